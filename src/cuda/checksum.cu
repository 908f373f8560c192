// The device checksums: the state digest (docs/format.md, "Stream: state
// digest"), full and as a change, and the flush frame's xxh3-128 trailer.
//
// The state digest is a sum mod 2^64 of one hash per element, so any split
// of the work adds up to the same value: blocks sum grid-strided groups,
// then one block sums the blocks.
//
// xxh3-128 of a long input is, per 1 KiB block, an addition of the block's
// 16 stripes into 8 accumulators followed by a scramble of each. The
// additions do not depend on the accumulators, so every block's sums are
// computed in parallel first; only the scrambles form a chain, run by 8
// threads (one per accumulator) over the sums.
#include <cstdint>

#include "core/element_digest.h"
#include "cuda/cuda_internal.h"
#include "cuda/kernel_util.cuh"

namespace deltasync::cuda::internal {
namespace {

namespace ed = ::deltasync::element_digest;

constexpr unsigned kDigestThreads = 256;

template <int W, bool kAligned>
__global__ void __launch_bounds__(kDigestThreads) StateDigestKernel(DigestLaunch p) {
  constexpr int E = 16 / W;
  __shared__ unsigned long long s_sum[64];
  unsigned long long a = 0, b = 0;
  const uint64_t groups = (p.numel + E - 1) / E;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t g = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const uint64_t first = g * E;
    const uint4 v = LoadGroup<W, kAligned>(p.data, first, p.numel);
    const uint64_t t = ed::PositionKey(p.first_position + first, W);
    uint64_t ka = ed::KeyA(t), kb = ed::KeyB(t);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      if (first + k < p.numel) {
        const uint64_t bits = ElemOf<W>(v, k);
        a += ed::FmixA(ka ^ bits);
        b += ed::FmixB(kb ^ bits);
      }
      ka += ed::kMulA;
      kb += ed::kMulB;
    }
  }
  BlockSum2(a, b, s_sum);
  if (threadIdx.x == 0) {
    p.partials[2 * blockIdx.x] = a;
    p.partials[2 * blockIdx.x + 1] = b;
  }
}

template <int W>
__device__ __forceinline__ uint64_t BitsAt(const void* values, uint64_t i) {
  return static_cast<const typename ElemType<W>::T*>(values)[i];
}

template <int W>
__global__ void __launch_bounds__(kDigestThreads) DigestChangeKernel(DigestLaunch p) {
  __shared__ unsigned long long s_sum[64];
  unsigned long long a = 0, b = 0;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < p.numel; i += stride) {
    const uint64_t pos = p.base + static_cast<uint64_t>(PositionOfWidth(p.positions, p.width, i));
    if (p.block_rows > 0) {
      // Only the block's elements: rows of block_count at block_row_stride.
      if (pos < p.block_first) continue;
      const uint64_t off = pos - p.block_first;
      if (p.block_rows == 1 ? off >= p.block_count
                            : off / p.block_row_stride >= p.block_rows ||
                                  off % p.block_row_stride >= p.block_count) {
        continue;
      }
    }
    const uint64_t t = ed::PositionKey(pos, W);
    const uint64_t ka = ed::KeyA(t), kb = ed::KeyB(t);
    const uint64_t nv = BitsAt<W>(p.new_values, i), ov = BitsAt<W>(p.old_values, i);
    a += ed::FmixA(ka ^ nv) - ed::FmixA(ka ^ ov);
    b += ed::FmixB(kb ^ nv) - ed::FmixB(kb ^ ov);
  }
  BlockSum2(a, b, s_sum);
  if (threadIdx.x == 0) {
    p.partials[2 * blockIdx.x] = a;
    p.partials[2 * blockIdx.x + 1] = b;
  }
}

__global__ void SumPartialsKernel(const unsigned long long* partials, unsigned blocks,
                                  Results* results) {
  __shared__ unsigned long long s_sum[64];
  unsigned long long a = 0, b = 0;
  for (unsigned i = threadIdx.x; i < blocks; i += blockDim.x) {
    a += partials[2 * i];
    b += partials[2 * i + 1];
  }
  BlockSum2(a, b, s_sum);
  if (threadIdx.x == 0) {
    results->a = a;
    results->b = b;
  }
}

