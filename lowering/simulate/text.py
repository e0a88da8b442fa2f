"""The simulator's text of statements for messages: one line in the text form, with the values
its expressions had (`mbarrier.wait empty[1] phase(0)`), its line in the printed IR and the loop
variables around it."""

from __future__ import annotations

import dataclasses

from .. import ir
from ..evaluate import ExprError, Undefined, compile_expr
from ..printer import print_stmt


_BLOCK_FIELDS = ("body", "then", "orelse")


def _with_values(s: ir.Stmt, env: dict) -> ir.Stmt:
    """`s` with every expression that `env` can evaluate replaced by its value."""
    def value(e):
        if isinstance(e, (ir.IntConst, ir.FloatConst)):
            return e
        try:
            return ir.const(compile_expr(e)(env))
        except (Undefined, ExprError, TypeError, ValueError):
            return e

    def substitute(x):
        if isinstance(x, (ir.Var, ir.BinOp, ir.Call)):
            return value(x)
        if isinstance(x, ir.SmemRef):
            return ir.SmemRef(x.buffer, tuple(value(i) for i in x.index))
        if isinstance(x, ir.BarRef):
            return ir.BarRef(x.barrier, value(x.index))
        if isinstance(x, tuple) and x and all(isinstance(i, (ir.IntConst, ir.FloatConst, ir.Var, ir.BinOp, ir.Call))
                                              for i in x):
            return tuple(value(i) for i in x)
        return x
    return dataclasses.replace(s, **{f.name: substitute(getattr(s, f.name))
                                     for f in dataclasses.fields(s) if f.name not in _BLOCK_FIELDS})


def stmt_text(s: ir.Stmt, env: dict | None = None) -> str:
    """The statement's first line in the text form; with `env`, expressions show their values
    (`mbarrier.wait empty[1] phase(0)`)."""
    if env is not None:
        s = _with_values(s, env)
    blocks = {f.name: () for f in dataclasses.fields(s) if f.name in _BLOCK_FIELDS}
    if blocks:
        s = dataclasses.replace(s, **blocks)
    try:
        return print_stmt(s).split("\n")[0].removesuffix(" {")
    except (TypeError, ValueError):
        return repr(s)


def loops_text(loops, env, line: int | None = None) -> str:
    """Where a statement ran: ` (IR line 57; loop tile=0, k=2)`, parts left out when unknown."""
    parts = [] if line is None else [f"IR line {line}"]
    if loops:
        parts.append("loop " + ", ".join(f"{v}={env.get(v, '?')}" for v in loops))
    return f" ({'; '.join(parts)})" if parts else ""
