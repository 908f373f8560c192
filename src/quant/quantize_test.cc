#include "deltasync/quantize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_test_util.h"

namespace deltasync {
namespace {

using fp8_test::E4M3Code;
using fp8_test::E4M3Value;
using fp8_test::E8M0Code;

// ---------------------------------------------------------------------------
// The independent reference: plain float math, one element at a time, with
// fp8_test_util.h's table-driven encoder.

float HalfToFloat(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                           : std::ldexp(static_cast<float>(1024 + m), e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// A 2-D weight in one of the source dtypes.
struct Weight {
  DType dtype = DType::kBF16;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape() const { return {rows, cols}; }
  size_t elem() const { return DTypeSize(dtype); }
  float At(int64_t r, int64_t c) const {
    const uint8_t* p = bytes.data() + (r * cols + c) * static_cast<int64_t>(elem());
    if (dtype == DType::kF32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    if (dtype == DType::kF16) return HalfToFloat(h);
    return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
  }
  void SetBits(int64_t i, uint32_t bits) {
    std::memcpy(bytes.data() + i * static_cast<int64_t>(elem()), &bits, elem());
  }
};

// Elements of widely varying magnitude per 128x128 block (so block scales
// differ), zeros, exact ties for the encoder, and values tiny enough to
// land in E4M3's subnormals. F16 bits are drawn directly (subnormal halves
// included); BF16 is the top half of a float32.
Weight MakeWeight(DType dtype, int64_t rows, int64_t cols, uint64_t seed) {
  Weight w{dtype, rows, cols, std::vector<uint8_t>(rows * cols * DTypeSize(dtype))};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const int block_exp = static_cast<int>(((r / 128) * 7 + (c / 128) * 3) % 24) - 16;
      float x = std::ldexp(normal(rng), block_exp);
      if (rng() % 16 == 0) x = 0.0f;
      if (rng() % 32 == 0) x = std::ldexp(x, -12);  // E4M3 subnormals after scaling
      if (dtype == DType::kF32) {
        w.SetBits(i, std::bit_cast<uint32_t>(x));
      } else if (dtype == DType::kBF16) {
        w.SetBits(i, std::bit_cast<uint32_t>(x) >> 16);
      } else {
        const uint32_t sign = static_cast<uint32_t>(rng() & 1) << 15;
        const uint32_t exp = static_cast<uint32_t>(rng() % 31);  // 0..30: finite
        const uint32_t man = static_cast<uint32_t>(rng() & 0x3FF);
        w.SetBits(i, rng() % 16 == 0 ? 0 : (sign | (exp << 10) | man));
      }
    }
  }
  return w;
}

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;  // the scale tensor's bytes
};

// The smallest power of two >= sf, found with frexp rather than bits.
float RefCeilPowerOfTwo(float sf) {
  int e = 0;
  const float m = std::frexp(sf, &e);  // sf = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? sf : std::ldexp(1.0f, e);
}

float RefScale(const QuantRecipe& recipe, float amax) {
  switch (recipe.scheme) {
    case QuantScheme::kBlock128: {
      // torch divides a CUDA tensor by a Python float as a product with the
      // float32 reciprocal: x_amax / 448.0 == x_amax * float(1 / 448).
      const float sf = std::max(amax, 1e-4f) * (1.0f / 448.0f);
      return recipe.scale_format == ScaleFormat::kF32 ? sf : RefCeilPowerOfTwo(sf);
    }
    // Triton's division by 448 (div.full.f32) is the same product.
    case QuantScheme::kPerChannel: return std::max(amax, 1e-10f) * (1.0f / 448.0f);
    case QuantScheme::kPerTensor: return amax == 0.0f ? 1.0f : amax / 448.0f;
  }
  return 0.0f;
}

size_t ScaleBytes(const QuantRecipe& recipe) {
  return DTypeSize(QuantScaleDType(recipe.scale_format));
}

void PutScale(const QuantRecipe& recipe, float sf, uint8_t* at) {
  if (recipe.scale_format == ScaleFormat::kUe8m0) {
    int e = 0;
    std::frexp(sf, &e);  // sf = 0.5 * 2^e = 2^(e - 1)
    *at = E8M0Code(e - 1);
  } else {
    std::memcpy(at, &sf, 4);
  }
}

Quantized RefQuantize(const QuantRecipe& recipe, const Weight& w) {
  const bool block = recipe.scheme == QuantScheme::kBlock128;
  const bool per_channel = recipe.scheme == QuantScheme::kPerChannel;
  const int64_t grid_rows = block ? (w.rows + 127) / 128 : per_channel ? w.rows : 1;
  const int64_t grid_cols = block ? (w.cols + 127) / 128 : 1;
  auto group = [&](int64_t r, int64_t c) {
    return block ? (r / 128) * grid_cols + c / 128 : per_channel ? r : 0;
  };
  std::vector<float> amax(grid_rows * grid_cols, 0.0f);
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t c = 0; c < w.cols; ++c) {
      float& a = amax[group(r, c)];
      a = std::max(a, std::fabs(w.At(r, c)));
    }
  }
  Quantized q;
  q.scales.resize(amax.size() * ScaleBytes(recipe));
  std::vector<float> sf(amax.size());
  for (size_t g = 0; g < amax.size(); ++g) {
    sf[g] = RefScale(recipe, amax[g]);
    PutScale(recipe, sf[g], q.scales.data() + g * ScaleBytes(recipe));
  }
  q.codes.resize(w.rows * w.cols);
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t c = 0; c < w.cols; ++c) {
      const float y = w.At(r, c) * (1.0f / sf[group(r, c)]);
      q.codes[r * w.cols + c] = E4M3Code(std::clamp(y, -448.0f, 448.0f));
    }
  }
  return q;
}

