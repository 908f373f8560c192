// Runs the real `deltasync` binary and checks the CLI contract.
#include <sys/wait.h>

#include <gtest/gtest.h>

#include "cli_test_util.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "deltasync/checkpoint.h"
#include "deltasync/checksum.h"

namespace deltasync {
namespace {

using testing_cli::CliRun;
using testing_cli::CountLines;
using testing_cli::RunCli;

TEST(CliTest, HelpListsCommands) {
  CliRun r = RunCli("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("inspect"), std::string::npos);
  EXPECT_NE(r.out.find("checksum"), std::string::npos);
}

// The --encoding help is made from the encodings' descriptors: every name,
// the default marked, and the encodings the Python receiver reads.
TEST(CliTest, EncodingHelpNamesEveryEncoding) {
  for (const char* command : {"publish", "sync", "demo"}) {
    CliRun r = RunCli(std::string(command) + " --help");
    EXPECT_EQ(r.exit_code, 0) << command << ": " << r.err;
    EXPECT_NE(r.out.find("dense | indices | xor | overwrite | sparse (default); the Python "
                         "receiver reads xor and overwrite"),
              std::string::npos)
        << command << ":\n"
        << r.out;
  }
  CliRun bench = RunCli("bench --help");
  EXPECT_NE(bench.out.find("(dense,indices,xor,overwrite,sparse) or all"), std::string::npos)
      << bench.out;
}

TEST(CliTest, UnknownSubcommandFails) {
  CliRun r = RunCli("frobnicate");
  EXPECT_NE(r.exit_code, 0);
}

TEST(CliTest, ChecksumPrintsSha256sumStyleLines) {
  const std::string path = testing::TempDir() + "/cli_checksum_input.bin";
  std::string data(100000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 % 256);
  std::ofstream(path, std::ios::binary) << data;
  std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  for (const char* algo : {"xxh3-128", "xxh3-64", "blake3", "adler32"}) {
    CliRun r = RunCli(std::string("checksum --algo ") + algo + " " + path + " " + path);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::string line = ChecksumHex(*ParseChecksumAlgo(algo), bytes) + "  " + path + "\n";
    EXPECT_EQ(r.out, line + line) << algo;
  }
}

TEST(CliTest, ChecksumErrorsAreOneLineAndNonZero) {
  CliRun missing = RunCli("checksum --algo xxh3-128 /nonexistent/file.bin");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_EQ(CountLines(missing.err), 1) << missing.err;
  EXPECT_NE(missing.err.find("/nonexistent/file.bin"), std::string::npos);

  CliRun bad_algo = RunCli("checksum --algo md5 /dev/null");
  EXPECT_NE(bad_algo.exit_code, 0);
  EXPECT_EQ(CountLines(bad_algo.err), 1) << bad_algo.err;
  EXPECT_NE(bad_algo.err.find("md5"), std::string::npos);
}

TEST(CliTest, InspectCheckpointTextAndJson) {
  const std::string dir = testing::TempDir() + "/cli_inspect_ckpt";
  std::vector<uint8_t> a(2 * 3 * 2, 1), b(16 * 4, 2);
  std::vector<TensorView> tensors = {{"layer.a", DType::kBF16, {2, 3}, a},
                                     {"layer.b", DType::kF32, {16}, b}};
  CheckpointWriteOptions opts;
  opts.max_shard_bytes = 8;  // forces two shards and an index
  ASSERT_TRUE(WriteCheckpoint(dir, tensors, opts).ok());

  CliRun text = RunCli("inspect " + dir);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("layer.a"), std::string::npos);
  EXPECT_NE(text.out.find("BF16"), std::string::npos);
  EXPECT_NE(text.out.find("[2, 3]"), std::string::npos);
  EXPECT_NE(text.out.find("total: 2 tensors, 76 bytes"), std::string::npos) << text.out;

  CliRun js = RunCli("inspect --json " + dir);
  ASSERT_EQ(js.exit_code, 0) << js.err;
  nlohmann::json j = nlohmann::json::parse(js.out);
  EXPECT_EQ(j["totals"]["tensors"], 2);
  EXPECT_EQ(j["totals"]["bytes"], 76);
  EXPECT_EQ(j["sharded"], true);
  EXPECT_EQ(j["files"].size(), 2u);
  EXPECT_EQ(j["tensors"][0]["name"], "layer.a");
  EXPECT_EQ(j["tensors"][0]["shape"], nlohmann::json::array({2, 3}));
  EXPECT_EQ(j["totals"]["by_dtype"]["F32"]["bytes"], 64);
}

TEST(CliTest, InspectCorruptFileNamesFileInOneLine) {
  const std::string path = testing::TempDir() + "/cli_corrupt.safetensors";
  std::ofstream(path, std::ios::binary) << std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10);
  CliRun r = RunCli("inspect " + path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(path), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(CliTest, SynthThenDiffReportsRealisticChanges) {
  const std::string dir = testing::TempDir() + "/cli_synth_chain";
  std::filesystem::remove_all(dir);
  CliRun synth = RunCli("synth --out " + dir + " --preset tiny --steps 1 --seed 7");
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  EXPECT_NE(synth.out.find("step_000001"), std::string::npos) << synth.out;

  CliRun diff = RunCli("diff --json " + dir + "/step_000000 " + dir + "/step_000001");
  ASSERT_EQ(diff.exit_code, 0) << diff.err;
  nlohmann::json j = nlohmann::json::parse(diff.out);
  const nlohmann::json& total = j["total"];
  const double density = total["density"];
  EXPECT_GT(density, 0.003);  // lr 1e-6 changes a few percent of BF16 elements
  EXPECT_LT(density, 0.10);
  uint64_t changed = 0, sparse = 0;
  for (const auto& t : j["tensors"]) {
    changed += t["changed"].get<uint64_t>();
    sparse += t["bytes"]["sparse"].get<uint64_t>();
  }
  EXPECT_EQ(changed, total["changed"].get<uint64_t>());
  EXPECT_EQ(sparse, total["bytes"]["sparse"].get<uint64_t>());
  const auto& per = total["bytes_per_changed"];
  EXPECT_LT(per["sparse"].get<double>(), per["xor"].get<double>());
  EXPECT_LT(per["xor"].get<double>(), per["indices"].get<double>());
  EXPECT_GE(per["sparse"].get<double>(), total["entropy_bytes_per_changed"].get<double>());
  EXPECT_EQ(total["dense_bytes"].get<uint64_t>(), 2 * total["numel"].get<uint64_t>());

  // A checkpoint diffed against itself changes nothing.
  CliRun same = RunCli("diff --json " + dir + "/step_000001 " + dir + "/step_000001");
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_EQ(nlohmann::json::parse(same.out)["total"]["changed"], 0);
}

TEST(CliTest, DiffOfUnrelatedCheckpointsFailsInOneLine) {
  const std::string dir = testing::TempDir() + "/cli_diff_mismatch";
  std::vector<uint8_t> a(8, 1);
  ASSERT_TRUE(WriteCheckpoint(dir + "/x", {{"only.in.x", DType::kF32, {2}, a}}).ok());
  ASSERT_TRUE(WriteCheckpoint(dir + "/y", {{"only.in.y", DType::kF32, {2}, a}}).ok());
  CliRun r = RunCli("diff " + dir + "/x " + dir + "/y");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("only.in."), std::string::npos) << r.err;
}

TEST(CliTest, SynthRejectsUnknownPreset) {
  CliRun r = RunCli("synth --out " + testing::TempDir() + "/cli_bad_preset --preset gpt-17");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("gpt-17"), std::string::npos) << r.err;
}

TEST(CliTest, SynthIntoAnExistingChainNamesTheOverwriteFlag) {
  const std::string out = testing::TempDir() + "/cli_synth_exists";
  std::filesystem::remove_all(out);
  ASSERT_EQ(RunCli("synth --out " + out + " --steps 1").exit_code, 0);
  CliRun again = RunCli("synth --out " + out + " --steps 1");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_EQ(CountLines(again.err), 1) << again.err;
  EXPECT_NE(again.err.find(out + "/step_000000 already exists"), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("(pass --overwrite to replace it)"), std::string::npos) << again.err;
  EXPECT_EQ(RunCli("synth --out " + out + " --steps 1 --overwrite").exit_code, 0);
}

// Tensor bytes of two checkpoints are equal, name by name.
void ExpectSameTensors(const std::string& a_path, const std::string& b_path) {
  auto a = Checkpoint::Open(a_path);
  auto b = Checkpoint::Open(b_path);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_EQ((*a)->tensors().size(), (*b)->tensors().size());
  for (const auto& [name, t] : (*a)->tensors()) {
    auto other = (*b)->Get(name);
    ASSERT_TRUE(other.ok()) << name;
    EXPECT_TRUE(
        std::equal(t.bytes.begin(), t.bytes.end(), other->bytes.begin(), other->bytes.end()))
        << name;
  }
}

TEST(CliTest, StoreCommandsPublishPullVerifyPrune) {
  const std::string dir = testing::TempDir() + "/cli_store";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(RunCli("synth --out " + dir + "/chain --steps 3 --seed 11").exit_code, 0);
  auto step = [&](int i) { return dir + "/chain/step_00000" + std::to_string(i); };
  const std::string store = " --store " + dir + "/store";
  ASSERT_EQ(RunCli("publish" + store + " --old " + step(0) + " --new " + step(1)).exit_code, 0);
  for (const char* bad : {"0", "lots"}) {
    CliRun r = RunCli("publish" + store + " --old " + step(1) + " --new " + step(2) +
                      " --max-shard-bytes " + bad);
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("--max-shard-bytes"), std::string::npos) << r.err;
  }
  // An unknown encoding or checksum is refused by name, and publishes nothing.
  for (const std::string& bad : {std::string("--encoding bogus"), std::string("--checksum md5")}) {
    CliRun r = RunCli("publish" + store + " --old " + step(1) + " --new " + step(2) + " " + bad);
    EXPECT_EQ(r.exit_code, 1) << bad;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(bad.substr(bad.find(' ') + 1)), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir + "/store/weight_v000002")) << bad;
  }
  // Small shards: the version spreads over several files and still pulls.
  CliRun xor_pub = RunCli("publish --json" + store + " --old " + step(1) + " --new " + step(2) +
                          " --encoding xor --checksum blake3 --max-shard-bytes 4KiB");
  ASSERT_EQ(xor_pub.exit_code, 0) << xor_pub.err;
  nlohmann::json pj = nlohmann::json::parse(xor_pub.out);
  EXPECT_EQ(pj["version"], 2);
  EXPECT_EQ(pj["encoding"], "xor");
  EXPECT_EQ(pj["checksum"], "blake3");
  EXPECT_GT(pj["changed_elements"].get<uint64_t>(), 0u);
  size_t shards = 0;
  for (const auto& entry : std::filesystem::directory_iterator(pj["dir"].get<std::string>())) {
    shards += entry.path().extension() == ".safetensors";
    EXPECT_NE(entry.path().filename().string()[0], '.') << "left behind: " << entry.path();
  }
  EXPECT_GT(shards, 1u);
  ASSERT_EQ(
      RunCli("publish" + store + " --old " + step(2) + " --new " + step(3) + " --full").exit_code,
      0);

  nlohmann::json versions = nlohmann::json::parse(RunCli("versions --json" + store).out);
  ASSERT_EQ(versions["versions"].size(), 3u);
  EXPECT_EQ(versions["versions"][0]["encoding"], "sparse");
  EXPECT_EQ(versions["versions"][2]["kind"], "full");
  nlohmann::json inspected = nlohmann::json::parse(RunCli("inspect --json " + dir + "/store").out);
  EXPECT_EQ(inspected["kind"], "store");
  EXPECT_EQ(inspected["newest_full"], 3);

  const std::string local = " --local " + dir + "/local --base " + step(0);
  CliRun pull2 = RunCli("pull --json --target 2" + store + local);
  ASSERT_EQ(pull2.exit_code, 0) << pull2.err;
  nlohmann::json rj = nlohmann::json::parse(pull2.out);
  EXPECT_EQ(rj["version"], 2);
  EXPECT_EQ(rj["versions_applied"], nlohmann::json::array({1, 2}));
  ExpectSameTensors(dir + "/local", step(2));
  CliRun verify = RunCli("verify" + store + " --local " + dir + "/local");
  EXPECT_EQ(verify.exit_code, 0) << verify.err;
  EXPECT_NE(verify.out.find("000002 verified"), std::string::npos) << verify.out;

  CliRun future = RunCli("pull --target 9" + store + local);
  EXPECT_NE(future.exit_code, 0);
  EXPECT_EQ(CountLines(future.err), 1) << future.err;
  EXPECT_NE(future.err.find("000009"), std::string::npos) << future.err;
  CliRun bad_target = RunCli("pull --target two" + store + local);
  EXPECT_NE(bad_target.exit_code, 0);
  EXPECT_NE(bad_target.err.find("two"), std::string::npos) << bad_target.err;

  ASSERT_EQ(RunCli("pull" + store + local).exit_code, 0);
  ExpectSameTensors(dir + "/local", step(3));

  CliRun prune = RunCli("prune --keep 1" + store);
  ASSERT_EQ(prune.exit_code, 0) << prune.err;
  EXPECT_NE(prune.out.find("removed 2 versions"), std::string::npos) << prune.out;
  // A late joiner seeds from the newest full version.
  CliRun late = RunCli("pull --json" + store + " --local " + dir + "/late --base " + step(0));
  ASSERT_EQ(late.exit_code, 0) << late.err;
  EXPECT_EQ(nlohmann::json::parse(late.out)["reset_to"], 3);
  ExpectSameTensors(dir + "/late", step(3));

  CliRun bad_enc =
      RunCli("publish" + store + " --old " + step(2) + " --new " + step(3) + " --encoding gzip");
  EXPECT_NE(bad_enc.exit_code, 0);
  EXPECT_EQ(CountLines(bad_enc.err), 1) << bad_enc.err;
  EXPECT_NE(bad_enc.err.find("gzip"), std::string::npos) << bad_enc.err;
}

}  // namespace
}  // namespace deltasync
