// wsched device primitives: stmatrix and 16-bit packing.
// Writes through stmatrix are generic-proxy: fence_proxy_async() before TMA/wgmma reads them.
#pragma once

#include "common.cuh"

namespace wsp {

// stmatrix.sync.aligned.m8n8.x4.shared.b16 [p], {r0, r1, r2, r3}
// (lane l supplies the row address for row l % 8 of matrix l / 8)
WSP_DEVICE void stmatrix_x4(void* smem_row_ptr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(smem_u32(smem_row_ptr)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// the same at a shared-memory address (e.g. a swizzled one)
WSP_DEVICE void stmatrix_x4_at(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(smem_addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [p], {r0, r1, r2, r3}
WSP_DEVICE void stmatrix_x4_trans(void* smem_row_ptr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(smem_u32(smem_row_ptr)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// cvt.rn.bf16x2.f32 d, hi, lo (lo -> bits 0-15, hi -> bits 16-31)
WSP_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(d) : "f"(lo), "f"(hi));
  return d;
}

// cvt.rn.f16x2.f32 d, hi, lo (lo -> bits 0-15, hi -> bits 16-31)
WSP_DEVICE uint32_t pack_f16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "=r"(d) : "f"(lo), "f"(hi));
  return d;
}

}  // namespace wsp
