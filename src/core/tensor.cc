#include "deltasync/tensor.h"

#include <limits>

namespace deltasync {

Result<int64_t> ShapeNumel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return Status::OutOfRange("negative dimension " + std::to_string(dim));
    if (dim != 0 && numel > std::numeric_limits<int64_t>::max() / dim) {
      return Status::OutOfRange("shape " + ShapeToString(shape) + " overflows int64 elements");
    }
    numel *= dim;
  }
  return numel;
}

int64_t TensorView::numel() const {
  Result<int64_t> n = ShapeNumel(shape);
  return n.ok() ? *n : 0;
}

Status TensorView::Validate() const {
  DS_ASSIGN_OR_RETURN(int64_t n, ShapeNumel(shape));
  const size_t elem = DTypeSize(dtype);
  if (static_cast<uint64_t>(n) > std::numeric_limits<uint64_t>::max() / elem ||
      static_cast<uint64_t>(n) * elem != bytes.size()) {
    return Status::InvalidArgument("tensor '" + name + "': shape " + ShapeToString(shape) + " x " +
                                   std::string(DTypeName(dtype)) + " does not match " +
                                   std::to_string(bytes.size()) + " bytes");
  }
  return Status::OK();
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

}  // namespace deltasync
