// Runs the real `deltasync bench` on a tiny synthetic model and checks its
// report: every key present, figures positive and finite, sizes consistent
// with the documented formats, and the error contract.
#include <sys/wait.h>

#include <gtest/gtest.h>

#include "cli_test_util.h"
#include "deltasync/codec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace deltasync {
namespace {

using testing_cli::CliRun;
using testing_cli::CountLines;
using testing_cli::RunCli;

// A 4 MiB model: the whole bench then takes well under a second.
constexpr const char* kTinyArgs = "bench --preset tiny --bytes 4MiB --repeat 1 --seed 7";

// The tiny run's JSON, produced once for all the tests that read it.
const nlohmann::json& TinyReport() {
  static const nlohmann::json* report = [] {
    CliRun r = RunCli(std::string(kTinyArgs) + " --threads 2 --json");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;  // stderr is not a terminal: no progress
    auto* j = new nlohmann::json(nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false));
    return j;
  }();
  return *report;
}

void ExpectPositiveNumber(const nlohmann::json& parent, const std::string& key) {
  ASSERT_TRUE(parent.contains(key)) << "missing key " << key << " in " << parent.dump();
  ASSERT_TRUE(parent[key].is_number()) << key << " = " << parent[key].dump();
  const double v = parent[key].get<double>();
  EXPECT_TRUE(std::isfinite(v)) << key;
  EXPECT_GT(v, 0.0) << key;
}

TEST(BenchCliTest, JsonHasEveryKeyWithPositiveFiniteFigures) {
  const nlohmann::json& j = TinyReport();
  ASSERT_TRUE(j.is_object()) << "output is not one JSON object";

  ASSERT_TRUE(j.contains("config"));
  const nlohmann::json& config = j["config"];
  EXPECT_EQ(config["preset"], "tiny");
  EXPECT_EQ(config["seed"], 7);
  EXPECT_EQ(config["threads"], 2);
  EXPECT_EQ(config["repeat"], 1);
  for (const char* key : {"scale", "bytes", "lr"}) ExpectPositiveNumber(config, key);
  // SynthScaleForBytes promises the closest size; 4 MiB is well inside tiny's range.
  EXPECT_NEAR(config["bytes"].get<double>(), 4.0 * (1 << 20), 0.05 * 4.0 * (1 << 20));

  ASSERT_TRUE(j.contains("cpu"));
  EXPECT_TRUE(j["cpu"].is_string());
  EXPECT_FALSE(j["cpu"].get<std::string>().empty());

  for (const char* key :
       {"memcpy_gbps", "diff_gbps", "changed", "numel", "density", "entropy_bytes_per_changed"}) {
    ExpectPositiveNumber(j, key);
  }
  ASSERT_TRUE(j.contains("diff"));
  const nlohmann::json& diff = j["diff"];
  for (const char* key : {"gbps_1t", "gbps_nt", "vs_memcpy_1t", "vs_memcpy_nt"}) {
    ExpectPositiveNumber(diff, key);
  }
  ASSERT_TRUE(diff["kernel"].is_string());
  const std::string kernel = diff["kernel"];
  EXPECT_TRUE(kernel == "scalar" || kernel == "avx2" || kernel == "avx512") << kernel;
  EXPECT_EQ(j["diff_gbps"], diff["gbps_1t"]);
  // The ratio is a time ratio: memcpy rate over diff rate.
  EXPECT_NEAR(diff["vs_memcpy_1t"].get<double>(),
              j["memcpy_gbps"].get<double>() / diff["gbps_1t"].get<double>(),
              1e-9 * diff["vs_memcpy_1t"].get<double>());

  ASSERT_TRUE(j.contains("encodings"));
  // Every encoding the library has, by default.
  for (Encoding encoding : AllEncodings()) {
    const std::string name(EncodingName(encoding));
    SCOPED_TRACE(name);
    ASSERT_TRUE(j["encodings"].contains(name));
    const nlohmann::json& e = j["encodings"][name];
    for (const char* key :
         {"encode_gbps_1t", "encode_gbps_nt", "decode_apply_gbps_1t", "decode_apply_gbps_nt",
          "encode_gbps", "decode_apply_gbps", "bytes", "bytes_per_changed"}) {
      ExpectPositiveNumber(e, key);
    }
    EXPECT_EQ(e["encode_gbps"], e["encode_gbps_1t"]);
    EXPECT_EQ(e["decode_apply_gbps"], e["decode_apply_gbps_1t"]);
    EXPECT_NEAR(e["bytes_per_changed"].get<double>(),
                e["bytes"].get<double>() / j["changed"].get<double>(), 1e-9);
  }
  ASSERT_TRUE(j.contains("ratios"));
  for (const char* key :
       {"sparse_vs_entropy", "sparse_vs_xor", "sparse_vs_xor_zstd1", "sparse_vs_indices"}) {
    ExpectPositiveNumber(j["ratios"], key);
  }
  for (const char* key : {"zstd1_bytes", "zstd1_bytes_per_changed"}) {
    ExpectPositiveNumber(j["encodings"]["xor"], key);
  }
}

