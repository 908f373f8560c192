// The flush frame's writer, reader and destinations (docs/format.md,
// "Stream: flush frame"). One file past 800 lines on purpose: every case
// builds its frames with RawFrame below, a writer of the documented layout
// independent of FlushWriter, so that a corruption case and the layout it
// breaks read against one definition.
#include "stream/frame.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deltasync/checksum.h"

namespace deltasync::stream {
namespace {

using Bytes = stream::FrameBuffer;

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Bytes RandomBytes(size_t n, uint64_t seed) {
  Bytes v(n, 0);
  for (uint8_t& b : v) b = static_cast<uint8_t>(SplitMix(seed));
  return v;
}

void Put(Bytes& out, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void Set(Bytes& frame, size_t at, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) frame[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t Get(const Bytes& frame, size_t at, int width) {
  uint64_t v = 0;
  for (int i = 0; i < width; ++i) v |= uint64_t{frame[at + i]} << (8 * i);
  return v;
}

// Recomputes the trailer after an edit, so that the reader gets past its
// checksum to the field under test.
void Rehash(Bytes& frame) {
  const std::vector<uint8_t> sum =
      ChecksumBytes(ChecksumAlgo::kXxh3_128, std::span(frame).first(frame.size() - 16));
  std::copy(sum.begin(), sum.end(), frame.end() - 16);
}

// ---------------------------------------------------------------------------
// An independent builder of frames, written from docs/format.md: the
// reference the writer is compared with, and the source of frames no writer
// would make.

struct RawEntry {
  RawEntry(std::string name, uint8_t dtype_code, uint8_t encoding, std::vector<uint64_t> shape,
           uint64_t first, uint64_t count, uint64_t n, Bytes positions, Bytes values)
      : name(std::move(name)),
        dtype_code(dtype_code),
        encoding(encoding),
        shape(std::move(shape)),
        first(first),
        count(count),
        n(n),
        positions(std::move(positions)),
        values(std::move(values)) {}
  std::string name;
  uint8_t dtype_code;
  uint8_t encoding;
  std::vector<uint64_t> shape;
  uint64_t first, count, n;
  Bytes positions, values;  // region contents
  std::optional<uint64_t> pos_off, val_off, pos_bytes, val_bytes;
};

struct RawDigest {
  std::string name;
  uint64_t first = 0, count = 0, rows = 1, row_stride = 0;
  uint64_t a = 0, b = 0;
};

struct RawFrame {
  uint16_t version = 2;
  uint16_t flags = 2 | 4;  // delta, last
  uint64_t sync_id = 7;
  uint32_t flush_index = 3;
  std::vector<RawEntry> entries;
  std::vector<RawDigest> digests;

  Bytes Build() const {
    Bytes f(64, 0);
    std::vector<std::array<uint64_t, 4>> regions;
    for (const RawEntry& e : entries) {
      f.resize((f.size() + 7) / 8 * 8, 0);
      const uint64_t pos_off = f.size();
      f.insert(f.end(), e.positions.begin(), e.positions.end());
      f.resize((f.size() + 7) / 8 * 8, 0);
      const uint64_t val_off = f.size();
      f.insert(f.end(), e.values.begin(), e.values.end());
      regions.push_back({e.pos_off.value_or(pos_off), e.pos_bytes.value_or(e.positions.size()),
                         e.val_off.value_or(val_off), e.val_bytes.value_or(e.values.size())});
    }
    f.resize((f.size() + 7) / 8 * 8, 0);
    const uint64_t payload = f.size() - 64;
    Bytes m;
    for (size_t k = 0; k < entries.size(); ++k) {
      const RawEntry& e = entries[k];
      Put(m, e.name.size(), 2);
      Put(m, e.dtype_code, 1);
      Put(m, e.encoding, 1);
      Put(m, e.shape.size(), 1);
      Put(m, 0, 3);
      Put(m, e.first, 8);
      Put(m, e.count, 8);
      Put(m, e.n, 8);
      for (uint64_t v : regions[k]) Put(m, v, 8);
      for (uint64_t d : e.shape) Put(m, d, 8);
      m.insert(m.end(), e.name.begin(), e.name.end());
    }
    for (const RawDigest& d : digests) {
      Put(m, d.name.size(), 2);
      Put(m, 0, 6);
      for (uint64_t v : {d.first, d.count, d.rows, d.row_stride, d.a, d.b}) Put(m, v, 8);
      m.insert(m.end(), d.name.begin(), d.name.end());
    }
    f.insert(f.end(), m.begin(), m.end());
    const uint64_t total = f.size() + 16;
    std::memcpy(f.data(), "DSFL", 4);
    Set(f, 4, version, 2);
    Set(f, 6, flags, 2);
    Set(f, 8, sync_id, 8);
    Set(f, 16, flush_index, 4);
    Set(f, 20, entries.size(), 4);
    Set(f, 24, digests.size(), 4);
    Set(f, 32, total, 8);
    Set(f, 40, payload, 8);
    Set(f, 48, m.size(), 8);
    f.resize(total, 0);
    Rehash(f);
    return f;
  }
};

Bytes Le(std::initializer_list<uint64_t> values, int width) {
  Bytes out;
  for (uint64_t v : values) Put(out, v, width);
  return out;
}

Bytes Zstd(const Bytes& content, bool with_size = true) {
  Bytes out(ZSTD_compressBound(content.size()));
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, with_size ? 1 : 0);
  size_t n;
  if (with_size) {
    n = ZSTD_compress2(cctx, out.data(), out.size(), content.data(), content.size());
  } else {
    ZSTD_inBuffer in{content.data(), content.size(), 0};
    ZSTD_outBuffer o{out.data(), out.size(), 0};
    n = ZSTD_compressStream2(cctx, &o, &in, ZSTD_e_end);
    n = ZSTD_isError(n) ? n : o.pos;
  }
  ZSTD_freeCCtx(cctx);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n, 0);
  return out;
}

Bytes Unzstd(std::span<const uint8_t> frame) {
  const unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  Bytes out(size, 0);
  EXPECT_EQ(ZSTD_decompress(out.data(), out.size(), frame.data(), frame.size()), size);
  return out;
}

// A zstd frame of `size` copies of one byte from RLE blocks, written out by
// hand: single segment, 8-byte content size. Lets a test claim huge
// contents in a few bytes; `claimed` overrides the recorded size.
Bytes RleZstd(uint64_t size, uint8_t byte, std::optional<uint64_t> claimed = std::nullopt) {
  Bytes f = {0x28, 0xB5, 0x2F, 0xFD, 0xE0};  // FCS 8 bytes, single segment
  Put(f, claimed.value_or(size), 8);
  constexpr uint64_t kBlock = 128 << 10;
  uint64_t left = size;
  do {
    const uint64_t n = std::min(left, kBlock);
    left -= n;
    Put(f, (n << 3) | (1 << 1) | (left == 0 ? 1 : 0), 3);  // RLE block
    f.push_back(byte);
  } while (left > 0);
  return f;
}

// ---------------------------------------------------------------------------

void ExpectCode(const Status& s, StatusCode code, const std::string& text) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_NE(s.message().find(text), std::string::npos) << s.message() << "\n  wanted: " << text;
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();
}

// After the checksum every message names the frame.
void ExpectCorrupt(const Bytes& frame, const std::string& text) {
  FlushReader reader;
  const Status s = reader.Read(frame);
  ExpectCode(s, StatusCode::kCorruption, text);
  EXPECT_NE(s.message().find("flush frame of sync "), std::string::npos) << s.message();
  EXPECT_TRUE(reader.entries().empty());
}

std::vector<int64_t> Shape(std::initializer_list<int64_t> dims) { return dims; }

// A small frame with every encoding and a digest record. Known layout:
//   entry 0 'model.embed.weight' BF16 [4, 8] dense [0, 32)
//   entry 1 'model.layers.0.w'   F32 [64] indices {1, 5, 63}
//   entry 2 'model.norm.weight'  F64 [16] sparse {0, 3, 15}
//   entry 3 'model.bias'         U8 [3] dense
//   record 0 'model.norm.weight' [0, +16)
struct BaseFrame {
  Bytes frame;
  Bytes embed = RandomBytes(64, 1);
  Bytes w_values = RandomBytes(12, 2);
  Bytes norm_values = RandomBytes(24, 3);
  Bytes bias = {7, 8, 9};
  std::vector<uint64_t> w_positions = {1, 5, 63};
  std::vector<uint64_t> norm_positions = {0, 3, 15};

