"""Timeline events of a kernel run: which statements are stamped, the events they make, and the
builder that turns one warpgroup's stamps into events. One vocabulary for both sources:

* the simulator (`simulate(..., trace=True)`, `traced_machine.TracingMachine`) stamps its
  logical clock, the scheduler's step count, at the statements `probe_for` names;
* the instrumented CUDA build (`codegen/emit_trace.py`) stamps `%globaltimer` / `%clock` at the
  same statements, and `wsched.timeline` feeds the stamps it reads back through `TraceBuilder`.

A probed statement is a span (stamped before and after: waits, barriers, stores) or an instant
(stamped at issue: arrivals, TMA and wgmma issue, commits). The builder folds wgmma issue /
commit / wait into one `wgmma` span per commit group, from its first issue to the end of the
`wgmma.wait` that retires it, which is how long the tensor cores may be busy with it. A TMA load
is an instant on the GPU (its completion is seen only as the end of a consumer's wait); the
simulator knows when it lands and makes it a span.

    mbarrier.wait full[s] phase(ph)     span     "wait full[2]"       value: the barrier index
    mbarrier.arrive empty[prev_s]       instant  "arrive empty[1]"
    tma.load A[s] <- ... bar(full[s])   instant  "tma.load A → full[2]"  (simulator: issue → landed)
    wgmma.mma / commit / wgmma.wait 1   span     "wgmma acc"          per commit group
    for tile in persistent(...)         instant  "tile 5"             at every iteration
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .. import ir

# Event categories.
WAIT = "wait"                  # mbarrier.wait: blocked until a phase completes
ARRIVE = "arrive"              # mbarrier.arrive / arrive_expect_tx: a release
BAR_SYNC = "bar.sync"          # named barrier
TMA_LOAD = "tma.load"          # TMA issue (simulator: issue -> landed)
TMA_STORE = "tma.store"        # TMA store issue
TMA_WAIT = "tma.wait"          # waiting for TMA stores (or their smem reads)
WGMMA = "wgmma"                # one commit group of wgmmas in flight
WGMMA_ISSUE = "wgmma.issue"    # stamps folded into WGMMA spans (not events themselves)
WGMMA_COMMIT = "wgmma.commit"
WGMMA_WAIT = "wgmma.wait"      # waiting for wgmma groups to retire
STORE = "store"                # tile.store / tile.store_smem (the epilogue's writes)
TILE = "tile"                  # a CTA starts a tile of its persistent loop

# Categories that run beside the warpgroup's own instruction stream (drawn on their own row).
ASYNC_CATEGORIES = frozenset({WGMMA, TMA_LOAD})

BEGIN, END, AT = "begin", "end", "at"


@dataclass(frozen=True)
class Probe:
    """How one statement is stamped: its event category, span or instant, a label with `{}` for the
    value, and the expression whose value is stamped with it (None: no value)."""

    category: str
    span: bool
    label: str
    value: ir.Expr | None = None


def probe_for(s: ir.Stmt) -> Probe | None:
    """The probe of a statement inside a role, or None if it is not stamped."""
    if isinstance(s, ir.MbarrierWait):
        return Probe(WAIT, True, f"wait {s.bar.barrier}[{{}}]", s.bar.index)
    if isinstance(s, ir.MbarrierArrive):
        return Probe(ARRIVE, False, f"arrive {s.bar.barrier}[{{}}]", s.bar.index)
    if isinstance(s, ir.MbarrierArriveExpectTx):
        return Probe(ARRIVE, False, f"arrive_expect_tx {s.bar.barrier}[{{}}]", s.bar.index)
    if isinstance(s, ir.NamedBarrierSync):
        return Probe(BAR_SYNC, True, "bar.sync {}", s.id)
    if isinstance(s, ir.TmaLoad):
        return Probe(TMA_LOAD, False, f"tma.load {s.dst.buffer} → {s.bar.barrier}[{{}}]", s.bar.index)
    if isinstance(s, ir.TmaStore):
        return Probe(TMA_STORE, False, f"tma.store {s.src.buffer} → {s.tensor}")
    if isinstance(s, ir.TmaWait):
        return Probe(TMA_WAIT, True, f"tma.wait{'.read' if s.read else ''} {s.pending}")
    if isinstance(s, ir.Wgmma):
        return Probe(WGMMA_ISSUE, False, f"wgmma {s.acc}")
    if isinstance(s, ir.WgmmaCommit):
        return Probe(WGMMA_COMMIT, False, "wgmma.commit")
    if isinstance(s, ir.WgmmaWait):
        return Probe(WGMMA_WAIT, True, "wgmma.wait {}", ir.IntConst(s.pending))
    if isinstance(s, ir.TileStoreGlobal):
        return Probe(STORE, True, f"tile.store {s.tensor}")
    if isinstance(s, ir.TileStoreSmem):
        return Probe(STORE, True, f"tile.store_smem {s.dst.buffer}")
    if isinstance(s, ir.For) and s.iteration in ("persistent", "dynamic"):
        return Probe(TILE, False, "tile {}", ir.Var(s.var))
    return None


@dataclass(frozen=True)
class Site:
    """One place a warpgroup stamps the clock: a probed statement's begin, end or instant.
    `statement` pairs a span's begin with its end; `line` is the statement's IR line (if known)."""

    category: str
    edge: str
    label: str
    statement: int
    line: int | None = None


def sites_of(probe: Probe, statement: int, line: int | None = None) -> tuple[Site, ...]:
    """(begin, end) of a span probe, (at,) of an instant."""
    if probe.span:
        return (Site(probe.category, BEGIN, probe.label, statement, line),
                Site(probe.category, END, probe.label, statement, line))
    return (Site(probe.category, AT, probe.label, statement, line),)


@dataclass(frozen=True)
class TraceEvent:
    """One span (`end` > `begin`) or instant (`end` == `begin`) of one warpgroup of one CTA,
    on the trace's clock. `args`: what else is known (IR line, loop variables, the value)."""

    cta: int
    role: str
    warpgroup: int          # index within the role
    category: str
    label: str
    begin: float
    end: float
    args: dict = field(default_factory=dict, compare=False)

    @property
    def duration(self) -> float:
        return self.end - self.begin


