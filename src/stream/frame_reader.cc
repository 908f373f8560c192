// The flush frame's validating reader (docs/format.md, "Stream: flush
// frame"): every check passes before an entry is handed out.
#include "stream/frame.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <numeric>

#include "deltasync/checksum.h"
#include "deltasync/tensor.h"
#include "stream/frame_wire.h"

namespace deltasync::stream {

using namespace frame_wire;  // NOLINT(google-build-using-namespace): the frame's own fields

// ---------------------------------------------------------------------------
// Reader

struct FlushReader::ZstdContexts {
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  ~ZstdContexts() { ZSTD_freeDCtx(dctx); }
};

FlushReader::FlushReader() : zstd_(std::make_unique<ZstdContexts>()) {}
FlushReader::~FlushReader() = default;

namespace {

// The content size a region's single zstd frame records, or an error text.
// Checks the magic, that the region is exactly one frame and that the size
// is recorded and in [lo, hi].
std::string CheckZstdRegion(std::span<const uint8_t> region, uint64_t lo, uint64_t hi,
                            uint64_t* content) {
  if (region.size() < 4 || std::memcmp(region.data(), kZstdMagic, 4) != 0) {
    return "is not a zstd frame";
  }
  const size_t frame = ZSTD_findFrameCompressedSize(region.data(), region.size());
  if (ZSTD_isError(frame)) {
    return "is a malformed zstd frame (" + std::string(ZSTD_getErrorName(frame)) + ")";
  }
  if (frame != region.size()) {
    return "holds " + U64(region.size() - frame) + " bytes after its zstd frame";
  }
  const unsigned long long size = ZSTD_getFrameContentSize(region.data(), region.size());
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) return "zstd frame does not record its content size";
  if (size == ZSTD_CONTENTSIZE_ERROR) return "is a malformed zstd frame";
  if (size < lo || size > hi) {
    return "zstd frame records " + U64(size) + " content bytes, not in [" + U64(lo) + ", " +
           U64(hi) + "]";
  }
  *content = size;
  return "";
}

// Checks a decompressed gap section: exactly n minimal gaps filling it, the
// last position below end. Returns an error text or "".
std::string CheckGaps(std::span<const uint8_t> gaps, uint64_t n, uint64_t first, uint64_t end) {
  const uint8_t* p = gaps.data();
  const uint8_t* const stop = p + gaps.size();
  uint64_t next = first;
  for (uint64_t k = 0; k < n; ++k) {
    if (p == stop) return "gap section ends after " + U64(k) + " of " + U64(n) + " gaps";
    uint64_t gap = *p++;
    if (gap == 0xFF) {
      uint64_t extra = 0;
      int shift = 0;
      for (;;) {
        if (p == stop) return "gap " + U64(k) + " is cut short";
        const uint8_t b = *p++;
        if (shift == 49 && (b & 0x80) != 0) return "gap " + U64(k) + " does not fit 56 bits";
        extra |= uint64_t{b & 0x7Fu} << shift;
        if ((b & 0x80) == 0) {
          if (b == 0 && shift > 0) return "gap " + U64(k) + " is not minimal LEB128";
          break;
        }
        shift += 7;
      }
      gap = 255 + extra;
    }
    if (gap >= end - next) {
      return "position " + U64(k) + " (gap " + U64(gap) + ") is past the range's end " + U64(end);
    }
    next += gap + 1;
  }
  if (p != stop) {
    return "gap section holds " + U64(stop - p) + " bytes after its " + U64(n) + " gaps";
  }
  return "";
}

// Checks an indices entry's positions: strictly increasing, inside the
// range, none negative. Returns an error text or "".
template <uint32_t W>
std::string CheckIndexPositions(const FlushEntry& entry) {
  const uint64_t end = entry.first + entry.count;
  const uint8_t* p = entry.positions.data();
  uint64_t next = entry.first;  // the smallest allowed position
  for (uint64_t k = 0; k < entry.value_count; ++k) {
    const uint64_t raw = LoadPosition<W>(p + k * W);
    if (raw >= next && raw < end) {  // end <= 2^56: a negative one is never below it
      next = raw + 1;
      continue;
    }
    const bool negative = W != 3 && raw >> (8 * W - 1);  // u24 is unsigned
    const std::string shown =
        negative ? "-" + U64((~raw + 1) & (W == 4 ? 0xFFFFFFFFull : ~uint64_t{0})) : U64(raw);
    if (!negative && raw < next && k > 0) {
      return "positions not strictly increasing at " + U64(k) + " (" + shown + " after " +
             U64(next - 1) + ")";
    }
    return "position " + U64(k) + " (" + shown + ") is outside the range [" + U64(entry.first) +
           ", " + U64(end) + ")";
  }
  return "";
}

}  // namespace

