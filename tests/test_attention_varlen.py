"""Attention over packed sequences of their own lengths (`ws.varlen` / `ws.packed`,
FlashAttention's varlen layout: Q [NQ, H, D], K and V [NK, H, D], i32 offsets cu_q and cu_k):
the CPU simulator against the torch reference (outputs poisoned with NaN first), the IR of the
tile loop (a binary search for the tile's sequence, its rows in the packed tensors, stores that
stop at the sequence's end), the host check of the offsets, nvcc builds, and what is refused."""

import pytest
import torch

import wsched as ws
from wsched.errors import FusionError
from wsched.schedule import ScheduleError

from attention_fusions import make_varlen_attention, make_varlen_paged_attention, varlen_inputs, varlen_paged_inputs
from test_attention_paged import check, compiled   # simulated against the reference, outputs poisoned


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_ragged_sequences_match_torch(causal):
    # an empty query sequence, a one-token one, one that ends a block early, one of 3 blocks and
    # queries without keys (O = 0, LSE = -inf); the keys of each sequence differ from its
    # queries (bottom-right aligns each to its own)
    fusion = make_varlen_attention(64, causal=causal)
    inputs = varlen_inputs([0, 1, 130, 300, 7], [5, 1, 200, 260, 0], 2, 64, seed=1)
    check(compiled(fusion), fusion, inputs)


def test_gqa_with_empty_key_sequences_and_more_tiles_than_sms():
    fusion = make_varlen_attention(128, causal="bottom_right", gqa=True)
    inputs = varlen_inputs([3, 64, 0, 129, 17, 1, 250], [3, 100, 7, 129, 300, 0, 250], 4, 128, kv_heads=2, seed=3)
    check(compiled(fusion), fusion, inputs, num_sms=3)


def test_many_short_sequences_on_64_row_tiles():
    # 13 sequences: a 4-step search; 64-row tiles of one consumer warpgroup, more SMs than tiles
    fusion = make_varlen_attention(64, causal=True, lse=False)
    lens = [1, 7, 64, 65, 0, 33, 2, 128, 5, 90, 64, 1, 40]
    check(compiled(fusion, tile=(64, 64, 64), consumer_warpgroups=1), fusion,
          varlen_inputs(lens, lens, 1, 64, seed=4), num_sms=64)


def test_one_offsets_tensor_for_queries_and_keys():
    @ws.fusion
    def self_attention(q: ws.Tensor[ws.bf16, "N", "H", 64], k: ws.Tensor[ws.bf16, "N", "H", 64],
                       v: ws.Tensor[ws.bf16, "N", "H", 64], cu: ws.Tensor[ws.i32, "B1"]):
        s = ws.causal_mask(ws.matmul(ws.varlen(q, cu), ws.varlen(k, cu).transpose(-1, -2)) * 0.125)
        return ws.packed(ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu)).to(ws.bf16), cu)

    kernel = compiled(self_attention)
    assert [p.name for p in kernel.kernel.params].count("cu") == 1
    q, k, v, cu, _ = varlen_inputs([150, 3, 97], [150, 3, 97], 2, 64, seed=5)
    check(kernel, self_attention, (q, k, v, cu))


def test_a_score_function_sees_positions_within_each_sequence():
    @ws.fusion
    def softcap_window(q: ws.Tensor[ws.bf16, "NQ", "H", 64], k: ws.Tensor[ws.bf16, "NK", "H", 64],
                       v: ws.Tensor[ws.bf16, "NK", "H", 64], cu_q: ws.Tensor[ws.i32, "B1"],
                       cu_k: ws.Tensor[ws.i32, "B1"]):
        s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2)) * 0.125
        i, j = ws.positions(s)
        s = ws.where((j <= i) & (i - j < 100), 20 * ws.tanh(s / 20), -ws.inf)
        return ws.packed(ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(ws.bf16), cu_q)

    check(compiled(softcap_window), softcap_window, varlen_inputs([260, 9, 131], [260, 9, 131], 2, 64, seed=6))


