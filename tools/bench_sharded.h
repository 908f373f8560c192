// `deltasync bench --stream --sharded`: a sharded trainer's memory and sync
// time. For each model size and each number of trainer ranks, every rank is
// a process holding its rows of every tensor, syncing a seed and then a
// delta to one receiver process over gloo on loopback; each rank reports
// its peak resident memory beyond its own shards and its snapshot, which
// must not grow with the model.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace deltasync::cli {

struct ShardedBenchConfig {
  std::string preset = "qwen2.5-0.5b";
  std::vector<uint64_t> sizes = {uint64_t{256} << 20, uint64_t{512} << 20, uint64_t{1} << 30,
                                 uint64_t{2} << 30};
  std::vector<int> ranks = {1, 2, 4};
  uint64_t bucket_bytes = uint64_t{16} << 20;
  std::chrono::milliseconds timeout{300000};
};

// Runs the benchmark and prints its table (or one JSON object); the exit
// code.
int RunShardedBench(const ShardedBenchConfig& config, bool json);

// A trainer rank's side (the hidden `bench-sharded-trainer` command):
// `args` are its flags, documented in bench_sharded.cc. The exit code.
int RunShardedBenchTrainer(const std::vector<std::string>& args);

}  // namespace deltasync::cli
