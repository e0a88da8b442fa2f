"""Compile every kernel the GPU tests and benchmarks use, in parallel, into the build cache."""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import wsched as ws  # noqa: E402
from fusions import linear_relu_residual, matmul, matmul_f16, mlp, scaled_silu_f32  # noqa: E402

VARIANTS = [(matmul, {}), (matmul_f16, {}), (mlp, {}), (linear_relu_residual, {}), (scaled_silu_f32, {}),
            (mlp, dict(stages=1)), (mlp, dict(stages=2)), (mlp, dict(stages=4, epilogue="direct")),
            (linear_relu_residual, dict(epilogue="direct"))]


def build(item):
    fusion, overrides = item
    t0 = time.time()
    try:
        k = ws.compile(fusion, build=True, **overrides)
        r = k.resources
        return f"{fusion.name} {overrides}: {time.time() - t0:.1f}s regs {r.registers} spills {r.spill_stores}/{r.spill_loads}"
    except Exception as e:  # report every failure, keep building the others
        return f"{fusion.name} {overrides}: FAILED {type(e).__name__}: {e}"


if __name__ == "__main__":
    from matmul import linear, matmul as bench_matmul

    with ThreadPoolExecutor(max_workers=8) as pool:
        for line in pool.map(build, VARIANTS + [(bench_matmul, {}), (linear, {})]):
            print(line, flush=True)
