// Runs the real `deltasync demo --online` and `deltasync bench --stream` on
// tiny models: processes on loopback, checked through their JSON.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"

namespace deltasync {
namespace {

using nlohmann::json;
using testing_cli::RunCli;

TEST(OnlineDemoTest, EveryReceiverMatchesTheShardedTrainerAfterEveryStep) {
  const auto r =
      RunCli("demo --online --preset tiny --bytes 2MiB --steps 3 --ranks 2 --receivers 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["mode"], "online");
  EXPECT_TRUE(j["all_exact"].get<bool>());
  ASSERT_EQ(j["steps"].size(), 3u);
  EXPECT_EQ(j["steps"][0]["seeded"], 2);
  for (const json& s : j["steps"]) EXPECT_EQ(s["receivers_exact"], 2);
  EXPECT_GT(j["steps"][2]["bytes_sent"].get<uint64_t>(), 0u);
  EXPECT_LT(j["steps"][2]["bytes_sent"].get<uint64_t>(),
            j["steps"][0]["bytes_sent"].get<uint64_t>());
}

TEST(OnlineDemoTest, BadArgumentsFailWithOneLine) {
  for (const char* args :
       {"demo --ranks 2", "demo --online --encoding xor --preset tiny",
        "demo --online --workdir /etc --preset tiny", "demo --online --bench-agent"}) {
    const auto r = RunCli(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(testing_cli::CountLines(r.err), 1) << args << ": " << r.err;
  }
}

TEST(StreamBenchTest, ReportsEachEncodingAgainstTheFullBroadcastAndItsBound) {
  const auto r = RunCli(
      "bench --stream --preset tiny --bytes 2MiB --receivers 1 --links none --trainer-ranks 2 "
      "--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["mode"], "stream");
  // What a dense frame costs beyond the wire, measured in the run.
  EXPECT_GT(j["frame_hash_s"].get<double>(), 0);
  EXPECT_GT(j["frame_copy_s"].get<double>(), 0);
  const json& loop = j["links"]["loopback"];
  EXPECT_GT(loop["bytes_per_s"].get<double>(), 0);
  std::vector<std::string> what;
  for (const json& run : loop["runs"]) {
    what.push_back(run["what"]);
    EXPECT_GT(run["seconds"].get<double>(), 0);
    if (run["what"] != "full" && run["what"] != "tree") {
      EXPECT_GT(run["bound_s"].get<double>(), 0);
      EXPECT_GT(run["bytes_sent"].get<uint64_t>(), 0u);
      EXPECT_GT(run["sender_buffer_bytes"].get<uint64_t>(), 0u);
    }
  }
  // The full send down the chain, by the binomial tree, each encoding, then
  // the sharded trainer of 2 ranks.
  EXPECT_EQ(what,
            (std::vector<std::string>{"full", "tree", "dense", "indices", "sparse", "indices/2r"}));
  EXPECT_EQ(loop["runs"].back()["trainer_ranks"], 2);
}

TEST(StreamBenchTest, BadArgumentsFailWithOneLine) {
  for (const char* args : {"bench --stream --receivers 2,1", "bench --stream --links fast",
                           "bench --receivers 2", "bench --stream --e2e",
                           "bench --stream --bucket 1KiB --preset tiny --bytes 1MiB "
                           "--receivers 1 --links none"}) {
    const auto r = RunCli(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(testing_cli::CountLines(r.err), 1) << args << ": " << r.err;
  }
}

}  // namespace
}  // namespace deltasync
