#!/usr/bin/env bash
# One device call for the matmul schedule space (issue 9): install, build the kernels in parallel,
# the matmul GPU tests (sliced epilogues, split-K), the Llama-3-8B linear shapes with the default
# and `--schedule` variants next to cuBLAS, the square shapes, and (if asked) the fused epilogues.
#   scripts/gpu_matmul_space.sh [tests|bench|both] [extra schedule for the benchmarks, e.g. split_k=16]
set -uo pipefail
OUT="${OUT:-/tmp/wsched-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export PYTHONUNBUFFERED=1 WSCHED_CACHE_DIR=/tmp/wsched-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
what="${1:-both}"; variant="${2:-split_k=16}"
python3 - "$variant" <<'PY' 2>&1 | tee "$OUT/prebuild.log"
import sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path[:0] = ["tests", "benchmarks"]
import wsched as ws
from fusions import gated, linear_relu_residual, matmul, matmul_f16, mlp, scaled_silu_f32
from matmul import linear, matmul as bench_matmul, parse_overrides
extra = parse_overrides(sys.argv[1])
todo = [(f, {}) for f in (matmul, matmul_f16, mlp, linear_relu_residual, scaled_silu_f32, gated, bench_matmul, linear)]
todo += [(mlp, dict(stages=1)), (mlp, dict(stages=2)), (mlp, dict(stages=4, epilogue="direct")),
         (linear_relu_residual, dict(epilogue="direct")), (matmul, dict(split_k=16)), (gated, dict(split_k=16)),
         (bench_matmul, extra), (linear, extra)]
def build(item):
    f, o = item; t = time.time()
    try:
        r = ws.compile(f, build=True, **o).resources
        return f"{f.name} {o}: {time.time() - t:.1f}s regs {r.registers} spills {r.spill_stores}/{r.spill_loads}"
    except Exception as e:
        return f"{f.name} {o}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}"
with ThreadPoolExecutor(max_workers=16) as pool:
    for line in pool.map(build, todo):
        print(line, flush=True)
PY
if [ "$what" != bench ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_matmul.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-matmul.log" | tail -15
fi
if [ "$what" != tests ]; then
  timeout 150 python3 benchmarks/matmul_llm.py --models 8b,70b --ms 1,16,128,512 --iters 20 --schedule "$variant" 2>&1 | tee "$OUT/bench-llm.log" | grep -E "geomean|split_k" | tail -70
  timeout 50 python3 benchmarks/matmul.py --shapes 4096x4096x4096,8192x8192x8192 --layouts nk --iters 20 --schedule "$variant" 2>&1 | tee "$OUT/bench-squares.log" | tail -6
  timeout 90 python3 benchmarks/matmul_llm.py --epilogues --iters 20 2>&1 | tee "$OUT/bench-epilogues.log" | tail -4
fi
