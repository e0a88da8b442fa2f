"""The simulator runs what the GPU runs: expressions as the emitted CUDA computes them (32-bit
`int` with C's truncating `/` and `%`, an overflow is an error; fp32 floats), register tiles
that start undefined, named barriers counted in warps, and a warpgroup's elected thread as a
thread of its own. Each check is shown on a real lowered kernel: a mutation of its printed IR is
caught with its message, and the unmutated kernel runs clean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import wsched as ws
from wsched.lowering import ir
from wsched.lowering.evaluate import evaluate
from wsched.lowering.parser import parse_expr, parse_kernel
from wsched.lowering.printer import print_kernel
from wsched.lowering.simulate import (DeadlockError, ProtocolError, RaceError, SimulationError, VerifyError,
                                      simulate)
from wsched.lowering.simulate.machine import Machine

from attention_fusions import attention_inputs, make_attention
from fusions import inputs_for, mlp

SMALL = dict(tile=(128, 128, 64))   # 3 stages; M=200, N=136 gives 4 tiles, 2 per CTA on 2 SMs


def mutated(text: str, old: str, new: str, count: int = 1) -> str:
    """`text` with `old` replaced by `new` exactly `count` times (all of them must be there)."""
    assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in the IR, not {count}"
    return text.replace(old, new)


def mlp_ir(**overrides) -> str:
    return print_kernel(ws.lower(mlp, **SMALL, **overrides))


def mlp_args(M=200, N=136, K=330) -> dict:
    inputs = dict(zip([n.id for n in mlp.inputs], inputs_for(mlp, M, N, K)))
    return {**inputs, "out": torch.full((M, N), float("nan"), dtype=torch.bfloat16), "M": M, "N": N, "K": K}


def run_mlp(text: str, seed: int = 0, **shape) -> torch.Tensor:
    args = mlp_args(**shape)
    simulate(parse_kernel(text), args, num_sms=2, seed=seed)
    return args["out"]


def run_unverified(text: str, seed: int = 0, **shape) -> None:
    """The simulator alone (`simulate` without its structural verify): its run-time checks are
    the backstop for what the verifier cannot decide statically (ids from loop variables)."""
    Machine(parse_kernel(text), mlp_args(**shape), num_sms=2, seed=seed, max_steps=5_000_000).run()


ATTENTION = make_attention(64, causal=True, lse=True)


def run_attention(text: str, seed: int = 0) -> torch.Tensor:
    q, k, v = attention_inputs(1, 2, 200, 333, 64, seed=1)
    o = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    args = {"q": q, "k_in": k, "v": v, "o": o, "lse": torch.full((1, 2, 200, 1), float("nan")),
            "batch0": 1, "batch1": 2, "S": 200, "T": 333}
    simulate(parse_kernel(text), args, num_sms=2, seed=seed)
    return o


def test_unmutated_kernels_run_clean():
    for seed in range(2):
        assert not torch.isnan(run_mlp(mlp_ir(), seed=seed).float()).any()
        assert not torch.isnan(run_attention(print_kernel(ws.lower(ATTENTION)), seed=seed).float()).any()


# ---------------------------------------------------------------------------------------------
# Expressions: the CUDA's `int` and `float`
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, env, value", [
    ("-7 / 2", {}, -3), ("-7 % 2", {}, -1), ("7 / -2", {}, -3), ("7 % -2", {}, 1),
    ("-1 / 3", {}, 0), ("-1 % 3", {}, -1),                 # `prev_it = -1` of attention's first block
    ("(it - 3) / 3 & 1", {"it": 1}, 0),                   # floor division would give 1
    ("ceil_div(M, 128)", {"M": 300}, 3), ("ceil_div(-5, 4)", {}, 0),   # wsp::ceil_div: (a + b - 1) / b
    ("M * 2", {"M": 2**30 - 1}, 2**31 - 2), ("-2147483647 - 1", {}, -2**31),
    ("7.0 / 2", {}, 3.5), ("1.0 / 0.0", {}, float("inf")), ("0.1 + 0.2", {}, 0.30000001192092896),   # fp32
    ("min(1, 0.5)", {}, 0.5), ("16777217 == 16777216.0", {}, 1),    # the int converted to fp32, as in C
    ("n >> 1", {"n": -9}, -5), ("select(n < 0, 1 / 0, 2)", {"n": 1}, 2),   # `?:` evaluates one side
])
def test_expressions_evaluate_as_the_cuda_does(text, env, value):
    assert evaluate(parse_expr(text), env) == value


@pytest.mark.parametrize("text, env, message", [
    ("M * M", {"M": 65536}, "integer overflow: 65536 * 65536 = 4294967296 does not fit the CUDA's 32-bit int "
                            "[-2147483648, 2147483647] (signed overflow is undefined on the GPU) in M * M"),
    ("2147483647 + 1", {}, "integer overflow: 2147483647 + 1 = 2147483648"),
    ("ceil_div(M, 128)", {"M": 2**31 - 1}, r"integer overflow: ceil_div(2147483647, 128): 2147483647 + 128"),
    ("-2147483648 / -1", {}, "integer overflow: -2147483648 / -1 = 2147483648"),
    ("1 << 31", {}, "integer overflow: 1 << 31 = 2147483648"),
    ("1 << 32", {}, "shift count 32 is outside [0, 32)"),
    ("8 * 2147483648", {}, "the integer constant 2147483648 does not fit the CUDA's 32-bit int"),
    ("M % 0", {"M": 3}, "integer modulo by zero in M % 0"),
    ("x % 2.0", {"x": 5}, "'%' needs integers, got 5 and 2.0"),
    ("ceil_div(x, 2)", {"x": 5.0}, "'ceil_div' needs integers"),
])
def test_expressions_without_a_cuda_value_are_errors(text, env, message):
    with pytest.raises(ValueError) as info:
        evaluate(parse_expr(text), env)
    assert message in str(info.value)


def scalar_kernel(*body: ir.Stmt) -> ir.Kernel:
    return ir.Kernel(
        name="scalar", params=(ir.ScalarParam("n", "i32"), ir.GlobalParam("out", "f32", (ir.const(1), ir.const(1)))),
        grid=ir.const(1), cluster=(1, 1, 1), smem=(), barriers=(),
        body=(ir.RegDecl("t", "f32", (1, 1)), *body,
              ir.TileStoreGlobal("out", (ir.const(0), ir.const(0)), "t")))


def test_the_simulator_computes_with_the_same_definition():
    out = torch.zeros(1, 1)
    simulate(scalar_kernel(ir.Let("x", parse_expr("(n - 3) / 3 & 1")), ir.TileFill("t", ir.Var("x"))),
             {"n": 1, "out": out})
    assert out.item() == 0


def test_an_overflow_in_the_kernel_names_the_statement():
    kernel = scalar_kernel(ir.Let("x", parse_expr("n * n")), ir.TileFill("t", ir.Var("x")))
    with pytest.raises(ProtocolError, match=r"^integer overflow: 65536 \* 65536 = 4294967296 does not fit the "
                                            r"CUDA's 32-bit int .* in CTA 0 wg0: let x = n \* n \(IR line 3\)$"):
        simulate(kernel, {"n": 65536, "out": torch.zeros(1, 1)})


def test_a_loop_variable_stepping_past_int_max_is_an_overflow():
    loop = ir.For("i", ir.const(2**31 - 8), ir.const(2**31 - 1), ir.const(4), "serial",
                  (ir.TileFill("t", ir.const(1.0)),))
    with pytest.raises(ProtocolError, match=r"integer overflow: the loop variable i steps from 2147483644 to "
                                            r"2147483648, past the CUDA's 32-bit int maximum"):
        simulate(scalar_kernel(loop), {"n": 0, "out": torch.zeros(1, 1)})


def test_a_grid_that_overflows_is_reported():
    kernel = dataclasses.replace(scalar_kernel(ir.TileFill("t", ir.const(0.0))), grid=parse_expr("ceil_div(n, 128)"))
    with pytest.raises(SimulationError, match=r"grid ceil_div\(n, 128\) has no value with these arguments: integer "
                                              r"overflow: ceil_div\(2147483647, 128\): 2147483647 \+ 128"):
        simulate(kernel, {"n": 2**31 - 1, "out": torch.zeros(1, 1)})


def test_i32_arguments_must_fit_an_int():
    with pytest.raises(SimulationError, match=r"argument 'n' is i32 but got 2147483648 \(an integer in "
                                              r"\[-2147483648, 2147483647\]\)"):
        simulate(scalar_kernel(ir.TileFill("t", ir.const(0.0))), {"n": 2**31, "out": torch.zeros(1, 1)})


@pytest.mark.parametrize("seed", range(2))
def test_producer_phase_by_floor_division_deadlocks_as_on_the_gpu(seed):
    """`(it - 3) / 3 & 1` equals `ph ^ 1` under floor division; C truncates (-2 / 3 == 0), so at
    it = 1 the producer waits for a phase of empty[1] that never completes."""
    text = mutated(mlp_ir(), "mbarrier.wait empty[s] phase(ph ^ 1)", "mbarrier.wait empty[s] phase((it - 3) / 3 & 1)")
    with pytest.raises(DeadlockError, match=r"CTA 0 producer wg0: mbarrier\.wait empty\[1\] phase\(0\) — barrier at "
                                            r"phase parity 0, 2 of 2 arrivals pending, tx 0 \(IR line \d+; "
                                            r"loop tile=0, k=1\)"):
        run_mlp(text, seed=seed)


# ---------------------------------------------------------------------------------------------
# Register tiles start undefined; so do smem slots
# ---------------------------------------------------------------------------------------------


def test_running_sum_without_its_fill_is_read_before_written():
    text = mutated(print_kernel(ws.lower(ATTENTION)), "tile.fill l_run, 0.0\n", "")
    with pytest.raises(ProtocolError, match=r"read of register tile l_run before any write to it since its `reg` "
                                            r"declaration: on the GPU its registers hold whatever was there .*"
                                            r"`tile.fill l_run, 0.0` .*: CTA \d consumer wg[01]: tile\.mul l_run, "
                                            r"l_run, corr \(IR line \d+; loop tile=\d+, k=0\)"):
        run_attention(text)


def test_accumulating_into_an_unwritten_accumulator_is_read_before_written():
    text = mutated(mlp_ir(), "accumulate(k > 0)", "accumulate(1)")
    with pytest.raises(ProtocolError, match=r"read of register tile acc before any write .*: CTA \d consumer "
                                            r"wg[01]: wgmma\.mma acc, A\[0, [01]\], B\[0\] major\(k, n\) "
                                            r"accumulate\(1\) \(IR line \d+; loop tile=\d+, k=0\)"):
        run_mlp(text)


def test_a_stage_half_loaded_is_read_before_written():
    text = mutated(mlp_ir(), "          tma.load B[s, 1] <- b[k * 64, n0 + 64] bar(full[s])\n", "")
    text = mutated(text, "bytes(32768)", "bytes(24576)")
    with pytest.raises(RaceError, match=r"read of slot B\[0\] before any write to it \(did the reader wait on "
                                        r"the right barrier and phase\?\): reader CTA \d consumer wg[01]: "
                                        r"wgmma\.mma acc, A\[0, [01]\], B\[0\] .* \(IR line \d+; loop tile=\d+, k=0\)"):
        run_mlp(text)


# ---------------------------------------------------------------------------------------------
# Named barriers count warps
# ---------------------------------------------------------------------------------------------

SHARED_ID = (r"named barrier 1 counts 128 threads \(4 warps\) but consumer wg0 and consumer wg1 arrive at it "
             r"\(256 threads\) without being ordered: on the GPU a round completes with the first 4 warps to "
             r"arrive, which can mix warps of different warpgroups.*give each group its own barrier id .* or "
             r"count every participating thread \(`bar.sync 1, 256`\): CTA \d consumer wg[01]: bar.sync 1, 128 "
             r"\(IR line \d+; loop tile=\d+\); concurrent arrival CTA \d consumer wg[01]: bar.sync 1, 128")


def test_two_warpgroups_sharing_one_128_thread_barrier():
    text = mutated(mlp_ir(), "bar.sync 1 + wg, 128", "bar.sync 1, 128", count=2)
    with pytest.raises((VerifyError, SimulationError)):   # caught before the GPU, by either layer
        run_mlp(text)
    for seed in range(3):
        with pytest.raises(ProtocolError, match=SHARED_ID):
            run_unverified(text, seed=seed)


def test_barrier_ids_from_the_tile_counter_are_checked_at_run_time():
    """Ids 1 and 2 alternate per tile: with one k step per tile nothing orders warpgroup 1's
    epilogue of one tile before warpgroup 0's of the next, which uses the same id."""
    text = mutated(mlp_ir(), "bar.sync 1 + wg, 128", "bar.sync 1 + (wg + tile_iter) % 2, 128", count=2)
    for seed in range(3):
        with pytest.raises(ProtocolError, match=r"named barrier [12] counts 128 threads .* but consumer wg0 and "
                                                r"consumer wg1 arrive at it \(256 threads\) without being ordered"):
            run_unverified(text, seed=seed, K=64)
    run_unverified(text, K=330)   # 6 k steps over 3 stages: the mbarrier chain orders the epilogues