void FlushReader::Clear() {
  header_ = FlushHeader{};
  entry_count_ = 0;
  digest_count_ = 0;
}

Status FlushReader::Read(std::span<const uint8_t> frame) {
  if (frame.size() < kFlushHeaderBytes + kFlushTrailerBytes) return Read(frame, {});
  return Read(frame, ChecksumBytes(ChecksumAlgo::kXxh3_128,
                                   frame.first(frame.size() - kFlushTrailerBytes)));
}

Status FlushReader::Read(std::span<const uint8_t> frame, std::span<const uint8_t> sum) {
  Clear();
  const uint64_t size = frame.size();
  const uint8_t* f = frame.data();
  if (size < kFlushHeaderBytes + kFlushTrailerBytes) {
    return Status::Corruption("flush frame of " + U64(size) +
                              " bytes: shorter than a 64-byte header and a 16-byte trailer");
  }
  if (sum.size() != kFlushTrailerBytes) {
    return Status::InvalidArgument("flush reader: a checksum of " + U64(sum.size()) +
                                   " bytes, not 16");
  }
  // 2. Nothing is believed before the checksum.
  if (std::memcmp(sum.data(), f + size - kFlushTrailerBytes, kFlushTrailerBytes) != 0) {
    return TrailerMismatch(size, frame.first(kFlushHeaderBytes),
                           frame.subspan(size - kFlushTrailerBytes), sum);
  }
  return ReadParts(
      size, f,
      [&](uint64_t offset, uint64_t bytes) -> Result<std::span<const uint8_t>> {
        return frame.subspan(offset, bytes);
      },
      f, nullptr, nullptr);
}

Status FlushReader::ReadPlaced(
    std::span<const uint8_t> head, uint64_t frame_bytes,
    const std::function<Result<std::span<const uint8_t>>(uint64_t, uint64_t)>& manifest,
    const uint8_t* base, const PayloadChecker& check, bool* needs_host) {
  Clear();
  *needs_host = false;
  if (frame_bytes < kFlushHeaderBytes + kFlushTrailerBytes || head.size() < kFlushHeaderBytes) {
    return Status::Corruption("flush frame of " + U64(frame_bytes) +
                              " bytes: shorter than a 64-byte header and a 16-byte trailer");
  }
  if (!check) return Status::InvalidArgument("flush reader: a placed frame needs a checker");
  return ReadParts(frame_bytes, head.data(), manifest, base, &check, needs_host);
}

