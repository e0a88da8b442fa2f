"""pingpong: alternate the two consumer warpgroups' wgmma issue (attention, mode="pingpong").

With overlap_softmax each warpgroup issues S_k = Q K_k^T and O += P_{k-1} V_{k-1} together and
then runs a softmax. Two named barriers pass a token so that one warpgroup issues its GEMMs
while the other is in its softmax (FlashAttention-3's inter-warpgroup ping-pong): warpgroup w
waits on barrier 3 + w before issuing and, once issued, arrives on the other's barrier. Each
barrier counts 256 threads: the waiting warpgroup's 128 plus the other's 128 arrivals.
Warpgroup 1 arrives once up front, so warpgroup 0 goes first; warpgroup 0 takes that extra
credit back after its last tile, leaving both barriers balanced at exit.

    after (consumer):
      if wg == 1 { bar.arrive 3, 256 }
      for tile ... { for k ... {
          mbarrier.wait k_full[s] phase(ph)
          bar.sync 3 + wg, 256
          wgmma.fence; wgmma.mma s_acc ...; wgmma.commit; if k > 0 { ... P V ... }; wgmma.commit
          bar.arrive 4 - wg, 256
          wgmma.wait 1 ... softmax ... } }
      if wg == 0 { bar.sync 3, 256 }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.lowering import ir
from wsched.lowering.context import LoweringContext
from wsched.lowering.rewrite import map_loop, map_role
from wsched.names import CONSUMER, K_VAR, TILE_VAR, TOKEN_BARRIER

FIRST_BARRIER = TOKEN_BARRIER   # ids below it: syncthreads and each warpgroup's own barrier
THREADS = 256       # both consumer warpgroups


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    wg = ir.Var("wg")
    mine = ir.NamedBarrierSync(ir.add(FIRST_BARRIER, wg), THREADS)
    theirs = ir.NamedBarrierArrive(ir.sub(FIRST_BARRIER + 1, wg), THREADS)

    def k_body(loop: ir.For) -> ir.For:
        body = list(loop.body)
        issue = next(i for i, s in enumerate(body) if isinstance(s, ir.WgmmaFence))
        waited = next(i for i, s in enumerate(body) if isinstance(s, ir.WgmmaWait))
        body[waited:waited] = [theirs]
        body[issue:issue] = [mine]
        return replace(loop, body=tuple(body))

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, K_VAR, k_body)
        decls = tuple(s for s in body if isinstance(s, ir.RegDecl))
        rest = tuple(s for s in body if not isinstance(s, ir.RegDecl))
        first = ir.If(ir.eq(wg, 1), (ir.NamedBarrierArrive(ir.IntConst(FIRST_BARRIER), THREADS),))
        last = ir.If(ir.eq(wg, 0), (ir.NamedBarrierSync(ir.IntConst(FIRST_BARRIER), THREADS),))
        assert any(isinstance(s, ir.For) and s.var == TILE_VAR for s in rest)
        return replace(role, body=decls + (first,) + rest + (last,))

    return map_role(kernel, CONSUMER, consumer)
