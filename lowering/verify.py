"""The loop-IR verifier: structural rules, Hopper limits, and the load/compute contract.

`verify(kernel)` raises a `VerifyError` that lists every problem; `verify_all(kernel)` returns
them as `Diagnostic`s. IR nodes carry no source positions, so a statement is named by its
traversal path (child indices from the kernel body down; an `if`'s children are its `then`
statements followed by its `else` statements) and every message points at the line that
statement has in the printed IR (`print_kernel`: header on line 1, one line per smem and barrier
declaration, one line per statement, a closing `}` or `} else {` on a line of its own):

    IR line 23 (role consumer > for k > mbarrier.wait): <what is wrong>; <what would be right>

Two layers, so that `verify(kernel, contract=False)` can check a partially lowered kernel:

* structural checks: names and scopes, references to declarations, shapes and dtypes of every
  copy, MMA and tile op, the order of barrier initialisation, warpgroup-collective statements
  kept out of elect_one, and the hardware limits of DESIGN.md §6 (registers, threads, shared
  memory, named barriers, setmaxnreg, TMA boxes);
* the contract between the load and compute nests (DESIGN.md §3): expect_tx bytes, stage and
  barrier slot agreement, barrier arrival counts, the same (tile, k) traversal with the same
  stage and phase on both sides, no stage released (and no smem overwritten) while a wgmma
  reading it may be pending, and generic smem writes fenced before TMA or wgmma read them.
  The dynamic half runs each role's control flow (lets, vars, loops, ifs) on the host for a few
  sample problem sizes and CTAs, recording the barrier operations, wgmma groups and smem
  accesses of every warpgroup; persistent tile loops are cut after two tiles (tile = cta_id,
  cta_id + num_ctas), which both sides' identical tile loops make a common prefix. A sample the
  host cannot run (a name without a value, a division by zero, too many steps) is skipped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from . import ir
from .evaluate import evaluate
from .parser import LOOP_KINDS, MMA_MAJORS, SETMAXNREG_ACTIONS
from .printer import print_expr
from .rewrite import subst

SMEM_LIMIT = 232448             # bytes of shared memory one CTA may use on sm_90 (227 KB)
REGISTER_FILE = 65536           # 32-bit registers per SM
MAX_THREADS = 1024
SWIZZLES = (0, 32, 64, 128)
_SAME_ORDER = "the load and compute nests must traverse the same (tile, k) order"


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnostic:
    """One problem. `path` is the statement's traversal path (() for the kernel header and the
    declarations); `line` its line in the printed IR; `message` the full text."""

    message: str
    path: tuple[int, ...]
    line: int

    def __str__(self) -> str:
        return self.message


class VerifyError(ValueError):
    """The kernel breaks a rule of the IR; `diagnostics` holds every problem found."""

    def __init__(self, diagnostics):
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.message for d in self.diagnostics))

    def __reduce__(self):
        return (type(self), (self.diagnostics,))


def verify(kernel: ir.Kernel, *, contract: bool = True) -> None:
    """Raise VerifyError if `kernel` has any problem (`contract=False`: structural checks only,
    for kernels whose barriers and pipeline are not complete yet)."""
    problems = verify_all(kernel, contract=contract)
    if problems:
        raise VerifyError(problems)


def verify_all(kernel: ir.Kernel, *, contract: bool = True) -> list[Diagnostic]:
    """Every problem of `kernel`, ordered by IR line."""
    report = _Report(kernel)
    _Structure(kernel, report, require_init=contract).run()
    if contract:
        _Contract(kernel, report).run()
    return sorted(report.diagnostics, key=lambda d: d.line)


def children(s: ir.Stmt) -> tuple[ir.Stmt, ...]:
    """The statements nested in `s`, in path order (an `if`: then, then else)."""
    return tuple(itertools.chain.from_iterable(ir.child_blocks(s)))


def statement_at(kernel: ir.Kernel, path: tuple[int, ...]) -> ir.Stmt:
    stmts = kernel.body
    s = None
    for i in path:
        s = stmts[i]
        stmts = children(s)
    return s


def statement_lines(kernel: ir.Kernel) -> dict[tuple[int, ...], int]:
    """Line of every statement in the printed IR, keyed by traversal path."""
    lines: dict[tuple[int, ...], int] = {}
    line = 2 + len(kernel.smem) + len(kernel.barriers)

    def block(stmts, prefix, offset=0):
        nonlocal line
        for i, s in enumerate(stmts):
            path = prefix + (offset + i,)
            lines[path] = line
            line += 1
            if isinstance(s, ir.If):
                block(s.then, path)
                if s.orelse:
                    line += 1                          # } else {
                    block(s.orelse, path, len(s.then))
                line += 1                              # }
            elif ir.child_blocks(s):
                block(s.body, path)
                line += 1                              # }

    block(kernel.body, ())
    return lines


# ---------------------------------------------------------------------------------------------
# Locations and text
# ---------------------------------------------------------------------------------------------


def _keyword(s: ir.Stmt) -> str:
    """How a statement is named in a location: its leading keyword(s)."""
    if isinstance(s, ir.Role):
        return f"role {s.name}"
    if isinstance(s, ir.For):
        return f"for {s.var}"
    if isinstance(s, ir.Let):
        return f"{'var' if s.mutable else 'let'} {s.name}"
    if isinstance(s, ir.Assign):
        return f"set {s.name}"
    if isinstance(s, ir.RegDecl):
        return f"reg {s.name}"
    if isinstance(s, ir.Setmaxnreg):
        return f"setmaxnreg.{s.action}"
    if isinstance(s, (ir.TileUnary, ir.TileBinary)):
        return f"tile.{s.op}"
    if isinstance(s, ir.TileReduce):
        return f"tile.reduce.{s.op}"
    if isinstance(s, ir.TmaWait):
        return "tma.wait.read" if s.read else "tma.wait"
    return _KEYWORDS[type(s)]


_KEYWORDS = {
    ir.If: "if", ir.ElectOne: "elect_one", ir.Return: "return",
    ir.MbarrierInit: "mbarrier.init", ir.MbarrierArrive: "mbarrier.arrive",
    ir.MbarrierArriveExpectTx: "mbarrier.arrive_expect_tx", ir.MbarrierWait: "mbarrier.wait",
    ir.MbarrierInval: "mbarrier.inval", ir.FenceMbarrierInit: "fence.mbarrier_init",
    ir.FenceProxyAsync: "fence.proxy.async", ir.SyncThreads: "syncthreads",
    ir.NamedBarrierSync: "bar.sync", ir.NamedBarrierArrive: "bar.arrive",
    ir.TmaLoad: "tma.load", ir.TmaStore: "tma.store", ir.TmaCommit: "tma.commit",
    ir.WgmmaFence: "wgmma.fence", ir.Wgmma: "wgmma.mma", ir.WgmmaCommit: "wgmma.commit",
    ir.WgmmaWait: "wgmma.wait", ir.TileFill: "tile.fill", ir.TileMask: "tile.mask",
    ir.TileLoadGlobal: "tile.load",
    ir.TileStoreGlobal: "tile.store", ir.TileStoreSmem: "tile.store_smem",
}


def _where(kernel: ir.Kernel, path: tuple[int, ...]) -> str:
    parts = []
    stmts = kernel.body
    for depth, i in enumerate(path):
        s = stmts[i]
        if depth + 1 < len(path) and isinstance(s, ir.If):
            parts.append("if" if path[depth + 1] < len(s.then) else "else")
        else:
            parts.append(_keyword(s))
        stmts = children(s)
    return " > ".join(parts)


def _text(e: ir.Expr) -> str:
    """An expression as the printer spells it (repr for a malformed one, which is reported)."""
    try:
        return print_expr(e)
    except (TypeError, ValueError):
        return repr(e)


def _ref(r: "ir.SmemRef | ir.BarRef") -> str:
    if isinstance(r, ir.BarRef):
        return f"{r.barrier}[{_text(r.index)}]"
    return f"{r.buffer}[{', '.join(_text(i) for i in r.index)}]" if r.index else r.buffer


def _array(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(_text(d) if not isinstance(d, int) else str(d) for d in shape)}]"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _expr_nodes(e: ir.Expr) -> Iterator[ir.Expr]:
    yield e
    if isinstance(e, ir.BinOp):
        yield from _expr_nodes(e.lhs)
        yield from _expr_nodes(e.rhs)
    elif isinstance(e, ir.Call):
        for a in e.args:
            yield from _expr_nodes(a)


def _constant(e: ir.Expr) -> "int | float | None":
    try:
        return evaluate(e, {})
    except (KeyError, ZeroDivisionError, TypeError, ValueError):
        return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _volume(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class _Site:
    path: tuple[int, ...]
    stmt: ir.Stmt
    ancestors: tuple[ir.Stmt, ...]          # enclosing statements, outermost first

    @property
    def role(self) -> "ir.Role | None":
        return next((a for a in self.ancestors if isinstance(a, ir.Role)), None)

    @property
    def role_path(self) -> "tuple[int, ...] | None":
        return next((self.path[:i + 1] for i, a in enumerate(self.ancestors) if isinstance(a, ir.Role)), None)

    def loops(self) -> list[tuple[ir.For, tuple[int, ...]]]:
        """The enclosing for loops inside the role, outermost first, with their paths."""
        return [(a, self.path[:i + 1]) for i, a in enumerate(self.ancestors) if isinstance(a, ir.For)]


def _sites(kernel: ir.Kernel) -> list[_Site]:
    out: list[_Site] = []

    def visit(stmts, prefix, ancestors):
        for i, s in enumerate(stmts):
            out.append(_Site(prefix + (i,), s, ancestors))
            visit(children(s), prefix + (i,), ancestors + (s,))

    visit(kernel.body, (), ())
    return out


def _block_of(kernel: ir.Kernel, path: tuple[int, ...]) -> tuple[tuple[ir.Stmt, ...], int, int]:
    """The statement list that holds `path`, the statement's index in it, and the list's offset in
    the parent's children (non-zero for an `else` block)."""
    stmts, offset = kernel.body, 0
    if len(path) > 1:
        parent = statement_at(kernel, path[:-1])
        stmts = children(parent)
        if isinstance(parent, ir.If):
            stmts, offset = ((parent.then, 0) if path[-1] < len(parent.then)
                             else (parent.orelse, len(parent.then)))
    return stmts, path[-1] - offset, offset


