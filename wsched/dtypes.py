"""Element types of fusion tensors, and the one promotion rule the DSL uses.

A `DType` is a small frozen value (it is stored in DAG nodes, so it must be hashable and compare
by value). `bf16`, `f16`, `f32` and `i32` are the types a tensor may be declared with; `bool8` is
the result of a comparison (`s > 0`, `j <= i`), which only `ws.where` and `& | ~` take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, repr=False)
class DType:
    """An element type: its short name (used in printouts and error messages), its width in bits
    and the torch dtype that holds it."""

    name: str
    bits: int
    torch_dtype: torch.dtype
    is_float: bool = True

    @property
    def itemsize(self) -> int:
        """Bytes per element (TMA boxes and shared-memory tiles are sized in bytes)."""
        return self.bits // 8

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"ws.{self.name}"


bf16 = DType("bf16", 16, torch.bfloat16)
f16 = DType("f16", 16, torch.float16)
f32 = DType("f32", 32, torch.float32)
i32 = DType("i32", 32, torch.int32, is_float=False)

DTYPES = (bf16, f16, f32, i32)
bool8 = DType("bool", 8, torch.bool, is_float=False)   # comparisons; not a declarable input type


def promote(a: DType, b: DType) -> DType | None:
    """The dtype of a binary op on tensors of dtypes `a` and `b`, or None if they do not mix.

    A 16-bit float meets f32 in f32 (the accumulator type, so nothing is lost). bf16 and f16 do
    not mix: either rounding would be a silent choice, so the user must cast explicitly. An i32
    meets a float in that float, as in torch (`slope * (j - i)` with positions `i`, `j`); a bool
    (a comparison) mixes with nothing: `ws.where` turns it into values.
    """
    if a == b:
        return a
    if {a, b} in ({bf16, f32}, {f16, f32}):
        return f32
    if i32 in (a, b) and (a.is_float or b.is_float):
        return a if a.is_float else b
    return None
