// Publisher: diffs new weights against the snapshot of what receivers hold,
// writes the next version atomically, and advances the snapshot only once
// the version is durable. PruneStore lives here too.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "deltasync/checkpoint.h"
#include "deltasync/diff.h"
#include "deltasync/safetensors.h"
#include "deltasync/store.h"
#include "format/file_util.h"
#include "store/store_internal.h"
#include "store/version_internal.h"

namespace deltasync {
namespace {

using format_internal::JoinPath;
using store_internal::CrashPoint;
using store_internal::FirstError;
using store_internal::VersionDir;

struct SnapshotTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::unique_ptr<uint8_t[]> owned;  // null when borrowed from the caller
  uint8_t* data = nullptr;           // never written when borrowed
  size_t size = 0;
  // Hex digest (options.checksum) of the current contents, once computed.
  std::optional<std::string> checksum;

  std::span<uint8_t> bytes() { return {data, size}; }
  TensorView view() const { return {name, dtype, shape, {data, size}}; }
};

// What one tensor contributes to a delta version.
struct DeltaTensor {
  bool changed = false;
  bool refreshed = false;  // the snapshot already holds the new values
  ChangeSet undo;          // positions + old values while refreshed
  std::vector<uint8_t> encoded;
  std::string checksum;       // of the new bytes
  std::string base_checksum;  // of the old bytes
  uint64_t changed_elements = 0;
};

// Removes a temp dir unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(std::string path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (!path_.empty()) (void)store_internal::RemoveTree(path_);
  }
  void Release() { path_.clear(); }

 private:
  std::string path_;
};

std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct Publisher::State {
  PublisherOptions options;
  ThreadPool* pool = nullptr;
  std::vector<SnapshotTensor> tensors;
  std::unordered_map<std::string, size_t> index;
  int64_t latest = 0;
  // The snapshot points at the caller's base, which is only read: a
  // one-shot publish (PublishOnce) that never advances it.
  bool borrowed = false;

  static Result<std::unique_ptr<State>> Make(const PublisherOptions& options,
                                             const std::vector<TensorView>& base, bool borrow);
  Result<PublishResult> Publish(const std::vector<TensorView>& weights, bool full);

  // Orders `weights` as the snapshot, checking that they match it.
  Status MatchWeights(const std::vector<TensorView>& weights,
                      std::vector<const TensorView*>* ordered) const;
  Result<std::vector<DeltaTensor>> WriteDelta(const std::vector<const TensorView*>& weights,
                                              int64_t version, const std::string& dir,
                                              PublishResult* result);
  Status WriteFull(const std::vector<const TensorView*>& weights, int64_t version,
                   const std::string& dir, std::vector<std::string>* checksums);
  void RestoreSnapshot(std::vector<DeltaTensor>* delta);
};

Status Publisher::State::MatchWeights(const std::vector<TensorView>& weights,
                                      std::vector<const TensorView*>* ordered) const {
  ordered->assign(tensors.size(), nullptr);
  for (const TensorView& w : weights) {
    auto it = index.find(w.name);
    if (it == index.end()) {
      return Status::InvalidArgument("tensor '" + w.name + "' is not in the publisher's snapshot");
    }
    const SnapshotTensor& s = tensors[it->second];
    if (w.dtype != s.dtype || w.shape != s.shape) {
      return Status::InvalidArgument(
          "tensor '" + w.name + "' is " + std::string(DTypeName(w.dtype)) + ShapeToString(w.shape) +
          " but the snapshot holds " + std::string(DTypeName(s.dtype)) + ShapeToString(s.shape));
    }
    DS_RETURN_IF_ERROR(w.Validate().WithContext("tensor '" + w.name + "'"));
    if ((*ordered)[it->second] != nullptr) {
      return Status::InvalidArgument("tensor '" + w.name + "' is given twice");
    }
    (*ordered)[it->second] = &w;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if ((*ordered)[i] == nullptr) {
      return Status::InvalidArgument("tensor '" + tensors[i].name +
                                     "' of the snapshot is missing from the new weights");
    }
  }
  return Status::OK();
}

