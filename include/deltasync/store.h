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
//   is a full version. Our extensions (each changed tensor's base checksum,
//   dtype and shape, every tensor's digest at the version, strong digests
//   beside adler32) live in a sidecar, <version>/deltasync.json, which the
//   Python receiver never opens.
//   <local>/.weight_sync/lock        flock, serializes every process on a host
//   <local>/.weight_sync/state.json  {"version": "000007", ...}
//   <local>/.weight_sync/journal     redo/undo journal of an apply in flight
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/dtype.h"
#include "deltasync/status.h"
#include "deltasync/tensor.h"
#include "deltasync/thread_pool.h"

namespace deltasync {

// ---------------------------------------------------------------------------
// Version directories

// Name of the sidecar file a version dir may hold (our extensions).
inline constexpr const char* kVersionManifestFileName = "deltasync.json";

// "weight_v000007" for 7. `version` must be >= 0.
std::string VersionDirName(int64_t version);
// Inverse of VersionDirName: "weight_v" then 6 or more decimal digits (the
// Python writer's {N:06d} grows past 6 digits). InvalidArgument else.
Result<int64_t> ParseVersionDirName(std::string_view name);
// "000007" for 7: how versions are written inside metadata and state files.
std::string FormatVersion(int64_t version);
// Inverse of FormatVersion: 6 or more decimal digits, at most 18. InvalidArgument else.
Result<int64_t> ParseVersion(std::string_view text);

// What a version directory declares about itself (its index and sidecar;
// the tensor data is not read).
struct VersionInfo {
  int64_t version = 0;
  std::string dir;  // the path it was read from
  bool is_delta = false;
  // Delta versions only:
  int64_t base_version = -1;
  Encoding encoding = Encoding::kXor;
  std::string compression = "zstd";  // "zstd", or "none" for dense / indices
  ChecksumAlgo checksum = ChecksumAlgo::kXxh3_128;
  bool has_manifest = false;  // deltasync.json present
  uint64_t tensors = 0;       // tensors the version holds (changed ones for a delta)
  uint64_t bytes = 0;         // sizes of the files in the directory
};

// Reads and validates a version directory's index and sidecar. NotFound
// when the dir is missing; Corruption for a malformed index, metadata or
// sidecar (a non-string delta_encoding, a delta without a string "version",
// missing or non-numeric base_version, a "version" that disagrees with the
// directory name, a weight_map file name that is not a plain name);
// Unsupported for an unknown delta_encoding, compression_format or
// checksum_format. A dir with neither an index nor model.safetensors is
// Corruption. The version number comes from the dir name when it is a
// version dir name, else from the index's "version" (InvalidArgument when
// neither gives one).
Result<VersionInfo> ReadVersionInfo(const std::string& version_dir);

// Version numbers of every version dir in `store`, ascending, reading only
// the directory listing. Entries that are not version dirs (temp dirs of a
// publish in progress, trash of a prune) are ignored. NotFound for a store
// that does not exist (an empty one has no versions). A directory with no
// version dir is a store (an empty one) only when all it holds is what a
// store may hold besides versions: hidden entries (".tmp-*" of a publish,
// ".trash-*" of a prune, a file system's own such as ".nfs*"), entries
// named "weight_v..." (a version's temporaries, whoever writes them) and
// "lost+found" (a store at a file system's root). Anything else there (a
// checkpoint, a synth chain: a mistyped store) is InvalidArgument naming
// the directory and one such entry; a store with versions may hold anything
// else beside them.
Result<std::vector<int64_t>> ListVersionNumbers(const std::string& store);

// ReadVersionInfo of every version dir in `store`, ascending. Fails on the
// first malformed version (naming it).
Result<std::vector<VersionInfo>> ListVersions(const std::string& store);

// One tensor as a version's sidecar describes it.
struct ManifestTensor {
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::string checksum;       // hex digest of the new bytes
  std::string base_checksum;  // delta only: hex digest of the bytes it applies to
  uint64_t changed = 0;       // delta only: changed elements
  // With VersionManifest::strong: checksum and base_checksum again, in the
  // strong algorithm.
  std::string strong_checksum;
  std::string strong_base_checksum;  // delta only
};

// The sidecar deltasync.json (docs/format.md, "Delta store").
struct VersionManifest {
  int64_t version = 0;
  bool is_delta = false;
  int64_t base_version = -1;  // delta only
  ChecksumAlgo checksum = ChecksumAlgo::kXxh3_128;
  // Delta: the changed tensors. Full: every tensor.
  std::map<std::string, ManifestTensor> tensors;
  // Every tensor's digest (`checksum`) at this version, name -> hex: what a
  // publish on top of this version checks its base against. A full
  // version's come from `tensors`; a delta's sidecar records them apart.
  // nullopt for a delta whose sidecar predates that record (it describes
  // only the changed tensors).
  std::optional<std::map<std::string, std::string>> state;
  // Set when `checksum` can be matched on purpose (adler32): the algorithm
  // (xxh3-128) of the strong digests recorded beside the peer-readable ones,
  // in each tensor's strong_* fields and, for every tensor, in strong_state
  // (present exactly when `state` is).
  std::optional<ChecksumAlgo> strong;
  std::map<std::string, std::string> strong_state;
};

// The sidecar of `version_dir`, or nullopt when it has none (versions
// written by the Python publisher). Corruption when it is malformed.
Result<std::optional<VersionManifest>> ReadVersionManifest(const std::string& version_dir);

// ---------------------------------------------------------------------------
// Publisher (trainer side)

struct PublisherOptions {
  std::string store;  // created if missing
  // kSparse is ours and the smallest; kXor / kOverwrite for hosts running
  // the Python receiver. kDense and kIndices are accepted too.
  Encoding encoding = Encoding::kSparse;
  ChecksumAlgo checksum = ChecksumAlgo::kXxh3_128;
  EncodeOptions encode;  // zstd level, frame checksums, sparse mode
  // Every K-th version (N % K == 0) is published full; 0 = only on request.
  int64_t full_every = 0;
  // Delta versions: most encoded bytes per shard file (a single larger
  // tensor gets a shard of its own). Each worker task appends the encodings
  // of the tensors it finishes to a file of its own, so a version has a
  // shard per task that found changes, and the encoded delta is never held
  // in memory beyond the tensors in flight, whatever this limit.
  uint64_t max_shard_bytes = 1ull << 30;
  // Full versions: most tensor bytes per shard (HF's default, 5 GB). Full
  // versions stream from the caller's tensors and hold nothing.
  uint64_t full_max_shard_bytes = 5'000'000'000ull;
  // Executable run as `hook <temp_dir> <final_dir> <version>` once the
  // version's files are complete and synced in the temp dir, before the
  // rename makes it visible. A non-zero exit (or failure to run it) fails
  // the publish: the temp dir is removed, nothing is published and the
  // snapshot is unchanged.
  std::string post_write_hook;
  // The snapshot is refreshed during the diff; until the version is durable
  // the old values of refreshed elements are kept (an undo log) so that a
  // failed publish restores the snapshot. Past this many bytes of undo log,
  // later tensors are diffed without refresh and refreshed after the
  // rename instead (a second pass over those tensors), keeping memory bounded.
  uint64_t undo_budget_bytes = 1ull << 30;
  ThreadPool* pool = nullptr;  // nullptr = ThreadPool::Default()
};

struct PublishResult {
  VersionInfo info;
  uint64_t tensors = 0;          // in the model
  uint64_t tensors_changed = 0;  // present in a delta version (all for full)
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  uint64_t bytes_written = 0;  // of all files in the version dir
  double seconds = 0;
};

// Keeps a snapshot of what receivers hold and publishes version N = latest+1
// as a delta against N-1, or as a full version. Atomic: a version is written
// into a temp dir inside the store, fsynced, then renamed into place; the
// snapshot advances only after that (a failed publish leaves it as it was).
// Not thread-safe: one publisher per store.
class Publisher {
 public:
  // `base` is what receivers hold now: the engine's base checkpoint (version
  // 0) when the store is empty, else the newest version's weights. Copied
  // into the publisher's snapshot, and checked as it is copied against what
  // the newest version records (docs/format.md, "Publishing": every tensor's
  // digest for versions we publish, less for others). InvalidArgument for
  // invalid or repeated tensors, bad options, or an encoding that cannot be
  // published; FailedPrecondition naming the first tensor (by name) where
  // the base differs from the newest version, or naming the newest version
  // when it is empty or incomplete (no index, a shard missing).
  static Result<std::unique_ptr<Publisher>> Create(const PublisherOptions& options,
                                                   const std::vector<TensorView>& base);
  // Create with every tensor of the checkpoint (dir or .safetensors file) at
  // `base_path`, in name order.
  static Result<std::unique_ptr<Publisher>> CreateFromCheckpoint(const PublisherOptions& options,
                                                                 const std::string& base_path);
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Publishes `weights` (exactly the snapshot's names, dtypes and shapes, in
  // any order) as the next version. `full` forces a full version.
  // InvalidArgument when the tensors do not match the snapshot;
  // FailedPrecondition when the store already holds a version past
  // latest_version() (another publisher); AlreadyExists when the target dir
  // appeared meanwhile; Aborted when the post-write hook fails; IOError
  // from the file system. On any error nothing is published and the snapshot
  // is unchanged.
  Result<PublishResult> Publish(const std::vector<TensorView>& weights, bool full = false);
  // Publish with the tensors of the checkpoint at `path`.
  Result<PublishResult> PublishCheckpoint(const std::string& path, bool full = false);

  // The version the snapshot holds: the newest published one.
  int64_t latest_version() const;
  // The snapshot, in the base's order. Views stay valid until the next
  // Publish or the publisher's destruction.
  std::vector<TensorView> snapshot() const;

 private:
  friend Result<PublishResult> PublishOnce(const PublisherOptions&, const std::vector<TensorView>&,
                                           const std::vector<TensorView>&, bool);
  struct State;
  explicit Publisher(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Publishes `weights` as the next version against `base` (what receivers
// hold: the store's newest version, or the engine's base when the store is
// empty), in one shot: no snapshot is kept, so `base` is read in place
// instead of being copied (the publish costs no memory in proportion to the
// model beyond the tensors in flight). Same files, checks and errors as
// Publisher::Create then Publisher::Publish, except that the base of a full
// version is not checked against the newest version (a full version does not
// depend on it); a delta's base is checked by the diff pass, before anything
// becomes visible. full_every applies to the version number. For tools that
// publish one version per run (the CLI's `publish --old --new`).
Result<PublishResult> PublishOnce(const PublisherOptions& options,
                                  const std::vector<TensorView>& base,
                                  const std::vector<TensorView>& weights, bool full = false);
// PublishOnce with the checkpoints (dirs or .safetensors files) at
// `base_path` and `new_path`, both mapped read-only.
Result<PublishResult> PublishCheckpointOnce(const PublisherOptions& options,
                                            const std::string& base_path,
                                            const std::string& new_path, bool full = false);

// Deletes old versions, keeping the newest `keep` (>= 1) and every version
// from the newest full version on, so that the chain stays replayable from
// it; with no full version every delta is needed to replay from the base
// and nothing is deleted. Also removes temp dirs of publishes that can no
// longer complete (their version exists) and leftovers of earlier prunes.
// A version is first renamed out of the listing, then deleted, so readers
// never see a half-deleted version. Returns the versions removed, ascending.
Result<std::vector<int64_t>> PruneStore(const std::string& store, int64_t keep);

// ---------------------------------------------------------------------------
// LocalCheckpoint (rollout side)

struct LocalCheckpointOptions {
  // Host-local full checkpoint dir, created by the first pull. It must be a
  // directory of its own: neither the base nor the store, nor inside or
  // around either of them.
  std::string local;
  // The store. A pull from a store that does not exist fails (NotFound);
  // empty only when nothing but the base is ever pulled.
  std::string store;
  // The engine's base checkpoint dir (version 0); needed only when a pull
  // has to start from the base (Verify, CurrentVersion need none). Before
  // copying it, a pull checks it against what the store's version 1 records
  // about its base, when it records that (our sidecar), and refuses a base
  // that differs, changing nothing. A pull that does not copy it still
  // checks it when given, even with nothing to pull: it must be the base
  // the checkpoint was last reset to (recorded under .weight_sync), or one
  // the store's version 1 vouches for (a copy of it), else FailedPrecondition
  // before anything changes. A full version must have the base's tensor
  // names, dtypes and shapes before it replaces anything.
  std::string base;
  // A pull that has to reset a local checkpoint with no state.json (one
  // that no receiver made, such as a trainer's checkpoint) but holding
  // weights files refuses to replace them unless this is set. When no
  // receiver has been there at all (no .weight_sync), the refusal creates
  // nothing in `local`.
  bool replace_unknown_checkpoint = false;
  // Executable run as `hook <store> <target>` (target: 6-digit version or
  // "latest") at the start of every Pull, before the store is listed; e.g.
  // to refresh an object-store mount's view. A non-zero exit fails the pull.
  std::string pre_read_hook;
  // Sync the journal and the applied data to disk before committing each
  // version, so that a committed version survives power loss: the whole
  // version is journaled (old and new values) and synced before the
  // checkpoint is touched, then applied. Without it a commit survives a
  // crash of the process (kill -9) but not of the machine; after a reboot
  // the checkpoint is then verified against the recorded checksums, and
  // reseeded when it does not match. Such a pull reads the checkpoint once:
  // each journal record (old values only) is applied as soon as it is
  // written, and an interrupted apply is rolled back, then applied again.
  bool durable = false;
  // Recover a pending apply (replay or roll back its journal) in Open.
  // Otherwise the next Pull does it.
  bool recover_on_open = true;
  ThreadPool* pool = nullptr;  // nullptr = ThreadPool::Default()
  // Most changes in one journal record. A larger tensor's changes are
  // journaled as several records, so a pull's memory is a few such records
  // per thread whatever the model's size (128 Ki changes of a BF16 tensor
  // are 1 MiB). A pull without `durable` uses at most 16 Ki.
  uint64_t journal_record_changes = uint64_t{128} << 10;
};

struct PullResult {
  std::optional<int64_t> from_version;    // nullopt: nothing was materialized
  int64_t version = 0;                    // now applied and verified
  bool applied = false;                   // false when already at the target
  std::optional<int64_t> reset_to;        // a full version (or 0: the base) copied in
  std::vector<int64_t> versions_applied;  // deltas, in order
  // An interrupted apply was replayed or rolled back first (by this pull or
  // by the Open before it).
  bool recovered = false;
  bool reseeded = false;  // local state could not be trusted and was rebuilt
  double seconds = 0;
  uint64_t bytes_read = 0;  // of version files (deltas) or copied (full/base)
  uint64_t tensors_changed = 0;
  uint64_t changed_elements = 0;
};

// A host-local full checkpoint kept at a version of a store. Every method
// takes the host lock (<local>/.weight_sync/lock, flock), so processes on a
// host (ours or the Python receiver) never interleave.
class LocalCheckpoint {
 public:
  // With recover_on_open, finishes or rolls back an interrupted apply;
  // otherwise writes nothing (nor does CurrentVersion or Verify: only Pull
  // creates <local>/.weight_sync). InvalidArgument for an empty `local`,
  // or one that is, lies inside or holds the base or the store (compared by
  // device and inode, so symlinks and bind mounts count), or for a store
  // directory that is not a store (ListVersionNumbers).
  static Result<std::unique_ptr<LocalCheckpoint>> Open(const LocalCheckpointOptions& options);
  ~LocalCheckpoint();
  LocalCheckpoint(const LocalCheckpoint&) = delete;
  LocalCheckpoint& operator=(const LocalCheckpoint&) = delete;

  // Brings the local checkpoint to `target` (nullopt = the store's latest,
  // 0 with an empty store; 0 = the base). When the newest full version at or
  // below the target (the base counts as version 0) is newer than the
  // applied version, or nothing is applied, or the target is older than the
  // applied version, the local checkpoint is first reset to it by copy;
  // then every delta up to the target is applied in order and each changed
  // tensor verified. Each version is decoded and validated completely before
  // the checkpoint is touched, and committed on its own.
  // A local checkpoint at version 0 copied from another base than
  // options.base is copied again from options.base. Leftovers of a killed
  // writer (a reset's partial copies, state temporaries) are removed first.
  // Errors (the local checkpoint is left at the last committed version):
  // NotFound for a missing store, version dir or target; InvalidArgument
  // for a directory that is not a store; FailedPrecondition for a base the
  // store's records or the checkpoint's record refuse (see
  // LocalCheckpointOptions::base), a local checkpoint that no
  // receiver made (see replace_unknown_checkpoint), a
  // version whose base_version breaks the chain, or whose base checksums
  // show the local tensor is not its base; Corruption for bad files, frames,
  // positions or a checksum mismatch after apply (rolled back);
  // Unsupported for an unknown encoding, compression or checksum; Aborted
  // when the pre-read hook fails.
  // Crash-safe: a pull killed at any instant leaves the checkpoint at the
  // old version or recoverable to the new one by the next Pull.
  Result<PullResult> Pull(std::optional<int64_t> target);

  // The committed version, or nullopt when none is (never materialized,
  // mid-apply or mid-reset, or `local` does not exist). Takes a shared lock
  // and writes nothing.
  Result<std::optional<int64_t>> CurrentVersion();

  // Recomputes every tensor's checksum and compares it with what the applied
  // versions recorded; tensors no version has changed since the last reset
  // are compared byte for byte with the checkpoint they were copied from.
  // When state.json carries none of that (another receiver, such as the
  // Python one, committed last), the expected state is rebuilt from the
  // store: each tensor's digest from the newest delta <= the applied version
  // that changed it, else the newest full version, else the base (the
  // option, or the base path our last pull recorded).
  // Takes a shared lock and writes nothing. NotFound when `local` does not
  // exist; FailedPrecondition when nothing is committed (saying whether an
  // interrupted pull must be recovered by pulling) or a needed source is gone;
  // NotFound for a missing version in the chain; Corruption naming the first
  // mismatching tensor and the version that set its expected value.
  Status Verify();

  const std::string& local() const;

 private:
  struct State;
  explicit LocalCheckpoint(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace deltasync
