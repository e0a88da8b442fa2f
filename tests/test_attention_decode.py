"""Attention for decode: split-KV (each split's partial O, row max and row sum merged by the last
split of a tile to finish) and GQA packing (the G query heads of a KV head in the rows of one
tile), on the CPU simulator against the torch reference, the golden IR, the per-call choice of
`ws.compile`, and the errors."""

from __future__ import annotations

import re

import pytest
import torch

import wsched as ws
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.schedule import ScheduleError
from wsched.workloads.attention.schedule import MAX_SPLIT_KV

from attention_fusions import VARIANTS, attention_inputs, make_attention, make_variant, variant_inputs

DECODE = dict(tile=(64, 128, 128), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV, pack_gqa=True)


def compiled(fusion, **overrides):
    schedule = ws.schedule_for(fusion, **overrides)
    return ws.CompiledKernel(fusion, schedule, ws.partition(fusion, schedule), ws.lower(fusion, schedule),
                             cuda_source="")


def splits_of(kernel, inputs, num_sms: int) -> int:
    """The split count the host passes for a call on `num_sms` SMs."""
    _, scalars, _ = kernel._bind_inputs(inputs)
    return kernel._host_params(scalars, num_sms)["splits"]


def check(kernel, fusion, inputs, num_sms, seed=0):
    got = kernel.simulate(*inputs, num_sms=num_sms, seed=seed)
    want = fusion.reference(*inputs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert not torch.isnan(g.float()).any(), "outputs never written (poisoned with NaN)"
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g)), "rows that see no key differ"
        err = float((g.float()[finite] - w.float()[finite]).norm() / w.float()[finite].norm().clamp_min(1e-30))
        assert err < 1e-2, err


@pytest.mark.parametrize("s, t, num_sms, splits", [
    (1, 1, 8, 1),          # one key: one kv block, nothing to split
    (1, 127, 8, 1),
    (1, 1000, 2, 1),       # 8 kv blocks, 2 tiles on 2 SMs: the SMs are full, not split
    (1, 1000, 16, 4),      # 2 tiles on 16 SMs: 8 units wanted a tile, 8 kv blocks: 4 splits of 2 blocks
    (3, 8193, 16, 8),      # 65 kv blocks in 8 splits (the last one short): 2 tiles > 16 / 16, units on all SMs
    (3, 8193, 32, 8),      # 2 tiles <= 32 / 16: units on half the SMs, 8 splits
    (16, 2100, 64, 6),     # 64 rows of 4 heads x 16 queries; 17 kv blocks: 8 wanted, 3 a split: 6 (the last short)
    (64, 640, 6, 1),       # 4 x 64 rows: 4 m-blocks per KV head, 8 tiles > 6 SMs: no split
])
def test_packed_split_decode_matches_torch(s, t, num_sms, splits):
    fusion = make_attention(128, causal="bottom_right", lse=True, gqa=True)
    kernel = compiled(fusion, **DECODE)
    inputs = attention_inputs(1, 8, s, t, 128, gqa_groups=4, seed=s + t)
    assert splits_of(kernel, inputs, num_sms) == splits
    check(kernel, fusion, inputs, num_sms)


