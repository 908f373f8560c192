// The rollout-side HTTP agent and the trainer-side sync coordinator.
//
// One agent runs per rollout host. It keeps the host-local checkpoint at a
// version of the delta store (through a CheckpointPuller, normally a
// LocalCheckpoint) and, after each pull, can tell the engine to reload it.
// The trainer publishes a version and then asks every agent to pull it
// (SyncCoordinator / PullOnEngines); a sync succeeds only when every engine
// reports the target version applied and verified.
//
// HTTP API (JSON bodies; Agent below has the details):
//   POST /pull_weights  {"target_version": N | "latest"}  -> pull result
//   GET  /status        applied version, store's latest, busy/idle, last error
//   GET  /health        {"status": "ok"}
//   GET  /metrics       Prometheus text exposition format 0.0.4
// Errors are {"error": "<reason>", "code": "<machine-readable code>"} with a
// 4xx status for a request the agent refuses (nothing is changed) and a 5xx
// status when the pull or the engine reload failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/store.h"

namespace deltasync {

// ---------------------------------------------------------------------------
// What the agent drives

// The host-local checkpoint as the agent sees it. A seam: the agent is
// tested against fakes, and runs against OpenLocalCheckpointPuller.
// Implementations must be safe to call from several threads, but the agent
// never runs two Pull/CurrentVersion/Verify calls at once.
class CheckpointPuller {
 public:
  virtual ~CheckpointPuller() = default;
  // LocalCheckpoint::Pull's contract: brings the local checkpoint to
  // `target` (nullopt = the store's latest) and verifies what it changed.
  virtual Result<PullResult> Pull(std::optional<int64_t> target) = 0;
  // The committed version; nullopt when none is.
  virtual Result<std::optional<int64_t>> CurrentVersion() = 0;
  // The newest version in the store (0 when it holds none). Reads only the
  // store's listing and never waits for the host lock, so that /status
  // answers while a pull is in flight.
  virtual Result<int64_t> LatestVersion() = 0;
  // Recomputes every tensor's checksum (LocalCheckpoint::Verify).
  virtual Status Verify() = 0;
  // The local checkpoint directory: what the engine reloads from.
  virtual const std::string& local() const = 0;
};

// A CheckpointPuller over LocalCheckpoint::Open(options) and the store's
// listing (ListVersionNumbers). Fails as LocalCheckpoint::Open does.
Result<std::unique_ptr<CheckpointPuller>> OpenLocalCheckpointPuller(
    const LocalCheckpointOptions& options);

// Tells the inference engine to reload its weights from the local
// checkpoint after a successful pull.
class EngineReloader {
 public:
  virtual ~EngineReloader() = default;
  // `model_path` is the agent's own local checkpoint dir (never a request
  // field). A non-OK status fails the /pull_weights request with 502.
  virtual Status Reload(const std::string& model_path, int64_t version) = 0;
  // One line for logs and /status, e.g. "POST http://127.0.0.1:30000/...".
  virtual std::string Describe() const = 0;
};

// POSTs {"model_path": <model_path>, "weight_version": "<version>"} (the
// body SGLang's /update_weights_from_disk takes) to `url` (http:// or
// https://, with a path). Succeeds on a 2xx response whose body is not a
// JSON object with "success": false. `timeout_seconds` bounds connecting and
// each read. InvalidArgument for a malformed URL or a non-positive timeout.
Result<std::unique_ptr<EngineReloader>> MakeHttpReloader(const std::string& url,
                                                         double timeout_seconds = 600);

// Runs `/bin/sh -c '<command> "$@"' deltasync-reload <model_path> <version>`:
// the command (which may carry its own arguments) gets the local checkpoint
// dir and the decimal version as its last two arguments, and as the
// environment variables DELTASYNC_MODEL_PATH and DELTASYNC_WEIGHT_VERSION.
// It runs in its own process group with default signal handling; exit 0 is
// success. Past `timeout_seconds` the group is killed and the reload fails.
// InvalidArgument for an empty command or a non-positive timeout.
Result<std::unique_ptr<EngineReloader>> MakeCommandReloader(const std::string& command,
                                                            double timeout_seconds = 600);

// ---------------------------------------------------------------------------
// Agent (rollout side)

inline constexpr size_t kDefaultAgentMaxBodyBytes = 64 * 1024;

struct AgentOptions {
  // Address to listen on. Loopback by default: the agent changes the weights
  // an engine serves, so exposing it needs a token (see `token`).
  std::string host = "127.0.0.1";
  int port = 0;  // 0 = an ephemeral port, see Agent::port()
  // Bearer token. Empty = no authentication, allowed only on a loopback
  // host (127.0.0.0/8, ::1, "localhost"). When set, every request needs
  // "Authorization: Bearer <token>" (compared in constant time) or gets 401.
  std::string token;
  // Requests with a larger body get 413 before the body is read.
  size_t max_body_bytes = kDefaultAgentMaxBodyBytes;
  // Deadlines, not idle timeouts: a request's head (request line and
  // header fields) must have arrived this long after its connection was
  // accepted, and its body this long after that, however the bytes trickle
  // in; past either the request gets 408 and its connection is closed.
  double head_timeout_seconds = 10;
  double body_timeout_seconds = 10;
  // Also run the puller's full Verify (every tensor) after each pull. Pull
  // already verifies every tensor it changed; this re-reads the whole
  // checkpoint, so it is off by default.
  bool verify_after_pull = false;
  // Nice value (0..19) of the threads that read requests and answer
  // /status, /health and /metrics. Pulls run on a thread of their own at the
  // priority of the thread that called Start(), so that a busy scraper cannot
  // take CPU from a pull on a small host. 0 leaves them at that priority.
  int request_nice = 19;
};

// The HTTP agent. /pull_weights requests are served one at a time (a mutex
// here; the puller's host lock serializes against other processes).
//
// /pull_weights body: an empty body or {} or {"target_version": "latest"}
// or {"target_version": null} pulls the store's latest version (the base,
// version 0, when the store is empty); {"target_version": N} with an integer
// (or a decimal string) N >= 0 pulls N, 0 being the engine's base. Other
// fields are ignored. Responses:
//   200 {"version", "applied", "verified": true, "seconds", "bytes_read",
//        "tensors_changed", "changed_elements", "from_version", "reset_to",
//        "versions_applied", "recovered", "reseeded", "reloaded",
//        "reload_seconds"}
//   400 invalid_json | invalid_request | invalid_target_version | bad_request
//   401 unauthorized    404 version_not_found (N is past the store's latest)
//   408 request_timeout 409 precondition_failed (the store's versions do not
//   apply to this host's checkpoint, e.g. another base: retrying cannot help)
//   413 body_too_large  500 pull_failed | store_unreadable | verify_failed
//   502 reload_failed (the pull succeeded; the engine did not reload)
//   503 shutting_down (the agent is stopping; nothing was pulled)
// docs/format.md ("Agent HTTP API") lists every code any endpoint sends.
class Agent {
 public:
  // `puller` is required; `reloader` may be null (no reload). InvalidArgument
  // for a null puller, a non-loopback host without a token, a port outside
  // [0, 65535], a zero body cap or a timeout outside (0, 86400]. Nothing is
  // bound yet.
  static Result<std::unique_ptr<Agent>> Create(const AgentOptions& options,
                                               std::unique_ptr<CheckpointPuller> puller,
                                               std::unique_ptr<EngineReloader> reloader);
  // Stops (as Stop) if still serving.
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Reads the applied version, binds and starts serving on background
  // threads; returns once requests are accepted. IOError "cannot listen on
  // HOST:PORT: <reason>" (e.g. "address already in use") when the address
  // cannot be bound; FailedPrecondition when already started.
  Status Start();
  // The bound port (the ephemeral one when options.port was 0); 0 before Start.
  int port() const;
  // Stops accepting connections, lets requests already accepted finish (an
  // in-flight pull completes; pulls still waiting for it get 503), then
  // returns. Idempotent; safe from any thread but not from a handler.
  void Stop();

