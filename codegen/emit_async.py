"""Barriers and the asynchronous units in CUDA: mbarrier, named barriers, TMA, wgmma.

Each IR statement becomes one call of a device primitive (`include/mbarrier.cuh`, `sync.cuh`,
`tma.cuh`, `wgmma.cuh`), placed and guarded by the execution model (see `emit.py`):

    mbarrier.arrive empty[s]          if (threadIdx.x % 128 == 0) {        // one per warpgroup
                                        wsp::mbar_arrive(&empty_bar[s]);
    tma.load A[s] <- a[m0, k * 64]    wsp::tma_load_2d(smem_A + s * 16384, &a, &full_bar[s], k * 64, m0);
    tma.load K[s, 1] row(r * 16)      wsp::tma_load_4d(smem_K + s * 32768 + 16384 + r * 16 * 128, &k_cache,
      <- k_cache[page, 0, h, 64] ...                     &full_bar[s], 64, h, 0, page);
    wgmma.mma acc, A[s], B[s]         {  // wgmma: acc[64, 256] (+)= A[s] x B[s], 4 x m64n256k16
                                        const uint64_t desc_a = wsp::make_smem_desc(...); ...

The `wgmma.mma_async` wrappers themselves are generated per shape (`wgmma.py`) and collected in
`Emitter.wgmma` for the file's preamble.
"""

from __future__ import annotations

import math
from typing import Callable

from wsched.lowering import ir
from wsched.target import (DTYPE_BYTES, OPERAND_SWIZZLES, WGMMA_ACCUMULATOR_DTYPE, WGMMA_K, WGMMA_M,
                           WGMMA_N, WGMMA_OPERAND_DTYPES)

from .emit_context import ELECT, KERNEL, EmitError, Emitter, describe, paren
from .fragment import FULL
from .wgmma import wgmma_function

# --- mbarriers and CTA / named barriers -------------------------------------------------------------


def emit_mbarrier_init(em: Emitter, s: ir.MbarrierInit) -> None:
    slots = _barrier_slots(em, s.barrier)
    em.guarded(em.one_thread(), f"for (int i = 0; i < {slots}; ++i) "
                                f"wsp::mbar_init(&{s.barrier}_bar[i], {s.arrivals});")


def emit_mbarrier_inval(em: Emitter, s: ir.MbarrierInval) -> None:
    slots = _barrier_slots(em, s.barrier)
    em.guarded(em.one_thread(), f"for (int i = 0; i < {slots}; ++i) "
                                f"wsp::mbar_inval(&{s.barrier}_bar[i]);")


def _barrier_slots(em: Emitter, name: str) -> int:
    # verifier _MbarrierInit / _MbarrierInval: a declared barrier
    (slots,) = [b.slots for b in em.kernel.barriers if b.name == name]
    return slots


def emit_fence_mbarrier_init(em: Emitter, s: ir.FenceMbarrierInit) -> None:
    em.guarded(em.one_thread(), "wsp::fence_mbarrier_init();")


def emit_mbarrier_arrive(em: Emitter, s: ir.MbarrierArrive) -> None:
    if s.cta is None:
        em.guarded(em.one_thread(), f"wsp::mbar_arrive({em.bar_ref(s.bar)});")
    else:
        em.guarded(em.one_thread(), f"wsp::mbar_arrive_cluster({em.bar_ref(s.bar)}, {em.expr(s.cta)});")


def emit_mbarrier_arrive_expect_tx(em: Emitter, s: ir.MbarrierArriveExpectTx) -> None:
    em.guarded(em.one_thread(),
               f"wsp::mbar_arrive_expect_tx({em.bar_ref(s.bar)}, {em.expr(s.bytes)});")


def emit_mbarrier_wait(em: Emitter, s: ir.MbarrierWait) -> None:
    em.line(f"wsp::mbar_wait({em.bar_ref(s.bar)}, {em.expr(s.phase)});")


def emit_fence_proxy_async(em: Emitter, s: ir.FenceProxyAsync) -> None:
    em.line("wsp::fence_proxy_async();")


