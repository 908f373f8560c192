#include "stream/state_digest.h"

#include "core/cpu_isa.h"
#include "core/element_digest.h"
#include "core/endian.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics start some results from an undefined vector
// and warn about it once inlined (GCC bug 105593); the warnings point into
// the header, so they are silenced for its lines.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

namespace deltasync::stream {

namespace {

using element_digest::FmixA;
using element_digest::FmixB;
using element_digest::kFmixA1;
using element_digest::kFmixA2;
using element_digest::kFmixB1;
using element_digest::kFmixB2;
using element_digest::kMulA;
using element_digest::kMulB;
using element_digest::PositionKey;

bool IsValidElemSize(uint32_t elem_size) {
  return elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8;
}

// The scalar reference: the definition, one element after the other. The
// position keys advance by their multiplier per element (t grows by one as
// long as positions stay below 2^56).
template <uint32_t W>
StateDigest DigestScalar(const uint8_t* p, uint64_t n, uint64_t first) {
  const uint64_t t = PositionKey(first, W);
  uint64_t ka = element_digest::KeyA(t);
  uint64_t kb = element_digest::KeyB(t);
  uint64_t a = 0, b = 0;
  for (uint64_t k = 0; k < n; ++k) {
    const uint64_t v = LoadLe<UintOfWidth<W>>(p + k * W);
    a += FmixA(ka ^ v);
    b += FmixB(kb ^ v);
    ka += kMulA;
    kb += kMulB;
  }
  return {a, b};
}

#if defined(__x86_64__)

#define DS_TARGET_AVX2 __attribute__((target("avx2")))
#define DS_TARGET_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

// AVX2 has no 64-bit multiply: the low 64 bits of x * c from three 32x32
// products (the high halves' product only reaches bits 64 and up).
DS_TARGET_AVX2 inline __m256i Mul64Avx2(__m256i x, __m256i c_lo, __m256i c_hi) {
  const __m256i lo = _mm256_mul_epu32(x, c_lo);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), c_lo), _mm256_mul_epu32(x, c_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

struct Avx2Const {
  __m256i lo, hi;
};

DS_TARGET_AVX2 inline Avx2Const SplitAvx2(uint64_t c) {
  return {_mm256_set1_epi64x(static_cast<int64_t>(c & 0xFFFFFFFFu)),
          _mm256_set1_epi64x(static_cast<int64_t>(c >> 32))};
}

template <int S>
DS_TARGET_AVX2 inline __m256i XorShiftAvx2(__m256i x) {
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, S));
}

// Four elements' bits, zero-extended to 64 bits.
template <uint32_t W>
DS_TARGET_AVX2 inline __m256i Load4Avx2(const uint8_t* p) {
  if constexpr (W == 1) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(v)));
  } else if constexpr (W == 2) {
    return _mm256_cvtepu16_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (W == 4) {
    return _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
}

DS_TARGET_AVX2 inline uint64_t SumAvx2(__m256i v) {
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

template <uint32_t W>
DS_TARGET_AVX2 StateDigest DigestAvx2(const uint8_t* p, uint64_t n, uint64_t first) {
  const uint64_t t = PositionKey(first, W);
  const uint64_t ka0 = element_digest::KeyA(t), kb0 = element_digest::KeyB(t);
  __m256i ka = _mm256_setr_epi64x(static_cast<int64_t>(ka0), static_cast<int64_t>(ka0 + kMulA),
                                  static_cast<int64_t>(ka0 + 2 * kMulA),
                                  static_cast<int64_t>(ka0 + 3 * kMulA));
  __m256i kb = _mm256_setr_epi64x(static_cast<int64_t>(kb0), static_cast<int64_t>(kb0 + kMulB),
                                  static_cast<int64_t>(kb0 + 2 * kMulB),
                                  static_cast<int64_t>(kb0 + 3 * kMulB));
  const __m256i step_a = _mm256_set1_epi64x(static_cast<int64_t>(4 * kMulA));
  const __m256i step_b = _mm256_set1_epi64x(static_cast<int64_t>(4 * kMulB));
  const Avx2Const a1 = SplitAvx2(kFmixA1), a2 = SplitAvx2(kFmixA2);
  const Avx2Const b1 = SplitAvx2(kFmixB1), b2 = SplitAvx2(kFmixB2);
  __m256i acc_a = _mm256_setzero_si256(), acc_b = _mm256_setzero_si256();
  const uint64_t whole = n & ~uint64_t{3};
  for (uint64_t k = 0; k < whole; k += 4) {
    const __m256i v = Load4Avx2<W>(p + k * W);
    __m256i xa = XorShiftAvx2<33>(_mm256_xor_si256(ka, v));
    xa = XorShiftAvx2<33>(Mul64Avx2(xa, a1.lo, a1.hi));
    xa = XorShiftAvx2<33>(Mul64Avx2(xa, a2.lo, a2.hi));
    __m256i xb = XorShiftAvx2<30>(_mm256_xor_si256(kb, v));
    xb = XorShiftAvx2<27>(Mul64Avx2(xb, b1.lo, b1.hi));
    xb = XorShiftAvx2<31>(Mul64Avx2(xb, b2.lo, b2.hi));
    acc_a = _mm256_add_epi64(acc_a, xa);
    acc_b = _mm256_add_epi64(acc_b, xb);
    ka = _mm256_add_epi64(ka, step_a);
    kb = _mm256_add_epi64(kb, step_b);
  }
  StateDigest d{SumAvx2(acc_a), SumAvx2(acc_b)};
  if (whole < n) d += DigestScalar<W>(p + whole * W, n - whole, first + whole);
  return d;
}

template <int S>
DS_TARGET_AVX512 inline __m512i XorShift512(__m512i x) {
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, S));
}

