// Publisher: diffs new weights against the snapshot of what receivers hold,
// writes the next version atomically, and advances the snapshot only once
// the version is durable. PruneStore lives here too.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "core/parallel.h"
#include "deltasync/checkpoint.h"
#include "deltasync/diff.h"
#include "deltasync/safetensors.h"
#include "deltasync/store.h"
#include "deltasync/timing.h"
#include "format/json_util.h"
#include "io/file.h"
#include "io/mapping.h"
#include "io/process.h"
#include "pipeline/chunked_diff.h"
#include "pipeline/producer.h"
#include "store/store_internal.h"
#include "store/version_internal.h"

namespace deltasync {
namespace {

using core_internal::FirstError;
using format_internal::QuoteForMessage;
using io::JoinPath;
using store_internal::CrashPoint;
using store_internal::IsWeakChecksum;
using store_internal::kStrongChecksum;
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
  // The same in kStrongChecksum, kept when options.checksum is weak.
  std::optional<std::string> strong_checksum;

  std::span<uint8_t> bytes() { return {data, size}; }
  TensorView view() const { return {name, dtype, shape, {data, size}}; }
};

// What one tensor contributes to a delta version.
struct DeltaTensor {
  bool changed = false;
  bool refreshed = false;     // the snapshot already holds the new values
  ChangeSet undo;             // positions + old values while refreshed
  std::string checksum;       // of the new bytes
  std::string base_checksum;  // of the old bytes
  // kStrongChecksum digests, when options.checksum is weak.
  std::string strong_checksum;
  std::string strong_base_checksum;
  // The old bytes' digest in the algorithm of the newest version's record,
  // when the base is checked against it.
  std::string check_digest;
  uint64_t changed_elements = 0;
};

// What the store's newest version records about every tensor: what the
// base of a delta published on top of it must hold.
struct BaseRecord {
  int64_t version = 0;
  std::string dir;
  // Digests of the tensors' bytes, name -> hex in `algo`; nullopt for a
  // full version without a sidecar, known by its tensors' dtypes and shapes.
  std::optional<ChecksumAlgo> algo;
  std::map<std::string, std::string> digests;
  std::map<std::string, std::pair<DType, std::vector<int64_t>>> specs;
  // Every tensor of the version is listed: the base must hold no other.
  // Otherwise only the tensors the version changed are (a sidecar that
  // predates the state record, or none: the Python publisher's).
  bool complete = false;

  bool Lists(const std::string& name) const {
    return algo ? digests.count(name) > 0 : specs.count(name) > 0;
  }
};

// Removes a temp dir unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(std::string path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (!path_.empty()) (void)io::RemoveTree(path_);
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

// Bytes copied at a time from a slot's data file into its shard.
constexpr size_t kShardCopyBytes = size_t{1} << 20;

// A data file that one producer lane of a delta publish appends the
// encodings of its finished tensors to, assembled into a shard at the end.
struct SlotPart {
  std::string data_path;
  int fd = -1;
  uint64_t size = 0;
  std::vector<std::pair<size_t, uint64_t>> tensors;  // (index, encoded bytes), in file order
  SlotPart() = default;
  SlotPart(const SlotPart&) = delete;
  SlotPart& operator=(const SlotPart&) = delete;
  ~SlotPart() {
    if (fd >= 0) ::close(fd);
  }
};

// The disk store's sink: each producer lane appends the encodings of the
// tensors it finishes to a data file of its own (a new one past
// max_shard_bytes), so the encoded delta is never held in memory beyond the
// tensors in flight; WriteDelta assembles the shards from those files.
class SlotFiles final : public pipeline::EncodingSink {
 public:
  SlotFiles(std::string dir, uint64_t max_shard_bytes)
      : dir_(std::move(dir)), max_shard_bytes_(max_shard_bytes) {}

  Status Put(size_t lane, size_t index, const pipeline::TensorDelta& delta,
             std::span<const uint8_t> encoding) override {
    (void)delta;
    SlotPart*& part = LanePart(lane);
    if (part == nullptr ||
        (!part->tensors.empty() && part->size + encoding.size() > max_shard_bytes_)) {
      if (part != nullptr) {  // full: reopened to be read at the end
        ::close(part->fd);
        part->fd = -1;
      }
      DS_ASSIGN_OR_RETURN(part, NewPart());
    }
    DS_RETURN_IF_ERROR(
        io::WriteAllAt(part->fd, encoding.data(), encoding.size(), part->size, part->data_path));
    part->tensors.emplace_back(index, encoding.size());
    part->size += encoding.size();
    return Status::OK();
  }