Result<std::vector<DeltaTensor>> Publisher::State::WriteDelta(
    const std::vector<const TensorView*>& weights, int64_t version, const std::string& dir,
    PublishResult* result) {
  const size_t n = tensors.size();
  std::vector<DeltaTensor> delta(n);
  std::atomic<uint64_t> undo_bytes{0};
  FirstError error;

  // Shards are written as they fill, under temporary names: their final
  // names carry the shard count, known only at the end.
  struct WrittenShard {
    std::string temp_name;
    std::vector<std::string> tensors;
  };
  std::vector<WrittenShard> shards;
  std::vector<size_t> batch;  // tensor indices of the shard being filled
  uint64_t batch_bytes = 0;
  auto flush_batch = [&]() -> Status {
    if (batch.empty()) return Status::OK();
    WrittenShard shard;
    shard.temp_name = "part-" + std::to_string(shards.size() + 1) + ".safetensors";
    std::vector<TensorSpec> specs;
    std::map<std::string, std::string> metadata;
    for (size_t i : batch) {
      specs.push_back(
          {tensors[i].name, DType::kU8, {static_cast<int64_t>(delta[i].encoded.size())}});
      metadata[tensors[i].name] = delta[i].checksum;
      shard.tensors.push_back(tensors[i].name);
    }
    DS_ASSIGN_OR_RETURN(
        std::unique_ptr<SafetensorsWriter> writer,
        SafetensorsWriter::Create(JoinPath(dir, shard.temp_name), std::move(specs), metadata));
    for (size_t i : batch) {
      DS_RETURN_IF_ERROR(writer->Append(delta[i].encoded));
      // Only the undo log and the digests outlive the shard.
      std::vector<uint8_t>().swap(delta[i].encoded);
    }
    DS_RETURN_IF_ERROR(writer->Finish());
    shards.push_back(std::move(shard));
    batch.clear();
    batch_bytes = 0;
    return Status::OK();
  };

  const PublisherOptions& opt = options;
  const Codec& codec = GetCodec(opt.encoding);
  auto process = [&](size_t i) {
    if (error.failed()) return;
    SnapshotTensor& snap = tensors[i];
    DeltaTensor& out = delta[i];
    const TensorView& w = *weights[i];
    // The base checksum must describe the bytes before the refresh.
    if (!snap.checksum) snap.checksum = ChecksumHex(opt.checksum, snap.bytes());
    DiffOptions diff;
    diff.elem_size = static_cast<uint32_t>(DTypeSize(snap.dtype));
    diff.refresh_snapshot =
        !borrowed && undo_bytes.load(std::memory_order_relaxed) < opt.undo_budget_bytes;
    diff.keep_old_values = true;
    diff.pool = nullptr;
    ChangeSet changes;
    Status s = DiffTensor(w.bytes, snap.bytes(), diff, &changes);
    if (!s.ok()) {
      error.Note(s.WithContext("tensor '" + snap.name + "'"));
      return;
    }
    out.refreshed = diff.refresh_snapshot;
    if (changes.count() == 0) return;
    out.changed = true;
    out.changed_elements = changes.count();
    out.base_checksum = *snap.checksum;
    s = codec.Encode(w.bytes, changes, opt.encode, &out.encoded);
    if (s.ok()) {
      out.checksum = ChecksumHex(opt.checksum, w.bytes);
    } else {
      error.Note(s.WithContext("encoding tensor '" + snap.name + "'"));
    }
    // Kept even on failure: a refreshed snapshot must be restorable.
    if (out.refreshed) {
      std::vector<uint8_t>().swap(changes.new_values);
      undo_bytes.fetch_add(changes.count() * (changes.wide ? 8 : 4) + changes.old_values.size(),
                           std::memory_order_relaxed);
      out.undo = std::move(changes);
    }
  };

  // Tensors are processed in windows so that the encoded bytes held at once
  // stay near one shard plus one window.
  const size_t window = std::max<size_t>(4, 2 * (pool->size() + 1));
  for (size_t begin = 0; begin < n && !error.failed(); begin += window) {
    const size_t end = std::min(n, begin + window);
    pool->ParallelFor(end - begin, [&](size_t k) { process(begin + k); });
    if (error.failed()) break;
    for (size_t i = begin; i < end; ++i) {
      if (!delta[i].changed) continue;
      const uint64_t size = delta[i].encoded.size();
      if (!batch.empty() && batch_bytes + size > opt.max_shard_bytes) {
        error.Note(flush_batch());
        if (error.failed()) break;
      }
      batch.push_back(i);
      batch_bytes += size;
      result->tensors_changed++;
      result->changed_elements += delta[i].changed_elements;
    }
  }
  if (!error.failed()) error.Note(flush_batch());
  if (error.failed()) {
    RestoreSnapshot(&delta);
    return error.status();
  }

  // Final shard names, the index, the sidecar.
  CheckpointIndex index;
  index.metadata["version"] = FormatVersion(version);
  index.metadata["base_version"] = FormatVersion(version - 1);
  index.metadata["delta_encoding"] = std::string(EncodingName(opt.encoding));
  index.metadata["compression_format"] = std::string(store_internal::CompressionOf(opt.encoding));
  index.metadata["checksum_format"] = std::string(ChecksumAlgoName(opt.checksum));
  Status status;
  for (size_t k = 0; k < shards.size() && status.ok(); ++k) {
    const std::string final_name = ShardName(k + 1, shards.size());
    if (::rename(JoinPath(dir, shards[k].temp_name).c_str(), JoinPath(dir, final_name).c_str()) !=
        0) {
      status = Status::FromErrno(errno, JoinPath(dir, final_name) + ": rename");
    }
    for (const std::string& name : shards[k].tensors) index.weight_map[name] = final_name;
  }
  VersionManifest manifest;
  manifest.version = version;
  manifest.is_delta = true;
  manifest.base_version = version - 1;
  manifest.checksum = opt.checksum;
  for (size_t i = 0; i < n; ++i) {
    if (!delta[i].changed) continue;
    ManifestTensor& t = manifest.tensors[tensors[i].name];
    t.dtype = tensors[i].dtype;
    t.shape = tensors[i].shape;
    t.checksum = delta[i].checksum;
    t.base_checksum = delta[i].base_checksum;
    t.changed = delta[i].changed_elements;
  }
  if (status.ok()) {
    Result<std::string> index_text = SerializeCheckpointIndex(index);
    status = index_text.ok()
                 ? format_internal::WriteFileAtomically(JoinPath(dir, kIndexFileName), *index_text)
                 : index_text.status();
  }
  if (status.ok()) {
    status =
        format_internal::WriteFileAtomically(JoinPath(dir, kVersionManifestFileName),
                                             store_internal::SerializeVersionManifest(manifest));
  }
  if (!status.ok()) {
    RestoreSnapshot(&delta);
    return status;
  }
  return delta;
}

