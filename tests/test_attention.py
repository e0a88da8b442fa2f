"""Attention: partition, lowering (golden IR, round trip) and the CPU simulator against the
torch reference — causal and not, head dims 64/96/128/256 and 192 with V 128, ragged sequence
lengths, decode, batch, GQA / MQA through broadcasting, LSE output."""

import re

import pytest
import torch

import wsched as ws
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.schedule import ScheduleError

from attention_fusions import attention_inputs, make_attention


def rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def simulate_and_check(fusion, inputs, seed=0, num_sms=3, schedule=None):
    schedule = schedule or ws.schedule_for(fusion)
    kernel = ws.lower(fusion, schedule)
    ck = ws.CompiledKernel(fusion, schedule, ws.partition(fusion, schedule), kernel, cuda_source="")
    got = ck.simulate(*inputs, seed=seed, num_sms=num_sms)
    ref = fusion.reference(*inputs)
    got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
    for g, r in zip(got, ref):
        assert not torch.isnan(g.float()).any(), "outputs never written"
        assert rel(g, r) < 1e-2, rel(g, r)
    return got


def test_partition_finds_q_k_v_scale_and_mask():
    f = make_attention(128, causal=True, lse=True)
    p = ws.partition(f, ws.schedule_for(f))
    a = p.payload
    assert p.workload.name == "attention" and p.output_names == ("o", "lse") and p.nonempty == ("T",)
    assert (a.q.id, a.k.id, a.v.id) == ("q", "k", "v")
    assert a.causal and a.lse is not None and abs(a.scale - 128 ** -0.5) < 1e-12
    assert [(c.name, c.level, c.stages, c.bytes_per_stage) for c in p.channels] == [
        ("q", "tile", 1, 128 * 128 * 2), ("k", "k", 3, 128 * 128 * 2), ("v", "k", 3, 128 * 128 * 2)]
    assert p.dims == {"batch0": ("q", 0), "batch1": ("q", 1), "S": ("q", 2), "T": ("k", 2)}


def test_attention_partition_prints(golden):
    f = make_attention(128, causal=True, lse=True)
    golden.check("attention.partition.txt", str(ws.partition(f, ws.schedule_for(f))))


def test_attention_ir_is_golden_and_round_trips(golden):
    k = ws.lower(make_attention(128, causal=True, lse=True))
    text = print_kernel(k)
    golden.check("attention_causal_d128.ir", text)
    for snapshot in k.ir_after.values():
        assert parse_kernel(print_kernel(snapshot)) == snapshot


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_head_dims_causal_and_not(D, causal):
    f = make_attention(D, causal=causal, lse=True)
    simulate_and_check(f, attention_inputs(1, 2, 200, 200, D, seed=D + causal))


@pytest.mark.parametrize("D", [96, 192])
@pytest.mark.parametrize("S,T,causal", [(77, 300, "bottom_right"), (300, 129, True)])
def test_head_dims_96_and_192_with_gqa_causal_and_odd_lengths(D, S, T, causal):
    f = make_attention(D, causal=causal, lse=True, gqa=True)
    simulate_and_check(f, attention_inputs(1, 4, S, T, D, seed=S + D, gqa_groups=2), num_sms=2)


def test_head_dim_96_is_three_64_byte_swizzled_chunks():
    """No padded MMA work: Q, K and V lie in chunks of 32 columns with the 64-byte swizzle."""
    k = ws.lower(make_attention(96, causal=True))
    assert [(b.name, b.shape, b.swizzle) for b in k.smem] == [
        ("Q", (1, 2, 3, 64, 32), 64), ("K", (3, 3, 128, 32), 64), ("V", (3, 3, 128, 32), 64),
        ("tile_slot", (2, 1), 0)]   # the causal tiles' next tile (passes/dynamic_tiles.py)
    maps = {p.name: (p.box, p.swizzle) for p in k.params if isinstance(p, ws.lowering.ir.TensorMapParam)}
    assert maps == {"q": ((1, 1, 64, 32), 64), "k_in": ((1, 1, 128, 32), 64), "v": ((1, 1, 128, 32), 64)}


