// The flush frame's writer (docs/format.md, "Stream: flush frame"); its
// reader is frame_reader.cc, its application frame_apply.cc.
#include "stream/frame.h"

#include <zstd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <numeric>

#include "deltasync/checksum.h"
#include "deltasync/shard.h"
#include "deltasync/tensor.h"
#include "stream/frame_wire.h"

namespace deltasync::stream {

namespace {

// Resizes `b` to `size`, zeroing what it gains (a FrameBuffer's resize
// leaves new bytes as they were): padding is zero on the wire.
void ResizeZeroed(FrameBuffer* b, uint64_t size) {
  const uint64_t old = b->size();
  b->resize(size);
  if (size > old) std::memset(b->data() + old, 0, size - old);
}

}  // namespace

// A sharded trainer's placements check the limits the frames carry.
static_assert(kMaxShardNumel == static_cast<int64_t>(kMaxStreamNumel));
static_assert(kMaxShardDims == kMaxTensorDims);
static_assert(kMaxShardNameBytes == kMaxTensorNameBytes);

using namespace frame_wire;  // NOLINT(google-build-using-namespace): the frame's own fields

namespace {

// The values' count against the positions (or the range), and the
// positions: strictly increasing, inside the range. `what()` names the
// tensor in an error (built only for one).
template <typename What>
Status CheckValuesOf(const What& what, const TensorRange& range, const Positions* positions,
                     std::span<const uint8_t> values) {
  const uint64_t w = DTypeSize(range.dtype);
  const uint64_t n = positions ? positions->size() : range.count;
  if (values.size() % w != 0 || values.size() / w != n) {
    return Status::InvalidArgument(what() + ": " + U64(values.size()) + " value bytes for " +
                                   U64(n) + " elements of " + U64(w) + " bytes");
  }
  if (positions) {
    Status checked = positions->Check(range.first + range.count);
    if (!checked.ok()) return checked.WithContext(what());
    if (n > 0 && (*positions)[0] < range.first) {
      return Status::InvalidArgument(what() + ": position " + U64((*positions)[0]) +
                                     " is before the range's first element " + U64(range.first));
    }
  }
  return Status::OK();
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

// ---------------------------------------------------------------------------
// Writer

struct SparseEncoder::Context {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ~Context() { ZSTD_freeCCtx(cctx); }
};

SparseEncoder::SparseEncoder() : zstd_(std::make_unique<Context>()) {}
SparseEncoder::~SparseEncoder() = default;

Result<bool> SparseEncoder::Build(const TensorRange& range, const Positions& positions,
                                  std::span<const uint8_t> values, uint64_t decoded_limit) {
  const uint64_t n = positions.size();
  const uint32_t w = static_cast<uint32_t>(DTypeSize(range.dtype));
  // Every gap takes a byte at least: refuse what cannot fit before building.
  if (n + values.size() > decoded_limit) return false;
  gaps_.clear();
  uint64_t next = range.first;
  for (uint64_t k = 0; k < n; ++k) {
    AppendGap(&gaps_, positions[k] - next);
    next = positions[k] + 1;
  }
  if (gaps_.size() + values.size() > decoded_limit) return false;
  planes_.resize(values.size());
  for (uint32_t j = 0; j < w; ++j) {
    uint8_t* plane = planes_.data() + j * n;
    for (uint64_t k = 0; k < n; ++k) plane[k] = values[k * w + j];
  }
  return true;
}

Result<size_t> SparseEncoder::Compress(std::span<const uint8_t> content, int zstd_level,
                                       std::span<uint8_t> out) {
  ZSTD_CCtx* cctx = zstd_->cctx;
  ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, zstd_level);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0);
  const size_t written =
      ZSTD_compress2(cctx, out.data(), out.size(), content.data(), content.size());
  if (ZSTD_isError(written)) {
    return Status::Internal("sparse encoder: zstd: " + std::string(ZSTD_getErrorName(written)));
  }
  return written;
}

Status SparseEncoder::Encode(const TensorRange& range, const Positions& positions,
                             std::span<const uint8_t> values, int zstd_level,
                             uint64_t decoded_limit, SparseRegions* out) {
  const auto what = [&] { return "sparse encoder: tensor " + Quote(range.name); };
  DS_RETURN_IF_ERROR(CheckValuesOf(what, range, &positions, values));
  out->name = std::string(range.name);
  out->dtype = range.dtype;
  out->first = range.first;
  out->count = range.count;
  out->n = positions.size();
  out->decoded = 0;
  out->positions.clear();
  out->values.clear();
  if (out->n == 0) return Status::OK();
  DS_ASSIGN_OR_RETURN(bool built, Build(range, positions, values, decoded_limit));
  if (!built) {
    return Status::OutOfRange(what() + ": " + U64(out->n) +
                              " changes decode to more than a frame's " + U64(decoded_limit) +
                              " sparse bytes");
  }
  out->decoded = gaps_.size() + planes_.size();
  for (auto [content, region] : {std::pair{std::span<const uint8_t>(gaps_), &out->positions},
                                 std::pair{std::span<const uint8_t>(planes_), &out->values}}) {
    region->resize(ZSTD_compressBound(content.size()));
    DS_ASSIGN_OR_RETURN(size_t written, Compress(content, zstd_level, *region));
    region->resize(written);
  }
  return Status::OK();
}

FlushWriter::FlushWriter() = default;
FlushWriter::~FlushWriter() = default;

Status FlushWriter::Begin(const FlushHeader& header, uint64_t budget_bytes, FrameBuffer* out) {
  return Start(header, budget_bytes, out, /*placed=*/false);
}

Status FlushWriter::BeginPlaced(const FlushHeader& header, uint64_t budget_bytes,
                                FrameBuffer* out) {
  return Start(header, budget_bytes, out, /*placed=*/true);
}

Status FlushWriter::Start(const FlushHeader& header, uint64_t budget_bytes, FrameBuffer* out,
                          bool placed) {
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
  ResizeZeroed(out_, kFlushHeaderBytes);
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
  // Error texts are built only for an error.
  const auto what = [&] {
    return "flush writer: sync " + U64(header_.sync_id) + ": tensor " + Quote(range.name);
  };
  if (range.name.empty() || range.name.size() > kMaxTensorNameBytes) {
    return Status::InvalidArgument(what() + ": name of " + U64(range.name.size()) +
                                   " bytes (1 to 1024)");
  }
  if (!IsUtf8(range.name)) return Status::InvalidArgument(what() + ": name is not UTF-8");
  if (range.shape.size() > kMaxTensorDims) {
    return Status::InvalidArgument(what() + ": " + U64(range.shape.size()) +
                                   " dimensions (at most 16)");
  }
  std::array<uint64_t, kMaxTensorDims> dims;
  bool negative = false;
  for (size_t d = 0; d < range.shape.size(); ++d) {
    negative |= range.shape[d] < 0;
    dims[d] = static_cast<uint64_t>(range.shape[d]);
  }
  const std::optional<uint64_t> elements =
      negative ? std::nullopt
               : ShapeElements(std::span<const uint64_t>(dims.data(), range.shape.size()));
  if (!elements) {
    return Status::InvalidArgument(
        what() + ": shape " +
        ShapeToString(std::vector<int64_t>(range.shape.begin(), range.shape.end())) +
        " is negative or has more than 2^56 elements");
  }
  if (range.first > *elements || range.count > *elements - range.first) {
    return Status::InvalidArgument(what() + ": range [" + U64(range.first) + ", +" +
                                   U64(range.count) + ") is outside its " + U64(*elements) +
                                   " elements");
  }
  if (header_.kind == FrameKind::kSeed && encoding != WireEncoding::kDense) {
    return Status::InvalidArgument(what() + ": a seed frame holds only dense entries, not " +
                                   std::string(WireEncodingName(encoding)));
  }
  if (entry_count_ >= kMaxFlushEntries) {
    return Status::InvalidArgument(what() + ": the frame already holds 2^20 entries");
  }
  const auto it = tensors_.find(range.name);
  if (it != tensors_.end()) {
    const TensorEntries& t = it->second;
    if (t.dtype != range.dtype ||
        !std::equal(t.shape.begin(), t.shape.end(), range.shape.begin(), range.shape.end())) {
      return Status::InvalidArgument(what() + ": another dtype or shape than its earlier entry");
    }
    const uint64_t end = range.first + range.count;
    auto next = t.ranges.upper_bound(range.first);
    if (next != t.ranges.end() && next->first < end) {
      return Status::InvalidArgument(what() + ": range [" + U64(range.first) + ", " + U64(end) +
                                     ") overlaps an earlier entry's");
    }
    if (next != t.ranges.begin() && std::prev(next)->second > range.first) {
      return Status::InvalidArgument(what() + ": range [" + U64(range.first) + ", " + U64(end) +
                                     ") overlaps an earlier entry's");
    }
  }
  *numel = *elements;
  return Status::OK();
}

Status FlushWriter::CheckValues(const TensorRange& range, const Positions* positions,
                                std::span<const uint8_t> values) const {
  return CheckValuesOf(
      [&] {
        return "flush writer: sync " + U64(header_.sync_id) + ": tensor " + Quote(range.name);
      },
      range, positions, values);
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
  ResizeZeroed(out_, off);
  CopyIn(values);
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kDense, range.count, off, 0, off, values.size());
  return true;
}