unsigned DigestBlocks(uint64_t work) {
  const uint64_t blocks = (work + kDigestThreads - 1) / kDigestThreads;
  return static_cast<unsigned>(blocks == 0                 ? 1
                               : blocks < kDigestMaxBlocks ? blocks
                                                           : kDigestMaxBlocks);
}

// ---- xxh3-128 (the definition libxxhash implements; its default secret) ----

__constant__ uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t kStripe = 64;
constexpr int kStripesPerBlock = 16;
constexpr int kScrambleOffset = 192 - 64;  // secret of the scramble
constexpr int kLastStripeOffset = 192 - 64 - 7;
constexpr int kMergeLowOffset = 11;
constexpr int kMergeHighOffset = 192 - 64 - 11;

__device__ __forceinline__ uint64_t SecretAt(int offset) {
  uint64_t v = 0;
#pragma unroll
  for (int k = 7; k >= 0; --k) v = (v << 8) | kSecret[offset + k];
  return v;
}

// Any alignment: the little-endian 8 bytes at p.
__device__ __forceinline__ uint64_t Read64(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
#pragma unroll
  for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

// Lane i's share of one stripe: what acc[i] gains from its own word (the
// 32x32 product) and the word itself, which acc[i ^ 1] gains.
__device__ __forceinline__ void StripeLane(const uint8_t* stripe, int secret_offset, int i,
                                           uint64_t& product, uint64_t& word) {
  word = Read64(stripe + 8 * i);
  const uint64_t key = word ^ SecretAt(secret_offset + 8 * i);
  product = (key & 0xFFFFFFFFull) * (key >> 32);
}

// Per whole block, per lane: the sum its 16 stripes add to acc[lane].
__global__ void XxhBlockSumsKernel(const uint8_t* data, uint64_t blocks, unsigned long long* sums) {
  const uint64_t g = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const uint64_t block = g >> 3;
  const int i = static_cast<int>(g & 7);
  uint64_t products = 0, words = 0;
  if (block < blocks) {
    const uint8_t* base = data + block * kXxhBlockBytes;
#pragma unroll 4
    for (int s = 0; s < kStripesPerBlock; ++s) {
      uint64_t product, word;
      StripeLane(base + s * kStripe, 8 * s, i, product, word);
      products += product;
      words += word;
    }
  }
  const uint64_t partner = __shfl_xor_sync(0xFFFFFFFFu, words, 1);
  if (block < blocks) sums[8 * block + i] = products + partner;
}

__device__ __forceinline__ uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

__device__ __forceinline__ uint64_t Mul128Fold64(uint64_t a, uint64_t b) {
  return (a * b) ^ __umul64hi(a, b);
}

__device__ uint64_t MergeAccs(const uint64_t* acc, int secret_offset, uint64_t start) {
  uint64_t result = start;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    result += Mul128Fold64(acc[2 * i] ^ SecretAt(secret_offset + 16 * i),
                           acc[2 * i + 1] ^ SecretAt(secret_offset + 16 * i + 8));
  }
  return Avalanche(result);
}