@pytest.mark.parametrize("h, t, splits", [
    (32, 8192, 8),      # 8 tiles on 132 SMs: 16 splits on all SMs would take 4 of 64 blocks each: half
    (32, 16384, 16),    # 8 blocks a split on all SMs: all of them (H100: 41.1 -> 39.5 us)
    (32, 32768, 16),    # (66.6 -> 62.7 us)
    (16, 32768, 16),    # 4 tiles: 33 splits on all SMs, a merge of more than 16: half
    (8, 32768, 32),     # 2 tiles: 33 wanted on half the SMs, at most 32
])
def test_few_tiles_split_on_all_sms_where_a_split_would_take_8_blocks(h, t, splits):
    """Units on half the SMs where the tiles are few (at most num_sms / 16), unless a split on
    all of them would take 8 kv blocks or more and the merge at most 16 splits (loops.split_count)."""
    kernel = compiled(make_attention(128, gqa=True), **DECODE)
    assert splits_of(kernel, attention_inputs(1, h, 1, t, 128, gqa_groups=4), 132) == splits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_split_count_up_to_the_blocks_merges_to_the_same_result(seed):
    """One tile of 73 kv blocks on 1..12, 20 and 70 SMs: splits 1..11 (units on all of 1..15 SMs:
    12 wanted on 12, 7 blocks a split leave work for 11), 10 on 20 (one tile <= 20 / 16: units on
    half of them) and 25 on 70 (MAX_SPLIT_KV wanted: 3 blocks a split leave work for 25), the
    last split runs short; every interleaving seed gives the torch result."""
    fusion = make_attention(64, lse=True, gqa=True)
    kernel = compiled(fusion, tile=(64, 128, 64), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV, pack_gqa=True)
    inputs = attention_inputs(1, 2, 2, 9300, 64, gqa_groups=2, seed=seed)
    seen = set()
    for num_sms in [*range(1, 13), 20, 70]:
        seen.add(splits_of(kernel, inputs, num_sms))
        check(kernel, fusion, inputs, num_sms, seed=seed)
    assert seen == {*range(1, 12), 25}
    assert splits_of(kernel, inputs, 15) == 15 and splits_of(kernel, inputs, 20) == 10   # all SMs / half of them


@pytest.mark.parametrize("causal, s, t, num_sms, bn", [
    (False, 200, 2100, 4, 128), (True, 2100, 2100, 40, 128), ("bottom_right", 300, 2100, 6, 128),
    (True, 1000, 1000, 16, 64)])
def test_split_kv_without_packing_on_128_row_tiles(causal, s, t, num_sms, bn):
    """Split-KV on the prefill kernel (few tiles, long keys): causal tiles split their own kv
    range (the first ones have fewer blocks than splits). With 64-key blocks the second split of
    the first tile starts above the diagonal of its first 64 rows: they see no key there."""
    fusion = make_attention(64, causal=causal, lse=True)
    kernel = compiled(fusion, tile=(128, bn, 64), split_kv=4)
    inputs = attention_inputs(1, 1, s, t, 64, seed=3)
    assert splits_of(kernel, inputs, num_sms) == 2
    check(kernel, fusion, inputs, num_sms=num_sms)


def test_split_kv_with_a_sliding_window_skips_blocks_before_the_first_visible_key():
    fusion = make_variant(64, "window", window=200)
    kernel = compiled(fusion, tile=(128, 128, 64), split_kv=4)
    inputs = [*attention_inputs(1, 1, 300, 2100, 64, seed=4)]
    assert splits_of(kernel, inputs, 8) == 2
    check(kernel, fusion, inputs, num_sms=8)


def test_mqa_and_head_dims_96_and_192():
    for d in (96, 192):
        fusion = make_attention(d, causal="bottom_right", gqa=True)
        kernel = compiled(fusion, tile=(64, 128, d), consumer_warpgroups=1, split_kv=8, pack_gqa=True)
        inputs = attention_inputs(2, 8, 2, 2100, d, gqa_groups=8, seed=d)    # MQA: one KV head, 8 query heads
        assert splits_of(kernel, inputs, 8) == 4    # 2 tiles on 8 SMs: 4 units a tile, 17 kv blocks
        check(kernel, fusion, inputs, num_sms=8)


def test_decode_ir_is_golden_and_round_trips(golden):
    kernel = ws.lower(make_attention(128, causal="bottom_right", lse=True, gqa=True),
                      **dict(DECODE, split_kv=32))
    text = print_kernel(kernel)
    golden.check("attention_decode_split.ir", text)
    assert parse_kernel(text) == kernel
    assert "tile.mask s_acc, rows(m0 + wg * 64), cols((k + kv_first) * 128), limit(T) causal(T - S) period(S)" in text
    # wanted: at most 32, at least 2 blocks a split, units on half the SMs while the tiles are few,
    # unless a split on all of them takes 8 blocks or more and the merge at most 16 splits; then no
    # more splits than ceil(blocks / wanted) blocks a split leave work for
    blocks = "max(1, ceil_div(T, 128))"
    tiles = "batch0 * batch1 * ceil_div(G * S, 64)"
    on_all = f"min(32, max(1, num_sms / ({tiles})))"
    few = f"(16 * ({tiles}) <= num_sms) * ({blocks} < 8 * {on_all} || {on_all} > 16)"
    wanted = f"min(min(32, max(1, {blocks} / 2)), max(1, num_sms / ({tiles} * (1 + {few}))))"
    assert f"i32 splits = ceil_div({blocks}, ceil_div({blocks}, {wanted}))," in text
    # the rows a tile owns: whole merge chunks of 8 rows, dealt to the SMs the splits leave idle
    chunks = "ceil_div(min(64, G * S), 8)"
    parts = f"min({chunks}, max(1, num_sms / ({tiles} * splits)))"
    assert f"i32 tile_rows = select(splits > 1 && {parts} > 1, 8 * ceil_div({chunks}, {parts}), 64)," in text
    assert "let m0 = m_block * tile_rows" in text


