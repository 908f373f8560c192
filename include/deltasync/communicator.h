// Communicators: the collective libraries the online stream runs over,
// behind one small interface chosen by name.
//
//   gloo  host memory, over TCP (Gloo's tcp transport). Every message carries
//         a header (docs/format.md, "Communicators"), so a size or call
//         mismatch between two ranks is an error that names both sides, and
//         a peer that dies is noticed as soon as its connection drops. It
//         makes the process ignore SIGPIPE (unless the process handles it
//         itself): Gloo writes to sockets with writev, and a write to a dead
//         peer's socket would otherwise end the process.
//   nccl  CUDA device memory, through NCCL; host memory too, staged through
//         a device buffer the communicator allocates at its first host call
//         (up to 64 MiB; a copy in before each NCCL call and out after it).
//         Built only when CUDA and NCCL are found (and Gloo, whose stores
//         carry NCCL's unique id). NCCL refuses two ranks of one group on
//         one GPU.
//
// A group is `size` processes with one Communicator each, which find each
// other in a rendezvous store (Gloo's FileStore on a directory every member
// sees, or its RedisStore on a redis-server) under a group name.
//
// Every operation is bounded by the communicator's timeout: a peer that dies
// (kill -9) or stops answering makes the call fail, never hang:
//   Unavailable        the connection to the peer was lost (gloo mostly
//                      notices a dead peer at once; when it has not seen
//                      the connection drop before the call, the call ends
//                      at its timeout instead), or a store cannot be reached;
//   DeadlineExceeded   nothing came within the timeout.
// Both name the operation and, where the library says which one, the peer
// rank ("peer rank 2"); nccl cannot say which member of a collective failed.
//
// Errors break the communicator. A bad argument found before anything is
// sent (a rank out of range, a span of the wrong size: InvalidArgument)
// leaves it usable. Any other failure, a mismatch with the peer's call
// found on the wire included (InvalidArgument too, naming both sides),
// closes the communicator's connections, so that its peers' calls fail at
// once as well instead of waiting for their timeouts, and every later call
// returns FailedPrecondition naming the first error. Nothing is written into
// a caller's buffer after the failing call returns. The way on is to form the
// group again (below).
//
// Forming and re-forming a group. The stores keep every key forever and
// refuse to overwrite one, so each formation of a group uses its own keys,
// under the prefix "<group>/<generation>/", and a group that lost a member is
// formed again under a new generation by every member, the restarted one
// included: each creates a new Communicator with the same options. The
// generation is either
//   - automatic (CommunicatorOptions::generation unset), led by rank 0:
//     rank 0 takes the generation after the highest one announced in the
//     store and announces it ("<group>/generation/<g>"); every other rank
//     joins the highest announced generation unless it joined that one
//     before, and then (a survivor, or a restart that comes before rank 0
//     has re-formed) waits for rank 0 to announce the next one. A restarted
//     member and the survivors therefore meet in the generation rank 0
//     opens when it re-forms, in whatever order they come, as long as rank 0
//     forms again after a failure (its own next call with the dead member
//     fails; with gloo the survivors' fail at once too, because rank 0
//     closed its connections; with nccl at their timeout). A rank that came
//     too late for a generation retries.
//   - or explicit: the caller chooses it (an orchestrator's restart count,
//     say), and every member passes the same value. A group uses one way or
//     the other, never both.
// A store directory (or a redis database) therefore grows by a few keys per
// formation; use a fresh one, or a fresh group name, per run, because a
// member that finds a previous run's keys may join its stale generation (and
// fail, and retry).
//
// A Communicator is used by one thread at a time, but for Cancel, which any
// thread may call while another is in a call. Send blocks until the peer
// has posted the matching Recv, so two ranks that both Send to each other
// first wait for each other until the timeout: order exchanges (the sharded
// gather exchanges sizes with Gather first, then the root Recvs from each
// rank in turn).
//
// Waiting for a peer that comes late by design. The timeout bounds a peer
// that has gone silent inside an exchange. A message that opens an exchange
// the peer takes part in only much later (a rollout worker waiting for the
// trainer's next sync while the trainer trains for minutes) is not such a
// peer: SendAwaiting and RecvAwaiting wait for it as long as the caller
// says, and bound only the rest of the message by the timeout. A peer that
// dies while they wait still fails them at once where the communicator
// detects dead peers.
#pragma once

#include <algorithm>
#include <array>
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

#include "deltasync/status.h"

