"""Attention score functions and masks written in the DSL (issue 11): each variant in the CPU
simulator against the torch reference (odd lengths, GQA), the kv blocks a mask hides skipped and
the blocks it cuts masked (checked against brute force), a golden IR for softcap + sliding
window, spill-free builds (and the narrower keys per block of score functions that keep registers
live), and the errors for definitions the kernel cannot compute."""

import math
import re

import pytest
import torch

import source_lines
import wsched as ws
from wsched.lowering import ir
from wsched.lowering.evaluate import evaluate
from wsched.lowering.parser import parse_kernel
from wsched.lowering.printer import print_expr, print_kernel
from wsched.names import K_COUNT, K_FIRST
from wsched.schedule import ScheduleError

from attention_fusions import (VARIANTS, attention_inputs, biased_inputs, make_attention, make_biased, make_variant,
                               union_mask, variant_inputs)
from wsched.workloads.attention.schedule import SCORE_FUNCTION_KEYS_PER_BLOCK, VALUE_DIMS


def rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def compiled(fusion, **overrides) -> ws.CompiledKernel:
    schedule = ws.schedule_for(fusion, **overrides)
    return ws.CompiledKernel(fusion, schedule, ws.partition(fusion, schedule), ws.lower(fusion, schedule),
                             cuda_source="")


def check(fusion, inputs, num_sms=3, seed=0, **overrides):
    """Simulate with outputs poisoned (the simulator's fresh outputs are NaN) and compare with
    the reference; rows that see no key must store O = 0 and LSE = -inf (the reference: NaN)."""
    o, lse = compiled(fusion, **overrides).simulate(*inputs, num_sms=num_sms, seed=seed)
    ro, rlse = fusion.reference(*inputs)
    seen = torch.isfinite(rlse)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()
    assert rel(o[seen], ro[seen]) < 1e-2
    assert rel(lse[seen], rlse[seen]) < 1e-3
    return o, lse


# ---------------------------------------------------------------------------------------------
# The DSL: masks, positions, where
# ---------------------------------------------------------------------------------------------


def test_a_score_function_is_a_dag_of_elementwise_nodes():
    f = make_variant(64, "softcap_window", lse=False, window=256)
    text = str(f)
    assert "position(dim=-2) : i32[S, 1]" in text and "position(dim=-1) : i32[1, T]" in text
    assert re.search(r"le\(n\d+, n\d+\) : bool\[S, T\]", text)
    assert re.search(r"logical_and\(n\d+, n\d+\) : bool\[S, T\]", text)
    assert re.search(r"const\(value=-inf\) : f32\[\]", text)
    assert re.search(r"where\(n\d+, n\d+, n\d+\) : f32\[B, H, S, T\]", text)


@pytest.mark.parametrize("overrides", [{}, {"mma_inflight": 0}, {"split_kv": 4}], ids=["default", "inflight0", "split4"])
def test_a_where_inside_a_longer_score_function_hides_whole_rows_without_nan(overrides):
    """`ws.where(..., -inf)` not as the outermost op (a bias follows it) is no mask the analysis
    sees: the rows it hides entirely must still store O = 0 and LSE = -inf, not NaN (the row
    max of a block of -inf scores is kept finite)."""
    f = make_biased(lambda s, i, j, u, p: ws.where(p > -0.5, s, -ws.inf) - u * ((j - i) * (j - i)) * 0.01,
                    per_query=True)
    inputs = biased_inputs(2, 2, 127, 130, per_query=True)
    o, lse = check(f, inputs, **overrides)
    assert torch.isneginf(lse).any() and torch.isfinite(lse).any()   # rows of both kinds


def test_a_bottom_right_causal_mask_inside_key_lengths_is_refused():
    """Inside ws.key_lengths a bottom-right causal mask ends its diagonal at the last of all T keys
    (the reference); the kernel aligns to each sequence's last key: refused, with the spelling
    that aligns per sequence. That spelling compiles and matches the reference."""
    def make(inside: bool):
        def attention(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
                      v: ws.Tensor[ws.bf16, "B", "H", "T", 64], lens: ws.Tensor[ws.i32, "B"]):
            s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
            s = (ws.key_lengths(ws.causal_mask(s, align="bottom_right"), lens) if inside
                 else ws.causal_mask(ws.key_lengths(s, lens), align="bottom_right"))
            return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
        return ws.fusion(attention)

    with pytest.raises(ScheduleError) as e:
        ws.lower(make(inside=True))
    assert ("a bottom-right ws.causal_mask inside ws.key_lengths aligns to the whole key dim T, not to each "
            "sequence's length; write ws.causal_mask(ws.key_lengths(s, lengths), align='bottom_right')") in str(e.value)
    assert "causal_mask" in str(e.value) and "test_attention_variants.py" in str(e.value)
    q, k, v = attention_inputs(2, 2, 127, 130, 64, seed=3)
    check(make(inside=False), [q, k, v, torch.tensor([100, 130], dtype=torch.int32)])


def test_dtype_rules_of_positions_and_comparisons():
    @ws.fusion
    def f(x: ws.Tensor[ws.f32, "H", "S", "T"], slope: ws.Tensor[ws.f32, "H", 1, 1]):
        i, j = ws.positions(x)
        return j - i, (j - i) * 2, (j - i) * 0.5, slope * (j - i), ~(i < j) | (i == j), ws.where(j <= i, x, 0)
    types = [f.node(o).type_str for o in f.outputs]
    assert types == ["i32[S, T]", "i32[S, T]", "f32[S, T]", "f32[H, S, T]", "bool[S, T]", "f32[H, S, T]"]


def test_the_reference_of_a_sliding_window():
    f = make_variant(64, "window", window=5)
    q, k, v = attention_inputs(1, 2, 20, 20, 64, seed=1)
    o, lse = f.reference(q, k, v)
    s = q.float() @ k.float().transpose(-1, -2) / 8
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    s = s.masked_fill(~((j <= i) & (i - j < 5)), -math.inf)
    assert torch.allclose(lse, torch.logsumexp(s, -1))
    assert torch.allclose(o.float(), (torch.softmax(s, -1) @ v.float()).bfloat16().float())


# ---------------------------------------------------------------------------------------------
# Each variant in the simulator
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_the_reference(variant, gqa):
    f = make_variant(64, variant, gqa=gqa)
    check(f, variant_inputs(f, 1, 4, 200, 333, 64, seed=len(variant), gqa_groups=2 if gqa else None))


@pytest.mark.parametrize("variant, S, T", [
    ("window", 1, 300), ("window", 300, 129), ("softcap", 129, 64), ("alibi", 77, 333),
    ("document", 1, 257), ("document_causal", 130, 130), ("softcap_window", 300, 100)])
def test_ragged_lengths_and_decode(variant, S, T):
    f = make_variant(64, variant)
    check(f, variant_inputs(f, 2, 2, S, T, 64, seed=S + T), num_sms=4)


@pytest.mark.parametrize("overrides", [dict(mma_inflight=0), dict(mode="pingpong")], ids=["inflight0", "pingpong"])
def test_other_schedules(overrides):
    f = make_variant(64, "softcap_window", window=150)
    check(f, variant_inputs(f, 1, 2, 300, 300, 64, seed=2), **overrides)


def test_head_dims_96_128_192_and_256():
    for d, variant in ((96, "document_causal"), (128, "alibi"), (192, "softcap_window"), (256, "softcap_window")):
        f = make_variant(d, variant, window=70)
        check(f, variant_inputs(f, 1, 2, 150, 150, d, seed=d))


