// The stream's adversarial campaign, kept: randomized trials of every fault
// class a user or an attacker can bring, each ending in a check that every
// receiver is bit-exact once the stream has repaired itself, or that
// nothing of the fault was taken.
//
// Each class runs DELTASYNC_CAMPAIGN_TRIALS trials (default 2: the short
// form CI runs); scripts/stream-campaign runs the long form. A trial's
// randomness comes from DELTASYNC_CAMPAIGN_SEED (default: the clock), which
// every failure names so that it can be replayed.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/stream.h"
#include "stream/sync_rig.h"

namespace deltasync {
namespace {

using namespace sync_rig;

int Trials() {
  const char* env = std::getenv("DELTASYNC_CAMPAIGN_TRIALS");
  const int n = env != nullptr ? std::atoi(env) : 2;
  return n > 0 ? n : 2;
}

uint64_t BaseSeed() {
  static const uint64_t seed = []() -> uint64_t {
    const char* env = std::getenv("DELTASYNC_CAMPAIGN_SEED");
    if (env != nullptr) return std::strtoull(env, nullptr, 10);
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return seed;
}

class Campaign : public SyncTest {
 protected:
  // A fresh group for each trial: its own directory.
  void NewTrial(const std::string& what, int trial) {
    NewDir();
    connect_timeout_ = 3s;
    rng_.seed(BaseSeed() * 1000003 + std::hash<std::string>()(what) + trial);
    if (trial + 1 == Trials()) {
      // The long run's counts, as its log shows them.
      std::printf("campaign: %s: %d trials (seed %llu)\n", what.c_str(), Trials(),
                  static_cast<unsigned long long>(BaseSeed()));
    }
  }
  uint64_t Draw(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  std::string Trace(const std::string& what, int trial) const {
    return what + " trial " + std::to_string(trial) +
           " (DELTASYNC_CAMPAIGN_SEED=" + std::to_string(BaseSeed()) + ")";
  }
  std::mt19937_64 rng_;
};

// The sender's model after `steps` of the peer's steps.
Model PeerModel(int steps) {
  Model m = Model::Make(0);
  for (int k = 1; k <= steps; ++k) m.Step(1000 + k, 0.05);
  return m;
}

std::vector<std::string> SendArgs(const std::string& dir, int size, int steps) {
  return {DS_SYNC_PEER_PATH,     "send",
          "file:" + dir,         std::to_string(size),
          std::to_string(steps), std::to_string(kTimeout.count())};
}

// kill -9 of the sender at a random instant (forming, handshaking, mid-sync,
// between syncs); a new sender process syncs to the end, and every receiver
// holds its model exactly.
TEST_F(Campaign, ASenderKilledAtARandomInstant) {
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("kill the sender", trial);
    SCOPED_TRACE(Trace("kill the sender", trial));
    SetUpGroup(2);
    const int steps = 6;
    const Model final_model = PeerModel(steps);
    ReceiverRig a(final_model, Hold::kWhole, Factory(1));
    ReceiverRig b(final_model, Hold::kColumns, Factory(2));
    a.Start();
    b.Start();
    comm_test::Children sender;
    ASSERT_EQ(sender.Spawn(SendArgs(Dir(), 3, steps)), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(Draw(0, 400)));
    sender.Kill(0);
    EXPECT_TRUE(sender.Wait(0, 10s).has_value());
    ASSERT_TRUE(sender.Respawn(0, SendArgs(Dir(), 3, steps)));
    EXPECT_EQ(sender.Wait(0, 60s), 0) << "the restarted sender did not sync every step";
    EXPECT_TRUE(a.Matches(final_model).ok()) << a.Matches(final_model).ToString();
    EXPECT_TRUE(b.Matches(final_model).ok()) << b.Matches(final_model).ToString();
    a.RequestStop();
    b.RequestStop();
    for (ReceiverRig* r : {&a, &b}) {
      // The sender is gone: their calls fail, and the rejoin waits are cut.
      r->Cancel();
      r->Stop();
    }
  }
}

std::vector<std::string> ShardArgs(const std::string& dir, int rank, int start, int steps) {
  return {DS_SYNC_PEER_PATH,
          "shard",
          "file:" + dir + "/trainers",
          std::to_string(rank),
          std::to_string(start),
          std::to_string(steps),
          std::to_string(kTimeout.count())};
}

// The sharded trainer's model after step k, as the peer makes it.
Model ShardedStep(int k) {
  Model m = ShardedModel(9);
  for (int i = 1; i <= k; ++i) m.Step(3000 + i, 0.05);
  return m;
}

// kill -9 of a sharded trainer rank (rank 2 of 4, a process) at a random
// instant. Every rank syncs once after each step whatever became of the
// last sync (as a trainer does), then three more times with the last step's
// model; the killed rank is restarted at the step the others are at. Every
// receiver ends holding the last step exactly.
TEST_F(Campaign, AShardedTrainerRankKilledAtARandomInstant) {
  constexpr int kRepairSyncs = 3;  // as stream_sync_test_peer's
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("kill a sharded trainer rank", trial);
    SCOPED_TRACE(Trace("kill a sharded trainer rank", trial));
    SetUpGroup(2);
    const int steps = 8;
    const Model final_model = ShardedStep(steps);
    std::vector<ModelTensor> model;
    for (const SyncTensor& t : final_model.tensors) model.push_back({t.name, t.dtype, t.shape});
    ReceiverRig a(final_model, Hold::kWhole, Factory(1));
    ReceiverRig b(final_model, Hold::kColumns, Factory(2));
    a.Start();
    b.Start();
    comm_test::Children victim;
    ASSERT_EQ(victim.Spawn(ShardArgs(Dir(), 2, 0, steps)), 0);
    std::atomic<int> at_step{0};  // the step rank 0 syncs
    std::vector<Status> last(4);
    // What each rank's syncs returned, and when: shown if a receiver ends
    // up wrong.
    std::vector<std::string> history(4);
    const auto began = std::chrono::steady_clock::now();
    std::vector<std::thread> ranks;
    for (int r : {0, 1, 3}) {
      ranks.emplace_back([&, r] {
        CommunicatorOptions o = comm_test::LoopbackOptions(
            comm_test::FileRendezvous(Dir() + "/trainers"), r, 4, kTimeout, "trainers");
        o.connect_timeout = 10s;
        Result<std::unique_ptr<StreamSender>> s = StreamSender::CreateSharded(
            [o] { return CreateCommunicator("gloo", o); }, r == 0 ? Factory(0) : nullptr);
        if (!s.ok()) {
          last[r] = s.status();
          return;
        }
        const std::vector<ShardSpec> specs = RankSpecs(r);
        for (int k = 0; k <= steps + kRepairSyncs; ++k) {
          if (r == 0) at_step = k;
          const Model m = ShardedStep(std::min(k, steps));
          std::vector<std::vector<uint8_t>> bytes;
          std::vector<ShardedTensor> shards;
          for (const ShardSpec& spec : specs) bytes.push_back(Extract(spec, m));
          for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[i], {}});
          Result<SyncStats> got = (*s)->SyncShards(model, shards);
          last[r] = got.ok() ? Status::OK() : got.status();
          history[r] += "  rank " + std::to_string(r) + " step " + std::to_string(k) + " at " +
                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                           std::chrono::steady_clock::now() - began)
                                           .count()) +
                        " ms: " + last[r].ToString() + "\n";
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(Draw(0, 500)));
    victim.Kill(0);
    const std::optional<int> code = victim.Wait(0, 10s);
    if (code != 0) {
      // Restarted from a checkpoint of the step the trainer is at.
      history[2] = "  rank 2 restarted at step " + std::to_string(at_step.load()) + " at " +
                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                      std::chrono::steady_clock::now() - began)
                                      .count()) +
                   " ms\n";
      ASSERT_TRUE(victim.Respawn(0, ShardArgs(Dir(), 2, at_step.load(), steps)));
      EXPECT_EQ(victim.Wait(0, 120s), 0);
    }
    for (std::thread& t : ranks) t.join();
    // The last syncs, of the last step's model, left every receiver exact.
    const std::string syncs = history[2] + history[0] + history[1] + history[3];
    EXPECT_TRUE(a.Matches(final_model).ok()) << a.Matches(final_model).ToString() << "\n" << syncs;
    EXPECT_TRUE(b.Matches(final_model).ok()) << b.Matches(final_model).ToString();
    for (ReceiverRig* r : {&a, &b}) {
      r->RequestStop();
      r->Cancel();
      r->Stop();
    }
  }
}

