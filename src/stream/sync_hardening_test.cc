// The stream as a user and an attacker meet it: calls from several
// threads, training steps longer than the timeout, damaged or forged
// messages, registrations the sender cannot serve, destinations that move,
// trainer ranks that leave elements uncovered, and the authenticated mode.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "deltasync/communicator.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "stream/sync_messages.h"
#include "stream/sync_rig.h"

namespace deltasync {
namespace {

using namespace sync_rig;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A receiver of `m` (every tensor whole) without a thread of its own.
struct Bare {
  std::unique_ptr<StreamReceiver> receiver;
  std::vector<std::vector<uint8_t>> buffers;

  Bare(const Model& m, CommunicatorFactory f, ReceiverOptions o = {},
       const std::set<std::string>& skip = {}) {
    Result<std::unique_ptr<StreamReceiver>> r = StreamReceiver::Create(std::move(f), std::move(o));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    receiver = std::move(*r);
    buffers.reserve(m.tensors.size());
    for (const SyncTensor& t : m.tensors) {
      buffers.emplace_back(t.data.size(), 0);
      if (skip.count(t.name)) continue;
      Status s = receiver->Register(t.name, t.dtype, t.shape, buffers.back());
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  bool Holds(const Model& m, const std::set<std::string>& skip = {}) const {
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      if (skip.count(m.tensors[i].name)) continue;
      if (buffers[i] != m.bytes[i]) return false;
    }
    return true;
  }
};

// Runs `fn` on a thread; Get() joins it and returns its result.
template <typename T>
class Async {
 public:
  explicit Async(std::function<T()> fn) : thread_([this, fn] { result_ = fn(); }) {}
  ~Async() {
    if (thread_.joinable()) thread_.join();
  }
  T Get() {
    if (thread_.joinable()) thread_.join();
    return std::move(*result_);
  }