void Publisher::State::RestoreSnapshot(std::vector<DeltaTensor>* delta) {
  pool->ParallelFor(delta->size(), [&](size_t i) {
    DeltaTensor& d = (*delta)[i];
    if (!d.refreshed || d.undo.count() == 0) return;
    const uint32_t es = d.undo.elem_size;
    uint8_t* dst = tensors[i].data;
    for (uint64_t k = 0; k < d.undo.count(); ++k) {
      std::memcpy(dst + d.undo.position(k) * es, d.undo.old_values.data() + k * es, es);
    }
    d.refreshed = false;
  });
}

Status Publisher::State::WriteFull(const std::vector<const TensorView*>& weights, int64_t version,
                                   const std::string& dir, std::vector<std::string>* checksums) {
  checksums->assign(weights.size(), std::string());
  pool->ParallelFor(weights.size(), [&](size_t i) {
    (*checksums)[i] = ChecksumHex(options.checksum, weights[i]->bytes);
  });
  std::vector<TensorView> views;
  views.reserve(weights.size());
  for (const TensorView* w : weights) views.push_back(*w);
  CheckpointWriteOptions write;
  write.max_shard_bytes = std::max<uint64_t>(1, options.full_max_shard_bytes);
  write.index_metadata["version"] = FormatVersion(version);
  // transformers refuses safetensors files whose metadata lacks format=pt.
  write.shard_metadata["format"] = "pt";
  DS_RETURN_IF_ERROR(WriteCheckpoint(dir, views, write));
  VersionManifest manifest;
  manifest.version = version;
  manifest.is_delta = false;
  manifest.checksum = options.checksum;
  for (size_t i = 0; i < weights.size(); ++i) {
    ManifestTensor& t = manifest.tensors[tensors[i].name];
    t.dtype = tensors[i].dtype;
    t.shape = tensors[i].shape;
    t.checksum = (*checksums)[i];
  }
  return format_internal::WriteFileAtomically(JoinPath(dir, kVersionManifestFileName),
                                              store_internal::SerializeVersionManifest(manifest));
}

