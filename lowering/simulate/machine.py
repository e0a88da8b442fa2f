"""The simulator's machine: CTAs launched in waves of `num_sms` (the CTAs of a cluster together),
one coroutine (generator) per warpgroup, the seeded scheduler that steps coroutines and
asynchronous operations, deadlock and livelock reports, CTA exit (with its checks), statement
execution and the control-flow handlers. The handlers of the other statements come from one
mixin per concern (`prepare`, `sync`, `async_proxy`, `tiles`); a node's handler is the method
`_h_<Stmt class name>` (`prepare` picks another for a statement on a peer CTA)."""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Callable, Iterator

import torch

from wsched.target import SETMAXNREG_MAX, SETMAXNREG_MIN, SETMAXNREG_STEP, TORCH_DTYPES, WARPGROUP_THREADS

from .. import ir
from ..evaluate import INT_MAX, ExprError, Undefined, compile_expr
from ..printer import expr_text
from .async_proxy import AsyncHandlers
from .errors import (PRODUCER_TAIL, DeadlockError, ProtocolError, SimulationError, SimulatorInternalError,
                     check_verified)
from .global_sync import GlobalSyncHandlers
from .prepare import KernelPreparation
from .report import SimReport
from .state import Cell, Cluster, Co, Cta, Node, TmaLoadOp
from .sync import BarrierHandlers
from .tiles import TileHandlers


class _ReturnSignal(Exception):
    pass


