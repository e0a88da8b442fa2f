"""The score function of an attention fusion: what stands between Q K^T and the softmax.

A user writes any elementwise function of the scores, the query and key positions
(`ws.positions`), constants and small inputs that broadcast against the scores (a slope per head
[H, 1, 1], a document id per query [B, 1, S, 1] or per key [B, 1, 1, T]):

    s = ws.matmul(q, k.transpose(-1, -2)) * scale
    i, j = ws.positions(s)
    s = 30 * ws.tanh(s / 30) + slope * (j - i)
    s = ws.where((j <= i) & (i - j < 1024), s, -ws.inf)

`analyse` checks it (every node elementwise; Q, K and V read only through Q K^T) and takes it
apart for the kernel:

  * masks: `causal_mask` and `where(cond, x, -inf)` around the top, whose condition reads
    positions, constants and inputs but not the scores. A condition built from comparisons of
    `j - i` or `j` with constants, joined by `&`, is *analysed*: it bounds the visible keys of a
    block of rows, so the kernel skips the kv blocks it hides and masks only the blocks it cuts.
    Any other condition (document ids) is applied to every block.
  * scale: positive constant factors around the top, folded into the exp2 of the softmax (the
    row max of the unscaled scores is the scaled one's, divided by the factor).
  * bias: terms `c * u * (j - i)` added around the top (ALiBi's `slope[h] * (j - i)`), u inputs
    with one value per tile (per head or batch): `DiagonalBias`. Without a sink only.
  * inner: the rest, the score before the masks and the scale (Q K^T itself for plain
    attention), computed as tile ops on the score accumulator in every block. Its range
    (`inner_range`, interval arithmetic over its ops: tanh's [-1, 1], constants, min / max ...)
    bounds the scores where an op such as softcapping's tanh bounds them; Q K^T, inputs and
    positions are unbounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import networkx as nx
import torch

from wsched.target import COMPARE_OPS, ELEMENTWISE_OPS, FLOAT_DTYPES, TORCH_DTYPES

# Ops a score function is built from (besides its leaves: Q K^T, inputs, constants, positions).
SCORE_OPS = (frozenset(ELEMENTWISE_OPS) | frozenset(COMPARE_OPS)
             | {"logical_not", "where", "causal_mask", "key_lengths"})
_LEAVES = ("const", "position", "input")


@dataclass(frozen=True)
class Bound:
    """`value`, plus T - S when `shifted` (the bottom-right causal diagonal)."""

    value: int
    shifted: bool = False


@dataclass(frozen=True)
class Mask:
    """One mask around the top of the score function: scores where it does not hold are -inf.

    `node` is the causal_mask or where node; for a where, `cond` its condition and `visible`
    the branch that keeps the score (where(cond, x, -inf): True). An analysed mask holds exactly
    where every bound holds: j - i <= each of `upper`, j - i >= each of `lower`, j <= each of
    `key_upper`, j >= each of `key_lower`."""

    node: object
    cond: object | None = None
    visible: bool = True
    analysed: bool = False
    upper: tuple[Bound, ...] = ()
    lower: tuple[Bound, ...] = ()
    key_upper: tuple[int, ...] = ()
    key_lower: tuple[int, ...] = ()
    ids: tuple["SideInput", "SideInput"] | None = None   # (per query, per key): holds only where equal
    # A condition `A | B | ...` of analysable conjunctions (prefix LM: `(j <= i) | (j < prefix)`):
    # each an analysed Mask of its bounds. The mask holds where any does: the kernel visits the
    # hull of their kv ranges and applies the condition on blocks none of them covers whole.
    alternatives: tuple["Mask", ...] = ()

    @property
    def causal(self) -> str | None:
        """The alignment of a `causal_mask` (None for a where)."""
        return self.node.attr("align") if self.node.op == "causal_mask" else None


@dataclass(frozen=True)
class SideInput:
    """An input the score function reads: `dims[d]` names the score dim its dim d runs along
    ("batch<i>", "S" or "T"), None where it has extent 1."""

    node: object
    param: str
    dims: tuple[str | None, ...]

    @property
    def per_query(self) -> bool:
        return "S" in self.dims

    @property
    def per_key(self) -> bool:
        return "T" in self.dims


@dataclass(frozen=True)
class DiagonalBias:
    """A term `coef * u1 * u2 ... * (j - i)` added to the scores (ALiBi: `slope[h] * (j - i)`),
    each u an input with one value per tile (per head or batch), `coef` in units of the final
    score (the scale factors around it applied).

    The kernel adds `coef * u * (j - r)` to each score, r the first query row of the row block
    (T - S further where the diagonal is aligned bottom-right), and the rest, `coef * u * (r - i)`,
    the same for every key of a row, only to the LSE: a row's softmax does not change when one
    number is added to all its scores. That is one add per score on a [1, BN] tile computed per
    kv block, where `u * (j - i)` itself takes three; and near the diagonal, where a row's weight
    is, j - r is small, so the scores keep their fp32 precision at any sequence length (a bias
    split as `u j - u i` would not)."""

    node: object                 # the add / sub the term was peeled from
    coef: float
    factors: tuple[str, ...]     # the ids of the inputs u


@dataclass(frozen=True)
class ScoreFunction:
    qk: str                        # the id of Q K^T
    scale: float                   # positive factor around the top (folded into the exp2)
    inner: str                     # the score before the masks and the scale (qk if none)
    masks: tuple[Mask, ...]
    inputs: tuple[SideInput, ...]
    lengths: SideInput | None = None   # ws.key_lengths: each sequence's keys (an i32 [B] input)
    bias: tuple[DiagonalBias, ...] = ()   # added to the scores, outside `inner`
    inner_range: tuple[float, float] = (-math.inf, math.inf)   # the finite scores of `inner` lie in it

    @property
    def causal(self) -> str | None:
        """The alignment of the causal mask when it is the only mask (the plain causal kernel)."""
        aligns = [m.causal for m in self.masks]
        return aligns[0] if len(aligns) == 1 and aligns[0] is not None else None

    def register_costs(self, fusion) -> tuple[tuple[str, object], ...]:
        """(kind, node) for each way this function keeps registers live beyond plain attention's,
        the kinds of `schedule.SCORE_FUNCTION_KEYS_PER_BLOCK`: "computes on the scores" (inner
        ops on every score), "reads a per-key input" (a [1, BN] tile per kv block, such as a
        document id per key). A mask alone is a few temporaries per element of one fused loop (the
        window masks measured no narrower than plain attention); a mask that reads a per-key
        input counts as that input."""
        costs = []
        if self.inner != self.qk or self.bias:
            costs.append(("computes on the scores", fusion.node(self.inner) if self.inner != self.qk
                          else self.bias[0].node))
        per_key = next((x for x in self.inputs if x.per_key), None)
        if per_key is not None:
            costs.append(("reads a per-key input", per_key.node))
        return tuple(costs)

    @property
    def cuts_diagonals(self) -> bool:
        """Whether a mask is bounded by a diagonal j - i (a causal mask, a sliding window, the
        causal part of a union) or a bias grows along one (ALiBi): the tiles that cross it are
        masked or biased per element."""
        def diagonal(m: Mask) -> bool:
            return m.causal is not None or bool(m.upper or m.lower) or any(map(diagonal, m.alternatives))
        return bool(self.bias) or any(map(diagonal, self.masks))

    @property
    def causal_only(self) -> bool:
        """Whether every mask is a causal mask or an analysed one without a lower diagonal bound
        (`j <= i`, key bounds), with no bias and no union: a tile's keys run from the first to its
        diagonal, as long as the sequence is, not bounded by a window."""
        def upper_only(m: Mask) -> bool:
            return not m.alternatives and not m.lower and (m.causal is not None or m.analysed)
        return not self.bias and all(map(upper_only, self.masks))

    @property
    def id_spans(self) -> tuple[tuple[SideInput, SideInput], ...]:
        """(query ids, key ids) of each mask that holds only where they are equal (a document
        mask): the kernel skips the kv blocks whose ids cannot equal a row block's."""
        return tuple(m.ids for m in self.masks if m.ids is not None)

    @property
    def rows_may_see_nothing(self) -> bool:
        """Whether a row may see no key in some block (or in all of them): any mask but the
        top-left causal one, which always shows a row its own key and every key before it; or a
        score function that computes on the scores (`inner`), which may itself give -inf (a
        `ws.where(..., -ws.inf)` inside a longer expression, a log of 0): the kernel then keeps
        each block's row max finite and stores O = 0, LSE = -inf for a row with no finite score,
        instead of NaN."""
        return (self.lengths is not None or any(m.causal != "top_left" for m in self.masks)
                or self.inner != self.qk)


