"""The persistent warp-specialized matmul on the GPU, against the torch reference.

Outputs are poisoned with NaN before every run, inputs are fresh random normals, shapes include
ones that do not divide the tile, K < BK, and fewer / more tiles than SMs.
"""

import warnings

import pytest
import torch

import wsched as ws
from wsched.codegen.launch import tma_ready

from fusions import gated, inputs_for, linear_relu_residual, matmul, matmul_f16, mlp, scaled_silu_f32

pytestmark = pytest.mark.gpu

SHAPES = [
    (512, 512, 512),      # 2 x 2 tiles: fewer tiles than SMs
    (4096, 4096, 1024),   # 32 x 16 = 512 tiles: more tiles than SMs
    (999, 1000, 1000),    # nothing divides the tile
    (8, 4096, 4096),      # skinny M
    (4096, 8, 2048),      # skinny N
    (300, 520, 40),       # K smaller than one k tile
]

_compiled: dict = {}


def compiled(fusion, **overrides):
    key = (fusion.name, tuple(sorted(overrides.items())))
    if key not in _compiled:
        _compiled[key] = ws.compile(fusion, **overrides)
    return _compiled[key]


def run_and_check(k, fusion, M, N, K, seed, tol=1e-2):
    inputs = inputs_for(fusion, M, N, K, device="cuda", seed=seed)
    names = [n for n in ws.partition(fusion, k.schedule).outputs]
    out = {"out": torch.full((M, N), float("nan"), device="cuda",
                             dtype=names[0].dtype.torch_dtype)}
    k(*inputs, out=out)
    k.synchronize()
    got = out["out"].float()
    ref = fusion.reference(*[t.cpu() for t in inputs]).float().cuda()
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} outputs never written"
    err = float((got - ref).norm() / ref.norm())
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matmul_bf16(M, N, K):
    run_and_check(compiled(matmul), matmul, M, N, K, seed=M + N + K)


@pytest.mark.parametrize("M,N,K", [(512, 512, 512), (999, 1000, 1000)])
def test_matmul_f16(M, N, K):
    run_and_check(compiled(matmul_f16), matmul_f16, M, N, K, seed=1)


@pytest.mark.parametrize("fusion", [mlp, linear_relu_residual, scaled_silu_f32], ids=lambda f: f.name)
@pytest.mark.parametrize("M,N,K", [(512, 768, 512), (1000, 1000, 1000)])
def test_fused_epilogues(fusion, M, N, K):
    run_and_check(compiled(fusion), fusion, M, N, K, seed=7)


@pytest.mark.parametrize("stages,epilogue", [(1, "tma_store"), (2, "tma_store"), (4, "direct")])
@pytest.mark.parametrize("M,N,K", [(999, 1000, 1000), (2048, 2048, 512)])
def test_stage_counts(stages, epilogue, M, N, K):
    run_and_check(compiled(mlp, stages=stages, epilogue=epilogue), mlp, M, N, K, seed=stages)


def test_k_major_weight_direct_epilogue():
    k = compiled(linear_relu_residual, epilogue="direct")
    run_and_check(k, linear_relu_residual, 999, 1000, 1000, seed=3)


def test_odd_n_direct_epilogue_stores_element_by_element():
    # N = 1001: rows of `res` and `out` are not pair-aligned, so the direct loads and stores
    # take the element-by-element path (w is [N, K] with K contiguous, so TMA still applies).
    k = compiled(linear_relu_residual, epilogue="direct")
    run_and_check(k, linear_relu_residual, 300, 1001, 256, seed=4)


def test_wrong_device_and_dtype_are_named():
    k = compiled(matmul)
    a, b = inputs_for(matmul, 128, 128, 128, device="cuda")
    with pytest.raises(ValueError, match="argument 'a' is on cpu"):
        k(a.cpu(), b)
    with pytest.raises(ws.FusionError, match=r"a is declared bf16\[M, K\] but got a torch.float32 tensor"):
        k(a.float(), b)