class _Report:
    def __init__(self, kernel: ir.Kernel):
        self.kernel = kernel
        self.lines = statement_lines(kernel)
        self.diagnostics: list[Diagnostic] = []
        self._seen: set[str] = set()

    def _add(self, line: int, where: str, problem: str, path: tuple[int, ...]) -> None:
        message = f"IR line {line} ({where}): {problem}"
        if message not in self._seen:
            self._seen.add(message)
            self.diagnostics.append(Diagnostic(message, path, line))

    def at(self, path: tuple[int, ...], problem: str) -> None:
        self._add(self.lines[path], _where(self.kernel, path), problem, path)

    def header(self, problem: str, what: str = "") -> None:
        self._add(1, f"kernel {self.kernel.name}" + (f" > {what}" if what else ""), problem, ())

    def smem_decl(self, index: int, problem: str) -> None:
        self._add(2 + index, f"smem {self.kernel.smem[index].name}", problem, ())

    def barrier_decl(self, index: int, problem: str) -> None:
        self._add(2 + len(self.kernel.smem) + index, f"barrier {self.kernel.barriers[index].name}",
                  problem, ())

    def line(self, path: tuple[int, ...]) -> int:
        return self.lines[path]


# ---------------------------------------------------------------------------------------------
# Structural checks
# ---------------------------------------------------------------------------------------------

_SCALARS = ("scalar param", "builtin", "let", "var", "loop variable")

# Statements every thread of a warpgroup must execute together (not inside elect_one).
_COLLECTIVE = (ir.Role, ir.Setmaxnreg, ir.SyncThreads, ir.NamedBarrierSync, ir.NamedBarrierArrive,
               ir.WgmmaFence, ir.Wgmma, ir.WgmmaCommit, ir.WgmmaWait, ir.RegDecl, ir.TileFill,
               ir.TileUnary, ir.TileBinary, ir.TileReduce, ir.TileMask, ir.TileLoadGlobal,
               ir.TileStoreGlobal, ir.TileStoreSmem)


@dataclass(frozen=True)
class _Name:
    kind: str                  # "scalar param", "tensormap param", "smem buffer", "let", ...
    line: int
    decl: object = None        # the Param / SmemDecl / BarrierDecl / RegDecl behind the name


@dataclass(frozen=True)
class _Ctx:
    role: "ir.Role | None"
    elected: bool = False


@dataclass(frozen=True)
class _Declaration:
    kind: str
    line: int
    path: tuple[int, ...]
    role: "str | None"


