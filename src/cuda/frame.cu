// The stream's flush frames in device memory (docs/format.md, "Stream:
// flush frame"): the reader's payload checks (zero padding, indices
// positions strictly increasing inside their range), and the sender's
// position copies (a unit's positions made absolute, at the frame's width)
// and unit splits of a chunk's sorted positions.
#include <cstdint>

#include "cuda/cuda_internal.h"
#include "cuda/kernel_util.cuh"

namespace deltasync::cuda::internal {
namespace {

constexpr unsigned kThreads = 256;

unsigned Grid(uint64_t work) {
  const uint64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : blocks < 65536 ? blocks : 65536);
}

__device__ __forceinline__ uint64_t RawAt(const uint8_t* p, uint64_t width, uint64_t k) {
  // Regions are 8-byte aligned in the frame, so 4- and 8-byte loads are
  // natural; u24 ones go a byte at a time.
  if (width == 3) return static_cast<uint64_t>(PositionOfWidth(p, 3, k));
  return width == 4 ? static_cast<uint64_t>(reinterpret_cast<const uint32_t*>(p)[k])
                    : reinterpret_cast<const unsigned long long*>(p)[k];
}

__global__ void FrameCheckKernel(FrameCheckLaunch p) {
  const uint64_t items = p.nzeros + p.total_positions;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < items; i += stride) {
    if (i < p.nzeros) {
      const FrameZero z = p.zeros[i];
      for (uint64_t b = 0; b < z.bytes; ++b) {
        if (p.base[z.offset + b] != 0) {
          atomicMin(&p.results->count, static_cast<unsigned long long>(i));
          break;
        }
      }
      continue;
    }
    // Element e of all the checks' positions: find its check.
    const uint64_t e = i - p.nzeros;
    uint64_t lo = 0, hi = p.npositions;
    while (hi - lo > 1) {
      const uint64_t mid = lo + (hi - lo) / 2;
      if (p.starts[mid] <= e) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const FramePositions c = p.positions[lo];
    const uint64_t k = e - p.starts[lo];
    const uint8_t* at = p.base + c.offset;
    const uint64_t raw = RawAt(at, c.width, k);
    // A negative position, read unsigned, is at or past 2^31 (2^63): never
    // below end (at most 2^56).
    bool bad = raw < c.first || raw >= c.end;
    if (!bad && k > 0) bad = RawAt(at, c.width, k - 1) >= raw;
    if (bad) atomicMin(&p.results->count, static_cast<unsigned long long>(p.nzeros + lo));
  }
}

__global__ void CopyPositionsKernel(CopyPositionsLaunch p) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    const uint64_t v =
        (p.src_wide ? static_cast<uint64_t>(static_cast<const long long*>(p.src)[i])
                    : static_cast<uint64_t>(static_cast<const uint32_t*>(p.src)[i])) +
        p.add;
    if (p.dest_width == 8) {
      static_cast<unsigned long long*>(p.dest)[i] = v;
    } else if (p.dest_width == 3) {
      uint8_t* b = static_cast<uint8_t*>(p.dest) + 3 * i;
      b[0] = static_cast<uint8_t>(v);
      b[1] = static_cast<uint8_t>(v >> 8);
      b[2] = static_cast<uint8_t>(v >> 16);
    } else {
      static_cast<uint32_t*>(p.dest)[i] = static_cast<uint32_t>(v);
    }
  }
}

__global__ void SplitPositionsKernel(SplitLaunch p) {
  const uint64_t k = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (k > p.units) return;
  const uint64_t bound = k * p.unit;
  uint64_t lo = 0, hi = p.count;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    const uint64_t v = p.wide
                           ? static_cast<uint64_t>(static_cast<const long long*>(p.positions)[mid])
                           : static_cast<const uint32_t*>(p.positions)[mid];
    if (v < bound) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  p.offsets[k] = lo;
}

}  // namespace

cudaError_t LaunchFrameCheck(const FrameCheckLaunch& p) {
  cudaError_t err = cudaMemsetAsync(&p.results->count, 0xFF, sizeof(p.results->count), p.stream);
  if (err != cudaSuccess) return err;
  FrameCheckKernel<<<Grid(p.nzeros + p.total_positions), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchCopyPositions(const CopyPositionsLaunch& p) {
  if (p.count == 0) return cudaSuccess;
  CopyPositionsKernel<<<Grid(p.count), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSplitPositions(const SplitLaunch& p) {
  SplitPositionsKernel<<<Grid(p.units + 1), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::internal
