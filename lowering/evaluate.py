"""The IR's arithmetic, defined once, as the emitted CUDA computes it: expressions compiled to
closures over an env dict, which the simulator runs, and `evaluate` on the host (grid sizes,
tensor views, verifier sample points).

The emitter spells every integer scalar as a C++ `int` and every float scalar as a `float`
(`codegen/emit_context.py`: lets, loop variables, parameters and builtins), so:

* integers are 32-bit signed: `+ - * <<` and `ceil_div`'s `a + b - 1` whose result leaves
  [-2^31, 2^31) raise ExprError (signed overflow is undefined behaviour in CUDA C++; the GPU
  may wrap or the compiler may assume it away, so no wrapped value is "the" answer), and so
  does an integer constant outside that range;
* `/` and `%` on integers truncate toward zero like C (`-1 / 3 == 0`, `-1 % 3 == -1`), not
  Python's floor; `ceil_div(a, b)` is the device helper's `(a + b - 1) / b`;
* a float operand makes the operation float: fp32, rounded after every operation (an int
  operand converted to fp32 first), IEEE division (x / 0 is inf or nan, not an exception);
* `%`, bitwise operators, `ceil_div` and `bit_length` take integers only (the emitter has no
  float spelling for them); shift counts must lie in [0, 32); `bit_length(x)` is the device
  helper's `32 - __clz(x)`, defined for x >= 0 only (a negative x raises ExprError).
"""

from __future__ import annotations

import math
import operator
import struct
from functools import lru_cache
from typing import Callable

from wsched.target import INT_MAX, INT_MIN

from . import ir
from .printer import print_expr

# The C++ `int` every integer scalar of the emitted CUDA is declared as.


class Undefined(Exception):
    """An expression read a name that has no value in the env."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class ExprError(Exception):
    """An operation without a value on the GPU (integer division by zero, a 32-bit overflow,
    a float in `&`, ...)."""


Closure = Callable[[dict], "int | float"]

_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """`x` rounded to the nearest fp32 (an overflow rounds to infinity, as on the GPU)."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _overflow(text: str, value: int) -> ExprError:
    return ExprError(f"integer overflow: {text} = {value} does not fit the CUDA's 32-bit int "
                     f"[{INT_MIN}, {INT_MAX}] (signed overflow is undefined on the GPU)")


def _as_float(x) -> float:
    return f32(float(x))


def _int_args(sym: str, a, b) -> None:
    if type(a) is not int or type(b) is not int:
        raise ExprError(f"'{sym}' needs integers, got {a!r} and {b!r}")


def c_div(a: int, b: int) -> int:
    """C's integer division: the quotient truncated toward zero."""
    if b == 0:
        raise ExprError("integer division by zero")
    if a >= 0 and b > 0:
        return a // b
    q = abs(a) // abs(b)
    q = q if (a < 0) == (b < 0) else -q
    if q > INT_MAX:   # INT_MIN / -1
        raise _overflow(f"{a} / {b}", q)
    return q


def c_mod(a: int, b: int) -> int:
    """C's `%`: the remainder of the truncating division, with the sign of `a`."""
    if b == 0:
        raise ExprError("integer modulo by zero")
    if a >= 0 and b > 0:
        return a % b
    return a - b * c_div(a, b)


def _float_div(a: float, b: float) -> float:
    if b == 0:  # IEEE like the GPU, not Python's ZeroDivisionError
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _build_arithmetic(sym: str, int_op: Callable[[int, int], int],
                      float_op: Callable[[float, float], float]) -> Callable[[Closure, Closure], Closure]:
    """`+ - * /`: int32 on two integers, fp32 otherwise."""
    def build(l: Closure, r: Closure) -> Closure:
        def arithmetic(env):
            a, b = l(env), r(env)
            if type(a) is int and type(b) is int:
                value = int_op(a, b)
                if INT_MIN <= value <= INT_MAX:
                    return value
                raise _overflow(f"{a} {sym} {b}", value)
            return f32(float_op(_as_float(a), _as_float(b)))
        return arithmetic
    return build


def _build_mod(l: Closure, r: Closure) -> Closure:
    def modulo(env):
        a, b = l(env), r(env)
        _int_args("%", a, b)
        return c_mod(a, b)
    return modulo


def _build_compare(op: Callable[[object, object], bool]) -> Callable[[Closure, Closure], Closure]:
    """Comparisons: an int compared with a float is converted to fp32 first, as in C."""
    def build(l: Closure, r: Closure) -> Closure:
        def compare(env):
            a, b = l(env), r(env)
            if type(a) is not int or type(b) is not int:
                a, b = _as_float(a), _as_float(b)
            return 1 if op(a, b) else 0
        return compare
    return build


def _shift_count(b: int) -> int:
    if not 0 <= b < 32:
        raise ExprError(f"shift count {b} is outside [0, 32) (undefined for a 32-bit int)")
    return b


