"""CPU simulator of the loop IR: the reference semantics of every node, and the tool that catches
protocol bugs (deadlocks, slot races, expect_tx mismatches) before they hang a GPU.

    report = simulate(kernel, {"M": 256, "a": a, "b": b, "c": c}, num_sms=4, seed=0)

Execution model (`ir`'s module docstring is the contract; this file is its executable form):

* Every CTA of the grid (`kernel.grid` evaluated with `num_sms` and the scalar arguments) runs
  as one coroutine per warpgroup (Python generators). At most `num_sms` CTAs are resident at a
  time; the next one starts when a CTA exits (waves, as on a GPU with one CTA per SM).
* Kernel-level statements are executed by every warpgroup for control flow and bindings, but
  their side effects (mbarrier.*, fences, TMA, global/smem stores) happen once per CTA, by its
  first warpgroup ("thread 0"). `syncthreads` is the CTA barrier over the warpgroups still
  running. A `Role` runs its body in the warpgroups it owns, with `wg` bound.
* Scheduling: at every step a seeded `random.Random` picks one runnable coroutine (which runs
  one statement) or one pending asynchronous operation (which progresses: a TMA load lands, a
  TMA store reads smem or writes global). A coroutine blocked on a wait is parked until the
  state it waits on changes, then retries. No runnable coroutine and nothing asynchronous in
  flight is a deadlock.
* mbarriers count arrivals, transaction bytes and phases like the hardware: a phase completes
  when all arrivals are in and tx is zero; `mbarrier.wait b phase(p)` passes once the phase of
  parity p has completed (current parity != p).
* wgmma results land at the `wgmma.wait` that covers their commit group; the math is
  acc = (accumulate ? acc : 0) + A @ B in fp32 with one torch matmul per `wgmma.mma`.

Race detection is happens-before, not timing, so a protocol bug is reported on every seed:
every coroutine carries a vector clock (own epochs plus, per mbarrier, the number of completed
phases it has observed). Releases (mbarrier.arrive, bar.sync / bar.arrive, syncthreads) publish
the clock, acquires (a passing mbarrier.wait, bar.sync, syncthreads) merge it. Each smem region
remembers its last write and the reads since then:

* an async read (wgmma, TMA store) needs the last write to be known complete: a TMA load whose
  barrier phase the reader has observed, or a `tile.store_smem` followed by
  `fence.proxy.async` (by the writer) that the reader is ordered after;
* a write (TMA load at issue, `tile.store_smem`) needs every read since the previous write to
  have ended (wgmma.wait / tma.wait.read) and that end to be known to the writer — a consumer
  that releases a stage before its `wgmma.wait` is caught even when the timing was lucky.

TMA box <-> smem sub-array: a box whose 2-D [rows, cols] shape (leading extent-1 dims dropped)
equals the tile a sub-array holds (`ir.tile_shape_of_subarray`) is written as that tile (column
chunks for a (chunks, R, W) sub-array); any other box of the same volume is written in memory
order (a [128, 64] box into a (2, 64, 64) sub-array fills [0] with rows 0-63 and [1] with rows
64-127, as `A[s]` / `A[s, wg]` use it).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass, fields
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from . import ir
from .printer import print_expr, print_stmt

__all__ = ["simulate", "SimReport", "SimulationError", "DeadlockError", "RaceError", "ProtocolError"]


class SimulationError(RuntimeError):
    """The simulated kernel did something wrong (or was called wrongly)."""


class DeadlockError(SimulationError):
    """Every coroutine is blocked and nothing asynchronous is in flight (or max_steps ran out)."""


class RaceError(SimulationError):
    """A shared-memory region or register tile was accessed without the required ordering."""


class ProtocolError(SimulationError):
    """A rule of the execution model was broken (barrier use, tx bytes, shapes, names...)."""


@dataclass
class SimReport:
    """What one simulation did: steps taken, CTAs run, and event counters."""

    steps: int = 0
    num_ctas: int = 0
    tma_loads: int = 0
    tma_stores: int = 0
    tma_bytes_loaded: int = 0
    tma_bytes_stored: int = 0
    wgmmas: int = 0
    barrier_phases: int = 0
    named_barrier_syncs: int = 0

    @property
    def counters(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("steps", "num_ctas")}


_TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}
_REG_ROUND = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": None, "i32": torch.int32}


def _round(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values rounded to `dtype` (the register tile's declared type), kept as fp32."""
    target = _REG_ROUND[dtype]
    return t if target is None else t.to(target).float()


# ---------------------------------------------------------------------------------------------
# Expressions: compiled once per kernel into closures over the coroutine's env dict
# ---------------------------------------------------------------------------------------------


