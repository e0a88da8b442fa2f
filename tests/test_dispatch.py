"""ws.compile(fusion) without a schedule picks, per call, among the workload's default schedule
and its shape variants (matmul: split-K where the output tiles cannot fill the SMs)."""

from __future__ import annotations

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


def test_default_matmul_has_a_split_k_variant(k):
    assert isinstance(k, ShapeDispatchKernel)
    (variant,) = k.variants
    assert variant.schedule == ws.schedule_for(matmul, split_k=MAX_SPLIT_K)
    assert k.describe() == (
        "matmul: 128x256x64 stages=3 consumers=2 regs=24/240 epilogue=tma_store (default)\n"
        f"  128x256x64 stages=3 consumers=2 regs=24/240 epilogue=tma_store split_k={MAX_SPLIT_K} when "
        f"splits = min({MAX_SPLIT_K}, k steps, num_sms / output tiles) > 1")
    # what a CompiledKernel has is the default schedule's
    assert k.schedule == ws.schedule_for(matmul) and k.ir == k.primary.ir and k.cuda_source == k.primary.cuda_source


def test_a_schedule_or_overrides_give_one_kernel():
    assert not isinstance(ws.compile(matmul, ws.schedule_for(matmul), build=False), ShapeDispatchKernel)
    assert not isinstance(ws.compile(matmul, stages=2, build=False), ShapeDispatchKernel)
    assert not isinstance(ws.compile(make_attention(64), build=False), ShapeDispatchKernel)


def _shape(m, n, kk):
    return torch.empty(m, kk, dtype=torch.bfloat16), torch.empty(kk, n, dtype=torch.bfloat16)


@pytest.mark.parametrize("m, n, kk, sms, split", [
    (1, 4096, 4096, 132, True),       # 16 tiles on 132 SMs: 8 splits
    (128, 4096, 4096, 132, True),
    (512, 4096, 4096, 132, True),     # 64 tiles: 2 splits
    (640, 4096, 4096, 132, False),    # 80 tiles: 132 / 80 = 1
    (8192, 8192, 8192, 132, False),
    (1, 4096, 64, 132, False),        # one k step: nothing to split
    (1, 4096, 128, 132, True),
    (16, 1024, 4096, 4, False),       # 4 tiles on 4 SMs
    (16, 256, 4096, 4, True),
])
def test_the_rule(k, m, n, kk, sms, split):
    chosen = k.choose(_shape(m, n, kk), sms)
    assert (chosen.schedule.split_k == MAX_SPLIT_K) == split
    assert chosen is (k.kernels[1] if split else k.primary)


def test_variants_are_built_once(k):
    first = k.choose(_shape(1, 512, 4096), 132)
    assert k.choose(_shape(2, 512, 4096), 132) is first and len(k.kernels) == 2


@pytest.mark.parametrize("fusion, m, n, kk", [(matmul, 33, 296, 520), (gated, 1, 384, 640)])
def test_simulate_runs_the_chosen_kernel(fusion, m, n, kk):
    k = ws.compile(fusion, build=False)
    inputs = inputs_for(fusion, m, n, kk, seed=m)
    assert k.choose(inputs, 4).schedule.split_k == MAX_SPLIT_K     # 2 tiles on 4 SMs
    out = k.simulate(*inputs, num_sms=4)
    ref = fusion.reference(*inputs)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_cpu_tensors_raise_the_no_gpu_error(k):
    a, b = inputs_for(matmul, 16, 256, 64)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(NoGPUError, match="no CUDA device is available here"):
        k(a, b)
