// What `deltasync demo` runs: a whole RL weight-sync deployment in one
// process, on generated data. An in-process trainer (SynthTrainer: fp32
// master weights, AdamW, cast to BF16 every step) publishes each step's
// weights as a delta into a store in a work dir; rollout hosts, each an HTTP
// agent on a loopback port with its own host-local checkpoint, pull every
// version when the trainer-side SyncCoordinator asks; after each step every
// local checkpoint is compared bit for bit with the trainer's weights.
//
// Also the agent benchmark (`deltasync demo --bench-agent`): the cost of
// pulling through the HTTP agent against a direct library pull of the same
// versions, and whether /status traffic slows pulls down.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/codec.h"
#include "deltasync/status.h"

namespace deltasync::cli {

struct DemoConfig {
  std::string preset = "qwen2.5-0.5b";
  uint64_t target_bytes = uint64_t{512} << 20;  // BF16 bytes of the model
  int64_t steps = 45;                           // RL steps, one version each; >= 1
  uint64_t seed = 0;
  double lr = 1e-6;
  Encoding encoding = Encoding::kSparse;
  // Where the base checkpoint, the store and the hosts' local checkpoints
  // go. Empty: a fresh directory under $TMPDIR (or /tmp). A given one must
  // be missing or empty (the demo never writes into a user's files).
  std::string workdir;
  bool keep = false;  // leave the work dir in place; otherwise it is removed at the end
};

// One engine (an agent) as the demo deploys it.
struct DemoEngine {
  std::string name;   // "A", "B/rank0", "B/rank1"
  std::string url;    // http://127.0.0.1:PORT
  std::string local;  // the host-local checkpoint it keeps
};

// What one engine answered in one step.
struct DemoEnginePull {
  std::string name;
  bool ok = false;  // reported the target version, verified
  bool applied = false;
  double seconds = 0;  // request to answer, as the coordinator saw it
  uint64_t bytes_read = 0;
  std::string error;
};

// One row of the demo: the seed (step 0: every host materializes the base)
// or one RL step (train, publish a version, pull it everywhere, verify).
struct DemoStep {
  int64_t step = 0;
  int64_t version = 0;  // the store version the hosts were brought to
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  uint64_t delta_bytes = 0;  // files of the published version (seed: 0)
  uint64_t full_bytes = 0;   // BF16 bytes of the whole model
  double train_seconds = 0;
  double publish_seconds = 0;
  double pull_seconds = 0;  // slowest engine
  double verify_seconds = 0;
  std::vector<DemoEnginePull> engines;
  // Ranks of the two-rank host that applied the version: 1 when the host
  // lock collapses their pulls into one apply (the other finds it done).
  int shared_host_applies = 0;
  bool verified = false;  // every local checkpoint equals the trainer's weights
  std::string error;      // the first problem, when !verified

