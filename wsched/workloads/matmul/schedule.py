"""The matmul workload's schedule: a persistent GEMM tile with a fused epilogue.

tile = (BM, BN, BK): BM output rows (64 per consumer warpgroup), BN output columns (64, 128, 192
or 256: whole 128-byte swizzled column chunks of B and of the output), BK the k extent of one
stage (one 128-byte swizzled row of A and of B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

from wsched.schedule import (PRODUCER_REGISTERS, SWIZZLE_GROUP_MAX, Schedule, ScheduleError, check_overrides,
                             default_consumer_registers, is_int, max_stages)
from wsched.target import (HOPPER_SMS, PAGE_ROWS_ALIGN, SMEM_ALIGN, SWIZZLE_ROW_BYTES, WARPGROUP_THREADS,
                           WGMMA_K, WGMMA_M)

# Output columns per tile: whole 64-column chunks. Narrower tiles have no 128-byte swizzled B
# tile (N-major) or output staging tile the emitter can address.
TILE_N = (64, 128, 192, 256)


EPILOGUE_COLUMNS = 64     # accumulator columns per epilogue slice

# The largest accumulator a consumer warpgroup holds, in elements: [64, 256] or [128, 128] fp32,
# 128 registers per thread.
MAX_ACCUMULATOR = WGMMA_M * 256

# CTAs a cluster may pair along one tile dimension (the shared operand's tile is split into this
# many pieces, each CTA loading one and multicasting it to all).
CLUSTER_SIZES = (1, 2, 4)

# The most CTAs one output tile's k range is split across (split-K).
MAX_SPLIT_K = 16
# The fewest k steps a split takes (loops.split_count). A split costs its fp32 partial's store,
# the ticket and one more partial for the last unit to sum (a GPU trace of 258x1320x2152 split 4
# ways: ~1.1 us the ticket, ~2.1 us a 64-column slice's sum). Measured on an H100 (cold L2, us, no split / 2 / 4 / 8 / 16
# splits, 2026-11-24; cuBLAS in the same run): M72 N672 K728 (12 k steps) 9.6 / 12.1 / 12.9 /
# 15.8 / 18.7 (6.7); M37 N280 K792 8.7 / 9.8 / 9.8 / 11.8 / 14.3 (6.5); M1 N912 K1120 9.8 / 10.0 /
# 9.9 / 10.9 / 13.8 (7.3); M16 N4096 K4096 (64 steps) 31.6 / 27.0 / 23.6 / 23.6 / 23.6 (21.6).
MIN_K_STEPS_PER_SPLIT = 8


@dataclass(frozen=True)
class MatmulSchedule(Schedule):
    """A `Schedule` whose tile is (BM, BN, BK) of C = A @ B. `mma_inflight=1` keeps one wgmma
    group in flight across k iterations and releases the previous stage after `wgmma.wait 1`.

    `mode="pingpong"` gives each of the two consumer warpgroups whole tiles of its own, in turn
    (BM = one warpgroup's rows, 64 or 128; the default 128x128): while one runs its epilogue the
    other issues its mainloop's wgmmas, and named barriers hand the mainloop from one to the other
    (pingpong.py).

    `split_k` is the most CTAs an output tile's k range may be split across. 1 builds the plain
    persistent kernel; above 1 the kernel takes a host param `splits` that the host computes per
    call (`splits = min(split_k, max(1, k_tiles / split_min_steps), max(1, num_sms / tiles))`:
    enough work units for the SMs, never a second wave, and no split of fewer than
    `split_min_steps` k steps, MIN_K_STEPS_PER_SPLIT by default), each unit stores its fp32
    partial to a workspace, and the last of a tile's units to take its ticket sums the partials in split order and runs the epilogue
    (docs/architecture.md, "Split-K").

    `stream_k=True` splits the call's k steps, not its tiles, evenly over the CTAs: all output
    tiles' k steps in one row (tile by tile), CTA c taking the `unit_steps = ceil(tiles x k_tiles /
    num_sms)` steps from c x unit_steps. A tile whose k steps lie in more than one CTA's range is
    finished by the last to arrive, which sums the fp32 partials in CTA order and runs the
    epilogue: the others store their partials and take the tile's ticket, the CTA holding the
    tile's last k steps (which nearly always arrives last) takes it first and stores its partial
    only when it did not. No wave of tiles is left part empty (docs/architecture.md, "Stream-K")."""

    workload = "matmul"
    split_k: int = 1
    split_min_steps: int = MIN_K_STEPS_PER_SPLIT
    stream_k: bool = False
    # A warpgroup owns 64 or 128 rows: one or two m64 wgmmas per k step, each into an accumulator
    # of its own (ping-pong's 128 x 128 tiles, cooperative 256 x 128).
    consumer_rows = (WGMMA_M, 2 * WGMMA_M)

    @property
    def tile_warpgroups(self) -> int:
        """Ping-pong: each warpgroup reads the stages of its own tiles only."""
        return 1 if self.mode == "pingpong" else self.consumer_warpgroups

    @property
    def stage_bytes(self) -> int:
        """An A tile [BM, BK] and a B tile [BK, BN]."""
        return (self.bm + self.bn) * self.bk * self.operand_bytes

    @property
    def epilogue_width(self) -> int:
        """Accumulator columns per epilogue slice."""
        return min(self.bn, EPILOGUE_COLUMNS)

    @property
    def staging_slots(self) -> int:
        """Staging slots a consumer warpgroup's TMA-store epilogue needs for its slices (64 rows x
        epilogue_width each): two that the slices take in turn (a slot is written while the
        other's store reads it), so the ring keeps more stages; with an odd count the first slice
        of the next tile would take the slot whose store was issued last, so one slot per slice."""
        slices = self.mma_row_blocks * (self.bn // self.epilogue_width)
        return 2 if slices % 2 == 0 else slices

    @property
    def epilogue_bytes(self) -> int:
        """The output staging slots of the TMA-store epilogue, [64, epilogue_width] each
        (`staging_slots` per consumer warpgroup; none for direct stores), and with split-K the
        smem slot each consumer warpgroup reads its ticket from (one aligned buffer)."""
        staging = (self.consumer_warpgroups * self.staging_slots * WGMMA_M * self.epilogue_width * self.output_bytes
                   if self.epilogue == "tma_store" else 0)
        return staging + (SMEM_ALIGN if self.splits_k else 0)

    @property
    def splits_k(self) -> bool:
        """Whether a tile's k steps may be split across CTAs (split-K or stream-K)."""
        return (is_int(self.split_k) and self.split_k > 1) or self.stream_k is True

    def short(self) -> str:
        return (super().short() + (" pingpong" if self.mode == "pingpong" else "")
                + (f" split_k={self.split_k}" if self.split_k != 1 else "")
                + (" stream_k" if self.stream_k is True else "")
                + (f" split_min_steps={self.split_min_steps}"
                   if self.split_min_steps != MIN_K_STEPS_PER_SPLIT else "")
                + (f" cluster={'x'.join(map(str, self.cluster))}"
                   if isinstance(self.cluster, tuple) and self.cluster != (1, 1, 1) else "")
                + (" mma_inflight=0" if self.mma_inflight == 0 and is_int(self.stages) and self.stages >= 2 else ""))

    def _workload_problems(self) -> list[str]:
        p: list[str] = []
        bk = self.bk
        if not is_int(self.split_k) or not 1 <= self.split_k <= MAX_SPLIT_K:
            p.append(f"split_k={self.split_k!r} must be an int in [1, {MAX_SPLIT_K}] (the most CTAs one output "
                     f"tile's k range is split across; 1: no split)")
        if not is_int(self.split_min_steps) or self.split_min_steps < 1:
            p.append(f"split_min_steps={self.split_min_steps!r} must be an int >= 1 (the fewest k steps a split-K "
                     f"unit takes; default {MIN_K_STEPS_PER_SPLIT})")
        if not isinstance(self.stream_k, bool):
            p.append(f"stream_k={self.stream_k!r} must be True or False (True: the call's k steps split "
                     f"evenly over the CTAs)")
        elif self.stream_k:
            if is_int(self.split_k) and self.split_k != 1:
                p.append(f"stream_k=True with split_k={self.split_k}: stream-K chooses its own splits; "
                         f"use split_k=1")
            if self.mode == "pingpong":
                p.append("stream_k=True with mode 'pingpong': a split tile's ticket is per tile, not per "
                         "warpgroup's tile; use mode 'cooperative'")
            if self.mma_row_blocks > 1:
                p.append(f"stream_k=True with {self.rows_per_consumer} rows per consumer warpgroup: stream-K "
                         f"takes 64 rows per warpgroup (BM = 64 x consumer_warpgroups)")
        if self.mode == "pingpong" and self.consumer_warpgroups != 2:
            p.append(f"mode 'pingpong' alternates two consumer warpgroups on tiles of their own: it needs "
                     f"consumer_warpgroups=2 (not {self.consumer_warpgroups})")
        if self.mode == "pingpong" and is_int(self.split_k) and self.split_k != 1:
            p.append(f"split_k={self.split_k} with mode 'pingpong': a split unit's ticket is per tile, not "
                     f"per warpgroup's tile; use mode 'cooperative' for split-K")
        if (self.rows_per_consumer in self.consumer_rows and self.mma_row_blocks > 1
                and self.rows_per_consumer * self.bn > MAX_ACCUMULATOR):
            p.append(f"a consumer warpgroup's accumulators [{self.rows_per_consumer}, {self.bn}] hold "
                     f"{self.rows_per_consumer * self.bn // WARPGROUP_THREADS} fp32 registers per thread, more than the "
                     f"{MAX_ACCUMULATOR // WARPGROUP_THREADS} that leave room for the epilogue: use BN <= "
                     f"{MAX_ACCUMULATOR // self.rows_per_consumer} with {self.rows_per_consumer} rows per warpgroup")
        if self.mma_row_blocks > 1 and is_int(self.split_k) and self.split_k != 1:
            p.append(f"split_k={self.split_k} with {self.rows_per_consumer} rows per consumer warpgroup: split-K "
                     f"takes 64 rows per warpgroup (BM = 64 x consumer_warpgroups)")
        if self.bn not in TILE_N:
            p.append(f"BN={self.bn} is not supported for matmul: use {', '.join(map(str, TILE_N))} (whole "
                     f"128-byte swizzled column chunks of B and of the output tile)")
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


    def _cluster_problems(self) -> list[str]:
        """(cm, cn, 1): cm CTAs on consecutive tiles along M share their B tile, or cn along N their A
        tile; the shared tile is split into cluster-size pieces of whole swizzle atoms
        (PAGE_ROWS_ALIGN rows), an A piece within one warpgroup's 64 rows. (A B piece always is: BN
        and BK are multiples of 64, the pieces 16 rows or more.)"""
        cm, cn, cz = self.cluster
        if cz != 1 or min(cm, cn) != 1 or cm * cn not in CLUSTER_SIZES:
            return [f"cluster {self.cluster}: use (n, 1, 1) (CTAs on tiles along M, sharing B) or (1, n, 1) "
                    f"(along N, sharing A) with n in {CLUSTER_SIZES}"]
        if cm * cn == 1:
            return []
        p: list[str] = []
        if self.mode != "cooperative":
            p.append(f"cluster {self.cluster} with mode {self.mode!r}: clusters are built for the cooperative "
                     f"schedule; use mode='cooperative' or cluster (1, 1, 1)")
        if is_int(self.split_k) and self.split_k != 1:
            p.append(f"cluster {self.cluster} with split_k={self.split_k}: a cluster's CTAs walk whole tiles "
                     f"together; use split_k=1 or cluster (1, 1, 1)")
        if self.stream_k is True:
            p.append(f"cluster {self.cluster} with stream_k=True: a cluster's CTAs walk whole tiles together; "
                     f"use stream_k=False or cluster (1, 1, 1)")
        if cn > 1 and (self.bm % cn or self.bm // cn > WGMMA_M or (self.bm // cn) % PAGE_ROWS_ALIGN):
            p.append(f"cluster {self.cluster} with BM={self.bm}: each CTA loads {self.bm}/{cn} rows of the shared "
                     f"A tile, which must be whole {PAGE_ROWS_ALIGN}-row swizzle atoms within one block of {WGMMA_M} "
                     f"rows; use a cluster along M or BM <= {WGMMA_M * cn}")
        return p


def output_tiles(m: int, n: int, tile) -> int:
    """Output tiles of an M x N result with (BM, BN, ...) tiles."""
    return -(-m // tile[0]) * -(-n // tile[1])


def wave_work(m: int, n: int, num_sms: int, tile) -> int:
    """The output elements the persistent grid's waves take an M x N result in: waves x tile area
    (a wave lasts as long as its fullest SM's tile, however empty the others)."""
    return -(-output_tiles(m, n, tile) // num_sms) * tile[0] * tile[1]


# A narrower tile does less per byte it loads: measured on an H100 at many waves, 128x128 tiles
# ran at 0.93-0.98 of 128x256 ones. A call switches to it only for 10% less wave work.
NARROW_TILE_MARGIN = 0.9


def saves_waves(m: int, n: int, num_sms: int, tile, than) -> bool:
    """Whether `tile`'s waves take at least 10% less time than `than`'s for an M x N output, by
    `wave_work`: fewer than one wave of the wider tiles, or a last wave that costs a large share
    of few (512 x 10240: 2 waves of 160 wide tiles on 132 SMs, 3 of 320 narrow ones). At many
    waves the last wave's fill hardly counts and the wider tile stays (8192 x 28672: 55 waves)."""
    return wave_work(m, n, num_sms, tile) < NARROW_TILE_MARGIN * wave_work(m, n, num_sms, than)


def cluster_waves_no_more(m: int, n: int, num_sms: int, tile, cluster_m: int) -> bool:
    """Whether clusters of `cluster_m` CTAs on tiles along M (num_sms / cluster_m of them at a
    time) take no more waves than single CTAs on the same tiles: the pairs' last row of tiles may
    be half empty; never where fewer SMs than a cluster's CTAs run at once."""
    if num_sms < cluster_m:
        return False
    tiles_m, tiles_n = -(-m // tile[0]), -(-n // tile[1])
    clusters = -(-tiles_m // cluster_m) * tiles_n
    return -(-clusters // (num_sms // cluster_m)) <= -(-output_tiles(m, n, tile) // num_sms)


def default_schedule(**overrides) -> MatmulSchedule:
    """Hopper heuristic: 128x256x64 tiles, 1 producer + 2 consumer warpgroups at 24/240
    registers (the producer only issues copies; the consumers hold a 64x256 fp32 accumulator
    plus the epilogue's side tiles), and as many stages as fit beside the epilogue's staging
    buffer (at most 4). Where outputs of several dtypes stage too many bytes for two stages
    beside them, the tile narrows (BN 128, then 64). With mode="pingpong" the tile is 128x128 (one
    warpgroup's two blocks of 64 rows, 128 accumulator registers). The raster group is
    `balanced_swizzle_group`'s."""
    check_overrides(MatmulSchedule, overrides)
    consumers = overrides.get("consumer_warpgroups", 2)
    rows = WGMMA_M * consumers if is_int(consumers) and consumers >= 1 else 128
    width = 256
    if overrides.get("mode") == "pingpong":
        rows, width = 2 * WGMMA_M, 128     # each warpgroup's own tile: two m64 blocks, 128 accumulator registers
    base = dict(tile=(rows, width, 64), consumer_warpgroups=2, stages=2,
                consumer_registers=default_consumer_registers(consumers, overrides.get("producer_registers", PRODUCER_REGISTERS)))
    base["swizzle_group"] = balanced_swizzle_group(base.get("tile", (rows, width, 64)), overrides.get("tile"),
                                                   overrides.get("raster", "row"))
    base.update({k: v for k, v in overrides.items() if k not in ("stages", "mma_inflight")})
    try:
        probe = MatmulSchedule(**base)
    except ScheduleError:
        narrower = [] if "tile" in overrides else _fitting(base, (128, 64), "swizzle_group" not in overrides)
        if not narrower:
            raise
        probe = narrower[0]
    stages = overrides.get("stages", min(4, max_stages(probe)))
    # Keeping a wgmma in flight holds its stage: one stage alone must wait for every mma.
    inflight = overrides.get("mma_inflight", 1 if is_int(stages) and stages >= 2 else 0)
    return replace(probe, stages=stages, mma_inflight=inflight)


def balanced_swizzle_group(default_tile, tile=None, raster: str = "row") -> int:
    """The grouped raster's group: g rows of BM x (wave / g) columns of BN tiles run at once, and
    their operand slices are read from memory once per wave: g x BM + (wave / g) x BN rows, least
    at g = sqrt(wave x BN / BM) (16 for 128 x 256 tiles on 132 SMs, 11 for 128 x 128). Measured on an
    H100, 128 x 256 tiles timed interleaved at 7 large shapes in both layouts (docs/benchmarks.md):
    16 against 8 within 1% at 10 of 14 rows, 5% faster at two (8192 x 28672 x 4096 and
    8192 x 10240 x 8192, B [N, K]), 1-2% slower at none beyond the noise."""
    bm, bn = (tile if isinstance(tile, tuple) and len(tile) == 3 and all(is_int(t) and t > 0 for t in tile)
              else default_tile)[:2]
    if raster == "column":      # groups of columns: the same balance with the roles swapped
        bm, bn = bn, bm
    return max(1, min(SWIZZLE_GROUP_MAX, round(math.sqrt(HOPPER_SMS * bn / bm))))


def _fitting(fields: dict, widths, regroup: bool) -> list[MatmulSchedule]:
    """The valid schedules among `fields` with BN set to each of `widths` (and, with `regroup`,
    the raster group balanced for it)."""
    found = []
    for bn in widths:
        tile = (fields["tile"][0], bn, fields["tile"][2])
        group = {"swizzle_group": balanced_swizzle_group(tile, raster=fields.get("raster", "row"))} if regroup else {}
        try:
            found.append(MatmulSchedule(**{**fields, "tile": tile, **group}))
        except ScheduleError:
            pass
    return found


def schedule_space(output_bytes: int = 2, operand_bytes: int = 2,
                   split_ks: tuple[int, ...] = (1, MAX_SPLIT_K)) -> Iterator[MatmulSchedule]:
    """Schedules of the space this workload implements, for a search: BM 128 (2 consumer
    warpgroups) or 64 (1), BN 64..256, both epilogues, either raster, and split-K off or up to
    MAX_SPLIT_K (the host picks the split per call); ping-pong 128 x 128, 64 x 256 and 128 x 64
    and cooperative 256 x 128, unsplit; clusters of two CTAs (`MatmulSchedule.cluster`) at 128 x 256 and
    128 x 128; stream-K at 128 x 256, 128 x 192 and 128 x 128. With 2 consumers and no split every stage
    count that fits, with and without a wgmma group in flight; the other families with the
    default's stages (as many as fit, at most 4) and a group in flight, which keeps the space a
    search times small. (`MatmulSchedule` also takes other register budgets, raster
    groups and split bounds.) A batched matmul passes `split_ks=(1,)`: split-K and stream-K are
    2-D only."""
    for consumers in (2, 1):
        for split_k in split_ks:
            for bn in TILE_N:
                for epilogue in ("tma_store", "direct"):
                    for raster in ("row", "column"):
                        fields = dict(tile=(WGMMA_M * consumers, bn, SWIZZLE_ROW_BYTES // operand_bytes),
                                      consumer_warpgroups=consumers, epilogue=epilogue, raster=raster,
                                      split_k=split_k, output_bytes=output_bytes, operand_bytes=operand_bytes)
                        if consumers == 2 and split_k == 1:
                            yield from _stage_choices(fields)
                            continue
                        try:
                            yield default_schedule(**fields)
                        except ScheduleError:
                            continue
    # Two consumer warpgroups with tiles of their own (ping-pong), or each with two blocks of 64
    # rows (256 x 128): no split, the default's stages.
    for mode, tile in (("pingpong", (128, 128)), ("pingpong", (64, 256)), ("pingpong", (128, 64)),
                       ("cooperative", (256, 128))):
        for epilogue in ("tma_store", "direct"):
            for raster in ("row", "column"):
                try:
                    yield default_schedule(tile=tile + (SWIZZLE_ROW_BYTES // operand_bytes,), mode=mode, epilogue=epilogue,
                                           raster=raster, output_bytes=output_bytes, operand_bytes=operand_bytes)
                except ScheduleError:
                    continue
    # Clusters of two CTAs along M (sharing B) or N (sharing A), 128 x 256 and 128 x 128 tiles: the
    # default's stages, TMA-store epilogue, row raster.
    for cluster in ((2, 1, 1), (1, 2, 1)):
        for bn in (256, 128):
            try:
                yield default_schedule(tile=(2 * WGMMA_M, bn, SWIZZLE_ROW_BYTES // operand_bytes), cluster=cluster,
                                       output_bytes=output_bytes, operand_bytes=operand_bytes)
            except ScheduleError:
                continue
    # Stream-K (2-D only, as split-K): 128 x 256, 128 x 192 and 128 x 128 tiles, the default's
    # stages, TMA-store epilogue, row raster.
    if len(split_ks) > 1:
        for bn in (256, 192, 128):
            try:
                yield default_schedule(tile=(2 * WGMMA_M, bn, SWIZZLE_ROW_BYTES // operand_bytes), stream_k=True,
                                       output_bytes=output_bytes, operand_bytes=operand_bytes)
            except ScheduleError:
                continue


def _stage_choices(fields: dict) -> Iterator[MatmulSchedule]:
    """`fields` with every stage count that fits, with and without a wgmma group in flight."""
    try:
        probe = default_schedule(**fields, stages=1, mma_inflight=0)
    except ScheduleError:
        return       # not even one stage fits beside the staged outputs
    for stages in range(1, max_stages(probe) + 1):
        for inflight in ((0, 1) if stages >= 2 else (0,)):
            try:
                yield replace(probe, stages=stages, mma_inflight=inflight)
            except ScheduleError:
                continue
