"""overlap_softmax: attention's intra-warpgroup pipelining (FlashAttention-3 style).

After lower_mma each kv block runs S = Q K^T, softmax, O += P V back to back, each wgmma
waited for at once. With `mma_inflight = 1` this pass delays the P V product by one block:
block k issues S_k = Q K_k^T and O += P_{k-1} V_{k-1} together, waits only for S_k, runs the
softmax of block k while P_{k-1} V_{k-1} is still on the tensor cores, then waits for it,
rescales O and turns S_k into P_k. The last block's P V runs after the loop.

    before (per kv block k):
      mbarrier.wait k_full[s] phase(ph); wgmma.fence; wgmma.mma s_acc, Q, K[s] ...; wgmma.commit
      wgmma.wait 0; mbarrier.arrive k_empty[s]
      <softmax> ; tile.mul o_acc, o_acc, corr ; tile.cast p, s_acc
      mbarrier.wait v_full[s] phase(ph); wgmma.fence; wgmma.mma o_acc, p, V[s] ...; wgmma.commit
      wgmma.wait 0; mbarrier.arrive v_empty[s]
    after:
      let prev_it = it - 1 ; let prev_s = ... ; let prev_ph = ...
      mbarrier.wait k_full[s] phase(ph); wgmma.fence; wgmma.mma s_acc, Q, K[s] ...; wgmma.commit
      if k > 0 { mbarrier.wait v_full[prev_s] phase(prev_ph); wgmma.mma o_acc, p, V[prev_s] ... }
      wgmma.commit                      # (an empty group when k = 0: wait 1 still means S_k)
      wgmma.wait 1; mbarrier.arrive k_empty[s]
      <softmax>
      wgmma.wait 0
      if k > 0 { mbarrier.arrive v_empty[prev_s] }
      tile.mul o_acc, o_acc, corr ; tile.cast p, s_acc
    and after the kv loop:
      if kv_tiles > 0 { <the last block's P V, waited for, its stage released> }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.lowering.rewrite import map_loop, map_role
from wsched.names import CONSUMER, K_BASE, K_COUNT, K_VAR, TILE_VAR

V = ir.Var
C = ir.IntConst


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    stages = ctx.schedule.stages

    def split(body: tuple[ir.Stmt, ...]):
        """(lets, S section, softmax, O rescale + P cast, P V section) of a kv block."""
        mmas = [i for i, s in enumerate(body) if isinstance(s, ir.Wgmma)]
        first_s, pv = mmas
        s_start = next(i for i in range(first_s, -1, -1) if isinstance(body[i], ir.MbarrierWait))
        s_end = next(i for i in range(first_s, len(body)) if isinstance(body[i], ir.MbarrierArrive))
        v_start = next(i for i in range(pv, -1, -1) if isinstance(body[i], ir.MbarrierWait))
        lets = body[:s_start]
        s_section = body[s_start:s_end + 1]
        middle = body[s_end + 1:v_start]
        tail = tuple(x for x in middle if _writes(x, ("o_acc", "p")))
        softmax = tuple(x for x in middle if not _writes(x, ("o_acc", "p")))
        return lets, s_section, softmax, tail, body[v_start:]

    def pv_at(section: tuple[ir.Stmt, ...], stage: ir.Expr, phase: ir.Expr) -> tuple[ir.Stmt, ...]:
        """The P V section with its V stage and phase replaced."""
        def fix(s):
            if isinstance(s, ir.MbarrierWait):
                return replace(s, bar=replace(s.bar, index=stage), phase=phase)
            if isinstance(s, ir.MbarrierArrive):
                return replace(s, bar=replace(s.bar, index=stage))
            if isinstance(s, ir.Wgmma):
                return replace(s, b=replace(s.b, index=(stage,) + s.b.index[1:]))
            return s
        return tuple(fix(s) for s in section)

    after_loop: list[ir.Stmt] = []

    def k_body(loop: ir.For) -> ir.For:
        lets, s_section, softmax, tail, pv = split(loop.body)
        s_issue = tuple(x for x in s_section if not isinstance(x, (ir.WgmmaWait, ir.MbarrierArrive)))
        k_release = tuple(x for x in s_section if isinstance(x, ir.MbarrierArrive))
        pv = pv_at(pv, V("prev_s"), V("prev_ph"))
        pv_issue = tuple(x for x in pv if isinstance(x, (ir.MbarrierWait, ir.Wgmma)))
        v_release = tuple(x for x in pv if isinstance(x, ir.MbarrierArrive))
        previous = (ir.Let("prev_it", ir.sub("it", 1)),
                    ir.Let("prev_s", ir.mod("prev_it", stages)),
                    ir.Let("prev_ph", ir.band(ir.div("prev_it", stages), 1)))
        later = ir.BinOp(">", V(K_VAR), C(0))
        body = (lets + previous + s_issue
                + (ir.If(later, pv_issue), ir.WgmmaCommit(), ir.WgmmaWait(1)) + k_release
                + softmax + (ir.WgmmaWait(0), ir.If(later, v_release)) + tail)
        last = ir.sub(ir.add(K_BASE, K_COUNT), 1)
        after_loop[:] = [ir.If(ir.BinOp(">", V(K_COUNT), C(0)), (
            ir.Let("last_it", last),
            ir.Let("last_s", ir.mod("last_it", stages)),
            ir.Let("last_ph", ir.band(ir.div("last_it", stages), 1)),
        ) + pv_at(pv, V("last_s"), V("last_ph")))]
        return replace(loop, body=body)

    def tile_body(loop: ir.For) -> ir.For:
        out: list[ir.Stmt] = []
        for s in loop.body:
            out.append(s)
            if isinstance(s, ir.For) and s.var == K_VAR:
                out += after_loop
        return replace(loop, body=tuple(out))

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, K_VAR, k_body)
        return replace(role, body=map_loop(body, TILE_VAR, tile_body))

    return map_role(kernel, CONSUMER, consumer)


def _writes(s: ir.Stmt, tiles: tuple[str, ...]) -> bool:
    return isinstance(s, (ir.TileUnary, ir.TileBinary)) and s.dst in tiles

