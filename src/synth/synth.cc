// The synthetic AdamW trainer.
//
// Work is split into fixed blocks of elements of one tensor. Every random
// number is derived from (seed, tensor name, stream, step or epoch, element
// index) by a counter-based hash, never from a sequential generator, so a
// block computes the same bits whichever thread runs it and in whatever
// order: results are independent of the thread count by construction.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "deltasync/synth.h"
#include "deltasync/thread_pool.h"
#include "synth/bf16.h"

namespace deltasync {

static_assert(std::endian::native == std::endian::little,
              "BF16 weights are exposed as little-endian safetensors bytes");

namespace {

// --- Counter-based random numbers -------------------------------------------

// splitmix64's output function: a bijective mixer whose outputs for
// consecutive inputs pass BigCrush, which is all a counter-based generator
// needs.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The n-th output of the splitmix64 sequence that starts at `key`.
inline uint64_t CounterHash(uint64_t key, uint64_t n) {
  return Mix64(key + (n + 1) * 0x9E3779B97F4A7C15ull);
}

uint64_t HashName(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a; Mix64 repairs its weak low bits
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return Mix64(h);
}

// Independent streams of one tensor; the values are part of the chain's
// definition (changing one changes every chain).
enum class Stream : uint64_t {
  kInit = 1,         // initial weights, per element
  kTensorScale = 2,  // gradient scale of the tensor, once
  kRowScale = 3,     // gradient scale of each row, once
  kStepScale = 4,    // gradient scale of the tensor in one step
  kDirection = 5,    // slowly rotating gradient direction, per epoch
  kNoise = 6,        // fresh gradient noise, per step
  kRowActive = 7,    // whether an embedding row is used by a step's batch
  kGlobalStep = 8,   // gradient scale shared by all tensors in one step
};

uint64_t StreamKey(uint64_t seed, uint64_t tensor_key, Stream stream, uint64_t index) {
  uint64_t k = Mix64(seed ^ 0x5851F42D4C957F2Dull);
  k = Mix64(k ^ tensor_key);
  k = Mix64(k + static_cast<uint64_t>(stream) * 0xD1B54A32D192ED03ull);
  return Mix64(k + index * 0x9E3779B97F4A7C15ull);
}

// --- Sampling by inverse CDF ------------------------------------------------

// Upper-half quantiles of N(0, 1): for each tail probability q in `tail`
// (decreasing, each < 0.5), the x > 0 with P(X > x) = q. Newton's method on
// the convex, decreasing tail function converges monotonically from below,
// so each root warm-starts the next and a handful of iterations suffice.
std::vector<double> NormalUpperQuantiles(const std::vector<double>& tail) {
  std::vector<double> x(tail.size());
  double guess = 0;
  for (size_t i = 0; i < tail.size(); ++i) {
    for (int iter = 0; iter < 100; ++iter) {
      const double excess = 0.5 * std::erfc(guess / std::numbers::sqrt2) - tail[i];
      const double density =
          std::exp(-0.5 * guess * guess) / (std::numbers::sqrt2 * std::sqrt(std::numbers::pi));
      const double step = excess / density;
      guess += step;
      if (step <= guess * 1e-15) break;
    }
    x[i] = guess;
  }
  return x;
}

// Student's t with 4 degrees of freedom has a closed-form quantile function
// (Shaw, "Sampling Student's T distribution", 2006); written here for the
// upper tail probability, which keeps full precision far out in the tail.
double StudentT4UpperQuantile(double tail) {
  const double alpha = std::min(1.0, 4 * tail * (1 - tail));
  const double root = std::sqrt(alpha);
  const double q = std::cos(std::acos(root) / 3) / root;
  return 2 * std::sqrt(std::max(0.0, q - 1));
}

// A distribution as tables of its quantiles: sampling is one table load per
// value, where Box-Muller would cost a log and a sine. The per-step gradient
// draws (billions per step for the real presets) use the 2^16-entry table of
// bucket midpoints, normalised to mean 0 and variance 1 over its entries;
// the rare draws that want a continuous value interpolate a 2^12-interval
// grid with 32 random bits.
class QuantileTable {
 public:
  static constexpr int kFineBits = 16;
  static constexpr int kFine = 1 << kFineBits;
  static constexpr int kCoarseBits = 12;
  static constexpr int kCoarse = 1 << kCoarseBits;

