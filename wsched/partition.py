"""Partition a fusion into a load sub-DAG and a compute sub-DAG, each with its own loop nest.

This is the split that makes warp specialization a scheduling decision rather than a
rewrite of one loop nest: every global operand read by the MMA becomes a TMA load run by the
producer warp (the load sub-DAG), everything else (the MMA, the fused epilogue, the stores)
runs on the consumer warpgroups (the compute sub-DAG). Each edge the cut crosses is carried by
a `Channel`: a circular buffer of `stages` shared-memory slots with a full and an empty
mbarrier per slot.

    load    : for tile in persistent(tiles): for k in range(k_tiles): tma.load A, B
    compute : for tile in persistent(tiles): { for k in range(k_tiles): wgmma ; epilogue }
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx

from .schedule import Schedule, ScheduleError

ELEMENTWISE_UNARY = ("neg", "exp", "exp2", "log", "relu", "gelu", "silu", "sigmoid", "tanh", "cast")
ELEMENTWISE_BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
DTYPE_NAMES = {"bf16": "bf16", "f16": "f16", "f32": "f32"}


@dataclass(frozen=True)
class OperandLoad:
    """One TMA load per stage of a global operand of the MMA into a shared-memory buffer.

    `major` is the contiguous dimension of the operand in global memory: "k" (A as [M, K],
    B as [N, K]) or "n" (B as [K, N]). `box` is one TMA box (outermost first); `boxes` how many
    boxes fill one stage (a 128-byte swizzled N-major B is loaded as BN/64 column chunks)."""

    tensor: str
    operand: str          # "a" | "b"
    buffer: str           # "A" | "B"
    major: str
    dtype: str
    box: tuple[int, int]
    boxes: int

    @property
    def bytes(self) -> int:
        return self.box[0] * self.box[1] * self.boxes * 2


@dataclass(frozen=True)
class Channel:
    """A cut edge of the DAG carried through shared memory by a circular buffer.

    `level` is the loop that steps it: "k" (a new slot every cta-k / kv iteration) or "tile"
    (loaded once per output tile, like attention's Q)."""

    name: str
    stages: int
    loads: tuple[OperandLoad, ...]
    full: str = "full"
    empty: str = "empty"
    level: str = "k"

    @property
    def buffers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(ld.buffer for ld in self.loads))

    @property
    def bytes_per_stage(self) -> int:
        return sum(load.bytes for load in self.loads)


@dataclass(frozen=True)
class EpilogueTile:
    """How a compute-DAG value is held per consumer warpgroup: a [rows, cols] register tile
    ('full' [64, BN], 'row' [1, BN], 'col' [64, 1]) or a scalar."""

    node: str
    kind: str             # "full" | "row" | "col" | "scalar"
    dtype: str


@dataclass(frozen=True)
class Partition:
    kind = "matmul"
    fusion: object
    schedule: Schedule
    matmul: object                     # the anchor Node
    channels: tuple[Channel, ...]
    load_dag: nx.DiGraph               # inputs -> tma loads -> channel buffers
    compute_dag: nx.DiGraph            # channel buffers -> mma -> epilogue -> stores
    epilogue: tuple[object, ...]       # compute nodes after the mma, topological order
    tiles: dict                        # node id -> EpilogueTile, for every compute value
    side_inputs: tuple[object, ...]    # global inputs the epilogue reads (bias, residual)
    outputs: tuple[object, ...]        # output nodes, all [M, N]
    dims: dict                         # "M"/"N"/"K" -> (input name, axis) to read the size from

    def __str__(self) -> str:
        s = self.schedule
        bm, bn, bk = s.tile
        ch = self.channels[0]
        lines = [f"partition of {self.fusion.name} ({s.short()})", "",
                 "load sub-DAG  (producer: 1 warp of 1 warpgroup, elected thread)",
                 f"  for tile in persistent(ceil(M/{bm}) x ceil(N/{bn}) tiles, raster {s.raster},"
                 f" group {s.swizzle_group}):",
                 f"    for k in range(ceil(K/{bk})):"]
        for ld in ch.loads:
            lines.append(f"      tma.load {ld.tensor} -> {ld.buffer}[stage]   box {list(ld.box)} x{ld.boxes}, "
                         f"{ld.major}-major, {ld.bytes} bytes   (channel {ch.name})")
        lines += ["", f"compute sub-DAG  (consumers: {s.consumer_warpgroups} warpgroups x "
                  f"{s.rows_per_consumer} rows)",
                  "  for tile in persistent(same tiles, same order):",
                  "    for k in range(ceil(K/" + str(bk) + ")):",
                  f"      {self.matmul.id} = matmul({', '.join(self.matmul.inputs)})   wgmma "
                  f"{ch.loads[0].buffer} x {ch.loads[1].buffer} -> acc f32[{s.rows_per_consumer}, {bn}]",
                  "    epilogue:"]
        for node in self.epilogue:
            t = self.tiles[node.id]
            lines.append(f"      {node.id} = {node.op}({', '.join(node.inputs)})   {t.kind} tile {t.dtype}")
        for out in self.outputs:
            lines.append(f"      store {out.id} -> {_output_name(self, out)}   ({s.epilogue})")
        lines += ["", "channels"]
        for c in self.channels:
            parts = " + ".join(f"{ld.buffer} {ld.bytes}" for ld in c.loads)
            lines.append(f"  {c.name}: {c.stages} stages x {c.bytes_per_stage} bytes ({parts}), "
                         f"barriers {c.full}[{c.stages}] (arrivals 1 + tx) / {c.empty}[{c.stages}] "
                         f"(arrivals {s.consumer_warpgroups})")
        return "\n".join(lines) + "\n"