  BaseFrame() {
    FlushWriter writer;
    FlushHeader header;
    header.sync_id = 7;
    header.flush_index = 3;
    header.last = true;
    EXPECT_TRUE(writer.Begin(header, 1 << 20, &frame).ok());
    const auto s0 = Shape({4, 8}), s1 = Shape({64}), s2 = Shape({16}), s3 = Shape({3});
    EXPECT_TRUE(*writer.AddDense({"model.embed.weight", DType::kBF16, s0, 0, 32}, embed));
    EXPECT_TRUE(*writer.AddIndices({"model.layers.0.w", DType::kF32, s1, 0, 64},
                                   Positions::Absolute(w_positions), w_values));
    EXPECT_TRUE(*writer.AddDigest("model.norm.weight", DigestBlock::Range(0, 16), {1, 2}));
    EXPECT_TRUE(*writer.AddSparse({"model.norm.weight", DType::kF64, s2, 0, 16},
                                  Positions::Absolute(norm_positions), norm_values));
    EXPECT_TRUE(*writer.AddDense({"model.bias", DType::kU8, s3, 0, 3}, bias));
    EXPECT_TRUE(writer.Finish().ok());
  }
  uint64_t payload() const { return Get(frame, 40, 8); }
  uint64_t manifest_at() const { return 64 + payload(); }
  // The manifest offset of entry k (entries are walked by their sizes).
  uint64_t entry_at(int k) const {
    uint64_t at = manifest_at();
    for (int i = 0; i < k; ++i) at += 64 + 8 * frame[at + 4] + Get(frame, at, 2);
    return at;
  }
  uint64_t record_at() const { return entry_at(4); }
};

TEST(FlushFrame, WriterMatchesTheDocumentedLayout) {
  // Dense and indices regions are fixed by the format; compare byte for
  // byte with the builder written from the docs.
  const Bytes embed = RandomBytes(64, 1), w = RandomBytes(12, 2), bias = {1, 2, 3};
  RawFrame raw;
  raw.flags = 2;  // delta, not last
  raw.sync_id = 42;
  raw.flush_index = 5;
  raw.entries.push_back({"model.embed.weight", 8, 0, {4, 8}, 0, 32, 32, {}, embed});
  raw.entries.push_back({"model.layers.0.w", 11, 1, {64}, 0, 64, 3, Le({1, 5, 63}, 3), w});
  raw.entries.push_back({"model.bias", 1, 0, {3}, 0, 3, 3, {}, bias});
  raw.digests.push_back({"model.bias", 0, 3, 1, 0, 0x1122334455667788ull, 0x99});

  Bytes frame;
  FlushWriter writer;
  FlushHeader header;
  header.sync_id = 42;
  header.flush_index = 5;
  ASSERT_TRUE(writer.Begin(header, 4096, &frame).ok());
  const auto s0 = Shape({4, 8}), s1 = Shape({64}), s3 = Shape({3});
  const std::vector<uint64_t> positions = {1, 5, 63};
  ASSERT_TRUE(
      *writer.AddDigest("model.bias", DigestBlock::Range(0, 3), {0x1122334455667788ull, 0x99}));
  ASSERT_TRUE(*writer.AddDense({"model.embed.weight", DType::kBF16, s0, 0, 32}, embed));
  ASSERT_TRUE(*writer.AddIndices({"model.layers.0.w", DType::kF32, s1, 0, 64},
                                 Positions::Absolute(positions), w));
  ASSERT_TRUE(*writer.AddDense({"model.bias", DType::kU8, s3, 0, 3}, bias));
  const uint64_t predicted = writer.frame_bytes();
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_EQ(frame.size(), predicted);
  EXPECT_EQ(frame, raw.Build());
  // The trailer is xxh3-128 of the rest in its canonical (printed) form.
  EXPECT_EQ(ToHex(std::span(frame).last(16)),
            ChecksumHex(ChecksumAlgo::kXxh3_128, std::span(frame).first(frame.size() - 16)));
}

TEST(FlushFrame, SparseRegionsAreGapsAndPlanes) {
  BaseFrame base;
  FlushReader reader;
  ASSERT_TRUE(reader.Read(base.frame).ok());
  const uint64_t at = base.entry_at(2);
  const uint64_t pos_off = Get(base.frame, at + 32, 8), pos_bytes = Get(base.frame, at + 40, 8);
  const uint64_t val_off = Get(base.frame, at + 48, 8), val_bytes = Get(base.frame, at + 56, 8);
  // Gaps of {0, 3, 15} from 0: 0, 2, 11. Planes of the three F64 values.
  EXPECT_EQ(Unzstd(std::span(base.frame).subspan(pos_off, pos_bytes)), (Bytes{0, 2, 11}));
  Bytes planes;
  for (int j = 0; j < 8; ++j) {
    for (int k = 0; k < 3; ++k) planes.push_back(base.norm_values[k * 8 + j]);
  }
  EXPECT_EQ(Unzstd(std::span(base.frame).subspan(val_off, val_bytes)), planes);
}

TEST(FlushFrame, ReadExposesWhatWasWritten) {
  BaseFrame base;
  FlushReader reader;
  ASSERT_TRUE(reader.Read(base.frame).ok());
  EXPECT_EQ(reader.header().sync_id, 7u);
  EXPECT_EQ(reader.header().flush_index, 3u);
  EXPECT_EQ(reader.header().kind, FrameKind::kDelta);
  EXPECT_TRUE(reader.header().last);
  EXPECT_FALSE(reader.header().verify_all);
  ASSERT_EQ(reader.entries().size(), 4u);
  const FlushEntry& e0 = reader.entries()[0];
  EXPECT_EQ(e0.name, "model.embed.weight");
  EXPECT_EQ(e0.dtype, DType::kBF16);
  EXPECT_EQ(e0.shape, Shape({4, 8}));
  EXPECT_EQ(e0.numel, 32u);
  EXPECT_EQ(Bytes(e0.values.begin(), e0.values.end()), base.embed);
  const FlushEntry& e1 = reader.entries()[1];
  EXPECT_EQ(e1.encoding, WireEncoding::kIndices);
  EXPECT_EQ(e1.position_width, 3u);  // u24: 64 elements
  EXPECT_EQ(EntryPositions(e1), base.w_positions);
  EXPECT_EQ(Bytes(e1.values.begin(), e1.values.end()), base.w_values);
  const FlushEntry& e2 = reader.entries()[2];
  EXPECT_EQ(e2.encoding, WireEncoding::kSparse);
  EXPECT_EQ(EntryPositions(e2), base.norm_positions);
  EXPECT_EQ(Bytes(e2.values.begin(), e2.values.end()), base.norm_values);
  ASSERT_EQ(reader.digests().size(), 1u);
  EXPECT_EQ(reader.digests()[0].name, "model.norm.weight");
  EXPECT_EQ(reader.digests()[0].block, DigestBlock::Range(0, 16));
  EXPECT_EQ(reader.digests()[0].digest, (StateDigest{1, 2}));
}

// Every dtype width with every encoding, at densities from one element to
// all of them, through the writer, the reader and an apply.
TEST(FlushFrame, RoundTripEveryWidthAndEncoding) {
  const DType dtypes[] = {DType::kU8, DType::kBF16, DType::kF32, DType::kF64};
  uint64_t seed = 99;
  FlushWriter writer;
  FlushReader reader;
  Bytes frame;
  for (DType dtype : dtypes) {
    const uint32_t w = static_cast<uint32_t>(DTypeSize(dtype));
    for (WireEncoding encoding :
         {WireEncoding::kDense, WireEncoding::kIndices, WireEncoding::kSparse}) {
      for (int density : {0, 1, 3, 50, 100}) {
        const uint64_t numel = 1000 + SplitMix(seed) % 5000;
        const uint64_t first = SplitMix(seed) % 100, count = numel - first - SplitMix(seed) % 100;
        const std::vector<int64_t> shape = {static_cast<int64_t>(numel)};
        std::vector<uint64_t> positions;
        for (uint64_t i = first; i < first + count; ++i) {
          if (encoding == WireEncoding::kDense || SplitMix(seed) % 100 < uint64_t(density)) {
            positions.push_back(i);
          }
        }
        if (density == 1) positions.push_back(first + count - 1);  // a gap past 255
        std::sort(positions.begin(), positions.end());
        positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
        const Bytes values = RandomBytes(positions.size() * w, SplitMix(seed));
        FlushHeader header;
        header.sync_id = 1 + SplitMix(seed) % 1000;
        ASSERT_TRUE(writer.Begin(header, 1 << 24, &frame).ok());
        const TensorRange range{"t", dtype, shape, first, count};
        Result<bool> added = encoding == WireEncoding::kDense ? writer.AddDense(range, values)
                             : encoding == WireEncoding::kIndices
                                 ? writer.AddIndices(range, Positions::Absolute(positions), values)
                                 : writer.AddSparse(range, Positions::Absolute(positions), values);
        ASSERT_TRUE(added.ok()) << added.status().ToString();
        ASSERT_TRUE(*added);
        ASSERT_TRUE(writer.Finish().ok());
        ASSERT_TRUE(reader.Read(frame).ok()) << reader.Read(frame).ToString();
        ASSERT_EQ(reader.entries().size(), 1u);
        const FlushEntry& e = reader.entries()[0];
        EXPECT_EQ(e.encoding, encoding);
        EXPECT_EQ(e.first, first);
        EXPECT_EQ(e.count, count);
        ASSERT_EQ(EntryPositions(e), positions);
        ASSERT_EQ(Bytes(e.values.begin(), e.values.end()), values);

        // Apply onto random bytes; compare with a plain scatter, and the
        // running digest with a recompute.
        Bytes dest = RandomBytes(numel * w, SplitMix(seed));
        Bytes want = dest;
        for (size_t k = 0; k < positions.size(); ++k) {
          std::memcpy(&want[positions[k] * w], &values[k * w], w);
        }
        const DestinationMap map = DestinationMap::Whole(numel);
        StateDigest running = *ComputeStateDigest(dest, w, 0);
        Result<uint64_t> written = ApplyEntry(e, map, dest, &running);
        ASSERT_TRUE(written.ok()) << written.status().ToString();
        EXPECT_EQ(*written, positions.size());
        ASSERT_EQ(dest, want) << DTypeName(dtype) << " " << WireEncodingName(encoding);
        EXPECT_EQ(running, *ComputeStateDigest(want, w, 0));
        // Applying again changes nothing: values, not differences.
        ASSERT_TRUE(ApplyEntry(e, map, dest).ok());
        EXPECT_EQ(dest, want);
      }
    }
  }
}

TEST(FlushFrame, SparseIsSmallerThanIndicesAtLowDensity) {
  // BF16 weights ~N(0, 0.02) where 2% changed: the reason sparse exists.
  const uint64_t numel = 1 << 18;
  uint64_t seed = 5;
  std::vector<uint64_t> positions;
  Bytes values;
  for (uint64_t i = 0; i < numel; ++i) {
    if (SplitMix(seed) % 50 != 0) continue;
    positions.push_back(i);
    const float x = static_cast<float>(static_cast<int64_t>(SplitMix(seed) % 2001) - 1000) * 4e-5f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    Put(values, bits >> 16, 2);
  }
  const std::vector<int64_t> shape = {static_cast<int64_t>(numel)};
  const TensorRange range{"w", DType::kBF16, shape, 0, numel};
  FlushWriter writer;
  Bytes sparse, indices;
  ASSERT_TRUE(writer.Begin({1}, 1 << 24, &sparse).ok());
  ASSERT_TRUE(*writer.AddSparse(range, Positions::Absolute(positions), values));
  ASSERT_TRUE(writer.Finish().ok());
  ASSERT_TRUE(writer.Begin({1}, 1 << 24, &indices).ok());
  ASSERT_TRUE(*writer.AddIndices(range, Positions::Absolute(positions), values));
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_LT(sparse.size() * 2, indices.size()) << sparse.size() << " vs " << indices.size();
}

// int64 positions from 2^31 elements on, for ranges near the end of a
// tensor that is never allocated: the destination holds only the range.
TEST(FlushFrame, WidePositionsForHugeTensors) {
  struct Case {
    std::vector<int64_t> shape;
    uint64_t numel;
    uint32_t width;
  };
  const Case cases[] = {
      {{int64_t{1} << 24}, uint64_t{1} << 24, 3},
      {{(int64_t{1} << 24) + 1}, (uint64_t{1} << 24) + 1, 4},
      {{(int64_t{1} << 31) - 1}, (uint64_t{1} << 31) - 1, 4},
      {{int64_t{1} << 31}, uint64_t{1} << 31, 8},
      {{1 << 16, 1 << 16}, uint64_t{1} << 32, 8},
  };
  for (const Case& c : cases) {
    const uint64_t first = c.numel - 1000, count = 1000;
    const std::vector<uint64_t> positions = {first, first + 1, c.numel - 2, c.numel - 1};
    const Bytes values = {1, 2, 3, 4, 5, 6, 7, 8};
    Bytes frame;
    FlushWriter writer;
    ASSERT_TRUE(writer.Begin({9}, 1 << 20, &frame).ok());
    ASSERT_TRUE(*writer.AddIndices({"huge", DType::kBF16, c.shape, first, count},
                                   Positions::Absolute(positions), values));
    ASSERT_TRUE(*writer.AddSparse({"huge2", DType::kBF16, c.shape, first, count},
                                  Positions::Absolute(positions), values));
    ASSERT_TRUE(writer.Finish().ok());
    FlushReader reader;
    ASSERT_TRUE(reader.Read(frame).ok()) << reader.Read(frame).ToString();
    const FlushEntry& e = reader.entries()[0];
    EXPECT_EQ(e.position_width, c.width);
    EXPECT_EQ(e.positions.size(), 4 * c.width);
    EXPECT_EQ(EntryPositions(e), positions);
    EXPECT_EQ(EntryPositions(reader.entries()[1]), positions);
    Result<DestinationMap> map = DestinationMap::Create(c.numel, {{first, count, 0, 1}});
    ASSERT_TRUE(map.ok());
    for (const FlushEntry& entry : reader.entries()) {
      Bytes dest(count * 2, 0);
      ASSERT_TRUE(ApplyEntry(entry, *map, dest).ok());
      EXPECT_EQ(dest[0], 1);
      EXPECT_EQ(dest[3], 4);
      EXPECT_EQ(dest[2 * 998], 5);
      EXPECT_EQ(dest[2 * 999 + 1], 8);
    }
  }
}

TEST(FlushFrame, SeedAndVerifyAllFlags) {
  Bytes frame;
  FlushWriter writer;
  FlushHeader header;
  header.sync_id = 3;
  header.kind = FrameKind::kSeed;
  header.last = true;
  header.verify_all = true;
  ASSERT_TRUE(writer.Begin(header, 1024, &frame).ok());
  const auto shape = Shape({2});
  const std::vector<uint64_t> one = {1};
  ExpectCode(writer.AddIndices({"x", DType::kU8, shape, 0, 2}, Positions::Absolute(one), Bytes{1})
                 .status(),
             StatusCode::kInvalidArgument, "a seed frame holds only dense entries, not indices");
  ASSERT_TRUE(*writer.AddDense({"x", DType::kU8, shape, 0, 2}, Bytes{1, 2}));
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_EQ(Get(frame, 6, 2), 1u | 4u | 8u);
  FlushReader reader;
  ASSERT_TRUE(reader.Read(frame).ok());
  EXPECT_EQ(reader.header().kind, FrameKind::kSeed);
  EXPECT_TRUE(reader.header().verify_all);
}

TEST(FlushFrame, EmptyFrameEndsASync) {
  Bytes frame;
  FlushWriter writer;
  FlushHeader header;
  header.sync_id = 12;
  header.last = true;
  ASSERT_TRUE(writer.Begin(header, 80, &frame).ok());
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_EQ(frame.size(), 80u);
  FlushReader reader;
  ASSERT_TRUE(reader.Read(frame).ok());
  EXPECT_TRUE(reader.entries().empty());
  EXPECT_EQ(*PeekFlushFrameBytes(frame), 80u);
}

TEST(FlushFrame, BudgetIsNeverPassed) {
  uint64_t seed = 1;
  const Bytes values = RandomBytes(4000, 2);
  const auto shape = Shape({4000});
  for (uint64_t budget : {80ull, 200ull, 1000ull, 2500ull, 4200ull, 10000ull}) {
    Bytes frame;
    FlushWriter writer;
    ASSERT_TRUE(writer.Begin({5}, budget, &frame).ok());
    uint64_t added = 0, first = 0;
    while (first < 4000) {
      const uint64_t count = std::min<uint64_t>(4000 - first, 1 + SplitMix(seed) % 700);
      const uint64_t before = writer.frame_bytes();
      Result<bool> fit = writer.AddDense({"t", DType::kU8, shape, first, count},
                                         std::span(values).subspan(first, count));
      ASSERT_TRUE(fit.ok());
      if (!*fit) {
        EXPECT_EQ(writer.frame_bytes(), before);  // unchanged
        break;
      }
      EXPECT_LE(writer.frame_bytes(), budget);
      ++added;
      first += count;
    }
    // A digest record does not fit a full frame either.
    if (writer.frame_bytes() + 57 > budget) {
      EXPECT_FALSE(*writer.AddDigest("t", DigestBlock::Range(0, 4000), {}));
    }
    ASSERT_TRUE(writer.Finish().ok());
    EXPECT_LE(frame.size(), budget);
    FlushReader reader;
    ASSERT_TRUE(reader.Read(frame).ok());
    EXPECT_EQ(reader.entries().size(), added);
  }
}

TEST(FlushFrame, RefusedAddLeavesTheFrameAsItWas) {
  // The same frame with and without a failed attempt in the middle.
  const Bytes big = RandomBytes(5000, 3);
  const auto shape = Shape({5000});
  std::vector<uint64_t> positions(5000);
  for (uint64_t i = 0; i < 5000; ++i) positions[i] = i;
  auto build = [&](bool attempt) {
    Bytes frame;
    FlushWriter writer;
    EXPECT_TRUE(writer.Begin({5}, 600, &frame).ok());
    EXPECT_TRUE(*writer.AddDense({"a", DType::kU8, shape, 0, 100}, std::span(big).first(100)));
    if (attempt) {
      EXPECT_FALSE(
          *writer.AddDense({"a", DType::kU8, shape, 100, 4900}, std::span(big).subspan(100)));
      EXPECT_FALSE(*writer.AddSparse({"b", DType::kU8, shape, 0, 5000},
                                     Positions::Absolute(positions), big));  // compresses, then cut
      EXPECT_FALSE(writer
                       .AddIndices({"a", DType::kU8, shape, 50, 10},
                                   Positions::Absolute(std::vector<uint64_t>{55}), Bytes{1})
                       .ok());  // overlaps
    }
    EXPECT_TRUE(*writer.AddDense({"c", DType::kU8, shape, 0, 10}, std::span(big).first(10)));
    EXPECT_TRUE(writer.Finish().ok());
    return frame;
  };
  EXPECT_EQ(build(true), build(false));
}

TEST(FlushFrame, SparseDecodeLimitIsAFitNotAnError) {
  // The frame's sparse decode limit (2^30 bytes, lowered here) is a fit
  // like the budget: gap sections and values together.
  const auto shape = Shape({1000});
  std::vector<uint64_t> positions(100);
  for (uint64_t i = 0; i < 100; ++i) positions[i] = 3 * i;
  const Bytes values = RandomBytes(200, 1);
  Bytes frame;
  FlushWriter writer;
  writer.set_sparse_decoded_limit(600);
  ASSERT_TRUE(writer.Begin({5}, 1 << 20, &frame).ok());
  EXPECT_TRUE(*writer.AddSparse({"a", DType::kBF16, shape, 0, 1000}, Positions::Absolute(positions),
                                values));  // 100 + 200 bytes
  EXPECT_TRUE(*writer.AddSparse({"b", DType::kBF16, shape, 0, 1000}, Positions::Absolute(positions),
                                values));  // 600
  EXPECT_FALSE(*writer.AddSparse({"c", DType::kBF16, shape, 0, 1000},
                                 Positions::Absolute(std::span(positions).first(1)),
                                 std::span(values).first(2)));
  EXPECT_TRUE(*writer.AddSparse({"c", DType::kBF16, shape, 0, 1000}, Positions::Absolute({}), {}));
  EXPECT_EQ(writer.entry_count(), 3u);
  ASSERT_TRUE(writer.Finish().ok());
  FlushReader reader;
  EXPECT_TRUE(reader.Read(frame).ok());
}

TEST(FlushFrame, SparseRegionsCompressedAheadMakeTheSameFrame) {
  const auto shape = Shape({5000});
  std::vector<uint64_t> positions;
  for (uint64_t i = 7; i < 5000; i += 13) positions.push_back(i);
  const Bytes values = RandomBytes(positions.size() * 2, 3);
  const TensorRange a{"a", DType::kBF16, shape, 0, 5000};
  const TensorRange empty{"b", DType::kBF16, shape, 1000, 10};
  SparseEncoder encoder;
  SparseRegions ra, rb;
  ASSERT_TRUE(
      encoder.Encode(a, Positions::Absolute(positions), values, 1, kMaxSparseDecodedBytes, &ra)
          .ok());
  ASSERT_TRUE(
      encoder.Encode(empty, Positions::Absolute({}), {}, 1, kMaxSparseDecodedBytes, &rb).ok());
  FlushWriter writer;
  Bytes direct, ahead;
  ASSERT_TRUE(writer.Begin({3}, 1 << 20, &direct).ok());
  ASSERT_TRUE(*writer.AddSparse(a, Positions::Absolute(positions), values));
  ASSERT_TRUE(*writer.AddSparse(empty, Positions::Absolute({}), {}));
  ASSERT_TRUE(writer.Finish().ok());
  ASSERT_TRUE(writer.Begin({3}, 1 << 20, &ahead).ok());
  // Regions made for another range: refused, the frame as it was.
  const uint64_t before = writer.frame_bytes();
  ExpectCode(writer.AddSparseRegions({"a", DType::kBF16, shape, 0, 4999}, ra).status(),
             StatusCode::kInvalidArgument, "sparse regions made for another range");
  ExpectCode(writer.AddSparseRegions({"c", DType::kBF16, shape, 0, 5000}, ra).status(),
             StatusCode::kInvalidArgument, "sparse regions made for another range");
  EXPECT_EQ(writer.frame_bytes(), before);
  EXPECT_EQ(writer.entry_count(), 0u);
  ASSERT_TRUE(*writer.AddSparseRegions(a, ra));
  ASSERT_TRUE(*writer.AddSparseRegions(empty, rb));
  ASSERT_TRUE(writer.Finish().ok());
  EXPECT_EQ(ahead, direct);

  // A frame's decode limit is a fit for them too; the encoder refuses what
  // no frame could take, and bad positions as the writer does.
  writer.set_sparse_decoded_limit(ra.decoded - 1);
  ASSERT_TRUE(writer.Begin({4}, 1 << 20, &ahead).ok());
  EXPECT_FALSE(*writer.AddSparseRegions(a, ra));
  ExpectCode(encoder.Encode(a, Positions::Absolute(positions), values, 1, ra.decoded - 1, &rb),
             StatusCode::kOutOfRange, "sparse bytes");
  const std::vector<uint64_t> backwards = {5, 4};
  ExpectCode(
      encoder.Encode(a, Positions::Absolute(backwards), Bytes(4), 1, kMaxSparseDecodedBytes, &rb),
      StatusCode::kInvalidArgument, "sparse encoder: tensor 'a'");
  ExpectCode(
      encoder.Encode(a, Positions::Absolute(positions), Bytes(3), 1, kMaxSparseDecodedBytes, &rb),
      StatusCode::kInvalidArgument, "value bytes");
}

TEST(FlushFrame, WriterRefusesWhatTheReaderWould) {
  Bytes frame;
  FlushWriter writer;
  ExpectCode(writer.Begin({0}, 1024, &frame), StatusCode::kInvalidArgument, "sync id 0");
  FlushHeader bad_verify;
  bad_verify.sync_id = 1;
  bad_verify.verify_all = true;
  ExpectCode(writer.Begin(bad_verify, 1024, &frame), StatusCode::kInvalidArgument,
             "verify_all is only for the last frame");
  ExpectCode(writer.Begin({1}, 79, &frame), StatusCode::kInvalidArgument, "not in [80, 2^40]");
  ExpectCode(writer.Begin({1}, 1024, nullptr), StatusCode::kInvalidArgument, "no output buffer");
  ExpectCode(writer.Finish(), StatusCode::kFailedPrecondition, "no frame begun");
  ExpectCode(writer.AddDense({"x", DType::kU8, {}, 0, 1}, Bytes{1}).status(),
             StatusCode::kFailedPrecondition, "no frame begun");

  ASSERT_TRUE(writer.Begin({1}, 1 << 20, &frame).ok());
  const auto s10 = Shape({10});
  const Bytes ten(10, 1);
  const std::vector<uint64_t> p = {2, 2};
  auto invalid = [](const Result<bool>& r, const std::string& text) {
    ExpectCode(r.status(), StatusCode::kInvalidArgument, text);
  };
  invalid(writer.AddDense({"", DType::kU8, s10, 0, 10}, ten), "name of 0 bytes (1 to 1024)");
  invalid(writer.AddDense({std::string(1025, 'a'), DType::kU8, s10, 0, 10}, ten),
          "name of 1025 bytes");
  invalid(writer.AddDense({"\xff", DType::kU8, s10, 0, 10}, ten), "'\\xff': name is not UTF-8");
  const std::vector<int64_t> deep(17, 1);
  invalid(writer.AddDense({"x", DType::kU8, deep, 0, 1}, Bytes{1}), "17 dimensions");
  const auto negative = Shape({-1});
  invalid(writer.AddDense({"x", DType::kU8, negative, 0, 0}, {}), "is negative or has more");
  const auto huge = Shape({1 << 30, 1 << 30});
  invalid(writer.AddDense({"x", DType::kU8, huge, 0, 0}, {}), "more than 2^56 elements");
  invalid(writer.AddDense({"x", DType::kU8, s10, 5, 6}, Bytes(6)),
          "range [5, +6) is outside its 10 elements");
  invalid(writer.AddDense({"x", DType::kU8, s10, 0, 10}, Bytes(9)),
          "9 value bytes for 10 elements of 1 bytes");
  invalid(writer.AddIndices({"x", DType::kU8, s10, 0, 10}, Positions::Absolute(p), Bytes(2)),
          "not strictly increasing at 1 (2 after 2)");
  const std::vector<uint64_t> outside = {10};
  invalid(writer.AddSparse({"x", DType::kU8, s10, 0, 10}, Positions::Absolute(outside), Bytes(1)),
          "is not below 10");
  const std::vector<uint64_t> before = {1};
  invalid(writer.AddSparse({"x", DType::kU8, s10, 2, 8}, Positions::Absolute(before), Bytes(1)),
          "position 1 is before the range's first element 2");
  ASSERT_TRUE(*writer.AddDense({"x", DType::kU8, s10, 0, 5}, Bytes(5)));
  invalid(writer.AddDense({"x", DType::kU8, s10, 4, 2}, Bytes(2)),
          "range [4, 6) overlaps an earlier entry's");
  invalid(writer.AddDense({"x", DType::kI8, s10, 5, 5}, Bytes(5)),
          "another dtype or shape than its earlier entry");
  EXPECT_TRUE(*writer.AddDense({"x", DType::kU8, s10, 5, 5}, Bytes(5)));
  invalid(writer.AddDigest("x", DigestBlock{0, 4, 2, 4}, {}), "rows touch");
  invalid(writer.AddDigest("", DigestBlock::Range(0, 1), {}), "name of 0 bytes");
  ASSERT_TRUE(*writer.AddDigest("x", DigestBlock::Range(0, 10), {}));
  invalid(writer.AddDigest("x", DigestBlock::Range(0, 10), {3, 4}),
          "block [0, +10) already has a record in this frame");
  ASSERT_TRUE(writer.Finish().ok());
  FlushReader reader;
  EXPECT_TRUE(reader.Read(frame).ok());
}

// ---------------------------------------------------------------------------
// The reader's refusals, each with its message.

TEST(FlushFrameRejects, ShortFrames) {
  BaseFrame base;
  FlushReader reader;
  for (size_t n = 0; n < 80; ++n) {
    ExpectCode(reader.Read(std::span(base.frame).first(n)), StatusCode::kCorruption,
               "shorter than a 64-byte header and a 16-byte trailer");
  }
}

TEST(FlushFrameRejects, TruncationAtEveryLength) {
  BaseFrame base;
  FlushReader reader;
  ASSERT_TRUE(reader.Read(base.frame).ok());
  for (size_t n = 80; n < base.frame.size(); ++n) {
    ExpectCode(reader.Read(std::span(base.frame).first(n)), StatusCode::kCorruption,
               "xxh3-128 mismatch");
    EXPECT_TRUE(reader.entries().empty());
  }
}

TEST(FlushFrameRejects, ACorruptedByteAnywhere) {
  BaseFrame base;
  FlushReader reader;
  for (size_t at = 0; at < base.frame.size(); ++at) {
    for (uint8_t flip : {uint8_t{0x01}, uint8_t{0x80}}) {
      Bytes frame = base.frame;
      frame[at] ^= flip;
      ExpectCode(reader.Read(frame), StatusCode::kCorruption, "xxh3-128 mismatch");
    }
  }
  Bytes extended = base.frame;
  extended.push_back(0);
  ExpectCode(reader.Read(extended), StatusCode::kCorruption, "xxh3-128 mismatch");
}

// A checksum the caller took as the bytes came in stands for the reader's
// own: it must match the trailer, and be 16 bytes.
TEST(FlushFrameRejects, TheCallersChecksum) {
  BaseFrame base;
  FlushReader reader;
  const std::span<const uint8_t> body = std::span(base.frame).first(base.frame.size() - 16);
  std::vector<uint8_t> sum = ChecksumBytes(ChecksumAlgo::kXxh3_128, body);
  ASSERT_TRUE(reader.Read(base.frame, sum).ok());
  EXPECT_FALSE(reader.entries().empty());
  sum[3] ^= 0x10;
  ExpectCode(reader.Read(base.frame, sum), StatusCode::kCorruption, "xxh3-128 mismatch");
  EXPECT_TRUE(reader.entries().empty());
  ExpectCode(reader.Read(base.frame, std::span(sum).first(8)), StatusCode::kInvalidArgument,
             "a checksum of 8 bytes, not 16");
  // A corrupted byte the caller's checksum saw is refused as the reader's
  // own pass would refuse it.
  Bytes frame = base.frame;
  frame[70] ^= 0x01;
  ExpectCode(reader.Read(frame, ChecksumBytes(ChecksumAlgo::kXxh3_128,
                                              std::span(frame).first(frame.size() - 16))),
             StatusCode::kCorruption, "xxh3-128 mismatch");
}

TEST(FlushFrameRejects, HeaderFields) {
  BaseFrame base;
  auto with = [&](size_t at, uint64_t v, int width) {
    Bytes f = base.frame;
    Set(f, at, v, width);
    Rehash(f);
    return f;
  };
  ExpectCorrupt(with(0, 'X', 1), "bad magic 5853464c");
  {
    FlushReader reader;
    ExpectCode(reader.Read(with(4, 3, 2)), StatusCode::kUnsupported,
               "flush frame of sync 7, flush 3: protocol version 3");
    ExpectCode(reader.Read(with(4, 0, 2)), StatusCode::kUnsupported, "protocol version 0");
  }
  ExpectCorrupt(with(6, 2 | 4 | 16, 2), "unknown flags 16");
  ExpectCorrupt(with(6, 1 | 2, 2), "exactly one of seed and delta");
  ExpectCorrupt(with(6, 4, 2), "exactly one of seed and delta");
  ExpectCorrupt(with(6, 2 | 8, 2), "verify_all without last");
  ExpectCorrupt(with(8, 0, 8), "flush frame of sync 0, flush 3: sync id 0");
  ExpectCorrupt(with(28, 1, 4), "reserved header bytes are not 0");
  ExpectCorrupt(with(56, 1, 8), "reserved header bytes are not 0");
  ExpectCorrupt(with(32, base.frame.size() + 8, 8), "header says");
  const uint64_t payload = base.payload(), manifest = Get(base.frame, 48, 8);
  {
    Bytes f = base.frame;
    Set(f, 40, payload + 4, 8);
    Set(f, 48, manifest - 4, 8);
    Rehash(f);
    ExpectCorrupt(f, "is not a multiple of 8");
  }
  ExpectCorrupt(with(48, manifest + 8, 8), "do not fill the");
  ExpectCorrupt(with(20, (1u << 20) + 1, 4), "1048577 entries (at most 2^20)");
  ExpectCorrupt(with(24, (1u << 20) + 1, 4), "1048577 digest records (at most 2^20)");
  ExpectCorrupt(with(20, 1000, 4), "cannot hold 1000 entries");
}

TEST(FlushFrameRejects, EntryFields) {
  BaseFrame base;
  const uint64_t e0 = base.entry_at(0), e1 = base.entry_at(1), e3 = base.entry_at(3);
  auto with = [&](size_t at, uint64_t v, int width) {
    Bytes f = base.frame;
    Set(f, at, v, width);
    Rehash(f);
    return f;
  };
  ExpectCorrupt(with(e0, 0, 2), "entry 0: name of 0 bytes (1 to 1024)");
  ExpectCorrupt(with(e0, 1025, 2), "entry 0: name of 1025 bytes");
  ExpectCorrupt(with(e0 + 4, 17, 1), "entry 0: 17 dimensions (at most 16)");
  ExpectCorrupt(with(e3, 1000, 2), "entry 3: shape and name cut short by the manifest's end");
  ExpectCorrupt(with(e0 + 64 + 16, 0xFF, 1),
                "entry 0 ('\\xffodel.embed.weight'): name is not UTF-8");
  ExpectCorrupt(with(e0 + 6, 1, 1), "entry 0 ('model.embed.weight'): reserved bytes are not 0");
  ExpectCorrupt(with(e0 + 2, 16, 1), "entry 0 ('model.embed.weight'): unknown dtype code 16");
  ExpectCorrupt(with(e0 + 3, 3, 1), "unknown encoding 3");
  ExpectCorrupt(with(e0 + 64, (uint64_t{1} << 56) + 1, 8),
                "a dimension or the element count is past 2^56");
  {
    Bytes f = base.frame;
    Set(f, e0 + 64, uint64_t{1} << 30, 8);
    Set(f, e0 + 72, uint64_t{1} << 30, 8);
    Rehash(f);
    ExpectCorrupt(f, "a dimension or the element count is past 2^56");
  }
  ExpectCorrupt(with(e0 + 8, 1, 8), "range [1, +32) is outside its 32 elements");
  ExpectCorrupt(with(e0 + 24, 31, 8), "31 values for dense over a range of 32");
  ExpectCorrupt(with(e1 + 24, 65, 8), "65 values for indices over a range of 64");
  ExpectCorrupt(with(6, 1 | 4, 2),
                "entry 1 ('model.layers.0.w'): a seed frame holds only dense entries, not indices");
  {
    // One entry more than the manifest holds (records dropped).
    Bytes f = base.frame;
    const uint64_t records = f.size() - 16 - base.record_at();
    f.erase(f.begin() + base.record_at(), f.end() - 16);
    Set(f, 20, 5, 4);
    Set(f, 24, 0, 4);
    Set(f, 48, Get(f, 48, 8) - records, 8);
    Set(f, 32, f.size(), 8);
    Rehash(f);
    ExpectCorrupt(f, "entry 4: cut short by the manifest's end");
  }
}

TEST(FlushFrameRejects, DigestRecords) {
  BaseFrame base;
  const uint64_t r0 = base.record_at();
  auto with = [&](size_t at, uint64_t v, int width) {
    Bytes f = base.frame;
    Set(f, at, v, width);
    Rehash(f);
    return f;
  };
  ExpectCorrupt(with(r0, 0, 2), "digest record 0: name of 0 bytes");
  ExpectCorrupt(with(r0, 1025, 2), "digest record 0: name of 1025 bytes");
  ExpectCorrupt(with(r0, 18, 2), "digest record 0: name cut short by the manifest's end");
  ExpectCorrupt(with(r0 + 3, 1, 1),
                "digest record 0 ('model.norm.weight'): reserved bytes are not 0");
  ExpectCorrupt(with(r0 + 56, 0xC0, 1), "name is not UTF-8");
  ExpectCorrupt(with(r0 + 24, 0, 8),
                "digest record 0 ('model.norm.weight'): digest block [0, +16) x 0 step 0: no rows");
  ExpectCorrupt(with(r0 + 32, 16, 8), "a single row must have row stride 0");
  ExpectCorrupt(with(24, 2, 4), "digest record 1: cut short by the manifest's end");
  {
    Bytes f = base.frame;
    f.insert(f.end() - 16, 8, 0);
    Set(f, 48, Get(f, 48, 8) + 8, 8);
    Set(f, 32, f.size(), 8);
    Rehash(f);
    ExpectCorrupt(f, "the manifest holds 8 bytes after its last record");
  }
}

TEST(FlushFrameRejects, Regions) {
  BaseFrame base;
  const uint64_t e1 = base.entry_at(1), e2 = base.entry_at(2), e3 = base.entry_at(3);
  auto with = [&](size_t at, uint64_t v, int width) {
    Bytes f = base.frame;
    Set(f, at, v, width);
    Rehash(f);
    return f;
  };
  const uint64_t pos1 = Get(base.frame, e1 + 32, 8);
  ExpectCorrupt(with(e1 + 32, pos1 + 8, 8), "entry 1 ('model.layers.0.w'): positions at offset");
  ExpectCorrupt(with(e1 + 40, 8, 8), "entry 1 ('model.layers.0.w'): positions of 8 bytes, not 9");
  ExpectCorrupt(with(e1 + 56, 16, 8), "values of 16 bytes, not 12");
  ExpectCorrupt(with(e2 + 56, uint64_t{1} << 40, 8), "run past the payload's end");
  // Entry 1's 9 position bytes (u24) are padded to 16 before its values.
  ExpectCorrupt(with(pos1 + 13, 1, 1),
                "entry 1 ('model.layers.0.w'): padding before its values is not 0");
  // Entry 3's three values end the payload, padded to 8.
  const uint64_t val3 = Get(base.frame, e3 + 48, 8);
  ASSERT_EQ((val3 + 3) % 8, 3u);
  ExpectCorrupt(with(val3 + 3, 1, 1), "the payload's padding is not 0");
  {
    Bytes f = base.frame;
    const uint64_t payload_end = 64 + base.payload();
    f.insert(f.begin() + payload_end, 8, 0);
    Set(f, 40, base.payload() + 8, 8);
    Set(f, 32, f.size(), 8);
    Rehash(f);
    ExpectCorrupt(f, "bytes after its last entry's values");
  }
}

TEST(FlushFrameRejects, IndicesPositions) {
  BaseFrame base;
  const uint64_t pos1 = Get(base.frame, base.entry_at(1) + 32, 8);
  auto with = [&](size_t at, uint64_t v, int width) {
    Bytes f = base.frame;
    Set(f, at, v, width);
    Rehash(f);
    return f;
  };
  // u24 positions (a tensor of 64 elements): unsigned, never negative.
  ExpectCorrupt(with(pos1 + 3, 1, 3),
                "entry 1 ('model.layers.0.w'): positions not strictly increasing at 1 (1 after 1)");
  ExpectCorrupt(with(pos1 + 6, 64, 3), "position 2 (64) is outside the range [0, 64)");
  ExpectCorrupt(with(pos1, 0xFFFFFF, 3), "position 0 (16777215) is outside the range [0, 64)");
  // In a range that does not start at 0, a position before it.
  RawFrame raw;
  raw.entries.push_back({"x", 1, 1, {100}, 10, 20, 2, Le({5, 12}, 3), {1, 2}});
  ExpectCorrupt(raw.Build(), "position 0 (5) is outside the range [10, 30)");
  // An older sender's frame: i32 positions in the same tensor, where a
  // negative one is out of range.
  raw.version = 1;
  raw.entries[0].positions = Le({static_cast<uint64_t>(-3), 12}, 4);
  ExpectCorrupt(raw.Build(), "position 0 (-3) is outside");
  raw.entries[0].positions = Le({11, 12}, 4);
  EXPECT_TRUE(FlushReader().Read(raw.Build()).ok());
  raw.version = 2;
  // int64 positions of a tensor of 2^31 elements.
  raw.entries[0] = {"x", 1, 1, {uint64_t{1} << 31}, 10, 20, 2, Le({~uint64_t{0}, 12}, 8), {1, 2}};
  ExpectCorrupt(raw.Build(), "position 0 (-1) is outside");
  raw.entries[0].positions = Le({11, 12}, 8);
  FlushReader reader;
  EXPECT_TRUE(reader.Read(raw.Build()).ok());
}

TEST(FlushFrameRejects, SparseRegions) {
  // One F32 sparse entry of n = 3 over [0, 100).
  auto frame = [](Bytes positions, Bytes values, uint64_t n = 3, uint64_t numel = 100) {
    RawFrame raw;
    raw.entries.push_back(
        {"s", 11, 2, {numel}, 0, numel, n, std::move(positions), std::move(values)});
    return raw.Build();
  };
  const Bytes gaps = {0, 2, 11}, planes = RandomBytes(12, 4);
  FlushReader reader;
  ASSERT_TRUE(reader.Read(frame(Zstd(gaps), Zstd(planes))).ok());
  EXPECT_EQ(EntryPositions(reader.entries()[0]), (std::vector<uint64_t>{0, 3, 15}));

  ExpectCorrupt(frame(Bytes{1, 2, 3, 4}, Zstd(planes)),
                "entry 0 ('s'): positions is not a zstd frame");
  Bytes trailing = Zstd(gaps);
  trailing.push_back(0);
  ExpectCorrupt(frame(trailing, Zstd(planes)), "positions holds 1 bytes after its zstd frame");
  ExpectCorrupt(frame(Zstd(gaps, false), Zstd(planes)),
                "positions zstd frame does not record its content size");
  ExpectCorrupt(frame(Zstd({0, 2}), Zstd(planes)),
                "positions zstd frame records 2 content bytes, not in [3, 27]");
  ExpectCorrupt(frame(Zstd(gaps), Zstd(RandomBytes(11, 4))),
                "values zstd frame records 11 content bytes, not in [12, 12]");
  ExpectCorrupt(frame(Bytes(gaps.begin(), gaps.end()), Zstd(planes)),
                "positions is not a zstd frame");
  ExpectCorrupt(frame(RleZstd(3, 0, 4), Zstd(planes)),
                "positions do not decompress to their recorded 4 bytes");
  // Gap sections.
  ExpectCorrupt(frame(Zstd({0, 0xFF, 5}), Zstd(planes), 3, 1000),
                "gap section ends after 2 of 3 gaps");
  ExpectCorrupt(frame(Zstd({0, 0, 0, 0}), Zstd(planes)),
                "gap section holds 1 bytes after its 3 gaps");
  ExpectCorrupt(frame(Zstd({0, 0xFF, 0x80, 0x00}), Zstd(planes)), "gap 1 is not minimal LEB128");
  ExpectCorrupt(frame(Zstd({0, 0, 0xFF, 0x80}), Zstd(planes)), "gap 2 is cut short");
  ExpectCorrupt(
      frame(Zstd({0, 0xFF, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}), Zstd(planes)),
      "gap 1 does not fit 56 bits");
  ExpectCorrupt(frame(Zstd({0, 2, 96}), Zstd(planes)),
                "position 2 (gap 96) is past the range's end 100");
  EXPECT_TRUE(reader.Read(frame(Zstd({0, 2, 95}), Zstd(planes))).ok());  // position 99
  ExpectCorrupt(frame(Zstd({0xFF, 0x00, 0, 0}), Zstd(planes)),
                "position 0 (gap 255) is past the range's end 100");
  // n = 0 has no regions.
  ExpectCorrupt(frame(Zstd(gaps), {}, 0), "positions of ");
  EXPECT_TRUE(reader.Read(frame({}, {}, 0)).ok());
}

TEST(FlushFrameRejects, SparseDecodeLimit) {
  // Two U8 entries whose recorded sizes add up past 2^30, in a few KB of
  // RLE blocks: refused before anything is decompressed.
  const uint64_t n = uint64_t{1} << 28;
  RawFrame raw;
  raw.entries.push_back({"a", 1, 2, {n}, 0, n, n, RleZstd(n, 0), RleZstd(n, 1)});
  raw.entries.push_back({"b", 1, 2, {n}, 0, n, n, RleZstd(n, 0), RleZstd(n, 1)});
  raw.entries.push_back({"c", 1, 2, {n}, 0, n, n, RleZstd(n, 0), RleZstd(n, 1)});
  ExpectCorrupt(raw.Build(), "entry 2 ('c'): sparse entries decompress to more than 2^30 bytes");
}

TEST(FlushFrameRejects, OneTensorsEntriesAndRecords) {
  RawFrame raw;
  raw.entries.push_back({"x", 1, 0, {30}, 0, 10, 10, {}, Bytes(10)});
  raw.entries.push_back({"y", 1, 0, {30}, 0, 10, 10, {}, Bytes(10)});
  raw.entries.push_back({"x", 1, 0, {30}, 5, 10, 10, {}, Bytes(10)});
  ExpectCorrupt(raw.Build(), "entries 0 and 2 ('x'): ranges [0, 10) and [5, 15) overlap");
  raw.entries[2].first = 10;
  FlushReader reader;
  EXPECT_TRUE(reader.Read(raw.Build()).ok());
  raw.entries[2].dtype_code = 2;
  ExpectCorrupt(raw.Build(), "entries 0 and 2 ('x'): different dtypes or shapes for one tensor");
  raw.entries[2].dtype_code = 1;
  raw.entries[2].shape = {3, 10};
  ExpectCorrupt(raw.Build(), "different dtypes or shapes");
  raw.entries[2].shape = {30};
  raw.digests.push_back({"x", 0, 30, 1, 0, 1, 1});
  raw.digests.push_back({"x", 0, 3, 10, 4, 1, 1});
  raw.digests.push_back({"x", 0, 30, 1, 0, 2, 2});
  ExpectCorrupt(raw.Build(), "digest records 0 and 2 ('x'): both for block [0, +30)");
}

TEST(FlushFrame, PeekFrameBytes) {
  BaseFrame base;
  EXPECT_EQ(*PeekFlushFrameBytes(std::span(base.frame).first(64)), base.frame.size());
  ExpectCode(PeekFlushFrameBytes(std::span(base.frame).first(63)).status(), StatusCode::kCorruption,
             "flush frame header of 63 bytes: shorter than 64");
  Bytes f = base.frame;
  f[1] = 'X';
  ExpectCode(PeekFlushFrameBytes(f).status(), StatusCode::kCorruption, "bad magic");
  f = base.frame;
  Set(f, 4, 9, 2);
  ExpectCode(PeekFlushFrameBytes(f).status(), StatusCode::kUnsupported, "protocol version 9");
  Set(f, 4, 1, 2);
  Set(f, 32, (uint64_t{1} << 40) + 1, 8);
  ExpectCode(PeekFlushFrameBytes(f).status(), StatusCode::kCorruption, "is not in [80, 2^40]");
  Set(f, 32, 79, 8);
  ExpectCode(PeekFlushFrameBytes(f).status(), StatusCode::kCorruption, "is not in [80, 2^40]");
}

// ---------------------------------------------------------------------------
// Destinations.

// One entry of `dtype` over the whole of a tensor of `shape`, read back.
struct OneEntry {
  Bytes frame;
  FlushReader reader;
  const FlushEntry& entry() const { return reader.entries()[0]; }
};

void MakeEntry(OneEntry* out, DType dtype, const std::vector<int64_t>& shape, WireEncoding encoding,
               const std::vector<uint64_t>& positions, const Bytes& values) {
  FlushWriter writer;
  ASSERT_TRUE(writer.Begin({1}, 1 << 20, &out->frame).ok());
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
  const TensorRange range{"t", dtype, shape, 0, numel};
  Result<bool> r = encoding == WireEncoding::kDense ? writer.AddDense(range, values)
                   : encoding == WireEncoding::kIndices
                       ? writer.AddIndices(range, Positions::Absolute(positions), values)
                       : writer.AddSparse(range, Positions::Absolute(positions), values);
  ASSERT_TRUE(r.ok() && *r);
  ASSERT_TRUE(writer.Finish().ok());
  ASSERT_TRUE(out->reader.Read(out->frame).ok());
}

TEST(Destination, SlicesAndFusedParts) {
  // A [8, 16] F32 weight; a dense entry and a sparse one with every 3rd
  // element. Receivers hold rows 2..5, columns 4..11, or the whole tensor
  // as the second part of a fused buffer; each must end up with exactly its
  // part of the new tensor, and nothing else written.
  const uint64_t rows = 8, cols = 16, numel = rows * cols, w = 4;
  const Bytes full = RandomBytes(numel * w, 21);
  std::vector<uint64_t> every3;
  Bytes every3_values;
  for (uint64_t i = 0; i < numel; i += 3) {
    every3.push_back(i);
    every3_values.insert(every3_values.end(), &full[i * w], &full[i * w] + w);
  }
  for (WireEncoding encoding : {WireEncoding::kDense, WireEncoding::kSparse}) {
    OneEntry e;
    const bool dense = encoding == WireEncoding::kDense;
    MakeEntry(&e, DType::kF32, {8, 16}, encoding, every3, dense ? full : every3_values);
    const std::vector<uint64_t>& changed = every3;
    auto is_changed = [&](uint64_t i) {
      return dense || std::binary_search(changed.begin(), changed.end(), i);
    };

    struct Receiver {
      std::string what;
      DestinationMap map;
      uint64_t dest_elems;
      std::vector<std::pair<uint64_t, uint64_t>> layout;  // (hf index, dest index)
    };
    std::vector<Receiver> receivers;
    {
      Receiver r{"rows 2..5",
                 *DestinationMap::FromBlock(numel, DigestBlock::Range(2 * cols, 4 * cols), 0, 0),
                 4 * cols,
                 {}};
      for (uint64_t i = 2 * cols; i < 6 * cols; ++i) r.layout.push_back({i, i - 2 * cols});
      receivers.push_back(std::move(r));
    }
    {
      Receiver r{"columns 4..11",
                 *DestinationMap::FromBlock(numel, {4, 8, rows, cols}, 0, 8),
                 rows * 8,
                 {}};
      for (uint64_t row = 0; row < rows; ++row) {
        for (uint64_t c = 4; c < 12; ++c) r.layout.push_back({row * cols + c, row * 8 + c - 4});
      }
      receivers.push_back(std::move(r));
    }
    {
      // The tensor is k of a fused qkv buffer of 3 * numel, at numel.
      Receiver r{
          "fused part", *DestinationMap::Create(numel, {{0, numel, numel, 1}}), 3 * numel, {}};
      for (uint64_t i = 0; i < numel; ++i) r.layout.push_back({i, numel + i});
      receivers.push_back(std::move(r));
    }
    {
      // Interleaved with another tensor: element i at 2 * i + 1.
      Receiver r{"interleaved", *DestinationMap::Create(numel, {{0, numel, 1, 2}}), 2 * numel, {}};
      for (uint64_t i = 0; i < numel; ++i) r.layout.push_back({i, 2 * i + 1});
      receivers.push_back(std::move(r));
    }
    for (Receiver& r : receivers) {
      Bytes dest = RandomBytes(r.dest_elems * w, 5);
      Bytes want = dest;
      uint64_t want_written = 0;
      for (auto [i, d] : r.layout) {
        if (!is_changed(i)) continue;
        std::memcpy(&want[d * w], &full[i * w], w);
        ++want_written;
      }
      Result<StateDigest> before = DigestDestination(r.map, dest, w);
      ASSERT_TRUE(before.ok()) << before.status().ToString();
      StateDigest running = *before;
      Result<uint64_t> written = ApplyEntry(e.entry(), r.map, dest, &running);
      ASSERT_TRUE(written.ok()) << written.status().ToString();
      EXPECT_EQ(*written, want_written) << r.what;
      EXPECT_EQ(dest, want) << r.what << " " << WireEncodingName(encoding);
      EXPECT_EQ(running, *DigestDestination(r.map, dest, w)) << r.what;
      // The held elements' digest is the one the sender computes from the
      // whole tensor for the receiver's block.
      if (dense) {
        const std::optional<DigestBlock> block = r.map.AsBlock();
        ASSERT_TRUE(block.has_value()) << r.what;
        EXPECT_EQ(running, *ComputeBlockPartDigest(full, w, 0, *block)) << r.what;
      }
    }
  }
}

TEST(Destination, EveryBitPatternIsAValue) {
  // NaNs with payloads, -0.0, infinities, denormals: byte copies.
  const Bytes f32 = Le({0x7FC00001, 0xFFC00000, 0x80000000, 0x7F800000, 0x00000001, 0x7FBFFFFF}, 4);
  const Bytes bf16 = Le({0x7FC1, 0xFF81, 0x8000, 0x0001}, 2);
  for (WireEncoding encoding :
       {WireEncoding::kDense, WireEncoding::kIndices, WireEncoding::kSparse}) {
    for (const auto& [dtype, values] :
         {std::pair{DType::kF32, f32}, std::pair{DType::kBF16, bf16}}) {
      const uint32_t w = static_cast<uint32_t>(DTypeSize(dtype));
      const uint64_t n = values.size() / w;
      std::vector<uint64_t> positions(n);
      for (uint64_t k = 0; k < n; ++k) positions[k] = k;
      OneEntry e;
      MakeEntry(&e, dtype, {static_cast<int64_t>(n)}, encoding, positions, values);
      Bytes dest(values.size(), 0);
      ASSERT_TRUE(ApplyEntry(e.entry(), DestinationMap::Whole(n), dest).ok());
      EXPECT_EQ(dest, values);
    }
  }
}

TEST(Destination, MapRules) {
  auto invalid = [](const Result<DestinationMap>& r, const std::string& text) {
    ExpectCode(r.status(), StatusCode::kInvalidArgument, text);
  };
  invalid(DestinationMap::Create(10, {{0, 0, 0, 1}}), "run [0, +0) -> 0 step 1: no elements");
  invalid(DestinationMap::Create(10, {{0, 2, 0, 0}}), "stride 0");
  invalid(DestinationMap::Create(10, {{5, 6, 0, 1}}), "outside the tensor's 10 elements");
  invalid(DestinationMap::Create(10, {{4, 3, 0, 1}, {0, 5, 10, 1}}),
          "run [4, +3) -> 0 step 1: overlaps the run before it");
  invalid(DestinationMap::Create(10, {{0, 3, ~uint64_t{0} - 1, 1}}),
          "destination elements past 2^64");
  invalid(DestinationMap::Create(kMaxStreamNumel + 1, {}), "past 2^56");
  invalid(DestinationMap::FromBlock(100, {0, 4, 2, 10}, 0, 3),
          "destination rows of 3 elements are shorter than the block's 4");
  invalid(DestinationMap::FromBlock(100, {95, 10, 1, 0}, 0, 0),
          "is outside the tensor's 100 elements");
  invalid(DestinationMap::FromBlock(100, {0, 4, 2, 4}, 0, 4), "rows touch");

  Result<DestinationMap> m = DestinationMap::Create(100, {{50, 10, 0, 1}, {0, 10, 10, 3}});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->runs()[0].hf_first, 0u);  // sorted
  EXPECT_EQ(m->held(), 20u);
  EXPECT_EQ(m->dest_extent(), 10u + 9 * 3 + 1);
  EXPECT_EQ(m->AsBlock(), (DigestBlock{0, 10, 2, 50}));

