// Device helpers the kernels share: 16-byte groups of elements and their
// element bits, and block-wide sums.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deltasync::cuda::internal {

template <int W>
struct ElemType;

// Position i of an array of `width`-byte positions (3: u24, 4: int32, 8:
// int64, all little-endian), the signed ones sign-extended: a flush frame's
// indices (u24 ones are read a byte at a time) or a diff's output.
__device__ __forceinline__ long long PositionOfWidth(const void* positions, uint32_t width,
                                                     uint64_t i) {
  if (width == 3) {
    const uint8_t* b = static_cast<const uint8_t*>(positions) + 3 * i;
    return static_cast<long long>(uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16);
  }
  return width == 8 ? static_cast<const long long*>(positions)[i]
                    : static_cast<long long>(static_cast<const int32_t*>(positions)[i]);
}
template <>
struct ElemType<1> {
  using T = uint8_t;
};
template <>
struct ElemType<2> {
  using T = uint16_t;
};
template <>
struct ElemType<4> {
  using T = uint32_t;
};
template <>
struct ElemType<8> {
  using T = unsigned long long;
};

// Element k (a compile-time index after unrolling) of a 16-byte group, as a
// zero-extended little-endian integer.
template <int W>
__device__ __forceinline__ uint64_t ElemOf(const uint4& v, int k) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (W == 1) {
    return (w[k >> 2] >> (8 * (k & 3))) & 0xFFu;
  } else if constexpr (W == 2) {
    return (w[k >> 1] >> (16 * (k & 1))) & 0xFFFFu;
  } else if constexpr (W == 4) {
    return w[k];
  } else {
    return static_cast<uint64_t>(w[2 * k]) | (static_cast<uint64_t>(w[2 * k + 1]) << 32);
  }
}

// The same for an index known only at run time (selects, not an indexed
// register array, which would go to local memory).
__device__ __forceinline__ uint32_t WordAt(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
template <int W>
__device__ __forceinline__ uint64_t ElemAt(const uint4& v, int k) {
  if constexpr (W == 1) {
    return (WordAt(v, k >> 2) >> (8 * (k & 3))) & 0xFFu;
  } else if constexpr (W == 2) {
    return (WordAt(v, k >> 1) >> (16 * (k & 1))) & 0xFFFFu;
  } else if constexpr (W == 4) {
    return WordAt(v, k);
  } else {
    return static_cast<uint64_t>(WordAt(v, 2 * k)) |
           (static_cast<uint64_t>(WordAt(v, 2 * k + 1)) << 32);
  }
}

template <int W>
__device__ __forceinline__ void SetElem(uint4& v, int k, uint64_t bits) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
  if constexpr (W == 1) {
    const int s = 8 * (k & 3);
    w[k >> 2] = (w[k >> 2] & ~(0xFFu << s)) | (static_cast<uint32_t>(bits) << s);
  } else if constexpr (W == 2) {
    const int s = 16 * (k & 1);
    w[k >> 1] = (w[k >> 1] & ~(0xFFFFu << s)) | (static_cast<uint32_t>(bits) << s);
  } else if constexpr (W == 4) {
    w[k] = static_cast<uint32_t>(bits);
  } else {
    w[2 * k] = static_cast<uint32_t>(bits);
    w[2 * k + 1] = static_cast<uint32_t>(bits >> 32);
  }
}

// The 16/W elements first .. first + 16/W - 1 of `base`; those at or past
// `numel` read as 0. With kAligned the group is one 16-byte load when it is
// whole (streaming: each byte is read once).
template <int W, bool kAligned>
__device__ __forceinline__ uint4 LoadGroup(const void* base, uint64_t first, uint64_t numel) {
  constexpr int E = 16 / W;
  using T = typename ElemType<W>::T;
  if (kAligned && first + E <= numel) {
    return __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(base) + first * W));
  }
  uint4 v = make_uint4(0, 0, 0, 0);
  const T* p = static_cast<const T*>(base);
#pragma unroll
  for (int k = 0; k < E; ++k) {
    if (first + k < numel) SetElem<W>(v, k, p[first + k]);
  }
  return v;
}

__device__ __forceinline__ unsigned long long WarpSum(unsigned long long v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, d);
  return v;
}

// Sums two lanes over the block (blockDim.x a multiple of 32, at most
// 1024); the result is valid in thread 0. `scratch` holds 64 values.
__device__ __forceinline__ void BlockSum2(unsigned long long& a, unsigned long long& b,
                                          unsigned long long* scratch) {
  a = WarpSum(a);
  b = WarpSum(b);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    scratch[warp] = a;
    scratch[32 + warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    a = lane < warps ? scratch[lane] : 0;
    b = lane < warps ? scratch[32 + lane] : 0;
    a = WarpSum(a);
    b = WarpSum(b);
  }
}

}  // namespace deltasync::cuda::internal
