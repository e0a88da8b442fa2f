"""Evaluate loop-IR expressions on the host (grid sizes, verifier sample points)."""

from __future__ import annotations

from . import ir

_BINARY = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": lambda a, b: a // b if isinstance(a, int) and isinstance(b, int) else a / b,
    "%": lambda a, b: a % b,
    "&": lambda a, b: a & b, "|": lambda a, b: a | b, "^": lambda a, b: a ^ b,
    "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b,
    "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b),
    "<": lambda a, b: int(a < b), "<=": lambda a, b: int(a <= b),
    ">": lambda a, b: int(a > b), ">=": lambda a, b: int(a >= b),
    "&&": lambda a, b: int(bool(a) and bool(b)), "||": lambda a, b: int(bool(a) or bool(b)),
}
_CALLS = {
    "min": min, "max": max,
    "ceil_div": lambda a, b: -(-a // b),
    "select": lambda c, a, b: a if c else b,
}


def evaluate(e: ir.Expr, env: dict[str, int | float]) -> int | float:
    """The value of `e` with the names in `env`; KeyError names an unbound variable."""
    if isinstance(e, ir.IntConst):
        return e.value
    if isinstance(e, ir.FloatConst):
        return e.value
    if isinstance(e, ir.Var):
        try:
            return env[e.name]
        except KeyError:
            raise KeyError(f"expression reads '{e.name}', which has no value here") from None
    if isinstance(e, ir.BinOp):
        return _BINARY[e.op](evaluate(e.lhs, env), evaluate(e.rhs, env))
    if isinstance(e, ir.Call):
        return _CALLS[e.func](*(evaluate(a, env) for a in e.args))
    raise TypeError(f"not an expression: {e!r}")


__all__ = ["evaluate"]
