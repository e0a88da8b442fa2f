"""What a @ws.fusion function calls while it is traced: the proxy `ws.Tensor` and the DSL ops.

A proxy holds no data, only a handle on one node of the DAG being recorded (`fusion.Trace`).
Each op checks its operands' shapes and dtypes, then records one node through the trace:

    ws.matmul(a, b)   # a: bf16[M, K], b: bf16[K, N]  ->  n0 = matmul(a, b) : f32[M, N]

Shapes follow numpy broadcasting over symbolic dims: a dim is an int (concrete) or a str (a
symbol, equal only to the same name), and a dim of 1 broadcasts. Mistakes raise `FusionError`
naming the op, the shapes or dtypes, and the user's source line.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from .dtypes import DTYPES, DType, bool8, f32, i32, promote
from .errors import FusionError, type_name
from .target import COMPARE_OPS, ELEMENTWISE_OPS, UNARY_OPS

if TYPE_CHECKING:  # the trace and its nodes are built in fusion.py, which imports this module
    from .fusion import Node, Trace

Dim = int | str
Shape = tuple[Dim, ...]

# "ws.bf16, ws.f16, ws.f32, ws.i32": the dtypes an annotation or a cast may name.
_DTYPE_CHOICES = ", ".join(repr(dtype) for dtype in DTYPES)


def format_type(dtype: DType, shape: Sequence[Dim]) -> str:
    """`bf16[M, K]`: how types appear in printouts and error messages."""
    return f"{dtype.name}[{', '.join(str(dim) for dim in shape)}]"


def plus_one_base(dim: object) -> str | None:
    """"B" for a dim declared "B+1" (the offsets of B packed sequences, ws.varlen), else None."""
    if isinstance(dim, str) and dim.endswith("+1") and dim[:-2].isidentifier():
        return dim[:-2]
    return None


def _is_dim(dim: object) -> bool:
    """A symbol ("B"), a symbol plus one ("B+1": the offsets of B packed sequences, ws.varlen)
    or a positive size."""
    return (isinstance(dim, str) and (dim.isidentifier() or plus_one_base(dim) is not None)) or (
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1)


@dataclass(frozen=True)
class TensorSpec:
    """What the annotation `ws.Tensor[dtype, dims...]` evaluates to: one input's declared type."""

    dtype: DType
    shape: Shape

    def __str__(self) -> str:
        return format_type(self.dtype, self.shape)


# --------------------------------------------------------------------------------------------
# The proxy tensor
# --------------------------------------------------------------------------------------------

class Tensor:
    """A symbolic tensor inside a @ws.fusion function: a handle on one node of the DAG being
    traced. Operators and methods build nodes, like their torch namesakes.

    `ws.Tensor[dtype, dims...]` is the annotation for fusion parameters: dims are symbol names
    (str) or concrete sizes (int), e.g. `ws.Tensor[ws.bf16, "M", "K"]`.
    """

    __slots__ = ("_trace", "node")
    __array_ufunc__ = None  # numpy scalars on the left defer to our reflected operators

    def __init__(self, trace: Trace, node: Node):
        self._trace = trace
        self.node = node

    def __class_getitem__(cls, params) -> TensorSpec:
        if isinstance(params, tuple) and not params:
            raise FusionError("Tensor[...]", f"needs a ws dtype ({_DTYPE_CHOICES}) and the dims, e.g. "
                              "ws.Tensor[ws.bf16, \"M\", \"K\"]")
        dtype, *dims = params if isinstance(params, tuple) else (params,)
        if not isinstance(dtype, DType):
            raise FusionError("Tensor[...]", f"the first argument must be a ws dtype "
                              f"({_DTYPE_CHOICES}), got {dtype!r}")
        for dim in dims:
            if not _is_dim(dim):
                raise FusionError("Tensor[...]", "dims must be symbol names (str), a symbol plus one "
                                  f"(\"B+1\", offsets of B sequences) or positive ints, got {dim!r}")
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
    # Comparisons build bool tensors (masks); `& | ~` combine them. Python turns `0 < x` into
    # `x > 0`, so the reflected forms need nothing of their own.
    def __lt__(self, other): return lt(self, other)
    def __le__(self, other): return le(self, other)
    def __gt__(self, other): return gt(self, other)
    def __ge__(self, other): return ge(self, other)
    def __eq__(self, other): return eq(self, other)   # type: ignore[override]
    def __ne__(self, other): return ne(self, other)   # type: ignore[override]
    def __and__(self, other): return logical_and(self, other)
    def __rand__(self, other): return logical_and(other, self)
    def __or__(self, other): return logical_or(self, other)
    def __ror__(self, other): return logical_or(other, self)
    def __invert__(self): return logical_not(self)

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
    ("__abs__", "abs", "abs(x)"), ("__pos__", "pos", "+x"), ("__xor__", "xor", "x ^ y"),
    ("__rxor__", "xor", "x ^ y"),
    ("__bool__", "bool", "bool(x) / if x"), ("__getitem__", "getitem", "x[...]"),
    ("__iter__", "iter", "iteration over x"), ("__len__", "len", "len(x)"),
    ("__float__", "float", "float(x)"), ("__int__", "int", "int(x)"),
    ("__index__", "index", "x as an index"),
]:
    setattr(Tensor, _dunder, _unsupported_operator(_op, _spelling))
