// The disk transport's commands: publish, pull, verify, versions, prune.
#include <charconv>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "deltasync/store.h"

namespace deltasync::cli {
namespace {

// `tensors` counts a model's tensors everywhere; a delta version holds only
// the changed ones, `tensors_changed`.
nlohmann::json VersionJson(const VersionInfo& v) {
  nlohmann::json j = {
      {"version", v.version}, {"dir", v.dir}, {"kind", v.is_delta ? "delta" : "full"}};
  j[v.is_delta ? "tensors_changed" : "tensors"] = v.tensors;
  if (v.is_delta) {
    j["base_version"] = v.base_version;
    j["encoding"] = EncodingName(v.encoding);
    j["compression"] = v.compression;
    j["checksum"] = ChecksumAlgoName(v.checksum);
  }
  return j;
}

nlohmann::json PullJson(const PullResult& r) {
  // Every pull that returns is verified: each changed tensor was hashed
  // after its apply (a mismatch rolls back and fails the pull).
  nlohmann::json j = {{"version", r.version},
                      {"applied", r.applied},
                      {"verified", true},
                      {"versions_applied", r.versions_applied},
                      {"recovered", r.recovered},
                      {"reseeded", r.reseeded},
                      {"seconds", r.seconds},
                      {"bytes_read", r.bytes_read},
                      {"tensors_changed", r.tensors_changed},
                      {"changed_elements", r.changed_elements}};
  j["from_version"] = r.from_version ? nlohmann::json(*r.from_version) : nlohmann::json(nullptr);
  j["reset_to"] = r.reset_to ? nlohmann::json(*r.reset_to) : nlohmann::json(nullptr);
  return j;
}

}  // namespace

void RegisterPublish(CLI::App& app, CommandFn* run) {
  struct Opts {
    PublishFlags publish;
    std::string hook, max_shard = "1GiB";
    bool json = false;
    int64_t full_every = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "publish",
      "Publish NEW as the store's next version: a delta against OLD (what receivers "
      "hold now), or a full version");
  AddPublishFlags(cmd, "receivers", &o->publish);
  cmd->add_option("--full-every", o->full_every, "Make every K-th version full (0 = never)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--hook", o->hook,
                  "Executable run as `hook <temp_dir> <final_dir> <version>` (version: 6 digits) "
                  "once the version is complete in a temp dir inside the store, before it is "
                  "renamed to final_dir and becomes visible; non-zero exit fails the publish");
  cmd->add_option("--max-shard-bytes", o->max_shard,
                  "Most encoded bytes per delta shard file, with a unit (e.g. 64MiB)")
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->callback([o, run] {
    *run = [o]() -> int {
      PublisherOptions opts;
      Result<uint64_t> max_shard = ParseByteSize(o->max_shard);
      if (!max_shard.ok()) return Fail(max_shard.status().WithContext("--max-shard-bytes"));
      if (*max_shard == 0) {
        return Fail(Status::InvalidArgument("--max-shard-bytes: must be above 0"));
      }
      opts.max_shard_bytes = *max_shard;
      if (Status s = ApplyPublishFlags(o->publish, &opts); !s.ok()) return Fail(s);
      opts.full_every = o->full_every;
      opts.post_write_hook = o->hook;
      // One version per run: the old checkpoint is read in place rather than
      // copied into a publisher's snapshot.
      Result<PublishResult> r =
          PublishCheckpointOnce(opts, o->publish.old_ckpt, o->publish.new_ckpt, o->publish.full);
      if (!r.ok()) return Fail(r.status());
      if (o->json) {
        nlohmann::json j = VersionJson(r->info);
        j["tensors_changed"] = r->tensors_changed;
        j["changed_elements"] = r->changed_elements;
        j["total_elements"] = r->total_elements;
        j["bytes_written"] = r->bytes_written;
        j["seconds"] = r->seconds;
        std::cout << j.dump(2) << std::endl;
      } else {
        std::cout << "published " << r->info.dir << " ("
                  << (r->info.is_delta ? std::string(EncodingName(r->info.encoding)) +
                                             " delta on " + FormatVersion(r->info.base_version)
                                       : std::string("full"))
                  << "): " << r->tensors_changed << " of " << r->tensors << " tensors, "
                  << r->changed_elements << " changed elements, " << FormatBytes(r->bytes_written)
                  << " in " << FormatSeconds(r->seconds) << std::endl;
      }
      return 0;
    };
  });
}

void RegisterPull(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string store, local, base, target = "latest", hook;
    bool durable = false, json = false, force = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "pull", "Bring a host-local checkpoint to a version of the store (crash-safe, verified)");
  cmd->add_option("--store", o->store, "Store directory")->required();
  cmd->add_option("--local", o->local, "Host-local checkpoint directory")->required();
  cmd->add_option("--base", o->base, "The engine's base checkpoint (version 0)")->required();
  cmd->add_option("--target,-t", o->target, "Version number, or latest")->capture_default_str();
  cmd->add_option("--hook", o->hook,
                  "Executable run as `hook <store> <target>` (target: 6-digit version or "
                  "`latest`) at the start of the pull, before the store is listed; non-zero exit "
                  "fails the pull");
  cmd->add_flag("--durable", o->durable, "Sync data to disk before committing the new version");
  cmd->add_flag("--force", o->force,
                "Replace the weights in --local even if no pull made them (no "
                ".weight_sync/state.json: e.g. a trainer's checkpoint)");
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->callback([o, run] {
    *run = [o]() -> int {
      std::optional<int64_t> target;
      if (o->target != "latest") {
        int64_t t = 0;
        const char* begin = o->target.data();
        const char* end = begin + o->target.size();
        auto [ptr, ec] = std::from_chars(begin, end, t);
        if (o->target.empty() || ec != std::errc() || ptr != end || t < 0) {
          return Fail("--target must be a version number (0 = the base) or 'latest', got '" +
                      o->target + "'");
        }
        target = t;
      }
      LocalCheckpointOptions opts;
      opts.store = o->store;
      opts.local = o->local;
      opts.base = o->base;
      opts.pre_read_hook = o->hook;
      opts.durable = o->durable;
      opts.replace_unknown_checkpoint = o->force;
      Result<std::unique_ptr<LocalCheckpoint>> local = LocalCheckpoint::Open(opts);
      if (!local.ok()) return Fail(local.status());
      Result<PullResult> r = (*local)->Pull(target);
      if (!r.ok()) return Fail(r.status());
      // Only an empty store has no version past the base to call latest.
      const std::string empty_store =
          !target && r->version == 0 ? " (store " + o->store + " is empty)" : "";
      if (o->json) {
        std::cout << PullJson(*r).dump(2) << std::endl;
      } else if (!r->applied) {
        std::cout << o->local << " is already at version " << FormatVersion(r->version)
                  << empty_store << std::endl;
      } else {
        std::cout << o->local << ": "
                  << (r->from_version ? FormatVersion(*r->from_version) : std::string("(empty)"))
                  << " -> " << FormatVersion(r->version) << " (" << r->versions_applied.size()
                  << " deltas" << (r->reset_to ? ", reset to " + FormatVersion(*r->reset_to) : "")
                  << (r->recovered ? ", recovered an interrupted apply" : "") << "), "
                  << r->tensors_changed << " tensors changed, " << FormatBytes(r->bytes_read)
                  << " read in " << FormatSeconds(r->seconds) << ", verified" << empty_store
                  << std::endl;
      }
      return 0;
    };
  });
}

