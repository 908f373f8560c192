#include "deltasync/synth.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>

#include "deltasync/checkpoint.h"
#include "synth/bf16.h"

namespace deltasync {
namespace {

using synth::Bf16ToFloat;
using synth::FloatToBf16;

uint16_t CastBits(uint32_t float_bits) { return FloatToBf16(std::bit_cast<float>(float_bits)); }

// --- BF16 cast ---------------------------------------------------------------

TEST(Bf16Test, RoundsToNearestTiesToEven) {
  EXPECT_EQ(CastBits(0x3F800000), 0x3F80);  // 1.0 exact
  EXPECT_EQ(CastBits(0x3F807FFF), 0x3F80);  // just below the midpoint
  EXPECT_EQ(CastBits(0x3F808000), 0x3F80);  // midpoint, kept half even: down
  EXPECT_EQ(CastBits(0x3F808001), 0x3F81);  // just above the midpoint
  EXPECT_EQ(CastBits(0x3F818000), 0x3F82);  // midpoint, kept half odd: up
  EXPECT_EQ(CastBits(0xBF818000), 0xBF82);  // same, negative
  EXPECT_EQ(CastBits(0x3FFF8000), 0x4000);  // carry into the exponent: 1.99.. -> 2.0
  EXPECT_EQ(CastBits(0x80000000), 0x8000);  // -0.0 keeps its sign
}

TEST(Bf16Test, OverflowRoundsToInfinity) {
  EXPECT_EQ(CastBits(0x7F7F7FFF), 0x7F7F);  // stays the largest finite BF16
  EXPECT_EQ(CastBits(0x7F7F8000), 0x7F80);  // tie with odd kept half: up to +inf
  EXPECT_EQ(CastBits(0x7F7FFFFF), 0x7F80);  // FLT_MAX -> +inf
  EXPECT_EQ(CastBits(0xFF7FFFFF), 0xFF80);  // -FLT_MAX -> -inf
  EXPECT_EQ(CastBits(0x7F800000), 0x7F80);  // +inf stays
  EXPECT_EQ(CastBits(0xFF800000), 0xFF80);  // -inf stays
}

TEST(Bf16Test, NanStaysQuietNan) {
  EXPECT_EQ(CastBits(0x7FC00000), 0x7FC0);  // canonical quiet NaN
  EXPECT_EQ(CastBits(0xFFC00000), 0xFFC0);
  EXPECT_EQ(CastBits(0x7F800001), 0x7FC0);  // payload only in the dropped half: not inf
  EXPECT_EQ(CastBits(0xFF800001), 0xFFC0);
  EXPECT_EQ(CastBits(0x7F810000), 0x7FC1);  // signalling NaN is quieted, payload kept
  EXPECT_EQ(CastBits(0x7FFFFFFF), 0x7FFF);  // no carry into the sign bit
  EXPECT_EQ(CastBits(0xFFFFFFFF), 0xFFFF);
}

TEST(Bf16Test, Subnormals) {
  EXPECT_EQ(CastBits(0x00000001), 0x0000);  // smallest f32 subnormal rounds to +0
  EXPECT_EQ(CastBits(0x00008000), 0x0000);  // tie, even: down
  EXPECT_EQ(CastBits(0x00008001), 0x0001);  // smallest BF16 subnormal
  EXPECT_EQ(CastBits(0x00018000), 0x0002);  // tie, odd: up
  EXPECT_EQ(CastBits(0x807FFFFF), 0x8080);  // largest subnormal rounds up to -FLT_MIN
  EXPECT_EQ(CastBits(0x00400000), 0x0040);  // exact subnormal
}

TEST(Bf16Test, EveryBf16RoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    const uint16_t back = FloatToBf16(f);
    if (std::isnan(f)) {
      EXPECT_EQ(back, b | 0x0040) << b;
    } else {
      EXPECT_EQ(back, b) << b;
    }
  }
}

// Independent reference: pick the nearer of the two BF16 neighbours using
// exact double arithmetic, ties to the even one.
uint16_t ReferenceRound(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t down = static_cast<uint16_t>(bits >> 16);  // truncation toward zero
  if ((bits & 0xFFFF) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);  // next magnitude away from zero
  const double x = f;
  const double lo = Bf16ToFloat(down);
  // A next magnitude with an all-ones exponent is infinity; in double the
  // rounding boundary there is FLT_MAX rounded at BF16 precision, 2^128.
  const double hi = (up & 0x7F80) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), x)
                                            : static_cast<double>(Bf16ToFloat(up));
  const double dlo = std::fabs(x - lo), dhi = std::fabs(hi - x);
  if (dlo < dhi) return down;
  if (dhi < dlo) return up;
  return (down & 1) ? up : down;
}

