"""The fusion DSL and the tensor DAG it builds (DESIGN.md §2).

A user writes a plain Python function over `ws.Tensor` parameters. `@ws.fusion` calls it once,
at decoration time, with symbolic proxy tensors; every op on a proxy appends one `Node` to a DAG.
The result is a `Fusion`: a networkx DiGraph of frozen Nodes that the later stages (schedule,
partition, lowering) read, and `reference()`, the torch evaluation that every test and the
simulator compare against.

    @ws.fusion
    def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
            bias: ws.Tensor[ws.bf16, "N"]):
        return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)

    print(mlp)
    fusion mlp(a: bf16[M, K], b: bf16[K, N], bias: bf16[N]):
      n0 = matmul(a, b) : f32[M, N]   # mlp.py:5
      n1 = add(n0, bias) : f32[M, N]   # mlp.py:5
      n2 = gelu(n1) : f32[M, N]   # mlp.py:5
      n3 = cast(n2) : bf16[M, N]   # mlp.py:5
      return n3

Shapes follow numpy broadcasting over symbolic dims: a dim is an int (concrete) or a str (a
symbol, equal only to the same name), and a dim of 1 broadcasts. Nodes no output depends on are
dropped when tracing ends, and the remaining ones are numbered n0, n1, ... in creation order.
Mistakes raise `FusionError` naming the op, the shapes or dtypes, and the user's source line.
"""

from __future__ import annotations

import inspect
import numbers
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import networkx as nx
import torch
import torch.nn.functional as F

from .dtypes import DType, f32, promote
from .errors import FusionError, user_location

Dim = int | str
Shape = tuple[Dim, ...]

# Ids of non-input nodes; a parameter may not take one (it would collide in the printout).
_GENERATED_ID = re.compile(r"n\d+")


def format_type(dtype: DType, shape: Sequence[Dim]) -> str:
    """`bf16[M, K]`: how types appear in printouts and error messages."""
    return f"{dtype.name}[{', '.join(str(dim) for dim in shape)}]"


def _is_dim(dim: object) -> bool:
    return (isinstance(dim, str) and dim.isidentifier()) or (
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1)


def _format_attr(value: object) -> str:
    return value.name if isinstance(value, DType) else repr(value)


# --------------------------------------------------------------------------------------------
# The DAG's data: nodes and declared input types
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    """One op of the DAG. Frozen and compared by value, so later stages can key dicts by node
    and tests can compare graphs structurally."""

    id: str                                     # parameter name for inputs, else "n0", "n1", ...
    op: str                                     # 'input', 'const', 'matmul', 'add', ...
    inputs: tuple[str, ...]                     # operand node ids, in operand order
    dtype: DType
    shape: Shape                                # symbolic dims are str
    attrs: tuple[tuple[str, object], ...] = ()  # sorted by key
    source: str = ""                            # "file.py:LINE" of the user's line

    def __post_init__(self):
        # Normalise so that nodes built from lists or unsorted attrs still compare equal.
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "attrs", tuple(sorted(self.attrs, key=lambda item: item[0])))

    def attr(self, name: str, default: object = None) -> object:
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def type_str(self) -> str:
        return format_type(self.dtype, self.shape)

    def __str__(self) -> str:
        arguments = [*self.inputs, *(f"{key}={_format_attr(value)}" for key, value in self.attrs)]
        text = f"{self.id} = {self.op}({', '.join(arguments)}) : {self.type_str}"
        return f"{text}   # {self.source}" if self.source else text


@dataclass(frozen=True)
class TensorSpec:
    """What the annotation `ws.Tensor[dtype, dims...]` evaluates to: one input's declared type."""

    dtype: DType
    shape: Shape

    def __str__(self) -> str:
        return format_type(self.dtype, self.shape)


# --------------------------------------------------------------------------------------------
# Tracing: proxy tensors recording nodes
# --------------------------------------------------------------------------------------------

