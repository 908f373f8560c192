#include "deltasync/communicator.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator_internal.h"

namespace deltasync {

namespace stream_internal {

namespace {
thread_local const std::atomic<bool>* formation_cancel = nullptr;
}  // namespace

FormationCancel::FormationCancel(const std::atomic<bool>* flag) : previous_(formation_cancel) {
  formation_cancel = flag;
}

FormationCancel::~FormationCancel() { formation_cancel = previous_; }

Status FormationCancel::Check(std::string_view where) {
  if (formation_cancel == nullptr || !formation_cancel->load()) return Status::OK();
  return Status::Aborted(std::string(where) + ": the formation was cancelled");
}

std::chrono::milliseconds Deadline::remaining() const {
  const auto left = end_ - Clock::now();
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left);
  return ms < std::chrono::milliseconds(1) ? std::chrono::milliseconds(1) : ms;
}

Status ValidateOptions(std::string_view name, const CommunicatorOptions& o) {
  const std::string who(name);
  if (o.size < 1) {
    return Status::InvalidArgument(who + ": group size " + std::to_string(o.size) +
                                   " (must be at least 1)");
  }
  if (o.rank < 0 || o.rank >= o.size) {
    return Status::InvalidArgument(who + ": rank " + std::to_string(o.rank) +
                                   " is outside the group of " + std::to_string(o.size) +
                                   " (0 <= rank < size)");
  }
  if (o.group.empty() || o.group.find('/') != std::string::npos) {
    return Status::InvalidArgument(who + ": group name \"" + o.group +
                                   "\" must be non-empty and hold no '/'");
  }
  if (o.timeout.count() <= 0 || o.connect_timeout.count() <= 0) {
    return Status::InvalidArgument(who + ": timeouts must be positive (timeout " +
                                   std::to_string(o.timeout.count()) + " ms, connect_timeout " +
                                   std::to_string(o.connect_timeout.count()) + " ms)");
  }
  const Rendezvous& r = o.rendezvous;
  if (r.kind == Rendezvous::Kind::kFile) {
    if (r.path.empty()) {
      return Status::InvalidArgument(who + ": file rendezvous without a directory");
    }
  } else if (r.kind == Rendezvous::Kind::kRedis) {
    if (r.host.empty() || r.port <= 0 || r.port > 65535) {
      return Status::InvalidArgument(who +
                                     ": redis rendezvous needs a host and a port in "
                                     "1..65535 (got \"" +
                                     r.host + "\" port " + std::to_string(r.port) + ")");
    }
  } else {
    return Status::InvalidArgument(who + ": unknown rendezvous kind " +
                                   std::to_string(static_cast<int>(r.kind)));
  }
  return Status::OK();
}

std::string DescribeMember(std::string_view group, uint64_t generation, int rank, int size) {
  std::string out = "group \"";
  out += group;
  out += "\" generation " + std::to_string(generation) + ", rank " + std::to_string(rank) + " of " +
         std::to_string(size);
  return out;
}

Status CheckPeer(std::string_view call, int size, int rank, int peer) {
  if (peer < 0 || peer >= size) {
    return Status::InvalidArgument(std::string(call) + ": peer rank " + std::to_string(peer) +
                                   " is outside the group of " + std::to_string(size));
  }
  if (peer == rank) {
    return Status::InvalidArgument(std::string(call) + ": peer rank " + std::to_string(peer) +
                                   " is this rank");
  }
  return Status::OK();
}

Status CheckRoot(std::string_view call, int size, int root) {
  if (root < 0 || root >= size) {
    return Status::InvalidArgument(std::string(call) + ": root rank " + std::to_string(root) +
                                   " is outside the group of " + std::to_string(size));
  }
  return Status::OK();
}

Status CheckSize(std::string_view call, std::string_view what, size_t expected, size_t actual) {
  if (expected != actual) {
    return Status::InvalidArgument(std::string(call) + ": " + std::string(what) + " is " +
                                   std::to_string(actual) + " bytes, expected " +
                                   std::to_string(expected));
  }
  return Status::OK();
}

Status BrokenError(std::string_view call, std::string_view member, const Status& cause) {
  return Status::FailedPrecondition(std::string(call) + " (" + std::string(member) +
                                    "): the communicator is broken by an earlier error (" +
                                    cause.ToString() + "); form the group again");
}

}  // namespace stream_internal

