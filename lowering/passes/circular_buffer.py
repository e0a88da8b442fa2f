"""circular_buffer: give the channel `stages` slots, indexed from one linear counter.

Both nests derive the slot from the same counter `it` = (local tile index) x k_tiles + k, so
the producer and the consumers walk the ring in lockstep without sharing any state:
stage = it % S and phase = (it / S) & 1. When the number of k iterations varies per tile (the k
loop's bound is computed inside the tile loop, as causal attention's `kv_tiles` is), each role
keeps the same running base instead: `var k_base`, advanced by the tile's bound after its k
loop, and it = k_base + k.

    before:  for k in serial(0, k_tiles, 1) { tma.load A[0] <- a[m0, k * 64] bar(full[0]) }
    after:   for k in serial(0, k_tiles, 1) {
               let it = tile_iter * k_tiles + k
               let s = it % 4
               let ph = (it / 4) & 1
               tma.load A[s] <- a[m0, k * 64] bar(full[s])
             }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import K_BASE, K_VAR, TILE_VAR

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_loop, transform

V = ir.Var


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    stages = ctx.schedule.stages
    ring = ctx.channels("k")
    buffers = {b for c in ring for b in c.buffers}
    barrier_names = {n for c in ring for n in (c.full, c.empty)}
    smem = tuple(replace(b, shape=(stages,) + b.shape[1:]) if b.name in buffers else b for b in kernel.smem)
    barriers = tuple(replace(b, slots=stages) if b.name in barrier_names else b for b in kernel.barriers)
    k_stop = next(s.stop for s in ir.walk(kernel.body) if isinstance(s, ir.For) and s.var == K_VAR)
    # Every tile runs the same k iterations when the k loop's bound is a kernel-level value.
    kernel_level = {p.name for p in kernel.params} | {s.name for s in kernel.body if isinstance(s, ir.Let)}
    uniform = set(ir.expr_vars(k_stop)) <= kernel_level
    stage = V("s")

    def restage(stmt):
        if isinstance(stmt, ir.TmaLoad) and stmt.dst.buffer in buffers:
            return replace(stmt, dst=_at_stage(stmt.dst, stage), bar=replace(stmt.bar, index=stage))
        if isinstance(stmt, ir.Wgmma):
            a = _at_stage(stmt.a, stage) if isinstance(stmt.a, ir.SmemRef) and stmt.a.buffer in buffers else stmt.a
            b = _at_stage(stmt.b, stage) if stmt.b.buffer in buffers else stmt.b
            return replace(stmt, a=a, b=b)
        return None

    def add_counter(loop: ir.For):
        base = ir.mul("tile_iter", k_stop) if uniform else V(K_BASE)
        return replace(loop, body=ring_position(ir.add(base, K_VAR), stages) + loop.body)

    def add_tile_iter(loop: ir.For):
        # the how-manieth tile of this CTA (of its cluster, when a cluster walks the tiles together)
        local = ir.Let("tile_iter", ir.div(ir.sub(TILE_VAR, loop.start), loop.step))
        advance = () if uniform else (ir.Assign(K_BASE, ir.add(K_BASE, k_stop)),)
        tile_loop = replace(loop, body=(local,) + loop.body + advance)
        return tile_loop if uniform else (ir.Let(K_BASE, ir.IntConst(0), mutable=True), tile_loop)

    body = transform(kernel.body, restage)
    body = map_loop(body, K_VAR, add_counter)
    body = map_loop(body, TILE_VAR, add_tile_iter)
    return replace(kernel, smem=smem, barriers=barriers, body=body)


def ring_position(it: ir.Expr, stages: int) -> tuple[ir.Stmt, ...]:
    """`let it`, and the stage `s` and phase parity `ph` the ring's it-th use takes."""
    return (ir.Let("it", it), ir.Let("s", ir.mod("it", stages)), ir.Let("ph", ir.band(ir.div("it", stages), 1)))


def _at_stage(ref: ir.SmemRef, stage: ir.Expr) -> ir.SmemRef:
    return replace(ref, index=(stage,) + ref.index[1:])
