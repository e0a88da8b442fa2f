"""Attention against a KV cache: per-sequence key lengths (`ws.key_lengths`) and paged K / V
(`ws.paged`: [pages, page_size, HK, D] caches through a block table), on the CPU simulator
against the torch reference (outputs poisoned with NaN first), the IR the producer gets, and the
errors for what a cache cannot be."""


import re

import pytest
import torch

import wsched as ws
from wsched.errors import FusionError
from wsched.schedule import ScheduleError
from wsched.workloads.attention.schedule import MAX_SPLIT_KV

from attention_fusions import make_paged_attention
from attention_fusions import paged_inputs as attention_paged_inputs

D = 64


def make_paged(page_size: int, causal: bool = True, lengths: bool = True):
    return make_paged_attention(D, page_size, causal=causal, lengths=lengths, lse=True)


@ws.fusion
def cache_seqlens(q: ws.Tensor[ws.bf16, "B", "HK", "G", "S", D], k: ws.Tensor[ws.bf16, "B", "HK", 1, "T", D],
                  v: ws.Tensor[ws.bf16, "B", "HK", 1, "T", D], seq_lens: ws.Tensor[ws.i32, "B"]):
    s = ws.causal_mask(ws.key_lengths(ws.matmul(q, k.transpose(-1, -2)) * D ** -0.5, seq_lens), align="bottom_right")
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


def paged_inputs(lens, page_size, **kw):
    return attention_paged_inputs(lens, page_size, D, **kw)


def compiled(fusion, **overrides):
    schedule = ws.schedule_for(fusion, **overrides)
    return ws.CompiledKernel(fusion, schedule, ws.partition(fusion, schedule), ws.lower(fusion, schedule),
                             cuda_source="")


