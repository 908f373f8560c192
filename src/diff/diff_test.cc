#include "deltasync/diff.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "diff/diff_internal.h"

namespace deltasync {

// Readable kernel names in gtest messages (found by argument-dependent lookup).
void PrintTo(DiffKernel kernel, std::ostream* os) { *os << DiffKernelName(kernel); }

namespace {

constexpr uint32_t kElemSizes[] = {1, 2, 4, 8};
constexpr uint8_t kGuardByte = 0xA5;
constexpr size_t kGuardBytes = 64;

// The oracle: what any kernel must report, computed the obvious way.
struct ExpectedChanges {
  std::vector<uint64_t> positions;
  std::vector<uint8_t> new_values;
  std::vector<uint8_t> old_values;
};

ExpectedChanges NaiveDiff(std::span<const uint8_t> new_bytes, std::span<const uint8_t> old_bytes,
                          uint32_t elem_size) {
  ExpectedChanges expected;
  for (size_t i = 0; i * elem_size < new_bytes.size(); ++i) {
    const uint8_t* n = new_bytes.data() + i * elem_size;
    const uint8_t* o = old_bytes.data() + i * elem_size;
    if (std::memcmp(n, o, elem_size) != 0) {
      expected.positions.push_back(i);
      expected.new_values.insert(expected.new_values.end(), n, n + elem_size);
      expected.old_values.insert(expected.old_values.end(), o, o + elem_size);
    }
  }
  return expected;
}

std::vector<uint64_t> Positions(const ChangeSet& changes) {
  std::vector<uint64_t> positions;
  for (uint64_t i = 0; i < changes.count(); ++i) positions.push_back(changes.position(i));
  return positions;
}

// Element-exact comparison that reports the first mismatch rather than
// printing two huge vectors.
template <typename T>
::testing::AssertionResult SameContents(const std::vector<T>& actual,
                                        const std::vector<T>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size " << actual.size() << ", expected " << expected.size();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] != expected[i]) {
      return ::testing::AssertionFailure() << "index " << i << ": " << uint64_t{actual[i]}
                                           << ", expected " << uint64_t{expected[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

// Random old bytes, and new bytes with about `density` of the elements
// changed. Half the changes touch a single byte of the element, so a kernel
// that looks at only part of an element misses them.
struct TensorPair {
  std::vector<uint8_t> old_bytes;
  std::vector<uint8_t> new_bytes;
};

TensorPair MakePair(size_t numel, uint32_t elem_size, double density, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TensorPair pair;
  pair.old_bytes.resize(numel * elem_size);
  for (uint8_t& b : pair.old_bytes) b = static_cast<uint8_t>(rng());
  pair.new_bytes = pair.old_bytes;
  std::bernoulli_distribution changed(density);
  for (size_t i = 0; i < numel; ++i) {
    if (!changed(rng)) continue;
    uint8_t* elem = pair.new_bytes.data() + i * elem_size;
    if (rng() & 1) {
      elem[rng() % elem_size] ^= static_cast<uint8_t>(1 + rng() % 255);
    } else {
      for (uint32_t b = 0; b < elem_size; ++b) elem[b] ^= static_cast<uint8_t>(rng());
      if (std::memcmp(elem, pair.old_bytes.data() + i * elem_size, elem_size) == 0) elem[0] ^= 1;
    }
  }
  return pair;
}

// A copy of `bytes` at `offset` into a buffer framed by guard bytes, so
// that writes outside the span are caught.
class GuardedBuffer {
 public:
  GuardedBuffer(std::span<const uint8_t> bytes, size_t offset)
      : size_(bytes.size()), offset_(offset), storage_(kGuardBytes + offset + size_ + kGuardBytes) {
    std::fill(storage_.begin(), storage_.end(), kGuardByte);
    std::copy(bytes.begin(), bytes.end(), storage_.begin() + kGuardBytes + offset_);
  }
  std::span<uint8_t> span() { return {storage_.data() + kGuardBytes + offset_, size_}; }
  std::vector<uint8_t> contents() const {
    const auto begin = storage_.begin() + kGuardBytes + offset_;
    return {begin, begin + size_};
  }
  bool GuardsIntact() const {
    for (size_t i = 0; i < storage_.size(); ++i) {
      const bool inside = i >= kGuardBytes + offset_ && i < kGuardBytes + offset_ + size_;
      if (!inside && storage_[i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  size_t size_;
  size_t offset_;
  std::vector<uint8_t> storage_;
};

struct RunSpec {
  DiffKernel kernel = DiffKernel::kScalar;
  uint32_t elem_size = 2;
  bool refresh = true;
  bool keep_old = true;
  bool force_wide = false;
  ThreadPool* pool = nullptr;
  size_t chunk_bytes = 4u << 20;
  size_t new_offset = 0;
  size_t snapshot_offset = 0;
};

std::string Describe(const RunSpec& spec, size_t bytes) {
  return std::string(DiffKernelName(spec.kernel)) + " elem_size=" + std::to_string(spec.elem_size) +
         " bytes=" + std::to_string(bytes) + " refresh=" + std::to_string(spec.refresh) +
         " keep_old=" + std::to_string(spec.keep_old) + " wide=" + std::to_string(spec.force_wide) +
         " threads=" + std::to_string(spec.pool ? spec.pool->size() + 1 : 1) +
         " chunk=" + std::to_string(spec.chunk_bytes) +
         " offsets=" + std::to_string(spec.new_offset) + "/" + std::to_string(spec.snapshot_offset);
}

// Runs one diff as `spec` says and checks everything against the oracle:
// positions, values, the snapshot afterwards and the bytes around it.
void ExpectMatchesOracle(const TensorPair& pair, const RunSpec& spec) {
  SCOPED_TRACE(Describe(spec, pair.new_bytes.size()));
  GuardedBuffer new_buffer(pair.new_bytes, spec.new_offset);
  GuardedBuffer snapshot(pair.old_bytes, spec.snapshot_offset);
  DiffOptions options;
  options.kernel = spec.kernel;
  options.elem_size = spec.elem_size;
  options.refresh_snapshot = spec.refresh;
  options.keep_old_values = spec.keep_old;
  options.pool = spec.pool;
  options.parallel_chunk_bytes = spec.chunk_bytes;
  ChangeSet changes;
  const Status status = diff_internal::DiffTensorImpl(new_buffer.span(), snapshot.span(), options,
                                                      spec.force_wide, &changes);
  ASSERT_TRUE(status.ok()) << status.ToString();

  const ExpectedChanges expected = NaiveDiff(pair.new_bytes, pair.old_bytes, spec.elem_size);
  EXPECT_EQ(changes.numel, pair.new_bytes.size() / spec.elem_size);
  EXPECT_EQ(changes.elem_size, spec.elem_size);
  EXPECT_EQ(changes.wide, spec.force_wide);
  if (spec.force_wide) {
    EXPECT_TRUE(changes.pos32.empty());
    EXPECT_TRUE(SameContents(changes.pos64, expected.positions));
  } else {
    EXPECT_TRUE(changes.pos64.empty());
    EXPECT_TRUE(SameContents(Positions(changes), expected.positions));
  }
  EXPECT_TRUE(SameContents(changes.new_values, expected.new_values));
  if (spec.keep_old) {
    EXPECT_TRUE(SameContents(changes.old_values, expected.old_values));
  } else {
    EXPECT_TRUE(changes.old_values.empty());
  }
  EXPECT_TRUE(SameContents(snapshot.contents(), spec.refresh ? pair.new_bytes : pair.old_bytes));
  EXPECT_TRUE(SameContents(new_buffer.contents(), pair.new_bytes)) << "new tensor was modified";
  EXPECT_TRUE(snapshot.GuardsIntact()) << "write outside the snapshot";
  EXPECT_TRUE(new_buffer.GuardsIntact()) << "write outside the new tensor";
}

// ---------------------------------------------------------------------------
// Every kernel, compared with the oracle. Kernels this CPU lacks are skipped.

class DiffKernelTest : public ::testing::TestWithParam<DiffKernel> {
 protected:
  void SetUp() override {
    const std::vector<DiffKernel> available = AvailableDiffKernels();
    if (std::find(available.begin(), available.end(), GetParam()) == available.end()) {
      GTEST_SKIP() << "this CPU cannot run the " << DiffKernelName(GetParam()) << " kernel";
    }
  }
  RunSpec Spec(uint32_t elem_size) const {
    RunSpec spec;
    spec.kernel = GetParam();
    spec.elem_size = elem_size;
    return spec;
  }
};

TEST_P(DiffKernelTest, UnalignedStartsAndOddTails) {
  // Lengths around the 32- and 64-byte vector widths and the 128-byte step,
  // in elements, each at every start offset within a cache line.
  const size_t lengths_in_bytes[] = {0, 1, 7, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 200, 257};
  for (uint32_t elem_size : kElemSizes) {
    for (size_t length : lengths_in_bytes) {
      const size_t numel = (length + elem_size - 1) / elem_size;
      const TensorPair pair = MakePair(numel, elem_size, 0.3, length * 131 + elem_size);
      for (size_t offset = 1; offset < 64; ++offset) {
        RunSpec spec = Spec(elem_size);
        spec.new_offset = offset;
        spec.snapshot_offset = (offset * 37) % 64;
        ExpectMatchesOracle(pair, spec);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_P(DiffKernelTest, RandomDensitiesAndFlags) {
  const double densities[] = {0.0, 0.001, 0.02, 0.3, 0.97, 1.0};
  for (uint32_t elem_size : kElemSizes) {
    for (double density : densities) {
      // Not a multiple of any vector width, and larger than one 64 KiB
      // kernel window so results of several windows are joined.
      const size_t numel = 150001 / elem_size + 3;
      const TensorPair pair = MakePair(numel, elem_size, density, elem_size * 1000 + density * 100);
      for (int flags = 0; flags < 4; ++flags) {
        RunSpec spec = Spec(elem_size);
        spec.refresh = flags & 1;
        spec.keep_old = flags & 2;
        spec.new_offset = 3;
        spec.snapshot_offset = 17;
        ExpectMatchesOracle(pair, spec);
      }
    }
  }
}

TEST_P(DiffKernelTest, NoneChanged) {
  for (uint32_t elem_size : kElemSizes) {
    const TensorPair pair = MakePair(10000 / elem_size + 1, elem_size, 0.0, elem_size);
    ExpectMatchesOracle(pair, Spec(elem_size));
    GuardedBuffer snapshot(pair.old_bytes, 0);
    DiffOptions options;
    options.kernel = GetParam();
    options.elem_size = elem_size;
    ChangeSet changes;
    ASSERT_TRUE(DiffTensor(pair.new_bytes, snapshot.span(), options, &changes).ok());
    EXPECT_EQ(changes.count(), 0u);
    EXPECT_TRUE(changes.new_values.empty());
    EXPECT_EQ(changes.density(), 0.0);
  }
}

TEST_P(DiffKernelTest, AllChanged) {
  for (uint32_t elem_size : kElemSizes) {
    TensorPair pair = MakePair(5003, elem_size, 0.0, elem_size);
    for (uint8_t& b : pair.new_bytes) b = static_cast<uint8_t>(~b);
    ExpectMatchesOracle(pair, Spec(elem_size));
    GuardedBuffer snapshot(pair.old_bytes, 0);
    DiffOptions options;
    options.kernel = GetParam();
    options.elem_size = elem_size;
    ChangeSet changes;
    ASSERT_TRUE(DiffTensor(pair.new_bytes, snapshot.span(), options, &changes).ok());
    ASSERT_EQ(changes.count(), 5003u);
    for (uint64_t i = 0; i < changes.count(); ++i) ASSERT_EQ(changes.position(i), i);
    EXPECT_EQ(changes.density(), 1.0);
  }
}

// A change confined to the high or the low byte of a wide element must be
// found, and an element whose bytes all match must not.
TEST_P(DiffKernelTest, SingleByteChangeAtEveryPosition) {
  for (uint32_t elem_size : kElemSizes) {
    const size_t numel = 256 / elem_size;
    const TensorPair base = MakePair(numel, elem_size, 0.0, 99);
    for (size_t byte = 0; byte < base.new_bytes.size(); ++byte) {
      TensorPair pair = base;
      pair.new_bytes[byte] ^= 0x80;
      GuardedBuffer snapshot(pair.old_bytes, 0);
      DiffOptions options;
      options.kernel = GetParam();
      options.elem_size = elem_size;
      ChangeSet changes;
      ASSERT_TRUE(DiffTensor(pair.new_bytes, snapshot.span(), options, &changes).ok());
      ASSERT_EQ(changes.count(), 1u) << "elem_size " << elem_size << " byte " << byte;
      EXPECT_EQ(changes.position(0), byte / elem_size);
      EXPECT_TRUE(SameContents(snapshot.contents(), pair.new_bytes));
    }
  }
}

// Floating-point values are compared as bit patterns: NaNs with different
// payloads differ, identical NaNs do not, and -0.0 differs from +0.0.
TEST_P(DiffKernelTest, FloatBitPatterns) {
  struct Case {
    uint32_t elem_size;
    uint64_t old_bits;
    uint64_t new_bits;
    bool changed;
  };
  const Case cases[] = {
      {2, 0x7FC0, 0x7FC1, true},   // bf16 NaN payloads
      {2, 0x7FC0, 0x7FC0, false},  // same bf16 NaN
      {2, 0x8000, 0x0000, true},   // bf16 -0.0 vs +0.0
      {2, 0x7E00, 0xFE00, true},   // f16 NaN sign
      {4, 0x7FC00000, 0x7FC00001, true},
      {4, 0x7FA00000, 0x7FC00000, true},  // signaling vs quiet NaN
      {4, 0x7FC00000, 0x7FC00000, false},
      {4, 0x80000000, 0x00000000, true},
      {8, 0x7FF8000000000000, 0x7FF8000000000001, true},
      {8, 0x7FF8000000000001, 0x7FF8000000000001, false},
      {8, 0x8000000000000000, 0x0000000000000000, true},
      {1, 0x7F, 0xFF, true},  // fp8 e4m3 NaN sign
      {1, 0x80, 0x00, true},  // fp8 -0.0 vs +0.0
  };
  for (const Case& c : cases) {
    // The special value sits among equal neighbours, at a position that
    // lands in a vector body for some cases and in the tail for others.
    const size_t numel = 97;
    const size_t where = (c.old_bits * 7 + c.new_bits) % numel;
    TensorPair pair = MakePair(numel, c.elem_size, 0.0, c.old_bits);
    std::memcpy(pair.old_bytes.data() + where * c.elem_size, &c.old_bits, c.elem_size);
    std::memcpy(pair.new_bytes.data() + where * c.elem_size, &c.new_bits, c.elem_size);
    GuardedBuffer snapshot(pair.old_bytes, 0);
    DiffOptions options;
    options.kernel = GetParam();
    options.elem_size = c.elem_size;
    ChangeSet changes;
    ASSERT_TRUE(DiffTensor(pair.new_bytes, snapshot.span(), options, &changes).ok());
    SCOPED_TRACE("old " + std::to_string(c.old_bits) + " new " + std::to_string(c.new_bits));
    ASSERT_EQ(changes.count(), c.changed ? 1u : 0u);
    if (c.changed) {
      EXPECT_EQ(changes.position(0), where);
      uint64_t new_bits = 0, old_bits = 0;
      std::memcpy(&new_bits, changes.new_values.data(), c.elem_size);
      std::memcpy(&old_bits, changes.old_values.data(), c.elem_size);
      EXPECT_EQ(new_bits, c.new_bits);
      EXPECT_EQ(old_bits, c.old_bits);
    }
    EXPECT_TRUE(SameContents(snapshot.contents(), pair.new_bytes));
  }
}

TEST_P(DiffKernelTest, ThreadsAndChunksGiveIdenticalOutput) {
  ThreadPool two(1);
  ThreadPool three(2);
  ThreadPool* pools[] = {nullptr, &two, &three};
  // Chunk sizes below one element, not a multiple of the element size or of
  // a vector, and one that leaves a short last chunk.
  const size_t chunk_sizes[] = {1, 100, 4096, 65536 + 8};
  for (uint32_t elem_size : kElemSizes) {
    const TensorPair pair = MakePair(200003 / elem_size, elem_size, 0.05, elem_size + 7);
    for (ThreadPool* pool : pools) {
      for (size_t chunk : chunk_sizes) {
        if (chunk == 1 && elem_size < 4) continue;  // 200 K one-element chunks: slow, no new path
        for (int flags = 0; flags < 4; ++flags) {
          RunSpec spec = Spec(elem_size);
          spec.pool = pool;
          spec.chunk_bytes = chunk;
          spec.refresh = flags & 1;
          spec.keep_old = flags & 2;
          spec.new_offset = 5;
          ExpectMatchesOracle(pair, spec);
        }
      }
    }
  }
}

// Tensors of 2^32 elements and more use 64-bit positions; the hook forces
// that path on a small tensor so its output can be checked.
TEST_P(DiffKernelTest, WidePositions) {
  ThreadPool two(1);
  for (uint32_t elem_size : kElemSizes) {
    const TensorPair pair = MakePair(70001, elem_size, 0.1, elem_size * 3);
    for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
      for (int flags = 0; flags < 4; ++flags) {
        RunSpec spec = Spec(elem_size);
        spec.force_wide = true;
        spec.pool = pool;
        spec.chunk_bytes = 12345;
        spec.refresh = flags & 1;
        spec.keep_old = flags & 2;
        spec.snapshot_offset = 9;
        ExpectMatchesOracle(pair, spec);
      }
    }
  }
}

TEST_P(DiffKernelTest, CountKernelMatchesOracle) {
  for (uint32_t elem_size : kElemSizes) {
    diff_internal::CountRangeFn count = nullptr;
    switch (GetParam()) {
      case DiffKernel::kScalar: count = diff_internal::ScalarCountFn(elem_size); break;
#if defined(__x86_64__)
      case DiffKernel::kAvx2: count = diff_internal::Avx2CountFn(elem_size); break;
      case DiffKernel::kAvx512: count = diff_internal::Avx512CountFn(elem_size); break;
#else
      default: break;
#endif
    }
    ASSERT_NE(count, nullptr);
    for (size_t numel : {size_t{0}, size_t{1}, size_t{33}, size_t{1000}, size_t{40001}}) {
      const TensorPair pair = MakePair(numel, elem_size, 0.2, numel + elem_size);
      const uint64_t expected =
          NaiveDiff(pair.new_bytes, pair.old_bytes, elem_size).positions.size();
      for (size_t offset : {0, 1, 13, 63}) {
        GuardedBuffer a(pair.new_bytes, offset);
        GuardedBuffer b(pair.old_bytes, 63 - offset);
        EXPECT_EQ(count(a.span().data(), b.span().data(), numel), expected)
            << "elem_size " << elem_size << " numel " << numel << " offset " << offset;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllKernels, DiffKernelTest,
                         ::testing::Values(DiffKernel::kScalar, DiffKernel::kAvx2,
                                           DiffKernel::kAvx512),
                         [](const ::testing::TestParamInfo<DiffKernel>& info) {
                           return std::string(DiffKernelName(info.param));
                         });

// ---------------------------------------------------------------------------
// Public API behaviour that does not depend on the kernel.

TEST(DiffTest, KernelNamesRoundTrip) {
  for (DiffKernel kernel : {DiffKernel::kScalar, DiffKernel::kAvx2, DiffKernel::kAvx512}) {
    const Result<DiffKernel> parsed = ParseDiffKernel(DiffKernelName(kernel));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kernel);
  }
  const Result<DiffKernel> bad = ParseDiffKernel("sse9");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().IsInvalidArgument());
  EXPECT_NE(bad.status().message().find("sse9"), std::string::npos);
}

TEST(DiffTest, AvailableKernelsStartWithScalarAndEndWithBest) {
  const std::vector<DiffKernel> available = AvailableDiffKernels();
  ASSERT_FALSE(available.empty());
  EXPECT_EQ(available.front(), DiffKernel::kScalar);
  EXPECT_EQ(available.back(), BestDiffKernel());
  EXPECT_EQ(DiffOptions().kernel, BestDiffKernel());
#if !defined(__x86_64__)
  EXPECT_EQ(available.size(), 1u);
#endif
}

TEST(DiffTest, ReusedChangeSetIsReplaced) {
  const TensorPair dense = MakePair(1000, 4, 0.5, 1);
  const TensorPair sparse = MakePair(300, 2, 0.01, 2);
  ChangeSet changes;
  std::vector<uint8_t> snapshot = dense.old_bytes;
  DiffOptions options;
  options.elem_size = 4;
  ASSERT_TRUE(
      diff_internal::DiffTensorImpl(dense.new_bytes, snapshot, options, true, &changes).ok());
  ASSERT_GT(changes.count(), 0u);
  snapshot = sparse.old_bytes;
  options.elem_size = 2;
  options.keep_old_values = false;
  ASSERT_TRUE(DiffTensor(sparse.new_bytes, snapshot, options, &changes).ok());
  const ExpectedChanges expected = NaiveDiff(sparse.new_bytes, sparse.old_bytes, 2);
  EXPECT_FALSE(changes.wide);
  EXPECT_TRUE(changes.pos64.empty());
  EXPECT_EQ(changes.numel, 300u);
  EXPECT_TRUE(SameContents(Positions(changes), expected.positions));
  EXPECT_TRUE(SameContents(changes.new_values, expected.new_values));
  EXPECT_TRUE(changes.old_values.empty());
}

TEST(DiffTest, SecondDiffAfterRefreshFindsNothing) {
  const TensorPair pair = MakePair(50000, 2, 0.02, 5);
  std::vector<uint8_t> snapshot = pair.old_bytes;
  ChangeSet changes;
  ASSERT_TRUE(DiffTensor(pair.new_bytes, snapshot, DiffOptions(), &changes).ok());
  EXPECT_GT(changes.count(), 0u);
  ASSERT_TRUE(DiffTensor(pair.new_bytes, snapshot, DiffOptions(), &changes).ok());
  EXPECT_EQ(changes.count(), 0u);
}

TEST(DiffTest, SameMemoryForBothSidesIsUnchanged) {
  TensorPair pair = MakePair(1000, 2, 0.0, 6);
  ChangeSet changes;
  ASSERT_TRUE(DiffTensor(pair.new_bytes, pair.new_bytes, DiffOptions(), &changes).ok());
  EXPECT_EQ(changes.count(), 0u);
}

TEST(DiffTest, EmptyTensor) {
  ChangeSet changes;
  changes.pos32 = {1, 2, 3};
  ASSERT_TRUE(DiffTensor({}, {}, DiffOptions(), &changes).ok());
  EXPECT_EQ(changes.numel, 0u);
  EXPECT_EQ(changes.count(), 0u);
  EXPECT_EQ(changes.density(), 0.0);
}

// Each bad call is refused with InvalidArgument, a message naming the
// problem, and no effect on the snapshot or the output.
TEST(DiffTest, BadArgumentsAreRefused) {
  const std::vector<uint8_t> new_bytes(64, 1);
  std::vector<uint8_t> snapshot(64, 2);
  struct Case {
    std::string name;
    size_t new_size;
    size_t snapshot_size;
    uint32_t elem_size;
    std::string message_part;
  };
  const Case cases[] = {
      {"length mismatch", 64, 62, 2, "length mismatch"},
      {"partial element", 63, 63, 2, "not a multiple of element size 2"},
      {"partial wide element", 60, 60, 8, "not a multiple of element size 8"},
      {"element size 0", 64, 64, 0, "element size 0"},
      {"element size 3", 63, 63, 3, "element size 3"},
      {"element size 16", 64, 64, 16, "element size 16"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    DiffOptions options;
    options.elem_size = c.elem_size;
    ChangeSet changes;
    changes.pos32 = {7};
    const Status status = DiffTensor(std::span(new_bytes).first(c.new_size),
                                     std::span(snapshot).first(c.snapshot_size), options, &changes);
    EXPECT_TRUE(status.IsInvalidArgument()) << status.ToString();
    EXPECT_NE(status.message().find(c.message_part), std::string::npos) << status.message();
    EXPECT_EQ(changes.pos32, std::vector<uint32_t>{7});
    EXPECT_EQ(snapshot, std::vector<uint8_t>(64, 2));

    const Result<uint64_t> count =
        CountChanged(std::span(new_bytes).first(c.new_size),
                     std::span(snapshot).first(c.snapshot_size), c.elem_size);
    ASSERT_FALSE(count.ok());
    EXPECT_TRUE(count.status().IsInvalidArgument());
    EXPECT_NE(count.status().message().find(c.message_part), std::string::npos);
  }
}

TEST(DiffTest, NullOutputAndOverlapAreRefused) {
  std::vector<uint8_t> buffer(128, 3);
  const Status null_out =
      DiffTensor(std::span(buffer).first(64), std::span(buffer).last(64), DiffOptions(), nullptr);
  EXPECT_TRUE(null_out.IsInvalidArgument());
  EXPECT_NE(null_out.message().find("null"), std::string::npos);

  ChangeSet changes;
  const Status overlap = DiffTensor(std::span(buffer).first(64), std::span(buffer).subspan(32, 64),
                                    DiffOptions(), &changes);
  EXPECT_TRUE(overlap.IsInvalidArgument());
  EXPECT_NE(overlap.message().find("overlap"), std::string::npos);
}

TEST(DiffTest, UnavailableKernelIsRefused) {
  const std::vector<DiffKernel> available = AvailableDiffKernels();
  for (DiffKernel kernel : {DiffKernel::kAvx2, DiffKernel::kAvx512}) {
    if (std::find(available.begin(), available.end(), kernel) != available.end()) continue;
    std::vector<uint8_t> new_bytes(64, 1), snapshot(64, 2);
    DiffOptions options;
    options.kernel = kernel;
    ChangeSet changes;
    const Status status = DiffTensor(new_bytes, snapshot, options, &changes);
    EXPECT_TRUE(status.IsInvalidArgument());
    EXPECT_NE(status.message().find("not available"), std::string::npos);
    EXPECT_EQ(snapshot, std::vector<uint8_t>(64, 2));
  }
  // An enumerator value outside the enum is refused, not dispatched.
  std::vector<uint8_t> new_bytes(64, 1), snapshot(64, 2);
  DiffOptions options;
  options.kernel = static_cast<DiffKernel>(42);
  ChangeSet changes;
  EXPECT_TRUE(DiffTensor(new_bytes, snapshot, options, &changes).IsInvalidArgument());
}

TEST(DiffTest, CountChangedMatchesOracle) {
  for (uint32_t elem_size : kElemSizes) {
    const TensorPair pair = MakePair(30011, elem_size, 0.07, elem_size * 11);
    const Result<uint64_t> count = CountChanged(pair.new_bytes, pair.old_bytes, elem_size);
    ASSERT_TRUE(count.ok()) << count.status().ToString();
    EXPECT_EQ(*count, NaiveDiff(pair.new_bytes, pair.old_bytes, elem_size).positions.size());
  }
}

}  // namespace
}  // namespace deltasync
