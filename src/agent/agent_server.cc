// The rollout-side HTTP agent (include/deltasync/agent.h).
#include <arpa/inet.h>
#include <httplib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "agent/connection_gate.h"
#include "agent/http_util.h"
#include "agent/metrics.h"
#include "deltasync/agent.h"
#include "deltasync/thread_pool.h"
#include "deltasync/timing.h"

namespace deltasync {

using nlohmann::json;

namespace {

using agent_internal::AgentMetrics;
using agent_internal::BearerToken;
using agent_internal::ChunkedDecoder;
using agent_internal::ConnectionGate;
using agent_internal::ConstantTimeEquals;
using agent_internal::DeadlineStream;
using agent_internal::GateOptions;
using agent_internal::LowerThreadPriority;
using agent_internal::ParsePullBody;
using agent_internal::PullBody;

// Error messages carry file names, which need not be UTF-8: never throw on them.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

void SendJson(httplib::Response& res, int http_status, const json& body) {
  res.status = http_status;
  res.set_content(Dump(body) + "\n", "application/json");
}

json ErrorBody(std::string_view code, const std::string& message) {
  return json{{"error", message}, {"code", code}};
}

json OptionalVersion(const std::optional<int64_t>& v) { return v ? json(*v) : json(nullptr); }

// The code httplib's own refusals (no handler ran) get in their JSON body.
std::string_view CodeForHttpStatus(int http_status) {
  switch (http_status) {
    case 400: return "bad_request";
    case 404: return "not_found";
    case 413: return "body_too_large";
    case 414: return "uri_too_long";
    case 415: return "unsupported_content_encoding";
    case 416: return "range_not_satisfiable";
    default: return http_status >= 500 ? "internal" : "bad_request";
  }
}

json PullResultJson(const PullResult& r) {
  return json{{"version", r.version},
              {"applied", r.applied},
              {"verified", true},
              {"seconds", r.seconds},
              {"bytes_read", r.bytes_read},
              {"tensors_changed", r.tensors_changed},
              {"changed_elements", r.changed_elements},
              {"from_version", OptionalVersion(r.from_version)},
              {"reset_to", OptionalVersion(r.reset_to)},
              {"versions_applied", r.versions_applied},
              {"recovered", r.recovered},
              {"reseeded", r.reseeded}};
}

std::string StripBrackets(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

// A pool of request threads (an httplib::ThreadPool). Each lowers its own priority to `nice` before
// its first request (Linux keeps a nice value per thread, so the pull thread
// and the puller's worker pool keep theirs) and reports the CPU time each
// connection cost it.
class RequestQueue final : public httplib::TaskQueue {
 public:
  RequestQueue(size_t threads, int nice, AgentMetrics* metrics)
      : pool_(threads), nice_(nice), metrics_(metrics) {}

  void enqueue(std::function<void()> fn) override {
    pool_.enqueue([this, fn = std::move(fn)] {
      thread_local bool lowered = false;
      if (!lowered) {
        if (nice_ > 0) LowerThreadPriority(nice_);
        lowered = true;
      }
      const double start = ThreadCpuSeconds();
      fn();
      metrics_->RecordRequest(ThreadCpuSeconds() - start);
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  static double ThreadCpuSeconds() {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  }

  httplib::ThreadPool pool_;
  int nice_;
  AgentMetrics* metrics_;
};

// What httplib's accept loop hands each new socket to: the connection gate,
// straight from the accept thread (AgentHttpServer::process_and_close_socket
// only passes the socket on, so nothing here blocks).
class InlineQueue final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

// httplib's server with the connection handling taken over: an accepted
// socket goes to `on_accept` (the gate) instead of a pool thread that would
// read it at the client's pace, and Serve parses and answers one request
// whose head has already arrived.
class AgentHttpServer final : public httplib::Server {
 public:
  std::function<void(int fd)> on_accept;

  // httplib listens with a backlog of 5: a burst of connections (clients,
  // or an attack the gate would shrug off) overflows it, and the kernel then
  // drops SYNs, which the clients retry only a second or more later. Linux
  // takes a second listen() on a listening socket as a new backlog.
  void RaiseBacklog() {
    const socket_t sock = svr_sock_;
    if (sock != INVALID_SOCKET) ::listen(sock, SOMAXCONN);
  }

  void Serve(httplib::Stream& stream) {
    bool connection_closed = false;
    process_request(stream, /*close_connection=*/true, connection_closed,
                    // Every answer is whole: a Range header is ignored, as
                    // RFC 9110 allows, rather than cutting a JSON body.
                    [](httplib::Request& req) { req.ranges.clear(); });
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    on_accept(sock);
    return true;
  }
};

// The stream of the request the calling request thread serves: handlers
// read a /pull_weights body from it themselves.
thread_local DeadlineStream* t_request_stream = nullptr;

constexpr size_t kQuickThreads = 4;  // all but POST: /status, /health, /metrics, refusals
constexpr size_t kPostThreads = 8;   // POST: a /pull_weights body, then the wait for the pull
constexpr double kLingerSeconds = 2;
constexpr double kWriteTimeoutSeconds = 10;

DeadlineStream::Clock::duration Seconds(double s) {
  return std::chrono::duration_cast<DeadlineStream::Clock::duration>(
      std::chrono::duration<double>(s));
}

bool IsKnownPath(const std::string& path) {
  return path == "/pull_weights" || path == "/status" || path == "/health" || path == "/metrics";
}

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string Trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return std::string(text);
}

// "host:port", or "[v6]:port".
std::string HostPort(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace

bool IsLoopbackHost(const std::string& host_in) {
  const std::string host = StripBrackets(host_in);
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6);
  }
  return false;
}

Result<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot read token file '" + path + "'");
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return Status::IOError("cannot read token file '" + path + "'");
  std::string token = buf.str();
  const size_t first = token.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) {
    return Status::InvalidArgument("token file '" + path + "' is empty");
  }
  const size_t last = token.find_last_not_of(" \t\r\n");
  token = token.substr(first, last - first + 1);
  for (char c : token) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= ' ' || u == 0x7f) {
      return Status::InvalidArgument("token in '" + path +
                                     "' holds whitespace or control characters");
    }
  }
  // The HTTP parser percent-decodes header values: "a%41" sent as is would
  // arrive as "aA" and never match.
  if (token.find('%') != std::string::npos) {
    return Status::InvalidArgument("token in '" + path +
                                   "' holds '%', which HTTP headers arrive percent-decoded with");
  }
  return token;
}

