"""The torch reference semantics of a fusion: what `Fusion.reference` computes.

Every node is evaluated in fp32 on fp32 operands and rounded to its declared dtype, so 16-bit
intermediates round where a kernel's would. Every test, and the simulator, compares against it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from .dtypes import f32
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
            values[declared.id] = value.float()
        for node in fusion.nodes():
            if node.op != "input":
                result = _evaluate_node(node, [values[i] for i in node.inputs], sizes, device)
                if node.dtype != f32:
                    result = result.to(node.dtype.torch_dtype).float()
                values[node.id] = result
    outputs = tuple(values[o].to(fusion.node(o).dtype.torch_dtype) for o in fusion.outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def _per_sequence(lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Per-sequence key lengths [B] shaped to broadcast against scores [B, ..., S, T] (as [B, 1, ..., 1, 1])."""
    return lengths.reshape(-1, *([1] * (scores.ndim - 1)))


def _evaluate_node(node: Node, args: list[torch.Tensor], sizes: dict[str, int],
                   device: torch.device) -> torch.Tensor:
    """One node evaluated in fp32 on fp32 operands (rounding to node.dtype is the caller's)."""
    op = node.op
    if op in ELEMENTWISE_TORCH:
        return ELEMENTWISE_TORCH[op](*args)
    if op in MASK_TORCH:
        return MASK_TORCH[op](*args)
    if op == "const":
        return torch.tensor(node.attr("value"), dtype=torch.float32, device=device)
    if op == "position":   # the index along one of the last two dims, as [rows, 1] or [1, cols]
        shape = [sizes[dim] if isinstance(dim, str) else dim for dim in node.shape]
        return torch.arange(max(shape), dtype=torch.float32, device=device).reshape(shape)
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
        elif len(args) == 2:
            offset = _per_sequence(args[1], args[0]) - queries
        else:
            offset = keys - queries
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
    raise FusionError(op, f"the reference has no rule for node {node.id}", node.source)
