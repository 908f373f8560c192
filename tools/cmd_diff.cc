// deltasync diff OLD NEW [--json]: per tensor and in total, changed
// elements, density, bytes under each encoding, and the entropy bound.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "deltasync/checkpoint.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/thread_pool.h"

namespace deltasync::cli {
namespace {

struct TensorDiff {
  std::string name;
  DType dtype = DType::kU8;
  uint64_t numel = 0;
  uint64_t changed = 0;
  uint64_t dense_bytes = 0;
  std::vector<uint64_t> encoded;  // per AllEncodings() entry
  double entropy_bytes = 0;
  Status status;
};

// Diffs one tensor pair and sizes every encoding of the change.
TensorDiff DiffOne(const std::string& name, const TensorView& old_t, const TensorView& new_t) {
  TensorDiff d;
  d.name = name;
  d.dtype = new_t.dtype;
  d.numel = static_cast<uint64_t>(new_t.numel());
  d.dense_bytes = new_t.nbytes();
  if (old_t.dtype != new_t.dtype || old_t.shape != new_t.shape) {
    d.status = Status::InvalidArgument(
        "tensor '" + name + "' differs in layout: " + std::string(DTypeName(old_t.dtype)) +
        ShapeToString(old_t.shape) + " vs " + std::string(DTypeName(new_t.dtype)) +
        ShapeToString(new_t.shape));
    return d;
  }
  // The diff compares against a mutable snapshot; the old file is mapped
  // read-only, so it is copied (and left unrefreshed).
  std::vector<uint8_t> snapshot(old_t.bytes.begin(), old_t.bytes.end());
  DiffOptions opts;
  opts.elem_size = static_cast<uint32_t>(DTypeSize(new_t.dtype));
  opts.refresh_snapshot = false;
  opts.keep_old_values = true;
  ChangeSet changes;
  d.status = DiffTensor(new_t.bytes, snapshot, opts, &changes);
  if (!d.status.ok()) return d;
  d.changed = changes.count();
  Result<EntropyBound> bound = EntropyBoundBytes(changes);
  if (!bound.ok()) {
    d.status = bound.status();
    return d;
  }
  d.entropy_bytes = bound->total_bytes();
  std::vector<uint8_t> out;
  for (Encoding e : AllEncodings()) {
    out.clear();
    d.status = Encode(e, new_t.bytes, changes, EncodeOptions{}, &out);
    if (!d.status.ok()) {
      d.status =
          d.status.WithContext("tensor '" + name + "', encoding " + std::string(EncodingName(e)));
      return d;
    }
    d.encoded.push_back(out.size());
  }
  return d;
}

double PerChanged(double bytes, uint64_t changed) { return changed ? bytes / changed : 0.0; }

}  // namespace

void RegisterDiff(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string old_path, new_path;
    bool json = false;
    bool all = false;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "diff",
      "Change statistics between two checkpoints: changed elements, density, bytes under each "
      "encoding and the entropy bound, per tensor and in total");
  cmd->add_option("old", opts->old_path, "Old checkpoint (dir or .safetensors)")->required();
  cmd->add_option("new", opts->new_path, "New checkpoint (dir or .safetensors)")->required();
  cmd->add_flag("--json", opts->json, "Machine-readable output");
  cmd->add_flag("--all", opts->all, "List unchanged tensors too");
  cmd->callback([opts, run] {
    *run = [opts]() -> int {
      Result<std::unique_ptr<Checkpoint>> old_ckpt = Checkpoint::Open(opts->old_path);
      if (!old_ckpt.ok()) return Fail(old_ckpt.status());
      Result<std::unique_ptr<Checkpoint>> new_ckpt = Checkpoint::Open(opts->new_path);
      if (!new_ckpt.ok()) return Fail(new_ckpt.status());
      const auto& old_tensors = (*old_ckpt)->tensors();
      const auto& new_tensors = (*new_ckpt)->tensors();
      for (const auto& [name, t] : new_tensors) {
        if (!old_tensors.count(name)) {
          return Fail("tensor '" + name + "' is in " + opts->new_path + " but not in " +
                      opts->old_path);
        }
      }
      for (const auto& [name, t] : old_tensors) {
        if (!new_tensors.count(name)) {
          return Fail("tensor '" + name + "' is in " + opts->old_path + " but not in " +
                      opts->new_path);
        }
      }
      std::vector<const std::string*> names;
      for (const auto& [name, t] : new_tensors) names.push_back(&name);
      std::vector<TensorDiff> diffs(names.size());
      ThreadPool::Default().ParallelFor(names.size(), [&](size_t i) {
        diffs[i] = DiffOne(*names[i], old_tensors.at(*names[i]), new_tensors.at(*names[i]));
      });
      for (const TensorDiff& d : diffs) {
        if (!d.status.ok()) return Fail(d.status);
      }

      const auto encodings = AllEncodings();
      uint64_t numel = 0, changed = 0, dense = 0, changed_tensors = 0;
      double entropy = 0;
      std::vector<uint64_t> enc_total(encodings.size(), 0);
      for (const TensorDiff& d : diffs) {
        numel += d.numel;
        changed += d.changed;
        dense += d.dense_bytes;
        entropy += d.entropy_bytes;
        changed_tensors += d.changed > 0;
        for (size_t e = 0; e < encodings.size(); ++e) enc_total[e] += d.encoded[e];
      }
      const double density = numel ? static_cast<double>(changed) / numel : 0.0;

      if (opts->json) {
        nlohmann::json out;
        out["old"] = opts->old_path;
        out["new"] = opts->new_path;
        nlohmann::json tensors = nlohmann::json::array();
        for (const TensorDiff& d : diffs) {
          nlohmann::json bytes;
          for (size_t e = 0; e < encodings.size(); ++e) {
            bytes[std::string(EncodingName(encodings[e]))] = d.encoded[e];
          }
          tensors.push_back({{"name", d.name},
                             {"dtype", DTypeName(d.dtype)},
                             {"numel", d.numel},
                             {"changed", d.changed},
                             {"density", d.numel ? static_cast<double>(d.changed) / d.numel : 0.0},
                             {"bytes", bytes},
                             {"entropy_bytes", d.entropy_bytes}});
        }
        out["tensors"] = tensors;
        nlohmann::json bytes, per_changed;
        for (size_t e = 0; e < encodings.size(); ++e) {
          const std::string n(EncodingName(encodings[e]));
          bytes[n] = enc_total[e];
          per_changed[n] = PerChanged(static_cast<double>(enc_total[e]), changed);
        }
        out["total"] = {{"tensors", diffs.size()},
                        {"changed_tensors", changed_tensors},
                        {"numel", numel},
                        {"changed", changed},
                        {"density", density},
                        {"dense_bytes", dense},
                        {"bytes", bytes},
                        {"bytes_per_changed", per_changed},
                        {"entropy_bytes", entropy},
                        {"entropy_bytes_per_changed", PerChanged(entropy, changed)}};
        std::cout << out.dump(2) << std::endl;
        return 0;
      }

      size_t width = 6;
      for (const TensorDiff& d : diffs) width = std::max(width, d.name.size());
      std::printf("%-*s %12s %12s %8s", static_cast<int>(width), "tensor", "numel", "changed",
                  "density");
      for (Encoding e : encodings) std::printf(" %11s", std::string(EncodingName(e)).c_str());
      std::printf(" %11s\n", "entropy");
      for (const TensorDiff& d : diffs) {
        if (!opts->all && d.changed == 0) continue;
        std::printf("%-*s %12llu %12llu %7.3f%%", static_cast<int>(width), d.name.c_str(),
                    static_cast<unsigned long long>(d.numel),
                    static_cast<unsigned long long>(d.changed),
                    d.numel ? 100.0 * d.changed / d.numel : 0.0);
        for (uint64_t b : d.encoded) std::printf(" %11llu", static_cast<unsigned long long>(b));
        std::printf(" %11.0f\n", d.entropy_bytes);
      }
      std::printf("%-*s %12llu %12llu %7.3f%%", static_cast<int>(width), "TOTAL",
                  static_cast<unsigned long long>(numel), static_cast<unsigned long long>(changed),
                  100.0 * density);
      for (uint64_t b : enc_total) std::printf(" %11llu", static_cast<unsigned long long>(b));
      std::printf(" %11.0f\n", entropy);
      std::printf("\n%llu of %zu tensors changed; %llu of %llu elements (%.3f%%)\n",
                  static_cast<unsigned long long>(changed_tensors), diffs.size(),
                  static_cast<unsigned long long>(changed), static_cast<unsigned long long>(numel),
                  100.0 * density);
      std::printf("bytes per changed element:");
      for (size_t e = 0; e < encodings.size(); ++e) {
        std::printf("  %s %.2f", std::string(EncodingName(encodings[e])).c_str(),
                    PerChanged(static_cast<double>(enc_total[e]), changed));
      }
      std::printf("  (entropy bound %.2f)\n", PerChanged(entropy, changed));
      std::printf("full checkpoint: %s; smallest delta: %s\n", FormatBytes(dense).c_str(),
                  FormatBytes(*std::min_element(enc_total.begin(), enc_total.end())).c_str());
      return 0;
    };
  });
}

}  // namespace deltasync::cli
