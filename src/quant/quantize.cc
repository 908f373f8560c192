#include "deltasync/quantize.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/cpu_isa.h"

namespace deltasync {

namespace {

// Element types. Loads go through memcpy: a tensor in a safetensors mapping
// may be misaligned for its dtype. `abs` bits order like the magnitudes
// they encode, so amax is taken on integers and converted once per group;
// `abs >= kNonFinite` is a NaN or an infinity.
struct Bf16 {
  using T = uint16_t;
  static constexpr int32_t kAbsMask = 0x7FFF;
  static constexpr int32_t kNonFinite = 0x7F80;
  // Exact: BF16 is the upper half of a float32.
  static float ToFloat(uint32_t v) { return std::bit_cast<float>(v << 16); }
};

struct F16 {
  using T = uint16_t;
  static constexpr int32_t kAbsMask = 0x7FFF;
  static constexpr int32_t kNonFinite = 0x7C00;
  // Exact for finite halves, without a float32 subnormal anywhere (they are
  // slow on some CPUs): normals rebias the exponent (15 -> 127); subnormals
  // m * 2^-24 are (2^-14 + m * 2^-24) - 2^-14, both normal floats.
  static float ToFloat(uint32_t v) {
    const uint32_t h = v & 0x7FFFu, shifted = h << 13;
    const uint32_t normal = shifted + (112u << 23);
    const uint32_t subnormal = std::bit_cast<uint32_t>(
        std::bit_cast<float>(shifted + (113u << 23)) - std::bit_cast<float>(113u << 23));
    // A mask rather than ?: so that the loops vectorize (see quantize.h).
    const uint32_t is_subnormal = 0u - static_cast<uint32_t>(h < 0x400u);
    const uint32_t mag = (subnormal & is_subnormal) | (normal & ~is_subnormal);
    return std::bit_cast<float>(mag | ((v & 0x8000u) << 16));
  }
};

struct F32 {
  using T = uint32_t;
  static constexpr int32_t kAbsMask = 0x7FFFFFFF;
  static constexpr int32_t kNonFinite = 0x7F800000;
  static float ToFloat(uint32_t v) { return std::bit_cast<float>(v); }
};

// The two loops every recipe runs, over one run of elements that share a
// scale. Their bodies are compiled once per ISA: always inlined into
// wrappers that carry a per-function target attribute (not a file-wide -m
// flag, which would also apply to inline library code instantiated here:
// see diff_avx2.cc), one of which each call picks. Branch-free, so that the
// compiler vectorizes them at every width.
#define DS_QUANT_INLINE __attribute__((always_inline)) inline

// The largest |x| of n elements, as abs bits.
template <typename S>
DS_QUANT_INLINE int32_t MaxAbsBitsBody(const uint8_t* src, int64_t n) {
  int32_t max_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    typename S::T v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(v)), sizeof(v));
    const int32_t abs = static_cast<int32_t>(v) & S::kAbsMask;
    max_abs = max_abs > abs ? max_abs : abs;
  }
  return max_abs;
}

// Encodes n elements with one inverse scale; returns their largest |x| as
// abs bits, which the caller checks against the group's amax.
template <typename S>
DS_QUANT_INLINE int32_t EncodeRunBody(const uint8_t* src, int64_t n, float inv, uint8_t* codes) {
  int32_t max_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    typename S::T v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(v)), sizeof(v));
    const int32_t abs = static_cast<int32_t>(v) & S::kAbsMask;
    max_abs = max_abs > abs ? max_abs : abs;
    codes[i] = Fp8E4M3FromFloat(S::ToFloat(v) * inv);
  }
  return max_abs;
}

struct Loops {
  int32_t (*max_abs)(const uint8_t* src, int64_t n);
  int32_t (*encode)(const uint8_t* src, int64_t n, float inv, uint8_t* codes);
};

template <typename S>
int32_t MaxAbsGeneric(const uint8_t* src, int64_t n) {
  return MaxAbsBitsBody<S>(src, n);
}
template <typename S>
int32_t EncodeGeneric(const uint8_t* src, int64_t n, float inv, uint8_t* codes) {
  return EncodeRunBody<S>(src, n, inv, codes);
}

