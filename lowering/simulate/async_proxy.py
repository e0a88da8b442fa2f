"""The simulator's asynchronous-proxy handlers (mixed into `machine.Machine`): smem
references and the happens-before race checks on their cells, TMA loads and stores with their
bulk groups and waits, and wgmma with its commit groups (the math lands at `wgmma.wait`)."""

from __future__ import annotations

import math

from wsched.target import (
    TORCH_DTYPES, WGMMA_ACCUMULATOR_DTYPE, WGMMA_K, WGMMA_M, WGMMA_N, WGMMA_OPERAND_DTYPES,
)

from .. import ir
from ..spelling import keyword
from .errors import ProtocolError, RaceError, check_verified
from .state import (Co, Ctx, MBarrier, Node, Read, TmaLoadOp, TmaStoreOp, WgmmaOp, Write, box_to_subarray,
                    is_chunked_box, read_box, tile_of)
from .text import loops_text


class AsyncHandlers:
    """smem, TMA and wgmma; uses `Machine`'s `_int`, `_park`, `wake`, `report`, `buffers`,
    `cell_depth`, `tensors`, `async_ops`, `BarrierHandlers`' `_barrier` / `_complete_phase` and
    `TileHandlers`' `_reg`."""

    # shared memory references and race checks
    def _smem(self, co: Co, node: Node, ref: ir.SmemRef, idx_closures, cta=None):
        """(decl, sub-array view, cells, label) of a SmemRef (in `cta`, a CTA of `co`'s cluster;
        default its own)."""
        decl = self.buffers[ref.buffer]
        env = co.env
        idx = tuple(self._int(co, node, f(env), "smem index") for f in idx_closures)
        for i, (v, n) in enumerate(zip(idx, decl.shape)):
            if not 0 <= v < n:
                raise ProtocolError(f"smem index {v} out of range for dim {i} of {ref.buffer}: "
                                    f"{decl.dtype}{list(decl.shape)}: {co.where(node)}")
        label = f"{ref.buffer}[{', '.join(map(str, idx))}]" if idx else ref.buffer
        depth = self.cell_depth[ref.buffer]
        lin = 0
        for v, n in zip(idx, decl.shape):
            lin = lin * n + v
        per = math.prod(decl.shape[len(idx):depth]) * self.cell_splits.get(ref.buffer, 1)
        cta = cta or co.cta
        cells = cta.cells[ref.buffer][lin * per:(lin + 1) * per]
        return decl, cta.smem[ref.buffer][idx], cells, label

    def _check_async_read(self, co: Co, node: Node, cells, label: str, reader: str) -> None:
        """An async-proxy read (wgmma / TMA store) needs the last write known complete."""
        agent = co.agent()
        vc = agent.vc
        for cell in cells:
            w = cell.write
            if w is None:
                raise RaceError(f"read of slot {label} before any write to it (did the reader wait on the right "
                                f"barrier and phase?): reader {co.where(node)}")
            if w.proxy == "async":
                if not w.landed:
                    raise RaceError(f"read of slot {label} before its TMA load completed (did the reader wait on "
                                    f"the right barrier and phase?): reader {co.where(node)}; pending writer {w.ctx}")
                if vc.get(w.bar, 0) <= w.phase:
                    raise RaceError(
                        f"read of slot {label} not synchronized with its TMA load: the load completes phase "
                        f"{w.phase} (parity {w.phase & 1}) of {w.bar.label}, which the reader has not waited "
                        f"for: reader {co.where(node)}; writer {w.ctx}")
            else:
                if w.agent is not agent and vc.get(w.agent, 0) < w.epoch:
                    if w.agent is co:
                        raise RaceError(
                            f"{reader} by the elected thread reads slot {label} that every thread of {co.label} "
                            f"wrote (tile.store_smem) with no barrier of the warpgroup in between: the other "
                            f"threads' writes may not have landed when it reads; put `bar.sync` over the "
                            f"warpgroup's threads after the write's fence.proxy.async and before the "
                            f"elect_one: reader {co.where(node)}; writer {w.ctx}")
                    raise RaceError(f"read of slot {label} not ordered after its tile.store_smem (no barrier "
                                    f"between writer and reader): reader {co.where(node)}; writer {w.ctx}")
                if w.fence_epoch is None or vc.get(w.agent, 0) < w.fence_epoch:
                    raise RaceError(f"missing fence.proxy.async: {reader} reads slot {label} written by "
                                    f"tile.store_smem with no fence.proxy.async by that warpgroup after the "
                                    f"write (and before the barrier the reader waited on): reader "
                                    f"{co.where(node)}; writer {w.ctx}")

    def _check_write(self, co: Co, node: Node, cells, label: str, writer: str) -> None:
        """A write needs the previous write landed and every read since then ended, both known."""
        agent = co.agent()
        vc = agent.vc
        for cell in cells:
            w = cell.write
            if w is not None:
                if w.proxy == "async" and not w.landed:
                    raise RaceError(f"{writer} into slot {label} while an earlier TMA load into it is still in "
                                    f"flight: writer {co.where(node)}; earlier load {w.ctx}")
                unordered = (vc.get(w.bar, 0) <= w.phase) if w.proxy == "async" else \
                    (w.agent is not agent and vc.get(w.agent, 0) < w.epoch)
                if unordered:
                    raise RaceError(f"{writer} into slot {label} is not ordered after the previous write to it: "
                                    f"writer {co.where(node)}; previous {w.ctx}")
            for r in cell.reads:
                what = "wgmma" if r.reader == "wgmma" else "TMA store"
                wait = "wgmma.wait" if r.reader == "wgmma" else "tma.wait.read"
                if r.pending:
                    raise RaceError(f"{writer} overwrites slot {label} while a {what} may still be reading it "
                                    f"(the slot was released before {wait} covered the read): writer "
                                    f"{co.where(node)}; reader {r.ctx}")
                if r.end_agent is not agent and vc.get(r.end_agent, 0) < r.end:
                    if r.end_agent is co.lane:
                        raise RaceError(
                            f"{writer} overwrites slot {label} while the {what} may still be reading it: the "
                            f"elected thread's {wait} that ends the read is not yet known to the other threads "
                            f"of {co.label}, which write the slot; put `bar.sync` over the warpgroup's threads "
                            f"between `elect_one {{ {wait} ... }}` and the write: writer {co.where(node)}; "
                            f"{what} {r.ctx}; wait {r.end_ctx}")
                    raise RaceError(f"{writer} overwrites slot {label} before the reader's {wait} is ordered "
                                    f"before it (the reader released the slot before its {wait}): writer "
                                    f"{co.where(node)}; reader {r.ctx}")

    # TMA
    def _tensormap(self, co, node, name: str):
        entry = self.tensors.get(name)
        check_verified(entry is not None and isinstance(entry[0], ir.TensorMapParam),
                       "tma.load and tma.store reach tensormap params")
        return entry

    def _coords(self, co, node, closures, rank: int) -> tuple[int, ...]:
        coords = tuple(self._int(co, node, f(co.env), "coordinate") for f in closures)
        check_verified(len(coords) == rank, "a tensor access gives one coordinate per dim")
        return coords

    @staticmethod
    def _chunked_box(param, decl, sub_shape) -> bool:
        """Whether the box fills the sub-array as column chunks (`state.is_chunked_box`)."""
        check_verified(decl.dtype == param.dtype and decl.swizzle == param.swizzle
                       and math.prod(param.box) == math.prod(sub_shape),
                       "a TMA copy moves one box between a tensormap and a smem sub-array of its dtype, "
                       "swizzle and size")
        return is_chunked_box(param.box, sub_shape)

    def _h_TmaLoad(self, co, node):
        """`tma.load`: one box into a sub-array (its rows, with `row`) of this CTA, or with
        `multicast(mask)` of every CTA of the cluster whose rank's bit is set, completing its bytes
        on the barrier of each; every target is checked as a plain load into it would be, then the
        copies land independently."""
        s = node.stmt
        dst_idx, coord_fns, bar_idx, row_fn, mask_fn = node.ex
        env = co.env
        param, tensor = self._tensormap(co, node, s.tensor)
        coords = self._coords(co, node, coord_fns, len(param.box))
        if mask_fn is None:
            ctas = (co.cta,)
        else:
            mask = self._int(co, node, mask_fn(env), "multicast mask")
            problem = ir.cluster_operand_problem("multicast", mask, self.cluster_size)
            if problem:
                raise ProtocolError(f"{problem}: {co.where(node)}")
            ctas = tuple(cta for cta in co.cta.cluster.ctas if mask >> cta.rank & 1)
        nbytes = math.prod(param.box) * ir.DTYPE_BYTES[param.dtype]
        targets, data = [], None
        for cta in ctas:
            peer = cta is not co.cta
            decl, view, cells, label = self._smem(co, node, s.dst, dst_idx, cta)
            if row_fn is None:
                chunked = self._chunked_box(param, decl, view.shape)
            else:
                view, cells, label = self._box_rows(co, node, param, decl, view, cells, label, row_fn(env))
                chunked = False
            bar = (self._peer_barrier(co, node, s.bar.barrier, bar_idx(env), cta, label) if peer
                   else self._barrier(co, node, s.bar.barrier, bar_idx(env)))
            self._check_tx(co, node, bar, nbytes)
            try:
                self._check_write(co, node, cells, f"{label} of CTA {cta.cta_id}" if peer else label, "TMA load")
            except RaceError as error:
                if not peer:
                    raise
                raise RaceError(f"{error}; a multicast writes into its peers' smem, so the consumers of each "
                                f"peer free the stage on the issuing CTA's barrier too (`mbarrier.arrive ... "
                                f"cta({co.cta.rank})`), and the issuer waits for that before it loads") from None
            if data is None:
                data = box_to_subarray(read_box(tensor, coords, param.box, TORCH_DTYPES[param.dtype]),
                                       tuple(view.shape), chunked)
            targets.append((cta, bar, view, cells, label))
        ctx = Ctx(co, node)
        for cta, bar, view, cells, label in targets:
            op = self._start_load(co, cta, bar, view, cells, data, nbytes, ctx)
            if cta is not co.cta:
                cta.peer_loads[bar] = (op.phase, ctx, label)
        self.report.tma_loads += 1
        self.report.tma_bytes_loaded += nbytes * len(targets)

    def _start_load(self, co: Co, cta, bar: MBarrier, view, cells, data, nbytes: int, ctx: Ctx) -> TmaLoadOp:
        """A TMA load in flight into `view` (`cells`) of `cta`, completing `nbytes` on `bar`."""
        write = Write("async", co.agent(), ctx)
        write.bar = bar
        for cell in cells:
            cell.write = write
            cell.reads = []
        op = TmaLoadOp()
        op.cta, op.bar, op.phase, op.view, op.write, op.ctx = cta, bar, bar.completed, view, write, ctx
        op.data = data
        op.bytes = nbytes
        bar.issued += nbytes
        bar.inflight += 1
        cta.loads_inflight += 1
        self.async_ops.append(op)
        return op

    def _box_rows(self, co, node, param, decl, view, cells, label: str, row):
        """(view, cells, label) of the rows `tma.load ... row(r)` fills in the 2-D sub-array `view`
        (whose cells split its rows evenly: `prepare._note_row_load`)."""
        row = self._int(co, node, row, "tma.load's row")
        height, width = view.shape
        check_verified(param.box[-1] == width, "a row load's box is as wide as its sub-array")
        rows = math.prod(param.box) // width
        if not 0 <= row <= height - rows:
            raise ProtocolError(f"tma.load into {label} at row({row}): the box's {rows} rows would land in rows "
                                f"{row} .. {row + rows - 1}, outside the {height} rows of {label} (outside the "
                                f"buffer on the GPU); a row load needs 0 <= row <= {height - rows}: {co.where(node)}")
        align, step = ir.tma_row_step(decl)
        if row % step:
            raise ProtocolError(f"tma.load into {label} at row({row}): the box would start "
                                f"{row * width * ir.DTYPE_BYTES[decl.dtype]} bytes into {label}, not on the {align}-byte "
                                f"alignment its swizzle({decl.swizzle}) and TMA need (on the GPU its rows would land "
                                f"swizzled as other rows, or the copy faults); use a row that is a multiple of "
                                f"{step}: {co.where(node)}")
        unit = height // len(cells)
        return (view[row:row + rows], cells[row // unit:(row + rows) // unit],
                f"{label} rows {row} .. {row + rows - 1}")

    def _check_tx(self, co: Co, node: Node, bar: MBarrier, nbytes: int) -> None:
        """A load belongs to the phase its issuer announced with arrive_expect_tx; its bytes must
        fit what that phase expects (checked at issue, so the verdict does not depend on when
        the earlier loads happen to land)."""
        phase = bar.expect_phase.get(co)
        if phase is None:
            return  # bytes announced by another thread: checked when the load lands
        if phase != bar.completed:
            expected, issued = bar.history.get(phase, (0, 0))
            raise ProtocolError(f"expect_tx mismatch on {bar.label} (CTA {bar.cta_id}): expected {expected} bytes, "
                                f"TMA delivered {issued + nbytes} (the phase completed with the bytes announced "
                                f"before this load was issued): {co.where(node)}")
        if bar.issued + nbytes > bar.expected:
            raise ProtocolError(f"expect_tx mismatch on {bar.label} (CTA {bar.cta_id}): expected {bar.expected} "
                                f"bytes, TMA delivered {bar.issued + nbytes}: {co.where(node)}")

    def land_tma_load(self, op: TmaLoadOp) -> None:
        bar = op.bar
        bar.inflight -= 1
        op.cta.loads_inflight -= 1
        if bar.completed != op.phase:
            expected, issued = bar.history.get(op.phase, (bar.expected, bar.issued))
            raise ProtocolError(f"expect_tx mismatch on {bar.label} (CTA {bar.cta_id}): expected {expected} bytes, "
                                f"TMA delivered {issued} (the phase completed before this load landed): {op.ctx}")
        op.view.copy_(op.data)
        op.write.landed = True
        op.write.phase = op.phase
        bar.tx -= op.bytes
        self._settle(bar, op.ctx)

    def _h_TmaStore(self, co, node):
        s = node.stmt
        src_idx, coord_fns = node.ex
        param, tensor = self._tensormap(co, node, s.tensor)
        coords = self._coords(co, node, coord_fns, len(param.box))
        decl, view, cells, label = self._smem(co, node, s.src, src_idx)
        chunked = self._chunked_box(param, decl, view.shape)
        self._check_async_read(co, node, cells, label, "TMA store")
        ctx = Ctx(co, node)
        op = TmaStoreOp()
        op.co, op.view, op.chunked, op.box, op.tensor, op.coords = co, view, chunked, tuple(param.box), tensor, coords
        op.param_dtype = TORCH_DTYPES[param.dtype]
        op.data, op.read_done, op.done, op.reads_ended = None, False, False, False
        op.reads = []
        for cell in cells:
            read = Read("tma_store", ctx)
            cell.reads.append(read)
            op.reads.append(read)
        co.bulk_open.append(op)
        self.async_ops.append(op)
        self.report.tma_stores += 1
        self.report.tma_bytes_stored += math.prod(param.box) * ir.DTYPE_BYTES[param.dtype]

    def _h_TmaCommit(self, co, node):
        co.bulk_groups.append(co.bulk_open)
        co.bulk_open = []

    def _h_TmaWait(self, co, node):
        s = node.stmt
        if self._bulk_ready(co, s.pending, s.read):
            self._bulk_finish(co, node, s.pending)
            return None
        return self._wait_bulk(co, node)

    @staticmethod
    def _older_groups(co: Co, pending: int) -> list:
        groups = co.bulk_groups
        return groups[:max(len(groups) - pending, 0)]

    def _bulk_ready(self, co: Co, pending: int, read: bool) -> bool:
        for group in self._older_groups(co, pending):
            for op in group:
                if not (op.read_done if read else op.done):
                    return False
        return True

    def _bulk_finish(self, co: Co, node: Node, pending: int) -> None:
        agent = co.agent()   # the issuing thread: bulk groups are per thread
        epoch, ctx = agent.vc[agent], None
        for group in self._older_groups(co, pending):
            for op in group:
                if not op.reads_ended:
                    op.reads_ended = True
                    ctx = ctx or Ctx(co, node)
                    for r in op.reads:
                        r.pending = False
                        r.end, r.end_agent, r.end_ctx = epoch, agent, ctx
        co.bulk_groups = [g for g in co.bulk_groups if not all(op.done and op.reads_ended for op in g)]

    def _wait_bulk(self, co, node):
        env, loops, s = co.env, tuple(co.loops), node.stmt
        pending, read = s.pending, s.read

        def describe():
            return (f"{keyword(s)} {pending} — {len(co.bulk_groups)} bulk group(s) committed"
                    f"{loops_text(loops, env, node.line)}")
        while not self._bulk_ready(co, pending, read):
            self._park(co, co.bulk_waiters, describe)
            yield
        self._bulk_finish(co, node, pending)
        yield

    # wgmma
    def _h_WgmmaFence(self, co, node):
        co.touched.clear()

    def _h_Wgmma(self, co, node):
        s = node.stmt
        a_idx, b_idx, accumulate_fn = node.ex
        acc = self._reg(co, node, s.acc)
        op = WgmmaOp()
        op.reads = []
        ctx = Ctx(co, node)
        reads = []  # (cells, label) to check and record
        if isinstance(s.a, str):
            a = self._reg(co, node, s.a)
            a_dtype, a_shape = a.dtype, a.shape
            op.a_name, op.a_reg, op.a_view, op.a_trans = s.a, a, None, False
            fenced = (s.acc, s.a)
        else:
            decl, view, cells, label = self._smem(co, node, s.a, a_idx)
            a_dtype, tile = decl.dtype, ir.tile_shape_of_subarray(tuple(view.shape))
            op.a_name, op.a_reg, op.a_view, op.a_trans = None, None, view, s.a_major == "n"
            a_shape = tile[::-1] if op.a_trans else tile
            reads.append((cells, label))
            fenced = (s.acc,)
        bdecl, bview, bcells, blabel = self._smem(co, node, s.b, b_idx)
        reads.append((bcells, blabel))
        btile = ir.tile_shape_of_subarray(tuple(bview.shape))
        op.b_view, op.b_trans = bview, s.b_major == "k"
        k, n = btile[::-1] if op.b_trans else btile
        check_verified(s.a_major in ir.MMA_MAJORS and s.b_major in ir.MMA_MAJORS
                       and (isinstance(s.a, ir.SmemRef) or s.a_major == "k")
                       and acc.dtype == WGMMA_ACCUMULATOR_DTYPE and acc.shape == (WGMMA_M, n) and n in WGMMA_N
                       and a_dtype == bdecl.dtype and a_dtype in WGMMA_OPERAND_DTYPES
                       and tuple(a_shape) == (WGMMA_M, k) and k % WGMMA_K == 0,
                       "wgmma's operands have the shapes and dtypes of one wgmma.mma_async")
        for name in fenced:
            if name in co.touched:
                raise ProtocolError(f"missing wgmma.fence: register tile {name} was accessed by a tile op "
                                    f"since the last wgmma.fence: {co.where(node)}")
        accumulate = node.ex[2](co.env)
        op.acc, op.accumulate = s.acc, bool(accumulate)
        # wgmmas into one accumulator run in issue order: a pending one has written it by then
        if op.accumulate and s.acc not in co.acc_pending:
            self._check_written(co, node, s.acc, acc)
        if op.a_reg is not None:
            self._check_written(co, node, s.a, op.a_reg)
        for cells, label in reads:
            self._check_async_read(co, node, cells, label, "wgmma")
            for cell in cells:
                read = Read("wgmma", ctx)
                cell.reads.append(read)
                op.reads.append(read)
        acc.written = True
        co.wg_open.append(op)
        co.acc_pending[s.acc] = co.acc_pending.get(s.acc, 0) + 1
        if op.a_reg is not None:
            co.a_pending[s.a] = co.a_pending.get(s.a, 0) + 1
        self.report.wgmmas += 1

    def _h_WgmmaCommit(self, co, node):
        co.wg_groups.append(co.wg_open)
        co.wg_open = []

    def _h_WgmmaWait(self, co, node):
        groups = co.wg_groups
        while len(groups) > node.stmt.pending:
            self._complete_wgmma_group(co, groups.popleft())

    def _complete_wgmma_group(self, co: Co, group: list) -> None:
        epoch = co.vc[co]   # wgmma.wait is warpgroup-collective
        for op in group:
            acc = co.regs[op.acc]
            a = op.a_reg.value if op.a_reg is not None else tile_of(op.a_view).float()
            if op.a_trans:
                a = a.T
            b = tile_of(op.b_view).float()
            if op.b_trans:
                b = b.T
            product = a @ b
            acc.value = acc.value + product if op.accumulate else product
            for r in op.reads:
                r.pending = False
                r.end, r.end_agent = epoch, co
            for pending, name in ((co.acc_pending, op.acc), (co.a_pending, op.a_name)):
                if name:
                    pending[name] -= 1
                    if not pending[name]:
                        del pending[name]
