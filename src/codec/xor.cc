// xor: vime/slime's default disk encoding. One zstd frame whose content is
// new ^ old over every byte of the tensor (zeros where nothing changed).
// Encoding streams chunks of that content into the compressor, built from the
// ChangeSet, so the whole XOR image never exists in memory; decoding streams
// it back out and XORs each chunk into the target.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "codec/codec_internal.h"
#include "codec/zstd_stream.h"

namespace deltasync::codec_internal {
namespace {

// The descriptor (codec.h, EncodingInfo).
constexpr EncodingInfo kXorInfo = {
    .encoding = Encoding::kXor,
    .name = "xor",
    .compression = "zstd",
    .needs_old_values = true,
    .needs_base = true,
    .idempotent = false,
    .streams = true,
    .carries_values = false,
    .read_by_python_receiver = true,
    .zstd_checksum_by_default = false,
    .max_tensor_bytes = UINT64_MAX,
};

// A decoded chunk, reused by each thread from tensor to tensor (a decode
// runs start to end on one thread): a fresh megabyte per tensor costs a page
// fault per 4 KiB.
std::vector<uint8_t>& ThreadDecodeChunk() {
  thread_local std::vector<uint8_t> chunk;
  return chunk;
}

// A zero run shorter than this stays in the literals. The run is one zero
// literal then a match, and zstd takes external matches of at least 4 bytes
// (3 only at levels whose own minimum match is 3): it sizes its sequence
// store by that. Measured on a BF16 training step, short runs as matches
// also give the smallest frames: 5, 8, 16 and 32 gave 19.0, 19.1, 19.9
// and 22.9 MiB for 1 GiB at 2% changed.
constexpr size_t kMinZeroRun = 5;

// Sequences of the block being written, reused by each thread.
std::vector<ZSTD_Sequence>& ThreadSequences() {
  thread_local std::vector<ZSTD_Sequence> sequences;
  return sequences;
}

// The xor encoding from ranges: the XOR image is staged options.chunk_bytes
// at a time, exactly as Encode stages it, so the frames are identical. The
// stage is all zeros but for the changed elements, whose offsets the stream
// keeps, so it is handed to zstd as sequences: the changed elements as
// literals, each zero run as a match of offset 1 behind its first zero. zstd
// then does no match search over the tensor's bytes, which is most of the
// time of compressing an XOR image and, for a sparse one, finds nothing
// better.
class XorEncodeStream final : public EncodeStream {
 public:
  XorEncodeStream(uint64_t numel, uint32_t elem_size, const EncodeOptions& options,
                  std::vector<uint8_t>* out)
      : ranges_(numel, elem_size, kXorInfo.needs_old_values, kXorInfo.name),
        stage_buffer_(PooledBuffer::kZeroed),
        stage_(stage_buffer_.bytes()),
        writer_(out) {
    if (!IsValidElemSize(elem_size)) {
      begun_ = Status::InvalidArgument("xor encode stream: element size " +
                                       std::to_string(elem_size) + " (expected 1, 2, 4 or 8)");
      return;
    }
    es_ = elem_size;
    total_ = numel * elem_size;
    chunk_ = static_cast<size_t>(
        std::min<uint64_t>(ElementsPerChunk(options.chunk_bytes, es_) * es_, total_));
    if (stage_.size() < chunk_) stage_.resize(chunk_, 0);
    begun_ = writer_.Begin(options.zstd_level, options.ZstdChecksumFor(Encoding::kXor), total_)
                 .WithContext("xor encode");
  }
  ~XorEncodeStream() override { ClearStage(); }

  Status Add(uint64_t first, std::span<const uint8_t> new_chunk, const ChangeSet& piece) override {
    DS_RETURN_IF_ERROR(begun_);
    DS_RETURN_IF_ERROR(ranges_.Add(first, new_chunk, piece));
    for (uint64_t i = 0; i < piece.count(); ++i) {
      const uint64_t at = (first + piece.position(i)) * es_;
      while (at >= stage_at_ + chunk_) DS_RETURN_IF_ERROR(WriteStage());
      const auto offset = static_cast<size_t>(at - stage_at_);
      ChangedXor(piece, i, stage_.data() + offset);
      dirty_.push_back(offset);
    }
    const uint64_t covered = (first + piece.numel) * es_;
    while (stage_at_ < total_ && covered >= stage_at_ + chunk_) DS_RETURN_IF_ERROR(WriteStage());
    return Status::OK();
  }

