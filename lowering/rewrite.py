"""Small helpers the passes share to rebuild frozen IR trees."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from . import ir


def with_blocks(s: ir.Stmt, blocks: tuple[tuple[ir.Stmt, ...], ...]) -> ir.Stmt:
    """`s` with its nested statement lists replaced (same order as `ir.child_blocks`)."""
    if isinstance(s, (ir.For, ir.Role, ir.ElectOne)):
        return replace(s, body=blocks[0])
    if isinstance(s, ir.If):
        return replace(s, then=blocks[0], orelse=blocks[1])
    return s


def transform(stmts: tuple[ir.Stmt, ...], fn: Callable[[ir.Stmt], "ir.Stmt | tuple | None"]) -> tuple[ir.Stmt, ...]:
    """Rebuild bottom-up: children first, then `fn(stmt)` returns a replacement statement,
    a tuple to splice in its place, or None to keep the statement as it is."""
    out: list[ir.Stmt] = []
    for s in stmts:
        blocks = ir.child_blocks(s)
        if blocks:
            s = with_blocks(s, tuple(transform(b, fn) for b in blocks))
        r = fn(s)
        if r is None:
            out.append(s)
        elif isinstance(r, tuple):
            out.extend(r)
        else:
            out.append(r)
    return tuple(out)


def map_role(kernel: ir.Kernel, name: str, fn: Callable[[ir.Role], ir.Role]) -> ir.Kernel:
    def visit(s):
        return fn(s) if isinstance(s, ir.Role) and s.name == name else None
    return replace(kernel, body=transform(kernel.body, visit))


def role(kernel: ir.Kernel, name: str) -> ir.Role:
    for r in kernel.roles():
        if r.name == name:
            return r
    raise KeyError(f"kernel {kernel.name} has no role {name!r}")


def map_loop(stmts: tuple[ir.Stmt, ...], var: str, fn: Callable[[ir.For], "ir.Stmt | tuple"]) -> tuple[ir.Stmt, ...]:
    """Apply `fn` to every `for` over the loop variable `var`."""
    return transform(stmts, lambda s: fn(s) if isinstance(s, ir.For) and s.var == var else None)


def subst(e: ir.Expr, mapping: dict[str, ir.Expr]) -> ir.Expr:
    if isinstance(e, ir.Var):
        return mapping.get(e.name, e)
    if isinstance(e, ir.BinOp):
        return ir.BinOp(e.op, subst(e.lhs, mapping), subst(e.rhs, mapping))
    if isinstance(e, ir.Call):
        return ir.Call(e.func, tuple(subst(a, mapping) for a in e.args))
    return e
