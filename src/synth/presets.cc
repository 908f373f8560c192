// Model-family presets for the synthetic trainer and the scale search.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "deltasync/synth.h"

namespace deltasync {
namespace {

// The dimensions that decide a Qwen2-style decoder's tensor shapes. kv_width
// is num_key_value_heads * head_dim (the rows of k_proj and v_proj).
struct ModelDims {
  int64_t hidden = 0;
  int64_t kv_width = 0;
  int64_t intermediate = 0;
  int64_t vocab = 0;
  int64_t layers = 0;
  bool tied_embeddings = false;
  // Mixture-of-experts (Qwen3-MoE): `experts` experts per layer, each with
  // gate/up/down projections of width moe_intermediate, and a router, in
  // place of the dense MLP; attention without biases, q_proj of q_width
  // rows and per-head q/k norms of head_dim. 0: a dense Qwen2 layer.
  int64_t experts = 0;
  int64_t moe_intermediate = 0;
  int64_t q_width = 0;
  int64_t head_dim = 0;
};

struct Preset {
  const char* name;
  ModelDims dims;
};

// qwen2.5-*: Qwen/Qwen2.5-{0.5B,1.5B}/config.json. tiny keeps the layout with
// dimensions chosen for ~10 MB of BF16 and an untied lm_head, so both
// variants of the layout get exercised.
constexpr Preset kPresets[] = {
    {"tiny", {256, 128, 1024, 2048, 4, false}},
    {"qwen2.5-0.5b", {896, 2 * 64, 4864, 151936, 24, true}},
    {"qwen2.5-1.5b", {1536, 2 * 128, 8960, 151936, 28, true}},
    // Qwen/Qwen3-30B-A3B/config.json: 48 layers of 128 experts (18,432
    // expert projections), 32 query heads and 4 key/value heads of 128.
    {"qwen3-30b-a3b", {2048, 4 * 128, 0, 151936, 48, false, 128, 768, 32 * 128, 128}},
};

// Initialisation as in Qwen2's _init_weights (initializer_range 0.02) for
// matrices; biases small rather than zero and norm weights spread around 1.0,
// because a trained checkpoint has neither exact zeros nor exact ones.
constexpr float kMatrixInitStd = 0.02f;
constexpr float kBiasInitStd = 0.01f;
constexpr float kNormInitStd = 0.02f;

const Preset* FindPreset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

std::string KnownPresetList() {
  std::string out;
  for (const Preset& p : kPresets) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

int64_t ScaleDim(int64_t dim, double scale) {
  const double units = std::round(static_cast<double>(dim) * scale / 64.0);
  return std::max<int64_t>(1, static_cast<int64_t>(units)) * 64;
}

Status ValidateScale(double scale) {
  if (!std::isfinite(scale) || scale <= 0.0 || scale > kMaxSynthScale) {
    return Status::InvalidArgument("synth scale " + std::to_string(scale) + " is outside (0, " +
                                   std::to_string(kMaxSynthScale) + "]");
  }
  return Status::OK();
}

// Hidden and key/value widths scale with `scale`; the MLP width and the
// vocabulary absorb the rounding of the hidden size, so that the products
// that dominate the size (hidden x intermediate, hidden x vocab) track
// scale^2 closely and a target byte size can be hit within ~1%.
ModelDims ScaledDims(const ModelDims& base, double scale) {
  if (scale == 1.0) return base;
  ModelDims d = base;
  d.hidden = ScaleDim(base.hidden, scale);
  d.kv_width = std::min(ScaleDim(base.kv_width, scale), d.hidden);
  const double wide_scale =
      scale * scale * static_cast<double>(base.hidden) / static_cast<double>(d.hidden);
  d.intermediate = base.intermediate == 0 ? 0 : ScaleDim(base.intermediate, wide_scale);
  d.vocab = ScaleDim(base.vocab, wide_scale);
  if (base.experts > 0) {
    d.moe_intermediate = ScaleDim(base.moe_intermediate, wide_scale);
    d.q_width = ScaleDim(base.q_width, scale);
    d.head_dim = std::min(ScaleDim(base.head_dim, scale), d.kv_width);
  }
  return d;
}

// Parameters of BuildSpecs(d), without building it (the scale search
// evaluates this many thousand times).
int64_t ParameterCount(const ModelDims& d) {
  const int64_t h = d.hidden, kv = d.kv_width, in = d.intermediate;
  const int64_t attention = d.experts > 0 ? 2 * d.q_width * h + 2 * kv * h + 2 * d.head_dim
                                          : 2 * h * h + 2 * kv * h + h + 2 * kv;
  const int64_t mlp =
      d.experts > 0 ? d.experts * 3 * h * d.moe_intermediate + d.experts * h : 3 * h * in;
  const int64_t norms = 2 * h;
  const int64_t embeddings = d.vocab * h * (d.tied_embeddings ? 1 : 2);
  return embeddings + d.layers * (attention + mlp + norms) + h;
}

SynthTensorSpec Matrix(std::string name, int64_t rows, int64_t cols, SynthTensorKind kind) {
  return {std::move(name), {rows, cols}, kind, 0.0f, kMatrixInitStd};
}
SynthTensorSpec Bias(std::string name, int64_t n) {
  return {std::move(name), {n}, SynthTensorKind::kBias, 0.0f, kBiasInitStd};
}
SynthTensorSpec Norm(std::string name, int64_t n) {
  return {std::move(name), {n}, SynthTensorKind::kNorm, 1.0f, kNormInitStd};
}

std::vector<SynthTensorSpec> BuildSpecs(const ModelDims& d) {
  std::vector<SynthTensorSpec> specs;
  specs.reserve(3 + 12 * d.layers);
  specs.push_back(
      Matrix("model.embed_tokens.weight", d.vocab, d.hidden, SynthTensorKind::kEmbedding));
  for (int64_t i = 0; i < d.layers; ++i) {
    const std::string layer = "model.layers." + std::to_string(i) + ".";
    const std::string attn = layer + "self_attn.";
    const std::string mlp = layer + "mlp.";
    if (d.experts > 0) {
      // Qwen3-MoE, as its checkpoints name and shape the tensors.
      const SynthTensorKind lin = SynthTensorKind::kLinear;
      specs.push_back(Matrix(attn + "q_proj.weight", d.q_width, d.hidden, lin));
      specs.push_back(Matrix(attn + "k_proj.weight", d.kv_width, d.hidden, lin));
      specs.push_back(Matrix(attn + "v_proj.weight", d.kv_width, d.hidden, lin));
      specs.push_back(Matrix(attn + "o_proj.weight", d.hidden, d.q_width, lin));
      specs.push_back(Norm(attn + "q_norm.weight", d.head_dim));
      specs.push_back(Norm(attn + "k_norm.weight", d.head_dim));
      specs.push_back(Matrix(mlp + "gate.weight", d.experts, d.hidden, lin));
      for (int64_t e = 0; e < d.experts; ++e) {
        const std::string ex = mlp + "experts." + std::to_string(e) + ".";
        specs.push_back(Matrix(ex + "gate_proj.weight", d.moe_intermediate, d.hidden, lin));
        specs.push_back(Matrix(ex + "up_proj.weight", d.moe_intermediate, d.hidden, lin));
        specs.push_back(Matrix(ex + "down_proj.weight", d.hidden, d.moe_intermediate, lin));
      }
      specs.push_back(Norm(layer + "input_layernorm.weight", d.hidden));
      specs.push_back(Norm(layer + "post_attention_layernorm.weight", d.hidden));
      continue;
    }
    specs.push_back(Matrix(attn + "q_proj.weight", d.hidden, d.hidden, SynthTensorKind::kLinear));
    specs.push_back(Bias(attn + "q_proj.bias", d.hidden));
    specs.push_back(Matrix(attn + "k_proj.weight", d.kv_width, d.hidden, SynthTensorKind::kLinear));
    specs.push_back(Bias(attn + "k_proj.bias", d.kv_width));
    specs.push_back(Matrix(attn + "v_proj.weight", d.kv_width, d.hidden, SynthTensorKind::kLinear));
    specs.push_back(Bias(attn + "v_proj.bias", d.kv_width));
    specs.push_back(Matrix(attn + "o_proj.weight", d.hidden, d.hidden, SynthTensorKind::kLinear));
    specs.push_back(
        Matrix(mlp + "gate_proj.weight", d.intermediate, d.hidden, SynthTensorKind::kLinear));
    specs.push_back(
        Matrix(mlp + "up_proj.weight", d.intermediate, d.hidden, SynthTensorKind::kLinear));
    specs.push_back(
        Matrix(mlp + "down_proj.weight", d.hidden, d.intermediate, SynthTensorKind::kLinear));
    specs.push_back(Norm(layer + "input_layernorm.weight", d.hidden));
    specs.push_back(Norm(layer + "post_attention_layernorm.weight", d.hidden));
  }
  specs.push_back(Norm("model.norm.weight", d.hidden));
  if (!d.tied_embeddings) {
    specs.push_back(Matrix("lm_head.weight", d.vocab, d.hidden, SynthTensorKind::kLmHead));
  }
  return specs;
}

uint64_t BytesAt(const Preset& preset, double scale) {
  return 2 * static_cast<uint64_t>(ParameterCount(ScaledDims(preset.dims, scale)));
}

// The shortest decimal with the same size as `scale`: scales are printed and
// typed back on command lines.
double ShortScaleWithSameSize(const Preset& preset, double scale) {
  const uint64_t bytes = BytesAt(preset, scale);
  for (int digits = 1; digits <= 17; ++digits) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.*g", digits, scale);
    const double candidate = std::strtod(buf, nullptr);
    if (candidate > 0 && candidate <= kMaxSynthScale && BytesAt(preset, candidate) == bytes) {
      return candidate;
    }
  }
  return scale;
}

}  // namespace

std::vector<std::string> SynthPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

Result<std::vector<SynthTensorSpec>> SynthPresetSpecs(std::string_view preset, double scale) {
  const Preset* p = FindPreset(preset);
  if (p == nullptr) {
    return Status::InvalidArgument("unknown synth preset '" + std::string(preset) +
                                   "' (known: " + KnownPresetList() + ")");
  }
  DS_RETURN_IF_ERROR(ValidateScale(scale));
  return BuildSpecs(ScaledDims(p->dims, scale));
}

int64_t SynthParameterCount(const std::vector<SynthTensorSpec>& specs) {
  int64_t total = 0;
  for (const SynthTensorSpec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    total += n;
  }
  return total;
}

uint64_t SynthBf16Bytes(const std::vector<SynthTensorSpec>& specs) {
  return 2 * static_cast<uint64_t>(SynthParameterCount(specs));
}

Result<double> SynthScaleForBytes(std::string_view preset, uint64_t target_bytes) {
  const Preset* p = FindPreset(preset);
  if (p == nullptr) {
    return Status::InvalidArgument("unknown synth preset '" + std::string(preset) +
                                   "' (known: " + KnownPresetList() + ")");
  }
  if (target_bytes == 0) return Status::InvalidArgument("synth target size must be > 0 bytes");
  const uint64_t max_bytes = BytesAt(*p, kMaxSynthScale);
  if (target_bytes > max_bytes) {
    return Status::OutOfRange("preset '" + std::string(preset) + "' reaches at most " +
                              std::to_string(max_bytes) + " bytes (scale " +
                              std::to_string(kMaxSynthScale) + "), asked for " +
                              std::to_string(target_bytes));
  }
  // Size is only roughly monotonic in scale (the compensating rounding in
  // ScaledDims makes it wiggle), so search by scanning rather than
  // bisecting: a coarse logarithmic pass over the whole range, then a fine
  // pass over every coarse interval whose ends bracket the target within 10%.
  constexpr double kMinScale = 1e-4;  // every dimension is at its floor here
  constexpr int kCoarse = 4000;
  constexpr int kFinePerInterval = 400;
  auto distance = [&](double s) {
    const uint64_t b = BytesAt(*p, s);
    return b > target_bytes ? b - target_bytes : target_bytes - b;
  };
  const double log_step = std::log(kMaxSynthScale / kMinScale) / kCoarse;
  auto coarse = [&](int i) {
    return i == kCoarse ? kMaxSynthScale : kMinScale * std::exp(log_step * i);
  };
  double best = kMinScale;
  uint64_t best_distance = distance(best);
  const double lo_bytes = 0.9 * static_cast<double>(target_bytes);
  const double hi_bytes = 1.1 * static_cast<double>(target_bytes);
  for (int i = 0; i < kCoarse; ++i) {
    const double a = coarse(i), b = coarse(i + 1);
    const double bytes_a = static_cast<double>(BytesAt(*p, a));
    const double bytes_b = static_cast<double>(BytesAt(*p, b));
    const bool near = bytes_a <= hi_bytes && bytes_b >= lo_bytes;
    const int points = near ? kFinePerInterval : 1;
    for (int k = 0; k <= points; ++k) {
      const double s = k == points ? b : a + (b - a) * k / points;
      const uint64_t d = distance(s);
      if (d < best_distance) {
        best_distance = d;
        best = s;
      }
    }
  }
  return ShortScaleWithSameSize(*p, best);
}

}  // namespace deltasync