// ---------------------------------------------------------------------------

struct Agent::State {
  AgentOptions options;
  std::unique_ptr<CheckpointPuller> puller;
  std::unique_ptr<EngineReloader> reloader;

  AgentHttpServer server;
  std::thread listener;
  std::atomic<int> port{0};
  std::atomic<bool> listener_done{false};
  std::atomic<bool> stopping{false};
  std::mutex lifecycle_mu;  // Start and Stop
  bool started = false;
  bool stopped = false;

  // Where connections wait for their request head, then the two pools of
  // request threads that serve them (docs/format.md, "Threads and
  // priorities"). Made by Start(), stopped and reset by Stop().
  std::unique_ptr<ConnectionGate> gate;
  std::unique_ptr<RequestQueue> quick_threads;
  std::unique_ptr<RequestQueue> post_threads;

  std::mutex pull_mu;  // one pull at a time in this process
  // The one thread pulls run on, made by Start() so that it has the
  // priority of the thread that started the agent, not the request threads'.
  // Set before the server runs and reset after it stops.
  std::unique_ptr<ThreadPool> pull_thread;
  AgentMetrics metrics;

  // What /status reports, guarded by status_mu (never held across a pull).
  std::mutex status_mu;
  std::optional<int64_t> applied_version;
  bool busy = false;
  json pulling_target;  // the target in flight: a number or "latest"
  json last_error;      // {"error", "code", "unix_time"} of the last failed pull, or null
  json last_pull;       // the last successful pull's result, or null

