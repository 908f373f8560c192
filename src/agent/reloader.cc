// Engine reloaders: an HTTP POST (SGLang's /update_weights_from_disk body)
// or a command.
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent/http_util.h"
#include "deltasync/agent.h"

extern char** environ;

namespace deltasync {
namespace {

using agent_internal::HttpUrl;
using agent_internal::ParseHttpUrl;

// Splits seconds into the (sec, usec) pair httplib's timeouts take.
void SplitSeconds(double seconds, time_t* sec, time_t* usec) {
  *sec = static_cast<time_t>(seconds);
  *usec = static_cast<time_t>((seconds - static_cast<double>(*sec)) * 1e6);
}

std::string Truncated(const std::string& text, size_t max_chars = 300) {
  std::string out = text.size() > max_chars ? text.substr(0, max_chars) + "..." : text;
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

class HttpReloader final : public EngineReloader {
 public:
  HttpReloader(std::string url, HttpUrl parsed, double timeout_seconds)
      : url_(std::move(url)), parsed_(std::move(parsed)), timeout_seconds_(timeout_seconds) {}

  Status Reload(const std::string& model_path, int64_t version) override {
    httplib::Client client(parsed_.scheme_host_port);
    time_t sec = 0;
    time_t usec = 0;
    SplitSeconds(timeout_seconds_, &sec, &usec);
    client.set_connection_timeout(sec, usec);
    client.set_read_timeout(sec, usec);
    client.set_write_timeout(sec, usec);
    const nlohmann::json body = {{"model_path", model_path},
                                 {"weight_version", std::to_string(version)}};
    const std::string path = parsed_.path.empty() ? "/" : parsed_.path;
    httplib::Result res = client.Post(path, body.dump(), "application/json");
    if (!res) {
      return Status::IOError("engine reload POST " + url_ +
                             " failed: " + httplib::to_string(res.error()));
    }
    if (res->status < 200 || res->status >= 300) {
      return Status::Aborted("engine reload POST " + url_ + " answered " +
                             std::to_string(res->status) + ": " + Truncated(res->body));
    }
    const nlohmann::json reply = nlohmann::json::parse(res->body, nullptr, false);
    if (reply.is_object()) {
      auto it = reply.find("success");
      if (it != reply.end() && it->is_boolean() && !it->get<bool>()) {
        std::string message;
        if (auto m = reply.find("message"); m != reply.end() && m->is_string()) {
          message = m->get<std::string>();
        }
        return Status::Aborted("engine reload POST " + url_ +
                               " reported failure: " + Truncated(message));
      }
    }
    return Status::OK();
  }

  std::string Describe() const override { return "POST " + url_; }

 private:
  std::string url_;
  HttpUrl parsed_;
  double timeout_seconds_;
};

class CommandReloader final : public EngineReloader {
 public:
  CommandReloader(std::string command, double timeout_seconds)
      : command_(std::move(command)), timeout_seconds_(timeout_seconds) {}

  Status Reload(const std::string& model_path, int64_t version) override {
    const std::string version_text = std::to_string(version);
    const std::string script = command_ + " \"$@\"";
    std::vector<std::string> args = {"/bin/sh",          "-c",       script,
                                     "deltasync-reload", model_path, version_text};
    std::vector<std::string> env_strings;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      const std::string_view entry(*e);
      if (entry.starts_with("DELTASYNC_MODEL_PATH=") ||
          entry.starts_with("DELTASYNC_WEIGHT_VERSION=")) {
        continue;
      }
      env_strings.emplace_back(entry);
    }
    env_strings.push_back("DELTASYNC_MODEL_PATH=" + model_path);
    env_strings.push_back("DELTASYNC_WEIGHT_VERSION=" + version_text);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);

    // The agent's process blocks SIGTERM and SIGINT in every thread (they
    // are taken by sigwait); the command must get the defaults back, and its
    // own process group so that a timeout kills everything it started.
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t empty_mask;
    sigemptyset(&empty_mask);
    sigset_t defaults;
    sigemptyset(&defaults);
    for (int sig : {SIGTERM, SIGINT, SIGPIPE, SIGHUP, SIGQUIT}) sigaddset(&defaults, sig);
    posix_spawnattr_setsigmask(&attr, &empty_mask);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(
        &attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, "/bin/sh", nullptr, &attr, argv.data(), envp.data());
    posix_spawnattr_destroy(&attr);
    if (rc != 0) return Status::FromErrno(rc, "engine reload command: cannot start /bin/sh");

    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds_);
    auto poll = std::chrono::milliseconds(1);
    while (true) {
      int wstatus = 0;
      const pid_t done = waitpid(pid, &wstatus, WNOHANG);
      if (done == pid) {
        if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::OK();
        if (WIFEXITED(wstatus)) {
          return Status::Aborted("engine reload command '" + command_ + "' exited with status " +
                                 std::to_string(WEXITSTATUS(wstatus)));
        }
        return Status::Aborted("engine reload command '" + command_ + "' was killed by signal " +
                               std::to_string(WTERMSIG(wstatus)));
      }
      if (done < 0 && errno != EINTR) {
        return Status::FromErrno(errno, "engine reload command: waitpid");
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        kill(-pid, SIGKILL);
        waitpid(pid, &wstatus, 0);
        return Status::Aborted("engine reload command '" + command_ + "' timed out after " +
                               agent_internal::FormatDouble(timeout_seconds_) + " s (killed)");
      }
      std::this_thread::sleep_for(poll);
      if (poll < std::chrono::milliseconds(50)) poll *= 2;
    }
  }

  std::string Describe() const override { return "command: " + command_; }

 private:
  std::string command_;
  double timeout_seconds_;
};

bool ValidTimeout(double seconds) { return std::isfinite(seconds) && seconds > 0; }

}  // namespace

Result<std::unique_ptr<EngineReloader>> MakeHttpReloader(const std::string& url,
                                                         double timeout_seconds) {
  if (!ValidTimeout(timeout_seconds)) {
    return Status::InvalidArgument("reload timeout must be a positive number of seconds");
  }
  DS_ASSIGN_OR_RETURN(HttpUrl parsed, ParseHttpUrl(url));
  return std::unique_ptr<EngineReloader>(new HttpReloader(url, std::move(parsed), timeout_seconds));
}

Result<std::unique_ptr<EngineReloader>> MakeCommandReloader(const std::string& command,
                                                            double timeout_seconds) {
  if (command.find_first_not_of(" \t") == std::string::npos) {
    return Status::InvalidArgument("reload command is empty");
  }
  if (!ValidTimeout(timeout_seconds)) {
    return Status::InvalidArgument("reload timeout must be a positive number of seconds");
  }
  return std::unique_ptr<EngineReloader>(new CommandReloader(command, timeout_seconds));
}

}  // namespace deltasync
