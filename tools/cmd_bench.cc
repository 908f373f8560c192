// deltasync bench [--json] [...]: the performance report behind README.md's
// "Diff and encodings" table (figures and targets), every figure measured
// side by side in one run.
//
// Reading the report: every rate is dense bytes of the model (BF16 bytes of
// all tensors) per second, in GB/s of 1e9 bytes, whatever the operation
// actually touches, so rates compare directly with memcpy. "_1t" runs on the
// calling thread; "_nt" on --threads threads (the diff through its own
// chunking, encode and decode-apply one tensor per task). vs_memcpy_* is the
// diff's time over memcpy's at the same thread count (target <= 1.25).
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>

#include <sstream>

#include "bench_e2e.h"
#include "bench_gpu.h"
#include "bench_runner.h"
#include "bench_sharded.h"
#include "bench_stream.h"
#include "cli_util.h"

namespace deltasync::cli {
namespace {

// Figures are the shortest of the repeats: on a shared machine interference
// only ever adds time, so the minimum is the least disturbed measurement.
constexpr const char* kStatistic = "best";

Result<std::vector<Encoding>> ParseEncodingList(const std::string& text) {
  std::vector<Encoding> encodings;
  if (text == "all") {
    const std::span<const Encoding> all = AllEncodings();
    return std::vector<Encoding>(all.begin(), all.end());
  }
  std::set<Encoding> seen;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string name = text.substr(start, comma - start);
    DS_ASSIGN_OR_RETURN(Encoding encoding, ParseEncoding(name));
    if (seen.insert(encoding).second) encodings.push_back(encoding);
    start = comma + 1;
  }
  return encodings;
}

// sparse's bytes per changed element over `other`'s; null when either was
// not measured.
nlohmann::json SparseRatio(const BenchResult& r, Encoding other) {
  const BenchEncodingResult* sparse = r.Find(Encoding::kSparse);
  const BenchEncodingResult* base = r.Find(other);
  if (sparse == nullptr || base == nullptr || base->encoded_bytes == 0) return nullptr;
  return static_cast<double>(sparse->encoded_bytes) / static_cast<double>(base->encoded_bytes);
}

// sparse's bytes over xor's as the Python peers write it (zstd -1 of the
// XOR image): the yardstick of the 0.7x size target (README.md).
nlohmann::json SparseVsZstd1Xor(const BenchResult& r) {
  const BenchEncodingResult* sparse = r.Find(Encoding::kSparse);
  const BenchEncodingResult* xor_result = r.Find(Encoding::kXor);
  if (sparse == nullptr || xor_result == nullptr || xor_result->zstd1_bytes == 0) return nullptr;
  return static_cast<double>(sparse->encoded_bytes) / static_cast<double>(xor_result->zstd1_bytes);
}

nlohmann::json SparseVsEntropy(const BenchResult& r) {
  const BenchEncodingResult* sparse = r.Find(Encoding::kSparse);
  if (sparse == nullptr || r.entropy_bytes <= 0) return nullptr;
  return static_cast<double>(sparse->encoded_bytes) / r.entropy_bytes;
}

nlohmann::json ReportJson(const BenchConfig& config, const BenchResult& r) {
  nlohmann::json out;
  nlohmann::json encodings_list = nlohmann::json::array();
  for (Encoding e : config.encodings) encodings_list.push_back(EncodingName(e));
  out["config"] = {{"preset", config.preset},
                   {"scale", r.scale},
                   {"bytes", r.dense_bytes},
                   {"requested_bytes", config.target_bytes},
                   {"lr", config.lr},
                   {"seed", config.seed},
                   {"warmup_steps", config.warmup_steps},
                   {"threads", config.threads},
                   {"repeat", config.repeat},
                   {"statistic", kStatistic},
                   {"encodings", encodings_list}};
  out["cpu"] = CpuModelName();
  out["hardware_threads"] = std::thread::hardware_concurrency();
  out["tensors"] = r.tensors;
  out["memcpy_gbps"] = r.Gbps(r.memcpy_time.seconds_1t);
  out["memcpy_gbps_nt"] = r.Gbps(r.memcpy_time.seconds_nt);
  out["diff"] = {{"kernel", r.diff_kernel},
                 {"gbps_1t", r.Gbps(r.diff_time.seconds_1t)},
                 {"gbps_nt", r.Gbps(r.diff_time.seconds_nt)},
                 {"vs_memcpy_1t", r.diff_time.seconds_1t / r.memcpy_time.seconds_1t},
                 {"vs_memcpy_nt", r.diff_time.seconds_nt / r.memcpy_time.seconds_nt}};
  out["diff_gbps"] = r.Gbps(r.diff_time.seconds_1t);
  out["changed"] = r.changed;
  out["numel"] = r.numel;
  out["density"] = r.density();
  out["entropy_bytes"] = r.entropy_bytes;
  out["entropy_bytes_per_changed"] = r.BytesPerChanged(r.entropy_bytes);
  nlohmann::json encodings = nlohmann::json::object();
  for (const BenchEncodingResult& e : r.encodings) {
    const double encode_1t = r.Gbps(e.encode.seconds_1t);
    const double decode_1t = r.Gbps(e.decode_apply.seconds_1t);
    encodings[std::string(EncodingName(e.encoding))] = {
        {"encode_gbps_1t", encode_1t},
        {"encode_gbps_nt", r.Gbps(e.encode.seconds_nt)},
        {"decode_apply_gbps_1t", decode_1t},
        {"decode_apply_gbps_nt", r.Gbps(e.decode_apply.seconds_nt)},
        {"encode_gbps", encode_1t},
        {"decode_apply_gbps", decode_1t},
        {"bytes", e.encoded_bytes},
        {"bytes_per_changed", r.BytesPerChanged(static_cast<double>(e.encoded_bytes))},
        {"tensors", e.tensors}};
    if (e.encoding == Encoding::kXor) {
      encodings["xor"]["zstd1_bytes"] = e.zstd1_bytes;
      encodings["xor"]["zstd1_bytes_per_changed"] =
          r.BytesPerChanged(static_cast<double>(e.zstd1_bytes));
    }
  }
  out["encodings"] = encodings;
  out["ratios"] = {{"sparse_vs_entropy", SparseVsEntropy(r)},
                   {"sparse_vs_xor", SparseRatio(r, Encoding::kXor)},
                   {"sparse_vs_xor_zstd1", SparseVsZstd1Xor(r)},
                   {"sparse_vs_indices", SparseRatio(r, Encoding::kIndices)}};
  return out;
}

std::string Fmt(const char* format, double value) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, value);
  return buf;
}

