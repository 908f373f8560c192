// Every decoder against truncated, bit-flipped and hand-built malformed
// input: each must fail with Corruption naming the problem (or, for a flip
// that leaves the content intact, apply it exactly), and never write outside
// the target.
#include <gtest/gtest.h>
#include <zstd.h>

#include <string>
#include <vector>

#include "codec/codec_internal.h"
#include "codec/codec_test_util.h"
#include "deltasync/codec.h"

namespace deltasync {
namespace {

using codec_test::DiffPair;
using codec_test::MakePair;
using codec_test::TensorPair;
using codec_test::XorImage;

constexpr uint8_t kGuard = 0x5A;
constexpr size_t kGuardBytes = 64;

struct Outcome {
  Status status;
  std::vector<uint8_t> target;
  bool guards_intact = true;
};

Outcome Apply(Encoding encoding, std::span<const uint8_t> encoded, const std::vector<uint8_t>& base,
              uint32_t es, size_t chunk_bytes = 1 << 20) {
  std::vector<uint8_t> buffer(base.size() + 2 * kGuardBytes, kGuard);
  std::copy(base.begin(), base.end(), buffer.begin() + kGuardBytes);
  DecodeOptions options;
  options.chunk_bytes = chunk_bytes;
  Outcome outcome;
  outcome.status =
      DecodeApply(encoding, encoded, {buffer.data() + kGuardBytes, base.size()}, es, options);
  for (size_t i = 0; i < kGuardBytes; ++i) {
    outcome.guards_intact &= buffer[i] == kGuard && buffer[buffer.size() - 1 - i] == kGuard;
  }
  outcome.target.assign(buffer.begin() + kGuardBytes, buffer.end() - kGuardBytes);
  EXPECT_TRUE(codec_test::ChangesMatchApply(encoding, encoded, base, es, options, outcome.status,
                                            outcome.target));
  return outcome;
}

// Expects Corruption whose message contains `needle`.
void ExpectCorruption(const Outcome& outcome, const std::string& needle) {
  EXPECT_TRUE(outcome.status.IsCorruption()) << outcome.status.ToString();
  EXPECT_NE(outcome.status.message().find(needle), std::string::npos)
      << "message: " << outcome.status.message() << "\nexpected to contain: " << needle;
  EXPECT_TRUE(outcome.guards_intact);
}

std::vector<uint8_t> Compress(std::span<const uint8_t> content) {
  std::vector<uint8_t> out(ZSTD_compressBound(content.size()));
  size_t n = ZSTD_compress(out.data(), out.size(), content.data(), content.size(), 1);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

std::vector<uint8_t> CompressUnsized(std::span<const uint8_t> content) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
  std::vector<uint8_t> out(ZSTD_compressBound(content.size()) + 64);
  ZSTD_inBuffer in{content.data(), content.size(), 0};
  ZSTD_outBuffer ob{out.data(), out.size(), 0};
  while (ZSTD_compressStream2(cctx, &ob, &in, ZSTD_e_end) != 0) {
  }
  ZSTD_freeCCtx(cctx);
  out.resize(ob.pos);
  return out;
}

void PutLE(std::vector<uint8_t>* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

struct Fixture {
  TensorPair pair = MakePair(3001, 2, 0.05, 77);
  ChangeSet changes = DiffPair(pair);
  // With zstd's content checksum always on (xor frames have none by
  // default): these tests are about what the decoders catch by themselves.
  std::vector<uint8_t> EncodeAs(Encoding e, SparseMode mode = SparseMode::kAuto) const {
    EncodeOptions options;
    options.sparse_mode = mode;
    options.zstd_checksum = true;
    std::vector<uint8_t> out;
    EXPECT_TRUE(Encode(e, pair.new_bytes, changes, options, &out).ok());
    return out;
  }
};

class EveryDecoder : public ::testing::TestWithParam<Encoding> {};

TEST_P(EveryDecoder, RejectsEveryTruncation) {
  Fixture f;
  const Encoding e = GetParam();
  std::vector<SparseMode> modes = {SparseMode::kAuto};
  if (e == Encoding::kSparse) modes.push_back(SparseMode::kXorPlanes);
  for (SparseMode mode : modes) {
    std::vector<uint8_t> encoded = f.EncodeAs(e, mode);
    for (size_t length = 0; length < encoded.size(); ++length) {
      for (size_t chunk : {size_t{1} << 20, size_t{512}}) {
        Outcome outcome = Apply(e, std::span(encoded).first(length), f.pair.old_bytes, 2, chunk);
        ASSERT_TRUE(outcome.status.IsCorruption())
            << "prefix of " << length << " bytes: " << outcome.status.ToString();
        ASSERT_TRUE(outcome.guards_intact);
      }
    }
    // And one byte too many.
    encoded.push_back(0);
    Outcome outcome = Apply(e, encoded, f.pair.old_bytes, 2);
    EXPECT_TRUE(outcome.status.IsCorruption()) << outcome.status.ToString();
  }
}

// A flipped bit either fails the decode or (when zstd framing absorbs it,
// e.g. a larger declared window) leaves the applied content exact. For raw
// formats (dense, indices) a flipped value is undetectable here by design:
// per-tensor checksums catch it; their headers must still be checked.
TEST_P(EveryDecoder, BitFlipsFailOrApplyExactly) {
  Fixture f;
  const Encoding e = GetParam();
  std::vector<SparseMode> modes = {SparseMode::kAuto};
  if (e == Encoding::kSparse) modes.push_back(SparseMode::kXorPlanes);
  const bool raw = e == Encoding::kDense || e == Encoding::kIndices;
  for (SparseMode mode : modes) {
    const std::vector<uint8_t> encoded = f.EncodeAs(e, mode);
    const size_t checked_bytes = e == Encoding::kIndices ? 24 : encoded.size();
    if (e == Encoding::kDense) continue;  // no structure to flip
    size_t failures = 0;
    size_t flips = 0;
    for (size_t byte = 0; byte < checked_bytes; ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        std::vector<uint8_t> flipped = encoded;
        flipped[byte] ^= static_cast<uint8_t>(1u << bit);
        Outcome outcome = Apply(e, flipped, f.pair.old_bytes, 2);
        ASSERT_TRUE(outcome.guards_intact) << "byte " << byte << " bit " << bit;
        ++flips;
        if (!outcome.status.ok()) {
          ASSERT_TRUE(outcome.status.IsCorruption()) << outcome.status.ToString();
          ++failures;
        } else {
          ASSERT_FALSE(raw) << "header flip accepted: byte " << byte << " bit " << bit;
          ASSERT_EQ(outcome.target, f.pair.new_bytes) << "byte " << byte << " bit " << bit;
        }
      }
    }
    // Benign flips are rare (zstd frame-header fields with slack).
    EXPECT_GE(failures * 100, flips * 98) << failures << " of " << flips;
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, EveryDecoder, ::testing::ValuesIn(AllEncodings()),
                         [](const ::testing::TestParamInfo<Encoding>& info) {
                           return std::string(EncodingName(info.param));
                         });

TEST(DenseCorruption, SizeMismatch) {
  std::vector<uint8_t> base(10, 1);
  std::vector<uint8_t> encoded(9, 2);
  Outcome outcome = Apply(Encoding::kDense, encoded, base, 2);
  ExpectCorruption(outcome, "9 encoded bytes for a tensor of 10 bytes");
  EXPECT_EQ(outcome.target, base);
}

TEST(XorCorruption, WrongContentLengthIsRefusedBeforeApplying) {
  Fixture f;
  std::vector<uint8_t> image = XorImage(f.pair);
  std::vector<uint8_t> longer = image;
  longer.push_back(0);
  Outcome outcome = Apply(Encoding::kXor, Compress(longer), f.pair.old_bytes, 2);
  ExpectCorruption(outcome, "decompresses to 6003 bytes but the tensor has 6002");
  EXPECT_EQ(outcome.target, f.pair.old_bytes);
  std::vector<uint8_t> shorter(image.begin(), image.end() - 2);
  outcome = Apply(Encoding::kXor, Compress(shorter), f.pair.old_bytes, 2);
  ExpectCorruption(outcome, "decompresses to 6000 bytes");
  EXPECT_EQ(outcome.target, f.pair.old_bytes);
}

TEST(XorCorruption, WrongLengthWithoutContentSizeIsCaughtWhileStreaming) {
  Fixture f;
  std::vector<uint8_t> image = XorImage(f.pair);
  std::vector<uint8_t> longer = image;
  longer.push_back(0);
  ExpectCorruption(Apply(Encoding::kXor, CompressUnsized(longer), f.pair.old_bytes, 2),
                   "more than the 6002 bytes");
  std::vector<uint8_t> shorter(image.begin(), image.end() - 2);
  ExpectCorruption(Apply(Encoding::kXor, CompressUnsized(shorter), f.pair.old_bytes, 2),
                   "frame ends after 6000 bytes");
}

TEST(XorCorruption, OnlyOneFrame) {
  Fixture f;
  std::vector<uint8_t> frame = f.EncodeAs(Encoding::kXor);
  std::vector<uint8_t> two = frame;
  std::vector<uint8_t> empty_frame = Compress({});
  two.insert(two.end(), empty_frame.begin(), empty_frame.end());
  ExpectCorruption(Apply(Encoding::kXor, two, f.pair.old_bytes, 2), "after the zstd frame");
  std::vector<uint8_t> not_zstd = {0x28, 0xb5, 0x2f, 0xfe, 0, 0, 0, 0};
  ExpectCorruption(Apply(Encoding::kXor, not_zstd, f.pair.old_bytes, 2), "not a zstd frame");
  ExpectCorruption(Apply(Encoding::kXor, {}, f.pair.old_bytes, 2), "not a zstd frame");
}

TEST(XorCorruption, TruncatedFramesAndBadChecksums) {
  Fixture f;
  const std::vector<uint8_t> frame = f.EncodeAs(Encoding::kXor);
  ExpectCorruption(Apply(Encoding::kXor, std::span(frame).first(5), f.pair.old_bytes, 2),
                   "truncated or invalid zstd frame header");
  ExpectCorruption(
      Apply(Encoding::kXor, std::span(frame).first(frame.size() / 2), f.pair.old_bytes, 2),
      "truncated zstd frame");
  // The content checksum is the frame's last 4 bytes.
  ASSERT_GT(frame.size(), 8u);
  std::vector<uint8_t> bad_checksum = frame;
  bad_checksum[frame.size() - 1] ^= 1;
  ExpectCorruption(Apply(Encoding::kXor, bad_checksum, f.pair.old_bytes, 2), "checksum");
}

TEST(XorCorruption, WindowLargerThanAllowed) {
  std::vector<uint8_t> base(4 << 20, 0);
  std::vector<uint8_t> image(base.size());
  for (size_t i = 0; i < image.size(); i += 4099) image[i] = 1;
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_windowLog, 22);
  std::vector<uint8_t> frame(ZSTD_compressBound(image.size()));
  size_t n = ZSTD_compress2(cctx, frame.data(), frame.size(), image.data(), image.size());
  ZSTD_freeCCtx(cctx);
  ASSERT_FALSE(ZSTD_isError(n));
  frame.resize(n);
  DecodeOptions options;
  options.zstd_window_log_max = 20;
  std::vector<uint8_t> target = base;
  Status status = DecodeApply(Encoding::kXor, frame, target, 1, options);
  EXPECT_TRUE(status.IsCorruption()) << status.ToString();
  EXPECT_NE(status.message().find("memory"), std::string::npos) << status.message();
  options.zstd_window_log_max = 22;
  EXPECT_TRUE(DecodeApply(Encoding::kXor, frame, target, 1, options).ok());
  EXPECT_EQ(target, image);
}

std::vector<uint8_t> OverwriteContent(const std::vector<uint32_t>& positions,
                                      const std::vector<uint8_t>& values) {
  std::vector<uint8_t> content;
  PutLE(&content, positions.size(), 4);
  for (uint32_t p : positions) PutLE(&content, p, 4);
  content.insert(content.end(), values.begin(), values.end());
  return content;
}

TEST(OverwriteCorruption, PositionOutOfRange) {
  std::vector<uint8_t> base(1000, 7);
  std::vector<uint32_t> positions(300);
  std::vector<uint8_t> values(300, 9);
  for (uint32_t i = 0; i < 300; ++i) positions[i] = 3 * i;
  positions[250] = 1000;
  std::vector<uint8_t> content = OverwriteContent(positions, values);
  // The buffered path (everything fits one chunk) checks before applying.
  Outcome outcome = Apply(Encoding::kOverwrite, Compress(content), base, 1);
  ExpectCorruption(outcome, "byte position 1000 at entry 250 is outside the tensor's 1000 bytes");
  EXPECT_EQ(outcome.target, base);
  // The two-cursor path stops at the bad entry.
  ExpectCorruption(Apply(Encoding::kOverwrite, Compress(content), base, 1, 100),
                   "byte position 1000 at entry 250");
  positions[250] = 0xFFFFFFFFu;
  ExpectCorruption(
      Apply(Encoding::kOverwrite, Compress(OverwriteContent(positions, values)), base, 1, 100),
      "byte position 4294967295");
}

TEST(OverwriteCorruption, CountDisagreesWithFrame) {
  std::vector<uint8_t> base(1000, 7);
  std::vector<uint8_t> content = OverwriteContent({1, 2, 3}, {4, 5, 6});
  std::vector<uint8_t> extra = content;
  extra.push_back(0);
  ExpectCorruption(Apply(Encoding::kOverwrite, Compress(extra), base, 1),
                   "frame content is 20 bytes, but K = 3 needs 19");
  for (size_t chunk : {size_t{1} << 20, size_t{5}}) {
    ExpectCorruption(Apply(Encoding::kOverwrite, CompressUnsized(extra), base, 1, chunk),
                     "more than");
    std::vector<uint8_t> missing(content.begin(), content.end() - 1);
    ExpectCorruption(Apply(Encoding::kOverwrite, CompressUnsized(missing), base, 1, chunk),
                     "frame ends after");
  }
  std::vector<uint8_t> huge_count = content;
  huge_count[0] = 0xE9;  // K = 1001 + the rest
  huge_count[1] = 0x03;
  ExpectCorruption(Apply(Encoding::kOverwrite, Compress(huge_count), base, 1),
                   "positions for a tensor of 1000 bytes");
  ExpectCorruption(Apply(Encoding::kOverwrite, Compress(std::vector<uint8_t>{1, 0}), base, 1),
                   "frame ends after 2 bytes");
}

std::vector<uint8_t> IndicesPayload(uint8_t width, uint8_t es, uint64_t numel,
                                    const std::vector<int64_t>& positions) {
  std::vector<uint8_t> out = {'D', 'S', 'I', 'X', 1, width, es, 0};
  PutLE(&out, numel, 8);
  PutLE(&out, positions.size(), 8);
  for (int64_t p : positions) PutLE(&out, static_cast<uint64_t>(p), width);
  out.resize(out.size() + positions.size() * es, 0xAB);
  return out;
}

TEST(IndicesCorruption, PositionsOutOfRangeLeaveTargetUntouched) {
  std::vector<uint8_t> base(400, 1);  // 200 two-byte elements
  Outcome outcome = Apply(Encoding::kIndices, IndicesPayload(4, 2, 200, {0, 5, 200}), base, 2);
  ExpectCorruption(outcome, "position 200 at entry 2 is outside the tensor's 200 elements");
  EXPECT_EQ(outcome.target, base);
  outcome = Apply(Encoding::kIndices, IndicesPayload(4, 2, 200, {3, -1}), base, 2);
  ExpectCorruption(outcome, "position -1 at entry 1");
  EXPECT_EQ(outcome.target, base);
  outcome = Apply(Encoding::kIndices, IndicesPayload(8, 2, 200, {int64_t{1} << 40}), base, 2);
  ExpectCorruption(outcome, "position 1099511627776");
  // Well-formed control: the same builder's valid payload applies.
  outcome = Apply(Encoding::kIndices, IndicesPayload(4, 2, 200, {199}), base, 2);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.ToString();
  EXPECT_EQ(outcome.target[398], 0xAB);
}

TEST(IndicesCorruption, HeaderFields) {
  std::vector<uint8_t> base(400, 1);
  const std::vector<uint8_t> good = IndicesPayload(4, 2, 200, {1, 2});
  auto with = [&](size_t byte, uint8_t value) {
    std::vector<uint8_t> bad = good;
    bad[byte] = value;
    return bad;
  };
  ExpectCorruption(Apply(Encoding::kIndices, with(0, 'X'), base, 2), "bad magic");
  ExpectCorruption(Apply(Encoding::kIndices, with(4, 2), base, 2), "unsupported version 2");
  ExpectCorruption(Apply(Encoding::kIndices, with(5, 2), base, 2), "position width 2");
  ExpectCorruption(Apply(Encoding::kIndices, with(6, 4), base, 2), "element size 4");
  ExpectCorruption(Apply(Encoding::kIndices, with(7, 1), base, 2), "reserved");
  ExpectCorruption(Apply(Encoding::kIndices, with(8, 201), base, 2), "encodes 201 elements");
  ExpectCorruption(Apply(Encoding::kIndices, with(16, 3), base, 2), "expected 42 for 3 entries");
  ExpectCorruption(Apply(Encoding::kIndices, with(16, 255), base, 2), "255 positions");
  ExpectCorruption(Apply(Encoding::kIndices, std::span(good).first(10), base, 2),
                   "truncated header");
}

std::vector<uint8_t> SparseEncoding(uint8_t mode, uint8_t es, uint64_t numel, uint64_t count,
                                    std::span<const uint8_t> content) {
  std::vector<uint8_t> out = {'D', 'S', 'S', 'P', 1, mode, es, 0};
  PutLE(&out, numel, 8);
  PutLE(&out, count, 8);
  std::vector<uint8_t> frame = Compress(content);
  out.insert(out.end(), frame.begin(), frame.end());
  return out;
}

TEST(SparseCorruption, HeaderFields) {
  std::vector<uint8_t> base(200, 0);  // 100 two-byte elements
  // Gaps 10, 0, 5 -> elements 10, 11, 17; plane 0 then plane 1.
  const std::vector<uint8_t> content = {3, 0, 0, 0, 10, 0, 5, 0xFF, 0x01, 0x00, 0x00, 0x00, 0x80};
  const std::vector<uint8_t> good = SparseEncoding(1, 2, 100, 3, content);
  Outcome control = Apply(Encoding::kSparse, good, base, 2);
  ASSERT_TRUE(control.status.ok()) << control.status.ToString();
  EXPECT_EQ(control.target[20], 0xFF);  // element 10, plane 0
  EXPECT_EQ(control.target[22], 0x01);  // element 11
  EXPECT_EQ(control.target[34], 0x00);  // element 17, plane 0
  EXPECT_EQ(control.target[35], 0x80);  // element 17, plane 1
  auto with = [&](size_t byte, uint8_t value) {
    std::vector<uint8_t> bad = good;
    bad[byte] = value;
    return bad;
  };
  ExpectCorruption(Apply(Encoding::kSparse, with(3, 'Q'), base, 2), "bad magic");
  ExpectCorruption(Apply(Encoding::kSparse, with(4, 9), base, 2), "unsupported version 9");
  ExpectCorruption(Apply(Encoding::kSparse, with(5, 0), base, 2), "unknown mode 0");
  ExpectCorruption(Apply(Encoding::kSparse, with(6, 3), base, 2), "element size 3");
  ExpectCorruption(Apply(Encoding::kSparse, with(6, 4), base, 2),
                   "element size 4 but the tensor's is 2");
  ExpectCorruption(Apply(Encoding::kSparse, with(7, 1), base, 2), "reserved");
  ExpectCorruption(Apply(Encoding::kSparse, with(8, 99), base, 2),
                   "encodes 99 elements but the tensor has 100");
  ExpectCorruption(Apply(Encoding::kSparse, with(16, 101), base, 2), "101 changes out of 100");
  ExpectCorruption(Apply(Encoding::kSparse, with(16, 4), base, 2), "gap section of 3 bytes");
  ExpectCorruption(Apply(Encoding::kSparse, with(16, 2), base, 2), "1 unused bytes");
  ExpectCorruption(Apply(Encoding::kSparse, std::span(good).first(23), base, 2),
                   "truncated header");
}

TEST(SparseCorruption, GapsAndSections) {
  std::vector<uint8_t> base(200, 0);
  auto apply = [&](uint64_t count, const std::vector<uint8_t>& content) {
    return Apply(Encoding::kSparse, SparseEncoding(1, 2, 100, count, content), base, 2);
  };
  // Positions 60 and 60 + 1 + 45 = 106 > 99.
  ExpectCorruption(apply(2, {2, 0, 0, 0, 60, 45, 1, 1, 1, 1}), "outside the tensor's 100 elements");
  // Escaped gap 255 + 0 from position 0.
  ExpectCorruption(apply(1, {2, 0, 0, 0, 255, 0, 1, 1}), "gap 255 is outside");
  // Escape whose varint never ends inside the section.
  ExpectCorruption(apply(1, {2, 0, 0, 0, 255, 0x80, 1, 1}), "malformed or truncated gap");
  // A varint wider than 64 bits: its tenth byte carries bit 64.
  std::vector<uint8_t> wide = {11, 0, 0, 0, 255};
  for (int i = 0; i < 9; ++i) wide.push_back(0xFF);
  wide.push_back(0x02);
  wide.push_back(1);
  wide.push_back(1);
  ExpectCorruption(apply(1, wide), "malformed or truncated gap");
  // The same section one byte longer is refused by its declared length.
  wide[0] = 12;
  wide.insert(wide.begin() + 5, 0xFF);
  ExpectCorruption(apply(1, wide), "gap section of 12 bytes for 1 positions");
  // Two gap bytes for one position.
  ExpectCorruption(apply(1, {2, 0, 0, 0, 1, 1, 1, 1}), "unused bytes in a gap section");
  // Planes cut short, then content past the last block.
  ExpectCorruption(apply(2, {2, 0, 0, 0, 1, 1, 1, 1, 1}), "frame ends after");
  ExpectCorruption(apply(1, {1, 0, 0, 0, 1, 1, 1, 9}), "more than");
}

// The decoder reads positions ahead of the change it applies (a ring of
// kPrefetchLeadChanges): a block several rings long must apply every change
// at its own position, escaped gaps included, and a bad gap far past the
// first ring must still be refused.
TEST(SparseCorruption, LongBlockAppliesEveryChangeAndRefusesALateBadGap) {
  constexpr uint64_t kNumel = 200000;
  constexpr size_t kCount = 5 * codec_internal::kPrefetchLeadChanges + 77;
  std::vector<uint8_t> gaps;
  std::vector<uint64_t> positions;
  std::vector<size_t> gap_at;  // where each change's gap starts in `gaps`
  uint64_t next = 0;
  for (size_t i = 0; i < kCount; ++i) {
    const uint64_t gap = i % 7 == 0 ? 300 : i % 3;  // 300: escape 255, then varint 45
    gap_at.push_back(gaps.size());
    if (gap >= 255) {
      gaps.push_back(255);
      gaps.push_back(static_cast<uint8_t>(gap - 255));
    } else {
      gaps.push_back(static_cast<uint8_t>(gap));
    }
    positions.push_back(next + gap);
    next = positions.back() + 1;
  }
  ASSERT_LT(next, kNumel);
  auto content_with = [&](const std::vector<uint8_t>& gap_bytes) {
    std::vector<uint8_t> content;
    PutLE(&content, gap_bytes.size(), 4);
    content.insert(content.end(), gap_bytes.begin(), gap_bytes.end());
    for (size_t i = 0; i < kCount; ++i) content.push_back(static_cast<uint8_t>(i | 1));
    for (size_t i = 0; i < kCount; ++i) content.push_back(static_cast<uint8_t>(i >> 8));
    return SparseEncoding(1, 2, kNumel, kCount, content);
  };
  const std::vector<uint8_t> base(2 * kNumel, 0);
  Outcome good = Apply(Encoding::kSparse, content_with(gaps), base, 2);
  ASSERT_TRUE(good.status.ok()) << good.status.ToString();
  std::vector<uint8_t> expected(2 * kNumel, 0);
  for (size_t i = 0; i < kCount; ++i) {
    expected[2 * positions[i]] = static_cast<uint8_t>(i | 1);
    expected[2 * positions[i] + 1] = static_cast<uint8_t>(i >> 8);
  }
  EXPECT_TRUE(good.target == expected);

  // Change 4 rings in gets a gap that leaves the tensor.
  const size_t late = 4 * codec_internal::kPrefetchLeadChanges + 4;
  ASSERT_NE(late % 7, 0u);  // a one-byte gap, made an escape below
  std::vector<uint8_t> bad = gaps;
  bad[gap_at[late]] = 255;
  const uint8_t far[] = {0xFF, 0xFF, 0x7F};  // escape + 2^21 - 1: past element 200000
  bad.insert(bad.begin() + static_cast<std::ptrdiff_t>(gap_at[late]) + 1, std::begin(far),
             std::end(far));
  ExpectCorruption(Apply(Encoding::kSparse, content_with(bad), base, 2),
                   "outside the tensor's 200000 elements");
}

TEST(SparseCorruption, XorPlanesCountMismatch) {
  std::vector<uint8_t> base(8, 0);
  std::vector<uint8_t> planes = {1, 0, 0, 2, 0, 0, 0, 0};  // elements 0 and 3 change
  ASSERT_TRUE(Apply(Encoding::kSparse, SparseEncoding(2, 2, 4, 2, planes), base, 2).status.ok());
  ExpectCorruption(Apply(Encoding::kSparse, SparseEncoding(2, 2, 4, 3, planes), base, 2),
                   "changes 2 elements but the header declares 3");
  std::vector<uint8_t> short_planes(planes.begin(), planes.end() - 1);
  ExpectCorruption(Apply(Encoding::kSparse, SparseEncoding(2, 2, 4, 2, short_planes), base, 2),
                   "frame ends after 7 bytes");
}

// Formats that let a position repeat (indices, overwrite): the last entry
// wins, as when applying in order, and an element written back to its own
// value is no change. Apply() checks DecodeChanges against DecodeApply.
TEST(RepeatedPositions, LastEntryWinsAndRestoredElementsAreNotChanges) {
  std::vector<uint8_t> base(40);
  for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<uint8_t>(3 * i + 1);
  // indices, 2-byte elements: 5 is written, then restored; 2 twice; 9 once.
  std::vector<uint8_t> payload = IndicesPayload(4, 2, 20, {5, 2, 5, 9, 2});
  uint8_t* values = payload.data() + payload.size() - 5 * 2;
  const uint8_t v[5][2] = {
      {0x11, 0x12}, {0x21, 0x22}, {base[10], base[11]}, {0x41, 0x42}, {0x51, 0x52}};
  for (int k = 0; k < 5; ++k) std::memcpy(values + 2 * k, v[k], 2);
  Outcome outcome = Apply(Encoding::kIndices, payload, base, 2);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.ToString();
  EXPECT_EQ(outcome.target[4], 0x51);
  EXPECT_EQ(outcome.target[10], base[10]);
  ChangeSet changes;
  ASSERT_TRUE(DecodeChanges(Encoding::kIndices, payload, base, 2, &changes).ok());
  ASSERT_EQ(changes.count(), 2u);
  EXPECT_EQ(changes.position(0), 2u);
  EXPECT_EQ(changes.position(1), 9u);

  // overwrite, 4-byte elements: bytes out of order, one rewritten twice,
  // one element's only write is its current byte.
  std::vector<uint8_t> content =
      OverwriteContent({13, 1, 13, 20, 2}, {0xEE, 0xAA, 0xCC, base[20], 0xBB});
  outcome = Apply(Encoding::kOverwrite, Compress(content), base, 4);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.ToString();
  EXPECT_EQ(outcome.target[13], 0xCC);
  ASSERT_TRUE(DecodeChanges(Encoding::kOverwrite, Compress(content), base, 4, &changes).ok());
  ASSERT_EQ(changes.count(), 2u);
  EXPECT_EQ(changes.position(0), 0u);
  EXPECT_EQ(changes.position(1), 3u);
}

}  // namespace
}  // namespace deltasync
