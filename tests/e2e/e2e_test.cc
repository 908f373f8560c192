// End to end, as a deployment runs it: real `deltasync agent` processes on
// loopback ports, one per rollout host, and the trainer side through the
// `deltasync publish`, `sync` and `prune` commands, on a synthetic RL chain
// (the `tiny` preset: AdamW steps on an fp32 master, cast to BF16). Every
// host's local checkpoint is compared tensor by tensor, by name, with the
// trainer's checkpoint of the version it claims to hold.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/agent_test_util.h"
#include "deltasync/checkpoint.h"
#include "deltasync/store.h"
#include "deltasync/synth.h"

extern char** environ;

namespace deltasync {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A child process with its stdout and stderr read through pipes.
class Process {
 public:
  // `extra_env`: "NAME=value" entries added to this process's environment.
  explicit Process(std::vector<std::string> args, const std::vector<std::string>& extra_env = {}) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      return;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_adddup2(&actions, err[1], 2);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings(extra_env);
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
    if (rc != 0) {
      ADD_FAILURE() << "cannot run " << args[0] << ": " << std::strerror(rc);
      pid_ = -1;
    }
  }
  ~Process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      Wait();
    }
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Reads from both pipes until a line of stdout (stream 0) or stderr
  // (stream 1) not returned before contains `needle`, or `seconds` pass, or
  // the process closes its pipes. Returns that line.
  std::optional<std::string> WaitForLine(int stream, const std::string& needle, double seconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      const std::string& text = text_[stream];
      for (size_t nl; (nl = text.find('\n', scanned_[stream])) != std::string::npos;) {
        const std::string line = text.substr(scanned_[stream], nl - scanned_[stream]);
        scanned_[stream] = nl + 1;
        if (line.find(needle) != std::string::npos) return line;
      }
      if (Clock::now() >= deadline) return std::nullopt;
      if (!ReadSome(50)) {
        if (text_[stream].find('\n', scanned_[stream]) == std::string::npos) return std::nullopt;
      }
    }
  }
  // Reads both pipes to their end, then waits for the exit.
  int Finish() {
    while (ReadSome(1000)) {
    }
    return Wait();
  }
  // The exit code, or -signal when killed.
  int Wait() {
    if (pid_ > 0) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    }
    return exit_code_;
  }
  void Signal(int signal_number) {
    if (pid_ > 0) ::kill(pid_, signal_number);
  }
  const std::string& out() const { return text_[0]; }
  const std::string& err() const { return text_[1]; }

 private:
  // Reads whatever is ready within `timeout_ms`. False once both pipes are
  // at their end.
  bool ReadSome(int timeout_ms) {
    pollfd p[2];
    int n = 0;
    int stream_of[2];
    for (int s = 0; s < 2; ++s) {
      if (fds_[s] >= 0) {
        p[n] = {fds_[s], POLLIN, 0};
        stream_of[n++] = s;
      }
    }
    if (n == 0) return false;
    if (::poll(p, n, timeout_ms) <= 0) return true;
    for (int i = 0; i < n; ++i) {
      if (p[i].revents == 0) continue;
      char buf[4096];
      const ssize_t got = ::read(p[i].fd, buf, sizeof(buf));
      if (got > 0) {
        text_[stream_of[i]].append(buf, static_cast<size_t>(got));
      } else {
        ::close(p[i].fd);
        fds_[stream_of[i]] = -1;
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  std::string text_[2];
  size_t scanned_[2] = {0, 0};
  int exit_code_ = -1;
};

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

CliRun RunCli(std::vector<std::string> args) {
  args.insert(args.begin(), DS_CLI_PATH);
  Process p(args);
  CliRun r;
  r.exit_code = p.Finish();
  r.out = p.out();
  r.err = p.err();
  return r;
}

struct HttpAnswer {
  int status = -1;  // -1: no response (connection failed or was cut)
  json body;
};

std::optional<std::string> NoToken() { return std::nullopt; }

HttpAnswer Send(int port, const std::string& method, const std::string& path,
                const std::string& body = "", std::optional<std::string> token = NoToken()) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(10, 0);
  client.set_read_timeout(60, 0);
  if (token) client.set_bearer_token_auth(*token);
  httplib::Result r =
      method == "GET" ? client.Get(path) : client.Post(path, body, "application/json");
  HttpAnswer answer;
  if (!r) return answer;
  answer.status = r->status;
  answer.body = json::parse(r->body, nullptr, false);
  return answer;
}

HttpAnswer Pull(int port, const std::string& target, std::optional<std::string> token = NoToken()) {
  return Send(port, "POST", "/pull_weights", R"({"target_version": )" + target + "}",
              std::move(token));
}

// Sends `request` as is and returns everything the agent answers.
std::string RawRequest(int port, const std::string& request) {
  return testing_agent::RawHttpRequest(port, request, 10);
}

// Every tensor of `local` equals the tensor of the same name in `expected`
// (a checkpoint dir), and both hold the same names.
::testing::AssertionResult HoldsSameTensors(const std::string& local, const std::string& expected) {
  Result<std::unique_ptr<Checkpoint>> got = Checkpoint::Open(local);
  if (!got.ok()) return ::testing::AssertionFailure() << got.status().ToString();
  Result<std::unique_ptr<Checkpoint>> want = Checkpoint::Open(expected);
  if (!want.ok()) return ::testing::AssertionFailure() << want.status().ToString();
  const auto& got_tensors = (*got)->tensors();
  const auto& want_tensors = (*want)->tensors();
  if (got_tensors.size() != want_tensors.size()) {
    return ::testing::AssertionFailure() << local << " holds " << got_tensors.size() << " tensors, "
                                         << expected << " " << want_tensors.size();
  }
  for (const auto& [name, want_view] : want_tensors) {
    auto it = got_tensors.find(name);
    if (it == got_tensors.end()) {
      return ::testing::AssertionFailure() << local << " lacks tensor " << name;
    }
    const TensorView& got_view = it->second;
    if (got_view.dtype != want_view.dtype || got_view.shape != want_view.shape ||
        got_view.bytes.size() != want_view.bytes.size() ||
        std::memcmp(got_view.bytes.data(), want_view.bytes.data(), want_view.bytes.size()) != 0) {
      return ::testing::AssertionFailure()
             << "tensor " << name << " of " << local << " differs from " << expected;
    }
  }
  return ::testing::AssertionSuccess() << got_tensors.size() << " tensors equal";
}

// A `deltasync agent` process serving one host-local checkpoint.
struct AgentProcess {
  std::unique_ptr<Process> process;
  int port = 0;
};

class EndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A client writing a request the agent refuses half way must get EPIPE,
    // not die of SIGPIPE.
    ::signal(SIGPIPE, SIG_IGN);
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/ds_e2e_test.XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    root_ = pattern;
  }
  void TearDown() override {
    agents_.clear();
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  // The trainer's checkpoints step_000000 (the engines' base) ... step_{steps}.
  void WriteChain(int64_t steps) {
    SynthChainOptions options;
    options.out_dir = Path("chain");
    options.trainer.preset = "tiny";
    options.trainer.seed = 7;
    options.steps = steps;
    const Status s = WriteSynthChain(options);
    ASSERT_TRUE(s.ok()) << s.ToString();
    // The trainer makes the store before the engines seed from the base.
    std::filesystem::create_directories(Store());
  }

  std::string Path(const std::string& name) const { return root_ + "/" + name; }
  std::string TrainerStep(int64_t step) const { return Path("chain/" + SynthStepDirName(step)); }
  std::string Store() const { return Path("store"); }
  std::string Local(const std::string& host) const { return Path("hosts/" + host); }
  std::string StateFile(const std::string& host) const {
    return Local(host) + "/.weight_sync/state.json";
  }
  std::string Url(int port) const { return "http://127.0.0.1:" + std::to_string(port); }

  // Starts `deltasync agent` for `host` on an ephemeral loopback port (the
  // agent binds port 0 and prints the port it got). `binary`: the shipped
  // CLI, or its test build with fault injection (DS_CRASH_PAUSE_CLI_PATH).
  int StartAgent(const std::string& host, const std::vector<std::string>& extra_args = {},
                 const std::vector<std::string>& extra_env = {},
                 const std::string& binary = DS_CLI_PATH) {
    std::vector<std::string> args = {binary,     "agent",      "--store", Store(),
                                     "--local",  Local(host),  "--base",  TrainerStep(0),
                                     "--listen", "127.0.0.1:0"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    AgentProcess agent;
    agent.process = std::make_unique<Process>(args, extra_env);
    const std::string prefix = "deltasync agent listening on http://127.0.0.1:";
    const std::optional<std::string> line = agent.process->WaitForLine(0, prefix, 30);
    EXPECT_TRUE(line.has_value()) << "agent for " << host
                                  << " did not start: " << agent.process->err();
    if (!line) return 0;
    agent.port = std::stoi(line->substr(line->find(prefix) + prefix.size()));
    const int port = agent.port;
    agents_[host] = std::move(agent);
    return port;
  }

  Process& AgentOf(const std::string& host) { return *agents_.at(host).process; }

  // `deltasync publish` of the trainer's step `to` against step `from`.
  void Publish(int64_t from, int64_t to, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"publish",         "--store", Store(),        "--old",
                                     TrainerStep(from), "--new",   TrainerStep(to)};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliRun r = RunCli(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }

  // `deltasync sync` of step `to` against step `from` to `ports`; returns
  // its JSON summary.
  json Sync(int64_t from, int64_t to, const std::vector<int>& ports,
            std::vector<std::string> extra = {}) {
    std::string engines;
    for (int port : ports) {
      if (!engines.empty()) engines += ',';
      engines += Url(port);
    }
    std::vector<std::string> args = {
        "sync",      "--store", Store(),     "--old", TrainerStep(from), "--new", TrainerStep(to),
        "--engines", engines,   "--timeout", "60"};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliRun r = RunCli(args);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return json::parse(r.out, nullptr, false);
  }

  json StatusOf(int port, std::optional<std::string> token = NoToken()) {
    HttpAnswer a = Send(port, "GET", "/status", "", std::move(token));
    EXPECT_EQ(a.status, 200) << a.body.dump();
    return a.body;
  }

  std::string root_;
  std::map<std::string, AgentProcess> agents_;
};

// Three hosts: A is killed (SIGKILL) in the middle of applying a version and
// restarted; B lags several versions and catches up through the chain; C
// joins after the store was pruned down to a full version and seeds from it.
TEST_F(EndToEndTest, ThreeAgentsSurviveAKillALagAndALateJoin) {
  WriteChain(6);
  // A stops inside the apply: its pull has rewritten tensors in place and
  // journaled them, but not committed the version.
  const int port_a =
      StartAgent("a", {}, {"DELTASYNC_TEST_PAUSE_AT=apply:record"}, DS_CRASH_PAUSE_CLI_PATH);
  const int port_b = StartAgent("b");
  ASSERT_GT(port_a, 0);
  ASSERT_GT(port_b, 0);

  // Every host starts from the base (version 0).
  for (int port : {port_a, port_b}) {
    HttpAnswer seeded = Pull(port, "0");
    ASSERT_EQ(seeded.status, 200) << seeded.body.dump();
    EXPECT_EQ(seeded.body["version"], 0);
    EXPECT_EQ(seeded.body["reset_to"], 0);
  }
  Publish(0, 1);
  HttpAnswer b1 = Pull(port_b, "1");
  ASSERT_EQ(b1.status, 200) << b1.body.dump();
  EXPECT_EQ(b1.body["versions_applied"], json::array({1}));

  // A: killed mid-pull.
  HttpAnswer killed_pull;
  std::thread request([&] { killed_pull = Pull(port_a, "1"); });
  const std::optional<std::string> paused =
      AgentOf("a").WaitForLine(1, "paused at crash point apply:record", 30);
  if (!paused) {
    request.join();
    FAIL() << "agent A never reached the apply: " << killed_pull.body.dump() << AgentOf("a").err();
  }
  const json mid_pull_state = json::parse(ReadFileOrEmpty(StateFile("a")), nullptr, false);
  EXPECT_TRUE(std::filesystem::exists(Local("a") + "/.weight_sync/journal"));
  AgentOf("a").Signal(SIGKILL);
  EXPECT_EQ(AgentOf("a").Wait(), -SIGKILL);
  request.join();
  EXPECT_EQ(killed_pull.status, -1) << "a killed agent cannot have answered";
  ASSERT_TRUE(mid_pull_state.is_object());
  EXPECT_TRUE(mid_pull_state.contains("applying")) << mid_pull_state.dump();
  EXPECT_FALSE(HoldsSameTensors(Local("a"), TrainerStep(0)))
      << "the kill should land after some tensor was rewritten in place";

  // Restarted on the same local checkpoint (without the pause), A recovers
  // and catches up.
  const int port_a2 = StartAgent("a");
  ASSERT_GT(port_a2, 0);
  const json after_restart = StatusOf(port_a2);
  EXPECT_TRUE(after_restart["applied_version"] == 0 || after_restart["applied_version"] == 1)
      << after_restart.dump();
  HttpAnswer a1 = Pull(port_a2, "\"latest\"");
  ASSERT_EQ(a1.status, 200) << a1.body.dump();
  EXPECT_EQ(a1.body["version"], 1);
  EXPECT_EQ(a1.body["verified"], true);
  EXPECT_TRUE(HoldsSameTensors(Local("a"), TrainerStep(1)));

  // B lags while A follows versions 2..4 through `deltasync sync`.
  for (int64_t v = 2; v <= 4; ++v) {
    const json summary = Sync(v - 1, v, {port_a2});
    EXPECT_EQ(summary["ok"], true) << summary.dump();
    EXPECT_EQ(summary["version"], v);
  }
  const json lagging = StatusOf(port_b);
  EXPECT_EQ(lagging["applied_version"], 1);
  EXPECT_EQ(lagging["store_latest"], 4);
  HttpAnswer b4 = Pull(port_b, "\"latest\"");
  ASSERT_EQ(b4.status, 200) << b4.body.dump();
  EXPECT_EQ(b4.body["version"], 4);
  EXPECT_EQ(b4.body["from_version"], 1);
  EXPECT_EQ(b4.body["versions_applied"], json::array({2, 3, 4}));
  EXPECT_TRUE(b4.body["reset_to"].is_null()) << b4.body.dump();
  EXPECT_TRUE(HoldsSameTensors(Local("b"), TrainerStep(4)));

  // A full version, one more delta, then prune: only 5 (full) and 6 remain.
  json summary = Sync(4, 5, {port_a2, port_b}, {"--full"});
  EXPECT_EQ(summary["ok"], true) << summary.dump();
  summary = Sync(5, 6, {port_a2, port_b});
  EXPECT_EQ(summary["ok"], true) << summary.dump();
  const CliRun pruned = RunCli({"prune", "--store", Store(), "--keep", "1"});
  ASSERT_EQ(pruned.exit_code, 0) << pruned.err;
  Result<std::vector<int64_t>> left = ListVersionNumbers(Store());
  ASSERT_TRUE(left.ok()) << left.status().ToString();
  EXPECT_EQ(*left, (std::vector<int64_t>{5, 6}));
  Result<VersionInfo> v5 = ReadVersionInfo(Store() + "/" + VersionDirName(5));
  ASSERT_TRUE(v5.ok()) << v5.status().ToString();
  EXPECT_FALSE(v5->is_delta);

  // C joins late: nothing before version 5 is left, so it seeds from 5.
  const int port_c = StartAgent("c");
  ASSERT_GT(port_c, 0);
  HttpAnswer c6 = Pull(port_c, "\"latest\"");
  ASSERT_EQ(c6.status, 200) << c6.body.dump();
  EXPECT_EQ(c6.body["version"], 6);
  EXPECT_EQ(c6.body["reset_to"], 5);
  EXPECT_EQ(c6.body["versions_applied"], json::array({6}));

  // Every host ends bit-exact with the trainer's newest weights.
  for (const auto& [host, port] :
       std::vector<std::pair<std::string, int>>{{"a", port_a2}, {"b", port_b}, {"c", port_c}}) {
    EXPECT_TRUE(HoldsSameTensors(Local(host), TrainerStep(6))) << host;
    EXPECT_EQ(StatusOf(port)["applied_version"], 6) << host;
    const CliRun verified = RunCli({"verify", "--local", Local(host), "--store", Store()});
    EXPECT_EQ(verified.exit_code, 0) << host << ": " << verified.err;
  }
  for (auto& [host, agent] : agents_) {
    agent.process->Signal(SIGTERM);
    EXPECT_EQ(agent.process->Wait(), 0) << host << ": " << agent.process->err();
  }
}

// Fault injection lives in the test build only: given the same pause
// variable, the test build stops at the crash point and the shipped
// `deltasync` passes it and completes the pull. The shipped binary does not
// even hold the variable's name.
TEST_F(EndToEndTest, OnlyTheTestBuildPausesAtACrashPoint) {
  WriteChain(1);
  const std::vector<std::string> pause = {"DELTASYNC_TEST_PAUSE_AT=apply:record"};
  const int port_shipped = StartAgent("shipped", {}, pause);
  const int port_test = StartAgent("test", {}, pause, DS_CRASH_PAUSE_CLI_PATH);
  ASSERT_GT(port_shipped, 0);
  ASSERT_GT(port_test, 0);
  for (int port : {port_shipped, port_test}) {
    HttpAnswer seeded = Pull(port, "0");
    ASSERT_EQ(seeded.status, 200) << seeded.body.dump();
  }
  Publish(0, 1);

  HttpAnswer paused_pull;
  std::thread request([&] { paused_pull = Pull(port_test, "1"); });
  const std::optional<std::string> paused =
      AgentOf("test").WaitForLine(1, "paused at crash point apply:record", 30);
  AgentOf("test").Signal(SIGKILL);
  AgentOf("test").Wait();
  request.join();
  EXPECT_TRUE(paused.has_value()) << AgentOf("test").err();
  EXPECT_EQ(paused_pull.status, -1);

  HttpAnswer shipped = Pull(port_shipped, "1");
  ASSERT_EQ(shipped.status, 200) << shipped.body.dump() << AgentOf("shipped").err();
  EXPECT_EQ(shipped.body["version"], 1);
  EXPECT_TRUE(HoldsSameTensors(Local("shipped"), TrainerStep(1)));

  const std::string variable = "DELTASYNC_TEST_PAUSE_AT";
  EXPECT_EQ(ReadFileOrEmpty(DS_CLI_PATH).find(variable), std::string::npos);
  EXPECT_NE(ReadFileOrEmpty(DS_CRASH_PAUSE_CLI_PATH).find(variable), std::string::npos);
}

TEST_F(EndToEndTest, TokenIsRequiredWhenOneIsSet) {
  WriteChain(1);
  const std::string token = "e2e-secret-token";
  {
    std::ofstream f(Path("token"));
    f << token << "\n";
  }
  const int port = StartAgent("a", {"--token-file", Path("token")});
  ASSERT_GT(port, 0);

  for (const char* path : {"/status", "/health", "/metrics"}) {
    EXPECT_EQ(Send(port, "GET", path).status, 401) << path;
    EXPECT_EQ(Send(port, "GET", path, "", "wrong-token").status, 401) << path;
    EXPECT_EQ(Send(port, "GET", path, "", token).status, 200) << path;
  }
  HttpAnswer anonymous = Pull(port, "0");
  EXPECT_EQ(anonymous.status, 401);
  EXPECT_EQ(anonymous.body["code"], "unauthorized");
  EXPECT_FALSE(std::filesystem::exists(StateFile("a"))) << "a refused pull must not touch the host";
  HttpAnswer wrong = Pull(port, "0", "e2e-secret-tokeN");
  EXPECT_EQ(wrong.status, 401);
  EXPECT_FALSE(std::filesystem::exists(StateFile("a")));

  HttpAnswer seeded = Pull(port, "0", token);
  ASSERT_EQ(seeded.status, 200) << seeded.body.dump();
  const json summary = Sync(0, 1, {port}, {"--token-file", Path("token")});
  EXPECT_EQ(summary["ok"], true) << summary.dump();
  EXPECT_TRUE(HoldsSameTensors(Local("a"), TrainerStep(1)));
}

TEST_F(EndToEndTest, BadRequestsGet4xxAndChangeNothing) {
  WriteChain(2);
  const int port = StartAgent("a");
  ASSERT_GT(port, 0);
  Publish(0, 1);
  HttpAnswer pulled = Pull(port, "1");
  ASSERT_EQ(pulled.status, 200) << pulled.body.dump();
  Publish(1, 2);  // in the store, not pulled: a bad request must not pull it either

  const std::string state_before = ReadFileOrEmpty(StateFile("a"));
  ASSERT_FALSE(state_before.empty());
  auto expect_unchanged = [&](const std::string& what) {
    EXPECT_EQ(ReadFileOrEmpty(StateFile("a")), state_before) << what;
    const json status = StatusOf(port);
    EXPECT_EQ(status["applied_version"], 1) << what;
    EXPECT_EQ(status["busy"], false) << what;
  };

  struct BadBody {
    std::string what;
    std::string body;
    int status;
    std::string code;
  };
  const std::vector<BadBody> bad = {
      {"truncated JSON", R"({"target_version": )", 400, "invalid_json"},
      {"not JSON", "pull version two please", 400, "invalid_json"},
      {"not an object", "[2]", 400, "invalid_request"},
      {"negative version", R"({"target_version": -1})", 400, "invalid_target_version"},
      {"fractional version", R"({"target_version": 1.5})", 400, "invalid_target_version"},
      {"garbage version", R"({"target_version": "2; rm -rf /"})", 400, "invalid_target_version"},
      {"future version", R"({"target_version": 3})", 404, "version_not_found"},
      {"far future version", R"({"target_version": 999999999})", 404, "version_not_found"},
  };
  for (const BadBody& b : bad) {
    HttpAnswer answer = Send(port, "POST", "/pull_weights", b.body);
    EXPECT_EQ(answer.status, b.status) << b.what << ": " << answer.body.dump();
    EXPECT_EQ(answer.body["code"], b.code) << b.what << ": " << answer.body.dump();
    expect_unchanged(b.what);
  }

  // A huge body: declared (a gigabyte) and refused before any of it is
  // read...
  const std::string declared = RawRequest(
      port,
      "POST /pull_weights HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: 1073741824\r\n\r\n");
  EXPECT_EQ(declared.rfind("HTTP/1.1 413", 0), 0u) << declared;
  EXPECT_NE(declared.find("body_too_large"), std::string::npos) << declared;
  expect_unchanged("declared huge body");
  // ...and actually sent (1 MiB of valid JSON). The agent may close the
  // connection before the client has sent it all, so no answer is also fine;
  // a pull is not.
  const std::string huge = R"({"target_version": 2, "pad": ")" + std::string(1 << 20, 'x') + "\"}";
  HttpAnswer huge_answer = Send(port, "POST", "/pull_weights", huge);
  EXPECT_TRUE(huge_answer.status == 413 || huge_answer.status == -1) << huge_answer.status;
  expect_unchanged("sent huge body");

  // The wrong method or path.
  EXPECT_GE(Send(port, "GET", "/pull_weights").status, 400);
  EXPECT_LT(Send(port, "GET", "/pull_weights").status, 500);
  EXPECT_EQ(Send(port, "POST", "/pull_weight", "{}").status, 404);
  expect_unchanged("wrong method or path");
  EXPECT_TRUE(HoldsSameTensors(Local("a"), TrainerStep(1)));

  // The agent still works.
  HttpAnswer good = Pull(port, "2");
  ASSERT_EQ(good.status, 200) << good.body.dump();
  EXPECT_TRUE(HoldsSameTensors(Local("a"), TrainerStep(2)));
}

