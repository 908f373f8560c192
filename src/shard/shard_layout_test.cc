// A sharded trainer's layout (shard_layout.h): a piece's runs against an
// element-by-element reference, the layout's wire form and its
// corruptions, rank 0's checks of overlaps and gaps, the dense gather's
// packing, and the exchange over a gloo group.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "comm/communicator_test_util.h"
#include "deltasync/communicator.h"
#include "deltasync/shard.h"
#include "shard/shard_layout.h"

namespace deltasync::stream {
namespace {

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

ShardSpec Spec(Result<ShardSpec> r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : ShardSpec{};
}

// Every element of `spec`'s piece `j`: HF flat position -> local flat
// position, by walking its coordinates (the reference the runs must match).
std::map<uint64_t, uint64_t> PieceElements(const ShardSpec& spec, size_t j) {
  std::map<uint64_t, uint64_t> out;
  const ShardPiece& p = spec.pieces[j];
  if (p.kind == ShardPiece::Kind::kFlat) {
    for (int64_t k = 0; k < p.count; ++k) out[p.hf_first + k] = p.local_first + k;
    return out;
  }
  const size_t nd = p.extent.size();
  for (int64_t e = 0; e < p.elements(); ++e) {
    int64_t rem = e, local = 0, hf = 0;
    std::vector<int64_t> c(nd);
    for (size_t d = nd; d-- > 0;) {
      c[d] = rem % p.extent[d];
      rem /= p.extent[d];
    }
    for (size_t d = 0; d < nd; ++d) {
      local = local * spec.local_shape[d] + p.local_offset[d] + c[d];
      hf = hf * p.hf_shape[d] + p.hf_offset[d] + c[d];
    }
    out[hf] = local;
  }
  return out;
}

TEST(PieceRuns, EveryRangeOfEveryPieceMatchesTheElementWalk) {
  std::mt19937_64 rng(7);
  std::vector<ShardSpec> specs = {
      Spec(ShardSpec::Shard("a", DType::kBF16, {10, 6}, 0, 1, 3)),
      Spec(ShardSpec::Shard("b", DType::kBF16, {10, 6}, 1, 2, 4)),
      Spec(ShardSpec::Box("c", DType::kF32, {5, 7, 9}, {1, 2, 3}, {3, 4, 5})),
      Spec(ShardSpec::FlatRange("d", DType::kF32, {8, 8}, 13, 29)),
      Spec(ShardSpec::Whole("e", DType::kF32, {})),
      Spec(ShardSpec::Fused(DType::kBF16, 0,
                            {Spec(ShardSpec::Shard("q", DType::kBF16, {8, 6}, 0, 1, 2)),
                             Spec(ShardSpec::Shard("k", DType::kBF16, {4, 6}, 0, 1, 2))})),
  };
  for (const ShardSpec& spec : specs) {
    for (size_t j = 0; j < spec.pieces.size(); ++j) {
      const std::map<uint64_t, uint64_t> want_all = PieceElements(spec, j);
      uint64_t numel = 1;
      for (int64_t d : spec.pieces[j].hf_shape) numel *= d;
      for (int trial = 0; trial < 40; ++trial) {
        const uint64_t first = rng() % (numel + 1);
        const uint64_t count = rng() % (numel - first + 1);
        std::map<uint64_t, uint64_t> got;
        uint64_t last_end = 0;
        ForEachPieceRun(spec.pieces[j], spec.local_shape, first, count, [&](const PieceRun& r) {
          EXPECT_GE(r.hf, last_end) << "runs in increasing HF order";
          last_end = r.hf + r.count;
          for (uint64_t k = 0; k < r.count; ++k) got[r.hf + k] = r.local + k;
        });
        std::map<uint64_t, uint64_t> want;
        for (const auto& [hf, local] : want_all) {
          if (hf >= first && hf < first + count) want[hf] = local;
        }
        EXPECT_EQ(got, want) << spec.pieces[j].hf_name << " [" << first << ", +" << count << ")";
      }
    }
  }
}

TEST(Layout, RoundTripsAndRefusesWhatItCannotRead) {
  ShardSpec fused =
      Spec(ShardSpec::Fused(DType::kBF16, 0,
                            {Spec(ShardSpec::Shard("q", DType::kBF16, {8, 6}, 0, 1, 2)),
                             Spec(ShardSpec::Replicate("k", DType::kBF16, {4, 6}, false))}));
  std::vector<ShardSpec> specs = {Spec(ShardSpec::FlatRange("d", DType::kF32, {8, 8}, 13, 29)),
                                  fused};
  specs[0].contributes = false;
  const std::vector<uint8_t> bytes = EncodeLayout(specs);
  Result<std::vector<ShardSpec>> back = DecodeLayout(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(EncodeLayout(*back), bytes);
  ASSERT_EQ(back->size(), 2u);
  EXPECT_FALSE((*back)[0].contributes);
  EXPECT_FALSE((*back)[1].pieces[1].contributes);
  std::vector<uint8_t> flipped = bytes;
  flipped[5] ^= 1;
  EXPECT_TRUE(Contains(DecodeLayout(flipped).status(), "checksum mismatch"));
  EXPECT_EQ(DecodeLayout(std::vector<uint8_t>(3)).status().code(), StatusCode::kCorruption);
}

std::vector<LayoutTensor> Model() {
  return {{"w", DType::kBF16, {12, 8}}, {"b", DType::kF32, {30}}};
}

TEST(Layout, RankZeroRefusesOverlapsAndGapsNamingThem) {
  // Two ranks, w split by rows, b split 20 + 10.
  const auto ranks = [](int64_t w_rows0, int64_t b0, bool second_b_contributes) {
    std::vector<std::vector<ShardSpec>> by_rank(2);
    by_rank[0].push_back(
        Spec(ShardSpec::ShardSizes("w", DType::kBF16, {12, 8}, 0, {w_rows0, 12 - w_rows0}, 0)));
    by_rank[1].push_back(
        Spec(ShardSpec::ShardSizes("w", DType::kBF16, {12, 8}, 0, {w_rows0, 12 - w_rows0}, 1)));
    by_rank[0].push_back(Spec(ShardSpec::FlatRange("b", DType::kF32, {30}, 0, b0)));
    ShardSpec b1 = Spec(ShardSpec::FlatRange("b", DType::kF32, {30}, 20, 10));
    b1.contributes = second_b_contributes;
    by_rank[1].push_back(b1);
    return by_rank;
  };
  EXPECT_TRUE(CheckLayout(Model(), ranks(5, 20, true)).ok());
  Status gap = CheckLayout(Model(), ranks(5, 18, true));
  EXPECT_TRUE(Contains(gap, "tensor 'b': element 18 (of 30, 2 in all) is held by no trainer rank"))
      << gap.ToString();
  Status replica = CheckLayout(Model(), ranks(5, 20, false));
  EXPECT_TRUE(Contains(replica, "tensor 'b': element 20 (of 30, 10 in all)")) << replica.ToString();
  Status overlap = CheckLayout(Model(), ranks(5, 25, true));
  EXPECT_TRUE(Contains(overlap,
                       "tensor 'b': element 20 is held by two contributing pieces, of "
                       "rank 0 and of rank 1"))
      << overlap.ToString();
  // Column shards whose spans meet but whose elements do not: fine; one
  // column too many: an overlap.
  std::vector<std::vector<ShardSpec>> cols(2);
  cols[0].push_back(Spec(ShardSpec::Box("w", DType::kBF16, {12, 8}, {0, 0}, {12, 4})));
  cols[1].push_back(Spec(ShardSpec::Box("w", DType::kBF16, {12, 8}, {0, 4}, {12, 4})));
  cols[0].push_back(Spec(ShardSpec::Whole("b", DType::kF32, {30})));
  EXPECT_TRUE(CheckLayout(Model(), cols).ok());
  cols[1][0] = Spec(ShardSpec::Box("w", DType::kBF16, {12, 8}, {0, 3}, {12, 5}));
  Status cross = CheckLayout(Model(), cols);
  EXPECT_TRUE(Contains(cross, "tensor 'w': element 3 is held by two contributing pieces"))
      << cross.ToString();
  // A piece of another shape than the model's.
  cols[1][0] = Spec(ShardSpec::Box("w", DType::kBF16, {12, 9}, {0, 4}, {12, 4}));
  EXPECT_TRUE(Contains(CheckLayout(Model(), cols), "another dtype or shape than in the model"));
}

TEST(DenseGather, PackedValuesLandWhereTheLayoutSays) {
  // A 2-D tensor in column shards over 3 ranks, gathered in two segments.
  const std::vector<int64_t> shape = {9, 10};
  std::vector<uint16_t> full(90);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<uint16_t>(1000 + i);
  std::vector<std::vector<ShardSpec>> by_rank(3);
  std::vector<std::vector<uint8_t>> locals(3);
  for (int r = 0; r < 3; ++r) {
    by_rank[r].push_back(Spec(ShardSpec::Shard("w", DType::kBF16, shape, 1, r, 3)));
    const ShardSpec& s = by_rank[r][0];
    locals[r].resize(s.local_numel() * 2);
    for (const auto& [hf, local] : PieceElements(s, 0)) {
      std::memcpy(locals[r].data() + local * 2, &full[hf], 2);
    }
  }
  const std::vector<Segment> segments = {{"w", 0, 37, 2}, {"w", 37, 53, 2}};
  std::vector<std::vector<uint8_t>> buffers = {std::vector<uint8_t>(37 * 2),
                                               std::vector<uint8_t>(53 * 2)};
  std::vector<std::span<uint8_t>> spans(buffers.begin(), buffers.end());
  for (int r = 0; r < 3; ++r) {
    const PiecesByTensor pieces = ContributingPieces(by_rank[r]);
    std::vector<std::span<const uint8_t>> data = {locals[r]};
    std::vector<uint8_t> message;
    PackDense(by_rank[r], pieces, data, segments, &message);
    EXPECT_EQ(message.size(), DenseBytes(by_rank[r], pieces, segments));
    UnpackDense(by_rank[r], pieces, message, segments, spans);
  }
  EXPECT_EQ(std::memcmp(buffers[0].data(), full.data(), 37 * 2), 0);
  EXPECT_EQ(std::memcmp(buffers[1].data(), full.data() + 37, 53 * 2), 0);
}

TEST(Layout, TheExchangeBringsEveryLayoutToRankZeroAndARefusalFailsIt) {
  comm_test::TempDir dir;
  const int n = 3;
  for (const bool refuse : {false, true}) {
    SCOPED_TRACE(refuse ? "a rank refuses" : "every rank sends");
    std::vector<Status> errors;
    std::vector<std::unique_ptr<Communicator>> comms = comm_test::FormInThreads(
        n,
        [&](int r) {
          return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir.path()), r, n,
                                            std::chrono::milliseconds(5000),
                                            refuse ? "refuse" : "send");
        },
        &errors);
    for (const Status& e : errors) ASSERT_TRUE(e.ok()) << e.ToString();
    std::vector<Result<std::vector<std::vector<ShardSpec>>>> got(n, Status::Internal("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        std::vector<ShardSpec> mine = {Spec(ShardSpec::Shard("w", DType::kBF16, {12, 8}, 0, r, n))};
        const Status refusal = refuse && r == 2 ? Status::InvalidArgument("bad shard") : Status();
        got[r] = ExchangeLayout(*comms[r], mine, refusal);
      });
    }
    for (std::thread& t : threads) t.join();
    if (!refuse) {
      ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
      ASSERT_EQ(got[0]->size(), 3u);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ((*got[0])[r][0].pieces[0].hf_offset[0], 4 * r);
      }
      EXPECT_TRUE(got[1].ok() && got[1]->empty());
      continue;
    }
    EXPECT_TRUE(Contains(got[0].status(), "rank 2 refused its own shards"))
        << got[0].status().ToString();
    EXPECT_TRUE(Contains(got[2].status(), "bad shard"));
    EXPECT_TRUE(got[1].ok());
    // The group stays usable.
    for (const auto& c : comms) EXPECT_TRUE(c->health().ok());
  }
}

}  // namespace
}  // namespace deltasync::stream
