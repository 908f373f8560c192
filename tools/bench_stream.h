// `deltasync bench --stream`: the online transport measured against a full
// broadcast of the same weights over the same communicator, with receivers
// as processes of their own, on loopback and over a switch whose hosts each
// have an uplink shaped with tc.
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
  // For each count above 1, a sharded trainer of that many ranks (processes
  // on the sender's host, the trainer group on its loopback) syncs the
  // same shapes with `indices` beside the whole-tensor rows.
  std::vector<int> trainer_ranks = {1};
  std::chrono::milliseconds timeout{300000};
  std::string workdir;  // empty: a temp dir under /tmp
};

// The shaped network of one run, as hosts on a switch: the switch is a
// bridge in a network namespace of its own ("dsbench-<pid>"), each receiver
// a namespace of its own ("dsbench-<pid>-r<i>"), and every host (the sender,
// which stays in the host's namespace, and each receiver) reaches the
// switch through an uplink of its own, a veth pair shaped at both ends as a
// NIC is. Only the sender's uplink has a name in the host's namespace
// ("dsb<pid>-0", within the 15 characters of an interface name for any pid
// below 10^8); the others live in the namespaces. The addresses are a /24
// of 10.77.0.0/16 picked from the pid and `attempt` (the next attempt takes
// the next, for when another run's holds this one): .1 the sender, .10 + i
// receiver i. Unique to the run, so two runs on one host never touch each
// other's.
struct StreamBenchNet {
  std::string ns;              // the switch's namespace
  std::string host_veth;       // the sender's end of its uplink
  std::string sender_address;  // without the prefix length
  int prefix_length = 24;
  std::string subnet;  // "10.77.K." the addresses' first three parts
  // Receiver i's (from 1) namespace and address.
  std::string ReceiverNs(int i) const { return ns + "-r" + std::to_string(i); }
  std::string ReceiverAddress(int i) const { return subnet + std::to_string(10 + i); }
};
StreamBenchNet StreamBenchNetFor(int64_t pid, int attempt = 0);

// Runs the benchmark and prints its tables (or one JSON object); the exit
// code.
int RunStreamBench(const StreamBenchConfig& config, bool json);

// The receiver processes' side (the hidden `bench-stream-peer` command):
// `args` are its flags, documented in bench_stream.cc. The exit code.
int RunStreamBenchPeer(const std::vector<std::string>& args);

}  // namespace deltasync::cli
