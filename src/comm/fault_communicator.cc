#include "comm/fault_communicator.h"

#include <algorithm>
#include <thread>
#include <utility>

namespace deltasync::stream_internal {

namespace {

// The fault on a call whose bytes leave this rank: `call` makes the inner
// call with the bytes it is given.
template <typename Call>
Status Outgoing(const FaultPlan& f, std::chrono::milliseconds delay, std::span<const uint8_t> data,
                Call&& call) {
  switch (f.kind) {
    case FaultKind::kCorruptByte: {
      if (data.empty()) return call(data);
      std::vector<uint8_t> copy(data.begin(), data.end());
      copy[f.byte_offset % copy.size()] ^= f.mask;
      return call(std::span<const uint8_t>(copy));
    }
    case FaultKind::kTruncate: return call(data.first(std::min(f.byte_offset, data.size())));
    case FaultKind::kDrop: return Status::OK();
    case FaultKind::kDelay: std::this_thread::sleep_for(delay); return call(data);
    case FaultKind::kFail: return f.error;
    case FaultKind::kRewrite: {
      std::vector<uint8_t> copy(data.begin(), data.end());
      if (f.rewrite) f.rewrite(copy);
      return call(std::span<const uint8_t>(copy));
    }
  }
  return call(data);
}

// The fault on a call that only receives into `data`.
template <typename Call>
Status Incoming(const FaultPlan& f, std::chrono::milliseconds delay, std::span<uint8_t> data,
                Call&& call) {
  switch (f.kind) {
    case FaultKind::kCorruptByte: {
      Status s = call(data);
      if (s.ok() && !data.empty()) data[f.byte_offset % data.size()] ^= f.mask;
      return s;
    }
    case FaultKind::kTruncate: return call(data.first(std::min(f.byte_offset, data.size())));
    case FaultKind::kDrop: return Status::OK();
    case FaultKind::kDelay: std::this_thread::sleep_for(delay); return call(data);
    case FaultKind::kFail: return f.error;
    case FaultKind::kRewrite: {
      Status s = call(data);
      if (s.ok() && f.rewrite) f.rewrite(data);
      return s;
    }
  }
  return call(data);
}

// A Recv plan with `match`, after the call: only the kinds that change
// received bytes act.
void AfterRecv(const FaultPlan& f, std::span<uint8_t> data) {
  if (f.kind == FaultKind::kCorruptByte && !data.empty()) {
    data[f.byte_offset % data.size()] ^= f.mask;
  } else if (f.kind == FaultKind::kRewrite && f.rewrite) {
    f.rewrite(data);
  }
}

}  // namespace

std::string_view CommOpName(CommOp op) {
  switch (op) {
    case CommOp::kAny: return "any";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kBarrier: return "barrier";
    case CommOp::kGather: return "gather";
    case CommOp::kAllGather: return "all-gather";
  }
  return "unknown";
}

FaultCommunicator::FaultCommunicator(std::unique_ptr<Communicator> inner,
                                     std::vector<FaultPlan> plans)
    : inner_(std::move(inner)), name_("fault(" + std::string(inner_->name()) + ")") {
  for (FaultPlan& p : plans) {
    Armed armed;
    armed.plan = std::move(p);
    plans_.push_back(std::move(armed));
  }
}

const FaultPlan* FaultCommunicator::Next(CommOp op, const std::span<const uint8_t>* bytes,
                                         bool post) {
  // At most one plan fires per call: the first listed whose turn it is.
  const FaultPlan* firing = nullptr;
  for (Armed& a : plans_) {
    if (a.done || (a.plan.op != CommOp::kAny && a.plan.op != op)) continue;
    if (a.plan.match) {
      if (bytes == nullptr || !a.plan.match(*bytes)) continue;
    } else if (post) {
      continue;
    }
    if (a.seen++ == a.plan.call_index && firing == nullptr) {
      a.done = true;
      firing = &a.plan;
      ++fired_;
    }
  }
  return firing;
}

std::chrono::milliseconds FaultCommunicator::DelayOf(const FaultPlan& plan) const {
  if (plan.delay.count() > 0) return plan.delay;
  return inner_->timeout() + std::chrono::milliseconds(250);
}

template <typename Call>
Status FaultCommunicator::SendVia(std::span<const uint8_t> data, Call&& call) {
  const FaultPlan* f = Next(CommOp::kSend, &data);
  return f ? Outgoing(*f, DelayOf(*f), data, call) : call(data);
}

Status FaultCommunicator::Send(int peer, std::span<const uint8_t> data) {
  return SendVia(data, [&](std::span<const uint8_t> d) { return inner_->Send(peer, d); });
}

Status FaultCommunicator::SendAwaiting(int peer, std::span<const uint8_t> data,
                                       std::optional<std::chrono::milliseconds> wait) {
  return SendVia(data,
                 [&](std::span<const uint8_t> d) { return inner_->SendAwaiting(peer, d, wait); });
}

Status FaultCommunicator::Recv(int peer, std::span<uint8_t> data) {
  return RecvVia(data, [&](std::span<uint8_t> d) { return inner_->Recv(peer, d); });
}

Status FaultCommunicator::RecvAwaiting(int peer, std::span<uint8_t> data,
                                       std::optional<std::chrono::milliseconds> wait) {
  return RecvVia(data, [&](std::span<uint8_t> d) { return inner_->RecvAwaiting(peer, d, wait); });
}

template <typename Call>
Status FaultCommunicator::RecvVia(std::span<uint8_t> data, Call&& call) {
  const FaultPlan* f = Next(CommOp::kRecv);
  if (f != nullptr) return Incoming(*f, DelayOf(*f), data, call);
  Status s = call(data);
  if (!s.ok()) return s;
  const std::span<const uint8_t> got(data);
  if (const FaultPlan* after = Next(CommOp::kRecv, &got, true)) AfterRecv(*after, data);
  return s;
}

Status FaultCommunicator::Broadcast(int root, std::span<uint8_t> data) {
  const FaultPlan* f = Next(CommOp::kBroadcast);
  if (f == nullptr) return inner_->Broadcast(root, data);
  if (rank() != root) {
    return Incoming(*f, DelayOf(*f), data,
                    [&](std::span<uint8_t> d) { return inner_->Broadcast(root, d); });
  }
  // The root's bytes are only read, so a changed copy stands in for them.
  return Outgoing(*f, DelayOf(*f), data, [&](std::span<const uint8_t> d) {
    std::vector<uint8_t> copy(d.begin(), d.end());
    return inner_->Broadcast(root, copy);
  });
}

Status FaultCommunicator::Barrier() {
  const FaultPlan* f = Next(CommOp::kBarrier);
  if (f == nullptr) return inner_->Barrier();
  return Outgoing(*f, DelayOf(*f), {}, [&](std::span<const uint8_t>) { return inner_->Barrier(); });
}

Status FaultCommunicator::Gather(int root, std::span<const uint8_t> record,
                                 std::span<uint8_t> out) {
  const FaultPlan* f = Next(CommOp::kGather);
  auto call = [&](std::span<const uint8_t> r) { return inner_->Gather(root, r, out); };
  return f ? Outgoing(*f, DelayOf(*f), record, call) : call(record);
}

Status FaultCommunicator::AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) {
  const FaultPlan* f = Next(CommOp::kAllGather);
  auto call = [&](std::span<const uint8_t> r) { return inner_->AllGather(r, out); };
  return f ? Outgoing(*f, DelayOf(*f), record, call) : call(record);
}

}  // namespace deltasync::stream_internal
