"""lower_mma: the wgmma protocol around each MMA, and the consumer's release point.

wgmma is asynchronous: `wgmma.fence` orders the accumulator's register traffic before it,
`wgmma.commit` closes a group, `wgmma.wait n` leaves at most n groups in flight. A stage may be
released only when no wgmma reading it is pending. With `mma_inflight = 1` one group stays in
flight across iterations, so iteration k releases the stage of iteration k - 1 and the tile's
last stage is released after the loop's final `wgmma.wait 0`.

Which of the two applies is read from the k loop. The wgmmas of a k step that read only shared
memory, issued back to back, each accumulating into an accumulator of its own zero-filled just
before the loop (matmul: one per 64-row block of a warpgroup's rows), depend on nothing else in
their iteration: they are one group, which may stay in flight (`mma_inflight`), and the first k
step overwrites the accumulators (accumulate(k > 0)) so the zero fills go. Several wgmmas per k step feed each other through
registers (attention: S = Q K^T, softmax, O += P V): each is waited for at once and keeps its
accumulate flag; overlapping them is a reordering a workload pass makes afterwards.

    before:  tile.fill acc, 0.0
             for k ... { mbarrier.wait full[s] phase(ph)
                         wgmma.mma acc, A[s, wg], B[s] major(k, k) accumulate(1)
                         mbarrier.arrive empty[s] }
    after (mma_inflight = 1):
             for k ... { mbarrier.wait full[s] phase(ph)
                         wgmma.fence
                         wgmma.mma acc, A[s, wg], B[s] major(k, k) accumulate(k > 0)
                         wgmma.commit
                         wgmma.wait 1
                         if k > 0 { let prev_s = (it - 1) % 4
                                    mbarrier.arrive empty[prev_s] } }
             wgmma.wait 0
             let last_s = ((tile_iter * k_tiles) + k_tiles - 1) % 4
             mbarrier.arrive empty[last_s]
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import CONSUMER, K_VAR, TILE_VAR

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_loop, map_role

V = ir.Var
C = ir.IntConst


def one_group(body: tuple[ir.Stmt, ...]) -> bool:
    """Whether a k step's wgmmas are one group, which may stay in flight across steps: they read
    only shared memory, each into an accumulator of its own, issued back to back (matmul: one per
    64-row block of the warpgroup's rows). Otherwise each wgmma is waited for at once."""
    mmas = [s for s in body if isinstance(s, ir.Wgmma)]
    at = [i for i, s in enumerate(body) if isinstance(s, ir.Wgmma)]
    return (bool(mmas) and all(isinstance(m.a, ir.SmemRef) for m in mmas) and len({m.acc for m in mmas}) == len(mmas)
            and at == list(range(at[0], at[0] + len(at))))


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    stages = ctx.schedule.stages
    consumer_role = next(r for r in kernel.roles() if r.name == CONSUMER)
    k_loop = next(s for s in ir.walk(consumer_role.body) if isinstance(s, ir.For) and s.var == K_VAR)
    mmas = [s for s in k_loop.body if isinstance(s, ir.Wgmma)]
    at = [i for i, s in enumerate(k_loop.body) if isinstance(s, ir.Wgmma)]
    single = one_group(k_loop.body)
    inflight = ctx.schedule.mma_inflight if single else 0
    accs: set[str] = set()
    empty = it_base = None
    if single:
        reads = {m.b.buffer for m in mmas} | {m.a.buffer for m in mmas}
        accs = {m.acc for m in mmas}
        # The k-level channel the wgmmas read: its stage is the one released one step late.
        empty = next(c.empty for c in ctx.channels("k") if reads & set(c.buffers))
        # The ring counter's value before the tile's first k step (circular_buffer's `it`).
        it_base = next(s.value.lhs for s in k_loop.body if isinstance(s, ir.Let) and s.name == "it")

    def k_body(loop: ir.For) -> ir.For:
        out: list[ir.Stmt] = []
        for i, s in enumerate(loop.body):
            if isinstance(s, ir.Wgmma) and single:
                first, last = i == at[0], i == at[-1]
                out += ([ir.WgmmaFence()] if first else []) + [replace(s, accumulate=ir.BinOp(">", V(K_VAR), C(0)))]
                out += [ir.WgmmaCommit(), ir.WgmmaWait(inflight)] if last else []
            elif isinstance(s, ir.Wgmma):
                out += [ir.WgmmaFence(), s, ir.WgmmaCommit(), ir.WgmmaWait(inflight)]
            elif isinstance(s, ir.MbarrierArrive) and s.bar.barrier == empty and inflight:
                prev = ir.Let("prev_s", ir.mod(ir.sub("it", 1), stages))
                out.append(ir.If(ir.BinOp(">", V(K_VAR), C(0)),
                                 (prev, ir.MbarrierArrive(ir.BarRef(empty, V("prev_s"))))))
            else:
                out.append(s)
        return replace(loop, body=tuple(out))

    def tile_body(loop: ir.For) -> ir.For:
        out: list[ir.Stmt] = []
        for s in loop.body:
            if isinstance(s, ir.TileFill) and s.dst in accs:
                continue
            out.append(s)
            if isinstance(s, ir.For) and s.var == K_VAR and inflight:
                last = ir.mod(ir.sub(ir.add(it_base, k_loop.stop), 1), stages)
                out += [ir.WgmmaWait(0), ir.Let("last_s", last),
                        ir.MbarrierArrive(ir.BarRef(empty, V("last_s")))]
        return replace(loop, body=tuple(out))

    def consumer(role: ir.Role) -> ir.Role:
        body = map_loop(role.body, K_VAR, k_body)
        return replace(role, body=map_loop(body, TILE_VAR, tile_body) if single else body)

    return map_role(kernel, CONSUMER, consumer)
