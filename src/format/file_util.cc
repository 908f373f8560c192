#include "format/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace deltasync::format_internal {
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

Result<std::vector<std::string>> ListSafetensorsFiles(const std::string& dir) {
  static constexpr std::string_view kSuffix = ".safetensors";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return Status::FromErrno(errno, dir + ": open directory");
  std::vector<std::string> names;
  Status status;
  while (true) {
    errno = 0;
    const struct dirent* entry = ::readdir(d);
    if (entry == nullptr) {
      if (errno != 0) status = Status::FromErrno(errno, dir + ": read directory");
      break;
    }
    const std::string_view name = entry->d_name;
    if (name.empty() || name[0] == '.' || !name.ends_with(kSuffix)) continue;
    const std::string path = JoinPath(dir, name);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      // ENOENT: a dangling link, or an entry removed since it was listed.
      if (errno == ENOENT) continue;
      status = Status::FromErrno(errno, path + ": stat");
      break;
    }
    if (S_ISREG(st.st_mode)) names.emplace_back(name);
  }
  ::closedir(d);
  if (!status.ok()) return status;
  std::sort(names.begin(), names.end());
  return names;
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

}  // namespace deltasync::format_internal
