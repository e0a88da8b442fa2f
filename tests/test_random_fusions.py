"""Fusions a user might write, drawn at random (hypothesis), through what `ws.compile` picks for the
call in the simulator, against the reference in fp32: attention score functions and masks in any
spelling (`j <= i + c`, `~(j > i)`, `2 * j <= i`, `i + j < c`, query-only conditions, joined by
`&` / `|`); attention calls at decode and prefill shapes with GQA, head dims 64-256, f16, a
score function's side input, sinks and key lengths (where the per-call rules pick split-KV, packed
GQA or 64-row tiles); and matmul epilogues at shapes no tile divides on 1 to 16 SMs (where they
pick split-K, stream-K, narrow or clustered kernels). Outputs are NaN-poisoned by the simulator
first; rows that see no key must give O = 0 and LSE = -inf."""

import inspect
import operator

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wsched as ws
from attention_fusions import attention_inputs
from wsched.workloads.attention.schedule import HEAD_DIMS, VALUE_DIMS

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def rel(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def simulated_matches_the_reference(fusion, args, seed, num_sms, o_tol):
    """The attention fusion's O and LSE from the simulator (the kernel the call picks on num_sms SMs)
    against the reference: rows that see no key store O = 0 and LSE = -inf, the others match."""
    ref_o, ref_lse = fusion.reference(*args)
    o, lse = ws.compile(fusion, build=False).simulate(*args, seed=seed, num_sms=num_sms)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key differ"
    assert not torch.isnan(o).any()
    assert bool((o.float()[~seen] == 0).all()), "a row that sees no key must store O = 0"
    if seen.any():
        assert rel(o.float()[seen], ref_o.float()[seen]) < o_tol
        assert float((lse[seen] - ref_lse[seen]).abs().max()) < 5e-2


# --- attention: score functions and masks -------------------------------------------------------

# Conditions on the query position i and the key position j, each with a constant c drawn for it.
CONDITIONS = {
    "j <= i + c": lambda i, j, c: j <= i + c,
    "i - j < c (window)": lambda i, j, c: i - j < abs(c) + 1,
    "j - i > c": lambda i, j, c: j - i > c,
    "j < c": lambda i, j, c: j < abs(c) + 1,
    "j >= c": lambda i, j, c: j >= abs(c),
    "i >= c (rows only)": lambda i, j, c: i >= abs(c),
    "2 * j <= i + c": lambda i, j, c: 2 * j <= i + abs(c),
    "i + j < c (anti-diagonal)": lambda i, j, c: i + j < abs(c) + 1,
    "~(j > i + c)": lambda i, j, c: ~(j > i + c),
    "-j >= c - i": lambda i, j, c: -j >= c - i,
    "j != i + c": lambda i, j, c: j != i + c,
}
SCORES = {
    "plain": lambda s, i, j: s,
    "softcap 20": lambda s, i, j: 20 * ws.tanh(s / 20),
    "negated": lambda s, i, j: -s,
    "scaled by -2": lambda s, i, j: s * -2.0,
    "clamped": lambda s, i, j: ws.minimum(ws.maximum(s, -1.0), 2.0),
    "relative bias": lambda s, i, j: s + 0.01 * (j - i),
    "key bias": lambda s, i, j: s - 0.002 * j,
    "s * sigmoid(s)": lambda s, i, j: s * ws.sigmoid(s),
}
constants = st.integers(-140, 140)
conditions = st.recursive(
    st.tuples(st.sampled_from(sorted(CONDITIONS)), constants),
    lambda inner: st.tuples(st.sampled_from(["&", "|"]), inner, inner),
    max_leaves=3)


def spell(cond, i, j):
    """The ws condition of a drawn tree."""
    if cond[0] in ("&", "|"):
        join = operator.and_ if cond[0] == "&" else operator.or_
        return join(spell(cond[1], i, j), spell(cond[2], i, j))
    return CONDITIONS[cond[0]](i, j, cond[1])


def attention_fusion(score: str, masks: list, causal: str | None, head_dim: int):
    def attention(q: ws.Tensor[ws.bf16, "B", "H", "S", head_dim], k: ws.Tensor[ws.bf16, "B", "H", "T", head_dim],
                  v: ws.Tensor[ws.bf16, "B", "H", "T", head_dim]):
        s = ws.matmul(q, k.transpose(-1, -2)) * head_dim ** -0.5
        i, j = ws.positions(s)
        s = SCORES[score](s, i, j)
        for cond in masks:
            s = ws.where(spell(cond, i, j), s, -ws.inf)
        if causal:
            s = ws.causal_mask(s, align=causal)
        return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)
    return ws.fusion(attention)


