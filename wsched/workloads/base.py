"""The workload seam: what a workload gives the one lowering pipeline.

A workload (matmul, attention) is a plug-in in the manner of ThunderKittens' load / compute /
finish template: the pipeline and the shared passes own the warp-specialized protocol (stages,
full/empty barriers, TMA issue, the wgmma protocol, register reallocation); the workload says

- `matches(fusion)`: whether it can take a fusion (and `mismatch(fusion)`: why not, in words);
- `default_schedule(fusion, **overrides)` and `schedule_space(fusion)`: its schedules (a
  subclass of `wsched.schedule.Schedule`, `schedule_type`);
- `split(workload, fusion, schedule)`: the load / compute split, one `wsched.partition.Partition`
  with the workload's own payload, and `describe(partition)` to print it;
- `build_loops(None, ctx)`: the partition's two loop nests (producer loads, consumer compute),
  single-buffered and unsynchronised;
- `extra_passes`: its own steps, run after the shared wgmma protocol is in place;
- `epilogue(kernel, ctx)`: what the consumers do after the k loop (the stores);
- `late_passes`: its own steps on the whole tile's work, run after the epilogue (matmul's
  ping-pong hands each tile to one warpgroup);
- `variants(fusion, schedule)`: other default schedules a call switches to by shape and SM count
  (`wsched/dispatch.py`), each with its rule; none by default.

The shared passes never ask which workload they run: they read the IR and the channels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterator

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext, Step
from wsched.partition import Partition
from wsched.schedule import Schedule, ScheduleError

if TYPE_CHECKING:
    from wsched.dispatch import Variant


class Workload(ABC):
    name: str
    schedule_type: type[Schedule]
    extra_passes: tuple[Step, ...] = ()
    late_passes: tuple[Step, ...] = ()
    # The workload's own functions, set by each subclass as `staticmethod`s:
    split: Callable[["Workload", object, Schedule], Partition]      # (workload, fusion, schedule)
    describe: Callable[[Partition], str]
    build_loops: Callable[[None, LoweringContext], ir.Kernel]
    epilogue: Callable[[ir.Kernel, LoweringContext], ir.Kernel]

    @abstractmethod
    def matches(self, fusion) -> bool: ...

    @abstractmethod
    def mismatch(self, fusion) -> str:
        """Why this workload does not take `fusion` (for the error naming every workload)."""

    @abstractmethod
    def default_schedule(self, fusion, **overrides) -> Schedule: ...

    @abstractmethod
    def schedule_space(self, fusion) -> Iterator[Schedule]: ...

    def variants(self, fusion, schedule: Schedule) -> tuple["Variant", ...]:
        """Schedules that `ws.compile(fusion)` (no schedule, no overrides) switches to per call
        instead of the default `schedule`, each with the rule that picks it."""
        return ()

    def lighter(self, fusion, schedule: Schedule) -> tuple[Schedule, ...]:
        """Schedules to build instead of `schedule`, one of the schedules the compiler picks (the
        default, a per-call variant), where ptxas spills its registers, lightest last
        (`kernel.build_without_spills`). None by default."""
        return ()

    def _narrower(self, fusion, schedule: Schedule, narrowest: int, **keep) -> tuple[Schedule, ...]:
        """`lighter`'s usual answer: the default schedule with `keep` and the tile of `schedule`,
        first with no MMA kept in flight (one accumulator's worth of registers fewer live), then
        with half and a quarter of the tile's width down to `narrowest` (as in flight as
        `schedule`, then not); each kept only where the workload takes it for the fusion."""
        bm, bn, bk = schedule.tile
        tried = [(bn, 0)] if schedule.mma_inflight else []
        tried += [(width, inflight) for width in (bn // 2, bn // 4) if width >= narrowest
                  for inflight in dict.fromkeys((schedule.mma_inflight, 0))]
        found = (self.taken(fusion, tile=(bm, width, bk), mma_inflight=inflight, **keep) for width, inflight in tried)
        return tuple(s for s in found if s is not None)

    def taken(self, fusion, **overrides) -> Schedule | None:
        """The default schedule with `overrides` if the workload takes it for the fusion (it
        validates and partitions the fusion), else None."""
        try:
            schedule = self.default_schedule(fusion, **overrides)
            self.partition(fusion, schedule)
        except ScheduleError:
            return None
        return schedule

    def check_values(self, partition: Partition, tensors: dict) -> None:
        """Check the values of inputs the kernel indexes with (`tensors`: kernel param name ->
        tensor), raising FusionError: the simulator calls it on every run, a GPU call with
        WSCHED_CHECK_INPUTS=1. None by default."""

    def partition(self, fusion, schedule: Schedule) -> Partition:
        if not isinstance(schedule, self.schedule_type):
            raise ScheduleError(f"{fusion.name} is taken by the {self.name} workload; its schedule must be a "
                                f"{self.schedule_type.__name__}, not {type(schedule).__name__}")
        return self.split(self, fusion, schedule)

    def __repr__(self) -> str:
        return f"<workload {self.name}>"
