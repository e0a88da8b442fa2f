"""A paged GQA decode step written as a tensor DAG: 32 query heads share 8 KV heads, a few new
tokens per sequence attend to their sequence's keys in a paged K/V cache (bottom-right causal,
each sequence its own length), with the log-sum-exp.

The cache is [pages, 16, HK, D] (the vLLM / FlashInfer layout), a block table [B, max_pages]
names each sequence's pages, seq_lens [B] its length. `ws.compile` picks the decode kernel for
such calls: the 4 query heads of a KV head packed into the rows of one tile, the keys split
across CTAs where the tiles would leave SMs idle, each block's pages gathered by TMA. On a Hopper
GPU: run it on sequences of mixed lengths, check it against torch in fp32, and time it next to
SDPA's cuDNN and flash backends on the same keys in a contiguous cache. Without a GPU: lower the
kernel, print its loop IR, compile the CUDA with nvcc if present, and run it in the CPU
simulator on a small cache.
"""

from __future__ import annotations

import argparse

import torch

import wsched as ws
from common import show_lowered
from wsched.timing import rel_error

D, PAGE = 128, 16


@ws.fusion
def decode(q: ws.Tensor[ws.bf16, "B", "HK", "G", "S", D],
           k_cache: ws.Tensor[ws.bf16, "P", PAGE, "HK", D], v_cache: ws.Tensor[ws.bf16, "P", PAGE, "HK", D],
           block_table: ws.Tensor[ws.i32, "B", "MP"], seq_lens: ws.Tensor[ws.i32, "B"]):
    k, v = ws.paged(k_cache, block_table), ws.paged(v_cache, block_table)
    s = ws.key_lengths(ws.matmul(q, k.transpose(-1, -2)) * D ** -0.5, seq_lens)
    s = ws.causal_mask(s, align="bottom_right")
    return ws.matmul(ws.softmax(s, dim=-1), v).to(ws.bf16), ws.logsumexp(s, dim=-1)


def inputs(lens, HK, G, S, device, seed=0):
    """Q and a cache whose pages are shuffled: sequence b owns ceil(lens[b] / PAGE) random pages."""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // PAGE)) for n in lens]
    pages = torch.randperm(sum(need), generator=g).int()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = pages[sum(need[:b]):sum(need[:b]) + n]
    q = torch.randn((len(lens), HK, G, S, D), generator=g)
    caches = [torch.randn((sum(need), PAGE, HK, D), generator=g) for _ in range(2)]
    return [x.to(torch.bfloat16).to(device) for x in (q, *caches)] + [
        table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)]


def on_gpu(B: int, HK: int, G: int, S: int, T: int):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from wsched.timing import median_ms

    k = ws.compile(decode)
    lens = [max(S, T - 997 * b) for b in range(B)]              # sequences of mixed lengths
    args = inputs(lens, HK, G, S, "cuda")
    print(f"B{B} H{HK * G}/{HK} S{S} T{min(lens)}..{max(lens)} D{D}, pages of {PAGE}: kernel "
          f"{k.kernel_for(*args).schedule.short()}")
    o, lse = k(*args)
    ref_o, ref_lse = decode.reference(*args)
    print(f"relative error vs torch (fp32): O {rel_error(o, ref_o):.2e}, LSE {rel_error(lse, ref_lse):.2e}")
    # timing: every sequence T keys, ours on the pages, SDPA on the same keys in a contiguous cache
    args = inputs([T] * B, HK, G, S, "cuda", seed=1)
    q, k_cache, v_cache, table, _ = args
    kv_bytes = 2 * B * HK * T * D * 2
    t_ours = median_ms(k.bind(*args))
    line = f"wsched {t_ours * 1e3:.1f} us ({kv_bytes / t_ours / 1e6:.0f} GB/s of K/V)"
    qs = q.reshape(B, HK * G, S, D)
    ks, vs = (c[table.long()].reshape(B, -1, HK, D)[:, :T].transpose(1, 2).contiguous() for c in (k_cache, v_cache))
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


def on_cpu(HK: int, G: int, S: int):
    schedule = ws.schedule_for(decode, tile=(64, 128, D), consumer_warpgroups=1, split_kv=32, pack_gqa=True)
    k = ws.compile(decode, schedule, build=False)
    show_lowered(k)
    lens = [2100, 37, 0]   # 17 kv blocks: 2 splits (6 tiles on 16 SMs); a short sequence; an empty one
    args = inputs(lens, HK, G, S, "cpu")
    o, lse = k.simulate(*args, num_sms=16)
    ref_o, ref_lse = decode.reference(*args)
    seen = lse.isfinite()     # the empty sequence: O = 0, LSE = -inf (torch's softmax gives 0 / 0 there)
    err_o, err_lse = rel_error(o[seen], ref_o[seen]), rel_error(lse[seen], ref_lse[seen])
    print(f"simulated lengths {lens}, H{HK * G}/{HK} S{S} on 16 SMs: relative error vs torch O {err_o:.2e}, "
          f"LSE {err_lse:.2e}; the empty sequence's O is {'0' if (o[~seen] == 0).all() else 'not 0'}")
    assert torch.equal(seen, ref_lse.isfinite()) and (o[~seen] == 0).all(), "sequences with no key differ"
    assert err_o < 1e-2 and err_lse < 1e-3, "simulated kernel does not match"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--queries", type=int, default=1, help="new tokens per sequence (S)")
    ap.add_argument("--keys", type=int, default=8192, help="longest sequence (T)")
    ap.add_argument("--cpu", action="store_true", help="simulate even when a GPU is present")
    args = ap.parse_args(argv)
    if torch.cuda.is_available() and not args.cpu:
        on_gpu(args.batch, args.kv_heads, args.groups, args.queries, args.keys)
    else:
        on_cpu(2, args.groups, min(args.queries, 4))


if __name__ == "__main__":
    main()