Status FlushReader::ReadParts(
    uint64_t size, const uint8_t* f,
    const std::function<Result<std::span<const uint8_t>>(uint64_t, uint64_t)>& manifest_at,
    const uint8_t* base, const PayloadChecker* check, bool* needs_host) {
  const std::span<const uint8_t> frame_head(f, kFlushHeaderBytes);
  const uint64_t sync_id = LoadLe<uint64_t>(f + 8);
  const uint32_t flush_index = LoadLe<uint32_t>(f + 16);
  const std::string where = "flush frame of sync " + U64(sync_id) + ", flush " + U64(flush_index);
  auto bad = [&](const std::string& problem) { return Status::Corruption(where + ": " + problem); };

  // 3. Header fields.
  if (std::memcmp(f, kMagic, 4) != 0) return bad("bad magic " + ToHex(frame_head.first(4)));
  const uint16_t version = LoadLe<uint16_t>(f + 4);
  if (version < kOldestFlushFrameVersion || version > kFlushFrameVersion) {
    return Status::Unsupported(where + ": protocol version " + U64(version) +
                               " (this reader knows versions 1 and 2)");
  }
  const uint16_t flags = LoadLe<uint16_t>(f + 6);
  if (flags & ~kKnownFlags) return bad("unknown flags " + U64(flags & ~kKnownFlags));
  const bool seed = flags & kFlagSeed, delta = flags & kFlagDelta;
  if (seed == delta) return bad("flags must set exactly one of seed and delta");
  if ((flags & kFlagVerifyAll) && !(flags & kFlagLast)) return bad("verify_all without last");
  if (sync_id == 0) return bad("sync id 0");
  if (LoadLe<uint32_t>(f + 28) != 0 || LoadLe<uint64_t>(f + 56) != 0) {
    return bad("reserved header bytes are not 0");
  }
  // 4. Sizes.
  const uint64_t total = LoadLe<uint64_t>(f + 32), payload = LoadLe<uint64_t>(f + 40),
                 manifest = LoadLe<uint64_t>(f + 48);
  if (total != size) return bad("header says " + U64(total) + " bytes, the frame has " + U64(size));
  if (total > kMaxFlushFrameBytes) return bad(U64(total) + " bytes is past the 2^40 limit");
  if (payload % 8 != 0) return bad("payload of " + U64(payload) + " bytes is not a multiple of 8");
  const uint64_t room = total - kFlushHeaderBytes - kFlushTrailerBytes;
  if (payload > room || manifest != room - payload) {
    return bad("payload " + U64(payload) + " and manifest " + U64(manifest) +
               " bytes do not fill the " + U64(room) + " between header and trailer");
  }
  // 5. Counts, checked against the manifest before anything is allocated.
  const uint32_t entry_count = LoadLe<uint32_t>(f + 20), digest_count = LoadLe<uint32_t>(f + 24);
  if (entry_count > kMaxFlushEntries) return bad(U64(entry_count) + " entries (at most 2^20)");
  if (digest_count > kMaxFlushDigests) {
    return bad(U64(digest_count) + " digest records (at most 2^20)");
  }
  if (uint64_t{entry_count} * (kEntryFixedBytes + 1) +
          uint64_t{digest_count} * (kDigestFixedBytes + 1) >
      manifest) {
    return bad("a manifest of " + U64(manifest) + " bytes cannot hold " + U64(entry_count) +
               " entries and " + U64(digest_count) + " digest records");
  }

  // 6. Entries. The manifest's bytes: `mf + (c - payload_end)` is offset c.
  const uint64_t payload_begin = kFlushHeaderBytes, payload_end = kFlushHeaderBytes + payload;
  const uint64_t manifest_end = payload_end + manifest;
  Result<std::span<const uint8_t>> manifest_bytes = manifest_at(payload_end, manifest);
  if (!manifest_bytes.ok()) return manifest_bytes.status();
  if (manifest_bytes->size() != manifest) {
    return Status::Internal(where + ": the manifest's copy holds " + U64(manifest_bytes->size()) +
                            " bytes, not " + U64(manifest));
  }
  const uint8_t* const mf = manifest_bytes->data() - payload_end;
  uint64_t c = payload_end;
  // Filled in place, exposed only once the whole frame has passed.
  if (entries_.size() < entry_count) entries_.resize(entry_count);
  const std::span<FlushEntry> entries = std::span(entries_).first(entry_count);
  regions_.resize(entry_count);
  const std::span<Regions> regions = std::span(regions_).first(entry_count);
  std::vector<uint64_t> dims;
  for (uint32_t e = 0; e < entry_count; ++e) {
    // Error texts are built only for an error.
    const auto at = [&] { return "entry " + U64(e); };
    if (manifest_end - c < kEntryFixedBytes) return bad(at() + ": cut short by the manifest's end");
    const uint8_t* m = mf + c;
    const uint16_t name_len = LoadLe<uint16_t>(m);
    const uint8_t code = m[2], encoding = m[3], ndim = m[4];
    if (name_len == 0 || name_len > kMaxTensorNameBytes) {
      return bad(at() + ": name of " + U64(name_len) + " bytes (1 to 1024)");
    }
    if (ndim > kMaxTensorDims) return bad(at() + ": " + U64(ndim) + " dimensions (at most 16)");
    if (manifest_end - c - kEntryFixedBytes < uint64_t{8} * ndim + name_len) {
      return bad(at() + ": shape and name cut short by the manifest's end");
    }
    FlushEntry& entry = entries[e];
    entry.name =
        std::string_view(reinterpret_cast<const char*>(m + kEntryFixedBytes + 8 * ndim), name_len);
    const auto what = [&] { return at() + " (" + Quote(entry.name) + ")"; };
    if (!IsUtf8(entry.name)) return bad(what() + ": name is not UTF-8");
    if (!AllZero(m + 5, 3)) return bad(what() + ": reserved bytes are not 0");
    const std::optional<DType> dtype = DTypeFromWireCode(code);
    if (!dtype) return bad(what() + ": unknown dtype code " + U64(code));
    entry.dtype = *dtype;
    if (encoding > static_cast<uint8_t>(WireEncoding::kSparse)) {
      return bad(what() + ": unknown encoding " + U64(encoding));
    }
    entry.encoding = static_cast<WireEncoding>(encoding);
    entry.position_width = 0;
    dims.resize(ndim);
    for (uint32_t d = 0; d < ndim; ++d) dims[d] = LoadLe<uint64_t>(m + kEntryFixedBytes + 8 * d);
    const std::optional<uint64_t> numel = ShapeElements(std::span<const uint64_t>(dims));
    if (!numel) return bad(what() + ": a dimension or the element count is past 2^56");
    entry.numel = *numel;
    entry.shape.assign(dims.begin(), dims.end());
    entry.first = LoadLe<uint64_t>(m + 8);
    entry.count = LoadLe<uint64_t>(m + 16);
    entry.value_count = LoadLe<uint64_t>(m + 24);
    if (entry.first > entry.numel || entry.count > entry.numel - entry.first) {
      return bad(what() + ": range [" + U64(entry.first) + ", +" + U64(entry.count) +
                 ") is outside its " + U64(entry.numel) + " elements");
    }
    const uint64_t n = entry.value_count;
    if (entry.encoding == WireEncoding::kDense ? n != entry.count : n > entry.count) {
      return bad(what() + ": " + U64(n) + " values for " +
                 std::string(WireEncodingName(entry.encoding)) + " over a range of " +
                 U64(entry.count));
    }
    if (seed && entry.encoding != WireEncoding::kDense) {
      return bad(what() + ": a seed frame holds only dense entries, not " +
                 std::string(WireEncodingName(entry.encoding)));
    }
    regions[e] = {LoadLe<uint64_t>(m + 32), LoadLe<uint64_t>(m + 40), LoadLe<uint64_t>(m + 48),
                  LoadLe<uint64_t>(m + 56)};
    c += kEntryFixedBytes + 8 * ndim + name_len;
  }

  // 7. Digest records.
  if (digests_.size() < digest_count) digests_.resize(digest_count);
  const std::span<FlushDigest> digests = std::span(digests_).first(digest_count);
  for (uint32_t g = 0; g < digest_count; ++g) {
    const auto at = [&] { return "digest record " + U64(g); };
    if (manifest_end - c < kDigestFixedBytes) {
      return bad(at() + ": cut short by the manifest's end");
    }
    const uint8_t* m = mf + c;
    const uint16_t name_len = LoadLe<uint16_t>(m);
    if (name_len == 0 || name_len > kMaxTensorNameBytes) {
      return bad(at() + ": name of " + U64(name_len) + " bytes (1 to 1024)");
    }
    if (manifest_end - c - kDigestFixedBytes < name_len) {
      return bad(at() + ": name cut short by the manifest's end");
    }
    FlushDigest& record = digests[g];
    record.name = std::string_view(reinterpret_cast<const char*>(m + kDigestFixedBytes), name_len);
    const auto what = [&] { return at() + " (" + Quote(record.name) + ")"; };
    if (!IsUtf8(record.name)) return bad(what() + ": name is not UTF-8");
    if (!AllZero(m + 2, 6)) return bad(what() + ": reserved bytes are not 0");
    record.block = {LoadLe<uint64_t>(m + 8), LoadLe<uint64_t>(m + 16), LoadLe<uint64_t>(m + 24),
                    LoadLe<uint64_t>(m + 32)};
    Status valid = record.block.Validate();
    if (!valid.ok()) return bad(what() + ": " + valid.message());
    record.digest = {LoadLe<uint64_t>(m + 40), LoadLe<uint64_t>(m + 48)};
    c += kDigestFixedBytes + name_len;
  }
  // 8.
  if (c != manifest_end) {
    return bad("the manifest holds " + U64(manifest_end - c) + " bytes after its last record");
  }

  // 9. Regions: sizes, canonical offsets, zero padding. A placed frame's
  // payload checks are gathered for `check`, each with what its failure
  // means.
  PayloadChecks checks;
  std::vector<std::string> check_problems;
  // `problem()`: what a failure of the check means (built only when kept).
  const auto zero = [&](uint64_t off, uint64_t bytes, const auto& problem) -> bool {
    if (bytes == 0) return true;
    if (check == nullptr) return AllZero(f + off, bytes);
    checks.zeros.push_back({off, bytes});
    check_problems.push_back(problem());
    return true;
  };
  uint64_t cursor = payload_begin;
  auto region = [&](const auto& what, const char* kind, uint64_t off, uint64_t bytes,
                    uint64_t expected_bytes, bool any_size) -> std::string {
    const uint64_t expected_off = Align8(cursor);
    if (off != expected_off) {
      return what() + ": " + kind + " at offset " + U64(off) + ", not " + U64(expected_off);
    }
    if (expected_off > payload_end || bytes > payload_end - expected_off) {
      return what() + ": " + kind + " of " + U64(bytes) + " bytes at " + U64(off) +
             " run past the payload's end " + U64(payload_end);
    }
    if (!any_size && bytes != expected_bytes) {
      return what() + ": " + kind + " of " + U64(bytes) + " bytes, not " + U64(expected_bytes);
    }
    const auto padding = [&] { return what() + ": padding before its " + kind + " is not 0"; };
    if (!zero(cursor, expected_off - cursor, padding)) return padding();
    cursor = off + bytes;
    return "";
  };
  for (uint32_t e = 0; e < entry_count; ++e) {
    FlushEntry& entry = entries[e];
    const Regions& r = regions[e];
    const auto what = [&] { return "entry " + U64(e) + " (" + Quote(entry.name) + ")"; };
    const uint64_t w = DTypeSize(entry.dtype), n = entry.value_count;
    uint64_t pos_expected = 0;
    bool sparse = false;
    switch (entry.encoding) {
      case WireEncoding::kDense: break;
      case WireEncoding::kIndices:
        entry.position_width = PositionWidth(entry.numel, version);
        pos_expected = n * entry.position_width;
        break;
      case WireEncoding::kSparse: sparse = n > 0; break;
    }
    std::string problem = region(what, "positions", r.pos_off, r.pos_bytes, pos_expected, sparse);
    if (problem.empty()) {
      problem = region(what, "values", r.val_off, r.val_bytes, n * w, sparse);
    }
    if (!problem.empty()) return bad(problem);
    entry.positions = {base + r.pos_off, r.pos_bytes};
    entry.values = {base + r.val_off, r.val_bytes};
    entry.host_readable = check == nullptr;
  }
  if (Align8(cursor) != payload_end) {
    return bad("the payload holds " + U64(payload_end - cursor) +
               " bytes after its last entry's values");
  }
  if (!zero(cursor, payload_end - cursor,
            [] { return std::string("the payload's padding is not 0"); })) {
    return bad("the payload's padding is not 0");
  }

  // 10. Positions. Sparse sizes first, so the scratch is sized once.
  sparse_sizes_.assign(entry_count, {0, 0});
  const std::span<std::pair<uint64_t, uint64_t>> sparse_sizes(sparse_sizes_);
  uint64_t decoded = 0;
  for (uint32_t e = 0; e < entry_count; ++e) {
    FlushEntry& entry = entries[e];
    const auto what = [&] { return "entry " + U64(e) + " (" + Quote(entry.name) + ")"; };
    const uint64_t n = entry.value_count;
    if (entry.encoding == WireEncoding::kIndices && check != nullptr) {
      checks.positions.push_back({static_cast<uint64_t>(entry.positions.data() - base), n,
                                  entry.position_width, entry.first, entry.first + entry.count});
      check_problems.push_back(what() + ": positions not strictly increasing inside the range [" +
                               U64(entry.first) + ", " + U64(entry.first + entry.count) + ")");
    } else if (entry.encoding == WireEncoding::kIndices) {
      const std::string problem = entry.position_width == 3   ? CheckIndexPositions<3>(entry)
                                  : entry.position_width == 4 ? CheckIndexPositions<4>(entry)
                                                              : CheckIndexPositions<8>(entry);
      if (!problem.empty()) return bad(what() + ": " + problem);
    } else if (entry.encoding == WireEncoding::kSparse && n > 0 && check != nullptr) {
      // zstd content is decoded on the host: the caller reads the frame
      // from a host copy.
      *needs_host = true;
      return Status::OK();
    } else if (entry.encoding == WireEncoding::kSparse && n > 0) {
      const uint64_t w = DTypeSize(entry.dtype);
      uint64_t gap_bytes = 0, value_bytes = 0;
      std::string problem = CheckZstdRegion(entry.positions, n, kMaxGapBytes * n, &gap_bytes);
      if (!problem.empty()) return bad(what() + ": positions " + problem);
      problem = CheckZstdRegion(entry.values, n * w, n * w, &value_bytes);
      if (!problem.empty()) return bad(what() + ": values " + problem);
      if (gap_bytes + value_bytes > kMaxSparseDecodedBytes - decoded) {
        return bad(what() + ": sparse entries decompress to more than 2^30 bytes");
      }
      decoded += gap_bytes + value_bytes;
      sparse_sizes[e] = {gap_bytes, value_bytes};
    }
  }
  if (check != nullptr) {
    // Rule 9 gathered every zero check before rule 10's position checks:
    // check_problems is in the checker's index order.
    Result<std::optional<uint64_t>> failed = (*check)(checks);
    if (!failed.ok()) {
      return Status(failed.status().code(),
                    where + ": checking the payload: " + failed.status().message());
    }
    if (failed->has_value()) {
      const uint64_t k = **failed;
      return bad(k < check_problems.size() ? check_problems[k]
                                           : "payload check " + U64(k) + " failed");
    }
  }
  if (decoded > 0) {
    decoded_.resize(decoded);
    uint64_t at = 0;
    for (uint32_t e = 0; e < entry_count; ++e) {
      FlushEntry& entry = entries[e];
      const auto [gap_bytes, value_bytes] = sparse_sizes[e];
      if (gap_bytes == 0) continue;
      const auto what = [&] { return "entry " + U64(e) + " (" + Quote(entry.name) + ")"; };
      const uint64_t w = DTypeSize(entry.dtype), n = entry.value_count;
      uint8_t* gaps = decoded_.data() + at;
      size_t got = ZSTD_decompressDCtx(zstd_->dctx, gaps, gap_bytes, entry.positions.data(),
                                       entry.positions.size());
      if (ZSTD_isError(got) || got != gap_bytes) {
        return bad(what() + ": positions do not decompress to their recorded " + U64(gap_bytes) +
                   " bytes" +
                   (ZSTD_isError(got) ? " (" + std::string(ZSTD_getErrorName(got)) + ")" : ""));
      }
      const std::string problem =
          CheckGaps({gaps, gap_bytes}, n, entry.first, entry.first + entry.count);
      if (!problem.empty()) return bad(what() + ": " + problem);
      uint8_t* values = gaps + gap_bytes;
      uint8_t* planes = values;
      if (w > 1) {
        planes_.resize(value_bytes);
        planes = planes_.data();
      }
      got = ZSTD_decompressDCtx(zstd_->dctx, planes, value_bytes, entry.values.data(),
                                entry.values.size());
      if (ZSTD_isError(got) || got != value_bytes) {
        return bad(what() + ": values do not decompress to their recorded " + U64(value_bytes) +
                   " bytes" +
                   (ZSTD_isError(got) ? " (" + std::string(ZSTD_getErrorName(got)) + ")" : ""));
      }
      for (uint64_t j = 0; j < w && w > 1; ++j) {
        const uint8_t* plane = planes + j * n;
        for (uint64_t k = 0; k < n; ++k) values[k * w + j] = plane[k];
      }
      entry.positions = {gaps, gap_bytes};
      entry.values = {values, value_bytes};
      at += gap_bytes + value_bytes;
    }
  }

  // 11.
  if (const std::string problem = CheckTensors(entry_count, digest_count); !problem.empty()) {
    return bad(problem);
  }

  header_.sync_id = sync_id;
  header_.flush_index = flush_index;
  header_.kind = seed ? FrameKind::kSeed : FrameKind::kDelta;
  header_.last = flags & kFlagLast;
  header_.verify_all = flags & kFlagVerifyAll;
  entry_count_ = entry_count;
  digest_count_ = digest_count;
  return Status::OK();
}