def test_head_dim_192_has_v_and_o_of_128():
    f = make_attention(192, lse=True)
    s = ws.schedule_for(f)
    assert (s.head_dim, s.value_dim, s.stage_bytes) == (192, 128, 128 * (192 + 128) * 2)
    k = ws.lower(f)
    assert [(b.name, b.shape) for b in k.smem] == [("Q", (1, 2, 3, 64, 64)), ("K", (2, 3, 128, 64)),
                                                   ("V", (2, 2, 128, 64))]
    assert next(p for p in k.params if p.name == "o").shape[-1] == ws.lowering.ir.IntConst(128)


@pytest.mark.parametrize("qk, v", [(80, 80), (192, 192), (128, 64)])
def test_unsupported_head_dims_name_the_supported_ones(qk, v):
    @ws.fusion
    def odd(q: ws.Tensor[ws.bf16, "B", "S", qk], k: ws.Tensor[ws.bf16, "B", "T", qk], v: ws.Tensor[ws.bf16, "B", "T", v]):
        return ws.matmul(ws.softmax(ws.matmul(q, k.transpose(-1, -2)), dim=-1), v).to(ws.bf16)  # odd-dims

    if qk == 80:
        message = ("invalid schedule 128x128x80 stages=1 consumers=2 regs=24/240 epilogue=direct:\n"
                   "  - head dim (BK) 80 is not one of 64, 96, 128, 192, 256 (of Q and K; V: 64, 96, 128, 256 "
                   "(V the same) or 192 with V 128)")
    else:
        message = (f"attention schedule for odd: head dims Q/K {qk}, V {v} are not supported; head dims are 64, 96, "
                   f"128, 256 (V the same) or 192 with V 128 (v = input(...) at ")
    with pytest.raises(ScheduleError, match="^" + re.escape(message)):
        ws.lower(odd)


@pytest.mark.parametrize("S,T", [(1, 300), (70, 333), (129, 64), (256, 256)])
def test_ragged_lengths_and_decode(S, T):
    f = make_attention(64, lse=True)
    simulate_and_check(f, attention_inputs(2, 3, S, T, 64, seed=S), num_sms=4)


def test_causal_ragged_more_tiles_than_ctas():
    f = make_attention(64, causal=True)
    simulate_and_check(f, attention_inputs(2, 2, 300, 300, 64, seed=9), num_sms=3)


@pytest.mark.parametrize("groups", [2, 4])
def test_gqa_and_mqa_broadcast_k_and_v(groups):
    f = make_attention(64, gqa=True, lse=True)
    inputs = attention_inputs(1, 4, 150, 170, 64, seed=groups, gqa_groups=groups)   # groups=4: MQA
    simulate_and_check(f, inputs)
    text = print_kernel(ws.lower(f))
    assert "k_in[b0, b1, 0, k * 128, 0]" in text   # no copy of K: the group coordinate is 0 (K is passed as k_in: `k` is the kv loop variable)


@pytest.mark.parametrize("S,T", [(300, 100), (1, 257), (130, 130), (64, 300)])
def test_bottom_right_causal_and_fully_masked_rows(S, T):
    """Bottom-right alignment (query i sees keys j <= i + T - S): with S > T the first S - T
    rows see no key; they store O = 0 and LSE = -inf (the reference has NaN there)."""
    f = make_attention(64, causal="bottom_right", lse=True)
    inputs = attention_inputs(1, 2, S, T, 64, seed=S * T)
    kernel = ws.lower(f)
    ck = ws.CompiledKernel(f, ws.schedule_for(f), ws.partition(f, ws.schedule_for(f)), kernel, cuda_source="")
    o, lse = ck.simulate(*inputs, num_sms=3)
    ro, rlse = f.reference(*inputs)
    hidden = max(S - T, 0)
    assert (o[..., :hidden, :] == 0).all() and torch.isneginf(lse[..., :hidden]).all()
    assert rel(o[..., hidden:, :], ro[..., hidden:, :]) < 1e-2
    assert rel(lse[..., hidden:], rlse[..., hidden:]) < 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_without_softmax_overlap(causal):
    """mma_inflight=0: every wgmma waited for at once (the schedule before overlap_softmax)."""
    f = make_attention(64, causal=causal, lse=True)
    sched = ws.schedule_for(f, mma_inflight=0)
    kernel = ws.lower(f, sched)
    assert "wgmma.wait 1" not in print_kernel(kernel)
    assert "overlap_softmax" not in kernel.ir_after   # a step that would do nothing is off the route
    ck = ws.CompiledKernel(f, sched, ws.partition(f, sched), kernel, cuda_source="")
    inputs = attention_inputs(1, 2, 200, 333, 64, seed=5)
    o, lse = ck.simulate(*inputs, num_sms=3)
    ro, rlse = f.reference(*inputs)
    assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3