TEST(Bf16Test, MatchesExactReferenceOnRandomFloats) {
  std::mt19937_64 rng(12345);
  int checked = 0;
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    const float f = std::bit_cast<float>(bits);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(FloatToBf16(f), ReferenceRound(f)) << std::hex << bits;
    ++checked;
  }
  EXPECT_GT(checked, 900000);
}

// --- Presets -----------------------------------------------------------------

std::map<std::string, std::vector<int64_t>> ShapesByName(const std::vector<SynthTensorSpec>& s) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const SynthTensorSpec& t : s) out[t.name] = t.shape;
  return out;
}

TEST(SynthPresetTest, Qwen25HalfBillionMatchesPublishedModel) {
  auto specs = SynthPresetSpecs("qwen2.5-0.5b");
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  // Qwen2.5-0.5B's published parameter count (model card: 0.49B;
  // sum of its safetensors shapes: 494,032,768).
  EXPECT_EQ(SynthParameterCount(*specs), 494032768);
  EXPECT_EQ(specs->size(), 1u + 24 * 12 + 1);
  auto shapes = ShapesByName(*specs);
  EXPECT_EQ(shapes.size(), specs->size()) << "duplicate names";
  using S = std::vector<int64_t>;
  EXPECT_EQ(shapes["model.embed_tokens.weight"], (S{151936, 896}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.q_proj.weight"], (S{896, 896}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.q_proj.bias"], (S{896}));
  EXPECT_EQ(shapes["model.layers.7.self_attn.k_proj.weight"], (S{128, 896}));
  EXPECT_EQ(shapes["model.layers.7.self_attn.v_proj.bias"], (S{128}));
  EXPECT_EQ(shapes["model.layers.23.self_attn.o_proj.weight"], (S{896, 896}));
  EXPECT_EQ(shapes["model.layers.23.mlp.gate_proj.weight"], (S{4864, 896}));
  EXPECT_EQ(shapes["model.layers.23.mlp.up_proj.weight"], (S{4864, 896}));
  EXPECT_EQ(shapes["model.layers.23.mlp.down_proj.weight"], (S{896, 4864}));
  EXPECT_EQ(shapes["model.layers.23.input_layernorm.weight"], (S{896}));
  EXPECT_EQ(shapes["model.layers.23.post_attention_layernorm.weight"], (S{896}));
  EXPECT_EQ(shapes["model.norm.weight"], (S{896}));
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u) << "0.5B ties its embeddings";
  EXPECT_EQ(shapes.count("model.layers.24.mlp.up_proj.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.o_proj.bias"), 0u);
}

TEST(SynthPresetTest, Qwen25OneAndAHalfBillionMatchesPublishedModel) {
  auto specs = SynthPresetSpecs("qwen2.5-1.5b");
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  EXPECT_EQ(SynthParameterCount(*specs), 1543714304);  // published: 1.54B
  auto shapes = ShapesByName(*specs);
  using S = std::vector<int64_t>;
  EXPECT_EQ(shapes["model.layers.27.self_attn.k_proj.weight"], (S{256, 1536}));
  EXPECT_EQ(shapes["model.layers.27.mlp.down_proj.weight"], (S{1536, 8960}));
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u);
}

