"""The matmul workload: C = epilogue(A @ B) as a persistent, warp-specialized GEMM.

The producer loads A and B tiles through one channel per k step; the consumer warpgroups run
one wgmma per k step into an fp32 accumulator, then the fused elementwise epilogue and the
stores (TMA or direct). It takes fusions with exactly one matmul whose operands are
inputs, and elementwise ops after it; a batched one ([*batch, M, K] @ [*batch, K, N], batch dims
that broadcast) walks the batch as the outermost tile dimension.
"""

from __future__ import annotations

from dataclasses import replace

from wsched.lowering.context import Step
from wsched.target import TMA_FAST_ROW_ALIGNMENT
from wsched.schedule import ScheduleError, max_stages
from wsched.workloads.base import Workload

from . import epilogue, loops, partition, pingpong, schedule

from .schedule import MAX_SPLIT_K, MatmulSchedule, cluster_waves_no_more, output_tiles, saves_waves, wave_work

# Ping-pong's variant keeps five stages of its 128 x 128 tiles (32 KB each) where they fit beside
# the staged outputs. Against four, one interleaved H100 run at square shapes was mixed (-5% to +7%,
# the short-K rows ahead); the Llama-3 rows the variant serves (M 128-512) were measured with five.
PINGPONG_STAGES = 5
# The M <= 64 variant streams the weights: more stages keep more bytes in flight per SM (Little's
# law). Eight of its 64 x 128 tiles (24 KB each) fit beside a bf16 staging tile; measured on an
# H100 (Llama-3 nk rows at M 1, 16, 64): geomean over cuBLAS 1.177 with four, 1.192 with eight,
# the weight read at M = 1 of 70B gate_up 91% -> 94% of a plain read (docs/benchmarks.md).
SMALL_M_STAGES = 8
# A call whose 64 x 64 tiles fit in one wave and whose K is at most SMALL_TILE_MAX_K_STEPS k steps
# of 64 runs 64 x 64 tiles on one consumer warpgroup, unsplit, SMALL_TILE_STAGES deep (16 KB a
# stage): more CTAs than 64 x 128 tiles give, each streaming its whole k range, and no split-K
# partials, tickets and sums, which cost such short calls more than they save. Measured on an
# H100 (cold L2, cuBLAS in the same run, 2026-11-25; 72 kn calls M 1-512 x N 512-4096 x K 1024-8192
# and 8 nk LLM rows, against the 64 x 128 split-K or ping-pong kernel the rules picked before):
# every call of one wave and at most 64 k steps gained (1.02-1.58x; K 1024 1.19-1.58x, to
# 0.96-1.03 of cuBLAS), beyond 64 k steps M <= 16 lost up to 0.87x (M1 N512 K8192: the split
# weight read wins) and one M 203 row 0.84x; beyond one wave (256 tiles and up) 0.55-0.96x.
SMALL_TILE_STAGES = 12
SMALL_TILE_MAX_K_STEPS = 64
# Longer K on few tiles: where the 64 x 64 tiles fill at most SMALL_TILE_SPLIT_MAX_FILL of the SMs,
# 64x64 tiles with split-K (the host splits K; the same 12 stages). Against the 64x128 split-K
# kernel the M <= 64 and few-tiles rules ran (H100, cold L2, cuBLAS in the same run, 2026-11-25; 55
# calls M 1-512 x N 512-2048 x K 6144-14336 with at most 132 64x64 tiles, both layouts): the 34 calls
# of at most 33 tiles gained 1.03-1.44x (0.55-0.92 -> 0.69-0.97 of cuBLAS); at 38-44 tiles it
# was mixed (0.97-1.18x) and from 55 on it mostly lost (0.68-1.06x), so the rule stops at a quarter.
SMALL_TILE_SPLIT_MAX_FILL = 0.25
# Between the default's 128x256 tiles and 128x128 ones: 128 x 192. Where its waves take at least 10%
# less wave work than 128x256 ones (`saves_waves`) and no more than 128x128 ones, a call runs it
# (in clusters of 2 along M where an input's rows are off a 64-byte boundary; plain 128x192 tiles
# ran such rows at 0.5-0.8 of cuBLAS). Measured on an H100 (cold L2, cuBLAS in the same run,
# 2026-11-25; 69 calls: M 1500-4864 x N 1024-4224 x K 4096, both layouts, rows aligned and 16 bytes
# off, and five more): the 41 calls the rule takes ran at 0.68-1.08 of cuBLAS against 0.57-0.97 on the kernel the
# rules below picked (ping-pong 128x128 or 128x256, in clusters where rows are off), 0.99-1.22x;
# where 128x192 tiles save no wave work they ran at 0.85-0.95x the default (M 4096 N 4096 K 4096),
# and where 128x128 tiles do less (M 1500 N 1024) ping-pong stays (0.81 of cuBLAS against 0.64).
MID_TILE = (128, 192, 64)
# The narrow tile the wave rules weigh against the default's 128x256 (ping-pong, or cooperative in
# clusters where rows are off a 64-byte boundary; see the comment below).
NARROW_TILE = (128, 128, 64)
# Where an input's rows are off a 64-byte boundary and the default's tiles fill half the SMs (the
# clustered 128x256 rule below), but 128x128 tiles take 10% less wave work in at most two waves:
# cooperative 128x128 tiles in clusters of 2 along M. H100, cold L2, cuBLAS in the same run
# (2026-11-25): tall narrow outputs (M 4774 x N 264 / 384 x K 1160 / 3920, both layouts) 0.60-0.75
# -> 0.78-0.85 of cuBLAS, 1.13-1.30x over 128x256 in clusters; at four and more waves of 128x128
# tiles (M 2466-5925, N 2240-4184) it lost 0.83-0.96x, and in place of ping-pong (the rule's
# first, wider form) it was mixed (0.91-1.12x over 17 calls), hence the bounds.
NARROW_CLUSTER_MAX_WAVES = 2
# Stream-K (`stream_k=True`): where the default's 128x256 tiles take a little more than one wave
# (at most STREAM_K_MAX_WAVES of them) the plain kernel's second wave runs nearly empty and
# 128x192 tiles take two waves of three-quarter tiles; spreading all tiles' k steps evenly over
# the SMs costs a CTA sharing a tile a partial's store and a ticket (~6 us on an H100) and the
# tile's last CTA a sum, which K of at least STREAM_K_MIN_K_STEPS k steps pays for. Measured on
# an H100 (cold L2, cuBLAS in the same run, 2026-11-25; rows on a 64-byte boundary, both layouts),
# against the 128x192 kernel the rules picked before: 133-147 tiles at K 4096 1.07-1.18x, K 6144
# 1.11-1.23x, K 8192-12288 1.16-1.25x; at K 2048 0.90-1.00x; 160-180 tiles (1.21-1.36 waves)
# 0.78-0.99x; 1.5-2 waves 0.68-1.05x; below one wave 0.84-0.89x of the plain kernel. Held out,
# after a first bound of 1.2 waves lost at 153-154 tiles (0.96x): 8 fresh calls of 135-147 tiles,
# K 4096-16384, 0.996-1.22x. Rows off a 64-byte boundary keep their clusters (stream-K 0.58-0.67
# of cuBLAS there, before the hand-over).
STREAM_K_MAX_WAVES = 1.15
STREAM_K_MIN_K_STEPS = 64


