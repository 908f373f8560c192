// The compatible encodings checked against independent constructions: frames
// made or read by plain one-shot zstd (as the Python peers do) and payloads
// parsed by hand from the byte layout in docs/format.md.
#include <gtest/gtest.h>
#include <zstd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "codec/codec_test_util.h"
#include "deltasync/codec.h"

namespace deltasync {
namespace {

using codec_test::DiffPair;
using codec_test::MakePair;
using codec_test::TensorPair;
using codec_test::XorImage;
using codec_test::ZstdCompress;

uint32_t Le32(const uint8_t* p) { return p[0] | p[1] << 8 | p[2] << 16 | uint32_t{p[3]} << 24; }
uint64_t Le64(const uint8_t* p) { return Le32(p) | uint64_t{Le32(p + 4)} << 32; }

// One-shot decompression, the way python-zstandard's decompress() works.
std::vector<uint8_t> Decompress(std::span<const uint8_t> frame, size_t capacity) {
  std::vector<uint8_t> out(capacity);
  size_t n = ZSTD_decompress(out.data(), out.size(), frame.data(), frame.size());
  EXPECT_FALSE(ZSTD_isError(n)) << ZSTD_getErrorName(n);
  out.resize(ZSTD_isError(n) ? 0 : n);
  return out;
}

// A frame whose header omits the content size (streaming producers).
std::vector<uint8_t> CompressUnsized(std::span<const uint8_t> content) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 0);
  std::vector<uint8_t> out(ZSTD_compressBound(content.size()) + 64);
  ZSTD_inBuffer in{content.data(), content.size(), 0};
  ZSTD_outBuffer ob{out.data(), out.size(), 0};
  while (ZSTD_compressStream2(cctx, &ob, &in, ZSTD_e_end) != 0) {
  }
  ZSTD_freeCCtx(cctx);
  out.resize(ob.pos);
  return out;
}

class Compat : public ::testing::TestWithParam<uint32_t> {};

// The xor encoder hands zstd its own sequences and stitches the blocks into
// one frame; plain one-shot zstd (which verifies the content checksum) is the
// judge, across block and chunk boundaries, densities from none to most, and
// with and without the checksum.
TEST_P(Compat, XorFrameIsOneZstdFrameOfNewXorOld) {
  const uint32_t es = GetParam();
  for (double density : {0.0, 0.02, 0.6}) {
    // More than two 128 KiB zstd blocks for every element size.
    TensorPair pair = MakePair(50001 + 300000 / es, es, density, es);
    ChangeSet changes = DiffPair(pair);
    for (size_t chunk_bytes : {size_t{4096}, size_t{1} << 20}) {
      for (bool checksum : {true, false}) {
        SCOPED_TRACE("density " + std::to_string(density) + ", chunk " +
                     std::to_string(chunk_bytes) + ", checksum " + std::to_string(checksum));
        EncodeOptions options;
        options.zstd_checksum = checksum;
        options.chunk_bytes = chunk_bytes;
        std::vector<uint8_t> frame;
        ASSERT_TRUE(Encode(Encoding::kXor, pair.new_bytes, changes, options, &frame).ok());
        // One frame, nothing after it, its content size in the header.
        EXPECT_EQ(ZSTD_findFrameCompressedSize(frame.data(), frame.size()), frame.size());
        EXPECT_EQ(ZSTD_getFrameContentSize(frame.data(), frame.size()), pair.new_bytes.size());
        ASSERT_GT(frame.size(), 4u);
        EXPECT_EQ((frame[4] & 0x04) != 0, checksum);  // Content_Checksum_flag
        EXPECT_EQ(Decompress(frame, pair.new_bytes.size() + 1), XorImage(pair));
        if (density > 0 && density < 0.5) {
          // Far smaller than the image: the zero runs became matches.
          EXPECT_LT(frame.size() * 10, pair.new_bytes.size());
        }
      }
    }
  }
}