def check(kernel, fusion, inputs, num_sms=8, seed=0):
    got = kernel.simulate(*inputs, num_sms=num_sms, seed=seed)
    want = fusion.reference(*inputs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert not torch.isnan(g.float()).any(), "outputs never written (poisoned with NaN)"
        # a row that sees no key: the reference's softmax is 0 / 0 (NaN), the kernel's O is 0; LSE -inf
        assert (g[torch.isnan(w)] == 0).all(), "O of a row that sees no key is not 0"
        assert torch.equal(torch.isneginf(w), torch.isneginf(g)), "LSE of rows that see no key differ"
        finite = torch.isfinite(w)
        if finite.any():
            err = float((g.float()[finite] - w.float()[finite]).norm() / w.float()[finite].norm().clamp_min(1e-30))
            assert err < 1e-2, err


DECODE = dict(tile=(64, 128, D), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV, pack_gqa=True)


@pytest.mark.parametrize("page_size, lens, s", [
    (16, [1, 127, 300], 1),       # 8 pages a kv block; one-key and ragged sequences
    (64, [200, 0, 65], 3),        # an empty sequence: O = 0, LSE = -inf; 3 queries bottom-right
    (256, [1100, 129], 16),       # half a page a kv block; 1100 keys: 9 blocks
])
def test_paged_decode_matches_torch(page_size, lens, s):
    fusion = make_paged(page_size)
    kernel = compiled(fusion, **DECODE)
    check(kernel, fusion, paged_inputs(lens, page_size, s=s, seed=page_size))


def test_paged_split_kv_merges_each_sequence_over_its_own_keys():
    """One long sequence next to short ones on many SMs: the long one's keys split, the splits
    of a short one past its keys run no block."""
    fusion = make_paged(32)
    kernel = compiled(fusion, **DECODE)
    inputs = paged_inputs([2100, 40, 1], 32, hk=1, g=4, seed=3)
    _, scalars, _ = kernel._bind_inputs(inputs)
    assert kernel._host_params(scalars, 8)["splits"] == 2
    check(kernel, fusion, inputs, num_sms=8)


@pytest.mark.parametrize("lens, g, s, num_sms", [([2100, 700], 16, 2, 32), ([1500, 3], 32, 1, 24)])
def test_paged_split_tiles_deal_their_rows_to_idle_sms(lens, g, s, num_sms):
    """One KV head, 32 query rows (two merge chunks of 16 at head dim 64): the splits leave SMs
    idle, so each sequence's rows go to two tiles of 16, both walking the sequence's pages."""
    fusion = make_paged(32)
    kernel = compiled(fusion, **DECODE)
    inputs = paged_inputs(lens, 32, hk=1, g=g, s=s, seed=num_sms)
    _, scalars, _ = kernel._bind_inputs(inputs)
    params = kernel._host_params(scalars, num_sms)
    assert (params["splits"], params["tile_rows"]) == (6, 16)
    check(kernel, fusion, inputs, num_sms=num_sms)


@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_tiles_without_packing(causal):
    """128-row tiles, two consumer warpgroups, 64-row pages: a chunk of 150 new tokens against
    caches of 150 and 400 keys."""
    fusion = make_paged(64, causal=causal)
    kernel = compiled(fusion, tile=(128, 128, D))
    check(kernel, fusion, paged_inputs([150, 400], 64, hk=2, g=1, s=150, seed=5), num_sms=6)


def test_paged_without_lengths_reads_every_page_of_the_table():
    fusion = make_paged(16, lengths=False)
    kernel = compiled(fusion, **DECODE)
    inputs = paged_inputs([64, 48], 16, seed=7)[:4]
    check(kernel, fusion, inputs)


def test_contiguous_cache_with_per_sequence_lengths():
    """FlashAttention's cache_seqlens: one contiguous cache [B, HK, 1, T, D], each sequence
    holding its first seq_lens[b] keys (lengths 0 .. T)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(4, 2, 2, 2, D, generator=gen).bfloat16()
    k, v = (torch.randn(4, 2, 1, 700, D, generator=gen).bfloat16() for _ in range(2))
    lens = torch.tensor([700, 0, 1, 333], dtype=torch.int32)
    for overrides in (DECODE, dict(tile=(128, 128, D))):
        check(compiled(cache_seqlens, **overrides), cache_seqlens, [q, k, v, lens])


def test_ws_compile_picks_the_packed_decode_kernel_for_a_paged_cache():
    kernel = ws.compile(make_paged(16), build=False)
    inputs = paged_inputs([300, 5], 16, seed=2)
    chosen = kernel.choose(inputs, 132)           # as on a GPU of 132 SMs
    assert chosen.schedule.pack_gqa and chosen.schedule.splits_kv


def test_the_producer_reads_pages_from_the_block_table():
    """The IR: each 16-key slice's page from the table (clamped into its row), one box per slice
    and chunk into its rows of the kv block, a slice past the sequence's keys reading page P."""
    text = compiled(make_paged(16), **DECODE).ir
    assert "ld.global T_seq = seq_lens[b0]\n" in text
    assert "let T = max(min(T_seq, T_cache), 0)\n" in text
    assert "ld.global page7 = block_table[b0, min(((k + kv_first) * 128 + 112) / 16, MP - 1)]\n" in text
    assert ("tma.load K[s, 0] row(112) <- k_cache[select((k + kv_first) * 128 + 112 < T, page7, P), 0, b1, 0] "
            "bar(k_full[s])\n") in text
    assert "i32 T_cache = MP * 16, " in text
    assert "tensormap k_cache: bf16[P, 16, batch1, 64] box(1, 16, 1, 64) swizzle(128)" in text
    big = compiled(make_paged(256), **DECODE).ir      # half a page a block: the row within the page
    assert ("tma.load V[s, 0] <- v_cache[select((k + kv_first) * 128 < T, page0, P), (k + kv_first) * 128 % 256, "
            "b1, 0] bar(v_full[s])\n") in big


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [48, 1, 2])
def test_page_size_must_tile_a_kv_block(page_size):
    """The page size's rule, also where pages this small would have asked for more producer
    registers than a schedule takes (the registers are sized only for page sizes that fit)."""
    fusion = make_paged(page_size)
    with pytest.raises(ScheduleError, match=rf"page size {page_size}: TMA fills a kv block of 128 keys from whole "
                                            r"pages or slices of one page, in boxes of a multiple of 8 rows; the page "
                                            r"size must be a multiple of 8 that divides 128 or is a multiple of it"):
        ws.schedule_for(fusion, **DECODE) and ws.partition(fusion, ws.schedule_for(fusion, **DECODE))
    with pytest.raises(ScheduleError, match=rf"page size {page_size}: "):
        ws.compile(fusion, build=False)


