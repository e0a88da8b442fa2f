"""The fusion DSL builds the DAG it should: nodes, shapes, dtypes, attrs, order and printout."""

import re

import networkx as nx
import pytest
import torch

import source_lines
import wsched as ws
from wsched.dtypes import DTYPES, promote
from wsched.fusion import Fusion, Node
from wsched.target import BINARY_OPS, ELEMENTWISE_OPS, UNARY_OPS


def line_of(marker: str) -> str:
    return source_lines.line_of(__file__, marker)


@ws.fusion  # mlp-def
def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
        bias: ws.Tensor[ws.bf16, "N"]):
    return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)  # mlp-body


def trace_attention():
    @ws.fusion
    def attention(q: ws.Tensor[ws.bf16, "B", "H", "S", "D"],
                  k: ws.Tensor[ws.bf16, "B", "H", "S", "D"],
                  v: ws.Tensor[ws.bf16, "B", "H", "S", "D"]):
        s = ws.causal_mask(ws.matmul(q, k.transpose(-1, -2)) * 0.125)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
    return attention


def test_mlp_nodes():
    body = line_of("mlp-body")
    assert mlp.name == "mlp"
    assert mlp.nodes() == [
        Node("a", "input", (), ws.bf16, ("M", "K"), (), line_of("mlp-def")),
        Node("b", "input", (), ws.bf16, ("K", "N"), (), line_of("mlp-def")),
        Node("bias", "input", (), ws.bf16, ("N",), (), line_of("mlp-def")),
        Node("n0", "matmul", ("a", "b"), ws.f32, ("M", "N"), (), body),
        Node("n1", "add", ("n0", "bias"), ws.f32, ("M", "N"), (), body),
        Node("n2", "gelu", ("n1",), ws.f32, ("M", "N"), (), body),
        Node("n3", "cast", ("n2",), ws.bf16, ("M", "N"), (), body),
    ]
    assert [node.id for node in mlp.inputs] == ["a", "b", "bias"]
    assert mlp.outputs == ("n3",)
    assert mlp.symbols == ("M", "K", "N")


def test_mlp_printout():
    body = line_of("mlp-body")
    assert str(mlp) == (
        "fusion mlp(a: bf16[M, K], b: bf16[K, N], bias: bf16[N]):\n"
        f"  n0 = matmul(a, b) : f32[M, N]   # {body}\n"
        f"  n1 = add(n0, bias) : f32[M, N]   # {body}\n"
        f"  n2 = gelu(n1) : f32[M, N]   # {body}\n"
        f"  n3 = cast(n2) : bf16[M, N]   # {body}\n"
        "  return n3"
    )
    assert repr(mlp) == "<Fusion mlp(a, b, bias) -> n3: 7 nodes>"


def test_attention_printout_shows_attrs_and_consts():
    attention = trace_attention()
    listing = [line.split("   #")[0] for line in str(attention).splitlines()]
    assert listing == [
        "fusion attention(q: bf16[B, H, S, D], k: bf16[B, H, S, D], v: bf16[B, H, S, D]):",
        "  n0 = transpose(k, dim0=-2, dim1=-1) : bf16[B, H, D, S]",
        "  n1 = matmul(q, n0) : f32[B, H, S, S]",
        "  n2 = const(value=0.125) : f32[]",
        "  n3 = mul(n1, n2) : f32[B, H, S, S]",
        "  n4 = causal_mask(n3, align='top_left') : f32[B, H, S, S]",
        "  n5 = softmax(n4, dim=-1) : f32[B, H, S, S]",
        "  n6 = matmul(n5, v) : f32[B, H, S, D]",
        "  n7 = cast(n6) : bf16[B, H, S, D]",
        "  n8 = logsumexp(n4, dim=-1, keepdim=False) : f32[B, H, S]",
        "  return n7, n8",
    ]


def test_graph_edges_carry_operand_positions():
    assert sorted(mlp.graph.edges(data="operand")) == [
        ("a", "n0", 0), ("b", "n0", 1), ("bias", "n1", 1), ("n0", "n1", 0),
        ("n1", "n2", 0), ("n2", "n3", 0)]
    assert mlp.node("n1") == mlp.graph.nodes["n1"]["node"]
    assert [node.id for node in mlp.consumers("n0")] == ["n1"]
    assert mlp.consumers("n3") == []


def test_same_operand_twice_is_one_edge_with_both_positions():
    @ws.fusion
    def square(x: ws.Tensor[ws.f32, "N"]):
        return x * x
    assert square.node("n0").inputs == ("x", "x")
    assert square.graph.edges["x", "n0"] == {"operand": 0, "operands": (0, 1)}