TEST(SynthPresetTest, Qwen3MoeHasEveryExpertProjectionAsItsCheckpointNamesThem) {
  auto specs = SynthPresetSpecs("qwen3-30b-a3b");
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  EXPECT_EQ(SynthParameterCount(*specs), 30532122624);  // published: 30.5B
  auto shapes = ShapesByName(*specs);
  using S = std::vector<int64_t>;
  size_t experts = 0;
  for (const SynthTensorSpec& t : *specs) experts += t.name.find(".experts.") != std::string::npos;
  EXPECT_EQ(experts, 48u * 128 * 3);
  EXPECT_EQ(shapes["model.layers.47.mlp.experts.127.gate_proj.weight"], (S{768, 2048}));
  EXPECT_EQ(shapes["model.layers.0.mlp.experts.0.down_proj.weight"], (S{2048, 768}));
  EXPECT_EQ(shapes["model.layers.0.mlp.gate.weight"], (S{128, 2048}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.q_proj.weight"], (S{4096, 2048}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.o_proj.weight"], (S{2048, 4096}));
  EXPECT_EQ(shapes["model.layers.0.self_attn.k_norm.weight"], (S{128}));
  EXPECT_EQ(shapes.count("model.layers.0.mlp.up_proj.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.bias"), 0u);
  EXPECT_EQ(shapes["lm_head.weight"], (S{151936, 2048}));
  // Scaled to fit, the experts stay: only their widths shrink.
  Result<double> scale = SynthScaleForBytes("qwen3-30b-a3b", uint64_t{512} << 20);
  ASSERT_TRUE(scale.ok()) << scale.status().ToString();
  auto small = SynthPresetSpecs("qwen3-30b-a3b", *scale);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->size(), specs->size());
  // Within 15%: every step of 64 in an expert's width moves 18,432 tensors.
  EXPECT_NEAR(static_cast<double>(SynthBf16Bytes(*small)), 512.0 * (1 << 20), 0.15 * (512 << 20));
}

TEST(SynthPresetTest, TinyIsAboutTenMegabytesWithUntiedHead) {
  auto specs = SynthPresetSpecs("tiny");
  ASSERT_TRUE(specs.ok());
  EXPECT_GT(SynthBf16Bytes(*specs), 9u << 20);
  EXPECT_LT(SynthBf16Bytes(*specs), 11u << 20);
  auto shapes = ShapesByName(*specs);
  EXPECT_EQ(shapes["lm_head.weight"], shapes["model.embed_tokens.weight"]);
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.k_proj.bias"), 1u);
  for (const SynthTensorSpec& s : *specs) {
    if (s.kind == SynthTensorKind::kNorm) {
      EXPECT_EQ(s.init_mean, 1.0f) << s.name;
    }
  }
}

TEST(SynthPresetTest, ScaleShrinksDimensionsToMultiplesOf64AndKeepsLayers) {
  auto full = SynthPresetSpecs("qwen2.5-0.5b", 1.0);
  auto half = SynthPresetSpecs("qwen2.5-0.5b", 0.5);
  ASSERT_TRUE(full.ok() && half.ok());
  ASSERT_EQ(full->size(), half->size());
  for (size_t i = 0; i < half->size(); ++i) {
    EXPECT_EQ((*half)[i].name, (*full)[i].name);
    for (int64_t d : (*half)[i].shape) EXPECT_EQ(d % 64, 0) << (*half)[i].name;
  }
  auto shapes = ShapesByName(*half);
  using S = std::vector<int64_t>;
  EXPECT_EQ(shapes["model.embed_tokens.weight"], (S{75968, 448}));
  EXPECT_EQ(shapes["model.layers.3.mlp.down_proj.weight"], (S{448, 2432}));
  EXPECT_EQ(shapes["model.layers.3.self_attn.k_proj.weight"], (S{64, 448}));
  // Sizes about a quarter of the full model.
  const double ratio = static_cast<double>(SynthBf16Bytes(*half)) / SynthBf16Bytes(*full);
  EXPECT_NEAR(ratio, 0.25, 0.02);
  // The smallest scales clamp every dimension at 64.
  auto smallest = SynthPresetSpecs("qwen2.5-0.5b", 1e-6);
  ASSERT_TRUE(smallest.ok());
  EXPECT_EQ(ShapesByName(*smallest)["model.embed_tokens.weight"], (S{64, 64}));
}

