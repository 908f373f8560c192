// Fp8QuantizeShard: trainer ranks as threads over gloo, each holding a
// window of a BF16 weight whose borders cut through 128 x 128 blocks (and,
// in the 2-D layout, through rows' channels and the tensor's one group);
// each rank's codes and scales equal the whole weight's, quantized at once.

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator_test_util.h"
#include "deltasync/communicator.h"
#include "deltasync/quantize.h"
#include "deltasync/shard.h"

namespace deltasync {
namespace {

using std::chrono::milliseconds;

constexpr int64_t kRows = 300, kCols = 200;

struct Box {
  int64_t r0, r1, c0, c1;
};

// A BF16 weight with one large element per row band, so blocks differ.
std::vector<uint16_t> Weight(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<uint16_t> w(kRows * kCols);
  for (int64_t i = 0; i < kRows * kCols; ++i) {
    float x = d(rng);
    if (i % 4099 == 0) x *= 40.0f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    w[i] = static_cast<uint16_t>(bits >> 16);
  }
  return w;
}

// The box `b` of a [kRows, kCols] row-major array, its rows back to back.
template <typename T>
std::vector<T> Cut(const std::vector<T>& w, const Box& b) {
  std::vector<T> out;
  for (int64_t r = b.r0; r < b.r1; ++r) {
    out.insert(out.end(), w.begin() + r * kCols + b.c0, w.begin() + r * kCols + b.c1);
  }
  return out;
}

class Fp8QuantizeShardGloo : public ::testing::TestWithParam<QuantRecipe> {
 protected:
  void Form(int ranks) {
#if !DS_HAVE_GLOO
    GTEST_SKIP() << "built without Gloo (DELTASYNC_WITH_GLOO)";
#else
    std::vector<Status> errors;
    comms_ = comm_test::FormInThreads(
        ranks,
        [&](int r) {
          return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir_.path()), r, ranks,
                                            milliseconds(10000), "quant");
        },
        &errors);
    for (const Status& s : errors) ASSERT_TRUE(s.ok()) << s.ToString();
#endif
  }

  // Every rank quantizes its box of `w`; checks each against the whole.
  void ExpectWholeResult(const std::vector<uint16_t>& w, const std::vector<Box>& boxes) {
    const QuantRecipe recipe = GetParam();
    const std::vector<int64_t> shape = {kRows, kCols};
    const QuantTensor tensor{"model.layers.0.mlp.down_proj.weight", DType::kBF16, shape};
    const std::vector<int64_t> grid = *QuantScaleShape(recipe, kRows, kCols);
    const size_t scale_size = DTypeSize(QuantScaleDType(recipe.scale_format));
    std::vector<uint8_t> whole_codes(kRows * kCols);
    std::vector<uint8_t> whole_scales(grid[0] * (grid.size() == 2 ? grid[1] : 1) * scale_size);
    ASSERT_TRUE(
        Fp8Quantize(recipe, tensor, w.data(), whole_codes.data(), whole_scales.data()).ok());
    const int ranks = static_cast<int>(boxes.size());
    std::vector<std::vector<uint16_t>> data(ranks);
    std::vector<QuantWindow> windows(ranks);
    for (int r = 0; r < ranks; ++r) {
      data[r] = Cut(w, boxes[r]);
      windows[r] = {nullptr, boxes[r].r0, boxes[r].r1, boxes[r].c0, boxes[r].c1};
    }
    std::vector<std::vector<uint8_t>> codes(ranks), scales(ranks);
    const std::vector<Status> done = comm_test::OnEveryRank(ranks, [&](int r) {
      std::vector<QuantWindow> mine = windows;
      mine[r].data = data[r].data();
      codes[r].assign(data[r].size(), 0);
      scales[r].assign(whole_scales.size(), 0);  // at least its groups' count
      return Fp8QuantizeShard(*comms_[r], recipe, tensor, mine, codes[r].data(), scales[r].data());
    });
    const int64_t grid_cols = grid.size() == 2 ? grid[1] : 1;
    for (int r = 0; r < ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_TRUE(done[r].ok()) << done[r].ToString();
      EXPECT_EQ(codes[r], Cut(whole_codes, boxes[r]));
      windows[r].data = data[r].data();
      const QuantGroups g = *Fp8WindowGroups(recipe, tensor, windows[r]);
      size_t k = 0;
      for (int64_t gr = g.row_begin; gr < g.row_end; ++gr) {
        for (int64_t gc = g.col_begin; gc < g.col_end; ++gc, ++k) {
          EXPECT_EQ(
              0, std::memcmp(scales[r].data() + k * scale_size,
                             whole_scales.data() + (gr * grid_cols + gc) * scale_size, scale_size))
              << "group (" << gr << ", " << gc << ")";
        }
      }
    }
  }