// Unset, the content checksum is off for xor (the store verifies each
// tensor's checksum after apply; hashing the whole XOR image would cost a
// pass over the tensor on each side) and on for the other zstd encodings.
TEST_P(Compat, ContentChecksumByDefaultOnlyOutsideXor) {
  const uint32_t es = GetParam();
  TensorPair pair = MakePair(20000, es, 0.02, 300 + es);
  ChangeSet changes = DiffPair(pair);
  for (Encoding e : AllEncodings()) {
    if (GetEncodingInfo(e).compression != "zstd") continue;
    SCOPED_TRACE(std::string(EncodingName(e)));
    EncodeOptions options;
    EXPECT_EQ(options.ZstdChecksumFor(e), e != Encoding::kXor);
    std::vector<uint8_t> frame;
    ASSERT_TRUE(Encode(e, pair.new_bytes, changes, options, &frame).ok());
    // The zstd frame: at the start, or after sparse's fixed header.
    const uint8_t magic[4] = {0x28, 0xB5, 0x2F, 0xFD};
    auto at = std::search(frame.begin(), frame.end(), std::begin(magic), std::end(magic));
    ASSERT_NE(at, frame.end());
    ASSERT_GT(frame.end() - at, 5);
    EXPECT_EQ((at[4] & 0x04) != 0, e != Encoding::kXor);  // Content_Checksum_flag
    options.zstd_checksum = false;
    EXPECT_FALSE(options.ZstdChecksumFor(e));
    options.zstd_checksum = true;
    EXPECT_TRUE(options.ZstdChecksumFor(e));
  }
}

TEST_P(Compat, XorAppliesFramesFromOneShotAndStreamingProducers) {
  const uint32_t es = GetParam();
  TensorPair pair = MakePair(30011, es, 0.03, 100 + es);
  for (const std::vector<uint8_t>& frame :
       {ZstdCompress(XorImage(pair)), ZstdCompress(XorImage(pair), 19),
        CompressUnsized(XorImage(pair))}) {
    std::vector<uint8_t> target = pair.old_bytes;
    DecodeOptions options;
    options.chunk_bytes = 1000;
    Status status = DecodeApply(Encoding::kXor, frame, target, es, options);
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(target, pair.new_bytes);
    EXPECT_TRUE(codec_test::ChangesMatchApply(Encoding::kXor, frame, pair.old_bytes, es, options,
                                              status, target));
  }
}

// Parses vime's overwrite content by hand: u32 K, K u32 byte positions, K
// bytes; every differing byte and nothing else, ascending.
TEST_P(Compat, OverwriteFrameListsExactlyTheDifferingBytes) {
  const uint32_t es = GetParam();
  TensorPair pair = MakePair(40000, es, 0.02, 200 + es);
  ChangeSet changes = DiffPair(pair);
  EncodeOptions options;
  options.chunk_bytes = 100;
  std::vector<uint8_t> frame;
  ASSERT_TRUE(Encode(Encoding::kOverwrite, pair.new_bytes, changes, options, &frame).ok());
  EXPECT_EQ(ZSTD_findFrameCompressedSize(frame.data(), frame.size()), frame.size());
  std::vector<uint32_t> expected_positions;
  std::vector<uint8_t> expected_values;
  for (size_t i = 0; i < pair.new_bytes.size(); ++i) {
    if (pair.new_bytes[i] != pair.old_bytes[i]) {
      expected_positions.push_back(static_cast<uint32_t>(i));
      expected_values.push_back(pair.new_bytes[i]);
    }
  }
  const uint64_t k = expected_positions.size();
  ASSERT_EQ(ZSTD_getFrameContentSize(frame.data(), frame.size()), 4 + 5 * k);
  std::vector<uint8_t> content = Decompress(frame, 4 + 5 * k);
  ASSERT_EQ(content.size(), 4 + 5 * k);
  ASSERT_EQ(Le32(content.data()), k);
  for (uint64_t i = 0; i < k; ++i) {
    ASSERT_EQ(Le32(content.data() + 4 + 4 * i), expected_positions[i]) << "entry " << i;
    ASSERT_EQ(content[4 + 4 * k + i], expected_values[i]) << "entry " << i;
  }
}

