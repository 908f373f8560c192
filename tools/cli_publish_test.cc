// Runs the real `deltasync` binary: what `publish` and `prune` refuse, and
// what the `--hook` help texts of `publish` and `pull` promise.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "cli_test_util.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace deltasync {
namespace {

using testing_cli::CliRun;
using testing_cli::CountLines;
using testing_cli::ReadWholeFile;
using testing_cli::RunCli;

// A fresh directory with a synthetic chain of `steps` steps in it.
struct ChainDir {
  std::string dir;
  explicit ChainDir(const std::string& name, int steps = 3) {
    dir = testing::TempDir() + "/" + name;
    std::filesystem::remove_all(dir);
    const CliRun r =
        RunCli("synth --out " + dir + "/chain --steps " + std::to_string(steps) + " --seed 5");
    EXPECT_EQ(r.exit_code, 0) << r.err;
  }
  std::string Step(int i) const { return dir + "/chain/step_00000" + std::to_string(i); }
  std::string Store() const { return dir + "/store"; }
  std::string Publish(int old_step, int new_step) const {
    return "publish --store " + Store() + " --old " + Step(old_step) + " --new " + Step(new_step);
  }
};

TEST(CliPublish, AnOldThatIsNotTheNewestVersionIsRefusedInOneLine) {
  ChainDir c("cli_publish_old");
  ASSERT_EQ(RunCli(c.Publish(0, 1)).exit_code, 0);
  ASSERT_EQ(RunCli(c.Publish(1, 2)).exit_code, 0);
  // Re-running the publish of step 2 from step 1, now with step 3.
  CliRun r = RunCli(c.Publish(1, 3));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("version 000002"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("differs"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(c.Store() + "/weight_v000003"));
  CliRun ok = RunCli(c.Publish(2, 3));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(std::filesystem::exists(c.Store() + "/weight_v000003"));
}

TEST(CliPublish, AnEmptyNewestVersionIsRefusedNamingIt) {
  ChainDir c("cli_publish_empty");
  ASSERT_EQ(RunCli(c.Publish(0, 1)).exit_code, 0);
  std::filesystem::create_directory(c.Store() + "/weight_v000002");
  CliRun r = RunCli(c.Publish(1, 2));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(c.Store() + "/weight_v000002"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("remove it"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(c.Store() + "/weight_v000003"));
}

// A loopback port nothing listens on (bound, read back, released).
int UnusedLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

TEST(CliSync, AnUnreachableEngineFailsSayingWhatWasPublished) {
  ChainDir c("cli_sync_unreachable", 1);
  const int port = UnusedLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string engine = "http://127.0.0.1:" + std::to_string(port);
  const CliRun r =
      RunCli("sync --store " + c.Store() + " --old " + c.Step(0) + " --new " + c.Step(1) +
                 " --engines " + engine + " --retries 0 --connect-timeout 2 --timeout 5",
             120);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  // The version is there for good: the line says which, and that the
  // engine does not have it.
  EXPECT_NE(r.err.find("published version 000001, but not every engine pulled it"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(engine), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::is_directory(c.Store() + "/weight_v000001"));
}

TEST(CliPrune, KeepBelowOneIsRefusedInOneReadableLine) {
  ChainDir c("cli_prune_keep", 2);
  ASSERT_EQ(RunCli(c.Publish(0, 1)).exit_code, 0);
  ASSERT_EQ(RunCli(c.Publish(1, 2) + " --full").exit_code, 0);
  for (const char* keep : {"0", "-1"}) {
    CliRun r = RunCli("prune --store " + c.Store() + " --keep " + keep);
    EXPECT_NE(r.exit_code, 0) << keep;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("--keep must be at least 1, not " + std::string(keep)), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("newest version"), std::string::npos) << r.err;
    EXPECT_TRUE(std::filesystem::exists(c.Store() + "/weight_v000001")) << keep;
  }
  CliRun r = RunCli("prune --store " + c.Store() + " --keep 1");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(std::filesystem::exists(c.Store() + "/weight_v000001"));
}

// The placeholders of "`hook <a> <b> ...`" in the --hook line of `command
// --help`.
std::vector<std::string> HookPlaceholders(const std::string& command) {
  const CliRun help = RunCli(command + " --help");
  EXPECT_EQ(help.exit_code, 0) << help.err;
  const size_t line = help.out.find("--hook");
  EXPECT_NE(line, std::string::npos) << help.out;
  const size_t begin = help.out.find("`hook", line);
  const size_t end = help.out.find('`', begin + 1);
  EXPECT_NE(begin, std::string::npos) << help.out;
  EXPECT_NE(end, std::string::npos) << help.out;
  if (begin == std::string::npos || end == std::string::npos) return {};
  std::istringstream words(help.out.substr(begin + 5, end - begin - 5));
  std::vector<std::string> names;
  for (std::string w; words >> w;) {
    EXPECT_TRUE(w.size() > 2 && w.front() == '<' && w.back() == '>') << w;
    names.push_back(w.substr(1, w.size() - 2));
  }
  return names;
}

// A hook that records, one line each, "dir ARG" for an argument naming an
// existing directory and "arg ARG" otherwise.
std::string WriteRecordingHook(const std::string& dir, const std::string& record) {
  const std::string path = dir + "/hook.sh";
  std::ofstream(path)
      << "#!/bin/sh\nfor a in \"$@\"; do\n  if [ -d \"$a\" ]; then echo \"dir $a\"; "
         "else echo \"arg $a\"; fi\ndone > "
      << record << "\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

// Each placeholder of the help text, in order, against what the hook got.
void ExpectHookGot(const std::vector<std::string>& placeholders,
                   const std::map<std::string, std::function<bool(const std::string&)>>& meaning,
                   const std::string& record) {
  const std::vector<std::string> got = Lines(ReadWholeFile(record));
  ASSERT_EQ(got.size(), placeholders.size()) << ReadWholeFile(record);
  for (size_t i = 0; i < got.size(); ++i) {
    auto it = meaning.find(placeholders[i]);
    ASSERT_NE(it, meaning.end()) << "the help names <" << placeholders[i]
                                 << ">, which no argument is";
    EXPECT_TRUE(it->second(got[i])) << "<" << placeholders[i] << "> got: " << got[i];
  }
}

TEST(CliHooks, TheHelpTextsNameTheArgumentsTheHooksReceive) {
  ChainDir c("cli_hooks", 1);
  const std::string record = c.dir + "/record";
  const std::string hook = WriteRecordingHook(c.dir, record);
  const std::string store = c.Store();
  const std::string final_dir = store + "/weight_v000001";

  ASSERT_EQ(RunCli(c.Publish(0, 1) + " --hook " + hook).exit_code, 0);
  ExpectHookGot(HookPlaceholders("publish"),
                {{"temp_dir",
                  [&](const std::string& a) {
                    return a.rfind("dir " + store + "/.", 0) == 0 && a != "dir " + final_dir;
                  }},
                 {"final_dir", [&](const std::string& a) { return a == "arg " + final_dir; }},
                 {"version", [](const std::string& a) { return a == "arg 000001"; }}},
                record);

  const std::vector<std::string> pull = HookPlaceholders("pull");
  for (const std::string target : {"latest", "1"}) {
    SCOPED_TRACE(target);
    std::filesystem::remove(record);
    CliRun r = RunCli("pull --store " + store + " --local " + c.dir + "/local --base " + c.Step(0) +
                      " --target " + target + " --hook " + hook);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::string expected_target = target == "latest" ? "latest" : "000001";
    ExpectHookGot(pull,
                  {{"store", [&](const std::string& a) { return a == "dir " + store; }},
                   {"target", [&](const std::string& a) { return a == "arg " + expected_target; }}},
                  record);
  }
}

}  // namespace
}  // namespace deltasync