  // `upper_quantiles(tail)` returns, for decreasing tail probabilities, the
  // matching upper quantiles; the distribution must be symmetric about 0.
  template <typename F>
  explicit QuantileTable(F upper_quantiles) {
    std::vector<double> tail(kFine / 2);
    for (int k = 0; k < kFine / 2; ++k) tail[k] = (kFine / 2 - k - 0.5) / kFine;
    const std::vector<double> upper = upper_quantiles(tail);
    double sum_sq = 0;
    for (double x : upper) sum_sq += 2 * x * x;
    const double stddev = std::sqrt(sum_sq / kFine);  // the mean is 0 by symmetry
    for (int k = 0; k < kFine / 2; ++k) {
      fine_[kFine / 2 + k] = static_cast<float>(upper[k] / stddev);
      fine_[kFine / 2 - 1 - k] = -fine_[kFine / 2 + k];
    }

    // Grid points k / kCoarse; the outermost are clamped to the smallest
    // probability 32 bits can express.
    std::vector<double> coarse_tail(kCoarse / 2 + 1);
    for (int k = 0; k <= kCoarse / 2; ++k) {
      coarse_tail[k] = std::max(0.5 / 4294967296.0, static_cast<double>(kCoarse / 2 - k) / kCoarse);
    }
    const std::vector<double> coarse_upper = upper_quantiles(coarse_tail);
    for (int k = 0; k <= kCoarse / 2; ++k) {
      coarse_[kCoarse / 2 + k] = static_cast<float>(coarse_upper[k] / stddev);
      coarse_[kCoarse / 2 - k] = -coarse_[kCoarse / 2 + k];
    }
  }

  // One sample from the low 16 bits of `u`.
  float Sample16(uint32_t u) const { return fine_[u & (kFine - 1)]; }

  // One sample from 32 uniform bits.
  float Sample32(uint32_t u) const {
    const uint32_t k = u >> (32 - kCoarseBits);
    constexpr uint32_t kFractionMask = (1u << (32 - kCoarseBits)) - 1;
    const float f = (static_cast<float>(u & kFractionMask) + 0.5f) * (1.0f / (kFractionMask + 1));
    return coarse_[k] + f * (coarse_[k + 1] - coarse_[k]);
  }

