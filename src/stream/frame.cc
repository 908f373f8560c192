#include "stream/frame.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <numeric>

#include "deltasync/checksum.h"
#include "deltasync/tensor.h"

namespace deltasync::stream {

namespace {

constexpr uint8_t kMagic[4] = {'D', 'S', 'F', 'L'};
constexpr uint8_t kZstdMagic[4] = {0x28, 0xB5, 0x2F, 0xFD};
constexpr uint16_t kFlagSeed = 1;
constexpr uint16_t kFlagDelta = 2;
constexpr uint16_t kFlagLast = 4;
constexpr uint16_t kFlagVerifyAll = 8;
constexpr uint16_t kKnownFlags = kFlagSeed | kFlagDelta | kFlagLast | kFlagVerifyAll;
constexpr size_t kEntryFixedBytes = 64;
constexpr size_t kDigestFixedBytes = 56;
constexpr uint64_t kWidePositionsFrom = uint64_t{1} << 31;
// A gap is below 2^56: FF and at most 8 LEB128 bytes.
constexpr uint64_t kMaxGapBytes = 9;

constexpr DType kWireDTypes[] = {
    DType::kBool, DType::kU8,  DType::kI8,  DType::kF8_E4M3, DType::kF8_E5M2,
    DType::kI16,  DType::kU16, DType::kF16, DType::kBF16,    DType::kI32,
    DType::kU32,  DType::kF32, DType::kI64, DType::kU64,     DType::kF64,
};
static_assert(std::size(kWireDTypes) == static_cast<size_t>(kNumDTypes));

std::string U64(uint64_t v) { return std::to_string(v); }

uint64_t Align8(uint64_t v) { return (v + 7) & ~uint64_t{7}; }

// Appends v as `width` (2 or 8) little-endian bytes.
void Append(std::vector<uint8_t>* out, uint64_t v, uint32_t width) {
  const size_t at = out->size();
  out->resize(at + width);
  StoreLeWidth(out->data() + at, v, width);
}

bool AllZero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// RFC 3629 UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF.
bool IsUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;  // bounds of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    }
    i += len;
  }
  return true;
}

// `name` in single quotes for a message: control characters, quotes,
// backslashes and bytes past ASCII escaped, long names cut short.
std::string Quote(std::string_view name) {
  constexpr size_t kMaxShown = 200;
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c >= 0x7F || c == '\'' || c == '\\') {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (name.size() > kMaxShown) out += "...";
  return out + "'";
}

// The element count of a shape, or nullopt when a dimension or the product
// exceeds kMaxStreamNumel (a zero dimension makes it 0 whatever the rest).
std::optional<uint64_t> ShapeElements(std::span<const uint64_t> shape) {
  bool zero = false;
  for (uint64_t d : shape) {
    if (d > kMaxStreamNumel) return std::nullopt;
    if (d == 0) zero = true;
  }
  if (zero) return 0;
  uint64_t numel = 1;
  for (uint64_t d : shape) {
    if (numel > kMaxStreamNumel / d) return std::nullopt;
    numel *= d;
  }
  return numel;
}

uint32_t PositionWidth(uint64_t numel) { return numel < kWidePositionsFrom ? 4 : 8; }

// The gap code of docs/format.md: g < 255 as one byte, else FF and g - 255
// as minimal LEB128.
void AppendGap(std::vector<uint8_t>* out, uint64_t gap) {
  if (gap < 255) {
    out->push_back(static_cast<uint8_t>(gap));
    return;
  }
  out->push_back(0xFF);
  uint64_t extra = gap - 255;
  do {
    uint8_t b = extra & 0x7F;
    extra >>= 7;
    if (extra != 0) b |= 0x80;
    out->push_back(b);
  } while (extra != 0);
}

}  // namespace

std::string_view WireEncodingName(WireEncoding encoding) {
  switch (encoding) {
    case WireEncoding::kDense: return "dense";
    case WireEncoding::kIndices: return "indices";
    case WireEncoding::kSparse: return "sparse";
  }
  return "unknown";
}

uint8_t DTypeWireCode(DType dtype) {
  for (uint8_t code = 0; code < std::size(kWireDTypes); ++code) {
    if (kWireDTypes[code] == dtype) return code;
  }
  return 0xFF;  // unreachable for a DType in the enum
}

std::optional<DType> DTypeFromWireCode(uint8_t code) {
  if (code >= std::size(kWireDTypes)) return std::nullopt;
  return kWireDTypes[code];
}

// ---------------------------------------------------------------------------
// Writer

struct FlushWriter::ZstdContexts {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ~ZstdContexts() { ZSTD_freeCCtx(cctx); }
};

FlushWriter::FlushWriter() : zstd_(std::make_unique<ZstdContexts>()) {}
FlushWriter::~FlushWriter() = default;

Status FlushWriter::Begin(const FlushHeader& header, uint64_t budget_bytes,
                          std::vector<uint8_t>* out) {
  return Start(header, budget_bytes, out, /*placed=*/false);
}

Status FlushWriter::BeginPlaced(const FlushHeader& header, uint64_t budget_bytes,
                                std::vector<uint8_t>* out) {
  return Start(header, budget_bytes, out, /*placed=*/true);
}

Status FlushWriter::Start(const FlushHeader& header, uint64_t budget_bytes,
                          std::vector<uint8_t>* out, bool placed) {
  if (out == nullptr) return Status::InvalidArgument("flush writer: no output buffer");
  if (header.sync_id == 0) return Status::InvalidArgument("flush writer: sync id 0");
  if (header.verify_all && !header.last) {
    return Status::InvalidArgument("flush writer: sync " + U64(header.sync_id) +
                                   ": verify_all is only for the last frame");
  }
  if (budget_bytes < kFlushHeaderBytes + kFlushTrailerBytes || budget_bytes > kMaxFlushFrameBytes) {
    return Status::InvalidArgument("flush writer: budget of " + U64(budget_bytes) +
                                   " bytes is not in [80, 2^40]");
  }
  out_ = out;
  header_ = header;
  budget_ = budget_bytes;
  manifest_.clear();
  records_.clear();
  entry_count_ = 0;
  digest_count_ = 0;
  sparse_decoded_ = 0;
  tensors_.clear();
  digest_keys_.clear();
  placed_ = placed;
  end_ = kFlushHeaderBytes;
  out_->clear();
  out_->resize(kFlushHeaderBytes);
  return Status::OK();
}

