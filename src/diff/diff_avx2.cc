// AVX2 kernel: 64 bytes per step, two 32-byte compares folded into one
// 64-bit mask. The common step (nothing changed) is two loads of each side
// and no store at all: an equal snapshot already holds the new bytes, so
// only steps with a change write the snapshot back. That keeps unchanged
// cache lines clean, which is why the fused diff can run at copy speed.
//
// Compiled with a per-function target attribute, not per-file -mavx2: a
// file-wide flag would also apply to inline library code instantiated here,
// and the linker could keep that AVX2 copy for callers on any CPU.
#include "diff/diff_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define DS_TARGET_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt")))

namespace deltasync::diff_internal {
namespace {

// One bit per element in a byte mask: the element's first byte.
template <uint32_t kElemSize>
constexpr uint64_t kFirstByteBits = kElemSize == 1   ? ~uint64_t{0}
                                    : kElemSize == 2 ? 0x5555555555555555ull
                                    : kElemSize == 4 ? 0x1111111111111111ull
                                                     : 0x0101010101010101ull;

template <uint32_t kElemSize>
DS_TARGET_AVX2 inline __m256i EqualLanes(__m256i a, __m256i b) {
  if constexpr (kElemSize == 1) return _mm256_cmpeq_epi8(a, b);
  if constexpr (kElemSize == 2) return _mm256_cmpeq_epi16(a, b);
  if constexpr (kElemSize == 4) return _mm256_cmpeq_epi32(a, b);
  if constexpr (kElemSize == 8) return _mm256_cmpeq_epi64(a, b);
}

// Bit b set <=> byte b of the 64 starts an element that differs.
template <uint32_t kElemSize>
DS_TARGET_AVX2 inline uint64_t ChangedFirstBytes(__m256i n0, __m256i n1, __m256i s0, __m256i s1) {
  const uint64_t equal_lo =
      static_cast<uint32_t>(_mm256_movemask_epi8(EqualLanes<kElemSize>(n0, s0)));
  const uint64_t equal_hi =
      static_cast<uint32_t>(_mm256_movemask_epi8(EqualLanes<kElemSize>(n1, s1)));
  return ~(equal_lo | (equal_hi << 32)) & kFirstByteBits<kElemSize>;
}

struct Avx2Table {
  template <uint32_t kElemSize, bool kRefresh, bool kKeepOld, bool kWide>
  DS_TARGET_AVX2 static size_t Diff(const uint8_t* new_bytes, uint8_t* snapshot, size_t numel,
                                    uint64_t first_index, const ChangeSink& sink) {
    const size_t bytes = numel * kElemSize;
    size_t count = 0;
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
      const __m256i n0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(new_bytes + off));
      const __m256i n1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(new_bytes + off + 32));
      const __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(snapshot + off));
      const __m256i s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(snapshot + off + 32));
      uint64_t changed = ChangedFirstBytes<kElemSize>(n0, n1, s0, s1);
      if (changed == 0) continue;
      const uint64_t step_index = first_index + off / kElemSize;
      do {
        const uint32_t byte = static_cast<uint32_t>(_tzcnt_u64(changed));
        RecordChange<kElemSize, kKeepOld, kWide>(new_bytes + off + byte, snapshot + off + byte,
                                                 step_index + byte / kElemSize, sink, count);
        ++count;
        changed = _blsr_u64(changed);
      } while (changed != 0);
      if constexpr (kRefresh) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(snapshot + off), n0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(snapshot + off + 32), n1);
      }
    }
    return DiffElementwise<kElemSize, kRefresh, kKeepOld, kWide>(
        new_bytes + off, snapshot + off, (bytes - off) / kElemSize, first_index + off / kElemSize,
        sink, count);
  }

  template <uint32_t kElemSize>
  DS_TARGET_AVX2 static uint64_t Count(const uint8_t* a, const uint8_t* b, size_t numel) {
    const size_t bytes = numel * kElemSize;
    uint64_t count = 0;
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + off));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + off + 32));
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off + 32));
      count += static_cast<uint64_t>(_mm_popcnt_u64(ChangedFirstBytes<kElemSize>(a0, a1, b0, b1)));
    }
    return count + CountElementwise<kElemSize>(a + off, b + off, (bytes - off) / kElemSize);
  }
};

}  // namespace

DiffRangeFn Avx2DiffFn(const KernelVariant& variant) { return PickDiffFn<Avx2Table>(variant); }
CountRangeFn Avx2CountFn(uint32_t elem_size) { return PickCountFn<Avx2Table>(elem_size); }

}  // namespace deltasync::diff_internal

#endif  // __x86_64__
