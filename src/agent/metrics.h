// The agent's counters and their Prometheus text exposition (format 0.0.4).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace deltasync::agent_internal {

// A cumulative histogram with fixed upper bounds.
class Histogram {
 public:
  // `bounds` ascending and finite; the +Inf bucket is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  const std::vector<double>& bounds() const { return bounds_; }
  // Observations <= bounds()[i] for each i, then the total count.
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> per_bucket_;  // bounds_.size() + 1 (the last: > every bound)
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Seconds buckets for a pull: from a no-op (milliseconds) to a full copy of a
// large model (minutes).
std::vector<double> DefaultPullSecondsBuckets();

// Everything /metrics reports. Thread-safe.
class AgentMetrics {
 public:
  AgentMetrics();
  // A pull that reached the checkpoint and succeeded (`seconds`: its
  // duration, `bytes_read`: PullResult::bytes_read).
  void RecordPullSuccess(double seconds, uint64_t bytes_read);
  void RecordPullFailure();
  void RecordReload(bool ok, double seconds);
  // A request refused with a 4xx before anything was touched.
  void RecordRejected();
  void SetAppliedVersion(std::optional<int64_t> version);
  void SetBusy(bool busy);
  // A connection served by a request thread and the CPU time that thread
  // spent on it (pulls run elsewhere and are not included).
  void RecordRequest(double cpu_seconds);

  // The exposition text: HELP and TYPE lines for every family, then its samples.
  std::string Render() const;

 private:
  mutable std::mutex mu_;
  uint64_t pulls_ = 0;
  uint64_t pull_failures_ = 0;
  uint64_t bytes_read_ = 0;
  uint64_t reloads_ = 0;
  uint64_t reload_failures_ = 0;
  uint64_t rejected_ = 0;
  std::optional<int64_t> applied_version_;
  bool busy_ = false;
  uint64_t requests_ = 0;
  double request_cpu_seconds_ = 0;
  Histogram pull_seconds_;
  Histogram reload_seconds_;
};

}  // namespace deltasync::agent_internal