  EXPECT_EQ(DestinationMap::Whole(7).AsBlock(), DigestBlock::Range(0, 7));
  EXPECT_EQ(DestinationMap::Whole(0).AsBlock(), DigestBlock{});
  EXPECT_EQ(DestinationMap::FromBlock(100, {3, 4, 5, 10}, 0, 4)->AsBlock(),
            (DigestBlock{3, 4, 5, 10}));
  // Rows that touch are one range.
  EXPECT_EQ(DestinationMap::Create(100, {{0, 10, 0, 1}, {10, 10, 50, 1}})->AsBlock(),
            DigestBlock::Range(0, 20));
  EXPECT_FALSE(DestinationMap::Create(100, {{0, 10, 0, 1}, {20, 5, 50, 1}})->AsBlock().has_value());
}

TEST(Destination, ApplyRefusesAMapThatDoesNotFit) {
  OneEntry e;
  MakeEntry(&e, DType::kBF16, {10}, WireEncoding::kDense, {}, Bytes(20, 1));
  Bytes dest(20, 0);
  ExpectCode(ApplyEntry(e.entry(), DestinationMap::Whole(11), dest).status(),
             StatusCode::kInvalidArgument,
             "apply: tensor 't' has 10 elements, its destination map 11");
  ExpectCode(ApplyEntry(e.entry(), DestinationMap::Whole(10), std::span(dest).first(19)).status(),
             StatusCode::kInvalidArgument,
             "destination of 19 bytes, its map needs 10 elements of 2");
  EXPECT_EQ(dest, Bytes(20, 0));  // nothing written
  ExpectCode(DigestDestination(DestinationMap::Whole(10), std::span(dest).first(19), 2).status(),
             StatusCode::kInvalidArgument, "destination of 19 bytes");
}

