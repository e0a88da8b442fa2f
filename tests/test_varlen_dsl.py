"""Packed variable-length sequences (FlashAttention's varlen API): `ws.varlen(x, cu_seqlens)` views
rows packed as [N, *heads, D] as a zero-padded batch [B1-1, *heads, N, D], `ws.packed` turns a
result back into packed rows. The nodes and their shapes, `Fusion.bind`, the torch reference
against a per-sequence loop over torch's scaled_dot_product_attention in fp32 (padded keys hidden,
bottom-right causal aligned per sequence), and the exact errors for bad uses and bad offsets."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import source_lines
import wsched as ws
from wsched import FusionError
from wsched.fusion import Node
from wsched.reference import check_cu_seqlens

D = 64
# an empty sequence, a one-token one, ragged ones; keys differ from queries per sequence: no
# keys for a query (LSE -inf), more queries than keys (bottom-right hides the first rows)
CU_Q = [0, 0, 1, 128, 300]
CU_K = [0, 5, 5, 200, 350]


def line_of(marker: str) -> str:
    return source_lines.line_of(__file__, marker)


def raises(message: str, marker: str):
    """Expect a FusionError whose whole message is `message` + " at <line marked marker>"."""
    return pytest.raises(FusionError, match=f"^{re.escape(message)} at {line_of(marker)}$")


@ws.fusion
def varlen_attention(q: ws.Tensor[ws.bf16, "NQ", "H", D], k: ws.Tensor[ws.bf16, "NK", "H", D],
                     v: ws.Tensor[ws.bf16, "NK", "H", D],
                     cu_q: ws.Tensor[ws.i32, "B1"], cu_k: ws.Tensor[ws.i32, "B1"]):
    s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2)) * D ** -0.5  # varlen-q
    s = ws.causal_mask(s, align="bottom_right")
    o = ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(ws.bf16)
    return ws.packed(o, cu_q), ws.packed(ws.logsumexp(s, dim=-1), cu_q)


def make_varlen(causal: str | None, gqa: bool, softcap: float | None = None):
    """Varlen attention with O and the LSE: multi-head ([N, H, D]) or GQA (Q [NQ, HK, G, D], K and
    V [NK, HK, 1, D]); `causal` None, "top_left" or "bottom_right"; `softcap`: scores
    softcap * tanh(s / softcap)."""
    q_heads, kv_heads = (("HK", "G"), ("HK", 1)) if gqa else (("H",), ("H",))

    def attention(q: ws.Tensor[ws.bf16, "NQ", *q_heads, D], k: ws.Tensor[ws.bf16, "NK", *kv_heads, D],
                  v: ws.Tensor[ws.bf16, "NK", *kv_heads, D],
                  cu_q: ws.Tensor[ws.i32, "B1"], cu_k: ws.Tensor[ws.i32, "B1"]):
        s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2)) * D ** -0.5
        if softcap is not None:
            s = softcap * ws.tanh(s / softcap)
        if causal is not None:
            s = ws.causal_mask(s, align=causal)
        o = ws.matmul(ws.softmax(s, dim=-1), ws.varlen(v, cu_k)).to(ws.bf16)
        return ws.packed(o, cu_q), ws.packed(ws.logsumexp(s, dim=-1), cu_q)

    return ws.fusion(attention)


def inputs(cu_q, cu_k, q_heads=(2,), kv_heads=(2,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(cu_q[-1], *q_heads, D, generator=gen).bfloat16()
    k, v = (torch.randn(cu_k[-1], *kv_heads, D, generator=gen).bfloat16() for _ in range(2))
    return [q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)]


def per_sequence_attention(q, k, v, cu_q, cu_k, causal, softcap=None):
    """O [NQ, *heads, D] and LSE [NQ, *heads] in fp32, one sequence at a time: torch's SDPA with
    an explicit mask (bottom-right: query i of Lq sees keys j <= i + Lk - Lq); a row that sees no
    key gives O = 0 and LSE = -inf."""
    heads = q.shape[1:-1]
    o = torch.zeros(q.shape[0], *heads, D)
    lse = torch.full((q.shape[0], *heads), -math.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb = q[rows].float().flatten(1, -2).transpose(0, 1)                 # [heads, Lq, D]
        kb, vb = (t[keys].float().expand(-1, *heads, -1).flatten(1, -2).transpose(0, 1) for t in (k, v))
        lq, lk = qb.shape[1], kb.shape[1]
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        mask = {None: torch.ones(lq, lk, dtype=torch.bool), "top_left": j <= i,
                "bottom_right": j <= i + lk - lq}[causal]
        scores = qb @ kb.transpose(-1, -2) * D ** -0.5
        if softcap is not None:   # SDPA takes no score function: its scale 1 on pre-capped Q K^T via an additive bias
            bias = softcap * torch.tanh(scores / softcap) - scores
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias.masked_fill(~mask, -math.inf))
            scores = scores + bias
        else:
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        lseb = torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1)
        sees = mask.any(-1)
        o[rows] = torch.where(sees[None, :, None], ob, 0.0).transpose(0, 1).reshape(lq, *heads, D)
        lse[rows] = lseb.transpose(0, 1).reshape(lq, *heads)
    return o, lse


def assert_close(got_o, got_lse, want_o, want_lse):
    # a row that sees no key: the reference's softmax is 0 / 0 (NaN), its LSE -inf
    unseen = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(got_lse), unseen)
    assert torch.equal(torch.isnan(got_o.float()).any(-1), unseen)
    o = got_o.float().nan_to_num(0.0)
    assert float((o - want_o).norm() / want_o.norm()) < 1e-2
    finite = ~unseen
    assert float((got_lse[finite] - want_lse[finite]).norm() / want_lse[finite].norm()) < 1e-2


# -- the nodes -------------------------------------------------------------------------------


def test_varlen_and_packed_nodes():
    body = line_of("varlen-q")
    nodes = {n.id: n for n in varlen_attention.nodes()}
    assert nodes["n0"] == Node("n0", "varlen", ("q", "cu_q"), ws.bf16, ("B1-1", "H", "NQ", D), (), body)
    assert nodes["n1"].shape == ("B1-1", "H", "NK", D) and nodes["n1"].inputs == ("k", "cu_k")
    assert nodes["n3"].shape == ("B1-1", "H", "NQ", "NK")
    assert [str(nodes[o]).split("   #")[0] for o in varlen_attention.outputs] == [
        "n11 = packed(n10, cu_q, dim=-2) : bf16[NQ, H, 64]",
        "n13 = packed(n12, cu_q, dim=-1) : f32[NQ, H]"]


def test_gqa_views_and_packed_outputs():
    fusion = make_varlen("bottom_right", gqa=True)
    views = [n for n in fusion.nodes() if n.op == "varlen"]
    assert [n.shape for n in views] == [("B1-1", "HK", "G", "NQ", D), ("B1-1", "HK", 1, "NK", D),
                                        ("B1-1", "HK", 1, "NK", D)]
    o, lse = (fusion.node(n) for n in fusion.outputs)
    assert (o.shape, o.dtype, o.attr("dim")) == (("NQ", "HK", "G", D), ws.bf16, -2)
    assert (lse.shape, lse.dtype, lse.attr("dim")) == (("NQ", "HK", "G"), ws.f32, -1)


def test_offsets_declared_as_a_number_give_a_number_of_sequences():
    @ws.fusion
    def fixed(q: ws.Tensor[ws.bf16, "N", "H", D], cu: ws.Tensor[ws.i32, 5]):
        return ws.packed(ws.varlen(q, cu) * 2.0, cu)
    assert fixed.node("n0").shape == (4, "H", "N", D)
    assert fixed.node(fixed.outputs[0]).shape == ("N", "H", D)


def test_bind_gives_the_number_of_sequences():
    shapes = [(300, 2, D), (350, 2, D), (350, 2, D), (5,), (5,)]
    assert varlen_attention.bind(*shapes) == {"NQ": 300, "H": 2, "NK": 350, "B1": 5, "B1-1": 4}


@pytest.mark.parametrize("offsets, held", [(1, "1 offset"), (0, "0 offsets")])
def test_bind_needs_one_sequence(offsets, held):
    shapes = [(0, 2, D), (0, 2, D), (0, 2, D), (offsets,), (offsets,)]
    with raises(f"varlen_attention.bind: cu_q holds {held}: cu_seqlens must hold at least 2 offsets (one sequence)",
                "bind-offsets"):
        varlen_attention.bind(*shapes)  # bind-offsets


# -- the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_reference_matches_a_loop_over_sequences(causal, gqa):
    fusion = make_varlen(causal, gqa)
    heads = dict(q_heads=(2, 3), kv_heads=(2, 1)) if gqa else {}
    args = inputs(CU_Q, CU_K, seed=7, **heads)
    o, lse = fusion.reference(*args)
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((300, *args[0].shape[1:]), torch.bfloat16,
                                                        (300, *args[0].shape[1:-1]), torch.float32)
    assert_close(o, lse, *per_sequence_attention(*args[:3], CU_Q, CU_K, causal))


def test_the_user_spelling_is_bottom_right_causal():
    args = inputs(CU_Q, CU_K, seed=3)
    assert_close(*varlen_attention.reference(*args), *per_sequence_attention(*args[:3], CU_Q, CU_K, "bottom_right"))


def test_padded_keys_stay_hidden_through_a_score_function():
    """The padded keys are hidden at the softmax, not at Q @ K^T: 30 * tanh(s / 30) would turn an
    -inf there into -30, a key every row would see."""
    fusion = make_varlen("top_left", gqa=False, softcap=30.0)
    args = inputs(CU_Q, CU_K, seed=5)
    assert_close(*fusion.reference(*args), *per_sequence_attention(*args[:3], CU_Q, CU_K, "top_left", softcap=30.0))


def test_one_sequence_and_equal_offsets_for_q_and_k():
    fusion = make_varlen("bottom_right", gqa=False)
    args = inputs([0, 77], [0, 77], seed=1)
    assert_close(*fusion.reference(*args), *per_sequence_attention(*args[:3], [0, 77], [0, 77], "bottom_right"))


def test_the_view_is_zero_past_each_length_and_packed_inverts_it():
    @ws.fusion
    def views(q: ws.Tensor[ws.bf16, "N", "HK", "G", D], cu: ws.Tensor[ws.i32, "B1"]):
        padded = ws.varlen(q, cu)
        return padded, ws.packed(padded, cu)
    q, cu = inputs(CU_Q, CU_Q, q_heads=(2, 3))[0], torch.tensor(CU_Q, dtype=torch.int32)
    padded, back = views.reference(q, cu)
    assert padded.shape == (4, 2, 3, 300, D) and torch.equal(back, q)
    for b in range(4):
        length = CU_Q[b + 1] - CU_Q[b]
        assert torch.equal(padded[b, :, :, :length], q[CU_Q[b]:CU_Q[b + 1]].permute(1, 2, 0, 3))
        assert not padded[b, :, :, length:].any()


# -- offsets a call may not give -------------------------------------------------------------


@pytest.mark.parametrize("cu_q, message", [
    ([0, 7, 5, 128, 300], "cu_q[2] = 5 is below cu_q[1] = 7: cu_seqlens must be non-decreasing offsets from 0 to 300 "
                          "(the rows of q)"),
    ([2, 2, 5, 128, 300], "cu_q[0] = 2 must be 0: cu_seqlens must be non-decreasing offsets from 0 to 300 (the rows "
                          "of q)"),
    ([0, 1, 5, 128, 299], "cu_q[4] = 299 (the last offset) must be 300: cu_seqlens must be non-decreasing offsets "
                          "from 0 to 300 (the rows of q)"),
])
def test_the_reference_refuses_bad_offsets(cu_q, message):
    args = inputs(CU_Q, CU_K)
    args[3] = torch.tensor(cu_q, dtype=torch.int32)
    with raises(f"varlen: {message}", "varlen-q"):
        varlen_attention.reference(*args)


def test_check_cu_seqlens_names_the_caller():
    with pytest.raises(FusionError, match=r"^attn: cu_k\[3\] = 351 \(the last offset\) must be 350: cu_seqlens must "
                                          r"be non-decreasing offsets from 0 to 350 \(the rows of k\)$"):
        check_cu_seqlens("cu_k", torch.tensor([0, 5, 9, 351]), 350, "k", op="attn", location="")
    with pytest.raises(FusionError, match=r"^varlen: cu_k holds 1 offset: cu_seqlens must hold at least 2 offsets "
                                          r"\(one sequence\) at x.py:3$"):
        check_cu_seqlens("cu_k", torch.tensor([0]), 0, "k", location="x.py:3")
    check_cu_seqlens("cu_k", torch.tensor([0, 0, 350], dtype=torch.int32), 350, "k")


# -- uses the DSL refuses --------------------------------------------------------------------


def test_varlen_takes_a_packed_input():
    with raises("varlen: x must be a fusion input [rows, heads, head_dim] or [rows, kv_heads, group, head_dim] "
                "(the sequences' rows packed one after another), but n1 is bf16[N, H, 64]", "varlen-computed"):
        @ws.fusion
        def computed(q: ws.Tensor[ws.bf16, "N", "H", D], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.varlen(q * 2.0, cu)  # varlen-computed
    with raises("varlen: x must be a fusion input [rows, heads, head_dim] or [rows, kv_heads, group, head_dim] "
                "(the sequences' rows packed one after another), but q is bf16[N, 64]", "varlen-rank"):
        @ws.fusion
        def rank2(q: ws.Tensor[ws.bf16, "N", D], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.varlen(q, cu)  # varlen-rank
    with raises("varlen: expects a floating-point tensor, but q is i32[N, H, 64]", "varlen-int"):
        @ws.fusion
        def integers(q: ws.Tensor[ws.i32, "N", "H", D], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.varlen(q, cu)  # varlen-int


@pytest.mark.parametrize("declared", [(ws.f32, "B1"), (ws.i32, "B", "B1")])
def test_varlen_takes_i32_offsets(declared):
    shown = f"{declared[0].name}[{', '.join(declared[1:])}]"
    with raises(f"varlen: cu_seqlens must be an i32 fusion input [B1] (the offsets of the B1 - 1 sequences' rows "
                f"in x), but cu is {shown}", "varlen-offsets"):
        @ws.fusion
        def bad(q: ws.Tensor[ws.bf16, "N", "H", D], cu: ws.Tensor[declared]):
            return ws.varlen(q, cu)  # varlen-offsets


def test_varlen_needs_one_sequence():
    with raises("varlen: cu is declared with 1 offset; cu_seqlens must hold at least 2 offsets (one sequence)",
                "varlen-one"):
        @ws.fusion
        def one(q: ws.Tensor[ws.bf16, "N", "H", D], cu: ws.Tensor[ws.i32, 1]):
            return ws.varlen(q, cu)  # varlen-one


def test_packed_needs_a_tensor_from_varlen():
    with raises("packed: needs a tensor computed from ws.varlen(..., cu), but n1 is f32[B, H, S, S], computed from "
                "no such view",
                "packed-dense"):
        @ws.fusion
        def dense(q: ws.Tensor[ws.bf16, "B", "H", "S", D], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.packed(ws.matmul(q, q.transpose(-1, -2)), cu)  # packed-dense


def test_packed_needs_the_rows_of_its_offsets():
    with raises("packed: needs a sequence dim after dim 0: NK (the rows of ws.varlen(..., cu_k)), but n6 is "
                "f32[B1-1, H, NQ, 64]", "packed-keys"):
        @ws.fusion
        def by_keys(q: ws.Tensor[ws.bf16, "NQ", "H", D], k: ws.Tensor[ws.bf16, "NK", "H", D],
                    cu_q: ws.Tensor[ws.i32, "B1"], cu_k: ws.Tensor[ws.i32, "B1"]):
            s = ws.matmul(ws.varlen(q, cu_q), ws.varlen(k, cu_k).transpose(-1, -2))
            return ws.packed(ws.matmul(ws.softmax(s, dim=-1), ws.varlen(k, cu_k)), cu_k)  # packed-keys
    with raises("packed: dim 0 must be the sequences of cu (B1-1), but n1 is bf16[H, B1-1, N, 64]", "packed-dim0"):
        @ws.fusion
        def moved(q: ws.Tensor[ws.bf16, "N", "H", D], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.packed(ws.varlen(q, cu).transpose(0, 1), cu)  # packed-dim0
    with raises("packed: cu_seqlens must be an i32 fusion input [B1] (the offsets given to ws.varlen), but n0 is "
                "bf16[B1-1, H, N, 64]", "packed-order"):
        @ws.fusion
        def swapped(q: ws.Tensor[ws.bf16, "N", "H", D], cu: ws.Tensor[ws.i32, "B1"]):
            return ws.packed(cu, ws.varlen(q, cu))  # packed-order