def emit_syncthreads(em: Emitter, s: ir.SyncThreads) -> None:
    # verifier _SyncThreads and _block: at kernel level, not inside elect_one
    assert em.level == KERNEL, s
    em.line("__syncthreads();")


def emit_cluster_sync(em: Emitter, s: ir.ClusterSync) -> None:
    # verifier _ClusterSync and _block: at kernel level, not inside elect_one
    assert em.level == KERNEL, s
    em.line("wsp::cluster_sync();")


def emit_named_barrier_sync(em: Emitter, s: ir.NamedBarrierSync) -> None:
    em.line(f"wsp::named_barrier_sync({em.expr(s.id)}, {s.threads});")


def emit_named_barrier_arrive(em: Emitter, s: ir.NamedBarrierArrive) -> None:
    em.line(f"wsp::named_barrier_arrive({em.expr(s.id)}, {s.threads});")


# --- TMA ---------------------------------------------------------------------------------------------


def _require_elected(em: Emitter, s: ir.Stmt) -> None:
    em.require(s, level=(ELECT,), what="must be inside elect_one (TMA is issued, committed and "
                                       "waited on by one thread)")


def _tma_operands(em: Emitter, s: ir.TmaLoad | ir.TmaStore, ref: ir.SmemRef) -> tuple[str, str, str]:
    """(smem pointer, &tensor map, coordinates innermost first) of a TMA copy; a load with a row
    offset points at that row of its 2-D sub-array."""
    _require_elected(em, s)
    p = em.tensormap_param(s.tensor, s, s.coords)
    ptr, decl, sub = em.smem_ref(ref)
    row = s.row if isinstance(s, ir.TmaLoad) else None
    if row is None:
        # verifier _tma: the sub-array holds exactly one box of the map's dtype
        assert p.dtype == decl.dtype and math.prod(p.box) == math.prod(sub), s
    else:
        # verifier _box_rows: the box is rows of a 2-D sub-array, as wide as it
        assert p.dtype == decl.dtype and len(sub) == 2 and p.box[-1] == sub[1], s
        row_bytes = sub[1] * DTYPE_BYTES[decl.dtype]
        if isinstance(row, ir.IntConst):
            ptr += f" + {row.value * row_bytes}" if row.value else ""
        else:
            text, prec, _ = em.expr_prec(row)
            ptr += f" + {paren(text, prec, 13)} * {row_bytes}"
    # IR coordinates are outermost first; the hardware (and wsp::tma_*) take innermost first.
    return ptr, f"&{em.c(s.tensor)}", em.coords_text(tuple(reversed(s.coords)))


def emit_tma_load(em: Emitter, s: ir.TmaLoad) -> None:
    dst, tensor_map, coords = _tma_operands(em, s, s.dst)
    if s.multicast is None:
        em.line(f"wsp::tma_load_{len(s.coords)}d({dst}, {tensor_map}, {em.bar_ref(s.bar)}, {coords});")
    else:
        em.line(f"wsp::tma_load_{len(s.coords)}d_multicast({dst}, {tensor_map}, {em.bar_ref(s.bar)}, "
                f"{em.expr(s.multicast)}, {coords});")


def emit_tma_store(em: Emitter, s: ir.TmaStore) -> None:
    src, tensor_map, coords = _tma_operands(em, s, s.src)
    em.line(f"wsp::tma_store_{len(s.coords)}d({tensor_map}, {src}, {coords});")


def emit_tma_commit(em: Emitter, s: ir.TmaCommit) -> None:
    _require_elected(em, s)
    em.line("wsp::tma_store_commit();")


def emit_tma_wait(em: Emitter, s: ir.TmaWait) -> None:
    _require_elected(em, s)
    em.line(f"wsp::tma_store_wait{'_read' if s.read else ''}<{s.pending}>();")


# --- wgmma -------------------------------------------------------------------------------------------


def wgmma_register_operands(body: tuple[ir.Stmt, ...]) -> list[str]:
    """The register tiles wgmma reads or writes in `body` (accumulators, register A operands):
    what `wgmma.fence` / `wgmma.wait` pin in place."""
    names: list[str] = []
    for st in ir.walk(body):
        if isinstance(st, ir.Wgmma):
            for n in (st.acc, st.a if isinstance(st.a, str) else None):
                if n is not None and n not in names:
                    names.append(n)
    return names


