// BF16 <-> FP32 conversions with the rounding PyTorch's `tensor.to(bfloat16)`
// uses: round to nearest, ties to even; NaN stays NaN (quieted); overflow
// rounds to infinity; subnormals round like any other value.
#pragma once

#include <bit>
#include <cstdint>

namespace deltasync::synth {

// BF16 is the top half of an FP32; this is exact.
inline float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// Rounds `value` to the nearest BF16, ties to even.
inline uint16_t FloatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly
  // when the dropped half is above the midpoint, or at it with an odd kept
  // half. A carry out of the mantissa bumps the exponent, which is the right
  // result, up to and including rounding the largest finite values to inf.
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  // The same addition would turn a NaN whose payload lives only in the low
  // half into inf (or carry a NaN into the sign bit), so NaNs are truncated
  // instead and forced quiet, keeping sign and top payload bits.
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}

}  // namespace deltasync::synth
