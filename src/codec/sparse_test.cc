// Size targets of the sparse encoding on realistic BF16 optimizer steps, and
// its per-tensor layout choice.
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "codec/codec_test_util.h"
#include "deltasync/codec.h"

namespace deltasync {
namespace {

using codec_test::DiffPair;
using codec_test::MakeBf16Step;
using codec_test::MakePair;
using codec_test::TensorPair;

size_t EncodedSize(Encoding e, const TensorPair& pair, const ChangeSet& changes,
                   SparseMode mode = SparseMode::kAuto) {
  EncodeOptions options;
  options.sparse_mode = mode;
  std::vector<uint8_t> out;
  Status status = Encode(e, pair.new_bytes, changes, options, &out);
  EXPECT_TRUE(status.ok()) << status.ToString();
  std::vector<uint8_t> target = pair.old_bytes;
  EXPECT_TRUE(DecodeApply(e, out, target, pair.elem_size).ok());
  EXPECT_EQ(target, pair.new_bytes);
  return out.size();
}

class Bf16Step : public ::testing::TestWithParam<float> {};

// The size targets (README.md, "Diff and encodings"): sparse within 1.25x of
// the entropy bound, at most 0.7x of xor's bytes (as the peers write xor) and
// 0.3x of int32 indices + values.
// Our own xor encoder writes smaller frames of the same format; sparse must
// still beat it.
TEST_P(Bf16Step, SparseMeetsItsSizeTargets) {
  TensorPair pair = MakeBf16Step(size_t{1} << 20, GetParam(), 1234);
  ChangeSet changes = DiffPair(pair);
  const double density = changes.density();
  ASSERT_GE(density, 0.01);
  ASSERT_LE(density, 0.03);
  Result<EntropyBound> bound = EntropyBoundBytes(changes);
  ASSERT_TRUE(bound.ok());
  const double count = static_cast<double>(changes.count());
  const double sparse = EncodedSize(Encoding::kSparse, pair, changes) / count;
  const double xor_bytes = EncodedSize(Encoding::kXor, pair, changes) / count;
  // xor as the Python peers write it: one-shot zstd -1 of the XOR image.
  const double zstd1_xor =
      static_cast<double>(codec_test::ZstdCompress(codec_test::XorImage(pair)).size()) / count;
  const double indices = EncodedSize(Encoding::kIndices, pair, changes) / count;
  const double overwrite = EncodedSize(Encoding::kOverwrite, pair, changes) / count;
  std::printf(
      "density %.4f, bytes per changed element: bound %.3f sparse %.3f xor %.3f (zstd -1 %.3f) "
      "overwrite %.3f indices %.3f\n",
      density, bound->bytes_per_changed(), sparse, xor_bytes, zstd1_xor, overwrite, indices);
  EXPECT_LE(sparse, 1.25 * bound->bytes_per_changed());
  EXPECT_LT(sparse, 0.7 * zstd1_xor);
  EXPECT_LT(sparse, xor_bytes);
  EXPECT_LT(xor_bytes, zstd1_xor);
  EXPECT_LT(sparse, 0.3 * indices);
  // The bound is a bound: nothing beats it by more than framing noise.
  EXPECT_GT(sparse, 0.95 * bound->bytes_per_changed());
}

INSTANTIATE_TEST_SUITE_P(Steps, Bf16Step, ::testing::Values(3e-7f, 5e-7f));

TEST(SparseMode, AutoPicksTheSmallerLayout) {
  for (double density : {0.01, 0.2, 0.45, 0.6, 0.9, 1.0}) {
    TensorPair pair = MakePair(200000, 2, density, 42);
    ChangeSet changes = DiffPair(pair);
    const size_t positions = EncodedSize(Encoding::kSparse, pair, changes, SparseMode::kPositions);
    const size_t planes = EncodedSize(Encoding::kSparse, pair, changes, SparseMode::kXorPlanes);
    EncodeOptions options;
    std::vector<uint8_t> out;
    ASSERT_TRUE(Encode(Encoding::kSparse, pair.new_bytes, changes, options, &out).ok());
    Result<SparseHeader> header = ReadSparseHeader(out);
    ASSERT_TRUE(header.ok());
    SCOPED_TRACE("density " + std::to_string(density) + ": positions " + std::to_string(positions) +
                 ", xor-planes " + std::to_string(planes));
    EXPECT_EQ(out.size(), std::min(positions, planes));
    EXPECT_EQ(header->mode, positions <= planes ? SparseMode::kPositions : SparseMode::kXorPlanes);
  }
}

// Small tensors (norms, biases) must not pay much for framing.
TEST(SparseMode, SmallTensorsStayCompact) {
  TensorPair pair = MakeBf16Step(4096, 5e-7f, 99);
  ChangeSet changes = DiffPair(pair);
  ASSERT_GT(changes.count(), 0u);
  const size_t sparse = EncodedSize(Encoding::kSparse, pair, changes);
  const size_t indices = EncodedSize(Encoding::kIndices, pair, changes);
  EXPECT_LT(sparse, indices / 2) << changes.count() << " changes";
}

}  // namespace
}  // namespace deltasync