uint64_t FlushWriter::frame_bytes() const {
  if (out_ == nullptr) return 0;
  return Align8(end_) + manifest_.size() + records_.size() + kFlushTrailerBytes;
}

bool FlushWriter::Fits(uint64_t payload_end, size_t manifest_add) const {
  return Align8(payload_end) + manifest_.size() + records_.size() + manifest_add +
             kFlushTrailerBytes <=
         budget_;
}

Status FlushWriter::CheckRange(const TensorRange& range, WireEncoding encoding,
                               uint64_t* numel) const {
  if (out_ == nullptr) return Status::FailedPrecondition("flush writer: no frame begun");
  const std::string what =
      "flush writer: sync " + U64(header_.sync_id) + ": tensor " + Quote(range.name);
  if (range.name.empty() || range.name.size() > kMaxTensorNameBytes) {
    return Status::InvalidArgument(what + ": name of " + U64(range.name.size()) +
                                   " bytes (1 to 1024)");
  }
  if (!IsUtf8(range.name)) return Status::InvalidArgument(what + ": name is not UTF-8");
  if (range.shape.size() > kMaxTensorDims) {
    return Status::InvalidArgument(what + ": " + U64(range.shape.size()) +
                                   " dimensions (at most 16)");
  }
  std::vector<uint64_t> dims;
  bool negative = false;
  for (int64_t d : range.shape) {
    negative |= d < 0;
    dims.push_back(static_cast<uint64_t>(d));
  }
  const std::optional<uint64_t> elements =
      negative ? std::nullopt : ShapeElements(std::span<const uint64_t>(dims));
  if (!elements) {
    return Status::InvalidArgument(
        what + ": shape " +
        ShapeToString(std::vector<int64_t>(range.shape.begin(), range.shape.end())) +
        " is negative or has more than 2^56 elements");
  }
  if (range.first > *elements || range.count > *elements - range.first) {
    return Status::InvalidArgument(what + ": range [" + U64(range.first) + ", +" +
                                   U64(range.count) + ") is outside its " + U64(*elements) +
                                   " elements");
  }
  if (header_.kind == FrameKind::kSeed && encoding != WireEncoding::kDense) {
    return Status::InvalidArgument(what + ": a seed frame holds only dense entries, not " +
                                   std::string(WireEncodingName(encoding)));
  }
  if (entry_count_ >= kMaxFlushEntries) {
    return Status::InvalidArgument(what + ": the frame already holds 2^20 entries");
  }
  const auto it = tensors_.find(range.name);
  if (it != tensors_.end()) {
    const TensorEntries& t = it->second;
    if (t.dtype != range.dtype ||
        !std::equal(t.shape.begin(), t.shape.end(), range.shape.begin(), range.shape.end())) {
      return Status::InvalidArgument(what + ": another dtype or shape than its earlier entry");
    }
    const uint64_t end = range.first + range.count;
    auto next = t.ranges.upper_bound(range.first);
    if (next != t.ranges.end() && next->first < end) {
      return Status::InvalidArgument(what + ": range [" + U64(range.first) + ", " + U64(end) +
                                     ") overlaps an earlier entry's");
    }
    if (next != t.ranges.begin() && std::prev(next)->second > range.first) {
      return Status::InvalidArgument(what + ": range [" + U64(range.first) + ", " + U64(end) +
                                     ") overlaps an earlier entry's");
    }
  }
  *numel = *elements;
  return Status::OK();
}

Status FlushWriter::CheckValues(const TensorRange& range, const Positions* positions,
                                std::span<const uint8_t> values) const {
  const std::string what =
      "flush writer: sync " + U64(header_.sync_id) + ": tensor " + Quote(range.name);
  const uint64_t w = DTypeSize(range.dtype);
  const uint64_t n = positions ? positions->size() : range.count;
  if (values.size() % w != 0 || values.size() / w != n) {
    return Status::InvalidArgument(what + ": " + U64(values.size()) + " value bytes for " + U64(n) +
                                   " elements of " + U64(w) + " bytes");
  }
  if (positions) {
    Status checked = positions->Check(range.first + range.count);
    if (!checked.ok()) return checked.WithContext(what);
    if (n > 0 && (*positions)[0] < range.first) {
      return Status::InvalidArgument(what + ": position " + U64((*positions)[0]) +
                                     " is before the range's first element " + U64(range.first));
    }
  }
  return Status::OK();
}

void FlushWriter::AppendEntry(const TensorRange& range, WireEncoding encoding, uint64_t n,
                              uint64_t pos_off, uint64_t pos_bytes, uint64_t val_off,
                              uint64_t val_bytes) {
  Append(&manifest_, range.name.size(), 2);
  manifest_.push_back(DTypeWireCode(range.dtype));
  manifest_.push_back(static_cast<uint8_t>(encoding));
  manifest_.push_back(static_cast<uint8_t>(range.shape.size()));
  manifest_.insert(manifest_.end(), 3, 0);  // reserved
  Append(&manifest_, range.first, 8);
  Append(&manifest_, range.count, 8);
  Append(&manifest_, n, 8);
  Append(&manifest_, pos_off, 8);
  Append(&manifest_, pos_bytes, 8);
  Append(&manifest_, val_off, 8);
  Append(&manifest_, val_bytes, 8);
  for (int64_t d : range.shape) Append(&manifest_, static_cast<uint64_t>(d), 8);
  manifest_.insert(manifest_.end(), range.name.begin(), range.name.end());
  ++entry_count_;
  auto it = tensors_.find(range.name);
  if (it == tensors_.end()) {
    it = tensors_
             .emplace(
                 std::string(range.name),
                 TensorEntries{
                     range.dtype, std::vector<int64_t>(range.shape.begin(), range.shape.end()), {}})
             .first;
  }
  it->second.ranges[range.first] = range.first + range.count;
}

