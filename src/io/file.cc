#include "io/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace deltasync::io {
namespace {

// Large enough that per-tensor appends of small tensors batch into few
// writes; larger appends bypass it.
constexpr size_t kWriteBufferBytes = 1 << 20;

Status WriteAll(int fd, const uint8_t* data, size_t size, const std::string& what) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, what + ": write");
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return Status::OK();
}

}  // namespace

std::string JoinPath(std::string_view dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  std::string out(dir);
  if (out.back() != '/') out.push_back('/');
  out.append(name);
  return out;
}

std::string DirName(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

std::string BaseName(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos || path.size() == 1) return std::string(path);
  return std::string(path.substr(slash + 1));
}

Result<int> OpenRegularFile(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::FromErrno(errno, path + ": open");
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::FromErrno(err, path + ": stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": not a regular file");
  }
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

Result<std::string> ReadFileLimited(const std::string& path, uint64_t max_bytes) {
  uint64_t size = 0;
  DS_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, &size));
  if (size > max_bytes) {
    ::close(fd);
    return Status::Corruption(path + ": " + std::to_string(size) + " bytes exceeds the " +
                              std::to_string(max_bytes) + "-byte limit for this file");
  }
  std::string contents(static_cast<size_t>(size), '\0');
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::read(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(err, path + ": read");
    }
    if (n == 0) break;  // shrank under us; return what is there
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  contents.resize(done);
  return contents;
}

Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, dir + ": open directory");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory; that is not a failure of ours.
  if (rc != 0 && err != EINVAL && err != ENOTSUP) {
    return Status::FromErrno(err, dir + ": fsync directory");
  }
  return Status::OK();
}

Status CreateDirectories(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError(dir + ": create directory: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::IOError(dir + ": exists and is not a directory");
  }
  return Status::OK();
}

Status RemoveFileIfExists(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, path + ": remove");
  }
  return Status::OK();
}

Result<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  const std::string dir = DirName(path);
  const std::string base = BaseName(path);
  if (base.empty() || base == "." || base == ".." || base == "/") {
    return Status::InvalidArgument("'" + path + "' does not name a file");
  }
  std::unique_ptr<AtomicFile> file(new AtomicFile());
  file->path_ = path;
  // A dot name keeps the temporary out of globs such as *.safetensors; the
  // pid and counter keep concurrent writers of one path apart.
  for (int attempt = 0; attempt < 100; ++attempt) {
    file->temp_path_ = JoinPath(dir, "." + base + ".tmp." + std::to_string(::getpid()) + "." +
                                         std::to_string(counter.fetch_add(1)));
    file->fd_ = ::open(file->temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (file->fd_ >= 0) break;
    if (errno != EEXIST) return Status::FromErrno(errno, path + ": create temporary file");
  }
  if (file->fd_ < 0) return Status::IOError(path + ": could not pick a temporary file name");
  file->buffer_.reserve(kWriteBufferBytes);
  return file;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

Status AtomicFile::Fail(Status status) {
  error_ = status;
  return status;
}

Status AtomicFile::Flush() {
  if (buffer_.empty()) return Status::OK();
  Status status = WriteAll(fd_, buffer_.data(), buffer_.size(), path_);
  buffer_.clear();
  return status;
}

Status AtomicFile::Write(std::span<const uint8_t> bytes) {
  if (committed_) return Status::FailedPrecondition(path_ + ": write after commit");
  if (!error_.ok()) return error_;
  if (buffer_.size() + bytes.size() <= kWriteBufferBytes) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return Status::OK();
  }
  if (Status s = Flush(); !s.ok()) return Fail(s);
  if (bytes.size() >= kWriteBufferBytes) {
    if (Status s = WriteAll(fd_, bytes.data(), bytes.size(), path_); !s.ok()) return Fail(s);
  } else {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  return Status::OK();
}

Status AtomicFile::Commit() {
  if (committed_) return Status::FailedPrecondition(path_ + ": already committed");
  if (!error_.ok()) return error_;
  if (Status s = Flush(); !s.ok()) return Fail(s);
  if (::fsync(fd_) != 0) return Fail(Status::FromErrno(errno, path_ + ": fsync"));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Fail(Status::FromErrno(errno, path_ + ": close"));
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return Fail(Status::FromErrno(errno, path_ + ": rename into place"));
  }
  committed_ = true;
  return SyncDirectory(DirName(path_));
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(path));
  DS_RETURN_IF_ERROR(file->Write(contents));
  return file->Commit();
}

