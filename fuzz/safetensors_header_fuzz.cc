// libFuzzer target for the safetensors reader.
//
// Every input is used twice:
//  1. Header mode: the first 8 bytes (little-endian) give a data-buffer size
//     and the rest is header JSON for ParseSafetensorsHeader.
//  2. File mode: the whole input is a file image, opened both from memory
//     and from a real (memory-mapped) file; both must agree exactly.
//  3. Index mode: the whole input is a checkpoint index
//     (model.safetensors.index.json), which must serialize and parse back
//     to the same index when accepted.
// Whatever is accepted must satisfy the reader's guarantees (tensors tile
// the data buffer, views inside the image, bytes match shapes) and must
// survive a write/read round trip unchanged. A violation aborts.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deltasync/checkpoint.h"
#include "deltasync/safetensors.h"
#include "fuzz_util.h"

namespace {

using deltasync::Result;
using deltasync::SafetensorsFile;
using deltasync::SafetensorsHeader;
using deltasync::Status;
using deltasync::TensorView;

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

// One scratch file per process, rewritten for each input.
struct ScratchFile {
  std::string path;
  int fd = -1;

  ScratchFile() {
    // tmpfs when available: truncating and rewriting a file on a journaling
    // file system for every input costs more than the parse itself.
    const char* env = std::getenv("TMPDIR");
    std::string dir = env && *env ? env : ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string pattern = dir + "/ds_fuzz_XXXXXX";
    fd = ::mkstemp(pattern.data());
    Require(fd >= 0, "mkstemp");
    path = pattern;
  }
  ~ScratchFile() {
    ::close(fd);
    ::unlink(path.c_str());
  }
  void Store(const uint8_t* data, size_t size) {
    Require(::ftruncate(fd, 0) == 0, "ftruncate");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
      Require(n > 0, "pwrite");
      done += static_cast<size_t>(n);
    }
  }
};

void CheckHeader(const SafetensorsHeader& header, uint64_t data_size) {
  uint64_t covered = 0;
  for (const auto& entry : header.entries) {
    Require(entry.begin == covered, "entries tile the buffer");
    Require(entry.end >= entry.begin && entry.end <= data_size, "entry within the buffer");
    uint64_t nbytes = deltasync::DTypeSize(entry.dtype);
    for (int64_t dim : entry.shape) {
      Require(dim >= 0, "non-negative dims");
      nbytes *= static_cast<uint64_t>(dim);
    }
    Require(entry.end - entry.begin == nbytes, "shape matches byte range");
    covered = entry.end;
  }
  Require(covered == data_size, "entries cover the buffer");
}

void CheckFile(const SafetensorsFile& file, const uint8_t* image, size_t size) {
  const auto data = file.data();
  Require(data.data() >= image && data.data() + data.size() == image + size,
          "data buffer is the image's tail");
  for (const TensorView& tensor : file.tensors()) {
    Require(tensor.Validate().ok(), "view matches its shape");
    Require(tensor.bytes.empty() ||
                (tensor.bytes.data() >= data.data() &&
                 tensor.bytes.data() + tensor.bytes.size() <= data.data() + data.size()),
            "view inside the data buffer");
    Result<TensorView> again = file.Get(tensor.name);
    Require(again.ok() && again->bytes.data() == tensor.bytes.data(), "Get finds the tensor");
  }
}

// Writing what was read and reading it back must give the same tensors.
void CheckRoundTrip(const SafetensorsFile& file) {
  std::vector<deltasync::TensorSpec> specs;
  for (const TensorView& t : file.tensors()) specs.push_back({t.name, t.dtype, t.shape});
  Result<std::string> header = deltasync::BuildSafetensorsHeader(specs, file.metadata());
  Require(header.ok(), "an accepted file can be re-written");
  std::string image(8, '\0');
  for (int i = 0; i < 8; ++i) image[i] = static_cast<char>(header->size() >> (8 * i));
  image += *header;
  for (const TensorView& t : file.tensors()) {
    image.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  auto reread = SafetensorsFile::OpenMemory(
      "rewritten", std::span(reinterpret_cast<const uint8_t*>(image.data()), image.size()));
  Require(reread.ok(), "a re-written file opens");
  Require((*reread)->metadata() == file.metadata(), "metadata survives");
  Require((*reread)->tensors().size() == file.tensors().size(), "tensor count survives");
  for (size_t i = 0; i < file.tensors().size(); ++i) {
    const TensorView& a = file.tensors()[i];
    const TensorView& b = (*reread)->tensors()[i];
    Require(
        a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
            a.bytes.size() == b.bytes.size() &&
            (a.bytes.empty() || std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0),
        "tensor survives");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ScratchFile scratch;

  if (size >= 8) {
    uint64_t data_size = 0;
    for (int i = 7; i >= 0; --i) data_size = (data_size << 8) | data[i];
    Result<SafetensorsHeader> header =
        deltasync::ParseSafetensorsHeader(std::span(data + 8, size - 8), data_size);
    if (header.ok()) CheckHeader(*header, data_size);
  }

  auto in_memory = SafetensorsFile::OpenMemory(scratch.path, std::span(data, size));
  scratch.Store(data, size);
  auto mapped = SafetensorsFile::Open(scratch.path);
  Require(in_memory.status().ToString() == mapped.status().ToString(),
          "memory and mmap readers agree");
  if (in_memory.ok()) {
    CheckFile(**in_memory, data, size);
    CheckRoundTrip(**in_memory);
    Require((*mapped)->tensors().size() == (*in_memory)->tensors().size(), "same tensors");
  }

  (void)deltasync::fuzz_util::CheckIndexRoundTrip(
      std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
