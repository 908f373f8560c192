// AVX-512 kernel: one 64-byte compare per step straight into a per-element
// mask, and masked loads/stores for the tail, so no scalar remainder loop.
// As in the AVX2 kernel, only steps with a change store into the snapshot,
// and the ISA is enabled per function (see diff_avx2.cc for why).
#include "diff/diff_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define DS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,bmi,bmi2,popcnt")))

namespace deltasync::diff_internal {
namespace {

// Bit i set <=> element i of the 64 bytes differs.
template <uint32_t kElemSize>
DS_TARGET_AVX512 inline uint64_t ChangedElements(__m512i a, __m512i b) {
  if constexpr (kElemSize == 1) return _mm512_cmpneq_epi8_mask(a, b);
  if constexpr (kElemSize == 2) return _mm512_cmpneq_epi16_mask(a, b);
  if constexpr (kElemSize == 4) return _mm512_cmpneq_epi32_mask(a, b);
  if constexpr (kElemSize == 8) return _mm512_cmpneq_epi64_mask(a, b);
}

template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
DS_TARGET_AVX512 inline size_t DiffStep(const uint8_t* new_bytes, uint8_t* snapshot,
                                        uint64_t step_index, __mmask64 byte_mask,
                                        const ChangeSink& sink, size_t count) {
  const __m512i n = _mm512_maskz_loadu_epi8(byte_mask, new_bytes);
  const __m512i s = _mm512_maskz_loadu_epi8(byte_mask, snapshot);
  uint64_t changed = ChangedElements<kElemSize>(n, s);
  if (changed == 0) return count;
  do {
    const uint32_t element = static_cast<uint32_t>(_tzcnt_u64(changed));
    RecordChange<kElemSize, kKeepOld, kWide>(new_bytes + element * kElemSize,
                                             snapshot + element * kElemSize, step_index + element,
                                             sink, count);
    ++count;
    changed = _blsr_u64(changed);
  } while (changed != 0);
  if constexpr (kRefresh) _mm512_mask_storeu_epi8(snapshot, byte_mask, n);
  return count;
}

struct Avx512Table {
  template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
  DS_TARGET_AVX512 static size_t Diff(const uint8_t* new_bytes, uint8_t* snapshot, size_t numel,
                                      uint64_t first_index, const ChangeSink& sink) {
    const size_t bytes = numel * kElemSize;
    size_t count = 0;
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
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