TEST(SynthPresetTest, RejectsUnknownPresetAndBadScale) {
  auto unknown = SynthPresetSpecs("llama-70b");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(unknown.status().IsInvalidArgument());
  EXPECT_NE(unknown.status().message().find("llama-70b"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("qwen2.5-0.5b"), std::string::npos);
  for (double scale : {0.0, -1.0, kMaxSynthScale * 1.01, std::numeric_limits<double>::quiet_NaN(),
                       std::numeric_limits<double>::infinity()}) {
    auto r = SynthPresetSpecs("tiny", scale);
    ASSERT_FALSE(r.ok()) << scale;
    EXPECT_TRUE(r.status().IsInvalidArgument());
    EXPECT_NE(r.status().message().find("scale"), std::string::npos);
  }
  EXPECT_EQ(SynthPresetNames(),
            (std::vector<std::string>{"tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-30b-a3b"}));
}

uint64_t BytesAtScale(const std::string& preset, double scale) {
  return SynthBf16Bytes(*SynthPresetSpecs(preset, scale));
}

uint64_t AbsDiff(uint64_t a, uint64_t b) { return a > b ? a - b : b - a; }

TEST(SynthPresetTest, ScaleForBytesFindsTheClosestSize) {
  for (uint64_t target : {512ull << 20, 1ull << 30, 100ull << 20}) {
    auto scale = SynthScaleForBytes("qwen2.5-0.5b", target);
    ASSERT_TRUE(scale.ok()) << scale.status().ToString();
    const uint64_t got = BytesAtScale("qwen2.5-0.5b", *scale);
    EXPECT_LT(AbsDiff(got, target), target / 100) << target;
    // No scale on a fine grid does better.
    for (double s = 0.2; s <= 1.6; s += 0.0005) {
      ASSERT_GE(AbsDiff(BytesAtScale("qwen2.5-0.5b", s), target), AbsDiff(got, target))
          << "target " << target << " scale " << s << " beats " << *scale;
    }
  }
  // A target below the smallest model gives the smallest model.
  auto floor = SynthScaleForBytes("tiny", 1);
  ASSERT_TRUE(floor.ok());
  EXPECT_EQ(BytesAtScale("tiny", *floor), BytesAtScale("tiny", 1e-9));

  EXPECT_TRUE(SynthScaleForBytes("tiny", 0).status().IsInvalidArgument());
  EXPECT_TRUE(SynthScaleForBytes("nope", 1 << 20).status().IsInvalidArgument());
  EXPECT_EQ(SynthScaleForBytes("tiny", 1ull << 50).status().code(), StatusCode::kOutOfRange);
}

// --- Trainer -----------------------------------------------------------------

SynthConfig TinyConfig(uint64_t seed = 7, double lr = 1e-6, size_t threads = 0) {
  SynthConfig c;
  c.preset = "tiny";
  c.seed = seed;
  c.lr = lr;
  c.num_threads = threads;
  return c;
}

std::unique_ptr<SynthTrainer> MakeTrainer(const SynthConfig& c) {
  auto t = SynthTrainer::Create(c);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// All weights as one byte string, in order.
std::string Snapshot(const SynthTrainer& t) {
  std::string out;
  for (const TensorView& v : t.Weights()) {
    out.append(reinterpret_cast<const char*>(v.bytes.data()), v.bytes.size());
  }
  return out;
}

std::vector<uint16_t> AsBf16(const TensorView& v) {
  std::vector<uint16_t> out(v.bytes.size() / 2);
  std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
  return out;
}

TEST(SynthTrainerTest, RejectsBadConfigNamingTheField) {
  struct Case {
    const char* field;
    void (*mutate)(SynthConfig&);
  };
  const Case cases[] = {
      {"lr", [](SynthConfig& c) { c.lr = -1; }},
      {"lr", [](SynthConfig& c) { c.lr = std::numeric_limits<double>::quiet_NaN(); }},
      {"beta1", [](SynthConfig& c) { c.beta1 = 1.0; }},
      {"beta2", [](SynthConfig& c) { c.beta2 = -0.1; }},
      {"eps", [](SynthConfig& c) { c.eps = 0; }},
      {"weight_decay", [](SynthConfig& c) { c.weight_decay = -0.01; }},
      {"grad_correlation", [](SynthConfig& c) { c.grad_correlation = 1.5; }},
      {"direction_period", [](SynthConfig& c) { c.direction_period = 0; }},
      {"preset", [](SynthConfig& c) { c.preset = "gpt-5"; }},
      {"scale", [](SynthConfig& c) { c.scale = 0; }},
  };
  for (const Case& k : cases) {
    SynthConfig c = TinyConfig();
    k.mutate(c);
    auto t = SynthTrainer::Create(c);
    ASSERT_FALSE(t.ok()) << k.field;
    EXPECT_TRUE(t.status().IsInvalidArgument()) << t.status().ToString();
    EXPECT_NE(t.status().message().find(k.field == std::string("preset") ? "gpt-5" : k.field),
              std::string::npos)
        << t.status().ToString();
  }
}

TEST(SynthTrainerTest, InitialWeightsLookLikeACheckpoint) {
  auto t = MakeTrainer(TinyConfig());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->step(), 0);
  const auto views = t->Weights();
  ASSERT_EQ(views.size(), t->specs().size());
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView& v = views[i];
    const SynthTensorSpec& spec = t->specs()[i];
    ASSERT_TRUE(v.Validate().ok()) << v.name;
    EXPECT_EQ(v.name, spec.name);
    EXPECT_EQ(v.dtype, DType::kBF16);
    EXPECT_EQ(v.shape, spec.shape);
    double sum = 0, sum_sq = 0;
    const std::vector<uint16_t> w = AsBf16(v);
    for (uint16_t b : w) {
      const double x = Bf16ToFloat(b);
      ASSERT_TRUE(std::isfinite(x)) << v.name;
      sum += x;
      sum_sq += x * x;
    }
    const double mean = sum / w.size();
    const double stddev = std::sqrt(sum_sq / w.size() - mean * mean);
    EXPECT_NEAR(mean, spec.init_mean, 4 * spec.init_std / std::sqrt(w.size()) + 1e-3) << v.name;
    // Sampling error of a standard deviation is about 1/sqrt(2n) of it;
    // near 1.0, BF16's ulp of 2^-7 adds rounding noise of its own.
    const double rounding = spec.kind == SynthTensorKind::kNorm ? 0.003 : 0.0;
    EXPECT_NEAR(stddev, spec.init_std,
                spec.init_std * (0.02 + 4 / std::sqrt(2.0 * w.size())) + rounding)
        << v.name;
  }
}

