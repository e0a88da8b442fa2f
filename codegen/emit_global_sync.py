"""Synchronisation through global memory in CUDA (split-K's tickets): `fence.acq_rel.gpu`,
`atomic.inc` and `ld.shared`, one device primitive or one access each (`include/atomic.cuh`):

    elect_one {                                    if (wsp::warp_id_in_warpgroup() == 0 && wsp::elect_one()) {
      fence.acq_rel.gpu                              wsp::fence_acq_rel_gpu();
      atomic.inc T[wg] <- tickets[t] wrap(n - 1)     *reinterpret_cast<int*>(smem_T + wg * 4) =
                                                         wsp::atomic_inc(tickets + t, n - 1);
      fence.acq_rel.gpu }                            wsp::fence_acq_rel_gpu(); }
    bar.sync 1 + wg, 128                           wsp::named_barrier_sync(1 + wg, 128);
    ld.shared ticket = T[wg]                       const int ticket = *reinterpret_cast<volatile int*>(smem_T + wg * 4);

and `ld.global`, one element of an input through the read-only data cache:

    ld.global page = block_table[b, k]             const int page = __ldg(&block_table[(b) * MP + k]);
"""

from __future__ import annotations

from wsched.lowering import ir

from .emit_context import ELECT, ROLE, EmitError, Emitter, describe, paren


def emit_fence_gpu(em: Emitter, s: ir.FenceGpu) -> None:
    em.line("wsp::fence_acq_rel_gpu();")


def _element(em: Emitter, s: ir.AtomicInc | ir.LoadGlobal, p: ir.GlobalParam) -> str:
    """The row-major element offset of `coords` in the tensor `p`."""
    offset = ""
    for d, coord in enumerate(s.coords):
        text, prec, _ = em.expr_prec(coord)
        if d == 0:
            offset = text if len(s.coords) == 1 else paren(text, prec, 13)
            continue
        extent, eprec, _ = em.expr_prec(p.shape[d])
        offset = f"({offset}) * {paren(extent, eprec, 13)} + {paren(text, prec, 12)}"
    return offset


def emit_atomic_inc(em: Emitter, s: ir.AtomicInc) -> None:
    # verifier _AtomicInc: inside elect_one, an i32 global tensor, an i32 smem element
    if em.level != ELECT:
        raise EmitError(f"{describe(s)} is one thread's operation and must be inside elect_one")
    p = em.global_param(s.tensor, s)
    ptr, _, _ = em.smem_ref(s.dst)
    em.line(f"*reinterpret_cast<int*>({ptr}) = wsp::atomic_inc({em.c(p.name)} + {_element(em, s, p)}, "
            f"{em.expr(s.wrap)});")


def emit_load_shared(em: Emitter, s: ir.LoadShared) -> None:
    em.require(s, level=(ROLE, ELECT), what="reads smem into a scalar of the running threads and must be in a role")
    ptr, _, _ = em.smem_ref(s.src)
    em.scope.declare(s.name, "int")
    # volatile: read after the barrier that orders it after the writer, never hoisted above it
    em.line(f"const int {em.c(s.name)} = *reinterpret_cast<volatile int*>({ptr});")


def emit_load_global(em: Emitter, s: ir.LoadGlobal) -> None:
    # verifier _LoadGlobal: an i32 global param that is no workspace (nothing writes it while
    # the kernel runs, so the read-only data cache may serve it), one coordinate per dim
    p = em.global_param(s.tensor, s)
    assert p.dtype == "i32" and not isinstance(p, ir.WorkspaceParam) and len(s.coords) == len(p.shape), s
    em.scope.declare(s.name, "int")
    em.line(f"const int {em.c(s.name)} = __ldg(&{em.c(p.name)}[{_element(em, s, p)}]);")