 private:
  std::array<float, kFine> fine_{};
  std::array<float, kCoarse + 1> coarse_{};
};

const QuantileTable& NormalTable() {
  static const QuantileTable table(NormalUpperQuantiles);
  return table;
}
const QuantileTable& HeavyTailTable() {
  static const QuantileTable table([](const std::vector<double>& tail) {
    std::vector<double> x(tail.size());
    for (size_t i = 0; i < tail.size(); ++i) x[i] = StudentT4UpperQuantile(tail[i]);
    return x;
  });
  return table;
}

// A standard normal from a full 64-bit hash (for the few once-per-tensor,
// once-per-row and once-per-step draws).
float NormalFromHash(uint64_t h) { return NormalTable().Sample32(static_cast<uint32_t>(h >> 32)); }

// --- Gradient model constants ------------------------------------------------

// Typical magnitudes only matter relative to eps, since Adam divides the
// scale out; what shapes the updates is how the scale varies: across tensors
// and rows (once), and from step to step (batch to batch).
constexpr double kTensorScaleLogMean = -9.2;  // ln(1e-4)
constexpr double kTensorScaleLogStd = 1.0;
constexpr double kRowScaleLogStd = 0.5;
constexpr double kStepScaleLogStd = 0.3;
constexpr double kGlobalStepScaleLogStd = 0.3;
// An untied embedding row gets a gradient only in steps whose batch holds its
// token; token frequencies fall off roughly as a power of their id (BPE ids
// are assigned by merge order, i.e. roughly by frequency).
constexpr double kTokenActiveHead = 32.0;
constexpr double kTokenActiveExponent = 0.6;

constexpr int64_t kBlockElements = 8192;  // a multiple of 4: one hash feeds 4 elements

struct Block {
  uint32_t tensor;
  int64_t begin;
  int64_t end;
};

Status ValidateConfig(const SynthConfig& c) {
  auto bad = [](const std::string& field, double value, const char* rule) {
    return Status::InvalidArgument("synth config: " + field + " = " + std::to_string(value) + " " +
                                   rule);
  };
  if (!std::isfinite(c.lr) || c.lr < 0) return bad("lr", c.lr, "must be finite and >= 0");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return bad("beta1", c.beta1, "must be in [0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return bad("beta2", c.beta2, "must be in [0, 1)");
  if (!(std::isfinite(c.eps) && c.eps > 0)) return bad("eps", c.eps, "must be finite and > 0");
  if (!(std::isfinite(c.weight_decay) && c.weight_decay >= 0)) {
    return bad("weight_decay", c.weight_decay, "must be finite and >= 0");
  }
  if (!(c.grad_correlation >= 0 && c.grad_correlation <= 1)) {
    return bad("grad_correlation", c.grad_correlation, "must be in [0, 1]");
  }
  if (c.direction_period < 1) {
    return bad("direction_period", static_cast<double>(c.direction_period), "must be >= 1");
  }
  if (c.num_threads > 4096) {
    return bad("num_threads", static_cast<double>(c.num_threads), "must be <= 4096");
  }
  return Status::OK();
}

// One anonymous mapping for all of a trainer's arrays. At 14 bytes per
// parameter they reach gigabytes, and taking a page fault per 4 KiB on first
// touch costs more than filling them; MAP_POPULATE lets the kernel map them
// in one pass instead (measured faster here than huge pages, whose
// compaction stalls). The pages come zeroed: Adam's initial m and v.
class Arena {
 public:
  static std::unique_ptr<Arena> Map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    return std::unique_ptr<Arena>(new Arena(static_cast<uint8_t*>(p), bytes));
  }
  ~Arena() { munmap(base_, size_); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  uint8_t* base() const { return base_; }

 private:
  Arena(uint8_t* base, size_t size) : base_(base), size_(size) {}
  uint8_t* base_;
  size_t size_;
};

constexpr size_t kArrayAlignment = 64;  // a cache line: keeps vector loads aligned

size_t AlignUp(size_t n) { return (n + kArrayAlignment - 1) / kArrayAlignment * kArrayAlignment; }

struct StepParams {
  int64_t t = 0;  // 1-based step being computed, as in Adam's bias correction
  uint64_t epoch = 0;
  float direction_cos = 1, direction_sin = 0;
  float direction_weight = 0, noise_weight = 0;
  float global_scale = 1;
  // AdamW, precomputed in double and rounded once, as torch does.
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float step_size = 0, bias_correction2_sqrt = 1, eps = 0, decay = 1;
};

}  // namespace

// --- Trainer state -----------------------------------------------------------

struct SynthTrainer::State {
  struct Tensor {
    int64_t numel = 0;
    int64_t row_length = 0;  // elements per gradient-scale row
    uint64_t key = 0;        // hash of the name: tensor streams survive reordering
    float grad_scale = 0;
    // Arrays of numel elements inside the arena.
    float* master = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    uint16_t* bf16 = nullptr;
    std::vector<float> row_scale;
    // Per row, P(active) scaled to 2^64, for embeddings with sparse rows.
    std::vector<uint64_t> row_active_threshold;
  };

  SynthConfig config;
  std::vector<SynthTensorSpec> specs;
  std::unique_ptr<Arena> arena;
  std::vector<Tensor> tensors;
  std::vector<Block> blocks;
  std::vector<int64_t> block_changed;
  std::unique_ptr<ThreadPool> own_pool;
  ThreadPool* pool = nullptr;
  int64_t step = 0;
  SynthStepStats stats;

