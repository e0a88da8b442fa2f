"""insert_barriers: the full/empty mbarrier protocol of the channel.

    setup     mbarrier.init full arrivals(1); mbarrier.init empty arrivals(consumers);
              fence.mbarrier_init; syncthreads
    producer  producer_acquire: mbarrier.wait empty[s] phase(ph ^ 1)   (first pass is free)
              producer_commit:  mbarrier.arrive_expect_tx full[s] bytes(stage bytes), then loads
    consumer  consumer_wait:    mbarrier.wait full[s] phase(ph)
              consumer_release: mbarrier.arrive empty[s]   (placed after the mma here;
                                lower_mma moves it behind the wgmma wait that frees the slot)

    before:  for k ... { let it ...; tma.load A[s] <- ...; tma.load B[s] <- ... }
    after:   for k ... { let it ...; mbarrier.wait empty[s] phase(ph ^ 1)
                         mbarrier.arrive_expect_tx full[s] bytes(49152)
                         tma.load A[s] <- ...; tma.load B[s] <- ... }
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..context import CONSUMER, K_VAR, PRODUCER, LoweringContext
from ..rewrite import map_loop, map_role

V = ir.Var


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    ch = ctx.channel
    full, empty = ir.BarRef(ch.full, V("s")), ir.BarRef(ch.empty, V("s"))

    def producer_loop(loop: ir.For):
        lets = tuple(x for x in loop.body if isinstance(x, ir.Let))
        rest = tuple(x for x in loop.body if not isinstance(x, ir.Let))
        acquire = (ir.MbarrierWait(empty, ir.BinOp("^", V("ph"), ir.IntConst(1))),
                   ir.MbarrierArriveExpectTx(full, ir.IntConst(ch.bytes_per_stage)))
        return replace(loop, body=lets + acquire + rest)

    def consumer_loop(loop: ir.For):
        lets = tuple(x for x in loop.body if isinstance(x, ir.Let))
        rest = tuple(x for x in loop.body if not isinstance(x, ir.Let))
        return replace(loop, body=lets + (ir.MbarrierWait(full, V("ph")),) + rest + (ir.MbarrierArrive(empty),))

    kernel = map_role(kernel, PRODUCER, lambda r: replace(r, body=map_loop(r.body, K_VAR, producer_loop)))
    kernel = map_role(kernel, CONSUMER, lambda r: replace(r, body=map_loop(r.body, K_VAR, consumer_loop)))
    init = (ir.MbarrierInit(ch.full, 1),
            ir.MbarrierInit(ch.empty, ctx.schedule.consumer_warpgroups),
            ir.FenceMbarrierInit(),
            ir.SyncThreads())
    first_role = next(i for i, x in enumerate(kernel.body) if isinstance(x, ir.Role))
    body = kernel.body[:first_role] + init + kernel.body[first_role:]
    return replace(kernel, body=body)
