#include <gtest/gtest.h>

#include <atomic>
#include <nlohmann/json.hpp>

#include "agent/agent_test_util.h"
#include "deltasync/agent.h"

namespace deltasync {
namespace {

using nlohmann::json;
using testing_agent::LoopbackServer;

// A stand-in agent whose /pull_weights answers are scripted per attempt.
class ScriptedAgent {
 public:
  struct Reply {
    int status = 200;
    json body;
    int delay_ms = 0;
  };
  // Replies in order; the last one repeats.
  explicit ScriptedAgent(std::vector<Reply> replies) : replies_(std::move(replies)) {
    server_.server().Post(
        "/pull_weights", [this](const httplib::Request& req, httplib::Response& res) {
          Reply reply;
          {
            std::lock_guard<std::mutex> lock(mu_);
            requests_.push_back(json::parse(req.body, nullptr, false));
            authorization_.push_back(req.get_header_value("Authorization"));
            reply = replies_[std::min(requests_.size() - 1, replies_.size() - 1)];
          }
          if (reply.delay_ms > 0)
            std::this_thread::sleep_for(std::chrono::milliseconds(reply.delay_ms));
          res.status = reply.status;
          res.set_content(reply.body.dump(), "application/json");
        });
    EXPECT_GT(server_.Start(), 0);
  }
  static Reply Ok(int64_t version) {
    return {200, json{{"version", version},
                      {"applied", true},
                      {"verified", true},
                      {"bytes_read", 123},
                      {"tensors_changed", 4}}};
  }
  static Reply Error(int status, const std::string& code, const std::string& message) {
    return {status, json{{"error", message}, {"code", code}}};
  }
  std::string url() const { return server_.url(); }
  size_t requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_.size();
  }
  json request(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_.at(i);
  }
  std::string authorization(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return authorization_.at(i);
  }
  void Stop() { server_.Stop(); }

 private:
  std::mutex mu_;
  std::vector<Reply> replies_;
  std::vector<json> requests_;
  std::vector<std::string> authorization_;
  LoopbackServer server_;
};

EnginePullOptions FastOptions() {
  EnginePullOptions o;
  o.connect_timeout_seconds = 2;
  o.timeout_seconds = 5;
  o.retries = 3;
  o.backoff_initial_seconds = 0.01;
  o.backoff_max_seconds = 0.05;
  return o;
}

TEST(CoordinatorTest, SucceedsWhenEveryEngineReportsTheVersion) {
  ScriptedAgent a({ScriptedAgent::Ok(7)});
  ScriptedAgent b({ScriptedAgent::Ok(7)});
  EnginePullOptions options = FastOptions();
  options.token = "tok";
  const std::vector<std::string> engines = {a.url(), b.url() + "/"};
  std::vector<EnginePullOutcome> out = PullOnEngines(engines, 7, options);
  ASSERT_EQ(out.size(), 2u);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_TRUE(out[i].ok) << out[i].error;
    EXPECT_EQ(out[i].engine, engines[i]);
    EXPECT_EQ(out[i].version, 7);
    EXPECT_EQ(out[i].attempts, 1);
    EXPECT_EQ(out[i].http_status, 200);
    EXPECT_EQ(out[i].bytes_read, 123u);
    EXPECT_EQ(out[i].tensors_changed, 4u);
  }
  EXPECT_TRUE(SummarizeEngineOutcomes(out).ok());
  EXPECT_EQ(a.request(0)["target_version"], 7);
  EXPECT_EQ(a.authorization(0), "Bearer tok");
  EXPECT_EQ(b.requests(), 1u);
}

TEST(CoordinatorTest, LatestTargetIsSentAsLatest) {
  ScriptedAgent a({ScriptedAgent::Ok(4)});
  std::vector<EnginePullOutcome> out = PullOnEngines({a.url()}, std::nullopt, FastOptions());
  ASSERT_TRUE(out[0].ok) << out[0].error;
  EXPECT_EQ(a.request(0)["target_version"], "latest");
  EXPECT_EQ(a.authorization(0), "");
}

