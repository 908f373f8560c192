// The gloo communicator: host memory over Gloo's TCP transport.
//
// Gloo's own collectives are not used: they report a failure by the peer's
// address (not its rank), cannot tell a message of the wrong size (a short
// one completes silently, a long one kills the receiving process from
// Gloo's event thread), and have no gatherv. Every operation here is built
// from framed point-to-point messages instead (docs/format.md,
// "Communicator messages (gloo)"): a fixed header, checked before the payload is
// posted, so that the payload's receive buffer always has the payload's
// size.
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "comm/communicator_internal.h"
#include "comm/communicator_rendezvous.h"
#include "core/endian.h"

namespace deltasync::stream_internal {

namespace {

// Every message goes through one slot: the header's operation code, not
// the slot, tells operations apart, so that two ranks calling different
// operations get an error naming both instead of waiting on different
// slots until the timeout.
constexpr uint64_t kMessageSlot = 0x00dc000000000000ull;

constexpr uint32_t kMagic = 0x314d4344;  // "DCM1"
constexpr size_t kHeaderBytes = 32;

enum class MessageOp : uint8_t {
  kSend = 1,
  kBroadcast = 2,
  kGather = 3,
  kAllGather = 4,
  kBarrier = 5,
};

std::string_view OpName(uint8_t op) {
  switch (static_cast<MessageOp>(op)) {
    case MessageOp::kSend: return "send";
    case MessageOp::kBroadcast: return "broadcast";
    case MessageOp::kGather: return "gather";
    case MessageOp::kAllGather: return "all-gather";
    case MessageOp::kBarrier: return "barrier";
  }
  return "unknown";
}

// The header's fields (docs/format.md, "Communicator messages (gloo)").
struct Header {
  uint8_t op = 0;
  uint32_t root = 0;
  uint64_t sequence = 0;
  uint64_t nbytes = 0;
};

void EncodeHeader(const Header& h, uint8_t* out) {
  std::memset(out, 0, kHeaderBytes);
  StoreLe<uint32_t>(out, kMagic);
  out[4] = h.op;
  StoreLe<uint32_t>(out + 8, h.root);
  StoreLe<uint64_t>(out + 16, h.sequence);
  StoreLe<uint64_t>(out + 24, h.nbytes);
}

// False when the bytes are no header at all.
bool DecodeHeader(const uint8_t* in, Header* h) {
  if (LoadLe<uint32_t>(in) != kMagic) return false;
  for (size_t i : {5, 6, 7, 12, 13, 14, 15}) {
    if (in[i] != 0) return false;
  }
  h->op = in[4];
  h->root = LoadLe<uint32_t>(in + 8);
  h->sequence = LoadLe<uint64_t>(in + 16);
  h->nbytes = LoadLe<uint64_t>(in + 24);
  return true;
}

// Whether two socket addresses name the same host and port.
bool SameEndpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr)) == 0;
  }
  return false;
}

// The connections of a formed context, as this process's descriptors. Gloo
// does not hand them out, so they are found by address: each pair listens
// on an address of its own and the side that accepts keeps it as its local
// end, while the side that connects has, as its remote end, the address
// the peer published for it in the formation's store (its key is the
// peer's rank; the entries skip the publisher's own rank).
std::vector<int> FindConnections(::gloo::Context& context, ::gloo::rendezvous::Store& view) {
  std::vector<sockaddr_storage> local;
  std::vector<sockaddr_storage> remote;
  for (int r = 0; r < context.size; ++r) {
    if (r == context.rank) continue;
    const auto* self =
        dynamic_cast<const ::gloo::transport::tcp::Address*>(&context.getPair(r)->address());
    if (self == nullptr) continue;
    local.push_back(self->getSockaddr());
    try {
      const std::vector<char> all = view.get(std::to_string(r));
      const size_t n = all.size() / static_cast<size_t>(context.size - 1);
      const size_t at = static_cast<size_t>(context.rank > r ? context.rank - 1 : context.rank);
      if (n == 0 || (at + 1) * n > all.size()) continue;
      const ::gloo::transport::tcp::Address peer(
          std::vector<char>(all.begin() + at * n, all.begin() + (at + 1) * n));
      remote.push_back(peer.getSockaddr());
    } catch (const std::exception&) {
      // The store no longer has it: that side's socket is not found.
    }
  }
  std::vector<int> found;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return found;
  while (const dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    sockaddr_storage mine = {};
    sockaddr_storage theirs = {};
    socklen_t n1 = sizeof(mine);
    socklen_t n2 = sizeof(theirs);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &n1) != 0) continue;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &n2) != 0) continue;
    const auto is = [](const std::vector<sockaddr_storage>& set, const sockaddr_storage& a) {
      return std::any_of(set.begin(), set.end(),
                         [&](const sockaddr_storage& b) { return SameEndpoint(a, b); });
    };
    if (is(local, mine) || is(remote, theirs)) found.push_back(fd);
  }
  closedir(d);
  return found;
}

