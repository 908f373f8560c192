// The applying half of a transport: decodes per-tensor encodings read from
// a source (the disk store's version shards, a collective's receive
// buffer) and applies them in place to the receiver's tensors, verifying
// each result against the digest it must have.
//
// Each tensor's changes are decoded in bounded runs (never the tensor's
// whole change list at once, whatever its size), and each run is written
// and hashed right behind the decoder, a small piece at a time, while the
// lines it touches are still in cache. An observer sees every run before it
// is written (to journal it, say) and after. Tensors run in parallel,
// largest first, and per-task decode scratch is kept from Run to Run.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/parallel.h"
#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync::pipeline {

// One tensor (or element range of one) to apply an encoding to.
struct ApplyTensor {
  // Prefixes this tensor's errors, e.g. "applying version 000003: tensor 'w'".
  std::string_view what;
  Encoding encoding = Encoding::kSparse;
  // Holds exactly the base the encoding was made against; receives the
  // result in kApply (only read in kDecodeOnly).
  std::span<uint8_t> target;
  uint32_t elem_size = 1;  // 1, 2, 4 or 8, as the encoder's
  // What the result must hash to: lowercase hex in `algo`. Empty: the
  // result is neither hashed nor verified.
  ChecksumAlgo algo = ChecksumAlgo::kXxh3_128;
  std::string_view digest;
};

// Where encodings come from.
class EncodingSource {
 public:
  virtual ~EncodingSource() = default;
  // The encoding of tensor `index`, valid until Run returns. Called once
  // per tensor, from the applier's pool tasks, several at once. An error
  // stops the applier (prefixed with the tensor's `what`).
  virtual Result<std::span<const uint8_t>> EncodingOf(size_t index) = 0;
};

// Sees each tensor's progress. Called from the applier's pool tasks,
// several at once; `lane` numbers the task slot that calls (from 0, fewer
// than the applier has ever run at once), and two calls never share a lane
// at the same time, so per-lane state needs no lock.
class ApplyObserver {
 public:
  virtual ~ApplyObserver() = default;
  // Before anything of tensor `index` is decoded.
  virtual void Begin(size_t lane, size_t index) {
    (void)lane;
    (void)index;
  }
  // Each run of the tensor's changes, in ascending positions, each past the
  // one before, with old and new values (the last run may be empty: every
  // tensor has at least one), before any of it is written. An error stops
  // the tensor, and the applier.
  virtual Status Changes(size_t lane, size_t index, const ChangeSet& run) {
    (void)lane;
    (void)index;
    (void)run;
    return Status::OK();
  }
  // After a non-empty run is written into the target (kApply).
  virtual void Written(size_t lane, size_t index, const ChangeSet& run) {
    (void)lane;
    (void)index;
    (void)run;
  }
  // After the tensor's last run, when every step for it succeeded (before
  // its digest is compared).
  virtual void Done(size_t lane, size_t index) {
    (void)lane;
    (void)index;
  }
};

enum class ApplyMode : uint8_t {
  // Decode, write every run into the target, verify the result.
  kApply,
  // Decode and hand the runs to the observer only: the target is read (the
  // old values come from it), never written, and nothing is verified. For
  // a receiver that journals a whole version before it touches anything.
  kDecodeOnly,
};

struct ApplierOptions {
  ApplyMode mode = ApplyMode::kApply;
  ThreadPool* pool = nullptr;  // null: ThreadPool::Default()
  // Changes per run (at least 1). In kApply few enough that the lines a
  // run's decode reads are still in cache when its values are written and
  // hashed right after.
  uint64_t run_changes = uint64_t{16} << 10;
  // Bytes of a run written and then hashed together: the lines its decode
  // just read are in L2; a piece this small is hashed from L1 (2-4% less
  // CPU for a pull than hashing the run's span after writing all of it,
  // measured at 1.7% of BF16 elements changed).
  size_t hash_piece_bytes = size_t{64} << 10;
  // In kApply, maps a target's pages writable in one call when the
  // encoding's size says its changes dirty nearly every page anyway.
  bool prefault_targets = true;
};

// What happened to one tensor.
struct ApplyOutcome {
  // Decoded (and in kApply written) in full; false for a tensor that failed
  // or was skipped after another one failed.
  bool done = false;
  // kApply: done, but the result's digest is not ApplyTensor::digest.
  bool mismatch = false;
  uint64_t changed_elements = 0;  // elements the encoding changes (when done)
};

// Applies sets of tensors. One Run at a time.
class Applier {
 public:
  explicit Applier(const ApplierOptions& options);
  ~Applier();
  Applier(const Applier&) = delete;
  Applier& operator=(const Applier&) = delete;

  // Applies (or decodes, in kDecodeOnly) each tensor of `tensors` to its
  // target, reading encoding i from `source`, telling `observer` (may be
  // null) about each, and sets (*outcomes)[i] (resized to tensors.size()).
  // Tensors are started largest target first, ties in the given order. The
  // first error (the codec's Corruption for bytes that violate the format
  // or do not fit the target; the source's or observer's error) is
  // returned prefixed with the tensor's `what`, the remaining tensors
  // skipped; a target that was being written is then partly updated, as
  // are the targets written before, which the observer saw. A digest
  // mismatch is no error: it is reported in the outcome.
  Status Run(std::span<const ApplyTensor> tensors, EncodingSource* source, ApplyObserver* observer,
             std::vector<ApplyOutcome>* outcomes);

  const ApplierOptions& options() const { return options_; }

 private:
  struct Scratch;

  ApplierOptions options_;
  ThreadPool* pool_;
  std::unique_ptr<core_internal::FreeList<Scratch>> scratch_;
  std::atomic<size_t> lanes_{0};
};

}  // namespace deltasync::pipeline
