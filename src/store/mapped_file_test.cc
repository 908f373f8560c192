// MappedFile and DropMappedPages: dropping a mapping's pages gives up its
// page table entries (resident set) but never the data, dirty or not.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "deltasync/thread_pool.h"
#include "store/store_internal.h"

namespace deltasync::store_internal {
namespace {

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

std::vector<uint8_t> ReadBack(const std::string& path, size_t size) {
  std::vector<uint8_t> bytes(size);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, bytes.data(), size, 0), static_cast<ssize_t>(size));
  ::close(fd);
  return bytes;
}

TEST(DropMappedPages, KeepsWrittenDataAndGivesUpResidentPages) {
  const std::string dir = ::testing::TempDir() + "/drop_pages_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/file";
  const size_t size = (size_t{130} << 20) + 100;  // three 64 MiB pieces, the last partial
  std::vector<uint8_t> expected(size);
  for (size_t i = 0; i < size; ++i) expected[i] = static_cast<uint8_t>(i * 7 + (i >> 12));
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(expected.data()), static_cast<std::streamsize>(size));
  }
  ThreadPool pool(2);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    Result<MappedFile> map = MappedFile::OpenReadWrite(path);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    std::span<uint8_t> bytes = map->bytes();
    ASSERT_EQ(bytes.size(), size);
    // Dirty a byte of every page through the mapping, and read the rest.
    for (size_t i = 0; i < size; i += 4096) {
      expected[i + 5 < size ? i + 5 : i] ^= 0x5a;
      bytes[i + 5 < size ? i + 5 : i] ^= 0x5a;
    }
    ASSERT_GT(ResidentKb(bytes.data()), 100000);
    DropMappedPages(bytes, p);
    EXPECT_LT(ResidentKb(bytes.data()), 1000) << "pages still mapped";
    // The writes are in the page cache, and the mapping still reads them.
    EXPECT_TRUE(ReadBack(path, size) == expected);
    EXPECT_EQ(std::memcmp(bytes.data(), expected.data(), size), 0);
  }
  // A read-only mapping of the file (as checkpoints are opened) too.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* ro = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  ASSERT_NE(ro, MAP_FAILED);
  const std::span<const uint8_t> view(static_cast<const uint8_t*>(ro), size);
  EXPECT_EQ(std::memcmp(view.data(), expected.data(), size), 0);
  ASSERT_GT(ResidentKb(ro), 100000);
  DropMappedPages(view.subspan(1), &pool);  // not page-aligned: whole pages covering it
  EXPECT_LT(ResidentKb(ro), 1000);
  EXPECT_EQ(std::memcmp(view.data(), expected.data(), size), 0);
  ::munmap(ro, size);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace deltasync::store_internal
