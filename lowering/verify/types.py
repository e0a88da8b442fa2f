"""Well-typedness of an IR object built in Python: the check `verify` runs first, so that the rest of
the verifier, the simulator (which verifies first) and the emitter can trust every field's type.

A kernel parsed from text is well typed by construction; one built in Python may hold anything:
`MbarrierWait(bar, None)`, a `str` where an expression belongs, a float stage count. The type each
field must have is the annotation `lowering/ir.py` gives it (read with `typing.get_type_hints`,
so the IR module stays the one definition), checked against the value:

    str, bool          that type exactly
    int                an int that is not a bool, within 64 bits (the emitter spells it in C++)
    float              a float (FloatConst: an int there would print back as an IntConst)
    Expr, SmemRef, ... an instance of one of the classes of the Union, each field checked in turn
    tuple[X, ...]      a tuple of X; tuple[int, int, int] a tuple of three

Nesting is bounded as the parser bounds it, expressions `MAX_EXPRESSION_DEPTH` operators deep and
statements `MAX_BLOCK_DEPTH` blocks deep, so that no later stage (they walk the IR recursively)
can exhaust Python's stack. The walk here uses an explicit stack for the same reason.

Two phases, because a message names its statement by the IR line and path (`lines.Report`), which
needs the statement skeleton to be sound:

1. the skeleton: the kernel's own fields are of their types, every block is a tuple of
   statements, each statement's keyword field (`setmaxnreg.<action>`, `tile.<op>`) is a str;
2. every field of every statement and declaration, reported at its IR line.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Iterator, Union

from wsched.errors import short_repr, type_name

from .. import ir
from ..spelling import SPELLINGS
from .lines import Diagnostic, Report, location, statement_name

# Limits the parser enforces on text and this module on IR built in Python.
MAX_EXPRESSION_DEPTH = 64       # operators on the longest path from an expression's root to a leaf
MAX_BLOCK_DEPTH = 32            # statements nested inside statements, below the kernel body
INT_LITERAL_BITS = 64           # integers the IR holds are signed 64-bit values

_INT_LIMIT = 2 ** (INT_LITERAL_BITS - 1)
_EXPR_TYPES = typing.get_args(ir.Expr)
_BLOCK_FIELDS = ("body", "then", "orelse")


def type_problems(kernel: object) -> list[Diagnostic]:
    """Every field of `kernel` whose value does not have its declared type; [] for a well-typed
    kernel (the other checks may then run)."""
    if not isinstance(kernel, ir.Kernel):
        return [Diagnostic(f"verify takes an ir.Kernel, got {type_name(kernel)} {short_repr(kernel)}", (), 0)]
    problems = _skeleton_problems(kernel)
    if problems:
        return problems
    report = Report(kernel)
    hints = _hints(ir.Kernel)
    for name in ("name", "params", "grid", "cluster", "smem", "barriers"):
        for problem in _value_problems(getattr(kernel, name), hints[name], name):
            report.header(problem)
    for path, stmt in _statements(kernel.body, ()):
        for problem in _node_problems(stmt, skip=_BLOCK_FIELDS):
            report.at(path, problem)
    return report.diagnostics


# -- phase 1: the skeleton ---------------------------------------------------------------------------


def _skeleton_problems(kernel: ir.Kernel) -> list[Diagnostic]:
    where = f"kernel {kernel.name}" if isinstance(kernel.name, str) else "kernel"
    for name, what in (("params", "parameters"), ("smem", "ir.SmemDecl"), ("barriers", "ir.BarrierDecl"),
                       ("body", "statements")):
        if not isinstance(getattr(kernel, name), tuple):
            return [_skeleton(where, f"`{name}` is {_describe(getattr(kernel, name))}; expected a tuple of {what}")]
    # (statements, the path of their owner, the owner's location text, nesting depth)
    stack: list[tuple[tuple, tuple[int, ...], str, int]] = [(kernel.body, (), where, 0)]
    while stack:
        block, prefix, owner, depth = stack.pop()
        if depth > MAX_BLOCK_DEPTH:
            return [_skeleton(owner, f"statements nested more than {MAX_BLOCK_DEPTH} blocks deep; the IR "
                                     f"allows at most {MAX_BLOCK_DEPTH}")]
        for i, stmt in enumerate(block):
            if not isinstance(stmt, ir.STMT_TYPES):
                return [_skeleton(owner, f"statement {i + 1} of its block is {_describe(stmt)}; expected an IR "
                                         f"statement (ir.Let, ir.For, ir.MbarrierWait, ...)")]
            field = SPELLINGS[type(stmt)].field
            if field is not None and not isinstance(getattr(stmt, field), str):
                return [_skeleton(owner, f"`{field}` of {type(stmt).__name__} (statement {i + 1} of its block) "
                                         f"is {_describe(getattr(stmt, field))}; expected a str")]
        # Every statement of the block is sound now, so `location` can name them.
        for i, stmt in enumerate(block):
            path = prefix + (i,)
            names = [name for name in _BLOCK_FIELDS if hasattr(stmt, name)]
            for name in names:
                if not isinstance(getattr(stmt, name), tuple):
                    here = " > ".join(filter(None, (location(kernel, prefix), statement_name(stmt))))
                    return [_skeleton(here, f"`{name}` is {_describe(getattr(stmt, name))}; "
                                            f"expected a tuple of statements")]
            if names:   # an if's children: then, then else (the traversal paths of lines.py)
                children = sum((getattr(stmt, name) for name in names), ())
                stack.append((children, path, location(kernel, path), depth + 1))
    return []


def _skeleton(where: str, problem: str) -> Diagnostic:
    return Diagnostic(f"IR ({where}): {problem}", (), 0)


def _statements(block: tuple, prefix: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], ir.Stmt]]:
    """Every statement with its traversal path (an `if`'s children: then, then else), without
    recursion (block by block, not in text order)."""
    stack = [(block, prefix)]
    while stack:
        stmts, base = stack.pop()
        for i, stmt in enumerate(stmts):
            path = base + (i,)
            yield path, stmt
            if isinstance(stmt, ir.If):
                stack.append((stmt.then + stmt.orelse, path))
            elif isinstance(stmt, (ir.For, ir.Role, ir.ElectOne)):
                stack.append((stmt.body, path))


# -- phase 2: every field -----------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    """The declared type of each compared field of an IR dataclass."""
    hints = typing.get_type_hints(cls, vars(ir))
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.compare}


def _node_problems(node: object, skip: tuple[str, ...] = ()) -> list[str]:
    problems = []
    for name, expected in _hints(type(node)).items():
        if name not in skip:
            problems += _value_problems(getattr(node, name), expected, name)
    return problems


def _value_problems(value: object, expected: object, what: str) -> list[str]:
    """What is wrong with `value` as a `expected`, each problem naming the field path `what`
    (`bar.index`, `coords[1].lhs`). Walks nested nodes with an explicit stack."""
    problems: list[str] = []

    def wrong(value, expected, what):
        problems.append(f"`{what}` is {_describe(value)}; expected {_spell(expected)}")

    # (value, expected type, field path, expression depth so far)
    stack = [(value, expected, what, 0)]
    while stack:
        value, expected, what, depth = stack.pop()
        origin = typing.get_origin(expected)
        if origin in (Union, types.UnionType):
            match = next((t for t in typing.get_args(expected) if _is_instance(value, t)), None)
            if match is None:
                wrong(value, expected, what)
            elif dataclasses.is_dataclass(match):
                stack.append((value, match, what, depth))
            continue
        if origin is tuple:
            args = typing.get_args(expected)
            variadic = len(args) == 2 and args[1] is Ellipsis
            if not isinstance(value, tuple) or (not variadic and len(value) != len(args)):
                wrong(value, expected, what)
                continue
            items = list(zip(value, [args[0]] * len(value) if variadic else args))
            for i, (item, item_type) in reversed(list(enumerate(items))):
                stack.append((item, item_type, f"{what}[{i}]", depth))
            continue
        if not _is_instance(value, expected):
            wrong(value, expected, what)
            continue
        if expected is int and not -_INT_LIMIT <= value < _INT_LIMIT:
            problems.append(f"`{what}` is {value}, which does not fit in {INT_LITERAL_BITS} bits")
            continue
        if not dataclasses.is_dataclass(expected):
            continue
        if expected in (ir.BinOp, ir.Call):
            depth += 1
            if depth > MAX_EXPRESSION_DEPTH:
                # named by the field that holds the whole expression, not by the long path down
                root = re.split(r"[.\[]", what)[0]
                problems.append(f"`{root}` is nested more than {MAX_EXPRESSION_DEPTH} operators deep; bind parts "
                                f"of it to names with `let`")
                continue
        for name, field_type in reversed(list(_hints(expected).items())):
            stack.append((getattr(value, name), field_type, f"{what}.{name}", depth))
    return problems


def _is_instance(value: object, expected: object) -> bool:
    if expected is type(None):
        return value is None
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, float)
    if isinstance(expected, type):
        return isinstance(value, expected)
    return False


def _describe(value: object) -> str:
    return f"{short_repr(value)} ({type_name(value)})"


def _spell(expected: object) -> str:
    """A declared type in words: `an expression`, `a tuple of ints`, `a SmemRef or a str`."""
    if expected == ir.Expr:
        return "an expression (ir.IntConst, ir.FloatConst, ir.Var, ir.BinOp or ir.Call)"
    origin = typing.get_origin(expected)
    if origin in (Union, types.UnionType):
        options = typing.get_args(expected)
        if set(_EXPR_TYPES) <= set(options):
            rest = [t for t in options if t not in _EXPR_TYPES]
            return " or ".join([_spell(ir.Expr)] + [_spell(t) for t in rest])
        return " or ".join(_spell(t) for t in options)
    if origin is tuple:
        args = typing.get_args(expected)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple of {_plural(args[0])}"
        return f"a tuple of {len(args)} {_plural(args[0])}"
    if expected is type(None):
        return "None"
    name = expected.__name__ if isinstance(expected, type) else str(expected)
    return f"an {name}" if name[0] in "aeiouAEIOU" else f"a {name}"


def _plural(expected: object) -> str:
    if expected == ir.Expr:
        return "expressions"
    if typing.get_origin(expected) in (Union, types.UnionType):
        return "values of " + " or ".join(t.__name__ for t in typing.get_args(expected))
    name = expected.__name__ if isinstance(expected, type) else str(expected)
    return name + "s"