def analyse(fusion, scores, qk, roles: dict, batch: int, fail, param_name,
            shift_invariant: bool = True) -> ScoreFunction:
    """Check the nodes from Q K^T (`qk`) to the softmax input (`scores`) and take them apart.
    `roles` maps the ids of Q, K and V to their names; `fail(message, node)` raises.
    `shift_invariant`: whether the softmax ignores a number added to a whole row (no sink),
    which the diagonal bias needs."""
    # First what reads Q, K or V around Q K^T (a mask of V), then what is not a score op.
    around = nx.subgraph_view(fusion.graph, filter_node=lambda n: n != qk.id)
    function = nx.ancestors(around, scores.id) | {scores.id} if scores.id != qk.id else set()
    for node in fusion.nodes():
        if node.id in function:
            read = next((i for i in node.inputs if i in roles), None)
            if read is not None:
                fail(f"{node.op} reads {read}, which is {roles[read]}; a score or mask function reads "
                     f"Q K^T, ws.positions(...), constants and small inputs (a slope per head, a document "
                     f"id per token), never Q, K or V themselves", node)
    chain = _chain(fusion, scores, qk, fail)
    data = {qk.id} | nx.descendants(fusion.graph, qk.id)     # nodes that read the scores
    inputs = {}
    for node in chain:
        for index, operand in enumerate(node.inputs):
            x = fusion.node(operand)
            if node.op in ("key_lengths", "causal_mask") and index == 1:
                continue                    # the key lengths: per sequence, not per score
            if x.op == "input" and x.id not in inputs:
                inputs[x.id] = SideInput(x, param_name(x.id), _side_dims(x, qk, batch, fail))
            if x.op == "position" and x.shape != ((qk.shape[-2], 1) if x.attr("dim") == -2 else (1, qk.shape[-1])):
                fail(f"{x.id} is a position along dims {list(x.shape)}, not along the scores "
                     f"{qk.type_str}; take ws.positions(...) of the scores", x)
        _check_exact(node, fail)

    uniform = {x.node.id for x in inputs.values() if "S" not in x.dims and "T" not in x.dims}
    scale, masks, x, lengths, bias = 1.0, [], scores, None, []
    while x.id != qk.id:
        if x.op == "key_lengths":
            lengths = x.inputs[1]
            x = fusion.node(x.inputs[0])
        elif x.op == "causal_mask":
            if lengths is not None and x.attr("align") == "bottom_right":
                # inside ws.key_lengths the mask sees the whole key dim: its diagonal ends at the
                # last of T keys, not at each sequence's last key, as the kernel's would
                fail("a bottom-right ws.causal_mask inside ws.key_lengths aligns to the whole key dim T, not "
                     "to each sequence's length; write ws.causal_mask(ws.key_lengths(s, lengths), "
                     "align='bottom_right') to end each sequence's diagonal at its last key", x)
            bound = Bound(0, x.attr("align") == "bottom_right")
            masks.append(Mask(x, analysed=True, upper=(bound,)))
            x = fusion.node(x.inputs[0])
        elif x.op == "where" and _masks_to_minus_inf(fusion, x) is not None:
            visible, kept = _masks_to_minus_inf(fusion, x)
            cond = fusion.node(x.inputs[0])
            if cond.id in data:            # a mask computed from the scores: part of the function
                break
            mask = _analyse_mask(fusion, x, cond, visible)
            if visible and not mask.analysed:
                mask = replace(mask, ids=_equal_ids(fusion, cond, inputs))
            masks.append(mask)
            x = kept
        elif _positive_factor(fusion, x) is not None:
            factor, x = _positive_factor(fusion, x)
            scale *= factor
        elif shift_invariant and (peeled := _peel_bias(fusion, x, uniform)) is not None:
            coef, factors, kept = peeled
            bias.append(DiagonalBias(x, scale * coef, factors))
            x = kept
        else:
            break
    inner = nx.ancestors(fusion.graph, x.id) | {x.id}
    unpeeled = next((n for n in chain if n.op == "key_lengths" and n.id in inner), None)
    if unpeeled is not None:
        fail("ws.key_lengths must wrap the score function from outside (with the masks and the scale, "
             "after every op that computes on the scores)", unpeeled)
    side = None if lengths is None else SideInput(fusion.node(lengths), param_name(lengths), ("batch0",))
    return ScoreFunction(qk.id, scale, x.id, tuple(masks), tuple(inputs.values()), side, tuple(bias),
                         value_range(fusion, x, qk.id))


