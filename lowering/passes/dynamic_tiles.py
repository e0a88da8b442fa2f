"""The tile loop takes its tiles from a counter (a dynamic tile order), where the kernel has a
`TILE_COUNTER` workspace.

A persistent loop gives CTA c the tiles c, c + num_ctas, ...: where tiles differ in work (causal
attention: a tile's kv blocks grow with its rows) the CTAs finish apart, however the tiles are
ordered. Here every CTA starts with tile cta_id and then takes the next tile of the order from a
global counter when it is ready for one, so the heaviest-first order is dealt out greedily.

The producer (one elected thread) takes the next tile once it has issued the current tile's loads
and hands it to the consumer warpgroups through a two-slot ring in shared memory:

    var tile_count = 0
    var tile_next = 0
    for tile in dynamic(cta_id, num_tiles, tile_next) {
      let tile_iter = tile_count
      let tile_s = tile_iter % 2
      let tile_ph = tile_iter / 2 & 1
      ... the tile's work ...
      producer:   mbarrier.wait tile_empty[tile_s] phase(tile_ph ^ 1)      the slot was read
                  atomic.inc tile_slot[tile_s] <- tile_counter[0] wrap(num_tiles - 1)
                  mbarrier.arrive tile_full[tile_s]
      consumers:  mbarrier.wait tile_full[tile_s] phase(tile_ph)
      both:       ld.shared fetched = tile_slot[tile_s]
      consumers:  bar.sync 1 + wg, 128            every warp has read before one thread releases
                  mbarrier.arrive tile_empty[tile_s]
      both:       set tile_next = fetched + num_ctas
      set tile_count = tile_count + 1
    }

The counter hands out 0, 1, 2, ...; value v is tile v + num_ctas (the first num_ctas tiles are the
CTAs' first ones), past the last tile for the last num_ctas values: one for each CTA, its last
take. So a launch takes exactly num_tiles values, and the wrap brings the counter back to 0 at the
last one: the workspace (zeroed once) is never cleared, like split-K's tickets (one launch of a
kernel at a time per device, as every kernel with a workspace). The producer runs ahead of the
consumers by at most two tiles (the ring's slots).

The pass runs after the epilogue and the workloads' late passes (the consumers' take comes after
the tile's stores), and replaces circular_buffer's `tile_iter = (tile - cta_id) / num_ctas` by
the count of the CTA's tiles so far.
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import (CONSUMER, PRODUCER, TILE_COUNT, TILE_COUNTER, TILE_EMPTY, TILE_FULL, TILE_NEXT,
                          TILE_SLOT, TILE_VAR, WARPGROUP_BARRIER)
from wsched.target import WARPGROUP_THREADS

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_loop, map_role

V, C = ir.Var, ir.IntConst
SLOTS = 2   # tiles the producer may take ahead of the consumers


def applies(kernel: ir.Kernel) -> bool:
    return any(isinstance(p, ir.WorkspaceParam) and p.name == TILE_COUNTER for p in kernel.params)


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    if not applies(kernel):
        return kernel
    consumers = next(s.warpgroups for s in kernel.body if isinstance(s, ir.Role) and s.name == CONSUMER)
    slot = ir.SmemRef(TILE_SLOT, (V("tile_s"),))
    take = ir.Assign(TILE_NEXT, ir.add("fetched", "num_ctas"))
    producer = (
        ir.MbarrierWait(ir.BarRef(TILE_EMPTY, V("tile_s")), ir.BinOp("^", V("tile_ph"), C(1))),
        ir.AtomicInc(slot, TILE_COUNTER, (C(0),), ir.sub("num_tiles", 1)),
        ir.MbarrierArrive(ir.BarRef(TILE_FULL, V("tile_s"))),
        ir.LoadShared("fetched", slot),
        take,
    )
    consumer = (
        ir.MbarrierWait(ir.BarRef(TILE_FULL, V("tile_s")), V("tile_ph")),
        ir.LoadShared("fetched", slot),
        # one thread releases the slot for its warpgroup: every warp past its wait and read first
        ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS),
        ir.MbarrierArrive(ir.BarRef(TILE_EMPTY, V("tile_s"))),
        take,
    )
    # the ring's slot and phase next to the tile's count, like a stage's next to its counter
    where = (ir.Let("tile_iter", V(TILE_COUNT)), ir.Let("tile_s", ir.mod("tile_iter", SLOTS)),
             ir.Let("tile_ph", ir.band(ir.div("tile_iter", SLOTS), 1)))

    def dynamic(tail):
        def loop_of(loop: ir.For):
            assert loop.iteration == "persistent", loop
            first = loop.body[0]
            assert isinstance(first, ir.Let) and first.name == "tile_iter", "circular_buffer puts tile_iter first"
            body = where + loop.body[1:] + tail + (
                ir.Assign(TILE_COUNT, ir.add(TILE_COUNT, 1)),)
            return (ir.Let(TILE_COUNT, C(0), mutable=True), ir.Let(TILE_NEXT, C(0), mutable=True),
                    replace(loop, step=V(TILE_NEXT), iteration="dynamic", body=body))
        return lambda role: replace(role, body=map_loop(role.body, TILE_VAR, loop_of))

    kernel = map_role(map_role(kernel, PRODUCER, dynamic(producer)), CONSUMER, dynamic(consumer))
    inits = (ir.MbarrierInit(TILE_FULL, 1), ir.MbarrierInit(TILE_EMPTY, consumers))
    fence = next(i for i, s in enumerate(kernel.body) if isinstance(s, ir.FenceMbarrierInit))
    return replace(kernel, smem=kernel.smem + (ir.SmemDecl(TILE_SLOT, "i32", (SLOTS, 1), 0),),
                   barriers=kernel.barriers + (ir.BarrierDecl(TILE_FULL, SLOTS), ir.BarrierDecl(TILE_EMPTY, SLOTS)),
                   body=kernel.body[:fence] + inits + kernel.body[fence:])