  void InitBlock(const Block& b);
  void StepBlock(const Block& b, size_t block_index, const StepParams& p);
};

void SynthTrainer::State::InitBlock(const Block& b) {
  Tensor& t = tensors[b.tensor];
  const SynthTensorSpec& spec = specs[b.tensor];
  const uint64_t key = StreamKey(config.seed, t.key, Stream::kInit, 0);
  const QuantileTable& normal = NormalTable();
  for (int64_t i = b.begin; i < b.end; i += 2) {
    const uint64_t h = CounterHash(key, static_cast<uint64_t>(i) >> 1);
    for (int64_t j = 0; j < 2 && i + j < b.end; ++j) {
      const float z = normal.Sample32(static_cast<uint32_t>(h >> (32 * j)));
      // On BF16 values (a loaded BF16 checkpoint), changes must accumulate
      // past half an ulp to show; off them, the BF16 weight is the
      // master's rounding (SynthConfig::master_on_bf16).
      const float master = spec.init_mean + spec.init_std * z;
      const uint16_t w = synth::FloatToBf16(master);
      t.bf16[i + j] = w;
      t.master[i + j] = config.master_on_bf16 ? synth::Bf16ToFloat(w) : master;
    }
  }
}

void SynthTrainer::State::StepBlock(const Block& b, size_t block_index, const StepParams& p) {
  Tensor& t = tensors[b.tensor];
  const int64_t n = b.end - b.begin;
  alignas(64) float grad[kBlockElements];

  // Unscaled gradient: rotating direction plus heavy-tailed noise.
  const QuantileTable& normal = NormalTable();
  const QuantileTable& heavy = HeavyTailTable();
  const uint64_t dir_key0 = StreamKey(config.seed, t.key, Stream::kDirection, p.epoch);
  const uint64_t dir_key1 = StreamKey(config.seed, t.key, Stream::kDirection, p.epoch + 1);
  const uint64_t noise_key = StreamKey(config.seed, t.key, Stream::kNoise, p.t);
  const float w0 = p.direction_weight * p.direction_cos;
  const float w1 = p.direction_weight * p.direction_sin;
  for (int64_t i = 0; i < n; i += 4) {
    const uint64_t group = static_cast<uint64_t>(b.begin + i) >> 2;
    const uint64_t h0 = CounterHash(dir_key0, group);
    const uint64_t h1 = CounterHash(dir_key1, group);
    const uint64_t hn = CounterHash(noise_key, group);
    const int64_t count = std::min<int64_t>(4, n - i);
    for (int64_t j = 0; j < count; ++j) {
      const int shift = 16 * static_cast<int>(j);
      grad[i + j] = w0 * normal.Sample16(static_cast<uint32_t>(h0 >> shift)) +
                    w1 * normal.Sample16(static_cast<uint32_t>(h1 >> shift)) +
                    p.noise_weight * heavy.Sample16(static_cast<uint32_t>(hn >> shift));
    }
  }

  // Per-row scales (and whole rows without gradient, for sparse embeddings).
  const float step_scale =
      p.global_scale * t.grad_scale *
      std::exp(
          static_cast<float>(kStepScaleLogStd) *
          NormalFromHash(CounterHash(StreamKey(config.seed, t.key, Stream::kStepScale, p.t), 0)));
  const uint64_t active_key = StreamKey(config.seed, t.key, Stream::kRowActive, p.t);
  for (int64_t pos = b.begin; pos < b.end;) {
    const int64_t row = pos / t.row_length;
    const int64_t row_end = std::min(b.end, (row + 1) * t.row_length);
    float s = step_scale * t.row_scale[row];
    if (!t.row_active_threshold.empty() &&
        CounterHash(active_key, static_cast<uint64_t>(row)) >= t.row_active_threshold[row]) {
      s = 0;
    }
    for (int64_t k = pos - b.begin; k < row_end - b.begin; ++k) grad[k] *= s;
    pos = row_end;
  }

  // AdamW (torch.optim.AdamW, non-fused), then round to BF16.
  float* __restrict master = t.master + b.begin;
  float* __restrict exp_avg = t.exp_avg + b.begin;
  float* __restrict exp_avg_sq = t.exp_avg_sq + b.begin;
  uint16_t* __restrict bf16 = t.bf16 + b.begin;
  int64_t changed = 0;
  for (int64_t k = 0; k < n; ++k) {
    const float g = grad[k];
    const float m = p.beta1 * exp_avg[k] + p.one_minus_beta1 * g;
    const float v = p.beta2 * exp_avg_sq[k] + p.one_minus_beta2 * g * g;
    exp_avg[k] = m;
    exp_avg_sq[k] = v;
    const float denom = std::sqrt(v) / p.bias_correction2_sqrt + p.eps;
    const float w = master[k] * p.decay - p.step_size * (m / denom);
    master[k] = w;
    const uint16_t rounded = synth::FloatToBf16(w);
    changed += rounded != bf16[k];
    bf16[k] = rounded;
  }
  block_changed[block_index] = changed;
}

// --- SynthTrainer ------------------------------------------------------------

SynthTrainer::SynthTrainer(std::unique_ptr<State> state) : state_(std::move(state)) {}
SynthTrainer::~SynthTrainer() = default;

Result<std::unique_ptr<SynthTrainer>> SynthTrainer::Create(const SynthConfig& config) {
  DS_RETURN_IF_ERROR(ValidateConfig(config));
  DS_ASSIGN_OR_RETURN(std::vector<SynthTensorSpec> specs,
                      SynthPresetSpecs(config.preset, config.scale));

  auto state = std::make_unique<State>();
  state->config = config;
  state->specs = std::move(specs);
  if (config.num_threads > 0) {
    state->own_pool = std::make_unique<ThreadPool>(config.num_threads);
    state->pool = state->own_pool.get();
  } else {
    state->pool = &ThreadPool::Default();
  }

  state->tensors.resize(state->specs.size());
  size_t arena_bytes = 0;
  for (const SynthTensorSpec& spec : state->specs) {
    const size_t n = static_cast<size_t>(SynthParameterCount({spec}));
    arena_bytes += 3 * AlignUp(n * sizeof(float)) + AlignUp(n * sizeof(uint16_t));
  }
  state->arena = Arena::Map(arena_bytes);
  if (!state->arena) {
    return Status::OutOfRange("synth: cannot map " + std::to_string(arena_bytes) +
                              " bytes (14 per parameter) for preset '" + config.preset +
                              "' at scale " + std::to_string(config.scale) +
                              "; use a smaller scale");
  }
  uint8_t* next = state->arena->base();
  auto carve = [&next](size_t bytes) {
    uint8_t* p = next;
    next += AlignUp(bytes);
    return p;
  };
  const bool has_lm_head =
      std::any_of(state->specs.begin(), state->specs.end(),
                  [](const SynthTensorSpec& s) { return s.kind == SynthTensorKind::kLmHead; });
  int64_t total = 0;
  for (size_t ti = 0; ti < state->specs.size(); ++ti) {
    const SynthTensorSpec& spec = state->specs[ti];
    State::Tensor& t = state->tensors[ti];
    t.numel = SynthParameterCount({spec});
    t.row_length = spec.shape.size() >= 2 ? spec.shape.back() : std::max<int64_t>(1, t.numel);
    t.key = HashName(spec.name);
    const size_t n = static_cast<size_t>(t.numel);
    t.master = reinterpret_cast<float*>(carve(n * sizeof(float)));
    t.exp_avg = reinterpret_cast<float*>(carve(n * sizeof(float)));
    t.exp_avg_sq = reinterpret_cast<float*>(carve(n * sizeof(float)));
    t.bf16 = reinterpret_cast<uint16_t*>(carve(n * sizeof(uint16_t)));
    const uint64_t seed = config.seed;
    t.grad_scale = static_cast<float>(std::exp(
        kTensorScaleLogMean +
        kTensorScaleLogStd *
            NormalFromHash(CounterHash(StreamKey(seed, t.key, Stream::kTensorScale, 0), 0))));
    const int64_t rows = t.numel / t.row_length;
    t.row_scale.resize(static_cast<size_t>(rows));
    const uint64_t row_key = StreamKey(seed, t.key, Stream::kRowScale, 0);
    for (int64_t r = 0; r < rows; ++r) {
      t.row_scale[r] = static_cast<float>(std::exp(
          kRowScaleLogStd * NormalFromHash(CounterHash(row_key, static_cast<uint64_t>(r)))));
    }
    // With tied embeddings the matrix is also the output projection, whose
    // every row gets a gradient through the softmax.
    if (spec.kind == SynthTensorKind::kEmbedding && has_lm_head && rows > 1) {
      t.row_active_threshold.resize(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const double p = std::min(
            1.0, kTokenActiveHead / std::pow(static_cast<double>(r + 1), kTokenActiveExponent));
        t.row_active_threshold[r] =
            p >= 1.0 ? UINT64_MAX : static_cast<uint64_t>(std::ldexp(p, 64));
      }
    }

    for (int64_t begin = 0; begin < t.numel; begin += kBlockElements) {
      state->blocks.push_back(
          {static_cast<uint32_t>(ti), begin, std::min(t.numel, begin + kBlockElements)});
    }
    total += t.numel;
  }
  state->block_changed.assign(state->blocks.size(), 0);
  state->stats.total_elements = total;
  state->stats.changed_per_tensor.assign(state->specs.size(), 0);

  State* s = state.get();
  s->pool->ParallelFor(s->blocks.size(), [s](size_t i) { s->InitBlock(s->blocks[i]); });
  return std::unique_ptr<SynthTrainer>(new SynthTrainer(std::move(state)));
}

void SynthTrainer::Step() {
  State* s = state_.get();
  const SynthConfig& c = s->config;
  StepParams p;
  p.t = s->step + 1;
  const int64_t phase = (p.t - 1) % c.direction_period;
  p.epoch = static_cast<uint64_t>((p.t - 1) / c.direction_period);
  const double angle =
      std::numbers::pi / 2 * static_cast<double>(phase) / static_cast<double>(c.direction_period);
  p.direction_cos = static_cast<float>(std::cos(angle));
  p.direction_sin = static_cast<float>(std::sin(angle));
  p.direction_weight = static_cast<float>(std::sqrt(c.grad_correlation));
  p.noise_weight = static_cast<float>(std::sqrt(1 - c.grad_correlation));
  p.global_scale = static_cast<float>(
      std::exp(kGlobalStepScaleLogStd *
               NormalFromHash(CounterHash(StreamKey(c.seed, 0, Stream::kGlobalStep, p.t), 0))));
  p.beta1 = static_cast<float>(c.beta1);
  p.one_minus_beta1 = static_cast<float>(1 - c.beta1);
  p.beta2 = static_cast<float>(c.beta2);
  p.one_minus_beta2 = static_cast<float>(1 - c.beta2);
  const double bias_correction1 = 1 - std::pow(c.beta1, static_cast<double>(p.t));
  const double bias_correction2 = 1 - std::pow(c.beta2, static_cast<double>(p.t));
  p.step_size = static_cast<float>(c.lr / bias_correction1);
  p.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  p.eps = static_cast<float>(c.eps);
  p.decay = static_cast<float>(1 - c.lr * c.weight_decay);

  s->pool->ParallelFor(s->blocks.size(), [s, &p](size_t i) { s->StepBlock(s->blocks[i], i, p); });

  s->step = p.t;
  SynthStepStats& stats = s->stats;
  stats.step = p.t;
  stats.changed_elements = 0;
  std::fill(stats.changed_per_tensor.begin(), stats.changed_per_tensor.end(), 0);
  for (size_t i = 0; i < s->blocks.size(); ++i) {
    stats.changed_per_tensor[s->blocks[i].tensor] += s->block_changed[i];
    stats.changed_elements += s->block_changed[i];
  }
}

int64_t SynthTrainer::step() const { return state_->step; }

std::vector<TensorView> SynthTrainer::Weights() const {
  std::vector<TensorView> views;
  views.reserve(state_->specs.size());
  for (size_t i = 0; i < state_->specs.size(); ++i) {
    const State::Tensor& t = state_->tensors[i];
    views.push_back({state_->specs[i].name,
                     DType::kBF16,
                     state_->specs[i].shape,
                     {reinterpret_cast<const uint8_t*>(t.bf16), static_cast<size_t>(t.numel) * 2}});
  }
  return views;
}

const std::vector<SynthTensorSpec>& SynthTrainer::specs() const { return state_->specs; }
const SynthConfig& SynthTrainer::config() const { return state_->config; }
const SynthStepStats& SynthTrainer::last_step_stats() const { return state_->stats; }

}  // namespace deltasync
