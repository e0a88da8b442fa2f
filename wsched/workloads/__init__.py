"""The workloads wsched compiles, each a plug-in of the one lowering pipeline (see base.py):
matmul (a persistent GEMM with a fused epilogue) and attention (flash attention)."""

from __future__ import annotations

from wsched.fusion import check_fusion
from wsched.partition import Partition
from wsched.schedule import Schedule, ScheduleError, check_schedule

from .attention import ATTENTION
from .base import Workload
from .matmul import MATMUL

# Tried in order; the first that matches a fusion takes it.
WORKLOADS: tuple[Workload, ...] = (ATTENTION, MATMUL)


def workload_for(fusion) -> Workload:
    """The workload that takes `fusion`; ScheduleError saying why each one does not."""
    check_fusion(fusion, "workload_for")
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
    check_fusion(fusion, "partition")
    check_schedule(schedule)
    _check_kernel_arguments(fusion)
    taker = next((w for w in WORKLOADS if w.matches(fusion)), None)
    if taker is not None and taker.name != schedule.workload:
        raise ScheduleError(f"{fusion.name} is taken by the {taker.name} workload; its schedule must be a "
                            f"{taker.schedule_type.__name__}, not {type(schedule).__name__} (ws.schedule_for("
                            f"{fusion.name}, **fields) builds one)")
    return workload_named(schedule.workload).partition(fusion, schedule)


def _check_kernel_arguments(fusion) -> None:
    """A kernel takes every input as an argument and stores every output once: a fusion may say
    otherwise (the DSL keeps an unused parameter and a repeated output), a kernel cannot."""
    for node in fusion.inputs:
        if not fusion.consumers(node.id) and node.id not in fusion.outputs:
            raise ScheduleError(f"{fusion.name}: input {node.id} ({node.source}) is not used by any output; the "
                                f"kernel would take an argument it never reads: remove the parameter")
    for index, output in enumerate(fusion.outputs):
        if output in fusion.outputs[:index]:
            raise ScheduleError(f"{fusion.name} returns {output} twice (outputs {fusion.outputs.index(output)} and "
                                f"{index}); a kernel stores each output once: return it once")
