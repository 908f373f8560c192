// The rendezvous stores and the generation protocol (communicator_rendezvous.h).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <system_error>
#include <thread>
#include <utility>

#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#if GLOO_USE_REDIS && DS_HAVE_HIREDIS
#define DS_GLOO_REDIS 1
#define HIREDIS_NESTED_INCLUDE
#include <gloo/rendezvous/redis_store.h>
#else
#define DS_GLOO_REDIS 0
#endif

#include "comm/communicator_rendezvous.h"

namespace deltasync::stream_internal {

namespace {

// How often a wait looks at the store again. A formation takes a few
// waits, so 5 ms costs nothing and keeps a group on one host quick to form.
constexpr auto kPollInterval = std::chrono::milliseconds(5);

// Runs `f`, turning whatever it throws into a Status with `code`.
template <typename F>
Status Guarded(StatusCode code, const std::string& what, F&& f) {
  try {
    f();
    return Status::OK();
  } catch (const std::exception& e) {  // Gloo's IoException and EnforceNotMet among them
    return Status(code, what + ": " + GlooErrorText(e.what()));
  }
}

// Gloo's FileStore with its existence check reachable.
class FileStoreWithCheck final : public ::gloo::rendezvous::FileStore {
 public:
  using FileStore::FileStore;
  bool Has(const std::string& key) { return check({key}); }
};

#if DS_GLOO_REDIS
// Sends AUTH with `password` on `c`; the error's text, or empty. The
// password never appears in it.
std::string Authenticate(redisContext* c, const std::string& password) {
  auto* reply = static_cast<redisReply*>(
      redisCommand(c, "AUTH %b", password.data(), static_cast<size_t>(password.size())));
  if (reply == nullptr) return std::string("sending AUTH: ") + c->errstr;
  std::string error;
  if (reply->type == REDIS_REPLY_ERROR) {
    error = "the server refused the password (" + std::string(reply->str, reply->len) + ")";
  }
  freeReplyObject(reply);
  return error;
}

// Gloo's RedisStore, with a command timeout: hiredis otherwise blocks for
// ever on a server that stopped answering.
class RedisStoreWithTimeout final : public ::gloo::rendezvous::RedisStore {
 public:
  RedisStoreWithTimeout(const std::string& host, int port, std::chrono::milliseconds timeout,
                        const std::string& password)
      : RedisStore(host, port) {
    struct timeval tv = {};
    tv.tv_sec = timeout.count() / 1000;
    tv.tv_usec = (timeout.count() % 1000) * 1000;
    if (redisSetTimeout(redis_, tv) != REDIS_OK) {
      GLOO_THROW_IO_EXCEPTION("setting the command timeout: ", redis_->errstr);
    }
    if (!password.empty()) {
      const std::string error = Authenticate(redis_, password);
      if (!error.empty()) GLOO_THROW_IO_EXCEPTION(error);
    }
  }
  bool Has(const std::string& key) { return check({key}); }
};
#endif

}  // namespace

// The store proper, and the code its failures are reported with (a file
// store's are the file system's: IOError; a server's: Unavailable).
struct RendezvousStore::Backend {
  virtual ~Backend() = default;
  virtual ::gloo::rendezvous::Store& store() = 0;
  // May throw, as Gloo's stores do.
  virtual bool Has(const std::string& key) = 0;
  StatusCode failure = StatusCode::kIOError;
};

namespace {

class FileBackend final : public RendezvousStore::Backend {
 public:
  explicit FileBackend(const std::string& dir) : store_(dir) {}
  ::gloo::rendezvous::Store& store() override { return store_; }
  bool Has(const std::string& key) override { return store_.Has(key); }

