// Internals shared by the communicators: deadlines, the argument checks
// every communicator makes before touching the wire, how errors describe a
// call, and the per-library factories CreateCommunicator dispatches to.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "deltasync/communicator.h"
#include "deltasync/status.h"

namespace deltasync::stream_internal {

using Clock = std::chrono::steady_clock;

// The instant an operation must be over by, fixed when it starts, so that
// every wait inside one call shares one budget.
class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds budget)
      : budget_(budget), end_(Clock::now() + budget) {}

  std::chrono::milliseconds budget() const { return budget_; }
  bool expired() const { return Clock::now() >= end_; }
  // What is left, rounded up, and at least 1 ms: Gloo reads a wait of 0 or
  // -1 ms as "the context's default", never as "do not wait".
  std::chrono::milliseconds remaining() const;

 private:
  std::chrono::milliseconds budget_;
  Clock::time_point end_;
};

// Forming a group waits in the rendezvous up to the connect timeout, and a
// stream side's Cancel must reach such a wait too: while a FormationCancel
// lives on a thread, the formation waits of that thread (the rendezvous
// polls) end with Aborted once *flag is set.
class FormationCancel {
 public:
  explicit FormationCancel(const std::atomic<bool>* flag);
  ~FormationCancel();
  FormationCancel(const FormationCancel&) = delete;
  FormationCancel& operator=(const FormationCancel&) = delete;
  // Aborted naming `where` once the calling thread's formation was
  // cancelled; OK otherwise (and on threads without one).
  static Status Check(std::string_view where);

 private:
  const std::atomic<bool>* previous_;
};

// What a Gloo store view throws with (then the text) when the formation
// was cancelled, so that the formation's caller can tell.
inline constexpr const char* kFormationCancelled = "the formation was cancelled: ";

// InvalidArgument naming the problem for options no communicator accepts
// (size, rank, group name, timeouts, rendezvous); `name` prefixes it.
Status ValidateOptions(std::string_view name, const CommunicatorOptions& options);

// "group "g" generation 3, rank 1 of 4": who is speaking, for messages.
std::string DescribeMember(std::string_view group, uint64_t generation, int rank, int size);

// Argument checks made before anything is sent; InvalidArgument
// "<call>: ..." on failure, where `call` names the communicator and the
// operation ("gloo send").
// A peer other than `rank`, in [0, size).
Status CheckPeer(std::string_view call, int size, int rank, int peer);
// A root in [0, size).
Status CheckRoot(std::string_view call, int size, int root);
// A buffer of exactly `expected` bytes (`what` names it: "out").
Status CheckSize(std::string_view call, std::string_view what, size_t expected, size_t actual);

// FailedPrecondition: `call` refused because the communicator described by
// `member` is broken by `cause`.
Status BrokenError(std::string_view call, std::string_view member, const Status& cause);

// The factories behind CreateCommunicator, built with their library.
#if DS_HAVE_GLOO
Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const CommunicatorOptions& options);
#endif
#if DS_HAVE_NCCL
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const CommunicatorOptions& options);
#endif

}  // namespace deltasync::stream_internal