// A frame of 2,000 small tensors and a large one, entries of every
// encoding, the large tensor's two entries apart in it: the changes it
// carries, made independently of the writer and the apply.
struct ManyTensors {
  static constexpr int kSmall = 2000;
  static constexpr int kBig = 500;  // the large tensor's place among them
  static constexpr uint64_t kSmallNumel = 300, kBigNumel = 200000;
  std::vector<std::string> names;
  std::vector<uint64_t> numel;
  std::vector<Bytes> before, after;  // per tensor
  std::vector<size_t> tensor_of;     // per entry
  std::vector<uint64_t> writes;      // per entry: the elements it carries
  Bytes frame;
  FlushReader reader;

  ManyTensors() {
    uint64_t seed = 17;
    FlushWriter writer;
    EXPECT_TRUE(writer.Begin({1}, uint64_t{1} << 26, &frame).ok());
    for (int i = 0; i <= kSmall; ++i) {
      const bool big = i == kBig;
      const uint64_t n = big ? kBigNumel : kSmallNumel;
      const size_t t = names.size();
      names.push_back(big ? "model.embed.weight"
                          : "model.layers." + std::to_string(i / 64) + ".experts." +
                                std::to_string(i % 64) + ".w");
      numel.push_back(n);
      before.push_back(RandomBytes(n * 2, SplitMix(seed)));
      after.push_back(before.back());
      std::vector<uint64_t> changed;
      for (uint64_t p = 0; p < n; ++p) {
        if (SplitMix(seed) % 100 >= 5) continue;
        changed.push_back(p);
        after[t][2 * p] ^= static_cast<uint8_t>(SplitMix(seed) | 1);
      }
      const std::vector<int64_t> shape = {static_cast<int64_t>(n)};
      // [first, end) as dense (0), indices (1) or sparse (2).
      const auto add = [&](uint64_t first, uint64_t end, int encoding) {
        const TensorRange range{names[t], DType::kBF16, shape, first, end - first};
        std::vector<uint64_t> at;
        for (uint64_t p : changed) {
          if (p >= first && p < end) at.push_back(p);
        }
        Bytes values;
        for (uint64_t p : at) values.insert(values.end(), &after[t][2 * p], &after[t][2 * p] + 2);
        Result<bool> added =
            encoding == 0
                ? writer.AddDense(range, std::span(after[t]).subspan(2 * first, 2 * (end - first)))
            : encoding == 1 ? writer.AddIndices(range, Positions::Absolute(at), values)
                            : writer.AddSparse(range, Positions::Absolute(at), values);
        EXPECT_TRUE(added.ok() && *added) << names[t];
        tensor_of.push_back(t);
        writes.push_back(encoding == 0 ? end - first : at.size());
      };
      if (big) {
        add(0, n / 2, 0);
        add(n / 2, n, 1);
      } else {
        add(0, n, i % 3);
      }
    }
    EXPECT_TRUE(writer.Finish().ok());
    const Status read = reader.Read(frame);
    EXPECT_TRUE(read.ok()) << read.ToString();
  }
  uint64_t WrittenBefore(size_t entries) const {
    uint64_t sum = 0;
    for (size_t k = 0; k < entries; ++k) sum += writes[k];
    return sum;
  }
};