// The decoder accepts positions in any order (vime writes them ascending;
// the format does not promise it), through the buffered and the two-cursor
// paths.
TEST_P(Compat, OverwriteAppliesHandBuiltFramesInAnyOrder) {
  const uint32_t es = GetParam();
  TensorPair pair = MakePair(20000, es, 0.05, 300 + es);
  std::vector<uint32_t> positions;
  for (size_t i = 0; i < pair.new_bytes.size(); ++i) {
    if (pair.new_bytes[i] != pair.old_bytes[i]) positions.push_back(static_cast<uint32_t>(i));
  }
  std::reverse(positions.begin(), positions.end());
  std::vector<uint8_t> content(4 + 5 * positions.size());
  const uint32_t k = static_cast<uint32_t>(positions.size());
  std::memcpy(content.data(), &k, 4);
  for (uint32_t i = 0; i < k; ++i) {
    std::memcpy(content.data() + 4 + 4 * i, &positions[i], 4);
    content[4 + 4 * k + i] = pair.new_bytes[positions[i]];
  }
  for (const std::vector<uint8_t>& frame : {ZstdCompress(content), CompressUnsized(content)}) {
    for (size_t chunk : {size_t{1} << 20, size_t{777}}) {
      std::vector<uint8_t> target = pair.old_bytes;
      DecodeOptions options;
      options.chunk_bytes = chunk;
      Status status = DecodeApply(Encoding::kOverwrite, frame, target, es, options);
      ASSERT_TRUE(status.ok()) << status.ToString();
      EXPECT_EQ(target, pair.new_bytes);
      EXPECT_TRUE(codec_test::ChangesMatchApply(Encoding::kOverwrite, frame, pair.old_bytes, es,
                                                options, status, target));
    }
  }
}

TEST_P(Compat, IndicesPayloadLayout) {
  const uint32_t es = GetParam();
  TensorPair pair = MakePair(9000, es, 0.04, 400 + es);
  ChangeSet changes = DiffPair(pair);
  std::vector<uint8_t> payload;
  ASSERT_TRUE(Encode(Encoding::kIndices, pair.new_bytes, changes, {}, &payload).ok());
  const uint64_t k = changes.count();
  ASSERT_EQ(payload.size(), 24 + k * (4 + es));
  EXPECT_EQ(std::string(payload.begin(), payload.begin() + 4), "DSIX");
  EXPECT_EQ(payload[4], 1);   // version
  EXPECT_EQ(payload[5], 4);   // int32 positions below 2^31 elements
  EXPECT_EQ(payload[6], es);  // element size
  EXPECT_EQ(payload[7], 0);
  EXPECT_EQ(Le64(payload.data() + 8), pair.numel());
  EXPECT_EQ(Le64(payload.data() + 16), k);
  uint64_t entry = 0;
  for (size_t e = 0; e < pair.numel(); ++e) {
    if (std::memcmp(&pair.new_bytes[e * es], &pair.old_bytes[e * es], es) == 0) continue;
    ASSERT_LT(entry, k);
    EXPECT_EQ(Le32(payload.data() + 24 + 4 * entry), e);
    EXPECT_EQ(0,
              std::memcmp(payload.data() + 24 + 4 * k + es * entry, &pair.new_bytes[e * es], es));
    ++entry;
  }
  EXPECT_EQ(entry, k);
}

// int64 positions (what a producer uses from 2^31 elements on) decode too.
TEST_P(Compat, IndicesAcceptsInt64Positions) {
  const uint32_t es = GetParam();
  TensorPair pair = MakePair(1000, es, 0.1, 500 + es);
  std::vector<uint8_t> payload = {'D', 'S', 'I', 'X', 1, 8, static_cast<uint8_t>(es), 0};
  std::vector<uint64_t> positions;
  for (size_t e = 0; e < pair.numel(); ++e) {
    if (std::memcmp(&pair.new_bytes[e * es], &pair.old_bytes[e * es], es) != 0) {
      positions.push_back(e);
    }
  }
  auto put64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) payload.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  put64(pair.numel());
  put64(positions.size());
  for (uint64_t p : positions) put64(p);
  for (uint64_t p : positions) {
    payload.insert(payload.end(), &pair.new_bytes[p * es], &pair.new_bytes[p * es] + es);
  }
  std::vector<uint8_t> target = pair.old_bytes;
  Status status = DecodeApply(Encoding::kIndices, payload, target, es);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(target, pair.new_bytes);
  EXPECT_TRUE(codec_test::ChangesMatchApply(Encoding::kIndices, payload, pair.old_bytes, es,
                                            DecodeOptions{}, status, target));
}

