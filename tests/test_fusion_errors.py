"""Every FusionError names the op, the shapes or dtypes involved and the user's source line."""

import pickle
import re

import pytest
import torch
import torch.nn.functional as F

import source_lines
import wsched as ws
from wsched import FusionError


def line_of(marker: str) -> str:
    return source_lines.line_of(__file__, marker)


def raises(message: str, marker: str):
    """Expect a FusionError whose whole message is `message` + " at <line marked marker>"."""
    return pytest.raises(FusionError, match=f"^{re.escape(message)} at {line_of(marker)}$")


def test_fusion_error_is_a_value_error_with_fields():
    error = FusionError("matmul", "inner dimensions differ", "x.py:3")
    assert isinstance(error, ValueError)
    assert str(error) == "matmul: inner dimensions differ at x.py:3"
    assert (error.op, error.detail, error.location) == ("matmul", "inner dimensions differ",
                                                        "x.py:3")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.location == "x.py:3"


# --- shapes ---------------------------------------------------------------------------------

def test_matmul_inner_dimensions_differ():
    with raises("matmul: inner dimensions differ: a is bf16[M, K], b is bf16[K2, N] (K vs K2)",
                "matmul-inner"):
        @ws.fusion
        def f(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K2", "N"]):
            return ws.matmul(a, b)  # matmul-inner


def test_matmul_operator_inner_dimensions_differ():
    with raises("matmul: inner dimensions differ: a is bf16[M, 64], b is bf16[32, N] "
                "(64 vs 32)", "matmul-operator"):
        @ws.fusion
        def f(a: ws.Tensor[ws.bf16, "M", 64], b: ws.Tensor[ws.bf16, 32, "N"]):
            return a @ b  # matmul-operator


def test_matmul_batch_dimensions_do_not_broadcast():
    with raises("matmul: batch dimensions do not broadcast: q is bf16[B, H, S, D], "
                "n0 is bf16[B, H2, D, S] (H vs H2)", "matmul-batch"):
        @ws.fusion
        def f(q: ws.Tensor[ws.bf16, "B", "H", "S", "D"],
              k: ws.Tensor[ws.bf16, "B", "H2", "S", "D"]):
            return ws.matmul(q, k.transpose(-1, -2))  # matmul-batch


def test_matmul_needs_matrices():
    with raises("matmul: operands need at least 2 dims, but b is bf16[K]", "matmul-rank"):
        @ws.fusion
        def f(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K"]):
            return a @ b  # matmul-rank


def test_broadcast_mismatch():
    with raises("add: shapes do not broadcast: n0 is f32[M, N], bias is bf16[M] (N vs M)",
                "broadcast"):
        @ws.fusion
        def f(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
              bias: ws.Tensor[ws.bf16, "M"]):
            return ws.matmul(a, b) + bias  # broadcast


def test_symbol_does_not_broadcast_with_a_concrete_size():
    with raises("mul: shapes do not broadcast: x is f32[M], y is f32[64] (M vs 64)",
                "symbol-vs-int"):
        @ws.fusion
        def f(x: ws.Tensor[ws.f32, "M"], y: ws.Tensor[ws.f32, 64]):
            return x * y  # symbol-vs-int


def test_expand_of_a_non_unit_dim():
    with raises("expand: cannot expand x is f32[M, K] to [M, N] (K vs N)", "expand"):
        @ws.fusion
        def f(x: ws.Tensor[ws.f32, "M", "K"], y: ws.Tensor[ws.f32, "N"]):
            return x.expand("M", "N")  # expand


def test_expand_to_an_unbindable_symbol():
    with raises("expand: symbol B of [B, M, 1] is not a dim of any input", "expand-symbol"):
        @ws.fusion
        def f(x: ws.Tensor[ws.f32, "M", 1]):
            return x.expand("B", "M", 1)  # expand-symbol


def test_reduction_dim_out_of_range_or_missing():
    with raises("sum: dim 2 is out of range for x is f32[M, N]", "sum-range"):
        @ws.fusion
        def f(x: ws.Tensor[ws.f32, "M", "N"]):
            return x.sum(dim=2)  # sum-range
    with raises("max: needs a dim, only one dim is reduced at a time (x is f32[M, N])",
                "max-dim"):
        @ws.fusion
        def g(x: ws.Tensor[ws.f32, "M", "N"]):
            return x.max()  # max-dim


def test_causal_mask_align_and_rank():
    with raises("causal_mask: align must be 'top_left' or 'bottom_right', got 'left'",
                "mask-align"):
        @ws.fusion
        def f(s: ws.Tensor[ws.f32, "Q", "K"]):
            return ws.causal_mask(s, align="left")  # mask-align
    with raises("causal_mask: needs [..., queries, keys] dims, but s is f32[K]", "mask-rank"):
        @ws.fusion
        def g(s: ws.Tensor[ws.f32, "K"]):
            return ws.causal_mask(s)  # mask-rank


# --- dtypes ---------------------------------------------------------------------------------

def test_bf16_with_f16_is_a_dtype_mismatch():
    with raises("add: dtype mismatch: x is bf16[N], y is f16[N] (bf16 vs f16)", "add-dtype"):
        @ws.fusion
        def f(x: ws.Tensor[ws.bf16, "N"], y: ws.Tensor[ws.f16, "N"]):
            return x + y  # add-dtype


def test_matmul_dtype_mismatch():
    with raises("matmul: dtype mismatch: a is bf16[M, K], b is f16[K, N] (bf16 vs f16)",
                "matmul-dtype"):
        @ws.fusion
        def f(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.f16, "K", "N"]):
            return ws.matmul(a, b)  # matmul-dtype


def test_float_ops_reject_integers():
    with raises("exp: expects a floating-point tensor, but x is i32[N]", "exp-int"):
        @ws.fusion
        def f(x: ws.Tensor[ws.i32, "N"]):
            return ws.exp(x)  # exp-int


def test_cast_needs_a_ws_dtype():
    with raises("cast: expected a ws dtype (ws.bf16, ws.f16, ws.f32, ws.i32), got "
                "torch.bfloat16", "cast-torch"):
        @ws.fusion
        def f(x: ws.Tensor[ws.f32, "N"]):
            return x.to(torch.bfloat16)  # cast-torch


# --- unsupported ops --------------------------------------------------------------------------

# Each row: (the marker on the row's lambda line, which is the line the error must name,
# the expression, the exact message before " at <line>").
@pytest.mark.parametrize("marker, expression, message", [
    ("pow", lambda x: x ** 2,  # pow
     "pow: `x ** y` is not supported on ws tensors (x is f32[M, N])"),
    ("rpow", lambda x: 2 ** x,  # rpow
     "pow: `x ** y` is not supported on ws tensors (x is f32[M, N])"),
    ("mod", lambda x: x % 3,  # mod
     "mod: `x % y` is not supported on ws tensors (x is f32[M, N])"),
    ("abs", lambda x: abs(x),  # abs
     "abs: `abs(x)` is not supported on ws tensors (x is f32[M, N])"),
    ("xor", lambda x: x ^ x,  # xor
     "xor: `x ^ y` is not supported on ws tensors (x is f32[M, N])"),
    ("and-float", lambda x: x & (x > 0),  # and-float
     "and: `x & y` combines comparisons (bool tensors), but x is f32[M, N]"),
    ("not-float", lambda x: ~x,  # not-float
     "not: `~x` combines comparisons (bool tensors), but x is f32[M, N]"),
    ("bool-arithmetic", lambda x: (x < 0) + 1,  # bool-arithmetic
     "add: n1 is a comparison (bool[M, N]); add takes numbers: turn a mask into values with "
     "ws.where(cond, a, b)"),
    ("where-of-floats", lambda x: ws.where(x, x, 0.0),  # where-of-floats
     "where: the condition must be a comparison (a bool tensor such as `j <= i`), but x is f32[M, N]"),
    ("where-of-a-number", lambda x: ws.where(True, x, 0.0),  # where-of-a-number
     "where: the condition must be a ws comparison (a bool tensor such as `j <= i`), got bool"),
    ("positions-of-a-vector", lambda x: ws.positions(x.sum(-1)),  # positions-of-a-vector
     "positions: needs [..., rows, cols] dims, but n0 is f32[M]"),
    ("if", lambda x: x if x else x,  # if
     "bool: `bool(x) / if x` is not supported on ws tensors (x is f32[M, N])"),
    ("index", lambda x: x[0],  # index
     "getitem: `x[...]` is not supported on ws tensors (x is f32[M, N])"),
    ("torch.exp", lambda x: torch.exp(x),  # torch.exp
     "torch.exp: torch functions cannot take ws tensors (x is f32[M, N]); use ws.exp instead"),
    ("F.gelu", lambda x: F.gelu(x),  # F.gelu
     "torch.gelu: torch functions cannot take ws tensors (x is f32[M, N]); use ws.gelu instead"),
    ("tensor+proxy", lambda x: torch.ones(1) + x,  # tensor+proxy
     "torch.add: torch functions cannot take ws tensors (x is f32[M, N]); use ws.add instead"),
    ("torch.where", lambda x: torch.where(x, x, x),  # torch.where
     "torch.where: torch functions cannot take ws tensors (x is f32[M, N]); use ws.where instead"),
    ("proxy+tensor", lambda x: x + torch.ones(1),  # proxy+tensor
     "add: operand 1 has type torch.Tensor; add takes ws tensors and Python numbers"),
    ("no-tensor", lambda x: ws.exp(1.0),  # no-tensor
     "exp: expects a ws tensor operand, got float"),
    ("matmul-scalar", lambda x: ws.matmul(x, 2.0),  # matmul-scalar
     "matmul: operand 1 has type float; matmul takes ws tensors"),
    ("bool-scalar", lambda x: x * True,  # bool-scalar
     "mul: operand 1 has type bool; mul takes ws tensors and Python numbers"),
])
def test_unsupported_ops(marker, expression, message):
    with raises(message, marker):
        @ws.fusion
        def f(x: ws.Tensor[ws.f32, "M", "N"]):
            return expression(x)


# --- the function's signature and result ------------------------------------------------------

def test_missing_annotation():
    with raises("f: parameter b needs a ws.Tensor[dtype, dims...] annotation, got none",
                "missing-annotation"):
        @ws.fusion  # missing-annotation
        def f(a: ws.Tensor[ws.f32, "N"], b):
            return a


def test_annotation_that_is_not_a_tensor():
    with raises("f: parameter a needs a ws.Tensor[dtype, dims...] annotation, got <class "
                "'int'>", "int-annotation"):
        @ws.fusion  # int-annotation
        def f(a: int):
            return a


def test_variadic_and_reserved_parameters():
    with raises("f: variadic parameter rest is not supported; declare each input", "variadic"):
        @ws.fusion  # variadic
        def f(*rest: ws.Tensor[ws.f32, "N"]):
            return rest[0]
    with raises("g: parameter name n0 is reserved for intermediate nodes (n0, n1, ...)",
                "reserved"):
        @ws.fusion  # reserved
        def g(n0: ws.Tensor[ws.f32, "N"]):
            return n0


def test_bad_tensor_annotations():
    with raises("Tensor[...]: the first argument must be a ws dtype (ws.bf16, ws.f16, ws.f32, "
                "ws.i32), got 'M'", "annotation-dtype"):
        ws.Tensor["M", "N"]  # annotation-dtype
    with raises("Tensor[...]: dims must be symbol names (str), a symbol plus one (\"B+1\", offsets of B sequences) "
                "or positive ints, got 'M N'",
                "annotation-dim"):
        ws.Tensor[ws.f32, "M N"]  # annotation-dim


@pytest.mark.parametrize("result, what", [
    (None, "NoneType"), (1.0, "float"), ([], "list"), ((1,), "int")])
def test_returning_a_non_tensor(result, what):
    with raises(f"f: must return a ws tensor or a tuple of them, but return value 0 has type "
                f"{what}", "returns"):
        @ws.fusion  # returns
        def f(x: ws.Tensor[ws.f32, "N"]):
            return result


def test_returning_an_empty_tuple():
    with raises("f: returns an empty tuple; return at least one ws tensor", "empty-return"):
        @ws.fusion  # empty-return
        def f(x: ws.Tensor[ws.f32, "N"]):
            return ()


def test_proxies_do_not_outlive_or_cross_fusions():
    leaked = []

    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "N"]):
        leaked.append(x)
        return x
    with raises("exp: x of fusion f is used after tracing ended; ws ops only work inside the "
                "@ws.fusion function", "leaked"):
        ws.exp(leaked[0])  # leaked
    with raises("g: must return a ws tensor or a tuple of them, but return value 0 is a ws "
                "tensor of another fusion", "foreign"):
        @ws.fusion  # foreign
        def g(y: ws.Tensor[ws.f32, "N"]):
            return leaked[0]


