// The agent and the coordinator on the real store: publish, sync to two
// in-process agents, and compare their local checkpoints with the weights
// the trainer published, bit for bit.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/stat.h>
#include <time.h>

#include <nlohmann/json.hpp>

#include "deltasync/agent.h"
#include "deltasync/checkpoint.h"
#include "store/store_test_util.h"

namespace deltasync {
namespace {

using nlohmann::json;
using store_test::HoldsModel;
using store_test::MakeModel;
using store_test::Model;
using store_test::Step;
using store_test::TempDir;
using store_test::WriteModel;

// Every tensor of the checkpoint at `dir` as bytes, read independently of
// the store (straight from the safetensors files).
std::map<std::string, std::vector<uint8_t>> TensorBytes(const std::string& dir) {
  std::map<std::string, std::vector<uint8_t>> out;
  Result<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  EXPECT_TRUE(c.ok()) << dir << ": " << c.status().ToString();
  if (!c.ok()) return out;
  for (const auto& [name, view] : (*c)->tensors()) {
    out[name].assign(view.bytes.begin(), view.bytes.end());
  }
  return out;
}

class AgentStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models_.push_back(MakeModel(7));
    for (int i = 1; i <= 3; ++i) models_.push_back(Step(models_.back(), 500 + i, 0.03));
    for (size_t i = 0; i < models_.size(); ++i) {
      WriteModel(StepDir(static_cast<int>(i)), models_[i]);
    }
  }
  std::string StepDir(int i) const { return tmp_.Join("step" + std::to_string(i)); }
  std::string Local(int i) const { return tmp_.Join("local" + std::to_string(i)); }
  std::string Store() const { return tmp_.Join("store"); }

  // Starts an agent on a real LocalCheckpoint at Local(i), base = step 0.
  void StartAgent(int i, std::unique_ptr<EngineReloader> reloader = nullptr) {
    LocalCheckpointOptions options;
    options.local = Local(i);
    options.store = Store();
    options.base = StepDir(0);
    options.pool = &pool_;
    Result<std::unique_ptr<CheckpointPuller>> puller = OpenLocalCheckpointPuller(options);
    ASSERT_TRUE(puller.ok()) << puller.status().ToString();
    AgentOptions agent_options;
    agent_options.token = "integration-token";
    Result<std::unique_ptr<Agent>> agent =
        Agent::Create(agent_options, std::move(puller).value(), std::move(reloader));
    ASSERT_TRUE(agent.ok()) << agent.status().ToString();
    ASSERT_TRUE((*agent)->Start().ok());
    urls_.push_back("http://127.0.0.1:" + std::to_string((*agent)->port()));
    agents_.push_back(std::move(agent).value());
  }

  SyncOptions Sync() const {
    SyncOptions options;
    options.engines = urls_;
    options.pull.token = "integration-token";
    options.pull.timeout_seconds = 30;
    options.pull.retries = 1;
    options.pull.backoff_initial_seconds = 0.01;
    return options;
  }

  std::unique_ptr<Publisher> MakePublisher(Encoding encoding = Encoding::kSparse) {
    PublisherOptions options;
    options.store = Store();
    options.encoding = encoding;
    options.pool = &pool_;
    Result<std::unique_ptr<Publisher>> p = Publisher::CreateFromCheckpoint(options, StepDir(0));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? std::move(p).value() : nullptr;
  }

  TempDir tmp_;
  ThreadPool pool_{2};
  std::vector<Model> models_;
  std::vector<std::unique_ptr<Agent>> agents_;
  std::vector<std::string> urls_;
};

