"""Schedules: how a fusion is mapped onto a warp-specialized Hopper kernel.

`Schedule` holds the choices every workload shares (tile, pipeline depth, warp roles, registers,
raster, epilogue) and checks them against the Hopper target (`wsched/target.py`). Each workload
subclasses it (`wsched/workloads/<name>/schedule.py`): the subclass says what its tile means,
how many shared-memory bytes a stage and the epilogue take, and which choices it supports. A
schedule is frozen and validated when it is built: every limit it breaks is named with the
amount by which it is broken. Any field can be overridden with `dataclasses.replace` or by
passing keywords to `ws.compile(fusion, ...)`.

What a schedule accepts is what the lowering implements: every schedule that validates lowers,
passes the verifier, emits CUDA and builds with nvcc (tests/test_schedule_space.py checks it over
the whole field space). Where ptxas's register margin is thin (head dim 256, a paged cache's
producer) a schedule can still spill, which is a build error: for a schedule the caller gives,
`BuildError` says so; the schedules `ws.compile` picks itself fall back to lighter ones
(`kernel.build_without_spills`), and the autotuner rejects such a candidate. Field types are
checked first (ints, not bools, floats or strings; tuples of three ints), so a wrong value is
named by its field before any arithmetic runs on it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import ClassVar

from .errors import short_repr, type_name
from .target import (REGISTER_FILE, SETMAXNREG_MAX, SETMAXNREG_MIN, SETMAXNREG_STEP, SMEM_ALIGN,
                     SMEM_BASE_SLACK, SMEM_LIMIT, MAX_THREADS, WARPGROUP_THREADS, WGMMA_M, WGMMA_N,
                     launch_registers, register_pool)


class ScheduleError(ValueError):
    """A schedule breaks a hardware limit, or does not fit the fusion it is applied to."""


MODES = ("cooperative", "pingpong")
RASTERS = ("row", "column")
EPILOGUES = ("tma_store", "direct")
# The consumer warpgroup counts the lowering is built and checked for (a workload's schedule may
# take more: `Schedule.consumer_counts`). With 3 or more, a thread starts with at most 128
# registers (65536 / 512 threads), which a 64 x BN fp32 accumulator and the epilogue's tiles
# overflow for the wider tiles (ptxas spills, and spills are build errors).
CONSUMER_WARPGROUPS = (1, 2)
# The grouped raster computes `swizzle_group x tiles` in 32-bit ints: with at most 32 rows per
# group and tiles at least 64 wide, that stays below 2**31 for any extent an i32 size can have.
SWIZZLE_GROUP_MAX = 32
# Bytes per element of a wgmma operand (bf16 / f16).
OPERAND_BYTES = (2,)
# Bytes per output element the epilogue stages in shared memory: one staging buffer per distinct
# output dtype (bf16 or f16: 2, f32: 4), so the sum over the distinct dtypes of the outputs.
OUTPUT_BYTES = (2, 4, 6, 8)

_INT_FIELDS = ("stages", "consumer_warpgroups", "producer_registers", "consumer_registers",
               "swizzle_group", "mma_inflight", "operand_bytes", "output_bytes")
_CHOICE_FIELDS = {"mode": MODES, "raster": RASTERS, "epilogue": EPILOGUES}
_TRIPLE_FIELDS = {"tile": "(BM, BN, BK)", "cluster": "(x, y, z)"}


def is_int(value: object) -> bool:
    """An integer that is not a bool (True would read as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def choices_text(values) -> str:
    return ", ".join(repr(v) for v in values)


# What the producer warp keeps after setmaxnreg.dec: enough for TMA coordinates and the loop
# state; a producer that holds more (a paged cache's page indices) asks for more.
PRODUCER_REGISTERS = 24


@dataclass(frozen=True)
class Schedule:
    """Tile shape, pipeline depth and warp roles of a warp-specialized kernel.

    tile:               (BM, BN, BK): output rows per tile, columns per wgmma, and the k extent
                        of one stage of the mainloop GEMM (the workload's subclass says what
                        each one is for it).
    stages:             circular-buffer depth of the k-loop channels.
    consumer_warpgroups: warpgroups that run wgmma and the epilogue; each owns BM/n rows of a
                        tile (BM rows of its own tiles in matmul's ping-pong).
    mode:               "cooperative" (all consumers share one tile, interleaving freely), or
                        "pingpong" (the consumer warpgroups take turns issuing their GEMMs:
                        attention's warpgroups on one tile, matmul's each on tiles of its own).
    producer_registers / consumer_registers: per-thread budgets set with setmaxnreg.
    raster:             "row" (consecutive tiles walk along N) or "column".
    swizzle_group:      tiles are visited in groups of this many rows (columns) for L2 reuse.
    epilogue:           "tma_store" (registers -> smem -> TMA) or "direct" (plain stores).
    mma_inflight:       wgmma groups kept in flight in the k loop before a stage is released
                        (0: wait for each mma; 1: see the workload's schedule).
    cluster:            CTA cluster shape in tiles (the workload says which shapes it takes; matmul:
                        (2, 1, 1) pairs CTAs on tiles next to each other along M, which share
                        their B tile, loaded once and multicast; (1, 2, 1) along N, sharing A).
    operand_bytes:      bytes per element of the MMA operands (2: bf16 or f16).
    output_bytes:       bytes per output element staged in shared memory by a TMA-store
                        epilogue, summed over the distinct output dtypes (set from the fusion by
                        `ws.schedule_for`; the partition checks it).
    """

    workload: ClassVar[str] = ""     # the name of the workload whose schedule this is

    tile: tuple[int, int, int] = (128, 256, 64)
    stages: int = 3
    consumer_warpgroups: int = 2
    mode: str = "cooperative"
    producer_registers: int = PRODUCER_REGISTERS
    consumer_registers: int = 240
    raster: str = "row"
    swizzle_group: int = 8
    epilogue: str = "tma_store"
    mma_inflight: int = 1
    cluster: tuple[int, int, int] = (1, 1, 1)
    operand_bytes: int = 2
    output_bytes: int = 2

    def __post_init__(self):
        if not self.workload:
            raise ScheduleError("Schedule is the shared base of the workloads' schedules; build one with "
                                "ws.schedule_for(fusion, **fields), or a workload's subclass (MatmulSchedule, "
                                "AttentionSchedule)")
        problems = self._type_problems()
        if not problems:
            problems = self._problems()
        if problems:
            raise ScheduleError("invalid schedule " + self.short() + ":\n  - " + "\n  - ".join(problems))

    def _type_problems(self) -> list[str]:
        """Fields of the wrong type, each named; lists become tuples and integer types (numpy's)
        become int, so that a valid schedule holds plain values."""
        p: list[str] = []
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if is_int(value):
                object.__setattr__(self, name, int(value))
            else:
                p.append(f"{name}={value!r} must be an int, not {type_name(value)}")
        for name, meaning in _TRIPLE_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, (tuple, list)) and len(value) == 3 and all(is_int(v) for v in value):
                object.__setattr__(self, name, tuple(int(v) for v in value))
            else:
                p.append(f"{name}={value!r} must be a tuple of three ints {meaning}")
        for name, allowed in _CHOICE_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                p.append(f"{name} {value!r} is not one of {choices_text(allowed)}")
        return p

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def bm(self) -> int:
        return self.tile[0]

    @property
    def bn(self) -> int:
        return self.tile[1]

    @property
    def bk(self) -> int:
        return self.tile[2]

    # The rows a consumer warpgroup may own: one m64 wgmma per k step (a workload that issues
    # one per 64-row block of its rows, each into its own accumulator, allows more).
    consumer_rows = (WGMMA_M,)
    # The consumer warpgroup counts this workload's lowering takes (CONSUMER_WARPGROUPS unless it
    # says otherwise).
    consumer_counts: ClassVar[tuple[int, ...]] = CONSUMER_WARPGROUPS

    @property
    def mma_row_blocks(self) -> int:
        """The m64 blocks of a consumer warpgroup's rows: its wgmmas per k step, its accumulators."""
        return self.rows_per_consumer // WGMMA_M

    @property
    def tile_warpgroups(self) -> int:
        """Consumer warpgroups that share one tile and read each stage of the k-loop ring (the
        empty barriers' arrivals): all of them, unless a workload gives each warpgroup tiles of
        its own (matmul's ping-pong)."""
        return self.consumer_warpgroups

    @property
    def rows_per_consumer(self) -> int:
        return self.bm // self.tile_warpgroups

    @property
    def stage_bytes(self) -> int:
        """Bytes one stage of the k-loop channels holds (the workload's operand tiles)."""
        raise NotImplementedError(f"{type(self).__name__} must say how many bytes a stage holds")

    @property
    def epilogue_bytes(self) -> int:
        """Shared memory outside the k-loop ring (an output staging buffer, a tile loaded once)."""
        raise NotImplementedError(f"{type(self).__name__} must say how many bytes its epilogue holds")

    @property
    def smem_bytes(self) -> int:
        """Operand stages + epilogue staging + barriers, each buffer 1024-byte aligned, plus
        the 1 KB the kernel spends aligning its dynamic shared memory base."""
        return self.stages * self.stage_bytes + self.epilogue_bytes + SMEM_ALIGN + SMEM_BASE_SLACK

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * (1 + self.consumer_warpgroups)

    @property
    def register_use(self) -> int:
        return WARPGROUP_THREADS * (self.producer_registers + self.consumer_warpgroups * self.consumer_registers)

    def short(self) -> str:
        tile = "x".join(map(str, self.tile)) if isinstance(self.tile, tuple) and len(self.tile) == 3 else repr(self.tile)
        return (f"{tile} stages={self.stages} consumers={self.consumer_warpgroups} "
                f"regs={self.producer_registers}/{self.consumer_registers} epilogue={self.epilogue}")

    # -- validation ------------------------------------------------------------------------
    def _problems(self) -> list[str]:
        """Every limit the (well-typed) schedule breaks."""
        p: list[str] = []
        if any(t <= 0 for t in self.tile):
            return p + [f"tile {self.tile} must be three positive integers (BM, BN, BK)"]
        bm, bn, _ = self.tile
        n = self.consumer_warpgroups
        if n < 1:
            p.append(f"consumer_warpgroups is {n}; at least 1 is needed")
        elif n not in self.consumer_counts:
            p.append(f"consumer_warpgroups={n} is not supported: use {' or '.join(map(str, self.consumer_counts))} "
                     f"(with {n}, a thread starts with "
                     f"{launch_registers(self.threads)} registers, too few for a 64 x BN fp32 accumulator "
                     f"and the epilogue: ptxas spills)")
        elif self.tile_warpgroups == n and bm % (WGMMA_M * n):
            p.append(f"BM={bm} must be a multiple of {WGMMA_M} x consumer_warpgroups="
                     f"{WGMMA_M * n} (each consumer warpgroup issues m64 wgmmas)")
        elif self.rows_per_consumer not in self.consumer_rows:
            shared = (f"BM / consumer_warpgroups = {self.rows_per_consumer}" if self.tile_warpgroups == n else
                      f"BM = {bm}: in mode {self.mode!r} each consumer warpgroup takes whole tiles of its own")
            owns = " or ".join(map(str, self.consumer_rows))
            p.append(f"each consumer warpgroup must own {'exactly ' if len(self.consumer_rows) == 1 else ''}"
                     f"{owns} rows ({shared}); use BM = "
                     + " or ".join(str(r * self.tile_warpgroups) for r in self.consumer_rows))
        if bn not in WGMMA_N:
            p.append(f"BN={bn} must be a multiple of {WGMMA_N[0]} in [{WGMMA_N[0]}, {WGMMA_N[-1]}] "
                     f"(the wgmma n extent)")
        if bn > 64 and bn % 64:
            p.append(f"BN={bn} above 64 must be a multiple of 64 (128-byte swizzled column chunks)")
        if self.operand_bytes not in OPERAND_BYTES:
            p.append(f"operand_bytes={self.operand_bytes} is not supported: wgmma operands are bf16 or f16 "
                     f"(2 bytes)")
        if self.output_bytes not in OUTPUT_BYTES:
            p.append(f"output_bytes={self.output_bytes} must be one of {choices_text(OUTPUT_BYTES)} (bytes per "
                     f"staged output element: bf16 or f16 2, f32 4, summed over the distinct output dtypes)")
        if self.stages < 1:
            p.append(f"stages is {self.stages}; at least 1 is needed")
        if self.mma_inflight not in (0, 1):
            p.append(f"mma_inflight is {self.mma_inflight}; it must be 0 or 1")
        if n not in self.consumer_counts:   # threads and registers below are products of it
            return p
        p += self._workload_problems()
        p += self._register_problems()
        if self.threads > MAX_THREADS:
            p.append(f"{self.threads} threads per CTA exceed {MAX_THREADS}")
        if self.smem_bytes > SMEM_LIMIT:
            fitting = max_stages(self, at_least_one=False)
            fix = (f"use at most {fitting} stage{'s' if fitting > 1 else ''}, a smaller tile" if fitting
                   else "not even one stage fits: use a smaller tile")
            p.append(f"shared memory {self.smem_bytes} bytes exceeds the {SMEM_LIMIT}-byte limit by "
                     f"{self.smem_bytes - SMEM_LIMIT} (stages {self.stages} x {self.stage_bytes}"
                     f" + epilogue {self.epilogue_bytes}); {fix}"
                     + (" or epilogue='direct'" if self.epilogue == "tma_store" else ""))
        if not 1 <= self.swizzle_group <= SWIZZLE_GROUP_MAX:
            p.append(f"swizzle_group is {self.swizzle_group}; it must be in [1, {SWIZZLE_GROUP_MAX}] (the kernel "
                     f"computes swizzle_group x tiles in 32-bit ints)")
        p += self._cluster_problems()
        return p

    def _cluster_problems(self) -> list[str]:
        """A workload without a cluster schedule takes only (1, 1, 1)."""
        if self.cluster != (1, 1, 1):
            return [f"cluster {self.cluster}: the {self.workload} workload has no cluster schedule; use (1, 1, 1)"]
        return []

    @property
    def cluster_size(self) -> int:
        """CTAs per cluster."""
        return math.prod(self.cluster)

    def _register_problems(self) -> list[str]:
        """setmaxnreg: budgets in its steps, within the CTA's register pool, and on the right side of the
        count every thread starts with (the producer's .dec lowers it, the consumers' .inc raises
        it; a consumer budget below it would depend on how many registers ptxas happens to use)."""
        p: list[str] = []
        for name, regs in (("producer_registers", self.producer_registers),
                           ("consumer_registers", self.consumer_registers)):
            if regs % SETMAXNREG_STEP or not SETMAXNREG_MIN <= regs <= SETMAXNREG_MAX:
                p.append(f"{name}={regs} must be a multiple of {SETMAXNREG_STEP} in "
                         f"[{SETMAXNREG_MIN}, {SETMAXNREG_MAX}] (setmaxnreg)")
        pool = register_pool(self.threads)
        if self.register_use > pool:
            p.append(f"register budget exceeded: {WARPGROUP_THREADS} x {self.producer_registers} + "
                     f"{WARPGROUP_THREADS * self.consumer_warpgroups} x {self.consumer_registers} = "
                     f"{self.register_use} > {pool}, the registers a CTA of {self.threads} threads holds "
                     f"({launch_registers(self.threads)} per thread), by {self.register_use - pool}: setmaxnreg.inc "
                     f"would wait forever for the rest (producer_registers + consumer_warpgroups x "
                     f"consumer_registers, per warpgroup)")
        start = launch_registers(self.threads)
        if self.producer_registers > start:
            p.append(f"producer_registers={self.producer_registers} is above the {start} registers a thread "
                     f"starts with ({REGISTER_FILE} / {self.threads} threads): setmaxnreg.dec only lowers "
                     f"it; use at most {start}")
        if self.consumer_registers < start:
            p.append(f"consumer_registers={self.consumer_registers} is below the {start} registers a thread "
                     f"starts with ({REGISTER_FILE} / {self.threads} threads): setmaxnreg.inc only raises "
                     f"it; use at least {start}")
        return p

    def _workload_problems(self) -> list[str]:
        """What the workload does not support (its tile rules, modes, epilogues)."""
        return []

    def with_(self, **changes) -> "Schedule":
        return replace(self, **changes)


