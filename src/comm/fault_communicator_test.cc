// The fault-injecting wrapper, around gloo groups formed in threads: each
// fault changes exactly what it says, on exactly the call it names.
#include "comm/fault_communicator.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/communicator_test_util.h"

namespace deltasync::stream_internal {
namespace {

using namespace std::chrono_literals;
using comm_test::OnEveryRank;
using comm_test::PatternBytes;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = 1000ms;
constexpr auto kSlack = 750ms;

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

class FaultTest : public ::testing::Test {
 protected:
  // A group of two; `plans` wrap rank `faulty`.
  void Form(int faulty, std::vector<FaultPlan> plans) {
    std::vector<Status> errors;
    auto comms = comm_test::FormInThreads(
        2,
        [&](int r) {
          return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir_.path()), r, 2, kTimeout);
        },
        &errors);
    for (const Status& s : errors) ASSERT_TRUE(s.ok()) << s.ToString();
    auto wrapped = std::make_unique<FaultCommunicator>(std::move(comms[faulty]), std::move(plans));
    fault_ = wrapped.get();
    comms[faulty] = std::move(wrapped);
    c_ = std::move(comms);
  }

  comm_test::TempDir dir_;
  std::vector<std::unique_ptr<Communicator>> c_;
  FaultCommunicator* fault_ = nullptr;
};

TEST_F(FaultTest, CorruptByteOnSendFlipsOneByteOfTheFirstSendOnly) {
  FaultPlan plan;
  plan.op = CommOp::kSend;
  plan.kind = FaultKind::kCorruptByte;
  plan.byte_offset = 5;
  plan.mask = 0x80;
  ASSERT_NO_FATAL_FAILURE(Form(0, {plan}));
  EXPECT_EQ(c_[0]->name(), "fault(gloo)");
  EXPECT_EQ(c_[0]->capabilities().checks_sizes, c_[1]->capabilities().checks_sizes);
  const std::vector<uint8_t> sent = PatternBytes(1, 64);
  std::vector<uint8_t> first(64), second(64);
  std::vector<Status> s = OnEveryRank(2, [&](int r) {
    if (r == 0) {
      Status x = c_[0]->Send(1, sent);
      return x.ok() ? c_[0]->Send(1, sent) : x;
    }
    Status x = c_[1]->Recv(0, first);
    return x.ok() ? c_[1]->Recv(0, second) : x;
  });
  ASSERT_TRUE(s[0].ok() && s[1].ok()) << s[0].ToString() << s[1].ToString();
  std::vector<uint8_t> want = sent;
  want[5] ^= 0x80;
  EXPECT_EQ(first, want);
  EXPECT_EQ(second, sent);
  EXPECT_EQ(sent, PatternBytes(1, 64));  // the caller's bytes are intact
  EXPECT_EQ(fault_->fired(), 1);
}

TEST_F(FaultTest, CorruptByteOnRecvChangesTheReceivedBytesModuloTheirSize) {
  FaultPlan plan;
  plan.op = CommOp::kRecv;
  plan.kind = FaultKind::kCorruptByte;
  plan.byte_offset = 70;  // byte 6 of 64
  ASSERT_NO_FATAL_FAILURE(Form(1, {plan}));
  const std::vector<uint8_t> sent = PatternBytes(2, 64);
  std::vector<uint8_t> got(64);
  std::vector<Status> s =
      OnEveryRank(2, [&](int r) { return r == 0 ? c_[0]->Send(1, sent) : c_[1]->Recv(0, got); });
  ASSERT_TRUE(s[0].ok() && s[1].ok()) << s[0].ToString() << s[1].ToString();
  std::vector<uint8_t> want = sent;
  want[6] ^= 0x01;
  EXPECT_EQ(got, want);
}

TEST_F(FaultTest, CorruptByteOnAGatherRecordReachesTheRoot) {
  FaultPlan plan;
  plan.op = CommOp::kGather;
  plan.kind = FaultKind::kCorruptByte;
  plan.byte_offset = 3;
  ASSERT_NO_FATAL_FAILURE(Form(1, {plan}));
  std::vector<uint8_t> out(16);
  std::vector<Status> s = OnEveryRank(2, [&](int r) {
    const std::vector<uint8_t> record = PatternBytes(10 + r, 8);
    return c_[r]->Gather(0, record, r == 0 ? std::span<uint8_t>(out) : std::span<uint8_t>());
  });
  ASSERT_TRUE(s[0].ok() && s[1].ok()) << s[0].ToString() << s[1].ToString();
  std::vector<uint8_t> want = PatternBytes(10, 8);
  std::vector<uint8_t> one = PatternBytes(11, 8);
  one[3] ^= 0x01;
  want.insert(want.end(), one.begin(), one.end());
  EXPECT_EQ(out, want);
}