def test_gqa_with_head_dims_96_and_192():
    for d, variant in ((96, "softcap"), (192, "alibi")):
        f = make_variant(d, variant, gqa=True)
        check(f, variant_inputs(f, 1, 4, 130, 201, d, seed=d, gqa_groups=2), num_sms=2)


def test_rows_that_see_no_key_store_zero_and_minus_inf():
    """Queries of a document no key belongs to (and with bottom-right causal, S > T) see nothing."""
    f = make_variant(64, "document")
    q, k, v, doc_q, doc_k = variant_inputs(f, 1, 2, 150, 150, 64, seed=3)
    doc_q = doc_q.clone()
    doc_q[..., 40:70, :] = 99
    o, lse = check(f, [q, k, v, doc_q, doc_k])
    assert (o[..., 40:70, :] == 0).all() and torch.isneginf(lse[..., 40:70]).all()

    @ws.fusion
    def br(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
           v: ws.Tensor[ws.bf16, "B", "H", "T", 64]):
        s = ws.causal_mask(30 * ws.tanh(ws.matmul(q, k.transpose(-1, -2)) / 240), align="bottom_right")
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
    o, lse = check(br, attention_inputs(1, 2, 300, 100, 64, seed=4))
    assert torch.isneginf(lse[..., :200]).all()


