"""lower_tma: the producer's copies as an elected thread's TMA issue loop, swizzled.

One thread of the producer warpgroup issues every wait, expect_tx and copy; the other threads
leave at once. Operand tiles whose rows are exactly one of the operand swizzle spans
(`target.OPERAND_SWIZZLES`: 128 bytes, or 64) use that swizzle (bank-conflict-free for wgmma),
which the tensor map and the smem buffer must agree on.

    before:  role producer ... { for tile ... { ... } }
             tensormap a: bf16[M, K] box(128, 64) swizzle(0)      smem A: ... swizzle(0)
    after:   role producer ... { elect_one { for tile ... { ... } }  return }
             tensormap a: bf16[M, K] box(128, 64) swizzle(128)    smem A: ... swizzle(128)
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import PRODUCER
from wsched.target import DTYPE_BYTES, OPERAND_SWIZZLES

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_role


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    def elect(role: ir.Role) -> ir.Role:
        decls = tuple(x for x in role.body if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in role.body if not isinstance(x, ir.RegDecl))
        return replace(role, body=decls + (ir.ElectOne(rest), ir.Return()))

    kernel = map_role(kernel, PRODUCER, elect)
    loads = [(ld, ld.box[-1] * DTYPE_BYTES[ld.dtype]) for c in ctx.channels() for ld in c.loads]
    map_swizzle = {ld.tensor: span for ld, span in loads if span in OPERAND_SWIZZLES}
    buffer_swizzle = {ld.buffer: span for ld, span in loads if span in OPERAND_SWIZZLES}
    params = tuple(replace(p, swizzle=map_swizzle[p.name]) if isinstance(p, ir.TensorMapParam) and p.name in map_swizzle
                   else p for p in kernel.params)
    smem = tuple(replace(b, swizzle=buffer_swizzle[b.name]) if b.name in buffer_swizzle else b for b in kernel.smem)
    return replace(kernel, params=params, smem=smem)