def test_node_order_is_deterministic_and_follows_creation():
    def build():
        @ws.fusion
        def diamond(x: ws.Tensor[ws.f32, "M", "N"], y: ws.Tensor[ws.f32, "M", "N"]):
            right = ws.exp(y)
            left = ws.relu(x)
            both = left * right
            return both + left, ws.sigmoid(right)
        return diamond
    first, second = build(), build()
    assert first.nodes() == second.nodes()
    assert str(first) == str(second)
    assert [node.id for node in first.nodes()] == ["x", "y", "n0", "n1", "n2", "n3", "n4"]
    assert [node.op for node in first.nodes()[2:]] == ["exp", "relu", "mul", "add", "sigmoid"]
    assert list(nx.lexicographical_topological_sort(first.graph)) != []  # graph is acyclic
    assert first.outputs == ("n3", "n4")


def test_dead_nodes_are_dropped_and_ids_renumbered():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "N"], unused: ws.Tensor[ws.f32, "N"]):
        ws.exp(x)            # never used: dropped
        _ = unused * 2.0     # dropped with its const
        return ws.tanh(x)
    assert [(node.id, node.op) for node in f.nodes()] == [
        ("x", "input"), ("unused", "input"), ("n0", "tanh")]
    assert f.outputs == ("n0",)


def test_returning_an_input_and_the_same_tensor_twice():
    @ws.fusion
    def f(x: ws.Tensor[ws.f16, "N"]):
        y = ws.neg(x)
        return x, y, y
    assert f.outputs == ("x", "n0", "n0")


def test_matmul_batches_with_broadcasting_and_accumulates_in_f32():
    @ws.fusion
    def f(a: ws.Tensor[ws.f16, "B", 1, "M", "K"], b: ws.Tensor[ws.f16, "H", "K", "N"]):
        return a @ b
    assert f.node("n0") == Node("n0", "matmul", ("a", "b"), ws.f32, ("B", "H", "M", "N"), (),
                                f.node("n0").source)


def test_matmul_of_f32_probabilities_with_bf16_values():
    @ws.fusion
    def f(p: ws.Tensor[ws.f32, "M", "S"], v: ws.Tensor[ws.bf16, "S", "D"]):
        return ws.matmul(p, v)
    assert (f.node("n0").dtype, f.node("n0").shape) == (ws.f32, ("M", "D"))


@pytest.mark.parametrize("left, right, result", [
    (ws.bf16, ws.bf16, ws.bf16), (ws.f16, ws.f16, ws.f16), (ws.f32, ws.f32, ws.f32),
    (ws.bf16, ws.f32, ws.f32), (ws.f32, ws.f16, ws.f32), (ws.i32, ws.i32, ws.i32)])
def test_binary_dtype_promotion(left, right, result):
    @ws.fusion
    def f(x: ws.Tensor[left, "N"], y: ws.Tensor[right, "N"]):
        return tuple(getattr(ws, op)(x, y) for op in BINARY_OPS)
    assert len(f.outputs) == len(BINARY_OPS)
    assert {f.node(output).dtype for output in f.outputs} == {result}


# An i32 input meets a float in that float (the promotion above): in a matmul epilogue it is read
# into an f32 tile, the conversion torch makes; integer arithmetic there is an early error.

@ws.fusion
def offset_by_index(a: ws.Tensor[ws.bf16, "M", 128], b: ws.Tensor[ws.bf16, 128, "N"],
                    col: ws.Tensor[ws.i32, "N"], row: ws.Tensor[ws.i32, "M", 1]):
    return (ws.matmul(a, b) * 0.01 + col - row).to(ws.bf16)


def test_i32_inputs_meet_the_matmul_result_in_f32():
    a, b = torch.randn(200, 128).bfloat16(), torch.randn(128, 136).bfloat16()
    col = torch.randint(-1000, 1000, (136,), dtype=torch.int32)
    row = torch.randint(-100_000, 100_000, (200, 1), dtype=torch.int32)
    k = ws.compile(offset_by_index)
    assert [line.strip() for line in k.ir.splitlines() if line.strip().startswith(("reg col_t", "reg row_t"))] == [
        "reg col_t: f32[1, 64]", "reg row_t: f32[64, 1]"]
    out = k.simulate(a, b, col, row)
    ref = offset_by_index.reference(a, b, col, row)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_integer_arithmetic_in_a_matmul_epilogue_is_an_early_error():
    @ws.fusion
    def f(a: ws.Tensor[ws.bf16, "M", 128], b: ws.Tensor[ws.bf16, 128, "N"], col: ws.Tensor[ws.i32, "N"]):
        return ((ws.matmul(a, b) + col).to(ws.i32) + 0.5).to(ws.bf16)  # i32-epilogue
    with pytest.raises(ws.ScheduleError, match=re.escape(
            f"n2 = cast(...) at {source_lines.line_of(__file__, 'i32-epilogue')} computes i32 values; the matmul "
            "epilogue computes in floating point: an i32 input may meet a float (it is read as f32), not be "
            "computed on; cast it first with .to(ws.f32)")):
        ws.compile(f)


