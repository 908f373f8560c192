// indices: verl's sparse payload, (positions, values), framed by a 24-byte
// header so that a receiver can check it against the tensor before applying.
// Positions are signed little-endian int32 (int64 once numel >= 2^31, where
// torch's int32 indices stop), uncompressed: verl ships them raw.
#include <algorithm>
#include <string>
#include <vector>

#include "codec/codec_internal.h"
#include "core/endian.h"

namespace deltasync::codec_internal {
namespace {

// The descriptor (codec.h, EncodingInfo).
constexpr EncodingInfo kIndicesInfo = {
    .encoding = Encoding::kIndices,
    .name = "indices",
    .compression = "none",
    .needs_old_values = false,
    .needs_base = true,
    .idempotent = true,
    .streams = false,
    .carries_values = true,
    .read_by_python_receiver = false,
    .zstd_checksum_by_default = false,
    .max_tensor_bytes = UINT64_MAX,
};

constexpr uint8_t kIndicesMagic[4] = {'D', 'S', 'I', 'X'};
constexpr uint8_t kIndicesVersion = 1;
constexpr size_t kIndicesHeaderBytes = 24;
constexpr uint64_t kInt32Limit = uint64_t{1} << 31;

Status Corrupt(const std::string& what) { return Status::Corruption("indices decode: " + what); }

class IndicesCodecImpl final : public Codec {
 public:
  const EncodingInfo& info() const override { return kIndicesInfo; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                const EncodeOptions& /*options*/, std::vector<uint8_t>* out) const override {
    DS_RETURN_IF_ERROR(
        ValidateChangeSet(new_bytes, changes, kIndicesInfo.needs_old_values, kIndicesInfo.name));
    const uint64_t count = changes.count();
    const uint64_t es = changes.elem_size;
    const uint64_t width = changes.numel < kInt32Limit ? 4 : 8;
    const size_t start = out->size();
    out->resize(start + kIndicesHeaderBytes + count * (width + es));
    uint8_t* p = out->data() + start;
    std::memcpy(p, kIndicesMagic, 4);
    p[4] = kIndicesVersion;
    p[5] = static_cast<uint8_t>(width);
    p[6] = static_cast<uint8_t>(es);
    p[7] = 0;
    StoreLe<uint64_t>(p + 8, changes.numel);
    StoreLe<uint64_t>(p + 16, count);
    p += kIndicesHeaderBytes;
    if (width == 4) {
      for (uint64_t i = 0; i < count; ++i, p += 4) {
        StoreLe<uint32_t>(p, static_cast<uint32_t>(changes.position(i)));
      }
    } else {
      for (uint64_t i = 0; i < count; ++i, p += 8) StoreLe<uint64_t>(p, changes.position(i));
    }
    if (count) std::memcpy(p, changes.new_values.data(), count * es);
    return Status::OK();
  }

  Status DecodeApply(std::span<const uint8_t> encoded, std::span<uint8_t> target,
                     uint32_t elem_size, const DecodeOptions& /*options*/) const override {
    DS_ASSIGN_OR_RETURN(Payload p, Parse(encoded, target, elem_size));
    for (uint64_t i = 0; i < p.count; ++i) {
      uint64_t pos = ReadPosition(p.positions, i, p.width);
      std::memcpy(target.data() + pos * elem_size, p.values + i * elem_size, elem_size);
    }
    return Status::OK();
  }

  Status DecodeChanges(std::span<const uint8_t> encoded, std::span<const uint8_t> base,
                       uint32_t elem_size, const DecodeOptions& options,
                       ChangeSet* out) const override {
    DS_ASSIGN_OR_RETURN(Payload p, Parse(encoded, base, elem_size));
    // Any order is valid and a repeated position takes its last value, as
    // when applying in order. Ours are strictly ascending; anything else is
    // applied to a scratch copy and diffed (no per-entry sort memory).
    for (uint64_t i = 1; i < p.count; ++i) {
      if (ReadPosition(p.positions, i - 1, p.width) >= ReadPosition(p.positions, i, p.width)) {
        return DecodeChangesViaCopy(*this, encoded, base, elem_size, options, out);
      }
    }
    ChangeCollector collector(base, elem_size, options, out);
    collector.Reserve(p.count);
    // The base lines are requested ahead, as the sparse decoder does.
    const uint64_t lead = std::min<uint64_t>(p.count, kPrefetchLeadChanges);
    for (uint64_t i = 0; i < lead; ++i) collector.Prefetch(ReadPosition(p.positions, i, p.width));
    for (uint64_t i = 0; i < p.count; ++i) {
      if (i + lead < p.count) collector.Prefetch(ReadPosition(p.positions, i + lead, p.width));
      collector.AddNew(ReadPosition(p.positions, i, p.width), p.values + i * elem_size);
    }
    return Status::OK();
  }

