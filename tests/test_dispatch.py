"""ws.compile(fusion) without a schedule picks, per call, among the workload's default schedule
and its shape variants (matmul: split-K where the output tiles cannot fill the SMs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import wsched as ws
from wsched.api import NoGPUError
from wsched.dispatch import ShapeDispatchKernel
from wsched.workloads.matmul.schedule import MAX_SPLIT_K

from attention_fusions import make_attention
from fusions import gated, inputs_for, matmul


@pytest.fixture(scope="module")
def k():
    return ws.compile(matmul, build=False)


def test_default_matmul_has_narrow_split_k_variants(k):
    assert isinstance(k, ShapeDispatchKernel)
    short, short_split, small, stream, mid, mid_clustered, narrow_clustered, clustered, pingpong, narrow = k.variants
    assert short.schedule == ws.schedule_for(matmul, tile=(64, 64, 64), consumer_warpgroups=1, stages=12)
    assert short_split.schedule == ws.schedule_for(matmul, tile=(64, 64, 64), consumer_warpgroups=1,
                                                   split_k=MAX_SPLIT_K, stages=12)
    assert small.schedule == ws.schedule_for(matmul, tile=(64, 128, 64), consumer_warpgroups=1, split_k=MAX_SPLIT_K,
                                             stages=8)     # the weights streamed with more bytes in flight
    assert stream.schedule == ws.schedule_for(matmul, stream_k=True)
    assert mid.schedule == ws.schedule_for(matmul, tile=(128, 192, 64))
    assert mid_clustered.schedule == ws.schedule_for(matmul, tile=(128, 192, 64), cluster=(2, 1, 1))
    assert narrow_clustered.schedule == ws.schedule_for(matmul, tile=(128, 128, 64), cluster=(2, 1, 1))
    assert clustered.schedule == ws.schedule_for(matmul, cluster=(2, 1, 1))
    assert pingpong.schedule == ws.schedule_for(matmul, tile=(128, 128, 64), mode="pingpong", stages=5)
    assert narrow.schedule == small.schedule    # few 128x128 tiles: the M <= 64 variant's kernel
    assert k.describe() == (
        "matmul: 128x256x64 stages=4 consumers=2 regs=24/240 epilogue=tma_store (default)\n"
        f"  {short.schedule.short()} when 64x64 tiles fit in one wave and K is at most 64 k steps: 64x64 tiles, no "
        "split\n"
        f"  {short_split.schedule.short()} when K is more than 64 k steps and 64x64 tiles fill at most 25% of the "
        "SMs (split-K: the host splits when the tiles fill at most half the SMs)\n"
        f"  {small.schedule.short()} when M <= 64 (split-K: the host splits when the tiles fill at most half the SMs)\n"
        f"  {stream.schedule.short()} when rows on a 64-byte boundary, 128x256 tiles that take more than one wave and "
        "at most 1.15, and K of at least 64 k steps: stream-K\n"
        f"  {mid.schedule.short()} when 128x192 tiles take 10% less wave work than 128x256 ones and no more than "
        "128x128 ones\n"
        f"  {mid_clustered.schedule.short()} when 128x192 tiles take 10% less wave work than 128x256 ones and no more "
        "than 128x128 ones, rows of an input off a 64-byte boundary and pairs along M that take no more waves: "
        "128x192 in clusters of 2 along M\n"
        f"  {narrow_clustered.schedule.short()} when rows of an input off a 64-byte boundary, 128x256 tiles that "
        "fill at least half the SMs, 128x128 ones that take 10% less wave work in at most two waves and pairs along "
        "M that take no more waves: 128x128 in clusters of 2 along M\n"
        f"  {clustered.schedule.short()} when rows of an input off a 64-byte boundary, tiles that fill at least half "
        "the SMs and pairs along M that take no more waves: clusters of 2 along M (B multicast)\n"
        f"  {pingpong.schedule.short()} when 128x128 tiles take 10% less wave work than 128x256 ones and fill more "
        "than half the SMs: ping-pong\n"
        f"  {narrow.schedule.short()} when 128x128 tiles take 10% less wave work than 128x256 ones (split-K: the "
        "host splits when the tiles fill at most half the SMs)")
    # what a CompiledKernel has is the default schedule's
    assert k.schedule == ws.schedule_for(matmul) and k.ir == k.primary.ir and k.cuda_source == k.primary.cuda_source


def test_a_schedule_or_overrides_give_one_kernel():
    assert not isinstance(ws.compile(matmul, ws.schedule_for(matmul), build=False), ShapeDispatchKernel)
    assert not isinstance(ws.compile(matmul, stages=2, build=False), ShapeDispatchKernel)
    assert not isinstance(ws.compile(make_attention(64), ws.schedule_for(make_attention(64)), build=False),
                          ShapeDispatchKernel)
    assert not isinstance(ws.compile(make_attention(64), stages=2, build=False), ShapeDispatchKernel)


def _shape(m, n, kk):
    return torch.empty(m, kk, dtype=torch.bfloat16), torch.empty(kk, n, dtype=torch.bfloat16)


@pytest.mark.parametrize("m, n, kk, sms, tile, mode", [
    (1, 4096, 4096, 132, (64, 64), "cooperative"),      # 64 tiles of 64 x 64, 64 k steps: no split
    (1, 4096, 8192, 132, (64, 128), "cooperative"),     # 128 k steps: M <= 64, split-K
    (512, 1024, 1024, 132, (64, 64), "cooperative"),    # 128 tiles of 64 x 64: one wave
    (512, 2048, 1024, 132, (64, 128), "cooperative"),   # 256: two waves; few 128 x 128 tiles, split-K
    (64, 57344, 8192, 132, (64, 128), "cooperative"),
    (16, 1024, 8192, 132, (64, 64), "cooperative"),     # 16 tiles of 64 x 64, 128 k steps: 64x64 split-K
    (203, 512, 11416, 132, (64, 64), "cooperative"),    # 32 tiles: at most a quarter of 132
    (93, 1216, 11416, 132, (64, 128), "cooperative"),   # 38 tiles: more than a quarter; 64x128 split-K
    (65, 4096, 4096, 132, (64, 64), "cooperative"),    # 128 tiles of 64 x 64 in one wave, 64 k steps
    (65, 4096, 8192, 132, (64, 128), "cooperative"),   # 16 wide tiles, 32 narrow: both < 1 wave, narrow fuller
    (128, 28672, 4096, 132, (128, 256), "cooperative"),   # 112 / 132 vs 224 / 264: equal, the default
    (512, 4096, 4096, 132, (128, 128), "pingpong"),    # 64 vs 128 of 132: more than half the SMs
    (512, 6144, 4096, 132, (128, 192), "cooperative"),    # 96 / 132 vs 128 / 132 (192 / 264 of 128 x 128)
    (512, 10240, 8192, 132, (128, 192), "cooperative"),   # 160 / 264 vs 216 / 264 vs 320 / 396: 0.75 each
    (512, 8192, 8192, 132, (128, 256), "cooperative"),    # 128 / 132 vs 256 / 264
    (4096, 4096, 4096, 132, (128, 256), "cooperative"),
    (8192, 8192, 8192, 132, (128, 256), "cooperative"),
    (300, 520, 40, 132, (64, 64), "cooperative"),      # 45 tiles of 64 x 64, one k step
    (300, 520, 8200, 132, (64, 128), "cooperative"),   # 129 k steps: 3 x 3 vs 3 x 5 tiles, 15 of 132, split-K
    (16, 1024, 4096, 4, (64, 128), "cooperative"),
    (1000, 1024, 4096, 4, (128, 256), "cooperative"),     # 32 / 32 vs 64 / 64
    (8192, 28672, 4096, 132, (128, 256), "cooperative"),  # 55 waves of wide tiles, 109 of narrow: 1% less
    (2048, 57344, 8192, 132, (128, 256), "cooperative"),  # 28 waves vs 55: 2% less
    (2304, 2048, 2048, 132, (128, 192), "cooperative"),   # 144 tiles: 2 waves; 198 of 128 x 192: 2 waves
    # (from K 4096, 64 k steps, such a call runs stream-K: test_stream_k_takes_...)
    (1500, 4224, 4096, 132, (128, 192), "cooperative"),   # 204 tiles: 2 waves; 264: 2 waves; 396: 3 waves
    (1500, 1024, 4096, 132, (128, 128), "pingpong"),      # 96 tiles of 128 x 128 in a wave: less work than 72 of 192
    (2304, 3072, 4096, 132, (128, 256), "cooperative"),   # 216 tiles: 2 waves; 288: 3 waves of 128 x 192
])
def test_the_rule(k, m, n, kk, sms, tile, mode):
    chosen = k.choose(_shape(m, n, kk), sms)
    assert (chosen.schedule.tile[:2], chosen.schedule.mode) == (tile, mode)
    assert (chosen is k.primary) == (tile == (128, 256))


@pytest.mark.parametrize("m, n, kk, sms, stream", [
    (2304, 2048, 4096, 132, True),      # 144 tiles: 1.09 waves, 64 k steps
    (2432, 1792, 10240, 132, True),     # 133 tiles
    (3077, 1536, 4096, 132, True),      # 150 tiles: 1.14 waves
    (2304, 2048, 4032, 132, False),     # 63 k steps: 128x192 tiles
    (1152, 4352, 4096, 132, False),     # 153 tiles: 1.16 waves
    (4224, 1024, 10240, 132, False),    # 132 tiles: one wave, the default
    (2048, 2048, 12288, 132, False),    # 128 tiles: less than a wave, the default
    (300, 768, 4096, 8, True),          # 9 tiles on 8 SMs: 1.125 waves
    (300, 768, 4096, 4, False),         # on 4 SMs: 2.25 waves
])
def test_stream_k_takes_a_little_more_than_one_wave_of_long_k(k, m, n, kk, sms, stream):
    chosen = k.choose(_shape(m, n, kk), sms).schedule
    assert chosen.stream_k is stream
    if stream:
        assert chosen.tile == (128, 256, 64)


def _padded(m, n, kk, pad):
    """A [m, kk] and B [kk, n] as views of wider buffers: rows `pad` elements longer."""
    return (torch.empty(m, kk + pad, dtype=torch.bfloat16)[:, :kk],
            torch.empty(kk, n + pad, dtype=torch.bfloat16)[:, :n])


@pytest.mark.parametrize("m, n, kk, pad, schedule", [
    (4096, 4096, 4096, 8, "cluster"),       # rows 16 bytes off a 64-byte boundary, 4 waves either way
    (4096, 4096, 4096, 16, "cluster"),      # 32 bytes off
    (4096, 4096, 4096, 32, "default"),      # 64-byte aligned rows: the default
    (2289, 4200, 3920, 0, "mid_cluster"),   # contiguous, rows of 7840 / 8400 bytes; 306 tiles, 396 of 128 x 192
    (2304, 4224, 3968, 0, "mid"),           # the same shape with aligned rows: 128 x 192 unclustered
    (4774, 2040, 3920, 0, "cluster"),       # 304 tiles and 418 of 128 x 192: 3 and 4 waves
    (4774, 384, 1160, 0, "narrow_cluster"),  # 76 tiles of 128 x 256 (a wave of 32768) vs 114 of 128 x 128 (16384)
    (2466, 3688, 6248, 0, "cluster"),       # 128 x 128 saves wave work, but in 5 waves: the 128 x 256 clusters
    (1500, 1000, 1160, 0, "pingpong"),      # 48 tiles of 128 x 256 fill less than half the SMs: ping-pong stays
    (777, 9000, 3000, 0, "default"),        # 7 rows of tiles: pairs take 3 waves, single CTAs 2
    (258, 1320, 2152, 0, "short"),          # 105 tiles of 64 x 64, 34 k steps: no split
    (258, 1320, 8200, 0, "split"),          # 129 k steps; 18 tiles: fewer than half the SMs
    (40, 4200, 8200, 0, "small"),           # M <= 64 first
])
def test_rows_off_a_64_byte_boundary_run_in_clusters_along_m(k, m, n, kk, pad, schedule):
    """TMA loads rows that start off a 64-byte boundary slower; clusters of 2 CTAs along M halve
    each CTA's B loads (H100: 4096^3 with rows 16 bytes off, 0.59 -> 0.98 of cuBLAS)."""
    chosen = k.choose(_padded(m, n, kk, pad), 132).schedule
    assert {"cluster": chosen.cluster == (2, 1, 1) and chosen.tile == (128, 256, 64),
            "mid_cluster": chosen.cluster == (2, 1, 1) and chosen.tile == (128, 192, 64),
            "mid": chosen.cluster == (1, 1, 1) and chosen.tile == (128, 192, 64),
            "narrow_cluster": (chosen.cluster, chosen.tile, chosen.mode) == ((2, 1, 1), (128, 128, 64), "cooperative"),
            "default": chosen == k.primary.schedule,
            "pingpong": chosen.mode == "pingpong",
            "split": chosen.split_k > 1 and chosen.tile == (64, 128, 64),
            "short": chosen.split_k == 1 and chosen.tile == (64, 64, 64),
            "small": chosen.tile == (64, 128, 64)}[schedule], chosen.short()