 private:
  FileStoreWithCheck store_;
};

#if DS_GLOO_REDIS
// Connects once, within `timeout`, and hangs up. Gloo's RedisStore connects
// with no bound and, when the server cannot be reached, throws without
// freeing its hiredis context; probing first gives a bounded, leak-free
// Unavailable for the common case of a server that is down or misnamed.
// The probe also tries the password (or its absence) with a PING, so that
// a server that wants one, or refuses the one given, is said so plainly.
Status ProbeRedis(const std::string& host, int port, std::chrono::milliseconds timeout,
                  const std::string& password) {
  struct timeval tv = {};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  redisContext* probe = redisConnectWithTimeout(host.c_str(), port, tv);
  if (probe == nullptr) return Status::Unavailable("cannot allocate a connection");
  std::string error = probe->err != 0 ? "cannot connect: " + std::string(probe->errstr) : "";
  StatusCode code = StatusCode::kUnavailable;
  if (error.empty() && redisSetTimeout(probe, tv) != REDIS_OK) {
    error = "setting the command timeout: " + std::string(probe->errstr);
  }
  if (error.empty() && !password.empty()) {
    error = Authenticate(probe, password);
    if (!error.empty()) code = StatusCode::kInvalidArgument;
  }
  if (error.empty()) {
    auto* reply = static_cast<redisReply*>(redisCommand(probe, "PING"));
    if (reply == nullptr) {
      error = "no answer to PING: " + std::string(probe->errstr);
    } else {
      if (reply->type == REDIS_REPLY_ERROR) {
        const std::string text(reply->str, reply->len);
        code = StatusCode::kInvalidArgument;
        error = text.starts_with("NOAUTH")
                    ? "the server asks for a password (give it as the rendezvous password: a "
                      "file, or DELTASYNC_REDIS_PASSWORD)"
                    : "PING refused: " + text;
      }
      freeReplyObject(reply);
    }
  }
  redisFree(probe);
  if (!error.empty()) return Status(code, error);
  return Status::OK();
}

class RedisBackend final : public RendezvousStore::Backend {
 public:
  RedisBackend(const std::string& host, int port, std::chrono::milliseconds timeout,
               const std::string& password)
      : store_(host, port, timeout, password) {
    failure = StatusCode::kUnavailable;
  }
  ::gloo::rendezvous::Store& store() override { return store_; }
  bool Has(const std::string& key) override { return store_.Has(key); }

 private:
  RedisStoreWithTimeout store_;
};
#endif

// The store connectFullMesh sees: every wait bounded by one deadline.
// connectFullMesh waits for each peer's key with the context's timeout in
// turn, and gets others through waits of Gloo's default 30 s, so without
// this a formation could take a multiple of any single bound.
class DeadlineView final : public ::gloo::rendezvous::Store {
 public:
  DeadlineView(RendezvousStore::Backend& backend, const Deadline& deadline,
               std::string* waiting_for, std::string refusal_key)
      : backend_(backend),
        deadline_(deadline),
        waiting_for_(waiting_for),
        refusal_key_(std::move(refusal_key)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    backend_.store().set(key, data);
  }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    return backend_.store().get(key);
  }

  void wait(const std::vector<std::string>& keys) override { WaitAll(keys); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    WaitAll(keys);
  }

 private:
  void WaitAll(const std::vector<std::string>& keys) {
    for (const std::string& key : keys) {
      if (waiting_for_ != nullptr) *waiting_for_ = key;
      while (!backend_.Has(key)) {
        if (deadline_.expired()) {
          GLOO_THROW_IO_EXCEPTION("Wait timeout for key ", key);
        }
        if (!FormationCancel::Check("rendezvous").ok()) {
          GLOO_THROW_IO_EXCEPTION(kFormationCancelled, key);
        }
        // A member that refused this formation will never come.
        if (!refusal_key_.empty() && backend_.Has(refusal_key_)) {
          const std::vector<char> why = backend_.store().get(refusal_key_);
          GLOO_THROW_IO_EXCEPTION(kRefusedMarker, std::string(why.begin(), why.end()));
        }
        std::this_thread::sleep_for(kPollInterval);
      }
    }
  }

