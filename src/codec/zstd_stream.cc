#include "codec/zstd_stream.h"

#include <algorithm>
#include <string>

#include "codec/codec_internal.h"

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

}  // namespace

Result<uint64_t> ZstdFrameContentSize(std::span<const uint8_t> frame) {
  if (frame.size() < 4 || LoadLE32(frame.data()) != ZSTD_MAGICNUMBER) {
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
  if (cctx_ == nullptr) return;
  std::vector<ZSTD_CCtx*>& spares = Contexts().spare_cctx;
  if (spares.size() < kMaxSpareCCtx) {
    spares.push_back(cctx_);
  } else {
    ZSTD_freeCCtx(cctx_);
  }
}

Status ZstdFrameWriter::Begin(int level, bool checksum, uint64_t pledged_size) {
  if (cctx_ == nullptr) {
    std::vector<ZSTD_CCtx*>& spares = Contexts().spare_cctx;
    if (!spares.empty()) {
      cctx_ = spares.back();
      spares.pop_back();
    } else {
      cctx_ = ZSTD_createCCtx();
    }
  }
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
    if (out_->size() < used_ + room) {
      // Geometric growth keeps appends amortized O(1) without a side buffer;
      // only the slack actually exposed is zero-filled.
      if (out_->capacity() < used_ + room) {
        out_->reserve(std::max(used_ + room, 2 * out_->capacity()));
      }
      out_->resize(used_ + room);
    }
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