# Names the lowering gives its own loop variables, lets and buffers. A fusion input with one of
# these names is passed to the kernel under `<name>_in` (see param_name), so the IR stays
# free of shadowing.
RESERVED_NAMES = frozenset({
    "k", "s", "ph", "it", "tile", "tile_iter", "prev_s", "last_s", "m0", "n0", "tile_m", "tile_n",
    "tiles_m", "tiles_n", "num_tiles", "k_tiles", "group_size", "first_m", "first_n", "group_extent",
    "acc", "wg", "cta_id", "num_ctas", "num_sms", "M", "N", "K", "S", "T", "m_blocks", "m_block",
    "kv_blocks", "kv_tiles", "k_base", "rest", "s_acc", "p", "o_acc", "m_run", "l_run", "m_blk",
    "corr", "o_t", "o", "lse", "out", "A", "B", "Q", "V", "full", "empty",
})


def param_name(tensor: str) -> str:
    """The kernel parameter name of a fusion input."""
    if tensor in RESERVED_NAMES or re.fullmatch(r"(b|batch|rest|out)\d+|C_\w+|\w+_t", tensor):
        return f"{tensor}_in"
    return tensor


def _output_name(part: Partition, node) -> str:
    outs = list(part.fusion.outputs)
    return "out" if len(outs) == 1 else f"out{outs.index(node.id)}"


def output_names(part) -> list[str]:
    """Kernel parameter names of the outputs, in fusion output order."""
    if part.kind == "attention":
        return part.output_names()
    return [_output_name(part, n) for n in part.outputs]


def partition(fusion, schedule: Schedule):
    """Split a fusion into load and compute sub-DAGs with the schedule's kind."""
    if schedule.kind == "attention":
        from .attention import partition_attention

        return partition_attention(fusion, schedule)
    return partition_matmul(fusion, schedule)


def partition_matmul(fusion, schedule: Schedule) -> Partition:
    """Split a matmul-anchored fusion. Raises ScheduleError when it is not of that shape."""
    nodes = fusion.nodes()
    matmuls = [n for n in nodes if n.op == "matmul"]
    if len(matmuls) != 1:
        raise ScheduleError(f"the matmul schedule needs exactly one matmul in {fusion.name}, found "
                            f"{len(matmuls)}" + ("; attention fusions need kind='attention'" if matmuls else ""))
    mm = matmuls[0]
    if len(mm.shape) != 2:
        raise ScheduleError(f"{mm.id} = matmul{tuple(mm.inputs)} at {mm.source} has shape "
                            f"{list(mm.shape)}: the persistent matmul kernel handles 2-D [M, K] x [K, N] only")
    a_load, a_dims = _operand(fusion, mm.inputs[0], "a", schedule)
    b_load, b_dims = _operand(fusion, mm.inputs[1], "b", schedule)
    dims = {"M": a_dims[0], "K": a_dims[1], "N": b_dims[1]}
    channel = Channel("ab", schedule.stages, (a_load, b_load))

    # Compute sub-DAG: the mma, then every node downstream of it, plus what those read.
    downstream = nx.descendants(fusion.graph, mm.id)
    epilogue = [n for n in nodes if n.id in downstream]
    m_sym, n_sym = mm.shape
    tiles = {mm.id: EpilogueTile(mm.id, "full", "f32")}
    side_inputs = []
    for node in epilogue:
        if node.op not in ELEMENTWISE_UNARY + ELEMENTWISE_BINARY:
            raise ScheduleError(f"{node.id} = {node.op}(...) at {node.source}: the matmul epilogue "
                                f"fuses elementwise ops only ({', '.join(ELEMENTWISE_UNARY + ELEMENTWISE_BINARY)})")
        for src in node.inputs:
            if src in tiles:
                continue
            src_node = fusion.node(src)   # not computed in the epilogue: an input or a scalar
            tiles[src] = _side_tile(src_node, m_sym, n_sym, node)
            if src_node.op == "input":
                side_inputs.append(src_node)
            elif src_node.op != "const":
                raise ScheduleError(f"{src_node.id} = {src_node.op}(...) at {src_node.source} is "
                                    f"computed from inputs outside the matmul; only inputs and "
                                    f"scalars can join the epilogue")
        tiles[node.id] = _result_tile(node, tiles, m_sym, n_sym)
    outputs = [fusion.node(o) for o in fusion.outputs]
    for out in outputs:
        if out.id != mm.id and out.id not in downstream:
            raise ScheduleError(f"output {out.id} = {out.op}(...) at {out.source} does not depend "
                                f"on the matmul; every output of a matmul kernel is an [M, N] tile")
        if tiles[out.id].kind != "full":
            raise ScheduleError(f"output {out.id} has shape {list(out.shape)}; the matmul kernel "
                                f"stores [M, N] outputs only")
        if out.dtype.name not in DTYPE_NAMES:
            raise ScheduleError(f"output {out.id} has dtype {out.dtype.name}; supported: bf16, f16, f32")

    load_dag = nx.DiGraph()
    compute_dag = nx.DiGraph()
    for ld in channel.loads:
        load_dag.add_edge(ld.tensor, f"tma_load({ld.tensor})")
        load_dag.add_edge(f"tma_load({ld.tensor})", f"{ld.buffer}[stage]")
        compute_dag.add_edge(f"{ld.buffer}[stage]", mm.id)
    for node in epilogue:
        for src in node.inputs:
            compute_dag.add_edge(src, node.id)
    for out in outputs:
        compute_dag.add_edge(out.id, f"store({out.id})")
    return Partition(fusion, schedule, mm, (channel,), load_dag, compute_dag, tuple(epilogue),
                     tiles, tuple(dict.fromkeys(side_inputs)), tuple(outputs), dims)


