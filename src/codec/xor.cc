// xor: vime/slime's default disk encoding. One zstd frame whose content is
// new ^ old over every byte of the tensor (zeros where nothing changed).
// Encoding streams chunks of that content into the compressor, built from the
// ChangeSet, so the whole XOR image never exists in memory; decoding streams
// it back out and XORs each chunk into the target.
#include <algorithm>
#include <memory>
#include <string>

#include "codec/codec_internal.h"
#include "codec/zstd_stream.h"

namespace deltasync::codec_internal {
namespace {

class XorCodecImpl final : public Codec {
 public:
  Encoding encoding() const override { return Encoding::kXor; }
  bool needs_old_values() const override { return true; }
  bool needs_base() const override { return true; }
  bool idempotent() const override { return false; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                const EncodeOptions& options, std::vector<uint8_t>* out) const override {
    DS_RETURN_IF_ERROR(ValidateChangeSet(new_bytes, changes, true, "xor"));
    const size_t es = changes.elem_size;
    const uint64_t total = new_bytes.size();
    const uint64_t count = changes.count();
    ZstdFrameWriter writer(out);
    // The content size goes into the frame header: python-zstandard's
    // one-shot decompress(), which the peer may use, requires it.
    DS_RETURN_IF_ERROR(
        writer.Begin(options.zstd_level, options.zstd_checksum, total).WithContext("xor encode"));
    const size_t chunk_elems = ElementsPerChunk(options.chunk_bytes, es);
    const size_t chunk_bytes = static_cast<size_t>(std::min<uint64_t>(chunk_elems * es, total));
    std::unique_ptr<uint8_t[]> chunk(new uint8_t[std::max<size_t>(chunk_bytes, 1)]());
    uint64_t next = 0;  // first change not yet written
    for (uint64_t offset = 0; offset < total; offset += chunk_bytes) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, total - offset));
      const uint64_t first_elem = offset / es;
      const uint64_t end_elem = (offset + n) / es;
      const uint64_t begin = next;
      for (; next < count && changes.position(next) < end_elem; ++next) {
        ChangedXor(changes, next, chunk.get() + (changes.position(next) - first_elem) * es);
      }
      DS_RETURN_IF_ERROR(writer.Write({chunk.get(), n}).WithContext("xor encode"));
      // Re-zero only what was scattered: the chunk stays all-zero between
      // chunks without a full memset.
      for (uint64_t i = begin; i < next; ++i) {
        std::memset(chunk.get() + (changes.position(i) - first_elem) * es, 0, es);
      }
    }
    return writer.Finish().WithContext("xor encode");
  }

  Status DecodeApply(std::span<const uint8_t> encoded, std::span<uint8_t> target,
                     uint32_t elem_size, const DecodeOptions& options) const override {
    return Stream(encoded, target, elem_size, options,
                  [&](size_t offset, const uint8_t* chunk, size_t n) {
                    XorInto(target.data() + offset, chunk, n);
                  });
  }

  Status DecodeChanges(std::span<const uint8_t> encoded, std::span<const uint8_t> base,
                       uint32_t elem_size, const DecodeOptions& options,
                       ChangeSet* out) const override {
    ChangeCollector collector(base, elem_size, options, out);
    // Most of the XOR image is zeros: the diff kernel (SIMD) against a zero
    // page finds the non-zero elements far faster than a scalar scan.
    static const uint8_t kZeros[size_t{1} << 16] = {};
    ChangeSet found;
    Status scan;
    Status streamed = Stream(encoded, base, elem_size, options,
                             [&](size_t offset, const uint8_t* chunk, size_t n) {
                               for (size_t at = 0; at < n && scan.ok(); at += sizeof(kZeros)) {
                                 const size_t m = std::min(sizeof(kZeros), n - at);
                                 scan = DiffAgainst({chunk + at, m}, {kZeros, m}, elem_size,
                                                    /*keep_old_values=*/false, &found);
                                 if (scan.ok())
                                   collector.AddXorList((offset + at) / elem_size, found);
                               }
                             });
    DS_RETURN_IF_ERROR(scan.WithContext("xor decode"));
    return streamed;
  }

 private:
  // Decompresses the frame in chunks of whole elements, handing each to
  // sink(byte offset, chunk, bytes), after checking that the frame fits the
  // tensor; the last chunk is handed over before the frame's checksum is
  // verified, so a sink that writes must be undone on error.
  template <typename Sink>
  static Status Stream(std::span<const uint8_t> encoded, std::span<const uint8_t> target,
                       uint32_t elem_size, const DecodeOptions& options, Sink sink) {
    DS_RETURN_IF_ERROR(ValidateTarget(target, elem_size).WithContext("xor decode"));
    Result<uint64_t> header_size = ZstdFrameContentSize(encoded);
    if (!header_size.ok()) return header_size.status().WithContext("xor decode");
    const uint64_t content_size = *header_size;
    // Refuse a frame of the wrong size before touching the target.
    if (content_size != kZstdUnknownSize && content_size != target.size()) {
      return Status::Corruption("xor decode: frame decompresses to " +
                                std::to_string(content_size) + " bytes but the tensor has " +
                                std::to_string(target.size()));
    }
    ZstdFrameReader reader;
    DS_RETURN_IF_ERROR(
        reader.Begin(encoded, options.zstd_window_log_max, 0).WithContext("xor decode"));
    const size_t chunk_bytes =
        ElementsPerChunk(std::min<size_t>(options.chunk_bytes, target.size()), elem_size) *
        elem_size;
    std::unique_ptr<uint8_t[]> chunk(new uint8_t[chunk_bytes]);
    for (size_t offset = 0; offset < target.size(); offset += chunk_bytes) {
      const size_t n = std::min(chunk_bytes, target.size() - offset);
      DS_RETURN_IF_ERROR(reader.Read(chunk.get(), n).WithContext("xor decode"));
      sink(offset, chunk.get(), n);
    }
    Status end = reader.ExpectEnd();
    if (!end.ok()) {
      return Status::Corruption("xor decode (tensor of " + std::to_string(target.size()) +
                                " bytes): " + end.message());
    }
    return Status::OK();
  }
};

}  // namespace

const Codec& XorCodec() {
  static const XorCodecImpl codec;
  return codec;
}

}  // namespace deltasync::codec_internal