std::vector<std::string> ReceiveArgs(const std::string& dir, const std::string& file) {
  return {DS_SYNC_PEER_PATH,
          "receive",
          "file:" + dir,
          "2",
          "3",
          file,
          "0",
          std::to_string(kTimeout.count())};
}

// kill -9 of a receiver at a random instant; restarted, it is reseeded and
// every receiver is exact at the next sync that commits.
TEST_F(Campaign, AReceiverKilledAtARandomInstant) {
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("kill a receiver", trial);
    SCOPED_TRACE(Trace("kill a receiver", trial));
    SetUpGroup(2);
    Model m = Model::Make(0);
    const std::string file = Dir() + "/peer.bin";
    comm_test::Children peer;
    ASSERT_EQ(peer.Spawn(ReceiveArgs(Dir(), file)), 0);
    std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
    ReceiverRig local(m, Hold::kRows, Factory(1));
    local.Start();
    std::thread killer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(Draw(0, 600)));
      peer.Kill(0);
    });
    for (int step = 0; step < 8; ++step) {
      m.Step(2000 + step, 0.05);
      (void)sender->Sync(m.tensors);
    }
    killer.join();
    EXPECT_TRUE(peer.Wait(0, 10s).has_value());
    ASSERT_TRUE(peer.Respawn(0, ReceiveArgs(Dir(), file)));
    Status last;
    for (int attempt = 0; attempt < 4; ++attempt) {
      m.Step(3000 + attempt, 0.05);
      Result<SyncStats> s = sender->Sync(m.tensors);
      last = s.ok() ? Status::OK() : s.status();
      if (s.ok()) break;
    }
    EXPECT_TRUE(last.ok()) << last.ToString();
    EXPECT_TRUE(local.Matches(m).ok()) << local.Matches(m).ToString();
    EXPECT_TRUE(sync_test::PeerHolds(file, m, 5000ms));
    Finish(sender, {&local});
  }
}

