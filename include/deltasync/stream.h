// The online transport: a trainer's sender streams each sync's changed
// values to rollout workers' receivers over a communicator
// (include/deltasync/communicator.h), and every receiver proves, by state
// digests, that it then holds exactly what the trainer holds
// (docs/format.md, "Stream: flush frame", "Stream: state digest", "Stream:
// commit protocol").
//
// A stream group is one communicator group: the sender is rank 0, the
// receivers ranks 1 .. N. Each side is given a factory that forms its member
// of the group, so that after a failure it forms the group again by itself:
//
//   sender:    auto s = StreamSender::Create(connect, {});
//              for (step ...) { train(); s->Sync(tensors); }
//   receiver:  auto r = StreamReceiver::Create(connect, {});
//              r->Register("model.embed_tokens.weight", DType::kBF16, shape, bytes);
//              for (;;) r->ReceiveSync();
//
// The first sync seeds every receiver with dense values; later ones send
// only the changed elements. A sync succeeds only when every receiver
// applied and verified it; then, and only then, the sender's snapshot
// advances. A failed sync names each receiver that failed and why, and the
// next sync brings every receiver bit-exact to the sender's current values
// whatever part of the failed one it applied: the positions a failed sync
// changed are resent until a sync commits, and a receiver that may hold
// unverified bytes, or that formed the group again (a restart, a lost
// connection), is reseeded.
//
// Tensors live in host memory, or in CUDA device memory (Placement): there
// the sender diffs on the device against a snapshot it keeps on the device,
// and a receiver applies into its device tensors with the device's kernels
// (include/deltasync/cuda.h). Over a communicator that carries device
// memory (nccl), with every tensor of a side on one device, the frames stay
// on the device end to end: built there from the diff's outputs, sent from
// and received into device buckets, checked and scattered there; over
// gloo only the changes come back to host frames.
//
// Threads. Each side makes one call at a time: a second thread that calls
// Sync, SyncShards or ReceiveSync while another thread is in one gets
// FailedPrecondition at once and changes nothing. Cancel and health may be
// called from any thread at any time: Cancel ends the call in flight with
// Aborted (at once over gloo and nccl; see CommunicatorCapabilities) and
// closes the side for good, so that an owner can shut a side down that
// another thread is using, and then destroy it once that call returned.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/dtype.h"
#include "deltasync/quantize.h"
#include "deltasync/shard.h"
#include "deltasync/status.h"

namespace deltasync {

// Forms this side's member of the stream group (CreateCommunicator with the
// group's options, or a wrapper around it). Called at the first sync and
// again after any failure of the communicator.
using CommunicatorFactory = std::function<Result<std::unique_ptr<Communicator>>()>;

// How a delta sync carries positions (docs/format.md, "Wire encodings"):
//   dense    every element of each changed range, positions implied;
//   indices  int32 positions (int64 for tensors of 2^31 elements or more)
//            and the new values, as verl sends them; a range whose
//            positions would cost more than its values goes dense;
//   sparse   gap-coded positions and byte planes of the values, zstd
//            compressed: fewest bytes, for slow links.
// A seed is always dense.
enum class StreamEncoding : uint8_t { kDense = 0, kIndices = 1, kSparse = 2 };

// "dense", "indices", "sparse".
std::string_view StreamEncodingName(StreamEncoding encoding);
// The inverse; InvalidArgument naming the accepted names otherwise.
Result<StreamEncoding> ParseStreamEncoding(std::string_view name);

// Where a tensor's bytes live: host memory (cuda_device -1), or device
// memory of CUDA device `cuda_device`, with the stream that orders work on
// it (a cudaStream_t; nullptr, the default stream). The stream layer's work
// on the tensor is ordered on that stream, after what the caller queued
// there before (pass the stream the tensor is written on: torch's current
// stream), and is done when Sync or ReceiveSync returns. A build without
// CUDA refuses device placements (Unsupported); a machine without a GPU
// too (FailedPrecondition).
struct Placement {
  int cuda_device = -1;
  void* cuda_stream = nullptr;
  bool on_device() const { return cuda_device >= 0; }
  static Placement Cuda(int device, void* stream = nullptr) { return {device, stream}; }
};

// One tensor the sender syncs, named as in the Hugging Face checkpoint:
// `data` holds numel(shape) elements of `dtype`, row-major, contiguous, in
// the memory `place` says. Every Sync passes the same tensors (names,
// dtypes, shapes, placements), in any order. SenderOptions::quantize names
// those sent as FP8.
struct SyncTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;
  Placement place;
};