 private:
  std::optional<T> result_;
  std::thread thread_;
};

Status StatusOf(const Result<ReceiveStats>& r) { return r.ok() ? Status::OK() : r.status(); }
Status StatusOf(const Result<SyncStats>& r) { return r.ok() ? Status::OK() : r.status(); }

// ---------------------------------------------------------------------------
// Threads.

TEST_F(SyncTest, ASecondThreadIsRefusedAndCancelEndsAReceiveInFlight) {
  SetUpGroup(1);
  Model m = Model::Make(41);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  Bare rx(m, Factory(1));
  {
    Async<Result<ReceiveStats>> first([&] { return rx.receiver->ReceiveSync(); });
    ASSERT_TRUE(sender->Sync(m.tensors).ok());
    ASSERT_TRUE(first.Get().ok());
  }
  // The receiver now waits for a sync that does not come.
  Async<Result<ReceiveStats>> waiting([&] { return rx.receiver->ReceiveSync(); });
  const auto until = Clock::now() + 5s;
  while (!rx.receiver->health().waiting && Clock::now() < until) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(rx.receiver->health().in_call);
  Result<ReceiveStats> second = rx.receiver->ReceiveSync();
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(second.status(), "already running in another thread"))
      << second.status().ToString();
  const auto t0 = Clock::now();
  rx.receiver->Cancel("shutting down");
  Result<ReceiveStats> ended = waiting.Get();
  EXPECT_LT(Since(t0), 2.0);
  EXPECT_EQ(ended.status().code(), StatusCode::kAborted) << ended.status().ToString();
  EXPECT_TRUE(Contains(ended.status(), "shutting down")) << ended.status().ToString();
  // Closed for good.
  EXPECT_EQ(rx.receiver->ReceiveSync().status().code(), StatusCode::kAborted);
  EXPECT_FALSE(rx.receiver->health().link.ok());
}

TEST_F(SyncTest, CancelEndsAFormationInFlight) {
  SetUpGroup(1);
  Model m = Model::Make(40);
  Bare rx(m, Factory(1));  // no sender ever comes: the formation waits
  Async<Result<ReceiveStats>> forming([&] { return rx.receiver->ReceiveSync(); });
  std::this_thread::sleep_for(300ms);
  const auto t0 = Clock::now();
  rx.receiver->Cancel("shutting down");
  Result<ReceiveStats> r = forming.Get();
  EXPECT_LT(Since(t0), 1.0);
  EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
  EXPECT_TRUE(Contains(r.status(), "the formation was cancelled")) << r.status().ToString();
}

TEST_F(SyncTest, CancelEndsASyncInFlightAndASecondThreadIsRefused) {
  SetUpGroup(1);
  Model m = Model::Make(42);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  std::atomic<bool> slow{false};
  ReceiverOptions o;
  o.apply_hook = [&](uint64_t, std::string_view, uint64_t) {
    for (int i = 0; i < 300 && slow; ++i) std::this_thread::sleep_for(10ms);
    return Status::OK();
  };
  ReceiverRig rig(m, Hold::kWhole, Factory(1), o);
  rig.Start();
  ASSERT_TRUE(sender->Sync(m.tensors).ok());
  slow = true;
  m.Step(1, 0.05);
  Async<Result<SyncStats>> syncing([&] { return sender->Sync(m.tensors); });
  std::this_thread::sleep_for(300ms);
  Result<SyncStats> second = sender->Sync(m.tensors);
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(second.status(), "already running in another thread"));
  const auto t0 = Clock::now();
  sender->Cancel("the trainer stops");
  Result<SyncStats> ended = syncing.Get();
  EXPECT_LT(Since(t0), 2.0);
  EXPECT_FALSE(ended.ok());
  EXPECT_TRUE(Contains(ended.status(), "the trainer stops")) << ended.status().ToString();
  EXPECT_EQ(sender->Sync(m.tensors).status().code(), StatusCode::kAborted);
  slow = false;
  Finish(sender, {&rig});
}

// ---------------------------------------------------------------------------
// Waiting for the next sync.

TEST_F(SyncTest, TrainingStepsLongerThanTheTimeoutKeepTheDelta) {
  SetUpGroup(1);
  Model m = Model::Make(43);
  const auto factory = [&](int rank) -> CommunicatorFactory {
    const CommunicatorOptions o =
        comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), rank, size_, 700ms, "long");
    return [o] { return CreateCommunicator("gloo", o); };
  };
  std::unique_ptr<StreamSender> sender = MakeSender(factory(0));
  ReceiverRig rig(m, Hold::kWhole, factory(1));
  rig.Start();
  for (int step = 0; step < 3; ++step) {
    if (step > 0) {
      std::this_thread::sleep_for(1800ms);  // a step: over twice the timeout
      m.Step(43 + step, 0.02);
    }
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 1u : 0u) << "step " << step;
    EXPECT_TRUE(rig.Matches(m).ok());
  }
  Finish(sender, {&rig});
  for (const Status& r : rig.results()) {
    if (!r.ok()) {
      EXPECT_TRUE(Contains(r, "taking the sync's route")) << r.ToString();
    }
  }
  const std::vector<ReceiveStats> stats = rig.stats();
  ASSERT_EQ(stats.size(), 3u);
  EXPECT_GT(stats[2].wait_s, 1.0);  // it waited out the step
}

