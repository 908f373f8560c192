// FP8 quantization of BF16/F16/F32 weights, bit for bit as the rollout
// engines' loaders do it, so that a trainer can send the engines FP8 bytes
// that equal what they would have made from the high-precision weights.
//
// Output: F8_E4M3 codes (torch.float8_e4m3fn: 1 sign, 4 exponent bits of
// bias 7, 3 mantissa bits, no infinities, NaN 0x7F/0xFF, largest finite
// 448), one per element, in the weight's shape, plus a scale tensor of the
// dequantization multipliers (dequant = E4M3 value * scale). Every recipe
// works in float32: it takes amax = max |x| of a group of elements, turns
// it into the group's scale sf, computes inv = 1.0f / sf (IEEE float32
// division) and encodes each x as E4M3(clamp(float32(x) * inv, -448, 448)),
// rounding to nearest, ties to even. Scale groups:
//
// - QuantScheme::kBlock128: DeepGEMM's `per_block_cast_to_fp8`, as vLLM
//   (vllm/utils/deep_gemm.py @ 779d1fc154ee91e5decea00ab46e4ba6532c45e9)
//   and SGLang (python/sglang/srt/layers/quantization/fp8_utils.py @
//   6082c49139ac8f1c99a835840de73971faa15e8e) run it. Blocks of 128 x 128
//   elements; blocks at the right and bottom edges are partial (DeepGEMM
//   zero-pads them, and padding never raises an amax). amax is floored at
//   1e-4f (torch's .clamp(1e-4)); sf = amax * R, R = float32(1/448)
//   (0x3B124925), not the quotient amax / 448.0f that the Python reads:
//   torch divides a CUDA tensor by a Python scalar as a product with the
//   scalar's float32 reciprocal (aten/src/ATen/native/cuda/
//   BinaryDivTrueKernel.cu, "compute a * reciprocal(b)"), and Inductor,
//   which compiles vLLM's copy (@torch.compile), lowers division by a
//   constant the same way (torch/_inductor/lowering.py, div_prim). The two
//   differ by an ULP for about a third of all amax values. With a ue8m0
//   scale format sf becomes the smallest power of two >= sf, computed
//   exactly on the float32 bits; torch computes pow(2, ceil(log2(sf))) in
//   float32, which keeps the power of two below sf where sf lies within an
//   ULP or two above one (F32 weights only: the two agreed on an H100 for
//   every BF16 and F16 amax). Scale
//   tensor: [ceil(M/128), ceil(N/128)], row major, DeepSeek-V3's
//   `weight_scale_inv`. Checked on an H100 (torch 2.11, both eager and
//   compiled) for every finite BF16 and F16 amax and random F32 ones:
//   identical scales and codes, except that Inductor's 1/sf is Triton's
//   approximate division, which moved 27 of 4.06M codes in the F16 sweep
//   with F32 scales (none with ue8m0 scales, whose reciprocal is exact).
// - QuantScheme::kPerTensor: vLLM's dynamic per-tensor kernel
//   (csrc/quantization/w8a8/fp8/common.cu @ 096d3dc9 and common.cuh,
//   `scaled_fp8_conversion`): one group, sf = amax / 448.0f (an IEEE
//   quotient: CUDA C++ dividing by the constant), with no floor. Where
//   amax / 448.0f has no finite float32 reciprocal (amax == 0, or amax
//   below about 1.3e-36) we take sf = 1.0f, so an all-zero tensor gets
//   zero codes; vLLM's kernel divides by zero there and writes 448
//   everywhere. Scale tensor: F32 [1].
// - QuantScheme::kPerChannel: SGLang's per-output-channel load path
//   (per_token_group_quant_fp8 with the group as wide as a row, Triton
//   `_per_token_group_quant_8bit` in
//   python/sglang/srt/layers/quantization/fp8_kernel.py): one group per
//   row, amax floored at 1e-10f, sf = amax * R as for kBlock128 (Triton's
//   division, div.full.f32, multiplies by the reciprocal of 448, which is
//   R). Scale tensor: F32 [M, 1]. Its inv = 1.0f / sf is that same
//   approximate division, not reproducible on a CPU: we take the IEEE
//   quotient. Checked on an H100 (Triton 3.6) for every finite BF16 and
//   F16 row amax: identical scales, codes identical but for 62 of 8.1M in
//   the F16 sweep (none for BF16 or F32 weights).
//
// Non-finite weights (NaN, infinity) are refused. Results depend on no
// floating-point environment other than the default rounding mode.
//
// Sharded trainers: a scale group may straddle the border between two
// ranks' shards. The work is therefore split into Fp8GroupAmax (each rank
// takes the partial amax of the groups its window touches), a MAX-reduce
// across ranks by the caller, and Fp8QuantizeWindow (each rank encodes its
// window with the reduced amax). The result is byte-identical to
// quantizing the whole tensor at once. amax values are non-negative
// floats, which order like their bit patterns read as integers: an integer
// MAX reduction of the bits gives the same result as a float one.
//
// Nothing here starts threads: callers parallelize over windows. Each call
// reads its window once (GroupAmax) or once more (QuantizeWindow).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "deltasync/dtype.h"
#include "deltasync/status.h"