Status WriteAllAt(int fd, const uint8_t* data, size_t size, uint64_t offset,
                  const std::string& what) {
  struct iovec one = {const_cast<uint8_t*>(data), size};
  return WriteAllAtV(fd, {&one, 1}, offset, what);
}

Status WriteAllAtV(int fd, std::span<struct iovec> iov, uint64_t offset, const std::string& what) {
  size_t first = 0;
  for (;;) {
    while (first < iov.size() && iov[first].iov_len == 0) ++first;
    if (first == iov.size()) return Status::OK();
    const int batch = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::pwritev(fd, iov.data() + first, batch, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, what + ": write");
    }
    offset += static_cast<uint64_t>(n);
    for (auto left = static_cast<size_t>(n); left > 0;) {
      const size_t step = std::min(left, iov[first].iov_len);
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + step;
      iov[first].iov_len -= step;
      left -= step;
      if (iov[first].iov_len == 0) ++first;
    }
  }
}

Status ReadAllAt(int fd, uint8_t* data, size_t size, uint64_t offset, const std::string& what) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, what + ": read");
    }
    if (n == 0) return Status::IOError(what + ": ends early, at byte " + std::to_string(offset));
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

Result<std::vector<std::string>> ListRegularFiles(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return Status::NotFound(dir + ": no such directory");
    return Status::FromErrno(errno, dir + ": open directory");
  }
  std::vector<std::string> names;
  while (struct dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name.empty() || name[0] == '.') continue;
    struct stat st;
    if (::stat(JoinPath(dir, name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      names.push_back(name);
    }
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return Status::IOError(path + ": remove: " + ec.message());
  return Status::OK();
}

Status RenameNoReplace(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) {
    return Status::OK();
  }
  if (errno == EEXIST)
    return Status::AlreadyExists(to + ": already exists; refusing to replace it");
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return Status::FromErrno(errno, "rename " + from + " -> " + to);
  }
  // The file system cannot refuse for us (NFS, some FUSE mounts): check, then
  // rename. rename still refuses a non-empty target directory, and a version
  // dir is never empty (it holds an index).
  if (PathExists(to)) return Status::AlreadyExists(to + ": already exists; refusing to replace it");
  if (::rename(from.c_str(), to.c_str()) != 0) {
    if (errno == EEXIST || errno == ENOTEMPTY) {
      return Status::AlreadyExists(to + ": already exists; refusing to replace it");
    }
    return Status::FromErrno(errno, "rename " + from + " -> " + to);
  }
  return Status::OK();
}

Result<std::string> ResolvedPath(const std::string& path) {
  std::error_code ec;
  std::filesystem::path absolute = std::filesystem::absolute(path, ec);
  if (ec) return Status::FromErrno(ec.value(), path + ": absolute path");
  std::filesystem::path resolved = std::filesystem::weakly_canonical(absolute, ec);
  if (ec) return Status::FromErrno(ec.value(), path + ": resolve path");
  return resolved.lexically_normal().string();
}