TEST_F(SyncTest, AWaitingReceiverNoticesADeadSenderAndItsOwnBound) {
  SetUpGroup(1);
  Model m = Model::Make(44);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  Bare rx(m, Factory(1));
  {
    Async<Result<ReceiveStats>> first([&] { return rx.receiver->ReceiveSync(); });
    ASSERT_TRUE(sender->Sync(m.tensors).ok());
    ASSERT_TRUE(first.Get().ok());
  }
  Async<Result<ReceiveStats>> waiting([&] { return rx.receiver->ReceiveSync(); });
  std::this_thread::sleep_for(300ms);
  const auto t0 = Clock::now();
  sender.reset();  // the trainer dies: its connections close
  Result<ReceiveStats> r = waiting.Get();
  EXPECT_LT(Since(t0), 2.0) << "noticed only after " << Since(t0) << " s";
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();

  // A bound of the receiver's own.
  SetUpGroup(1);
  const CommunicatorOptions o0 =
      comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), 0, 2, kTimeout, "bounded");
  const CommunicatorOptions o1 =
      comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), 1, 2, kTimeout, "bounded");
  std::unique_ptr<StreamSender> sender2 =
      MakeSender([o0] { return CreateCommunicator("gloo", o0); });
  ReceiverOptions bounded;
  bounded.sync_wait = 400ms;
  Bare rx2(
      m, [o1] { return CreateCommunicator("gloo", o1); }, bounded);
  {
    Async<Result<ReceiveStats>> first([&] { return rx2.receiver->ReceiveSync(); });
    ASSERT_TRUE(sender2->Sync(m.tensors).ok());
    ASSERT_TRUE(first.Get().ok());
  }
  const auto t1 = Clock::now();
  Result<ReceiveStats> late = rx2.receiver->ReceiveSync();
  EXPECT_EQ(late.status().code(), StatusCode::kDeadlineExceeded) << late.status().ToString();
  EXPECT_LT(Since(t1), 3.0);
  EXPECT_GT(Since(t1), 0.3);
}

// ---------------------------------------------------------------------------
// Hellos and what the sender refuses there.

TEST_F(SyncTest, ADamagedHelloIsRefusedSaidSoAndTheNextFormationSyncs) {
  SetUpGroup(1);
  Model m = Model::Make(45);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  // The receiver's hello body with one block field changed, its checksum
  // left as it was.
  FaultPlan damage;
  damage.op = CommOp::kSend;
  damage.kind = FaultKind::kRewrite;
  damage.match = [](std::span<const uint8_t> b) {
    const std::string text(b.begin(), b.end());
    return text.find("\"protocol\"") != std::string::npos;
  };
  damage.rewrite = [](std::span<uint8_t> b) {
    std::string text(b.begin(), b.end());
    const size_t at = text.find("\"block\":[");
    ASSERT_NE(at, std::string::npos);
    char& digit = reinterpret_cast<char&>(b[at + 9]);
    digit = digit == '0' ? '1' : '0';
  };
  ReceiverRig rig(m, Hold::kWhole, Factory(1, {damage}));
  rig.Start();
  Result<SyncStats> first = sender->Sync(m.tensors);
  ASSERT_FALSE(first.ok());
  EXPECT_TRUE(Contains(first.status(), "receiver 1: its hello: checksum mismatch"))
      << first.status().ToString();
  // The group forms again; the hello is whole this time.
  Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    Result<SyncStats> s = sender->Sync(m.tensors);
    last = StatusOf(s);
    if (s.ok()) break;
  }
  EXPECT_TRUE(last.ok()) << last.ToString();
  EXPECT_TRUE(rig.Matches(m).ok());
  Finish(sender, {&rig});
  const std::vector<Status> results = rig.results();
  ASSERT_FALSE(results.empty());
  EXPECT_TRUE(Contains(results[0], "refused this receiver: its hello: checksum mismatch"))
      << results[0].ToString();
}

TEST_F(SyncTest, AReceiverThatFailsThreeSyncsInARowFormsTheGroupAgainAndIsRepaired) {
  SetUpGroup(1);
  Model m = Model::Make(46);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  ReceiverOptions o;
  o.apply_hook = [](uint64_t sync_id, std::string_view, uint64_t) {
    return sync_id >= 2 && sync_id <= 4 ? Status::IOError("injected") : Status::OK();
  };
  ReceiverRig rig(m, Hold::kWhole, Factory(1), o);
  rig.Start();
  std::vector<Status> results;
  for (int step = 0; step < 7; ++step) {
    if (step > 0) m.Step(46 + step, 0.03);
    results.push_back(StatusOf(sender->Sync(m.tensors)));
  }
  for (int i : {1, 2, 3}) EXPECT_FALSE(results[i].ok()) << i;
  EXPECT_TRUE(results[6].ok()) << results[6].ToString();
  EXPECT_TRUE(rig.Matches(m).ok());
  Finish(sender, {&rig});
  bool rejoined = false;
  for (const Status& r : rig.results()) rejoined = rejoined || Contains(r, "forms the group again");
  EXPECT_TRUE(rejoined);
}

