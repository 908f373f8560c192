// The stream's sender, shared by the whole-tensor sender (sync_sender.cc)
// and the sharded one (sharded_sender.cc): the state of a sync on rank 0,
// the frames of its receiver groups, and the commit protocol
// (include/deltasync/stream.h; docs/format.md, "Stream: commit protocol",
// "Stream: sharded sync").
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "core/raw_bytes.h"
#include "deltasync/diff.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "shard/shard_changes.h"
#include "shard/shard_layout.h"
#include "stream/cost_model.h"
#include "stream/device_path.h"
#include "stream/frame.h"
#include "stream/quantized_inputs.h"
#include "stream/state_digest.h"
#include "stream/sync_messages.h"

namespace deltasync::stream_sender {

using stream::DigestBlock;
using stream::Envelope;
using stream::FlushHeader;
using stream::FlushWriter;
using stream::FrameKind;
using stream::MessageType;
using stream::Positions;
using stream::Registration;
using stream::StateDigest;
using stream::TensorRange;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMinBucketBytes = uint64_t{64} << 10;
// Room a frame keeps for its header, manifest entry and trailer beside one
// unit's positions and values.
constexpr uint64_t kFrameReserve = 8192;
// A sync that sent at least this much measures the wire for the time model.
constexpr uint64_t kWireSampleBytes = uint64_t{8} << 20;
// Frame buckets kept from one sync to the next (one per kind of receiver).
constexpr size_t kSpareBuckets = 2;
// Elements a device tensor diffs per kernel call (about what its scratch
// holds: positions, new and old values of a whole chunk).
constexpr uint64_t kDeviceChunkElements = uint64_t{1} << 25;
// A sharded rank's unit of its local tensors: what a failed sync marks
// dirty and a commit copies (docs/format.md, "Stream: sharded sync").
constexpr uint64_t kLocalUnit = uint64_t{1} << 20;
// A sync's first host frame is at most this big, each next one twice the
// last, up to the bucket: the wire starts after the first unit of work,
// not after a whole bucket's diff (docs/format.md, "Stream: flush frame").
constexpr uint64_t kFirstFrameBytes = uint64_t{1} << 20;
// The diff's and the commit's pieces on the sender's threads.
constexpr uint64_t kParallelDiffBytes = uint64_t{128} << 10;
constexpr uint64_t kParallelCopyBytes = uint64_t{4} << 20;

// The options' checks, shared by both senders' factories.
Status CheckOptions(const SenderOptions& options);

// One copy of a commit: `bytes` from `from` to `to`.
struct Copy {
  uint8_t* to = nullptr;
  const uint8_t* from = nullptr;
  uint64_t bytes = 0;
};

// A host tensor's changed elements that the commit copies one by one
// instead of their whole unit: `n` positions from element `first`, as
// LEB128 gaps (the first from 0) at byte `at` of the sender's commit log.
struct LoggedRun {
  uint64_t first = 0;
  uint64_t n = 0;
  uint64_t at = 0;
};
// A unit's mark in TensorState::changed: copied whole at the commit, or
// only its logged elements.
inline constexpr uint8_t kUnitCopied = 1;
inline constexpr uint8_t kUnitLogged = 2;
// Appends `n` increasing positions as LEB128 gaps (the first from 0);
// the bytes written (at most 5 a position).
uint64_t LogPositions(const uint32_t* positions, uint64_t n, uint8_t* out);
// The bytes LogPositions writes for them.
uint64_t LoggedBytes(const uint32_t* positions, uint64_t n);
// Copies a run's elements of `w` bytes from the tensor's current values
// `x` into its snapshot; `log` is the commit log the run points into.
void CopyLogged(const LoggedRun& r, uint32_t w, const uint8_t* log, const uint8_t* x,
                uint8_t* snapshot);

using BlockKey = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t>;

inline BlockKey KeyOf(const DigestBlock& b) { return {b.first, b.count, b.rows, b.row_stride}; }
inline DigestBlock BlockOf(const BlockKey& k) {
  return {std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k)};
}

