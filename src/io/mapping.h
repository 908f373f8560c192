// Memory-mapped files and advice about their pages: mapping a file
// read-write, and mapping, prefaulting or dropping pages in bulk instead of
// one fault (or one teardown) per page.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync::io {

// A read-write shared mapping of a whole file.
class MappedFile {
 public:
  // IOError naming `path` when it cannot be opened, examined or mapped.
  static Result<MappedFile> OpenReadWrite(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  ~MappedFile();

  std::span<uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }
  // msync(MS_SYNC) of the mapping, then fdatasync.
  Status Sync();

 private:
  void Reset();
  std::string path_;
  int fd_ = -1;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Unmapping a large mapping tears down one page table entry per page on one
// thread (about 25 ms a GiB here, and process exit does the same). This
// drops the pages of `mapped` (MADV_DONTNEED) first, in pieces across
// `pool` (null: on the calling thread): the mapping stays valid and the
// data stays in the page cache (dirty pages of a shared mapping stay
// dirty), later accesses fault back in. `mapped` must lie in a file mapping
// that was never written through a private copy: anonymous or
// copied-on-write pages would be lost. Worth it for clean pages (the
// publisher's inputs); for a mapping just written (the pull's), the
// parallel teardown measured 3% slower than munmap.
void DropMappedPages(std::span<const uint8_t> mapped, ThreadPool* pool);

// Maps the pages covering `bytes` for reading (MADV_POPULATE_READ, 4 MiB
// a call), instead of one fault per 16 pages as a pass reads them: about
// 0.04 s of kernel time a GiB of a hot file here against 0.06-0.09 s. For
// memory about to be read in full; advisory, errors (an older kernel, a
// mapping that cannot be populated) are ignored.
void PrefaultForRead(std::span<const uint8_t> bytes);

// When `changes` writes to `bytes` are dense enough to dirty nearly every
// page anyway (at least one per page on average), maps its pages writable
// in one call (MADV_POPULATE_WRITE) instead of taking a write fault per
// page. Sparser changes are left to fault in, so that pages they do not
// touch stay clean. Advisory: errors (an older kernel) are ignored.
void PrefaultForWrite(std::span<uint8_t> bytes, uint64_t changes);

}  // namespace deltasync::io