#if defined(__x86_64__)
#define DS_TARGET_AVX2 __attribute__((target("avx2")))
#define DS_TARGET_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512vl")))
template <typename S>
DS_TARGET_AVX2 int32_t MaxAbsAvx2(const uint8_t* src, int64_t n) {
  return MaxAbsBitsBody<S>(src, n);
}
template <typename S>
DS_TARGET_AVX2 int32_t EncodeAvx2(const uint8_t* src, int64_t n, float inv, uint8_t* codes) {
  return EncodeRunBody<S>(src, n, inv, codes);
}
template <typename S>
DS_TARGET_AVX512 int32_t MaxAbsAvx512(const uint8_t* src, int64_t n) {
  return MaxAbsBitsBody<S>(src, n);
}
template <typename S>
DS_TARGET_AVX512 int32_t EncodeAvx512(const uint8_t* src, int64_t n, float inv, uint8_t* codes) {
  return EncodeRunBody<S>(src, n, inv, codes);
}
#endif

// Callers have checked CpuRuns(kernel).
template <typename S>
Loops LoopsFor(QuantKernel kernel) {
  switch (kernel) {
#if defined(__x86_64__)
    case QuantKernel::kAvx2: return {MaxAbsAvx2<S>, EncodeAvx2<S>};
    case QuantKernel::kAvx512: return {MaxAbsAvx512<S>, EncodeAvx512<S>};
#endif
    default: break;
  }
  return {MaxAbsGeneric<S>, EncodeGeneric<S>};
}

bool CpuRuns(QuantKernel kernel) {
  switch (kernel) {
    case QuantKernel::kGeneric: return true;
    case QuantKernel::kAvx2: return core_internal::CpuRuns(core_internal::CpuIsa::kAvx2);
    case QuantKernel::kAvx512: return core_internal::CpuRuns(core_internal::CpuIsa::kAvx512);
  }
  return false;
}

void StoreScale(ScaleFormat format, float sf, void* scales, int64_t index) {
  if (format == ScaleFormat::kUe8m0) {
    static_cast<uint8_t*>(scales)[index] = Ue8m0Byte(sf);
  } else {
    std::memcpy(static_cast<uint8_t*>(scales) + index * 4, &sf, 4);
  }
}

std::string Prefix(const QuantTensor& tensor) {
  return tensor.name.empty() ? std::string("quantize")
                             : "quantize '" + std::string(tensor.name) + "'";
}

std::string Str(float v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  return buf;
}

// A validated call: the whole shape, the window's extent and its groups.
struct Geometry {
  int64_t rows = 0, cols = 0;
  int64_t window_rows = 0, window_cols = 0;
  QuantGroups groups;
};

QuantGroups GroupsOf(QuantScheme scheme, const QuantWindow& w) {
  switch (scheme) {
    case QuantScheme::kBlock128:
      return {w.row_begin / kQuantBlock, (w.row_end + kQuantBlock - 1) / kQuantBlock,
              w.col_begin / kQuantBlock, (w.col_end + kQuantBlock - 1) / kQuantBlock};
    case QuantScheme::kPerChannel: return {w.row_begin, w.row_end, 0, 1};
    case QuantScheme::kPerTensor: break;
  }
  return {0, 1, 0, 1};
}

Result<Geometry> CheckCall(const QuantRecipe& recipe, const QuantTensor& tensor,
                           const QuantWindow& window) {
  const std::string prefix = Prefix(tensor);
  Status recipe_ok = CheckQuantRecipe(recipe);
  if (!recipe_ok.ok()) return recipe_ok.WithContext(prefix);
  if (tensor.dtype != DType::kBF16 && tensor.dtype != DType::kF16 && tensor.dtype != DType::kF32) {
    return Status::InvalidArgument(prefix + ": dtype " + std::string(DTypeName(tensor.dtype)) +
                                   " cannot be quantized (BF16, F16 or F32 only)");
  }
  if (tensor.shape.size() != 2) {
    return Status::InvalidArgument(prefix + ": weight has " + std::to_string(tensor.shape.size()) +
                                   " dims, FP8 quantization takes 2");
  }
  Geometry g;
  g.rows = tensor.shape[0];
  g.cols = tensor.shape[1];
  if (g.rows < 1 || g.cols < 1) {
    return Status::InvalidArgument(prefix + ": shape [" + std::to_string(g.rows) + ", " +
                                   std::to_string(g.cols) + "] has no elements");
  }
  // Byte offsets of F32 elements must fit in int64.
  if (g.rows > std::numeric_limits<int64_t>::max() / 4 / g.cols) {
    return Status::InvalidArgument(prefix + ": shape [" + std::to_string(g.rows) + ", " +
                                   std::to_string(g.cols) + "] is too large");
  }
  const QuantWindow& w = window;
  if (w.row_begin < 0 || w.col_begin < 0 || w.row_end > g.rows || w.col_end > g.cols ||
      w.row_begin >= w.row_end || w.col_begin >= w.col_end) {
    return Status::InvalidArgument(prefix + ": window rows [" + std::to_string(w.row_begin) + ", " +
                                   std::to_string(w.row_end) + ") x cols [" +
                                   std::to_string(w.col_begin) + ", " + std::to_string(w.col_end) +
                                   ") is empty or outside the shape [" + std::to_string(g.rows) +
                                   ", " + std::to_string(g.cols) + "]");
  }
  if (w.data == nullptr) return Status::InvalidArgument(prefix + ": window data is null");
  g.window_rows = w.row_end - w.row_begin;
  g.window_cols = w.col_end - w.col_begin;
  g.groups = GroupsOf(recipe.scheme, w);
  return g;
}

