"""Persistent warp-specialized matmul vs cuBLAS (torch.matmul), timed side by side in one run.

    python benchmarks/matmul.py [--iters 50] [--shapes 4096x4096x4096,...]
    python benchmarks/matmul.py --batched [--batched-shapes 8x512x512x512,...]

--batched times batched matmuls instead ([B, M, K] @ [B, K, N] next to torch.bmm, and a batched
linear layer [B, M, K] @ w.T with w [N, K] shared by every batch next to torch.matmul).

Prints TFLOP/s of both and our ratio to cuBLAS; every result is checked against torch first. A
shape whose rows TMA cannot read as they are (N or K no multiple of 8: a vocabulary of 50257)
times the whole call, which stages them through aligned copies, marked "(staged call)".
--schedule adds kernels of other schedules (e.g. 'mode=pingpong'); per shape, cuBLAS and every
kernel are timed back to back, --rounds times, so that clock drift over the run does not decide a
comparison.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import wsched as ws  # noqa: E402
from wsched.codegen.launch import TmaLayoutError  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024), (2048, 2048, 8192), (6144, 6144, 6144)]


@ws.fusion
def matmul(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)


@ws.fusion
def linear(a: ws.Tensor[ws.bf16, "M", "K"], w: ws.Tensor[ws.bf16, "N", "K"]):
    return ws.matmul(a, w.transpose(-1, -2)).to(ws.bf16)


@ws.fusion
def bmm(a: ws.Tensor[ws.bf16, "B", "M", "K"], b: ws.Tensor[ws.bf16, "B", "K", "N"]):
    return ws.matmul(a, b).to(ws.bf16)


@ws.fusion
def batched_linear(x: ws.Tensor[ws.bf16, "B", "M", "K"], w: ws.Tensor[ws.bf16, "N", "K"]):
    return ws.matmul(x, w.transpose(-1, -2)).to(ws.bf16)


# (kind, B, M, N, K): bmm rows against torch.bmm, linear rows against torch.matmul(x, w.t())
BATCHED = [("bmm", 8, 512, 512, 512), ("bmm", 16, 1024, 1024, 256), ("bmm", 4, 4096, 4096, 1024),
           ("linear", 4, 2048, 4096, 4096), ("linear", 8, 128, 4096, 4096)]


def run_batched(args) -> None:
    """Batched rows: ours and torch's in the same run, checked against torch first."""
    cases = [(kind, *(int(x) for x in dims.split("x"))) for kind, dims in
             (item.split(":") for item in args.batched_shapes.split(",") if item)] or BATCHED
    kernels = {"bmm": ws.compile(bmm), "linear": ws.compile(batched_linear)}
    for kind, k in kernels.items():
        res = k.resources
        print(f"# {kind}: {k.schedule.short()}  registers {res.registers}  spills {res.spill_stores}/{res.spill_loads}")
    rows = []
    for kind, B, M, N, K in cases:
        a = torch.randn(B, M, K, device="cuda", dtype=torch.bfloat16) / K ** 0.25
        if kind == "bmm":
            b = torch.randn(B, K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.25
            ref_fn, name = (lambda: torch.bmm(a, b)), "torch.bmm"
        else:
            b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.25
            ref_fn, name = (lambda: torch.matmul(a, b.t())), "torch.matmul"
        out = torch.full((B, M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        ours_fn = kernels[kind].bind(a, b, out={"out": out})
        ours_fn()
        torch.cuda.synchronize()
        err = rel_error(out, ref_fn())
        t_ref = median_ms(ref_fn, iters=args.iters)
        t_ours = median_ms(ours_fn, iters=args.iters)
        flops = 2 * B * M * N * K
        row = (kind, f"{B}x{M}x{N}x{K}", flops / t_ours / 1e9, name, flops / t_ref / 1e9, t_ref / t_ours, err)
        rows.append(row)
        print(f"{row[0]:>6} {row[1]:>20}  wsched {row[2]:7.1f} TFLOP/s  {row[3]} {row[4]:7.1f} TFLOP/s  "
              f"ratio {row[5]:.3f}  rel.err {row[6]:.1e}", flush=True)
    print("\n| kind | B×M×N×K | wsched TFLOP/s | reference | TFLOP/s | ratio |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]} | {r[4]:.0f} | {r[5]:.2f} |")


def parse_overrides(text: str) -> dict:
    """'stages=4,epilogue=direct,tile=128x128x64,cluster=2x1x1' -> schedule keyword overrides."""
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        if key in ("tile", "cluster"):
            out[key] = tuple(int(x) for x in value.split("x"))
        else:
            out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--layouts", default="kn,nk", help="kn: b is [K, N]; nk: b is [N, K] (a linear layer)")
    ap.add_argument("--schedule", action="append", default=[],
                    help="schedule overrides to compare, e.g. 'stages=4,epilogue=direct' (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="timings of each kernel per shape, interleaved (median)")
    ap.add_argument("--call-overhead", action="store_true", help="also time the whole Python call of the default")
    ap.add_argument("--batched", action="store_true", help="time batched matmuls (bmm, batched linear) instead")
    ap.add_argument("--batched-shapes", default="",
                    help="with --batched: kind:BxMxNxK,... (kind bmm or linear), e.g. bmm:8x512x512x512")
    args = ap.parse_args(argv)
    if args.batched:
        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}")
        return run_batched(args)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s] or SHAPES
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}")
    rows = []
    variants = [{}] + [parse_overrides(text) for text in args.schedule]
    for layout in args.layouts.split(","):
        fusion = matmul if layout == "kn" else linear
        kernels = []
        for overrides in variants:
            k = ws.compile(fusion, **overrides)
            res = k.resources
            name = f"{layout} {','.join(f'{a}={b}' for a, b in overrides.items())}" if overrides else layout
            kernels.append((name, k))
            print(f"# {name}: {k.schedule.short()}  registers {res.registers}  smem {k.kernel.smem_bytes}  "
                  f"spills {res.spill_stores}/{res.spill_loads}")
        for M, N, K in shapes:
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) / K ** 0.25
            kn = fusion is matmul
            b = torch.randn((K, N) if kn else (N, K), device="cuda", dtype=torch.bfloat16) / K ** 0.25
            ref_fn = (lambda: torch.matmul(a, b)) if kn else (lambda: torch.matmul(a, b.t()))
            flops = 2 * M * N * K
            # cuBLAS and every schedule of this shape back to back, `--rounds` times (the median
            # of each): clocks drift over a run, and a ratio compares timings taken together.
            fns, errs, timed = [ref_fn], [], []
            for name, k in kernels:
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    ours_fn = k.bind(a, b, out={"out": out})   # pre-bound arguments: time the kernel
                except TmaLayoutError:   # rows TMA cannot read (N or K no multiple of 8): the call
                    with warnings.catch_warnings():   # stages them; timed whole (copies and host work)
                        warnings.simplefilter("ignore")
                        k(a, b, out={"out": out})
                    ours_fn = functools.partial(k, a, b, out={"out": out})
                    name = f"{name} (staged call)"
                ours_fn()
                torch.cuda.synchronize()
                errs.append(rel_error(out, ref_fn()))
                fns.append(ours_fn)
                timed.append((name, k))
            times = [[] for _ in fns]
            for _ in range(args.rounds):
                for i, fn in enumerate(fns):
                    times[i].append(median_ms(fn, iters=args.iters))
            t_ref, *t_ours = (sorted(t)[len(t) // 2] for t in times)
            for (name, k), t, err in zip(timed, t_ours, errs):
                row = (name, f"{M}x{N}x{K}", flops / t / 1e9, flops / t_ref / 1e9, t_ref / t, err)
                rows.append(row)
                print(f"{row[0]:>3} {row[1]:>16}  wsched {row[2]:7.1f} TFLOP/s  cuBLAS {row[3]:7.1f} TFLOP/s  "
                      f"ratio {row[4]:.3f}  rel.err {row[5]:.1e}", flush=True)
            if args.call_overhead:
                # The whole Python call (bind, checks, cached maps, launch): the host overhead a
                # user pays on top of the kernel.
                name, k = kernels[0]
                t_call = median_ms(lambda: k(a, b, out={"out": out}), iters=args.iters)
                print(f"    {name} call overhead {(t_call - t_ours[0]) * 1e3:.0f} us", flush=True)
    print("\n| layout | M×N×K | wsched TFLOP/s | cuBLAS TFLOP/s | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.2f} |")


if __name__ == "__main__":
    main()
