// The rendezvous stores (Gloo's FileStore and RedisStore) behind Status,
// with waits that end at a deadline, and the generation protocol that lets
// a group be formed again (include/deltasync/communicator.h, "Forming and
// re-forming a group"; the keys are in docs/format.md, "Rendezvous
// keys"). Built with Gloo; the nccl communicator uses it too.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator_internal.h"
#include "deltasync/communicator.h"
#include "deltasync/status.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace deltasync::stream_internal {

// One connection to a store. Not thread-safe. Gloo's exceptions stop here:
// every method returns a Status.
class RendezvousStore {
 public:
  // Opens the store `where` names: a file store's directory is created if
  // missing; a redis connection is made with `io_timeout` as its connect
  // and command timeout. Unavailable naming the store when it cannot be
  // reached; Unsupported for redis when Gloo was built without it.
  static Result<std::unique_ptr<RendezvousStore>> Open(const Rendezvous& where,
                                                       std::chrono::milliseconds io_timeout);
  ~RendezvousStore();
  RendezvousStore(const RendezvousStore&) = delete;
  RendezvousStore& operator=(const RendezvousStore&) = delete;

  // "file:<dir>" or "redis:<host>:<port>", for messages.
  const std::string& spec() const { return spec_; }

  // Writes `key` once. AlreadyExists when it is there already (keys are
  // never overwritten); `value` must not be empty (Gloo's FileStore reads
  // an empty value as an error).
  Status Set(const std::string& key, std::span<const char> value);
  Result<bool> Exists(const std::string& key);
  // Waits until `key` exists, polling, up to the deadline: DeadlineExceeded
  // naming the key then.
  Status Wait(const std::string& key, const Deadline& deadline);
  // Wait, then the value.
  Result<std::vector<char>> Get(const std::string& key, const Deadline& deadline);

  // A Gloo store for rendezvous::Context::connectFullMesh: Gloo's
  // PrefixStore (keys under "<prefix>/") over a view of this store whose
  // gets and waits all end at `deadline` (where Gloo's own stores wait 30 s
  // whatever the context's timeout), throwing Gloo's IoException then, as
  // Gloo's stores do. Each key it waits for is written to *waiting_for
  // first, so that a failure can name the member it waited for. Lives no
  // longer than this store.
  std::unique_ptr<gloo::rendezvous::Store> GlooView(std::string prefix, const Deadline& deadline,
                                                    std::string* waiting_for);

  // The store behind this object (the view's target).
  struct Backend;

 private:
  RendezvousStore(std::string spec, std::unique_ptr<Backend> backend);

  std::string spec_;
  std::unique_ptr<Backend> backend_;
};

// What a GlooView's wait throws with (then the refusal's text) when a
// member gave up on the formation (AbandonGeneration).
inline constexpr const char* kRefusedMarker = "a member gave up on this formation: ";

// Marks generation `g` of `group` as given up by this member, saying why
// (the first member to give up writes it): the members still waiting in
// it stop at once (a GlooView's waits throw kRefusedMarker and the text),
// and members that join later pass it by for the next one. A formation
// that failed for one member fails for all, so this spares them waiting
// out their connect timeout. Best effort: a store error is ignored.
void AbandonGeneration(RendezvousStore& store, const std::string& group, uint64_t g,
                       const std::string& why);

// "<group>/<generation>": the prefix of one formation's keys.
std::string GenerationPrefix(const std::string& group, uint64_t generation);

// The generation this rank forms its group under, its join marker written:
// options.generation when set (AlreadyExists when this rank joined it
// before: a generation is formed once), otherwise the automatic protocol,
// led by rank 0. DeadlineExceeded when rank 0 announces no generation this
// rank can join before the deadline.
Result<uint64_t> JoinGeneration(RendezvousStore& store, const CommunicatorOptions& options,
                                const Deadline& deadline);

// A Gloo exception's text without the "[file:line] " Gloo puts in front.
std::string GlooErrorText(std::string_view what);

// The rank a Gloo connectFullMesh key names ("<prefix>/rank_3" or
// "<prefix>/3" -> 3), or nullopt; for naming the member a formation
// waited for.
std::optional<int> RankOfMeshKey(const std::string& key);

}  // namespace deltasync::stream_internal