Status FlushWriter::CheckMode(bool placed) const {
  if (out_ != nullptr && placed_ != placed) {
    return Status::FailedPrecondition(
        placed_ ? "flush writer: a placed frame takes Place calls, not Add"
                : "flush writer: Place calls are for a frame begun with BeginPlaced");
  }
  return Status::OK();
}

Result<bool> FlushWriter::AddDense(const TensorRange& range, std::span<const uint8_t> values) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(false));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kDense, &numel));
  DS_RETURN_IF_ERROR(CheckValues(range, nullptr, values));
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  const uint64_t off = Align8(end_);
  if (!Fits(off + values.size(), entry_bytes)) return false;
  out_->resize(off);
  out_->insert(out_->end(), values.begin(), values.end());
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kDense, range.count, off, 0, off, values.size());
  return true;
}

Result<bool> FlushWriter::AddIndices(const TensorRange& range, const Positions& positions,
                                     std::span<const uint8_t> values) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(false));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kIndices, &numel));
  DS_RETURN_IF_ERROR(CheckValues(range, &positions, values));
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  const uint32_t width = PositionWidth(numel);
  const uint64_t n = positions.size();
  const uint64_t pos_off = Align8(end_);
  const uint64_t val_off = Align8(pos_off + n * width);
  if (!Fits(val_off + values.size(), entry_bytes)) return false;
  out_->resize(val_off);
  uint8_t* p = out_->data() + pos_off;
  for (uint64_t k = 0; k < n; ++k) StoreLeWidth(p + k * width, positions[k], width);
  out_->insert(out_->end(), values.begin(), values.end());
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kIndices, n, pos_off, n * width, val_off, values.size());
  return true;
}

Result<size_t> FlushWriter::Compress(std::span<const uint8_t> content, uint64_t offset) {
  out_->resize(offset + ZSTD_compressBound(content.size()));
  ZSTD_CCtx* cctx = zstd_->cctx;
  ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, zstd_level_);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0);
  const size_t written = ZSTD_compress2(cctx, out_->data() + offset, out_->size() - offset,
                                        content.data(), content.size());
  if (ZSTD_isError(written)) {
    return Status::Internal("flush writer: zstd: " + std::string(ZSTD_getErrorName(written)));
  }
  out_->resize(offset + written);
  return written;
}

Result<bool> FlushWriter::AddSparse(const TensorRange& range, const Positions& positions,
                                    std::span<const uint8_t> values) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(false));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kSparse, &numel));
  DS_RETURN_IF_ERROR(CheckValues(range, &positions, values));
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  const uint64_t n = positions.size();
  const uint64_t start = out_->size();
  const uint64_t pos_off = Align8(start);
  if (n == 0) {
    if (!Fits(pos_off, entry_bytes)) return false;
    out_->resize(pos_off);
    end_ = pos_off;
    AppendEntry(range, WireEncoding::kSparse, 0, pos_off, 0, pos_off, 0);
    return true;
  }
  const uint32_t w = static_cast<uint32_t>(DTypeSize(range.dtype));
  // Every gap takes a byte at least: refuse what cannot fit before building.
  if (sparse_decoded_ + n + values.size() > sparse_decoded_limit_) return false;
  gaps_.clear();
  uint64_t next = range.first;
  for (uint64_t k = 0; k < n; ++k) {
    AppendGap(&gaps_, positions[k] - next);
    next = positions[k] + 1;
  }
  if (sparse_decoded_ + gaps_.size() + values.size() > sparse_decoded_limit_) return false;
  planes_.resize(values.size());
  for (uint32_t j = 0; j < w; ++j) {
    uint8_t* plane = planes_.data() + j * n;
    for (uint64_t k = 0; k < n; ++k) plane[k] = values[k * w + j];
  }
  // A frame cannot exceed its budget by more than one entry's compressed
  // bytes before it is cut back, so an entry that does not fit costs its
  // compression but no lasting memory.
  Result<size_t> compressed = Compress(gaps_, pos_off);
  if (!compressed.ok()) {
    out_->resize(start);
    return compressed.status();
  }
  const size_t pos_bytes = *compressed;
  const uint64_t val_off = Align8(pos_off + pos_bytes);
  Result<size_t> val_bytes = Compress(planes_, val_off);
  if (!val_bytes.ok() || !Fits(val_off + *val_bytes, entry_bytes)) {
    out_->resize(start);
    if (!val_bytes.ok()) return val_bytes.status();
    return false;
  }
  // Compress resized the buffer with value-initialized bytes: the padding
  // before each region is zero.
  sparse_decoded_ += gaps_.size() + values.size();
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kSparse, n, pos_off, pos_bytes, val_off, *val_bytes);
  return true;
}

Result<std::optional<PlacedEntry>> FlushWriter::PlaceDense(const TensorRange& range) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(true));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kDense, &numel));
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  PlacedEntry e;
  e.positions_offset = Align8(end_);
  e.values_offset = e.positions_offset;
  e.values_bytes = range.count * DTypeSize(range.dtype);
  if (!Fits(e.values_offset + e.values_bytes, entry_bytes)) return std::optional<PlacedEntry>();
  end_ = e.values_offset + e.values_bytes;
  AppendEntry(range, WireEncoding::kDense, range.count, e.positions_offset, 0, e.values_offset,
              e.values_bytes);
  return std::optional<PlacedEntry>(e);
}

Result<std::optional<PlacedEntry>> FlushWriter::PlaceIndices(const TensorRange& range, uint64_t n) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(true));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kIndices, &numel));
  if (n > range.count) {
    return Status::InvalidArgument("flush writer: sync " + U64(header_.sync_id) + ": tensor " +
                                   Quote(range.name) + ": " + U64(n) + " positions in a range of " +
                                   U64(range.count));
  }
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  PlacedEntry e;
  e.position_width = PositionWidth(numel);
  e.positions_offset = Align8(end_);
  e.positions_bytes = n * e.position_width;
  e.values_offset = Align8(e.positions_offset + e.positions_bytes);
  e.values_bytes = n * DTypeSize(range.dtype);
  if (!Fits(e.values_offset + e.values_bytes, entry_bytes)) return std::optional<PlacedEntry>();
  end_ = e.values_offset + e.values_bytes;
  AppendEntry(range, WireEncoding::kIndices, n, e.positions_offset, e.positions_bytes,
              e.values_offset, e.values_bytes);
  return std::optional<PlacedEntry>(e);
}