// ---------------------------------------------------------------------------
// The code under test, whole and by windows.

Result<Quantized> Quantize(const QuantRecipe& recipe, const Weight& w,
                           QuantKernel kernel = BestQuantKernel()) {
  DS_ASSIGN_OR_RETURN(const std::vector<int64_t> scale_shape,
                      QuantScaleShape(recipe, w.rows, w.cols));
  int64_t n = 1;
  for (int64_t d : scale_shape) n *= d;
  // Guard bytes past both outputs: nothing may be written beyond them.
  constexpr size_t kGuard = 64;
  constexpr uint8_t kGuardByte = 0x5A;
  const size_t ncodes = w.rows * w.cols, nscales = n * ScaleBytes(recipe);
  Quantized q{std::vector<uint8_t>(ncodes + kGuard, kGuardByte),
              std::vector<uint8_t>(nscales + kGuard, kGuardByte)};
  const std::vector<int64_t> shape = w.shape();
  DS_RETURN_IF_ERROR(Fp8Quantize(recipe, {"w", w.dtype, shape}, w.bytes.data(), q.codes.data(),
                                 q.scales.data(), kernel));
  for (const auto* out : {&q.codes, &q.scales}) {
    const size_t size = out == &q.codes ? ncodes : nscales;
    if (!std::all_of(out->begin() + size, out->end(), [](uint8_t b) { return b == kGuardByte; })) {
      return Status::Internal("wrote past the end of its output");
    }
  }
  q.codes.resize(ncodes);
  q.scales.resize(nscales);
  return q;
}

std::vector<uint8_t> WindowData(const Weight& w, const QuantWindow& win) {
  std::vector<uint8_t> out;
  const size_t e = w.elem();
  for (int64_t r = win.row_begin; r < win.row_end; ++r) {
    const uint8_t* p = w.bytes.data() + (r * w.cols + win.col_begin) * static_cast<int64_t>(e);
    out.insert(out.end(), p, p + (win.col_end - win.col_begin) * static_cast<int64_t>(e));
  }
  return out;
}

// Quantizes w as the windows that `row_cuts` x `col_cuts` cut it into, as
// ranks of a sharded trainer would: each takes its partial amax, the amax
// are MAX-reduced per group, then each encodes its window. Windows that
// share a group must write the same scale bytes for it.
Quantized QuantizeByWindows(const QuantRecipe& recipe, const Weight& w,
                            const std::vector<int64_t>& row_cuts,
                            const std::vector<int64_t>& col_cuts, QuantKernel kernel) {
  const bool block = recipe.scheme == QuantScheme::kBlock128;
  const int64_t grid_rows = block                                       ? (w.rows + 127) / 128
                            : recipe.scheme == QuantScheme::kPerChannel ? w.rows
                                                                        : 1;
  const int64_t grid_cols = block ? (w.cols + 127) / 128 : 1;
  const std::vector<int64_t> shape = w.shape();
  const QuantTensor tensor{"w", w.dtype, shape};
  std::vector<QuantWindow> windows;
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i + 1 < row_cuts.size(); ++i) {
    for (size_t j = 0; j + 1 < col_cuts.size(); ++j) {
      windows.push_back({nullptr, row_cuts[i], row_cuts[i + 1], col_cuts[j], col_cuts[j + 1]});
      data.push_back(WindowData(w, windows.back()));
      windows.back().data = data.back().data();
    }
  }
  // Pointers into `data` stay valid: it is not resized after this.
  for (size_t k = 0; k < windows.size(); ++k) windows[k].data = data[k].data();

  std::vector<float> reduced(grid_rows * grid_cols, 0.0f);
  for (const QuantWindow& win : windows) {
    const Result<QuantGroups> groups = Fp8WindowGroups(recipe, tensor, win);
    EXPECT_TRUE(groups.ok()) << groups.status().ToString();
    std::vector<float> amax(groups->count());
    const Status s = Fp8GroupAmax(recipe, tensor, win, amax.data(), kernel);
    EXPECT_TRUE(s.ok()) << s.ToString();
    const int64_t gcols = groups->col_end - groups->col_begin;
    for (int64_t i = 0; i < groups->count(); ++i) {
      float& slot =
          reduced[(groups->row_begin + i / gcols) * grid_cols + groups->col_begin + i % gcols];
      slot = std::max(slot, amax[i]);
    }
  }

  Quantized q{std::vector<uint8_t>(w.rows * w.cols),
              std::vector<uint8_t>(reduced.size() * ScaleBytes(recipe))};
  std::vector<bool> scale_written(reduced.size(), false);
  const size_t sb = ScaleBytes(recipe);
  for (const QuantWindow& win : windows) {
    const Result<QuantGroups> groups = Fp8WindowGroups(recipe, tensor, win);
    const int64_t gcols = groups->col_end - groups->col_begin;
    std::vector<float> amax;
    std::vector<int64_t> where;
    for (int64_t i = 0; i < groups->count(); ++i) {
      where.push_back((groups->row_begin + i / gcols) * grid_cols + groups->col_begin + i % gcols);
      amax.push_back(reduced[where.back()]);
    }
    const int64_t wr = win.row_end - win.row_begin, wc = win.col_end - win.col_begin;
    std::vector<uint8_t> codes(wr * wc), scales(amax.size() * sb);
    const Status s =
        Fp8QuantizeWindow(recipe, tensor, win, amax.data(), codes.data(), scales.data(), kernel);
    EXPECT_TRUE(s.ok()) << s.ToString();
    for (int64_t r = 0; r < wr; ++r) {
      std::copy_n(codes.begin() + r * wc, wc,
                  q.codes.begin() + (win.row_begin + r) * w.cols + win.col_begin);
    }
    for (size_t i = 0; i < where.size(); ++i) {
      uint8_t* dst = q.scales.data() + where[i] * sb;
      if (scale_written[where[i]]) {
        EXPECT_EQ(0, std::memcmp(dst, scales.data() + i * sb, sb)) << "group " << where[i];
      }
      std::memcpy(dst, scales.data() + i * sb, sb);
      scale_written[where[i]] = true;
    }
  }
  return q;
}

