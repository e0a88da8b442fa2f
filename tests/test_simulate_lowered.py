"""The lowered kernels run in the CPU simulator and match the torch reference; protocol bugs
introduced by editing the printed IR are caught (deadlock with every blocked role, or a race
naming slot, writer and reader) instead of giving a silent wrong answer."""

import re

import pytest
import torch

import wsched as ws
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import DeadlockError, ProtocolError, RaceError, simulate

from fusions import inputs_for, linear_relu_residual, matmul, mlp, scaled_silu_f32

SMALL = dict(tile=(128, 128, 64))   # a 128-column tile keeps six stages inside shared memory


def rel_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check(k, fusion, M, N, K, seed, num_sms=4):
    inputs = inputs_for(fusion, M, N, K, seed=seed)
    out = k.simulate(*inputs, seed=seed, num_sms=num_sms)
    assert not torch.isnan(out.float()).any(), "outputs never written"
    assert rel_error(out, fusion.reference(*inputs)) < 1e-2


# M, N, K: not dividing the tile; K smaller than one k tile; fewer and more tiles than CTAs.
ODD_SHAPES = [(200, 136, 152), (96, 72, 40), (130, 264, 72), (520, 264, 64)]   # K: TMA rows are 16-byte aligned


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("fusion", [matmul, mlp, linear_relu_residual], ids=lambda f: f.name)
def test_stages_one_to_six(fusion, stages):
    k = ws.compile(fusion, build=False, stages=stages, **SMALL)
    for i, (M, N, K) in enumerate(ODD_SHAPES[:2]):
        check(k, fusion, M, N, K, seed=stages * 10 + i)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("M,N,K", ODD_SHAPES)
def test_default_schedule_odd_shapes_several_interleavings(M, N, K, seed):
    check(ws.compile(mlp, build=False), mlp, M, N, K, seed=seed, num_sms=3)


@pytest.mark.parametrize("overrides", [dict(epilogue="direct"), dict(raster="column", swizzle_group=2),
                                       dict(mma_inflight=0, stages=2)], ids=str)
def test_schedule_variants(overrides):
    for fusion in (linear_relu_residual, scaled_silu_f32):
        check(ws.compile(fusion, build=False, **SMALL, **overrides), fusion, 330, 264, 200, seed=5, num_sms=2)


@pytest.mark.parametrize("fusion, M, N, K", [(matmul, 70, 257, 100), (mlp, 130, 300, 36), (matmul, 33, 8, 7)],
                         ids=["rows_of_odd_k_and_n", "mlp_k36", "k7"])
def test_rows_tma_cannot_read_are_staged(fusion, M, N, K):
    """K and N whose rows are no multiple of 16 bytes (a vocabulary of 50257 columns): the
    inputs are read from aligned copies and the output written to an aligned buffer, then copied
    into the contiguous output, as on the GPU (CompiledKernel._run_staged)."""
    inputs = inputs_for(fusion, M, N, K, seed=7)
    out = ws.compile(fusion, build=False, **SMALL).simulate(*inputs, num_sms=2)
    assert out.is_contiguous() and out.shape == (M, N)
    assert rel_error(out, fusion.reference(*inputs)) < 1e-2


def test_a_transposed_weight_is_staged():
    """A [K, N] weight passed as the transposed view of an [N, K] one (innermost stride K)."""
    a, b = inputs_for(matmul, 100, 136, 72, seed=3)
    b_t = b.t().contiguous().t()
    assert b_t.stride() == (1, 72)
    out = ws.compile(matmul, build=False, **SMALL).simulate(a, b_t, num_sms=2)
    assert rel_error(out, matmul.reference(a, b)) < 1e-2


def test_more_tiles_than_ctas_each_cta_walks_several():
    k = ws.compile(matmul, build=False, **SMALL)
    check(k, matmul, 512, 512, 128, seed=2, num_sms=3)   # 16 tiles on 3 CTAs


def test_256_cubed():   # its time is reported by benchmarks/compile_time.py
    check(ws.compile(mlp, build=False), mlp, 256, 256, 256, seed=0)