TEST(SynthTrainerTest, SameSeedIsBitIdenticalAcrossThreadCounts) {
  auto one = MakeTrainer(TinyConfig(7, 1e-6, 1));
  auto many = MakeTrainer(TinyConfig(7, 1e-6, 3));
  ASSERT_NE(one, nullptr);
  ASSERT_NE(many, nullptr);
  EXPECT_EQ(Snapshot(*one), Snapshot(*many));
  for (int s = 0; s < 3; ++s) {
    one->Step();
    many->Step();
    ASSERT_EQ(Snapshot(*one), Snapshot(*many)) << "step " << s + 1;
    EXPECT_EQ(one->last_step_stats().changed_elements, many->last_step_stats().changed_elements);
  }
}

TEST(SynthTrainerTest, DifferentSeedsDiffer) {
  auto a = MakeTrainer(TinyConfig(1));
  auto b = MakeTrainer(TinyConfig(2));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::string a0 = Snapshot(*a), b0 = Snapshot(*b);
  EXPECT_NE(a0, b0);
  // Per-element, the two initial models agree only by chance.
  size_t equal = 0;
  for (size_t i = 0; i + 1 < a0.size(); i += 2) equal += a0.compare(i, 2, b0, i, 2) == 0;
  EXPECT_LT(equal, a0.size() / 2 / 20);
  a->Step();
  b->Step();
  EXPECT_NE(Snapshot(*a), Snapshot(*b));
}

TEST(SynthTrainerTest, ZeroLearningRateChangesNothing) {
  auto t = MakeTrainer(TinyConfig(3, 0.0));
  ASSERT_NE(t, nullptr);
  const std::string before = Snapshot(*t);
  t->Step();
  t->Step();
  EXPECT_EQ(Snapshot(*t), before);
  EXPECT_EQ(t->last_step_stats().changed_elements, 0);
  EXPECT_EQ(t->step(), 2);
}

// Adam's first bias-corrected update is lr * g / (|g| + eps): at most lr per
// element. So step 1 can move a BF16 value only where half an ulp is below
// lr (|w| < 2^-10 for lr 1e-6), and by at most lr plus the final rounding.
TEST(SynthTrainerTest, FirstStepMovesEachWeightByAtMostTheLearningRate) {
  const double lr = 1e-6;
  auto t = MakeTrainer(TinyConfig(11, lr));
  ASSERT_NE(t, nullptr);
  std::vector<std::vector<uint16_t>> before;
  for (const TensorView& v : t->Weights()) before.push_back(AsBf16(v));
  t->Step();
  const auto after_views = t->Weights();
  int64_t changed = 0;
  for (size_t i = 0; i < after_views.size(); ++i) {
    const std::vector<uint16_t> after = AsBf16(after_views[i]);
    for (size_t k = 0; k < after.size(); ++k) {
      if (after[k] == before[i][k]) continue;
      ++changed;
      const double w0 = Bf16ToFloat(before[i][k]);
      const double w1 = Bf16ToFloat(after[k]);
      ASSERT_LT(std::fabs(w0), std::ldexp(1.0, -10)) << after_views[i].name << "[" << k << "]";
      // BF16 keeps 8 significant bits: its half ulp is below |w1| * 2^-8.
      ASSERT_LE(std::fabs(w1 - w0), lr * (1 + 1e-3) + std::fabs(w1) * std::ldexp(1.0, -8))
          << after_views[i].name << "[" << k << "]";
    }
  }
  EXPECT_EQ(changed, t->last_step_stats().changed_elements);
  EXPECT_GT(changed, 0);
}