def sink_of(fusion, softmax, qk, batch: int, fail, param_name) -> SideInput | float | None:
    """The attention sink of the softmax (`ws.softmax(s, dim=-1, sink=...)`): a constant, or an
    input with one logit per row (its key dim 1), read once per tile."""
    if len(softmax.inputs) < 2:
        return None
    sink = fusion.node(softmax.inputs[1])
    if sink.op == "const":
        return float(sink.attr("value"))
    if sink.op != "input":
        fail(f"the sink {sink.id} is computed ({sink.op}); a sink is an input (a logit per head or per "
             f"row) or a number", softmax)
    dims = _side_dims(sink, qk, batch, fail)
    if "T" in dims:
        fail(f"the sink {sink.id} is {sink.type_str}: one logit per row, its key dim 1", softmax)
    return SideInput(sink, param_name(sink.id), dims)


# -- the chain ---------------------------------------------------------------------------------


def _chain(fusion, scores, qk, fail) -> list:
    """Every node from Q K^T (excluded) to the scores, in topological order; FusionError-like
    `fail` on a node that is not a score op."""
    seen, stack = set(), [scores]
    while stack:
        node = stack.pop()
        if node.id in seen or node.id == qk.id:
            continue
        seen.add(node.id)
        if node.op in _LEAVES:
            continue
        if node.op not in SCORE_OPS:
            fail(f"{node.op} cannot be computed between Q K^T and the softmax: a score or mask function "
                 f"is built from elementwise ops, comparisons, ws.where and ws.positions", node)
        stack.extend(fusion.node(i) for i in node.inputs)
    return [n for n in fusion.nodes() if n.id in seen and n.op not in _LEAVES]