def _operand(fusion, node_id: str, which: str, schedule: Schedule):
    """The OperandLoad of an MMA operand and where its [rows, cols] sizes come from."""
    node = fusion.node(node_id)
    transposed = False
    if node.op == "transpose":
        transposed = True
        node = fusion.node(node.inputs[0])
    if node.op != "input":
        raise ScheduleError(f"matmul operand {which} is {node.id} = {node.op}(...) at {node.source}: "
                            f"an MMA operand must be a fusion input (optionally transposed) so that "
                            f"it can be loaded by TMA")
    if len(node.shape) != 2:
        raise ScheduleError(f"matmul operand {which} ({node.id}) has rank {len(node.shape)}; 2 is needed")
    if node.dtype.name not in ("bf16", "f16"):
        raise ScheduleError(f"matmul operand {which} ({node.id}) is {node.dtype.name}; wgmma takes bf16 or f16")
    bm, bn, bk = schedule.tile
    if which == "a":
        if transposed:
            raise ScheduleError(f"matmul operand a is a transpose of {node.id}: A must be [M, K] with "
                                f"K contiguous; pass the tensor in that layout")
        return (OperandLoad(param_name(node.id), "a", "A", "k", node.dtype.name, (bm, bk), 1),
                ((node.id, 0), (node.id, 1)))
    if transposed:   # b = w.transpose(): w is [N, K], K contiguous
        return (OperandLoad(param_name(node.id), "b", "B", "k", node.dtype.name, (bn, bk), 1),
                ((node.id, 1), (node.id, 0)))
    chunk = min(bn, 64)
    return (OperandLoad(param_name(node.id), "b", "B", "n", node.dtype.name, (bk, chunk), bn // chunk),
            ((node.id, 0), (node.id, 1)))


def _side_tile(node, m_sym, n_sym, user) -> EpilogueTile:
    dtype = node.dtype.name
    if node.op == "const" or len(node.shape) == 0:
        return EpilogueTile(node.id, "scalar", dtype)
    shape = tuple(node.shape)
    if shape in ((m_sym, n_sym),):
        return EpilogueTile(node.id, "full", dtype)
    if shape in ((n_sym,), (1, n_sym)):
        return EpilogueTile(node.id, "row", dtype)
    if shape == (m_sym, 1):
        return EpilogueTile(node.id, "col", dtype)
    raise ScheduleError(f"{node.id} has shape {list(shape)} and is read by {user.id} = {user.op}(...) at "
                        f"{user.source}; the epilogue reads [M, N], [N], [1, N] or [M, 1] tensors "
                        f"(M={m_sym}, N={n_sym})")


def _result_tile(node, tiles, m_sym, n_sym) -> EpilogueTile:
    kinds = {tiles[i].kind for i in node.inputs} - {"scalar"}
    kind = "full" if "full" in kinds or kinds == {"row", "col"} else (kinds.pop() if kinds else "scalar")
    if kind != "full":
        raise ScheduleError(f"{node.id} = {node.op}(...) at {node.source} does not depend on the "
                            f"matmul result")
    return EpilogueTile(node.id, kind, node.dtype.name)
