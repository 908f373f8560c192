// The fused diff on the device: one pass over the current tensor and its
// snapshot compares them as integers of the element size, compacts the
// changed elements' positions and values in position order, refreshes the
// snapshot where it changed and sums the digest change.
//
// Order without a second pass: a single-pass scan with decoupled look-back.
// Each block takes the next tile by ticket (so every tile before it has
// started, and the wait below always ends), counts its changes, publishes
// that count, then reads its predecessors' states back until one holds an
// inclusive prefix. Its offset known, it writes its changes there and
// publishes its own inclusive prefix.
#include "core/element_digest.h"
#include "cuda/cuda_internal.h"
#include "cuda/kernel_util.cuh"
#include "cuda/quantize.cuh"

namespace deltasync::cuda::internal {
namespace {

namespace ed = ::deltasync::element_digest;

constexpr unsigned long long kFlagAggregate = 1ull << 62;
constexpr unsigned long long kFlagPrefix = 2ull << 62;
constexpr unsigned long long kValueMask = (1ull << 62) - 1;

template <int W>
__device__ __forceinline__ uint32_t ChangeMask(const uint4& a, const uint4& b) {
  constexpr int E = 16 / W;
  uint32_t mask = 0;
#pragma unroll
  for (int k = 0; k < E; ++k) {
    if (ElemOf<W>(a, k) != ElemOf<W>(b, k)) mask |= 1u << k;
  }
  return mask;
}

// Inclusive scan over the warp of packed per-round counts (16 bits each).
__device__ __forceinline__ unsigned long long WarpScan(unsigned long long v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long up = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

__device__ __forceinline__ uint64_t Field(unsigned long long packed, int r) {
  return (packed >> (16 * r)) & 0xFFFFu;
}

// The exclusive offset of `tile` among all changes, by look-back, run by
// the block's first warp: each step reads the states of the 128 tiles
// before the window's end at once (4 a lane), and stops at the nearest that
// holds an inclusive prefix. A wide window keeps the prefixes moving ahead
// as fast as tiles finish; waiting lanes back off rather than poll.
__device__ uint64_t LookBack(unsigned long long* state, uint64_t tile, uint64_t total) {
  constexpr int kPerLane = 4;
  constexpr long long kWindow = 32 * kPerLane;
  const int lane = threadIdx.x & 31;
  if (tile == 0) {
    if (lane == 0) atomicExch(&state[0], kFlagPrefix | total);
    return 0;
  }
  if (lane == 0) atomicExch(&state[tile], kFlagAggregate | total);
  uint64_t exclusive = 0;
  long long end = static_cast<long long>(tile) - 1;  // the window's newest tile
  for (;;) {
    unsigned long long s[kPerLane];
    bool missing = false;
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      const long long j = end - (32 * q + lane);
      // Before tile 0: a prefix of 0.
      s[q] = kFlagPrefix;
      if (j >= 0) s[q] = *reinterpret_cast<volatile unsigned long long*>(&state[j]);
      missing |= s[q] == 0;
    }
    while (__any_sync(0xFFFFFFFFu, missing)) {
      __nanosleep(100);
      missing = false;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) {
        if (s[q] == 0) {
          s[q] = *reinterpret_cast<volatile unsigned long long*>(&state[end - (32 * q + lane)]);
          missing |= s[q] == 0;
        }
      }
    }
    // The nearest prefix: the smallest distance 32 * q + lane holding one.
    bool found = false;
    int stop = static_cast<int>(kWindow) - 1;
#pragma unroll
    for (int q = kPerLane - 1; q >= 0; --q) {
      const unsigned prefixes = __ballot_sync(0xFFFFFFFFu, (s[q] & kFlagPrefix) != 0);
      if (prefixes) {
        stop = 32 * q + __ffs(prefixes) - 1;
        found = true;
      }
    }
    uint64_t mine = 0;
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      if (32 * q + lane <= stop) mine += s[q] & kValueMask;
    }
    exclusive += WarpSum(mine);
    if (found) break;
    end -= kWindow;
  }
  if (lane == 0) atomicExch(&state[tile], kFlagPrefix | (exclusive + total));
  return exclusive;
}

