"""build_loops for attention: the load nest (Q once per tile, K and V per kv block) and the
compute nest (S = Q K^T, online softmax in registers, O += P V), single-buffered, unsynchronised.

A tile is 128 query rows of one (batch, head); the consumer warpgroups own 64 rows each. The
tiles run in reverse m-block order so that, with a causal mask, the longest tiles start first.

    after (consumer, per kv block):
      wgmma.mma s_acc, Q[0, wg], K[0] major(k, k) accumulate(0)
      if (k * 128 + 128 > T) { tile.mask s_acc, rows(m0 + wg * 64), cols(k * 128), limit(T) }
      tile.reduce.max m_blk, s_acc, axis(1)        # m_new = max(c * rowmax S, m), c = scale log2 e
      tile.mul m_blk, m_blk, scalar(<c>)
      tile.maximum m_blk, m_blk, m_run
      tile.sub corr, m_run, m_blk                  # c = exp2(m - m_new)
      tile.exp2 corr, corr
      tile.maximum m_run, m_run, m_blk
      tile.mul s_acc, s_acc, scalar(<c>)           # P = exp2(c S - m_new): one fma + ex2
      tile.sub s_acc, s_acc, m_blk
      tile.exp2 s_acc, s_acc
      tile.reduce.sum m_blk, s_acc, axis(1)        # l = l * c + rowsum P ; O *= c
      tile.mul l_run, l_run, corr
      tile.add l_run, l_run, m_blk
      tile.mul o_acc, o_acc, corr
      tile.cast p, s_acc
      wgmma.mma o_acc, p, V[0] major(k, n) accumulate(1)
"""

from __future__ import annotations

import math

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.names import CONSUMER, K_COUNT, K_VAR, PRODUCER, TILE_VAR

LOG2E = 1.0 / math.log(2.0)

V = ir.Var
C = ir.IntConst


def build_loops(kernel: None, ctx: LoweringContext) -> ir.Kernel:
    part, s = ctx.partition, ctx.schedule
    a = part.payload
    bm, bn, d = s.tile
    nwg = s.consumer_warpgroups
    chunks = d // 64
    dt = a.q.dtype.name
    nb = a.batch
    batch = [V(f"batch{i}") for i in range(nb)]
    k_batch = [C(1) if a.k_broadcast[i] else batch[i] for i in range(nb)]

    params: list[ir.Param] = [ir.ScalarParam(f"batch{i}", "i32") for i in range(nb)]
    params += [ir.ScalarParam("S", "i32"), ir.ScalarParam("T", "i32")]
    ones = (1,) * nb
    q_name, k_name, v_name = (c.loads[0].tensor for c in part.channels)
    params.append(ir.TensorMapParam(q_name, dt, tuple(batch) + (V("S"), C(d)), ones + (64, 64), 0))
    for name in (k_name, v_name):
        params.append(ir.TensorMapParam(name, dt, tuple(k_batch) + (V("T"), C(d)), ones + (bn, 64), 0))
    params.append(ir.GlobalParam("o", a.out.dtype.name, tuple(batch) + (V("S"), C(d))))
    if a.lse is not None:
        params.append(ir.GlobalParam("lse", "f32", tuple(batch) + (V("S"), C(1))))

    smem = (ir.SmemDecl("Q", dt, (1, nwg, chunks, 64, 64), 0),
            ir.SmemDecl("K", dt, (1, chunks, bn, 64), 0),
            ir.SmemDecl("V", dt, (1, chunks, bn, 64), 0))
    barriers = tuple(ir.BarrierDecl(name, 1) for c in part.channels for name in (c.full, c.empty))

    heads = C(1)
    for b in batch:
        heads = b if heads == C(1) else ir.mul(heads, b)
    setup = (
        ir.Let("m_blocks", ir.ceil_div("S", bm)),
        ir.Let("num_tiles", ir.mul(heads, "m_blocks")),
        ir.Let("kv_blocks", ir.ceil_div("T", bn)),
    )

    q_full, k_full, v_full = (ir.BarRef(c.full, C(0)) for c in part.channels)
    b_idx = tuple(V(f"b{i}") for i in range(nb))
    kb_idx = tuple(C(0) if a.k_broadcast[i] else b_idx[i] for i in range(nb))
    q_loads = tuple(ir.TmaLoad(ir.SmemRef("Q", (C(0), C(w), C(c))), q_name,
                               b_idx + (_plus("m0", w * 64), C(c * 64)), q_full)
                    for w in range(nwg) for c in range(chunks))
    row = ir.mul(K_VAR, bn)
    kv_loads = tuple(ir.TmaLoad(ir.SmemRef(buf, (C(0), C(c))), name, kb_idx + (row, C(c * 64)), bar)
                     for buf, name, bar in (("K", k_name, k_full), ("V", v_name, v_full))
                     for c in range(chunks))
    producer = ir.Role(PRODUCER, 1, s.producer_registers, (
        tile_loop(ctx, q_loads + (k_loop(kv_loads),)),
    ))

    rows0 = ir.add("m0", ir.mul("wg", 64))
    shift = causal_shift(a)
    limit = ir.emin("T", _shifted(ir.add(rows0, 1), shift)) if a.causal else V("T")
    mask = ir.TileMask("s_acc", rows0, row, V("T"), shift)
    f = ir.FloatConst
    # Bottom-right alignment can hide every key of a row (S > T): keep its max finite so that
    # exp2(S - m) is 0, not NaN.
    finite = ((ir.TileBinary("maximum", "m_blk", "m_blk", f(-1e30)),)
              if a.causal == "bottom_right" else ())
    softmax = (
        ir.Wgmma("s_acc", ir.SmemRef("Q", (C(0), V("wg"))), ir.SmemRef("K", (C(0),)), "k", "k", C(0)),
        ir.If(ir.BinOp(">", ir.add(row, bn), limit), (mask,)),
        # The row max is taken on the unscaled scores (the scale is positive), so that the
        # scale and the subtraction below fuse into one multiply-add per element.
        ir.TileReduce("max", "m_blk", "s_acc", 1),
        ir.TileBinary("mul", "m_blk", "m_blk", f(a.scale * LOG2E)),
        ir.TileBinary("maximum", "m_blk", "m_blk", "m_run"),
        *finite,
        ir.TileBinary("sub", "corr", "m_run", "m_blk"),
        ir.TileUnary("exp2", "corr", "corr"),
        ir.TileBinary("maximum", "m_run", "m_run", "m_blk"),
        ir.TileBinary("mul", "s_acc", "s_acc", f(a.scale * LOG2E)),
        ir.TileBinary("sub", "s_acc", "s_acc", "m_blk"),
        ir.TileUnary("exp2", "s_acc", "s_acc"),
        ir.TileReduce("sum", "m_blk", "s_acc", 1),
        ir.TileBinary("mul", "l_run", "l_run", "corr"),
        ir.TileBinary("add", "l_run", "l_run", "m_blk"),
        ir.TileBinary("mul", "o_acc", "o_acc", "corr"),
        ir.TileUnary("cast", "p", "s_acc"),
        ir.Wgmma("o_acc", "p", ir.SmemRef("V", (C(0),)), "k", "n", C(1)),
    )
    consumer = ir.Role(CONSUMER, nwg, s.consumer_registers, (
        ir.RegDecl("s_acc", "f32", (64, bn)),
        ir.RegDecl("p", dt, (64, bn)),
        ir.RegDecl("o_acc", "f32", (64, d)),
        ir.RegDecl("m_run", "f32", (64, 1)),
        ir.RegDecl("l_run", "f32", (64, 1)),
        ir.RegDecl("m_blk", "f32", (64, 1)),
        ir.RegDecl("corr", "f32", (64, 1)),
        tile_loop(ctx, (ir.TileFill("o_acc", f(0.0)), ir.TileFill("l_run", f(0.0)),
                        ir.TileFill("m_run", f(float("-inf"))), k_loop(softmax))),
    ))
    grid = ir.emin("num_sms", ir.mul(heads, ir.ceil_div("S", bm)))
    return ir.Kernel(ctx.name, tuple(params), grid, (1, 1, 1), smem, barriers, setup + (producer, consumer))


