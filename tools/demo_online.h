// `deltasync demo --online`: the online transport end to end on generated
// data. Trainer ranks (a sharded synthetic trainer, one process each) sync
// every RL step to receivers (one process each) over gloo on loopback, and
// every receiver's weights are checked against the trainer's after every
// step.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "deltasync/stream.h"

namespace deltasync::cli {

struct OnlineDemoConfig {
  std::string preset = "qwen2.5-0.5b";
  uint64_t target_bytes = uint64_t{64} << 20;
  int steps = 8;
  int ranks = 2;      // trainer ranks
  int receivers = 2;  // rollout workers
  double lr = 1e-6;
  uint64_t seed = 0;
  StreamEncoding encoding = StreamEncoding::kIndices;
  std::chrono::milliseconds timeout{120000};
  std::string workdir;  // empty: a temp dir under /tmp
};

// Runs the demo, printing a table per step (or one JSON object); exit 0 only
// when every receiver matched the trainer after every step.
int RunOnlineDemo(const OnlineDemoConfig& config, bool json);

// The hidden `demo-online-peer` command: one trainer rank or receiver.
int RunOnlineDemoPeer(const std::vector<std::string>& args);

}  // namespace deltasync::cli
