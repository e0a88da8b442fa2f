"""lower_mma: the wgmma protocol around each MMA, and the consumer's release point.

wgmma is asynchronous: `wgmma.fence` orders the accumulator's register traffic before it,
`wgmma.commit` closes a group, `wgmma.wait n` leaves at most n groups in flight. A stage may be
released only when no wgmma reading it is pending. With `mma_inflight = 1` one group stays in
flight across iterations, so iteration k releases the stage of iteration k - 1 and the tile's
last stage is released after the loop's final `wgmma.wait 0`. In a matmul the first k block
overwrites the accumulator (accumulate(k > 0)), so no zero fill is needed; attention's two
wgmmas keep the accumulate flags build_loops gave them (S is overwritten, O accumulates).

    before:  tile.fill acc, 0.0
             for k ... { mbarrier.wait full[s] phase(ph)
                         wgmma.mma acc, A[s, wg], B[s] major(k, k) accumulate(1)
                         mbarrier.arrive empty[s] }
    after (mma_inflight = 1):
             for k ... { mbarrier.wait full[s] phase(ph)
                         wgmma.fence
                         wgmma.mma acc, A[s, wg], B[s] major(k, k) accumulate(k > 0)
                         wgmma.commit
                         wgmma.wait 1
                         if k > 0 { let prev_s = (it - 1) % 4
                                    mbarrier.arrive empty[prev_s] } }
             wgmma.wait 0
             let last_s = ((tile_iter * k_tiles) + k_tiles - 1) % 4
             mbarrier.arrive empty[last_s]
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..context import ACC, CONSUMER, K_VAR, TILE_VAR, LoweringContext
from ..rewrite import map_loop, map_role

V = ir.Var
C = ir.IntConst


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    stages = ctx.schedule.stages
    matmul = ctx.kind == "matmul"
    # Attention's overlap is a reordering of the complete protocol (overlap_softmax): here every
    # attention wgmma is waited for at once.
    inflight = ctx.schedule.mma_inflight if matmul else 0
    empty = ctx.channel.empty

    def k_body(loop: ir.For) -> ir.For:
        out: list[ir.Stmt] = []
        for s in loop.body:
            if isinstance(s, ir.Wgmma):
                mma = replace(s, accumulate=ir.BinOp(">", V(K_VAR), C(0))) if matmul else s
                out += [ir.WgmmaFence(), mma, ir.WgmmaCommit(), ir.WgmmaWait(inflight)]
            elif isinstance(s, ir.MbarrierArrive) and s.bar.barrier == empty and inflight:
                prev = ir.Let("prev_s", ir.mod(ir.sub("it", 1), stages))
                out.append(ir.If(ir.BinOp(">", V(K_VAR), C(0)),
                                 (prev, ir.MbarrierArrive(ir.BarRef(empty, V("prev_s"))))))
            else:
                out.append(s)
        return replace(loop, body=tuple(out))

    def tile_body(loop: ir.For) -> ir.For:
        out: list[ir.Stmt] = []
        for s in loop.body:
            if isinstance(s, ir.TileFill) and s.dst == ACC:
                continue
            out.append(s)
            if isinstance(s, ir.For) and s.var == K_VAR and inflight:
                last = ir.mod(ir.sub(ir.add(ir.mul("tile_iter", "k_tiles"), "k_tiles"), 1), stages)
                out += [ir.WgmmaWait(0), ir.Let("last_s", last),
                        ir.MbarrierArrive(ir.BarRef(empty, V("last_s")))]
        return replace(loop, body=tuple(out))

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, K_VAR, k_body)
        return replace(role, body=map_loop(body, TILE_VAR, tile_body) if matmul else body)

    return map_role(kernel, CONSUMER, consumer)
