"""epilogue for matmul: the fused elementwise ops on the accumulator, then the stores of the outputs.

The consumers walk each [64, BN] accumulator (one per block of 64 rows a warpgroup owns: `acc`,
and `acc1` for a second block) in slices of EPILOGUE_COLUMNS (64) columns (`tile.view`)
and copy each into a slice tile of its own, `slice_t`, on which the fused ops run: every tile the
epilogue loads beside it (a bias, a gate, a residual) and every intermediate is one slice wide, so
its registers do not grow with its inputs (a [64, 256] bf16 side tile next to the 128 accumulator
registers spilled), and wgmma stays the only writer of the accumulator (non-wgmma writes of it
made ptxas serialise the k loop's wgmmas). Each compute-DAG value after the MMA becomes a
register tile of the slice (a full [64, 64] tile, a [1, 64] row such as a bias, a [64, 1] column,
or a scalar). A result reuses the tile of an operand that dies at it, so the epilogue needs no
more registers than its widest point. Outputs are stored either with plain stores (`direct`) or
through shared memory and TMA (`tma_store`): per slice, wait until the store that last read its
staging slot is done (two slots a warpgroup, taken in turn: `tma.wait.read 1`), write the slice
into it (generic proxy), `fence.proxy.async`, sync the warpgroup, and one thread issues the copy.
With an odd number of slices a warpgroup (`MatmulSchedule.staging_slots`) there is a slot per slice: wait for the
previous tile's stores once, write every slice, then one batch of copies. A second output of a
dtype already staged is stored directly (one staging buffer per dtype, as the schedule counts
them).

With split-K (`split_k > 1`) each (tile, split) unit first stores its fp32 partial and takes a
ticket; only the last unit of a tile to arrive runs the epilogue, on the sum of the partials in
split order 0, 1, ... (the same bits whichever unit is last). Stream-K (`stream_k=True`) counts a
tile's CTAs in `tile_splits`, the summing CTA adds its own partial from its registers, and the
CTA holding the tile's last k steps takes its ticket before storing (`_stream_k_ticket`).

    after (tma_store, BN = 256):
      for j in unroll(0, 4, 1) {
        elect_one { tma.wait.read 1 }
        bar.sync 1 + wg, 128
        tile.view acc_j, acc, cols(j * 64, 64)
        tile.cast slice_t, acc_j
        tile.load bias_t <- bias[n0 + j * 64]
        tile.add slice_t, slice_t, bias_t
        tile.gelu slice_t, slice_t          # the output cast to bf16 happens in the store
        tile.store_smem C_bf16[wg, j % 2] <- slice_t
        fence.proxy.async
        bar.sync 1 + wg, 128
        elect_one { tma.store out[m0 + wg * 64, n0 + j * 64] <- C_bf16[wg, j % 2]; tma.commit }
      }
    and after the tile loop:  elect_one { tma.wait 0 }

A batched matmul stores to out[b0, b1, ..., row, col] (its tensor map has a box extent 1 in each
batch dim) and reads an epilogue input at the tile's batch indices (0 where it broadcasts).

    split-K (docs/architecture.md, "Split-K"):
      var last_split = 1
      if splits > 1 {
        for j ... { tile.view acc_j, ...; tile.store partials[split, m0 + wg * 64, n0 + j * 64] <- acc_j }
        bar.sync 1 + wg, 128                # every thread's partial before the release
        elect_one {
          fence.acq_rel.gpu                 # release the partial
          atomic.inc ticket_slot[wg] <- tickets[out_tile * 2 + wg] wrap(splits - 1)
          fence.acq_rel.gpu                 # acquire the other units' partials
        }
        bar.sync 1 + wg, 128                # the ticket (and what it acquired) to the warpgroup
        ld.shared ticket = ticket_slot[wg]
        set last_split = ticket == splits - 1
      }
      if last_split {
        ... for j in unroll(0, 4, 1) {
          if splits > 1 {
            tile.fill slice_t, 0.0
            for src_split in serial(0, splits, 1) {
              tile.load part_t <- partials[src_split, m0 + wg * 64, n0 + j * 64]
              tile.add slice_t, slice_t, part_t }
            ... the fused ops and stores of slice_t
          } else { tile.view acc_j ...; tile.cast slice_t, acc_j; ... the same } } ...
      }
"""


