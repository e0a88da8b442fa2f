// wsched device helpers: predicated global loads / stores of register-tile elements.
// One instruction each and no branch (a branch per element splits the epilogue into many small
// blocks and ptxas spills). A disabled load reads 0; a disabled store writes nothing.
// Values move as raw bits: cuda_bf16.h's / cuda_fp16.h's conversion asm would go through
// local memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "scalar.cuh"  // bit_cast

namespace wsp {

// @ok ld.global.b16 v, [p] (0 when !ok)
WSP_DEVICE uint16_t ld_b16_if(const void* p, bool ok) {
  uint16_t v = 0;
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.b16 %0, [%1];\n}\n"
               : "+h"(v) : "l"(p), "r"(int(ok)));
  return v;
}

// @ok ld.global.b32 v, [p] (0 when !ok)
WSP_DEVICE uint32_t ld_b32_if(const void* p, bool ok) {
  uint32_t v = 0;
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.b32 %0, [%1];\n}\n"
               : "+r"(v) : "l"(p), "r"(int(ok)));
  return v;
}

// @ok ld.global.v2.b32 {v.x, v.y}, [p] (0, 0 when !ok)
WSP_DEVICE uint2 ld_b64_if(const void* p, bool ok) {
  uint2 v = make_uint2(0, 0);
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q ld.global.v2.b32 {%0, %1}, [%2];\n}\n"
               : "+r"(v.x), "+r"(v.y) : "l"(p), "r"(int(ok)));
  return v;
}

// @ok ld.global.v4.b32 {v.x, v.y, v.z, v.w}, [p] (0s when !ok; p 16-byte aligned)
WSP_DEVICE uint4 ld_b128_if(const void* p, bool ok) {
  uint4 v = make_uint4(0, 0, 0, 0);
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n @q ld.global.v4.b32 {%0, %1, %2, %3}, [%4];\n}\n"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"(int(ok)));
  return v;
}

// @ok st.global.b16 [p], v
WSP_DEVICE void st_b16_if(void* p, uint16_t v, bool ok) {
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.b16 [%0], %1;\n}\n"
               :: "l"(p), "h"(v), "r"(int(ok)) : "memory");
}

// @ok st.global.b32 [p], v
WSP_DEVICE void st_b32_if(void* p, uint32_t v, bool ok) {
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.b32 [%0], %1;\n}\n"
               :: "l"(p), "r"(v), "r"(int(ok)) : "memory");
}

// @ok st.global.v2.b32 [p], {v.x, v.y}
WSP_DEVICE void st_b64_if(void* p, uint2 v, bool ok) {
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q st.global.v2.b32 [%0], {%1, %2};\n}\n"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(int(ok)) : "memory");
}

// An element type as raw bits: `type` is its adjacent pair, `bits` the pair's raw bits; ld / st
// move one element, ld2 / st2 a pair with one access.
template <typename T> struct pair_of;

template <> struct pair_of<__nv_bfloat16> {
  using type = __nv_bfloat162;
  using bits = uint32_t;
  // one 16-bit element
  static WSP_DEVICE uint16_t ld(const void* p, bool ok) { return ld_b16_if(p, ok); }
  // an adjacent pair with one 32-bit load
  static WSP_DEVICE uint32_t ld2(const void* p, bool ok) { return ld_b32_if(p, ok); }
  // two elements' bits as a pair's (lo in bits 0-15)
  static WSP_DEVICE uint32_t join(uint16_t lo, uint16_t hi) { return lo | (uint32_t(hi) << 16); }
  // element `half` (0: bits 0-15, 1: bits 16-31) of a pair's bits
  static WSP_DEVICE void st(void* p, uint32_t b, int half, bool ok) { st_b16_if(p, uint16_t(b >> (16 * half)), ok); }
  // a pair with one 32-bit store
  static WSP_DEVICE void st2(void* p, uint32_t b, bool ok) { st_b32_if(p, b, ok); }
};

// f16 moves exactly as bf16 (same size), only the pair type differs
template <> struct pair_of<__half> : pair_of<__nv_bfloat16> { using type = __half2; };

template <> struct pair_of<float> {
  using type = float2;
  using bits = uint2;
  // one 32-bit element
  static WSP_DEVICE uint32_t ld(const void* p, bool ok) { return ld_b32_if(p, ok); }
  // an adjacent pair with one 64-bit load
  static WSP_DEVICE uint2 ld2(const void* p, bool ok) { return ld_b64_if(p, ok); }
  // two elements' bits as a pair's
  static WSP_DEVICE uint2 join(uint32_t lo, uint32_t hi) { return make_uint2(lo, hi); }
  // element `half` (0: .x, 1: .y) of a pair's bits
  static WSP_DEVICE void st(void* p, uint2 b, int half, bool ok) { st_b32_if(p, half ? b.y : b.x, ok); }
  // a pair with one 64-bit store
  static WSP_DEVICE void st2(void* p, uint2 b, bool ok) { st_b64_if(p, b, ok); }
};

// i32 (document ids read into f32 tiles) moves exactly as f32 (same size), only the pair type differs
template <> struct pair_of<int> : pair_of<float> { using type = int2; };

