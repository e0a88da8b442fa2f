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

With a score function (score.py, score_ops.py) the block runs its inner score in place on s_acc
right after the first wgmma, then the masks that cannot be analysed, and puts the analysed masks'
tile ops inside the `if` beside the key-tail mask (the `if` then asks whether the block is cut by
a mask, not only by T). Inputs it reads are loaded per tile or at the top of the kv block. The
analysed masks also give the tile loop its kv range (`kv_range`): both roles skip the blocks no
row of the tile sees, addressing block k + kv_first.
"""

from __future__ import annotations

import math

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.names import CONSUMER, K_COUNT, K_FIRST, K_VAR, PRODUCER, TILE_VAR
from wsched.workloads.batch import batch_index_lets

from .score import Bound, SideInput
from .schedule import chunk_columns
from .score_ops import ScoreOps

LOG2E = 1.0 / math.log(2.0)

V = ir.Var
C = ir.IntConst


def build_loops(kernel: None, ctx: LoweringContext) -> ir.Kernel:
    part, s = ctx.partition, ctx.schedule
    a = part.payload
    bm, bn, d = s.tile
    dv = s.value_dim
    nwg = s.consumer_warpgroups
    dt = a.q.dtype.name
    # Q and K, and V, in column chunks of one swizzle span (schedule.chunk_columns)
    qk_width, v_width = (chunk_columns(x, a.q.dtype.itemsize) for x in (d, dv))
    chunks, v_chunks = d // qk_width, dv // v_width
    nb = a.batch
    batch = [V(f"batch{i}") for i in range(nb)]
    k_batch = [C(1) if a.k_broadcast[i] else batch[i] for i in range(nb)]

    params: list[ir.Param] = [ir.ScalarParam(f"batch{i}", "i32") for i in range(nb)]
    params += [ir.ScalarParam("S", "i32"), ir.ScalarParam("T", "i32")]
    ones = (1,) * nb
    q_name, k_name, v_name = (c.loads[0].tensor for c in part.channels)
    params.append(ir.TensorMapParam(q_name, dt, tuple(batch) + (V("S"), C(d)), ones + (64, qk_width), 0))
    for name, dim, width in ((k_name, d, qk_width), (v_name, dv, v_width)):
        params.append(ir.TensorMapParam(name, dt, tuple(k_batch) + (V("T"), C(dim)), ones + (bn, width), 0))
    params.append(ir.GlobalParam("o", a.out.dtype.name, tuple(batch) + (V("S"), C(dv))))
    if a.lse is not None:
        params.append(ir.GlobalParam("lse", "f32", tuple(batch) + (V("S"), C(1))))
    sf = a.score
    read = sf.inputs + ((a.sink,) if isinstance(a.sink, SideInput) else ())   # inputs read in the kernel
    params += [ir.GlobalParam(x.param, x.node.dtype.name, tuple(C(1) if dim is None else V(dim) for dim in x.dims))
               for x in read]

    smem = (ir.SmemDecl("Q", dt, (1, nwg, chunks, 64, qk_width), 0),
            ir.SmemDecl("K", dt, (1, chunks, bn, qk_width), 0),
            ir.SmemDecl("V", dt, (1, v_chunks, bn, v_width), 0))
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
                               b_idx + (_plus("m0", w * 64), C(c * qk_width)), q_full)
                    for w in range(nwg) for c in range(chunks))
    # The kv block's first key: k counts this tile's blocks from its first visible one.
    row = ir.mul(ir.add(K_VAR, K_FIRST), bn) if _lower_bounds(sf) else ir.mul(K_VAR, bn)
    kv_loads = tuple(ir.TmaLoad(ir.SmemRef(buf, (C(0), C(c))), name, kb_idx + (row, C(c * width)), bar)
                     for buf, name, bar, count, width in (("K", k_name, k_full, chunks, qk_width),
                                                           ("V", v_name, v_full, v_chunks, v_width))
                     for c in range(count))
    producer = ir.Role(PRODUCER, 1, s.producer_registers, (
        tile_loop(ctx, q_loads + (k_loop(kv_loads),)),
    ))

    rows0 = ir.add("m0", ir.mul("wg", 64))
    ops = ScoreOps(ctx.partition.fusion, (64, bn))
    tiles = {x.node.id: (f"{x.param}_t", (64 if x.per_query else 1, bn if x.per_key else 1)) for x in read}
    positions = {-2: rows0, -1: row}
    loads = {per_key: tuple(ir.TileLoadGlobal(tiles[x.node.id][0], x.param, _side_coords(x, rows0, row))
                            for x in read if x.per_key == per_key) for per_key in (False, True)}
    # The score function: the inner score in place on every block, then the masks that cannot be
    # analysed; the analysed ones only where a block is cut (beyond the keys, or by a mask).
    inner, _ = ops.lower(sf.inner, "s_acc", {**tiles, sf.qk: ("s_acc", (64, bn))}, positions, _causal_shift)
    every_block = [stmt for m in sf.masks if not m.analysed for stmt in _apply_mask(ops, m, tiles, positions)]
    cut = [stmt for m in sf.masks if m.analysed and m.causal is None for stmt in _apply_mask(ops, m, tiles, positions)]
    causal = [m.causal for m in sf.masks if m.causal is not None] or [None]
    cut += [ir.TileMask("s_acc", rows0, row, V("T"), _causal_shift(align)) for align in causal]
    f = ir.FloatConst
    # A mask can hide every key of a row in a block, or in all of them (bottom-right alignment
    # with S > T): keep its max finite so that exp2(S - m) is 0, not NaN.
    finite = ((ir.TileBinary("maximum", "m_blk", "m_blk", f(-1e30)),)
              if sf.rows_may_see_nothing else ())
    softmax = (
        *loads[True],
        ir.Wgmma("s_acc", ir.SmemRef("Q", (C(0), V("wg"))), ir.SmemRef("K", (C(0),)), "k", "k", C(0)),
        *inner, *every_block,
        ir.If(_block_is_cut(sf, rows0, row, bn), tuple(cut)),
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
        ir.RegDecl("o_acc", "f32", (64, dv)),
        ir.RegDecl("m_run", "f32", (64, 1)),
        ir.RegDecl("l_run", "f32", (64, 1)),
        ir.RegDecl("m_blk", "f32", (64, 1)),
        ir.RegDecl("corr", "f32", (64, 1)),
        *(ir.RegDecl(name, "f32", shape) for name, shape in tiles.values()),
        *ops.decls.values(),
        tile_loop(ctx, (ir.TileFill("o_acc", f(0.0)), *loads[False], *_running_state(a.sink, tiles),
                        k_loop(softmax))),
    ))
    grid = ir.emin("num_sms", ir.mul(heads, ir.ceil_div("S", bm)))
    return ir.Kernel(ctx.name, tuple(params), grid, (1, 1, 1), smem, barriers, setup + (producer, consumer))


def _running_state(sink, tiles: dict) -> tuple[ir.Stmt, ...]:
    """The online softmax before the first kv block: no score yet (l = 0, m = -inf), or the
    attention sink's logit as the first one, with no value row (l = 1, m = sink log2 e)."""
    f = ir.FloatConst
    if sink is None:
        return ir.TileFill("l_run", f(0.0)), ir.TileFill("m_run", f(float("-inf")))
    if not isinstance(sink, SideInput):
        return ir.TileFill("l_run", f(1.0)), ir.TileFill("m_run", f(sink * LOG2E))
    return (ir.TileFill("l_run", f(1.0)), ir.TileFill("m_run", f(0.0)),
            ir.TileBinary("add", "m_run", "m_run", tiles[sink.node.id][0]),
            ir.TileBinary("mul", "m_run", "m_run", f(LOG2E)))


