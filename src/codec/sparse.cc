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
#include <string>

#include "codec/codec_internal.h"
#include "codec/zstd_stream.h"

namespace deltasync {

namespace codec_internal {
namespace {

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

void AppendGap(uint64_t gap, std::vector<uint8_t>* out) {
  if (gap < kGapEscape) {
    out->push_back(static_cast<uint8_t>(gap));
    return;
  }
  out->push_back(kGapEscape);
  uint64_t rest = gap - kGapEscape;
  while (rest >= 0x80) {
    out->push_back(static_cast<uint8_t>(rest | 0x80));
    rest >>= 7;
  }
  out->push_back(static_cast<uint8_t>(rest));
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
  StoreLE64(header + 8, numel);
  StoreLE64(header + 16, count);
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

Status EncodePositions(const ChangeSet& changes, const EncodeOptions& options,
                       std::vector<uint8_t>* out) {
  const size_t es = changes.elem_size;
  const uint64_t count = changes.count();
  WriteHeader(SparseMode::kPositions, changes.elem_size, changes.numel, count, out);
  ZstdFrameWriter writer(out);
  DS_RETURN_IF_ERROR(writer.Begin(options.zstd_level, options.zstd_checksum, kZstdUnknownSize));
  const size_t block = static_cast<size_t>(std::min(kBlock, count));
  std::vector<uint8_t> gaps;
  gaps.reserve(4 + 2 * block);
  std::unique_ptr<uint8_t[]> planes(new uint8_t[std::max<size_t>(block * es, 1)]);
  uint64_t next_position = 0;  // previous position + 1
  for (uint64_t first = 0; first < count; first += kBlock) {
    const size_t n = static_cast<size_t>(std::min(kBlock, count - first));
    gaps.assign(4, 0);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t pos = changes.position(first + i);
      AppendGap(pos - next_position, &gaps);
      next_position = pos + 1;
      const uint8_t* nv = changes.new_values.data() + (first + i) * es;
      const uint8_t* ov = changes.old_values.data() + (first + i) * es;
      for (size_t j = 0; j < es; ++j) planes[j * n + i] = nv[j] ^ ov[j];
    }
    StoreLE32(gaps.data(), static_cast<uint32_t>(gaps.size() - 4));
    std::span<const uint8_t> sections[9];
    sections[0] = gaps;
    for (size_t j = 0; j < es; ++j) sections[1 + j] = {planes.get() + j * n, n};
    DS_RETURN_IF_ERROR(WriteSections(&writer, {sections, 1 + es}, n));
  }
  return writer.Finish();
}

Status EncodeXorPlanes(const ChangeSet& changes, const EncodeOptions& options,
                       std::vector<uint8_t>* out) {
  const size_t es = changes.elem_size;
  const uint64_t count = changes.count();
  const uint64_t numel = changes.numel;
  WriteHeader(SparseMode::kXorPlanes, changes.elem_size, numel, count, out);
  ZstdFrameWriter writer(out);
  DS_RETURN_IF_ERROR(writer.Begin(options.zstd_level, options.zstd_checksum, numel * es));
  const size_t block = static_cast<size_t>(std::min(kBlock, numel));
  std::unique_ptr<uint8_t[]> planes(new uint8_t[std::max<size_t>(block * es, 1)]);
  uint64_t next = 0;
  for (uint64_t first = 0; first < numel; first += kBlock) {
    const size_t n = static_cast<size_t>(std::min(kBlock, numel - first));
    std::memset(planes.get(), 0, n * es);
    for (; next < count && changes.position(next) < first + n; ++next) {
      const size_t i = static_cast<size_t>(changes.position(next) - first);
      const uint8_t* nv = changes.new_values.data() + next * es;
      const uint8_t* ov = changes.old_values.data() + next * es;
      for (size_t j = 0; j < es; ++j) planes[j * n + i] = nv[j] ^ ov[j];
    }
    std::span<const uint8_t> sections[8];
    for (size_t j = 0; j < es; ++j) sections[j] = {planes.get() + j * n, n};
    DS_RETURN_IF_ERROR(WriteSections(&writer, {sections, es}, n));
  }
  return writer.Finish();
}

// Where decoded XOR values go: straight into the tensor (DecodeApply) or
// into a change list (DecodeChanges). Planes hold a block of n elements'
// XOR values, byte j of element i at planes[j * n + i].
struct ApplyTarget {
  uint8_t* data;
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
  size_t cursor = 0;
  uint64_t next = *next_position;
  for (size_t i = 0; i < n; ++i) {
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
    target->template XorOne<ES>(pos, planes, n, i);
    next = pos + 1;
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
  std::unique_ptr<uint8_t[]> gaps(new uint8_t[std::max<size_t>(block * kMaxGapBytes, 1)]);
  std::unique_ptr<uint8_t[]> planes(new uint8_t[std::max<size_t>(block * es, 1)]);
  uint64_t next_position = 0;
  for (uint64_t first = 0; first < header.count; first += kBlock) {
    const size_t n = static_cast<size_t>(std::min(kBlock, header.count - first));
    uint8_t length_bytes[4];
    DS_RETURN_IF_ERROR(reader->Read(length_bytes, 4).WithContext("sparse decode"));
    const uint64_t gap_bytes = LoadLE32(length_bytes);
    if (gap_bytes < n || gap_bytes > n * kMaxGapBytes) {
      return Corrupt("gap section of " + std::to_string(gap_bytes) + " bytes for " +
                     std::to_string(n) + " positions");
    }
    DS_RETURN_IF_ERROR(reader->Read(gaps.get(), gap_bytes).WithContext("sparse decode"));
    DS_RETURN_IF_ERROR(reader->Read(planes.get(), n * es).WithContext("sparse decode"));
    Status status;
    switch (es) {
      case 1:
        status = ApplyPositionsBlock<1>(gaps.get(), gap_bytes, planes.get(), n, header.numel,
                                        &next_position, target);
        break;
      case 2:
        status = ApplyPositionsBlock<2>(gaps.get(), gap_bytes, planes.get(), n, header.numel,
                                        &next_position, target);
        break;
      case 4:
        status = ApplyPositionsBlock<4>(gaps.get(), gap_bytes, planes.get(), n, header.numel,
                                        &next_position, target);
        break;
      default:
        status = ApplyPositionsBlock<8>(gaps.get(), gap_bytes, planes.get(), n, header.numel,
                                        &next_position, target);
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
  std::unique_ptr<uint8_t[]> planes(new uint8_t[std::max<size_t>(block * es, 1)]);
  uint64_t changed = 0;
  for (uint64_t first = 0; first < header.numel; first += kBlock) {
    const size_t n = static_cast<size_t>(std::min(kBlock, header.numel - first));
    DS_RETURN_IF_ERROR(reader->Read(planes.get(), n * es).WithContext("sparse decode"));
    switch (es) {
      case 1: changed += target->template XorBlock<1>(first, planes.get(), n); break;
      case 2: changed += target->template XorBlock<2>(first, planes.get(), n); break;
      case 4: changed += target->template XorBlock<4>(first, planes.get(), n); break;
      default: changed += target->template XorBlock<8>(first, planes.get(), n); break;
    }
  }
  DS_RETURN_IF_ERROR(reader->ExpectEnd().WithContext("sparse decode"));
  if (changed != header.count) {
    return Corrupt("xor-planes content changes " + std::to_string(changed) +
                   " elements but the header declares " + std::to_string(header.count));
  }
  return Status::OK();
}

class SparseCodecImpl final : public Codec {
 public:
  Encoding encoding() const override { return Encoding::kSparse; }
  bool needs_old_values() const override { return true; }
  bool needs_base() const override { return true; }
  bool idempotent() const override { return false; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                const EncodeOptions& options, std::vector<uint8_t>* out) const override {
    DS_RETURN_IF_ERROR(ValidateChangeSet(new_bytes, changes, true, "sparse"));
    const double density = changes.density();
    SparseMode mode = options.sparse_mode;
    if (mode == SparseMode::kAuto) {
      if (density < kTryBothMinDensity) {
        mode = SparseMode::kPositions;
      } else if (density > kTryBothMaxDensity) {
        mode = SparseMode::kXorPlanes;
      }
    }
    if (mode == SparseMode::kPositions) {
      return EncodePositions(changes, options, out).WithContext("sparse encode");
    }
    if (mode == SparseMode::kXorPlanes) {
      return EncodeXorPlanes(changes, options, out).WithContext("sparse encode");
    }
    const size_t start = out->size();
    DS_RETURN_IF_ERROR(EncodePositions(changes, options, out).WithContext("sparse encode"));
    std::vector<uint8_t> planes;
    DS_RETURN_IF_ERROR(EncodeXorPlanes(changes, options, &planes).WithContext("sparse encode"));
    if (planes.size() < out->size() - start) {
      out->resize(start);
      out->insert(out->end(), planes.begin(), planes.end());
    }
    return Status::OK();
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
  header.numel = codec_internal::LoadLE64(h + 8);
  header.count = codec_internal::LoadLE64(h + 16);
  if (header.count > header.numel) {
    return Corrupt(std::to_string(header.count) + " changes out of " +
                   std::to_string(header.numel) + " elements");
  }
  return header;
}

}  // namespace deltasync
