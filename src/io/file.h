// Generic file-system helpers: paths, bounded reads, positioned writes,
// directories, crash-safe (atomic) file replacement, copies and locks.
// Nothing here knows a file format; errors name the path and the
// operation that failed.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/io.h"
#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync::io {

// ---------------------------------------------------------------------------
// Paths

// `dir` + "/" + `name` (no separator doubled; `dir` empty gives `name`).
std::string JoinPath(std::string_view dir, std::string_view name);
// The directory part of `path`: "." when it has none, "/" for "/name".
std::string DirName(std::string_view path);
// The last component of `path` (trailing separators ignored).
std::string BaseName(std::string_view path);

// The absolute, symlink-resolved form of `path` (its missing tail kept as
// written), for recording a path that must keep naming the same place.
Result<std::string> ResolvedPath(const std::string& path);

// True when `inner` is `outer` or lies below it. Compares the device and
// inode of `outer` with those of `inner` and each of its existing
// ancestors, so relative spellings, symlinks and bind mounts are seen
// through; `inner` need not exist yet. False when `outer` does not exist.
bool IsSameOrInside(const std::string& inner, const std::string& outer);

// ---------------------------------------------------------------------------
// Reading and writing

// Opens the regular file at `path` read-only (close-on-exec) and sets
// *size to its size; the caller closes the descriptor. NotFound when it
// does not exist, InvalidArgument when it is not a regular file. Messages
// name the path.
Result<int> OpenRegularFile(const std::string& path, uint64_t* size);

// Reads the whole regular file at `path`. NotFound when it does not exist;
// Corruption when it is larger than `max_bytes` (so a hostile file cannot
// make us allocate without bound). Messages name the path.
Result<std::string> ReadFileLimited(const std::string& path, uint64_t max_bytes);

// pwrite/pread of exactly `size` bytes at `offset` (retrying short counts
// and EINTR); errors name `what`. A read past the end is IOError.
Status WriteAllAt(int fd, const uint8_t* data, size_t size, uint64_t offset,
                  const std::string& what);
Status ReadAllAt(int fd, uint8_t* data, size_t size, uint64_t offset, const std::string& what);
// pwritev of every byte `iov` lists, at `offset` on (retrying short counts
// and EINTR; `iov` entries are advanced past what was written).
Status WriteAllAtV(int fd, std::span<struct iovec> iov, uint64_t offset, const std::string& what);

// A file that appears under its final name only on Commit: bytes go to a
// temporary file in the same directory (so the rename cannot cross file
// systems), which Commit flushes, fsyncs, renames over `path` and makes
// durable by syncing the directory. Readers therefore see either the old file
// or the complete new one, never a prefix. Destroying an uncommitted file
// removes the temporary.
class AtomicFile {
 public:
  static Result<std::unique_ptr<AtomicFile>> Create(const std::string& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Buffered; small appends cost no system call. After an error every later
  // call fails with the same status.
  Status Write(std::span<const uint8_t> bytes);
  Status Write(std::string_view text) {
    return Write(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  }
  // Publishes the file. Calling anything after Commit is FailedPrecondition.
  Status Commit();

  const std::string& path() const { return path_; }

 private:
  AtomicFile() = default;
  Status Flush();
  Status Fail(Status status);

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  bool committed_ = false;
  Status error_;
  std::vector<uint8_t> buffer_;
};

// Replaces `path` with `contents` through an AtomicFile.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// ---------------------------------------------------------------------------
// Directories and their entries

// True when `path` exists (any type, symlinks not followed).
bool PathExists(const std::string& path);
bool IsDirectory(const std::string& path);
// Regular files directly inside `dir` (names only, sorted). Hidden names
// (leading '.') are skipped. NotFound when `dir` does not exist.
Result<std::vector<std::string>> ListRegularFiles(const std::string& dir);
// Sum of the sizes of the regular files in `dir` (not recursive); 0 when
// it cannot be listed.
uint64_t DirectoryBytes(const std::string& dir);

// Creates `dir` and its missing parents. OK when it already exists.
Status CreateDirectories(const std::string& dir);
// fsync on a directory, so that a rename or unlink inside it is durable.
Status SyncDirectory(const std::string& dir);
// Removes `path` if it exists; OK when it did not.
Status RemoveFileIfExists(const std::string& path);
// Removes `path` and everything below it; OK when it does not exist.
Status RemoveTree(const std::string& path);
// rename(2) that refuses to replace an existing `to` (AlreadyExists), also
// for directories, where plain rename would replace an empty one.
Status RenameNoReplace(const std::string& from, const std::string& to);

// Removes what an interrupted writer of ours leaves in `dir` (not
// recursive): CopyFiles' `.<name>.copy.<pid>.<n>` and AtomicFile's
// `.<name>.tmp.<pid>.<n>` temporaries. Only for a directory whose writers
// are all serialized by a lock the caller holds. Returns how many it removed.
Result<uint64_t> RemoveLeftoverTemporaries(const std::string& dir);

// ---------------------------------------------------------------------------
// Copies

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
// destination directory after. `written`, when set, is called once every
// temporary holds its data and before the first rename (the step a caller
// that simulates interruptions stops at). Returns the bytes copied. On
// error no temporary is left; destinations renamed before it stay.
Result<uint64_t> CopyFiles(const std::vector<CopyJob>& jobs, bool durable, ThreadPool* pool,
                           const std::function<void()>& written = nullptr);

// ---------------------------------------------------------------------------
// Locks

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

}  // namespace deltasync::io