// Writing to a socket whose peer has died raises SIGPIPE, whose default
// action ends the process: Gloo writes with plain writev and expects its
// user to ignore the signal (Python, say, does at startup). A process
// that handles SIGPIPE itself keeps its handler.
void IgnoreSigpipeOnce() {
  static const bool done = [] {
    struct sigaction old = {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
    return true;
  }();
  (void)done;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const CommunicatorOptions& options, uint64_t generation)
      : options_(options),
        generation_(generation),
        member_(DescribeMember(options.group, generation, options.rank, options.size)),
        sent_(options.size, 0),
        received_(options.size, 0) {}

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      stop_watchdog_ = true;
      watchdog_cv_.notify_all();
    }
    if (watchdog_.joinable()) watchdog_.join();
    ShutDownConnections();
    // The context's pairs refer to the device; the context goes first.
    context_.reset();
    for (int fd : connections_) ::close(fd);
    device_.reset();
  }

  std::string_view name() const override { return "gloo"; }
  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  uint64_t generation() const override { return generation_; }
  CommunicatorCapabilities capabilities() const override {
    CommunicatorCapabilities c;
    c.host_buffers = true;
    c.point_to_point = true;
    c.detects_dead_peer = true;
    c.checks_sizes = true;
    c.awaits_peer = true;
    c.cancels_in_flight = true;
    return c;
  }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  Status health() const override {
    if (!broken_.ok()) return broken_;
    std::lock_guard<std::mutex> lock(cancel_mu_);
    return cancelled_;
  }

  // Makes the connections to every other member, through `store`.
  Status Connect(RendezvousStore& store, const Deadline& deadline);

  Status Send(int peer, std::span<const uint8_t> data) override {
    return SendWaiting(peer, data, options_.timeout, "gloo send");
  }

  Status Recv(int peer, std::span<uint8_t> data) override {
    return RecvWaiting(peer, data, options_.timeout, "gloo recv");
  }

  Status SendAwaiting(int peer, std::span<const uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return SendWaiting(peer, data, wait.value_or(kNoBound), "gloo send");
  }

  Status RecvAwaiting(int peer, std::span<uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return RecvWaiting(peer, data, wait.value_or(kNoBound), "gloo recv");
  }

  void Cancel(std::string_view why) override {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    if (!cancelled_.ok()) return;
    cancelled_ = Status::Aborted("cancelled: " + std::string(why));
    if (waiting_ != nullptr) {
      if (waiting_recv_) {
        waiting_->abortWaitRecv();
      } else {
        waiting_->abortWaitSend();
      }
    }
  }

  Status Broadcast(int root, std::span<uint8_t> data) override {
    const std::string_view call = "gloo broadcast";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckRoot(call, size(), root));
    const Deadline deadline(options_.timeout);
    return TreeBroadcast(MessageOp::kBroadcast, root, data, deadline, call);
  }

  Status Barrier() override {
    const std::string_view call = "gloo barrier";
    DS_RETURN_IF_ERROR(Usable(call));
    const Deadline deadline(options_.timeout);
    DS_RETURN_IF_ERROR(GatherTo(MessageOp::kBarrier, 0, {}, {}, deadline, call));
    return TreeBroadcast(MessageOp::kBarrier, 0, {}, deadline, call);
  }

  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override {
    const std::string_view call = "gloo gather";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckRoot(call, size(), root));
    if (rank() == root) {
      DS_RETURN_IF_ERROR(CheckSize(call, "out", record.size() * size(), out.size()));
    }
    const Deadline deadline(options_.timeout);
    return GatherTo(MessageOp::kGather, root, record, out, deadline, call);
  }

  Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) override {
    const std::string_view call = "gloo all-gather";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckSize(call, "out", record.size() * size(), out.size()));
    const Deadline deadline(options_.timeout);
    DS_RETURN_IF_ERROR(GatherTo(MessageOp::kAllGather, 0, record, out, deadline, call));
    return TreeBroadcast(MessageOp::kAllGather, 0, out, deadline, call);
  }

 private:
  // One message to a peer: its header and payload, posted, until both are
  // sent. Destroying it withdraws whatever Gloo still has of it.
  struct Outgoing {
    int peer = -1;
    uint8_t header[kHeaderBytes] = {};
    std::unique_ptr<::gloo::transport::UnboundBuffer> header_buf;
    std::unique_ptr<::gloo::transport::UnboundBuffer> payload_buf;
  };
  // One message from a peer: the header posted first; the payload once the
  // header has been checked.
  struct Incoming {
    int peer = -1;
    uint8_t header[kHeaderBytes] = {};
    std::unique_ptr<::gloo::transport::UnboundBuffer> header_buf;
    std::unique_ptr<::gloo::transport::UnboundBuffer> payload_buf;
  };

  // Gloo's waits take a number of milliseconds, and any wait that runs out
  // closes every connection: "no bound" is a year.
  static constexpr std::chrono::milliseconds kNoBound{std::chrono::hours(24 * 365)};

  Status Usable(std::string_view call) {
    if (!broken_.ok()) return BrokenError(call, member_, broken_);
    Status cancelled;
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      cancelled = cancelled_;
    }
    if (!cancelled.ok()) {
      (void)Fail(cancelled);
      return BrokenError(call, member_, broken_);
    }
    return Status::OK();
  }

  // The header's wait is `first` (the peer coming to the exchange), the
  // payload's the timeout from when the header has gone.
  Status SendWaiting(int peer, std::span<const uint8_t> data, std::chrono::milliseconds first,
                     std::string_view call) {
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckPeer(call, size(), rank(), peer));
    Outgoing out;
    DS_RETURN_IF_ERROR(Post(&out, peer, MessageOp::kSend, 0, data, call));
    const Deadline opening(first);
    DS_RETURN_IF_ERROR(Await(out.header_buf.get(), false, opening, call, peer));
    const Deadline deadline(options_.timeout);
    if (out.payload_buf)
      DS_RETURN_IF_ERROR(Await(out.payload_buf.get(), false, deadline, call, peer));
    return Status::OK();
  }

  Status RecvWaiting(int peer, std::span<uint8_t> data, std::chrono::milliseconds first,
                     std::string_view call) {
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckPeer(call, size(), rank(), peer));
    Incoming in;
    DS_RETURN_IF_ERROR(PostHeader(&in, peer, call));
    DS_RETURN_IF_ERROR(Await(in.header_buf.get(), true, Deadline(first), call, peer));
    const Deadline deadline(options_.timeout);
    DS_RETURN_IF_ERROR(Accept(&in, MessageOp::kSend, 0, data, deadline, call));
    return FinishPayload(&in, deadline, call);
  }

  // Waits for `buf` (its receive when `recv`, else its send) until the
  // deadline, where Cancel can end the wait.
  //
  // A wait longer than kWatchSlice (a receiver waiting for the next sync)
  // is woken by the watchdog every slice, so that it also ends when the
  // communicator broke by other means than this buffer's own error (Gloo
  // does not hand a peer's lost connection to every kind of pending
  // operation), and otherwise goes on waiting.
  Status Await(::gloo::transport::UnboundBuffer* buf, bool recv, const Deadline& deadline,
               std::string_view call, int peer) {
    const bool watched = deadline.budget() > 2 * kWatchSlice;
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      if (!cancelled_.ok())
        return Fail(Status(cancelled_.code(), Where(call, peer) + cancelled_.message()));
      waiting_ = buf;
      waiting_recv_ = recv;
      waiting_watched_ = watched;
      if (watched) StartWatchdog();
    }
    bool done = true;
    Status failed;
    for (;;) {
      try {
        done = recv ? buf->waitRecv(nullptr, deadline.remaining())
                    : buf->waitSend(nullptr, deadline.remaining());
      } catch (const std::exception& e) {
        failed = Translate(e, call, peer, deadline);
      }
      if (done || !failed.ok()) break;
      std::lock_guard<std::mutex> lock(cancel_mu_);
      if (!cancelled_.ok()) break;
      if (!broken_.ok()) {
        failed = Status(broken_.code(), Where(call, peer) +
                                            "the communicator broke while it "
                                            "waited: " +
                                            broken_.message());
        break;
      }
      // The watchdog's wake-up: wait on.
    }
    Status cancelled;
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      waiting_ = nullptr;
      waiting_watched_ = false;
      cancelled = cancelled_;
    }
    if (!failed.ok()) return failed;
    if (!done) {
      return Fail(Status(StatusCode::kAborted,
                         Where(call, peer) + (cancelled.ok() ? "aborted" : cancelled.message())));
    }
    return Status::OK();
  }

  // Needs cancel_mu_. The watchdog wakes a watched wait every kWatchSlice.
  void StartWatchdog() {
    if (watchdog_.joinable()) return;
    watchdog_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(cancel_mu_);
      while (!stop_watchdog_) {
        watchdog_cv_.wait_for(lock, kWatchSlice);
        if (stop_watchdog_) break;
        if (waiting_ != nullptr && waiting_watched_) {
          if (waiting_recv_) {
            waiting_->abortWaitRecv();
          } else {
            waiting_->abortWaitSend();
          }
        }
      }
    });
  }

  std::string Where(std::string_view call, int peer) const {
    return std::string(call) + " (" + member_ + "): peer rank " + std::to_string(peer) + ": ";
  }

  // Records the first error and closes every connection, so that no byte
  // lands in a caller's buffer after the call returns and so that the
  // peers' pending and later calls fail at once.
  //
  // The connections are closed on a thread of their own, waited for a
  // little: Gloo's Pair::close holds the pair's lock while it waits for the
  // device's event loop to tick, and the loop may be waiting for that lock
  // to handle an event of the same pair (the peer closing it at the same
  // moment, as every member does when a group breaks at once). The waiting
  // call must not hang there; the thread keeps the context alive until the
  // close is done, and no byte reaches a caller's buffer after its call
  // returns either way (its Gloo buffers are gone, and Gloo writes through
  // them only while they live).
  Status Fail(Status status) {
    if (broken_.ok()) broken_ = status;
    ShutDownConnections();
    if (context_) {
      struct Closing {
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;
      };
      auto closing = std::make_shared<Closing>();
      std::thread([ctx = context_, closing] {
        try {
          ctx->closeConnections();
        } catch (const std::exception&) {
          // Already closed or failed: nothing more can arrive either way.
        }
        std::lock_guard<std::mutex> lock(closing->mu);
        closing->done = true;
        closing->cv.notify_all();
      }).detach();
      std::unique_lock<std::mutex> lock(closing->mu);
      closing->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return closing->done; });
    }
    return status;
  }

  // A Gloo exception from an operation with `peer`, as the Status the
  // file comment of communicator.h promises.
  Status Translate(const std::exception& e, std::string_view call, int peer,
                   const Deadline& deadline) {
    const std::string text = GlooErrorText(e.what());
    const std::string where =
        std::string(call) + " (" + member_ + "): peer rank " + std::to_string(peer) + ": ";
    if (dynamic_cast<const ::gloo::IoException*>(&e) != nullptr) {
      if (text.find("Timed out") != std::string::npos) {
        return Fail(Status::DeadlineExceeded(where + "no answer within " +
                                             std::to_string(deadline.budget().count()) + " ms"));
      }
      return Fail(Status::Unavailable(where + "connection lost (" + text + ")"));
    }
    return Fail(Status::Internal(where + "gloo failed: " + text));
  }

  Status Post(Outgoing* out, int peer, MessageOp op, int root, std::span<const uint8_t> data,
              std::string_view call) {
    out->peer = peer;
    Header h;
    h.op = static_cast<uint8_t>(op);
    h.root = static_cast<uint32_t>(root);
    h.sequence = sent_[peer]++;
    h.nbytes = data.size();
    EncodeHeader(h, out->header);
    try {
      out->header_buf = context_->createUnboundBuffer(out->header, kHeaderBytes);
      out->header_buf->send(peer, kMessageSlot);
      if (!data.empty()) {
        // Gloo's buffers are not const, but a send only reads.
        out->payload_buf =
            context_->createUnboundBuffer(const_cast<uint8_t*>(data.data()), data.size());
        out->payload_buf->send(peer, kMessageSlot);
      }
    } catch (const std::exception& e) {
      return Translate(e, call, peer, Deadline(options_.timeout));
    }
    return Status::OK();
  }

  Status Finish(Outgoing* out, const Deadline& deadline, std::string_view call) {
    DS_RETURN_IF_ERROR(Await(out->header_buf.get(), false, deadline, call, out->peer));
    if (out->payload_buf) {
      DS_RETURN_IF_ERROR(Await(out->payload_buf.get(), false, deadline, call, out->peer));
    }
    return Status::OK();
  }

  Status PostHeader(Incoming* in, int peer, std::string_view call) {
    in->peer = peer;
    try {
      in->header_buf = context_->createUnboundBuffer(in->header, kHeaderBytes);
      in->header_buf->recv(peer, kMessageSlot);
    } catch (const std::exception& e) {
      return Translate(e, call, peer, Deadline(options_.timeout));
    }
    return Status::OK();
  }

  // Waits for the header of `in`, checks it against what this rank's call
  // expects, and posts the payload's receive into `data`.
  Status Receive(Incoming* in, MessageOp op, int root, std::span<uint8_t> data,
                 const Deadline& deadline, std::string_view call) {
    DS_RETURN_IF_ERROR(Await(in->header_buf.get(), true, deadline, call, in->peer));
    return Accept(in, op, root, data, deadline, call);
  }

  // Checks the header of `in`, which has arrived, against what this rank's
  // call expects, and posts the payload's receive into `data`.
  Status Accept(Incoming* in, MessageOp op, int root, std::span<uint8_t> data,
                const Deadline& deadline, std::string_view call) {
    const int peer = in->peer;
    const std::string where =
        std::string(call) + " (" + member_ + "): peer rank " + std::to_string(peer) + " ";
    Header h;
    if (!DecodeHeader(in->header, &h)) {
      return Fail(Status::Corruption(where + "sent a message that is not a deltasync one"));
    }
    if (h.op != static_cast<uint8_t>(op)) {
      return Fail(Status::InvalidArgument(
          where + "sent a " + std::string(OpName(h.op)) + " message; this rank expects a " +
          std::string(OpName(static_cast<uint8_t>(op))) + " (the two ranks' calls differ)"));
    }
    if (op != MessageOp::kSend && h.root != static_cast<uint32_t>(root)) {
      return Fail(Status::InvalidArgument(where + "has root rank " + std::to_string(h.root) +
                                          "; this rank has root rank " + std::to_string(root)));
    }
    if (h.sequence != received_[peer]) {
      return Fail(Status::InvalidArgument(
          where + "sent its message " + std::to_string(h.sequence) + " to this rank; this rank " +
          "expects message " + std::to_string(received_[peer]) + " (the two ranks' calls differ)"));
    }
    if (h.nbytes != data.size()) {
      return Fail(Status::InvalidArgument(where + "sent " + std::to_string(h.nbytes) +
                                          " bytes; this rank expects " +
                                          std::to_string(data.size())));
    }
    ++received_[peer];
    if (data.empty()) return Status::OK();
    try {
      in->payload_buf = context_->createUnboundBuffer(data.data(), data.size());
      in->payload_buf->recv(peer, kMessageSlot);
    } catch (const std::exception& e) {
      return Translate(e, call, peer, deadline);
    }
    return Status::OK();
  }

  Status FinishPayload(Incoming* in, const Deadline& deadline, std::string_view call) {
    if (!in->payload_buf) return Status::OK();
    return Await(in->payload_buf.get(), true, deadline, call, in->peer);
  }

  // Along a binomial tree rooted at `root`: in virtual ranks (root is 0),
  // rank v receives from v with its lowest set bit cleared and then sends
  // to v + 2^k for every 2^k below that bit (below the group's size rounded
  // up to a power of two, for the root).
  Status TreeBroadcast(MessageOp op, int root, std::span<uint8_t> data, const Deadline& deadline,
                       std::string_view call) {
    const int n = size();
    if (n == 1) return Status::OK();
    const int vrank = (rank() - root + n) % n;
    int reach = 1;
    while (reach < n) reach *= 2;
    if (vrank != 0) {
      const int low = vrank & -vrank;
      const int parent = (vrank - low + root) % n;
      Incoming in;
      DS_RETURN_IF_ERROR(PostHeader(&in, parent, call));
      DS_RETURN_IF_ERROR(Receive(&in, op, root, data, deadline, call));
      DS_RETURN_IF_ERROR(FinishPayload(&in, deadline, call));
      reach = low;
    }
    // A deque: Gloo holds pointers into each posted message's header.
    std::deque<Outgoing> outs;
    for (int step = reach / 2; step >= 1; step /= 2) {
      if (vrank + step >= n) continue;
      outs.emplace_back();
      const int child = (vrank + step + root) % n;
      DS_RETURN_IF_ERROR(Post(&outs.back(), child, op, root, data, call));
    }
    for (Outgoing& out : outs) DS_RETURN_IF_ERROR(Finish(&out, deadline, call));
    return Status::OK();
  }

  // Every rank's `record` into `out` on root, in rank order. The root posts
  // every header receive at once and then takes the ranks in order.
  Status GatherTo(MessageOp op, int root, std::span<const uint8_t> record, std::span<uint8_t> out,
                  const Deadline& deadline, std::string_view call) {
    const int n = size();
    const size_t bytes = record.size();
    if (rank() != root) {
      Outgoing msg;
      DS_RETURN_IF_ERROR(Post(&msg, root, op, root, record, call));
      return Finish(&msg, deadline, call);
    }
    if (bytes > 0) std::memcpy(out.data() + root * bytes, record.data(), bytes);
    if (n == 1) return Status::OK();
    std::vector<Incoming> ins(n);
    for (int p = 0; p < n; ++p) {
      if (p != root) DS_RETURN_IF_ERROR(PostHeader(&ins[p], p, call));
    }
    for (int p = 0; p < n; ++p) {
      if (p == root) continue;
      DS_RETURN_IF_ERROR(Receive(&ins[p], op, root, out.subspan(p * bytes, bytes), deadline, call));
    }
    for (int p = 0; p < n; ++p) {
      if (p != root) DS_RETURN_IF_ERROR(FinishPayload(&ins[p], deadline, call));
    }
    return Status::OK();
  }

  const CommunicatorOptions options_;
  const uint64_t generation_;
  const std::string member_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;
  // Messages sent to and accepted from each peer so far: the sequence
  // numbers the next headers carry.
  std::vector<uint64_t> sent_;
  std::vector<uint64_t> received_;
  Status broken_;
  // Cancel's state: the error it set, and the buffer a call waits on.
  mutable std::mutex cancel_mu_;
  Status cancelled_;
  ::gloo::transport::UnboundBuffer* waiting_ = nullptr;
  bool waiting_recv_ = false;
  bool waiting_watched_ = false;
  // Copies of this member's connections (close-on-exec), found once the
  // group formed; shut down when the member leaves or fails.
  void HoldConnections(::gloo::rendezvous::Store& view) {
    for (int fd : FindConnections(*context_, view)) {
      // Gloo opens its sockets without close-on-exec: a process started
      // afterwards (a helper, a restarted peer a supervisor spawns) would
      // otherwise hold the connection open after this member is gone.
      // Both: Gloo's own descriptor gets the flag so that an exec'd child
      // does not inherit it, and the copy (close-on-exec too) is this
      // member's handle to shut the connection down at the end, which
      // Gloo's descriptor may no longer be by then (Gloo closes it).
      const int flags = fcntl(fd, F_GETFD);
      if (flags >= 0) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
      const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);
      if (copy >= 0) connections_.push_back(copy);
    }
  }
  // Ends every connection for the peers too, whoever else holds a copy of
  // its socket (a process forked without exec, say a data loader's worker,
  // or one started while the group was forming): closing this process's
  // descriptor alone would then send nothing, and a peer waiting as long
  // as a training step takes would never notice this member leave.
  void ShutDownConnections() {
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);
  }
  std::vector<int> connections_;

  // Wakes watched waits (Await); started at the first one.
  static constexpr std::chrono::milliseconds kWatchSlice{500};
  std::thread watchdog_;
  std::condition_variable watchdog_cv_;
  bool stop_watchdog_ = false;
};

