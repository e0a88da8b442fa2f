"""The attention workload: O = softmax(scale * Q K^T [masked]) V as flash attention.

The producer loads Q once per tile and K, V per kv block through their own channels; the
consumer warpgroups run S = Q K^T, the score function and the online softmax in registers and
O += P V, then normalise and store O (and the log-sum-exp). It takes fusions of the form
matmul -> softmax -> matmul whose operands are inputs, with any elementwise score function and
masks between Q K^T and the softmax (score.py: what is analysed, score_ops.py: the tile ops).
Its own passes: overlap_softmax (mma_inflight=1), pingpong (mode="pingpong") and defer_row_loads.
"""

from __future__ import annotations

from dataclasses import replace

from wsched.errors import FusionError
from wsched.lowering.context import Step
from wsched.lowering.passes import dynamic_tiles
from wsched.schedule import ScheduleError, is_int
from wsched.workloads.base import Workload

from . import defer_row_loads, epilogue, loops, overlap_softmax, partition, pingpong, schedule
from . import schedule as schedule_mod
from .schedule import AttentionSchedule


class AttentionWorkload(Workload):
    name = "attention"
    schedule_type = AttentionSchedule
    split = staticmethod(partition.partition_attention)
    describe = staticmethod(partition.describe)
    build_loops = staticmethod(loops.build_loops)
    epilogue = staticmethod(epilogue.epilogue)
    extra_passes = (
        # Delay P V by one block so the softmax overlaps it: a reordering of the complete wgmma
        # protocol lower_mma wrote.
        Step("overlap_softmax", overlap_softmax.run, True, lambda s: s.mma_inflight == 1, "mma_inflight=1"),
        # Token passing around the GEMM issue that overlap_softmax grouped together.
        Step("pingpong", pingpong.run, True, lambda s: s.mode == "pingpong", 'mode="pingpong"'),
    )
    # Tiles of unequal work (a mask bounds the keys by the row; packed sequences) are dealt out
    # from a counter (build_loops declares it): the shared pass reads the workspace.
    late_passes = (
        # Per-row score inputs read only in the kv loop: loaded in its first block, after the
        # wgmmas are issued (after the epilogue, which may read such an input too).
        Step("defer_row_loads", defer_row_loads.run, True),
        Step("dynamic_tiles", dynamic_tiles.run, True, lambda s: not s.splits_kv, "split_kv=1"),
    )

    def check_values(self, part, tensors: dict) -> None:
        partition.check_cache_values(part, tensors)

    def matches(self, fusion) -> bool:
        return partition.is_attention(fusion)

    def mismatch(self, fusion) -> str:
        nodes = fusion.nodes()
        return (f"attention needs matmul -> softmax -> matmul (found {sum(n.op == 'matmul' for n in nodes)} "
                f"matmul(s), {sum(n.op == 'softmax' for n in nodes)} softmax(es))")

    def default_schedule(self, fusion, **overrides) -> AttentionSchedule:
        if "head_dim" in overrides:
            head_dim = overrides.pop("head_dim")
            if not is_int(head_dim) or head_dim not in schedule.HEAD_DIMS:
                raise ScheduleError(f"attention schedule for {fusion.name}: head_dim={head_dim!r} is not one of "
                                    f"{', '.join(map(str, schedule.HEAD_DIMS))}")
        else:
            head_dim = self._head_dim(fusion)
        chosen = schedule.default_schedule(head_dim, partition.page_size_of(fusion), **overrides)
        if ("mode" not in overrides and head_dim in schedule.PINGPONG_BIAS_HEAD_DIMS and chosen.mode == "cooperative"
                and chosen.consumer_warpgroups == 2 and chosen.mma_inflight == 1 and not chosen.splits_kv
                and self._diagonal_bias(fusion, chosen)):
            chosen = replace(chosen, mode="pingpong")   # schedule.PINGPONG_BIAS_HEAD_DIMS says why
        return chosen

    def _three_warpgroups(self, fusion, chosen) -> tuple[str, str] | None:
        """How the fusion may take 192-row tiles on three consumer warpgroups
        (`schedule.THREE_WARPGROUP_HEAD_DIMS`), with the kernel's name for the keys (T, or a
        cache's T_cache): "no diagonal" where the score function cuts none, "causal" where its
        masks bound the keys from above only (`ScoreFunction.causal_only`); None where it may
        not: packed sequences (their tiles end where a sequence does), a paged cache (its
        producer's registers), windows, unions, ALiBi, masks not analysed."""
        if chosen.head_dim not in schedule_mod.THREE_WARPGROUP_HEAD_DIMS or partition.page_size_of(fusion):
            return None
        payload = self.partition(fusion, chosen).payload
        if payload.varlen is not None:
            return None
        if not payload.score.cuts_diagonals:
            return "no diagonal", payload.keys
        return ("causal", payload.keys) if payload.score.causal_only else None

    def _diagonal_bias(self, fusion, chosen) -> bool:
        """Whether the fusion's score function adds a diagonal bias (ALiBi); False where the
        fusion does not partition (its error comes with the compile)."""
        try:
            return bool(self.partition(fusion, chosen).payload.score.bias)
        except (FusionError, ScheduleError):
            return False

    def lighter(self, fusion, schedule: AttentionSchedule):
        """Where the compiler's choice spills (ptxas's margin is thin at head dim 256, and a paged
        producer or a score function moves it): the softmax not overlapped with P V (one score
        tile fewer in flight), then half and a quarter of the keys per block (down to 32), each
        kept only where the workload takes it for the fusion; last, where the keys are split, the
        same tiles unsplit (a 64x32x256 split decode with a top-left causal mask spilled 12 bytes,
        unsplit it built: measured with the fragment merge, before the merge moved to linear tiles,
        and not since)."""
        keep = dict(consumer_warpgroups=schedule.consumer_warpgroups, pack_gqa=schedule.pack_gqa, mode=schedule.mode)
        lighter = self._narrower(fusion, schedule, 32, split_kv=schedule.split_kv, **keep)
        if schedule.splits_kv:
            unsplit = (self.taken(fusion, tile=s.tile, mma_inflight=s.mma_inflight, split_kv=1, **keep)
                       for s in (schedule, *lighter))
            lighter += tuple(dict.fromkeys(s for s in unsplit if s is not None))
        return lighter

    def variants(self, fusion, schedule: AttentionSchedule):
        """The default's 128-row tiles suit prefill; where a call has few query rows or few tiles
        it switches (docs/architecture.md, "Split-KV decode"), and at head dim 64 with long keys
        to more rows:

        - S <= 64 (decode, speculative or chunked steps): 64-row tiles (one consumer warpgroup)
          with the G query heads of a KV head packed into the rows where the fusion allows
          (`pack_gqa`), and split-KV: the host splits the keys when the tiles fill at most half
          the SMs;
        - otherwise, when the default's 128-row tiles fill at most half the SMs (short
          sequences, few heads, long keys): 64-row tiles on one consumer warpgroup (twice the
          tiles), not packed, with split-KV where the keys are long; at value dim 256 the
          default's tiles with split-KV (unpacked 64 x 32 tiles spilled beside a paged producer,
          split or not; nvcc 2026-11-24). Measured on an H100 against the default with
          split-KV (2026-11-24, 35 calls at head dim 128, S 200-1024 and chunks of 128-512
          queries against 4K-32K keys): at or above it in every call, 1.18-1.48x at S <= 1024
          (B1 H16/4 S512: 0.69 -> 1.02 of cuDNN), 1.02-1.80x on long keys;
        - otherwise, at head dim 64, where no mask or bias cuts a diagonal or the masks are causal
          only, with at least 1024 or 5120 keys (`schedule.THREE_WARPGROUP_MIN_KEYS`), and where
          192-row tiles take at most 11/15 of the waves of 128-row ones (a tile of them is 1.5x
          the work, and ran 1.1x as fast per row with long keys; without a diagonal also at any
          length where they take at most 2/3): 192-row tiles on three consumer warpgroups
          (`schedule.THREE_WARPGROUP_HEAD_DIMS` gives the measurements).

        A fusion the split-KV variants cannot take (an attention sink) has neither of those."""
        from wsched.dispatch import Variant

        if schedule != self.default_schedule(fusion):
            return ()
        found = []
        # split-KV beside a 256-wide O: overlap no softmax there (SPLIT_KV_SPILLS),
        # and one consumer warpgroup takes 32 keys a block (64 spilled 8 bytes, packed or not)
        inflights = (schedule.mma_inflight, 0)
        wide = schedule.value_dim == schedule_mod.THIN_MARGIN_VALUE_DIM
        decode = _first_taken(self, fusion, [
            dict(tile=(64, 32 if wide else schedule.bn, schedule.head_dim), consumer_warpgroups=1,
                 split_kv=schedule_mod.MAX_SPLIT_KV, pack_gqa=pack, mma_inflight=0 if wide else inflight)
            for pack in (True, False) for inflight in inflights])
        if decode is not None:
            found.append(Variant(decode, lambda v: v["S"] <= 64,
                                 "S <= 64" + (" (G query heads of a KV head packed into the rows)" if decode.pack_gqa
                                              else "") + "; the host splits the keys when the tiles fill at most "
                                                         "half the SMs"))
        few = _first_taken(self, fusion, [   # value dim 256: 128-row tiles (64-row ones spilled paged)
            dict(split_kv=schedule_mod.MAX_SPLIT_KV, mma_inflight=inflight) if wide else
            dict(tile=(64, schedule.bn, schedule.head_dim), consumer_warpgroups=1, split_kv=schedule_mod.MAX_SPLIT_KV,
                 mma_inflight=inflight)
            for inflight in inflights])
        if few is not None:
            bm = schedule.bm
            found.append(Variant(few, lambda v: 2 * _tiles(v, bm) <= v["num_sms"],
                                 f"the {bm}-row tiles fill at most half the SMs"
                                 + ("" if wide else ": 64-row tiles") + " (split-KV)"))
        kind, t = self._three_warpgroups(fusion, schedule) or (None, None)
        three = kind and self.taken(fusion, tile=(192, schedule.bn, schedule.head_dim), consumer_warpgroups=3)
        if three:
            keys, bm, any_length = schedule_mod.THREE_WARPGROUP_MIN_KEYS[kind], schedule.bm, kind == "no diagonal"

            def applies(v):
                fewer, more = _waves(v, 192), _waves(v, bm)
                return ((v[t] >= keys and 15 * fewer <= 11 * more)   # 1.5x the work a tile, 1.1x as fast
                        or (any_length and 3 * fewer <= 2 * more))
            masks = "no mask or bias cuts a diagonal" if any_length else "causal masks only"
            found.append(Variant(three, applies, f"{masks}, {t} >= {keys} and 192-row tiles take at most 11/15 of the "
                                 f"waves of {bm}-row ones{' (or 2/3 at any length)' if any_length else ''}: 192-row "
                                 f"tiles on three consumer warpgroups"))
        return tuple(found)

    def schedule_space(self, fusion):
        """Every schedule the workload implements for `fusion`, for a search (the autotuner, the
        GPU fuzzer): the prefill side (`schedule.schedule_space`: 128-row tiles, keys per block,
        stages, the softmax overlapped or not, ping-pong) fitted to the fusion (a paged cache's
        producer registers), then the decode side (64-row tiles on one consumer warpgroup,
        split-KV, GQA packing; 128-row tiles with split-KV) and the per-call variants themselves,
        each kept only where the workload takes it for the fusion. At value dim 256
        (`THIN_MARGIN_VALUE_DIM`) the decode side is the variants alone: other one-warpgroup
        schedules spill there."""
        # the partition of the default schedule checks the fusion and analyses its score function
        default = self.default_schedule(fusion)
        score_function = self.partition(fusion, default).payload.score
        kinds = tuple(kind for kind, _ in score_function.register_costs(fusion))
        head_dim = self._head_dim(fusion)
        found = [self.taken(fusion, tile=s.tile, stages=s.stages, mma_inflight=s.mma_inflight, mode=s.mode,
                            consumer_warpgroups=s.consumer_warpgroups)
                 for s in schedule.schedule_space(head_dim, kinds)]
        split = schedule_mod.MAX_SPLIT_KV
        if default.value_dim != schedule_mod.THIN_MARGIN_VALUE_DIM:
            found += [self.taken(fusion, tile=(64, keys, head_dim), consumer_warpgroups=1, mma_inflight=inflight,
                                 pack_gqa=pack, split_kv=splits)
                      for keys in (32, 64, 128) for inflight in (1, 0) for pack in (False, True)
                      for splits in (1, split)]
            found += [self.taken(fusion, tile=(128, keys, head_dim), mma_inflight=inflight, split_kv=split)
                      for keys in (64, 128) for inflight in (1, 0)]
        found += [v.schedule for v in self.variants(fusion, default)]
        return iter(dict.fromkeys(s for s in found if s is not None))

    @staticmethod
    def _head_dim(fusion) -> int:
        head_dim = partition.head_dim_of(fusion)
        if not is_int(head_dim):
            raise ScheduleError(f"attention schedule for {fusion.name}: the head dim of Q is the symbol "
                                f"{head_dim!r}; declare it as a number ({', '.join(map(str, schedule.HEAD_DIMS))})")
        return head_dim


def _first_taken(workload, fusion, candidates: list[dict]):
    """The first default schedule with these overrides that the fusion takes (None if none)."""
    return next((s for s in (workload.taken(fusion, **overrides) for overrides in candidates) if s is not None), None)


def _waves(values, bm: int) -> int:
    """Waves of `bm`-row tiles on the call's SMs."""
    return -(-_tiles(values, bm) // values["num_sms"])


def _tiles(values, bm: int) -> int:
    """The default kernel's tiles for a call: (batch, head) slices x query blocks."""
    heads = 1
    for name, value in values.items():
        if name.startswith("batch"):
            heads *= value
    return heads * -(-values["S"] // bm)


ATTENTION = AttentionWorkload()
