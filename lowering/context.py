"""What the lowering passes know besides the kernel: the partition and its schedule."""

from __future__ import annotations

from dataclasses import dataclass

from wsched.partition import Channel, Partition
from wsched.schedule import Schedule


class LoweringError(ValueError):
    """A pass could not lower the partition with the schedule it was given."""


@dataclass(frozen=True)
class LoweringContext:
    partition: Partition
    name: str

    @property
    def schedule(self) -> Schedule:
        return self.partition.schedule

    @property
    def channel(self) -> Channel:
        return self.partition.channels[0]


# Names the passes agree on (one place, so a pass never guesses another pass's spelling).
PRODUCER = "producer"
CONSUMER = "consumer"
TILE_VAR = "tile"
K_VAR = "k"
ACC = "acc"
