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
    def kind(self) -> str:
        return self.partition.kind

    @property
    def channel(self) -> Channel:
        """The operand channel of a matmul (its only one)."""
        return self.partition.channels[0]

    def channels(self, level: str | None = None) -> tuple[Channel, ...]:
        return tuple(c for c in self.partition.channels if level is None or c.level == level)


# Names the passes agree on (one place, so a pass never guesses another pass's spelling).
PRODUCER = "producer"
CONSUMER = "consumer"
TILE_VAR = "tile"
K_VAR = "k"
ACC = "acc"
K_BASE = "k_base"      # attention: kv iterations before this tile (the ring counter's base)
K_COUNT = "kv_tiles"   # attention: kv blocks of this tile (varies with the causal diagonal)
