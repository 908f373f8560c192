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
#include <fstream>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "agent/http_util.h"
#include "agent/metrics.h"
#include "deltasync/agent.h"
#include "deltasync/thread_pool.h"

namespace deltasync {

using nlohmann::json;

namespace {

using agent_internal::AgentMetrics;
using agent_internal::ConstantTimeEquals;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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
    case 401: return "unauthorized";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 413: return "body_too_large";
    case 414: return "uri_too_long";
    case 503: return "unavailable";
    default: return http_status >= 500 ? "internal" : "bad_request";
  }
}

// What /pull_weights was asked for: nullopt = the store's latest.
struct PullRequest {
  std::optional<int64_t> target;
};

struct RequestError {
  int http_status;
  std::string code;
  std::string message;
};

// Parses a /pull_weights body; on failure fills `error` and returns nullopt.
std::optional<PullRequest> ParsePullRequest(const std::string& body, RequestError* error) {
  PullRequest out;
  if (body.find_first_not_of(" \t\r\n") == std::string::npos) return out;
  const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    *error = {400, "invalid_json", "request body is not valid JSON"};
    return std::nullopt;
  }
  if (!parsed.is_object()) {
    *error = {400, "invalid_request", "request body must be a JSON object"};
    return std::nullopt;
  }
  auto it = parsed.find("target_version");
  if (it == parsed.end() || it->is_null()) return out;
  const json& t = *it;
  auto bad_target = [&](const std::string& why) {
    *error = {400, "invalid_target_version", "target_version " + why};
    return std::nullopt;
  };
  if (t.is_number_unsigned()) {
    const uint64_t v = t.get<uint64_t>();
    if (v > static_cast<uint64_t>(INT64_MAX)) return bad_target("is out of range");
    out.target = static_cast<int64_t>(v);
    return out;
  }
  if (t.is_number_integer()) {
    const int64_t v = t.get<int64_t>();
    if (v < 0) return bad_target("must be >= 0, got " + std::to_string(v));
    out.target = v;
    return out;
  }
  if (t.is_string()) {
    const std::string& s = t.get_ref<const std::string&>();
    if (s == "latest") return out;
    int64_t v = 0;
    const char* end = s.data() + s.size();
    auto [ptr, ec] = std::from_chars(s.data(), end, v);
    const bool all_digits =
        !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
    if (!all_digits || ec != std::errc() || ptr != end) {
      return bad_target("must be a non-negative integer or \"latest\"");
    }
    out.target = v;
    return out;
  }
  return bad_target("must be a non-negative integer or \"latest\"");
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

// The bearer token of an Authorization header value, or "" when it is not one.
std::string_view BearerToken(std::string_view header) {
  constexpr std::string_view kScheme = "bearer ";
  if (header.size() < kScheme.size()) return {};
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != kScheme[i]) return {};
  }
  header.remove_prefix(kScheme.size());
  while (!header.empty() && header.front() == ' ') header.remove_prefix(1);
  while (!header.empty() && header.back() == ' ') header.remove_suffix(1);
  return header;
}

std::string StripBrackets(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

// Raises the calling thread's nice value to `nice` (never lowers it: that
// needs privileges, and the caller chose its own priority).
void LowerThreadPriority(int nice) {
  const auto tid = static_cast<id_t>(::gettid());
  errno = 0;
  const int current = ::getpriority(PRIO_PROCESS, tid);
  if (errno != 0 || current >= nice) return;
  ::setpriority(PRIO_PROCESS, tid, nice);  // best effort: a failure only costs priority
}

// httplib's request threads. Each lowers its own priority to `nice` before
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
  return token;
}

// ---------------------------------------------------------------------------

struct Agent::State {
  AgentOptions options;
  std::unique_ptr<CheckpointPuller> puller;
  std::unique_ptr<EngineReloader> reloader;

