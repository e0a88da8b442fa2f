"""Attention against a KV cache on the GPU: paged K / V (`ws.paged`) and per-sequence key
lengths (`ws.key_lengths`), through `ws.compile`'s per-shape choice, against the torch reference
in fp32; outputs poisoned with NaN first."""

import pytest
import torch

import wsched as ws

from attention_fusions import make_paged_attention, paged_inputs
from test_gpu_attention import run

pytestmark = pytest.mark.gpu

_compiled = {}


def compiled(d, page_size, causal):
    key = (d, page_size, causal)
    if key not in _compiled:
        f = make_paged_attention(d, page_size, causal=causal, lse=True)
        _compiled[key] = (f, ws.compile(f))
    return _compiled[key]


def check(f, k, inputs):
    o, lse = run(f, k, inputs)
    ro, rlse = f.reference(*inputs)
    seen = torch.isfinite(rlse)
    assert torch.equal(seen, torch.isfinite(lse)), "sequences with no key differ"
    assert not torch.isnan(o).any() and (o[~seen] == 0).all()   # the reference's O there is 0 / 0
    err_o = float((o[seen].float() - ro[seen].float()).norm() / ro[seen].float().norm())
    err_lse = float((lse[seen] - rlse[seen]).norm() / rlse[seen].norm())
    assert err_o < 1e-2 and err_lse < 1e-3, (err_o, err_lse)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("s, lens", [
    (1, [1, 127, 8193, 0]), (3, [3, 4097, 200]), (16, [1000, 16, 5000]), (64, [20000, 64])])
def test_paged_decode_matches_torch(page_size, s, lens):
    f, k = compiled(128, page_size, True)
    inputs = paged_inputs(lens, page_size, 128, hk=8, g=4, s=s, seed=page_size + s, device="cuda")
    check(f, k, inputs)


@pytest.mark.parametrize("hk, g", [(32, 1), (2, 8)])
def test_paged_mha_and_wide_groups(hk, g):
    f, k = compiled(64, 16, False)
    inputs = paged_inputs([3000, 1, 777] * 3, 16, 64, hk=hk, g=g, seed=hk, device="cuda")
    check(f, k, inputs)


@pytest.mark.parametrize("lens, s", [([4621], 1), ([1172, 30000], 1), ([3000, 1], 3)])
def test_paged_one_kv_head_deals_its_rows_to_idle_sms(lens, s):
    """MQA against a paged cache: 32 query heads of one KV head, few sequences: the splits leave
    SMs idle and each sequence's 32 x S rows go to tiles of whole merge chunks."""
    f, k = compiled(128, 16, True)
    inputs = paged_inputs(lens, 16, 128, hk=1, g=32, s=s, seed=len(lens) + s, device="cuda")
    chosen = k.kernel_for(*inputs)
    _, scalars, _ = chosen._bind_inputs(inputs)
    params = chosen._host_params(scalars, torch.cuda.get_device_properties(0).multi_processor_count)
    assert params["splits"] > 1 and params["tile_rows"] < 64
    check(f, k, inputs)


def test_paged_prefill_chunk_against_its_cache():
    """A chunk of 700 new tokens of each sequence at the end of its cache (128-row tiles)."""
    f, k = compiled(128, 64, True)
    inputs = paged_inputs([700, 3000, 1500], 64, 128, hk=4, g=2, s=700, seed=9, device="cuda")
    check(f, k, inputs)


@pytest.mark.parametrize("d, page_size, hk, g, s, lens", [
    (128, 16, 4, 2, 134, [4779, 4515, 3962]), (128, 32, 4, 1, 188, [2373, 2373]),
    (128, 64, 4, 1, 188, [2373, 2373]), (256, 16, 4, 8, 119, [1774, 823, 5128])])
def test_paged_chunks_on_two_consumer_warpgroups_with_pages_shorter_than_a_block(d, page_size, hk, g, s, lens):
    """Chunks of more than 64 queries. `ws.compile`'s choice where the 128-row tiles fill at most
    half the SMs: 64-row tiles on one consumer warpgroup. And the 128-row tiles on two (with
    split-KV where the kernel takes it; not at head dim 256), whose producer needs 32 or more
    registers for its page indices: these hung (GPU fuzzer, seed 3) while the consumers asked for
    240 registers each: 128 x 32 + 256 x 240 is more than the CTA holds."""
    f, k = compiled(d, page_size, True)
    inputs = paged_inputs(lens, page_size, d, hk=hk, g=g, s=s, seed=page_size + s, device="cuda")
    chosen = k.kernel_for(*inputs).schedule
    few = 2 * len(lens) * hk * g * -(-s // 128) <= torch.cuda.get_device_properties(0).multi_processor_count
    assert (chosen.tile[0], chosen.consumer_warpgroups, chosen.pack_gqa) == (
        (64, 1, False) if few and d != 256 else (128, 2, False))   # value dim 256: 128-row tiles
    check(f, k, inputs)
    two = ws.compile(f, ws.schedule_for(f, **({} if d == 256 else {"split_kv": 32})))
    assert two.schedule.consumer_warpgroups == 2 and two.schedule.producer_registers >= 32
    assert two.schedule.consumer_registers <= 232
    check(f, two, inputs)


def test_a_block_table_entry_past_the_cache_reads_zeros(monkeypatch):
    """A bad page index must not read outside the cache: TMA fills the box with zeros, as the
    reference reads it. With WSCHED_CHECK_INPUTS=1 the call refuses it instead."""
    f, k = compiled(128, 16, False)
    inputs = paged_inputs([64, 64], 16, 128, hk=8, g=4, seed=1, device="cuda")
    inputs[3][1, 2] = 1 << 20
    o, lse = run(f, k, inputs)
    ro, rlse = f.reference(*inputs)
    assert float((o.float() - ro.float()).norm() / ro.float().norm()) < 1e-2
    assert float((lse - rlse).norm() / rlse.norm()) < 1e-3
    monkeypatch.setenv("WSCHED_CHECK_INPUTS", "1")
    checked = ws.compile(f)
    with pytest.raises(ws.FusionError, match=r"block_table\[1, 2\] = 1048576 \(keys 32.. of sequence 1\) is not "
                                             r"a page of k_cache"):
        checked(*inputs)


@pytest.mark.parametrize("name", ["key_bias_lengths", "documents_lengths"])
def test_inputs_per_key_beside_key_lengths(name):
    """A bias and document ids per key, as long as the cache, beside per-sequence key lengths."""
    import test_attention_paged as cpu

    f = getattr(cpu, name)
    inputs = [t.cuda() for t in cpu.per_key_inputs(f, B=3, H=4, S=1000, T=3000, lens=(3000, 1377, 5))]
    check(f, ws.compile(f), inputs)
