// wsched device primitives: wgmma bookkeeping and shared-memory matrix descriptors.
// The wgmma.mma_async calls themselves are generated per shape by wsched.codegen.wgmma.
#pragma once

#include "common.cuh"

namespace wsp {

// (no PTX) 64-bit wgmma shared-memory matrix descriptor:
//   bits  0-13 start address >> 4, bits 16-29 leading-dimension byte offset >> 4,
//   bits 32-45 stride-dimension byte offset >> 4, bits 49-51 base offset (0: tiles 1024 B aligned
//   for 128B swizzle), bits 62-63 layout type (0 interleave/none, 1 128B, 2 64B, 3 32B swizzle).
WSP_DEVICE uint64_t make_smem_desc(const void* smem_ptr, int swizzle_bytes, uint32_t lbo_bytes,
                                   uint32_t sbo_bytes) {
  const uint64_t layout = swizzle_bytes == 128 ? 1u : swizzle_bytes == 64 ? 2u : swizzle_bytes == 32 ? 3u : 0u;
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_u32(smem_ptr) >> 4) & 0x3FFFu);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32;
  desc |= layout << 62;
  return desc;
}

// (no PTX) advance a descriptor's start address by `byte_offset` (a multiple of 16), e.g. per k-step
WSP_DEVICE uint64_t smem_desc_add(uint64_t desc, uint32_t byte_offset) {
  return desc + static_cast<uint64_t>(byte_offset >> 4);
}

// wgmma.fence.sync.aligned (before the first wgmma that touches accumulators written elsewhere)
WSP_DEVICE void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// wgmma.commit_group.sync.aligned
WSP_DEVICE void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// wgmma.wait_group.sync.aligned N (<= N committed wgmma groups still pending)
template <int N>
WSP_DEVICE void wgmma_wait() {
  static_assert(N >= 0, "wgmma.wait_group: N >= 0");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// (no instruction) empty asm tying the register so the compiler cannot move its uses across wgmma
WSP_DEVICE void warpgroup_fence_operand(float& r) {
  asm volatile("" : "+f"(r) :: "memory");
}

// (no instruction) same, for packed 16-bit A fragments held in 32-bit registers
WSP_DEVICE void warpgroup_fence_operand(uint32_t& r) {
  asm volatile("" : "+r"(r) :: "memory");
}

// (no instruction) warpgroup_fence_operand on every element of a fragment array
template <int N>
WSP_DEVICE void warpgroup_fence_array(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) warpgroup_fence_operand(d[i]);
}

}  // namespace wsp
