"""Schedules: how a fusion is mapped onto a warp-specialized Hopper kernel.

A `Schedule` is frozen and validated when it is built: every limit it breaks is named with the
amount by which it is broken. `default_schedule(fusion)` is the Hopper heuristic; any field can
be overridden with `dataclasses.replace` or by passing keywords to `Schedule(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace



class ScheduleError(ValueError):
    """A schedule breaks a hardware limit, or does not fit the fusion it is applied to."""

SMEM_LIMIT = 232448          # bytes of dynamic shared memory a CTA may use on sm_90 (227 KB)
REGISTER_FILE = 65536        # 32-bit registers per SM
WGMMA_M = 64                 # rows of one wgmma instruction (one warpgroup)
WGMMA_K = 16                 # k extent of one bf16/f16 wgmma instruction
BARRIER_BYTES = 8


@dataclass(frozen=True)
class Schedule:
    """Tile shape, pipeline depth and warp roles of a warp-specialized kernel.

    tile:               (BM, BN, BK) output rows, output columns and k extent per stage.
    stages:             circular-buffer depth of the operand channel.
    consumer_warpgroups: warpgroups that run wgmma and the epilogue; each owns BM/n rows.
    mode:               "cooperative" (all consumers share one tile, interleaving freely), or
                        "pingpong" (attention only: the two consumer warpgroups take turns
                        issuing their GEMMs; matmul ping-pong is not implemented).
    producer_registers / consumer_registers: per-thread budgets set with setmaxnreg.
    raster:             "row" (consecutive tiles walk along N) or "column".
    swizzle_group:      tiles are visited in groups of this many rows (columns) for L2 reuse.
    epilogue:           "tma_store" (registers -> smem -> TMA) or "direct" (plain stores).
    mma_inflight:       wgmma groups kept in flight in the k loop before a stage is released
                        (0: wait for each mma; 1: release the previous stage after wait 1; for
                        attention, 1 overlaps the softmax of one kv block with the previous
                        block's P V).
    cluster:            CTA cluster shape (only (1, 1, 1) for now).
    """

    kind: str = "matmul"
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
        """Bytes one stage of the k-loop channels holds: A and B tiles (matmul), or a K and a V
        block (attention: BN keys x head dim BK)."""
        if self.kind == "attention":
            return 2 * self.bn * self.bk * self.operand_bytes
        return (self.bm + self.bn) * self.bk * self.operand_bytes

    @property
    def epilogue_bytes(self) -> int:
        """Shared memory outside the k-loop ring: the output staging buffer (matmul tma_store),
        or the Q tile loaded once per tile (attention)."""
        if self.kind == "attention":
            return self.bm * self.bk * self.operand_bytes
        return self.bm * self.bn * self.output_bytes if self.epilogue == "tma_store" else 0

    @property
    def smem_bytes(self) -> int:
        """Operand stages + epilogue staging + barriers, each buffer 1024-byte aligned, plus
        the 1 KB the kernel spends aligning its dynamic shared memory base."""
        return self.stages * self.stage_bytes + self.epilogue_bytes + 2048

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumer_warpgroups)

    @property
    def register_use(self) -> int:
        return 128 * self.producer_registers + 128 * self.consumer_warpgroups * self.consumer_registers

    def short(self) -> str:
        bm, bn, bk = self.tile
        return (f"{bm}x{bn}x{bk} stages={self.stages} consumers={self.consumer_warpgroups} "
                f"regs={self.producer_registers}/{self.consumer_registers} epilogue={self.epilogue}")

    # -- validation ------------------------------------------------------------------------
    def _problems(self) -> list[str]:
        p: list[str] = []
        if self.kind not in ("matmul", "attention"):
            p.append(f"kind {self.kind!r} is not one of 'matmul', 'attention'")
        if len(self.tile) != 3 or any(not isinstance(t, int) or t <= 0 for t in self.tile):
            return p + [f"tile {self.tile} must be three positive integers (BM, BN, BK)"]
        bm, bn, bk = self.tile
        if self.mode not in ("cooperative", "pingpong"):
            p.append(f"mode {self.mode!r} is not one of 'cooperative', 'pingpong'")
        elif self.mode == "pingpong" and self.kind == "matmul":
            p.append("mode 'pingpong' is not implemented for matmul yet; use 'cooperative'")
        elif self.mode == "pingpong" and (self.consumer_warpgroups != 2 or self.mma_inflight != 1):
            p.append("attention ping-pong alternates 2 consumer warpgroups around the overlapped "
                     "softmax: it needs consumer_warpgroups=2 and mma_inflight=1")
        if self.consumer_warpgroups < 1:
            p.append(f"consumer_warpgroups is {self.consumer_warpgroups}; at least 1 is needed")
        elif bm % (WGMMA_M * self.consumer_warpgroups):
            p.append(f"BM={bm} must be a multiple of {WGMMA_M} x consumer_warpgroups="
                     f"{WGMMA_M * self.consumer_warpgroups} (each consumer warpgroup issues m64 wgmmas)")
        elif self.rows_per_consumer != WGMMA_M:
            p.append(f"each consumer warpgroup must own exactly {WGMMA_M} rows (BM / consumer_warpgroups"
                     f" = {self.rows_per_consumer}); use BM = {WGMMA_M * self.consumer_warpgroups}")
        if bn % 8 or not 8 <= bn <= 256:
            p.append(f"BN={bn} must be a multiple of 8 in [8, 256] (the wgmma n extent)")
        if bn > 64 and bn % 64:
            p.append(f"BN={bn} above 64 must be a multiple of 64 (128-byte swizzled column chunks)")
        if self.kind == "attention":
            if bk not in (64, 128, 256):
                p.append(f"head dim (BK) {bk} is not one of 64, 128, 256")
            if bn % WGMMA_K or bn > 256 or bn % 64 and bn > 64:
                p.append(f"BN={bn} (keys per block) must be a multiple of {WGMMA_K} (the k extent of "
                         f"P @ V), at most 256, and a multiple of 64 above 64")
            if self.epilogue != "direct":
                p.append("attention stores O and LSE with epilogue='direct' (tma_store is not "
                         "implemented for attention yet)")
            if self.mma_inflight not in (0, 1):
                p.append(f"mma_inflight is {self.mma_inflight}; attention takes 0 (each wgmma waited "
                         f"for) or 1 (P V of one block overlaps the softmax of the next)")
        elif bk % WGMMA_K:
            p.append(f"BK={bk} is not a multiple of {WGMMA_K} (the wgmma k extent); "
                     f"use {max(WGMMA_K, bk // WGMMA_K * WGMMA_K)}")
        elif bk * self.operand_bytes != 128:
            p.append(f"BK={bk} gives {bk * self.operand_bytes}-byte rows; the 128-byte swizzled "
                     f"operand layout needs BK = {128 // self.operand_bytes}")
        if self.stages < 1:
            p.append(f"stages is {self.stages}; at least 1 is needed")
        if self.mma_inflight not in (0, 1):
            p.append(f"mma_inflight is {self.mma_inflight}; it must be 0 or 1")
        if self.mma_inflight == 1 and self.stages < 2 and self.kind == "matmul":
            p.append("mma_inflight=1 keeps one stage in use while the next is loaded: stages must "
                     "be at least 2 (or set mma_inflight=0)")
        for name, regs in (("producer_registers", self.producer_registers),
                           ("consumer_registers", self.consumer_registers)):
            if regs % 8 or not 24 <= regs <= 256:
                p.append(f"{name}={regs} must be a multiple of 8 in [24, 256] (setmaxnreg)")
        if self.register_use > REGISTER_FILE:
            p.append(f"register budget exceeded: 128 x {self.producer_registers} + "
                     f"{128 * self.consumer_warpgroups} x {self.consumer_registers} = "
                     f"{self.register_use} > {REGISTER_FILE} per SM by {self.register_use - REGISTER_FILE}")
        if self.threads > 1024:
            p.append(f"{self.threads} threads per CTA exceed 1024")
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

    def with_(self, **changes) -> "Schedule":
        return replace(self, **changes)


def max_stages(schedule: "Schedule") -> int:
    """The deepest pipeline that fits in shared memory with the schedule's other choices."""
    room = SMEM_LIMIT - schedule.epilogue_bytes - 2048
    return max(1, room // schedule.stage_bytes)


def default_schedule(kind: str = "matmul", **overrides) -> Schedule:
    """Hopper heuristic: 128x256x64 tiles, 1 producer + 2 consumer warpgroups at 24/240
    registers (the producer only issues copies; the consumers hold a 64x256 fp32 accumulator
    plus the epilogue's side tiles), and as many stages as fit beside the epilogue's staging
    buffer."""
    unknown = set(overrides) - {f.name for f in fields(Schedule)} - ({"head_dim"} if kind == "attention" else set())
    if unknown:
        raise ScheduleError(f"unknown schedule field(s) {sorted(unknown)}; known: "
                            f"{[f.name for f in fields(Schedule)]}")
    if kind == "attention":
        return _default_attention(overrides)
    base = dict(kind=kind, tile=(128, 256, 64), consumer_warpgroups=2, stages=2)
    base.update({k: v for k, v in overrides.items() if k not in ("stages", "mma_inflight")})
    probe = Schedule(**base)
    stages = overrides.get("stages", min(4, max_stages(probe)))
    # Keeping a wgmma in flight holds its stage: one stage alone must wait for every mma.
    inflight = overrides.get("mma_inflight", 1 if stages >= 2 else 0)
    return replace(probe, stages=stages, mma_inflight=inflight)


def _default_attention(overrides: dict) -> Schedule:
    """FlashAttention-3-like shape: 128 query rows (2 consumer warpgroups x 64), 128 keys per
    block (64 for head dim 256, to keep O and S in registers), 3 K/V stages where they fit (2 at
    head dim 256), 24/240 registers,
    and the P V product of one block overlapping the softmax of the next (mma_inflight=1)."""
    head_dim = overrides.pop("head_dim", None) or overrides.get("tile", (0, 0, 128))[2]
    base = dict(kind="attention", tile=(128, 64 if head_dim == 256 else 128, head_dim), stages=1,
                consumer_warpgroups=2, producer_registers=24, consumer_registers=240,
                epilogue="direct", mma_inflight=1)
    # mode="pingpong" (passes/pingpong.py) is correct but measured 1-14% slower than letting the
    # two warpgroups interleave freely (H200, 2026-11-21): cooperative stays the default.
    base.update({k: v for k, v in overrides.items() if k != "stages"})
    probe = Schedule(**base)
    # K/V stages: as many as fit beside Q, up to 3 (measured on H200: 3 beats 2 by 1-5% at
    # head dims 64 and 128; head dim 256 fits only 2).
    return replace(probe, stages=overrides.get("stages", min(3, max_stages(probe))))