@pytest.mark.parametrize("M,N,K", [(300, 1001, 100), (8, 50257, 768), (1000, 257, 36)])
@pytest.mark.parametrize("fusion", [matmul, mlp], ids=lambda f: f.name)
def test_rows_tma_cannot_read(fusion, M, N, K):
    """K and N whose rows are no multiple of 16 bytes (GPT-2's vocabulary of 50257 columns): the
    per-shape choice stores such outputs directly (epilogue="direct") and stages the inputs
    (warned); a contiguous output returned, a given one filled; repeated calls stay right."""
    k = ws.compile(fusion)
    inputs = inputs_for(fusion, M, N, K, device="cuda", seed=M)
    ref = fusion.reference(*inputs).float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = k(*inputs)
    staged_inputs = any(not tma_ready(t) for t in inputs)   # K's rows, or b's [K, N] ones
    assert any("TMA-aligned buffer" in str(w.message) for w in caught) == staged_inputs
    assert k.kernel_for(*inputs).schedule.epilogue == "direct"   # outputs of at most 64 MB
    assert out.shape == (M, N) and out.is_contiguous()
    for _ in range(3):
        given = {"out": torch.full((M, N), float("nan"), device="cuda", dtype=out.dtype)}
        assert k(*inputs, out=given) is given["out"]
        assert float((given["out"].float() - ref).norm() / ref.norm()) < 1e-2
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("M,N,K", [(300, 1001, 104), (8, 50257, 768)])
def test_a_tma_stored_output_of_unaligned_rows_is_staged(M, N, K):
    """A kernel of one schedule (a TMA-store epilogue) computes such an output into an aligned
    buffer and copies it into the output, warned once."""
    k = ws.compile(matmul, ws.schedule_for(matmul))
    a, b = inputs_for(matmul, M, N, K, device="cuda", seed=N)
    with pytest.warns(UserWarning, match=rf"'out' \({M}, {N}\): a stride of {2 * N} bytes in dim 0"):
        out = k(a, b)
    ref = matmul.reference(a, b).float()
    assert out.is_contiguous() and float((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_shifted_and_transposed_views_are_staged():
    k = compiled(matmul)
    a, b = inputs_for(matmul, 256, 384, 136, device="cuda", seed=2)
    wide = torch.zeros(256, 144, device="cuda", dtype=a.dtype)
    wide[:, 1:137] = a
    b_t = b.t().contiguous().t()                       # innermost stride K
    with pytest.warns(UserWarning, match=r"'a' \(256, 136\): base 2 bytes past a 16-byte boundary; 'b' \(136, 384\): "
                                         r"innermost stride 136"):
        out = k(wide[:, 1:137], b_t)
    ref = matmul.reference(a, b).float()
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


# --- sliced epilogues and split-K ----------------------------------------------------------------

PINGPONG_SHAPES = [
    (64, 256, 64),        # one tile: warpgroup 1 of its CTA has none
    (999, 1000, 1000),    # nothing divides the tile; CTAs with odd and even tile counts
    (4096, 4096, 4096),   # 1024 tiles: every stage reused many times, both warpgroups busy
    (8, 4096, 4096),      # skinny M
    (300, 520, 40),       # K smaller than one k tile
]


@pytest.mark.parametrize("M,N,K", PINGPONG_SHAPES)
@pytest.mark.parametrize("fusion,overrides", [(matmul, {}), (matmul, dict(tile=(64, 256, 64))),
                                              (matmul, dict(mma_inflight=0)), (gated, {}),
                                              (linear_relu_residual, dict(epilogue="direct"))],
                         ids=["default", "bm64", "inflight0", "gated", "residual_direct"])
def test_pingpong(fusion, overrides, M, N, K):
    """mode="pingpong": the two consumer warpgroups take tiles in turn, each a tile of its own."""
    run_and_check(compiled(fusion, mode="pingpong", **overrides), fusion, M, N, K, seed=M + N)


@pytest.mark.parametrize("M,N,K", [(999, 1000, 1000), (4096, 4096, 1024), (300, 520, 40)])
@pytest.mark.parametrize("fusion", [matmul, gated, scaled_silu_f32], ids=lambda f: f.name)
def test_two_row_blocks_per_warpgroup(fusion, M, N, K):
    """Cooperative 256 x 128 tiles: each consumer warpgroup issues two m64 wgmmas per k step into
    two accumulators, and its epilogue walks both blocks of rows."""
    run_and_check(compiled(fusion, tile=(256, 128, 64)), fusion, M, N, K, seed=M + K)


@pytest.mark.parametrize("M", [1, 33, 4096])
@pytest.mark.parametrize("fusion", [gated, scaled_silu_f32, linear_relu_residual], ids=lambda f: f.name)
def test_epilogues_with_mn_inputs_and_f32_outputs(fusion, M):
    """The gated, f32-output and residual epilogues (they spilled before the epilogue took the
    accumulator in slices) at decode, odd and large M."""
    run_and_check(compiled(fusion), fusion, M, 4096, 1024, seed=M)


@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (33, 4096, 4096), (16, 1000, 3000), (4096, 4096, 1024),
                                   (200, 512, 100000 // 64 * 64), (128, 264, 40)])
@pytest.mark.parametrize("fusion", [matmul, gated], ids=lambda f: f.name)
def test_split_k(fusion, M, N, K):
    """Few tiles: the host splits their k range (M 1 and 33: 16 tiles of 64 k steps, 8 splits);
    many tiles: no split (4096); a long K; K < BK (one k step: no split)."""
    run_and_check(compiled(fusion, split_k=16), fusion, M, N, K, seed=M + K)


@pytest.mark.parametrize("fusion", [matmul, gated], ids=lambda f: f.name)
def test_the_default_switches_to_split_k_where_tiles_are_few(fusion):
    """ws.compile(fusion) picks a narrower kernel per call where the default's output tiles cannot
    fill the SMs: 64x64 tiles unsplit where they fit in one wave and K is at most 64 k steps (M = 1
    and 128 at N = K = 4096), 64x128 split-K at a longer K (8192), and the default where the tiles
    fill the SMs (M = 4096)."""
    k = compiled(fusion)
    for M, K, tile, split in ((1, 8192, (64, 128, 64), True), (128, 8192, (64, 128, 64), True),
                              (1, 4096, (64, 64, 64), False), (128, 4096, (64, 64, 64), False),
                              (4096, 4096, (128, 256, 64), False)):
        inputs = inputs_for(fusion, M, 4096, K, device="cuda")
        chosen = k.kernel_for(*inputs).schedule
        assert (chosen.tile, chosen.split_k > 1) == (tile, split), (M, K)
        run_and_check(k, fusion, M, 4096, K, seed=M + K)


# (fusion, M, N, K, expected (tile, split, cluster along M)): a call of each per-call rule at
# sizes no tile divides (rows off a 64-byte boundary too), a gated epilogue among them
SHORT, SHORT_SPLIT = ((64, 64, 64), False, 1), ((64, 64, 64), True, 1)
MID, MID_CLUSTERED = ((128, 192, 64), False, 1), ((128, 192, 64), False, 2)
NARROW_CLUSTERED = ((128, 128, 64), False, 2)
PER_CALL = [
    # 64x64 tiles fit in one wave and K is at most 64 k steps: unsplit (N 912, K 1120: rows off)
    (matmul, 1, 912, 1120, SHORT), (matmul, 37, 280, 792, SHORT), (matmul, 258, 1320, 2152, SHORT),
    (gated, 23, 440, 1344, SHORT), (matmul, 100, 4000, 4096, SHORT), (gated, 5, 136, 40, SHORT),
    # K beyond 64 k steps, 64x64 tiles in at most a quarter of the SMs: split-K (K no multiple of 64)
    (matmul, 1, 1000, 9000, SHORT_SPLIT), (gated, 37, 600, 7000, SHORT_SPLIT), (matmul, 203, 500, 11416, SHORT_SPLIT),
    (gated, 16, 1016, 8200, SHORT_SPLIT),
    # 128x192 tiles shorten the waves (2304 x 2048: 144 tiles of 128x256 take two waves, 198 of
    # 128x192 two shorter ones); in clusters where rows are off (K 520, 1064; N 4216)
    (matmul, 2304, 2048, 2048, MID), (gated, 2304, 2048, 1024, MID), (matmul, 1500, 4224, 520, MID_CLUSTERED),
    (gated, 2290, 4216, 1064, MID_CLUSTERED),
    # tall narrow outputs of rows off (4774 x 384: 76 tiles of 128x256 hold 512 columns for 384):
    # cooperative 128x128 tiles in clusters
    (matmul, 4774, 384, 1160, NARROW_CLUSTERED), (gated, 4346, 336, 1712, NARROW_CLUSTERED),
]


@pytest.mark.parametrize("fusion, M, N, K, expected", PER_CALL)
def test_each_per_call_rule_runs_its_kernel_correctly(fusion, M, N, K, expected):
    """ws.compile(fusion) picks the rule's kernel for the call (tile, split-K or not, cluster
    along M, cooperative) and its result matches torch, outputs poisoned first."""
    k = compiled(fusion)
    chosen = k.kernel_for(*inputs_for(fusion, M, N, K, device="cuda")).schedule
    assert ((chosen.tile, chosen.split_k > 1, chosen.cluster[0]), chosen.mode) == (expected, "cooperative"), \
        chosen.short()
    run_and_check(k, fusion, M, N, K, seed=M + N + K)


@pytest.mark.parametrize("overrides, M, N, K, seed", [(dict(split_k=16), 40, 4096, 8192, 11),
                                                     (dict(stream_k=True), 700, 1000, 6000, 12)],
                         ids=["split_k", "stream_k"])
def test_split_work_is_deterministic_and_its_tickets_reset(overrides, M, N, K, seed):
    """The same inputs three times: the same bits (the partials are summed in split order
    whichever CTA arrives last), and the tickets are back at 0 after each call (else the second
    call's last CTA would be another one, or none). Split-K, and stream-K's tiles split between
    CTAs' ranges."""
    k = compiled(matmul, **overrides)
    a, b = inputs_for(matmul, M, N, K, device="cuda", seed=seed)
    outs = [k(a, b).clone() for _ in range(3)]
    k.synchronize()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(int(t.count_nonzero()) == 0 for (name, _), held in k._workspaces.items() if name == "tickets"
               for t in held)
    ref = matmul.reference(a.cpu(), b.cpu()).float().cuda()
    assert float((outs[0].float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("fusion, M, N, K", [
    (matmul, 2304, 2048, 8192),          # 144 tiles on the SMs: the rule's call, tiles in two CTAs' ranges
    (gated, 2688, 1792, 9216),           # 154 tiles, a gated epilogue on the sums
    (matmul, 300, 520, 8200),            # 9 tiles of 129 k steps over the SMs: each tile in ~15 ranges
    (scaled_silu_f32, 1000, 1000, 5000),  # f32 output, ragged in every dim
    (linear_relu_residual, 33, 4096, 4096),
])
def test_stream_k(fusion, M, N, K):
    run_and_check(compiled(fusion, stream_k=True), fusion, M, N, K, seed=M + K)


@pytest.mark.parametrize("fusion, M, N, K", [(matmul, 2304, 2048, 4096), (gated, 2432, 1792, 10240),
                                             (linear_relu_residual, 3077, 1536, 4096)])
def test_the_default_takes_stream_k_for_a_little_more_than_one_wave_of_long_k(fusion, M, N, K):
    k = compiled(fusion)
    assert k.kernel_for(*inputs_for(fusion, M, N, K, device="cuda")).schedule.stream_k
    run_and_check(k, fusion, M, N, K, seed=M + N + K)


# --- batched matmul (tests/test_batched_matmul.py has the simulator's checks) ----------------------

def _check_batched(fusion, sizes, seed):
    from test_batched_matmul import inputs

    k = compiled(fusion)
    x = [t.cuda() for t in inputs(fusion, sizes, seed)]
    ref = fusion.reference(*[t.cpu() for t in x]).float().cuda()
    node = ws.partition(fusion, k.schedule).outputs[0]
    out = {"out": torch.full(tuple(ref.shape), float("nan"), device="cuda", dtype=node.dtype.torch_dtype)}
    k(*x, out=out)
    k.synchronize()
    got = out["out"].float()
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} outputs never written"
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("B,M,N,K", [(1, 512, 512, 512), (3, 999, 1000, 1000), (16, 1024, 1024, 256),
                                     (5, 33, 4096, 40)])
def test_bmm(B, M, N, K):
    from test_batched_matmul import bmm

    _check_batched(bmm, dict(B=B, M=M, N=N, K=K), seed=B + M)


@pytest.mark.parametrize("B,M", [(1, 4096), (4, 1000), (3, 1)])
def test_batched_linear_with_bias_and_residual(B, M):
    from test_batched_matmul import batched_linear

    _check_batched(batched_linear, dict(B=B, M=M, N=1000, K=1024), seed=B)


def test_broadcast_batch_dims_in_operands_and_epilogue():
    from test_batched_matmul import broadcast_b, shared_a, three_batch_dims

    _check_batched(three_batch_dims, dict(P=2, Q=3, R=2, M=300, N=520, K=264), seed=1)
    _check_batched(broadcast_b, dict(B=3, M=300, N=520, K=264), seed=2)
    _check_batched(shared_a, dict(B=3, M=300, N=520, K=264), seed=3)


@ws.fusion
def divided(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], scale: ws.Tensor[ws.f32, "N"]):
    return (ws.matmul(a, b) / scale).to(ws.f32)


@ws.fusion
def undivided(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    return ws.matmul(a, b).to(ws.f32)


def test_division_by_a_broadcast_tile_matches_ieee_at_the_edges():
    """`/ scale` with scale a per-column tile is one reciprocal a column and a multiply
    (wsp::div_shared): within 1.5 ulp of IEEE division of the same fp32 products (the same
    schedule without the division gives them), also for subnormal, huge, zero and infinite
    divisors and for quotients that overflow or fall into the subnormals."""
    M, N, K = 200, 264, 128
    a, b, _ = inputs_for(mlp, M, N, K, device="cuda", seed=11)
    edges = torch.tensor([1.0, 3.0, -7.0, 1e-39, -3e-42, 2.5e38, float("inf"), 0.0], device="cuda")
    scale = edges.repeat(N // len(edges))
    out = {"out": torch.full((M, N), float("nan"), device="cuda")}
    compiled(divided, epilogue="direct")(a, b, scale, out=out)
    products = compiled(undivided, epilogue="direct")(a, b)
    torch.cuda.synchronize()
    want, got = products / scale, out["out"]       # torch: IEEE division
    assert bool((torch.isinf(want) == torch.isinf(got)).all()) and bool((torch.isnan(want) == torch.isnan(got)).all())
    finite = torch.isfinite(want)
    close = torch.isclose(got[finite], want[finite], rtol=3e-7, atol=3e-45)   # 1.5 ulp; one subnormal step
    assert bool(close.all()), f"{int((~close).sum())} quotients off, e.g. {got[finite][~close][:4]} vs {want[finite][~close][:4]}"


CLUSTER_SHAPES = [
    (512, 512, 512),      # fewer tile pairs than clusters
    (4096, 4096, 1024),   # many tiles: every cluster walks several, every stage reused
    (999, 1000, 1000),    # an odd count of row tiles: one CTA of the last pair computes past M
    (8, 4096, 4096),      # one row of tiles: the pair's second CTA only lends its piece of B
    (4096, 8, 2048),      # skinny N
    (300, 520, 40),       # K smaller than one k tile
]


@pytest.mark.parametrize("M,N,K", CLUSTER_SHAPES)
@pytest.mark.parametrize("fusion,overrides", [
    (matmul, dict(cluster=(2, 1, 1))), (matmul, dict(cluster=(1, 2, 1))), (matmul, dict(cluster=(4, 1, 1))),
    (linear_relu_residual, dict(cluster=(2, 1, 1), epilogue="direct")),
    (gated, dict(cluster=(2, 1, 1), tile=(128, 128, 64))),
    (matmul, dict(cluster=(1, 2, 1), tile=(64, 256, 64), consumer_warpgroups=1))],
    ids=["2x1", "1x2", "4x1", "residual_direct_2x1", "gated_2x1_bn128", "bm64_1x2"])
def test_clusters_with_tma_multicast(fusion, overrides, M, N, K):
    """Clusters: the CTAs of a cluster take tiles next to each other, each loads a piece of the tile
    they share and multicasts it to all; every CTA's consumers free a stage on every CTA."""
    run_and_check(compiled(fusion, **overrides), fusion, M, N, K, seed=M + N + K)


def test_cluster_grid_counts_the_sms_clusters_can_hold():
    """A cluster kernel's persistent grid is sized by the SMs its clusters can occupy at once."""
    k = compiled(matmul, cluster=(4, 1, 1))
    held = k._loaded.cluster_sms(torch.cuda.current_device(), 4)
    assert 0 < held <= torch.cuda.get_device_properties(0).multi_processor_count and held % 4 == 0
    a, b = inputs_for(matmul, 8192, 8192, 128, device="cuda", seed=0)
    plan, _, _ = k._prepare((a, b), None)
    assert plan.grid == held



@pytest.mark.parametrize("M,N,K,pad", [(2048, 2048, 1000, 8), (4096, 1000, 2000, 8), (3001, 4200, 3920, 0)])
@pytest.mark.parametrize("fusion", [matmul, gated], ids=lambda f: f.name)
def test_rows_off_a_64_byte_boundary_run_in_clusters(fusion, M, N, K, pad):
    """A and B whose rows start off a 64-byte boundary (views of buffers `pad` elements wider, or
    contiguous with K and N no multiples of 32) take the clustered variant where their tiles fill
    half the SMs; its result against torch, outputs NaN-poisoned first."""
    k = compiled(fusion)
    a, b, *rest = inputs_for(fusion, M, N + pad, K + pad, device="cuda", seed=M + pad)
    inputs = [a[:, :K], b[:K, :N], *(t[:, :N].contiguous() for t in rest)]
    assert k.kernel_for(*inputs).schedule.cluster == (2, 1, 1)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    k(*inputs, out={"out": out})
    k.synchronize()
    ref = fusion.reference(*inputs).float()
    assert not torch.isnan(out.float()).any()
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
