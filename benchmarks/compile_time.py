"""Compile-side timings: lowering, CUDA emission, a cold nvcc build, a warm cache hit, parsing the
printed IR, and simulating a 256x256x256 matmul on the CPU. Runs without a GPU.

    python benchmarks/compile_time.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import make_attention  # noqa: E402
from fusions import inputs_for, mlp  # noqa: E402
from wsched.codegen.build import compile_cuda  # noqa: E402
from wsched.codegen.emit import emit_kernel  # noqa: E402
from wsched.lowering.parser import parse_kernel  # noqa: E402


def best_of(fn, n=5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    rows = []
    for name, fusion in (("mlp (matmul + bias + gelu)", mlp), ("attention d128 causal + lse", make_attention(128, True, True))):
        lower = best_of(lambda: ws.lower(fusion))
        kernel = ws.lower(fusion)
        emit = best_of(lambda: emit_kernel(kernel))
        text = str(kernel)
        parse = best_of(lambda: parse_kernel(text))
        source = emit_kernel(kernel).source
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            compile_cuda(source, name=kernel.name, cache_dir=cache)
            cold = time.perf_counter() - t0
            hits = [best_of(lambda: compile_cuda(source, name=kernel.name, cache_dir=cache), 1) for _ in range(20)]
        rows.append((name, lower, emit, parse, len(text.splitlines()), cold, statistics.median(hits)))
    k = ws.compile(mlp, build=False)
    inputs = inputs_for(mlp, 256, 256, 256)
    t0 = time.perf_counter()
    out = k.simulate(*inputs)
    sim = time.perf_counter() - t0
    assert not torch.isnan(out.float()).any()
    print("| kernel | lower | emit | parse IR (lines) | nvcc cold | cache hit |\n|---|---|---|---|---|---|")
    for name, lower, emit, parse, lines, cold, hit in rows:
        print(f"| {name} | {lower * 1e3:.0f} ms | {emit * 1e3:.0f} ms | {parse * 1e3:.0f} ms ({lines}) | "
              f"{cold:.1f} s | {hit * 1e3:.1f} ms |")
    print(f"\nsimulator: 256x256x256 mlp (128x256x64 tiles, 2 consumer warpgroups) in {sim:.2f} s")


if __name__ == "__main__":
    main()