def test_attention_sinks():
    """A sink logit joins the denominator with no value row: a row that sees no key puts all its
    weight on the sink (O = 0, LSE = the sink); a Python number is one sink for every head."""
    @ws.fusion
    def sunk(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
             v: ws.Tensor[ws.bf16, "B", "H", "T", 64], sink: ws.Tensor[ws.f32, "H", 1, 1]):
        s = ws.causal_mask(ws.matmul(q, k.transpose(-1, -2)) * 0.125, align="bottom_right")
        return ws.matmul(ws.softmax(s, dim=-1, sink=sink), v).to(ws.bf16), ws.logsumexp(s, dim=-1, sink=sink)
    q, k, v = attention_inputs(1, 3, 300, 100, 64, seed=8)
    sink = torch.tensor([-1.0, 2.0, 5.0]).reshape(3, 1, 1)
    o, lse = check(sunk, [q, k, v, sink])
    assert (o[..., :200, :] == 0).all() and torch.equal(lse[..., :200], sink[..., 0].expand(1, 3, 200))
    text = print_kernel(ws.lower(sunk))
    assert "tile.load sink_t <- sink[b1, 0, 0]" in text and "tile.fill l_run, 1.0" in text

    @ws.fusion
    def number(q: ws.Tensor[ws.bf16, "B", "S", 64], k: ws.Tensor[ws.bf16, "B", "S", 64], v: ws.Tensor[ws.bf16, "B", "S", 64]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
        return ws.matmul(ws.softmax(s, dim=-1, sink=3.0), v).to(ws.bf16), ws.logsumexp(s, dim=-1, sink=3.0)
    check(number, [x[0] for x in attention_inputs(1, 1, 150, 150, 64, seed=9)])


def _bounded(inner):
    """Attention whose score is `inner(Q K^T / 8)`, causal, with its LSE."""
    @ws.fusion
    def bounded(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
                v: ws.Tensor[ws.bf16, "B", "H", "T", 64]):
        s = ws.causal_mask(inner(ws.matmul(q, k.transpose(-1, -2)) * 0.125))
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
    return bounded


@pytest.mark.parametrize("inner, scale, bounds", [
    (lambda s: 30 * ws.tanh(s / 30), 30.0, (-1.0, 1.0)),              # softcapping: the factor 30 peeled
    (lambda s: ws.tanh(s) * 2 - 1, 1.0, (-3.0, 1.0)),
    (lambda s: ws.sigmoid(s) * 4, 4.0, (0.0, 1.0)),
    (lambda s: ws.minimum(ws.maximum(s, -5.0), 7.0), 1.0, (-5.0, 7.0)),
    (lambda s: ws.tanh(s) / ws.tanh(s), 1.0, (-math.inf, math.inf)),  # a divisor that may be 0
    (lambda s: s, 0.125, (-math.inf, math.inf)),                       # Q K^T itself
    (lambda s: ws.maximum(s, -5.0), 1.0, (-5.0, math.inf)),
    (lambda s: -ws.exp(ws.tanh(s)) * 3, 3.0, (-math.e, -1 / math.e)),    # neg, exp; the factor 3 peeled
    (lambda s: ws.relu(ws.tanh(s)) - ws.exp(s), 1.0, (-math.inf, 1.0)),   # exp of Q K^T: [0, inf)
    (lambda s: ws.where(s > 0, ws.sigmoid(s), ws.tanh(s) * -2), 1.0, (-2.0, 2.0)),
    (lambda s: (ws.tanh(s) - 2) * (ws.tanh(s) + 0.5), 1.0, (-4.5, 1.5)),  # products of signed intervals
    (lambda s: ws.where((s > 1) & (s < 4), ws.tanh(s), 2.0), 1.0, (-1.0, 2.0)),  # a constant branch
    (lambda s: ws.tanh(s) * 1e38 * 10 + 1, 1.0, (-math.inf, math.inf)),  # beyond fp32: inf in the kernel
])
def test_interval_arithmetic_bounds_the_inner_score(inner, scale, bounds):
    sf = compiled(_bounded(inner)).partition.payload.score
    assert sf.scale == pytest.approx(scale) and sf.inner_range == bounds


def test_bounded_scores_take_exp2_against_their_bound():
    """Softcapping 30 tanh(s / 30) spans 60 * log2 e = 86.6 exponents (<= FIXED_MAX_RANGE): the
    kv block runs no row max, correction or rescale, m_run holds the bound 30 log2 e; a cap of
    50 (144 exponents), a bias or a sink keep the online softmax."""
    from wsched.workloads.attention.loops import FIXED_MAX_RANGE, LOG2E, fixed_row_max
    assert 60 * LOG2E <= 66 * LOG2E <= FIXED_MAX_RANGE < 68 * LOG2E
    capped = compiled(make_variant(64, "softcap"))
    assert fixed_row_max(compiled(make_variant(64, "softcap", softcap=33.0, name="softcap33")).partition.payload)
    assert fixed_row_max(compiled(make_variant(64, "softcap", softcap=34.0, name="softcap34")).partition.payload) is None
    assert fixed_row_max(compiled(make_variant(64, "softcap", dtype=ws.f16, name="softcap_f16")).partition.payload) is None
    assert fixed_row_max(capped.partition.payload) == pytest.approx(30 * LOG2E)
    text = print_kernel(capped.kernel)
    assert f"tile.fill m_run, {30 * LOG2E!r}" in text and f"tile.sub s_acc, s_acc, scalar({30 * LOG2E!r})" in text
    assert "tile.reduce.max" not in text and "corr, corr" not in text and "tile.mul o_acc, o_acc, corr" not in text
    wide = compiled(make_variant(64, "softcap", softcap=50.0, name="softcap50"))
    assert fixed_row_max(wide.partition.payload) is None and "tile.reduce.max m_blk" in print_kernel(wide.kernel)

    @ws.fusion
    def capped_sink(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
                    v: ws.Tensor[ws.bf16, "B", "H", "T", 64]):
        s = 30 * ws.tanh(ws.matmul(q, k.transpose(-1, -2)) * 0.125 / 30)
        return ws.matmul(ws.softmax(s, dim=-1, sink=2.0), v).to(ws.bf16)
    assert fixed_row_max(compiled(capped_sink).partition.payload) is None


@pytest.mark.parametrize("overrides", [{}, dict(tile=(64, 128, 64), consumer_warpgroups=1, split_kv=4)])
def test_scores_at_the_floor_of_their_bound_match_the_reference(overrides):
    """Rows whose every score sits near the bottom of softcapping's range (-28 of [-30, 30]: 2^-84
    of the bound after exp2) and rows near its top: O and the LSE as the reference's, also through
    the split-KV merge (whose factors are all 1 with a fixed row max)."""
    f = make_variant(64, "softcap")
    q, k, v = attention_inputs(1, 2, 200, 200, 64, seed=11)
    u = torch.full((64,), 0.125)                                    # a unit vector
    k = (0.05 * k.float() + u).to(k.dtype)                          # every key along u
    q = torch.stack([-400 * u, 400 * u]).reshape(1, 2, 1, 64).expand(1, 2, 200, 64).to(q.dtype)
    o, lse = check(f, [q, k, v], **overrides)
    ref_o, ref_lse = f.reference(q, k, v)
    assert float(ref_lse[0, 0].max()) < -20 < 20 < float(ref_lse[0, 1].min())


@pytest.mark.parametrize("cap, dtype", [(33.0, ws.bf16), (30.0, ws.f16)])
def test_one_key_at_the_floor_of_the_widest_bound(cap, dtype):
    """A cap of 33 spans 95.2 exponents, just inside FIXED_MAX_RANGE: causal row 0 sees one key at
    the floor, its sum 2^-95.2, and still divides by it (not by the epilogue's clamp of 1e-30).
    With f16 operands the online softmax stays (P would round to 0 in f16): the same inputs match."""
    f = make_variant(64, "softcap", softcap=cap, dtype=dtype, name=f"softcap{cap:g}_{dtype.name}")
    q, k, v = attention_inputs(1, 1, 130, 130, 64, seed=12, dtype=dtype.torch_dtype)
    u = torch.full((64,), 0.125)
    k = (0.01 * k.float() + u).to(k.dtype)
    q = (-1000 * u).expand(1, 1, 130, 64).to(q.dtype)               # every score at -cap
    o, lse = check(f, [q, k, v])
    ref_o, _ = f.reference(q, k, v)
    assert rel(o[0, 0, 0], ref_o[0, 0, 0]) < 1e-2


def test_several_interleavings():
    f = make_variant(64, "document_causal")
    inputs = variant_inputs(f, 1, 1, 260, 260, 64, seed=1)
    for seed in range(3):
        check(f, inputs, num_sms=2, seed=seed)


# ---------------------------------------------------------------------------------------------
# A bias along the diagonal: c * slope[h] * (j - i), its row part on the LSE
# ---------------------------------------------------------------------------------------------


SPELLINGS = {   # name: (spelling, [(coef, factors)] of the bias peeled from the top)
    "alibi": (lambda s, i, j, u, p: s + u * (j - i), [(1.0, ("slope",))]),
    "minus i - j": (lambda s, i, j, u, p: s - u * (i - j), [(1.0, ("slope",))]),
    "scaled inside": (lambda s, i, j, u, p: (s * 8 + (j - i).to(ws.f32) / 4 * u) * 0.5, [(0.125, ("slope",))]),
    "two terms": (lambda s, i, j, u, p: s + u * (j - i) - 0.5 * (i - j), [(0.5, ()), (1.0, ("slope",))]),
    "negated": (lambda s, i, j, u, p: -(u * (i - j)) + s, [(1.0, ("slope",))]),
    "offset": (lambda s, i, j, u, p: s + u * (j - i + 1), []),
    "squared": (lambda s, i, j, u, p: s - u * ((j - i) * (j - i)) * 0.01, []),
    "per query": (lambda s, i, j, u, p: s + u * p * (j - i), []),
    "j alone": (lambda s, i, j, u, p: s + u * j, []),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_a_bias_along_the_diagonal_is_peeled_from_the_top(name):
    """`c * u * (j - i)` terms added around the top, u per head, leave the inner score; any other
    term (an offset, (j - i)^2, a per-query factor, j alone) stays in it."""
    spelling, want = SPELLINGS[name]
    f = make_biased(spelling, per_query=name == "per query")
    sf = ws.partition(f, ws.schedule_for(f)).payload.score
    assert [(pytest.approx(b.coef), tuple(f.node(x).id for x in b.factors)) for b in sf.bias] == want
    # peeled: the scale around the scores is folded into the exp2 (0.5 * 8 * 0.125 scaled inside)
    assert (sf.inner == sf.qk) == bool(want)
    assert sf.scale == pytest.approx((0.5 if name == "scaled inside" else 0.125) if want else 1.0)


def test_a_peeled_bias_adds_one_column_tile_per_block_and_its_row_part_to_the_lse():
    f = make_biased(SPELLINGS["two terms"][0])
    text = print_kernel(ws.lower(f))
    # once per tile, the weight: 0.5 and 1 * slope, each over the scale 0.125
    assert "tile.fill bias_w, 4.0\n      tile.mul bias_u, slope_t, scalar(8.0)\n      tile.add bias_w, bias_w, bias_u\n" in text
    assert ("tile.iota bias_t, axis(1), start(k * 128 - (m0 + wg * 64))\n"
            "        tile.mul bias_t, bias_t, bias_w\n"
            "        tile.add s_acc, s_acc, bias_t\n") in text
    assert ("tile.iota m_run, axis(0), start(0)\n      tile.mul m_run, m_run, bias_w\n"
            "      tile.mul m_run, m_run, scalar(-0.125)\n      tile.add l_run, l_run, m_run\n") in text


@pytest.mark.parametrize("name", ["alibi", "two terms", "scaled inside", "squared", "per query"])
def test_a_bias_matches_the_reference(name):
    f = make_biased(SPELLINGS[name][0], per_query=name == "per query")
    check(f, biased_inputs(2, 2, 77, 333, seed=len(name), per_query=name == "per query"), num_sms=3)


def test_a_bias_with_a_sink_stays_in_the_scores():
    """A sink's logit does not move with the row: the bias is computed on every score."""
    f = make_biased(SPELLINGS["alibi"][0], sink=True)
    sf = ws.partition(f, ws.schedule_for(f)).payload.score
    assert sf.bias == () and sf.inner != sf.qk
    check(f, biased_inputs(1, 3, 150, 150, seed=5))


@pytest.mark.parametrize("s, t, num_sms", [(1, 2100, 16), (3, 900, 8), (300, 2100, 40)])
def test_a_bias_through_split_kv_merges_to_the_reference(s, t, num_sms):
    """Each split's LSE leaves out the row part; the merged LSE gets it once (bottom-right causal:
    the last query sees every key)."""
    from wsched.workloads.attention.schedule import MAX_SPLIT_KV
    f = make_biased(SPELLINGS["two terms"][0], align="bottom_right")
    tile = (64, 128, 64) if s < 64 else (128, 128, 64)
    schedule = ws.schedule_for(f, tile=tile, consumer_warpgroups=1 if s < 64 else 2, split_kv=MAX_SPLIT_KV)
    kernel = ws.CompiledKernel(f, schedule, ws.partition(f, schedule), ws.lower(f, schedule), cuda_source="")
    inputs = biased_inputs(1, 2, s, t, seed=s)
    _, scalars, _ = kernel._bind_inputs(inputs)
    assert kernel._host_params(scalars, num_sms)["splits"] > 1
    o, lse = kernel.simulate(*inputs, num_sms=num_sms)
    ro, rlse = f.reference(*inputs)
    seen = torch.isfinite(rlse)
    assert rel(o[seen], ro[seen]) < 1e-2 and rel(lse[seen], rlse[seen]) < 1e-3
    assert (o[~seen] == 0).all() and torch.isneginf(lse[~seen]).all()


# ---------------------------------------------------------------------------------------------
# What the mask analysis proves: skipped kv blocks, masks on cut blocks only
# ---------------------------------------------------------------------------------------------


def _visible(fusion, S, T):
    """Brute force: which (query, key) pairs the reference keeps (True) for one head."""
    q = torch.zeros(1, 1, S, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, T, 64, dtype=torch.bfloat16)
    inputs = [q, k, k] + [torch.zeros(1, 1, 1, 1)] * (len(fusion.inputs) - 3)
    scores = [n for n in fusion.nodes() if n.op == "softmax"][0].inputs[0]
    from wsched.reference import evaluate as reference
    probe = type(fusion)(fusion.name, fusion.nodes(), [scores])
    return torch.isfinite(reference(probe, inputs, probe.bind(*inputs)))[0, 0]


def _tile_lets(kernel, role="producer"):
    """The lets of a role's tile loop (both roles compute the kv range alike)."""
    loop = next(s for r in kernel.roles() if r.name == role for s in ir.walk(r.body)
                if isinstance(s, ir.For) and s.var == "tile")
    return [s for s in loop.body if isinstance(s, ir.Let)]


@pytest.mark.parametrize("variant, window, S, T", [
    ("window", 1024, 4096, 4096), ("window", 100, 1000, 777), ("softcap_window", 300, 700, 1500),
    ("causal", 0, 1000, 1000), ("softcap", 0, 1000, 700)])
def test_kv_blocks_outside_the_mask_are_skipped(variant, window, S, T):
    """Each tile's kv range [kv_first, kv_first + kv_tiles) is exactly the blocks below ceil(T / 128)
    that some row of the tile sees (the masks read positions only: counted over all 128 rows and
    unbounded keys), for the producer and the consumers alike."""
    f = make_variant(64, variant, window=window, lse=False)
    kernel = ws.lower(f)
    bm, bn, _ = ws.schedule_for(f).tile
    kv_blocks = math.ceil(T / bn)
    visible = _visible(f, math.ceil(S / bm) * bm, kv_blocks * bn + S)
    lets = {role: _tile_lets(kernel, role) for role in ("producer", "consumer")}
    assert [print_kernel_lets(x) for x in lets["producer"]] == [print_kernel_lets(x) for x in lets["consumer"]]
    for m_block in range(math.ceil(S / bm)):
        env = {"T": T, "S": S, "kv_blocks": math.ceil(T / bn), "m0": m_block * bm}
        first = evaluate(next(s.value for s in lets["producer"] if s.name == K_FIRST), env) \
            if any(s.name == K_FIRST for s in lets["producer"]) else 0
        env[K_FIRST] = first
        count = evaluate(next(s.value for s in lets["producer"] if s.name == K_COUNT), env)
        rows = visible[m_block * bm:(m_block + 1) * bm]
        blocks = {j // bn for j in torch.nonzero(rows.any(0)).flatten().tolist() if j // bn < kv_blocks}
        assert set(range(first, first + count)) == blocks, (m_block, first, count)


def print_kernel_lets(let):
    return f"{let.name} = {let.value}"


def test_the_mask_is_paid_on_cut_blocks_only():
    """The consumer's `if` around the mask is true exactly for the blocks (64 rows of a warpgroup
    x 128 keys) that hold a hidden score or keys beyond T."""
    f = make_variant(64, "softcap_window", window=300, lse=False)
    kernel = ws.lower(f)
    bm, bn, _ = ws.schedule_for(f).tile
    S, T = 700, 1500
    padded = torch.zeros(math.ceil(S / bm) * bm, math.ceil(T / bn) * bn, dtype=torch.bool)
    padded[:, :T] = _visible(f, padded.shape[0], T)   # the mask reads positions only
    cut = next(s for s in ir.walk(kernel.body) if isinstance(s, ir.If)
               and any(isinstance(x, ir.TileMask) and x.lower is not None for x in s.then))
    checked = 0
    for m_block in range(math.ceil(S / bm)):
        env = {"T": T, "S": S, "kv_blocks": math.ceil(T / bn), "m0": m_block * bm}
        for let in [x for x in _tile_lets(kernel) if x.name in (K_FIRST, K_COUNT)]:
            env[let.name] = evaluate(let.value, env)
        for wg in (0, 1):
            for k in range(env[K_COUNT]):
                r0, c0 = m_block * bm + wg * 64, (k + env[K_FIRST]) * bn
                hidden = not bool(padded[r0:r0 + 64, c0:c0 + bn].all())
                assert bool(evaluate(cut.cond, {**env, "wg": wg, "k": k})) == hidden, (m_block, wg, k)
                checked += hidden
    assert 0 < checked


def test_masks_that_cannot_be_analysed_apply_on_every_block():
    """A mask of ids that is not a document mask (`!=`) applies to every block."""
    def other(q, k, v, doc_q, doc_k):
        s = ws.matmul(q, k.transpose(-1, -2))
        return ws.matmul(ws.softmax(ws.where(doc_q != doc_k, s, -ws.inf), dim=-1), v).to(ws.bf16)
    kernel = ws.lower(ws.fusion(_typed(other, make_variant(64, "document").inputs)))
    consumer = next(r for r in kernel.roles() if r.name == "consumer")
    kv = next(s for s in ir.walk(consumer.body) if isinstance(s, ir.For) and s.var == "k")
    assert [type(s) for s in kv.body if isinstance(s, (ir.TileSelect, ir.TileLoadGlobal))] == \
        [ir.TileLoadGlobal, ir.TileSelect]


def test_a_document_mask_applies_on_the_blocks_the_table_does_not_call_full():
    """doc_q == doc_k (with causal): the mask and the per-key ids' load only where a block is not
    in the table's full run; the causal `where` joins the key-tail mask on cut blocks."""
    kernel = ws.lower(make_variant(64, "document_causal", lse=False))
    consumer = next(r for r in kernel.roles() if r.name == "consumer")
    kv = next(s for s in ir.walk(consumer.body) if isinstance(s, ir.For) and s.var == "k")
    partial = "k + kv_first < span_full || k + kv_first >= span_full + span_fulls"
    ifs = [s for s in kv.body if isinstance(s, ir.If)]
    assert [type(s) for s in kv.body if isinstance(s, (ir.TileSelect, ir.TileLoadGlobal, ir.TileMask))] == []
    ((load, eq, select),) = [s.then for s in ifs if print_expr(s.cond) == partial]
    assert isinstance(select, ir.TileSelect) and (load.dst, load.tensor, print_kernel_coords(load)) == \
        ("doc_k_t", "doc_k", "b0, 0, 0, (k + kv_first) * 128")
    on_cut = [x for s in ifs if print_expr(s.cond) != partial for x in s.then if isinstance(x, (ir.TileSelect, ir.TileMask))]
    assert [type(x) for x in on_cut] == [ir.TileMask]
    assert on_cut[0].causal == ir.IntConst(0) and on_cut[0].lower is None
    loads = [(s.name, s.tensor, print_kernel_coords(s)) for s in ir.walk(consumer.body) if isinstance(s, ir.LoadGlobal)]
    assert loads == [("span_first", "id_spans", "b0, 0, m_block, 0"), ("span_count", "id_spans", "b0, 0, m_block, 1"),
                     ("span_full", "id_spans", "b0, 0, m_block, 2"), ("span_fulls", "id_spans", "b0, 0, m_block, 3")]


# ---------------------------------------------------------------------------------------------
# Document masks: the kv blocks the ids cannot see are skipped (ir.SpanParam)
# ---------------------------------------------------------------------------------------------


def _spans_of(kernel):
    return [p for p in kernel.params if isinstance(p, ir.SpanParam)]


def _consumer_tile_body(kernel):
    consumer = next(r for r in kernel.roles() if r.name == "consumer")
    return next(s for s in consumer.body if isinstance(s, ir.For) and s.var == "tile").body


@pytest.mark.parametrize("variant, tile, moved", [("document", "doc_q_t", True), ("sinks", "sink_t", False)])
def test_per_row_score_inputs_load_in_the_first_kv_block_unless_the_tile_reads_them_outside(variant, tile, moved):
    """defer_row_loads: the document's per-query ids, read only by the mask in the kv loop, load in
    the first kv block after its wgmmas are issued (before the first wgmma.wait); the sink's
    logit, which the running state reads before the loop, stays in the tile's prologue."""
    kernel = ws.lower(make_variant(128, variant))
    body = _consumer_tile_body(kernel)
    at = next(i for i, s in enumerate(body) if isinstance(s, ir.For) and s.var == "k")
    loads = [s for s in body[:at] if isinstance(s, ir.TileLoadGlobal) and s.dst == tile]
    kv = body[at].body
    wait = next(i for i, s in enumerate(kv) if isinstance(s, ir.WgmmaWait))
    first = kv[wait - 1]
    if moved:
        assert not loads
        assert isinstance(first, ir.If) and print_expr(first.cond) == "k == 0"
        assert [(type(s).__name__, s.dst) for s in first.then] == [("TileLoadGlobal", tile)]
        assert any(isinstance(s, ir.Wgmma) for s in kv[:wait])
    else:
        assert len(loads) == 1 and not (isinstance(first, ir.If) and print_expr(first.cond) == "k == 0")


def test_defer_row_loads_leaves_a_load_that_the_tile_reads_after_its_kv_loop():
    """The pass runs after the epilogue: a per-row tile that something after the kv loop also
    reads (a tile with no kv block would read it unloaded) keeps its load in the prologue."""
    from dataclasses import replace

    from wsched.workloads.attention import defer_row_loads

    before = ws.lower(make_variant(128, "document")).ir_after["epilogue"]
    consumer = next(r for r in before.roles() if r.name == "consumer")
    loop = next(s for s in consumer.body if isinstance(s, ir.For) and s.var == "tile")
    moved = defer_row_loads._tile(loop)
    assert not any(isinstance(s, ir.TileLoadGlobal) and s.dst == "doc_q_t" for s in moved.body)
    reader = ir.TileBinary("add", "doc_q_t", "doc_q_t", ir.FloatConst(0.0))
    kept = defer_row_loads._tile(replace(loop, body=loop.body + (reader,)))
    assert kept.body[:-1] == loop.body


def test_a_document_mask_bounds_each_tile_by_the_spans_table(golden):
    """doc_q == doc_k gives the kernel a spans table of its ids; both roles read their tile's row
    and intersect it with the analysed masks' range (the causal one here)."""
    kernel = ws.lower(make_variant(128, "document_causal"))
    golden.check("attention_document_causal_d128.ir", print_kernel(kernel))
    assert parse_kernel(print_kernel(kernel)) == kernel
    (spans,) = _spans_of(kernel)
    assert (spans.query, spans.key, spans.rows, spans.cols) == ("doc_q", "doc_k", 128, 128)
    assert "spans id_spans: i32[batch0, 1, ceil_div(S, 128), 4] = overlap(doc_q, doc_k) rows(128) cols(128)" \
        in print_kernel(kernel)
    for role in ("producer", "consumer"):
        lets = {x.name: f"{x.name} = {print_expr(x.value)}" for x in _tile_lets(kernel, role)}
        assert lets[K_FIRST] == "kv_first = span_first"
        assert lets[K_COUNT] == ("kv_tiles = max(min(min(kv_blocks, ceil_div(m0 + 128, 128)), span_first + span_count)"
                                 " - kv_first, 0)")
    # a mask of `!=`, or ids of another kind, keeps every block
    def other(q, k, v, doc_q, doc_k):
        s = ws.matmul(q, k.transpose(-1, -2))
        return ws.matmul(ws.softmax(ws.where(doc_q != doc_k, s, -ws.inf), dim=-1), v).to(ws.bf16)
    spec = make_variant(64, "document").inputs
    f = ws.fusion(_typed(other, spec))
    assert not _spans_of(ws.lower(f))


def _typed(fn, inputs):
    """`fn` with the annotations of a fusion's inputs (the same parameter names)."""
    names = [n.id for n in inputs]
    fn.__annotations__ = {name: ws.Tensor[(n.dtype, *n.shape)] for name, n in zip(names, inputs)}
    return fn


def test_a_document_mask_visits_exactly_the_blocks_its_ids_see():
    """With ids that grow along the sequence (packed documents) a tile's kv range is exactly the
    blocks holding a key of one of its rows' documents."""
    from wsched.lowering.block_spans import block_spans

    f = make_variant(64, "document", lse=False)
    kernel = ws.lower(f)
    bm, bn, _ = ws.schedule_for(f).tile
    S, T = 1000, 1500
    _, _, _, doc_q, doc_k = variant_inputs(f, 2, 1, S, T, 64, seed=3, documents=9)
    table = block_spans(doc_q, doc_k, bm, bn, (2, 1, math.ceil(S / bm), 4))
    lets = _tile_lets(kernel)
    checked = 0
    for b in range(2):
        for m_block in range(math.ceil(S / bm)):
            env = {"T": T, "S": S, "kv_blocks": math.ceil(T / bn), "m0": m_block * bm,
                   "span_first": int(table[b, 0, m_block, 0]), "span_count": int(table[b, 0, m_block, 1])}
            for let in [x for x in lets if x.name in (K_FIRST, K_COUNT)]:
                env[let.name] = evaluate(let.value, env)
            rows = doc_q[b, 0, m_block * bm:(m_block + 1) * bm, 0]
            seen = (rows[:, None] == doc_k[b, 0, 0][None, :]).any(0)
            blocks = {j // bn for j in torch.nonzero(seen).flatten().tolist()}
            assert set(range(env[K_FIRST], env[K_FIRST] + env[K_COUNT])) == blocks, (b, m_block)
            full, fulls = table[b, 0, m_block, 2:].tolist()
            every = (rows[:, None] == doc_k[b, 0, 0][None, :]).all(0)
            whole = {c for c in range(math.ceil(T / bn)) if bool(every[c * bn:(c + 1) * bn].all())}
            assert set(range(full, full + fulls)) == whole, (b, m_block)
            checked += len(whole)
    assert checked > 0


def test_block_spans_hold_every_equal_pair_for_ids_in_any_order():
    """The table is a hull: ids in any order, broadcast over batch dims, ragged last blocks."""
    from wsched.lowering.block_spans import block_spans

    g = torch.Generator().manual_seed(0)
    for S, T, rows, cols in ((1, 1, 128, 128), (130, 257, 128, 64), (300, 129, 64, 128), (64, 700, 128, 128)):
        q = torch.randint(0, 5, (3, 1, S, 1), generator=g, dtype=torch.int32)
        k = torch.randint(0, 5, (1, 2, 1, T), generator=g, dtype=torch.int32)
        table = block_spans(q, k, rows, cols, (3, 2, math.ceil(S / rows), 4))
        assert table.dtype == torch.int32 and table.is_contiguous()
        for b in range(3):
            for h in range(2):
                for r in range(math.ceil(S / rows)):
                    first, count, full, fulls = table[b, h, r].tolist()
                    equal = q[b, 0, r * rows:(r + 1) * rows, 0, None] == k[0, h, 0, None, :]
                    blocks = {j // cols for j in torch.nonzero(equal.any(0)).flatten().tolist()}
                    assert blocks <= set(range(first, first + count)) and first + count <= math.ceil(T / cols)
                    for c in range(full, full + fulls):   # the full run: every pair equal
                        assert bool(equal[:, c * cols:(c + 1) * cols].all())


@pytest.mark.parametrize("order", ["sorted", "shuffled", "unseen"])
def test_document_masks_match_the_reference_with_blocks_skipped(order):
    """Many short documents (most kv blocks skipped), ids in no order (the hull keeps blocks a
    row may not see), and rows whose document has no key (a block of rows with nothing to see:
    O = 0, LSE = -inf)."""
    f = make_variant(64, "document_causal" if order == "sorted" else "document")
    q, k, v, doc_q, doc_k = variant_inputs(f, 2, 2, 300, 420, 64, seed=5, documents=7)
    if order == "shuffled":
        doc_k = doc_k[..., torch.randperm(420, generator=torch.Generator().manual_seed(1))].contiguous()
    if order == "unseen":   # the last query block's documents appear in no key
        doc_q = doc_q.clone()
        doc_q[:, :, 256:] = 100
    o, lse = check(f, [q, k, v, doc_q, doc_k], num_sms=3)
    if order == "unseen":
        assert (o[:, :, 256:] == 0).all() and torch.isneginf(lse[:, :, 256:]).all()


def print_kernel_coords(s):
    from wsched.lowering.printer import print_expr
    return ", ".join(print_expr(c) for c in s.coords)


def test_plain_attention_keeps_its_kernel():
    """Scale and causal_mask take no tile op and no select: the plain kernel is the same as ever
    (tests/golden/attention_causal_d128.ir), and a causal `where` costs the same blocks."""
    text = print_kernel(ws.lower(make_attention(64, causal=True)))
    assert "tile.iota" not in text and "tile.select" not in text and "kv_first" not in text
    where = print_kernel(ws.lower(make_variant(64, "causal", lse=False)))
    count = re.compile(r"let kv_tiles = .*")
    assert count.findall(where) == count.findall(text)


# ---------------------------------------------------------------------------------------------
# Golden IR and builds
# ---------------------------------------------------------------------------------------------


def softcap_window_d128():
    return make_variant(128, "softcap_window", window=256, name="attn_d128_softcap_window_causal")


def test_softcap_sliding_window_ir_is_golden_and_round_trips(golden):
    k = ws.lower(softcap_window_d128())
    golden.check("attention_softcap_window_d128.ir", print_kernel(k))
    for snapshot in k.ir_after.values():
        assert parse_kernel(print_kernel(snapshot)) == snapshot


def build_resources(kernel):
    from wsched.codegen.build import compile_cuda
    from wsched.codegen.emit import emit_kernel

    return compile_cuda(emit_kernel(kernel).source, name=kernel.name).resources[kernel.name]


@pytest.mark.nvcc
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_variants_build_without_spills(variant, head_dim):
    resources = build_resources(ws.lower(make_variant(head_dim, variant)))
    assert resources.spill_stores == 0 and resources.spill_loads == 0


@pytest.mark.nvcc
@pytest.mark.parametrize("variant", ["softcap", "alibi", "document_causal"])
@pytest.mark.parametrize("head_dim", [96, 192])
def test_head_dims_96_and_192_build_without_spills(variant, head_dim):
    resources = build_resources(ws.lower(make_variant(head_dim, variant)))
    assert resources.spill_stores == 0 and resources.spill_loads == 0


# The heaviest variant of each kind of SCORE_FUNCTION_KEYS_PER_BLOCK (schedule.py).
HEAVIEST = {"computes on the scores": "alibi", "reads a per-key input": "document_causal"}
NARROWER = [(kind, key, widest) for kind, table in SCORE_FUNCTION_KEYS_PER_BLOCK.items()
            for key, widest in sorted(table.items())]


@pytest.mark.nvcc
@pytest.mark.parametrize("kind, key, widest", NARROWER,
                         ids=[f"{HEAVIEST[k]}-{c}-{d}-{i}" for k, (c, d, i), _ in NARROWER])
def test_the_widest_keys_per_block_a_score_function_gets_build_without_spills(kind, key, widest):
    """At every narrower limit of the table, the heaviest variant of its kind builds at that BN
    without spills (one step wider spilled when it was measured)."""
    consumers, value_dim, inflight = key
    head_dim = next(d for d, v in VALUE_DIMS.items() if v == value_dim)
    kernel = ws.lower(make_variant(head_dim, HEAVIEST[kind]), consumer_warpgroups=consumers, mma_inflight=inflight,
                      tile=(64 * consumers, widest, head_dim), stages=1)
    resources = build_resources(kernel)
    assert resources.spill_stores == 0 and resources.spill_loads == 0


def test_a_score_function_that_keeps_registers_live_narrows_the_keys_per_block():
    f = make_variant(128, "document")
    with pytest.raises(ScheduleError, match="^" + re.escape(
            f"attention schedule for {f.name}: BN=192 keys per block: the score function reads a per-key input, "
            "which keeps more registers live than plain attention; with head dim 128, mma_inflight=1 and 2 consumer "
            "warpgroup(s) ptxas spills beyond BN=128; use BN <= 128 (doc_k = input(...) at attention_fusions.py:")):
        ws.lower(f, tile=(128, 192, 128))
    g = make_variant(64, "alibi")
    with pytest.raises(ScheduleError, match=re.escape(
            "the score function computes on the scores, which keeps more registers live than plain attention; with "
            "head dim 64, mma_inflight=0 and 1 consumer warpgroup(s) ptxas spills beyond BN=192; use BN <= 192 "
            "(n8 = add(...) at attention_fusions.py:")):
        ws.lower(g, tile=(64, 256, 64), consumer_warpgroups=1, mma_inflight=0)
    # plain attention keeps its table; the search space and the defaults keep within the limits
    ws.lower(make_variant(128, "window"), tile=(128, 192, 128))
    space = list(ws.workload_for(f).schedule_space(f))
    assert max(s.bn for s in space if s.mma_inflight == 1) == 128 and max(s.bn for s in space) == 192
    for variant in VARIANTS:
        fusion = make_variant(128, variant)
        for consumers in (1, 2):
            for inflight in (0, 1):
                ws.partition(fusion, ws.schedule_for(fusion, mma_inflight=inflight, consumer_warpgroups=consumers))


def test_score_ops_run_as_one_loop_over_the_fragment():
    """The inner score and each mask are one unrolled loop each: temporaries stay per element.
    The scale and the softcap's 1 / c are one multiply; a mask bounded by diagonals only is the
    key-tail mask's causal(...) and lower(...) bounds."""
    from wsched.codegen.emit import emit_kernel

    source = emit_kernel(ws.lower(softcap_window_d128())).source
    assert source.count("wsp::tanh_approx(") == 2      # c = 0, 1 of one fragment position
    assert re.search(r"// tile\.mul s_acc, s_acc, 0\.00294627[0-9]*f; tile\.tanh s_acc, s_acc\n", source)
    # the causal sliding window on cut blocks: one tile.mask, a compare per bound and element
    assert "// tile.mask s_acc, rows(m0 + wg * 64), cols((k + kv_first) * 128), limit(T) causal(0) lower(-255)" in source
    assert "(col >= T || col > row + 0 || col < row - 255) ? -INFINITY : s_acc[4 * fj + 2 * fi + 0]" in source
    assert "tile.iota" not in source and "tile.select" not in source


# ---------------------------------------------------------------------------------------------
# Errors: what the kernel cannot compute between Q K^T and the softmax
# ---------------------------------------------------------------------------------------------


def where_is(marker: str) -> str:
    return source_lines.line_of(__file__, marker)


def schedule_error(message: str, node: str, op: str, marker: str):
    return pytest.raises(ScheduleError, match="^" + re.escape(
        f"attention schedule for bad: {message} ({node} = {op}(...) at {where_is(marker)})") + "$")


def attention_of(score):
    @ws.fusion
    def bad(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "S", 64],
            v: ws.Tensor[ws.bf16, "B", "H", "S", 64]):
        s = score(ws.matmul(q, k.transpose(-1, -2)) * 0.125, v)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16)
    return bad


def test_a_mask_that_depends_on_v_is_named():
    f = attention_of(lambda s, v: ws.where(
        v.max(-1, keepdim=True).transpose(-1, -2) > 0, s, -ws.inf))  # mask-of-v
    with schedule_error("max reads v, which is the V of P @ V; a score or mask function reads Q K^T, "
                        "ws.positions(...), constants and small inputs (a slope per head, a document id per "
                        "token), never Q, K or V themselves", "n4", "max", "mask-of-v"):
        ws.lower(f)


def test_an_unsupported_op_in_the_score_function_is_named():
    f = attention_of(lambda s, v: s - ws.logsumexp(s, dim=-1, keepdim=True))  # logsumexp
    with schedule_error("logsumexp cannot be computed between Q K^T and the softmax: a score or mask function "
                        "is built from elementwise ops, comparisons, ws.where and ws.positions",
                        "n4", "logsumexp", "logsumexp"):
        ws.lower(f)


def test_integer_division_is_named():
    def score(s, v):
        i, j = ws.positions(s)
        return ws.where(j / 64 == i / 64, s, -ws.inf)  # block-div
    with schedule_error("an integer division in a score function is not supported (the kernel computes in "
                        "fp32); divide floats: cast an operand with .to(ws.f32)", "n7", "div", "block-div"):
        ws.lower(attention_of(score))


def test_a_sink_must_be_one_logit_per_row_and_reach_the_logsumexp():
    with pytest.raises(ws.FusionError, match=re.escape(
            "softmax: the sink sink is f32[H, 1, T] must broadcast against n1 is f32[B, H, S, T] with its last "
            "dim 1 (one logit per row, e.g. per head [H, 1, 1]) at " + where_is("sink-per-key"))):
        @ws.fusion
        def per_key(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
                    v: ws.Tensor[ws.bf16, "B", "H", "T", 64], sink: ws.Tensor[ws.f32, "H", 1, "T"]):
            s = ws.matmul(q, k.transpose(-1, -2))
            return ws.matmul(ws.softmax(s, dim=-1, sink=sink), v).to(ws.bf16)  # sink-per-key

    @ws.fusion
    def bad(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
            v: ws.Tensor[ws.bf16, "B", "H", "T", 64], sink: ws.Tensor[ws.f32, "H", 1, 1]):
        s = ws.matmul(q, k.transpose(-1, -2))
        return ws.matmul(ws.softmax(s, dim=-1, sink=sink), v).to(ws.bf16), ws.logsumexp(s, dim=-1)  # lse-no-sink
    with schedule_error("the logsumexp output must have the softmax's sink (ws.logsumexp(s, dim=-1, sink=...) "
                        "with the same sink, or neither has one)", "n5", "logsumexp", "lse-no-sink"):
        ws.lower(bad)


def test_an_input_that_does_not_broadcast_dim_by_dim_is_named():
    @ws.fusion
    def bad(q: ws.Tensor[ws.bf16, "B", "S", 64], k: ws.Tensor[ws.bf16, "B", "S", 64],
            v: ws.Tensor[ws.bf16, "B", "S", 64], bias: ws.Tensor[ws.f32, "H", "B", 1, "S"]):
        s = ws.matmul(q, k.transpose(-1, -2)) + bias  # big-bias
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16)
    with pytest.raises(ScheduleError, match=re.escape(
            "bias is f32[H, B, 1, S]; an input read by the score function broadcasts against the scores "
            "f32[B, S, S] dim by dim, each dim 1 or the scores' own (e.g. [H, 1, 1] per head, [B, 1, S, 1] "
            "per query, [B, 1, 1, T] per key)")):
        ws.lower(bad)


@pytest.mark.parametrize("edit, message", [
    (("overlap(doc_q, doc_k)", "overlap(o, doc_k)"),
     "spans id_spans: its query ids `o` are bf16[4 dims]; they must be i32 [..., S, 1], at most the table's rank (4)"),
    (("overlap(doc_q, doc_k)", "overlap(doc_q, ids)"),
     "spans id_spans reads `ids` as its key ids, which is not a global param declared before it; name an i32 "
     "global input [..., 1, T]"),
    (("rows(128) cols(128)", "rows(0) cols(128)"), "spans id_spans: rows(0) cols(128) must both be >= 1")])
def test_a_spans_param_that_reads_no_ids_is_named(edit, message):
    from wsched.lowering.verify import VerifyError, verify

    text = print_kernel(ws.lower(make_variant(64, "document"))).replace(*edit)
    with pytest.raises(VerifyError) as error:
        verify(parse_kernel(text))
    assert message in str(error.value)


def test_a_document_mask_joined_to_another_condition_masks_full_blocks_too():
    """where((doc_q == doc_k) & (j <= i), ...): the spans bound the kv range, but a block the
    table calls full is not full for the causal condition: the mask runs on every block."""
    def joined(q, k, v, doc_q, doc_k):
        s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
        i, j = ws.positions(s)
        s = ws.where((doc_q == doc_k) & (j <= i), s, -ws.inf)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
    f = ws.fusion(_typed(joined, make_variant(64, "document").inputs))
    kernel = ws.lower(f)
    assert _spans_of(kernel)
    consumer = next(r for r in kernel.roles() if r.name == "consumer")
    kv = next(s for s in ir.walk(consumer.body) if isinstance(s, ir.For) and s.var == "k")
    assert [type(s) for s in kv.body if isinstance(s, ir.TileSelect)] == [ir.TileSelect]   # not under an if
    check(f, variant_inputs(make_variant(64, "document_causal"), 1, 2, 300, 300, 64, seed=5, documents=2))


def test_document_ids_shared_by_every_sequence():
    """Ids [S, 1] and [1, T] (one packing for the whole batch): a table of one row per block."""
    def shared(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
               v: ws.Tensor[ws.bf16, "B", "H", "T", 64], doc_q: ws.Tensor[ws.i32, "S", 1],
               doc_k: ws.Tensor[ws.i32, 1, "T"]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
        s = ws.where(doc_q == doc_k, s, -ws.inf)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)

    f = ws.fusion(shared)
    (spans,) = _spans_of(ws.lower(f))
    assert [print_expr(d) for d in spans.shape] == ["1", "1", "ceil_div(S, 128)", "4"]
    q, k, v = attention_inputs(2, 2, 260, 390, 64, seed=4)
    ids = torch.arange(390, dtype=torch.int32) // 70
    check(f, [q, k, v, ids[:260, None].contiguous(), ids[None, :].contiguous()])


def test_document_ids_beyond_fp32s_integers_compare_exactly():
    """Ids 2**30 + d (fp32 has 24 bits: 2**30 + 1 rounds to 2**30, so every document would look
    like one): they are loaded into i32 tiles and compared as integers, in the table and the mask."""
    f = make_variant(64, "document")
    q, k, v, doc_q, doc_k = variant_inputs(f, 2, 2, 300, 300, 64, seed=3, documents=5)
    big_q, big_k = doc_q + 2**30, doc_k + 2**30
    assert torch.equal(big_q.float(), torch.full_like(big_q, 2**30).float())   # indistinct as fp32
    kernel = ws.lower(f)
    decls = {s.name: s.dtype for s in ir.walk(next(r for r in kernel.roles() if r.name == "consumer").body)
             if isinstance(s, ir.RegDecl)}
    assert decls["doc_q_t"] == decls["doc_k_t"] == "i32"
    o, _ = check(f, [q, k, v, big_q, big_k])
    o_small, _ = check(f, [q, k, v, doc_q, doc_k])
    assert torch.equal(o, o_small)   # the same documents, whatever their ids


def test_integer_score_inputs_meet_positions_in_i32():
    """A per-key position input far beyond 2**24 (an absolute position in a long stream), its
    offset subtracted and compared with the query's position: i32 arithmetic, the position cast to
    i32 for the comparison; in fp32 the offset would swallow the low bits."""
    base = 2**28 + 3

    def positioned(q: ws.Tensor[ws.bf16, "B", "H", "S", 64], k: ws.Tensor[ws.bf16, "B", "H", "T", 64],
                   v: ws.Tensor[ws.bf16, "B", "H", "T", 64], pos_k: ws.Tensor[ws.i32, "B", 1, 1, "T"]):
        s = ws.matmul(q, k.transpose(-1, -2)) * 0.125
        i, _ = ws.positions(s)
        s = ws.where(pos_k - base <= i, s, -ws.inf)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)

    f = ws.fusion(positioned)
    text = print_kernel(ws.lower(f))
    assert re.search(r"tile\.sub score\d+_t, pos_k_t, scalar\(268435459\)", text)
    assert re.search(r"tile\.cast score\d+_t, score\d+_t", text)   # the query position into i32
    q, k, v = attention_inputs(2, 2, 200, 260, 64, seed=6)
    shuffled = torch.randperm(260, generator=torch.Generator().manual_seed(2)).to(torch.int32)
    pos_k = (shuffled + base).reshape(1, 1, 1, 260).expand(2, 1, 1, 260).contiguous()
    check(f, [q, k, v, pos_k])


# ---------------------------------------------------------------------------------------------
# Masks `A | B` of analysable conjunctions (prefix LM, a window with sink tokens)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, S, T", [("prefix_lm", 1000, 1000), ("prefix_lm", 200, 700),
                                        ("streaming", 1000, 1000), ("streaming", 700, 300), ("streaming", 300, 1000)])
