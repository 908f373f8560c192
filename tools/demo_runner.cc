#include "demo_runner.h"

#include <httplib.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "deltasync/agent.h"
#include "deltasync/checkpoint.h"
#include "deltasync/store.h"
#include "deltasync/synth.h"
#include "deltasync/timing.h"

namespace deltasync::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::string Join(const std::string& dir, std::string_view name) {
  return dir + "/" + std::string(name);
}

// The demo's scratch directory. Removed on destruction unless kept; a
// directory the user named is only ever used when it was missing or empty,
// so removing it never takes anything the demo did not write.
class WorkDir {
 public:
  static Result<std::unique_ptr<WorkDir>> Create(const std::string& requested, bool keep) {
    std::string path = requested;
    std::error_code ec;
    if (path.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/deltasync-demo.XXXXXX";
      if (::mkdtemp(pattern.data()) == nullptr) {
        return Status::IOError("cannot create a work dir from '" + pattern +
                               "': " + std::strerror(errno));
      }
      path = pattern;
    } else if (std::filesystem::exists(path, ec)) {
      if (!std::filesystem::is_directory(path, ec)) {
        return Status::InvalidArgument("work dir '" + path + "' is not a directory");
      }
      if (!std::filesystem::is_empty(path, ec) || ec) {
        return Status::InvalidArgument("work dir '" + path +
                                       "' is not empty (the demo only writes into a missing or "
                                       "empty directory)");
      }
    } else if (!std::filesystem::create_directories(path, ec) || ec) {
      return Status::IOError("cannot create work dir '" + path + "': " + ec.message());
    }
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    return std::unique_ptr<WorkDir>(new WorkDir(std::filesystem::absolute(path).string(), keep));
  }
  ~WorkDir() {
    if (keep_) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  WorkDir(const WorkDir&) = delete;
  WorkDir& operator=(const WorkDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  WorkDir(std::string path, bool keep) : path_(std::move(path)), keep_(keep) {}
  std::string path_;
  bool keep_;
};

// Corruption naming the first tensor of `dir` (an HF checkpoint dir) that
// differs from `expected` in name, dtype, shape or any byte.
Status CompareWithWeights(const std::string& dir, const std::vector<TensorView>& expected) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(dir));
  const std::map<std::string, TensorView>& held = checkpoint->tensors();
  if (held.size() != expected.size()) {
    return Status::Corruption(dir + " holds " + std::to_string(held.size()) +
                              " tensors, the trainer " + std::to_string(expected.size()));
  }
  for (const TensorView& want : expected) {
    auto it = held.find(want.name);
    if (it == held.end()) {
      return Status::Corruption(dir + " lacks tensor '" + want.name + "'");
    }
    const TensorView& got = it->second;
    if (got.dtype != want.dtype || got.shape != want.shape) {
      return Status::Corruption("tensor '" + want.name + "' in " + dir + " is " +
                                std::string(DTypeName(got.dtype)) + ShapeToString(got.shape) +
                                ", the trainer's " + std::string(DTypeName(want.dtype)) +
                                ShapeToString(want.shape));
    }
    if (got.bytes.size() != want.bytes.size() ||
        std::memcmp(got.bytes.data(), want.bytes.data(), want.bytes.size()) != 0) {
      const auto mismatch =
          std::mismatch(want.bytes.begin(), want.bytes.end(), got.bytes.begin(), got.bytes.end());
      return Status::Corruption("tensor '" + want.name + "' in " + dir +
                                " differs from the trainer's at byte " +
                                std::to_string(mismatch.first - want.bytes.begin()));
    }
  }
  return Status::OK();
}

// The trainer, its base checkpoint (version 0 for every host) and an empty
// store: what both the demo and the agent benchmark start from.
struct Testbed {
  std::unique_ptr<WorkDir> work;
  std::unique_ptr<SynthTrainer> trainer;
  DemoSetup setup;
};

