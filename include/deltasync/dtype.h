// Element types, named exactly as the safetensors format names them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "deltasync/status.h"

namespace deltasync {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kF8_E4M3,
  kF8_E5M2,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kI64,
  kU64,
  kF64,
  // Appended, not placed beside the other F8 types: the enum's values are
  // the wire codes (src/core/dtype_code.h), which never move.
  kF8_E8M0,
};

inline constexpr int kNumDTypes = 16;

// Size of one element in bytes (1, 2, 4 or 8).
size_t DTypeSize(DType dtype);

// The safetensors name: "BOOL", "U8", ..., "BF16", "F64", "F8_E8M0".
std::string_view DTypeName(DType dtype);

// Parses a safetensors dtype name (case-sensitive, as the format requires).
// Unknown names are Unsupported.
Result<DType> ParseDType(std::string_view name);

// True for floating-point element types (F8_*, F16, BF16, F32, F64).
// F8_E8M0 counts: an element is the real number 2^(e - 127) (or NaN), not
// an integer, and torch.float8_e8m0fnu is a floating-point dtype too, even
// though it has neither sign nor mantissa (nor a zero).
bool DTypeIsFloat(DType dtype);

}  // namespace deltasync
