#!/usr/bin/env bash
# One device call: install, build every kernel the GPU tests need (in parallel), run the GPU
# tests, then the benchmarks. Logs go to $OUT (the device tool brings them back). Carry .whl.
#   scripts/gpu-check.sh [all|matmul|attention] [tests|bench|both]
set -uo pipefail
OUT="${OUT:-/tmp/wsched-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export PYTHONUNBUFFERED=1 WSCHED_CACHE_DIR=/tmp/wsched-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
which="${1:-all}"; what="${2:-both}"
python3 scripts/prebuild.py "$which" 2>&1 | tee "$OUT/prebuild-$which.log" | grep -i "failed\|spills [1-9]"
if [ "$which" != matmul ]; then   # the score-function kernels of the GPU tests and the variant benchmark
  timeout 300 python3 benchmarks/attention_variants.py --prebuild > "$OUT/prebuild-attention-variants.log" 2>&1
  grep -i "failed" "$OUT/prebuild-attention-variants.log" | head -5
fi
if [ "$what" != bench ]; then
  case "$which" in matmul) files=tests/test_gpu_matmul.py;; attention) files="tests/test_gpu_attention.py tests/test_gpu_attention_decode.py tests/test_gpu_attention_paged.py tests/test_gpu_attention_varlen.py";; *) files=tests/;; esac
  timeout 480 python3 -m pytest -q -m gpu $files -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu-tests-$which.log" | tail -25
fi
if [ "$what" != tests ]; then
  if [ "$which" != attention ]; then
    timeout 240 python3 benchmarks/matmul.py --iters 30 2>&1 | tee "$OUT/bench-matmul.log"
    timeout 60 python3 benchmarks/matmul.py --batched --iters 30 2>&1 | tee "$OUT/bench-matmul-batched.log"
    timeout 300 python3 benchmarks/matmul_llm.py --iters 20 2>&1 | tee "$OUT/bench-matmul-llm.log" | tail -3
    timeout 120 python3 benchmarks/matmul_llm.py --epilogues --iters 20 2>&1 | tee "$OUT/bench-matmul-epilogues.log" | grep wsched
  fi
  if [ "$which" != matmul ]; then
    timeout 240 python3 benchmarks/attention.py --iters 20 2>&1 | tee "$OUT/bench-attention.log"
    timeout 240 python3 benchmarks/attention_variants.py --iters 20 2>&1 | tee "$OUT/bench-attention-variants.log"
    timeout 180 python3 benchmarks/decode.py --s 1,4 2>&1 | tee "$OUT/bench-decode.log" | grep -v "^  efficient:"
    timeout 120 python3 benchmarks/attention_varlen.py --iters 20 2>&1 | tee "$OUT/bench-attention-varlen.log"
  fi
fi