// The scale step and the encoder below are compiled for the GPU too (the
// fused quantize-then-diff of include/deltasync/cuda.h), so that both sides
// run one definition.
#if defined(__CUDACC__)
#define DS_QUANT_HOST_DEVICE __host__ __device__
#else
#define DS_QUANT_HOST_DEVICE
#endif

namespace deltasync {

// How elements are grouped under one scale (see the top of this file).
enum class QuantScheme : uint8_t { kBlock128, kPerTensor, kPerChannel };

// How a scale is rounded and stored.
enum class ScaleFormat : uint8_t {
  kF32,       // sf as computed, F32
  kUe8m0F32,  // sf rounded up to a power of two, stored as F32 (what vLLM and
              // SGLang hold before packing); kBlock128 only
  kUe8m0,     // sf rounded up to a power of two, stored as one F8_E8M0 byte
              // (the float32 exponent field: 2^(byte - 127)); kBlock128 only
};

struct QuantRecipe {
  QuantScheme scheme = QuantScheme::kBlock128;
  ScaleFormat scale_format = ScaleFormat::kF32;
};

// Edge of a kBlock128 scale block, and E4M3's largest finite value.
inline constexpr int64_t kQuantBlock = 128;
inline constexpr float kE4M3Max = 448.0f;

// "block128", "per_tensor", "per_channel".
std::string_view QuantSchemeName(QuantScheme scheme);
// "f32", "ue8m0_f32", "ue8m0".
std::string_view ScaleFormatName(ScaleFormat format);

// OK when the recipe's scale format is allowed with its scheme (ue8m0
// formats only with kBlock128); InvalidArgument otherwise.
Status CheckQuantRecipe(const QuantRecipe& recipe);

// The scale tensor's element type: kF8_E8M0 for ScaleFormat::kUe8m0, kF32
// otherwise (DTypeSize gives its element size).
DType QuantScaleDType(ScaleFormat format);

// The scale tensor's shape for a [rows, cols] weight: [ceil(rows/128),
// ceil(cols/128)], [1] or [rows, 1]. InvalidArgument for a recipe
// CheckQuantRecipe refuses, or rows or cols below 1.
Result<std::vector<int64_t>> QuantScaleShape(const QuantRecipe& recipe, int64_t rows, int64_t cols);

// Implementations of the amax and encode loops: the same source compiled
// for each ISA and picked at run time. All give identical bytes.
enum class QuantKernel : uint8_t { kGeneric, kAvx2, kAvx512 };

// "generic", "avx2", "avx512".
std::string_view QuantKernelName(QuantKernel kernel);
// Kernels this CPU (and OS) can run, slowest first; always starts with
// kGeneric. Off x86-64 only kGeneric exists.
std::vector<QuantKernel> AvailableQuantKernels();
// The fastest available kernel (AVX-512 > AVX2 > generic). Detected once.
QuantKernel BestQuantKernel();

// The weight being quantized.
struct QuantTensor {
  std::string_view name;           // for error messages only
  DType dtype = DType::kBF16;      // of its elements: kBF16, kF16 or kF32
  std::span<const int64_t> shape;  // of the whole weight: exactly [rows, cols]
};

// Rows [row_begin, row_end) x columns [col_begin, col_end) of the whole
// weight, and a pointer to that window's own elements: contiguous, row
// major, (row_end - row_begin) rows of (col_end - col_begin) elements. A
// whole tensor is the window {data, 0, rows, 0, cols}.
struct QuantWindow {
  const void* data = nullptr;
  int64_t row_begin = 0, row_end = 0;
  int64_t col_begin = 0, col_end = 0;
};

// A rectangle of the scale grid: the scale tensor seen as [scale rows,
// scale cols] ([ceil(M/128), ceil(N/128)], [1, 1] or [M, 1]).
struct QuantGroups {
  int64_t row_begin = 0, row_end = 0;
  int64_t col_begin = 0, col_end = 0;
  int64_t count() const { return (row_end - row_begin) * (col_end - col_begin); }
};

// The scale groups a window touches: the blocks it overlaps (kBlock128),
// its rows (kPerChannel), the one group (kPerTensor). Fp8GroupAmax and
// Fp8QuantizeWindow read and write one entry per group of it, row major
// over the rectangle. InvalidArgument on the refusals listed at
// Fp8GroupAmax.
Result<QuantGroups> Fp8WindowGroups(const QuantRecipe& recipe, const QuantTensor& tensor,
                                    const QuantWindow& window);

// Writes to group_amax[0, Fp8WindowGroups(...).count()) the largest |x|
// (as float32, before any floor) over the window's elements of each group
// it touches: a partial amax when the window holds only part of a group.
// `kernel` changes no byte, only the speed.
// InvalidArgument, with nothing written, when the recipe is refused
// (CheckQuantRecipe), the dtype is not BF16, F16 or F32, the shape is not
// 2-D with both dims >= 1, the window is empty, reversed or reaches outside
// the shape, a pointer is null, or `kernel` does not run on this CPU; and,
// naming the tensor, when the window holds a NaN or an infinity (found in
// the same pass, before anything is written).
Status Fp8GroupAmax(const QuantRecipe& recipe, const QuantTensor& tensor, const QuantWindow& window,
                    float* group_amax, QuantKernel kernel = BestQuantKernel());

// Encodes the window into `codes` (window-shaped, one F8_E4M3 byte per
// element, row stride col_end - col_begin) and writes the scales of the
// groups it touches to `scales` (Fp8WindowGroups(...).count() entries of
// QuantScaleDType(recipe.scale_format), row major over the rectangle).
// `group_amax` holds each of those groups' amax over the whole weight: the
// MAX of every window's Fp8GroupAmax for it. Windows that share a group
// write the same scale bytes for it.
// InvalidArgument, with nothing written, on the refusals of Fp8GroupAmax
// and on a group_amax entry that is negative, NaN or infinite.
// InvalidArgument naming the tensor when the window holds a NaN or an
// infinity, or an element larger in magnitude than its group's amax
// (group_amax was not taken over this data): both are found while
// encoding, so scales and codes may be partly written then.
Status Fp8QuantizeWindow(const QuantRecipe& recipe, const QuantTensor& tensor,
                         const QuantWindow& window, const float* group_amax, uint8_t* codes,
                         void* scales, QuantKernel kernel = BestQuantKernel());

// The whole tensor: Fp8GroupAmax then Fp8QuantizeWindow over one window.
// `data` holds rows x cols elements, row major; `codes` gets as many bytes,
// `scales` the whole scale tensor (QuantScaleShape). Fails as those two do.
Status Fp8Quantize(const QuantRecipe& recipe, const QuantTensor& tensor, const void* data,
                   uint8_t* codes, void* scales, QuantKernel kernel = BestQuantKernel());

// The F8_E4M3 code nearest x, ties to the even code, magnitudes above 448
// saturating to +-448 (the engines' kernels clamp to +-448 before the cast,
// and .to(torch.float8_e4m3fn) rounds to nearest even below that); -0.0
// gives 0x80. Every recipe encodes with it. For finite x: a NaN gives
// +-448 too, but recipes never pass one. Branch-free, so that loops over
// it vectorize; defined here so that they inline it.
DS_QUANT_HOST_DEVICE inline uint8_t Fp8E4M3FromFloat(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  // |x| as bits, saturated at 448 (0x43E00000). Signed compares: they
  // vectorize on every x86-64, unsigned ones only from SSE4.1.
  int32_t mag = static_cast<int32_t>(bits & 0x7FFFFFFFu);
  mag = mag < 0x43E00000 ? mag : 0x43E00000;
  // Normal codes (|x| >= 2^-6): keep 3 mantissa bits, rounding to nearest
  // even on the bits, and rebias the exponent from 127 to 7. A carry out of
  // the mantissa bumps the exponent, as it should.
  const int32_t normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3);
  // Subnormal codes (|x| < 2^-6, steps of 2^-9): adding 2^14, whose float32
  // ULP is 2^-9, rounds |x| to a multiple of 2^-9 in the FPU's own
  // nearest-even; the mantissa then holds the code (8 when it rounds up to
  // 2^-6, the smallest normal code).
  const float shifted = std::bit_cast<float>(mag) + 16384.0f;
  const int32_t subnormal = static_cast<int32_t>(std::bit_cast<uint32_t>(shifted) - 0x46800000u);
  // A mask, not ?:, to pick: GCC will not if-convert a select whose arm
  // holds a float add (it might trap), and the loop would not vectorize.
  const int32_t is_subnormal = -static_cast<int32_t>(mag < 0x3C800000);
  const int32_t code = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(code));
}