inline bool Covers(const DigestBlock& b, uint64_t numel) {
  return b.first == 0 && b.count == numel && b.rows == 1;
}

inline bool InBlock(const DigestBlock& b, uint64_t p) {
  if (p < b.first) return false;
  const uint64_t off = p - b.first;
  if (b.rows == 1) return off < b.count;
  const uint64_t row = off / b.row_stride;
  return row < b.rows && off % b.row_stride < b.count;
}

// "3 -> 5 -> 6": a chain of receivers that pass a sync's frames on.
inline std::string ChainName(const std::vector<int>& chain) {
  std::string name;
  for (size_t i = 0; i < chain.size(); ++i)
    name += (i > 0 ? " -> " : "") + std::to_string(chain[i]);
  return name;
}

// Sends a receiver a frame of its own (one message).
inline Status SendOwnFrame(Communicator& comm, int rank, bool last, std::span<const uint8_t> frame,
                           uint64_t* bytes_sent) {
  if (Status s = stream::SendMessage(comm, rank, MessageType::kFrame, last, frame); !s.ok()) {
    return Status(s.code(), "receiver " + std::to_string(rank) + ": " + s.message());
  }
  *bytes_sent += stream::kEnvelopeBytes + frame.size();
  return Status::OK();
}

// Sends a frame shared by a chain of receivers to the first of them
// (`head`), which passes it on (docs/format.md, "Fan-out"): one copy
// whatever their number.
inline Status SendSharedFrame(Communicator& comm, int head, std::span<const uint8_t> frame,
                              uint64_t* bytes_sent) {
  if (Status s = stream::SendShared(comm, head, frame); !s.ok()) {
    return Status(s.code(), "receiver " + std::to_string(head) + ": " + s.message());
  }
  *bytes_sent += stream::kEnvelopeBytes + frame.size();
  return Status::OK();
}

struct TensorState {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint32_t w = 1;
  uint64_t unit = 1;                 // elements per unit of work
  core_internal::RawBytes snapshot;  // the committed state (empty before it)
  // A device tensor's snapshot and diff (then `snapshot` stays empty).
  std::unique_ptr<stream::DeviceSource> device;
  std::vector<uint8_t> dirty;                 // per unit: changed by a failed sync
  std::vector<uint8_t> changed;               // per unit: changed by the current sync
  std::vector<LoggedRun> logged;              // the kUnitLogged units' elements
  std::map<BlockKey, StateDigest> committed;  // the snapshot's digest per held block
  std::map<BlockKey, StateDigest> expected;   // at the end of the current sync

  uint64_t units() const { return numel == 0 ? 0 : (numel + unit - 1) / unit; }
};

struct Peer {
  int rank = 0;
  bool need_seed = true;
  bool partial = false;                                    // holds some of the tensors on purpose
  std::map<std::string, DigestBlock, std::less<>> blocks;  // held tensors
  std::string layout;                                      // the held names, one key per set
};

// Where a tensor's changes and values come from, one unit of work at a
// time: `changes` fills the unit's changes against the snapshot (positions
// from the unit's first element, new and old values); `dense` gives the
// unit's current values (valid until the next call). `whole_digest`, when
// set, gives the unit's share of the whole tensor's digest (its change
// since the snapshot, or before one its digest) in place of computing it
// from the changes. `view`, when set, gives a unit's changes where they
// already lie in place of `changes` (UnitChanges).
struct UnitChanges;
struct UnitSource {
  std::function<Status(uint64_t first, uint64_t count, ChangeSet* out)> changes;
  std::function<Status(uint64_t first, uint64_t count, UnitChanges* out)> view;
  std::function<Result<std::span<const uint8_t>>(uint64_t first, uint64_t count)> dense;
  std::function<Result<StateDigest>(uint64_t first, uint64_t count, bool seed)> whole_digest;
  // Whether `dense` can give the unit's values, the unit having `changed`
  // changes; unset: always. A sharded rank 0 holds no copy of the model:
  // only a unit whose every element changed, or whose dense values were
  // gathered, can go dense.
  std::function<bool(uint64_t first, uint64_t count, uint64_t changed)> can_dense;
  // A host tensor and its committed snapshot (`host` set, from the second
  // sync on): its units are diffed a run at a time on the sender's threads
  // (StreamHostUnits) in place of `changes`.
  bool host = false;
  std::span<const uint8_t> host_current;
  std::span<uint8_t> host_snapshot;  // diffed only, never written
};