// Fraction of elements that differ between two snapshots, counted directly.
double ChangedFraction(const std::string& a, const std::string& b) {
  size_t changed = 0;
  for (size_t i = 0; i + 1 < a.size(); i += 2) changed += a.compare(i, 2, b, i, 2) != 0;
  return static_cast<double>(changed) / (a.size() / 2);
}

TEST(SynthTrainerTest, ChangeDensityIsRealisticAndGrowsWithLearningRate) {
  auto slow = MakeTrainer(TinyConfig(5, 1e-6));
  auto fast = MakeTrainer(TinyConfig(5, 1e-5));
  ASSERT_NE(slow, nullptr);
  ASSERT_NE(fast, nullptr);
  std::string slow_prev = Snapshot(*slow), fast_prev = Snapshot(*fast);
  double slow_total = 0, fast_total = 0;
  for (int s = 1; s <= 6; ++s) {
    slow->Step();
    fast->Step();
    const std::string slow_now = Snapshot(*slow), fast_now = Snapshot(*fast);
    const double d_slow = ChangedFraction(slow_prev, slow_now);
    const double d_fast = ChangedFraction(fast_prev, fast_now);
    EXPECT_GE(d_slow, 0.003) << "step " << s;
    EXPECT_LE(d_slow, 0.10) << "step " << s;
    EXPECT_DOUBLE_EQ(slow->last_step_stats().changed_fraction(), d_slow);
    slow_total += d_slow;
    fast_total += d_fast;
    slow_prev = slow_now;
    fast_prev = fast_now;
  }
  EXPECT_GT(fast_total, 2 * slow_total);
}

// A master off the BF16 grid rounds to the same initial BF16 weights, and
// its small updates cross rounding boundaries more often.
TEST(SynthTrainerTest, AMasterOffTheBf16GridStartsFromTheSameWeightsAndChangesMore) {
  SynthConfig off_grid = TinyConfig(5, 1e-6);
  off_grid.master_on_bf16 = false;
  auto on = MakeTrainer(TinyConfig(5, 1e-6));
  auto off = MakeTrainer(off_grid);
  ASSERT_NE(on, nullptr);
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(Snapshot(*on), Snapshot(*off));
  int64_t on_changed = 0, off_changed = 0;
  for (int s = 1; s <= 4; ++s) {
    on->Step();
    off->Step();
    on_changed += on->last_step_stats().changed_elements;
    off_changed += off->last_step_stats().changed_elements;
  }
  EXPECT_GT(on_changed, 0);
  EXPECT_GT(off_changed, on_changed * 13 / 10) << on_changed << " against " << off_changed;
}

TEST(SynthTrainerTest, NormWeightsChangeMuchLessOftenThanLinearWeights) {
  auto t = MakeTrainer(TinyConfig(9));
  ASSERT_NE(t, nullptr);
  int64_t norm_changed = 0, norm_total = 0, linear_changed = 0, linear_total = 0;
  for (int s = 0; s < 8; ++s) {
    t->Step();
    const SynthStepStats& stats = t->last_step_stats();
    for (size_t i = 0; i < t->specs().size(); ++i) {
      const SynthTensorSpec& spec = t->specs()[i];
      const int64_t n = SynthParameterCount({spec});
      if (spec.kind == SynthTensorKind::kNorm) {
        norm_changed += stats.changed_per_tensor[i];
        norm_total += n;
      } else if (spec.kind == SynthTensorKind::kLinear) {
        linear_changed += stats.changed_per_tensor[i];
        linear_total += n;
      }
    }
  }
  const double norm_rate = static_cast<double>(norm_changed) / norm_total;
  const double linear_rate = static_cast<double>(linear_changed) / linear_total;
  EXPECT_GT(linear_rate, 0.003);
  EXPECT_LT(norm_rate, linear_rate / 10) << norm_rate << " vs " << linear_rate;

  // They do train: a large learning rate moves them past half an ulp.
  auto fast = MakeTrainer(TinyConfig(9, 3e-3));
  ASSERT_NE(fast, nullptr);
  fast->Step();
  int64_t fast_norm_changed = 0;
  for (size_t i = 0; i < fast->specs().size(); ++i) {
    if (fast->specs()[i].kind == SynthTensorKind::kNorm) {
      fast_norm_changed += fast->last_step_stats().changed_per_tensor[i];
    }
  }
  EXPECT_GT(fast_norm_changed, norm_total / 8 / 4);
}

