#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <system_error>

#include "format/file_util.h"
#include "store/store_internal.h"

extern char** environ;

namespace deltasync::store_internal {
namespace {

using format_internal::DirName;
using format_internal::JoinPath;

std::atomic<CrashHook> g_crash_hook{nullptr};

std::mutex g_boot_mu;
std::optional<std::string> g_boot_override;

// Ranges a single large file is cut into for a parallel copy.
constexpr uint64_t kCopyRangeBytes = uint64_t{256} << 20;

// Bytes read and written at a time by a copy through user space.
constexpr size_t kCopyBufferBytes = size_t{1} << 20;

// Whether copy_file_range can hand a copy into the file open as `fd` to
// the server: NFS and SMB do the copy there. On a local filesystem that
// cannot clone (ext4), copy_file_range copies through the page cache a page
// at a time and leaves the copy cached in 4 KiB pieces; 1 MiB writes leave
// it in large folios instead, which are mapped, written and unmapped several
// times faster (a 1 GiB checkpoint here: mapping and tearing down 0.042 s
// against 0.016 s). Every later pull into the copy gains that.
bool OffloadsCopies(int fd) {
  constexpr uint32_t kNfs = 0x6969, kSmb2 = 0xFE534D42, kCifs = 0xFF534D42;
  struct statfs fs;
  if (::fstatfs(fd, &fs) != 0) return false;
  // The magic numbers are 32 bits; f_type is as wide as a long.
  const auto type = static_cast<uint32_t>(fs.f_type);
  return type == kNfs || type == kSmb2 || type == kCifs;
}

// Copies [offset, offset + length) of `in` to the same offsets of `out`,
// with copy_file_range where `offload`, else (or where it is not offered)
// by reading and writing.
Status CopyRange(int in, int out, uint64_t offset, uint64_t length, bool offload,
                 const std::string& what) {
  loff_t in_off = static_cast<loff_t>(offset);
  loff_t out_off = static_cast<loff_t>(offset);
  uint64_t left = length;
  while (offload && left > 0) {
    const ssize_t n = ::copy_file_range(in, &in_off, out, &out_off, left, 0);
    if (n > 0) {
      left -= static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP ||
        errno == EPERM || errno == ETXTBSY) {
      break;  // not offered here: fall back to read and write
    }
    return Status::FromErrno(errno, what + ": copy_file_range");
  }
  if (left == 0) return Status::OK();
  std::vector<uint8_t> buffer(std::min<uint64_t>(left, kCopyBufferBytes));
  uint64_t pos = static_cast<uint64_t>(in_off);
  while (left > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
    DS_RETURN_IF_ERROR(ReadAllAt(in, buffer.data(), n, pos, what));
    DS_RETURN_IF_ERROR(WriteAllAt(out, buffer.data(), n, pos, what));
    pos += n;
    left -= n;
  }
  return Status::OK();
}

}  // namespace

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

void SetCrashHookForTesting(CrashHook hook) { g_crash_hook.store(hook); }

void CrashPoint(std::string_view point) {
  if (CrashHook hook = g_crash_hook.load(std::memory_order_relaxed)) hook(point);
}

void SetBootIdForTesting(std::optional<std::string> boot_id) {
  std::lock_guard<std::mutex> lock(g_boot_mu);
  g_boot_override = std::move(boot_id);
}

std::string CurrentBootId() {
  {
    std::lock_guard<std::mutex> lock(g_boot_mu);
    if (g_boot_override) return *g_boot_override;
  }
  // A /proc file reports size 0: read until EOF rather than by its size.
  const int fd = ::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buf[128];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n <= 0) return "";
  std::string id(buf, static_cast<size_t>(n));
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

Status RunHook(const std::string& executable, const std::vector<std::string>& args,
               std::string_view what) {
  std::vector<std::string> argv_storage;
  argv_storage.push_back(executable);
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const bool has_slash = executable.find('/') != std::string::npos;
  const int rc =
      has_slash ? ::posix_spawn(&pid, executable.c_str(), nullptr, nullptr, argv.data(), environ)
                : ::posix_spawnp(&pid, executable.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    return Status::FromErrno(rc, std::string(what) + " '" + executable + "': cannot run");
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) {
      return Status::FromErrno(errno, std::string(what) + " '" + executable + "': wait");
    }
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::OK();
  std::string how =
      WIFEXITED(wstatus)     ? "exited with status " + std::to_string(WEXITSTATUS(wstatus))
      : WIFSIGNALED(wstatus) ? "was killed by signal " + std::to_string(WTERMSIG(wstatus))
                             : "failed";
  // posix_spawn reports a missing executable as exit status 127 of the child.
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 127) how += " (not found or not executable?)";
  return Status::Aborted(std::string(what) + " '" + executable + "' " + how);
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

Result<uint64_t> CopyFiles(const std::vector<CopyJob>& jobs, bool durable, ThreadPool* pool) {
  static std::atomic<uint64_t> counter{0};
  struct Open {
    int in = -1;
    int out = -1;
    uint64_t size = 0;
    std::string temp;
    bool cloned = false;
    bool offload = false;
  };
  std::vector<Open> files(jobs.size());
  auto cleanup = [&files]() {
    for (Open& f : files) {
      if (f.in >= 0) ::close(f.in);
      if (f.out >= 0) ::close(f.out);
      if (!f.temp.empty()) ::unlink(f.temp.c_str());
      f = Open();
    }
  };
  struct Range {
    size_t file;
    uint64_t offset;
    uint64_t length;
  };
  std::vector<Range> ranges;
  uint64_t total = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    Open& f = files[i];
    f.in = ::open(jobs[i].source.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.in < 0) {
      Status s = Status::FromErrno(errno, jobs[i].source + ": open");
      cleanup();
      return s;
    }
    struct stat st;
    if (::fstat(f.in, &st) != 0) {
      Status s = Status::FromErrno(errno, jobs[i].source + ": stat");
      cleanup();
      return s;
    }
    f.size = static_cast<uint64_t>(st.st_size);
    total += f.size;
    const std::string dir = DirName(jobs[i].destination);
    std::string temp_name(".");
    temp_name.append(format_internal::BaseName(jobs[i].destination));
    temp_name.append(".copy.");
    temp_name.append(std::to_string(::getpid()));
    temp_name.append(".");
    temp_name.append(std::to_string(counter.fetch_add(1)));
    f.temp = JoinPath(dir, temp_name);
    f.out = ::open(f.temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f.out < 0) {
      Status s = Status::FromErrno(errno, f.temp + ": create");
      f.temp.clear();
      cleanup();
      return s;
    }
    if (::ioctl(f.out, FICLONE, f.in) == 0) {
      f.cloned = true;
      continue;
    }
    f.offload = OffloadsCopies(f.out);
    if (::ftruncate(f.out, static_cast<off_t>(f.size)) != 0) {
      Status s = Status::FromErrno(errno, f.temp + ": set size");
      cleanup();
      return s;
    }
    for (uint64_t off = 0; off < f.size; off += kCopyRangeBytes) {
      ranges.push_back({i, off, std::min(kCopyRangeBytes, f.size - off)});
    }
  }
  std::mutex mu;
  Status first_error;
  auto note = [&](Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (first_error.ok()) first_error = std::move(s);
  };
  pool->ParallelFor(ranges.size(), [&](size_t r) {
    const Range& range = ranges[r];
    const Open& f = files[range.file];
    Status s =
        CopyRange(f.in, f.out, range.offset, range.length, f.offload, jobs[range.file].source);
    if (!s.ok()) note(std::move(s));
  });
  if (durable && first_error.ok()) {
    pool->ParallelFor(files.size(), [&](size_t i) {
      if (::fsync(files[i].out) != 0) note(Status::FromErrno(errno, files[i].temp + ": fsync"));
    });
  }
  if (!first_error.ok()) {
    cleanup();
    return first_error;
  }
  CrashPoint("copy:written");  // the temporaries hold the data, none is renamed yet
  std::vector<std::string> dirs;
  for (size_t i = 0; i < files.size(); ++i) {
    Open& f = files[i];
    ::close(f.in);
    f.in = -1;
    if (::close(f.out) != 0) {
      f.out = -1;
      Status s = Status::FromErrno(errno, f.temp + ": close");
      cleanup();
      return s;
    }
    f.out = -1;
    if (::rename(f.temp.c_str(), jobs[i].destination.c_str()) != 0) {
      Status s = Status::FromErrno(errno, jobs[i].destination + ": rename into place");
      cleanup();
      return s;
    }
    f.temp.clear();
    dirs.push_back(DirName(jobs[i].destination));
  }
  if (durable) {
    std::sort(dirs.begin(), dirs.end());
    dirs.erase(std::unique(dirs.begin(), dirs.end()), dirs.end());
    for (const std::string& dir : dirs) DS_RETURN_IF_ERROR(format_internal::SyncDirectory(dir));
  }
  return total;
}

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

}  // namespace deltasync::store_internal