def _causal_shift(align: str | None) -> ir.Expr | None:
    """How far right of the diagonal the last visible key of a row lies (None: no causal mask)."""
    if align is None:
        return None
    return C(0) if align == "top_left" else ir.sub("T", "S")


def _bound(e: ir.Expr, b: Bound) -> ir.Expr:
    """e + b: the bottom-right shift T - S first, then the constant."""
    if b.shifted:
        e = ir.add(e, ir.sub("T", "S"))
    if b.value:
        e = ir.add(e, b.value) if b.value > 0 else ir.sub(e, -b.value)
    return e


def _fold(combine, exprs: list[ir.Expr]) -> ir.Expr:
    out = exprs[0]
    for e in exprs[1:]:
        out = combine(out, e)
    return out


def _lower_bounds(sf) -> bool:
    return any(m.lower or m.key_lower for m in sf.masks if m.analysed)


def _block_is_cut(sf, rows0: ir.Expr, col0: ir.Expr, bn: int) -> ir.Expr:
    """Whether the block of 64 rows from rows0 and bn keys from col0 needs masking: it reaches
    beyond the keys, or an analysed mask hides some of its scores (a row's last visible key is
    before its last column, or its first after its first)."""
    masks = [m for m in sf.masks if m.analysed]
    ends = [_bound(ir.add(rows0, 1), b) for m in masks for b in m.upper]
    ends += [C(v + 1) for m in masks for v in m.key_upper]
    cut = ir.BinOp(">", ir.add(col0, bn), ir.emin("T", _fold(ir.emin, ends)) if ends else V("T"))
    starts = [_bound(ir.add(rows0, 63), b) for m in masks for b in m.lower]
    starts += [C(v) for m in masks for v in m.key_lower]
    for start in starts:
        cut = ir.BinOp("||", cut, ir.BinOp("<", col0, start))
    return cut


