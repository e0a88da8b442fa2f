"""The main job: a persistent warp-specialized matmul with a fused bias + GELU epilogue.

On a Hopper GPU: compile, run, check against torch, and time it next to torch.matmul (cuBLAS).
Without a GPU: lower, print the loop IR, compile the CUDA with nvcc if it is installed, and run
the kernel in the CPU simulator at a small size, checked against the torch reference.
"""

from __future__ import annotations

import argparse
import time

import torch

import wsched as ws
from common import show_lowered
from wsched.timing import rel_error


@ws.fusion
def mlp(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], bias: ws.Tensor[ws.bf16, "N"]):
    return ws.gelu(ws.matmul(a, b) + bias).to(ws.bf16)


def inputs(M, N, K, device):
    a = (torch.randn(M, K) / K ** 0.5).to(torch.bfloat16).to(device)
    b = torch.randn(K, N).to(torch.bfloat16).to(device)
    bias = torch.randn(N).to(torch.bfloat16).to(device)
    return a, b, bias


def on_gpu(size: int):
    from wsched.timing import median_ms

    k = ws.compile(mlp)
    print(f"schedule: {k.schedule.short()}   ptxas: {k.resources}")
    a, b, bias = inputs(size, size, size, "cuda")
    out = k(a, b, bias)
    err = rel_error(out, mlp.reference(a, b, bias))
    print(f"{size}^3: relative error vs torch reference {err:.2e}")
    flops = 2 * size ** 3
    t_ours = median_ms(lambda: k(a, b, bias))
    t_ref = median_ms(lambda: torch.nn.functional.gelu(torch.matmul(a, b) + bias))
    print(f"wsched {flops / t_ours / 1e9:.0f} TFLOP/s   torch (cuBLAS + gelu) {flops / t_ref / 1e9:.0f} TFLOP/s"
          f"   ratio {t_ref / t_ours:.2f}")


def on_cpu(M: int, N: int, K: int):
    t0 = time.perf_counter()
    k = ws.compile(mlp, build=False)
    print(f"lowered and emitted in {time.perf_counter() - t0:.2f} s; schedule {k.schedule.short()}\n")
    show_lowered(k)
    a, b, bias = inputs(M, N, K, "cpu")
    t0 = time.perf_counter()
    out = k.simulate(a, b, bias, seed=0)
    err = rel_error(out, mlp.reference(a, b, bias))
    print(f"simulated {M}x{N}x{K} in {time.perf_counter() - t0:.1f} s: relative error vs torch {err:.2e}")
    assert err < 1e-2, "simulated kernel does not match the reference"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=4096, help="M = N = K on the GPU")
    ap.add_argument("--cpu", action="store_true", help="simulate even when a GPU is present")
    args = ap.parse_args()
    if torch.cuda.is_available() and not args.cpu:
        on_gpu(args.size)
    else:
        on_cpu(200, 296, 152)   # not multiples of the tile; rows 16-byte aligned as TMA needs


if __name__ == "__main__":
    main()