std::string FlushReader::CheckTensors(uint32_t entry_count, uint32_t digest_count) {
  const std::span<const FlushEntry> entries = std::span(entries_).first(entry_count);
  const std::span<const FlushDigest> digests = std::span(digests_).first(digest_count);
  // A sender lists each tensor's entries in order, so the common frame is
  // checked in one pass over a table of names (open addressing, each slot
  // the index + 1 of the last entry of its tensor seen so far): every
  // entry agrees with, and starts at or after the end of, the one before
  // it of its tensor. Anything else is judged, and named, by the sorts
  // below, whose verdict this pass only anticipates.
  size_t slots = 16;
  while (slots < 2 * size_t{std::max(entry_count, digest_count)}) slots *= 2;
  const auto probe = [&](std::string_view name, const auto& same) -> uint32_t& {
    size_t h = std::hash<std::string_view>{}(name) & (slots - 1);
    while (slots_[h] != 0 && !same(slots_[h] - 1)) h = (h + 1) & (slots - 1);
    return slots_[h];
  };
  bool simple = true;
  slots_.assign(slots, 0);
  for (uint32_t e = 0; e < entry_count && simple; ++e) {
    const FlushEntry& cur = entries[e];
    uint32_t& slot = probe(cur.name, [&](uint32_t k) { return entries[k].name == cur.name; });
    if (slot != 0) {
      const FlushEntry& prev = entries[slot - 1];
      simple = prev.dtype == cur.dtype && prev.shape == cur.shape &&
               cur.first >= prev.first + prev.count;
    }
    slot = e + 1;
  }
  if (!simple) {
    order_.resize(entry_count);
    std::iota(order_.begin(), order_.end(), 0);
    std::sort(order_.begin(), order_.end(), [&](uint32_t x, uint32_t y) {
      const FlushEntry &a = entries[x], &b = entries[y];
      return std::tie(a.name, a.first, x) < std::tie(b.name, b.first, y);
    });
    for (size_t k = 1; k < order_.size(); ++k) {
      const FlushEntry &prev = entries[order_[k - 1]], &cur = entries[order_[k]];
      if (prev.name != cur.name) continue;
      const std::string what =
          "entries " + U64(order_[k - 1]) + " and " + U64(order_[k]) + " (" + Quote(cur.name) + ")";
      if (prev.dtype != cur.dtype || prev.shape != cur.shape) {
        return what + ": different dtypes or shapes for one tensor";
      }
      if (cur.first < prev.first + prev.count) {
        return what + ": ranges [" + U64(prev.first) + ", " + U64(prev.first + prev.count) +
               ") and [" + U64(cur.first) + ", " + U64(cur.first + cur.count) + ") overlap";
      }
    }
  }
  // Records: two for one block need two for one tensor.
  simple = true;
  slots_.assign(slots, 0);
  for (uint32_t g = 0; g < digest_count && simple; ++g) {
    const FlushDigest& cur = digests[g];
    uint32_t& slot = probe(cur.name, [&](uint32_t k) { return digests[k].name == cur.name; });
    simple = slot == 0;
    slot = g + 1;
  }
  if (simple) return "";
  order_.resize(digest_count);
  std::iota(order_.begin(), order_.end(), 0);
  auto record_key = [&](uint32_t g) {
    const FlushDigest& r = digests[g];
    return std::tie(r.name, r.block.first, r.block.count, r.block.rows, r.block.row_stride);
  };
  std::sort(order_.begin(), order_.end(),
            [&](uint32_t x, uint32_t y) { return record_key(x) < record_key(y); });
  for (size_t k = 1; k < order_.size(); ++k) {
    if (record_key(order_[k - 1]) == record_key(order_[k])) {
      const FlushDigest& r = digests[order_[k]];
      return "digest records " + U64(std::min(order_[k - 1], order_[k])) + " and " +
             U64(std::max(order_[k - 1], order_[k])) + " (" + Quote(r.name) + "): both for block " +
             r.block.ToString();
    }
  }
  return "";
}

