#include "codec/zstd_stream.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "codec/codec_internal.h"
#include "core/endian.h"

namespace deltasync::codec_internal {
namespace {

// Compression contexts are owned by a writer from Begin to its destruction
// (several writers may be open on one thread), then kept as spares;
// decompression contexts are used within one call.
constexpr size_t kMaxSpareCCtx = 4;

struct ThreadContexts {
  std::vector<ZSTD_CCtx*> spare_cctx;
  ZSTD_DCtx* dctx[2] = {nullptr, nullptr};
  ~ThreadContexts() {
    for (ZSTD_CCtx* cctx : spare_cctx) ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx[0]);
    ZSTD_freeDCtx(dctx[1]);
  }
};

ThreadContexts& Contexts() {
  thread_local ThreadContexts contexts;
  return contexts;
}

std::string ZstdError(size_t code) { return ZSTD_getErrorName(code); }

// A compression context owned by one writer: the thread's spare, or a new one.
ZSTD_CCtx* TakeCCtx() {
  std::vector<ZSTD_CCtx*>& spares = Contexts().spare_cctx;
  if (spares.empty()) return ZSTD_createCCtx();
  ZSTD_CCtx* cctx = spares.back();
  spares.pop_back();
  return cctx;
}

void GiveCCtx(ZSTD_CCtx* cctx) {
  if (cctx == nullptr) return;
  std::vector<ZSTD_CCtx*>& spares = Contexts().spare_cctx;
  if (spares.size() < kMaxSpareCCtx) {
    spares.push_back(cctx);
  } else {
    ZSTD_freeCCtx(cctx);
  }
}

// Makes out->size() at least used + room. Geometric growth keeps appends
// amortized O(1) without a side buffer; only the slack actually exposed is
// zero-filled, once.
void EnsureRoom(std::vector<uint8_t>* out, size_t used, size_t room) {
  if (out->size() >= used + room) return;
  if (out->capacity() < used + room) out->reserve(std::max(used + room, 2 * out->capacity()));
  out->resize(used + room);
}

// Frame header fields (RFC 8878, 3.1.1.1).
constexpr uint8_t kFhdContentSize8 = 0xC0;  // Frame_Content_Size on 8 bytes
constexpr uint8_t kFhdChecksum = 0x04;
constexpr uint8_t kWindowLog = 17;  // 128 KiB: blocks never refer further back
constexpr uint8_t kWindowLogOfExponent0 = 10;
// Block header fields (RFC 8878, 3.1.1.2).
constexpr uint32_t kLastBlockBit = 1;
constexpr uint32_t kBlockTypeRle = 1;
constexpr size_t kBlockHeaderBytes = 3;

}  // namespace

Result<uint64_t> ZstdFrameContentSize(std::span<const uint8_t> frame) {
  if (frame.size() < 4 || LoadLe<uint32_t>(frame.data()) != ZSTD_MAGICNUMBER) {
    return Status::Corruption("not a zstd frame (missing magic number)");
  }
  unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) {
    return Status::Corruption("truncated or invalid zstd frame header");
  }
  return static_cast<uint64_t>(size);
}

ZstdFrameWriter::ZstdFrameWriter(std::vector<uint8_t>* out) : out_(out), used_(out->size()) {}

ZstdFrameWriter::~ZstdFrameWriter() {
  out_->resize(used_);
  GiveCCtx(cctx_);
}

Status ZstdFrameWriter::Begin(int level, bool checksum, uint64_t pledged_size) {
  if (cctx_ == nullptr) cctx_ = TakeCCtx();
  if (cctx_ == nullptr) return Status::Internal("cannot allocate a zstd compression context");
  size_t rc = ZSTD_CCtx_reset(cctx_, ZSTD_reset_session_and_parameters);
  if (!ZSTD_isError(rc)) rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, level);
  if (!ZSTD_isError(rc)) rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_checksumFlag, checksum ? 1 : 0);
  if (!ZSTD_isError(rc) && pledged_size != kZstdUnknownSize) {
    rc = ZSTD_CCtx_setPledgedSrcSize(cctx_, pledged_size);
  }
  if (ZSTD_isError(rc)) {
    return Status::InvalidArgument("zstd compression parameters (level " + std::to_string(level) +
                                   "): " + ZstdError(rc));
  }
  return Status::OK();
}

Status ZstdFrameWriter::Drive(std::span<const uint8_t> data, ZSTD_EndDirective mode) {
  ZSTD_inBuffer in{data.data(), data.size(), 0};
  const size_t room = ZSTD_CStreamOutSize();
  for (;;) {
    EnsureRoom(out_, used_, room);
    ZSTD_outBuffer out{out_->data() + used_, out_->size() - used_, 0};
    size_t remaining = ZSTD_compressStream2(cctx_, &out, &in, mode);
    used_ += out.pos;
    if (ZSTD_isError(remaining)) {
      return Status::Internal("zstd compression failed: " + ZstdError(remaining));
    }
    bool done = mode == ZSTD_e_continue ? in.pos == in.size : remaining == 0;
    if (done) return Status::OK();
  }
}

