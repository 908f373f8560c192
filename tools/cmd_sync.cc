// deltasync sync --store S --old CKPT --new CKPT --engines URL[,URL...]
//                [--token-file F] [--encoding E] [--timeout S] [--retries N]
// Publishes NEW as the store's next version, then has every engine's agent
// pull it, concurrently; prints a JSON summary. Exit 0 only when every
// engine reports the new version verified.
#include <iostream>

#include "cli_util.h"
#include "deltasync/agent.h"
#include "deltasync/store.h"

namespace deltasync::cli {

void RegisterSync(CLI::App& app, CommandFn* run) {
  struct Opts {
    PublishFlags publish;
    std::string token_file;
    std::vector<std::string> engines;
    double timeout = 600, connect_timeout = 10;
    int retries = 3;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "sync",
      "Publish NEW as the store's next version (a delta against OLD, what the engines hold "
      "now) and have every engine's agent pull it; prints a JSON summary and fails unless "
      "every engine reports the version verified");
  AddPublishFlags(cmd, "engines", &o->publish);
  cmd->add_option("--engines", o->engines,
                  "Agent URLs, comma-separated: http://host:port[/prefix] or host:port")
      ->required()
      ->delimiter(',');
  cmd->add_option("--token-file", o->token_file, "File holding the agents' bearer token");
  cmd->add_option("--timeout", o->timeout,
                  "Seconds to wait for one engine's pull (and reload) to answer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--connect-timeout", o->connect_timeout, "Seconds to wait for a connection")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--retries", o->retries,
                  "Further attempts per engine after connection errors, timeouts and 5xx "
                  "(exponential backoff); 4xx is final")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  cmd->callback([o, run] {
    *run = [o]() -> int {
      PublisherOptions publish;
      if (Status s = ApplyPublishFlags(o->publish, &publish); !s.ok()) return Fail(s);

      SyncOptions sync;
      for (const std::string& engine : o->engines) {
        if (!engine.empty()) sync.engines.push_back(engine);
      }
      // Before anything is published: a sync that cannot reach an engine
      // must not leave a version behind.
      if (Status s = CheckEngineUrls(sync.engines); !s.ok()) return Fail(s);
      sync.pull.timeout_seconds = o->timeout;
      sync.pull.connect_timeout_seconds = o->connect_timeout;
      sync.pull.retries = o->retries;
      if (!o->token_file.empty()) {
        Result<std::string> token = ReadTokenFile(o->token_file);
        if (!token.ok()) return Fail(token.status());
        sync.pull.token = *token;
      }

      Result<std::unique_ptr<Publisher>> publisher =
          Publisher::CreateFromCheckpoint(publish, o->publish.old_ckpt);
      if (!publisher.ok()) return Fail(publisher.status());
      Result<std::unique_ptr<SyncCoordinator>> coordinator =
          SyncCoordinator::Create(sync, std::move(publisher).value());
      if (!coordinator.ok()) return Fail(coordinator.status());
      Result<SyncReport> report =
          (*coordinator)->SyncCheckpoint(o->publish.new_ckpt, o->publish.full);
      if (!report.ok()) return Fail(report.status().WithContext("publish failed"));
      std::cout << SyncReportToJson(*report) << std::endl;
      // The version stays published whatever the engines did: say so, so
      // that a rerun does not publish the same weights again on top of it.
      if (!report->status.ok()) {
        return Fail("published version " + FormatVersion(report->version) +
                    ", but not every engine pulled it: " + report->status.message());
      }
      return 0;
    };
  });
}

}  // namespace deltasync::cli
