"""Partition a matmul-anchored fusion: A and B through one channel, the fused epilogue on the
consumers.

    load    : for tile in persistent(tiles): for k in range(k_tiles): tma.load A, B
    compute : for tile in persistent(tiles): { for k in range(k_tiles): wgmma ; epilogue }

A batched matmul ([*batch, M, K] @ [*batch, K, N], at most MAX_BATCH_DIMS leading dims that
broadcast) walks batch x m x n tiles: batch is the outermost tile dimension. An operand (or an
epilogue input) addresses each output batch dim as its own (`BATCH_INDEX`), as a dim of extent 1
read at 0 (`BATCH_ONE`, broadcast), or not at all (None: it has fewer dims, e.g. a weight).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx

from wsched.partition import Channel, OperandLoad, Partition, dag_of_loads, param_name
from wsched.schedule import Schedule, ScheduleError
from wsched.target import ELEMENTWISE_OPS, FLOAT_DTYPES, TMA_MAX_RANK, WGMMA_OPERAND_DTYPES

# Leading batch dims of a batched matmul: TMA maps the operands and outputs with one dim each.
MAX_BATCH_DIMS = TMA_MAX_RANK - 2
BATCH_INDEX = "index"     # the tensor has this batch dim: read at the tile's batch index
BATCH_ONE = "one"         # the tensor has extent 1 there: read at 0 (broadcast)


@dataclass(frozen=True)
class EpilogueTile:
    """How a compute-DAG value is held per consumer warpgroup: a [rows, cols] register tile
    ('full' [64, BN], 'row' [1, BN], 'col' [64, 1]) or a scalar."""

    node: str
    layout: str           # "full" | "row" | "col" | "scalar"
    dtype: str
    batch: tuple = ()     # per output batch dim: BATCH_INDEX, BATCH_ONE or None (a side input's)


@dataclass(frozen=True)
class MatmulPayload:
    """What only the matmul workload knows about its partition."""

    matmul: object                     # the anchor Node
    epilogue: tuple[object, ...]       # compute nodes after the mma, topological order
    tiles: dict                        # node id -> EpilogueTile, for every compute value
    side_inputs: tuple[object, ...]    # global inputs the epilogue reads (bias, residual)
    a_batch: tuple = ()                # per output batch dim, how A addresses it (BATCH_INDEX, ...)
    b_batch: tuple = ()                # the same for B

    @property
    def batch(self) -> int:
        """The number of leading batch dims of the output (0: a plain 2-D matmul)."""
        return len(self.a_batch)


def staged_output_bytes(fusion) -> int:
    """Bytes per output element a TMA-store epilogue stages in shared memory: one buffer per
    distinct output dtype (the schedule's `output_bytes`)."""
    dtypes = {fusion.node(o).dtype for o in fusion.outputs}
    return sum(d.itemsize for d in dtypes) or 2


def output_name(fusion, node) -> str:
    outs = list(fusion.outputs)
    return "out" if len(outs) == 1 else f"out{outs.index(node.id)}"


def partition_matmul(workload, fusion, schedule: Schedule) -> Partition:
    """Split a matmul-anchored fusion. Raises ScheduleError when it is not of that shape."""
    nodes = fusion.nodes()
    matmuls = [n for n in nodes if n.op == "matmul"]
    if len(matmuls) != 1:
        raise ScheduleError(f"the matmul schedule needs exactly one matmul in {fusion.name}, found "
                            f"{len(matmuls)}" + ("; a matmul -> softmax -> matmul fusion is scheduled "
                                                 "as attention (ws.schedule_for picks it)" if matmuls else ""))
    mm = matmuls[0]
    nb = len(mm.shape) - 2
    if nb > MAX_BATCH_DIMS:
        raise ScheduleError(f"{mm.id} = matmul{tuple(mm.inputs)} at {mm.source} has shape {list(mm.shape)}: "
                            f"{nb} batch dims; the persistent matmul kernel takes [*batch, M, K] x [*batch, K, N] "
                            f"with at most {MAX_BATCH_DIMS} batch dims (merge some first)")
    if nb and schedule.split_k > 1:
        raise ScheduleError(f"{mm.id} = matmul{tuple(mm.inputs)} at {mm.source} is batched (shape "
                            f"{list(mm.shape)}): split-K (split_k={schedule.split_k}) takes 2-D matmuls only; "
                            f"use split_k=1 (the batch dims already multiply the tiles)")
    if nb and schedule.stream_k is True:
        raise ScheduleError(f"{mm.id} = matmul{tuple(mm.inputs)} at {mm.source} is batched (shape "
                            f"{list(mm.shape)}): stream-K takes 2-D matmuls only; use stream_k=False")
    a_load, a_dims, a_batch = _operand(fusion, mm.inputs[0], "a", schedule, nb)
    b_load, b_dims, b_batch = _operand(fusion, mm.inputs[1], "b", schedule, nb)
    dims = {f"batch{i}": (a_dims[2][i] if a_batch[i] == BATCH_INDEX or b_batch[i] is None else b_dims[2][i])
            for i in range(nb)}
    dims.update({"M": a_dims[0], "K": a_dims[1], "N": b_dims[1]})
    channel = Channel("ab", schedule.stages, (a_load, b_load))

    # Compute sub-DAG: the mma, then every node downstream of it, plus what those read.
    downstream = nx.descendants(fusion.graph, mm.id)
    epilogue = [n for n in nodes if n.id in downstream]
    tiles = {mm.id: EpilogueTile(mm.id, "full", "f32")}
    side_inputs = []
    for node in epilogue:
        if node.op not in ELEMENTWISE_OPS:
            raise ScheduleError(f"{node.id} = {node.op}(...) at {node.source}: the matmul epilogue "
                                f"fuses elementwise ops only ({', '.join(ELEMENTWISE_OPS)})")
        for src in node.inputs:
            if src in tiles:
                continue
            src_node = fusion.node(src)   # not computed in the epilogue: an input or a scalar
            tiles[src] = _side_tile(src_node, tuple(mm.shape), node)
            if src_node.op == "input":
                side_inputs.append(src_node)
            elif src_node.op != "const":
                raise ScheduleError(f"{src_node.id} = {src_node.op}(...) at {src_node.source} is "
                                    f"computed from inputs outside the matmul; only inputs and "
                                    f"scalars can join the epilogue")
        tiles[node.id] = _result_tile(node, tiles)
        if not node.dtype.is_float:
            raise ScheduleError(f"{node.id} = {node.op}(...) at {node.source} computes {node.dtype.name} values; "
                                f"the matmul epilogue computes in floating point: an {node.dtype.name} input may "
                                f"meet a float (it is read as f32), not be computed on; cast it first with "
                                f".to(ws.f32)")
    outputs = [fusion.node(o) for o in fusion.outputs]
    for out in outputs:
        if out.id != mm.id and out.id not in downstream:
            raise ScheduleError(f"output {out.id} = {out.op}(...) at {out.source} does not depend "
                                f"on the matmul; every output of a matmul kernel is an [M, N] tile")
        if tiles[out.id].layout != "full" or tuple(out.shape) != tuple(mm.shape):
            raise ScheduleError(f"output {out.id} has shape {list(out.shape)}; the matmul kernel "
                                f"stores {_output_text(mm.shape)} outputs only")
        if out.dtype.name not in FLOAT_DTYPES:
            raise ScheduleError(f"output {out.id} has dtype {out.dtype.name}; supported: "
                                f"{', '.join(FLOAT_DTYPES)}")
    staged = staged_output_bytes(fusion)
    if schedule.epilogue == "tma_store" and schedule.output_bytes != staged:
        # The staging buffers are sized from the outputs' dtypes: a schedule counted with other
        # bytes is fine only while the real buffers still fit.
        try:
            replace(schedule, output_bytes=staged)
        except ScheduleError as e:
            dtypes = ", ".join(sorted({o.dtype.name for o in outputs}))
            raise ScheduleError(f"the schedule counts {schedule.output_bytes} bytes per staged output element "
                                f"(output_bytes) but the outputs of {fusion.name} ({dtypes}) take {staged}, and with "
                                f"{staged} it breaks a limit: {'; '.join(str(e).splitlines()[1:]).replace('  - ', '')}; build it with "
                                f"ws.schedule_for({fusion.name}, ...), which sets output_bytes={staged}") from None

    compute_dag = nx.DiGraph()
    for ld in channel.loads:
        compute_dag.add_edge(f"{ld.buffer}[stage]", mm.id)
    for node in epilogue:
        for src in node.inputs:
            compute_dag.add_edge(src, node.id)
    for out in outputs:
        compute_dag.add_edge(out.id, f"store({out.id})")
    payload = MatmulPayload(mm, tuple(epilogue), tiles, tuple(dict.fromkeys(side_inputs)), a_batch, b_batch)
    return Partition(workload, fusion, schedule, (channel,), dag_of_loads((channel,)), compute_dag,
                     tuple(outputs), tuple(output_name(fusion, o) for o in outputs), dims, ("K",), payload)


def describe(part: Partition) -> str:
    s, mm = part.schedule, part.payload
    bm, bn, bk = s.tile
    ch = part.channels[0]
    batch = "".join(f"batch{i} x " for i in range(mm.batch))
    lines = [f"partition of {part.fusion.name} ({s.short()})", "",
             "load sub-DAG  (producer: 1 warp of 1 warpgroup, elected thread)",
             f"  for tile in persistent({batch}ceil(M/{bm}) x ceil(N/{bn}) tiles, raster {s.raster},"
             f" group {s.swizzle_group}):",
             f"    for k in range(ceil(K/{bk})):"]
    for ld in ch.loads:
        lines.append(f"      tma.load {ld.tensor} -> {ld.buffer}[stage]   box {list(ld.box)} x{ld.boxes}, "
                     f"{ld.major}-major, {ld.bytes} bytes   (channel {ch.name})")
    pingpong = s.tile_warpgroups == 1 < s.consumer_warpgroups
    lines += ["", f"compute sub-DAG  (consumers: {s.consumer_warpgroups} warpgroups x "
              f"{s.rows_per_consumer} rows" + (", each its own tiles in turn)" if pingpong else ")"),
              "  for tile in persistent(same tiles, same order" + (", every other one per warpgroup):" if pingpong
                                                                  else "):"),
              "    for k in range(ceil(K/" + str(bk) + ")):",
              f"      {mm.matmul.id} = matmul({', '.join(mm.matmul.inputs)})   wgmma "
              f"{ch.loads[0].buffer} x {ch.loads[1].buffer} -> acc f32[{s.rows_per_consumer}, {bn}]"
              + (f" (in {s.mma_row_blocks} accumulators of 64 rows)" if s.mma_row_blocks > 1 else ""),
              "    epilogue:"]
    for node in mm.epilogue:
        t = mm.tiles[node.id]
        lines.append(f"      {node.id} = {node.op}({', '.join(node.inputs)})   {t.layout} tile {t.dtype}")
    for out, name in zip(part.outputs, part.output_names):
        lines.append(f"      store {out.id} -> {name}   ({s.epilogue})")
    lines += ["", "channels"]
    for c in part.channels:
        parts = " + ".join(f"{ld.buffer} {ld.bytes}" for ld in c.loads)
        lines.append(f"  {c.name}: {c.stages} stages x {c.bytes_per_stage} bytes ({parts}), "
                     f"barriers {c.full}[{c.stages}] (arrivals 1 + tx) / {c.empty}[{c.stages}] "
                     f"(arrivals {s.tile_warpgroups})")
    return "\n".join(lines) + "\n"


def _operand(fusion, node_id: str, which: str, schedule: Schedule, nb: int):
    """The OperandLoad of an MMA operand, where its [rows, cols] sizes come from (then its batch
    dims' (node, axis) per output batch dim), and how it addresses each output batch dim."""
    node = fusion.node(node_id)
    transposed = False
    if node.op == "transpose":
        transposed = True
        if (node.attr("dim0"), node.attr("dim1")) != (-2, -1):
            raise ScheduleError(f"matmul operand {which} is {node.id} = transpose(dims {node.attr('dim0')}, "
                                f"{node.attr('dim1')}) at {node.source}: only the last two dims of an operand "
                                f"may be swapped (w.transpose(-1, -2))")
        node = fusion.node(node.inputs[0])
    if node.op != "input":
        raise ScheduleError(f"matmul operand {which} is {node.id} = {node.op}(...) at {node.source}: "
                            f"an MMA operand must be a fusion input (optionally transposed) so that "
                            f"it can be loaded by TMA")
    rank = len(node.shape)
    batch = batch_roles(node.shape[:-2], nb)
    axes = tuple(None if role is None else (node.id, rank - 2 - (nb - i)) for i, role in enumerate(batch))
    r, c = (node.id, rank - 2), (node.id, rank - 1)
    if node.dtype.name not in WGMMA_OPERAND_DTYPES:
        raise ScheduleError(f"matmul operand {which} ({node.id}) is {node.dtype.name}; wgmma takes "
                            f"{' or '.join(WGMMA_OPERAND_DTYPES)}")
    bm, bn, bk = schedule.tile
    if which == "a":
        if transposed:
            raise ScheduleError(f"matmul operand a is a transpose of {node.id}: A must be [M, K] with "
                                f"K contiguous; pass the tensor in that layout")
        return (OperandLoad(param_name(node.id), "a", "A", "k", node.dtype.name, (bm, bk), 1),
                (r, c, axes), batch)
    if transposed:   # b = w.transpose(): w is [*batch, N, K], K contiguous
        return (OperandLoad(param_name(node.id), "b", "B", "k", node.dtype.name, (bn, bk), 1),
                (c, r, axes), batch)
    chunk = min(bn, 64)
    return (OperandLoad(param_name(node.id), "b", "B", "n", node.dtype.name, (bk, chunk), bn // chunk),
            (r, c, axes), batch)


def batch_roles(leading, nb: int) -> tuple:
    """How a tensor whose dims before its last two are `leading` addresses each of the output's
    `nb` batch dims (right-aligned, as broadcasting aligns them): BATCH_INDEX, BATCH_ONE (extent
    1) or None (the tensor has fewer dims). The caller has checked that they broadcast."""
    missing = nb - len(leading)
    return tuple(None if i < missing else BATCH_ONE if leading[i - missing] == 1 else BATCH_INDEX
                 for i in range(nb))


def _output_text(shape) -> str:
    return "[M, N]" if len(shape) == 2 else f"[{', '.join(map(str, shape[:-2]))}, M, N]"


def _side_tile(node, out_shape: tuple, user) -> EpilogueTile:
    # An integer input meets a float (the DSL's promotion): it is read into an f32 tile, the
    # conversion torch's promotion makes too.
    dtype = node.dtype.name if node.dtype.is_float else "f32"
    if node.op == "const" or len(node.shape) == 0:
        return EpilogueTile(node.id, "scalar", dtype)
    shape = tuple(node.shape)
    *batch, m_sym, n_sym = out_shape
    # Leading dims: each the output's batch dim or 1 (the tile never broadcasts the accumulator).
    lead, last = (shape[:-2], shape[-2:]) if len(shape) >= 2 else ((), shape)
    fits = len(lead) <= len(batch) and all(d == 1 or d == batch[len(batch) - len(lead) + i]
                                           for i, d in enumerate(lead))
    layout = {(m_sym, n_sym): "full", (n_sym,): "row", (1, n_sym): "row", (m_sym, 1): "col"}.get(last)
    if fits and layout is not None:
        return EpilogueTile(node.id, layout, dtype, batch_roles(lead, len(batch)))
    where = f"(M={m_sym}, N={n_sym})" if not batch else \
        f"with leading dims of the output's batch dims [{', '.join(map(str, batch))}] or 1 (M={m_sym}, N={n_sym})"
    raise ScheduleError(f"{node.id} has shape {list(shape)} and is read by {user.id} = {user.op}(...) at "
                        f"{user.source}; the epilogue reads [M, N], [N], [1, N] or [M, 1] tensors {where}")


def _result_tile(node, tiles) -> EpilogueTile:
    layouts = {tiles[i].layout for i in node.inputs} - {"scalar"}
    if "full" not in layouts and layouts != {"row", "col"}:
        raise ScheduleError(f"{node.id} = {node.op}(...) at {node.source} does not depend on the "
                            f"matmul result")
    return EpilogueTile(node.id, "full", node.dtype.name)
