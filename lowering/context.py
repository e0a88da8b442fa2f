"""What the lowering passes know besides the kernel: the partition (its channels, its schedule,
the workload that made it), and the shape of one step of the pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from wsched.partition import Channel, Partition
from wsched.schedule import Schedule

from . import ir


@dataclass(frozen=True)
class LoweringContext:
    partition: Partition
    name: str

    @property
    def schedule(self) -> Schedule:
        return self.partition.schedule

    @property
    def workload(self):
        """The workload plug-in (wsched.workloads) that partitioned the fusion."""
        return self.partition.workload

    def channels(self, level: str | None = None) -> tuple[Channel, ...]:
        return tuple(c for c in self.partition.channels if level is None or c.level == level)


def always(schedule: Schedule) -> bool:
    return True


@dataclass(frozen=True)
class Step:
    """One step of a pipeline route: a pass `(kernel, context) -> kernel` under a name (the key
    of `kernel.ir_after`, `WSCHED_PRINT_IR`), whether the load/compute contract holds after it,
    and the schedules it runs for (a step that would do nothing is not on the route)."""

    name: str
    run: Callable[[ir.Kernel | None, LoweringContext], ir.Kernel]
    contract: bool
    when: Callable[[Schedule], bool] = always
    condition: str = ""            # `when` in words, for printed routes
