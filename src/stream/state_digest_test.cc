#include "stream/state_digest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "deltasync/thread_pool.h"

namespace deltasync::stream {
namespace {

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(SplitMix(seed));
  return v;
}

uint64_t Bits(const uint8_t* p, uint32_t w) {
  uint64_t v = 0;
  for (uint32_t i = 0; i < w; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

// The definition, element by element (ElementDigest is checked against the
// published vectors below).
StateDigest BruteForce(std::span<const uint8_t> bytes, uint32_t w, uint64_t first) {
  StateDigest d;
  for (size_t k = 0; k < bytes.size() / w; ++k)
    d += ElementDigest(first + k, Bits(&bytes[k * w], w), w);
  return d;
}

// Computed with the Python code in docs/format.md ("Stream: state digest")
// over the bytes 0, 1, ..., 63.
struct SpanVector {
  uint32_t w;
  uint64_t first;
  uint64_t a, b;
};
constexpr SpanVector kSpanVectors[] = {
    {1, 0ull, 0xd7c85e55af24e3deull, 0xe2e5623bee4087bdull},
    {1, 1000003ull, 0x00f661d92850bbcaull, 0xbf51f5e58f2d17bcull},
    {1, 72057594037927872ull, 0xd475bfbaf7797c48ull, 0x56434ccb23b33333ull},
    {2, 0ull, 0xbf4faa30c6d66c12ull, 0xf1248443fcc4d9b5ull},
    {2, 1000003ull, 0x69c3628c65777683ull, 0x95e22bbee4e3aec1ull},
    {2, 72057594037927904ull, 0x8b2f988b5d5327e2ull, 0xfbba1c6a534ec196ull},
    {4, 0ull, 0x834a6373451c122full, 0x6c96089eceae9645ull},
    {4, 1000003ull, 0xf74c34fd9305a265ull, 0x9bc63d40ac466a72ull},
    {4, 72057594037927920ull, 0x44669b9c6a4593e5ull, 0xbc7078f8739e691cull},
    {8, 0ull, 0xe411bbfb84302df5ull, 0x4de1c89716963ac8ull},
    {8, 1000003ull, 0xeae5819bd58bcc34ull, 0x5de6041c0582f160ull},
    {8, 72057594037927928ull, 0x22f79569d90054f0ull, 0xd5b8800768237f57ull},
};

struct ElementVector {
  uint32_t w;
  uint64_t bits;
  uint64_t position;
  uint64_t a, b;
};
constexpr ElementVector kElementVectors[] = {
    {2, 0x3f80ull, 0ull, 0x1399c4f5dd1c6c42ull, 0x1db88b5b5126c413ull},
    {2, 0x3f80ull, 1ull, 0x599744574d2be09dull, 0x8bf596b0ed79edf0ull},
    {2, 0xbf80ull, 0ull, 0x9075fe3bc369cb42ull, 0x96c1b0263d3be4d1ull},
    {4, 0x7fc00001ull, 12345ull, 0x88738485ac9a5742ull, 0xa548a5c20863bce0ull},
    {8, 0x8000000000000000ull, 72057594037927935ull, 0x818f97f4869a596full, 0x28df2063fb272c01ull},
    {1, 0x0ull, 0ull, 0x7acdbb98b1344213ull, 0xdfc7a99951f24649ull},
    {1, 0xffull, 7ull, 0xfe029cff57500970ull, 0xc95649cafff3b852ull},
};

TEST(StateDigest, ElementDigestMatchesThePythonDefinition) {
  for (const ElementVector& v : kElementVectors) {
    const StateDigest d = ElementDigest(v.position, v.bits, v.w);
    EXPECT_EQ(d.a, v.a) << v.w << " " << v.position;
    EXPECT_EQ(d.b, v.b) << v.w << " " << v.position;
  }
}

TEST(StateDigest, EveryKernelMatchesThePythonDefinition) {
  std::vector<uint8_t> data(64);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i);
  for (DigestKernel kernel : AvailableDigestKernels()) {
    DigestOptions options;
    options.kernel = kernel;
    for (const SpanVector& v : kSpanVectors) {
      Result<StateDigest> d = ComputeStateDigest(data, v.w, v.first, options);
      ASSERT_TRUE(d.ok()) << d.status().ToString();
      EXPECT_EQ(*d, (StateDigest{v.a, v.b}))
          << DigestKernelName(kernel) << " w=" << v.w << " first=" << v.first;
    }
  }
}

TEST(StateDigest, HexIsLaneAThenLaneB) {
  EXPECT_EQ((StateDigest{0x0123456789abcdefull, 0xfedcba9876543210ull}).ToHex(),
            "0123456789abcdeffedcba9876543210");
  EXPECT_EQ(StateDigest{}.ToHex(), std::string(32, '0'));
}

// Every kernel against the scalar reference, for every width, every length
// up to a few vector steps and misaligned starts (tails and masks).
TEST(StateDigest, KernelsAgreeWithScalar) {
  const std::vector<uint8_t> data = RandomBytes(8 * 200 + 8, 7);
  DigestOptions scalar;
  scalar.kernel = DigestKernel::kScalar;
  for (DigestKernel kernel : AvailableDigestKernels()) {
    DigestOptions options;
    options.kernel = kernel;
    for (uint32_t w : {1u, 2u, 4u, 8u}) {
      for (size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
        for (size_t n = 0; n <= 70; ++n) {
          std::span<const uint8_t> span(data.data() + offset, n * w);
          const uint64_t first = 1000 * n + offset;
          Result<StateDigest> want = ComputeStateDigest(span, w, first, scalar);
          Result<StateDigest> got = ComputeStateDigest(span, w, first, options);
          ASSERT_TRUE(want.ok() && got.ok());
          ASSERT_EQ(*got, *want) << DigestKernelName(kernel) << " w=" << w << " n=" << n;
          ASSERT_EQ(*want, BruteForce(span, w, first));
        }
      }
    }
  }
}

TEST(StateDigest, PoolGivesTheSameDigest) {
  ThreadPool pool(3);
  const std::vector<uint8_t> data = RandomBytes(100003 * 2, 11);
  DigestOptions options;
  options.pool = &pool;
  options.parallel_chunk_bytes = 4096 + 6;  // not a multiple of anything nice
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    std::span<const uint8_t> span(data.data(), data.size() / w * w);
    Result<StateDigest> serial = ComputeStateDigest(span, w, 17);
    Result<StateDigest> parallel = ComputeStateDigest(span, w, 17, options);
    ASSERT_TRUE(serial.ok() && parallel.ok());
    EXPECT_EQ(*parallel, *serial) << w;
  }
}

// A sharded trainer: each rank computes its flat shard's part, rank 0 adds
// them; the sum is the whole tensor's digest.
TEST(StateDigest, ShardPartsAddUpToTheWhole) {
  const uint32_t w = 2;
  const std::vector<uint8_t> tensor = RandomBytes(4099 * w, 3);
  const uint64_t numel = tensor.size() / w;
  Result<StateDigest> whole = ComputeStateDigest(tensor, w, 0);
  ASSERT_TRUE(whole.ok());
  uint64_t seed = 5;
  for (int trial = 0; trial < 20; ++trial) {
    std::set<uint64_t> cuts = {0, numel};
    for (int c = 0; c < trial % 7; ++c) cuts.insert(SplitMix(seed) % numel);
    StateDigest sum;
    for (auto it = cuts.begin(); std::next(it) != cuts.end(); ++it) {
      const uint64_t lo = *it, hi = *std::next(it);
      Result<StateDigest> part =
          ComputeStateDigest(std::span(tensor).subspan(lo * w, (hi - lo) * w), w, lo);
      ASSERT_TRUE(part.ok());
      sum += *part;
    }
    EXPECT_EQ(sum, *whole) << trial;
  }
  // A replicated shard counted twice is not the tensor's digest: which
  // replica contributes is the caller's rule.
  Result<StateDigest> half = ComputeStateDigest(std::span(tensor).first(2000 * w), w, 0);
  ASSERT_TRUE(half.ok());
  EXPECT_NE(*whole + *half, *whole);
}

TEST(StateDigest, BlockPartsOfShardsAddUpToTheBlock) {
  // A [12, 10] BF16 weight; a receiver holds columns [3, 7): rows of 4,
  // stride 10. The trainer holds it in three flat shards.
  const uint32_t w = 2;
  const uint64_t rows = 12, cols = 10;
  const std::vector<uint8_t> tensor = RandomBytes(rows * cols * w, 9);
  const DigestBlock block{3, 4, rows, cols};
  ASSERT_TRUE(block.Validate().ok());
  StateDigest want;
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 3; c < 7; ++c) {
      const uint64_t i = r * cols + c;
      want += ElementDigest(i, Bits(&tensor[i * w], w), w);
    }
  }
  Result<StateDigest> whole = ComputeBlockPartDigest(tensor, w, 0, block);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(*whole, want);
  StateDigest sum;
  const uint64_t cuts[] = {0, 35, 36, 118, rows * cols};
  for (size_t k = 0; k + 1 < std::size(cuts); ++k) {
    Result<StateDigest> part = ComputeBlockPartDigest(
        std::span(tensor).subspan(cuts[k] * w, (cuts[k + 1] - cuts[k]) * w), w, cuts[k], block);
    ASSERT_TRUE(part.ok());
    sum += *part;
  }
  EXPECT_EQ(sum, want);
}