TEST_F(SyncTest, AReceiverOfSomeTensorsMustSaySoAndIsCountedWhenItDoes) {
  SetUpGroup(1);
  Model m = Model::Make(47);
  const std::set<std::string> skip = {"b.bias", "c.weight"};
  {
    std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
    Bare rx(m, Factory(1), {}, skip);
    Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(Contains(s.status(), "it did not register tensor 'b.bias'"))
        << s.status().ToString();
    EXPECT_TRUE(Contains(got.Get().status(), "did not register tensor 'b.bias'"));
  }
  SetUpGroup(1);
  const auto factory = [&](int rank) -> CommunicatorFactory {
    const CommunicatorOptions o =
        comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), rank, 2, kTimeout, "partial");
    return [o] { return CreateCommunicator("gloo", o); };
  };
  std::unique_ptr<StreamSender> sender = MakeSender(factory(0));
  ReceiverOptions o;
  o.partial = true;
  Bare rx(m, factory(1), o, skip);
  Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
  Result<SyncStats> s = sender->Sync(m.tensors);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->partial_receivers, 1u);
  Result<ReceiveStats> r = got.Get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->partial);
  EXPECT_EQ(r->tensors, m.tensors.size() - skip.size());
  EXPECT_TRUE(rx.Holds(m, skip));
}

TEST_F(SyncTest, AReceiverWhoseFramesAreTooSmallIsRefusedNamingBothSizes) {
  SetUpGroup(1);
  Model m = Model::Make(48);
  SenderOptions so;
  so.bucket_bytes = 1 << 20;
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), so);
  ReceiverOptions ro;
  ro.max_frame_bytes = 100000;
  Bare rx(m, Factory(1), ro);
  Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
  Result<SyncStats> s = sender->Sync(m.tensors);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.status(),
                       "it takes frames of at most 100000 bytes, and the sender's "
                       "frames may be 1048576"))
      << s.status().ToString();
  const Status r = StatusOf(got.Get());
  EXPECT_TRUE(Contains(r, "frames of at most 100000 bytes")) << r.ToString();
}

// ---------------------------------------------------------------------------
// Destinations that move.

TEST_F(SyncTest, ARefusalBeforeApplyWritesNothingAndRebindAsksForASeed) {
  SetUpGroup(1);
  Model m = Model::Make(49);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  std::atomic<bool> moved{false};
  ReceiverOptions o;
  o.before_apply = [&]() -> Status {
    return moved ? Status::FailedPrecondition("tensor 'a.weight': its memory moved") : Status::OK();
  };
  Bare rx(m, Factory(1), o);
  const auto round = [&]() -> std::pair<Status, Status> {
    Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
    const Status s = StatusOf(sender->Sync(m.tensors));
    return {s, StatusOf(got.Get())};
  };
  ASSERT_TRUE(round().first.ok());
  moved = true;
  m.Step(49, 0.1);
  const std::vector<std::vector<uint8_t>> before = rx.buffers;
  auto [sent, taken] = round();
  EXPECT_TRUE(Contains(sent, "tensor 'a.weight': its memory moved")) << sent.ToString();
  EXPECT_EQ(taken.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rx.buffers, before);  // nothing written
  // The engine gives the tensor new memory and says so.
  std::vector<uint8_t> fresh(m.bytes[0].size(), 0xAB);
  ASSERT_TRUE(rx.receiver->Rebind("a.weight", fresh).ok());
  EXPECT_FALSE(rx.receiver->Rebind("nope", fresh).ok());
  std::vector<uint8_t> small(4);
  EXPECT_TRUE(Contains(rx.receiver->Rebind("a.weight", small), "holds 4 bytes"));
  moved = false;
  auto [asked, seed_asked] = round();
  EXPECT_TRUE(Contains(asked, "asks for a seed")) << asked.ToString();
  auto [reseeded, taken2] = round();
  EXPECT_TRUE(reseeded.ok()) << reseeded.ToString();
  EXPECT_EQ(fresh, m.bytes[0]);
  for (size_t i = 1; i < m.tensors.size(); ++i) EXPECT_EQ(rx.buffers[i], m.bytes[i]);
}