  comm_test::TempDir dir_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

TEST_P(Fp8QuantizeShardGloo, RowShardsCutThroughBlocksAndMatchTheWhole) {
  Form(3);
  if (IsSkipped()) return;
  ExpectWholeResult(Weight(1), {{0, 100, 0, kCols}, {100, 200, 0, kCols}, {200, 300, 0, kCols}});
}

TEST_P(Fp8QuantizeShardGloo, TwoDimensionalShardsMatchTheWhole) {
  Form(3);
  if (IsSkipped()) return;
  ExpectWholeResult(Weight(2), {{0, 150, 0, kCols}, {150, 300, 0, 70}, {150, 300, 70, kCols}});
}

TEST_P(Fp8QuantizeShardGloo, ARankWithANanFailsEveryRank) {
  Form(2);
  if (IsSkipped()) return;
  std::vector<uint16_t> w = Weight(3);
  w[250 * kCols + 7] = 0x7FC0;  // NaN in rank 1's rows
  const std::vector<int64_t> shape = {kRows, kCols};
  const QuantTensor tensor{"w", DType::kBF16, shape};
  const std::vector<Box> boxes = {{0, 140, 0, kCols}, {140, 300, 0, kCols}};
  std::vector<std::vector<uint16_t>> data = {Cut(w, boxes[0]), Cut(w, boxes[1])};
  std::vector<std::vector<uint8_t>> codes(2), scales(2);
  const std::vector<Status> done = comm_test::OnEveryRank(2, [&](int r) {
    std::vector<QuantWindow> windows;
    for (int k = 0; k < 2; ++k) {
      windows.push_back(
          {k == r ? data[r].data() : nullptr, boxes[k].r0, boxes[k].r1, boxes[k].c0, boxes[k].c1});
    }
    codes[r].assign(data[r].size(), 0);
    scales[r].assign(64 * 4, 0);
    return Fp8QuantizeShard(*comms_[r], GetParam(), tensor, windows, codes[r].data(),
                            scales[r].data());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(done[r].code(), StatusCode::kInvalidArgument) << done[r].ToString();
    EXPECT_EQ(codes[r], std::vector<uint8_t>(data[r].size(), 0)) << "rank " << r;
  }
  EXPECT_NE(done[0].message().find("rank 1"), std::string::npos) << done[0].ToString();
  EXPECT_NE(done[1].message().find("'w'"), std::string::npos) << done[1].ToString();
}

TEST(Fp8QuantizeShard, RefusesWindowsThatDoNotFitTheGroup) {
#if DS_HAVE_GLOO
  comm_test::TempDir dir;
  std::vector<Status> errors;
  std::vector<std::unique_ptr<Communicator>> comms = comm_test::FormInThreads(
      1,
      [&](int r) {
        return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir.path()), r, 1,
                                          milliseconds(10000), "quant1");
      },
      &errors);
  ASSERT_TRUE(errors[0].ok()) << errors[0].ToString();
  const std::vector<int64_t> shape = {kRows, kCols};
  const QuantTensor tensor{"w", DType::kBF16, shape};
  std::vector<uint16_t> w = Weight(4);
  uint8_t out = 0;
  const std::vector<QuantWindow> two = {{w.data(), 0, 10, 0, kCols}, {nullptr, 10, 20, 0, kCols}};
  Status s = Fp8QuantizeShard(*comms[0], QuantRecipe{}, tensor, two, &out, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("2 windows for a trainer group of 1"), std::string::npos);
  const std::vector<QuantWindow> outside = {{w.data(), 0, kRows + 1, 0, kCols}};
  s = Fp8QuantizeShard(*comms[0], QuantRecipe{}, tensor, outside, &out, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("rank 0's window"), std::string::npos) << s.ToString();
  EXPECT_EQ(out, 0);
#else
  GTEST_SKIP() << "built without Gloo (DELTASYNC_WITH_GLOO)";
#endif
}

