// wsched device helpers: the register-tile fragment layout (the wgmma accumulator layout).
// Thread t of a warpgroup (warp w = t / 32, lane l) holds element d[4j + 2i + c] of a [64, N]
// tile at row frag_row() + 8i, column frag_col() + 8j + c; 16-bit tiles hold the c = 0, 1
// elements as one packed pair. The generated kernels loop over (j, i) with these as the origin.
#pragma once

#include "common.cuh"

namespace wsp {

// (no PTX) row of this thread's first fragment element: 16 * warp + lane / 4
WSP_DEVICE int frag_row() { return 16 * ((threadIdx.x % 128) / 32) + (threadIdx.x % 32) / 4; }

// (no PTX) column of this thread's first fragment element: 2 * (lane % 4)
WSP_DEVICE int frag_col() { return 2 * (threadIdx.x % 4); }

// (no PTX) a linear tile (docs/ir.md, "Linear tiles"): the row of this thread's elements, thread
// t of the warpgroup holding row t / threads_per_row, and the column of its first element, its
// `per_thread` consecutive elements from (t % threads_per_row) * per_thread. Ints, as frag_row()
// is: threadIdx.x is unsigned, and a row offset below 0 (S - T) added to it would wrap.
WSP_DEVICE int linear_row(int threads_per_row) { return static_cast<int>(threadIdx.x % 128) / threads_per_row; }
WSP_DEVICE int linear_col(int threads_per_row, int per_thread) {
  return static_cast<int>(threadIdx.x % 128) % threads_per_row * per_thread;
}

// (no PTX) the row of the 16-byte row address this lane gives `stmatrix .x4` storing the 16 x 16
// block of fragment pairs (i, j), (1, j), (0, j + 1), (1, j + 1): row lane % 8 of matrix lane / 8
WSP_DEVICE int stmatrix_row() { return 16 * ((threadIdx.x % 128) / 32) + threadIdx.x % 8 + 8 * ((threadIdx.x / 8) % 2); }

// (no PTX) which of the two column blocks j, j + 1 this lane's stmatrix row address is in
WSP_DEVICE int stmatrix_half() { return (threadIdx.x / 16) % 2; }

// (no instruction) empty asm on every packed 16-bit pair of a fragment (a register wgmma A
// operand), so the compiler cannot move its reads/writes across wgmma issue/wait
// (wsp::warpgroup_fence_array does the same for float fragments)
template <typename T2, int N>
WSP_DEVICE void fence_packed(T2 (&d)[N]) {
  static_assert(sizeof(T2) == 4, "packed 16-bit pairs");
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&d[i])) :: "memory");
}

}  // namespace wsp