namespace deltasync {

// What a communicator can do; ask before relying on it.
struct CommunicatorCapabilities {
  bool host_buffers = false;    // buffers may be host memory
  bool device_buffers = false;  // buffers may be CUDA device memory
  int cuda_device = -1;         // of this CUDA device (with device_buffers)
  bool point_to_point = false;  // Send and Recv are available
  // A peer that dies makes the call fail with Unavailable naming it as soon
  // as its connection drops; without this only the timeout notices.
  bool detects_dead_peer = false;
  // The byte counts two ranks pass to one operation are compared: a mismatch
  // is an error naming both counts. Without this a mismatch is undefined (in
  // practice a timeout or wrong bytes), so the caller must agree sizes first.
  bool checks_sizes = false;
  // SendAwaiting and RecvAwaiting wait for the peer as long as they are
  // asked to; without this they are Send and Recv, bounded by the timeout.
  bool awaits_peer = false;
  // Cancel ends a call in flight at once; without this the call ends by
  // itself (at the latest at its timeout) and only later calls fail.
  bool cancels_in_flight = false;
};

// Where the members of a group find each other.
struct Rendezvous {
  enum class Kind : uint8_t {
    kFile = 0,   // Gloo's FileStore: a directory every member sees
    kRedis = 1,  // Gloo's RedisStore: a redis-server every member reaches
  };
  Kind kind = Kind::kFile;
  // kFile: the directory. Created if missing, readable and writable by
  // this user only (0700); an existing one is used as it is.
  std::string path;
  std::string host;  // kRedis
  int port = 6379;   // kRedis
  // kRedis: the server's password (AUTH), when it asks for one. Never part
  // of a spec (specs show on command lines and in logs): read it from a
  // file with ReadSecretFile, or leave it empty to take the environment's
  // DELTASYNC_REDIS_PASSWORD when that is set.
  std::string password;
};

// "file:<directory>", "file://<directory>" (a file URL: file:///abs/dir),
// "redis:<host>[:<port>]" or "redis://<host>[:<port>]" (the port defaults
// to 6379; an IPv6 host in brackets). InvalidArgument naming the spec and
// the accepted forms otherwise, and for a password in the spec.
Result<Rendezvous> ParseRendezvous(std::string_view spec);

// The spec ParseRendezvous reads back to the same Rendezvous (but for the
// password, which no spec holds).
std::string RendezvousSpec(const Rendezvous& rendezvous);

// The contents of a file holding a secret (a Redis password, a stream
// key), without one trailing newline. Refuses, naming the file, one that
// other users may read or write (mode & 077: chmod 600 it) or that is
// empty; NotFound or IOError when it cannot be read.
Result<std::string> ReadSecretFile(const std::string& path);

// Authenticated mode (docs/format.md, "Authenticated messages"): every
// message of the group carries a BLAKE3 tag under a key every member holds,
// bound to its place in the group's traffic, so that a process without the
// key cannot make a member take a message, and no message is taken twice.
struct AuthKey {
  std::array<uint8_t, 32> bytes{};
};

// The key from a shared secret of at least 16 bytes (InvalidArgument for a
// shorter one).
Result<AuthKey> DeriveAuthKey(std::string_view secret);

// The key the environment gives: DELTASYNC_STREAM_KEY_FILE names a file
// (ReadSecretFile: only its owner may read it) or DELTASYNC_STREAM_KEY
// holds the secret itself; nullopt when neither is set. The errors of
// ReadSecretFile and DeriveAuthKey.
Result<std::optional<AuthKey>> AuthKeyFromEnvironment();

struct CommunicatorOptions {
  int rank = 0;  // this process, 0 <= rank < size
  int size = 1;  // members of the group
  Rendezvous rendezvous;
  // Names the group in the store; several groups may share one store. Not
  // empty, and no '/' (it is the first component of every key).
  std::string group = "deltasync";
  // Unset: automatic, led by rank 0 (see "Forming and re-forming a group").
  std::optional<uint64_t> generation;
  // Bounds every operation, from the call to its return.
  std::chrono::milliseconds timeout{30000};
  // Bounds waiting in the store for the other members while forming; a
  // member that dies while the connections are being made can add up to
  // this much again for each such member.
  std::chrono::milliseconds connect_timeout{60000};
  // gloo: the address this process accepts its peers' connections on
  // ("127.0.0.1" for a group on one host). Empty: this host's name, as the
  // resolver answers it.
  std::string hostname;
  // nccl: the CUDA device this rank uses.
  int cuda_device = 0;
  // Set: the member is authenticated (AuthenticateCommunicator), and
  // every member of the group must set the same key.
  std::optional<AuthKey> auth_key;
};

// One member of a formed group. Buffers are spans of bytes in the memory
// the capabilities allow (device memory for nccl: the span is never
// dereferenced on the host). A span's size is the exact byte count of the
// operation. Every call fails with InvalidArgument, before anything is sent,
// for a rank out of range or a span of the wrong size, and otherwise as the
// file comment says (Unavailable, DeadlineExceeded, FailedPrecondition once
// broken).
class Communicator {
 public:
  virtual ~Communicator() = default;

  // "gloo", "nccl", or a wrapper's name around its inner one's.
  virtual std::string_view name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The generation this group was formed under.
  virtual uint64_t generation() const = 0;
  virtual CommunicatorCapabilities capabilities() const = 0;
  // The bound of every operation.
  virtual std::chrono::milliseconds timeout() const = 0;
  // OK while usable; the first error that broke it afterwards.
  virtual Status health() const = 0;

