// The dtype's one-byte code on the wire (docs/format.md: the stream's
// frames and the sharded gather's messages): the safetensors dtypes in
// their listed order, BOOL = 0 to F64 = 14, then F8_E8M0 = 15. A dtype
// added later takes the next code at the end: frames and gather messages
// already written keep their meaning.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>

#include "deltasync/dtype.h"

namespace deltasync {

inline constexpr DType kWireDTypes[] = {
    DType::kBool, DType::kU8,  DType::kI8,   DType::kF8_E4M3, DType::kF8_E5M2, DType::kI16,
    DType::kU16,  DType::kF16, DType::kBF16, DType::kI32,     DType::kU32,     DType::kF32,
    DType::kI64,  DType::kU64, DType::kF64,  DType::kF8_E8M0,
};
static_assert(std::size(kWireDTypes) == static_cast<size_t>(kNumDTypes));

// The enum's values are the codes, so that a new dtype appended to the enum
// is appended here too (and tests may write a code as the enum's value).
constexpr bool WireCodesAreEnumValues() {
  for (size_t code = 0; code < std::size(kWireDTypes); ++code) {
    if (static_cast<size_t>(kWireDTypes[code]) != code) return false;
  }
  return true;
}
static_assert(WireCodesAreEnumValues(), "kWireDTypes must list DType values in order");

inline uint8_t DTypeWireCode(DType dtype) {
  for (uint8_t code = 0; code < std::size(kWireDTypes); ++code) {
    if (kWireDTypes[code] == dtype) return code;
  }
  return 0xFF;  // unreachable for a DType in the enum
}

// The inverse; nullopt for a code past 15.
inline std::optional<DType> DTypeFromWireCode(uint8_t code) {
  if (code >= std::size(kWireDTypes)) return std::nullopt;
  return kWireDTypes[code];
}

}  // namespace deltasync