// /status's store_latest comes from a listing reused while the store
// directory is unchanged; one taken right after a change is never reused.
TEST_F(AgentStoreTest, LatestVersionFollowsTheStoreDirectory) {
  LocalCheckpointOptions options;
  options.local = Local(0);
  options.store = Store();
  options.base = StepDir(0);
  options.pool = &pool_;
  Result<std::unique_ptr<CheckpointPuller>> opened = OpenLocalCheckpointPuller(options);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  CheckpointPuller& puller = **opened;
  ASSERT_EQ(::mkdir(Store().c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((Store() + "/weight_v000001").c_str(), 0755), 0);
  auto latest = [&] {
    Result<int64_t> v = puller.LatestVersion();
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    return v.ok() ? *v : -1;
  };
  auto set_mtime = [&](timespec t) {
    const timespec times[2] = {t, t};
    ASSERT_EQ(::utimensat(AT_FDCWD, Store().c_str(), times, 0), 0);
  };
  struct stat st {};
  ASSERT_EQ(::stat(Store().c_str(), &st), 0);
  EXPECT_EQ(latest(), 1);
  // A version added within the same timestamp tick (mtime unchanged) is seen:
  // the first listing was too close to the change to be trusted.
  ASSERT_EQ(::mkdir((Store() + "/weight_v000002").c_str(), 0755), 0);
  set_mtime(st.st_mtim);
  EXPECT_EQ(latest(), 2);
  // An old mtime settles the listing: it is reused while the directory is
  // unchanged (shown here by a removal with the mtime put back) ...
  timespec old_time{};
  ::clock_gettime(CLOCK_REALTIME, &old_time);
  old_time.tv_sec -= 10;
  set_mtime(old_time);
  EXPECT_EQ(latest(), 2);
  ASSERT_EQ(::rmdir((Store() + "/weight_v000002").c_str()), 0);
  set_mtime(old_time);
  EXPECT_EQ(latest(), 2);
  // ... and dropped as soon as the directory changes.
  ASSERT_EQ(::mkdir((Store() + "/weight_v000003").c_str(), 0755), 0);
  EXPECT_EQ(latest(), 3);
}

TEST_F(AgentStoreTest, SyncBringsEveryHostToTheNewWeightsBitExactly) {
  std::unique_ptr<Publisher> publisher = MakePublisher();
  ASSERT_NE(publisher, nullptr);
  Result<PublishResult> v1 = publisher->PublishCheckpoint(StepDir(1));
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  ASSERT_EQ(v1->info.version, 1);

  StartAgent(0);
  StartAgent(1);
  Result<std::unique_ptr<SyncCoordinator>> coordinator =
      SyncCoordinator::Create(Sync(), std::move(publisher));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();

  // Version 2 is published by the coordinator and pulled by both hosts,
  // which had nothing: each materializes the base and applies 1 and 2.
  Result<SyncReport> report = (*coordinator)->SyncCheckpoint(StepDir(2));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->status.ok()) << report->status.ToString();
  EXPECT_EQ(report->version, 2);
  ASSERT_EQ(report->engines.size(), 2u);
  const auto expected = TensorBytes(StepDir(2));
  ASSERT_FALSE(expected.empty());
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(report->engines[i].ok) << report->engines[i].error;
    EXPECT_EQ(report->engines[i].version, 2);
    EXPECT_TRUE(report->engines[i].applied);
    EXPECT_GT(report->engines[i].bytes_read, 0u);
    EXPECT_EQ(TensorBytes(Local(i)), expected) << Local(i);
    EXPECT_TRUE(HoldsModel(Local(i), models_[2]));
  }
  const json summary = json::parse(SyncReportToJson(*report), nullptr, false);
  EXPECT_EQ(summary["ok"], true);
  EXPECT_EQ(summary["engines"].size(), 2u);

  // The next sync is one delta on top of what the hosts hold.
  report = (*coordinator)->SyncCheckpoint(StepDir(3));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->status.ok()) << report->status.ToString();
  EXPECT_EQ(report->version, 3);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(HoldsModel(Local(i), models_[3])) << Local(i);

  // Version 0 brings the base back; "latest" returns to version 3.
  std::vector<EnginePullOutcome> out = (*coordinator)->PullAll(0);
  EXPECT_TRUE(SummarizeEngineOutcomes(out).ok()) << SummarizeEngineOutcomes(out).ToString();
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(HoldsModel(Local(i), models_[0])) << Local(i);
  out = (*coordinator)->PullAll(std::nullopt);
  EXPECT_TRUE(SummarizeEngineOutcomes(out).ok()) << SummarizeEngineOutcomes(out).ToString();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(out[i].version, 3);
    EXPECT_TRUE(HoldsModel(Local(i), models_[3])) << Local(i);
  }

  // A version past the store's latest is refused without touching anything.
  out = (*coordinator)->PullAll(9);
  for (const EnginePullOutcome& o : out) {
    EXPECT_FALSE(o.ok);
    EXPECT_EQ(o.http_status, 404);
  }
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(HoldsModel(Local(i), models_[3])) << Local(i);

  // /status and /metrics of a real agent.
  httplib::Client client(urls_[0]);
  client.set_bearer_token_auth("integration-token");
  httplib::Result status = client.Get("/status");
  ASSERT_TRUE(status);
  const json body = json::parse(status->body, nullptr, false);
  EXPECT_EQ(body["applied_version"], 3);
  EXPECT_EQ(body["store_latest"], 3);
  EXPECT_EQ(body["state"], "idle");
}

