"""Stream-K matmul (`stream_k=True`): all output tiles' k steps in a row, split evenly over the
CTAs (`unit_steps` each); a CTA walks the tiles its range touches, the last first, and a tile
whose k steps lie in several CTAs' ranges is finished as a split-K tile is (fp32 partials, a
ticket per (tile, consumer warpgroup), the last CTA to arrive sums in CTA order, its own partial
from its registers).

Golden IR, the schedule's checks, the simulator against torch (tiles in one to five CTAs' ranges,
CTAs that take one tile, two or three), the same bits whichever CTA arrives last, and the protocol
broken on purpose (a race or a ticket left non-zero, caught by the simulator).
"""

from __future__ import annotations

import re

import pytest
import torch

import wsched as ws
from fusions import gated, inputs_for, linear_relu_residual, matmul, mlp, scaled_silu_f32, simulated_under_interleavings
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import ProtocolError, RaceError, simulate
from wsched.schedule import ScheduleError


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(scope="module")
def sk():
    return ws.compile(matmul, stream_k=True, build=False)


# --- the kernel --------------------------------------------------------------------------------

def test_stream_k_final_ir_is_golden(golden):
    golden.check("matmul_stream_k.ir", print_kernel(ws.lower(matmul, stream_k=True)))


def test_host_params_grid_and_the_tile_walk(sk):
    text = sk.ir
    assert ("i32 unit_steps = ceil_div(ceil_div(M, 128) * ceil_div(N, 256) * ceil_div(K, 64), num_sms), "
            "i32 splits = ceil_div(ceil_div(K, 64), unit_steps) + 1") in text
    assert "grid(ceil_div(ceil_div(M, 128) * ceil_div(N, 256) * ceil_div(K, 64), unit_steps))" in text
    assert text.count("for tile in persistent(0, sk_last - sk_begin / k_tiles + 1, 1) {") == 2   # both roles
    assert "let out_tile = sk_last - tile" in text
    assert "atomic.inc ticket_slot[wg] <- tickets[out_tile * 2 + wg] wrap(tile_splits - 1)" in text
    assert "tile.load part_t <- partials[src_split, m0 + wg * 64, n0 + j * 64]" in text
    assert "if src_split == split {" in text


@pytest.mark.parametrize("overrides, message", [
    (dict(stream_k=1), r"stream_k=1 must be True or False \(True: the call's k steps split evenly over the CTAs\)"),
    (dict(stream_k=True, split_k=4), r"stream_k=True with split_k=4: stream-K chooses its own splits; use split_k=1"),
    (dict(stream_k=True, tile=(128, 128, 64), mode="pingpong"),
     r"stream_k=True with mode 'pingpong': a split tile's ticket is per tile, not per warpgroup's tile; use mode "
     r"'cooperative'"),
    (dict(stream_k=True, cluster=(2, 1, 1)),
     r"cluster \(2, 1, 1\) with stream_k=True: a cluster's CTAs walk whole tiles together; use stream_k=False or "
     r"cluster \(1, 1, 1\)"),
    (dict(stream_k=True, tile=(256, 128, 64)),
     r"stream_k=True with 128 rows per consumer warpgroup: stream-K takes 64 rows per warpgroup"),
])
def test_schedule_checks(overrides, message):
    with pytest.raises(ScheduleError, match=message):
        ws.schedule_for(matmul, **overrides)
    assert ws.schedule_for(matmul, stream_k=True).short().endswith(" stream_k")


def test_a_batched_matmul_is_refused():
    from test_batched_matmul import bmm
    with pytest.raises(ScheduleError, match=r"is batched .*: stream-K takes 2-D matmuls only; use stream_k=False"):
        ws.lower(bmm, stream_k=True)


# --- the simulator against torch --------------------------------------------------------------

