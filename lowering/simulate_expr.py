"""The simulator's expressions and message text: every `ir.Expr` is compiled once per kernel
into a closure over a coroutine's env dict (integer ops with C-like checks, IEEE float
division), and statements are spelled in the text form, with the values they had, for
error messages."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from . import ir
from .printer import print_expr, print_stmt
from .simulate import ProtocolError, SimulationError


# ---------------------------------------------------------------------------------------------
# Expressions: compiled once per kernel into closures over the coroutine's env dict
# ---------------------------------------------------------------------------------------------


class Undefined(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class ExprError(Exception):
    pass


Closure = Callable[[dict], "int | float"]


def _int_args(sym: str, a, b) -> None:
    if type(a) is not int or type(b) is not int:
        raise ExprError(f"'{sym}' needs integers, got {a!r} and {b!r}")


def _float_div(a, b):
    if b == 0:  # IEEE like the GPU, not Python's ZeroDivisionError
        return math.nan if a == 0 else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _build_division(what: str, int_op, float_op) -> Callable[[Closure, Closure], Closure]:
    """`/` and `%`: floor semantics on integers, IEEE (no exception) on floats."""
    def build(l: Closure, r: Closure) -> Closure:
        def division(env):
            a, b = l(env), r(env)
            if type(a) is int and type(b) is int:
                if b == 0:
                    raise ExprError(f"integer {what} by zero")
                return int_op(a, b)
            return float_op(a, b)
        return division
    return build


_build_div = _build_division("division", lambda a, b: a // b, _float_div)
_build_mod = _build_division("modulo", lambda a, b: a % b, lambda a, b: math.fmod(a, b) if b != 0 else math.nan)


def _build_bitwise(sym: str, fn: Callable[[int, int], int]) -> Callable[[Closure, Closure], Closure]:
    def build(l: Closure, r: Closure) -> Closure:
        def bitwise(env):
            a, b = l(env), r(env)
            _int_args(sym, a, b)
            if sym in ("<<", ">>") and b < 0:
                raise ExprError(f"negative shift count {b}")
            return fn(a, b)
        return bitwise
    return build


_BINARY_BUILDERS: dict[str, Callable[[Closure, Closure], Closure]] = {
    "+": lambda l, r: lambda env: l(env) + r(env),
    "-": lambda l, r: lambda env: l(env) - r(env),
    "*": lambda l, r: lambda env: l(env) * r(env),
    "/": _build_div,
    "%": _build_mod,
    "==": lambda l, r: lambda env: 1 if l(env) == r(env) else 0,
    "!=": lambda l, r: lambda env: 1 if l(env) != r(env) else 0,
    "<": lambda l, r: lambda env: 1 if l(env) < r(env) else 0,
    "<=": lambda l, r: lambda env: 1 if l(env) <= r(env) else 0,
    ">": lambda l, r: lambda env: 1 if l(env) > r(env) else 0,
    ">=": lambda l, r: lambda env: 1 if l(env) >= r(env) else 0,
    "&&": lambda l, r: lambda env: 1 if (l(env) and r(env)) else 0,
    "||": lambda l, r: lambda env: 1 if (l(env) or r(env)) else 0,
    "&": _build_bitwise("&", lambda a, b: a & b),
    "|": _build_bitwise("|", lambda a, b: a | b),
    "^": _build_bitwise("^", lambda a, b: a ^ b),
    "<<": _build_bitwise("<<", lambda a, b: a << b),
    ">>": _build_bitwise(">>", lambda a, b: a >> b),
}


def _ceil_div(a, b):
    if type(a) is int and type(b) is int:
        if b == 0:
            raise ExprError("ceil_div by zero")
        return -(-a // b)
    return float(math.ceil(_float_div(a, b)))


def compile_expr(e: ir.Expr) -> Closure:
    if isinstance(e, (ir.IntConst, ir.FloatConst)):
        value = e.value
        return lambda env: value
    if isinstance(e, ir.Var):
        name = e.name

        def var(env):
            try:
                return env[name]
            except KeyError:
                raise Undefined(name) from None
        return var
    if isinstance(e, ir.BinOp):
        build = _BINARY_BUILDERS.get(e.op)
        if build is None:
            raise ProtocolError(f"unknown binary operator {e.op!r} in {expr_text(e)}")
        fn = build(compile_expr(e.lhs), compile_expr(e.rhs))
    elif isinstance(e, ir.Call):
        if ir.CALLS.get(e.func) != len(e.args):
            raise ProtocolError(f"unknown call or wrong arity: {expr_text(e)} "
                                f"(builtins: {', '.join(f'{k}/{n}' for k, n in ir.CALLS.items())})")
        args = [compile_expr(a) for a in e.args]
        if e.func == "select":
            c, a, b = args
            fn = lambda env: a(env) if c(env) else b(env)  # noqa: E731
        else:
            a, b = args
            op = {"min": min, "max": max, "ceil_div": _ceil_div}[e.func]
            fn = lambda env: op(a(env), b(env))  # noqa: E731
    else:
        raise ProtocolError(f"not an expression: {e!r}")
    if next(ir.expr_vars(e), None) is None:  # constant: fold it (errors stay at run time)
        try:
            value = fn({})
        except ExprError:
            return fn
        return lambda env: value
    return fn


# ---------------------------------------------------------------------------------------------
# Text of statements for messages (one line, the text form's spelling)
# ---------------------------------------------------------------------------------------------


def expr_text(e: ir.Expr) -> str:
    try:
        return print_expr(e)
    except (TypeError, ValueError):  # not printable: the message still says what it was
        return repr(e)


_BLOCK_FIELDS = ("body", "then", "orelse")


def _with_values(s: ir.Stmt, env: dict) -> ir.Stmt:
    """`s` with every expression that `env` can evaluate replaced by its value."""
    def value(e):
        if isinstance(e, (ir.IntConst, ir.FloatConst)):
            return e
        try:
            return ir.const(compile_expr(e)(env))
        except (Undefined, ExprError, SimulationError, TypeError):
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


def loops_text(loops, env) -> str:
    if not loops:
        return ""
    return " (loop " + ", ".join(f"{v}={env.get(v, '?')}" for v in loops) + ")"