TEST(BenchCliTest, FiguresAreConsistentWithTheFormats) {
  const nlohmann::json& j = TinyReport();
  ASSERT_TRUE(j.is_object());
  const double changed = j["changed"], numel = j["numel"];
  ASSERT_GT(changed, 0);
  EXPECT_LE(changed, numel);
  const double density = j["density"];
  EXPECT_GT(density, 0.0);
  EXPECT_LT(density, 0.2);
  EXPECT_NEAR(density, changed / numel, 1e-12);
  // Every tensor is BF16.
  EXPECT_EQ(j["config"]["bytes"].get<double>(), 2 * numel);

  const nlohmann::json& enc = j["encodings"];
  // docs/format.md: dense is the raw new bytes of every tensor; indices is a
  // 24-byte header plus an i32 position and a 2-byte value per change.
  EXPECT_EQ(enc["dense"]["bytes"], j["config"]["bytes"]);
  EXPECT_EQ(enc["dense"]["tensors"], j["tensors"]);
  EXPECT_EQ(enc["indices"]["bytes"].get<double>(),
            24.0 * enc["indices"]["tensors"].get<double>() + 6.0 * changed);

  const double sparse = enc["sparse"]["bytes_per_changed"];
  EXPECT_LT(sparse, enc["indices"]["bytes_per_changed"].get<double>());
  EXPECT_LT(sparse, enc["xor"]["bytes_per_changed"].get<double>());
  EXPECT_LT(sparse, enc["overwrite"]["bytes_per_changed"].get<double>());
  EXPECT_LT(sparse, enc["dense"]["bytes_per_changed"].get<double>());
  // No encoder beats the i.i.d. bound by much: a much smaller size would
  // mean the bound or the byte count is wrong.
  EXPECT_GT(sparse, 0.5 * j["entropy_bytes_per_changed"].get<double>());

  const nlohmann::json& ratios = j["ratios"];
  EXPECT_NEAR(ratios["sparse_vs_indices"].get<double>(),
              sparse / enc["indices"]["bytes_per_changed"].get<double>(), 1e-9);
  EXPECT_NEAR(ratios["sparse_vs_xor"].get<double>(),
              sparse / enc["xor"]["bytes_per_changed"].get<double>(), 1e-9);
  EXPECT_NEAR(ratios["sparse_vs_entropy"].get<double>(),
              sparse / j["entropy_bytes_per_changed"].get<double>(), 1e-9);
  // xor as the peers write it (zstd -1): the yardstick of the 0.7x target,
  // and larger than our frames of the same format.
  const double zstd1 = enc["xor"]["zstd1_bytes_per_changed"];
  EXPECT_NEAR(zstd1, enc["xor"]["zstd1_bytes"].get<double>() / changed, 1e-9);
  EXPECT_GT(zstd1, enc["xor"]["bytes_per_changed"].get<double>());
  EXPECT_NEAR(ratios["sparse_vs_xor_zstd1"].get<double>(), sparse / zstd1, 1e-9);
}