@pytest.mark.parametrize("M, N, K, num_sms", [
    (33, 200, 520, 3),      # one tile of 9 k steps over 3 CTAs (3 each)
    (33, 200, 520, 4),      # 3, 3, 3: the fourth CTA has no range (grid of 3)
    (1, 64, 640, 4),        # 10 k steps in ranges of 3: one tile in 4 CTAs
    (300, 520, 1000, 4),    # 9 tiles x 16 steps on 4 CTAs: 36 steps each, 3-4 tiles a CTA
    (130, 520, 640, 5),     # 6 tiles x 10 steps on 5: 12 each, ranges that end inside tiles
    (257, 513, 1100, 7),    # 15 tiles x 18 steps on 7: ragged in every dim
    (128, 256, 640, 3),     # one tile, 10 steps on 3 CTAs: 4, 4, 2
    (300, 520, 40, 4),      # one k step a tile: every tile in one CTA's range
])
def test_matches_torch(sk, M, N, K, num_sms):
    a, b = inputs_for(matmul, M, N, K, seed=M + K)
    out = sk.simulate(a, b, num_sms=num_sms)        # outputs NaN-poisoned first
    assert not torch.isnan(out.float()).any()
    assert rel_error(out, matmul.reference(a, b)) < 1e-2


def test_the_sum_is_the_same_bits_whichever_cta_arrives_last(sk):
    runs = simulated_under_interleavings(sk, 200, 264, 1000, num_sms=5)
    assert all(report.num_ctas == 5 for _, report in runs)
    assert all(torch.equal(runs[0][0], out) for out, _ in runs[1:])


@pytest.mark.parametrize("fusion", [mlp, gated, linear_relu_residual, scaled_silu_f32], ids=lambda f: f.name)
def test_fused_epilogues_run_on_the_sum(fusion):
    k = ws.compile(fusion, stream_k=True, build=False)
    x = inputs_for(fusion, 130, 264, 900, seed=2)
    out = k.simulate(*x, num_sms=5)
    assert not torch.isnan(out.float()).any()
    assert rel_error(out, fusion.reference(*x)) < 1e-2


def test_direct_epilogue_and_narrow_tiles():
    for overrides in (dict(epilogue="direct"), dict(tile=(128, 64, 64)), dict(tile=(64, 128, 64), consumer_warpgroups=1)):
        k = ws.compile(gated, stream_k=True, build=False, **overrides)
        x = inputs_for(gated, 100, 200, 700, seed=4)
        assert rel_error(k.simulate(*x, num_sms=6), gated.reference(*x)) < 1e-2, overrides


# --- the protocol is checked by the simulator ------------------------------------------------

def _mutant_run(text: str, M: int = 130, N: int = 520, K: int = 640, num_sms: int = 5):
    a, b = inputs_for(matmul, M, N, K, seed=1)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    simulate(parse_kernel(text), {"M": M, "N": N, "K": K, "a": a, "b": b, "out": out}, num_sms=num_sms)


# one tile of 10 k steps on 3 CTAs (4, 4, 2): all three run their part at once
ONE_TILE = dict(M=128, N=256, K=640, num_sms=3)


RACE = r"tile\.load of partials reads elements another warpgroup stored with no synchronisation between the store " \
       r"and this load"


# the fences in the IR's order: the tail's first ticket (acquire only: it stored nothing), its
# hand-over (release, acquire), the others' first ticket (release only) and hand-over (release,
# acquire); ONE_TILE's tail arrives first and hands over, 130 x 520's tails arrive last
@pytest.mark.parametrize("which, shape", [(0, {}), (1, ONE_TILE), (2, ONE_TILE), (3, {}), (4, ONE_TILE), (5, ONE_TILE)],
                         ids=["tail-acquire", "tail-hand-over-release", "tail-hand-over-acquire", "others-release",
                              "others-hand-over-release", "others-hand-over-acquire"])
def test_a_missing_gpu_fence_is_a_race(sk, which, shape):
    """One tile of 10 k steps on 3 CTAs: the tail (2 steps) arrives first and hands its partial
    over; 130 x 520 on 5 CTAs: the tails arrive last."""
    lines = sk.ir.split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == "fence.acq_rel.gpu"]
    assert len(hits) == 6
    with pytest.raises(RaceError, match=RACE):
        _mutant_run("\n".join(lines[:hits[which]] + lines[hits[which] + 1:]), **shape)


