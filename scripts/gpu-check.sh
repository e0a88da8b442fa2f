#!/usr/bin/env bash
# One device call: install, build every kernel the GPU tests need, run the GPU tests, then the
# benchmarks. Logs go to $OUT (the device tool brings them back). Carry .whl (lark).
set -uo pipefail
OUT="${OUT:-/tmp/wsched-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export PYTHONUNBUFFERED=1 WSCHED_CACHE_DIR=/tmp/wsched-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
what="${1:-all}"
if [ "$what" = all ] || [ "$what" = tests ]; then
  python3 scripts/prebuild.py 2>&1 | tee "$OUT/prebuild.log"
  timeout 400 python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 300 python3 benchmarks/matmul.py --iters 30 2>&1 | tee "$OUT/bench-matmul.log"
fi
