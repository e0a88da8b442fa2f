set -uo pipefail
OUT="${OUT:-/tmp/wsched-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export PYTHONUNBUFFERED=1 WSCHED_CACHE_DIR=/tmp/wsched-cache
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_matmul.py tests/test_gpu_torch_ops.py -p no:cacheprovider 2>&1 | tail -2
timeout 300 python3 benchmarks/matmul_llm.py --iters 20 2>&1 | tee $OUT/bench-matmul-llm.log | tail -2