// The first differing byte, rather than two long vectors.
::testing::AssertionResult SameBytes(const std::vector<uint8_t>& actual,
                                     const std::vector<uint8_t>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.size() << " != " << expected.size();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] != expected[i]) {
      return ::testing::AssertionFailure()
             << "byte " << i << ": " << int{actual[i]} << " != " << int{expected[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

constexpr QuantRecipe kRecipes[] = {
    {QuantScheme::kBlock128, ScaleFormat::kF32},   {QuantScheme::kBlock128, ScaleFormat::kUe8m0F32},
    {QuantScheme::kBlock128, ScaleFormat::kUe8m0}, {QuantScheme::kPerTensor, ScaleFormat::kF32},
    {QuantScheme::kPerChannel, ScaleFormat::kF32},
};
constexpr DType kDTypes[] = {DType::kBF16, DType::kF16, DType::kF32};

std::string Describe(const QuantRecipe& recipe, DType dtype) {
  return std::string(QuantSchemeName(recipe.scheme)) + "/" +
         std::string(ScaleFormatName(recipe.scale_format)) + "/" + std::string(DTypeName(dtype));
}

// ---------------------------------------------------------------------------
// The encoder.

void ExpectEncodes(float x) {
  ASSERT_EQ(Fp8E4M3FromFloat(x), E4M3Code(x))
      << "x = " << x << " (bits 0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
}

TEST(Fp8E4M3FromFloat, MatchesReferenceOnEveryCodeTieAndNeighbour) {
  for (int code = 0; code < 0x7F; ++code) {
    const float v = E4M3Value(static_cast<uint8_t>(code));
    const float next = code < 0x7E ? E4M3Value(static_cast<uint8_t>(code + 1)) : 480.0f;
    const float tie = (v + next) / 2;  // exact: neighbours differ in few bits
    for (float x : {v, tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e9f),
                    std::nextafter(v, 0.0f), std::nextafter(v, 1e9f)}) {
      ExpectEncodes(x);
      ExpectEncodes(-x);
    }
  }
}

TEST(Fp8E4M3FromFloat, MatchesReferenceOnStridedSweepOfAllFloats) {
  // Every 4099th float32 bit pattern (both signs), skipping NaN.
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 4099) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(bits));
    if (std::isnan(x)) continue;
    ExpectEncodes(x);
  }
  // Densely around the subnormal/normal border and the top of the range.
  for (float lo : {0x1p-11f, 0x1p-7f, 400.0f}) {
    float x = lo;
    for (int i = 0; i < 200000; ++i, x = std::nextafter(x, 1e9f)) {
      ExpectEncodes(x);
      ExpectEncodes(-x);
    }
  }
}