  // Every data file made, in the order made.
  std::vector<std::unique_ptr<SlotPart>>& parts() { return parts_; }

 private:
  // The lane's current data file (null before its first); only the lane's
  // own calls use the entry, and a deque keeps it in place as others are
  // added.
  SlotPart*& LanePart(size_t lane) {
    std::lock_guard<std::mutex> lock(mu_);
    while (lane_parts_.size() <= lane) lane_parts_.push_back(nullptr);
    return lane_parts_[lane];
  }

  Result<SlotPart*> NewPart() {
    auto part = std::make_unique<SlotPart>();
    std::lock_guard<std::mutex> lock(mu_);
    part->data_path = JoinPath(dir_, ".data-" + std::to_string(parts_.size() + 1));
    part->fd = ::open(part->data_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (part->fd < 0) return Status::FromErrno(errno, part->data_path + ": create");
    parts_.push_back(std::move(part));
    return parts_.back().get();
  }

  const std::string dir_;
  const uint64_t max_shard_bytes_;
  std::mutex mu_;  // guards parts_ and the size of lane_parts_
  std::vector<std::unique_ptr<SlotPart>> parts_;
  std::deque<SlotPart*> lane_parts_;
};

// What the store's newest version `newest` records about its tensors,
// read from its sidecar (or, without one, its shards' headers). A version
// that is empty, lacks its index, names shards that are missing or is
// otherwise unreadable is FailedPrecondition: nothing can be published on
// top of it until it is removed.
Result<BaseRecord> ReadBaseRecord(const std::string& store, int64_t newest) {
  const std::string dir = VersionDir(store, newest);
  auto unusable = [&dir](const Status& s) {
    const std::string what = "cannot publish on top of the store's newest version " + dir;
    if (s.code() == StatusCode::kIOError || s.code() == StatusCode::kUnsupported) {
      return s.WithContext(what);
    }
    return Status::FailedPrecondition(what + ", which is incomplete or damaged (" + s.message() +
                                      "): if it is left over from an interrupted write or " +
                                      "copy, remove it and publish again");
  };
  Result<VersionInfo> info = ReadVersionInfo(dir);
  if (!info.ok()) return unusable(info.status());
  // Opening maps every shard the index names and validates their headers
  // (a missing or truncated shard fails here); no tensor data is read.
  Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(dir);
  if (!opened.ok()) return unusable(opened.status());
  Result<std::optional<VersionManifest>> manifest = ReadVersionManifest(dir);
  if (!manifest.ok()) return unusable(manifest.status());

  BaseRecord record;
  record.version = newest;
  record.dir = dir;
  if (*manifest && (*manifest)->state) {
    const VersionManifest& m = **manifest;
    record.complete = true;
    record.algo = m.strong ? *m.strong : m.checksum;
    record.digests = m.strong ? m.strong_state : *m.state;
  } else if (*manifest) {
    // A delta from an older publisher: the changed tensors only.
    record.algo = (*manifest)->checksum;
    for (const auto& [name, t] : (*manifest)->tensors) record.digests[name] = t.checksum;
  } else if (info->is_delta) {
    // The Python publisher's delta: the changed tensors' new checksums.
    record.algo = info->checksum;
    for (const auto& file : (*opened)->files()) {
      for (const TensorView& t : file->tensors()) {
        auto md = file->metadata().find(t.name);
        if (md == file->metadata().end()) {
          return unusable(Status::Corruption(file->path() + " records no checksum for tensor " +
                                             QuoteForMessage(t.name)));
        }
        record.digests[t.name] = md->second;
      }
    }
  } else {
    // A full version without a sidecar: its tensors' names, dtypes and
    // shapes are what it records without reading the weights.
    record.complete = true;
    for (const auto& [name, t] : (*opened)->tensors()) record.specs[name] = {t.dtype, t.shape};
  }
  return record;
}

// FailedPrecondition naming the first tensor, in name order, where the base
// (`tensors`, `digests[i]` the hex digest of tensor i in record.algo) is not
// what `record` says.
Status CheckBase(const BaseRecord& record, const std::vector<SnapshotTensor>& tensors,
                 const std::vector<std::string>& digests) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  std::vector<const std::string*> listed;
  if (record.algo) {
    for (const auto& [name, digest] : record.digests) listed.push_back(&name);
  } else {
    for (const auto& [name, spec] : record.specs) listed.push_back(&name);
  }
  const std::string version = FormatVersion(record.version);
  auto refuse = [&](const std::string& why) {
    return Status::FailedPrecondition("cannot publish a delta on version " + version + " (" +
                                      record.dir + "): the base given is not what that version " +
                                      "holds, so no host could apply the delta: " + why);
  };
  size_t a = 0, b = 0;
  while (a < order.size() || b < listed.size()) {
    const SnapshotTensor* t = a < order.size() ? &tensors[order[a]] : nullptr;
    if (t != nullptr && (b == listed.size() || t->name < *listed[b])) {
      if (record.complete) {
        return refuse("tensor " + QuoteForMessage(t->name) + " of the base is not in it");
      }
      ++a;
      continue;
    }
    if (t == nullptr || *listed[b] < t->name) {
      return refuse("its tensor " + QuoteForMessage(*listed[b]) + " is not in the base");
    }
    if (record.algo) {
      const std::string& recorded = record.digests.at(t->name);
      const std::string& actual = digests[order[a]];
      if (actual != recorded) {
        return refuse("tensor " + QuoteForMessage(t->name) + " differs (" +
                      std::string(ChecksumAlgoName(*record.algo)) + " " + actual +
                      " in the base, " + recorded + " in the version)");
      }
    } else {
      const auto& [dtype, shape] = record.specs.at(t->name);
      if (t->dtype != dtype || t->shape != shape) {
        return refuse("tensor " + QuoteForMessage(t->name) + " is " +
                      std::string(DTypeName(t->dtype)) + ShapeToString(t->shape) +
                      " in the base, " + std::string(DTypeName(dtype)) + ShapeToString(shape) +
                      " in the version");
      }
    }
    ++a;
    ++b;
  }
  return Status::OK();
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
  // A borrowed base's check against the store's newest version, done by
  // the delta pass, which hashes every base tensor anyway. An owned base is
  // checked as it is copied, in Make.
  std::optional<BaseRecord> base_record;

