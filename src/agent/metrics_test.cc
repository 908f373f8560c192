#include "agent/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <sstream>

namespace deltasync::agent_internal {
namespace {

TEST(HistogramTest, BucketsAreLessOrEqualAndCumulative) {
  Histogram h({0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 1.0, 3.0, 100.0}) h.Observe(v);
  // 0.05 and 0.1 (on the bound) <= 0.1; then 0.5 and 1.0 <= 1; 3 <= 10; 100 only in +Inf.
  EXPECT_EQ(h.CumulativeCounts(), std::vector<uint64_t>({2, 4, 5, 6}));
  EXPECT_EQ(h.count(), 6u);
  EXPECT_DOUBLE_EQ(h.sum(), 0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 100.0);
}

// A small reader of the Prometheus text format, written from the format's
// description, independent of the writer.
struct Exposition {
  std::map<std::string, std::string> help;
  std::map<std::string, std::string> type;
  // sample name (with labels) -> value, in order of appearance
  std::vector<std::pair<std::string, double>> samples;
  std::string error;
};

Exposition ParseExposition(const std::string& text) {
  Exposition out;
  std::istringstream in(text);
  std::string line;
  std::set<std::string> families_done;
  std::string current_family;
  if (text.empty() || text.back() != '\n') out.error = "text must end with a newline";
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) {
      const std::string rest = line.substr(7);
      const size_t space = rest.find(' ');
      if (space == std::string::npos) {
        out.error = "comment without text: " + line;
        return out;
      }
      const std::string name = rest.substr(0, space);
      if (line[2] == 'H') {
        out.help[name] = rest.substr(space + 1);
      } else {
        const std::string type = rest.substr(space + 1);
        if (type != "counter" && type != "gauge" && type != "histogram" && type != "summary" &&
            type != "untyped") {
          out.error = "bad type: " + line;
          return out;
        }
        if (families_done.count(name)) {
          out.error = "family declared twice: " + name;
          return out;
        }
        out.type[name] = type;
      }
      if (name != current_family) {
        if (!current_family.empty()) families_done.insert(current_family);
        current_family = name;
      }
      continue;
    }
    if (line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) {
      out.error = "sample without value: " + line;
      return out;
    }
    const std::string name = line.substr(0, space);
    const std::string value_text = line.substr(space + 1);
    double value = 0;
    if (value_text == "+Inf") {
      value = HUGE_VAL;
    } else {
      size_t used = 0;
      try {
        value = std::stod(value_text, &used);
      } catch (...) {
        used = 0;
      }
      if (used != value_text.size()) {
        out.error = "bad value: " + line;
        return out;
      }
    }
    const std::string bare = name.substr(0, name.find('{'));
    for (char c : bare) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ':')) {
        out.error = "bad metric name: " + bare;
        return out;
      }
    }
    out.samples.emplace_back(name, value);
  }
  return out;
}

std::string FamilyOf(const std::string& sample_name, const Exposition& e) {
  std::string bare = sample_name.substr(0, sample_name.find('{'));
  if (e.type.count(bare)) return bare;
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s = suffix;
    if (bare.size() > s.size() && bare.compare(bare.size() - s.size(), s.size(), s) == 0) {
      const std::string base = bare.substr(0, bare.size() - s.size());
      if (e.type.count(base) && e.type.at(base) == "histogram") return base;
    }
  }
  return "";
}

TEST(AgentMetricsTest, ExpositionParsesAndHistogramsAreCumulative) {
  AgentMetrics m;
  m.RecordPullSuccess(0.02, 100);
  m.RecordPullSuccess(0.7, 50);
  m.RecordPullSuccess(1000, 1);  // beyond every bound
  m.RecordPullFailure();
  m.RecordRejected();
  m.RecordReload(true, 0.3);
  m.SetAppliedVersion(12);
  const Exposition e = ParseExposition(m.Render());
  ASSERT_TRUE(e.error.empty()) << e.error;

  std::map<std::string, double> values;
  for (const auto& [name, value] : e.samples) {
    const std::string family = FamilyOf(name, e);
    EXPECT_FALSE(family.empty()) << "sample without a TYPE line: " << name;
    EXPECT_TRUE(e.help.count(family)) << "family without a HELP line: " << family;
    values[name] = value;
  }
  EXPECT_EQ(e.type.at("deltasync_agent_pulls_total"), "counter");
  EXPECT_EQ(e.type.at("deltasync_agent_apply_seconds"), "histogram");
  EXPECT_EQ(e.type.at("deltasync_agent_applied_version"), "gauge");
  EXPECT_EQ(values.at("deltasync_agent_pulls_total"), 4);
  EXPECT_EQ(values.at("deltasync_agent_pull_failures_total"), 1);
  EXPECT_EQ(values.at("deltasync_agent_bytes_read_total"), 151);
  EXPECT_EQ(values.at("deltasync_agent_rejected_requests_total"), 1);
  EXPECT_EQ(values.at("deltasync_agent_applied_version"), 12);
  EXPECT_EQ(values.at("deltasync_agent_apply_seconds_count"), 3);
  EXPECT_DOUBLE_EQ(values.at("deltasync_agent_apply_seconds_sum"), 1000.72);

  // Buckets: le labels ascending, counts non-decreasing, +Inf last and equal to _count.
  std::vector<std::pair<double, double>> buckets;
  for (const auto& [name, value] : e.samples) {
    const std::string prefix = "deltasync_agent_apply_seconds_bucket{le=\"";
    if (name.rfind(prefix, 0) != 0) continue;
    ASSERT_EQ(name.substr(name.size() - 2), "\"}") << name;
    const std::string le = name.substr(prefix.size(), name.size() - prefix.size() - 2);
    buckets.emplace_back(le == "+Inf" ? HUGE_VAL : std::stod(le), value);
  }
  ASSERT_GE(buckets.size(), 2u);
  for (size_t i = 1; i < buckets.size(); ++i) {
    EXPECT_LT(buckets[i - 1].first, buckets[i].first);
    EXPECT_LE(buckets[i - 1].second, buckets[i].second);
  }
  EXPECT_EQ(buckets.back().first, HUGE_VAL);
  EXPECT_EQ(buckets.back().second, 3);
  // 0.02 s falls in le=0.025 and every bucket above it; 0.7 s from le=1 on.
  for (const auto& [le, count] : buckets) {
    const double expected = (le >= 0.02 ? 1 : 0) + (le >= 0.7 ? 1 : 0) + (le >= 1000 ? 1 : 0);
    EXPECT_EQ(count, expected) << "le=" << le;
  }
}

TEST(AgentMetricsTest, NoVersionIsMinusOne) {
  AgentMetrics m;
  const Exposition e = ParseExposition(m.Render());
  ASSERT_TRUE(e.error.empty()) << e.error;
  bool found = false;
  for (const auto& [name, value] : e.samples) {
    if (name == "deltasync_agent_applied_version") {
      found = true;
      EXPECT_EQ(value, -1);
    }
  }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace deltasync::agent_internal