// A row of a global tensor moves in pairs (p, p + 1) with one 32/64-bit access when the row
// pointer is aligned for it and the row length is even (a pair is then wholly inside or wholly
// outside); otherwise element by element. The generated code decides once per row.

// (no PTX) whether a row can move in pairs: pair-aligned row pointer, even row length
template <typename T>
WSP_DEVICE bool pairs_aligned(const T* row_ptr, int cols) {
  return reinterpret_cast<uintptr_t>(row_ptr) % sizeof(typename pair_of<T>::type) == 0 && cols % 2 == 0;
}

// the pair (p[0], p[1]) with one access; zero when !ok
template <typename T>
WSP_DEVICE typename pair_of<T>::type load_pair(const T* p, bool ok) {
  return bit_cast<typename pair_of<T>::type>(pair_of<T>::ld2(p, ok));
}

// the pair (p[0], p[1]) with one access per element; an element is zero when its ok is false
template <typename T>
WSP_DEVICE typename pair_of<T>::type load_split(const T* p, bool ok0, bool ok1) {
  using P = pair_of<T>;
  return bit_cast<typename P::type>(P::join(P::ld(p, ok0), P::ld(p + 1, ok1)));
}

// the element p[0]; zero when !ok
template <typename T>
WSP_DEVICE T load_one(const T* p, bool ok) {
  return bit_cast<T>(pair_of<T>::ld(p, ok));
}

// p[0], p[1] = v with one access, when ok
template <typename T>
WSP_DEVICE void store_pair(T* p, bool ok, typename pair_of<T>::type v) {
  pair_of<T>::st2(p, bit_cast<typename pair_of<T>::bits>(v), ok);
}

// p[0] = v.x when ok0, p[1] = v.y when ok1, one access per element
template <typename T>
WSP_DEVICE void store_split(T* p, bool ok0, bool ok1, typename pair_of<T>::type v) {
  const auto b = bit_cast<typename pair_of<T>::bits>(v);
  pair_of<T>::st(p, b, 0, ok0);
  pair_of<T>::st(p + 1, b, 1, ok1);
}

// 16-byte stores of a [64, N] 16-bit fragment tile. The 4 lanes of a quad (lane q = lane % 4)
// hold the pairs of columns 8j + 2q of their row for every 8-column group j. For groups
// 4J .. 4J + 3, `quad_transpose` gives lane q the 4 pairs of group 4J + q (columns 8(4J + q) ..
// + 7, 16 consecutive bytes), from word k of each lane being its pair of group 4J + k: one
// shuffle per word within the quad, so a warp's store writes 64 bytes of each of 8 rows instead
// of 16 (four times fewer store requests than a 32-bit store per pair). Every lane of the warp
// must call it (the shuffles), whatever it then stores.

// (no PTX) whether a row of 16-bit values can take 16-byte stores: a 16-byte aligned row
// pointer and a row length that is a multiple of 8 (each 8-column chunk wholly inside or outside)
template <typename T>
WSP_DEVICE bool rows16_aligned(const T* row_ptr, int cols) {
  return reinterpret_cast<uintptr_t>(row_ptr) % 16 == 0 && cols % 8 == 0;
}

// shfl.sync.idx.b32 (x4, within the quad): lane q gets word q of lanes 0..3 of its quad
WSP_DEVICE uint4 quad_transpose(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const int q = threadIdx.x & 3;
  uint32_t y0 = 0, y1 = 0, y2 = 0, y3 = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // round k: lane s sends its word (s - k) & 3; lane q reads lane (q + k) & 3, whose word q that is
    const int send = (q - k) & 3;
    const uint32_t v = send == 0 ? w0 : send == 1 ? w1 : send == 2 ? w2 : w3;
    const uint32_t r = __shfl_sync(0xffffffffu, v, (q + k) & 3, 4);
    const int at = (q + k) & 3;
    y0 = at == 0 ? r : y0;
    y1 = at == 1 ? r : y1;
    y2 = at == 2 ? r : y2;
    y3 = at == 3 ? r : y3;
  }
  return make_uint4(y0, y1, y2, y3);
}

// @ok st.global.v4.b32 [p], v  (p 16-byte aligned)
WSP_DEVICE void st_b128_if(void* p, uint4 v, bool ok) {
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n @q st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(int(ok)) : "memory");
}

// p[0 .. 7] = the 8 16-bit values of v with one 16-byte store, when ok
template <typename T>
WSP_DEVICE void store_eight(T* p, bool ok, uint4 v) {
  static_assert(sizeof(T) == 2, "16-byte stores of 16-bit elements");
  st_b128_if(p, v, ok);
}

// p[e] = value e of v for e in 0 .. 7, each when ok and col + e < cols (a row not 16-byte aligned)
template <typename T>
WSP_DEVICE void store_eight_split(T* p, bool ok, int col, int cols, uint4 v) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    st_b16_if(p + e, uint16_t(w[e / 2] >> (16 * (e % 2))), ok && col + e < cols);
  }
}

}  // namespace wsp
