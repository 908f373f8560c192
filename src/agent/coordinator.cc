// Trainer side: ask every engine's agent to pull a version, concurrently,
// with timeouts and bounded retries.
#include <httplib.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent/http_util.h"
#include "deltasync/agent.h"
#include "deltasync/codec.h"
#include "deltasync/timing.h"

namespace deltasync {

using nlohmann::json;

namespace {

using agent_internal::HttpUrl;
using agent_internal::ParseHttpUrl;

void SplitSeconds(double seconds, time_t* sec, time_t* usec) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  *sec = static_cast<time_t>(seconds);
  *usec = static_cast<time_t>((seconds - static_cast<double>(*sec)) * 1e6);
}

std::string OneLine(const std::string& text, size_t max_chars = 400) {
  std::string out = text.size() > max_chars ? text.substr(0, max_chars) + "..." : text;
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

double BackoffSeconds(const EnginePullOptions& options, int retry) {
  double s = options.backoff_initial_seconds;
  for (int i = 1; i < retry && s < options.backoff_max_seconds; ++i) s *= 2;
  if (!std::isfinite(s) || s < 0) s = 0;
  return std::min(s, options.backoff_max_seconds);
}

enum class AttemptVerdict { kOk, kRetry, kFinal };

// Judges one HTTP response; fills the outcome's fields from it.
AttemptVerdict JudgeResponse(const httplib::Response& res, std::optional<int64_t> target,
                             EnginePullOutcome* out) {
  out->http_status = res.status;
  const json body = json::parse(res.body, nullptr, /*allow_exceptions=*/false);
  const bool is_object = body.is_object();
  auto string_field = [&](const char* key) -> std::string {
    if (!is_object) return {};
    auto it = body.find(key);
    return it != body.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  if (res.status != 200) {
    out->error_code = string_field("code");
    if (out->error_code.empty()) out->error_code = "http_" + std::to_string(res.status);
    std::string reason = string_field("error");
    if (reason.empty()) reason = res.body.empty() ? "(no body)" : res.body;
    out->error = "HTTP " + std::to_string(res.status) + ": " + OneLine(reason);
    return res.status >= 500 ? AttemptVerdict::kRetry : AttemptVerdict::kFinal;
  }
  if (!is_object) {
    out->error_code = "bad_response";
    out->error = "HTTP 200 with a body that is not a JSON object: " + OneLine(res.body, 200);
    return AttemptVerdict::kFinal;
  }
  auto version = body.find("version");
  if (version != body.end() && version->is_number_integer()) out->version = version->get<int64_t>();
  if (auto it = body.find("applied"); it != body.end() && it->is_boolean()) {
    out->applied = it->get<bool>();
  }
  if (auto it = body.find("bytes_read"); it != body.end() && it->is_number_unsigned()) {
    out->bytes_read = it->get<uint64_t>();
  }
  if (auto it = body.find("tensors_changed"); it != body.end() && it->is_number_unsigned()) {
    out->tensors_changed = it->get<uint64_t>();
  }
  auto verified = body.find("verified");
  if (verified == body.end() || !verified->is_boolean() || !verified->get<bool>()) {
    out->error_code = "not_verified";
    out->error = "engine did not report the version verified";
    return AttemptVerdict::kFinal;
  }
  if (!out->version) {
    out->error_code = "bad_response";
    out->error = "engine response lacks an integer \"version\"";
    return AttemptVerdict::kFinal;
  }
  if (target && *out->version != *target) {
    out->error_code = "wrong_version";
    out->error = "engine reports version " + std::to_string(*out->version) + ", expected " +
                 std::to_string(*target);
    return AttemptVerdict::kFinal;
  }
  out->error.clear();
  out->error_code.clear();
  return AttemptVerdict::kOk;
}

EnginePullOutcome PullOnEngine(const std::string& engine, std::optional<int64_t> target,
                               const EnginePullOptions& options) {
  EnginePullOutcome out;
  out.engine = engine;
  const auto start = std::chrono::steady_clock::now();
  Result<HttpUrl> url = ParseHttpUrl(engine);
  if (!url.ok()) {
    // The summary names the engine: say only what is wrong with its URL.
    const std::string message = url.status().message();
    const std::string named = "URL '" + engine + "': ";
    out.error_code = "invalid_url";
    out.error =
        "malformed URL: " + (message.rfind(named, 0) == 0 ? message.substr(named.size()) : message);
    return out;
  }
  httplib::Client client(url->scheme_host_port);
  time_t sec = 0;
  time_t usec = 0;
  SplitSeconds(options.connect_timeout_seconds, &sec, &usec);
  client.set_connection_timeout(sec, usec);
  SplitSeconds(options.timeout_seconds, &sec, &usec);
  client.set_read_timeout(sec, usec);
  client.set_write_timeout(sec, usec);
  httplib::Headers headers;
  if (!options.token.empty()) headers.emplace("Authorization", "Bearer " + options.token);
  const json request = {{"target_version", target ? json(*target) : json("latest")}};
  const std::string body = request.dump();
  const std::string path = url->path + "/pull_weights";

  const int max_attempts = 1 + std::max(0, options.retries);
  for (int attempt = 1; attempt <= max_attempts; ++attempt) {
    if (attempt > 1) {
      std::this_thread::sleep_for(
          std::chrono::duration<double>(BackoffSeconds(options, attempt - 1)));
    }
    out.attempts = attempt;
    const auto attempt_start = std::chrono::steady_clock::now();
    httplib::Result res = client.Post(path, headers, body, "application/json");
    if (!res) {
      const httplib::Error err = res.error();
      out.http_status = 0;
      const double waited = SecondsSince(attempt_start);
      if (err == httplib::Error::Read && waited + 0.05 >= options.timeout_seconds) {
        out.error_code = "timeout";
        out.error =
            "no response within " + agent_internal::FormatDouble(options.timeout_seconds) + " s";
      } else if (err == httplib::Error::ConnectionTimeout) {
        out.error_code = "timeout";
        out.error = "could not connect within " +
                    agent_internal::FormatDouble(options.connect_timeout_seconds) + " s";
      } else if (err == httplib::Error::Connection) {
        // httplib keeps no errno: connect once more to learn why.
        const std::string reason = agent_internal::ConnectFailureReason(
            url->host, url->port, options.connect_timeout_seconds);
        out.error_code = "connection";
        out.error = "cannot connect: " + (reason.empty() ? httplib::to_string(err) : reason);
      } else {
        out.error_code = "connection";
        out.error = "request failed: " + httplib::to_string(err);
      }
      continue;
    }
    const AttemptVerdict verdict = JudgeResponse(res.value(), target, &out);
    if (verdict == AttemptVerdict::kOk) {
      out.ok = true;
      break;
    }
    if (verdict == AttemptVerdict::kFinal) break;
  }
  if (!out.ok && out.attempts > 1) {
    out.error += " (after " + std::to_string(out.attempts) + " attempts)";
  }
  out.seconds = SecondsSince(start);
  return out;
}

}  // namespace

Status CheckEngineUrls(const std::vector<std::string>& engines) {
  if (engines.empty()) return Status::InvalidArgument("sync needs at least one engine");
  for (const std::string& engine : engines) {
    Result<HttpUrl> url = ParseHttpUrl(engine);
    if (!url.ok()) return Status::InvalidArgument("engine " + url.status().message());
  }
  return Status::OK();
}

std::vector<EnginePullOutcome> PullOnEngines(const std::vector<std::string>& engines,
                                             std::optional<int64_t> target,
                                             const EnginePullOptions& options) {
  std::vector<EnginePullOutcome> outcomes(engines.size());
  std::vector<std::thread> threads;
  threads.reserve(engines.size());
  for (size_t i = 0; i < engines.size(); ++i) {
    threads.emplace_back([&, i] { outcomes[i] = PullOnEngine(engines[i], target, options); });
  }
  for (std::thread& t : threads) t.join();
  return outcomes;
}

Status SummarizeEngineOutcomes(const std::vector<EnginePullOutcome>& outcomes) {
  size_t failed = 0;
  std::string reasons;
  for (const EnginePullOutcome& o : outcomes) {
    if (o.ok) continue;
    ++failed;
    if (!reasons.empty()) reasons += "; ";
    reasons += o.engine + ": " + (o.error.empty() ? "failed" : o.error);
  }
  if (failed == 0) return Status::OK();
  return Status::Aborted(std::to_string(failed) + " of " + std::to_string(outcomes.size()) +
                         " engines failed: " + reasons);
}

std::string SyncReportToJson(const SyncReport& report) {
  json engines = json::array();
  for (const EnginePullOutcome& o : report.engines) {
    json e = {{"engine", o.engine},
              {"ok", o.ok},
              {"seconds", o.seconds},
              {"attempts", o.attempts},
              {"http_status", o.http_status},
              {"version", o.version ? json(*o.version) : json(nullptr)},
              {"applied", o.applied},
              {"bytes_read", o.bytes_read},
              {"tensors_changed", o.tensors_changed}};
    if (!o.ok) {
      e["error"] = o.error;
      e["code"] = o.error_code;
    }
    engines.push_back(std::move(e));
  }
  const PublishResult& p = report.publish;
  json publish = {{"version", p.info.version},
                  {"delta", p.info.is_delta},
                  {"tensors", p.tensors},
                  {"tensors_changed", p.tensors_changed},
                  {"changed_elements", p.changed_elements},
                  {"total_elements", p.total_elements},
                  {"bytes_written", p.bytes_written},
                  {"seconds", p.seconds}};
  if (p.info.is_delta) {
    publish["base_version"] = p.info.base_version;
    publish["encoding"] = std::string(EncodingName(p.info.encoding));
  }
  json out = {{"ok", report.status.ok()},
              {"version", report.version},
              {"publish_seconds", report.publish_seconds},
              {"publish", std::move(publish)},
              {"pull_seconds", report.pull_seconds},
              {"total_seconds", report.total_seconds},
              {"engines", std::move(engines)}};
  if (!report.status.ok()) out["error"] = report.status.message();
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace deltasync
