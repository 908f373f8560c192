// Runs the real `deltasync` binary (DS_CLI_PATH) for the CLI tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace deltasync::testing_cli {

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs `deltasync <args>` through the shell, capturing stdout and stderr in
// files unique to this process and call (CTest runs test cases in parallel
// processes that share the temp dir). With `timeout_s`, a command that runs
// longer is killed (exit code 124), for commands that would otherwise serve
// forever when they wrongly start.
inline CliRun RunCli(const std::string& args, int timeout_s = 0) {
  static std::atomic<int> counter{0};
  const std::string stem = ::testing::TempDir() + "/deltasync_cli_" + std::to_string(getpid()) +
                           "_" + std::to_string(counter.fetch_add(1));
  const std::string out_path = stem + ".out", err_path = stem + ".err";
  const std::string cmd =
      (timeout_s > 0 ? "timeout " + std::to_string(timeout_s) + " " : std::string()) +
      std::string(DS_CLI_PATH) + " " + args + " >" + out_path + " 2>" + err_path;
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadWholeFile(out_path);
  r.err = ReadWholeFile(err_path);
  std::remove(out_path.c_str());
  std::remove(err_path.c_str());
  return r;
}

inline int CountLines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace deltasync::testing_cli
