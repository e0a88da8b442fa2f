"""Evaluate loop-IR expressions on the host (grid sizes, tensor views, verifier sample points)
with the simulator's semantics, which are the reference semantics of the IR: one definition
of what `/`, `%`, `ceil_div` and the rest mean."""

from __future__ import annotations

from functools import lru_cache

from . import ir
from .printer import print_expr
from .simulate_expr import ExprError, Undefined, compile_expr

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


__all__ = ["evaluate"]
