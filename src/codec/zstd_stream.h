// Streaming zstd frame writer and reader with bounded memory, on contexts
// reused per thread (creating a zstd context costs more than encoding a
// small tensor).
#pragma once

// ZSTD_compressSequences and ZSTD_Sequence (exported by libzstd 1.5, in the
// header's experimental section).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "deltasync/status.h"

struct XXH64_state_s;  // <xxhash.h>

namespace deltasync::codec_internal {

inline constexpr uint64_t kZstdUnknownSize = ZSTD_CONTENTSIZE_UNKNOWN;

// The content size recorded in the header of the zstd frame at the start of
// `frame`, or kZstdUnknownSize when the header omits it. Corruption when the
// bytes do not start with a complete zstd frame header.
Result<uint64_t> ZstdFrameContentSize(std::span<const uint8_t> frame);

// Appends one zstd frame to a vector, fed in pieces. Each writer holds a
// compression context of its own from Begin on, so writers may interleave.
class ZstdFrameWriter {
 public:
  explicit ZstdFrameWriter(std::vector<uint8_t>* out);
  ZstdFrameWriter(const ZstdFrameWriter&) = delete;
  ZstdFrameWriter& operator=(const ZstdFrameWriter&) = delete;
  // Leaves *out at the bytes written so far (the frame is incomplete unless
  // Finish succeeded).
  ~ZstdFrameWriter();

  // Starts the frame. `pledged_size` is the exact total that Write will be
  // given (recorded in the frame header, which some decoders require), or
  // kZstdUnknownSize.
  Status Begin(int level, bool checksum, uint64_t pledged_size);
  Status Write(std::span<const uint8_t> data);
  // Ends the current zstd block, so data written next gets its own entropy
  // tables instead of sharing a block with differently distributed bytes.
  Status Flush();
  Status Finish();

 private:
  Status Drive(std::span<const uint8_t> data, ZSTD_EndDirective mode);

  ZSTD_CCtx* cctx_ = nullptr;
  std::vector<uint8_t>* out_;
  size_t used_;  // bytes of *out_ that hold output; the rest is slack
};

// Appends one zstd frame whose blocks the caller describes as sequences
// (literals, then a match) instead of having zstd search for matches: for
// content that is mostly zeros, such as an XOR image, the caller knows where
// the zero runs are and the encoding costs time per sequence, not per byte.
// Each WriteBlock is compressed by ZSTD_compressSequences as a frame of its
// own whose blocks are moved into this frame. That is sound because every
// match the caller gives has offset 1 after at least one literal (see
// WriteBlock): zstd's repeat-offset history then starts every block as a
// fresh frame's does, and a frame's first block never refers to the entropy
// tables of an earlier one. The result is an ordinary frame that any zstd
// decoder reads.
class ZstdSequenceFrameWriter {
 public:
  // The largest content one WriteBlock takes.
  static constexpr size_t kMaxBlockBytes = size_t{128} << 10;

  explicit ZstdSequenceFrameWriter(std::vector<uint8_t>* out);
  ZstdSequenceFrameWriter(const ZstdSequenceFrameWriter&) = delete;
  ZstdSequenceFrameWriter& operator=(const ZstdSequenceFrameWriter&) = delete;
  ~ZstdSequenceFrameWriter();

  // Writes the frame header: `content_size` is the exact total the blocks
  // will hold; `level` picks zstd's entropy coding effort.
  Status Begin(int level, bool checksum, uint64_t content_size);
  // Appends `content` (at most kMaxBlockBytes) as the sequences describe it:
  // each has offset 1, a literal length of at least 1 whose last literal is
  // a zero byte, and a match length of at least 4 (zeros); literals left
  // after the last one are implied. Sequences that break this rule make a
  // wrong frame, so callers must keep to it (debug builds check).
  Status WriteBlock(std::span<const uint8_t> content, std::span<const ZSTD_Sequence> sequences);
  // Ends the frame (an empty last block, then the content checksum).
  Status Finish();

 private:
  void Append(const uint8_t* bytes, size_t n);

  ZSTD_CCtx* cctx_ = nullptr;
  std::vector<uint8_t>* out_;
  size_t used_;  // bytes of *out_ that hold output; the rest is slack
  uint64_t content_size_ = 0;
  uint64_t written_ = 0;
  bool checksum_ = false;
  ::XXH64_state_s* hash_ = nullptr;
};

// Reads exactly the content of the single zstd frame that `frame` must hold.
class ZstdFrameReader {
 public:
  ZstdFrameReader() = default;
  ZstdFrameReader(const ZstdFrameReader&) = delete;
  ZstdFrameReader& operator=(const ZstdFrameReader&) = delete;

  // `slot` (0 or 1) picks the thread's cached context, so that two readers
  // can walk the same frame at different offsets.
  Status Begin(std::span<const uint8_t> frame, int window_log_max, int slot);
  // Fills dst[0, n) with the next n bytes of content; Corruption when the
  // frame ends first, is truncated or is malformed.
  Status Read(uint8_t* dst, size_t n);
  // Discards the next n bytes of content, decompressing through `scratch`.
  Status Skip(uint64_t n, std::span<uint8_t> scratch);
  // Corruption unless the frame ends here (checksum verified) and nothing
  // follows it.
  Status ExpectEnd();

 private:
  ZSTD_DCtx* dctx_ = nullptr;
  ZSTD_inBuffer in_{nullptr, 0, 0};
  bool frame_done_ = false;
  uint64_t produced_ = 0;
};

}  // namespace deltasync::codec_internal
