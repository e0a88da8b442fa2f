// wsched device primitives: named barriers, register reallocation, warp election, role ids.
#pragma once

#include "common.cuh"

namespace wsp {

// bar.sync id, threads (named barrier; id >= 1 inside role branches, threads a multiple of 32)
WSP_DEVICE void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// bar.arrive id, threads (arrive without waiting; pairs with bar.sync by the other threads)
WSP_DEVICE void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// barrier.cluster.arrive.release + barrier.cluster.wait.acquire (every thread of every CTA of the
// cluster; makes barrier inits and smem writes before it visible to the peers)
WSP_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// setmaxnreg.inc.sync.aligned.u32 N (whole warpgroup; needs __launch_bounds__(threads, 1))
template <uint32_t N>
WSP_DEVICE void setmaxnreg_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: N must be a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}

// setmaxnreg.dec.sync.aligned.u32 N (whole warpgroup; needs __launch_bounds__(threads, 1))
template <uint32_t N>
WSP_DEVICE void setmaxnreg_dec() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: N must be a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}

// elect.sync _|p, 0xffffffff (true in exactly one lane of a fully active warp)
WSP_DEVICE bool elect_one() {
  uint32_t elected;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  elect.sync _|p, 0xffffffff;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(elected));
  return elected != 0;
}

// shfl.sync.idx of threadIdx.x / 128 from lane 0 (warp-uniform warpgroup index; 1-D blocks)
WSP_DEVICE uint32_t warpgroup_id() {
  return __shfl_sync(0xffffffffu, threadIdx.x / 128u, 0);
}

// shfl.sync.idx of (threadIdx.x / 32) % 4 from lane 0 (warp-uniform warp index within its warpgroup)
WSP_DEVICE uint32_t warp_id_in_warpgroup() {
  return __shfl_sync(0xffffffffu, (threadIdx.x / 32u) % 4u, 0);
}

}  // namespace wsp