  double changed_fraction() const {
    return total_elements ? static_cast<double>(changed_elements) / total_elements : 0.0;
  }
};

struct DemoSetup {
  std::string preset;
  double scale = 0;
  uint64_t parameters = 0;
  uint64_t model_bytes = 0;
  size_t tensors = 0;
  std::string workdir;
  std::string store;
  std::string base;
  std::vector<DemoEngine> engines;
  double setup_seconds = 0;  // trainer init, base checkpoint, publisher, agents
};

struct DemoResult {
  DemoSetup setup;
  DemoStep seed;
  std::vector<DemoStep> steps;
  bool all_verified = false;  // the seed and every step
  double total_seconds = 0;
};

// Called as the demo goes, so that a terminal shows it live.
struct DemoObserver {
  std::function<void(const DemoSetup&)> on_setup;
  std::function<void(const DemoStep&)> on_step;  // the seed, then each step
};

// Runs the demo. A step whose checkpoints do not match (or whose pulls
// fail) is reported in its row and makes all_verified false; later steps
// still run. Errors (returned): InvalidArgument for a bad config or a
// non-empty work dir, and failures to set the deployment up (IOError,
// OutOfRange when the model does not fit in memory, the store's errors).
Result<DemoResult> RunDemo(const DemoConfig& config, const DemoObserver& observer = {});

// ---------------------------------------------------------------------------
// Agent benchmark

struct AgentBenchConfig {
  DemoConfig demo;  // preset, size, seed, lr, encoding, work dir
  // Versions pulled both ways for the overhead figure (after one warm-up
  // version), and versions pulled both with and without /status load.
  int64_t overhead_versions = 8;
  int64_t load_versions = 8;
  // /status load during a loaded pull: this many client threads, each
  // sending requests one after another (a fresh connection each: the agent
  // serves one request per connection), pausing interval_ms between them
  // (0 = back to back), at most max_requests_per_thread each and never past
  // the pull's end. The default is a bounded load (up to 400 requests a
  // second), far above any monitoring poller; back to back is a CPU stress
  // test that on a small host competes with the pull for cores.
  int status_threads = 4;
  double status_interval_ms = 10;
  int64_t max_requests_per_thread = 20000;
  // Nice value of the client threads. A monitoring scraper runs on another
  // host or as its own low-priority process; here it shares the bench's
  // process, so by default it runs at nice 19 and the ratio measures what
  // serving /status costs the pull, not what a busy client on the same
  // cores would cost any process. 0 runs the clients at normal priority.
  int status_client_nice = 19;
};

struct AgentBenchResult {
  DemoSetup setup;
  // Overhead: per version, wall time of POST /pull_weights through the
  // coordinator's client and of LocalCheckpoint::Pull on a second local
  // checkpoint, the two alternating which goes first.
  std::vector<double> http_ms;
  std::vector<double> agent_pull_ms;  // the pull as the agent timed it
  std::vector<double> direct_ms;
  double http_median_ms = 0;
  double direct_median_ms = 0;
  double overhead_median_ms = 0;  // median of per-version (http - direct)
  // Median of per-version (http - agent-timed pull): what HTTP, JSON and
  // the agent's bookkeeping add to the same pull, free of the variation
  // between two pulls.
  double transport_median_ms = 0;
  // Load: each version pulled through one agent under /status traffic and
  // through a second, quiet agent (index i of both vectors is version i).
  std::vector<double> unloaded_ms;
  std::vector<double> loaded_ms;
  std::vector<double> pair_ratios;  // loaded / unloaded, per version
  double unloaded_median_ms = 0;
  double loaded_median_ms = 0;
  double load_ratio = 0;         // loaded median / unloaded median
  double pair_ratio_median = 0;  // median of pair_ratios
  double worst_pair_ratio = 0;   // largest of pair_ratios
  // Both lists sorted, the largest ratio of the k-th fastest loaded pull to
  // the k-th fastest quiet one: how far the load shifts any quantile of the
  // pull time. Unlike a single pair, it is not at the mercy of one noisy
  // quiet pull (two pulls of the same version differ by up to 20% here with
  // no load at all; see the overhead section's pairs).
  double worst_quantile_ratio = 0;
  // Per two consecutive versions, whose agents swap roles: the geometric
  // mean of their pair ratios, free of one agent's own bias (its checkpoint
  // pulling some percent slower than the other's, load or not).
  std::vector<double> swapped_pair_ratios;
  double worst_swapped_pair_ratio = 0;
  uint64_t status_requests = 0;
  uint64_t status_errors = 0;  // non-200 answers and failed connections
  double status_requests_per_second = 0;
  // Round trips of the /status requests sent during the timed loaded pulls.
  double status_p50_ms = 0;
  double status_p99_ms = 0;
  double status_max_ms = 0;
  // The same load with no pull running, for one second: the CPU it costs
  // the whole process (clients and agent), as a fraction of one core. On a
  // host whose pull uses every core, that fraction bounds what the load can
  // take from a pull; it is measured directly where the pull-time ratio is
  // within run-to-run noise.
  uint64_t idle_load_requests = 0;
  double idle_load_seconds = 0;
  double idle_load_cpu_seconds = 0;
  // Of that, what the agent's request threads spent (its /metrics counters,
  // the bench's own two scrapes left out): the part a scraper on another
  // host would still cost this one.
  double idle_load_agent_connections = 0;
  double idle_load_agent_cpu_seconds = 0;
  bool verified = false;  // both local checkpoints equal the trainer's weights at the end
  double total_seconds = 0;
};

// Progress lines for a terminal.
using AgentBenchProgress = std::function<void(std::string_view)>;

// Runs the agent benchmark: one in-process agent and one direct
// LocalCheckpoint over one store, fed by an in-process trainer. Errors as
// RunDemo; an Internal error when a pull fails or a checkpoint ends up
// different from the trainer's weights.
Result<AgentBenchResult> RunAgentBench(const AgentBenchConfig& config,
                                       const AgentBenchProgress& progress = {});

// Median of `values` (0 for none).
double Median(std::vector<double> values);

}  // namespace deltasync::cli
