"""FMHA forward on the GPU against the torch reference and torch SDPA; outputs poisoned first."""

import pytest
import torch
import torch.nn.functional as F

import wsched as ws

from attention_fusions import (VARIANTS, attention_inputs, biased_inputs, make_attention, make_biased, make_variant,
                               union_mask, variant_inputs)

pytestmark = pytest.mark.gpu

_compiled = {}


def compiled(D, causal=False, lse=False, gqa=False, dtype=ws.bf16):
    key = (D, causal, lse, gqa, dtype.name)
    if key not in _compiled:
        f = make_attention(D, causal=causal, lse=lse, gqa=gqa, dtype=dtype)
        _compiled[key] = (f, ws.compile(f))
    return _compiled[key]


def run(f, k, inputs):
    outs = k._outputs(f.bind(*inputs), "cuda")
    for t in outs.values():
        t.fill_(float("nan"))
    k(*inputs, out=outs)
    k.synchronize()
    return list(outs.values())


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_bottom_right(f, k, inputs, excess):
    """O and LSE of a bottom-right causal kernel against the reference; with S - T = `excess`
    > 0 the first `excess` rows see no key and store O = 0, LSE = -inf."""
    o, lse = run(f, k, inputs)
    ro, rlse = f.reference(*inputs)
    hidden = max(excess, 0)
    assert (o[..., :hidden, :] == 0).all() and torch.isneginf(lse[..., :hidden]).all()
    assert rel(o[..., hidden:, :], ro[..., hidden:, :]) < 1e-2
    assert rel(lse[..., hidden:], rlse[..., hidden:]) < 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("S", [1000, 2048])
def test_mha_vs_reference_and_sdpa(D, causal, S):
    f, k = compiled(D, causal=causal, lse=True)
    q, kk, v = attention_inputs(2, 4, S, S, D, device="cuda", seed=D + S)
    o, lse = run(f, k, (q, kk, v))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    ro, rlse = f.reference(q, kk, v)
    assert rel(o, ro) < 1e-2
    assert rel(lse, rlse) < 1e-3
    assert rel(o, F.scaled_dot_product_attention(q, kk, v, is_causal=causal)) < 1e-2


@pytest.mark.parametrize("gqa, B, H, S, T, warpgroups", [(False, 4, 8, 1500, 1700, 3), (True, 2, 32, 1500, 2500, 3),
                                                         (False, 3, 12, 2000, 1025, 3), (False, 4, 16, 420, 333, 2)])
def test_head_dim_64_with_long_keys_runs_192_row_tiles_on_three_warpgroups(gqa, B, H, S, T, warpgroups):
    """At head dim 64 with no causal or window mask and T >= 1024, 192-row tiles on 3 consumer
    warpgroups (schedule.THREE_WARPGROUP_HEAD_DIMS), rows and keys no multiple of the tile,
    more tiles than SMs; O and LSE against the reference, outputs poisoned."""
    f, k = compiled(64, lse=True, gqa=gqa)
    q, kk, v = attention_inputs(B, H, S, T, 64, device="cuda", seed=S, gqa_groups=4 if gqa else None)
    assert k.kernel_for(q, kk, v).schedule.consumer_warpgroups == warpgroups
    o, lse = run(f, k, (q, kk, v))
    ro, rlse = f.reference(q, kk, v)
    assert not torch.isnan(o).any() and rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3


@pytest.mark.parametrize("variant, B, S, T", [("causal", 1, 5200, 5200), ("bottom_right", 2, 3000, 6000),
                                              ("softcap", 1, 5121, 5121), ("sinks", 1, 5500, 5500)])
def test_long_causal_head_dim_64_runs_192_row_tiles_on_three_warpgroups(variant, B, S, T):
    """Causal masks only (top-left, bottom-right with S < T, under softcap, with sinks) and
    T >= THREE_WARPGROUP_MIN_KEYS["causal"]: the 3-warpgroup kernel; O and LSE against the
    reference, outputs poisoned."""
    if variant in ("causal", "bottom_right"):
        f, k = compiled(64, causal=True if variant == "causal" else "bottom_right", lse=True)
        inputs = attention_inputs(B, 8, S, T, 64, device="cuda", seed=S)
    else:
        f, k = compiled_variant(64, variant)
        inputs = variant_inputs(f, B, 8, S, T, 64, device="cuda", seed=S)
    assert k.kernel_for(*inputs).schedule.consumer_warpgroups == 3
    check_variant(f, k, inputs)


