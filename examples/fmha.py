"""Flash attention forward written as a tensor DAG: softmax(Q K^T / sqrt(d)) V with a causal
mask and the log-sum-exp, scheduled into a warp-specialized kernel with online softmax.

On a Hopper GPU: compile, run, check against torch SDPA, and time it next to SDPA's cuDNN and
flash backends. Without a GPU: lower, print the partition and the loop IR, compile the CUDA with
nvcc if present, and run the kernel in the CPU simulator at a small size.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import wsched as ws
from common import show_lowered
from wsched.timing import rel_error

D = 128
SCALE = 1.0 / math.sqrt(D)


@ws.fusion
def attention(q: ws.Tensor[ws.bf16, "B", "H", "S", D], k: ws.Tensor[ws.bf16, "B", "H", "T", D],
              v: ws.Tensor[ws.bf16, "B", "H", "T", D]):
    s = ws.causal_mask(ws.matmul(q, k.transpose(-1, -2)) * SCALE)
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


def inputs(B, H, S, device):
    return [torch.randn(B, H, S, D).to(torch.bfloat16).to(device) for _ in range(3)]


def on_gpu(B: int, H: int, S: int):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from wsched.timing import median_ms

    k = ws.compile(attention)
    print(f"schedule: {k.schedule.short()}   ptxas: {k.resources}")
    q, kk, v = inputs(B, H, S, "cuda")
    o, lse = k(q, kk, v)
    print(f"B{B} H{H} S{S} D{D} causal: relative error vs SDPA "
          f"{rel_error(o, F.scaled_dot_product_attention(q, kk, v, is_causal=True)):.2e}, LSE vs torch "
          f"{rel_error(lse, attention.reference(q, kk, v)[1]):.2e}")
    flops = 4 * B * H * S * S * D / 2
    t_ours = median_ms(lambda: k(q, kk, v))
    line = f"wsched {flops / t_ours / 1e9:.0f} TFLOP/s"
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def sdpa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        t = median_ms(sdpa)
        line += f"   SDPA {backend.name} {flops / t / 1e9:.0f} TFLOP/s (ratio {t / t_ours:.2f})"
    print(line)


def on_cpu():
    t0 = time.perf_counter()
    k = ws.compile(attention, build=False)
    print(f"lowered and emitted in {time.perf_counter() - t0:.2f} s\n")
    show_lowered(k)
    q, kk, v = inputs(1, 2, 200, "cpu")
    t0 = time.perf_counter()
    o, lse = k.simulate(q, kk, v, seed=0)
    ro, rlse = attention.reference(q, kk, v)
    print(f"simulated B1 H2 S200 D{D} causal in {time.perf_counter() - t0:.1f} s: relative error "
          f"O {rel_error(o, ro):.2e}, LSE {rel_error(lse, rlse):.2e}")
    assert rel_error(o, ro) < 1e-2 and rel_error(lse, rlse) < 1e-3, "simulated kernel does not match"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cpu", action="store_true", help="simulate even when a GPU is present")
    args = ap.parse_args()
    if torch.cuda.is_available() and not args.cpu:
        on_gpu(args.batch, args.heads, args.seq)
    else:
        on_cpu()


if __name__ == "__main__":
    main()