def test_the_choice_is_made_per_layout_not_only_per_shape(k):
    """The same shapes with other strides are another choice (kernel_for keys on both)."""
    aligned = k.choose(_padded(4096, 4096, 4096, 0), 132)
    padded = k.choose(_padded(4096, 4096, 4096, 8), 132)
    assert aligned is k.primary and padded is not aligned
    assert k._key(_padded(64, 64, 64, 0)) != k._key(_padded(64, 64, 64, 8))


def test_variants_are_built_once(k):
    first = k.choose(_shape(1, 512, 4096), 132)
    assert k.choose(_shape(2, 512, 4096), 132) is first and first in k.kernels


def test_a_variant_that_does_not_build_is_dropped_with_a_warning(monkeypatch):
    import wsched.kernel

    k = ws.compile(matmul, build=False)
    real = wsched.kernel.build_kernel

    attempts = []

    def failing(fusion, schedule=None, **kw):
        if schedule is not None and schedule.tile[0] == 64:
            attempts.append(schedule)
            raise RuntimeError("ptxas: 8 bytes spill stores")
        return real(fusion, schedule, **kw)

    monkeypatch.setattr(wsched.kernel, "build_kernel", failing)
    with pytest.warns(UserWarning, match=r"the 64x128x64 .* kernel for M <= 64 .* did not build and is not used "
                                         r"\(RuntimeError: ptxas: 8 bytes spill stores\)"):
        chosen = k.choose(_shape(1, 4096, 8192), 132)
    # the few-tiles rule runs the same schedule: dropped with it, so the default serves the call
    assert chosen is k.primary
    assert k.choose(_shape(1, 4096, 8192), 132) is chosen and list(k.dropped) == [2, 9]
    # a thread that passed the check before the variant was dropped gets its error, not a new build
    with pytest.raises(RuntimeError, match="ptxas: 8 bytes spill stores"):
        k._variant_kernel(2)
    assert len(attempts) == 1