// Eight elements' bits, zero-extended; `mask` selects the first ones (the
// tail), whose loads touch nothing past them.
template <uint32_t W>
DS_TARGET_AVX512 inline __m512i Load8Avx512(const uint8_t* p) {
  if constexpr (W == 1) {
    return _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (W == 2) {
    return _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (W == 4) {
    return _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_si512(p);
  }
}

template <uint32_t W>
DS_TARGET_AVX512 inline __m512i Load8MaskedAvx512(const uint8_t* p, __mmask8 mask) {
  if constexpr (W == 1) {
    return _mm512_cvtepu8_epi64(_mm_maskz_loadu_epi8(mask, p));
  } else if constexpr (W == 2) {
    return _mm512_cvtepu16_epi64(_mm_maskz_loadu_epi16(mask, p));
  } else if constexpr (W == 4) {
    return _mm512_cvtepu32_epi64(_mm256_maskz_loadu_epi32(mask, p));
  } else {
    return _mm512_maskz_loadu_epi64(mask, p);
  }
}

struct Avx512State {
  __m512i ka, kb, acc_a, acc_b;
};

DS_TARGET_AVX512 inline void Step512(Avx512State& s, __m512i v, __mmask8 mask) {
  __m512i xa = XorShift512<33>(_mm512_xor_si512(s.ka, v));
  xa = XorShift512<33>(_mm512_mullo_epi64(xa, _mm512_set1_epi64(static_cast<int64_t>(kFmixA1))));
  xa = XorShift512<33>(_mm512_mullo_epi64(xa, _mm512_set1_epi64(static_cast<int64_t>(kFmixA2))));
  __m512i xb = XorShift512<30>(_mm512_xor_si512(s.kb, v));
  xb = XorShift512<27>(_mm512_mullo_epi64(xb, _mm512_set1_epi64(static_cast<int64_t>(kFmixB1))));
  xb = XorShift512<31>(_mm512_mullo_epi64(xb, _mm512_set1_epi64(static_cast<int64_t>(kFmixB2))));
  s.acc_a = _mm512_mask_add_epi64(s.acc_a, mask, s.acc_a, xa);
  s.acc_b = _mm512_mask_add_epi64(s.acc_b, mask, s.acc_b, xb);
  s.ka = _mm512_add_epi64(s.ka, _mm512_set1_epi64(static_cast<int64_t>(8 * kMulA)));
  s.kb = _mm512_add_epi64(s.kb, _mm512_set1_epi64(static_cast<int64_t>(8 * kMulB)));
}

// The lanes' sum mod 2^64 (_mm512_reduce_add_epi64 adds as signed integers,
// which overflow).
DS_TARGET_AVX512 inline uint64_t Sum512(__m512i v) {
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, v);
  uint64_t sum = 0;
  for (uint64_t lane : lanes) sum += lane;
  return sum;
}

template <uint32_t W>
DS_TARGET_AVX512 StateDigest DigestAvx512(const uint8_t* p, uint64_t n, uint64_t first) {
  const uint64_t t = PositionKey(first, W);
  const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  Avx512State s;
  s.ka = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(element_digest::KeyA(t))),
                          _mm512_mullo_epi64(lane, _mm512_set1_epi64(static_cast<int64_t>(kMulA))));
  s.kb = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(element_digest::KeyB(t))),
                          _mm512_mullo_epi64(lane, _mm512_set1_epi64(static_cast<int64_t>(kMulB))));
  s.acc_a = _mm512_setzero_si512();
  s.acc_b = _mm512_setzero_si512();
  const uint64_t whole = n & ~uint64_t{7};
  for (uint64_t k = 0; k < whole; k += 8) Step512(s, Load8Avx512<W>(p + k * W), 0xFF);
  if (whole < n) {
    const __mmask8 mask = static_cast<__mmask8>((1u << (n - whole)) - 1);
    Step512(s, Load8MaskedAvx512<W>(p + whole * W, mask), mask);
  }
  return {Sum512(s.acc_a), Sum512(s.acc_b)};
}