TEST(Fp8E4M3FromFloat, SpecialValues) {
  EXPECT_EQ(Fp8E4M3FromFloat(0.0f), 0x00);
  EXPECT_EQ(Fp8E4M3FromFloat(-0.0f), 0x80);
  EXPECT_EQ(Fp8E4M3FromFloat(0x1p-9f), 0x01);   // smallest subnormal
  EXPECT_EQ(Fp8E4M3FromFloat(0x1p-10f), 0x00);  // tie between 0 and 2^-9: even
  EXPECT_EQ(Fp8E4M3FromFloat(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(Fp8E4M3FromFloat(3 * 0x1p-10f), 0x02);   // tie between codes 1 and 2
  EXPECT_EQ(Fp8E4M3FromFloat(15 * 0x1p-10f), 0x08);  // tie between 7 and 8 (2^-6)
  EXPECT_EQ(Fp8E4M3FromFloat(0x1p-6f), 0x08);
  EXPECT_EQ(Fp8E4M3FromFloat(-1e-30f), 0x80);
  EXPECT_EQ(Fp8E4M3FromFloat(448.0f), 0x7E);
  EXPECT_EQ(Fp8E4M3FromFloat(-448.0f), 0xFE);
  for (float big : {std::nextafter(448.0f, 1e9f), 449.0f, 464.0f, 480.0f, 1e30f,
                    std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(Fp8E4M3FromFloat(big), 0x7E) << big;
    EXPECT_EQ(Fp8E4M3FromFloat(-big), 0xFE) << big;
  }
}

// ---------------------------------------------------------------------------
// Recipes against the reference.

TEST(Fp8Quantize, EveryRecipeMatchesReference) {
  // Shapes: block edges not multiples of 128 on either side, exact blocks,
  // one element, one row, one column.
  const std::pair<int64_t, int64_t> shapes[] = {{300, 200}, {128, 256}, {1, 1}, {1, 333}, {257, 1}};
  uint64_t seed = 1;
  for (DType dtype : kDTypes) {
    for (auto [rows, cols] : shapes) {
      const Weight w = MakeWeight(dtype, rows, cols, seed++);
      for (const QuantRecipe& recipe : kRecipes) {
        const Quantized ref = RefQuantize(recipe, w);
        for (QuantKernel kernel : AvailableQuantKernels()) {
          SCOPED_TRACE(Describe(recipe, dtype) + " [" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "] " + std::string(QuantKernelName(kernel)));
          const Result<Quantized> q = Quantize(recipe, w, kernel);
          ASSERT_TRUE(q.ok()) << q.status().ToString();
          EXPECT_TRUE(SameBytes(q->scales, ref.scales));
          EXPECT_TRUE(SameBytes(q->codes, ref.codes));
        }
      }
    }
  }
}

TEST(Fp8Quantize, EveryHalfAndBfloatBitPattern) {
  // All finite 16-bit patterns, one per element of a [256, 256] weight (the
  // rest zero): covers every F16/BF16 decode, subnormal halves included.
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    Weight w{dtype, 256, 256, std::vector<uint8_t>(256 * 256 * 2)};
    const uint32_t exp_mask = dtype == DType::kF16 ? 0x7C00 : 0x7F80;
    for (uint32_t h = 0; h < 65536; ++h) w.SetBits(h, (h & exp_mask) == exp_mask ? 0 : h);
    for (const QuantRecipe& recipe : kRecipes) {
      const Quantized ref = RefQuantize(recipe, w);
      for (QuantKernel kernel : AvailableQuantKernels()) {
        SCOPED_TRACE(Describe(recipe, dtype) + " " + std::string(QuantKernelName(kernel)));
        const Result<Quantized> q = Quantize(recipe, w, kernel);
        ASSERT_TRUE(q.ok()) << q.status().ToString();
        EXPECT_TRUE(SameBytes(q->scales, ref.scales));
        EXPECT_TRUE(SameBytes(q->codes, ref.codes));
      }
    }
  }
}

TEST(Fp8Quantize, EveryKernelEncodesTheSweep) {
  // The vectorized encoders on the scalar sweep's values: a per-tensor F32
  // weight whose amax is 448 has sf = inv = 1, so its codes are the
  // encoder's output for the elements themselves.
  std::vector<float> values = {448.0f, -448.0f, 0.0f, -0.0f};
  for (int code = 0; code < 0x7E; ++code) {
    const float v = E4M3Value(static_cast<uint8_t>(code));
    const float tie = (v + E4M3Value(static_cast<uint8_t>(code + 1))) / 2;
    for (float x : {v, tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e9f)}) {
      values.push_back(x);
      values.push_back(-x);
    }
  }
  for (uint32_t bits = 0; bits <= 0x43E00000u; bits += 4099) {
    values.push_back(std::bit_cast<float>(bits));
    values.push_back(-std::bit_cast<float>(bits));
  }
  const int64_t cols = 1000, rows = (static_cast<int64_t>(values.size()) + cols - 1) / cols;
  values.resize(rows * cols, 1.0f);
  Weight w{DType::kF32, rows, cols, std::vector<uint8_t>(values.size() * 4)};
  std::memcpy(w.bytes.data(), values.data(), w.bytes.size());
  for (QuantKernel kernel : AvailableQuantKernels()) {
    SCOPED_TRACE(QuantKernelName(kernel));
    const Result<Quantized> q = Quantize({QuantScheme::kPerTensor, ScaleFormat::kF32}, w, kernel);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    float sf = 0;
    std::memcpy(&sf, q->scales.data(), 4);
    ASSERT_EQ(sf, 1.0f);
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(q->codes[i], E4M3Code(values[i])) << "x = " << values[i];
    }
  }
}

float ScaleF32(const Quantized& q, size_t i) {
  float f;
  std::memcpy(&f, q.scales.data() + i * 4, 4);
  return f;
}

