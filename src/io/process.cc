#include "io/process.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

extern char** environ;

namespace deltasync::io {

Status RunHook(const std::string& executable, const std::vector<std::string>& args,
               std::string_view what) {
  std::vector<std::string> argv_storage;
  argv_storage.push_back(executable);
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const bool has_slash = executable.find('/') != std::string::npos;
  const int rc =
      has_slash ? ::posix_spawn(&pid, executable.c_str(), nullptr, nullptr, argv.data(), environ)
                : ::posix_spawnp(&pid, executable.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    return Status::FromErrno(rc, std::string(what) + " '" + executable + "': cannot run");
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0) {
    if (errno != EINTR) {
      return Status::FromErrno(errno, std::string(what) + " '" + executable + "': wait");
    }
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::OK();
  std::string how =
      WIFEXITED(wstatus)     ? "exited with status " + std::to_string(WEXITSTATUS(wstatus))
      : WIFSIGNALED(wstatus) ? "was killed by signal " + std::to_string(WTERMSIG(wstatus))
                             : "failed";
  // posix_spawn reports a missing executable as exit status 127 of the child.
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 127) how += " (not found or not executable?)";
  return Status::Aborted(std::string(what) + " '" + executable + "' " + how);
}

}  // namespace deltasync::io
