// The scale step of the fused quantize-then-diff (the diff itself is
// diff.cu's kernel, reading the weight through QuantizeGroup): one pass over
// the weight takes every scale group's amax, a second tiny one turns each
// amax into its scale and inverse with deltasync/quantize.h's Fp8ScaleFor.
#include <algorithm>

#include "cuda/cuda_internal.h"
#include "cuda/kernel_util.cuh"
#include "cuda/quantize.cuh"

namespace deltasync::cuda::internal {
namespace {

constexpr unsigned kAmaxThreads = 256;
// A tile of the amax pass lies inside one scale group: a 128 x 128 block,
// or up to this many columns of one row.
constexpr uint64_t kRowTile = 8192;

template <QuantKind K>
__global__ void __launch_bounds__(kAmaxThreads)
    AmaxKernel(QuantLoad q, uint64_t rows, uint64_t tiles, unsigned int* amax_bits) {
  using S = QuantElem<K>;
  using T = typename S::T;
  constexpr uint64_t kPerLoad = 16 / sizeof(T);
  __shared__ unsigned int s_max[kAmaxThreads / 32];
  const bool block128 = static_cast<QuantScheme>(q.scheme) == QuantScheme::kBlock128;
  const uint64_t tile_rows = block128 ? kQuantBlock : 1;
  const uint64_t tile_cols = block128 ? kQuantBlock : kRowTile;
  const uint64_t per_row = (q.cols + tile_cols - 1) / tile_cols;
  const T* w = static_cast<const T*>(q.weight);
  const bool vector = q.aligned16 && q.cols % kPerLoad == 0;
  for (uint64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const uint64_t tr = t / per_row, tc = t - tr * per_row;
    const uint64_t r0 = tr * tile_rows, c0 = tc * tile_cols;
    const uint64_t nr = min(tile_rows, rows - r0), nc = min(tile_cols, q.cols - c0);
    unsigned int m = 0;
    if (vector) {
      const uint64_t per = nc / kPerLoad;
      for (uint64_t i = threadIdx.x; i < nr * per; i += kAmaxThreads) {
        const uint64_t r = i / per, v = i - r * per;
        const uint4 g = __ldcs(reinterpret_cast<const uint4*>(w + (r0 + r) * q.cols + c0) + v);
#pragma unroll
        for (int k = 0; k < static_cast<int>(kPerLoad); ++k) {
          m = max(m, static_cast<unsigned int>(ElemOf<sizeof(T)>(g, k)) & S::kAbsMask);
        }
      }
    } else {
      for (uint64_t i = threadIdx.x; i < nr * nc; i += kAmaxThreads) {
        const uint64_t r = i / nc, c = i - r * nc;
        m = max(m, static_cast<unsigned int>(w[(r0 + r) * q.cols + c0 + c]) & S::kAbsMask);
      }
    }
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (unsigned j = 1; j < kAmaxThreads / 32; ++j) m = max(m, s_max[j]);
      const uint64_t group = block128                                                         ? t
                             : static_cast<QuantScheme>(q.scheme) == QuantScheme::kPerChannel ? tr
                                                                                              : 0;
      if (m != 0) atomicMax(amax_bits + group, m);
    }
    __syncthreads();
  }
}

template <QuantKind K>
__global__ void ScaleKernel(QuantScaleLaunch p) {
  using S = QuantElem<K>;
  const QuantRecipe recipe{static_cast<QuantScheme>(p.load.scheme),
                           static_cast<ScaleFormat>(p.scale_format)};
  for (uint64_t g = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; g < p.groups;
       g += uint64_t{gridDim.x} * blockDim.x) {
    const unsigned int bits = p.amax_bits[g];
    if (bits >= S::kNonFinite) {
      atomicExch(&p.results->count, 1ull);
      p.inv[g] = 0.0f;
      continue;
    }
    const Fp8GroupScale s = Fp8ScaleFor(recipe, S::ToFloat(bits));
    p.inv[g] = s.inv;
    if (recipe.scale_format == ScaleFormat::kUe8m0) {
      static_cast<uint8_t*>(p.scales)[g] = Ue8m0Byte(s.sf);
    } else {
      static_cast<float*>(p.scales)[g] = s.sf;
    }
  }
}

template <QuantKind K>
cudaError_t LaunchK(const QuantScaleLaunch& p) {
  const bool block128 = static_cast<QuantScheme>(p.load.scheme) == QuantScheme::kBlock128;
  const uint64_t tile_rows = block128 ? kQuantBlock : 1;
  const uint64_t tile_cols = block128 ? kQuantBlock : kRowTile;
  const uint64_t tiles =
      ((p.rows + tile_rows - 1) / tile_rows) * ((p.load.cols + tile_cols - 1) / tile_cols);
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(tiles, uint64_t{1} << 20));
  AmaxKernel<K><<<grid, kAmaxThreads, 0, p.stream>>>(p.load, p.rows, tiles, p.amax_bits);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const unsigned sgrid = static_cast<unsigned>(std::min<uint64_t>((p.groups + 255) / 256, 4096));
  ScaleKernel<K><<<sgrid, 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

template <QuantKind K>
__global__ void EncodeKernel(QuantLoad q, uint64_t numel, uint8_t* codes) {
  const bool aligned = reinterpret_cast<uintptr_t>(codes) % 16 == 0;
  for (uint64_t g = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; g * 16 < numel;
       g += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t first = g * 16;
    const uint4 v = QuantizeGroup<K>(q, first, numel);
    if (aligned && first + 16 <= numel) {
      *reinterpret_cast<uint4*>(codes + first) = v;
    } else {
      for (int k = 0; k < 16 && first + k < numel; ++k) {
        codes[first + k] = static_cast<uint8_t>(ElemAt<1>(v, k));
      }
    }
  }
}

}  // namespace

cudaError_t LaunchQuantEncode(const QuantLoad& q, uint64_t numel, uint8_t* codes,
                              cudaStream_t stream) {
  const uint64_t groups = (numel + 15) / 16;
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>((groups + 255) / 256, 65536));
  switch (q.kind) {
    case QuantKind::kBf16:
      EncodeKernel<QuantKind::kBf16><<<grid, 256, 0, stream>>>(q, numel, codes);
      break;
    case QuantKind::kF16:
      EncodeKernel<QuantKind::kF16><<<grid, 256, 0, stream>>>(q, numel, codes);
      break;
    case QuantKind::kF32:
      EncodeKernel<QuantKind::kF32><<<grid, 256, 0, stream>>>(q, numel, codes);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchQuantScales(const QuantScaleLaunch& p) {
  cudaError_t err = cudaMemsetAsync(p.amax_bits, 0, p.groups * sizeof(unsigned int), p.stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(p.results, 0, sizeof(Results), p.stream);
  if (err != cudaSuccess) return err;
  switch (p.load.kind) {
    case QuantKind::kBf16: return LaunchK<QuantKind::kBf16>(p);
    case QuantKind::kF16: return LaunchK<QuantKind::kF16>(p);
    case QuantKind::kF32: return LaunchK<QuantKind::kF32>(p);
  }
  return cudaErrorInvalidValue;
}

}  // namespace deltasync::cuda::internal
