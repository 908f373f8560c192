// Internals shared by the store module's sources and tests: file-system
// helpers the disk transport needs beyond the format module's, external
// hooks, and test-only fault injection.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync::store_internal {

// ---------------------------------------------------------------------------
// Fault injection (tests only). Production code calls CrashPoint at every
// step whose interruption must be survivable; a test installs a hook that
// ends the process there (_exit) to simulate kill -9 at that instant.

using CrashHook = void (*)(std::string_view point);
// nullptr removes the hook.
void SetCrashHookForTesting(CrashHook hook);
// Calls the hook, if any. Thread-safe; may be called from pool tasks.
void CrashPoint(std::string_view point);

// Overrides the boot id that CurrentBootId reports (nullopt: the real one),
// so tests can simulate a reboot.
void SetBootIdForTesting(std::optional<std::string> boot_id);
// /proc/sys/kernel/random/boot_id without its newline; "" when unreadable.
std::string CurrentBootId();

// ---------------------------------------------------------------------------
// Processes

// Runs `executable` with `args` (no shell), stdio inherited, and waits.
// Aborted naming `what`, the executable and the exit status when it exits
// non-zero or dies of a signal; IOError when it cannot be started.
Status RunHook(const std::string& executable, const std::vector<std::string>& args,
               std::string_view what);

// ---------------------------------------------------------------------------
// Files

// True when `path` exists (any type, symlinks not followed).
bool PathExists(const std::string& path);
bool IsDirectory(const std::string& path);
// Regular files directly inside `dir` (names only, sorted). Hidden names
// (leading '.') are skipped.
Result<std::vector<std::string>> ListRegularFiles(const std::string& dir);
// Removes `path` and everything below it; OK when it does not exist.
Status RemoveTree(const std::string& path);
// rename(2) that refuses to replace an existing `to` (AlreadyExists), also
// for directories, where plain rename would replace an empty one.
Status RenameNoReplace(const std::string& from, const std::string& to);
// Sum of the sizes of the regular files in `dir` (not recursive).
uint64_t DirectoryBytes(const std::string& dir);
// Syncs every regular file under `dir` (recursively) and asks the kernel to
// drop its cached pages (POSIX_FADV_DONTNEED), as if another host had
// written them. IOError naming the file when one cannot be opened or synced.
Status DropFromPageCache(const std::string& dir);

// The absolute, symlink-resolved form of `path` (its missing tail kept as
// written), for recording a path that must keep naming the same place.
Result<std::string> ResolvedPath(const std::string& path);

// True when `inner` is `outer` or lies below it. Compares the device and
// inode of `outer` with those of `inner` and each of its existing
// ancestors, so relative spellings, symlinks and bind mounts are seen
// through; `inner` need not exist yet. False when `outer` does not exist.
bool IsSameOrInside(const std::string& inner, const std::string& outer);

// Removes what an interrupted writer of ours leaves in `dir` (not
// recursive): CopyFiles' `.<name>.copy.<pid>.<n>` and AtomicFile's
// `.<name>.tmp.<pid>.<n>` temporaries. Only for a directory whose writers
// are all serialized by a lock the caller holds. Returns how many it removed.
Result<uint64_t> RemoveLeftoverTemporaries(const std::string& dir);

// One file to copy by CopyFiles.
struct CopyJob {
  std::string source;
  std::string destination;
};
// Copies each source to its destination atomically (a temp file beside the
// destination, renamed over it at the end): a FICLONE reflink where the file
// system offers one, else in parallel ranges, with copy_file_range where it
// hands the copy to a server (NFS, SMB) and 1 MiB reads and writes
// elsewhere. With `durable` each file is fsynced before its rename and each
// destination directory after. Returns the bytes copied.
Result<uint64_t> CopyFiles(const std::vector<CopyJob>& jobs, bool durable, ThreadPool* pool);

// A read-write shared mapping of a whole file.
// Unmapping a large mapping tears down one page table entry per page on one
// thread (about 25 ms a GiB here, and process exit does the same). This
// drops the pages of `mapped` (MADV_DONTNEED) first, in pieces across
// `pool`: the mapping stays valid and the data stays in the page cache
// (dirty pages of a shared mapping stay dirty), later accesses fault back
// in. `mapped` must lie in a file mapping that was never written through a
// private copy: anonymous or copied-on-write pages would be lost. Worth it
// for clean pages (the publisher's inputs); for a mapping just written
// (the pull's), the parallel teardown measured 3% slower than munmap.
void DropMappedPages(std::span<const uint8_t> mapped, ThreadPool* pool);

// Maps the pages covering `bytes` for reading (MADV_POPULATE_READ, 4 MiB
// a call), instead of one fault per 16 pages as a pass reads them: about
// 0.04 s of kernel time a GiB of a hot file here against 0.06-0.09 s. For
// memory about to be read in full; advisory, errors (an older kernel, a
// mapping that cannot be populated) are ignored.
void PrefaultForRead(std::span<const uint8_t> bytes);

class MappedFile {
 public:
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

// An flock held for the object's lifetime.
class FileLock {
 public:
  // Exclusive; creates the lock file if needed.
  static Result<FileLock> Acquire(const std::string& path);
  // Shared, for readers that must not write: opens the lock file read-only
  // and never creates it. A missing lock file is no lock at all (an
  // unlocked FileLock): no process has ever written next to it.
  static Result<FileLock> AcquireSharedIfExists(const std::string& path);
  FileLock() = default;
  FileLock(FileLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileLock& operator=(FileLock&& other) noexcept;
  ~FileLock();

 private:
  int fd_ = -1;
};

// pwrite/pread of exactly `size` bytes at `offset` (retrying short counts
// and EINTR); errors name `what`. A read past the end is IOError.
Status WriteAllAt(int fd, const uint8_t* data, size_t size, uint64_t offset,
                  const std::string& what);
Status ReadAllAt(int fd, uint8_t* data, size_t size, uint64_t offset, const std::string& what);
// pwritev of every byte `iov` lists, at `offset` on (retrying short counts
// and EINTR; `iov` entries are advanced past what was written).
Status WriteAllAtV(int fd, std::span<struct iovec> iov, uint64_t offset, const std::string& what);

// A mutex-guarded free list of per-task scratch objects, reused across the
// tasks of a parallel loop: vectors sized for large tensors are an mmap, a
// page-fault storm and an munmap each when made fresh. As many exist as
// tasks ever ran at once.
template <typename T>
class FreeList {
 public:
  std::unique_ptr<T> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<T>();
    std::unique_ptr<T> item = std::move(free_.back());
    free_.pop_back();
    return item;
  }
  void Give(std::unique_ptr<T> item) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(item));
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<T>> free_;
};

// Keeps the first error that any of several parallel tasks reports.
class FirstError {
 public:
  void Note(Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = std::move(s);
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return !status_.ok();
  }
  Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  Status status_;
};

}  // namespace deltasync::store_internal
