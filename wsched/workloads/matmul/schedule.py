"""The matmul workload's schedule: a persistent GEMM tile with a fused epilogue.

tile = (BM, BN, BK): BM output rows (64 per consumer warpgroup), BN output columns, BK the k
extent of one stage (one 128-byte swizzled row of A and of B).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from wsched.schedule import Schedule, ScheduleError, check_overrides, max_stages
from wsched.target import SWIZZLE_ROW_BYTES, WGMMA_K


@dataclass(frozen=True)
class MatmulSchedule(Schedule):
    """A `Schedule` whose tile is (BM, BN, BK) of C = A @ B. `mma_inflight=1` keeps one wgmma
    group in flight across k iterations and releases the previous stage after `wgmma.wait 1`."""

    workload = "matmul"

    @property
    def stage_bytes(self) -> int:
        """An A tile [BM, BK] and a B tile [BK, BN]."""
        return (self.bm + self.bn) * self.bk * self.operand_bytes

    @property
    def epilogue_bytes(self) -> int:
        """The output staging buffer [BM, BN] of the TMA-store epilogue (none for direct stores)."""
        return self.bm * self.bn * self.output_bytes if self.epilogue == "tma_store" else 0

    def _workload_problems(self) -> list[str]:
        p: list[str] = []
        bk = self.bk
        if self.mode == "pingpong":
            p.append("mode 'pingpong' is not implemented for matmul yet; use 'cooperative'")
        if bk % WGMMA_K:
            p.append(f"BK={bk} is not a multiple of {WGMMA_K} (the wgmma k extent); "
                     f"use {max(WGMMA_K, bk // WGMMA_K * WGMMA_K)}")
        elif bk * self.operand_bytes != SWIZZLE_ROW_BYTES:
            p.append(f"BK={bk} gives {bk * self.operand_bytes}-byte rows; the {SWIZZLE_ROW_BYTES}-byte "
                     f"swizzled operand layout needs BK = {SWIZZLE_ROW_BYTES // self.operand_bytes}")
        if self.mma_inflight == 1 and self.stages < 2:
            p.append("mma_inflight=1 keeps one stage in use while the next is loaded: stages must "
                     "be at least 2 (or set mma_inflight=0)")
        return p


def default_schedule(**overrides) -> MatmulSchedule:
    """Hopper heuristic: 128x256x64 tiles, 1 producer + 2 consumer warpgroups at 24/240
    registers (the producer only issues copies; the consumers hold a 64x256 fp32 accumulator
    plus the epilogue's side tiles), and as many stages as fit beside the epilogue's staging
    buffer (at most 4)."""
    check_overrides(MatmulSchedule, overrides)
    base = dict(tile=(128, 256, 64), consumer_warpgroups=2, stages=2)
    base.update({k: v for k, v in overrides.items() if k not in ("stages", "mma_inflight")})
    probe = MatmulSchedule(**base)
    stages = overrides.get("stages", min(4, max_stages(probe)))
    # Keeping a wgmma in flight holds its stage: one stage alone must wait for every mma.
    inflight = overrides.get("mma_inflight", 1 if stages >= 2 else 0)
    return replace(probe, stages=stages, mma_inflight=inflight)


def schedule_space(output_bytes: int = 2, operand_bytes: int = 2) -> Iterator[MatmulSchedule]:
    """Every schedule of the space this workload implements today: BN 64..256, both epilogues,
    1 stage up to as many as fit, either raster, wgmma groups in flight or not."""
    for bn in (64, 128, 192, 256):
        for epilogue in ("tma_store", "direct"):
            for raster in ("row", "column"):
                probe = default_schedule(tile=(128, bn, 128 // operand_bytes), epilogue=epilogue, raster=raster,
                                         output_bytes=output_bytes, operand_bytes=operand_bytes)
                for stages in range(1, max_stages(probe) + 1):
                    for inflight in ((0, 1) if stages >= 2 else (0,)):
                        try:
                            candidate = replace(probe, stages=stages, mma_inflight=inflight)
                        except ScheduleError:
                            continue
                        yield candidate