@SETTINGS
@given(score=st.sampled_from(sorted(SCORES)), masks=st.lists(conditions, max_size=2),
       causal=st.sampled_from([None, "top_left", "bottom_right"]), head_dim=st.sampled_from([64, 128]),
       heads=st.integers(1, 2), s=st.integers(1, 300), t=st.integers(1, 300), num_sms=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_any_score_function_and_mask_matches_the_reference(score, masks, causal, head_dim, heads, s, t,
                                                           num_sms, seed):
    fusion = attention_fusion(score, masks, causal, head_dim)
    args = attention_inputs(1, heads, s, t, head_dim, seed=seed)
    simulated_matches_the_reference(fusion, args, seed, num_sms, o_tol=2e-2)


SIDE_SCORE_INPUTS = {   # a small input of the score function: its spec and how it enters
    "slope per head": lambda heads, ones: (ws.Tensor[(ws.f32, *heads, 1, 1)], lambda s, x, i, j: s + x * (j - i)),
    "bias per key": lambda heads, ones: (ws.Tensor[(ws.f32, "B", *ones, 1, "T")], lambda s, x, i, j: s + x),
}


def attention_call(head_dim, dtype, gqa, side, sink, lengths, masks, causal):
    """Attention over [B, H, S, D] (GQA: [B, HK, G, S, D] against K / V [B, HK, 1, T, D]) with a
    score function's side input, a sink logit per head and key lengths per sequence, as drawn."""
    heads, kv_heads = (("HK", "G"), ("HK", 1)) if gqa else (("H",), ("H",))
    ones = (1,) * len(heads)
    specs = {"q": ws.Tensor[(dtype, "B", *heads, "S", head_dim)],
             "k": ws.Tensor[(dtype, "B", *kv_heads, "T", head_dim)],
             "v": ws.Tensor[(dtype, "B", *kv_heads, "T", VALUE_DIMS.get(head_dim, head_dim))]}
    enter = None
    if side:
        specs["side"], enter = SIDE_SCORE_INPUTS[side](heads, ones)
    if sink:
        specs["sink"] = ws.Tensor[(ws.f32, *heads, 1, 1)]
    if lengths:
        specs["seq_lens"] = ws.Tensor[ws.i32, "B"]

    def body(q, k, v, side=None, sink=None, seq_lens=None):
        s = ws.matmul(q, k.transpose(-1, -2)) * head_dim ** -0.5
        i, j = ws.positions(s)
        if enter:
            s = enter(s, side, i, j)
        for cond in masks:
            s = ws.where(spell(cond, i, j), s, -ws.inf)
        if lengths:
            s = ws.key_lengths(s, seq_lens)
        if causal:
            s = ws.causal_mask(s, align=causal)
        o = ws.matmul(ws.softmax(s, dim=-1, sink=sink), v).to(dtype)
        return o, ws.logsumexp(s, dim=-1, sink=sink)

    def attention(*tensors):
        return body(*tensors[:3], **dict(zip(list(specs)[3:], tensors[3:])))
    attention.__name__ = "random_attention"   # the signature: see matmul_fusion
    attention.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=spec)
         for name, spec in specs.items()])
    return ws.fusion(attention)


@SETTINGS
@given(head_dim=st.sampled_from(HEAD_DIMS), f16=st.booleans(), groups=st.sampled_from([0, 1, 2, 4]),
       side=st.sampled_from([None, *sorted(SIDE_SCORE_INPUTS)]), sink=st.booleans(), lengths=st.booleans(),
       masks=st.lists(conditions, max_size=1), causal=st.sampled_from([None, "bottom_right"]),
       batch=st.integers(1, 2), kv_heads=st.integers(1, 2), s=st.one_of(st.integers(1, 64), st.integers(1, 300)),
       t=st.integers(1, 700), num_sms=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 2**16))
