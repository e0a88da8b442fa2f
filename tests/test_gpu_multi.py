"""A compiled kernel runs on the device of its tensors, whatever the current device is.

The context (that device's primary context), the stream (torch's current stream of that
device), the SM count that sizes the grid, the loaded module and the TMA maps are all that
device's. Outputs are poisoned with NaN before every run and compared with the torch
reference. The two-device tests skip on a machine with one GPU; the thread tests that need only
one device run anywhere there is a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

import wsched as ws

from attention_fusions import attention_inputs, make_attention
from fusions import inputs_for, matmul, mlp

pytestmark = pytest.mark.gpu

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs")

SHAPE = (999, 1000, 1000)   # nothing divides the tile; 8 x 4 tiles: fewer than SMs
BIG = (4096, 4096, 1024)    # 32 x 16 tiles: more than SMs

_compiled: dict = {}


def compiled(fusion):
    if fusion.name not in _compiled:
        _compiled[fusion.name] = ws.compile(fusion)
    return _compiled[fusion.name]


def run_and_check(fusion, device, shape=SHAPE, seed=0):
    """One poisoned run of `fusion` on `device`; returns the relative error against the reference."""
    k = compiled(fusion)
    M, N, K = shape
    inputs = inputs_for(fusion, M, N, K, device=device, seed=seed)
    out = {"out": torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)}
    k(*inputs, out=out)
    torch.cuda.synchronize(device)
    got = out["out"].float()
    ref = fusion.reference(*inputs).float()
    assert got.device == torch.device(device)
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} outputs never written on {device}"
    return float((got - ref).norm() / ref.norm())


@two_gpus
@pytest.mark.parametrize("current", [0, 1])
@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_kernel_runs_on_its_tensors_device_whatever_the_current_device(device, current):
    with torch.cuda.device(current):
        for fusion, shape in ((matmul, SHAPE), (mlp, BIG)):
            assert run_and_check(fusion, device, shape, seed=current) < 1e-2
        assert torch.cuda.current_device() == current   # the call leaves the current device alone


@two_gpus
def test_after_set_device_both_devices_still_work():
    try:
        for current in (1, 0):
            torch.cuda.set_device(current)
            for device in ("cuda:1", "cuda:0"):
                assert run_and_check(matmul, device, seed=current) < 1e-2
                assert torch.cuda.current_device() == current
    finally:
        torch.cuda.set_device(0)


@two_gpus
def test_attention_with_lse_on_the_second_device():
    f = make_attention(128, causal=True, lse=True)
    k = ws.compile(f)
    with torch.cuda.device(0):
        q, kk, v = attention_inputs(2, 4, 1000, 1000, 128, device="cuda:1", seed=3)
        outs = k._outputs(f.bind(q, kk, v), "cuda:1")
        for t in outs.values():
            t.fill_(float("nan"))
        k(q, kk, v, out=outs)
        torch.cuda.synchronize(1)
    o, lse = outs.values()
    ro, rlse = f.reference(q, kk, v)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert float((o.float() - ro.float()).norm() / ro.float().norm()) < 1e-2
    assert float((lse - rlse).norm() / rlse.norm()) < 1e-3


@two_gpus
def test_the_launch_goes_on_the_current_stream_of_the_tensors_device():
    k = compiled(matmul)
    M, N, K = BIG
    a, b = inputs_for(matmul, M, N, K, device="cuda:1", seed=5)
    out = {"out": torch.empty((M, N), device="cuda:1", dtype=torch.bfloat16)}
    side = torch.cuda.Stream(device=1)
    with torch.cuda.stream(side):             # the current stream of cuda:1 (and cuda:1 current)
        torch.cuda._sleep(50_000_000)         # ~25 ms of GPU time on `side`...
        out["out"].fill_(float("nan"))        # ...then the poison, on `side`
        with torch.cuda.device(0):            # the current device is another one at the call
            k(a, b, out=out)                  # must run after the poison: on `side`
    side.synchronize()
    got = out["out"].float()
    assert not torch.isnan(got).any(), "the kernel ran on another stream than cuda:1's current one"
    ref = matmul.reference(a, b).float()
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@two_gpus
def test_arguments_on_two_devices_are_named():
    k = compiled(matmul)
    a, b = inputs_for(matmul, 256, 256, 256, device="cuda:0")
    with pytest.raises(ValueError, match=r"argument 'b' is on cuda:1 but the kernel runs on cuda:0; "
                                         r"all arguments must be on one GPU — move it with \.to\('cuda:0'\)"):
        k(a, b.to("cuda:1"))
    out = {"out": torch.empty(256, 256, device="cuda:1", dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="argument 'out' is on cuda:1 but the kernel runs on cuda:0"):
        k(a, b, out=out)


def _drive(devices, set_device: bool, rounds: int = 6):
    """One thread per entry of `devices`, each running `rounds` poisoned calls on its device."""
    errors: list[str] = []
    start = threading.Barrier(len(devices))

    def work(slot, device):
        try:
            if set_device:
                torch.cuda.set_device(device)
            start.wait()
            for r in range(rounds):
                fusion, shape = ((matmul, SHAPE), (mlp, BIG))[r % 2]
                err = run_and_check(fusion, device, shape, seed=10 * slot + r)
                if err >= 1e-2:
                    errors.append(f"thread {slot} on {device}, round {r}: relative error {err:.2e}")
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(f"thread {slot} on {device}: {type(error).__name__}: {error}")

    for fusion in (matmul, mlp):
        compiled(fusion)   # built before the threads start
    threads = [threading.Thread(target=work, args=(slot, device)) for slot, device in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, "\n".join(errors)


@two_gpus
@pytest.mark.parametrize("set_device", [False, True], ids=["current-device-0", "set_device"])
def test_two_threads_each_driving_one_device(set_device):
    _drive(["cuda:0", "cuda:1"], set_device)


@pytest.mark.parametrize("set_device", [False, True], ids=["fresh-threads", "set_device"])
def test_threads_sharing_one_device(set_device):
    _drive(["cuda:0"] * 4, set_device)


@pytest.mark.parametrize("device", ["cuda:0", pytest.param("cuda:1", marks=two_gpus)])
def test_a_thread_that_never_used_cuda_can_launch(device):
    # the thread has no current context at all: the launch binds the device's primary context
    k = compiled(matmul)
    M, N, K = SHAPE
    a, b = inputs_for(matmul, M, N, K, device=device, seed=9)
    out = {"out": torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)}
    bound = k.bind(a, b, out=out)
    torch.cuda.synchronize(device)
    errors = []

    def launch():
        try:
            bound()
            bound.synchronize()
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join(timeout=120)
    assert not errors, errors
    torch.cuda.synchronize(device)
    got, ref = out["out"].float(), matmul.reference(a, b).float()
    assert not torch.isnan(got).any()
    assert float((got - ref).norm() / ref.norm()) < 1e-2
