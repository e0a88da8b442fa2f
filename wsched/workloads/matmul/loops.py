"""build_loops for matmul: the partition's two loop nests as one kernel with a producer and a consumer role.

The load sub-DAG becomes the producer's nest (persistent tile loop x cta-k loop of TMA loads),
the compute sub-DAG's MMA the consumer's nest (same tile loop x cta-k loop of wgmmas). Buffers
have a single stage and nothing synchronises yet: later passes add the circular buffer, the
barriers, the wgmma protocol, the epilogue and register reallocation.

    after:
      role producer warpgroups(1) registers(40) {
        for tile in persistent(cta_id, num_tiles, num_ctas) {
          let m0 = tile_m * 128 ...
          for k in serial(0, k_tiles, 1) {
            tma.load A[0] <- a[m0, k * 64] bar(full[0])
            tma.load B[0] <- b[n0, k * 64] bar(full[0])
          }
        }
      }
      role consumer warpgroups(2) registers(232) {
        reg acc: f32[64, 256]
        for tile in persistent(cta_id, num_tiles, num_ctas) {
          ...
          tile.fill acc, 0.0
          for k in serial(0, k_tiles, 1) {
            wgmma.mma acc, A[0, wg], B[0] major(k, k) accumulate(1)
          }
        }
      }

A batched matmul (partition.py) adds i32 params batch0, batch1, ... and walks
batch0 x batch1 x ... x tiles_m x tiles_n tiles, batch outermost: a tile index splits into the
batch indices (b0, b1, ...) and the tile within its batch, which takes the grouped raster. The
operand maps get one leading dim per batch dim they have (box extent 1; extent 1 and
coordinate 0 where the operand broadcasts), so a tile's rows past M read TMA's zero fill, never
the next batch.
"""

from __future__ import annotations

from dataclasses import replace

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.names import ACC, CONSUMER, K_VAR, PARTIALS, PRODUCER, SPLITS, TICKETS, TILE_SPLITS, TILE_VAR, UNIT_STEPS
from wsched.partition import param_name
from wsched.target import WGMMA_M
from wsched.workloads.batch import batch_index_lets

from .partition import BATCH_ONE

V = ir.Var
C = ir.IntConst


