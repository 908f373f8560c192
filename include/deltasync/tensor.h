// TensorView: a named, typed, shaped view of bytes owned by someone else.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "deltasync/dtype.h"
#include "deltasync/status.h"

namespace deltasync {

// Number of elements of a shape (1 for a scalar, shape {}); nullopt-free:
// returns OutOfRange when the product overflows int64 or a dim is negative.
Result<int64_t> ShapeNumel(const std::vector<int64_t>& shape);

// A non-owning view. The bytes must outlive the view. Invariant (checked by
// Validate, established by every producer in this library):
// bytes.size() == numel(shape) * DTypeSize(dtype).
struct TensorView {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;

  // Elements according to the shape (assumes a validated view).
  int64_t numel() const;
  size_t nbytes() const { return bytes.size(); }
  // OK when the byte length matches shape x element size.
  Status Validate() const;
};

// "[2, 3]" style rendering of a shape.
std::string ShapeToString(const std::vector<int64_t>& shape);

}  // namespace deltasync
