"""epilogue for matmul: the fused elementwise ops on the accumulator, then the stores of the outputs.

Each compute-DAG value after the MMA becomes a register tile of the consumer warpgroup (a full
[64, BN] tile, a [1, BN] row such as a bias, a [64, 1] column, or a scalar). A result reuses
the tile of an operand that dies at it, so the epilogue needs no more registers than its widest
point. Outputs are stored either with plain stores (`direct`) or through shared memory and TMA
(`tma_store`): wait until the previous tile's store has read the staging buffer, write it
(generic proxy), `fence.proxy.async`, sync the warpgroup, and one thread issues the copies.

    after (tma_store):
      tile.load bias_t <- bias[n0]
      tile.add acc, acc, bias_t
      tile.gelu acc, acc                    # the output cast to bf16 happens in the store
      elect_one { tma.wait.read 0 }
      bar.sync 1 + wg, 128
      tile.store_smem C[wg] <- acc
      fence.proxy.async
      bar.sync 1 + wg, 128
      elect_one { tma.store out[m0 + wg * 64, n0] <- C[wg, 0]  ...  tma.commit }
    and after the tile loop:  elect_one { tma.wait 0 }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.lowering.rewrite import map_loop, map_role
from wsched.names import ACC, CONSUMER, TILE_VAR, WARPGROUP_BARRIER
from wsched.partition import param_name
from wsched.target import DTYPE_BYTES, SWIZZLE_ROW_BYTES, UNARY_OPS, WARPGROUP_THREADS

V = ir.Var
C = ir.IntConst


def epilogue(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    part, s = ctx.partition, ctx.schedule
    mm = part.payload
    rows, bn = s.rows_per_consumer, s.bn
    row0 = ir.add("m0", ir.mul("wg", rows))
    shapes = {"full": (rows, bn), "row": (1, bn), "col": (rows, 1)}

    # Liveness: the last epilogue step that reads each value (outputs live to the stores).
    steps = list(mm.epilogue)
    last_use: dict[str, int] = {}
    for i, node in enumerate(steps):
        for src in node.inputs:
            last_use[src] = i
    for out in part.outputs:
        last_use[out.id] = len(steps)

    tile_of: dict[str, str] = {mm.matmul.id: ACC}
    decls: dict[str, ir.RegDecl] = {}
    body: list[ir.Stmt] = []

    def declare(name: str, dtype: str, layout: str) -> str:
        decls.setdefault(name, ir.RegDecl(name, dtype, shapes[layout]))
        return name

    def operand(node_id: str):
        info = mm.tiles[node_id]
        if info.layout == "scalar":
            node = part.fusion.node(node_id)
            return ir.FloatConst(float(node.attr("value")))
        if node_id not in tile_of:   # a side input: load its slice of this tile
            node = part.fusion.node(node_id)
            name = declare(f"{node_id}_t", info.dtype, info.layout)
            coords = _side_coords(node, info.layout, row0)
            body.append(ir.TileLoadGlobal(name, param_name(node_id), coords))
            tile_of[node_id] = name
        return tile_of[node_id]

    consumers = {n.id: [m for m in steps if n.id in m.inputs] for n in steps}
    for i, node in enumerate(steps):
        info = mm.tiles[node.id]
        if node.op == "cast" and not consumers[node.id] and mm.tiles[node.inputs[0]].layout == "full":
            # An output cast is done by the store itself (stores round to the tensor's dtype):
            # no second [64, BN] tile stays live beside the accumulator.
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

    tail: tuple[ir.Stmt, ...] = ()
    extra_smem: list[ir.SmemDecl] = []
    params = list(kernel.params)
    for out, name in zip(part.outputs, part.output_names):
        src = tile_of[out.id]
        dtype = out.dtype.name
        if s.epilogue == "direct":
            body.append(ir.TileStoreGlobal(name, (row0, V("n0")), src))
            continue
        width = min(bn, SWIZZLE_ROW_BYTES // DTYPE_BYTES[dtype])
        buf = f"C_{dtype}"
        swizzle = SWIZZLE_ROW_BYTES if width * DTYPE_BYTES[dtype] == SWIZZLE_ROW_BYTES else 0
        if not any(b.name == buf for b in extra_smem):   # outputs of one dtype share the buffer
            extra_smem.append(ir.SmemDecl(buf, dtype, (s.consumer_warpgroups, bn // width, rows, width), swizzle))
        i = next(j for j, p in enumerate(params) if p.name == name)
        params[i] = ir.TensorMapParam(name, dtype, (V("M"), V("N")), (rows, width), swizzle)
        sync = ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS)
        stores = tuple(ir.TmaStore(name, (row0, V("n0") if j == 0 else ir.add("n0", j * width)),
                                   ir.SmemRef(buf, (V("wg"), C(j))))
                       for j in range(bn // width))
        body += [ir.ElectOne((ir.TmaWait(0, True),)), sync,
                 ir.TileStoreSmem(ir.SmemRef(buf, (V("wg"),)), src),
                 ir.FenceProxyAsync(), sync,
                 ir.ElectOne(stores + (ir.TmaCommit(),))]
        tail = (ir.ElectOne((ir.TmaWait(0, False),)),)

    def consumer(role: ir.Role) -> ir.Role:
        new = map_loop(role.body, TILE_VAR, lambda loop: replace(loop, body=loop.body + tuple(body)))
        head = tuple(x for x in new if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in new if not isinstance(x, ir.RegDecl))
        return replace(role, body=head + tuple(decls.values()) + rest + tail)

    kernel = map_role(kernel, CONSUMER, consumer)
    return replace(kernel, params=tuple(params), smem=kernel.smem + tuple(extra_smem))


def _tile_dtype(decls, name) -> str:
    return decls[name].dtype if name in decls else "f32"   # only acc is declared elsewhere


def _side_coords(node, layout: str, row0: ir.Expr) -> tuple[ir.Expr, ...]:
    n0 = V("n0")
    if layout == "full":
        return (row0, n0)
    if layout == "row":
        return (n0,) if len(node.shape) == 1 else (C(0), n0)
    return (row0, C(0))