def _apply_mask(ops: ScoreOps, mask, tiles: dict, positions: dict) -> list[ir.Stmt]:
    """The mask's condition as tile ops, then -inf into the scores where it does not hold."""
    stmts, cond = ops.lower(mask.cond.id, None, tiles, positions, _causal_shift)
    minus_inf = ir.FloatConst(float("-inf"))
    keep = ("s_acc", minus_inf) if mask.visible else (minus_inf, "s_acc")
    return stmts + [ir.TileSelect("s_acc", cond, *keep)]


def _side_coords(x, rows0: ir.Expr, col0: ir.Expr) -> tuple[ir.Expr, ...]:
    """Where an input of the score function is read for the block: its batch dims at the tile's
    (b0, b1, ...), its query dim at the warpgroup's first row, its key dim at the block's first key."""
    at = {"S": rows0, "T": col0}
    return tuple(C(0) if dim is None else at.get(dim, V(dim.replace("batch", "b"))) for dim in x.dims)



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
    lets += batch_index_lets(a.batch)
    lets.append(ir.Let("m0", ir.mul("m_block", bm)))
    lets += kv_range(a.score, bm, bn)
    return ir.For(TILE_VAR, V("cta_id"), V("num_tiles"), V("num_ctas"), "persistent", tuple(lets) + body)


def kv_range(sf, bm: int, bn: int) -> list[ir.Let]:
    """The tile's kv blocks [K_FIRST, K_FIRST + K_COUNT): the analysed masks bound the keys its
    rows m0 .. m0 + bm - 1 can see, so both roles skip the blocks no row sees."""
    masks = [m for m in sf.masks if m.analysed]
    uppers = [b for m in masks for b in m.upper]
    key_uppers = [v for m in masks for v in m.key_upper]
    # keys before this one are seen by some row
    ends = [_bound(ir.add("m0", bm), b) for b in uppers] + [C(v + 1) for v in key_uppers]
    count = V("kv_blocks")
    if ends:
        visible = _fold(ir.emin, ends)
        if any(b.shifted or b.value < 0 for b in uppers) or any(v < 0 for v in key_uppers):
            visible = ir.emax(visible, 0)
        count = ir.emin("kv_blocks", ir.ceil_div(visible, bn))
    if not _lower_bounds(sf):
        return [ir.Let(K_COUNT, count)]
    # the first key some row sees
    starts = [_bound(V("m0"), b) for m in masks for b in m.lower] + [C(v) for m in masks for v in m.key_lower]
    first = ir.div(ir.emax(_fold(ir.emax, starts), 0), bn)
    return [ir.Let(K_FIRST, first), ir.Let(K_COUNT, ir.emax(ir.sub(count, K_FIRST), 0))]
