// Bit-exact, element-granular diff of new tensor bytes against a snapshot,
// fused with the snapshot refresh.
//
// Elements are compared as integers of their size (1, 2, 4 or 8 bytes): no
// thresholds, and NaN payloads or -0.0 vs +0.0 are simply different bit
// patterns. Element size 1 is also the byte-level mode for unknown dtypes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync {

// What changed in one tensor. Positions are element indices, ascending and
// unique; `pos32` is used while numel < 2^32, `pos64` otherwise (the other
// vector stays empty). `new_values` / `old_values` hold the changed
// elements' bytes, elem_size each, in position order.
struct ChangeSet {
  uint64_t numel = 0;
  uint32_t elem_size = 1;
  bool wide = false;  // positions in pos64
  std::vector<uint32_t> pos32;
  std::vector<uint64_t> pos64;
  std::vector<uint8_t> new_values;
  std::vector<uint8_t> old_values;  // empty unless DiffOptions::keep_old_values

  uint64_t count() const { return wide ? pos64.size() : pos32.size(); }
  uint64_t position(uint64_t i) const { return wide ? pos64[i] : pos32[i]; }
  double density() const { return numel ? static_cast<double>(count()) / numel : 0.0; }
  // Back to the empty state (numel 0, elem_size 1, narrow), keeping the
  // vectors' capacity for reuse.
  void Clear();
};

// Implementations of the element-compare loop. All produce identical output.
enum class DiffKernel : uint8_t { kScalar, kAvx2, kAvx512 };

// "scalar", "avx2" or "avx512".
std::string_view DiffKernelName(DiffKernel kernel);
// The kernel whose DiffKernelName is `name`; InvalidArgument otherwise. Does
// not check that this CPU can run it.
Result<DiffKernel> ParseDiffKernel(std::string_view name);
// Kernels this CPU (and OS) can run, slowest first; always starts with
// kScalar. Off x86-64 only kScalar exists.
std::vector<DiffKernel> AvailableDiffKernels();
// The fastest available kernel (AVX-512 > AVX2 > scalar). Detected once.
DiffKernel BestDiffKernel();

// Working memory of DiffTensor's single-threaded path, kept between calls:
// a caller diffing many small ranges gives each of its threads one
// (DiffOptions::scratch), so that no call allocates and faults in a
// window's buffers anew. Not shared by two calls at once.
class DiffScratch {
 public:
  DiffScratch();
  ~DiffScratch();
  DiffScratch(DiffScratch&&) noexcept;
  DiffScratch& operator=(DiffScratch&&) noexcept;
  struct Impl;
  Impl* impl() { return impl_.get(); }
  // The bytes it holds.
  uint64_t bytes() const;

 private:
  std::unique_ptr<Impl> impl_;
};

struct DiffOptions {
  uint32_t elem_size = 2;        // 1, 2, 4 or 8
  bool refresh_snapshot = true;  // copy new into snapshot in the same pass
  bool keep_old_values = true;   // fill ChangeSet::old_values
  DiffKernel kernel = BestDiffKernel();
  // Worker pool for large tensors; nullptr = single-threaded. The calling
  // thread works too, so a pool of N workers runs N + 1 chunks at a time.
  // DiffTensor must then not be called from inside one of its tasks.
  ThreadPool* pool = nullptr;
  // With a pool, tensors larger than this are cut into chunks of this many
  // bytes (rounded down to whole elements) diffed in parallel; smaller ones
  // are diffed by the calling thread. The output never depends on it.
  size_t parallel_chunk_bytes = 4u << 20;
  // Reused by the single-threaded path (no pool, or a tensor of one chunk);
  // nullptr: a buffer of the call's own.
  DiffScratch* scratch = nullptr;
};

// Compares `new_bytes` against `snapshot` (same length, a multiple of
// elem_size) and replaces the contents of `out` with the changed elements.
// With refresh_snapshot, `snapshot` equals `new_bytes` afterwards; only the
// changed elements are written, so unchanged cache lines stay clean and
// need no write-back (the fused pass costs little more than reading both).
// The two spans may be the same memory but must not partially overlap.
// InvalidArgument (naming the problem) on a bad element size, a length
// mismatch, a length that is not whole elements, overlap, a null `out`, or
// a kernel this CPU cannot run; `out` and `snapshot` are untouched then.
Status DiffTensor(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                  const DiffOptions& options, ChangeSet* out);

// Counts differing elements of `a` and `b` without recording them
// (statistics only), with the best kernel and one thread. Same argument
// rules and errors as DiffTensor.
Result<uint64_t> CountChanged(std::span<const uint8_t> a, std::span<const uint8_t> b,
                              uint32_t elem_size);

}  // namespace deltasync