 private:
  struct Payload {
    const uint8_t* positions = nullptr;
    const uint8_t* values = nullptr;
    uint64_t count = 0;
    uint64_t width = 4;
  };

  // Checks the header, the size and every position against the tensor, so
  // a bad payload is refused before anything is written.
  static Result<Payload> Parse(std::span<const uint8_t> encoded, std::span<const uint8_t> target,
                               uint32_t elem_size) {
    DS_RETURN_IF_ERROR(ValidateTarget(target, elem_size).WithContext("indices decode"));
    if (encoded.size() < kIndicesHeaderBytes) {
      return Corrupt("truncated header (" + std::to_string(encoded.size()) + " bytes)");
    }
    const uint8_t* h = encoded.data();
    if (std::memcmp(h, kIndicesMagic, 4) != 0) return Corrupt("bad magic (not an indices payload)");
    if (h[4] != kIndicesVersion) return Corrupt("unsupported version " + std::to_string(h[4]));
    const uint64_t width = h[5];
    if (width != 4 && width != 8) return Corrupt("position width " + std::to_string(width));
    if (h[6] != elem_size) {
      return Corrupt("element size " + std::to_string(h[6]) + " but the tensor's is " +
                     std::to_string(elem_size));
    }
    if (h[7] != 0) return Corrupt("reserved header byte is not zero");
    const uint64_t numel = target.size() / elem_size;
    if (LoadLe<uint64_t>(h + 8) != numel) {
      return Corrupt("encodes " + std::to_string(LoadLe<uint64_t>(h + 8)) +
                     " elements but the tensor has " + std::to_string(numel));
    }
    const uint64_t count = LoadLe<uint64_t>(h + 16);
    if (count > numel) {
      return Corrupt(std::to_string(count) + " positions for a tensor of " + std::to_string(numel) +
                     " elements");
    }
    // count <= numel <= SIZE_MAX / elem_size, so this cannot overflow.
    const uint64_t body = count * (width + elem_size);
    if (encoded.size() - kIndicesHeaderBytes != body) {
      return Corrupt(std::to_string(encoded.size()) + " bytes, expected " +
                     std::to_string(kIndicesHeaderBytes + body) + " for " + std::to_string(count) +
                     " entries");
    }
    Payload p;
    p.positions = h + kIndicesHeaderBytes;
    p.values = p.positions + count * width;
    p.count = count;
    p.width = width;
    for (uint64_t i = 0; i < count; ++i) {
      uint64_t pos = ReadPosition(p.positions, i, width);
      if (pos >= numel) {
        return Corrupt("position " + std::to_string(static_cast<int64_t>(pos)) + " at entry " +
                       std::to_string(i) + " is outside the tensor's " + std::to_string(numel) +
                       " elements");
      }
    }
    return p;
  }

  // Positions are signed on the wire; a negative one reads as a huge value
  // and fails the bound check.
  static uint64_t ReadPosition(const uint8_t* positions, uint64_t i, uint64_t width) {
    if (width == 4) {
      return static_cast<uint64_t>(
          static_cast<int64_t>(static_cast<int32_t>(LoadLe<uint32_t>(positions + 4 * i))));
    }
    return LoadLe<uint64_t>(positions + 8 * i);
  }
};

}  // namespace

const Codec& IndicesCodec() {
  static const IndicesCodecImpl codec;
  return codec;
}

}  // namespace deltasync::codec_internal
