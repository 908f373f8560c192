// BLAKE3 as the specification describes it (BLAKE3-team/BLAKE3-specs):
// a 7-round compression function over 64-byte blocks, 1 KiB chunks hashed
// into chaining values, chaining values merged pairwise into a binary tree
// whose root node is compressed once per 64 bytes of output.
#include "deltasync/blake3.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <string>

#include "core/endian.h"

#if defined(__x86_64__) || defined(__i386__)
#define DS_BLAKE3_HAVE_X86 1
#include <immintrin.h>
#else
#define DS_BLAKE3_HAVE_X86 0
#endif

namespace deltasync {
namespace {

constexpr uint32_t kIv[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                             0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};

// Domain-separation flags, one bit each, as numbered by the specification.
enum Flag : uint8_t {
  kChunkStart = 1 << 0,
  kChunkEnd = 1 << 1,
  kParent = 1 << 2,
  kRoot = 1 << 3,
  kKeyedHash = 1 << 4,
  kDeriveKeyContext = 1 << 5,
  kDeriveKeyMaterial = 1 << 6,
};

constexpr size_t kBlockLen = Blake3::kBlockLen;
constexpr size_t kChunkLen = Blake3::kChunkLen;
constexpr size_t kBlocksPerChunk = kChunkLen / kBlockLen;
constexpr size_t kCvLen = 32;
// Whole chunks hashed per batch (64 KiB). Larger batches only save a few
// stack pushes; the chaining-value scratch space on the stack grows with them.
constexpr size_t kMaxBatchChunks = 64;

// The spec permutes the message words between rounds; precomputing which
// original word each round reads avoids moving the words themselves.
using Schedule = std::array<std::array<uint8_t, 16>, 7>;
constexpr Schedule MakeSchedule() {
  constexpr uint8_t kPermutation[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
  Schedule s{};
  for (uint8_t i = 0; i < 16; ++i) s[0][i] = i;
  for (size_t r = 1; r < s.size(); ++r) {
    for (size_t i = 0; i < 16; ++i) s[r][i] = s[r - 1][kPermutation[i]];
  }
  return s;
}
constexpr Schedule kSchedule = MakeSchedule();

inline void LoadWords(const uint8_t* bytes, size_t n, uint32_t* words) {
  for (size_t i = 0; i < n; ++i) words[i] = LoadLe<uint32_t>(bytes + 4 * i);
}

inline void StoreWords(const uint32_t* words, size_t n, uint8_t* bytes) {
  for (size_t i = 0; i < n; ++i) StoreLe<uint32_t>(bytes + 4 * i, words[i]);
}

// ---------------------------------------------------------------------------
// Portable kernel: the reference algorithm, one block at a time.

inline void G(uint32_t v[16], int a, int b, int c, int d, uint32_t mx, uint32_t my) {
  v[a] = v[a] + v[b] + mx;
  v[d] = std::rotr(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = std::rotr(v[b] ^ v[c], 12);
  v[a] = v[a] + v[b] + my;
  v[d] = std::rotr(v[d] ^ v[a], 8);
  v[c] = v[c] + v[d];
  v[b] = std::rotr(v[b] ^ v[c], 7);
}

// Runs the seven rounds; v receives the full 16-word state.
inline void CompressRounds(const uint32_t cv[8], const uint8_t block[kBlockLen], uint32_t block_len,
                           uint64_t counter, uint32_t flags, uint32_t v[16]) {
  uint32_t m[16];
  LoadWords(block, 16, m);
  for (int i = 0; i < 8; ++i) v[i] = cv[i];
  for (int i = 0; i < 4; ++i) v[8 + i] = kIv[i];
  v[12] = static_cast<uint32_t>(counter);
  v[13] = static_cast<uint32_t>(counter >> 32);
  v[14] = block_len;
  v[15] = flags;
  for (const auto& s : kSchedule) {
    G(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    G(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    G(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    G(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    G(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    G(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    G(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    G(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
}

// cv <- the chaining value of compressing `block` under cv.
inline void CompressInPlace(uint32_t cv[8], const uint8_t block[kBlockLen], uint32_t block_len,
                            uint64_t counter, uint32_t flags) {
  uint32_t v[16];
  CompressRounds(cv, block, block_len, counter, flags, v);
  for (int i = 0; i < 8; ++i) cv[i] = v[i] ^ v[i + 8];
}

// The full 64-byte output of one compression, used for root output blocks.
inline void CompressXof(const uint32_t cv[8], const uint8_t block[kBlockLen], uint32_t block_len,
                        uint64_t counter, uint32_t flags, uint8_t out[kBlockLen]) {
  uint32_t v[16];
  CompressRounds(cv, block, block_len, counter, flags, v);
  for (int i = 0; i < 8; ++i) {
    StoreLe<uint32_t>(out + 4 * i, v[i] ^ v[i + 8]);
    StoreLe<uint32_t>(out + 32 + 4 * i, v[i + 8] ^ cv[i]);
  }
}

// The arguments shared by every kernel's many-input hash: each of the
// num_inputs inputs is `blocks` whole blocks long and yields one 32-byte
// chaining value in out (num_inputs * 32 bytes). Input i uses counter + i
// when increment_counter (chunks) and counter otherwise (parent nodes).
struct ManyJob {
  const uint8_t* const* inputs;
  size_t num_inputs;
  size_t blocks;
  const uint32_t* key;
  uint64_t counter;
  bool increment_counter;
  uint8_t flags;
  uint8_t flags_start;  // added on each input's first block
  uint8_t flags_end;    // added on each input's last block
  uint8_t* out;
};

void HashManyPortable(const ManyJob& job) {
  for (size_t i = 0; i < job.num_inputs; ++i) {
    uint32_t cv[8];
    std::memcpy(cv, job.key, sizeof(cv));
    const uint64_t counter = job.counter + (job.increment_counter ? i : 0);
    for (size_t b = 0; b < job.blocks; ++b) {
      uint32_t flags = job.flags;
      if (b == 0) flags |= job.flags_start;
      if (b + 1 == job.blocks) flags |= job.flags_end;
      CompressInPlace(cv, job.inputs[i] + b * kBlockLen, kBlockLen, counter, flags);
    }
    StoreWords(cv, 8, job.out + i * kCvLen);
  }
}

// ---------------------------------------------------------------------------
// AVX2 kernel: eight independent inputs, one per 32-bit lane. Built with a
// target attribute because the rest of the build has no -mavx2; it runs only
// after a runtime check.

#if DS_BLAKE3_HAVE_X86
#define DS_AVX2 __attribute__((target("avx2")))
#define DS_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline

DS_AVX2_INLINE __m256i Add(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
DS_AVX2_INLINE __m256i Xor(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
DS_AVX2_INLINE __m256i Rotr16(__m256i x) {
  return _mm256_shuffle_epi8(
      x, _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13, 2, 3, 0, 1, 6, 7, 4,
                          5, 10, 11, 8, 9, 14, 15, 12, 13));
}
DS_AVX2_INLINE __m256i Rotr12(__m256i x) {
  return _mm256_or_si256(_mm256_srli_epi32(x, 12), _mm256_slli_epi32(x, 20));
}
DS_AVX2_INLINE __m256i Rotr8(__m256i x) {
  return _mm256_shuffle_epi8(
      x, _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12, 1, 2, 3, 0, 5, 6, 7,
                          4, 9, 10, 11, 8, 13, 14, 15, 12));
}
DS_AVX2_INLINE __m256i Rotr7(__m256i x) {
  return _mm256_or_si256(_mm256_srli_epi32(x, 7), _mm256_slli_epi32(x, 25));
}

// One round: the four column G functions, then the four diagonal ones, each
// step applied to all four G's at once so independent work interleaves.
DS_AVX2_INLINE void Round8(__m256i v[16], const __m256i m[16], const std::array<uint8_t, 16>& s) {
  v[0] = Add(Add(v[0], v[4]), m[s[0]]);
  v[1] = Add(Add(v[1], v[5]), m[s[2]]);
  v[2] = Add(Add(v[2], v[6]), m[s[4]]);
  v[3] = Add(Add(v[3], v[7]), m[s[6]]);
  v[12] = Rotr16(Xor(v[12], v[0]));
  v[13] = Rotr16(Xor(v[13], v[1]));
  v[14] = Rotr16(Xor(v[14], v[2]));
  v[15] = Rotr16(Xor(v[15], v[3]));
  v[8] = Add(v[8], v[12]);
  v[9] = Add(v[9], v[13]);
  v[10] = Add(v[10], v[14]);
  v[11] = Add(v[11], v[15]);
  v[4] = Rotr12(Xor(v[4], v[8]));
  v[5] = Rotr12(Xor(v[5], v[9]));
  v[6] = Rotr12(Xor(v[6], v[10]));
  v[7] = Rotr12(Xor(v[7], v[11]));
  v[0] = Add(Add(v[0], v[4]), m[s[1]]);
  v[1] = Add(Add(v[1], v[5]), m[s[3]]);
  v[2] = Add(Add(v[2], v[6]), m[s[5]]);
  v[3] = Add(Add(v[3], v[7]), m[s[7]]);
  v[12] = Rotr8(Xor(v[12], v[0]));
  v[13] = Rotr8(Xor(v[13], v[1]));
  v[14] = Rotr8(Xor(v[14], v[2]));
  v[15] = Rotr8(Xor(v[15], v[3]));
  v[8] = Add(v[8], v[12]);
  v[9] = Add(v[9], v[13]);
  v[10] = Add(v[10], v[14]);
  v[11] = Add(v[11], v[15]);
  v[4] = Rotr7(Xor(v[4], v[8]));
  v[5] = Rotr7(Xor(v[5], v[9]));
  v[6] = Rotr7(Xor(v[6], v[10]));
  v[7] = Rotr7(Xor(v[7], v[11]));

  v[0] = Add(Add(v[0], v[5]), m[s[8]]);
  v[1] = Add(Add(v[1], v[6]), m[s[10]]);
  v[2] = Add(Add(v[2], v[7]), m[s[12]]);
  v[3] = Add(Add(v[3], v[4]), m[s[14]]);
  v[15] = Rotr16(Xor(v[15], v[0]));
  v[12] = Rotr16(Xor(v[12], v[1]));
  v[13] = Rotr16(Xor(v[13], v[2]));
  v[14] = Rotr16(Xor(v[14], v[3]));
  v[10] = Add(v[10], v[15]);
  v[11] = Add(v[11], v[12]);
  v[8] = Add(v[8], v[13]);
  v[9] = Add(v[9], v[14]);
  v[5] = Rotr12(Xor(v[5], v[10]));
  v[6] = Rotr12(Xor(v[6], v[11]));
  v[7] = Rotr12(Xor(v[7], v[8]));
  v[4] = Rotr12(Xor(v[4], v[9]));
  v[0] = Add(Add(v[0], v[5]), m[s[9]]);
  v[1] = Add(Add(v[1], v[6]), m[s[11]]);
  v[2] = Add(Add(v[2], v[7]), m[s[13]]);
  v[3] = Add(Add(v[3], v[4]), m[s[15]]);
  v[15] = Rotr8(Xor(v[15], v[0]));
  v[12] = Rotr8(Xor(v[12], v[1]));
  v[13] = Rotr8(Xor(v[13], v[2]));
  v[14] = Rotr8(Xor(v[14], v[3]));
  v[10] = Add(v[10], v[15]);
  v[11] = Add(v[11], v[12]);
  v[8] = Add(v[8], v[13]);
  v[9] = Add(v[9], v[14]);
  v[5] = Rotr7(Xor(v[5], v[10]));
  v[6] = Rotr7(Xor(v[6], v[11]));
  v[7] = Rotr7(Xor(v[7], v[8]));
  v[4] = Rotr7(Xor(v[4], v[9]));
}

// Transposes an 8x8 matrix of 32-bit words held as eight rows. Turns eight
// inputs' words into one vector per word index, and back.
DS_AVX2_INLINE void Transpose8x8(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]);
  const __m256i t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]);
  const __m256i t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]);
  const __m256i t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]);
  const __m256i t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  // Words (k, k+4) of rows 0-3 in u[k], of rows 4-7 in u[k+4].
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2);
  const __m256i u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3);
  const __m256i u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6);
  const __m256i u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7);
  const __m256i u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Hashes exactly eight inputs of job.blocks blocks each. The small loops over
// vector arrays are unrolled so that the vectors can live in registers: left
// to -O2, they stay in memory and the kernel runs about 20% slower.
DS_AVX2 void Hash8Avx2(const uint8_t* const inputs[8], const ManyJob& job, uint64_t counter,
                       uint8_t* out) {
  __m256i h[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) h[i] = _mm256_set1_epi32(static_cast<int>(job.key[i]));
  alignas(32) uint32_t counter_lo[8];
  alignas(32) uint32_t counter_hi[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const uint64_t c = counter + (job.increment_counter ? static_cast<uint64_t>(i) : 0);
    counter_lo[i] = static_cast<uint32_t>(c);
    counter_hi[i] = static_cast<uint32_t>(c >> 32);
  }
  const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(counter_lo));
  const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(counter_hi));
  const __m256i block_len = _mm256_set1_epi32(static_cast<int>(kBlockLen));