Tensor.__hash__ = object.__hash__  # defining __eq__ would otherwise leave proxies unhashable

# torch function names with a ws op of the same name (for the hint in __torch_function__).
_WS_OP_NAMES = {*ELEMENTWISE_OPS, *COMPARE_OPS, "logical_not", "where", "matmul", "softmax",
                "logsumexp", "sum", "max", "expand", "transpose"}


def _describe(t: Tensor) -> str:
    return f"{t.id} is {t.node.type_str}"


def _operands(op: str, values: Sequence[object], allow_scalars: bool = True) -> list[Tensor]:
    """The operands of `op` as proxies of one open trace; Python numbers become const nodes."""
    proxies = [value for value in values if isinstance(value, Tensor)]
    if not proxies:
        raise FusionError(op, "expects a ws tensor operand, got "
                          + ", ".join(type_name(value) for value in values))
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
            raise FusionError(op, f"operand {index} has type {type_name(value)}; {op} takes "
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
        hint = ""
        if any(isinstance(d, str) and d.endswith("-1") for d in conflict):   # ws.varlen's B1-1 beside a cache's B
            hint = "; declare the offsets of ws.varlen [B+1] to give its view the batch B of the other operand"
        raise FusionError("matmul", f"batch dimensions do not broadcast: {_describe(a)}, "
                          f"{_describe(b)} ({conflict[0]} vs {conflict[1]}){hint}")
    return a._trace.add("matmul", (a, b), f32, (*batch, a.shape[-2], b.shape[-1]))


def _binary(op: str, lhs: Tensor | float, rhs: Tensor | float) -> Tensor:
    a, b = _operands(op, (lhs, rhs))
    shape, conflict = _broadcast_dims(a.shape, b.shape)
    if conflict:
        raise FusionError(op, f"shapes do not broadcast: {_describe(a)}, {_describe(b)} "
                          f"({conflict[0]} vs {conflict[1]})")
    _require_values(op, a, b)
    return a._trace.add(op, (a, b), _result_dtype(op, a, b), shape)


def _result_dtype(op: str, a: Tensor, b: Tensor) -> DType:
    """The dtype of an elementwise op on a and b. A Python number is weak, as in torch: it takes
    the tensor's dtype instead of promoting it (a fractional number meets an i32 tensor in f32)."""
    if a.node.op == "const" and b.node.op == "const":
        return f32
    if a.node.op == "const" or b.node.op == "const":
        number, tensor = (a, b) if a.node.op == "const" else (b, a)
        value = number.node.attr("value")
        if tensor.dtype == i32 and not float(value).is_integer():
            return f32
        return tensor.dtype
    return _promote(op, a, b)


def _require_values(op: str, *operands: Tensor) -> None:
    """Arithmetic takes numbers: a comparison's bool result becomes values through ws.where."""
    for x in operands:
        if x.dtype == bool8:
            raise FusionError(op, f"{x.id} is a comparison ({x.node.type_str}); {op} takes numbers: turn "
                              "a mask into values with ws.where(cond, a, b)")


def _public_op(op: str, doc: str, function: Callable) -> Callable:
    """`function` named and documented as the ws op `op` (so help(ws.exp) reads well)."""
    function.__name__ = function.__qualname__ = op
    function.__doc__ = doc
    return function


# The elementwise ops below are target.BINARY_OPS and target.UNARY_OPS (cast is `cast`, which
# takes a dtype): the ops a kernel's consumer warpgroups compute on register tiles.

def _binary_op(op: str, doc: str) -> Callable[[Tensor | float, Tensor | float], Tensor]:
    return _public_op(op, doc + " Elementwise, numpy broadcasting; a Python number keeps the "
                      "tensor's dtype.", lambda a, b: _binary(op, a, b))


add = _binary_op("add", "a + b.")
sub = _binary_op("sub", "a - b.")
mul = _binary_op("mul", "a * b.")
div = _binary_op("div", "a / b.")
maximum = _binary_op("maximum", "The larger of a and b.")
minimum = _binary_op("minimum", "The smaller of a and b.")

# Unary ops that are exact on integers. Every other unary op of the target makes no sense on
# integers (and the reference would silently truncate it), so it takes floats only.
_INTEGER_UNARY_OPS = {"neg", "relu"}
_FLOAT_ONLY = set(UNARY_OPS) - _INTEGER_UNARY_OPS


def _unary(op: str, x: Tensor) -> Tensor:
    (x,) = _operands(op, (x,), allow_scalars=False)
    _require_values(op, x)
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
        raise FusionError("cast", f"expected a ws dtype ({_DTYPE_CHOICES}), got {dtype!r}")
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


def logsumexp(x: Tensor, dim: int = -1, keepdim: bool = False, sink: Tensor | float | None = None) -> Tensor:
    """log(sum(exp(x))) over one dim, computed stably; same dtype as x. With `sink` (see
    ws.softmax) the sum has one more term, exp(sink)."""
    if sink is None:
        return _reduce("logsumexp", x, dim, keepdim, float_only=True)
    out = _reduce("logsumexp", x, dim, keepdim, float_only=True)
    sink = _sink("logsumexp", x, _normalize_dim("logsumexp", x, dim), sink)
    return x._trace.add("logsumexp", (x, sink), out.dtype, out.shape, out.node.attrs)


def softmax(x: Tensor, dim: int = -1, sink: Tensor | float | None = None) -> Tensor:
    """exp(x) / sum(exp(x)) over one dim; same shape and dtype as x. `sink` is an attention sink:
    one more logit per row that joins the denominator, exp(x) / (exp(sink) + sum(exp(x))), with
    no value of its own (torch: the softmax of x with the sink appended, the sink's column
    dropped). It broadcasts against x with the reduced dim 1, e.g. a learned logit per head
    `ws.Tensor[ws.f32, "H", 1, 1]`; a Python number is one logit for every row."""
    (x,) = _operands("softmax", (x,), allow_scalars=False)
    _require_float("softmax", x)
    dim = _normalize_dim("softmax", x, dim)
    if sink is None:
        return x._trace.add("softmax", (x,), x.dtype, x.shape, [("dim", dim)])
    sink = _sink("softmax", x, dim, sink)
    return x._trace.add("softmax", (x, sink), x.dtype, x.shape, [("dim", dim)])


def _sink(op: str, x: Tensor, dim: int, sink: Tensor | float) -> Tensor:
    """The sink logit of `op` over dim `dim` of x, checked: over the last dim, broadcasting
    against x with that dim 1."""
    (x, sink) = _operands(op, (x, sink))
    _require_float(op, sink)
    if dim != -1:
        raise FusionError(op, f"a sink joins a softmax over the last dim (the keys), not dim {dim}")
    rows = (*x.shape[:-1], 1)
    shape, conflict = _broadcast_dims(sink.shape, rows)
    if conflict or shape != rows:
        raise FusionError(op, f"the sink {_describe(sink)} must broadcast against {_describe(x)} with "
                          f"its last dim 1 (one logit per row, e.g. per head [H, 1, 1])")
    return sink


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
    lengths = _key_lengths_of(x)
    operands = (x,) if lengths is None else (x, lengths)
    return x._trace.add("causal_mask", operands, x.dtype, x.shape, [("align", align)])


# --------------------------------------------------------------------------------------------
# Caches: per-sequence key lengths and paged K / V
# --------------------------------------------------------------------------------------------

def key_lengths(x: Tensor, lengths: Tensor) -> Tensor:
    """Scores [B, ..., queries, keys] of sequences that hold fewer keys than the cache: the keys
    j >= lengths[b] of sequence b are -inf (hidden), so the softmax and the log-sum-exp see its
    first lengths[b] keys only. `lengths` is an i32 [B] tensor (FlashAttention's cache_seqlens).
    A bottom-right `causal_mask` taken after it aligns to each sequence's own length: query i of
    S sees keys j <= i + lengths[b] - S. A sequence of length 0 gives O = 0 and LSE = -inf."""
    (x,) = _operands("key_lengths", (x,), allow_scalars=False)
    _require_float("key_lengths", x)
    if not isinstance(lengths, Tensor):
        raise FusionError("key_lengths", f"lengths must be an i32 [B] fusion input, got {type_name(lengths)}")
    if x.ndim < 3:
        raise FusionError("key_lengths", f"needs [B, ..., queries, keys] scores, but {_describe(x)}")
    if lengths.dtype != i32 or lengths.shape != (x.shape[0],) or lengths.node.op != "input":
        raise FusionError("key_lengths", f"lengths must be an i32 fusion input of shape [{x.shape[0]}] (one "
                          f"length per sequence, dim 0 of the scores {_describe(x)}), but {_describe(lengths)}")
    known = _key_lengths_of(x)
    if known is not None and known.id != lengths.id:
        raise FusionError("key_lengths", f"the scores already have key lengths {known.id}; a sequence has one "
                          f"length")
    return x._trace.add("key_lengths", (x, lengths), x.dtype, x.shape)


def _key_lengths_of(x: Tensor) -> Tensor | None:
    """The lengths input of a `key_lengths` that x is computed from, if any."""
    nodes = {n.id: n for n in x._trace.nodes}
    stack, seen = [x.node], set()
    while stack:
        node = stack.pop()
        if node.id in seen:
            continue
        seen.add(node.id)
        if node.op == "key_lengths":
            return Tensor(x._trace, nodes[node.inputs[1]])
        if node.op not in ("matmul", "input"):
            stack.extend(nodes[i] for i in node.inputs)
    return None


def paged(cache: Tensor, block_table: Tensor) -> Tensor:
    """K or V of a paged cache as the [B, HK, 1, T, D] tensor attention reads, T = max_pages x
    page_size: `cache` is [num_pages, page_size, HK, D] (the vLLM / FlashInfer layout) and
    `block_table` an i32 [B, max_pages] input; key t of sequence b is
    cache[block_table[b, t // page_size], t % page_size]. Write Q as [B, HK, G, S, D] (G query
    heads share a KV head; G = 1 for multi-head attention), and give the sequences' lengths with
    `ws.key_lengths` (pages past a sequence's end are never read)."""
    cache, block_table = _operands("paged", (cache, block_table), allow_scalars=False)
    if cache.ndim != 4 or cache.node.op != "input":
        raise FusionError("paged", f"the cache must be a fusion input [num_pages, page_size, kv_heads, "
                          f"head_dim], but {_describe(cache)}")
    _require_float("paged", cache)
    if block_table.ndim != 2 or block_table.dtype != i32 or block_table.node.op != "input":
        raise FusionError("paged", f"the block table must be an i32 fusion input [batch, max_pages], but "
                          f"{_describe(block_table)}")
    batch, pages = block_table.shape
    _, page_size, heads, dim = cache.shape
    if isinstance(pages, int) and isinstance(page_size, int):
        keys: Dim = pages * page_size
    else:
        keys = f"{pages}*{page_size}"   # bound from the table and the cache (Fusion.bind)
    return cache._trace.add("paged", (cache, block_table), cache.dtype, (batch, heads, 1, keys, dim))


# --------------------------------------------------------------------------------------------
# Packed sequences (FlashAttention's varlen): ws.varlen and ws.packed
# --------------------------------------------------------------------------------------------

def varlen(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The sequences packed in x as one zero-padded batch: x is a fusion input [N, *heads, D]
    (FlashAttention's varlen layout: the rows of every sequence one after another) and
    `cu_seqlens` an i32 input [B1] of offsets, sequence b holding rows cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1. The result is [B1-1, *heads, N, D] (declare the offsets [B+1] and it
    is [B, *heads, N, D], B matching other [B, ...] inputs such as a paged cache's block table):
    row t of sequence b is x[cu_seqlens[b] + t], and 0 past its length. Over scores of a varlen
    Q and K, softmax and logsumexp see each sequence's own keys only, and a bottom-right
    `causal_mask` aligns to each sequence's query and key counts (with varlen Q against a cache,
    to its queries and its key lengths); `ws.packed` turns a result back into packed rows."""
    x, offsets = _operands("varlen", (x, cu_seqlens), allow_scalars=False)
    if x.ndim not in (3, 4) or x.node.op != "input":
        raise FusionError("varlen", f"x must be a fusion input [rows, heads, head_dim] or [rows, kv_heads, "
                          f"group, head_dim] (the sequences' rows packed one after another), but {_describe(x)}")
    _require_float("varlen", x)
    if offsets.ndim != 1 or offsets.dtype != i32 or offsets.node.op != "input":
        raise FusionError("varlen", f"cu_seqlens must be an i32 fusion input [B1] (the offsets of the B1 - 1 "
                          f"sequences' rows in x), but {_describe(offsets)}")
    (count,) = offsets.shape
    if count == 1:
        raise FusionError("varlen", f"{offsets.id} is declared with 1 offset; cu_seqlens must hold at least 2 "
                          f"offsets (one sequence)")
    # bound from cu_seqlens (Fusion.bind)
    if isinstance(count, int):
        sequences: Dim = count - 1
    elif plus_one_base(count) is not None:   # declared [B+1]: B sequences
        sequences = plus_one_base(count)
    else:
        sequences = f"{count}-1"
    rows, *heads, dim = x.shape
    return x._trace.add("varlen", (x, offsets), x.dtype, (sequences, *heads, rows, dim))


def packed(x: Tensor, cu_seqlens: Tensor, dim: int | None = None) -> Tensor:
    """The inverse of `ws.varlen`, for outputs: x [B1-1, *mid, N, *rest] computed from
    `ws.varlen(..., cu_seqlens)` views as packed rows [N, *mid, *rest], row cu_seqlens[b] + t
    holding x[b, ..., t, ...]. The sequence dim is `dim`, or the dim after dim 0 that is the
    rows N of such a view: O [B1-1, H, NQ, D] -> [NQ, H, D], the LSE [B1-1, H, NQ] -> [NQ, H]
    (where another dim has the same size, e.g. as many heads as rows, pass `dim`)."""
    x, offsets = _operands("packed", (x, cu_seqlens), allow_scalars=False)
    if offsets.ndim != 1 or offsets.dtype != i32 or offsets.node.op != "input":
        raise FusionError("packed", f"cu_seqlens must be an i32 fusion input [B1] (the offsets given to "
                          f"ws.varlen), but {_describe(offsets)}")
    views = _varlen_views_of(x, offsets)
    if not views:
        raise FusionError("packed", f"needs a tensor computed from ws.varlen(..., {offsets.id}), but "
                          f"{_describe(x)}, computed from no such view")
    sequences = views[0].shape[0]
    if x.ndim < 2 or x.shape[0] != sequences:
        raise FusionError("packed", f"dim 0 must be the sequences of {offsets.id} ({sequences}), but "
                          f"{_describe(x)}")
    rows = [view.shape[-2] for view in views]
    found = [axis for axis in range(1, x.ndim) if x.shape[axis] in rows]
    if dim is not None:
        if not isinstance(dim, int) or isinstance(dim, bool) or not -x.ndim < dim < x.ndim or dim % x.ndim == 0:
            raise FusionError("packed", f"dim must be an int naming a dim of {_describe(x)} after dim 0, got {dim!r}")
        dim %= x.ndim
        if dim not in found:
            raise FusionError("packed", f"dim {dim} of {_describe(x)} is not the rows "
                              f"{' or '.join(map(str, dict.fromkeys(rows)))} of ws.varlen(..., {offsets.id})")
    elif not found:
        raise FusionError("packed", f"needs a sequence dim after dim 0: "
                          f"{' or '.join(map(str, dict.fromkeys(rows)))} (the rows of ws.varlen(..., {offsets.id})), "
                          f"but {_describe(x)}")
    elif len(found) > 1:
        raise FusionError("packed", f"{_describe(x)}: dims {' and '.join(map(str, found))} both have the size of the "
                          f"rows of ws.varlen(..., {offsets.id}); pass dim= (the queries: -2 of O, -1 of the LSE)")
    else:
        dim = found[0]
    shape = (x.shape[dim], *x.shape[1:dim], *x.shape[dim + 1:])
    return x._trace.add("packed", (x, offsets), x.dtype, shape, [("dim", dim - x.ndim)])


def _varlen_views_of(x: Tensor, offsets: Tensor) -> list[Node]:
    """The `varlen(..., offsets)` nodes that x is computed from, in trace order."""
    nodes = {n.id: n for n in x._trace.nodes}
    stack, seen = [x.node], set()
    while stack:
        node = stack.pop()
        if node.id not in seen:
            seen.add(node.id)
            stack.extend(nodes[i] for i in node.inputs)
    return [n for n in x._trace.nodes if n.id in seen and n.op == "varlen" and n.inputs[1] == offsets.id]


# --------------------------------------------------------------------------------------------
# Masks and score functions: comparisons, logic, where, positions
# --------------------------------------------------------------------------------------------

inf = float("inf")   # `ws.where(mask, s, -ws.inf)`


def _compare(op: str, lhs: Tensor | float, rhs: Tensor | float) -> Tensor:
    a, b = _operands(op, (lhs, rhs))
    shape, conflict = _broadcast_dims(a.shape, b.shape)
    if conflict:
        raise FusionError(op, f"shapes do not broadcast: {_describe(a)}, {_describe(b)} "
                          f"({conflict[0]} vs {conflict[1]})")
    if op not in ("eq", "ne"):
        _require_values(op, a, b)
    if a.node.op != "const" and b.node.op != "const" and a.dtype != b.dtype:
        _promote(op, a, b)   # the operands must mix as in arithmetic
    return a._trace.add(op, (a, b), bool8, shape)


def _compare_op(op: str, spelling: str) -> Callable[[Tensor | float, Tensor | float], Tensor]:
    return _public_op(op, f"a {spelling} b: a bool tensor (a mask), elementwise with numpy "
                      "broadcasting; take it to ws.where or combine it with & | ~.",
                      lambda a, b: _compare(op, a, b))


lt = _compare_op("lt", "<")
le = _compare_op("le", "<=")
gt = _compare_op("gt", ">")
ge = _compare_op("ge", ">=")
eq = _compare_op("eq", "==")
ne = _compare_op("ne", "!=")


def _require_bool(op: str, spelling: str, *operands: Tensor) -> None:
    for x in operands:
        if x.dtype != bool8:
            raise FusionError(op, f"`{spelling}` combines comparisons (bool tensors), but "
                              f"{_describe(x)}")


def logical_and(a: Tensor, b: Tensor) -> Tensor:
    """a & b of two masks (bool tensors), with numpy broadcasting."""
    a, b = _operands("and", (a, b), allow_scalars=False)
    _require_bool("and", "x & y", a, b)
    shape, conflict = _broadcast_dims(a.shape, b.shape)
    if conflict:
        raise FusionError("and", f"shapes do not broadcast: {_describe(a)}, {_describe(b)} "
                          f"({conflict[0]} vs {conflict[1]})")
    return a._trace.add("logical_and", (a, b), bool8, shape)


def logical_or(a: Tensor, b: Tensor) -> Tensor:
    """a | b of two masks (bool tensors), with numpy broadcasting."""
    a, b = _operands("or", (a, b), allow_scalars=False)
    _require_bool("or", "x | y", a, b)
    shape, conflict = _broadcast_dims(a.shape, b.shape)
    if conflict:
        raise FusionError("or", f"shapes do not broadcast: {_describe(a)}, {_describe(b)} "
                          f"({conflict[0]} vs {conflict[1]})")
    return a._trace.add("logical_or", (a, b), bool8, shape)


def logical_not(x: Tensor) -> Tensor:
    """~x of a mask (a bool tensor)."""
    (x,) = _operands("not", (x,), allow_scalars=False)
    _require_bool("not", "~x", x)
    return x._trace.add("logical_not", (x,), bool8, x.shape)


def where(cond: Tensor, a: Tensor | float, b: Tensor | float) -> Tensor:
    """a where cond is true, else b (torch.where): cond is a mask (a comparison), a and b ws
    tensors or Python numbers, all three broadcast. `ws.where(j <= i, s, -ws.inf)` masks scores."""
    if not isinstance(cond, Tensor):
        raise FusionError("where", f"the condition must be a ws comparison (a bool tensor such as "
                          f"`j <= i`), got {type_name(cond)}")
    cond, x, y = _operands("where", (cond, a, b))
    if cond.dtype != bool8:
        raise FusionError("where", f"the condition must be a comparison (a bool tensor such as "
                          f"`j <= i`), but {_describe(cond)}")
    _require_values("where", x, y)
    shape, conflict = _broadcast_dims(cond.shape, x.shape)
    if not conflict:
        shape, conflict = _broadcast_dims(shape, y.shape)
    if conflict:
        raise FusionError("where", f"shapes do not broadcast: {_describe(cond)}, {_describe(x)}, "
                          f"{_describe(y)} ({conflict[0]} vs {conflict[1]})")
    return cond._trace.add("where", (cond, x, y), _result_dtype("where", x, y), shape)


def positions(x: Tensor) -> tuple[Tensor, Tensor]:
    """(i, j): the row and column index of every element of the last two dims of x, as i32
    tensors of shapes [rows, 1] and [1, cols] that broadcast against x. On attention scores
    [..., queries, keys] they are the query and the key position:

        i, j = ws.positions(s)
        s = ws.where((j <= i) & (i - j < 1024), s, -ws.inf)     # causal sliding window
    """
    (x,) = _operands("positions", (x,), allow_scalars=False)
    if x.ndim < 2:
        raise FusionError("positions", f"needs [..., rows, cols] dims, but {_describe(x)}")
    rows, cols = x.shape[-2:]
    return (x._trace.add("position", (), i32, (rows, 1), [("dim", -2)]),
            x._trace.add("position", (), i32, (1, cols), [("dim", -1)]))
