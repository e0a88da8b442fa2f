"""The verifier's structural checks: one walk over the kernel in program order.

`StructureCheck` keeps the names in scope at each statement and checks names and scopes,
references to declarations, the order of barrier initialisation (init, `fence.mbarrier_init`,
`syncthreads`, then the roles), warpgroup-collective statements kept out of elect_one, and the
hardware limits of `wsched/target.py` (registers, threads, shared memory, named barriers,
setmaxnreg). It has one method per statement type, `_<StmtType>`; those of the statements that
move or compute tiles (TMA, wgmma, register tiles) come from its mixin `tiles.TileChecks`. After
the walk come the checks across roles, from the mixin `roles.RoleChecks`: the CTA's thread,
register and shared-memory budgets, each role's setmaxnreg, and each named barrier id counted for
the threads that reach it.
These checks need no barriers or pipeline, so they also run on partially lowered kernels
(`verify(kernel, contract=False)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wsched.target import (
    DTYPE_BYTES, MAX_PORTABLE_CLUSTER, MBARRIER_MAX_ARRIVALS, NAMED_BARRIERS, SETMAXNREG_MAX, SETMAXNREG_MIN, SETMAXNREG_STEP,
    TMA_SWIZZLES, WARP_THREADS, WARPGROUP_THREADS,
)

from .. import ir
from ..evaluate import evaluate
from ..printer import expr_text
from ..spelling import keyword
from .lines import Report, constant, expr_nodes, location, ref_text, sites, statement_name
from .global_sync import GlobalSyncChecks
from .roles import RoleChecks
from .tiles import SWIZZLE_CHOICES, TileChecks

_SCALARS = ("scalar param", "builtin", "let", "var", "loop variable")
_REGISTERS = f"a multiple of {SETMAXNREG_STEP} in [{SETMAXNREG_MIN}, {SETMAXNREG_MAX}]"


def _settable_registers(n: int) -> bool:
    """Whether setmaxnreg can set a per-thread register count of `n`."""
    return n % SETMAXNREG_STEP == 0 and SETMAXNREG_MIN <= n <= SETMAXNREG_MAX


def _operator_problem(node, report) -> None:
    """An operator or call the IR does not have (or a call with the wrong number of arguments)."""
    if isinstance(node, ir.BinOp) and node.op not in ir.BINARY_PRECEDENCE:
        report(f"`{node.op}` is not an operator of the IR; use one of {' '.join(ir.BINARY_PRECEDENCE)}")
    elif isinstance(node, ir.Call) and ir.CALLS.get(node.func) != len(node.args):
        if node.func in ir.CALLS:
            report(f"{node.func}() takes {ir.CALLS[node.func]} arguments, not {len(node.args)}")
        else:
            report(f"`{node.func}` is not a function of the IR; use one of {', '.join(ir.CALLS)}")
    name = node.op if isinstance(node, ir.BinOp) else node.func if isinstance(node, ir.Call) else None
    if name in ir.INTEGER_ONLY:
        args = (node.lhs, node.rhs) if isinstance(node, ir.BinOp) else node.args
        for arg in args:
            if isinstance(arg, ir.FloatConst):
                report(f"`{name}` takes integers, not the float {arg.value!r}")


@dataclass(frozen=True)
class _Name:
    what: str                  # "scalar param", "tensormap param", "smem buffer", "let", ...
    line: int
    decl: object = None        # the Param / SmemDecl / BarrierDecl / RegDecl behind the name


@dataclass(frozen=True)
class _Ctx:
    role: "ir.Role | None"
    elected: bool = False


@dataclass(frozen=True)
class _Declaration:
    what: str                  # "let", "var", "loop variable" or "register tile"
    line: int
    path: tuple[int, ...]
    role: "str | None"


class StructureCheck(TileChecks, GlobalSyncChecks, RoleChecks):
    """One walk over the kernel in program order, with the names in scope at each statement."""

    def __init__(self, kernel: ir.Kernel, report: Report, require_init: bool):
        self.k = kernel
        self.r = report
        self.require_init = require_init
        self.inits: dict[str, int] = {}          # barrier -> IR line of its mbarrier.init
        self.unfenced_init = False                # an init not yet followed by fence + syncthreads
        self.fenced = False                       # fence.mbarrier_init seen, syncthreads pending
        self.visibility_reported = False
        self.remote = False                       # a peer's barrier or smem is reached (cta(), multicast)
        self.cluster_synced = False               # fence.mbarrier_init followed by cluster.sync
        self.role_lines: dict[str, int] = {}       # role name -> IR line of its first declaration
        self.views: set[str] = set()               # register tiles declared by tile.view
        self.declarations = self._index_declarations()

    def _index_declarations(self) -> dict[str, list[_Declaration]]:
        """Every let, var, loop variable and register tile, for messages about names used where
        their declaration is not in scope."""
        declares = {ir.Let: "let", ir.For: "loop variable", ir.RegDecl: "register tile",
                    ir.TileView: "register tile", ir.LoadShared: "let", ir.LoadGlobal: "let"}
        found: dict[str, list[_Declaration]] = {}
        for site in sites(self.k):
            s = site.stmt
            what = "var" if isinstance(s, ir.Let) and s.mutable else declares.get(type(s))
            if what is not None:
                role = site.role.name if site.role is not None else None
                name = s.var if isinstance(s, ir.For) else s.name
                found.setdefault(name, []).append(_Declaration(what, self.r.line(site.path), site.path, role))
        return found

    # -- kernel header and declarations ---------------------------------------------------------

    def run(self) -> None:
        scope = self._globals()
        self._launch(scope)
        self._block(self.k.body, (), scope, _Ctx(None))
        if self.remote and self.inits and not self.cluster_synced:
            self.r.header("CTAs of the cluster arrive on each other's barriers or multicast into each "
                          "other's smem, but nothing makes a CTA's barrier inits visible to its peers: "
                          "after the last mbarrier.init put `fence.mbarrier_init` and then `cluster.sync`")
        if not self._budgets():
            return                  # the per-role checks walk every warpgroup: not past the limits
        every = sites(self.k)
        self._register_handoff(every)
        self._named_barrier_groups(every)

    def _globals(self) -> dict[str, _Name]:
        scope: dict[str, _Name] = {"cta_id": _Name("builtin", 0), "num_ctas": _Name("builtin", 0)}
        scalars = {p.name: _Name("scalar param", 1, p) for p in self.k.params if isinstance(p, ir.ScalarParam)}
        seen: dict[str, tuple[str, int]] = {}

        def declare(name, what, line, decl, report):
            if name in ir.BUILTINS:
                report(f"`{name}` is a builtin name; rename the {what}")
            elif name in seen:
                other_what, other_line = seen[name]
                report(f"`{name}` is already declared as a {other_what} at IR line {other_line} "
                       f"(names are unique in the IR); rename one of them")
            else:
                seen[name] = (what, line)
                scope[name] = _Name(what, line, decl)

        declared_scalars: dict[str, _Name] = {}
        for p in self.k.params:
            what = {ir.ScalarParam: "scalar param", ir.TensorMapParam: "tensormap param",
                    ir.GlobalParam: "global param", ir.HostParam: "scalar param",
                    ir.WorkspaceParam: "global param", ir.SpanParam: "global param"}[type(p)]
            where = f"{what.split()[0]} {p.name}"
            report = lambda problem, where=where: self.r.header(problem, where)  # noqa: E731
            if isinstance(p, ir.HostParam):   # computed on the host from the params before it
                self._host_expr(p.value, declared_scalars, report, f"the value of host param {p.name}")
            if isinstance(p, ir.ScalarParam):
                declared_scalars[p.name] = scalars[p.name]
            declare(p.name, what, 1, p, report)
            self._dtype(p.dtype, report)
            if isinstance(p, (ir.TensorMapParam, ir.GlobalParam)):
                for d in p.shape:
                    self._host_expr(d, scalars, report, "a tensor shape")
            if isinstance(p, ir.TensorMapParam):
                self._tensormap(p, report)
            if isinstance(p, ir.SpanParam):
                self._spans(p, report)
            if isinstance(p, ir.WorkspaceParam) and p.fragments and (len(p.shape) < 2 or DTYPE_BYTES.get(p.dtype) != 4):
                report(f"a fragments workspace holds 4-byte elements (f32, i32) in matrices (rank >= 2); "
                       f"{p.name} is {p.dtype} of rank {len(p.shape)}: drop `fragments` or declare it f32[..., rows, cols]")
        for i, b in enumerate(self.k.smem):
            report = lambda problem, i=i: self.r.smem_decl(i, problem)  # noqa: E731
            declare(b.name, "smem buffer", 2 + i, b, report)
            self._dtype(b.dtype, report)
            if not b.shape or any(d < 1 for d in b.shape):
                report(f"shape {list(b.shape)}: a smem buffer needs at least one dim, each >= 1")
            if b.swizzle not in TMA_SWIZZLES:
                report(f"swizzle({b.swizzle}) is not a TMA swizzle; use {SWIZZLE_CHOICES}")
        for j, b in enumerate(self.k.barriers):
            report = lambda problem, j=j: self.r.barrier_decl(j, problem)  # noqa: E731
            declare(b.name, "barrier", 2 + len(self.k.smem) + j, b, report)
            if b.slots < 1:
                report(f"barrier {b.name}[{b.slots}] has no slots; declare at least one")
        return scope

    def _spans(self, p: ir.SpanParam, report) -> None:
        """A spans table reads two i32 id inputs declared before it, at most of its rank: [..., S, 1]
        and [..., 1, T]; it is [..., row blocks, 4]."""
        params = {q.name: q for q in self.k.params[:self.k.params.index(p)]}
        for side, name, dims in (("query", p.query, "[..., S, 1]"), ("key", p.key, "[..., 1, T]")):
            q = params.get(name)
            if not (isinstance(q, ir.GlobalParam) and type(q) is ir.GlobalParam):
                report(f"spans {p.name} reads `{name}` as its {side} ids, which is not a global param declared "
                       f"before it; name an i32 global input {dims}")
            elif q.dtype != "i32" or not 2 <= len(q.shape) <= len(p.shape):
                report(f"spans {p.name}: its {side} ids `{name}` are {q.dtype}[{len(q.shape)} dims]; they must be "
                       f"i32 {dims}, at most the table's rank ({len(p.shape)})")
        if p.dtype != "i32" or not p.shape or p.shape[-1] != ir.IntConst(4):
            report(f"spans {p.name} is {p.dtype}[...]; a spans table is i32[..., row blocks, 4] (first, count, "
                   f"full first, full count)")
        if p.rows < 1 or p.cols < 1:
            report(f"spans {p.name}: rows({p.rows}) cols({p.cols}) must both be >= 1")

    def _dtype(self, dtype, report) -> None:
        if dtype not in ir.DTYPES:
            report(f"dtype {dtype!r} is not one of {', '.join(ir.DTYPES)}")

    def _host_expr(self, e, scalars, report, what) -> None:
        for node in expr_nodes(e):
            if isinstance(node, ir.Var) and node.name not in scalars and node.name != "num_sms":
                report(f"{what} reads `{node.name}`; host-side expressions may read scalar params "
                       f"(and num_sms in the grid) only")
            else:
                _operator_problem(node, lambda m: report(f"{what}: {m}"))

    def _launch(self, scope) -> None:
        scalars = {n: b for n, b in scope.items() if b.what == "scalar param"}
        self._host_expr(self.k.grid, scalars, lambda m: self.r.header(m, "grid"), "the grid")
        if len(self.k.cluster) != 3 or any(c < 1 for c in self.k.cluster):
            self.r.header(f"cluster{tuple(self.k.cluster)}: give three extents, each >= 1")
        elif self.k.cluster[1:] != (1, 1):
            self.r.header(f"cluster{tuple(self.k.cluster)}: the grid is one-dimensional, so a cluster is "
                          f"consecutive CTAs along x; use cluster({math.prod(self.k.cluster)}, 1, 1)")
        elif self.k.cluster[0] > MAX_PORTABLE_CLUSTER:
            self.r.header(f"cluster{tuple(self.k.cluster)}: at most {MAX_PORTABLE_CLUSTER} CTAs in a cluster "
                          f"(the portable size)")

    def _cluster_operand(self, clause: str, e, path, scope, ctx) -> None:
        """A peer rank (`cta(r)`) or a multicast mask (`clause`): only in a kernel with a cluster
        of more than one CTA, and in range where it is a constant."""
        self._expr(e, path, scope, ctx)
        size = self.k.cluster[0] if len(self.k.cluster) == 3 else 1
        if size <= 1:
            self.r.at(path, f"{clause}({expr_text(e)}) in a kernel without a cluster (cluster{tuple(self.k.cluster)}); "
                            f"give the kernel cluster(n, 1, 1) with n >= 2, or drop {clause}")
            return
        self.remote = True
        problem = ir.cluster_operand_problem(clause, e.value, size) if isinstance(e, ir.IntConst) else None
        if problem:
            self.r.at(path, problem)

    # -- statements -----------------------------------------------------------------------------

    def _block(self, stmts, prefix, scope, ctx, offset=0) -> None:
        scope = dict(scope)
        for i, s in enumerate(stmts):
            path = prefix + (offset + i,)
            if ctx.elected and isinstance(s, ir.WARPGROUP_COLLECTIVE):
                self.r.at(path, f"{statement_name(s)} is warpgroup-collective, but elect_one runs its body on "
                                f"one thread; move it out of elect_one")
            getattr(self, "_" + type(s).__name__)(s, path, scope, ctx)

    def _declare(self, name, what, path, scope, decl=None) -> None:
        line = self.r.line(path)
        if name in ir.BUILTINS:
            self.r.at(path, f"`{name}` is a builtin name; choose another name for the {what}")
            return
        if name in scope:
            other = scope[name]
            self.r.at(path, f"`{name}` is already declared as a {other.what} at IR line {other.line} "
                            f"(names are unique in the IR); rename one of them")
        scope[name] = _Name(what, line, decl)

    def _undeclared(self, name, path, ctx) -> str:
        if name == "wg":
            return ("`wg` (the warpgroup index) exists only inside a role; move this statement into a "
                    "role or use a constant")
        if name == "num_sms":
            return ("`num_sms` is host-side and may appear only in the grid; inside the kernel use "
                    "num_ctas (gridDim.x)")
        role = ctx.role.name if ctx.role else None
        line = self.r.line(path)
        for d in self.declarations.get(name, ()):
            if d.what == "register tile" and d.role != role:
                owner = f"role {d.role}" if d.role else "kernel level"
                return (f"register tile `{name}` belongs to {owner} (IR line {d.line}); register tiles "
                        f"are per warpgroup and visible only inside the role that declares them")
            if d.role == role and d.line > line:
                return (f"`{name}` is used before its declaration ({d.what} at IR line {d.line}); "
                        f"declare it before this statement")
        if name in self.declarations:
            d = min(self.declarations[name], key=lambda d: d.role != role)     # this role's first
            return (f"`{name}` is declared at IR line {d.line} ({location(self.k, d.path)}), which does "
                    f"not enclose this statement; declare it in this block or an enclosing one")
        return (f"`{name}` is not declared; expressions read scalar params, builtins (cta_id, num_ctas, "
                f"wg inside a role), loop variables and the lets/vars of enclosing blocks")

    def _expr(self, e, path, scope, ctx) -> None:
        for node in expr_nodes(e):
            if isinstance(node, ir.Var):
                b = scope.get(node.name)
                if b is None:
                    self.r.at(path, self._undeclared(node.name, path, ctx))
                elif b.what not in _SCALARS:
                    self.r.at(path, f"`{node.name}` is a {b.what}, not a scalar; expressions read scalar "
                                    f"params, builtins, loop variables and lets/vars")
            else:
                _operator_problem(node, lambda m: self.r.at(path, m))

    def _lookup(self, name, wanted, path, scope, ctx, noun):
        """The declaration behind `name` if it is a `wanted` ("barrier", "register tile", ...) in
        scope, else report and None; `noun` is what the statement calls the name ("tile")."""
        b = scope.get(name)
        if b is not None and b.what == wanted:
            return b.decl
        known = ", ".join(n for n, x in scope.items() if x.what == wanted) or "none"
        if b is not None:
            self.r.at(path, f"{noun} `{name}` is a {b.what}, not a {wanted} (declared: {known})")
        elif wanted == "register tile":
            message = self._undeclared(name, path, ctx)
            if name not in self.declarations:
                message = (f"`{name}` is not a register tile; declare it in this role with "
                           f"`reg {name}: f32[rows, cols]`")
            self.r.at(path, message)
        else:
            self.r.at(path, f"{noun} `{name}` is not a declared {wanted} (declared: {known})")
        return None

    def _bar(self, ref: ir.BarRef, path, scope, ctx) -> "ir.BarrierDecl | None":
        decl = self._lookup(ref.barrier, "barrier", path, scope, ctx, "barrier")
        self._expr(ref.index, path, scope, ctx)
        if decl is None:
            return None
        v = constant(ref.index)
        if isinstance(v, int) and not 0 <= v < decl.slots:
            self.r.at(path, f"`{ref_text(ref)}`: barrier {decl.name} has {decl.slots} slots "
                            f"(0..{decl.slots - 1})")
        self._initialised(decl.name, path)
        return decl

    def _initialised(self, barrier, path) -> None:
        if barrier in self.inits:
            return
        later = any(isinstance(s, ir.MbarrierInit) and s.barrier == barrier for s in ir.walk(self.k.body))
        if later:
            self.r.at(path, f"barrier `{barrier}` is used before its mbarrier.init; initialise every "
                            f"barrier at kernel level before the roles")
        elif self.require_init:
            self.r.at(path, f"barrier `{barrier}` is never initialised; add `mbarrier.init {barrier} "
                            f"arrivals(n)` at kernel level before the roles")

    # one method per statement kind ----------------------------------------------------------

    def _Let(self, s: ir.Let, path, scope, ctx):
        self._expr(s.value, path, scope, ctx)
        self._declare(s.name, "var" if s.mutable else "let", path, scope)

    def _Assign(self, s: ir.Assign, path, scope, ctx):
        self._expr(s.value, path, scope, ctx)
        b = scope.get(s.name)
        if b is None:
            self.r.at(path, f"`set {s.name}` updates an undeclared name; declare it first with "
                            f"`var {s.name} = ...`")
        elif b.what == "let":
            self.r.at(path, f"`set {s.name}` updates a let (immutable, IR line {b.line}); declare it with "
                            f"`var {s.name} = ...` to update it")
        elif b.what != "var":
            self.r.at(path, f"`set {s.name}` updates a {b.what}; only a `var` can be updated")

    def _For(self, s: ir.For, path, scope, ctx):
        for e in (s.start, s.stop, s.step):
            self._expr(e, path, scope, ctx)
        if s.iteration not in ir.LOOP_KINDS:
            self.r.at(path, f"loop kind `{s.iteration}` is not one of {', '.join(ir.LOOP_KINDS)}")
        step = constant(s.step)
        if s.iteration == "dynamic":
            b = scope.get(s.step.name) if isinstance(s.step, ir.Var) else None
            if b is None or b.what != "var" or not any(isinstance(x, ir.Assign) and x.name == s.step.name
                                                       for x in ir.walk(s.body)):
                self.r.at(path, f"dynamic({expr_text(s.start)}, {expr_text(s.stop)}, {expr_text(s.step)}): the "
                                f"next value of a dynamic loop is a `var` declared before the loop that its body "
                                f"sets (`set {expr_text(s.step)} = ...`)")
        elif isinstance(step, (int, float)) and step <= 0:
            self.r.at(path, f"step {expr_text(s.step)}: a loop counts up; use a step >= 1")
        inner = dict(scope)
        self._declare(s.var, "loop variable", path, inner, s)
        self._block(s.body, path, inner, ctx)

    def _If(self, s: ir.If, path, scope, ctx):
        self._expr(s.cond, path, scope, ctx)
        self._block(s.then, path, scope, ctx)
        self._block(s.orelse, path, scope, ctx, len(s.then))

    def _Role(self, s: ir.Role, path, scope, ctx):
        if ctx.role is not None:
            self.r.at(path, f"role {s.name} is nested in role {ctx.role.name}; roles are laid out at "
                            f"kernel level")
        if s.warpgroups < 1:
            self.r.at(path, f"warpgroups({s.warpgroups}): a role has at least one warpgroup")
        if not _settable_registers(s.registers):
            self.r.at(path, f"registers({s.registers}): a role's register count must be {_REGISTERS} "
                            f"(what setmaxnreg can set)")
        if s.name in self.role_lines:
            self.r.at(path, f"role {s.name} is declared twice (first at IR line {self.role_lines[s.name]}); "
                            f"give each role its own name")
        self.role_lines.setdefault(s.name, self.r.line(path))
        if (self.unfenced_init or self.fenced) and not self.visibility_reported:
            self.visibility_reported = True
            self.r.at(path, "the barrier inits are not visible to the roles yet; after the last "
                            "mbarrier.init put `fence.mbarrier_init` and then `syncthreads`")
        inner = dict(scope)
        inner["wg"] = _Name("builtin", 0)
        self._block(s.body, path, inner, _Ctx(s))

    def _ElectOne(self, s: ir.ElectOne, path, scope, ctx):
        self._block(s.body, path, scope, _Ctx(ctx.role, True))

    def _Return(self, s, path, scope, ctx):
        pass

    def _Setmaxnreg(self, s: ir.Setmaxnreg, path, scope, ctx):
        if s.action not in ir.SETMAXNREG_ACTIONS:
            self.r.at(path, f"{keyword(s)}: the action is {' or '.join(ir.SETMAXNREG_ACTIONS)}")
        if not _settable_registers(s.registers):
            self.r.at(path, f"setmaxnreg {s.registers}: the register count must be {_REGISTERS}")
        if ctx.role is None:
            self.r.at(path, "setmaxnreg outside a role; it belongs at the start of a role's body")
        elif s.registers != ctx.role.registers:
            self.r.at(path, f"{keyword(s)} {s.registers} in role {ctx.role.name} "
                            f"registers({ctx.role.registers}); the role's budget and its setmaxnreg must "
                            f"agree: use {keyword(s)} {ctx.role.registers} (or "
                            f"registers({s.registers}))")

    def _MbarrierInit(self, s: ir.MbarrierInit, path, scope, ctx):
        self._lookup(s.barrier, "barrier", path, scope, ctx, "barrier")
        if ctx.role is not None:
            self.r.at(path, f"mbarrier.init inside role {ctx.role.name}; barriers are initialised at "
                            f"kernel level (by thread 0) before the roles")
            return
        if s.arrivals < 1:
            self.r.at(path, f"arrivals({s.arrivals}): an mbarrier phase needs at least 1 arrival; count "
                            f"the arrive operations of one phase")
        elif s.arrivals > MBARRIER_MAX_ARRIVALS:
            self.r.at(path, f"arrivals({s.arrivals}): an mbarrier phase counts at most "
                            f"{MBARRIER_MAX_ARRIVALS} arrivals")
        if s.barrier in self.inits:
            self.r.at(path, f"barrier `{s.barrier}` is initialised twice (first at IR line "
                            f"{self.inits[s.barrier]}); initialise it once")
        self.inits.setdefault(s.barrier, self.r.line(path))
        self.unfenced_init, self.fenced = True, False

    def _MbarrierArrive(self, s: ir.MbarrierArrive, path, scope, ctx):
        self._bar(s.bar, path, scope, ctx)
        if s.cta is not None:
            self._cluster_operand("cta", s.cta, path, scope, ctx)

    def _MbarrierArriveExpectTx(self, s: ir.MbarrierArriveExpectTx, path, scope, ctx):
        self._bar(s.bar, path, scope, ctx)
        self._expr(s.bytes, path, scope, ctx)

    def _MbarrierWait(self, s: ir.MbarrierWait, path, scope, ctx):
        self._bar(s.bar, path, scope, ctx)
        self._expr(s.phase, path, scope, ctx)

    def _MbarrierInval(self, s: ir.MbarrierInval, path, scope, ctx):
        if self._lookup(s.barrier, "barrier", path, scope, ctx, "barrier") is not None:
            self._initialised(s.barrier, path)

    def _FenceMbarrierInit(self, s, path, scope, ctx):
        if ctx.role is None and self.unfenced_init:
            self.unfenced_init, self.fenced = False, True

    def _FenceProxyAsync(self, s, path, scope, ctx):
        pass

    def _SyncThreads(self, s, path, scope, ctx):
        if ctx.role is not None:
            self.r.at(path, f"syncthreads inside role {ctx.role.name} waits for the threads of every "
                            f"role (deadlock); synchronise the participating warpgroups with a named "
                            f"barrier `bar.sync id, threads` with id >= 1")
        self.fenced = False

    def _ClusterSync(self, s, path, scope, ctx):
        if ctx.role is not None:
            self.r.at(path, f"cluster.sync inside role {ctx.role.name} waits for the threads of every role "
                            f"of every CTA of the cluster (deadlock); put it at kernel level")
        if self.fenced:
            self.cluster_synced = True
        self.fenced = False

    def _named_barrier(self, s, path, scope, ctx):
        verb = keyword(s)
        self._expr(s.id, path, scope, ctx)
        reads_wg = "wg" in ir.expr_vars(s.id)
        wgs = range(ctx.role.warpgroups) if ctx.role is not None and reads_wg else [None]
        for wg in wgs:
            try:
                bid = evaluate(s.id, {} if wg is None else {"wg": wg})
            except (KeyError, ValueError):   # unbound name, or no value (evaluate's errors)
                break
            if not 1 <= bid < NAMED_BARRIERS:
                at = "" if wg is None else f" for wg = {wg}"
                last = NAMED_BARRIERS - 1
                self.r.at(path, f"{verb} {expr_text(s.id)}: barrier id {bid}{at} is outside [1, {last}] (id 0 "
                                f"is the barrier syncthreads uses); use ids 1..{last}")
                break
        unit = WARPGROUP_THREADS if ctx.role is not None else WARP_THREADS
        if s.threads < 1 or s.threads % unit:
            what = "whole warpgroups inside a role" if unit == WARPGROUP_THREADS else "whole warps"
            self.r.at(path, f"{verb} {expr_text(s.id)}, {s.threads}: the thread count must be a multiple of "
                            f"{unit} ({what})")
        if s.threads > self.k.threads:
            self.r.at(path, f"{verb} {expr_text(s.id)}, {s.threads}: more threads than the block has "
                            f"({self.k.threads}); count only the participating threads")

    _NamedBarrierSync = _named_barrier
    _NamedBarrierArrive = _named_barrier
