"""What one simulation did: `SimReport`, the counters the machine fills in."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SimReport:
    """What one simulation did: steps taken, CTAs run, and event counters; with
    `simulate(..., trace=True)` also the timeline (`trace.Trace`) of every warpgroup."""

    steps: int = 0
    num_ctas: int = 0
    tma_loads: int = 0
    tma_stores: int = 0
    tma_bytes_loaded: int = 0
    tma_bytes_stored: int = 0
    wgmmas: int = 0
    barrier_phases: int = 0
    named_barrier_syncs: int = 0
    trace: object = field(default=None, repr=False, compare=False)

    @property
    def counters(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("steps", "num_ctas", "trace")}
