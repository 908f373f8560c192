// The gloo communicator: groups formed in threads of this process for the
// checks of one call, and groups of processes (communicator_test_peer) for
// every operation over both stores, a peer killed with SIGKILL, a silent
// peer, and a group formed again after a member restarts.
#include <netinet/in.h>
#include <signal.h>

#include <gloo/transport/tcp/address.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator_rendezvous.h"
#include "comm/communicator_test_util.h"
#include "deltasync/communicator.h"

namespace deltasync {
namespace {

using namespace std::chrono_literals;
using comm_test::FileRendezvous;
using comm_test::FormInThreads;
using comm_test::LoopbackOptions;
using comm_test::OnEveryRank;
using comm_test::PatternBytes;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = 2000ms;
// What a bound may be late by on a loaded machine: waits poll, threads
// wake late.
constexpr auto kSlack = 750ms;
// How long a peer process may take to finish its part.
constexpr auto kPeerLimit = 15000ms;

std::chrono::milliseconds Since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
}

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// A gloo group of `n` in threads, on a fresh directory.
class GlooThreads : public ::testing::Test {
 protected:
  std::vector<std::unique_ptr<Communicator>> Form(int n,
                                                  std::chrono::milliseconds timeout = kTimeout) {
    std::vector<Status> errors;
    auto comms = FormInThreads(
        n, [&](int r) { return LoopbackOptions(FileRendezvous(dir_.path()), r, n, timeout); },
        &errors);
    for (const Status& s : errors) EXPECT_TRUE(s.ok()) << s.ToString();
    return comms;
  }

  comm_test::TempDir dir_;
};

TEST_F(GlooThreads, SizeMismatchNamesBothSizesLeavesTheBufferAloneAndBreaksTheCommunicator) {
  auto c = Form(2);
  ASSERT_TRUE(c[0] && c[1]);
  std::vector<uint8_t> got(64, 0xab);
  const std::vector<uint8_t> sent = PatternBytes(1, 100);
  std::vector<Status> s =
      OnEveryRank(2, [&](int r) { return r == 0 ? c[0]->Send(1, sent) : c[1]->Recv(0, got); });
  EXPECT_EQ(s[1].code(), StatusCode::kInvalidArgument) << s[1].ToString();
  EXPECT_TRUE(Contains(s[1], "gloo recv")) << s[1].ToString();
  EXPECT_TRUE(Contains(s[1], "peer rank 0 sent 100 bytes; this rank expects 64"))
      << s[1].ToString();
  EXPECT_EQ(got, std::vector<uint8_t>(64, 0xab));
  // The receiver closed its connections: the sender fails at once, not at
  // its timeout.
  EXPECT_EQ(s[0].code(), StatusCode::kUnavailable) << s[0].ToString();
  EXPECT_TRUE(Contains(s[0], "peer rank 1")) << s[0].ToString();

  Status later = c[1]->Barrier();
  EXPECT_EQ(later.code(), StatusCode::kFailedPrecondition) << later.ToString();
  EXPECT_TRUE(Contains(later, "broken")) << later.ToString();
  EXPECT_TRUE(Contains(later, "sent 100 bytes")) << later.ToString();
  EXPECT_EQ(c[1]->health().code(), StatusCode::kInvalidArgument);
}

TEST_F(GlooThreads, CallMismatchNamesBothOperations) {
  auto c = Form(2);
  ASSERT_TRUE(c[0] && c[1]);
  std::vector<uint8_t> a(8), b(8);
  std::vector<Status> s =
      OnEveryRank(2, [&](int r) { return r == 0 ? c[0]->Broadcast(0, a) : c[1]->Recv(0, b); });
  EXPECT_EQ(s[1].code(), StatusCode::kInvalidArgument) << s[1].ToString();
  EXPECT_TRUE(Contains(s[1], "sent a broadcast message; this rank expects a send"))
      << s[1].ToString();
}

TEST_F(GlooThreads, RootMismatchNamesBothRoots) {
  // With 4 ranks, rank 2 rooted at 1 expects its broadcast from rank 1,
  // which rooted at 3 forwards rank 3's to it.
  auto c = Form(4);
  for (auto& comm : c) ASSERT_TRUE(comm);
  std::vector<std::vector<uint8_t>> bufs(4, std::vector<uint8_t>(16));
  std::vector<Status> s =
      OnEveryRank(4, [&](int r) { return c[r]->Broadcast(r == 2 ? 1 : 3, bufs[r]); });
  EXPECT_EQ(s[2].code(), StatusCode::kInvalidArgument) << s[2].ToString();
  EXPECT_TRUE(Contains(s[2], "peer rank 1 has root rank 3; this rank has root rank 1"))
      << s[2].ToString();
}

TEST_F(GlooThreads, BadArgumentsAreRefusedBeforeSendingAndLeaveItUsable) {
  auto c = Form(2);
  ASSERT_TRUE(c[0] && c[1]);
  std::vector<uint8_t> buf(16);
  Status s = c[0]->Send(5, buf);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "gloo send: peer rank 5 is outside the group of 2")) << s.ToString();
  s = c[0]->Recv(-1, buf);
  EXPECT_TRUE(Contains(s, "gloo recv: peer rank -1 is outside the group of 2")) << s.ToString();
  s = c[0]->Send(0, buf);
  EXPECT_TRUE(Contains(s, "peer rank 0 is this rank")) << s.ToString();
  s = c[0]->Broadcast(2, buf);
  EXPECT_TRUE(Contains(s, "gloo broadcast: root rank 2 is outside the group of 2")) << s.ToString();
  s = c[0]->Gather(0, std::span(buf).first(8), std::span(buf).first(10));
  EXPECT_TRUE(Contains(s, "gloo gather: out is 10 bytes, expected 16")) << s.ToString();
  s = c[0]->AllGather(std::span(buf).first(4), buf);
  EXPECT_TRUE(Contains(s, "gloo all-gather: out is 16 bytes, expected 8")) << s.ToString();
  EXPECT_TRUE(c[0]->health().ok());

  // Still usable: a real exchange, and zero-byte messages.
  const std::vector<uint8_t> sent = PatternBytes(7, 16);
  std::vector<uint8_t> none;
  std::vector<Status> r = OnEveryRank(2, [&](int rank) {
    if (rank == 0) {
      Status x = c[0]->Send(1, sent);
      return x.ok() ? c[0]->Send(1, none) : x;
    }
    Status x = c[1]->Recv(0, buf);
    return x.ok() ? c[1]->Recv(0, none) : x;
  });
  EXPECT_TRUE(r[0].ok()) << r[0].ToString();
  EXPECT_TRUE(r[1].ok()) << r[1].ToString();
  EXPECT_EQ(buf, sent);
}