class _Trace:
    """The DAG being recorded while one @ws.fusion function runs; closed once it returns."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[Node] = []
        self.closed = False
        self._created = 0  # non-input nodes so far, for provisional ids

    def add(self, op: str, operands: Sequence[Tensor], dtype: DType, shape: Sequence[Dim],
            attrs: Iterable[tuple[str, object]] = ()) -> Tensor:
        # Provisional id; `finish` renumbers once dead nodes are gone.
        node_id = f"n{self._created}"
        self._created += 1
        node = Node(node_id, op, tuple(t.id for t in operands), dtype, tuple(shape),
                    tuple(attrs), user_location())
        self.nodes.append(node)
        return Tensor(self, node)

    def add_input(self, name: str, spec: TensorSpec, source: str) -> Tensor:
        node = Node(name, "input", (), spec.dtype, spec.shape, (), source)
        self.nodes.append(node)
        return Tensor(self, node)

    def symbols(self) -> set[str]:
        return {dim for node in self.nodes if node.op == "input" for dim in node.shape
                if isinstance(dim, str)}

    def finish(self, outputs: Sequence[Tensor]) -> Fusion:
        """Drop nodes no output depends on, number the rest n0, n1, ... and build the Fusion."""
        live = {t.id for t in outputs}
        for node in reversed(self.nodes):
            if node.id in live:
                live.update(node.inputs)
        kept = [node for node in self.nodes if node.op == "input" or node.id in live]
        renamed = {}
        for node in kept:
            if node.op != "input":
                renamed[node.id] = f"n{len(renamed)}"
        nodes = [replace(node, id=renamed.get(node.id, node.id),
                         inputs=tuple(renamed.get(i, i) for i in node.inputs)) for node in kept]
        return Fusion(self.name, nodes, [renamed.get(t.id, t.id) for t in outputs])


class Tensor:
    """A symbolic tensor inside a @ws.fusion function: a handle on one node of the DAG being
    traced. Operators and methods build nodes, like their torch namesakes.

    `ws.Tensor[dtype, dims...]` is the annotation for fusion parameters: dims are symbol names
    (str) or concrete sizes (int), e.g. `ws.Tensor[ws.bf16, "M", "K"]`.
    """

    __slots__ = ("_trace", "node")
    __array_ufunc__ = None  # numpy scalars on the left defer to our reflected operators

    def __init__(self, trace: _Trace, node: Node):
        self._trace = trace
        self.node = node

    def __class_getitem__(cls, params) -> TensorSpec:
        dtype, *dims = params if isinstance(params, tuple) else (params,)
        if not isinstance(dtype, DType):
            raise FusionError("Tensor[...]", "the first argument must be a ws dtype (ws.bf16, "
                              f"ws.f16, ws.f32, ws.i32), got {dtype!r}")
        for dim in dims:
            if not _is_dim(dim):
                raise FusionError("Tensor[...]", "dims must be symbol names (str) or positive "
                                  f"ints, got {dim!r}")
        return TensorSpec(dtype, tuple(dims))

    id = property(lambda self: self.node.id)
    dtype = property(lambda self: self.node.dtype)
    shape = property(lambda self: self.node.shape)
    ndim = property(lambda self: len(self.node.shape))

    def __repr__(self) -> str:
        return f"<ws.Tensor {self.node.id}: {self.node.type_str}>"

    def __add__(self, other): return add(self, other)
    def __radd__(self, other): return add(other, self)
    def __sub__(self, other): return sub(self, other)
    def __rsub__(self, other): return sub(other, self)
    def __mul__(self, other): return mul(self, other)
    def __rmul__(self, other): return mul(other, self)
    def __truediv__(self, other): return div(self, other)
    def __rtruediv__(self, other): return div(other, self)
    def __matmul__(self, other): return matmul(self, other)
    def __rmatmul__(self, other): return matmul(other, self)
    def __neg__(self): return neg(self)

    def to(self, dtype: DType) -> Tensor:
        return cast(self, dtype)

    def expand(self, *sizes: Dim) -> Tensor:
        return expand(self, *sizes)

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        return transpose(self, dim0, dim1)

    def sum(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return reduce_sum(self, dim, keepdim)

    def max(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return reduce_max(self, dim, keepdim)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch calls this when a proxy reaches a torch function (torch.exp(x), t + x, ...).
        # Proxies hold no data, so say which ws op to use instead of failing deep in torch.
        proxies = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, Tensor)]
        name = getattr(func, "__name__", repr(func)).strip("_")
        described = f" ({_describe(proxies[0])})" if proxies else ""
        instead = f"ws.{name}" if name in _WS_OP_NAMES else "ws ops"
        raise FusionError(f"torch.{name}", f"torch functions cannot take ws tensors{described}; "
                          f"use {instead} instead")


def _unsupported_operator(op: str, spelling: str):
    def raise_unsupported(self, *args):
        raise FusionError(op, f"`{spelling}` is not supported on ws tensors ({_describe(self)})")
    return raise_unsupported


# Python operators the DAG has no node for. Defining them, rather than leaving Python's generic
# TypeError, lets the error name the op and the user's line; __bool__ also catches data-dependent
# control flow, which tracing cannot see.
for _dunder, _op, _spelling in [
    ("__pow__", "pow", "x ** y"), ("__rpow__", "pow", "x ** y"),
    ("__mod__", "mod", "x % y"), ("__rmod__", "mod", "x % y"),
    ("__floordiv__", "floordiv", "x // y"), ("__rfloordiv__", "floordiv", "x // y"),
    ("__abs__", "abs", "abs(x)"), ("__pos__", "pos", "+x"), ("__invert__", "invert", "~x"),
    ("__and__", "and", "x & y"), ("__or__", "or", "x | y"), ("__xor__", "xor", "x ^ y"),
    ("__lt__", "lt", "x < y"), ("__le__", "le", "x <= y"), ("__gt__", "gt", "x > y"),
    ("__ge__", "ge", "x >= y"), ("__eq__", "eq", "x == y"), ("__ne__", "ne", "x != y"),
    ("__bool__", "bool", "bool(x) / if x"), ("__getitem__", "getitem", "x[...]"),
    ("__iter__", "iter", "iteration over x"), ("__len__", "len", "len(x)"),
    ("__float__", "float", "float(x)"), ("__int__", "int", "int(x)"),
    ("__index__", "index", "x as an index"),
]:
    setattr(Tensor, _dunder, _unsupported_operator(_op, _spelling))
Tensor.__hash__ = object.__hash__  # defining __eq__ would otherwise leave proxies unhashable


def _describe(t: Tensor) -> str:
    return f"{t.id} is {t.node.type_str}"


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _operands(op: str, values: Sequence[object], allow_scalars: bool = True) -> list[Tensor]:
    """The operands of `op` as proxies of one open trace; Python numbers become const nodes."""
    proxies = [value for value in values if isinstance(value, Tensor)]
    if not proxies:
        raise FusionError(op, "expects a ws tensor operand, got "
                          + ", ".join(_type_name(value) for value in values))
    trace = proxies[0]._trace
    for proxy in proxies:
        if proxy._trace is not trace:
            raise FusionError(op, f"operands come from different fusions: {proxies[0].id} of "
                              f"{trace.name}, {proxy.id} of {proxy._trace.name}")
    if trace.closed:
        raise FusionError(op, f"{proxies[0].id} of fusion {trace.name} is used after tracing "
                          "ended; ws ops only work inside the @ws.fusion function")
    result = []
    for index, value in enumerate(values):
        if isinstance(value, Tensor):
            result.append(value)
        elif (allow_scalars and isinstance(value, numbers.Real)
              and not isinstance(value, bool)):
            result.append(trace.add("const", (), f32, (), [("value", float(value))]))
        else:
            accepted = "ws tensors and Python numbers" if allow_scalars else "ws tensors"
            raise FusionError(op, f"operand {index} has type {_type_name(value)}; {op} takes "
                              f"{accepted}")
    return result


# --------------------------------------------------------------------------------------------
# Shape and dtype rules
# --------------------------------------------------------------------------------------------

def _broadcast_dims(a: Shape, b: Shape) -> tuple[Shape, tuple[Dim, Dim] | None]:
    """numpy broadcasting of two symbolic shapes: (result, None), or ((), the conflicting pair
    of dims, rightmost first)."""
    result = []
    for back in range(1, max(len(a), len(b)) + 1):
        dim_a = a[-back] if back <= len(a) else 1
        dim_b = b[-back] if back <= len(b) else 1
        if dim_a == dim_b or dim_b == 1:
            result.append(dim_a)
        elif dim_a == 1:
            result.append(dim_b)
        else:
            return (), (dim_a, dim_b)
    return tuple(reversed(result)), None


def _promote(op: str, a: Tensor, b: Tensor) -> DType:
    dtype = promote(a.dtype, b.dtype)
    if dtype is None:
        raise FusionError(op, f"dtype mismatch: {_describe(a)}, {_describe(b)} "
                          f"({a.dtype} vs {b.dtype})")
    return dtype


def _require_float(op: str, x: Tensor) -> None:
    if not x.dtype.is_float:
        raise FusionError(op, f"expects a floating-point tensor, but {_describe(x)}")


def _normalize_dim(op: str, x: Tensor, dim: object) -> int:
    """`dim` as a negative index (stable when batch dims are added in front)."""
    if dim is None:
        raise FusionError(op, f"needs a dim, only one dim is reduced at a time ({_describe(x)})")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise FusionError(op, f"dim must be an int, got {dim!r}")
    if not -x.ndim <= dim < x.ndim:
        raise FusionError(op, f"dim {dim} is out of range for {_describe(x)}")
    return dim - x.ndim if dim >= 0 else dim


# --------------------------------------------------------------------------------------------
# Ops: each builds one node
# --------------------------------------------------------------------------------------------

def matmul(a: Tensor, b: Tensor) -> Tensor:
    """[..., M, K] @ [..., K, N] -> f32[..., M, N]: the result is the fp32 accumulator; leading
    (batch) dims broadcast. Operands are bf16 or f16 (not mixed); an f32 operand may meet either
    (softmax probabilities times V in attention): the reference multiplies in fp32, a kernel
    may round that operand to the 16-bit type to feed the tensor cores."""
    a, b = _operands("matmul", (a, b), allow_scalars=False)
    for operand in (a, b):
        if operand.ndim < 2:
            raise FusionError("matmul", f"operands need at least 2 dims, but {_describe(operand)}")
        _require_float("matmul", operand)
    _promote("matmul", a, b)
    if a.shape[-1] != b.shape[-2]:
        raise FusionError("matmul", f"inner dimensions differ: {_describe(a)}, {_describe(b)} "
                          f"({a.shape[-1]} vs {b.shape[-2]})")
    batch, conflict = _broadcast_dims(a.shape[:-2], b.shape[:-2])
    if conflict:
        raise FusionError("matmul", f"batch dimensions do not broadcast: {_describe(a)}, "
                          f"{_describe(b)} ({conflict[0]} vs {conflict[1]})")
    return a._trace.add("matmul", (a, b), f32, (*batch, a.shape[-2], b.shape[-1]))


def _binary(op: str, lhs: Tensor | float, rhs: Tensor | float) -> Tensor:
    a, b = _operands(op, (lhs, rhs))
    shape, conflict = _broadcast_dims(a.shape, b.shape)
    if conflict:
        raise FusionError(op, f"shapes do not broadcast: {_describe(a)}, {_describe(b)} "
                          f"({conflict[0]} vs {conflict[1]})")
    # A Python number is weak, as in torch: it takes the tensor's dtype instead of promoting it.
    if a.node.op == "const":
        dtype = b.dtype
    elif b.node.op == "const":
        dtype = a.dtype
    else:
        dtype = _promote(op, a, b)
    return a._trace.add(op, (a, b), dtype, shape)


def _public_op(op: str, doc: str, function: Callable) -> Callable:
    """`function` named and documented as the ws op `op` (so help(ws.exp) reads well)."""
    function.__name__ = function.__qualname__ = op
    function.__doc__ = doc
    return function


def _binary_op(op: str, doc: str) -> Callable[[Tensor | float, Tensor | float], Tensor]:
    return _public_op(op, doc + " Elementwise, numpy broadcasting; a Python number keeps the "
                      "tensor's dtype.", lambda a, b: _binary(op, a, b))


add = _binary_op("add", "a + b.")
sub = _binary_op("sub", "a - b.")
mul = _binary_op("mul", "a * b.")
div = _binary_op("div", "a / b.")
maximum = _binary_op("maximum", "The larger of a and b.")
minimum = _binary_op("minimum", "The smaller of a and b.")

# Unary ops that make no sense on integers (and that the reference would silently truncate).
_FLOAT_ONLY = {"exp", "exp2", "log", "gelu", "silu", "sigmoid", "tanh"}


def _unary(op: str, x: Tensor) -> Tensor:
    (x,) = _operands(op, (x,), allow_scalars=False)
    if op in _FLOAT_ONLY:
        _require_float(op, x)
    return x._trace.add(op, (x,), x.dtype, x.shape)


def _unary_op(op: str, doc: str) -> Callable[[Tensor], Tensor]:
    return _public_op(op, doc + " Elementwise; same dtype as x (the reference computes it in "
                      "fp32).", lambda x: _unary(op, x))


neg = _unary_op("neg", "-x.")
exp = _unary_op("exp", "e ** x.")
exp2 = _unary_op("exp2", "2 ** x.")
log = _unary_op("log", "Natural logarithm.")
relu = _unary_op("relu", "max(x, 0).")
gelu = _unary_op("gelu", "Exact (erf) GELU, torch's default.")
silu = _unary_op("silu", "x * sigmoid(x).")
sigmoid = _unary_op("sigmoid", "1 / (1 + e ** -x).")
tanh = _unary_op("tanh", "Hyperbolic tangent.")


def cast(x: Tensor, dtype: DType) -> Tensor:
    """x rounded to `dtype` (also `x.to(dtype)`); a cast to x's own dtype adds no node."""
    (x,) = _operands("cast", (x,), allow_scalars=False)
    if not isinstance(dtype, DType):
        raise FusionError("cast", "expected a ws dtype (ws.bf16, ws.f16, ws.f32, ws.i32), "
                          f"got {dtype!r}")
    if dtype == x.dtype:
        return x
    return x._trace.add("cast", (x,), dtype, x.shape)