bool IsSameOrInside(const std::string& inner, const std::string& outer) {
  if (inner.empty() || outer.empty()) return false;
  Result<std::string> resolved_outer = ResolvedPath(outer);
  struct stat o {};
  if (!resolved_outer.ok() || ::stat(resolved_outer->c_str(), &o) != 0) return false;
  Result<std::string> resolved = ResolvedPath(inner);
  std::filesystem::path p = resolved.ok() ? std::filesystem::path(*resolved)
                                          : std::filesystem::absolute(inner).lexically_normal();
  while (true) {
    struct stat s {};
    if (::stat(p.c_str(), &s) == 0 && s.st_dev == o.st_dev && s.st_ino == o.st_ino) return true;
    if (!p.has_relative_path()) return false;  // the root: nothing above it
    p = p.parent_path();
  }
}

namespace {

// ".<name>.<kind>.<digits>.<digits>"
bool IsOurTemporaryName(std::string_view name, std::string_view kind) {
  if (name.size() < 2 || name[0] != '.') return false;
  auto digits_back = [&](std::string_view& s) {
    size_t n = 0;
    while (n < s.size() && s[s.size() - 1 - n] >= '0' && s[s.size() - 1 - n] <= '9') ++n;
    if (n == 0 || n == s.size() || s[s.size() - 1 - n] != '.') return false;
    s.remove_suffix(n + 1);
    return true;
  };
  std::string_view rest = name.substr(1);
  if (!digits_back(rest) || !digits_back(rest)) return false;
  return rest.size() > kind.size() + 1 && rest.ends_with(kind) &&
         rest[rest.size() - kind.size() - 1] == '.';
}

}  // namespace

Result<uint64_t> RemoveLeftoverTemporaries(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return uint64_t{0};
    return Status::FromErrno(errno, dir + ": open directory");
  }
  std::vector<std::string> leftovers;
  while (struct dirent* entry = ::readdir(d)) {
    const std::string_view name = entry->d_name;
    if (IsOurTemporaryName(name, "copy") || IsOurTemporaryName(name, "tmp")) {
      leftovers.emplace_back(name);
    }
  }
  ::closedir(d);
  for (const std::string& name : leftovers) {
    const std::string path = JoinPath(dir, name);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return Status::FromErrno(errno, path + ": remove leftover temporary file");
    }
  }
  return static_cast<uint64_t>(leftovers.size());
}

uint64_t DirectoryBytes(const std::string& dir) {
  uint64_t total = 0;
  Result<std::vector<std::string>> names = ListRegularFiles(dir);
  if (!names.ok()) return 0;
  for (const std::string& name : *names) {
    struct stat st;
    if (::stat(JoinPath(dir, name).c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_size);
  }
  return total;
}

Status DropFromPageCache(const std::string& dir) {
  std::error_code ec;
  std::filesystem::recursive_directory_iterator it(dir, ec), end;
  if (ec) return Status::IOError(dir + ": " + ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) return Status::IOError(dir + ": " + ec.message());
    if (!it->is_regular_file(ec)) continue;
    const std::string path = it->path().string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Status::FromErrno(errno, path + ": open");
    // Only clean pages can be dropped: a writer that did not sync leaves
    // dirty ones.
    if (::fdatasync(fd) != 0) {
      Status s = Status::FromErrno(errno, path + ": fdatasync");
      ::close(fd);
      return s;
    }
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // advisory
    ::close(fd);
  }
  if (ec) return Status::IOError(dir + ": " + ec.message());
  return Status::OK();
}

Result<FileLock> FileLock::Acquire(const std::string& path) {
  FileLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock.fd_ < 0) return Status::FromErrno(errno, path + ": open lock file");
  while (::flock(lock.fd_, LOCK_EX) != 0) {
    if (errno != EINTR) return Status::FromErrno(errno, path + ": flock");
  }
  return lock;
}

Result<FileLock> FileLock::AcquireSharedIfExists(const std::string& path) {
  FileLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (lock.fd_ < 0) {
    if (errno == ENOENT) return lock;
    return Status::FromErrno(errno, path + ": open lock file");
  }
  while (::flock(lock.fd_, LOCK_SH) != 0) {
    if (errno != EINTR) return Status::FromErrno(errno, path + ": flock");
  }
  return lock;
}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the flock
}

}  // namespace deltasync::io
