// overwrite: vime/slime's idempotent disk encoding. One zstd frame whose
// content is a little-endian u32 count K, K u32 byte positions, then the K
// new bytes. Only bytes that actually differ are listed, so a changed BF16
// element whose high byte survived costs one entry, not two.
//
// The decoder reads positions and values from two cursors over the same
// frame when they do not fit one decode chunk: memory stays bounded at the
// price of decompressing the position section twice.
#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "codec/codec_internal.h"
#include "codec/zstd_stream.h"
#include "core/endian.h"

namespace deltasync::codec_internal {
namespace {

// The descriptor (codec.h, EncodingInfo).
constexpr EncodingInfo kOverwriteInfo = {
    .encoding = Encoding::kOverwrite,
    .name = "overwrite",
    .compression = "zstd",
    .needs_old_values = true,
    .needs_base = true,
    .idempotent = true,
    .streams = false,
    .carries_values = false,
    .read_by_python_receiver = true,
    .zstd_checksum_by_default = true,
    // u32 byte positions.
    .max_tensor_bytes = uint64_t{1} << 32,
};

Status Corrupt(const std::string& what) { return Status::Corruption("overwrite decode: " + what); }

// Feeds fixed-size records into a writer through a bounded staging buffer.
class StagedWriter {
 public:
  StagedWriter(ZstdFrameWriter* writer, size_t capacity)
      : writer_(writer), buffer_(new uint8_t[capacity]), capacity_(capacity) {}
  // Room for at least `n` more bytes, flushing to the writer if needed.
  Status Reserve(size_t n, uint8_t** dst) {
    if (used_ + n > capacity_) DS_RETURN_IF_ERROR(Drain());
    *dst = buffer_.get() + used_;
    used_ += n;
    return Status::OK();
  }
  Status Drain() {
    Status status = writer_->Write({buffer_.get(), used_});
    used_ = 0;
    return status;
  }

 private:
  ZstdFrameWriter* writer_;
  std::unique_ptr<uint8_t[]> buffer_;
  size_t capacity_;
  size_t used_ = 0;
};

class OverwriteCodecImpl final : public Codec {
 public:
  const EncodingInfo& info() const override { return kOverwriteInfo; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                const EncodeOptions& options, std::vector<uint8_t>* out) const override {
    DS_RETURN_IF_ERROR(ValidateChangeSet(new_bytes, changes, kOverwriteInfo.needs_old_values,
                                         kOverwriteInfo.name));
    if (new_bytes.size() > kOverwriteInfo.max_tensor_bytes) {
      return Status::Unsupported(
          "overwrite encode: the format's u32 byte positions cannot "
          "address a tensor of " +
          std::to_string(new_bytes.size()) + " bytes");
    }
    const size_t es = changes.elem_size;
    const uint64_t count = changes.count();
    const uint8_t* new_values = changes.new_values.data();
    const uint8_t* old_values = changes.old_values.data();
    uint64_t differing = 0;
    for (uint64_t i = 0; i < count * es; ++i) differing += new_values[i] != old_values[i];
    if (differing > std::numeric_limits<uint32_t>::max()) {
      return Status::Unsupported("overwrite encode: " + std::to_string(differing) +
                                 " changed bytes exceed the format's u32 count");
    }

    ZstdFrameWriter writer(out);
    DS_RETURN_IF_ERROR(writer
                           .Begin(options.zstd_level, options.ZstdChecksumFor(Encoding::kOverwrite),
                                  4 + 5 * differing)
                           .WithContext("overwrite encode"));
    StagedWriter staged(&writer, std::max<size_t>(options.chunk_bytes, 4 * es));
    uint8_t* dst = nullptr;
    DS_RETURN_IF_ERROR(staged.Reserve(4, &dst));
    StoreLe<uint32_t>(dst, static_cast<uint32_t>(differing));
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t base = changes.position(i) * es;
      for (size_t b = 0; b < es; ++b) {
        if (new_values[i * es + b] == old_values[i * es + b]) continue;
        DS_RETURN_IF_ERROR(staged.Reserve(4, &dst).WithContext("overwrite encode"));
        StoreLe<uint32_t>(dst, static_cast<uint32_t>(base + b));
      }
    }
    for (uint64_t i = 0; i < count * es; ++i) {
      if (new_values[i] == old_values[i]) continue;
      DS_RETURN_IF_ERROR(staged.Reserve(1, &dst).WithContext("overwrite encode"));
      *dst = new_values[i];
    }
    DS_RETURN_IF_ERROR(staged.Drain().WithContext("overwrite encode"));
    return writer.Finish().WithContext("overwrite encode");
  }