def expand(x: Tensor, *sizes: Dim) -> Tensor:
    """x broadcast to `sizes` (like torch's expand): new dims may be added in front, dims of
    size 1 may grow, -1 keeps a dim. Also `x.expand(*sizes)`."""
    (x,) = _operands("expand", (x,), allow_scalars=False)
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    wanted = "[" + ", ".join(map(str, sizes)) + "]"
    if len(sizes) < x.ndim:
        raise FusionError("expand", f"cannot expand {_describe(x)} to fewer dims {wanted}")
    new_dims = len(sizes) - x.ndim
    shape = []
    for index, size in enumerate(sizes):
        old = x.shape[index - new_dims] if index >= new_dims else None
        if size == -1 and old is not None:
            shape.append(old)
        elif not _is_dim(size):
            raise FusionError("expand", f"size {size!r} of {wanted} is not a symbol name or a "
                              "positive int")
        elif isinstance(size, str) and size not in x._trace.symbols():
            # Sizes come from binding the inputs; a symbol no input has could never be bound.
            raise FusionError("expand", f"symbol {size} of {wanted} is not a dim of any input")
        elif old is None or old == 1 or old == size:
            shape.append(size)
        else:
            raise FusionError("expand", f"cannot expand {_describe(x)} to {wanted} "
                              f"({old} vs {size})")
    if tuple(shape) == x.shape:
        return x
    return x._trace.add("expand", (x,), x.dtype, shape)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """A view of x with two dims swapped (also `x.transpose(dim0, dim1)`); attrs hold the two
    dims as negative indices, smaller first."""
    (x,) = _operands("transpose", (x,), allow_scalars=False)
    dim0, dim1 = sorted((_normalize_dim("transpose", x, dim0),
                         _normalize_dim("transpose", x, dim1)))
    if dim0 == dim1:
        return x
    shape = list(x.shape)
    shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
    return x._trace.add("transpose", (x,), x.dtype, shape, [("dim0", dim0), ("dim1", dim1)])