Status GlooCommunicator::Connect(RendezvousStore& store, const Deadline& deadline) {
  const std::string where = "gloo: forming " + member_ + " through " + store.spec();
  IgnoreSigpipeOnce();
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = options_.hostname;
    device_ = ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return Status::Unavailable(where + ": cannot listen on \"" + options_.hostname +
                               "\": " + GlooErrorText(e.what()));
  }
  std::string waiting_for;
  auto view = store.GlooView(GenerationPrefix(options_.group, generation_), deadline, &waiting_for);
  try {
    context_ = std::make_shared<::gloo::rendezvous::Context>(rank(), size());
    // Bounds each connection's wait, which connectFullMesh makes per peer.
    // Gloo waits five times its timeout for a peer to connect to a pair it
    // listens on (tcp/pair.h, waitUntil): a member that published its
    // address and died would otherwise hold the formation five times the
    // connect timeout.
    context_->setTimeout(std::max(std::chrono::milliseconds(1), deadline.remaining() / 5));
    context_->connectFullMesh(*view, device_);
    HoldConnections(*view);
    context_->setTimeout(options_.timeout);
  } catch (const std::exception& e) {
    context_.reset();
    const std::string text = GlooErrorText(e.what());
    const std::optional<int> peer = RankOfMeshKey(waiting_for);
    const std::string who = peer ? "rank " + std::to_string(*peer) : "a member";
    if (text.find("Connect timeout") != std::string::npos) {
      return Status::DeadlineExceeded(where + ": " + who + " did not connect within " +
                                      std::to_string(deadline.budget().count()) + " ms");
    }
    if (text.find("Wait timeout") != std::string::npos) {
      return Status::DeadlineExceeded(where + ": " + who + " did not join within " +
                                      std::to_string(deadline.budget().count()) + " ms");
    }
    if (text.find(kFormationCancelled) != std::string::npos) {
      return Status::Aborted(where + ": the formation was cancelled");
    }
    if (const size_t at = text.find(kRefusedMarker); at != std::string::npos) {
      const std::string why = text.substr(at + std::strlen(kRefusedMarker));
      const bool sizes = why.find("the group sizes disagree") != std::string::npos;
      return Status(sizes ? StatusCode::kInvalidArgument : StatusCode::kUnavailable,
                    where + ": " + why);
    }
    return Status::Unavailable(where + ": connecting to " + who + ": " + text);
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const CommunicatorOptions& options) {
  const Deadline deadline(options.connect_timeout);
  DS_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> store,
                      RendezvousStore::Open(options.rendezvous, options.connect_timeout));
  DS_ASSIGN_OR_RETURN(uint64_t generation, JoinGeneration(*store, options, deadline));
  auto comm = std::make_unique<GlooCommunicator>(options, generation);
  if (options.size > 1) {
    if (Status s = comm->Connect(*store, deadline); !s.ok()) {
      AbandonGeneration(*store, options.group, generation,
                        "rank " + std::to_string(options.rank) + " gave up: " + s.message());
      return s;
    }
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace deltasync::stream_internal
