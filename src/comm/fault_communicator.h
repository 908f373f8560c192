// A communicator that wraps another and injects faults on chosen calls,
// for tests of what runs over communicators (the stream's sender, receiver
// and commit protocol): a corrupted byte, a truncated message, a dropped
// message, a delay past the timeout, or an error.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/status.h"

namespace deltasync::stream_internal {

// The operations a fault can be aimed at.
enum class CommOp : uint8_t {
  kAny = 0,
  kSend = 1,
  kRecv = 2,
  kBroadcast = 3,
  kBarrier = 4,
  kGather = 5,
  kAllGather = 6,
};

// "send", "recv", ..., "any".
std::string_view CommOpName(CommOp op);

enum class FaultKind : uint8_t {
  // Flips bits of one byte (byte_offset modulo the size, `mask`): of the
  // bytes this rank contributes (Send's data, Broadcast's on the root, a
  // gather's record), sent from a copy so the caller's buffer stays intact;
  // or, where this rank only receives (Recv, Broadcast off the root), of
  // the bytes received, after the call. A call with no bytes is left alone.
  kCorruptByte = 0,
  // Makes the call with only the first byte_offset bytes of the buffer this
  // rank contributes or receives into (the record, for a gather), so that
  // the peers see a message of the wrong size.
  kTruncate = 1,
  // Returns OK without making the call: the message is lost, and the
  // peers wait for it until their timeout.
  kDrop = 2,
  // Sleeps for `delay` (zero: the inner communicator's timeout plus 250 ms,
  // so past the peers' timeout), then makes the call.
  kDelay = 3,
  // Returns `error` without making the call; the inner communicator stays
  // usable.
  kFail = 4,
  // Calls `rewrite` on the bytes this rank contributes (a copy, then sent)
  // or, where it only receives, on the bytes received, after the call: for
  // a well-formed message with chosen contents.
  kRewrite = 5,
};

// One fault: it fires on the call_index-th call (counting from 0) among the
// calls of `op` (or among all calls, for kAny), once.
//
// With `match`, only Send and Recv calls whose bytes it accepts count (a
// Send's data; a Recv's bytes once received, so a Recv plan with `match`
// can only be kCorruptByte or kRewrite, which act after the call; others
// never fire): a fault aimed at a message by its contents, such as the
// first frame of a chosen sync, rather than by counting calls.
struct FaultPlan {
  CommOp op = CommOp::kAny;
  uint64_t call_index = 0;
  FaultKind kind = FaultKind::kFail;
  size_t byte_offset = 0;  // kCorruptByte: which byte; kTruncate: bytes kept
  uint8_t mask = 0x01;     // kCorruptByte
  std::chrono::milliseconds delay{0};
  Status error = Status::Unavailable("injected fault");
  std::function<bool(std::span<const uint8_t>)> match;
  std::function<void(std::span<uint8_t>)> rewrite;  // kRewrite
};

// Forwards every call to `inner`, except where a plan fires. Its name is
// "fault(<inner's name>)"; everything else it reports is the inner one's.
class FaultCommunicator final : public Communicator {
 public:
  FaultCommunicator(std::unique_ptr<Communicator> inner, std::vector<FaultPlan> plans);

  // The plans that have fired so far.
  int fired() const { return fired_; }
  Communicator& inner() { return *inner_; }

  std::string_view name() const override { return name_; }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  uint64_t generation() const override { return inner_->generation(); }
  CommunicatorCapabilities capabilities() const override { return inner_->capabilities(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  Status health() const override { return inner_->health(); }

  Status Send(int peer, std::span<const uint8_t> data) override;
  Status Recv(int peer, std::span<uint8_t> data) override;
  Status Broadcast(int root, std::span<uint8_t> data) override;
  Status Barrier() override;
  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override;
  Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) override;
  // Counted, and faulted, as Send and Recv.
  Status SendAwaiting(int peer, std::span<const uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override;
  Status RecvAwaiting(int peer, std::span<uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override;
  void Cancel(std::string_view why) override { inner_->Cancel(why); }

 private:
  template <typename Call>
  Status SendVia(std::span<const uint8_t> data, Call&& call);
  template <typename Call>
  Status RecvVia(std::span<uint8_t> data, Call&& call);

  struct Armed {
    FaultPlan plan;
    uint64_t seen = 0;  // matching calls so far
    bool done = false;
  };

  // The plan that fires on this call of `op`, or nullptr; counts the call.
  // `bytes`: the call's bytes where known (plans with `match` need them);
  // `post`: only plans with `match` are considered (a Recv, after it).
  const FaultPlan* Next(CommOp op, const std::span<const uint8_t>* bytes = nullptr,
                        bool post = false);
  std::chrono::milliseconds DelayOf(const FaultPlan& plan) const;

  std::unique_ptr<Communicator> inner_;
  std::string name_;
  std::vector<Armed> plans_;
  int fired_ = 0;
};

}  // namespace deltasync::stream_internal
