"""The attention workload's schedule: flash attention with an online softmax.

tile = (BM, BN, D): BM query rows per tile (64 per consumer warpgroup), BN keys per kv block
(the k extent of P @ V), and the head dim D of Q and K (the k extent of Q @ K^T, so the third
entry is the k extent of the first GEMM as it is for matmul). `head_dim` names it; the head dim
of V and O follows from it (`value_dim`: the same, or 128 beside 192, DeepSeek-style MLA prefill).

Q, K and V lie in shared memory as column chunks of one swizzle span each (`chunk_columns`):
64 columns (128-byte rows, 128-byte swizzle) where the dim is a multiple of 64, else 32 (64-byte
rows, 64-byte swizzle): a head dim of 96 is 3 chunks of 32, so no MMA work is padded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from wsched.schedule import (PRODUCER_REGISTERS, Schedule, ScheduleError, check_overrides, default_consumer_registers,
                             is_int, max_stages)
from wsched.target import (PAGE_ROWS_ALIGN, SETMAXNREG_STEP, SMEM_ALIGN, SWIZZLE_ROW_BYTES, WARPGROUP_THREADS, WGMMA_K,
                           WGMMA_M, launch_registers)

# The head dims of Q and K the kernels implement, and the head dim of V and O beside each.
VALUE_DIMS = {64: 64, 96: 96, 128: 128, 192: 128, 256: 256}
HEAD_DIMS = tuple(VALUE_DIMS)

# The most CTAs one tile's kv blocks may be split across (split-KV decode); the host picks the
# split count per call (loops.split_count), at most this.
MAX_SPLIT_KV = 32
# The fewest kv blocks a split takes, and how many (tile, split) units a call aims at
# (loops.split_count). A split costs its partial's store, the ticket (~1.2 us once a tile is
# split at all) and its share of the last split's merge (8 splits' loads a round, a round per 8
# query rows); it saves the kv blocks it takes from the others, ~1.7 us each at D128 (one
# warpgroup's latency over a 64-row tile of a few query rows). Where units on all SMs would give
# each tile 16 or more (at most num_sms / 16 tiles), units on half the SMs read K/V as fast and
# merge half as many splits, unless each split would then be long (FEW_SPLIT_BLOCKS) and the
# merge short (FEW_SPLIT_MERGE); with more tiles the units fill the SMs, so that no unit's chain
# of blocks outlasts the read. Measured on an H100 (cold L2, D128, cuDNN in the same
# run, µs):
#   2026-11-24, by the fewest blocks a split (8 / 4 / 2 / 1), units on all SMs: B1 H32/8 T1024
#   15.7 / 14.0 / 13.2 / 13.4 (cuDNN 12.3), T8192 28.2 (8 splits) / 29.9 (16) / 29.8 / 29.8 (26.9);
#   B8 H32/8 T1024 22.5 unsplit / 23.7 in 2; but B8 H32/8 T8192 112 unsplit / 105 in 2 (108 cuDNN)
#   and T32768 384 / 365 (365): 64 tiles of 64-256 blocks need the whole GPU.
#   2026-11-25, units on half / all of the SMs: 8 tiles (B1 H32/8, 8 / 16 splits) T8192 26.8 /
#   29.7 (cuDNN 26.0), T32768 67.6-69.8 / 67.3-67.4 (63.3-64.4); 16 tiles (4 / 8 splits: B2 H32/8,
#   B1 H32/16) T8192 42.2-42.7 / 40.1-40.4 (39.5-40.6), T32768 115.4-116.9 / 107.2-107.6
#   (105.7-107.1); 32 tiles (2 / 4 splits: B1 H32/32, B4 H32/8) T8192 65.6-68.6 / 62.4-62.6
#   (63.1-63.7), T32768 201-204 / 191.9-192.5 (192.8-192.9), T1024 equal (17.3-17.4).
#   2026-11-25, after the merge moved to linear tiles (all 128 threads loading, 8 splits in flight),
#   half / all: 8 tiles (8 / 16 splits) T4096 16.9 / 17.6, T8192 24.6 / 25.1, T16384 41.0-41.1 /
#   39.5-39.6, T32768 65.6-66.6 / 62.4-62.7, T65536 111.7-114.7 / 106.0-106.6 (cuDNN 18.1, 26.0,
#   39.9-41.0, 63.2-63.5, 105.9-107.1): all SMs from 8 blocks a split (FEW_SPLIT_BLOCKS); 4 tiles
#   (16 / 32 splits) B1 H32/4 T8192 19.1 / 21.7, T16384 26.5 / 29.1, T32768 43.2 / 43.5, B2 H32/2
#   T32768 46.5 / 49.2: a merge of 32 splits (of 16 query rows: 2 chunks of 8) costs what the
#   shorter splits save (FEW_SPLIT_MERGE). Two or four units an SM (more splits) were slower at
#   every shape (B8 H32/8 T8192 104.4 -> 111.1 / 114.5).
MIN_KV_BLOCKS_PER_SPLIT = 2
FEW_SPLIT_TILES = 16   # tiles at most num_sms / this: units on half the SMs, else on all of them
FEW_SPLIT_BLOCKS = 8   # ... unless a split on all SMs would take at least this many kv blocks
FEW_SPLIT_MERGE = 16   # ... and the merge would take at most this many splits


def head_dims_text() -> str:
    """The supported head dims, for errors: "64, 96, 128, 256 (V the same) or 192 with V 128"."""
    same = [d for d, v in VALUE_DIMS.items() if d == v]
    other = [f"{d} with V {v}" for d, v in VALUE_DIMS.items() if d != v]
    return f"{', '.join(map(str, same))} (V the same) or {' or '.join(other)}"


def chunk_columns(dim: int, element_bytes: int) -> int:
    """Columns of one swizzled smem chunk of a Q, K or V tile whose rows hold `dim` values:
    a 128-byte row where `dim` is a multiple of it, else a 64-byte one (head dim 96)."""
    wide = SWIZZLE_ROW_BYTES // element_bytes
    return wide if dim % wide == 0 else wide // 2


# The most keys per kv block (BN) whose S tile, P, the O accumulator and the softmax state fit
# the registers of a consumer thread, by (consumer_warpgroups, head dim of V and O, mma_inflight):
# beyond it ptxas spills (a build error). Measured with nvcc on the causal + LSE + GQA kernels, the
# largest of each family; with 2 consumer warpgroups a thread has 168 registers, with 1 it starts
# with 248 (`target.launch_registers`). Q and K stay in shared memory: their head dim does not count.
MAX_KEYS_PER_BLOCK = {
    (2, 64, 0): 192, (2, 64, 1): 192,
    (2, 96, 0): 192, (2, 96, 1): 192,
    (2, 128, 0): 192, (2, 128, 1): 192,
    (2, 256, 0): 128, (2, 256, 1): 64,
    (1, 64, 0): 256, (1, 64, 1): 256,
    (1, 96, 0): 256, (1, 96, 1): 192,
    (1, 128, 0): 256, (1, 128, 1): 192,
    (1, 256, 0): 128, (1, 256, 1): 128,
}
# Narrower limits where the score function keeps more registers live (`ScoreFunction.
# register_costs`), measured the same way on the heaviest variant of each kind: ALiBi (a slope
# times j - i added to every score) for "computes on the scores", document ids for "reads a
# per-key input" (a [1, BN] f32 tile beside S: BN / 4 registers a thread; (1, 128, 0) spilled 16
# bytes at 192 once causal tiles ran heaviest first, 2026-11-23). Keys not listed keep
# MAX_KEYS_PER_BLOCK's; a function of both kinds takes the narrower.
SCORE_FUNCTION_KEYS_PER_BLOCK = {
    "computes on the scores": {(1, 64, 0): 192, (1, 96, 0): 128, (1, 128, 0): 128, (1, 256, 0): 64},
    "reads a per-key input": {(2, 64, 1): 128, (2, 96, 1): 128, (2, 128, 1): 128,
                              (1, 64, 1): 128, (1, 96, 0): 192, (1, 96, 1): 128, (1, 128, 0): 128,
                              (1, 128, 1): 128, (1, 256, 1): 64},
}


# The value dim at which one consumer warpgroup has no register margin left: beside a 64 x 256 fp32
# O, the split-KV merge spills unless a block is 32 keys with the softmax not overlapped (the decode
# variant, AttentionWorkload.variants), and other one-warpgroup decode schedules spill (nvcc,
# 2026-11-23: 8 of the 122 one-warpgroup and split-KV schedules of five fusions, all at 256), so
# the search space offers the variants alone there (AttentionWorkload.schedule_space).
THIN_MARGIN_VALUE_DIM = 256

# (consumer_warpgroups, head dim of V and O, mma_inflight) whose split-KV kernel spills where the
# plain one does not (measured with nvcc on the causal + LSE kernels, GQA-packed or not,
# 2026-11-23: 8 to 28 bytes; with the merge on fragment tiles, not measured again since it moved
# to linear tiles, 2026-11-25).
SPLIT_KV_SPILLS = {(2, 256, 1), (1, 256, 1)}
# (with one consumer warpgroup and 64 keys a block head dim 256 spilled at mma_inflight=0 too, where
# GQA-packed: the decode variant takes 32 keys a block there, AttentionWorkload.variants)


OVERLAPPED_KEYS_WITH_FEWER_REGISTERS = 128


def max_keys_per_block(schedule: "AttentionSchedule", kinds: tuple[str, ...] = ()) -> int:
    """The widest BN whose kernel does not spill, for a score function that keeps registers
    live in the given `kinds` (SCORE_FUNCTION_KEYS_PER_BLOCK; none: plain attention)."""
    key = (schedule.consumer_warpgroups, schedule.value_dim, schedule.mma_inflight)
    widest = MAX_KEYS_PER_BLOCK.get(key, 256)
    if schedule.mma_inflight and is_int(schedule.consumer_registers) and is_int(schedule.producer_registers) and \
            schedule.consumer_registers < default_consumer_registers(schedule.consumer_warpgroups, PRODUCER_REGISTERS):
        # the table's consumers have all the registers a 24-register producer leaves; beside a
        # paged producer (32 or 40: 232) BN=192 with the softmax overlapped spilled 32 bytes at
        # head dim 128 (nvcc, 2026-11-23; the GPU fuzzer drew it), 128 builds
        widest = min(widest, OVERLAPPED_KEYS_WITH_FEWER_REGISTERS)
    return min([widest] + [SCORE_FUNCTION_KEYS_PER_BLOCK[kind].get(key, widest) for kind in kinds])


# The split-KV merge reads every split's O, max and sum into linear tiles (docs/ir.md, "Linear
# tiles"), each thread MERGE_PER_THREAD values of a row: 10 loads a split, 8 splits' in flight,
# a round of loads per merge_rows() query rows and 8 splits (epilogue._split_merge).
MERGE_PER_THREAD = 8
MERGE_SPLITS_IN_FLIGHT = 8    # splits whose loads the merge issues together (80 registers a thread)


def merge_rows(value_dim: int) -> int:
    """Rows of the merge's linear tiles: as many as hold MERGE_PER_THREAD values a thread
    ([8, 128] at head dim 128, [16, 64] at 64), a power of two dividing the warpgroup's threads."""
    rows = WGMMA_M   # at most a warpgroup's rows (a power of two dividing its threads)
    while rows > 1 and (rows * value_dim > MERGE_PER_THREAD * WARPGROUP_THREADS
                        or rows * value_dim % WARPGROUP_THREADS):
        rows //= 2
    return rows