def test_the_tile_loop_finds_its_sequence_and_stores_only_its_rows():
    ir = compiled(make_varlen_attention(64, causal="bottom_right")).ir
    assert ("i32 offsets, i32 batch0 = offsets - 1, i32 batch1, i32 S_packed, i32 search_steps = bit_length(batch0), "
            "i32 T_packed") in ir
    assert "grid(min(num_sms, batch1 * (S_packed / 128 + batch0)))" in ir
    search = """\
        var seq = 0
        var span = batch0
        for step in serial(0, search_steps, 1) {
          let half = span / 2
          let mid = seq + half
          ld.global cu_mid = cu_q[mid]
          let go = cu_mid / 128 + mid <= v_block
          set seq = select(go, mid, seq)
          set span = select(go, span - half, half)
        }
        let b0 = seq
        ld.global q_off0 = cu_q[b0]
        ld.global q_off1 = cu_q[min(b0 + 1, offsets - 1)]
        let q_start = min(max(q_off0, 0), S_packed)
        let q_end = min(max(q_off1, q_start), S_packed)
        let S = q_end - q_start
"""
    assert search in ir   # the producer's; the consumers' is the same, indented less
    assert "let kv_tiles = select(m0 < S, min(kv_blocks, ceil_div(max(m0 + 128 + (T - S), 0), 128)), 0)" in ir
    assert "tma.load K[s, 0] <- k_in[k_start + k * 128, kv_head * 64] bar(k_full[s])" in ir
    assert "tile.store o[q_start + (m0 + wg * 64), head * 64] <- o_t row_limit(q_end)" in ir
    assert "tile.store lse[q_start + (m0 + wg * 64), head] <- l_run row_limit(q_end)" in ir


def test_offsets_are_checked_on_the_host():
    fusion = make_varlen_attention(64)
    q, k, v, cu_q, cu_k = varlen_inputs([10, 20], [10, 20], 1, 64)
    kernel = compiled(fusion)
    i32 = dict(dtype=torch.int32)
    with pytest.raises(FusionError, match=_re("cu_q[2] = 10 is below cu_q[1] = 20: cu_seqlens must be non-decreasing "
                                              "offsets from 0 to 30 (the rows of q)")):
        kernel.simulate(q, k, v, torch.tensor([0, 20, 10], **i32), cu_k)
    with pytest.raises(FusionError, match=_re("cu_k[2] = 29 (the last offset) must be 30")):
        kernel.simulate(q, k, v, cu_q, torch.tensor([0, 10, 29], **i32))
    kernel.simulate(q, k, v, cu_q, torch.tensor([0, 0, 30], **i32))   # an empty sequence is fine


@pytest.mark.parametrize("overrides, message", [
    (dict(pack_gqa=True, tile=(64, 128, 64), consumer_warpgroups=1),
     "pack_gqa=True does not take ws.varlen sequences (a tile's rows are one sequence's queries of one head); "
     "use pack_gqa=False"),
    (dict(split_kv=4), "split_kv=4 does not take ws.varlen sequences; use split_kv=1"),
])
def test_what_packed_sequences_do_not_take(overrides, message):
    fusion = make_varlen_attention(64, gqa=True)
    with pytest.raises(ScheduleError, match=r"^attention schedule for varlen_d64_lse_gqa_bf16: " + _re(message)):
        ws.partition(fusion, ws.schedule_for(fusion, **overrides))


def test_ws_compile_picks_no_decode_variant_for_packed_sequences():
    k = ws.compile(make_varlen_attention(128, gqa=True), build=False)
    assert not getattr(k, "variants", ())


def test_outputs_of_packed_sequences_must_be_packed():
    @ws.fusion
    def unpacked(q: ws.Tensor[ws.bf16, "NQ", "H", 64], k: ws.Tensor[ws.bf16, "NK", "H", 64],
                 v: ws.Tensor[ws.bf16, "NK", "H", 64], cu_q: ws.Tensor[ws.i32, "B1"], cu_k: ws.Tensor[ws.i32, "B1"]):
        s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2))
        return ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(ws.bf16)

    with pytest.raises(ScheduleError, match=_re(
            "with ws.varlen sequences the outputs are packed rows: return ws.packed(x, cu_q) (O [NQ, heads, D], "
            "LSE [NQ, heads]) (n7 = cast(...) at test_attention_varlen.py:")):
        ws.partition(unpacked, ws.schedule_for(unpacked))