def _check_exact(node, fail) -> None:
    """The kernel computes integers with +, -, *, min, max and comparisons (exactly, in i32 tiles
    where an i32 input is involved; positions in fp32, exact below 2**24), not the truncations of
    an integer division or a cast to i32."""
    if node.op == "div" and node.dtype.name == "i32":
        fail("an integer division in a score function is not supported (the kernel computes in "
             "fp32); divide floats: cast an operand with .to(ws.f32)", node)
    if node.op == "cast" and node.dtype.name == "i32":
        fail("a cast to i32 in a score function is not supported (the kernel computes in fp32)", node)


def _side_dims(x, qk, batch: int, fail) -> tuple[str | None, ...]:
    names = [f"batch{i}" for i in range(batch)] + ["S", "T"]
    offset = len(qk.shape) - len(x.shape)
    dims = []
    for d, size in enumerate(x.shape):
        if offset + d < 0 or (size != 1 and size != qk.shape[offset + d]):
            fail(f"{x.id} is {x.type_str}; an input read by the score function broadcasts against the "
                 f"scores {qk.type_str} dim by dim, each dim 1 or the scores' own (e.g. [H, 1, 1] per "
                 f"head, [B, 1, S, 1] per query, [B, 1, 1, T] per key)", x)
        dims.append(None if size == 1 else names[offset + d])
    return tuple(dims)


