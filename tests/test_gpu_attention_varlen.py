"""Attention over packed sequences (`ws.varlen` / `ws.packed`) on the GPU, against a
per-sequence fp32 reference (each sequence's own Q K^T, mask, softmax, P V); outputs poisoned
with NaN first: every packed row must be written, by the tile of its own sequence only."""

import math

import pytest
import torch

import wsched as ws

from attention_fusions import make_varlen_attention, varlen_inputs
from test_gpu_attention import run

pytestmark = pytest.mark.gpu

_compiled = {}


def compiled(d, causal, gqa=False):
    key = (d, causal, gqa)
    if key not in _compiled:
        f = make_varlen_attention(d, causal=causal, gqa=gqa)
        _compiled[key] = (f, ws.compile(f))
    return _compiled[key]


def per_sequence(q, k, v, cu_q, cu_k, causal):
    """O and LSE of each sequence on its own, in fp32, packed like q."""
    d = q.shape[-1]
    o = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    heads = q.shape[1:-1]
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue   # no query, or no key: O = 0, LSE = -inf
        qs = q[q0:q1].float().reshape(q1 - q0, -1, d).transpose(0, 1)          # [H, S, D]
        ks = k[k0:k1].float().expand(k1 - k0, *heads, d).reshape(k1 - k0, -1, d).transpose(0, 1)
        vs = v[k0:k1].float().expand(k1 - k0, *heads, v.shape[-1]).reshape(k1 - k0, -1, v.shape[-1]).transpose(0, 1)
        s = qs @ ks.transpose(-1, -2) / math.sqrt(d)
        if causal:
            shift = (k1 - k0) - (q1 - q0) if causal == "bottom_right" else 0
            i = torch.arange(q1 - q0, device=q.device)[:, None]
            j = torch.arange(k1 - k0, device=q.device)[None, :]
            s = s.masked_fill(j > i + shift, float("-inf"))
        l = torch.logsumexp(s, -1)                                             # [H, S]
        p = torch.exp(s - l[..., None]).nan_to_num(0.0)
        o[q0:q1] = (p @ vs).transpose(0, 1).reshape(q1 - q0, *heads, v.shape[-1])
        lse[q0:q1] = l.transpose(0, 1).reshape(q1 - q0, *heads)
    return o, lse


def check(f, k, inputs, causal):
    o, lse = run(f, k, inputs)
    ro, rlse = per_sequence(*inputs, causal)
    seen = torch.isfinite(rlse)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "packed rows never written"
    assert torch.equal(seen, torch.isfinite(lse)), "rows that see no key differ"
    assert (o[~seen] == 0).all()
    err_o = float((o[seen].float() - ro[seen]).norm() / ro[seen].norm())
    err_lse = float((lse[seen] - rlse[seen]).norm() / rlse[seen].norm())
    assert err_o < 1e-2 and err_lse < 1e-3, (err_o, err_lse)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_ragged_sequences(causal):
    f, k = compiled(128, causal)
    inputs = varlen_inputs([1, 127, 8193, 0, 300, 2048], [1, 500, 8193, 7, 0, 2047], 8, 128, seed=1, device="cuda")
    check(f, k, inputs, causal)


def test_gqa_with_many_short_sequences():
    # 64 sequences of 1..600 rows: a 7-step search per tile, more tiles than SMs
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 600, (64,), generator=g).tolist()
    f, k = compiled(128, "bottom_right", gqa=True)
    check(f, k, varlen_inputs(lens, lens, 32, 128, kv_heads=8, seed=2, device="cuda"), "bottom_right")


@pytest.mark.parametrize("d", [64, 96, 256])
def test_head_dims(d):
    f, k = compiled(d, True)
    check(f, k, varlen_inputs([513, 64, 1, 1000], [513, 64, 1, 1000], 4, d, seed=d, device="cuda"), True)


@pytest.mark.parametrize("page_size", [16, 256, None])
def test_packed_chunks_against_a_paged_cache(page_size):
    """A mixed batch: chunks of 0..700 new tokens per sequence against caches of 0..5000 keys
    (bottom-right causal per sequence), GQA 8/2."""
    from attention_fusions import make_varlen_paged_attention, varlen_paged_inputs

    key = ("paged", page_size)
    if key not in _compiled:
        f = make_varlen_paged_attention(128, page_size)
        _compiled[key] = (f, ws.compile(f))
    f, k = _compiled[key]
    inputs = varlen_paged_inputs([1, 700, 0, 64, 129, 1], [4000, 700, 9, 0, 5000, 1], page_size, 128, hk=2, g=4,
                                 seed=page_size or 7, device="cuda")
    o, lse = run(f, k, inputs)
    ro, rlse = f.reference(*inputs)
    seen = torch.isfinite(rlse)
    assert not torch.isnan(o).any() and torch.equal(seen, torch.isfinite(lse)) and (o[~seen] == 0).all()
    err_o = float((o[seen].float() - ro[seen].float()).norm() / ro[seen].float().norm())
    err_lse = float((lse[seen] - rlse[seen]).norm() / rlse[seen].norm())
    assert err_o < 1e-2 and err_lse < 1e-3, (err_o, err_lse)
