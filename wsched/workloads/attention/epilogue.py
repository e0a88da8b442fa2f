"""epilogue for attention: normalise O by the running sum, store it, and the log-sum-exp.

The running max is kept in log2 units (S was scaled by log2 e), so
LSE = m * ln 2 + ln l, in natural units like torch.logsumexp (-inf for a row that sees no key,
which only a bottom-right causal mask with S > T produces; such a row stores O = 0).

    after (inside the tile loop, after the kv loop):
      tile.div o_acc, o_acc, l_run
      tile.cast o_t, o_acc
      tile.store o[b0, b1, m0 + wg * 64, 0] <- o_t
      tile.log l_run, l_run
      tile.mul m_run, m_run, scalar(0.6931471805599453)
      tile.add l_run, l_run, m_run
      tile.store lse[b0, b1, m0 + wg * 64, 0] <- l_run
"""

from __future__ import annotations

from dataclasses import replace

import math

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.lowering.rewrite import map_loop, map_role
from wsched.names import (CONSUMER, PART_L, PART_M, PART_O, SPLITS, TICKET_SLOT, TILE_VAR,
                          WARPGROUP_BARRIER)
from wsched.target import WARPGROUP_THREADS
from wsched.workloads.ticket import take_ticket
from .loops import bias_lse


LN2 = math.log(2.0)

V = ir.Var
C = ir.IntConst


def epilogue(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    a, s = ctx.partition.payload, ctx.schedule
    d = s.value_dim
    row0 = ir.add("m0", ir.mul("wg", 64))
    coords = tuple(V(f"b{i}") for i in range(a.kernel_batch)) + (row0, C(0))
    lse_coords, limit = coords, None
    if a.varlen is not None:   # packed rows [NQ, heads x D]: the sequence's rows, none past its end
        row0 = ir.add("q_start", row0)
        coords, lse_coords, limit = (row0, ir.mul("head", d)), (row0, V("head")), V("q_end")
    if a.rows_may_see_nothing:   # a row with no visible key has l = 0: store O = 0
        normalise = [ir.TileBinary("maximum", "corr", "l_run", ir.FloatConst(1e-30)),
                     ir.TileBinary("div", "o_acc", "o_acc", "corr")]
    else:
        normalise = [ir.TileBinary("div", "o_acc", "o_acc", "l_run")]
    tail: list[ir.Stmt] = normalise + [
        ir.TileUnary("cast", "o_t", "o_acc"),
        ir.TileStoreGlobal("o", coords, "o_t", limit),
    ]
    if a.lse is not None:
        tail += [ir.TileUnary("log", "l_run", "l_run"),
                 ir.TileBinary("mul", "m_run", "m_run", ir.FloatConst(LN2)),
                 ir.TileBinary("add", "l_run", "l_run", "m_run"),
                 *(bias_lse(a.score, a.scale) if a.score.bias else ()),
                 ir.TileStoreGlobal("lse", lse_coords, "l_run", limit)]

    decls = [ir.RegDecl("o_t", a.out.dtype.name, (64, d))]
    smem = kernel.smem
    if s.splits_kv:
        # the merge reads each split's O in slices into the first columns of the score tile, dead by
        # then: as wide as the tile takes (one load a split where bn >= d)
        width = next(w for w in (128, 64, 32, 16) if d % w == 0 and s.bn % w == 0)
        decls.append(ir.RegDecl("l_blk", "f32", (64, 1)))
        tail = _split_merge(s.consumer_warpgroups, d, width) + [ir.If(V("last_split"), tuple(tail))]
        smem += (ir.SmemDecl(TICKET_SLOT, "i32", (s.consumer_warpgroups, 1), 0),)

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, TILE_VAR, lambda loop: replace(loop, body=loop.body + tuple(tail)))
        head = tuple(x for x in body if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in body if not isinstance(x, ir.RegDecl))
        return replace(role, body=head + tuple(decls) + rest)

    return replace(map_role(kernel, CONSUMER, consumer), smem=smem)


def _split_merge(nwg: int, d: int, width: int) -> list[ir.Stmt]:
    """Split-KV: every split stores its O (unnormalised), row max m and row sum l of the tile and
    takes the ticket of its (tile, warpgroup); the last split to arrive merges the splits in
    split order (the same bits whichever is last):

        m = max_s m_s ;  c_s = exp2(m_s - m) ;  l = sum_s c_s l_s ;  O = sum_s c_s O_s

    in two passes over the splits, the max first, then the sums, and goes on to the plain
    epilogue (`last_split`). The merge is latency-bound (a few rows, each split's partial a load
    from L2 away): with m known before the sums, no split's loads wait on another split's
    arithmetic, so the unrolled loops keep several splits' loads in flight (one pass that
    rescaled a running (m, l, O) as each split joined waited out two to three load latencies a
    split: 15 us of a 37 us B1 decode step with 8 splits, H100 trace, 2026-11-24). A split with
    no visible key stores m = -inf, l = 0, O = 0; m starts at -1e30, so that its factor is 0,
    not NaN."""
    f = ir.FloatConst
    at = (V("work"), ir.mul("wg", 64))
    sync = ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS)
    slot = ir.SmemRef(TICKET_SLOT, (V("wg"),))
    counter = ir.add(ir.mul("work", nwg), "wg") if nwg > 1 else V("work")
    last = ir.sub(SPLITS, 1)
    slices = d // width
    src = (V("src_split"),) + at

    def o_slices(stmts) -> list[ir.Stmt]:
        return [ir.For("j", C(0), C(slices), C(1), "unroll", (
            ir.TileView("o_j", "o_acc", ir.mul("j", width), width), *stmts))]

    merge = (
        ir.TileView("part_t", "s_acc", C(0), width),
        ir.TileFill("m_run", f(-1e30)),
        ir.For("src_split", C(0), V(SPLITS), C(1), "serial", (      # m = max_s m_s
            ir.TileLoadGlobal("m_blk", PART_M, src + (C(0),)),
            ir.TileBinary("maximum", "m_run", "m_run", "m_blk"),
        )),
        ir.TileFill("l_run", f(0.0)),
        ir.TileFill("o_acc", f(0.0)),
        ir.For("src_split", C(0), V(SPLITS), C(1), "serial", (      # l and O, each split scaled by c_s
            ir.TileLoadGlobal("m_blk", PART_M, src + (C(0),)),
            ir.TileLoadGlobal("l_blk", PART_L, src + (C(0),)),
            ir.TileBinary("sub", "m_blk", "m_blk", "m_run"),
            ir.TileUnary("exp2", "m_blk", "m_blk"),                   # c_s, this split's factor
            ir.TileBinary("mul", "l_blk", "l_blk", "m_blk"),
            ir.TileBinary("add", "l_run", "l_run", "l_blk"),
            *o_slices((ir.TileLoadGlobal("part_t", PART_O, src + (ir.mul("j", width),)),
                       ir.TileBinary("mul", "part_t", "part_t", "m_blk"),
                       ir.TileBinary("add", "o_j", "o_j", "part_t"))),
        )),
    )
    return [
        ir.Let("last_split", C(1), mutable=True),
        ir.If(ir.BinOp(">", V(SPLITS), C(1)), (
            ir.TileStoreGlobal(PART_O, (V("split"),) + at + (C(0),), "o_acc"),
            ir.TileStoreGlobal(PART_M, (V("split"),) + at + (C(0),), "m_run"),
            ir.TileStoreGlobal(PART_L, (V("split"),) + at + (C(0),), "l_run"),
            *take_ticket(slot, counter, last, sync),
            ir.If(V("last_split"), merge),
        )),
    ]