# -- peeling the top ---------------------------------------------------------------------------


def _masks_to_minus_inf(fusion, node):
    """(visible branch, kept node) of where(cond, x, -inf) / where(cond, -inf, x); else None."""
    _, a, b = (fusion.node(i) for i in node.inputs)
    minus_inf = [n.op == "const" and n.attr("value") == -math.inf for n in (a, b)]
    if minus_inf == [False, True]:
        return True, a
    if minus_inf == [True, False]:
        return False, b
    return None


def _positive_factor(fusion, node):
    """(factor, scaled node) of x * c, c * x or x / c with a positive constant c; else None."""
    if node.op not in ("mul", "div"):
        return None
    a, b = (fusion.node(i) for i in node.inputs)
    if node.op == "mul" and a.op == "const" and b.op != "const":
        a, b = b, a
    if b.op != "const" or a.op == "const" or not float(b.attr("value")) > 0:
        return None
    value = float(b.attr("value"))
    if not math.isfinite(value) or node.dtype.name != "f32":
        return None
    return (value if node.op == "mul" else 1.0 / value), a


def _peel_bias(fusion, node, uniform: set):
    """(coef, factors, kept) of kept + D, D + kept or kept - D with D = coef * factors * (j - i)
    (`_diagonal`), computed in f32; else None."""
    if node.op not in ("add", "sub") or node.dtype.name != "f32":
        return None
    a, b = (fusion.node(i) for i in node.inputs)
    sign = 1.0 if node.op == "add" else -1.0
    for term, kept in ((b, a), (a, b)) if node.op == "add" else ((b, a),):
        found = _diagonal(fusion, term, uniform)
        if found is not None:
            return sign * found[0], found[1], kept
    return None


def _diagonal(fusion, node, uniform: set) -> tuple[float, tuple[str, ...]] | None:
    """(coef, factors) with node = coef * (product of the inputs `factors`) * (j - i) exactly
    (each factor in `uniform`: one value per tile); else None."""
    linear = _linear(fusion, node)
    if linear is not None:
        ci, cj, c = linear
        return (cj, ()) if cj != 0 and ci == -cj and c == 0 else None
    if node.dtype.name != "f32" or node.op not in ("neg", "mul", "div"):
        return None
    operands = [fusion.node(i) for i in node.inputs]
    if node.op == "neg":
        found = _diagonal(fusion, operands[0], uniform)
        return None if found is None else (-found[0], found[1])
    a, b = operands
    if node.op == "mul" and (a.op == "const" or a.id in uniform) and not (b.op == "const" or b.id in uniform):
        a, b = b, a
    if b.op == "const":
        value = float(b.attr("value"))
        if not math.isfinite(value) or value == 0.0:
            return None
        found = _diagonal(fusion, a, uniform)
        return None if found is None else (found[0] * (value if node.op == "mul" else 1.0 / value), found[1])
    if node.op == "mul" and b.id in uniform:
        found = _diagonal(fusion, a, uniform)
        return None if found is None else (found[0], found[1] + (b.id,))
    return None


# -- mask analysis -----------------------------------------------------------------------------


def _analyse_mask(fusion, node, cond, visible: bool) -> Mask:
    atoms = _atoms(fusion, cond)
    if atoms is None and visible and cond.op == "logical_or":
        alternatives = [_atoms(fusion, part) for part in _disjuncts(fusion, cond)]
        if None not in alternatives:
            return Mask(node, cond, visible,
                        alternatives=tuple(_bounded(node, cond, atoms) for atoms in alternatives))
    if atoms is None or (not visible and len(atoms) != 1):
        return Mask(node, cond, visible)
    if not visible:
        atoms = [(_NEGATED[op], lhs, value) for op, lhs, value in atoms]
    return _bounded(node, cond, atoms, visible)