@pytest.mark.parametrize("D", [96, 192])
@pytest.mark.parametrize("S,T", [(1, 1500), (777, 1200), (1200, 777)])
def test_head_dims_96_and_192_with_gqa_ragged(D, S, T):
    """Q/K 96 (three 64-byte swizzled chunks) and 192 with V 128, K/V broadcast over 4 groups."""
    f, k = compiled(D, causal="bottom_right", lse=True, gqa=True)
    check_bottom_right(f, k, attention_inputs(2, 8, S, T, D, device="cuda", seed=S + D, gqa_groups=4), S - T)


@pytest.mark.parametrize("S,T", [(1, 4097), (1, 128), (77, 1000), (300, 129)])
def test_decode_and_ragged_lengths(S, T):
    f, k = compiled(128)
    q, kk, v = attention_inputs(3, 5, S, T, 128, device="cuda", seed=S + T)
    (o,) = run(f, k, (q, kk, v))
    assert not torch.isnan(o).any()
    assert rel(o, F.scaled_dot_product_attention(q, kk, v)) < 1e-2


@pytest.mark.parametrize("groups", [4, 16])
def test_gqa_and_mqa(groups):
    f, k = compiled(128, causal=True, gqa=True)
    B, H, S = 2, 16, 1000
    q, kk, v = attention_inputs(B, H, S, S, 128, device="cuda", seed=groups, gqa_groups=groups)
    (o,) = run(f, k, (q, kk, v))
    ref = F.scaled_dot_product_attention(q.reshape(B, H, S, 128), kk.squeeze(2), v.squeeze(2),
                                         is_causal=True, enable_gqa=True)
    assert rel(o.reshape(B, H, S, 128), ref) < 1e-2


@pytest.mark.parametrize("S,T", [(1, 4097), (2000, 700), (700, 2000)])
def test_bottom_right_causal_kv_cache(S, T):
    f, k = compiled(128, causal="bottom_right", lse=True)
    check_bottom_right(f, k, attention_inputs(2, 4, S, T, 128, device="cuda", seed=S), S - T)


@pytest.mark.parametrize("D", [64, 128])
def test_pingpong_schedule(D):
    f = make_attention(D, causal=True, lse=True)
    k = ws.compile(f, mode="pingpong")
    q, kk, v = attention_inputs(2, 4, 1000, 1000, D, device="cuda", seed=D)
    o, lse = run(f, k, (q, kk, v))
    assert rel(o, F.scaled_dot_product_attention(q, kk, v, is_causal=True)) < 1e-2
    assert rel(lse, f.reference(q, kk, v)[1]) < 1e-3


def test_fp16():
    f, k = compiled(64, causal=True, dtype=ws.f16)
    q, kk, v = attention_inputs(2, 4, 700, 700, 64, device="cuda", dtype=torch.float16)
    (o,) = run(f, k, (q, kk, v))
    assert rel(o, F.scaled_dot_product_attention(q, kk, v, is_causal=True)) < 1e-2


# --- score functions and masks written in the DSL (issue 11) ---------------------------------

_variants = {}


def compiled_variant(D, variant, gqa=False, window=100):
    key = (D, variant, gqa, window)
    if key not in _variants:
        f = make_variant(D, variant, gqa=gqa, window=window)
        _variants[key] = (f, ws.compile(f))
    return _variants[key]