def test_a_union_of_analysed_masks_visits_exactly_the_blocks_some_row_sees(kind, S, T):
    """Each tile's kv blocks are exactly those (below ceil(T / 128)) some row of the tile sees —
    a prefix LM's one run from key 0, a window with sink tokens as two runs (the sinks' block,
    then the window's) — and the mask runs on exactly the blocks of a warpgroup's 64 rows that
    hold a hidden score."""
    f = union_mask(64, kind)
    kernel = ws.lower(f)
    (mask,) = ws.partition(f, ws.schedule_for(f)).payload.score.masks
    assert len(mask.alternatives) == 2 and not mask.analysed
    bm, bn, _ = ws.schedule_for(f).tile
    kv_blocks = math.ceil(T / bn)
    visible = _visible(f, math.ceil(S / bm) * bm, kv_blocks * bn + S)
    lets = _tile_lets(kernel)
    consumer = next(r for r in kernel.roles() if r.name == "consumer")
    kv = next(s for s in ir.walk(consumer.body) if isinstance(s, ir.For) and s.var == "k")
    (union_if,) = [s for s in kv.body if isinstance(s, ir.If) and any(isinstance(x, ir.TileSelect) for x in s.then)]
    two_runs = any(x.name == "run_first" for x in lets)
    assert two_runs == (kind == "streaming")   # a prefix LM's two runs both start at key 0: one range

    def block(env, k):
        if two_runs:
            return k + env["run_first"] if k < env["run_count"] else k + env["run_next"] - env["run_count"]
        return k + env.get(K_FIRST, 0)

    for m_block in range(math.ceil(S / bm)):
        env = {"T": T, "S": S, "kv_blocks": kv_blocks, "m0": m_block * bm}
        for let in [x for x in lets if x.name in (K_FIRST, K_COUNT) or x.name.startswith("run_")]:
            env[let.name] = evaluate(let.value, env)
        rows = visible[m_block * bm:(m_block + 1) * bm]
        blocks = {j // bn for j in torch.nonzero(rows.any(0)).flatten().tolist() if j // bn < kv_blocks}
        walked = [block(env, k) for k in range(env[K_COUNT])]
        assert sorted(walked) == sorted(blocks) and len(set(walked)) == len(walked), (m_block, walked)
        for wg in (0, 1):
            for k in range(env[K_COUNT]):
                r0, c0 = m_block * bm + wg * 64, block(env, k) * bn
                hidden = not bool(visible[r0:r0 + 64, c0:c0 + bn].all())
                assert bool(evaluate(union_if.cond, {**env, "wg": wg, "k": k})) == hidden, (m_block, wg, k)


@pytest.mark.parametrize("kind, S, T", [("prefix_lm", 333, 333), ("prefix_lm", 130, 500), ("streaming", 400, 400),
                                        ("streaming", 300, 200), ("prefix_window", 450, 450)])
def test_a_union_of_analysed_masks_matches_the_reference(kind, S, T):
    f = union_mask(64, kind, prefix=150, window=100, sinks=5)
    q, k, v = attention_inputs(2, 2, S, T, 64, seed=S + T)
    check(f, [q, k, v], num_sms=3)


def test_a_diagonal_bias_at_head_dim_64_defaults_to_ping_pong():
    """schedule.PINGPONG_BIAS_HEAD_DIMS: ALiBi at head dim 64 takes turns (1.13-1.19x on an H100),
    at 128 it does not, nor does a score function without a bias; decode's one-warpgroup and
    split-KV variants keep their own mode."""
    assert ws.schedule_for(make_variant(64, "alibi")).mode == "pingpong"
    assert ws.schedule_for(make_variant(64, "alibi", gqa=True)).mode == "pingpong"
    assert ws.schedule_for(make_variant(128, "alibi")).mode == "cooperative"
    assert ws.schedule_for(make_variant(64, "softcap")).mode == "cooperative"
    assert ws.schedule_for(make_variant(64, "alibi"), mode="cooperative").mode == "cooperative"
    f = make_variant(64, "alibi")
    variants = ws.partition(f, ws.schedule_for(f)).workload.variants(f, ws.schedule_for(f))
    assert variants and all(v.schedule.mode == "cooperative" for v in variants)