TEST(Destination, ApplyEntriesInTasksIsEveryEntryApplied) {
  const ManyTensors m;
  ASSERT_EQ(m.reader.entries().size(), m.tensor_of.size());
  std::vector<DestinationMap> maps;
  for (uint64_t n : m.numel) maps.push_back(DestinationMap::Whole(n));
  ThreadPool pool(3);
  for (ThreadPool* threads : {static_cast<ThreadPool*>(nullptr), &pool}) {
    for (bool digest : {true, false}) {
      std::vector<Bytes> dest = m.before;
      std::vector<EntryDestination> dests;
      for (size_t t : m.tensor_of) dests.push_back({&maps[t], dest[t]});
      std::vector<StateDigest> moves;
      const AppliedEntries done =
          ApplyEntries(m.reader.entries(), dests, threads, digest ? &moves : nullptr);
      ASSERT_TRUE(done.failed.ok()) << done.failed.ToString();
      EXPECT_EQ(done.applied, m.tensor_of.size());
      EXPECT_EQ(done.written, m.WrittenBefore(m.tensor_of.size()));
      for (size_t t = 0; t < dest.size(); ++t) ASSERT_EQ(dest[t], m.after[t]) << m.names[t];
      if (!digest) {
        EXPECT_TRUE(moves.empty());
        continue;
      }
      // Each tensor's moves add up to its digest's change.
      ASSERT_EQ(moves.size(), m.tensor_of.size());
      std::vector<StateDigest> moved(dest.size());
      for (size_t k = 0; k < moves.size(); ++k) moved[m.tensor_of[k]] += moves[k];
      for (size_t t = 0; t < dest.size(); ++t) {
        EXPECT_EQ(moved[t],
                  *ComputeStateDigest(m.after[t], 2, 0) - *ComputeStateDigest(m.before[t], 2, 0))
            << m.names[t];
      }
    }
  }
}

