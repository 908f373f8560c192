// AVX-512 kernel: one 64-byte compare per step straight into a per-element
// mask; the refresh is a masked store of exactly the changed elements (a
// zero mask writes nothing, so unchanged lines stay clean), and the tail is
// one masked step instead of a scalar loop. Changes are recorded as in the
// AVX2 kernel (first two per step without a branch; see diff_avx2.cc for
// why), and the ISA is enabled per function for the same reason.
#include "diff/diff_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define DS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,bmi,bmi2,popcnt")))

namespace deltasync::diff_internal {
namespace {

constexpr size_t kPrefetchBytes = 2048;
constexpr int kBranchFreeChanges = 2;

DS_TARGET_AVX512 inline void PrefetchAhead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes),
               _MM_HINT_T0);
}

// Bit i set <=> element i of the 64 bytes differs.
template <uint32_t kElemSize>
DS_TARGET_AVX512 inline uint64_t ChangedElements(__m512i a, __m512i b) {
  if constexpr (kElemSize == 1) return _mm512_cmpneq_epi8_mask(a, b);
  if constexpr (kElemSize == 2) return _mm512_cmpneq_epi16_mask(a, b);
  if constexpr (kElemSize == 4) return _mm512_cmpneq_epi32_mask(a, b);
  if constexpr (kElemSize == 8) return _mm512_cmpneq_epi64_mask(a, b);
}

// Writes the elements of `value` selected by `elements` to `p`.
template <uint32_t kElemSize>
DS_TARGET_AVX512 inline void StoreElements(uint8_t* p, uint64_t elements, __m512i value) {
  if constexpr (kElemSize == 1) _mm512_mask_storeu_epi8(p, elements, value);
  if constexpr (kElemSize == 2)
    _mm512_mask_storeu_epi16(p, static_cast<__mmask32>(elements), value);
  if constexpr (kElemSize == 4)
    _mm512_mask_storeu_epi32(p, static_cast<__mmask16>(elements), value);
  if constexpr (kElemSize == 8) _mm512_mask_storeu_epi64(p, static_cast<__mmask8>(elements), value);
}

// Records the lowest change in `changed` as entry `slot`; with no change
// left it records a scratch entry for element 0, which every step has.
template <uint32_t kElemSize, bool kKeepOld, bool kWide>
DS_TARGET_AVX512 inline void RecordLowest(const uint8_t* step_new, const uint8_t* step_old,
                                          uint64_t changed, uint64_t step_index,
                                          const ChangeSink& sink, size_t slot) {
  constexpr uint32_t kElementsPerStep = 64 / kElemSize;
  const uint32_t element = static_cast<uint32_t>(_tzcnt_u64(changed)) & (kElementsPerStep - 1);
  RecordChange<kElemSize, kKeepOld, kWide>(step_new + element * kElemSize,
                                           step_old + element * kElemSize, step_index + element,
                                           sink, slot);
}

// One step over the bytes of `byte_mask` (all 64, or the tail's first ones).
template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
DS_TARGET_AVX512 inline size_t DiffStep(const uint8_t* step_new, uint8_t* step_old,
                                        uint64_t step_index, __mmask64 byte_mask,
                                        const ChangeSink& sink, size_t count) {
  const __m512i fresh = _mm512_maskz_loadu_epi8(byte_mask, step_new);
  const __m512i stale = _mm512_maskz_loadu_epi8(byte_mask, step_old);
  const uint64_t all_changed = ChangedElements<kElemSize>(fresh, stale);
  uint64_t changed = all_changed;
  for (int i = 0; i < kBranchFreeChanges; ++i) {
    RecordLowest<kElemSize, kKeepOld, kWide>(step_new, step_old, changed, step_index, sink, count);
    count += changed != 0;
    changed = _blsr_u64(changed);
  }
  while (changed != 0) [[unlikely]] {
      RecordLowest<kElemSize, kKeepOld, kWide>(step_new, step_old, changed, step_index, sink,
                                               count);
      ++count;
      changed = _blsr_u64(changed);
    }
  if constexpr (kRefresh) StoreElements<kElemSize>(step_old, all_changed, fresh);
  return count;
}

struct Avx512Table {
  template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
  DS_TARGET_AVX512 static size_t Diff(const uint8_t* new_bytes, uint8_t* snapshot, size_t numel,
                                      uint64_t first_index, const ChangeSink& sink_arg) {
    const ChangeSink sink = sink_arg;  // a local copy cannot alias the bytes stored below
    const size_t bytes = numel * kElemSize;
    size_t count = 0;
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
      PrefetchAhead(new_bytes + off);
      PrefetchAhead(snapshot + off);
      count = DiffStep<kElemSize, kRefresh, kKeepOld, kWide>(new_bytes + off, snapshot + off,
                                                             first_index + off / kElemSize,
                                                             ~__mmask64{0}, sink, count);
    }
    if (off < bytes) {
      count = DiffStep<kElemSize, kRefresh, kKeepOld, kWide>(
          new_bytes + off, snapshot + off, first_index + off / kElemSize,
          _bzhi_u64(~uint64_t{0}, static_cast<uint32_t>(bytes - off)), sink, count);
    }
    return count;
  }

  template <uint32_t kElemSize>
  DS_TARGET_AVX512 static uint64_t Count(const uint8_t* a, const uint8_t* b, size_t numel) {
    const size_t bytes = numel * kElemSize;
    uint64_t count = 0;
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
      PrefetchAhead(a + off);
      PrefetchAhead(b + off);
      count += static_cast<uint64_t>(_mm_popcnt_u64(
          ChangedElements<kElemSize>(_mm512_loadu_si512(a + off), _mm512_loadu_si512(b + off))));
    }
    if (off < bytes) {
      const __mmask64 tail = _bzhi_u64(~uint64_t{0}, static_cast<uint32_t>(bytes - off));
      count += static_cast<uint64_t>(_mm_popcnt_u64(ChangedElements<kElemSize>(
          _mm512_maskz_loadu_epi8(tail, a + off), _mm512_maskz_loadu_epi8(tail, b + off))));
    }
    return count;
  }
};

}  // namespace

DiffRangeFn Avx512DiffFn(const KernelVariant& variant) { return PickDiffFn<Avx512Table>(variant); }
CountRangeFn Avx512CountFn(uint32_t elem_size) { return PickCountFn<Avx512Table>(elem_size); }

}  // namespace deltasync::diff_internal

#endif  // __x86_64__
