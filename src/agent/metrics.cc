#include "agent/metrics.h"

#include <algorithm>

#include "agent/http_util.h"

namespace deltasync::agent_internal {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), per_bucket_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  // Prometheus buckets are "less than or equal": a value on a bound counts in it.
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                       bounds_.begin());
  ++per_bucket_[i];
  sum_ += value;
  ++count_;
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(per_bucket_.size());
  uint64_t running = 0;
  for (size_t i = 0; i < per_bucket_.size(); ++i) {
    running += per_bucket_[i];
    out[i] = running;
  }
  return out;
}

std::vector<double> DefaultPullSecondsBuckets() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}

AgentMetrics::AgentMetrics()
    : pull_seconds_(DefaultPullSecondsBuckets()), reload_seconds_(DefaultPullSecondsBuckets()) {}

void AgentMetrics::RecordPullSuccess(double seconds, uint64_t bytes_read) {
  std::lock_guard<std::mutex> lock(mu_);
  ++pulls_;
  bytes_read_ += bytes_read;
  pull_seconds_.Observe(seconds);
}

void AgentMetrics::RecordPullFailure() {
  std::lock_guard<std::mutex> lock(mu_);
  ++pulls_;
  ++pull_failures_;
}

void AgentMetrics::RecordReload(bool ok, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++reloads_;
  if (!ok) ++reload_failures_;
  reload_seconds_.Observe(seconds);
}

void AgentMetrics::RecordRejected() {
  std::lock_guard<std::mutex> lock(mu_);
  ++rejected_;
}

void AgentMetrics::SetAppliedVersion(std::optional<int64_t> version) {
  std::lock_guard<std::mutex> lock(mu_);
  applied_version_ = version;
}

void AgentMetrics::SetBusy(bool busy) {
  std::lock_guard<std::mutex> lock(mu_);
  busy_ = busy;
}

namespace {

void Family(std::string* out, const char* name, const char* type, const char* help) {
  *out += "# HELP ";
  *out += name;
  *out += ' ';
  *out += help;
  *out += "\n# TYPE ";
  *out += name;
  *out += ' ';
  *out += type;
  *out += '\n';
}

void Sample(std::string* out, const std::string& name, const std::string& value) {
  *out += name;
  *out += ' ';
  *out += value;
  *out += '\n';
}

void HistogramSamples(std::string* out, const char* name, const Histogram& h) {
  const std::vector<uint64_t> cumulative = h.CumulativeCounts();
  for (size_t i = 0; i < cumulative.size(); ++i) {
    const std::string le = i < h.bounds().size() ? FormatDouble(h.bounds()[i]) : "+Inf";
    Sample(out, std::string(name) + "_bucket{le=\"" + le + "\"}", std::to_string(cumulative[i]));
  }
  Sample(out, std::string(name) + "_sum", FormatDouble(h.sum()));
  Sample(out, std::string(name) + "_count", std::to_string(h.count()));
}

}  // namespace

void AgentMetrics::RecordRequest(double cpu_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_;
  request_cpu_seconds_ += cpu_seconds;
}

std::string AgentMetrics::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  Family(&out, "deltasync_agent_pulls_total", "counter",
         "Pulls of the local checkpoint attempted (requests that passed validation).");
  Sample(&out, "deltasync_agent_pulls_total", std::to_string(pulls_));
  Family(&out, "deltasync_agent_pull_failures_total", "counter",
         "Pulls that failed (the checkpoint stays at its last committed version).");
  Sample(&out, "deltasync_agent_pull_failures_total", std::to_string(pull_failures_));
  Family(&out, "deltasync_agent_bytes_read_total", "counter",
         "Bytes of version files read or copied by successful pulls.");
  Sample(&out, "deltasync_agent_bytes_read_total", std::to_string(bytes_read_));
  Family(&out, "deltasync_agent_rejected_requests_total", "counter",
         "Requests refused with a 4xx status before anything was changed.");
  Sample(&out, "deltasync_agent_rejected_requests_total", std::to_string(rejected_));
  Family(&out, "deltasync_agent_reloads_total", "counter", "Engine reloads attempted.");
  Sample(&out, "deltasync_agent_reloads_total", std::to_string(reloads_));
  Family(&out, "deltasync_agent_reload_failures_total", "counter", "Engine reloads that failed.");
  Sample(&out, "deltasync_agent_reload_failures_total", std::to_string(reload_failures_));
  Family(&out, "deltasync_agent_apply_seconds", "histogram",
         "Duration of successful pulls (apply and verify), in seconds.");
  HistogramSamples(&out, "deltasync_agent_apply_seconds", pull_seconds_);
  Family(&out, "deltasync_agent_reload_seconds", "histogram",
         "Duration of engine reloads, in seconds.");
  HistogramSamples(&out, "deltasync_agent_reload_seconds", reload_seconds_);
  Family(&out, "deltasync_agent_applied_version", "gauge",
         "Version the local checkpoint holds (-1 when none is committed).");
  Sample(&out, "deltasync_agent_applied_version", std::to_string(applied_version_.value_or(-1)));
  Family(&out, "deltasync_agent_busy", "gauge", "1 while a pull is in flight, else 0.");
  Sample(&out, "deltasync_agent_busy", busy_ ? "1" : "0");
  Family(&out, "deltasync_agent_connections_total", "counter",
         "Connections served by the request threads (one request each).");
  Sample(&out, "deltasync_agent_connections_total", std::to_string(requests_));
  Family(&out, "deltasync_agent_request_cpu_seconds_total", "counter",
         "CPU time the request threads spent reading requests and answering them; pulls run "
         "on a thread of their own and are not included.");
  Sample(&out, "deltasync_agent_request_cpu_seconds_total", FormatDouble(request_cpu_seconds_));
  return out;
}

}  // namespace deltasync::agent_internal