def test_softmax_overlaps_the_previous_blocks_pv():
    text = print_kernel(ws.lower(make_attention(128)))
    loop = text[text.index("role consumer"):]
    assert loop.index("wgmma.mma s_acc") < loop.index("wgmma.mma o_acc, p, V[prev_s]") < loop.index("wgmma.wait 1")
    assert loop.index("wgmma.wait 1") < loop.index("tile.exp2_ftz s_acc") < loop.index("wgmma.wait 0")
    assert "wgmma.mma o_acc, p, V[last_s]" in loop   # the last block's P V after the loop


def test_the_softmax_flushes_subnormal_exponentials_unless_the_kernel_splits_its_kv_blocks():
    """AttentionSchedule.softmax_exp2: tile.exp2_ftz (one ex2.approx.ftz) for the corrections and
    probabilities of a kernel that does not split, tile.exp2 (exp2f) in a split-KV kernel, whose
    merge keeps tile.exp2 too (a split's factor and the running sums'); the CUDA spells them
    wsp::ex2_approx and exp2f."""
    f = make_attention(64, causal=True, lse=True)
    for split, op, other in ((1, "exp2_ftz", "exp2f("), (8, "exp2", "wsp::ex2_approx(")):
        sched = ws.schedule_for(f, split_kv=split)
        assert sched.softmax_exp2 == op
        kernel = ws.lower(f, sched)
        ops = [(s.op, s.dst) for s in ir.walk(kernel.body) if isinstance(s, ir.TileUnary) and "exp2" in s.op]
        assert ops[:2] == [(op, "corr"), (op, "s_acc")] and all(o == "exp2" for o, _ in ops[2:])
        assert len(ops) == (2 if split == 1 else 4)
        source = emit_kernel(kernel).source
        assert other not in source
    inputs = attention_inputs(1, 2, 200, 333, 64, seed=7)
    simulate_and_check(f, inputs)


def test_head_dim_64_with_long_keys_and_no_diagonal_masks_runs_three_consumer_warpgroups():
    """The per-call variant of schedule.THREE_WARPGROUP_HEAD_DIMS: 192 rows on 3 warpgroups (24/160
    registers) at head dim 64 where no mask or bias cuts a diagonal or the masks are causal only,
    the keys number THREE_WARPGROUP_MIN_KEYS and the 192-row tiles take at most 11/15 of the
    waves (without a diagonal, also at any length where they take at most 2/3); never with
    windows, ALiBi, packed sequences or a paged cache; simulated against the reference (GQA,
    rows and keys no multiple of the tiles)."""
    from attention_fusions import make_paged_attention, make_varlen_attention, make_variant

    from wsched.workloads.attention.schedule import THREE_WARPGROUP_MIN_KEYS

    def three(f):
        return [v for v in getattr(ws.compile(f, build=False), "variants", ()) if v.schedule.consumer_warpgroups == 3]

    plain, gqa, document = make_attention(64), make_attention(64, lse=True, gqa=True), make_variant(64, "document")
    for f in (plain, gqa, document):
        (variant,) = three(f)
        s = variant.schedule
        assert (s.tile, s.consumer_registers, s.stages, s.mode) == ((192, 128, 64), 160, 3, "cooperative"), f.name
    causal = make_attention(64, causal=True)
    for f in (causal, make_attention(64, causal="bottom_right", lse=True), make_variant(64, "softcap")):
        (variant,) = three(f)
        assert variant.rule.startswith("causal masks only"), f.name
    for f in (make_attention(128), make_variant(64, "window"), make_variant(64, "alibi"),
              make_variant(64, "document_causal"), make_varlen_attention(64), make_paged_attention(64, 64)):
        assert not three(f), f.name
    for f in (causal, plain, document, make_varlen_attention(64)):
        assert ws.schedule_for(f).consumer_warpgroups == 2, f.name   # the default kernel itself

    def warpgroups(k, B, H, S, T):
        return k.choose(attention_inputs(B, H, S, T, 64), 132).schedule.consumer_warpgroups

    kc, long = ws.compile(causal, build=False), THREE_WARPGROUP_MIN_KEYS["causal"]
    # B2 H16 S5120: 7 waves of 192-row tiles against 10 of 128-row ones; B1: 4 against 5
    assert [warpgroups(kc, 2, 16, long, long), warpgroups(kc, 2, 16, long - 1, long - 1),
            warpgroups(kc, 1, 16, long, long)] == [3, 2, 2]
    k, keys = ws.compile(plain, build=False), THREE_WARPGROUP_MIN_KEYS["no diagonal"]
    # B8 H16 S2048: 11 waves against 16; B1 H8 S2048: 1 wave either way (1.5x the work a tile);
    # B4 H16 S420: 2 waves either way; B2 H16 S727: 1 wave against 2, at any length; B4 S100: few tiles
    assert [warpgroups(k, 8, 16, 2048, keys), warpgroups(k, 8, 16, 2048, keys - 1), warpgroups(k, 1, 8, 2048, 2048),
            warpgroups(k, 4, 16, 420, 420), warpgroups(k, 2, 16, 727, 727), warpgroups(k, 4, 16, 100, 8000)] \
        == [3, 2, 2, 2, 3, 1]
    simulate_and_check(gqa, attention_inputs(1, 8, 200, 333, 64, seed=3, gqa_groups=4),
                       schedule=three(gqa)[0].schedule)
    simulate_and_check(plain, attention_inputs(2, 1, 385, 130, 64, seed=4), schedule=three(plain)[0].schedule)


