// deltasync demo [--steps N] [--bytes SIZE] [--preset P] [--workdir DIR]
//                [--keep] [--json]
// The end-to-end showcase on generated data: a trainer publishes each RL
// step as a delta, two rollout hosts' agents (one with two co-located ranks)
// pull it over HTTP, and every local checkpoint is compared bit for bit with
// the trainer's weights. Exit 0 only when every one matched at every step.
//
// deltasync demo --bench-agent [...]: the agent's cost over a direct library
// pull, and pulls with and without /status traffic (see demo_runner.h).
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_util.h"
#include "demo_online.h"
#include "demo_runner.h"

namespace deltasync::cli {
namespace {

constexpr double kMB = 1e6;

std::string Fixed(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  return buf;
}

// Right-aligned in `width` columns.
std::string Pad(const std::string& text, size_t width) {
  return text.size() >= width ? text : std::string(width - text.size(), ' ') + text;
}

void PrintSetup(const DemoSetup& s, const DemoConfig& c) {
  std::cout << "deltasync demo: " << c.steps << " RL steps of " << s.preset << " at scale "
            << Fixed(s.scale, 3) << " (" << s.tensors << " tensors, "
            << Fixed(static_cast<double>(s.parameters) / 1e6, 1) << " M parameters, "
            << FormatBytes(s.model_bytes) << " of BF16 weights)\n"
            << "  trainer  in process: fp32 master weights, AdamW (lr " << c.lr
            << "), cast to BF16 after every step\n"
            << "  store    " << s.store << "  (" << EncodingName(c.encoding)
            << " deltas, xxh3-128 checksums)\n"
            << "  base     " << s.base << "  (version 0, what every host starts from)\n";
  for (const DemoEngine& e : s.engines) {
    std::cout << "  host " << Pad(e.name, 7) << "  agent " << e.url << "  keeps " << e.local
              << "\n";
  }
  std::cout << "  (host B's two ranks share one local checkpoint and its host lock: one applies "
               "each version, the other finds it done)\n"
            << "  set up in " << Fixed(s.setup_seconds, 1) << " s\n"
            << std::endl;
}

void PrintHeader() {
  std::cout << Pad("step", 5) << Pad("version", 9) << Pad("changed", 10) << Pad("delta MB", 11)
            << Pad("full MB", 10) << Pad("ratio", 8) << Pad("train s", 9) << Pad("publish s", 11)
            << Pad("pull s", 8) << Pad("B applies", 11) << Pad("verified", 10) << "\n";
}

void PrintRow(const DemoStep& r) {
  const bool seed = r.step == 0;
  std::cout << Pad(seed ? "seed" : std::to_string(r.step), 5) << Pad(std::to_string(r.version), 9)
            << Pad(seed ? "base" : Fixed(100.0 * r.changed_fraction(), 2) + "%", 10)
            << Pad(seed ? "-" : Fixed(r.delta_bytes / kMB, 2), 11)
            << Pad(Fixed(r.full_bytes / kMB, 1), 10)
            << Pad(seed || r.delta_bytes == 0
                       ? "-"
                       : Fixed(static_cast<double>(r.full_bytes) / r.delta_bytes, 1) + "x",
                   8)
            << Pad(seed ? "-" : Fixed(r.train_seconds, 2), 9)
            << Pad(seed ? "-" : Fixed(r.publish_seconds, 3), 11) << Pad(Fixed(r.pull_seconds, 3), 8)
            << Pad(std::to_string(r.shared_host_applies) + " of 2", 11)
            << Pad(r.verified ? "yes" : "NO", 10) << std::endl;
  if (!r.verified) std::cout << "      " << r.error << std::endl;
}

void PrintTotals(const DemoResult& r) {
  uint64_t delta = 0, full = 0, changed = 0, total = 0;
  double train = 0, publish = 0, pull = 0;
  int verified = 0;
  for (const DemoStep& s : r.steps) {
    delta += s.delta_bytes;
    full += s.full_bytes;
    changed += s.changed_elements;
    total += s.total_elements;
    train += s.train_seconds;
    publish += s.publish_seconds;
    pull += s.pull_seconds;
    verified += s.verified;
  }
  std::cout << Pad("total", 5) << Pad("", 9)
            << Pad(total ? Fixed(100.0 * changed / total, 2) + "%" : "-", 10)
            << Pad(Fixed(delta / kMB, 2), 11) << Pad(Fixed(full / kMB, 1), 10)
            << Pad(delta ? Fixed(static_cast<double>(full) / delta, 1) + "x" : "-", 8)
            << Pad(Fixed(train, 2), 9) << Pad(Fixed(publish, 3), 11) << Pad(Fixed(pull, 3), 8)
            << Pad("", 11)
            << Pad(std::to_string(verified) + "/" + std::to_string(r.steps.size()), 10) << "\n\n";
  const size_t hosts = 2;
  if (r.all_verified) {
    std::cout << "every local checkpoint (" << hosts << " hosts, " << r.setup.engines.size()
              << " engines) matched the trainer's weights bit for bit after the seed and each of "
              << r.steps.size() << " steps; shipped " << Fixed(delta / kMB, 2) << " MB of deltas "
              << "instead of " << Fixed(full / kMB, 1) << " MB of full weights; "
              << Fixed(r.total_seconds, 1) << " s in all" << std::endl;
  } else {
    std::cout << "FAILED: a local checkpoint did not match the trainer's weights (see the rows "
                 "marked NO); "
              << Fixed(r.total_seconds, 1) << " s in all" << std::endl;
  }
}

nlohmann::json StepJson(const DemoStep& s) {
  nlohmann::json engines = nlohmann::json::array();
  for (const DemoEnginePull& e : s.engines) {
    engines.push_back({{"engine", e.name},
                       {"ok", e.ok},
                       {"applied", e.applied},
                       {"seconds", e.seconds},
                       {"bytes_read", e.bytes_read},
                       {"error", e.error}});
  }
  return {{"step", s.step},
          {"version", s.version},
          {"changed_elements", s.changed_elements},
          {"total_elements", s.total_elements},
          {"changed_fraction", s.changed_fraction()},
          {"delta_bytes", s.delta_bytes},
          {"full_bytes", s.full_bytes},
          {"train_seconds", s.train_seconds},
          {"publish_seconds", s.publish_seconds},
          {"pull_seconds", s.pull_seconds},
          {"verify_seconds", s.verify_seconds},
          {"shared_host_applies", s.shared_host_applies},
          {"verified", s.verified},
          {"error", s.error},
          {"engines", engines}};
}

nlohmann::json SetupJson(const DemoSetup& s) {
  nlohmann::json engines = nlohmann::json::array();
  for (const DemoEngine& e : s.engines) {
    engines.push_back({{"engine", e.name}, {"url", e.url}, {"local", e.local}});
  }
  return {{"preset", s.preset},         {"scale", s.scale},
          {"parameters", s.parameters}, {"model_bytes", s.model_bytes},
          {"tensors", s.tensors},       {"workdir", s.workdir},
          {"store", s.store},           {"base", s.base},
          {"engines", engines},         {"setup_seconds", s.setup_seconds}};
}

nlohmann::json DemoJson(const DemoResult& r, bool kept) {
  nlohmann::json steps = nlohmann::json::array();
  uint64_t delta = 0, full = 0;
  for (const DemoStep& s : r.steps) {
    steps.push_back(StepJson(s));
    delta += s.delta_bytes;
    full += s.full_bytes;
  }
  return {{"ok", r.all_verified}, {"setup", SetupJson(r.setup)},
          {"workdir_kept", kept}, {"seed", StepJson(r.seed)},
          {"steps", steps},       {"delta_bytes", delta},
          {"full_bytes", full},   {"total_seconds", r.total_seconds}};
}

nlohmann::json BenchJson(const AgentBenchResult& r, const AgentBenchConfig& c) {
  return {{"ok", r.verified && r.status_errors == 0},
          {"setup", SetupJson(r.setup)},
          {"overhead",
           {{"versions", r.http_ms.size()},
            {"http_ms", r.http_ms},
            {"agent_pull_ms", r.agent_pull_ms},
            {"direct_ms", r.direct_ms},
            {"http_median_ms", r.http_median_ms},
            {"direct_median_ms", r.direct_median_ms},
            {"overhead_median_ms", r.overhead_median_ms},
            {"transport_median_ms", r.transport_median_ms}}},
          {"load",
           {{"status_threads", c.status_threads},
            {"status_interval_ms", c.status_interval_ms},
            {"status_client_nice", c.status_client_nice},
            {"unloaded_ms", r.unloaded_ms},
            {"loaded_ms", r.loaded_ms},
            {"unloaded_median_ms", r.unloaded_median_ms},
            {"loaded_median_ms", r.loaded_median_ms},
            {"ratio", r.load_ratio},
            {"pair_ratios", r.pair_ratios},
            {"pair_ratio_median", r.pair_ratio_median},
            {"worst_pair_ratio", r.worst_pair_ratio},
            {"worst_quantile_ratio", r.worst_quantile_ratio},
            {"swapped_pair_ratios", r.swapped_pair_ratios},
            {"worst_swapped_pair_ratio", r.worst_swapped_pair_ratio},
            {"status_requests", r.status_requests},
            {"status_errors", r.status_errors},
            {"status_requests_per_second", r.status_requests_per_second},
            {"status_p50_ms", r.status_p50_ms},
            {"status_p99_ms", r.status_p99_ms},
            {"status_max_ms", r.status_max_ms},
            {"idle_load_requests", r.idle_load_requests},
            {"idle_load_seconds", r.idle_load_seconds},
            {"idle_load_cpu_seconds", r.idle_load_cpu_seconds},
            {"idle_load_agent_connections", r.idle_load_agent_connections},
            {"idle_load_agent_cpu_seconds", r.idle_load_agent_cpu_seconds}}},
          {"verified", r.verified},
          {"total_seconds", r.total_seconds}};
}

std::string MsList(const std::vector<double>& values) {
  std::string out;
  for (double v : values) out += (out.empty() ? "" : " ") + Fixed(v, 1);
  return out;
}

int RunBenchAgent(const AgentBenchConfig& config, bool json) {
  const bool live = !json && StdoutIsTerminal();
  Result<AgentBenchResult> r = RunAgentBench(config, [&](std::string_view line) {
    if (!json) std::cout << "  " << line << (live ? "..." : "") << std::endl;
  });
  if (!r.ok()) return Fail(r.status().WithContext("agent bench"));
  if (json) {
    std::cout << BenchJson(*r, config).dump(2) << std::endl;
  } else {
    const AgentBenchResult& b = *r;
    std::cout << "\nmodel: " << b.setup.preset << " at scale " << Fixed(b.setup.scale, 3) << ", "
              << FormatBytes(b.setup.model_bytes) << ", " << b.setup.tensors << " tensors\n\n"
              << "pull overhead of the agent (" << b.http_ms.size()
              << " versions, each pulled through POST /pull_weights and by LocalCheckpoint::Pull "
                 "on a second local checkpoint, alternating which goes first)\n"
              << "  /pull_weights    median " << Fixed(b.http_median_ms, 1) << " ms   ["
              << MsList(b.http_ms) << "]\n"
              << "    (agent-timed)  median " << Fixed(Median(b.agent_pull_ms), 1) << " ms   ["
              << MsList(b.agent_pull_ms) << "]\n"
              << "  direct Pull      median " << Fixed(b.direct_median_ms, 1) << " ms   ["
              << MsList(b.direct_ms) << "]\n"
              << "  difference       median " << Fixed(b.overhead_median_ms, 1)
              << " ms per pull (median of per-version /pull_weights - direct)\n"
              << "  HTTP round trip  median " << Fixed(b.transport_median_ms, 2)
              << " ms per pull (median of per-version /pull_weights - agent-timed pull)\n\n"
              << "/status load during pulls (" << b.loaded_ms.size()
              << " versions, each pulled by an agent under load and by a quiet agent, "
                 "the two agents swapping roles every version and order every two; "
              << config.status_threads << " threads, "
              << (config.status_interval_ms > 0
                      ? Fixed(config.status_interval_ms, 1) + " ms between requests"
                      : std::string("back to back"))
              << ", at most " << config.max_requests_per_thread
              << " requests each, clients at nice " << config.status_client_nice << ")\n"
              << "  quiet agent       median " << Fixed(b.unloaded_median_ms, 1) << " ms   ["
              << MsList(b.unloaded_ms) << "]\n"
              << "  agent under load  median " << Fixed(b.loaded_median_ms, 1) << " ms   ["
              << MsList(b.loaded_ms) << "]\n"
              << "  loaded / quiet    median " << Fixed(b.pair_ratio_median, 3) << "   worst "
              << Fixed(b.worst_pair_ratio, 3) << "   per version [" <<
        [&] {
          std::string out;
          for (double v : b.pair_ratios) out += (out.empty() ? "" : " ") + Fixed(v, 2);
          return out;
        }() << "]\n"
              << "  by quantile       worst " << Fixed(b.worst_quantile_ratio, 3)
              << "   (k-th fastest loaded pull / k-th fastest quiet pull)\n"
              << "  swapped pairs     worst " << Fixed(b.worst_swapped_pair_ratio, 3) << "   [" <<
        [&] {
          std::string out;
          for (double v : b.swapped_pair_ratios) {
            out += (out.empty() ? "" : " ") + Fixed(v, 2);
          }
          return out;
        }() << "] (geometric mean of versions 2k and 2k+1, whose agents swap roles)\n"
              << "  /status requests    " << b.status_requests << " ("
              << Fixed(b.status_requests_per_second, 0) << " per second), " << b.status_errors
              << " errors; round trip median " << Fixed(b.status_p50_ms, 2) << " ms, p99 "
              << Fixed(b.status_p99_ms, 1) << " ms, max " << Fixed(b.status_max_ms, 1) << " ms\n"
              << "  the load alone      " << b.idle_load_requests << " requests in "
              << Fixed(b.idle_load_seconds, 2)
              << " s with no pull: " << Fixed(b.idle_load_cpu_seconds * 1e3, 1) << " ms CPU ("
              << Fixed(b.idle_load_requests ? b.idle_load_cpu_seconds * 1e6 /
                                                  static_cast<double>(b.idle_load_requests)
                                            : 0.0,
                       0)
              << " us per request, "
              << Fixed(b.idle_load_seconds > 0
                           ? 100.0 * b.idle_load_cpu_seconds / b.idle_load_seconds
                           : 0.0,
                       1)
              << "% of one core)\n"
              << "    of which the agent  " << Fixed(b.idle_load_agent_cpu_seconds * 1e3, 1)
              << " ms over " << Fixed(b.idle_load_agent_connections, 0) << " connections ("
              << Fixed(b.idle_load_agent_connections > 0
                           ? b.idle_load_agent_cpu_seconds * 1e6 / b.idle_load_agent_connections
                           : 0.0,
                       0)
              << " us each, its request threads' CPU time); the rest is the clients\n\n"
              << "all three local checkpoints matched the trainer's weights bit for bit; "
              << Fixed(b.total_seconds, 1) << " s in all" << std::endl;
  }
  if (r->status_errors > 0) {
    return Fail(std::to_string(r->status_errors) + " /status requests failed under load");
  }
  return 0;
}

}  // namespace

void RegisterDemo(CLI::App& app, CommandFn* run) {
  RegisterHiddenCommand(app, "demo-online-peer", RunOnlineDemoPeer, run);
  struct Opts {
    DemoConfig demo;
    std::string bytes = "512MiB", encoding = "sparse";
    bool json = false, bench_agent = false, online = false;
    int ranks = 2, receivers = 2;
    AgentBenchConfig bench;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "The end-to-end showcase on generated data: an in-process trainer publishes each RL step "
      "as a delta, the agents of two rollout hosts (one with two ranks sharing a local "
      "checkpoint) pull it over HTTP, and every local checkpoint is checked bit for bit against "
      "the trainer's weights. Exit 0 only when all matched. The default size takes about two and a "
      "half minutes on 2 cores and ~11x --bytes of memory (the trainer's fp32 state)");
  cmd->add_option("--steps", o->demo.steps, "RL steps, one published version each")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{100000}));
  cmd->add_option("--bytes", o->bytes, "Model size in BF16 bytes, e.g. 320MiB or 1GiB")
      ->capture_default_str();
  cmd->add_option("--preset", o->demo.preset,
                  "Model shape: tiny | qwen2.5-0.5b | qwen2.5-1.5b | qwen3-30b-a3b")
      ->capture_default_str();
  cmd->add_option("--seed", o->demo.seed, "Random seed of the synthetic trainer")
      ->capture_default_str();
  cmd->add_option("--lr", o->demo.lr, "AdamW learning rate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--encoding,-e", o->encoding, EncodingHelp(o->encoding))->capture_default_str();
  cmd->add_option("--workdir", o->demo.workdir,
                  "Directory for the base, the store and the hosts (must be missing or empty; "
                  "default: a fresh one under $TMPDIR)");
  cmd->add_flag("--keep", o->demo.keep, "Keep the work dir instead of removing it at the end");
  cmd->add_flag("--json", o->json, "Machine-readable output (one JSON document at the end)");
  cmd->add_flag("--online", o->online,
                "Instead, the online transport: a sharded trainer's ranks (--ranks processes) "
                "stream every step to --receivers processes over gloo on loopback, each "
                "receiver checked bit for bit after every step (default --bytes 64MiB, "
                "--encoding indices: dense | indices | sparse)");
  cmd->add_option("--ranks", o->ranks, "--online: trainer ranks")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  cmd->add_option("--receivers", o->receivers, "--online: receivers")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  cmd->add_flag("--bench-agent", o->bench_agent,
                "Instead of the demo, measure the agent: /pull_weights against a direct "
                "library pull of the same versions, and pulls with and without /status load");
  cmd->add_option("--bench-versions", o->bench.overhead_versions,
                  "--bench-agent: versions pulled both ways, and again with/without load")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1000}));
  cmd->add_option("--status-threads", o->bench.status_threads,
                  "--bench-agent: threads sending GET /status during loaded pulls")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--status-client-nice", o->bench.status_client_nice,
                  "--bench-agent: nice value (0-19) of the /status client threads, which stand "
                  "in for a scraper on another host")
      ->capture_default_str()
      ->check(CLI::Range(0, 19));
  cmd->add_option("--status-interval-ms", o->bench.status_interval_ms,
                  "--bench-agent: pause of each /status thread between requests (0 = none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->callback([o, run, cmd] {
    *run = [o, cmd]() -> int {
      if (o->online) {
        for (const char* other : {"--bench-agent", "--keep", "--bench-versions"}) {
          if (cmd->count(other) > 0)
            return Fail(std::string(other) + " does not apply to --online");
        }
        OnlineDemoConfig oc;
        if (cmd->count("--preset") > 0) oc.preset = o->demo.preset;
        if (cmd->count("--steps") > 0) oc.steps = static_cast<int>(o->demo.steps);
        oc.seed = o->demo.seed;
        oc.lr = o->demo.lr;
        oc.ranks = o->ranks;
        oc.receivers = o->receivers;
        oc.workdir = o->demo.workdir;
        if (cmd->count("--bytes") > 0) {
          Result<uint64_t> bytes = ParseByteSize(o->bytes);
          if (!bytes.ok()) return Fail(bytes.status().WithContext("--bytes"));
          oc.target_bytes = *bytes;
        }
        if (cmd->count("--encoding") > 0) {
          Result<StreamEncoding> e = ParseStreamEncoding(o->encoding);
          if (!e.ok()) return Fail(e.status().WithContext("--encoding"));
          oc.encoding = *e;
        }
        return RunOnlineDemo(oc, o->json);
      }
      for (const char* online_only : {"--ranks", "--receivers"}) {
        if (cmd->count(online_only) > 0) return Fail(std::string(online_only) + " needs --online");
      }
      // The demo is its own HTTP client: a connection the agent closes
      // early must fail that request (EPIPE), not kill the process.
      ::signal(SIGPIPE, SIG_IGN);
      Result<uint64_t> bytes = ParseByteSize(o->bytes);
      if (!bytes.ok()) return Fail(bytes.status().WithContext("--bytes"));
      o->demo.target_bytes = *bytes;
      Result<Encoding> encoding = ParseEncoding(o->encoding);
      if (!encoding.ok()) return Fail(encoding.status().WithContext("--encoding"));
      o->demo.encoding = *encoding;
      if (o->bench_agent) {
        o->bench.demo = o->demo;
        o->bench.load_versions = o->bench.overhead_versions;
        return RunBenchAgent(o->bench, o->json);
      }

      DemoObserver observer;
      if (!o->json) {
        observer.on_setup = [o](const DemoSetup& setup) {
          PrintSetup(setup, o->demo);
          PrintHeader();
        };
        observer.on_step = [](const DemoStep& step) { PrintRow(step); };
      }
      Result<DemoResult> result = RunDemo(o->demo, observer);
      if (!result.ok()) return Fail(result.status().WithContext("demo"));
      if (o->json) {
        std::cout << DemoJson(*result, o->demo.keep).dump(2) << std::endl;
      } else {
        PrintTotals(*result);
        if (o->demo.keep) std::cout << "work dir kept: " << result->setup.workdir << std::endl;
      }
      if (!result->all_verified) {
        return Fail("a local checkpoint did not match the trainer's weights");
      }
      return 0;
    };
  });
}

}  // namespace deltasync::cli