def _disjuncts(fusion, cond) -> list:
    """The operands of a chain of `|`: A | (B | C) -> [A, B, C]."""
    if cond.op != "logical_or":
        return [cond]
    return [part for i in cond.inputs for part in _disjuncts(fusion, fusion.node(i))]


def _bounded(node, cond, atoms, visible: bool = True) -> Mask:
    """The analysed mask of a conjunction of atoms (op, "d" | "j", value)."""
    upper, lower, key_upper, key_lower = [], [], [], []
    for op, lhs, value in atoms:
        low, high = _integer_range(op, value)
        if lhs == "d":
            upper += [Bound(high)] if high is not None else []
            lower += [Bound(low)] if low is not None else []
        else:
            key_upper += [high] if high is not None else []
            key_lower += [low] if low is not None else []
    return Mask(node, cond, visible, True, tuple(upper), tuple(lower), tuple(key_upper), tuple(key_lower))


def _equal_ids(fusion, cond, inputs: dict) -> tuple[SideInput, SideInput] | None:
    """(query ids, key ids) where the condition holds only where an i32 input with one value per
    query row equals an i32 input with one value per key (`doc_q == doc_k`, alone or joined to
    other conditions by `&`): a document mask. The kernel then visits, per block of rows, only
    the run of kv blocks whose ids can equal the rows' (ir.SpanParam); else None."""
    if cond.op == "logical_and":
        return next(filter(None, (_equal_ids(fusion, fusion.node(i), inputs) for i in cond.inputs)), None)
    if cond.op != "eq":
        return None
    sides = [inputs.get(i) for i in cond.inputs]
    if any(x is None or x.node.dtype.name != "i32" for x in sides):
        return None
    for q, k in (sides, sides[::-1]):
        if q.per_query and not q.per_key and k.per_key and not k.per_query:
            return q, k
    return None


_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _atoms(fusion, cond) -> list | None:
    """The condition as a conjunction of (op, "d" | "j", value): `j - i op value` or `j op value`;
    None if it is not one."""
    if cond.op == "logical_and":
        parts = [_atoms(fusion, fusion.node(i)) for i in cond.inputs]
        return None if None in parts else parts[0] + parts[1]
    if cond.op not in _FLIPPED:
        return None
    a, b = (_linear(fusion, fusion.node(i)) for i in cond.inputs)
    if a is None or b is None:
        return None
    ci, cj, c = a[0] - b[0], a[1] - b[1], a[2] - b[2]   # ci * i + cj * j + c  op  0
    op = cond.op
    if cj < 0:
        ci, cj, c, op = -ci, -cj, -c, _FLIPPED[op]
    # (a bound beyond 2**30 would overflow the kernel's 32-bit block arithmetic: no bound at all)
    if cj == 0 or ci not in (0, -cj) or not math.isfinite(c / cj) or abs(c / cj) >= 2 ** 30:
        return None
    return [(op, "d" if ci else "j", -c / cj)]


def _integer_range(op: str, value: float) -> tuple[int | None, int | None]:
    """(low, high) of the integers x with `x op value`."""
    if op == "lt":
        return None, math.ceil(value) - 1
    if op == "le":
        return None, math.floor(value)
    if op == "gt":
        return math.floor(value) + 1, None
    return math.ceil(value), None


def _linear(fusion, node) -> tuple[float, float, float] | None:
    """(ci, cj, c) with node = ci * i + cj * j + c exactly, i and j the positions; else None."""
    if node.op == "position":
        return (1.0, 0.0, 0.0) if node.attr("dim") == -2 else (0.0, 1.0, 0.0)
    if node.op == "const":
        return 0.0, 0.0, float(node.attr("value"))
    if node.op == "cast" and node.dtype.name in ("f32", "i32"):
        return _linear(fusion, fusion.node(node.inputs[0]))
    parts = [_linear(fusion, fusion.node(i)) for i in node.inputs]
    if None in parts or node.dtype.name not in ("f32", "i32"):
        return None
    if node.op == "neg":
        return tuple(-x for x in parts[0])
    if node.op in ("add", "sub"):
        sign = 1.0 if node.op == "add" else -1.0
        return tuple(x + sign * y for x, y in zip(*parts))
    if node.op == "mul":
        a, b = parts
        if a[:2] == (0.0, 0.0):
            a, b = b, a
        if b[:2] != (0.0, 0.0):
            return None
        return tuple(x * b[2] for x in a)
    return None