TEST(CoordinatorTest, FailureNamesTheFailedEngine) {
  ScriptedAgent good({ScriptedAgent::Ok(2)});
  ScriptedAgent bad({ScriptedAgent::Error(500, "pull_failed", "Corruption: tensor 'w' mismatch")});
  EnginePullOptions options = FastOptions();
  options.retries = 1;
  const int dead_port = testing_agent::UnusedLoopbackPort();
  const std::string dead = "127.0.0.1:" + std::to_string(dead_port);
  std::vector<EnginePullOutcome> out = PullOnEngines({good.url(), bad.url(), dead}, 2, options);
  EXPECT_TRUE(out[0].ok);
  EXPECT_FALSE(out[1].ok);
  EXPECT_EQ(out[1].http_status, 500);
  EXPECT_EQ(out[1].error_code, "pull_failed");
  EXPECT_EQ(out[1].attempts, 2);
  EXPECT_FALSE(out[2].ok);
  EXPECT_EQ(out[2].error_code, "connection");
  EXPECT_EQ(out[2].http_status, 0);
  EXPECT_EQ(out[2].attempts, 2);
  Status summary = SummarizeEngineOutcomes(out);
  ASSERT_FALSE(summary.ok());
  const std::string& msg = summary.message();
  EXPECT_NE(msg.find("2 of 3 engines failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find(bad.url() + ": HTTP 500: Corruption: tensor 'w' mismatch"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find(dead + ": "), std::string::npos) << msg;
  EXPECT_EQ(msg.find(good.url() + ":"), std::string::npos) << msg;
}

TEST(CoordinatorTest, UnreachableEngineErrorSaysWhy) {
  const std::string dead =
      "http://127.0.0.1:" + std::to_string(testing_agent::UnusedLoopbackPort());
  EnginePullOptions options = FastOptions();
  options.retries = 0;
  std::vector<EnginePullOutcome> out = PullOnEngines({dead}, 1, options);
  ASSERT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].error_code, "connection");
  EXPECT_EQ(out[0].error, "cannot connect: connection refused");
  const Status summary = SummarizeEngineOutcomes(out);
  EXPECT_EQ(summary.message(),
            "1 of 1 engines failed: " + dead + ": cannot connect: connection refused");
}

TEST(CoordinatorTest, PreconditionFailureIsFinal) {
  // A real agent whose pull finds that the store's versions do not apply
  // to what its host holds: a 4xx, so one attempt.
  auto checkpoint = std::make_shared<testing_agent::FakeCheckpoint>();
  checkpoint->current = 1;
  checkpoint->next_pull_error =
      Status::FailedPrecondition("version 000002 applies to version 000005, not 000001");
  Result<std::unique_ptr<Agent>> agent = Agent::Create(
      AgentOptions{}, std::make_unique<testing_agent::FakePuller>(checkpoint), nullptr);
  ASSERT_TRUE(agent.ok());
  ASSERT_TRUE((*agent)->Start().ok());
  const std::string url = "http://127.0.0.1:" + std::to_string((*agent)->port());
  EnginePullOptions options = FastOptions();
  options.retries = 3;
  std::vector<EnginePullOutcome> out = PullOnEngines({url}, 2, options);
  ASSERT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].http_status, 409);
  EXPECT_EQ(out[0].error_code, "precondition_failed");
  EXPECT_EQ(out[0].attempts, 1);
  EXPECT_EQ(checkpoint->pull_count(), 1u);
  EXPECT_NE(out[0].error.find("applies to version 000005"), std::string::npos) << out[0].error;
}

TEST(CoordinatorTest, RetriesOn5xxThenSucceeds) {
  ScriptedAgent flaky({ScriptedAgent::Error(503, "unavailable", "busy"),
                       ScriptedAgent::Error(502, "reload_failed", "engine down"),
                       ScriptedAgent::Ok(5)});
  std::vector<EnginePullOutcome> out = PullOnEngines({flaky.url()}, 5, FastOptions());
  ASSERT_TRUE(out[0].ok) << out[0].error;
  EXPECT_EQ(out[0].attempts, 3);
  EXPECT_EQ(flaky.requests(), 3u);
  EXPECT_TRUE(out[0].error.empty());
}

TEST(CoordinatorTest, RetriesAreBounded) {
  ScriptedAgent broken({ScriptedAgent::Error(500, "pull_failed", "disk full")});
  EnginePullOptions options = FastOptions();
  options.retries = 2;
  std::vector<EnginePullOutcome> out = PullOnEngines({broken.url()}, 5, options);
  EXPECT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].attempts, 3);
  EXPECT_EQ(broken.requests(), 3u);
  EXPECT_NE(out[0].error.find("after 3 attempts"), std::string::npos) << out[0].error;
}

