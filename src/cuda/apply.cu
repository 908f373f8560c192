// The receiver's apply on the device: the positions are checked first (in
// range, strictly ascending), then each value is written at its position,
// directly or through the destination's runs (a slice the receiver holds).
// Values are raw bits: NaN, -0.0 and every other pattern land as sent.
#include <cstdint>

#include "cuda/cuda_internal.h"
#include "cuda/kernel_util.cuh"

namespace deltasync::cuda::internal {
namespace {

__global__ void CheckPositionsKernel(ScatterLaunch p) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    const long long pos = PositionOfWidth(p.positions, p.width, i);
    bool bad = pos < 0 || static_cast<uint64_t>(pos) >= p.limit;
    if (!bad && i > 0) bad = PositionOfWidth(p.positions, p.width, i - 1) >= pos;
    if (bad) atomicMin(&p.results->count, static_cast<unsigned long long>(i));
  }
}

template <int W>
__global__ void ScatterKernel(ScatterLaunch p) {
  using T = typename ElemType<W>::T;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  T* dest = static_cast<T*>(p.dest);
  const T* values = static_cast<const T*>(p.values);
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    dest[PositionOfWidth(p.positions, p.width, i)] = values[i];
  }
}

// Where tensor element `pos` lies in a destination of `nruns` runs
// (ascending hf_first): in the last run starting at or before it, when it
// falls inside that run; UINT64_MAX when no run holds it.
__device__ __forceinline__ uint64_t DestOf(const RunLaunch* runs, uint64_t nruns, uint64_t pos) {
  uint64_t lo = 0, hi = nruns;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (runs[mid].hf_first <= pos) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == 0) return UINT64_MAX;
  const RunLaunch r = runs[lo - 1];
  if (pos - r.hf_first >= r.count) return UINT64_MAX;
  return r.dest_offset + (pos - r.hf_first);
}

template <int W>
__global__ void ScatterRunsKernel(ScatterRunsLaunch p) {
  using T = typename ElemType<W>::T;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  T* dest = static_cast<T*>(p.dest);
  const T* values = static_cast<const T*>(p.values);
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    const uint64_t pos = static_cast<uint64_t>(PositionOfWidth(p.positions, p.width, i));
    const uint64_t at = DestOf(p.runs, p.nruns, pos);
    if (at < p.dest_numel) dest[at] = values[i];
  }
}

// One value of a batch: item k is the last whose first value is at or
// before i; its value j = i - starts[k] goes where ScatterRunsKernel would
// put it.
template <int W>
__device__ __forceinline__ void CopyElem(void* dest, uint64_t at, const void* values, uint64_t j) {
  using T = typename ElemType<W>::T;
  static_cast<T*>(dest)[at] = static_cast<const T*>(values)[j];
}

// The last item whose first value is at or before i, searched in [lo, hi).
__device__ __forceinline__ uint64_t ItemOf(const uint64_t* starts, uint64_t lo, uint64_t hi,
                                           uint64_t i) {
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (starts[mid] <= i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

// Each block takes blockDim.x consecutive values at a time: one thread finds
// the item of the first among all items and then the item of the last
// among the blockDim.x items after it (each item holds at least one
// value); every value then searches only between the two, mostly one or two
// items, so the cost per value does not grow with the number of items.
__global__ void ScatterBatchKernel(ScatterBatchLaunch p) {
  __shared__ uint64_t block_items[2];
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t base = uint64_t{blockIdx.x} * blockDim.x; base < p.total; base += stride) {
    if (threadIdx.x == 0) {
      const uint64_t first = ItemOf(p.starts, 0, p.nitems, base);
      const uint64_t last_value = min(p.total, base + blockDim.x) - 1;
      block_items[0] = first;
      block_items[1] = ItemOf(p.starts, first, min(p.nitems, first + blockDim.x), last_value) + 1;
    }
    __syncthreads();
    const uint64_t i = base + threadIdx.x;
    const uint64_t lo = block_items[0], hi = block_items[1];
    __syncthreads();
    if (i >= p.total) continue;
    const uint64_t k = ItemOf(p.starts, lo, hi, i);
    const BatchItemLaunch& it = p.items[k];
    const uint64_t j = i - p.starts[k];
    const uint64_t pos = it.positions == nullptr
                             ? it.first + j
                             : static_cast<uint64_t>(PositionOfWidth(it.positions, it.width, j));
    const uint64_t at = DestOf(it.runs, it.nruns, pos);
    if (at >= it.dest_numel) continue;
    switch (it.elem_size) {
      case 1: CopyElem<1>(it.dest, at, it.values, j); break;
      case 2: CopyElem<2>(it.dest, at, it.values, j); break;
      case 4: CopyElem<4>(it.dest, at, it.values, j); break;
      default: CopyElem<8>(it.dest, at, it.values, j); break;
    }
  }
}

unsigned GridFor(uint64_t count, unsigned threads) {
  const uint64_t blocks = (count + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks == 0 ? 1 : blocks) : 65536);
}

}  // namespace

cudaError_t LaunchCheckPositions(const ScatterLaunch& p) {
  cudaError_t err = cudaMemsetAsync(&p.results->count, 0xFF, sizeof(p.results->count), p.stream);
  if (err != cudaSuccess) return err;
  CheckPositionsKernel<<<GridFor(p.count, 256), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchScatter(const ScatterLaunch& p) {
  const unsigned grid = GridFor(p.count, 256);
  switch (p.elem_size) {
    case 1: ScatterKernel<1><<<grid, 256, 0, p.stream>>>(p); break;
    case 2: ScatterKernel<2><<<grid, 256, 0, p.stream>>>(p); break;
    case 4: ScatterKernel<4><<<grid, 256, 0, p.stream>>>(p); break;
    default: ScatterKernel<8><<<grid, 256, 0, p.stream>>>(p); break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchScatterRuns(const ScatterRunsLaunch& p) {
  const unsigned grid = GridFor(p.count, 256);
  switch (p.elem_size) {
    case 1: ScatterRunsKernel<1><<<grid, 256, 0, p.stream>>>(p); break;
    case 2: ScatterRunsKernel<2><<<grid, 256, 0, p.stream>>>(p); break;
    case 4: ScatterRunsKernel<4><<<grid, 256, 0, p.stream>>>(p); break;
    default: ScatterRunsKernel<8><<<grid, 256, 0, p.stream>>>(p); break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchScatterBatch(const ScatterBatchLaunch& p) {
  ScatterBatchKernel<<<GridFor(p.total, 256), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::internal