// `deltasync demo` on the tiny preset: the JSON report says what the table
// shows, and the work dir is the demo's own.
TEST_F(EndToEndTest, DemoVerifiesEveryHostAtEveryStep) {
  const std::string workdir = Path("demo");
  const CliRun run = RunCli({"demo", "--preset", "tiny", "--bytes", "10MiB", "--steps", "3",
                             "--workdir", workdir, "--keep", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  const json report = json::parse(run.out, nullptr, false);
  ASSERT_TRUE(report.is_object()) << run.out;
  EXPECT_EQ(report["ok"], true);
  ASSERT_EQ(report["setup"]["engines"].size(), 3u);
  ASSERT_EQ(report["steps"].size(), 3u);
  EXPECT_EQ(report["seed"]["verified"], true);
  EXPECT_EQ(report["seed"]["shared_host_applies"], 1);
  int64_t version = 0;
  for (const json& step : report["steps"]) {
    ++version;
    EXPECT_EQ(step["version"], version);
    EXPECT_EQ(step["verified"], true) << step.dump();
    // The two ranks of host B share a local checkpoint: one applies, the
    // other finds the version already there.
    EXPECT_EQ(step["shared_host_applies"], 1) << step.dump();
    EXPECT_GT(step["changed_elements"].get<uint64_t>(), 0u);
    EXPECT_LT(step["delta_bytes"].get<uint64_t>(), step["full_bytes"].get<uint64_t>() / 10);
    for (const json& engine : step["engines"]) EXPECT_EQ(engine["ok"], true) << engine.dump();
  }
  // Kept: both hosts hold version 3, the same tensors, and their recorded
  // checksums.
  const std::string local_a = report["setup"]["engines"][0]["local"];
  const std::string local_b = report["setup"]["engines"][1]["local"];
  EXPECT_NE(local_a, local_b);
  EXPECT_EQ(report["setup"]["engines"][2]["local"], local_b);
  EXPECT_TRUE(HoldsSameTensors(local_a, local_b));
  EXPECT_FALSE(HoldsSameTensors(local_a, workdir + "/base")) << "the hosts never left the base";
  for (const std::string& local : {local_a, local_b}) {
    const json state =
        json::parse(ReadFileOrEmpty(local + "/.weight_sync/state.json"), nullptr, false);
    EXPECT_EQ(state["version"], "000003") << local;
    const CliRun verified = RunCli(
        {"verify", "--local", local, "--store", workdir + "/store", "--base", workdir + "/base"});
    EXPECT_EQ(verified.exit_code, 0) << verified.err;
  }

  // A work dir with someone's files in it is refused, and left alone.
  const CliRun refused = RunCli(
      {"demo", "--preset", "tiny", "--bytes", "10MiB", "--steps", "1", "--workdir", workdir});
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.err.find("is not empty"), std::string::npos) << refused.err;
  EXPECT_TRUE(std::filesystem::exists(workdir + "/store"));
  // Without --keep the demo removes its work dir.
  const std::string fresh = Path("fresh");
  const CliRun removed =
      RunCli({"demo", "--preset", "tiny", "--bytes", "10MiB", "--steps", "1", "--workdir", fresh});
  EXPECT_EQ(removed.exit_code, 0) << removed.err;
  EXPECT_NE(removed.out.find("bit for bit"), std::string::npos) << removed.out;
  EXPECT_FALSE(std::filesystem::exists(fresh));
}

}  // namespace
}  // namespace deltasync
