"""The verifier's contract between the load and compute nests (docs/architecture.md).

Static half (`ContractCheck`): each tma.load elected, announced by an arrive_expect_tx with the
bytes of its loads, completing on the slot of its destination's stage; each channel's full and
empty barriers declared with one slot per stage and initialised with the right arrival counts;
and both sides' loop nests around a channel with the same bounds. A channel's empty barrier is,
among those the producer waits on where it announces the channel's stages, the one the
consumers release those stages on, so the producer's acquires may come in any order.

Dynamic half: `_Tracer` runs each role's control flow (lets, vars, loops, ifs) on the host for a
few sample problem sizes and CTAs, recording the barrier operations, wgmma groups and smem
accesses of every warpgroup; persistent tile loops are cut after two tiles (tile = cta_id,
cta_id + num_ctas), which both sides' identical tile loops make a common prefix. A sample the
host cannot run (a name without a value, a division by zero, too many steps) is skipped; a
wait repeated right after itself is one acquire.
`_TraceCheck` then holds each sample's traces to the contract: the same (tile, k) traversal with
the same stage and phase on both sides, barrier arrival counts, no stage released (and no smem
overwritten) while a wgmma reading it may be pending nor before every warp has passed its wait,
and generic smem writes fenced before TMA or wgmma read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from wsched.target import FLOAT_DTYPES, WARPGROUP_THREADS

from .. import ir
from ..evaluate import evaluate
from ..printer import expr_text
from ..rewrite import subst
from ..spelling import keyword
from .lines import Report, Site, block_of, constant, ordinal, plural, ref_text, sites, statement_at, volume

_SAME_ORDER = "the load and compute nests must traverse the same (tile, k) order"


def _lets_before(kernel: ir.Kernel, path: tuple[int, ...]) -> dict[str, ir.Expr]:
    """The `let` definitions in scope at `path`, each substituted into the ones after it. An
    `ld.global x = t[c]` stands for the element it reads, spelled as the call `t(c)`: two sides
    that read the same element of an input read the same value (a sequence length in both
    nests' loop bounds)."""
    lets: dict[str, ir.Expr] = {}
    for depth in range(1, len(path) + 1):
        stmts, index, _ = block_of(kernel, path[:depth])
        for s in stmts[:index]:
            if isinstance(s, ir.Let) and not s.mutable:
                lets[s.name] = subst(s.value, lets)
            elif isinstance(s, ir.LoadGlobal):
                lets[s.name] = ir.Call(s.tensor, tuple(subst(c, lets) for c in s.coords))
    return lets


@dataclass
class _Channel:
    full: str
    empty: "str | None"              # the barrier the consumers release its stages on
    buffers: set
    expect_tx: Site                  # the producer's first arrive_expect_tx on `full`
    mismatched_roles: set = field(default_factory=set)   # consumer roles whose loop nest differs
    acquires: tuple = ()             # barriers the producer waits on in the expect_tx's block, nearest first


class ContractCheck:
    """The load/compute contract of a kernel whose structure is sound: the static checks of
    every tma.load and channel, then `_TraceCheck` on the host-run traces of each sample."""

    def __init__(self, kernel: ir.Kernel, report: Report):
        self.k = kernel
        self.r = report
        self.sites = sites(kernel)
        self.reported: set = set()
        self.inits = {s.stmt.barrier: s for s in self.sites if isinstance(s.stmt, ir.MbarrierInit)}

    def once(self, key, path, problem, cause=None) -> None:
        """Report `problem` at `path` unless this check already reported there (or, given a
        `cause` path, already reported anything that cause led to): a rule broken on one sample
        point is broken at many, and the first one says it."""
        seen = (key, cause if cause is not None else path)
        if seen not in self.reported:
            self.reported.add(seen)
            self.r.at(path, problem)

    def run(self) -> None:
        self._load_blocks()
        channels = self._channels()
        runs = []
        if self.k.roles():
            runs = [(sample, traces) for sample in _samples(self.k)
                    if (traces := _Tracer(self.k, sample.env, sample.loaded).run()) is not None]
        _release_barriers(channels, runs[0][1] if runs else {})
        for ch in channels:
            self._channel_declarations(ch)
            ch.mismatched_roles = self._same_nests(ch)
        for sample, traces in runs:
            _TraceCheck(self, channels, traces, sample).run()

    # -- static ---------------------------------------------------------------------------------

    def _load_blocks(self) -> None:
        """Each tma.load: elected, announced by an arrive_expect_tx on its barrier earlier in the
        same block, completing on the slot of its destination's stage; each expect_tx: the bytes
        of the loads it announces."""
        blocks = [(self.k.body, (), 0)]
        for site in self.sites:
            s = site.stmt
            if isinstance(s, ir.If):
                blocks += [(s.then, site.path, 0), (s.orelse, site.path, len(s.then))]
            elif ir.child_blocks(s):
                blocks.append((s.body, site.path, 0))
        by_path = {site.path: site for site in self.sites}
        for stmts, prefix, offset in blocks:
            announced: dict[ir.BarRef, list] = {}       # barrier -> loads since its latest expect_tx
            groups: list[tuple[ir.MbarrierArriveExpectTx, tuple[int, ...], list]] = []
            for i, s in enumerate(stmts):
                path = prefix + (offset + i,)
                if isinstance(s, ir.MbarrierArriveExpectTx):
                    groups.append((s, path, []))
                    announced[s.bar] = groups[-1][2]
                elif isinstance(s, ir.TmaLoad):
                    self._load(s, by_path[path], announced)
            for s, path, loads in groups:
                self._expect_tx_bytes(s, path, loads)

    def _load(self, s: ir.TmaLoad, site: Site, announced) -> None:
        if not any(isinstance(a, ir.ElectOne) for a in site.ancestors):
            self.r.at(site.path, "tma.load outside elect_one would be issued by every thread of the "
                                 "warpgroup; put the producer's loads inside `elect_one { ... }`")
        if s.bar in announced:
            announced[s.bar].append(s)
        else:
            self.r.at(site.path, f"tma.load completes on {ref_text(s.bar)} but no `mbarrier.arrive_expect_tx "
                                 f"{ref_text(s.bar)} bytes(...)` precedes it in this block; announce the "
                                 f"stage's bytes on that barrier before the loads")
        if not s.dst.index:
            self.r.at(site.path, f"tma.load into {s.dst.buffer} without a stage index; a channel buffer "
                                 f"is selected by its stage: {s.dst.buffer}[s]")
        elif s.bar.index != s.dst.index[0]:
            self.r.at(site.path, f"tma.load {ref_text(s.dst)} completes on {ref_text(s.bar)}: the barrier slot "
                                 f"must be the destination's stage, {s.bar.barrier}[{expr_text(s.dst.index[0])}]")

    def _load_bytes(self, s: ir.TmaLoad) -> "int | None":
        """The bytes a load delivers to each CTA that receives it. A multicast to the whole cluster
        is counted once per CTA of it: every CTA issues its share of the operand to all of them.
        Any other mask is left to the simulator, which checks the bytes that really land."""
        try:
            p = self.k.param(s.tensor)
            decl = self.k.smem_decl(s.dst.buffer)
        except KeyError:
            return None
        copies = 1
        if s.multicast is not None:   # counted only for a mask of the whole cluster
            size = self.k.cluster[0]
            if constant(s.multicast) != (1 << size) - 1:
                return None
            copies = size
        if isinstance(p, ir.TensorMapParam) and p.dtype in ir.DTYPE_BYTES:
            return copies * volume(p.box) * ir.DTYPE_BYTES[p.dtype]
        return copies * volume(ir.smem_subshape(decl, s.dst)) * ir.DTYPE_BYTES.get(decl.dtype, 0)

    def _expect_tx_bytes(self, s: ir.MbarrierArriveExpectTx, path, loads) -> None:
        announced = constant(subst(s.bytes, _lets_before(self.k, path)))
        if not isinstance(announced, int):
            self.r.at(path, f"bytes({expr_text(s.bytes)}) is not a constant; TMA delivers whole boxes "
                            f"(out-of-bounds elements included), so announce their constant sum")
            return
        sizes = [self._load_bytes(ld) for ld in loads]
        if None in sizes:
            return
        if not loads:
            self.r.at(path, f"expect_tx announces {announced} bytes but no tma.load into {ref_text(s.bar)} "
                            f"follows it in this block; announce the bytes right before the loads")
        elif sum(sizes) != announced:
            parts = " + ".join(f"{ref_text(ld.dst)} {n}" for ld, n in zip(loads, sizes))
            self.r.at(path, f"expect_tx announces {announced} bytes but the loads into {ref_text(s.bar)} "
                            f"deliver {sum(sizes)} ({parts}); use bytes({sum(sizes)})")

    def _channels(self) -> list[_Channel]:
        channels: dict[str, _Channel] = {}
        for site in self.sites:
            s = site.stmt
            if isinstance(s, ir.TmaLoad) and site.role is not None:
                ch = channels.get(s.bar.barrier)
                if ch is None:
                    expect = next((x for x in self.sites if isinstance(x.stmt, ir.MbarrierArriveExpectTx)
                                   and x.stmt.bar.barrier == s.bar.barrier and x.role is site.role), None)
                    if expect is None:
                        continue            # reported with the load
                    ch = channels[s.bar.barrier] = _Channel(s.bar.barrier, None, set(), expect)
                ch.buffers.add(s.dst.buffer)
        for ch in channels.values():
            ch.acquires = self._acquires(ch.expect_tx, set(channels))
        return list(channels.values())

    def _acquires(self, expect: Site, fulls: set) -> tuple:
        """The barriers (other than full ones) the producer waits on in the block where it announces
        a stage, nearest first: the candidates for the channel's empty barrier (producer_acquire).
        Which one it is, the consumers say (`_release_barriers`); so two acquires may come in any order."""
        stmts, index, _ = block_of(self.k, expect.path)
        def waited(block):
            return [s.bar.barrier for s in block if isinstance(s, ir.MbarrierWait) and s.bar.barrier not in fulls]
        before = waited(reversed(stmts[:index]))
        if not before:
            self.once("acquire", expect.path, f"the producer announces {ref_text(expect.stmt.bar)} without first "
                                              f"waiting for the stage to be free; put `mbarrier.wait empty[...] "
                                              f"phase(ph ^ 1)` (producer_acquire) before it")
        return tuple(dict.fromkeys(before + waited(stmts[index + 1:])))

    def _channel_declarations(self, ch: _Channel) -> None:
        barriers = {b.name: (j, b) for j, b in enumerate(self.k.barriers)}
        for name in filter(None, (ch.full, ch.empty)):
            if name not in barriers:
                continue
            j, bar = barriers[name]
            stages: dict[int, list[str]] = {}
            for buf in sorted(ch.buffers):
                decl = next((b for b in self.k.smem if b.name == buf and b.shape), None)
                if decl is not None and decl.shape[0] != bar.slots:
                    stages.setdefault(decl.shape[0], []).append(buf)
            for n, bufs in stages.items():
                self.r.barrier_decl(j, f"barrier {name} has {plural(bar.slots, 'slot')} but its channel "
                                       f"{'buffers' if len(bufs) > 1 else 'buffer'} {', '.join(bufs)} "
                                       f"{'have' if len(bufs) > 1 else 'has'} {plural(n, 'stage')}; a channel "
                                       f"has one full and one empty barrier per stage: declare {name}[{n}]")
        init = self.inits.get(ch.full)
        if init is not None and init.stmt.arrivals != 1:
            self.r.at(init.path, f"{ch.full} is initialised with arrivals({init.stmt.arrivals}), but a full "
                                 f"barrier's phase is completed by the one elected producer thread's "
                                 f"arrive_expect_tx (plus the TMA bytes); use arrivals(1)")

    def _same_nests(self, ch: _Channel) -> set:
        """Both sides' loop nests around the channel have the same bounds, after substituting
        lets and renaming loop variables by nest position. Returns the paths of the consumer
        roles whose nest differs (their stage sequence is not compared again on the traces)."""
        mismatched = set()
        producer = ch.expect_tx.loops()
        waits = [x for x in self.sites if isinstance(x.stmt, ir.MbarrierWait)
                 and x.stmt.bar.barrier == ch.full and x.role is not None]
        checked_roles = set()
        for wait in waits:
            if wait.role_path in checked_roles:
                continue
            checked_roles.add(wait.role_path)
            consumer = wait.loops()
            if len(consumer) != len(producer):
                names = lambda nest: " > ".join(f"for {f.var}" for f, _ in nest) or "no loop"  # noqa: E731
                self.r.at(wait.path, f"the consumer waits on {ch.full} inside {plural(len(consumer), 'loop')} "
                                     f"({names(consumer)}) but the producer fills it inside "
                                     f"{len(producer)} ({names(producer)}); {_SAME_ORDER}")
                mismatched.add(wait.role_path)
                continue
            p_rename: dict[str, ir.Expr] = {}
            c_rename: dict[str, ir.Expr] = {}
            for level, ((pf, ppath), (cf, cpath)) in enumerate(zip(producer, consumer)):
                p_lets, c_lets = _lets_before(self.k, ppath), _lets_before(self.k, cpath)
                p_bounds = [subst(e, p_lets) for e in (pf.start, pf.stop, pf.step)]
                c_bounds = [subst(e, c_lets) for e in (cf.start, cf.stop, cf.step)]
                same = ([subst(e, p_rename) for e in p_bounds] == [subst(e, c_rename) for e in c_bounds]
                        and _tile_kind(pf) == _tile_kind(cf))
                if not same:
                    spell = lambda f, b: f"{f.iteration}({', '.join(expr_text(e) for e in b)})"  # noqa: E731
                    self.r.at(cpath, f"the consumer's for {cf.var} runs {spell(cf, c_bounds)} but the "
                                     f"producer's for {pf.var} (IR line {self.r.line(ppath)}) runs "
                                     f"{spell(pf, p_bounds)}; {_SAME_ORDER}")
                    mismatched.add(wait.role_path)
                    break
                p_rename[pf.var] = c_rename[cf.var] = ir.Var(f"loop{level}")
        return mismatched


def _release_barriers(channels: list[_Channel], traces) -> None:
    """Set each channel's empty barrier: among the producer's acquires, the one the consumers
    release the channel's stages on. A consumer's arrive at slot e releases the one stage e it
    holds (waited on and read) whose wgmmas are no longer pending; each such arrive is a vote
    (most votes over one sample's consumer warpgroups win; a tie, or no traces, goes to the wait
    nearest the producer's announcement)."""
    fulls = {ch.full: ch for ch in channels}
    of_buffer = {b: ch.full for ch in channels for b in ch.buffers}
    votes = {ch.full: dict.fromkeys(ch.acquires, 0) for ch in channels}
    for _, events in traces.values():
        held: dict[tuple[str, int], bool] = {}          # (full, stage) acquired -> read since
        open_group: list = []
        groups: list[list] = []
        for e in events:
            if e.op == "wait" and e.bar in fulls:
                held[(e.bar, e.slot)] = False
            elif e.op == "mma":
                reads = [(of_buffer[buf], index[0]) for buf, index, _ in e.refs if buf in of_buffer and index]
                open_group += reads
                held.update((r, True) for r in reads if r in held)
            elif e.op == "commit":
                groups, open_group = groups + [open_group], []
            elif e.op == "mma_wait":
                groups = groups[len(groups) - e.value:] if e.value else []
            elif e.op == "arrive":
                pending = {r for g in groups + [open_group] for r in g}
                free = [key for key, read in held.items() if read and key[1] == e.slot and key not in pending]
                if len(free) == 1 and e.bar in votes[free[0][0]]:
                    votes[free[0][0]][e.bar] += 1
                    del held[free[0]]
    for ch in channels:
        ch.empty = max(ch.acquires, key=lambda name: votes[ch.full][name]) if ch.acquires else None


# -- running the roles on the host -----------------------------------------------------------------


@dataclass(frozen=True)
class _Sample:
    env: dict
    text: str
    loaded: int = 0           # the value every `ld.global` reads (global tensors are not traced)


def _samples(kernel: ir.Kernel) -> list[_Sample]:
    """A few problem sizes (every i32 param gets a value, and every `ld.global` the first of
    them; several k-tile counts around typical stage counts, partial tiles included) and CTA positions; the last one long enough that each
    of the two tiles traced walks every stage of a ring of up to 7 more than once (a release
    is only checked on a stage the producer fills again); and one whose leading sizes are 1 (one
    batch entry: a CTA's second tile is the last of the tile order, where a causal kernel that
    walks its heaviest tiles first has its tile with no kv step)."""
    ints = ((256, 384, 320, 192, 448, 130), (384, 130, 200, 448, 256, 320), (130, 256, 64, 320, 192, 384),
            (1000, 1030, 968, 1100, 1160, 900), (1, 1, 320, 192, 448, 130))
    ctas = ((0, 2), (1, 3), (0, 1), (1, 2), (0, 2))
    reads_globals = any(isinstance(s, ir.LoadGlobal) for s in ir.walk(kernel.body))
    out = []
    for values, (cta, num) in zip(ints, ctas):
        env: dict = {}
        scalars = [p for p in kernel.params if isinstance(p, ir.ScalarParam)]
        for i, p in enumerate(scalars):
            if isinstance(p, ir.HostParam):   # as the host computes it, on a device of _SAMPLE_SMS SMs
                try:
                    env[p.name] = evaluate(p.value, dict(env, num_sms=_SAMPLE_SMS))
                except (KeyError, ZeroDivisionError, TypeError, ValueError):
                    env[p.name] = 1
                continue
            env[p.name] = values[i % len(values)] if p.dtype not in FLOAT_DTYPES else 1.0
        env.update(cta_id=cta, num_ctas=num)
        text = ", ".join(f"{k}={v}" for k, v in env.items())
        if reads_globals:   # a length read from memory takes a size of the sample, like a scalar param
            text += f", every ld.global reads {values[0]}"
        out.append(_Sample(env, text, values[0]))
    return out


_SAMPLE_SMS = 132   # the SM count host params are computed for (an H100 / H200)


def _tile_kind(loop: ir.For) -> str:
    """A CTA's tile loop, strided (`persistent`) or taken from a counter (`dynamic`), or another
    loop (serial and unroll walk the same iterations)."""
    return loop.iteration if loop.iteration in ("persistent", "dynamic") else "serial"


@dataclass(frozen=True)
class _Event:
    op: str                            # wait | arrive | expect_tx | mma | commit | mma_wait |
    path: tuple[int, ...]              # smem_write | fence_proxy | bar_sync | tma_store
    bar: str = ""
    slot: int = -1
    value: int = 0                     # wait: parity; mma_wait: pending groups
    refs: tuple = ()                   # smem touched: ((buffer, index values, text), ...)
    point: tuple = ()                  # ((loop var, value), ...), outermost first


class _Abort(Exception):
    """A sample the host cannot run (unbound name, division by zero, too many steps)."""


class _Stop(Exception):
    """`return`: the warpgroup leaves the kernel."""


class _Tracer:
    MAX_STEPS = 200_000
    PERSISTENT_TILES = 2

    def __init__(self, kernel: ir.Kernel, env: dict, loaded: int):
        self.k = kernel
        self.env = env
        self.loaded = loaded
        self.steps = 0
        self.traces: dict[tuple[tuple[int, ...], int], tuple[ir.Role, list[_Event]]] = {}

    def run(self):
        try:
            self._exec(self.k.body, (), dict(self.env), (), None)
        except _Abort:
            return None
        return self.traces

    def _eval(self, e, env):
        try:
            return evaluate(e, env)
        except (KeyError, ZeroDivisionError, TypeError, ValueError):
            raise _Abort() from None

    def _exec(self, stmts, prefix, env, point, out, offset=0) -> None:
        for i, s in enumerate(stmts):
            path = prefix + (offset + i,)
            self.steps += 1
            if self.steps > self.MAX_STEPS:
                raise _Abort()
            if isinstance(s, ir.Let):
                env[s.name] = self._eval(s.value, env)
            elif isinstance(s, ir.Assign):
                env[s.name] = self._eval(s.value, env)
            elif isinstance(s, ir.For) and s.iteration == "dynamic":
                # the next tile is the body's `var` (a counter's value: a ld.shared reads 0 here)
                v, stop = self._eval(s.start, env), self._eval(s.stop, env)
                for n in range(self.PERSISTENT_TILES):
                    if v >= stop:
                        break
                    env[s.var] = v
                    self._exec(s.body, path, env, point + ((s.var, v),), out)
                    v = self._eval(s.step, env)
            elif isinstance(s, ir.For):
                start, stop, step = (self._eval(e, env) for e in (s.start, s.stop, s.step))
                if step <= 0:
                    raise _Abort()
                limit = self.PERSISTENT_TILES if s.iteration == "persistent" else None
                for n, v in enumerate(range(start, stop, step)):
                    if limit is not None and n == limit:
                        break
                    env[s.var] = v
                    self._exec(s.body, path, env, point + ((s.var, v),), out)
            elif isinstance(s, ir.If):
                if self._eval(s.cond, env):
                    self._exec(s.then, path, env, point, out)
                else:
                    self._exec(s.orelse, path, env, point, out, len(s.then))
            elif isinstance(s, ir.Role):
                if out is not None:
                    raise _Abort()
                for wg in range(s.warpgroups):
                    events: list[_Event] = []
                    try:
                        self._exec(s.body, path, dict(env, wg=wg), (), events)
                    except _Stop:
                        pass
                    self.traces[(path, wg)] = (s, _without_rewaits(events))
            elif isinstance(s, ir.ElectOne):
                self._exec(s.body, path, env, point, out)
            elif isinstance(s, ir.Return):
                if out is not None:
                    raise _Stop()
            elif isinstance(s, ir.LoadShared):
                env[s.name] = 0     # smem values are not traced: a ticket reads as the first arrival
            elif isinstance(s, ir.LoadGlobal):
                # nor global ones: every element reads as the sample's size, but a spans table's
                # first kv block reads 0 (so that its count, the size, bounds a tile of many steps)
                first_of_span = (isinstance(self.k.param(s.tensor), ir.SpanParam)
                                 and s.coords[-1] == ir.IntConst(0))
                env[s.name] = 0 if first_of_span else self.loaded
            elif out is not None:
                event = self._event(s, path, env, point)
                if event is not None:
                    out.append(event)

    def _event(self, s, path, env, point) -> "_Event | None":
        if isinstance(s, ir.MbarrierWait):
            return _Event("wait", path, s.bar.barrier, self._eval(s.bar.index, env),
                          self._eval(s.phase, env), point=point)
        if isinstance(s, ir.MbarrierArrive):
            return _Event("arrive", path, s.bar.barrier, self._eval(s.bar.index, env), point=point)
        if isinstance(s, ir.MbarrierArriveExpectTx):
            return _Event("expect_tx", path, s.bar.barrier, self._eval(s.bar.index, env), point=point)
        if isinstance(s, ir.Wgmma):
            refs = [r for r in (s.a, s.b) if isinstance(r, ir.SmemRef)]
            return _Event("mma", path, refs=self._refs(refs, env), point=point)
        if isinstance(s, ir.TileStoreSmem):
            return _Event("smem_write", path, refs=self._refs([s.dst], env), point=point)
        if isinstance(s, ir.TmaStore):
            return _Event("tma_store", path, refs=self._refs([s.src], env), point=point)
        if isinstance(s, ir.NamedBarrierSync):          # value: the threads it counts
            return _Event("bar_sync", path, value=s.threads, point=point)
        op = _PLAIN_EVENTS.get(type(s))
        if op is not None:
            return _Event(op, path, value=getattr(s, "pending", 0), point=point)
        return None

    def _refs(self, refs, env) -> tuple:
        return tuple((r.buffer, tuple(self._eval(i, env) for i in r.index), _spelled(r)) for r in refs)


@functools.lru_cache(maxsize=4096)
def _spelled(ref: ir.SmemRef) -> str:
    """`ref_text`, once per reference (the traces name the same few references many times)."""
    return ref_text(ref)


_PLAIN_EVENTS = {ir.WgmmaCommit: "commit", ir.WgmmaWait: "mma_wait", ir.FenceProxyAsync: "fence_proxy"}


def _without_rewaits(events: list[_Event]) -> list[_Event]:
    """The trace without waits that repeat the warpgroup's previous event: a second wait on the
    same slot and parity right after the first passes at once (that slot's next phase needs,
    through the other side of the channel, an arrival this warpgroup has not made yet), so it is
    the same acquire, not another use of the stage."""
    out: list[_Event] = []
    for e in events:
        if out and e.op == "wait" and (out[-1].op, out[-1].bar, out[-1].slot, out[-1].value) == (
                "wait", e.bar, e.slot, e.value):
            continue
        out.append(e)
    return out


# -- the contract on one sample's traces ----------------------------------------------------------


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two references (buffer, index values) may touch the same elements."""
    n = min(len(a[1]), len(b[1]))
    return a[0] == b[0] and a[1][:n] == b[1][:n]


@dataclass
class _Use:
    slot: int
    wait: _Event
    releases: int = 0


class _TraceCheck:
    """The contract on one sample's traces: the same stage sequence on both sides of every
    channel, the parity each use must wait for, the arrivals that release a stage, and no release
    while a wgmma reading the stage may be pending."""

    def __init__(self, contract: ContractCheck, channels: list[_Channel], traces, sample: _Sample):
        self.c = contract
        self.k = contract.k
        self.channels = channels
        self.traces = traces
        self.sample = sample

    def where(self, role: ir.Role, wg: int, e: _Event) -> str:
        point = ", ".join(f"{v}={x}" for v, x in e.point)
        if role.warpgroups > 1:
            point = f"wg={wg}" + (f", {point}" if point else "")
        return f"{point} ({self.sample.text})" if point else f"({self.sample.text})"

    def run(self) -> None:
        for ch in self.channels:
            produced = self._producer(ch)
            if produced is None:
                continue
            fills, points = produced
            assigned: dict[tuple, list[int]] = {}      # trace key -> the fill each of its waits is for
            for key, (role, events) in self.traces.items():
                waits = [e for e in events if e.op == "wait" and e.bar == ch.full]
                if (waits and key[0] not in ch.mismatched_roles
                        and not any(e.op == "expect_tx" and e.bar == ch.full for e in events)):
                    assigned[key] = self._assign(fills, points, waits)
                    self._consumer(ch, fills, role, key[1], waits, assigned[key])
                    self._handed_over(ch, fills, role, key[1], events, assigned[key])
                    self._converged_releases(ch, role, key[1], events)
            self._covered(ch, fills, points, assigned)
            if ch.empty is not None:
                self._releases(ch, fills, assigned)
        for key, (role, events) in self.traces.items():
            self._wgmma_groups(role, key[1], events)
            self._generic_writes(role, key[1], events)

    def _producer(self, ch: _Channel) -> "tuple[list[int], list[tuple]] | None":
        """The stages the producer fills, in order, and the loop point of each fill (its loop
        counters' values); checks its acquire of each and the parity of every acquire (the j-th
        use of a stage waits with parity (j & 1) ^ 1)."""
        producers = [(key, role, events) for key, (role, events) in self.traces.items()
                     if any(e.op == "expect_tx" and e.bar == ch.full for e in events)]
        if not producers:
            return None
        if len(producers) > 1:
            names = ", ".join(f"role {role.name} wg {key[1]}" for key, role, _ in producers)
            self.c.once("producers", ch.expect_tx.path,
                        f"{len(producers)} warpgroups ({names}) arrive on {ch.full} for every stage; a full "
                        f"barrier is completed by one elected producer thread: issue the loads from one "
                        f"warpgroup")
        (_, wg), role, events = producers[0]
        fills: list[int] = []
        points: list[tuple] = []
        uses: dict[int, int] = {}
        acquire = None
        for i, e in enumerate(events):
            if e.op == "wait" and ch.empty is not None and e.bar == ch.empty:
                acquire = e
            elif e.op == "expect_tx" and e.bar == ch.full:
                j = uses.get(e.slot, 0)
                uses[e.slot] = j + 1
                fills.append(e.slot)
                points.append(tuple(v for _, v in e.point))
                if ch.empty is None:
                    continue
                if acquire is None:
                    late = next((x for x in events[i + 1:] if x.op == "wait" and x.bar == ch.empty
                                 and x.point == e.point), None)
                    hint = (f": its wait on {ch.empty} (IR line {self.c.r.line(late.path)}) comes after the fill, "
                            f"move it above" if late is not None else "")
                    self.c.once("acquire", e.path,
                                f"at {self.where(role, wg, e)} the producer fills stage {e.slot} without "
                                f"waiting on {ch.empty} first{hint}; every fill waits for the stage to be free")
                elif acquire.slot != e.slot:     # (an acquire after an unacquired fill: that fill said it)
                    self.c.once("acquire", acquire.path,
                                f"at {self.where(role, wg, e)} the producer waits on {ch.empty} stage "
                                f"{acquire.slot} but then fills stage {e.slot}; wait on the stage it fills",
                                cause=e.path)
                elif acquire.value != (j & 1) ^ 1:
                    self.c.once("parity", acquire.path,
                                f"at {self.where(role, wg, acquire)} the producer waits on {ch.empty} stage "
                                f"{e.slot} with phase({acquire.value}), its {ordinal(j + 1)} use of the "
                                f"stage; the parity must be {(j & 1) ^ 1}, the consumer's phase {j & 1} "
                                f"XOR 1 (the first pass through a stage is free, each later one waits for "
                                f"the previous release)")
                acquire = None
        return fills, points

    @staticmethod
    def _assign(fills: list[int], points: list[tuple], waits: list[_Event]) -> list[int]:
        """The fill each of a consumer warpgroup's waits is for. A warpgroup that waits as often
        as the producer fills takes every fill in order (the i-th wait, the i-th fill). One that
        waits less often takes the tiles given to it (matmul's ping-pong: every other tile per
        warpgroup): each wait is for the fill at its own loop point (both nests run the same
        loops, checked statically), and a wait at a point the producer never fills at takes the
        next fill in order."""
        if len(waits) >= len(fills):
            return list(range(len(waits)))
        at = {}
        for i, p in enumerate(points):
            at.setdefault(p, i)
        out, last = [], -1
        for w in waits:
            i = at.get(tuple(v for _, v in w.point))
            last = i if i is not None and i > last else last + 1
            out.append(last)
        return out

    def _consumer(self, ch, fills, role, wg, waits, assigned) -> None:
        """Each of the consumer's waits on `full` is for the fill `_assign` gives it (in order, the
        i-th wait for the i-th fill): same stage, and the parity of that fill's phase."""
        use_of = []                          # the j-th use of its stage, per fill
        uses: dict[int, int] = {}
        for slot in fills:
            use_of.append(uses.get(slot, 0))
            uses[slot] = use_of[-1] + 1
        for w, i in zip(waits, assigned):
            if i >= len(fills):
                self.c.once("sequence", w.path,
                            f"at {self.where(role, wg, w)} the consumer waits on {ch.full} for a fill the "
                            f"producer never makes (it fills {len(fills)} stages here): deadlock; {_SAME_ORDER}")
                return
            slot = fills[i]
            if w.slot != slot:
                self.c.once("sequence", w.path,
                            f"at {self.where(role, wg, w)} the consumer waits on {ch.full} stage {w.slot} "
                            f"but the producer's {ordinal(i + 1)} fill went to stage {slot}; both sides "
                            f"must compute the stage from the same counter (stage = it % S)")
                return
            j = use_of[i]
            if w.value != j & 1:
                self.c.once("parity", w.path,
                            f"at {self.where(role, wg, w)} the consumer waits on {ch.full} stage {slot} with "
                            f"phase({w.value}), the {ordinal(j + 1)} use of the stage, which completes "
                            f"phase {j}; the parity must be {j & 1} (phase = (it / S) & 1)")
                return

    def _handed_over(self, ch, fills, role, wg, events, assigned) -> None:
        """A warpgroup that skips fills (the stages of other warpgroups' tiles) must be ordered
        after the warpgroups whose fills it skips: its wait's parity is also that of an older
        phase of the stage, so nothing but a barrier both warpgroups reach (ping-pong's token,
        more threads than one warpgroup's) keeps it from passing early and reading a stage the
        producer has not refilled yet."""
        prev, handed, n = -1, False, 0
        for e in events:
            if e.op == "bar_sync" and e.value > WARPGROUP_THREADS:
                handed = True
            elif e.op == "wait" and e.bar == ch.full:
                i = assigned[n]
                n += 1
                if i > prev + 1 and not handed and i < len(fills):
                    others = f"fill {prev + 2}" if i == prev + 2 else f"fills {prev + 2}..{i}"
                    self.c.once("handover", e.path,
                                f"at {self.where(role, wg, e)} the consumer waits on {ch.full} stage {e.slot} for the "
                                f"producer's {ordinal(i + 1)} fill, but {others} before it are other warpgroups': "
                                f"nothing orders this wait after their use of the stages, and its parity is also "
                                f"that of an older phase, so it can pass before the refill; hand the mainloop "
                                f"over with a named barrier both warpgroups reach between their tiles (mode="
                                f"'pingpong' syncs on `bar.sync 3 + wg, 256` before its k loop)")
                    return
                prev, handed = max(prev, i), False

    def _covered(self, ch, fills, points, assigned) -> None:
        """Every fill is waited for by some consumer warpgroup: otherwise the producer blocks on
        a stage nobody releases."""
        if not assigned:
            return
        taken = {i for found in assigned.values() for i in found}
        missed = next((i for i in range(len(fills)) if i not in taken), None)
        if missed is None:
            return
        key, found = max(assigned.items(), key=lambda kv: len(kv[1]))
        waits = [e for e in self.traces[key][1] if e.op == "wait" and e.bar == ch.full]
        if len({tuple(f) for f in assigned.values()}) == 1:     # every warpgroup takes the same fills
            self.c.once("sequence", waits[0].path,
                        f"the consumer waits on {ch.full} {len(found)} times ({self.sample.text}) but the "
                        f"producer fills {len(fills)} stages; the producer blocks on a stage nobody "
                        f"releases: {_SAME_ORDER}")
            return
        point = ", ".join(f"{v}={x}" for v, x in zip((v for v, _ in waits[0].point), points[missed]))
        self.c.once("sequence", waits[0].path,
                    f"no consumer warpgroup waits on {ch.full} for the producer's {ordinal(missed + 1)} fill "
                    f"(stage {fills[missed]}, at {point}; {self.sample.text}): the producer blocks on a stage "
                    f"nobody releases; every tile's stages need a warpgroup that takes them")

    def _converged_releases(self, ch: _Channel, role: ir.Role, wg: int, events) -> None:
        """One thread releases a stage, so every warp of its warpgroup must have passed the wait
        on the stage first: a wgmma (warpgroup-collective) or a bar.sync of the warpgroup
        between the wait and the release. Otherwise the producer may complete the full
        barrier's next phase too, and a warp still waiting for parity p sees p again: it waits
        one phase behind for ever (a tile whose k loop runs no iteration does this)."""
        waited: dict[int, tuple[_Event, bool]] = {}      # slot -> (its latest wait, converged since)
        for e in events:
            if e.op == "wait" and e.bar == ch.full:
                waited[e.slot] = (e, False)
            elif e.op in ("mma", "bar_sync"):
                waited = {slot: (w, True) for slot, (w, _) in waited.items()}
            elif e.op == "arrive" and e.bar == ch.empty and e.slot in waited:
                wait, converged = waited.pop(e.slot)
                if not converged:
                    self.c.once("converge", e.path,
                                f"at {self.where(role, wg, e)} one thread releases {ch.empty} stage {e.slot} "
                                f"while the other warps of its warpgroup may not have passed the wait on "
                                f"{ch.full} (IR line {self.c.r.line(wait.path)}): no wgmma or bar.sync between "
                                f"them on this path, so the producer can complete {ch.full}'s next phase too "
                                f"and a late warp waits a phase behind for ever; put the warpgroup's "
                                f"`bar.sync 1 + wg, 128` before the release")

    def _releases(self, ch: _Channel, fills, assigned) -> None:
        """Each use of a stage that the producer fills again later is released the same number of
        times by every consumer warpgroup; the empty barrier's arrivals are the sum of those over
        the warpgroups that take the fill."""
        later: set[int] = set()
        reused = []                      # whether the producer fills each use's stage again later
        for slot in reversed(fills):
            reused.append(slot in later)
            later.add(slot)
        reused.reverse()
        takers: dict[int, list[tuple[tuple[int, ...], ir.Role, int]]] = {}   # fill -> (role path, role, releases)
        for (rpath, wg), (role, events) in self.traces.items():
            if rpath in ch.mismatched_roles or (rpath, wg) not in assigned:
                continue
            fill_of = assigned[(rpath, wg)]
            uses: list[_Use] = []
            current: dict[int, int] = {}
            for e in events:
                if e.op == "wait" and e.bar == ch.full:
                    current[e.slot] = len(uses)
                    uses.append(_Use(e.slot, e))
                elif e.op == "arrive" and e.bar == ch.empty:
                    if e.slot in current:
                        uses[current[e.slot]].releases += 1
                    else:
                        self.c.once("release", e.path,
                                    f"at {self.where(role, wg, e)} the consumer releases {ch.empty} stage "
                                    f"{e.slot} before it ever waited on {ch.full} for it; release a stage "
                                    f"only after using it")
            counts = set()
            for i, use in enumerate(uses[:len(fill_of)]):
                if fill_of[i] >= len(fills) or not reused[fill_of[i]]:
                    continue
                if use.releases == 0:
                    self.c.once("release", use.wait.path,
                                f"at {self.where(role, wg, use.wait)} the consumer never releases stage "
                                f"{use.slot} before its next use; the producer's wait on {ch.empty} "
                                f"deadlocks: arrive on {ch.empty} once the wgmmas reading the stage are done")
                counts.add(use.releases)
            if 0 in counts:
                continue
            if len(counts) > 1:
                self.c.once("release-count", next(u.wait.path for u in uses),
                            f"the consumer releases its stages {' or '.join(map(str, sorted(counts)))} times "
                            f"per use ({self.sample.text}); release every use exactly the same number of "
                            f"times")
            elif counts:
                count = counts.pop()
                for i in fill_of:
                    if i < len(fills) and reused[i]:
                        takers.setdefault(i, []).append((rpath, role, count))
        init = self.c.inits.get(ch.empty)
        if init is None or not takers:
            return
        totals = {i: sum(count for _, _, count in found) for i, found in sorted(takers.items())}
        (i, a), *rest = totals.items()
        other = next(((j, b) for j, b in rest if b != a), None)
        if other is not None:
            j, b = other
            self.c.once("arrivals", init.path,
                        f"{ch.empty}'s stages are released by {plural(a, 'consumer arrival')} at the producer's "
                        f"{ordinal(i + 1)} fill but by {b} at its {ordinal(j + 1)} ({self.sample.text}): the "
                        f"consumer warpgroups take different fills different numbers of times, and no one "
                        f"arrivals({init.stmt.arrivals}) fits both; every fill needs the same warpgroups' releases")
            return
        if init.stmt.arrivals == a:          # every fill is released the same number of times: a
            return
        per_role: dict[tuple[int, ...], tuple[ir.Role, list[int]]] = {}
        for rpath, role, count in takers[i]:
            per_role.setdefault(rpath, (role, []))[1].append(count)
        parts = ", ".join(
            f"role {role.name}: " + (f"{plural(len(counts), 'warpgroup')} × {plural(counts[0], 'arrive')}"
                                     if len(set(counts)) == 1 else f"{' + '.join(map(str, counts))} arrives")
            for role, counts in per_role.values())
        self.c.once("arrivals", init.path,
                    f"{ch.empty} is initialised with arrivals({init.stmt.arrivals}) but {a} consumer "
                    f"arrivals release each stage ({parts}); use arrivals({a})")

    def _wgmma_groups(self, role: ir.Role, wg: int, events) -> None:
        """Release only what no pending wgmma group reads; read only stages this warpgroup holds."""
        of_buffer = {b: ch for ch in self.channels for b in ch.buffers}
        of_empty = {ch.empty: ch for ch in self.channels if ch.empty is not None}
        fulls = {ch.full for ch in self.channels}
        held: set[tuple[str, int]] = set()
        open_group: list[tuple[tuple, _Event]] = []
        groups: list[list[tuple[tuple, _Event]]] = []
        for e in events:
            if e.op == "wait" and e.bar in fulls:
                held.add((e.bar, e.slot))
            elif e.op == "mma":
                for read in e.refs:
                    ch = of_buffer.get(read[0])
                    if ch is None or not read[1]:
                        continue
                    stage = read[1][0]
                    if (ch.full, stage) not in held:
                        self.c.once("held", e.path,
                                    f"at {self.where(role, wg, e)} wgmma.mma reads {read[2]} (stage {stage}) "
                                    f"but this warpgroup does not hold that stage; wait on "
                                    f"{ch.full}[{stage}] first and release it only after the wgmma")
                open_group.extend((read, e) for read in e.refs)
            elif e.op == "smem_write":
                pending = [mma for g in groups + [open_group] for read, mma in g if _overlap(read, e.refs[0])]
                if pending:
                    self.c.once("pending-write", e.path,
                                f"at {self.where(role, wg, e)} tile.store_smem overwrites {e.refs[0][2]} while the "
                                f"wgmma reading it (IR line {self.c.r.line(pending[0].path)}) may be pending; put "
                                f"`wgmma.wait 0` (or wait for that group) before the write")
            elif e.op == "commit":
                groups.append(open_group)
                open_group = []
            elif e.op == "mma_wait":
                groups = groups[len(groups) - e.value:] if e.value else []
            elif e.op == "arrive" and e.bar in of_empty:
                ch = of_empty[e.bar]
                pending = [(read, mma) for g in groups + [open_group] for read, mma in g
                           if read[0] in ch.buffers and read[1][:1] == (e.slot,)]
                if pending:
                    names = " and ".join(dict.fromkeys(read[2] for read, _ in pending))
                    line = self.c.r.line(pending[0][1].path)
                    self.c.once("pending", e.path,
                                f"consumer releases {ref_text(statement_at(self.k, e.path).bar)} (stage "
                                f"{e.slot}, at {self.where(role, wg, e)}) before the wgmma reading {names} "
                                f"(IR line {line}) has completed; put `wgmma.wait 0` (or wait for that "
                                f"group) before the release")
                held.discard((ch.full, e.slot))

    def _generic_writes(self, role: ir.Role, wg: int, events) -> None:
        """A tile.store_smem is seen by the async proxy only after `fence.proxy.async`; a TMA store
        issued by one thread also needs the warpgroup barrier that says every thread has written."""
        written: list[tuple[tuple, _Event, bool]] = []      # (reference, write, fenced)
        for e in events:
            if e.op == "smem_write":
                written.append((e.refs[0], e, False))
            elif e.op == "fence_proxy":
                written = [(ref, w, True) for ref, w, _ in written]
            elif e.op == "bar_sync":
                written = [x for x in written if not x[2]]
            elif e.op in ("tma_store", "mma"):
                for read in e.refs:
                    for ref, write, fenced in written:
                        if not _overlap(ref, read) or (fenced and e.op == "mma"):
                            continue
                        line = self.c.r.line(write.path)
                        missing = ("`bar.sync` of the warpgroup after the fence (one thread issues the "
                                   "copy of what every thread wrote)" if fenced else
                                   "`fence.proxy.async` and then a `bar.sync` of the warpgroup"
                                   if e.op == "tma_store" else "`fence.proxy.async`")
                        self.c.once("proxy", e.path,
                                    f"at {self.where(role, wg, e)} {keyword(statement_at(self.k, e.path))} "
                                    f"reads {read[2]}, written by tile.store_smem {ref[2]} (IR line {line}) "
                                    f"with generic stores; put {missing} between the write and this read",
                                    cause=write.path)