// A sharded trainer's model: every HF tensor the sync covers, named as in
// the checkpoint. Every trainer rank passes the same list.
struct ModelTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
};

// One of a trainer rank's local tensors: where its elements lie in the HF
// tensors (include/deltasync/shard.h), and its bytes (spec.local_shape of
// spec.dtype, row-major, contiguous) in the memory `place` says. A shard in
// device memory is diffed on its device against its snapshot there (or in
// pinned host memory: SenderOptions::pinned_snapshot), and only its changes
// (a seed: its values) come to the host for the gather. Every sync passes
// the same placements.
struct ShardedTensor {
  ShardSpec spec;
  std::span<const uint8_t> data;
  Placement place;
};

// A tensor the whole-tensor sender sends as FP8 (quantize-then-diff): the
// SyncTensor of that name (BF16, F16 or F32, 2-D [rows, cols], in host or
// device memory) is quantized at each sync under `recipe`, exactly as
// deltasync/quantize.h's Fp8Quantize (and the engines' loaders it follows)
// would, and the receivers get two tensors: the codes, F8_E4M3 of the same
// shape under the same name, and the scales (QuantScaleDType,
// QuantScaleShape) under `scale_name` (empty: the name + "_scale_inv",
// DeepSeek-V3's). Both are diffed against the sender's snapshot of the
// quantized state, so a sync sends the codes and scales that changed and a
// receiver's FP8 weights are bit-identical to quantizing the trainer's
// weights directly. The sender holds the current codes and scales (half the
// BF16 bytes) beside its snapshot of them, where the tensor lives: a device
// tensor is quantized on its GPU (cuda::QuantizeOnDevice) and diffed there.
// A weight the recipe cannot take (not 2-D, another dtype, a NaN or an
// infinity) fails the sync with InvalidArgument naming it, before anything
// is sent.
struct QuantizedSend {
  QuantRecipe recipe;
  std::string scale_name;
};

struct SenderOptions {
  StreamEncoding encoding = StreamEncoding::kIndices;
  // A flush frame's size bound: besides its snapshot the sender holds two
  // such buckets, one per kind of receiver in a sync (those being seeded,
  // those taking the delta), or, when every receiver takes the same frames,
  // one filling while the previous frame is sent; at least 64 KiB.
  uint64_t bucket_bytes = uint64_t{16} << 20;
  // Every K-th sync, each receiver recomputes the digest of everything it
  // holds from memory instead of trusting its running digests; 0: never.
  uint32_t verify_every = 0;
  int zstd_level = 1;  // sparse
  // Build frames in device memory when every tensor lives on one device and
  // the communicator sends device memory (SyncStats::device_frames); false:
  // on the host always (two buckets of device memory fewer).
  bool device_frames = true;
  // A device tensor's snapshot in pinned host memory rather than device
  // memory: no device memory for it, and the diff reads it over the bus
  // (as fast as the bus reads it; a device snapshot is faster, and holds
  // a copy of the tensor in device memory).
  bool pinned_snapshot = false;
  // Threads for a host tensor's diff and the commit's copy into the
  // snapshot (the calling thread is one of them): 0 the cores this process
  // may run on (its CPU affinity), 1 the calling thread alone; at most 1024.
  uint32_t threads = 0;
  // A unit of a delta framed on the host (a host tensor's, or a device
  // tensor's whose changes come back to host frames) goes dense when that
  // takes less time than its positions: the work per dense byte and per
  // change of each encoding is measured on this machine once (a few
  // milliseconds, after the first sync that sends 8 MiB), the time per
  // byte on the wire from the syncs that send 8 MiB or more. false, until
  // then, and for frames built on the device: dense when positions would
  // take more bytes than the values (`indices` only).
  bool dense_by_time = true;
  // Tensors sent quantized, by name (above; whole-tensor senders only).
  std::map<std::string, QuantizedSend, std::less<>> quantize;
};

