// wsched device helpers: activation functions of fused epilogues (f32 in, f32 out).
#pragma once

#include "common.cuh"

namespace wsp {

// (no PTX) exact GELU, 0.5 x (1 + erf(x / sqrt(2)))
WSP_DEVICE float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }

// (no PTX) SiLU, x / (1 + e^-x)
WSP_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

// (no PTX) logistic sigmoid, 1 / (1 + e^-x)
WSP_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

}  // namespace wsp