std::string RatioText(const nlohmann::json& ratio, const char* target) {
  if (ratio.is_null()) return "n/a";
  return Fmt("%.3f", ratio.get<double>()) + " (target <= " + target + ")";
}

void PrintReport(const BenchConfig& config, const BenchResult& r) {
  const nlohmann::json j = ReportJson(config, r);
  std::printf("deltasync bench: %s at scale %.4f, %zu tensors, %s BF16, lr %g, seed %llu\n",
              config.preset.c_str(), r.scale, r.tensors, FormatBytes(r.dense_bytes).c_str(),
              config.lr, static_cast<unsigned long long>(config.seed));
  std::printf("cpu: %s, %u hardware threads; N = %zu threads; each figure the %s of %d runs\n",
              CpuModelName().c_str(), std::thread::hardware_concurrency(), config.threads,
              kStatistic, config.repeat);
  std::printf("changed: %llu of %llu elements (density %.4f%%) after %lld warm-up steps\n",
              static_cast<unsigned long long>(r.changed), static_cast<unsigned long long>(r.numel),
              100.0 * r.density(), static_cast<long long>(config.warmup_steps));
  const std::string nt_label = std::to_string(config.threads) + " threads";
  std::printf("\n%-22s %12s %12s\n", "GB/s of dense bytes", "1 thread", nt_label.c_str());
  std::printf("%-22s %12.2f %12.2f\n", "memcpy", r.Gbps(r.memcpy_time.seconds_1t),
              r.Gbps(r.memcpy_time.seconds_nt));
  const std::string diff_label = "diff (" + r.diff_kernel + ")";
  std::printf("%-22s %12.2f %12.2f\n", diff_label.c_str(), r.Gbps(r.diff_time.seconds_1t),
              r.Gbps(r.diff_time.seconds_nt));
  std::printf("%-22s %11.3fx %11.3fx   (target <= 1.25x)\n", "diff time / memcpy time",
              j["diff"]["vs_memcpy_1t"].get<double>(), j["diff"]["vs_memcpy_nt"].get<double>());

  std::printf("\n%-10s %10s %10s %10s %10s %14s %10s\n", "encoding", "enc 1t", "enc Nt", "apply 1t",
              "apply Nt", "bytes", "B/changed");
  for (const BenchEncodingResult& e : r.encodings) {
    std::printf("%-10s %10.2f %10.2f %10.2f %10.2f %14llu %10.3f\n",
                std::string(EncodingName(e.encoding)).c_str(), r.Gbps(e.encode.seconds_1t),
                r.Gbps(e.encode.seconds_nt), r.Gbps(e.decode_apply.seconds_1t),
                r.Gbps(e.decode_apply.seconds_nt), static_cast<unsigned long long>(e.encoded_bytes),
                r.BytesPerChanged(static_cast<double>(e.encoded_bytes)));
  }
  if (const BenchEncodingResult* x = r.Find(Encoding::kXor)) {
    std::printf("%-10s %43s %14llu %10.3f\n", "xor zstd-1",
                "(the same images as the peers write them)",
                static_cast<unsigned long long>(x->zstd1_bytes),
                r.BytesPerChanged(static_cast<double>(x->zstd1_bytes)));
  }
  std::printf("%-10s %54s %10.3f\n", "entropy", "", r.BytesPerChanged(r.entropy_bytes));
  std::printf("\nsparse / entropy bound: %s\n",
              RatioText(j["ratios"]["sparse_vs_entropy"], "1.25").c_str());
  std::printf("sparse / xor zstd-1:    %s\n",
              RatioText(j["ratios"]["sparse_vs_xor_zstd1"], "0.7").c_str());
  if (!j["ratios"]["sparse_vs_xor"].is_null()) {
    std::printf("sparse / xor (ours):    %.3f\n", j["ratios"]["sparse_vs_xor"].get<double>());
  }
  std::printf("sparse / indices:       %s\n",
              RatioText(j["ratios"]["sparse_vs_indices"], "0.3").c_str());
  std::fflush(stdout);
}

}  // namespace