Result<Testbed> MakeTestbed(const DemoConfig& config) {
  if (config.steps < 1 || config.steps > 100000) {
    return Status::InvalidArgument("steps must be in 1..100000, got " +
                                   std::to_string(config.steps));
  }
  if (config.target_bytes == 0) return Status::InvalidArgument("model size must be positive");
  const auto start = Clock::now();
  Testbed bed;
  DS_ASSIGN_OR_RETURN(const double scale, SynthScaleForBytes(config.preset, config.target_bytes));
  SynthConfig synth;
  synth.preset = config.preset;
  synth.scale = scale;
  synth.seed = config.seed;
  synth.lr = config.lr;
  // The work dir is made after the config has been validated, so that a bad
  // preset leaves no directory behind.
  DS_ASSIGN_OR_RETURN(bed.work, WorkDir::Create(config.workdir, config.keep));
  DS_ASSIGN_OR_RETURN(bed.trainer, SynthTrainer::Create(synth));

  DemoSetup& s = bed.setup;
  s.preset = config.preset;
  s.scale = scale;
  s.parameters = static_cast<uint64_t>(SynthParameterCount(bed.trainer->specs()));
  s.model_bytes = SynthBf16Bytes(bed.trainer->specs());
  s.tensors = bed.trainer->specs().size();
  s.workdir = bed.work->path();
  s.store = Join(s.workdir, "store");
  s.base = Join(s.workdir, "base");
  CheckpointWriteOptions write;
  write.max_shard_bytes = uint64_t{2} << 30;  // as save_pretrained shards, one file up to 2 GiB
  DS_RETURN_IF_ERROR(WriteCheckpoint(s.base, bed.trainer->Weights(), write));
  // The trainer makes the store before the engines seed from the base: a
  // pull refuses a store that does not exist (a mistyped path).
  std::error_code ec;
  std::filesystem::create_directories(s.store, ec);
  if (ec) return Status::FromErrno(ec.value(), s.store + ": create store directory");
  s.setup_seconds = SecondsSince(start);
  return bed;
}

Result<std::unique_ptr<Agent>> StartAgent(const DemoSetup& setup, const std::string& local) {
  LocalCheckpointOptions options;
  options.local = local;
  options.store = setup.store;
  options.base = setup.base;
  DS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointPuller> puller, OpenLocalCheckpointPuller(options));
  AgentOptions agent_options;  // loopback, an ephemeral port, no token
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Agent> agent,
                      Agent::Create(agent_options, std::move(puller), nullptr));
  DS_RETURN_IF_ERROR(agent->Start());
  return agent;
}

std::string AgentUrl(const Agent& agent) {
  return "http://127.0.0.1:" + std::to_string(agent.port());
}

// Fills the engine columns of `row` from the coordinator's outcomes and
// compares every distinct local checkpoint with the trainer's weights.
void FinishRow(const std::vector<DemoEngine>& engines,
               const std::vector<EnginePullOutcome>& outcomes,
               const std::vector<TensorView>& weights, DemoStep* row) {
  std::vector<std::string> problems;
  for (size_t i = 0; i < engines.size() && i < outcomes.size(); ++i) {
    const EnginePullOutcome& o = outcomes[i];
    DemoEnginePull pull;
    pull.name = engines[i].name;
    pull.ok = o.ok && o.version == row->version;
    pull.applied = o.applied;
    pull.seconds = o.seconds;
    pull.bytes_read = o.bytes_read;
    if (!pull.ok) {
      pull.error =
          o.error.empty() ? "reported version " + std::to_string(o.version.value_or(-1)) : o.error;
      problems.push_back(engines[i].name + ": " + pull.error);
    }
    row->pull_seconds = std::max(row->pull_seconds, pull.seconds);
    if (engines[i].name.rfind("B/", 0) == 0 && pull.applied) ++row->shared_host_applies;
    row->engines.push_back(std::move(pull));
  }
  const auto verify_start = Clock::now();
  std::vector<std::string> checked;
  for (const DemoEngine& engine : engines) {
    if (std::find(checked.begin(), checked.end(), engine.local) != checked.end()) continue;
    checked.push_back(engine.local);
    if (Status s = CompareWithWeights(engine.local, weights); !s.ok()) {
      problems.push_back(s.ToString());
    }
  }
  row->verify_seconds = SecondsSince(verify_start);
  row->verified = problems.empty();
  if (!problems.empty()) row->error = problems.front();
}

}  // namespace

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