@pytest.mark.parametrize("fusion, m, n, kk", [(matmul, 33, 296, 520), (gated, 1, 384, 640), (gated, 100, 384, 640)])
def test_simulate_runs_the_chosen_kernel(fusion, m, n, kk):
    k = ws.compile(fusion, build=False)
    inputs = inputs_for(fusion, m, n, kk, seed=m)
    assert k.choose(inputs, 4) is not k.primary
    out = k.simulate(*inputs, num_sms=4)
    ref = fusion.reference(*inputs)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("m, n, kk", [(16, 257, 96), (300, 1001, 64), (300, 1000, 64)])
def test_outputs_of_unaligned_rows_are_stored_directly(m, n, kk):
    """An output whose rows are no multiple of 16 bytes (N = 257, 1001: a vocabulary of 50257)
    would be staged through a copy under a TMA store: the chosen schedule with plain stores runs
    instead (built once), and the simulator runs that kernel too."""
    k = ws.compile(matmul, build=False)
    inputs = inputs_for(matmul, m, n, kk, seed=n)
    chosen = k.choose(inputs, 132)
    kernel = k._unstaged(chosen, inputs)
    if n % 8 == 0:
        assert kernel is chosen and chosen.schedule.epilogue == "tma_store"
    else:
        assert kernel.schedule == dataclasses.replace(chosen.schedule, epilogue="direct")
        assert k._unstaged(chosen, inputs) is kernel
        assert "global out:" in kernel.ir
    out = k.simulate(*inputs, num_sms=4)
    assert float((out.float() - matmul.reference(*inputs)).norm() / out.float().norm()) < 1e-2


