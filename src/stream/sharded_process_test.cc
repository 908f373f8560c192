// A sharded trainer whose every rank and every receiver is a process of its
// own (stream_sync_test_peer's "ranks" and "shard-receive"), over gloo: 2
// and 4 trainer ranks, every placement of sync_test::RankSpecs, 3
// receivers, one of which kills itself (kill -9) in the middle of applying
// a sync and is started again. Each receiver checks after every sync it
// applied that it holds one step's model bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator_test_util.h"
#include "stream/sync_rig.h"

namespace deltasync {
namespace {

using namespace sync_rig;

class ShardedProcesses : public SyncTest, public ::testing::WithParamInterface<int> {};

// The (sync id, step held) lines a receiver wrote.
std::vector<std::pair<uint64_t, int>> Held(const std::string& file) {
  std::vector<std::pair<uint64_t, int>> out;
  std::ifstream in(file);
  uint64_t id = 0;
  int step = 0;
  while (in >> id >> step) out.push_back({id, step});
  return out;
}

TEST_P(ShardedProcesses, StayBitExactAfterEverySyncAndAKilledReceiverIsReseeded) {
  const int ranks = GetParam();
  constexpr int kSteps = 5;
  constexpr int kReceivers = 3;
  constexpr int kDieAt = 3;  // receiver 3 kills itself applying sync 3
  std::filesystem::create_directories(Dir() + "/trainers");
  std::filesystem::create_directories(Dir() + "/stream");
  const std::string trainers = "file:" + Dir() + "/trainers";
  const std::string stream = "file:" + Dir() + "/stream";
  const std::string timeout = std::to_string(std::chrono::milliseconds(kTimeout).count());
  const auto receive = [&](int r, int die_at) {
    return std::vector<std::string>{DS_SYNC_PEER_PATH,
                                    "shard-receive",
                                    stream,
                                    std::to_string(r),
                                    std::to_string(kReceivers + 1),
                                    Dir() + "/held-" + std::to_string(r),
                                    std::to_string(die_at),
                                    timeout,
                                    std::to_string(kSteps)};
  };
  comm_test::Children receivers;
  for (int r = 1; r <= kReceivers; ++r) {
    ASSERT_EQ(receivers.Spawn(receive(r, r == kReceivers ? kDieAt : 0)), r - 1);
  }
  comm_test::Children ranks_;
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(ranks_.Spawn({DS_SYNC_PEER_PATH, "ranks", trainers, stream, std::to_string(r),
                            std::to_string(ranks), std::to_string(kReceivers + 1),
                            std::to_string(kSteps), timeout}),
              r);
  }
  // The receiver that killed itself comes back, to be seeded again.
  EXPECT_TRUE(receivers.Wait(kReceivers - 1, 120s).has_value()) << "receiver 3 did not die";
  ASSERT_TRUE(receivers.Respawn(kReceivers - 1, receive(kReceivers, 0)));
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(ranks_.Wait(r, 180s), 0) << "trainer rank " << r << " did not sync every step";
  }
  // Every receiver reports the last sync once it returns from it.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  for (int r = 1; r <= kReceivers; ++r) {
    const std::string file = Dir() + "/held-" + std::to_string(r);
    while (std::chrono::steady_clock::now() < deadline) {
      const std::vector<std::pair<uint64_t, int>> h = Held(file);
      if (!h.empty() && h.back().second == kSteps) break;
      std::this_thread::sleep_for(20ms);
    }
  }
  for (int r = 1; r <= kReceivers; ++r) receivers.Kill(r - 1);
  for (int r = 1; r <= kReceivers; ++r) {
    const std::vector<std::pair<uint64_t, int>> h = Held(Dir() + "/held-" + std::to_string(r));
    std::ostringstream all;
    for (const auto& [id, step] : h) all << " sync " << id << ": step " << step << ";";
    ASSERT_FALSE(h.empty()) << "receiver " << r << " applied no sync";
    int last = -1;
    for (const auto& [id, step] : h) {
      EXPECT_GE(step, 0) << "receiver " << r << " after sync " << id
                         << " held no step's model:" << all.str();
      EXPECT_GE(step, last) << "receiver " << r << " went back:" << all.str();
      last = step;
    }
    EXPECT_EQ(h.back().second, kSteps) << "receiver " << r << ":" << all.str();
    if (r == kReceivers) {
      // Killed while applying sync 3, it never reported it.
      for (const auto& [id, step] : h) EXPECT_NE(id, static_cast<uint64_t>(kDieAt)) << all.str();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TrainerRanks, ShardedProcesses, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return std::to_string(p.param) + "Ranks";
                         });

}  // namespace
}  // namespace deltasync
