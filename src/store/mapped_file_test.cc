// MappedFile and DropMappedPages: dropping a mapping's pages gives up its
// page table entries (resident set) but never the data, dirty or not.
// PrefaultForRead maps pages without changing them; CopyFiles copies
// exactly, or fails and leaves nothing behind.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "deltasync/thread_pool.h"
#include "store/store_internal.h"
#include "store/store_test_util.h"

namespace deltasync::store_internal {
namespace {

using store_test::ListDir;
using store_test::ReadFile;
using store_test::TempDir;
using store_test::WriteFile;

// Resident kilobytes of the mapping that starts at `start`
// (/proc/self/smaps), or -1 when it is not found.
long ResidentKb(const void* start) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t want = reinterpret_cast<uintptr_t>(start);
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > 8) {
      in = lo == want;
      continue;
    }
    if (in && line.rfind("Rss:", 0) == 0) return std::stol(line.substr(4));
  }
  return -1;
}

// `size` bytes that differ with `seed`.
std::string Pattern(size_t size, unsigned seed) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * seed + (i >> 10) + seed);
  return bytes;
}

// The whole file at `path` mapped read-only and private, as checkpoints are
// opened (MAP_FAILED on error).
void* MapReadOnly(const std::string& path, size_t size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return MAP_FAILED;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  return map;
}

TEST(DropMappedPages, KeepsWrittenDataAndGivesUpResidentPages) {
  TempDir dir;
  const std::string path = dir.Join("file");
  const size_t size = (size_t{130} << 20) + 100;  // three 64 MiB pieces, the last partial
  std::string expected = Pattern(size, 7);
  WriteFile(path, expected);
  ThreadPool pool(2);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    Result<MappedFile> map = MappedFile::OpenReadWrite(path);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    std::span<uint8_t> bytes = map->bytes();
    ASSERT_EQ(bytes.size(), size);
    // Dirty a byte of every page through the mapping, and read the rest.
    for (size_t i = 0; i < size; i += 4096) {
      expected[i + 5 < size ? i + 5 : i] ^= static_cast<char>(0x5a);
      bytes[i + 5 < size ? i + 5 : i] ^= 0x5a;
    }
    ASSERT_GT(ResidentKb(bytes.data()), 100000);
    DropMappedPages(bytes, p);
    EXPECT_LT(ResidentKb(bytes.data()), 1000) << "pages still mapped";
    // The writes are in the page cache, and the mapping still reads them.
    EXPECT_TRUE(ReadFile(path) == expected);
    EXPECT_EQ(std::memcmp(bytes.data(), expected.data(), size), 0);
  }
  // A read-only mapping of the file (as checkpoints are opened) too.
  void* ro = MapReadOnly(path, size);
  ASSERT_NE(ro, MAP_FAILED);
  const std::span<const uint8_t> view(static_cast<const uint8_t*>(ro), size);
  EXPECT_EQ(std::memcmp(view.data(), expected.data(), size), 0);
  ASSERT_GT(ResidentKb(ro), 100000);
  DropMappedPages(view.subspan(1), &pool);  // not page-aligned: whole pages covering it
  EXPECT_LT(ResidentKb(ro), 1000);
  EXPECT_EQ(std::memcmp(view.data(), expected.data(), size), 0);
  ::munmap(ro, size);
}

TEST(PrefaultForRead, MapsThePagesAndLeavesTheBytes) {
  TempDir dir;
  const std::string path = dir.Join("file");
  const size_t size = (size_t{9} << 20) + 123;  // three 4 MiB calls, the last partial
  const std::string expected = Pattern(size, 13);
  WriteFile(path, expected);
  void* map = MapReadOnly(path, size);
  ASSERT_NE(map, MAP_FAILED);
#ifdef MADV_POPULATE_READ
  if (::madvise(map, 4096, MADV_POPULATE_READ) != 0) {
    ::munmap(map, size);
    GTEST_SKIP() << "this kernel has no MADV_POPULATE_READ";
  }
#else
  ::munmap(map, size);
  GTEST_SKIP() << "built without MADV_POPULATE_READ";
#endif
  const std::span<const uint8_t> view(static_cast<const uint8_t*>(map), size);
  // The probe may have mapped the first folio, up to 2 MiB.
  ASSERT_LE(ResidentKb(map), 2048);
  PrefaultForRead(view.subspan(1));  // not page-aligned: whole pages covering it
  EXPECT_GE(ResidentKb(map), static_cast<long>(size >> 10)) << "pages not mapped";
  EXPECT_EQ(std::memcmp(view.data(), expected.data(), size), 0);
  PrefaultForRead({});  // nothing to do
  ::munmap(map, size);
}

