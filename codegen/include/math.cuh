// wsched device primitives: fast math used by fused epilogues / online softmax.
#pragma once

#include "common.cuh"

namespace wsp {

// ex2.approx.ftz.f32 (2^x, flush denormals; what FA-style softmax uses with log2(e) folded in)
WSP_DEVICE float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace wsp