Publisher::Publisher(std::unique_ptr<State> state) : state_(std::move(state)) {}
Publisher::~Publisher() = default;

Result<std::unique_ptr<Publisher::State>> Publisher::State::Make(
    const PublisherOptions& options, const std::vector<TensorView>& base, bool borrow) {
  if (options.store.empty()) return Status::InvalidArgument("publisher: no store directory given");
  if (options.full_every < 0) {
    return Status::InvalidArgument("publisher: full_every must be >= 0, not " +
                                   std::to_string(options.full_every));
  }
  if (options.max_shard_bytes == 0) {
    return Status::InvalidArgument("publisher: max_shard_bytes must be > 0");
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->pool = options.pool ? options.pool : &ThreadPool::Default();
  state->borrowed = borrow;
  state->tensors.resize(base.size());
  for (size_t i = 0; i < base.size(); ++i) {
    const TensorView& t = base[i];
    DS_RETURN_IF_ERROR(t.Validate().WithContext("base tensor '" + t.name + "'"));
    if (!state->index.emplace(t.name, i).second) {
      return Status::InvalidArgument("base tensor '" + t.name + "' is given twice");
    }
    SnapshotTensor& s = state->tensors[i];
    s.name = t.name;
    s.dtype = t.dtype;
    s.shape = t.shape;
    s.size = t.bytes.size();
    if (borrow) {
      // Only read: the diff runs without refresh.
      s.data = const_cast<uint8_t*>(t.bytes.data());
    } else {
      s.owned.reset(new uint8_t[std::max<size_t>(1, s.size)]);
      s.data = s.owned.get();
    }
  }
  if (!borrow) {
    state->pool->ParallelFor(base.size(), [&](size_t i) {
      if (!base[i].bytes.empty()) {
        std::memcpy(state->tensors[i].data, base[i].bytes.data(), base[i].bytes.size());
      }
    });
  }
  DS_RETURN_IF_ERROR(format_internal::CreateDirectories(options.store));
  DS_ASSIGN_OR_RETURN(std::vector<int64_t> versions, ListVersionNumbers(options.store));
  state->latest = versions.empty() ? 0 : versions.back();
  return state;
}

Result<std::unique_ptr<Publisher>> Publisher::Create(const PublisherOptions& options,
                                                     const std::vector<TensorView>& base) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<State> state, State::Make(options, base, false));
  return std::unique_ptr<Publisher>(new Publisher(std::move(state)));
}

Result<std::unique_ptr<Publisher>> Publisher::CreateFromCheckpoint(const PublisherOptions& options,
                                                                   const std::string& base_path) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> base, Checkpoint::Open(base_path));
  std::vector<TensorView> views;
  for (const auto& [name, view] : base->tensors()) views.push_back(view);
  return Create(options, views);
}

int64_t Publisher::latest_version() const { return state_->latest; }

std::vector<TensorView> Publisher::snapshot() const {
  std::vector<TensorView> views;
  for (const SnapshotTensor& t : state_->tensors) views.push_back(t.view());
  return views;
}

Result<PublishResult> Publisher::PublishCheckpoint(const std::string& path, bool full) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(path));
  std::vector<TensorView> views;
  for (const auto& [name, view] : checkpoint->tensors()) views.push_back(view);
  return Publish(views, full);
}

Result<PublishResult> Publisher::Publish(const std::vector<TensorView>& weights, bool full) {
  return state_->Publish(weights, full);
}