// What one sync did, split by phase (seconds).
struct SyncStats {
  uint64_t sync_id = 0;
  uint32_t receivers = 0;
  uint32_t seeded = 0;  // receivers that got a seed
  // Receivers that hold only some of the tensors on purpose
  // (ReceiverOptions::partial).
  uint32_t partial_receivers = 0;
  uint64_t changed = 0;        // elements that differ from the snapshot
  uint64_t sent_elements = 0;  // elements the delta frames carry (changed + resent)
  uint64_t frames = 0;         // frames built (each sent to every receiver of its kind)
  // Of those, frames built in device memory: device tensors on one device
  // over a communicator that sends that device's memory (nccl), seeds and
  // dense or indices deltas. Their bytes never cross to the host.
  uint64_t device_frames = 0;
  uint64_t bytes_sent = 0;  // over all receivers, envelopes included
  bool verify_all = false;
  // The most bytes of frame buckets and diff scratch the sync held at once,
  // beside the snapshot (capacities, measured at the end of the sync;
  // device tensors' scratch and pinned staging included).
  uint64_t buffer_bytes = 0;
  double quantize_s = 0;  // quantizing the tensors sent as FP8 (SenderOptions::quantize)
  double diff_s = 0;      // diff against the snapshot and digest updates
  double encode_s = 0;    // building frames
  double transfer_s = 0;  // sending them (while the next fills, see bucket_bytes)
  double report_s = 0;    // waiting for the receivers' reports
  double commit_s = 0;    // advancing the snapshot
  double total_s = 0;     // the whole call, from the checks of its arguments on
  // Bytes the whole-tensor sender's commit copied into host snapshots: the
  // changed elements alone where the sync logged their positions (half a
  // bucket of them), their whole units otherwise (and first snapshots).
  uint64_t committed_bytes = 0;
};

// Rank 0 of a stream group; with a sharded trainer, one on every trainer
// rank.
class StreamSender {
 public:
  // A trainer that holds every tensor whole: Sync.
  static Result<std::unique_ptr<StreamSender>> Create(CommunicatorFactory connect,
                                                      SenderOptions options = {});
  // One trainer rank of a sharded trainer: SyncShards. `trainer_group`
  // forms the trainer ranks' own group (its rank is this trainer rank);
  // `stream_group` forms the stream group, on trainer rank 0 only (empty on
  // the others). No rank holds a copy of the model (docs/format.md,
  // "Stream: sharded sync"): each rank keeps the committed snapshot of its
  // own shards, diffs them against it and sends rank 0 only the changed
  // elements, one batch at a time, which rank 0 streams on; a seed streams
  // the ranks' current values through rank 0 the same way, and a failed
  // sync's changes are resent by the ranks that hold them. Rank 0's memory
  // beyond its own shards is its buckets and one batch, whatever the
  // model's size.
  static Result<std::unique_ptr<StreamSender>> CreateSharded(CommunicatorFactory trainer_group,
                                                             CommunicatorFactory stream_group,
                                                             SenderOptions options = {});
  virtual ~StreamSender() = default;

  // Called on every trainer rank with the same `model` and its own local
  // tensors (their pieces inside the model's tensors, each element of the
  // model held by some rank that contributes). The result as Sync's, on
  // every rank: rank 0 tells the others whether the sync committed, and
  // their snapshots advance with it. Stats are rank 0's; the others fill in
  // changed and diff_s, and as sync_id how many syncs they took part in.
  virtual Result<SyncStats> SyncShards(std::span<const ModelTensor> model,
                                       std::span<const ShardedTensor> shards) = 0;