def check_variant(f, k, inputs):
    """Outputs poisoned, then O and LSE against the reference; rows that see no key store O = 0
    and LSE = -inf (the reference has NaN there)."""
    o, lse = run(f, k, inputs)
    ro, rlse = f.reference(*inputs)
    seen = torch.isfinite(rlse)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    assert rel(o[seen], ro[seen]) < 1e-2
    assert rel(lse[seen], rlse[seen]) < 1e-3
    return o, lse


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128])
def test_score_function_variants(D, variant):
    f, k = compiled_variant(D, variant)
    check_variant(f, k, variant_inputs(f, 2, 4, 1000, 1000, D, device="cuda", seed=D + len(variant)))


@pytest.mark.parametrize("D", [64, 96, 128, 192])
@pytest.mark.parametrize("variant", ["softcap", "softcap_window"])
def test_softcap_where_tanh_saturates(D, variant):
    """Scores beyond twice the cap, so tanh.approx (max relative error 2^-11) runs over its whole
    curve into saturation: O and LSE against the fp32 reference, and LSE within 1e-2 everywhere."""
    f, k = compiled_variant(D, variant)
    q, kk, v = variant_inputs(f, 2, 4, 1000, 1000, D, device="cuda", seed=D)
    inputs = ((q.float() * 12).to(q.dtype), kk, v)     # scores ~ N(0, 144): |s| up to ~60 > 30
    check_variant(f, k, inputs)
    lse = run(f, k, inputs)[1]
    rlse = f.reference(*inputs)[1]
    seen = torch.isfinite(rlse)
    assert float((lse[seen] - rlse[seen]).abs().max()) < 1e-2


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("variant", ["softcap", "softcap_window"])
def test_bounded_scores_at_the_floor_of_their_range(D, variant):
    """Softcapped scores take exp2 against their bound 30 (loops.fixed_row_max): heads whose every
    score sits near -28 (P ~ 2^-84 after ex2.approx.ftz, bf16 P into the wgmma) and heads near +28,
    O and LSE against the fp32 reference."""
    f, k = compiled_variant(D, variant)
    q, kk, v = variant_inputs(f, 2, 4, 1000, 1000, D, device="cuda", seed=D + 1)
    u = torch.full((D,), D ** -0.5, device="cuda")                     # a unit vector
    kk = (0.05 * kk.float() + u).to(kk.dtype)                           # every key along u
    sign = torch.tensor([-1.0, 1.0, -1.0, 1.0], device="cuda").reshape(1, 4, 1, 1)
    q = (sign * 50 * D ** 0.5 * u).expand(2, 4, 1000, D).to(q.dtype)    # scores ~ -+50 before the cap
    _, lse = check_variant(f, k, (q, kk, v))
    assert float(lse[:, 0].max()) < -20 < 20 < float(lse[:, 1].min())


@pytest.mark.parametrize("variant, S, T", [("window", 777, 1200), ("alibi", 1200, 777), ("document", 1, 1500),
                                           ("softcap_window", 1000, 300), ("document_causal", 513, 513)])
def test_score_function_variants_gqa_and_ragged(variant, S, T):
    f, k = compiled_variant(128, variant, gqa=True)
    check_variant(f, k, variant_inputs(f, 2, 8, S, T, 128, device="cuda", seed=S, gqa_groups=4))


def test_sliding_window_skips_blocks_at_length_4096():
    f, k = compiled_variant(128, "window", window=1024)
    check_variant(f, k, variant_inputs(f, 1, 2, 4096, 4096, 128, device="cuda", seed=7))


def test_rows_of_a_document_no_key_belongs_to():
    f, k = compiled_variant(128, "document")
    q, kk, v, doc_q, doc_k = variant_inputs(f, 2, 4, 900, 900, 128, device="cuda", seed=5)
    doc_q[..., 100:300, :] = 99
    check_variant(f, k, (q, kk, v, doc_q, doc_k))


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_document_masks_skip_the_blocks_their_ids_cannot_see(order):
    """Many documents of 1..~400 tokens (most kv blocks outside a tile's span table), and keys
    whose ids are shuffled (the table's hull keeps blocks no row sees: still masked right)."""
    f, k = compiled_variant(128, "document_causal" if order == "sorted" else "document")
    q, kk, v, doc_q, doc_k = variant_inputs(f, 2, 4, 3000, 2900, 128, device="cuda", seed=11, documents=24)
    if order == "shuffled":
        doc_k = doc_k[..., torch.randperm(2900, device="cuda")].contiguous()
    check_variant(f, k, (q, kk, v, doc_q, doc_k))