TEST_F(GlooThreads, ASingleRankGroupDoesEverythingLocally) {
  auto c = Form(1);
  ASSERT_TRUE(c[0]);
  EXPECT_EQ(c[0]->name(), "gloo");
  EXPECT_TRUE(c[0]->capabilities().host_buffers);
  EXPECT_FALSE(c[0]->capabilities().device_buffers);
  EXPECT_TRUE(c[0]->capabilities().detects_dead_peer);
  EXPECT_TRUE(c[0]->capabilities().checks_sizes);
  std::vector<uint8_t> buf = PatternBytes(3, 32);
  EXPECT_TRUE(c[0]->Broadcast(0, buf).ok());
  EXPECT_EQ(buf, PatternBytes(3, 32));
  EXPECT_TRUE(c[0]->Barrier().ok());
  std::vector<uint8_t> out(32);
  EXPECT_TRUE(c[0]->Gather(0, buf, out).ok());
  EXPECT_EQ(out, buf);
  std::fill(out.begin(), out.end(), 0);
  EXPECT_TRUE(c[0]->AllGather(buf, out).ok());
  EXPECT_EQ(out, buf);
  EXPECT_EQ(c[0]->Send(0, buf).code(), StatusCode::kInvalidArgument);
}

TEST_F(GlooThreads, AutomaticGenerationsCountUpAndEachFormationIsFresh) {
  for (uint64_t g = 0; g < 2; ++g) {
    auto c = Form(2);
    ASSERT_TRUE(c[0] && c[1]);
    EXPECT_EQ(c[0]->generation(), g);
    EXPECT_EQ(c[1]->generation(), g);
    std::vector<Status> s = OnEveryRank(2, [&](int r) { return c[r]->Barrier(); });
    EXPECT_TRUE(s[0].ok() && s[1].ok()) << s[0].ToString() << s[1].ToString();
  }
}