TEST(StateDigest, UpdateEqualsRecompute) {
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    const uint64_t numel = 3001, first = 1 << 20;  // a shard starting past 0
    std::vector<uint8_t> old_bytes = RandomBytes(numel * w, w);
    std::vector<uint8_t> new_bytes = old_bytes;
    std::vector<uint32_t> offsets;
    std::vector<uint8_t> old_values, new_values;
    uint64_t seed = 100 + w;
    for (uint64_t i = SplitMix(seed) % 5; i < numel; i += 1 + SplitMix(seed) % 40) {
      offsets.push_back(static_cast<uint32_t>(i));
      old_values.insert(old_values.end(), &old_bytes[i * w], &old_bytes[i * w] + w);
      new_bytes[i * w] ^= static_cast<uint8_t>(1 + SplitMix(seed) % 255);
      new_values.insert(new_values.end(), &new_bytes[i * w], &new_bytes[i * w] + w);
    }
    Result<StateDigest> before = ComputeStateDigest(old_bytes, w, first);
    Result<StateDigest> after = ComputeStateDigest(new_bytes, w, first);
    ASSERT_TRUE(before.ok() && after.ok());
    ASSERT_NE(*before, *after);
    StateDigest d = *before;
    Positions positions{offsets, {}, first};
    ASSERT_TRUE(UpdateStateDigest(&d, positions, old_values, new_values, w).ok());
    EXPECT_EQ(d, *after) << w;
    // And back.
    ASSERT_TRUE(UpdateStateDigest(&d, positions, new_values, old_values, w).ok());
    EXPECT_EQ(d, *before) << w;
  }
}

