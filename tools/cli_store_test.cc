// The disk transport's commands as a user meets them: mistyped paths,
// checkpoints that are not ours, what the JSON and the messages say.
#include <gtest/gtest.h>

#include "cli_test_util.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>

namespace deltasync {
namespace {

using testing_cli::CliRun;
using testing_cli::CountLines;
using testing_cli::ReadWholeFile;
using testing_cli::RunCli;

// A synth chain of 3 steps and a store with versions 1 (delta) and 2
// (full), in a fresh dir per test.
struct Chain {
  std::string dir;
  explicit Chain(const std::string& name) : dir(testing::TempDir() + "/" + name) {
    std::filesystem::remove_all(dir);
    EXPECT_EQ(RunCli("synth --preset tiny --out " + dir + "/chain --steps 2 --seed 3").exit_code,
              0);
    EXPECT_EQ(
        RunCli("publish --store " + store() + " --old " + step(0) + " --new " + step(1)).exit_code,
        0);
    EXPECT_EQ(
        RunCli("publish --full --store " + store() + " --old " + step(1) + " --new " + step(2))
            .exit_code,
        0);
  }
  std::string step(int i) const { return dir + "/chain/step_00000" + std::to_string(i); }
  std::string store() const { return dir + "/store"; }
  std::string local() const { return dir + "/local"; }
};

void ExpectOneLineError(const CliRun& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("error: error"), std::string::npos) << r.err;
}

// Every path under `dir` (hidden ones too), relative to it.
std::set<std::string> ListTree(const std::string& dir) {
  std::set<std::string> paths;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    paths.insert(std::filesystem::relative(entry.path(), dir).string());
  }
  return paths;
}

TEST(CliStore, JsonSaysVerifiedAndTensorsCountsTheModel) {
  Chain c("cli_store_json");
  CliRun pull = RunCli("pull --json --target 1 --store " + c.store() + " --local " + c.local() +
                       " --base " + c.step(0));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  const nlohmann::json p = nlohmann::json::parse(pull.out);
  EXPECT_EQ(p["verified"], true);
  EXPECT_GT(p["tensors_changed"].get<uint64_t>(), 0u);

  CliRun versions = RunCli("versions --json --store " + c.store());
  ASSERT_EQ(versions.exit_code, 0) << versions.err;
  const nlohmann::json v = nlohmann::json::parse(versions.out)["versions"];
  ASSERT_EQ(v.size(), 2u);
  EXPECT_FALSE(v[0].contains("tensors")) << v[0].dump();  // a delta holds only the changed ones
  EXPECT_GT(v[0]["tensors_changed"].get<uint64_t>(), 0u);
  const nlohmann::json inspected = nlohmann::json::parse(RunCli("inspect --json " + c.step(2)).out);
  EXPECT_EQ(v[1]["tensors"], inspected["totals"]["tensors"]) << v[1].dump();
  EXPECT_NE(RunCli("versions --store " + c.store()).out.find("tensors changed"), std::string::npos);
}

TEST(CliStore, AMistypedStoreIsAnErrorAndAnEmptyOneSaysSo) {
  Chain c("cli_store_missing");
  const std::string typo = c.dir + "/stor";
  ExpectOneLineError(
      RunCli("pull --store " + typo + " --local " + c.local() + " --base " + c.step(0)),
      "store " + typo + " does not exist");
  ExpectOneLineError(RunCli("versions --store " + typo), typo);
  ExpectOneLineError(RunCli("prune --keep 1 --store " + typo), typo);
  EXPECT_FALSE(std::filesystem::exists(c.local()));
  EXPECT_FALSE(std::filesystem::exists(typo));

  std::filesystem::create_directories(c.dir + "/empty");
  CliRun empty = RunCli("versions --store " + c.dir + "/empty");
  EXPECT_EQ(empty.exit_code, 0) << empty.err;
  EXPECT_NE(empty.out.find("empty store"), std::string::npos) << empty.out;
}

