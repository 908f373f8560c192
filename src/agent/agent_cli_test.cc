// `deltasync agent` and `deltasync sync` as processes: the CLI contract
// (exit codes, one-line errors, the JSON summary) and SIGTERM handling.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "agent/agent_test_util.h"
#include "store/store_test_util.h"

extern char** environ;

namespace deltasync {
namespace {

using nlohmann::json;
using store_test::TempDir;

// A child process with its stdout and stderr in pipes.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int out[2];
    int err[2];
    EXPECT_EQ(::pipe(out), 0);
    EXPECT_EQ(::pipe(err), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_adddup2(&actions, err[1], 2);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    posix_spawn_file_actions_addclose(&actions, err[0]);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(err[1]);
    out_ = out[0];
    err_ = err[0];
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      Wait();
    }
    ::close(out_);
    ::close(err_);
  }
  // Reads stdout until a full line arrives or `seconds` pass.
  std::string ReadLine(double seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (stdout_.find('\n') == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) {
        char buf[512];
        const ssize_t n = ::read(out_, buf, sizeof(buf));
        if (n <= 0) break;
        stdout_.append(buf, static_cast<size_t>(n));
      }
    }
    const size_t nl = stdout_.find('\n');
    if (nl == std::string::npos) return {};
    std::string line = stdout_.substr(0, nl);
    stdout_.erase(0, nl + 1);
    return line;
  }
  // Waits for the exit; returns the exit status (-signal when killed).
  int Wait() {
    int status = 0;
    if (pid_ <= 0) return exit_code_;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    return exit_code_;
  }
  std::string ReadAll(bool from_stderr) {
    std::string out = from_stderr ? std::string() : stdout_;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(from_stderr ? err_ : out_, buf, sizeof(buf))) > 0) {
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  int err_ = -1;
  int exit_code_ = -1;
  std::string stdout_;
};

class AgentCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = store_test::MakeModel(3);
    next_ = store_test::Step(base_, 9, 0.05);
    store_test::WriteModel(tmp_.Join("base"), base_);
    store_test::WriteModel(tmp_.Join("next"), next_);
    std::filesystem::create_directories(tmp_.Join("store"));
  }
  std::vector<std::string> AgentArgs(const std::string& local, const std::string& listen) {
    return {DS_CLI_PATH,      "agent",  "--store",         tmp_.Join("store"), "--local",
            tmp_.Join(local), "--base", tmp_.Join("base"), "--listen",         listen};
  }
  // Starts an agent and returns its port from the line it prints.
  int StartAgent(Child& child) {
    const std::string line = child.ReadLine(20);
    const std::string prefix = "deltasync agent listening on http://127.0.0.1:";
    EXPECT_EQ(line.rfind(prefix, 0), 0u) << line;
    return line.rfind(prefix, 0) == 0 ? std::stoi(line.substr(prefix.size())) : 0;
  }

  TempDir tmp_;
  store_test::Model base_;
  store_test::Model next_;
};

TEST_F(AgentCliTest, ServesSyncsAndExitsCleanlyOnSigterm) {
  Child a(AgentArgs("local_a", "127.0.0.1:0"));
  Child b(AgentArgs("local_b", ":0"));
  const int port_a = StartAgent(a);
  const int port_b = StartAgent(b);
  ASSERT_GT(port_a, 0);
  ASSERT_GT(port_b, 0);

  Child sync({DS_CLI_PATH, "sync", "--store", tmp_.Join("store"), "--old", tmp_.Join("base"),
              "--new", tmp_.Join("next"), "--engines",
              "http://127.0.0.1:" + std::to_string(port_a) + ",127.0.0.1:" + std::to_string(port_b),
              "--encoding", "xor", "--timeout", "30"});
  const int sync_rc = sync.Wait();
  const std::string summary_text = sync.ReadAll(false);
  EXPECT_EQ(sync_rc, 0) << summary_text << sync.ReadAll(true);
  const json summary = json::parse(summary_text, nullptr, false);
  ASSERT_TRUE(summary.is_object()) << summary_text;
  EXPECT_EQ(summary["ok"], true);
  EXPECT_EQ(summary["version"], 1);
  EXPECT_EQ(summary["engines"].size(), 2u);
  EXPECT_TRUE(summary["publish_seconds"].is_number());
  EXPECT_TRUE(summary["total_seconds"].is_number());
  EXPECT_TRUE(store_test::HoldsModel(tmp_.Join("local_a"), next_));
  EXPECT_TRUE(store_test::HoldsModel(tmp_.Join("local_b"), next_));

  ASSERT_EQ(::kill(a.pid(), SIGTERM), 0);
  ASSERT_EQ(::kill(b.pid(), SIGTERM), 0);
  EXPECT_EQ(a.Wait(), 0) << a.ReadAll(true);
  EXPECT_EQ(b.Wait(), 0) << b.ReadAll(true);
  httplib::Client gone("127.0.0.1", port_a);
  gone.set_connection_timeout(1, 0);
  EXPECT_FALSE(gone.Get("/health"));
}

