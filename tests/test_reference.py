"""Fusion.reference() computes what hand-written torch computes.

Two kinds of check: against torch written with the same rounding points (fp32 math, rounded to
each node's dtype), which must agree exactly; and against independent torch formulations
(SDPA for attention), which must agree to bf16 tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

import wsched as ws
from wsched.reference import ELEMENTWISE_TORCH
from wsched.target import ELEMENTWISE_OPS

BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to dtype and back to fp32: where the reference rounds a 16-bit node."""
    return x.to(dtype).float()


def test_mlp_matches_torch():
    @ws.fusion
    def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
            bias: ws.Tensor[ws.bf16, "N"]):
        return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)
    a, b, bias = randn(48, 40), randn(40, 24), randn(24)
    out = mlp.reference(a, b, bias)
    expected = F.gelu(a.float() @ b.float() + bias.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (48, 24)
    assert torch.equal(out, expected)


def test_bias_relu_residual_epilogue():
    @ws.fusion
    def epilogue(x: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "K", "N"],
                 bias: ws.Tensor[ws.bf16, "N"], residual: ws.Tensor[ws.bf16, "M", "N"]):
        return (ws.relu(x @ w + bias) + residual).to(ws.bf16)
    x, w, bias, residual = randn(32, 64), randn(64, 16), randn(16), randn(32, 16)
    expected = (torch.relu(x.float() @ w.float() + bias.float()) + residual.float())
    assert torch.equal(epilogue.reference(x, w, bias, residual), expected.bfloat16())


def test_16_bit_intermediates_round_where_declared():
    @ws.fusion
    def chain(a: ws.Tensor[ws.bf16, "N"], b: ws.Tensor[ws.bf16, "N"], c: ws.Tensor[ws.f32, "N"]):
        return a * b + c  # a * b is bf16 (rounded), + c is f32
    a, b, c = randn(4096), randn(4096), randn(4096, dtype=torch.float32)
    out = chain.reference(a, b, c)
    assert out.dtype == torch.float32
    assert torch.equal(out, rounded(a.float() * b.float(), torch.bfloat16) + c)
    assert not torch.equal(out, a.float() * b.float() + c)  # the rounding really happened


@pytest.mark.parametrize("op, torch_op", [
    ("neg", torch.neg), ("exp", torch.exp), ("exp2", torch.exp2), ("log", torch.log),
    ("relu", torch.relu), ("gelu", F.gelu), ("silu", F.silu), ("sigmoid", torch.sigmoid),
    ("tanh", torch.tanh)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unary_ops(op, torch_op, dtype):
    ws_dtype = {torch.bfloat16: ws.bf16, torch.float16: ws.f16, torch.float32: ws.f32}[dtype]

    @ws.fusion
    def f(x: ws.Tensor[ws_dtype, "M", "N"]):
        return getattr(ws, op)(x)
    x = torch.rand(16, 32).add(0.1).to(dtype)  # positive, so log is defined
    out = f.reference(x)
    assert out.dtype == dtype
    assert torch.equal(out, torch_op(x.float()).to(dtype))


def test_every_elementwise_op_of_the_target_has_a_torch_rule():
    assert set(ELEMENTWISE_TORCH) == set(ELEMENTWISE_OPS)


def test_binary_ops_with_scalars_on_either_side():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "M", "N"], y: ws.Tensor[ws.f32, "N"]):
        return (1 - x) / 2, 2 / (x * y), ws.maximum(x, 0.0), ws.minimum(x, y) - x
    x, y = randn(8, 16), randn(16, dtype=torch.float32)
    outs = f.reference(x, y)
    xf = x.float()
    expected = (
        rounded(rounded(1 - xf, torch.bfloat16) / 2, torch.bfloat16),
        2 / (xf * y),
        rounded(torch.clamp_min(xf, 0.0), torch.bfloat16),
        torch.minimum(xf, y) - xf,
    )
    assert [out.dtype for out in outs] == [torch.bfloat16, torch.float32, torch.bfloat16,
                                          torch.float32]
    for out, want in zip(outs, expected):
        assert torch.equal(out.float(), want)


def test_softmax_on_bf16_rows():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "M", "N"]):
        return ws.softmax(x, dim=-1), ws.softmax(x * 1.0, dim=0)
    x = randn(12, 50)
    rows, columns = f.reference(x)
    assert torch.equal(rows, torch.softmax(x.float(), -1).bfloat16())
    assert torch.equal(columns, torch.softmax(x.float(), 0).bfloat16())
    torch.testing.assert_close(rows.float().sum(-1), torch.ones(12), **BF16_TOLERANCE)


def test_row_reductions_and_logsumexp():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "M", "N"]):
        return x.sum(dim=-1), ws.max(x, 1, keepdim=True), ws.logsumexp(x, dim=-1), \
            ws.logsumexp(x, dim=0, keepdim=True)
    x = torch.randn(10, 33) * 4
    total, peak, lse, lse_columns = f.reference(x)
    assert torch.equal(total, x.sum(-1))
    assert torch.equal(peak, x.amax(-1, keepdim=True))
    torch.testing.assert_close(lse, torch.log(torch.exp(x).sum(-1)), atol=1e-5, rtol=1e-5)
    assert torch.equal(lse_columns, torch.logsumexp(x, 0, keepdim=True))


