"""The matmul workload: C = epilogue(A @ B) as a persistent, warp-specialized GEMM.

The producer loads A and B tiles through one channel per k step; the consumer warpgroups run
one wgmma per k step into an fp32 accumulator, then the fused elementwise epilogue and the
stores (TMA or direct). It takes fusions with exactly one 2-D matmul whose operands are
inputs, and elementwise ops after it.
"""

from __future__ import annotations

from wsched.schedule import ScheduleError
from wsched.workloads.base import Workload

from . import epilogue, loops, partition, schedule
from .schedule import MatmulSchedule


class MatmulWorkload(Workload):
    name = "matmul"
    schedule_type = MatmulSchedule

    def matches(self, fusion) -> bool:
        return sum(n.op == "matmul" for n in fusion.nodes()) == 1

    def mismatch(self, fusion) -> str:
        found = sum(n.op == "matmul" for n in fusion.nodes())
        return f"matmul needs exactly one matmul (found {found})"

    def default_schedule(self, fusion, **overrides) -> MatmulSchedule:
        if "output_bytes" not in overrides:
            outputs = [fusion.node(o) for o in fusion.outputs]
            overrides["output_bytes"] = max((o.dtype.itemsize for o in outputs), default=2)
        return schedule.default_schedule(**overrides)

    def schedule_space(self, fusion):
        outputs = [fusion.node(o) for o in fusion.outputs]
        return schedule.schedule_space(max((o.dtype.itemsize for o in outputs), default=2))

    def partition(self, fusion, sched):
        if not isinstance(sched, MatmulSchedule):
            raise ScheduleError(f"{fusion.name} is a matmul; its schedule must be a MatmulSchedule, "
                                f"not {type(sched).__name__}")
        return partition.partition_matmul(self, fusion, sched)

    def describe(self, part) -> str:
        return partition.describe(part)

    def build_loops(self, kernel, ctx):
        return loops.build_loops(kernel, ctx)

    def epilogue(self, kernel, ctx):
        return epilogue.epilogue(kernel, ctx)


MATMUL = MatmulWorkload()