  for (size_t b = 0; b < job.blocks; ++b) {
    uint32_t flags = job.flags;
    if (b == 0) flags |= job.flags_start;
    if (b + 1 == job.blocks) flags |= job.flags_end;

    __m256i m[16];
    const size_t offset = b * kBlockLen;
#pragma GCC unroll 8
    for (int half = 0; half < 2; ++half) {
      __m256i* rows = m + 8 * half;
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        rows[i] =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(inputs[i] + offset + 32 * half));
      }
      Transpose8x8(rows);
    }

    __m256i v[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) v[i] = h[i];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) v[8 + i] = _mm256_set1_epi32(static_cast<int>(kIv[i]));
    v[12] = lo;
    v[13] = hi;
    v[14] = block_len;
    v[15] = _mm256_set1_epi32(static_cast<int>(flags));
#pragma GCC unroll 7
    for (const auto& s : kSchedule) Round8(v, m, s);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) h[i] = Xor(v[i], v[i + 8]);
  }

  Transpose8x8(h);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kCvLen), h[i]);
  }
}

void HashManyAvx2(const ManyJob& job) {
  size_t done = 0;
  for (; done + 8 <= job.num_inputs; done += 8) {
    Hash8Avx2(job.inputs + done, job, job.counter + (job.increment_counter ? done : 0),
              job.out + done * kCvLen);
  }
  const size_t left = job.num_inputs - done;
  if (left == 0) return;
  if (left == 1) {
    // One input gains nothing from the lanes; the portable kernel is cheaper.
    ManyJob rest = job;
    rest.inputs += done;
    rest.num_inputs = 1;
    rest.counter += job.increment_counter ? done : 0;
    rest.out += done * kCvLen;
    HashManyPortable(rest);
    return;
  }
  // Two to seven inputs: fill the idle lanes with copies of the last input
  // and drop their outputs; half-empty lanes still beat one block at a time.
  const uint8_t* padded[8];
  for (size_t i = 0; i < 8; ++i) padded[i] = job.inputs[done + std::min(i, left - 1)];
  uint8_t cvs[8 * kCvLen];
  Hash8Avx2(padded, job, job.counter + (job.increment_counter ? done : 0), cvs);
  std::memcpy(job.out + done * kCvLen, cvs, left * kCvLen);
}