// Columns [begin, end) of the window that fall in scale column `gc` (block
// columns for kBlock128; the whole window width otherwise), relative to
// the window.
struct Run {
  int64_t begin, end;
};
Run RunOf(QuantScheme scheme, const QuantWindow& w, int64_t gc) {
  if (scheme != QuantScheme::kBlock128) return {0, w.col_end - w.col_begin};
  const int64_t lo = std::max(w.col_begin, gc * kQuantBlock);
  const int64_t hi = std::min(w.col_end, (gc + 1) * kQuantBlock);
  return {lo - w.col_begin, hi - w.col_begin};
}

// The group row of window row r (0-based in the window).
int64_t GroupRowOf(QuantScheme scheme, const QuantWindow& w, const QuantGroups& groups, int64_t r) {
  switch (scheme) {
    case QuantScheme::kBlock128: return (w.row_begin + r) / kQuantBlock - groups.row_begin;
    case QuantScheme::kPerChannel: return r;
    case QuantScheme::kPerTensor: break;
  }
  return 0;
}

template <typename S>
Status GroupAmaxImpl(const QuantRecipe& recipe, const QuantTensor& tensor, const QuantWindow& w,
                     const Geometry& g, QuantKernel kernel, float* group_amax) {
  const Loops loops = LoopsFor<S>(kernel);
  const int64_t group_cols = g.groups.col_end - g.groups.col_begin;
  const int64_t count = g.groups.count();
  // abs bits per group; converted once at the end.
  std::vector<int32_t> acc(static_cast<size_t>(count), 0);
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = g.window_cols * static_cast<int64_t>(sizeof(typename S::T));
  for (int64_t r = 0; r < g.window_rows; ++r) {
    const uint8_t* row = base + r * row_bytes;
    int32_t* slot = acc.data() + GroupRowOf(recipe.scheme, w, g.groups, r) * group_cols;
    for (int64_t gc = 0; gc < group_cols; ++gc) {
      const Run run = RunOf(recipe.scheme, w, g.groups.col_begin + gc);
      const int32_t m = loops.max_abs(row + run.begin * static_cast<int64_t>(sizeof(typename S::T)),
                                      run.end - run.begin);
      slot[gc] = slot[gc] > m ? slot[gc] : m;
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    if (acc[static_cast<size_t>(i)] >= S::kNonFinite) {
      return Status::InvalidArgument(Prefix(tensor) + ": holds a NaN or an infinity (scale group " +
                                     std::to_string(i) + " of the window)");
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    group_amax[i] = S::ToFloat(static_cast<uint32_t>(acc[static_cast<size_t>(i)]));
  }
  return Status::OK();
}

template <typename S>
Status QuantizeImpl(const QuantRecipe& recipe, const QuantTensor& tensor, const QuantWindow& w,
                    const Geometry& g, QuantKernel kernel, const float* group_amax, uint8_t* codes,
                    void* scales) {
  const Loops loops = LoopsFor<S>(kernel);
  const int64_t group_cols = g.groups.col_end - g.groups.col_begin;
  const int64_t count = g.groups.count();
  std::vector<float> inv(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const Fp8GroupScale s = Fp8ScaleFor(recipe, group_amax[i]);
    inv[static_cast<size_t>(i)] = s.inv;
    StoreScale(recipe.scale_format, s.sf, scales, i);
  }
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = g.window_cols * static_cast<int64_t>(sizeof(typename S::T));
  for (int64_t r = 0; r < g.window_rows; ++r) {
    const uint8_t* row = base + r * row_bytes;
    uint8_t* out = codes + r * g.window_cols;
    const int64_t first = GroupRowOf(recipe.scheme, w, g.groups, r) * group_cols;
    for (int64_t gc = 0; gc < group_cols; ++gc) {
      const Run run = RunOf(recipe.scheme, w, g.groups.col_begin + gc);
      const int32_t m =
          loops.encode(row + run.begin * static_cast<int64_t>(sizeof(typename S::T)),
                       run.end - run.begin, inv[static_cast<size_t>(first + gc)], out + run.begin);
      // One check per run, not per element: NaN/inf, or an amax that was
      // not taken over this data (the codes would silently saturate).
      if (m >= S::kNonFinite) {
        return Status::InvalidArgument(Prefix(tensor) + ": holds a NaN or an infinity (row " +
                                       std::to_string(w.row_begin + r) + ")");
      }
      const float have = S::ToFloat(static_cast<uint32_t>(m));
      if (have > group_amax[first + gc]) {
        return Status::InvalidArgument(
            Prefix(tensor) + ": row " + std::to_string(w.row_begin + r) +
            " holds |x| = " + Str(have) + " above its scale group's amax " +
            Str(group_amax[first + gc]) + " (amax not taken over this data)");
      }
    }
  }
  return Status::OK();
}

}  // namespace

std::string_view QuantSchemeName(QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kBlock128: return "block128";
    case QuantScheme::kPerTensor: return "per_tensor";
    case QuantScheme::kPerChannel: return "per_channel";
  }
  return "unknown";
}