def test_one_256_thread_barrier_for_both_warpgroups_is_fine():
    out = run_mlp(mutated(mlp_ir(), "bar.sync 1 + wg, 128", "bar.sync 1, 256", count=2))
    assert not torch.isnan(out.float()).any()


def test_a_round_that_takes_part_of_a_warpgroup():
    """At kernel level every warpgroup arrives: 320 of the 384 threads complete the round and
    the last two warps wait for one that never fills."""
    text = mutated(mlp_ir(), "  syncthreads\n", "  syncthreads\n  bar.sync 5, 320\n")
    with pytest.raises(ProtocolError, match=r"named barrier 5 counts 320 threads, not a multiple of the warpgroups "
                                            r"that arrive: wg\d brings 128 threads when 64 complete the round"):
        run_unverified(text)


# ---------------------------------------------------------------------------------------------
# The elected thread is a thread of its own: the TMA-store staging tile
# ---------------------------------------------------------------------------------------------

WAIT_THEN_SYNC = "  tma.wait.read 0\n      }\n      bar.sync 1 + wg, 128\n"
FENCE_THEN_SYNC = "fence.proxy.async\n      bar.sync 1 + wg, 128\n"


@pytest.mark.parametrize("seed", range(2))
def test_staging_tile_rewritten_before_the_warpgroup_knows_the_store_read_it(seed):
    text = mutated(mlp_ir(), WAIT_THEN_SYNC, "  tma.wait.read 0\n      }\n")
    with pytest.raises(RaceError, match=r"tile\.store_smem overwrites slot C_bf16\[[01], [0-3]\] while the TMA store may "
                                        r"still be reading it: the elected thread's tma\.wait\.read that ends the "
                                        r"read is not yet known to the other threads of consumer wg[01], which "
                                        r"write the slot; put `bar\.sync` over the warpgroup's threads between "
                                        r"`elect_one \{ tma\.wait\.read \.\.\. \}` and the write: writer CTA \d "
                                        r"consumer wg[01]: tile\.store_smem C_bf16\[[01], [0-3]\] <- slice_t \(IR line "
                                        r"\d+; loop tile=\d+, j=[0-3]\); TMA store CTA \d consumer wg[01] \(elected thread\): "
                                        r"tma\.store .*; wait CTA \d consumer wg[01] \(elected thread\): "
                                        r"tma\.wait\.read 0"):
        run_mlp(text, seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_staging_tile_stored_before_the_warpgroup_finished_writing_it(seed):
    text = mutated(mlp_ir(), FENCE_THEN_SYNC, "fence.proxy.async\n")
    with pytest.raises(RaceError, match=r"TMA store by the elected thread reads slot C_bf16\[[01], 0\] that every "
                                        r"thread of consumer wg[01] wrote \(tile\.store_smem\) with no barrier of "
                                        r"the warpgroup in between.*: reader CTA \d consumer wg[01]: tma\.store "):
        run_mlp(text, seed=seed)