namespace {

constexpr std::string_view kFilePrefix = "file:";
constexpr std::string_view kRedisPrefix = "redis:";

std::string JoinNames(const std::vector<std::string_view>& names) {
  if (names.empty()) return "none";
  std::string out;
  for (std::string_view n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

}  // namespace

Result<Rendezvous> ParseRendezvous(std::string_view spec) {
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument("rendezvous \"" + std::string(spec) + "\": " + std::string(why) +
                                   " (expected file:<directory>, file://<directory>, "
                                   "redis:<host>[:<port>] or redis://<host>[:<port>])");
  };
  Rendezvous r;
  if (spec.starts_with(kFilePrefix)) {
    r.kind = Rendezvous::Kind::kFile;
    std::string_view path = spec.substr(kFilePrefix.size());
    if (path.starts_with("//")) {
      // A file URL: file:///abs/dir, or file://localhost/abs/dir.
      path.remove_prefix(2);
      if (path.starts_with("localhost/")) path.remove_prefix(9);
      if (!path.starts_with("/")) return bad("a file URL names a host other than this one");
    }
    if (path.empty()) return bad("no directory");
    r.path = std::string(path);
    return r;
  }
  if (spec.starts_with(kRedisPrefix)) {
    r.kind = Rendezvous::Kind::kRedis;
    std::string_view rest = spec.substr(kRedisPrefix.size());
    if (rest.starts_with("//")) {
      rest.remove_prefix(2);
      if (rest.ends_with("/")) rest.remove_suffix(1);
      if (rest.find('/') != std::string_view::npos) {
        return bad("a path or database after the port is not supported");
      }
    }
    if (rest.find('@') != std::string_view::npos) {
      return bad(
          "a password in the spec would show on command lines and in logs: give it as "
          "Rendezvous::password (a file, or DELTASYNC_REDIS_PASSWORD) instead");
    }
    std::string_view host = rest;
    std::string_view port;
    if (rest.starts_with("[")) {  // [v6 address]
      const size_t close = rest.find(']');
      if (close == std::string_view::npos) return bad("an unclosed '[' in the host");
      host = rest.substr(1, close - 1);
      std::string_view after = rest.substr(close + 1);
      if (!after.empty()) {
        if (!after.starts_with(":")) return bad("text after the host's ']'");
        port = after.substr(1);
        if (port.empty()) return bad("an empty port");
      }
    } else if (const size_t colon = rest.rfind(':'); colon != std::string_view::npos) {
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
      if (port.empty()) return bad("an empty port");
    }
    if (!port.empty()) {
      int value = 0;
      auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
      if (ec != std::errc() || end != port.data() + port.size() || value <= 0 || value > 65535) {
        return bad("port \"" + std::string(port) + "\" is not a number in 1..65535");
      }
      r.port = value;
    }
    if (host.empty()) return bad("no host");
    if (host.find(':') != std::string_view::npos && !rest.starts_with("[")) {
      return bad("an IPv6 host goes in brackets: redis://[::1]:6379");
    }
    r.host = std::string(host);
    return r;
  }
  return bad("unknown kind");
}

std::string RendezvousSpec(const Rendezvous& r) {
  if (r.kind == Rendezvous::Kind::kRedis) {
    const bool v6 = r.host.find(':') != std::string::npos;
    return std::string(kRedisPrefix) + (v6 ? "[" + r.host + "]" : r.host) + ":" +
           std::to_string(r.port);
  }
  return std::string(kFilePrefix) + r.path;
}

Result<std::string> ReadSecretFile(const std::string& path) {
  const std::string what = "secret file " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::NotFound(what + ": no such file");
    return Status::IOError(what + ": " + std::strerror(err));
  }
  struct stat st = {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(what + ": not a regular file");
  }
  if ((st.st_mode & 077) != 0) {
    ::close(fd);
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::InvalidArgument(what + ": other users may read or write it (mode " + mode +
                                   "); chmod 600 it");
  }
  constexpr size_t kMaxSecretBytes = 1 << 16;
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return Status::IOError(what + ": " + std::strerror(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > kMaxSecretBytes) {
      ::close(fd);
      return Status::InvalidArgument(what + ": over 64 KiB, not a secret");
    }
  }
  ::close(fd);
  if (out.ends_with("\r\n")) {
    out.resize(out.size() - 2);
  } else if (out.ends_with("\n")) {
    out.pop_back();
  }
  if (out.empty()) return Status::InvalidArgument(what + ": empty");
  return out;
}

std::vector<std::string_view> BuiltCommunicators() {
  std::vector<std::string_view> names;
#if DS_HAVE_GLOO
  names.push_back("gloo");
#endif
#if DS_HAVE_NCCL
  names.push_back("nccl");
#endif
  return names;
}

std::vector<std::string_view> KnownCommunicators() { return {"gloo", "nccl"}; }

Result<std::unique_ptr<Communicator>> CreateCommunicator(std::string_view name,
                                                         const CommunicatorOptions& options) {
  bool known = false;
  for (std::string_view k : KnownCommunicators()) known = known || k == name;
  if (!known) {
    return Status::InvalidArgument("unknown communicator \"" + std::string(name) +
                                   "\" (known: " + JoinNames(KnownCommunicators()) +
                                   "; built: " + JoinNames(BuiltCommunicators()) + ")");
  }
  DS_RETURN_IF_ERROR(stream_internal::ValidateOptions(name, options));
  std::optional<Result<std::unique_ptr<Communicator>>> made;
#if DS_HAVE_GLOO
  if (name == "gloo") made = stream_internal::CreateGlooCommunicator(options);
#endif
#if DS_HAVE_NCCL
  if (name == "nccl") made = stream_internal::CreateNcclCommunicator(options);
#endif
  if (made) {
    if (!made->ok() || !options.auth_key) return std::move(*made);
    return AuthenticateCommunicator(std::move(**made), *options.auth_key, options.group);
  }
  std::string needs =
      name == "nccl" ? "CUDA, NCCL and Gloo (DELTASYNC_WITH_NCCL)" : "Gloo (DELTASYNC_WITH_GLOO)";
  return Status::Unsupported("communicator \"" + std::string(name) +
                             "\" is not in this build (built: " + JoinNames(BuiltCommunicators()) +
                             "; it needs " + needs + " at configure time)");
}

}  // namespace deltasync
