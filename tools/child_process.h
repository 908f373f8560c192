// A child process of a benchmark or demo: started with its stdout and
// stderr in files, its report (one JSON object on stdout) read when it is
// reaped; killed and reaped at the end if never waited for.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "deltasync/status.h"

extern char** environ;

namespace deltasync::cli {

// A child process, its output in files, reaped by Wait.
class Child {
 public:
  Status Start(const std::vector<std::string>& argv, const std::string& stem) {
    stem_ = stem;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, (stem + ".out").c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, (stem + ".err").c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char*> cargv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    const int rc = posix_spawnp(&pid_, cargv[0], &actions, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return Status::FromErrno(rc, "cannot run " + argv[0]);
    return Status::OK();
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      int st = 0;
      waitpid(pid_, &st, 0);
    }
  }
  // Whether the child still runs (one that ended is reaped; Wait reports).
  bool Running() {
    if (pid_ <= 0 || reaped_) return false;
    if (waitpid(pid_, &status_, WNOHANG) != pid_) return true;
    reaped_ = true;
    return false;
  }
  // The child's JSON report (its stdout), or its error.
  Result<nlohmann::json> Wait() {
    if (!reaped_) waitpid(pid_, &status_, 0);
    const int st = status_;
    pid_ = -1;
    reaped_ = false;
    std::ifstream out(stem_ + ".out"), err(stem_ + ".err");
    std::stringstream o, e;
    o << out.rdbuf();
    e << err.rdbuf();
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::string why = e.str();
      while (!why.empty() && why.back() == '\n') why.pop_back();
      return Status::Internal("a child process failed: " + why);
    }
    nlohmann::json j = nlohmann::json::parse(o.str(), nullptr, false);
    if (!j.is_object()) return Status::Internal("a child process printed no report");
    return j;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string stem_;
};

// This executable's path, to start it again as a child; empty if unknown.
inline std::string SelfPath() {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.string();
}

// A work directory removed with its contents when it goes out of scope,
// unless it was the user's own (`owned` false).
struct ScratchDir {
  std::string path;
  bool owned = true;
  ~ScratchDir() {
    std::error_code ec;
    if (owned && !path.empty()) std::filesystem::remove_all(path, ec);
  }
};

// A field of /proc/self/status ("VmHWM", "VmRSS"), in bytes.
inline uint64_t OwnMemory(const char* field) {
  uint64_t kib = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    const std::string format = std::string(field) + ": %llu kB";
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      unsigned long long v = 0;
      if (std::sscanf(line, format.c_str(), &v) == 1) kib = v;
    }
    std::fclose(f);
  }
  return kib * 1024;
}

}  // namespace deltasync::cli
