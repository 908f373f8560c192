#include "io/mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace deltasync::io {

Result<MappedFile> MappedFile::OpenReadWrite(const std::string& path) {
  MappedFile file;
  file.path_ = path;
  file.fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (file.fd_ < 0) return Status::FromErrno(errno, path + ": open for writing");
  struct stat st;
  if (::fstat(file.fd_, &st) != 0) return Status::FromErrno(errno, path + ": stat");
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ > 0) {
    void* map = ::mmap(nullptr, file.size_, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd_, 0);
    if (map == MAP_FAILED) return Status::FromErrno(errno, path + ": mmap read-write");
    file.data_ = static_cast<uint8_t*>(map);
  }
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Reset();
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    data_ = other.data_;
    size_ = other.size_;
    other.fd_ = -1;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

MappedFile::~MappedFile() { Reset(); }

void MappedFile::Reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
}

void DropMappedPages(std::span<const uint8_t> mapped, ThreadPool* pool) {
  if (mapped.empty()) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(mapped.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(mapped.data()) + mapped.size();
  constexpr uintptr_t kPiece = uintptr_t{64} << 20;  // a multiple of any page size
  const size_t pieces = static_cast<size_t>((end - begin + kPiece - 1) / kPiece);
  auto drop = [&](size_t i) {
    const uintptr_t at = begin + i * kPiece;
    (void)::madvise(reinterpret_cast<void*>(at), std::min(kPiece, end - at), MADV_DONTNEED);
  };
  if (pool == nullptr || pieces == 1) {
    for (size_t i = 0; i < pieces; ++i) drop(i);
  } else {
    pool->ParallelFor(pieces, drop);
  }
}

void PrefaultForRead(std::span<const uint8_t> bytes) {
#ifdef MADV_POPULATE_READ
  if (bytes.empty()) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  // In pieces: each call holds the address space's lock, and one call over
  // a large tensor (0.29 GB: 15 ms) stalled the other threads' allocations.
  constexpr uintptr_t kPiece = uintptr_t{4} << 20;  // a multiple of any page size
  for (uintptr_t at = begin; at < end; at += kPiece) {
    (void)::madvise(reinterpret_cast<void*>(at), std::min(kPiece, end - at), MADV_POPULATE_READ);
  }
#else
  (void)bytes;
#endif
}

Status MappedFile::Sync() {
  if (data_ != nullptr && ::msync(data_, size_, MS_SYNC) != 0) {
    return Status::FromErrno(errno, path_ + ": msync");
  }
  if (fd_ >= 0 && ::fdatasync(fd_) != 0) return Status::FromErrno(errno, path_ + ": fdatasync");
  return Status::OK();
}

void PrefaultForWrite(std::span<uint8_t> bytes, uint64_t changes) {
#ifdef MADV_POPULATE_WRITE
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (bytes.empty() || changes * page < bytes.size()) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(uintptr_t{page} - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
#else
  (void)bytes;
  (void)changes;
#endif
}

}  // namespace deltasync::io