# --- binding ----------------------------------------------------------------------------------

@ws.fusion
def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
        bias: ws.Tensor[ws.bf16, "N"]):
    return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)


def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def test_wrong_number_of_inputs():
    with raises("mlp.reference: expected 3 inputs (a, b, bias), got 2", "count"):
        mlp.reference(bf16(4, 8), bf16(8, 2))  # count


def test_wrong_rank():
    with raises("mlp.reference: a is declared bf16[M, K] but got shape (2, 4, 8) (rank 3, "
                "expected 2)", "rank"):
        mlp.reference(bf16(2, 4, 8), bf16(8, 2), bf16(2))  # rank


def test_symbol_bound_to_two_sizes():
    with raises("mlp.bind: symbol K is bound to two sizes: 8 (a dim 1) and 6 (b dim 0)",
                "two-sizes"):
        mlp.bind(bf16(4, 8), bf16(6, 2), bf16(2))  # two-sizes


def test_input_dtype_differs_from_declaration():
    with raises("mlp.reference: b is declared bf16[K, N] but got a torch.float16 tensor of "
                "shape (8, 2)", "input-dtype"):
        mlp.reference(bf16(4, 8), torch.zeros(8, 2, dtype=torch.float16), bf16(2))  # input-dtype


def test_reference_needs_tensors():
    with raises("mlp.reference: input 2 has type tuple; expected a torch tensor", "not-tensor"):
        mlp.reference(bf16(4, 8), bf16(8, 2), (2,))  # not-tensor
    with raises("mlp.bind: bias: expected a torch tensor or a shape, got str", "bind-str"):
        mlp.bind((4, 8), (8, 2), "2")  # bind-str
