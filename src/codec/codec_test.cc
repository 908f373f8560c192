// Round trips of every encoding over element sizes, densities and awkward
// sizes, plus the API's names, capabilities and argument checks.
#include "deltasync/codec.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include "codec/codec_test_util.h"
#include "core/fp8_test_util.h"

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

// The names and values are stored in files: pinned here, not read back
// from the registry.
TEST(EncodingNames, RoundTripAndRejectUnknown) {
  const char* names[] = {"dense", "indices", "xor", "overwrite", "sparse"};
  ASSERT_EQ(AllEncodings().size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(static_cast<size_t>(AllEncodings()[i]), i);
    EXPECT_EQ(EncodingName(AllEncodings()[i]), names[i]);
    Result<Encoding> parsed = ParseEncoding(names[i]);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, AllEncodings()[i]);
    EXPECT_EQ(GetCodec(AllEncodings()[i]).encoding(), AllEncodings()[i]);
    EXPECT_EQ(GetCodec(AllEncodings()[i]).name(), names[i]);
    EXPECT_EQ(&GetEncodingInfo(AllEncodings()[i]), &GetCodec(AllEncodings()[i]).info());
  }
  for (const char* bad : {"XOR", "", "zstd", "sparse "}) {
    Result<Encoding> parsed = ParseEncoding(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_TRUE(parsed.status().IsInvalidArgument());
    EXPECT_NE(parsed.status().message().find("overwrite"), std::string::npos);
  }
  EXPECT_EQ(ParseEncoding("gzip").status().message(),
            "unknown delta encoding 'gzip' (expected dense, indices, xor, overwrite or sparse)");
  EXPECT_EQ(JoinEncodingNames(", "), "dense, indices, xor, overwrite, sparse");
  EXPECT_EQ(JoinEncodingNames(",", " or "), "dense,indices,xor,overwrite or sparse");
}

// The build makes per-encoding targets (fuzz/) from the Encoding enum's
// enumerators (src/codec/CMakeLists.txt); an encoding whose name breaks
// codec.h's naming rule, or a parse that misses one, shows up here.
TEST(EncodingNames, TheBuildListsEveryEncoding) {
  EXPECT_EQ(std::string(DS_BUILD_ENCODINGS), JoinEncodingNames(","));
}

TEST(EncodingNames, OutOfRangeValuesFailCleanly) {
  const Encoding bogus = static_cast<Encoding>(17);
  EXPECT_EQ(EncodingName(bogus), "unknown");
  EXPECT_EQ(GetEncodingInfo(bogus).compression, "");
  EXPECT_EQ(GetEncodingInfo(bogus).max_tensor_bytes, 0u);
  std::vector<uint8_t> out;
  std::vector<uint8_t> target(4);
  EXPECT_TRUE(Encode(bogus, target, ChangeSet{}, {}, &out).IsInvalidArgument());
  EXPECT_TRUE(DecodeApply(bogus, target, target, 1).IsInvalidArgument());
  EXPECT_TRUE(out.empty());
}

// Every descriptor against docs/format.md ("Delta encodings"): the table of
// what each encoding carries, the index's compression_format, the Python
// receiver's encodings, the content checksum default and overwrite's u32
// byte positions.
TEST(Capabilities, MatchTheFormats) {
  struct Row {
    Encoding encoding;
    const char* compression;
    bool needs_old_values, needs_base, idempotent, streams, carries_values, python, checksum;
    uint64_t max_tensor_bytes;
  };
  const Row rows[] = {
      {Encoding::kDense, "none", false, false, true, false, true, false, false, UINT64_MAX},
      {Encoding::kIndices, "none", false, true, true, false, true, false, false, UINT64_MAX},
      {Encoding::kXor, "zstd", true, true, false, true, false, true, false, UINT64_MAX},
      {Encoding::kOverwrite, "zstd", true, true, true, false, false, true, true, uint64_t{1} << 32},
      {Encoding::kSparse, "zstd", true, true, false, true, false, false, true, UINT64_MAX},
  };
  ASSERT_EQ(std::size(rows), AllEncodings().size());
  for (const Row& row : rows) {
    const EncodingInfo& info = GetEncodingInfo(row.encoding);
    SCOPED_TRACE(std::string(info.name));
    EXPECT_EQ(info.encoding, row.encoding);
    EXPECT_EQ(info.compression, row.compression);
    EXPECT_EQ(info.needs_old_values, row.needs_old_values);
    EXPECT_EQ(info.needs_base, row.needs_base);
    EXPECT_EQ(info.idempotent, row.idempotent);
    EXPECT_EQ(info.streams, row.streams);
    EXPECT_EQ(info.carries_values, row.carries_values);
    EXPECT_EQ(info.read_by_python_receiver, row.python);
    EXPECT_EQ(info.zstd_checksum_by_default, row.checksum);
    EXPECT_EQ(info.max_tensor_bytes, row.max_tensor_bytes);
    const Codec& codec = GetCodec(row.encoding);
    EXPECT_EQ(codec.needs_old_values(), row.needs_old_values);
    EXPECT_EQ(codec.needs_base(), row.needs_base);
    EXPECT_EQ(codec.idempotent(), row.idempotent);
  }
}