  // Sends data.size() bytes to `peer` (not this rank), which calls
  // Recv(this rank) with a span of the same size. Returns once the bytes
  // have left (the peer has posted its Recv); `data` may be reused then.
  virtual Status Send(int peer, std::span<const uint8_t> data) = 0;
  // Receives exactly data.size() bytes from `peer` into `data`. gloo: a
  // message of another size is an error naming both sizes, and `data` is
  // left untouched.
  virtual Status Recv(int peer, std::span<uint8_t> data) = 0;
  // Every rank passes a span of the same size; on return every rank's span
  // holds root's bytes (root's is not written). gloo sends along a binomial
  // tree, so root sends about log2(size) copies.
  virtual Status Broadcast(int root, std::span<uint8_t> data) = 0;
  // Returns on any rank only once every rank has called it.
  virtual Status Barrier() = 0;
  // Every rank contributes a record of the same size; `out` (size() *
  // record.size() bytes) receives every rank's record in rank order, on
  // root only: other ranks' `out` is ignored (it may be empty). For small
  // records (status reports, sizes): the root receives them one rank after
  // another.
  virtual Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) = 0;
  // Gather to every rank: each rank's `out` is size() * record.size() bytes.
  virtual Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) = 0;

  // Send and Recv of a message that opens an exchange the peer may come to
  // long after this rank does (see "Waiting for a peer that comes late by
  // design"): the wait for the peer to take part is `wait` (nullopt: no
  // bound) instead of the timeout; once the message has begun to move, the
  // rest is bounded by the timeout. Running out of `wait` is
  // DeadlineExceeded and breaks the communicator as any timeout does.
  // Without capabilities().awaits_peer these are Send and Recv.
  virtual Status SendAwaiting(int peer, std::span<const uint8_t> data,
                              std::optional<std::chrono::milliseconds> wait) {
    (void)wait;
    return Send(peer, data);
  }
  virtual Status RecvAwaiting(int peer, std::span<uint8_t> data,
                              std::optional<std::chrono::milliseconds> wait) {
    (void)wait;
    return Recv(peer, data);
  }

  // Called with each chunk of a Relay once it is in host memory, in order,
  // on the calling thread: the receiver checks the bytes as they come (a
  // running checksum) instead of in a pass of its own afterwards.
  using ChunkTaken = std::function<void(std::span<const uint8_t>)>;

  // Takes `data` from `from` as consecutive messages of at most `chunk`
  // bytes (the last holding the rest) and, when `to` >= 0, sends each on to
  // `to` as soon as it has it: one link of a chain that passes a message
  // down a row of ranks. `taken` (may be empty) sees each chunk after it
  // is passed on. This default passes a chunk on before it takes the next;
  // a communicator may take the next while it passes one on.
  virtual Status Relay(int from, int to, std::span<uint8_t> data, size_t chunk,
                       const ChunkTaken& taken) {
    if (chunk == 0) return Status::InvalidArgument("relay: a chunk of 0 bytes");
    for (size_t at = 0; at < data.size(); at += chunk) {
      const std::span<uint8_t> part = data.subspan(at, std::min(chunk, data.size() - at));
      if (Status s = Recv(from, part); !s.ok()) return s;
      if (to >= 0) {
        if (Status s = Send(to, part); !s.ok()) return s;
      }
      if (taken) taken(part);
    }
    return Status::OK();
  }

  // Thread-safe; the one method another thread may call while a call is in
  // flight. Breaks the communicator with Aborted naming `why`: a call in
  // flight returns with that error (at once with
  // capabilities().cancels_in_flight; otherwise when it ends by itself, at
  // the latest at its timeout), and every later call fails. Idempotent.
  virtual void Cancel(std::string_view why) = 0;
};

// Forms this rank's member of the group `options` describes with the
// communicator called `name`, waiting for the other members up to
// options.connect_timeout. InvalidArgument for bad options or a name that
// is no communicator (naming the known ones); Unsupported for a known one
// this build lacks (naming what was built); Unavailable when the store or a
// peer cannot be reached; DeadlineExceeded naming a member that did not
// come (the lowest rank that did not, where the store tells).
Result<std::unique_ptr<Communicator>> CreateCommunicator(std::string_view name,
                                                         const CommunicatorOptions& options);

// Wraps `inner`, a formed member of the group named `group`, in the
// authenticated mode: every member of the group wraps its own, with the
// same key, right after forming (the wrap makes the session with an
// all-gather bounded by inner's timeout). The wrapper's messages carry
// tags; one whose tag does not verify fails its call with Corruption and
// breaks the communicator. It takes host memory only (the tags are
// computed on the host). The all-gather's errors, naming the group.
Result<std::unique_ptr<Communicator>> AuthenticateCommunicator(std::unique_ptr<Communicator> inner,
                                                               const AuthKey& key,
                                                               std::string_view group);

// The communicators this build holds, e.g. {"gloo", "nccl"}; may be empty.
std::vector<std::string_view> BuiltCommunicators();

// Every communicator name CreateCommunicator knows, built or not.
std::vector<std::string_view> KnownCommunicators();

}  // namespace deltasync
