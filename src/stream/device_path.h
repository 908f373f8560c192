// The stream's tensors in CUDA device memory (include/deltasync/stream.h,
// Placement), on the cuda module's kernels (include/deltasync/cuda.h):
//   sender    the snapshot lives on the device; each chunk of a tensor is
//             diffed there (compare, compaction and digest change in one
//             pass). Over a communicator that sends device memory the
//             frames are built on the device too (DeviceFrame): positions
//             and values go from the diff's outputs into a device bucket,
//             the host writes only the header and manifest, the trailer is
//             hashed on the device. Otherwise only the changes come back to
//             the host frames, through pinned staging. A commit copies the
//             tensor into the snapshot; a failed sync leaves it as it was.
//   receiver  over such a communicator, frames arrive in a device bucket
//             and are checked there (DeviceFrameReader: trailer, padding,
//             positions), entries scattered straight from it into the live
//             tensors; otherwise a host frame goes up whole, a frame at
//             a time (HostFrameUpload), and its entries are scattered from
//             there with one wait per frame, none per entry.
//             Digests are recomputed from device memory at every sync.
// Built without CUDA, Create answers Unsupported, naming the tensor.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/dtype.h"
#include "deltasync/quantize.h"
#include "deltasync/status.h"
#include "deltasync/stream.h"
#include "stream/frame.h"
#include "stream/state_digest.h"

namespace deltasync::stream {

// Whether this build has the GPU data path.
bool DevicePathBuilt();

// The device resources of one sender or receiver on one CUDA device: the
// kernels' workspace and the staging buffers, shared by its tensors. One
// thread at a time.
class DeviceContext {
 public:
  // Unsupported without CUDA; FailedPrecondition without a device.
  static Result<std::unique_ptr<DeviceContext>> Create(int cuda_device);
  virtual ~DeviceContext() = default;
  virtual int device() const = 0;
  // Device and pinned host bytes held.
  virtual uint64_t buffer_bytes() const = 0;
};

// A weight in device memory sent as FP8 (SenderOptions::quantize): its
// codes and scales, held on its device and quantized there at each sync
// (cuda::QuantizeOnDevice).
class DeviceQuantized {
 public:
  // Unsupported without CUDA.
  static Result<std::unique_ptr<DeviceQuantized>> Create(DeviceContext& ctx);
  virtual ~DeviceQuantized() = default;
  // Quantizes the [shape[0], shape[1]] weight of `dtype` at `weight`
  // (device memory of the context's device; work ordered on `stream`) into
  // codes() and scales(), growing them as needed. Returns when they hold
  // it. InvalidArgument naming `name` for a weight the recipe cannot take.
  virtual Status Quantize(const QuantRecipe& recipe, const std::string& name, DType dtype,
                          std::span<const int64_t> shape, const uint8_t* weight, void* stream) = 0;
  // Device memory: the codes (rows * cols bytes) and the scales.
  virtual std::span<const uint8_t> codes() const = 0;
  virtual std::span<const uint8_t> scales() const = 0;
  virtual uint64_t buffer_bytes() const = 0;
};

// A unit's changes left in device memory (DeviceSource::DeviceChanges):
// `count` positions from `base` (int32, or int64 with `wide`; base +
// position is the tensor's flat position), their new and old values.
struct DeviceUnitChanges {
  const void* positions = nullptr;
  bool wide = false;
  uint64_t base = 0;
  const void* values = nullptr;
  const void* old_values = nullptr;
  uint64_t count = 0;
};

// The sender's state of one device tensor.
class DeviceSource {
 public:
  // `chunk` elements (a multiple of the sender's unit of work, `unit`) are
  // diffed at a time. The snapshot lives in device memory, or with
  // `pinned_snapshot` in pinned host memory that the diff reads over the
  // bus (no device memory for it).
  static Result<std::unique_ptr<DeviceSource>> Create(DeviceContext& ctx, std::string name,
                                                      DType dtype, uint64_t numel, uint64_t unit,
                                                      uint64_t chunk, bool pinned_snapshot = false);
  virtual ~DeviceSource() = default;