// 1/448 rounded to float32 (0x3B124925), as torch computes it on the host
// for `cuda_tensor / 448.0`.
inline constexpr float kInverseE4M3Max = 1.0f / kE4M3Max;

// A scale group's dequantization multiplier as stored (sf) and what its
// elements are multiplied by before encoding (inv = 1.0f / sf).
struct Fp8GroupScale {
  float sf = 1.0f;
  float inv = 1.0f;
};

// The recipes' amax -> scale step (the sources are at the top of this
// file), for a group's amax over the whole weight: finite and >= 0.
DS_QUANT_HOST_DEVICE inline Fp8GroupScale Fp8ScaleFor(const QuantRecipe& recipe, float amax) {
  float sf = 1.0f;
  switch (recipe.scheme) {
    case QuantScheme::kBlock128:
      // torch: x_amax.clamp(1e-4) / 448.0, then ceil_to_ue8m0. On a CUDA
      // tensor that division is a multiplication by the float32 reciprocal,
      // which differs from amax / 448.0f for about a third of all amax
      // values.
      sf = std::fmax(amax, 1e-4f) * kInverseE4M3Max;
      if (recipe.scale_format != ScaleFormat::kF32) {
        // The smallest power of two >= sf (a positive normal): the
        // mantissa rounded up into the exponent.
        sf = std::bit_cast<float>((std::bit_cast<uint32_t>(sf) + 0x7FFFFFu) & 0xFF800000u);
      }
      break;
    case QuantScheme::kPerChannel:
      // Triton: tl.maximum(absmax, eps = 1e-10) / fp8_max, whose
      // div.full.f32 multiplies by the reciprocal of 448: float32(1/448).
      sf = std::fmax(amax, 1e-10f) * kInverseE4M3Max;
      break;
    case QuantScheme::kPerTensor:
      // vLLM divides by whatever comes out, 0 included; we keep the codes
      // finite and meaningful instead.
      sf = amax / kE4M3Max;
      if (!(sf > 0.0f) || std::isinf(1.0f / sf)) sf = 1.0f;
      break;
  }
  return {sf, 1.0f / sf};
}

// The stored byte of a ue8m0 scale (ScaleFormat::kUe8m0): its float32
// exponent field.
DS_QUANT_HOST_DEVICE inline uint8_t Ue8m0Byte(float sf) {
  return static_cast<uint8_t>(std::bit_cast<uint32_t>(sf) >> 23);
}

}  // namespace deltasync