@pytest.mark.parametrize("h, g, s, t, num_sms, splits, tile_rows", [
    (32, 32, 1, 700, 16, 3, 8),      # MQA: 32 rows (4 merge chunks of 8), 3 splits on 16 SMs: 4 tiles of 8 rows
    (12, 12, 3, 1300, 40, 4, 8),     # 36 rows: 5 tiles of 8, the last with 4
    (32, 32, 1, 700, 6, 3, 16),      # 6 SMs take 2 tiles of 2 chunks
    (32, 32, 1, 100, 16, 1, 64),     # one kv block, no split: the tile keeps its rows
    (32, 4, 1, 4000, 16, 2, 64),     # 4 rows (one chunk) a KV head: nothing to deal
    (32, 32, 3, 1500, 40, 6, 24),    # 96 rows, two row blocks of 64: 4 tiles of 24
])
@pytest.mark.parametrize("seed", [0, 1])
def test_split_tiles_deal_their_rows_to_idle_sms(h, g, s, t, num_sms, splits, tile_rows, seed):
    """Where the splits leave SMs idle, a split-KV tile's rows go to tiles of whole merge chunks
    (loops.tile_rows): each reads the same kv blocks and merges only its own rows. Rows past a
    tile's own are computed (the wgmma takes 64) but not stored, by the merge nor unsplit."""
    fusion = make_attention(128, causal="bottom_right", lse=True, gqa=True)
    kernel = compiled(fusion, **DECODE)
    inputs = attention_inputs(1, h, s, t, 128, gqa_groups=g, seed=t + seed)
    _, scalars, _ = kernel._bind_inputs(inputs)
    params = kernel._host_params(scalars, num_sms)
    assert (params["splits"], params["tile_rows"]) == (splits, tile_rows)
    assert params["part_rows"] == min(tile_rows, g * s)
    check(kernel, fusion, inputs, num_sms, seed=seed)


def test_split_tiles_of_unpacked_causal_rows_deal_them_too():
    """100 query rows of one head (no packing), bottom-right against 1500 keys, on 64-row decode
    tiles: 2 row blocks x 6 splits on 40 SMs, so 5 tiles of 24 rows (the last with 4), each
    walking the kv blocks its 64 computed rows see (a superset of its own rows')."""
    fusion = make_attention(128, causal="bottom_right", lse=True)
    kernel = compiled(fusion, tile=(64, 128, 128), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV)
    inputs = attention_inputs(1, 1, 100, 1500, 128, seed=7)
    _, scalars, _ = kernel._bind_inputs(inputs)
    params = kernel._host_params(scalars, 40)
    assert (params["splits"], params["tile_rows"], params["part_rows"]) == (6, 24, 24)
    check(kernel, fusion, inputs, num_sms=40)


@ws.fusion
def alibi_decode(q: ws.Tensor[ws.bf16, "B", "H", "S", 128], k: ws.Tensor[ws.bf16, "B", "H", "T", 128],
                 v: ws.Tensor[ws.bf16, "B", "H", "T", 128], slope: ws.Tensor[ws.f32, "H", 1, 1]):
    s = ws.matmul(q, k.transpose(-1, -2)) * 128 ** -0.5
    i, j = ws.positions(s)
    s = ws.causal_mask(s + slope * (j - i), align="bottom_right")
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


