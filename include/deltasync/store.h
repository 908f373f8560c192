// The disk transport: a versioned delta store on a shared filesystem, the
// trainer-side Publisher that writes it, and the rollout-side
// LocalCheckpoint that brings a host-local full checkpoint to a version.
//
// On-disk layout (docs/format.md, "Delta store"), compatible with the
// vime/slime Python implementation in both directions:
//   <store>/weight_v000001/ ...   versions N = 1, 2, ...; version 0 is the
//                                 engine's own base checkpoint (elsewhere)
//   a version = a canonical HF checkpoint dir (shards + index). A delta
//   version's index metadata holds version, base_version, delta_encoding,
//   compression_format, checksum_format; each changed tensor is a 1-D U8
//   tensor holding the encoded change; each shard's __metadata__ maps tensor
//   name -> hex checksum of its new bytes. A version without delta_encoding
//   is a full version.
//   <local>/.weight_sync/lock        flock, serializes every process on a host
//   <local>/.weight_sync/state.json  {"version": "000007", ...}
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/status.h"
#include "deltasync/tensor.h"
#include "deltasync/thread_pool.h"

namespace deltasync {

// "weight_v000007" for 7.
std::string VersionDirName(int64_t version);
// Inverse of VersionDirName; InvalidArgument for anything else.
Result<int64_t> ParseVersionDirName(std::string_view name);
// "000007" for 7: how versions are written inside metadata and state files.
std::string FormatVersion(int64_t version);
// Inverse of FormatVersion: 6 or more decimal digits. InvalidArgument else.
Result<int64_t> ParseVersion(std::string_view text);

// What a version directory declares about itself.
struct VersionInfo {
  int64_t version = 0;
  std::string dir;  // absolute or store-relative path of the version dir
  bool is_delta = false;
  // Delta versions only:
  int64_t base_version = -1;
  Encoding encoding = Encoding::kXor;
  std::string compression = "zstd";
  ChecksumAlgo checksum = ChecksumAlgo::kXxh3_128;
};

// Reads and validates a version directory's index (not the tensor data).
// Corruption for a malformed index or metadata, Unsupported for an unknown
// encoding, compression or checksum, NotFound when the dir is missing.
Result<VersionInfo> ReadVersionInfo(const std::string& version_dir);

// Every version dir in `store`, ascending. Entries that are not version dirs
// (including in-progress temp dirs) are ignored.
Result<std::vector<VersionInfo>> ListVersions(const std::string& store);

// ---------------------------------------------------------------------------
// Publisher (trainer side)

struct PublisherOptions {
  std::string store;                       // created if missing
  Encoding encoding = Encoding::kSparse;   // kXor / kOverwrite for Python receivers
  ChecksumAlgo checksum = ChecksumAlgo::kXxh3_128;
  int64_t full_every = 0;                  // publish every K-th version full; 0 = never
  uint64_t max_shard_bytes = 2ull << 30;   // of encoded bytes per shard file
  // Executable called as `hook <version_dir>` after the version is durable
  // and before the snapshot advances; non-zero exit fails the publish.
  std::string post_write_hook;
  ThreadPool* pool = nullptr;  // nullptr = ThreadPool::Default()
};

struct PublishResult {
  VersionInfo info;
  uint64_t tensors = 0;          // in the model
  uint64_t tensors_changed = 0;  // present in the version
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  uint64_t bytes_written = 0;  // of all files in the version dir
  double seconds = 0;
};

// Keeps a snapshot of what receivers hold and publishes version N = latest+1
// as a delta against N-1, or as a full version. Atomic: a version is written
// into a temp dir, fsynced, then renamed into place; the snapshot advances
// only after that. Not thread-safe: one publisher per store.
class Publisher {
 public:
  // `base` is what receivers hold now: the engine's base checkpoint (version
  // 0) when the store is empty, else the newest version's weights. Copied
  // into the publisher's snapshot.
  static Result<std::unique_ptr<Publisher>> Create(const PublisherOptions& options,
                                                   const std::vector<TensorView>& base);
  ~Publisher();

  // Publishes `weights` (same names, dtypes and shapes as the snapshot) as the
  // next version. `full` forces a full version.
  Result<PublishResult> Publish(const std::vector<TensorView>& weights, bool full = false);

  int64_t latest_version() const;

 private:
  struct State;
  explicit Publisher(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Deletes old versions, keeping the newest `keep` and whatever is needed to
// replay the chain from the newest full version (or from the base, when
// there is no full version, in which case nothing is deleted that a replay
// from version 0 needs). Returns the versions removed.
Result<std::vector<int64_t>> PruneStore(const std::string& store, int64_t keep);

// ---------------------------------------------------------------------------
// LocalCheckpoint (rollout side)

struct LocalCheckpointOptions {
  std::string local;  // host-local full checkpoint dir, created on first pull
  std::string store;
  std::string base;   // the engine's base checkpoint (version 0)
  // Executable called as `hook <version_dir> <target_version>` before a
  // version dir is read; non-zero exit fails the pull.
  std::string pre_read_hook;
  bool durable = false;  // sync data before committing state
  ThreadPool* pool = nullptr;
};

struct PullResult {
  int64_t from_version = -1;  // -1: nothing was materialized before
  int64_t version = 0;        // now applied and verified
  bool applied = false;       // false when already at the target
  std::vector<int64_t> versions_applied;
  double seconds = 0;
  uint64_t bytes_read = 0;  // from the store
  uint64_t tensors_changed = 0;
};

class LocalCheckpoint {
 public:
  static Result<std::unique_ptr<LocalCheckpoint>> Open(const LocalCheckpointOptions& options);
  ~LocalCheckpoint();

  // Brings the local checkpoint to `target` (nullopt = the store's latest;
  // 0 = the base), under the host lock. Crash-safe: a pull killed at any
  // instant leaves the checkpoint at the old version or recoverable to the
  // new one by the next Pull.
  Result<PullResult> Pull(std::optional<int64_t> target);

  // The committed version, or nullopt when none is (never materialized, or
  // mid-apply). Takes the lock briefly.
  Result<std::optional<int64_t>> CurrentVersion();

  // Recomputes every tensor's checksum and compares it with what the
  // applied version recorded.
  Status Verify();

 private:
  struct State;
  explicit LocalCheckpoint(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace deltasync
