// Synthetic RL weight chains: a deterministic stand-in for a trainer that
// updates an LLM with AdamW every step, producing the BF16 weight versions a
// rollout engine would receive.
//
// Why it looks the way it does: the point of deltasync is that only a few
// percent of BF16 elements change per RL step, because most AdamW updates are
// smaller than half a BF16 ulp of the weight they touch. A useful synthetic
// chain must therefore reproduce the mechanism, not the outcome: an fp32
// master copy (started from the BF16 checkpoint, as a trainer loading an HF
// model does) is updated by bias-corrected AdamW with noisy, temporally
// correlated, heavy-tailed gradients, and cast to BF16 with round-to-nearest-
// even after every step. Which elements change, and how many, then follows
// from the weights' magnitudes (small weights have small ulps and change
// often, RMSNorm weights near 1.0 almost never) and from the learning rate.
//
// Determinism: every random number is a pure function of (seed, tensor name,
// stream, step, element index), so a chain is bit-identical for a given seed
// and configuration whatever the number of threads.
//
// Memory: the trainer keeps fp32 master, fp32 Adam m and v, and the BF16
// copy: 14 bytes per parameter (tiny: ~70 MB, qwen2.5-0.5b: ~6.9 GB,
// qwen2.5-1.5b: ~21.6 GB), all committed by Create. Use `scale` to shrink a
// preset.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/tensor.h"

namespace deltasync {

// What a tensor is in the model; decides its initialisation and how its
// gradient is drawn.
enum class SynthTensorKind : uint8_t {
  kEmbedding,  // token embedding [vocab, hidden]
  kLinear,     // projection weight [out, in]
  kBias,       // projection bias [out]
  kNorm,       // RMSNorm weight [hidden], initialised near 1.0
  kLmHead,     // output projection [vocab, hidden] (absent when tied)
};

// One tensor of a preset model. Every tensor is BF16.
struct SynthTensorSpec {
  std::string name;            // Hugging Face parameter name
  std::vector<int64_t> shape;  // row-major, rows first
  SynthTensorKind kind = SynthTensorKind::kLinear;
  float init_mean = 0.0f;  // initial values ~ init_mean + init_std * N(0, 1)
  float init_std = 0.02f;
};

// The preset names, in order of size: "tiny", "qwen2.5-0.5b", "qwen2.5-1.5b",
// "qwen3-30b-a3b" (a mixture of experts: 48 layers of 128 experts, each
// expert's projections a tensor of its own, 18,432 in all; scale it to fit).
std::vector<std::string> SynthPresetNames();

// Largest accepted `scale`: keeps every size comfortably inside int64.
inline constexpr double kMaxSynthScale = 16.0;

// The tensors of preset `preset` at size factor `scale` (0 < scale <=
// kMaxSynthScale), in the order a Hugging Face state dict lists them.
//
// At scale 1 the names and shapes are exactly the model family's (Qwen2
// layout: model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v}_proj
// .{weight,bias}, ...o_proj.weight, ...mlp.{gate,up,down}_proj.weight,
// ...{input,post_attention}_layernorm.weight, model.norm.weight, and
// lm_head.weight unless the embeddings are tied). Other scales multiply the
// hidden size and the key/value width by `scale`, and the MLP width and the
// vocabulary by about `scale` (compensating the hidden size's rounding, so
// that the size in bytes tracks scale^2 within ~1%); every scaled dimension
// is a multiple of 64 and at least 64. The layer count, and so the tensor
// names, stay those of the preset.
// Errors: InvalidArgument naming the unknown preset or the bad scale.
Result<std::vector<SynthTensorSpec>> SynthPresetSpecs(std::string_view preset, double scale = 1.0);

// Number of parameters (elements) of `specs`.
int64_t SynthParameterCount(const std::vector<SynthTensorSpec>& specs);

// BF16 bytes of `specs` (2 per parameter).
uint64_t SynthBf16Bytes(const std::vector<SynthTensorSpec>& specs);

// The scale at which `preset`'s BF16 size is closest to `target_bytes` (for
// benchmarks that want "about 512 MiB of weights"). A target below the
// smallest reachable size yields the smallest size's scale.
// Errors: InvalidArgument for an unknown preset or target_bytes == 0;
// OutOfRange when even kMaxSynthScale is too small.
Result<double> SynthScaleForBytes(std::string_view preset, uint64_t target_bytes);

// Configuration of a synthetic trainer. The defaults describe a typical RL
// post-training run (AdamW, lr 1e-6) and give about 1-3% changed BF16
// elements per step.
struct SynthConfig {
  std::string preset = "tiny";
  double scale = 1.0;
  uint64_t seed = 0;

  // AdamW, as torch.optim.AdamW (decoupled weight decay, bias-corrected).
  double lr = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;