TEST(CoordinatorTest, NoRetryOn4xx) {
  ScriptedAgent refusing({ScriptedAgent::Error(404, "version_not_found", "no version 9")});
  std::vector<EnginePullOutcome> out = PullOnEngines({refusing.url()}, 9, FastOptions());
  EXPECT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].attempts, 1);
  EXPECT_EQ(refusing.requests(), 1u);
  EXPECT_EQ(out[0].http_status, 404);
  EXPECT_EQ(out[0].error_code, "version_not_found");
  EXPECT_NE(out[0].error.find("no version 9"), std::string::npos);
}

TEST(CoordinatorTest, TimeoutFailsTheEngineInBoundedTime) {
  ScriptedAgent slow({{200, ScriptedAgent::Ok(1).body, 1500}});
  EnginePullOptions options = FastOptions();
  options.timeout_seconds = 0.3;
  options.retries = 0;
  const auto start = std::chrono::steady_clock::now();
  std::vector<EnginePullOutcome> out = PullOnEngines({slow.url()}, 1, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].error_code, "timeout");
  EXPECT_EQ(out[0].attempts, 1);
  EXPECT_LT(out[0].seconds, 1.4);
  // The server's worker is still sleeping: the destructor waits it out.
  EXPECT_LT(seconds, 1.4);
}

TEST(CoordinatorTest, TimeoutIsRetried) {
  ScriptedAgent slow_then_fast({{200, ScriptedAgent::Ok(1).body, 600}, ScriptedAgent::Ok(1)});
  EnginePullOptions options = FastOptions();
  options.timeout_seconds = 0.2;
  options.retries = 1;
  std::vector<EnginePullOutcome> out = PullOnEngines({slow_then_fast.url()}, 1, options);
  EXPECT_TRUE(out[0].ok) << out[0].error;
  EXPECT_EQ(out[0].attempts, 2);
}

TEST(CoordinatorTest, EnginesArePulledConcurrently) {
  std::vector<std::unique_ptr<ScriptedAgent>> agents;
  std::vector<std::string> urls;
  for (int i = 0; i < 4; ++i) {
    agents.push_back(std::make_unique<ScriptedAgent>(
        std::vector<ScriptedAgent::Reply>{{200, ScriptedAgent::Ok(1).body, 300}}));
    urls.push_back(agents.back()->url());
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<EnginePullOutcome> out = PullOnEngines(urls, 1, FastOptions());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const EnginePullOutcome& o : out) EXPECT_TRUE(o.ok) << o.error;
  EXPECT_LT(seconds, 1.0) << "4 engines x 0.3 s each should overlap";
}

TEST(CoordinatorTest, ResponsesThatDoNotConfirmTheTargetFail) {
  ScriptedAgent wrong({ScriptedAgent::Ok(6)});
  ScriptedAgent unverified({{200, json{{"version", 7}, {"verified", false}}}});
  ScriptedAgent garbage({{200, json("not an object")}});
  std::vector<EnginePullOutcome> out =
      PullOnEngines({wrong.url(), unverified.url(), garbage.url()}, 7, FastOptions());
  EXPECT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].error_code, "wrong_version");
  EXPECT_NE(out[0].error.find("version 6, expected 7"), std::string::npos);
  EXPECT_FALSE(out[1].ok);
  EXPECT_EQ(out[1].error_code, "not_verified");
  EXPECT_FALSE(out[2].ok);
  EXPECT_EQ(out[2].error_code, "bad_response");
  // None of these are retried: the agent answered, and the answer is wrong.
  EXPECT_EQ(wrong.requests(), 1u);
}

TEST(CoordinatorTest, MalformedUrlFailsOnlyItsEngine) {
  ScriptedAgent a({ScriptedAgent::Ok(1)});
  std::vector<EnginePullOutcome> out =
      PullOnEngines({"ftp://x:1", a.url(), "http://:80"}, 1, FastOptions());
  EXPECT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].error_code, "invalid_url");
  EXPECT_EQ(out[0].attempts, 0);
  EXPECT_TRUE(out[1].ok);
  EXPECT_FALSE(out[2].ok);
  // The summary names the URL once.
  EXPECT_NE(SummarizeEngineOutcomes(out).message().find(
                "ftp://x:1: malformed URL: scheme must be http or https"),
            std::string::npos)
      << SummarizeEngineOutcomes(out).message();
}

