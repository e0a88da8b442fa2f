"""Ping-pong matmul (mode="pingpong") and warpgroups with two blocks of 64 rows.

Ping-pong: the two consumer warpgroups take the CTA's tiles in turn (tile_iter % 2 == wg), each
releases its own tiles' stages alone (empty barriers of one arrival), and two named barriers hand
the mainloop from one to the other; the token is taken back after the tile loop. A warpgroup may
own 128 rows (ping-pong's 128 x 128 tiles, cooperative 256 x 128): two m64 wgmmas per k step in
one group, two accumulators, an epilogue per block of rows.

Checked here: the golden IR, the simulator against torch (outputs NaN-poisoned, tiles per CTA odd
and even, fewer tiles than CTAs, K long enough to reuse every stage), the simulator and the
verifier on broken protocols, and nvcc builds without spills.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import wsched as ws
from fusions import gated, inputs_for, linear_relu_residual, matmul, scaled_silu_f32
from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.lowering import ir
from wsched.lowering.pipeline import pass_names
from wsched.lowering.printer import print_kernel
from wsched.lowering.rewrite import map_loop
from wsched.lowering.simulate import DeadlockError, ProtocolError, simulate
from wsched.lowering.verify import VerifyError, verify
from wsched.workloads import workload_for

SCHEDULES = {
    "pingpong": dict(mode="pingpong"),                               # 128 x 128 per warpgroup
    "pingpong_bm64": dict(mode="pingpong", tile=(64, 256, 64)),
    "pingpong_inflight0_direct": dict(mode="pingpong", mma_inflight=0, epilogue="direct"),
    "cooperative_256x128": dict(tile=(256, 128, 64)),
}
# (M, N, K, CTAs): odd and even tile counts per CTA, one tile for several CTAs, K < BK, long K
SHAPES = [(300, 264, 640, 2), (256, 512, 320, 3), (64, 128, 64, 4), (130, 136, 904, 1), (520, 600, 40, 4)]


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_pingpong_is_on_the_route_and_its_ir_is_golden(golden):
    schedule = ws.schedule_for(matmul, mode="pingpong")
    assert schedule.tile == (128, 128, 64) and schedule.tile_warpgroups == 1 and schedule.mma_row_blocks == 2
    assert pass_names(workload_for(matmul), schedule)[-2:] == ("pingpong", "reg_realloc")
    assert "pingpong" not in pass_names(workload_for(matmul), ws.schedule_for(matmul))
    golden.check("matmul_pingpong.ir", print_kernel(ws.lower(matmul, mode="pingpong")))


def test_two_row_blocks_are_one_wgmma_group():
    text = print_kernel(ws.lower(matmul, tile=(256, 128, 64)))
    assert ("        wgmma.fence\n        wgmma.mma acc, A[s, wg * 2], B[s] major(k, n) accumulate(k > 0)\n"
            "        wgmma.mma acc1, A[s, wg * 2 + 1], B[s] major(k, n) accumulate(k > 0)\n"
            "        wgmma.commit\n        wgmma.wait 1\n") in text
    assert "tma.store out[m0 + (wg * 2 + 1) * 64, n0 + j * 64] <- C_bf16[wg, (2 + j) % 2]" in text
    assert "mbarrier.init empty arrivals(2)" in text


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("fusion", [matmul, gated, linear_relu_residual], ids=lambda f: f.name)
def test_simulated_against_torch(fusion, name):
    k = ws.compile(fusion, build=False, **SCHEDULES[name])
    for i, (M, N, K, ctas) in enumerate(SHAPES):
        x = inputs_for(fusion, M, N, K, seed=i)
        out = k.simulate(*x, num_sms=ctas, seed=i)          # outputs NaN-poisoned first
        assert not torch.isnan(out.float()).any(), (M, N, K)
        assert rel_error(out, fusion.reference(*x)) < 1e-2, (M, N, K)


def _consumer_edit(kernel: ir.Kernel, edit) -> ir.Kernel:
    body = tuple(replace(s, body=edit(s.body)) if isinstance(s, ir.Role) and s.name == "consumer" else s
                 for s in kernel.body)
    return replace(kernel, body=body)


def _tile_body_edit(edit):
    """A consumer-body edit that rewrites the body of its tile loop with `edit(body)`."""
    return lambda body: map_loop(body, "tile", lambda loop: replace(loop, body=edit(loop.body)))


def _guards(cond):
    """A tile-body edit that sets the condition of its guards (`if tile_iter % 2 == wg`) to
    `cond(old condition)`."""
    return _tile_body_edit(lambda body: tuple(replace(x, cond=cond(x.cond)) if isinstance(x, ir.If) else x
                                              for x in body))


def _run(kernel: ir.Kernel, M=256, N=512, K=320, ctas=2):
    a, b = torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16()
    simulate(kernel, {"M": M, "N": N, "K": K, "a": a, "b": b, "out": torch.empty(M, N).bfloat16()}, num_sms=ctas)


def test_the_simulator_catches_a_token_not_taken_back_or_never_handed():
    kernel = ws.lower(matmul, mode="pingpong")
    balance = lambda body: tuple(s for s in body if not (isinstance(s, ir.If) and "cta_tiles" in ir.expr_vars(s.cond)))  # noqa: E731
    _run(kernel)
    with pytest.raises(ProtocolError, match=r"CTA \d exited with named barrier 3 part way through a round: 128 of its "
                                            r"256 threads arrived \(first CTA \d consumer wg1: bar.arrive 3, 256"):
        _run(_consumer_edit(kernel, balance), M=512, N=512, ctas=2)      # 4 tiles per CTA: warpgroup 0's token
    with pytest.raises(ProtocolError, match=r"exited with named barrier 4 part way through a round"):
        _run(_consumer_edit(kernel, balance), M=384, N=384, ctas=3)      # 3 tiles per CTA: warpgroup 1's
    first = lambda body: tuple(s for s in body if not (isinstance(s, ir.If) and s.cond == ir.eq("wg", 1)))  # noqa: E731
    with pytest.raises(DeadlockError, match=r"consumer wg0: bar.sync 3, 256"):
        _run(_consumer_edit(kernel, first))


def test_the_verifier_holds_each_stage_to_the_warpgroup_that_takes_its_tile():
    kernel = ws.lower(matmul, mode="pingpong")
    assert verify(kernel) is None
    doubled = replace(kernel, body=tuple(replace(s, arrivals=2) if isinstance(s, ir.MbarrierInit) and s.barrier == "empty"
                                         else s for s in kernel.body))
    with pytest.raises(VerifyError, match=r"empty is initialised with arrivals\(2\) but 1 consumer arrivals release "
                                          r"each stage \(role consumer: 1 warpgroup × 1 arrive\); use arrivals\(1\)"):
        verify(doubled)

    even_tiles_only = _guards(lambda cond: ir.eq(ir.mod("tile_iter", 2), 0))
    with pytest.raises(VerifyError) as caught:       # both warpgroups take the even tiles: the odd ones nobody
        verify(_consumer_edit(kernel, even_tiles_only))
    assert str(caught.value).splitlines() == [
        "IR line 12 (mbarrier.init): empty is initialised with arrivals(1) but 2 consumer arrivals release each stage "
        "(role consumer: 2 warpgroups × 1 arrive); use arrivals(2)",
        "IR line 64 (role consumer > for tile > if > for k > mbarrier.wait): the consumer waits on full 5 times (M=256, "
        "N=384, K=320, cta_id=0, num_ctas=2) but the producer fills 10 stages; the producer blocks on a stage nobody "
        "releases: the load and compute nests must traverse the same (tile, k) order"]

    odd_tiles_to_nobody = _guards(lambda cond: ir.BinOp("&&", cond, ir.eq("wg", 0)))     # warpgroup 1 takes nothing
    with pytest.raises(VerifyError, match=r"the consumer waits on full 5 times \(M=256, N=384, K=320, cta_id=0, "
                                          r"num_ctas=2\) but the producer fills 10 stages; the producer blocks on a "
                                          r"stage nobody releases"):
        verify(_consumer_edit(kernel, odd_tiles_to_nobody))


def test_pingpong_describes_itself():
    text = workload_for(matmul).describe(ws.partition(matmul, ws.schedule_for(matmul, mode="pingpong")))
    assert "compute sub-DAG  (consumers: 2 warpgroups x 128 rows, each its own tiles in turn)" in text
    assert "barriers full[4] (arrivals 1 + tx) / empty[4] (arrivals 1)" in text


@pytest.mark.nvcc
@pytest.mark.parametrize("name", ["pingpong", "pingpong_bm64", "cooperative_256x128"])
@pytest.mark.parametrize("fusion", [matmul, gated, scaled_silu_f32], ids=lambda f: f.name)
def test_builds_without_spills(fusion, name, tmp_path_factory):
    emitted = emit_kernel(ws.lower(fusion, **SCHEDULES[name]))
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path_factory.mktemp("pingpong"))
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
    assert not [w for w in result.warnings if "C7514" in w or "C7510" in w]    # wgmmas not serialised


def _without_token(body):
    """The body with every 256-thread named barrier (the ping-pong token) removed."""
    out = []
    for s in body:
        if isinstance(s, (ir.NamedBarrierSync, ir.NamedBarrierArrive)) and s.threads == 256:
            continue
        if isinstance(s, ir.If):
            then, orelse = _without_token(s.then), _without_token(s.orelse)
            if not then and not orelse:
                continue
            s = replace(s, then=then, orelse=orelse)
        elif isinstance(s, (ir.For, ir.ElectOne)):
            s = replace(s, body=_without_token(s.body))
        out.append(s)
    return tuple(out)


def test_the_verifier_wants_the_mainloop_handed_over():
    """Without the token, warpgroup 1's first wait (stage 1 of 2, its parity also an older
    phase's) may pass before warpgroup 0 has used and released the stage: a race the simulator
    finds only on some shapes; the verifier names it on every one."""
    kernel = ws.lower(matmul, mode="pingpong", stages=2)
    with pytest.raises(VerifyError, match=r"IR line \d+ \(role consumer > for tile > if > for k > mbarrier.wait\): at "
                                          r"wg=1, tile=2, k=0 \(M=256, N=384, K=320, cta_id=0, num_ctas=2\) the "
                                          r"consumer waits on full stage 1 for the producer's 6th fill, but fills "
                                          r"1\.\.5 before it are other warpgroups': nothing orders this wait after "
                                          r"their use of the stages"):
        verify(_consumer_edit(kernel, _without_token))


def test_fills_released_by_different_warpgroups_are_named():
    kernel = ws.lower(matmul)       # cooperative: warpgroup 1 takes only the even tiles

    own = ir.BinOp("||", ir.eq("wg", 0), ir.eq(ir.mod("tile_iter", 2), 0))
    even_for_wg1 = _tile_body_edit(lambda body: (body[0], ir.If(own, tuple(body[1:]))))
    with pytest.raises(VerifyError, match=r"empty's stages are released by 2 consumer arrivals at the producer's 1st "
                                          r"fill but by 1 at its 6th \(M=256, N=384, K=320, cta_id=0, num_ctas=2\): "
                                          r"the consumer warpgroups take different fills different numbers of times"):
        verify(_consumer_edit(kernel, even_for_wg1))


def test_a_spilling_pingpong_falls_back_to_lighter_pingpong_schedules():
    schedule = ws.schedule_for(matmul, mode="pingpong")
    lighter = workload_for(matmul).lighter(matmul, schedule)
    assert [s.short() for s in lighter] == [
        "128x128x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store pingpong mma_inflight=0",
        "128x64x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store pingpong",
        "128x64x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store pingpong mma_inflight=0"]


def test_a_fill_no_warpgroup_takes_is_named():
    """Warpgroups that split a tile's k steps (k % 3 == wg) leave every third fill to nobody."""
    kernel = ws.lower(matmul)

    def split(loop):
        lets = tuple(x for x in loop.body if isinstance(x, ir.Let))
        rest = tuple(x for x in loop.body if not isinstance(x, ir.Let))
        return replace(loop, body=lets + (ir.If(ir.eq(ir.mod("k", 3), "wg"), rest),))

    split_k_steps = lambda body: map_loop(body, "k", split)  # noqa: E731

    with pytest.raises(VerifyError) as caught:
        verify(_consumer_edit(kernel, split_k_steps))
    assert ("IR line 61 (role consumer > for tile > for k > if > mbarrier.wait): no consumer warpgroup waits on full "
            "for the producer's 3rd fill (stage 2, at tile=0, k=2; M=256, N=384, K=320, cta_id=0, num_ctas=2): the "
            "producer blocks on a stage nobody releases; every tile's stages need a warpgroup that takes them"
            ) in str(caught.value).splitlines()