TEST(CliStore, ADirectoryThatHoldsOtherThingsIsNotAStoreForAnyCommand) {
  Chain c("cli_store_not_a_store");
  // The synth output dir, mistaken for the store: it holds step dirs and
  // synth_chain.json, and no version.
  const std::string chain = c.dir + "/chain";
  const std::set<std::string> before = ListTree(chain);
  const std::string needle = chain + " is not a store";
  ExpectOneLineError(
      RunCli("pull --store " + chain + " --local " + c.local() + " --base " + c.step(0)), needle);
  ExpectOneLineError(
      RunCli("pull --target 0 --store " + chain + " --local " + c.local() + " --base " + c.step(0)),
      needle);
  EXPECT_FALSE(std::filesystem::exists(c.local()));
  ExpectOneLineError(RunCli("versions --store " + chain), needle);
  ExpectOneLineError(RunCli("prune --keep 1 --store " + chain), needle);
  ExpectOneLineError(
      RunCli("publish --store " + chain + " --old " + c.step(0) + " --new " + c.step(1)), needle);
  ExpectOneLineError(RunCli("sync --store " + chain + " --old " + c.step(0) + " --new " +
                                c.step(1) + " --engines http://127.0.0.1:1 --retries 0",
                            60),
                     needle);
  ExpectOneLineError(RunCli("agent --listen 127.0.0.1:0 --store " + chain + " --local " +
                                c.local() + " --base " + c.step(0),
                            60),
                     needle);
  // verify reads the store only when given one.
  ASSERT_EQ(RunCli("pull --store " + c.store() + " --local " + c.local() + " --base " + c.step(0))
                .exit_code,
            0);
  ExpectOneLineError(RunCli("verify --store " + chain + " --local " + c.local()), needle);
  EXPECT_EQ(ListTree(chain), before);  // nothing was published into it

  // An empty directory is an empty store, and said to be one.
  const std::string empty = c.dir + "/empty";
  std::filesystem::create_directories(empty);
  CliRun pull =
      RunCli("pull --store " + empty + " --local " + c.dir + "/fresh --base " + c.step(0));
  EXPECT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_NE(pull.out.find("-> 000000"), std::string::npos) << pull.out;
  EXPECT_NE(pull.out.find("store " + empty + " is empty"), std::string::npos) << pull.out;
  CliRun again =
      RunCli("pull --store " + empty + " --local " + c.dir + "/fresh --base " + c.step(0));
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("already at version 000000 (store " + empty + " is empty)"),
            std::string::npos)
      << again.out;
  CliRun prune = RunCli("prune --keep 1 --store " + empty);
  EXPECT_EQ(prune.exit_code, 0) << prune.err;
  EXPECT_NE(prune.out.find("is empty"), std::string::npos) << prune.out;
  // What a store holds beside its versions leaves it an empty store.
  std::filesystem::create_directories(empty + "/.tmp-weight_v000001-1-0");
  std::filesystem::create_directories(empty + "/.trash-weight_v000001-1-0");
  std::ofstream(empty + "/weight_v000001.partial") << "x";
  CliRun listed = RunCli("versions --store " + empty);
  EXPECT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_NE(listed.out.find("empty store"), std::string::npos) << listed.out;
}

TEST(CliStore, AWrongBaseIsRefusedEvenWithNothingToPull) {
  Chain c("cli_store_wrong_base");
  const std::string pull = "pull --store " + c.store() + " --local " + c.local() + " --base ";
  ASSERT_EQ(RunCli(pull + c.step(0)).exit_code, 0);
  const std::string state_path = c.local() + "/.weight_sync/state.json";
  const std::string state = ReadWholeFile(state_path);
  // Already at the latest version: the base plays no part in this pull,
  // but it is the wrong one all the same.
  ExpectOneLineError(RunCli(pull + c.step(1)), "is not the base");
  ExpectOneLineError(RunCli(pull + c.step(1) + " --target 2"), "is not the base");
  EXPECT_EQ(ReadWholeFile(state_path), state);
  CliRun right = RunCli(pull + c.step(0));
  EXPECT_EQ(right.exit_code, 0) << right.err;
  EXPECT_NE(right.out.find("already at version 000002"), std::string::npos) << right.out;
}