  void SetApplied(std::optional<int64_t> v) {
    {
      std::lock_guard<std::mutex> lock(status_mu);
      applied_version = v;
    }
    metrics.SetAppliedVersion(v);
  }

  void NoteFailure(std::string_view code, const std::string& message) {
    std::lock_guard<std::mutex> lock(status_mu);
    last_error = ErrorBody(code, message);
    last_error["unix_time"] =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  void Reject(httplib::Response& res, int http_status, std::string_view code,
              const std::string& message) {
    if (http_status < 500) metrics.RecordRejected();
    SendJson(res, http_status, ErrorBody(code, message));
  }

  // Runs on a request thread for a connection whose head the gate passed.
  void ServeConnection(int fd) {
    DeadlineStream stream(fd, DeadlineStream::Clock::now() + Seconds(options.body_timeout_seconds),
                          Seconds(kWriteTimeoutSeconds));
    t_request_stream = &stream;
    server.Serve(stream);
    t_request_stream = nullptr;
    gate->Linger(fd);
  }

  // Every refusal that needs only the head, before any body is read.
  httplib::Server::HandlerResponse PreRoute(const httplib::Request& req, httplib::Response& res) {
    using httplib::Server;
    if (!options.token.empty()) {
      // The whole value, not get_header_value's C string, which ends at a NUL.
      const auto [first, last] = req.headers.equal_range("Authorization");
      const auto count = std::distance(first, last);
      const std::optional<std::string_view> presented =
          count == 1 ? BearerToken(first->second) : std::nullopt;
      if (!presented || !ConstantTimeEquals(*presented, options.token)) {
        res.set_header("WWW-Authenticate", "Bearer");
        Reject(res, 401, "unauthorized",
               count == 0  ? "missing Authorization: Bearer <token> header"
               : count > 1 ? "more than one Authorization header"
                           : "invalid bearer token");
        return Server::HandlerResponse::Handled;
      }
    }
    const bool pull = req.method == "POST" && req.path == "/pull_weights";
    // Framing (RFC 9112 section 6): a body's length must be unambiguous.
    const size_t lengths = req.headers.count("Content-Length");
    const size_t codings = req.headers.count("Transfer-Encoding");
    if (lengths > 1) {
      Reject(res, 400, "bad_request", "more than one Content-Length header");
      return Server::HandlerResponse::Handled;
    }
    if (codings > 1) {
      Reject(res, 400, "bad_request", "more than one Transfer-Encoding header");
      return Server::HandlerResponse::Handled;
    }
    if (lengths > 0 && codings > 0) {
      Reject(res, 400, "bad_request", "both Content-Length and Transfer-Encoding are set");
      return Server::HandlerResponse::Handled;
    }
    if (codings > 0) {
      const std::string coding = Lower(Trim(req.get_header_value("Transfer-Encoding")));
      if (coding != "chunked") {
        const size_t comma = coding.rfind(',');
        const std::string final_coding =
            comma == std::string::npos ? coding : Trim(std::string_view(coding).substr(comma + 1));
        if (final_coding != "chunked") {
          Reject(res, 400, "bad_request",
                 "Transfer-Encoding '" + coding + "' does not end with chunked");
        } else {
          Reject(res, 501, "unsupported_transfer_encoding",
                 "Transfer-Encoding '" + coding +
                     "' is not supported; send chunked or a Content-Length");
        }
        return Server::HandlerResponse::Handled;
      }
      if (!pull) {
        Reject(res, 411, "length_required",
               "a chunked request body is only accepted by /pull_weights");
        return Server::HandlerResponse::Handled;
      }
    }
    if (lengths > 0) {
      const std::string text = req.headers.find("Content-Length")->second;
      uint64_t length = 0;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), length);
      if (text.empty() || ec != std::errc() || ptr != text.data() + text.size()) {
        Reject(res, 400, "bad_request", "malformed Content-Length '" + text + "'");
        return Server::HandlerResponse::Handled;
      }
      if (length > options.max_body_bytes) {
        Reject(res, 413, "body_too_large",
               "request body of " + text + " bytes exceeds the limit of " +
                   std::to_string(options.max_body_bytes));
        return Server::HandlerResponse::Handled;
      }
    }
    // Only POST /pull_weights reads a body; any other request that could
    // carry one is answered from its head, so that no request thread waits
    // for a body nobody reads.
    if (req.method != "GET" && req.method != "HEAD" && !pull) {
      if (!IsKnownPath(req.path)) {
        Reject(res, 404, "not_found", "no such endpoint: " + req.path);
      } else {
        const char* allowed = req.path == "/pull_weights" ? "POST" : "GET";
        res.set_header("Allow", allowed);
        Reject(res, 405, "method_not_allowed",
               req.method + " " + req.path + " is not allowed; use " + allowed);
      }
      return Server::HandlerResponse::Handled;
    }
    if (pull && req.has_header("Content-Encoding") &&
        Lower(Trim(req.get_header_value("Content-Encoding"))) != "identity") {
      Reject(res, 415, "unsupported_content_encoding",
             "Content-Encoding '" + req.get_header_value("Content-Encoding") +
                 "' is not supported; send the body as is");
      return Server::HandlerResponse::Handled;
    }
    return Server::HandlerResponse::Unhandled;
  }

  // Reads the /pull_weights body from the request's stream (PreRoute has
  // checked its framing): Content-Length bytes, a chunked body decoded
  // strictly and under the cap as it arrives, or nothing when neither
  // header is there (RFC 9112: such a request has no body).
  void HandlePullRequest(const httplib::Request& req, httplib::Response& res) {
    DeadlineStream& stream = *t_request_stream;
    auto timed_out = [&] {
      Reject(res, 408, "request_timeout",
             "request body not received within " +
                 agent_internal::FormatDouble(options.body_timeout_seconds) + " s");
    };
    std::string body;
    char buf[4096];
    if (req.has_header("Transfer-Encoding")) {
      ChunkedDecoder decoder(options.max_body_bytes);
      while (decoder.state() == ChunkedDecoder::State::kMore) {
        const ssize_t n = stream.read(buf, sizeof(buf));
        if (n <= 0) {
          if (stream.timed_out()) return timed_out();
          return Reject(res, 400, "bad_request",
                        "chunked request body ended before its last chunk");
        }
        decoder.Feed(std::string_view(buf, static_cast<size_t>(n)), &body);
      }
      if (decoder.state() == ChunkedDecoder::State::kTooLarge) {
        return Reject(res, 413, "body_too_large", decoder.error());
      }
      if (decoder.state() == ChunkedDecoder::State::kMalformed) {
        return Reject(res, 400, "bad_request", "malformed chunked body: " + decoder.error());
      }
    } else if (req.has_header("Content-Length")) {
      const uint64_t length = std::stoull(req.get_header_value("Content-Length"));
      while (body.size() < length) {
        const ssize_t n = stream.read(
            buf, static_cast<size_t>(std::min<uint64_t>(sizeof(buf), length - body.size())));
        if (n <= 0) {
          if (stream.timed_out()) return timed_out();
          return Reject(res, 400, "bad_request",
                        "request body ended after " + std::to_string(body.size()) + " of " +
                            std::to_string(length) + " bytes");
        }
        body.append(buf, static_cast<size_t>(n));
      }
    }
    HandlePull(body, res);
  }

  void HandlePull(const std::string& request_body, httplib::Response& res) {
    const PullBody request = ParsePullBody(request_body);
    if (!request.ok()) return Reject(res, 400, request.error_code, request.error);
    if (request.target) {
      // Refused before anything is touched: a version the store does not
      // (yet) hold is the caller's mistake, not a pull failure.
      Result<int64_t> latest = puller->LatestVersion();
      if (!latest.ok()) {
        NoteFailure("store_unreadable", latest.status().ToString());
        return SendJson(res, 500, ErrorBody("store_unreadable", latest.status().ToString()));
      }
      if (*request.target > *latest) {
        return Reject(res, 404, "version_not_found",
                      "target_version " + std::to_string(*request.target) +
                          " is past the store's latest version " + std::to_string(*latest));
      }
    }
    if (stopping.load()) {
      return SendJson(res, 503, ErrorBody("shutting_down", "the agent is shutting down"));
    }
    std::unique_lock<std::mutex> pull_lock(pull_mu);
    if (stopping.load()) {
      return SendJson(res, 503, ErrorBody("shutting_down", "the agent is shutting down"));
    }
    {
      std::lock_guard<std::mutex> lock(status_mu);
      busy = true;
      pulling_target = request.target ? json(*request.target) : json("latest");
    }
    metrics.SetBusy(true);
    struct IdleOnExit {
      State* s;
      ~IdleOnExit() {
        {
          std::lock_guard<std::mutex> lock(s->status_mu);
          s->busy = false;
          s->pulling_target = nullptr;
        }
        s->metrics.SetBusy(false);
      }
    } idle_on_exit{this};

    const auto start = std::chrono::steady_clock::now();
    Result<PullResult> pulled = Status::Internal("the pull did not run");
    Status verified;
    std::promise<void> done;
    pull_thread->Submit([&] {
      pulled = puller->Pull(request.target);
      if (pulled.ok() && options.verify_after_pull) verified = puller->Verify();
      done.set_value();
    });
    done.get_future().wait();
    const double pull_seconds = SecondsSince(start);
    if (!pulled.ok() || !verified.ok()) {
      metrics.RecordPullFailure();
      // The checkpoint is at its last committed version (or mid-recovery):
      // report what it holds now rather than what it held before.
      Result<std::optional<int64_t>> now = puller->CurrentVersion();
      if (now.ok()) SetApplied(*now);
      const Status& failure = pulled.ok() ? verified : pulled.status();
      int http_status = 500;
      std::string_view code = "verify_failed";
      if (!pulled.ok()) {
        code = "pull_failed";
        if (failure.IsNotFound()) {
          http_status = 404;
          code = "version_not_found";
        } else if (failure.code() == StatusCode::kFailedPrecondition) {
          // The store's chain does not apply to what this host holds (a
          // wrong base, say): asking again cannot help.
          http_status = 409;
          code = "precondition_failed";
        }
      }
      NoteFailure(code, failure.ToString());
      json body = ErrorBody(code, failure.ToString());
      body["status"] = StatusCodeName(failure.code());
      body["applied_version"] = now.ok() ? OptionalVersion(*now) : json(nullptr);
      return SendJson(res, http_status, body);
    }
    metrics.RecordPullSuccess(pull_seconds, pulled->bytes_read);
    SetApplied(pulled->version);
    json body = PullResultJson(*pulled);
    body["seconds"] = pull_seconds;
    body["reloaded"] = false;
    body["reload_seconds"] = 0.0;
    if (reloader) {
      const auto reload_start = std::chrono::steady_clock::now();
      const Status reloaded = reloader->Reload(puller->local(), pulled->version);
      const double reload_seconds = SecondsSince(reload_start);
      metrics.RecordReload(reloaded.ok(), reload_seconds);
      body["reload_seconds"] = reload_seconds;
      if (!reloaded.ok()) {
        const std::string message = "pulled version " + std::to_string(pulled->version) +
                                    " but the engine reload failed: " + reloaded.ToString();
        NoteFailure("reload_failed", message);
        body["error"] = message;
        body["code"] = "reload_failed";
        return SendJson(res, 502, body);
      }
      body["reloaded"] = true;
    }
    {
      std::lock_guard<std::mutex> lock(status_mu);
      last_error = nullptr;
      last_pull = body;
    }
    SendJson(res, 200, body);
  }

  void HandleStatus(httplib::Response& res) {
    json body;
    {
      std::lock_guard<std::mutex> lock(status_mu);
      body["applied_version"] = OptionalVersion(applied_version);
      body["busy"] = busy;
      body["state"] = busy ? "busy" : "idle";
      body["pulling_target"] = pulling_target;
      body["last_error"] = last_error;
      body["last_pull"] = last_pull;
    }
    Result<int64_t> latest = puller->LatestVersion();
    body["store_latest"] = latest.ok() ? json(*latest) : json(nullptr);
    if (!latest.ok()) body["store_error"] = latest.status().ToString();
    body["local"] = puller->local();
    body["reload"] = reloader ? json(reloader->Describe()) : json(nullptr);
    SendJson(res, 200, body);
  }

  void Configure() {
    // httplib's default also sets SO_REUSEPORT, which would let a second
    // agent bind the same port and silently take half the requests.
    server.set_socket_options([](int sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });
    server.set_payload_max_length(options.max_body_bytes);
    // Accepted sockets go to the gate at once, on the accept thread.
    server.new_task_queue = [] { return new InlineQueue(); };
    server.on_accept = [this](int fd) { gate->Admit(fd); };
    server.set_pre_routing_handler(
        [this](const httplib::Request& req, httplib::Response& res) { return PreRoute(req, res); });
    // A client that waits for 100 Continue learns of a refusal (a body
    // over the cap, a missing token) before it sends the body.
    server.set_expect_100_continue_handler(
        [this](const httplib::Request& req, httplib::Response& res) {
          return PreRoute(req, res) == httplib::Server::HandlerResponse::Handled ? res.status : 100;
        });
    // The content-reader form keeps httplib from reading the body into
    // req.body first: HandlePullRequest reads it itself.
    server.Post("/pull_weights",
                httplib::Server::HandlerWithContentReader(
                    [this](const httplib::Request& req, httplib::Response& res,
                           const httplib::ContentReader&) { HandlePullRequest(req, res); }));
    server.Get("/status",
               [this](const httplib::Request&, httplib::Response& res) { HandleStatus(res); });
    server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      SendJson(res, 200, json{{"status", "ok"}});
    });
    server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.status = 200;
      res.set_content(metrics.Render(), "text/plain; version=0.0.4; charset=utf-8");
    });
    server.Get("/pull_weights", [this](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Allow", "POST");
      Reject(res, 405, "method_not_allowed",
             req.method + " " + req.path + " is not allowed; use POST");
    });
    // Refusals httplib makes itself (unknown path, a malformed request
    // line, a URI too long) get the same JSON error shape.
    server.set_error_handler(httplib::Server::HandlerWithResponse(
        [this](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
          if (res.status < 500) metrics.RecordRejected();
          const std::string message =
              res.status == 404 ? "no such endpoint: " + req.path
                                : "request refused with HTTP status " + std::to_string(res.status);
          SendJson(res, res.status, ErrorBody(CodeForHttpStatus(res.status), message));
          return httplib::Server::HandlerResponse::Handled;
        }));
  }

  // Stops and drops the gate and the request threads (after the listener).
  void StopConnections() {
    if (gate) gate->Stop();
    if (quick_threads) quick_threads->shutdown();
    if (post_threads) post_threads->shutdown();
    quick_threads.reset();
    post_threads.reset();
    gate.reset();
  }
};