 private:
  struct State;
  explicit Agent(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// True for the hosts an agent may serve without a token: IPv4 127.0.0.0/8,
// IPv6 ::1 (with or without brackets) and "localhost".
bool IsLoopbackHost(const std::string& host);

// Reads a token file: its content with surrounding whitespace removed.
// InvalidArgument when that is empty or holds whitespace, control
// characters or '%' (the agent's HTTP parser percent-decodes header values,
// so such a token could not match); IOError when the file cannot be read.
Result<std::string> ReadTokenFile(const std::string& path);

// ---------------------------------------------------------------------------
// Coordinator (trainer side)

struct EnginePullOptions {
  std::string token;  // sent as "Authorization: Bearer <token>" when set
  // Per attempt: connecting, then waiting for the pull's response (the agent
  // answers once the pull, verify and reload are done).
  double connect_timeout_seconds = 10;
  double timeout_seconds = 600;
  // Further attempts after the first, on connection errors, timeouts and
  // 5xx responses. A 4xx response is final (the request itself is wrong).
  int retries = 3;
  // Backoff before retry k (k = 1, 2, ...): initial * 2^(k-1), at most max.
  double backoff_initial_seconds = 0.5;
  double backoff_max_seconds = 30;
};

// What one engine did with a pull request.
struct EnginePullOutcome {
  std::string engine;      // the URL as given
  bool ok = false;         // reported the target version, verified
  std::string error;       // why not, when !ok (the agent's reason when it gave one)
  std::string error_code;  // the agent's "code", or "connection", "timeout", ...
  int http_status = 0;     // of the last attempt; 0 when no response came
  int attempts = 0;
  double seconds = 0;              // all attempts and backoffs
  std::optional<int64_t> version;  // reported by the engine
  bool applied = false;
  uint64_t bytes_read = 0;
  uint64_t tensors_changed = 0;
};

// Asks every engine (a base URL "http://host:port[/prefix]", "https://..." or
// "host:port") to pull `target` (nullopt = "latest"), all at once, one
// thread per engine, with the retries and timeouts of `options`. Returns
// one outcome per engine, in the order given. An engine succeeds only when
// it answers 200 with "verified": true and, for a given target, "version"
// equal to it. Malformed URLs fail their own engine without a request.
// An engine that cannot be reached fails with code "connection" and the
// reason, e.g. "cannot connect: connection refused" (SummarizeEngineOutcomes
// puts the URL in front).
std::vector<EnginePullOutcome> PullOnEngines(const std::vector<std::string>& engines,
                                             std::optional<int64_t> target,
                                             const EnginePullOptions& options);

// OK when every engine URL is one PullOnEngines takes; otherwise
// InvalidArgument naming the first malformed one and what is wrong with it
// ("engine URL 'ftp://h:1': scheme must be http or https"), or saying that
// the list is empty. Lets a caller refuse a sync before it publishes.
Status CheckEngineUrls(const std::vector<std::string>& engines);

// OK when every outcome is ok; otherwise Aborted naming each failed engine
// and its reason: "2 of 3 engines failed: http://a:1: ...; http://b:2: ...".
Status SummarizeEngineOutcomes(const std::vector<EnginePullOutcome>& outcomes);

struct SyncOptions {
  std::vector<std::string> engines;
  EnginePullOptions pull;
};

struct SyncReport {
  int64_t version = 0;
  double publish_seconds = 0;
  PublishResult publish;
  std::vector<EnginePullOutcome> engines;
  double pull_seconds = 0;
  double total_seconds = 0;
  Status status;  // SummarizeEngineOutcomes(engines)
};

// {"ok", "version", "publish_seconds", "publish": {...}, "pull_seconds",
//  "total_seconds", "engines": [{"engine", "ok", "seconds", "attempts",
//  "http_status", "version", "applied", "bytes_read", "tensors_changed",
//  "error", "code"}], "error"} as compact JSON.
std::string SyncReportToJson(const SyncReport& report);

// Trainer side of a sync: publish the next version, then have every engine
// pull it. Holds the Publisher (and so its snapshot) across syncs.
class SyncCoordinator {
 public:
  // InvalidArgument for an empty engine list or a malformed engine URL
  // (CheckEngineUrls) or a null publisher.
  static Result<std::unique_ptr<SyncCoordinator>> Create(const SyncOptions& options,
                                                         std::unique_ptr<Publisher> publisher);
  ~SyncCoordinator();
  SyncCoordinator(const SyncCoordinator&) = delete;
  SyncCoordinator& operator=(const SyncCoordinator&) = delete;

  // Publishes `weights` (Publisher::Publish) and pulls the new version on
  // every engine. A failed publish is returned as the error (nothing was
  // published, no engine was asked); otherwise the report, whose `status`
  // says whether every engine got the version.
  Result<SyncReport> Sync(const std::vector<TensorView>& weights, bool full = false);
  // Sync with the tensors of the checkpoint at `path`.
  Result<SyncReport> SyncCheckpoint(const std::string& path, bool full = false);
  // Asks every engine to pull `target` without publishing (e.g. version 0
  // to materialize the base on every host at startup).
  std::vector<EnginePullOutcome> PullAll(std::optional<int64_t> target);

  Publisher& publisher();

 private:
  struct State;
  explicit SyncCoordinator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace deltasync
