#include "deltasync/diff.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>

#include "core/cpu_isa.h"
#include "diff/diff_internal.h"

namespace deltasync {

namespace {

using diff_internal::ChangeSink;
using diff_internal::CountRangeFn;
using diff_internal::DiffRangeFn;
using diff_internal::KernelVariant;

// Kernels see at most this many bytes per call, so the output arrays need
// room for one window's elements beyond what was found so far, not for the
// whole tensor.
constexpr size_t kWindowBytes = size_t{64} << 10;

bool IsValidElemSize(uint32_t elem_size) {
  return elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8;
}

bool CpuRuns(DiffKernel kernel) {
  switch (kernel) {
    case DiffKernel::kScalar: return true;
    case DiffKernel::kAvx2: return core_internal::CpuRuns(core_internal::CpuIsa::kAvx2);
    case DiffKernel::kAvx512: return core_internal::CpuRuns(core_internal::CpuIsa::kAvx512);
  }
  return false;
}

// Callers have checked CpuRuns(kernel) and the element size.
DiffRangeFn SelectDiffFn(DiffKernel kernel, const KernelVariant& variant) {
  switch (kernel) {
    case DiffKernel::kScalar: return diff_internal::ScalarDiffFn(variant);
#if defined(__x86_64__)
    case DiffKernel::kAvx2: return diff_internal::Avx2DiffFn(variant);
    case DiffKernel::kAvx512: return diff_internal::Avx512DiffFn(variant);
#else
    default: break;
#endif
  }
  return nullptr;
}

CountRangeFn SelectCountFn(DiffKernel kernel, uint32_t elem_size) {
  switch (kernel) {
    case DiffKernel::kScalar: return diff_internal::ScalarCountFn(elem_size);
#if defined(__x86_64__)
    case DiffKernel::kAvx2: return diff_internal::Avx2CountFn(elem_size);
    case DiffKernel::kAvx512: return diff_internal::Avx512CountFn(elem_size);
#else
    default: break;
#endif
  }
  return nullptr;
}

// `what` names the caller; `first`/`second` name its two operands.
Status CheckOperands(std::string_view what, std::string_view first, std::string_view second,
                     size_t first_size, size_t second_size, uint32_t elem_size) {
  if (!IsValidElemSize(elem_size)) {
    return Status::InvalidArgument(std::string(what) + ": element size " +
                                   std::to_string(elem_size) + " is not 1, 2, 4 or 8");
  }
  if (first_size != second_size) {
    return Status::InvalidArgument(std::string(what) + ": length mismatch, " + std::string(first) +
                                   " has " + std::to_string(first_size) + " bytes but " +
                                   std::string(second) + " has " + std::to_string(second_size));
  }
  if (first_size % elem_size != 0) {
    return Status::InvalidArgument(std::string(what) + ": length " + std::to_string(first_size) +
                                   " bytes is not a multiple of element size " +
                                   std::to_string(elem_size));
  }
  return Status::OK();
}

// Uninitialized, growable staging storage for changes. Zero-filling (as
// std::vector::resize would) is avoided because the arrays are sized for
// the worst case of a window, not for what is actually found; buffers are
// reused so their memory is already mapped and cache-warm.
class ChangeBuffer {
 public:
  explicit ChangeBuffer(const KernelVariant& variant) : variant_(variant) {}

  // Makes room for `more` changes beyond count().
  void Reserve(size_t more) {
    if (count_ + more <= capacity_) return;
    const size_t capacity = std::max(count_ + more, capacity_ * 2);
    const size_t value_bytes = capacity * variant_.elem_size;
    if (variant_.wide) {
      Regrow(pos64_, count_, capacity);
    } else {
      Regrow(pos32_, count_, capacity);
    }
    Regrow(new_values_, count_ * variant_.elem_size, value_bytes);
    if (variant_.keep_old) Regrow(old_values_, count_ * variant_.elem_size, value_bytes);
    capacity_ = capacity;
  }

  // Where the next change goes.
  ChangeSink Tail() const {
    const size_t value_offset = count_ * variant_.elem_size;
    ChangeSink sink;
    if (variant_.wide) {
      sink.pos64 = pos64_.get() + count_;
    } else {
      sink.pos32 = pos32_.get() + count_;
    }
    sink.new_values = new_values_.get() + value_offset;
    if (variant_.keep_old) sink.old_values = old_values_.get() + value_offset;
    return sink;
  }

  void Commit(size_t added) { count_ += added; }
  // The bytes its arrays hold.
  uint64_t bytes() const {
    return capacity_ * ((variant_.wide ? 8 : 4) + variant_.elem_size * (variant_.keep_old ? 2 : 1));
  }
  size_t count() const { return count_; }
  void Reset() { count_ = 0; }