TEST_F(AgentCliTest, SigtermLetsTheInFlightPullFinish) {
  std::vector<std::string> args = AgentArgs("local", "127.0.0.1:0");
  args.push_back("--reload-cmd");
  args.push_back("sleep 0.6 #");
  Child agent(args);
  const int port = StartAgent(agent);
  ASSERT_GT(port, 0);
  int status = 0;
  json body;
  std::thread request([&] {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(20, 0);
    httplib::Result r = c.Post("/pull_weights", R"({"target_version": 0})", "application/json");
    status = r ? r->status : -1;
    if (r) body = json::parse(r->body, nullptr, false);
  });
  // Until the base is in place and the reload is running.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!std::filesystem::exists(tmp_.Join("local/.weight_sync/state.json")) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(::kill(agent.pid(), SIGTERM), 0);
  request.join();
  EXPECT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["reloaded"], true);
  EXPECT_EQ(agent.Wait(), 0);
  EXPECT_TRUE(store_test::HoldsModel(tmp_.Join("local"), base_));
}

TEST_F(AgentCliTest, RefusesANonLoopbackAddressWithoutAToken) {
  Child agent(AgentArgs("local", "0.0.0.0:0"));
  EXPECT_EQ(agent.Wait(), 1);
  const std::string err = agent.ReadAll(true);
  EXPECT_NE(err.find("without a token"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

// The exit status of an agent that must refuse to start; one that listens
// after all fails the test and is killed.
int ExitWithoutListening(Child& agent) {
  const std::string line = agent.ReadLine(20);
  EXPECT_EQ(line, "") << "the agent must not start";
  if (!line.empty()) ::kill(agent.pid(), SIGKILL);
  return agent.Wait();
}

// One "deltasync: error: ..." line whose prefixes are not repeated.
void ExpectOneErrorLine(const std::string& err) {
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_EQ(err.rfind("deltasync: error: ", 0), 0u) << err;
  EXPECT_EQ(err.find("error: error:"), std::string::npos) << err;
  EXPECT_EQ(err.find("agent: agent:"), std::string::npos) << err;
}

TEST_F(AgentCliTest, RefusesAMissingBase) {
  std::vector<std::string> args = AgentArgs("local", "127.0.0.1:0");
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--base") args[i + 1] = tmp_.Join("no-such-base");
  }
  Child agent(args);
  EXPECT_EQ(ExitWithoutListening(agent), 1);
  const std::string err = agent.ReadAll(true);
  ExpectOneErrorLine(err);
  EXPECT_NE(err.find("--base '" + tmp_.Join("no-such-base") + "' does not exist"),
            std::string::npos)
      << err;
  EXPECT_FALSE(std::filesystem::exists(tmp_.Join("local"))) << "nothing is created";
  // A directory that holds no checkpoint is refused as well.
  std::filesystem::create_directories(tmp_.Join("empty"));
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--base") args[i + 1] = tmp_.Join("empty");
  }
  Child empty(args);
  EXPECT_EQ(ExitWithoutListening(empty), 1);
  const std::string empty_err = empty.ReadAll(true);
  ExpectOneErrorLine(empty_err);
  EXPECT_NE(empty_err.find("--base: " + tmp_.Join("empty")), std::string::npos) << empty_err;
}

TEST_F(AgentCliTest, AddressInUseSaysSo) {
  Child first(AgentArgs("local_a", "127.0.0.1:0"));
  const int port = StartAgent(first);
  ASSERT_GT(port, 0);
  Child second(AgentArgs("local_b", "127.0.0.1:" + std::to_string(port)));
  EXPECT_EQ(ExitWithoutListening(second), 1);
  const std::string err = second.ReadAll(true);
  ExpectOneErrorLine(err);
  EXPECT_NE(
      err.find("cannot listen on 127.0.0.1:" + std::to_string(port) + ": address already in use"),
      std::string::npos)
      << err;
  ::kill(first.pid(), SIGTERM);
  EXPECT_EQ(first.Wait(), 0);
}

TEST_F(AgentCliTest, SyncRefusesAMalformedEngineUrlBeforePublishing) {
  Child sync({DS_CLI_PATH, "sync", "--store", tmp_.Join("store"), "--old", tmp_.Join("base"),
              "--new", tmp_.Join("next"), "--engines", "127.0.0.1:1,http://h:99999"});
  EXPECT_EQ(sync.Wait(), 1);
  const std::string err = sync.ReadAll(true);
  ExpectOneErrorLine(err);
  EXPECT_NE(err.find("engine URL 'http://h:99999': port must be a number"), std::string::npos)
      << err;
  EXPECT_TRUE(sync.ReadAll(false).empty());
  EXPECT_TRUE(!std::filesystem::exists(tmp_.Join("store")) ||
              ListVersionNumbers(tmp_.Join("store")).value().empty())
      << "nothing may be published";
}

TEST_F(AgentCliTest, TokenFileIsEnforced) {
  store_test::WriteFile(tmp_.Join("token"), "cli-token\n");
  std::vector<std::string> args = AgentArgs("local", "127.0.0.1:0");
  args.push_back("--token-file");
  args.push_back(tmp_.Join("token"));
  Child agent(args);
  const int port = StartAgent(agent);
  ASSERT_GT(port, 0);
  httplib::Client anonymous("127.0.0.1", port);
  httplib::Result r = anonymous.Get("/status");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  httplib::Client authorized("127.0.0.1", port);
  authorized.set_bearer_token_auth("cli-token");
  r = authorized.Get("/status");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  ::kill(agent.pid(), SIGTERM);
  EXPECT_EQ(agent.Wait(), 0);
}

TEST_F(AgentCliTest, SyncFailsNamingTheDeadEngine) {
  Child agent(AgentArgs("local", "127.0.0.1:0"));
  const int port = StartAgent(agent);
  ASSERT_GT(port, 0);
  const std::string live = "http://127.0.0.1:" + std::to_string(port);
  const std::string dead =
      "http://127.0.0.1:" + std::to_string(testing_agent::UnusedLoopbackPort());
  Child sync({DS_CLI_PATH, "sync", "--store", tmp_.Join("store"), "--old", tmp_.Join("base"),
              "--new", tmp_.Join("next"), "--engines", live + "," + dead, "--retries", "1",
              "--timeout", "30"});
  EXPECT_EQ(sync.Wait(), 1);
  const json summary = json::parse(sync.ReadAll(false), nullptr, false);
  ASSERT_TRUE(summary.is_object());
  EXPECT_EQ(summary["ok"], false);
  EXPECT_EQ(summary["engines"][0]["ok"], true);
  EXPECT_EQ(summary["engines"][1]["ok"], false);
  EXPECT_EQ(summary["engines"][1]["engine"], dead);
  EXPECT_EQ(summary["engines"][1]["code"], "connection");
  const std::string err = sync.ReadAll(true);
  ExpectOneErrorLine(err);
  EXPECT_NE(err.find("1 of 2 engines failed: " + dead + ": cannot connect: connection refused"),
            std::string::npos)
      << err;
  // The live host got the version all the same.
  EXPECT_TRUE(store_test::HoldsModel(tmp_.Join("local"), next_));
  ::kill(agent.pid(), SIGTERM);
  EXPECT_EQ(agent.Wait(), 0);
}

TEST_F(AgentCliTest, SyncWithABadCheckpointPublishesNothing) {
  Child sync({DS_CLI_PATH, "sync", "--store", tmp_.Join("store"), "--old", tmp_.Join("base"),
              "--new", tmp_.Join("missing"), "--engines", "127.0.0.1:1"});
  EXPECT_EQ(sync.Wait(), 1);
  EXPECT_NE(sync.ReadAll(true).find("publish failed"), std::string::npos);
  EXPECT_TRUE(store_test::ListDir(tmp_.Join("store")).empty() ||
              ListVersionNumbers(tmp_.Join("store")).value().empty());
}

}  // namespace
}  // namespace deltasync
