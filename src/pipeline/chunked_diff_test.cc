// The producer diffs and hashes each tensor in one chunked pass. These
// tests hold that pass to the whole-tensor references it replaces: one
// DiffTensor call for the ChangeSet and one-shot ChecksumHex for the
// digests.

#include "pipeline/chunked_diff.h"

#include "pipeline/pipeline_test_util.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/diff.h"

namespace deltasync::pipeline {
namespace {

constexpr ChecksumAlgo kAlgos[] = {ChecksumAlgo::kXxh3_64, ChecksumAlgo::kXxh3_128,
                                   ChecksumAlgo::kBlake3, ChecksumAlgo::kAdler32};

::testing::AssertionResult SameChangeSet(const ChangeSet& actual, const ChangeSet& expected) {
  if (actual.numel != expected.numel) {
    return ::testing::AssertionFailure() << "numel " << actual.numel << " vs " << expected.numel;
  }
  if (actual.elem_size != expected.elem_size) {
    return ::testing::AssertionFailure()
           << "elem_size " << actual.elem_size << " vs " << expected.elem_size;
  }
  if (actual.wide != expected.wide) {
    return ::testing::AssertionFailure() << "wide " << actual.wide << " vs " << expected.wide;
  }
  if (actual.pos32 != expected.pos32) {
    return ::testing::AssertionFailure() << "pos32 differ (" << actual.pos32.size() << " vs "
                                         << expected.pos32.size() << " entries)";
  }
  if (actual.pos64 != expected.pos64) {
    return ::testing::AssertionFailure() << "pos64 differ (" << actual.pos64.size() << " vs "
                                         << expected.pos64.size() << " entries)";
  }
  if (actual.new_values != expected.new_values) {
    return ::testing::AssertionFailure() << "new_values differ";
  }
  if (actual.old_values != expected.old_values) {
    return ::testing::AssertionFailure() << "old_values differ";
  }
  return ::testing::AssertionSuccess();
}

using pipeline_test::Mutate;
using pipeline_test::RandomBytes;

TEST(FusedDiff, ChunkedDiffEqualsOneWholeTensorDiff) {
  std::mt19937_64 rng(11);
  // Reused across every case, as the publisher reuses them across tensors.
  ChangeSet out, piece;
  int cases = 0;
  for (uint32_t es : {1u, 2u, 4u, 8u}) {
    for (size_t numel : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
      const std::vector<uint8_t> old_bytes = RandomBytes(numel * es, &rng);
      for (double density : {0.0, 0.01, 0.5, 1.0}) {
        const std::vector<uint8_t> new_bytes = Mutate(old_bytes, es, density, &rng);
        for (size_t chunk : {size_t{1}, size_t{es}, size_t{3 * es + 1}, size_t{64}, size_t{4096},
                             kFusedChunkBytes}) {
          for (bool refresh : {false, true}) {
            for (bool keep_old : {false, true}) {
              DiffOptions options;
              options.elem_size = es;
              options.refresh_snapshot = refresh;
              options.keep_old_values = keep_old;
              std::vector<uint8_t> expected_snapshot = old_bytes;
              ChangeSet expected;
              ASSERT_TRUE(DiffTensor(new_bytes, expected_snapshot, options, &expected).ok());
              std::vector<uint8_t> snapshot = old_bytes;
              const Status s = DiffAndHashInChunks(new_bytes, snapshot, options, chunk, nullptr,
                                                   nullptr, &piece, &out);
              ASSERT_TRUE(s.ok()) << s.ToString();
              ASSERT_TRUE(SameChangeSet(out, expected))
                  << "es " << es << " numel " << numel << " density " << density << " chunk "
                  << chunk << " refresh " << refresh << " keep_old " << keep_old;
              ASSERT_EQ(snapshot, expected_snapshot);
              ASSERT_EQ(snapshot, refresh ? new_bytes : old_bytes);
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 5 * 4 * 6 * 2 * 2);
}

TEST(FusedDiff, DigestsEqualOneShotChecksumsOfOldAndNewBytes) {
  std::mt19937_64 rng(12);
  for (ChecksumAlgo algo : kAlgos) {
    // Reset between tensors, as the publisher does.
    std::unique_ptr<Hasher> base_hasher = NewHasher(algo);
    std::unique_ptr<Hasher> new_hasher = NewHasher(algo);
    ChangeSet out, piece;
    for (uint32_t es : {1u, 2u, 8u}) {
      // Sizes below, at, and not a multiple of the chunk; one unchanged.
      for (size_t bytes :
           {size_t{0}, size_t{8}, kFusedChunkBytes, kFusedChunkBytes * 2 + 8 * 123}) {
        for (double density : {0.0, 0.02}) {
          const std::vector<uint8_t> old_bytes = RandomBytes(bytes, &rng);
          const std::vector<uint8_t> new_bytes = Mutate(old_bytes, es, density, &rng);
          DiffOptions options;
          options.elem_size = es;
          options.refresh_snapshot = true;  // the base digest must predate the refresh
          std::vector<uint8_t> snapshot = old_bytes;
          base_hasher->Reset();
          new_hasher->Reset();
          const Status s = DiffAndHashInChunks(new_bytes, snapshot, options, kFusedChunkBytes,
                                               base_hasher.get(), new_hasher.get(), &piece, &out);
          ASSERT_TRUE(s.ok()) << s.ToString();
          EXPECT_EQ(base_hasher->HexDigest(), ChecksumHex(algo, old_bytes))
              << ChecksumAlgoName(algo) << " es " << es << " bytes " << bytes;
          EXPECT_EQ(new_hasher->HexDigest(), ChecksumHex(algo, new_bytes))
              << ChecksumAlgoName(algo) << " es " << es << " bytes " << bytes;
          EXPECT_EQ(snapshot, new_bytes);
        }
      }
    }
  }
}

TEST(FusedDiff, BadOperandsAreRefusedBeforeAnyChunkIsTouched) {
  std::vector<uint8_t> buffer(4096, 0);
  std::vector<uint8_t> next(4096, 1);
  ChangeSet out, piece;
  DiffOptions options;
  options.elem_size = 2;
  auto expect_invalid = [&](std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                            const DiffOptions& o, const std::string& words) {
    const std::vector<uint8_t> before(snapshot.begin(), snapshot.end());
    const Status s =
        DiffAndHashInChunks(new_bytes, snapshot, o, 64, nullptr, nullptr, &piece, &out);
    EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.ToString();
    EXPECT_TRUE(std::equal(before.begin(), before.end(), snapshot.begin()));
  };
  expect_invalid(std::span(next).first(100), std::span(buffer).first(102), options,
                 "length mismatch");
  expect_invalid(std::span(next).first(101), std::span(buffer).first(101), options,
                 "not a multiple of element size");
  DiffOptions three = options;
  three.elem_size = 3;
  expect_invalid(std::span(next).first(99), std::span(buffer).first(99), three, "element size 3");
  // Chunks of the two spans would not overlap, but the spans do.
  expect_invalid(std::span(buffer).subspan(0, 2048), std::span(buffer).subspan(1024, 2048), options,
                 "partially overlap");
  const Status s =
      DiffAndHashInChunks(next, buffer, options, 64, nullptr, nullptr, &piece, nullptr);
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  // The same memory as both operands is allowed (nothing changed).
  ASSERT_TRUE(
      DiffAndHashInChunks(buffer, buffer, options, 64, nullptr, nullptr, &piece, &out).ok());
  EXPECT_EQ(out.count(), 0u);
  EXPECT_EQ(out.numel, 2048u);
}

// Address space that reads as zeros and costs memory only where written.
class SparseRegion {
 public:
  explicit SparseRegion(size_t size) : size_(size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
#ifdef MADV_HUGEPAGE
    // Reads then map the huge zero page: far fewer faults.
    if (data_ != nullptr) (void)::madvise(data_, size_, MADV_HUGEPAGE);
#endif
  }
  ~SparseRegion() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  SparseRegion(const SparseRegion&) = delete;
  SparseRegion& operator=(const SparseRegion&) = delete;
  uint8_t* data() const { return data_; }
  std::span<uint8_t> span() const { return {data_, size_}; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

TEST(FusedDiff, TensorsOfMoreThan2To32ElementsGetWidePositionsAcrossChunks) {
  // One-byte elements, so 2^32 + a few pages of elements fit in 4 GiB of
  // address space that is almost all the zero page.
  const size_t numel = (size_t{1} << 32) + 3 * 4096 + 5;
  SparseRegion old_region(numel), new_region(numel);
  if (old_region.data() == nullptr || new_region.data() == nullptr) {
    GTEST_SKIP() << "cannot reserve 2 x 4 GiB of address space";
  }
  for (uint64_t pos :
       {uint64_t{0}, uint64_t{524287}, uint64_t{524288}, uint64_t{UINT32_MAX} - 1,
        uint64_t{UINT32_MAX}, uint64_t{1} << 32, (uint64_t{1} << 32) + 7, uint64_t{numel} - 1}) {
    new_region.data()[pos] = static_cast<uint8_t>(pos % 251 + 1);
  }
  old_region.data()[(uint64_t{1} << 32) + 7] = 0x77;  // a changed element with a non-zero old value
  DiffOptions options;
  options.elem_size = 1;
  options.refresh_snapshot = false;
  options.keep_old_values = true;
  ChangeSet expected, out, piece;
  ASSERT_TRUE(DiffTensor(new_region.span(), old_region.span(), options, &expected).ok());
  ASSERT_TRUE(expected.wide);
  ASSERT_EQ(expected.count(), 8u);
  const Status s = DiffAndHashInChunks(new_region.span(), old_region.span(), options,
                                       kFusedChunkBytes, nullptr, nullptr, &piece, &out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(SameChangeSet(out, expected));
}

TEST(FusedDiff, RefreshInChunksWritesTheNewBytesAndCountsTheChanges) {
  std::mt19937_64 rng(13);
  ChangeSet piece;
  for (uint32_t es : {1u, 2u, 8u}) {
    const std::vector<uint8_t> old_bytes = RandomBytes(kFusedChunkBytes * 2 + es * 77, &rng);
    const std::vector<uint8_t> new_bytes = Mutate(old_bytes, es, 0.03, &rng);
    uint64_t expected = 0;
    for (size_t i = 0; i < old_bytes.size(); i += es) {
      expected +=
          !std::equal(old_bytes.begin() + i, old_bytes.begin() + i + es, new_bytes.begin() + i);
    }
    std::vector<uint8_t> snapshot = old_bytes;
    Result<uint64_t> changed = RefreshInChunks(new_bytes, snapshot, es, &piece);
    ASSERT_TRUE(changed.ok()) << changed.status().ToString();
    EXPECT_EQ(*changed, expected) << "es " << es;
    EXPECT_EQ(snapshot, new_bytes);
  }
  std::vector<uint8_t> a(10), b(12);
  const Result<uint64_t> refused = RefreshInChunks(a, b, 2, &piece);
  EXPECT_TRUE(refused.status().IsInvalidArgument()) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("length mismatch"), std::string::npos);
}

}  // namespace
}  // namespace deltasync::pipeline
