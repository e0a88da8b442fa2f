"""The table of a `spans` parameter (ir.SpanParam): for each block of query rows, the run of key
blocks outside which no key's id equals a row's id, and the run of key blocks that the mask
hides nothing of. The host computes it per call and the
simulator from its arguments, both with `block_spans`, so the table the kernel reads on the GPU
is the one the simulator checks.

A block pair (row block r, key block c) may hold an equal pair of ids only if the ranges
[min, max] of their ids meet. The table keeps, per row block, the first such key block and the
count up to the last one: a conservative hull (ids in any order give a correct table; ids that
grow along the sequence, as packed documents' do, give exactly the blocks with a visible score).
A block pair is full, every pair of ids equal, where both blocks hold one id, the same.
"""

from __future__ import annotations

import torch


def _block_ranges(ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each run of `size` elements along the last dim of `ids` (the last run may
    be shorter: it is padded with its own last element, which changes neither)."""
    n = ids.shape[-1]
    pad = -n % size
    if pad:
        ids = torch.cat([ids, ids[..., -1:].expand(*ids.shape[:-1], pad)], dim=-1)
    return torch.aminmax(ids.unflatten(-1, (-1, size)), dim=-1)


def block_spans(query: torch.Tensor, key: torch.Tensor, rows: int, cols: int,
                shape: tuple[int, ...]) -> torch.Tensor:
    """The i32 table of `shape` ([*batch, ceil(S / rows), 4]) for ids `query` [*batch_q, S, 1]
    and `key` [*batch_k, 1, T] (batch dims broadcast to `shape`'s). For row block r:

      [..., r, 0], [..., r, 1]  the first key block whose ids' range meets the rows' range, and
                                the count through the last one (first 0, count 0: none does);
      [..., r, 2], [..., r, 3]  the first and the count of the key blocks whose ids are all the
                                one id every row of the block has (there the mask hides nothing),
                                where those blocks are one run; else count 0.

    On the ids' device."""
    device = query.device
    if query.shape[-2] == 0 or key.shape[-1] == 0:
        return torch.zeros(shape, dtype=torch.int32, device=device)
    q_min, q_max = _block_ranges(query[..., 0].to(torch.int64), rows)    # [*batch_q, R]
    k_min, k_max = _block_ranges(key[..., 0, :].to(torch.int64), cols)   # [*batch_k, C]
    meets = (q_min[..., :, None] <= k_max[..., None, :]) & (k_min[..., None, :] <= q_max[..., :, None])
    full = ((q_min == q_max)[..., :, None] & (k_min == k_max)[..., None, :]
            & (q_min[..., :, None] == k_min[..., None, :]))
    columns = []
    for blocks in (meets, full):
        first, count = _run(blocks)
        if blocks is full:   # only where the full blocks are one run
            count = torch.where(count == blocks.sum(-1), count, 0)
            first = torch.where(count > 0, first, 0)
        columns += [first, count]
    table = torch.stack(torch.broadcast_tensors(*columns), dim=-1)
    return table.expand(shape).to(torch.int32).contiguous()


def _run(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, count through the last) of the True blocks along the last dim; (0, 0) if none."""
    n = blocks.shape[-1]
    index = torch.arange(n, device=blocks.device)
    first = torch.where(blocks, index, n).amin(-1)
    last = torch.where(blocks, index, -1).amax(-1)
    count = (last - first + 1).clamp_min(0)
    return torch.where(count > 0, first, 0), count
