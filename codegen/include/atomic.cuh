// wsched device primitives: GPU-scope fences and atomics (split-K's tickets).
#pragma once

#include "common.cuh"

namespace wsp {

// fence.acq_rel.gpu (orders this thread's accesses before it with those after it, GPU scope)
WSP_DEVICE void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// atom.global.inc.u32 (relaxed, GPU scope): *p = (old >= wrap) ? 0 : old + 1; returns old
WSP_DEVICE int atomic_inc(int* p, int wrap) {
  uint32_t old;
  asm volatile("atom.global.inc.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(wrap) : "memory");
  return static_cast<int>(old);
}

}  // namespace wsp