TEST(StateDigest, UpdateTakesAChangeSet) {
  ChangeSet changes;
  changes.numel = 100;
  changes.elem_size = 4;
  changes.pos32 = {3, 50};
  changes.old_values = {1, 0, 0, 0, 2, 0, 0, 0};
  changes.new_values = {9, 0, 0, 0, 8, 0, 0, 0};
  StateDigest d;
  ASSERT_TRUE(
      UpdateStateDigest(&d, Positions::Of(changes, 1000), changes.old_values, changes.new_values, 4)
          .ok());
  const StateDigest want = ElementDigest(1003, 9, 4) - ElementDigest(1003, 1, 4) +
                           ElementDigest(1050, 8, 4) - ElementDigest(1050, 2, 4);
  EXPECT_EQ(d, want);
}

// For a fixed position, bits -> hash is a bijection in each lane, so one
// changed element always changes both lanes.
TEST(StateDigest, OneChangedElementChangesBothLanes) {
  std::vector<uint64_t> a, b;
  for (uint64_t v = 0; v < 65536; ++v) {
    const StateDigest d = ElementDigest(12345, v, 2);
    a.push_back(d.a);
    b.push_back(d.b);
  }
  for (std::vector<uint64_t>* lane : {&a, &b}) {
    std::sort(lane->begin(), lane->end());
    EXPECT_EQ(std::adjacent_find(lane->begin(), lane->end()), lane->end());
  }
}

TEST(StateDigest, PositionsMatter) {
  // Two elements swapped, and the same bytes at other positions or widths.
  std::vector<uint8_t> x = {1, 2, 3, 4}, swapped = {3, 4, 1, 2};
  EXPECT_NE(*ComputeStateDigest(x, 2, 0), *ComputeStateDigest(swapped, 2, 0));
  EXPECT_NE(*ComputeStateDigest(x, 2, 0), *ComputeStateDigest(x, 2, 1));
  EXPECT_NE(*ComputeStateDigest(x, 2, 0), *ComputeStateDigest(x, 1, 0));
  EXPECT_NE(*ComputeStateDigest(x, 4, 0), *ComputeStateDigest(x, 2, 0));
}

