"""insert_barriers: the full/empty mbarrier protocol of every channel.

    setup     mbarrier.init <full> arrivals(1); mbarrier.init <empty> arrivals(consumers); ...
              fence.mbarrier_init; syncthreads (cluster.sync in a kernel with a cluster)
    producer  producer_acquire: mbarrier.wait empty[s] phase(ph ^ 1)   (the first pass is free)
              producer_commit:  mbarrier.arrive_expect_tx full[s] bytes(<stage bytes>), then loads
    consumer  consumer_wait:    mbarrier.wait full[s] phase(ph)   before the first reader
              consumer_release: mbarrier.arrive empty[s]          after the last reader
                                (lower_mma then puts the wgmma wait that frees it in between)

A channel stepped by the k loop uses that loop's stage `s` and phase `ph`; a channel loaded once
per tile (attention's Q, one slot) uses slot 0 and phase tile_iter & 1, around the k loop. Its
release comes as early as its last read allows: where a wgmma at the top of the k loop's body
reads it, in the loop's last step after that wgmma's own releases (`if k + 1 == kv_tiles`), so
the producer loads the next tile's Q while the last block's softmax, its P V and the epilogue
run (measured on an H100: 1.00-1.08x on plain prefill, 0.94-1.04x with score functions;
docs/benchmarks.md, tenth session); a tile whose loop runs no step
releases it after the loop (`if kv_tiles == 0`).

The release is one thread's arrival, so every thread of the warpgroup must have passed the wait
before it: otherwise the producer can complete the barrier's next phase too, and a warp still
waiting for parity p sees p again and waits one phase behind for ever (a GPU hang the fuzzer found
for attention tiles whose kv loop runs no iteration). A wgmma between wait and release converges
the warpgroup; when the last reader is a loop, which may run no iteration, the release is preceded
by the warpgroup's own barrier (`bar.sync 1 + wg, 128`).

    before:  for k ... { let it ...; tma.load A[s] <- ...; tma.load B[s] <- ... }
    after:   for k ... { let it ...; mbarrier.wait empty[s] phase(ph ^ 1)
                         mbarrier.arrive_expect_tx full[s] bytes(49152)
                         tma.load A[s] <- ...; tma.load B[s] <- ... }

    consumer, a tile-level channel (Q) read in every k step:
             mbarrier.wait q_full[0] phase(tile_iter & 1)
             for k ... { ...; wgmma.mma s_acc, Q[0, wg], K[s] ...; mbarrier.arrive k_empty[s]
                         if k + 1 == kv_tiles { mbarrier.arrive q_empty[0] }  ... }
             if kv_tiles == 0 { bar.sync 1 + wg, 128; mbarrier.arrive q_empty[0] }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import CONSUMER, K_VAR, PRODUCER, TILE_VAR, WARPGROUP_BARRIER
from wsched.target import WARPGROUP_THREADS

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_loop, map_role
from . import lower_mma

V = ir.Var
C = ir.IntConst


def _reads(stmt: ir.Stmt, buffers: set[str]) -> bool:
    """Does `stmt` (or anything nested in it) read one of the channel's buffers with a wgmma?"""
    for s in ir.walk((stmt,)):
        if isinstance(s, ir.Wgmma):
            refs = [s.b] + ([s.a] if isinstance(s.a, ir.SmemRef) else [])
            if any(r.buffer in buffers for r in refs):
                return True
    return False


def _loads(stmt: ir.Stmt, buffers: set[str]) -> bool:
    return isinstance(stmt, ir.TmaLoad) and stmt.dst.buffer in buffers


def _slot(channel, level: str) -> tuple[ir.Expr, ir.Expr]:
    """(slot, phase parity) a channel uses at its loop level."""
    if level == "k":
        return V("s"), V("ph")
    return C(0), ir.band("tile_iter", 1)


def producer_acquire(empty: str, slot: ir.Expr, phase: ir.Expr) -> ir.MbarrierWait:
    """Wait until the consumers have freed the slot's previous use (the first pass is free)."""
    return ir.MbarrierWait(ir.BarRef(empty, slot), ir.BinOp("^", phase, C(1)))


def _producer(body: tuple[ir.Stmt, ...], channels, level) -> tuple[ir.Stmt, ...]:
    out: list[ir.Stmt] = []
    started: set[str] = set()
    for s in body:
        for c in channels:
            if c.name not in started and _loads(s, set(c.buffers)):
                slot, phase = _slot(c, level)
                out += [producer_acquire(c.empty, slot, phase),
                        ir.MbarrierArriveExpectTx(ir.BarRef(c.full, slot), C(c.bytes_per_stage))]
                started.add(c.name)
        out.append(s)
    return tuple(out)