// ---------------------------------------------------------------------------
// A sharded trainer whose ranks leave elements uncovered.

TEST_F(SyncTest, ElementsNoContributingRankHoldsAreRefusedNamingTheFirst) {
  SetUpGroup(1);
  Model m = ShardedModel(50);
  std::vector<ModelTensor> model;
  for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
  std::vector<std::unique_ptr<StreamSender>> ranks;
  for (int r = 0; r < 4; ++r) {
    const CommunicatorOptions o =
        comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), r, 4, kTimeout, "trainers");
    Result<std::unique_ptr<StreamSender>> s = StreamSender::CreateSharded(
        [o] { return CreateCommunicator("gloo", o); }, r == 0 ? Factory(0) : nullptr);
    ASSERT_TRUE(s.ok());
    ranks.push_back(std::move(*s));
  }
  Bare rx(m, Factory(1));
  Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
  std::vector<Status> results(4);
  std::vector<std::vector<std::vector<uint8_t>>> bytes(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      std::vector<ShardSpec> specs = RankSpecs(r);
      // c.weight's third part (elements 3500..4999) held by rank 2 only,
      // which says another rank sends it.
      if (r == 2) specs[1].contributes = false;
      std::vector<ShardedTensor> shards;
      for (const ShardSpec& spec : specs) bytes[r].push_back(Extract(spec, m));
      for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[r][i], {}});
      results[r] = StatusOf(ranks[r]->SyncShards(model, shards));
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(Contains(results[0],
                       "tensor 'c.weight': element 3500 (of 5000, 1500 in all) is "
                       "held by no trainer rank that contributes"))
      << results[0].ToString();
  for (int r = 1; r < 4; ++r) EXPECT_FALSE(results[r].ok()) << r;
  EXPECT_EQ(ranks[0]->committed_sync_id(), 0u);
  // The layout was refused before the stream group formed: the receiver
  // still waits to form it.
  rx.receiver->Cancel("the test ends");
  EXPECT_FALSE(got.Get().ok());
}

// A shard placed on a CUDA device that its memory is not on (here: host
// memory; FailedPrecondition without a GPU, Unsupported in a build without
// CUDA, InvalidArgument with one) is refused naming it, every rank's sync
// fails rather than waits, and the next sync with the shard placed in host
// memory goes through as a first sync would.
TEST_F(SyncTest, ADeviceShardThatCannotBeUsedIsRefusedByNameAndLosesNothing) {
  SetUpGroup(1);
  Model m = ShardedModel(51);
  std::vector<ModelTensor> model;
  for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
  constexpr int kRanks = 4;
  std::vector<std::unique_ptr<StreamSender>> ranks =
      ShardedRanks(kRanks, [](int, SenderOptions*) {});
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kRanks));
  ReceiverRig whole(m, Hold::kWhole, Factory(1));
  whole.Start();
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::vector<std::vector<std::vector<uint8_t>>> bytes(kRanks);
    std::vector<Status> results(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        const std::vector<ShardSpec> specs = RankSpecs(r);
        std::vector<ShardedTensor> shards;
        for (const ShardSpec& spec : specs) bytes[r].push_back(Extract(spec, m));
        for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[r][i], {}});
        if (attempt == 0 && r == 1) shards[0].place = Placement::Cuda(0);
        results[r] = StatusOf(ranks[r]->SyncShards(model, shards));
      });
    }
    for (std::thread& t : threads) t.join();
    if (attempt == 0) {
      const StatusCode code = results[1].code();
      EXPECT_TRUE(code == StatusCode::kFailedPrecondition || code == StatusCode::kUnsupported ||
                  code == StatusCode::kInvalidArgument)
          << results[1].ToString();
      EXPECT_TRUE(Contains(results[1], "shard 0 (of '")) << results[1].ToString();
      for (int r : {0, 2, 3}) EXPECT_FALSE(results[r].ok()) << r;
      EXPECT_EQ(ranks[0]->committed_sync_id(), 0u);
      continue;
    }
    for (int r = 0; r < kRanks; ++r)
      EXPECT_TRUE(results[r].ok()) << r << ": " << results[r].ToString();
    Status same = whole.Matches(m);
    EXPECT_TRUE(same.ok()) << same.ToString();
  }
  whole.RequestStop();
  ranks.clear();
  whole.Stop();
}

