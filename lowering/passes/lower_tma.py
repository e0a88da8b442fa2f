"""lower_tma: the producer's copies as an elected thread's TMA issue loop, 128B-swizzled.

One thread of the producer warpgroup issues every wait, expect_tx and copy; the other threads
leave at once. Operand tiles whose rows are exactly 128 bytes use the 128-byte swizzle (bank-
conflict-free for wgmma), which the tensor map and the smem buffer must agree on.

    before:  role producer ... { for tile ... { ... } }
             tensormap a: bf16[M, K] box(128, 64) swizzle(0)      smem A: ... swizzle(0)
    after:   role producer ... { elect_one { for tile ... { ... } }  return }
             tensormap a: bf16[M, K] box(128, 64) swizzle(128)    smem A: ... swizzle(128)
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import PRODUCER
from wsched.target import DTYPE_BYTES, SWIZZLE_ROW_BYTES

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_role


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    def elect(role: ir.Role) -> ir.Role:
        decls = tuple(x for x in role.body if isinstance(x, ir.RegDecl))
        rest = tuple(x for x in role.body if not isinstance(x, ir.RegDecl))
        return replace(role, body=decls + (ir.ElectOne(rest), ir.Return()))

    kernel = map_role(kernel, PRODUCER, elect)
    swizzled = {ld.tensor: ld.buffer for c in ctx.channels() for ld in c.loads
                if ld.box[-1] * DTYPE_BYTES[ld.dtype] == SWIZZLE_ROW_BYTES}
    params = tuple(replace(p, swizzle=SWIZZLE_ROW_BYTES) if isinstance(p, ir.TensorMapParam) and p.name in swizzled else p
                   for p in kernel.params)
    smem = tuple(replace(b, swizzle=SWIZZLE_ROW_BYTES) if b.name in swizzled.values() else b for b in kernel.smem)
    return replace(kernel, params=params, smem=smem)