#endif  // __x86_64__

bool CpuRuns(DigestKernel kernel) {
  switch (kernel) {
    case DigestKernel::kScalar: return true;
    case DigestKernel::kAvx2: return core_internal::CpuRuns(core_internal::CpuIsa::kAvx2);
    case DigestKernel::kAvx512: return core_internal::CpuRuns(core_internal::CpuIsa::kAvx512);
  }
  return false;
}

using DigestFn = StateDigest (*)(const uint8_t*, uint64_t, uint64_t);

template <uint32_t W>
DigestFn SelectForWidth(DigestKernel kernel) {
  switch (kernel) {
#if defined(__x86_64__)
    case DigestKernel::kAvx2: return &DigestAvx2<W>;
    case DigestKernel::kAvx512: return &DigestAvx512<W>;
#endif
    default: return &DigestScalar<W>;
  }
}

DigestFn SelectDigestFn(DigestKernel kernel, uint32_t elem_size) {
  switch (elem_size) {
    case 1: return SelectForWidth<1>(kernel);
    case 2: return SelectForWidth<2>(kernel);
    case 4: return SelectForWidth<4>(kernel);
    default: return SelectForWidth<8>(kernel);
  }
}

std::string U64(uint64_t v) { return std::to_string(v); }

Status CheckElemSize(std::string_view what, uint32_t elem_size) {
  if (IsValidElemSize(elem_size)) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": element size " + U64(elem_size) +
                                 " is not 1, 2, 4 or 8");
}

// Positions [first, first + n) must stay below kMaxStreamNumel.
Status CheckPositions(std::string_view what, uint64_t first, uint64_t n) {
  if (first > kMaxStreamNumel || n > kMaxStreamNumel - first) {
    return Status::InvalidArgument(std::string(what) + ": elements [" + U64(first) + ", +" +
                                   U64(n) + ") reach past 2^56");
  }
  return Status::OK();
}

}  // namespace

