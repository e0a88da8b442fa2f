"""The matmul workload: C = epilogue(A @ B) as a persistent, warp-specialized GEMM.

The producer loads A and B tiles through one channel per k step; the consumer warpgroups run
one wgmma per k step into an fp32 accumulator, then the fused elementwise epilogue and the
stores (TMA or direct). It takes fusions with exactly one 2-D matmul whose operands are
inputs, and elementwise ops after it.
"""

from __future__ import annotations

from wsched.workloads.base import Workload

from . import epilogue, loops, partition, schedule
from .schedule import MatmulSchedule


class MatmulWorkload(Workload):
    name = "matmul"
    schedule_type = MatmulSchedule
    split = staticmethod(partition.partition_matmul)
    describe = staticmethod(partition.describe)
    build_loops = staticmethod(loops.build_loops)
    epilogue = staticmethod(epilogue.epilogue)

    def matches(self, fusion) -> bool:
        return sum(n.op == "matmul" for n in fusion.nodes()) == 1

    def mismatch(self, fusion) -> str:
        found = sum(n.op == "matmul" for n in fusion.nodes())
        return f"matmul needs exactly one matmul (found {found})"

    def default_schedule(self, fusion, **overrides) -> MatmulSchedule:
        if "output_bytes" not in overrides:
            overrides["output_bytes"] = partition.staged_output_bytes(fusion)
        return schedule.default_schedule(**overrides)

    def schedule_space(self, fusion):
        return schedule.schedule_space(partition.staged_output_bytes(fusion))


MATMUL = MatmulWorkload()