def _fence_operands(em: Emitter) -> None:
    for name in em.role.fenced:
        t = em.role.tiles.get(name)
        if t is None:
            continue  # not declared yet: the wgmma using it reports that
        if t.packed:
            em.line(f"wsp::fence_packed({t.name});")
        else:
            em.line(f"wsp::warpgroup_fence_array({t.name});")


def emit_wgmma_fence(em: Emitter, s: ir.WgmmaFence) -> None:
    em.require_warpgroup(s)
    # As CUTLASS: pin the fragments wgmma reads/writes to this point, then wgmma.fence.
    _fence_operands(em)
    em.line("wsp::wgmma_fence();")


def emit_wgmma_commit(em: Emitter, s: ir.WgmmaCommit) -> None:
    em.require_warpgroup(s)
    em.line("wsp::wgmma_commit();")


def emit_wgmma_wait(em: Emitter, s: ir.WgmmaWait) -> None:
    em.require_warpgroup(s)
    em.line(f"wsp::wgmma_wait<{s.pending}>();")
    # Accumulator reads after this wait must not be hoisted above it.
    _fence_operands(em)


# The operand layouts implemented (target.OPERAND_SWIZZLES): rows, or column chunks, of one swizzle
# span (128 bytes: 64 x 16-bit; 64 bytes: 32 x 16-bit), swizzled with it; 8 rows are a swizzle atom.
def _k_major_operand(em: Emitter, s: ir.Wgmma, ref: ir.SmemRef, rows: int,
                     what: str) -> tuple[str, int, Callable[[int], int], int]:
    """(start pointer text, K, byte offset of k16 step ks, swizzle span) of a K-major operand:
    sub-array [rows, K] (K * bytes <= the span) or column chunks (K / W, rows, W), W * bytes the span."""
    ptr, decl, sub = em.smem_ref(ref)
    span = _check_operand_swizzle(s, decl, what)
    assert len(sub) in (2, 3), s  # verifier _smem_tile: [rows, K] or (chunks, rows, width)
    if len(sub) == 2:
        r, k = sub
        w = k
    else:
        chunks, r, w = sub
        k = chunks * w
    nbytes = DTYPE_BYTES[decl.dtype]
    if w * nbytes > span or (len(sub) == 3 and w * nbytes != span):
        raise EmitError(f"{describe(s)}: {what} rows of {w} {decl.dtype} are not one {span}-byte swizzle span")
    # verifier _Wgmma: A is [64, K], B [N, K], K a multiple of 16
    assert r == rows and k % WGMMA_K == 0, s

    def step(ks: int) -> int:
        col = WGMMA_K * ks
        return (col // w) * r * span + (col % w) * nbytes

    return ptr, k, step, span


def _check_operand_swizzle(s: ir.Wgmma, decl: ir.SmemDecl, what: str) -> int:
    """The operand buffer's swizzle span (one of target.OPERAND_SWIZZLES)."""
    if decl.swizzle not in OPERAND_SWIZZLES or decl.dtype not in WGMMA_OPERAND_DTYPES:
        raise EmitError(f"{describe(s)}: {what} buffer {decl.name} is {decl.dtype} swizzle({decl.swizzle}); "
                        f"wgmma operands are implemented for bf16/f16 with swizzle "
                        f"{' or '.join(map(str, OPERAND_SWIZZLES))}")
    return decl.swizzle


def emit_wgmma(em: Emitter, s: ir.Wgmma) -> None:
    em.require_warpgroup(s)
    acc = em.tile(s.acc, s)
    # verifier _Wgmma: the accumulator is an f32[64, N] tile with N one of WGMMA_N
    assert acc.layout == FULL and acc.dtype == WGMMA_ACCUMULATOR_DTYPE and acc.cols in WGMMA_N, s
    n = acc.cols
    b_ptr, b_decl, b_sub = em.smem_ref(s.b)
    span = _check_operand_swizzle(s, b_decl, "B")
    dtype = b_decl.dtype

    lines: list[str] = []
    if s.b_major == "k":
        b_ptr, k_b, b_step, _ = _k_major_operand(em, s, s.b, n, "B")
        b_desc = f"wsp::make_smem_desc({b_ptr}, {span}, 16, {8 * span})"
        b_note = f"B K-major [N, K]: rows of {span} bytes, SBO = {8 * span} (8-row group), LBO unused (1)"
    elif s.b_major == "n":
        width = span // DTYPE_BYTES[dtype]
        sub = b_sub if len(b_sub) == 3 else (1,) + tuple(b_sub)
        if len(sub) != 3 or sub[2] != width or sub[0] * sub[2] != n:
            raise EmitError(f"{describe(s)}: N-major B must be a (N/{width}, K, {width}) sub-array with "
                            f"N = {n}; got {list(b_sub)}")
        k_b = sub[1]
        chunk_bytes = k_b * span

        def b_step(ks: int) -> int:
            return WGMMA_K * ks * span

        # MN-major, swizzled (PTX ISA "Shared Memory Matrix Layout" / strides table; CUTLASS
        # make_gmma_desc<Major::MN>, canonical layouts B128 ((8,n),(8,k)):((1,LBO),(8,SBO)) and
        # B64 ((4,n),(8,k)):((1,LBO),(4,SBO)) in 16-byte units): LBO = stride between N chunks of
        # one span, SBO = stride between 8-row K groups. Here chunks are K rows x span bytes apart
        # and 8 rows are 8 x span bytes.
        b_desc = f"wsp::make_smem_desc({b_ptr}, {span}, {chunk_bytes}, {8 * span})"
        b_note = (f"B N-major (N/{width}, K, {width}): LBO = {chunk_bytes} (next {width}-column chunk), "
                  f"SBO = {8 * span} (next 8 k-rows)")
    else:
        raise AssertionError(s)  # verifier _Wgmma: B is K- or N-major

    if isinstance(s.a, ir.SmemRef):
        if s.a_major != "k":
            raise EmitError(f"{describe(s)}: only K-major A in shared memory is implemented")
        a_ptr, k, a_step, a_span = _k_major_operand(em, s, s.a, WGMMA_M, "A")
        a_dtype = em.kernel.smem_decl(s.a.buffer).dtype
        name, text = wgmma_function(n, dtype, "smem", s.b_major == "n")
        lines.append(f"const uint64_t desc_a = wsp::make_smem_desc({a_ptr}, {a_span}, 16, {8 * a_span});")
    else:
        a_tile = em.tile(s.a, s)
        # verifier _Wgmma: a K-major [64, K] bf16 or f16 tile (so packed pairs)
        assert a_tile.layout == FULL and a_tile.packed and s.a_major == "k", s
        k, a_dtype = a_tile.cols, a_tile.dtype
        name, text = wgmma_function(n, dtype, "regs", s.b_major == "n")
    assert (a_dtype, k) == (dtype, k_b), s  # verifier _Wgmma: A and B have one dtype and one K
    em.wgmma.setdefault(name, text)
    lines.append(f"const uint64_t desc_b = {b_desc};  // {b_note}")

    for ks in range(k // WGMMA_K):
        scale = em.expr(s.accumulate) if ks == 0 else "1"
        if isinstance(s.a, ir.SmemRef):
            a_arg = "desc_a" if ks == 0 else f"wsp::smem_desc_add(desc_a, {a_step(ks)})"
        else:
            a_arg = ", ".join(f"wsp::bit_cast<uint32_t>({a_tile.name}[{4 * ks + r}])" for r in range(4))
        b_arg = "desc_b" if ks == 0 else f"wsp::smem_desc_add(desc_b, {b_step(ks)})"
        lines.append(f"{name}({acc.name}, {a_arg}, {b_arg}, {scale});")

    a_text = s.a if isinstance(s.a, str) else em.ref_text(s.a)
    b_text = em.ref_text(s.b)
    with em.block(f"{{  // wgmma: {acc.name}[64, {n}] (+)= {a_text} x {b_text}, "
                  f"{k // WGMMA_K} x m64n{n}k16"):
        for ln in lines:
            em.line(ln)
