"""The torch reference semantics of a fusion: what `Fusion.reference` computes.

Every float node is evaluated in fp32 on fp32 operands and rounded to its declared dtype, so
16-bit intermediates round where a kernel's would; an i32 node holds exact integers (int32
arithmetic, wrapping), and meets a float in fp32. Every test, and the simulator, compares
against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from .dtypes import f32, i32
from .errors import FusionError

if TYPE_CHECKING:  # fusion.py calls `evaluate` from Fusion.reference
    from .fusion import Fusion, Node

# What each elementwise op means: target.ELEMENTWISE_OPS, each as its torch function. A cast
# computes nothing: the rounding to the node's dtype, which every node gets, is the cast.
ELEMENTWISE_TORCH: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "cast": lambda x: x,
}

# Masks: target.COMPARE_OPS, `~` and ws.where. Comparisons give bool tensors (the node's dtype
# is bool, so the caller's rounding keeps them 0 / 1); a condition is true where it is not 0.
MASK_TORCH: dict[str, Callable[..., torch.Tensor]] = {
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_not": torch.logical_not, "where": lambda cond, a, b: torch.where(cond != 0, a, b),
}


def evaluate(fusion: Fusion, inputs: Sequence[torch.Tensor], sizes: dict[str, int],
             ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The outputs of `fusion` on `inputs` (checked and bound to `sizes` by the caller), in
    their declared dtypes: one tensor, or a tuple for several outputs."""
    device = inputs[0].device if inputs else torch.device("cpu")
    values: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for declared, value in zip(fusion.inputs, inputs):
            values[declared.id] = _held(value, declared)
        sequences = _packed_sequences(fusion, inputs)
        for node in fusion.nodes():
            if node.op != "input":
                result = _evaluate_node(node, [values[i] for i in node.inputs], sizes, device, sequences)
                if node.op != "const":   # a number stays weak (fp64: see _evaluate_node)
                    result = _held(result if node.dtype == f32 else result.to(node.dtype.torch_dtype), node)
                values[node.id] = result
    outputs = tuple(values[o].to(fusion.node(o).dtype.torch_dtype) for o in fusion.outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def _held(value: torch.Tensor, node) -> torch.Tensor:
    """A node's value as the evaluation holds it: an i32 node's as int32 (exact; torch's int32
    ops wrap, and an int32 meets a float in fp32), any other as fp32."""
    return value.to(torch.int32) if node.dtype == i32 else value.float()


# --------------------------------------------------------------------------------------------
# Packed sequences (ws.varlen, ws.packed): offsets checked, per-sequence lengths of the scores
# --------------------------------------------------------------------------------------------

def check_cu_seqlens(name: str, cu: torch.Tensor, rows: int, rows_of: str, *, op: str = "varlen",
                     location: str | None = None) -> None:
    """FusionError(op, ...) unless `cu` (the offsets input `name`, any integer dtype and device)
    holds at least 2 offsets that rise from 0 to `rows` (the packed rows of the input
    `rows_of`) without decreasing; the message names the first bad offset and the rule."""
    offsets = cu.detach().to("cpu", torch.int64).reshape(-1)
    rule = f"cu_seqlens must be non-decreasing offsets from 0 to {rows} (the rows of {rows_of})"
    if offsets.numel() < 2:
        raise FusionError(op, f"{name} holds {offsets.numel()} offset{'s' * (offsets.numel() != 1)}: cu_seqlens must "
                          f"hold at least 2 offsets (one sequence)", location)
    if offsets[0] != 0:
        raise FusionError(op, f"{name}[0] = {int(offsets[0])} must be 0: {rule}", location)
    falls = (offsets[1:] < offsets[:-1]).nonzero()
    if len(falls):
        i = int(falls[0, 0]) + 1
        raise FusionError(op, f"{name}[{i}] = {int(offsets[i])} is below {name}[{i - 1}] = {int(offsets[i - 1])}: "
                          f"{rule}", location)
    last = offsets.numel() - 1
    if offsets[last] != rows:
        raise FusionError(op, f"{name}[{last}] = {int(offsets[last])} (the last offset) must be {rows}: {rule}",
                          location)


@dataclass
class _Sequences:
    """What the varlen rules need, computed once per call from the cu_seqlens inputs: the
    offsets [B + 1] by input id (int64), and for each softmax, logsumexp and causal_mask over
    scores of a varlen Q or K, the sequences' (query lengths, key lengths), each [B], or None
    for the side that is not varlen (a cache: its key lengths are ws.key_lengths')."""

    offsets: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)