// A byte of a frame flipped, or a frame cut short, at a random place of a
// random sync: refused with no weight of that frame written, and the next
// sync brings the receiver back.
TEST_F(Campaign, AFrameDamagedAtARandomPlace) {
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("damage a frame", trial);
    SCOPED_TRACE(Trace("damage a frame", trial));
    SetUpGroup(1);
    Model m = Model::Make(trial);
    const uint64_t bad_sync = Draw(2, 4);
    const bool truncate = Draw(0, 3) == 0;
    FaultPlan p;
    p.op = CommOp::kRecv;
    p.kind = truncate ? FaultKind::kTruncate : FaultKind::kCorruptByte;
    p.byte_offset = Draw(0, 1 << 20);
    p.mask = static_cast<uint8_t>(1u << Draw(0, 7));
    p.match = [bad_sync](std::span<const uint8_t> b) {
      // A frame body of sync `bad_sync`: "DSFL", then the sync id at byte 8.
      if (b.size() < 16 || std::memcmp(b.data(), "DSFL", 4) != 0) return false;
      uint64_t id = 0;
      std::memcpy(&id, b.data() + 8, 8);
      return id == bad_sync;
    };
    if (truncate) {
      // A short message is a size mismatch on the wire, not a frame: aim it
      // by count instead.
      p.match = nullptr;
      p.call_index = Draw(4, 12);
      p.byte_offset = 3;
    }
    std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
    ReceiverRig rig(m, Hold::kWhole, Factory(1, {p}));
    rig.Start();
    bool ok_after = false;
    for (int step = 0; step < 7; ++step) {
      if (step > 0) m.Step(4000 + step, 0.03);
      Result<SyncStats> s = sender->Sync(m.tensors);
      if (s.ok()) {
        EXPECT_TRUE(rig.Matches(m).ok()) << "step " << step << ": " << rig.Matches(m).ToString();
        ok_after = step >= 5;
      }
    }
    EXPECT_TRUE(ok_after);
    Finish(sender, {&rig});
  }
}

// A byte of a hello flipped: refused and said so; the next formation syncs.
TEST_F(Campaign, AHelloDamagedAtARandomPlace) {
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("damage a hello", trial);
    SCOPED_TRACE(Trace("damage a hello", trial));
    SetUpGroup(1);
    Model m = Model::Make(trial);
    FaultPlan p;
    p.op = CommOp::kSend;
    p.kind = FaultKind::kCorruptByte;
    p.byte_offset = Draw(0, 4096);
    p.mask = static_cast<uint8_t>(1u << Draw(0, 7));
    p.match = [](std::span<const uint8_t> b) {
      const std::string text(b.begin(), b.end());
      return text.find("\"protocol\"") != std::string::npos;
    };
    std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
    ReceiverRig rig(m, Hold::kWhole, Factory(1, {p}));
    rig.Start();
    Result<SyncStats> first = sender->Sync(m.tensors);
    EXPECT_FALSE(first.ok());
    Status last;
    for (int attempt = 0; attempt < 3; ++attempt) {
      Result<SyncStats> s = sender->Sync(m.tensors);
      last = s.ok() ? Status::OK() : s.status();
      if (s.ok()) break;
    }
    EXPECT_TRUE(last.ok()) << last.ToString();
    EXPECT_TRUE(rig.Matches(m).ok());
    Finish(sender, {&rig});
  }
}