@pytest.mark.parametrize("index", [3, 4])
def test_the_simulator_names_a_meta_index_input_before_reading_its_values(index):
    fusion = make_paged(16)
    inputs = paged_inputs([20, 5], 16)
    name = fusion.inputs[index].id
    inputs[index] = inputs[index].to("meta")
    with pytest.raises(ws.ArgumentError, match=re.escape(
            f"paged16_d64_causal_lse_bf16.simulate: argument '{name}' is on meta; the simulator runs on CPU "
            f"tensors with values (pass {name}.cpu(), or a CPU tensor for a meta one)")):
        compiled(fusion, **DECODE).simulate(*inputs, num_sms=2)


def test_a_block_table_entry_a_sequence_uses_must_name_a_page():
    fusion = make_paged(16)
    kernel = compiled(fusion, **DECODE)
    inputs = paged_inputs([20, 5], 16)
    inputs[3][0, 1] = inputs[1].shape[0]          # keys 16..19 of sequence 0
    with pytest.raises(FusionError, match=r"paged16_d64_causal_lse_bf16: block_table\[0, 1\] = 6 \(keys 16.. of "
                                          r"sequence 0\) is not a page of k_cache: block table entries a sequence "
                                          r"uses must lie in 0..5"):
        kernel.simulate(*inputs, num_sms=2)


def test_entries_past_a_sequences_pages_are_neither_checked_nor_read():
    """Tables are padded past a sequence's pages (-1, or anything): those entries are not checked
    and not read. Without lengths every entry is used and checked."""
    fusion = make_paged(16, causal=False)
    inputs = paged_inputs([20, 5], 16)
    inputs[3][1, 1] = -1
    check(compiled(fusion, **DECODE), fusion, inputs)
    fusion = make_paged(16, lengths=False, causal=False)
    inputs = paged_inputs([32], 16)[:4]
    inputs[3][0, 1] = 10_000
    with pytest.raises(FusionError, match=r"block_table\[0, 1\] = 10000 \(keys 16.. of sequence 0\)"):
        compiled(fusion, **DECODE).simulate(*inputs, num_sms=2)


def test_the_reference_reads_an_entry_outside_the_cache_as_a_page_of_zeros():
    """As the kernels' TMA does (the GPU test checks the kernel against it)."""
    fusion = make_paged(16, lengths=False, causal=False)
    inputs = paged_inputs([32], 16, hk=1, g=1)[:4]
    good = inputs[3].clone()
    inputs[3][0, 1] = 10_000
    zero_page = torch.zeros_like(inputs[1][:1])
    k2, v2 = torch.cat([inputs[1], zero_page]), torch.cat([inputs[2], zero_page])
    good[0, 1] = k2.shape[0] - 1
    got, want = fusion.reference(*inputs), fusion.reference(inputs[0], k2, v2, good)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_key_lengths_must_be_one_i32_per_sequence():
    with pytest.raises(FusionError, match=r"lengths must be an i32 fusion input of shape \[B\]"):
        @ws.fusion
        def bad(q: ws.Tensor[ws.bf16, "B", "H", "S", D], k: ws.Tensor[ws.bf16, "B", "H", "T", D],
                lens: ws.Tensor[ws.i32, "H"]):
            return ws.key_lengths(ws.matmul(q, k.transpose(-1, -2)), lens)


def test_key_lengths_inside_the_score_function_is_refused():
    @ws.fusion
    def inside(q: ws.Tensor[ws.bf16, "B", "H", "S", D], k: ws.Tensor[ws.bf16, "B", "H", "T", D],
               v: ws.Tensor[ws.bf16, "B", "H", "T", D], lens: ws.Tensor[ws.i32, "B"]):
        s = ws.tanh(ws.key_lengths(ws.matmul(q, k.transpose(-1, -2)), lens))
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16)
    with pytest.raises(ScheduleError, match=r"ws.key_lengths must wrap the score function from outside"):
        ws.schedule_for(inside) and ws.partition(inside, ws.schedule_for(inside))