  static Result<std::unique_ptr<State>> Make(const PublisherOptions& options,
                                             const std::vector<TensorView>& base, bool borrow);
  Result<PublishResult> Publish(const std::vector<TensorView>& weights, bool full);

  // Orders `weights` as the snapshot, checking that they match it.
  Status MatchWeights(const std::vector<TensorView>& weights,
                      std::vector<const TensorView*>* ordered) const;
  Result<std::vector<DeltaTensor>> WriteDelta(const std::vector<const TensorView*>& weights,
                                              int64_t version, const std::string& dir,
                                              PublishResult* result);
  // With `changed_elements`, also counts the elements that differ from the
  // snapshot, in the pass that computes the digests.
  // `strong_checksums` are filled when options.checksum is weak.
  Status WriteFull(const std::vector<const TensorView*>& weights, int64_t version,
                   const std::string& dir, std::vector<std::string>* checksums,
                   std::vector<std::string>* strong_checksums, uint64_t* changed_elements);
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
  const PublisherOptions& opt = options;
  const bool weak = IsWeakChecksum(opt.checksum);
  // The base's digests in the record's algorithm come from the hashers the
  // pass runs anyway, unless the record is in a third algorithm.
  const std::optional<ChecksumAlgo> check_algo =
      base_record ? base_record->algo : std::optional<ChecksumAlgo>();
  const bool check_apart =
      check_algo && *check_algo != opt.checksum && !(weak && *check_algo == kStrongChecksum);
  // The record's algorithm, when there is a record.
  const ChecksumAlgo record_algo = check_algo.value_or(opt.checksum);

