// wsched device primitives: mbarrier (shared-memory transaction barriers).
#pragma once

#include "common.cuh"

namespace wsp {

// mbarrier.init.shared::cta.b64 [bar], arrivals
WSP_DEVICE void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n"
               :: "r"(smem_u32(bar)), "r"(arrivals) : "memory");
}

// fence.mbarrier_init.release.cluster (make mbarrier.init visible before the CTA/cluster barrier)
WSP_DEVICE void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// mbarrier.arrive.shared::cta.b64 (one arrival, state discarded)
WSP_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n"
               :: "r"(smem_u32(bar)) : "memory");
}

// mbarrier.arrive on the barrier at the same smem offset in the CTA of rank `cta_rank` of this CTA's
// cluster: mapa.shared::cluster.u32, then mbarrier.arrive.shared::cluster.b64 with the default
// semantics (.release.cta), as CUTLASS's cluster barrier arrives: what it orders is this warpgroup's
// wgmma reads of the stage, complete before it, against the peer's TMA overwrite. The PTX memory
// model promises that ordering to another CTA only at .cluster scope, but an explicit
// .release.cluster halved a cluster matmul's throughput (H100, docs/benchmarks.md); the simulator
// treats every arrival as a release the waiter acquires.
WSP_DEVICE void mbar_arrive_cluster(uint64_t* bar, uint32_t cta_rank) {
  asm volatile(
      "{\n"
      "  .reg .b32 remote;\n"
      "  mapa.shared::cluster.u32 remote, %0, %1;\n"
      "  mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n"
      :: "r"(smem_u32(bar)), "r"(cta_rank) : "memory");
}

// mbarrier.arrive.expect_tx.shared::cta.b64 (one arrival + expect `bytes` of async transactions)
WSP_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// mbarrier.try_wait.parity.shared::cta.b64: true once the phase with parity `phase_parity` completed
WSP_DEVICE bool mbar_try_wait(uint64_t* bar, uint32_t phase_parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done) : "r"(smem_u32(bar)), "r"(phase_parity) : "memory");
  return done != 0;
}

// loop on mbarrier.try_wait.parity.shared::cta.b64 until the phase with parity `phase_parity` completed
WSP_DEVICE void mbar_wait(uint64_t* bar, uint32_t phase_parity) {
  while (!mbar_try_wait(bar, phase_parity)) {
  }
}

// mbarrier.inval.shared::cta.b64 (before the barrier's smem is reused for anything else)
WSP_DEVICE void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" :: "r"(smem_u32(bar)) : "memory");
}

}  // namespace wsp
