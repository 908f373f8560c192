#include "pipeline/scatter.h"

#include <algorithm>
#include <string>

namespace deltasync::pipeline {

Status ScatterNewValuesAndVisit(const ChangeSet& changes, std::span<uint8_t> target, size_t begin,
                                size_t end, size_t piece_bytes,
                                const std::function<void(std::span<const uint8_t>)>& visit) {
  const uint64_t count = changes.count();
  const size_t es = changes.elem_size == 0 ? 1 : changes.elem_size;
  if (target.size() != changes.numel * changes.elem_size ||
      changes.new_values.size() != count * changes.elem_size ||
      (count > 0 && changes.position(count - 1) >= changes.numel)) {
    return Status::Internal("changes do not fit their tensor of " + std::to_string(target.size()) +
                            " bytes");
  }
  if (begin > end || end > target.size() || begin % es != 0 || end % es != 0 ||
      (count > 0 &&
       (changes.position(0) < begin / es || (changes.position(count - 1) + 1) * es > end))) {
    return Status::Internal("changes do not lie in the visited bytes [" + std::to_string(begin) +
                            ", " + std::to_string(end) + ")");
  }
  const uint8_t* positions = changes.wide ? reinterpret_cast<const uint8_t*>(changes.pos64.data())
                                          : reinterpret_cast<const uint8_t*>(changes.pos32.data());
  const uint8_t* values = changes.new_values.data();
  uint64_t next = 0;
  const size_t piece = std::max(es, piece_bytes / es * es);
  for (size_t at = begin; at < end; at += piece) {
    const size_t n = std::min(piece, end - at);
    const uint64_t below = (at + n) / es;
    if (changes.wide) {
      ScatterBelowPos<uint64_t>(changes.elem_size, positions, count, values, target.data(), below,
                                &next);
    } else {
      ScatterBelowPos<uint32_t>(changes.elem_size, positions, count, values, target.data(), below,
                                &next);
    }
    visit(target.subspan(at, n));
  }
  return Status::OK();
}

}  // namespace deltasync::pipeline
