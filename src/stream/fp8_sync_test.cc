// The stream with FP8 element types: block-scaled FP8 layers (F8_E4M3
// weights, F8_E8M0 block scales, F32 per-tensor scales) re-quantized at
// each step reach every receiver bit-exactly, from one sender in each
// stream encoding and from a sharded trainer whose ranks each hold a slice
// of the weights and of their scales.

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_test_util.h"
#include "deltasync/quantize.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "stream/sync_rig.h"
#include "stream/sync_test_util.h"
#include "synth/bf16.h"

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

// The receivers' FP8 copy of BF16 weights, quantized on the trainer at each
// step and diffed there (quantize-then-diff): every receiver ends each step
// with exactly the bytes that quantizing the trainer's weights gives, codes
// and scales, for every recipe the engines use. The weights move as AdamW
// moves them (a small step on every element, so a few percent of the E4M3
// codes change), and one block's range grows each step, so its scale and
// all of its codes change.
struct QuantCase {
  QuantRecipe recipe;
  const char* scale_suffix;
};

class QuantizeThenDiff : public SyncTest, public ::testing::WithParamInterface<QuantCase> {};

TEST_P(QuantizeThenDiff, ReceiversHoldTheTrainersWeightsQuantized) {
  const QuantRecipe recipe = GetParam().recipe;
  // Not multiples of 128: the edge blocks are partial.
  const std::vector<std::vector<int64_t>> shapes = {{300, 200}, {129, 640}};
  std::mt19937_64 rng(11);
  std::normal_distribution<float> init(0.0f, 0.02f), step(0.0f, 2e-4f);
  std::vector<std::vector<float>> master;  // the trainer's fp32 masters
  std::vector<Model::Spec> specs;
  for (size_t t = 0; t < shapes.size(); ++t) {
    const std::string name = "model.layers." + std::to_string(t) + ".mlp.up_proj.weight";
    std::vector<float>& w = master.emplace_back(shapes[t][0] * shapes[t][1]);
    for (float& x : w) x = init(rng);
    const std::vector<int64_t> scale_shape = *QuantScaleShape(recipe, shapes[t][0], shapes[t][1]);
    specs.emplace_back(name, DType::kF8_E4M3, shapes[t]);
    specs.emplace_back(name + GetParam().scale_suffix, QuantScaleDType(recipe.scale_format),
                       scale_shape);
  }
  Model m = Model::Make(1, specs);
  // The BF16 weights of the masters (as torch casts them), quantized
  // into the model's code and scale tensors.
  const auto quantize_into = [&](Model* into) {
    for (size_t t = 0; t < shapes.size(); ++t) {
      std::vector<uint16_t> bf16(master[t].size());
      for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = synth::FloatToBf16(master[t][i]);
      const QuantTensor tensor{std::get<0>(specs[2 * t]), DType::kBF16, shapes[t]};
      ASSERT_TRUE(Fp8Quantize(recipe, tensor, bf16.data(), into->bytes[2 * t].data(),
                              into->bytes[2 * t + 1].data())
                      .ok());
    }
    into->Rebind();
  };
  SetUpGroup(2);
  SenderOptions o;
  o.encoding = StreamEncoding::kIndices;
  o.bucket_bytes = 64 << 10;
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ASSERT_NE(sender, nullptr);
  quantize_into(&m);
  ReceiverRig first(m, Hold::kWhole, Factory(1));
  ReceiverRig second(m, Hold::kWhole, Factory(2));
  first.Start();
  second.Start();
  uint64_t code_changes = 0, codes = 0;
  for (int s = 0; s <= 3; ++s) {
    if (s > 0) {
      for (std::vector<float>& w : master) {
        for (float& x : w) x += step(rng);
        w[0] *= 2.0f;  // block (0, 0)'s (and row 0's) range grows
      }
    }
    const std::vector<std::vector<uint8_t>> before = m.bytes;
    quantize_into(&m);
    if (s > 0) {
      for (size_t t = 0; t < shapes.size(); ++t) {
        for (size_t i = 0; i < m.bytes[2 * t].size(); ++i) {
          code_changes += m.bytes[2 * t][i] != before[2 * t][i];
        }
        codes += m.bytes[2 * t].size();
      }
    }
    Result<SyncStats> r = sender->Sync(m.tensors);
    ASSERT_TRUE(r.ok()) << "step " << s << ": " << r.status().ToString();
    EXPECT_TRUE(first.Matches(m).ok()) << "step " << s << ": " << first.Matches(m).ToString();
    EXPECT_TRUE(second.Matches(m).ok()) << "step " << s << ": " << second.Matches(m).ToString();
  }
  // A delta, not a resend: some codes changed, most did not.
  EXPECT_GT(code_changes, 0u);
  EXPECT_LT(code_changes, codes / 2);
  Finish(sender, {&first, &second});
}