def test_the_verifier_names_a_float_op_into_an_i32_register_tile():
    """An i32 tile may hold the i32 input (a float op reads it converted), but a float scalar
    multiplied into one would be truncated silently: the verifier names the op and its IR line."""
    k = ws.compile(offset_by_index, build=False)
    assert "int col_t[" in k.with_ir(k.ir.replace("reg col_t: f32", "reg col_t: i32"), build=False).cuda_source
    text = k.ir.replace("reg slice_t: f32", "reg slice_t: i32")
    line = next(n for n, s in enumerate(text.splitlines(), 1) if "tile.mul slice_t" in s)
    with pytest.raises(ws.lowering.verify.VerifyError, match=re.escape(
            f"IR line {line} (role consumer > for tile > for j > tile.mul): tile.mul slice_t: slice_t is i32 but "
            "the scalar 0.01 is a float; an op into an i32 tile takes integer scalars")):
        k.with_ir(text, build=False)


def test_scalars_become_f32_const_nodes_and_keep_the_tensor_dtype():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "N"]):
        return 1 - x * 0.5
    assert [(node.id, node.op, node.inputs, node.dtype, node.shape, node.attrs)
            for node in f.nodes()[1:]] == [
        ("n0", "const", (), ws.f32, (), (("value", 0.5),)),
        ("n1", "mul", ("x", "n0"), ws.bf16, ("N",), ()),
        ("n2", "const", (), ws.f32, (), (("value", 1.0),)),
        ("n3", "sub", ("n2", "n1"), ws.bf16, ("N",), ()),
    ]


def test_broadcasting_follows_numpy_over_symbols():
    @ws.fusion
    def f(col: ws.Tensor[ws.f32, "M", 1], row: ws.Tensor[ws.f32, "N"],
          batch: ws.Tensor[ws.f32, "B", 1, 1]):
        return col + row, (col * row) / batch
    assert [f.node(o).shape for o in f.outputs] == [("M", "N"), ("B", "M", "N")]


def test_every_elementwise_op_of_the_target_is_a_ws_op():
    for op in ELEMENTWISE_OPS:
        assert getattr(ws, op).__name__ == op


@pytest.mark.parametrize("op", [op for op in UNARY_OPS if op != "cast"])  # cast takes a dtype
@pytest.mark.parametrize("dtype", [ws.bf16, ws.f16, ws.f32])
def test_unary_ops_keep_shape_and_dtype(op, dtype):
    @ws.fusion
    def f(x: ws.Tensor[dtype, "M", 8]):
        return getattr(ws, op)(x)
    assert f.node("n0") == Node("n0", op, ("x",), dtype, ("M", 8), (), f.node("n0").source)


def test_negation_operator_is_neg():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "N"]):
        return -x
    assert f.node("n0").op == "neg"


def test_cast_adds_a_node_only_when_the_dtype_changes():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "N"]):
        return x.to(ws.bf16), ws.cast(x, ws.f32)
    assert f.outputs == ("x", "n0")
    assert (f.node("n0").op, f.node("n0").dtype) == ("cast", ws.f32)


def test_expand_adds_leading_dims_grows_ones_and_keeps_minus_one():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "M", 1], y: ws.Tensor[ws.f32, "B", "N"]):
        return x.expand("B", -1, "N"), x.expand(("M", 1))
    assert f.node("n0") == Node("n0", "expand", ("x",), ws.f32, ("B", "M", "N"), (),
                                f.node("n0").source)
    assert f.outputs == ("n0", "x")  # an expand to the same shape is no node


def test_transpose_stores_sorted_negative_dims():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "B", "S", "D"]):
        return x.transpose(2, 1), x.transpose(-1, -1)
    assert f.node("n0").shape == ("B", "D", "S")
    assert f.node("n0").attrs == (("dim0", -2), ("dim1", -1))
    assert f.outputs[1] == "x"


def test_row_reductions():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "M", "N"]):
        return x.sum(dim=-1), x.max(1, keepdim=True), ws.sum(x, 0), ws.max(x, dim=-2)
    shapes = [(f.node(o).op, f.node(o).shape, f.node(o).attrs, f.node(o).dtype) for o in f.outputs]
    assert shapes == [
        ("sum", ("M",), (("dim", -1), ("keepdim", False)), ws.bf16),
        ("max", ("M", 1), (("dim", -1), ("keepdim", True)), ws.bf16),
        ("sum", ("N",), (("dim", -2), ("keepdim", False)), ws.bf16),
        ("max", ("N",), (("dim", -2), ("keepdim", False)), ws.bf16),
    ]