TEST(StateDigest, StridedMatchesBruteForce) {
  const std::vector<uint8_t> data = RandomBytes(7 * 40 * 4, 13);
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    for (uint64_t stride : {1u, 2u, 7u}) {
      const uint64_t count = data.size() / w / stride;
      std::vector<uint8_t> packed;
      for (uint64_t k = 0; k < count; ++k) {
        packed.insert(packed.end(), &data[k * stride * w], &data[k * stride * w] + w);
      }
      Result<StateDigest> got = ComputeStridedStateDigest(data, w, 77, count, stride);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(*got, BruteForce(packed, w, 77)) << w << " " << stride;
    }
  }
}

void ExpectInvalid(const Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(text), std::string::npos) << s.message() << "\n  wanted: " << text;
}

TEST(StateDigest, RefusesBadArguments) {
  std::vector<uint8_t> bytes(12);
  ExpectInvalid(ComputeStateDigest(bytes, 3, 0).status(), "element size 3 is not 1, 2, 4 or 8");
  ExpectInvalid(ComputeStateDigest(std::span(bytes).first(6), 4, 0).status(),
                "6 bytes are not whole elements of 4");
  ExpectInvalid(ComputeStateDigest(bytes, 4, kMaxStreamNumel - 2).status(), "reach past 2^56");
  EXPECT_TRUE(ComputeStateDigest(bytes, 4, kMaxStreamNumel - 3).ok());
  ExpectInvalid(ComputeStridedStateDigest(bytes, 4, 0, 2, 0).status(), "stride 0");
  ExpectInvalid(ComputeStridedStateDigest(bytes, 4, 0, 3, 2).status(),
                "3 elements of stride 2 do not fit 12 bytes");
  EXPECT_TRUE(ComputeStridedStateDigest(bytes, 4, 0, 2, 2).ok());
  if (AvailableDigestKernels().size() < 3) {
    DigestOptions options;
    options.kernel = DigestKernel::kAvx512;
    ExpectInvalid(ComputeStateDigest(bytes, 4, 0, options).status(), "cannot run the avx512");
  }

  StateDigest d{1, 2};
  const std::vector<uint32_t> two = {5, 5};
  std::vector<uint8_t> values(4);
  ExpectInvalid(UpdateStateDigest(&d, Positions{two, {}, 0}, values, values, 2),
                "not strictly increasing at 1 (5 after 5)");
  ExpectInvalid(UpdateStateDigest(&d, Positions{two, {}, 0}, values, std::span(values).first(2), 2),
                "2 positions but 4 old and 2 new value bytes");
  const std::vector<uint64_t> far = {kMaxStreamNumel};
  ExpectInvalid(UpdateStateDigest(&d, Positions::Absolute(far), std::span(values).first(2),
                                  std::span(values).first(2), 2),
                "is not below");
  const std::vector<uint64_t> wide = {1};
  ExpectInvalid(UpdateStateDigest(&d, Positions{std::span(two).first(1), wide, 0},
                                  std::span(values).first(2), std::span(values).first(2), 2),
                "both 32-bit and 64-bit");
  EXPECT_EQ(d, (StateDigest{1, 2}));  // untouched by every refusal
}

TEST(StateDigest, BlockRules) {
  EXPECT_TRUE(DigestBlock::Range(5, 10).Validate().ok());
  EXPECT_TRUE((DigestBlock{}).Validate().ok());
  EXPECT_TRUE((DigestBlock{3, 4, 12, 10}).Validate().ok());
  ExpectInvalid((DigestBlock{0, 4, 0, 10}).Validate(), "no rows");
  ExpectInvalid((DigestBlock{0, 4, 1, 10}).Validate(), "a single row must have row stride 0");
  ExpectInvalid((DigestBlock{7, 0, 1, 0}).Validate(), "an empty block must start at 0");
  ExpectInvalid((DigestBlock{0, 0, 2, 10}).Validate(), "several rows of no elements");
  ExpectInvalid((DigestBlock{0, 4, 2, 3}).Validate(), "rows overlap");
  ExpectInvalid((DigestBlock{0, 4, 2, 4}).Validate(), "rows touch");
  ExpectInvalid((DigestBlock{0, 4, uint64_t{1} << 40, uint64_t{1} << 20}).Validate(),
                "reaches past 2^56");
  ExpectInvalid(DigestBlock::Range(kMaxStreamNumel - 1, 2).Validate(), "reach past 2^56");
  EXPECT_EQ((DigestBlock{3, 4, 12, 10}).end(), 11u * 10 + 3 + 4);
  EXPECT_EQ((DigestBlock{3, 4, 12, 10}).ToString(), "[3, +4) x 12 step 10");
}

}  // namespace
}  // namespace deltasync::stream