  // Brings every receiver to `tensors`. OK when every receiver applied and
  // verified it (the snapshot then holds `tensors`). Otherwise the error
  // names the sync and each failed receiver with its reason ("sync 7: 1 of
  // 3 receivers failed: receiver 2: tensor 'w': digest mismatch ..."), and
  // the snapshot is unchanged. InvalidArgument, before anything is sent, for
  // tensors that are not the ones the first sync passed (or are malformed).
  virtual Result<SyncStats> Sync(std::span<const SyncTensor> tensors) = 0;

  // The committed state of a tensor (what every receiver held after the
  // last sync that succeeded), in the memory the tensor lives in (device
  // memory for a device tensor); NotFound before the first success.
  // FailedPrecondition on a sharded sender, which holds no whole tensor.
  virtual Result<std::span<const uint8_t>> Snapshot(std::string_view name) const = 0;
  // A sharded rank's committed snapshot of its local tensor `index` (the
  // index-th of the shards SyncShards takes); NotFound before the first
  // success, or for a local tensor that contributes nothing (no snapshot is
  // kept of it); FailedPrecondition on a whole-tensor sender.
  virtual Result<std::span<const uint8_t>> ShardSnapshot(size_t index) const = 0;
  // The id of the last sync that succeeded; 0 before.
  virtual uint64_t committed_sync_id() const = 0;

  // Thread-safe. Ends a call in flight with Aborted naming `why` and closes
  // this sender: every later call fails. Idempotent.
  virtual void Cancel(std::string_view why) = 0;
};

// A part of a tensor a receiver holds: tensor elements hf_first + k (0 <= k
// < count), in the tensor's flat row-major coordinates, live at destination
// element dest_offset + k * dest_stride. A whole tensor is one run; a slice
// of rows one run; a slice of columns one run per row; a part of a fused
// parameter is the tensor's run at the part's offset in the fused buffer.
struct DestinationRun {
  uint64_t hf_first = 0;
  uint64_t count = 0;
  uint64_t dest_offset = 0;
  uint64_t dest_stride = 1;
  bool operator==(const DestinationRun&) const = default;
};

struct ReceiverOptions {
  // The largest frame this receiver takes; it holds one frame and one
  // decode chunk. It says so in its hello, and a sender whose bucket is
  // larger refuses it there, naming both sizes.
  uint64_t max_frame_bytes = uint64_t{1} << 30;
  // How long ReceiveSync waits for the next sync to begin (and, before the
  // first sync of a formation, for the sender to take its hello); unset: no
  // bound. Between syncs the trainer trains, which may take far longer than
  // the communicator's timeout; a sender that dies meanwhile is still
  // noticed at once over gloo (its connection drops). Everything inside a
  // sync stays bounded by the timeout.
  std::optional<std::chrono::milliseconds> sync_wait;
  // This receiver registers only some of the sender's tensors on purpose
  // (a pipeline stage). Otherwise the sender refuses it unless it registers
  // every tensor the sender syncs, naming the first one it lacks.
  bool partial = false;
  // Called once per sync before it writes anything (when its first frame
  // has arrived): an error refuses the sync with that error, having written
  // nothing. For destinations whose memory the caller may move between
  // syncs (Python tensors whose storage an engine swaps): the check names
  // the tensor, and Rebind points the receiver at its new memory.
  std::function<Status()> before_apply;
  // Take frames into device memory when every registered tensor lives on
  // one device and the communicator takes device memory
  // (ReceiveStats::device_frames); false: into host memory always.
  bool device_frames = true;
  // Threads that apply a host frame's entries (each entry a range of one
  // tensor; the calling thread is one of them): 0 the cores this process
  // may run on (its CPU affinity), 1 the calling thread alone; at most
  // 1024.
  uint32_t threads = 0;
  // Tests only: called before each entry is applied with the sync id, the
  // tensor and the entry's index in the sync; an error stops the apply
  // there, as a failure half way through would.
  std::function<Status(uint64_t sync_id, std::string_view tensor, uint64_t entry)> apply_hook;
};

