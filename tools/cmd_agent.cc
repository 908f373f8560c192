// deltasync agent --store S --local L --base CKPT --listen HOST:PORT
//                 [--token-file F] [--reload-url URL | --reload-cmd CMD]
// Serves /pull_weights, /status, /health and /metrics for one rollout host
// until SIGTERM or SIGINT; then stops accepting, lets an in-flight pull
// finish and exits 0.
#include <signal.h>

#include <charconv>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "cli_util.h"
#include "deltasync/agent.h"
#include "deltasync/checkpoint.h"

namespace deltasync::cli {
namespace {

// "HOST:PORT", "[v6]:PORT" or ":PORT" (loopback).
Status ParseListen(const std::string& text, std::string* host, int* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) {
    return Status::InvalidArgument("--listen '" + text + "' must be HOST:PORT");
  }
  *host = text.substr(0, colon);
  if (host->empty()) *host = "127.0.0.1";
  if (host->find(':') != std::string::npos && host->front() != '[') {
    return Status::InvalidArgument("--listen '" + text + "': put an IPv6 host in brackets");
  }
  const std::string port_text = text.substr(colon + 1);
  const char* end = port_text.data() + port_text.size();
  auto [ptr, ec] = std::from_chars(port_text.data(), end, *port);
  if (port_text.empty() || ec != std::errc() || ptr != end || *port < 0 || *port > 65535) {
    return Status::InvalidArgument("--listen '" + text + "': port must be a number in 0..65535");
  }
  return Status::OK();
}

}  // namespace

