// deltasync synth --out DIR [--preset P] [--steps N] [--lr X] [--seed S]
//                 [--scale F | --bytes B]
// Writes a realistic chain of RL weight versions as HF checkpoint dirs
// DIR/step_000000 ... DIR/step_{N:06d}.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "cli_util.h"
#include "deltasync/synth.h"

namespace deltasync::cli {

void RegisterSynth(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string out;
    std::string preset = "tiny";
    int64_t steps = 3;
    double lr = 1e-6;
    uint64_t seed = 0;
    double scale = 1.0;
    std::string bytes;
    std::string shard_size = "2GiB";
    bool overwrite = false;
    size_t threads = 0;
    std::string master_init = "bf16";
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "synth",
      "Write a realistic chain of RL weight versions (AdamW on an fp32 master, cast to BF16) as "
      "HF checkpoint dirs DIR/step_000000 ...");
  cmd->add_option("--out,-o", opts->out, "Output directory")->required();
  std::string presets;
  for (const std::string& p : SynthPresetNames()) presets += (presets.empty() ? "" : " | ") + p;
  cmd->add_option("--preset,-p", opts->preset, "Model family: " + presets)->capture_default_str();
  cmd->add_option("--steps,-n", opts->steps, "Training steps (writes steps + 1 versions)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}));
  cmd->add_option("--lr", opts->lr, "AdamW learning rate")->capture_default_str();
  cmd->add_option("--seed,-s", opts->seed, "Random seed (the chain is deterministic per seed)")
      ->capture_default_str();
  auto* scale = cmd->add_option("--scale", opts->scale,
                                "Size factor on hidden/MLP/vocab widths (1 = the real model)")
                    ->capture_default_str();
  cmd->add_option("--bytes", opts->bytes, "Pick the scale for about this much BF16 (e.g. 512MiB)")
      ->excludes(scale);
  cmd->add_option("--shard-size", opts->shard_size, "Maximum bytes per safetensors shard")
      ->capture_default_str();
  cmd->add_option("--master-init", opts->master_init,
                  "Where the fp32 master starts: bf16 (on the BF16 weights, a loaded BF16 "
                  "checkpoint) | fp32 (off them, a model initialised in fp32: more changes)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp32"}));
  cmd->add_flag("--overwrite", opts->overwrite, "Replace existing step directories");
  cmd->add_option("--threads", opts->threads, "Worker threads (0 = all)")->capture_default_str();
  cmd->callback([opts, run] {
    *run = [opts]() -> int {
      SynthChainOptions chain;
      chain.out_dir = opts->out;
      chain.steps = opts->steps;
      chain.overwrite = opts->overwrite;
      chain.trainer.preset = opts->preset;
      chain.trainer.lr = opts->lr;
      chain.trainer.seed = opts->seed;
      chain.trainer.scale = opts->scale;
      chain.trainer.num_threads = opts->threads;
      chain.trainer.master_on_bf16 = opts->master_init == "bf16";
      Result<uint64_t> shard = ParseByteSize(opts->shard_size);
      if (!shard.ok()) return Fail(shard.status());
      chain.max_shard_bytes = *shard;
      if (!opts->bytes.empty()) {
        Result<uint64_t> bytes = ParseByteSize(opts->bytes);
        if (!bytes.ok()) return Fail(bytes.status());
        Result<double> s = SynthScaleForBytes(opts->preset, *bytes);
        if (!s.ok()) return Fail(s.status());
        chain.trainer.scale = *s;
      }
      Result<std::vector<SynthTensorSpec>> specs =
          SynthPresetSpecs(chain.trainer.preset, chain.trainer.scale);
      if (!specs.ok()) return Fail(specs.status());
      // The library would refuse too, naming its option rather than the flag.
      if (!opts->overwrite) {
        for (int64_t step = 0; step <= opts->steps; ++step) {
          const std::filesystem::path dir =
              std::filesystem::path(opts->out) / SynthStepDirName(step);
          std::error_code ec;
          if (std::filesystem::exists(std::filesystem::symlink_status(dir, ec))) {
            return Fail("synth: " + dir.string() +
                        " already exists (pass --overwrite to replace it)");
          }
        }
      }
      std::cout << "synth: preset " << opts->preset << " scale " << chain.trainer.scale << ", "
                << specs->size() << " tensors, " << SynthParameterCount(*specs) << " parameters ("
                << FormatBytes(SynthBf16Bytes(*specs)) << " BF16), lr " << opts->lr << ", seed "
                << opts->seed << ", master init " << opts->master_init << std::endl;
      const auto start = std::chrono::steady_clock::now();
      chain.progress = [start](const SynthChainProgress& p) {
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        char line[256];
        if (p.step == 0) {
          std::snprintf(line, sizeof(line), "  %s  initial weights           %7.1f s",
                        p.dir.c_str(), secs);
        } else {
          std::snprintf(line, sizeof(line), "  %s  changed %6.3f%% of elements %7.1f s",
                        p.dir.c_str(), 100.0 * p.changed_fraction, secs);
        }
        std::cout << line << std::endl;
        return true;
      };
      Status s = WriteSynthChain(chain);
      if (!s.ok()) return Fail(s);
      return 0;
    };
  });
}

}  // namespace deltasync::cli