TEST(BenchCliTest, SubsetOfEncodingsIsDeterministicAcrossRuns) {
  const nlohmann::json& full = TinyReport();
  ASSERT_TRUE(full.is_object());
  CliRun r = RunCli(std::string(kTinyArgs) + " --threads 1 --encodings sparse,xor,sparse --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["config"]["threads"], 1);
  EXPECT_EQ(j["encodings"].size(), 2u);
  EXPECT_TRUE(j["encodings"].contains("sparse"));
  EXPECT_TRUE(j["encodings"].contains("xor"));
  EXPECT_TRUE(j["ratios"]["sparse_vs_indices"].is_null());
  EXPECT_FALSE(j["ratios"]["sparse_vs_xor"].is_null());
  // Same seed, same step: the data do not depend on the thread count.
  EXPECT_EQ(j["changed"], full["changed"]);
  EXPECT_EQ(j["encodings"]["sparse"]["bytes"], full["encodings"]["sparse"]["bytes"]);
  EXPECT_EQ(j["encodings"]["xor"]["bytes"], full["encodings"]["xor"]["bytes"]);
}

TEST(BenchCliTest, TextReportHasTheTable) {
  CliRun r = RunCli(kTinyArgs);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* word : {"cpu:", "memcpy", "diff (", "entropy", "sparse / xor"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << word << "\n" << r.out;
  }
  for (Encoding encoding : AllEncodings()) {
    const std::string name(EncodingName(encoding));
    EXPECT_NE(r.out.find("\n" + name + " "), std::string::npos) << name;
  }
}

TEST(BenchCliTest, BadArgumentsFailWithOneLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--bytes 12XB", "12XB"},
      {"--bytes 0", "--bytes"},
      {"--bytes lots", "lots"},
      {"--bytes 4MiB --preset qwen9-000b", "qwen9-000b"},
      {"--bytes 4MiB --preset tiny --encodings sparse,zip", "zip"},
      {"--bytes 4MiB --preset tiny --repeat 0", "--repeat"},
      {"--sharded", "--sharded needs --stream"},
      {"--trainer-ranks 2", "--trainer-ranks needs --stream"},
      {"--stream --trainer-ranks 2,x", "--trainer-ranks: 'x' is not a count in [1, 64]"},
      {"--stream --sharded --trainer-ranks 0", "--trainer-ranks: '0'"},
      {"--stream --sharded --sizes 12KiB", "below 1MiB"},
      {"--stream --sharded --links 1", "--links does not apply to --sharded"},
  };
  for (const auto& [args, named] : cases) {
    SCOPED_TRACE(args);
    CliRun r = RunCli("bench " + args);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

// Two trainer ranks as processes and a receiver: every rank reports its
// shards (together the model) and a peak beyond its shards and snapshot of
// a few buckets, not of the model.
TEST(BenchCliTest, ShardedStreamReportsEachRanksMemoryBeyondItsShards) {
  CliRun r = RunCli(
      "bench --stream --sharded --preset tiny --sizes 4MiB --trainer-ranks 2 --bucket 64KiB "
      "--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  ASSERT_EQ(j["rows"].size(), 1u);
  const nlohmann::json& row = j["rows"][0];
  ASSERT_EQ(row["ranks"].size(), 2u);
  uint64_t shards = 0;
  for (const nlohmann::json& rank : row["ranks"]) {
    shards += rank["shard_bytes"].get<uint64_t>();
    EXPECT_GT(rank["seed_s"].get<double>(), 0);
    EXPECT_GT(rank["delta_s"].get<double>(), 0);
    EXPECT_LT(rank["seed_beyond_shards_and_snapshot_bytes"].get<uint64_t>(), uint64_t{64} << 20);
    EXPECT_LT(rank["delta_beyond_shards_and_snapshot_bytes"].get<uint64_t>(), uint64_t{64} << 20);
  }
  EXPECT_EQ(shards, row["model_bytes"].get<uint64_t>());
}

TEST(BenchCliTest, ByteSizesAcceptUnits) {
  // 4 MiB written three ways must pick the same model.
  for (const char* bytes : {"4194304", "4MiB", "4096KiB"}) {
    SCOPED_TRACE(bytes);
    CliRun r = RunCli(std::string("bench --preset tiny --repeat 1 --encodings dense --json "
                                  "--bytes ") +
                      bytes);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["config"]["requested_bytes"], 4194304);
    EXPECT_EQ(j["config"]["bytes"], TinyReport()["config"]["bytes"]);
  }
}

// The agent benchmark end to end on a tiny model: the overhead versions
// are pulled both ways, every load version by the loaded and the quiet agent,
// the /status load got answers, and all three checkpoints verified.
TEST(BenchAgentTest, JsonReportsPairedPullsAndTheLoad) {
  CliRun r = RunCli(
      "demo --bench-agent --preset tiny --bytes 4MiB --bench-versions 2 --status-threads 2 "
      "--json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["verified"], true);
  const nlohmann::json& overhead = j["overhead"];
  EXPECT_EQ(overhead["versions"], 2);
  EXPECT_EQ(overhead["http_ms"].size(), 2u);
  EXPECT_EQ(overhead["direct_ms"].size(), 2u);
  const nlohmann::json& load = j["load"];
  ASSERT_EQ(load["loaded_ms"].size(), 2u);
  ASSERT_EQ(load["unloaded_ms"].size(), 2u);
  ASSERT_EQ(load["pair_ratios"].size(), 2u);
  double worst = 0;
  for (size_t i = 0; i < 2; ++i) {
    const double ratio = load["loaded_ms"][i].get<double>() / load["unloaded_ms"][i].get<double>();
    EXPECT_NEAR(load["pair_ratios"][i].get<double>(), ratio, 1e-9);
    worst = std::max(worst, ratio);
  }
  EXPECT_NEAR(load["worst_pair_ratio"].get<double>(), worst, 1e-9);
  std::vector<double> loaded = load["loaded_ms"].get<std::vector<double>>();
  std::vector<double> quiet = load["unloaded_ms"].get<std::vector<double>>();
  std::sort(loaded.begin(), loaded.end());
  std::sort(quiet.begin(), quiet.end());
  EXPECT_NEAR(load["worst_quantile_ratio"].get<double>(),
              std::max(loaded[0] / quiet[0], loaded[1] / quiet[1]), 1e-9);
  ASSERT_EQ(load["swapped_pair_ratios"].size(), 1u);
  EXPECT_NEAR(
      load["swapped_pair_ratios"][0].get<double>(),
      std::sqrt(load["pair_ratios"][0].get<double>() * load["pair_ratios"][1].get<double>()), 1e-9);
  EXPECT_NEAR(load["worst_swapped_pair_ratio"].get<double>(),
              load["swapped_pair_ratios"][0].get<double>(), 1e-9);
  EXPECT_EQ(load["status_client_nice"], 19);
  EXPECT_GT(load["status_p99_ms"].get<double>(), 0.0);
  EXPECT_GE(load["status_max_ms"].get<double>(), load["status_p99_ms"].get<double>());
  EXPECT_GE(load["status_p99_ms"].get<double>(), load["status_p50_ms"].get<double>());
  EXPECT_EQ(load["status_threads"], 2);
  EXPECT_EQ(load["status_errors"], 0);
  ExpectPositiveNumber(load, "status_requests");
  ExpectPositiveNumber(load, "idle_load_requests");
  ExpectPositiveNumber(load, "idle_load_seconds");
  EXPECT_GE(load["idle_load_cpu_seconds"].get<double>(), 0.0);
  // The agent counted the load's connections (each client request is one).
  EXPECT_GE(load["idle_load_agent_connections"].get<double>(),
            load["idle_load_requests"].get<double>() - 4);
  EXPECT_GT(load["idle_load_agent_cpu_seconds"].get<double>(), 0.0);
}

TEST(BenchAgentTest, RejectsTooFewVersions) {
  CliRun r = RunCli("demo --bench-agent --preset tiny --bytes 4MiB --bench-versions 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("bench-versions"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace deltasync