TEST(Destination, ApplyEntriesReportsTheFirstEntryThatFails) {
  const ManyTensors m;
  const size_t n = m.tensor_of.size();
  std::vector<DestinationMap> maps;
  for (uint64_t numel : m.numel) maps.push_back(DestinationMap::Whole(numel));
  // Two entries in the middle, in different tasks, whose maps are for
  // another element count: ApplyEntry refuses them before writing.
  const size_t first_bad = 1201, second_bad = 1700;
  ASSERT_GT(m.tensor_of[first_bad], static_cast<size_t>(ManyTensors::kBig));
  const DestinationMap wrong = DestinationMap::Whole(ManyTensors::kSmallNumel + 1);
  ThreadPool pool(3);
  for (ThreadPool* threads : {static_cast<ThreadPool*>(nullptr), &pool}) {
    std::vector<Bytes> dest = m.before;
    std::vector<EntryDestination> dests;
    for (size_t t : m.tensor_of) dests.push_back({&maps[t], dest[t]});
    dests[first_bad].map = &wrong;
    dests[second_bad].map = &wrong;
    std::vector<StateDigest> moves;
    const AppliedEntries done = ApplyEntries(m.reader.entries(), dests, threads, &moves);
    EXPECT_EQ(done.applied, first_bad);
    ExpectCode(done.failed, StatusCode::kInvalidArgument,
               "apply: tensor '" + m.names[m.tensor_of[first_bad]] +
                   "' has 300 elements, its destination map 301");
    EXPECT_EQ(done.written, m.WrittenBefore(first_bad));
    // Every other entry was applied, with its digest move; the two wrote
    // nothing.
    std::vector<StateDigest> moved(m.names.size());
    for (size_t k = 0; k < n; ++k) {
      const size_t t = m.tensor_of[k];
      const bool refused = k == first_bad || k == second_bad;
      ASSERT_EQ(dest[t], refused ? m.before[t] : m.after[t]) << m.names[t];
      moved[t] += moves[k];
    }
    for (size_t t = 0; t < m.names.size(); ++t) {
      const Bytes& now = dest[t];
      EXPECT_EQ(moved[t], *ComputeStateDigest(now, 2, 0) - *ComputeStateDigest(m.before[t], 2, 0))
          << m.names[t];
    }
  }
  // Destinations that do not match the entries are refused whole.
  std::vector<EntryDestination> none;
  const AppliedEntries refused = ApplyEntries(m.reader.entries(), none, &pool, nullptr);
  EXPECT_EQ(refused.applied, 0u);
  ExpectCode(refused.failed, StatusCode::kInvalidArgument, "0 destinations for 2002 entries");
}