Status ZstdFrameWriter::Write(std::span<const uint8_t> data) {
  if (data.empty()) return Status::OK();
  return Drive(data, ZSTD_e_continue);
}

Status ZstdFrameWriter::Flush() { return Drive({}, ZSTD_e_flush); }

Status ZstdFrameWriter::Finish() {
  DS_RETURN_IF_ERROR(Drive({}, ZSTD_e_end));
  out_->resize(used_);
  return Status::OK();
}

ZstdSequenceFrameWriter::ZstdSequenceFrameWriter(std::vector<uint8_t>* out)
    : out_(out), used_(out->size()) {}

ZstdSequenceFrameWriter::~ZstdSequenceFrameWriter() {
  out_->resize(used_);
  GiveCCtx(cctx_);
  if (hash_ != nullptr) XXH64_freeState(hash_);
}

Status ZstdSequenceFrameWriter::Begin(int level, bool checksum, uint64_t content_size) {
  if (cctx_ == nullptr) cctx_ = TakeCCtx();
  if (cctx_ == nullptr) return Status::Internal("cannot allocate a zstd compression context");
  size_t rc = ZSTD_CCtx_reset(cctx_, ZSTD_reset_session_and_parameters);
  if (!ZSTD_isError(rc)) rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, level);
  if (!ZSTD_isError(rc)) rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_checksumFlag, 0);
  if (!ZSTD_isError(rc)) rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_contentSizeFlag, 0);
  if (!ZSTD_isError(rc)) {
    rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_blockDelimiters, ZSTD_sf_noBlockDelimiters);
  }
#ifndef NDEBUG
  if (!ZSTD_isError(rc)) rc = ZSTD_CCtx_setParameter(cctx_, ZSTD_c_validateSequences, 1);
#endif
  if (ZSTD_isError(rc)) {
    return Status::InvalidArgument("zstd compression parameters (level " + std::to_string(level) +
                                   "): " + ZstdError(rc));
  }
  checksum_ = checksum;
  if (checksum_) {
    if (hash_ == nullptr) hash_ = XXH64_createState();
    if (hash_ == nullptr || XXH64_reset(hash_, 0) != XXH_OK) {
      return Status::Internal("cannot start the zstd content checksum");
    }
  }
  content_size_ = content_size;
  written_ = 0;
  uint8_t header[14];
  StoreLe<uint32_t>(header, ZSTD_MAGICNUMBER);
  header[4] = static_cast<uint8_t>(kFhdContentSize8 | (checksum ? kFhdChecksum : 0));
  header[5] = static_cast<uint8_t>((kWindowLog - kWindowLogOfExponent0) << 3);
  StoreLe<uint64_t>(header + 6, content_size);
  Append(header, sizeof(header));
  return Status::OK();
}

Status ZstdSequenceFrameWriter::WriteBlock(std::span<const uint8_t> content,
                                           std::span<const ZSTD_Sequence> sequences) {
  if (content.size() > kMaxBlockBytes || content.size() > content_size_ - written_) {
    return Status::Internal("zstd sequence block of " + std::to_string(content.size()) +
                            " bytes does not fit the frame");
  }
  if (content.empty()) return Status::OK();
  const size_t start = used_;
  const size_t bound = ZSTD_compressBound(content.size());
  EnsureRoom(out_, used_, bound);
  const size_t n = ZSTD_compressSequences(cctx_, out_->data() + start, bound, sequences.data(),
                                          sequences.size(), content.data(), content.size());
  if (ZSTD_isError(n)) {
    return Status::Internal("zstd sequence compression failed: " + ZstdError(n));
  }
  // Move the blocks of the frame just made over its header, each marked as
  // not last: Finish ends this frame.
  uint8_t* frame = out_->data() + start;
  const size_t header = ZSTD_frameHeaderSize(frame, n);
  if (ZSTD_isError(header)) {
    return Status::Internal("zstd sequence compression made no frame header: " + ZstdError(header));
  }
  size_t from = header;
  size_t to = 0;
  bool last = false;
  while (!last) {
    if (from + kBlockHeaderBytes > n) {
      return Status::Internal("zstd sequence compression made a truncated block");
    }
    const uint32_t h =
        frame[from] | (uint32_t{frame[from + 1]} << 8) | (uint32_t{frame[from + 2]} << 16);
    last = (h & kLastBlockBit) != 0;
    const uint32_t type = (h >> 1) & 3;
    const size_t body = type == kBlockTypeRle ? 1 : (h >> 3);
    if (from + kBlockHeaderBytes + body > n) {
      return Status::Internal("zstd sequence compression made a truncated block");
    }
    const uint32_t kept = h & ~kLastBlockBit;
    frame[to] = static_cast<uint8_t>(kept);
    frame[to + 1] = static_cast<uint8_t>(kept >> 8);
    frame[to + 2] = static_cast<uint8_t>(kept >> 16);
    std::memmove(frame + to + kBlockHeaderBytes, frame + from + kBlockHeaderBytes, body);
    from += kBlockHeaderBytes + body;
    to += kBlockHeaderBytes + body;
  }
  used_ = start + to;
  if (checksum_) (void)XXH64_update(hash_, content.data(), content.size());
  written_ += content.size();
  return Status::OK();
}

