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
from wsched.names import (CONSUMER, MERGE_C, MERGE_L, MERGE_LB, MERGE_M, MERGE_MB, MERGE_O, MERGE_PART, MERGE_T,
                          PART_L, PART_M, PART_O, PART_ROWS, SPLITS, TICKET_SLOT, TILE_ROWS, TILE_VAR,
                          WARPGROUP_BARRIER)
from wsched.target import WARPGROUP_THREADS
from wsched.workloads.ticket import take_ticket
from .loops import bias_lse, deals_rows
from .schedule import MERGE_SPLITS_IN_FLIGHT, merge_rows


LN2 = math.log(2.0)

V = ir.Var
C = ir.IntConst


def _tail(a, d: int, o: str, l: str, m: str, corr: str, o_t: str, rows: ir.Expr, first: ir.Expr,
          limit: ir.Expr | None = None) -> list[ir.Stmt]:
    """Normalise O (tile `o`, head dim `d`) by the row sum `l`, store it, and the log-sum-exp from
    the row max `m`: the tile's rows start at m0 + `rows`; `first` is the first of them in the
    warpgroup's tile (what the diagonal bias's LSE part counts rows from); rows from `limit` on
    are not stored."""
    row0 = ir.add("m0", rows)
    coords = tuple(V(f"b{i}") for i in range(a.kernel_batch)) + (row0, C(0))
    lse_coords = coords
    if a.varlen is not None:   # packed rows [NQ, heads x D]: the sequence's rows, none past its end
        # its limit replaces the caller's: packed sequences do not split (partition refuses
        # split_kv with ws.varlen), so no rows are dealt there
        assert limit is None, "a dealt-rows limit on packed sequences"
        row0 = ir.add("q_start", row0)
        coords, lse_coords, limit = (row0, ir.mul("head", d)), (row0, V("head")), V("q_end")
    if a.rows_may_see_nothing:   # a row with no visible key has l = 0: store O = 0
        normalise = [ir.TileBinary("maximum", corr, l, ir.FloatConst(1e-30)),
                     ir.TileBinary("div", o, o, corr)]
    else:
        normalise = [ir.TileBinary("div", o, o, l)]
    tail: list[ir.Stmt] = normalise + [
        ir.TileUnary("cast", o_t, o),
        ir.TileStoreGlobal("o", coords, o_t, limit),
    ]
    if a.lse is not None:
        tail += [ir.TileUnary("log", l, l),
                 ir.TileBinary("mul", m, m, ir.FloatConst(LN2)),
                 ir.TileBinary("add", l, l, m),
                 *(bias_lse(a.score, a.scale, m, l, first) if a.score.bias else ()),
                 ir.TileStoreGlobal("lse", lse_coords, l, limit)]
    return tail


def epilogue(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    a, s = ctx.partition.payload, ctx.schedule
    d = s.value_dim
    wg_rows = ir.mul("wg", 64)
    # a tile that deals rows owns `tile_rows` of its 64 (loops.tile_rows), the next tile the rest:
    # the host deals them only to split tiles (tile_rows is 64 where the call does not split),
    # the limit keeps the unsplit store to the tile's own rows whatever tile_rows is
    tail = _tail(a, d, "o_acc", "l_run", "m_run", "corr", "o_t", wg_rows, C(0),
                 ir.add("m0", TILE_ROWS) if deals_rows(s) else None)
    decls = [ir.RegDecl("o_t", a.out.dtype.name, (64, d))]
    smem = kernel.smem
    if s.splits_kv:
        rows = merge_rows(d)
        linear = dict(layout="linear")
        decls += [ir.RegDecl(MERGE_O, "f32", (rows, d), **linear),
                  ir.RegDecl(MERGE_PART, "f32", (rows, d), **linear),
                  ir.RegDecl(MERGE_T, a.out.dtype.name, (rows, d), **linear)]
        decls += [ir.RegDecl(name, "f32", (rows, 1), **linear) for name in (MERGE_M, MERGE_L, MERGE_MB, MERGE_LB, MERGE_C)]
        tail = _split_merge(a, d, s.consumer_warpgroups, rows, tail)
        smem += (ir.SmemDecl(TICKET_SLOT, "i32", (s.consumer_warpgroups, 1), 0),)

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, TILE_VAR, lambda loop: replace(loop, body=loop.body + tuple(tail)))
        head = tuple(x for x in body if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in body if not isinstance(x, ir.RegDecl))
        return replace(role, body=head + tuple(decls) + rest)

    return replace(map_role(kernel, CONSUMER, consumer), smem=smem)