// A frame of one large dense entry (a seed's) is cut into pieces across the
// threads: the same bytes and digest move as one thread, through a map of
// many runs (a partial receiver's rows, placed in another order), and a
// refused entry writes none of its pieces.
TEST(Destination, ApplyEntriesCutsALargeDenseEntryAcrossTheThreads) {
  constexpr uint64_t kRows = 64, kCols = 4099, kNumel = kRows * kCols;
  uint64_t seed = 5;
  const Bytes before = RandomBytes(kNumel * 2, SplitMix(seed));
  const Bytes after = RandomBytes(kNumel * 2, SplitMix(seed));
  Bytes frame;
  FlushWriter writer;
  ASSERT_TRUE(writer.Begin({1}, uint64_t{1} << 22, &frame).ok());
  const uint64_t first = 3 * kCols + 17, count = kNumel - first - 100;
  const std::vector<int64_t> shape = {int64_t{kRows}, int64_t{kCols}};
  const TensorRange range{"w", DType::kBF16, shape, first, count};
  Result<bool> added = writer.AddDense(range, std::span(after).subspan(2 * first, 2 * count));
  ASSERT_TRUE(added.ok() && *added);
  ASSERT_TRUE(writer.Finish().ok());
  FlushReader reader;
  ASSERT_TRUE(reader.Read(frame).ok());
  ASSERT_EQ(reader.entries().size(), 1u);
  // Every odd row, placed in reverse order in a destination of half the rows.
  std::vector<DestinationRun> runs;
  for (uint64_t r = 1; r < kRows; r += 2)
    runs.push_back({r * kCols, kCols, (kRows - r) / 2 * kCols, 1});
  const Result<DestinationMap> map = DestinationMap::Create(kNumel, runs);
  ASSERT_TRUE(map.ok());
  const auto place = [&](const Bytes& full) {
    Bytes out(kNumel, 0);  // kRows / 2 rows of 2-byte elements
    for (const DestinationRun& r : runs) {
      std::memcpy(&out[2 * r.dest_offset], &full[2 * r.hf_first], 2 * r.count);
    }
    return out;
  };
  Bytes expect = place(before);
  uint64_t held = 0;  // the entry's elements the map holds
  for (const DestinationRun& r : runs) {
    const uint64_t lo = std::max(first, r.hf_first),
                   hi = std::min(first + count, r.hf_first + r.count);
    if (lo >= hi) continue;
    std::memcpy(&expect[2 * (r.dest_offset + lo - r.hf_first)], &after[2 * lo], 2 * (hi - lo));
    held += hi - lo;
  }
  ASSERT_GT(held, 0u);
  ThreadPool pool(3);
  std::vector<StateDigest> one_thread;
  for (ThreadPool* threads : {static_cast<ThreadPool*>(nullptr), &pool}) {
    Bytes dest = place(before);
    const EntryDestination to{&*map, dest};
    std::vector<StateDigest> moves;
    const AppliedEntries done = ApplyEntries(reader.entries(), {&to, 1}, threads, &moves);
    ASSERT_TRUE(done.failed.ok()) << done.failed.ToString();
    EXPECT_EQ(done.applied, 1u);
    EXPECT_EQ(done.written, held);
    EXPECT_EQ(dest, expect);
    ASSERT_EQ(moves.size(), 1u);
    EXPECT_EQ(moves[0],
              *DigestDestination(*map, expect, 2) - *DigestDestination(*map, place(before), 2));
    if (threads == nullptr) {
      one_thread = moves;
    } else {
      EXPECT_EQ(moves, one_thread);
    }
  }
  // A map for another element count: every piece refused, nothing written.
  const DestinationMap wrong = DestinationMap::Whole(kNumel + 1);
  Bytes dest = place(before);
  const EntryDestination to{&wrong, dest};
  const AppliedEntries refused = ApplyEntries(reader.entries(), {&to, 1}, &pool, nullptr);
  EXPECT_EQ(refused.applied, 0u);
  EXPECT_EQ(refused.written, 0u);
  ExpectCode(refused.failed, StatusCode::kInvalidArgument, "its destination map");
  EXPECT_EQ(dest, place(before));
}

// ---------------------------------------------------------------------------
// The fuzz target's seed corpus (fuzz/corpus/flush_frame): frames from the
// writer, behind the target's mode byte (0: as is; 1: the target rewrites
// the trailer, so mutations reach the fields). DS_WRITE_FLUSH_CORPUS=1
// rewrites them; the test checks that every seed is a frame the reader
// accepts.
std::map<std::string, Bytes> CorpusSeeds() {
  std::map<std::string, Bytes> seeds;
  BaseFrame base;
  seeds["every_encoding"] = base.frame;
  {
    Bytes f;
    FlushWriter writer;
    FlushHeader h;
    h.sync_id = 1;
    h.kind = FrameKind::kSeed;
    h.last = true;
    h.verify_all = true;
    EXPECT_TRUE(writer.Begin(h, 4096, &f).ok());
    const auto shape = Shape({3, 5});
    EXPECT_TRUE(*writer.AddDense({"a", DType::kF16, shape, 0, 15}, RandomBytes(30, 8)));
    EXPECT_TRUE(*writer.AddDigest("a", DigestBlock{1, 2, 3, 5}, {5, 6}));
    EXPECT_TRUE(writer.Finish().ok());
    seeds["seed_verify_all"] = f;
  }
  {
    Bytes f;
    FlushWriter writer;
    EXPECT_TRUE(writer.Begin({2, 1}, 4096, &f).ok());
    const auto shape = Shape({1 << 16, 1 << 16});
    const uint64_t end = uint64_t{1} << 32;
    const std::vector<uint64_t> positions = {end - 700, end - 3, end - 1};
    EXPECT_TRUE(*writer.AddIndices({"wide", DType::kI64, shape, end - 1000, 1000},
                                   Positions::Absolute(positions), RandomBytes(24, 9)));
    EXPECT_TRUE(*writer.AddSparse({"wide_sparse", DType::kU8, shape, end - 1000, 1000},
                                  Positions::Absolute(positions), Bytes{1, 2, 3}));
    EXPECT_TRUE(writer.Finish().ok());
    seeds["wide_positions"] = f;
  }
  {
    Bytes f;
    FlushWriter writer;
    FlushHeader h;
    h.sync_id = 99;
    h.last = true;
    EXPECT_TRUE(writer.Begin(h, 80, &f).ok());
    EXPECT_TRUE(writer.Finish().ok());
    seeds["empty_last"] = f;
  }
  return seeds;
}

TEST(FlushFrameCorpus, SeedsAreFramesTheReaderAccepts) {
  const std::filesystem::path dir =
      std::filesystem::path(DS_SOURCE_DIR) / "fuzz/corpus/flush_frame";
  const char* write = std::getenv("DS_WRITE_FLUSH_CORPUS");
  if (write != nullptr && std::string(write) == "1") {
    std::filesystem::create_directories(dir);
    for (const auto& [name, frame] : CorpusSeeds()) {
      for (uint8_t mode : {0, 1}) {
        std::ofstream out(dir / (name + (mode ? "_rehashed" : "")), std::ios::binary);
        out.put(static_cast<char>(mode));
        out.write(reinterpret_cast<const char*>(frame.data()),
                  static_cast<std::streamsize>(frame.size()));
      }
    }
  }
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " does not exist";
  size_t seen = 0;
  FlushReader reader;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    const Bytes bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_FALSE(bytes.empty()) << e.path();
    // The first byte is the fuzz target's mode: bit 0 set, the trailer is
    // rewritten with the checksum of what precedes it (an input the fuzzer
    // kept can be one of these).
    Bytes frame(bytes.begin() + 1, bytes.end());
    if ((bytes[0] & 1) != 0) {
      ResealFlushFrame(frame);
    }
    EXPECT_TRUE(reader.Read(frame).ok()) << e.path();
    ++seen;
  }
  EXPECT_GE(seen, 9u);
}

// A version 1 frame (an older sender's: i32 positions in a small tensor)
// is still read, as written; the same bytes called version 2 are refused,
// since their positions region has the size of i32 ones, not u24 ones.
TEST(FlushFrameCorpus, VersionOneFramesAreStillRead) {
  const std::filesystem::path path =
      std::filesystem::path(DS_SOURCE_DIR) / "fuzz/corpus/flush_frame/every_encoding_v1";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const Bytes seed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(seed.size(), 1u);
  const Bytes v1(seed.begin() + 1, seed.end());
  ASSERT_EQ(Get(v1, 4, 2), 1u);
  FlushReader reader;
  ASSERT_TRUE(reader.Read(v1).ok()) << reader.Read(v1).ToString();
  const BaseFrame base;  // the frame the seed was written as, at version 1
  ASSERT_EQ(reader.entries().size(), 4u);
  const FlushEntry& e1 = reader.entries()[1];
  EXPECT_EQ(e1.position_width, 4u);
  EXPECT_EQ(EntryPositions(e1), base.w_positions);
  EXPECT_EQ(Bytes(e1.values.begin(), e1.values.end()), base.w_values);
  Bytes v2 = v1;
  Set(v2, 4, 2, 2);
  Rehash(v2);
  ExpectCorrupt(v2, "positions");
}

// ---------------------------------------------------------------------------
// Placed frames: the payload written by the caller where it lies (a device
// bucket), here host memory standing in for it.