// A reference reader for the sparse format written from docs/format.md,
// sharing no code with the library: it must reproduce new from old.
std::vector<uint8_t> ReferenceSparseApply(std::span<const uint8_t> encoded,
                                          std::vector<uint8_t> target, uint32_t es) {
  EXPECT_EQ(std::string(encoded.begin(), encoded.begin() + 4), "DSSP");
  EXPECT_EQ(encoded[4], 1);
  EXPECT_EQ(encoded[6], es);
  EXPECT_EQ(encoded[7], 0);
  const uint8_t mode = encoded[5];
  const uint64_t numel = Le64(encoded.data() + 8);
  const uint64_t count = Le64(encoded.data() + 16);
  EXPECT_EQ(numel * es, target.size());
  std::span<const uint8_t> frame = encoded.subspan(24);
  EXPECT_EQ(ZSTD_findFrameCompressedSize(frame.data(), frame.size()), frame.size());
  std::vector<uint8_t> content = Decompress(frame, 16 * numel + 1024);
  size_t at = 0;
  if (mode == 2) {  // xor-planes: blocks of 65536 elements, plane by plane
    EXPECT_EQ(content.size(), numel * es);
    for (uint64_t first = 0; first < numel; first += 65536) {
      const uint64_t n = std::min<uint64_t>(65536, numel - first);
      for (uint32_t j = 0; j < es; ++j) {
        for (uint64_t i = 0; i < n; ++i) target[(first + i) * es + j] ^= content[at++];
      }
    }
    return target;
  }
  EXPECT_EQ(mode, 1);
  uint64_t previous_plus_one = 0;
  for (uint64_t first = 0; first < count; first += 65536) {
    const uint64_t n = std::min<uint64_t>(65536, count - first);
    const uint32_t gap_bytes = Le32(&content[at]);
    at += 4;
    const size_t gaps_end = at + gap_bytes;
    std::vector<uint64_t> positions;
    while (at < gaps_end) {
      uint64_t gap = content[at++];
      if (gap == 255) {
        uint64_t rest = 0;
        for (int shift = 0;; shift += 7) {
          uint8_t b = content[at++];
          rest |= uint64_t{b & 0x7fu} << shift;
          if (!(b & 0x80)) break;
        }
        gap = 255 + rest;
      }
      positions.push_back(previous_plus_one + gap);
      previous_plus_one = positions.back() + 1;
    }
    EXPECT_EQ(positions.size(), n);
    for (uint32_t j = 0; j < es; ++j) {
      for (uint64_t i = 0; i < n; ++i) target[positions[i] * es + j] ^= content[at++];
    }
  }
  EXPECT_EQ(at, content.size());
  return target;
}

TEST_P(Compat, SparseMatchesTheDocumentedLayout) {
  const uint32_t es = GetParam();
  for (double density : {0.0, 0.003, 0.02, 0.6, 1.0}) {
    TensorPair pair = MakePair(140000, es, density, 600 + es);
    ChangeSet changes = DiffPair(pair);
    for (SparseMode mode : {SparseMode::kPositions, SparseMode::kXorPlanes}) {
      EncodeOptions options;
      options.sparse_mode = mode;
      std::vector<uint8_t> encoded;
      ASSERT_TRUE(Encode(Encoding::kSparse, pair.new_bytes, changes, options, &encoded).ok());
      Result<SparseHeader> header = ReadSparseHeader(encoded);
      ASSERT_TRUE(header.ok()) << header.status().ToString();
      EXPECT_EQ(header->mode, mode);
      EXPECT_EQ(header->numel, pair.numel());
      EXPECT_EQ(header->count, changes.count());
      EXPECT_EQ(ReferenceSparseApply(encoded, pair.old_bytes, es), pair.new_bytes)
          << "density " << density << " mode " << static_cast<int>(mode);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ElemSizes, Compat, ::testing::Values(1u, 2u, 4u, 8u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return "es" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace deltasync
