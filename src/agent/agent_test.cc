#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "agent/agent_test_util.h"
#include "deltasync/agent.h"
#include "deltasync/timing.h"

namespace deltasync {
namespace {

using namespace std::string_literals;
using nlohmann::json;
using testing_agent::FakeCheckpoint;
using testing_agent::FakePuller;
using testing_agent::FakeReload;
using testing_agent::FakeReloader;
using testing_agent::RawConnection;
using testing_agent::ResponseJson;

// Runs `step` on a thread of its own until it returns false or the
// Trickler is destroyed (also when an assertion leaves the test early).
class Trickler {
 public:
  explicit Trickler(std::function<bool()> step)
      : thread_([this, step = std::move(step)] {
          while (!stop_.load() && step()) {
          }
        }) {}
  ~Trickler() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class AgentTest : public ::testing::Test {
 protected:
  void StartAgent(AgentOptions options = {}, bool with_reloader = false) {
    std::unique_ptr<EngineReloader> reloader;
    if (with_reloader) reloader = std::make_unique<FakeReloader>(reload_);
    Result<std::unique_ptr<Agent>> agent =
        Agent::Create(options, std::make_unique<FakePuller>(checkpoint_), std::move(reloader));
    ASSERT_TRUE(agent.ok()) << agent.status().ToString();
    agent_ = std::move(agent).value();
    ASSERT_TRUE(agent_->Start().ok());
    ASSERT_GT(agent_->port(), 0);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", agent_->port());
    client_->set_read_timeout(10, 0);
    if (!options.token.empty()) client_->set_bearer_token_auth(options.token.c_str());
  }

  // POSTs `body` to /pull_weights; returns {status, parsed body}.
  std::pair<int, json> Pull(const std::string& body) {
    httplib::Result res = client_->Post("/pull_weights", body, "application/json");
    if (!res) return {-1, json()};
    return {res->status, json::parse(res->body, nullptr, false)};
  }
  std::pair<int, json> Get(const std::string& path) {
    httplib::Result res = client_->Get(path.c_str());
    if (!res) return {-1, json()};
    return {res->status, json::parse(res->body, nullptr, false)};
  }
  // Sends `request` as is on a fresh connection; returns everything read
  // until the server closes it (or 5 s pass).
  std::string RawRequest(const std::string& request) {
    return testing_agent::RawHttpRequest(agent_->port(), request, 5);
  }
  std::string MetricsText() {
    httplib::Result res = client_->Get("/metrics");
    EXPECT_TRUE(res);
    if (!res) return {};
    EXPECT_EQ(res->status, 200);
    return res->body;
  }
  // The value of an unlabelled sample line "<name> <value>" in /metrics.
  double Metric(const std::string& name) {
    const std::string text = MetricsText();
    const std::string key = "\n" + name + " ";
    const size_t at = ("\n" + text).find(key);
    EXPECT_NE(at, std::string::npos) << name;
    if (at == std::string::npos) return -1;
    return std::stod(text.substr(at + key.size() - 1));
  }

  std::shared_ptr<FakeCheckpoint> checkpoint_ = std::make_shared<FakeCheckpoint>();
  std::shared_ptr<FakeReload> reload_ = std::make_shared<FakeReload>();
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(AgentTest, EmptyBodyPullsTheStoresLatest) {
  StartAgent();
  auto [status, body] = Pull("");
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["version"], 3);
  EXPECT_EQ(body["applied"], true);
  EXPECT_EQ(body["verified"], true);
  EXPECT_EQ(body["bytes_read"], 1003);
  EXPECT_EQ(body["tensors_changed"], 2);
  EXPECT_TRUE(body["seconds"].is_number());
  EXPECT_TRUE(body["from_version"].is_null());
  ASSERT_EQ(checkpoint_->pull_targets.size(), 1u);
  EXPECT_EQ(checkpoint_->pull_targets[0], std::nullopt);
}

TEST_F(AgentTest, TargetVersionForms) {
  StartAgent();
  auto [s1, b1] = Pull(R"({"target_version": 2})");
  ASSERT_EQ(s1, 200) << b1.dump();
  EXPECT_EQ(b1["version"], 2);
  auto [s2, b2] = Pull(R"({"target_version": 0})");
  ASSERT_EQ(s2, 200) << b2.dump();
  EXPECT_EQ(b2["version"], 0);
  EXPECT_EQ(b2["from_version"], 2);
  auto [s3, b3] = Pull(R"({"target_version": "latest"})");
  ASSERT_EQ(s3, 200) << b3.dump();
  EXPECT_EQ(b3["version"], 3);
  auto [s4, b4] = Pull(R"({"target_version": "1", "unrelated": [1, 2]})");
  ASSERT_EQ(s4, 200) << b4.dump();
  EXPECT_EQ(b4["version"], 1);
  auto [s5, b5] = Pull(R"({"target_version": null})");
  ASSERT_EQ(s5, 200) << b5.dump();
  EXPECT_EQ(b5["version"], 3);
  auto [s6, b6] = Pull(R"({"target_version": 3})");
  ASSERT_EQ(s6, 200) << b6.dump();
  EXPECT_EQ(b6["applied"], false);  // already there
  const std::vector<std::optional<int64_t>> expected = {2, 0, std::nullopt, 1, std::nullopt, 3};
  EXPECT_EQ(checkpoint_->pull_targets, expected);
}

TEST_F(AgentTest, BadRequestsGet4xxAndChangeNothing) {
  checkpoint_->current = 1;
  StartAgent();
  struct Case {
    std::string body;
    int status;
    std::string code;
  };
  const std::vector<Case> cases = {
      {"{not json", 400, "invalid_json"},
      {"[1, 2]", 400, "invalid_request"},
      {"7", 400, "invalid_request"},
      {R"({"target_version": -1})", 400, "invalid_target_version"},
      {R"({"target_version": 1.5})", 400, "invalid_target_version"},
      {R"({"target_version": true})", 400, "invalid_target_version"},
      {R"({"target_version": "../../etc/passwd"})", 400, "invalid_target_version"},
      {R"({"target_version": "-3"})", 400, "invalid_target_version"},
      {R"({"target_version": 18446744073709551615})", 400, "invalid_target_version"},
      {R"({"target_version": 4})", 404, "version_not_found"},
      {R"({"target_version": 1000000})", 404, "version_not_found"},
  };
  for (const Case& c : cases) {
    auto [status, body] = Pull(c.body);
    EXPECT_EQ(status, c.status) << c.body;
    ASSERT_TRUE(body.is_object()) << c.body;
    EXPECT_EQ(body["code"], c.code) << c.body;
    EXPECT_TRUE(body["error"].is_string() && !body["error"].get<std::string>().empty()) << c.body;
  }
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
  EXPECT_EQ(checkpoint_->current, 1);
  EXPECT_EQ(Metric("deltasync_agent_pulls_total"), 0);
  EXPECT_EQ(Metric("deltasync_agent_rejected_requests_total"), static_cast<double>(cases.size()));
  auto [status, body] = Get("/status");
  EXPECT_EQ(body["applied_version"], 1);
  EXPECT_TRUE(body["last_error"].is_null()) << "a refused request is not a pull failure";
}

TEST_F(AgentTest, HugeBodyIsRefusedWith413) {
  AgentOptions options;
  options.max_body_bytes = 1024;
  StartAgent(options);
  const std::string huge = R"({"target_version": 1, "pad": ")" + std::string(4096, 'x') + "\"}";
  auto [status, body] = Pull(huge);
  EXPECT_EQ(status, 413);
  EXPECT_EQ(body["code"], "body_too_large");
  // Sent chunked (no Content-Length), the body is refused once a chunk
  // size would take it past the cap.
  const std::string chunk(2000, ' ');
  char size_line[16];
  std::snprintf(size_line, sizeof(size_line), "%zx\r\n", chunk.size());
  const std::string chunked =
      RawRequest("POST /pull_weights HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
                 std::string(size_line) + chunk + "\r\n0\r\n\r\n");
  EXPECT_EQ(chunked.rfind("HTTP/1.1 413", 0), 0u) << chunked;
  EXPECT_NE(chunked.find("body_too_large"), std::string::npos) << chunked;
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
  // Chunked bodies anywhere else are refused before they are read.
  const std::string raw = RawRequest(
      "POST /status HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n");
  EXPECT_EQ(raw.rfind("HTTP/1.1 411", 0), 0u) << raw;
  EXPECT_NE(raw.find("length_required"), std::string::npos) << raw;
  // A body under the cap still works.
  auto [ok_status, ok_body] = Pull(R"({"target_version": 1})");
  EXPECT_EQ(ok_status, 200) << ok_body.dump();
}

TEST_F(AgentTest, PullFailureIs500WithTheReason) {
  checkpoint_->current = 2;
  checkpoint_->next_pull_error = Status::Corruption("tensor 'w' checksum mismatch after apply");
  StartAgent();
  auto [status, body] = Pull(R"({"target_version": 3})");
  EXPECT_EQ(status, 500);
  EXPECT_EQ(body["code"], "pull_failed");
  EXPECT_EQ(body["status"], "Corruption");
  EXPECT_NE(body["error"].get<std::string>().find("checksum mismatch"), std::string::npos);
  EXPECT_EQ(body["applied_version"], 2);
  auto [st, st_body] = Get("/status");
  EXPECT_EQ(st_body["last_error"]["code"], "pull_failed");
  EXPECT_EQ(Metric("deltasync_agent_pull_failures_total"), 1);
  EXPECT_EQ(Metric("deltasync_agent_pulls_total"), 1);
  // The next successful pull clears it.
  auto [s2, b2] = Pull(R"({"target_version": 3})");
  EXPECT_EQ(s2, 200) << b2.dump();
  auto [st2, st2_body] = Get("/status");
  EXPECT_TRUE(st2_body["last_error"].is_null());
  EXPECT_EQ(st2_body["last_pull"]["version"], 3);
}

TEST_F(AgentTest, VersionVanishingDuringPullIs404) {
  checkpoint_->next_pull_error = Status::NotFound("version dir weight_v000003 is missing");
  StartAgent();
  auto [status, body] = Pull(R"({"target_version": 3})");
  EXPECT_EQ(status, 404);
  EXPECT_EQ(body["code"], "version_not_found");
}

TEST_F(AgentTest, UnreadableStoreIs500) {
  checkpoint_->latest_error = Status::IOError("cannot list /store: Permission denied");
  StartAgent();
  auto [status, body] = Pull(R"({"target_version": 1})");
  EXPECT_EQ(status, 500);
  EXPECT_EQ(body["code"], "store_unreadable");
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST_F(AgentTest, VerifyAfterPullRunsAndItsFailureFailsThePull) {
  AgentOptions options;
  options.verify_after_pull = true;
  StartAgent(options);
  auto [s1, b1] = Pull(R"({"target_version": 1})");
  EXPECT_EQ(s1, 200) << b1.dump();
  EXPECT_EQ(checkpoint_->verify_calls, 1);
  checkpoint_->verify_error = Status::Corruption("tensor 'x' does not match");
  auto [s2, b2] = Pull(R"({"target_version": 2})");
  EXPECT_EQ(s2, 500);
  EXPECT_EQ(b2["code"], "verify_failed");
}

TEST_F(AgentTest, StatusHealthAndMetricsEndpoints) {
  checkpoint_->current = 1;
  StartAgent();
  auto [hs, health] = Get("/health");
  EXPECT_EQ(hs, 200);
  EXPECT_EQ(health["status"], "ok");
  auto [ss, status] = Get("/status");
  EXPECT_EQ(ss, 200);
  EXPECT_EQ(status["applied_version"], 1);
  EXPECT_EQ(status["store_latest"], 3);
  EXPECT_EQ(status["state"], "idle");
  EXPECT_EQ(status["busy"], false);
  EXPECT_TRUE(status["last_error"].is_null());
  EXPECT_EQ(status["local"], checkpoint_->local);
  ASSERT_EQ(Pull(R"({"target_version": 2})").first, 200);
  ASSERT_EQ(Pull(R"({"target_version": 3})").first, 200);
  EXPECT_EQ(Metric("deltasync_agent_pulls_total"), 2);
  EXPECT_EQ(Metric("deltasync_agent_pull_failures_total"), 0);
  EXPECT_EQ(Metric("deltasync_agent_bytes_read_total"), 1002 + 1003);
  EXPECT_EQ(Metric("deltasync_agent_apply_seconds_count"), 2);
  EXPECT_EQ(Metric("deltasync_agent_applied_version"), 3);
  EXPECT_EQ(Metric("deltasync_agent_busy"), 0);
  // Every connection is counted once it is closed, with the CPU it took.
  double connections = 0;
  for (int i = 0; i < 200 && connections < 4; ++i) {
    connections = Metric("deltasync_agent_connections_total");
    if (connections < 4) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE(connections, 4);
  EXPECT_GT(Metric("deltasync_agent_request_cpu_seconds_total"), 0.0);
  httplib::Result res = client_->Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->get_header_value("Content-Type").rfind("text/plain", 0), 0u);
}

TEST_F(AgentTest, UnknownPathsAndWrongMethodsGetJsonErrors) {
  StartAgent();
  auto [s1, b1] = Get("/nope");
  EXPECT_EQ(s1, 404);
  EXPECT_EQ(b1["code"], "not_found");
  auto [s2, b2] = Get("/pull_weights");
  EXPECT_EQ(s2, 405);
  EXPECT_EQ(b2["code"], "method_not_allowed");
  httplib::Result res = client_->Post("/status", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST_F(AgentTest, TokenIsRequiredWhenSet) {
  AgentOptions options;
  options.token = "s3cret-token";
  StartAgent(options);
  httplib::Client anonymous("127.0.0.1", agent_->port());
  for (const char* path : {"/health", "/status", "/metrics"}) {
    httplib::Result res = anonymous.Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 401) << path;
    EXPECT_EQ(json::parse(res->body, nullptr, false)["code"], "unauthorized") << path;
  }
  httplib::Result res =
      anonymous.Post("/pull_weights", R"({"target_version": 1})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
  EXPECT_EQ(res->get_header_value("WWW-Authenticate"), "Bearer");

  for (const char* wrong : {"s3cret-toke", "s3cret-token2", "S3CRET-TOKEN", "x"}) {
    httplib::Client c("127.0.0.1", agent_->port());
    c.set_bearer_token_auth(wrong);
    httplib::Result r = c.Post("/pull_weights", R"({"target_version": 1})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401) << wrong;
  }
  httplib::Client basic("127.0.0.1", agent_->port());
  basic.set_basic_auth("user", "s3cret-token");
  httplib::Result r = basic.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(checkpoint_->pull_count(), 0u);

  auto [status, body] = Pull(R"({"target_version": 1})");  // client_ carries the token
  EXPECT_EQ(status, 200) << body.dump();
  EXPECT_EQ(Get("/health").first, 200);
}

TEST_F(AgentTest, UnauthorizedHugeBodyIsRefusedBeforeReading) {
  AgentOptions options;
  options.token = "t";
  options.max_body_bytes = 100;
  StartAgent(options);
  httplib::Client anonymous("127.0.0.1", agent_->port());
  httplib::Result res =
      anonymous.Post("/pull_weights", std::string(1 << 20, 'x'), "application/json");
  // 401 comes first; the server may close before the client finishes
  // sending, which is also a refusal.
  if (res) {
    EXPECT_EQ(res->status, 401);
  }
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST(AgentCreateTest, RefusesNonLoopbackWithoutToken) {
  auto make = [](const std::string& host, const std::string& token) {
    AgentOptions options;
    options.host = host;
    options.token = token;
    return Agent::Create(options, std::make_unique<FakePuller>(std::make_shared<FakeCheckpoint>()),
                         nullptr);
  };
  for (const char* host : {"0.0.0.0", "::", "[::]", "10.1.2.3", "example.com", "192.168.0.1"}) {
    Result<std::unique_ptr<Agent>> agent = make(host, "");
    ASSERT_FALSE(agent.ok()) << host;
    EXPECT_EQ(agent.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(agent.status().message().find("token"), std::string::npos);
  }
  // With a token they are allowed (not started here: tests bind loopback only).
  EXPECT_TRUE(make("0.0.0.0", "tok").ok());
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) {
    EXPECT_TRUE(make(host, "").ok()) << host;
  }
  EXPECT_FALSE(Agent::Create(AgentOptions{}, nullptr, nullptr).ok());
  AgentOptions bad_port;
  bad_port.port = 70000;
  EXPECT_FALSE(Agent::Create(bad_port,
                             std::make_unique<FakePuller>(std::make_shared<FakeCheckpoint>()),
                             nullptr)
                   .ok());
}

TEST_F(AgentTest, RequestThreadsYieldToThePull) {
  const int own_nice = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
  if (own_nice >= 19) GTEST_SKIP() << "the test already runs at nice 19";
  StartAgent();
  ASSERT_EQ(Pull("{\"target_version\": 2}").first, 200);
  ASSERT_EQ(Get("/status").first, 200);
  // /status (and the request parsing of every endpoint) runs at nice 19; the
  // pull keeps the priority of the thread that started the agent.
  EXPECT_EQ(checkpoint_->latest_thread_nice.load(), 19);
  EXPECT_EQ(checkpoint_->pull_thread_nice.load(), own_nice);
}

TEST_F(AgentTest, RequestNiceZeroLeavesRequestThreadsAlone) {
  const int own_nice = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
  AgentOptions options;
  options.request_nice = 0;
  StartAgent(options);
  ASSERT_EQ(Get("/status").first, 200);
  EXPECT_EQ(checkpoint_->latest_thread_nice.load(), own_nice);
  ASSERT_EQ(Pull("").first, 200);
  EXPECT_EQ(checkpoint_->pull_thread_nice.load(), own_nice);
}

TEST(AgentCreateTest, RequestNiceOutsideRangeIsRefused) {
  for (int nice : {-1, 20}) {
    AgentOptions options;
    options.request_nice = nice;
    Result<std::unique_ptr<Agent>> agent = Agent::Create(
        options, std::make_unique<FakePuller>(std::make_shared<FakeCheckpoint>()), nullptr);
    ASSERT_FALSE(agent.ok()) << nice;
    EXPECT_EQ(agent.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(agent.status().message().find("nice"), std::string::npos);
  }
}

TEST(AgentCreateTest, LoopbackHosts) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.255.0.9"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_TRUE(IsLoopbackHost("[::1]"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("128.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("::"));
  EXPECT_FALSE(IsLoopbackHost("::ffff:10.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("localhost.evil.com"));
  EXPECT_FALSE(IsLoopbackHost(""));
}

TEST(AgentCreateTest, BindFailureIsAnError) {
  testing_agent::LoopbackServer taken;
  const int port = taken.Start();
  ASSERT_GT(port, 0);
  AgentOptions options;
  options.port = port;
  Result<std::unique_ptr<Agent>> agent = Agent::Create(
      options, std::make_unique<FakePuller>(std::make_shared<FakeCheckpoint>()), nullptr);
  ASSERT_TRUE(agent.ok());
  // httplib sets SO_REUSEADDR, which on Linux still refuses a port in LISTEN.
  Status started = (*agent)->Start();
  EXPECT_FALSE(started.ok());
  EXPECT_EQ(started.code(), StatusCode::kIOError);
  EXPECT_EQ(started.message(),
            "cannot listen on 127.0.0.1:" + std::to_string(port) + ": address already in use");
}

TEST_F(AgentTest, PullsAreSerializedAndStatusAnswersWhileBusy) {
  checkpoint_->pull_delay = std::chrono::milliseconds(300);
  StartAgent();
  std::vector<std::thread> threads;
  std::vector<int> statuses(3, 0);
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", agent_->port());
      c.set_read_timeout(10, 0);
      httplib::Result r =
          c.Post("/pull_weights", R"({"target_version": )" + std::to_string(i + 1) + "}",
                 "application/json");
      statuses[i] = r ? r->status : -1;
    });
  }
  // While pulls are queued, /status answers at once and says busy.
  bool saw_busy = false;
  for (int i = 0; i < 200 && !saw_busy; ++i) {
    const auto start = std::chrono::steady_clock::now();
    auto [s, body] = Get("/status");
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
    if (s == 200 && body["busy"] == true) {
      saw_busy = true;
      EXPECT_EQ(body["state"], "busy");
      EXPECT_FALSE(body["pulling_target"].is_null());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(saw_busy);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(statuses, std::vector<int>({200, 200, 200}));
  EXPECT_EQ(checkpoint_->max_pulls_in_flight.load(), 1);
  EXPECT_EQ(checkpoint_->pull_count(), 3u);
}

TEST_F(AgentTest, StopLetsTheInFlightPullFinish) {
  checkpoint_->pull_delay = std::chrono::milliseconds(400);
  StartAgent();
  const int port = agent_->port();
  int pull_status = 0;
  json pull_body;
  std::thread puller([&] {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(10, 0);
    httplib::Result r = c.Post("/pull_weights", R"({"target_version": 2})", "application/json");
    pull_status = r ? r->status : -1;
    if (r) pull_body = json::parse(r->body, nullptr, false);
  });
  while (checkpoint_->pulls_in_flight.load() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  client_.reset();  // no idle keep-alive connection of ours holds the server
  agent_->Stop();
  puller.join();
  EXPECT_EQ(pull_status, 200);
  EXPECT_EQ(pull_body["version"], 2);
  EXPECT_EQ(checkpoint_->current, 2);
  httplib::Client after("127.0.0.1", port);
  after.set_connection_timeout(1, 0);
  EXPECT_FALSE(after.Get("/health"));
  agent_->Stop();  // idempotent
}

TEST_F(AgentTest, ReloadRunsAfterEachSuccessfulPull) {
  StartAgent({}, /*with_reloader=*/true);
  auto [s1, b1] = Pull(R"({"target_version": 2, "model_path": "/etc"})");
  ASSERT_EQ(s1, 200) << b1.dump();
  EXPECT_EQ(b1["reloaded"], true);
  ASSERT_EQ(reload_->calls.size(), 1u);
  // The path comes from the agent's configuration, never from the request.
  EXPECT_EQ(reload_->calls[0].first, checkpoint_->local);
  EXPECT_EQ(reload_->calls[0].second, 2);

  checkpoint_->next_pull_error = Status::Corruption("bad frame");
  EXPECT_EQ(Pull(R"({"target_version": 3})").first, 500);
  EXPECT_EQ(reload_->calls.size(), 1u) << "no reload after a failed pull";

  reload_->result = Status::Aborted("engine answered 500");
  auto [s3, b3] = Pull(R"({"target_version": 3})");
  EXPECT_EQ(s3, 502);
  EXPECT_EQ(b3["code"], "reload_failed");
  EXPECT_NE(b3["error"].get<std::string>().find("engine answered 500"), std::string::npos);
  EXPECT_EQ(b3["version"], 3);
  EXPECT_EQ(Metric("deltasync_agent_reload_failures_total"), 1);
  EXPECT_EQ(Metric("deltasync_agent_reloads_total"), 2);
  auto [st, status] = Get("/status");
  EXPECT_EQ(status["applied_version"], 3);
  EXPECT_EQ(status["last_error"]["code"], "reload_failed");
}

TEST_F(AgentTest, SlowHeadsNeitherStarveHealthNorOutliveTheirDeadline) {
  AgentOptions options;
  options.head_timeout_seconds = 1.5;
  StartAgent(options);
  client_->set_read_timeout(2, 0);
  // More connections than there are request threads, each sending a header
  // line every 100 ms: never idle long enough for a per-read timeout.
  constexpr int kSlow = 24;
  const auto opened = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<RawConnection>> slow;
  for (int i = 0; i < kSlow; ++i) {
    slow.push_back(std::make_unique<RawConnection>(agent_->port()));
    ASSERT_TRUE(slow.back()->connected());
    ASSERT_TRUE(
        slow.back()->Send(i % 2 ? "GET /health HTTP/1.1\r\n" : "POST /pull_weights HTTP/1.1\r\n"));
  }
  Trickler trickler([&] {
    for (auto& c : slow) c->Send("X-Slow: 1\r\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (const char* path : {"/health", "/status", "/health"}) {
    const auto start = std::chrono::steady_clock::now();
    auto [status, body] = Get(path);
    EXPECT_EQ(status, 200) << path;
    EXPECT_LT(SecondsSince(start), 0.5) << path;
  }
  // That was under load: every slow connection was still being held.
  ASSERT_LT(SecondsSince(opened), 1.4) << "the machine is too slow for this test's timing";
  // Each slow connection is answered 408 at its head deadline.
  for (auto& c : slow) {
    const std::string answer = c->ReadFor(3);
    EXPECT_GT(SecondsSince(opened), 1.4);
    EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
    EXPECT_EQ(ResponseJson(answer)["code"], "request_timeout") << answer;
  }
  EXPECT_LT(SecondsSince(opened), 3.0);
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST_F(AgentTest, SlowBodyGets408AtItsDeadline) {
  AgentOptions options;
  options.body_timeout_seconds = 0.5;
  StartAgent(options);
  RawConnection c(agent_->port());
  ASSERT_TRUE(c.Send("POST /pull_weights HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{"));
  const auto start = std::chrono::steady_clock::now();
  Trickler trickler([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return c.Send(" ");
  });
  // /health is served by other threads than the body being read.
  EXPECT_EQ(Get("/health").first, 200);
  const std::string answer = c.ReadFor(3);
  const double seconds = SecondsSince(start);
  EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
  EXPECT_EQ(ResponseJson(answer)["code"], "request_timeout") << answer;
  EXPECT_GT(seconds, 0.4);
  EXPECT_LT(seconds, 1.5);
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST_F(AgentTest, RefusedLargeBodyStillGetsItsAnswer) {
  AgentOptions options;
  options.max_body_bytes = 1024;
  StartAgent(options);
  // More than the socket buffers hold (the sender's grows to 4 MiB): the
  // agent answers before the body is through, and the client reads the
  // answer only once it has sent everything.
  const std::string body(8 << 20, ' ');
  httplib::Result res = client_->Post("/pull_weights", body, "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 413);
  const json answer = json::parse(res->body, nullptr, false);
  EXPECT_EQ(answer["code"], "body_too_large") << res->body;
  EXPECT_NE(answer["error"].get<std::string>().find("limit of 1024"), std::string::npos);
  // The same sent chunked: refused once the first chunk's size is read.
  RawConnection c(agent_->port());
  char size_line[32];
  std::snprintf(size_line, sizeof(size_line), "%zx\r\n", body.size());
  ASSERT_TRUE(
      c.Send("POST /pull_weights HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
             std::string(size_line) + body + "\r\n0\r\n\r\n"));
  const std::string chunked = c.ReadFor(5);
  EXPECT_EQ(chunked.rfind("HTTP/1.1 413", 0), 0u) << chunked.substr(0, 200);
  EXPECT_EQ(ResponseJson(chunked)["code"], "body_too_large");
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST_F(AgentTest, AmbiguousOrBrokenFramingIs400AndPullsNothing) {
  StartAgent();
  const std::string post = "POST /pull_weights HTTP/1.1\r\nHost: x\r\n";
  struct Case {
    const char* what;
    std::string request;
    int status;
    const char* code;
  };
  const std::vector<Case> cases = {
      {"chunk size that is not hex", post + "Transfer-Encoding: chunked\r\n\r\nzz\r\n\r\n", 400,
       "bad_request"},
      {"chunk data longer than its size",
       post + "Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX\r\n0\r\n\r\n", 400, "bad_request"},
      {"two Content-Length", post + "Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400,
       "bad_request"},
      {"Content-Length and Transfer-Encoding",
       post + "Content-Length: 13\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400,
       "bad_request"},
      {"coding other than chunked", post + "Transfer-Encoding: gzip\r\n\r\n{}", 400, "bad_request"},
      {"coding before chunked", post + "Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501,
       "unsupported_transfer_encoding"},
      {"percent-encoded length", post + "Content-Length: %32\r\n\r\n{}", 400, "bad_request"},
      {"space before the colon", post + "Content-Length : 2\r\n\r\n{}", 400, "bad_request"},
      {"bare LF", "POST /pull_weights HTTP/1.1\r\nHost: x\nContent-Length: 2\r\n\r\n{}", 400,
       "bad_request"},
      {"folded field", post + "X-A: 1\r\n Content-Length: 2\r\n\r\n{}", 400, "bad_request"},
      {"compressed body", post + "Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 415,
       "unsupported_content_encoding"},
  };
  for (const Case& c : cases) {
    const std::string answer = RawRequest(c.request);
    EXPECT_EQ(answer.rfind("HTTP/1.1 " + std::to_string(c.status), 0), 0u)
        << c.what << ": " << answer;
    const json body = ResponseJson(answer);
    EXPECT_EQ(body["code"], c.code) << c.what << ": " << answer;
    EXPECT_TRUE(body["error"].is_string()) << c.what;
  }
  // Bodies that end (the client closes) before they are whole.
  for (const std::string& cut : {post + "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
                                 post + "Content-Length: 20\r\n\r\n{}"}) {
    RawConnection conn(agent_->port());
    ASSERT_TRUE(conn.Send(cut));
    conn.ShutdownWrite();
    const std::string answer = conn.ReadFor(5);
    EXPECT_EQ(answer.rfind("HTTP/1.1 400", 0), 0u) << answer;
    EXPECT_EQ(ResponseJson(answer)["code"], "bad_request") << answer;
  }
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
  // A well-formed chunked body (with an extension and a trailer) pulls.
  const std::string json_body = R"({"target_version": 2})";
  char size_line[16];
  std::snprintf(size_line, sizeof(size_line), "%zx;ext=1\r\n", json_body.size());
  const std::string answer = RawRequest(post + "Transfer-Encoding: chunked\r\n\r\n" + size_line +
                                        json_body + "\r\n0\r\nX-Trailer: t\r\n\r\n");
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
  EXPECT_EQ(ResponseJson(answer)["version"], 2);
  EXPECT_EQ(checkpoint_->pull_count(), 1u);
}

TEST_F(AgentTest, TokenMustMatchWhole) {
  AgentOptions options;
  options.token = "tok";
  StartAgent(options);
  auto request = [](const std::string& authorization) {
    return "POST /pull_weights HTTP/1.1\r\nHost: x\r\n" + authorization +
           "Content-Length: 2\r\n\r\n{}";
  };
  struct Case {
    const char* what;
    std::string authorization;
    int status;
  };
  for (const Case& c : std::vector<Case>{
           {"NUL after the token", "Authorization: Bearer tok\0extra\r\n"s, 400},
           {"escaped NUL after the token", "Authorization: Bearer tok%00extra\r\n", 401},
           {"a second, wrong token", "Authorization: Bearer tok\r\nAuthorization: Bearer x\r\n",
            401},
           {"control character", "Authorization: Bearer tok\x01\r\n", 400},
       }) {
    const std::string answer = RawRequest(request(c.authorization));
    EXPECT_EQ(answer.rfind("HTTP/1.1 " + std::to_string(c.status), 0), 0u)
        << c.what << ": " << answer;
  }
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
  const std::string ok = RawRequest(request("Authorization: Bearer tok\r\n"));
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  EXPECT_EQ(checkpoint_->pull_count(), 1u);
}

TEST_F(AgentTest, PreconditionFailureIs409) {
  checkpoint_->current = 2;
  checkpoint_->next_pull_error = Status::FailedPrecondition(
      "weight_v000003: the local checkpoint is not this version's base; rolled back to version 2");
  StartAgent();
  auto [status, body] = Pull(R"({"target_version": 3})");
  EXPECT_EQ(status, 409);
  EXPECT_EQ(body["code"], "precondition_failed");
  EXPECT_EQ(body["status"], "FailedPrecondition");
  EXPECT_NE(body["error"].get<std::string>().find("not this version's base"), std::string::npos);
  EXPECT_EQ(body["applied_version"], 2);
  EXPECT_EQ(Get("/status").second["last_error"]["code"], "precondition_failed");
  // A pull that ran and failed, not a refused request.
  EXPECT_EQ(Metric("deltasync_agent_pulls_total"), 1);
  EXPECT_EQ(Metric("deltasync_agent_pull_failures_total"), 1);
  EXPECT_EQ(Metric("deltasync_agent_rejected_requests_total"), 0);
}

TEST_F(AgentTest, PullsTotalCountsEveryPullThatRan) {
  StartAgent();
  ASSERT_EQ(Pull(R"({"target_version": 2})").first, 200);
  auto [again, again_body] = Pull(R"({"target_version": 2})");
  ASSERT_EQ(again, 200);
  EXPECT_EQ(again_body["applied"], false);
  checkpoint_->next_pull_error = Status::IOError("disk full");
  ASSERT_EQ(Pull(R"({"target_version": 3})").first, 500);
  ASSERT_EQ(Pull("{oops").first, 400);
  ASSERT_EQ(Pull(R"({"target_version": 9})").first, 404);
  EXPECT_EQ(Metric("deltasync_agent_pulls_total"), 3);  // applied, no-op, failed
  EXPECT_EQ(Metric("deltasync_agent_pull_failures_total"), 1);
  EXPECT_EQ(Metric("deltasync_agent_rejected_requests_total"), 2);
  EXPECT_EQ(Metric("deltasync_agent_apply_seconds_count"), 2);
}

TEST_F(AgentTest, OnlyPullWeightsWaitsForABody) {
  AgentOptions options;
  options.max_body_bytes = 100;
  StartAgent(options);
  // Bodies announced but never sent: answered from the head at once.
  struct Case {
    std::string request;
    int status;
    const char* code;
  };
  for (const Case& c : std::vector<Case>{
           {"PUT /health HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n", 405,
            "method_not_allowed"},
           {"POST /status HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n", 405,
            "method_not_allowed"},
           {"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n", 404, "not_found"},
           {"DELETE /pull_weights HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n", 405,
            "method_not_allowed"},
           // Told before it sends the body that it is too large.
           {"POST /pull_weights HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            "Content-Length: 1000\r\n\r\n",
            413, "body_too_large"},
       }) {
    RawConnection conn(agent_->port());
    ASSERT_TRUE(conn.Send(c.request));
    const auto start = std::chrono::steady_clock::now();
    const std::string answer = conn.ReadFor(5);
    EXPECT_LT(SecondsSince(start), 1.0) << c.request;
    EXPECT_EQ(answer.rfind("HTTP/1.1 " + std::to_string(c.status), 0), 0u) << answer;
    EXPECT_EQ(ResponseJson(answer)["code"], c.code) << answer;
  }
  // A Range header does not cut a JSON answer.
  httplib::Headers range = {{"Range", "bytes=0-1"}};
  httplib::Result res = client_->Get("/health", range);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(json::parse(res->body, nullptr, false)["status"], "ok") << res->body;
  // A malformed one is refused, in the same JSON shape.
  const std::string bad_range =
      RawRequest("GET /health HTTP/1.1\r\nHost: x\r\nRange: bytes=x\r\n\r\n");
  EXPECT_EQ(bad_range.rfind("HTTP/1.1 416", 0), 0u) << bad_range;
  EXPECT_EQ(ResponseJson(bad_range)["code"], "range_not_satisfiable") << bad_range;
  EXPECT_EQ(checkpoint_->pull_count(), 0u);
}

TEST_F(AgentTest, StopAnswersConnectionsStillSendingTheirHead) {
  StartAgent();
  RawConnection c(agent_->port());
  ASSERT_TRUE(c.Send("GET /health HTTP/1.1\r\n"));
  // Until the agent holds the connection (it answers a complete request).
  ASSERT_EQ(Get("/health").first, 200);
  client_.reset();
  agent_->Stop();
  const std::string answer = c.ReadFor(2);
  EXPECT_EQ(answer.rfind("HTTP/1.1 503", 0), 0u) << answer;
  EXPECT_EQ(ResponseJson(answer)["code"], "shutting_down") << answer;
}

TEST(AgentCreateTest, RequestTimeoutsMustBePositive) {
  for (double bad : {0.0, -1.0, std::nan(""), 1e9}) {
    AgentOptions options;
    options.body_timeout_seconds = bad;
    Result<std::unique_ptr<Agent>> agent = Agent::Create(
        options, std::make_unique<FakePuller>(std::make_shared<FakeCheckpoint>()), nullptr);
    ASSERT_FALSE(agent.ok()) << bad;
    EXPECT_EQ(agent.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(agent.status().message().find("timeouts"), std::string::npos);
  }
}

TEST(TokenFileTest, ReadsAndTrims) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/agent_token_test.txt";
  { std::ofstream(path) << "  abc.DEF-123\n"; }
  Result<std::string> token = ReadTokenFile(path);
  ASSERT_TRUE(token.ok()) << token.status().ToString();
  EXPECT_EQ(*token, "abc.DEF-123");
  { std::ofstream(path) << "\n \n"; }
  EXPECT_EQ(ReadTokenFile(path).status().code(), StatusCode::kInvalidArgument);
  { std::ofstream(path) << "two words"; }
  EXPECT_EQ(ReadTokenFile(path).status().code(), StatusCode::kInvalidArgument);
  { std::ofstream(path) << "a%41b"; }
  EXPECT_EQ(ReadTokenFile(path).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ReadTokenFile(path).status().message().find("'%'"), std::string::npos);
  EXPECT_EQ(ReadTokenFile(dir + "/no-such-token-file").status().code(), StatusCode::kIOError);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace deltasync
