// Internals shared by the diff driver (diff.cc) and its per-ISA kernels.
//
// A kernel diffs one contiguous range of elements and writes what it finds
// into caller-provided arrays that have room for every element of the range,
// so its inner loop never checks capacity. The driver cuts tensors into
// windows and chunks, owns the memory, and concatenates the results.
//
// Every kernel is a family of instantiations over (element size, refresh,
// keep old values, wide positions) so that the flags cost nothing inside the
// loop; PickDiffFn maps the runtime flags to one instantiation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "deltasync/diff.h"
#include "deltasync/status.h"

namespace deltasync::diff_internal {

// Vector kernels record the first changes of every step without branching on
// whether they exist (a branch per step mispredicts about half the time at
// 1-3% density and costs more than the scratch writes). Such scratch entries
// lie just past the reported count, at most this many of them.
constexpr size_t kSinkSlack = 8;

// Where one kernel call writes its changes. Each array has room for as many
// entries as the call has elements plus kSinkSlack; only the array selected
// by the variant (pos32 or pos64; old_values only when keeping old values)
// is touched.
struct ChangeSink {
  uint32_t* pos32 = nullptr;
  uint64_t* pos64 = nullptr;
  uint8_t* new_values = nullptr;
  uint8_t* old_values = nullptr;
};

// Diffs `numel` elements of new_bytes against snapshot, records changed
// element i as position first_index + i, and returns how many it recorded.
using DiffRangeFn = size_t (*)(const uint8_t* new_bytes, uint8_t* snapshot, size_t numel,
                               uint64_t first_index, const ChangeSink& sink);
// Number of differing elements among the first `numel` of a and b.
using CountRangeFn = uint64_t (*)(const uint8_t* a, const uint8_t* b, size_t numel);

struct KernelVariant {
  uint32_t elem_size = 2;
  bool refresh = true;
  bool keep_old = true;
  bool wide = false;
};

// Per-ISA selectors; nullptr for an element size other than 1, 2, 4, 8.
// The x86 ones return code the caller may run only when the CPU has the ISA.
DiffRangeFn ScalarDiffFn(const KernelVariant& variant);
CountRangeFn ScalarCountFn(uint32_t elem_size);
#if defined(__x86_64__)
DiffRangeFn Avx2DiffFn(const KernelVariant& variant);
CountRangeFn Avx2CountFn(uint32_t elem_size);
DiffRangeFn Avx512DiffFn(const KernelVariant& variant);
CountRangeFn Avx512CountFn(uint32_t elem_size);
#endif

// DiffTensor with a switch that records positions in pos64 even for small
// tensors, so tests can exercise the wide path without 2^32 elements.
Status DiffTensorImpl(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                      const DiffOptions& options, bool force_wide, ChangeSet* out);

// ---------------------------------------------------------------------------
// Helpers for the kernels. They carry no target attribute on purpose: they
// are inlined into the ISA-specific loops, and any out-of-line copy the
// linker keeps is plain x86-64 (or portable) code, safe on every CPU.

template <uint32_t kElemSize>
struct ElementInt;
template <>
struct ElementInt<1> {
  using type = uint8_t;
};
template <>
struct ElementInt<2> {
  using type = uint16_t;
};
template <>
struct ElementInt<4> {
  using type = uint32_t;
};
template <>
struct ElementInt<8> {
  using type = uint64_t;
};

// The element at `p` as an unsigned integer (no alignment requirement).
template <uint32_t kElemSize>
inline typename ElementInt<kElemSize>::type LoadElement(const uint8_t* p) {
  typename ElementInt<kElemSize>::type v;
  std::memcpy(&v, p, kElemSize);
  return v;
}

// Writes change number `slot`: its position and the element's new (and old)
// bytes. Must run before the snapshot element is overwritten.
template <uint32_t kElemSize, bool kKeepOld, bool kWide>
inline void RecordChange(const uint8_t* new_elem, const uint8_t* old_elem, uint64_t position,
                         const ChangeSink& sink, size_t slot) {
  if constexpr (kWide) {
    sink.pos64[slot] = position;
  } else {
    sink.pos32[slot] = static_cast<uint32_t>(position);
  }
  std::memcpy(sink.new_values + slot * kElemSize, new_elem, kElemSize);
  if constexpr (kKeepOld) std::memcpy(sink.old_values + slot * kElemSize, old_elem, kElemSize);
}

// Element-by-element diff: the scalar kernel, and the tails of vector kernels.
template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
inline size_t DiffElementwise(const uint8_t* new_bytes, uint8_t* snapshot, size_t numel,
                              uint64_t first_index, const ChangeSink& sink, size_t count) {
  for (size_t i = 0; i < numel; ++i) {
    const uint8_t* new_elem = new_bytes + i * kElemSize;
    uint8_t* old_elem = snapshot + i * kElemSize;
    if (LoadElement<kElemSize>(new_elem) != LoadElement<kElemSize>(old_elem)) {
      RecordChange<kElemSize, kKeepOld, kWide>(new_elem, old_elem, first_index + i, sink, count);
      ++count;
      if constexpr (kRefresh) std::memcpy(old_elem, new_elem, kElemSize);
    }
  }
  return count;
}

template <uint32_t kElemSize>
inline uint64_t CountElementwise(const uint8_t* a, const uint8_t* b, size_t numel) {
  uint64_t count = 0;
  for (size_t i = 0; i < numel; ++i) {
    count += LoadElement<kElemSize>(a + i * kElemSize) != LoadElement<kElemSize>(b + i * kElemSize);
  }
  return count;
}

// Maps runtime flags to Table::Diff<elem_size, refresh, keep_old, wide>.
template <typename Table>
DiffRangeFn PickDiffFn(const KernelVariant& v) {
  const auto for_size = [&v]<uint32_t E>() -> DiffRangeFn {
    const auto for_keep = [&v]<bool R, bool K>() -> DiffRangeFn {
      return v.wide ? &Table::template Diff<E, R, K, true> : &Table::template Diff<E, R, K, false>;
    };
    const auto for_refresh = [&v, &for_keep]<bool R>() -> DiffRangeFn {
      return v.keep_old ? for_keep.template operator()<R, true>()
                        : for_keep.template operator()<R, false>();
    };
    return v.refresh ? for_refresh.template operator()<true>()
                     : for_refresh.template operator()<false>();
  };
  switch (v.elem_size) {
    case 1: return for_size.template operator()<1>();
    case 2: return for_size.template operator()<2>();
    case 4: return for_size.template operator()<4>();
    case 8: return for_size.template operator()<8>();
  }
  return nullptr;
}

// Maps an element size to Table::Count<elem_size>.
template <typename Table>
CountRangeFn PickCountFn(uint32_t elem_size) {
  switch (elem_size) {
    case 1: return &Table::template Count<1>;
    case 2: return &Table::template Count<2>;
    case 4: return &Table::template Count<4>;
    case 8: return &Table::template Count<8>;
  }
  return nullptr;
}

}  // namespace deltasync::diff_internal
