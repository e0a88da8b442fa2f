"""The verifier's checks across roles, after the structural walk (a mixin of
`structure.StructureCheck`): the CTA's thread, register and shared-memory budgets; each role's
setmaxnreg, once at the top of its body, in the direction that takes its warps from the registers
they start with to the role's budget; and each named barrier id counted for exactly the threads
that reach it."""

from __future__ import annotations

from wsched.target import (
    MAX_THREADS, NAMED_BARRIERS, REGISTER_FILE, SETMAXNREG_MIN, SETMAXNREG_STEP, SMEM_LIMIT,
    WARP_THREADS, WARPGROUP_THREADS, launch_registers, register_pool,
)

from .. import ir
from ..evaluate import evaluate
from ..printer import expr_text
from ..spelling import keyword
from .lines import Site, location


class RoleChecks:
    """Needs `self.k` (the kernel) and `self.r` (the report) from the structural walk."""

    def _budgets(self) -> bool:
        """The CTA's budgets; False when the threads exceed the CTA (nothing per warpgroup then)."""
        roles = self.k.roles()
        threads = self.k.threads
        per_wg = WARPGROUP_THREADS          # threads of one warpgroup
        if threads > MAX_THREADS:
            self.r.header(f"the roles add up to {threads} threads ({threads // per_wg} warpgroups); a CTA "
                          f"has at most {MAX_THREADS} threads ({MAX_THREADS // per_wg} warpgroups)")
        used = sum(r.warpgroups * per_wg * r.registers for r in roles)
        pool = register_pool(threads)
        if used > pool:
            terms = " + ".join(f"role {r.name} {r.warpgroups}×{per_wg}×{r.registers}" for r in roles)
            widest = max(roles, key=lambda r: r.warpgroups * r.registers)
            rest = used - widest.warpgroups * per_wg * widest.registers
            fit = (pool - rest) // (widest.warpgroups * per_wg) // SETMAXNREG_STEP * SETMAXNREG_STEP
            hint = (f"lower the registers of a role, e.g. role {widest.name} registers({fit})"
                    if fit >= SETMAXNREG_MIN else "use fewer warpgroups")
            self.r.header(f"register budget exceeded: {terms} = {used} registers, {used - pool} over the "
                          f"{pool} a CTA of {threads} threads holds (setmaxnreg.inc would wait forever); {hint}")
        total = self.k.smem_bytes
        if total > SMEM_LIMIT:
            self.r.header(f"shared memory needs {total} bytes (buffers, barriers and alignment), "
                          f"{total - SMEM_LIMIT} over the {SMEM_LIMIT} bytes ({SMEM_LIMIT // 1024} KB) a CTA "
                          f"can have; use fewer stages or smaller tiles")
        return threads <= MAX_THREADS

    def _register_handoff(self, every: list[Site]) -> None:
        """Each role's setmaxnreg, once at the top of its body, in the direction that takes its
        warps from the registers they start with to the role's budget. A kernel without any
        setmaxnreg (before reg_realloc) keeps the launch share everywhere and is not checked."""
        roles = {site.path: site.stmt for site in every if isinstance(site.stmt, ir.Role)}
        setters: dict[tuple[int, ...], list[Site]] = {path: [] for path in roles}
        for site in every:
            if isinstance(site.stmt, ir.Setmaxnreg) and site.role_path in setters:
                setters[site.role_path].append(site)
        if not any(setters.values()):
            return
        share = launch_registers(self.k.threads)
        start, origin = share, (f"{REGISTER_FILE} registers / {self.k.threads} threads, in steps of "
                                f"{SETMAXNREG_STEP}")
        raised = [s.stmt.registers for found in setters.values() for s in found if s.stmt.action == "inc"]
        if raised and max(raised) < share:
            start, origin = max(raised), (f"ptxas starts the kernel at its largest setmaxnreg.inc target "
                                          f"when that is below the launch share of {share}")
        for path, role in roles.items():
            found = setters[path]
            if not found:
                if role.registers != start:
                    action = "dec" if role.registers < start else "inc"
                    self.r.at(path, f"role {role.name} registers({role.registers}) has no setmaxnreg: its "
                                    f"warps keep the {start} registers per thread they start with ({origin}), "
                                    f"not the {role.registers} of its budget, which the other roles' "
                                    f"setmaxnreg count on; start its body with setmaxnreg.{action} "
                                    f"{role.registers}")
                continue
            first = found[0]
            for extra in found[1:]:
                self.r.at(extra.path, f"a second setmaxnreg in role {role.name} (the first is at IR line "
                                      f"{self.r.line(first.path)}); a role sets its budget once, and two "
                                      f"setmaxnreg without a warpgroup barrier between them are undefined: "
                                      f"remove this one")
            for s in found:
                if len(s.path) != len(path) + 1:
                    self.r.at(s.path, f"setmaxnreg inside {location(self.k, s.path[:-1])}: every warp of the "
                                      f"warpgroup must execute the same setmaxnreg once; put it at the top "
                                      f"of role {role.name}'s body")
            s = first.stmt
            if s.action == "inc" and s.registers < start:
                self.r.at(first.path, f"{keyword(s)} {s.registers} in role {role.name}: its warps start with "
                                      f"{start} registers per thread ({origin}) and .inc can only raise that: "
                                      f"use setmaxnreg.dec {s.registers} (the registers a .dec releases are "
                                      f"what the other roles' setmaxnreg.inc waits for)")
            elif s.action == "dec" and s.registers > start:
                self.r.at(first.path, f"{keyword(s)} {s.registers} in role {role.name}: its warps start with "
                                      f"{start} registers per thread ({origin}) and .dec can only lower that "
                                      f"(ptxas rejects it): use setmaxnreg.inc {s.registers}")

    def _named_barrier_groups(self, every: list[Site]) -> None:
        """Each named barrier id counts exactly the threads that reach it: a count below them
        lets the barrier complete with some of them only (it orders nothing), a count above them
        never completes. Ids computed from `wg` and branches on `wg` are followed per warpgroup;
        a barrier whose id depends on anything else leaves the whole check undecided."""
        names = {site.path: site.stmt.name for site in every if isinstance(site.stmt, ir.Role)}
        everyone = {(site.path, wg) for site in every if isinstance(site.stmt, ir.Role)
                    for wg in range(site.stmt.warpgroups)}
        reached: dict[int, set] = {}                     # id -> {(role path, wg)}
        uses: list[tuple[Site, int, "int | None"]] = []   # (statement, id, wg; None at kernel level)
        for site in every:
            if not isinstance(site.stmt, (ir.NamedBarrierSync, ir.NamedBarrierArrive)):
                continue
            role = site.role
            for wg in (range(role.warpgroups) if role is not None else (None,)):
                env = {} if wg is None else {"wg": wg}
                if not self._reaches(site, env):
                    continue
                try:
                    bid = evaluate(site.stmt.id, env)
                except (KeyError, ValueError):
                    return
                if not 1 <= bid < NAMED_BARRIERS:
                    continue                            # reported with the statement
                group = {(site.role_path, wg)} if role is not None else everyone
                reached.setdefault(bid, set()).update(group)
                uses.append((site, bid, wg))
        reported = set()
        for site, bid, wg in uses:
            s, threads = site.stmt, site.stmt.threads
            expected = WARPGROUP_THREADS * len(reached[bid])
            unit = WARPGROUP_THREADS if wg is not None else WARP_THREADS
            if threads == expected or site.path in reported or threads % unit or threads > self.k.threads:
                continue                                # the last two are reported with the statement
            reported.add(site.path)
            who = ", ".join(f"role {names[p]} wg {w}" for p, w in sorted(reached[bid]))
            at = f" (wg = {wg})" if wg is not None and "wg" in ir.expr_vars(s.id) else ""
            head = f"{keyword(s)} {expr_text(s.id)}, {threads}: barrier {bid}{at} is reached by {expected} threads ({who})"
            if threads < expected:
                self.r.at(site.path, f"{head} but counts {threads}, so it completes once any {threads // WARP_THREADS} "
                                     f"of their {expected // WARP_THREADS} warps arrive and orders nothing; give "
                                     f"each group of {threads} threads its own id (as `bar.sync 1 + wg, 128` does "
                                     f"per warpgroup) or count them all: {keyword(s)} {expr_text(s.id)}, {expected}")
            else:
                self.r.at(site.path, f"{head}, fewer than the {threads} it counts: it never completes (deadlock); "
                                     f"count the threads that reach it: {keyword(s)} {expr_text(s.id)}, {expected}")

    def _reaches(self, site: Site, env: dict) -> bool:
        """Whether a warpgroup with `env` (its `wg`) can reach `site`: every enclosing branch on a
        condition computable from `env` alone is taken towards it (other conditions: maybe)."""
        for depth, parent in enumerate(site.ancestors):
            if not isinstance(parent, ir.If):
                continue
            try:
                taken = bool(evaluate(parent.cond, env))
            except (KeyError, ValueError):
                continue
            if taken != (site.path[depth + 1] < len(parent.then)):
                return False
        return True
