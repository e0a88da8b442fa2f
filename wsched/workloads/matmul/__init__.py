"""The matmul workload: C = epilogue(A @ B) as a persistent, warp-specialized GEMM.

The producer loads A and B tiles through one channel per k step; the consumer warpgroups run
one wgmma per k step into an fp32 accumulator, then the fused elementwise epilogue and the
stores (TMA or direct). It takes fusions with exactly one 2-D matmul whose operands are
inputs, and elementwise ops after it.
"""

from __future__ import annotations

from wsched.workloads.base import Workload

from . import epilogue, loops, partition, schedule
from wsched.names import SPLITS

from .schedule import MAX_SPLIT_K, MatmulSchedule


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

    def variants(self, fusion, schedule: MatmulSchedule):
        """Split-K where the default's output tiles cannot fill the SMs: the same tile with
        `split_k=MAX_SPLIT_K`, used when the split count the host computes for the call is above 1
        (fewer than half as many output tiles as SMs, and at least 2 k steps). The split-capable
        kernel is slower where it does not split (8192^3), so it never replaces the default."""
        from wsched.dispatch import Variant

        if schedule.split_k != 1:
            return ()
        split = self.default_schedule(fusion, tile=schedule.tile, consumer_warpgroups=schedule.consumer_warpgroups,
                                      split_k=MAX_SPLIT_K)
        return (Variant(split, lambda values: values[SPLITS] > 1,
                        f"{SPLITS} = min({MAX_SPLIT_K}, k steps, num_sms / output tiles) > 1"),)

    def schedule_space(self, fusion):
        return schedule.schedule_space(partition.staged_output_bytes(fusion))


MATMUL = MatmulWorkload()