@dataclass(frozen=True)
class AttentionSchedule(Schedule):
    """A `Schedule` whose tile is (query rows, keys per kv block, head dim). `mma_inflight=1`
    overlaps the softmax of one kv block with the previous block's P V (the overlap_softmax
    pass); `mode="pingpong"` makes the two consumer warpgroups take turns issuing their GEMMs.

    `split_kv` is the most CTAs a tile's kv blocks may be split across (decode, long context with
    few tiles): 1 builds the plain kernel; above 1 the host picks the split count per call
    (`loops.split_count`: at most `split_kv`, at least MIN_KV_BLOCKS_PER_SPLIT kv blocks a
    split, units on all SMs or on half of them where the tiles are few and the splits short),
    each split keeps its partial O, row max and row sum in a workspace, and the last split of a
    tile to finish merges them (docs/architecture.md, "Split-KV"). `pack_gqa` puts the G query heads that share a KV head
    into the rows of one tile (a [..., G, S, D] Q against [..., 1, T, D] K and V): the G x S
    rows of a decode step fill a tile that S alone would leave nearly empty, and K and V are read
    once for all G heads."""

    workload = "attention"
    # Three consumer warpgroups (192 query rows on 24/160 registers) build without spills at head
    # dim 64 with 128 keys a block; wider ones spill, a build error (`build_without_spills`).
    consumer_counts = (1, 2, 3)
    tile: tuple[int, int, int] = (128, 128, 128)
    epilogue: str = "direct"
    split_kv: int = 1
    pack_gqa: bool = False

    @property
    def head_dim(self) -> int:
        """The head dim of Q and K."""
        return self.tile[2]

    @property
    def value_dim(self) -> int:
        """The head dim of V and O (the head dim's own where it is not supported)."""
        return VALUE_DIMS.get(self.head_dim, self.head_dim)

    @property
    def stage_bytes(self) -> int:
        """A K block [BN, D] and a V block [BN, value_dim]."""
        return self.bn * (self.head_dim + self.value_dim) * self.operand_bytes

    @property
    def epilogue_bytes(self) -> int:
        """The Q tile [BM, D], loaded once per tile, and with split-KV the smem slot each
        consumer warpgroup reads its ticket from (one aligned buffer)."""
        return self.bm * self.head_dim * self.operand_bytes + (SMEM_ALIGN if self.splits_kv else 0)

    @property
    def splits_kv(self) -> bool:
        """Whether the kernel may split a tile's kv blocks (split_kv > 1)."""
        return is_int(self.split_kv) and self.split_kv > 1

    @property
    def softmax_exp2(self) -> str:
        """The tile op of the softmax's exponentials: `exp2_ftz` (one ex2.approx.ftz) in a kernel
        that does not split its kv blocks, `exp2` (exp2f: ex2.approx.f32 kept exact for subnormal
        results) in one that does. Same process on an H100: the flushed op sped prefill up
        1.02-1.15x (B4 H16 S4096, 2026-11-25: causal D64 1.056, D128 1.035, no mask D128 1.151,
        softcap D64 / D128 1.022 / 1.043; docs/ir.md) and slowed the split-KV decode kernels of
        batch 1 (2026-11-24, H32/32 T32768 200 -> 221 us; 2026-11-25, cold L2: 0.96-1.01, B1
        H32/8 T32768 0.96)."""
        return "exp2" if self.splits_kv else "exp2_ftz"

    def short(self) -> str:
        return (super().short() + (f" split_kv={self.split_kv}" if self.split_kv != 1 else "")
                + (" pack_gqa" if self.pack_gqa is True else "")
                + (" mma_inflight=0" if self.mma_inflight == 0 else "")
                + (" pingpong" if self.mode == "pingpong" else ""))

    def _workload_problems(self) -> list[str]:
        p: list[str] = []
        bn, d = self.bn, self.head_dim
        if self.mode == "pingpong" and (self.consumer_warpgroups != 2 or self.mma_inflight != 1):
            p.append("attention ping-pong alternates 2 consumer warpgroups around the overlapped "
                     "softmax: it needs consumer_warpgroups=2 and mma_inflight=1")
        if d not in HEAD_DIMS:
            p.append(f"head dim (BK) {d} is not one of {', '.join(map(str, HEAD_DIMS))} (of Q and K; V: "
                     f"{head_dims_text()})")
        if bn % WGMMA_K or bn > 256 or bn % 64 and bn > 64:
            p.append(f"BN={bn} (keys per block) must be a multiple of {WGMMA_K} (the k extent of "
                     f"P @ V), at most 256, and a multiple of 64 above 64")
        if not is_int(self.split_kv) or not 1 <= self.split_kv <= MAX_SPLIT_KV:
            p.append(f"split_kv={self.split_kv!r} must be an int in [1, {MAX_SPLIT_KV}] (the most CTAs one tile's "
                     f"kv blocks are split across; 1: no split)")
        if self.splits_kv and (self.consumer_warpgroups, self.value_dim, self.mma_inflight) in SPLIT_KV_SPILLS:
            fixes = [f"mma_inflight={m}" for m in (0, 1)
                     if m != self.mma_inflight and (self.consumer_warpgroups, self.value_dim, m) not in SPLIT_KV_SPILLS]
            fixes += [f"consumer_warpgroups={n}" for n in (1, 2)
                      if n != self.consumer_warpgroups and (n, self.value_dim, self.mma_inflight) not in SPLIT_KV_SPILLS]
            p.append(f"split_kv={self.split_kv} with head dim {self.value_dim}, mma_inflight={self.mma_inflight} and "
                     f"{self.consumer_warpgroups} consumer warpgroups needs more registers than a consumer thread has "
                     f"(the merge of the splits beside O): ptxas spills; use {' or '.join(fixes + ['split_kv=1'])}")
        if not isinstance(self.pack_gqa, bool):
            p.append(f"pack_gqa={self.pack_gqa!r} must be True or False")
        if self.epilogue != "direct":
            p.append("attention stores O and LSE with epilogue='direct' (tma_store is not "
                     "implemented for attention yet)")
        widest = MAX_KEYS_PER_BLOCK.get((self.consumer_warpgroups, self.value_dim, self.mma_inflight))
        if widest is not None and bn > widest:
            p.append(f"BN={bn} keys per block with head dim {d}, mma_inflight={self.mma_inflight} and "
                     f"{self.consumer_warpgroups} consumer warpgroup(s) needs more registers than a consumer "
                     f"thread has ({launch_registers(self.threads)}): ptxas spills; use BN <= {widest}")
        elif widest is not None and is_int(bn) and bn > max_keys_per_block(self):
            p.append(f"BN={bn} keys per block with head dim {d} and the softmax overlapped (mma_inflight=1) needs "
                     f"more than the {self.consumer_registers} registers a consumer thread has beside a "
                     f"{self.producer_registers}-register producer: ptxas spills; use BN <= {max_keys_per_block(self)} "
                     f"or mma_inflight=0")
        return p


