"""The spans table of a kernel's `spans` parameter (ir.SpanParam), computed on the GPU per call
by one small CUDA kernel, `wsched_block_spans`, built once through the build cache.

`lowering/block_spans.py` defines the table (the simulator computes it there, with torch); this
kernel computes the same table in one launch, where the dozen torch ops of that definition
would cost a call some 60 us of host time. tests/test_gpu_attention.py checks the two agree.

One CTA of 256 threads per (batch index, block of `rows` query rows): the block's id range by a
block-wide min / max, then each warp takes every 8th block of `cols` keys, its range by a
warp-wide min / max, and keeps the first and last key block whose range meets the rows' range,
and the first, last and number of the blocks that hold the rows' one id only.
Batch dims (up to MAX_BATCH_DIMS) are decoded from the CTA index; the ids' strides are passed,
0 along a dim they broadcast over, so no id tensor is copied.
"""

from __future__ import annotations

import threading

import torch

KERNEL = "wsched_block_spans"
THREADS = 256
MAX_BATCH_DIMS = 4

SOURCE = f"#define WARPS {THREADS // 32}\n" + r"""
// wsched_block_spans: the table of a `spans` kernel parameter (codegen/block_spans.py; the
// definition, which the simulator runs: lowering/block_spans.py).
#include <climits>

__device__ __forceinline__ int warp_min(int v) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_max(int v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// (min over the CTA of lo, max over the CTA of hi), to every thread
__device__ __forceinline__ void block_min_max(int& lo, int& hi, int (*scratch)[WARPS]) {
    lo = warp_min(lo);
    hi = warp_max(hi);
    const int warp = threadIdx.x >> 5;
    __syncthreads();   // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) { scratch[0][warp] = lo; scratch[1][warp] = hi; }
    __syncthreads();
    lo = scratch[0][0];
    hi = scratch[1][0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
        lo = min(lo, scratch[0][w]);
        hi = max(hi, scratch[1][w]);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) wsched_block_spans(
        const int* __restrict__ q, const int* __restrict__ k, int* __restrict__ table,
        int S, int T, int rows, int cols, int row_blocks, int key_blocks,
        int d1, int d2, int d3,
        int qs0, int qs1, int qs2, int qs3, int q_row,
        int ks0, int ks1, int ks2, int ks3, int k_col) {
    __shared__ int scratch[2][WARPS];
    const int x = blockIdx.x;
    const int r = x % row_blocks;
    int b = x / row_blocks;
    const int c3 = b % d3; b /= d3;
    const int c2 = b % d2; b /= d2;
    const int c1 = b % d1;
    const int c0 = b / d1;
    const int* qb = q + (long long)c0 * qs0 + (long long)c1 * qs1 + (long long)c2 * qs2 + (long long)c3 * qs3;
    const int* kb = k + (long long)c0 * ks0 + (long long)c1 * ks1 + (long long)c2 * ks2 + (long long)c3 * ks3;

    int q_lo = INT_MAX, q_hi = INT_MIN;
    const int row_end = min(S, r * rows + rows);
    for (int i = r * rows + threadIdx.x; i < row_end; i += WARPS * 32) {
        const int v = qb[(long long)i * q_row];
        q_lo = min(q_lo, v);
        q_hi = max(q_hi, v);
    }
    block_min_max(q_lo, q_hi, scratch);

    int first = INT_MAX, last = INT_MIN, full_first = INT_MAX, full_last = INT_MIN, fulls = 0;
    const int lane = threadIdx.x & 31;
    // unrolled: a warp's loads of two blocks (each lane's four ids of a block of 128) in flight
    // at once; the loop is latency-bound, not bandwidth-bound
#pragma unroll 2
    for (int c = threadIdx.x >> 5; c < key_blocks; c += WARPS) {
        int k_lo = INT_MAX, k_hi = INT_MIN;
        const int key_end = min(T, c * cols + cols);
#pragma unroll 4
        for (int j = c * cols + lane; j < key_end; j += 32) {
            const int v = kb[(long long)j * k_col];
            k_lo = min(k_lo, v);
            k_hi = max(k_hi, v);
        }
        k_lo = warp_min(k_lo);
        k_hi = warp_max(k_hi);
        if (k_lo <= q_hi && q_lo <= k_hi) {
            first = min(first, c);
            last = max(last, c);
        }
        if (q_lo == q_hi && k_lo == k_hi && q_lo == k_lo) {   // every id of both blocks the same
            full_first = min(full_first, c);
            full_last = max(full_last, c);
            fulls += lane == 0;
        }
    }
    block_min_max(first, last, scratch);
    block_min_max(full_first, full_last, scratch);
    __syncthreads();   // the full blocks counted: each warp's lane 0 holds its warp's count
    if (lane == 0) scratch[0][threadIdx.x >> 5] = fulls;
    __syncthreads();
    fulls = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) fulls += scratch[0][w];
    if (threadIdx.x == 0) {
        const int count = last >= first ? last - first + 1 : 0;
        int full_count = full_last >= full_first ? full_last - full_first + 1 : 0;
        if (full_count != fulls) full_count = 0;   // not one run
        int4 entry = make_int4(count > 0 ? first : 0, count, full_count > 0 ? full_first : 0, full_count);
        reinterpret_cast<int4*>(table)[x] = entry;
    }
}
"""