  httplib::Server server;
  std::thread listener;
  std::atomic<int> port{0};
  std::atomic<bool> listener_done{false};
  std::atomic<bool> stopping{false};
  std::mutex lifecycle_mu;  // Start and Stop
  bool started = false;
  bool stopped = false;

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
    metrics.RecordRejected();
    SendJson(res, http_status, ErrorBody(code, message));
  }

  httplib::Server::HandlerResponse PreRoute(const httplib::Request& req, httplib::Response& res) {
    if (!options.token.empty()) {
      const std::string header = req.get_header_value("Authorization");
      const std::string_view presented = BearerToken(header);
      if (presented.empty() || !ConstantTimeEquals(presented, options.token)) {
        res.set_header("WWW-Authenticate", "Bearer");
        Reject(res, 401, "unauthorized",
               header.empty() ? "missing Authorization: Bearer <token> header"
                              : "invalid bearer token");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (req.has_header("Transfer-Encoding") &&
        !(req.method == "POST" && req.path == "/pull_weights")) {
      // Only /pull_weights reads its body under the cap as it arrives; any
      // other endpoint would have httplib read it whole first.
      res.set_header("Connection", "close");
      Reject(res, 411, "length_required",
             "a chunked request body is only accepted by /pull_weights");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.has_header("Content-Length")) {
      const std::string text = req.get_header_value("Content-Length");
      uint64_t length = 0;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), length);
      if (ec != std::errc() || ptr != text.data() + text.size()) {
        Reject(res, 400, "bad_request", "malformed Content-Length");
        return httplib::Server::HandlerResponse::Handled;
      }
      if (length > options.max_body_bytes) {
        Reject(res, 413, "body_too_large",
               "request body of " + text + " bytes exceeds the limit of " +
                   std::to_string(options.max_body_bytes));
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return httplib::Server::HandlerResponse::Unhandled;
  }

  // Reads the body itself so that the cap also holds for a chunked body,
  // which httplib would otherwise read whole before any handler runs.
  void HandlePullStreamed(httplib::Response& res, const httplib::ContentReader& reader) {
    std::string body;
    bool too_large = false;
    reader([&](const char* data, size_t length) {
      if (length > options.max_body_bytes - body.size()) {
        too_large = true;
        return false;
      }
      body.append(data, length);
      return true;
    });
    if (too_large) {
      res.set_header("Connection", "close");
      return Reject(
          res, 413, "body_too_large",
          "request body exceeds the limit of " + std::to_string(options.max_body_bytes) + " bytes");
    }
    HandlePull(body, res);
  }

  void HandlePull(const std::string& request_body, httplib::Response& res) {
    RequestError error{};
    const std::optional<PullRequest> request = ParsePullRequest(request_body, &error);
    if (!request) return Reject(res, error.http_status, error.code, error.message);
    if (request->target) {
      // Refused before anything is touched: a version the store does not
      // (yet) hold is the caller's mistake, not a pull failure.
      Result<int64_t> latest = puller->LatestVersion();
      if (!latest.ok()) {
        NoteFailure("store_unreadable", latest.status().ToString());
        return SendJson(res, 500, ErrorBody("store_unreadable", latest.status().ToString()));
      }
      if (*request->target > *latest) {
        return Reject(res, 404, "version_not_found",
                      "target_version " + std::to_string(*request->target) +
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
      pulling_target = request->target ? json(*request->target) : json("latest");
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
      pulled = puller->Pull(request->target);
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
      const bool not_found = !pulled.ok() && pulled.status().IsNotFound();
      const std::string_view code =
          not_found ? "version_not_found" : (pulled.ok() ? "verify_failed" : "pull_failed");
      const Status& failure = pulled.ok() ? verified : pulled.status();
      NoteFailure(code, failure.ToString());
      json body = ErrorBody(code, failure.ToString());
      body["status"] = StatusCodeName(failure.code());
      body["applied_version"] = now.ok() ? OptionalVersion(*now) : json(nullptr);
      return SendJson(res, not_found ? 404 : 500, body);
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
    server.new_task_queue = [this] {
      return new RequestQueue(CPPHTTPLIB_THREAD_POOL_COUNT, options.request_nice, &metrics);
    };
    // One request per connection. Requests are few (a pull per training
    // step, a scrape now and then), and httplib cannot otherwise close a
    // connection whose body it refused unread: it would wait out the read
    // timeout on the leftover bytes, and so would Stop().
    server.set_keep_alive_max_count(1);
    server.set_pre_routing_handler(
        [this](const httplib::Request& req, httplib::Response& res) { return PreRoute(req, res); });
    server.Post("/pull_weights", httplib::Server::HandlerWithContentReader(
                                     [this](const httplib::Request&, httplib::Response& res,
                                            const httplib::ContentReader& reader) {
                                       HandlePullStreamed(res, reader);
                                     }));
    // A POST without a body does not go through the content reader.
    server.Post("/pull_weights", httplib::Server::Handler(
                                     [this](const httplib::Request& req, httplib::Response& res) {
                                       HandlePull(req.body, res);
                                     }));
    server.Get("/status",
               [this](const httplib::Request&, httplib::Response& res) { HandleStatus(res); });
    server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      SendJson(res, 200, json{{"status", "ok"}});
    });
    server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.status = 200;
      res.set_content(metrics.Render(), "text/plain; version=0.0.4; charset=utf-8");
    });
    auto method_not_allowed = [this](const char* allowed) {
      return [this, allowed](const httplib::Request& req, httplib::Response& res) {
        res.set_header("Allow", allowed);
        Reject(res, 405, "method_not_allowed",
               req.method + " " + req.path + " is not allowed; use " + allowed);
      };
    };
    server.Get("/pull_weights", method_not_allowed("POST"));
    for (const char* path : {"/status", "/health", "/metrics"}) {
      server.Post(path, method_not_allowed("GET"));
    }
    // Refusals httplib makes itself (unknown path, a body over the cap sent
    // chunked, a malformed request) get the same JSON error shape.
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
    return Status::IOError("cannot listen on " + s.options.host + ":" +
                           std::to_string(s.options.port));
  }
  s.port = port;
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
    s.stopped = true;
    return Status::IOError("agent listener on " + s.options.host + ":" + std::to_string(port) +
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
    // httplib's stop closes the listening socket; listen_after_bind then
    // drains the worker pool, so every accepted request gets its answer.
    s.server.stop();
    if (s.listener.joinable()) s.listener.join();
  }
  // After the request threads: a request waiting on a pull gets its answer.
  s.pull_thread.reset();
  s.stopped = true;
}

}  // namespace deltasync