void RegisterAgent(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string store, local, base, listen = "127.0.0.1:8470", token_file, reload_url, reload_cmd,
                                    max_body = "64KiB";
    double reload_timeout = 600;
    int request_nice = 19;
    bool verify_after_pull = false, durable = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "agent",
      "Serve one rollout host over HTTP: POST /pull_weights {\"target_version\": N|\"latest\"} "
      "brings the local checkpoint to version N of the store and can reload the engine; GET "
      "/status, /health, /metrics (Prometheus). Stops on SIGTERM after the pull in flight");
  cmd->add_option("--store", o->store, "Store directory (the shared filesystem)")->required();
  cmd->add_option("--local", o->local, "Host-local checkpoint directory the engine loads")
      ->required();
  cmd->add_option("--base", o->base, "The engine's base checkpoint (version 0)")->required();
  cmd->add_option("--listen", o->listen,
                  "HOST:PORT to serve on; port 0 picks one. A non-loopback host needs "
                  "--token-file")
      ->capture_default_str();
  cmd->add_option("--token-file", o->token_file,
                  "File holding a bearer token every request must carry "
                  "(Authorization: Bearer <token>)");
  CLI::Option* url =
      cmd->add_option("--reload-url", o->reload_url,
                      "After each pull, POST {\"model_path\": <local>, \"weight_version\": \"N\"} "
                      "here (SGLang's /update_weights_from_disk)");
  CLI::Option* command = cmd->add_option(
      "--reload-cmd", o->reload_cmd,
      "After each pull, run `/bin/sh -c '<CMD> \"$@\"' - <local> <N>` (also given as "
      "$DELTASYNC_MODEL_PATH and $DELTASYNC_WEIGHT_VERSION); non-zero exit fails the pull "
      "request with 502");
  url->excludes(command);
  cmd->add_option("--reload-timeout", o->reload_timeout, "Seconds a reload may take")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-body", o->max_body, "Largest request body accepted (413 beyond)")
      ->capture_default_str();
  cmd->add_option("--request-nice", o->request_nice,
                  "Nice value (0-19) of the threads that read requests and serve /status, "
                  "/health and /metrics; pulls keep the agent's own priority")
      ->capture_default_str()
      ->check(CLI::Range(0, 19));
  cmd->add_flag("--verify-after-pull", o->verify_after_pull,
                "Recompute every tensor's checksum after each pull (reads the whole checkpoint)");
  cmd->add_flag("--durable", o->durable,
                "Sync applied data to disk before committing each version (survives power loss)");
  cmd->callback([o, run] {
    *run = [o]() -> int {
      AgentOptions options;
      if (Status s = ParseListen(o->listen, &options.host, &options.port); !s.ok()) return Fail(s);
      Result<uint64_t> max_body = ParseByteSize(o->max_body);
      if (!max_body.ok()) return Fail(max_body.status().WithContext("--max-body"));
      options.max_body_bytes = static_cast<size_t>(*max_body);
      options.verify_after_pull = o->verify_after_pull;
      options.request_nice = o->request_nice;
      if (!o->token_file.empty()) {
        Result<std::string> token = ReadTokenFile(o->token_file);
        if (!token.ok()) return Fail(token.status());
        options.token = *token;
      }
      std::unique_ptr<EngineReloader> reloader;
      if (!o->reload_url.empty()) {
        Result<std::unique_ptr<EngineReloader>> r =
            MakeHttpReloader(o->reload_url, o->reload_timeout);
        if (!r.ok()) return Fail(r.status().WithContext("--reload-url"));
        reloader = std::move(r).value();
      } else if (!o->reload_cmd.empty()) {
        Result<std::unique_ptr<EngineReloader>> r =
            MakeCommandReloader(o->reload_cmd, o->reload_timeout);
        if (!r.ok()) return Fail(r.status().WithContext("--reload-cmd"));
        reloader = std::move(r).value();
      }

      // SIGTERM and SIGINT are taken by sigwait below, so they are blocked
      // before any thread exists (every thread inherits the mask); a signal
      // then never interrupts a pull half way, it only ends the wait.
      sigset_t stop_signals;
      sigemptyset(&stop_signals);
      sigaddset(&stop_signals, SIGTERM);
      sigaddset(&stop_signals, SIGINT);
      pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

      LocalCheckpointOptions local;
      // The engine gets this path in reload requests: make it mean the same
      // directory from the engine's working directory.
      std::error_code ec;
      const std::filesystem::path absolute_local = std::filesystem::absolute(o->local, ec);
      if (ec) return Fail("--local '" + o->local + "': " + ec.message());
      local.local = absolute_local.lexically_normal().string();
      while (local.local.size() > 1 && local.local.back() == '/') local.local.pop_back();
      // LocalCheckpoint opens the base only when a pull starts from it: a
      // wrong path would otherwise surface as the first pull's failure.
      const std::filesystem::file_status base = std::filesystem::status(o->base, ec);
      if (base.type() == std::filesystem::file_type::not_found) {
        return Fail("--base '" + o->base + "' does not exist");
      }
      if (ec) return Fail("--base '" + o->base + "': " + ec.message());
      if (!std::filesystem::is_directory(base) && !std::filesystem::is_regular_file(base)) {
        return Fail("--base '" + o->base + "' is neither a checkpoint directory nor a file");
      }
      // Its headers only: a directory that holds no checkpoint is refused too.
      if (Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(o->base); !opened.ok()) {
        return Fail(opened.status().WithContext("--base"));
      }
      local.store = o->store;
      local.base = o->base;
      local.durable = o->durable;
      Result<std::unique_ptr<CheckpointPuller>> puller = OpenLocalCheckpointPuller(local);
      if (!puller.ok()) return Fail(puller.status());
      Result<std::unique_ptr<Agent>> agent =
          Agent::Create(options, std::move(puller).value(), std::move(reloader));
      if (!agent.ok()) return Fail(agent.status());
      if (Status s = (*agent)->Start(); !s.ok()) return Fail(s);
      const bool v6 = options.host.find(':') != std::string::npos && options.host.front() != '[';
      std::cout << "deltasync agent listening on http://" << (v6 ? "[" : "") << options.host
                << (v6 ? "]" : "") << ":" << (*agent)->port() << std::endl;

      int signal_number = 0;
      while (sigwait(&stop_signals, &signal_number) != 0) {
      }
      std::cerr << "deltasync agent: " << (signal_number == SIGINT ? "SIGINT" : "SIGTERM")
                << " received, finishing the request in flight" << std::endl;
      (*agent)->Stop();
      return 0;
    };
  });
}

}  // namespace deltasync::cli