def test_document_ids_beyond_fp32s_integers():
    """Ids 2**30 + d (one value as fp32) and shuffled keys (masked blocks): the table and the mask
    compare the i32 ids exactly, so the output is that of the same documents numbered 0, 1, ..."""
    f, k = compiled_variant(128, "document")
    q, kk, v, doc_q, doc_k = variant_inputs(f, 2, 4, 1500, 1500, 128, device="cuda", seed=13, documents=6)
    doc_k = doc_k[..., torch.randperm(1500, device="cuda")].contiguous()
    o_small, _ = check_variant(f, k, (q, kk, v, doc_q, doc_k))
    o_big, _ = check_variant(f, k, (q, kk, v, doc_q + 2**30, doc_k + 2**30))
    assert torch.equal(o_big, o_small)


def test_per_key_positions_beyond_fp32s_integers():
    """A per-key absolute position 2**28 + 3 + p (keys shuffled), its offset subtracted and
    compared with the query's position: i32 arithmetic on the GPU, the position cast to i32."""
    base = 2**28 + 3

    def positioned(q: ws.Tensor[ws.bf16, "B", "H", "S", 128], k: ws.Tensor[ws.bf16, "B", "H", "T", 128],
                   v: ws.Tensor[ws.bf16, "B", "H", "T", 128], pos_k: ws.Tensor[ws.i32, "B", 1, 1, "T"]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 128 ** -0.5
        i, _ = ws.positions(s)
        s = ws.where(pos_k - base <= i, s, -ws.inf)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)

    f = ws.fusion(positioned)
    q, kk, v = attention_inputs(2, 4, 700, 900, 128, device="cuda", seed=8)
    pos_k = torch.stack([torch.randperm(900, device="cuda") for _ in range(2)]).to(torch.int32) + base
    check_variant(f, ws.compile(f), (q, kk, v, pos_k.reshape(2, 1, 1, 900).contiguous()))


@pytest.mark.parametrize("S, T, rows, cols", [(1, 1, 128, 128), (300, 129, 64, 128), (4096, 4000, 128, 128),
                                         (130, 70000, 128, 128)])
def test_the_spans_table_on_the_gpu_is_the_simulators(S, T, rows, cols):
    """The helper kernel's table (codegen/block_spans.py) equals the definition the simulator
    runs (lowering/block_spans.py): ids in any order, sorted ids, broadcast batch dims, strided."""
    import math

    from wsched.codegen.block_spans import block_spans_cuda
    from wsched.lowering.block_spans import block_spans

    for order in ("random", "sorted"):
        q = torch.randint(0, 6, (3, 1, S, 1), dtype=torch.int32, device="cuda")
        k = torch.randint(0, 6, (1, 2, 2 * T, 1), dtype=torch.int32, device="cuda")[:, :, ::2].transpose(-1, -2)
        if order == "sorted":
            q, k = q.sort(dim=-2).values, k.sort(dim=-1).values
        shape = (3, 2, math.ceil(S / rows), 4)
        assert torch.equal(block_spans_cuda(q, k, rows, cols, shape), block_spans(q, k, rows, cols, shape))


