#include "deltasync/communicator.h"

#include <charconv>
#include <string>
#include <vector>

#include "stream/communicator_internal.h"

namespace deltasync {

namespace stream_internal {

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
                                   " (expected file:<directory> or redis:<host>[:<port>])");
  };
  Rendezvous r;
  if (spec.starts_with(kFilePrefix)) {
    r.kind = Rendezvous::Kind::kFile;
    r.path = std::string(spec.substr(kFilePrefix.size()));
    if (r.path.empty()) return bad("no directory");
    return r;
  }
  if (spec.starts_with(kRedisPrefix)) {
    r.kind = Rendezvous::Kind::kRedis;
    std::string_view rest = spec.substr(kRedisPrefix.size());
    const size_t colon = rest.rfind(':');
    if (colon != std::string_view::npos) {
      std::string_view port = rest.substr(colon + 1);
      int value = 0;
      auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
      if (ec != std::errc() || end != port.data() + port.size() || value <= 0 || value > 65535) {
        return bad("port \"" + std::string(port) + "\" is not a number in 1..65535");
      }
      r.port = value;
      rest = rest.substr(0, colon);
    }
    if (rest.empty()) return bad("no host");
    r.host = std::string(rest);
    return r;
  }
  return bad("unknown kind");
}

std::string RendezvousSpec(const Rendezvous& r) {
  if (r.kind == Rendezvous::Kind::kRedis) {
    return std::string(kRedisPrefix) + r.host + ":" + std::to_string(r.port);
  }
  return std::string(kFilePrefix) + r.path;
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
#if DS_HAVE_GLOO
  if (name == "gloo") return stream_internal::CreateGlooCommunicator(options);
#endif
#if DS_HAVE_NCCL
  if (name == "nccl") return stream_internal::CreateNcclCommunicator(options);
#endif
  std::string needs =
      name == "nccl" ? "CUDA, NCCL and Gloo (DELTASYNC_WITH_NCCL)" : "Gloo (DELTASYNC_WITH_GLOO)";
  return Status::Unsupported("communicator \"" + std::string(name) +
                             "\" is not in this build (built: " + JoinNames(BuiltCommunicators()) +
                             "; it needs " + needs + " at configure time)");
}

}  // namespace deltasync
