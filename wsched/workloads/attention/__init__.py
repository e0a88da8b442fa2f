"""The attention workload: O = softmax(scale * Q K^T [masked]) V as flash attention.

The producer loads Q once per tile and K, V per kv block through their own channels; the
consumer warpgroups run S = Q K^T, the score function and the online softmax in registers and
O += P V, then normalise and store O (and the log-sum-exp). It takes fusions of the form
matmul -> softmax -> matmul whose operands are inputs, with any elementwise score function and
masks between Q K^T and the softmax (score.py: what is analysed, score_ops.py: the tile ops).
Its own passes: overlap_softmax (mma_inflight=1) and pingpong (mode="pingpong").
"""

from __future__ import annotations

from wsched.lowering.context import Step
from wsched.schedule import ScheduleError, is_int
from wsched.workloads.base import Workload

from . import epilogue, loops, overlap_softmax, partition, pingpong, schedule
from .schedule import AttentionSchedule


class AttentionWorkload(Workload):
    name = "attention"
    schedule_type = AttentionSchedule
    split = staticmethod(partition.partition_attention)
    describe = staticmethod(partition.describe)
    build_loops = staticmethod(loops.build_loops)
    epilogue = staticmethod(epilogue.epilogue)
    extra_passes = (
        # Delay P V by one block so the softmax overlaps it: a reordering of the complete wgmma
        # protocol lower_mma wrote.
        Step("overlap_softmax", overlap_softmax.run, True, lambda s: s.mma_inflight == 1, "mma_inflight=1"),
        # Token passing around the GEMM issue that overlap_softmax grouped together.
        Step("pingpong", pingpong.run, True, lambda s: s.mode == "pingpong", 'mode="pingpong"'),
    )

    def matches(self, fusion) -> bool:
        return partition.is_attention(fusion)

    def mismatch(self, fusion) -> str:
        nodes = fusion.nodes()
        return (f"attention needs matmul -> softmax -> matmul (found {sum(n.op == 'matmul' for n in nodes)} "
                f"matmul(s), {sum(n.op == 'softmax' for n in nodes)} softmax(es))")

    def default_schedule(self, fusion, **overrides) -> AttentionSchedule:
        if "head_dim" in overrides:
            head_dim = overrides.pop("head_dim")
            if not is_int(head_dim) or head_dim not in schedule.HEAD_DIMS:
                raise ScheduleError(f"attention schedule for {fusion.name}: head_dim={head_dim!r} is not one of "
                                    f"{', '.join(map(str, schedule.HEAD_DIMS))}")
        else:
            head_dim = self._head_dim(fusion)
        return schedule.default_schedule(head_dim, **overrides)

    def schedule_space(self, fusion):
        # the partition of the default schedule checks the fusion and analyses its score function
        score_function = self.partition(fusion, self.default_schedule(fusion)).payload.score
        kinds = tuple(kind for kind, _ in score_function.register_costs(fusion))
        return schedule.schedule_space(self._head_dim(fusion), kinds)

    @staticmethod
    def _head_dim(fusion) -> int:
        head_dim = partition.head_dim_of(fusion)
        if not is_int(head_dim):
            raise ScheduleError(f"attention schedule for {fusion.name}: the head dim of Q is the symbol "
                                f"{head_dim!r}; declare it as a number ({', '.join(map(str, schedule.HEAD_DIMS))})")
        return head_dim


ATTENTION = AttentionWorkload()