// The same with the sender quantizing (SenderOptions::quantize): it is
// given the BF16 weights each step, and the receivers, which hold codes and
// scales, end every step with exactly what quantizing them gives.
TEST_P(QuantizeThenDiff, TheSenderQuantizesTheTrainersBf16Weights) {
  const QuantRecipe recipe = GetParam().recipe;
  const std::vector<std::vector<int64_t>> shapes = {{300, 200}, {129, 640}};
  std::mt19937_64 rng(12);
  std::normal_distribution<float> init(0.0f, 0.02f), step(0.0f, 2e-4f);
  std::vector<std::vector<float>> master;
  std::vector<Model::Spec> specs;
  SenderOptions o;
  o.encoding = StreamEncoding::kIndices;
  o.bucket_bytes = 64 << 10;
  for (size_t t = 0; t < shapes.size(); ++t) {
    const std::string name = "model.layers." + std::to_string(t) + ".mlp.up_proj.weight";
    std::vector<float>& w = master.emplace_back(shapes[t][0] * shapes[t][1]);
    for (float& x : w) x = init(rng);
    specs.emplace_back(name, DType::kF8_E4M3, shapes[t]);
    specs.emplace_back(name + GetParam().scale_suffix, QuantScaleDType(recipe.scale_format),
                       *QuantScaleShape(recipe, shapes[t][0], shapes[t][1]));
    // The DeepSeek-V3 default name for one, a name of its own for the other.
    const bool default_name = std::string(GetParam().scale_suffix) == "_scale_inv";
    o.quantize[name] = {recipe, default_name ? "" : name + GetParam().scale_suffix};
  }
  specs.emplace_back("model.norm.weight", DType::kBF16, std::vector<int64_t>{200});
  Model want = Model::Make(2, specs);  // what the receivers must hold
  std::vector<std::vector<uint16_t>> bf16(shapes.size());
  std::vector<SyncTensor> given;  // what the sender is given
  for (size_t t = 0; t < shapes.size(); ++t) {
    bf16[t].resize(master[t].size());
    given.push_back({std::get<0>(specs[2 * t]), DType::kBF16, shapes[t], {}, {}});
  }
  given.push_back(want.tensors.back());  // sent as it is
  const auto step_to = [&]() {
    for (size_t t = 0; t < shapes.size(); ++t) {
      for (size_t i = 0; i < bf16[t].size(); ++i) bf16[t][i] = synth::FloatToBf16(master[t][i]);
      given[t].data = {reinterpret_cast<const uint8_t*>(bf16[t].data()), bf16[t].size() * 2};
      ASSERT_TRUE(Fp8Quantize(recipe, {given[t].name, DType::kBF16, shapes[t]}, bf16[t].data(),
                              want.bytes[2 * t].data(), want.bytes[2 * t + 1].data())
                      .ok());
    }
    want.Rebind();
  };
  SetUpGroup(2);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ASSERT_NE(sender, nullptr);
  ReceiverRig first(want, Hold::kWhole, Factory(1));
  ReceiverRig second(want, Hold::kWhole, Factory(2));
  first.Start();
  second.Start();
  uint64_t sent = 0;
  for (int s = 0; s <= 3; ++s) {
    if (s > 0) {
      for (std::vector<float>& w : master) {
        for (float& x : w) x += step(rng);
        w[0] *= 2.0f;
      }
    }
    step_to();
    Result<SyncStats> r = sender->Sync(given);
    ASSERT_TRUE(r.ok()) << "step " << s << ": " << r.status().ToString();
    EXPECT_TRUE(first.Matches(want).ok()) << "step " << s << ": " << first.Matches(want).ToString();
    EXPECT_TRUE(second.Matches(want).ok())
        << "step " << s << ": " << second.Matches(want).ToString();
    // The snapshot is of the quantized state.
    Result<std::span<const uint8_t>> snap = sender->Snapshot(given[0].name);
    ASSERT_TRUE(snap.ok()) << snap.status().ToString();
    EXPECT_TRUE(std::equal(snap->begin(), snap->end(), want.bytes[0].begin(), want.bytes[0].end()));
    EXPECT_GT(r->quantize_s, 0.0);
    EXPECT_LE(r->quantize_s, r->total_s);
    if (s > 0) {
      sent += r->sent_elements;
      EXPECT_GT(r->changed, 0u);
    }
  }
  uint64_t codes = 0;
  for (const auto& shape : shapes) codes += shape[0] * shape[1];
  EXPECT_LT(sent, 3 * codes / 2) << "a delta, not a resend";
  Finish(sender, {&first, &second});
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, QuantizeThenDiff,
    ::testing::Values(QuantCase{{QuantScheme::kBlock128, ScaleFormat::kF32}, "_scale_inv"},
                      QuantCase{{QuantScheme::kBlock128, ScaleFormat::kUe8m0}, "_scale_inv"},
                      QuantCase{{QuantScheme::kPerTensor, ScaleFormat::kF32}, "_scale"},
                      QuantCase{{QuantScheme::kPerChannel, ScaleFormat::kF32}, "_scale"}),
    [](const ::testing::TestParamInfo<QuantCase>& info) {
      return std::string(QuantSchemeName(info.param.recipe.scheme)) + "_" +
             std::string(ScaleFormatName(info.param.recipe.scale_format));
    });

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