// A unit's changes in place: absolute positions, their new and old
// values, and, when the source has it, what they move a digest of every
// element of the tensor by (computed ahead, on the sender's threads).
struct UnitChanges {
  Positions pos;
  std::span<const uint8_t> new_values;
  std::span<const uint8_t> old_values;
  std::optional<StateDigest> digest_change;
};

// A unit's dense values, read at most once (valid until the next unit).
using DenseView = std::function<Result<std::span<const uint8_t>>()>;
// The DenseView of elements [first, first + count) of `src`, kept in *cache
// (which must outlive it) after the first read.
inline DenseView DenseOnce(const UnitSource& src, uint64_t first, uint64_t count,
                           std::optional<std::span<const uint8_t>>* cache) {
  return [&src, first, count, cache]() -> Result<std::span<const uint8_t>> {
    if (!*cache) {
      DS_ASSIGN_OR_RETURN(std::span<const uint8_t> v, src.dense(first, count));
      *cache = v;
    }
    return **cache;
  };
}

// One unit of work as the groups take it: its range, its changed elements
// (positions from `first`, new values; or on the device), and whether it
// is resent whole.
struct UnitOut {
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t n = 0;  // changed elements
  bool resend = false;
  Positions pos;
  std::span<const uint8_t> values;
  const stream::DeviceUnitChanges* device = nullptr;
  // Its sparse entry, compressed ahead on the sender's threads (else
  // compressed as the frame takes it).
  const stream::SparseRegions* sparse = nullptr;
};

// The host diff's pieces and how many of them run per pass: a window of
// kHostWindowBytes of a tensor is counted and its digests moved in one
// pass; its positions are then taken a bucket's worth at a time.
constexpr uint64_t kHostWindowBytes = uint64_t{64} << 20;

// A thread's diff output and scratch for the host diff's pieces, kept from
// tensor to tensor: made afresh for each of thousands of small tensors,
// their buffers would cost more than the tensors' diffs.
struct PieceScratch {
  ChangeSet changes;
  DiffScratch scratch;
};

// One tensor's part of a sync while its units stream (a sharded sync
// streams a large tensor over several batches): the change of each held
// block's digest so far, and the blocks whose digest is computed whole from
// the dense values instead (before any commit, or a block no receiver held
// at the last commit).
struct TensorRound {
  std::map<BlockKey, StateDigest> delta;
  std::set<BlockKey> whole;
};

// A tensor by name, dtype and shape, with or without bytes.
struct TensorMeta {
  std::string_view name;
  DType dtype;
  const std::vector<int64_t>* shape;
  std::span<const uint8_t> data;  // empty for a sharded model's
  Placement place;
};

class Sender final : public StreamSender {
 public:
  // Fixes the time model of a unit's encodings (SenderOptions::
  // dense_by_time) instead of measuring it: for tests, whose decisions must
  // not hang on a loaded machine's timings.
  void SetCostModel(const stream::CostModel& m) {
    cost_ = m;
    cost_fixed_ = true;
  }
  Sender(CommunicatorFactory connect, SenderOptions options)
      : connect_(std::move(connect)), options_(options), quantized_(options.quantize) {}
  Sender(CommunicatorFactory trainer, CommunicatorFactory connect, SenderOptions options)
      : connect_(std::move(connect)),
        trainer_connect_(std::move(trainer)),
        options_(options),
        sharded_(true),
        quantized_(options.quantize) {}
  ~Sender() override { (void)Land(nullptr); }