  Status DecodeApply(std::span<const uint8_t> encoded, std::span<uint8_t> target,
                     uint32_t elem_size, const DecodeOptions& options) const override {
    ZstdFrameReader positions;
    DS_ASSIGN_OR_RETURN(const uint64_t count,
                        BeginFrame(encoded, target, elem_size, options, &positions));
    const size_t chunk_bytes = std::max<size_t>(options.chunk_bytes, 5);
    if (5 * count <= chunk_bytes) {
      return ApplyBuffered(&positions, count, target);
    }
    return ApplyTwoCursors(encoded, &positions, count, target, chunk_bytes, options);
  }

  Status DecodeChanges(std::span<const uint8_t> encoded, std::span<const uint8_t> base,
                       uint32_t elem_size, const DecodeOptions& options,
                       ChangeSet* out) const override {
    ZstdFrameReader reader;
    DS_ASSIGN_OR_RETURN(const uint64_t count,
                        BeginFrame(encoded, base, elem_size, options, &reader));
    // Gathering K entries costs 5 K bytes: beyond the tensor's own size a
    // scratch copy is the cheaper way (a hostile K must not cost more).
    if (5 * count > base.size()) {
      return DecodeChangesViaCopy(*this, encoded, base, elem_size, options, out);
    }
    std::vector<uint32_t> positions(count);
    std::vector<uint8_t> values(count);
    for (uint64_t done = 0; done < count;) {
      const size_t m = static_cast<size_t>(std::min<uint64_t>(count - done, 1 << 18));
      uint8_t* dst = reinterpret_cast<uint8_t*>(positions.data() + done);
      DS_RETURN_IF_ERROR(reader.Read(dst, 4 * m).WithContext("overwrite decode"));
      for (size_t j = 0; j < m; ++j) positions[done + j] = LoadLe<uint32_t>(dst + 4 * j);
      done += m;
    }
    if (count) {
      DS_RETURN_IF_ERROR(reader.Read(values.data(), count).WithContext("overwrite decode"));
    }
    DS_RETURN_IF_ERROR(reader.ExpectEnd().WithContext("overwrite decode"));
    for (uint64_t i = 0; i < count; ++i) {
      if (positions[i] >= base.size()) return PositionOutside(positions[i], i, base.size());
    }
    // Entries may come in any order and repeat a byte (the last one wins,
    // as when applying in order). Ours and vime's are strictly ascending;
    // anything else is applied to a scratch copy and diffed.
    for (uint64_t i = 1; i < count; ++i) {
      if (positions[i - 1] >= positions[i]) {
        return DecodeChangesViaCopy(*this, encoded, base, elem_size, options, out);
      }
    }
    ChangeCollector collector(base, elem_size, options, out);
    uint8_t element[8];
    // The base lines are requested ahead, as the sparse decoder does.
    const uint64_t lead = std::min<uint64_t>(count, kPrefetchLeadChanges);
    for (uint64_t k = 0; k < lead; ++k) __builtin_prefetch(base.data() + positions[k], /*rw=*/0);
    for (uint64_t k = 0; k < count;) {
      if (k + lead < count) __builtin_prefetch(base.data() + positions[k + lead], /*rw=*/0);
      const uint64_t elem = positions[k] / elem_size;
      std::memcpy(element, base.data() + elem * elem_size, elem_size);
      for (; k < count && positions[k] / elem_size == elem; ++k) {
        element[positions[k] % elem_size] = values[k];
      }
      collector.AddNew(elem, element);
    }
    return Status::OK();
  }

