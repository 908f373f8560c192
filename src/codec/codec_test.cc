// Round trips of every encoding over element sizes, densities and awkward
// sizes, plus the API's names, capabilities and argument checks.
#include "deltasync/codec.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "codec/codec_test_util.h"

namespace deltasync {
namespace {

using codec_test::DiffPair;
using codec_test::MakePair;
using codec_test::MakePairAt;
using codec_test::TensorPair;

constexpr uint8_t kGuard = 0xC3;
constexpr size_t kGuardBytes = 32;

// Applies `encoded` to a copy of `base` that sits between guard bytes, and
// checks both the result and that nothing outside the tensor was written.
::testing::AssertionResult AppliesTo(Encoding encoding, const std::vector<uint8_t>& encoded,
                                     const std::vector<uint8_t>& base,
                                     const std::vector<uint8_t>& expected, uint32_t elem_size,
                                     const DecodeOptions& options = {}) {
  std::vector<uint8_t> buffer(base.size() + 2 * kGuardBytes, kGuard);
  std::copy(base.begin(), base.end(), buffer.begin() + kGuardBytes);
  std::span<uint8_t> target(buffer.data() + kGuardBytes, base.size());
  Status status = DecodeApply(encoding, encoded, target, elem_size, options);
  if (!status.ok()) return ::testing::AssertionFailure() << status.ToString();
  ::testing::AssertionResult changes = codec_test::ChangesMatchApply(
      encoding, encoded, base, elem_size, options, status, {target.begin(), target.end()});
  if (!changes) return changes;
  for (size_t i = 0; i < kGuardBytes; ++i) {
    if (buffer[i] != kGuard || buffer[buffer.size() - 1 - i] != kGuard) {
      return ::testing::AssertionFailure() << "wrote outside the target";
    }
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (target[i] != expected[i]) {
      return ::testing::AssertionFailure()
             << "byte " << i << " is " << int{target[i]} << ", expected " << int{expected[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<uint8_t> EncodeOrDie(Encoding encoding, const TensorPair& pair,
                                 const ChangeSet& changes, const EncodeOptions& options = {}) {
  std::vector<uint8_t> encoded;
  Status status = Encode(encoding, pair.new_bytes, changes, options, &encoded);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return encoded;
}

TEST(EncodingNames, RoundTripAndRejectUnknown) {
  const char* names[] = {"dense", "indices", "xor", "overwrite", "sparse"};
  ASSERT_EQ(AllEncodings().size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(EncodingName(AllEncodings()[i]), names[i]);
    Result<Encoding> parsed = ParseEncoding(names[i]);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, AllEncodings()[i]);
    EXPECT_EQ(GetCodec(AllEncodings()[i]).encoding(), AllEncodings()[i]);
    EXPECT_EQ(GetCodec(AllEncodings()[i]).name(), names[i]);
  }
  for (const char* bad : {"XOR", "", "zstd", "sparse "}) {
    Result<Encoding> parsed = ParseEncoding(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_TRUE(parsed.status().IsInvalidArgument());
    EXPECT_NE(parsed.status().message().find("overwrite"), std::string::npos);
  }
}

TEST(EncodingNames, OutOfRangeValuesFailCleanly) {
  const Encoding bogus = static_cast<Encoding>(17);
  EXPECT_EQ(EncodingName(bogus), "unknown");
  std::vector<uint8_t> out;
  std::vector<uint8_t> target(4);
  EXPECT_TRUE(Encode(bogus, target, ChangeSet{}, {}, &out).IsInvalidArgument());
  EXPECT_TRUE(DecodeApply(bogus, target, target, 1).IsInvalidArgument());
  EXPECT_TRUE(out.empty());
}

TEST(Capabilities, MatchTheFormats) {
  EXPECT_FALSE(GetCodec(Encoding::kDense).needs_base());
  EXPECT_FALSE(GetCodec(Encoding::kDense).needs_old_values());
  EXPECT_TRUE(GetCodec(Encoding::kIndices).idempotent());
  EXPECT_FALSE(GetCodec(Encoding::kIndices).needs_old_values());
  EXPECT_FALSE(GetCodec(Encoding::kXor).idempotent());
  EXPECT_TRUE(GetCodec(Encoding::kOverwrite).idempotent());
  EXPECT_FALSE(GetCodec(Encoding::kSparse).idempotent());
  for (Encoding e : {Encoding::kIndices, Encoding::kXor, Encoding::kOverwrite, Encoding::kSparse}) {
    EXPECT_TRUE(GetCodec(e).needs_base()) << EncodingName(e);
  }
}

// Idempotent encodings converge when applied twice; xor-based ones revert.
TEST(Capabilities, ApplyingTwiceBehavesAsAdvertised) {
  TensorPair pair = MakePair(3001, 2, 0.05, 7);
  ChangeSet changes = DiffPair(pair);
  for (Encoding e : AllEncodings()) {
    std::vector<uint8_t> encoded = EncodeOrDie(e, pair, changes);
    std::vector<uint8_t> target = pair.old_bytes;
    ASSERT_TRUE(DecodeApply(e, encoded, target, 2).ok());
    ASSERT_TRUE(DecodeApply(e, encoded, target, 2).ok());
    EXPECT_EQ(target == pair.new_bytes, GetCodec(e).idempotent()) << EncodingName(e);
    if (!GetCodec(e).idempotent()) {
      EXPECT_EQ(target, pair.old_bytes) << EncodingName(e);
    }
  }
}

enum class Density { kNone, kOne, kOnePercent, kHalf, kAll };

const char* DensityName(Density d) {
  switch (d) {
    case Density::kNone: return "none";
    case Density::kOne: return "one";
    case Density::kOnePercent: return "onepct";
    case Density::kHalf: return "half";
    case Density::kAll: return "all";
  }
  return "?";
}

TensorPair MakeCase(size_t numel, uint32_t elem_size, Density density, uint64_t seed) {
  switch (density) {
    case Density::kNone: return MakePairAt(numel, elem_size, {}, seed);
    case Density::kOne: return MakePairAt(numel, elem_size, {numel / 3}, seed);
    case Density::kOnePercent: return MakePair(numel, elem_size, 0.01, seed);
    case Density::kHalf: return MakePair(numel, elem_size, 0.5, seed);
    case Density::kAll: return MakePair(numel, elem_size, 1.0, seed);
  }
  return {};
}

using RoundTripParam = std::tuple<Encoding, uint32_t, Density>;

class RoundTrip : public ::testing::TestWithParam<RoundTripParam> {};

// Sizes straddle every boundary the formats have: a single element, odd byte
// counts, one past the 64 Ki-entry sparse block and one past a small decode
// chunk.
TEST_P(RoundTrip, RestoresNewBytesExactly) {
  const auto [encoding, elem_size, density] = GetParam();
  for (size_t numel : {size_t{1}, size_t{7}, size_t{1023}, size_t{65537}, size_t{70001}}) {
    SCOPED_TRACE("numel " + std::to_string(numel));
    if (density == Density::kOnePercent && numel < 100) continue;
    TensorPair pair = MakeCase(numel, elem_size, density, numel * 31 + elem_size);
    ChangeSet changes = DiffPair(pair);
    const uint64_t expected_count = density == Density::kNone  ? 0
                                    : density == Density::kOne ? 1
                                    : density == Density::kAll ? numel
                                                               : changes.count();
    ASSERT_EQ(changes.count(), expected_count);

    std::vector<SparseMode> modes = {SparseMode::kAuto};
    if (encoding == Encoding::kSparse) {
      modes.push_back(SparseMode::kPositions);
      modes.push_back(SparseMode::kXorPlanes);
    }
    for (SparseMode mode : modes) {
      SCOPED_TRACE("sparse mode " + std::to_string(static_cast<int>(mode)));
      EncodeOptions options;
      options.sparse_mode = mode;
      std::vector<uint8_t> encoded = EncodeOrDie(encoding, pair, changes, options);
      EXPECT_TRUE(AppliesTo(encoding, encoded, pair.old_bytes, pair.new_bytes, elem_size));
      // A decode chunk that does not divide the tensor, and smaller than an
      // overwrite payload, so the streaming paths see partial chunks.
      DecodeOptions small;
      small.chunk_bytes = 4099;
      EXPECT_TRUE(AppliesTo(encoding, encoded, pair.old_bytes, pair.new_bytes, elem_size, small));
      // Encoding with a small staging chunk must give an equivalent encoding.
      EncodeOptions small_chunks = options;
      small_chunks.chunk_bytes = 1000;
      std::vector<uint8_t> encoded_small = EncodeOrDie(encoding, pair, changes, small_chunks);
      EXPECT_TRUE(
          AppliesTo(encoding, encoded_small, pair.old_bytes, pair.new_bytes, elem_size, small));
      // Encoding from ranges gives the same bytes, however the tensor is cut.
      std::vector<uint8_t> probe;
      if (GetCodec(encoding).NewEncodeStream(numel, elem_size, options, &probe)) {
        for (size_t range : {size_t{1}, size_t{7}, size_t{4096}, numel}) {
          SCOPED_TRACE("ranges of " + std::to_string(range));
          EXPECT_EQ(codec_test::EncodeByRanges(encoding, pair, options, range), encoded);
          EXPECT_EQ(codec_test::EncodeByRanges(encoding, pair, small_chunks, range), encoded_small);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllEncodings, RoundTrip,
    ::testing::Combine(::testing::Values(Encoding::kDense, Encoding::kIndices, Encoding::kXor,
                                         Encoding::kOverwrite, Encoding::kSparse),
                       ::testing::Values(1u, 2u, 4u, 8u),
                       ::testing::Values(Density::kNone, Density::kOne, Density::kOnePercent,
                                         Density::kHalf, Density::kAll)),
    [](const ::testing::TestParamInfo<RoundTripParam>& info) {
      return std::string(EncodingName(std::get<0>(info.param))) + "_es" +
             std::to_string(std::get<1>(info.param)) + "_" + DensityName(std::get<2>(info.param));
    });

// A stream refuses ranges that skip, overlap or overrun the tensor, a
// finish before the whole tensor was seen, and a bad element size.
TEST(EncodeStream, RejectsBadRanges) {
  for (Encoding e : {Encoding::kXor, Encoding::kSparse}) {
    SCOPED_TRACE(std::string(EncodingName(e)));
    TensorPair pair = MakeCase(100, 2, Density::kHalf, 7);
    std::vector<uint8_t> old_range(pair.old_bytes.begin(), pair.old_bytes.begin() + 100);
    std::span<const uint8_t> new_range(pair.new_bytes.data(), 100);
    DiffOptions diff;
    diff.elem_size = 2;
    diff.refresh_snapshot = false;
    ChangeSet piece;  // elements [0, 50)
    ASSERT_TRUE(DiffTensor(new_range, old_range, diff, &piece).ok());
    ASSERT_GT(piece.count(), 0u);
    std::vector<uint8_t> out;
    {
      auto stream = GetCodec(e).NewEncodeStream(100, 2, {}, &out);
      ASSERT_NE(stream, nullptr);
      EXPECT_EQ(stream->Add(1, new_range, piece).code(), StatusCode::kInvalidArgument);
      ASSERT_TRUE(stream->Add(0, new_range, piece).ok());
      EXPECT_EQ(stream->Add(0, new_range, piece).code(), StatusCode::kInvalidArgument);
      Status early = stream->Finish();
      EXPECT_EQ(early.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(early.message().find("50 of 100"), std::string::npos) << early.ToString();
    }
    {
      auto stream = GetCodec(e).NewEncodeStream(60, 2, {}, &out);
      ASSERT_TRUE(stream->Add(0, new_range, piece).ok());
      EXPECT_EQ(stream->Add(50, new_range, piece).code(), StatusCode::kInvalidArgument);
    }
    {
      ChangeSet no_old = piece;
      no_old.old_values.clear();
      auto stream = GetCodec(e).NewEncodeStream(100, 2, {}, &out);
      EXPECT_EQ(stream->Add(0, new_range, no_old).code(), StatusCode::kInvalidArgument);
    }
    {
      auto stream = GetCodec(e).NewEncodeStream(100, 3, {}, &out);
      EXPECT_EQ(stream->Finish().code(), StatusCode::kInvalidArgument);
    }
  }
  for (Encoding e : {Encoding::kDense, Encoding::kIndices, Encoding::kOverwrite}) {
    std::vector<uint8_t> out;
    EXPECT_EQ(GetCodec(e).NewEncodeStream(100, 2, {}, &out), nullptr);
  }
}

// Streams are independent objects: two of them fed in turn on one thread
// give what each gives alone.
TEST(EncodeStream, InterleavedStreamsOnOneThreadStayApart) {
  for (Encoding e : {Encoding::kXor, Encoding::kSparse}) {
    SCOPED_TRACE(std::string(EncodingName(e)));
    const size_t numel = 70001;
    TensorPair a = MakeCase(numel, 2, Density::kOnePercent, 1);
    TensorPair b = MakeCase(numel, 2, Density::kOnePercent, 2);
    const std::vector<uint8_t> expected_a = EncodeOrDie(e, a, DiffPair(a));
    const std::vector<uint8_t> expected_b = EncodeOrDie(e, b, DiffPair(b));
    std::vector<uint8_t> out_a, out_b;
    auto stream_a = GetCodec(e).NewEncodeStream(numel, 2, {}, &out_a);
    auto stream_b = GetCodec(e).NewEncodeStream(numel, 2, {}, &out_b);
    DiffOptions diff;
    diff.elem_size = 2;
    diff.refresh_snapshot = false;
    const size_t range = 4099;
    for (size_t first = 0; first < numel; first += range) {
      const size_t n = std::min(range, numel - first);
      for (auto [pair, stream] : {std::pair{&a, stream_a.get()}, std::pair{&b, stream_b.get()}}) {
        std::span<const uint8_t> new_range(pair->new_bytes.data() + first * 2, n * 2);
        std::vector<uint8_t> old_range(pair->old_bytes.begin() + first * 2,
                                       pair->old_bytes.begin() + (first + n) * 2);
        ChangeSet piece;
        ASSERT_TRUE(DiffTensor(new_range, old_range, diff, &piece).ok());
        ASSERT_TRUE(stream->Add(first, new_range, piece).ok());
      }
    }
    ASSERT_TRUE(stream_a->Finish().ok());
    ASSERT_TRUE(stream_b->Finish().ok());
    EXPECT_EQ(out_a, expected_a);
    EXPECT_EQ(out_b, expected_b);
  }
}

TEST(RoundTrip, EmptyTensor) {
  TensorPair pair;
  pair.elem_size = 4;
  ChangeSet changes;
  changes.elem_size = 4;
  for (Encoding e : AllEncodings()) {
    std::vector<uint8_t> encoded = EncodeOrDie(e, pair, changes);
    std::vector<uint8_t> target;
    EXPECT_TRUE(DecodeApply(e, encoded, target, 4).ok()) << EncodingName(e);
  }
}

TEST(RoundTrip, FirstAndLastElement) {
  for (uint32_t es : {1u, 2u, 4u, 8u}) {
    TensorPair pair = MakePairAt(100, es, {0, 99}, es);
    ChangeSet changes = DiffPair(pair);
    for (Encoding e : AllEncodings()) {
      EXPECT_TRUE(AppliesTo(e, EncodeOrDie(e, pair, changes), pair.old_bytes, pair.new_bytes, es))
          << EncodingName(e) << " es " << es;
    }
  }
}

// Gaps of 255 and more take the escape path of the sparse gap code.
TEST(RoundTrip, LongGaps) {
  TensorPair pair = MakePairAt(1 << 20, 2, {254, 509, 765, 20000, 1000000, (1 << 20) - 1}, 3);
  ChangeSet changes = DiffPair(pair);
  for (Encoding e : AllEncodings()) {
    EXPECT_TRUE(AppliesTo(e, EncodeOrDie(e, pair, changes), pair.old_bytes, pair.new_bytes, 2))
        << EncodingName(e);
  }
}

// A ChangeSet with 64-bit positions (as the diff produces for numel >= 2^32)
// must encode to something that decodes the same.
TEST(RoundTrip, WidePositions) {
  TensorPair pair = MakePair(5000, 4, 0.03, 11);
  ChangeSet narrow = DiffPair(pair);
  ChangeSet wide = narrow;
  wide.wide = true;
  wide.pos64.assign(narrow.pos32.begin(), narrow.pos32.end());
  wide.pos32.clear();
  for (Encoding e : AllEncodings()) {
    EXPECT_EQ(EncodeOrDie(e, pair, wide), EncodeOrDie(e, pair, narrow)) << EncodingName(e);
  }
}

TEST(Encode, AppendsAfterExistingBytes) {
  TensorPair pair = MakePair(999, 2, 0.02, 5);
  ChangeSet changes = DiffPair(pair);
  for (Encoding e : AllEncodings()) {
    std::vector<uint8_t> alone = EncodeOrDie(e, pair, changes);
    std::vector<uint8_t> packed = {1, 2, 3};
    ASSERT_TRUE(Encode(e, pair.new_bytes, changes, {}, &packed).ok());
    ASSERT_EQ(packed.size(), alone.size() + 3) << EncodingName(e);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), packed.begin() + 3)) << EncodingName(e);
  }
}

TEST(Encode, RejectsInconsistentChangeSets) {
  TensorPair pair = MakePair(100, 2, 0.1, 9);
  const ChangeSet good = DiffPair(pair);
  ASSERT_GE(good.count(), 2u);
  auto expect_invalid = [&](const ChangeSet& changes, std::span<const uint8_t> bytes, Encoding e,
                            const std::string& needle) {
    std::vector<uint8_t> out;
    Status status = Encode(e, bytes, changes, {}, &out);
    EXPECT_TRUE(status.IsInvalidArgument()) << EncodingName(e) << ": " << status.ToString();
    EXPECT_NE(status.message().find(needle), std::string::npos) << status.message();
  };
  for (Encoding e : {Encoding::kIndices, Encoding::kXor, Encoding::kOverwrite, Encoding::kSparse}) {
    ChangeSet bad = good;
    bad.elem_size = 3;
    expect_invalid(bad, pair.new_bytes, e, "element size");
    expect_invalid(good, std::span(pair.new_bytes).first(198), e, "tensor has 198 bytes");
    bad = good;
    bad.new_values.pop_back();
    expect_invalid(bad, pair.new_bytes, e, "new_values");
    bad = good;
    std::swap(bad.pos32[0], bad.pos32[1]);
    expect_invalid(bad, pair.new_bytes, e, "out of order");
    bad = good;
    bad.pos32.back() = 100;
    expect_invalid(bad, pair.new_bytes, e, "not below numel");
    bad = good;
    bad.pos64.push_back(1);
    expect_invalid(bad, pair.new_bytes, e, "both");
  }
  for (Encoding e : {Encoding::kXor, Encoding::kOverwrite, Encoding::kSparse}) {
    ChangeSet bad = good;
    bad.old_values.clear();
    expect_invalid(bad, pair.new_bytes, e, "keep_old_values");
  }
  // Encoders that do not need old values do not ask for them.
  ChangeSet no_old = good;
  no_old.old_values.clear();
  std::vector<uint8_t> out;
  EXPECT_TRUE(Encode(Encoding::kIndices, pair.new_bytes, no_old, {}, &out).ok());
}

TEST(DecodeApply, RejectsBadTargets) {
  TensorPair pair = MakePair(100, 4, 0.1, 9);
  ChangeSet changes = DiffPair(pair);
  for (Encoding e : AllEncodings()) {
    std::vector<uint8_t> encoded = EncodeOrDie(e, pair, changes);
    std::vector<uint8_t> target = pair.old_bytes;
    Status bad_size = DecodeApply(e, encoded, target, 3);
    EXPECT_TRUE(bad_size.IsInvalidArgument()) << bad_size.ToString();
    target.pop_back();
    Status ragged = DecodeApply(e, encoded, target, 4);
    EXPECT_TRUE(ragged.IsInvalidArgument()) << ragged.ToString();
    EXPECT_NE(ragged.message().find("whole number"), std::string::npos) << ragged.message();
    // The right byte count but a wrong element size is a mismatch with what
    // the encoder recorded (dense, xor and overwrite are byte-level and
    // cannot tell).
    std::vector<uint8_t> same_bytes = pair.old_bytes;
    Status wrong_es = DecodeApply(e, encoded, same_bytes, 2);
    if (e == Encoding::kIndices || e == Encoding::kSparse) {
      EXPECT_TRUE(wrong_es.IsCorruption()) << wrong_es.ToString();
      EXPECT_NE(wrong_es.message().find("element size"), std::string::npos);
    }
    // A tensor of a different size. vime's overwrite format records no size,
    // so only its positions are checked (they still fit here).
    std::vector<uint8_t> bigger(pair.old_bytes.size() + 4);
    Status wrong_size = DecodeApply(e, encoded, bigger, 4);
    EXPECT_EQ(wrong_size.IsCorruption(), e != Encoding::kOverwrite)
        << EncodingName(e) << ": " << wrong_size.ToString();
  }
}

}  // namespace
}  // namespace deltasync