def _split_merge(a, d: int, nwg: int, rows: int, tail: list[ir.Stmt]) -> list[ir.Stmt]:
    """Split-KV: every split stores its O (unnormalised), row max m and row sum l of the tile and
    takes the ticket of its (tile, warpgroup); the last split to arrive merges the splits in
    split order (the same bits whichever is last), one pass with a running max:

        m' = max(m, m_s) ;  l = l 2^(m - m') + l_s 2^(m_s - m') ;  O = O 2^(m - m') + O_s 2^(m_s - m')

    and normalises and stores the result (`_tail`); with one split the tile's own O is stored
    (`tail`, the fragment epilogue). The merge is latency-bound (each split's partial a load from
    L2 away), so it runs on linear tiles (docs/ir.md, "Linear tiles"): `rows` rows at a time
    (merge_rows: 8 at head dim 128, 16 at 64), each of the 128 threads MERGE_PER_THREAD (or
    fewer) values of a row, 10 loads a split at head dim 128, where the fragment layout keeps a
    row in 4 threads (a decode tile's 4 rows in 16 of them, 64 registers a split). No split's
    loads depend on the running (m, l, O), so each group of MERGE_SPLITS_IN_FLIGHT splits (an
    unrolled loop) issues its loads at once and the rescaling after them is arithmetic: a round
    of loads per group and chunk of rows (two passes, the max first, took two). The last group's
    places past the last split load nothing (zero outside) and take m_s = -1e30, so that their
    factor is 0: a loop over the splits unrolled by the compiler ran its remainder one split, one
    load latency, at a time (H100, cold L2: 13 splits of a 32-row tile 22.2 -> 20.0 us, 6 of a
    64-row one 27.1 -> 21.8; 2 of a 64-row one 34.0 -> 36.0). With d = m_s - m, the factors are 2^min(d, 0) for the split
    and 2^-max(d, 0) for the running sums. A split with no visible key stores m = -inf, l = 0,
    O = 0 (its factor is 0); m starts at -1e30, so that the first split's factor is 1 and no
    factor is NaN. The chunks stop at the rows a query fills (`part_rows`)."""
    f = ir.FloatConst
    at = (V("work"), ir.mul("wg", 64))
    sync = ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS)
    slot = ir.SmemRef(TICKET_SLOT, (V("wg"),))
    counter = ir.add(ir.mul("work", nwg), "wg") if nwg > 1 else V("work")
    last = ir.sub(SPLITS, 1)
    chunk_rows = ir.add(ir.mul("wg", 64), ir.mul("chunk", rows))      # the chunk's first row in the tile
    src = (V("src_split"), V("work"), chunk_rows)
    group = MERGE_SPLITS_IN_FLIGHT
    # this warpgroup's rows a query fills (none for the second where a query fills 64 or fewer)
    wg_filled = ir.emax(C(0), ir.emin(C(64), ir.sub(PART_ROWS, ir.mul("wg", 64))))
    merge = ir.For("chunk", C(0), ir.ceil_div(wg_filled, rows), C(1), "serial", (
        ir.TileFill(MERGE_M, f(-1e30)),
        ir.TileFill(MERGE_L, f(0.0)),
        ir.TileFill(MERGE_O, f(0.0)),
        ir.For("first_split", C(0), V(SPLITS), C(group), "serial", (
          ir.For("in_group", C(0), C(group), C(1), "unroll", (
            ir.Let("src_split", ir.add("first_split", "in_group")),
            ir.TileLoadGlobal(MERGE_MB, PART_M, src + (C(0),)),          # past the last split: 0 (zero outside)
            ir.TileLoadGlobal(MERGE_LB, PART_L, src + (C(0),)),
            ir.TileLoadGlobal(MERGE_PART, PART_O, src + (C(0),)),
            ir.TileBinary("sub", MERGE_MB, MERGE_MB, ir.mul(ir.BinOp(">=", V("src_split"), V(SPLITS)), f(1e30))),
            ir.TileBinary("sub", MERGE_C, MERGE_MB, MERGE_M),            # d = m_s - m
            ir.TileBinary("maximum", MERGE_M, MERGE_M, MERGE_MB),        # m' = max(m, m_s)
            ir.TileBinary("minimum", MERGE_MB, MERGE_C, f(0.0)),
            ir.TileUnary("exp2", MERGE_MB, MERGE_MB),                    # the split's factor 2^(m_s - m')
            ir.TileBinary("maximum", MERGE_C, MERGE_C, f(0.0)),
            ir.TileUnary("neg", MERGE_C, MERGE_C),
            ir.TileUnary("exp2", MERGE_C, MERGE_C),                      # the running sums' 2^(m - m')
            ir.TileBinary("mul", MERGE_L, MERGE_L, MERGE_C),
            ir.TileBinary("mul", MERGE_LB, MERGE_LB, MERGE_MB),
            ir.TileBinary("add", MERGE_L, MERGE_L, MERGE_LB),
            ir.TileBinary("mul", MERGE_O, MERGE_O, MERGE_C),
            ir.TileBinary("mul", MERGE_PART, MERGE_PART, MERGE_MB),
            ir.TileBinary("add", MERGE_O, MERGE_O, MERGE_PART),
        )),)),
        *_tail(a, d, MERGE_O, MERGE_L, MERGE_M, MERGE_C, MERGE_T, chunk_rows, ir.mul("chunk", rows)),
    ))
    return [
        ir.If(ir.BinOp(">", V(SPLITS), C(1)), (
            ir.Let("last_split", C(0), mutable=True),
            ir.TileStoreGlobal(PART_O, (V("split"),) + at + (C(0),), "o_acc"),
            ir.TileStoreGlobal(PART_M, (V("split"),) + at + (C(0),), "m_run"),
            ir.TileStoreGlobal(PART_L, (V("split"),) + at + (C(0),), "l_run"),
            *take_ticket(slot, counter, last, sync),
            ir.If(V("last_split"), (merge,)),
        ), tuple(tail)),
    ]