Result<bool> FlushWriter::AddDigest(std::string_view name, const DigestBlock& block,
                                    const StateDigest& digest) {
  if (out_ == nullptr) return Status::FailedPrecondition("flush writer: no frame begun");
  const std::string what =
      "flush writer: sync " + U64(header_.sync_id) + ": digest of tensor " + Quote(name);
  if (name.empty() || name.size() > kMaxTensorNameBytes) {
    return Status::InvalidArgument(what + ": name of " + U64(name.size()) + " bytes (1 to 1024)");
  }
  if (!IsUtf8(name)) return Status::InvalidArgument(what + ": name is not UTF-8");
  Status valid = block.Validate();
  if (!valid.ok()) return valid.WithContext(what);
  if (digest_count_ >= kMaxFlushDigests) {
    return Status::InvalidArgument(what + ": the frame already holds 2^20 digest records");
  }
  auto key =
      std::make_tuple(std::string(name), block.first, block.count, block.rows, block.row_stride);
  if (digest_keys_.count(key)) {
    return Status::InvalidArgument(what + ": block " + block.ToString() +
                                   " already has a record in this frame");
  }
  const size_t record_bytes = kDigestFixedBytes + name.size();
  if (!Fits(end_, record_bytes)) return false;
  Append(&records_, name.size(), 2);
  records_.insert(records_.end(), 6, 0);  // reserved
  Append(&records_, block.first, 8);
  Append(&records_, block.count, 8);
  Append(&records_, block.rows, 8);
  Append(&records_, block.row_stride, 8);
  Append(&records_, digest.a, 8);
  Append(&records_, digest.b, 8);
  records_.insert(records_.end(), name.begin(), name.end());
  digest_keys_.insert(std::move(key));
  ++digest_count_;
  return true;
}

Status FlushWriter::Finish() {
  if (out_ == nullptr) return Status::FailedPrecondition("flush writer: no frame begun");
  const uint64_t payload_end = Align8(end_);
  // A placed frame's payload lies elsewhere: *out keeps the header alone.
  if (!placed_) out_->resize(payload_end);
  const uint64_t payload = payload_end - kFlushHeaderBytes;
  out_->insert(out_->end(), manifest_.begin(), manifest_.end());
  out_->insert(out_->end(), records_.begin(), records_.end());
  const uint64_t total = payload_end + manifest_.size() + records_.size() + kFlushTrailerBytes;
  uint8_t* h = out_->data();
  std::memcpy(h, kMagic, 4);
  StoreLe<uint16_t>(h + 4, kFlushFrameVersion);
  uint16_t flags = header_.kind == FrameKind::kSeed ? kFlagSeed : kFlagDelta;
  if (header_.last) flags |= kFlagLast;
  if (header_.verify_all) flags |= kFlagVerifyAll;
  StoreLe<uint16_t>(h + 6, flags);
  StoreLe<uint64_t>(h + 8, header_.sync_id);
  StoreLe<uint32_t>(h + 16, header_.flush_index);
  StoreLe<uint32_t>(h + 20, entry_count_);
  StoreLe<uint32_t>(h + 24, digest_count_);
  StoreLe<uint32_t>(h + 28, 0);
  StoreLe<uint64_t>(h + 32, total);
  StoreLe<uint64_t>(h + 40, payload);
  StoreLe<uint64_t>(h + 48, manifest_.size() + records_.size());
  StoreLe<uint64_t>(h + 56, 0);
  if (!placed_) {
    const std::vector<uint8_t> sum = ChecksumBytes(ChecksumAlgo::kXxh3_128, *out_);
    out_->insert(out_->end(), sum.begin(), sum.end());
  }
  out_ = nullptr;
  return Status::OK();
}

// ---------------------------------------------------------------------------
// Reader

struct FlushReader::ZstdContexts {
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  ~ZstdContexts() { ZSTD_freeDCtx(dctx); }
};

FlushReader::FlushReader() : zstd_(std::make_unique<ZstdContexts>()) {}
FlushReader::~FlushReader() = default;

namespace {

// Where an entry's regions lie, kept while the reader checks the payload.
struct RawRegions {
  uint64_t pos_off, pos_bytes, val_off, val_bytes;
};

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
    const uint64_t raw = LoadLe<UintOfWidth<W>>(p + k * W);
    if (raw >= next && raw < end) {  // end <= 2^56: a negative one is never below it
      next = raw + 1;
      continue;
    }
    const bool negative = raw >> (8 * W - 1);
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
  entries_.clear();
  digests_.clear();
}

