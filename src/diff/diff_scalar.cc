// Portable reference kernel: one element at a time. It defines the output
// every vector kernel must reproduce, and is the only kernel off x86-64.
#include "diff/diff_internal.h"

namespace deltasync::diff_internal {
namespace {

struct ScalarTable {
  template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
  static size_t Diff(const uint8_t* new_bytes, uint8_t* snapshot, size_t numel,
                     uint64_t first_index, const ChangeSink& sink) {
    return DiffElementwise<kElemSize, kRefresh, kKeepOld, kWide>(new_bytes, snapshot, numel,
                                                                 first_index, sink, 0);
  }

  template <uint32_t kElemSize>
  static uint64_t Count(const uint8_t* a, const uint8_t* b, size_t numel) {
    return CountElementwise<kElemSize>(a, b, numel);
  }
};

}  // namespace

DiffRangeFn ScalarDiffFn(const KernelVariant& variant) { return PickDiffFn<ScalarTable>(variant); }
CountRangeFn ScalarCountFn(uint32_t elem_size) { return PickCountFn<ScalarTable>(elem_size); }

}  // namespace deltasync::diff_internal