  void AppendTo(ChangeSet* out) const {
    if (count_ == 0) return;
    const size_t value_bytes = count_ * variant_.elem_size;
    if (variant_.wide) {
      out->pos64.insert(out->pos64.end(), pos64_.get(), pos64_.get() + count_);
    } else {
      out->pos32.insert(out->pos32.end(), pos32_.get(), pos32_.get() + count_);
    }
    out->new_values.insert(out->new_values.end(), new_values_.get(),
                           new_values_.get() + value_bytes);
    if (variant_.keep_old) {
      out->old_values.insert(out->old_values.end(), old_values_.get(),
                             old_values_.get() + value_bytes);
    }
  }

 private:
  template <typename T>
  static void Regrow(std::unique_ptr<T[]>& array, size_t keep, size_t capacity) {
    std::unique_ptr<T[]> grown = std::make_unique_for_overwrite<T[]>(capacity);
    if (keep != 0) std::copy(array.get(), array.get() + keep, grown.get());
    array = std::move(grown);
  }

  KernelVariant variant_;
  size_t count_ = 0;
  size_t capacity_ = 0;
  std::unique_ptr<uint32_t[]> pos32_;
  std::unique_ptr<uint64_t[]> pos64_;
  std::unique_ptr<uint8_t[]> new_values_;
  std::unique_ptr<uint8_t[]> old_values_;
};

// Diffs elements [first, first + numel) into `buffer`, one window at a
// time. With `flush_to`, each window's changes are appended there while
// still in cache and the buffer is emptied, so it never outgrows a window.
void DiffRange(DiffRangeFn fn, uint32_t elem_size, const uint8_t* new_bytes, uint8_t* snapshot,
               uint64_t first, size_t numel, ChangeBuffer* buffer, ChangeSet* flush_to) {
  const size_t window_numel = kWindowBytes / elem_size;
  for (size_t done = 0; done < numel;) {
    const size_t n = std::min(window_numel, numel - done);
    const size_t offset = (first + done) * elem_size;
    buffer->Reserve(n + diff_internal::kSinkSlack);
    buffer->Commit(fn(new_bytes + offset, snapshot + offset, n, first + done, buffer->Tail()));
    if (flush_to != nullptr) {
      buffer->AppendTo(flush_to);
      buffer->Reset();
    }
    done += n;
  }
}

// Collects the outputs of chunks diffed in parallel and appends them to the
// ChangeSet in chunk order as soon as all earlier chunks are in. Chunks are
// handed out in increasing order, so most arrive in order and are copied
// while still in cache and while other threads keep diffing; the few that
// overtake a slower one wait in `pending_`. Buffers are recycled.
class OrderedAppender {
 public:
  OrderedAppender(const KernelVariant& variant, size_t num_chunks, ChangeSet* out)
      : variant_(variant), out_(out), pending_(num_chunks) {}

  std::unique_ptr<ChangeBuffer> Acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<ChangeBuffer>(variant_);
    std::unique_ptr<ChangeBuffer> buffer = std::move(free_.back());
    free_.pop_back();
    return buffer;
  }

  void Finish(size_t chunk, std::unique_ptr<ChangeBuffer> buffer) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_[chunk] = std::move(buffer);
    while (next_ < pending_.size() && pending_[next_] != nullptr) {
      std::unique_ptr<ChangeBuffer> done = std::move(pending_[next_++]);
      done->AppendTo(out_);
      done->Reset();
      free_.push_back(std::move(done));
    }
  }

 private:
  const KernelVariant variant_;
  ChangeSet* const out_;
  std::mutex mu_;
  std::vector<std::unique_ptr<ChangeBuffer>> pending_;  // by chunk index
  std::vector<std::unique_ptr<ChangeBuffer>> free_;
  size_t next_ = 0;  // first chunk not yet appended
};

}  // namespace

struct DiffScratch::Impl {
  KernelVariant variant;
  std::unique_ptr<ChangeBuffer> buffer;
  // The buffer for `v`, made anew only when the variant changes.
  ChangeBuffer* For(const KernelVariant& v) {
    if (!buffer || v.elem_size != variant.elem_size || v.refresh != variant.refresh ||
        v.keep_old != variant.keep_old || v.wide != variant.wide) {
      variant = v;
      buffer = std::make_unique<ChangeBuffer>(v);
    }
    buffer->Reset();
    return buffer.get();
  }
};

DiffScratch::DiffScratch() : impl_(std::make_unique<Impl>()) {}
uint64_t DiffScratch::bytes() const { return impl_->buffer ? impl_->buffer->bytes() : 0; }
DiffScratch::~DiffScratch() = default;
DiffScratch::DiffScratch(DiffScratch&&) noexcept = default;
DiffScratch& DiffScratch::operator=(DiffScratch&&) noexcept = default;

void ChangeSet::Clear() {
  numel = 0;
  elem_size = 1;
  wide = false;
  pos32.clear();
  pos64.clear();
  new_values.clear();
  old_values.clear();
}