Result<DemoResult> RunDemo(const DemoConfig& config, const DemoObserver& observer) {
  const auto start = Clock::now();
  DS_ASSIGN_OR_RETURN(Testbed bed, MakeTestbed(config));
  const auto agents_start = Clock::now();
  DemoResult result;
  DemoSetup& setup = bed.setup;

  // Host A has one rank; host B two, sharing one local checkpoint (and so
  // one host lock), as co-located engines of one node would.
  const std::string local_a = Join(setup.workdir, "host-a/model");
  const std::string local_b = Join(setup.workdir, "host-b/model");
  std::vector<std::unique_ptr<Agent>> agents;
  for (const auto& [name, local] : {std::pair<std::string, std::string>{"A", local_a},
                                    {"B/rank0", local_b},
                                    {"B/rank1", local_b}}) {
    DS_ASSIGN_OR_RETURN(std::unique_ptr<Agent> agent, StartAgent(setup, local));
    setup.engines.push_back({name, AgentUrl(*agent), local});
    agents.push_back(std::move(agent));
  }

  PublisherOptions publish;
  publish.store = setup.store;
  publish.encoding = config.encoding;
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> publisher,
                      Publisher::Create(publish, bed.trainer->Weights()));
  SyncOptions sync;
  for (const DemoEngine& engine : setup.engines) sync.engines.push_back(engine.url);
  DS_ASSIGN_OR_RETURN(std::unique_ptr<SyncCoordinator> coordinator,
                      SyncCoordinator::Create(sync, std::move(publisher)));
  setup.setup_seconds += SecondsSince(agents_start);
  if (observer.on_setup) observer.on_setup(setup);

  // The seed: every host materializes version 0, the base, by copy.
  result.seed.step = 0;
  result.seed.version = 0;
  result.seed.total_elements = setup.parameters;
  result.seed.full_bytes = setup.model_bytes;
  FinishRow(setup.engines, coordinator->PullAll(0), bed.trainer->Weights(), &result.seed);
  if (observer.on_step) observer.on_step(result.seed);
  bool all_verified = result.seed.verified;

  for (int64_t step = 1; step <= config.steps; ++step) {
    DemoStep row;
    row.step = step;
    row.full_bytes = setup.model_bytes;
    row.total_elements = setup.parameters;
    const auto train_start = Clock::now();
    bed.trainer->Step();
    row.train_seconds = SecondsSince(train_start);
    const std::vector<TensorView> weights = bed.trainer->Weights();
    Result<SyncReport> report = coordinator->Sync(weights);
    if (!report.ok()) {
      // Nothing was published: the hosts still hold the previous version.
      row.error = "publish failed: " + report.status().ToString();
      all_verified = false;
      result.steps.push_back(row);
      if (observer.on_step) observer.on_step(row);
      break;
    }
    row.version = report->version;
    row.changed_elements = report->publish.changed_elements;
    row.delta_bytes = report->publish.bytes_written;
    row.publish_seconds = report->publish_seconds;
    FinishRow(setup.engines, report->engines, weights, &row);
    all_verified = all_verified && row.verified;
    result.steps.push_back(row);
    if (observer.on_step) observer.on_step(row);
  }
  for (std::unique_ptr<Agent>& agent : agents) agent->Stop();
  result.setup = setup;
  result.all_verified = all_verified;
  result.total_seconds = SecondsSince(start);
  return result;
}

// ---------------------------------------------------------------------------
// Agent benchmark