  RendezvousStore::Backend& backend_;
  const Deadline deadline_;
  std::string* const waiting_for_;
  const std::string refusal_key_;
};

// Gloo's PrefixStore over a DeadlineView it owns (the view is a base so
// that it is built before the PrefixStore that refers to it).
struct DeadlineViewHolder {
  DeadlineViewHolder(RendezvousStore::Backend& backend, const Deadline& deadline,
                     std::string* waiting_for, std::string refusal_key)
      : view(backend, deadline, waiting_for, std::move(refusal_key)) {}
  DeadlineView view;
};

class PrefixedDeadlineView final : private DeadlineViewHolder,
                                   public ::gloo::rendezvous::PrefixStore {
 public:
  PrefixedDeadlineView(RendezvousStore::Backend& backend, const std::string& prefix,
                       const Deadline& deadline, std::string* waiting_for)
      : DeadlineViewHolder(backend, deadline, waiting_for, prefix + "/refused"),
        PrefixStore(prefix, view) {}
};

std::string GenerationKey(const std::string& group, uint64_t g) {
  return group + "/generation/" + std::to_string(g);
}

std::string JoinedKey(const std::string& group, uint64_t g, int rank) {
  return GenerationPrefix(group, g) + "/joined/" + std::to_string(rank);
}

// "<host>:<pid> size <n>": who wrote a marker, for whoever reads the
// store, and the group size it formed with.
std::vector<char> MarkerValue(int size) {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '?';
  const std::string text =
      std::string(host) + ":" + std::to_string(getpid()) + " size " + std::to_string(size);
  return std::vector<char>(text.begin(), text.end());
}

// The group size a value ending in " size <n>" names (an announcement, a
// marker), or nullopt for a value without one.
std::optional<int> SizeIn(const std::vector<char>& value) {
  const std::string text(value.begin(), value.end());
  const size_t at = text.rfind(" size ");
  if (at == std::string::npos) return std::nullopt;
  int n = 0;
  const char* first = text.data() + at + 6;
  const char* last = text.data() + text.size();
  auto [end, ec] = std::from_chars(first, last, n);
  if (ec != std::errc() || end != last) return std::nullopt;
  return n;
}

std::string RefusalKey(const std::string& group, uint64_t g) {
  return GenerationPrefix(group, g) + "/refused";
}

// Checks this member's group size against the one rank 0 formed
// generation `g` with (`value`: its announcement or its marker). On a
// mismatch, writes the generation's refusal key (so that rank 0 stops
// waiting for this member, naming both sizes) and fails naming both.
Status CheckSize(RendezvousStore& store, const CommunicatorOptions& options, uint64_t g,
                 const std::vector<char>& value, const std::string& who) {
  const std::optional<int> theirs = SizeIn(value);
  if (!theirs || *theirs == options.size) return Status::OK();
  const std::string why = "the group sizes disagree: rank " + std::to_string(options.rank) +
                          " was started with a group of " + std::to_string(options.size) +
                          " members, rank 0 with " + std::to_string(*theirs) +
                          " (every member passes the same size)";
  AbandonGeneration(store, options.group, g, why);
  return Status::InvalidArgument(who + ": generation " + std::to_string(g) + ": " + why);
}

// The highest generation announced in `group`, or nullopt for none.
// Announcements are contiguous from 0 (rank 0 announces the one after the
// highest), so a doubling search then a bisection finds it in O(log g)
// lookups. `hint` is a generation known to be announced.
Result<std::optional<uint64_t>> HighestAnnounced(RendezvousStore& store, const std::string& group,
                                                 std::optional<uint64_t> hint) {
  uint64_t lo = 0;  // announced
  if (hint) {
    lo = *hint;
  } else {
    DS_ASSIGN_OR_RETURN(bool any, store.Exists(GenerationKey(group, 0)));
    if (!any) return std::optional<uint64_t>();
  }
  uint64_t step = 1;
  uint64_t hi = lo + step;  // probed: not announced once the loop ends
  for (;;) {
    DS_ASSIGN_OR_RETURN(bool there, store.Exists(GenerationKey(group, hi)));
    if (!there) break;
    lo = hi;
    step *= 2;
    hi = lo + step;
  }
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    DS_ASSIGN_OR_RETURN(bool there, store.Exists(GenerationKey(group, mid)));
    (there ? lo : hi) = mid;
  }
  return std::optional<uint64_t>(lo);
}

}  // namespace

void AbandonGeneration(RendezvousStore& store, const std::string& group, uint64_t g,
                       const std::string& why) {
  (void)store.Set(RefusalKey(group, g), std::span<const char>(why.data(), why.size()));
}

std::string GlooErrorText(std::string_view what) {
  if (what.starts_with("[")) {
    const size_t end = what.find("] ");
    if (end != std::string_view::npos) what.remove_prefix(end + 2);
  }
  return std::string(what);
}