class _Undefined(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _ExprError(Exception):
    pass


class _ReturnSignal(Exception):
    pass


Closure = Callable[[dict], "int | float"]


def _int_args(sym: str, a, b) -> None:
    if type(a) is not int or type(b) is not int:
        raise _ExprError(f"'{sym}' needs integers, got {a!r} and {b!r}")


def _float_div(a, b):
    if b == 0:  # IEEE like the GPU, not Python's ZeroDivisionError
        return math.nan if a == 0 else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _build_division(what: str, int_op, float_op) -> Callable[[Closure, Closure], Closure]:
    """`/` and `%`: floor semantics on integers, IEEE (no exception) on floats."""
    def build(l: Closure, r: Closure) -> Closure:
        def division(env):
            a, b = l(env), r(env)
            if type(a) is int and type(b) is int:
                if b == 0:
                    raise _ExprError(f"integer {what} by zero")
                return int_op(a, b)
            return float_op(a, b)
        return division
    return build


_build_div = _build_division("division", lambda a, b: a // b, _float_div)
_build_mod = _build_division("modulo", lambda a, b: a % b, lambda a, b: math.fmod(a, b) if b != 0 else math.nan)


def _build_bitwise(sym: str, fn: Callable[[int, int], int]) -> Callable[[Closure, Closure], Closure]:
    def build(l: Closure, r: Closure) -> Closure:
        def bitwise(env):
            a, b = l(env), r(env)
            _int_args(sym, a, b)
            if sym in ("<<", ">>") and b < 0:
                raise _ExprError(f"negative shift count {b}")
            return fn(a, b)
        return bitwise
    return build


_BINARY_BUILDERS: dict[str, Callable[[Closure, Closure], Closure]] = {
    "+": lambda l, r: lambda env: l(env) + r(env),
    "-": lambda l, r: lambda env: l(env) - r(env),
    "*": lambda l, r: lambda env: l(env) * r(env),
    "/": _build_div,
    "%": _build_mod,
    "==": lambda l, r: lambda env: 1 if l(env) == r(env) else 0,
    "!=": lambda l, r: lambda env: 1 if l(env) != r(env) else 0,
    "<": lambda l, r: lambda env: 1 if l(env) < r(env) else 0,
    "<=": lambda l, r: lambda env: 1 if l(env) <= r(env) else 0,
    ">": lambda l, r: lambda env: 1 if l(env) > r(env) else 0,
    ">=": lambda l, r: lambda env: 1 if l(env) >= r(env) else 0,
    "&&": lambda l, r: lambda env: 1 if (l(env) and r(env)) else 0,
    "||": lambda l, r: lambda env: 1 if (l(env) or r(env)) else 0,
    "&": _build_bitwise("&", lambda a, b: a & b),
    "|": _build_bitwise("|", lambda a, b: a | b),
    "^": _build_bitwise("^", lambda a, b: a ^ b),
    "<<": _build_bitwise("<<", lambda a, b: a << b),
    ">>": _build_bitwise(">>", lambda a, b: a >> b),
}


def _ceil_div(a, b):
    if type(a) is int and type(b) is int:
        if b == 0:
            raise _ExprError("ceil_div by zero")
        return -(-a // b)
    return float(math.ceil(_float_div(a, b)))


def _compile_expr(e: ir.Expr) -> Closure:
    if isinstance(e, (ir.IntConst, ir.FloatConst)):
        value = e.value
        return lambda env: value
    if isinstance(e, ir.Var):
        name = e.name

        def var(env):
            try:
                return env[name]
            except KeyError:
                raise _Undefined(name) from None
        return var
    if isinstance(e, ir.BinOp):
        build = _BINARY_BUILDERS.get(e.op)
        if build is None:
            raise ProtocolError(f"unknown binary operator {e.op!r} in {_expr_text(e)}")
        fn = build(_compile_expr(e.lhs), _compile_expr(e.rhs))
    elif isinstance(e, ir.Call):
        if ir.CALLS.get(e.func) != len(e.args):
            raise ProtocolError(f"unknown call or wrong arity: {_expr_text(e)} "
                                f"(builtins: {', '.join(f'{k}/{n}' for k, n in ir.CALLS.items())})")
        args = [_compile_expr(a) for a in e.args]
        if e.func == "select":
            c, a, b = args
            fn = lambda env: a(env) if c(env) else b(env)  # noqa: E731
        else:
            a, b = args
            op = {"min": min, "max": max, "ceil_div": _ceil_div}[e.func]
            fn = lambda env: op(a(env), b(env))  # noqa: E731
    else:
        raise ProtocolError(f"not an expression: {e!r}")
    if next(ir.expr_vars(e), None) is None:  # constant: fold it (errors stay at run time)
        try:
            value = fn({})
        except _ExprError:
            return fn
        return lambda env: value
    return fn


# ---------------------------------------------------------------------------------------------
# Text of statements for messages (one line, the text form's spelling)
# ---------------------------------------------------------------------------------------------


def _expr_text(e: ir.Expr) -> str:
    try:
        return print_expr(e)
    except (TypeError, ValueError):  # not printable: the message still says what it was
        return repr(e)


_BLOCK_FIELDS = ("body", "then", "orelse")


def _with_values(s: ir.Stmt, env: dict) -> ir.Stmt:
    """`s` with every expression that `env` can evaluate replaced by its value."""
    def value(e):
        if isinstance(e, (ir.IntConst, ir.FloatConst)):
            return e
        try:
            return ir.const(_compile_expr(e)(env))
        except (_Undefined, _ExprError, SimulationError, TypeError):
            return e

    def substitute(x):
        if isinstance(x, (ir.Var, ir.BinOp, ir.Call)):
            return value(x)
        if isinstance(x, ir.SmemRef):
            return ir.SmemRef(x.buffer, tuple(value(i) for i in x.index))
        if isinstance(x, ir.BarRef):
            return ir.BarRef(x.barrier, value(x.index))
        if isinstance(x, tuple) and x and all(isinstance(i, (ir.IntConst, ir.FloatConst, ir.Var, ir.BinOp, ir.Call))
                                              for i in x):
            return tuple(value(i) for i in x)
        return x
    return dataclasses.replace(s, **{f.name: substitute(getattr(s, f.name))
                                     for f in dataclasses.fields(s) if f.name not in _BLOCK_FIELDS})


def _stmt_text(s: ir.Stmt, env: dict | None = None) -> str:
    """The statement's first line in the text form; with `env`, expressions show their values
    (`mbarrier.wait empty[1] phase(0)`)."""
    if env is not None:
        s = _with_values(s, env)
    blocks = {f.name: () for f in dataclasses.fields(s) if f.name in _BLOCK_FIELDS}
    if blocks:
        s = dataclasses.replace(s, **blocks)
    try:
        return print_stmt(s).split("\n")[0].removesuffix(" {")
    except (TypeError, ValueError):
        return repr(s)


# ---------------------------------------------------------------------------------------------
# Run-time state
# ---------------------------------------------------------------------------------------------


class _Node:
    """A statement prepared for execution: its handler, compiled expressions, nested blocks."""

    __slots__ = ("stmt", "fn", "ex", "block", "orelse", "leader_only", "info")

    def __init__(self, stmt):
        self.stmt = stmt
        self.fn = None
        self.ex = None
        self.block = ()
        self.orelse = ()
        self.leader_only = False
        self.info = None


class _Ctx:
    """Who did something, frozen at that moment (for messages about it later)."""

    __slots__ = ("cta_id", "label", "stmt", "env", "loops")

    def __init__(self, co: "_Co", node: _Node):
        self.cta_id = co.cta.cta_id
        self.label = co.label
        self.stmt = node.stmt
        self.env = dict(co.env)
        self.loops = tuple(co.loops)

    def __str__(self) -> str:
        return f"CTA {self.cta_id} {self.label}: {_stmt_text(self.stmt, self.env)}{_loops_text(self.loops, self.env)}"


def _loops_text(loops, env) -> str:
    if not loops:
        return ""
    return " (loop " + ", ".join(f"{v}={env.get(v, '?')}" for v in loops) + ")"


class _Reg:
    __slots__ = ("dtype", "shape", "value")

    def __init__(self, dtype: str, shape: tuple[int, ...]):
        self.dtype = dtype
        self.shape = shape
        self.value = torch.zeros(shape)


class _Write:
    """The last write of a smem cell: a TMA load (async proxy) or a tile.store_smem."""

    __slots__ = ("kind", "co", "epoch", "ctx", "landed", "bar", "phase", "fence_epoch")

    def __init__(self, kind: str, co: "_Co", ctx: _Ctx):
        self.kind = kind
        self.co = co
        self.epoch = co.vc[co]
        self.ctx = ctx
        self.landed = False
        self.bar = None
        self.phase = -1
        self.fence_epoch = None


class _Read:
    """An async read of a smem cell (wgmma or TMA store); it ends at the covering wait."""

    __slots__ = ("kind", "co", "ctx", "pending", "end")

    def __init__(self, kind: str, co: "_Co", ctx: _Ctx):
        self.kind = kind
        self.co = co
        self.ctx = ctx
        self.pending = True
        self.end = 0


class _Cell:
    __slots__ = ("write", "reads")

    def __init__(self):
        self.write = None
        self.reads = []


class _MBarrier:
    """One mbarrier slot of one CTA."""

    __slots__ = ("label", "cta_id", "arrivals", "pending", "tx", "parity", "completed", "expected",
                 "issued", "history", "arrive_know", "know", "waiters", "init_co", "init_epoch",
                 "inflight", "expect_phase")

    def __init__(self, label: str, cta_id: int, arrivals: int, init_co: "_Co"):
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


class _BarrierGeneration:
    """One round of a named barrier or of syncthreads."""

    __slots__ = ("threads", "count", "know", "waiters", "done")

    def __init__(self, threads: int | None):
        self.threads = threads
        self.count = 0
        self.know = {}
        self.waiters = []
        self.done = False


class _TmaLoadOp:
    __slots__ = ("cta", "bar", "phase", "bytes", "data", "view", "write", "ctx")

    def advance(self, m: "_Machine") -> bool:
        m.land_tma_load(self)
        return True


class _TmaStoreOp:
    __slots__ = ("co", "view", "chunked", "box", "tensor", "coords", "param_dtype", "data",
                 "read_done", "done", "reads", "reads_ended")

    def advance(self, m: "_Machine") -> bool:
        if not self.read_done:
            self.data = _subarray_to_box(self.view, self.box, self.chunked)
            self.read_done = True
        else:
            _write_box(self.tensor, self.coords, self.data, self.param_dtype)
            self.done = True
        m.wake(self.co.bulk_waiters)
        return self.done


class _WgmmaOp:
    __slots__ = ("acc", "a_name", "a_reg", "a_view", "a_trans", "b_view", "b_trans", "accumulate", "reads")


class _Co:
    """One warpgroup of one CTA: a coroutine with its own env and register tiles."""

    __slots__ = ("cta", "gid", "role", "label", "env", "regs", "vc", "loops", "gen", "parked", "block",
                 "in_elect", "wg_open", "wg_groups", "acc_pending", "a_pending", "touched",
                 "bulk_open", "bulk_groups", "bulk_waiters", "unfenced", "node", "done")

    def __init__(self, cta: "_Cta", gid: int, env: dict):
        self.cta = cta
        self.gid = gid
        self.role = None
        self.label = f"wg{gid}"
        self.env = env
        self.regs = {}
        self.vc = {self: 1}
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

    def where(self, node: _Node | None = None) -> str:
        node = node or self.node
        text = _stmt_text(node.stmt, self.env) if node is not None else "(start)"
        return f"CTA {self.cta.cta_id} {self.label}: {text}{_loops_text(self.loops, self.env)}"

    def release(self, know: dict) -> None:
        """Publish this coroutine's clock into `know`; later events get a new epoch."""
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


class _Cta:
    __slots__ = ("cta_id", "smem", "cells", "bars", "named", "sync_gen", "live", "cos", "loads_inflight")


# ---------------------------------------------------------------------------------------------
# Boxes, sub-arrays and tiles
# ---------------------------------------------------------------------------------------------


def _box_shape_2d(box: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(box)
    while len(shape) > 2 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _is_chunked_box(box: tuple[int, ...], sub_shape: tuple[int, ...]) -> bool:
    """Does the box fill a (chunks, R, W) sub-array as its [R, chunks*W] tile?"""
    return (len(sub_shape) == 3 and sub_shape[0] > 1
            and _box_shape_2d(box) == ir.tile_shape_of_subarray(sub_shape))


def _box_to_subarray(data: torch.Tensor, sub_shape: tuple[int, ...], chunked: bool) -> torch.Tensor:
    if chunked:
        chunks, rows, width = sub_shape
        return data.reshape(rows, chunks, width).transpose(0, 1)
    return data.reshape(sub_shape)


def _subarray_to_box(view: torch.Tensor, box: tuple[int, ...], chunked: bool) -> torch.Tensor:
    if chunked:
        return view.transpose(0, 1).reshape(box).clone()
    return view.reshape(box).clone()


def _tile_of(view: torch.Tensor) -> torch.Tensor:
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


def _read_box(tensor: torch.Tensor, coords, extents, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(tuple(extents), dtype=dtype)
    region = _region(coords, extents, tensor.shape)
    if region is not None:
        out[region[1]] = tensor[region[0]].to(dtype)
    return out


def _write_box(tensor: torch.Tensor, coords, data: torch.Tensor, param_dtype: torch.dtype) -> None:
    region = _region(coords, data.shape, tensor.shape)
    if region is not None:
        tensor[region[0]] = data[region[1]].to(param_dtype).to(tensor.dtype)


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "relu": torch.relu,
    "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "cast": lambda t: t,
}
_BINARY: dict[str, Callable] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
}

# Kernel-level statements with side effects run once per CTA, by its first warpgroup.
_LEADER_ONLY = (ir.MbarrierInit, ir.MbarrierInval, ir.MbarrierArrive, ir.MbarrierArriveExpectTx,
                ir.FenceMbarrierInit, ir.FenceProxyAsync, ir.TmaLoad, ir.TmaStore, ir.TmaCommit,
                ir.TmaWait, ir.TileStoreGlobal, ir.TileStoreSmem)
# Warpgroup-collective statements: one elected thread cannot run them.
_COLLECTIVE = (ir.WgmmaFence, ir.Wgmma, ir.WgmmaCommit, ir.WgmmaWait, ir.NamedBarrierSync,
               ir.NamedBarrierArrive, ir.SyncThreads, ir.Setmaxnreg, ir.RegDecl, ir.TileFill,
               ir.TileUnary, ir.TileBinary, ir.TileReduce, ir.TileMask, ir.TileLoadGlobal,
               ir.TileStoreGlobal, ir.TileStoreSmem, ir.Role)


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------


class _Machine:
    def __init__(self, kernel: ir.Kernel, args: dict, num_sms: int, seed: int, max_steps: int):
        self.kernel = kernel
        self.num_sms = num_sms
        self.max_steps = max_steps
        self.rng = random.Random(seed)
        self.report = SimReport()
        self.runnable: list[_Co] = []
        self.async_ops: list = []
        self._bind_args(args)
        genv = dict(self.scalars, num_sms=num_sms)
        try:
            grid = _compile_expr(kernel.grid)(genv)
        except _Undefined as u:
            raise SimulationError(f"grid {_expr_text(kernel.grid)}: undefined name {u.name!r}") from None
        if type(grid) is not int or grid < 1:
            raise SimulationError(f"grid {_expr_text(kernel.grid)} = {grid!r}: need a positive integer")
        self.grid = grid
        self.report.num_ctas = grid
        self.warpgroups = kernel.threads // 128
        self.role_start: dict[int, int] = {}
        start = 0
        for role in kernel.roles():
            self.role_start[id(role)] = start
            start += role.warpgroups
        self.mutable = {s.name for s in ir.walk(kernel.body) if isinstance(s, ir.Let) and s.mutable}
        self.buffers = {d.name: d for d in kernel.smem}
        self.barrier_decls = {b.name: b for b in kernel.barriers}
        self.cell_depth = {d.name: 0 for d in kernel.smem}
        self.body = self._compile_block(kernel.body, in_role=False, in_elect=False)

    # -- arguments ---------------------------------------------------------------------------
    def _bind_args(self, args: dict) -> None:
        self.scalars: dict[str, int | float] = {}
        self.tensors: dict[str, tuple[ir.Param, torch.Tensor]] = {}
        names = {p.name for p in self.kernel.params}
        unknown = sorted(set(args) - names)
        if unknown:
            raise SimulationError(f"arguments {unknown} are not parameters of kernel {self.kernel.name} "
                                  f"(parameters: {sorted(names)})")
        for p in self.kernel.params:
            if p.name not in args:
                raise SimulationError(f"missing argument {p.name!r} for kernel {self.kernel.name}")
            value = args[p.name]
            if isinstance(p, ir.ScalarParam):
                if isinstance(value, torch.Tensor) or isinstance(value, bool):
                    raise SimulationError(f"argument {p.name!r} ({p.dtype}) must be a Python number")
                if p.dtype == "i32":
                    if int(value) != value:
                        raise SimulationError(f"argument {p.name!r} is i32 but got {value!r}")
                    self.scalars[p.name] = int(value)
                else:
                    self.scalars[p.name] = float(value)
        for p in self.kernel.params:
            if isinstance(p, ir.ScalarParam):
                continue
            value = args[p.name]
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                raise SimulationError(f"argument {p.name!r} must be a CPU torch tensor, got {type(value).__name__}")
            try:
                shape = tuple(_compile_expr(d)(self.scalars) for d in p.shape)
            except _Undefined as u:
                raise SimulationError(f"shape of parameter {p.name}: undefined name {u.name!r}") from None
            if tuple(value.shape) != shape:
                raise SimulationError(
                    f"argument {p.name!r} has shape {list(value.shape)} but the kernel declares "
                    f"{p.name}: {p.dtype}[{', '.join(_expr_text(d) for d in p.shape)}] = {list(shape)}")
            if isinstance(p, ir.TensorMapParam):
                if len(p.box) != len(p.shape):
                    raise ProtocolError(f"tensormap {p.name}: box {list(p.box)} has rank {len(p.box)}, "
                                        f"the tensor rank {len(p.shape)}")
                if p.swizzle not in (0, 32, 64, 128):
                    raise ProtocolError(f"tensormap {p.name}: swizzle({p.swizzle}) is not one of 0, 32, 64, 128")
                inner = p.box[-1] * ir.DTYPE_BYTES[p.dtype]
                if any(not 1 <= b <= 256 for b in p.box) or inner % 16:
                    raise ProtocolError(f"tensormap {p.name}: box {list(p.box)} needs every extent in "
                                        f"[1, 256] and inner bytes a multiple of 16 (got {inner})")
                if p.swizzle and inner > p.swizzle:
                    raise ProtocolError(f"tensormap {p.name}: inner box extent {p.box[-1]} {p.dtype} = {inner} "
                                        f"bytes exceeds the swizzle({p.swizzle}) span")
            self.tensors[p.name] = (p, value)

    # -- compilation -------------------------------------------------------------------------
    def _compile_block(self, stmts, in_role: bool, in_elect: bool) -> tuple[_Node, ...]:
        return tuple(self._compile_stmt(s, in_role, in_elect) for s in stmts)

    def _compile_stmt(self, s: ir.Stmt, in_role: bool, in_elect: bool) -> _Node:
        node = _Node(s)
        handler = getattr(self, "_h_" + type(s).__name__, None)
        if handler is None:
            raise ProtocolError(f"the simulator has no semantics for {type(s).__name__}: {_stmt_text(s)}")
        node.fn = handler
        node.leader_only = not in_role and isinstance(s, _LEADER_ONLY)
        if in_elect and isinstance(s, _COLLECTIVE):
            raise ProtocolError(f"{_stmt_text(s)}: warpgroup-collective statement inside elect_one "
                                f"(one thread cannot run it)")
        if in_role and isinstance(s, (ir.SyncThreads, ir.Role)):
            raise ProtocolError(f"{_stmt_text(s)} inside a role: use a named barrier "
                                f"(bar.sync id, threads) for the warpgroups that take part")
        c = _compile_expr
        if isinstance(s, (ir.Let, ir.Assign)):
            node.ex = c(s.value)
        elif isinstance(s, ir.For):
            if s.kind not in ("serial", "persistent", "unroll"):
                raise ProtocolError(f"{_stmt_text(s)}: loop kind must be serial, persistent or unroll")
            node.ex = (c(s.start), c(s.stop), c(s.step))
            node.block = self._compile_block(s.body, in_role, in_elect)
        elif isinstance(s, ir.If):
            node.ex = c(s.cond)
            node.block = self._compile_block(s.then, in_role, in_elect)
            node.orelse = self._compile_block(s.orelse, in_role, in_elect)
        elif isinstance(s, ir.Role):
            node.info = self.role_start[id(s)]
            node.block = self._compile_block(s.body, True, False)
        elif isinstance(s, ir.ElectOne):
            node.block = self._compile_block(s.body, in_role, True)
        elif isinstance(s, (ir.MbarrierArrive, ir.MbarrierArriveExpectTx, ir.MbarrierWait)):
            extra = s.bytes if isinstance(s, ir.MbarrierArriveExpectTx) else getattr(s, "phase", None)
            node.ex = (c(s.bar.index), c(extra) if extra is not None else None)
        elif isinstance(s, (ir.NamedBarrierSync, ir.NamedBarrierArrive)):
            node.ex = c(s.id)
        elif isinstance(s, ir.TmaLoad):
            node.ex = (tuple(c(e) for e in s.dst.index), tuple(c(e) for e in s.coords), c(s.bar.index))
            self._note_ref(s.dst)
        elif isinstance(s, ir.TmaStore):
            node.ex = (tuple(c(e) for e in s.src.index), tuple(c(e) for e in s.coords))
            self._note_ref(s.src)
        elif isinstance(s, ir.Wgmma):
            a_idx = None if isinstance(s.a, str) else tuple(c(e) for e in s.a.index)
            node.ex = (a_idx, tuple(c(e) for e in s.b.index), c(s.accumulate))
            if not isinstance(s.a, str):
                self._note_ref(s.a)
            self._note_ref(s.b)
        elif isinstance(s, ir.TileFill):
            node.ex = c(s.value)
        elif isinstance(s, ir.TileBinary):
            node.ex = tuple(None if isinstance(o, str) else c(o) for o in (s.lhs, s.rhs))
            if s.op not in _BINARY:
                raise ProtocolError(f"{_stmt_text(s)}: unknown binary tile op (known: {', '.join(_BINARY)})")
        elif isinstance(s, ir.TileUnary):
            if s.op not in _UNARY:
                raise ProtocolError(f"{_stmt_text(s)}: unknown unary tile op (known: {', '.join(_UNARY)})")
        elif isinstance(s, ir.TileReduce):
            if s.op not in ir.REDUCE_OPS:
                raise ProtocolError(f"{_stmt_text(s)}: unknown reduction (known: {', '.join(ir.REDUCE_OPS)})")
        elif isinstance(s, ir.TileMask):
            node.ex = (c(s.row0), c(s.col0), c(s.limit), None if s.causal is None else c(s.causal))
        elif isinstance(s, (ir.TileLoadGlobal, ir.TileStoreGlobal)):
            node.ex = tuple(c(e) for e in s.coords)
        elif isinstance(s, ir.TileStoreSmem):
            node.ex = tuple(c(e) for e in s.dst.index)
            self._note_ref(s.dst)
        return node

    def _note_ref(self, ref: ir.SmemRef) -> None:
        """Race tracking works on cells: the finest leading-index split any reference uses."""
        if ref.buffer not in self.buffers:
            raise ProtocolError(f"smem buffer {ref.buffer!r} is not declared "
                                f"(declared: {', '.join(self.buffers) or 'none'})")
        decl = self.buffers[ref.buffer]
        if len(ref.index) > len(decl.shape) - 1:
            raise ProtocolError(f"{ref.buffer}[...] has {len(ref.index)} indices; buffer "
                                f"{ref.buffer}: {decl.dtype}{list(decl.shape)} leaves no tile")
        self.cell_depth[ref.buffer] = max(self.cell_depth[ref.buffer], len(ref.index))

    # -- CTAs and the scheduler --------------------------------------------------------------
    def _launch(self, cta_id: int) -> _Cta:
        cta = _Cta()
        cta.cta_id = cta_id
        cta.smem, cta.cells = {}, {}
        for d in self.kernel.smem:
            tdt = _TORCH_DTYPES[d.dtype]
            # Never-written smem reads as NaN so a wrong box mapping shows in the numbers.
            cta.smem[d.name] = torch.full(d.shape, math.nan, dtype=tdt) if tdt.is_floating_point \
                else torch.zeros(d.shape, dtype=tdt)
            cta.cells[d.name] = [_Cell() for _ in range(math.prod(d.shape[:self.cell_depth[d.name]]))]
        cta.bars = {b.name: [None] * b.slots for b in self.kernel.barriers}
        cta.named = {}
        cta.sync_gen = None
        cta.loads_inflight = 0
        cta.cos = []
        for gid in range(self.warpgroups):
            env = dict(self.scalars)
            env["cta_id"] = cta_id
            env["num_ctas"] = self.grid
            co = _Co(cta, gid, env)
            co.gen = self._main(co)
            cta.cos.append(co)
            self.runnable.append(co)
        cta.live = len(cta.cos)
        return cta

    def run(self) -> SimReport:
        waiting = deque(range(self.grid))
        self.resident: list[_Cta] = []
        while waiting and len(self.resident) < self.num_sms:
            self.resident.append(self._launch(waiting.popleft()))
        self.waiting = waiting
        runnable, async_ops = self.runnable, self.async_ops
        rand = self.rng.random
        steps, max_steps = 0, self.max_steps
        while True:
            nr = len(runnable)
            n = nr + len(async_ops)
            if n == 0:
                if self.resident or self.waiting:
                    raise DeadlockError(self._deadlock_text(steps))
                break
            steps += 1
            if steps > max_steps:
                self.report.steps = steps - 1
                raise DeadlockError(self._livelock_text(max_steps))
            r = int(rand() * n)
            if r < nr:
                co = runnable[r]
                try:
                    next(co.gen)
                except StopIteration:
                    last = runnable.pop()
                    if r < len(runnable):
                        runnable[r] = last
                    self._finish(co)
                    continue
                if co.parked:
                    last = runnable.pop()
                    if r < len(runnable):
                        runnable[r] = last
            else:
                i = r - nr
                if async_ops[i].advance(self):
                    last = async_ops.pop()
                    if i < len(async_ops):
                        async_ops[i] = last
        self.report.steps = steps
        return self.report

    def wake(self, waiters: list) -> None:
        for co in waiters:
            if co.parked:
                co.parked = False
                self.runnable.append(co)
        waiters.clear()

    @staticmethod
    def _park(co: _Co, waiters: list, describe: Callable[[], str]) -> None:
        co.parked = True
        co.block = describe
        waiters.append(co)

    def _main(self, co: _Co) -> Iterator[None]:
        try:
            yield from self._exec(co, self.body)
        except _ReturnSignal:
            pass
        self._check_no_pending_wgmma(co, "ended")

    def _finish(self, co: _Co) -> None:
        co.done = True
        unwaited = [r for g in co.bulk_groups + [co.bulk_open] for op in g for r in op.reads if r.pending]
        if unwaited:
            raise ProtocolError(f"CTA {co.cta.cta_id} {co.label} exited while {len(unwaited)} smem region(s) "
                                f"may still be read by its TMA stores (missing tma.wait.read 0 / tma.wait 0 "
                                f"before the end): first store {unwaited[0].ctx}")
        cta = co.cta
        cta.live -= 1
        gen = cta.sync_gen
        if gen is not None and gen.count and gen.count >= cta.live:
            self._release_syncthreads(cta)
        if cta.live == 0:
            if cta.loads_inflight:
                raise ProtocolError(f"CTA {cta.cta_id} exited with {cta.loads_inflight} TMA load(s) still in "
                                    f"flight into its shared memory")
            self.resident.remove(cta)
            if self.waiting:
                self.resident.append(self._launch(self.waiting.popleft()))

    def _check_no_pending_wgmma(self, co: _Co, how: str) -> None:
        if co.wg_open or co.wg_groups:
            n_open = len(co.wg_open)
            raise ProtocolError(
                f"CTA {co.cta.cta_id} {co.label} {how} with {len(co.wg_groups)} wgmma group(s) still in flight"
                f"{f' and {n_open} wgmma.mma never committed' if n_open else ''} "
                f"(missing wgmma.commit / wgmma.wait 0 before the end of the role)")

    # -- messages ----------------------------------------------------------------------------
    def _blocked_lines(self) -> list[str]:
        lines = []
        for cta in self.resident:
            for co in cta.cos:
                if co.done:
                    continue
                if co.parked:
                    lines.append(f"CTA {cta.cta_id} {co.label}: {co.block()}")
                else:
                    lines.append(f"{co.where()} (runnable)")
        return lines

    def _deadlock_text(self, steps: int) -> str:
        head = (f"deadlock after {steps} steps: no warpgroup can run and no TMA operation is in flight"
                + (f" ({len(self.waiting)} CTA(s) not started)" if self.waiting else "") + "; blocked:")
        return "\n  ".join([head] + self._blocked_lines())

    def _livelock_text(self, max_steps: int) -> str:
        head = f"no progress / livelock: stopped after max_steps={max_steps} steps; warpgroups:"
        return "\n  ".join([head] + self._blocked_lines())

    # -- statement execution -----------------------------------------------------------------
    def _exec(self, co: _Co, block: tuple[_Node, ...]) -> Iterator[None]:
        for node in block:
            if node.leader_only and co.gid:
                continue
            co.node = node
            try:
                r = node.fn(co, node)
            except _Undefined as u:
                raise self._undefined(co, node, u.name) from None
            except _ExprError as x:
                raise ProtocolError(f"{x} in {co.where(node)}") from None
            if r is None:
                yield
            else:
                yield from r

    def _undefined(self, co: _Co, node: _Node, name: str) -> ProtocolError:
        hint = ""
        if name == "num_sms":
            hint = " (num_sms is host side: usable in the grid expression only; use num_ctas in the body)"
        elif name == "wg":
            hint = " (wg is bound only inside a role)"
        return ProtocolError(f"undefined name {name!r} in CTA {co.cta.cta_id} {co.label}: "
                             f"{_stmt_text(node.stmt)}{hint}")

    def _int(self, co: _Co, node: _Node, value, what: str) -> int:
        if type(value) is not int:
            raise ProtocolError(f"{what} must be an integer, got {value!r} in {co.where(node)}")
        return value

    # control flow and bindings
    def _h_Let(self, co, node):
        co.env[node.stmt.name] = node.ex(co.env)

    def _h_Assign(self, co, node):
        name = node.stmt.name
        if name not in co.env:
            raise _Undefined(name)
        if name not in self.mutable:
            raise ProtocolError(f"set of {name!r}, which is not declared with `var`: {co.where(node)}")
        co.env[name] = node.ex(co.env)

    def _h_For(self, co, node):
        env = co.env
        start, stop, step = (self._int(co, node, f(env), "loop bound") for f in node.ex)
        if step == 0:
            raise ProtocolError(f"loop step is 0: {co.where(node)}")
        return self._for_loop(co, node, range(start, stop, step))

    def _for_loop(self, co, node, iterations):
        env, var, block, run = co.env, node.stmt.var, node.block, self._exec
        co.loops.append(var)
        for i in iterations:
            env[var] = i
            yield from run(co, block)
        co.loops.pop()

    def _h_If(self, co, node):
        return self._exec(co, node.block if node.ex(co.env) else node.orelse)

    def _h_Role(self, co, node):
        start, role = node.info, node.stmt
        if not start <= co.gid < start + role.warpgroups:
            return ()
        return self._role(co, node, co.gid - start)

    def _role(self, co, node, wg):
        role = node.stmt
        co.role, co.label = role.name, f"{role.name} wg{wg}"
        co.env["wg"] = wg
        yield from self._exec(co, node.block)
        self._check_no_pending_wgmma(co, f"finished role {role.name}")
        del co.env["wg"]
        co.role, co.label = None, f"wg{co.gid}"

    def _h_ElectOne(self, co, node):
        return self._elect(co, node)

    def _elect(self, co, node):
        co.in_elect += 1
        yield from self._exec(co, node.block)
        co.in_elect -= 1

    def _h_Return(self, co, node):
        raise _ReturnSignal()

    def _h_Setmaxnreg(self, co, node):
        s = node.stmt
        if s.action not in ("inc", "dec") or s.registers % 8 or not 24 <= s.registers <= 256:
            raise ProtocolError(f"setmaxnreg needs inc/dec and a multiple of 8 in [24, 256]: {co.where(node)}")
        if co.role is not None:
            role = next(r for r in self.kernel.roles() if r.name == co.role)
            if role.registers != s.registers:
                raise ProtocolError(f"{_stmt_text(s)} in role {role.name} declared registers({role.registers}): "
                                    f"{co.where(node)}")

    # mbarriers
    def _barrier(self, co: _Co, node: _Node, name: str, index) -> _MBarrier:
        slots = co.cta.bars.get(name)
        if slots is None:
            raise ProtocolError(f"barrier {name!r} is not declared: {co.where(node)}")
        index = self._int(co, node, index, "barrier index")
        if not 0 <= index < len(slots):
            raise ProtocolError(f"barrier index {name}[{index}] out of range (barrier {name}[{len(slots)}]): "
                                f"{co.where(node)}")
        bar = slots[index]
        if bar is None:
            raise ProtocolError(f"mbarrier {name}[{index}] used before mbarrier.init: {co.where(node)}")
        if co.vc.get(bar.init_co, 0) < bar.init_epoch:
            raise ProtocolError(f"mbarrier {name}[{index}] used before its mbarrier.init is visible to this "
                                f"warpgroup (missing syncthreads after mbarrier.init?): {co.where(node)}")
        return bar

    def _h_MbarrierInit(self, co, node):
        s = node.stmt
        slots = co.cta.bars.get(s.barrier)
        if slots is None:
            raise ProtocolError(f"barrier {s.barrier!r} is not declared: {co.where(node)}")
        if not 1 <= s.arrivals < 2 ** 20:
            raise ProtocolError(f"mbarrier arrival count must be in [1, 2^20): {co.where(node)}")
        for i, old in enumerate(slots):
            if old is not None:
                raise ProtocolError(f"mbarrier.init on {s.barrier}[{i}], which is already initialised "
                                    f"(missing mbarrier.inval?): {co.where(node)}")
            slots[i] = _MBarrier(f"{s.barrier}[{i}]", co.cta.cta_id, s.arrivals, co)

    def _h_MbarrierInval(self, co, node):
        slots = co.cta.bars.get(node.stmt.barrier)
        if slots is None:
            raise ProtocolError(f"barrier {node.stmt.barrier!r} is not declared: {co.where(node)}")
        for i, bar in enumerate(slots):
            if bar is not None and (bar.waiters or bar.inflight):
                raise ProtocolError(f"mbarrier.inval of {bar.label} while it has waiters or TMA loads in "
                                    f"flight: {co.where(node)}")
            slots[i] = None

    def _arrive(self, co: _Co, bar: _MBarrier) -> None:
        co.release(bar.arrive_know)
        bar.pending -= 1
        if bar.pending <= 0 and bar.tx == 0:
            self._complete_phase(bar)

    def _complete_phase(self, bar: _MBarrier) -> None:
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

    def _h_MbarrierArriveExpectTx(self, co, node):
        bar = self._barrier(co, node, node.stmt.bar.barrier, node.ex[0](co.env))
        nbytes = self._int(co, node, node.ex[1](co.env), "expect_tx bytes")
        if nbytes < 0 or bar.tx + nbytes >= 2 ** 20:
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
            co.acquire(bar.know)
            return None
        return self._wait_mbarrier(co, node, bar, parity)

    def _wait_mbarrier(self, co, node, bar, parity):
        env, loops = co.env, tuple(co.loops)

        def describe():
            return (f"mbarrier.wait {bar.label} phase({parity}) — {bar.state()}{_loops_text(loops, env)}")
        while bar.parity == parity:
            self._park(co, bar.waiters, describe)
            yield
        co.acquire(bar.know)
        yield

    def _h_FenceMbarrierInit(self, co, node):
        return None

    def _h_FenceProxyAsync(self, co, node):
        epoch = co.vc[co]
        for write in co.unfenced:
            write.fence_epoch = epoch
        co.unfenced.clear()

    # named barriers and syncthreads
    def _h_NamedBarrierSync(self, co, node):
        return self._named_barrier(co, node, wait=True)

    def _h_NamedBarrierArrive(self, co, node):
        return self._named_barrier(co, node, wait=False)

    def _named_barrier(self, co, node, wait: bool):
        s = node.stmt
        bid = self._int(co, node, node.ex(co.env), "named barrier id")
        if not 1 <= bid < 16:
            raise ProtocolError(f"named barrier id {bid} must be in [1, 16) (0 is syncthreads): {co.where(node)}")
        if s.threads % 128 or not 128 <= s.threads <= self.kernel.threads:
            raise ProtocolError(f"named barrier over {s.threads} threads: needs a multiple of 128 (whole "
                                f"warpgroups) and at most the CTA's {self.kernel.threads}: {co.where(node)}")
        gen = co.cta.named.get(bid)
        if gen is None:
            gen = co.cta.named[bid] = _BarrierGeneration(s.threads)
        elif gen.threads != s.threads:
            raise ProtocolError(f"named barrier {bid} used with {s.threads} threads while this round counts "
                                f"{gen.threads}: {co.where(node)}")
        co.release(gen.know)
        gen.count += 1
        if gen.count * 128 >= gen.threads:
            gen.done = True
            del co.cta.named[bid]
            self.report.named_barrier_syncs += 1
            self.wake(gen.waiters)
        if not wait:
            return None
        if gen.done:
            co.acquire(gen.know)
            return None
        return self._wait_generation(co, gen, lambda: (
            f"bar.sync {bid}, {s.threads} — {gen.count} of {s.threads // 128} warpgroups arrived"))

    def _wait_generation(self, co, gen, what):
        env, loops = co.env, tuple(co.loops)
        describe = lambda: what() + _loops_text(loops, env)  # noqa: E731
        while not gen.done:
            self._park(co, gen.waiters, describe)
            yield
        co.acquire(gen.know)
        yield

    def _h_SyncThreads(self, co, node):
        cta = co.cta
        gen = cta.sync_gen
        if gen is None:
            gen = cta.sync_gen = _BarrierGeneration(None)
        co.release(gen.know)
        gen.count += 1
        if gen.count >= cta.live:
            self._release_syncthreads(cta)
            co.acquire(gen.know)
            return None
        return self._wait_generation(co, gen, lambda: (
            f"syncthreads — {gen.count} of {cta.live} running warpgroups arrived"))

    def _release_syncthreads(self, cta: _Cta) -> None:
        gen = cta.sync_gen
        gen.done = True
        cta.sync_gen = None
        self.wake(gen.waiters)

    # shared memory references and race checks
    def _smem(self, co: _Co, node: _Node, ref: ir.SmemRef, idx_closures):
        """(decl, sub-array view, cells, label) of a SmemRef."""
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
        per = math.prod(decl.shape[len(idx):depth])
        cells = co.cta.cells[ref.buffer][lin * per:(lin + 1) * per]
        return decl, co.cta.smem[ref.buffer][idx], cells, label

    def _check_async_read(self, co: _Co, node: _Node, cells, label: str, reader: str) -> None:
        """An async-proxy read (wgmma / TMA store) needs the last write known complete."""
        vc = co.vc
        for cell in cells:
            w = cell.write
            if w is None:
                raise RaceError(f"read of slot {label} before any write to it (did the reader wait on the right "
                                f"barrier and phase?): reader {co.where(node)}")
            if w.kind == "tma":
                if not w.landed:
                    raise RaceError(f"read of slot {label} before its TMA load completed (did the reader wait on "
                                    f"the right barrier and phase?): reader {co.where(node)}; pending writer {w.ctx}")
                if vc.get(w.bar, 0) <= w.phase:
                    raise RaceError(
                        f"read of slot {label} not synchronized with its TMA load: the load completes phase "
                        f"{w.phase} (parity {w.phase & 1}) of {w.bar.label}, which the reader has not waited "
                        f"for: reader {co.where(node)}; writer {w.ctx}")
            else:
                if w.co is not co and vc.get(w.co, 0) < w.epoch:
                    raise RaceError(f"read of slot {label} not ordered after its tile.store_smem (no barrier "
                                    f"between writer and reader): reader {co.where(node)}; writer {w.ctx}")
                if w.fence_epoch is None or vc.get(w.co, 0) < w.fence_epoch:
                    raise RaceError(f"missing fence.proxy.async: {reader} reads slot {label} written by "
                                    f"tile.store_smem with no fence.proxy.async by that warpgroup after the "
                                    f"write (and before the barrier the reader waited on): reader "
                                    f"{co.where(node)}; writer {w.ctx}")

    def _check_write(self, co: _Co, node: _Node, cells, label: str, writer: str) -> None:
        """A write needs the previous write landed and every read since then ended, both known."""
        vc = co.vc
        for cell in cells:
            w = cell.write
            if w is not None:
                if w.kind == "tma" and not w.landed:
                    raise RaceError(f"{writer} into slot {label} while an earlier TMA load into it is still in "
                                    f"flight: writer {co.where(node)}; earlier load {w.ctx}")
                unordered = (vc.get(w.bar, 0) <= w.phase) if w.kind == "tma" else \
                    (w.co is not co and vc.get(w.co, 0) < w.epoch)
                if unordered:
                    raise RaceError(f"{writer} into slot {label} is not ordered after the previous write to it: "
                                    f"writer {co.where(node)}; previous {w.ctx}")
            for r in cell.reads:
                what = "wgmma" if r.kind == "wgmma" else "TMA store"
                wait = "wgmma.wait" if r.kind == "wgmma" else "tma.wait.read"
                if r.pending:
                    raise RaceError(f"{writer} overwrites slot {label} while a {what} may still be reading it "
                                    f"(the slot was released before {wait} covered the read): writer "
                                    f"{co.where(node)}; reader {r.ctx}")
                if r.co is not co and vc.get(r.co, 0) < r.end:
                    raise RaceError(f"{writer} overwrites slot {label} before the reader's {wait} is ordered "
                                    f"before it (the reader released the slot before its {wait}): writer "
                                    f"{co.where(node)}; reader {r.ctx}")

    # TMA
    def _tensormap(self, co, node, name: str):
        entry = self.tensors.get(name)
        if entry is None or not isinstance(entry[0], ir.TensorMapParam):
            raise ProtocolError(f"{name!r} is not a tensormap parameter: {co.where(node)}")
        return entry

    def _coords(self, co, node, closures, rank: int, what: str) -> tuple[int, ...]:
        coords = tuple(self._int(co, node, f(co.env), "coordinate") for f in closures)
        if len(coords) != rank:
            raise ProtocolError(f"{what} has rank {rank} but {len(coords)} coordinates: {co.where(node)}")
        return coords

    def _check_box(self, co, node, param, decl, sub_shape, label: str) -> bool:
        if decl.dtype != param.dtype:
            raise ProtocolError(f"tensormap {param.name} is {param.dtype} but smem {label} is {decl.dtype}: "
                                f"{co.where(node)}")
        if decl.swizzle != param.swizzle:
            raise ProtocolError(f"tensormap {param.name} has swizzle({param.swizzle}) but smem {decl.name} has "
                                f"swizzle({decl.swizzle}): {co.where(node)}")
        if math.prod(param.box) != math.prod(sub_shape):
            raise ProtocolError(f"box {list(param.box)} of {param.name} ({math.prod(param.box)} elements) does not "
                                f"fill smem {label} of shape {list(sub_shape)} ({math.prod(sub_shape)} elements): "
                                f"{co.where(node)}")
        return _is_chunked_box(param.box, sub_shape)

    def _h_TmaLoad(self, co, node):
        s = node.stmt
        dst_idx, coord_fns, bar_idx = node.ex
        param, tensor = self._tensormap(co, node, s.tensor)
        coords = self._coords(co, node, coord_fns, len(param.box), f"tensormap {param.name}")
        decl, view, cells, label = self._smem(co, node, s.dst, dst_idx)
        chunked = self._check_box(co, node, param, decl, view.shape, label)
        bar = self._barrier(co, node, s.bar.barrier, bar_idx(co.env))
        nbytes = math.prod(param.box) * ir.DTYPE_BYTES[param.dtype]
        self._check_tx(co, node, bar, nbytes)
        self._check_write(co, node, cells, label, "TMA load")
        ctx = _Ctx(co, node)
        write = _Write("tma", co, ctx)
        write.bar = bar
        for cell in cells:
            cell.write = write
            cell.reads = []
        op = _TmaLoadOp()
        op.cta, op.bar, op.phase, op.view, op.write, op.ctx = co.cta, bar, bar.completed, view, write, ctx
        tdt = _TORCH_DTYPES[param.dtype]
        op.data = _box_to_subarray(_read_box(tensor, coords, param.box, tdt), tuple(view.shape), chunked)
        op.bytes = nbytes
        bar.issued += op.bytes
        bar.inflight += 1
        co.cta.loads_inflight += 1
        self.async_ops.append(op)
        self.report.tma_loads += 1
        self.report.tma_bytes_loaded += op.bytes

    def _check_tx(self, co: _Co, node: _Node, bar: _MBarrier, nbytes: int) -> None:
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

    def land_tma_load(self, op: _TmaLoadOp) -> None:
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
        if bar.tx < 0:
            raise ProtocolError(f"expect_tx mismatch on {bar.label} (CTA {bar.cta_id}): expected {bar.expected} "
                                f"bytes, TMA delivered {bar.issued} (more bytes than announced by "
                                f"mbarrier.arrive_expect_tx before the loads): {op.ctx}")
        if bar.pending <= 0 and bar.tx == 0:
            self._complete_phase(bar)

    def _h_TmaStore(self, co, node):
        s = node.stmt
        src_idx, coord_fns = node.ex
        param, tensor = self._tensormap(co, node, s.tensor)
        coords = self._coords(co, node, coord_fns, len(param.box), f"tensormap {param.name}")
        decl, view, cells, label = self._smem(co, node, s.src, src_idx)
        chunked = self._check_box(co, node, param, decl, view.shape, label)
        self._check_async_read(co, node, cells, label, "TMA store")
        ctx = _Ctx(co, node)
        op = _TmaStoreOp()
        op.co, op.view, op.chunked, op.box, op.tensor, op.coords = co, view, chunked, tuple(param.box), tensor, coords
        op.param_dtype = _TORCH_DTYPES[param.dtype]
        op.data, op.read_done, op.done, op.reads_ended = None, False, False, False
        op.reads = []
        for cell in cells:
            read = _Read("tma_store", co, ctx)
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
            self._bulk_finish(co, s.pending, s.read)
            return None
        return self._wait_bulk(co, s.pending, s.read)

    @staticmethod
    def _older_groups(co: _Co, pending: int) -> list:
        groups = co.bulk_groups
        return groups[:max(len(groups) - pending, 0)]

    def _bulk_ready(self, co: _Co, pending: int, read: bool) -> bool:
        for group in self._older_groups(co, pending):
            for op in group:
                if not (op.read_done if read else op.done):
                    return False
        return True

    def _bulk_finish(self, co: _Co, pending: int, read: bool) -> None:
        epoch = co.vc[co]
        for group in self._older_groups(co, pending):
            for op in group:
                if not op.reads_ended:
                    op.reads_ended = True
                    for r in op.reads:
                        r.pending = False
                        r.end = epoch
        co.bulk_groups = [g for g in co.bulk_groups if not all(op.done and op.reads_ended for op in g)]

    def _wait_bulk(self, co, pending: int, read: bool):
        env, loops = co.env, tuple(co.loops)
        kind = "tma.wait.read" if read else "tma.wait"

        def describe():
            return f"{kind} {pending} — {len(co.bulk_groups)} bulk group(s) committed{_loops_text(loops, env)}"
        while not self._bulk_ready(co, pending, read):
            self._park(co, co.bulk_waiters, describe)
            yield
        self._bulk_finish(co, pending, read)
        yield

    # wgmma
    def _h_WgmmaFence(self, co, node):
        co.touched.clear()

    def _h_Wgmma(self, co, node):
        s = node.stmt
        a_idx, b_idx, accumulate_fn = node.ex
        acc = self._reg(co, node, s.acc)
        if acc.dtype != "f32" or len(acc.shape) != 2 or acc.shape[0] != 64:
            raise ProtocolError(f"wgmma accumulator {s.acc} must be f32[64, N], is {acc.dtype}{list(acc.shape)}: "
                                f"{co.where(node)}")
        op = _WgmmaOp()
        op.reads = []
        ctx = _Ctx(co, node)
        reads = []  # (cells, label) to check and record
        if isinstance(s.a, str):
            a = self._reg(co, node, s.a)
            if s.a_major != "k":
                raise ProtocolError(f"register A operand must be major k: {co.where(node)}")
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
        if s.a_major not in ("k", "n") or s.b_major not in ("k", "n"):
            raise ProtocolError(f"wgmma majors must be k or n: {co.where(node)}")
        op.b_view, op.b_trans = bview, s.b_major == "k"
        k, n = btile[::-1] if op.b_trans else btile
        if (a_dtype != bdecl.dtype or a_dtype not in ("bf16", "f16") or len(a_shape) != 2
                or a_shape[0] != 64 or a_shape[1] != k or acc.shape[1] != n or n % 8 or not 8 <= n <= 256
                or k % 16):
            raise ProtocolError(
                f"wgmma shapes: acc {list(acc.shape)} = A {a_dtype}{list(a_shape)} @ B {bdecl.dtype}[{k}, {n}] "
                f"(from {blabel} {list(bview.shape)}, major {s.b_major}) needs 16-bit A and B of one dtype, "
                f"M = 64, K a multiple of 16, N a multiple of 8 in [8, 256]: {co.where(node)}")
        for name in fenced:
            if name in co.touched:
                raise ProtocolError(f"missing wgmma.fence: register tile {name} was accessed by a tile op "
                                    f"since the last wgmma.fence: {co.where(node)}")
        accumulate = node.ex[2](co.env)
        op.acc, op.accumulate = s.acc, bool(accumulate)
        for cells, label in reads:
            self._check_async_read(co, node, cells, label, "wgmma")
            for cell in cells:
                read = _Read("wgmma", co, ctx)
                cell.reads.append(read)
                op.reads.append(read)
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

    def _complete_wgmma_group(self, co: _Co, group: list) -> None:
        epoch = co.vc[co]
        for op in group:
            acc = co.regs[op.acc]
            a = op.a_reg.value if op.a_reg is not None else _tile_of(op.a_view).float()
            if op.a_trans:
                a = a.T
            b = _tile_of(op.b_view).float()
            if op.b_trans:
                b = b.T
            product = a @ b
            acc.value = acc.value + product if op.accumulate else product
            for r in op.reads:
                r.pending = False
                r.end = epoch
            for pending, name in ((co.acc_pending, op.acc), (co.a_pending, op.a_name)):
                if name:
                    pending[name] -= 1
                    if not pending[name]:
                        del pending[name]

    # register tiles
    def _reg(self, co: _Co, node: _Node, name: str) -> _Reg:
        reg = co.regs.get(name)
        if reg is None:
            raise ProtocolError(f"register tile {name!r} is not declared: {co.where(node)}")
        return reg

    def _read_reg(self, co: _Co, node: _Node, name: str) -> _Reg:
        reg = self._reg(co, node, name)
        if name in co.acc_pending:
            raise RaceError(f"acc read while wgmma pending (missing wgmma.wait): {name} in {co.where(node)}")
        co.touched.add(name)
        return reg

    def _write_reg(self, co: _Co, node: _Node, name: str, value: torch.Tensor) -> None:
        reg = self._reg(co, node, name)
        if name in co.acc_pending:
            raise RaceError(f"acc read while wgmma pending (missing wgmma.wait): {name} written in "
                            f"{co.where(node)}")
        if name in co.a_pending:
            raise RaceError(f"register A operand {name} written while a wgmma reading it is pending "
                            f"(missing wgmma.wait): {co.where(node)}")
        if tuple(value.shape) != reg.shape:
            raise ProtocolError(f"result of shape {list(value.shape)} does not fit {name}: "
                                f"{reg.dtype}{list(reg.shape)} in {co.where(node)}")
        co.touched.add(name)
        reg.value = _round(value.float(), reg.dtype)

    def _h_RegDecl(self, co, node):
        s = node.stmt
        if s.dtype not in _REG_ROUND or not s.shape or any(d < 1 for d in s.shape):
            raise ProtocolError(f"bad register tile declaration: {co.where(node)}")
        if s.name in co.acc_pending or s.name in co.a_pending:
            raise RaceError(f"acc read while wgmma pending (missing wgmma.wait): {s.name} re-declared in "
                            f"{co.where(node)}")
        co.regs[s.name] = _Reg(s.dtype, tuple(s.shape))

    def _h_TileFill(self, co, node):
        reg = self._reg(co, node, node.stmt.dst)
        value = node.ex(co.env)
        self._write_reg(co, node, node.stmt.dst, torch.full(reg.shape, float(value)))

    def _h_TileUnary(self, co, node):
        s = node.stmt
        src = self._read_reg(co, node, s.src)
        self._write_reg(co, node, s.dst, _UNARY[s.op](src.value))

    def _h_TileBinary(self, co, node):
        s = node.stmt
        operands = []
        for o, fn in zip((s.lhs, s.rhs), node.ex):
            if fn is None:
                operands.append(self._read_reg(co, node, o).value)
            else:   # a scalar operand: a 0-d fp32 tensor broadcasts like a tile (torch.maximum
                operands.append(torch.tensor(float(fn(co.env))))   # takes tensors only)
        try:
            result = _BINARY[s.op](*operands)
        except RuntimeError as e:
            raise ProtocolError(f"operand shapes do not broadcast ({e}): {co.where(node)}") from None
        if result.dim() == 0:
            result = result.expand(self._reg(co, node, s.dst).shape)
        self._write_reg(co, node, s.dst, result)

    def _h_TileMask(self, co, node):
        s = node.stmt
        value = self._read_reg(co, node, s.dst).value
        if value.dim() != 2:
            raise ProtocolError(f"tile.mask needs a 2-D tile, {s.dst} has shape {list(value.shape)}: "
                                f"{co.where(node)}")
        row0, col0, limit = (int(f(co.env)) for f in node.ex[:3])
        rows = torch.arange(value.shape[0]).unsqueeze(1) + row0
        cols = torch.arange(value.shape[1]).unsqueeze(0) + col0
        masked = (cols >= limit).expand(value.shape)
        if node.ex[3] is not None:
            masked = masked | (cols > rows + int(node.ex[3](co.env)))
        self._write_reg(co, node, s.dst, value.masked_fill(masked, float("-inf")))

    def _h_TileReduce(self, co, node):
        s = node.stmt
        src = self._read_reg(co, node, s.src).value
        if not 0 <= s.axis < src.dim():
            raise ProtocolError(f"axis {s.axis} out of range for a rank-{src.dim()} tile: {co.where(node)}")
        result = src.sum(s.axis, keepdim=True) if s.op == "sum" else src.amax(s.axis, keepdim=True)
        self._write_reg(co, node, s.dst, result)

    def _global(self, co, node, name: str, tile_shape: tuple[int, ...]):
        """(param, tensor, coords, extents) of a plain global access by a tile."""
        entry = self.tensors.get(name)
        if entry is None or not isinstance(entry[0], ir.GlobalParam):
            raise ProtocolError(f"{name!r} is not a `global` parameter (tensormaps are reached with tma.*): "
                                f"{co.where(node)}")
        param, tensor = entry
        rank = tensor.dim()
        coords = self._coords(co, node, node.ex, rank, f"global {name}")
        t = len(tile_shape)
        if t >= rank:
            if any(d != 1 for d in tile_shape[:t - rank]):
                raise ProtocolError(f"tile {list(tile_shape)} has more dims than {name} (rank {rank}) and the "
                                    f"extra leading dims are not 1: {co.where(node)}")
            extents = tile_shape[t - rank:]
        else:
            extents = (1,) * (rank - t) + tuple(tile_shape)
        return param, tensor, coords, extents

    def _h_TileLoadGlobal(self, co, node):
        s = node.stmt
        reg = self._reg(co, node, s.dst)
        param, tensor, coords, extents = self._global(co, node, s.tensor, reg.shape)
        data = _read_box(tensor, coords, extents, _TORCH_DTYPES[param.dtype])
        self._write_reg(co, node, s.dst, data.float().reshape(reg.shape))

    def _h_TileStoreGlobal(self, co, node):
        s = node.stmt
        reg = self._read_reg(co, node, s.src)
        param, tensor, coords, extents = self._global(co, node, s.tensor, reg.shape)
        _write_box(tensor, coords, reg.value.reshape(extents), _TORCH_DTYPES[param.dtype])

    def _h_TileStoreSmem(self, co, node):
        s = node.stmt
        reg = self._read_reg(co, node, s.src)
        decl, view, cells, label = self._smem(co, node, s.dst, node.ex)
        sub = tuple(view.shape)
        tile = ir.tile_shape_of_subarray(sub) if len(sub) in (2, 3) else sub
        if tuple(reg.shape) != tuple(tile):
            raise ProtocolError(f"tile {s.src}: {list(reg.shape)} does not match smem {label} holding "
                                f"{list(tile)}: {co.where(node)}")
        self._check_write(co, node, cells, label, "tile.store_smem")
        value = reg.value.to(_TORCH_DTYPES[decl.dtype])
        if len(sub) == 3:
            chunks, rows, width = sub
            value = value.reshape(rows, chunks, width).transpose(0, 1)
        view.copy_(value)
        write = _Write("generic", co, _Ctx(co, node))
        for cell in cells:
            cell.write = write
            cell.reads = []
        co.unfenced.append(write)


def simulate(kernel: ir.Kernel, args: dict[str, "torch.Tensor | int | float"], *, num_sms: int = 4,
             seed: int = 0, max_steps: int = 5_000_000) -> SimReport:
    """Run `kernel` on the CPU over every CTA of its grid; outputs are written into `args`' tensors.

    `args` maps every parameter name to a Python number (i32 / f32 params) or a CPU torch tensor
    of the declared shape (tensormap / global params; any dtype: reads see values rounded to
    the declared dtype, writes are rounded to it, then stored in the tensor's dtype).
    `seed` picks the interleaving; `max_steps` bounds the run (a DeadlockError past it).
    Raises DeadlockError, RaceError or ProtocolError (all SimulationError) naming the CTA, role,
    warpgroup, statement and loop variables involved.
    """
    if num_sms < 1:
        raise SimulationError(f"num_sms must be >= 1, got {num_sms}")
    machine = _Machine(kernel, args, num_sms, seed, max_steps)
    # One matmul per wgmma is tiny ([64, K] @ [K, N]): intra-op threads only add contention
    # (10x slower on a busy 2-core machine), so run single-threaded and restore the caller's setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return machine.run()
    finally:
        torch.set_num_threads(threads)
