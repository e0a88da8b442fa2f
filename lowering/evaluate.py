"""The IR's arithmetic, defined once: expressions compiled to closures over an env dict (integer
ops with C-like checks, IEEE float division), which the simulator runs, and `evaluate` on the
host (grid sizes, tensor views, verifier sample points): one definition of what `/`, `%`,
`ceil_div` and the rest mean."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

from . import ir
from .printer import print_expr


class Undefined(Exception):
    """An expression read a name that has no value in the env."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class ExprError(Exception):
    """An operation without a value (integer division by zero, a float in `&`, ...)."""


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
    """`e` as a closure over an env dict. Raises ValueError / TypeError for a malformed expression
    (an unknown operator or call, which the verifier reports); the closure raises Undefined and
    ExprError."""
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
            raise ValueError(f"unknown binary operator {e.op!r} in {e!r}")
        fn = build(compile_expr(e.lhs), compile_expr(e.rhs))
    elif isinstance(e, ir.Call):
        if ir.CALLS.get(e.func) != len(e.args):
            raise ValueError(f"unknown call or wrong arity: {e!r} "
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
        raise TypeError(f"not an expression: {e!r}")
    if next(ir.expr_vars(e), None) is None:  # constant: fold it (errors stay at run time)
        try:
            value = fn({})
        except ExprError:
            return fn
        return lambda env: value
    return fn


_compiled = lru_cache(maxsize=4096)(compile_expr)   # frozen expressions hash structurally


def evaluate(e: ir.Expr, env: dict[str, int | float]) -> int | float:
    """The value of `e` with the names in `env`. KeyError names an unbound variable; ValueError
    says why an operation has no value (integer division by zero, a float in `&`, ...)."""
    try:
        return _compiled(e)(env)
    except Undefined as missing:
        raise KeyError(f"expression reads '{missing.name}', which has no value here") from None
    except ExprError as error:
        raise ValueError(f"{error} in {print_expr(e)}") from None


__all__ = ["evaluate", "compile_expr", "Undefined", "ExprError"]
