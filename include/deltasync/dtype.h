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
};

inline constexpr int kNumDTypes = 15;

// Size of one element in bytes (1, 2, 4 or 8).
size_t DTypeSize(DType dtype);

// The safetensors name: "BOOL", "U8", ..., "BF16", "F64".
std::string_view DTypeName(DType dtype);

// Parses a safetensors dtype name (case-sensitive, as the format requires).
// Unknown names are Unsupported.
Result<DType> ParseDType(std::string_view name);

// True for floating-point element types (F8_*, F16, BF16, F32, F64).
bool DTypeIsFloat(DType dtype);

}  // namespace deltasync
