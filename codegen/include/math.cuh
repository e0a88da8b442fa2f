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

// tanh.approx.f32 (one MUFU.TANH; max relative error 2^-11 over the whole range, PTX ISA
// "Floating Point Instructions: tanh"; subnormals pass through). tile.tanh's spelling: tanhf is a
// longer instruction sequence per element, and the error is well below bf16's half ulp (2^-9).
WSP_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace wsp