uint32_t WrittenPositionWidth(uint64_t numel) { return PositionWidth(numel, kFlushFrameVersion); }

Result<bool> FlushWriter::AddIndices(const TensorRange& range, const Positions& positions,
                                     std::span<const uint8_t> values) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(false));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kIndices, &numel));
  DS_RETURN_IF_ERROR(CheckValues(range, &positions, values));
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  const uint32_t width = PositionWidth(numel, kFlushFrameVersion);
  const uint64_t n = positions.size();
  const uint64_t pos_off = Align8(end_);
  const uint64_t val_off = Align8(pos_off + n * width);
  if (!Fits(val_off + values.size(), entry_bytes)) return false;
  ResizeZeroed(out_, val_off);
  uint8_t* p = out_->data() + pos_off;
  switch (width) {
    case 3:
      for (uint64_t k = 0; k < n; ++k) StoreLeWidth(p + 3 * k, positions[k], 3);
      break;
    case 4:
      for (uint64_t k = 0; k < n; ++k) StoreLe<uint32_t>(p + 4 * k, uint32_t(positions[k]));
      break;
    default:
      for (uint64_t k = 0; k < n; ++k) StoreLe<uint64_t>(p + 8 * k, positions[k]);
  }
  CopyIn(values);
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kIndices, n, pos_off, n * width, val_off, values.size());
  return true;
}