Result<PublishResult> Publisher::State::Publish(const std::vector<TensorView>& weights, bool full) {
  const auto t0 = std::chrono::steady_clock::now();
  State& st = *this;
  std::vector<const TensorView*> ordered;
  DS_RETURN_IF_ERROR(st.MatchWeights(weights, &ordered));
  const std::string& store = st.options.store;
  DS_ASSIGN_OR_RETURN(std::vector<int64_t> existing, ListVersionNumbers(store));
  if (!existing.empty() && existing.back() > st.latest) {
    return Status::FailedPrecondition(
        store + " already holds version " + FormatVersion(existing.back()) +
        ", newer than this publisher's latest " + FormatVersion(st.latest) +
        ": is another publisher writing to this store?");
  }
  const int64_t version = st.latest + 1;
  if (st.options.full_every > 0 && version % st.options.full_every == 0) full = true;
  const std::string final_dir = VersionDir(store, version);
  if (store_internal::PathExists(final_dir)) {
    return Status::AlreadyExists(final_dir + ": already exists; refusing to overwrite a version");
  }
  static std::atomic<uint64_t> counter{0};
  const std::string temp_dir =
      JoinPath(store, ".tmp-" + VersionDirName(version) + "-" + std::to_string(::getpid()) + "-" +
                          std::to_string(counter.fetch_add(1)));
  (void)store_internal::RemoveTree(temp_dir);
  if (::mkdir(temp_dir.c_str(), 0755) != 0) {
    return Status::FromErrno(errno, temp_dir + ": create");
  }
  TempDirGuard guard(temp_dir);

  PublishResult result;
  result.tensors = st.tensors.size();
  for (const SnapshotTensor& t : st.tensors) {
    result.total_elements += t.size / DTypeSize(t.dtype);
  }
  std::vector<DeltaTensor> delta;
  std::vector<std::string> full_checksums;
  if (full) {
    DS_RETURN_IF_ERROR(st.WriteFull(ordered, version, temp_dir, &full_checksums));
    result.tensors_changed = st.tensors.size();
  } else {
    DS_ASSIGN_OR_RETURN(delta, st.WriteDelta(ordered, version, temp_dir, &result));
  }
  // From here on a failure must put the snapshot back.
  Status status = format_internal::SyncDirectory(temp_dir);
  if (status.ok() && !st.options.post_write_hook.empty()) {
    status =
        store_internal::RunHook(st.options.post_write_hook,
                                {temp_dir, final_dir, FormatVersion(version)}, "post-write hook");
  }
  if (status.ok()) {
    CrashPoint("publish:before-rename");
    status = store_internal::RenameNoReplace(temp_dir, final_dir);
  }
  if (!status.ok()) {
    st.RestoreSnapshot(&delta);
    return status.WithContext("publishing " + VersionDirName(version));
  }
  guard.Release();
  // The version is visible; a failed directory sync leaves it visible but
  // maybe not durable, which the caller must hear about, yet the snapshot
  // must follow what readers can now see.
  Status sync_status = format_internal::SyncDirectory(store);
  st.latest = version;

  // Advance the snapshot.
  if (st.borrowed) {
    // Nothing to advance; only the statistics a full version lacks.
    if (full) {
      std::atomic<uint64_t> changed{0};
      st.pool->ParallelFor(st.tensors.size(), [&](size_t i) {
        Result<uint64_t> n = CountChanged(ordered[i]->bytes, st.tensors[i].bytes(),
                                          static_cast<uint32_t>(DTypeSize(st.tensors[i].dtype)));
        if (n.ok()) changed.fetch_add(*n, std::memory_order_relaxed);
      });
      result.changed_elements = changed.load();
    }
  } else if (full) {
    std::atomic<uint64_t> changed{0};
    st.pool->ParallelFor(st.tensors.size(), [&](size_t i) {
      SnapshotTensor& s = st.tensors[i];
      DiffOptions diff;
      diff.elem_size = static_cast<uint32_t>(DTypeSize(s.dtype));
      diff.keep_old_values = false;
      ChangeSet changes;
      if (DiffTensor(ordered[i]->bytes, s.bytes(), diff, &changes).ok()) {
        changed.fetch_add(changes.count(), std::memory_order_relaxed);
      } else {
        if (s.size > 0) std::memcpy(s.data, ordered[i]->bytes.data(), s.size);
      }
      s.checksum = full_checksums[i];
    });
    result.changed_elements = changed.load();
  } else {
    st.pool->ParallelFor(st.tensors.size(), [&](size_t i) {
      SnapshotTensor& s = st.tensors[i];
      DeltaTensor& d = delta[i];
      if (!d.changed) return;
      if (!d.refreshed && s.size > 0) {
        std::memcpy(s.data, ordered[i]->bytes.data(), s.size);
      }
      s.checksum = d.checksum;
      d.undo = ChangeSet();
    });
  }

  DS_ASSIGN_OR_RETURN(result.info, ReadVersionInfo(final_dir));
  result.bytes_written = store_internal::DirectoryBytes(final_dir);
  result.seconds = SecondsSince(t0);
  if (!sync_status.ok()) return sync_status.WithContext("version published but not synced");
  return result;
}