TEST_F(AgentStoreTest, ACorruptVersionFailsTheSyncNamingTheEngines) {
  std::unique_ptr<Publisher> publisher = MakePublisher(Encoding::kXor);
  ASSERT_NE(publisher, nullptr);
  StartAgent(0);
  Result<std::unique_ptr<SyncCoordinator>> coordinator =
      SyncCoordinator::Create(Sync(), std::move(publisher));
  ASSERT_TRUE(coordinator.ok());
  Result<SyncReport> report = (*coordinator)->SyncCheckpoint(StepDir(1));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_TRUE(report->status.ok()) << report->status.ToString();

  // Flip a byte inside every shard of version 2's data after publishing it
  // through a second, identical publisher path: publish, then damage.
  Result<PublishResult> v2 = (*coordinator)->publisher().PublishCheckpoint(StepDir(2));
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  bool damaged = false;
  for (const std::string& name : store_test::ListDir(v2->info.dir)) {
    if (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors") {
      const std::string path = v2->info.dir + "/" + name;
      std::string bytes = store_test::ReadFile(path);
      ASSERT_GT(bytes.size(), 64u);
      bytes[bytes.size() - 5] ^= 0x40;  // inside the last tensor's data
      store_test::WriteFile(path, bytes);
      damaged = true;
    }
  }
  ASSERT_TRUE(damaged);
  std::vector<EnginePullOutcome> out = (*coordinator)->PullAll(2);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_FALSE(out[0].ok);
  EXPECT_EQ(out[0].http_status, 500);
  EXPECT_EQ(out[0].error_code, "pull_failed");
  const Status summary = SummarizeEngineOutcomes(out);
  EXPECT_NE(summary.message().find(urls_[0]), std::string::npos) << summary.message();
  // The host stays at the last version it committed.
  EXPECT_TRUE(HoldsModel(Local(0), models_[1]));
}

TEST_F(AgentStoreTest, ReloadCommandSeesTheLocalCheckpoint) {
  std::unique_ptr<Publisher> publisher = MakePublisher();
  ASSERT_NE(publisher, nullptr);
  const std::string marker = tmp_.Join("reloaded");
  Result<std::unique_ptr<EngineReloader>> reloader =
      MakeCommandReloader("sh -c 'printf \"%s %s\" \"$0\" \"$1\" > " + marker + "'");
  ASSERT_TRUE(reloader.ok());
  StartAgent(0, std::move(reloader).value());
  Result<std::unique_ptr<SyncCoordinator>> coordinator =
      SyncCoordinator::Create(Sync(), std::move(publisher));
  ASSERT_TRUE(coordinator.ok());
  Result<SyncReport> report = (*coordinator)->SyncCheckpoint(StepDir(1));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->status.ok()) << report->status.ToString();
  EXPECT_EQ(store_test::ReadFile(marker), Local(0) + " 1");
}

}  // namespace
}  // namespace deltasync