std::string_view DiffKernelName(DiffKernel kernel) {
  switch (kernel) {
    case DiffKernel::kScalar: return "scalar";
    case DiffKernel::kAvx2: return "avx2";
    case DiffKernel::kAvx512: return "avx512";
  }
  return "unknown";
}

Result<DiffKernel> ParseDiffKernel(std::string_view name) {
  for (DiffKernel kernel : {DiffKernel::kScalar, DiffKernel::kAvx2, DiffKernel::kAvx512}) {
    if (name == DiffKernelName(kernel)) return kernel;
  }
  return Status::InvalidArgument("unknown diff kernel \"" + std::string(name) +
                                 "\" (expected scalar, avx2 or avx512)");
}

std::vector<DiffKernel> AvailableDiffKernels() {
  std::vector<DiffKernel> kernels;
  for (DiffKernel kernel : {DiffKernel::kScalar, DiffKernel::kAvx2, DiffKernel::kAvx512}) {
    if (CpuRuns(kernel)) kernels.push_back(kernel);
  }
  return kernels;
}

DiffKernel BestDiffKernel() {
  static const DiffKernel best = AvailableDiffKernels().back();
  return best;
}

namespace diff_internal {

Status DiffTensorImpl(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                      const DiffOptions& options, bool force_wide, ChangeSet* out) {
  if (out == nullptr) return Status::InvalidArgument("DiffTensor: output ChangeSet is null");
  const uint32_t elem_size = options.elem_size;
  DS_RETURN_IF_ERROR(CheckOperands("DiffTensor", "new tensor", "snapshot", new_bytes.size(),
                                   snapshot.size(), elem_size));
  if (!CpuRuns(options.kernel)) {
    return Status::InvalidArgument("DiffTensor: kernel " +
                                   std::string(DiffKernelName(options.kernel)) +
                                   " is not available on this CPU");
  }
  const size_t bytes = new_bytes.size();
  const auto new_begin = reinterpret_cast<uintptr_t>(new_bytes.data());
  const auto old_begin = reinterpret_cast<uintptr_t>(snapshot.data());
  if (bytes != 0 && new_begin != old_begin && new_begin < old_begin + bytes &&
      old_begin < new_begin + bytes) {
    return Status::InvalidArgument("DiffTensor: new tensor and snapshot partially overlap");
  }

  const uint64_t numel = bytes / elem_size;
  KernelVariant variant;
  variant.elem_size = elem_size;
  variant.refresh = options.refresh_snapshot;
  variant.keep_old = options.keep_old_values;
  variant.wide = force_wide || numel > uint64_t{UINT32_MAX};
  const DiffRangeFn fn = SelectDiffFn(options.kernel, variant);
  if (fn == nullptr) return Status::Internal("DiffTensor: no kernel instantiation");

  out->Clear();
  out->numel = numel;
  out->elem_size = elem_size;
  out->wide = variant.wide;

  // Chunks are whole elements; one chunk unless a pool is given and the
  // tensor is larger than a chunk.
  const size_t chunk_bytes =
      std::max<size_t>(elem_size, options.parallel_chunk_bytes / elem_size * elem_size);
  if (options.pool == nullptr || bytes <= chunk_bytes) {
    if (options.scratch != nullptr) {
      DiffRange(fn, elem_size, new_bytes.data(), snapshot.data(), 0, numel,
                options.scratch->impl()->For(variant), out);
      return Status::OK();
    }
    ChangeBuffer buffer(variant);
    DiffRange(fn, elem_size, new_bytes.data(), snapshot.data(), 0, numel, &buffer, out);
    return Status::OK();
  }
  const size_t chunk_numel = chunk_bytes / elem_size;
  const size_t num_chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
  OrderedAppender appender(variant, num_chunks, out);
  options.pool->ParallelFor(num_chunks, [&](size_t chunk) {
    const uint64_t first = uint64_t{chunk} * chunk_numel;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_numel, numel - first));
    std::unique_ptr<ChangeBuffer> buffer = appender.Acquire();
    DiffRange(fn, elem_size, new_bytes.data(), snapshot.data(), first, n, buffer.get(), nullptr);
    appender.Finish(chunk, std::move(buffer));
  });
  return Status::OK();
}

}  // namespace diff_internal

Status DiffTensor(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                  const DiffOptions& options, ChangeSet* out) {
  return diff_internal::DiffTensorImpl(new_bytes, snapshot, options, /*force_wide=*/false, out);
}

Result<uint64_t> CountChanged(std::span<const uint8_t> a, std::span<const uint8_t> b,
                              uint32_t elem_size) {
  DS_RETURN_IF_ERROR(CheckOperands("CountChanged", "a", "b", a.size(), b.size(), elem_size));
  const CountRangeFn fn = SelectCountFn(BestDiffKernel(), elem_size);
  if (fn == nullptr) return Status::Internal("CountChanged: no kernel instantiation");
  return fn(a.data(), b.data(), a.size() / elem_size);
}

}  // namespace deltasync