// kQuant: the current elements are the codes of p.quant's weight, of that
// kind (W == 1); -1: read from p.current.
template <int W, bool kAligned, int kQuant = -1>
__global__ void __launch_bounds__(kDiffThreads) DiffKernel(DiffLaunch p) {
  constexpr int E = 16 / W;
  constexpr int R = DiffRounds(W);
  constexpr int kWords = (R + 3) / 4;  // per-round counts, 16 bits each
  constexpr uint64_t kTileElems = DiffTileElems(W);
  using T = typename ElemType<W>::T;
  __shared__ unsigned long long s_ticket;
  __shared__ unsigned long long s_prefix;
  __shared__ unsigned long long s_warp[kWords][kDiffThreads / 32];
  __shared__ unsigned long long s_sum[64];

  const int t = threadIdx.x;
  if (t == 0) s_ticket = atomicAdd(p.ticket, 1ull);
  __syncthreads();
  const uint64_t tile = s_ticket;
  const uint64_t tile_first = tile * kTileElems;
  const void* snap_read = p.snapshot_read != nullptr ? p.snapshot_read : p.snapshot;
  const uint64_t read_first = p.snapshot_read != nullptr ? p.read_first : 0;

  uint4 cur[R], old[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint64_t first = tile_first + (static_cast<uint64_t>(r) * kDiffThreads + t) * E;
    if constexpr (kQuant < 0) {
      cur[r] = LoadGroup<W, kAligned>(p.current, first, p.numel);
    } else {
      static_assert(W == 1, "codes are bytes");
      cur[r] = QuantizeGroup<static_cast<QuantKind>(kQuant)>(p.quant, first, p.numel);
    }
    old[r] = LoadGroup<W, kAligned>(snap_read, first - read_first, p.numel - read_first);
  }
  uint32_t mask[R];
  unsigned long long packed[kWords] = {};
#pragma unroll
  for (int r = 0; r < R; ++r) {
    mask[r] = ChangeMask<W>(cur[r], old[r]);
    packed[r / 4] |= static_cast<unsigned long long>(__popc(mask[r])) << (16 * (r % 4));
  }

  // Block-wide exclusive scans of the packed counts (each field stays below
  // 2^16: at most 256 * 16 changes per round).
  const int lane = t & 31, warp = t >> 5;
  unsigned long long inclusive[kWords];
#pragma unroll
  for (int q = 0; q < kWords; ++q) {
    inclusive[q] = WarpScan(packed[q]);
    if (lane == 31) s_warp[q][warp] = inclusive[q];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      unsigned long long v = lane < kDiffThreads / 32 ? s_warp[q][lane] : 0;
      v = WarpScan(v);
      if (lane < kDiffThreads / 32) s_warp[q][lane] = v;
    }
  }
  __syncthreads();
  unsigned long long exclusive[kWords], totals[kWords];
  uint64_t total = 0;
