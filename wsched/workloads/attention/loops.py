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

(tile.exp2 is tile.exp2_ftz where the kernel does not split its kv blocks: `softmax_exp2`.)
Where the score function bounds the scores (`fixed_row_max`), m_run holds the bound from the
start and the block keeps only `tile.mul`, `tile.sub s_acc, s_acc, scalar(<bound>)`, the exp2,
the row sum and `tile.add l_run`: no max, correction or rescale.

With a score function (score.py, score_ops.py) the block runs its inner score in place on s_acc
right after the first wgmma, then the masks that cannot be analysed, and puts the analysed masks'
tile ops inside the `if` beside the key-tail mask (the `if` then asks whether the block is cut by
a mask, not only by T); masks bounded by diagonals only (causal, sliding windows) become that
mask's causal(...) and lower(...) bounds instead of tile ops. Inputs it reads are loaded per
tile or at the top of the kv block. The analysed masks also give the tile loop its kv range (`kv_range`): both roles skip the blocks no
row of the tile sees, addressing block k + kv_first.
"""

from __future__ import annotations

import math

import torch

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.names import (BIAS_COLS, BIAS_TERM, BIAS_WEIGHT, CONSUMER, ID_SPANS, K_COUNT, K_FIRST, K_VAR, OFFSETS, PART_L, PART_M, PART_O, PART_ROWS, PRODUCER, SPLITS, TICKETS,
                          TILE_COUNTER, TILE_ROWS, TILE_VAR)
from wsched.workloads.batch import batch_index_lets

from .score import Bound, SideInput
from .schedule import (FEW_SPLIT_BLOCKS, FEW_SPLIT_MERGE, FEW_SPLIT_TILES, MIN_KV_BLOCKS_PER_SPLIT, THIN_MARGIN_VALUE_DIM,
                       chunk_columns, merge_rows)
from .score_ops import ScoreOps, input_dtype

LOG2E = 1.0 / math.log(2.0)

V = ir.Var
C = ir.IntConst
SECTION = "section"   # host param: heads walked together, heaviest first (tile_loop)
SEARCH_STEPS = "search_steps"   # host param: steps of the binary search for a packed tile's sequence
RUN_FIRST, RUN_COUNT, RUN_NEXT = "run_first", "run_count", "run_next"   # two runs of kv blocks (union_runs)


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
    nb = a.kernel_batch
    batch = [V(f"batch{i}") for i in range(nb)]
    k_batch = _k_extents(a)
    rows = query_rows(a)

    vl = a.varlen
    params: list[ir.Param] = [ir.ScalarParam(f"batch{i}", "i32") for i in range(nb)]
    if vl and vl.k:   # the sequences: one fewer than the offsets
        params = [ir.ScalarParam(OFFSETS, "i32"), ir.HostParam("batch0", "i32", ir.sub(OFFSETS, 1))] + params[1:]
    elif vl:          # the sequences: the cache's batch, the offsets one more
        params = [ir.ScalarParam(OFFSETS, "i32")] + params
    params += [ir.ScalarParam("G", "i32")] if a.packed else []
    params.append(ir.ScalarParam(a.queries, "i32"))
    pc = a.paged
    if vl:   # the steps of the search for a tile's sequence (varlen_lets)
        params.append(ir.HostParam(SEARCH_STEPS, "i32", ir.bit_length("batch0")))
    if vl and vl.k:
        params.append(ir.ScalarParam(a.keys, "i32"))
    elif pc:   # the cache's pages, the table's pages per sequence, and the keys they hold
        params += [ir.ScalarParam("P", "i32"), ir.ScalarParam("MP", "i32"),
                   ir.HostParam(a.keys, "i32", ir.mul("MP", pc.page_size))]
    else:
        params.append(ir.ScalarParam(a.keys, "i32"))
    if s.splits_kv:
        params.append(ir.HostParam(SPLITS, "i32", split_count(s, nb, rows, a.keys)))
        if deals_rows(s):
            params.append(ir.HostParam(TILE_ROWS, "i32", tile_rows(s, nb, rows)))
    counter = takes_tiles_from_counter(a, s)
    if counter:
        params.append(ir.WorkspaceParam(TILE_COUNTER, "i32", (C(1),), zeroed=True))
    if _rows_bound_keys(a.score):
        params.append(ir.HostParam(SECTION, "i32", dynamic_section_heads() if counter
                                   else section_heads(m_blocks_of(a, row_step(s)))))
    ones = (1,) * nb
    q_name, k_name, v_name = (c.loads[0].tensor for c in part.channels)
    if vl:   # packed [N, *heads, D] read as [N, heads x D]: a tile's head is a run of columns
        params.append(ir.TensorMapParam(q_name, dt, (V(a.queries), ir.mul(_heads(nb, 1), d)), (64, qk_width), 0))
    else:
        params.append(ir.TensorMapParam(q_name, dt, tuple(batch) + (rows, C(d)), ones + (64, qk_width), 0))
    for name, dim, width in ((k_name, d, qk_width), (v_name, dv, v_width)):
        if vl and vl.k:
            params.append(ir.TensorMapParam(name, dt, (V(a.keys), ir.mul(_heads(nb, 1, k_batch), dim)), (bn, width), 0))
        elif pc:   # [P, page_size, HK, D]: a box of rows_per_load keys of one page and head
            params.append(ir.TensorMapParam(name, dt, (V("P"), C(pc.page_size), V("batch1"), C(dim)),
                                            (1, pc.rows_per_load, 1, width), 0))
        else:
            params.append(ir.TensorMapParam(name, dt, tuple(k_batch) + (V(a.keys), C(dim)), ones + (bn, width), 0))
    if vl:   # packed rows: O [NQ, heads x dv], LSE [NQ, heads]
        params.append(ir.GlobalParam("o", a.out.dtype.name, (V(a.queries), ir.mul(_heads(nb, 1), dv))))
        if a.lse is not None:
            params.append(ir.GlobalParam("lse", "f32", (V(a.queries), _heads(nb, 1))))
    else:
        params.append(ir.GlobalParam("o", a.out.dtype.name, tuple(batch) + (rows, C(dv))))
        if a.lse is not None:
            params.append(ir.GlobalParam("lse", "f32", tuple(batch) + (rows, C(1))))
    sf = a.score
    # inputs read in the kernel (the sink's may be one the score function reads too)
    read = sf.inputs + ((a.sink,) if isinstance(a.sink, SideInput)
                        and all(x.node.id != a.sink.node.id for x in sf.inputs) else ())
    # a per-key input spans the keys K and V hold (a cache's T_cache where each sequence has its own
    # length: the tile loop's `T` is that sequence's)
    extent = {"T": a.keys} if sf.lengths is not None else {}
    params += [ir.GlobalParam(x.param, x.node.dtype.name,
                              tuple(C(1) if dim is None else V(extent.get(dim, dim)) for dim in x.dims))
               for x in read]
    if sf.lengths is not None:
        params.append(ir.GlobalParam(sf.lengths.param, "i32", (V("batch0"),)))
    spans = id_spans(a, s)
    if spans is not None:   # a document mask: the host's table of each row block's kv blocks
        q_ids, k_ids = spans
        varies = [any(f"batch{i}" in x.dims for x in spans) for i in range(nb)]
        params.append(ir.SpanParam(ID_SPANS, "i32", tuple(V(f"batch{i}") if varies[i] else C(1) for i in range(nb))
                                   + (ir.ceil_div(rows, bm), C(4)), q_ids.param, k_ids.param, bm, bn))
    if pc:
        params.append(ir.GlobalParam(pc.table_param, "i32", (V("batch0"), V("MP"))))
    if vl:
        params += [ir.GlobalParam(cu, "i32", (V(OFFSETS),)) for cu in dict.fromkeys((vl.cu_q_param, vl.cu_k_param))
                   if cu is not None]
    if s.splits_kv:   # per split: O (unnormalised), row max and row sum of each tile; a ticket per warpgroup
        # Only the rows a query can fill are kept: a decode tile of 64 rows holds G x S of them
        # (4 for one token of 4 heads), and the merge reads every split's rows. The stores drop,
        # and the merge's loads read as 0, the rows past `part_rows`; no stored O row comes of them.
        tiles = ir.mul(_heads(nb), ir.ceil_div(rows, row_step(s)))
        params.append(ir.HostParam(PART_ROWS, "i32", ir.emin(row_step(s), rows)))
        params += [ir.WorkspaceParam(PART_O, "f32", (V(SPLITS), tiles, V(PART_ROWS), C(dv))),
                   ir.WorkspaceParam(PART_M, "f32", (V(SPLITS), tiles, V(PART_ROWS), C(1))),
                   ir.WorkspaceParam(PART_L, "f32", (V(SPLITS), tiles, V(PART_ROWS), C(1))),
                   ir.WorkspaceParam(TICKETS, "i32", (ir.mul(tiles, nwg) if nwg > 1 else tiles,), zeroed=True)]

    smem = (ir.SmemDecl("Q", dt, (1, nwg, chunks, 64, qk_width), 0),
            ir.SmemDecl("K", dt, (1, chunks, bn, qk_width), 0),
            ir.SmemDecl("V", dt, (1, v_chunks, bn, v_width), 0))
    barriers = tuple(ir.BarrierDecl(name, 1) for c in part.channels for name in (c.full, c.empty))

    setup = (
        ir.Let("heads", _heads(nb, 1 if vl else 0)),
        ir.Let("m_blocks", m_blocks_of(a, row_step(s))),
        ir.Let("num_tiles", ir.mul("heads", "m_blocks")),
    ) + ((ir.Let("kv_blocks", ir.ceil_div("T", bn)),) if sf.lengths is None and not (vl and vl.k) else ()) \
      + ((ir.Let("num_units", ir.mul("num_tiles", SPLITS)),) if s.splits_kv else ())

    q_full, k_full, v_full = (ir.BarRef(c.full, C(0)) for c in part.channels)
    b_idx = tuple(V(f"b{i}") for i in range(nb))
    kb_idx = tuple(C(0) if a.k_broadcast[i] else b_idx[i] for i in range(nb))
    if vl:   # the sequence's rows of the packed Q, its head's columns
        q_loads = tuple(ir.TmaLoad(ir.SmemRef("Q", (C(0), C(w), C(c))), q_name,
                                   (ir.add("q_start", _plus("m0", w * 64)), _plus_mul("head", d, c * qk_width)), q_full)
                        for w in range(nwg) for c in range(chunks))
    else:
        q_loads = tuple(ir.TmaLoad(ir.SmemRef("Q", (C(0), C(w), C(c))), q_name,
                                   b_idx + (_plus("m0", w * 64), C(c * qk_width)), q_full)
                        for w in range(nwg) for c in range(chunks))
    # The kv block's first key: k counts this tile's blocks from its first visible one.
    if two_runs(a, s):   # k walks the first run of kv blocks, then the second (`kv_range`)
        row = ir.mul(ir.Call("select", (ir.lt(K_VAR, RUN_COUNT), ir.add(K_VAR, RUN_FIRST),
                                        ir.sub(ir.add(K_VAR, RUN_NEXT), RUN_COUNT))), bn)
    elif kv_range_has_first(sf) or s.splits_kv or spans is not None:
        row = ir.mul(ir.add(K_VAR, K_FIRST), bn)
    else:
        row = ir.mul(K_VAR, bn)
    if vl and vl.k:
        kv_loads = tuple(ir.TmaLoad(ir.SmemRef(buf, (C(0), C(c))), name,
                                    (ir.add("k_start", row), _plus_mul("kv_head", dim, c * width)), bar)
                         for buf, name, bar, count, width, dim in (("K", k_name, k_full, chunks, qk_width, d),
                                                                    ("V", v_name, v_full, v_chunks, v_width, dv))
                         for c in range(count))
    else:
        kv_loads = tuple(ir.TmaLoad(ir.SmemRef(buf, (C(0), C(c))), name, kb_idx + (row, C(c * width)), bar)
                     for buf, name, bar, count, width in (("K", k_name, k_full, chunks, qk_width),
                                                           ("V", v_name, v_full, v_chunks, v_width))
                     for c in range(count)) if not pc else _paged_loads(
        pc, bn, row, (("K", k_name, k_full, chunks, qk_width), ("V", v_name, v_full, v_chunks, v_width)))
    producer = ir.Role(PRODUCER, 1, s.producer_registers, (
        tile_loop(ctx, q_loads + (k_loop(kv_loads),)),
    ))

    rows0 = ir.add("m0", ir.mul("wg", 64))
    tiles = {x.node.id: (f"{x.param}_t", (64 if x.per_query else 1, bn if x.per_key else 1)) for x in read}
    ops = ScoreOps(ctx.partition.fusion, (64, bn), inputs={tiles[x.node.id][0]: input_dtype(x.node) for x in read})
    positions = {-2: rows0, -1: row}
    loads = {per_key: tuple(ir.TileLoadGlobal(tiles[x.node.id][0], x.param, _side_coords(x, rows0, row))
                            for x in read if x.per_key == per_key) for per_key in (False, True)}
    # The score function: the inner score in place on every block, then the masks that cannot be
    # analysed; the analysed ones only where a block is cut (beyond the keys, or by a mask).
    inner, _ = ops.lower(sf.inner, "s_acc", {**tiles, sf.qk: ("s_acc", (64, bn))}, positions, _causal_shift)
    weight, bias_cols, bias_add = _bias(sf, tiles, row, rows0, a.scale)
    # A document mask whose ids give the spans table and whose condition is their equality alone:
    # only on the blocks the table does not call full (one id in all their keys, the rows' one id),
    # its per-key ids loaded there, right before it, where nothing else reads them. (Joined by `&`
    # to other conditions, the table still bounds the kv range, but the mask runs on every block:
    # a full block is not full for the other conditions.)
    id_mask = next((m for m in sf.masks if spans is not None and m.ids == spans and m.cond.op == "eq"), None)
    every_block = [stmt for m in sf.masks if not m.analysed and m is not id_mask and not m.alternatives
                   for stmt in _apply_mask(ops, m, tiles, positions)]
    # a mask `A | B` of analysed conjunctions: on the blocks none of them shows whole
    every_block += [ir.If(_union_hides_some(m, C(0) if a.packed else rows0, row, bn),
                          tuple(_apply_mask(ops, m, tiles, positions))) for m in sf.masks if m.alternatives]
    partial_block = ir.BinOp("||", ir.lt(ir.add(K_VAR, K_FIRST), "span_full"),
                             ir.BinOp(">=", ir.add(K_VAR, K_FIRST), ir.add("span_full", "span_fulls")))
    if id_mask is not None:
        late = ()
        if not _read_elsewhere(ctx.partition.fusion, sf, id_mask, spans[1]):
            # loaded where it is used: no [1, BN] tile live across the wgmma (H100, one document
            # B4 H16 S4096: D128 537 vs 481 TFLOP/s loaded before it; 4 documents D64 211 vs 191)
            late = tuple(x for x in loads[True] if x.tensor == spans[1].param)
            loads[True] = tuple(x for x in loads[True] if x not in late)
        every_block.append(ir.If(partial_block, late + tuple(_apply_mask(ops, id_mask, tiles, positions))))
    span_fulls = () if id_mask is None else (
        ir.LoadGlobal("span_full", ID_SPANS, span_row(spans, nb) + (C(2),)),
        ir.LoadGlobal("span_fulls", ID_SPANS, span_row(spans, nb) + (C(3),)))
    # Analysed masks bounded only by diagonals (causal_mask, causal and sliding-window `where`s)
    # join the key-tail mask as its causal(...) and lower(...) bounds: one compare per bound and
    # element, on cut blocks only; the other analysed masks' tile ops run there too.
    diagonal = [m for m in sf.masks if m.analysed and not (m.key_upper or m.key_lower)]
    cut = [stmt for m in sf.masks if m.analysed and m not in diagonal for stmt in _apply_mask(ops, m, tiles, positions)]
    uppers = [_diagonal(b) for m in diagonal for b in m.upper]
    lowers = [_diagonal(b) for m in diagonal for b in m.lower]
    cut.append(ir.TileMask("s_acc", rows0, row, V("T"), _fold(ir.emin, uppers) if uppers else None,
                           V("S") if a.packed else None, _fold(ir.emax, lowers) if lowers else None))
    f = ir.FloatConst
    # A mask can hide every key of a row in a block, or in all of them (bottom-right alignment
    # with S > T), or in all of a split's blocks (a split starting above a row's diagonal): keep
    # its max finite so that exp2(S - m) is 0, not NaN.
    row_max = fixed_row_max(a)
    if row_max is None:   # the online softmax: a running row max, the sum and O rescaled to it
        finite = ((ir.TileBinary("maximum", "m_blk", "m_blk", f(-1e30)),)
                  if sf.rows_may_see_nothing or (s.splits_kv and sf.masks) else ())
        exponentials = (
            # The row max is taken on the unscaled scores (the scale is positive), so that the
            # scale and the subtraction below fuse into one multiply-add per element.
            ir.TileReduce("max", "m_blk", "s_acc", 1),
            ir.TileBinary("mul", "m_blk", "m_blk", f(a.scale * LOG2E)),
            ir.TileBinary("maximum", "m_blk", "m_blk", "m_run"),
            *finite,
            ir.TileBinary("sub", "corr", "m_run", "m_blk"),
            ir.TileUnary(s.softmax_exp2, "corr", "corr"),
            ir.TileBinary("maximum", "m_run", "m_run", "m_blk"),
            ir.TileBinary("mul", "s_acc", "s_acc", f(a.scale * LOG2E)),
            ir.TileBinary("sub", "s_acc", "s_acc", "m_blk"),
            ir.TileUnary(s.softmax_exp2, "s_acc", "s_acc"),
            ir.TileReduce("sum", "m_blk", "s_acc", 1),
            ir.TileBinary("mul", "l_run", "l_run", "corr"),
            ir.TileBinary("add", "l_run", "l_run", "m_blk"),
            ir.TileBinary("mul", "o_acc", "o_acc", "corr"),
        )
    else:   # scores bounded above: exp2 against the bound, m_run holds it (fixed_row_max)
        exponentials = (
            ir.TileBinary("mul", "s_acc", "s_acc", f(a.scale * LOG2E)),
            ir.TileBinary("sub", "s_acc", "s_acc", f(row_max)),
            ir.TileUnary(s.softmax_exp2, "s_acc", "s_acc"),
            ir.TileReduce("sum", "m_blk", "s_acc", 1),
            ir.TileBinary("add", "l_run", "l_run", "m_blk"),
        )
    softmax = (
        *loads[True],
        ir.Wgmma("s_acc", ir.SmemRef("Q", (C(0), V("wg"))), ir.SmemRef("K", (C(0),)), "k", "k", C(0)),
        *bias_cols, *inner, *bias_add, *every_block,
        ir.If(_block_is_cut(sf, C(0) if a.packed else rows0, row, bn), tuple(cut)),
        *exponentials,
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
        *(ir.RegDecl(name, ops.inputs[name], shape) for name, shape in tiles.values()),
        *ops.decls.values(),
        *((ir.RegDecl(BIAS_WEIGHT, "f32", (1, 1)), ir.RegDecl(BIAS_COLS, "f32", (1, bn))) if sf.bias else ()),
        *((ir.RegDecl(BIAS_TERM, "f32", (1, 1)),) if len(sf.bias) > 1 else ()),
        tile_loop(ctx, (*span_fulls, ir.TileFill("o_acc", f(0.0)), *loads[False], *weight, *_running_state(a.sink, tiles, row_max),
                        k_loop(softmax))),
    ))
    units = ir.mul(_heads(nb, 1 if vl else 0), m_blocks_of(a, row_step(s)))
    grid = ir.emin("num_sms", ir.mul(units, SPLITS) if s.splits_kv else units)
    return ir.Kernel(ctx.name, tuple(params), grid, (1, 1, 1), smem, barriers, setup + (producer, consumer))


def query_rows(a) -> ir.Expr:
    """The rows of the query dim the tiles walk: S, or G x S with GQA packing (row r is query
    r mod S of head r / S of the KV head's group)."""
    return ir.mul("G", "S") if a.packed else V("S")


def _heads(nb: int, first: int = 0, extents: list | None = None) -> ir.Expr:
    """batch<first> x ... x batch<nb-1>: the (batch, head) slices the tiles walk (from batch1:
    the heads of one packed sequence); `extents` in place of the batch params (K's, 1 where
    it broadcasts)."""
    dims = [V(f"batch{i}") if extents is None else extents[i] for i in range(first, nb)]
    dims = [x for x in dims if x != C(1)]
    heads: ir.Expr = dims[0] if dims else C(1)
    for x in dims[1:]:
        heads = ir.mul(heads, x)
    return heads


def _plus_mul(name: str, factor: int, offset: int) -> ir.Expr:
    """name * factor + offset: a head's first column (plus a chunk's) in a [N, heads x D] view."""
    e = ir.mul(name, factor)
    return ir.add(e, offset) if offset else e


def deals_rows(s) -> bool:
    """Whether a tile's rows may go to several tiles (`tile_rows`): split-KV on one consumer
    warpgroup (with two or three, a tile's second warpgroup would compute rows for nothing)."""
    return s.splits_kv and s.consumer_warpgroups == 1


def row_step(s) -> ir.Expr:
    """The query rows from one tile's first to the next's: the tile's bm, or the host's
    `tile_rows` where the kernel deals rows (`deals_rows`)."""
    return V(TILE_ROWS) if deals_rows(s) else C(s.bm)


def m_blocks_of(a, bm: int | ir.Expr) -> ir.Expr:
    """The m-blocks the tiles of one head walk: ceil(rows / bm), or, for packed sequences, the
    virtual blocks S_packed / bm + B: sequence b takes blocks from cu_q[b] / bm + b on, which
    leaves it at least ceil(its queries / bm) of them (`varlen_lets`)."""
    if a.varlen is not None:
        return ir.add(ir.div(a.queries, bm), "batch0")
    return ir.ceil_div(query_rows(a), bm)


def _paged_loads(pc, bn: int, row: ir.Expr, operands) -> tuple[ir.Stmt, ...]:
    """A kv block of bn keys from a paged cache: for each rows_per_load-key slice its page from
    the block table (clamped into the table's row), then one TMA box per slice and column chunk
    of K, then of V, into rows [r * rows_per_load, ...) of the block. A slice past the sequence's
    keys (T) reads no page: its page index is P, past the cache, so TMA fills it with zeros."""
    rows, ps = pc.rows_per_load, pc.page_size
    keys = [row if r == 0 else ir.add(row, r * rows) for r in range(bn // rows)]
    stmts: list[ir.Stmt] = [ir.LoadGlobal(f"page{r}", pc.table_param,
                                          (V("b0"), ir.emin(ir.div(key, ps), ir.sub("MP", 1))))
                            for r, key in enumerate(keys)]
    for buf, name, bar, count, width in operands:
        for r, key in enumerate(keys):
            page = ir.Call("select", (ir.lt(key, "T"), V(f"page{r}"), V("P")))
            for c in range(count):
                stmts.append(ir.TmaLoad(ir.SmemRef(buf, (C(0), C(c))), name,
                                        (page, ir.mod(key, ps) if ps > bn else C(0), V("b1"), C(c * width)), bar,
                                        C(r * rows) if len(keys) > 1 else None))
    return tuple(stmts)


def split_count(s, nb: int, rows: ir.Expr, keys: str = "T") -> ir.Expr:
    """The host's split count for a call: (tile, split) units on half the SMs where the tiles
    are few (at most num_sms / FEW_SPLIT_TILES), unless a split on all of them would take
    FEW_SPLIT_BLOCKS kv blocks or more and the merge at most FEW_SPLIT_MERGE splits; at most
    `split_kv`; at least MIN_KV_BLOCKS_PER_SPLIT kv blocks a split; and no more splits than the
    blocks a split takes (ceil(blocks / splits)) leave work for: 17 blocks in 8 splits would be 3
    a split and 2 empty splits, so 6."""
    bn = s.bn
    tiles = _split_tiles(s, nb, rows)
    blocks = ir.emax(1, ir.ceil_div(keys, bn))
    longest = ir.emax(1, ir.div(blocks, MIN_KV_BLOCKS_PER_SPLIT))
    on_all = ir.emin(s.split_kv, ir.emax(1, ir.div("num_sms", tiles)))   # splits a tile, units on all SMs
    few = ir.mul(ir.BinOp("<=", ir.mul(FEW_SPLIT_TILES, tiles), V("num_sms")),   # 1 or 0
                 ir.BinOp("||", ir.BinOp("<", blocks, ir.mul(FEW_SPLIT_BLOCKS, on_all)),
                          ir.BinOp(">", on_all, C(FEW_SPLIT_MERGE))))
    units = ir.emax(1, ir.div("num_sms", ir.mul(tiles, ir.add(1, few))))
    wanted = ir.emin(ir.emin(s.split_kv, longest), units)
    return ir.ceil_div(blocks, ir.ceil_div(blocks, wanted))


def _split_tiles(s, nb: int, rows: ir.Expr) -> ir.Expr:
    """The tiles the split rule counts: heads x blocks of BM query rows (before any are dealt:
    `split_count` and `tile_rows` read it, so the splits do not depend on the dealing)."""
    return ir.mul(_heads(nb), ir.ceil_div(rows, s.bm))


def tile_rows(s, nb: int, rows: ir.Expr) -> ir.Expr:
    """The host's query rows a split-KV tile of one warpgroup owns (`row_step`): its 64, unless
    its splits fill at most half the SMs (num_sms / (tiles x splits) >= 2) and its rows hold
    more than one merge chunk (merge_rows: 8 rows at head dim 128); then the rows of each 64 go
    to up to `chunks` tiles of whole chunks, as many as the idle SMs take. Every such tile runs
    the wgmma over 64 rows from its first (of a GQA-packed tile: against the same kv blocks, read
    from L2 by the tiles of a split side by side) but stores and merges only its own chunks: the
    last split's merge, one load latency a chunk and group of splits on one SM, is what one KV
    head's 32 query rows (MQA at batch 1) wait for. Measured on an H100 (cold L2, D128, B1, one
    KV head, the same splits, 2026-11-25): 8 query heads (one chunk) vs 32 (four) T4621 13.8 /
    20.3 us, T32768 22.5 / 35.9 (cuDNN with 32 heads 13.8, 20.6); 32 heads dealt 13.5, 24.9
    (docs/benchmarks.md has more, head dims 64 and 256 and the few-tiles prefill variant)."""
    bm = s.bm
    step = merge_rows(s.value_dim)
    chunks = ir.ceil_div(ir.emin(bm, rows), step)
    tiles = _split_tiles(s, nb, rows)
    parts = ir.emin(chunks, ir.emax(1, ir.div("num_sms", ir.mul(tiles, SPLITS))))
    dealt = ir.BinOp("&&", ir.BinOp(">", V(SPLITS), C(1)), ir.BinOp(">", parts, C(1)))
    return ir.Call("select", (dealt, ir.mul(step, ir.ceil_div(chunks, parts)), C(bm)))


def takes_tiles_from_counter(a, s) -> bool:
    """Whether each CTA takes its next tile from a counter (passes/dynamic_tiles.py): where tiles
    differ in work (a mask bounds the keys by the row; packed sequences of their own lengths; a
    document mask's spans: 1.12-1.20x the static order on an H100, 4 and 16 documents), so
    that the CTAs end together, unless split-KV (its units are even) or beside a paged producer at
    the value dim with no register margin (the counter's scalars spilled 12 bytes there, nvcc
    2026-11-24; the 28 unpaged causal, softcap-window, ALiBi and GQA schedules of the search space
    at 256 build without spills)."""
    return (not s.splits_kv and (s.value_dim != THIN_MARGIN_VALUE_DIM or a.paged is None)
            and (_rows_bound_keys(a.score) or a.varlen is not None or id_spans(a, s) is not None))


# With the tiles taken from a counter, a section of heads walked heaviest m-block first has
# num_sms / DYNAMIC_SECTION_SMS heads (8 on 132 SMs: some 16 tiles of each head in flight, which
# share its K and V in L2). Measured on an H100 against sections of 1, 4, 16 heads and the static
# rule (2026-11-24, causal D128 TFLOP/s, one head / 8 heads): B4 H16 S4096 555 / 573, S2000 412 /
# 452, B1 H16 S8192 574 / 622, S16384 612 / 645, GQA B4 H32/8 S4096 579 / 591; 4 heads within 2%
# of 8, 16 lower at D96 and S16384; all heads at once (64) 405 at S4096 (K and V out of L2).
DYNAMIC_SECTION_SMS = 16


def dynamic_section_heads() -> ir.Expr:
    return ir.emax(1, ir.div("num_sms", DYNAMIC_SECTION_SMS))


def section_heads(m_blocks: ir.Expr) -> ir.Expr:
    """How many (batch, head) slices the causal tile order walks together, heaviest m-block first
    across them: 1 (one head after another, in reverse m-block order: the heads in flight share
    K and V in L2) unless a head has at least half as many m-blocks as the GPU has SMs; then two
    waves of tiles' worth. With one head after another the CTAs' static strides can meet the
    m-block period (132 SMs, 128 m-blocks at S = 16384): a CTA then sums 3x another's kv blocks.
    Measured on an H100 against cuDNN in one run (2026-11-23): S16384 causal 0.69 one head after
    another, 0.86 in sections of 2 heads; sections at S <= 8192 were 0-11% slower."""
    long = ir.BinOp(">=", ir.mul(2, m_blocks), V("num_sms"))
    return ir.add(1, ir.mul(long, ir.sub(ir.ceil_div(ir.mul(2, "num_sms"), m_blocks), 1)))


# The widest range of exponents (log2 units) over which the softmax of bounded scores takes
# exp2 against the bound instead of the running row max (`fixed_row_max`): P = 2^(c s - bound)
# then lies in [2^-96, 1]. A row's sum stays above the epilogue's clamp of l at 1e-30 (2^-99.7)
# even where it sees one key at the floor, and in fp32 far from the smallest normal 2^-126, so
# that no visible score's weight, nor its product with a value above 2^-30, flushes to 0.
FIXED_MAX_RANGE = 96.0


def fixed_row_max(a) -> float | None:
    """The row max the softmax may use for every row and block, in the exp2 domain, or None:
    where the score function bounds its scores (`ScoreFunction.inner_range`: softcapping's
    c tanh(s / c) lies in [-c, c]) within FIXED_MAX_RANGE exponents, exp2(c s - bound) is exact
    softmax arithmetic (any per-row constant cancels between P V and the sum) without a row max,
    a correction factor or a rescale of O and the sum per kv block. Not beside a bias (ALiBi's
    term grows with the distance), nor a sink (its logit is unbounded), nor where P, cast to the
    operand dtype for the P V product, would fall below that dtype's smallest normal (bf16's is
    fp32's 2^-126; f16's 2^-14 would round softcapping's P to 0)."""
    lo, hi = a.score.inner_range
    c = a.scale * LOG2E
    if a.sink is not None or a.score.bias or not (math.isfinite(lo) and math.isfinite(hi)) \
            or (hi - lo) * c > min(FIXED_MAX_RANGE, -math.log2(torch.finfo(a.q.dtype.torch_dtype).tiny)):
        return None
    return hi * c


def _running_state(sink, tiles: dict, bound: float | None = None) -> tuple[ir.Stmt, ...]:
    """The online softmax before the first kv block: no score yet (l = 0, m = -inf, or m = the
    scores' bound where `fixed_row_max` gives one), or the attention sink's logit as the first
    one, with no value row (l = 1, m = sink log2 e)."""
    f = ir.FloatConst
    if sink is None:
        return ir.TileFill("l_run", f(0.0)), ir.TileFill("m_run", f(float("-inf") if bound is None else bound))
    if not isinstance(sink, SideInput):
        return ir.TileFill("l_run", f(1.0)), ir.TileFill("m_run", f(sink * LOG2E))
    return (ir.TileFill("l_run", f(1.0)), ir.TileFill("m_run", f(0.0)),
            ir.TileBinary("add", "m_run", "m_run", tiles[sink.node.id][0]),
            ir.TileBinary("mul", "m_run", "m_run", f(LOG2E)))


def _bottom_right(sf) -> bool:
    """Whether a mask aligns the diagonal bottom-right (query i sees the keys up to T - S + i)."""
    return any(b.shifted for m in _bounded_masks(sf) for b in m.upper + m.lower)


def _bounded_masks(sf) -> list:
    """Every analysed mask, and each alternative of a mask `A | B` of analysed conjunctions."""
    return [m for m in sf.masks if m.analysed] + [x for m in sf.masks for x in m.alternatives]


def _union_range(m, row_start: ir.Expr, row_end: ir.Expr) -> tuple[ir.Expr | None, ir.Expr | None]:
    """(first, end) of the keys a mask `A | B | ...` shows rows row_start .. row_end - 1: the hull
    of its alternatives' runs [first, end) within [0, T), runs left empty by T left out (None:
    from key 0, or to T, where no alternative bounds that side)."""
    runs = []
    for alt in m.alternatives:
        starts, ends = _key_bounds(alt, row_start, row_end)
        runs.append((_fold(ir.emax, starts) if starts else None,
                     ir.emin("T", _fold(ir.emin, ends)) if ends else None))
    first = end = None
    if any(a is not None for a, _ in runs):
        first = _fold(ir.emin, [ir.Call("select", (ir.lt(C(0) if a is None else a, V("T") if e is None else e),
                                                   C(0) if a is None else a, V("T"))) for a, e in runs])
    if any(e is not None for _, e in runs):
        end = _fold(ir.emax, [ir.Call("select", (ir.lt(C(0) if a is None else a, V("T") if e is None else e),
                                                 V("T") if e is None else e, C(0))) for a, e in runs])
    return first, end


def _key_bounds(m, row_start: ir.Expr, row_end: ir.Expr) -> tuple[list[ir.Expr], list[ir.Expr]]:
    """The analysed mask `m`'s bounds on the keys of rows row_start .. row_end - 1: the first key
    each lower bound lets the first row see, the end (exclusive) each upper bound lets the last."""
    return ([_bound(row_start, b) for b in m.lower] + [C(v) for v in m.key_lower],
            [_bound(row_end, b) for b in m.upper] + [C(v + 1) for v in m.key_upper])


def _bias(sf, tiles: dict, row: ir.Expr, rows0: ir.Expr, scale: float):
    """The diagonal bias (`score.DiagonalBias`) as tile ops: (once per tile, the weight
    w = sum of coef / scale * u, one number; per kv block before the inner score, w * (j - r) on a
    [1, BN] tile; after it, that tile added to the scores). r is the warpgroup's first row, and
    T - S further where the diagonal is aligned bottom-right (a decode step), so that j - r is
    small where a row's weight lies. The row's rest, w * (r - i), goes to the LSE (`bias_lse`)."""
    if not sf.bias:
        return (), (), ()
    f, weight = ir.FloatConst, []
    for n, term in enumerate(sf.bias):
        target = BIAS_WEIGHT if n == 0 else BIAS_TERM
        factors = [tiles[x][0] for x in term.factors]
        if factors:
            weight.append(ir.TileBinary("mul", target, factors[0], f(term.coef / scale)))
            weight += [ir.TileBinary("mul", target, target, u) for u in factors[1:]]
        else:
            weight.append(ir.TileFill(target, f(term.coef / scale)))
        if n:
            weight.append(ir.TileBinary("add", BIAS_WEIGHT, BIAS_WEIGHT, BIAS_TERM))
    r = ir.add(rows0, ir.sub("T", "S")) if _bottom_right(sf) else rows0
    cols = (ir.TileIota(BIAS_COLS, 1, ir.sub(row, r)),
            ir.TileBinary("mul", BIAS_COLS, BIAS_COLS, BIAS_WEIGHT))
    return tuple(weight), cols, (ir.TileBinary("add", "s_acc", "s_acc", BIAS_COLS),)


def bias_lse(sf, scale: float, m: str = "m_run", l: str = "l_run", first: ir.Expr = C(0)) -> tuple[ir.Stmt, ...]:
    """The diagonal bias's part along a row, scale * w * (r - i) (r as `_bias` takes it), added to
    the LSE `l`; the dead `m` holds i - r first (`first`: the tile's first row in the warpgroup's)."""
    f = ir.FloatConst
    start = ir.sub("S", "T") if _bottom_right(sf) else C(0)
    if first != C(0):
        start = ir.add(start, first) if _bottom_right(sf) else first
    return (ir.TileIota(m, 0, start),
            ir.TileBinary("mul", m, m, BIAS_WEIGHT),
            ir.TileBinary("mul", m, m, f(-scale)),
            ir.TileBinary("add", l, l, m))


def _causal_shift(align: str | None) -> ir.Expr | None:
    """How far right of the diagonal the last visible key of a row lies (None: no causal mask)."""
    if align is None:
        return None
    return C(0) if align == "top_left" else ir.sub("T", "S")


def _diagonal(b: Bound) -> ir.Expr:
    """A bound on j - i as tile.mask's causal(...) or lower(...): b's value, T - S further where
    it is aligned bottom-right."""
    return _bound(ir.sub("T", "S"), Bound(b.value)) if b.shifted else C(b.value)


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


def two_runs(a, s) -> bool:
    """Whether a tile walks the kv blocks of a mask `A | B` as two runs, one per alternative
    (a sliding window and sink tokens: the blocks between them skipped): the mask is the only
    one bounding the keys, of two alternatives, one of which may start after key 0, in a kernel
    of one kv range per tile. H100, B4 H16 S4096, window 1024 and 4 sink tokens: D128 423 vs
    229 TFLOP/s walking the hull of the two, D64 268 vs 133; a prefix LM (both runs from key 0)
    keeps its one range (602 vs 590 as two runs)."""
    sf = a.score
    unions = [m for m in sf.masks if m.alternatives]
    return (len(unions) == 1 and len(unions[0].alternatives) == 2 and not any(m.analysed for m in sf.masks)
            and any(x.lower or x.key_lower for x in unions[0].alternatives)   # else both runs start at 0: one
            and not (a.packed or a.varlen or s.splits_kv or id_spans(a, s) is not None))


def union_runs(sf, bm: int, bn: int) -> list[ir.Stmt]:
    """The kv blocks of the tile's rows m0 .. m0 + bm - 1 under a mask `A | B` as two runs: each
    alternative's blocks [first, end) within [0, kv_blocks), the run that starts first taken first
    and the other's clipped to begin after it; k < RUN_COUNT walks RUN_FIRST + k, then
    RUN_NEXT + k - RUN_COUNT. Overlapping runs make one, empty ones none."""
    (m,) = [m for m in sf.masks if m.alternatives]
    bounds = []
    for alt in m.alternatives:
        starts, ends = _key_bounds(alt, V("m0"), ir.add("m0", bm))
        first = ir.div(ir.emax(_fold(ir.emax, starts), 0), bn) if starts else C(0)
        end = ir.emin("kv_blocks", ir.ceil_div(ir.emax(_fold(ir.emin, ends), 0), bn)) if ends else V("kv_blocks")
        bounds.append((first, end))
    (a0, a1), (b0, b1) = bounds
    lets: list[ir.Stmt] = [ir.Let("run_a0", a0), ir.Let("run_a1", a1), ir.Let("run_b0", b0), ir.Let("run_b1", b1)]
    a_first = ir.BinOp("<=", V("run_a0"), V("run_b0"))
    pick = lambda x, y: ir.Call("select", (a_first, V(x), V(y)))   # noqa: E731
    lets += [ir.Let(RUN_FIRST, pick("run_a0", "run_b0")),
             ir.Let(RUN_COUNT, ir.emax(ir.sub(pick("run_a1", "run_b1"), RUN_FIRST), 0)),
             ir.Let(RUN_NEXT, ir.emax(pick("run_b0", "run_a0"), ir.add(RUN_FIRST, RUN_COUNT))),
             ir.Let(K_COUNT, ir.add(RUN_COUNT, ir.emax(ir.sub(pick("run_b1", "run_a1"), RUN_NEXT), 0)))]
    return lets


def kv_range_has_first(sf) -> bool:
    """Whether the masks bound a tile's first kv block (kv_first), not only its count."""
    return any(m.lower or m.key_lower for m in _bounded_masks(sf))


def _block_is_cut(sf, rows0: ir.Expr, col0: ir.Expr, bn: int) -> ir.Expr:
    """Whether the block of 64 rows from rows0 and bn keys from col0 needs masking: it reaches
    beyond the keys, or an analysed mask hides some of its scores (a row's last visible key is
    before its last column, or its first after its first)."""
    return _hides_some([m for m in sf.masks if m.analysed], rows0, col0, bn, V("T"))


def _hides_some(masks: list, rows0: ir.Expr, col0: ir.Expr, bn: int, keys: ir.Expr | None) -> ir.Expr:
    """Whether the analysed `masks` (and the key count `keys`, if given) hide a score of the
    block of 64 rows from rows0 and bn keys from col0."""
    ends = [_bound(ir.add(rows0, 1), b) for m in masks for b in m.upper]
    ends += [C(v + 1) for m in masks for v in m.key_upper]
    if keys is not None:
        ends = [ir.emin(keys, _fold(ir.emin, ends)) if ends else keys]
    cut = ir.BinOp(">", ir.add(col0, bn), _fold(ir.emin, ends)) if ends else None
    starts = [_bound(ir.add(rows0, 63), b) for m in masks for b in m.lower]
    starts += [C(v) for m in masks for v in m.key_lower]
    for start in starts:
        before = ir.BinOp("<", col0, start)
        cut = before if cut is None else ir.BinOp("||", cut, before)
    return ir.IntConst(0) if cut is None else cut


def _union_hides_some(m, rows0: ir.Expr, col0: ir.Expr, bn: int) -> ir.Expr:
    """Whether a mask `A | B | ...` hides a score of the block: none of its alternatives shows
    the whole block."""
    return _fold(lambda a, b: ir.BinOp("&&", a, b), [_hides_some([x], rows0, col0, bn, None) for x in m.alternatives])


def _read_elsewhere(fusion, sf, mask, x: SideInput) -> bool:
    """Whether input `x` is read by the score function other than through `mask`'s condition
    (the inner score, another mask, the bias, the sink)."""
    import networkx as nx

    others = [sf.inner] + [m.cond.id for m in sf.masks if m is not mask and m.cond is not None]
    others += [factor for b in sf.bias for factor in b.factors]
    return any(x.node.id == n or x.node.id in nx.ancestors(fusion.graph, n) for n in others)


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
    """Both roles: tile -> (batch indices, m-block) and the tile's kv blocks. One (batch, head)
    after another, m-blocks in reverse order (with a causal mask the longest tiles start first);
    where a mask bounds the keys by the query row and the sequence is long, in sections of
    `section` heads walked heaviest m-block first across them (`section_heads`: longest-
    processing-time first, so the persistent CTAs end together). With split-KV the index walks
    (tile, split) units, the splits of one tile next to each other."""
    a, s = ctx.partition.payload, ctx.schedule
    bm, bn, _ = s.tile
    nb = a.kernel_batch
    t = V("work") if s.splits_kv else V(TILE_VAR)
    lets: list[ir.Stmt] = []
    if s.splits_kv:
        lets += [ir.Let("split", ir.mod(TILE_VAR, SPLITS)), ir.Let("work", ir.div(TILE_VAR, SPLITS))]
    block = "v_block" if a.varlen else "m_block"   # packed sequences: a virtual block (varlen_lets)
    if _rows_bound_keys(a.score):
        # sections of `section` heads (the last one may hold fewer), each walked heaviest m-block first
        lets += [ir.Let("first_head", ir.mul(ir.div(t, ir.mul(SECTION, "m_blocks")), SECTION)),
                 ir.Let("section_heads", ir.emin(SECTION, ir.sub("heads", "first_head"))),
                 ir.Let("in_section", ir.sub(t, ir.mul("first_head", "m_blocks"))),
                 ir.Let(block, ir.sub(ir.sub("m_blocks", 1), ir.div("in_section", "section_heads"))),
                 ir.Let("rest", ir.add("first_head", ir.mod("in_section", "section_heads")))]
    else:
        lets += [ir.Let(block, ir.sub(ir.sub("m_blocks", 1), ir.mod(t, "m_blocks"))),
                 ir.Let("rest", ir.div(t, "m_blocks"))]
    if a.varlen:
        lets += varlen_lets(a, bm, bn)
    else:
        lets += batch_index_lets(nb) if nb else []
    if a.score.lengths is not None:   # this sequence's keys: its length, within the cache
        lets += [ir.LoadGlobal("T_seq", a.score.lengths.param, (V("b0"),)),
                 ir.Let("T", ir.emax(ir.emin("T_seq", a.keys), 0)),
                 ir.Let("kv_blocks", ir.ceil_div("T", bn))]
    lets.append(ir.Let("m0", ir.mul("m_block", row_step(s))))
    spans = id_spans(a, s)
    kv = (union_runs(a.score, bm, bn) if two_runs(a, s) else
          kv_range(a.score, bm, bn, a.packed, s.splits_kv, None if spans is None else span_row(spans, nb)))
    if a.varlen:   # a virtual block past its sequence's queries: no kv block, nothing stored
        kv = [ir.Let(x.name, ir.Call("select", (ir.lt("m0", "S"), x.value, C(0)))) if x.name == K_COUNT else x
              for x in kv]
    lets += kv
    count = V("num_units") if s.splits_kv else V("num_tiles")
    return ir.For(TILE_VAR, V("cta_id"), count, V("num_ctas"), "persistent", tuple(lets) + body)


def varlen_lets(a, bm: int, bn: int) -> list[ir.Stmt]:
    """Packed sequences (ws.varlen): the tile's heads from `rest`, then its sequence b0 from its
    virtual block: sequence b owns the blocks from V_b = cu_q[b] / bm + b on (V_b grows with b,
    and V_{b+1} - V_b >= ceil(queries of b / bm)); b0 is the last b with V_b <= v_block, found by
    a binary search over cu_q in `search_steps` = bit_length(B) steps. Then the sequence's rows:
    S and T are its query and key counts, q_start and k_start its first rows in the packed
    tensors (offsets clamped into the tensors: bad offsets never read or write outside them).
    A block past the sequence's queries has m0 >= S: no kv block, no row stored."""
    vl, nb = a.varlen, a.kernel_batch
    lets: list[ir.Stmt] = list(batch_index_lets(nb, first=1))   # the heads; b0 is the search's
    go = ir.BinOp("<=", ir.add(ir.div("cu_mid", bm), "mid"), V("v_block"))
    lets += [
        ir.Let("seq", C(0), mutable=True),
        ir.Let("span", V("batch0"), mutable=True),
        ir.For("step", C(0), V(SEARCH_STEPS), C(1), "serial", (
            ir.Let("half", ir.div("span", 2)),
            ir.Let("mid", ir.add("seq", "half")),
            ir.LoadGlobal("cu_mid", vl.cu_q_param, (V("mid"),)),
            ir.Let("go", go),
            ir.Assign("seq", ir.Call("select", (V("go"), V("mid"), V("seq")))),
            ir.Assign("span", ir.Call("select", (V("go"), ir.sub("span", "half"), V("half")))),
        )),
        ir.Let("b0", V("seq")),
    ]
    last = ir.emin(ir.add("b0", 1), ir.sub(OFFSETS, 1))
    sides = [("q", vl.cu_q_param, a.queries, "S")] + ([("k", vl.cu_k_param, a.keys, "T")] if vl.k else [])
    for side, cu, rows, count in sides:
        lets += [ir.LoadGlobal(f"{side}_off0", cu, (V("b0"),)), ir.LoadGlobal(f"{side}_off1", cu, (last,)),
                 ir.Let(f"{side}_start", ir.emin(ir.emax(f"{side}_off0", 0), rows)),
                 ir.Let(f"{side}_end", ir.emin(ir.emax(f"{side}_off1", f"{side}_start"), rows)),
                 ir.Let(count, ir.sub(f"{side}_end", f"{side}_start"))]
    lets += [ir.Let("kv_blocks", ir.ceil_div("T", bn))] if vl.k else []
    lets += [ir.Let("m_block", ir.emax(ir.sub("v_block", ir.add(ir.div("q_start", bm), "b0")), 0)),
             ir.Let("head", _flat_index(nb, [V(f"batch{i}") for i in range(nb)], [False] * nb))]
    lets += [ir.Let("kv_head", _flat_index(nb, _k_extents(a), a.k_broadcast))] if vl.k else []
    return lets


def _k_extents(a) -> list[ir.Expr]:
    """K's and V's batch dims: the batch params, 1 where they broadcast (GQA, MQA)."""
    return [C(1) if a.k_broadcast[i] else V(f"batch{i}") for i in range(a.kernel_batch)]


def _flat_index(nb: int, extents: list, broadcast) -> ir.Expr:
    """b1 * extent2 * ... + ... + b<nb-1>: the head of a tile among dims 1.. of a packed tensor
    (dims where it broadcasts count as index 0 of extent 1)."""
    index: ir.Expr | None = None
    for i in range(1, nb):
        if broadcast[i]:
            continue
        index = V(f"b{i}") if index is None else ir.add(ir.mul(index, extents[i]), f"b{i}")
    return C(0) if index is None else index


def _rows_bound_keys(sf) -> bool:
    """Whether a tile's kv blocks grow with its m-block (an analysed mask bounds keys by row, or
    a mask `A | B` whose alternatives all end and one of them by row)."""
    return (any(m.upper for m in sf.masks if m.analysed)
            or any(all(x.upper or x.key_upper for x in m.alternatives) and any(x.upper for x in m.alternatives)
                   for m in sf.masks if m.alternatives))


def span_row(spans: tuple[SideInput, SideInput], nb: int) -> tuple[ir.Expr, ...]:
    """The tile's row of the spans table: its batch indices where the ids vary, its m-block."""
    return tuple(V(f"b{i}") if any(f"batch{i}" in x.dims for x in spans) else C(0) for i in range(nb)) \
        + (V("m_block"),)


def id_spans(a, s) -> tuple[SideInput, SideInput] | None:
    """The (query ids, key ids) of a document mask whose spans table bounds each tile's kv
    blocks (`ir.SpanParam`): rows of one sequence each (not GQA-packed, not packed sequences,
    which bound their own keys), one kv range per tile (no split-KV)."""
    pairs = a.score.id_spans
    return pairs[0] if pairs and not (a.packed or a.varlen or s.splits_kv) else None


def kv_range(sf, bm: int, bn: int, packed: bool = False, split: bool = False,
             spans: tuple[ir.Expr, ...] | None = None) -> list[ir.Stmt]:
    """The tile's kv blocks [K_FIRST, K_FIRST + K_COUNT): the analysed masks bound the keys its
    rows m0 .. m0 + bm - 1 can see, so both roles skip the blocks no row sees. Packed rows are
    queries 0 .. S - 1 of several heads: the bounds take the whole query range. With split-KV
    the range is cut into `splits` runs of equal length and the unit takes run `split` (empty
    where the runs outnumber the blocks). `spans`: the tile's row of the spans table (a document
    mask), whose run of kv blocks bounds the range too."""
    masks = [m for m in sf.masks if m.analysed]
    uppers = [b for m in masks for b in m.upper]
    key_uppers = [v for m in masks for v in m.key_upper]
    # keys before this one are seen by some row
    last_row_end = V("S") if packed else ir.add("m0", bm)
    ends = [_bound(last_row_end, b) for b in uppers] + [C(v + 1) for v in key_uppers]
    row_start = C(0) if packed else V("m0")
    unions = [e for m in sf.masks if m.alternatives for e in [_union_range(m, row_start, last_row_end)[1]]
              if e is not None]
    ends += unions
    count = V("kv_blocks")
    if ends:
        visible = _fold(ir.emin, ends)
        if any(b.shifted or b.value < 0 for b in uppers) or any(v < 0 for v in key_uppers) or unions:
            visible = ir.emax(visible, 0)
        count = ir.emin("kv_blocks", ir.ceil_div(visible, bn))
    first: ir.Expr | None = None
    if kv_range_has_first(sf):
        # the first key some row sees
        starts = [_bound(row_start, b) for m in masks for b in m.lower]
        starts += [C(v) for m in masks for v in m.key_lower]
        starts += [e for m in sf.masks if m.alternatives for e in [_union_range(m, row_start, last_row_end)[0]]
                   if e is not None]
        first = ir.div(ir.emax(_fold(ir.emax, starts), 0), bn)
    if spans is not None:
        assert not split
        loads = [ir.LoadGlobal("span_first", ID_SPANS, spans + (C(0),)),
                 ir.LoadGlobal("span_count", ID_SPANS, spans + (C(1),))]
        start = V("span_first") if first is None else ir.emax(first, "span_first")
        end = ir.emin(count, ir.add("span_first", "span_count"))
        return loads + [ir.Let(K_FIRST, start), ir.Let(K_COUNT, ir.emax(ir.sub(end, K_FIRST), 0))]
    if not split:
        if first is None:
            return [ir.Let(K_COUNT, count)]
        return [ir.Let(K_FIRST, first), ir.Let(K_COUNT, ir.emax(ir.sub(count, K_FIRST), 0))]
    lets = [ir.Let("kv_all", count if first is None else ir.emax(ir.sub(count, first), 0)),
            ir.Let("kv_per", ir.ceil_div("kv_all", SPLITS)),
            ir.Let("kv_skip", ir.mul("split", "kv_per"))]
    start = V("kv_skip") if first is None else ir.add(first, "kv_skip")
    return lets + [ir.Let(K_FIRST, start),
                   ir.Let(K_COUNT, ir.emax(ir.emin(ir.sub("kv_all", "kv_skip"), "kv_per"), 0))]