TEST(CoordinatorTest, CheckEngineUrlsNamesTheFirstBadOne) {
  EXPECT_TRUE(CheckEngineUrls({"127.0.0.1:1", "https://h/x"}).ok());
  const Status bad = CheckEngineUrls({"127.0.0.1:1", "http://h:99999", "ftp://x"});
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "engine URL 'http://h:99999': port must be a number in 1..65535");
  EXPECT_EQ(CheckEngineUrls({}).code(), StatusCode::kInvalidArgument);
}

TEST(CoordinatorTest, PathPrefixIsKept) {
  LoopbackServer server;
  std::atomic<int> hits{0};
  server.server().Post("/engine0/pull_weights",
                       [&](const httplib::Request&, httplib::Response& res) {
                         ++hits;
                         res.set_content(ScriptedAgent::Ok(1).body.dump(), "application/json");
                       });
  ASSERT_GT(server.Start(), 0);
  std::vector<EnginePullOutcome> out = PullOnEngines({server.url() + "/engine0"}, 1, FastOptions());
  EXPECT_TRUE(out[0].ok) << out[0].error;
  EXPECT_EQ(hits.load(), 1);
}

// The coordinator against real agents (with fake checkpoints behind them).
TEST(CoordinatorTest, WorksAgainstRealAgents) {
  std::vector<std::shared_ptr<testing_agent::FakeCheckpoint>> checkpoints;
  std::vector<std::unique_ptr<Agent>> agents;
  std::vector<std::string> urls;
  for (int i = 0; i < 2; ++i) {
    checkpoints.push_back(std::make_shared<testing_agent::FakeCheckpoint>());
    AgentOptions options;
    options.token = "shared-token";
    Result<std::unique_ptr<Agent>> agent = Agent::Create(
        options, std::make_unique<testing_agent::FakePuller>(checkpoints.back()), nullptr);
    ASSERT_TRUE(agent.ok());
    ASSERT_TRUE((*agent)->Start().ok());
    urls.push_back("http://127.0.0.1:" + std::to_string((*agent)->port()));
    agents.push_back(std::move(agent).value());
  }
  EnginePullOptions options = FastOptions();
  options.token = "shared-token";
  std::vector<EnginePullOutcome> out = PullOnEngines(urls, 3, options);
  for (const EnginePullOutcome& o : out) EXPECT_TRUE(o.ok) << o.error;
  for (auto& c : checkpoints) EXPECT_EQ(c->current, 3);

  // A future version is a 4xx: refused at once, not retried.
  out = PullOnEngines(urls, 4, options);
  for (const EnginePullOutcome& o : out) {
    EXPECT_FALSE(o.ok);
    EXPECT_EQ(o.http_status, 404);
    EXPECT_EQ(o.attempts, 1);
  }
  // A wrong token is a 401, named in the summary.
  options.token = "wrong";
  out = PullOnEngines(urls, 3, options);
  Status summary = SummarizeEngineOutcomes(out);
  EXPECT_NE(summary.message().find("HTTP 401"), std::string::npos) << summary.message();
}

TEST(CoordinatorTest, ReportJson) {
  SyncReport report;
  report.version = 4;
  report.publish.info.version = 4;
  report.publish.info.is_delta = true;
  report.publish.info.base_version = 3;
  report.publish_seconds = 0.5;
  EnginePullOutcome ok;
  ok.engine = "http://a:1";
  ok.ok = true;
  ok.version = 4;
  EnginePullOutcome failed;
  failed.engine = "http://b:2";
  failed.error = "HTTP 500: boom";
  failed.error_code = "pull_failed";
  report.engines = {ok, failed};
  report.status = SummarizeEngineOutcomes(report.engines);
  const json j = json::parse(SyncReportToJson(report), nullptr, false);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["ok"], false);
  EXPECT_EQ(j["version"], 4);
  EXPECT_EQ(j["publish_seconds"], 0.5);
  EXPECT_EQ(j["publish"]["base_version"], 3);
  ASSERT_EQ(j["engines"].size(), 2u);
  EXPECT_EQ(j["engines"][0]["ok"], true);
  EXPECT_FALSE(j["engines"][0].contains("error"));
  EXPECT_EQ(j["engines"][1]["error"], "HTTP 500: boom");
  EXPECT_EQ(j["engines"][1]["code"], "pull_failed");
  EXPECT_NE(j["error"].get<std::string>().find("http://b:2"), std::string::npos);
}

}  // namespace
}  // namespace deltasync
