"""The simulator's handlers of synchronisation through global memory (mixed into
`machine.Machine`): the ordering of plain tile stores and loads between CTAs, `fence.acq_rel.gpu`,
`atomic.inc` and `ld.shared` (split-K's ticket protocol); and `ld.global`, one element of an input
(a paged cache's page table and lengths), which must lie inside its tensor.

Global memory gets the same happens-before treatment as shared memory, at the granularity of
elements: a `tile.store` remembers, per element, which agent wrote it at which epoch, and a
`tile.load` of an element another agent wrote must know that write. Between CTAs the only way
to know it is the release/acquire pattern of the PTX memory model through an atomic:

    writer CTA:  tile.store partials[...]; bar.sync (its elected thread learns the stores);
                 elect_one { fence.acq_rel.gpu   # release: the clock so far goes with
                             atomic.inc ... }    #   every later atomic of this thread
    reader CTA:  elect_one { atomic.inc ...      # reads the releases of earlier atomics there
                             fence.acq_rel.gpu } # acquire: what they released is now known
                 bar.sync (the warpgroup learns it); tile.load partials[...]

An atomic location keeps the union of what the atomics on it released (read-modify-writes
continue a release sequence); an atomic records what it read as its agent's `observed`, and the
agent's next fence acquires that. Without either fence, or with the load before the atomic, the
load does not know the writer's stores and is reported as a race.
"""

from __future__ import annotations

import torch

from .. import ir
from ..evaluate import INT_MAX, INT_MIN
from .errors import ProtocolError, RaceError, check_verified
from .state import Co, Ctx, GlobalWrite, Node, Write