struct ReceiveStats {
  uint64_t sync_id = 0;
  // A seed: every element this receiver holds was written. A seed counts
  // no changes (there is no previous state to compare with): it is the
  // sender's SyncStats::changed that counts a delta's changes.
  bool seed = false;
  bool partial = false;  // ReceiverOptions::partial
  uint64_t tensors = 0;  // registered
  bool verify_all = false;
  uint64_t frames = 0;
  // Of those, frames taken into device memory, checked and applied from
  // there (but for frames with sparse entries, decoded from a host copy):
  // every registered tensor on one device, over a communicator that takes
  // that device's memory.
  uint64_t device_frames = 0;
  uint64_t bytes = 0;             // frame bytes taken
  uint64_t elements_written = 0;  // into destinations
  double wait_s = 0;              // for the sync's first frame
  double receive_s = 0;           // taking the rest
  double apply_s = 0;             // checking and applying frames
  double verify_s = 0;            // digests recomputed from memory
};

// Ranks 1 .. N of a stream group.
class StreamReceiver {
 public:
  static Result<std::unique_ptr<StreamReceiver>> Create(CommunicatorFactory connect,
                                                        ReceiverOptions options = {});
  virtual ~StreamReceiver() = default;

  // Registers where a tensor's values are written: `dest` holds elements of
  // `dtype`; `runs` map the tensor's flat coordinates into it (empty: the
  // whole tensor, back to back). The held elements must form one digest
  // block (a range, or equal rows at a fixed stride, as tensor-parallel
  // slices do). `place` says where `dest` lives; in device memory its runs
  // must have stride 1 and ascend in `dest` (as every row or column slice
  // of a contiguous tensor does), and the receiver recomputes the held
  // elements' digests on the device at each sync rather than keeping
  // running ones. Before the first ReceiveSync only; InvalidArgument naming
  // the tensor for a duplicate name, bad runs, a `dest` too small or not
  // where `place` says.
  virtual Status Register(std::string name, DType dtype, std::vector<int64_t> shape,
                          std::span<uint8_t> dest, std::vector<DestinationRun> runs = {},
                          Placement place = {}) = 0;

  // Points a registered tensor at new memory of the same dtype and size
  // (an engine that reallocated its weights), between syncs. The new
  // memory's contents are not known, so the receiver asks the sender for a
  // seed: the next sync is refused (the sender learns why) and the one after
  // reseeds it. InvalidArgument naming the tensor for an unknown name or a
  // destination of another size or place; FailedPrecondition during a call.
  virtual Status Rebind(std::string_view name, std::span<uint8_t> dest, Placement place = {}) = 0;

  // Takes one sync: its frames, applied in place once each is checked, its
  // digests verified, and the report sent. OK when this receiver's part
  // succeeded; otherwise the error names the sync and frame or tensor and
  // the problem. A frame refused by its checks changed no weight, but
  // frames of the sync before it may have been applied: after a failed
  // sync each element holds its committed value or the sync's, and the
  // next sync repairs it (docs/format.md, "After a failed sync"). A
  // communicator failure drops the group, which the next call forms again
  // (and is reseeded); so do three failed syncs in a row.
  virtual Result<ReceiveStats> ReceiveSync() = 0;

  // Thread-safe. Ends a call in flight with Aborted naming `why` and closes
  // this receiver: every later call fails. Idempotent.
  virtual void Cancel(std::string_view why) = 0;

  // Thread-safe: where this receiver stands.
  struct Health {
    bool connected = false;  // a member of a formed group
    bool seeded = false;     // holds a verified state of this formation
    bool in_call = false;    // a ReceiveSync is running
    bool waiting = false;    // ... and waits for a sync to begin
    double waiting_s = 0;    // since when it waits
    uint64_t last_sync_id = 0;
    uint32_t failures_in_a_row = 0;
    Status link;  // the communicator's health (OK while usable), or Cancel's error
  };
  virtual Health health() const = 0;
};

}  // namespace deltasync