 private:
  // Checks the arguments, opens the frame and reads K, refusing a K that
  // cannot fit the tensor or disagrees with the frame's declared size.
  static Result<uint64_t> BeginFrame(std::span<const uint8_t> encoded,
                                     std::span<const uint8_t> target, uint32_t elem_size,
                                     const DecodeOptions& options, ZstdFrameReader* reader) {
    DS_RETURN_IF_ERROR(ValidateTarget(target, elem_size).WithContext("overwrite decode"));
    Result<uint64_t> header_size = ZstdFrameContentSize(encoded);
    if (!header_size.ok()) return header_size.status().WithContext("overwrite decode");
    const uint64_t content_size = *header_size;
    DS_RETURN_IF_ERROR(
        reader->Begin(encoded, options.zstd_window_log_max, 0).WithContext("overwrite decode"));
    uint8_t count_bytes[4];
    DS_RETURN_IF_ERROR(reader->Read(count_bytes, 4).WithContext("overwrite decode"));
    const uint64_t count = LoadLe<uint32_t>(count_bytes);
    if (count > target.size()) {
      return Corrupt(std::to_string(count) + " positions for a tensor of " +
                     std::to_string(target.size()) + " bytes");
    }
    const uint64_t expected_size = 4 + 5 * count;
    if (content_size != kZstdUnknownSize && content_size != expected_size) {
      return Corrupt("frame content is " + std::to_string(content_size) + " bytes, but K = " +
                     std::to_string(count) + " needs " + std::to_string(expected_size));
    }
    return count;
  }

  static Status PositionOutside(uint32_t pos, uint64_t entry, size_t target_bytes) {
    return Corrupt("byte position " + std::to_string(pos) + " at entry " + std::to_string(entry) +
                   " is outside the tensor's " + std::to_string(target_bytes) + " bytes");
  }

  // Small deltas: the whole content fits one chunk, so it is checked in full
  // (including the frame checksum) before the target is touched.
  static Status ApplyBuffered(ZstdFrameReader* reader, uint64_t count, std::span<uint8_t> target) {
    std::unique_ptr<uint8_t[]> buffer(new uint8_t[std::max<uint64_t>(5 * count, 1)]);
    DS_RETURN_IF_ERROR(reader->Read(buffer.get(), 5 * count).WithContext("overwrite decode"));
    DS_RETURN_IF_ERROR(reader->ExpectEnd().WithContext("overwrite decode"));
    const uint8_t* values = buffer.get() + 4 * count;
    for (uint64_t i = 0; i < count; ++i) {
      const uint32_t pos = LoadLe<uint32_t>(buffer.get() + 4 * i);
      if (pos >= target.size()) return PositionOutside(pos, i, target.size());
    }
    for (uint64_t i = 0; i < count; ++i) target[LoadLe<uint32_t>(buffer.get() + 4 * i)] = values[i];
    return Status::OK();
  }

  static Status ApplyTwoCursors(std::span<const uint8_t> encoded, ZstdFrameReader* positions,
                                uint64_t count, std::span<uint8_t> target, size_t chunk_bytes,
                                const DecodeOptions& options) {
    std::unique_ptr<uint8_t[]> buffer(new uint8_t[chunk_bytes]);
    ZstdFrameReader values;
    DS_RETURN_IF_ERROR(
        values.Begin(encoded, options.zstd_window_log_max, 1).WithContext("overwrite decode"));
    DS_RETURN_IF_ERROR(values.Skip(4 + 4 * count, {buffer.get(), chunk_bytes})
                           .WithContext("overwrite decode (value cursor)"));
    const uint64_t per_step = chunk_bytes / 5;
    uint8_t* pos_buf = buffer.get();
    uint8_t* val_buf = buffer.get() + 4 * per_step;
    for (uint64_t done = 0; done < count;) {
      const size_t m = static_cast<size_t>(std::min(per_step, count - done));
      DS_RETURN_IF_ERROR(positions->Read(pos_buf, 4 * m).WithContext("overwrite decode"));
      DS_RETURN_IF_ERROR(values.Read(val_buf, m).WithContext("overwrite decode"));
      for (size_t j = 0; j < m; ++j) {
        const uint32_t pos = LoadLe<uint32_t>(pos_buf + 4 * j);
        if (pos >= target.size()) return PositionOutside(pos, done + j, target.size());
        target[pos] = val_buf[j];
      }
      done += m;
    }
    return values.ExpectEnd().WithContext("overwrite decode");
  }
};

}  // namespace

const Codec& OverwriteCodec() {
  static const OverwriteCodecImpl codec;
  return codec;
}

}  // namespace deltasync::codec_internal
