"""The simulator's run-time state: statements prepared as nodes, coroutines (one per
warpgroup) with their vector clocks, CTAs, mbarriers and barrier rounds, smem cells with their
last write and reads, pending TMA / wgmma operations, register tiles, and the mapping between
TMA boxes, smem sub-arrays and tiles."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from .. import ir
from .text import loops_text, stmt_text

if TYPE_CHECKING:
    from .machine import Machine


class Node:
    """A statement prepared for execution: its handler, compiled expressions, nested blocks."""

    __slots__ = ("stmt", "line", "fn", "ex", "block", "orelse", "leader_only", "info")

    def __init__(self, stmt, line: int):
        self.stmt = stmt
        self.line = line     # in the printed IR (`verify.lines.statement_lines`)
        self.fn = None
        self.ex = None
        self.block = ()
        self.orelse = ()
        self.leader_only = False
        self.info = None


class Ctx:
    """Who did something, frozen at that moment (for messages about it later)."""

    __slots__ = ("cta_id", "label", "stmt", "line", "env", "loops")

    def __init__(self, co: "Co", node: Node):
        self.cta_id = co.cta.cta_id
        self.label = co.label + (" (elected thread)" if co.in_elect else "")
        self.stmt = node.stmt
        self.line = node.line
        self.env = dict(co.env)
        self.loops = tuple(co.loops)

    def __str__(self) -> str:
        return (f"CTA {self.cta_id} {self.label}: {stmt_text(self.stmt, self.env)}"
                f"{loops_text(self.loops, self.env, self.line)}")


class Reg:
    """A register tile: fp32 values (rounded to `dtype` at every write; an i32 tile's int32),
    NaN and `written` False until the first write, since registers start undefined on the GPU."""

    __slots__ = ("dtype", "shape", "value", "written")

    def __init__(self, dtype: str, shape: tuple[int, ...]):
        self.dtype = dtype
        self.shape = shape
        # i32 tiles hold int32 values (docs/ir.md, "Integer tiles"); unwritten, never read
        self.value = torch.zeros(shape, dtype=torch.int32) if dtype == "i32" else torch.full(shape, float("nan"))
        self.written = False


class RegView:
    """`tile.view`: columns col0 .. col0 + cols - 1 of the register tile `base` (named `parent`);
    reads and writes go to the base tile, so the two stay one set of registers."""

    __slots__ = ("parent", "base", "col0", "cols")

    def __init__(self, parent: str, base: "Reg | RegView", col0: int, cols: int):
        self.parent = parent
        self.base = base
        self.col0 = col0
        self.cols = cols

    @property
    def dtype(self) -> str:
        return self.base.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.base.shape[0], self.cols)

    @property
    def value(self) -> torch.Tensor:
        return self.base.value[:, self.col0:self.col0 + self.cols]

    @value.setter
    def value(self, v: torch.Tensor) -> None:
        whole = self.base.value.clone()
        whole[:, self.col0:self.col0 + self.cols] = v
        self.base.value = whole

    @property
    def written(self) -> bool:
        return self.base.written

    @written.setter
    def written(self, flag: bool) -> None:
        self.base.written = self.base.written or flag

    def names(self) -> tuple[str, ...]:
        """This view's base tiles' names, nearest first (what a pending wgmma may hold)."""
        inner = self.base.names() if isinstance(self.base, RegView) else ()
        return (self.parent,) + inner


class GlobalWrite:
    """A plain store of a register tile to a global tensor by `agent` at its epoch (split-K's
    partials): a later `tile.load` of those elements by another agent must be ordered after it."""

    __slots__ = ("agent", "epoch", "ctx")

    def __init__(self, agent: "Agent", ctx: Ctx):
        self.agent = agent
        self.epoch = agent.vc[agent]
        self.ctx = ctx


class Write:
    """The last write of a smem cell: a TMA load (`proxy` "async") or a tile.store_smem
    (`proxy` "generic"), by `agent` (a warpgroup, or its elected thread) at its epoch."""

    __slots__ = ("proxy", "agent", "epoch", "ctx", "landed", "bar", "phase", "fence_epoch")

    def __init__(self, proxy: str, agent: "Agent", ctx: Ctx):
        self.proxy = proxy
        self.agent = agent
        self.epoch = agent.vc[agent]
        self.ctx = ctx
        self.landed = False
        self.bar = None
        self.phase = -1
        self.fence_epoch = None


class Read:
    """An async read of a smem cell (`reader` "wgmma" or "tma_store"); it ends at the covering
    wait, made by `end_agent` at its epoch `end` (`end_ctx`: that wait)."""

    __slots__ = ("reader", "ctx", "pending", "end", "end_agent", "end_ctx")

    def __init__(self, reader: str, ctx: Ctx):
        self.reader = reader
        self.ctx = ctx
        self.pending = True
        self.end = 0
        self.end_agent = None
        self.end_ctx = None


class Cell:
    __slots__ = ("write", "reads")

    def __init__(self):
        self.write = None
        self.reads = []


class MBarrier:
    """One mbarrier slot of one CTA."""

    __slots__ = ("label", "cta_id", "arrivals", "pending", "tx", "parity", "completed", "expected",
                 "issued", "history", "arrive_know", "know", "waiters", "init_co", "init_epoch",
                 "inflight", "expect_phase")

    def __init__(self, label: str, cta_id: int, arrivals: int, init_co: "Co"):
        self.label = label
        self.cta_id = cta_id
        self.arrivals = arrivals
        self.pending = arrivals
        self.tx = 0
        self.parity = 0
        self.completed = 0      # phases completed so far
        self.expected = 0       # expect_tx bytes announced in the current phase
        self.issued = 0         # bytes of TMA loads issued against the current phase
        self.history = {}       # completed phase -> (expected, issued)
        self.arrive_know = {}   # clocks published by this phase's arrivals
        self.know = {}          # clocks published by all completed phases
        self.waiters = []
        self.init_co = init_co
        self.init_epoch = init_co.vc[init_co]
        self.inflight = 0
        self.expect_phase = {}  # coroutine -> phase of its last arrive_expect_tx here

    def state(self) -> str:
        text = (f"barrier at phase parity {self.parity}, {self.pending} of {self.arrivals} arrivals "
                f"pending, tx {self.tx}")
        if self.tx:
            text += f" (expected {self.expected} bytes, TMA delivered {self.expected - self.tx})"
        return text


class BarrierGeneration:
    """One round of a named barrier (`threads` the count its instruction names, `count` the
    threads arrived so far, `arrivals` who arrived: (warpgroup, its epoch, Ctx)) or of
    syncthreads (`threads` None, `count` in warpgroups)."""

    __slots__ = ("threads", "count", "arrivals", "know", "waiters", "done")

    def __init__(self, threads: int | None):
        self.threads = threads
        self.count = 0
        self.arrivals = []
        self.know = {}
        self.waiters = []
        self.done = False


class TmaLoadOp:
    __slots__ = ("cta", "bar", "phase", "bytes", "data", "view", "write", "ctx")

    def advance(self, m: "Machine") -> bool:
        m.land_tma_load(self)
        return True


class TmaStoreOp:
    __slots__ = ("co", "view", "chunked", "box", "tensor", "coords", "param_dtype", "data",
                 "read_done", "done", "reads", "reads_ended")

    def advance(self, m: "Machine") -> bool:
        if not self.read_done:
            self.data = subarray_to_box(self.view, self.box, self.chunked)
            self.read_done = True
        else:
            write_box(self.tensor, self.coords, self.data, self.param_dtype)
            self.done = True
        m.wake(self.co.bulk_waiters)
        return self.done


class WgmmaOp:
    __slots__ = ("acc", "a_name", "a_reg", "a_view", "a_trans", "b_view", "b_trans", "accumulate", "reads")


class Agent:
    """Who synchronises: a vector clock (own epochs plus, per mbarrier, the number of completed
    phases observed) with release (publish, then start a new epoch) and acquire (merge).
    `released` is the clock its last `fence.acq_rel.gpu` published to the atomics after it;
    `observed` what its atomics read since, which its next fence acquires."""

    __slots__ = ("vc", "released", "observed")

    def release(self, know: dict) -> None:
        """Publish this agent's clock into `know`; later events get a new epoch."""
        vc = self.vc
        for key, value in vc.items():
            if know.get(key, 0) < value:
                know[key] = value
        vc[self] += 1

    def acquire(self, know: dict) -> None:
        vc = self.vc
        for key, value in know.items():
            if vc.get(key, 0) < value:
                vc[key] = value


class Lane(Agent):
    """The elected thread of a warpgroup (inside `elect_one`). What it does and learns there
    (tma.wait, mbarrier.wait) reaches the rest of the warpgroup only through a barrier the whole
    warpgroup takes part in; what the warpgroup's threads wrote reaches it the same way."""

    __slots__ = ("co",)

    def __init__(self, co: "Co"):
        self.co = co
        self.vc = {self: 1}
        self.released = None
        self.observed = {}


class Co(Agent):
    """One warpgroup of one CTA: a coroutine with its own env and register tiles. As an agent it
    stands for every thread of the warpgroup (what all of them did or learned); `lane` is its
    elected thread."""

    __slots__ = ("cta", "gid", "role", "label", "env", "regs", "lane", "loops", "gen", "parked", "block",
                 "in_elect", "wg_open", "wg_groups", "acc_pending", "a_pending", "touched",
                 "bulk_open", "bulk_groups", "bulk_waiters", "unfenced", "node", "done")

    def __init__(self, cta: "Cta", gid: int, env: dict):
        self.cta = cta
        self.gid = gid
        self.role = None
        self.label = f"wg{gid}"
        self.env = env
        self.regs = {}
        self.vc = {self: 1}
        self.released = None
        self.observed = {}
        self.lane = Lane(self)
        self.loops = []
        self.gen = None
        self.parked = False
        self.block = None
        self.in_elect = 0
        self.wg_open = []
        self.wg_groups = deque()
        self.acc_pending = {}
        self.a_pending = {}
        self.touched = set()
        self.bulk_open = []
        self.bulk_groups = []
        self.bulk_waiters = []
        self.unfenced = []
        self.node = None
        self.done = False

    def where(self, node: Node | None = None) -> str:
        node = node or self.node
        if node is None:
            return f"CTA {self.cta.cta_id} {self.label}: (start)"
        return (f"CTA {self.cta.cta_id} {self.label}: {stmt_text(node.stmt, self.env)}"
                f"{loops_text(self.loops, self.env, node.line)}")

    def agent(self) -> Agent:
        """Who runs the current statement: the elected thread inside elect_one, else the warpgroup."""
        return self.lane if self.in_elect else self

    def release_all(self, know: dict) -> None:
        """A barrier every thread of the warpgroup takes part in: the elected thread's knowledge
        is published with the warpgroup's."""
        self.release(know)
        self.lane.release(know)

    def acquire_all(self, know: dict) -> None:
        self.acquire(know)
        self.lane.acquire(know)


class Cta:
    """One resident CTA. `cluster` is its cluster and `rank` its place there (`cta_id % n`);
    `peer_arrivals` (barrier here -> (the phase, Ctx, barrier label) of the latest arrival a peer
    made on it) and `peer_loads` (barrier here -> (phase, Ctx, smem label) of the latest multicast a
    peer issued into this CTA's smem) are what this CTA must know of before it exits: the
    completion of that phase of each barrier. (Knowing a peer agent's latest arrival is not
    enough: arrivals of one thread on different barriers are not ordered for an observer in
    another CTA, so a tail that skips a stage would pass.)"""

    __slots__ = ("cta_id", "smem", "cells", "bars", "named", "named_last", "sync_gen", "live", "cos",
                 "loads_inflight", "cluster", "rank", "exited", "peer_arrivals", "peer_loads")


class Cluster:
    """The CTAs of one cluster (`kernel.cluster`: n consecutive CTAs, resident together), the
    warpgroups of them still running (`live`) and the open round of `cluster.sync`."""

    __slots__ = ("ctas", "live", "sync_gen")

    def __init__(self):
        self.ctas = []
        self.live = 0
        self.sync_gen = None


# ---------------------------------------------------------------------------------------------
# Boxes, sub-arrays and tiles
# ---------------------------------------------------------------------------------------------


def _box_shape_2d(box: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(box)
    while len(shape) > 2 and shape[0] == 1:
        shape = shape[1:]
    return shape


def is_chunked_box(box: tuple[int, ...], sub_shape: tuple[int, ...]) -> bool:
    """Does the box fill a (chunks, R, W) sub-array as its [R, chunks*W] tile?"""
    return (len(sub_shape) == 3 and sub_shape[0] > 1
            and _box_shape_2d(box) == ir.tile_shape_of_subarray(sub_shape))


def box_to_subarray(data: torch.Tensor, sub_shape: tuple[int, ...], chunked: bool) -> torch.Tensor:
    if chunked:
        chunks, rows, width = sub_shape
        return data.reshape(rows, chunks, width).transpose(0, 1)
    return data.reshape(sub_shape)


def subarray_to_box(view: torch.Tensor, box: tuple[int, ...], chunked: bool) -> torch.Tensor:
    if chunked:
        return view.transpose(0, 1).reshape(box).clone()
    return view.reshape(box).clone()


def tile_of(view: torch.Tensor) -> torch.Tensor:
    """The [rows, cols] tile a smem sub-array holds (column chunks concatenated)."""
    if view.dim() == 2:
        return view
    chunks, rows, width = view.shape
    return view.permute(1, 0, 2).reshape(rows, chunks * width)


def _region(coords, extents, shape):
    """(tensor slices, box slices) of the part of a box at `coords` inside `shape`, or None."""
    src, dst = [], []
    for c, b, n in zip(coords, extents, shape):
        lo, hi = max(c, 0), min(c + b, n)
        if hi <= lo:
            return None
        src.append(slice(lo, hi))
        dst.append(slice(lo - c, hi - c))
    return tuple(src), tuple(dst)


def read_box(tensor: torch.Tensor, coords, extents, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(tuple(extents), dtype=dtype)
    region = _region(coords, extents, tensor.shape)
    if region is not None:
        out[region[1]] = tensor[region[0]].to(dtype)
    return out


def write_box(tensor: torch.Tensor, coords, data: torch.Tensor, param_dtype: torch.dtype) -> None:
    region = _region(coords, data.shape, tensor.shape)
    if region is not None:
        tensor[region[0]] = data[region[1]].to(param_dtype).to(tensor.dtype)