std::string GenerationPrefix(const std::string& group, uint64_t generation) {
  return group + "/" + std::to_string(generation);
}

std::optional<int> RankOfMeshKey(const std::string& key) {
  std::string_view digits = key;
  const size_t slash = digits.rfind('/');
  if (slash != std::string_view::npos) digits.remove_prefix(slash + 1);
  if (digits.starts_with("rank_")) digits.remove_prefix(5);
  int rank = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) {
    return std::nullopt;
  }
  return rank;
}

RendezvousStore::RendezvousStore(std::string spec, std::unique_ptr<Backend> backend)
    : spec_(std::move(spec)), backend_(std::move(backend)) {}

RendezvousStore::~RendezvousStore() = default;

Result<std::unique_ptr<RendezvousStore>> RendezvousStore::Open(
    const Rendezvous& where, std::chrono::milliseconds io_timeout) {
  const std::string spec = RendezvousSpec(where);
  std::unique_ptr<Backend> backend;
  if (where.kind == Rendezvous::Kind::kFile) {
    // Only this user may read or write a directory made here: whoever can
    // write into it can claim a rank.
    std::error_code ec;
    std::string path = where.path;
    while (path.size() > 1 && path.ends_with("/")) path.pop_back();
    const std::filesystem::path dir(path);
    if (!std::filesystem::exists(dir, ec)) {
      if (dir.has_parent_path()) std::filesystem::create_directories(dir.parent_path(), ec);
      if (!ec && ::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
        ec = std::error_code(errno, std::generic_category());
      }
    }
    if (ec) {
      return Status::IOError("rendezvous " + spec + ": creating the directory: " + ec.message());
    }
    DS_RETURN_IF_ERROR(Guarded(StatusCode::kIOError, "rendezvous " + spec,
                               [&] { backend = std::make_unique<FileBackend>(where.path); }));
  } else {
#if DS_GLOO_REDIS
    std::string password = where.password;
    if (password.empty()) {
      if (const char* env = std::getenv("DELTASYNC_REDIS_PASSWORD")) password = env;
    }
    if (Status probe = ProbeRedis(where.host, where.port, io_timeout, password); !probe.ok()) {
      return Status(probe.code(), "rendezvous " + spec + ": " + probe.message());
    }
    DS_RETURN_IF_ERROR(Guarded(StatusCode::kUnavailable, "rendezvous " + spec, [&] {
      backend = std::make_unique<RedisBackend>(where.host, where.port, io_timeout, password);
    }));
#else
    (void)io_timeout;
    return Status::Unsupported("rendezvous " + spec +
                               ": this build's Gloo has no RedisStore (built without hiredis)");
#endif
  }
  return std::unique_ptr<RendezvousStore>(new RendezvousStore(spec, std::move(backend)));
}

Status RendezvousStore::Set(const std::string& key, std::span<const char> value) {
  DS_ASSIGN_OR_RETURN(bool there, Exists(key));
  if (there) {
    return Status::AlreadyExists("rendezvous " + spec_ + ": key " + key + " is already set");
  }
  const std::vector<char> data(value.begin(), value.end());
  return Guarded(backend_->failure, "rendezvous " + spec_ + ": setting " + key,
                 [&] { backend_->store().set(key, data); });
}

Result<bool> RendezvousStore::Exists(const std::string& key) {
  bool there = false;
  DS_RETURN_IF_ERROR(Guarded(backend_->failure, "rendezvous " + spec_ + ": looking up " + key,
                             [&] { there = backend_->Has(key); }));
  return there;
}