std::string_view ScaleFormatName(ScaleFormat format) {
  switch (format) {
    case ScaleFormat::kF32: return "f32";
    case ScaleFormat::kUe8m0F32: return "ue8m0_f32";
    case ScaleFormat::kUe8m0: return "ue8m0";
  }
  return "unknown";
}

Status CheckQuantRecipe(const QuantRecipe& recipe) {
  const std::string_view scheme = QuantSchemeName(recipe.scheme);
  const std::string_view format = ScaleFormatName(recipe.scale_format);
  if (scheme == "unknown" || format == "unknown") {
    return Status::InvalidArgument(
        "quant recipe: unknown scheme " + std::to_string(static_cast<int>(recipe.scheme)) +
        " or scale format " + std::to_string(static_cast<int>(recipe.scale_format)));
  }
  if (recipe.scheme != QuantScheme::kBlock128 && recipe.scale_format != ScaleFormat::kF32) {
    return Status::InvalidArgument("quant recipe: scale format " + std::string(format) +
                                   " needs block128 scales, not " + std::string(scheme));
  }
  return Status::OK();
}

DType QuantScaleDType(ScaleFormat format) {
  return format == ScaleFormat::kUe8m0 ? DType::kF8_E8M0 : DType::kF32;
}

Result<std::vector<int64_t>> QuantScaleShape(const QuantRecipe& recipe, int64_t rows,
                                             int64_t cols) {
  DS_RETURN_IF_ERROR(CheckQuantRecipe(recipe));
  if (rows < 1 || cols < 1) {
    return Status::InvalidArgument("quant scale shape: weight [" + std::to_string(rows) + ", " +
                                   std::to_string(cols) + "] has no elements");
  }
  switch (recipe.scheme) {
    case QuantScheme::kBlock128:
      return std::vector<int64_t>{(rows + kQuantBlock - 1) / kQuantBlock,
                                  (cols + kQuantBlock - 1) / kQuantBlock};
    case QuantScheme::kPerChannel: return std::vector<int64_t>{rows, 1};
    case QuantScheme::kPerTensor: break;
  }
  return std::vector<int64_t>{1};
}

std::string_view QuantKernelName(QuantKernel kernel) {
  switch (kernel) {
    case QuantKernel::kGeneric: return "generic";
    case QuantKernel::kAvx2: return "avx2";
    case QuantKernel::kAvx512: return "avx512";
  }
  return "unknown";
}