  // Which digests each tensor's pass computes. Of the base: in the
  // publisher's algorithm unless the snapshot's is known, the strong one
  // beside a weak one unless known, and the record's when it is a third
  // algorithm. Of the new bytes: the publisher's and, beside a weak one,
  // the strong one.
  struct Planned {
    bool base = false;
    bool strong_base = false;
    bool checked = false;  // the base record lists the tensor
    bool check = false;    // ... in an algorithm of its own
  };
  std::vector<Planned> planned(n);
  std::vector<pipeline::ProduceTensor> inputs(n);
  for (size_t i = 0; i < n; ++i) {
    SnapshotTensor& snap = tensors[i];
    Planned& p = planned[i];
    p.base = !snap.checksum;
    p.strong_base = weak && !snap.strong_checksum;
    p.checked = check_algo && base_record->Lists(snap.name);
    p.check = p.checked && check_apart;
    pipeline::ProduceTensor& in = inputs[i];
    in.name = snap.name;
    in.new_bytes = weights[i]->bytes;
    in.snapshot = snap.bytes();
    in.elem_size = static_cast<uint32_t>(DTypeSize(snap.dtype));
    if (p.base) in.base_digests.Add(opt.checksum);
    if (p.strong_base) in.base_digests.Add(kStrongChecksum);
    if (p.check) in.base_digests.Add(record_algo);
    in.new_digests.Add(opt.checksum);
    if (weak) in.new_digests.Add(kStrongChecksum);
  }

  pipeline::ProducerOptions produce;
  produce.encoding = opt.encoding;
  produce.encode = opt.encode;
  produce.pool = pool;
  // A borrowed snapshot is the caller's base, only read (and, a file
  // mapping, not hot).
  produce.refresh = !borrowed;
  produce.undo_budget_bytes = opt.undo_budget_bytes;
  produce.prefault_snapshot = borrowed;
  pipeline::Producer producer(produce);
  SlotFiles slots(dir, opt.max_shard_bytes);
  std::vector<pipeline::TensorDelta> produced;
  FirstError error;
  error.Note(producer.Run(inputs, &slots, &produced));

  std::vector<DeltaTensor> delta(n);
  for (size_t i = 0; i < n; ++i) {
    pipeline::TensorDelta& pd = produced[i];
    DeltaTensor& d = delta[i];
    const Planned& p = planned[i];
    const SnapshotTensor& snap = tensors[i];
    d.changed = pd.changed;
    d.changed_elements = pd.changed_elements;
    d.refreshed = pd.refreshed;
    d.undo = std::move(pd.undo);
    if (!pd.diffed) continue;
    size_t k = 0;
    d.base_checksum = p.base ? std::move(pd.base_digests[k++]) : *snap.checksum;
    d.checksum = std::move(pd.new_digests[0]);
    if (weak) {
      d.strong_base_checksum =
          p.strong_base ? std::move(pd.base_digests[k++]) : *snap.strong_checksum;
      d.strong_checksum = std::move(pd.new_digests[1]);
    }
    if (p.checked) {
      d.check_digest = p.check                       ? std::move(pd.base_digests[k])
                       : record_algo == opt.checksum ? d.base_checksum
                                                     : d.strong_base_checksum;
    }
  }
  std::vector<std::unique_ptr<SlotPart>>& parts = slots.parts();