bool CpuHasAvx2() {
  // libgcc's check covers both the CPUID bit and the OS saving YMM state.
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif  // DS_BLAKE3_HAVE_X86

void HashMany(Blake3::Kernel kernel, const ManyJob& job) {
#if DS_BLAKE3_HAVE_X86
  if (kernel == Blake3::Kernel::kAvx2) {
    HashManyAvx2(job);
    return;
  }
#endif
  (void)kernel;
  HashManyPortable(job);
}

// The chaining value of the parent node whose block is left || right.
void ParentCv(const uint32_t key[8], uint8_t mode_flags, const uint8_t block[kBlockLen],
              uint8_t out[kCvLen]) {
  uint32_t cv[8];
  std::memcpy(cv, key, sizeof(cv));
  CompressInPlace(cv, block, kBlockLen, 0, mode_flags | kParent);
  StoreWords(cv, 8, out);
}

}  // namespace

bool Blake3::KernelSupported(Kernel kernel) {
  switch (kernel) {
    case Kernel::kPortable: return true;
    case Kernel::kAvx2:
#if DS_BLAKE3_HAVE_X86
      return CpuHasAvx2();
#else
      return false;
#endif
  }
  return false;
}

Blake3::Kernel Blake3::BestKernel() {
  return KernelSupported(Kernel::kAvx2) ? Kernel::kAvx2 : Kernel::kPortable;
}

