// wsched device helpers: integer arithmetic and raw-bit reinterpretation for generated kernels.
#pragma once

#include <cstring>  // memcpy

#include "common.cuh"

namespace wsp {

// (no PTX) ceil(a / b) for a >= 0, b > 0: tile counts in the IR's `ceil_div(x, y)`
WSP_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }

// (no PTX) the number of bits of x >= 0 (0 for 0, 3 for 5): the IR's `bit_length(x)`
// (__clz(0) is 32)
WSP_DEVICE int bit_length(int x) { return 32 - __clz(x); }

// (no PTX) the raw bits of `v` as a `To` of the same size; bf16/f16 values move this way because
// cuda_bf16.h's / cuda_fp16.h's conversion asm would go through local memory
template <typename To, typename From>
WSP_DEVICE To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To r;
  memcpy(&r, &v, sizeof(To));
  return r;
}

}  // namespace wsp
