"""Partition a fusion into a load sub-DAG and a compute sub-DAG, each with its own loop nest.

This is the split that makes warp specialization a scheduling decision rather than a rewrite of
one loop nest: every global operand read by an MMA becomes a TMA load run by the producer warp
(the load sub-DAG), everything else (the MMAs, the softmax or the fused epilogue, the stores)
runs on the consumer warpgroups (the compute sub-DAG). Each edge the cut crosses is carried by
a `Channel`: a circular buffer of `stages` shared-memory slots with a full and an empty
mbarrier per slot.

The types here are shared by every workload; what a workload alone knows (the matmul's fused
epilogue, attention's Q/K/V and mask) is the partition's `payload`, built by the workload's
own partition function (`wsched/workloads/<name>/partition.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx

from .names import LOWERING_NAMES
from .schedule import Schedule
from .target import DTYPE_BYTES


@dataclass(frozen=True)
class OperandLoad:
    """One TMA load per stage of a global operand of an MMA into a shared-memory buffer.

    `major` is the contiguous dimension of the operand in global memory: "k" (A as [M, K],
    B as [N, K]) or "n" (B as [K, N]). `box` is one TMA box (outermost first); `boxes` how many
    boxes fill one stage (a 128-byte swizzled N-major B is loaded as BN/64 column chunks)."""

    tensor: str
    operand: str          # "a" | "b" (matmul), "q" | "k" | "v" (attention)
    buffer: str           # the shared-memory buffer it lands in
    major: str
    dtype: str
    box: tuple[int, int]
    boxes: int

    @property
    def bytes(self) -> int:
        return self.box[0] * self.box[1] * self.boxes * DTYPE_BYTES[self.dtype]


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
class Partition:
    """A fusion split for one workload: channels, the two sub-DAGs, what the kernel reads and
    writes, and the workload's own `payload`.

    `outputs` are the output nodes in fusion order and `output_names` their kernel parameter
    names; `dims` maps each kernel size scalar to the (input, axis) it is read from; `nonempty`
    names the sizes a call must not pass as 0 (the reduction extents)."""

    workload: object                   # the wsched.workloads.Workload that made it
    fusion: object
    schedule: Schedule
    channels: tuple[Channel, ...]
    load_dag: nx.DiGraph               # inputs -> tma loads -> channel buffers
    compute_dag: nx.DiGraph            # channel buffers -> mma -> ... -> stores
    outputs: tuple[object, ...]
    output_names: tuple[str, ...]
    dims: dict
    nonempty: tuple[str, ...]
    payload: object

    def __str__(self) -> str:
        return self.workload.describe(self)


def param_name(tensor: str) -> str:
    """The kernel parameter name of a fusion input (see wsched/names.py)."""
    if tensor in LOWERING_NAMES or re.fullmatch(r"(b|batch|rest|out)\d+|C_\w+|\w+_t", tensor):
        return f"{tensor}_in"
    return tensor


def dag_of_loads(channels) -> nx.DiGraph:
    """The load sub-DAG: each input -> its TMA load -> the channel buffer it fills."""
    load_dag = nx.DiGraph()
    for c in channels:
        for ld in c.loads:
            load_dag.add_edge(ld.tensor, f"tma_load({ld.tensor})")
            load_dag.add_edge(f"tma_load({ld.tensor})", f"{ld.buffer}[stage]")
    return load_dag