def test_k_and_v_of_two_offsets_are_refused():
    @ws.fusion
    def two(q: ws.Tensor[ws.bf16, "NQ", "H", 64], k: ws.Tensor[ws.bf16, "NK", "H", 64],
            v: ws.Tensor[ws.bf16, "NK", "H", 64], cu_q: ws.Tensor[ws.i32, "B1"], cu_k: ws.Tensor[ws.i32, "B1"]):
        s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2))
        return ws.packed(ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_q)).to(ws.bf16), cu_q)

    with pytest.raises(ScheduleError, match=_re("K and V must be ws.varlen(..., cu_seqlens) of one cu_seqlens")):
        ws.partition(two, ws.schedule_for(two))


@pytest.mark.parametrize("page_size", [16, 256, None])
def test_packed_queries_against_a_paged_or_contiguous_cache(page_size):
    # a serving engine's mixed batch: chunks of new tokens per sequence (one token, none, a few
    # blocks) against each sequence's cache of seq_lens[b] keys, bottom-right causal per sequence;
    # a sequence with queries and no key gives O = 0, LSE = -inf
    fusion = make_varlen_paged_attention(64, page_size)
    inputs = varlen_paged_inputs([1, 130, 0, 7, 300], [1, 500, 9, 0, 300], page_size, 64, seed=2)
    kernel = compiled(fusion)
    assert "global cu_q: i32[offsets]" in kernel.ir and "i32 batch0, " in kernel.ir   # B from the cache
    check(kernel, fusion, inputs)


def test_offsets_of_b_plus_1_entries_must_match_the_caches_b():
    fusion = make_varlen_paged_attention(64, 16)
    q, k, v, table, cu_q, lens = varlen_paged_inputs([3, 4], [10, 20], 16, 64)
    with pytest.raises(FusionError, match=_re(
            "symbol B is bound to two sizes: 2 (block_table dim 0) and 3 (cu_q dim 0 is B+1)")):
        fusion.bind(q, k, v, table, torch.tensor([0, 3, 7, 7], dtype=torch.int32), lens)


def test_packed_keys_need_packed_queries():
    @ws.fusion
    def keys_only(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "NK", "H", 64],
                  v: ws.Tensor[ws.bf16, "NK", "H", 64], cu_k: ws.Tensor[ws.i32, "B+1"]):
        s = ws.matmul(q, ws.varlen(k, cu_k).transpose(-1, -2))
        return ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(ws.bf16)

    with pytest.raises(ScheduleError, match=_re(
            "packed keys (ws.varlen K and V) need packed queries: Q must be ws.varlen(packed, cu_seqlens) too")):
        ws.partition(keys_only, ws.schedule_for(keys_only))


@pytest.mark.nvcc
@pytest.mark.parametrize("page_size", [16, None])
def test_packed_queries_against_a_cache_build_without_spills(page_size):
    from test_attention_variants import build_resources

    fusion = make_varlen_paged_attention(128, page_size)
    resources = build_resources(ws.lower(fusion, ws.schedule_for(fusion)))
    assert resources.spill_stores == 0 and resources.spill_loads == 0


