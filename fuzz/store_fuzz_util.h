// A small delta store for the libFuzzer targets that pull: a base
// checkpoint, versions published with the library's own publisher, and
// saved copies of local checkpoints at chosen versions, all in one scratch
// directory.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "deltasync/store.h"
#include "deltasync/thread_pool.h"
#include "fuzz_util.h"
#include "store/store_internal.h"

namespace deltasync::fuzz_util {

class FuzzStore {
 public:
  // Publishes versions 1..N, version i with `versions[i - 1]` (nullopt: a
  // full version), each a Step of the one before.
  FuzzStore(const char* prefix, const std::vector<std::optional<Encoding>>& versions)
      : dir_(prefix) {
    // Saved states carry this boot id, so that checked-in seeds match it.
    store_internal::SetBootIdForTesting(std::string("fuzz-boot"));
    models_.push_back(SmallModel(1));
    Require(WriteCheckpoint(base(), Views(models_[0])).ok(), "write the base");
    for (size_t i = 0; i < versions.size(); ++i) {
      models_.push_back(Step(models_.back(), 100 + i));
      PublisherOptions options;
      options.store = store();
      options.encoding = versions[i].value_or(Encoding::kSparse);
      options.pool = &pool_;
      Result<PublishResult> r = PublishOnce(options, Views(models_[models_.size() - 2]),
                                            Views(models_.back()), !versions[i].has_value());
      Require(r.ok(), "publish a version");
    }
  }

  std::string base() const { return dir_.Join("base"); }
  std::string store() const { return dir_.Join("store"); }
  std::string local() const { return dir_.Join("local"); }
  std::string saved(const std::string& name) const { return dir_.Join("saved-" + name); }
  std::string version_dir(int64_t v) const { return store() + "/" + VersionDirName(v); }
  const Model& model(int64_t v) const { return models_[static_cast<size_t>(v)]; }
  ThreadPool* pool() { return &pool_; }

  LocalCheckpointOptions LocalOpts(bool durable, bool recover_on_open = true) {
    LocalCheckpointOptions o;
    o.local = local();
    o.store = store();
    o.base = base();
    o.durable = durable;
    o.recover_on_open = recover_on_open;
    o.pool = &pool_;
    return o;
  }

  // Pulls a fresh local checkpoint to `version` and keeps a copy of it as
  // `name` (see Restore).
  void SaveLocalAt(int64_t version, const std::string& name) {
    std::error_code ec;
    std::filesystem::remove_all(local(), ec);
    {
      Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(LocalOpts(false));
      Require(l.ok(), "open a local checkpoint");
      Require((*l)->Pull(version).ok(), "pull the local checkpoint");
    }
    CopyDir(local(), saved(name));
  }
  // Keeps the current local checkpoint, whatever state it is in, as `name`.
  void SaveLocal(const std::string& name) { CopyDir(local(), saved(name)); }
  // Makes the local checkpoint the copy saved as `name` again.
  void Restore(const std::string& name) { CopyDir(saved(name), local()); }

 private:
  ScratchDir dir_;
  ThreadPool pool_{2};
  std::vector<Model> models_;
};

}  // namespace deltasync::fuzz_util