def _packed_sequences(fusion: Fusion, inputs: Sequence[torch.Tensor]) -> _Sequences:
    """The offsets of every `varlen` node's cu_seqlens (checked against its rows) and the lengths
    of the scores computed from them."""
    sequences = _Sequences()
    given = {declared.id: value for declared, value in zip(fusion.inputs, inputs)}
    for node in fusion.nodes():
        if node.op == "varlen":
            rows_of, name = node.inputs
            check_cu_seqlens(name, given[name], given[rows_of].shape[0], rows_of, location=node.source)
            sequences.offsets[name] = given[name].to(torch.int64)
    if not sequences.offsets:
        return sequences
    for node in fusion.nodes():
        if node.op in ("softmax", "logsumexp", "causal_mask"):
            views = _varlen_scores(fusion, node.inputs[0])
            if views is not None:
                queries, keys = (None if view is None else torch.diff(sequences.offsets[view.inputs[1]])
                                 for view in views)
                sequences.lengths[node.id] = (queries, keys)
    return sequences


def _varlen_scores(fusion: Fusion, scores: str) -> tuple[Node | None, Node | None] | None:
    """(the varlen view of Q or None, that of K or None) of the matmul Q @ K^T that `scores` is
    computed from, found back through everything but other matmuls; None if neither is one."""
    stack, seen = [scores], set()
    while stack:
        node = fusion.node(stack.pop())
        if node.id in seen or node.op == "input":
            continue
        seen.add(node.id)
        if node.op != "matmul":
            stack.extend(node.inputs)
            continue
        query, key = (_varlen_view(fusion, operand) for operand in node.inputs)
        if not _is_transpose(fusion, node.inputs[1]):
            continue
        if key is not None and fusion.node(node.inputs[1]).shape[-1] != key.shape[-2]:
            key = None
        if query is not None and fusion.node(node.inputs[0]).shape[-2] != query.shape[-2]:
            query = None
        if query is not None or key is not None:
            return query, key
    return None


def _is_transpose(fusion: Fusion, node_id: str) -> bool:
    """Whether `node_id`, followed back through casts and expands, is a transpose (K^T)."""
    node = fusion.node(node_id)
    while node.op in ("cast", "expand"):
        node = fusion.node(node.inputs[0])
    return node.op == "transpose"


def _varlen_view(fusion: Fusion, node_id: str) -> Node | None:
    """The varlen node that the matmul operand `node_id` reads, back through views and
    elementwise ops (Q scaled before the matmul), or None."""
    stack, seen = [node_id], set()
    while stack:
        node = fusion.node(stack.pop())
        if node.id in seen or node.op in ("input", "matmul"):
            continue
        seen.add(node.id)
        if node.op == "varlen":
            return node
        stack.extend(node.inputs)
    return None