def test_a_large_output_of_unaligned_rows_keeps_the_tma_store():
    """Beyond DIRECT_STORE_MAX_BYTES the staged copy costs less than storing an element at a time."""
    k = ws.compile(matmul, build=False)
    a = torch.empty(8192, 768, dtype=torch.bfloat16, device="meta")
    b = torch.empty(768, 50257, dtype=torch.bfloat16, device="meta")   # 823 MB of output
    chosen = k.choose((a, b), 132)
    assert k._unstaged(chosen, (a, b)) is chosen and chosen.schedule.epilogue == "tma_store"


def test_cpu_tensors_raise_the_no_gpu_error(k):
    a, b = inputs_for(matmul, 16, 256, 64)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(NoGPUError, match="no CUDA device is available here"):
        k(a, b)


def test_the_choice_is_one_torch_op_that_chooses_when_it_runs(k):
    """Traced (torch.compile, export), a call records the dispatcher's own op, not one of its
    kernels': the choice is made when the graph runs, and tracing builds nothing."""
    assert k.op is not k.primary.op and k.op.name().startswith("wsched::matmul_")
    a, b = inputs_for(matmul, 40, 256, 192)

    class Layer(torch.nn.Module):
        def forward(self, x, w):
            return k(x, w)

    exported = torch.export.export(Layer(), (a, b))
    assert [n.target for n in exported.graph.nodes if n.op == "call_function"] == [k.op]
    ref = matmul.reference(a, b)
    assert float((exported.module()(a, b).float() - ref).norm() / ref.norm()) < 1e-2