// Each descriptor's claims, checked against what its codec does.
TEST(Capabilities, DescriptorsTellWhatTheCodecsDo) {
  TensorPair pair = MakePair(3001, 2, 0.05, 8);
  ChangeSet changes = DiffPair(pair);
  ASSERT_GT(changes.count(), 0u);
  ChangeSet no_old = changes;
  no_old.old_values.clear();
  // The base with every changed element's bytes inverted: what a target
  // holds there does not matter to an encoding that carries values.
  std::vector<uint8_t> scrambled = pair.old_bytes;
  for (uint64_t i = 0; i < changes.count(); ++i) {
    for (uint32_t b = 0; b < 2; ++b) scrambled[changes.position(i) * 2 + b] ^= 0xFF;
  }
  for (Encoding e : AllEncodings()) {
    const EncodingInfo& info = GetEncodingInfo(e);
    SCOPED_TRACE(std::string(info.name));
    std::vector<uint8_t> out;
    EXPECT_EQ(GetCodec(e).NewEncodeStream(3001, 2, {}, &out) != nullptr, info.streams);
    out.clear();
    Status without_old = Encode(e, pair.new_bytes, no_old, {}, &out);
    EXPECT_EQ(without_old.IsInvalidArgument(), info.needs_old_values) << without_old.ToString();
    EXPECT_EQ(without_old.ok(), !info.needs_old_values);

    const std::vector<uint8_t> encoded = EncodeOrDie(e, pair, changes);
    std::vector<uint8_t> garbage(pair.old_bytes.size(), 0x5A);
    ASSERT_TRUE(DecodeApply(e, encoded, garbage, 2).ok());
    EXPECT_EQ(garbage == pair.new_bytes, !info.needs_base);
    std::vector<uint8_t> target = scrambled;
    ASSERT_TRUE(DecodeApply(e, encoded, target, 2).ok());
    EXPECT_EQ(target == pair.new_bytes, info.carries_values);

    // A zstd frame (RFC 8878 magic) in the first bytes exactly when the
    // index is to say "zstd".
    const uint8_t magic[4] = {0x28, 0xB5, 0x2F, 0xFD};
    const auto head = encoded.begin() + std::min<size_t>(encoded.size(), kSparseHeaderBytes + 4);
    const bool has_frame =
        std::search(encoded.begin(), head, std::begin(magic), std::end(magic)) != head;
    EXPECT_EQ(has_frame, info.compression == "zstd");
  }
}