TEST(CliStore, HumanReadableSecondsAreRoundedAndJsonKeepsThem) {
  Chain c("cli_store_seconds");
  // Three significant digits at most (leading zeros are not significant).
  auto significant_digits = [](std::string number) {
    number.erase(std::remove(number.begin(), number.end(), '.'), number.end());
    const size_t first = number.find_first_not_of('0');
    return first == std::string::npos ? size_t{0} : number.size() - first;
  };
  const std::regex seconds(" in ([0-9.]+) s\\b");
  CliRun publish =
      RunCli("publish --store " + c.store() + " --old " + c.step(2) + " --new " + c.step(1));
  ASSERT_EQ(publish.exit_code, 0) << publish.err;
  CliRun pull =
      RunCli("pull --store " + c.store() + " --local " + c.local() + " --base " + c.step(0));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  for (const std::string& out : {publish.out, pull.out}) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, seconds)) << out;
    EXPECT_LE(significant_digits(m[1].str()), 3u) << out;
    EXPECT_GE(significant_digits(m[1].str()), 1u) << out;
  }
  CliRun json = RunCli("pull --json --target 1 --store " + c.store() + " --local " + c.local() +
                       " --base " + c.step(0));
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_GT(nlohmann::json::parse(json.out)["seconds"].get<double>(), 0.0);
}

TEST(CliStore, TheLocalMustNotBeTheBase) {
  Chain c("cli_store_same");
  const std::string before = ReadWholeFile(c.step(0) + "/model.safetensors");
  ExpectOneLineError(
      RunCli("pull --store " + c.store() + " --local " + c.step(0) + " --base " + c.step(0)),
      "is the same directory as the base checkpoint");
  ExpectOneLineError(RunCli("verify --local " + c.step(0) + " --base " + c.step(0)),
                     "is the same directory as the base checkpoint");
  EXPECT_EQ(ReadWholeFile(c.step(0) + "/model.safetensors"), before);
  EXPECT_FALSE(std::filesystem::exists(c.step(0) + "/.weight_sync"));
}

TEST(CliStore, ATrainersCheckpointIsReplacedOnlyWithForce) {
  Chain c("cli_store_force");
  std::filesystem::create_directories(c.local());
  std::filesystem::copy(c.step(1), c.local(), std::filesystem::copy_options::recursive);
  const std::string pull =
      "pull --store " + c.store() + " --local " + c.local() + " --base " + c.step(0);
  const std::set<std::string> before = ListTree(c.local());
  ExpectOneLineError(RunCli(pull), "--force");
  EXPECT_EQ(ListTree(c.local()), before);  // no .weight_sync, no lock: nothing of the pull's
  CliRun verify = RunCli("verify --local " + c.local());
  ExpectOneLineError(verify, "never pulled");
  EXPECT_FALSE(std::filesystem::exists(c.local() + "/.weight_sync/state.json"));
  CliRun forced = RunCli(pull + " --force");
  EXPECT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_EQ(RunCli("verify --local " + c.local()).exit_code, 0);
}

TEST(CliStore, VerifyAfterAKilledPullSaysToPull) {
  Chain c("cli_store_killed");
  const std::string pull =
      "pull --target 1 --store " + c.store() + " --local " + c.local() + " --base " + c.step(0);
  ASSERT_EQ(RunCli(pull).exit_code, 0);
  // What a pull killed mid-apply leaves (the journal aside): the state names
  // no version, only the apply in flight.
  const std::string state_path = c.local() + "/.weight_sync/state.json";
  nlohmann::json state = nlohmann::json::parse(ReadWholeFile(state_path));
  state.erase("version");
  state["applying"] = "000002";
  state["from_version"] = "000001";
  std::ofstream(state_path) << state.dump();
  const std::string before = ReadWholeFile(state_path);
  ExpectOneLineError(RunCli("verify --local " + c.local()), "pull to recover");
  EXPECT_EQ(ReadWholeFile(state_path), before);  // verify wrote nothing
}

TEST(CliStore, InspectOfAFileThatIsNotSafetensorsSaysSo) {
  const std::string path = testing::TempDir() + "/cli_not_safetensors.txt";
  std::ofstream(path) << "hello, this is a text file\n";
  ExpectOneLineError(RunCli("inspect " + path), "is not a safetensors file");
}

}  // namespace
}  // namespace deltasync