from __future__ import annotations

from dataclasses import replace

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.lowering.rewrite import map_loop, map_role
from wsched.names import (ACC, CONSUMER, EPILOGUE_SLICE, PARTIALS, SPLITS, TICKET_SLOT, TILE_SPLITS, TILE_VAR,
                          WARPGROUP_BARRIER)
from wsched.partition import param_name
from wsched.target import DTYPE_BYTES, SWIZZLE_ROW_BYTES, UNARY_OPS, WARPGROUP_THREADS, WGMMA_M

from wsched.workloads.ticket import take_ticket

from .loops import accumulator, batch_coords, output_shape, row_block

V = ir.Var
C = ir.IntConst

ACC_SLICE = f"{ACC}_{EPILOGUE_SLICE}"
SLICE = "slice_t"         # the epilogue's tile: a slice of acc copied, or (split-K) the partials' sum


def epilogue(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    part, s = ctx.partition, ctx.schedule
    rows, bn, blocks = WGMMA_M, s.bn, s.mma_row_blocks    # the epilogue walks each 64-row block
    width = s.epilogue_width
    slices = bn // width
    j = V(EPILOGUE_SLICE) if slices > 1 else C(0)

    def row_of(h: int) -> ir.Expr:
        """The first output row of the warpgroup's h-th block of rows."""
        block = row_block(s, h)
        return V("m0") if block == C(0) else ir.add("m0", ir.mul(block, rows))

    # Staging (`MatmulSchedule.staging_slots`): with an even number of slices per warpgroup, two
    # slots that the slices take in turn, each stored by TMA as soon as it is written; else one
    # slot per slice.
    slots = s.staging_slots
    paired = slots != blocks * slices

    def staged_at(h: int, jj) -> ir.Expr:
        """The staging slot of block h's slice jj."""
        at = ir.add(h * slices, jj) if h else jj
        if not paired:
            return at
        return C(at.value % slots) if isinstance(at, ir.IntConst) else ir.mod(at, slots)

    row0 = row_of(0)
    col0 = ir.add("n0", ir.mul(j, width)) if slices > 1 else V("n0")
    split = s.splits_k
    splits = V(TILE_SPLITS if s.stream_k else SPLITS)   # how many units this tile's k steps are split into
    mm = part.payload
    at = tuple(V(f"b{i}") for i in range(mm.batch))     # an output's batch coordinates

    # Where each output goes: a TMA store through its dtype's staging buffer, or plain stores.
    params = list(kernel.params)
    extra_smem: list[ir.SmemDecl] = []
    staged: list[tuple[str, ir.SmemDecl, int]] = []    # (output param, staging buffer, chunk width)
    store_to: dict[str, "ir.SmemDecl | None"] = {}
    for out, name in zip(part.outputs, part.output_names):
        dtype = out.dtype.name
        buf = f"C_{dtype}"
        if s.epilogue == "direct" or any(b.name == buf for b in extra_smem):
            store_to[name] = None
            continue
        chunk = min(width, SWIZZLE_ROW_BYTES // DTYPE_BYTES[dtype])   # one 128-byte swizzled row
        swizzle = SWIZZLE_ROW_BYTES if chunk * DTYPE_BYTES[dtype] == SWIZZLE_ROW_BYTES else 0
        chunks = width // chunk
        shape = (s.consumer_warpgroups, slots) + ((chunks,) if chunks > 1 else ()) + (rows, chunk)
        decl = store_to[name] = ir.SmemDecl(buf, dtype, shape, swizzle)
        extra_smem.append(decl)
        staged.append((name, decl, chunk))
        i = next(k for k, p in enumerate(params) if p.name == name)
        params[i] = ir.TensorMapParam(name, dtype, output_shape(mm), (1,) * mm.batch + (rows, chunk), swizzle)

    decls: dict[str, ir.RegDecl] = {}

    def fused(source: str, h: int = 0) -> tuple[ir.Stmt, ...]:
        """The fused ops and the stores of one slice of block h whose matmul result is in tile
        `source`."""
        body: list[ir.Stmt] = []
        row = row_of(h)
        tile_of = _elementwise(part, (rows, width), row, col0, source, decls, body)
        for out, name in zip(part.outputs, part.output_names):
            decl = store_to[name]
            body.append(ir.TileStoreGlobal(name, at + (row, col0), tile_of[out.id]) if decl is None else
                        ir.TileStoreSmem(ir.SmemRef(decl.name, (V("wg"), staged_at(h, j))), tile_of[out.id]))
        return tuple(body)

    # The epilogue runs on a slice tile of its own, never on the accumulator: wgmma is the only
    # writer of acc (with non-wgmma writes of it, ptxas serialized the k loop's wgmmas, its C7514,
    # for f32 outputs and in split kernels). The slice is a copy of acc's columns, or with split-K
    # the sum of the partials.
    decls[SLICE] = ir.RegDecl(SLICE, "f32", (rows, width))

    def copy(h: int) -> tuple[ir.Stmt, ...]:
        acc = accumulator(h)
        view = (ir.TileView(ACC_SLICE, acc, ir.mul(j, width), width),) if slices > 1 else ()
        return view + (ir.TileUnary("cast", SLICE, ACC_SLICE if slices > 1 else acc),)

    body: list[ir.Stmt] = []
    sync = ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS)
    if staged and not paired:
        body += [ir.ElectOne((ir.TmaWait(0, True),)), sync]

    def slice_stores(h: int) -> tuple[ir.Stmt, ...]:
        """The TMA stores of block h's slice j, from its staging slot (paired staging)."""
        stores = []
        for name, decl, chunk in staged:
            for c in range(width // chunk):
                index = (V("wg"), staged_at(h, j)) + ((C(c),) if len(decl.shape) == 5 else ())
                stores.append(ir.TmaStore(name, at + (row_of(h), ir.add(col0, c * chunk) if c else col0),
                                          ir.SmemRef(decl.name, index)))
        return tuple(stores)

    for h in range(blocks):
        if not split:
            slice_body = copy(h) + fused(SLICE, h)
        else:       # the epilogue in both branches: joined before it, ptxas spilled (split-K: one block)
            own = None
            if s.stream_k:    # this unit's slice: acc's columns, or acc itself where it is one slice
                own = copy(h)[:-1] + ((ACC_SLICE if slices > 1 else accumulator(h)),)
            summed = _sum_of_partials(row0, col0, rows, width, decls, splits, own)
            slice_body = (ir.If(ir.BinOp(">", splits, C(1)), summed + fused(SLICE), copy(h) + fused(SLICE)),)
        if staged and paired:   # the slot's store two slices ago has read it; this one's store at once
            slice_body = ((ir.ElectOne((ir.TmaWait(slots - 1, True),)), sync) + slice_body
                          + (ir.FenceProxyAsync(), sync, ir.ElectOne(slice_stores(h) + (ir.TmaCommit(),))))
        if slices > 1:
            body.append(ir.For(EPILOGUE_SLICE, C(0), C(slices), C(1), "unroll", slice_body))
        else:
            body += slice_body
    if staged and not paired:
        stores: list[ir.Stmt] = []
        for name, decl, chunk in staged:
            for h in range(blocks):
                for jj in range(slices):
                    for c in range(width // chunk):
                        col = ir.add("n0", jj * width + c * chunk) if jj or c else V("n0")
                        index = (V("wg"), C(h * slices + jj)) + ((C(c),) if len(decl.shape) == 5 else ())
                        stores.append(ir.TmaStore(name, at + (row_of(h), col), ir.SmemRef(decl.name, index)))
        body += [ir.FenceProxyAsync(), sync, ir.ElectOne(tuple(stores) + (ir.TmaCommit(),))]
    tail: tuple[ir.Stmt, ...] = (ir.ElectOne((ir.TmaWait(0, False),)),) if staged else ()

    smem = kernel.smem + tuple(extra_smem)
    if split:
        body = [ir.Let("last_split", C(1), mutable=True),
                ir.If(ir.BinOp(">", splits, C(1)), (_stream_k_ticket if s.stream_k else _ticket)(
                    s, row0, sync, width, slices, splits)),
                ir.If(V("last_split"), tuple(body))]
        smem += (ir.SmemDecl(TICKET_SLOT, "i32", (s.consumer_warpgroups, 1), 0),)

    def consumer(role: ir.Role) -> ir.Role:
        new = map_loop(role.body, TILE_VAR, lambda loop: replace(loop, body=loop.body + tuple(body)))
        head = tuple(x for x in new if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in new if not isinstance(x, ir.RegDecl))
        return replace(role, body=head + tuple(decls.values()) + rest + tail)

    kernel = map_role(kernel, CONSUMER, consumer)
    return replace(kernel, params=tuple(params), smem=smem)


def _elementwise(part, shape, row0, col0, acc: str, decls: dict, body: list) -> dict[str, str]:
    """The fused ops of one slice, appended to `body`; the register tile of every value."""
    mm = part.payload
    rows, width = shape
    shapes = {"full": (rows, width), "row": (1, width), "col": (rows, 1)}

    # Liveness: the last epilogue step that reads each value (outputs live to the stores).
    steps = list(mm.epilogue)
    last_use: dict[str, int] = {}
    for i, node in enumerate(steps):
        for src in node.inputs:
            last_use[src] = i
    for out in part.outputs:
        last_use[out.id] = len(steps)

    tile_of: dict[str, str] = {mm.matmul.id: acc}

    def declare(name: str, dtype: str, layout: str) -> str:
        decls.setdefault(name, ir.RegDecl(name, dtype, shapes[layout]))
        return name

    def operand(node_id: str):
        info = mm.tiles[node_id]
        if info.layout == "scalar":
            node = part.fusion.node(node_id)
            return ir.FloatConst(float(node.attr("value")))
        if node_id not in tile_of:   # a side input: load its part of this slice
            node = part.fusion.node(node_id)
            name = declare(f"{node_id}_t", info.dtype, info.layout)
            body.append(ir.TileLoadGlobal(name, param_name(node_id), _side_coords(node, info, row0, col0)))
            tile_of[node_id] = name
        return tile_of[node_id]

    consumers = {n.id: [m for m in steps if n.id in m.inputs] for n in steps}
    for i, node in enumerate(steps):
        info = mm.tiles[node.id]
        if node.op == "cast" and not consumers[node.id] and mm.tiles[node.inputs[0]].layout == "full":
            # An output cast is done by the store itself (stores round to the tensor's dtype):
            # no second tile stays live beside the accumulator.
            tile_of[node.id] = operand(node.inputs[0])
            continue
        args = [operand(x) for x in node.inputs]
        dst = None
        for src, arg in zip(node.inputs, args):   # reuse a full tile that dies here
            if (isinstance(arg, str) and last_use.get(src) == i and mm.tiles[src].layout == "full"
                    and _tile_dtype(decls, arg) == info.dtype
                    and not any(t == arg and o != src and last_use.get(o, -1) > i for o, t in tile_of.items())):
                dst = arg
                break
        if dst is None:
            dst = declare(f"{node.id}_t", info.dtype, "full")
        tile_of[node.id] = dst
        if node.op in UNARY_OPS:
            body.append(ir.TileUnary(node.op, dst, args[0]))
        else:
            body.append(ir.TileBinary(node.op, dst, args[0], args[1]))
    return tile_of


def _store_partial(row0, width: int, slices: int) -> ir.Stmt:
    """This unit's fp32 partial, slice by slice."""
    if slices == 1:
        return ir.TileStoreGlobal(PARTIALS, (V("split"), row0, V("n0")), ACC)
    j = V(EPILOGUE_SLICE)
    return ir.For(EPILOGUE_SLICE, C(0), C(slices), C(1), "unroll", (
        ir.TileView(ACC_SLICE, ACC, ir.mul(j, width), width),
        ir.TileStoreGlobal(PARTIALS, (V("split"), row0, ir.add("n0", ir.mul(j, width))), ACC_SLICE),
    ))


def _ticket(s, row0: ir.Expr, sync: ir.Stmt, width: int, slices: int, splits: ir.Var) -> tuple[ir.Stmt, ...]:
    """Store this unit's partial and take the ticket of its (tile, warpgroup): `last_split`
    becomes 1 for the unit that arrives last."""
    nwg = s.consumer_warpgroups
    slot = ir.SmemRef(TICKET_SLOT, (V("wg"),))
    counter = ir.add(ir.mul("out_tile", nwg), "wg") if nwg > 1 else V("out_tile")
    last = ir.sub(splits, 1)
    return (_store_partial(row0, width, slices),) + take_ticket(slot, counter, last, sync)


def _stream_k_ticket(s, row0: ir.Expr, sync: ir.Stmt, width: int, slices: int,
                     splits: ir.Var) -> tuple[ir.Stmt, ...]:
    """Stream-K's tickets: the tile's last CTA (`split == tile_splits - 1`, which walks the tile
    last of all: its range's first tile) takes the ticket first and stores no partial when it
    arrives last, as it nearly always does; the others store theirs first, as in split-K. Where
    it arrives early, it stores its partial after all and hands the sum over through a second
    counter of the tile (wrap 1: two takers, the tail and the CTA that arrived last on the first):
    the second to take it sums. No CTA waits for another, and both counters end at 0. Fences: the
    tail's first ticket only acquires (it released nothing), the others' first only releases (none
    of them sums on it: the hand-over's fences acquire)."""
    nwg = s.consumer_warpgroups
    slot = ir.SmemRef(TICKET_SLOT, (V("wg"),))
    counter = ir.add(ir.mul("out_tile", nwg), "wg") if nwg > 1 else V("out_tile")
    second = ir.add(counter, ir.mul("num_tiles", nwg) if nwg > 1 else V("num_tiles"))
    last = ir.sub(splits, 1)
    store = _store_partial(row0, width, slices)
    hand_over = take_ticket(slot, second, C(1), sync, "hand_over")
    tail = take_ticket(slot, counter, last, sync, release=False) + (ir.If(ir.eq("last_split", 0),
                                                                          (store,) + hand_over),)
    others = (store,) + take_ticket(slot, counter, last, sync, acquire=False) + (ir.If(V("last_split"), hand_over),)
    return (ir.If(ir.eq("split", last), tail, others),)


def _sum_of_partials(row0, col0, rows: int, width: int, decls: dict, splits: ir.Var,
                     own: "tuple | None" = None) -> tuple[ir.Stmt, ...]:
    """For the last unit of a split tile: slice_t = 0 + partial 0 + partial 1 + ..., in split
    order (the same bits whichever unit runs it). With `own` (stream-K: the statements that view
    this unit's accumulator slice, then the slice's name), this unit's own partial is added from
    its registers rather than read back (it is what it stored, bit for bit)."""
    decls.setdefault("part_t", ir.RegDecl("part_t", "f32", (rows, width)))
    load = (ir.TileLoadGlobal("part_t", PARTIALS, (V("src_split"), row0, col0)),
            ir.TileBinary("add", SLICE, SLICE, "part_t"))
    step = load if own is None else (
        ir.If(ir.eq("src_split", "split"), own[:-1] + (ir.TileBinary("add", SLICE, SLICE, own[-1]),), load),)
    return (
        ir.TileFill(SLICE, ir.FloatConst(0.0)),
        ir.For("src_split", C(0), splits, C(1), "serial", step),
    )


def _tile_dtype(decls, name) -> str:
    return decls[name].dtype if name in decls else "f32"   # only acc (and its slices) is declared elsewhere


def _side_coords(node, info, row0: ir.Expr, col0: ir.Expr) -> tuple[ir.Expr, ...]:
    at = batch_coords(info.batch)
    if info.layout == "full":
        return at + (row0, col0)
    if info.layout == "row":
        return (col0,) if len(node.shape) == 1 else at + (C(0), col0)
    return at + (row0, C(0))