def _reduce(op: str, x: Tensor, dim: int | None, keepdim: bool, float_only: bool = False,
            ) -> Tensor:
    (x,) = _operands(op, (x,), allow_scalars=False)
    if float_only:
        _require_float(op, x)
    dim = _normalize_dim(op, x, dim)
    if not isinstance(keepdim, bool):
        raise FusionError(op, f"keepdim must be True or False, got {keepdim!r}")
    axis = x.ndim + dim
    shape = (*x.shape[:axis], *((1,) if keepdim else ()), *x.shape[axis + 1:])
    return x._trace.add(op, (x,), x.dtype, shape, [("dim", dim), ("keepdim", keepdim)])


def reduce_sum(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Sum over one dim (`ws.sum`, `x.sum(dim)`); same dtype as x, accumulated in fp32."""
    return _reduce("sum", x, dim, keepdim)


def reduce_max(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Maximum over one dim (`ws.max`, `x.max(dim)`): the values only, not torch's indices."""
    return _reduce("max", x, dim, keepdim)


def logsumexp(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """log(sum(exp(x))) over one dim, computed stably; same dtype as x."""
    return _reduce("logsumexp", x, dim, keepdim, float_only=True)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) over one dim; same shape and dtype as x."""
    (x,) = _operands("softmax", (x,), allow_scalars=False)
    _require_float("softmax", x)
    dim = _normalize_dim("softmax", x, dim)
    return x._trace.add("softmax", (x,), x.dtype, x.shape, [("dim", dim)])


CAUSAL_ALIGNS = ("top_left", "bottom_right")


def causal_mask(x: Tensor, align: str = "top_left") -> Tensor:
    """x with -inf where the key index j exceeds the query index i, over the last two dims
    [..., Sq, Sk]. "top_left" keeps j <= i (torch SDPA's is_causal); "bottom_right" keeps
    j <= i + Sk - Sq, so the last query sees every key (FlashAttention's rule for Sq != Sk)."""
    (x,) = _operands("causal_mask", (x,), allow_scalars=False)
    _require_float("causal_mask", x)
    if x.ndim < 2:
        raise FusionError("causal_mask", f"needs [..., queries, keys] dims, but {_describe(x)}")
    if align not in CAUSAL_ALIGNS:
        raise FusionError("causal_mask", f"align must be 'top_left' or 'bottom_right', "
                          f"got {align!r}")
    return x._trace.add("causal_mask", (x,), x.dtype, x.shape, [("align", align)])


# --------------------------------------------------------------------------------------------
# The Fusion: graph, binding, reference evaluation
# --------------------------------------------------------------------------------------------

_ELEMENTWISE = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}

# torch function names with a ws op of the same name (for the hint in __torch_function__).
_WS_OP_NAMES = {*_ELEMENTWISE, "matmul", "softmax", "logsumexp", "sum", "max", "expand",
                "transpose"}


def _reference_op(node: Node, args: list[torch.Tensor], sizes: dict[str, int],
                  device: torch.device) -> torch.Tensor:
    """One node evaluated in fp32 on fp32 operands (rounding to node.dtype is the caller's)."""
    op = node.op
    if op in _ELEMENTWISE:
        return _ELEMENTWISE[op](*args)
    if op == "const":
        return torch.tensor(node.attr("value"), dtype=torch.float32, device=device)
    if op == "matmul":
        return torch.matmul(*args)
    if op == "cast":
        return args[0]  # the rounding to node.dtype is the cast
    if op == "expand":
        return args[0].expand([sizes[dim] if isinstance(dim, str) else dim for dim in node.shape])
    if op == "transpose":
        return args[0].transpose(node.attr("dim0"), node.attr("dim1"))
    if op == "sum":
        return args[0].sum(node.attr("dim"), keepdim=node.attr("keepdim"))
    if op == "max":
        return args[0].amax(node.attr("dim"), keepdim=node.attr("keepdim"))
    if op == "logsumexp":
        return torch.logsumexp(args[0], node.attr("dim"), keepdim=node.attr("keepdim"))
    if op == "softmax":
        return torch.softmax(args[0], node.attr("dim"))
    if op == "causal_mask":
        queries, keys = args[0].shape[-2:]
        offset = 0 if node.attr("align") == "top_left" else keys - queries
        query = torch.arange(queries, device=device)[:, None]
        key = torch.arange(keys, device=device)[None, :]
        return args[0].masked_fill(key > query + offset, float("-inf"))
    raise FusionError(op, f"the reference has no rule for node {node.id}", node.source)


class Fusion:
    """A traced tensor DAG: `graph` maps node id -> attribute "node" (a Node), with an edge
    (u, v, {"operand": i}) for each operand (for `x * x` the one edge also carries
    "operands": (0, 1); Node.inputs is the authoritative operand list).

    Built by `@ws.fusion`, or directly from nodes listed in creation order (each node's
    operands listed before it). Treat it as immutable.
    """

    def __init__(self, name: str, nodes: Iterable[Node], outputs: Iterable[str]):
        self.name = name
        self.graph = nx.DiGraph()
        self._creation: dict[str, int] = {}
        for node in nodes:
            if node.id in self._creation:
                raise FusionError(name, f"duplicate node id {node.id}", node.source)
            for source in node.inputs:
                if source not in self._creation:
                    raise FusionError(name, f"node {node.id} uses {source} before it is "
                                      "defined", node.source)
            self._creation[node.id] = len(self._creation)
            self.graph.add_node(node.id, node=node)
            for operand, source in enumerate(node.inputs):
                if self.graph.has_edge(source, node.id):
                    edge = self.graph.edges[source, node.id]
                    edge["operands"] = (*edge.get("operands", (edge["operand"],)), operand)
                else:
                    self.graph.add_edge(source, node.id, operand=operand)
        self.inputs: tuple[Node, ...] = tuple(n for n in self.nodes() if n.op == "input")
        self.outputs: tuple[str, ...] = tuple(outputs)
        for output in self.outputs:
            if output not in self._creation:
                raise FusionError(name, f"output {output} is not a node of the fusion", "")

    def nodes(self) -> list[Node]:
        """Every node in a deterministic topological order (creation order breaks ties)."""
        order = nx.lexicographical_topological_sort(self.graph, key=self._creation.__getitem__)
        return [self.graph.nodes[node_id]["node"] for node_id in order]

    def node(self, node_id: str) -> Node:
        return self.graph.nodes[node_id]["node"]

    def consumers(self, node_id: str) -> list[Node]:
        """The nodes that read `node_id`, in creation order."""
        return [self.node(user) for user in
                sorted(self.graph.successors(node_id), key=self._creation.__getitem__)]

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbolic dims of the inputs, in order of first appearance."""
        found = dict.fromkeys(d for node in self.inputs for d in node.shape if isinstance(d, str))
        return tuple(found)

    def bind(self, *tensors: torch.Tensor | Sequence[int]) -> dict[str, int]:
        """The size of every symbol, from torch tensors (shape and dtype checked) or shapes
        (torch.Size or tuples; shape checked), one per input in declaration order."""
        return self._bind(f"{self.name}.bind", tensors)

    def _bind(self, op: str, tensors: Sequence[object]) -> dict[str, int]:
        if len(tensors) != len(self.inputs):
            names = ", ".join(node.id for node in self.inputs)
            raise FusionError(op, f"expected {len(self.inputs)} inputs ({names}), "
                              f"got {len(tensors)}")
        sizes: dict[str, int] = {}
        bound_at: dict[str, str] = {}  # symbol -> "a dim 1", where its size was first seen
        for declared, value in zip(self.inputs, tensors):
            shape = _shape_of(op, declared, value)
            if len(shape) != len(declared.shape):
                raise FusionError(op, f"{declared.id} is declared {declared.type_str} but got "
                                  f"shape {shape} (rank {len(shape)}, expected "
                                  f"{len(declared.shape)})")
            for axis, (dim, size) in enumerate(zip(declared.shape, shape)):
                here = f"{declared.id} dim {axis}"
                if isinstance(dim, int):
                    if size != dim:
                        raise FusionError(op, f"{declared.id} is declared {declared.type_str} "
                                          f"but {here} has size {size}")
                elif dim not in sizes:
                    sizes[dim], bound_at[dim] = size, here
                elif sizes[dim] != size:
                    raise FusionError(op, f"symbol {dim} is bound to two sizes: {sizes[dim]} "
                                      f"({bound_at[dim]}) and {size} ({here})")
        return sizes

    def reference(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Evaluate the DAG with torch: inputs upcast to fp32, every node computed in fp32 and
        rounded to its declared dtype (so bf16 intermediates round where a kernel's would).
        Returns the output, or a tuple of outputs, in their declared dtypes."""
        op = f"{self.name}.reference"
        for index, value in enumerate(tensors):
            if not isinstance(value, torch.Tensor):
                raise FusionError(op, f"input {index} has type {_type_name(value)}; expected a "
                                  "torch tensor")
        sizes = self._bind(op, tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        values: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for declared, value in zip(self.inputs, tensors):
                values[declared.id] = value.float()
            for node in self.nodes():
                if node.op != "input":
                    result = _reference_op(node, [values[i] for i in node.inputs], sizes, device)
                    if node.dtype != f32:
                        result = result.to(node.dtype.torch_dtype).float()
                    values[node.id] = result
        outputs = tuple(values[o].to(self.node(o).dtype.torch_dtype) for o in self.outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def __str__(self) -> str:
        parameters = ", ".join(f"{node.id}: {node.type_str}" for node in self.inputs)
        lines = [f"fusion {self.name}({parameters}):"]
        lines += [f"  {node}" for node in self.nodes() if node.op != "input"]
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        inputs = ", ".join(node.id for node in self.inputs)
        return f"<Fusion {self.name}({inputs}) -> {', '.join(self.outputs)}: {len(self.graph)} nodes>"


def _shape_of(op: str, declared: Node, value: object) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        if value.dtype != declared.dtype.torch_dtype:
            raise FusionError(op, f"{declared.id} is declared {declared.type_str} but got a "
                              f"{value.dtype} tensor of shape {tuple(value.shape)}")
        return tuple(value.shape)
    if isinstance(value, (tuple, list)) and all(
            isinstance(size, int) and not isinstance(size, bool) for size in value):
        return tuple(value)
    raise FusionError(op, f"{declared.id}: expected a torch tensor or a shape, got "
                      f"{_type_name(value)}")


# --------------------------------------------------------------------------------------------
# The decorator
# --------------------------------------------------------------------------------------------

def fusion(fn: Callable[..., Tensor | tuple[Tensor, ...]]) -> Fusion:
    """Trace `fn` once with symbolic tensors built from its `ws.Tensor[...]` annotations and
    return the Fusion it describes. Return one tensor, or a tuple for several outputs."""
    name = fn.__name__
    code = fn.__code__
    definition = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    try:
        signature = inspect.signature(fn, eval_str=True)
    except NameError as error:
        raise FusionError(name, f"cannot evaluate the parameter annotations ({error})",
                          definition) from error
    trace = _Trace(name)
    parameters = []
    for parameter in signature.parameters.values():
        spec = parameter.annotation
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise FusionError(name, f"variadic parameter {parameter.name} is not supported; "
                              "declare each input", definition)
        if not isinstance(spec, TensorSpec):
            got = "none" if spec is parameter.empty else repr(spec)
            raise FusionError(name, f"parameter {parameter.name} needs a ws.Tensor[dtype, "
                              f"dims...] annotation, got {got}", definition)
        if _GENERATED_ID.fullmatch(parameter.name):
            raise FusionError(name, f"parameter name {parameter.name} is reserved for "
                              "intermediate nodes (n0, n1, ...)", definition)
        parameters.append(trace.add_input(parameter.name, spec, definition))
    try:
        result = fn(*parameters)
    finally:
        trace.closed = True
    results = result if isinstance(result, tuple) else (result,)
    if not results:
        raise FusionError(name, "returns an empty tuple; return at least one ws tensor",
                          definition)
    for index, value in enumerate(results):
        if not isinstance(value, Tensor) or value._trace is not trace:
            what = "is a ws tensor of another fusion" if isinstance(value, Tensor) else (
                f"has type {_type_name(value)}")
            raise FusionError(name, "must return a ws tensor or a tuple of them, but return "
                              f"value {index} {what}", definition)
    return trace.finish(results)