Status FlushReader::Read(std::span<const uint8_t> frame) {
  Clear();
  const uint64_t size = frame.size();
  const uint8_t* f = frame.data();
  if (size < kFlushHeaderBytes + kFlushTrailerBytes) {
    return Status::Corruption("flush frame of " + U64(size) +
                              " bytes: shorter than a 64-byte header and a 16-byte trailer");
  }
  // 2. Nothing is believed before the checksum.
  const std::vector<uint8_t> sum =
      ChecksumBytes(ChecksumAlgo::kXxh3_128, frame.first(size - kFlushTrailerBytes));
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
  if (version != kFlushFrameVersion) {
    return Status::Unsupported(where + ": protocol version " + U64(version) +
                               " (this reader knows version 1)");
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
  std::vector<FlushEntry> entries(entry_count);
  std::vector<RawRegions> regions(entry_count);
  std::vector<uint64_t> dims;
  for (uint32_t e = 0; e < entry_count; ++e) {
    const std::string at = "entry " + U64(e);
    if (manifest_end - c < kEntryFixedBytes) return bad(at + ": cut short by the manifest's end");
    const uint8_t* m = mf + c;
    const uint16_t name_len = LoadLe<uint16_t>(m);
    const uint8_t code = m[2], encoding = m[3], ndim = m[4];
    if (name_len == 0 || name_len > kMaxTensorNameBytes) {
      return bad(at + ": name of " + U64(name_len) + " bytes (1 to 1024)");
    }
    if (ndim > kMaxTensorDims) return bad(at + ": " + U64(ndim) + " dimensions (at most 16)");
    if (manifest_end - c - kEntryFixedBytes < uint64_t{8} * ndim + name_len) {
      return bad(at + ": shape and name cut short by the manifest's end");
    }
    FlushEntry& entry = entries[e];
    entry.name =
        std::string_view(reinterpret_cast<const char*>(m + kEntryFixedBytes + 8 * ndim), name_len);
    const std::string what = at + " (" + Quote(entry.name) + ")";
    if (!IsUtf8(entry.name)) return bad(what + ": name is not UTF-8");
    if (!AllZero(m + 5, 3)) return bad(what + ": reserved bytes are not 0");
    const std::optional<DType> dtype = DTypeFromWireCode(code);
    if (!dtype) return bad(what + ": unknown dtype code " + U64(code));
    entry.dtype = *dtype;
    if (encoding > static_cast<uint8_t>(WireEncoding::kSparse)) {
      return bad(what + ": unknown encoding " + U64(encoding));
    }
    entry.encoding = static_cast<WireEncoding>(encoding);
    dims.resize(ndim);
    for (uint32_t d = 0; d < ndim; ++d) dims[d] = LoadLe<uint64_t>(m + kEntryFixedBytes + 8 * d);
    const std::optional<uint64_t> numel = ShapeElements(std::span<const uint64_t>(dims));
    if (!numel) return bad(what + ": a dimension or the element count is past 2^56");
    entry.numel = *numel;
    entry.shape.assign(dims.begin(), dims.end());
    entry.first = LoadLe<uint64_t>(m + 8);
    entry.count = LoadLe<uint64_t>(m + 16);
    entry.value_count = LoadLe<uint64_t>(m + 24);
    if (entry.first > entry.numel || entry.count > entry.numel - entry.first) {
      return bad(what + ": range [" + U64(entry.first) + ", +" + U64(entry.count) +
                 ") is outside its " + U64(entry.numel) + " elements");
    }
    const uint64_t n = entry.value_count;
    if (entry.encoding == WireEncoding::kDense ? n != entry.count : n > entry.count) {
      return bad(what + ": " + U64(n) + " values for " +
                 std::string(WireEncodingName(entry.encoding)) + " over a range of " +
                 U64(entry.count));
    }
    if (seed && entry.encoding != WireEncoding::kDense) {
      return bad(what + ": a seed frame holds only dense entries, not " +
                 std::string(WireEncodingName(entry.encoding)));
    }
    regions[e] = {LoadLe<uint64_t>(m + 32), LoadLe<uint64_t>(m + 40), LoadLe<uint64_t>(m + 48),
                  LoadLe<uint64_t>(m + 56)};
    c += kEntryFixedBytes + 8 * ndim + name_len;
  }

  // 7. Digest records.
  std::vector<FlushDigest> digests(digest_count);
  for (uint32_t g = 0; g < digest_count; ++g) {
    const std::string at = "digest record " + U64(g);
    if (manifest_end - c < kDigestFixedBytes) {
      return bad(at + ": cut short by the manifest's end");
    }
    const uint8_t* m = mf + c;
    const uint16_t name_len = LoadLe<uint16_t>(m);
    if (name_len == 0 || name_len > kMaxTensorNameBytes) {
      return bad(at + ": name of " + U64(name_len) + " bytes (1 to 1024)");
    }
    if (manifest_end - c - kDigestFixedBytes < name_len) {
      return bad(at + ": name cut short by the manifest's end");
    }
    FlushDigest& record = digests[g];
    record.name = std::string_view(reinterpret_cast<const char*>(m + kDigestFixedBytes), name_len);
    const std::string what = at + " (" + Quote(record.name) + ")";
    if (!IsUtf8(record.name)) return bad(what + ": name is not UTF-8");
    if (!AllZero(m + 2, 6)) return bad(what + ": reserved bytes are not 0");
    record.block = {LoadLe<uint64_t>(m + 8), LoadLe<uint64_t>(m + 16), LoadLe<uint64_t>(m + 24),
                    LoadLe<uint64_t>(m + 32)};
    Status valid = record.block.Validate();
    if (!valid.ok()) return bad(what + ": " + valid.message());
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
  const auto zero = [&](uint64_t off, uint64_t bytes, const std::string& problem) -> bool {
    if (bytes == 0) return true;
    if (check == nullptr) return AllZero(f + off, bytes);
    checks.zeros.push_back({off, bytes});
    check_problems.push_back(problem);
    return true;
  };
  uint64_t cursor = payload_begin;
  auto region = [&](const std::string& what, const char* kind, uint64_t off, uint64_t bytes,
                    uint64_t expected_bytes, bool any_size) -> std::string {
    const uint64_t expected_off = Align8(cursor);
    if (off != expected_off) {
      return what + ": " + kind + " at offset " + U64(off) + ", not " + U64(expected_off);
    }
    if (expected_off > payload_end || bytes > payload_end - expected_off) {
      return what + ": " + kind + " of " + U64(bytes) + " bytes at " + U64(off) +
             " run past the payload's end " + U64(payload_end);
    }
    if (!any_size && bytes != expected_bytes) {
      return what + ": " + kind + " of " + U64(bytes) + " bytes, not " + U64(expected_bytes);
    }
    const std::string padding = what + ": padding before its " + kind + " is not 0";
    if (!zero(cursor, expected_off - cursor, padding)) return padding;
    cursor = off + bytes;
    return "";
  };
  for (uint32_t e = 0; e < entry_count; ++e) {
    FlushEntry& entry = entries[e];
    const RawRegions& r = regions[e];
    const std::string what = "entry " + U64(e) + " (" + Quote(entry.name) + ")";
    const uint64_t w = DTypeSize(entry.dtype), n = entry.value_count;
    uint64_t pos_expected = 0;
    bool sparse = false;
    switch (entry.encoding) {
      case WireEncoding::kDense: break;
      case WireEncoding::kIndices:
        entry.position_width = PositionWidth(entry.numel);
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
  if (!zero(cursor, payload_end - cursor, "the payload's padding is not 0")) {
    return bad("the payload's padding is not 0");
  }

  // 10. Positions. Sparse sizes first, so the scratch is sized once.
  std::vector<std::pair<uint64_t, uint64_t>> sparse_sizes(entry_count, {0, 0});
  uint64_t decoded = 0;
  for (uint32_t e = 0; e < entry_count; ++e) {
    FlushEntry& entry = entries[e];
    const std::string what = "entry " + U64(e) + " (" + Quote(entry.name) + ")";
    const uint64_t n = entry.value_count;
    if (entry.encoding == WireEncoding::kIndices && check != nullptr) {
      checks.positions.push_back({static_cast<uint64_t>(entry.positions.data() - base), n,
                                  entry.position_width, entry.first, entry.first + entry.count});
      check_problems.push_back(what + ": positions not strictly increasing inside the range [" +
                               U64(entry.first) + ", " + U64(entry.first + entry.count) + ")");
    } else if (entry.encoding == WireEncoding::kIndices) {
      const std::string problem =
          entry.position_width == 4 ? CheckIndexPositions<4>(entry) : CheckIndexPositions<8>(entry);
      if (!problem.empty()) return bad(what + ": " + problem);
    } else if (entry.encoding == WireEncoding::kSparse && n > 0 && check != nullptr) {
      // zstd content is decoded on the host: the caller reads the frame
      // from a host copy.
      *needs_host = true;
      return Status::OK();
    } else if (entry.encoding == WireEncoding::kSparse && n > 0) {
      const uint64_t w = DTypeSize(entry.dtype);
      uint64_t gap_bytes = 0, value_bytes = 0;
      std::string problem = CheckZstdRegion(entry.positions, n, kMaxGapBytes * n, &gap_bytes);
      if (!problem.empty()) return bad(what + ": positions " + problem);
      problem = CheckZstdRegion(entry.values, n * w, n * w, &value_bytes);
      if (!problem.empty()) return bad(what + ": values " + problem);
      if (gap_bytes + value_bytes > kMaxSparseDecodedBytes - decoded) {
        return bad(what + ": sparse entries decompress to more than 2^30 bytes");
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
      const std::string what = "entry " + U64(e) + " (" + Quote(entry.name) + ")";
      const uint64_t w = DTypeSize(entry.dtype), n = entry.value_count;
      uint8_t* gaps = decoded_.data() + at;
      size_t got = ZSTD_decompressDCtx(zstd_->dctx, gaps, gap_bytes, entry.positions.data(),
                                       entry.positions.size());
      if (ZSTD_isError(got) || got != gap_bytes) {
        return bad(what + ": positions do not decompress to their recorded " + U64(gap_bytes) +
                   " bytes" +
                   (ZSTD_isError(got) ? " (" + std::string(ZSTD_getErrorName(got)) + ")" : ""));
      }
      const std::string problem =
          CheckGaps({gaps, gap_bytes}, n, entry.first, entry.first + entry.count);
      if (!problem.empty()) return bad(what + ": " + problem);
      uint8_t* values = gaps + gap_bytes;
      uint8_t* planes = values;
      if (w > 1) {
        planes_.resize(value_bytes);
        planes = planes_.data();
      }
      got = ZSTD_decompressDCtx(zstd_->dctx, planes, value_bytes, entry.values.data(),
                                entry.values.size());
      if (ZSTD_isError(got) || got != value_bytes) {
        return bad(what + ": values do not decompress to their recorded " + U64(value_bytes) +
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

  // 11. One tensor's entries agree and do not overlap; records are unique.
  std::vector<uint32_t> order(entry_count);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
    const FlushEntry &a = entries[x], &b = entries[y];
    return std::tie(a.name, a.first, x) < std::tie(b.name, b.first, y);
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const FlushEntry &prev = entries[order[k - 1]], &cur = entries[order[k]];
    if (prev.name != cur.name) continue;
    const std::string what =
        "entries " + U64(order[k - 1]) + " and " + U64(order[k]) + " (" + Quote(cur.name) + ")";
    if (prev.dtype != cur.dtype || prev.shape != cur.shape) {
      return bad(what + ": different dtypes or shapes for one tensor");
    }
    if (cur.first < prev.first + prev.count) {
      return bad(what + ": ranges [" + U64(prev.first) + ", " + U64(prev.first + prev.count) +
                 ") and [" + U64(cur.first) + ", " + U64(cur.first + cur.count) + ") overlap");
    }
  }
  std::vector<uint32_t> record_order(digest_count);
  std::iota(record_order.begin(), record_order.end(), 0);
  auto record_key = [&](uint32_t g) {
    const FlushDigest& r = digests[g];
    return std::tie(r.name, r.block.first, r.block.count, r.block.rows, r.block.row_stride);
  };
  std::sort(record_order.begin(), record_order.end(),
            [&](uint32_t x, uint32_t y) { return record_key(x) < record_key(y); });
  for (size_t k = 1; k < record_order.size(); ++k) {
    if (record_key(record_order[k - 1]) == record_key(record_order[k])) {
      const FlushDigest& r = digests[record_order[k]];
      return bad("digest records " + U64(std::min(record_order[k - 1], record_order[k])) + " and " +
                 U64(std::max(record_order[k - 1], record_order[k])) + " (" + Quote(r.name) +
                 "): both for block " + r.block.ToString());
    }
  }

  header_.sync_id = sync_id;
  header_.flush_index = flush_index;
  header_.kind = seed ? FrameKind::kSeed : FrameKind::kDelta;
  header_.last = flags & kFlagLast;
  header_.verify_all = flags & kFlagVerifyAll;
  entries_ = std::move(entries);
  digests_ = std::move(digests);
  return Status::OK();
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
  if (version != kFlushFrameVersion) {
    return Status::Unsupported("flush frame header: protocol version " + U64(version) +
                               " (this reader knows version 1)");
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

// ---------------------------------------------------------------------------
// Destinations

DestinationMap DestinationMap::Whole(uint64_t numel) {
  DestinationMap map;
  map.hf_numel_ = numel;
  if (numel > 0) {
    map.runs_.push_back({0, numel, 0, 1});
    map.dest_extent_ = numel;
    map.held_ = numel;
  }
  return map;
}

Result<DestinationMap> DestinationMap::Create(uint64_t hf_numel, std::vector<DestinationRun> runs) {
  if (hf_numel > kMaxStreamNumel) {
    return Status::InvalidArgument("destination map: " + U64(hf_numel) + " elements is past 2^56");
  }
  std::sort(runs.begin(), runs.end(), [](const DestinationRun& x, const DestinationRun& y) {
    return x.hf_first < y.hf_first;
  });
  DestinationMap map;
  map.hf_numel_ = hf_numel;
  uint64_t previous_end = 0;
  for (size_t k = 0; k < runs.size(); ++k) {
    const DestinationRun& r = runs[k];
    const std::string what = "destination map: run [" + U64(r.hf_first) + ", +" + U64(r.count) +
                             ") -> " + U64(r.dest_offset) + " step " + U64(r.dest_stride);
    if (r.count == 0) return Status::InvalidArgument(what + ": no elements");
    if (r.dest_stride == 0) return Status::InvalidArgument(what + ": stride 0");
    if (r.hf_first > hf_numel || r.count > hf_numel - r.hf_first) {
      return Status::InvalidArgument(what + ": outside the tensor's " + U64(hf_numel) +
                                     " elements");
    }
    if (k > 0 && r.hf_first < previous_end) {
      return Status::InvalidArgument(what + ": overlaps the run before it in the tensor");
    }
    uint64_t span = 0, last = 0;
    if (__builtin_mul_overflow(r.count - 1, r.dest_stride, &span) ||
        __builtin_add_overflow(r.dest_offset, span, &last) || last == ~uint64_t{0}) {
      return Status::InvalidArgument(what + ": destination elements past 2^64");
    }
    map.dest_extent_ = std::max(map.dest_extent_, last + 1);
    map.held_ += r.count;
    previous_end = r.hf_first + r.count;
  }
  map.runs_ = std::move(runs);
  return map;
}

Result<DestinationMap> DestinationMap::FromBlock(uint64_t hf_numel, const DigestBlock& block,
                                                 uint64_t dest_offset, uint64_t dest_row_stride) {
  Status valid = block.Validate();
  if (!valid.ok()) return valid.WithContext("destination map");
  if (block.end() > hf_numel) {
    return Status::InvalidArgument("destination map: block " + block.ToString() +
                                   " is outside the tensor's " + U64(hf_numel) + " elements");
  }
  if (block.rows > 1 && dest_row_stride < block.count) {
    return Status::InvalidArgument("destination map: block " + block.ToString() +
                                   ": destination rows of " + U64(dest_row_stride) +
                                   " elements are shorter than the block's " + U64(block.count));
  }
  std::vector<DestinationRun> runs;
  if (block.count == 0) return Create(hf_numel, std::move(runs));
  runs.reserve(block.rows);
  for (uint64_t r = 0; r < block.rows; ++r) {
    uint64_t offset = 0;
    if (__builtin_mul_overflow(r, dest_row_stride, &offset) ||
        __builtin_add_overflow(offset, dest_offset, &offset)) {
      return Status::InvalidArgument("destination map: block " + block.ToString() +
                                     ": destination elements past 2^64");
    }
    runs.push_back({block.first + r * block.row_stride, block.count, offset, 1});
  }
  return Create(hf_numel, std::move(runs));
}

std::optional<DigestBlock> DestinationMap::AsBlock() const {
  // Runs that touch in the tensor are one row.
  std::vector<std::pair<uint64_t, uint64_t>> rows;  // first, count
  for (const DestinationRun& r : runs_) {
    if (!rows.empty() && rows.back().first + rows.back().second == r.hf_first) {
      rows.back().second += r.count;
    } else {
      rows.emplace_back(r.hf_first, r.count);
    }
  }
  if (rows.empty()) return DigestBlock{};
  if (rows.size() == 1) return DigestBlock::Range(rows[0].first, rows[0].second);
  const uint64_t count = rows[0].second, stride = rows[1].first - rows[0].first;
  for (size_t k = 1; k < rows.size(); ++k) {
    if (rows[k].second != count || rows[k].first - rows[k - 1].first != stride) {
      return std::nullopt;
    }
  }
  return DigestBlock{rows[0].first, count, rows.size(), stride};
}

namespace {

// The first run whose end is past `position`.
size_t FirstRunFrom(std::span<const DestinationRun> runs, uint64_t position) {
  auto it = std::upper_bound(runs.begin(), runs.end(), position,
                             [](uint64_t p, const DestinationRun& r) { return p < r.hf_first; });
  if (it != runs.begin() && std::prev(it)->hf_first + std::prev(it)->count > position) --it;
  return static_cast<size_t>(it - runs.begin());
}

template <uint32_t W>
inline void CopyElement(uint8_t* dst, const uint8_t* src) {
  std::memcpy(dst, src, W);
}

template <uint32_t W, bool kDigest>
uint64_t ApplyDense(const FlushEntry& entry, std::span<const DestinationRun> runs, uint8_t* dest,
                    StateDigest* digest) {
  const uint64_t first = entry.first, end = entry.first + entry.count;
  uint64_t written = 0;
  for (size_t r = FirstRunFrom(runs, first); r < runs.size() && runs[r].hf_first < end; ++r) {
    const DestinationRun& run = runs[r];
    const uint64_t lo = std::max(first, run.hf_first);
    const uint64_t hi = std::min(end, run.hf_first + run.count);
    if (lo >= hi) continue;
    const uint8_t* src = entry.values.data() + (lo - first) * W;
    uint8_t* dst = dest + (run.dest_offset + (lo - run.hf_first) * run.dest_stride) * W;
    const uint64_t n = hi - lo;
    if (run.dest_stride == 1) {
      if constexpr (kDigest) {
        // Both spans are valid element runs below 2^56: these cannot fail.
        *digest -= ComputeStateDigest({dst, n * W}, W, lo).value();
        *digest += ComputeStateDigest({src, n * W}, W, lo).value();
      }
      std::memcpy(dst, src, n * W);
    } else {
      const uint64_t step = run.dest_stride * W;
      for (uint64_t k = 0; k < n; ++k, dst += step, src += W) {
        if constexpr (kDigest) {
          *digest += ElementChangeDigest(lo + k, LoadLe<UintOfWidth<W>>(dst),
                                         LoadLe<UintOfWidth<W>>(src), W);
        }
        CopyElement<W>(dst, src);
      }
    }
    written += n;
  }
  return written;
}

// Scattered positions touch a new cache line every few elements, and the
// digest reads each old value before it is overwritten: resolved in batches,
// with each destination prefetched a few slots ahead, the reads overlap
// instead of waiting on memory one at a time.
template <uint32_t W, bool kDigest>
uint64_t ApplyScattered(const FlushEntry& entry, std::span<const DestinationRun> runs,
                        uint8_t* dest, StateDigest* digest) {
  constexpr size_t kBatch = 256, kAhead = 16;
  struct Slot {
    uint64_t position;
    const uint8_t* src;
    uint8_t* dst;
  };
  Slot batch[kBatch];
  size_t fill = 0;
  size_t r = FirstRunFrom(runs, entry.first);
  uint64_t written = 0;
  StateDigest d;
  if constexpr (kDigest) d = *digest;
  const auto drain = [&] {
    for (size_t i = 0; i < fill; ++i) {
      if (i + kAhead < fill) __builtin_prefetch(batch[i + kAhead].dst, 1);
      const Slot& s = batch[i];
      if constexpr (kDigest) {
        d += ElementChangeDigest(s.position, LoadLe<UintOfWidth<W>>(s.dst),
                                 LoadLe<UintOfWidth<W>>(s.src), W);
      }
      CopyElement<W>(s.dst, s.src);
    }
    written += fill;
    fill = 0;
  };
  const uint8_t* values = entry.values.data();
  ForEachPosition(entry, [&](uint64_t k, uint64_t p) {
    while (r < runs.size() && runs[r].hf_first + runs[r].count <= p) ++r;
    if (r == runs.size() || p < runs[r].hf_first) return;  // another receiver's
    const DestinationRun& run = runs[r];
    uint8_t* dst = dest + (run.dest_offset + (p - run.hf_first) * run.dest_stride) * W;
    if (fill < kAhead) __builtin_prefetch(dst, 1);
    batch[fill++] = {p, values + k * W, dst};
    if (fill == kBatch) drain();
  });
  drain();
  if constexpr (kDigest) *digest = d;
  return written;
}

template <uint32_t W>
uint64_t ApplyWidth(const FlushEntry& entry, std::span<const DestinationRun> runs, uint8_t* dest,
                    StateDigest* digest) {
  if (entry.encoding == WireEncoding::kDense) {
    return digest ? ApplyDense<W, true>(entry, runs, dest, digest)
                  : ApplyDense<W, false>(entry, runs, dest, digest);
  }
  return digest ? ApplyScattered<W, true>(entry, runs, dest, digest)
                : ApplyScattered<W, false>(entry, runs, dest, digest);
}

}  // namespace

Result<uint64_t> ApplyEntry(const FlushEntry& entry, const DestinationMap& map,
                            std::span<uint8_t> dest, StateDigest* digest) {
  const uint32_t w = static_cast<uint32_t>(DTypeSize(entry.dtype));
  if (!entry.host_readable) {
    return Status::InvalidArgument("apply: tensor " + Quote(entry.name) +
                                   ": the entry lies in memory the host does not read (a "
                                   "placed frame); apply it where it lies");
  }
  if (map.hf_numel() != entry.numel) {
    return Status::InvalidArgument("apply: tensor " + Quote(entry.name) + " has " +
                                   U64(entry.numel) + " elements, its destination map " +
                                   U64(map.hf_numel()));
  }
  if (dest.size() / w < map.dest_extent()) {
    return Status::InvalidArgument("apply: tensor " + Quote(entry.name) + ": destination of " +
                                   U64(dest.size()) + " bytes, its map needs " +
                                   U64(map.dest_extent()) + " elements of " + U64(w));
  }
  switch (w) {
    case 1: return ApplyWidth<1>(entry, map.runs(), dest.data(), digest);
    case 2: return ApplyWidth<2>(entry, map.runs(), dest.data(), digest);
    case 4: return ApplyWidth<4>(entry, map.runs(), dest.data(), digest);
    default: return ApplyWidth<8>(entry, map.runs(), dest.data(), digest);
  }
}

Result<StateDigest> DigestDestination(const DestinationMap& map, std::span<const uint8_t> dest,
                                      uint32_t elem_size, const DigestOptions& options) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
    return Status::InvalidArgument("destination digest: element size " + U64(elem_size) +
                                   " is not 1, 2, 4 or 8");
  }
  if (dest.size() / elem_size < map.dest_extent()) {
    return Status::InvalidArgument("destination digest: destination of " + U64(dest.size()) +
                                   " bytes, its map needs " + U64(map.dest_extent()) +
                                   " elements of " + U64(elem_size));
  }
  StateDigest d;
  for (const DestinationRun& run : map.runs()) {
    const std::span<const uint8_t> from = dest.subspan(run.dest_offset * elem_size);
    if (run.dest_stride == 1) {
      DS_ASSIGN_OR_RETURN(StateDigest part, ComputeStateDigest(from.first(run.count * elem_size),
                                                               elem_size, run.hf_first, options));
      d += part;
    } else {
      DS_ASSIGN_OR_RETURN(StateDigest part, ComputeStridedStateDigest(from, elem_size, run.hf_first,
                                                                      run.count, run.dest_stride));
      d += part;
    }
  }
  return d;
}

}  // namespace deltasync::stream
