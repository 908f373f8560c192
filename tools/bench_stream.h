// `deltasync bench --stream`: the online transport measured against a full
// broadcast of the same weights over the same communicator, with receivers
// as processes of their own, on loopback and over veth links shaped with tc.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "deltasync/stream.h"

namespace deltasync::cli {

struct StreamBenchConfig {
  std::string preset = "qwen2.5-0.5b";
  uint64_t target_bytes = uint64_t{1} << 30;
  double lr = 1e-6;
  uint64_t seed = 0;
  int64_t warmup_steps = 2;
  std::vector<int> receivers = {1, 2, 4};
  std::vector<StreamEncoding> encodings = {StreamEncoding::kDense, StreamEncoding::kIndices,
                                           StreamEncoding::kSparse};
  uint64_t bucket_bytes = uint64_t{64} << 20;
  // Shaped links, in Gbit/s, after loopback; skipped with a message where
  // network namespaces cannot be made.
  std::vector<double> shaped_gbit = {10, 1};
  std::chrono::milliseconds timeout{300000};
  std::string workdir;  // empty: a temp dir under /tmp
};

// Runs the benchmark and prints its tables (or one JSON object); the exit
// code.
int RunStreamBench(const StreamBenchConfig& config, bool json);

// The receiver processes' side (the hidden `bench-stream-peer` command):
// `args` are its flags, documented in bench_stream.cc. The exit code.
int RunStreamBenchPeer(const std::vector<std::string>& args);

}  // namespace deltasync::cli
