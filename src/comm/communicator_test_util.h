// Test helpers for the communicators: reference bytes, the collectives
// scenario every rank of a test group runs, groups formed in threads of
// one process, child processes, and a private redis-server.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/status.h"

extern char** environ;

namespace deltasync::comm_test {

// splitmix64: bytes a test can recompute on every rank, independent of
// anything under test.
inline std::vector<uint8_t> PatternBytes(uint64_t seed, size_t n) {
  std::vector<uint8_t> out(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    for (size_t j = 0; j < 8 && i + j < n; ++j) out[i + j] = static_cast<uint8_t>(z >> (8 * j));
  }
  return out;
}

// OK when `got` is PatternBytes(seed, got.size()); Corruption naming the
// first differing byte otherwise.
inline Status ExpectPattern(std::span<const uint8_t> got, uint64_t seed, const std::string& what) {
  const std::vector<uint8_t> want = PatternBytes(seed, got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return Status::Corruption(what + ": byte " + std::to_string(i) + " of " +
                                std::to_string(got.size()) + " is " + std::to_string(got[i]) +
                                ", expected " + std::to_string(want[i]));
    }
  }
  return Status::OK();
}

// The bytes rank `r`'s shard has in the sharded gather of the scenario
// below; rank 2's is empty, as a rank with no changes sends nothing.
inline uint64_t ShardBytes(int r) { return r == 2 ? 0 : 1000u * r + 17; }

// Every operation, as every rank of the group runs it, each result checked
// against PatternBytes. The first failure, naming the step, or OK.
inline Status RunCollectivesScenario(Communicator& c) {
  const int n = c.size();
  const int r = c.rank();
  const std::string me = "rank " + std::to_string(r) + ": ";
  DS_RETURN_IF_ERROR(c.Barrier().WithContext(me + "first barrier"));
  {
    // More than a socket buffer, an odd size, from the last rank (so the
    // tree is rooted away from rank 0).
    const int root = n - 1;
    const size_t bytes = (1u << 20) + 3;
    std::vector<uint8_t> buf = r == root ? PatternBytes(11, bytes) : std::vector<uint8_t>(bytes);
    DS_RETURN_IF_ERROR(c.Broadcast(root, buf).WithContext(me + "broadcast"));
    DS_RETURN_IF_ERROR(ExpectPattern(buf, 11, me + "broadcast from rank " + std::to_string(root)));
    std::vector<uint8_t> none;
    DS_RETURN_IF_ERROR(c.Broadcast(0, none).WithContext(me + "empty broadcast"));
  }
  {
    // The sharded gather: sizes first (Gather of u64 records), then each
    // shard point to point, the root taking the ranks in turn.
    uint8_t size_record[8];
    const uint64_t mine = ShardBytes(r);
    std::memcpy(size_record, &mine, 8);
    std::vector<uint8_t> sizes(r == 0 ? 8 * n : 0);
    DS_RETURN_IF_ERROR(c.Gather(0, size_record, sizes).WithContext(me + "gather of sizes"));
    if (r == 0) {
      for (int p = 1; p < n; ++p) {
        uint64_t s = 0;
        std::memcpy(&s, sizes.data() + 8 * p, 8);
        if (s != ShardBytes(p)) {
          return Status::Corruption(me + "rank " + std::to_string(p) + " reported " +
                                    std::to_string(s) + " bytes");
        }
        std::vector<uint8_t> shard(s);
        DS_RETURN_IF_ERROR(c.Recv(p, shard).WithContext(me + "recv of a shard"));
        DS_RETURN_IF_ERROR(
            ExpectPattern(shard, 100 + p, me + "shard of rank " + std::to_string(p)));
      }
    } else {
      const std::vector<uint8_t> shard = PatternBytes(100 + r, mine);
      DS_RETURN_IF_ERROR(c.Send(0, shard).WithContext(me + "send of a shard"));
    }
  }
  {
    const std::vector<uint8_t> record = PatternBytes(200 + r, 24);
    std::vector<uint8_t> all(24 * n);
    DS_RETURN_IF_ERROR(c.AllGather(record, all).WithContext(me + "all-gather"));
    for (int p = 0; p < n; ++p) {
      DS_RETURN_IF_ERROR(ExpectPattern(std::span(all).subspan(24 * p, 24), 200 + p,
                                       me + "all-gather record of rank " + std::to_string(p)));
    }
  }
  {
    const int root = n > 1 ? 1 : 0;
    const std::vector<uint8_t> record = PatternBytes(300 + r, 8);
    std::vector<uint8_t> out(r == root ? 8 * n : 0);
    DS_RETURN_IF_ERROR(c.Gather(root, record, out).WithContext(me + "gather to rank 1"));
    for (int p = 0; r == root && p < n; ++p) {
      DS_RETURN_IF_ERROR(ExpectPattern(std::span(out).subspan(8 * p, 8), 300 + p,
                                       me + "gathered record of rank " + std::to_string(p)));
    }
  }
  if (n >= 3) {
    // Point to point away from rank 0, both ways.
    std::vector<uint8_t> buf(4096);
    if (r == 1) {
      DS_RETURN_IF_ERROR(c.Send(2, PatternBytes(401, 4096)).WithContext(me + "send to rank 2"));
      DS_RETURN_IF_ERROR(c.Recv(2, buf).WithContext(me + "recv from rank 2"));
      DS_RETURN_IF_ERROR(ExpectPattern(buf, 402, me + "reply of rank 2"));
    } else if (r == 2) {
      DS_RETURN_IF_ERROR(c.Recv(1, buf).WithContext(me + "recv from rank 1"));
      DS_RETURN_IF_ERROR(ExpectPattern(buf, 401, me + "message of rank 1"));
      DS_RETURN_IF_ERROR(c.Send(1, PatternBytes(402, 4096)).WithContext(me + "send to rank 1"));
    }
  }
  return c.Barrier().WithContext(me + "last barrier");
}