Result<PublishResult> PublishOnce(const PublisherOptions& options,
                                  const std::vector<TensorView>& base,
                                  const std::vector<TensorView>& weights, bool full) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Publisher::State> state,
                      Publisher::State::Make(options, base, /*borrow=*/true));
  return state->Publish(weights, full);
}

Result<PublishResult> PublishCheckpointOnce(const PublisherOptions& options,
                                            const std::string& base_path,
                                            const std::string& new_path, bool full) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> base, Checkpoint::Open(base_path));
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> next, Checkpoint::Open(new_path));
  std::vector<TensorView> base_views, new_views;
  for (const auto& [name, view] : base->tensors()) base_views.push_back(view);
  for (const auto& [name, view] : next->tensors()) new_views.push_back(view);
  return PublishOnce(options, base_views, new_views, full);
}

// ---------------------------------------------------------------------------
// PruneStore

Result<std::vector<int64_t>> PruneStore(const std::string& store, int64_t keep) {
  if (keep < 1) {
    return Status::InvalidArgument("prune: keep must be >= 1, not " + std::to_string(keep));
  }
  DS_ASSIGN_OR_RETURN(std::vector<VersionInfo> versions, ListVersions(store));
  std::vector<int64_t> removed;
  int64_t newest_full = -1;
  for (const VersionInfo& v : versions) {
    if (!v.is_delta) newest_full = v.version;
  }
  const int64_t latest = versions.empty() ? 0 : versions.back().version;
  if (newest_full >= 0) {
    const size_t first_kept = versions.size() > static_cast<size_t>(keep)
                                  ? versions.size() - static_cast<size_t>(keep)
                                  : 0;
    static std::atomic<uint64_t> counter{0};
    for (size_t i = 0; i < first_kept; ++i) {
      const int64_t v = versions[i].version;
      if (v >= newest_full) break;
      // Out of the listing first (atomic), then deleted: a reader never
      // sees a version with files missing.
      const std::string trash =
          JoinPath(store, ".trash-" + VersionDirName(v) + "-" + std::to_string(::getpid()) + "-" +
                              std::to_string(counter.fetch_add(1)));
      DS_RETURN_IF_ERROR(store_internal::RenameNoReplace(versions[i].dir, trash));
      DS_RETURN_IF_ERROR(store_internal::RemoveTree(trash));
      removed.push_back(v);
    }
  }
  // Leftovers: temp dirs whose version exists (their rename can never
  // succeed) and trash of interrupted prunes.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(store, ec)) {
    const std::string name = entry.path().filename().string();
    bool stale = name.rfind(".trash-", 0) == 0;
    if (name.rfind(".tmp-", 0) == 0) {
      const std::string rest = name.substr(5);
      const size_t dash = rest.find('-');
      Result<int64_t> v = ParseVersionDirName(rest.substr(0, dash));
      stale = v.ok() && *v <= latest;
    }
    if (stale) (void)store_internal::RemoveTree(entry.path().string());
  }
  if (!removed.empty()) DS_RETURN_IF_ERROR(format_internal::SyncDirectory(store));
  return removed;
}

}  // namespace deltasync
