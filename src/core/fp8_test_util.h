// Test data for the FP8 element types, shared by every module's tests: a
// DeepSeek-V3-style block-scaled FP8 linear layer (F8_E4M3 weights, one
// F8_E8M0 "ue8m0" scale per 128x128 block, a per-tensor F32 scale) and its
// versions after optimizer steps, as an RL trainer re-quantizes them.
//
// Only the bit patterns matter to deltasync; the values are made the way a
// quantizer makes them so that the deltas look like real ones (most E4M3
// bytes unchanged between versions, a few flipping by one code, a block's
// scale moving by a power of two).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "deltasync/dtype.h"

namespace deltasync::fp8_test {

// The value of an F8_E4M3 (torch.float8_e4m3fn) code: 1 sign, 4 exponent
// (bias 7) and 3 mantissa bits, subnormals at exponent 0, no infinities,
// NaN at 0x7F and 0xFF.
inline float E4M3Value(uint8_t code) {
  const int e = (code >> 3) & 0xF, m = code & 0x7;
  if (e == 0xF && m == 0x7) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m) / 8.0f, -6)
                           : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// The F8_E4M3 code nearest `x`, ties to the even code, saturating at
// +-448 (what torch's .to(torch.float8_e4m3fn) does for finite inputs).
inline uint8_t E4M3Code(float x) {
  // Positive finite codes 0x00..0x7E are ordered by value.
  static const std::array<float, 0x7F> kValues = [] {
    std::array<float, 0x7F> v{};
    for (size_t c = 0; c < v.size(); ++c) v[c] = E4M3Value(static_cast<uint8_t>(c));
    return v;
  }();
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  const size_t above_a = static_cast<size_t>(std::upper_bound(kValues.begin(), kValues.end(), a) -
                                             kValues.begin());  // >= 1
  const uint8_t lo = static_cast<uint8_t>(above_a - 1);
  if (lo == 0x7E) return sign | lo;
  const float below = a - kValues[lo], above = kValues[lo + 1] - a;
  const uint8_t pick = below < above   ? lo
                       : above < below ? static_cast<uint8_t>(lo + 1)
                                       : static_cast<uint8_t>((lo & 1) ? lo + 1 : lo);
  return sign | pick;
}

// The F8_E8M0 (torch.float8_e8m0fnu) code of 2^k: exponent bits only, bias
// 127; 0xFF is NaN.
inline uint8_t E8M0Code(int k) { return static_cast<uint8_t>(k + 127); }

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline constexpr int64_t kRows = 256, kCols = 256, kBlock = 128;
inline constexpr float kE4M3Max = 448.0f;

// The layer `prefix` at optimizer step `step` (0: as loaded): "<prefix>.weight"
// (F8_E4M3 [256, 256]), "<prefix>.weight_scale_inv" (F8_E8M0 [2, 2], one
// scale per 128x128 block) and "<prefix>.input_scale" (F32 scalar). Each
// step moves the fp32 master weights by a small random amount (so a few
// percent of the E4M3 codes change) and doubles block (1, 1)'s range, so
// its scale changes every step and its codes stay put.
inline std::vector<Tensor> BlockScaledLayer(const std::string& prefix, uint64_t seed, int step) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> weight(0.0f, 0.02f), move(0.0f, 2e-4f);
  std::vector<float> master(kRows * kCols);
  for (float& w : master) w = weight(rng);
  for (int s = 1; s <= step; ++s) {
    std::mt19937_64 step_rng(seed * 1000003 + static_cast<uint64_t>(s));
    for (float& w : master) w += move(step_rng);
  }
  Tensor w{prefix + ".weight", DType::kF8_E4M3, {kRows, kCols}, {}};
  Tensor scales{
      prefix + ".weight_scale_inv", DType::kF8_E8M0, {kRows / kBlock, kCols / kBlock}, {}};
  w.bytes.resize(kRows * kCols);
  for (int64_t br = 0; br < kRows / kBlock; ++br) {
    for (int64_t bc = 0; bc < kCols / kBlock; ++bc) {
      const float grow = (br == 1 && bc == 1) ? std::ldexp(1.0f, step) : 1.0f;
      float amax = 0.0f;
      for (int64_t r = br * kBlock; r < (br + 1) * kBlock; ++r) {
        for (int64_t c = bc * kBlock; c < (bc + 1) * kBlock; ++c) {
          amax = std::fmax(amax, std::fabs(master[r * kCols + c] * grow));
        }
      }
      // The smallest power of two that brings the block into E4M3's range.
      const int k = static_cast<int>(std::ceil(std::log2(amax / kE4M3Max)));
      scales.bytes.push_back(E8M0Code(k));
      for (int64_t r = br * kBlock; r < (br + 1) * kBlock; ++r) {
        for (int64_t c = bc * kBlock; c < (bc + 1) * kBlock; ++c) {
          w.bytes[r * kCols + c] = E4M3Code(std::ldexp(master[r * kCols + c] * grow, -k));
        }
      }
    }
  }
  Tensor input{prefix + ".input_scale", DType::kF32, {}, std::vector<uint8_t>(4)};
  const float activation_scale = 0.0123f * (1.0f + static_cast<float>(step) / 16.0f);
  std::memcpy(input.bytes.data(), &activation_scale, 4);
  return {std::move(w), std::move(scales), std::move(input)};
}

}  // namespace deltasync::fp8_test