def test_softmax_logsumexp_and_causal_mask_attrs():
    @ws.fusion
    def f(s: ws.Tensor[ws.f32, "H", "Q", "K"]):
        masked = ws.causal_mask(s, align="bottom_right")
        return ws.softmax(masked), ws.logsumexp(masked, dim=2, keepdim=True)
    assert f.node("n0").attrs == (("align", "bottom_right"),)
    assert (f.node("n1").shape, f.node("n1").attrs) == (("H", "Q", "K"), (("dim", -1),))
    assert (f.node("n2").shape, f.node("n2").attrs) == (
        ("H", "Q", 1), (("dim", -1), ("keepdim", True)))
    assert ws.causal_mask is not None and f.node("n0").attr("align") == "bottom_right"


def test_gqa_attention_by_broadcasting_kv_heads():
    @ws.fusion
    def gqa(q: ws.Tensor[ws.bf16, "B", "Hkv", "G", "S", "D"],
            k: ws.Tensor[ws.bf16, "B", "Hkv", 1, "S", "D"],
            v: ws.Tensor[ws.bf16, "B", "Hkv", 1, "S", "D"]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16)
    assert gqa.node("n1").shape == ("B", "Hkv", "G", "S", "S")
    assert gqa.node(gqa.outputs[0]).type_str == "bf16[B, Hkv, G, S, D]"


def test_bind_from_tensors_sizes_and_tuples():
    a = torch.empty(64, 32, dtype=torch.bfloat16)
    b = torch.empty(32, 16, dtype=torch.bfloat16)
    bias = torch.empty(16, dtype=torch.bfloat16)
    assert mlp.bind(a, b, bias) == {"M": 64, "K": 32, "N": 16}
    assert mlp.bind(a.shape, (32, 16), [16]) == {"M": 64, "K": 32, "N": 16}


def test_bind_checks_concrete_dims():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, 4, "N"]):
        return ws.exp(x)
    assert f.bind((4, 7)) == {"N": 7}
    with pytest.raises(ws.FusionError, match=r"x is declared f32\[4, N\] but x dim 0 has size 5"):
        f.bind((5, 7))


def test_node_normalises_fields_and_reads_attrs():
    node = Node("n0", "sum", ["x"], ws.f32, ["M"], (("keepdim", False), ("dim", -1)))
    assert node == Node("n0", "sum", ("x",), ws.f32, ("M",), (("dim", -1), ("keepdim", False)))
    assert node.attr("dim") == -1 and node.attr("missing", 7) == 7
    assert hash(node) == hash(Node("n0", "sum", ("x",), ws.f32, ("M",),
                                   (("dim", -1), ("keepdim", False))))
    assert str(node) == "n0 = sum(x, dim=-1, keepdim=False) : f32[M]"


def test_fusion_built_directly_from_nodes():
    nodes = [Node("x", "input", (), ws.f32, ("N",)),
             Node("n0", "exp", ("x",), ws.f32, ("N",)),
             Node("n1", "cast", ("n0",), ws.bf16, ("N",))]
    built = Fusion("direct", nodes, ["n1"])
    assert built.nodes() == nodes
    assert built.inputs == (nodes[0],)
    assert torch.equal(built.reference(torch.zeros(3)), torch.ones(3, dtype=torch.bfloat16))


def test_fusion_rejects_operands_defined_later():
    with pytest.raises(ws.FusionError, match="node n0 uses n1 before it is defined"):
        Fusion("bad", [Node("n0", "exp", ("n1",), ws.f32, ()),
                       Node("n1", "exp", (), ws.f32, ())], ["n0"])


def test_dtypes():
    assert [(d.name, d.bits, d.torch_dtype, d.itemsize) for d in DTYPES] == [
        ("bf16", 16, torch.bfloat16, 2), ("f16", 16, torch.float16, 2),
        ("f32", 32, torch.float32, 4), ("i32", 32, torch.int32, 4)]
    assert str(ws.bf16) == "bf16" and repr(ws.bf16) == "ws.bf16"
    assert promote(ws.bf16, ws.f16) is None and promote(ws.i32, ws.f32) == ws.f32
    assert promote(ws.f16, ws.f32) == ws.f32
    assert {ws.bf16: 1}[ws.DType("bf16", 16, torch.bfloat16)] == 1


def test_tensor_annotation_and_proxy():
    spec = ws.Tensor[ws.bf16, "M", 64]
    assert (spec.dtype, spec.shape, str(spec)) == (ws.bf16, ("M", 64), "bf16[M, 64]")
    seen = []

    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "M", "N"]):
        seen.append((x.id, x.dtype, x.shape, x.ndim, repr(x)))
        return x
    assert seen == [("x", ws.f32, ("M", "N"), 2, "<ws.Tensor x: f32[M, N]>")]