def check_schedule(value: object) -> Schedule:
    """`value` if it is a workload's schedule, else a ScheduleError saying how to make one."""
    if not isinstance(value, Schedule):
        raise ScheduleError(f"schedule={short_repr(value)} ({type_name(value)}) is not a Schedule; build one with "
                            f"ws.schedule_for(fusion, **fields), or pass the fields as keywords")
    return value


def max_stages(schedule: Schedule, at_least_one: bool = True) -> int:
    """The deepest pipeline that fits in shared memory with the schedule's other choices (at
    least 1 unless `at_least_one` is False: then 0 where not even one stage fits)."""
    room = SMEM_LIMIT - schedule.epilogue_bytes - SMEM_ALIGN - SMEM_BASE_SLACK
    fitting = max(0, room // schedule.stage_bytes)
    return max(1, fitting) if at_least_one else fitting


def default_consumer_registers(consumer_warpgroups: object, producer_registers: object) -> object:
    """What the consumers get by default: the registers the producer leaves in the CTA's pool
    (`register_pool`), up to setmaxnreg's maximum (2 consumers beside a 24-register producer: 240,
    beside 32 or 40: 232; 1 consumer: 256). Values of the wrong
    type give 240, for the schedule to report them."""
    if not (is_int(consumer_warpgroups) and is_int(producer_registers) and consumer_warpgroups >= 1):
        return 240
    threads = WARPGROUP_THREADS * (1 + consumer_warpgroups)
    share = (register_pool(threads) // WARPGROUP_THREADS - producer_registers) // consumer_warpgroups
    return max(SETMAXNREG_MIN, min(SETMAXNREG_MAX, share // SETMAXNREG_STEP * SETMAXNREG_STEP))


def check_overrides(schedule_type: type[Schedule], overrides: dict, extra: tuple[str, ...] = ()) -> None:
    """Reject keyword overrides that name no field of the schedule type."""
    known = [f.name for f in fields(schedule_type)]
    unknown = set(overrides) - set(known) - set(extra)
    if unknown:
        raise ScheduleError(f"unknown schedule field(s) {sorted(unknown)}; known: {known + list(extra)}")