namespace {

struct HttpPull {
  double wall_ms = 0;
  double agent_ms = 0;  // the pull as the agent timed it
};

// One POST /pull_weights, as the coordinator sends it (a fresh connection).
Result<HttpPull> PullThroughAgent(int port, int64_t version) {
  const auto start = Clock::now();
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(10, 0);
  client.set_read_timeout(600, 0);
  httplib::Result response = client.Post(
      "/pull_weights", "{\"target_version\": " + std::to_string(version) + "}", "application/json");
  HttpPull pull;
  pull.wall_ms = SecondsSince(start) * 1e3;
  if (!response) {
    return Status::Internal("POST /pull_weights failed: " + httplib::to_string(response.error()));
  }
  const nlohmann::json body = nlohmann::json::parse(response->body, nullptr, false);
  if (response->status != 200 || !body.is_object() || body.value("version", -1) != version ||
      !body.value("verified", false)) {
    return Status::Internal("POST /pull_weights answered " + std::to_string(response->status) +
                            ": " + response->body);
  }
  pull.agent_ms = body.value("seconds", 0.0) * 1e3;
  return pull;
}

// The agent's own count of served connections and the CPU its request
// threads spent on them, from /metrics.
struct AgentRequestCost {
  double connections = 0;
  double cpu_seconds = 0;
};
Result<AgentRequestCost> ScrapeRequestCost(int port) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(10, 0);
  httplib::Result r = client.Get("/metrics");
  if (!r || r->status != 200) return Status::Internal("GET /metrics failed");
  auto sample = [&](const std::string& name) -> Result<double> {
    const std::string key = "\n" + name + " ";
    const std::string text = "\n" + r->body;
    const size_t at = text.find(key);
    if (at == std::string::npos) return Status::Internal("/metrics lacks " + name);
    return std::strtod(text.c_str() + at + key.size(), nullptr);
  };
  AgentRequestCost cost;
  DS_ASSIGN_OR_RETURN(cost.connections, sample("deltasync_agent_connections_total"));
  DS_ASSIGN_OR_RETURN(cost.cpu_seconds, sample("deltasync_agent_request_cpu_seconds_total"));
  return cost;
}

// Clients sending GET /status to an agent until told to stop (or their
// request budget or a time limit runs out).
class StatusLoad {
 public:
  StatusLoad(int port, int threads, double interval_ms, int64_t max_requests, int nice) {
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    for (int t = 0; t < threads; ++t) {
      threads_.emplace_back([this, port, interval_ms, max_requests, deadline, nice] {
        if (nice > 0) ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), nice);
        for (int64_t i = 0; i < max_requests && !stop_.load() && Clock::now() < deadline; ++i) {
          httplib::Client client("127.0.0.1", port);
          client.set_connection_timeout(5, 0);
          client.set_read_timeout(5, 0);
          const auto sent = Clock::now();
          httplib::Result r = client.Get("/status");
          const double ms = SecondsSince(sent) * 1e3;
          ++requests_;
          if (!r || r->status != 200) ++errors_;
          {
            std::lock_guard<std::mutex> lock(mu_);
            latencies_ms_.push_back(ms);
          }
          if (interval_ms > 0) {
            std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(interval_ms));
          }
        }
      });
    }
  }
  ~StatusLoad() { Finish(); }
  void Finish() {
    stop_ = true;
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  uint64_t requests() const { return requests_.load(); }
  uint64_t errors() const { return errors_.load(); }
  // Each request's round trip; call after Finish().
  const std::vector<double>& latencies_ms() const { return latencies_ms_; }

 private:
  std::mutex mu_;
  std::vector<double> latencies_ms_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> errors_{0};
  std::vector<std::thread> threads_;
};

}  // namespace

