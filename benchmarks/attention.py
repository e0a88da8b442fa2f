"""FMHA forward vs torch SDPA (cuDNN and flash backends), timed side by side in one run.

    python benchmarks/attention.py [--iters 30] [--dims 96,192]

Head dims 64, 96, 128, 256, and 192 for Q and K with 128 for V (MLA prefill), and at D128 a long
prefill (B1 S16384 causal) and a ragged length (B4 S2000 causal); FLOPs are
2 S T (D + Dv) per head (halved with a causal mask). A backend that does not take a case prints
why and gets an empty column.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import dims_text, make_attention  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402

from wsched.workloads.attention.schedule import VALUE_DIMS  # noqa: E402

# (B, H, Hkv, S, D, causal)
CASES = [(4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (8, 16, 16, 2048, 64, False),
         (4, 16, 16, 4096, 256, False), (16, 16, 16, 1024, 128, False), (4, 32, 8, 4096, 128, True),
         (4, 16, 16, 4096, 96, False), (4, 16, 16, 4096, 96, True),
         (4, 16, 16, 4096, 192, False), (4, 16, 16, 4096, 192, True),
         (1, 16, 16, 16384, 128, True),   # long prefill
         (4, 16, 16, 2000, 128, True)]    # ragged: 2000 is no multiple of a tile's rows or columns


def sdpa(backend, q, k, v, causal, gqa):
    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return fn


def main(argv=None):
    from matmul import parse_overrides

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--schedule", action="append", default=[],
                    help="extra schedule to compare for one head dim, e.g. '64:tile=128x192x64,stages=3'")
    ap.add_argument("--dims", default="", help="only the cases of these head dims, e.g. '96,192'")
    args = ap.parse_args(argv)
    dims = {int(d) for d in args.dims.split(",") if d}
    extra: dict[int, list[dict]] = {}
    for text in args.schedule:
        d, overrides = text.split(":", 1)
        extra.setdefault(int(d), []).append(parse_overrides(overrides))
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}")
    rows = []
    for B, H, HK, S, D, causal in CASES:
        if dims and D not in dims:
            continue
        gqa = HK != H
        dv = VALUE_DIMS[D]
        f = make_attention(D, causal=causal, gqa=gqa)
        k = ws.compile(f)
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        kk = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HK, S, dv, device="cuda", dtype=torch.bfloat16)
        ours_in = ((q.view(B, HK, H // HK, S, D), kk.view(B, HK, 1, S, D), v.view(B, HK, 1, S, dv)) if gqa
                   else (q, kk, v))
        ours = k.bind(*ours_in)   # pre-bound arguments: time the kernel
        out = ours.outputs
        ours()
        torch.cuda.synchronize()
        o = next(iter(out.values())).view(B, H, S, dv)
        flops = 2 * B * H * S * S * (D + dv) * (0.5 if causal else 1.0)
        row = [f"B{B} H{H}{'/' + str(HK) if gqa else ''} S{S} {dims_text(D).upper()}{' causal' if causal else ''}"]
        t_ours = median_ms(ours, iters=args.iters)
        t_call = median_ms(lambda: k(*ours_in, out=out), iters=args.iters)   # whole Python call
        row.append(flops / t_ours / 1e9)
        err = None
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            try:
                fn = sdpa(backend, q, kk, v, causal, gqa)
                ref = fn()
                err = rel_error(o, ref) if err is None else err
                row.append(flops / median_ms(fn, iters=args.iters) / 1e9)
            except RuntimeError as e:   # a backend that does not take this case
                print(f"  {backend.name}: {str(e).splitlines()[0][:100]}")
                row.append(float("nan"))
        row.append(err)
        row.append((t_call - t_ours) * 1e3)
        rows.append(row)
        shown_err = err if err is not None else float("nan")
        print(f"{row[0]:>28}  wsched {row[1]:6.1f}  cuDNN {row[2]:6.1f}  flash {row[3]:6.1f} TFLOP/s  "
              f"vs cuDNN {row[1] / row[2]:.2f}  vs flash {row[1] / row[3]:.2f}  rel.err {shown_err:.1e}  "
              f"call overhead {row[5]:.0f} us", flush=True)
        for overrides in extra.get(D, []):
            variant = ws.compile(f, **overrides)
            rows.append(time_variant(variant, f, B, H, HK, S, D, causal, gqa, args.iters, overrides))
    print("\n| case | wsched TFLOP/s | SDPA cuDNN | SDPA flash | vs cuDNN | vs flash |\n|---|---|---|---|---|---|")
    for r in rows:
        if r[4] is None:   # a schedule variant: our kernel only
            print(f"| {r[0].strip()} | {r[1]:.0f} | | | | |")
        else:
            print(f"| {r[0]} | {r[1]:.0f} | {r[2]:.0f} | {r[3]:.0f} | {r[1] / r[2]:.2f} | {r[1] / r[3]:.2f} |")


def time_variant(k, f, B, H, HK, S, D, causal, gqa, iters, overrides):
    """Our kernel alone with other schedule overrides (SDPA columns left empty)."""
    dv = VALUE_DIMS[D]
    q = torch.randn(B, HK, H // HK, S, D, device="cuda", dtype=torch.bfloat16) if gqa else \
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    kv_shape = (B, HK, 1, S) if gqa else (B, H, S)
    kk = torch.randn(*kv_shape, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(*kv_shape, dv, device="cuda", dtype=torch.bfloat16)
    t = median_ms(k.bind(q, kk, v), iters=iters)   # pre-bound arguments: time the kernel
    flops = 2 * B * H * S * S * (D + dv) * (0.5 if causal else 1.0)
    label = f"  variant {','.join(f'{a}={b}' for a, b in overrides.items())}"
    print(f"{label:>28}  wsched {flops / t / 1e9:6.1f} TFLOP/s  ({k.schedule.short()})", flush=True)
    return [label, flops / t / 1e9, float("nan"), float("nan"), None]


if __name__ == "__main__":
    main()