Status TrailerMismatch(uint64_t frame_bytes, std::span<const uint8_t> header,
                       std::span<const uint8_t> trailer, std::span<const uint8_t> computed) {
  return Status::Corruption("flush frame of " + U64(frame_bytes) + " bytes (unverified sync " +
                            U64(LoadLe<uint64_t>(header.data() + 8)) +
                            "): xxh3-128 mismatch: trailer " + ToHex(trailer) +
                            ", frame hashes to " + ToHex(computed));
}

Result<uint64_t> PeekFlushFrameBytes(std::span<const uint8_t> header) {
  if (header.size() < kFlushHeaderBytes) {
    return Status::Corruption("flush frame header of " + U64(header.size()) +
                              " bytes: shorter than 64");
  }
  if (std::memcmp(header.data(), kMagic, 4) != 0) {
    return Status::Corruption("flush frame header: bad magic " + ToHex(header.first(4)));
  }
  const uint16_t version = LoadLe<uint16_t>(header.data() + 4);
  if (version < kOldestFlushFrameVersion || version > kFlushFrameVersion) {
    return Status::Unsupported("flush frame header: protocol version " + U64(version) +
                               " (this reader knows versions 1 and 2)");
  }
  const uint64_t total = LoadLe<uint64_t>(header.data() + 32);
  if (total < kFlushHeaderBytes + kFlushTrailerBytes || total > kMaxFlushFrameBytes) {
    return Status::Corruption("flush frame header: frame size " + U64(total) +
                              " is not in [80, 2^40]");
  }
  return total;
}

std::vector<uint64_t> EntryPositions(const FlushEntry& entry) {
  std::vector<uint64_t> positions(entry.value_count);
  ForEachPosition(entry, [&](uint64_t k, uint64_t p) { positions[k] = p; });
  return positions;
}

}  // namespace deltasync::stream
