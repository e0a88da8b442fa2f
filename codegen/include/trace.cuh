// wsched device primitives: timeline stamps of an instrumented build (emit_kernel(..., trace=True)).
// An untraced kernel calls none of this (inline functions only: nothing is compiled in).
//
// Buffer layout (uint4 records, zeroed by the host before the launch):
//   [CTA (blockIdx.x)][warpgroup][stream][capacity]
// stream 0 is the warpgroup's thread 0 (stamps of statements all its threads run), stream 1 its
// elected thread (stamps inside elect_one): two threads, two counters, no atomics. A record is
//   x: %globaltimer_lo (ns)   y: %clock (SM cycles)   z: site | %smid << 16   w: value
// where site >= 1 indexes the emitter's site table (`EmittedKernel.trace_sites`) and value is
// the stamped expression (a barrier index, the tile). A record with site 0 was never written.
// A full stream drops later stamps (the host sees a stream of `capacity` records).
#pragma once

#include "common.cuh"

namespace wsp {

// mov.u32 %globaltimer_lo (nanoseconds, shared by every SM; low 32 bits wrap every 4.3 s)
WSP_DEVICE uint32_t globaltimer_lo() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%globaltimer_lo;\n" : "=r"(t));
  return t;
}

// mov.u32 %clock (this SM's cycle counter, low 32 bits)
WSP_DEVICE uint32_t clock_lo() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%clock;\n" : "=r"(t));
  return t;
}

// mov.u32 %smid
WSP_DEVICE uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}

// The stamps of one thread: its warpgroup's two streams and how far each is filled.
struct Trace {
  uint4* records;      // this warpgroup's stream 0; stream 1 follows at + capacity
  uint32_t capacity;
  uint32_t count[2];
  uint32_t sm;         // %smid << 16

  WSP_DEVICE Trace(uint4* buffer, int capacity_)
      : capacity(static_cast<uint32_t>(capacity_)), count{0, 0}, sm(sm_id() << 16) {
    const uint32_t warpgroup = threadIdx.x / 128u, warpgroups = blockDim.x / 128u;
    records = buffer + (static_cast<size_t>(blockIdx.x) * warpgroups + warpgroup) * 2u * capacity;
  }

  // One record on `Stream` (0: the warpgroup's thread 0, 1: its elected thread); a template
  // argument so that count[] stays in registers.
  template <int Stream>
  WSP_DEVICE void stamp(uint32_t site, uint32_t value) {
    const uint32_t n = count[Stream];
    if (n < capacity) {
      records[Stream * capacity + n] = make_uint4(globaltimer_lo(), clock_lo(), site | sm, value);
      count[Stream] = n + 1;
    }
  }
};

}  // namespace wsp