TEST_F(FaultTest, TruncateMakesThePeerSeeAMessageOfTheWrongSize) {
  FaultPlan plan;
  plan.op = CommOp::kSend;
  plan.kind = FaultKind::kTruncate;
  plan.byte_offset = 10;
  ASSERT_NO_FATAL_FAILURE(Form(0, {plan}));
  const std::vector<uint8_t> sent = PatternBytes(3, 64);
  std::vector<uint8_t> got(64);
  std::vector<Status> s =
      OnEveryRank(2, [&](int r) { return r == 0 ? c_[0]->Send(1, sent) : c_[1]->Recv(0, got); });
  EXPECT_EQ(s[1].code(), StatusCode::kInvalidArgument) << s[1].ToString();
  EXPECT_TRUE(Contains(s[1], "sent 10 bytes; this rank expects 64")) << s[1].ToString();
  EXPECT_FALSE(s[0].ok());
}

TEST_F(FaultTest, DropReturnsOkAndThePeerTimesOut) {
  FaultPlan plan;
  plan.op = CommOp::kSend;
  plan.kind = FaultKind::kDrop;
  ASSERT_NO_FATAL_FAILURE(Form(0, {plan}));
  const std::vector<uint8_t> sent = PatternBytes(4, 64);
  std::vector<uint8_t> got(64);
  std::chrono::milliseconds waited{};
  std::vector<Status> s = OnEveryRank(2, [&](int r) {
    if (r == 0) return c_[0]->Send(1, sent);
    const auto start = Clock::now();
    Status x = c_[1]->Recv(0, got);
    waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    return x;
  });
  EXPECT_TRUE(s[0].ok()) << s[0].ToString();
  EXPECT_EQ(s[1].code(), StatusCode::kDeadlineExceeded) << s[1].ToString();
  EXPECT_GE(waited, kTimeout - 10ms);
  EXPECT_LT(waited, kTimeout + kSlack);
  EXPECT_EQ(got, std::vector<uint8_t>(64));
}

TEST_F(FaultTest, DelayPastTheTimeoutMakesThePeerTimeOutThenTheCallFails) {
  FaultPlan plan;
  plan.op = CommOp::kBroadcast;
  plan.kind = FaultKind::kDelay;  // the default: the timeout plus 250 ms
  ASSERT_NO_FATAL_FAILURE(Form(0, {plan}));
  std::vector<std::vector<uint8_t>> bufs = {PatternBytes(5, 32), std::vector<uint8_t>(32)};
  std::chrono::milliseconds took{};
  std::vector<Status> s = OnEveryRank(2, [&](int r) {
    const auto start = Clock::now();
    Status x = c_[r]->Broadcast(0, bufs[r]);
    if (r == 0) took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    return x;
  });
  EXPECT_EQ(s[1].code(), StatusCode::kDeadlineExceeded) << s[1].ToString();
  // By then rank 1 has closed its connections.
  EXPECT_EQ(s[0].code(), StatusCode::kUnavailable) << s[0].ToString();
  EXPECT_GE(took, kTimeout + 250ms);
  EXPECT_EQ(fault_->fired(), 1);
}

TEST_F(FaultTest, FailReturnsTheErrorOnTheChosenCallAndLeavesTheInnerOneUsable) {
  FaultPlan plan;
  plan.op = CommOp::kBarrier;
  plan.call_index = 1;
  plan.kind = FaultKind::kFail;
  plan.error = Status::Aborted("boom");
  ASSERT_NO_FATAL_FAILURE(Form(0, {plan}));
  // Rank 0: barrier, the failing one (which sends nothing), barrier; rank 1
  // takes part in two.
  std::vector<Status> s = OnEveryRank(2, [&](int r) -> Status {
    DS_RETURN_IF_ERROR(c_[r]->Barrier());
    if (r == 0) {
      Status injected = c_[0]->Barrier();
      if (injected.code() != StatusCode::kAborted || injected.message() != "boom") {
        return Status::Internal("the second barrier returned " + injected.ToString());
      }
    }
    return c_[r]->Barrier();
  });
  EXPECT_TRUE(s[0].ok()) << s[0].ToString();
  EXPECT_TRUE(s[1].ok()) << s[1].ToString();
  EXPECT_TRUE(c_[0]->health().ok());
  EXPECT_EQ(fault_->fired(), 1);
}

TEST_F(FaultTest, AnyCountsEveryCallAndEachPlanFiresOnce) {
  // The third call, whatever it is (an all-gather here), fails; so does the
  // first recv; nothing else.
  FaultPlan third;
  third.op = CommOp::kAny;
  third.call_index = 2;
  third.error = Status::Aborted("third");
  FaultPlan recv;
  recv.op = CommOp::kRecv;
  recv.error = Status::Aborted("recv");
  ASSERT_NO_FATAL_FAILURE(Form(0, {third, recv}));
  std::vector<uint8_t> buf(8), out(16);
  EXPECT_EQ(c_[0]->Recv(1, buf).message(), "recv");                     // call 0
  EXPECT_EQ(c_[0]->Send(7, buf).code(), StatusCode::kInvalidArgument);  // call 1
  EXPECT_EQ(c_[0]->AllGather(buf, out).message(), "third");             // call 2
  EXPECT_EQ(c_[0]->Send(0, buf).code(), StatusCode::kInvalidArgument);  // call 3
  EXPECT_EQ(fault_->fired(), 2);
}

}  // namespace
}  // namespace deltasync::stream_internal