  // Gradient model: g = tensor_scale * step_scale * row_scale * (
  //   sqrt(grad_correlation) * d_t + sqrt(1 - grad_correlation) * noise_t),
  // where d_t is a unit-variance direction that rotates smoothly from one
  // random direction to the next every `direction_period` steps (so
  // consecutive gradients are correlated, as in real training) and noise_t is
  // fresh Student-t (4 degrees of freedom) noise with heavy tails. The
  // log-normal scales are drawn once per tensor and per row, and afresh each
  // step (batch-to-batch gradient-norm swings, which Adam does not divide
  // out). Rows of an untied embedding get no gradient in steps whose batch
  // lacks their token, more often for higher token ids.
  double grad_correlation = 0.5;  // in [0, 1]
  int64_t direction_period = 16;  // >= 1

  // Where the fp32 master starts. true: on the BF16 values (a trainer that
  // loads a BF16 checkpoint), so a weight's BF16 bits change only once its
  // updates add up past half an ulp. false: on fp32 draws whose rounding
  // gives the BF16 weights (a model initialised or trained in fp32), so
  // that any small update may cross a rounding boundary: more elements
  // change per step. A real Qwen2.5-0.5B initialised in fp32 changed 2.94%
  // of its BF16 elements from step 2 to 3 of AdamW at lr 1e-6; the same
  // shapes here change 3.03% with false, 1.66% with true.
  bool master_on_bf16 = true;

  // Worker threads for Step(). 0 uses ThreadPool::Default(). Results do not
  // depend on it.
  size_t num_threads = 0;
};

// Counts of BF16 elements whose bits changed in the last step.
struct SynthStepStats {
  int64_t step = 0;                         // the step these counts describe
  int64_t changed_elements = 0;             // over all tensors
  int64_t total_elements = 0;               // parameters in the model
  std::vector<int64_t> changed_per_tensor;  // in spec order

  double changed_fraction() const {
    return total_elements ? static_cast<double>(changed_elements) / total_elements : 0.0;
  }
};

// An in-process trainer over one preset: owns the master weights, the AdamW
// state and the BF16 weights it publishes. Not thread-safe: call it from one
// thread at a time (it parallelises internally).
class SynthTrainer {
 public:
  // Validates `config` and allocates and initialises the weights (step 0).
  // Errors: InvalidArgument naming the bad field or preset; OutOfRange when
  // the 14 bytes per parameter cannot be allocated.
  static Result<std::unique_ptr<SynthTrainer>> Create(const SynthConfig& config);
  ~SynthTrainer();
  SynthTrainer(const SynthTrainer&) = delete;
  SynthTrainer& operator=(const SynthTrainer&) = delete;

  // Performs one optimiser step: draws gradients, updates the fp32 master with
  // AdamW and re-casts every tensor to BF16. Must not be called from inside a
  // task of the pool it uses.
  void Step();

  // Steps taken so far (0 after Create).
  int64_t step() const;

  // The current BF16 weights, in spec order. The views point into the
  // trainer: their bytes change on the next Step() and die with the trainer.
  std::vector<TensorView> Weights() const;

  const std::vector<SynthTensorSpec>& specs() const;
  const SynthConfig& config() const;

  // Change counts of the last Step() (all zero before the first).
  const SynthStepStats& last_step_stats() const;

 private:
  struct State;
  explicit SynthTrainer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Progress of WriteSynthChain, reported after each version is on disk.
struct SynthChainProgress {
  int64_t step = 0;               // the version just written (0 = initial weights)
  int64_t total_steps = 0;        // the last version that will be written
  std::string dir;                // its directory
  double changed_fraction = 0.0;  // BF16 elements changed by this step (0 for step 0)
};

struct SynthChainOptions {
  std::string out_dir;
  SynthConfig trainer;
  int64_t steps = 3;  // versions step_000000 ... step_{steps}: steps + 1 directories

  // A version whose BF16 bytes fit in one shard is a single
  // `model.safetensors`; a larger one is split into
  // `model-XXXXX-of-YYYYY.safetensors` shards of at most this size (HF's
  // rule) plus `model.safetensors.index.json`, as save_pretrained does. With
  // 2 GiB, tiny and qwen2.5-0.5b are single files and qwen2.5-1.5b has two
  // shards. 0 = always a single file.
  uint64_t max_shard_bytes = 2ull << 30;

  // Without it, an existing step_NNNNNN directory in the range to be written
  // is an AlreadyExists error. With it, such directories are deleted and
  // written anew (never merged: a stale shard could outlive its index).
  bool overwrite = false;

  // Called after each version; returning false stops the chain with Aborted.
  std::function<bool(const SynthChainProgress&)> progress;
};

// Writes DIR/step_000000 (the initial weights) ... DIR/step_{steps:06d}, each
// a Hugging Face checkpoint directory holding the trainer's BF16 weights
// after that many steps (every file's __metadata__ is {"format": "pt"}, as
// save_pretrained writes). Once every version is written, DIR/synth_chain.json
// records the configuration that regenerates the chain; its presence marks a
// complete chain. Nothing is written when the options or the config are
// invalid or a version directory exists without `overwrite`.
// Errors: InvalidArgument (bad options or config), AlreadyExists, IOError,
// OutOfRange (model too large to allocate), Aborted (progress returned
// false; versions already written stay).
Status WriteSynthChain(const SynthChainOptions& options);

// The directory name of version `step`: "step_000042".
std::string SynthStepDirName(int64_t step);

}  // namespace deltasync
