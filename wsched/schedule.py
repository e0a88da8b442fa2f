"""Schedules: how a fusion is mapped onto a warp-specialized Hopper kernel.

`Schedule` holds the choices every workload shares (tile, pipeline depth, warp roles, registers,
raster, epilogue) and checks them against the Hopper target (`wsched/target.py`). Each workload
subclasses it (`wsched/workloads/<name>/schedule.py`): the subclass says what its tile means,
how many shared-memory bytes a stage and the epilogue take, and which choices it supports. A
schedule is frozen and validated when it is built: every limit it breaks is named with the
amount by which it is broken. Any field can be overridden with `dataclasses.replace` or by
passing keywords to `ws.compile(fusion, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from .target import (REGISTER_FILE, SETMAXNREG_MAX, SETMAXNREG_MIN, SETMAXNREG_STEP, SMEM_ALIGN,
                     SMEM_BASE_SLACK, SMEM_LIMIT, MAX_THREADS, WARPGROUP_THREADS, WGMMA_M, WGMMA_N)


class ScheduleError(ValueError):
    """A schedule breaks a hardware limit, or does not fit the fusion it is applied to."""


@dataclass(frozen=True)
class Schedule:
    """Tile shape, pipeline depth and warp roles of a warp-specialized kernel.

    tile:               (BM, BN, BK): output rows per tile, columns per wgmma, and the k extent
                        of one stage of the mainloop GEMM (the workload's subclass says what
                        each one is for it).
    stages:             circular-buffer depth of the k-loop channels.
    consumer_warpgroups: warpgroups that run wgmma and the epilogue; each owns BM/n rows.
    mode:               "cooperative" (all consumers share one tile, interleaving freely), or
                        "pingpong" (the consumer warpgroups take turns issuing their GEMMs,
                        where the workload supports it).
    producer_registers / consumer_registers: per-thread budgets set with setmaxnreg.
    raster:             "row" (consecutive tiles walk along N) or "column".
    swizzle_group:      tiles are visited in groups of this many rows (columns) for L2 reuse.
    epilogue:           "tma_store" (registers -> smem -> TMA) or "direct" (plain stores).
    mma_inflight:       wgmma groups kept in flight in the k loop before a stage is released
                        (0: wait for each mma; 1: see the workload's schedule).
    cluster:            CTA cluster shape (only (1, 1, 1) for now).
    """

    workload: ClassVar[str] = ""     # the name of the workload whose schedule this is

    tile: tuple[int, int, int] = (128, 256, 64)
    stages: int = 3
    consumer_warpgroups: int = 2
    mode: str = "cooperative"
    producer_registers: int = 24
    consumer_registers: int = 240
    raster: str = "row"
    swizzle_group: int = 8
    epilogue: str = "tma_store"
    mma_inflight: int = 1
    cluster: tuple[int, int, int] = (1, 1, 1)
    operand_bytes: int = 2
    output_bytes: int = 2

    def __post_init__(self):
        problems = self._problems()
        if problems:
            raise ScheduleError("invalid schedule " + self.short() + ":\n  - " + "\n  - ".join(problems))

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

    @property
    def rows_per_consumer(self) -> int:
        return self.bm // self.consumer_warpgroups

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
        bm, bn, bk = self.tile
        return (f"{bm}x{bn}x{bk} stages={self.stages} consumers={self.consumer_warpgroups} "
                f"regs={self.producer_registers}/{self.consumer_registers} epilogue={self.epilogue}")

    # -- validation ------------------------------------------------------------------------
    def _problems(self) -> list[str]:
        p: list[str] = []
        if len(self.tile) != 3 or any(not isinstance(t, int) or t <= 0 for t in self.tile):
            return p + [f"tile {self.tile} must be three positive integers (BM, BN, BK)"]
        bm, bn, _ = self.tile
        if self.mode not in ("cooperative", "pingpong"):
            p.append(f"mode {self.mode!r} is not one of 'cooperative', 'pingpong'")
        if self.consumer_warpgroups < 1:
            p.append(f"consumer_warpgroups is {self.consumer_warpgroups}; at least 1 is needed")
        elif bm % (WGMMA_M * self.consumer_warpgroups):
            p.append(f"BM={bm} must be a multiple of {WGMMA_M} x consumer_warpgroups="
                     f"{WGMMA_M * self.consumer_warpgroups} (each consumer warpgroup issues m64 wgmmas)")
        elif self.rows_per_consumer != WGMMA_M:
            p.append(f"each consumer warpgroup must own exactly {WGMMA_M} rows (BM / consumer_warpgroups"
                     f" = {self.rows_per_consumer}); use BM = {WGMMA_M * self.consumer_warpgroups}")
        if bn not in WGMMA_N:
            p.append(f"BN={bn} must be a multiple of {WGMMA_N[0]} in [{WGMMA_N[0]}, {WGMMA_N[-1]}] "
                     f"(the wgmma n extent)")
        if bn > 64 and bn % 64:
            p.append(f"BN={bn} above 64 must be a multiple of 64 (128-byte swizzled column chunks)")
        p += self._workload_problems()
        if self.stages < 1:
            p.append(f"stages is {self.stages}; at least 1 is needed")
        if self.mma_inflight not in (0, 1):
            p.append(f"mma_inflight is {self.mma_inflight}; it must be 0 or 1")
        for name, regs in (("producer_registers", self.producer_registers),
                           ("consumer_registers", self.consumer_registers)):
            if regs % SETMAXNREG_STEP or not SETMAXNREG_MIN <= regs <= SETMAXNREG_MAX:
                p.append(f"{name}={regs} must be a multiple of {SETMAXNREG_STEP} in "
                         f"[{SETMAXNREG_MIN}, {SETMAXNREG_MAX}] (setmaxnreg)")
        if self.register_use > REGISTER_FILE:
            p.append(f"register budget exceeded: {WARPGROUP_THREADS} x {self.producer_registers} + "
                     f"{WARPGROUP_THREADS * self.consumer_warpgroups} x {self.consumer_registers} = "
                     f"{self.register_use} > {REGISTER_FILE} per SM by {self.register_use - REGISTER_FILE}")
        if self.threads > MAX_THREADS:
            p.append(f"{self.threads} threads per CTA exceed {MAX_THREADS}")
        if self.smem_bytes > SMEM_LIMIT:
            p.append(f"shared memory {self.smem_bytes} bytes exceeds the {SMEM_LIMIT}-byte limit by "
                     f"{self.smem_bytes - SMEM_LIMIT} (stages {self.stages} x {self.stage_bytes}"
                     f" + epilogue {self.epilogue_bytes}); use at most {max_stages(self)} stages, a "
                     f"smaller tile" + (" or epilogue='direct'" if self.epilogue == "tma_store" else ""))
        if self.raster not in ("row", "column"):
            p.append(f"raster {self.raster!r} is not one of 'row', 'column'")
        if self.swizzle_group < 1:
            p.append(f"swizzle_group is {self.swizzle_group}; at least 1 is needed")
        if self.epilogue not in ("tma_store", "direct"):
            p.append(f"epilogue {self.epilogue!r} is not one of 'tma_store', 'direct'")
        if tuple(self.cluster) != (1, 1, 1):
            p.append(f"cluster {self.cluster} is not supported yet; use (1, 1, 1)")
        return p

    def _workload_problems(self) -> list[str]:
        """What the workload does not support (its tile rules, modes, epilogues)."""
        return []

    def with_(self, **changes) -> "Schedule":
        return replace(self, **changes)


def max_stages(schedule: Schedule) -> int:
    """The deepest pipeline that fits in shared memory with the schedule's other choices."""
    room = SMEM_LIMIT - schedule.epilogue_bytes - SMEM_ALIGN - SMEM_BASE_SLACK
    return max(1, room // schedule.stage_bytes)


def check_overrides(schedule_type: type[Schedule], overrides: dict, extra: tuple[str, ...] = ()) -> None:
    """Reject keyword overrides that name no field of the schedule type."""
    from dataclasses import fields

    known = [f.name for f in fields(schedule_type)]
    unknown = set(overrides) - set(known) - set(extra)
    if unknown:
        raise ScheduleError(f"unknown schedule field(s) {sorted(unknown)}; known: {known + list(extra)}")
