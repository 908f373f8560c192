// The stream's tensors in CUDA device memory (include/deltasync/stream.h,
// Placement), on the cuda module's kernels (include/deltasync/cuda.h):
//   sender    the snapshot lives on the device; each chunk of a tensor is
//             diffed there (compare, compaction, snapshot refresh and digest
//             change in one pass) and only its changes come back to the host
//             frames, through pinned staging. The refresh is undone, from a
//             log of the old values, when the sync does not commit.
//   receiver  frame entries are copied up and scattered into the live
//             device tensor (positions checked on the device first), and its
//             digests are recomputed from device memory at every sync.
// Built without CUDA, Create answers Unsupported, naming the tensor.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/dtype.h"
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

// The sender's state of one device tensor.
class DeviceSource {
 public:
  // `chunk` elements (a multiple of the sender's unit of work) are diffed
  // at a time.
  static Result<std::unique_ptr<DeviceSource>> Create(DeviceContext& ctx, std::string name,
                                                      DType dtype, uint64_t numel, uint64_t chunk);
  virtual ~DeviceSource() = default;

  // Binds the sync's current values (`bytes`: device memory of `place`).
  // InvalidArgument naming the tensor for host memory, another device or a
  // wrong size.
  virtual Status Begin(std::span<const uint8_t> bytes, const Placement& place) = 0;
  // The changes of elements [first, first + count) against the snapshot
  // (positions from first, new and old values), refreshing the snapshot.
  // Units come in ascending order within a sync, and a tensor's units
  // before another's: a diffed chunk's changes wait in the context's
  // shared pinned staging.
  virtual Status Changes(uint64_t first, uint64_t count, ChangeSet* out) = 0;
  // What the unit adds to the digest of the whole tensor: before a
  // snapshot (`seed`), the digest of its current values; after, its share
  // of the change since the snapshot (the sum over the units is the
  // tensor's change). After Changes for the unit when not a seed.
  virtual Result<StateDigest> WholeDigest(uint64_t first, uint64_t count, bool seed) = 0;
  // The current values of the unit, in host memory valid until the next
  // call.
  virtual Result<std::span<const uint8_t>> Dense(uint64_t first, uint64_t count) = 0;
  // The sync committed: the snapshot holds the current values (the diff
  // wrote the changes in; `whole`, or before a first commit, they are
  // copied in whole: a seeding sync diffs nothing).
  virtual Status Commit(bool whole) = 0;
  // The sync failed: the snapshot goes back to the committed values. When
  // that fails, the snapshot is dropped (the next Commit copies it whole).
  virtual Status Rollback() = 0;
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
  // Writes a checked entry's values in place; the elements written.
  virtual Result<uint64_t> Apply(const FlushEntry& entry) = 0;
  // The digest of every held element, read from device memory.
  virtual Result<StateDigest> Digest() = 0;
};

}  // namespace deltasync::stream
