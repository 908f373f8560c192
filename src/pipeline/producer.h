// The producing half of a transport: turns new tensor bytes into
// per-tensor encodings against a snapshot of what receivers hold, and hands
// each finished encoding to a sink that decides where its bytes go (the
// disk store's shard files, a collective's send buffer).
//
// Per tensor, one pass a chunk at a time (DiffAndHashInChunks) computes the
// digests of the snapshot's bytes, the diff, the digests of the new bytes
// and, for encodings that stream, the encoding itself; others encode the
// gathered changes at the end. The pass may refresh the snapshot in place
// (keeping an undo log of positions and old values, so that a failed
// publish can put it back). Tensors run in parallel, largest first, and
// per-task scratch is reused from tensor to tensor.
//
// A "tensor" here is any run of elements with a snapshot of its own: a
// sharded trainer hands over the element range of a tensor it holds, and a
// receiver applies that range's encoding to the same range of its copy.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/parallel.h"
#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/status.h"
#include "deltasync/thread_pool.h"
#include "pipeline/chunked_diff.h"

namespace deltasync::pipeline {

// The most digests of each side (the snapshot's bytes, the new bytes) one
// tensor's pass computes.
inline constexpr size_t kMaxDigests = 3;

// Checksum algorithms, in order, whose digests a pass computes (at most
// kMaxDigests; the same algorithm may appear twice).
struct DigestAlgos {
  std::array<ChecksumAlgo, kMaxDigests> algo{};
  size_t count = 0;

  // Appends `a`; the caller keeps count below kMaxDigests.
  void Add(ChecksumAlgo a) { algo[count++] = a; }
};

// One tensor (or element range of one) to produce an encoding for.
struct ProduceTensor {
  std::string_view name;               // for error messages
  std::span<const uint8_t> new_bytes;  // the tensor's new contents
  // What receivers hold: as long as new_bytes. Written (refreshed to the
  // new bytes) only when the producer refreshes; otherwise only read.
  std::span<uint8_t> snapshot;
  uint32_t elem_size = 1;    // 1, 2, 4 or 8: changes are whole elements
  DigestAlgos base_digests;  // of the snapshot's bytes, as they were before the pass
  DigestAlgos new_digests;   // of the new bytes
};

// What the pass found for one tensor.
struct TensorDelta {
  // The pass over the tensor completed: the digests below are set (a
  // tensor skipped after another one failed, or whose pass failed, has
  // none).
  bool diffed = false;
  bool changed = false;  // some element differs: the tensor has an encoding
  uint64_t changed_elements = 0;
  // The snapshot holds the new bytes (also after a failure past the diff),
  // and `undo` the positions and old values that put it back.
  bool refreshed = false;
  ChangeSet undo;
  // Lowercase hex digests in the order of ProduceTensor's base_digests and
  // new_digests (the first `count` entries are set).
  std::array<std::string, kMaxDigests> base_digests;
  std::array<std::string, kMaxDigests> new_digests;
  uint64_t encoded_bytes = 0;  // the encoding's size, when changed
};

// Where finished encodings go. Put is called from the producer's pool
// tasks, several at once: once per changed tensor, after its digests are
// set. `lane` numbers the task slot that calls (from 0, fewer than the
// producer has ever run at once): two calls never share a lane at the same
// time, so per-lane state (an open file, a buffer) needs no lock.
class EncodingSink {
 public:
  virtual ~EncodingSink() = default;
  // Takes the encoding of tensor `index` (valid only during the call).
  // An error stops the producer and is what Run returns.
  virtual Status Put(size_t lane, size_t index, const TensorDelta& delta,
                     std::span<const uint8_t> encoding) = 0;
};

struct ProducerOptions {
  Encoding encoding = Encoding::kSparse;
  EncodeOptions encode;
  ThreadPool* pool = nullptr;  // null: ThreadPool::Default()
  // Whether snapshots are refreshed in the pass. Refreshing stops (later
  // tensors' snapshots are only read, and the caller copies their new bytes
  // when it advances them) once the undo logs hold undo_budget_bytes.
  bool refresh = true;
  uint64_t undo_budget_bytes = std::numeric_limits<uint64_t>::max();
  // Also maps the snapshot's pages before each pass (MADV_POPULATE_READ):
  // for a snapshot that is a file mapping, not memory the caller keeps hot.
  bool prefault_snapshot = false;
  size_t chunk_bytes = kFusedChunkBytes;
};

// Runs the pass over sets of tensors. One Run at a time; the scratch of
// its tasks is kept from Run to Run.
class Producer {
 public:
  explicit Producer(const ProducerOptions& options);
  ~Producer();
  Producer(const Producer&) = delete;
  Producer& operator=(const Producer&) = delete;

  // Produces every tensor of `tensors`, handing each changed one's
  // encoding to `sink`, and sets (*deltas)[i] (resized to tensors.size())
  // to what tensor i's pass found. On error (InvalidArgument for operands
  // the diff refuses, "tensor '<name>'" before the message; an encoder's
  // error after "encoding tensor '<name>'"; a sink's error as it is) the
  // remaining tensors are skipped, and *deltas still records every refresh
  // done, so that UndoRefresh can put each snapshot back.
  Status Run(std::span<const ProduceTensor> tensors, EncodingSink* sink,
             std::vector<TensorDelta>* deltas);

  const ProducerOptions& options() const { return options_; }

 private:
  struct Scratch;

  ProducerOptions options_;
  ThreadPool* pool_;
  const Codec& codec_;
  std::unique_ptr<core_internal::FreeList<Scratch>> scratch_;
  std::atomic<size_t> lanes_{0};
};

// Writes the old values `undo` holds back into `snapshot` (a TensorDelta's
// undo log of that snapshot), undoing a refresh.
void UndoRefresh(const ChangeSet& undo, std::span<uint8_t> snapshot);

}  // namespace deltasync::pipeline