class MatmulWorkload(Workload):
    name = "matmul"
    schedule_type = MatmulSchedule
    split = staticmethod(partition.partition_matmul)
    describe = staticmethod(partition.describe)
    build_loops = staticmethod(loops.build_loops)
    epilogue = staticmethod(epilogue.epilogue)
    late_passes = (
        Step("pingpong", pingpong.run, True, lambda s: s.mode == "pingpong", 'mode="pingpong"'),
    )

    def matches(self, fusion) -> bool:
        return sum(n.op == "matmul" for n in fusion.nodes()) == 1

    def mismatch(self, fusion) -> str:
        found = sum(n.op == "matmul" for n in fusion.nodes())
        return f"matmul needs exactly one matmul (found {found})"

    def default_schedule(self, fusion, **overrides) -> MatmulSchedule:
        if "output_bytes" not in overrides:
            overrides["output_bytes"] = partition.staged_output_bytes(fusion)
        return schedule.default_schedule(**overrides)

    def variants(self, fusion, schedule: MatmulSchedule):
        """The default's tile (128x256) is right when its tiles fill the SMs; where they do not,
        a call switches (docs/architecture.md, the matmul schedule space):

        - 64x64 tiles fit in one wave (at most num_sms of them) and K is at most
          SMALL_TILE_MAX_K_STEPS k steps: 64x64 tiles on one consumer warpgroup, no split-K
          (short calls: the split's partials and sums cost more than they save), ahead of the
          rules below.
        - K beyond those k steps and 64x64 tiles that fill at most a quarter of the SMs
          (SMALL_TILE_SPLIT_MAX_FILL): 64x64 tiles with split-K.
        - M <= 64: 64x128 tiles (one consumer warpgroup: a 128-row tile would be at least half
          empty rows) with split-K; the host splits K when the tiles fill at most half the SMs.
        - rows of both inputs on a 64-byte boundary, 128x256 tiles that take more than one wave
          but at most STREAM_K_MAX_WAVES, and K of at least STREAM_K_MIN_K_STEPS k steps: the
          default's tile with stream-K (every CTA the same share of all tiles' k steps).
        - 128x192 tiles take at least 10% less wave work than the default's (`saves_waves`)
          and no more than 128x128 ones: 128x192 tiles (`MID_TILE`), in clusters of 2 along M
          where an input's rows are off a 64-byte boundary (and pairs take no more waves).
        - an input's rows off a 64-byte boundary and the default's tiles fill at least half the
          SMs (the clustered rule below), but 128x128 tiles (NARROW_TILE) take at least 10% less
          wave work in at most NARROW_CLUSTER_MAX_WAVES waves (and pairs along M take no more
          waves): cooperative 128x128 tiles in clusters of 2 along M.
        - rows of an input off a 64-byte boundary (`dispatch.ROW_ALIGN` below
          target.TMA_FAST_ROW_ALIGNMENT: TMA loads such rows slower), where the default's tiles
          fill at least half the SMs and pairs of them along M take no more waves: the default's
          tile in clusters of 2 CTAs along M, B multicast to both (half the B loads per CTA).
        - otherwise, where 128x128 tiles take at least 10% less wave work than the default's
          (`saves_waves`: waves x tile area): ping-pong 128x128 tiles where they fill more than
          half the SMs (nothing to split; each warpgroup's epilogue hides under the other's
          mainloop), else (few tiles) the M <= 64 variant's 64x128 tiles on one consumer
          warpgroup with split-K. Against cooperative 128x128 tiles with split-K, which this
          rule ran before (H100, cold L2, 2026-11-24, ten calls it picks, cuBLAS in the same
          run): 0.59 -> 0.70 of cuBLAS at 258x1320x2152, 0.65 -> 0.80 at 265x656x6672, 0.71 ->
          0.89 at 72x672x728, 0.73 -> 0.85 at nk 128x4096x4096, none lower.

        A variant this fusion cannot take (its staged outputs do not fit beside two stages) is
        left out. A batched matmul has none: its rules count one batch's tiles, and split-K
        takes 2-D matmuls only; nor has a schedule other than the plain default (a cluster,
        split-K or another tile asked for)."""
        from wsched.dispatch import ROW_ALIGN, Variant

        if (schedule.tile != (128, 256, 64) or schedule.split_k != 1 or schedule.stream_k or schedule.cluster != (1, 1, 1)
                or _batched(fusion)):
            return ()
        found = []
        better = lambda v, tile: saves_waves(v["M"], v["N"], v["num_sms"], tile, schedule.tile)  # noqa: E731

        def mid(v, tile):   # 128x192 saves 10% of the default's wave work and does no more than 128x128
            return better(v, tile) and (wave_work(v["M"], v["N"], v["num_sms"], tile)
                                        <= wave_work(v["M"], v["N"], v["num_sms"], NARROW_TILE))
        off = lambda v: v[ROW_ALIGN] < TMA_FAST_ROW_ALIGNMENT  # noqa: E731
        k_steps = lambda v, tile: -(-v["K"] // tile[2])  # noqa: E731
        fills_half = lambda v: 2 * output_tiles(v["M"], v["N"], schedule.tile) >= v["num_sms"]  # noqa: E731
        mid_rule = "128x192 tiles take 10% less wave work than 128x256 ones and no more than 128x128 ones"
        split = " (split-K: the host splits when the tiles fill at most half the SMs)"
        for fields, stages, applies, rule in (
                (dict(tile=(64, 64, 64), consumer_warpgroups=1), SMALL_TILE_STAGES,
                 lambda v, tile: (output_tiles(v["M"], v["N"], tile) <= v["num_sms"]
                                  and k_steps(v, tile) <= SMALL_TILE_MAX_K_STEPS),
                 f"64x64 tiles fit in one wave and K is at most {SMALL_TILE_MAX_K_STEPS} k steps: 64x64 tiles, "
                 "no split"),
                (dict(tile=(64, 64, 64), consumer_warpgroups=1, split_k=MAX_SPLIT_K), SMALL_TILE_STAGES,
                 lambda v, tile: (k_steps(v, tile) > SMALL_TILE_MAX_K_STEPS
                                  and output_tiles(v["M"], v["N"], tile) <= SMALL_TILE_SPLIT_MAX_FILL * v["num_sms"]),
                 f"K is more than {SMALL_TILE_MAX_K_STEPS} k steps and 64x64 tiles fill at most "
                 f"{SMALL_TILE_SPLIT_MAX_FILL:.0%} of the SMs" + split),
                (dict(tile=(64, 128, 64), consumer_warpgroups=1, split_k=MAX_SPLIT_K), SMALL_M_STAGES,
                 lambda v, tile: v["M"] <= 64, "M <= 64" + split),
                (dict(tile=schedule.tile, stream_k=True), None,
                 lambda v, tile: (not off(v) and k_steps(v, tile) >= STREAM_K_MIN_K_STEPS
                                  and v["num_sms"] < output_tiles(v["M"], v["N"], tile)
                                  <= STREAM_K_MAX_WAVES * v["num_sms"]),
                 f"rows on a {TMA_FAST_ROW_ALIGNMENT}-byte boundary, 128x256 tiles that take more than one wave and "
                 f"at most {STREAM_K_MAX_WAVES:g}, and K of at least {STREAM_K_MIN_K_STEPS} k steps: stream-K"),
                (dict(tile=MID_TILE), None, lambda v, tile: not off(v) and mid(v, tile), mid_rule),
                (dict(tile=MID_TILE, cluster=(2, 1, 1)), None,
                 lambda v, tile: off(v) and mid(v, tile) and cluster_waves_no_more(v["M"], v["N"], v["num_sms"],
                                                                                    tile, 2),
                 f"{mid_rule}, rows of an input off a {TMA_FAST_ROW_ALIGNMENT}-byte boundary and pairs along M "
                 "that take no more waves: 128x192 in clusters of 2 along M"),
                (dict(tile=NARROW_TILE, cluster=(2, 1, 1)), None,
                 lambda v, tile: (off(v) and better(v, tile) and fills_half(v)
                                  and output_tiles(v["M"], v["N"], tile) <= NARROW_CLUSTER_MAX_WAVES * v["num_sms"]
                                  and cluster_waves_no_more(v["M"], v["N"], v["num_sms"], tile, 2)),
                 f"rows of an input off a {TMA_FAST_ROW_ALIGNMENT}-byte boundary, 128x256 tiles that fill at least "
                 "half the SMs, 128x128 ones that take 10% less wave work in at most two waves and pairs along M that "
                 "take no more waves: 128x128 in clusters of 2 along M"),
                (dict(tile=schedule.tile, cluster=(2, 1, 1)), None,
                 lambda v, tile: (off(v) and fills_half(v)
                                  and cluster_waves_no_more(v["M"], v["N"], v["num_sms"], tile, 2)),
                 f"rows of an input off a {TMA_FAST_ROW_ALIGNMENT}-byte boundary, tiles that fill at least half "
                 "the SMs and pairs along M that take no more waves: clusters of 2 along M (B multicast)"),
                (dict(tile=NARROW_TILE, mode="pingpong"), PINGPONG_STAGES,
                 lambda v, tile: better(v, tile) and 2 * output_tiles(v["M"], v["N"], tile) > v["num_sms"],
                 "128x128 tiles take 10% less wave work than 128x256 ones and fill more than half the SMs: "
                 "ping-pong"),
                (dict(tile=(64, 128, 64), consumer_warpgroups=1, split_k=MAX_SPLIT_K), SMALL_M_STAGES,
                 lambda v, tile: better(v, NARROW_TILE),
                 "128x128 tiles take 10% less wave work than 128x256 ones" + split)):
            try:
                variant = self.default_schedule(fusion, **fields)
            except ScheduleError:
                continue
            if stages is not None:      # deeper than the default's 4 where the stages fit
                variant = replace(variant, stages=max(variant.stages, min(stages, max_stages(variant))))
            found.append(Variant(variant, lambda v, f=applies, t=fields["tile"]: f(v, t), rule))
        return tuple(found)

    def lighter(self, fusion, schedule: MatmulSchedule):
        """Where the compiler's choice spills: no wgmma kept in flight, then half and a quarter of
        the tile's width (down to 64 columns: a narrower accumulator and epilogue slices), each
        kept only where the workload takes it for the fusion."""
        return self._narrower(fusion, schedule, 64, consumer_warpgroups=schedule.consumer_warpgroups,
                              split_k=schedule.split_k, epilogue=schedule.epilogue, mode=schedule.mode)

    def schedule_space(self, fusion):
        splits = (1,) if _batched(fusion) else (1, MAX_SPLIT_K)
        return schedule.schedule_space(partition.staged_output_bytes(fusion), split_ks=splits)


def _batched(fusion) -> bool:
    """Whether the fusion's matmul has leading batch dims."""
    return any(n.op == "matmul" and len(n.shape) > 2 for n in fusion.nodes())


MATMUL = MatmulWorkload()