struct PlacedCase {
  std::vector<int64_t> a_shape{1000};
  std::vector<int64_t> b_shape{3, 7};
  Bytes dense = RandomBytes(300 * 2, 1);
  std::vector<uint64_t> a_pos{300, 301, 309, 640, 999};
  Bytes a_val = RandomBytes(5 * 2, 2);
  std::vector<uint64_t> b_pos{0, 4, 20};  // an odd count: padding after them
  Bytes b_val = RandomBytes(3 * 4, 3);
  FlushHeader header{7, 1, FrameKind::kDelta, true, true};

  TensorRange A(uint64_t first, uint64_t count) const {
    return {"a", DType::kBF16, a_shape, first, count};
  }
  TensorRange B() const { return {"b", DType::kF32, b_shape, 0, 21}; }

  Bytes Written() const {
    FlushWriter w;
    Bytes out;
    EXPECT_TRUE(w.Begin(header, 1 << 16, &out).ok());
    EXPECT_TRUE(*w.AddDense(A(0, 300), dense));
    EXPECT_TRUE(*w.AddIndices(A(300, 700), Positions::Absolute(a_pos), a_val));
    EXPECT_TRUE(*w.AddIndices(B(), Positions::Absolute(b_pos), b_val));
    EXPECT_TRUE(*w.AddDigest("b", {0, 21, 1, 0}, {5, 6}));
    EXPECT_TRUE(w.Finish().ok());
    return out;
  }

  // The same frame through BeginPlaced, its payload put in place here.
  Bytes Placed() const {
    FlushWriter w;
    Bytes head;
    EXPECT_TRUE(w.BeginPlaced(header, 1 << 16, &head).ok());
    Bytes payload(1 << 16, 0);
    const auto put_positions = [&](const PlacedEntry& e, const std::vector<uint64_t>& pos) {
      for (size_t k = 0; k < pos.size(); ++k) {
        for (uint32_t i = 0; i < e.position_width; ++i) {
          payload[e.positions_offset + k * e.position_width + i] =
              static_cast<uint8_t>(pos[k] >> (8 * i));
        }
      }
    };
    const auto put = [&](uint64_t off, const Bytes& v) {
      std::copy(v.begin(), v.end(), payload.begin() + off);
    };
    Result<std::optional<PlacedEntry>> e = w.PlaceDense(A(0, 300));
    EXPECT_TRUE(e.ok() && e->has_value());
    put((*e)->values_offset, dense);
    e = w.PlaceIndices(A(300, 700), a_pos.size());
    EXPECT_TRUE(e.ok() && e->has_value());
    EXPECT_EQ((*e)->position_width, 3u);
    put_positions(**e, a_pos);
    put((*e)->values_offset, a_val);
    e = w.PlaceIndices(B(), b_pos.size());
    EXPECT_TRUE(e.ok() && e->has_value());
    put_positions(**e, b_pos);
    put((*e)->values_offset, b_val);
    EXPECT_TRUE(*w.AddDigest("b", {0, 21, 1, 0}, {5, 6}));
    const uint64_t end = w.payload_end();
    EXPECT_TRUE(w.Finish().ok());
    Bytes frame(head.begin(), head.begin() + 64);
    frame.insert(frame.end(), payload.begin() + 64, payload.begin() + end);
    frame.insert(frame.end(), head.begin() + 64, head.end());
    frame.resize(frame.size() + 16, 0);
    Rehash(frame);
    return frame;
  }
};

// The checks a placed frame's reader asks for, run on the host bytes.
PayloadChecker HostChecker(const Bytes& frame, PayloadChecks* seen = nullptr) {
  return [&frame, seen](const PayloadChecks& c) -> Result<std::optional<uint64_t>> {
    if (seen) *seen = c;
    for (size_t k = 0; k < c.zeros.size(); ++k) {
      for (uint64_t i = 0; i < c.zeros[k].bytes; ++i) {
        if (frame[c.zeros[k].offset + i] != 0) return std::optional<uint64_t>(k);
      }
    }
    for (size_t k = 0; k < c.positions.size(); ++k) {
      const cuda::PositionCheck& p = c.positions[k];
      for (uint64_t i = 0; i < p.count; ++i) {
        const uint64_t v = Get(frame, p.offset + i * p.width, static_cast<int>(p.width));
        const bool bad =
            v < p.first || v >= p.end ||
            (i > 0 && Get(frame, p.offset + (i - 1) * p.width, static_cast<int>(p.width)) >= v);
        if (bad) return std::optional<uint64_t>(c.zeros.size() + k);
      }
    }
    return std::optional<uint64_t>();
  };
}

Status ReadPlacedFrom(FlushReader& r, const Bytes& frame, const PayloadChecker& check,
                      bool* needs_host) {
  const auto manifest = [&](uint64_t off, uint64_t n) -> Result<std::span<const uint8_t>> {
    if (off > frame.size() || n > frame.size() - off) {
      return Status::OutOfRange("manifest past the frame");
    }
    return std::span<const uint8_t>(frame).subspan(off, n);
  };
  return r.ReadPlaced(std::span(frame).first(64), frame.size(), manifest, frame.data(), check,
                      needs_host);
}

TEST(PlacedFrame, LaysOutTheBytesTheWriterWrites) {
  const PlacedCase c;
  EXPECT_EQ(c.Placed(), c.Written());
}

TEST(PlacedFrame, RefusesWhatTheWriterRefusesAndTheOtherModesCalls) {
  const PlacedCase c;
  FlushWriter w;
  Bytes head;
  ASSERT_TRUE(w.BeginPlaced(c.header, 1 << 16, &head).ok());
  Result<bool> add = w.AddDense(c.A(0, 300), c.dense);
  ASSERT_FALSE(add.ok());
  EXPECT_EQ(add.status().code(), StatusCode::kFailedPrecondition);
  Result<std::optional<PlacedEntry>> e = w.PlaceIndices(c.A(300, 10), 11);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("11 positions in a range of 10"), std::string::npos)
      << e.status().ToString();
  e = w.PlaceDense({"a", DType::kBF16, c.a_shape, 900, 200});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("outside its 1000 elements"), std::string::npos);
  ASSERT_TRUE(w.PlaceDense(c.A(0, 300)).ok());
  e = w.PlaceDense(c.A(100, 300));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("overlaps"), std::string::npos);
  // Past the budget: nullopt, the frame unchanged.
  e = w.PlaceDense({"big", DType::kF64, std::vector<int64_t>{1 << 20}, 0, 1 << 20});
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(e->has_value());
  EXPECT_EQ(w.entry_count(), 1u);
  // A plain frame takes no Place calls.
  Bytes out;
  ASSERT_TRUE(w.Begin(c.header, 1 << 16, &out).ok());
  e = w.PlaceDense(c.A(0, 300));
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kFailedPrecondition);
}

TEST(PlacedFrame, ReadsWhatReadReadsAndLeavesThePayloadChecksToTheCaller) {
  const PlacedCase c;
  const Bytes frame = c.Written();
  FlushReader plain, placed;
  ASSERT_TRUE(plain.Read(frame).ok());
  bool needs_host = true;
  PayloadChecks asked;
  Status s = ReadPlacedFrom(placed, frame, HostChecker(frame, &asked), &needs_host);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_FALSE(needs_host);
  ASSERT_EQ(placed.entries().size(), plain.entries().size());
  for (size_t k = 0; k < plain.entries().size(); ++k) {
    const FlushEntry &a = plain.entries()[k], &b = placed.entries()[k];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.first, b.first);
    EXPECT_EQ(a.count, b.count);
    EXPECT_EQ(a.value_count, b.value_count);
    EXPECT_EQ(a.position_width, b.position_width);
    EXPECT_EQ(a.positions.data(), b.positions.data());  // views at the same offsets
    EXPECT_EQ(a.values.data(), b.values.data());
    EXPECT_TRUE(a.host_readable);
    EXPECT_FALSE(b.host_readable);
  }
  EXPECT_EQ(placed.digests().size(), 1u);
  EXPECT_TRUE(placed.header().verify_all);
  // The two indices entries' positions, and the padding after b's odd
  // count of positions, were left to the checker.
  ASSERT_EQ(asked.positions.size(), 2u);
  EXPECT_EQ(asked.positions[0].first, 300u);
  EXPECT_EQ(asked.positions[0].end, 1000u);
  EXPECT_EQ(asked.positions[1].count, 3u);
  ASSERT_FALSE(asked.zeros.empty());
  // A host apply of a placed entry is refused, not a read of that memory.
  Bytes dest(1000 * 2, 0);
  Result<uint64_t> applied = ApplyEntry(placed.entries()[1], DestinationMap::Whole(1000), dest);
  ASSERT_FALSE(applied.ok());
  EXPECT_NE(applied.status().message().find("placed frame"), std::string::npos);
}

TEST(PlacedFrame, WhatTheCheckerFindsRefusesTheFrameAndExposesNothing) {
  const PlacedCase c;
  const Bytes good = c.Written();
  FlushReader plain;
  ASSERT_TRUE(plain.Read(good).ok());
  const uint64_t b_positions = plain.entries()[2].positions.data() - good.data();
  const uint64_t a_positions = plain.entries()[1].positions.data() - good.data();
  struct Case {
    const char* what;
    std::function<void(Bytes&)> damage;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"padding", [&](Bytes& f) { f[b_positions + 12] = 1; },
       "entry 2 ('b'): padding before its values is not 0"},
      {"order", [&](Bytes& f) { Set(f, a_positions + 4, 300, 4); },
       "entry 1 ('a'): positions not strictly increasing inside the range [300, 1000)"},
      {"range", [&](Bytes& f) { Set(f, a_positions, 299, 4); },
       "entry 1 ('a'): positions not strictly increasing inside the range [300, 1000)"},
  };
  for (const Case& k : cases) {
    Bytes bad = good;
    k.damage(bad);
    Rehash(bad);
    FlushReader r, host;
    bool needs_host = false;
    Status s = ReadPlacedFrom(r, bad, HostChecker(bad), &needs_host);
    ASSERT_FALSE(s.ok()) << k.what;
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << k.what;
    EXPECT_NE(s.message().find(k.message), std::string::npos) << k.what << ": " << s.ToString();
    EXPECT_NE(s.message().find("sync 7, flush 1"), std::string::npos) << s.ToString();
    EXPECT_TRUE(r.entries().empty()) << k.what;
    EXPECT_FALSE(host.Read(bad).ok()) << k.what << ": the host reader refuses it too";
  }
  // A checker that cannot check fails the read, naming the frame.
  FlushReader r;
  bool needs_host = false;
  Status s = ReadPlacedFrom(
      r, good,
      [](const PayloadChecks&) -> Result<std::optional<uint64_t>> {
        return Status::Internal("device lost");
      },
      &needs_host);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("checking the payload: device lost"), std::string::npos);
  EXPECT_TRUE(r.entries().empty());
  // The header and manifest rules hold as in Read: a bad magic.
  Bytes bad = good;
  bad[0] = 'X';
  s = ReadPlacedFrom(r, bad, HostChecker(bad), &needs_host);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("bad magic"), std::string::npos) << s.ToString();
}

TEST(PlacedFrame, SparseEntriesSendTheReadToTheHost) {
  const PlacedCase c;
  FlushWriter w;
  Bytes frame;
  ASSERT_TRUE(w.Begin(c.header, 1 << 16, &frame).ok());
  ASSERT_TRUE(*w.AddSparse(c.A(300, 700), Positions::Absolute(c.a_pos), c.a_val));
  ASSERT_TRUE(w.Finish().ok());
  FlushReader r;
  bool needs_host = false;
  bool checked = false;
  Status s = ReadPlacedFrom(
      r, frame,
      [&](const PayloadChecks&) -> Result<std::optional<uint64_t>> {
        checked = true;
        return std::optional<uint64_t>();
      },
      &needs_host);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(needs_host);
  EXPECT_FALSE(checked);
  EXPECT_TRUE(r.entries().empty());
  ASSERT_TRUE(r.Read(frame).ok());
  EXPECT_EQ(EntryPositions(r.entries()[0]), c.a_pos);
}

}  // namespace
}  // namespace deltasync::stream
