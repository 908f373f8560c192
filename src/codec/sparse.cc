// sparse: our own encoding, built for BF16 weights after small optimizer
// steps, where 1-3% of elements change and the XOR of a changed element
// mostly sits in its low mantissa bits.
//
// Two layouts behind one 24-byte header (docs/format.md has the bytes):
//  - positions: per block of up to 64 Ki changes, the gaps between changed
//    positions (one byte each below 255, else an escape and a varint), then
//    the XOR values split into byte planes. Each section is flushed into its
//    own zstd block so its Huffman table fits its own statistics; measured on
//    Adam-like BF16 deltas this lands within ~1.1x of the entropy bound.
//  - xor-planes: the XOR of every element, byte-plane split per block of
//    64 Ki elements. Cheaper once more than about half the elements change,
//    because positions then cost more than the zeros they replace.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "codec/codec_internal.h"
#include "codec/zstd_stream.h"
#include "core/endian.h"

namespace deltasync {

namespace codec_internal {
namespace {

// The descriptor (codec.h, EncodingInfo).
constexpr EncodingInfo kSparseInfo = {
    .encoding = Encoding::kSparse,
    .name = "sparse",
    .compression = "zstd",
    .needs_old_values = true,
    .needs_base = true,
    .idempotent = false,
    .streams = true,
    .carries_values = false,
    .read_by_python_receiver = false,
    .zstd_checksum_by_default = true,
    .max_tensor_bytes = UINT64_MAX,
};

constexpr uint8_t kSparseMagic[4] = {'D', 'S', 'S', 'P'};
constexpr uint8_t kSparseVersion = 1;
// Changes per block (positions) or elements per block (xor-planes). Fixed by
// the format: the decoder's buffers are sized from it.
constexpr uint64_t kBlock = 65536;
constexpr uint8_t kGapEscape = 255;
// An escaped gap: the escape byte plus a varint of at most 10 bytes.
constexpr uint64_t kMaxGapBytes = 11;
// Below this many entries per section a separate zstd block (with its own
// entropy table header) costs more than the better fit saves; 128 measured
// best on BF16 steps from 50 to 1500 changes per tensor.
constexpr uint64_t kMinFlushEntries = 128;
// Auto mode: below the band positions always win, above it xor-planes do;
// inside it both are tried (measured on i.i.d. positions, see format.md).
constexpr double kTryBothMinDensity = 0.3;
constexpr double kTryBothMaxDensity = 0.8;

Status Corrupt(const std::string& what) { return Status::Corruption("sparse decode: " + what); }

// Writes one gap at `out` (room for kMaxGapBytes); returns the byte past it.
uint8_t* PutGap(uint64_t gap, uint8_t* out) {
  if (gap < kGapEscape) {
    *out++ = static_cast<uint8_t>(gap);
    return out;
  }
  *out++ = kGapEscape;
  uint64_t rest = gap - kGapEscape;
  while (rest >= 0x80) {
    *out++ = static_cast<uint8_t>(rest | 0x80);
    rest >>= 7;
  }
  *out++ = static_cast<uint8_t>(rest);
  return out;
}

// Parses one gap at *cursor (advancing it); false when the bytes run out or
// the varint does not fit 64 bits.
bool ParseGap(const uint8_t* bytes, size_t size, size_t* cursor, uint64_t* gap) {
  if (*cursor >= size) return false;
  uint8_t first = bytes[(*cursor)++];
  if (first != kGapEscape) {
    *gap = first;
    return true;
  }
  uint64_t rest = 0;
  for (int shift = 0;; shift += 7) {
    if (*cursor >= size || shift > 63) return false;
    uint64_t byte = bytes[(*cursor)++];
    uint64_t bits = byte & 0x7f;
    if (shift == 63 && bits > 1) return false;
    rest |= bits << shift;
    if (!(byte & 0x80)) break;
  }
  if (rest > UINT64_MAX - kGapEscape) return false;
  *gap = rest + kGapEscape;
  return true;
}

void WriteHeader(SparseMode mode, uint32_t elem_size, uint64_t numel, uint64_t count,
                 std::vector<uint8_t>* out) {
  uint8_t header[kSparseHeaderBytes];
  std::memcpy(header, kSparseMagic, 4);
  header[4] = kSparseVersion;
  header[5] = static_cast<uint8_t>(mode);
  header[6] = static_cast<uint8_t>(elem_size);
  header[7] = 0;
  StoreLe<uint64_t>(header + 8, numel);
  StoreLe<uint64_t>(header + 16, count);
  out->insert(out->end(), header, header + kSparseHeaderBytes);
}

// Writes `sections` in order, each in its own zstd block when large enough.
Status WriteSections(ZstdFrameWriter* writer, std::span<const std::span<const uint8_t>> sections,
                     uint64_t entries) {
  for (std::span<const uint8_t> section : sections) {
    DS_RETURN_IF_ERROR(writer->Write(section));
    if (entries >= kMinFlushEntries) DS_RETURN_IF_ERROR(writer->Flush());
  }
  return Status::OK();
}

// Block buffers of the decoders, reused by each thread from tensor to tensor
// (a decode runs start to end on one thread): fresh ones per tensor would
// cost a page fault per 4 KiB for every tensor.
enum ReaderSlot { kReaderGaps = 0, kReaderPlanes = 1 };
uint8_t* ThreadBlockBuffer(ReaderSlot slot, size_t bytes) {
  thread_local std::vector<uint8_t> buffers[2];
  std::vector<uint8_t>& buffer = buffers[slot];
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// Writes the positions layout a diff piece at a time, in ascending position
// order: a block of up to kBlock changes (gaps, then the XOR values' byte
// planes, each plane kBlock bytes apart in `planes_`) goes out when full.
// The header's count is filled in by Finish.
class PositionsWriter {
 public:
  PositionsWriter(uint32_t elem_size, uint64_t numel, std::vector<uint8_t>* out)
      : es_(elem_size),
        out_(out),
        header_at_(out->size()),
        gaps_buffer_(PooledBuffer::kGaps),
        planes_buffer_(PooledBuffer::kPlanes),
        gaps_(gaps_buffer_.bytes()),
        planes_(planes_buffer_.bytes()),
        writer_((WriteHeader(SparseMode::kPositions, elem_size, numel, 0, out), out)) {}

  Status Begin(const EncodeOptions& options) {
    if (gaps_.size() < 4) gaps_.resize(4);
    gap_bytes_ = 4;
    if (planes_.size() < kBlock * es_) planes_.resize(kBlock * es_);
    return writer_.Begin(options.zstd_level, options.ZstdChecksumFor(Encoding::kSparse),
                         kZstdUnknownSize);
  }
  // The changes of a diff piece whose positions count from element `first`
  // (all above every earlier one); ES is the element size.
  template <size_t ES>
  Status AddPiece(uint64_t first, const ChangeSet& piece) {
    const uint64_t count = piece.count();
    const uint8_t* new_values = piece.new_values.data();
    const uint8_t* old_values = piece.old_values.data();
    for (uint64_t i = 0; i < count;) {
      const uint64_t stop = i + std::min<uint64_t>(count - i, kBlock - n_);
      // Room for the longest gaps; the pooled buffer keeps what it grew to.
      const size_t room = gap_bytes_ + static_cast<size_t>(stop - i) * kMaxGapBytes;
      if (gaps_.size() < room) gaps_.resize(room);
      uint8_t* gap = gaps_.data() + gap_bytes_;
      uint8_t* plane = planes_.data() + n_;
      for (; i < stop; ++i, ++plane) {
        const uint64_t pos = first + piece.position(i);
        gap = PutGap(pos - next_position_, gap);
        next_position_ = pos + 1;
        for (size_t j = 0; j < ES; ++j) {
          plane[j * kBlock] = new_values[i * ES + j] ^ old_values[i * ES + j];
        }
      }
      gap_bytes_ = static_cast<size_t>(gap - gaps_.data());
      const auto added = static_cast<size_t>(plane - (planes_.data() + n_));
      n_ += added;
      count_ += added;
      if (n_ == kBlock) DS_RETURN_IF_ERROR(WriteBlock());
    }
    return Status::OK();
  }
  Status Finish() {
    if (n_ > 0) DS_RETURN_IF_ERROR(WriteBlock());
    DS_RETURN_IF_ERROR(writer_.Finish());
    StoreLe<uint64_t>(out_->data() + header_at_ + 16, count_);
    return Status::OK();
  }

 private:
  Status WriteBlock() {
    StoreLe<uint32_t>(gaps_.data(), static_cast<uint32_t>(gap_bytes_ - 4));
    std::span<const uint8_t> sections[9];
    sections[0] = {gaps_.data(), gap_bytes_};
    for (size_t j = 0; j < es_; ++j) sections[1 + j] = {planes_.data() + j * kBlock, n_};
    DS_RETURN_IF_ERROR(WriteSections(&writer_, {sections, 1 + es_}, n_));
    gap_bytes_ = 4;
    n_ = 0;
    return Status::OK();
  }

  size_t es_;
  std::vector<uint8_t>* out_;
  size_t header_at_;
  PooledBuffer gaps_buffer_;
  PooledBuffer planes_buffer_;
  std::vector<uint8_t>& gaps_;  // the block's length, then its gaps
  std::vector<uint8_t>& planes_;
  ZstdFrameWriter writer_;  // made after the header went out
  size_t gap_bytes_ = 4;    // bytes of gaps_ in use
  uint64_t next_position_ = 0;
  uint64_t count_ = 0;
  size_t n_ = 0;  // changes in the current block
};

// Writes the xor-planes layout one change at a time, in ascending position
// order: every block of kBlock elements goes out, all-zero ones included.
class XorPlanesWriter {
 public:
  XorPlanesWriter(uint32_t elem_size, uint64_t numel, std::vector<uint8_t>* out)
      : es_(elem_size),
        numel_(numel),
        out_(out),
        header_at_(out->size()),
        planes_buffer_(PooledBuffer::kPlanes),
        planes_(planes_buffer_.bytes()),
        writer_((WriteHeader(SparseMode::kXorPlanes, elem_size, numel, 0, out), out)) {}

  Status Begin(const EncodeOptions& options) {
    n_ = static_cast<size_t>(std::min(kBlock, numel_));
    planes_.assign(std::max<size_t>(kBlock * es_, 1), 0);
    return writer_.Begin(options.zstd_level, options.ZstdChecksumFor(Encoding::kSparse),
                         numel_ * es_);
  }
  Status Add(uint64_t pos, const uint8_t* x) {
    while (pos >= first_ + n_) DS_RETURN_IF_ERROR(WriteBlock());
    const size_t i = static_cast<size_t>(pos - first_);
    for (size_t j = 0; j < es_; ++j) planes_[j * n_ + i] = x[j];
    ++count_;
    return Status::OK();
  }
  Status Finish() {
    while (first_ < numel_) DS_RETURN_IF_ERROR(WriteBlock());
    DS_RETURN_IF_ERROR(writer_.Finish());
    StoreLe<uint64_t>(out_->data() + header_at_ + 16, count_);
    return Status::OK();
  }

 private:
  Status WriteBlock() {
    std::span<const uint8_t> sections[8];
    for (size_t j = 0; j < es_; ++j) sections[j] = {planes_.data() + j * n_, n_};
    DS_RETURN_IF_ERROR(WriteSections(&writer_, {sections, es_}, n_));
    std::memset(planes_.data(), 0, n_ * es_);
    first_ += n_;
    n_ = static_cast<size_t>(std::min(kBlock, numel_ - first_));
    return Status::OK();
  }

  size_t es_;
  uint64_t numel_;
  std::vector<uint8_t>* out_;
  size_t header_at_;
  PooledBuffer planes_buffer_;
  std::vector<uint8_t>& planes_;
  ZstdFrameWriter writer_;
  uint64_t first_ = 0;  // first element of the current block
  size_t n_ = 0;        // elements in the current block
  uint64_t count_ = 0;
};

// Where decoded XOR values go: straight into the tensor (DecodeApply) or
// into a change list (DecodeChanges). Planes hold a block of n elements'
// XOR values, byte j of element i at planes[j * n + i]. Prefetch(pos) is
// called some changes before XorOne(pos).
struct ApplyTarget {
  uint8_t* data;
  template <size_t ES>
  void Prefetch(uint64_t pos) {
    __builtin_prefetch(data + pos * ES, /*rw=*/1);
  }
  // Element pos ^= the i-th value.
  template <size_t ES>
  void XorOne(uint64_t pos, const uint8_t* planes, size_t n, size_t i) {
    uint8_t* t = data + pos * ES;
    for (size_t j = 0; j < ES; ++j) t[j] ^= planes[j * n + i];
  }
  // Elements [first, first + n) ^= the block; returns how many it changed.
  template <size_t ES>
  uint64_t XorBlock(uint64_t first, const uint8_t* planes, size_t n) {
    uint8_t* t = data + first * ES;
    uint64_t changed = 0;
    for (size_t i = 0; i < n; ++i) {
      uint8_t any = 0;
      for (size_t j = 0; j < ES; ++j) {
        const uint8_t v = planes[j * n + i];
        t[i * ES + j] ^= v;
        any |= v;
      }
      changed += any != 0;
    }
    return changed;
  }
};

struct CollectTarget {
  ChangeCollector* collector;
  template <size_t ES>
  void Prefetch(uint64_t pos) {
    collector->Prefetch<ES>(pos);
  }
  template <size_t ES>
  void XorOne(uint64_t pos, const uint8_t* planes, size_t n, size_t i) {
    uint8_t x[ES];
    for (size_t j = 0; j < ES; ++j) x[j] = planes[j * n + i];
    collector->AddXor<ES>(pos, x);
  }
  template <size_t ES>
  uint64_t XorBlock(uint64_t first, const uint8_t* planes, size_t n) {
    const uint64_t before = collector->count();
    for (size_t i = 0; i < n; ++i) XorOne<ES>(first + i, planes, n, i);
    return collector->count() - before;
  }
};

template <size_t ES, typename Target>
Status ApplyPositionsBlock(const uint8_t* gaps, size_t gap_bytes, const uint8_t* planes, size_t n,
                           uint64_t numel, uint64_t* next_position, Target* target) {
  // Positions are decoded, and their lines requested, kPrefetchLeadChanges
  // changes ahead of the change being applied.
  uint64_t ahead[kPrefetchLeadChanges];  // positions of changes [i, decoded), by index mod size
  size_t cursor = 0;
  size_t decoded = 0;
  uint64_t next = *next_position;
  for (size_t i = 0; i < n; ++i) {
    for (const size_t stop = std::min(n, i + kPrefetchLeadChanges); decoded < stop; ++decoded) {
      uint64_t gap;
      if (cursor < gap_bytes && gaps[cursor] != kGapEscape) {
        gap = gaps[cursor++];
      } else if (!ParseGap(gaps, gap_bytes, &cursor, &gap)) {
        return Corrupt("malformed or truncated gap section");
      }
      if (gap >= numel - next) {
        return Corrupt("position " + std::to_string(next) + " + gap " + std::to_string(gap) +
                       " is outside the tensor's " + std::to_string(numel) + " elements");
      }
      const uint64_t pos = next + gap;
      ahead[decoded % kPrefetchLeadChanges] = pos;
      target->template Prefetch<ES>(pos);
      next = pos + 1;
    }
    target->template XorOne<ES>(ahead[i % kPrefetchLeadChanges], planes, n, i);
  }
  if (cursor != gap_bytes) {
    return Corrupt(std::to_string(gap_bytes - cursor) + " unused bytes in a gap section");
  }
  *next_position = next;
  return Status::OK();
}

template <typename Target>
Status DecodePositions(const SparseHeader& header, ZstdFrameReader* reader, Target* target) {
  const size_t es = header.elem_size;
  const size_t block = static_cast<size_t>(std::min(kBlock, header.count));
  uint8_t* gaps = ThreadBlockBuffer(kReaderGaps, std::max<size_t>(block * kMaxGapBytes, 1));
  uint8_t* planes = ThreadBlockBuffer(kReaderPlanes, std::max<size_t>(block * es, 1));
  uint64_t next_position = 0;
  for (uint64_t first = 0; first < header.count; first += kBlock) {
    const size_t n = static_cast<size_t>(std::min(kBlock, header.count - first));
    uint8_t length_bytes[4];
    DS_RETURN_IF_ERROR(reader->Read(length_bytes, 4).WithContext("sparse decode"));
    const uint64_t gap_bytes = LoadLe<uint32_t>(length_bytes);
    if (gap_bytes < n || gap_bytes > n * kMaxGapBytes) {
      return Corrupt("gap section of " + std::to_string(gap_bytes) + " bytes for " +
                     std::to_string(n) + " positions");
    }
    DS_RETURN_IF_ERROR(reader->Read(gaps, gap_bytes).WithContext("sparse decode"));
    DS_RETURN_IF_ERROR(reader->Read(planes, n * es).WithContext("sparse decode"));
    Status status;
    switch (es) {
      case 1:
        status = ApplyPositionsBlock<1>(gaps, gap_bytes, planes, n, header.numel, &next_position,
                                        target);
        break;
      case 2:
        status = ApplyPositionsBlock<2>(gaps, gap_bytes, planes, n, header.numel, &next_position,
                                        target);
        break;
      case 4:
        status = ApplyPositionsBlock<4>(gaps, gap_bytes, planes, n, header.numel, &next_position,
                                        target);
        break;
      default:
        status = ApplyPositionsBlock<8>(gaps, gap_bytes, planes, n, header.numel, &next_position,
                                        target);
        break;
    }
    DS_RETURN_IF_ERROR(status);
  }
  return reader->ExpectEnd().WithContext("sparse decode");
}

template <typename Target>
Status DecodeXorPlanes(const SparseHeader& header, ZstdFrameReader* reader, Target* target) {
  const size_t es = header.elem_size;
  const size_t block = static_cast<size_t>(std::min(kBlock, header.numel));
  uint8_t* planes = ThreadBlockBuffer(kReaderPlanes, std::max<size_t>(block * es, 1));
  uint64_t changed = 0;
  for (uint64_t first = 0; first < header.numel; first += kBlock) {
    const size_t n = static_cast<size_t>(std::min(kBlock, header.numel - first));
    DS_RETURN_IF_ERROR(reader->Read(planes, n * es).WithContext("sparse decode"));
    switch (es) {
      case 1: changed += target->template XorBlock<1>(first, planes, n); break;
      case 2: changed += target->template XorBlock<2>(first, planes, n); break;
      case 4: changed += target->template XorBlock<4>(first, planes, n); break;
      default: changed += target->template XorBlock<8>(first, planes, n); break;
    }
  }
  DS_RETURN_IF_ERROR(reader->ExpectEnd().WithContext("sparse decode"));
  if (changed != header.count) {
    return Corrupt("xor-planes content changes " + std::to_string(changed) +
                   " elements but the header declares " + std::to_string(header.count));
  }
  return Status::OK();
}

// Hands the changes of a decoded positions layout to a writer (re-encoding
// them as xor-planes); DecodePositions only calls Prefetch and XorOne.
template <typename Writer>
struct ForwardTarget {
  Writer* writer;
  Status status;
  template <size_t ES>
  void Prefetch(uint64_t /*pos*/) {}  // writes only to its own buffers
  template <size_t ES>
  void XorOne(uint64_t pos, const uint8_t* planes, size_t n, size_t i) {
    uint8_t x[ES];
    for (size_t j = 0; j < ES; ++j) x[j] = planes[j * n + i];
    if (status.ok()) status = writer->Add(pos, x);
  }
};

// The sparse encoding from ranges. Positions go out as they come (unless
// xor-planes is forced); in auto mode a tensor that turns out dense is then
// re-encoded from those positions as xor-planes, so the choice matches
// Encode's without holding the tensor's changes.
class SparseEncodeStream final : public EncodeStream {
 public:
  SparseEncodeStream(uint64_t numel, uint32_t elem_size, const EncodeOptions& options,
                     std::vector<uint8_t>* out)
      : ranges_(numel, elem_size, kSparseInfo.needs_old_values, kSparseInfo.name),
        options_(options),
        out_(out),
        start_(out->size()) {
    if (!IsValidElemSize(elem_size)) {
      begun_ = Status::InvalidArgument("sparse encode stream: element size " +
                                       std::to_string(elem_size) + " (expected 1, 2, 4 or 8)");
    } else if (options.sparse_mode == SparseMode::kXorPlanes) {
      planes_.emplace(elem_size, numel, out);
      begun_ = planes_->Begin(options);
    } else {
      positions_.emplace(elem_size, numel, out);
      begun_ = positions_->Begin(options);
    }
  }

  Status Add(uint64_t first, std::span<const uint8_t> new_chunk, const ChangeSet& piece) override {
    DS_RETURN_IF_ERROR(begun_);
    DS_RETURN_IF_ERROR(ranges_.Add(first, new_chunk, piece));
    count_ += piece.count();
    if (positions_) {
      switch (piece.elem_size) {
        case 1: return positions_->AddPiece<1>(first, piece);
        case 2: return positions_->AddPiece<2>(first, piece);
        case 4: return positions_->AddPiece<4>(first, piece);
        default: return positions_->AddPiece<8>(first, piece);
      }
    }
    uint8_t x[8];
    for (uint64_t i = 0; i < piece.count(); ++i) {
      ChangedXor(piece, i, x);
      DS_RETURN_IF_ERROR(planes_->Add(first + piece.position(i), x));
    }
    return Status::OK();
  }

  Status Finish() override {
    DS_RETURN_IF_ERROR(begun_);
    DS_RETURN_IF_ERROR(ranges_.CheckComplete());
    if (planes_) return planes_->Finish().WithContext("sparse encode");
    DS_RETURN_IF_ERROR(positions_->Finish().WithContext("sparse encode"));
    positions_.reset();  // its frame writer trims *out_ when destroyed
    const double density = ranges_.numel() == 0
                               ? 0.0
                               : static_cast<double>(count_) / static_cast<double>(ranges_.numel());
    if (options_.sparse_mode != SparseMode::kAuto || density < kTryBothMinDensity) {
      return Status::OK();
    }
    std::vector<uint8_t> planes;
    DS_RETURN_IF_ERROR(Transcode(&planes).WithContext("sparse encode"));
    if (density > kTryBothMaxDensity || planes.size() < out_->size() - start_) {
      out_->resize(start_);
      out_->insert(out_->end(), planes.begin(), planes.end());
    }
    return Status::OK();
  }

 private:
  // The positions encoding just written, decoded into an xor-planes writer.
  Status Transcode(std::vector<uint8_t>* planes) {
    const std::span<const uint8_t> encoded(out_->data() + start_, out_->size() - start_);
    DS_ASSIGN_OR_RETURN(SparseHeader header, ReadSparseHeader(encoded));
    XorPlanesWriter writer(header.elem_size, header.numel, planes);
    DS_RETURN_IF_ERROR(writer.Begin(options_));
    ZstdFrameReader reader;
    DS_RETURN_IF_ERROR(
        reader.Begin(encoded.subspan(kSparseHeaderBytes), DecodeOptions().zstd_window_log_max, 1));
    ForwardTarget<XorPlanesWriter> forward{&writer, Status::OK()};
    DS_RETURN_IF_ERROR(DecodePositions(header, &reader, &forward));
    DS_RETURN_IF_ERROR(forward.status);
    return writer.Finish();
  }

  StreamRanges ranges_;
  EncodeOptions options_;
  std::vector<uint8_t>* out_;
  size_t start_;
  std::optional<PositionsWriter> positions_;
  std::optional<XorPlanesWriter> planes_;
  Status begun_;
  uint64_t count_ = 0;
};

class SparseCodecImpl final : public Codec {
 public:
  const EncodingInfo& info() const override { return kSparseInfo; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                const EncodeOptions& options, std::vector<uint8_t>* out) const override {
    return EncodeAsOneRange<SparseEncodeStream>(new_bytes, changes, options, out);
  }

  std::unique_ptr<EncodeStream> NewEncodeStream(uint64_t numel, uint32_t elem_size,
                                                const EncodeOptions& options,
                                                std::vector<uint8_t>* out) const override {
    return std::make_unique<SparseEncodeStream>(numel, elem_size, options, out);
  }

  Status DecodeApply(std::span<const uint8_t> encoded, std::span<uint8_t> target,
                     uint32_t elem_size, const DecodeOptions& options) const override {
    ApplyTarget apply{target.data()};
    return Decode(encoded, target, elem_size, options, &apply, nullptr);
  }

  Status DecodeChanges(std::span<const uint8_t> encoded, std::span<const uint8_t> base,
                       uint32_t elem_size, const DecodeOptions& options,
                       ChangeSet* out) const override {
    ChangeCollector collector(base, elem_size, options, out);
    CollectTarget collect{&collector};
    return Decode(encoded, base, elem_size, options, &collect, &collector);
  }

 private:
  template <typename Target>
  static Status Decode(std::span<const uint8_t> encoded, std::span<const uint8_t> target,
                       uint32_t elem_size, const DecodeOptions& options, Target* sink,
                       ChangeCollector* collector) {
    DS_RETURN_IF_ERROR(ValidateTarget(target, elem_size).WithContext("sparse decode"));
    DS_ASSIGN_OR_RETURN(SparseHeader header, ReadSparseHeader(encoded));
    if (header.elem_size != elem_size) {
      return Corrupt("element size " + std::to_string(header.elem_size) + " but the tensor's is " +
                     std::to_string(elem_size));
    }
    if (header.numel != target.size() / elem_size) {
      return Corrupt("encodes " + std::to_string(header.numel) + " elements but the tensor has " +
                     std::to_string(target.size() / elem_size));
    }
    ZstdFrameReader reader;
    DS_RETURN_IF_ERROR(
        reader.Begin(encoded.subspan(kSparseHeaderBytes), options.zstd_window_log_max, 0)
            .WithContext("sparse decode"));
    // The header's count is checked against the content as it decodes;
    // capped so a hostile header cannot reserve much before that.
    if (collector != nullptr) collector->Reserve(std::min<uint64_t>(header.count, kBlock * 64));
    if (header.mode == SparseMode::kPositions) return DecodePositions(header, &reader, sink);
    return DecodeXorPlanes(header, &reader, sink);
  }
};

}  // namespace

const Codec& SparseCodec() {
  static const SparseCodecImpl codec;
  return codec;
}

}  // namespace codec_internal

Result<SparseHeader> ReadSparseHeader(std::span<const uint8_t> encoded) {
  using codec_internal::Corrupt;
  if (encoded.size() < kSparseHeaderBytes) {
    return Corrupt("truncated header (" + std::to_string(encoded.size()) + " bytes)");
  }
  const uint8_t* h = encoded.data();
  if (std::memcmp(h, codec_internal::kSparseMagic, 4) != 0) {
    return Corrupt("bad magic (not a sparse encoding)");
  }
  if (h[4] != codec_internal::kSparseVersion) {
    return Corrupt("unsupported version " + std::to_string(h[4]));
  }
  SparseHeader header;
  if (h[5] == static_cast<uint8_t>(SparseMode::kPositions)) {
    header.mode = SparseMode::kPositions;
  } else if (h[5] == static_cast<uint8_t>(SparseMode::kXorPlanes)) {
    header.mode = SparseMode::kXorPlanes;
  } else {
    return Corrupt("unknown mode " + std::to_string(h[5]));
  }
  header.elem_size = h[6];
  if (!codec_internal::IsValidElemSize(header.elem_size)) {
    return Corrupt("element size " + std::to_string(header.elem_size));
  }
  if (h[7] != 0) return Corrupt("reserved header byte is not zero");
  header.numel = LoadLe<uint64_t>(h + 8);
  header.count = LoadLe<uint64_t>(h + 16);
  if (header.count > header.numel) {
    return Corrupt(std::to_string(header.count) + " changes out of " +
                   std::to_string(header.numel) + " elements");
  }
  return header;
}

}  // namespace deltasync
