"""The verifier's checks of the statements that synchronise CTAs through global memory (split-K):
`fence.acq_rel.gpu`, `atomic.inc` and `ld.shared`, which carries the atomic's result from the
thread that made it to its warpgroup; and of `ld.global`, the other statement that reaches one
i32 element of a global tensor (a paged cache's page table and lengths). A mixin of
`structure.StructureCheck`, like `tiles.TileChecks`; the ordering itself (the fences around the
atomic, the barrier before `ld.shared`) and the elements' bounds are what the simulator checks
on a run.
"""

from __future__ import annotations

from .. import ir
from .lines import array_text, plural, ref_text, volume

_TICKET_DTYPE = "i32"


class GlobalSyncChecks:
    """fence.acq_rel.gpu / atomic.inc / ld.shared (a mixin of StructureCheck)."""

    def _FenceGpu(self, s, path, scope, ctx):
        pass

    def _scalar_slot(self, verb: str, ref: ir.SmemRef, path, scope, ctx) -> None:
        """`ref` selects one i32 element of a smem buffer."""
        decl = self._smem(ref, path, scope, ctx)
        if decl is None:
            return
        sub = ir.smem_subshape(decl, ref)
        if decl.dtype != _TICKET_DTYPE or volume(sub) != 1:
            self.r.at(path, f"{verb}: `{ref_text(ref)}` is {array_text(decl.dtype, sub)} of {decl.name}; it must "
                            f"select one {_TICKET_DTYPE} element (declare e.g. `smem {decl.name}: "
                            f"{_TICKET_DTYPE}[n, 1]` and index all but the last dim)")

    def _AtomicInc(self, s: ir.AtomicInc, path, scope, ctx):
        if not ctx.elected:
            self.r.at(path, "atomic.inc is one thread's read-modify-write; put it inside elect_one (with the "
                            "fence.acq_rel.gpu around it on the same thread)")
        self._scalar_slot("atomic.inc", s.dst, path, scope, ctx)
        for c in s.coords:
            self._expr(c, path, scope, ctx)
        self._expr(s.wrap, path, scope, ctx)
        param = self._lookup(s.tensor, "global param", path, scope, ctx, "tensor")
        if param is None:
            return
        if param.dtype != _TICKET_DTYPE:
            self.r.at(path, f"atomic.inc on {s.tensor}, which is {param.dtype}; the counter is an "
                            f"{_TICKET_DTYPE} tensor")
        self._one_coordinate_per_dim("atomic.inc", s.tensor, s.coords, param, path)

    def _one_coordinate_per_dim(self, verb: str, tensor: str, coords, param: ir.GlobalParam, path) -> None:
        if len(coords) != len(param.shape):
            self.r.at(path, f"{verb} {tensor}[...] gives {plural(len(coords), 'coordinate')} but "
                            f"{tensor} is {array_text(param.dtype, param.shape)}; give one coordinate per dim")

    def _LoadShared(self, s: ir.LoadShared, path, scope, ctx):
        self._scalar_slot("ld.shared", s.src, path, scope, ctx)
        self._declare(s.name, "let", path, scope)

    def _LoadGlobal(self, s: ir.LoadGlobal, path, scope, ctx):
        for c in s.coords:
            self._expr(c, path, scope, ctx)
        param = self._lookup(s.tensor, "global param", path, scope, ctx, "tensor")
        if param is not None:
            if isinstance(param, ir.WorkspaceParam):
                self.r.at(path, f"ld.global reads {s.tensor}, a workspace, which the kernel writes; ld.global "
                                f"reads through the read-only data cache, valid only for data no CTA writes "
                                f"during the kernel: read a kernel input (a `global` param)")
            elif param.dtype != _TICKET_DTYPE:
                self.r.at(path, f"ld.global reads {s.tensor}, which is {param.dtype}; it reads an "
                                f"{_TICKET_DTYPE} element (a page index or a length): declare "
                                f"`global {s.tensor}: {_TICKET_DTYPE}[...]`")
            self._one_coordinate_per_dim("ld.global", s.tensor, s.coords, param, path)
        self._declare(s.name, "let", path, scope)