def test_a_document_mask_joined_to_a_causal_condition():
    """where((doc_q == doc_k) & (j <= i), ...): spans bound the kv range, the mask runs on every
    block (a block full for the ids is not full for the causal condition)."""
    def joined(q: ws.Tensor[ws.bf16, "B", "H", "S", 128], k: ws.Tensor[ws.bf16, "B", "H", "T", 128],
               v: ws.Tensor[ws.bf16, "B", "H", "T", 128], doc_q: ws.Tensor[ws.i32, "B", 1, "S", 1],
               doc_k: ws.Tensor[ws.i32, "B", 1, 1, "T"]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 128 ** -0.5
        i, j = ws.positions(s)
        s = ws.where((doc_q == doc_k) & (j <= i), s, -ws.inf)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
    f = ws.fusion(joined)
    k = ws.compile(f)
    check_variant(f, k, variant_inputs(make_variant(128, "document"), 2, 4, 1500, 1500, 128, device="cuda", seed=3,
                                       documents=3))


def test_a_bound_call_reads_the_document_ids_as_they_are_at_each_launch():
    """k.bind(...) computes the spans table again per launch: ids refilled in place between
    launches change which blocks are visited."""
    f, k = compiled_variant(128, "document")
    q, kk, v, doc_q, doc_k = variant_inputs(f, 1, 2, 1024, 1024, 128, device="cuda", seed=2, documents=8)
    call = k.bind(q, kk, v, doc_q, doc_k)
    for documents in (8, 2, 16):
        _, _, _, new_q, new_k = variant_inputs(f, 1, 2, 1024, 1024, 128, device="cuda", seed=documents,
                                               documents=documents)
        doc_q.copy_(new_q)
        doc_k.copy_(new_k)
        for t in call.outputs.values():
            t.fill_(float("nan"))
        o, lse = call()
        call.synchronize()
        ro, rlse = f.reference(q, kk, v, doc_q, doc_k)
        assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3, documents


def test_repeated_document_calls_launch_their_spans_helper_natively():
    """From a layout's third call on, the native launch path runs the spans helper and then the
    kernel (codegen/native.py): ids refilled in place between calls change the visited blocks,
    and every call's outputs match the reference."""
    from wsched.codegen import native

    f, k = compiled_variant(128, "document")
    q, kk, v, doc_q, doc_k = variant_inputs(f, 2, 2, 1100, 1100, 128, device="cuda", seed=4, documents=8)
    for documents in (8, 2, 16, 5):
        _, _, _, new_q, new_k = variant_inputs(f, 2, 2, 1100, 1100, 128, device="cuda", seed=documents,
                                               documents=documents)
        doc_q.copy_(new_q)
        doc_k.copy_(new_k)
        out = {"o": torch.full_like(q, float("nan")), "lse": torch.full(q.shape[:-1], float("nan"), device="cuda")}
        o, lse = k(q, kk, v, doc_q, doc_k, out=out)
        ro, rlse = f.reference(q, kk, v, doc_q, doc_k)
        assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3, documents
    if native.available():
        assert k._natives[("o", "lse")].stats()["hits"] == 2


@pytest.mark.parametrize("kind, D, S, T", [("prefix_lm", 128, 2000, 2000), ("prefix_lm", 64, 700, 3001),
                                           ("streaming", 128, 3000, 3000), ("streaming", 64, 3000, 1000),
                                           ("prefix_window", 128, 1500, 1500)])
def test_a_union_of_analysed_masks(kind, D, S, T):
    """A prefix LM and a sliding window with sink tokens (two runs of kv blocks per tile)."""
    key = ("union", kind, D)
    if key not in _variants:
        f = union_mask(D, kind, prefix=700, window=512, sinks=4)
        _variants[key] = (f, ws.compile(f))
    f, k = _variants[key]
    check_variant(f, k, attention_inputs(2, 4, S, T, D, device="cuda", seed=S + D))


@pytest.mark.parametrize("S, T", [(1, 8193), (5, 3000), (8192, 8192)])
def test_a_bias_along_the_diagonal(S, T):
    """ALiBi spelt as two terms, bottom-right causal: the decode shapes run split-KV (each split's
    LSE without the row part, the merge adds it once); at 8192 positions the scores stay within
    the bf16 tolerance (the kernel adds w (j - r), small near the diagonal, not w j)."""
    key = ("biased",)
    if key not in _variants:
        f = make_biased(lambda s, i, j, u, p: s + u * (j - i) - 0.5 * (i - j), d=128, align="bottom_right")
        _variants[key] = (f, ws.compile(f))
    f, k = _variants[key]
    check_variant(f, k, biased_inputs(1, 4, S, T, 128, seed=S, device="cuda"))