// An encoder refuses a tensor beyond what its format addresses before it
// reads any of it, and takes one of exactly that size. The tensors are
// address space only (PROT_NONE): a read would fault.
TEST(Capabilities, EncodersRefuseTensorsBeyondTheirLimit) {
  for (Encoding e : AllEncodings()) {
    const EncodingInfo& info = GetEncodingInfo(e);
    if (info.max_tensor_bytes == UINT64_MAX) continue;
    SCOPED_TRACE(std::string(info.name));
    const size_t bytes = static_cast<size_t>(info.max_tensor_bytes) + 8;
    void* space =
        ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    ASSERT_NE(space, MAP_FAILED);
    const uint8_t* data = static_cast<const uint8_t*>(space);
    for (uint64_t size : {info.max_tensor_bytes, info.max_tensor_bytes + 8}) {
      ChangeSet nothing;  // nothing changed, so no value is read either
      nothing.elem_size = 8;
      nothing.numel = size / 8;
      std::vector<uint8_t> out;
      Status status = Encode(e, {data, size}, nothing, {}, &out);
      if (size <= info.max_tensor_bytes) {
        EXPECT_TRUE(status.ok()) << status.ToString();
      } else {
        EXPECT_EQ(status.code(), StatusCode::kUnsupported) << status.ToString();
        EXPECT_NE(status.message().find(std::to_string(size) + " bytes"), std::string::npos)
            << status.message();
      }
    }
    ::munmap(space, bytes);
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
    ::testing::Combine(::testing::ValuesIn(AllEncodings()), ::testing::Values(1u, 2u, 4u, 8u),
                       ::testing::Values(Density::kNone, Density::kOne, Density::kOnePercent,
                                         Density::kHalf, Density::kAll)),
    [](const ::testing::TestParamInfo<RoundTripParam>& info) {
      return std::string(EncodingName(std::get<0>(info.param))) + "_es" +
             std::to_string(std::get<1>(info.param)) + "_" + DensityName(std::get<2>(info.param));
    });

// A stream refuses ranges that skip, overlap or overrun the tensor, a
// finish before the whole tensor was seen, and a bad element size.
TEST(EncodeStream, RejectsBadRanges) {
  for (Encoding e : AllEncodings()) {
    if (!GetEncodingInfo(e).streams) continue;
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
}

// Streams are independent objects: two of them fed in turn on one thread
// give what each gives alone.
TEST(EncodeStream, InterleavedStreamsOnOneThreadStayApart) {
  for (Encoding e : AllEncodings()) {
    if (!GetEncodingInfo(e).streams) continue;
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

// Block-scaled FP8 (E4M3 weights, E8M0 block scales, an F32 per-tensor
// scale) as a trainer re-quantizes it step after step: every encoding, in
// every sparse mode and encoded whole or by ranges, brings each tensor to
// the next step's exact bytes.
TEST(RoundTrip, BlockScaledFp8Steps) {
  std::vector<std::vector<fp8_test::Tensor>> steps;
  for (int step = 0; step <= 2; ++step) steps.push_back(fp8_test::BlockScaledLayer("l", 5, step));
  for (int step = 1; step <= 2; ++step) {
    for (size_t i = 0; i < steps[step].size(); ++i) {
      const fp8_test::Tensor& t = steps[step][i];
      SCOPED_TRACE(t.name + " step " + std::to_string(step));
      TensorPair pair;
      pair.elem_size = static_cast<uint32_t>(DTypeSize(t.dtype));
      pair.old_bytes = steps[step - 1][i].bytes;
      pair.new_bytes = t.bytes;
      const ChangeSet changes = DiffPair(pair);
      ASSERT_GT(changes.count(), 0u);  // each tensor moves every step
      for (Encoding e : AllEncodings()) {
        SCOPED_TRACE(std::string(EncodingName(e)));
        for (SparseMode mode :
             {SparseMode::kAuto, SparseMode::kPositions, SparseMode::kXorPlanes}) {
          if (e != Encoding::kSparse && mode != SparseMode::kAuto) continue;
          EncodeOptions options;
          options.sparse_mode = mode;
          const std::vector<uint8_t> encoded = EncodeOrDie(e, pair, changes, options);
          EXPECT_TRUE(AppliesTo(e, encoded, pair.old_bytes, pair.new_bytes, pair.elem_size));
          std::vector<uint8_t> probe;
          if (GetCodec(e).NewEncodeStream(pair.numel(), pair.elem_size, options, &probe)) {
            EXPECT_EQ(codec_test::EncodeByRanges(e, pair, options, 4096), encoded);
          }
        }
      }
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
  // Every encoder but dense, which reads only the new bytes.
  for (Encoding e : AllEncodings()) {
    if (e == Encoding::kDense) continue;
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
  // Encoders that need old values name the option that keeps them; the
  // others do not ask for them.
  ChangeSet no_old = good;
  no_old.old_values.clear();
  for (Encoding e : AllEncodings()) {
    if (GetEncodingInfo(e).needs_old_values) {
      expect_invalid(no_old, pair.new_bytes, e, "keep_old_values");
    } else {
      std::vector<uint8_t> out;
      EXPECT_TRUE(Encode(e, pair.new_bytes, no_old, {}, &out).ok()) << EncodingName(e);
    }
  }
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