  // Binds the sync's current values (`bytes`: device memory of `place`).
  // InvalidArgument naming the tensor for host memory, another device or a
  // wrong size.
  virtual Status Begin(std::span<const uint8_t> bytes, const Placement& place) = 0;
  // The changes of unit [first, first + count) against the snapshot
  // (positions from first, new and old values). Units come in ascending
  // order within a sync, and a tensor's units before another's: a diffed
  // chunk's changes wait in the context's shared pinned staging.
  virtual Status Changes(uint64_t first, uint64_t count, ChangeSet* out) = 0;
  // The same changes left in device memory, valid until the next chunk is
  // diffed (the context's scratch); nothing comes back to the host.
  virtual Result<DeviceUnitChanges> DeviceChanges(uint64_t first, uint64_t count) = 0;
  // The digest change of `changes` (DeviceChanges) over the elements of
  // `block` only: a receiver that holds a slice.
  virtual Result<StateDigest> BlockDigestChange(const DeviceUnitChanges& changes,
                                                const DigestBlock& block) = 0;
  // The current values from element `first` (device memory), and the
  // stream that orders work on them.
  virtual const uint8_t* current(uint64_t first) const = 0;
  virtual void* stream() const = 0;
  // What the unit adds to the digest of the whole tensor: before a
  // snapshot (`seed`), the digest of its current values; after, its share
  // of the change since the snapshot (the sum over the units is the
  // tensor's change). After Changes for the unit when not a seed.
  virtual Result<StateDigest> WholeDigest(uint64_t first, uint64_t count, bool seed) = 0;
  // The current values of the unit, in host memory valid until the next
  // call.
  virtual Result<std::span<const uint8_t>> Dense(uint64_t first, uint64_t count) = 0;
  // The committed values of [first, first + count), in host memory valid
  // until the next call to this or Dense; FailedPrecondition before a
  // commit.
  virtual Result<std::span<const uint8_t>> Committed(uint64_t first, uint64_t count) = 0;
  // The sync committed: the current values are copied into the snapshot
  // (one device copy: cheaper than logging the diff's writes to undo them).
  // When the copy fails, the snapshot is dropped.
  virtual Status Commit() = 0;
  // The sync failed: the snapshot, which the diff does not write, still
  // holds the committed values.
  virtual void Rollback() = 0;
  // The digest of the committed values in `block` (after a commit).
  virtual Result<StateDigest> SnapshotDigest(const DigestBlock& block) = 0;
  // The committed values (device memory); empty before the first commit.
  virtual std::span<const uint8_t> snapshot() const = 0;
  virtual uint64_t buffer_bytes() const = 0;
};

// A receiver's destination in device memory.
class DeviceDestination {
 public:
  // `map`'s runs must have stride 1 and ascend in the destination.
  // InvalidArgument naming the tensor otherwise, or for a destination that
  // is not device memory of the context's device.
  static Result<std::unique_ptr<DeviceDestination>> Create(DeviceContext& ctx, std::string name,
                                                           DType dtype, const DestinationMap& map,
                                                           std::span<uint8_t> dest,
                                                           const Placement& place);
  virtual ~DeviceDestination() = default;
  // Writes a checked entry's values in place; the elements written. An
  // entry that is not host_readable lies in a device bucket of the same
  // device (DeviceFrameReader) and is scattered from there, enqueued only:
  // Wait before the bucket is reused.
  virtual Result<uint64_t> Apply(const FlushEntry& entry) = 0;
  // Waits for the applies enqueued so far.
  virtual Status Wait() = 0;
  // The digest of every held element, read from device memory.
  virtual Result<StateDigest> Digest() = 0;
};

// A flush frame built in device memory for a communicator that sends it
// from there: the same bytes FlushWriter builds (docs/format.md, "Stream:
// flush frame"), but the payload is copied device to device from the
// diff's outputs and the tensors, the host lays it out (FlushWriter's
// placed frames) and writes the header and manifest, and the trailer is
// hashed on the device. One thread at a time.
class DeviceFrame {
 public:
  // A bucket of `budget_bytes` on the context's device.
  static Result<std::unique_ptr<DeviceFrame>> Create(DeviceContext& ctx, uint64_t budget_bytes);
  virtual ~DeviceFrame() = default;
  // Starts a frame; its payload bytes are zeroed on `stream` (the padding).
  virtual Status Begin(const FlushHeader& header, void* stream) = 0;
  // Entries from device memory, copied on `stream` (the tensor's): false
  // when they do not fit, the frame unchanged. The refusals of
  // FlushWriter's Add calls.
  virtual Result<bool> AddDense(const TensorRange& range, const uint8_t* values, void* stream) = 0;
  virtual Result<bool> AddIndices(const TensorRange& range, const DeviceUnitChanges& changes,
                                  void* stream) = 0;
  virtual Result<bool> AddDigest(std::string_view name, const DigestBlock& block,
                                 const StateDigest& digest) = 0;
  // Header, manifest and trailer; when it returns the frame is whole in
  // device memory, every copy into it done.
  virtual Status Finish() = 0;
  // The finished frame (device memory).
  virtual std::span<const uint8_t> frame() const = 0;
  virtual uint32_t entry_count() const = 0;
  virtual uint64_t buffer_bytes() const = 0;
};

// A receiver's bucket in device memory and the checks of the frames that
// arrive in it: the trailer hashed on the device, the header and manifest
// copied out and checked by FlushReader::ReadPlaced, the payload's padding
// and positions checked on the device. A frame with sparse entries (zstd,
// decoded on the host) is copied out and read whole. One thread at a time.
class DeviceFrameReader {
 public:
  static Result<std::unique_ptr<DeviceFrameReader>> Create(DeviceContext& ctx);
  virtual ~DeviceFrameReader() = default;
  // The bucket, grown to `bytes` (its contents are not kept), to receive
  // a frame into.
  virtual Result<std::span<uint8_t>> Bucket(uint64_t bytes) = 0;
  // Reads the frame of `bytes` bytes in the bucket into `reader` (as
  // FlushReader::Read: nothing exposed unless every check passes). Its
  // entries view the bucket, or a host copy when it held sparse entries.
  virtual Status Read(FlushReader* reader, uint64_t bytes) = 0;
  // The bucket (device memory).
  virtual const uint8_t* bucket() const = 0;
  // The last frame's host copy when it was read there; empty otherwise.
  virtual std::span<const uint8_t> host_copy() const = 0;
  virtual uint64_t buffer_bytes() const = 0;
};

// A frame's entries for the device destinations of one context, applied
// in one kernel launch per destination stream (cuda::ScatterBatchOnDevice),
// whatever their count: a frame of thousands of small tensors costs what
// one tensor of the same changes does. The entries are not host_readable
// (a device bucket's, or placed by HostFrameUpload) and checked. One
// thread at a time.
class DeviceBatch {
 public:
  static Result<std::unique_ptr<DeviceBatch>> Create(DeviceContext& ctx);
  virtual ~DeviceBatch() = default;
  // Adds an entry for `dest` (a destination of the same context): the
  // elements it will write, as DeviceDestination::Apply counts them.
  // Nothing runs until Launch.
  virtual Result<uint64_t> Add(DeviceDestination& dest, const FlushEntry& entry) = 0;
  // Enqueues the added entries' writes, one launch on each destination
  // stream, and starts over. Each destination's Wait then waits for them;
  // every one is waited for before the next Launch.
  virtual Status Launch() = 0;
  virtual uint64_t buffer_bytes() const = 0;
};

// A checked host frame's entries for device destinations, put in device
// memory a frame at a time, so that each is applied with no wait of its own
// (DeviceDestination::Apply of an entry that is not host_readable, then one
// Wait per destination): the frame's bytes go up in one copy, or are found
// where they already lie on the device, and what is not plain in them (a
// sparse entry's decoded positions and values) is packed in pinned memory
// and goes up in a second. One thread at a time.
class HostFrameUpload {
 public:
  static Result<std::unique_ptr<HostFrameUpload>> Create(DeviceContext& ctx);
  virtual ~HostFrameUpload() = default;
  // `frame`: the host bytes the checked `entries` were read from (they view
  // them, or decoded copies beside them); `on_device`: the same bytes in
  // device memory of the context's device, or null. For each entry k with
  // wanted[k], placed[k] is the entry as it lies in device memory
  // (host_readable false; a sparse entry becomes indices of absolute 4- or
  // 8-byte positions), valid until the next Place; the other entries are
  // copied as they are. Waits for the copies.
  virtual Status Place(std::span<const uint8_t> frame, const uint8_t* on_device,
                       std::span<const FlushEntry> entries, const std::vector<bool>& wanted,
                       std::vector<FlushEntry>* placed) = 0;
  virtual uint64_t buffer_bytes() const = 0;
};

}  // namespace deltasync::stream