namespace deltasync {
namespace {

using namespace sync_rig;

// A quantized send the recipe cannot take fails the sync before anything is
// sent, naming the tensor; the receivers keep what they held, and the next
// good sync goes through. Options that cannot work are refused at Create.
TEST_F(SyncTest, AQuantizedSendOfABadWeightIsRefusedByNameAndSendsNothing) {
  const QuantRecipe recipe{QuantScheme::kBlock128, ScaleFormat::kUe8m0};
  const std::vector<int64_t> shape = {130, 260};
  Model want = Model::Make(3, {{"w", DType::kF8_E4M3, shape},
                               {"w_scale_inv", DType::kF8_E8M0, std::vector<int64_t>{2, 3}}});
  std::vector<uint16_t> bf16(130 * 260);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> init(0.0f, 0.02f);
  for (uint16_t& x : bf16) x = synth::FloatToBf16(init(rng));
  SyncTensor given{"w", DType::kBF16, shape, {}, {}};
  given.data = {reinterpret_cast<const uint8_t*>(bf16.data()), bf16.size() * 2};
  ASSERT_TRUE(Fp8Quantize(recipe, {"w", DType::kBF16, shape}, bf16.data(), want.bytes[0].data(),
                          want.bytes[1].data())
                  .ok());
  want.Rebind();
  SenderOptions o;
  o.quantize["w"] = {recipe, ""};
  SetUpGroup(1);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ASSERT_NE(sender, nullptr);
  ReceiverRig rx(want, Hold::kWhole, Factory(1));
  rx.Start();
  ASSERT_TRUE(sender->Sync({&given, 1}).ok());
  ASSERT_TRUE(rx.Matches(want).ok());

  const uint16_t saved = bf16[777];
  bf16[777] = 0x7F80;  // +inf
  Result<SyncStats> bad = sender->Sync({&given, 1});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status(), "'w'")) << bad.status().ToString();
  EXPECT_TRUE(Contains(bad.status(), "NaN or an infinity")) << bad.status().ToString();
  EXPECT_EQ(sender->committed_sync_id(), 1u);
  EXPECT_TRUE(rx.Matches(want).ok());

  SyncTensor flat = given;
  flat.shape = {130 * 260};
  bad = sender->Sync({&flat, 1});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status(), "2-D")) << bad.status().ToString();
  SyncTensor other = given;
  other.name = "v";
  bad = sender->Sync({&other, 1});
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(bad.status(), "'w'")) << bad.status().ToString();

  bf16[777] = saved;
  bf16[5] ^= 0x40;
  ASSERT_TRUE(Fp8Quantize(recipe, {"w", DType::kBF16, shape}, bf16.data(), want.bytes[0].data(),
                          want.bytes[1].data())
                  .ok());
  want.Rebind();
  Result<SyncStats> good = sender->Sync({&given, 1});
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_TRUE(rx.Matches(want).ok()) << rx.Matches(want).ToString();
  Finish(sender, {&rx});
}

TEST(QuantizedSendOptions, RecipesAndNamesThatCannotWorkAreRefusedAtCreate) {
  const CommunicatorFactory none = []() -> Result<std::unique_ptr<Communicator>> {
    return Status::Unavailable("not used");
  };
  SenderOptions o;
  o.quantize["w"] = {{QuantScheme::kPerTensor, ScaleFormat::kUe8m0}, ""};
  EXPECT_EQ(StreamSender::Create(none, o).status().code(), StatusCode::kInvalidArgument);
  o.quantize["w"] = {{QuantScheme::kBlock128, ScaleFormat::kF32}, "w"};
  Result<std::unique_ptr<StreamSender>> r = StreamSender::Create(none, o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status(), "name of their own")) << r.status().ToString();
  o.quantize["w"] = {{QuantScheme::kBlock128, ScaleFormat::kF32}, ""};
  EXPECT_TRUE(StreamSender::Create(none, o).ok());
  r = StreamSender::CreateSharded(none, none, o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status(), "Fp8QuantizeShard")) << r.status().ToString();
}

}  // namespace
}  // namespace deltasync