TEST(Fp8Quantize, Ue8m0ScalesArePowersOfTwoAtLeastSf) {
  const Weight w = MakeWeight(DType::kBF16, 640, 520, 99);
  const Result<Quantized> f32 = Quantize({QuantScheme::kBlock128, ScaleFormat::kF32}, w);
  const Result<Quantized> pow2 = Quantize({QuantScheme::kBlock128, ScaleFormat::kUe8m0F32}, w);
  const Result<Quantized> e8m0 = Quantize({QuantScheme::kBlock128, ScaleFormat::kUe8m0}, w);
  ASSERT_TRUE(f32.ok() && pow2.ok() && e8m0.ok());
  ASSERT_EQ(e8m0->scales.size(), 5u * 5u);
  for (size_t i = 0; i < e8m0->scales.size(); ++i) {
    const float sf = ScaleF32(*f32, i), p = ScaleF32(*pow2, i);
    int e = 0;
    EXPECT_EQ(std::frexp(p, &e), 0.5f) << "block " << i << ": " << p << " is not a power of two";
    EXPECT_GE(p, sf) << "block " << i;
    EXPECT_LT(p / 2, sf) << "block " << i << ": not the smallest power of two";
    EXPECT_EQ(e8m0->scales[i], e - 1 + 127) << "block " << i;
    EXPECT_EQ(std::ldexp(1.0f, e8m0->scales[i] - 127), p) << "block " << i;
  }
}

// A one-element block whose amax is `amax` (exact in BF16).
Quantized OneBlock(ScaleFormat format, float amax) {
  Weight w{DType::kBF16, 1, 1, std::vector<uint8_t>(2)};
  w.SetBits(0, std::bit_cast<uint32_t>(amax) >> 16);
  EXPECT_EQ(w.At(0, 0), amax);
  Result<Quantized> q = Quantize({QuantScheme::kBlock128, format}, w);
  EXPECT_TRUE(q.ok()) << q.status().ToString();
  return *q;
}

TEST(Fp8Quantize, Ue8m0AtAPowerOfTwoAndJustAbove) {
  // amax = 14 = 448 * 2^-5: sf is exactly 2^-5 and stays; the next BF16
  // (14.0625) makes sf above 2^-5, which rounds up to 2^-4.
  EXPECT_EQ(OneBlock(ScaleFormat::kUe8m0, 14.0f).scales[0], 127 - 5);
  EXPECT_EQ(ScaleF32(OneBlock(ScaleFormat::kUe8m0F32, 14.0f), 0), 0x1p-5f);
  EXPECT_EQ(OneBlock(ScaleFormat::kUe8m0, 14.0625f).scales[0], 127 - 4);
  EXPECT_EQ(OneBlock(ScaleFormat::kUe8m0, 14.0f).codes[0], 0x7E);     // 448
  EXPECT_EQ(OneBlock(ScaleFormat::kUe8m0, 14.0625f).codes[0], 0x76);  // 225 -> 224
  // Below the 1e-4 floor the scale is the floor's: 2^-22 >= 1e-4 / 448.
  EXPECT_EQ(OneBlock(ScaleFormat::kUe8m0, 0.0f).scales[0], 127 - 22);
  EXPECT_EQ(ScaleF32(OneBlock(ScaleFormat::kF32, 0.0f), 0), 1e-4f * (1.0f / 448.0f));
}

TEST(Fp8Quantize, Ue8m0OneUlpAboveAPowerOfTwo) {
  // An F32 amax whose sf is the float just above 2^-5 (found with plain
  // float math): the scale must go up to 2^-4. (-5 + 1.7e-7 is within half
  // an ULP of -5, so torch's float32 log2 likely keeps 2^-5: the documented
  // difference, quantize.h.)
  const float target = std::nextafter(0x1p-5f, 1.0f);
  float amax = 14.0f;
  while (amax * (1.0f / 448.0f) < target) amax = std::nextafter(amax, 100.0f);
  ASSERT_EQ(amax * (1.0f / 448.0f), target);
  Weight w{DType::kF32, 1, 1, std::vector<uint8_t>(4)};
  w.SetBits(0, std::bit_cast<uint32_t>(amax));
  const Result<Quantized> q = Quantize({QuantScheme::kBlock128, ScaleFormat::kUe8m0}, w);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->scales[0], 127 - 4);
}

TEST(Fp8Quantize, BlockScaleIsAmaxTimesTheFloatReciprocal) {
  // torch's `cuda_amax / 448.0` multiplies by float32(1/448); it differs
  // from the IEEE quotient for the first BF16 amax above 1 used here.
  float amax = 1.0f;
  while (amax / 448.0f == amax * (1.0f / 448.0f)) {
    amax = std::bit_cast<float>(std::bit_cast<uint32_t>(amax) + 0x10000);  // next BF16
  }
  const Quantized q = OneBlock(ScaleFormat::kF32, amax);
  EXPECT_EQ(ScaleF32(q, 0), amax * (1.0f / 448.0f)) << amax;
  EXPECT_NE(ScaleF32(q, 0), amax / 448.0f) << amax;
}

