"""What the autotuner buys over the default schedule, at the matmul benchmark's shapes.

    python benchmarks/autotune_gain.py [--iters 30] [--max-candidates 24] [--shapes 4096x4096x4096,...]

For each shape and B layout: a forced search (`ws.autotune.tune`, `max_candidates` keeps what
`ws.compile(fusion)` runs at that shape, the default schedule and the rest spread over the space,
that many in all), then the default (`ws.compile(fusion)`, its per-shape choice), the tuned
kernel and cuBLAS timed again side by side in this run (interleaved, median of `iters`), so the
ratio is not the search's own measurement. Prints the search time (the first search builds every
candidate with nvcc; later ones reuse the builds), tuned / default and tuned / cuBLAS per row, and
the lowest tuned / default ratio among rows whose winner is another kernel than the default's
(where it is the same kernel, the ratio is the timing's spread and is marked so).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import wsched as ws  # noqa: E402
from matmul import SHAPES, linear, matmul  # noqa: E402
from wsched.autotune import tune  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--max-candidates", type=int, default=24)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--layouts", default="kn,nk")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s] or SHAPES
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}, "
          f"search over at most {args.max_candidates} candidates")
    print(f"{'layout':6} {'M x N x K':>18} {'search s':>8} {'default':>9} {'tuned':>9} {'cuBLAS':>9} "
          f"{'tuned/def':>9} {'tuned/cuBLAS':>12}  winner")
    gains, same, searches = [], [], []
    for layout in args.layouts.split(","):
        fusion = matmul if layout == "kn" else linear
        for m, n, kk in shapes:
            a = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
            b = torch.randn((kk, n) if layout == "kn" else (n, kk), device="cuda", dtype=torch.bfloat16)
            result = tune(fusion, (a, b), max_candidates=args.max_candidates, force=True, progress=False)
            searches.append((result.seconds, len(result.times) + len(result.rejected)))
            default, tuned = ws.compile(fusion), ws.compile(fusion, result.schedule)
            is_default = default.kernel_for(a, b).schedule == result.schedule
            ref = a @ (b if layout == "kn" else b.t())
            for k in (default, tuned):
                out = k(a, b)
                err = rel_error(out, ref)
                if not err < 2e-2:
                    raise SystemExit(f"{layout} {m}x{n}x{kk}: {k.schedule.short()} is wrong (rel error {err:.3g})")
            # interleave the three so that clock drift hits each alike
            t = {"default": [], "tuned": [], "cublas": []}
            for _ in range(3):
                t["default"].append(median_ms(lambda: default(a, b), iters=args.iters))
                t["tuned"].append(median_ms(lambda: tuned(a, b), iters=args.iters))
                t["cublas"].append(median_ms(lambda: a @ (b if layout == "kn" else b.t()), iters=args.iters))
            ms = {name: sorted(v)[1] for name, v in t.items()}
            gain = ms["default"] / ms["tuned"]
            (same if is_default else gains).append(gain)
            print(f"{layout:6} {f'{m}x{n}x{kk}':>18} {result.seconds:8.1f} {ms['default']:9.4f} {ms['tuned']:9.4f} "
                  f"{ms['cublas']:9.4f} {gain:9.3f} {ms['cublas'] / ms['tuned']:12.3f}  {result.schedule.short()}"
                  + ("  (the default's own kernel)" if is_default else ""))
            sys.stdout.flush()
    print(f"# searches: {searches[0][1]} candidates each; the first (building them) took {searches[0][0]:.1f} s, "
          f"the longest {max(t for t, _ in searches):.1f} s")
    if gains:
        print(f"# winner another kernel: {len(gains)} rows, tuned/default lowest {min(gains):.3f}, highest {max(gains):.3f}")
    if same:
        print(f"# winner the default's own kernel: {len(same)} rows, timing spread {min(same):.3f}..{max(same):.3f}")
    # A second process reads the winners back without timing.
    t0 = time.perf_counter()
    again = tune(matmul, {"M": shapes[0][0], "N": shapes[0][1], "K": shapes[0][2]}, max_candidates=args.max_candidates,
                 progress=False)
    print(f"# cache read in this process: from_cache={again.from_cache} in {1e3 * (time.perf_counter() - t0):.1f} ms")


if __name__ == "__main__":
    main()