def test_expand_with_bound_symbols():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "M", 1], y: ws.Tensor[ws.bf16, "M", "N"]):
        return x.expand("M", "N") + y.transpose(-1, -2).transpose(-2, -1)
    x, y = randn(6, 1), randn(6, 9)
    assert torch.equal(f.reference(x, y), rounded(x.float().expand(6, 9) + y.float(),
                                                  torch.bfloat16).bfloat16())


def causal_keep(queries: int, keys: int, align: str) -> torch.Tensor:
    """True where a query may attend a key, built the way torch's documentation does."""
    offset = 0 if align == "top_left" else keys - queries
    return torch.ones(queries, keys, dtype=torch.bool).tril(diagonal=offset)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("queries, keys", [(6, 6), (4, 9), (9, 4)])
def test_causal_mask(align, queries, keys):
    @ws.fusion
    def f(s: ws.Tensor[ws.f32, "H", "Q", "K"]):
        return ws.causal_mask(s, align=align)
    s = torch.randn(3, queries, keys)
    out = f.reference(s)
    keep = causal_keep(queries, keys, align)
    assert torch.equal(out, s.masked_fill(~keep, float("-inf")))
    assert torch.isneginf(out[:, ~keep]).all() and torch.isfinite(out[:, keep]).all()


def test_causal_mask_top_left_matches_sdpa_is_causal():
    @ws.fusion
    def attention(q: ws.Tensor[ws.f32, "B", "H", "Q", "D"],
                  k: ws.Tensor[ws.f32, "B", "H", "K", "D"],
                  v: ws.Tensor[ws.f32, "B", "H", "K", "D"]):
        s = ws.causal_mask(ws.matmul(q, k.transpose(-1, -2)) * 0.25)
        return ws.matmul(ws.softmax(s, dim=-1), v)
    q, k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(attention.reference(q, k, v), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_attention_with_lse_matches_sdpa(causal):
    scale = 64 ** -0.5

    @ws.fusion
    def gqa(q: ws.Tensor[ws.bf16, "B", "Hkv", "G", "S", 64],
            k: ws.Tensor[ws.bf16, "B", "Hkv", 1, "S", 64],
            v: ws.Tensor[ws.bf16, "B", "Hkv", 1, "S", 64]):
        s = ws.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            s = ws.causal_mask(s)
        o = ws.matmul(ws.softmax(s, dim=-1), v)
        return o.to(ws.bf16), ws.logsumexp(s, dim=-1)
    batch, kv_heads, group, seq = 2, 2, 3, 40
    q = randn(batch, kv_heads, group, seq, 64)
    k, v = randn(batch, kv_heads, 1, seq, 64), randn(batch, kv_heads, 1, seq, 64)
    o, lse = gqa.reference(q, k, v)
    assert (o.dtype, o.shape) == (torch.bfloat16, (batch, kv_heads, group, seq, 64))
    assert (lse.dtype, lse.shape) == (torch.float32, (batch, kv_heads, group, seq))

    # Independent formulation: SDPA over heads laid out as torch's GQA expects.
    heads_q = q.float().reshape(batch, kv_heads * group, seq, 64)
    heads_k = k.float().squeeze(2).repeat_interleave(group, dim=1)
    heads_v = v.float().squeeze(2).repeat_interleave(group, dim=1)
    expected = F.scaled_dot_product_attention(heads_q, heads_k, heads_v, is_causal=causal,
                                              scale=scale)
    torch.testing.assert_close(o.float().reshape(expected.shape), expected, **BF16_TOLERANCE)
    scores = heads_q @ heads_k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~causal_keep(seq, seq, "top_left"), float("-inf"))
    torch.testing.assert_close(lse.reshape(batch, kv_heads * group, seq),
                               torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-4)


def test_multiple_outputs_in_declared_dtypes():
    @ws.fusion
    def f(x: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "K", "N"]):
        y = x @ w
        return y.to(ws.bf16), y.to(ws.f16), ws.max(y, dim=-1), y
    x, w = randn(16, 32), randn(32, 8)
    outs = f.reference(x, w)
    y = x.float() @ w.float()
    assert isinstance(outs, tuple) and len(outs) == 4
    assert [out.dtype for out in outs] == [torch.bfloat16, torch.float16, torch.float32,
                                          torch.float32]
    assert torch.equal(outs[0], y.bfloat16()) and torch.equal(outs[1], y.half())
    assert torch.equal(outs[2], y.amax(-1)) and torch.equal(outs[3], y)


def test_reference_leaves_inputs_alone_and_ignores_autograd():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "N"]):
        return ws.exp(x)
    x = torch.randn(8, requires_grad=True)
    before = x.detach().clone()
    out = f.reference(x)
    assert not out.requires_grad and torch.equal(x.detach(), before)