_lock = threading.Lock()
_kernel = None


def _loaded():
    """The helper kernel, built (through the build cache) and wrapped on first use."""
    global _kernel
    with _lock:
        if _kernel is None:
            from .build import compile_cuda
            from .launch import LoadedKernel

            result = compile_cuda(SOURCE, name=KERNEL)
            _kernel = LoadedKernel(result.cubin_path, KERNEL, 0, THREADS)
    return _kernel


def _batch_strides(ids: torch.Tensor, batch: tuple[int, ...]) -> list[int]:
    """The strides of `ids`' batch dims (all but its last two), right-aligned to MAX_BATCH_DIMS
    table dims: 0 where the ids have extent 1 or no such dim (they broadcast along it)."""
    dims = ids.shape[:-2]
    strides = [0] * MAX_BATCH_DIMS
    for i in range(1, len(dims) + 1):
        if dims[-i] != 1:
            strides[-i] = ids.stride(len(dims) - i)
    return strides


class SpansLaunch:
    """The helper's launch for one layout of the ids (shapes and strides) and one table shape:
    the arguments packed once, the three pointers set per call (under a lock: one packed buffer
    for every thread), launched on the current stream of the ids' device."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, rows: int, cols: int, shape: tuple[int, ...]):
        from .launch import PackedArguments

        self.shape = tuple(shape)
        batch = self.shape[:-2]
        if len(batch) > MAX_BATCH_DIMS:
            raise ValueError(f"a spans table has at most {MAX_BATCH_DIMS} batch dims, got shape {list(shape)}")
        S, T = query.shape[-2], key.shape[-1]
        row_blocks, key_blocks = self.shape[-2], -(-T // cols)
        self.ctas = 0 if S == 0 or T == 0 else torch.Size(self.shape).numel() // 4
        d = (1,) * (MAX_BATCH_DIMS - len(batch)) + batch
        args = [("ptr", 0), ("ptr", 0), ("ptr", 0)]
        args += [("i32", v) for v in (S, T, rows, cols, row_blocks, key_blocks, d[1], d[2], d[3])]
        args += [("i32", v) for v in _batch_strides(query, batch)] + [("i32", query.stride(-2))]
        args += [("i32", v) for v in _batch_strides(key, batch)] + [("i32", key.stride(-1))]
        self._packed = PackedArguments(args)
        self._lock = threading.Lock()

    def raw(self) -> list[bytes]:
        """The packed arguments' bytes (the three pointers zero): what the native launch path
        repeats (codegen/native.py), setting the pointers per call."""
        with self._lock:
            for position in range(3):
                self._packed.set_pointer(position, 0)
            return self._packed.raw()

    def __call__(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        table = torch.empty(self.shape, dtype=torch.int32, device=query.device)
        if self.ctas == 0:
            return table.zero_()
        kernel = _loaded()
        with self._lock:
            for position, tensor in enumerate((query, key, table)):
                self._packed.set_pointer(position, tensor.data_ptr())
            kernel.launch_packed(self.ctas, self._packed, query.device.index)
        return table


def block_spans_cuda(query: torch.Tensor, key: torch.Tensor, rows: int, cols: int,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """`lowering.block_spans.block_spans` of CUDA i32 ids, by one launch on the current stream."""
    return SpansLaunch(query, key, rows, cols, shape)(query, key)