// The broadcast content of the re-forming scenario: a flag byte (1: more
// rounds follow, 0: the last), the round's seed, then PatternBytes(seed).
inline constexpr size_t kRoundBytes = 4096;
inline std::vector<uint8_t> RoundBytes(bool more, uint64_t seed) {
  std::vector<uint8_t> out = PatternBytes(seed, kRoundBytes);
  out[0] = more ? 1 : 0;
  std::memcpy(out.data() + 1, &seed, 8);
  return out;
}
// OK when `got` is a round's content; sets *more.
inline Status CheckRound(std::span<const uint8_t> got, bool* more) {
  if (got.size() != kRoundBytes || got[0] > 1) return Status::Corruption("round: bad flag");
  uint64_t seed = 0;
  std::memcpy(&seed, got.data() + 1, 8);
  const std::vector<uint8_t> want = PatternBytes(seed, kRoundBytes);
  if (!std::equal(got.begin() + 9, got.end(), want.begin() + 9)) {
    return Status::Corruption("round " + std::to_string(seed) + ": bytes differ");
  }
  *more = got[0] == 1;
  return Status::OK();
}

// A fresh directory, removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ds_comm_XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A TCP port on 127.0.0.1 nobody listens on right now (the kernel's pick
// for an ephemeral bind), or 0.
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

inline bool CanConnect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// Starts `argv` as a child process (posix_spawn: nothing of this process's
// threads runs in the child). Returns its pid, or -1.
inline pid_t Spawn(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ) != 0) return -1;
  return pid;
}

// How a child ended: its exit code, or 128 + the signal that ended it;
// nullopt (after killing it) when it is still running after `limit`.
inline std::optional<int> WaitExit(pid_t pid, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    }
    if (r < 0) return std::nullopt;
    if (std::chrono::steady_clock::now() >= end) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Child processes that are killed and reaped at the end if they have not
// been waited for, so that a test that fails early leaves none behind.
class Children {
 public:
  ~Children() {
    for (pid_t& p : pids_) {
      if (p > 0) {
        kill(p, SIGKILL);
        int status = 0;
        waitpid(p, &status, 0);
      }
    }
  }
  // Starts `argv`; its index, or -1.
  int Spawn(const std::vector<std::string>& argv) {
    const pid_t pid = comm_test::Spawn(argv);
    if (pid <= 0) return -1;
    pids_.push_back(pid);
    return static_cast<int>(pids_.size()) - 1;
  }
  // Replaces child `i` (already waited for) with a new process.
  bool Respawn(int i, const std::vector<std::string>& argv) {
    pids_[i] = comm_test::Spawn(argv);
    return pids_[i] > 0;
  }
  void Kill(int i) { kill(pids_[i], SIGKILL); }
  // As WaitExit; the child is reaped either way.
  std::optional<int> Wait(int i, std::chrono::milliseconds limit) {
    if (pids_[i] <= 0) return std::nullopt;
    const std::optional<int> code = WaitExit(pids_[i], limit);
    pids_[i] = -1;
    return code;
  }
  // Every child's Wait, in order.
  std::vector<std::optional<int>> WaitAll(std::chrono::milliseconds limit) {
    std::vector<std::optional<int>> out;
    for (size_t i = 0; i < pids_.size(); ++i) out.push_back(Wait(static_cast<int>(i), limit));
    return out;
  }

