"""The CPU simulator: reference numbers for a hand-built warp-specialized matmul, and every
protocol bug we know of caught with a message that names it.

`matmul_kernel` is the test fixture: the kernel shape the lowering is meant to produce
(producer: setmaxnreg.dec, elected thread, persistent tile loop x k loop, wait empty ->
arrive_expect_tx -> two TMA loads; consumers: wait full -> wgmma -> wait -> release; epilogue
by plain stores or by smem + TMA store). `mutate` breaks it in one named way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wsched.lowering import ir
from wsched.lowering.ir import Var, add, band, ceil_div, div, mod, mul, sub
from wsched.lowering.simulate import (DeadlockError, ProtocolError, RaceError, SimulationError,
                                      SimulatorInternalError, VerifyError, simulate)
from wsched.lowering.simulate.machine import Machine
from wsched.lowering.simulate.tiles import BINARY_SEMANTICS, UNARY_SEMANTICS

MUTATIONS = ("consumer_phase", "no_release", "expect_tx_short", "expect_tx_long",
             "release_before_wait", "producer_phase0", "no_fence", "no_init", "no_syncthreads",
             "skipped_syncthreads", "no_wgmma_wait", "acc_read_early", "no_store_wait")


def matmul_kernel(bn: int = 64, bk: int = 32, stages: int = 2, consumers: int = 2, *,
                  epilogue: str = "direct", mutate: str | None = None) -> ir.Kernel:
    """C[M, N] = A[M, K] @ B[N, K]^T in bf16 with fp32 accumulation; tile (64*consumers, bn, bk)."""
    assert mutate is None or mutate in MUTATIONS, mutate
    bm = 64 * consumers
    tile_bytes = (bm * bk + bn * bk) * 2
    M, N, K = Var("M"), Var("N"), Var("K")
    s, ph, wg = Var("s"), Var("ph"), Var("wg")

    def tile_lets():
        return (ir.Let("tile_iter", div(sub("tile", "cta_id"), "num_ctas")),
                ir.Let("m0", mul(div("tile", "n_tiles"), bm)),
                ir.Let("n0", mul(mod("tile", "n_tiles"), bn)))

    def stage_lets():
        return (ir.Let("it", add(mul("tile_iter", "k_tiles"), "k")),
                ir.Let("s", mod("it", stages)),
                ir.Let("ph", band(div("it", stages), 1)))

    def tile_loop(body):
        return ir.For("tile", Var("cta_id"), Var("num_tiles"), Var("num_ctas"), "persistent",
                      tile_lets() + tuple(body))

    def k_loop(body):
        return ir.For("k", ir.const(0), Var("k_tiles"), ir.const(1), "serial", stage_lets() + tuple(body))

    full, empty = ir.BarRef("full", s), ir.BarRef("empty", s)
    expect = tile_bytes + {"expect_tx_short": -bn * bk * 2, "expect_tx_long": bn * bk * 2}.get(mutate, 0)
    producer_phase = ph if mutate == "producer_phase0" else ir.BinOp("^", ph, ir.const(1))
    producer = ir.Role("producer", 1, 40, (
        ir.Setmaxnreg("dec", 40),
        ir.ElectOne((tile_loop([k_loop([
            ir.MbarrierWait(empty, producer_phase),
            ir.MbarrierArriveExpectTx(full, ir.const(expect)),
            ir.TmaLoad(ir.SmemRef("A", (s,)), "a", (Var("m0"), mul("k", bk)), full),
            ir.TmaLoad(ir.SmemRef("B", (s,)), "b", (Var("n0"), mul("k", bk)), full),
        ])]),)),
        ir.Return(),
    ))

    consumer_phase = ir.BinOp("^", ph, ir.const(1)) if mutate == "consumer_phase" else ph
    mma = [ir.WgmmaFence(),
           ir.Wgmma("acc", ir.SmemRef("A", (s, wg)), ir.SmemRef("B", (s,)), "k", "k", ir.const(1)),
           ir.WgmmaCommit()]
    release = [] if mutate == "no_release" else [ir.MbarrierArrive(empty)]
    wait = [] if mutate in ("no_wgmma_wait", "acc_read_early") else [ir.WgmmaWait(0)]
    k_body = [ir.MbarrierWait(full, consumer_phase)] + mma
    k_body += release + wait if mutate == "release_before_wait" else wait + release
    row = add("m0", mul(wg, 64))
    if epilogue == "direct":
        store = [ir.TileStoreGlobal("c", (row, Var("n0")), "out_t")]
        tail = []
    else:   # as the lowering's epilogue: staging tile per warpgroup, a warpgroup barrier around it
        fence = [] if mutate == "no_fence" else [ir.FenceProxyAsync()]
        sync_wg = ir.NamedBarrierSync(add(1, wg), 128)
        store = [*([] if mutate == "no_store_wait" else [ir.ElectOne((ir.TmaWait(0, read=True),))]), sync_wg,
                 ir.TileStoreSmem(ir.SmemRef("C", (wg,)), "out_t"), *fence, sync_wg,
                 ir.ElectOne((ir.TmaStore("c", (row, Var("n0")), ir.SmemRef("C", (wg,))), ir.TmaCommit()))]
        tail = [ir.ElectOne((ir.TmaWait(0, read=False),))]
    epilogue_stmts = ([ir.TileUnary("cast", "out_t", "acc")] if mutate != "acc_read_early"
                      else [ir.TileUnary("cast", "out_t", "acc"), ir.WgmmaWait(0)]) + store
    consumer = ir.Role("consumer", consumers, 232, (
        ir.Setmaxnreg("inc", 232),
        ir.RegDecl("acc", "f32", (64, bn)),
        ir.RegDecl("out_t", "bf16", (64, bn)),
        tile_loop([ir.TileFill("acc", ir.const(0.0)), k_loop(k_body)] + epilogue_stmts),
        *tail,
    ))

    c_param = (ir.GlobalParam("c", "bf16", (M, N)) if epilogue == "direct"
               else ir.TensorMapParam("c", "bf16", (M, N), (64, bn), 0))
    smem = [ir.SmemDecl("A", "bf16", (stages, consumers, 64, bk), 128),
            ir.SmemDecl("B", "bf16", (stages, bn, bk), 128)]
    if epilogue != "direct":
        smem.append(ir.SmemDecl("C", "bf16", (consumers, 64, bn), 0))
    setup = [] if mutate == "no_init" else [ir.MbarrierInit("full", 1)]
    setup += [ir.MbarrierInit("empty", consumers), ir.FenceMbarrierInit()]
    # skipped_syncthreads: the verifier sees a syncthreads after the inits, but it never runs.
    setup += {"no_syncthreads": [], "skipped_syncthreads": [ir.If(ir.lt(K, 0), (ir.SyncThreads(),))]}.get(
        mutate, [ir.SyncThreads()])
    return ir.Kernel(
        name="matmul",
        params=(ir.ScalarParam("M", "i32"), ir.ScalarParam("N", "i32"), ir.ScalarParam("K", "i32"),
                ir.TensorMapParam("a", "bf16", (M, K), (bm, bk), 128),
                ir.TensorMapParam("b", "bf16", (N, K), (bn, bk), 128),
                c_param),
        grid=Var("num_sms"),
        cluster=(1, 1, 1),
        smem=tuple(smem),
        barriers=(ir.BarrierDecl("full", stages), ir.BarrierDecl("empty", stages)),
        body=(ir.Let("n_tiles", ceil_div(N, bn)),
              ir.Let("num_tiles", mul(ceil_div(M, bm), "n_tiles")),
              ir.Let("k_tiles", ceil_div(K, bk)),
              *setup, producer, consumer),
    )


def run_matmul(m: int, n: int, k: int, *, seed: int = 0, num_sms: int = 4, **kernel_args):
    gen = torch.Generator().manual_seed(1234 + m + n + k)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    report = simulate(matmul_kernel(**kernel_args), {"M": m, "N": n, "K": k, "a": a, "b": b, "c": c},
                      num_sms=num_sms, seed=seed)
    expected = (a.float() @ b.float().T).to(torch.bfloat16)
    return c, expected, report


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n, k", [
    (128, 64, 64),     # one tile, K divides
    (200, 130, 100),   # nothing divides the tile
    (64, 40, 16),      # K < BK, fewer tiles than CTAs
    (300, 200, 70),    # 12 tiles over 4 CTAs
])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_matmul_matches_torch(m, n, k, stages):
    c, expected, report = run_matmul(m, n, k, stages=stages, seed=stages)
    torch.testing.assert_close(c.float(), expected.float(), rtol=2e-2, atol=2e-2)
    tiles = -(-m // 128) * -(-n // 64)
    assert report.num_ctas == 4
    assert report.tma_loads == 2 * tiles * -(-k // 32)
    assert report.wgmmas == 2 * tiles * -(-k // 32)
    assert report.barrier_phases >= 2 * tiles * -(-k // 32)


@pytest.mark.parametrize("seed", range(6))
def test_matmul_any_interleaving(seed):
    c, expected, _ = run_matmul(150, 100, 96, seed=seed, stages=3, num_sms=3)
    torch.testing.assert_close(c.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("consumers, bn, bk", [(1, 32, 16), (2, 128, 64)])
def test_matmul_tile_shapes(consumers, bn, bk):
    c, expected, _ = run_matmul(190, 150, 80, consumers=consumers, bn=bn, bk=bk, stages=2)
    torch.testing.assert_close(c.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", range(3))
def test_matmul_tma_store_epilogue(seed):
    c, expected, report = run_matmul(200, 100, 64, epilogue="tma_store", seed=seed)
    torch.testing.assert_close(c.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert report.tma_stores == 2 * 2 * 2


def test_seeds_change_the_interleaving():
    steps = {run_matmul(200, 130, 100, seed=seed)[2].steps for seed in range(4)}
    assert len(steps) > 1


def test_256_cubed():   # its time is reported by benchmarks/compile_time.py
    c, expected, report = run_matmul(256, 256, 256, bn=256, bk=64, stages=4, consumers=2)
    torch.testing.assert_close(c.float(), expected.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# Protocol bugs, each caught with its message
# ---------------------------------------------------------------------------------------------


def mutated(mutate: str, seed: int = 0, m: int = 200, n: int = 130, k: int = 100, **kernel_args):
    return run_matmul(m, n, k, mutate=mutate, seed=seed, **kernel_args)


@pytest.mark.parametrize("seed", range(3))
def test_wrong_consumer_phase_reads_before_load(seed):
    with pytest.raises(RaceError, match=r"read of slot (A\[0, [01]\]|B\[0\]) (before its TMA load completed|"
                                        r"before any write|not synchronized with its TMA load)"):
        mutated("consumer_phase", seed)


@pytest.mark.parametrize("seed", range(3))
def test_missing_release_deadlocks_listing_every_role(seed):
    with pytest.raises(DeadlockError) as info:
        mutated("no_release", seed)
    text = str(info.value)
    assert "deadlock" in text
    assert ("CTA 0 producer wg0: mbarrier.wait empty[0] phase(0) — barrier at phase parity 0, "
            "2 of 2 arrivals pending, tx 0") in text
    for wg in (0, 1):
        assert f"CTA 0 consumer wg{wg}: mbarrier.wait full[0] phase(1)" in text
    assert "(IR line 46; loop tile=0, k=2)" in text  # the IR line and loop variables where each one waits
    assert text.count("\n") == 4 * 3  # every blocked warpgroup of the 4 CTAs, one line each


@pytest.mark.parametrize("seed", range(4))
def test_expect_tx_short_by_one_tile(seed):
    with pytest.raises(ProtocolError, match=r"expect_tx mismatch on full\[0\] \(CTA \d\): expected 8192 bytes, "
                                            r"TMA delivered 12288"):
        mutated("expect_tx_short", seed)


def test_expect_tx_long_by_one_tile_deadlocks_showing_tx():
    with pytest.raises(DeadlockError, match=r"consumer wg0: mbarrier.wait full\[0\] phase\(0\) — barrier at phase "
                                           r"parity 0, 0 of 1 arrivals pending, tx 4096 \(expected 16384 bytes, "
                                           r"TMA delivered 12288\)"):
        mutated("expect_tx_long")


@pytest.mark.parametrize("seed", range(4))
def test_release_before_wgmma_wait(seed):
    with pytest.raises(RaceError, match=r"TMA load overwrites slot (A|B)\[\d(, \d)?\] .*(may still be reading|"
                                        r"before the reader's wgmma.wait)"):
        mutated("release_before_wait", seed, stages=2)


def test_producer_starting_at_phase_zero_deadlocks():
    with pytest.raises(DeadlockError) as info:
        mutated("producer_phase0")
    text = str(info.value)
    assert ("producer wg0: mbarrier.wait empty[0] phase(0) — barrier at phase parity 0, "
            "2 of 2 arrivals pending") in text
    assert "consumer wg1: mbarrier.wait full[0] phase(0) — barrier at phase parity 0, 1 of 1 arrivals pending" in text


@pytest.mark.parametrize("seed", range(2))
def test_missing_fence_before_tma_store(seed):
    with pytest.raises(RaceError, match=r"missing fence.proxy.async: TMA store reads slot C\[[01]\] written by "
                                        r"tile.store_smem"):
        mutated("no_fence", seed, epilogue="tma_store")


def test_barrier_used_before_init():
    with pytest.raises(ProtocolError, match=r"mbarrier full\[0\] used before mbarrier.init: "
                                            r"CTA \d (producer|consumer) wg\d: "):
        mutated("no_init")


def test_barrier_init_not_visible_without_syncthreads():
    with pytest.raises(ProtocolError, match=r"before its mbarrier.init is visible .*missing syncthreads"):
        mutated("skipped_syncthreads")


def test_missing_syncthreads_is_the_verifiers_to_report():
    with pytest.raises(VerifyError, match=r"IR line 12 \(role producer\): the barrier inits are not visible "
                                          r"to the roles yet"):
        mutated("no_syncthreads")


def test_acc_read_while_wgmma_pending():
    with pytest.raises(RaceError, match=r"acc read while wgmma pending \(missing wgmma.wait\): acc in CTA \d "
                                        r"consumer wg[01]: tile.cast out_t, acc"):
        mutated("acc_read_early", k=32)


@pytest.mark.parametrize("seed", range(2))
def test_no_wgmma_wait_overwrites_slot_still_read(seed):
    with pytest.raises(RaceError, match=r"TMA load overwrites slot .* while a wgmma may still be reading it"):
        mutated("no_wgmma_wait", seed)


@pytest.mark.parametrize("seed", range(2))
def test_store_smem_before_tma_store_read_it(seed):
    with pytest.raises(RaceError, match=r"tile.store_smem overwrites slot C\[[01]\] while a TMA store may still "
                                        r"be reading it \(the slot was released before tma.wait.read"):
        mutated("no_store_wait", seed, epilogue="tma_store", m=400)


def test_livelock_stops_at_max_steps():
    kernel = matmul_kernel()
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    b = torch.zeros(64, 64, dtype=torch.bfloat16)
    c = torch.zeros(128, 64, dtype=torch.bfloat16)
    with pytest.raises(DeadlockError, match=r"no progress / livelock: stopped after max_steps=50"):
        simulate(kernel, {"M": 128, "N": 64, "K": 64, "a": a, "b": b, "c": c}, max_steps=50)


def test_bad_arguments():
    kernel = matmul_kernel()
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    with pytest.raises(SimulationError, match="missing argument 'b'"):
        simulate(kernel, {"M": 128, "N": 64, "K": 64, "a": a})
    with pytest.raises(SimulationError, match=r"argument 'a' has shape \[128, 64\] but the kernel declares "
                                              r"a: bf16\[M, K\] = \[128, 32\]"):
        simulate(kernel, {"M": 128, "N": 64, "K": 32, "a": a, "b": torch.zeros(64, 32), "c": torch.zeros(128, 64)})


# ---------------------------------------------------------------------------------------------
# The other node kinds: tile math, plain global loads/stores, register-A and N-major wgmma,
# chunked smem, named barriers, expressions, static rules
# ---------------------------------------------------------------------------------------------


def softmax_gelu_kernel(rows_per_cta: int = 64, cols: int = 32) -> ir.Kernel:
    """y = softmax(gelu(x + bias) * scale) row by row, one CTA per 64 rows, no roles."""
    t, m, l, bias_t, y_t = "t", "m", "l", "bias_t", "y_t"
    row0 = mul("cta_id", rows_per_cta)
    return ir.Kernel(
        name="softmax_gelu",
        params=(ir.ScalarParam("R", "i32"), ir.ScalarParam("scale", "f32"),
                ir.GlobalParam("x", "f32", (Var("R"), ir.const(cols))),
                ir.GlobalParam("bias", "bf16", (ir.const(cols),)),
                ir.GlobalParam("y", "bf16", (Var("R"), ir.const(cols)))),
        grid=ceil_div("R", rows_per_cta), cluster=(1, 1, 1), smem=(), barriers=(),
        body=(ir.RegDecl(t, "f32", (rows_per_cta, cols)), ir.RegDecl(bias_t, "f32", (1, cols)),
              ir.RegDecl(m, "f32", (rows_per_cta, 1)), ir.RegDecl(l, "f32", (rows_per_cta, 1)),
              ir.RegDecl(y_t, "bf16", (rows_per_cta, cols)),
              ir.TileLoadGlobal(t, "x", (row0, ir.const(0))),
              ir.TileLoadGlobal(bias_t, "bias", (ir.const(0),)),
              ir.TileBinary("add", t, t, bias_t),
              ir.TileUnary("gelu", t, t),
              ir.TileBinary("mul", t, t, Var("scale")),
              ir.TileReduce("max", m, t, 1),
              ir.TileBinary("sub", t, t, m),
              ir.TileUnary("exp", t, t),
              ir.TileReduce("sum", l, t, 1),
              ir.TileBinary("div", t, t, l),
              ir.TileUnary("cast", y_t, t),
              ir.TileStoreGlobal("y", (row0, ir.const(0)), y_t)),
    )


@pytest.mark.parametrize("num_sms", [1, 4])  # 1: the three CTAs run one after another
def test_tile_ops_match_torch(num_sms):
    x = torch.randn(150, 32)
    bias = torch.randn(32).to(torch.bfloat16)
    y = torch.zeros(150, 32, dtype=torch.bfloat16)
    report = simulate(softmax_gelu_kernel(), {"R": 150, "scale": 0.5, "x": x, "bias": bias, "y": y}, num_sms=num_sms)
    assert report.num_ctas == 3
    expected = torch.softmax(torch.nn.functional.gelu(x + bias.float()) * 0.5, dim=1).to(torch.bfloat16)
    torch.testing.assert_close(y.float(), expected.float(), rtol=1e-2, atol=1e-3)


def attention_block_kernel(*, fence_before_pv: bool = True, fence_before_store: bool = True,
                           barrier_before_store: bool = True) -> ir.Kernel:
    """O[64, 128] = bf16(Q[64, 64] @ K[128, 64]^T) @ V[128, 128]: P from registers, V N-major in
    64-column chunks, O through a chunked smem tile and one TMA store of the whole [64, 128] box.
    Both consumer warpgroups compute the block; wg 0 writes it to smem, wg 1 stores it after a
    named barrier (the cross-warpgroup generic -> async proxy hand-off)."""
    full = ir.BarRef("full", ir.const(0))
    loads = (ir.MbarrierArriveExpectTx(full, ir.const((64 * 64 + 128 * 64 + 128 * 128) * 2)),
             ir.TmaLoad(ir.SmemRef("Qs", ()), "q", (ir.const(0), ir.const(0)), full),
             ir.TmaLoad(ir.SmemRef("Ks", ()), "k", (ir.const(0), ir.const(0)), full),
             ir.TmaLoad(ir.SmemRef("Vs", (ir.const(0),)), "v", (ir.const(0), ir.const(0)), full),
             ir.TmaLoad(ir.SmemRef("Vs", (ir.const(1),)), "v", (ir.const(0), ir.const(64)), full))
    compute = (
        ir.RegDecl("S", "f32", (64, 128)), ir.RegDecl("P", "bf16", (64, 128)), ir.RegDecl("O", "f32", (64, 128)),
        ir.RegDecl("Ob", "bf16", (64, 128)),
        ir.MbarrierWait(full, ir.const(0)),
        ir.WgmmaFence(),
        ir.Wgmma("S", ir.SmemRef("Qs", ()), ir.SmemRef("Ks", ()), "k", "k", ir.const(0)),
        ir.WgmmaCommit(), ir.WgmmaWait(0),
        ir.TileUnary("cast", "P", "S"),
        *([ir.WgmmaFence()] if fence_before_pv else []),
        ir.Wgmma("O", "P", ir.SmemRef("Vs", ()), "k", "n", ir.const(0)),
        ir.WgmmaCommit(), ir.WgmmaWait(0),
        ir.TileUnary("cast", "Ob", "O"),
        ir.If(ir.eq("wg", 0), (ir.TileStoreSmem(ir.SmemRef("Os", ()), "Ob"),
                               *([ir.FenceProxyAsync()] if fence_before_store else []))),
        *([ir.NamedBarrierSync(ir.const(1), 256)] if barrier_before_store else []),
        ir.If(ir.eq("wg", 1), (ir.ElectOne((ir.TmaStore("o", (ir.const(0), ir.const(0)), ir.SmemRef("Os", ())),
                                            ir.TmaCommit())),
                               ir.TmaWait(0, read=False))),
    )
    return ir.Kernel(
        name="attention_block",
        params=(ir.TensorMapParam("q", "bf16", (ir.const(64), ir.const(64)), (64, 64), 128),
                ir.TensorMapParam("k", "bf16", (ir.const(128), ir.const(64)), (128, 64), 128),
                ir.TensorMapParam("v", "bf16", (ir.const(128), ir.const(128)), (128, 64), 128),
                ir.TensorMapParam("o", "bf16", (ir.const(64), ir.const(128)), (64, 128), 0)),
        grid=ir.const(1), cluster=(1, 1, 1),
        smem=(ir.SmemDecl("Qs", "bf16", (64, 64), 128), ir.SmemDecl("Ks", "bf16", (128, 64), 128),
              ir.SmemDecl("Vs", "bf16", (2, 128, 64), 128), ir.SmemDecl("Os", "bf16", (2, 64, 64), 0)),
        barriers=(ir.BarrierDecl("full", 1),),
        body=(ir.MbarrierInit("full", 1), ir.FenceMbarrierInit(), ir.SyncThreads(),
              ir.Role("producer", 1, 40, (ir.Setmaxnreg("dec", 40), ir.ElectOne(loads))),
              ir.Role("consumer", 2, 232, (ir.Setmaxnreg("inc", 232),) + compute)),
    )


@pytest.mark.parametrize("seed", range(3))
def test_register_a_n_major_b_chunked_tma_store(seed):
    q, k, v = (torch.randn(*shape).to(torch.bfloat16) for shape in ((64, 64), (128, 64), (128, 128)))
    o = torch.zeros(64, 128, dtype=torch.bfloat16)
    report = simulate(attention_block_kernel(), {"q": q, "k": k, "v": v, "o": o}, seed=seed)
    p = (q.float() @ k.float().T).to(torch.bfloat16)
    torch.testing.assert_close(o.float(), (p.float() @ v.float()).to(torch.bfloat16).float(), rtol=2e-2, atol=5e-2)
    assert (report.wgmmas, report.tma_loads, report.tma_stores, report.named_barrier_syncs) == (4, 4, 1, 1)


@pytest.mark.parametrize("fence, barrier, message", [
    (False, True, r"missing fence.proxy.async: TMA store reads slot Os written by tile.store_smem"),
    (True, False, r"read of slot Os (before any write to it|not ordered after its tile.store_smem)"),
])
def test_cross_warpgroup_store_needs_fence_and_barrier(fence, barrier, message):
    q, k, v = (torch.randn(*shape).to(torch.bfloat16) for shape in ((64, 64), (128, 64), (128, 128)))
    for seed in range(3):
        with pytest.raises(RaceError, match=message):
            simulate(attention_block_kernel(fence_before_store=fence, barrier_before_store=barrier),
                     {"q": q, "k": k, "v": v, "o": torch.zeros(64, 128, dtype=torch.bfloat16)}, seed=seed)


def test_missing_wgmma_fence_after_register_write():
    q, k, v = (torch.randn(*shape).to(torch.bfloat16) for shape in ((64, 64), (128, 64), (128, 128)))
    o = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ProtocolError, match=r"missing wgmma.fence: register tile P was accessed by a tile op"):
        simulate(attention_block_kernel(fence_before_pv=False), {"q": q, "k": k, "v": v, "o": o})


def scalar_kernel(value: ir.Expr) -> ir.Kernel:
    return ir.Kernel(
        name="scalar", params=(ir.ScalarParam("n", "i32"), ir.GlobalParam("out", "f32", (ir.const(1), ir.const(1)))),
        grid=ir.const(1), cluster=(1, 1, 1), smem=(), barriers=(),
        body=(ir.RegDecl("t", "f32", (1, 1)), ir.Let("x", value), ir.TileFill("t", Var("x")),
              ir.TileStoreGlobal("out", (ir.const(0), ir.const(0)), "t")))


def binop(op: str, a, b) -> ir.Expr:
    return ir.BinOp(op, ir.as_expr(a), ir.as_expr(b))


@pytest.mark.parametrize("expr, value", [
    (div(-7, 2), -3), (mod(-7, 2), -1), (div(7.0, 2), 3.5), (ceil_div("n", 4), 3),
    (binop("^", band("n", 3), 1), 0), (binop("<<", 1, "n"), 512), (binop(">>", "n", 1), 4),
    (ir.Call("select", (ir.lt("n", 10), ir.const(5), ir.const(6))), 5),
    (binop("&&", ir.eq("n", 9), binop(">=", "n", 2)), 1), (binop("||", 0, 0), 0),
    (ir.emin("n", 4), 4), (ir.emax("n", 4), 9),
    (add("cta_id", "num_ctas"), 1),
])
def test_expression_semantics(expr, value):
    out = torch.zeros(1, 1)
    simulate(scalar_kernel(ir.as_expr(expr)), {"n": 9, "out": out})
    assert out.item() == value


def test_undefined_name_is_reported_by_the_verifier_before_running():
    with pytest.raises(VerifyError, match=r"IR line 3 \(let x\): `q` is not declared"):
        simulate(scalar_kernel(add("q", 1)), {"n": 9, "out": torch.zeros(1, 1)})
    with pytest.raises(VerifyError, match=r"`num_sms` is host-side and may appear only in the grid"):
        simulate(scalar_kernel(Var("num_sms")), {"n": 9, "out": torch.zeros(1, 1)})


def test_role_ending_with_wgmma_in_flight():
    kernel = attention_block_kernel()
    consumer = kernel.body[-1]
    cut = next(i for i, s in enumerate(consumer.body) if isinstance(s, ir.WgmmaWait))
    truncated = dataclasses.replace(kernel, body=kernel.body[:-1] + (ir.Role("consumer", 2, 232, consumer.body[:cut]),))
    q, k, v = (torch.randn(*shape).to(torch.bfloat16) for shape in ((64, 64), (128, 64), (128, 128)))
    with pytest.raises(ProtocolError, match=r"consumer wg[01] finished role consumer with 1 wgmma group\(s\) still in "
                                            r"flight"):
        simulate(truncated, {"q": q, "k": k, "v": v, "o": torch.zeros(64, 128, dtype=torch.bfloat16)})


def syncthreads_in_producer() -> ir.Kernel:
    kernel = matmul_kernel()
    producer = kernel.body[-2]
    return dataclasses.replace(kernel, body=kernel.body[:-2] + (
        ir.Role("producer", 1, 40, (ir.SyncThreads(),) + producer.body), kernel.body[-1]))


SMALL_ARGS = {"M": 64, "N": 64, "K": 32, "a": torch.zeros(64, 32), "b": torch.zeros(64, 32), "c": torch.zeros(64, 64)}


def test_syncthreads_inside_a_role_is_rejected():
    with pytest.raises(VerifyError, match=r"syncthreads inside role producer waits for the threads of every "
                                          r"role \(deadlock\); synchronise the participating warpgroups with a "
                                          r"named barrier"):
        simulate(syncthreads_in_producer(), SMALL_ARGS)


def test_structural_rules_are_internal_asserts_in_the_simulator():
    """The simulator trusts verified structure: met without the verifier, a broken rule is an
    internal error, not a second user message."""
    with pytest.raises(SimulatorInternalError, match="the verifier should have rejected this kernel: "
                                                     "syncthreads and roles are outside roles"):
        Machine(syncthreads_in_producer(), SMALL_ARGS, num_sms=1, seed=0, max_steps=100)


def test_tile_op_semantics_cover_the_ir_ops():
    assert tuple(UNARY_SEMANTICS) == ir.TILE_UNARY_OPS
    assert tuple(BINARY_SEMANTICS) == ir.BINARY_OPS


def test_exp2_ftz_flushes_results_below_the_least_normal_float_to_zero():
    """tile.exp2_ftz is ex2.approx.ftz: 2^x where that is a normal fp32, else 0 (tile.exp2 keeps
    the subnormals); -inf gives 0 and NaN stays NaN."""
    x = torch.tensor([0.0, 1.5, -126.0, -126.5, -140.0, float("-inf"), float("nan"), 100.0])
    got = UNARY_SEMANTICS["exp2_ftz"](x)
    assert got[:3].tolist() == torch.exp2(x[:3]).tolist() and got[2] == 2.0 ** -126
    assert got[3:6].tolist() == [0.0, 0.0, 0.0] and torch.exp2(x[3:5]).gt(0).all()
    assert torch.isnan(got[6]) and got[7] == 2.0 ** 100


def with_param(kernel: ir.Kernel, name: str, **changes) -> ir.Kernel:
    params = tuple(dataclasses.replace(p, **changes) if p.name == name else p for p in kernel.params)
    return dataclasses.replace(kernel, params=params)


@pytest.mark.parametrize("changes, message", [
    ({"box": (128, 128)}, r"\(kernel matmul > tensormap a\): the box's inner dim is 128 bf16 = 256 bytes, more "
                          r"than the 128-byte swizzle span"),
    ({"box": (64, 32)}, r"tma.load moves one box\(64, 32\) of bf16 = 4096 bytes but A\[s\] is bf16\[2, 64, 32\] "
                        r"= 8192 bytes; the smem sub-array must hold exactly one box"),
    ({"swizzle": 64}, r"tensormap a has swizzle\(64\) but smem A has swizzle\(128\)"),
])
def test_tensormap_rules_are_checked_before_running(changes, message):
    kernel = with_param(matmul_kernel(), "a", **changes)
    with pytest.raises(VerifyError, match=message):
        simulate(kernel, SMALL_ARGS)
