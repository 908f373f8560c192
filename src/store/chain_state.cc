// Rebuilds the expected value of each tensor at a version from the store's
// chain: the newest delta that changed it, else the full version (or base)
// the chain starts from.

#include "store/chain_state.h"

#include <optional>
#include <utility>

#include "deltasync/store.h"
#include "format/json_util.h"
#include "store/version_internal.h"

namespace deltasync::store_internal {
namespace {

using format_internal::QuoteForMessage;

// "'a', 'b', 'c' and 4 more": enough names to act on, bounded in length.
std::string SomeNames(const std::set<std::string>& names) {
  std::string out;
  size_t shown = 0;
  for (const std::string& name : names) {
    if (shown == 3) break;
    out += (shown ? ", " : "") + QuoteForMessage(name);
    ++shown;
  }
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

// Takes the digests a delta's shards record for the still-pending names.
Status TakeFromDelta(const VersionInfo& info, std::set<std::string>* pending,
                     ChainExpectation* out) {
  const std::string where = "version " + FormatVersion(info.version) + " (" + info.dir + ")";
  Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(info.dir);
  if (!opened.ok()) return opened.status().WithContext(where);
  for (const auto& file : (*opened)->files()) {
    for (const TensorView& t : file->tensors()) {
      if (!pending->count(t.name)) continue;
      auto md = file->metadata().find(t.name);
      if (md == file->metadata().end()) {
        return Status::Corruption(where + ": " + file->path() + " records no checksum for tensor " +
                                  QuoteForMessage(t.name));
      }
      DS_RETURN_IF_ERROR(CheckDigestText(
          md->second, info.checksum, where + ": checksum of tensor " + QuoteForMessage(t.name)));
      ExpectedTensor& e = out->tensors[t.name];
      e.set_by = info.version;
      e.by_digest = true;
      e.algo = info.checksum;
      e.hex = md->second;
      pending->erase(t.name);
    }
  }
  return Status::OK();
}

// Every tensor the chain's starting point holds must be local; every pending
// local tensor must be in it.
Status CheckSameNames(const std::set<std::string>& source_names, const std::string& what,
                      const ChainQuery& query, const std::set<std::string>& pending) {
  std::set<std::string> not_local, not_in_source;
  for (const std::string& name : source_names) {
    if (!query.local_names.count(name)) not_local.insert(name);
  }
  for (const std::string& name : pending) {
    if (!source_names.count(name)) not_in_source.insert(name);
  }
  if (!not_local.empty()) {
    return Status::Corruption(what + " holds tensor " + SomeNames(not_local) +
                              ", which the local checkpoint lacks");
  }
  if (!not_in_source.empty()) {
    return Status::Corruption("local tensor " + SomeNames(not_in_source) + " is not in " + what +
                              ", and no later version up to " + FormatVersion(query.version) +
                              " changed it");
  }
  return Status::OK();
}

// The pending names take their bytes from `reference` (a full version
// without a sidecar, or the base), compared byte for byte.
Status TakeFromReference(std::unique_ptr<Checkpoint> reference, int64_t version,
                         const std::string& what, const ChainQuery& query,
                         std::set<std::string>* pending, ChainExpectation* out) {
  std::set<std::string> names;
  for (const auto& [name, view] : reference->tensors()) names.insert(name);
  DS_RETURN_IF_ERROR(CheckSameNames(names, what, query, *pending));
  for (const std::string& name : *pending) {
    ExpectedTensor& e = out->tensors[name];
    e.set_by = version;
    e.bytes = reference->tensors().at(name).bytes;
  }
  pending->clear();
  out->reference_dir = reference->path();
  out->reference = std::move(reference);
  return Status::OK();
}

Status TakeFromFullVersion(const VersionInfo& info, const ChainQuery& query,
                           std::set<std::string>* pending, ChainExpectation* out) {
  const std::string what = "full version " + FormatVersion(info.version) + " (" + info.dir + ")";
  DS_ASSIGN_OR_RETURN(std::optional<VersionManifest> manifest, ReadVersionManifest(info.dir));
  if (manifest && !manifest->is_delta) {
    // Our full versions list every tensor's digest: nothing to map.
    std::set<std::string> names;
    for (const auto& [name, t] : manifest->tensors) names.insert(name);
    DS_RETURN_IF_ERROR(CheckSameNames(names, what, query, *pending));
    for (const std::string& name : *pending) {
      ExpectedTensor& e = out->tensors[name];
      e.set_by = info.version;
      e.by_digest = true;
      e.algo = manifest->checksum;
      e.hex = manifest->tensors.at(name).checksum;
    }
    pending->clear();
    out->reference_dir = info.dir;
    return Status::OK();
  }
  Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(info.dir);
  if (!opened.ok()) return opened.status().WithContext(what);
  return TakeFromReference(std::move(*opened), info.version, what, query, pending, out);
}

}  // namespace

Result<ChainExpectation> RebuildExpectedState(const ChainQuery& query) {
  ChainExpectation out;
  std::set<std::string> pending = query.wanted;
  if (pending.empty()) return out;
  const std::string goal = "version " + FormatVersion(query.version);
  if (query.version > 0 && query.store.empty()) {
    return Status::FailedPrecondition("the store is needed to rebuild what " + goal +
                                      " holds (tensor " + SomeNames(pending) +
                                      " has no recorded checksum) but none was given");
  }
  for (int64_t v = query.version; v > 0 && !pending.empty(); --v) {
    Result<VersionInfo> info = ReadVersionInfo(VersionDir(query.store, v));
    if (!info.ok()) {
      if (info.status().IsNotFound()) {
        return Status::NotFound("version " + FormatVersion(v) + " is missing from store " +
                                query.store + " (needed to rebuild what " + goal + " holds)");
      }
      return info.status();
    }
    if (!info->is_delta) {
      DS_RETURN_IF_ERROR(TakeFromFullVersion(*info, query, &pending, &out));
      return out;
    }
    if (info->base_version != v - 1) {
      return Status::FailedPrecondition("version " + FormatVersion(v) + " applies to version " +
                                        FormatVersion(info->base_version) + ", not " +
                                        FormatVersion(v - 1) + ": out-of-order chain in " +
                                        query.store);
    }
    DS_RETURN_IF_ERROR(TakeFromDelta(*info, &pending, &out));
  }
  if (pending.empty()) return out;

  // No full version and no delta changed these: they are still the base's.
  if (query.base.empty()) {
    return Status::FailedPrecondition(
        "the base checkpoint (version 0) is needed to verify tensor " + SomeNames(pending) +
        ", which no version up to " + FormatVersion(query.version) +
        (query.store.empty() ? std::string() : " of " + query.store) +
        " changed, but none was given");
  }
  Result<std::unique_ptr<Checkpoint>> base = Checkpoint::Open(query.base);
  if (!base.ok()) {
    return Status::FailedPrecondition("the base checkpoint " + query.base +
                                      " (version 0) is needed to rebuild what " + goal +
                                      " holds but does not open: " + base.status().ToString());
  }
  DS_RETURN_IF_ERROR(TakeFromReference(std::move(*base), 0, "the base checkpoint " + query.base,
                                       query, &pending, &out));
  return out;
}

}  // namespace deltasync::store_internal