def test_any_attention_call_matches_the_reference_in_the_kernel_it_picks(head_dim, f16, groups, side, sink, lengths,
                                                                         masks, causal, batch, kv_heads, s, t,
                                                                         num_sms, seed):
    """Decode and prefill shapes, GQA, head dims 64-256, f16, side inputs, sinks and key lengths:
    the per-call choice (split-KV, packed GQA, 64-row tiles) in the simulator against the reference."""
    dtype = ws.f16 if f16 else ws.bf16
    fusion = attention_call(head_dim, dtype, groups > 0, side, sink, lengths, masks, causal)
    g = torch.Generator().manual_seed(seed)
    q, k, v = attention_inputs(batch, kv_heads * max(groups, 1), s, t, head_dim, seed=seed,
                               gqa_groups=groups or None, dtype=dtype.torch_dtype)
    heads = q.shape[1:-2]
    args = [q, k, v]
    if side == "slope per head":
        args.append(torch.rand(*heads, 1, 1, generator=g) * 0.1)
    elif side == "bias per key":
        args.append(torch.randn(batch, *(1,) * len(heads), 1, t, generator=g))
    if sink:
        args.append(torch.randn(*heads, 1, 1, generator=g) + 1)
    if lengths:
        args.append(torch.randint(0, t + 1, (batch,), generator=g, dtype=torch.int32))
    simulated_matches_the_reference(fusion, args, seed, num_sms, o_tol=2.5e-2)


# --- matmul: epilogues through the per-call choice ------------------------------------------------

UNARY = {"relu": ws.relu, "gelu": ws.gelu, "silu": ws.silu, "sigmoid": ws.sigmoid, "tanh": ws.tanh,
         "neg": operator.neg, "half": lambda x: x * 0.5}
BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "max": ws.maximum, "min": ws.minimum}
SIDE_INPUTS = ("bias", "row_scale", "residual")
steps = st.one_of(st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY))),
                  st.tuples(st.sampled_from(sorted(BINARY)), st.sampled_from(SIDE_INPUTS)))


def matmul_fusion(dtype, b_transposed: bool, sides: list, chain: list, out_dtype):
    specs = {"a": ws.Tensor[dtype, "M", "K"],
             "b": ws.Tensor[dtype, "N", "K"] if b_transposed else ws.Tensor[dtype, "K", "N"]}
    side_specs = {"bias": ws.Tensor[dtype, "N"], "row_scale": ws.Tensor[ws.f32, "M", 1],
                  "residual": ws.Tensor[dtype, "M", "N"]}
    specs.update({name: side_specs[name] for name in sides})

    def body(a, b, **side):
        x = ws.matmul(a, b.transpose(-1, -2) if b_transposed else b)
        unused = dict(side)
        for kind, what in chain:
            if kind == "unary":
                x = UNARY[what](x)
            elif what in side:
                x = BINARY[kind](x, side[what])
                unused.pop(what, None)
        for value in unused.values():   # every input reaches the output
            x = x + value
        return x.to(out_dtype)

    def fusion(*tensors):
        return body(*tensors[:2], **dict(zip(sides, tensors[2:])))
    # ws.fusion reads the parameters and their ws.Tensor annotations from the signature, whose
    # list here depends on the drawn side inputs
    fusion.__name__ = "random_epilogue"
    fusion.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=spec)
         for name, spec in specs.items()])
    return ws.fusion(fusion)


@SETTINGS
@given(dtype=st.sampled_from([ws.bf16, ws.f16]), b_transposed=st.booleans(),
       sides=st.lists(st.sampled_from(SIDE_INPUTS), unique=True, max_size=3), chain=st.lists(steps, max_size=4),
       f32_out=st.booleans(), m=st.one_of(st.integers(1, 80), st.integers(60, 600)),
       n=st.sampled_from([8, 24, 40, 136, 264, 520]), k=st.sampled_from([8, 72, 520, 2056, 4104]),
       num_sms=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 2**16))
def test_any_epilogue_matches_the_reference_in_the_kernel_the_call_picks(dtype, b_transposed, sides, chain,
                                                                       f32_out, m, n, k, num_sms, seed):
    fusion = matmul_fusion(dtype, b_transposed, sides, chain, ws.f32 if f32_out else dtype)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype.torch_dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)
    side_values = {"bias": lambda: randn(n), "row_scale": lambda: randn(m, 1, dt=torch.float32),
                   "residual": lambda: randn(m, n)}
    args = [randn(m, k, scale=k ** -0.25), randn(*((n, k) if b_transposed else (k, n)), scale=k ** -0.25)]
    args += [side_values[name]() for name in sides]
    out = ws.compile(fusion, build=False).simulate(*args, seed=seed, num_sms=num_sms)
    assert not torch.isnan(out.float()).any()
    assert rel(out, fusion.reference(*args)) < 2e-2
