"""A GQA decode step written as a tensor DAG: 32 query heads share 8 KV heads, a few new tokens
per sequence attend to a K/V cache (bottom-right causal), with the log-sum-exp.

`ws.compile` picks the decode kernel for such calls: the 4 query heads of a KV head packed into
the rows of one tile, the keys split across CTAs where the tiles would leave SMs idle, the
splits' partial results merged in the kernel. On a Hopper GPU: run it, check it against torch in
fp32, and time it next to SDPA's cuDNN and flash backends. Without a GPU: lower the decode
kernel, print its loop IR, compile the CUDA with nvcc if present, and run it in the CPU
simulator on a small cache.
"""

from __future__ import annotations

import argparse
import shutil

import torch

import wsched as ws
from wsched.timing import rel_error

D = 128


@ws.fusion
def decode(q: ws.Tensor[ws.bf16, "B", "HK", "G", "S", D], k: ws.Tensor[ws.bf16, "B", "HK", 1, "T", D],
           v: ws.Tensor[ws.bf16, "B", "HK", 1, "T", D]):
    s = ws.causal_mask(ws.matmul(q, k.transpose(-1, -2)) * D ** -0.5, align="bottom_right")
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


def inputs(B, HK, G, S, T, device):
    g = torch.Generator().manual_seed(0)
    shapes = [(B, HK, G, S, D), (B, HK, 1, T, D), (B, HK, 1, T, D)]
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for shape in shapes]


def on_gpu(B: int, HK: int, G: int, S: int, T: int):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from wsched.timing import median_ms

    k = ws.compile(decode)
    q, kk, v = inputs(B, HK, G, S, T, "cuda")
    print(f"B{B} H{HK * G}/{HK} S{S} T{T} D{D}: kernel {k.kernel_for(q, kk, v).schedule.short()}")
    o, lse = k(q, kk, v)
    ref_o, ref_lse = decode.reference(q, kk, v)
    print(f"relative error vs torch (fp32): O {rel_error(o, ref_o):.2e}, LSE {rel_error(lse, ref_lse):.2e}")
    kv_bytes = 2 * B * HK * T * D * 2
    bound = k.bind(q, kk, v)
    t_ours = median_ms(bound)
    line = f"wsched {t_ours * 1e3:.1f} us ({kv_bytes / t_ours / 1e9:.0f} GB/s of K/V)"
    qs, ks, vs = q.reshape(B, HK * G, S, D), kk.reshape(B, HK, T, D), v.reshape(B, HK, T, D)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def sdpa():
            with sdpa_kernel(backend):
                # bottom-right causal for S > 1 is not SDPA's is_causal (top-left): time S = 1 without it
                return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
        try:
            t = median_ms(sdpa)
            line += f"   SDPA {backend.name} {t * 1e3:.1f} us (ratio {t / t_ours:.2f})"
        except RuntimeError as error:
            line += f"   SDPA {backend.name}: {str(error).splitlines()[0][:60]}"
    print(line)


def on_cpu(B: int, HK: int, G: int, S: int, T: int):
    schedule = ws.schedule_for(decode, tile=(64, 128, D), consumer_warpgroups=1, split_kv=32, pack_gqa=True)
    k = ws.compile(decode, schedule, build=False)
    print(k.partition)
    print(k.ir)
    if shutil.which("nvcc"):
        build = k.compile_cuda()
        print(f"nvcc: {build.cu_path}  {k.resources}  (cache {'hit' if build.cache_hit else 'miss'})")
    else:
        print("nvcc not found: skipping the sm_90a build")
    q, kk, v = inputs(B, HK, G, S, T, "cpu")
    o, lse = k.simulate(q, kk, v, num_sms=8)
    ref_o, ref_lse = decode.reference(q, kk, v)
    print(f"simulated B{B} H{HK * G}/{HK} S{S} T{T} on 8 SMs: relative error vs torch O {rel_error(o, ref_o):.2e}, "
          f"LSE {rel_error(lse, ref_lse):.2e}")
    assert rel_error(o, ref_o) < 1e-2 and rel_error(lse, ref_lse) < 1e-3, "simulated kernel does not match"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--queries", type=int, default=1, help="new tokens per sequence (S)")
    ap.add_argument("--keys", type=int, default=8192, help="cache length (T)")
    ap.add_argument("--cpu", action="store_true", help="simulate even when a GPU is present")
    args = ap.parse_args(argv)
    if torch.cuda.is_available() and not args.cpu:
        on_gpu(args.batch, args.kv_heads, args.groups, args.queries, args.keys)
    else:
        on_cpu(1, 2, args.groups, min(args.queries, 4), 2100)   # 17 kv blocks: 2 splits on 8 SMs


if __name__ == "__main__":
    main()