def page_size_fits(page_size: int, bn: int) -> bool:
    """Whether TMA can fill kv blocks of bn keys from pages of page_size keys: whole pages or
    slices of one, in boxes of a multiple of PAGE_ROWS_ALIGN rows (partition names the rule)."""
    return page_size % PAGE_ROWS_ALIGN == 0 and (bn % page_size == 0 or page_size % bn == 0)


def paged_producer_registers(bn: int, page_size: int, split: bool = False) -> int:
    """The producer's registers where a kv block of bn keys is gathered from pages of page_size
    keys: it holds the block's page indices (one per slice) from the table reads to the TMA
    issues, and with split-KV the split's range too. Measured with ptxas (2026-11-23): 8 slices
    (pages of 16, 128 keys a block) spill 16 bytes at 32 registers and none at 40; 4 slices
    build at 32; 2 at 24, or 32 with split-KV (head dim 256, 32 keys a block)."""
    slices = bn // min(page_size, bn)
    if slices == 1:
        return PRODUCER_REGISTERS
    need = 16 + 3 * slices + (8 if split else 0)
    return max(PRODUCER_REGISTERS, -(-need // SETMAXNREG_STEP) * SETMAXNREG_STEP)


# (consumer warpgroups, head dim of V and O) whose split-KV kernel spills where a kv block is
# gathered from two or more pages (measured with nvcc, causal + LSE, 2026-11-23: 12 to 28 bytes at
# any producer_registers from 24 to 48); one page a block, or no split, builds.
PAGED_SPLIT_KV_SPILLS = {(2, 256)}


# Head dims at which a score function with a diagonal bias (ALiBi) defaults to mode="pingpong":
# the bias's add per score makes the softmax the longer part of a block beside the short GEMMs of
# head dim 64, and taking turns overlaps one warpgroup's softmax with the other's GEMMs. H100,
# same process, causal ALiBi, TFLOP/s ping-pong / cooperative (2026-11-24): B4 H16 S4096 1.17,
# B16 H16 S1024 1.14, B2 H16 S8192 1.19, B4 H32/8 S4096 1.13, B8 H16 S2048 1.17; at head dim 128
# 0.99 and 1.00; plain causal and softcap at 64 gain nothing (0.99, 0.95).
PINGPONG_BIAS_HEAD_DIMS = (64,)
# Head dims at which a call whose score function cuts no diagonal (no causal or window mask, no
# ALiBi: `ScoreFunction.cuts_diagonals`), or whose masks are causal only, and whose keys number at
# least THREE_WARPGROUP_MIN_KEYS runs 192 query rows on three consumer warpgroups (128 keys a
# block, 160 registers each; a per-call variant): FlashAttention-3's head-dim-64 shape. The GEMMs
# of head dim 64 are short beside each block's softmax, and a third warpgroup keeps the tensor
# cores fed. H100, same process, B x H16 (GQA H32/8), ratio to 128 rows on two warpgroups
# (2026-11-25): no mask S512 B32 1.00, S1024 B16 1.02, S2048 B8 1.09, S4096 B4 1.10 (with LSE
# 1.15), S8192 B2 1.11, GQA S4096 1.07, document mask S4096 1.05. With few keys a tile the larger
# tiles' fixed costs weigh more and they win only where they save waves: B4 H16/4 S420 (2 waves
# either way) ran 0.77 of cuDNN on them and 0.94-0.95 on 128-row tiles (separate sweep runs). Where the tiles cross a diagonal the 192-row tiles mask two blocks a
# tile, not one, which long causal sequences amortise (THREE_WARPGROUP_MIN_KEYS["causal"]): causal
# S4096 0.98-1.00, B4 S6000 1.04, B2 S8192 1.07 (with LSE 1.12), GQA H32/8 S12000 1.07, S16384
# 1.05; a window's tiles see its width whatever T is (window 1024 at S16384: 0.97), and document +
# causal at S4096 measured 0.97-1.01: neither takes them.
THREE_WARPGROUP_HEAD_DIMS = (64,)
# The keys a call needs for them, by how the score function cuts diagonals (AttentionWorkload
# ._three_warpgroups); the per-call rule also weighs the waves of tiles either way.
THREE_WARPGROUP_MIN_KEYS = {"no diagonal": 1024, "causal": 5120}


def default_schedule(head_dim: int, page_size: int | None = None, **overrides) -> AttentionSchedule:
    """FlashAttention-3-like shape: 128 query rows (2 consumer warpgroups x 64), 128 keys per
    block (64 for head dim 256, to keep O and S in registers), 3 K/V stages where they fit (2 at
    head dim 256), 24/240 registers (more for the producer of a paged cache with pages shorter
    than a block: `paged_producer_registers`), and the P V product of one block overlapping the
    softmax of the next (mma_inflight=1)."""
    check_overrides(AttentionSchedule, overrides)
    consumers = overrides.get("consumer_warpgroups", 2)
    rows = 64 * consumers if is_int(consumers) and consumers >= 1 else 128
    tile = (rows, 64 if VALUE_DIMS.get(head_dim) == 256 else 128, head_dim)
    given = overrides.get("tile", tile)
    bn = given[1] if isinstance(given, tuple) and len(given) == 3 else None   # else the schedule's error
    producer = PRODUCER_REGISTERS
    if page_size and is_int(bn) and bn > 0 and page_size_fits(page_size, bn):   # else partition names the rule
        producer = paged_producer_registers(bn, page_size, overrides.get("split_kv", 1) != 1)
    producer = overrides.get("producer_registers", producer)
    base = dict(tile=tile, stages=1, consumer_warpgroups=2, producer_registers=producer,
                consumer_registers=default_consumer_registers(consumers, producer),
                epilogue="direct", mma_inflight=1)
    # mode="pingpong" (pingpong.py) is correct but measured 1-14% slower than letting the
    # two warpgroups interleave freely (H200, 2026-11-21): cooperative stays the default, but for
    # a diagonal bias at PINGPONG_BIAS_HEAD_DIMS (AttentionWorkload.default_schedule).
    base.update({k: v for k, v in overrides.items() if k != "stages"})
    probe = AttentionSchedule(**base)
    # K/V stages: as many as fit beside Q, up to 3 (measured on H200: 3 beats 2 by 1-5% at
    # head dims 64 and 128; head dim 256 fits only 2).
    return replace(probe, stages=overrides.get("stages", min(3, max_stages(probe))))


def schedule_space(head_dim: int, kinds: tuple[str, ...] = ()) -> Iterator[AttentionSchedule]:
    """Schedules of the space this workload implements, for a search: 2 consumer warpgroups,
    64..256 keys per block (as many as the registers hold beside the score function's `kinds`,
    `max_keys_per_block`), 1 stage up to as many as fit, the softmax overlapped with P V or not,
    cooperative or ping-pong consumers; at THREE_WARPGROUP_HEAD_DIMS also 192 rows on 3
    cooperative warpgroups with 128 keys a block (wider blocks spill there)."""
    for bn in (64, 128, 192, 256):
        for inflight in (0, 1):
            for mode in ("cooperative", "pingpong"):
                try:
                    probe = AttentionSchedule(tile=(128, bn, head_dim), stages=1, mma_inflight=inflight, mode=mode)
                except ScheduleError:
                    continue
                if bn > max_keys_per_block(probe, kinds):
                    continue
                yield from _stage_counts(probe)
    if head_dim in THREE_WARPGROUP_HEAD_DIMS:
        for inflight in (0, 1):
            probe = AttentionSchedule(tile=(192, 128, head_dim), stages=1, consumer_warpgroups=3,
                                      consumer_registers=default_consumer_registers(3, PRODUCER_REGISTERS),
                                      mma_inflight=inflight)
            if 128 <= max_keys_per_block(probe, kinds):
                yield from _stage_counts(probe)


def _stage_counts(probe: AttentionSchedule) -> Iterator[AttentionSchedule]:
    """`probe` with 1 stage up to as many as fit."""
    for stages in range(1, max_stages(probe) + 1):
        try:
            yield replace(probe, stages=stages)
        except ScheduleError:
            continue
