// MappedFile and DropMappedPages: dropping a mapping's pages gives up its
// page table entries (resident set) but never the data, dirty or not.
// PrefaultForRead maps pages without changing them.

#include "io/mapping.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "deltasync/thread_pool.h"
#include "io/io_test_util.h"

namespace deltasync::io {
namespace {

using io_test::MapReadOnly;
using io_test::Pattern;
using io_test::ReadFile;
using io_test::TempDir;
using io_test::WriteFile;

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

}  // namespace
}  // namespace deltasync::io
