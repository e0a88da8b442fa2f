"""Batched matmul through the persistent matmul kernel: [*batch, M, K] @ [*batch, K, N] (or
[*batch, N, K] transposed), batch dims that broadcast (extent 1, or missing as in a batched linear
layer's weight), batch as the outermost tile dimension of both roles.

The simulator against torch (outputs NaN-poisoned by `simulate`) at shapes that do not divide
the tile, the golden IR of a batched linear layer, the exact errors for what stays rejected,
and nvcc builds without spills.
"""

from __future__ import annotations

import pytest
import torch

import wsched as ws
from wsched.codegen import build
from wsched.codegen.emit import emit_kernel
from wsched.errors import FusionError
from wsched.kernel import CompiledKernel
from wsched.lowering.printer import print_kernel
from wsched.schedule import ScheduleError
from wsched.workloads.matmul import MATMUL

from source_lines import line_of


@ws.fusion
def bmm(a: ws.Tensor[ws.bf16, "B", "M", "K"], b: ws.Tensor[ws.bf16, "B", "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)   # bmm matmul


@ws.fusion
def batched_linear(x: ws.Tensor[ws.bf16, "B", "M", "K"], w: ws.Tensor[ws.bf16, "N", "K"],
                   bias: ws.Tensor[ws.bf16, "N"], residual: ws.Tensor[ws.bf16, "B", "M", "N"]):
    return (ws.matmul(x, w.transpose(0, 1)) + bias + residual).to(ws.bf16)


@ws.fusion
def batched_linear_b2(x: ws.Tensor[ws.bf16, 2, "M", "K"], w: ws.Tensor[ws.bf16, "N", "K"],
                      bias: ws.Tensor[ws.bf16, "N"], residual: ws.Tensor[ws.bf16, 2, "M", "N"]):
    """The golden kernel (and a mutation family in tests/test_mutations.py, whose inputs have
    fixed batch sizes): the batch a literal 2, the kernel's batch0 param bound from it."""
    return (ws.matmul(x, w.transpose(0, 1)) + bias + residual).to(ws.bf16)


@ws.fusion
def bmm_nk(a: ws.Tensor[ws.bf16, "B", "M", "K"], w: ws.Tensor[ws.bf16, "B", "N", "K"]):
    return ws.matmul(a, w.transpose(-1, -2)).to(ws.bf16)


@ws.fusion
def shared_a(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "B", "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)


@ws.fusion
def broadcast_b(a: ws.Tensor[ws.bf16, "B", "M", "K"], b: ws.Tensor[ws.bf16, 1, "K", "N"],
                scale: ws.Tensor[ws.f32, "B", "M", 1]):
    return ws.matmul(a, b) * scale


@ws.fusion
def three_batch_dims(a: ws.Tensor[ws.bf16, "P", "Q", "R", "M", "K"], b: ws.Tensor[ws.bf16, "Q", 1, "K", "N"],
                     scale: ws.Tensor[ws.f32, "M", 1], gate: ws.Tensor[ws.bf16, "P", 1, "R", "M", "N"]):
    return (ws.silu(ws.matmul(a, b) * scale) * gate).to(ws.bf16)


def inputs(fusion, sizes: dict, seed: int = 0) -> list[torch.Tensor]:
    """Fresh random normal inputs; MMA operands scaled by 1/sqrt(K) to keep sums O(1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for node in fusion.inputs:
        t = torch.randn([sizes[d] if isinstance(d, str) else d for d in node.shape], generator=g)
        if node.id in ("a", "x"):
            t = t / sizes["K"] ** 0.5
        out.append(t.to(node.dtype.torch_dtype))
    return out


def check(kernel, fusion, sizes, seed=0, num_sms=4):
    x = inputs(fusion, sizes, seed)
    out = kernel.simulate(*x, num_sms=num_sms, seed=seed)      # outputs NaN-poisoned first
    ref = fusion.reference(*x).float()
    assert out.shape == ref.shape
    assert not torch.isnan(out.float()).any(), f"{int(torch.isnan(out.float()).sum())} outputs never written"
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 1e-2, f"relative error {err:.2e}"


_kernels: dict = {}


def compiled(fusion, **overrides):
    key = (fusion.name, tuple(sorted(overrides.items())))
    if key not in _kernels:
        _kernels[key] = ws.compile(fusion, build=False, **overrides)
    return _kernels[key]


# --- the simulator against torch -----------------------------------------------------------------

@pytest.mark.parametrize("B,M,N,K", [(1, 100, 136, 200), (3, 100, 136, 200), (3, 130, 264, 72)])
def test_bmm(B, M, N, K):
    check(compiled(bmm), bmm, dict(B=B, M=M, N=N, K=K), seed=B + M)


@pytest.mark.parametrize("B", [1, 3])
def test_batched_linear_with_bias_and_residual(B):
    check(compiled(batched_linear), batched_linear, dict(B=B, M=70, N=200, K=136), seed=B)


def test_batched_linear_direct_epilogue_one_consumer():
    k = compiled(batched_linear, epilogue="direct", tile=(64, 128, 64), consumer_warpgroups=1)
    check(k, batched_linear, dict(B=3, M=70, N=200, K=136), seed=5)


def test_transposed_b_with_its_own_batch():
    check(compiled(bmm_nk), bmm_nk, dict(B=3, M=65, N=72, K=104), seed=2)


def test_a_without_batch_dims_is_shared_by_every_batch():
    check(compiled(shared_a), shared_a, dict(B=3, M=65, N=72, K=104), seed=3)


def test_b_of_batch_extent_1_broadcasts_and_a_row_scale_per_batch():
    check(compiled(broadcast_b), broadcast_b, dict(B=3, M=65, N=72, K=104), seed=4)


def test_three_batch_dims_broadcast_in_both_operands_and_the_epilogue():
    check(compiled(three_batch_dims), three_batch_dims, dict(P=2, Q=2, R=2, M=33, N=64, K=72), seed=6)


def test_more_tiles_than_sms_and_a_second_interleaving():
    check(compiled(bmm, tile=(64, 64, 64), consumer_warpgroups=1), bmm, dict(B=3, M=130, N=72, K=136),
          seed=7, num_sms=3)


# --- the kernel ------------------------------------------------------------------------------------

def test_batched_linear_final_ir_is_golden(golden):
    golden.check("matmul_batched_linear.ir", print_kernel(ws.lower(batched_linear_b2)))


def test_batch_is_the_outermost_tile_dimension():
    text = print_kernel(ws.lower(three_batch_dims))
    assert ("kernel three_batch_dims(i32 batch0, i32 batch1, i32 batch2, i32 M, i32 N, i32 K, "
            "tensormap a: bf16[batch0, batch1, batch2, M, K] box(1, 1, 1, 128, 64) swizzle(128), "
            "tensormap b: bf16[batch1, 1, K, N] box(1, 1, 64, 64) swizzle(128)") in text
    assert "global scale: f32[M, 1], global gate: bf16[batch0, 1, batch2, M, N]" in text
    assert "grid(min(num_sms, ceil_div(M, 128) * ceil_div(N, 256) * (batch0 * batch1 * batch2)))" in text
    for line in ("let num_tiles = batch_tiles * (batch0 * batch1 * batch2)", "let batch_tile = tile % batch_tiles",
                 "let b2 = rest % batch2", "let b1 = rest2 % batch1", "let b0 = rest1",
                 "tma.load B[s, 0] <- b[b1, 0, k * 64, n0] bar(full[s])",
                 "tile.load gate_t <- gate[b0, 0, b2, m0 + wg * 64, n0 + j * 64]",
                 "tma.store out[b0, b1, b2, m0 + wg * 64, n0 + j * 64] <- C_bf16[wg, j % 2]"):
        assert line in text, line
    assert text.count("let first_m = batch_tile / group_size * 16") == 2    # producer and consumers


def test_compile_gives_one_kernel_without_split_k_variants():
    k = ws.compile(bmm, build=False)
    assert isinstance(k, CompiledKernel) and k.schedule.split_k == 1
    schedule = ws.schedule_for(bmm)
    assert MATMUL.variants(bmm, schedule) == ()
    assert MATMUL.variants(ws.fusion(_plain), ws.schedule_for(ws.fusion(_plain))) != ()
    space = list(MATMUL.schedule_space(bmm))
    assert space and all(s.split_k == 1 for s in space)


def _plain(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)


# --- what stays rejected -------------------------------------------------------------------------

def test_split_k_is_rejected_for_a_batched_matmul():
    with pytest.raises(ScheduleError) as e:
        ws.lower(bmm, split_k=4)
    assert str(e.value) == (
        f"n0 = matmul('a', 'b') at {line_of(__file__, 'bmm matmul')} is batched (shape ['B', 'M', 'N']): "
        "split-K (split_k=4) "
        "takes 2-D matmuls only; use split_k=1 (the batch dims already multiply the tiles)")


def test_four_batch_dims_are_rejected():
    @ws.fusion
    def four(a: ws.Tensor[ws.bf16, "P", "Q", "R", "S", "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
        return ws.matmul(a, b)

    with pytest.raises(ScheduleError) as e:
        ws.lower(four)
    assert "has shape ['P', 'Q', 'R', 'S', 'M', 'N']: 4 batch dims; the persistent matmul kernel takes " \
           "[*batch, M, K] x [*batch, K, N] with at most 3 batch dims (merge some first)" in str(e.value)


def test_an_operand_transposed_over_a_batch_dim_is_rejected():
    @ws.fusion
    def swapped(a: ws.Tensor[ws.bf16, "B", "M", "K"], b: ws.Tensor[ws.bf16, "K", "B", "N"]):
        return ws.matmul(a, b.transpose(0, 1))   # swapped transpose

    with pytest.raises(ScheduleError) as e:
        ws.lower(swapped)
    where = line_of(__file__, "swapped transpose")
    assert str(e.value) == (f"matmul operand b is n0 = transpose(dims -3, -2) at {where}: only "
                            "the last two dims of an operand may be swapped (w.transpose(-1, -2))")


def test_batch_dims_that_do_not_broadcast_are_rejected_by_the_dsl():
    with pytest.raises(FusionError) as e:
        @ws.fusion
        def mismatch(a: ws.Tensor[ws.bf16, 2, "M", "K"], b: ws.Tensor[ws.bf16, 3, "K", "N"]):
            return ws.matmul(a, b)
    assert "batch dimensions do not broadcast" in str(e.value) and "(2 vs 3)" in str(e.value)


def test_an_epilogue_input_with_batch_dims_the_output_lacks_is_rejected():
    @ws.fusion
    def widened(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
                r: ws.Tensor[ws.bf16, "B", "M", "N"]):
        return ws.matmul(a, b) + r   # widened add

    with pytest.raises(ScheduleError) as e:
        ws.lower(widened)
    where = line_of(__file__, "widened add")
    assert str(e.value) == (f"r has shape ['B', 'M', 'N'] and is read by n1 = add(...) at {where}; "
                            "the epilogue reads [M, N], [N], [1, N] or [M, 1] tensors (M=M, N=N)")


def test_an_epilogue_input_of_another_batch_size_is_rejected():
    @ws.fusion
    def other(a: ws.Tensor[ws.bf16, "B", "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"],
              r: ws.Tensor[ws.bf16, "C", 1, "M", "N"]):
        return ws.matmul(a, b) + r

    with pytest.raises(ScheduleError) as e:
        ws.lower(other)
    assert str(e.value).endswith(
        "; the epilogue reads [M, N], [N], [1, N] or [M, 1] tensors with leading dims of the output's batch "
        "dims [B] or 1 (M=M, N=N)")


# --- nvcc ----------------------------------------------------------------------------------------

@pytest.mark.nvcc
@pytest.mark.parametrize("fusion", [batched_linear, three_batch_dims], ids=lambda f: f.name)
def test_compiles_for_sm90a_without_spills(fusion, tmp_path_factory):
    emitted = emit_kernel(ws.lower(fusion))
    result = build.compile_cuda(emitted.source, name=emitted.name, cache_dir=tmp_path_factory.mktemp("cache"))
    res = result.resources[emitted.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0)
    assert "wsp::tma_load_5d(" in emitted.source or "wsp::tma_load_3d(" in emitted.source