// One warp: lanes 0-7 each carry one accumulator through the chain of
// scrambles, then through the last partial block and the last stripe.
__global__ void XxhChainKernel(const uint8_t* data, uint64_t len, uint64_t blocks,
                               const unsigned long long* sums, Results* results) {
  const int lane = threadIdx.x;
  const int i = lane & 7;
  const uint64_t init[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                            kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  uint64_t acc = init[i];
  const uint64_t scramble_key = SecretAt(kScrambleOffset + 8 * i);
  // The block sums come in batches of 32 blocks through shared memory, the
  // next batch loaded while the current one is chained.
  __shared__ unsigned long long s_batch[2][256];
  const uint64_t words = 8 * blocks;
  unsigned long long next[8];
  auto load = [&](uint64_t batch) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const uint64_t idx = 256 * batch + 32 * q + lane;
      next[q] = idx < words ? sums[idx] : 0;
    }
  };
  const uint64_t batches = (blocks + 31) / 32;
  if (batches > 0) load(0);
  for (uint64_t batch = 0; batch < batches; ++batch) {
    unsigned long long* buf = s_batch[batch & 1];
#pragma unroll
    for (int q = 0; q < 8; ++q) buf[32 * q + lane] = next[q];
    __syncwarp();
    if (batch + 1 < batches) load(batch + 1);
    const uint64_t left = blocks - 32 * batch;
    const int steps = left < 32 ? static_cast<int>(left) : 32;
    for (int n = 0; n < steps; ++n) {
      acc += buf[8 * n + i];
      acc ^= acc >> 47;
      acc ^= scramble_key;
      acc *= kPrime32_1;
    }
    __syncwarp();
  }
  const uint64_t stripes = ((len - 1) - kXxhBlockBytes * blocks) / kStripe;
  const uint8_t* tail = data + blocks * kXxhBlockBytes;
  for (uint64_t s = 0; s < stripes; ++s) {
    uint64_t product, word;
    StripeLane(tail + s * kStripe, static_cast<int>(8 * s), i, product, word);
    acc += product + __shfl_xor_sync(0xFFFFFFFFu, word, 1);
  }
  {
    uint64_t product, word;
    StripeLane(data + len - kStripe, kLastStripeOffset, i, product, word);
    acc += product + __shfl_xor_sync(0xFFFFFFFFu, word, 1);
  }
  uint64_t all[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) all[k] = __shfl_sync(0xFFFFFFFFu, acc, k);
  if (lane == 0) {
    results->b = MergeAccs(all, kMergeLowOffset, len * kPrime64_1);
    results->a = MergeAccs(all, kMergeHighOffset, ~(len * kPrime64_2));
  }
}

}  // namespace

cudaError_t LaunchStateDigest(const DigestLaunch& p) {
  const uint64_t groups = (p.numel + 16 / p.elem_size - 1) / (16 / p.elem_size);
  const unsigned blocks = DigestBlocks(groups);
#define DS_DIGEST_CASE(W)                                                      \
  case W:                                                                      \
    if (p.aligned16) {                                                         \
      StateDigestKernel<W, true><<<blocks, kDigestThreads, 0, p.stream>>>(p);  \
    } else {                                                                   \
      StateDigestKernel<W, false><<<blocks, kDigestThreads, 0, p.stream>>>(p); \
    }                                                                          \
    break;
  switch (p.elem_size) {
    DS_DIGEST_CASE(1)
    DS_DIGEST_CASE(2)
    DS_DIGEST_CASE(4)
    default: DS_DIGEST_CASE(8)
  }
#undef DS_DIGEST_CASE
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SumPartialsKernel<<<1, 1024, 0, p.stream>>>(p.partials, blocks, p.results);
  return cudaGetLastError();
}

cudaError_t LaunchDigestChange(const DigestLaunch& p) {
  const unsigned blocks = DigestBlocks(p.numel);
  switch (p.elem_size) {
    case 1: DigestChangeKernel<1><<<blocks, kDigestThreads, 0, p.stream>>>(p); break;
    case 2: DigestChangeKernel<2><<<blocks, kDigestThreads, 0, p.stream>>>(p); break;
    case 4: DigestChangeKernel<4><<<blocks, kDigestThreads, 0, p.stream>>>(p); break;
    default: DigestChangeKernel<8><<<blocks, kDigestThreads, 0, p.stream>>>(p); break;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SumPartialsKernel<<<1, 1024, 0, p.stream>>>(p.partials, blocks, p.results);
  return cudaGetLastError();
}

cudaError_t LaunchXxh3_128(const XxhLaunch& p) {
  const uint64_t blocks = XxhBlocks(p.bytes);
  const uint8_t* data = static_cast<const uint8_t*>(p.data);
  if (blocks > 0) {
    const uint64_t threads = blocks * 8;
    const unsigned grid = static_cast<unsigned>((threads + 255) / 256);
    XxhBlockSumsKernel<<<grid, 256, 0, p.stream>>>(data, blocks, p.block_sums);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  XxhChainKernel<<<1, 32, 0, p.stream>>>(data, p.bytes, blocks, p.block_sums, p.results);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::internal