Status Blake3::SetKernel(Kernel kernel) {
  switch (kernel) {
    case Kernel::kPortable:
    case Kernel::kAvx2: break;
    default:
      return Status::InvalidArgument(
          "Blake3::SetKernel: " + std::to_string(static_cast<int>(kernel)) +
          " names no kernel (expected portable or avx2)");
  }
  if (!KernelSupported(kernel)) {
    return Status::Unsupported("Blake3::SetKernel: this CPU cannot run the AVX2 kernel");
  }
  kernel_ = kernel;
  return Status::OK();
}

Blake3::Blake3() : Blake3(kIv, 0) {}

Blake3::Blake3(const uint32_t key_words[8], uint8_t mode_flags)
    : mode_flags_(mode_flags), kernel_(BestKernel()) {
  std::memcpy(key_, key_words, sizeof(key_));
  std::memset(buffer_, 0, sizeof(buffer_));
  Reset();
}

Blake3 Blake3::Keyed(std::span<const uint8_t, kKeyLen> key) {
  uint32_t words[8];
  LoadWords(key.data(), 8, words);
  return Blake3(words, kKeyedHash);
}

Blake3 Blake3::DeriveKey(std::string_view context) {
  Blake3 context_hasher(kIv, kDeriveKeyContext);
  context_hasher.Update({reinterpret_cast<const uint8_t*>(context.data()), context.size()});
  uint8_t context_key[kKeyLen];
  context_hasher.Finalize(context_key);
  uint32_t words[8];
  LoadWords(context_key, 8, words);
  return Blake3(words, kDeriveKeyMaterial);
}