  Result<SyncStats> Sync(std::span<const SyncTensor> tensors) override {
    return Alone([&] { return SyncAlone(tensors); });
  }
  Result<SyncStats> SyncShards(std::span<const ModelTensor> model,
                               std::span<const ShardedTensor> shards) override {
    return Alone([&] { return SyncShardsAlone(model, shards); });
  }
  Result<std::span<const uint8_t>> Snapshot(std::string_view name) const override;
  Result<std::span<const uint8_t>> ShardSnapshot(size_t index) const override;
  uint64_t committed_sync_id() const override { return committed_id_; }
  void Cancel(std::string_view why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cancelled_.ok()) return;
    cancelled_ = Status::Aborted("the sender was cancelled: " + std::string(why));
    cancel_requested_.store(true);
    if (comm_) comm_->Cancel(why);
    if (trainers_) trainers_->Cancel(why);
  }

 private:
  // Runs one call, refusing a second thread's while it runs, and any call
  // once cancelled.
  template <typename Call>
  Result<SyncStats> Alone(Call&& call) {
    if (busy_.exchange(true)) {
      return Status::FailedPrecondition(
          "a sync is already running in another thread (one call at a time)");
    }
    const Status cancelled = Cancelled();
    Result<SyncStats> r = cancelled.ok() ? call() : Result<SyncStats>(cancelled);
    busy_.store(false);
    return r;
  }
  Status Cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }
  // Sets or clears a communicator Cancel reaches.
  Status Keep(std::unique_ptr<Communicator>* slot, std::unique_ptr<Communicator> c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (c && !cancelled_.ok()) return cancelled_;
    *slot = std::move(c);
    return Status::OK();
  }
  Result<SyncStats> SyncAlone(std::span<const SyncTensor> tensors);
  Result<SyncStats> SyncShardsAlone(std::span<const ModelTensor> model,
                                    std::span<const ShardedTensor> shards);

  // The receivers of one kind (seed or delta) holding one set of tensors:
  // they take the same frames.
  struct Group {
    bool seed = false;
    std::vector<size_t> members;  // indices into peers_
    // Views of the names the peers' `blocks` and the sender's tensors
    // hold (neither changes during a round).
    std::unordered_set<std::string_view> holds;
    std::unordered_set<std::string_view> named;  // tensors its entries named
    FlushWriter writer;
    stream::FrameBuffer bucket;
    // Device tensors over a communicator that sends device memory: the
    // frames are built in this device bucket instead (the records frame
    // that ends the sync still goes through `bucket`).
    std::unique_ptr<stream::DeviceFrame> device;
    uint32_t frames = 0;
    // A unit of work did not fit a first, small frame: the rest are whole
    // buckets.
    bool full_frames = false;
    bool open = false;
    // Its finished frames travel on the flight thread while the next one
    // fills (a round of one group: its bucket and the flight's are the two
    // the sender holds).
    bool overlap = false;
  };

  // The frame on its way to a group's receivers, sent on a thread of its
  // own while the caller diffs and encodes the next one. Only that thread
  // uses the stream communicator until Land returns.
  struct Flight {
    std::thread thread;
    stream::FrameBuffer frame;                    // in flight, or the idle second bucket
    std::unique_ptr<stream::DeviceFrame> device;  // the same, in device memory
    Status status;
    double seconds = 0;
    uint64_t bytes = 0;
  };

  // One sync's state on rank 0, from BeginSync to EndSync.
  struct Round {
    uint64_t sync_id = 0;
    SyncStats stats;
    std::vector<std::unique_ptr<Group>> groups;
    std::vector<Group*> group_of;
    Status streamed;
    Clock::time_point start;
    bool device_frames = false;  // every group builds its frames on the device
  };

  Status CheckModel(std::span<const TensorMeta> tensors, std::vector<TensorState*>* order);
  // The sender's threads (SenderOptions::threads); nullptr for one.
  ThreadPool* Pool();
  // The copies, cut into pieces, on the sender's threads.
  void CopyAll(std::span<const Copy> copies);
  // A host frame's budget: the ramp of kFirstFrameBytes, then the bucket.
  uint64_t FrameBudget(const Group& g) const;
  // `start`: when the sync call began (its total_s counts from there).
  Status BeginSync(Round* round, Clock::time_point start);
  // Records, reports, and the decision; on success `commit` advances the
  // snapshot, on failure nothing advances.
  Result<SyncStats> EndSync(Round* round, const std::vector<TensorState*>& order,
                            const std::function<Status()>& commit);
  // The snapshot is not known to hold the committed state: the next sync
  // seeds every receiver.
  void ForgetSnapshot();
  // Sharded (sharded_sender.cc): this rank's part of a sync, every rank.
  // The local shards' checks against the model and the first sync's.
  Status CheckShards(std::span<const ModelTensor> model, std::span<const ShardedTensor> shards);
  // The layout exchange; on rank 0 its check too. Sets layout_ready_ on
  // rank 0 when accepted.
  Status ExchangeShardLayout(std::span<const ModelTensor> model,
                             std::span<const ShardedTensor> shards, const Status& local);
  // This rank's changes of `segments` (dirty units resent whole), in the HF
  // tensors' coordinates, and the local units they cover marked changed.
  Status DiffSegments(std::span<const ShardedTensor> shards,
                      std::span<const stream::Segment> segments,
                      std::vector<stream::TensorChanges>* out, uint64_t* changed);
  // Rank 0: streams the segments of one batch to the receiver groups.
  Status StreamSegments(std::span<const stream::Segment> segments,
                        std::span<stream::TensorChanges> changes,
                        std::span<const std::span<uint8_t>> dense, Round* round,
                        std::map<std::string, TensorRound, std::less<>>* rounds);
  // Rank 0, after a batch: sends each group's open frame that holds at
  // least kBatchFrameBytes now, on the flight thread, so that it travels
  // while the ranks diff and gather the next batch instead of waiting to
  // fill.
  Status SendBatchFrames(Round* round);
  // After rank 0's decision: commits this rank's snapshots or marks the
  // units the sync covered dirty.
  void SettleShards(std::span<const ShardedTensor> shards, bool commit);
  struct LocalShard;
  // Local device tensor i's current elements [first, first + count) into
  // `out`, a unit of kLocalUnit elements copied from the device at a time.
  Status ReadDevice(size_t i, uint64_t first, uint64_t count, uint8_t* out);
  // DiffSegments for a run of a device shard: its changes, or every
  // element of a dirty unit, through append(hf position, new, old).
  Status DiffDeviceRun(LocalShard& l, const stream::PieceRun& run,
                       const std::function<void(uint64_t, const uint8_t*, const uint8_t*)>& append,
                       uint64_t* changed);
  Status Connect();
  Status Handshake(uint64_t sync_id);
  void Drop() {
    (void)Land(nullptr);
    (void)Keep(&comm_, nullptr);
    welcomed_ = false;
  }
  Status Begin(Group& g, uint64_t sync_id, bool last, bool verify_all);
  // Finishes the group's frame and sends it to the group (on the flight
  // thread when the group overlaps).
  Status Flush(Group& g, SyncStats* stats);
  // Waits for the frame in flight, if any: its send's status, its time and
  // bytes added to `stats` (when given).
  Status Land(SyncStats* stats);
  // Adds one entry to the group's frame through add(g) (false: it did not
  // fit), finishing and sending the frame and starting the next as needed.
  template <typename AddFn>
  Status Add(Group& g, uint64_t sync_id, SyncStats* stats, AddFn&& add);
  // The device context every tensor lives on, when they all live on one
  // device: frames can then be built there.
  stream::DeviceContext* FrameDevice() const;
  // The context of `cuda_device`, made at its first use; an error names
  // `what`.
  Result<stream::DeviceContext*> DeviceFor(int cuda_device, const std::string& what);
  Status StreamTensor(TensorState& t, const UnitSource& src, Round* round);
  // StreamTensor in parts: Begin, the units [u_begin, u_end) (any number of
  // times, in order, covering every unit once), End.
  void BeginTensor(TensorState& t, TensorRound* tr);
  Status StreamUnits(TensorState& t, const UnitSource& src, Round* round, TensorRound* tr,
                     uint64_t u_begin, uint64_t u_end);
  void EndTensor(TensorState& t, const TensorRound& tr);
  // The unit's encoding in a delta (not whole): the one asked for, or dense
  // when positions cost more than the values.
  StreamEncoding EncodingOf(const TensorState& t, const UnitSource& src, uint64_t first,
                            uint64_t count, uint64_t n) const;
  // Adds the unit's share of `key`'s whole digest (from its dense values,
  // or the source's whole digest) to `d`.
  Status AddWholeDigest(const TensorState& t, const UnitSource& src, const BlockKey& key,
                        uint64_t first, uint64_t count, const DenseView& dense, StateDigest* d);
  // Adds the unit to the frame of every group that holds the tensor.
  Status EmitUnit(TensorState& t, const UnitSource& src, Round* round, stream::DeviceSource* dev,
                  const UnitOut& c, const DenseView& dense);
  // The sparse entries of units[which[...]], compressed on the threads
  // (sparse_regions_), each unit pointing at its own.
  Status EncodeSparse(const TensorState& t, ThreadPool* pool, std::span<const size_t> which,
                      std::vector<UnitOut>* units, SyncStats* stats);
  // StreamUnits for a host tensor with a snapshot (sender_host_units.cc):
  // a window of units counted and its digests moved in one pass on the
  // sender's threads, then their positions taken a bucket's worth at a
  // time, in parallel too, and the units emitted in order.
  Status StreamHostUnits(TensorState& t, const UnitSource& src, Round* round, TensorRound* tr,
                         uint64_t u_begin, uint64_t u_end);
  Status SendRecords(Peer& peer, Group& g, uint64_t sync_id, bool verify_all,
                     const std::vector<TensorState*>& order, SyncStats* stats);

  Status ConnectTrainers();
  // A failure of the trainer group: every rank starts again from a full
  // send (rank 0 also reseeds every receiver).
  void LoseTrainers();

  CommunicatorFactory connect_;
  CommunicatorFactory trainer_connect_;
  SenderOptions options_;
  bool sharded_ = false;
  std::unique_ptr<Communicator> trainers_;
  // Sharded, every rank: its local tensors' committed snapshots (empty for
  // one that contributes nothing), their units a failed sync changed
  // (dirty) and the current sync changed, in units of kLocalUnit elements.
  struct LocalShard {
    ShardSpec spec;
    uint32_t w = 1;
    uint64_t numel = 0;
    bool contributes = false;
    core_internal::RawBytes snapshot;  // host shards
    // A device shard: its snapshot (device or pinned memory) and its diff.
    std::unique_ptr<stream::DeviceSource> device;
    Placement place;
    std::vector<uint8_t> dirty;
    std::vector<uint8_t> changed;
  };
  std::vector<LocalShard> local_;
  stream::PiecesByTensor my_pieces_;  // local_'s contributing pieces
  // The device shard diffed last in this sync (its chunk in the scratch).
  stream::DeviceSource* last_diffed_ = nullptr;
  ChangeSet device_part_;               // a device unit's changes
  std::vector<uint8_t> dense_scratch_;  // a dirty device unit's values
  // A seed's reads of device shards: the unit last copied to the host (of
  // local tensor read_cache_shard_, SIZE_MAX: none), valid in one sync.
  std::vector<uint8_t> read_cache_;
  uint64_t read_cache_first_ = 0;
  size_t read_cache_shard_ = SIZE_MAX;
  // A device shard's snapshot was lost to a failed copy: every sync fails.
  Status device_broken_ = Status::OK();
  bool have_local_ = false;  // the snapshots hold a committed state
  // The layout was exchanged (and on rank 0 accepted) on this formation of
  // the trainer group; rank 0 keeps every rank's contributing pieces.
  bool layout_ready_ = false;
  std::vector<std::vector<ShardSpec>> layouts_;
  std::vector<stream::PiecesByTensor> pieces_;
  uint64_t local_syncs_ = 0;  // sharded: syncs taken part in
  std::vector<uint8_t> scratch_;
  std::vector<stream::FrameBuffer> spare_buckets_;  // the last sync's, reused
  std::vector<std::unique_ptr<stream::DeviceFrame>> spare_device_frames_;
  void* frame_stream_ = nullptr;  // the stream of the device tensor being streamed
  Flight flight_;
  std::unique_ptr<Communicator> comm_;
  bool welcomed_ = false;
  std::vector<Peer> peers_;
  std::map<std::string, TensorState, std::less<>> tensors_;
  std::map<int, std::unique_ptr<stream::DeviceContext>> devices_;  // by CUDA device
  stream::QuantizedInputs quantized_;  // the codes and scales of tensors sent quantized
  bool have_snapshot_ = false;
  uint64_t bucket_reserve_ = 0;
  uint64_t next_sync_id_ = 1;
  uint64_t committed_id_ = 0;
  DiffOptions diff_;
  std::unique_ptr<ThreadPool> pool_;
  bool pool_made_ = false;
  ChangeSet changes_;
  std::vector<uint64_t> scratch_positions_;
  // StreamHostUnits' staged positions (from each unit's first) and new
  // values: at most a bucket's worth.
  std::vector<uint32_t> staged_positions_;
  std::vector<uint8_t> staged_values_;
  // The most StreamHostUnits held of kept changes, and of its threads'
  // diff scratch, in the sync so far.
  uint64_t host_kept_peak_ = 0;
  // The current sync's logged changes (LoggedRun), kept to half a bucket:
  // past it a changed unit is copied whole at the commit.
  std::vector<uint8_t> commit_log_;
  uint64_t committed_bytes_ = 0;  // by the last commit (SyncStats::committed_bytes)
  uint64_t host_scratch_peak_ = 0;
  // StreamHostUnits' sparse entries of the staged units, compressed ahead
  // (at most the staged changes' size), and an encoder per thread.
  std::vector<stream::SparseRegions> sparse_regions_;
  core_internal::FreeList<stream::SparseEncoder> sparse_encoders_;
  // The time model of a unit's encodings (SenderOptions::dense_by_time):
  // set once its CPU terms are measured, its wire term from the syncs.
  std::optional<stream::CostModel> cost_;
  bool cost_failed_ = false;        // the measurement failed: bytes decide
  bool cost_fixed_ = false;         // set by SetCostModel: never measured
  bool device_frames_now_ = false;  // the round being streamed frames on the device
  // After a committed sync: the wire term from its send, and the CPU terms
  // measured the first time.
  void UpdateCostModel(const SyncStats& stats);
  // Whether a unit goes dense rather than by positions of the encoding
  // asked for (EncodingOf's rule, before what the source can give).
  bool DenseIsCheaper(const TensorState& t, uint64_t count, uint64_t n) const;
  // StreamHostUnits' per-thread diff buffers.
  core_internal::FreeList<PieceScratch> piece_scratch_;
  // Cancel's state, and the lock under which comm_ and trainers_ are set
  // and cleared (the calling thread reads them without it).
  mutable std::mutex mu_;
  Status cancelled_;
  std::atomic<bool> cancel_requested_{false};  // cancelled_ set, for formations
  std::atomic<bool> busy_{false};
};

}  // namespace deltasync::stream_sender