class _Structure:
    """One walk over the kernel in program order, with the names in scope at each statement."""

    def __init__(self, kernel: ir.Kernel, report: _Report, require_init: bool):
        self.k = kernel
        self.r = report
        self.require_init = require_init
        self.inits: dict[str, int] = {}          # barrier -> IR line of its mbarrier.init
        self.unfenced_init = False                # an init not yet followed by fence + syncthreads
        self.fenced = False                       # fence.mbarrier_init seen, syncthreads pending
        self.visibility_reported = False
        self.declarations = self._index_declarations()

    def _index_declarations(self) -> dict[str, list[_Declaration]]:
        """Every let, var, loop variable and register tile, for messages about names used where
        their declaration is not in scope."""
        kinds = {ir.Let: "let", ir.For: "loop variable", ir.RegDecl: "register tile"}
        found: dict[str, list[_Declaration]] = {}
        for site in _sites(self.k):
            s = site.stmt
            kind = "var" if isinstance(s, ir.Let) and s.mutable else kinds.get(type(s))
            if kind is not None:
                role = site.role.name if site.role is not None else None
                name = s.var if isinstance(s, ir.For) else s.name
                found.setdefault(name, []).append(_Declaration(kind, self.r.line(site.path), site.path, role))
        return found

    # -- kernel header and declarations ---------------------------------------------------------

    def run(self) -> None:
        scope = self._globals()
        self._launch(scope)
        self._block(self.k.body, (), scope, _Ctx(None))
        self._budgets()

    def _globals(self) -> dict[str, _Name]:
        scope: dict[str, _Name] = {"cta_id": _Name("builtin", 0), "num_ctas": _Name("builtin", 0)}
        scalars = {p.name: _Name("scalar param", 1, p) for p in self.k.params if isinstance(p, ir.ScalarParam)}
        seen: dict[str, tuple[str, int]] = {}

        def declare(name, kind, line, decl, report):
            if name in ir.BUILTINS:
                report(f"`{name}` is a builtin name; rename the {kind}")
            elif name in seen:
                other_kind, other_line = seen[name]
                report(f"`{name}` is already declared as a {other_kind} at IR line {other_line} "
                       f"(names are unique in the IR); rename one of them")
            else:
                seen[name] = (kind, line)
                scope[name] = _Name(kind, line, decl)

        for p in self.k.params:
            kind = {ir.ScalarParam: "scalar param", ir.TensorMapParam: "tensormap param",
                    ir.GlobalParam: "global param"}[type(p)]
            what = f"{kind.split()[0]} {p.name}"
            report = lambda problem, what=what: self.r.header(problem, what)  # noqa: E731
            declare(p.name, kind, 1, p, report)
            self._dtype(p.dtype, report)
            if isinstance(p, (ir.TensorMapParam, ir.GlobalParam)):
                for d in p.shape:
                    self._host_expr(d, scalars, report, "a tensor shape")
            if isinstance(p, ir.TensorMapParam):
                self._tensormap(p, report)
        for i, b in enumerate(self.k.smem):
            report = lambda problem, i=i: self.r.smem_decl(i, problem)  # noqa: E731
            declare(b.name, "smem buffer", 2 + i, b, report)
            self._dtype(b.dtype, report)
            if not b.shape or any(d < 1 for d in b.shape):
                report(f"shape {list(b.shape)}: a smem buffer needs at least one dim, each >= 1")
            if b.swizzle not in SWIZZLES:
                report(f"swizzle({b.swizzle}) is not a TMA swizzle; use 0, 32, 64 or 128")
        for j, b in enumerate(self.k.barriers):
            report = lambda problem, j=j: self.r.barrier_decl(j, problem)  # noqa: E731
            declare(b.name, "barrier", 2 + len(self.k.smem) + j, b, report)
            if b.slots < 1:
                report(f"barrier {b.name}[{b.slots}] has no slots; declare at least one")
        return scope

    def _dtype(self, dtype, report) -> None:
        if dtype not in ir.DTYPES:
            report(f"dtype {dtype!r} is not one of {', '.join(ir.DTYPES)}")

    def _tensormap(self, p: ir.TensorMapParam, report) -> None:
        if len(p.box) != len(p.shape):
            report(f"box({', '.join(map(str, p.box))}) has {len(p.box)} dims but the tensor has rank "
                   f"{len(p.shape)}; give one box extent per dim")
        for d in p.box:
            if not 1 <= d <= 256:
                report(f"box extent {d} is outside [1, 256], the range a TMA box allows")
        if p.swizzle not in SWIZZLES:
            report(f"swizzle({p.swizzle}) is not a TMA swizzle; use 0, 32, 64 or 128")
        if not p.box or p.dtype not in ir.DTYPE_BYTES:
            return
        inner = p.box[-1] * ir.DTYPE_BYTES[p.dtype]
        if inner % 16:
            report(f"the box's inner dim is {p.box[-1]} {p.dtype} = {inner} bytes; TMA needs a multiple "
                   f"of 16 bytes")
        if p.swizzle in SWIZZLES[1:] and inner > p.swizzle:
            most = p.swizzle // ir.DTYPE_BYTES[p.dtype]
            report(f"the box's inner dim is {p.box[-1]} {p.dtype} = {inner} bytes, more than the "
                   f"{p.swizzle}-byte swizzle span; use at most {most} {p.dtype} per box row (store "
                   f"wider tiles as column chunks)")

    def _host_expr(self, e, scalars, report, what) -> None:
        for node in _expr_nodes(e):
            if isinstance(node, ir.Var) and node.name not in scalars and node.name != "num_sms":
                report(f"{what} reads `{node.name}`; host-side expressions may read scalar params "
                       f"(and num_sms in the grid) only")

    def _launch(self, scope) -> None:
        scalars = {n: b for n, b in scope.items() if b.kind == "scalar param"}
        self._host_expr(self.k.grid, scalars, lambda m: self.r.header(m, "grid"), "the grid")
        if len(self.k.cluster) != 3 or any(c < 1 for c in self.k.cluster):
            self.r.header(f"cluster{tuple(self.k.cluster)}: give three extents, each >= 1")

    def _budgets(self) -> None:
        roles = self.k.roles()
        threads = self.k.threads
        if threads > MAX_THREADS:
            self.r.header(f"the roles add up to {threads} threads ({threads // 128} warpgroups); a CTA "
                          f"has at most {MAX_THREADS} threads (8 warpgroups)")
        used = sum(r.warpgroups * 128 * r.registers for r in roles)
        if used > REGISTER_FILE:
            terms = " + ".join(f"role {r.name} {r.warpgroups}×128×{r.registers}" for r in roles)
            widest = max(roles, key=lambda r: r.warpgroups * r.registers)
            rest = used - widest.warpgroups * 128 * widest.registers
            fit = (REGISTER_FILE - rest) // (widest.warpgroups * 128) // 8 * 8
            hint = (f"lower the registers of a role, e.g. role {widest.name} registers({fit})"
                    if fit >= 24 else "use fewer warpgroups")
            self.r.header(f"register budget exceeded: {terms} = {used} registers, {used - REGISTER_FILE} "
                          f"over the {REGISTER_FILE} of an SM; {hint}")
        total = self.k.smem_bytes
        if total > SMEM_LIMIT:
            self.r.header(f"shared memory needs {total} bytes (buffers, barriers and alignment), "
                          f"{total - SMEM_LIMIT} over the {SMEM_LIMIT} bytes (227 KB) a CTA can have; "
                          f"use fewer stages or smaller tiles")

    # -- statements -----------------------------------------------------------------------------

    def _block(self, stmts, prefix, scope, ctx, offset=0) -> None:
        scope = dict(scope)
        for i, s in enumerate(stmts):
            path = prefix + (offset + i,)
            if ctx.elected and isinstance(s, _COLLECTIVE):
                self.r.at(path, f"{_keyword(s)} is warpgroup-collective, but elect_one runs its body on one "
                                f"thread; move it out of elect_one")
            getattr(self, "_" + type(s).__name__)(s, path, scope, ctx)

    def _declare(self, name, kind, path, scope, decl=None) -> None:
        line = self.r.line(path)
        if name in ir.BUILTINS:
            self.r.at(path, f"`{name}` is a builtin name; choose another name for the {kind}")
            return
        if name in scope:
            other = scope[name]
            self.r.at(path, f"`{name}` is already declared as a {other.kind} at IR line {other.line} "
                            f"(names are unique in the IR); rename one of them")
        scope[name] = _Name(kind, line, decl)

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
            if d.kind == "register tile" and d.role != role:
                owner = f"role {d.role}" if d.role else "kernel level"
                return (f"register tile `{name}` belongs to {owner} (IR line {d.line}); register tiles "
                        f"are per warpgroup and visible only inside the role that declares them")
            if d.role == role and d.line > line:
                return (f"`{name}` is used before its declaration ({d.kind} at IR line {d.line}); "
                        f"declare it before this statement")
        if name in self.declarations:
            d = min(self.declarations[name], key=lambda d: d.role != role)     # this role's first
            return (f"`{name}` is declared at IR line {d.line} ({_where(self.k, d.path)}), which does "
                    f"not enclose this statement; declare it in this block or an enclosing one")
        return (f"`{name}` is not declared; expressions read scalar params, builtins (cta_id, num_ctas, "
                f"wg inside a role), loop variables and the lets/vars of enclosing blocks")

    def _expr(self, e, path, scope, ctx) -> None:
        for node in _expr_nodes(e):
            if isinstance(node, ir.Var):
                b = scope.get(node.name)
                if b is None:
                    self.r.at(path, self._undeclared(node.name, path, ctx))
                elif b.kind not in _SCALARS:
                    self.r.at(path, f"`{node.name}` is a {b.kind}, not a scalar; expressions read scalar "
                                    f"params, builtins, loop variables and lets/vars")
            elif isinstance(node, ir.BinOp) and node.op not in ir.BINARY_PRECEDENCE:
                self.r.at(path, f"`{node.op}` is not an operator of the IR; use one of "
                                f"{' '.join(ir.BINARY_PRECEDENCE)}")
            elif isinstance(node, ir.Call) and ir.CALLS.get(node.func) != len(node.args):
                if node.func in ir.CALLS:
                    self.r.at(path, f"{node.func}() takes {ir.CALLS[node.func]} arguments, not "
                                    f"{len(node.args)}")
                else:
                    self.r.at(path, f"`{node.func}` is not a function of the IR; use one of "
                                    f"{', '.join(ir.CALLS)}")

    def _lookup(self, name, kind, path, scope, ctx, what):
        """The declaration behind `name` if it is a `kind` in scope, else report and None."""
        b = scope.get(name)
        if b is not None and b.kind == kind:
            return b.decl
        known = ", ".join(n for n, x in scope.items() if x.kind == kind) or "none"
        if b is not None:
            self.r.at(path, f"{what} `{name}` is a {b.kind}, not a {kind} (declared: {known})")
        elif kind == "register tile":
            message = self._undeclared(name, path, ctx)
            if name not in self.declarations:
                message = (f"`{name}` is not a register tile; declare it in this role with "
                           f"`reg {name}: f32[rows, cols]`")
            self.r.at(path, message)
        else:
            self.r.at(path, f"{what} `{name}` is not a declared {kind} (declared: {known})")
        return None

    def _tile(self, name, path, scope, ctx) -> "ir.RegDecl | None":
        return self._lookup(name, "register tile", path, scope, ctx, "tile")

    def _smem(self, ref: ir.SmemRef, path, scope, ctx) -> "ir.SmemDecl | None":
        decl = self._lookup(ref.buffer, "smem buffer", path, scope, ctx, "buffer")
        for e in ref.index:
            self._expr(e, path, scope, ctx)
        if decl is None:
            return None
        if len(ref.index) >= len(decl.shape):
            self.r.at(path, f"`{_ref(ref)}` has {len(ref.index)} indices but {decl.name} is "
                            f"{_array(decl.dtype, decl.shape)} (rank {len(decl.shape)}); a reference "
                            f"selects a sub-array, so use at most {len(decl.shape) - 1}")
            return None
        for dim, e in enumerate(ref.index):
            v = _constant(e)
            if isinstance(v, int) and not 0 <= v < decl.shape[dim]:
                self.r.at(path, f"`{_ref(ref)}`: index {v} is out of range for dim {dim} of {decl.name} "
                                f"(extent {decl.shape[dim]}); valid indices are 0..{decl.shape[dim] - 1}")
                return None
        return decl

    def _bar(self, ref: ir.BarRef, path, scope, ctx) -> "ir.BarrierDecl | None":
        decl = self._lookup(ref.barrier, "barrier", path, scope, ctx, "barrier")
        self._expr(ref.index, path, scope, ctx)
        if decl is None:
            return None
        v = _constant(ref.index)
        if isinstance(v, int) and not 0 <= v < decl.slots:
            self.r.at(path, f"`{_ref(ref)}`: barrier {decl.name} has {decl.slots} slots "
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
        elif b.kind == "let":
            self.r.at(path, f"`set {s.name}` updates a let (immutable, IR line {b.line}); declare it with "
                            f"`var {s.name} = ...` to update it")
        elif b.kind != "var":
            self.r.at(path, f"`set {s.name}` updates a {b.kind}; only a `var` can be updated")

    def _For(self, s: ir.For, path, scope, ctx):
        for e in (s.start, s.stop, s.step):
            self._expr(e, path, scope, ctx)
        if s.kind not in LOOP_KINDS:
            self.r.at(path, f"loop kind `{s.kind}` is not one of {', '.join(LOOP_KINDS)}")
        step = _constant(s.step)
        if isinstance(step, (int, float)) and step <= 0:
            self.r.at(path, f"step {_text(s.step)}: a loop counts up; use a step >= 1")
        inner = dict(scope)
        self._declare(s.var, "loop variable", path, inner)
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
        if s.registers % 8 or not 24 <= s.registers <= 256:
            self.r.at(path, f"registers({s.registers}): a role's register count must be a multiple of 8 "
                            f"in [24, 256] (what setmaxnreg can set)")
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
        if s.action not in SETMAXNREG_ACTIONS:
            self.r.at(path, f"setmaxnreg.{s.action}: the action is inc or dec")
        if s.registers % 8 or not 24 <= s.registers <= 256:
            self.r.at(path, f"setmaxnreg {s.registers}: the register count must be a multiple of 8 in "
                            f"[24, 256]")
        if ctx.role is None:
            self.r.at(path, "setmaxnreg outside a role; it belongs at the start of a role's body")
        elif s.registers != ctx.role.registers:
            self.r.at(path, f"setmaxnreg.{s.action} {s.registers} in role {ctx.role.name} "
                            f"registers({ctx.role.registers}); the role's budget and its setmaxnreg must "
                            f"agree: use setmaxnreg.{s.action} {ctx.role.registers} (or "
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
        if s.barrier in self.inits:
            self.r.at(path, f"barrier `{s.barrier}` is initialised twice (first at IR line "
                            f"{self.inits[s.barrier]}); initialise it once")
        self.inits.setdefault(s.barrier, self.r.line(path))
        self.unfenced_init, self.fenced = True, False

    def _MbarrierArrive(self, s: ir.MbarrierArrive, path, scope, ctx):
        self._bar(s.bar, path, scope, ctx)

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

    def _named_barrier(self, s, path, scope, ctx):
        verb = _keyword(s)
        self._expr(s.id, path, scope, ctx)
        reads_wg = "wg" in ir.expr_vars(s.id)
        wgs = range(ctx.role.warpgroups) if ctx.role is not None and reads_wg else [None]
        for wg in wgs:
            try:
                bid = evaluate(s.id, {} if wg is None else {"wg": wg})
            except (KeyError, ZeroDivisionError, TypeError):
                break
            if not 1 <= bid <= 15:
                at = "" if wg is None else f" for wg = {wg}"
                self.r.at(path, f"{verb} {_text(s.id)}: barrier id {bid}{at} is outside [1, 15] (id 0 is "
                                f"the barrier syncthreads uses); use ids 1..15")
                break
        unit = 128 if ctx.role is not None else 32
        if s.threads < 1 or s.threads % unit:
            what = "whole warpgroups inside a role" if unit == 128 else "whole warps"
            self.r.at(path, f"{verb} {_text(s.id)}, {s.threads}: the thread count must be a multiple of "
                            f"{unit} ({what})")
        if s.threads > self.k.threads:
            self.r.at(path, f"{verb} {_text(s.id)}, {s.threads}: more threads than the block has "
                            f"({self.k.threads}); count only the participating threads")

    _NamedBarrierSync = _named_barrier
    _NamedBarrierArrive = _named_barrier

    def _tma(self, verb, ref: ir.SmemRef, tensor, coords, path, scope, ctx) -> None:
        decl = self._smem(ref, path, scope, ctx)
        for c in coords:
            self._expr(c, path, scope, ctx)
        b = scope.get(tensor)
        param = b.decl if b is not None and b.kind == "tensormap param" else None
        if b is None:
            self.r.at(path, f"{verb} uses `{tensor}`, which is not a kernel parameter; declare it as "
                            f"`tensormap {tensor}: dtype[shape] box(...) swizzle(...)`")
        elif param is None:
            self.r.at(path, f"{verb} needs a tensormap param, but `{tensor}` is a {b.kind}; declare it "
                            f"as `tensormap {tensor}: ...`")
        if param is None:
            return
        coord_text = f"{tensor}[{', '.join(_text(c) for c in coords)}]"
        if len(coords) != len(param.shape):
            self.r.at(path, f"{verb} {coord_text} gives {_count(len(coords), 'coordinate')} but tensormap {tensor} "
                            f"is {_array(param.dtype, param.shape)} (rank {len(param.shape)}); give one "
                            f"coordinate per dim, outermost first")
        if decl is None or param.dtype not in ir.DTYPE_BYTES or decl.dtype not in ir.DTYPE_BYTES:
            return
        sub = ir.smem_subshape(decl, ref)
        box_bytes = _volume(param.box) * ir.DTYPE_BYTES[param.dtype]
        sub_bytes = _volume(sub) * ir.DTYPE_BYTES[decl.dtype]
        if param.dtype != decl.dtype:
            direction = "into" if verb == "tma.load" else "from"
            self.r.at(path, f"{verb} copies {param.dtype} (tensormap {tensor}) {direction} {decl.name}, "
                            f"which is {decl.dtype}; TMA does not convert: declare {decl.name} as "
                            f"{param.dtype}")
        elif box_bytes != sub_bytes:
            self.r.at(path, f"{verb} moves one box({', '.join(map(str, param.box))}) of {param.dtype} = "
                            f"{box_bytes} bytes but {_ref(ref)} is {_array(decl.dtype, sub)} = {sub_bytes} "
                            f"bytes; the smem sub-array must hold exactly one box")
        if param.swizzle != decl.swizzle:
            self.r.at(path, f"tensormap {tensor} has swizzle({param.swizzle}) but smem {decl.name} has "
                            f"swizzle({decl.swizzle}); TMA lays the box out with the map's swizzle, so both "
                            f"must agree")

    def _TmaLoad(self, s: ir.TmaLoad, path, scope, ctx):
        self._tma("tma.load", s.dst, s.tensor, s.coords, path, scope, ctx)
        self._bar(s.bar, path, scope, ctx)

    def _TmaStore(self, s: ir.TmaStore, path, scope, ctx):
        self._tma("tma.store", s.src, s.tensor, s.coords, path, scope, ctx)

    def _TmaCommit(self, s, path, scope, ctx):
        pass

    def _TmaWait(self, s: ir.TmaWait, path, scope, ctx):
        if s.pending < 0:
            self.r.at(path, f"{_keyword(s)} {s.pending}: the pending count is >= 0")

    _WgmmaFence = _WgmmaCommit = _FenceProxyAsync

    def _WgmmaWait(self, s: ir.WgmmaWait, path, scope, ctx):
        if s.pending < 0:
            self.r.at(path, f"wgmma.wait {s.pending}: the pending count is >= 0")

    def _smem_tile(self, ref, decl, path) -> "tuple[int, int] | None":
        sub = ir.smem_subshape(decl, ref)
        try:
            return ir.tile_shape_of_subarray(sub)
        except ValueError:
            self.r.at(path, f"`{_ref(ref)}` is a {_array(decl.dtype, sub)} sub-array, which holds no 2-D "
                            f"tile; select a [rows, cols] or (chunks, rows, width) sub-array")
            return None

    def _Wgmma(self, s: ir.Wgmma, path, scope, ctx):
        self._expr(s.accumulate, path, scope, ctx)
        for which, major in (("a", s.a_major), ("b", s.b_major)):
            if major not in MMA_MAJORS:
                self.r.at(path, f"major({s.a_major}, {s.b_major}): {which}'s major must be k or n")
        acc = self._tile(s.acc, path, scope, ctx)
        n = k = a_dtype = None
        if acc is not None:
            if (acc.dtype != "f32" or len(acc.shape) != 2 or acc.shape[0] != 64 or acc.shape[1] % 8
                    or not 8 <= acc.shape[1] <= 256):
                self.r.at(path, f"the accumulator {s.acc} is {_array(acc.dtype, acc.shape)}; wgmma "
                                f"accumulates into an f32[64, N] register tile with N a multiple of 8 in "
                                f"[8, 256]")
            else:
                n = acc.shape[1]
        if isinstance(s.a, ir.SmemRef):
            a_name = _ref(s.a)
            decl = self._smem(s.a, path, scope, ctx)
            tile = self._smem_tile(s.a, decl, path) if decl is not None else None
            if tile is not None:
                a_dtype = decl.dtype
                rows, k = tile if s.a_major == "k" else (tile[1], tile[0])
        else:
            a_name = s.a
            reg = self._tile(s.a, path, scope, ctx)
            if s.a_major != "k":
                self.r.at(path, f"A from registers ({s.a}) is K-major; use major(k, {s.b_major})")
            tile = None
            if reg is not None and len(reg.shape) == 2:
                a_dtype = reg.dtype
                rows, k = reg.shape
                tile = reg.shape
        if tile is not None and (rows != 64 or k % 16 or k < 16):
            self.r.at(path, f"A operand {a_name} holds a [{rows}, {k}] tile; wgmma's A is [64, K] with K a "
                            f"multiple of 16")
            k = None
        if a_dtype is not None and a_dtype not in ("bf16", "f16"):
            self.r.at(path, f"A operand {a_name} is {a_dtype}; wgmma multiplies bf16 or f16")
        decl = self._smem(s.b, path, scope, ctx)
        tile = self._smem_tile(s.b, decl, path) if decl is not None else None
        if tile is None:
            return
        if a_dtype is not None and decl.dtype != a_dtype:
            self.r.at(path, f"B operand {_ref(s.b)} is {decl.dtype} but A is {a_dtype}; both operands "
                            f"must have one dtype")
        b_n, b_k = tile if s.b_major == "k" else (tile[1], tile[0])
        if n is not None and k is not None and (b_n, b_k) != (n, k):
            sub = list(ir.smem_subshape(decl, s.b))
            if s.b_major == "k":
                want = f"[{n}, {k}] (K-major: [N, K])"
            else:
                want = f"({n // 64}, {k}, 64) (N-major column chunks)" if n % 64 == 0 else f"[{k}, {n}]"
            self.r.at(path, f"B operand {_ref(s.b)} is {sub}, a tile with N = {b_n} and K = {b_k}, but the "
                            f"accumulator {s.acc} has N = {n} and A has K = {k}; B must be {want}")

    def _RegDecl(self, s: ir.RegDecl, path, scope, ctx):
        self._dtype(s.dtype, lambda m: self.r.at(path, m))
        if not s.shape or any(d < 1 for d in s.shape):
            self.r.at(path, f"shape {list(s.shape)}: a register tile needs at least one dim, each >= 1")
        self._declare(s.name, "register tile", path, scope, s)

    def _TileFill(self, s: ir.TileFill, path, scope, ctx):
        self._tile(s.dst, path, scope, ctx)
        self._expr(s.value, path, scope, ctx)

    def _TileUnary(self, s: ir.TileUnary, path, scope, ctx):
        if s.op not in ir.UNARY_OPS:
            self.r.at(path, f"tile.{s.op} is not a unary tile op; use one of {', '.join(ir.UNARY_OPS)}")
        dst = self._tile(s.dst, path, scope, ctx)
        src = self._tile(s.src, path, scope, ctx)
        if dst is not None and src is not None and dst.shape != src.shape:
            self.r.at(path, f"tile.{s.op} {s.dst}, {s.src}: {s.src} is {_array(src.dtype, src.shape)} but "
                            f"{s.dst} is {_array(dst.dtype, dst.shape)}; an elementwise op keeps the shape")

    def _TileBinary(self, s: ir.TileBinary, path, scope, ctx):
        if s.op not in ir.BINARY_OPS:
            self.r.at(path, f"tile.{s.op} is not a binary tile op; use one of {', '.join(ir.BINARY_OPS)}")
        dst = self._tile(s.dst, path, scope, ctx)
        shapes = []
        for operand in (s.lhs, s.rhs):
            if isinstance(operand, str):
                t = self._tile(operand, path, scope, ctx)
                if t is None:
                    return
                shapes.append((operand, t.shape))
            else:
                self._expr(operand, path, scope, ctx)
        if dst is None or not shapes:
            return
        names = ", ".join(f"{name} {list(shape)}" for name, shape in shapes)
        if any(len(shape) != len(dst.shape) for _, shape in shapes):
            self.r.at(path, f"tile.{s.op} {s.dst}: operands {names} and result {list(dst.shape)} differ in "
                            f"rank; tiles of one op have one rank (extent 1 broadcasts)")
            return
        result = tuple(max(shape[d] for _, shape in shapes) for d in range(len(dst.shape)))
        bad = any(x not in (1, r) for _, shape in shapes for x, r in zip(shape, result))
        if bad or result != tuple(dst.shape):
            self.r.at(path, f"tile.{s.op} {s.dst}: operands {names} do not broadcast to the result "
                            f"{list(dst.shape)}; each dim must equal the result's or be 1")

    def _TileMask(self, s: ir.TileMask, path, scope, ctx):
        dst = self._tile(s.dst, path, scope, ctx)
        for e in (s.row0, s.col0, s.limit) + (() if s.causal is None else (s.causal,)):
            self._expr(e, path, scope, ctx)
        if dst is not None and len(dst.shape) != 2:
            self.r.at(path, f"tile.mask {s.dst}: {s.dst} is {list(dst.shape)}; the mask applies to a 2-D tile")

    def _TileReduce(self, s: ir.TileReduce, path, scope, ctx):
        if s.op not in ir.REDUCE_OPS:
            self.r.at(path, f"tile.reduce.{s.op} is not a reduction; use one of {', '.join(ir.REDUCE_OPS)}")
        dst = self._tile(s.dst, path, scope, ctx)
        src = self._tile(s.src, path, scope, ctx)
        if dst is None or src is None:
            return
        if not 0 <= s.axis < len(src.shape):
            self.r.at(path, f"axis({s.axis}) is out of range for {s.src} {list(src.shape)}; use 0.."
                            f"{len(src.shape) - 1}")
            return
        want = tuple(1 if d == s.axis else x for d, x in enumerate(src.shape))
        if tuple(dst.shape) != want:
            self.r.at(path, f"tile.reduce.{s.op} {s.dst}, {s.src}, axis({s.axis}): {s.dst} is "
                            f"{list(dst.shape)} but reducing {list(src.shape)} over axis {s.axis} gives "
                            f"{list(want)}; declare {s.dst} with that shape")

    def _global_tile(self, verb, tensor, coords, tile_name, path, scope, ctx) -> None:
        for c in coords:
            self._expr(c, path, scope, ctx)
        param = self._lookup(tensor, "global param", path, scope, ctx, "tensor")
        t = self._tile(tile_name, path, scope, ctx)
        if param is None:
            return
        if len(coords) != len(param.shape):
            self.r.at(path, f"{verb} {tensor}[{', '.join(_text(c) for c in coords)}] gives "
                            f"{_count(len(coords), 'coordinate')} but {tensor} is {_array(param.dtype, param.shape)} (rank "
                            f"{len(param.shape)}); give one coordinate per dim")
        if t is None:
            return
        extra = len(t.shape) - len(param.shape)
        if extra > 0 and any(d != 1 for d in t.shape[:extra]):
            self.r.at(path, f"{verb}: tile {tile_name} {list(t.shape)} does not fit {tensor} (rank "
                          f"{len(param.shape)}); the tile covers the tensor's trailing dims, and its "
                          f"dims beyond the tensor's rank must be 1")

    def _TileLoadGlobal(self, s: ir.TileLoadGlobal, path, scope, ctx):
        self._global_tile("tile.load", s.tensor, s.coords, s.dst, path, scope, ctx)

    def _TileStoreGlobal(self, s: ir.TileStoreGlobal, path, scope, ctx):
        self._global_tile("tile.store", s.tensor, s.coords, s.src, path, scope, ctx)

    def _TileStoreSmem(self, s: ir.TileStoreSmem, path, scope, ctx):
        decl = self._smem(s.dst, path, scope, ctx)
        t = self._tile(s.src, path, scope, ctx)
        if decl is None or t is None:
            return
        holds = self._smem_tile(s.dst, decl, path)
        if holds is not None and tuple(t.shape) != holds:
            self.r.at(path, f"tile.store_smem {_ref(s.dst)} <- {s.src}: {s.src} is {list(t.shape)} but "
                            f"{_ref(s.dst)} ({list(ir.smem_subshape(decl, s.dst))}) holds a {list(holds)} "
                            f"tile; the tile and the sub-array must have one shape")


# ---------------------------------------------------------------------------------------------
# The load/compute contract
# ---------------------------------------------------------------------------------------------


def _lets_before(kernel: ir.Kernel, path: tuple[int, ...]) -> dict[str, ir.Expr]:
    """The `let` definitions in scope at `path`, each substituted into the ones after it."""
    lets: dict[str, ir.Expr] = {}
    for depth in range(1, len(path) + 1):
        stmts, index, _ = _block_of(kernel, path[:depth])
        for s in stmts[:index]:
            if isinstance(s, ir.Let) and not s.mutable:
                lets[s.name] = subst(s.value, lets)
    return lets


@dataclass
class _Channel:
    full: str
    empty: "str | None"
    buffers: set
    expect_tx: _Site                  # the producer's first arrive_expect_tx on `full`
    mismatched_roles: set = field(default_factory=set)   # consumer roles whose loop nest differs


class _Contract:
    def __init__(self, kernel: ir.Kernel, report: _Report):
        self.k = kernel
        self.r = report
        self.sites = _sites(kernel)
        self.reported: set = set()
        self.inits = {s.stmt.barrier: s for s in self.sites if isinstance(s.stmt, ir.MbarrierInit)}

    def once(self, key, path, problem, cause=None) -> None:
        """Report `problem` at `path` unless this check already reported there (or, given a
        `cause` path, already reported anything that cause led to): a rule broken on one sample
        point is broken at many, and the first one says it."""
        seen = (key, cause if cause is not None else path)
        if seen not in self.reported:
            self.reported.add(seen)
            self.r.at(path, problem)

    def run(self) -> None:
        self._load_blocks()
        channels = self._channels()
        for ch in channels:
            self._channel_declarations(ch)
            ch.mismatched_roles = self._same_nests(ch)
        if self.k.roles():
            for sample in _samples(self.k):
                traces = _Tracer(self.k, sample.env).run()
                if traces is not None:
                    _TraceCheck(self, channels, traces, sample).run()

    # -- static ---------------------------------------------------------------------------------

    def _load_blocks(self) -> None:
        """Each tma.load: elected, announced by an arrive_expect_tx on its barrier earlier in the
        same block, completing on the slot of its destination's stage; each expect_tx: the bytes
        of the loads it announces."""
        blocks = [(self.k.body, (), 0)]
        for site in self.sites:
            s = site.stmt
            if isinstance(s, ir.If):
                blocks += [(s.then, site.path, 0), (s.orelse, site.path, len(s.then))]
            elif ir.child_blocks(s):
                blocks.append((s.body, site.path, 0))
        by_path = {site.path: site for site in self.sites}
        for stmts, prefix, offset in blocks:
            announced: dict[ir.BarRef, list] = {}       # barrier -> loads since its latest expect_tx
            groups: list[tuple[ir.MbarrierArriveExpectTx, tuple[int, ...], list]] = []
            for i, s in enumerate(stmts):
                path = prefix + (offset + i,)
                if isinstance(s, ir.MbarrierArriveExpectTx):
                    groups.append((s, path, []))
                    announced[s.bar] = groups[-1][2]
                elif isinstance(s, ir.TmaLoad):
                    self._load(s, by_path[path], announced)
            for s, path, loads in groups:
                self._expect_tx_bytes(s, path, loads)

    def _load(self, s: ir.TmaLoad, site: _Site, announced) -> None:
        if not any(isinstance(a, ir.ElectOne) for a in site.ancestors):
            self.r.at(site.path, "tma.load outside elect_one would be issued by every thread of the "
                                 "warpgroup; put the producer's loads inside `elect_one { ... }`")
        if s.bar in announced:
            announced[s.bar].append(s)
        else:
            self.r.at(site.path, f"tma.load completes on {_ref(s.bar)} but no `mbarrier.arrive_expect_tx "
                                 f"{_ref(s.bar)} bytes(...)` precedes it in this block; announce the "
                                 f"stage's bytes on that barrier before the loads")
        if not s.dst.index:
            self.r.at(site.path, f"tma.load into {s.dst.buffer} without a stage index; a channel buffer "
                                 f"is selected by its stage: {s.dst.buffer}[s]")
        elif s.bar.index != s.dst.index[0]:
            self.r.at(site.path, f"tma.load {_ref(s.dst)} completes on {_ref(s.bar)}: the barrier slot "
                                 f"must be the destination's stage, {s.bar.barrier}[{_text(s.dst.index[0])}]")

    def _load_bytes(self, s: ir.TmaLoad) -> "int | None":
        try:
            p = self.k.param(s.tensor)
            decl = self.k.smem_decl(s.dst.buffer)
        except KeyError:
            return None
        if isinstance(p, ir.TensorMapParam) and p.dtype in ir.DTYPE_BYTES:
            return _volume(p.box) * ir.DTYPE_BYTES[p.dtype]
        return _volume(ir.smem_subshape(decl, s.dst)) * ir.DTYPE_BYTES.get(decl.dtype, 0)

    def _expect_tx_bytes(self, s: ir.MbarrierArriveExpectTx, path, loads) -> None:
        announced = _constant(subst(s.bytes, _lets_before(self.k, path)))
        if not isinstance(announced, int):
            self.r.at(path, f"bytes({_text(s.bytes)}) is not a constant; TMA delivers whole boxes "
                            f"(out-of-bounds elements included), so announce their constant sum")
            return
        sizes = [self._load_bytes(ld) for ld in loads]
        if None in sizes:
            return
        if not loads:
            self.r.at(path, f"expect_tx announces {announced} bytes but no tma.load into {_ref(s.bar)} "
                            f"follows it in this block; announce the bytes right before the loads")
        elif sum(sizes) != announced:
            parts = " + ".join(f"{_ref(ld.dst)} {n}" for ld, n in zip(loads, sizes))
            self.r.at(path, f"expect_tx announces {announced} bytes but the loads into {_ref(s.bar)} "
                            f"deliver {sum(sizes)} ({parts}); use bytes({sum(sizes)})")

    def _channels(self) -> list[_Channel]:
        channels: dict[str, _Channel] = {}
        for site in self.sites:
            s = site.stmt
            if isinstance(s, ir.TmaLoad) and site.role is not None:
                ch = channels.get(s.bar.barrier)
                if ch is None:
                    expect = next((x for x in self.sites if isinstance(x.stmt, ir.MbarrierArriveExpectTx)
                                   and x.stmt.bar.barrier == s.bar.barrier and x.role is site.role), None)
                    if expect is None:
                        continue            # reported with the load
                    ch = channels[s.bar.barrier] = _Channel(s.bar.barrier, self._empty_of(expect), set(),
                                                            expect)
                ch.buffers.add(s.dst.buffer)
        return list(channels.values())

    def _empty_of(self, expect: _Site) -> "str | None":
        """The barrier the producer waits on right before announcing a stage (producer_acquire)."""
        stmts, index, _ = _block_of(self.k, expect.path)
        full = expect.stmt.bar.barrier
        for s in reversed(stmts[:index]):
            if isinstance(s, ir.MbarrierWait) and s.bar.barrier != full:
                return s.bar.barrier
        self.r.at(expect.path, f"the producer announces {_ref(expect.stmt.bar)} without first waiting for "
                               f"the stage to be free; put `mbarrier.wait empty[...] phase(ph ^ 1)` "
                               f"(producer_acquire) before it")
        return None

    def _channel_declarations(self, ch: _Channel) -> None:
        barriers = {b.name: (j, b) for j, b in enumerate(self.k.barriers)}
        for name in filter(None, (ch.full, ch.empty)):
            if name not in barriers:
                continue
            j, bar = barriers[name]
            stages: dict[int, list[str]] = {}
            for buf in sorted(ch.buffers):
                decl = next((b for b in self.k.smem if b.name == buf and b.shape), None)
                if decl is not None and decl.shape[0] != bar.slots:
                    stages.setdefault(decl.shape[0], []).append(buf)
            for n, bufs in stages.items():
                self.r.barrier_decl(j, f"barrier {name} has {_count(bar.slots, 'slot')} but its channel "
                                       f"{'buffers' if len(bufs) > 1 else 'buffer'} {', '.join(bufs)} "
                                       f"{'have' if len(bufs) > 1 else 'has'} {_count(n, 'stage')}; a channel "
                                       f"has one full and one empty barrier per stage: declare {name}[{n}]")
        init = self.inits.get(ch.full)
        if init is not None and init.stmt.arrivals != 1:
            self.r.at(init.path, f"{ch.full} is initialised with arrivals({init.stmt.arrivals}), but a full "
                                 f"barrier's phase is completed by the one elected producer thread's "
                                 f"arrive_expect_tx (plus the TMA bytes); use arrivals(1)")

    def _same_nests(self, ch: _Channel) -> set:
        """Both sides' loop nests around the channel have the same bounds, after substituting
        lets and renaming loop variables by nest position. Returns the paths of the consumer
        roles whose nest differs (their stage sequence is not compared again on the traces)."""
        mismatched = set()
        producer = ch.expect_tx.loops()
        waits = [x for x in self.sites if isinstance(x.stmt, ir.MbarrierWait)
                 and x.stmt.bar.barrier == ch.full and x.role is not None]
        checked_roles = set()
        for wait in waits:
            if wait.role_path in checked_roles:
                continue
            checked_roles.add(wait.role_path)
            consumer = wait.loops()
            if len(consumer) != len(producer):
                names = lambda nest: " > ".join(f"for {f.var}" for f, _ in nest) or "no loop"  # noqa: E731
                self.r.at(wait.path, f"the consumer waits on {ch.full} inside {_count(len(consumer), 'loop')} "
                                     f"({names(consumer)}) but the producer fills it inside "
                                     f"{len(producer)} ({names(producer)}); {_SAME_ORDER}")
                mismatched.add(wait.role_path)
                continue
            p_rename: dict[str, ir.Expr] = {}
            c_rename: dict[str, ir.Expr] = {}
            for level, ((pf, ppath), (cf, cpath)) in enumerate(zip(producer, consumer)):
                p_lets, c_lets = _lets_before(self.k, ppath), _lets_before(self.k, cpath)
                p_bounds = [subst(e, p_lets) for e in (pf.start, pf.stop, pf.step)]
                c_bounds = [subst(e, c_lets) for e in (cf.start, cf.stop, cf.step)]
                same = ([subst(e, p_rename) for e in p_bounds] == [subst(e, c_rename) for e in c_bounds]
                        and (pf.kind == "persistent") == (cf.kind == "persistent"))
                if not same:
                    spell = lambda f, b: f"{f.kind}({', '.join(_text(e) for e in b)})"  # noqa: E731
                    self.r.at(cpath, f"the consumer's for {cf.var} runs {spell(cf, c_bounds)} but the "
                                     f"producer's for {pf.var} (IR line {self.r.line(ppath)}) runs "
                                     f"{spell(pf, p_bounds)}; {_SAME_ORDER}")
                    mismatched.add(wait.role_path)
                    break
                p_rename[pf.var] = c_rename[cf.var] = ir.Var(f"loop{level}")
        return mismatched


# -- running the roles on the host -----------------------------------------------------------------


@dataclass(frozen=True)
class _Sample:
    env: dict
    text: str


def _samples(kernel: ir.Kernel) -> list[_Sample]:
    """A few problem sizes (every i32 param gets a value; several k-tile counts around typical
    stage counts, partial tiles included) and CTA positions."""
    ints = ((256, 384, 320, 192, 448, 130), (384, 130, 200, 448, 256, 320), (130, 256, 64, 320, 192, 384))
    ctas = ((0, 2), (1, 3), (0, 1))
    out = []
    for values, (cta, num) in zip(ints, ctas):
        env: dict = {}
        scalars = [p for p in kernel.params if isinstance(p, ir.ScalarParam)]
        for i, p in enumerate(scalars):
            env[p.name] = values[i % len(values)] if p.dtype == "i32" else 1.0
        env.update(cta_id=cta, num_ctas=num)
        text = ", ".join(f"{k}={v}" for k, v in env.items())
        out.append(_Sample(env, text))
    return out


@dataclass(frozen=True)
class _Event:
    kind: str                          # wait | arrive | expect_tx | mma | commit | mma_wait |
    path: tuple[int, ...]              # smem_write | fence_proxy | bar_sync | tma_store
    bar: str = ""
    slot: int = -1
    value: int = 0                     # wait: parity; mma_wait: pending groups
    refs: tuple = ()                   # smem touched: ((buffer, index values, text), ...)
    point: tuple = ()                  # ((loop var, value), ...), outermost first


class _Abort(Exception):
    """A sample the host cannot run (unbound name, division by zero, too many steps)."""


class _Stop(Exception):
    """`return`: the warpgroup leaves the kernel."""


class _Tracer:
    MAX_STEPS = 200_000
    PERSISTENT_TILES = 2

    def __init__(self, kernel: ir.Kernel, env: dict):
        self.k = kernel
        self.env = env
        self.steps = 0
        self.traces: dict[tuple[tuple[int, ...], int], tuple[ir.Role, list[_Event]]] = {}

    def run(self):
        try:
            self._exec(self.k.body, (), dict(self.env), (), None)
        except _Abort:
            return None
        return self.traces

    def _eval(self, e, env):
        try:
            return evaluate(e, env)
        except (KeyError, ZeroDivisionError, TypeError, ValueError):
            raise _Abort() from None

    def _exec(self, stmts, prefix, env, point, out, offset=0) -> None:
        for i, s in enumerate(stmts):
            path = prefix + (offset + i,)
            self.steps += 1
            if self.steps > self.MAX_STEPS:
                raise _Abort()
            if isinstance(s, ir.Let):
                env[s.name] = self._eval(s.value, env)
            elif isinstance(s, ir.Assign):
                env[s.name] = self._eval(s.value, env)
            elif isinstance(s, ir.For):
                start, stop, step = (self._eval(e, env) for e in (s.start, s.stop, s.step))
                if step <= 0:
                    raise _Abort()
                limit = self.PERSISTENT_TILES if s.kind == "persistent" else None
                for n, v in enumerate(range(start, stop, step)):
                    if limit is not None and n == limit:
                        break
                    env[s.var] = v
                    self._exec(s.body, path, env, point + ((s.var, v),), out)
            elif isinstance(s, ir.If):
                if self._eval(s.cond, env):
                    self._exec(s.then, path, env, point, out)
                else:
                    self._exec(s.orelse, path, env, point, out, len(s.then))
            elif isinstance(s, ir.Role):
                if out is not None:
                    raise _Abort()
                for wg in range(s.warpgroups):
                    events: list[_Event] = []
                    try:
                        self._exec(s.body, path, dict(env, wg=wg), (), events)
                    except _Stop:
                        pass
                    self.traces[(path, wg)] = (s, events)
            elif isinstance(s, ir.ElectOne):
                self._exec(s.body, path, env, point, out)
            elif isinstance(s, ir.Return):
                if out is not None:
                    raise _Stop()
            elif out is not None:
                event = self._event(s, path, env, point)
                if event is not None:
                    out.append(event)

    def _event(self, s, path, env, point) -> "_Event | None":
        if isinstance(s, ir.MbarrierWait):
            return _Event("wait", path, s.bar.barrier, self._eval(s.bar.index, env),
                          self._eval(s.phase, env), point=point)
        if isinstance(s, ir.MbarrierArrive):
            return _Event("arrive", path, s.bar.barrier, self._eval(s.bar.index, env), point=point)
        if isinstance(s, ir.MbarrierArriveExpectTx):
            return _Event("expect_tx", path, s.bar.barrier, self._eval(s.bar.index, env), point=point)
        if isinstance(s, ir.Wgmma):
            refs = [r for r in (s.a, s.b) if isinstance(r, ir.SmemRef)]
            return _Event("mma", path, refs=self._refs(refs, env), point=point)
        if isinstance(s, ir.TileStoreSmem):
            return _Event("smem_write", path, refs=self._refs([s.dst], env), point=point)
        if isinstance(s, ir.TmaStore):
            return _Event("tma_store", path, refs=self._refs([s.src], env), point=point)
        kind = _PLAIN_EVENTS.get(type(s))
        if kind is not None:
            return _Event(kind, path, value=getattr(s, "pending", 0), point=point)
        return None

    def _refs(self, refs, env) -> tuple:
        return tuple((r.buffer, tuple(self._eval(i, env) for i in r.index), _ref(r)) for r in refs)


_PLAIN_EVENTS = {ir.WgmmaCommit: "commit", ir.WgmmaWait: "mma_wait", ir.FenceProxyAsync: "fence_proxy",
                 ir.NamedBarrierSync: "bar_sync"}


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two references (buffer, index values) may touch the same elements."""
    n = min(len(a[1]), len(b[1]))
    return a[0] == b[0] and a[1][:n] == b[1][:n]


@dataclass
class _Use:
    slot: int
    wait: _Event
    releases: int = 0


class _TraceCheck:
    """The contract on one sample's traces: the same stage sequence on both sides of every
    channel, the parity each use must wait for, the arrivals that release a stage, and no release
    while a wgmma reading the stage may be pending."""

    def __init__(self, contract: _Contract, channels: list[_Channel], traces, sample: _Sample):
        self.c = contract
        self.k = contract.k
        self.channels = channels
        self.traces = traces
        self.sample = sample

    def where(self, role: ir.Role, wg: int, e: _Event) -> str:
        point = ", ".join(f"{v}={x}" for v, x in e.point)
        if role.warpgroups > 1:
            point = f"wg={wg}" + (f", {point}" if point else "")
        return f"{point} ({self.sample.text})" if point else f"({self.sample.text})"

    def run(self) -> None:
        for ch in self.channels:
            fills = self._producer(ch)
            if fills is None:
                continue
            for key, (role, events) in self.traces.items():
                waits = [e for e in events if e.kind == "wait" and e.bar == ch.full]
                if (waits and key[0] not in ch.mismatched_roles
                        and not any(e.kind == "expect_tx" and e.bar == ch.full for e in events)):
                    self._consumer(ch, fills, role, key[1], waits)
            if ch.empty is not None:
                self._releases(ch, fills)
        for key, (role, events) in self.traces.items():
            self._wgmma_groups(role, key[1], events)
            self._generic_writes(role, key[1], events)

    def _producer(self, ch: _Channel) -> "list[int] | None":
        """The stages the producer fills, in order, with its acquire of each; checks the parity of
        every acquire (the j-th use of a stage waits with parity (j & 1) ^ 1)."""
        producers = [(key, role, events) for key, (role, events) in self.traces.items()
                     if any(e.kind == "expect_tx" and e.bar == ch.full for e in events)]
        if not producers:
            return None
        if len(producers) > 1:
            names = ", ".join(f"role {role.name} wg {key[1]}" for key, role, _ in producers)
            self.c.once("producers", ch.expect_tx.path,
                        f"{len(producers)} warpgroups ({names}) arrive on {ch.full} for every stage; a full "
                        f"barrier is completed by one elected producer thread: issue the loads from one "
                        f"warpgroup")
        (_, wg), role, events = producers[0]
        fills: list[int] = []
        uses: dict[int, int] = {}
        acquire = None
        for e in events:
            if e.kind == "wait" and ch.empty is not None and e.bar == ch.empty:
                acquire = e
            elif e.kind == "expect_tx" and e.bar == ch.full:
                j = uses.get(e.slot, 0)
                uses[e.slot] = j + 1
                fills.append(e.slot)
                if ch.empty is None:
                    continue
                if acquire is None:
                    self.c.once("acquire", e.path,
                                f"at {self.where(role, wg, e)} the producer fills stage {e.slot} without "
                                f"waiting on {ch.empty} first; every fill waits for the stage to be free")
                elif acquire.slot != e.slot:
                    self.c.once("acquire", acquire.path,
                                f"at {self.where(role, wg, e)} the producer waits on {ch.empty} stage "
                                f"{acquire.slot} but then fills stage {e.slot}; wait on the stage it fills")
                elif acquire.value != (j & 1) ^ 1:
                    self.c.once("parity", acquire.path,
                                f"at {self.where(role, wg, acquire)} the producer waits on {ch.empty} stage "
                                f"{e.slot} with phase({acquire.value}), its {_ordinal(j + 1)} use of the "
                                f"stage; the parity must be {(j & 1) ^ 1}, the consumer's phase {j & 1} "
                                f"XOR 1 (the first pass through a stage is free, each later one waits for "
                                f"the previous release)")
                acquire = None
        return fills

    def _consumer(self, ch, fills, role, wg, waits) -> None:
        """The consumer's i-th wait on `full` is for the producer's i-th fill: same stage, and the
        parity of that fill's phase."""
        uses: dict[int, int] = {}
        for i, w in enumerate(waits):
            if i >= len(fills):
                self.c.once("sequence", w.path,
                            f"at {self.where(role, wg, w)} the consumer waits on {ch.full} for a fill the "
                            f"producer never makes (it fills {len(fills)} stages here): deadlock; {_SAME_ORDER}")
                return
            slot = fills[i]
            if w.slot != slot:
                self.c.once("sequence", w.path,
                            f"at {self.where(role, wg, w)} the consumer waits on {ch.full} stage {w.slot} "
                            f"but the producer's {_ordinal(i + 1)} fill went to stage {slot}; both sides "
                            f"must compute the stage from the same counter (stage = it % S)")
                return
            j = uses.get(slot, 0)
            uses[slot] = j + 1
            if w.value != j & 1:
                self.c.once("parity", w.path,
                            f"at {self.where(role, wg, w)} the consumer waits on {ch.full} stage {slot} with "
                            f"phase({w.value}), the {_ordinal(j + 1)} use of the stage, which completes "
                            f"phase {j}; the parity must be {j & 1} (phase = (it / S) & 1)")
                return
        if len(waits) < len(fills):
            self.c.once("sequence", waits[0].path,
                        f"the consumer waits on {ch.full} {len(waits)} times ({self.sample.text}) but the "
                        f"producer fills {len(fills)} stages; the producer blocks on a stage nobody "
                        f"releases: {_SAME_ORDER}")

    def _releases(self, ch: _Channel, fills) -> None:
        """Each use of a stage that the producer fills again later is released the same number of
        times by every consumer warpgroup; the empty barrier's arrivals are the sum of those."""
        later: set[int] = set()
        reused = []                      # whether the producer fills each use's stage again later
        for slot in reversed(fills):
            reused.append(slot in later)
            later.add(slot)
        reused.reverse()
        per_role: dict[tuple[int, ...], tuple[ir.Role, list[int]]] = {}
        for (rpath, wg), (role, events) in self.traces.items():
            if rpath in ch.mismatched_roles or not any(e.kind == "wait" and e.bar == ch.full for e in events):
                continue
            uses: list[_Use] = []
            current: dict[int, int] = {}
            for e in events:
                if e.kind == "wait" and e.bar == ch.full:
                    current[e.slot] = len(uses)
                    uses.append(_Use(e.slot, e))
                elif e.kind == "arrive" and e.bar == ch.empty:
                    if e.slot in current:
                        uses[current[e.slot]].releases += 1
                    else:
                        self.c.once("release", e.path,
                                    f"at {self.where(role, wg, e)} the consumer releases {ch.empty} stage "
                                    f"{e.slot} before it ever waited on {ch.full} for it; release a stage "
                                    f"only after using it")
            counts = set()
            for i, use in enumerate(uses[:len(fills)]):
                if not reused[i]:
                    continue
                if use.releases == 0:
                    self.c.once("release", use.wait.path,
                                f"at {self.where(role, wg, use.wait)} the consumer never releases stage "
                                f"{use.slot} before its next use; the producer's wait on {ch.empty} "
                                f"deadlocks: arrive on {ch.empty} once the wgmmas reading the stage are done")
                counts.add(use.releases)
            if 0 in counts:
                continue
            if len(counts) > 1:
                self.c.once("release-count", next(u.wait.path for u in uses),
                            f"the consumer releases its stages {' or '.join(map(str, sorted(counts)))} times "
                            f"per use ({self.sample.text}); release every use exactly the same number of "
                            f"times")
            elif counts:
                per_role.setdefault(rpath, (role, []))[1].append(counts.pop())
        init = self.c.inits.get(ch.empty)
        if init is None or not per_role:
            return
        total = sum(sum(counts) for _, counts in per_role.values())
        if init.stmt.arrivals != total:
            parts = ", ".join(
                f"role {role.name}: " + (f"{_count(len(counts), 'warpgroup')} × {_count(counts[0], 'arrive')}"
                                         if len(set(counts)) == 1 else f"{' + '.join(map(str, counts))} arrives")
                for role, counts in per_role.values())
            self.c.once("arrivals", init.path,
                        f"{ch.empty} is initialised with arrivals({init.stmt.arrivals}) but {total} consumer "
                        f"arrivals release each stage ({parts}); use arrivals({total})")

    def _wgmma_groups(self, role: ir.Role, wg: int, events) -> None:
        """Release only what no pending wgmma group reads; read only stages this warpgroup holds."""
        of_buffer = {b: ch for ch in self.channels for b in ch.buffers}
        of_empty = {ch.empty: ch for ch in self.channels if ch.empty is not None}
        fulls = {ch.full for ch in self.channels}
        held: set[tuple[str, int]] = set()
        open_group: list[tuple[tuple, _Event]] = []
        groups: list[list[tuple[tuple, _Event]]] = []
        for e in events:
            if e.kind == "wait" and e.bar in fulls:
                held.add((e.bar, e.slot))
            elif e.kind == "mma":
                for read in e.refs:
                    ch = of_buffer.get(read[0])
                    if ch is None or not read[1]:
                        continue
                    stage = read[1][0]
                    if (ch.full, stage) not in held:
                        self.c.once("held", e.path,
                                    f"at {self.where(role, wg, e)} wgmma.mma reads {read[2]} (stage {stage}) "
                                    f"but this warpgroup does not hold that stage; wait on "
                                    f"{ch.full}[{stage}] first and release it only after the wgmma")
                open_group.extend((read, e) for read in e.refs)
            elif e.kind == "smem_write":
                pending = [mma for g in groups + [open_group] for read, mma in g if _overlap(read, e.refs[0])]
                if pending:
                    self.c.once("pending-write", e.path,
                                f"at {self.where(role, wg, e)} tile.store_smem overwrites {e.refs[0][2]} while the "
                                f"wgmma reading it (IR line {self.c.r.line(pending[0].path)}) may be pending; put "
                                f"`wgmma.wait 0` (or wait for that group) before the write")
            elif e.kind == "commit":
                groups.append(open_group)
                open_group = []
            elif e.kind == "mma_wait":
                groups = groups[len(groups) - e.value:] if e.value else []
            elif e.kind == "arrive" and e.bar in of_empty:
                ch = of_empty[e.bar]
                pending = [(read, mma) for g in groups + [open_group] for read, mma in g
                           if read[0] in ch.buffers and read[1][:1] == (e.slot,)]
                if pending:
                    names = " and ".join(dict.fromkeys(read[2] for read, _ in pending))
                    line = self.c.r.line(pending[0][1].path)
                    self.c.once("pending", e.path,
                                f"consumer releases {_ref(statement_at(self.k, e.path).bar)} (stage "
                                f"{e.slot}, at {self.where(role, wg, e)}) before the wgmma reading {names} "
                                f"(IR line {line}) has completed; put `wgmma.wait 0` (or wait for that "
                                f"group) before the release")
                held.discard((ch.full, e.slot))

    def _generic_writes(self, role: ir.Role, wg: int, events) -> None:
        """A tile.store_smem is seen by the async proxy only after `fence.proxy.async`; a TMA store
        issued by one thread also needs the warpgroup barrier that says every thread has written."""
        written: list[tuple[tuple, _Event, bool]] = []      # (reference, write, fenced)
        for e in events:
            if e.kind == "smem_write":
                written.append((e.refs[0], e, False))
            elif e.kind == "fence_proxy":
                written = [(ref, w, True) for ref, w, _ in written]
            elif e.kind == "bar_sync":
                written = [x for x in written if not x[2]]
            elif e.kind in ("tma_store", "mma"):
                for read in e.refs:
                    for ref, write, fenced in written:
                        if not _overlap(ref, read) or (fenced and e.kind == "mma"):
                            continue
                        line = self.c.r.line(write.path)
                        missing = ("`bar.sync` of the warpgroup after the fence (one thread issues the "
                                   "copy of what every thread wrote)" if fenced else
                                   "`fence.proxy.async` and then a `bar.sync` of the warpgroup"
                                   if e.kind == "tma_store" else "`fence.proxy.async`")
                        self.c.once("proxy", e.path,
                                    f"at {self.where(role, wg, e)} {_keyword(statement_at(self.k, e.path))} "
                                    f"reads {read[2]}, written by tile.store_smem {ref[2]} (IR line {line}) "
                                    f"with generic stores; put {missing} between the write and this read",
                                    cause=write.path)