// --- Chain on disk -----------------------------------------------------------

namespace fs = std::filesystem;

class SynthChainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("deltasync_synth_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  SynthChainOptions Options(int64_t steps) const {
    SynthChainOptions o;
    o.out_dir = dir_.string();
    o.trainer = TinyConfig(21);
    o.steps = steps;
    return o;
  }

  // Every version on disk equals the trainer's weights after that many steps.
  void ExpectChainMatchesTrainer(const SynthChainOptions& o, bool sharded) {
    auto trainer = MakeTrainer(o.trainer);
    ASSERT_NE(trainer, nullptr);
    for (int64_t step = 0; step <= o.steps; ++step) {
      if (step > 0) trainer->Step();
      const fs::path version = dir_ / SynthStepDirName(step);
      auto ckpt = Checkpoint::Open(version.string());
      ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
      EXPECT_EQ((*ckpt)->sharded(), sharded);
      EXPECT_EQ(fs::exists(version / "model.safetensors"), !sharded);
      EXPECT_EQ(fs::exists(version / "model.safetensors.index.json"), sharded);
      const auto weights = trainer->Weights();
      ASSERT_EQ((*ckpt)->tensors().size(), weights.size());
      for (const TensorView& w : weights) {
        auto got = (*ckpt)->Get(w.name);
        ASSERT_TRUE(got.ok()) << w.name;
        EXPECT_EQ(got->dtype, DType::kBF16);
        EXPECT_EQ(got->shape, w.shape);
        ASSERT_EQ(got->bytes.size(), w.bytes.size());
        EXPECT_EQ(std::memcmp(got->bytes.data(), w.bytes.data(), w.bytes.size()), 0)
            << "step " << step << " " << w.name;
      }
    }
  }

  fs::path dir_;
};

TEST_F(SynthChainTest, WritesStepsPlusOneLoadableVersions) {
  SynthChainOptions o = Options(2);
  std::vector<SynthChainProgress> seen;
  o.progress = [&seen](const SynthChainProgress& p) {
    seen.push_back(p);
    return true;
  };
  ASSERT_TRUE(WriteSynthChain(o).ok());
  ExpectChainMatchesTrainer(o, /*sharded=*/false);
  EXPECT_FALSE(fs::exists(dir_ / SynthStepDirName(3)));
  ASSERT_EQ(seen.size(), 3u);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(seen[i].step, i);
    EXPECT_EQ(seen[i].total_steps, 2);
    EXPECT_EQ(seen[i].dir, (dir_ / SynthStepDirName(i)).string());
  }
  EXPECT_EQ(seen[0].changed_fraction, 0.0);
  EXPECT_GT(seen[1].changed_fraction, 0.003);
  EXPECT_LT(seen[1].changed_fraction, 0.1);
  // HF's single-file convention.
  auto file = SafetensorsFile::Open((dir_ / "step_000000" / "model.safetensors").string());
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  // The manifest names the configuration.
  std::ifstream manifest(dir_ / "synth_chain.json");
  std::stringstream text;
  text << manifest.rdbuf();
  EXPECT_NE(text.str().find("\"preset\": \"tiny\""), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"seed\": 21"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"steps\": 2"), std::string::npos) << text.str();
}