  // Shards, under temporary names (their final names carry the shard count),
  // in the order of their first tensors; each data file is copied after its
  // header and removed.
  if (!error.failed()) {  // on failure a part may hold no tensor
    std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) {
      return a->tensors.front().first < b->tensors.front().first;
    });
  }
  struct WrittenShard {
    std::string temp_name;
    std::vector<std::string> tensors;
  };
  // Shards are assembled side by side: each one's copy and sync are its own.
  std::vector<WrittenShard> shards(error.failed() ? 0 : parts.size());
  pool->ParallelFor(shards.size(), [&](size_t k) {
    if (error.failed()) return;
    SlotPart* part = parts[k].get();
    WrittenShard& shard = shards[k];
    shard.temp_name = "part-" + std::to_string(k + 1) + ".safetensors";
    std::vector<TensorSpec> specs;
    std::map<std::string, std::string> metadata;
    for (const auto& [i, bytes] : part->tensors) {
      specs.push_back({tensors[i].name, DType::kU8, {static_cast<int64_t>(bytes)}});
      metadata[tensors[i].name] = delta[i].checksum;
      shard.tensors.push_back(tensors[i].name);
    }
    Result<std::unique_ptr<SafetensorsWriter>> writer =
        SafetensorsWriter::Create(JoinPath(dir, shard.temp_name), std::move(specs), metadata);
    Status s = writer.status();
    if (s.ok() && part->fd < 0) {
      part->fd = ::open(part->data_path.c_str(), O_RDONLY | O_CLOEXEC);
      if (part->fd < 0) s = Status::FromErrno(errno, part->data_path + ": open");
    }
    std::vector<uint8_t> copy_buffer(std::min<uint64_t>(part->size, kShardCopyBytes));
    for (uint64_t at = 0; s.ok() && at < part->size; at += copy_buffer.size()) {
      const auto n_bytes =
          static_cast<size_t>(std::min<uint64_t>(copy_buffer.size(), part->size - at));
      s = io::ReadAllAt(part->fd, copy_buffer.data(), n_bytes, at, part->data_path);
      if (s.ok()) s = (*writer)->Append({copy_buffer.data(), n_bytes});
    }
    if (s.ok()) s = (*writer)->Finish();
    if (s.ok()) s = io::RemoveFileIfExists(part->data_path);
    error.Note(std::move(s));
  });
  for (size_t i = 0; i < n; ++i) {
    if (!delta[i].changed) continue;
    result->tensors_changed++;
    result->changed_elements += delta[i].changed_elements;
  }
  if (error.failed()) {
    RestoreSnapshot(&delta);
    return error.status();
  }

  // Final shard names, the index, the sidecar.
  CheckpointIndex index;
  index.metadata["version"] = FormatVersion(version);
  index.metadata["base_version"] = FormatVersion(version - 1);
  index.metadata["delta_encoding"] = std::string(EncodingName(opt.encoding));
  index.metadata["compression_format"] = std::string(GetEncodingInfo(opt.encoding).compression);
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
  if (weak) manifest.strong = kStrongChecksum;
  // Every tensor's new digest, which the pass computed anyway: the next
  // publish checks its base against them.
  manifest.state.emplace();
  for (size_t i = 0; i < n; ++i) {
    manifest.state->emplace(tensors[i].name, delta[i].checksum);
    if (weak) manifest.strong_state.emplace(tensors[i].name, delta[i].strong_checksum);
    if (!delta[i].changed) continue;
    ManifestTensor& t = manifest.tensors[tensors[i].name];
    t.dtype = tensors[i].dtype;
    t.shape = tensors[i].shape;
    t.checksum = delta[i].checksum;
    t.base_checksum = delta[i].base_checksum;
    t.changed = delta[i].changed_elements;
    t.strong_checksum = delta[i].strong_checksum;
    t.strong_base_checksum = delta[i].strong_base_checksum;
  }
  if (status.ok()) {
    Result<std::string> index_text = SerializeCheckpointIndex(index);
    status = index_text.ok() ? io::WriteFileAtomically(JoinPath(dir, kIndexFileName), *index_text)
                             : index_text.status();
  }
  if (status.ok()) {
    status = io::WriteFileAtomically(JoinPath(dir, kVersionManifestFileName),
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
    if (d.refreshed && d.undo.count() > 0) pipeline::UndoRefresh(d.undo, tensors[i].bytes());
    d.refreshed = false;
    // The snapshot holds the base again; its digests, when the diff
    // computed them, save the next publish a pass.
    if (!d.base_checksum.empty()) tensors[i].checksum = d.base_checksum;
    if (!d.strong_base_checksum.empty()) tensors[i].strong_checksum = d.strong_base_checksum;
  });
}