void Blake3::Reset() {
  chunk_counter_ = 0;
  buffer_len_ = 0;
  cv_stack_len_ = 0;
}

void Blake3::Update(std::span<const uint8_t> data) {
  const uint8_t* in = data.data();
  size_t left = data.size();
  if (left <= sizeof(buffer_) - buffer_len_) {
    if (left != 0) std::memcpy(buffer_ + buffer_len_, in, left);
    buffer_len_ += left;
    return;
  }
  // More than a full buffer in all. Complete the buffer's partial chunk;
  // input still follows it (the buffer is at most full), so every buffered
  // chunk is now known not to be the last.
  const size_t partial = buffer_len_ % kChunkLen;
  if (partial != 0) {
    const size_t take = kChunkLen - partial;
    std::memcpy(buffer_ + buffer_len_, in, take);
    buffer_len_ += take;
    in += take;
    left -= take;
  }
  // Hash whole chunks straight from the caller's memory, keeping back the
  // final chunk (1 to 1024 bytes): it may end the input.
  const size_t input_chunks = (left - 1) / kChunkLen;
  const size_t buffered_chunks = buffer_len_ / kChunkLen;
  HashWholeChunks(buffer_, buffered_chunks, in, buffered_chunks + input_chunks);
  in += input_chunks * kChunkLen;
  left -= input_chunks * kChunkLen;
  std::memcpy(buffer_, in, left);
  buffer_len_ = left;
}

void Blake3::HashWholeChunks(const uint8_t* first, size_t first_count, const uint8_t* rest,
                             size_t count) {
  const uint8_t* batch[kMaxBatchChunks];
  uint8_t cvs[kMaxBatchChunks * kCvLen];
  size_t done = 0;
  while (done < count) {
    // Batches end on multiples of kMaxBatchChunks so that every batch after
    // the first one forms a single complete subtree.
    const size_t to_boundary = kMaxBatchChunks - chunk_counter_ % kMaxBatchChunks;
    const size_t n = std::min(count - done, to_boundary);
    for (size_t i = 0; i < n; ++i) {
      const size_t index = done + i;
      batch[i] = index < first_count ? first + index * kChunkLen
                                     : rest + (index - first_count) * kChunkLen;
    }
    HashMany(kernel_, ManyJob{batch, n, kBlocksPerChunk, key_, chunk_counter_, true, mode_flags_,
                              kChunkStart, kChunkEnd, cvs});
    AddChunkCvs(cvs, n);
    done += n;
  }
}

