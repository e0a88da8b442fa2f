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
from wsched.names import CONSUMER, TILE_VAR

LN2 = math.log(2.0)

V = ir.Var
C = ir.IntConst


def epilogue(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    a, d = ctx.partition.payload, ctx.schedule.value_dim
    coords = tuple(V(f"b{i}") for i in range(a.batch)) + (ir.add("m0", ir.mul("wg", 64)), C(0))
    if a.score.rows_may_see_nothing:   # a row with no visible key has l = 0: store O = 0
        normalise = [ir.TileBinary("maximum", "corr", "l_run", ir.FloatConst(1e-30)),
                     ir.TileBinary("div", "o_acc", "o_acc", "corr")]
    else:
        normalise = [ir.TileBinary("div", "o_acc", "o_acc", "l_run")]
    tail: list[ir.Stmt] = normalise + [
        ir.TileUnary("cast", "o_t", "o_acc"),
        ir.TileStoreGlobal("o", coords, "o_t"),
    ]
    if a.lse is not None:
        tail += [ir.TileUnary("log", "l_run", "l_run"),
                 ir.TileBinary("mul", "m_run", "m_run", ir.FloatConst(LN2)),
                 ir.TileBinary("add", "l_run", "l_run", "m_run"),
                 ir.TileStoreGlobal("lse", coords, "l_run")]

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, TILE_VAR, lambda loop: replace(loop, body=loop.body + tuple(tail)))
        decls = tuple(x for x in body if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in body if not isinstance(x, ir.RegDecl))
        return replace(role, body=decls + (ir.RegDecl("o_t", a.out.dtype.name, (64, d)),) + rest)

    return map_role(kernel, CONSUMER, consumer)