Result<AgentBenchResult> RunAgentBench(const AgentBenchConfig& config,
                                       const AgentBenchProgress& progress) {
  if (config.overhead_versions < 1 || config.load_versions < 2 || config.status_threads < 1 ||
      config.max_requests_per_thread < 1 || config.status_interval_ms < 0 ||
      config.status_client_nice < 0 || config.status_client_nice > 19) {
    return Status::InvalidArgument(
        "agent bench needs >= 1 overhead version, >= 2 load versions, >= 1 status thread, "
        ">= 1 request per thread, a non-negative interval and a client nice value in 0..19");
  }
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  const auto start = Clock::now();
  DS_ASSIGN_OR_RETURN(Testbed bed, MakeTestbed(config.demo));
  AgentBenchResult result;
  DemoSetup& setup = bed.setup;
  const std::string local_http = Join(setup.workdir, "host-http/model");
  const std::string local_direct = Join(setup.workdir, "host-direct/model");
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Agent> agent, StartAgent(setup, local_http));
  setup.engines.push_back({"agent", AgentUrl(*agent), local_http});
  LocalCheckpointOptions direct_options;
  direct_options.local = local_direct;
  direct_options.store = setup.store;
  direct_options.base = setup.base;
  DS_ASSIGN_OR_RETURN(std::unique_ptr<LocalCheckpoint> direct,
                      LocalCheckpoint::Open(direct_options));
  setup.engines.push_back({"direct", "", local_direct});

  PublisherOptions publish;
  publish.store = setup.store;
  publish.encoding = config.demo.encoding;
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> publisher,
                      Publisher::Create(publish, bed.trainer->Weights()));
  auto next_version = [&]() -> Result<int64_t> {
    bed.trainer->Step();
    DS_ASSIGN_OR_RETURN(PublishResult published, publisher->Publish(bed.trainer->Weights()));
    // Writes back the version just published and the last pull's dirty
    // pages before the next timed pull, so that background writeback (which
    // on a small host competes for the same cores) does not land on
    // whichever pull happens to come next.
    ::sync();
    return published.info.version;
  };
  auto pull_direct = [&](int64_t version) -> Result<double> {
    const auto t0 = Clock::now();
    DS_ASSIGN_OR_RETURN(PullResult pulled, direct->Pull(version));
    if (pulled.version != version) {
      return Status::Internal("direct pull reached version " + std::to_string(pulled.version));
    }
    return SecondsSince(t0) * 1e3;
  };

  say("seeding both local checkpoints with the base");
  DS_RETURN_IF_ERROR(PullThroughAgent(agent->port(), 0).status());
  DS_RETURN_IF_ERROR(pull_direct(0).status());
  {
    // A warm-up version, not counted: first-touch costs of both paths.
    DS_ASSIGN_OR_RETURN(const int64_t v, next_version());
    DS_RETURN_IF_ERROR(PullThroughAgent(agent->port(), v).status());
    DS_RETURN_IF_ERROR(pull_direct(v).status());
  }

  say("overhead: " + std::to_string(config.overhead_versions) +
      " versions, each pulled through the agent and directly");
  std::vector<double> differences;
  for (int64_t i = 0; i < config.overhead_versions; ++i) {
    DS_ASSIGN_OR_RETURN(const int64_t v, next_version());
    HttpPull http;
    double direct_ms = 0;
    // Whichever goes second finds the version's files in the page cache:
    // alternate so that neither side always gets that advantage.
    if (i % 2 == 0) {
      DS_ASSIGN_OR_RETURN(http, PullThroughAgent(agent->port(), v));
      DS_ASSIGN_OR_RETURN(direct_ms, pull_direct(v));
    } else {
      DS_ASSIGN_OR_RETURN(direct_ms, pull_direct(v));
      DS_ASSIGN_OR_RETURN(http, PullThroughAgent(agent->port(), v));
    }
    result.http_ms.push_back(http.wall_ms);
    result.agent_pull_ms.push_back(http.agent_ms);
    result.direct_ms.push_back(direct_ms);
    differences.push_back(http.wall_ms - direct_ms);
  }
  result.http_median_ms = Median(result.http_ms);
  result.direct_median_ms = Median(result.direct_ms);
  result.overhead_median_ms = Median(differences);
  std::vector<double> transport;
  for (size_t i = 0; i < result.http_ms.size(); ++i) {
    transport.push_back(result.http_ms[i] - result.agent_pull_ms[i]);
  }
  result.transport_median_ms = Median(transport);

  {
    // What the load costs by itself, with the agent idle: the process's
    // CPU over one second with the load, less one second without it.
    auto process_cpu = [] {
      struct rusage r;
      ::getrusage(RUSAGE_SELF, &r);
      return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
             static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e-6;
    };
    const double quiet_start = process_cpu();
    const auto quiet_t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::seconds(1));
    const double quiet_rate = (process_cpu() - quiet_start) / SecondsSince(quiet_t0);
    DS_ASSIGN_OR_RETURN(const AgentRequestCost agent_before, ScrapeRequestCost(agent->port()));
    const double loaded_start = process_cpu();
    const auto t0 = Clock::now();
    StatusLoad idle(agent->port(), config.status_threads, config.status_interval_ms,
                    config.max_requests_per_thread, config.status_client_nice);
    std::this_thread::sleep_for(std::chrono::seconds(1));
    idle.Finish();
    result.idle_load_seconds = SecondsSince(t0);
    result.idle_load_cpu_seconds =
        std::max(0.0, process_cpu() - loaded_start - quiet_rate * result.idle_load_seconds);
    result.idle_load_requests = idle.requests();
    // The scrape itself is one more connection, counted once it closes:
    // give the last ones a moment to be recorded, then leave it out.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    DS_ASSIGN_OR_RETURN(const AgentRequestCost agent_after, ScrapeRequestCost(agent->port()));
    result.idle_load_agent_connections = agent_after.connections - agent_before.connections - 1;
    result.idle_load_agent_cpu_seconds = agent_after.cpu_seconds - agent_before.cpu_seconds;
    result.status_errors += idle.errors();
  }

  // Each load version is pulled twice through HTTP, by two agents on their
  // own local checkpoints: one under /status load, the other quiet. Pairing
  // on the same version keeps the step-to-step variation of the delta
  // (1.6-2.8% of elements changed) out of the ratio. Which agent is loaded
  // alternates every version and which pull goes first every two, so that
  // neither an agent's nor a position's own bias (a few percent here, seen
  // with almost no load) lands on one side.
  const std::string local_second = Join(setup.workdir, "host-second/model");
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Agent> second, StartAgent(setup, local_second));
  setup.engines.push_back({"second", AgentUrl(*second), local_second});
  DS_RETURN_IF_ERROR(PullThroughAgent(second->port(), 0).status());
  DS_RETURN_IF_ERROR(PullThroughAgent(second->port(), publisher->latest_version()).status());
  say("load: " + std::to_string(config.load_versions) +
      " versions, each pulled by one agent under load from " +
      std::to_string(config.status_threads) + " threads sending GET /status and by a quiet one");
  double load_seconds = 0;
  std::vector<double> status_ms;
  // Version -1 is a warm-up pair, not counted: the first loaded pull also
  // pays for starting the clients' and the agent's request threads.
  for (int64_t i = -1; i < config.load_versions; ++i) {
    DS_ASSIGN_OR_RETURN(const int64_t v, next_version());
    const bool swap_agents = (i & 1) != 0;
    Agent& loaded_agent = swap_agents ? *second : *agent;
    Agent& quiet_agent = swap_agents ? *agent : *second;
    auto timed_pull = [&](Agent& target, bool with_load) -> Result<double> {
      ::sync();  // the other pull's dirty pages are not written back during this one
      std::optional<StatusLoad> load;
      if (with_load) {
        load.emplace(target.port(), config.status_threads, config.status_interval_ms,
                     config.max_requests_per_thread, config.status_client_nice);
      }
      // Let the clients get going before the pull starts (both sides wait).
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const auto load_start = Clock::now();
      Result<HttpPull> pull = PullThroughAgent(target.port(), v);
      if (!load) {
        DS_RETURN_IF_ERROR(pull.status());
        return pull->wall_ms;
      }
      load->Finish();
      const double seconds = SecondsSince(load_start);
      result.status_errors += load->errors();
      DS_RETURN_IF_ERROR(pull.status());
      if (i >= 0) {
        load_seconds += seconds;
        result.status_requests += load->requests();
        status_ms.insert(status_ms.end(), load->latencies_ms().begin(), load->latencies_ms().end());
      }
      return pull->wall_ms;
    };
    double loaded_ms = 0, quiet_ms = 0;
    if (((i + 1) / 2) % 2 == 0) {
      DS_ASSIGN_OR_RETURN(loaded_ms, timed_pull(loaded_agent, true));
      DS_ASSIGN_OR_RETURN(quiet_ms, timed_pull(quiet_agent, false));
    } else {
      DS_ASSIGN_OR_RETURN(quiet_ms, timed_pull(quiet_agent, false));
      DS_ASSIGN_OR_RETURN(loaded_ms, timed_pull(loaded_agent, true));
    }
    if (i < 0) continue;
    result.loaded_ms.push_back(loaded_ms);
    result.unloaded_ms.push_back(quiet_ms);
    result.pair_ratios.push_back(loaded_ms / quiet_ms);
    result.worst_pair_ratio = std::max(result.worst_pair_ratio, loaded_ms / quiet_ms);
  }
  result.pair_ratio_median = Median(result.pair_ratios);
  // Versions 2k and 2k+1 have the agents in swapped roles: the geometric
  // mean of their two ratios cancels whatever one agent's checkpoint costs
  // over the other's and leaves the load's effect.
  for (size_t k = 0; k + 1 < result.pair_ratios.size(); k += 2) {
    const double swapped = std::sqrt(result.pair_ratios[k] * result.pair_ratios[k + 1]);
    result.swapped_pair_ratios.push_back(swapped);
    result.worst_swapped_pair_ratio = std::max(result.worst_swapped_pair_ratio, swapped);
  }
  {
    std::vector<double> loaded = result.loaded_ms, quiet = result.unloaded_ms;
    std::sort(loaded.begin(), loaded.end());
    std::sort(quiet.begin(), quiet.end());
    for (size_t k = 0; k < loaded.size(); ++k) {
      result.worst_quantile_ratio = std::max(result.worst_quantile_ratio, loaded[k] / quiet[k]);
    }
  }
  result.unloaded_median_ms = Median(result.unloaded_ms);
  result.loaded_median_ms = Median(result.loaded_ms);
  result.load_ratio =
      result.unloaded_median_ms > 0 ? result.loaded_median_ms / result.unloaded_median_ms : 0;
  std::sort(status_ms.begin(), status_ms.end());
  auto percentile = [&](double p) {
    if (status_ms.empty()) return 0.0;
    return status_ms[std::min(status_ms.size() - 1,
                              static_cast<size_t>(p * static_cast<double>(status_ms.size())))];
  };
  result.status_p50_ms = percentile(0.5);
  result.status_p99_ms = percentile(0.99);
  result.status_max_ms = status_ms.empty() ? 0.0 : status_ms.back();
  result.status_requests_per_second =
      load_seconds > 0 ? static_cast<double>(result.status_requests) / load_seconds : 0;

  // The direct checkpoint last pulled the final overhead version: bring it
  // to the newest too, then both must equal the trainer's weights.
  DS_RETURN_IF_ERROR(pull_direct(publisher->latest_version()).status());
  const std::vector<TensorView> weights = bed.trainer->Weights();
  Status http_match = CompareWithWeights(local_http, weights);
  Status direct_match = CompareWithWeights(local_direct, weights);
  Status second_match = CompareWithWeights(local_second, weights);
  agent->Stop();
  second->Stop();
  if (!http_match.ok()) return Status::Internal(http_match.ToString());
  if (!direct_match.ok()) return Status::Internal(direct_match.ToString());
  if (!second_match.ok()) return Status::Internal(second_match.ToString());
  result.verified = true;
  result.setup = setup;
  result.total_seconds = SecondsSince(start);
  return result;
}

}  // namespace deltasync::cli
