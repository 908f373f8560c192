// What stands between the agent's listening socket and httplib's request
// parser: a gate thread that holds each new connection until its whole
// request head has arrived (or its deadline passed), without a request
// thread, and a Stream whose reads all end at one deadline.
//
// httplib reads a request on one of a few pool threads, a byte at a time,
// with only a per-read timeout: a client that trickles a header line every
// few seconds keeps a thread forever, and a handful of them stop the agent
// answering anything. Here no request thread ever waits for a request head,
// and the rest of a request (its body) must arrive within one deadline.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "deltasync/status.h"

namespace deltasync::agent_internal {

// Raises the calling thread's nice value to `nice` (never lowers it: that
// needs privileges, and the caller chose its own priority). Best effort.
void LowerThreadPriority(int nice);

// A complete HTTP/1.1 response that closes the connection, with the agent's
// JSON error body {"error": message, "code": code}.
std::string ErrorResponse(int http_status, std::string_view code, const std::string& message);

// An httplib Stream over a connected non-blocking socket. Every read ends
// at `read_deadline` however the bytes trickle in (then it fails and
// timed_out() turns true); each write may wait `write_timeout` for room.
// Reads are buffered: the stream may read past the request it serves,
// which is harmless as every connection carries one request.
class DeadlineStream final : public httplib::Stream {
 public:
  using Clock = std::chrono::steady_clock;
  DeadlineStream(int fd, Clock::time_point read_deadline, Clock::duration write_timeout);

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return fd_; }

  // True once a read failed because the deadline passed.
  bool timed_out() const { return timed_out_; }

 private:
  // Waits until `events` are ready on the socket or `until` passes.
  bool WaitFor(short events, Clock::time_point until) const;

  int fd_;
  Clock::time_point read_deadline_;
  Clock::duration write_timeout_;
  mutable bool timed_out_ = false;
  char buffer_[4096];
  size_t buffer_begin_ = 0;
  size_t buffer_end_ = 0;
};

struct GateOptions {
  // A connection's request head must be complete this long after accept.
  double head_timeout_seconds = 10;
  // After its answer a connection is half-closed and what the client still
  // sends is read and dropped for up to this long, so that closing with
  // unread bytes (a refused body) does not reset the connection before the
  // client has read the answer.
  double linger_seconds = 2;
  // Largest request head (request line and header fields) taken.
  size_t max_head_bytes = 16 << 10;
  // Connections the gate holds at once (waiting for a head or lingering);
  // past it the oldest is closed to make room.
  size_t max_connections = 512;
  int nice = 0;  // of the gate thread (LowerThreadPriority)
};

// One thread and an epoll set. Thread-safe.
class ConnectionGate {
 public:
  // Runs on the gate thread for each connection whose head arrived whole
  // and passed CheckRequestHead, taking the socket: `post` is true when the
  // request line starts with "POST ". Must not block.
  using Dispatch = std::function<void(int fd, bool post)>;
  // Runs on the gate thread for each request the gate answers itself.
  using Answered = std::function<void(int http_status)>;

  ConnectionGate(GateOptions options, Dispatch dispatch, Answered answered);
  ~ConnectionGate();  // Stop()
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  // Creates the epoll set and starts the thread. IOError when the system
  // refuses either.
  Status Start();
  // Takes a freshly accepted socket. Before Start or after Stop it is
  // closed at once.
  void Admit(int fd);
  // Takes a socket whose request was answered: half-closes it, drains what
  // the client still sends until it closes or `linger_seconds` pass, then
  // closes it. After Stop it is closed at once.
  void Linger(int fd);
  // Dispatches the connections whose heads are complete, answers 503 to
  // those still waiting for theirs, closes the lingering ones; returns once
  // the thread has ended. Idempotent.
  void Stop();

 private:
  enum class Phase { kHead, kLinger };
  struct Connection {
    Phase phase = Phase::kHead;
    uint32_t generation = 0;  // tells a reused fd number's events apart
    std::chrono::steady_clock::time_point admitted;
    std::chrono::steady_clock::time_point deadline;
  };
  struct Ready {
    int fd;
    bool post;
  };

  void Run();
  // The helpers below run with mu_ held.
  void Add(int fd, Phase phase, double seconds);
  void Close(int fd);
  void AnswerAndLinger(int fd, int http_status, std::string_view code, const std::string& message);
  void OnHeadEvent(int fd, uint32_t events, bool stopping, std::vector<Ready>* ready);
  void OnLingerEvent(int fd);
  void MakeRoom();
  void Wake();

  GateOptions options_;
  Dispatch dispatch_;
  Answered answered_;
  std::mutex mu_;
  std::unordered_map<int, Connection> connections_;
  uint32_t next_generation_ = 1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  bool running_ = false;   // started and not yet told to stop
  bool stopping_ = false;  // told to stop; the thread finishes the last pass
  std::thread thread_;
  std::vector<char> peek_;  // the gate thread's view of a head being received
  // Answers counted by answered_ run outside mu_ (it may take other locks).
  std::vector<int> answered_statuses_;
};

}  // namespace deltasync::agent_internal