  Status Finish() override {
    DS_RETURN_IF_ERROR(begun_);
    DS_RETURN_IF_ERROR(ranges_.CheckComplete());
    while (stage_at_ < total_) DS_RETURN_IF_ERROR(WriteStage());
    return writer_.Finish().WithContext("xor encode");
  }

 private:
  Status WriteStage() {
    const auto n = static_cast<size_t>(std::min<uint64_t>(chunk_, total_ - stage_at_));
    constexpr size_t kBlock = ZstdSequenceFrameWriter::kMaxBlockBytes;
    std::vector<ZSTD_Sequence>& sequences = ThreadSequences();
    size_t d = 0;  // next entry of dirty_
    for (size_t block = 0; block < n; block += kBlock) {
      const size_t end = std::min(n, block + kBlock);
      sequences.clear();
      size_t literals_from = block;  // first byte no sequence covers yet
      size_t zeros_from = block;     // first byte past the last changed element
      // Bytes [zeros_from, to) are zeros.
      auto zero_run = [&](size_t to) {
        if (to - zeros_from < kMinZeroRun) return;
        sequences.push_back({/*offset=*/1, static_cast<unsigned>(zeros_from + 1 - literals_from),
                             static_cast<unsigned>(to - zeros_from - 1), /*rep=*/0});
        literals_from = to;
      };
      // dirty_ ascends without repeats: the ranges' positions were checked.
      for (; d < dirty_.size() && dirty_[d] < end; ++d) {
        zero_run(dirty_[d]);
        zeros_from = dirty_[d] + es_;
      }
      zero_run(end);
      DS_RETURN_IF_ERROR(writer_.WriteBlock({stage_.data() + block, end - block}, sequences)
                             .WithContext("xor encode"));
    }
    ClearStage();
    stage_at_ += n;
    return Status::OK();
  }
  // Re-zeroes what was scattered: the stage stays all zeros without a
  // memset per chunk.
  void ClearStage() {
    for (size_t offset : dirty_) std::memset(stage_.data() + offset, 0, es_);
    dirty_.clear();
  }

  StreamRanges ranges_;
  PooledBuffer stage_buffer_;  // all zeros but for dirty_, given back zeroed
  std::vector<uint8_t>& stage_;
  ZstdSequenceFrameWriter writer_;
  Status begun_;
  size_t es_ = 1;
  uint64_t total_ = 0;
  size_t chunk_ = 0;
  uint64_t stage_at_ = 0;  // byte offset of the stage in the tensor
  std::vector<size_t> dirty_;
};

class XorCodecImpl final : public Codec {
 public:
  const EncodingInfo& info() const override { return kXorInfo; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                const EncodeOptions& options, std::vector<uint8_t>* out) const override {
    return EncodeAsOneRange<XorEncodeStream>(new_bytes, changes, options, out);
  }

  std::unique_ptr<EncodeStream> NewEncodeStream(uint64_t numel, uint32_t elem_size,
                                                const EncodeOptions& options,
                                                std::vector<uint8_t>* out) const override {
    return std::make_unique<XorEncodeStream>(numel, elem_size, options, out);
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
    std::vector<uint8_t>& chunk = ThreadDecodeChunk();
    if (chunk.size() < chunk_bytes) chunk.resize(chunk_bytes);
    for (size_t offset = 0; offset < target.size(); offset += chunk_bytes) {
      const size_t n = std::min(chunk_bytes, target.size() - offset);
      DS_RETURN_IF_ERROR(reader.Read(chunk.data(), n).WithContext("xor decode"));
      sink(offset, chunk.data(), n);
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
