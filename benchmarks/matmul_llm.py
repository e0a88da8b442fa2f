"""Matmul at the shapes of LLM inference and training, next to cuBLAS, in one run.

    python benchmarks/matmul_llm.py [--iters 30] [--models 8b,70b] [--ms 1,16,64,128,512,2048,8192]
    python benchmarks/matmul_llm.py --epilogues   # fused epilogues vs eager torch and Inductor

The linear layers of Llama-3-8B and -70B (fused qkv, o, fused gate/up, down) at token counts M,
in both B layouts (`nk`: weight [N, K] as nn.Linear stores it; `kn`: [K, N]). Per row: TFLOP/s
of ours and cuBLAS (`torch.matmul`) and the ratio; for M <= 16 (weight-read bound) also the
weight bytes per second as a fraction of what a plain `torch.sum` over 2 GiB reads in the same
run, beside what `torch.sum` over the weight alone reaches (a read of that size, launch and ramp
included). A geometric mean of the ratios closes the table. Every result is compared with torch and a
row whose relative error exceeds 1e-2 is marked WRONG.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from matmul import linear, matmul, parse_overrides  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402

# (N, K) of each projection; qkv and gate/up fused as serving stacks run them.
MODELS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
MS = (1, 16, 64, 128, 512, 2048, 8192)


@ws.fusion
def gated(a: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "K", "N"], g: ws.Tensor[ws.bf16, "M", "N"]):
    return (ws.silu(ws.matmul(a, w)) * g).to(ws.bf16)


@ws.fusion
def bias_gelu(a: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "K", "N"], bias: ws.Tensor[ws.bf16, "N"]):
    return ws.gelu(ws.matmul(a, w) + bias).to(ws.bf16)


def plain_read_bandwidth(iters: int) -> float:
    """Bytes per second a plain torch.sum over 2 GiB of bf16 reads on this GPU (the roof)."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    t = median_ms(lambda: x.sum(), iters=iters)
    del x
    return (2 << 30) / (t * 1e-3)


