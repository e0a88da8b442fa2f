// wsched device primitives: common definitions.
// Every primitive is a __device__ __forceinline__ function in namespace wsp that wraps
// exactly one PTX instruction (plus, where PTX needs it, a predicate move).
// Target: sm_90a (build with -gencode=arch=compute_90a,code=sm_90a).
#pragma once

#include <cstdint>
#include <cuda.h>  // CUtensorMap

#define WSP_DEVICE __device__ __forceinline__

namespace wsp {

// cvta.to.shared: generic pointer into shared memory -> 32-bit shared-window address.
WSP_DEVICE uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace wsp
