"""The instrumented build: `emit_kernel(kernel, trace=True)` stamps the clock around the
statements the timeline probes (`lowering/simulate/trace.py`: waits, arrivals, TMA and wgmma
issue, wgmma and TMA waits, stores, each tile of the persistent loop) into a global buffer.
With `trace=False` (the default) none of this runs and the source is what it always was.

    mbarrier.wait full[s] phase(ph)     if (threadIdx.x % 128 == 0) {
                                          wsp_trace.stamp<0>(3, s);      // site 3: begin of "wait full[{}]"
                                        }
                                        wsp::mbar_wait(&full_bar[s], ph);
                                        if (threadIdx.x % 128 == 0) {
                                          wsp_trace.stamp<0>(4, s);      // site 4: its end
                                        }

A stamp is one record (`include/trace.cuh`): %globaltimer_lo, %clock, the site, the SM and a
value. Statements all of a warpgroup's threads run are stamped by its thread 0 (stream 0);
those inside `elect_one` by the elected thread (stream 1). The kernel takes two more
parameters, `uint4* wsp_trace_buffer` and `int wsp_trace_capacity` (records per stream); the
site table (`EmittedKernel.trace_sites`, site i at index i - 1) says what each stamp was, and
`wsched.timeline` reads the buffer back through the simulator's `TraceBuilder`.
"""

from __future__ import annotations

from wsched.lowering import ir
from wsched.lowering.simulate.trace import TILE, WGMMA_COMMIT, WGMMA_ISSUE, Probe, Site, probe_for, sites_of

from .emit_context import ELECT, KERNEL, Emitter

TRACE_HEADER = "trace.cuh"
BUFFER, CAPACITY, STATE = "wsp_trace_buffer", "wsp_trace_capacity", "wsp_trace"
STREAMS = 2          # per warpgroup: its thread 0, its elected thread
RECORD_WORDS = 4     # uint4 per record
MAX_SITES = 0xFFFF   # the site shares its 32-bit word with the SM id


class TraceEmitter:
    """Collects the site table while `emit.py` spells the kernel and writes the stamps."""

    def __init__(self):
        self.sites: list[Site] = []
        self._statements = 0

    @staticmethod
    def params() -> list[str]:
        return [f"uint4* __restrict__ {BUFFER}", f"const int {CAPACITY}"]

    @staticmethod
    def setup(em: Emitter) -> None:
        em.line(f"// trace: clock stamps of each warpgroup into {BUFFER} (include/{TRACE_HEADER})")
        em.line(f"wsp::Trace {STATE}({BUFFER}, {CAPACITY});")

    def header(self) -> str:
        return (f"//   trace     {BUFFER}: uint4[grid][warpgroups][{STREAMS}][{CAPACITY}], "
                f"{len(self.sites)} stamp sites (include/{TRACE_HEADER})")

    def before(self, em: Emitter, s: ir.Stmt) -> tuple[Probe, tuple[Site, ...]] | None:
        """Stamp the begin (or the instant) of `s` if it is probed; what `after` needs."""
        probe = probe_for(s) if em.level != KERNEL else None
        # Tiles are stamped inside the loop (`tile_start`). A stamp between wgmma.fence and
        # wgmma.mma_async makes ptxas inject a warpgroup.arrive (C7519), so wgmma issue is not
        # stamped and the commit is stamped after it: a group starts at its commit here (the
        # issue before it takes a few cycles).
        if probe is None or probe.category in (TILE, WGMMA_ISSUE):
            return None
        self._statements += 1
        sites = sites_of(probe, self._statements)
        if probe.category != WGMMA_COMMIT:
            self._stamp(em, sites[0], probe)
        return probe, sites

    def after(self, em: Emitter, probed: tuple[Probe, tuple[Site, ...]]) -> None:
        probe, sites = probed
        if probe.category == WGMMA_COMMIT or len(sites) == 2:
            self._stamp(em, sites[-1], probe)

    def tile_start(self, em: Emitter, s: ir.For) -> None:
        """A `tile` instant at the top of each iteration of a persistent loop in a role."""
        probe = probe_for(s) if em.level != KERNEL else None
        if probe is not None:
            self._statements += 1
            self._stamp(em, sites_of(probe, self._statements)[0], probe)

    def _stamp(self, em: Emitter, site: Site, probe: Probe) -> None:
        self.sites.append(site)
        index = len(self.sites)
        assert index <= MAX_SITES, "more stamp sites than a record can name"
        value = em.expr(probe.value) if probe.value is not None else "0"
        stream = 1 if em.level == ELECT else 0
        em.guarded(em.one_thread(), f"{STATE}.stamp<{stream}>({index}, {value});")
