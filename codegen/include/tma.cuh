// wsched device primitives: TMA (bulk tensor copies) and async-proxy fences.
// Coordinates are element indices, innermost dimension first (c0 is the contiguous one),
// as the hardware and cuTensorMapEncodeTiled take them. `map` is the address of a
// `const __grid_constant__ CUtensorMap` kernel parameter (or a tensor map in global memory).
#pragma once

#include "common.cuh"

namespace wsp {

// cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes
WSP_DEVICE void tma_load_1d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3}], [%2];\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)),
         "r"(c0)
      : "memory");
}

// cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
WSP_DEVICE void tma_load_2d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)),
         "r"(c0), "r"(c1)
      : "memory");
}

// cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes
WSP_DEVICE void tma_load_3d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)),
         "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes
WSP_DEVICE void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)),
         "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes
WSP_DEVICE void tma_load_5d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)),
         "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster:
// the box lands at the same smem offset, and completes on the barrier at the same offset, in every
// CTA of the cluster whose rank's bit is set in `cta_mask`
WSP_DEVICE void tma_load_1d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, uint16_t cta_mask, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4}], [%2], %3;\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask),
         "r"(c0)
      : "memory");
}

// cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster:
// the box lands at the same smem offset, and completes on the barrier at the same offset, in every
// CTA of the cluster whose rank's bit is set in `cta_mask`
WSP_DEVICE void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, uint16_t cta_mask, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5}], [%2], %3;\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask),
         "r"(c0), "r"(c1)
      : "memory");
}

// cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster:
// the box lands at the same smem offset, and completes on the barrier at the same offset, in every
// CTA of the cluster whose rank's bit is set in `cta_mask`
WSP_DEVICE void tma_load_3d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, uint16_t cta_mask, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6}], [%2], %3;\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask),
         "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster:
// the box lands at the same smem offset, and completes on the barrier at the same offset, in every
// CTA of the cluster whose rank's bit is set in `cta_mask`
WSP_DEVICE void tma_load_4d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, uint16_t cta_mask, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6, %7}], [%2], %3;\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask),
         "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster:
// the box lands at the same smem offset, and completes on the barrier at the same offset, in every
// CTA of the cluster whose rank's bit is set in `cta_mask`
WSP_DEVICE void tma_load_5d_multicast(void* smem_dst, const CUtensorMap* map, uint64_t* bar, uint16_t cta_mask, int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6, %7, %8}], [%2], %3;\n"
      :: "r"(smem_u32(smem_dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask),
         "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// cp.async.bulk.tensor.1d.global.shared::cta.bulk_group
WSP_DEVICE void tma_store_1d(const CUtensorMap* map, const void* smem_src, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.global.shared::cta.bulk_group"
      " [%0, {%2}], [%1];\n"
      :: "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(smem_src)),
         "r"(c0)
      : "memory");
}

// cp.async.bulk.tensor.2d.global.shared::cta.bulk_group
WSP_DEVICE void tma_store_2d(const CUtensorMap* map, const void* smem_src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"
      " [%0, {%2, %3}], [%1];\n"
      :: "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(smem_src)),
         "r"(c0), "r"(c1)
      : "memory");
}

// cp.async.bulk.tensor.3d.global.shared::cta.bulk_group
WSP_DEVICE void tma_store_3d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group"
      " [%0, {%2, %3, %4}], [%1];\n"
      :: "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(smem_src)),
         "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// cp.async.bulk.tensor.4d.global.shared::cta.bulk_group
WSP_DEVICE void tma_store_4d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n"
      :: "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(smem_src)),
         "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// cp.async.bulk.tensor.5d.global.shared::cta.bulk_group
WSP_DEVICE void tma_store_5d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group"
      " [%0, {%2, %3, %4, %5, %6}], [%1];\n"
      :: "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(smem_src)),
         "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// cp.async.bulk.commit_group (close the group of bulk stores issued by this thread)
WSP_DEVICE void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// cp.async.bulk.wait_group.read N (<= N groups still reading their smem source)
template <int N>
WSP_DEVICE void tma_store_wait_read() {
  static_assert(N >= 0, "cp.async.bulk.wait_group.read: N >= 0");
  asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}

// cp.async.bulk.wait_group N (<= N groups still pending, writes to global complete)
template <int N>
WSP_DEVICE void tma_store_wait() {
  static_assert(N >= 0, "cp.async.bulk.wait_group: N >= 0");
  asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

// prefetch.tensormap [map] (generic address of the __grid_constant__ map)
WSP_DEVICE void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// fence.proxy.async.shared::cta (generic-proxy smem writes -> visible to TMA / wgmma)
WSP_DEVICE void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace wsp
