// wsched device primitives: include everything (namespace wsp).
#pragma once

#include "common.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "sync.cuh"
#include "atomic.cuh"
#include "wgmma.cuh"
#include "stmatrix.cuh"
#include "math.cuh"
// register-tile helpers of the generated kernels
#include "scalar.cuh"
#include "activation.cuh"
#include "fragment.cuh"
#include "global_access.cuh"
#include "shared_access.cuh"
// timeline stamps of an instrumented build (emit_kernel(..., trace=True) calls them)
#include "trace.cuh"