Status ZstdSequenceFrameWriter::Finish() {
  if (written_ != content_size_) {
    return Status::Internal("zstd sequence frame holds " + std::to_string(written_) + " of " +
                            std::to_string(content_size_) + " bytes");
  }
  // An empty raw block, marked last.
  const uint8_t end[kBlockHeaderBytes] = {static_cast<uint8_t>(kLastBlockBit), 0, 0};
  Append(end, sizeof(end));
  if (checksum_) {
    uint8_t sum[4];
    StoreLe<uint32_t>(sum, static_cast<uint32_t>(XXH64_digest(hash_)));
    Append(sum, sizeof(sum));
  }
  out_->resize(used_);
  return Status::OK();
}

void ZstdSequenceFrameWriter::Append(const uint8_t* bytes, size_t n) {
  EnsureRoom(out_, used_, n);
  std::memcpy(out_->data() + used_, bytes, n);
  used_ += n;
}

Status ZstdFrameReader::Begin(std::span<const uint8_t> frame, int window_log_max, int slot) {
  DS_RETURN_IF_ERROR(ZstdFrameContentSize(frame).status());
  ThreadContexts& contexts = Contexts();
  ZSTD_DCtx*& dctx = contexts.dctx[slot & 1];
  if (dctx == nullptr) dctx = ZSTD_createDCtx();
  if (dctx == nullptr) return Status::Internal("cannot allocate a zstd decompression context");
  dctx_ = dctx;
  size_t rc = ZSTD_DCtx_reset(dctx_, ZSTD_reset_session_and_parameters);
  if (!ZSTD_isError(rc)) rc = ZSTD_DCtx_setParameter(dctx_, ZSTD_d_windowLogMax, window_log_max);
  if (ZSTD_isError(rc)) {
    return Status::InvalidArgument("zstd window log limit " + std::to_string(window_log_max) +
                                   ": " + ZstdError(rc));
  }
  in_ = {frame.data(), frame.size(), 0};
  frame_done_ = false;
  produced_ = 0;
  return Status::OK();
}

Status ZstdFrameReader::Read(uint8_t* dst, size_t n) {
  ZSTD_outBuffer out{dst, n, 0};
  while (out.pos < n) {
    if (frame_done_) {
      return Status::Corruption("zstd frame ends after " + std::to_string(produced_ + out.pos) +
                                " bytes of content, short of what the format requires");
    }
    size_t in_before = in_.pos;
    size_t out_before = out.pos;
    size_t hint = ZSTD_decompressStream(dctx_, &out, &in_);
    if (ZSTD_isError(hint)) {
      return Status::Corruption("zstd frame after " + std::to_string(produced_ + out.pos) +
                                " bytes of content: " + ZstdError(hint));
    }
    if (hint == 0) {
      frame_done_ = true;
    } else if (in_.pos == in_before && out.pos == out_before) {
      return Status::Corruption("truncated zstd frame: input ends after " +
                                std::to_string(produced_ + out.pos) + " bytes of content");
    }
  }
  produced_ += n;
  return Status::OK();
}

Status ZstdFrameReader::Skip(uint64_t n, std::span<uint8_t> scratch) {
  while (n > 0) {
    size_t step = static_cast<size_t>(std::min<uint64_t>(n, scratch.size()));
    DS_RETURN_IF_ERROR(Read(scratch.data(), step));
    n -= step;
  }
  return Status::OK();
}

Status ZstdFrameReader::ExpectEnd() {
  uint8_t extra = 0;
  while (!frame_done_) {
    ZSTD_outBuffer out{&extra, 1, 0};
    size_t in_before = in_.pos;
    size_t hint = ZSTD_decompressStream(dctx_, &out, &in_);
    if (ZSTD_isError(hint)) {
      return Status::Corruption("zstd frame end: " + ZstdError(hint));
    }
    if (out.pos != 0) {
      return Status::Corruption("zstd frame holds more than the " + std::to_string(produced_) +
                                " bytes of content the format allows");
    }
    if (hint == 0) {
      frame_done_ = true;
    } else if (in_.pos == in_before) {
      return Status::Corruption("truncated zstd frame: input ends before the frame does");
    }
  }
  if (in_.pos != in_.size) {
    return Status::Corruption(std::to_string(in_.size - in_.pos) +
                              " unexpected bytes after the zstd frame");
  }
  return Status::OK();
}

}  // namespace deltasync::codec_internal
