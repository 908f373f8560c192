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

// The network namespace, veth pair and addresses of one run's shaped links,
// unique to the run so that two runs on one host never touch each other's:
// the names carry the pid ("dsbench-<pid>", veths "dsb<pid>-0" on the host
// and "dsb<pid>-1" in the namespace, within the 15 characters of an
// interface name for any pid below 10^8), and the two addresses are a /30
// of 10.77.0.0/16 picked from the pid and `attempt` (the next attempt takes
// the next /30, for when another run's holds this one).
struct StreamBenchNet {
  std::string ns, host_veth, ns_veth;
  std::string sender_address, receiver_address;  // without the prefix length
  int prefix_length = 30;
};
StreamBenchNet StreamBenchNetFor(int64_t pid, int attempt = 0);

// Runs the benchmark and prints its tables (or one JSON object); the exit
// code.
int RunStreamBench(const StreamBenchConfig& config, bool json);

// The receiver processes' side (the hidden `bench-stream-peer` command):
// `args` are its flags, documented in bench_stream.cc. The exit code.
int RunStreamBenchPeer(const std::vector<std::string>& args);

}  // namespace deltasync::cli
