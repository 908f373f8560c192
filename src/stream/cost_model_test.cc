// The sender's time model of a unit's encodings (cost_model.h).
#include "stream/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace deltasync::stream {
namespace {

TEST(CostModel, IsMeasuredOnThisMachine) {
  Result<CostModel> m = MeasureCostModel();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (double v : {m->dense_byte, m->indices_change, m->sparse_change, m->sparse_change_bytes}) {
    EXPECT_TRUE(std::isfinite(v) && v > 0) << v;
  }
  // A change moves a position and a value through the frame and a
  // scatter: more work than one dense byte's copy.
  EXPECT_GT(m->indices_change, m->dense_byte);
  EXPECT_GT(m->sparse_change, m->dense_byte);
  EXPECT_EQ(m->wire_byte, 0);  // measured from the syncs, not here
}

TEST(CostModel, DenseWhenItsBytesCostLessTimeThanTheChanges) {
  CostModel m;
  m.dense_byte = 0.1e-9;
  m.indices_change = 10e-9;
  m.sparse_change = 20e-9;
  m.sparse_change_bytes = 1.5;
  // Unmeasured wire: time is not weighed.
  EXPECT_FALSE(DenseIsFaster(m, StreamEncoding::kIndices, 1000, 1000, 2, 3));
  // A fast wire (0.25 ns a byte): a BF16 element dense costs 0.7 ns, a
  // change by indices 11.25 ns, by sparse 20.4 ns.
  m.wire_byte = 0.25e-9;
  EXPECT_FALSE(DenseIsFaster(m, StreamEncoding::kIndices, 1000, 60, 2, 3));
  EXPECT_TRUE(DenseIsFaster(m, StreamEncoding::kIndices, 1000, 70, 2, 3));
  EXPECT_FALSE(DenseIsFaster(m, StreamEncoding::kSparse, 1000, 30, 2, 3));
  EXPECT_TRUE(DenseIsFaster(m, StreamEncoding::kSparse, 1000, 40, 2, 3));
  // A slow wire (8 ns a byte, 1 Gbit/s): the bytes decide nearly alone; a
  // dense element costs 16.2 ns, an indices change 50 ns.
  m.wire_byte = 8e-9;
  EXPECT_FALSE(DenseIsFaster(m, StreamEncoding::kIndices, 1000, 300, 2, 3));
  EXPECT_TRUE(DenseIsFaster(m, StreamEncoding::kIndices, 1000, 330, 2, 3));
  EXPECT_FALSE(DenseIsFaster(m, StreamEncoding::kDense, 1000, 1000, 2, 3));
}

}  // namespace
}  // namespace deltasync::stream