// A process forked without exec (a data loader's worker, say) holds copies
// of every socket its parent had: the member's leaving must still reach its
// peers, which would otherwise wait on a connection that never closes.
TEST_F(GlooThreads, AMemberThatLeavesIsNoticedWhileAForkedChildHoldsItsSockets) {
  auto comms = Form(2);
  ASSERT_EQ(comms.size(), 2u);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Only async-signal-safe calls here: the parent has threads.
    sleep(30);
    _exit(0);
  }
  std::vector<uint8_t> buf(16);
  Status got;
  Clock::time_point start;
  std::thread waiter([&] {
    start = Clock::now();
    got = comms[1]->RecvAwaiting(0, buf, 20000ms);
  });
  std::this_thread::sleep_for(200ms);
  comms[0].reset();
  waiter.join();
  const auto took = Since(start);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_EQ(got.code(), StatusCode::kUnavailable) << got.ToString();
  EXPECT_TRUE(Contains(got, "peer rank 0")) << got.ToString();
  EXPECT_LT(took, 200ms + kTimeout);
}

TEST(GlooForm, AMissingMemberIsDeadlineExceededNamingItWithinTheConnectTimeout) {
  comm_test::TempDir dir;
  CommunicatorOptions o = LoopbackOptions(FileRendezvous(dir.path()), 0, 2, kTimeout);
  o.connect_timeout = 600ms;
  const auto start = Clock::now();
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("gloo", o);
  const auto took = Since(start);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().ToString();
  EXPECT_TRUE(Contains(c.status(), "rank 1 did not join within 600 ms")) << c.status().ToString();
  EXPECT_GE(took, 600ms);
  EXPECT_LT(took, 600ms + kSlack);
}

// A member that published its address and died before connecting (killed
// during the formation): the formation still ends within the connect
// timeout, naming it. Rank 1's keys are written by hand with an address
// nobody listens on, whose port makes rank 0 the side that waits for the
// connection.
TEST(GlooForm, AMemberThatPublishedItsAddressAndDiedIsNamedWithinTheConnectTimeout) {
  comm_test::TempDir dir;
  CommunicatorOptions o = LoopbackOptions(FileRendezvous(dir.path()), 0, 2, kTimeout);
  o.connect_timeout = 1000ms;
  o.generation = 5;
  Result<std::unique_ptr<stream_internal::RendezvousStore>> store =
      stream_internal::RendezvousStore::Open(o.rendezvous, 1000ms);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  sockaddr_storage ss = {};
  auto& in = reinterpret_cast<sockaddr_in&>(ss);
  in.sin_family = AF_INET;
  in.sin_port = 0xFFFF;  // Gloo compares ports as stored: the largest listens last
  in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const std::vector<char> address = ::gloo::transport::tcp::Address(ss, 0).bytes();
  const std::string prefix = stream_internal::GenerationPrefix(o.group, 5) + "/";
  const std::string host = "127.0.0.1";
  ASSERT_TRUE((*store)->Set(prefix + "rank_1", std::span<const char>(host)).ok());
  ASSERT_TRUE((*store)->Set(prefix + "1", address).ok());
  const auto start = Clock::now();
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("gloo", o);
  const auto took = Since(start);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().ToString();
  EXPECT_TRUE(Contains(c.status(), "rank 1 did not connect within 1000 ms"))
      << c.status().ToString();
  EXPECT_LT(took, 1000ms + kSlack);
}

