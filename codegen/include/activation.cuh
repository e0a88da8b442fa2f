// wsched device helpers: activation functions of fused epilogues (f32 in, f32 out).
#pragma once

#include "common.cuh"

namespace wsp {

// (no PTX) exact GELU, 0.5 x (1 + erf(x / sqrt(2)))
WSP_DEVICE float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }

// (no PTX) SiLU, x / (1 + e^-x), with the fast exponential (ex2.approx) and division
// (__expf: 2 + |1.16 x| ulp; __fdividef: 2 ulp, and 0 once 1 + e^-x passes 2^126, where the true
// quotient is below 2^-119 in magnitude): a few fp32 ulp, far below the bf16 outputs' rounding, in
// fewer instructions than expf and an IEEE division (docs/ir.md, "Activations on the GPU").
WSP_DEVICE float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// (no PTX) logistic sigmoid, 1 / (1 + e^-x), fast like silu
WSP_DEVICE float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

}  // namespace wsp