def test_the_cluster_variant_for_unaligned_rows_matches_torch(k):
    """A 300 x 520 x 200 call whose A and B rows are 8 elements longer than their data (16 bytes
    off a 64-byte boundary): on 4 SMs the pairs take no more waves, so the clustered kernel runs;
    the simulator's result, outputs NaN-poisoned first, against torch."""
    a_full, b_full = inputs_for(matmul, 300, 528, 208, seed=7)
    a, b = a_full[:, :200], b_full[:200, :520]
    assert k.choose((a, b), 4).schedule.cluster == (2, 1, 1)
    out = k.simulate(a, b, num_sms=4)
    assert not torch.isnan(out.float()).any()
    ref = matmul.reference(a, b).float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_a_gpu_of_one_sm_runs_no_cluster():
    """A cluster of 2 CTAs needs 2 SMs at once: on one SM (the simulator's num_sms=1) the rules
    for rows off a 64-byte boundary choose no clustered kernel, and the result matches torch (the
    cluster rules once divided by num_sms // 2 = 0 there)."""
    k = ws.compile(matmul, build=False)
    a_full, b_full = inputs_for(matmul, 300, 528, 208, seed=7)
    a, b = a_full[:, :200], b_full[:200, :520]
    assert k.choose((a, b), 1).schedule.cluster == (1, 1, 1)
    out = k.simulate(a, b, num_sms=1)
    ref = matmul.reference(a, b).float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
