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

// Largest header we accept. The reference implementation uses the same cap;
// it bounds what a hostile length prefix can make us allocate.
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
  std::vector<SafetensorsEntry> entries;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

// Parses and validates header JSON bytes against a data buffer of
// `data_size` bytes. Enforces every rule in docs/format.md: valid UTF-8 JSON
// object, no duplicate keys, known dtypes, non-negative integer shapes,
// shape x element size == end - begin, offsets within the buffer, entries
// neither overlapping nor leaving holes, and the entries covering the whole
// buffer; "__metadata__" string -> string. Errors are Corruption (malformed)
// or Unsupported (unknown dtype).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> header_json,
                                                 uint64_t data_size);

// A read-only, memory-mapped safetensors file. Views stay valid for the
// lifetime of the object.
class SafetensorsFile {
 public:
  // Opens and validates `path`. Every error message names the file.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
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
  uint64_t header_size() const { return header_size_; }

 private:
  SafetensorsFile() = default;

  std::string path_;
  void* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t header_size_ = 0;
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

// Streams a safetensors file: the header is written from the specs up front,
// then each tensor's bytes in spec order, in as many Append calls as wanted.
// The file appears at `path` only on a successful Finish (temp file in the
// same directory, fsync, rename, fsync of the directory); a writer destroyed
// without Finish removes its temp file.
class SafetensorsWriter {
 public:
  static Result<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorSpec> specs,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();

  // Appends bytes of the current tensor (and on into the next ones). Writing
  // more bytes than the specs declare is InvalidArgument.
  Status Append(std::span<const uint8_t> bytes);
  // Fails unless exactly the declared bytes were appended.
  Status Finish();

 private:
  SafetensorsWriter() = default;
  std::string path_, tmp_path_;
  int fd_ = -1;
  uint64_t expected_ = 0, written_ = 0;
  bool finished_ = false;
};

// Writes `tensors` (in the given order) to `path` atomically.
Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

}  // namespace deltasync
