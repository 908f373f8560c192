// `deltasync bench --e2e`: the disk transport end to end. A synthetic RL
// step pair is written as two checkpoint directories; then, side by side in
// one run, the real `deltasync publish` / `deltasync pull` commands (sparse
// and xor deltas, and a full version) and the Python peer of the vime/slime
// transport (tests/peer/vime_peer.py, xor) each publish the step into a fresh
// store and pull it into a host-local checkpoint already at version 0. Every
// operation runs as a child process, so that its wall time and its peak
// memory are its own; every pulled checkpoint is compared byte for byte with
// the new checkpoint.
//
// Page cache: nothing is dropped between operations. The step pair, the
// version a publish has just written and the local checkpoint just
// materialized are all hot, as on a host that has just received them; the
// peer gets exactly the same treatment. Each implementation syncs what it
// syncs by default (the peer msyncs the applied tensors, deltasync commits
// without a data sync unless --durable), so the durable pull is timed too.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_runner.h"
#include "deltasync/status.h"

namespace deltasync::cli {

struct E2eConfig {
  std::string preset = "qwen2.5-0.5b";
  uint64_t target_bytes = uint64_t{1} << 30;  // BF16 bytes of the model
  double lr = 1e-6;
  uint64_t seed = 0;
  int64_t warmup_steps = 2;  // steps before the old checkpoint; new = one more
  int repeat = 1;            // each time is the best (shortest) of this many runs; >= 1
  // Directory the run works in: created, and it must be empty if it exists.
  // Empty = a fresh directory under $TMPDIR (or /tmp). Removed at the end
  // unless `keep`; when the bench created it, the directory itself too.
  std::string workdir;
  bool keep = false;
  std::string cli_path;     // the deltasync binary to run; empty = this process's executable
  std::string peer_script;  // vime_peer.py; empty = DefaultPeerScript()
  std::string python = "/usr/bin/python3";
  // Drop the store's files from the page cache before each pull (after
  // syncing them), as on a host that did not write the store itself; the
  // two checkpoints and the host's own stay cached.
  bool cold_store = false;
};

// tests/peer/vime_peer.py of the source tree this binary was built from.
std::string DefaultPeerScript();

// What one child process cost, as the kernel and the command report it.
struct E2eProcess {
  double wall_seconds = 0;  // spawn to exit, as seen by the bench
  double self_seconds = 0;  // the "seconds" of the command's own JSON summary
  double cpu_seconds = 0;   // user + system CPU time of the process
  double peak_rss_mib = 0;  // ru_maxrss: anonymous plus touched file-backed pages
  // High-water marks of /proc/<pid>/status RssAnon and RssFile, sampled
  // every 10 ms (a peak shorter than that can be missed).
  double peak_anon_mib = 0;
  double peak_file_mib = 0;
};

// One publish followed by one pull, best of E2eConfig::repeat runs.
struct E2eMeasurement {
  bool ran = false;
  std::string note;  // why it did not run, or what to know about it
  // Best of the repeats; for deltasync the wall time (process start
  // included), for the peer its self-reported time (interpreter start and
  // imports excluded).
  double publish_seconds = 0;
  double pull_seconds = 0;
  std::optional<double> pull_durable_seconds;  // deltasync only: pull --durable
  E2eProcess publish;                          // best wall and self times, highest peaks
  E2eProcess pull;
  std::optional<E2eProcess> pull_durable;
  uint64_t bytes = 0;             // written into the version dir by the publish
  uint64_t pull_bytes_read = 0;   // as the pull reports it
  uint64_t tensors_changed = 0;   // deltas: tensors the version holds
  uint64_t changed_elements = 0;  // deltasync deltas only
  uint64_t total_elements = 0;
  bool verified = false;  // every pulled checkpoint equals the new one bit for bit

  double total_seconds() const { return publish_seconds + pull_seconds; }
};

struct E2eResult {
  double scale = 0;
  uint64_t model_bytes = 0;  // BF16 bytes of every tensor
  // A pull decodes a tensor at a time per thread, so its private memory
  // follows this rather than the model's size.
  uint64_t largest_tensor_bytes = 0;
  uint64_t numel = 0;
  uint64_t changed = 0;  // elements the measured step changed (the trainer's count)
  size_t tensors = 0;
  std::string workdir;
  bool kept = false;
  // The bench's own RSS when it spawned a child, highest over the run: no
  // child's peak_rss_mib can be reported below it (see RunChild).
  double rss_floor_mib = 0;
  nlohmann::json load_average_start;  // 1-minute load average when the run began (or null)
  std::string cli_path;
  std::string peer_script;
  E2eMeasurement sparse;
  E2eMeasurement xor_delta;
  E2eMeasurement full;
  E2eMeasurement peer;  // vime_peer.py, xor

  double density() const { return numel ? static_cast<double>(changed) / numel : 0.0; }
};

// Writes the step pair, runs every measurement and checks every pull
// bit-exactly. A pulled checkpoint that differs from the new one, a command
// that fails or reports something other than the expected version, or a
// changed-element count that disagrees with the trainer's, is an Internal
// error naming it. The Python peer is skipped (with a note) when the
// interpreter or its modules are missing or the default script is absent;
// an explicitly given peer script that does not exist is InvalidArgument.
Result<E2eResult> RunE2eBench(const E2eConfig& config, const BenchProgress& progress = {});

// The targets the report checks (time ratios, lower is better).
inline constexpr double kE2eSparseVsPeerTarget = 0.3;
inline constexpr double kE2eXorVsPeerTarget = 0.5;
inline constexpr double kE2eDeltaVsFullTarget = 0.1;

// The --json report.
nlohmann::json E2eReportJson(const E2eConfig& config, const E2eResult& result);
// The table on stdout.
void PrintE2eReport(const E2eConfig& config, const E2eResult& result);

// The body of `deltasync bench --e2e`: runs the bench (progress on stderr
// when it is a terminal) and prints the table or, with `json`, the JSON
// report. Returns the exit code; errors are one line on stderr.
int RunE2eCommand(const E2eConfig& config, bool json);

}  // namespace deltasync::cli
