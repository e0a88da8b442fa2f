"""cluster: the barrier protocol of a cluster whose CTAs multicast their loads to each other.

build_loops gave the kernel `cluster(n, 1, 1)` and split the tile the cluster's CTAs share into n
pieces, each CTA loading one and multicasting it to all (`tma.load ... multicast(mask)`). A
stage of such a channel is then written by every producer of the cluster, so it is free only
once the consumers of every CTA have read it:

    setup     mbarrier.init <empty> arrivals(consumers x n)         every CTA's consumers count
              (insert_barriers already made the inits visible to the peers: cluster.sync)
    consumer  mbarrier.arrive empty[s] cta(0) ... cta(n - 1)        consumer_release, to each CTA
    producer  after its tile loop, the tail: for each stage, wait for the phase that frees its
              last use (`mbarrier.wait empty[s] phase(ph ^ 1)` at it = the CTA's iteration count
              + 0 .. stages - 1), so that no peer arrives on the barriers of a CTA that has exited

The full barriers need nothing more: a CTA's producer announces the stage's whole bytes, which
its own and its peers' pieces deliver (the tx count may run ahead of the announcement).

    before:  mbarrier.init empty arrivals(2); fence.mbarrier_init; cluster.sync
             ... mbarrier.arrive empty[prev_s] ...
    after:   mbarrier.init empty arrivals(4); fence.mbarrier_init; cluster.sync
             ... mbarrier.arrive empty[prev_s] cta(0); mbarrier.arrive empty[prev_s] cta(1) ...
             role producer { elect_one { for tile ... { ... }
                                         let tail_it = ceil_div(max(num_tiles - cluster_id, 0),
                                                                num_clusters) * k_tiles
                                         for i in serial(0, 4, 1) { let it = tail_it + i; ...
                                           mbarrier.wait empty[s] phase(ph ^ 1) } } }
"""

from __future__ import annotations

from dataclasses import replace

from wsched.names import CONSUMER, K_BASE, K_VAR, PRODUCER, TILE_VAR

from .. import ir
from ..context import LoweringContext
from ..rewrite import map_role, transform
from .circular_buffer import ring_position
from .insert_barriers import producer_acquire

V = ir.Var
C = ir.IntConst

TAIL_VAR = "tail"


def run(kernel: ir.Kernel, ctx: LoweringContext) -> ir.Kernel:
    n = kernel.cluster[0]
    fulls = {s.bar.barrier for s in ir.walk(kernel.body) if isinstance(s, ir.TmaLoad) and s.multicast is not None}
    shared = [c for c in ctx.channels() if c.full in fulls]
    empties = {c.empty for c in shared}
    if n == 1 or not empties:
        return kernel

    def setup(s):
        if isinstance(s, ir.MbarrierInit) and s.barrier in empties:
            return replace(s, arrivals=s.arrivals * n)
        return None

    kernel = replace(kernel, body=transform(kernel.body, setup))

    def release(s):
        if isinstance(s, ir.MbarrierArrive) and s.bar.barrier in empties and s.cta is None:
            return tuple(replace(s, cta=C(r)) for r in range(n))
        return None

    kernel = map_role(kernel, CONSUMER, lambda r: replace(r, body=transform(r.body, release)))
    slots = {b.name: b.slots for b in kernel.barriers}
    return map_role(kernel, PRODUCER, lambda r: replace(r, body=transform(
        r.body, lambda s: _with_tail(s, sorted(empties), slots) if isinstance(s, ir.ElectOne) else None)))


def _with_tail(elect: ir.ElectOne, empties: list[str], slots: dict[str, int]) -> ir.ElectOne:
    """The producer's tail after its tile loop: wait, for every stage of each shared channel, for
    the phase in which the consumers of the whole cluster free its last use."""
    at = next(i for i, s in enumerate(elect.body) if isinstance(s, ir.For) and s.var == TILE_VAR)
    # lower_tma puts the producer's whole nest, a running k_base included, in its elect_one
    assert not any(isinstance(s, ir.Let) and s.name == K_BASE for s in ir.walk(elect.body[at:at + 1])), \
        "k_base is declared before the tile loop"
    loop = elect.body[at]
    k_loop = next(s for s in ir.walk(loop.body) if isinstance(s, ir.For) and s.var == K_VAR)
    counted = any(isinstance(s, ir.Let) and s.name == K_BASE for s in elect.body[:at])
    if counted:     # the running base the k loops advance (a k bound that varies per tile)
        done: ir.Expr = V(K_BASE)
    else:           # every tile runs k_stop steps; the loop runs ceil((stop - start) / step) tiles
        tiles = ir.ceil_div(ir.emax(ir.sub(loop.stop, loop.start), 0), loop.step)
        done = ir.mul(tiles, k_loop.stop)
    tail: list[ir.Stmt] = [ir.Let("tail_it", done)]
    for name in empties:
        stages = slots[name]
        tail.append(ir.For(TAIL_VAR, C(0), C(stages), C(1), "serial", (
            *ring_position(ir.add("tail_it", TAIL_VAR), stages),
            producer_acquire(name, V("s"), V("ph")),
        )))
    return replace(elect, body=elect.body[:at + 1] + tuple(tail) + elect.body[at + 1:])