def test_dealt_tiles_keep_a_diagonal_bias_and_its_lse_per_row():
    """ALiBi (a per-head slope times j - i), bottom-right: a dealt tile's bias counts rows from
    its own first row, and the LSE's row part (`bias_lse`) from each merge chunk's; the LSE is
    held to 1e-4 (a chunk's rows counted from the wrong first row err by ~3e-3)."""
    kernel = compiled(alibi_decode, tile=(64, 128, 128), consumer_warpgroups=1, split_kv=MAX_SPLIT_KV)
    inputs = variant_inputs(alibi_decode, 1, 1, 100, 1500, 128, seed=5)
    _, scalars, _ = kernel._bind_inputs(inputs)
    params = kernel._host_params(scalars, 40)
    assert (params["splits"], params["tile_rows"]) == (6, 24)
    check(kernel, alibi_decode, inputs, num_sms=40)
    _, lse = kernel.simulate(*inputs, num_sms=40)
    want = alibi_decode.reference(*inputs)[1]
    assert float((lse - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize("g, s, rows, bm, num_sms", [(4, 1, 4, 64, 8), (8, 5, 40, 64, 8), (8, 16, 64, 64, 16),
                                                     (8, 12, 96, 128, 8)])
def test_split_partials_keep_only_the_rows_queries_fill(g, s, rows, bm, num_sms):
    """A split's partial O, max and sum hold the rows of its tile that queries fill (4 of 64 for
    one token of 4 heads), not the whole tile: the last split reads every split's partials. Also
    with two consumer warpgroups (128-row tiles), where the second holds rows 64..95 of 96."""
    fusion = make_attention(128, causal="bottom_right", lse=True, gqa=True)
    kernel = compiled(fusion, **(DECODE if bm == 64 else dict(split_kv=MAX_SPLIT_KV, pack_gqa=True)))
    inputs = attention_inputs(2, 2 * g, s, 3000, 128, gqa_groups=g, seed=rows)
    _, scalars, _ = kernel._bind_inputs(inputs)
    params = kernel._host_params(scalars, num_sms)
    assert params["part_rows"] == rows and params["splits"] == 2
    # no SM idle: a one-warpgroup tile keeps its rows; two warpgroups never deal them
    assert params.get("tile_rows") == (bm if bm == 64 else None)
    part_o = next(p for p in kernel.kernel.params if p.name == "part_o")
    tiles = 2 * 2 * -(-g * s // bm)   # batch x KV heads x row blocks of the G x S packed rows
    assert kernel._workspace(part_o, params, "cpu").numel() == params["splits"] * tiles * rows * 128
    check(kernel, fusion, inputs, num_sms=num_sms)


@pytest.mark.parametrize("split, num_sms, section", [(True, 3, 1), (True, 12, 4), (True, 24, 1),
                                                    (False, 3, 1), (False, 40, 2), (False, 64, 4)])
def test_long_causal_sequences_walk_sections_heaviest_first(split, num_sms, section):
    """6 m-blocks a head. The static order (a split-KV kernel): on 12 SMs (m-blocks >= half the
    SMs) sections of 4 heads then 2, each heaviest m-block first across its heads; on 3 SMs two
    waves are one head's tiles, on 24 the heads are short: one head after another. Tiles taken
    from a counter walk sections of num_sms / 16 heads."""
    fusion = make_attention(64, causal=True, lse=True)
    kernel = compiled(fusion, **({"split_kv": MAX_SPLIT_KV} if split else {}))
    assert ("tile_counter" in {p.name for p in kernel.kernel.params}) == (not split)
    inputs = attention_inputs(2, 3, 700, 700, 64, seed=num_sms)
    _, scalars, _ = kernel._bind_inputs(inputs)
    assert kernel._host_params(scalars, num_sms)["section"] == section
    check(kernel, fusion, inputs, num_sms=num_sms)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "sinks"])
@pytest.mark.parametrize("s, num_sms, splits", [(3, 4, 4), (300, 10, 2)])
def test_score_functions_run_in_the_kernels_compile_picks(variant, s, num_sms, splits):
    """Every score function of the variants issue in the decode variant (S <= 64: not packed, a
    score function may read per-head or per-query inputs; one tile on 4 SMs) and in the few-tiles
    variant (3 128-row tiles on 10 SMs: 5 64-row tiles, 2 units each): 17 kv blocks split in 4 and 2."""
    fusion = make_variant(64, variant, window=300)
    k = ws.compile(fusion, build=False)
    inputs = variant_inputs(fusion, 1, 1, s, 2100, 64, seed=s)
    kernel = k.choose(inputs, num_sms)
    assert kernel.schedule.split_kv == MAX_SPLIT_KV and splits_of(kernel, inputs, num_sms) == splits
    check(kernel, fusion, inputs, num_sms)


# --- ws.compile's choice -------------------------------------------------------------------------

def _call(b, h, s, t, g=4):
    return attention_inputs(b, h, s, t, 128, gqa_groups=g)


@pytest.mark.parametrize("shape, sms, chosen", [
    ((8, 32, 1, 8192), 132, "decode"),      # S <= 64: packed, split where the tiles leave SMs idle
    ((64, 32, 1, 2048), 132, "decode"),
    ((1, 32, 64, 32768), 132, "decode"),
    ((1, 8, 1024, 32768), 132, "split"),     # 2 KV heads x 4 x 8 = 64 tiles <= 66: 64-row tiles, split-KV
    ((1, 8, 200, 200), 132, "split"),        # 8 x 2 = 16 tiles: 64-row tiles (the host splits nothing)
    ((4, 32, 1024, 1024), 132, "default"),   # 256 tiles
    ((1, 8, 4096, 4096), 132, "default"),    # 256 tiles
])
def test_compile_picks_decode_split_or_default_by_shape(shape, sms, chosen):
    k = ws.compile(make_attention(128, causal="bottom_right", lse=True, gqa=True), build=False)
    decode, split = k.variants
    assert decode.schedule == ws.schedule_for(k.primary.fusion, **DECODE)
    # few 128-row tiles: 64-row tiles on one warpgroup, not packed (H100: B1 H16/4 S512 0.69 -> 1.02 of
    # cuDNN against 128-row tiles with split-KV; 1.02-1.80x those with 4K-32K keys)
    assert split.schedule == ws.schedule_for(k.primary.fusion, **{**DECODE, "pack_gqa": False})
    want = {"decode": decode.schedule, "split": split.schedule, "default": k.primary.schedule}[chosen]
    assert k.choose(_call(*shape), sms).schedule == want


def test_compile_without_packing_where_the_score_function_reads_per_head_inputs():
    """ALiBi reads a slope per query head: the decode variant does not pack the heads."""
    k = ws.compile(make_variant(128, "alibi", gqa=True), build=False)
    assert [v.schedule.pack_gqa for v in k.variants] == [False, False]
    assert k.variants[0].schedule.split_kv == MAX_SPLIT_KV


def test_a_fusion_with_a_sink_gets_no_split_variant():
    k = ws.compile(make_variant(128, "sinks", gqa=True), build=False)
    assert isinstance(k, ws.CompiledKernel)    # the sink is a per-head input: no split, no packing


# --- errors ------------------------------------------------------------------------------------

def test_pack_gqa_needs_the_gqa_layout():
    with pytest.raises(ScheduleError) as e:
        ws.lower(make_attention(128), **DECODE)
    assert str(e.value) == ("attention schedule for attn_d128_bf16: pack_gqa=True needs Q [..., G, S, D] against K "
                            "and V [..., 1, T, D]: the G query heads that share a KV head in the dim before S, where "
                            "K and V have extent 1")


def test_pack_gqa_refuses_score_functions_beyond_scale_and_diagonal_masks():
    with pytest.raises(ScheduleError, match=r"pack_gqa=True takes a score function of a scale and masks bounded by "
                                            r"diagonals only; this one: it computes on the scores"):
        ws.lower(make_variant(128, "softcap", gqa=True), **DECODE)


def test_split_kv_refuses_a_sink():
    with pytest.raises(ScheduleError, match=r"split_kv=32 does not take an attention sink \(its logit would count "
                                            r"once per split\); use split_kv=1"):
        ws.lower(make_variant(128, "sinks", gqa=True), **dict(DECODE, pack_gqa=False))


@pytest.mark.parametrize("overrides, advice", [
    (dict(tile=(64, 64, 256), consumer_warpgroups=1, split_kv=32, pack_gqa=True),
     "1 consumer warpgroups needs more registers than a consumer thread has (the merge of the splits beside O): "
     "ptxas spills; use mma_inflight=0 or split_kv=1"),
    (dict(split_kv=4), "2 consumer warpgroups needs more registers than a consumer thread has (the merge of the "
                       "splits beside O): ptxas spills; use mma_inflight=0 or split_kv=1")])
def test_split_kv_at_head_dim_256_advises_only_what_builds(overrides, advice):
    """Both warpgroup counts spill at mma_inflight=1: the advice names only the changes that build."""
    with pytest.raises(ScheduleError, match=re.escape(f"split_kv={overrides['split_kv']} with head dim 256, "
                                                      f"mma_inflight=1 and {advice}")):
        ws.schedule_for(make_attention(256, causal="bottom_right", lse=True, gqa=True), **overrides)


@pytest.mark.parametrize("variant, S, T", [("causal", 3, 513), ("causal", 64, 129), ("window", 16, 300),
                                            ("window", 1, 300)])
def test_masks_bounded_by_diagonals_are_packed(variant, S, T):
    """A causal mask or a sliding window written with ws.where (bounds on j - i) packs like
    ws.causal_mask: the rows' query positions are row mod S in the tile mask's bounds."""
    f = make_variant(128, variant, gqa=True, window=100)
    assert ws.compile(f, build=False).variants[0].schedule.pack_gqa
    q, k, v = attention_inputs(2, 8, S, T, 128, seed=S + T, gqa_groups=4)
    o, lse = compiled(f, **DECODE).simulate(q, k, v, num_sms=3)
    ro, rlse = f.reference(q, k, v)
    seen = torch.isfinite(rlse)
    assert (o[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())   # noqa: E731
    assert rel(o[seen], ro[seen]) < 1e-2 and rel(lse[seen], rlse[seen]) < 1e-3


def test_packing_refuses_a_bound_on_the_key_alone():
    def first_keys(q: ws.Tensor[ws.bf16, "B", "HK", "G", "S", 128], k: ws.Tensor[ws.bf16, "B", "HK", 1, "T", 128],
                   v: ws.Tensor[ws.bf16, "B", "HK", 1, "T", 128]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 128 ** -0.5
        _, j = ws.positions(s)
        s = ws.where(j < 100, s, -ws.inf)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)

    f = ws.fusion(first_keys)
    with pytest.raises(ScheduleError, match=re.escape(
            "pack_gqa=True takes a score function of a scale and masks bounded by diagonals only; this one: it has "
            "masks other than bounds on j - i (causal masks, causal or sliding-window ws.where conditions): a bound "
            "on the key alone, a union or an unanalysed condition")):
        ws.partition(f, ws.schedule_for(f, **DECODE))


@pytest.mark.parametrize("value", [0, 33, 2.0])
def test_split_kv_range(value):
    with pytest.raises(ScheduleError, match=rf"split_kv={value!r} must be an int in \[1, 32\]"):
        ws.schedule_for(make_attention(128), split_kv=value)


def test_a_packed_q_that_is_not_one_run_of_rows_is_named():
    fusion = make_attention(128, gqa=True)
    kernel = compiled(fusion, **DECODE)
    q, k, v = attention_inputs(1, 8, 2, 300, 128, gqa_groups=4)
    q = q.transpose(2, 3).contiguous().transpose(2, 3)    # [B, HK, G, S, D] with S outside G
    with pytest.raises(ws.ArgumentError, match=r"argument 'q' \(shape \[1, 2, 4, 2, 128\], strides .*\) cannot be "
                                               r"read as \[1, 2, 8, 128\] without a copy; .* pass q.contiguous\(\)"):
        kernel.simulate(q, k, v, num_sms=2)


@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True), (192, "bottom_right")])
def test_the_few_tiles_variant_builds_without_spills(head_dim, causal):
    """Where the 128-row tiles fill at most half the SMs ws.compile runs 64-row tiles on one
    consumer warpgroup, unpacked, split-KV: GQA fusions with the LSE at three head dims."""
    from test_attention_variants import build_resources

    f = make_attention(head_dim, causal=causal, lse=True, gqa=True)
    few = ws.compile(f, build=False).variants[1].schedule
    assert (few.bm, few.consumer_warpgroups, few.pack_gqa, few.split_kv) == (64, 1, False, MAX_SPLIT_KV)
    resources = build_resources(ws.lower(f, few))
    assert resources.spill_stores == 0 and resources.spill_loads == 0