 private:
  std::vector<pid_t> pids_;
};

// A redis-server of this test's own on a free port, stopped at the end.
class RedisServer {
 public:
  // The server, or nullptr with *why saying what is missing.
  // `extra`: more arguments to the server ("--requirepass", "pw").
  static std::unique_ptr<RedisServer> Start(std::string* why,
                                            const std::vector<std::string>& extra = {}) {
    const char* candidates[] = {"/usr/bin/redis-server", "/usr/local/bin/redis-server"};
    std::string binary;
    for (const char* c : candidates) {
      if (access(c, X_OK) == 0) binary = c;
    }
    if (binary.empty()) {
      *why = "redis-server is not installed (scripts/install-deps installs it)";
      return nullptr;
    }
    for (int attempt = 0; attempt < 3; ++attempt) {
      const int port = FreePort();
      if (port == 0) continue;
      auto server = std::unique_ptr<RedisServer>(new RedisServer);
      server->port_ = port;
      std::vector<std::string> argv = {binary,
                                       "--port",
                                       std::to_string(port),
                                       "--bind",
                                       "127.0.0.1",
                                       "--save",
                                       "",
                                       "--appendonly",
                                       "no",
                                       "--daemonize",
                                       "no",
                                       "--loglevel",
                                       "warning",
                                       "--dir",
                                       server->dir_.path(),
                                       "--logfile",
                                       server->dir_.path() + "/redis.log"};
      argv.insert(argv.end(), extra.begin(), extra.end());
      server->pid_ = Spawn(argv);
      if (server->pid_ < 0) break;
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (std::chrono::steady_clock::now() < end) {
        if (CanConnect(port)) return server;
        int status = 0;
        if (waitpid(server->pid_, &status, WNOHANG) == server->pid_) {
          server->pid_ = -1;  // exited (the port was taken): try another
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    *why = "redis-server did not start";
    return nullptr;
  }

  ~RedisServer() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      if (!WaitExit(pid_, std::chrono::seconds(5))) kill(pid_, SIGKILL);
    }
  }

  int port() const { return port_; }
  Rendezvous rendezvous() const {
    Rendezvous r;
    r.kind = Rendezvous::Kind::kRedis;
    r.host = "127.0.0.1";
    r.port = port_;
    return r;
  }

 private:
  RedisServer() = default;
  TempDir dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

// Options for rank `rank` of a loopback group.
inline CommunicatorOptions LoopbackOptions(const Rendezvous& where, int rank, int size,
                                           std::chrono::milliseconds timeout,
                                           std::string group = "test") {
  CommunicatorOptions o;
  o.rank = rank;
  o.size = size;
  o.rendezvous = where;
  o.group = std::move(group);
  o.timeout = timeout;
  o.connect_timeout = std::chrono::milliseconds(10000);
  o.hostname = "127.0.0.1";
  return o;
}

inline Rendezvous FileRendezvous(const std::string& dir) {
  Rendezvous r;
  r.kind = Rendezvous::Kind::kFile;
  r.path = dir;
  return r;
}

// Runs fn(rank) on one thread per rank at once; the results in rank order.
inline std::vector<Status> OnEveryRank(int n, const std::function<Status(int)>& fn) {
  std::vector<Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
  for (std::thread& t : threads) t.join();
  return out;
}

// A gloo group of `n` members formed in threads of this process.
inline std::vector<std::unique_ptr<Communicator>> FormInThreads(
    int n, const std::function<CommunicatorOptions(int)>& options, std::vector<Status>* errors) {
  std::vector<std::unique_ptr<Communicator>> comms(n);
  *errors = OnEveryRank(n, [&](int r) {
    Result<std::unique_ptr<Communicator>> c = CreateCommunicator("gloo", options(r));
    if (!c.ok()) return c.status();
    comms[r] = std::move(c).value();
    return Status::OK();
  });
  return comms;
}

}  // namespace deltasync::comm_test