std::vector<QuantKernel> AvailableQuantKernels() {
  std::vector<QuantKernel> kernels;
  for (QuantKernel k : {QuantKernel::kGeneric, QuantKernel::kAvx2, QuantKernel::kAvx512}) {
    if (CpuRuns(k)) kernels.push_back(k);
  }
  return kernels;
}

QuantKernel BestQuantKernel() {
  static const QuantKernel best = AvailableQuantKernels().back();
  return best;
}

Result<QuantGroups> Fp8WindowGroups(const QuantRecipe& recipe, const QuantTensor& tensor,
                                    const QuantWindow& window) {
  DS_ASSIGN_OR_RETURN(const Geometry g, CheckCall(recipe, tensor, window));
  return g.groups;
}

namespace {

Status CheckKernel(const QuantTensor& tensor, QuantKernel kernel) {
  if (CpuRuns(kernel)) return Status::OK();
  return Status::InvalidArgument(Prefix(tensor) + ": kernel " +
                                 std::string(QuantKernelName(kernel)) +
                                 " does not run on this CPU");
}

}  // namespace

Status Fp8GroupAmax(const QuantRecipe& recipe, const QuantTensor& tensor, const QuantWindow& window,
                    float* group_amax, QuantKernel kernel) {
  DS_ASSIGN_OR_RETURN(const Geometry g, CheckCall(recipe, tensor, window));
  DS_RETURN_IF_ERROR(CheckKernel(tensor, kernel));
  if (group_amax == nullptr) {
    return Status::InvalidArgument(Prefix(tensor) + ": group_amax is null");
  }
  switch (tensor.dtype) {
    case DType::kBF16: return GroupAmaxImpl<Bf16>(recipe, tensor, window, g, kernel, group_amax);
    case DType::kF16: return GroupAmaxImpl<F16>(recipe, tensor, window, g, kernel, group_amax);
    default: break;
  }
  return GroupAmaxImpl<F32>(recipe, tensor, window, g, kernel, group_amax);
}

Status Fp8QuantizeWindow(const QuantRecipe& recipe, const QuantTensor& tensor,
                         const QuantWindow& window, const float* group_amax, uint8_t* codes,
                         void* scales, QuantKernel kernel) {
  DS_ASSIGN_OR_RETURN(const Geometry g, CheckCall(recipe, tensor, window));
  DS_RETURN_IF_ERROR(CheckKernel(tensor, kernel));
  const std::string prefix = Prefix(tensor);
  if (group_amax == nullptr || codes == nullptr || scales == nullptr) {
    return Status::InvalidArgument(prefix + ": group_amax, codes or scales is null");
  }
  for (int64_t i = 0; i < g.groups.count(); ++i) {
    if (!(group_amax[i] >= 0.0f) || std::isinf(group_amax[i])) {
      return Status::InvalidArgument(prefix + ": group_amax[" + std::to_string(i) +
                                     "] = " + Str(group_amax[i]) + " is not a finite amax");
    }
  }
  switch (tensor.dtype) {
    case DType::kBF16:
      return QuantizeImpl<Bf16>(recipe, tensor, window, g, kernel, group_amax, codes, scales);
    case DType::kF16:
      return QuantizeImpl<F16>(recipe, tensor, window, g, kernel, group_amax, codes, scales);
    default: break;
  }
  return QuantizeImpl<F32>(recipe, tensor, window, g, kernel, group_amax, codes, scales);
}

Status Fp8Quantize(const QuantRecipe& recipe, const QuantTensor& tensor, const void* data,
                   uint8_t* codes, void* scales, QuantKernel kernel) {
  const int64_t rows = tensor.shape.size() == 2 ? tensor.shape[0] : 0;
  const int64_t cols = tensor.shape.size() == 2 ? tensor.shape[1] : 0;
  const QuantWindow whole{data, 0, rows, 0, cols};
  DS_ASSIGN_OR_RETURN(const Geometry g, CheckCall(recipe, tensor, whole));
  DS_RETURN_IF_ERROR(CheckKernel(tensor, kernel));
  if (codes == nullptr || scales == nullptr) {
    return Status::InvalidArgument(Prefix(tensor) + ": codes or scales is null");
  }
  std::vector<float> amax(static_cast<size_t>(g.groups.count()));
  DS_RETURN_IF_ERROR(Fp8GroupAmax(recipe, tensor, whole, amax.data(), kernel));
  return Fp8QuantizeWindow(recipe, tensor, whole, amax.data(), codes, scales, kernel);
}

}  // namespace deltasync