Status Publisher::State::WriteFull(const std::vector<const TensorView*>& weights, int64_t version,
                                   const std::string& dir, std::vector<std::string>* checksums,
                                   std::vector<std::string>* strong_checksums,
                                   uint64_t* changed_elements) {
  const bool weak = IsWeakChecksum(options.checksum);
  checksums->assign(weights.size(), std::string());
  strong_checksums->assign(weak ? weights.size() : 0, std::string());
  std::atomic<uint64_t> changed{0};
  pool->ParallelFor(weights.size(), [&](size_t i) {
    const std::span<const uint8_t> bytes = weights[i]->bytes;
    if (changed_elements == nullptr && !weak) {
      (*checksums)[i] = ChecksumHex(options.checksum, bytes);
      return;
    }
    // Hashed (and counted) piece by piece while each piece of the new bytes
    // is in cache.
    const SnapshotTensor& snap = tensors[i];
    const auto elem_size = static_cast<uint32_t>(DTypeSize(snap.dtype));
    const size_t chunk = pipeline::ChunkNumel(pipeline::kFusedChunkBytes, elem_size) * elem_size;
    std::unique_ptr<Hasher> hasher = NewHasher(options.checksum);
    std::unique_ptr<Hasher> strong = weak ? NewHasher(kStrongChecksum) : nullptr;
    uint64_t count = 0;
    for (size_t offset = 0; offset < bytes.size(); offset += chunk) {
      const size_t length = std::min(chunk, bytes.size() - offset);
      hasher->Update(bytes.subspan(offset, length));
      if (strong) strong->Update(bytes.subspan(offset, length));
      if (changed_elements == nullptr) continue;
      Result<uint64_t> n =
          CountChanged(bytes.subspan(offset, length),
                       std::span<const uint8_t>(snap.data + offset, length), elem_size);
      if (n.ok()) count += *n;
    }
    (*checksums)[i] = hasher->HexDigest();
    if (strong) (*strong_checksums)[i] = strong->HexDigest();
    changed.fetch_add(count, std::memory_order_relaxed);
  });
  if (changed_elements != nullptr) *changed_elements = changed.load();
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
  if (weak) manifest.strong = kStrongChecksum;
  for (size_t i = 0; i < weights.size(); ++i) {
    ManifestTensor& t = manifest.tensors[tensors[i].name];
    t.dtype = tensors[i].dtype;
    t.shape = tensors[i].shape;
    t.checksum = (*checksums)[i];
    if (weak) t.strong_checksum = (*strong_checksums)[i];
  }
  return io::WriteFileAtomically(JoinPath(dir, kVersionManifestFileName),
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
  DS_RETURN_IF_ERROR(io::CreateDirectories(options.store));
  DS_ASSIGN_OR_RETURN(std::vector<int64_t> versions, ListVersionNumbers(options.store));
  // The base must be what the newest version holds: a delta made against
  // anything else applies nowhere.
  std::optional<BaseRecord> record;
  if (!versions.empty()) {
    DS_ASSIGN_OR_RETURN(record, ReadBaseRecord(options.store, versions.back()));
  }
  state->latest = versions.empty() ? 0 : versions.back();
  if (borrow) {
    state->base_record = std::move(record);
    return state;
  }
  // Copied and, when checked, hashed a piece at a time while it is in
  // cache; a digest in the algorithm the publisher uses saves the first
  // publish its base pass.
  const std::optional<ChecksumAlgo> check_algo = record ? record->algo : std::nullopt;
  std::vector<std::string> digests(base.size());
  state->pool->ParallelFor(base.size(), [&](size_t i) {
    SnapshotTensor& s = state->tensors[i];
    const std::span<const uint8_t> from = base[i].bytes;
    if (!check_algo || !record->Lists(s.name)) {
      if (!from.empty()) std::memcpy(s.data, from.data(), from.size());
      return;
    }
    std::unique_ptr<Hasher> hasher = NewHasher(*check_algo);
    for (size_t offset = 0; offset < from.size(); offset += pipeline::kFusedChunkBytes) {
      const size_t length = std::min(pipeline::kFusedChunkBytes, from.size() - offset);
      std::memcpy(s.data + offset, from.data() + offset, length);
      hasher->Update({s.data + offset, length});
    }
    digests[i] = hasher->HexDigest();
    if (*check_algo == options.checksum) {
      s.checksum = digests[i];
    } else if (IsWeakChecksum(options.checksum) && *check_algo == kStrongChecksum) {
      s.strong_checksum = digests[i];
    }
  });
  if (record) DS_RETURN_IF_ERROR(CheckBase(*record, state->tensors, digests));
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
  if (io::PathExists(final_dir)) {
    return Status::AlreadyExists(final_dir + ": already exists; refusing to overwrite a version");
  }
  static std::atomic<uint64_t> counter{0};
  const std::string temp_dir =
      JoinPath(store, ".tmp-" + VersionDirName(version) + "-" + std::to_string(::getpid()) + "-" +
                          std::to_string(counter.fetch_add(1)));
  (void)io::RemoveTree(temp_dir);
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
  std::vector<std::string> full_checksums, full_strong_checksums;
  if (full) {
    // A borrowed snapshot is never refreshed, so only this pass can count
    // the changes; an owned one counts them in its refresh below. A full
    // version does not depend on the base, which is therefore not checked.
    DS_RETURN_IF_ERROR(st.WriteFull(ordered, version, temp_dir, &full_checksums,
                                    &full_strong_checksums,
                                    st.borrowed ? &result.changed_elements : nullptr));
    result.tensors_changed = st.tensors.size();
  } else {
    DS_ASSIGN_OR_RETURN(delta, st.WriteDelta(ordered, version, temp_dir, &result));
    if (st.base_record) {
      std::vector<std::string> digests(delta.size());
      for (size_t i = 0; i < delta.size(); ++i) digests[i] = std::move(delta[i].check_digest);
      if (Status s = CheckBase(*st.base_record, st.tensors, digests); !s.ok()) {
        st.RestoreSnapshot(&delta);
        return s;
      }
    }
  }
  // From here on a failure must put the snapshot back.
  Status status = io::SyncDirectory(temp_dir);
  if (status.ok() && !st.options.post_write_hook.empty()) {
    status = io::RunHook(st.options.post_write_hook, {temp_dir, final_dir, FormatVersion(version)},
                         "post-write hook");
  }
  if (status.ok()) {
    CrashPoint("publish:before-rename");
    status = io::RenameNoReplace(temp_dir, final_dir);
  }
  if (!status.ok()) {
    st.RestoreSnapshot(&delta);
    return status.WithContext("publishing " + VersionDirName(version));
  }
  guard.Release();
  // The version is visible; a failed directory sync leaves it visible but
  // maybe not durable, which the caller must hear about, yet the snapshot
  // must follow what readers can now see.
  Status sync_status = io::SyncDirectory(store);
  st.latest = version;

  // Advance the snapshot.
  if (st.borrowed) {
    // Nothing to advance: the snapshot is the caller's base.
  } else if (full) {
    std::atomic<uint64_t> changed{0};
    core_internal::FreeList<ChangeSet> pieces;
    st.pool->ParallelFor(st.tensors.size(), [&](size_t i) {
      SnapshotTensor& s = st.tensors[i];
      const auto elem_size = static_cast<uint32_t>(DTypeSize(s.dtype));
      std::unique_ptr<ChangeSet> piece = pieces.Take();
      Result<uint64_t> n =
          pipeline::RefreshInChunks(ordered[i]->bytes, s.bytes(), elem_size, piece.get());
      if (n.ok()) {
        changed.fetch_add(*n, std::memory_order_relaxed);
      } else {
        if (s.size > 0) std::memcpy(s.data, ordered[i]->bytes.data(), s.size);
      }
      s.checksum = full_checksums[i];
      if (!full_strong_checksums.empty()) s.strong_checksum = full_strong_checksums[i];
      pieces.Give(std::move(piece));
    });
    result.changed_elements = changed.load();
  } else {
    st.pool->ParallelFor(st.tensors.size(), [&](size_t i) {
      SnapshotTensor& s = st.tensors[i];
      DeltaTensor& d = delta[i];
      if (d.changed && !d.refreshed && s.size > 0) {
        std::memcpy(s.data, ordered[i]->bytes.data(), s.size);
      }
      // The diff pass hashed every tensor's new bytes, which the snapshot
      // now holds: the next publish need not hash its base.
      s.checksum = d.checksum;
      if (!d.strong_checksum.empty()) s.strong_checksum = d.strong_checksum;
      d.undo = ChangeSet();
    });
  }

  DS_ASSIGN_OR_RETURN(result.info, ReadVersionInfo(final_dir));
  result.bytes_written = io::DirectoryBytes(final_dir);
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
  Result<PublishResult> result = PublishOnce(options, base_views, new_views, full);
  // The two checkpoints' mappings (read-only, of files) are torn down on
  // the pool instead of one page at a time as they close.
  ThreadPool* pool = options.pool ? options.pool : &ThreadPool::Default();
  for (const Checkpoint* c : {base.get(), next.get()}) {
    for (const auto& file : c->files()) io::DropMappedPages(file->data(), pool);
  }
  return result;
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
      DS_RETURN_IF_ERROR(io::RenameNoReplace(versions[i].dir, trash));
      DS_RETURN_IF_ERROR(io::RemoveTree(trash));
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
    if (stale) (void)io::RemoveTree(entry.path().string());
  }
  if (!removed.empty()) DS_RETURN_IF_ERROR(io::SyncDirectory(store));
  return removed;
}

}  // namespace deltasync
