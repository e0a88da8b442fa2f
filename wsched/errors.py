"""User-facing errors of the fusion DSL, and how they find the user's source line.

Every `FusionError` message has the form `"<op>: <what is wrong> at <file.py>:<line>"`, where the
line is the user's own line that asked for the op (not a line inside wsched), so that a kernel
author can go straight to the offending expression.
"""

from __future__ import annotations

import os
import sys

# Frames of these packages are skipped when looking for the user's line: wsched is us, and torch
# frames appear when a proxy tensor goes through torch's __torch_function__ dispatch.
_INTERNAL_PACKAGES = ("wsched", "torch")


def _is_internal(module_name: str) -> bool:
    return any(module_name == package or module_name.startswith(package + ".")
               for package in _INTERNAL_PACKAGES)


def user_location() -> str:
    """`"file.py:LINE"` of the innermost stack frame outside wsched (and torch), or "" if none.

    Frames are classified by module name rather than file path because the wsched package maps
    several folders (lowering/, codegen/) into one import namespace.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if not _is_internal(frame.f_globals.get("__name__", "")):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def type_name(value: object) -> str:
    """How an error message names the type of a value that is not what was expected: `float`,
    `wsched.fusion.Fusion` (builtins unqualified, everything else with its module)."""
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class FusionError(ValueError):
    """A fusion definition or a call of it is wrong: shape, dtype, binding or unsupported op.

    `op` names what was being built or called ("matmul", "add", "mlp.reference"), `detail` says
    what is wrong with the shapes or dtypes involved, `location` is the user's "file.py:LINE"
    (found from the stack when not given).
    """

    def __init__(self, op: str, detail: str, location: str | None = None):
        self.op = op
        self.detail = detail
        self.location = user_location() if location is None else location
        message = f"{op}: {detail}"
        if self.location:
            message += f" at {self.location}"
        super().__init__(message)

    def __reduce__(self):
        # Exceptions pickle through their args; ours are (op, detail, location), not the message.
        return (type(self), (self.op, self.detail, self.location))


class ArgumentError(TypeError):
    """A wsched function was given an argument of a type it does not take (`build="no"`,
    `num_sms="4"`, `parse_kernel(None)`); the message names the argument, what it got and what it
    takes."""


def short_repr(value: object, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (a tensor or a long text in a message)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_argument(name: str, value: object, expected: type | tuple[type, ...], takes: str) -> None:
    """ArgumentError unless `value` is an instance of `expected` (a bool is not an int here)."""
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ArgumentError(f"{name}={short_repr(value)} ({type_name(value)}): expected {takes}")
