"""The simulator's synchronisation handlers (mixed into `machine.Machine`): mbarrier
init / inval / arrive / arrive_expect_tx / wait with phases and tx-counts, arrivals on a peer
CTA's barriers (`cta(r)`), the mbarrier and proxy fences, named barriers (bar.sync / bar.arrive,
counted in warps), syncthreads and cluster.sync. Every release publishes the agent's vector
clock and every passing wait acquires it, for the race checks; a barrier of the whole warpgroup
also carries what its elected thread knows."""

from __future__ import annotations

from wsched.target import (MBARRIER_MAX_ARRIVALS, MBARRIER_MAX_TX_BYTES, NAMED_BARRIERS, WARP_THREADS,
                           WARPGROUP_THREADS)

from .. import ir
from ..spelling import keyword
from .errors import PRODUCER_TAIL, ProtocolError, check_verified
from .state import BarrierGeneration, Cluster, Co, Cta, Ctx, MBarrier, Node
from .text import loops_text


class BarrierHandlers:
    """mbarriers, fences, named barriers and syncthreads; uses `Machine`'s `_int`, `_park`,
    `wake`, `report` and `kernel`."""

    # mbarriers
    def _barrier(self, co: Co, node: Node, name: str, index, cta: "Cta | None" = None) -> MBarrier:
        """Barrier `name[index]` of `co`'s CTA, or of `cta`, a peer in its cluster: initialised,
        with its init known to the agent (a peer learns it by cluster.sync)."""
        target = cta or co.cta
        slots = target.bars.get(name)
        check_verified(slots is not None, "a barrier reference names a declared barrier")
        index = self._int(co, node, index, "barrier index")
        if not 0 <= index < len(slots):
            raise ProtocolError(f"barrier index {name}[{index}] out of range (barrier {name}[{len(slots)}]): "
                                f"{co.where(node)}")
        bar = slots[index]
        if target is not co.cta:    # one message whichever comes first, the init or the use
            if bar is None or co.agent().vc.get(bar.init_co, 0) < bar.init_epoch:
                raise ProtocolError(f"mbarrier {name}[{index}] of CTA {target.cta_id} used before its mbarrier.init "
                                    f"is visible to this warpgroup of CTA {co.cta.cta_id} (missing cluster.sync after "
                                    f"fence.mbarrier_init?): {co.where(node)}")
            return bar
        if bar is None:
            raise ProtocolError(f"mbarrier {name}[{index}] used before mbarrier.init: {co.where(node)}")
        if co.agent().vc.get(bar.init_co, 0) < bar.init_epoch:
            raise ProtocolError(f"mbarrier {name}[{index}] used before its mbarrier.init is visible to this "
                                f"warpgroup (missing syncthreads after mbarrier.init?): {co.where(node)}")
        return bar

    def _h_MbarrierInit(self, co, node):
        s = node.stmt
        slots = co.cta.bars.get(s.barrier)
        check_verified(slots is not None and 1 <= s.arrivals <= MBARRIER_MAX_ARRIVALS,
                       "mbarrier.init names a declared barrier, with an arrival count mbarrier.init accepts")
        for i, old in enumerate(slots):
            if old is not None:
                raise ProtocolError(f"mbarrier.init on {s.barrier}[{i}], which is already initialised "
                                    f"(missing mbarrier.inval?): {co.where(node)}")
            slots[i] = MBarrier(f"{s.barrier}[{i}]", co.cta.cta_id, s.arrivals, co)

    def _h_MbarrierInval(self, co, node):
        slots = co.cta.bars.get(node.stmt.barrier)
        check_verified(slots is not None, "mbarrier.inval names a declared barrier")
        for i, bar in enumerate(slots):
            if bar is not None and (bar.waiters or bar.inflight):
                raise ProtocolError(f"mbarrier.inval of {bar.label} while it has waiters or TMA loads in "
                                    f"flight: {co.where(node)}")
            slots[i] = None

    def _arrive(self, co: Co, bar: MBarrier) -> None:
        co.agent().release(bar.arrive_know)
        bar.pending -= 1
        self._settle(bar, co.where())

    def _settle(self, bar: MBarrier, where) -> None:
        """After an arrival or a landed load: the phase completes once every arrival is in and tx
        is zero. tx may run below zero while arrivals are pending (a peer's multicast can land
        before this CTA's arrive_expect_tx), not once they are all in."""
        if bar.pending > 0:
            return
        if bar.tx == 0:
            self._complete_phase(bar)
        elif bar.tx < 0:
            raise ProtocolError(f"expect_tx mismatch on {bar.label} (CTA {bar.cta_id}): expected {bar.expected} "
                                f"bytes, TMA delivered {bar.issued} (more bytes than the phase's "
                                f"mbarrier.arrive_expect_tx announced): {where}")

    def _complete_phase(self, bar: MBarrier) -> None:
        while bar.pending <= 0 and bar.tx == 0:
            carry = -bar.pending  # arrivals beyond this phase count toward the next one
            bar.history[bar.completed] = (bar.expected, bar.issued)
            bar.history.pop(bar.completed - 8, None)
            bar.completed += 1
            bar.parity ^= 1
            know = bar.know
            for key, value in bar.arrive_know.items():
                if know.get(key, 0) < value:
                    know[key] = value
            know[bar] = bar.completed
            bar.arrive_know = {}
            bar.pending = bar.arrivals - carry
            bar.expected = bar.issued = 0
            self.report.barrier_phases += 1
            self.wake(bar.waiters)
            if carry == 0:
                break

    def _h_MbarrierArrive(self, co, node):
        self._arrive(co, self._barrier(co, node, node.stmt.bar.barrier, node.ex[0](co.env)))

    # clusters: a peer's barriers (`mbarrier.arrive ... cta(r)`, `tma.load ... multicast(mask)`)
    def _peer_rank(self, co: Co, node: Node, value) -> Cta:
        """The CTA of rank `value` in `co`'s cluster."""
        rank = self._int(co, node, value, "cta rank")
        problem = ir.cluster_operand_problem("cta", rank, self.cluster_size)
        if problem:
            raise ProtocolError(f"{problem}: {co.where(node)}")
        return co.cta.cluster.ctas[rank]

    def _peer_barrier(self, co: Co, node: Node, name: str, index, target: Cta, smem: str | None = None) -> MBarrier:
        """Barrier `name[index]` of the CTA `target` of `co`'s cluster (its own CTA included) for an
        arrival (or a multicast into `smem`), the CTA still running (`_barrier` checks the rest)."""
        if target.exited:   # the exit check's message (`Machine._check_peers_known`), for what comes after
            index = self._int(co, node, index, "barrier index")
            what = (f"the arrival on its barrier {name}[{index}]" if smem is None
                    else f"the multicast into its smem {smem}")
            raise ProtocolError(f"CTA {target.cta_id} exits before it knows of {what} by {co.where(node)}, which "
                                f"comes after CTA {target.cta_id} (rank {target.rank} of the cluster) exited: "
                                f"{PRODUCER_TAIL}")
        return self._barrier(co, node, name, index, target)

    def _h_remote_arrive(self, co, node):
        """`mbarrier.arrive b[i] cta(r)`: the arrival lands on b[i] of the CTA of rank r."""
        env = co.env
        target = self._peer_rank(co, node, node.ex[2](env))
        bar = self._peer_barrier(co, node, node.stmt.bar.barrier, node.ex[0](env), target)
        if target is not co.cta:   # the phase this arrival joins: the target must see it complete
            target.peer_arrivals[bar] = (bar.completed, Ctx(co, node), bar.label)
        self._arrive(co, bar)

    def _h_MbarrierArriveExpectTx(self, co, node):
        bar = self._barrier(co, node, node.stmt.bar.barrier, node.ex[0](co.env))
        nbytes = self._int(co, node, node.ex[1](co.env), "expect_tx bytes")
        if nbytes < 0 or bar.tx + nbytes > MBARRIER_MAX_TX_BYTES:
            raise ProtocolError(f"expect_tx of {nbytes} bytes takes {bar.label}'s tx-count out of "
                                f"[0, 2^20): {co.where(node)}")
        bar.tx += nbytes
        bar.expected += nbytes
        bar.expect_phase[co] = bar.completed
        self._arrive(co, bar)

    def _h_MbarrierWait(self, co, node):
        env = co.env
        bar = self._barrier(co, node, node.stmt.bar.barrier, node.ex[0](env))
        parity = node.ex[1](env)
        if parity not in (0, 1) or type(parity) is not int:
            raise ProtocolError(f"mbarrier.wait phase must be 0 or 1, got {parity!r}: {co.where(node)}")
        if bar.parity != parity:
            co.agent().acquire(bar.know)
            return None
        return self._wait_mbarrier(co, node, bar, parity)

    def _wait_mbarrier(self, co, node, bar, parity):
        env, loops = co.env, tuple(co.loops)

        def describe():
            return (f"mbarrier.wait {bar.label} phase({parity}) — {bar.state()}"
                    f"{loops_text(loops, env, node.line)}")
        while bar.parity == parity:
            self._park(co, bar.waiters, describe)
            yield
        co.agent().acquire(bar.know)
        yield

    def _h_FenceMbarrierInit(self, co, node):
        return None

    def _h_FenceProxyAsync(self, co, node):
        # A thread's fence orders its own writes: the elected thread's fence leaves the
        # warpgroup's tile.store_smem unfenced.
        agent = co.agent()
        epoch = agent.vc[agent]
        for write in co.unfenced:
            if write.agent is agent:
                write.fence_epoch = epoch
        co.unfenced[:] = [w for w in co.unfenced if w.fence_epoch is None]

    # named barriers and syncthreads
    def _h_NamedBarrierSync(self, co, node):
        return self._named_barrier(co, node, wait=True)

    def _h_NamedBarrierArrive(self, co, node):
        return self._named_barrier(co, node, wait=False)

    def _named_barrier(self, co, node, wait: bool):
        """`bar.sync id, n` / `bar.arrive id, n`: the hardware counts arriving warps; a round
        completes when n / 32 warps have arrived at barrier `id`, whoever they belong to. A
        warpgroup arrives with its 4 warps (at kernel level every warpgroup does)."""
        s = node.stmt
        bid = self._int(co, node, node.ex(co.env), "named barrier id")
        check_verified(1 <= bid < NAMED_BARRIERS and s.threads % WARP_THREADS == 0
                       and WARP_THREADS <= s.threads <= self.kernel.threads,
                       "a named barrier has an id in [1, 16) and counts whole warps, at most the CTA's")
        cta = co.cta
        gen = cta.named.get(bid)
        if gen is None:
            gen = cta.named[bid] = BarrierGeneration(s.threads)
        elif gen.threads != s.threads:
            raise ProtocolError(f"named barrier {bid} used with {s.threads} threads while this round counts "
                                f"{gen.threads} (the instructions of one round must name the same count): "
                                f"{co.where(node)}; first arrival {gen.arrivals[0][2]}")
        self._check_rounds_ordered(co, node, bid, gen)
        gen.arrivals.append((co, co.vc[co], Ctx(co, node)))
        co.release_all(gen.know)
        gen.count += WARPGROUP_THREADS
        if gen.count >= gen.threads:
            if gen.count > gen.threads:
                raise ProtocolError(self._split_warpgroup_text(co, node, bid, gen))
            gen.done = True
            del cta.named[bid]
            cta.named_last[bid] = gen
            self.report.named_barrier_syncs += 1
            self.wake(gen.waiters)
        if not wait:
            return None
        if gen.done:
            co.acquire_all(gen.know)
            return None
        return self._wait_generation(co, gen, lambda: (
            f"{keyword(s)} {bid}, {s.threads} — {gen.count // WARP_THREADS} of {s.threads // WARP_THREADS} "
            f"warps arrived"), node.line)

    @staticmethod
    def _check_rounds_ordered(co: Co, node: Node, bid: int, gen: BarrierGeneration) -> None:
        """Arrivals of different warpgroups in different rounds must be ordered: the GPU forms a
        round from whichever warps arrive first, so two warpgroups arriving concurrently at a
        barrier that counts fewer threads than both have can complete a round with warps of
        each (neither synchronised with itself), or leave warps waiting for a round that never
        fills (a hang)."""
        last = co.cta.named_last.get(bid)
        if last is None:
            return
        vc = co.vc
        for other, epoch, ctx in last.arrivals:
            if other is co or vc.get(other, 0) >= epoch:
                continue
            groups = sorted({c.label for c, _, _ in last.arrivals + gen.arrivals} | {co.label})
            verb, warps, total = keyword(node.stmt), gen.threads // WARP_THREADS, len(groups) * WARPGROUP_THREADS
            raise ProtocolError(
                f"named barrier {bid} counts {gen.threads} threads ({warps} warps) but {' and '.join(groups)} "
                f"arrive at it ({total} threads) without being ordered: on the GPU a round completes with the "
                f"first {warps} warps to arrive, which can mix warps of different warpgroups, so no warpgroup "
                f"is synchronised with itself (a broken barrier or a hang); give each group its own barrier id "
                f"(e.g. `{verb} {bid} + wg, {gen.threads}` per warpgroup) or count every participating thread "
                f"(`{verb} {bid}, {total}`): {co.where(node)}; concurrent arrival {ctx}")

    def _split_warpgroup_text(self, co, node, bid: int, gen: BarrierGeneration) -> str:
        inside = gen.threads - (gen.count - WARPGROUP_THREADS)
        arrived = ", ".join(str(ctx) for _, _, ctx in gen.arrivals)
        return (f"named barrier {bid} counts {gen.threads} threads, not a multiple of the warpgroups that arrive: "
                f"{co.label} brings {WARPGROUP_THREADS} threads when {inside} complete the round, so its warps "
                f"would be split between two rounds (the rest wait for a round that may never fill); count the "
                f"threads of every participating warpgroup: {co.where(node)}; arrivals of this round: {arrived}")

    def _wait_generation(self, co, gen, what, line=None):
        env, loops = co.env, tuple(co.loops)
        describe = lambda: what() + loops_text(loops, env, line)  # noqa: E731
        while not gen.done:
            self._park(co, gen.waiters, describe)
            yield
        co.acquire_all(gen.know)
        yield

    def _h_SyncThreads(self, co, node):
        cta = co.cta
        return self._barrier_round(co, node, cta, lambda gen: (
            f"syncthreads — {gen.count} of {cta.live} running warpgroups arrived"))

    def _h_ClusterSync(self, co, node):
        """`cluster.sync`: syncthreads over the running warpgroups of every CTA of the cluster."""
        cluster = co.cta.cluster
        ids = [cta.cta_id for cta in cluster.ctas]
        return self._barrier_round(co, node, cluster, lambda gen: (
            f"cluster.sync — {gen.count} of {cluster.live} running warpgroups of the cluster (CTAs "
            f"{ids[0]} .. {ids[-1]}) arrived"))

    def _barrier_round(self, co, node, holder: "Cta | Cluster", describe):
        """A round of syncthreads (holder: the CTA) or cluster.sync (the cluster) over the holder's
        `live` running warpgroups: each releases its clock into the round, the last one completes
        it, every one acquires all of them."""
        gen = holder.sync_gen
        if gen is None:
            gen = holder.sync_gen = BarrierGeneration(None)
        co.release_all(gen.know)
        gen.count += 1
        if gen.count >= holder.live:
            self._release_round(holder)
            co.acquire_all(gen.know)
            return None
        return self._wait_generation(co, gen, lambda: describe(gen), node.line)

    def _release_round(self, holder: "Cta | Cluster") -> None:
        gen = holder.sync_gen
        gen.done = True
        holder.sync_gen = None
        self.wake(gen.waiters)