TEST_F(SynthChainTest, ShardsWhenLargerThanOneShard) {
  SynthChainOptions o = Options(1);
  o.max_shard_bytes = 3 << 20;  // tiny is ~10 MB: at least four shards
  ASSERT_TRUE(WriteSynthChain(o).ok());
  ExpectChainMatchesTrainer(o, /*sharded=*/true);
  auto ckpt = Checkpoint::Open((dir_ / "step_000001").string());
  ASSERT_TRUE(ckpt.ok());
  const size_t shards = (*ckpt)->files().size();
  EXPECT_GE(shards, 4u);
  char first[64];
  std::snprintf(first, sizeof(first), "model-00001-of-%05zu.safetensors", shards);
  EXPECT_TRUE(fs::exists(dir_ / "step_000001" / first)) << first;
}

TEST_F(SynthChainTest, RefusesToOverwriteUnlessAsked) {
  SynthChainOptions o = Options(1);
  ASSERT_TRUE(WriteSynthChain(o).ok());
  // Plant a stale shard: replacing the version must remove it.
  std::ofstream(dir_ / "step_000001" / "stale.safetensors") << "x";
  Status again = WriteSynthChain(o);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
  EXPECT_NE(again.message().find("step_000000"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir_ / "step_000001" / "stale.safetensors"));

  o.overwrite = true;
  o.trainer.seed = 22;
  ASSERT_TRUE(WriteSynthChain(o).ok());
  EXPECT_FALSE(fs::exists(dir_ / "step_000001" / "stale.safetensors"));
  ExpectChainMatchesTrainer(o, /*sharded=*/false);
}

TEST_F(SynthChainTest, ProgressCanStopTheChain) {
  SynthChainOptions o = Options(5);
  o.progress = [](const SynthChainProgress& p) { return p.step < 1; };
  Status s = WriteSynthChain(o);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_TRUE(fs::exists(dir_ / "step_000001"));
  EXPECT_FALSE(fs::exists(dir_ / "step_000002"));
  EXPECT_FALSE(fs::exists(dir_ / "synth_chain.json"));
}

TEST_F(SynthChainTest, RejectsBadOptionsBeforeWriting) {
  SynthChainOptions o = Options(-1);
  EXPECT_TRUE(WriteSynthChain(o).IsInvalidArgument());
  o.steps = 1000000;
  EXPECT_TRUE(WriteSynthChain(o).IsInvalidArgument());
  o = Options(1);
  o.out_dir = "";
  EXPECT_TRUE(WriteSynthChain(o).IsInvalidArgument());
  o = Options(1);
  o.trainer.preset = "nope";
  EXPECT_TRUE(WriteSynthChain(o).IsInvalidArgument());
  o = Options(1);
  o.trainer.lr = -1;
  EXPECT_TRUE(WriteSynthChain(o).IsInvalidArgument());
  EXPECT_FALSE(fs::exists(dir_));
  // An out_dir that is a file.
  fs::create_directories(dir_);
  std::ofstream(dir_ / "file") << "x";
  o = Options(1);
  o.out_dir = (dir_ / "file").string();
  Status s = WriteSynthChain(o);
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  EXPECT_NE(s.message().find("not a directory"), std::string::npos);
}

TEST(SynthStepDirNameTest, SixDigits) {
  EXPECT_EQ(SynthStepDirName(0), "step_000000");
  EXPECT_EQ(SynthStepDirName(42), "step_000042");
  EXPECT_EQ(SynthStepDirName(999999), "step_999999");
}

// Timing of the real-size preset: run with --gtest_also_run_disabled_tests.
TEST(SynthTrainerTest, DISABLED_StepTimeQwen05b) {
  for (const char* preset : {"tiny", "qwen2.5-0.5b"}) {
    SynthConfig c;
    c.preset = preset;
    auto start = std::chrono::steady_clock::now();
    auto t = MakeTrainer(c);
    ASSERT_NE(t, nullptr);
    auto created = std::chrono::steady_clock::now();
    const int steps = 3;
    for (int s = 0; s < steps; ++s) {
      const auto s0 = std::chrono::steady_clock::now();
      t->Step();
      const auto s1 = std::chrono::steady_clock::now();
      std::printf("%s step %lld: %.3f s, changed %.3f%%\n", preset,
                  static_cast<long long>(t->step()), std::chrono::duration<double>(s1 - s0).count(),
                  100 * t->last_step_stats().changed_fraction());
    }
    std::printf("%s: create %.3f s\n", preset,
                std::chrono::duration<double>(created - start).count());
  }
}

}  // namespace
}  // namespace deltasync
