"""Compile every kernel the GPU tests and benchmarks use, in parallel, into the build cache."""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import wsched as ws  # noqa: E402
from attention_fusions import (make_attention, make_paged_attention, make_varlen_attention,  # noqa: E402
                               make_varlen_paged_attention)
from fusions import gated, linear_relu_residual, matmul, matmul_f16, mlp, scaled_silu_f32  # noqa: E402

VARIANTS = [(matmul, {}), (matmul_f16, {}), (mlp, {}), (linear_relu_residual, {}), (scaled_silu_f32, {}), (gated, {}),
            (matmul, dict(split_k=16)), (gated, dict(split_k=16)),
            (mlp, dict(stages=1)), (mlp, dict(stages=2)), (mlp, dict(stages=4, epilogue="direct")),
            (linear_relu_residual, dict(epilogue="direct")),
            (matmul, dict(mode="pingpong")), (matmul, dict(mode="pingpong", tile=(64, 256, 64))),
            (matmul, dict(tile=(256, 128, 64))), (gated, dict(tile=(256, 128, 64))),
            (scaled_silu_f32, dict(tile=(256, 128, 64))),
            (matmul, dict(mode="pingpong", mma_inflight=0)), (gated, dict(mode="pingpong")),
            (linear_relu_residual, dict(mode="pingpong", epilogue="direct"))]
ATTENTION = ([(make_attention(d, causal=c, lse=True), {}) for d in (64, 128, 256) for c in (False, True)]
             + [(make_attention(d, causal=c), {}) for d, c in ((128, False), (128, True), (64, False), (256, False))]
             + [(make_attention(128, causal=True, gqa=True), {}), (make_attention(64, causal=True, dtype=ws.f16), {}),
                (make_attention(128, causal="bottom_right", lse=True), {})]
             + [(make_attention(d, causal="bottom_right", lse=True, gqa=True), {}) for d in (64, 128)]
             + [(make_attention(64, causal="bottom_right", lse=True), {})]
             # tests/test_gpu_attention_paged.py
             + [(make_paged_attention(128, p, causal=True, lse=True), {}) for p in (16, 64, 256)]
             + [(make_paged_attention(64, 16, lse=True), {})]
             # tests/test_gpu_attention_varlen.py and benchmarks/attention_varlen.py
             + [(make_varlen_attention(d, causal=c), {}) for d, c in ((128, False), (128, True), (128, "bottom_right"),
                                                                      (64, True), (96, True), (256, True))]
             + [(make_varlen_attention(128, causal="bottom_right", gqa=True), {})]
             + [(make_varlen_attention(d, causal=c, lse=False, gqa=g), {})
                for d, c, g in ((128, "bottom_right", False), (128, False, False), (128, "bottom_right", True),
                                (64, "bottom_right", False))]
             + [(make_varlen_paged_attention(128, p), {}) for p in (16, 256, None)])


def build(item):
    from wsched.kernel import build_without_spills

    fusion, overrides = item
    t0 = time.time()
    try:
        k = ws.compile(fusion, build=True, **overrides)
        for variant in getattr(k, "variants", ()):     # a per-shape choice: build its variants too
            build_without_spills(fusion, variant.schedule, build=True)   # as ws.compile builds them
        r = k.resources
        return f"{fusion.name} {overrides}: {time.time() - t0:.1f}s regs {r.registers} spills {r.spill_stores}/{r.spill_loads}"
    except Exception as e:  # report every failure, keep building the others
        return f"{fusion.name} {overrides}: FAILED {type(e).__name__}: {e}"


if __name__ == "__main__":
    from matmul import batched_linear as bench_batched_linear, bmm as bench_bmm, linear, matmul as bench_matmul
    from test_batched_matmul import batched_linear, bmm, broadcast_b, shared_a, three_batch_dims

    with ThreadPoolExecutor(max_workers=16) as pool:
        which = sys.argv[1] if len(sys.argv) > 1 else "all"
        batched = [(f, {}) for f in (bmm, batched_linear, broadcast_b, shared_a, three_batch_dims, bench_bmm,
                                     bench_batched_linear)]
        todo = (VARIANTS + batched + [(bench_matmul, {}), (linear, {})] if which in ("all", "matmul") else []) + \
               (ATTENTION if which in ("all", "attention") else [])
        for line in pool.map(build, todo):
            print(line, flush=True)