TEST(Fp8Quantize, PerTensorDegenerateAmaxGivesUnitScale) {
  // amax == 0, and an amax whose amax / 448 has no finite reciprocal.
  for (float v : {0.0f, -0.0f, 1e-37f, -3e-38f}) {
    Weight w{DType::kF32, 2, 3, std::vector<uint8_t>(24)};
    for (int i = 0; i < 6; ++i) w.SetBits(i, std::bit_cast<uint32_t>(i % 2 ? v : 0.0f));
    const Result<Quantized> q = Quantize({QuantScheme::kPerTensor, ScaleFormat::kF32}, w);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    EXPECT_EQ(ScaleF32(*q, 0), 1.0f) << v;
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(q->codes[i], (i % 2 && std::signbit(v)) ? 0x80 : 0x00) << v << " at " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// Windows: the sharded trainer's property.

TEST(Fp8QuantizeWindow, WindowsWithReducedAmaxEqualTheWholeTensor) {
  struct Cuts {
    std::vector<int64_t> rows, cols;
  };
  // 300 x 200: row windows cutting block rows (100, 190), column windows
  // cutting a block column (70), both at once, and block-aligned ones.
  const Cuts cuts[] = {
      {{0, 100, 190, 300}, {0, 200}},     {{0, 300}, {0, 70, 200}},
      {{0, 150, 300}, {0, 70, 130, 200}}, {{0, 128, 256, 300}, {0, 128, 200}},
      {{0, 1, 299, 300}, {0, 199, 200}},
  };
  uint64_t seed = 7;
  for (DType dtype : kDTypes) {
    const Weight w = MakeWeight(dtype, 300, 200, seed++);
    for (const QuantRecipe& recipe : kRecipes) {
      const Result<Quantized> whole = Quantize(recipe, w, QuantKernel::kGeneric);
      ASSERT_TRUE(whole.ok()) << whole.status().ToString();
      for (QuantKernel kernel : AvailableQuantKernels()) {
        for (const Cuts& c : cuts) {
          SCOPED_TRACE(Describe(recipe, dtype) + " " + std::string(QuantKernelName(kernel)) +
                       " cuts " + std::to_string(c.rows.size() - 1) + "x" +
                       std::to_string(c.cols.size() - 1) + " (rows at " +
                       std::to_string(c.rows[1]) + ")");
          const Quantized windowed = QuantizeByWindows(recipe, w, c.rows, c.cols, kernel);
          EXPECT_TRUE(SameBytes(windowed.codes, whole->codes));
          EXPECT_TRUE(SameBytes(windowed.scales, whole->scales));
        }
      }
    }
  }
}

TEST(Fp8QuantizeWindow, GroupsAndPartialAmax) {
  // Column window [70, 200) x rows [100, 300) of a 300 x 200 weight of ones
  // except 5.0 at (120, 150) and -9.0 at (290, 80).
  Weight w{DType::kF32, 300, 200, std::vector<uint8_t>(300 * 200 * 4)};
  for (int64_t i = 0; i < 300 * 200; ++i) w.SetBits(i, std::bit_cast<uint32_t>(1.0f));
  w.SetBits(120 * 200 + 150, std::bit_cast<uint32_t>(5.0f));
  w.SetBits(290 * 200 + 80, std::bit_cast<uint32_t>(-9.0f));
  w.SetBits(50 * 200 + 100, std::bit_cast<uint32_t>(100.0f));  // outside the window
  const std::vector<int64_t> shape = w.shape();
  const QuantTensor tensor{"w", DType::kF32, shape};
  QuantWindow win{nullptr, 100, 300, 70, 200};
  const std::vector<uint8_t> data = WindowData(w, win);
  win.data = data.data();

  const QuantRecipe block{QuantScheme::kBlock128, ScaleFormat::kF32};
  const Result<QuantGroups> g = Fp8WindowGroups(block, tensor, win);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->row_begin, 0);
  EXPECT_EQ(g->row_end, 3);
  EXPECT_EQ(g->col_begin, 0);
  EXPECT_EQ(g->col_end, 2);
  std::vector<float> amax(6);
  ASSERT_TRUE(Fp8GroupAmax(block, tensor, win, amax.data()).ok());
  EXPECT_EQ(amax, (std::vector<float>{1.0f, 5.0f, 1.0f, 1.0f, 9.0f, 1.0f}));

  // Windows that end on a block border touch no block past it.
  const QuantWindow aligned{data.data(), 128, 256, 0, 128};
  const Result<QuantGroups> ga = Fp8WindowGroups(block, tensor, aligned);
  ASSERT_TRUE(ga.ok());
  EXPECT_EQ(ga->row_begin, 1);
  EXPECT_EQ(ga->row_end, 2);
  EXPECT_EQ(ga->col_begin, 0);
  EXPECT_EQ(ga->col_end, 1);

  const QuantRecipe channel{QuantScheme::kPerChannel, ScaleFormat::kF32};
  const Result<QuantGroups> gc = Fp8WindowGroups(channel, tensor, win);
  ASSERT_TRUE(gc.ok());
  EXPECT_EQ(gc->row_begin, 100);
  EXPECT_EQ(gc->row_end, 300);
  EXPECT_EQ(gc->count(), 200);
  std::vector<float> rows(200);
  ASSERT_TRUE(Fp8GroupAmax(channel, tensor, win, rows.data()).ok());
  EXPECT_EQ(rows[20], 5.0f);
  EXPECT_EQ(rows[190], 9.0f);
  EXPECT_EQ(rows[0], 1.0f);

  const QuantRecipe tensor_wide{QuantScheme::kPerTensor, ScaleFormat::kF32};
  float one = 0;
  ASSERT_TRUE(Fp8GroupAmax(tensor_wide, tensor, win, &one).ok());
  EXPECT_EQ(one, 9.0f);  // not 100: that element is outside the window
}

// ---------------------------------------------------------------------------
// Refusals.

TEST(QuantScaleShape, ShapesAndTypes) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(*QuantScaleShape({QuantScheme::kBlock128, ScaleFormat::kF32}, 300, 200), (V{3, 2}));
  EXPECT_EQ(*QuantScaleShape({QuantScheme::kBlock128, ScaleFormat::kUe8m0}, 128, 129), (V{1, 2}));
  EXPECT_EQ(*QuantScaleShape({QuantScheme::kPerTensor, ScaleFormat::kF32}, 300, 200), (V{1}));
  EXPECT_EQ(*QuantScaleShape({QuantScheme::kPerChannel, ScaleFormat::kF32}, 300, 200), (V{300, 1}));
  EXPECT_EQ(QuantScaleDType(ScaleFormat::kF32), DType::kF32);
  EXPECT_EQ(QuantScaleDType(ScaleFormat::kUe8m0F32), DType::kF32);
  EXPECT_EQ(QuantScaleDType(ScaleFormat::kUe8m0), DType::kF8_E8M0);
  for (ScaleFormat f : {ScaleFormat::kUe8m0F32, ScaleFormat::kUe8m0}) {
    for (QuantScheme s : {QuantScheme::kPerTensor, QuantScheme::kPerChannel}) {
      const Result<std::vector<int64_t>> r = QuantScaleShape({s, f}, 4, 4);
      EXPECT_TRUE(r.status().IsInvalidArgument()) << r.status().ToString();
      EXPECT_NE(r.status().message().find("needs block128"), std::string::npos);
    }
  }
  EXPECT_TRUE(QuantScaleShape({}, 0, 5).status().IsInvalidArgument());
  EXPECT_TRUE(QuantScaleShape({}, 5, -1).status().IsInvalidArgument());
  EXPECT_TRUE(QuantScaleShape({static_cast<QuantScheme>(9), ScaleFormat::kF32}, 1, 1)
                  .status()
                  .IsInvalidArgument());
}