def test_the_tail_that_arrives_early_must_store_its_partial(sk):
    """Without the tail's store before its hand-over, the CTA that sums reads a partial no one
    wrote: the result is wrong (one tile on 3 CTAs, the tail first)."""
    lines = sk.ir.split("\n")
    i = next(i for i, line in enumerate(lines) if line.strip() == "if last_split == 0 {")
    assert lines[i + 1].strip().startswith("for j in unroll(0, 4, 1)") and "tile.store partials" in lines[i + 3]
    text = "\n".join(lines[:i + 1] + lines[i + 5:])
    a, b = inputs_for(matmul, 128, 256, 640, seed=1)
    out = torch.full((128, 256), float("nan"), dtype=torch.bfloat16)
    try:
        simulate(parse_kernel(text), {"M": 128, "N": 256, "K": 640, "a": a, "b": b, "out": out}, num_sms=3)
    except (ProtocolError, RaceError):
        return
    assert torch.isnan(out.float()).any() or rel_error(out, matmul.reference(a, b)) > 0.1


def test_partials_read_without_the_ticket_are_a_race(sk):
    with pytest.raises(RaceError, match=RACE):
        _mutant_run(sk.ir.replace("set last_split = ticket == tile_splits - 1", "set last_split = 1"), **ONE_TILE)


def test_tickets_must_wrap_back_to_zero(sk):
    with pytest.raises(ProtocolError, match=r"workspace tickets is declared zeroed but the kernel left \d+ "
                                            r"element\(s\) non-zero"):
        _mutant_run(sk.ir.replace("wrap(tile_splits - 1)", "wrap(tile_splits)"))


def test_the_tiles_split_count_must_match_the_ranges(sk):
    """A tile's CTAs counted one short: a tile in three ranges wraps its ticket early (a CTA sums
    partials not yet released: a race); a tile in two counts as unsplit, each CTA storing its own
    part as the result (wrong values, caught against torch)."""
    text = sk.ir.replace("let tile_splits = (tile_k0 + k_tiles - 1) / unit_steps - first_cta + 1",
                         "let tile_splits = (tile_k0 + k_tiles - 1) / unit_steps - first_cta")
    assert text != sk.ir
    with pytest.raises(RaceError, match=RACE):
        _mutant_run(text, **ONE_TILE)
    a, b = inputs_for(matmul, 130, 520, 640, seed=1)
    out = torch.full((130, 520), float("nan"), dtype=torch.bfloat16)
    simulate(parse_kernel(text), {"M": 130, "N": 520, "K": 640, "a": a, "b": b, "out": out}, num_sms=5)
    assert rel_error(out, matmul.reference(a, b)) > 0.1


def test_the_kernel_text_round_trips(sk):
    assert print_kernel(parse_kernel(sk.ir)) == sk.ir
    assert re.search(r"\bsk_begin\b", sk.ir) and re.search(r"\bunit_steps\b", sk.ir)


@pytest.mark.nvcc
@pytest.mark.parametrize("fusion, overrides", [(matmul, {}), (gated, {}), (scaled_silu_f32, {}),
                                               (matmul, dict(tile=(128, 192, 64)))], ids=str)
def test_stream_k_kernels_build_for_sm90a_without_spills(fusion, overrides):
    k = ws.compile(fusion, stream_k=True, **overrides)
    assert k.build.resources[k.kernel.name].spill_stores == 0


def test_the_search_space_holds_stream_k_for_2d_matmuls_only():
    from test_batched_matmul import bmm
    from wsched.workloads.matmul import MATMUL

    space = [s for s in MATMUL.schedule_space(mlp) if s.stream_k]
    assert [s.tile for s in space] == [(128, 256, 64), (128, 192, 64), (128, 128, 64)]
    assert ws.schedule_for(matmul, stream_k=True) in list(MATMUL.schedule_space(matmul))
    assert not any(s.stream_k for s in MATMUL.schedule_space(bmm))
