// The per-element hash of the stream's state digest (docs/format.md,
// "Stream: state digest", "Definition"), in one place for the CPU kernels
// (src/stream/state_digest.cc) and the CUDA ones (src/cuda): both compile
// these same lines, so the two cannot drift apart.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DS_HOST_DEVICE inline
#endif

namespace deltasync::element_digest {

inline constexpr uint64_t kMulA = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kAddA = 0x243F6A8885A308D3ull;
inline constexpr uint64_t kMulB = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kAddB = 0x13198A2E03707344ull;
inline constexpr uint64_t kFmixA1 = 0xFF51AFD7ED558CCDull;
inline constexpr uint64_t kFmixA2 = 0xC4CEB9FE1A85EC53ull;
inline constexpr uint64_t kFmixB1 = 0xBF58476D1CE4E5B9ull;
inline constexpr uint64_t kFmixB2 = 0x94D049BB133111EBull;

// MurmurHash3's fmix64.
DS_HOST_DEVICE uint64_t FmixA(uint64_t x) {
  x ^= x >> 33;
  x *= kFmixA1;
  x ^= x >> 33;
  x *= kFmixA2;
  return x ^ (x >> 33);
}

// SplitMix64's finalizer.
DS_HOST_DEVICE uint64_t FmixB(uint64_t x) {
  x ^= x >> 30;
  x *= kFmixB1;
  x ^= x >> 27;
  x *= kFmixB2;
  return x ^ (x >> 31);
}

// log2 of an element size of 1, 2, 4 or 8.
DS_HOST_DEVICE constexpr uint64_t WidthCode(uint32_t elem_size) {
  return elem_size == 1 ? 0 : elem_size == 2 ? 1 : elem_size == 4 ? 2 : 3;
}

// t of the definition: the position with the width code in bits 56-57.
DS_HOST_DEVICE uint64_t PositionKey(uint64_t position, uint32_t elem_size) {
  return position | (WidthCode(elem_size) << 56);
}

// Lane keys of position t; they advance by kMulA / kMulB per element while
// positions stay below 2^56.
DS_HOST_DEVICE uint64_t KeyA(uint64_t t) { return t * kMulA + kAddA; }
DS_HOST_DEVICE uint64_t KeyB(uint64_t t) { return t * kMulB + kAddB; }

}  // namespace deltasync::element_digest
