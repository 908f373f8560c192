// The entropy bound against values worked out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "deltasync/codec.h"

namespace deltasync {
namespace {

// A ChangeSet with the given XOR values (old = 0, new = xor) at positions
// 0, 1, 2, ...
ChangeSet WithXors(uint64_t numel, uint32_t elem_size, const std::vector<uint64_t>& xors) {
  ChangeSet changes;
  changes.numel = numel;
  changes.elem_size = elem_size;
  for (size_t i = 0; i < xors.size(); ++i) {
    changes.pos32.push_back(static_cast<uint32_t>(i));
    for (uint32_t b = 0; b < elem_size; ++b) {
      changes.new_values.push_back(static_cast<uint8_t>(xors[i] >> (8 * b)));
      changes.old_values.push_back(0);
    }
  }
  return changes;
}

TEST(EntropyBound, PositionsOnly) {
  // p = 1/4: H2 = 0.811278 bits per element; all XOR values equal: 0 bits.
  Result<EntropyBound> bound = EntropyBoundBytes(WithXors(8, 2, {0x0101, 0x0101}));
  ASSERT_TRUE(bound.ok());
  const double h2 = -(0.25 * std::log2(0.25) + 0.75 * std::log2(0.75));
  EXPECT_NEAR(bound->position_bytes, 8 * h2 / 8, 1e-12);
  EXPECT_DOUBLE_EQ(bound->value_bytes, 0.0);
  EXPECT_NEAR(bound->bytes_per_changed(), h2 / 2, 1e-12);
}

TEST(EntropyBound, ValuesUseWholeElementSymbols) {
  for (uint32_t es : {1u, 2u, 4u, 8u}) {
    // Four distinct symbols, equally likely: 2 bits each. The 8-byte case
    // differs only in the top byte, which a per-byte model would miss.
    const uint64_t top = es == 8 ? uint64_t{1} << 56 : 0;
    std::vector<uint64_t> xors = {1, 2, 3, 4, 1 | top, 2 | top, 3 | top, 4 | top};
    if (es != 8) xors.resize(4);
    Result<EntropyBound> bound = EntropyBoundBytes(WithXors(xors.size(), es, xors));
    ASSERT_TRUE(bound.ok()) << es;
    EXPECT_DOUBLE_EQ(bound->position_bytes, 0.0) << es;  // every element changed
    const double bits = std::log2(static_cast<double>(xors.size()));
    EXPECT_NEAR(bound->value_bytes, xors.size() * bits / 8, 1e-12) << es;
  }
  // Skewed: 3 x A, 1 x B -> 4 * H(3/4) bits.
  Result<EntropyBound> skewed = EntropyBoundBytes(WithXors(4, 4, {7, 7, 7, 9}));
  ASSERT_TRUE(skewed.ok());
  const double h = -(0.75 * std::log2(0.75) + 0.25 * std::log2(0.25));
  EXPECT_NEAR(skewed->value_bytes, 4 * h / 8, 1e-12);
}

TEST(EntropyBound, NothingChanged) {
  Result<EntropyBound> bound = EntropyBoundBytes(WithXors(1000, 2, {}));
  ASSERT_TRUE(bound.ok());
  EXPECT_EQ(bound->total_bytes(), 0.0);
  EXPECT_EQ(bound->bytes_per_changed(), 0.0);
}

TEST(EntropyBound, NeedsOldValues) {
  ChangeSet changes = WithXors(10, 2, {1, 2});
  changes.old_values.clear();
  Result<EntropyBound> bound = EntropyBoundBytes(changes);
  ASSERT_FALSE(bound.ok());
  EXPECT_TRUE(bound.status().IsInvalidArgument());
  EXPECT_NE(bound.status().message().find("old value"), std::string::npos);
  changes = WithXors(10, 3, {});
  EXPECT_TRUE(EntropyBoundBytes(changes).status().IsInvalidArgument());
}

}  // namespace
}  // namespace deltasync
