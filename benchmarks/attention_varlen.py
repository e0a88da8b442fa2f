"""Attention over packed sequences of different lengths (FlashAttention's varlen layout:
Q [total, H, D], offsets cu_seqlens) vs the varlen forwards torch ships (flash, cuDNN), timed
side by side in one run.

    python benchmarks/attention_varlen.py [--iters 20]

Lengths are drawn once per case from a fixed seed; queries and keys share the offsets (one
packed prefill), so causal is the same for every convention. A second table: packed chunks of
new tokens against paged caches (a serving engine's mixed batch) next to flash's paged varlen. TFLOP/s counts the visible
scores: 2 (D + Dv) per (query, key) pair a query sees. A backend that does not run a case prints
why and gets an empty column.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import make_varlen_attention, varlen_inputs  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402


# (sequences, lengths low..high, H, HK, D, causal)
CASES = [(8, (256, 4096), 16, 16, 128, True), (8, (256, 4096), 16, 16, 128, False),
         (32, (64, 1024), 32, 8, 128, True), (16, (128, 2048), 16, 16, 64, True)]


def flash(q, k, v, cu, longest, causal):
    scale = q.shape[-1] ** -0.5
    return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False,
                                                           scale=scale)[0]


def cudnn(q, k, v, cu, longest, causal):
    scale = q.shape[-1] ** -0.5
    return lambda: torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, 0.0, causal,
                                                           False, scale=scale)[0]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}")
    rows = []
    for b, (low, high), h, hk, d, causal in CASES:
        g = torch.Generator().manual_seed(b * 1000 + d)
        lens = torch.randint(low, high + 1, (b,), generator=g).tolist()
        gqa = hk != h
        f = make_varlen_attention(d, causal="bottom_right" if causal else False, lse=False, gqa=gqa)
        kernel = ws.compile(f)
        q, k, v, cu, _ = varlen_inputs(lens, lens, h, d, kv_heads=hk if gqa else None, seed=b, device="cuda")
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens) * h
        flops = 2 * (d + d) * pairs
        ours = median_ms(lambda: kernel(q, k, v, cu, cu), iters=args.iters)
        mine = kernel(q, k, v, cu, cu)
        # torch's varlen forwards take [total, heads, D]; a backend whose output differs from ours
        # (a layout it reads otherwise) is reported and left out, not timed as if it ran the case
        q3, k3, v3 = (x.reshape(x.shape[0], -1, d) for x in (q, k, v))
        ref, errors = {}, []
        for name, make in (("flash", flash), ("cuDNN", cudnn)):
            try:
                fn = make(q3, k3, v3, cu, max(lens), causal)
                err = rel_error(mine.reshape(q3.shape[0], -1, d), fn())
            except Exception as e:   # noqa: BLE001 - a backend that does not run it gets an empty column
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            errors.append(f"{name} {err:.1e}")
            if err < 2e-2:
                ref[name] = median_ms(fn, iters=args.iters)
            else:
                print(f"  {name}: its output differs from ours by {err:.1e} (relative): left out")
        tf = {name: flops / ms / 1e9 for name, ms in {"wsched": ours, **ref}.items()}
        label = f"B{b} H{h}{f'/{hk}' if gqa else ''} D{d} lengths {low}..{high} (total {sum(lens)})" + \
                (" causal" if causal else "")
        rows.append((label, tf))
        print(f"  {label}: ours vs {', '.join(errors) or 'no reference'} (relative error)", flush=True)
    print("\n| case | wsched TFLOP/s | flash varlen | cuDNN varlen | vs flash | vs cuDNN |")
    print("|---|---|---|---|---|---|")
    for label, tf in rows:
        cols = [f"{tf[n]:.0f}" if n in tf else "" for n in ("wsched", "flash", "cuDNN")]
        ratios = [f"{tf['wsched'] / tf[n]:.2f}" if n in tf else "" for n in ("flash", "cuDNN")]
        print(f"| {label} | " + " | ".join(cols + ratios) + " |")
    mixed_batches(args.iters)


def mixed_batches(iters: int) -> None:
    """Packed chunks of new tokens against paged caches (a serving engine's mixed batch) vs
    flash's varlen forward with a block table and seqused_k (pages of 256, its paged layout)."""
    from attention_fusions import make_varlen_paged_attention, varlen_paged_inputs

    print("\n| mixed batch (paged 256, causal bottom-right) | wsched TFLOP/s | flash varlen paged | vs flash |")
    print("|---|---|---|---|")
    for b, chunk, cache, hk, g in ((16, (1, 512), (1024, 8192), 8, 4), (64, (1, 64), (512, 4096), 8, 4)):
        gen = torch.Generator().manual_seed(b)
        q_lens = torch.randint(chunk[0], chunk[1] + 1, (b,), generator=gen).tolist()
        k_lens = [q + int(torch.randint(cache[0], cache[1] + 1, (1,), generator=gen)) for q in q_lens]
        f = make_varlen_paged_attention(128, 256, lse=False)
        kernel = ws.compile(f)
        q, k_cache, v_cache, table, cu_q, lens = varlen_paged_inputs(q_lens, k_lens, 256, 128, hk=hk, g=g, seed=b,
                                                                     device="cuda")
        pairs = sum(qn * (kn - qn) + qn * (qn + 1) // 2 for qn, kn in zip(q_lens, k_lens)) * hk * g
        flops = 4 * 128 * pairs
        ours = median_ms(lambda: kernel(q, k_cache, v_cache, table, cu_q, lens), iters=iters)
        mine = kernel(q, k_cache, v_cache, table, cu_q, lens)
        label = f"B{b} H{hk * g}/{hk} chunks {chunk[0]}..{chunk[1]}, caches +{cache[0]}..{cache[1]}"
        ref = ""
        try:
            q3 = q.reshape(q.shape[0], hk * g, 128)
            cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

            def fn():
                return torch.ops.aten._flash_attention_forward(
                    q3, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), 0.0, True, False, scale=128 ** -0.5,
                    seqused_k=lens, block_table=table)[0]
            err = rel_error(mine.reshape(q3.shape), fn())
            if err < 2e-2:
                ms = median_ms(fn, iters=iters)
                ref = f"{flops / ms / 1e9:.0f} | {ms / ours:.2f}"
            else:
                ref = f"differs by {err:.1e} | "
        except Exception as e:   # noqa: BLE001 - a backend that does not run it gets an empty column
            print(f"  flash paged: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            ref = " | "
        print(f"| {label} | {flops / ours / 1e9:.0f} | {ref} |", flush=True)


if __name__ == "__main__":
    main()
