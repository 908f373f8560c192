// CopyFiles: atomic, parallel file copies (reflink, copy_file_range or
// plain reads and writes, whichever the file system does best).

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <vector>

#include "io/file.h"

namespace deltasync::io {
namespace {

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

Result<uint64_t> CopyFiles(const std::vector<CopyJob>& jobs, bool durable, ThreadPool* pool,
                           const std::function<void()>& written) {
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
    temp_name.append(BaseName(jobs[i].destination));
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
  if (written) written();  // the temporaries hold the data, none is renamed yet
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
    for (const std::string& dir : dirs) DS_RETURN_IF_ERROR(SyncDirectory(dir));
  }
  return total;
}

}  // namespace deltasync::io
