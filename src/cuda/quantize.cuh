// Device helpers of the fused quantize-then-diff: a weight's elements as
// float32, their scale groups, and a 16-byte group of F8_E4M3 codes made
// from them with deltasync/quantize.h's encoder (the CPU's own code).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_internal.h"
#include "cuda/kernel_util.cuh"
#include "deltasync/quantize.h"

namespace deltasync::cuda::internal {

// The element's bits as an unsigned integer, its |x| bits (which order
// like the magnitudes), the |x| bits from which it is a NaN or an
// infinity, and its exact float32 value.
template <QuantKind K>
struct QuantElem;
template <>
struct QuantElem<QuantKind::kBf16> {
  using T = uint16_t;
  static constexpr uint32_t kAbsMask = 0x7FFF, kNonFinite = 0x7F80;
  __device__ static float ToFloat(uint32_t v) { return __uint_as_float(v << 16); }
};
template <>
struct QuantElem<QuantKind::kF16> {
  using T = uint16_t;
  static constexpr uint32_t kAbsMask = 0x7FFF, kNonFinite = 0x7C00;
  __device__ static float ToFloat(uint32_t v) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(v)));
  }
};
template <>
struct QuantElem<QuantKind::kF32> {
  using T = uint32_t;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFF, kNonFinite = 0x7F800000;
  __device__ static float ToFloat(uint32_t v) { return __uint_as_float(v); }
};

// The scale group of element (row, col).
__device__ __forceinline__ uint64_t QuantGroupOf(const QuantLoad& q, uint64_t row, uint64_t col) {
  switch (static_cast<QuantScheme>(q.scheme)) {
    case QuantScheme::kBlock128: return (row / kQuantBlock) * q.scale_cols + col / kQuantBlock;
    case QuantScheme::kPerChannel: return row;
    case QuantScheme::kPerTensor: break;
  }
  return 0;
}

// The codes of the diff's elements first .. first + 15 (those at or past
// `numel` are 0): weight elements q.first + first on, each multiplied by
// its group's inverse scale and encoded.
template <QuantKind K>
__device__ __forceinline__ uint4 QuantizeGroup(const QuantLoad& q, uint64_t first, uint64_t numel) {
  using S = QuantElem<K>;
  using T = typename S::T;
  constexpr int kPerLoad = 16 / sizeof(T);
  const uint64_t e = q.first + first;
  uint32_t raw[16];
  const T* w = static_cast<const T*>(q.weight);
  if (q.aligned16 && first + 16 <= numel && e % kPerLoad == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(w + e);
#pragma unroll
    for (int j = 0; j < 16 / kPerLoad; ++j) {
      const uint4 v = __ldcs(src + j);
#pragma unroll
      for (int k = 0; k < kPerLoad; ++k) {
        raw[j * kPerLoad + k] = static_cast<uint32_t>(ElemOf<sizeof(T)>(v, k));
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k) raw[k] = first + k < numel ? static_cast<uint32_t>(w[e + k]) : 0;
  }
  uint64_t row = e / q.cols;
  uint64_t col = e - row * q.cols;
  uint4 codes = make_uint4(0, 0, 0, 0);
  if (q.cols % 16 == 0 && q.first % 16 == 0) {
    // The 16 lie in one row and one 128-column block (e and cols are
    // multiples of 16): one scale.
    const float inv = __ldg(q.inv + QuantGroupOf(q, row, col));
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (first + k < numel) SetElem<1>(codes, k, Fp8E4M3FromFloat(S::ToFloat(raw[k]) * inv));
    }
    return codes;
  }
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (first + k < numel) {
      const float inv = __ldg(q.inv + QuantGroupOf(q, row, col));
      SetElem<1>(codes, k, Fp8E4M3FromFloat(S::ToFloat(raw[k]) * inv));
    }
    if (++col == q.cols) {
      col = 0;
      ++row;
    }
  }
  return codes;
}

}  // namespace deltasync::cuda::internal