// The specs a sharded sender takes for each rank's codes and scales cover
// the codes and the scale grid once each across the ranks: a group that
// several windows touch is sent by the lowest of them, and every rank's
// local scales lie as Fp8QuantizeShard writes them (its groups' rectangle,
// row major).
TEST_P(Fp8QuantizeShardGloo, SpecsSendEveryCodeAndScaleOnce) {
  const QuantRecipe recipe = GetParam();
  const std::vector<int64_t> shape = {kRows, kCols};
  const QuantTensor tensor{"w", DType::kBF16, shape};
  const std::vector<int64_t> grid = *QuantScaleShape(recipe, kRows, kCols);
  const int64_t grid_cols = grid.size() == 2 ? grid[1] : 1;
  for (const std::vector<Box>& boxes :
       {std::vector<Box>{{0, 100, 0, kCols}, {100, 200, 0, kCols}, {200, 300, 0, kCols}},
        std::vector<Box>{{0, 150, 0, kCols}, {150, 300, 0, 70}, {150, 300, 70, kCols}}}) {
    std::vector<QuantWindow> windows;
    for (const Box& b : boxes) windows.push_back({nullptr, b.r0, b.r1, b.c0, b.c1});
    std::vector<int> code_sent(kRows * kCols, 0), scale_sent(grid[0] * grid_cols, 0);
    for (int r = 0; r < static_cast<int>(boxes.size()); ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      Result<Fp8ShardSpecs> specs = Fp8ShardSpecsOf(recipe, tensor, windows, r, "w_scale_inv");
      ASSERT_TRUE(specs.ok()) << specs.status().ToString();
      ASSERT_TRUE(specs->codes.Validate().ok());
      ASSERT_TRUE(specs->scales.Validate().ok());
      EXPECT_EQ(specs->codes.dtype, DType::kF8_E4M3);
      EXPECT_EQ(specs->scales.dtype, QuantScaleDType(recipe.scale_format));
      for (const ShardPiece& p : specs->codes.pieces) {
        EXPECT_EQ(p.hf_name, "w");
        for (int64_t i = 0; i < p.extent[0]; ++i) {
          for (int64_t j = 0; j < p.extent[1]; ++j) {
            code_sent[(p.hf_offset[0] + i) * kCols + p.hf_offset[1] + j] += p.contributes;
          }
        }
      }
      windows[r].data = &boxes;
      const QuantGroups g = *Fp8WindowGroups(recipe, tensor, windows[r]);
      windows[r].data = nullptr;
      const ShardSpec& scales = specs->scales;
      if (grid.size() == 1) {
        EXPECT_EQ(scales.local_shape, std::vector<int64_t>{1});
        scale_sent[0] += scales.contributes;
        continue;
      }
      EXPECT_EQ(scales.local_shape,
                (std::vector<int64_t>{g.row_end - g.row_begin, g.col_end - g.col_begin}));
      for (const ShardPiece& p : scales.pieces) {
        EXPECT_EQ(p.hf_name, "w_scale_inv");
        EXPECT_EQ(p.hf_shape, grid);
        for (int64_t i = 0; i < p.extent[0]; ++i) {
          for (int64_t j = 0; j < p.extent[1]; ++j) {
            // Local (row, col) of the rectangle is grid (row_begin + row, ...).
            EXPECT_EQ(p.hf_offset[0] + i, g.row_begin + p.local_offset[0] + i);
            EXPECT_EQ(p.hf_offset[1] + j, g.col_begin + p.local_offset[1] + j);
            scale_sent[(p.hf_offset[0] + i) * grid_cols + p.hf_offset[1] + j] +=
                p.contributes && scales.contributes;
          }
        }
      }
    }
    EXPECT_EQ(code_sent, std::vector<int>(code_sent.size(), 1));
    EXPECT_EQ(scale_sent, std::vector<int>(scale_sent.size(), 1));
  }
  // Refusals.
  std::vector<QuantWindow> two = {{nullptr, 0, 150, 0, kCols}, {nullptr, 150, 300, 0, kCols}};
  EXPECT_EQ(Fp8ShardSpecsOf(recipe, tensor, two, 2, "s").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Fp8ShardSpecsOf(recipe, tensor, two, 0, "w").status().code(),
            StatusCode::kInvalidArgument);
  two[1].row_end = kRows + 1;
  const Status outside = Fp8ShardSpecsOf(recipe, tensor, two, 0, "s").status();
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("rank 1's window"), std::string::npos) << outside.ToString();
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8QuantizeShardGloo,
                         ::testing::Values(QuantRecipe{QuantScheme::kBlock128, ScaleFormat::kF32},
                                           QuantRecipe{QuantScheme::kBlock128, ScaleFormat::kUe8m0},
                                           QuantRecipe{QuantScheme::kPerTensor, ScaleFormat::kF32},
                                           QuantRecipe{QuantScheme::kPerChannel,
                                                       ScaleFormat::kF32}),
                         [](const ::testing::TestParamInfo<QuantRecipe>& info) {
                           return std::string(QuantSchemeName(info.param.scheme)) + "_" +
                                  std::string(ScaleFormatName(info.param.scale_format));
                         });

}  // namespace
}  // namespace deltasync