def test_gqa_with_bottom_right_causal_and_lse():
    f = make_attention(64, causal="bottom_right", lse=True, gqa=True)
    inputs = attention_inputs(1, 4, 90, 200, 64, seed=11, gqa_groups=2)
    simulate_and_check(f, inputs)


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_pingpong_token_passing(causal):
    """mode="pingpong": the warpgroups take turns issuing their GEMMs through named barriers 3
    and 4; the barriers end balanced (no deadlock under any interleaving) and results match."""
    f = make_attention(64, causal=causal, lse=True)
    sched = ws.schedule_for(f, mode="pingpong")
    kernel = ws.lower(f, sched)
    text = print_kernel(kernel)
    assert "bar.sync 3 + wg, 256" in text and "bar.arrive 4 - wg, 256" in text
    ck = ws.CompiledKernel(f, sched, ws.partition(f, sched), kernel, cuda_source="")
    inputs = attention_inputs(2, 2, 300, 520, 64, seed=21)
    for seed in range(3):
        o, lse = ck.simulate(*inputs, seed=seed, num_sms=3)
    ro, rlse = f.reference(*inputs)
    assert rel(o, ro) < 1e-2 and rel(lse, rlse) < 1e-3


def test_several_interleavings():
    f = make_attention(64, causal=True, lse=True)
    inputs = attention_inputs(1, 1, 260, 260, 64, seed=1)
    for seed in range(4):
        simulate_and_check(f, inputs, seed=seed, num_sms=2)


def test_symbolic_head_dim_is_rejected():
    @ws.fusion
    def sym(q: ws.Tensor[ws.bf16, "B", "S", "D"], k: ws.Tensor[ws.bf16, "B", "T", "D"], v: ws.Tensor[ws.bf16, "B", "T", "D"]):
        return ws.matmul(ws.softmax(ws.matmul(q, k.transpose(-1, -2)), dim=-1), v).to(ws.bf16)

    with pytest.raises(ScheduleError, match="the head dim of Q is the symbol 'D'; declare it as a number"):
        ws.lower(sym)


def test_unfusable_op_between_the_matmuls_is_named():
    """A row reduction is no score function (tests/test_attention_variants.py: the others)."""
    @ws.fusion
    def bad(q: ws.Tensor[ws.bf16, "B", "S", 64], k: ws.Tensor[ws.bf16, "B", "T", 64], v: ws.Tensor[ws.bf16, "B", "T", 64]):
        s = ws.matmul(q, k.transpose(-1, -2))
        return ws.matmul(ws.softmax(s - s.max(-1, keepdim=True), dim=-1), v).to(ws.bf16)

    with pytest.raises(ScheduleError, match=r"max cannot be computed between Q K\^T and the softmax: a score or mask "
                                            r"function is built from elementwise ops, comparisons, ws.where and "
                                            r"ws.positions \(n\d+ = max\(\.\.\.\) at test_attention\.py:\d+\)"):
        ws.lower(bad)