def test_k_and_v_paged_by_two_tables_are_refused():
    @ws.fusion
    def two_tables(q: ws.Tensor[ws.bf16, "B", "HK", "G", "S", D], k_cache: ws.Tensor[ws.bf16, "P", 16, "HK", D],
                   v_cache: ws.Tensor[ws.bf16, "P", 16, "HK", D], k_table: ws.Tensor[ws.i32, "B", "MP"],
                   v_table: ws.Tensor[ws.i32, "B", "MP"]):
        s = ws.matmul(q, ws.paged(k_cache, k_table).transpose(-1, -2))
        return ws.matmul(ws.softmax(s, dim=-1), ws.paged(v_cache, v_table)).to(ws.bf16)
    with pytest.raises(ScheduleError, match=r"K and V must both be ws.paged\(...\) of one block table"):
        ws.partition(two_tables, ws.schedule_for(two_tables))


def test_lengths_beyond_the_cache_are_refused():
    fusion = make_paged(16)
    inputs = paged_inputs([20, 5], 16)
    inputs[4][0] = 33                              # two pages a sequence: 32 keys
    with pytest.raises(FusionError, match=r"seq_lens holds the length 33, outside 0..32 \(the keys the cache "
                                          r"holds\)"):
        fusion.reference(*inputs)
    with pytest.raises(FusionError, match=r"seq_lens\[0\] = 33: a sequence's length must lie in 0..32 \(the keys "
                                          r"its cache row holds\)"):
        compiled(fusion, **DECODE).simulate(*inputs, num_sms=2)


def test_pages_shorter_than_a_block_give_the_producer_registers_for_their_indices():
    """The default schedule raises producer_registers with the page slices a block holds; fewer
    would spill (measured), and an explicit schedule with fewer is refused."""
    fusion = make_paged(16)
    assert [ws.schedule_for(make_paged(p)).producer_registers for p in (16, 32, 64, 128, 256)] == [40, 32, 24, 24, 24]
    assert ws.schedule_for(fusion).consumer_registers == 232
    with pytest.raises(ScheduleError, match=r"pages of 16 keys, 128 keys a block: the producer holds the block's 8 "
                                            r"page indices from the table reads to the TMA issues; "
                                            r"producer_registers=24 spills, use producer_registers >= 40"):
        ws.partition(fusion, ws.schedule_for(fusion, producer_registers=24))


def _paged_kernels(head_dim, page_size):
    """The default kernel of a paged causal decode fusion and every per-call variant ws.compile may pick."""
    from wsched.workloads.attention import ATTENTION

    fusion = make_paged_attention(head_dim, page_size, causal=True, lse=True)
    default = ATTENTION.default_schedule(fusion)
    return fusion, [default] + [v.schedule for v in ATTENTION.variants(fusion, default)]


@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim, page_size", [(64, 16), (128, 16), (128, 256), (256, 16), (256, 32)])
def test_paged_kernels_build_without_spills(head_dim, page_size):
    """The producer's registers for the page indices (paged_producer_registers) and the split-KV
    schedules a paged cache refuses (PAGED_SPLIT_KV_SPILLS) keep every kernel free of spills: the
    default and the per-call variants."""
    from test_attention_variants import build_resources

    fusion, schedules = _paged_kernels(head_dim, page_size)
    assert len(schedules) == (2 if head_dim == 256 and page_size < 64 else 3)
    for schedule in schedules:
        resources = build_resources(ws.lower(fusion, schedule))
        assert resources.spill_stores == 0 and resources.spill_loads == 0, schedule.short()


def test_every_eighth_schedule_of_the_search_space_runs_a_paged_cache_in_the_simulator():
    """The autotuner may pick any schedule of the space (prefill side, decode side, per-call
    variants, each fitted to the paged producer): a spread of them against the reference on
    ragged sequences, one of them empty, with 3 queries each (bottom-right causal)."""
    fusion = make_paged(16)
    workload = ws.workload_for(fusion)
    space = list(workload.schedule_space(fusion))
    picked = space[::8]
    assert len(picked) >= 6 and any(s.consumer_warpgroups == 1 for s in picked) and any(s.splits_kv for s in picked)
    inputs = paged_inputs([300, 0, 77], 16, hk=2, g=2, s=3, seed=5)
    for schedule in picked:
        kernel = ws.CompiledKernel(fusion, schedule, ws.partition(fusion, schedule), ws.lower(fusion, schedule),
                                   cuda_source="")
        check(kernel, fusion, inputs, num_sms=6)