def build_loops(kernel: None, ctx: LoweringContext) -> ir.Kernel:
    part, s = ctx.partition, ctx.schedule
    mm = part.payload
    bm, bn, bk = s.tile
    (ch,) = part.channels
    a_load, b_load = ch.loads
    m_sym, n_sym = mm.matmul.shape[-2:]
    dims = {m_sym: V("M"), n_sym: V("N")}

    def shape_expr(node) -> tuple[ir.Expr, ...]:
        last = tuple(dims.get(d, C(d) if isinstance(d, int) else V(str(d))) for d in node.shape[-2:])
        return batch_shape(mm.tiles[node.id].batch) + last

    params: list[ir.Param] = [ir.ScalarParam(f"batch{i}", "i32") for i in range(mm.batch)]
    params += [ir.ScalarParam("M", "i32"), ir.ScalarParam("N", "i32"), ir.ScalarParam("K", "i32")]
    split = s.splits_k
    if s.stream_k:
        params += stream_k_params(s)
    elif split:
        params.append(ir.HostParam(SPLITS, "i32", split_count(s)))
    a_lead, b_lead = batch_shape(mm.a_batch), batch_shape(mm.b_batch)
    params.append(ir.TensorMapParam(a_load.tensor, a_load.dtype, a_lead + (V("M"), V("K")),
                                    (1,) * len(a_lead) + a_load.box, 0))
    b_shape = (V("N"), V("K")) if b_load.major == "k" else (V("K"), V("N"))
    params.append(ir.TensorMapParam(b_load.tensor, b_load.dtype, b_lead + b_shape, (1,) * len(b_lead) + b_load.box, 0))
    for node in mm.side_inputs:
        params.append(ir.GlobalParam(param_name(node.id), node.dtype.name, shape_expr(node)))
    for out, name in zip(part.outputs, part.output_names):
        params.append(ir.GlobalParam(name, out.dtype.name, output_shape(mm)))
    if split:   # fp32 partials [split, row, col] and one ticket per (output tile, consumer warpgroup)
        # in fragment order (ir.WorkspaceParam): the sum reads 512 contiguous bytes a warp and
        # access, where a row-major [64, 64] tile spread each warp's accesses over 8 rows
        # (L1 wavefronts, not latency, set the sum's pace: 0.3-2.3 us less a call, H100)
        params.append(ir.WorkspaceParam(PARTIALS, "f32", (V(SPLITS), V("M"), V("N")), fragments=True))
        tiles = ir.mul(ir.mul(ir.ceil_div("M", bm), ir.ceil_div("N", bn)), s.consumer_warpgroups)
        if s.stream_k:   # and a second counter each, for the hand-over (epilogue._stream_k_ticket)
            tiles = ir.mul(tiles, 2)
        params.append(ir.WorkspaceParam(TICKETS, "i32", (tiles,), zeroed=True))

    nwg, blocks = s.consumer_warpgroups, s.mma_row_blocks
    a_buf = ir.SmemDecl("A", a_load.dtype, (1, bm // WGMMA_M, WGMMA_M, bk), 0)     # m64 blocks of rows
    if b_load.major == "k":
        b_buf = ir.SmemDecl("B", b_load.dtype, (1, bn, bk), 0)
    else:
        b_buf = ir.SmemDecl("B", b_load.dtype, (1, b_load.boxes, bk, b_load.box[1]), 0)
    barriers = (ir.BarrierDecl(ch.full, 1), ir.BarrierDecl(ch.empty, 1))

    ext_m, ext_n = raster_extents(s)
    tiles = (ir.Let("num_tiles", ir.mul(ext_m, ext_n)),) if not mm.batch else (
        ir.Let("batch_tiles", ir.mul(ext_m, ext_n)),
        ir.Let("num_tiles", ir.mul("batch_tiles", batch_count(mm.batch))))
    setup = (
        ir.Let("tiles_m", ir.ceil_div("M", bm)),
        ir.Let("tiles_n", ir.ceil_div("N", bn)),
        *cluster_lets(s),
        *tiles,
        ir.Let("k_tiles", ir.ceil_div("K", bk)),
    ) + (stream_k_lets() if s.stream_k else (ir.Let("num_units", ir.mul("num_tiles", SPLITS)),) if split else ())
    full0 = ir.BarRef(ch.full, C(0))
    k0 = ir.mul(ir.add("k_begin", K_VAR) if split else V(K_VAR), bk)
    a_at, b_at = batch_coords(mm.a_batch), batch_coords(mm.b_batch)
    loads: list[ir.Stmt] = [ir.TmaLoad(ir.SmemRef("A", (C(0),)), a_load.tensor, a_at + (V("m0"), k0), full0)]
    if b_load.major == "k":
        loads.append(ir.TmaLoad(ir.SmemRef("B", (C(0),)), b_load.tensor, b_at + (V("n0"), k0), full0))
    else:
        width = b_load.box[-1]
        for j in range(b_load.boxes):
            col = V("n0") if j == 0 else ir.add("n0", j * width)
            loads.append(ir.TmaLoad(ir.SmemRef("B", (C(0), C(j))), b_load.tensor, b_at + (k0, col), full0))
    if s.cluster_size > 1:
        loads, params = multicast_loads(s, loads, params)

    producer = ir.Role(PRODUCER, 1, s.producer_registers, (
        tile_loop(ctx, (k_loop(tuple(loads), split),)),
    ))
    mmas = tuple(ir.Wgmma(accumulator(h), ir.SmemRef("A", (C(0), row_block(s, h))), ir.SmemRef("B", (C(0),)), "k",
                          b_load.major, C(1)) for h in range(blocks))
    consumer = ir.Role(CONSUMER, nwg, s.consumer_registers, (
        *(ir.RegDecl(accumulator(h), "f32", (WGMMA_M, bn)) for h in range(blocks)),
        tile_loop(ctx, tuple(ir.TileFill(accumulator(h), ir.FloatConst(0.0)) for h in range(blocks))
                  + (k_loop(mmas, split),)),
    ))
    cm, cn, _ = s.cluster
    units = ir.mul(_ceil_div_by(ir.ceil_div("M", bm), cm), _ceil_div_by(ir.ceil_div("N", bn), cn))
    if mm.batch:
        units = ir.mul(units, batch_count(mm.batch))
    if s.cluster_size > 1:   # whole clusters of CTAs, each taking whole clusters of tiles
        grid = ir.mul(ir.emin(ir.div("num_sms", s.cluster_size), units), s.cluster_size)
    elif s.stream_k:         # every CTA a full range of unit_steps k steps but perhaps the last
        grid = ir.ceil_div(stream_k_work(s), UNIT_STEPS)
    else:
        grid = ir.emin("num_sms", ir.mul(units, SPLITS) if split else units)
    return ir.Kernel(ctx.name, tuple(params), grid, (s.cluster_size, 1, 1), (a_buf, b_buf), barriers,
                     setup + (producer, consumer))


def _ceil_div_by(e: ir.Expr, n: int) -> ir.Expr:
    return e if n == 1 else ir.ceil_div(e, n)


def raster_extents(s) -> tuple[str, str]:
    """The tile grid the raster walks: output tiles, or with a cluster, groups of `cm` (`cn`)
    consecutive tiles along M (N) that the cluster's CTAs take together."""
    cm, cn, _ = s.cluster
    return ("cluster_tiles_m" if cm > 1 else "tiles_m"), ("cluster_tiles_n" if cn > 1 else "tiles_n")


def cluster_lets(s) -> tuple[ir.Stmt, ...]:
    """A cluster's rank, index and count, and its tile grid (`raster_extents`)."""
    n = s.cluster_size
    if n == 1:
        return ()
    cm, cn, _ = s.cluster
    grid = (ir.Let("cluster_tiles_m", ir.ceil_div("tiles_m", cm)),) if cm > 1 else (
        ir.Let("cluster_tiles_n", ir.ceil_div("tiles_n", cn)),)
    return (ir.Let("cluster_rank", ir.mod("cta_id", n)), ir.Let("cluster_id", ir.div("cta_id", n)),
            ir.Let("num_clusters", ir.div("num_ctas", n))) + grid


def multicast_loads(s, loads: list[ir.TmaLoad], params: list[ir.Param]) -> tuple[list, list]:
    """The operand the cluster's CTAs share (B along M, A along N) loaded in pieces: each CTA loads
    rows [rank x piece, (rank + 1) x piece) of every box of it and multicasts them to the whole
    cluster; its tensor map's box shrinks to a piece."""
    n = s.cluster_size
    shared = "B" if s.cluster[0] > 1 else "A"
    mask = C((1 << n) - 1)
    rank = V("cluster_rank")
    out: list[ir.TmaLoad] = []
    tensor = None
    for ld in loads:
        if ld.dst.buffer != shared:
            out.append(ld)
            continue
        tensor = ld.tensor
        p = next(p for p in params if p.name == ld.tensor)
        rows = p.box[-2]
        piece = rows // n
        offset = ir.mul(rank, piece)
        coords = ld.coords[:-2] + (ir.add(ld.coords[-2], offset), ld.coords[-1])
        dst, row = ld.dst, offset
        if shared == "A":    # A[s] holds blocks of WGMMA_M rows: a piece lies in one of them
            block = ir.div(offset, WGMMA_M) if piece < WGMMA_M else rank
            dst = ir.SmemRef("A", ld.dst.index + (block,))
            row = ir.mod(offset, WGMMA_M) if piece < WGMMA_M else None
        out.append(replace(ld, dst=dst, coords=coords, row=row, multicast=mask))
    params = [replace(p, box=p.box[:-2] + (p.box[-2] // n, p.box[-1])) if p.name == tensor else p for p in params]
    return out, params


def accumulator(h: int) -> str:
    """The accumulator of a consumer warpgroup's h-th block of 64 rows."""
    return ACC if h == 0 else f"{ACC}{h}"


def row_block(s, h: int) -> ir.Expr:
    """Which m64 block of the A tile (and of the output tile) a warpgroup's h-th block of rows is:
    the warpgroups of a tile own consecutive blocks; a warpgroup with tiles of its own (ping-pong)
    owns them all."""
    if s.tile_warpgroups == 1:
        return C(h)
    first = ir.mul("wg", s.mma_row_blocks) if s.mma_row_blocks > 1 else V("wg")
    return ir.add(first, h) if h else first


def batch_shape(roles) -> tuple[ir.Expr, ...]:
    """A tensor's leading dims for the batch dims it has (`partition.batch_roles`): batch{i}, or 1
    where it broadcasts."""
    return tuple(C(1) if role == BATCH_ONE else V(f"batch{i}") for i, role in enumerate(roles) if role is not None)


def batch_coords(roles) -> tuple[ir.Expr, ...]:
    """Where a tensor is read for the tile's batch indices: b{i}, or 0 where it broadcasts."""
    return tuple(C(0) if role == BATCH_ONE else V(f"b{i}") for i, role in enumerate(roles) if role is not None)


def output_shape(mm) -> tuple[ir.Expr, ...]:
    """An output's dims: [batch0, ..., M, N]."""
    return tuple(V(f"batch{i}") for i in range(mm.batch)) + (V("M"), V("N"))


def batch_count(nb: int) -> ir.Expr:
    """batch0 * batch1 * ...: how many times the output tiles repeat."""
    count: ir.Expr = V("batch0")
    for i in range(1, nb):
        count = ir.mul(count, f"batch{i}")
    return count


def split_count(s) -> ir.Expr:
    """The host's split count for a call: enough (tile, split) units to fill the SMs in one wave,
    at most `split_k`, and at least `split_min_steps` k steps per split (one split where there
    are fewer)."""
    bm, bn, bk = s.tile
    tiles = ir.mul(ir.ceil_div("M", bm), ir.ceil_div("N", bn))
    longest = ir.emax(1, ir.div(ir.ceil_div("K", bk), s.split_min_steps))
    return ir.emin(ir.emin(s.split_k, longest), ir.emax(1, ir.div("num_sms", tiles)))


def stream_k_params(s) -> list[ir.Param]:
    """Stream-K's host params: `unit_steps`, the k steps of one CTA's range (all tiles' k steps
    spread over the SMs), and `splits`, the most CTAs one tile's k steps can lie in (the
    partials' first dim): a range of at least unit_steps steps, so ceil(k_tiles / unit_steps) + 1."""
    return [ir.HostParam(UNIT_STEPS, "i32", ir.ceil_div(stream_k_work(s), "num_sms")),
            ir.HostParam(SPLITS, "i32", ir.add(ir.ceil_div(ir.ceil_div("K", s.bk), UNIT_STEPS), 1))]


def stream_k_work(s) -> ir.Expr:
    """All output tiles' k steps (a 2-D matmul: stream-K takes no batch dims)."""
    bm, bn, bk = s.tile
    return ir.mul(ir.mul(ir.ceil_div("M", bm), ir.ceil_div("N", bn)), ir.ceil_div("K", bk))


def k_loop(body: tuple[ir.Stmt, ...], split: bool = False) -> ir.For:
    """The k loop: over all k steps, or (split-K) over this unit's k_count steps from k_begin."""
    return ir.For(K_VAR, C(0), V("k_count" if split else "k_tiles"), C(1), "serial", body)


def tile_loop(ctx: LoweringContext, body: tuple[ir.Stmt, ...]) -> ir.For:
    """The persistent tile loop both roles run, with the same tile -> (m0, n0) raster. With
    split-K it walks (output tile, split) units, the splits of one tile next to each other; a
    split takes the k steps [split * k_tiles / splits, (split + 1) * k_tiles / splits)."""
    if ctx.schedule.stream_k:
        return stream_k_loop(ctx, body)
    if ctx.schedule.split_k == 1:
        nb = ctx.partition.payload.batch
        lets = raster_lets(ctx, V(TILE_VAR)) if not nb else batch_lets(nb) + raster_lets(ctx, V("batch_tile"))
        if ctx.schedule.cluster_size > 1:    # the cluster's CTAs take each tile group together
            return ir.For(TILE_VAR, V("cluster_id"), V("num_tiles"), V("num_clusters"), "persistent", lets + body)
        return ir.For(TILE_VAR, V("cta_id"), V("num_tiles"), V("num_ctas"), "persistent", lets + body)
    unit = (
        ir.Let("split", ir.mod(TILE_VAR, SPLITS)),
        ir.Let("out_tile", ir.div(TILE_VAR, SPLITS)),
    )
    k_range = (
        ir.Let("k_begin", ir.div(ir.mul("split", "k_tiles"), SPLITS)),
        ir.Let("k_end", ir.div(ir.mul(ir.add("split", 1), "k_tiles"), SPLITS)),
        ir.Let("k_count", ir.sub("k_end", "k_begin")),
    )
    return ir.For(TILE_VAR, V("cta_id"), V("num_units"), V("num_ctas"), "persistent",
                  unit + raster_lets(ctx, V("out_tile")) + k_range + body)


def stream_k_loop(ctx: LoweringContext, body: tuple[ir.Stmt, ...]) -> ir.For:
    """Stream-K's tile loop: this CTA's k steps are [sk_begin, sk_end) of all tiles' k steps in a
    row, so it walks the tiles they touch, the last first: its range begins inside one tile and
    ends inside another, and taking the later tile's first k steps first keeps every CTA near the
    same k step at the same time (CTAs on tiles that share an operand row or column read it
    together, once from memory, as in the plain kernel). In each tile: the k steps of its range
    (k_begin, k_count), which of the tile's CTAs it is (`split`, counted from the tile's first)
    and how many CTAs the tile's k steps lie in (`tile_splits`)."""
    unit = (
        ir.Let("out_tile", ir.sub("sk_last", TILE_VAR)),
        ir.Let("tile_k0", ir.mul("out_tile", "k_tiles")),
        ir.Let("k_begin", ir.sub(ir.emax("sk_begin", "tile_k0"), "tile_k0")),
        ir.Let("k_end", ir.sub(ir.emin("sk_end", ir.add("tile_k0", "k_tiles")), "tile_k0")),
        ir.Let("k_count", ir.sub("k_end", "k_begin")),
        ir.Let("first_cta", ir.div("tile_k0", UNIT_STEPS)),
        ir.Let("split", ir.sub("cta_id", "first_cta")),
        ir.Let(TILE_SPLITS, ir.add(ir.sub(ir.div(ir.sub(ir.add("tile_k0", "k_tiles"), 1), UNIT_STEPS),
                                          "first_cta"), 1)),
    )
    return ir.For(TILE_VAR, C(0), ir.add(ir.sub("sk_last", ir.div("sk_begin", "k_tiles")), 1), C(1), "persistent",
                  unit + raster_lets(ctx, V("out_tile")) + body)


def stream_k_lets() -> tuple[ir.Stmt, ...]:
    """This CTA's range of all tiles' k steps in a row, [sk_begin, sk_end), and the last tile it
    touches."""
    return (ir.Let("sk_begin", ir.mul("cta_id", UNIT_STEPS)),
            ir.Let("sk_end", ir.emin(ir.add("sk_begin", UNIT_STEPS), ir.mul("num_tiles", "k_tiles"))),
            ir.Let("sk_last", ir.div(ir.sub("sk_end", 1), "k_tiles")))


def batch_lets(nb: int) -> tuple[ir.Stmt, ...]:
    """A batched tile index -> the tile within its batch (`batch_tile`) and the batch indices
    b0, b1, ... (the last varying fastest), as the attention workload splits its tiles."""
    return (ir.Let("batch_tile", ir.mod(TILE_VAR, "batch_tiles")), ir.Let("rest", ir.div(TILE_VAR, "batch_tiles")),
            *batch_index_lets(nb))


def raster_lets(ctx: LoweringContext, t: ir.Var) -> tuple[ir.Stmt, ...]:
    """Grouped raster of output tile `t`: tiles are visited `swizzle_group` rows (row raster) or
    columns at a time, so that consecutive CTAs share operand tiles in L2."""
    s = ctx.schedule
    bm, bn, _ = s.tile
    g = s.swizzle_group
    major, minor = ("m", "n") if s.raster == "row" else ("n", "m")
    extent = dict(zip("mn", raster_extents(s)))
    per_cluster = dict(zip("mn", s.cluster))
    # with a cluster, the raster walks groups of tiles (cluster_tile_m) and the rank picks the tile
    name = {d: f"cluster_tile_{d}" if per_cluster[d] > 1 else f"tile_{d}" for d in "mn"}
    lets = (
        ir.Let("group_size", ir.mul(g, extent[minor])),
        ir.Let("first_" + major, ir.mul(ir.div(t, "group_size"), g)),
        ir.Let("group_extent", ir.emin(ir.sub(extent[major], "first_" + major), g)),
        ir.Let(name[major], ir.add("first_" + major, ir.mod(ir.mod(t, "group_size"), "group_extent"))),
        ir.Let(name[minor], ir.div(ir.mod(t, "group_size"), "group_extent")),
    )
    for d, c in per_cluster.items():
        if c > 1:
            lets += (ir.Let(f"tile_{d}", ir.add(ir.mul(name[d], c), "cluster_rank")),)
    return lets + (ir.Let("m0", ir.mul("tile_m", bm)), ir.Let("n0", ir.mul("tile_n", bn)))
