// WriteSynthChain: a trainer's versions as Hugging Face checkpoint
// directories.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

#include "deltasync/checkpoint.h"
#include "deltasync/synth.h"

namespace deltasync {
namespace {

constexpr int64_t kMaxChainSteps = 999999;  // the step_NNNNNN names have six digits
constexpr const char* kChainManifestName = "synth_chain.json";

std::string ShortestDouble(double value) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(value);
}

// Writes `contents` to `path` through a temporary file and rename, so a
// reader sees either nothing or the whole file.
Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, "create " + tmp);
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Status::FromErrno(err, "write " + tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::FromErrno(err, "sync " + tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::FromErrno(err, "rename " + tmp + " to " + path);
  }
  return Status::OK();
}

// Describes how the chain was made, so it can be regenerated. Every string
// in it is a preset name from the fixed list: no escaping is needed.
std::string ChainManifest(const SynthChainOptions& o, uint64_t bf16_bytes) {
  const SynthConfig& c = o.trainer;
  std::string json = "{\n";
  json += "  \"generator\": \"deltasync synth\",\n";
  json += "  \"preset\": \"" + c.preset + "\",\n";
  json += "  \"scale\": " + ShortestDouble(c.scale) + ",\n";
  json += "  \"seed\": " + std::to_string(c.seed) + ",\n";
  json += "  \"steps\": " + std::to_string(o.steps) + ",\n";
  json += "  \"lr\": " + ShortestDouble(c.lr) + ",\n";
  json += "  \"beta1\": " + ShortestDouble(c.beta1) + ",\n";
  json += "  \"beta2\": " + ShortestDouble(c.beta2) + ",\n";
  json += "  \"eps\": " + ShortestDouble(c.eps) + ",\n";
  json += "  \"weight_decay\": " + ShortestDouble(c.weight_decay) + ",\n";
  json += "  \"grad_correlation\": " + ShortestDouble(c.grad_correlation) + ",\n";
  json += "  \"direction_period\": " + std::to_string(c.direction_period) + ",\n";
  json += std::string("  \"master_init\": \"") + (c.master_on_bf16 ? "bf16" : "fp32") + "\",\n";
  json += "  \"bf16_bytes_per_version\": " + std::to_string(bf16_bytes) + "\n";
  json += "}\n";
  return json;
}

}  // namespace

std::string SynthStepDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%06lld", static_cast<long long>(step));
  return buf;
}

Status WriteSynthChain(const SynthChainOptions& options) {
  namespace fs = std::filesystem;
  if (options.out_dir.empty()) return Status::InvalidArgument("synth chain: out_dir is empty");
  if (options.steps < 0 || options.steps > kMaxChainSteps) {
    return Status::InvalidArgument("synth chain: steps = " + std::to_string(options.steps) +
                                   " must be in [0, " + std::to_string(kMaxChainSteps) + "]");
  }
  // Check the config (cheaply) before refusing or deleting anything.
  DS_ASSIGN_OR_RETURN(std::vector<SynthTensorSpec> specs,
                      SynthPresetSpecs(options.trainer.preset, options.trainer.scale));

  const fs::path out(options.out_dir);
  std::error_code ec;
  const fs::file_status out_status = fs::status(out, ec);
  if (fs::exists(out_status) && !fs::is_directory(out_status)) {
    return Status::InvalidArgument("synth chain: " + options.out_dir +
                                   " exists and is not a directory");
  }
  for (int64_t step = 0; step <= options.steps; ++step) {
    const fs::path dir = out / SynthStepDirName(step);
    if (!fs::exists(fs::symlink_status(dir, ec))) continue;
    if (!options.overwrite) {
      return Status::AlreadyExists("synth chain: " + dir.string() +
                                   " already exists (pass overwrite to replace it)");
    }
  }

  DS_ASSIGN_OR_RETURN(std::unique_ptr<SynthTrainer> trainer, SynthTrainer::Create(options.trainer));
  const uint64_t total_bytes = SynthBf16Bytes(specs);
  CheckpointWriteOptions write;
  // Single file when it fits, HF-style shards otherwise.
  write.max_shard_bytes = options.max_shard_bytes != 0 && total_bytes > options.max_shard_bytes
                              ? options.max_shard_bytes
                              : 0;
  write.shard_metadata = {{"format", "pt"}};  // what save_pretrained writes

  for (int64_t step = 0; step <= options.steps; ++step) {
    if (step > 0) trainer->Step();
    const fs::path dir = out / SynthStepDirName(step);
    // A replaced version must not keep files of the old one (say, shards of
    // a larger layout), so it is removed, never merged into.
    fs::remove_all(dir, ec);
    if (ec) return Status::FromErrno(ec.value(), "remove " + dir.string());
    DS_RETURN_IF_ERROR(WriteCheckpoint(dir.string(), trainer->Weights(), write));
    if (options.progress) {
      SynthChainProgress progress;
      progress.step = step;
      progress.total_steps = options.steps;
      progress.dir = dir.string();
      progress.changed_fraction = step > 0 ? trainer->last_step_stats().changed_fraction() : 0.0;
      if (!options.progress(progress)) {
        return Status::Aborted("synth chain: stopped after " + dir.string());
      }
    }
  }
  return WriteFileAtomically((out / kChainManifestName).string(),
                             ChainManifest(options, total_bytes));
}

}  // namespace deltasync
