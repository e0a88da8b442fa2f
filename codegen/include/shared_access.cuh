// wsched device helpers: generic-proxy stores of register tiles into shared memory.
// These are generic-proxy writes: fence_proxy_async() before TMA or wgmma reads them.
#pragma once

#include "common.cuh"

namespace wsp {

// (no PTX) 128-byte swizzle of a shared address (what TMA and wgmma use on 1024-byte-aligned
// buffers): the 16-byte unit bits [4, 7) are xor-ed with the 128-byte row bits [7, 10). Applied
// per store to the unswizzled address, so no per-thread table of swizzled offsets stays live.
WSP_DEVICE uint32_t swizzle128(uint32_t addr) { return addr ^ ((addr >> 3) & 0x70); }

// st.shared.b32 [addr], v
WSP_DEVICE void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}

// st.shared.v2.b32 [addr], {v.x, v.y}
WSP_DEVICE void st_shared(uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" :: "r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

}  // namespace wsp
