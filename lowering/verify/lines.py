"""Where a verifier message points: IR line numbers, traversal paths and the text that names them.

IR nodes carry no source positions, so a statement is named by its traversal path (child indices
from the kernel body down; an `if`'s children are its `then` statements followed by its `else`
statements) and located by the line it has in the printed IR (`print_kernel`: header on line 1,
one line per smem and barrier declaration, one line per statement, a closing `}` or `} else {` on
a line of its own). `Report` collects the problems of one kernel as `Diagnostic`s of the form

    IR line 23 (role consumer > for k > mbarrier.wait): <what is wrong>; <what would be right>

and the small text helpers here spell expressions, references, shapes and counts the way the
printer and every message do.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from .. import ir
from ..evaluate import evaluate
from ..printer import expr_text
from ..spelling import keyword


@dataclass(frozen=True)
class Diagnostic:
    """One problem. `path` is the statement's traversal path (() for the kernel header and the
    declarations); `line` its line in the printed IR; `message` the full text."""

    message: str
    path: tuple[int, ...]
    line: int

    def __str__(self) -> str:
        return self.message


def children(s: ir.Stmt) -> tuple[ir.Stmt, ...]:
    """The statements nested in `s`, in path order (an `if`: then, then else)."""
    return tuple(itertools.chain.from_iterable(ir.child_blocks(s)))


def statement_at(kernel: ir.Kernel, path: tuple[int, ...]) -> ir.Stmt:
    """The statement at traversal path `path`."""
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


# The field holding the name a statement declares, updates or runs under (`role consumer`).
_NAME_FIELDS = {ir.Role: "name", ir.For: "var", ir.Let: "name", ir.Assign: "name", ir.RegDecl: "name",
                ir.TileView: "name", ir.LoadShared: "name", ir.LoadGlobal: "name"}


def statement_name(s: ir.Stmt) -> str:
    """How a statement is named in a location: its keyword (`spelling.keyword`), and the name it
    declares, updates or runs under (`role consumer`, `for k`, `set acc_phase`)."""
    field = _NAME_FIELDS.get(type(s))
    return keyword(s) if field is None else f"{keyword(s)} {getattr(s, field)}"


def location(kernel: ir.Kernel, path: tuple[int, ...]) -> str:
    """The chain of statements down to `path`, e.g. `role consumer > for k > mbarrier.wait`."""
    parts = []
    stmts = kernel.body
    for depth, i in enumerate(path):
        s = stmts[i]
        if depth + 1 < len(path) and isinstance(s, ir.If):
            parts.append("if" if path[depth + 1] < len(s.then) else "else")
        else:
            parts.append(statement_name(s))
        stmts = children(s)
    return " > ".join(parts)


def ref_text(r: "ir.SmemRef | ir.BarRef") -> str:
    if isinstance(r, ir.BarRef):
        return f"{r.barrier}[{expr_text(r.index)}]"
    return f"{r.buffer}[{', '.join(expr_text(i) for i in r.index)}]" if r.index else r.buffer


def array_text(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(expr_text(d) if not isinstance(d, int) else str(d) for d in shape)}]"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def expr_nodes(e: ir.Expr) -> Iterator[ir.Expr]:
    yield e
    if isinstance(e, ir.BinOp):
        yield from expr_nodes(e.lhs)
        yield from expr_nodes(e.rhs)
    elif isinstance(e, ir.Call):
        for a in e.args:
            yield from expr_nodes(a)


def constant(e: ir.Expr) -> "int | float | None":
    try:
        return evaluate(e, {})
    except (KeyError, ZeroDivisionError, TypeError, ValueError):
        return None


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def volume(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Site:
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


def sites(kernel: ir.Kernel) -> list[Site]:
    out: list[Site] = []

    def visit(stmts, prefix, ancestors):
        for i, s in enumerate(stmts):
            out.append(Site(prefix + (i,), s, ancestors))
            visit(children(s), prefix + (i,), ancestors + (s,))

    visit(kernel.body, (), ())
    return out


def block_of(kernel: ir.Kernel, path: tuple[int, ...]) -> tuple[tuple[ir.Stmt, ...], int, int]:
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


class Report:
    """The problems found in one kernel, each message once, located at a statement (`at`), the
    kernel header or a declaration."""

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
        self._add(self.lines[path], location(self.kernel, path), problem, path)

    def header(self, problem: str, what: str = "") -> None:
        self._add(1, f"kernel {self.kernel.name}" + (f" > {what}" if what else ""), problem, ())

    def smem_decl(self, index: int, problem: str) -> None:
        self._add(2 + index, f"smem {self.kernel.smem[index].name}", problem, ())

    def barrier_decl(self, index: int, problem: str) -> None:
        self._add(2 + len(self.kernel.smem) + index, f"barrier {self.kernel.barriers[index].name}",
                  problem, ())

    def line(self, path: tuple[int, ...]) -> int:
        return self.lines[path]
