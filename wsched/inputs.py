"""Random inputs for a fusion at given sizes: one definition for the CLI, the autotuner and the
timelines. Normal values (never zeros: they hide unwritten outputs), scaled so that sums stay
O(1); integer inputs (document ids, positions) small non-negative ints."""

from __future__ import annotations

import math
from typing import Mapping

# Ops whose input is a row of attention scores: a matmul feeding one is scaled by the fusion
# itself (1/sqrt(d)), so its operands are left unscaled.
_SCORE_OPS = ("softmax", "logsumexp")


def _resolve(shape, sizes: Mapping[str, int]) -> list[int]:
    """A shape's sizes from the symbols' (`fusion.symbols`): numbers, symbols, and the dims
    derived from them: "B+1" (declared offsets), "B1-1" (ws.varlen's sequences), "MP*16"
    (ws.paged's keys)."""
    def size(d) -> int:
        if not isinstance(d, str) or d in sizes:
            return d if not isinstance(d, str) else sizes[d]
        for sep, combine in (("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)):
            if sep in d:
                a, b = d.split(sep, 1)
                return combine(size(int(a) if a.isdigit() else a), size(int(b) if b.isdigit() else b))
        return sizes[d]
    return [size(d) for d in shape]


def input_shapes(fusion, sizes: Mapping[str, int]) -> dict[str, list[int]]:
    """Each input's shape (by node id) at `sizes`, the symbols' values."""
    return {node.id: _resolve(node.shape, sizes) for node in fusion.inputs}


def _operand_source(fusion, node_id: str) -> str:
    """The node a view or cast chain starting at `node_id` reads from."""
    node = fusion.node(node_id)
    while node.op in ("transpose", "expand", "cast") and node.inputs:
        node = fusion.node(node.inputs[0])
    return node.id


def input_scales(fusion, sizes: Mapping[str, int]) -> dict[str, float]:
    """1/sqrt(K) for an input that is the left operand of a matmul over K, so that sums stay O(1)
    (like tests/fusions.py:inputs_for); attention scores carry their own scale, so the operands of
    a matmul whose result reaches a softmax or logsumexp keep scale 1."""
    import networkx as nx

    scales: dict[str, float] = {}
    for node in fusion.nodes():
        if node.op != "matmul":
            continue
        if any(fusion.node(d).op in _SCORE_OPS for d in nx.descendants(fusion.graph, node.id)):
            continue
        source = fusion.node(_operand_source(fusion, node.inputs[0]))
        if source.op == "input":
            contraction = _resolve(fusion.node(node.inputs[0]).shape, sizes)[-1]
            scales[source.id] = 1.0 / math.sqrt(contraction)
    return scales


def random_inputs(fusion, sizes: Mapping[str, int], device="cpu", seed: int = 0) -> list:
    """One random tensor per input of `fusion`, in its declared dtype and shape, on `device`
    (drawn on the CPU, so a seed gives the same values on every device)."""
    import torch

    missing = sorted(set(fusion.symbols) - set(sizes))
    if missing:
        raise ValueError(f"{fusion.name}: sizes needs a value for {', '.join(missing)}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    scales = input_scales(fusion, sizes)
    # offsets of packed sequences (ws.varlen): sorted cuts of the packed rows, from 0 to all of them
    offsets_of = {n.inputs[1]: fusion.node(n.inputs[0]) for n in fusion.nodes() if n.op == "varlen"}
    tensors = []
    for node in fusion.inputs:
        shape, dtype = _resolve(node.shape, sizes), node.dtype.torch_dtype
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=generator) * scales.get(node.id, 1.0)
        elif node.id in offsets_of:
            rows = _resolve(offsets_of[node.id].shape, sizes)[0]
            cuts = torch.randint(0, rows + 1, (shape[0] - 2,), generator=generator).sort().values
            t = torch.cat([torch.zeros(1, dtype=cuts.dtype), cuts, torch.full((1,), rows, dtype=cuts.dtype)])
        else:
            t = torch.randint(0, 8, shape, generator=generator)
        tensors.append(t.to(dtype).to(device))
    return tensors
