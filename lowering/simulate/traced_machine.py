"""The simulator with a timeline (`simulate(..., trace=True)`): a `Machine` whose probed
statements (`trace.probe_for`) stamp its logical clock into a `TraceBuilder`.

The clock is the number of scheduling steps so far: every step the scheduler draws one random
number to pick a warpgroup or an asynchronous operation, so counting the draws counts steps
without touching the untraced machine's loop. The draws, and so the interleaving, are the same
with and without tracing (same seed, same run). Only statements inside roles are stamped; a
span opens when its statement first runs and closes when the warpgroup moves past it (a wait
that passes at once is a span of length 0). A TMA load is a span from its issue to the step it
lands (a multicast: one span per CTA it writes into, on the issuer's row, labelled with the
peer's CTA)."""

from __future__ import annotations

import random

from ..evaluate import compile_expr
from .errors import SimulationError
from .machine import Machine
from .report import SimReport
from .state import Co, Node
from .trace import BEGIN, TILE, TMA_LOAD, Trace, TraceBuilder, TraceEvent, probe_for, roles_of, sites_of


class _CountingRandom(random.Random):
    """random.Random that counts its draws (the scheduler draws once per step)."""

    def __init__(self, seed):
        self.draws = 0
        super().__init__(seed)

    def random(self) -> float:
        self.draws += 1
        return super().random()


class TracingMachine(Machine):
    """A Machine that records a `Trace` of every warpgroup inside a role (`report.trace`); a
    SimulationError it raises carries the trace up to the failure as `error.trace`."""

    def __init__(self, kernel, args, num_sms: int, seed: int, max_steps: int):
        self._probed = 0                 # probed statements so far (pairs a span's begin and end)
        self.builder = TraceBuilder()    # before Machine.__init__ compiles the statements
        self._loads: dict = {}           # TmaLoadOp in flight -> (cta, role, wg, label, issued at, args)
        super().__init__(kernel, args, num_sms, seed, max_steps)
        self.rng = _CountingRandom(seed)

    @property
    def clock(self) -> int:
        return self.rng.draws

    def run(self) -> SimReport:
        try:
            report = super().run()
        except SimulationError as error:
            error.trace = self._trace()
            raise
        report.trace = self._trace()
        return report

    def _trace(self) -> Trace:
        return Trace(self.kernel.name, "simulator", "steps", roles_of(self.kernel), self.builder.finish(),
                     sms={cta: cta % self.num_sms for cta in range(self.grid)},
                     meta={"grid": self.grid, "num_sms": self.num_sms, "steps": self.clock})

    # -- stamping ------------------------------------------------------------------------------
    def _compile_stmt(self, s, in_role: bool, in_elect: bool, path) -> Node:
        node = super()._compile_stmt(s, in_role, in_elect, path)
        probe = probe_for(s) if in_role else None
        if probe is not None and probe.category != TILE:   # tiles: `_for_loop`
            self._probed += 1
            sites = sites_of(probe, self._probed, node.line)
            value = compile_expr(probe.value) if probe.value is not None else None
            node.fn = self._stamped(node.fn, sites, value)
        return node

    def _where(self, co: Co, node: Node) -> tuple[int, str, int, dict]:
        env = co.env
        args = {"line": node.line, **{var: env[var] for var in co.loops}}
        return co.cta.cta_id, co.role, env["wg"], args

    def _stamped(self, handler, sites, value):
        stamp = self.builder.stamp

        def run(co: Co, node: Node):
            cta, role, wg, args = self._where(co, node)
            v = value(co.env) if value is not None else None
            if sites[0].category == TMA_LOAD:    # a span from issue to landing, closed by land_tma_load
                issued = len(self.async_ops)
                result = handler(co, node)
                label = sites[0].label.format(v)
                for op in self.async_ops[issued:]:   # one per CTA a multicast writes into
                    into = label if op.cta is co.cta else f"{label} (CTA {op.cta.cta_id})"
                    self._loads[op] = (cta, role, wg, into, self.clock, args)
                return result
            if sites[0].edge != BEGIN:
                stamp(cta, role, wg, sites[0], v, self.clock, args)
                return handler(co, node)
            stamp(cta, role, wg, sites[0], v, self.clock, args)
            result = handler(co, node)
            if result is None:
                stamp(cta, role, wg, sites[1], v, self.clock)
                return None
            return self._close(result, (cta, role, wg, sites[1], v))
        return run

    def _close(self, blocked, stamp_args):
        yield from blocked
        self.builder.stamp(*stamp_args, self.clock)

    def land_tma_load(self, op) -> None:
        super().land_tma_load(op)
        issued = self._loads.pop(op, None)
        if issued is not None:
            cta, role, wg, label, begin, args = issued
            self.builder.add(TraceEvent(cta, role, wg, TMA_LOAD, label, begin, self.clock, args))

    def _for_loop(self, co: Co, node: Node, iterations):
        probe = probe_for(node.stmt) if co.role is not None else None
        if probe is None:
            return super()._for_loop(co, node, iterations)
        return super()._for_loop(co, node, self._tiles(self._where(co, node), node, probe, iterations))

    def _tiles(self, where, node: Node, probe, iterations):
        """The persistent loop's iterations, each stamped as a `tile` instant as it starts."""
        cta, role, wg, args = where
        for i in iterations:
            self.builder.add(TraceEvent(cta, role, wg, probe.category, probe.label.format(i), self.clock, self.clock,
                                        {**args, node.stmt.var: i}))
            yield i