// ---------------------------------------------------------------------------
// The authenticated mode.

Result<AuthKey> Key(std::string_view secret) { return DeriveAuthKey(secret); }

class AuthSyncTest : public SyncTest {
 protected:
  CommunicatorFactory KeyedFactory(
      int rank, std::optional<AuthKey> key,
      std::function<std::unique_ptr<Communicator>(std::unique_ptr<Communicator>)> under = nullptr,
      std::string group = "auth") {
    const CommunicatorOptions o =
        comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), rank, size_, kTimeout, group);
    return [o, key, under, group]() -> Result<std::unique_ptr<Communicator>> {
      DS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, CreateCommunicator("gloo", o));
      if (under) c = under(std::move(c));
      if (!key) return c;
      return AuthenticateCommunicator(std::move(c), *key, group);
    };
  }
};

TEST_F(AuthSyncTest, AnAuthenticatedGroupSyncsBitExact) {
  SetUpGroup(2);
  Model m = Model::Make(51);
  const AuthKey key = *Key("a secret of the whole job, 32 bytes");
  std::unique_ptr<StreamSender> sender = MakeSender(KeyedFactory(0, key));
  ReceiverRig a(m, Hold::kWhole, KeyedFactory(1, key));
  ReceiverRig b(m, Hold::kColumns, KeyedFactory(2, key));
  a.Start();
  b.Start();
  for (int step = 0; step < 3; ++step) {
    if (step > 0) m.Step(51 + step, 0.05);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_TRUE(a.Matches(m).ok());
    EXPECT_TRUE(b.Matches(m).ok());
  }
  Finish(sender, {&a, &b});
}

TEST_F(AuthSyncTest, AMemberWithoutTheKeyIsNeverTaken) {
  SetUpGroup(1);
  Model m = Model::Make(52);
  const AuthKey key = *Key("the job's secret, long enough");
  const AuthKey other = *Key("a rogue's secret, long enough");
  // A rogue rank 0 with another key: the receiver refuses it at once.
  std::unique_ptr<StreamSender> rogue = MakeSender(KeyedFactory(0, other));
  Bare rx(m, KeyedFactory(1, key));
  Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
  Result<SyncStats> s = rogue->Sync(m.tensors);
  EXPECT_FALSE(s.ok());
  const Status r = StatusOf(got.Get());
  EXPECT_EQ(r.code(), StatusCode::kCorruption) << r.ToString();
  EXPECT_TRUE(Contains(r, "authentication failed")) << r.ToString();
  for (const std::vector<uint8_t>& b : rx.buffers) {
    EXPECT_EQ(b, std::vector<uint8_t>(b.size(), 0));  // nothing of the rogue's taken
  }
}

