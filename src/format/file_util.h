// File-system helpers for the format module: path joins, bounded reads and
// crash-safe (atomic) file replacement.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"

namespace deltasync::format_internal {

// `dir` + "/" + `name` (no separator doubled; `dir` empty gives `name`).
std::string JoinPath(std::string_view dir, std::string_view name);
// The directory part of `path`: "." when it has none, "/" for "/name".
std::string DirName(std::string_view path);
// The last component of `path` (trailing separators ignored).
std::string BaseName(std::string_view path);

// Opens the regular file at `path` read-only (close-on-exec) and sets
// *size to its size; the caller closes the descriptor. NotFound when it
// does not exist, InvalidArgument when it is not a regular file. Messages
// name the path.
Result<int> OpenRegularFile(const std::string& path, uint64_t* size);

// Reads the whole regular file at `path`. NotFound when it does not exist;
// Corruption when it is larger than `max_bytes` (so a hostile file cannot
// make us allocate without bound). Messages name the path.
Result<std::string> ReadFileLimited(const std::string& path, uint64_t max_bytes);

// The names, sorted bytewise, of the files a checkpoint directory without an
// index consists of: every entry of `dir` whose name ends in ".safetensors",
// does not start with '.' (our writers' temporaries are hidden) and is a
// regular file, a symbolic link counting as what it points to (a dangling one
// is skipped, as are directories and special files). IOError naming `dir`
// when it cannot be listed, or naming the entry when it cannot be examined.
Result<std::vector<std::string>> ListSafetensorsFiles(const std::string& dir);

// fsync on a directory, so that a rename or unlink inside it is durable.
Status SyncDirectory(const std::string& dir);

// Creates `dir` and its missing parents. OK when it already exists.
Status CreateDirectories(const std::string& dir);

// Removes `path` if it exists; OK when it did not.
Status RemoveFileIfExists(const std::string& path);

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

}  // namespace deltasync::format_internal
