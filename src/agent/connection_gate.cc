#include "agent/connection_gate.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "agent/http_util.h"

namespace deltasync::agent_internal {

namespace {

using Clock = std::chrono::steady_clock;

Clock::duration Seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

const char* ReasonPhrase(int http_status) {
  switch (http_status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

void GetIpAndPort(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return;
  char host[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (::getnameinfo(sa, len, host, sizeof(host), service, sizeof(service),
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(service);
  }
}

}  // namespace

void LowerThreadPriority(int nice) {
  const auto tid = static_cast<id_t>(::gettid());
  errno = 0;
  const int current = ::getpriority(PRIO_PROCESS, tid);
  if (errno != 0 || current >= nice) return;
  ::setpriority(PRIO_PROCESS, tid, nice);  // best effort: a failure only costs priority
}

std::string ErrorResponse(int http_status, std::string_view code, const std::string& message) {
  const std::string body = nlohmann::json{{"error", message}, {"code", code}}.dump(
                               -1, ' ', false, nlohmann::json::error_handler_t::replace) +
                           "\n";
  return "HTTP/1.1 " + std::to_string(http_status) + " " + ReasonPhrase(http_status) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

// ---------------------------------------------------------------------------

DeadlineStream::DeadlineStream(int fd, Clock::time_point read_deadline,
                               Clock::duration write_timeout)
    : fd_(fd), read_deadline_(read_deadline), write_timeout_(write_timeout) {}

bool DeadlineStream::WaitFor(short events, Clock::time_point until) const {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd_, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 60000)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return false;
  }
}

bool DeadlineStream::is_readable() const {
  if (buffer_begin_ < buffer_end_) return true;
  if (WaitFor(POLLIN, read_deadline_)) return true;
  timed_out_ = Clock::now() >= read_deadline_;
  return false;
}

bool DeadlineStream::is_writable() const { return WaitFor(POLLOUT, Clock::now() + write_timeout_); }

ssize_t DeadlineStream::read(char* ptr, size_t size) {
  if (size == 0) return 0;
  if (buffer_begin_ < buffer_end_) {
    const size_t n = std::min(size, buffer_end_ - buffer_begin_);
    std::memcpy(ptr, buffer_ + buffer_begin_, n);
    buffer_begin_ += n;
    return static_cast<ssize_t>(n);
  }
  // httplib reads the head a byte at a time: fill the buffer instead.
  const bool buffered = size < sizeof(buffer_);
  for (;;) {
    if (Clock::now() >= read_deadline_) {
      timed_out_ = true;
      return -1;
    }
    const ssize_t n =
        ::recv(fd_, buffered ? buffer_ : ptr, buffered ? sizeof(buffer_) : size, MSG_DONTWAIT);
    if (n > 0 && buffered) {
      buffer_begin_ = 0;
      buffer_end_ = static_cast<size_t>(n);
      return read(ptr, size);
    }
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (!WaitFor(POLLIN, read_deadline_)) {
      timed_out_ = Clock::now() >= read_deadline_;
      return -1;
    }
  }
}

ssize_t DeadlineStream::write(const char* ptr, size_t size) {
  for (;;) {
    const ssize_t n = ::send(fd_, ptr, size, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (!WaitFor(POLLOUT, Clock::now() + write_timeout_)) return -1;
  }
}

void DeadlineStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  GetIpAndPort(fd_, /*peer=*/true, ip, port);
}

void DeadlineStream::get_local_ip_and_port(std::string& ip, int& port) const {
  GetIpAndPort(fd_, /*peer=*/false, ip, port);
}

// ---------------------------------------------------------------------------

ConnectionGate::ConnectionGate(GateOptions options, Dispatch dispatch, Answered answered)
    : options_(options), dispatch_(std::move(dispatch)), answered_(std::move(answered)) {}

ConnectionGate::~ConnectionGate() { Stop(); }

Status ConnectionGate::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (running_ || thread_.joinable()) return Status::FailedPrecondition("gate already started");
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return Status::FromErrno(errno, "epoll_create1");
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = ~uint64_t{0};
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
    return Status::FromErrno(errno, "epoll_ctl");
  }
  peek_.resize(options_.max_head_bytes);
  running_ = true;
  thread_ = std::thread([this] { Run(); });
  return Status::OK();
}

void ConnectionGate::Wake() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void ConnectionGate::Add(int fd, Phase phase, double seconds) {
  Connection c;
  c.phase = phase;
  c.generation = next_generation_++;
  c.admitted = Clock::now();
  c.deadline = c.admitted + Seconds(seconds);
  epoll_event ev{};
  // Edge-triggered: a head is peeked, not read, so the socket stays
  // readable until more bytes arrive; only their arrival is news.
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
  ev.data.u64 = (uint64_t{c.generation} << 32) | static_cast<uint32_t>(fd);
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    ::close(fd);
    return;
  }
  connections_[fd] = c;
}

void ConnectionGate::Close(int fd) {
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  connections_.erase(fd);
  ::close(fd);
}

void ConnectionGate::AnswerAndLinger(int fd, int http_status, std::string_view code,
                                     const std::string& message) {
  const std::string response = ErrorResponse(http_status, code, message);
  // A fresh socket's send buffer takes this whole; if not, the client is
  // not reading and loses the answer.
  (void)!::send(fd, response.data(), response.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  answered_statuses_.push_back(http_status);
  ::shutdown(fd, SHUT_WR);
  auto it = connections_.find(fd);
  if (it == connections_.end()) return;
  it->second.phase = Phase::kLinger;
  it->second.deadline = Clock::now() + Seconds(options_.linger_seconds);
  OnLingerEvent(fd);  // what is already there is drained now: no edge will come for it
}

void ConnectionGate::MakeRoom() {
  while (connections_.size() >= options_.max_connections && !connections_.empty()) {
    // Lingering connections first (their answers are out), then the
    // longest wait for a head: a real client sends its head at once.
    auto victim = connections_.end();
    for (auto it = connections_.begin(); it != connections_.end(); ++it) {
      if (victim == connections_.end()) {
        victim = it;
        continue;
      }
      const bool it_lingers = it->second.phase == Phase::kLinger;
      const bool victim_lingers = victim->second.phase == Phase::kLinger;
      if (it_lingers != victim_lingers) {
        if (it_lingers) victim = it;
      } else if (it->second.admitted < victim->second.admitted) {
        victim = it;
      }
    }
    const int fd = victim->first;
    if (victim->second.phase == Phase::kHead) {
      const std::string response =
          ErrorResponse(503, "overloaded", "too many connections waiting for their request");
      (void)!::send(fd, response.data(), response.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      answered_statuses_.push_back(503);
    }
    Close(fd);
  }
}

void ConnectionGate::Admit(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    ::close(fd);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_) {
    ::close(fd);
    return;
  }
  MakeRoom();
  Add(fd, Phase::kHead, options_.head_timeout_seconds);
  Wake();  // the gate may be sleeping with no deadline at all
}

void ConnectionGate::Linger(int fd) {
  ::shutdown(fd, SHUT_WR);
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_) {
    ::close(fd);
    return;
  }
  MakeRoom();
  Add(fd, Phase::kLinger, options_.linger_seconds);
  Wake();
}

void ConnectionGate::OnLingerEvent(int fd) {
  char sink[65536];
  for (;;) {
    const ssize_t n = ::recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    Close(fd);  // the client closed (or the connection broke): done
    return;
  }
}

void ConnectionGate::OnHeadEvent(int fd, uint32_t events, bool stopping,
                                 std::vector<Ready>* ready) {
  ssize_t n;
  do {
    n = ::recv(fd, peek_.data(), peek_.size(), MSG_PEEK | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    if (stopping) AnswerAndLinger(fd, 503, "shutting_down", "the agent is shutting down");
    return;
  }
  if (n <= 0) {
    Close(fd);  // closed (or broken) before sending a request
    return;
  }
  const std::string_view bytes(peek_.data(), static_cast<size_t>(n));
  const size_t end = FindRequestHeadEnd(bytes);
  if (end == std::string_view::npos) {
    if (bytes.size() >= options_.max_head_bytes) {
      AnswerAndLinger(fd, 431, "headers_too_large",
                      "request head exceeds " + std::to_string(options_.max_head_bytes) + " bytes");
    } else if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
      AnswerAndLinger(fd, 400, "bad_request", "connection closed before the request head ended");
    } else if (stopping) {
      AnswerAndLinger(fd, 503, "shutting_down", "the agent is shutting down");
    }
    return;
  }
  const Status head = CheckRequestHead(bytes.substr(0, end));
  if (!head.ok()) {
    AnswerAndLinger(fd, 400, "bad_request", head.message());
    return;
  }
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  connections_.erase(fd);
  ready->push_back({fd, bytes.substr(0, 5) == "POST "});
}

void ConnectionGate::Run() {
  LowerThreadPriority(options_.nice);
  std::vector<epoll_event> events(64);
  std::vector<Ready> ready;
  std::vector<int> answered;
  bool last_pass = false;
  while (!last_pass) {
    int timeout_ms = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto now = Clock::now();
      for (const auto& [fd, c] : connections_) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(c.deadline - now).count();
        const int ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
        if (timeout_ms < 0 || ms < timeout_ms) timeout_ms = ms;
      }
    }
    const int n =
        ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), timeout_ms);
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_pass = stopping_;
      for (int i = 0; i < n; ++i) {
        const uint64_t data = events[static_cast<size_t>(i)].data.u64;
        if (data == ~uint64_t{0}) {
          uint64_t count;
          (void)!::read(wake_fd_, &count, sizeof(count));
          continue;
        }
        const int fd = static_cast<int>(data & 0xffffffffu);
        auto it = connections_.find(fd);
        if (it == connections_.end() || it->second.generation != (data >> 32)) continue;
        if (it->second.phase == Phase::kHead) {
          OnHeadEvent(fd, events[static_cast<size_t>(i)].events, false, &ready);
        } else {
          OnLingerEvent(fd);
        }
      }
      const auto now = Clock::now();
      std::vector<int> fds;
      for (const auto& [fd, c] : connections_) fds.push_back(fd);
      for (int fd : fds) {
        auto it = connections_.find(fd);
        if (it == connections_.end()) continue;
        if (last_pass) {
          // Heads complete by now are served; the rest are told why not.
          if (it->second.phase == Phase::kHead) {
            OnHeadEvent(fd, 0, /*stopping=*/true, &ready);
          }
          if (connections_.count(fd)) Close(fd);
        } else if (it->second.deadline <= now) {
          if (it->second.phase == Phase::kHead) {
            AnswerAndLinger(fd, 408, "request_timeout",
                            "request head not received within " +
                                FormatDouble(options_.head_timeout_seconds) + " s");
          } else {
            Close(fd);
          }
        }
      }
      answered.swap(answered_statuses_);
    }
    for (const Ready& r : ready) dispatch_(r.fd, r.post);
    ready.clear();
    for (int status : answered) answered_(status);
    answered.clear();
  }
}

void ConnectionGate::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    stopping_ = true;
    if (thread_.joinable()) Wake();
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [fd, c] : connections_) ::close(fd);
  connections_.clear();
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

}  // namespace deltasync::agent_internal