Status RendezvousStore::Wait(const std::string& key, const Deadline& deadline) {
  for (;;) {
    DS_ASSIGN_OR_RETURN(bool there, Exists(key));
    if (there) return Status::OK();
    DS_RETURN_IF_ERROR(FormationCancel::Check("rendezvous " + spec_ + ": waiting for " + key));
    if (deadline.expired()) {
      return Status::DeadlineExceeded("rendezvous " + spec_ + ": key " + key + " not set within " +
                                      std::to_string(deadline.budget().count()) + " ms");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

Result<std::vector<char>> RendezvousStore::Get(const std::string& key, const Deadline& deadline) {
  DS_RETURN_IF_ERROR(Wait(key, deadline));
  std::vector<char> value;
  DS_RETURN_IF_ERROR(Guarded(backend_->failure, "rendezvous " + spec_ + ": reading " + key,
                             [&] { value = backend_->store().get(key); }));
  return value;
}

std::unique_ptr<::gloo::rendezvous::Store> RendezvousStore::GlooView(std::string prefix,
                                                                     const Deadline& deadline,
                                                                     std::string* waiting_for) {
  return std::make_unique<PrefixedDeadlineView>(*backend_, prefix, deadline, waiting_for);
}

Result<uint64_t> JoinGeneration(RendezvousStore& store, const CommunicatorOptions& options,
                                const Deadline& deadline) {
  const std::string& group = options.group;
  const std::vector<char> marker = MarkerValue(options.size);
  const std::string who = "rendezvous " + store.spec() + ": group \"" + group + "\" rank " +
                          std::to_string(options.rank);
  if (options.generation) {
    const uint64_t g = *options.generation;
    Status s = store.Set(JoinedKey(group, g, options.rank), marker);
    if (s.code() == StatusCode::kAlreadyExists) {
      return Status::AlreadyExists(who + " already joined generation " + std::to_string(g) +
                                   " (a generation is formed once: pass a new one)");
    }
    DS_RETURN_IF_ERROR(s);
    if (options.rank != 0) {
      // Rank 0's marker says the size it forms with.
      DS_ASSIGN_OR_RETURN(std::vector<char> zero, store.Get(JoinedKey(group, g, 0), deadline));
      DS_RETURN_IF_ERROR(CheckSize(store, options, g, zero, who));
    }
    return g;
  }

  if (options.rank == 0) {
    // The generation after the highest announced; another rank 0 racing
    // for it (a misconfiguration) only makes this one take the next.
    std::optional<uint64_t> hint;
    for (;;) {
      DS_ASSIGN_OR_RETURN(std::optional<uint64_t> highest, HighestAnnounced(store, group, hint));
      const uint64_t g = highest ? *highest + 1 : 0;
      const std::string text = std::to_string(g) + " size " + std::to_string(options.size);
      Status s =
          store.Set(GenerationKey(group, g), std::span<const char>(text.data(), text.size()));
      if (s.ok()) {
        DS_RETURN_IF_ERROR(store.Set(JoinedKey(group, g, 0), marker));
        return g;
      }
      if (s.code() != StatusCode::kAlreadyExists) return s;
      DS_RETURN_IF_ERROR(FormationCancel::Check(who));
      if (deadline.expired()) {
        return Status::DeadlineExceeded(who + ": could not announce a generation within " +
                                        std::to_string(deadline.budget().count()) + " ms");
      }
      hint = g;
    }
  }

  std::optional<uint64_t> hint;
  for (;;) {
    DS_ASSIGN_OR_RETURN(std::optional<uint64_t> highest, HighestAnnounced(store, group, hint));
    if (highest) {
      hint = highest;
      const std::string joined = JoinedKey(group, *highest, options.rank);
      DS_ASSIGN_OR_RETURN(bool already, store.Exists(joined));
      if (!already) {
        // A generation some member gave up on will never form.
        DS_ASSIGN_OR_RETURN(already, store.Exists(RefusalKey(group, *highest)));
      }
      if (!already) {
        DS_ASSIGN_OR_RETURN(std::vector<char> announced,
                            store.Get(GenerationKey(group, *highest), deadline));
        DS_RETURN_IF_ERROR(CheckSize(store, options, *highest, announced, who));
        Status s = store.Set(joined, marker);
        if (s.ok()) return *highest;
        if (s.code() != StatusCode::kAlreadyExists) return s;
      }
    }
    DS_RETURN_IF_ERROR(FormationCancel::Check(who));
    if (deadline.expired()) {
      return Status::DeadlineExceeded(
          who + ": rank 0 announced no generation to join " +
          (highest ? "after " + std::to_string(*highest) : std::string("at all")) + " within " +
          std::to_string(deadline.budget().count()) + " ms");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace deltasync::stream_internal