// In the authenticated mode, any one message of the receiver's changed at
// a random byte, below the authenticating layer: the group never takes it
// (every sync that succeeds leaves the receiver exact) and recovers.
TEST_F(Campaign, AnAuthenticatedMessageForgedAtARandomPlace) {
  const AuthKey key = *DeriveAuthKey("the campaign's shared secret");
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("forge an authenticated message", trial);
    SCOPED_TRACE(Trace("forge an authenticated message", trial));
    SetUpGroup(1);
    Model m = Model::Make(trial);
    FaultPlan p;
    p.op = CommOp::kAny;
    p.call_index = Draw(0, 40);
    p.kind = FaultKind::kCorruptByte;
    p.byte_offset = Draw(0, 1 << 16);
    p.mask = static_cast<uint8_t>(1u << Draw(0, 7));
    const auto factory = [&](int rank, std::vector<FaultPlan> plans) -> CommunicatorFactory {
      const CommunicatorOptions o = comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()),
                                                               rank, size_, kTimeout, "forge");
      auto shared = std::make_shared<std::vector<FaultPlan>>(std::move(plans));
      return [o, shared, key]() -> Result<std::unique_ptr<Communicator>> {
        DS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, CreateCommunicator("gloo", o));
        if (!shared->empty()) {
          c.reset(new FaultCommunicator(std::move(c), std::move(*shared)));
          shared->clear();
        }
        return AuthenticateCommunicator(std::move(c), key, "forge");
      };
    };
    std::unique_ptr<StreamSender> sender = MakeSender(factory(0, {}));
    ReceiverRig rig(m, Hold::kWhole, factory(1, {p}));
    rig.Start();
    bool ok_after = false;
    for (int step = 0; step < 6; ++step) {
      if (step > 0) m.Step(5000 + step, 0.03);
      Result<SyncStats> s = sender->Sync(m.tensors);
      if (s.ok()) {
        EXPECT_TRUE(rig.Matches(m).ok()) << "step " << step;
        ok_after = step >= 4;
      }
    }
    EXPECT_TRUE(ok_after);
    Finish(sender, {&rig});
  }
}

// A rogue rank 0 without the key on the same rendezvous, after a receiver
// restarted: the receiver never takes its model.
TEST_F(Campaign, ARogueSenderWithoutTheKey) {
  const AuthKey key = *DeriveAuthKey("the campaign's shared secret");
  for (int trial = 0; trial < Trials(); ++trial) {
    NewTrial("a rogue rank 0", trial);
    SCOPED_TRACE(Trace("a rogue rank 0", trial));
    SetUpGroup(1);
    Model m = Model::Make(trial);
    const bool keyless = Draw(0, 1) == 0;  // no key at all, or another key
    const auto factory = [&](int rank, std::optional<AuthKey> k) -> CommunicatorFactory {
      CommunicatorOptions o = comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), rank,
                                                         size_, 1500ms, "rogue");
      o.connect_timeout = 3s;
      o.auth_key = k;
      return [o] { return CreateCommunicator("gloo", o); };
    };
    std::unique_ptr<StreamSender> rogue = MakeSender(factory(
        0, keyless ? std::nullopt : std::optional<AuthKey>(*DeriveAuthKey("not it!!!!!!!!!!"))));
    ReceiverRig rig(m, Hold::kWhole, factory(1, key));
    rig.Start();
    Model theirs = Model::Make(100 + trial);
    for (int attempt = 0; attempt < 3; ++attempt) (void)rogue->Sync(theirs.tensors);
    for (const std::vector<uint8_t>& b : rig.buffers()) {
      EXPECT_EQ(b, std::vector<uint8_t>(b.size(), 0)) << "the receiver took the rogue's bytes";
    }
    rig.RequestStop();
    rig.Cancel();
    rogue.reset();
    rig.Stop();
  }
}

}  // namespace
}  // namespace deltasync