// Below the authenticated layer, on the receiver's side: what an attacker
// on the wire can do to the bytes and tags.
class Tamper final : public Communicator {
 public:
  // `edit(n, bytes)` may change the n-th message sent (bytes, then tag, as
  // separate messages); it has the messages sent before (`sent`).
  using Edit = std::function<void(size_t n, std::vector<uint8_t>* bytes,
                                  const std::deque<std::vector<uint8_t>>& sent)>;
  Tamper(std::unique_ptr<Communicator> inner, Edit edit)
      : inner_(std::move(inner)), edit_(std::move(edit)) {}
  std::string_view name() const override { return inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  uint64_t generation() const override { return inner_->generation(); }
  CommunicatorCapabilities capabilities() const override { return inner_->capabilities(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  Status health() const override { return inner_->health(); }
  void Cancel(std::string_view why) override { inner_->Cancel(why); }
  Status Send(int peer, std::span<const uint8_t> data) override {
    std::vector<uint8_t> bytes(data.begin(), data.end());
    edit_(sent_.size(), &bytes, sent_);
    sent_.emplace_back(data.begin(), data.end());
    return inner_->Send(peer, bytes);
  }
  Status SendAwaiting(int peer, std::span<const uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    std::vector<uint8_t> bytes(data.begin(), data.end());
    edit_(sent_.size(), &bytes, sent_);
    sent_.emplace_back(data.begin(), data.end());
    return inner_->SendAwaiting(peer, bytes, wait);
  }
  Status Recv(int peer, std::span<uint8_t> data) override { return inner_->Recv(peer, data); }
  Status RecvAwaiting(int peer, std::span<uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return inner_->RecvAwaiting(peer, data, wait);
  }
  Status Broadcast(int root, std::span<uint8_t> data) override {
    return inner_->Broadcast(root, data);
  }
  Status Barrier() override { return inner_->Barrier(); }
  Status Gather(int root, std::span<const uint8_t> r, std::span<uint8_t> out) override {
    return inner_->Gather(root, r, out);
  }
  Status AllGather(std::span<const uint8_t> r, std::span<uint8_t> out) override {
    return inner_->AllGather(r, out);
  }

 private:
  std::unique_ptr<Communicator> inner_;
  Edit edit_;
  std::deque<std::vector<uint8_t>> sent_;
};

// Rewrites every report the receiver sends to ok, envelope and body (with
// its checksum recomputed), as an attacker on the wire would; `tagged`:
// each message is followed by its tag.
Tamper::Edit ForgeOkReports(bool tagged) {
  auto envelope_at = std::make_shared<std::optional<size_t>>();
  return [envelope_at, tagged](size_t n, std::vector<uint8_t>* bytes,
                               const std::deque<std::vector<uint8_t>>&) {
    const std::vector<uint8_t> ok = stream::JsonBodyBytes(nlohmann::json{{"ok", true}});
    if (bytes->size() == stream::kEnvelopeBytes && (*bytes)[4] == 4) {
      *envelope_at = n;
      for (int i = 0; i < 8; ++i) (*bytes)[8 + i] = static_cast<uint8_t>(ok.size() >> (8 * i));
    } else if (*envelope_at && n == **envelope_at + (tagged ? 2 : 1)) {
      *bytes = ok;
    }
  };
}

TEST_F(AuthSyncTest, AReportRewrittenToOkCommitsAFailedSyncUnlessAuthenticated) {
  for (const bool keyed : {false, true}) {
    SCOPED_TRACE(keyed ? "authenticated" : "plain");
    SetUpGroup(1);
    Model m = Model::Make(53);
    const std::optional<AuthKey> key =
        keyed ? std::optional<AuthKey>(*Key("the job's secret, long enough")) : std::nullopt;
    ReceiverOptions o;
    o.apply_hook = [](uint64_t sync_id, std::string_view, uint64_t) {
      return sync_id == 2 ? Status::IOError("injected") : Status::OK();
    };
    const std::string group = keyed ? "forge-keyed" : "forge-plain";
    std::unique_ptr<StreamSender> sender = MakeSender(KeyedFactory(0, key, nullptr, group));
    const Tamper::Edit forge = ForgeOkReports(keyed);
    ReceiverRig rig(m, Hold::kWhole,
                    KeyedFactory(
                        1, key,
                        [forge](std::unique_ptr<Communicator> c) {
                          return std::unique_ptr<Communicator>(new Tamper(std::move(c), forge));
                        },
                        group),
                    o);
    rig.Start();
    ASSERT_TRUE(sender->Sync(m.tensors).ok());
    m.Step(53, 0.05);
    Result<SyncStats> s = sender->Sync(m.tensors);
    if (keyed) {
      // The forged report is refused, and the failed sync never commits.
      EXPECT_FALSE(s.ok());
      EXPECT_TRUE(Contains(s.status(), "authentication failed")) << s.status().ToString();
      EXPECT_EQ(sender->committed_sync_id(), 1u);
    } else {
      // What the authenticated mode is for: without it the sender takes the
      // forged report and commits a sync the receiver refused.
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      EXPECT_EQ(sender->committed_sync_id(), 2u);
      EXPECT_FALSE(rig.Matches(m).ok());
    }
    Finish(sender, {&rig});
  }
}

TEST_F(AuthSyncTest, AMessageReplayedWithItsOwnTagIsRefused) {
  SetUpGroup(1);
  Model m = Model::Make(54);
  const AuthKey key = *Key("the job's secret, long enough");
  // The receiver's messages: the session's all-gather is not a Send, so
  // the first Sends are the hello and its tag, then each sync's report
  // (envelope, tag, body, tag). At the second sync's report, the first
  // sync's report envelope and tag go out again in place of the new ones.
  std::vector<size_t> report_envelopes;
  const auto replay = [&](size_t n, std::vector<uint8_t>* bytes,
                          const std::deque<std::vector<uint8_t>>& sent) {
    if (bytes->size() == stream::kEnvelopeBytes && (*bytes)[4] == 4) {
      report_envelopes.push_back(n);
      if (report_envelopes.size() == 2) *bytes = sent[report_envelopes[0]];
    }
    if (report_envelopes.size() == 2 && n == report_envelopes[1] + 1) {
      *bytes = sent[report_envelopes[0] + 1];  // its tag
    }
  };
  std::unique_ptr<StreamSender> sender = MakeSender(KeyedFactory(0, key));
  Bare rx(m, KeyedFactory(1, key, [&](std::unique_ptr<Communicator> c) {
            return std::unique_ptr<Communicator>(new Tamper(std::move(c), replay));
          }));
  {
    Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
    ASSERT_TRUE(sender->Sync(m.tensors).ok());
    ASSERT_TRUE(got.Get().ok());
  }
  m.Step(54, 0.05);
  Async<Result<ReceiveStats>> got([&] { return rx.receiver->ReceiveSync(); });
  Result<SyncStats> s = sender->Sync(m.tensors);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.status(), "authentication failed")) << s.status().ToString();
  EXPECT_EQ(sender->committed_sync_id(), 1u);
  sender.reset();
  (void)got.Get();
}

TEST(AuthKeys, ShortSecretsAndKeyFilesOthersMayReadAreRefused) {
  EXPECT_EQ(DeriveAuthKey("short").status().code(), StatusCode::kInvalidArgument);
  const AuthKey a = *DeriveAuthKey("sixteen bytes!!!");
  const AuthKey b = *DeriveAuthKey("sixteen bytes!!?");
  EXPECT_NE(a.bytes, b.bytes);
  comm_test::TempDir dir;
  const std::string path = dir.path() + "/key";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("sixteen bytes!!!\n", f);
  std::fclose(f);
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  Result<std::string> open = ReadSecretFile(path);
  EXPECT_EQ(open.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(open.status(), "mode 0644")) << open.status().ToString();
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  Result<std::string> secret = ReadSecretFile(path);
  ASSERT_TRUE(secret.ok()) << secret.status().ToString();
  EXPECT_EQ(*secret, "sixteen bytes!!!");  // one trailing newline dropped
  EXPECT_EQ(ReadSecretFile(dir.path() + "/none").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace deltasync
