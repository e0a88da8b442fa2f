"""pingpong: the two consumer warpgroups take the CTA's tiles in turn (matmul, mode="pingpong").

Runs after the epilogue. Both roles keep walking the same persistent tile loop (the producer
fills the ring tile after tile, so a tile's stages are those of its place in the CTA's order,
`tile_iter`); warpgroup w runs the mainloop and the epilogue of every other tile, those with
tile_iter % 2 == w, and releases their stages alone (this pass sets the ring's empty barriers
to one arrival: the schedule's `tile_warpgroups`). While one warpgroup stores a tile, the other issues the next
one's wgmmas, so the tensor cores do not wait for the epilogue.

Two named barriers hand the mainloop from one warpgroup to the other (CUTLASS's ordered math
barrier): warpgroup w waits on 3 + w before its k loop and, once its last wgmma is issued,
arrives on the other's 4 - w. Each counts 256 threads (the waiting warpgroup's 128 and the
other's 128 arrivals). Warpgroup 1 arrives once up front, so warpgroup 0 goes first; after the
tile loop the warpgroup that holds the last, unanswered token takes it back (warpgroup 0 when the
CTA ran an even number of tiles, warpgroup 1 when odd), so both barriers end balanced.

    after (consumer):
      if wg == 1 { bar.arrive 3, 256 }
      for tile in persistent(cta_id, num_tiles, num_ctas) {
        let tile_iter = (tile - cta_id) / num_ctas
        if tile_iter % 2 == wg {
          ... raster lets ...
          bar.sync 3 + wg, 256
          for k ... { mbarrier.wait full[s] ...; wgmma ...; mbarrier.arrive empty[prev_s] }
          bar.arrive 4 - wg, 256
          wgmma.wait 0 ... the epilogue and stores of the tile
        }
      }
      let cta_tiles = ceil_div(num_tiles - cta_id, num_ctas)
      if (cta_tiles + wg) % 2 == 0 { bar.sync 3 + wg, 256 }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.lowering.rewrite import map_role
from wsched.names import CONSUMER, K_VAR, TILE_VAR, TOKEN_BARRIER
from wsched.target import WARPGROUP_THREADS

THREADS = 2 * WARPGROUP_THREADS     # both consumer warpgroups
TURNS = 2                           # warpgroups taking tiles in turn
CTA_TILES = "cta_tiles"


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    assert ctx.schedule.consumer_warpgroups == TURNS and ctx.schedule.tile_warpgroups == 1
    wg = ir.Var("wg")
    mine = ir.NamedBarrierSync(ir.add(TOKEN_BARRIER, wg), THREADS)
    theirs = ir.NamedBarrierArrive(ir.sub(TOKEN_BARRIER + 1, wg), THREADS)

    def owned(loop: ir.For) -> ir.For:
        """The tile's work for its warpgroup only, the mainloop between the token's hand-overs."""
        first = next(i for i, s in enumerate(loop.body) if not (isinstance(s, ir.Let) and s.name == "tile_iter"))
        assert first == 1, "circular_buffer puts tile_iter first in the tile loop"
        work = list(loop.body[first:])
        k = next(i for i, s in enumerate(work) if isinstance(s, ir.For) and s.var == K_VAR)
        work[k:k + 1] = [mine, work[k], theirs]
        turn = ir.If(ir.eq(ir.mod("tile_iter", TURNS), wg), tuple(work))
        return replace(loop, body=loop.body[:first] + (turn,))

    def consumer(role: ir.Role) -> ir.Role:
        at = next(i for i, s in enumerate(role.body) if isinstance(s, ir.For) and s.var == TILE_VAR)
        loop = role.body[at]
        assert loop.iteration == "persistent"
        head = ir.If(ir.eq(wg, 1), (ir.NamedBarrierArrive(ir.IntConst(TOKEN_BARRIER), THREADS),))
        count = ir.Let(CTA_TILES, ir.ceil_div(ir.sub(loop.stop, loop.start), loop.step))
        last = ir.If(ir.eq(ir.mod(ir.add(CTA_TILES, wg), TURNS), 0), (mine,))
        return replace(role, body=role.body[:at] + (head, owned(loop), count, last) + role.body[at + 1:])

    empties = {c.empty for c in ctx.channels("k")}
    body = tuple(replace(s, arrivals=ctx.schedule.tile_warpgroups)
                 if isinstance(s, ir.MbarrierInit) and s.barrier in empties else s for s in kernel.body)
    return map_role(replace(kernel, body=body), CONSUMER, consumer)
