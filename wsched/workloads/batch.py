"""What the workloads share about leading batch dims: a persistent tile index, once the tile
within its batch is taken off, split into batch indices b0, b1, ... (the last varying fastest)."""

from __future__ import annotations

from wsched.lowering import ir


def batch_index_lets(nb: int, rest: str = "rest", first: int = 0) -> list[ir.Let]:
    """Lets b{nb-1}, ..., b{first} from `rest` = tile / (tiles per batch entry), dividing by the
    `batch{i}` params from the last dim to the first (`first` 1: the heads of a packed sequence,
    whose b0 comes from elsewhere)."""
    lets: list[ir.Let] = []
    for i in reversed(range(first + 1, nb)):
        source = rest if i == nb - 1 else f"{rest}{i + 1}"
        lets += [ir.Let(f"b{i}", ir.mod(source, f"batch{i}")), ir.Let(f"{rest}{i}", ir.div(source, f"batch{i}"))]
    lets.append(ir.Let(f"b{first}", ir.Var(f"{rest}{first + 1}") if nb > first + 1 else ir.Var(rest)))
    return lets