TEST(Fp8QuantizeWindow, RefusalsWriteNothing) {
  const Weight w = MakeWeight(DType::kBF16, 300, 200, 5);
  const std::vector<int64_t> shape = w.shape(), shape3 = {300, 200, 1}, shape1 = {60000},
                             shape0 = {0, 200};
  const QuantRecipe good{QuantScheme::kBlock128, ScaleFormat::kF32};
  const QuantTensor tensor{"model.w", DType::kBF16, shape};
  const QuantWindow whole{w.bytes.data(), 0, 300, 0, 200};
  constexpr uint8_t kSentinel = 0xA5;
  std::vector<uint8_t> codes(300 * 200, kSentinel), scales(64, kSentinel);
  std::vector<float> amax(6, 1.0f), amax_out(6, -7.0f);

  struct Case {
    std::string what;
    QuantRecipe recipe;
    QuantTensor tensor;
    QuantWindow window;
    std::string message;  // a part of the error
  };
  const Case cases[] = {
      {"F8_E4M3 source", good, {"model.w", DType::kF8_E4M3, shape}, whole, "dtype F8_E4M3"},
      {"F64 source", good, {"model.w", DType::kF64, shape}, whole, "dtype F64"},
      {"3-D", good, {"model.w", DType::kBF16, shape3}, whole, "3 dims"},
      {"1-D", good, {"model.w", DType::kBF16, shape1}, whole, "1 dims"},
      {"no elements", good, {"model.w", DType::kBF16, shape0}, whole, "no elements"},
      {"empty window", good, tensor, {w.bytes.data(), 5, 5, 0, 200}, "empty or outside"},
      {"reversed window", good, tensor, {w.bytes.data(), 0, 300, 100, 50}, "empty or outside"},
      {"rows past the end", good, tensor, {w.bytes.data(), 200, 301, 0, 200}, "empty or outside"},
      {"cols past the end", good, tensor, {w.bytes.data(), 0, 10, 150, 201}, "empty or outside"},
      {"negative start", good, tensor, {w.bytes.data(), -1, 10, 0, 200}, "empty or outside"},
      {"null data", good, tensor, {nullptr, 0, 300, 0, 200}, "null"},
      {"ue8m0 per-tensor",
       {QuantScheme::kPerTensor, ScaleFormat::kUe8m0},
       tensor,
       whole,
       "needs block128"},
      {"ue8m0_f32 per-channel",
       {QuantScheme::kPerChannel, ScaleFormat::kUe8m0F32},
       tensor,
       whole,
       "needs block128"},
  };
  auto expect_refused = [&](const Status& s, const std::string& what, const std::string& part) {
    EXPECT_TRUE(s.IsInvalidArgument()) << what << ": " << s.ToString();
    EXPECT_NE(s.message().find(part), std::string::npos) << what << ": " << s.message();
    EXPECT_NE(s.message().find("model.w"), std::string::npos) << what << ": " << s.message();
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << what;
  };
  for (const Case& c : cases) {
    expect_refused(Fp8WindowGroups(c.recipe, c.tensor, c.window).status(), c.what, c.message);
    expect_refused(Fp8GroupAmax(c.recipe, c.tensor, c.window, amax_out.data()), c.what, c.message);
    expect_refused(
        Fp8QuantizeWindow(c.recipe, c.tensor, c.window, amax.data(), codes.data(), scales.data()),
        c.what, c.message);
    if (c.window.data == whole.data && c.window.row_begin == 0 && c.window.col_end == 200) {
      expect_refused(Fp8Quantize(c.recipe, c.tensor, c.window.data, codes.data(), scales.data()),
                     c.what, c.message);
    }
  }
  // Amax the caller brings: negative, NaN, infinite.
  for (float bad : {-1.0f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    std::vector<float> bad_amax = amax;
    bad_amax[4] = bad;
    expect_refused(
        Fp8QuantizeWindow(good, tensor, whole, bad_amax.data(), codes.data(), scales.data()),
        "amax " + std::to_string(bad), "not a finite amax");
  }
  expect_refused(Fp8GroupAmax(good, tensor, whole, nullptr), "null amax", "null");
  const QuantKernel no_such_kernel = static_cast<QuantKernel>(9);
  expect_refused(Fp8GroupAmax(good, tensor, whole, amax_out.data(), no_such_kernel), "kernel",
                 "does not run on this CPU");
  expect_refused(Fp8QuantizeWindow(good, tensor, whole, amax.data(), codes.data(), scales.data(),
                                   no_such_kernel),
                 "kernel", "does not run on this CPU");
  expect_refused(
      Fp8Quantize(good, tensor, w.bytes.data(), codes.data(), scales.data(), no_such_kernel),
      "kernel", "does not run on this CPU");
  expect_refused(Fp8QuantizeWindow(good, tensor, whole, amax.data(), nullptr, scales.data()),
                 "null codes", "null");
  expect_refused(Fp8Quantize(good, tensor, w.bytes.data(), codes.data(), nullptr), "null scales",
                 "null");

  EXPECT_TRUE(std::all_of(codes.begin(), codes.end(), [](uint8_t b) { return b == kSentinel; }));
  EXPECT_TRUE(std::all_of(scales.begin(), scales.end(), [](uint8_t b) { return b == kSentinel; }));
  EXPECT_TRUE(std::all_of(amax_out.begin(), amax_out.end(), [](float a) { return a == -7.0f; }));
}

TEST(Fp8Quantize, NonFiniteWeightsRefused) {
  const std::pair<DType, uint32_t> bad[] = {
      {DType::kBF16, 0x7FC0},    {DType::kBF16, 0xFF80},  // NaN, -inf
      {DType::kF16, 0x7C00},     {DType::kF16, 0xFE00},   // inf, NaN
      {DType::kF32, 0x7FC00001}, {DType::kF32, 0xFF800000},
  };
  for (auto [dtype, bits] : bad) {
    for (const QuantRecipe& recipe : kRecipes) {
      SCOPED_TRACE(Describe(recipe, dtype));
      Weight w = MakeWeight(dtype, 130, 140, 3);
      w.SetBits(129 * 140 + 133, bits);
      const std::vector<int64_t> shape = w.shape();
      const QuantTensor tensor{"layers.3.mlp", dtype, shape};
      std::vector<float> amax(4, -7.0f);
      const QuantWindow whole{w.bytes.data(), 0, 130, 0, 140};
      const Status a = Fp8GroupAmax(recipe, tensor, whole, amax.data());
      EXPECT_TRUE(a.IsInvalidArgument()) << a.ToString();
      EXPECT_NE(a.message().find("'layers.3.mlp': holds a NaN or an infinity"), std::string::npos)
          << a.message();
      EXPECT_TRUE(std::all_of(amax.begin(), amax.end(), [](float v) { return v == -7.0f; }));

      std::vector<uint8_t> codes(130 * 140), scales(4 * 130);
      const Status q = Fp8Quantize(recipe, tensor, w.bytes.data(), codes.data(), scales.data());
      EXPECT_TRUE(q.IsInvalidArgument()) << q.ToString();

      // With finite amax from elsewhere, the encode pass finds it too.
      std::vector<float> finite(130, std::numeric_limits<float>::max());
      const Status e =
          Fp8QuantizeWindow(recipe, tensor, whole, finite.data(), codes.data(), scales.data());
      EXPECT_TRUE(e.IsInvalidArgument()) << e.ToString();
      EXPECT_NE(e.message().find("NaN or an infinity (row 129)"), std::string::npos) << e.message();
    }
  }
}

TEST(Fp8QuantizeWindow, AmaxBelowTheDataRefused) {
  const Weight w = MakeWeight(DType::kBF16, 200, 200, 11);
  const std::vector<int64_t> shape = w.shape();
  const QuantTensor tensor{"w", DType::kBF16, shape};
  const QuantWindow whole{w.bytes.data(), 0, 200, 0, 200};
  const QuantRecipe recipe{QuantScheme::kBlock128, ScaleFormat::kF32};
  std::vector<float> amax(4);
  ASSERT_TRUE(Fp8GroupAmax(recipe, tensor, whole, amax.data()).ok());
  amax[3] = std::nextafter(amax[3], 0.0f);
  std::vector<uint8_t> codes(200 * 200), scales(16);
  const Status s =
      Fp8QuantizeWindow(recipe, tensor, whole, amax.data(), codes.data(), scales.data());
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  EXPECT_NE(s.message().find("above its scale group's amax"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace deltasync