void FlushWriter::CopyIn(std::span<const uint8_t> values) {
  const uint64_t at = out_->size();
  out_->resize(at + values.size());
  uint8_t* to = out_->data() + at;
  constexpr uint64_t kPiece = uint64_t{1} << 20;
  if (pool_ == nullptr || values.size() < 2 * kPiece) {
    if (!values.empty()) std::memcpy(to, values.data(), values.size());
    return;
  }
  pool_->ParallelFor((values.size() + kPiece - 1) / kPiece, [&](size_t i) {
    const uint64_t from = i * kPiece;
    std::memcpy(to + from, values.data() + from, std::min<uint64_t>(kPiece, values.size() - from));
  });
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
  if (n == 0) return AddEmptySparse(range, pos_off, entry_bytes);
  const uint64_t room =
      sparse_decoded_ >= sparse_decoded_limit_ ? 0 : sparse_decoded_limit_ - sparse_decoded_;
  DS_ASSIGN_OR_RETURN(bool built, sparse_.Build(range, positions, values, room));
  if (!built) return false;
  // Compressed straight into the frame. A frame cannot exceed its budget by
  // more than one entry's compressed bytes before it is cut back, so an
  // entry that does not fit costs its compression but no lasting memory.
  const auto compress = [&](std::span<const uint8_t> content, uint64_t offset) -> Result<size_t> {
    ResizeZeroed(out_, offset);
    out_->resize(offset + ZSTD_compressBound(content.size()));
    Result<size_t> written = sparse_.Compress(
        content, zstd_level_, std::span<uint8_t>(out_->data() + offset, out_->size() - offset));
    if (written.ok()) out_->resize(offset + *written);
    return written;
  };
  Result<size_t> compressed = compress(sparse_.gaps(), pos_off);
  if (!compressed.ok()) {
    out_->resize(start);
    return compressed.status();
  }
  const size_t pos_bytes = *compressed;
  const uint64_t val_off = Align8(pos_off + pos_bytes);
  Result<size_t> val_bytes = compress(sparse_.planes(), val_off);
  if (!val_bytes.ok() || !Fits(val_off + *val_bytes, entry_bytes)) {
    out_->resize(start);
    if (!val_bytes.ok()) return val_bytes.status();
    return false;
  }
  sparse_decoded_ += sparse_.gaps().size() + values.size();
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kSparse, n, pos_off, pos_bytes, val_off, *val_bytes);
  return true;
}