def _per_sequence(lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Per-sequence key lengths [B] shaped to broadcast against scores [B, ..., S, T] (as [B, 1, ..., 1, 1])."""
    return lengths.reshape(-1, *([1] * (scores.ndim - 1)))


def _evaluate_node(node: Node, args: list[torch.Tensor], sizes: dict[str, int],
                   device: torch.device, sequences: _Sequences | None = None) -> torch.Tensor:
    """One node evaluated in fp32 on fp32 operands (rounding to node.dtype is the caller's);
    `sequences` holds the offsets and lengths of packed sequences (`_packed_sequences`)."""
    op = node.op
    query_lengths, key_lengths = (sequences.lengths.get(node.id, (None, None)) if sequences
                                  else (None, None))
    if key_lengths is not None and op in ("softmax", "logsumexp") and node.attr("dim") == -1:
        # a sequence's padded keys are hidden here, at the reduction, not at Q @ K^T: a score
        # function (30 * tanh(s / 30)) would turn an early -inf finite
        key = torch.arange(args[0].shape[-1], device=device)
        args = [args[0].masked_fill(key >= _per_sequence(key_lengths, args[0]), float("-inf")), *args[1:]]
    if op in ELEMENTWISE_TORCH:
        return ELEMENTWISE_TORCH[op](*args)
    if op in MASK_TORCH:
        return MASK_TORCH[op](*args)
    if op == "const":
        # a Python number is weak (dsl._result_dtype): kept in fp64 (exact for integers below 2**53),
        # it takes an fp32 operand's dtype and meets an int32 one without rounding
        return torch.tensor(node.attr("value"), dtype=torch.float64, device=device)
    if op == "position":   # the index along one of the last two dims, as [rows, 1] or [1, cols]
        shape = [sizes[dim] if isinstance(dim, str) else dim for dim in node.shape]
        return torch.arange(max(shape), dtype=torch.int32, device=device).reshape(shape)
    if op == "matmul":
        return torch.matmul(*args)
    if op == "expand":
        return args[0].expand([sizes[dim] if isinstance(dim, str) else dim for dim in node.shape])
    if op == "transpose":
        return args[0].transpose(node.attr("dim0"), node.attr("dim1"))
    if op == "sum":
        return args[0].sum(node.attr("dim"), keepdim=node.attr("keepdim"))
    if op == "max":
        return args[0].amax(node.attr("dim"), keepdim=node.attr("keepdim"))
    if op in ("logsumexp", "softmax") and len(args) == 2:   # with a sink: one more logit per row
        x, sink = args
        joined = torch.cat([x, sink.expand(*x.shape[:-1], 1)], dim=-1)
        if op == "softmax":
            return torch.softmax(joined, -1)[..., :-1]
        return torch.logsumexp(joined, -1, keepdim=node.attr("keepdim"))
    if op == "logsumexp":
        return torch.logsumexp(args[0], node.attr("dim"), keepdim=node.attr("keepdim"))
    if op == "softmax":
        return torch.softmax(args[0], node.attr("dim"))
    if op == "causal_mask":   # with key lengths (a second operand), bottom-right aligns to each sequence's length
        queries, keys = args[0].shape[-2:]
        query = torch.arange(queries, device=device)[:, None]
        key = torch.arange(keys, device=device)[None, :]
        if node.attr("align") == "top_left":
            offset = 0
        else:   # each sequence aligns to its own key count (packed keys, key lengths) and queries
            if key_lengths is not None:
                keys = _per_sequence(key_lengths, args[0])
            elif len(args) == 2:
                keys = _per_sequence(args[1], args[0])
            offset = keys - (queries if query_lengths is None else _per_sequence(query_lengths, args[0]))
        return args[0].masked_fill(key > query + offset, float("-inf"))
    if op == "key_lengths":
        keys, lengths = args[0].shape[-1], args[1]
        if lengths.numel() and (lengths.min() < 0 or lengths.max() > keys):
            bad = lengths[(lengths < 0) | (lengths > keys)][0].item()
            raise FusionError("key_lengths", f"{node.inputs[1]} holds the length {bad:g}, outside 0..{keys} (the "
                              f"keys the cache holds)", node.source)
        key = torch.arange(keys, device=device)
        return args[0].masked_fill(key >= _per_sequence(args[1], args[0]), float("-inf"))
    if op == "paged":   # [P, PS, HK, D] by a [B, MP] table -> [B, HK, 1, MP * PS, D]
        cache, table = args
        # an entry outside the cache reads a page of zeros, as the kernels' TMA does (tables are
        # padded past a sequence's pages; `check_cache_values` refuses one a sequence uses)
        table = table.long()
        outside = (table < 0) | (table >= cache.shape[0])
        pages = cache[table.masked_fill(outside, 0)].masked_fill(outside[..., None, None, None], 0.0)
        b, mp, ps, hk, d = pages.shape
        return pages.reshape(b, mp * ps, hk, d).permute(0, 2, 1, 3).unsqueeze(2)
    if op == "varlen":   # [N, *heads, D] by offsets [B + 1] -> [B, *heads, N, D], zero past each length
        x, offsets = args[0], sequences.offsets[node.inputs[1]]
        rows = x.shape[0]
        t = torch.arange(rows, device=device)
        inside = t < torch.diff(offsets)[:, None]                                   # [B, N]
        gathered = x[(offsets[:-1, None] + t).clamp(max=max(rows - 1, 0))]          # [B, N, *heads, D]
        gathered = gathered.masked_fill(~inside.reshape(*inside.shape, *[1] * (x.ndim - 1)), 0.0)
        return gathered.movedim(1, -2)
    if op == "packed":   # [B, *mid, N, *rest] -> [N, *mid, *rest]: row r of sequence b is its row r - offsets[b]
        x, offsets = args[0], sequences.offsets[node.inputs[1]]
        by_sequence = x.movedim(node.attr("dim"), 1)                                # [B, N, *mid, *rest]
        row = torch.arange(by_sequence.shape[1], device=device)
        sequence = torch.searchsorted(offsets[1:].contiguous(), row, right=True)
        return by_sequence[sequence, row - offsets[sequence]]
    raise FusionError(op, f"the reference has no rule for node {node.id}", node.source)
