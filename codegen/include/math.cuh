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

// x / y where one divisor serves many quotients (a tile divided by a per-row or per-column
// tile, or by a constant): a reciprocal of the divisor and a multiply per quotient, within 1.5
// ulp of IEEE division (docs/ir.md, "tile.div on the GPU"). The divisor is first scaled by a power
// of two into [2^-100, 2^100] (exactly), so that its reciprocal neither overflows nor loses bits
// as a subnormal, and the product is scaled back; 0, inf and NaN divisors give IEEE's results.
// The scale and the reciprocal depend on y alone, so where y is one register for a whole
// unrolled tile loop the compiler computes them once: IEEE division is an instruction sequence
// with a slow path per quotient, about ten times the code of a multiply, and an epilogue runs
// it cold (once per tile).
WSP_DEVICE float div_shared(float x, float y) {
  const float a = fabsf(y);
  const float s = a < 0x1p-100f ? 0x1p64f : (a > 0x1p100f ? 0x1p-64f : 1.0f);
  return (x * __frcp_rn(y * s)) * s;
}

// i32 register tiles (docs/ir.md, "Integer tiles"): 32-bit two's-complement arithmetic that
// wraps, as torch's int32 does (signed overflow is undefined in C++; unsigned arithmetic wraps).
WSP_DEVICE int wrap_add(int a, int b) { return static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b)); }
WSP_DEVICE int wrap_sub(int a, int b) { return static_cast<int>(static_cast<unsigned>(a) - static_cast<unsigned>(b)); }
WSP_DEVICE int wrap_mul(int a, int b) { return static_cast<int>(static_cast<unsigned>(a) * static_cast<unsigned>(b)); }
WSP_DEVICE int wrap_neg(int a) { return static_cast<int>(0u - static_cast<unsigned>(a)); }

}  // namespace wsp