# --- protocol mutations: edit the printed IR, parse it back, simulate ------------------------------

def mutated(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) >= count, f"{old!r} not in the IR"
    return text.replace(old, new, count)


def run_text(text, fusion=mlp, M=200, N=136, K=330, seed=0):
    kernel = parse_kernel(text)
    inputs = dict(zip([n.id for n in fusion.inputs], inputs_for(fusion, M, N, K)))
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    simulate(kernel, {**inputs, "out": out, "M": M, "N": N, "K": K}, num_sms=2, seed=seed)
    return out


def base_ir(**overrides) -> str:
    return print_kernel(ws.lower(mlp, **SMALL, **overrides))


def test_unmutated_ir_runs_cleanly():
    out = run_text(base_ir())
    assert not torch.isnan(out.float()).any()


def test_wrong_consumer_phase_parity_is_a_race():
    text = mutated(base_ir(), "mbarrier.wait full[s] phase(ph)", "mbarrier.wait full[s] phase(ph ^ 1)")
    with pytest.raises(RaceError, match=r"read of slot [AB]\[\d.*before (any write to it|its TMA load completed)"):
        run_text(text)


def test_missing_consumer_release_deadlocks_and_lists_every_blocked_role():
    text = mutated(base_ir(), "mbarrier.arrive empty[prev_s]", "")
    text = mutated(text, "mbarrier.arrive empty[last_s]", "")
    with pytest.raises(DeadlockError) as info:
        run_text(text)
    message = str(info.value)
    assert re.search(r"CTA \d producer wg0: mbarrier\.wait empty\[\d\] phase\(\d\)", message)
    assert re.search(r"CTA \d consumer wg[01]: mbarrier\.wait full\[\d\] phase\(\d\)", message)


def test_expect_tx_short_by_one_tile_is_reported():
    text = mutated(base_ir(), "bytes(32768)", "bytes(16384)")
    with pytest.raises(ProtocolError, match=r"expect_tx mismatch on full\[\d\].*expected 16384 bytes"):
        run_text(text)


def test_expect_tx_long_by_one_tile_deadlocks():
    text = mutated(base_ir(), "bytes(32768)", "bytes(49152)")
    with pytest.raises(DeadlockError, match=r"mbarrier\.wait full\[\d\] phase\(0\)"):
        run_text(text)


def test_release_before_wgmma_wait_is_a_race():
    text = base_ir(mma_inflight=0, stages=2)
    text = mutated(text, "wgmma.wait 0\n        mbarrier.arrive empty[s]", "mbarrier.arrive empty[s]\n        wgmma.wait 0")
    with pytest.raises(RaceError, match=r"overwrites slot [AB]\[\d.*reader released the slot before its wgmma\.wait"):
        for seed in range(6):   # the overwrite needs the producer to win the race once
            run_text(text, seed=seed)


def test_one_stage_with_one_mma_in_flight_deadlocks():
    # The consumer would release stage 0 of iteration k-1 only after waiting for iteration k's
    # load, which the producer can only issue into that same stage once it is released.
    text = base_ir(stages=2)
    for old, new in (("% 2", "% 1"), ("/ 2", "/ 1"), ("[2, 2, 64, 64]", "[1, 2, 64, 64]"),
                     ("[2, 128, 64]", "[1, 128, 64]"), ("[2, 2, 64, 64]", "[1, 2, 64, 64]"),
                     ("full[2]", "full[1]"), ("empty[2]", "empty[1]")):
        text = text.replace(old, new)
    with pytest.raises(DeadlockError, match=r"(?s)producer wg0: mbarrier\.wait empty\[0\] phase\(0\).*"
                                            r"consumer wg[01]: mbarrier\.wait full\[0\] phase\(1\)"):
        run_text(text)


def test_producer_starting_at_phase_zero_deadlocks():
    text = mutated(base_ir(), "mbarrier.wait empty[s] phase(ph ^ 1)", "mbarrier.wait empty[s] phase(ph)")
    with pytest.raises(DeadlockError, match=r"producer wg0: mbarrier\.wait empty\[0\] phase\(0\)"):
        run_text(text)