Result<bool> FlushWriter::AddSparseRegions(const TensorRange& range, const SparseRegions& r) {
  uint64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckMode(false));
  DS_RETURN_IF_ERROR(CheckRange(range, WireEncoding::kSparse, &numel));
  if (r.name != range.name || r.dtype != range.dtype || r.first != range.first ||
      r.count != range.count) {
    return Status::InvalidArgument(
        "flush writer: sync " + U64(header_.sync_id) + ": tensor " + Quote(range.name) +
        ": sparse regions made for another range (tensor " + Quote(r.name) + ", elements " +
        U64(r.first) + " to " + U64(r.first + r.count) + ")");
  }
  const size_t entry_bytes = kEntryFixedBytes + 8 * range.shape.size() + range.name.size();
  const uint64_t pos_off = Align8(out_->size());
  if (r.n == 0) return AddEmptySparse(range, pos_off, entry_bytes);
  if (sparse_decoded_ + r.decoded > sparse_decoded_limit_) return false;
  const uint64_t val_off = Align8(pos_off + r.positions.size());
  if (!Fits(val_off + r.values.size(), entry_bytes)) return false;
  ResizeZeroed(out_, pos_off);
  out_->insert(out_->end(), r.positions.begin(), r.positions.end());
  ResizeZeroed(out_, val_off);
  CopyIn(r.values);
  sparse_decoded_ += r.decoded;
  end_ = out_->size();
  AppendEntry(range, WireEncoding::kSparse, r.n, pos_off, r.positions.size(), val_off,
              r.values.size());
  return true;
}

Result<bool> FlushWriter::AddEmptySparse(const TensorRange& range, uint64_t pos_off,
                                         size_t entry_bytes) {
  if (!Fits(pos_off, entry_bytes)) return false;
  ResizeZeroed(out_, pos_off);
  end_ = pos_off;
  AppendEntry(range, WireEncoding::kSparse, 0, pos_off, 0, pos_off, 0);
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
  e.position_width = PositionWidth(numel, kFlushFrameVersion);
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
  const auto what = [&] {
    return "flush writer: sync " + U64(header_.sync_id) + ": digest of tensor " + Quote(name);
  };
  if (name.empty() || name.size() > kMaxTensorNameBytes) {
    return Status::InvalidArgument(what() + ": name of " + U64(name.size()) + " bytes (1 to 1024)");
  }
  if (!IsUtf8(name)) return Status::InvalidArgument(what() + ": name is not UTF-8");
  Status valid = block.Validate();
  if (!valid.ok()) return valid.WithContext(what());
  if (digest_count_ >= kMaxFlushDigests) {
    return Status::InvalidArgument(what() + ": the frame already holds 2^20 digest records");
  }
  auto key =
      std::make_tuple(std::string(name), block.first, block.count, block.rows, block.row_stride);
  if (digest_keys_.count(key)) {
    return Status::InvalidArgument(what() + ": block " + block.ToString() +
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
  if (!placed_) ResizeZeroed(out_, payload_end);
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

void ResealFlushFrame(std::span<uint8_t> frame) {
  if (frame.size() < kFlushTrailerBytes) return;
  const std::span<const uint8_t> body = frame.first(frame.size() - kFlushTrailerBytes);
  const std::vector<uint8_t> sum = ChecksumBytes(ChecksumAlgo::kXxh3_128, body);
  std::copy(sum.begin(), sum.end(), frame.end() - kFlushTrailerBytes);
}

}  // namespace deltasync::stream
