"""The workloads wsched compiles, each a plug-in of the one lowering pipeline (see base.py):
matmul (a persistent GEMM with a fused epilogue) and attention (flash attention)."""

from __future__ import annotations

from wsched.partition import Partition
from wsched.schedule import Schedule, ScheduleError

from .attention import ATTENTION
from .base import Workload
from .matmul import MATMUL

# Tried in order; the first that matches a fusion takes it.
WORKLOADS: tuple[Workload, ...] = (ATTENTION, MATMUL)


def workload_for(fusion) -> Workload:
    """The workload that takes `fusion`; ScheduleError saying why each one does not."""
    for workload in WORKLOADS:
        if workload.matches(fusion):
            return workload
    reasons = "; ".join(w.mismatch(fusion) for w in WORKLOADS)
    raise ScheduleError(f"no workload takes {fusion.name}: {reasons}")


def workload_named(name: str) -> Workload:
    for workload in WORKLOADS:
        if workload.name == name:
            return workload
    raise ScheduleError(f"unknown workload {name!r}; known: {', '.join(w.name for w in WORKLOADS)}")


def partition(fusion, schedule: Schedule) -> Partition:
    """Split a fusion into load and compute sub-DAGs with its schedule's workload."""
    return workload_named(schedule.workload).partition(fusion, schedule)