void RegisterVerify(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string store, local, base;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "verify", "Recompute the checksums of a host-local checkpoint against its applied version");
  cmd->add_option("--local", o->local, "Host-local checkpoint directory")->required();
  cmd->add_option("--store", o->store, "Store directory");
  cmd->add_option("--base", o->base, "The engine's base checkpoint (version 0)");
  cmd->callback([o, run] {
    *run = [o]() -> int {
      LocalCheckpointOptions opts;
      opts.store = o->store;
      opts.local = o->local;
      opts.base = o->base;
      opts.recover_on_open = false;  // verify reports; it never changes the checkpoint
      Result<std::unique_ptr<LocalCheckpoint>> local = LocalCheckpoint::Open(opts);
      if (!local.ok()) return Fail(local.status());
      // Verify says why when no version is committed (never pulled, or a
      // pull to recover).
      Status s = (*local)->Verify();
      if (!s.ok()) return Fail(s);
      Result<std::optional<int64_t>> v = (*local)->CurrentVersion();
      if (!v.ok()) return Fail(v.status());
      if (!v->has_value()) return Fail(o->local + " changed while being verified; verify again");
      std::cout << o->local << ": version " << FormatVersion(**v) << " verified" << std::endl;
      return 0;
    };
  });
}

void RegisterVersions(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string store;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("versions", "List the versions of a store");
  cmd->add_option("--store", o->store, "Store directory")->required();
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->callback([o, run] {
    *run = [o]() -> int {
      Result<std::vector<VersionInfo>> versions = ListVersions(o->store);
      if (!versions.ok()) return Fail(versions.status());
      if (o->json) {
        nlohmann::json arr = nlohmann::json::array();
        for (const VersionInfo& v : *versions) arr.push_back(VersionJson(v));
        std::cout << nlohmann::json{{"store", o->store}, {"versions", arr}}.dump(2) << std::endl;
        return 0;
      }
      if (versions->empty()) std::cout << o->store << ": empty store, no versions" << std::endl;
      for (const VersionInfo& v : *versions) {
        std::cout << FormatVersion(v.version) << "  ";
        if (v.is_delta) {
          std::cout << "delta on " << FormatVersion(v.base_version) << "  "
                    << EncodingName(v.encoding) << "/" << v.compression << "/"
                    << ChecksumAlgoName(v.checksum);
        } else {
          std::cout << "full";
        }
        std::cout << "  " << v.tensors << (v.is_delta ? " tensors changed" : " tensors")
                  << std::endl;
      }
      return 0;
    };
  });
}

void RegisterPrune(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string store;
    int64_t keep = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "prune", "Delete old versions, keeping the newest N and whatever the chain needs to replay");
  cmd->add_option("--store", o->store, "Store directory")->required();
  cmd->add_option("--keep", o->keep,
                  "Newest versions to keep (at least 1); versions from the newest full one on "
                  "are kept too")
      ->required();
  cmd->callback([o, run] {
    *run = [o]() -> int {
      if (o->keep < 1) {
        return Fail("--keep must be at least 1, not " + std::to_string(o->keep) +
                    ": the newest version (what receivers pull) and the versions from the " +
                    "newest full one on are never deleted");
      }
      Result<std::vector<int64_t>> removed = PruneStore(o->store, o->keep);
      if (!removed.ok()) return Fail(removed.status());
      std::cout << "removed " << removed->size() << " versions";
      for (int64_t v : *removed) std::cout << " " << FormatVersion(v);
      if (Result<std::vector<int64_t>> left = ListVersionNumbers(o->store);
          left.ok() && left->empty()) {
        std::cout << " (store " << o->store << " is empty)";
      }
      std::cout << std::endl;
      return 0;
    };
  });
}

}  // namespace deltasync::cli