def llm_suite(args) -> None:
    roof = plain_read_bandwidth(args.iters)
    print(f"# plain read (torch.sum over 2 GiB): {roof / 1e12:.2f} TB/s")
    kernels = {"kn": ws.compile(matmul), "nk": ws.compile(linear)}
    # other schedules timed beside the default (--schedule split_k=16): their ratios to cuBLAS
    variants = {text: {"kn": ws.compile(matmul, **parse_overrides(text)), "nk": ws.compile(linear, **parse_overrides(text))}
                for text in args.schedule}
    rows = []
    for model in args.models.split(","):
        for proj, (N, K) in MODELS[model].items():
            for M in [int(m) for m in args.ms.split(",")]:
                for layout in args.layouts.split(","):
                    k = kernels[layout]
                    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) / K ** 0.25
                    b = torch.randn((K, N) if layout == "kn" else (N, K), device="cuda", dtype=torch.bfloat16) / K ** 0.25
                    ref_fn = (lambda: torch.matmul(a, b)) if layout == "kn" else (lambda: torch.matmul(a, b.t()))
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    ours_fn = k.bind(a, b, out={"out": out})   # bound once: time the kernel alone
                    ours_fn()
                    torch.cuda.synchronize()
                    err = rel_error(out, ref_fn())
                    t_ref = median_ms(ref_fn, iters=args.iters)
                    t_ours = median_ms(ours_fn, iters=args.iters)
                    flops = 2 * M * N * K
                    weight = N * K * 2
                    # a plain read of the weight's own bytes (torch.sum over it): what a read of this
                    # size reaches, launch and ramp included, beside the 2 GiB roof
                    t_read = median_ms(lambda: b.sum(), iters=args.iters) if M <= 16 else None
                    row = dict(case=f"{model} {proj} {layout}", shape=f"{M}x{N}x{K}", ours=flops / t_ours / 1e9,
                               ref=flops / t_ref / 1e9, ratio=t_ref / t_ours, err=err,
                               bw=(weight / (t_ours * 1e-3) / roof, weight / (t_ref * 1e-3) / roof,
                                   weight / (t_read * 1e-3) / roof) if M <= 16 else None,
                               variants={})
                    for text, ks in variants.items():
                        out.fill_(float("nan"))
                        fn = ks[layout].bind(a, b, out={"out": out})
                        fn()
                        torch.cuda.synchronize()
                        t = median_ms(fn, iters=args.iters)
                        row["variants"][text] = (t_ref / t, rel_error(out, ref_fn()), weight / (t * 1e-3) / roof)
                    rows.append(row)
                    bw = (f"  weight read {row['bw'][0]:.0%} / cuBLAS {row['bw'][1]:.0%} of plain read (a sum over "
                          f"the weight alone: {row['bw'][2]:.0%})") if row["bw"] else ""
                    more = "".join(f"  [{text}: ratio {r:.3f}{'' if e < 1e-2 else ' WRONG'}"
                                   f"{f', weight read {w:.0%}' if M <= 16 else ''}]"
                                   for text, (r, e, w) in row["variants"].items())
                    print(f"{row['case']:>18} {row['shape']:>18}  wsched {row['ours']:7.1f}  cuBLAS {row['ref']:7.1f} "
                          f"TFLOP/s  ratio {row['ratio']:.3f}  rel.err {err:.1e}{bw}"
                          f"{'  WRONG' if not err < 1e-2 else ''}{more}", flush=True)
    geo = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
    print("\n| case | M×N×K | wsched TFLOP/s | cuBLAS TFLOP/s | ratio | weight read (ours / cuBLAS / a sum over the "
          "weight, of plain read) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        bw = f"{r['bw'][0]:.0%} / {r['bw'][1]:.0%} / {r['bw'][2]:.0%}" if r["bw"] else ""
        print(f"| {r['case']} | {r['shape']} | {r['ours']:.0f} | {r['ref']:.0f} | {r['ratio']:.2f} | {bw} |")
    print(f"\ngeomean ratio to cuBLAS over {len(rows)} rows: {geo:.3f}; lowest {min(r['ratio'] for r in rows):.2f}")
    for text in variants:
        ratios = [r["variants"][text][0] for r in rows]
        print(f"geomean ratio to cuBLAS of [{text}]: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}; "
              f"lowest {min(ratios):.2f}")


def epilogue_suite(args) -> None:
    """Fused epilogues at M x N x K vs eager torch and torch.compile(max-autotune)."""
    M = N = K = args.size
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) / K ** 0.25
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.25
    extra = {"gated": torch.randn(M, N, device="cuda", dtype=torch.bfloat16),
             "bias_gelu": torch.randn(N, device="cuda", dtype=torch.bfloat16)}
    eager = {"gated": lambda a, w, g: (torch.nn.functional.silu(a @ w) * g),
             "bias_gelu": lambda a, w, bias: torch.nn.functional.gelu(a @ w + bias)}
    for name, fusion in (("gated", gated), ("bias_gelu", bias_gelu)):
        args_ = (a, w, extra[name])
        try:
            k = ws.compile(fusion)
        except Exception as e:  # a fusion we cannot build yet is a row, not a crash
            print(f"{name:>10} {M}x{N}x{K}  wsched FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        out = k(*args_)
        err = rel_error(out, fusion.reference(*args_))
        compiled = torch.compile(eager[name], mode="max-autotune-no-cudagraphs")
        compiled(*args_)
        flops = 2 * M * N * K
        t_ours = median_ms(lambda: k(*args_), iters=args.iters)
        t_eager = median_ms(lambda: eager[name](*args_), iters=args.iters)
        t_ind = median_ms(lambda: compiled(*args_), iters=args.iters)
        print(f"{name:>10} {M}x{N}x{K}  wsched {flops / t_ours / 1e9:6.1f}  eager {flops / t_eager / 1e9:6.1f}  "
              f"inductor {flops / t_ind / 1e9:6.1f} TFLOP/s  vs eager {t_eager / t_ours:.2f}  vs inductor "
              f"{t_ind / t_ours:.2f}  rel.err {err:.1e}{'  WRONG' if not err < 1e-2 else ''}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layouts", default="nk,kn")
    ap.add_argument("--epilogues", action="store_true", help="fused epilogues vs eager and Inductor instead")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--schedule", action="append", default=[],
                    help="schedule overrides timed beside the default, e.g. 'split_k=16' (repeatable)")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}")
    epilogue_suite(args) if args.epilogues else llm_suite(args)


if __name__ == "__main__":
    main()