# -- the range of the scores -------------------------------------------------------------------

_UNBOUNDED = (-math.inf, math.inf)
# The largest finite value of each float dtype (beyond it the kernel's value is inf); the tile
# ops compute in fp32, so other dtypes (i32 tiles, comparisons) are bounded by fp32's.
_FLOAT_MAX = {name: torch.finfo(TORCH_DTYPES[name]).max for name in FLOAT_DTYPES}


def _exp(v: float) -> float:
    return math.inf if v > 709.0 else math.exp(v)


def _sigmoid(v: float) -> float:
    return 0.0 if v < -709.0 else 1.0 / (1.0 + math.exp(-v))


# monotone non-decreasing unary ops: f(lo), f(hi) bound f of [lo, hi]; each takes -inf and inf
_MONOTONE = {"tanh": math.tanh, "sigmoid": _sigmoid, "exp": _exp,
             "exp2": lambda v: _exp(v * math.log(2.0)), "relu": lambda v: max(v, 0.0)}


def value_range(fusion, node, qk: str, memo: dict | None = None) -> tuple[float, float]:
    """An interval holding every value `node` takes where Q K^T (`qk`) is any number: interval
    arithmetic over the score ops (tanh and sigmoid bound whatever they read, constants are
    points, comparisons 0 or 1); Q K^T, inputs, positions and ops without a rule here are
    unbounded, and so is a bound beyond the dtype's largest finite value (the kernel's value would
    be inf) or one that meets inf or NaN arithmetic (never narrower than the truth)."""
    memo = {} if memo is None else memo
    if node.id in memo:
        return memo[node.id]
    args = [value_range(fusion, fusion.node(i), qk, memo) for i in node.inputs] if node.id != qk else []
    op = node.op
    if node.id == qk or op in ("input", "position"):
        lo, hi = _UNBOUNDED
    elif op == "const":
        lo = hi = float(node.attr("value"))
    elif op in _MONOTONE:
        f = _MONOTONE[op]
        lo, hi = f(args[0][0]), f(args[0][1])
    elif op == "neg":
        lo, hi = -args[0][1], -args[0][0]
    elif op == "cast" and node.dtype.name in _FLOAT_MAX:
        lo, hi = args[0]
    elif op in ("add", "sub", "mul", "div", "maximum", "minimum") and len(args) == 2:
        lo, hi = _binary_range(op, *args)
    elif op == "where" and len(args) == 3:
        lo, hi = min(args[1][0], args[2][0]), max(args[1][1], args[2][1])
    elif op in COMPARE_OPS or op == "logical_not":
        lo, hi = 0.0, 1.0
    else:
        lo, hi = _UNBOUNDED
    limit = _FLOAT_MAX.get(node.dtype.name, _FLOAT_MAX["f32"])
    if math.isnan(lo) or math.isnan(hi):
        lo, hi = _UNBOUNDED
    lo, hi = (-math.inf if lo < -limit else lo), (math.inf if hi > limit else hi)
    memo[node.id] = (lo, hi)
    return lo, hi


def _binary_range(op: str, a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    (a0, a1), (b0, b1) = a, b
    if op == "add":
        return a0 + b0, a1 + b1
    if op == "sub":
        return a0 - b1, a1 - b0
    if op == "maximum":
        return max(a0, b0), max(a1, b1)
    if op == "minimum":
        return min(a0, b0), min(a1, b1)
    if op == "div":
        if b0 <= 0.0 <= b1:
            return _UNBOUNDED
        b0, b1 = 1.0 / b1, 1.0 / b0
    products = [x * y for x in (a0, a1) for y in (b0, b1)]
    if any(math.isnan(x) for x in products):   # inf * 0
        return _UNBOUNDED
    return min(products), max(products)
