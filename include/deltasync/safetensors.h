// The safetensors file format: a validating mmap reader with zero-copy
// tensor views, and an atomic streaming writer.
//
// Layout (docs/format.md, "safetensors"): an 8-byte little-endian header
// length N, N bytes of UTF-8 JSON header, then the data buffer. The header
// maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the data buffer) and may hold "__metadata__", a map of
// string to string.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/tensor.h"

namespace deltasync {

// Largest header we accept: 100 MiB, the size of the reference
// implementation's cap (real headers are at most a few MB). It bounds what a
// hostile length prefix can make us parse and allocate.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// One tensor's entry in a header.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offset in the data buffer
  uint64_t end = 0;
};

// A parsed and fully validated header.
struct SafetensorsHeader {
  // Sorted by (begin, end, name): data order, with zero-size tensors that
  // share an offset in name order.
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Parses and validates header JSON bytes against a data buffer of
// `data_size` bytes. Enforces every rule in docs/format.md: valid UTF-8, a
// JSON object starting at the first byte (trailing whitespace allowed), no
// duplicate keys, entries of exactly {"dtype", "shape", "data_offsets"},
// known dtypes, non-negative integer dims and offsets that fit in 64 bits,
// shape x element size == end - begin, offsets within the buffer, entries
// neither overlapping nor leaving holes, and the entries covering the whole
// buffer; "__metadata__" an object of string -> string. Errors are
// Corruption (malformed) or Unsupported (unknown dtype); messages name the
// offending tensor or key but not the file (SafetensorsFile adds that).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> header_json,
                                                 uint64_t data_size);

// How a consumer is about to read a file's bytes; passed on to madvise.
enum class AccessHint {
  kNormal,      // the kernel's default read-around
  kSequential,  // one pass front to back: read ahead further
  kRandom,      // scattered small reads: do not read ahead
  kWillNeed,    // start reading these pages in now, asynchronously
  kDontNeed,    // done with these pages for now (they stay valid to read)
};

// A read-only, fully validated safetensors image: a memory-mapped file, or
// bytes the caller owns. Tensor views point into the image (zero copy) and
// stay valid for the lifetime of the object.
class SafetensorsFile {
 public:
  // Maps and validates `path`. Every error message starts with the path.
  // NotFound when the file does not exist. The file must not be truncated
  // while mapped (reading a page past the new end raises SIGBUS); files are
  // only ever replaced by rename in this library, which is safe.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Validates a complete file image held in memory, applying exactly the
  // rules of Open. `image` must outlive the result; `name` stands in for the
  // path in messages.
  static Result<std::unique_ptr<SafetensorsFile>> OpenMemory(std::string name,
                                                             std::span<const uint8_t> image);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In data-offset order.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // NotFound when absent.
  Result<TensorView> Get(const std::string& name) const;
  uint64_t file_size() const { return size_; }
  // Bytes of header JSON (padding included), excluding the 8-byte prefix.
  uint64_t header_size() const { return header_size_; }
  // The data buffer: every tensor's bytes, back to back.
  std::span<const uint8_t> data() const { return data_; }

  // Hints the kernel about the coming access to `bytes` (a view into this
  // file; empty = the whole data buffer). Mapped files only, a no-op for
  // OpenMemory images; failures are ignored since a hint cannot be wrong.
  // Open leaves the default read-around in place: a diff streams a tensor
  // once, but checksumming may re-read it, so dropping pages early
  // (kSequential) is the caller's call.
  void Advise(AccessHint hint, std::span<const uint8_t> bytes = {}) const;

 private:
  SafetensorsFile() = default;
  Status Parse();

  std::string path_;
  void* map_ = nullptr;  // non-null only when this object owns a mapping
  const uint8_t* image_ = nullptr;
  uint64_t size_ = 0;
  uint64_t header_size_ = 0;
  std::span<const uint8_t> data_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, size_t> index_;
};

// What a writer is told about each tensor before any bytes are written.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
};

// The header JSON for `specs` laid out back to back in the given order,
// padded with spaces so that 8 + its length is a multiple of 8 (the data
// buffer then starts 8-byte aligned, as the reference writer does).
// "__metadata__" is written only when `metadata` is non-empty.
// InvalidArgument for a spec the format cannot hold: an empty, repeated or
// reserved ("__metadata__") name, a name or metadata string that is not
// UTF-8, a negative dim, or a byte size past 64 bits.
Result<std::string> BuildSafetensorsHeader(const std::vector<TensorSpec>& specs,
                                           const std::map<std::string, std::string>& metadata);

namespace io {
class AtomicFile;
}

// Streams a safetensors file: the header is written from the specs up front,
// then each tensor's bytes in spec order, in as many Append calls as wanted.
// The file appears at `path` only on a successful Finish (temp file in the
// same directory, fsync, rename, fsync of the directory); a writer destroyed
// without Finish removes its temp file.
class SafetensorsWriter {
 public:
  // Errors as BuildSafetensorsHeader, or IOError when the temp file cannot
  // be created.
  static Result<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorSpec> specs,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes of the current tensor (and on into the next ones). Writing
  // more bytes than the specs declare is InvalidArgument (nothing of that
  // call is written).
  Status Append(std::span<const uint8_t> bytes);
  // FailedPrecondition unless exactly the declared bytes were appended.
  Status Finish();

  uint64_t expected_bytes() const { return expected_; }
  uint64_t written_bytes() const { return written_; }

 private:
  SafetensorsWriter();
  std::string path_;
  std::unique_ptr<io::AtomicFile> file_;
  uint64_t expected_ = 0, written_ = 0;
  bool finished_ = false;
};

// Writes `tensors` (in the given order) to `path` atomically.
// InvalidArgument when a view's bytes do not match its shape and dtype, or as
// BuildSafetensorsHeader.
Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

}  // namespace deltasync