@dataclass
class Trace:
    """The events of one kernel run. `clock`: "steps" (the simulator's scheduler steps) or "ns"
    (GPU, since the first stamp). `roles`: (name, first warpgroup, warpgroups) in CTA order;
    `sms`: CTA -> SM it ran on (the simulator: the resident slot)."""

    kernel: str
    source: str
    clock: str
    roles: tuple[tuple[str, int, int], ...]
    events: list[TraceEvent]
    sms: dict[int, int] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def ctas(self) -> list[int]:
        return sorted({e.cta for e in self.events})

    def track(self, cta: int, role: str, warpgroup: int) -> list[TraceEvent]:
        return [e for e in self.events if (e.cta, e.role, e.warpgroup) == (cta, role, warpgroup)]


def roles_of(kernel: ir.Kernel) -> tuple[tuple[str, int, int], ...]:
    out, first = [], 0
    for role in kernel.roles():
        out.append((role.name, first, role.warpgroups))
        first += role.warpgroups
    return tuple(out)


class _Track:
    __slots__ = ("open", "wgmma_open", "wgmma_groups")

    def __init__(self):
        self.open: dict[int, tuple[float, str, dict]] = {}   # statement -> (begin, label, args)
        self.wgmma_open: tuple | None = None     # (first issue, label, args) since the last commit
        self.wgmma_groups: deque = deque()        # committed groups, oldest first


class TraceBuilder:
    """Turns stamps, in time order per warpgroup, into `TraceEvent`s."""

    def __init__(self):
        self.events: list[TraceEvent] = []
        self._tracks: dict[tuple[int, str, int], _Track] = {}

    def stamp(self, cta: int, role: str, warpgroup: int, site: Site, value: int | None, t: float,
              args: dict | None = None) -> None:
        key = (cta, role, warpgroup)
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track()
        label = site.label.format(value) if value is not None else site.label
        if site.edge == BEGIN:
            track.open[site.statement] = (t, label, args or {})
            return
        if site.edge == END:
            opened = track.open.pop(site.statement, None)
            if opened is None:
                return   # its begin was not recorded (a GPU buffer that filled up)
            begin, label, args = opened
            self.events.append(TraceEvent(cta, role, warpgroup, site.category, label, begin, t, args))
            if site.category == WGMMA_WAIT:
                self._retire_wgmma(key, track, value or 0, t)
            return
        if site.category == WGMMA_ISSUE:
            if track.wgmma_open is None:
                track.wgmma_open = (t, label, args or {})
        elif site.category == WGMMA_COMMIT:   # a group with no issue stamp (GPU) starts here
            track.wgmma_groups.append(track.wgmma_open or (t, "wgmma", args or {}))
            track.wgmma_open = None
        else:
            self.events.append(TraceEvent(cta, role, warpgroup, site.category, label, t, t, args or {}))

    def _retire_wgmma(self, key, track: _Track, pending: int, t: float) -> None:
        while len(track.wgmma_groups) > pending:
            begin, label, args = track.wgmma_groups.popleft()
            self.events.append(TraceEvent(*key, WGMMA, label, begin, t, args))

    def add(self, event: TraceEvent) -> None:
        self.events.append(event)

    def finish(self) -> list[TraceEvent]:
        """The events, ordered by CTA, warpgroup and time."""
        return sorted(self.events, key=lambda e: (e.cta, e.role, e.warpgroup, e.begin, e.end))