class Machine(KernelPreparation, BarrierHandlers, AsyncHandlers, TileHandlers, GlobalSyncHandlers):
    """One simulation: the prepared kernel, the resident CTAs and their coroutines, the pending
    asynchronous operations, and the report."""

    def __init__(self, kernel: ir.Kernel, args: dict, num_sms: int, seed: int, max_steps: int):
        self.kernel = kernel
        self.num_sms = num_sms
        self.max_steps = max_steps
        self.rng = random.Random(seed)
        self.report = SimReport()
        self.runnable: list[Co] = []
        self.async_ops: list = []
        self.global_writes: dict = {}     # tensor -> (writer record per element, records): global_sync
        self.atomic_know: dict = {}       # (tensor, coords) -> clocks released there by atomics
        self._bind_args(args)
        # The verifier keeps a cluster along x (cluster[1:] == (1, 1)) and at most the portable size.
        n = self.cluster_size = kernel.cluster[0]
        check_verified(tuple(kernel.cluster[1:]) == (1, 1) and n >= 1, "a cluster is n consecutive CTAs along x")
        if num_sms < n:   # before the grid, which a cluster kernel sizes by num_sms / n
            raise SimulationError(f"num_sms = {num_sms} is less than the cluster cluster({n}, 1, 1): a cluster's "
                                  f"{n} CTAs are resident at once, one per SM")
        genv = dict(self.scalars, num_sms=num_sms)
        try:
            grid = compile_expr(kernel.grid)(genv)
        except Undefined:
            raise SimulatorInternalError("the verifier should have rejected this kernel: the grid reads "
                                         "scalar params and num_sms only") from None
        except ExprError as error:
            raise SimulationError(f"grid {expr_text(kernel.grid)} has no value with these arguments: "
                                  f"{error}") from None
        if type(grid) is not int or grid < 1:
            raise SimulationError(f"grid {expr_text(kernel.grid)} = {grid!r}: need a positive integer")
        self.grid = grid
        self.report.num_ctas = grid
        if grid % n:
            shown = expr_text(kernel.grid)
            shown = shown if shown == str(grid) else f"{shown} = {grid}"
            raise SimulationError(f"grid {shown} is not a multiple of the cluster "
                                  f"cluster({n}, 1, 1): a cluster is {n} consecutive CTAs, so the grid must be "
                                  f"a whole number of clusters")
        self.warpgroups = kernel.threads // WARPGROUP_THREADS
        self.role_start: dict[int, int] = {}
        start = 0
        for role in kernel.roles():
            self.role_start[id(role)] = start
            start += role.warpgroups
        self.mutable = {s.name for s in ir.walk(kernel.body) if isinstance(s, ir.Let) and s.mutable}
        self.buffers = {d.name: d for d in kernel.smem}
        self.barrier_decls = {b.name: b for b in kernel.barriers}
        self.cell_depth = {d.name: 0 for d in kernel.smem}
        self.body = self._compile_body()

    # -- CTAs and the scheduler --------------------------------------------------------------
    def _launch_ready(self) -> None:
        """Make the waiting clusters resident while each finds a free SM for every CTA of it."""
        waiting, resident, n = self.waiting, self.resident, self.cluster_size
        while waiting and len(resident) + n <= self.num_sms:
            cluster = Cluster()
            for rank in range(n):
                cta = self._launch(waiting.popleft(), cluster, rank)
                cluster.ctas.append(cta)
                cluster.live += cta.live
                resident.append(cta)

    def _launch(self, cta_id: int, cluster: Cluster, rank: int) -> Cta:
        cta = Cta()
        cta.cta_id = cta_id
        cta.cluster, cta.rank, cta.exited = cluster, rank, False
        cta.peer_arrivals, cta.peer_loads = {}, {}
        cta.smem, cta.cells = {}, {}
        for d in self.kernel.smem:
            tdt = TORCH_DTYPES[d.dtype]
            # Never-written smem reads as NaN so a wrong box mapping shows in the numbers.
            cta.smem[d.name] = torch.full(d.shape, math.nan, dtype=tdt) if tdt.is_floating_point \
                else torch.zeros(d.shape, dtype=tdt)
            cells = math.prod(d.shape[:self.cell_depth[d.name]]) * self.cell_splits.get(d.name, 1)
            cta.cells[d.name] = [Cell() for _ in range(cells)]
        cta.bars = {b.name: [None] * b.slots for b in self.kernel.barriers}
        cta.named = {}
        cta.named_last = {}
        cta.sync_gen = None
        cta.loads_inflight = 0
        cta.cos = []
        for gid in range(self.warpgroups):
            env = dict(self.scalars)
            env["cta_id"] = cta_id
            env["num_ctas"] = self.grid
            co = Co(cta, gid, env)
            co.gen = self._main(co)
            cta.cos.append(co)
            self.runnable.append(co)
        cta.live = len(cta.cos)
        return cta

    def run(self) -> SimReport:
        self.waiting = deque(range(self.grid))
        self.resident: list[Cta] = []
        self._launch_ready()
        runnable, async_ops = self.runnable, self.async_ops
        rand = self.rng.random
        steps, max_steps = 0, self.max_steps
        while True:
            nr = len(runnable)
            n = nr + len(async_ops)
            if n == 0:
                if self.resident or self.waiting:
                    raise DeadlockError(self._deadlock_text(steps))
                break
            steps += 1
            if steps > max_steps:
                self.report.steps = steps - 1
                raise DeadlockError(self._livelock_text(max_steps))
            r = int(rand() * n)
            if r < nr:
                co = runnable[r]
                try:
                    next(co.gen)
                except StopIteration:
                    last = runnable.pop()
                    if r < len(runnable):
                        runnable[r] = last
                    self._finish(co)
                    continue
                if co.parked:
                    last = runnable.pop()
                    if r < len(runnable):
                        runnable[r] = last
            else:
                i = r - nr
                if async_ops[i].advance(self):
                    last = async_ops.pop()
                    if i < len(async_ops):
                        async_ops[i] = last
        self.report.steps = steps
        self.check_zeroed_workspaces()
        return self.report

    def wake(self, waiters: list) -> None:
        for co in waiters:
            if co.parked:
                co.parked = False
                self.runnable.append(co)
        waiters.clear()

    @staticmethod
    def _park(co: Co, waiters: list, describe: Callable[[], str]) -> None:
        co.parked = True
        co.block = describe
        waiters.append(co)

    def _main(self, co: Co) -> Iterator[None]:
        try:
            yield from self._exec(co, self.body)
        except _ReturnSignal:
            pass
        self._check_no_pending_wgmma(co, "ended")

    def _finish(self, co: Co) -> None:
        co.done = True
        unwaited = [r for g in co.bulk_groups + [co.bulk_open] for op in g for r in op.reads if r.pending]
        if unwaited:
            raise ProtocolError(f"CTA {co.cta.cta_id} {co.label} exited while {len(unwaited)} smem region(s) "
                                f"may still be read by its TMA stores (missing tma.wait.read 0 / tma.wait 0 "
                                f"before the end): first store {unwaited[0].ctx}")
        cta = co.cta
        cta.live -= 1
        gen = cta.sync_gen
        if gen is not None and gen.count and gen.count >= cta.live:
            self._release_round(cta)
        cluster = cta.cluster
        cluster.live -= 1
        gen = cluster.sync_gen
        if gen is not None and gen.count and gen.count >= cluster.live:
            self._release_round(cluster)
        if cta.live == 0:
            if cta.loads_inflight:
                self._check_no_peer_load_inflight(cta)
                raise ProtocolError(f"CTA {cta.cta_id} exited with {cta.loads_inflight} TMA load(s) still in "
                                    f"flight into its shared memory")
            for bid, gen in sorted(cta.named.items()):
                raise ProtocolError(f"CTA {cta.cta_id} exited with named barrier {bid} part way through a round: "
                                    f"{gen.count} of its {gen.threads} threads arrived (first {gen.arrivals[0][2]}) "
                                    f"and nobody completes it; every bar.arrive needs its bar.sync (a token handed "
                                    f"between warpgroups is taken back before the end)")
            if cta.peer_arrivals or cta.peer_loads:
                self._check_peers_known(cta)
            cta.exited = True
            self.resident.remove(cta)
            if self.waiting:
                self._launch_ready()

    def _check_no_peer_load_inflight(self, cta: Cta) -> None:
        """A peer's multicast still in flight into `cta` as it exits: the exit check's message."""
        for op in self.async_ops:
            if isinstance(op, TmaLoadOp) and op.cta is cta and op.ctx.cta_id != cta.cta_id:
                label = cta.peer_loads[op.bar][2]
                raise ProtocolError(f"CTA {cta.cta_id} exits before it knows of the multicast into its smem {label} "
                                    f"by {op.ctx}, which is still in flight: {PRODUCER_TAIL}")

    @staticmethod
    def _check_peers_known(cta: Cta) -> None:
        """A CTA of a cluster exits knowing (happens-before, over what all its warpgroups and
        elected threads know) the completion of the phase of every arrival a peer made on its
        barriers and of every multicast a peer landed in its smem: otherwise a peer may still be
        arriving on or writing into it after it exits, which a lucky timing hides."""
        known: dict = {}
        for co in cta.cos:
            for agent in (co, co.lane):
                for key, value in agent.vc.items():
                    if known.get(key, 0) < value:
                        known[key] = value
        for bar, (phase, ctx, label) in cta.peer_arrivals.items():
            if known.get(bar, 0) <= phase:
                raise ProtocolError(f"CTA {cta.cta_id} exits before it knows of the arrival on its barrier {label} "
                                    f"by {ctx} (it joins phase {phase}, which no warpgroup of CTA {cta.cta_id} "
                                    f"waited for): {PRODUCER_TAIL}")
        for bar, (phase, ctx, label) in cta.peer_loads.items():
            if known.get(bar, 0) <= phase:
                raise ProtocolError(f"CTA {cta.cta_id} exits before it knows of the multicast into its smem {label} "
                                    f"by {ctx} (it completes phase {phase} of its barrier {bar.label}, which no "
                                    f"warpgroup of CTA {cta.cta_id} waited for): {PRODUCER_TAIL}")

    def _check_no_pending_wgmma(self, co: Co, how: str) -> None:
        if co.wg_open or co.wg_groups:
            n_open = len(co.wg_open)
            raise ProtocolError(
                f"CTA {co.cta.cta_id} {co.label} {how} with {len(co.wg_groups)} wgmma group(s) still in flight"
                f"{f' and {n_open} wgmma.mma never committed' if n_open else ''} "
                f"(missing wgmma.commit / wgmma.wait 0 before the end of the role)")

    # -- messages ----------------------------------------------------------------------------
    def _blocked_lines(self) -> list[str]:
        lines = []
        for cta in self.resident:
            for co in cta.cos:
                if co.done:
                    continue
                if co.parked:
                    lines.append(f"CTA {cta.cta_id} {co.label}: {co.block()}")
                else:
                    lines.append(f"{co.where()} (runnable)")
        return lines

    def _deadlock_text(self, steps: int) -> str:
        head = (f"deadlock after {steps} steps: no warpgroup can run and no TMA operation is in flight"
                + (f" ({len(self.waiting)} CTA(s) not started)" if self.waiting else "") + "; blocked:")
        return "\n  ".join([head] + self._blocked_lines())

    def _livelock_text(self, max_steps: int) -> str:
        head = f"no progress / livelock: stopped after max_steps={max_steps} steps; warpgroups:"
        return "\n  ".join([head] + self._blocked_lines())

    # -- statement execution -----------------------------------------------------------------
    def _exec(self, co: Co, block: tuple[Node, ...]) -> Iterator[None]:
        for node in block:
            if node.leader_only and co.gid:
                continue
            co.node = node
            try:
                r = node.fn(co, node)
            except Undefined as u:
                raise SimulatorInternalError(f"the verifier should have rejected this kernel: {u.name!r} is "
                                             f"not in scope at {co.where(node)}") from None
            except ExprError as x:
                raise ProtocolError(f"{x} in {co.where(node)}") from None
            if r is None:
                yield
            else:
                yield from r

    def _int(self, co: Co, node: Node, value, what: str) -> int:
        if type(value) is not int:
            raise ProtocolError(f"{what} must be an integer, got {value!r} in {co.where(node)}")
        return value

    # control flow and bindings
    def _h_Let(self, co, node):
        co.env[node.stmt.name] = node.ex(co.env)

    def _h_Assign(self, co, node):
        name = node.stmt.name
        check_verified(name in co.env and name in self.mutable, "`set` updates a `var` in scope")
        co.env[name] = node.ex(co.env)

    def _h_For(self, co, node):
        env = co.env
        if node.stmt.iteration == "dynamic":
            return self._dynamic_loop(co, node)
        start, stop, step = (self._int(co, node, f(env), "loop bound") for f in node.ex)
        if step < 1:
            raise ProtocolError(f"loop step is {step}: the CUDA loop `for (int {node.stmt.var} = start; "
                                f"{node.stmt.var} < stop; {node.stmt.var} += step)` counts up; use a step >= 1: "
                                f"{co.where(node)}")
        iterations = range(start, stop, step)
        if iterations and iterations[-1] + step > INT_MAX:
            raise ProtocolError(f"integer overflow: the loop variable {node.stmt.var} steps from {iterations[-1]} "
                                f"to {iterations[-1] + step}, past the CUDA's 32-bit int maximum {INT_MAX} "
                                f"(signed overflow is undefined on the GPU): {co.where(node)}")
        return self._for_loop(co, node, iterations)

    def _dynamic_loop(self, co, node):
        """`for tile in dynamic(start, stop, next)`: while tile < stop, then tile = next."""
        env, var = co.env, node.stmt.var
        start_f, stop_f, next_f = node.ex

        def iterations():
            value = self._int(co, node, start_f(env), "loop start")
            while value < self._int(co, node, stop_f(env), "loop bound"):
                yield value
                value = self._int(co, node, next_f(env), "the dynamic loop's next value")
        return self._for_loop(co, node, iterations())

    def _for_loop(self, co, node, iterations):
        env, var, block, run = co.env, node.stmt.var, node.block, self._exec
        co.loops.append(var)
        for i in iterations:
            env[var] = i
            yield from run(co, block)
        co.loops.pop()

    def _h_If(self, co, node):
        return self._exec(co, node.block if node.ex(co.env) else node.orelse)

    def _h_Role(self, co, node):
        start, role = node.info, node.stmt
        if not start <= co.gid < start + role.warpgroups:
            return ()
        return self._role(co, node, co.gid - start)

    def _role(self, co, node, wg):
        role = node.stmt
        co.role, co.label = role.name, f"{role.name} wg{wg}"
        co.env["wg"] = wg
        yield from self._exec(co, node.block)
        self._check_no_pending_wgmma(co, f"finished role {role.name}")
        del co.env["wg"]
        co.role, co.label = None, f"wg{co.gid}"

    def _h_ElectOne(self, co, node):
        return self._elect(co, node)

    def _elect(self, co, node):
        # The elected thread is one of the warpgroup's threads: it knows what all of them learned
        # (their waits), but not what the others wrote, until a barrier of the warpgroup.
        lane = co.lane
        own = lane.vc.get(co, 0)
        lane.acquire(co.vc)
        lane.vc[co] = own
        co.in_elect += 1
        yield from self._exec(co, node.block)
        co.in_elect -= 1

    def _h_Return(self, co, node):
        raise _ReturnSignal()

    def _h_Setmaxnreg(self, co, node):
        s = node.stmt
        check_verified(s.action in ir.SETMAXNREG_ACTIONS and s.registers % SETMAXNREG_STEP == 0
                       and SETMAXNREG_MIN <= s.registers <= SETMAXNREG_MAX and co.role is not None,
                       "setmaxnreg is inside a role, with an action and a count setmaxnreg accepts")
        role = next(r for r in self.kernel.roles() if r.name == co.role)
        check_verified(role.registers == s.registers, "setmaxnreg sets its role's registers")
