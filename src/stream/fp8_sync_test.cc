// The stream with FP8 element types: block-scaled FP8 layers (F8_E4M3
// weights, F8_E8M0 block scales, F32 per-tensor scales) re-quantized at
// each step reach every receiver bit-exactly, from one sender in each
// stream encoding and from a sharded trainer whose ranks each hold a slice
// of the weights and of their scales.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/fp8_test_util.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "stream/sync_rig.h"
#include "stream/sync_test_util.h"

namespace deltasync {
namespace {

using namespace sync_rig;

const char* const kLayers[] = {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"};

// Both layers at optimizer step `step`.
std::vector<fp8_test::Tensor> Layers(int step) {
  std::vector<fp8_test::Tensor> out;
  uint64_t seed = 3;
  for (const char* layer : kLayers) {
    for (fp8_test::Tensor& t : fp8_test::BlockScaledLayer(layer, seed++, step)) {
      out.push_back(std::move(t));
    }
  }
  return out;
}

// A Model of the layers at step 0 (the receivers register its tensors).
Model Fp8Model() {
  std::vector<Model::Spec> specs;
  for (const fp8_test::Tensor& t : Layers(0)) specs.emplace_back(t.name, t.dtype, t.shape);
  Model m = Model::Make(1, specs);
  return m;
}

// Puts step `step`'s bytes into `m`, in place.
void SetStep(Model* m, int step) {
  std::vector<fp8_test::Tensor> layers = Layers(step);
  ASSERT_EQ(layers.size(), m->bytes.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    ASSERT_EQ(m->tensors[i].name, layers[i].name);
    m->bytes[i] = std::move(layers[i].bytes);
  }
  m->Rebind();
}

class Fp8Sync : public SyncTest, public ::testing::WithParamInterface<StreamEncoding> {};

TEST_P(Fp8Sync, EveryStepReachesEveryReceiverBitExact) {
  SetUpGroup(2);
  Model m = Fp8Model();
  SenderOptions o;
  o.encoding = GetParam();
  o.bucket_bytes = 64 << 10;  // a 64 KiB FP8 weight fills more than one frame
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ASSERT_NE(sender, nullptr);
  ReceiverRig first(m, Hold::kWhole, Factory(1));
  ReceiverRig second(m, Hold::kWhole, Factory(2));
  first.Start();
  second.Start();
  std::vector<uint8_t> previous_scales;
  for (int step = 0; step <= 3; ++step) {
    SetStep(&m, step);
    // The data moves as a re-quantizing trainer's does: block (1, 1)'s
    // ue8m0 scale goes up by one each step.
    if (step > 0) {
      EXPECT_EQ(m.bytes[1][3], previous_scales[3] + 1) << "step " << step;
    }
    previous_scales = m.bytes[1];
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_TRUE(first.Matches(m).ok()) << "step " << step << ": " << first.Matches(m).ToString();
    EXPECT_TRUE(second.Matches(m).ok()) << "step " << step << ": " << second.Matches(m).ToString();
  }
  Finish(sender, {&first, &second});
  // Each receiver took the four syncs (what follows is the sender leaving).
  for (ReceiverRig* r : {&first, &second}) {
    const std::vector<Status> results = r->results();
    ASSERT_GE(results.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(results[i].ok()) << results[i].ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, Fp8Sync,
                         ::testing::Values(StreamEncoding::kDense, StreamEncoding::kIndices,
                                           StreamEncoding::kSparse),
                         [](const ::testing::TestParamInfo<StreamEncoding>& info) {
                           return std::string(StreamEncodingName(info.param));
                         });

// Two trainer ranks each hold half of every weight's rows and the matching
// row of its 2x2 block scales (the gather carries their dtypes by code);
// the per-tensor scales are replicated and rank 1 sends them.
TEST_F(SyncTest, ShardedFp8LayersSyncBitExact) {
  SetUpGroup(1);
  Model m = Fp8Model();
  std::vector<ModelTensor> model;
  for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
  constexpr int kRanks = 2;
  std::vector<std::unique_ptr<StreamSender>> ranks =
      ShardedRanks(kRanks, [](int, SenderOptions*) {});
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kRanks));
  ReceiverRig whole(m, Hold::kWhole, Factory(1));
  whole.Start();
  for (int step = 0; step <= 2; ++step) {
    SetStep(&m, step);
    const std::vector<Status> results = SyncRowShards(ranks, model, m);
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(results[r].ok())
          << "step " << step << " rank " << r << ": " << results[r].ToString();
    }
    EXPECT_TRUE(whole.Matches(m).ok()) << "step " << step << ": " << whole.Matches(m).ToString();
  }
  whole.RequestStop();
  ranks.clear();
  whole.Stop();
}

}  // namespace
}  // namespace deltasync