def _shift_left(a: int, b: int) -> int:
    value = a << _shift_count(b)
    if INT_MIN <= value <= INT_MAX:
        return value
    raise _overflow(f"{a} << {b}", value)


_BITWISE: dict[str, Callable[[int, int], int]] = {
    "&": lambda a, b: a & b,
    "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b,
    "<<": _shift_left,
    ">>": lambda a, b: a >> _shift_count(b),   # arithmetic, like nvcc on a signed int
}


def _build_bitwise(sym: str) -> Callable[[Closure, Closure], Closure]:
    fn = _BITWISE[sym]

    def build(l: Closure, r: Closure) -> Closure:
        def bitwise(env):
            a, b = l(env), r(env)
            _int_args(sym, a, b)
            return fn(a, b)
        return bitwise
    return build


_BINARY_BUILDERS: dict[str, Callable[[Closure, Closure], Closure]] = {
    "+": _build_arithmetic("+", operator.add, operator.add),
    "-": _build_arithmetic("-", operator.sub, operator.sub),
    "*": _build_arithmetic("*", operator.mul, operator.mul),
    "/": _build_arithmetic("/", c_div, _float_div),
    "%": _build_mod,
    "==": _build_compare(lambda a, b: a == b),
    "!=": _build_compare(lambda a, b: a != b),
    "<": _build_compare(lambda a, b: a < b),
    "<=": _build_compare(lambda a, b: a <= b),
    ">": _build_compare(lambda a, b: a > b),
    ">=": _build_compare(lambda a, b: a >= b),
    "&&": lambda l, r: lambda env: 1 if (l(env) and r(env)) else 0,
    "||": lambda l, r: lambda env: 1 if (l(env) or r(env)) else 0,
    **{sym: _build_bitwise(sym) for sym in _BITWISE},
}


def ceil_div(a, b) -> int:
    """The device helper `wsp::ceil_div(int a, int b)`: `(a + b - 1) / b` in 32-bit ints."""
    _int_args("ceil_div", a, b)
    if b == 0:
        raise ExprError("ceil_div by zero")
    total = a + b   # (a + b) - 1, evaluated left to right in `int`
    if not INT_MIN < total <= INT_MAX:
        raise _overflow(f"ceil_div({a}, {b}): {a} + {b}{' - 1' if total == INT_MIN else ''}",
                        total - (total == INT_MIN))
    return c_div(total - 1, b)


def bit_length(x) -> int:
    """The device helper `wsp::bit_length(int x)`: the number of bits of x >= 0 (0 for 0)."""
    if type(x) is not int:
        raise ExprError(f"'bit_length' needs an integer, got {x!r}")
    if x < 0:
        raise ExprError(f"bit_length of a negative number ({x})")
    return x.bit_length()


def _min_max(pick: Callable) -> Callable:
    """`min` / `max` on two ints; `fminf` / `fmaxf` otherwise (a NaN operand is ignored)."""
    def fn(a, b):
        if type(a) is int and type(b) is int:
            return pick(a, b)
        a, b = _as_float(a), _as_float(b)
        if math.isnan(a):
            return b
        if math.isnan(b):
            return a
        return pick(a, b)
    return fn


_CALLS = {"min": _min_max(min), "max": _min_max(max), "ceil_div": ceil_div, "bit_length": bit_length}


def _constant(value: int | float) -> Closure:
    if type(value) is float:
        value = f32(value)   # the emitter writes `0.5f`: an fp32 literal
    elif not INT_MIN <= value <= INT_MAX:
        def out_of_range(env):
            raise ExprError(f"the integer constant {value} does not fit the CUDA's 32-bit int "
                            f"[{INT_MIN}, {INT_MAX}]")
        return out_of_range
    return lambda env: value


def compile_expr(e: ir.Expr) -> Closure:
    """`e` as a closure over an env dict. Raises ValueError / TypeError for a malformed expression
    (an unknown operator or call, which the verifier reports); the closure raises Undefined and
    ExprError."""
    if isinstance(e, (ir.IntConst, ir.FloatConst)):
        return _constant(e.value)
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
        if e.func == "select":   # only the chosen operand is evaluated, as in C's `?:`
            c, a, b = args
            fn = lambda env: a(env) if c(env) else b(env)  # noqa: E731
        elif len(args) == 1:
            (a,) = args
            op = _CALLS[e.func]
            fn = lambda env: op(a(env))  # noqa: E731
        else:
            a, b = args
            op = _CALLS[e.func]
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
    says why an operation has no value (integer division by zero, a 32-bit overflow, a float
    in `&`, ...)."""
    try:
        return _compiled(e)(env)
    except Undefined as missing:
        raise KeyError(f"expression reads '{missing.name}', which has no value here") from None
    except ExprError as error:
        raise ValueError(f"{error} in {print_expr(e)}") from None


__all__ = ["evaluate", "compile_expr", "Undefined", "ExprError", "INT_MIN", "INT_MAX", "f32", "c_div", "c_mod",
           "ceil_div", "bit_length"]