def causal_shift(a) -> ir.Expr | None:
    """How far right of the diagonal the last visible key of a row lies (None: no causal mask)."""
    if a.causal is None:
        return None
    return C(0) if a.causal == "top_left" else ir.sub("T", "S")


def _shifted(e: ir.Expr, shift: ir.Expr | None) -> ir.Expr:
    return e if shift is None or shift == C(0) else ir.add(e, shift)


def _plus(name: str, offset: int) -> ir.Expr:
    return V(name) if offset == 0 else ir.add(name, offset)


def k_loop(body: tuple[ir.Stmt, ...]) -> ir.For:
    return ir.For(K_VAR, C(0), V(K_COUNT), C(1), "serial", body)


def tile_loop(ctx: LoweringContext, body: tuple[ir.Stmt, ...]) -> ir.For:
    """Both roles: tile -> (batch indices, m-block), reverse m order; the tile's kv block count."""
    a, (bm, bn, _) = ctx.partition.payload, ctx.schedule.tile
    t = V(TILE_VAR)
    lets = [ir.Let("m_block", ir.sub(ir.sub("m_blocks", 1), ir.mod(t, "m_blocks"))),
            ir.Let("rest", ir.div(t, "m_blocks"))]
    for i in reversed(range(1, a.batch)):
        lets += [ir.Let(f"b{i}", ir.mod("rest" if i == a.batch - 1 else f"rest{i + 1}", f"batch{i}")),
                 ir.Let(f"rest{i}", ir.div("rest" if i == a.batch - 1 else f"rest{i + 1}", f"batch{i}"))]
    lets.append(ir.Let("b0", V("rest1") if a.batch > 1 else V("rest")))
    lets.append(ir.Let("m0", ir.mul("m_block", bm)))
    shift = causal_shift(a)
    visible = _shifted(ir.add("m0", bm), shift)       # keys up to this one are seen by some row
    if a.causal == "bottom_right":
        visible = ir.emax(visible, 0)
    count = ir.emin("kv_blocks", ir.ceil_div(visible, bn)) if a.causal else V("kv_blocks")
    lets.append(ir.Let(K_COUNT, count))
    return ir.For(TILE_VAR, V("cta_id"), V("num_tiles"), V("num_ctas"), "persistent", tuple(lets) + body)