class GlobalSyncHandlers:
    """Uses `Machine`'s `tensors`, `global_writes`, `atomic_know`, `_int`, `AsyncHandlers`' `_coords`,
    `_smem` and `_check_write`."""

    # -- plain global stores and loads between agents --------------------------------------------
    def _global_writers(self, name: str, tensor: torch.Tensor):
        """(record index per element, records) of a tensor that tile stores have written."""
        entry = self.global_writes.get(name)
        if entry is None:
            entry = self.global_writes[name] = (torch.full(tuple(tensor.shape), -1, dtype=torch.int64), [])
        return entry

    @staticmethod
    def _box_region(coords, extents, shape):
        region = []
        for c, e, n in zip(coords, extents, shape):
            lo, hi = max(c, 0), min(c + e, n)
            if hi <= lo:
                return None
            region.append(slice(lo, hi))
        return tuple(region)

    def note_global_write(self, co: Co, node: Node, name: str, coords, extents) -> None:
        tensor = self.tensors[name][1]
        region = self._box_region(coords, extents, tensor.shape)
        if region is None:
            return
        index, records = self._global_writers(name, tensor)
        records.append(GlobalWrite(co.agent(), Ctx(co, node)))
        index[region] = len(records) - 1

    def check_global_read(self, co: Co, node: Node, name: str, coords, extents, verb: str = "tile.load") -> None:
        if name not in self.global_writes:
            return
        index, records = self.global_writes[name]
        region = self._box_region(coords, extents, index.shape)
        if region is None:
            return
        agent = co.agent()
        vc = agent.vc
        for i in torch.unique(index[region]).tolist():
            if i < 0:
                continue
            w = records[i]
            if w.agent is not agent and vc.get(w.agent, 0) < w.epoch:
                raise RaceError(
                    f"{verb} of {name} reads elements another warpgroup stored with no synchronisation "
                    f"between the store and this load: between CTAs the writer must release its stores "
                    f"(bar.sync, then fence.acq_rel.gpu before its atomic.inc) and the reader acquire them "
                    f"(atomic.inc, then fence.acq_rel.gpu, then bar.sync) before it loads: reader "
                    f"{co.where(node)}; writer {w.ctx}")

    def check_zeroed_workspaces(self) -> None:
        """A `zeroed` workspace is zero when the host allocates it and never again: the kernel
        must leave it zero for the next call (split-K's tickets wrap back to 0)."""
        for p, tensor in self.tensors.values():
            if isinstance(p, ir.WorkspaceParam) and p.zeroed and bool(tensor.any()):
                where = [list(i) for i in tensor.nonzero()[:4].tolist()]
                raise ProtocolError(f"workspace {p.name} is declared zeroed but the kernel left {int(tensor.count_nonzero())} "
                                    f"element(s) non-zero (first at {where}): the next call would start from them "
                                    f"(a ticket counter must wrap back to 0: atomic.inc ... wrap(n - 1) for n arrivals)")

    # -- fences, atomics and the broadcast of a result ----------------------------------------------
    def _h_FenceGpu(self, co, node):
        agent = co.agent()
        agent.acquire(agent.observed)          # acquire: what the atomics before it read
        agent.observed = {}
        agent.released = dict(agent.vc)        # release: everything so far, to the atomics after it
        agent.vc[agent] += 1

    def _h_AtomicInc(self, co, node):
        s = node.stmt
        check_verified(co.in_elect, "atomic.inc is inside elect_one")
        entry = self.tensors.get(s.tensor)
        check_verified(entry is not None and isinstance(entry[0], ir.GlobalParam), "atomic.inc reaches a global param")
        param, tensor = entry
        coords = self._coords(co, node, node.ex[1], tensor.dim())
        if not all(0 <= c < n for c, n in zip(coords, tensor.shape)):
            raise ProtocolError(f"atomic.inc at {s.tensor}{list(coords)} is outside {s.tensor} "
                                f"{list(tensor.shape)}: {co.where(node)}")
        wrap = self._int(co, node, node.ex[2](co.env), "atomic.inc's wrap")
        decl, view, cells, label = self._smem(co, node, s.dst, node.ex[0])
        self._check_write(co, node, cells, label, "atomic.inc")
        old = int(tensor[coords])
        tensor[coords] = 0 if old >= wrap else old + 1
        agent = co.agent()
        know = self.atomic_know.setdefault((s.tensor, coords), {})
        if agent.released is not None:
            for key, value in agent.released.items():
                if know.get(key, 0) < value:
                    know[key] = value
        for key, value in know.items():
            if agent.observed.get(key, 0) < value:
                agent.observed[key] = value
        view.fill_(old)
        write = Write("generic", agent, Ctx(co, node))
        for cell in cells:
            cell.write = write
            cell.reads = []

    def _h_LoadShared(self, co, node):
        s = node.stmt
        decl, view, cells, label = self._smem(co, node, s.src, node.ex)
        agent = co.agent()
        for cell in cells:
            w = cell.write
            if w is None:
                raise RaceError(f"ld.shared reads {label} before anything wrote it: {co.where(node)}")
            if w.agent is not agent and agent.vc.get(w.agent, 0) < w.epoch:
                raise RaceError(f"ld.shared reads {label} that {w.ctx.label} wrote with no barrier of the "
                                f"warpgroup in between (put `bar.sync` over the warpgroup's threads after the "
                                f"write): reader {co.where(node)}; writer {w.ctx}")
        co.env[s.name] = int(view.reshape(-1)[0])

    # -- one element of an input (a paged cache's page table and lengths) --------------------------
    def _h_LoadGlobal(self, co, node):
        s = node.stmt
        entry = self.tensors.get(s.tensor)
        check_verified(entry is not None and isinstance(entry[0], ir.GlobalParam)
                       and not isinstance(entry[0], ir.WorkspaceParam), "ld.global reads an input global param")
        param, tensor = entry
        coords = self._coords(co, node, node.ex, tensor.dim())
        if not all(0 <= c < n for c, n in zip(coords, tensor.shape)):
            raise ProtocolError(f"ld.global reads {s.tensor}{list(coords)}, outside {s.tensor} {list(tensor.shape)}: "
                                f"it would read out of bounds on the GPU; clamp the coordinates to the tensor "
                                f"(e.g. min(i, n - 1)): {co.where(node)}")
        self.check_global_read(co, node, s.tensor, coords, (1,) * len(coords), "ld.global")
        value = int(tensor[coords])
        if not INT_MIN <= value <= INT_MAX:
            raise ProtocolError(f"ld.global reads {value} at {s.tensor}{list(coords)}, outside the 32-bit int the "
                                f"kernel reads it as: {co.where(node)}")
        co.env[s.name] = value
