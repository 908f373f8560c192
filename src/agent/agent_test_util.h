// Fakes shared by the agent module's tests.
#pragma once

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "deltasync/agent.h"

namespace deltasync::testing_agent {

// Sends `request` as is on a fresh loopback connection to `port`; returns
// everything read until the server closes it (or `timeout_seconds` pass
// without data).
inline std::string RawHttpRequest(int port, const std::string& request, int timeout_seconds) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  timeval tv{timeout_seconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size())) {
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// A loopback connection the test writes and reads at its own pace (a slow
// client, a client that stops half way).
class RawConnection {
 public:
  explicit RawConnection(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    connected_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return connected_; }
  // Sends all of `bytes` (blocking); false once the connection is broken.
  bool Send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }
  // Tells the peer nothing more will come (it reads end of file).
  void ShutdownWrite() { ::shutdown(fd_, SHUT_WR); }
  // Reads until the peer closes or `seconds` pass.
  std::string ReadFor(double seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    std::string out;
    char buf[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      timeval tv{static_cast<time_t>(left.count() / 1000000),
                 static_cast<suseconds_t>(left.count() % 1000000)};
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  int fd_;
  bool connected_ = false;
};

// The JSON body of a raw HTTP response (after the blank line), or null.
inline nlohmann::json ResponseJson(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  if (at == std::string::npos) return nullptr;
  return nlohmann::json::parse(response.substr(at + 4), nullptr, /*allow_exceptions=*/false);
}

// What a FakePuller did and will do; the test keeps a handle after the
// puller moves into the Agent.
struct FakeCheckpoint {
  std::mutex mu;
  int64_t store_latest = 3;
  std::optional<int64_t> current;
  std::vector<std::optional<int64_t>> pull_targets;  // every Pull call, in order
  int verify_calls = 0;
  Status next_pull_error;  // returned (once) by the next Pull when not OK
  Status verify_error;
  Status latest_error;
  std::chrono::milliseconds pull_delay{0};
  // Set while a Pull runs; lets a test wait until one is in flight.
  std::atomic<int> pulls_in_flight{0};
  std::atomic<int> max_pulls_in_flight{0};
  std::string local = "/nonexistent/fake-local";
  // The nice value of the thread that ran the last Pull / LatestVersion.
  std::atomic<int> pull_thread_nice{-100};
  std::atomic<int> latest_thread_nice{-100};

  size_t pull_count() {
    std::lock_guard<std::mutex> lock(mu);
    return pull_targets.size();
  }
};

class FakePuller final : public CheckpointPuller {
 public:
  explicit FakePuller(std::shared_ptr<FakeCheckpoint> state) : s_(std::move(state)) {}

  static int ThisThreadNice() { return ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid())); }

  Result<PullResult> Pull(std::optional<int64_t> target) override {
    s_->pull_thread_nice = ThisThreadNice();
    const int now = ++s_->pulls_in_flight;
    int seen = s_->max_pulls_in_flight.load();
    while (now > seen && !s_->max_pulls_in_flight.compare_exchange_weak(seen, now)) {
    }
    std::chrono::milliseconds delay;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      delay = s_->pull_delay;
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    std::lock_guard<std::mutex> lock(s_->mu);
    --s_->pulls_in_flight;
    s_->pull_targets.push_back(target);
    if (!s_->next_pull_error.ok()) {
      Status error = s_->next_pull_error;
      s_->next_pull_error = Status::OK();
      return error;
    }
    PullResult r;
    r.from_version = s_->current;
    r.version = target.value_or(s_->store_latest);
    r.applied = s_->current != r.version;
    r.bytes_read = r.applied ? 1000 + static_cast<uint64_t>(r.version) : 0;
    r.tensors_changed = r.applied ? 2 : 0;
    r.changed_elements = r.applied ? 17 : 0;
    if (r.applied) r.versions_applied.push_back(r.version);
    r.seconds = 0.001;
    s_->current = r.version;
    return r;
  }
  Result<std::optional<int64_t>> CurrentVersion() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->current;
  }
  Result<int64_t> LatestVersion() override {
    s_->latest_thread_nice = ThisThreadNice();
    std::lock_guard<std::mutex> lock(s_->mu);
    if (!s_->latest_error.ok()) return s_->latest_error;
    return s_->store_latest;
  }
  Status Verify() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    ++s_->verify_calls;
    return s_->verify_error;
  }
  const std::string& local() const override { return s_->local; }

 private:
  std::shared_ptr<FakeCheckpoint> s_;
};

struct FakeReload {
  std::mutex mu;
  std::vector<std::pair<std::string, int64_t>> calls;
  Status result;
};

class FakeReloader final : public EngineReloader {
 public:
  explicit FakeReloader(std::shared_ptr<FakeReload> state) : s_(std::move(state)) {}
  Status Reload(const std::string& model_path, int64_t version) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->calls.emplace_back(model_path, version);
    return s_->result;
  }
  std::string Describe() const override { return "fake reloader"; }

 private:
  std::shared_ptr<FakeReload> s_;
};

// An httplib server on 127.0.0.1, an ephemeral port, serving on its own
// thread until destroyed.
class LoopbackServer {
 public:
  LoopbackServer() = default;
  ~LoopbackServer() { Stop(); }
  httplib::Server& server() { return server_; }
  // Binds and serves; returns the port (0 on failure).
  int Start() {
    port_ = server_.bind_to_any_port("127.0.0.1");
    if (port_ <= 0) return 0;
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    return port_;
  }
  void Stop() {
    if (thread_.joinable()) {
      server_.stop();
      thread_.join();
    }
  }
  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
};

// A port nothing listens on: bound (never listened on) then released, so a
// connection to it is refused. A race in principle, not in a test that
// connects at once.
inline int UnusedLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace deltasync::testing_agent