void RegisterBench(CLI::App& app, CommandFn* run) {
  RegisterHiddenCommand(app, "bench-stream-peer", RunStreamBenchPeer, run);
  RegisterHiddenCommand(app, "bench-sharded-trainer", RunShardedBenchTrainer, run);
  RegisterHiddenCommand(app, "bench-gpu-nccl-peer", RunGpuNcclPeer, run);
  struct Opts {
    std::string preset = "qwen2.5-0.5b";
    std::string bytes = "512MiB";
    double lr = 1e-6;
    uint64_t seed = 0;
    int64_t warmup_steps = 2;
    int64_t threads = 0;
    int64_t repeat = 3;
    std::string encodings = "all";
    bool json = false;
    bool e2e = false;
    std::string workdir, peer, python = "/usr/bin/python3";
    bool keep = false;
    bool cold_store = false;
    bool stream = false;
    bool gpu = false;
    std::string sizes = "1GiB,8GiB";
    double density = 0.015;
    std::string receivers = "1,2,4", links = "10,1", bucket = "16MiB";
    bool sharded = false;
    std::string trainer_ranks = "1,2,4";
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Measure memcpy, diff and every delta encoding side by side on a synthetic RL step held "
      "in memory (throughput in GB/s of dense bytes, sizes per changed element)");
  cmd->add_option("--preset", opts->preset, "Synthetic model preset")->capture_default_str();
  cmd->add_option("--bytes", opts->bytes,
                  "Model size in BF16 bytes: plain bytes or with a unit (512MiB, 1GiB, 2GB)")
      ->capture_default_str();
  cmd->add_option("--lr", opts->lr, "AdamW learning rate")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "Random seed of the synthetic trainer")
      ->capture_default_str();
  cmd->add_option("--warmup-steps", opts->warmup_steps, "Optimiser steps before the measured step")
      ->capture_default_str();
  cmd->add_option("--threads", opts->threads,
                  "Threads for the multi-threaded figures (default or 0: all hardware threads)");
  cmd->add_option("--repeat", opts->repeat, "Runs per figure; the best is reported")
      ->capture_default_str();
  cmd->add_option("--encodings", opts->encodings,
                  "Comma-separated encodings to measure (" + JoinEncodingNames(",") + ") or all")
      ->capture_default_str();
  cmd->add_flag("--json", opts->json, "Print one JSON object instead of the table");
  cmd->add_flag("--e2e", opts->e2e,
                "Time the disk transport end to end instead: deltasync publish + pull (sparse, "
                "xor, full) next to the Python peer, on checkpoint dirs (default --bytes 1GiB, "
                "--repeat 1)");
  cmd->add_flag("--stream", opts->stream,
                "Time the online transport instead: a delta sync per wire encoding against a "
                "full broadcast of the same weights over gloo, receivers as processes, on "
                "loopback and over veth links shaped with tc (default --bytes 1GiB)");
  cmd->add_flag("--gpu", opts->gpu,
                "Time the CUDA kernels instead (fused diff with the snapshot on the device and in "
                "pinned memory, scatter, checksums) against a device copy, a PCIe read and the "
                "torch ops trainers use (through --python), then stream syncs with the tensor "
                "on the device against the same in host memory, on one GPU");
  cmd->add_option("--sizes", opts->sizes,
                  "--gpu: tensor sizes in BF16 bytes, comma-separated; --sharded: model sizes "
                  "(default 256MiB,512MiB,1GiB,2GiB)")
      ->capture_default_str();
  cmd->add_flag("--sharded", opts->sharded,
                "--stream: a sharded trainer instead (trainer ranks as processes, one receiver, "
                "loopback): each rank's peak memory beyond its shards and snapshot, and the "
                "syncs' times, over model sizes (--sizes) and rank counts (--trainer-ranks)");
  cmd->add_option("--trainer-ranks", opts->trainer_ranks,
                  "--stream: trainer rank counts, comma-separated: with --sharded its rows "
                  "(default 1,2,4); otherwise, for each count above 1, a sharded trainer's "
                  "indices sync beside the whole-tensor rows (default: none)");
  cmd->add_option("--density", opts->density, "--gpu: fraction of elements changed per step")
      ->capture_default_str();
  cmd->add_option("--receivers", opts->receivers, "--stream: receiver counts, comma-separated")
      ->capture_default_str();
  cmd->add_option("--links", opts->links,
                  "--stream: shaped link speeds in Gbit/s, comma-separated, or none (needs root)")
      ->capture_default_str();
  cmd->add_option("--bucket", opts->bucket, "--stream: flush frame size bound")
      ->capture_default_str();
  cmd->add_option("--workdir", opts->workdir,
                  "--e2e: empty or new directory to work in (default: a temp dir under /tmp)");
  cmd->add_flag("--keep", opts->keep, "--e2e: keep the work directory");
  cmd->add_flag("--cold-store", opts->cold_store,
                "--e2e: drop the store's files from the page cache before each pull, as on a host "
                "that did not write the store");
  cmd->add_option("--peer", opts->peer, "--e2e: path of vime_peer.py (default: the source tree's)");
  cmd->add_option("--python", opts->python, "--e2e: Python interpreter for the peer")
      ->capture_default_str();
  cmd->callback([opts, run, cmd] {
    *run = [opts, cmd]() -> int {
      if (opts->gpu) {
        for (const char* other : {"--threads", "--encodings", "--e2e", "--stream", "--peer",
                                  "--cold-store", "--keep", "--bytes", "--receivers", "--links",
                                  "--bucket", "--preset", "--lr", "--warmup-steps", "--workdir"}) {
          if (cmd->count(other) > 0) return Fail(std::string(other) + " does not apply to --gpu");
        }
        GpuBenchConfig gc;
        gc.sizes.clear();
        std::stringstream ss(opts->sizes);
        for (std::string item; std::getline(ss, item, ',');) {
          Result<uint64_t> bytes = ParseByteSize(item);
          if (!bytes.ok()) return Fail(bytes.status());
          if (*bytes < 1024) return Fail("--sizes: '" + item + "' is below 1KiB");
          gc.sizes.push_back(*bytes);
        }
        if (gc.sizes.empty()) return Fail("--sizes: no size given");
        if (!(opts->density >= 0 && opts->density <= 1)) return Fail("--density must be in [0, 1]");
        gc.density = opts->density;
        if (cmd->count("--repeat") > 0) {
          if (opts->repeat < 1) return Fail("--repeat must be at least 1");
          gc.repeat = static_cast<int>(opts->repeat);
        }
        gc.seed = opts->seed;
        gc.python = cmd->count("--python") > 0 ? opts->python : "python3";
        return RunGpuBench(gc, opts->json);
      }
      if (opts->sharded) {
        if (!opts->stream) return Fail("--sharded needs --stream");
        for (const char* other :
             {"--threads", "--encodings", "--e2e", "--repeat", "--peer", "--python", "--cold-store",
              "--keep", "--density", "--bytes", "--receivers", "--links", "--lr", "--warmup-steps",
              "--seed", "--workdir"}) {
          if (cmd->count(other) > 0)
            return Fail(std::string(other) + " does not apply to --sharded");
        }
        ShardedBenchConfig hc;
        hc.preset = opts->preset;
        if (cmd->count("--sizes") > 0) {
          hc.sizes.clear();
          std::stringstream ss(opts->sizes);
          for (std::string item; std::getline(ss, item, ',');) {
            Result<uint64_t> bytes = ParseByteSize(item);
            if (!bytes.ok()) return Fail(bytes.status());
            if (*bytes < (uint64_t{1} << 20)) return Fail("--sizes: '" + item + "' is below 1MiB");
            hc.sizes.push_back(*bytes);
          }
          if (hc.sizes.empty()) return Fail("--sizes: no size given");
        }
        Result<std::vector<int>> ranks = ParseCounts("--trainer-ranks", opts->trainer_ranks, 64);
        if (!ranks.ok()) return Fail(ranks.status());
        hc.ranks = std::move(*ranks);
        Result<uint64_t> bucket = ParseByteSize(opts->bucket);
        if (!bucket.ok()) return Fail(bucket.status());
        if (*bucket < (uint64_t{64} << 10)) return Fail("--bucket must be at least 64KiB");
        hc.bucket_bytes = *bucket;
        return RunShardedBench(hc, opts->json);
      }
      if (cmd->count("--trainer-ranks") > 0 && !opts->stream) {
        return Fail("--trainer-ranks needs --stream");
      }
      for (const char* gpu_only : {"--sizes", "--density"}) {
        if (cmd->count(gpu_only) > 0) return Fail(std::string(gpu_only) + " needs --gpu");
      }
      if (opts->stream) {
        for (const char* other : {"--threads", "--encodings", "--e2e", "--repeat", "--peer",
                                  "--python", "--cold-store", "--keep"}) {
          if (cmd->count(other) > 0)
            return Fail(std::string(other) + " does not apply to --stream");
        }
        StreamBenchConfig sc;
        sc.preset = opts->preset;
        if (cmd->count("--bytes") > 0) {
          Result<uint64_t> bytes = ParseByteSize(opts->bytes);
          if (!bytes.ok()) return Fail(bytes.status());
          if (*bytes == 0) return Fail("--bytes must be at least 1 byte");
          sc.target_bytes = *bytes;
        }
        Result<uint64_t> bucket = ParseByteSize(opts->bucket);
        if (!bucket.ok()) return Fail(bucket.status());
        if (*bucket < (uint64_t{64} << 10)) return Fail("--bucket must be at least 64KiB");
        sc.bucket_bytes = *bucket;
        sc.lr = opts->lr;
        sc.seed = opts->seed;
        if (opts->warmup_steps < 0) return Fail("--warmup-steps must not be negative");
        sc.warmup_steps = opts->warmup_steps;
        sc.workdir = opts->workdir;
        Result<std::vector<int>> receivers = ParseCounts("--receivers", opts->receivers, 64);
        if (!receivers.ok()) return Fail(receivers.status());
        sc.receivers = std::move(*receivers);
        if (cmd->count("--trainer-ranks") > 0) {
          Result<std::vector<int>> ranks = ParseCounts("--trainer-ranks", opts->trainer_ranks, 64);
          if (!ranks.ok()) return Fail(ranks.status());
          sc.trainer_ranks = std::move(*ranks);
        }
        if (sc.receivers.front() != 1) {
          return Fail("--receivers must start with 1 (the link's speed is measured with one)");
        }
        sc.shaped_gbit.clear();
        if (opts->links != "none") {
          std::stringstream ls(opts->links);
          for (std::string item; std::getline(ls, item, ',');) {
            char* end = nullptr;
            const double g = std::strtod(item.c_str(), &end);
            if (end == item.c_str() || *end != '\0' || g <= 0 || g > 400) {
              return Fail("--links: '" + item + "' is not a speed in Gbit/s (or use none)");
            }
            sc.shaped_gbit.push_back(g);
          }
        }
        return RunStreamBench(sc, opts->json);
      }
      for (const char* stream_only : {"--receivers", "--links", "--bucket"}) {
        if (cmd->count(stream_only) > 0) return Fail(std::string(stream_only) + " needs --stream");
      }
      if (opts->e2e) {
        for (const char* other : {"--threads", "--encodings"}) {
          if (cmd->count(other) > 0) return Fail(std::string(other) + " does not apply to --e2e");
        }
        E2eConfig e2e;
        e2e.preset = opts->preset;
        if (cmd->count("--bytes") > 0) {
          Result<uint64_t> bytes = ParseByteSize(opts->bytes);
          if (!bytes.ok()) return Fail(bytes.status());
          if (*bytes == 0) return Fail("--bytes must be at least 1 byte");
          e2e.target_bytes = *bytes;
        }
        e2e.lr = opts->lr;
        e2e.seed = opts->seed;
        if (opts->warmup_steps < 0) return Fail("--warmup-steps must not be negative");
        e2e.warmup_steps = opts->warmup_steps;
        if (cmd->count("--repeat") > 0) {
          if (opts->repeat < 1 || opts->repeat > 1000) return Fail("--repeat must be in [1, 1000]");
          e2e.repeat = static_cast<int>(opts->repeat);
        }
        e2e.workdir = opts->workdir;
        e2e.keep = opts->keep;
        e2e.cold_store = opts->cold_store;
        e2e.peer_script = opts->peer;
        e2e.python = opts->python;
        return RunE2eCommand(e2e, opts->json);
      }
      for (const char* e2e_only : {"--workdir", "--keep", "--peer", "--python", "--cold-store"}) {
        if (cmd->count(e2e_only) > 0) return Fail(std::string(e2e_only) + " needs --e2e");
      }
      BenchConfig config;
      config.preset = opts->preset;
      Result<uint64_t> bytes = ParseByteSize(opts->bytes);
      if (!bytes.ok()) return Fail(bytes.status());
      if (*bytes == 0) return Fail("--bytes must be at least 1 byte");
      config.target_bytes = *bytes;
      config.lr = opts->lr;
      config.seed = opts->seed;
      if (opts->warmup_steps < 0) return Fail("--warmup-steps must not be negative");
      config.warmup_steps = opts->warmup_steps;
      if (opts->threads < 0) return Fail("--threads must not be negative");
      config.threads = opts->threads > 0 ? static_cast<size_t>(opts->threads)
                                         : std::max(1u, std::thread::hardware_concurrency());
      if (opts->repeat < 1 || opts->repeat > 1000) return Fail("--repeat must be in [1, 1000]");
      config.repeat = static_cast<int>(opts->repeat);
      Result<std::vector<Encoding>> encodings = ParseEncodingList(opts->encodings);
      if (!encodings.ok()) return Fail(encodings.status());
      config.encodings = *encodings;

      BenchProgress progress;
      if (isatty(STDERR_FILENO) == 1) {
        progress = [](std::string_view line) {
          std::cerr << "deltasync bench: " << line << std::endl;
        };
      }
      Result<BenchResult> result = RunBench(config, progress);
      if (!result.ok()) return Fail(result.status());
      if (opts->json) {
        std::cout << ReportJson(config, *result).dump(2) << std::endl;
      } else {
        PrintReport(config, *result);
      }
      return 0;
    };
  });
}

}  // namespace deltasync::cli
