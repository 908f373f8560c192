// Runs the real `deltasync bench --e2e` on a tiny synthetic model and checks
// its report: every key, the bit-exactness verdicts, figures that agree with
// each other and with the in-memory bench, the work directory's lifetime,
// the peer being skipped cleanly, and a wrong pull being caught.
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_test_util.h"

namespace deltasync {
namespace {

namespace fs = std::filesystem;
using testing_cli::CliRun;
using testing_cli::CountLines;
using testing_cli::RunCli;

constexpr const char* kTinyArgs = "bench --e2e --preset tiny --bytes 4MiB --seed 7";

std::string UniqueDir(const std::string& name) {
  static int counter = 0;
  return ::testing::TempDir() + "/bench_e2e_" + std::to_string(getpid()) + "_" + name + "_" +
         std::to_string(counter++);
}

bool PeerCanRun() {
  return std::system("/usr/bin/python3 -c 'import numpy, zstandard, xxhash' >/dev/null 2>&1") == 0;
}

struct Report {
  nlohmann::json json;
  std::string workdir;
};

// The tiny run's JSON, produced once for the tests that read it.
const Report& TinyReport() {
  static const Report* report = [] {
    auto* r = new Report;
    r->workdir = UniqueDir("main");
    CliRun run = RunCli(std::string(kTinyArgs) + " --json --workdir " + r->workdir);
    EXPECT_EQ(run.exit_code, 0) << run.err;
    EXPECT_TRUE(run.err.empty()) << run.err;  // stderr is not a terminal: no progress
    r->json = nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
    return r;
  }();
  return *report;
}

void ExpectPositive(const nlohmann::json& parent, const std::string& key) {
  ASSERT_TRUE(parent.contains(key)) << "missing key " << key << " in " << parent.dump();
  ASSERT_TRUE(parent[key].is_number()) << key << " = " << parent[key].dump();
  const double v = parent[key].get<double>();
  EXPECT_TRUE(std::isfinite(v)) << key;
  EXPECT_GT(v, 0.0) << key;
}

void ExpectTotalIsSum(const nlohmann::json& m) {
  EXPECT_NEAR(m["total_s"].get<double>(), m["publish_s"].get<double>() + m["pull_s"].get<double>(),
              1e-9);
}

TEST(BenchE2eTest, JsonHasEveryKeyAndEveryPullIsBitExact) {
  const nlohmann::json& j = TinyReport().json;
  ASSERT_TRUE(j.is_object()) << "output is not one JSON object";
  EXPECT_EQ(j["mode"], "e2e");
  const nlohmann::json& config = j["config"];
  EXPECT_EQ(config["preset"], "tiny");
  EXPECT_EQ(config["seed"], 7);
  EXPECT_EQ(config["repeat"], 1);  // --e2e's default
  EXPECT_EQ(config["requested_bytes"], 4 << 20);
  EXPECT_EQ(config["page_cache"], "hot");
  EXPECT_TRUE(config["load_average_start"].is_number());
  EXPECT_GT(config["rss_floor_mib"].get<double>(), 0.0);
  EXPECT_EQ(config["bytes"], j["model_bytes"]);
  EXPECT_NEAR(j["model_bytes"].get<double>(), 4.0 * (1 << 20), 0.05 * 4.0 * (1 << 20));
  for (const char* key : {"model_bytes", "largest_tensor_bytes", "numel", "changed", "density"}) {
    ExpectPositive(j, key);
  }
  EXPECT_LT(j["largest_tensor_bytes"].get<double>(), j["model_bytes"].get<double>());
  EXPECT_EQ(j["model_bytes"].get<double>(), 2 * j["numel"].get<double>());  // all BF16
  EXPECT_NEAR(j["density"].get<double>(), j["changed"].get<double>() / j["numel"].get<double>(),
              1e-12);
  EXPECT_LT(j["density"].get<double>(), 0.2);

  for (const char* enc : {"sparse", "xor"}) {
    SCOPED_TRACE(enc);
    ASSERT_TRUE(j["deltasync"].contains(enc));
    const nlohmann::json& m = j["deltasync"][enc];
    for (const char* key :
         {"publish_s", "pull_s", "total_s", "bytes", "pull_bytes_read", "publish_self_s",
          "pull_self_s", "publish_peak_rss_mib", "pull_peak_rss_mib", "publish_peak_anon_mib",
          "pull_peak_anon_mib", "pull_durable_s", "total_durable_s", "tensors_changed",
          "publish_cpu_s", "pull_cpu_s"}) {
      ExpectPositive(m, key);
    }
    ExpectTotalIsSum(m);
    EXPECT_EQ(m["verified"], true);
    // A delta is far smaller than the model.
    EXPECT_LT(m["bytes"].get<double>(), j["model_bytes"].get<double>());
    // The wall time around the process covers the command's own time.
    EXPECT_GE(m["pull_s"].get<double>(), m["pull_self_s"].get<double>());
  }
  EXPECT_EQ(j["deltasync"]["sparse"]["tensors_changed"], j["deltasync"]["xor"]["tensors_changed"]);
  EXPECT_LT(j["deltasync"]["sparse"]["bytes"].get<double>(),
            j["deltasync"]["xor"]["bytes"].get<double>());

  const nlohmann::json& full = j["full"];
  for (const char* key :
       {"publish_s", "pull_s", "total_s", "bytes", "publish_peak_rss_mib", "pull_peak_rss_mib"}) {
    ExpectPositive(full, key);
  }
  ExpectTotalIsSum(full);
  EXPECT_EQ(full["verified"], true);
  // A full version holds every tensor byte (plus headers and the index).
  EXPECT_GE(full["bytes"].get<double>(), j["model_bytes"].get<double>());
  EXPECT_GE(full["pull_bytes_read"].get<double>(), j["model_bytes"].get<double>());

  const nlohmann::json& targets = j["targets"];
  EXPECT_EQ(targets["sparse_vs_peer"], 0.3);
  EXPECT_EQ(targets["xor_vs_peer"], 0.5);
  EXPECT_EQ(targets["delta_vs_full"], 0.1);
  const nlohmann::json& ratios = j["ratios"];
  EXPECT_NEAR(ratios["delta_vs_full"].get<double>(),
              j["deltasync"]["sparse"]["total_s"].get<double>() / full["total_s"].get<double>(),
              1e-9);

  const nlohmann::json& peer = j["python_peer"];
  ASSERT_TRUE(peer.contains("ran"));
  ASSERT_TRUE(peer["note"].is_string());
  if (!PeerCanRun()) {
    EXPECT_EQ(peer["ran"], false);
    EXPECT_TRUE(ratios["sparse_vs_peer"].is_null());
  } else {
    ASSERT_EQ(peer["ran"], true) << peer["note"];
    for (const char* key :
         {"publish_s", "pull_s", "total_s", "bytes", "publish_wall_s", "pull_wall_s",
          "publish_cpu_s", "pull_cpu_s", "publish_peak_rss_mib", "pull_peak_rss_mib"}) {
      ExpectPositive(peer, key);
    }
    ExpectTotalIsSum(peer);
    EXPECT_EQ(peer["verified"], true);
    // Self-reported time excludes the interpreter's start; the wall time cannot.
    EXPECT_LT(peer["publish_s"].get<double>(), peer["publish_wall_s"].get<double>());
    EXPECT_LT(peer["pull_s"].get<double>(), peer["pull_wall_s"].get<double>());
    EXPECT_EQ(peer["tensors_changed"], j["deltasync"]["xor"]["tensors_changed"]);
    EXPECT_NEAR(ratios["sparse_vs_peer"].get<double>(),
                j["deltasync"]["sparse"]["total_s"].get<double>() / peer["total_s"].get<double>(),
                1e-9);
    EXPECT_NEAR(ratios["sparse_vs_peer_cpu"].get<double>(),
                (j["deltasync"]["sparse"]["publish_cpu_s"].get<double>() +
                 j["deltasync"]["sparse"]["pull_cpu_s"].get<double>()) /
                    (peer["publish_cpu_s"].get<double>() + peer["pull_cpu_s"].get<double>()),
                1e-9);
    EXPECT_NEAR(ratios["xor_vs_peer"].get<double>(),
                j["deltasync"]["xor"]["total_s"].get<double>() / peer["total_s"].get<double>(),
                1e-9);
  }
  for (const char* key : {"sparse_vs_peer", "xor_vs_peer", "delta_vs_full"}) {
    SCOPED_TRACE(key);
    if (ratios[key].is_null()) {
      EXPECT_TRUE(j["met"][key].is_null());
    } else {
      EXPECT_EQ(j["met"][key].get<bool>(), ratios[key].get<double>() <= targets[key].get<double>());
    }
  }
  EXPECT_EQ(j["verified"], true);
}

TEST(BenchE2eTest, ChangedElementsAgreeWithTheInMemoryBench) {
  const nlohmann::json& e2e = TinyReport().json;
  ASSERT_TRUE(e2e.is_object());
  // The in-memory bench diffs the same synthetic step without any file.
  CliRun r =
      RunCli("bench --preset tiny --bytes 4MiB --seed 7 --repeat 1 --encodings sparse,xor --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(e2e["changed"], j["changed"]);
  EXPECT_EQ(e2e["numel"], j["numel"]);
  EXPECT_EQ(e2e["deltasync"]["xor"]["tensors_changed"], j["encodings"]["xor"]["tensors"]);
}

TEST(BenchE2eTest, WorkdirIsRemovedAfterwards) {
  const Report& report = TinyReport();
  ASSERT_TRUE(report.json.is_object());
  EXPECT_EQ(report.json["config"]["workdir"], report.workdir);
  EXPECT_EQ(report.json["config"]["kept"], false);
  EXPECT_FALSE(fs::exists(report.workdir)) << report.workdir;
}

TEST(BenchE2eTest, TextTableWithKeepAndWithoutPeer) {
  const std::string dir = UniqueDir("keep");
  CliRun r =
      RunCli(std::string(kTinyArgs) + " --keep --python /nonexistent/python3 --workdir " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* word : {"deltasync sparse publish", "deltasync sparse pull",
                           "deltasync xor total", "deltasync full pull",
                           "sparse total / full total", "/nonexistent/python3", "bit for bit"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << word << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("sparse total / peer total  n/a"), std::string::npos) << r.out;
  // The step pair and the last measurement's files are kept for inspection.
  EXPECT_TRUE(fs::exists(dir + "/old/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/new/model.safetensors"));
  EXPECT_TRUE(fs::is_directory(dir + "/sparse/store/weight_v000001"));
  EXPECT_TRUE(fs::exists(dir + "/sparse/local/.weight_sync/state.json"));
  EXPECT_FALSE(fs::exists(dir + "/peer"));  // skipped
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// With the store dropped from the page cache before each pull, the pulls
// read it back from disk and still land bit for bit.
TEST(BenchE2eTest, ColdStoreRunsEveryPullBitExact) {
  CliRun r = RunCli(std::string(kTinyArgs) + " --json --cold-store");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["config"]["page_cache"], "store dropped before each pull");
  EXPECT_EQ(j["verified"], true);
  for (const char* enc : {"sparse", "xor"}) {
    ExpectPositive(j["deltasync"][enc], "pull_s");
    ExpectPositive(j["deltasync"][enc], "pull_bytes_read");
  }
  CliRun text = RunCli(std::string(kTinyArgs) + " --cold-store --python /nonexistent/python3");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("store files dropped from the page cache before each pull"),
            std::string::npos)
      << text.out;
}

TEST(BenchE2eTest, MissingPythonSkipsThePeerWithANote) {
  CliRun r = RunCli(std::string(kTinyArgs) + " --json --python /nonexistent/python3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["python_peer"]["ran"], false);
  EXPECT_NE(j["python_peer"]["note"].get<std::string>().find("/nonexistent/python3"),
            std::string::npos);
  EXPECT_TRUE(j["python_peer"]["total_s"].is_null());
  EXPECT_TRUE(j["ratios"]["sparse_vs_peer"].is_null());
  EXPECT_TRUE(j["met"]["xor_vs_peer"].is_null());
  EXPECT_FALSE(j["ratios"]["delta_vs_full"].is_null());
  EXPECT_EQ(j["verified"], true);
  // The default work dir under /tmp is gone too.
  EXPECT_FALSE(fs::exists(j["config"]["workdir"].get<std::string>()));
}

// A peer that claims to have applied the version without touching the local
// checkpoint: the bit-exactness check must catch it.
TEST(BenchE2eTest, APullThatDoesNotReachTheNewWeightsFailsLoudly) {
  if (!PeerCanRun()) GTEST_SKIP() << "the Python peer cannot run here";
  const std::string script = UniqueDir("lying_peer") + ".py";
  {
    std::ofstream f(script);
    f << "import json, subprocess, sys\n"
         "args = sys.argv[1:]\n"
         "if args[0] == 'pull' and '--target' not in args:\n"
         "    print(json.dumps({'to_version': '000001', 'versions_applied': ['000001'],\n"
         "                      'seconds': 0.001, 'bytes_read': 1}))\n"
         "    sys.exit(0)\n"
         "sys.exit(subprocess.call([sys.executable, '" DS_SOURCE_DIR
         "/tests/peer/vime_peer.py'] + args))\n";
  }
  const std::string dir = UniqueDir("lying");
  CliRun r = RunCli(std::string(kTinyArgs) + " --json --peer " + script + " --workdir " + dir);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("bit-exactness check failed: peer_pull"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir)) << "a failed run must clean up too";
  std::remove(script.c_str());
}

TEST(BenchE2eTest, BadArgumentsFailWithOneLine) {
  const std::string nonempty = UniqueDir("nonempty");
  fs::create_directories(nonempty);
  std::ofstream(nonempty + "/precious").put('x');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bench --e2e --bytes 4MiB --preset tiny --encodings sparse", "--encodings"},
      {"bench --e2e --bytes 4MiB --preset tiny --threads 2", "--threads"},
      {"bench --e2e --bytes 4MiB --preset tiny --peer /nonexistent/peer.py",
       "/nonexistent/peer.py"},
      {"bench --e2e --bytes 4MiB --preset tiny --workdir " + nonempty, "not empty"},
      {"bench --e2e --bytes 4MiB --preset nonesuch", "nonesuch"},
      {"bench --e2e --bytes 4MiB --preset tiny --repeat 0", "--repeat"},
      {"bench --bytes 4MiB --preset tiny --keep", "--keep needs --e2e"},
      {"bench --bytes 4MiB --preset tiny --cold-store", "--cold-store needs --e2e"},
  };
  for (const auto& [args, named] : cases) {
    SCOPED_TRACE(args);
    CliRun r = RunCli(args);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  // The refused work dir is left exactly as it was.
  EXPECT_TRUE(fs::exists(nonempty + "/precious"));
  std::error_code ec;
  fs::remove_all(nonempty, ec);
}

}  // namespace
}  // namespace deltasync