def _consumer(body: tuple[ir.Stmt, ...], channels, level) -> tuple[ir.Stmt, ...]:
    waits: dict[int, list[ir.Stmt]] = {}
    releases: dict[int, list[ir.Stmt]] = {}
    early: dict[int, tuple[list[ir.Stmt], set[str]]] = {}   # loop -> (its last step's releases, their buffers)
    for c in channels:
        readers = [i for i, s in enumerate(body) if _reads(s, set(c.buffers))]
        if not readers:
            continue
        slot, phase = _slot(c, level)
        waits.setdefault(readers[0], []).append(ir.MbarrierWait(ir.BarRef(c.full, slot), phase))
        release = releases.setdefault(readers[-1], [])
        arrive = ir.MbarrierArrive(ir.BarRef(c.empty, slot))
        last = body[readers[-1]]
        if isinstance(last, ir.For) and _reads_every_step(last, set(c.buffers)):
            # Free the buffer in the loop's last step, once its wgmma has read it, so the producer
            # loads the next tile's while this one's last steps and epilogue run; a loop that runs
            # no step frees it after the warpgroup's own barrier.
            arrives, buffers = early.setdefault(readers[-1], ([], set()))
            arrives.append(arrive)
            buffers.update(c.buffers)
            release += [ir.If(ir.BinOp("==", last.stop, C(0)), (
                ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS), arrive))]
            continue
        if isinstance(last, ir.For) and not release:
            release.append(ir.NamedBarrierSync(ir.add(WARPGROUP_BARRIER, "wg"), WARPGROUP_THREADS))
        release.append(arrive)
    out: list[ir.Stmt] = []
    for i, s in enumerate(body):
        if i in early:
            s = _release_in_last_step(s, *early[i])
        out += waits.get(i, []) + [s] + releases.get(i, [])
    return tuple(out)


def _reads_every_step(loop: ir.For, buffers: set[str]) -> bool:
    """Whether the loop's last step holds its last read of the buffers, right after which they
    may be released: the loop counts 0, 1, ... (so `stop == 0` means no step ran), its body reads
    them only in wgmmas at its top (not under an `if` or in an inner loop), and lower_mma waits
    for each of those wgmmas in its step (not one group kept in flight into the next step,
    `lower_mma.one_group`)."""
    readers = [s for s in loop.body if _reads(s, buffers)]
    return (loop.start == C(0) and loop.step == C(1) and bool(readers)
            and all(isinstance(s, ir.Wgmma) for s in readers) and not lower_mma.one_group(loop.body))


def _release_in_last_step(loop: ir.For, arrives: list[ir.Stmt], buffers: set[str]) -> ir.For:
    """`if k + 1 == stop { <arrives> }` after the loop body's last wgmma reading the buffers and
    the releases that follow it (lower_mma puts that wgmma's wait before them)."""
    body = list(loop.body)
    at = max(i for i, s in enumerate(body) if isinstance(s, ir.Wgmma) and _reads(s, buffers))
    at += 1
    while at < len(body) and isinstance(body[at], ir.MbarrierArrive):
        at += 1
    last = ir.If(ir.BinOp("==", ir.add(loop.var, 1), loop.stop), tuple(arrives))
    return replace(loop, body=tuple(body[:at]) + (last,) + tuple(body[at:]))


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    nwg = ctx.schedule.consumer_warpgroups
    for level, var in (("k", K_VAR), ("tile", TILE_VAR)):
        channels = ctx.channels(level)
        if not channels:
            continue
        kernel = map_role(kernel, PRODUCER, lambda r, ch=channels, lv=level, v=var: replace(
            r, body=map_loop(r.body, v, lambda loop: replace(loop, body=_producer(loop.body, ch, lv)))))
        kernel = map_role(kernel, CONSUMER, lambda r, ch=channels, lv=level, v=var: replace(
            r, body=map_loop(r.body, v, lambda loop: replace(loop, body=_consumer(loop.body, ch, lv)))))
    init: list[ir.Stmt] = []
    for c in ctx.channels():
        init += [ir.MbarrierInit(c.full, 1), ir.MbarrierInit(c.empty, nwg)]
    # a cluster's CTAs reach each other's barriers: the inits must be visible to the peers too
    init += [ir.FenceMbarrierInit(), ir.ClusterSync() if kernel.cluster[0] > 1 else ir.SyncThreads()]
    first_role = next(i for i, x in enumerate(kernel.body) if isinstance(x, ir.Role))
    return replace(kernel, body=kernel.body[:first_role] + tuple(init) + kernel.body[first_role:])