TEST(GlooForm, ARankWaitsForRankZerosAnnouncementUpToTheConnectTimeout) {
  comm_test::TempDir dir;
  CommunicatorOptions o = LoopbackOptions(FileRendezvous(dir.path()), 1, 2, kTimeout);
  o.connect_timeout = 300ms;
  const auto start = Clock::now();
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("gloo", o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().ToString();
  EXPECT_TRUE(Contains(c.status(), "rank 0 announced no generation to join at all"))
      << c.status().ToString();
  EXPECT_LT(Since(start), 300ms + kSlack);
}

TEST(GlooForm, AnExplicitGenerationIsFormedOnce) {
  comm_test::TempDir dir;
  CommunicatorOptions o = LoopbackOptions(FileRendezvous(dir.path()), 0, 1, kTimeout);
  o.generation = 7;
  Result<std::unique_ptr<Communicator>> first = CreateCommunicator("gloo", o);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ((*first)->generation(), 7u);
  Result<std::unique_ptr<Communicator>> again = CreateCommunicator("gloo", o);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(Contains(again.status(), "rank 0 already joined generation 7"))
      << again.status().ToString();
  o.generation = 8;
  EXPECT_TRUE(CreateCommunicator("gloo", o).ok());
}

// Members started with different group sizes: every one says so, naming
// both sizes, within the connect timeout (rather than a Gloo-internal
// message or a wait past it).
TEST(GlooForm, GroupSizesThatDisagreeAreNamedWithinTheConnectTimeout) {
  for (const bool rank0_larger : {false, true}) {
    SCOPED_TRACE(rank0_larger ? "rank 0 larger" : "rank 0 smaller");
    comm_test::TempDir dir;
    const int n0 = rank0_larger ? 3 : 2;
    const int n1 = rank0_larger ? 2 : 3;
    const auto start = Clock::now();
    std::vector<Status> s = OnEveryRank(2, [&](int r) {
      CommunicatorOptions o =
          LoopbackOptions(FileRendezvous(dir.path()), r, r == 0 ? n0 : n1, kTimeout);
      o.connect_timeout = 3000ms;
      return CreateCommunicator("gloo", o).status();
    });
    EXPECT_LT(Since(start), 3000ms + kSlack);
    const std::string sizes = "rank 1 was started with a group of " + std::to_string(n1) +
                              " members, rank 0 with " + std::to_string(n0);
    EXPECT_EQ(s[1].code(), StatusCode::kInvalidArgument) << s[1].ToString();
    EXPECT_TRUE(Contains(s[1], sizes)) << s[1].ToString();
    EXPECT_EQ(s[0].code(), StatusCode::kInvalidArgument) << s[0].ToString();
    EXPECT_TRUE(Contains(s[0], "the group sizes disagree: " + sizes)) << s[0].ToString();
  }
}

TEST(GlooForm, AFileRendezvousItCreatesIsPrivateToTheUser) {
  comm_test::TempDir dir;
  const std::string made = dir.path() + "/made/here/";
  CommunicatorOptions o = LoopbackOptions(FileRendezvous(made), 0, 1, kTimeout);
  ASSERT_TRUE(CreateCommunicator("gloo", o).ok());
  struct stat st = {};
  ASSERT_EQ(stat((dir.path() + "/made/here").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

TEST(GlooForm, ARedisThatWantsAPasswordSaysSoAndFormsWithIt) {
  std::string why;
  std::unique_ptr<comm_test::RedisServer> redis =
      comm_test::RedisServer::Start(&why, {"--requirepass", "s3cret-pass"});
  if (!redis) GTEST_SKIP() << why;
  CommunicatorOptions o = LoopbackOptions(redis->rendezvous(), 0, 1, kTimeout);
  ::unsetenv("DELTASYNC_REDIS_PASSWORD");
  Result<std::unique_ptr<Communicator>> none = CreateCommunicator("gloo", o);
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status().ToString();
  EXPECT_TRUE(Contains(none.status(), "the server asks for a password"))
      << none.status().ToString();
  o.rendezvous.password = "wrong";
  Result<std::unique_ptr<Communicator>> wrong = CreateCommunicator("gloo", o);
  EXPECT_TRUE(Contains(wrong.status(), "the server refused the password"))
      << wrong.status().ToString();
  EXPECT_FALSE(Contains(wrong.status(), "wrong"));
  o.rendezvous.password = "s3cret-pass";
  Result<std::unique_ptr<Communicator>> right = CreateCommunicator("gloo", o);
  EXPECT_TRUE(right.ok()) << right.status().ToString();
  // From the environment, when the options give none.
  o.rendezvous.password.clear();
  ::setenv("DELTASYNC_REDIS_PASSWORD", "s3cret-pass", 1);
  Result<std::unique_ptr<Communicator>> env = CreateCommunicator("gloo", o);
  ::unsetenv("DELTASYNC_REDIS_PASSWORD");
  EXPECT_TRUE(env.ok()) << env.status().ToString();
}

TEST(GlooForm, AnUnreachableRedisIsUnavailableNamingIt) {
  Rendezvous where;
  where.kind = Rendezvous::Kind::kRedis;
  where.host = "127.0.0.1";
  where.port = comm_test::FreePort();
  Result<std::unique_ptr<Communicator>> c =
      CreateCommunicator("gloo", LoopbackOptions(where, 0, 2, kTimeout));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().ToString();
  EXPECT_TRUE(Contains(c.status(), "rendezvous redis:127.0.0.1:" + std::to_string(where.port)))
      << c.status().ToString();
  EXPECT_TRUE(Contains(c.status(), "cannot connect")) << c.status().ToString();
}

// ---------------------------------------------------------------------------
// Groups of processes: rank 0 is this test, the others communicator_test_peer.

std::vector<std::string> PeerArgs(const std::string& scenario, int rank, int size,
                                  const Rendezvous& where, const std::string& group) {
  return {DS_COMM_PEER_PATH,
          scenario,
          std::to_string(rank),
          std::to_string(size),
          RendezvousSpec(where),
          group,
          std::to_string(kTimeout.count())};
}

enum class StoreKind { kFile, kRedis };

struct GroupCase {
  StoreKind store;
  int size;
};

// Each case's store: a directory, or a redis-server of its own.
class GlooProcesses : public ::testing::TestWithParam<GroupCase> {
 protected:
  void SetUp() override {
    if (GetParam().store == StoreKind::kRedis) {
      std::string why;
      redis_ = comm_test::RedisServer::Start(&why);
      if (!redis_) GTEST_SKIP() << why;
      where_ = redis_->rendezvous();
    } else {
      where_ = FileRendezvous(dir_.path());
    }
  }

  comm_test::TempDir dir_;
  std::unique_ptr<comm_test::RedisServer> redis_;
  Rendezvous where_;
};

std::string CaseName(const ::testing::TestParamInfo<GroupCase>& info) {
  return std::string(info.param.store == StoreKind::kFile ? "File" : "Redis") +
         std::to_string(info.param.size);
}

TEST_P(GlooProcesses, EveryOperationDeliversTheReferenceBytes) {
  const int n = GetParam().size;
  comm_test::Children peers;
  for (int r = 1; r < n; ++r) {
    ASSERT_GE(peers.Spawn(PeerArgs("collectives", r, n, where_, "collectives")), 0);
  }
  Result<std::unique_ptr<Communicator>> c =
      CreateCommunicator("gloo", LoopbackOptions(where_, 0, n, kTimeout, "collectives"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Status s = comm_test::RunCollectivesScenario(**c);
  EXPECT_TRUE(s.ok()) << s.ToString();
  for (const std::optional<int>& code : peers.WaitAll(kPeerLimit)) EXPECT_EQ(code, 0);
}

INSTANTIATE_TEST_SUITE_P(Stores, GlooProcesses,
                         ::testing::Values(GroupCase{StoreKind::kFile, 2},
                                           GroupCase{StoreKind::kFile, 4},
                                           GroupCase{StoreKind::kRedis, 3}),
                         CaseName);

class GlooRejoin : public GlooProcesses {};

TEST_P(GlooRejoin, AGroupIsFormedAgainAfterAMemberIsKilledAndRestarted) {
  const int n = 3;
  comm_test::Children peers;
  ASSERT_EQ(peers.Spawn(PeerArgs("rejoin", 1, n, where_, "rejoin")), 0);
  ASSERT_EQ(peers.Spawn(PeerArgs("rejoin", 2, n, where_, "rejoin")), 1);
  const CommunicatorOptions o = LoopbackOptions(where_, 0, n, kTimeout, "rejoin");
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("gloo", o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const uint64_t first = (*c)->generation();
  std::vector<uint8_t> round = comm_test::RoundBytes(true, 1);
  ASSERT_TRUE((*c)->Broadcast(0, round).ok());

  peers.Kill(0);
  EXPECT_EQ(peers.Wait(0, 5000ms), 128 + SIGKILL);
  round = comm_test::RoundBytes(true, 2);
  // Usually Unavailable at once; DeadlineExceeded when Gloo has not seen
  // the connection drop before the call (it happens under load): an error
  // naming the peer within the timeout either way.
  Status lost = (*c)->Broadcast(0, round);
  EXPECT_TRUE(lost.code() == StatusCode::kUnavailable ||
              lost.code() == StatusCode::kDeadlineExceeded)
      << lost.ToString();
  EXPECT_TRUE(Contains(lost, "peer rank 1")) << lost.ToString();

  // The restarted member, the survivor and rank 0 meet in the next
  // generation, whatever order they come in.
  ASSERT_TRUE(peers.Respawn(0, PeerArgs("rejoin", 1, n, where_, "rejoin")));
  c->reset();
  c = CreateCommunicator("gloo", o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->generation(), first + 1);
  round = comm_test::RoundBytes(false, 3);
  Status last = (*c)->Broadcast(0, round);
  EXPECT_TRUE(last.ok()) << last.ToString();
  // Every member leaves once all are done (communicator_test_peer).
  Status done = (*c)->Barrier();
  EXPECT_TRUE(done.ok()) << done.ToString();
  for (const std::optional<int>& code : peers.WaitAll(kPeerLimit)) EXPECT_EQ(code, 0);
}

INSTANTIATE_TEST_SUITE_P(Stores, GlooRejoin,
                         ::testing::Values(GroupCase{StoreKind::kFile, 3},
                                           GroupCase{StoreKind::kRedis, 3}),
                         CaseName);

TEST(GlooDeadPeer, APeerKilledMidGatherIsUnavailableNamingItBeforeTheTimeout) {
  comm_test::TempDir dir;
  const Rendezvous where = FileRendezvous(dir.path());
  comm_test::Children peers;
  ASSERT_EQ(peers.Spawn(PeerArgs("gather", 1, 3, where, "dead")), 0);
  ASSERT_EQ(peers.Spawn(PeerArgs("idle", 2, 3, where, "dead")), 1);
  Result<std::unique_ptr<Communicator>> c =
      CreateCommunicator("gloo", LoopbackOptions(where, 0, 3, kTimeout, "dead"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->Barrier().ok());

  // Rank 1 delivers its record; rank 2 never will: it is killed while this
  // rank waits for it.
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    peers.Kill(1);
  });
  std::vector<uint8_t> out(3 * 16);
  const auto start = Clock::now();
  Status s = (*c)->Gather(0, PatternBytes(500, 16), out);
  const auto took = Since(start);
  killer.join();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_TRUE(Contains(s, "gloo gather")) << s.ToString();
  EXPECT_TRUE(Contains(s, "peer rank 2: connection lost")) << s.ToString();
  EXPECT_LT(took, kTimeout);
  EXPECT_TRUE(comm_test::ExpectPattern(std::span(out).subspan(16, 16), 501, "rank 1").ok());
  EXPECT_EQ((*c)->Barrier().code(), StatusCode::kFailedPrecondition);

  const std::vector<std::optional<int>> codes = peers.WaitAll(kPeerLimit);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 128 + SIGKILL);
}

TEST(GlooDeadPeer, ASilentPeerIsDeadlineExceededNamingItWithinTheTimeout) {
  comm_test::TempDir dir;
  const Rendezvous where = FileRendezvous(dir.path());
  comm_test::Children peers;
  ASSERT_EQ(peers.Spawn(PeerArgs("idle", 1, 2, where, "silent")), 0);
  Result<std::unique_ptr<Communicator>> c =
      CreateCommunicator("gloo", LoopbackOptions(where, 0, 2, kTimeout, "silent"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->Barrier().ok());
  std::vector<uint8_t> buf(16);
  const auto start = Clock::now();
  Status s = (*c)->Recv(1, buf);
  const auto took = Since(start);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_TRUE(Contains(s, "gloo recv")) << s.ToString();
  EXPECT_TRUE(Contains(s, "peer rank 1: no answer within 2000 ms")) << s.ToString();
  EXPECT_GE(took, kTimeout - 10ms);
  EXPECT_LT(took, kTimeout + kSlack);
  peers.Kill(0);
  EXPECT_EQ(peers.Wait(0, 5000ms), 128 + SIGKILL);
}

}  // namespace
}  // namespace deltasync