std::string StateDigest::ToHex() const {
  char text[33];
  std::snprintf(text, sizeof(text), "%016llx%016llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b));
  return text;
}

Status DigestBlock::Validate() const {
  const std::string what = "digest block " + ToString();
  if (rows == 0) return Status::InvalidArgument(what + ": no rows");
  if (rows == 1) {
    if (row_stride != 0) {
      return Status::InvalidArgument(what + ": a single row must have row stride 0");
    }
    if (count == 0 && first != 0) {
      return Status::InvalidArgument(what + ": an empty block must start at 0");
    }
    return CheckPositions(what, first, count);
  }
  if (count == 0) return Status::InvalidArgument(what + ": several rows of no elements");
  // One representation per set of elements: rows that touch are one row.
  if (row_stride < count) return Status::InvalidArgument(what + ": rows overlap");
  if (row_stride == count) {
    return Status::InvalidArgument(what + ": rows touch (it is one row of " + std::to_string(rows) +
                                   " x " + std::to_string(count) + ")");
  }
  // first + (rows - 1) * row_stride + count <= 2^56, without overflow.
  if (rows - 1 > kMaxStreamNumel / row_stride) {
    return Status::InvalidArgument(what + ": reaches past 2^56");
  }
  return CheckPositions(what, first, (rows - 1) * row_stride + count);
}

std::string DigestBlock::ToString() const {
  // Appended piece by piece: GCC 12 misreads "literal" + std::string here
  // as an overlapping copy (-Wrestrict, GCC bug 105329).
  std::string s = "[";
  s.append(U64(first)).append(", +").append(U64(count)).append(")");
  if (rows != 1 || row_stride != 0) {
    s.append(" x ").append(U64(rows)).append(" step ").append(U64(row_stride));
  }
  return s;
}

Positions Positions::Of(const ChangeSet& changes, uint64_t base) {
  Positions p;
  if (changes.wide) {
    p.wide = changes.pos64;
  } else {
    p.narrow = changes.pos32;
  }
  p.base = base;
  return p;
}

Status Positions::Check(uint64_t limit) const {
  if (!narrow.empty() && !wide.empty()) {
    return Status::InvalidArgument("positions: both 32-bit and 64-bit offsets given");
  }
  const size_t n = size();
  uint64_t previous = 0;
  for (size_t k = 0; k < n; ++k) {
    const uint64_t offset = wide.empty() ? narrow[k] : wide[k];
    if (offset >= limit || base >= limit - offset) {
      return Status::InvalidArgument("positions: position " + U64(k) + " (" + U64(base) + " + " +
                                     U64(offset) + ") is not below " + U64(limit));
    }
    const uint64_t p = base + offset;
    if (k > 0 && p <= previous) {
      return Status::InvalidArgument("positions: not strictly increasing at " + U64(k) + " (" +
                                     U64(p) + " after " + U64(previous) + ")");
    }
    previous = p;
  }
  return Status::OK();
}

std::string_view DigestKernelName(DigestKernel kernel) {
  switch (kernel) {
    case DigestKernel::kScalar: return "scalar";
    case DigestKernel::kAvx2: return "avx2";
    case DigestKernel::kAvx512: return "avx512";
  }
  return "unknown";
}

std::vector<DigestKernel> AvailableDigestKernels() {
  std::vector<DigestKernel> kernels;
  for (DigestKernel k : {DigestKernel::kScalar, DigestKernel::kAvx2, DigestKernel::kAvx512}) {
    if (CpuRuns(k)) kernels.push_back(k);
  }
  return kernels;
}

DigestKernel BestDigestKernel() {
  static const DigestKernel best = AvailableDigestKernels().back();
  return best;
}

Result<StateDigest> ComputeStateDigest(std::span<const uint8_t> bytes, uint32_t elem_size,
                                       uint64_t first_position, const DigestOptions& options) {
  DS_RETURN_IF_ERROR(CheckElemSize("state digest", elem_size));
  if (bytes.size() % elem_size != 0) {
    return Status::InvalidArgument("state digest: " + U64(bytes.size()) +
                                   " bytes are not whole elements of " + U64(elem_size));
  }
  if (!CpuRuns(options.kernel)) {
    return Status::InvalidArgument("state digest: this CPU cannot run the " +
                                   std::string(DigestKernelName(options.kernel)) + " kernel");
  }
  const uint64_t n = bytes.size() / elem_size;
  DS_RETURN_IF_ERROR(CheckPositions("state digest", first_position, n));
  const DigestFn fn = SelectDigestFn(options.kernel, elem_size);
  const uint64_t chunk = std::max<uint64_t>(1, options.parallel_chunk_bytes / elem_size);
  if (options.pool == nullptr || options.pool->size() == 0 || n <= chunk) {
    return fn(bytes.data(), n, first_position);
  }
  const size_t chunks = static_cast<size_t>((n + chunk - 1) / chunk);
  std::vector<StateDigest> parts(chunks);
  options.pool->ParallelFor(chunks, [&](size_t c) {
    const uint64_t begin = c * chunk;
    const uint64_t count = std::min(chunk, n - begin);
    parts[c] = fn(bytes.data() + begin * elem_size, count, first_position + begin);
  });
  StateDigest d;
  for (const StateDigest& part : parts) d += part;
  return d;
}

Result<StateDigest> ComputeStridedStateDigest(std::span<const uint8_t> bytes, uint32_t elem_size,
                                              uint64_t first_position, uint64_t count,
                                              uint64_t stride) {
  DS_RETURN_IF_ERROR(CheckElemSize("strided state digest", elem_size));
  if (stride == 0) return Status::InvalidArgument("strided state digest: stride 0");
  // Element count - 1 lies stride * (count - 1) elements past the first.
  const uint64_t slots = bytes.size() / elem_size;
  if (count > 0 && (slots == 0 || (count - 1) > (slots - 1) / stride)) {
    return Status::InvalidArgument("strided state digest: " + U64(count) + " elements of stride " +
                                   U64(stride) + " do not fit " + U64(bytes.size()) + " bytes");
  }
  DS_RETURN_IF_ERROR(CheckPositions("strided state digest", first_position, count));
  if (stride == 1) {
    return SelectDigestFn(BestDigestKernel(), elem_size)(bytes.data(), count, first_position);
  }
  StateDigest d;
  for (uint64_t k = 0; k < count; ++k) {
    d += ElementDigest(first_position + k,
                       LoadLeWidth(bytes.data() + k * stride * elem_size, elem_size), elem_size);
  }
  return d;
}

Result<StateDigest> ComputeBlockPartDigest(std::span<const uint8_t> held, uint32_t elem_size,
                                           uint64_t held_first, const DigestBlock& block,
                                           const DigestOptions& options) {
  DS_RETURN_IF_ERROR(CheckElemSize("block digest", elem_size));
  DS_RETURN_IF_ERROR(block.Validate());
  if (held.size() % elem_size != 0) {
    return Status::InvalidArgument("block digest: " + U64(held.size()) +
                                   " bytes are not whole elements of " + U64(elem_size));
  }
  const uint64_t held_n = held.size() / elem_size;
  DS_RETURN_IF_ERROR(CheckPositions("block digest", held_first, held_n));
  const uint64_t held_end = held_first + held_n;
  StateDigest d;
  if (block.count == 0) return d;
  // Rows before r = (held_first - first) / row_stride end at or before
  // held_first; the loop stops at the first row starting at held_end.
  uint64_t r = 0;
  if (block.rows > 1 && held_first > block.first) {
    r = (held_first - block.first) / block.row_stride;
  }
  for (; r < block.rows; ++r) {
    const uint64_t row_first = block.first + r * block.row_stride;
    if (row_first >= held_end) break;
    const uint64_t lo = std::max(row_first, held_first);
    const uint64_t hi = std::min(row_first + block.count, held_end);
    if (lo >= hi) continue;
    DS_ASSIGN_OR_RETURN(
        StateDigest part,
        ComputeStateDigest(held.subspan((lo - held_first) * elem_size, (hi - lo) * elem_size),
                           elem_size, lo, options));
    d += part;
  }
  return d;
}

Status UpdateStateDigest(StateDigest* digest, const Positions& positions,
                         std::span<const uint8_t> old_values, std::span<const uint8_t> new_values,
                         uint32_t elem_size) {
  DS_RETURN_IF_ERROR(CheckElemSize("state digest update", elem_size));
  if (digest == nullptr) return Status::InvalidArgument("state digest update: no digest");
  const size_t n = positions.size();
  if (old_values.size() / elem_size != n || old_values.size() % elem_size != 0 ||
      new_values.size() != old_values.size()) {
    return Status::InvalidArgument("state digest update: " + U64(n) + " positions but " +
                                   U64(old_values.size()) + " old and " + U64(new_values.size()) +
                                   " new value bytes of " + U64(elem_size));
  }
  Status checked = positions.Check(kMaxStreamNumel);
  if (!checked.ok()) return checked.WithContext("state digest update");
  StateDigest d = *digest;
  for (size_t k = 0; k < n; ++k) {
    const uint64_t p = positions[k];
    d += ElementChangeDigest(p, LoadLeWidth(old_values.data() + k * elem_size, elem_size),
                             LoadLeWidth(new_values.data() + k * elem_size, elem_size), elem_size);
  }
  *digest = d;
  return Status::OK();
}

}  // namespace deltasync::stream