Agent::Agent(std::unique_ptr<State> state) : state_(std::move(state)) {}

Agent::~Agent() { Stop(); }

Result<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options,
                                             std::unique_ptr<CheckpointPuller> puller,
                                             std::unique_ptr<EngineReloader> reloader) {
  if (puller == nullptr) return Status::InvalidArgument("agent needs a checkpoint puller");
  if (options.host.empty()) return Status::InvalidArgument("agent listen host is empty");
  if (options.port < 0 || options.port > 65535) {
    return Status::InvalidArgument("agent port " + std::to_string(options.port) +
                                   " is outside 0..65535");
  }
  if (options.request_nice < 0 || options.request_nice > 19) {
    return Status::InvalidArgument("agent request nice value " +
                                   std::to_string(options.request_nice) + " is outside 0..19");
  }
  if (options.max_body_bytes == 0) {
    return Status::InvalidArgument("agent body size limit must be positive");
  }
  for (double t : {options.head_timeout_seconds, options.body_timeout_seconds}) {
    if (!std::isfinite(t) || t <= 0 || t > 86400) {
      return Status::InvalidArgument("agent request timeouts must be in (0, 86400] seconds, not " +
                                     agent_internal::FormatDouble(t));
    }
  }
  if (options.token.empty() && !IsLoopbackHost(options.host)) {
    return Status::InvalidArgument("refusing to listen on non-loopback address '" + options.host +
                                   "' without a token: pass --token-file");
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->options.host = StripBrackets(options.host);
  state->puller = std::move(puller);
  state->reloader = std::move(reloader);
  return std::unique_ptr<Agent>(new Agent(std::move(state)));
}

Status Agent::Start() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.lifecycle_mu);
  if (s.started || s.stopped) return Status::FailedPrecondition("agent was already started");
  Result<std::optional<int64_t>> current = s.puller->CurrentVersion();
  if (current.ok()) {
    s.SetApplied(*current);
  } else {
    s.NoteFailure("state_unreadable", current.status().ToString());
  }
  s.Configure();
  int port = s.options.port;
  if (port == 0) {
    port = s.server.bind_to_any_port(s.options.host);
  } else if (!s.server.bind_to_port(s.options.host, port)) {
    port = -1;
  }
  if (port <= 0) {
    // httplib says only that it failed: ask the system why, the same way.
    const std::string reason = agent_internal::ListenFailureReason(s.options.host, s.options.port);
    return Status::IOError("cannot listen on " + HostPort(s.options.host, s.options.port) +
                           (reason.empty() ? std::string() : ": " + reason));
  }
  s.port = port;
  s.server.RaiseBacklog();
  GateOptions gate;
  gate.head_timeout_seconds = s.options.head_timeout_seconds;
  gate.linger_seconds = kLingerSeconds;
  gate.nice = s.options.request_nice;
  s.gate = std::make_unique<ConnectionGate>(
      gate,
      [&s](int fd, bool post) {
        (post ? s.post_threads : s.quick_threads)->enqueue([&s, fd] { s.ServeConnection(fd); });
      },
      [&s](int http_status) {
        if (http_status < 500) s.metrics.RecordRejected();
      });
  s.quick_threads =
      std::make_unique<RequestQueue>(kQuickThreads, s.options.request_nice, &s.metrics);
  s.post_threads = std::make_unique<RequestQueue>(kPostThreads, s.options.request_nice, &s.metrics);
  if (Status started = s.gate->Start(); !started.ok()) {
    s.StopConnections();
    return started.WithContext("agent connection gate");
  }
  s.pull_thread = std::make_unique<ThreadPool>(1);
  s.listener = std::thread([&s] {
    s.server.listen_after_bind();
    s.listener_done = true;
  });
  // Stop() only takes effect on a running server: wait until it runs.
  while (!s.server.is_running() && !s.listener_done.load()) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  s.started = true;
  if (s.listener_done.load()) {
    s.listener.join();
    s.StopConnections();
    s.stopped = true;
    return Status::IOError("agent listener on " + HostPort(s.options.host, port) +
                           " stopped at once");
  }
  return Status::OK();
}

int Agent::port() const { return state_->port.load(); }

void Agent::Stop() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.lifecycle_mu);
  if (s.stopped) return;
  s.stopping = true;
  if (s.started) {
    // httplib's stop closes the listening socket and ends the accept loop.
    s.server.stop();
    if (s.listener.joinable()) s.listener.join();
  }
  // Then the gate hands on the requests whose heads are in and the request
  // threads answer every request they were given.
  s.StopConnections();
  // After the request threads: a request waiting on a pull gets its answer.
  s.pull_thread.reset();
  s.stopped = true;
}

}  // namespace deltasync