TEST(CopyFiles, CopiesEachFileExactlyAndLeavesNoTempFiles) {
  TempDir tmp;
  const std::string& dir = tmp.path();
  std::filesystem::create_directories(dir + "/in");
  std::filesystem::create_directories(dir + "/out");
  const std::vector<size_t> sizes = {0, 1, size_t{1} << 20, (size_t{3} << 20) + 5};
  ThreadPool pool(2);
  for (bool durable : {false, true}) {
    SCOPED_TRACE(durable ? "durable" : "not durable");
    std::vector<CopyJob> jobs;
    std::vector<std::string> contents;
    std::vector<std::string> want_names;
    uint64_t total = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::string name("f");  // not "f" + ...: a false -Wrestrict in GCC 12
      name += std::to_string(k);
      contents.push_back(Pattern(sizes[k], static_cast<unsigned>(k + (durable ? 7 : 3))));
      WriteFile(dir + "/in/" + name, contents.back());
      // The second round copies over the first round's files.
      jobs.push_back({dir + "/in/" + name, dir + "/out/" + name});
      want_names.push_back(name);
      total += sizes[k];
    }
    Result<uint64_t> copied = CopyFiles(jobs, durable, &pool);
    ASSERT_TRUE(copied.ok()) << copied.status().ToString();
    EXPECT_EQ(*copied, total);
    EXPECT_EQ(ListDir(dir + "/out"), want_names);
    for (size_t k = 0; k < sizes.size(); ++k) {
      EXPECT_EQ(std::filesystem::file_size(jobs[k].destination), sizes[k]) << jobs[k].destination;
      EXPECT_TRUE(ReadFile(jobs[k].destination) == contents[k]) << jobs[k].destination;
    }
  }
}

TEST(CopyFiles, AMissingSourceFailsAndWritesNothing) {
  TempDir tmp;
  const std::string& dir = tmp.path();
  std::filesystem::create_directories(dir + "/in");
  std::filesystem::create_directories(dir + "/out");
  WriteFile(dir + "/in/a", Pattern(5000, 3));
  WriteFile(dir + "/out/keep", Pattern(10, 5));
  ThreadPool pool(2);
  Result<uint64_t> copied = CopyFiles(
      {{dir + "/in/a", dir + "/out/a"}, {dir + "/in/missing", dir + "/out/missing"}}, false, &pool);
  ASSERT_FALSE(copied.ok());
  EXPECT_NE(copied.status().message().find("missing"), std::string::npos)
      << copied.status().ToString();
  EXPECT_EQ(ListDir(dir + "/out"), std::vector<std::string>{"keep"})
      << "a copy or a temp file left";
  EXPECT_TRUE(ReadFile(dir + "/out/keep") == Pattern(10, 5));
}

// Pages of the file at `path` in the page cache (mincore), or -1.
long CachedPages(const std::string& path, size_t size) {
  void* map = MapReadOnly(path, size);
  if (map == MAP_FAILED) return -1;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size + page - 1) / page);
  const int rc = ::mincore(map, size, resident.data());
  ::munmap(map, size);
  if (rc != 0) return -1;
  return static_cast<long>(std::count_if(resident.begin(), resident.end(),
                                         [](unsigned char r) { return (r & 1) != 0; }));
}

TEST(DropFromPageCache, SyncsAndDropsEveryFileBelowTheDirectory) {
  TempDir tmp;
  const std::string& dir = tmp.path();
  struct statfs fs;
  ASSERT_EQ(::statfs(dir.c_str(), &fs), 0);
  if (static_cast<uint32_t>(fs.f_type) == 0x01021994u) {
    GTEST_SKIP() << dir << " is on tmpfs, whose pages are the files themselves";
  }
  std::filesystem::create_directories(dir + "/sub");
  const size_t size = (size_t{2} << 20) + 7;
  const std::string a = Pattern(size, 3), b = Pattern(size, 5);
  WriteFile(dir + "/a", a);  // written, not synced: dirty pages
  WriteFile(dir + "/sub/b", b);
  ASSERT_GT(CachedPages(dir + "/a", size), 0);
  ASSERT_GT(CachedPages(dir + "/sub/b", size), 0);
  ASSERT_TRUE(DropFromPageCache(dir).ok());
  EXPECT_EQ(CachedPages(dir + "/a", size), 0);
  EXPECT_EQ(CachedPages(dir + "/sub/b", size), 0) << "a file in a subdirectory stayed cached";
  EXPECT_TRUE(ReadFile(dir + "/a") == a);
  EXPECT_TRUE(ReadFile(dir + "/sub/b") == b);
  const Status missing = DropFromPageCache(dir + "/nonexistent");
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("nonexistent"), std::string::npos) << missing.ToString();
}

}  // namespace
}  // namespace deltasync::store_internal
