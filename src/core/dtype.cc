#include "deltasync/dtype.h"

#include <array>
#include <string>

namespace deltasync {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
  bool is_float;
};

// Indexed by the enum value; a static_assert below keeps the order honest.
constexpr std::array<DTypeInfo, kNumDTypes> kTable = {{
    {DType::kBool, "BOOL", 1, false},
    {DType::kU8, "U8", 1, false},
    {DType::kI8, "I8", 1, false},
    {DType::kF8_E4M3, "F8_E4M3", 1, true},
    {DType::kF8_E5M2, "F8_E5M2", 1, true},
    {DType::kI16, "I16", 2, false},
    {DType::kU16, "U16", 2, false},
    {DType::kF16, "F16", 2, true},
    {DType::kBF16, "BF16", 2, true},
    {DType::kI32, "I32", 4, false},
    {DType::kU32, "U32", 4, false},
    {DType::kF32, "F32", 4, true},
    {DType::kI64, "I64", 8, false},
    {DType::kU64, "U64", 8, false},
    {DType::kF64, "F64", 8, true},
    // The OCP MX "ue8m0" scale of block-scaled FP8 checkpoints, named as
    // huggingface/safetensors names it (safetensors/src/tensor.rs, `enum
    // Dtype`: F8_E8M0, 8 bits). A float: see DTypeIsFloat.
    {DType::kF8_E8M0, "F8_E8M0", 1, true},
}};

constexpr bool TableInEnumOrder() {
  for (size_t i = 0; i < kTable.size(); ++i) {
    if (static_cast<size_t>(kTable[i].dtype) != i) return false;
  }
  return true;
}
static_assert(TableInEnumOrder(), "kTable must be indexed by DType value");

const DTypeInfo& Info(DType dtype) { return kTable[static_cast<size_t>(dtype)]; }

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) { return Info(dtype).name; }
bool DTypeIsFloat(DType dtype) { return Info(dtype).is_float; }

Result<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kTable) {
    if (info.name == name) return info.dtype;
  }
  return Status::Unsupported("unknown dtype '" + std::string(name) + "'");
}

}  // namespace deltasync
