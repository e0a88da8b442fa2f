"""The CUDA spelling of the final loop IR: one `.cu` per kernel, one emit function per node kind.

    emitted = emit_kernel(kernel)       # EmittedKernel(source, name, threads, smem_bytes, params)
    compile_cuda(emitted.source, name=emitted.name)

The generated file reads like a hand-written warp-specialized kernel (ThunderKittens' lcf
skeleton): a header comment with the kernel's launch facts, `#include "wsched.cuh"` (every
device primitive and helper, namespace `wsp`, in `codegen/include/`), the wgmma wrappers it uses
(generated per shape), then the kernel with a `// setup` section (shared-memory carve-up,
kernel-level lets, barrier init) and one branch per role (`// role producer`, `// role consumer`)
of a single if/else on the warpgroup index, which is what setmaxnreg needs. Every statement comes
from an IR node; nothing is specialised per workload.

Execution-model mapping (see `lowering/ir.py`):

* kernel level: all threads; `mbarrier.init` / `fence.mbarrier_init` by thread 0 only.
* inside a role: warpgroup-collective. One `mbarrier.arrive` (or `arrive_expect_tx`) is ONE
  arrival per warpgroup, made by the warpgroup's first thread; `mbarrier.wait` by every thread.
* `elect_one`: one thread of the warpgroup's first warp; TMA issue, commit and wait must be
  inside one (bulk async-groups belong to the issuing thread).
* register tiles use the wgmma accumulator fragment layout (`fragment.py`).

Spellings chosen so that ptxas keeps a 128x256 consumer (128 accumulator registers plus a
64-register bf16 output tile) inside its setmaxnreg budget without spilling:

* consecutive elementwise tile ops over one fragment space share one unrolled loop;
* 128B-swizzled smem stores xor the shared address per store (`wsp::swizzle128`) instead of
  precomputing swizzled offsets (ptxas hoisted 64 of them out of the tile loop and spilled);
* global tile loads/stores take one 64-bit row pointer plus constant column offsets, use
  predicated ld/st (no branch per element) and choose pair vs element accesses once per row;
* 16-bit values move as raw bits (cuda_bf16.h's conversion asm would go through local memory).

This module holds the entry point, the dispatch table, the kernel skeleton (setup, roles,
elect_one) and control flow; the other node kinds are spelled in

    emit_async.py        mbarrier, named barriers, TMA, wgmma
    emit_tiles.py        register tiles: declarations, elementwise ops, reductions, masks
    fragment.py          the register-tile fragment layout and the C++ names of its elements
    emit_tile_memory.py  tile loads / stores to global memory, tile stores to shared memory
    emit_global_sync.py  GPU fences, atomics and `ld.shared` (split-K's tickets), `ld.global`
    emit_context.py      the emitter's state: text, scopes, names, expressions, references
    emit_trace.py        the instrumented build (`trace=True`): clock stamps around statements
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from wsched.lowering import ir
from wsched.target import ELEMENT_TYPES, SMEM_ALIGN, WARPGROUP_THREADS, launch_registers

from . import emit_async, emit_global_sync, emit_tile_memory, emit_tiles
from .emit_context import ELECT, KERNEL, ROLE, EmitError, Emitter, RoleInfo, names_in
from .emit_trace import TraceEmitter

__all__ = ["EmitError", "EmittedKernel", "emit_kernel", "EMITTERS"]


@dataclass(frozen=True)
class EmittedKernel:
    source: str
    name: str
    threads: int
    smem_bytes: int
    params: tuple
    # An instrumented build (`trace=True`): what stamp i was is trace_sites[i - 1]; the kernel
    # takes two more parameters after `params` (emit_trace.py).
    trace_sites: tuple | None = None


def _emit_body(em: Emitter, body: tuple[ir.Stmt, ...]) -> None:
    i = 0
    while i < len(body):
        s = body[i]
        fn = EMITTERS.get(type(s))
        if fn is None:
            raise EmitError(f"no CUDA spelling for IR node {type(s).__name__} ({s!r}); "
                            f"codegen/emit.py handles: {sorted(t.__name__ for t in EMITTERS)}")
        if type(s) in emit_tiles.ELEMENTWISE and em.level == ROLE:
            i += emit_tiles.emit_elementwise_run(em, body, i)
            continue
        probed = em.trace.before(em, s) if em.trace is not None else None
        fn(em, s)
        if probed is not None:
            em.trace.after(em, probed)
        i += 1
        if isinstance(s, ir.Role) and not (i < len(body) and isinstance(body[i], ir.Role)):
            em.close_guard()
            em.depth -= 1  # close the if/else chain of the roles
            em.raw("}")
            em.role_chain_open = False


# ---------------------------------------------------------------------------------------------
# Scalars, control flow and the kernel skeleton
# ---------------------------------------------------------------------------------------------


def _emit_let(em: Emitter, s: ir.Let) -> None:
    ctype = em.expr_type(s.value)
    value = em.expr(s.value)
    em.scope.declare(s.name, ctype, em.divisor(s.value) if not s.mutable and ctype == "int" else 1)
    em.line(f"{'' if s.mutable else 'const '}{ctype} {em.c(s.name)} = {value};")


def _emit_assign(em: Emitter, s: ir.Assign) -> None:
    assert em.scope.lookup(s.name) is not None, s  # verifier _Assign: a var in scope
    em.line(f"{em.c(s.name)} = {em.expr(s.value)};")


# A serial loop of register tile work and global loads (split-K's and split-KV's merges) is
# unrolled so that several iterations' loads are in flight at once, as many as fit the registers
# ptxas compiles the kernel with (target.launch_registers: 248 for 256 threads, 168 for 384)
# beyond SERIAL_UNROLL_RESERVED (the accumulator or O tile and what else stays live): at 248,
# split-K's [64, 64] f32 partials (32) 2 deep, split-KV's groups of 8 splits (an unroll loop of
# 80 registers already) not at all; at 168 nothing. ptxas hoists the next
# iterations' loads of an unrolled loop and spilled these kernels wherever they did not fit
# (a 64x256 split-K tile with a residual input at 3 deep, 128 reserved).
SERIAL_UNROLL_RESERVED = 160
SERIAL_UNROLL_MAX = 8
_REGISTER_WORK = (ir.TileLoadGlobal, ir.TileBinary, ir.TileUnary, ir.TileFill, ir.TileView, ir.TileReduce, ir.Let)


def _register_work_only(body) -> bool:
    """Whether a loop body is only register tile ops and loads of global memory (no stores, no
    synchronisation), unroll loops of them included."""
    return all(isinstance(x, _REGISTER_WORK) or (isinstance(x, ir.For) and x.iteration == "unroll"
                                                 and _register_work_only(x.body)) for x in body)


def _loaded_registers(em: Emitter, body) -> int:
    """Registers a thread loads from global memory in one pass of `body` (unroll loops counted
    with their trip count; SERIAL_UNROLL_RESERVED loads a pass where it is not a constant)."""
    total = 0
    for x in body:
        if isinstance(x, ir.TileLoadGlobal):
            total += em.tile(x.dst, x).length
        elif isinstance(x, ir.For):
            trips = (x.stop.value - x.start.value) if isinstance(x.start, ir.IntConst) and \
                isinstance(x.stop, ir.IntConst) and x.step == ir.IntConst(1) else SERIAL_UNROLL_RESERVED
            total += max(0, trips) * _loaded_registers(em, x.body)
    return total


def serial_unroll(em: Emitter, body) -> int:
    """The unroll factor of a serial loop of register work (SERIAL_UNROLL_RESERVED)."""
    spare = launch_registers(em.kernel.threads) - SERIAL_UNROLL_RESERVED
    return max(1, min(SERIAL_UNROLL_MAX, spare // max(1, _loaded_registers(em, body))))


def _emit_for(em: Emitter, s: ir.For) -> None:
    # verifier _For: the iteration is one of ir.LOOP_KINDS
    assert s.iteration in ir.LOOP_KINDS, s
    start, stop = em.expr(s.start), em.expr(s.stop)
    var = em.c(s.var)
    if s.iteration == "dynamic":   # the next tile: the var the body set
        step = f"{var} = {em.expr(s.step)}"
    else:
        step = "++" + var if s.step == ir.IntConst(1) else f"{var} += {em.expr(s.step)}"
    if s.iteration == "unroll":
        em.line("#pragma unroll")
    elif s.iteration == "serial" and _register_work_only(s.body):
        # A loop of register tile work and global loads (split-KV's merge): unrolled as far as its
        # loads fit the registers the role has spare (SERIAL_UNROLL_RESERVED).
        em.line(f"#pragma unroll {serial_unroll(em, s.body)}")
    note = {"persistent": "  // persistent: this CTA's tiles",
            "dynamic": "  // dynamic: the tiles this CTA takes from the counter"}.get(s.iteration, "")
    with em.block(f"for (int {var} = {start}; {var} < {stop}; {step}) {{{note}"):
        em.scope.declare(s.var, "int")
        if em.trace is not None:
            em.trace.tile_start(em, s)
        _emit_body(em, s.body)


def _emit_if(em: Emitter, s: ir.If) -> None:
    head = f"if ({em.expr(s.cond)}) {{"
    while True:
        em.line(head)
        em.depth += 1
        with em.scope.nested():
            _emit_body(em, s.then)
        em.close_guard()
        em.depth -= 1
        if not s.orelse:
            em.line("}")
            return
        if len(s.orelse) == 1 and isinstance(s.orelse[0], ir.If):
            s = s.orelse[0]
            head = f"}} else if ({em.expr(s.cond)}) {{"
            continue
        em.line("} else {")
        em.depth += 1
        with em.scope.nested():
            _emit_body(em, s.orelse)
        em.close_guard()
        em.depth -= 1
        em.line("}")
        return


def _emit_role(em: Emitter, s: ir.Role) -> None:
    # One branch of a single if/else on the warpgroup index per role, in order: setmaxnreg is
    # honoured only when each role is one such branch.
    if em.level != KERNEL or em.depth != (2 if em.role_chain_open else 1):
        raise EmitError(f"role {s.name}: roles must be kernel-level statements, not nested in a "
                        "loop, an if or another role")
    if em.next_wg and not em.role_chain_open:
        raise EmitError(f"role {s.name}: the roles must be consecutive statements (one if/else "
                        "chain); a statement separates it from the previous role")
    first = em.next_wg
    em.next_wg += s.warpgroups
    if not em.role_chain_open:
        em.line()
        em.line(f"const int wg_index = __shfl_sync(0xffffffff, threadIdx.x / {WARPGROUP_THREADS}, 0);")
        em.line(f"if (wg_index < {em.next_wg}) {{")
        em.role_chain_open = True
    else:
        em.close_guard()
        em.depth -= 1
        em.raw(f"}} else if (wg_index < {em.next_wg}) {{")
    em.depth += 1
    wgs = f"warpgroup {first}" if s.warpgroups == 1 else f"warpgroups {first}-{em.next_wg - 1}"
    em.line(f"// role {s.name}: {wgs}, {s.registers} registers")
    em.level, em.role = ROLE, RoleInfo(s, first, fenced=emit_async.wgmma_register_operands(s.body))
    try:
        with em.scope.nested():
            if any(names_in(s.body, "wg")):
                em.line(f"const int wg = wg_index - {first};")
            _emit_body(em, s.body)
        em.close_guard()
    finally:
        em.level, em.role = KERNEL, None
    # the branch stays open: the next role's `} else if` or the caller's `}` closes it


def _emit_elect_one(em: Emitter, s: ir.ElectOne) -> None:
    em.require(s, level=(ROLE,), what="must be inside a role and not nested in another elect_one")
    with em.block("if (wsp::warp_id_in_warpgroup() == 0 && wsp::elect_one()) {  // elect_one"):
        em.level = ELECT
        try:
            _emit_body(em, s.body)
        finally:
            em.level = ROLE


def _emit_return(em: Emitter, s: ir.Return) -> None:
    em.line("return;")


def _emit_setmaxnreg(em: Emitter, s: ir.Setmaxnreg) -> None:
    # verifier _Setmaxnreg and _block: inc or dec, in a role, not inside elect_one
    assert em.level == ROLE and s.action in ("inc", "dec"), s
    em.line(f"wsp::setmaxnreg_{s.action}<{s.registers}>();")


EMITTERS: dict[type, Callable[[Emitter, ir.Stmt], None]] = {
    ir.Let: _emit_let,
    ir.Assign: _emit_assign,
    ir.For: _emit_for,
    ir.If: _emit_if,
    ir.Role: _emit_role,
    ir.ElectOne: _emit_elect_one,
    ir.Return: _emit_return,
    ir.Setmaxnreg: _emit_setmaxnreg,
    ir.MbarrierInit: emit_async.emit_mbarrier_init,
    ir.MbarrierArrive: emit_async.emit_mbarrier_arrive,
    ir.MbarrierArriveExpectTx: emit_async.emit_mbarrier_arrive_expect_tx,
    ir.MbarrierWait: emit_async.emit_mbarrier_wait,
    ir.MbarrierInval: emit_async.emit_mbarrier_inval,
    ir.FenceMbarrierInit: emit_async.emit_fence_mbarrier_init,
    ir.FenceProxyAsync: emit_async.emit_fence_proxy_async,
    ir.SyncThreads: emit_async.emit_syncthreads,
    ir.ClusterSync: emit_async.emit_cluster_sync,
    ir.NamedBarrierSync: emit_async.emit_named_barrier_sync,
    ir.NamedBarrierArrive: emit_async.emit_named_barrier_arrive,
    ir.TmaLoad: emit_async.emit_tma_load,
    ir.TmaStore: emit_async.emit_tma_store,
    ir.TmaCommit: emit_async.emit_tma_commit,
    ir.TmaWait: emit_async.emit_tma_wait,
    ir.WgmmaFence: emit_async.emit_wgmma_fence,
    ir.Wgmma: emit_async.emit_wgmma,
    ir.WgmmaCommit: emit_async.emit_wgmma_commit,
    ir.WgmmaWait: emit_async.emit_wgmma_wait,
    ir.RegDecl: emit_tiles.emit_reg_decl,
    ir.TileFill: emit_tiles.emit_elementwise,  # a run of these shares one loop (`_emit_body`)
    ir.TileUnary: emit_tiles.emit_elementwise,
    ir.TileBinary: emit_tiles.emit_elementwise,
    ir.TileReduce: emit_tiles.emit_tile_reduce,
    ir.TileMask: emit_tiles.emit_tile_mask,
    ir.TileLoadGlobal: emit_tile_memory.emit_tile_load_global,
    ir.TileStoreGlobal: emit_tile_memory.emit_tile_store_global,
    ir.TileStoreSmem: emit_tile_memory.emit_tile_store_smem,
    # sliced epilogues and split-K
    ir.TileView: emit_tiles.emit_tile_view,
    ir.FenceGpu: emit_global_sync.emit_fence_gpu,
    ir.AtomicInc: emit_global_sync.emit_atomic_inc,
    ir.LoadShared: emit_global_sync.emit_load_shared,
    # attention score functions: elementwise, a run of them shares one loop with the ops above
    ir.TileIota: emit_tiles.emit_elementwise,
    ir.TileSelect: emit_tiles.emit_elementwise,
    # paged KV caches
    ir.LoadGlobal: emit_global_sync.emit_load_global,
}


# ---------------------------------------------------------------------------------------------
# The whole file
# ---------------------------------------------------------------------------------------------


def _param_decl(em: Emitter, p: ir.Param) -> str:
    if isinstance(p, ir.TensorMapParam):
        return f"const __grid_constant__ CUtensorMap {em.c(p.name)}"
    if isinstance(p, ir.GlobalParam):
        return f"{ELEMENT_TYPES[p.dtype].cuda}* __restrict__ {em.c(p.name)}"
    if isinstance(p, ir.ScalarParam):
        if p.dtype not in ("i32", "f32"):
            raise EmitError(f"scalar parameter {p.name}: dtype {p.dtype} (i32 or f32)")
        return f"{ELEMENT_TYPES[p.dtype].cuda} {em.c(p.name)}"
    raise EmitError(f"no CUDA spelling for parameter {p!r}")


def _header(kernel: ir.Kernel, em: Emitter) -> list[str]:
    roles, first = [], 0
    for r in kernel.roles():
        wgs = f"warpgroup {first}" if r.warpgroups == 1 else f"warpgroups {first}-{first + r.warpgroups - 1}"
        roles.append(f"{r.name} ({wgs}, {r.registers} registers)")
        first += r.warpgroups
    grid = _host_expr(em, kernel.grid)
    out = [
        f"// {kernel.name}: warp-specialized kernel generated by wsched.codegen.emit from the loop IR.",
        "//",
        f"//   launch    grid {grid}, block {kernel.threads} threads, cluster "
        f"{'x'.join(map(str, kernel.cluster))}, {kernel.smem_bytes} bytes dynamic shared memory",
        f"//   roles     {'; '.join(roles) if roles else '(none)'}",
    ]
    for p in kernel.params:
        if isinstance(p, ir.HostParam):
            out.append(f"//   host      {p.name} = {_host_expr(em, p.value)} (computed per call)")
        elif isinstance(p, ir.WorkspaceParam):
            dims = ", ".join(_host_expr(em, d) for d in p.shape)
            out.append(f"//   workspace {p.name}: {p.dtype}[{dims}]{' zeroed' if p.zeroed else ''}"
                       f"{' fragments' if p.fragments else ''} (kept by the host)")
        elif isinstance(p, ir.SpanParam):
            dims = ", ".join(_host_expr(em, d) for d in p.shape)
            out.append(f"//   spans     {p.name}: {p.dtype}[{dims}] = overlap({p.query}, {p.key}) rows({p.rows}) "
                       f"cols({p.cols}) (computed per call)")
    for buf in kernel.smem:
        out.append(f"//   smem      {buf.name}: {buf.dtype}{list(buf.shape)} swizzle({buf.swizzle}) "
                   f"at +{em.smem_offsets[buf.name]} ({buf.nbytes} bytes)")
    for b in kernel.barriers:
        inits = [s.arrivals for s in ir.walk(kernel.body)
                 if isinstance(s, ir.MbarrierInit) and s.barrier == b.name]
        arrivals = f", {inits[0]} arrival{'s' if inits[0] != 1 else ''}" if inits else ""
        out.append(f"//   barrier   {b.name}[{b.slots}] at +{em.barrier_offsets[b.name]}{arrivals}")
    return out


def _host_expr(em: Emitter, e: ir.Expr) -> str:
    """A host-side expression (the grid) for the header comment: num_sms allowed."""
    em.host = True
    try:
        return em.expr(e)
    finally:
        em.host = False


def emit_kernel(kernel: ir.Kernel, *, trace: bool = False) -> EmittedKernel:
    """The CUDA C++ source of `kernel` (sm_90a), with its launch facts. `trace=True` emits the
    instrumented build (`emit_trace.py`); without it the source has no trace of tracing."""
    em = Emitter(kernel)
    if trace:
        em.trace = TraceEmitter()
    for p in kernel.params:
        if isinstance(p, ir.ScalarParam):
            em.scope.declare(p.name, ELEMENT_TYPES[p.dtype].cuda if p.dtype in ELEMENT_TYPES else "int")
        else:
            em.scope.declare(p.name, "tensor")

    # setup: shared memory carve-up in the layout ir.Kernel.smem_bytes assumes
    em.line("// setup")
    em.line(f"extern __shared__ __align__({SMEM_ALIGN}) uint8_t wsp_smem_raw[];")
    em.line(f"// the dynamic smem base, aligned up to {SMEM_ALIGN} bytes (128B-swizzle atoms need it)")
    mask = SMEM_ALIGN - 1
    em.line("uint8_t* const smem = reinterpret_cast<uint8_t*>("
            f"(reinterpret_cast<uintptr_t>(wsp_smem_raw) + {mask}) & ~uintptr_t({mask}));")
    for buf in kernel.smem:
        em.line(f"uint8_t* const smem_{buf.name} = smem + {em.smem_offsets[buf.name]};"
                f"  // {buf.dtype}{list(buf.shape)} swizzle({buf.swizzle})")
    for b in kernel.barriers:
        em.line(f"uint64_t* const {b.name}_bar = reinterpret_cast<uint64_t*>("
                f"smem + {em.barrier_offsets[b.name]});  // {b.slots} mbarriers")
    if em.uses_builtin["cta_id"]:
        em.line("const int cta_id = blockIdx.x;")
    if em.uses_builtin["num_ctas"]:
        em.line("const int num_ctas = gridDim.x;")
    if em.trace is not None:
        em.trace.setup(em)
    _emit_body(em, kernel.body)
    em.close_guard()
    body = em.lines

    out = _header(kernel, em)
    if em.trace is not None:
        out.append(em.trace.header())
    out += ["", '#include "wsched.cuh"', "#include <cuda_bf16.h>", "#include <cuda_fp16.h>", ""]
    for text in em.wgmma.values():
        out += text.rstrip("\n").split("\n") + [""]
    # A cluster is a compile-time attribute: any launch of the function (cuLaunchKernel included)
    # forms it, and the grid must be a multiple of it.
    cluster = f" __cluster_dims__({', '.join(map(str, kernel.cluster))})" if kernel.cluster != (1, 1, 1) else ""
    out.append(f'extern "C" __global__ void __launch_bounds__({kernel.threads}, 1){cluster} {kernel.name}(')
    decls = [_param_decl(em, p) for p in kernel.params]
    if em.trace is not None:
        decls += em.trace.params()
    out += [f"    {d}{',' if i + 1 < len(decls) else ') {'}" for i, d in enumerate(decls)]
    if not decls:
        out[-1] += ") {"
    out += body
    out.append("}")
    return EmittedKernel(source="\n".join(out) + "\n", name=kernel.name, threads=kernel.threads,
                         smem_bytes=kernel.smem_bytes, params=tuple(kernel.params),
                         trace_sites=tuple(em.trace.sites) if em.trace is not None else None)
