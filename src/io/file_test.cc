// CopyFiles copies exactly, or fails and leaves nothing behind;
// DropFromPageCache leaves no page of a directory's files cached.

#include "io/file.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "deltasync/thread_pool.h"
#include "io/io_test_util.h"

namespace deltasync::io {
namespace {

using io_test::ListDir;
using io_test::MapReadOnly;
using io_test::Pattern;
using io_test::ReadFile;
using io_test::TempDir;
using io_test::WriteFile;

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

TEST(CopyFiles, WrittenIsCalledOnceWithEveryTemporaryFullAndNoDestinationYet) {
  TempDir tmp;
  const std::string& dir = tmp.path();
  std::filesystem::create_directories(dir + "/in");
  std::filesystem::create_directories(dir + "/out");
  const std::string a = Pattern(3000, 3), b = Pattern((size_t{1} << 20) + 9, 5);
  WriteFile(dir + "/in/a", a);
  WriteFile(dir + "/in/b", b);
  ThreadPool pool(2);
  int calls = 0;
  std::vector<std::string> seen;
  std::vector<uint64_t> sizes;
  Result<uint64_t> copied = CopyFiles(
      {{dir + "/in/a", dir + "/out/a"}, {dir + "/in/b", dir + "/out/b"}}, false, &pool, [&] {
        ++calls;
        seen = ListDir(dir + "/out");
        for (const std::string& name : seen) {
          sizes.push_back(std::filesystem::file_size(dir + "/out/" + name));
        }
      });
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  EXPECT_EQ(calls, 1);
  ASSERT_EQ(seen.size(), 2u);
  for (const std::string& name : seen) {
    EXPECT_EQ(name[0], '.') << name << ": a destination existed before the renames";
    EXPECT_NE(name.find(".copy."), std::string::npos) << name;
  }
  std::sort(sizes.begin(), sizes.end());
  EXPECT_EQ(sizes, (std::vector<uint64_t>{a.size(), b.size()}));
  EXPECT_EQ(ListDir(dir + "/out"), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(ReadFile(dir + "/out/b") == b);

  // A copy that fails never reaches that step.
  calls = 0;
  copied = CopyFiles({{dir + "/in/missing", dir + "/out/c"}}, false, &pool, [&] { ++calls; });
  EXPECT_FALSE(copied.ok());
  EXPECT_EQ(calls, 0);
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
}  // namespace deltasync::io