void Blake3::AddChunkCvs(uint8_t* cvs, size_t count) {
  const uint8_t* parents[kMaxBatchChunks / 2];
  uint8_t parent_cvs[kMaxBatchChunks / 2 * kCvLen];
  while (count > 0) {
    // The biggest power-of-two run that fits and starts on a multiple of its
    // own size, so that it forms one complete subtree.
    unsigned level = static_cast<unsigned>(std::bit_width(count) - 1);
    if (chunk_counter_ != 0) {
      level = std::min(level, static_cast<unsigned>(std::countr_zero(chunk_counter_)));
    }
    const size_t run = size_t{1} << level;
    // Reduce the run level by level; each parent's block is an adjacent pair
    // of chaining values, so the pairs are read in place.
    for (size_t width = run; width > 1; width /= 2) {
      for (size_t i = 0; i < width / 2; ++i) parents[i] = cvs + i * 2 * kCvLen;
      HashMany(kernel_, ManyJob{parents, width / 2, 1, key_, 0, false,
                                static_cast<uint8_t>(mode_flags_ | kParent), 0, 0, parent_cvs});
      std::memcpy(cvs, parent_cvs, width / 2 * kCvLen);
    }
    PushSubtreeCv(cvs, level);
    cvs += run * kCvLen;
    count -= run;
  }
}

void Blake3::PushSubtreeCv(const uint8_t cv[32], unsigned level) {
  uint8_t block[kBlockLen];
  std::memcpy(block + kCvLen, cv, kCvLen);
  // Each trailing zero of the new subtree count completes a pair of equal
  // subtrees; more input is known to follow, so none of them is the root.
  uint64_t subtrees = (chunk_counter_ >> level) + 1;
  while ((subtrees & 1) == 0) {
    --cv_stack_len_;
    std::memcpy(block, cv_stack_[cv_stack_len_], kCvLen);
    ParentCv(key_, mode_flags_, block, block + kCvLen);
    subtrees >>= 1;
  }
  std::memcpy(cv_stack_[cv_stack_len_], block + kCvLen, kCvLen);
  ++cv_stack_len_;
  chunk_counter_ += uint64_t{1} << level;
}

void Blake3::Finalize(std::span<uint8_t> out) const {
  if (buffer_len_ <= kChunkLen) {
    FinalizeLastChunk(out);
    return;
  }
  // The buffered chunks before the last one are not the root: fold them into
  // the tree of a copy, leaving this hasher as it was.
  Blake3 copy = *this;
  const size_t earlier_chunks = (buffer_len_ - 1) / kChunkLen;
  copy.HashWholeChunks(buffer_, earlier_chunks, nullptr, earlier_chunks);
  copy.buffer_len_ = buffer_len_ - earlier_chunks * kChunkLen;
  std::memcpy(copy.buffer_, buffer_ + earlier_chunks * kChunkLen, copy.buffer_len_);
  copy.FinalizeLastChunk(out);
}

void Blake3::FinalizeLastChunk(std::span<uint8_t> out) const {
  // The node that becomes the root: its input chaining value, last block and
  // parameters, compressed once per 64 output bytes with ROOT set.
  uint32_t cv[8];
  std::memcpy(cv, key_, sizeof(cv));
  uint8_t block[kBlockLen] = {};
  uint32_t block_len;
  uint64_t counter = chunk_counter_;
  uint32_t flags = mode_flags_;

  // The final chunk: every block but its last is compressed now.
  const size_t blocks = buffer_len_ == 0 ? 1 : (buffer_len_ + kBlockLen - 1) / kBlockLen;
  for (size_t b = 0; b + 1 < blocks; ++b) {
    CompressInPlace(cv, buffer_ + b * kBlockLen, kBlockLen, counter,
                    mode_flags_ | (b == 0 ? kChunkStart : 0));
  }
  block_len = static_cast<uint32_t>(buffer_len_ - (blocks - 1) * kBlockLen);
  std::memcpy(block, buffer_ + (blocks - 1) * kBlockLen, block_len);
  flags |= kChunkEnd | (blocks == 1 ? kChunkStart : 0);

  // Fold the pending subtrees from the smallest (rightmost) to the largest.
  for (size_t i = cv_stack_len_; i-- > 0;) {
    CompressInPlace(cv, block, block_len, counter, flags);
    StoreWords(cv, 8, block + kCvLen);
    std::memcpy(block, cv_stack_[i], kCvLen);
    std::memcpy(cv, key_, sizeof(cv));
    block_len = kBlockLen;
    counter = 0;
    flags = mode_flags_ | kParent;
  }

  uint8_t out_block[kBlockLen];
  uint64_t output_counter = 0;
  for (size_t pos = 0; pos < out.size(); pos += kBlockLen) {
    CompressXof(cv, block, block_len, output_counter++, flags | kRoot, out_block);
    std::memcpy(out.data() + pos, out_block, std::min(kBlockLen, out.size() - pos));
  }
}

}  // namespace deltasync