@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim, causal, gqa", [(64, False, False), (128, "bottom_right", True), (256, True, False)])
def test_varlen_kernels_build_without_spills(head_dim, causal, gqa):
    """The producer's search and offsets fit its 24 registers; the consumers' beside the tile."""
    from test_attention_variants import build_resources

    fusion = make_varlen_attention(head_dim, causal=causal, gqa=gqa)
    resources = build_resources(ws.lower(fusion, ws.schedule_for(fusion)))
    assert resources.spill_stores == 0 and resources.spill_loads == 0


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_packed_asks_for_dim_where_heads_and_rows_have_one_size():
    # 8 one-token sequences of 8 heads: O [8, 8, 8, 64] has the rows' size twice
    @ws.fusion
    def square(q: ws.Tensor[ws.bf16, 8, 8, 64], k: ws.Tensor[ws.bf16, 8, 8, 64], v: ws.Tensor[ws.bf16, 8, 8, 64],
               cu: ws.Tensor[ws.i32, 9]):
        s = ws.matmul(ws.varlen(q, cu), ws.varlen(k, cu).transpose(-1, -2))
        o = ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu)).to(ws.bf16)
        with pytest.raises(FusionError, match=_re("packed: n7 is bf16[8, 8, 8, 64]: dims 1 and 2 both have the size "
                                                  "of the rows of ws.varlen(..., cu); pass dim= (the queries: -2 of O, "
                                                  "-1 of the LSE)")):
            ws.packed(o, cu)
        return ws.packed(o, cu, dim=1)   # the heads: refused by the partition

    with pytest.raises(ScheduleError, match=_re("ws.packed must pack the queries (dim -2 of O), not dim -3; pass dim=-2")):
        ws.partition(square, ws.schedule_for(square))


def test_a_cache_broadcast_over_packed_sequences_is_refused():
    @ws.fusion
    def shared(q: ws.Tensor[ws.bf16, "NQ", "H", 64], k: ws.Tensor[ws.bf16, 1, "H", "T", 64],
               v: ws.Tensor[ws.bf16, 1, "H", "T", 64], cu: ws.Tensor[ws.i32, "B+1"]):
        s = ws.matmul(ws.varlen(q, cu), k.transpose(-1, -2))
        return ws.packed(ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), cu)

    with pytest.raises(ScheduleError, match=_re("packed queries (B sequences) need a cache row per sequence: K [1, ...] "
                                                "is broadcast over them")):
        ws.partition(shared, ws.schedule_for(shared))


def test_offsets_of_queries_and_keys_must_count_the_same_sequences():
    @ws.fusion
    def one_key_sequence(q: ws.Tensor[ws.bf16, "NQ", "H", 64], k: ws.Tensor[ws.bf16, "NK", "H", 64],
                         v: ws.Tensor[ws.bf16, "NK", "H", 64], cu_q: ws.Tensor[ws.i32, "B1"],
                         cu_k: ws.Tensor[ws.i32, 2]):
        s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2))
        return ws.packed(ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(ws.bf16), cu_q)

    with pytest.raises(ScheduleError, match=_re("cu_k and cu_q must hold as many offsets (one per sequence, plus one): "
                                                "1 and B1-1 sequences")):
        ws.partition(one_key_sequence, ws.schedule_for(one_key_sequence))


def test_random_inputs_draw_valid_offsets():
    from wsched.inputs import random_inputs

    fusion = make_varlen_paged_attention(64, 16)
    assert fusion.symbols == ("NQ", "HK", "G", "P", "B", "MP")   # B, not B+1
    q, k, v, table, cu_q, lens = random_inputs(fusion, dict(NQ=100, HK=2, G=2, P=40, B=3, MP=8), seed=1)
    assert cu_q.shape == (4,) and cu_q[0] == 0 and cu_q[-1] == 100 and bool((cu_q[1:] >= cu_q[:-1]).all())


def test_errors_name_what_the_user_declared():
    fusion = make_varlen_attention(64)
    q, k, v, cu_q, cu_k = varlen_inputs([3], [0], 1, 64)
    with pytest.raises(FusionError, match=_re("T_packed is 0 (k dim 0); the kernel needs at least one element there")):
        compiled(fusion).simulate(q, k, v, cu_q, cu_k)
    with pytest.raises(FusionError, match=_re("(B1-1 vs B); declare the offsets of ws.varlen [B+1] to give its view the "
                                              "batch B of the other operand")):
        @ws.fusion
        def against_a_cache(q: ws.Tensor[ws.bf16, "NQ", "H", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
                            v: ws.Tensor[ws.bf16, "B", "H", "T", 64], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.matmul(ws.varlen(q, cu), k.transpose(-1, -2))