#pragma unroll
  for (int q = 0; q < kWords; ++q) {
    exclusive[q] = inclusive[q] - packed[q] + (warp > 0 ? s_warp[q][warp - 1] : 0);
    totals[q] = s_warp[q][kDiffThreads / 32 - 1];
#pragma unroll
    for (int r = 0; r < 4; ++r) total += Field(totals[q], r);
  }
  if (warp == 0) {
    const uint64_t prefix = LookBack(p.tile_state, tile, total);
    if (lane == 0) s_prefix = prefix;
  }
  __syncthreads();

  uint64_t offset = s_prefix;
  unsigned long long da = 0, db = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    uint64_t at = offset + Field(exclusive[r / 4], r % 4);
    offset += Field(totals[r / 4], r % 4);
    const uint32_t m = mask[r];
    if (m == 0) continue;
    const uint64_t first = tile_first + (static_cast<uint64_t>(r) * kDiffThreads + t) * E;
    const bool whole = kAligned && first + E <= p.numel;
    // One pass per changed element (not an unrolled pass per element of
    // the group: that code would not fit the instruction cache).
    for (uint32_t bits = m; bits != 0; bits &= bits - 1) {
      const int k = __ffs(bits) - 1;
      const uint64_t pos = first + k;
      const uint64_t nv = ElemAt<W>(cur[r], k);
      const uint64_t ov = ElemAt<W>(old[r], k);
      if (p.wide) {
        static_cast<long long*>(p.positions)[at] = static_cast<long long>(pos);
      } else {
        static_cast<int32_t*>(p.positions)[at] = static_cast<int32_t>(pos);
      }
      static_cast<T*>(p.values)[at] = static_cast<T>(nv);
      if (p.old_values != nullptr) static_cast<T*>(p.old_values)[at] = static_cast<T>(ov);
      if (p.digest) {
        const uint64_t key = ed::PositionKey(p.first_position + pos, W);
        const uint64_t ka = ed::KeyA(key), kb = ed::KeyB(key);
        da += ed::FmixA(ka ^ nv) - ed::FmixA(ka ^ ov);
        db += ed::FmixB(kb ^ nv) - ed::FmixB(kb ^ ov);
      }
      ++at;
      if (p.refresh && !whole) static_cast<T*>(p.snapshot)[pos] = static_cast<T>(nv);
    }
    // A whole aligned group is rewritten at once: its unchanged elements
    // get their own bits back.
    if (p.refresh && whole) {
      *reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.snapshot) + first * W) = cur[r];
    }
  }
  if (p.digest) {
    BlockSum2(da, db, s_sum);
    if (t == 0) {
      p.tile_digest[2 * tile] = da;
      p.tile_digest[2 * tile + 1] = db;
    }
  }
}

// The count (the last tile's inclusive prefix) and the digest change (the
// tiles' sums), in one block.
__global__ void FinishDiffKernel(const unsigned long long* state,
                                 const unsigned long long* tile_digest, uint64_t tiles, bool digest,
                                 Results* results) {
  __shared__ unsigned long long s_sum[64];
  unsigned long long a = 0, b = 0;
  if (digest) {
    for (uint64_t i = threadIdx.x; i < tiles; i += blockDim.x) {
      a += tile_digest[2 * i];
      b += tile_digest[2 * i + 1];
    }
  }
  BlockSum2(a, b, s_sum);
  if (threadIdx.x == 0) {
    results->count = state[tiles - 1] & kValueMask;
    results->a = a;
    results->b = b;
  }
}

template <int W, int kQuant = -1>
cudaError_t LaunchDiffW(const DiffLaunch& p) {
  const unsigned grid = static_cast<unsigned>(p.tiles);
  if (p.aligned16) {
    DiffKernel<W, true, kQuant><<<grid, kDiffThreads, 0, p.stream>>>(p);
  } else {
    DiffKernel<W, false, kQuant><<<grid, kDiffThreads, 0, p.stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchDiffReset(const DiffLaunch& p, uint64_t tiles) {
  cudaError_t err = cudaMemsetAsync(p.tile_state, 0, tiles * sizeof(unsigned long long), p.stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(p.ticket, 0, sizeof(unsigned long long), p.stream);
  return err;
}

cudaError_t LaunchDiffTiles(const DiffLaunch& p) {
  if (p.quant.weight != nullptr) {
    switch (p.quant.kind) {
      case QuantKind::kBf16: return LaunchDiffW<1, static_cast<int>(QuantKind::kBf16)>(p);
      case QuantKind::kF16: return LaunchDiffW<1, static_cast<int>(QuantKind::kF16)>(p);
      case QuantKind::kF32: return LaunchDiffW<1, static_cast<int>(QuantKind::kF32)>(p);
    }
    return cudaErrorInvalidValue;
  }
  switch (p.elem_size) {
    case 1: return LaunchDiffW<1>(p);
    case 2: return LaunchDiffW<2>(p);
    case 4: return LaunchDiffW<4>(p);
    default: return LaunchDiffW<8>(p);
  }
}

cudaError_t LaunchDiffFinish(const DiffLaunch& p, uint64_t tiles) {
  FinishDiffKernel<<<1, 1024, 0, p.stream>>>(p.tile_state, p.tile_digest, tiles, p.digest,
                                             p.results);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::internal