def test_a_paged_producer_leaves_the_consumers_too_few_registers_for_192_overlapped_keys():
    """Beside a 40-register paged producer the consumers have 232 registers: 192 keys a block
    with the softmax overlapped spilled 32 bytes (nvcc; the GPU fuzzer drew it); 128 builds."""
    fusion = make_paged_attention(128, 32, causal=True)
    with pytest.raises(ScheduleError, match=re.escape(
            "BN=192 keys per block with head dim 128 and the softmax overlapped (mma_inflight=1) needs more than the "
            "232 registers a consumer thread has beside a 40-register producer: ptxas spills; use BN <= 128 or "
            "mma_inflight=0")):
        ws.schedule_for(fusion, tile=(128, 192, 128))
    ws.schedule_for(fusion, tile=(128, 192, 128), mma_inflight=0)
    assert all(s.bn <= 128 for s in ws.workload_for(fusion).schedule_space(fusion) if s.mma_inflight)


# --- inputs per key beside per-sequence lengths -------------------------------------------------

@ws.fusion
def key_bias_lengths(q: ws.Tensor[ws.bf16, "B", "H", "S", D], k: ws.Tensor[ws.bf16, "B", "H", "T", D],
                     v: ws.Tensor[ws.bf16, "B", "H", "T", D], bias: ws.Tensor[ws.f32, "B", 1, 1, "T"],
                     seq_lens: ws.Tensor[ws.i32, "B"]):
    s = ws.key_lengths(ws.matmul(q, k.transpose(-1, -2)) * D ** -0.5 + bias, seq_lens)
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


@ws.fusion
def documents_lengths(q: ws.Tensor[ws.bf16, "B", "H", "S", D], k: ws.Tensor[ws.bf16, "B", "H", "T", D],
                      v: ws.Tensor[ws.bf16, "B", "H", "T", D], doc_q: ws.Tensor[ws.i32, "B", 1, "S", 1],
                      doc_k: ws.Tensor[ws.i32, "B", 1, 1, "T"], seq_lens: ws.Tensor[ws.i32, "B"]):
    s = ws.key_lengths(ws.matmul(q, k.transpose(-1, -2)) * D ** -0.5, seq_lens)
    s = ws.where(doc_q == doc_k, s, -ws.inf)
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


def per_key_inputs(fusion, B=2, H=2, S=130, T=300, lens=(300, 137), seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g).bfloat16() for n in (S, T, T))
    lens = torch.tensor(lens, dtype=torch.int32)
    if fusion is key_bias_lengths:
        return q, k, v, torch.randn(B, 1, 1, T, generator=g), lens
    doc_q = (torch.arange(S) * 3 // S).view(1, 1, S, 1).repeat(B, 1, 1, 1).int()
    doc_k = (torch.arange(T) * 3 // T).view(1, 1, 1, T).repeat(B, 1, 1, 1).int()
    return q, k, v, doc_q, doc_k, lens


@pytest.mark.parametrize("fusion", [key_bias_lengths, documents_lengths], ids=lambda f: f.name)
def test_inputs_per_key_span_the_cache_beside_key_lengths(fusion):
    """A bias per key and document ids per key are as long as the cache (`T_cache`), each sequence
    reading its first `seq_lens[b]`; a row whose document's keys lie past its sequence's length
    sees no key (O = 0, LSE = -inf)."""
    k = compiled(fusion)
    text = str(k.kernel)
    assert "i32 T_cache" in text and (": f32[batch0, 1, 1, T_cache]" in text or ": i32[batch0, 1, 1, T_cache]" in text)
    for seed in range(2):
        check(k, fusion, per_key_inputs(fusion, seed=seed), seed=seed)


def test_a_cache_with_key_lengths_chooses_by_its_keys_t_cache():
    """The per-call rules read the kernel's name for the keys: a cache whose sequences have their
    own lengths holds T_cache keys (no `T` among the call's sizes), and 3000 of them at head dim
    64 with no diagonal take the 3-warpgroup variant (B8 H16 S2048: 11 waves of its tiles, 16 of
    128-row ones)."""
    k = ws.compile(key_bias_lengths, build=False)
    inputs = per_key_inputs(key_bias_lengths, B=8, H=16, S=2048, T=3000, lens=(3000, 1377, 5, 3000, 1, 2, 3, 4))
    assert k.choose(inputs, 132).schedule.consumer_warpgroups == 3
    sizes = k.primary._bind_inputs(inputs)[1]
    assert "T_cache >= 1024" in k.variants[-1].rule and "T" not in sizes and sizes["T_cache"] == 3000
