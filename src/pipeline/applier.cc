#include "pipeline/applier.h"

#include <algorithm>
#include <utility>

#include "io/mapping.h"
#include "pipeline/scatter.h"

namespace deltasync::pipeline {

// Per-task decode state, reused from tensor to tensor (see FreeList).
struct Applier::Scratch {
  static constexpr size_t kNoLane = static_cast<size_t>(-1);
  size_t lane = kNoLane;
  ChangeSet changes;
};

Applier::Applier(const ApplierOptions& options)
    : options_(options),
      pool_(options.pool ? options.pool : &ThreadPool::Default()),
      scratch_(std::make_unique<core_internal::FreeList<Scratch>>()) {}

Applier::~Applier() = default;

Status Applier::Run(std::span<const ApplyTensor> tensors, EncodingSource* source,
                    ApplyObserver* observer, std::vector<ApplyOutcome>* outcomes) {
  const size_t n = tensors.size();
  outcomes->assign(n, ApplyOutcome());
  ApplyObserver none;
  if (observer == nullptr) observer = &none;
  const ApplierOptions& opt = options_;
  const bool write = opt.mode == ApplyMode::kApply;
  core_internal::FirstError error;

  auto process = [&](size_t j) {
    if (error.failed()) return;
    const ApplyTensor& t = tensors[j];
    ApplyOutcome& outcome = (*outcomes)[j];
    std::unique_ptr<Scratch> scratch = scratch_->Take();
    if (scratch->lane == Scratch::kNoLane) scratch->lane = lanes_.fetch_add(1);
    const size_t lane = scratch->lane;
    observer->Begin(lane, j);
    Result<std::span<const uint8_t>> encoded = source->EncodingOf(j);
    if (!encoded.ok()) {
      scratch_->Give(std::move(scratch));
      error.Note(encoded.status().WithContext(t.what));
      return;
    }
    const uint32_t es = t.elem_size;
    std::unique_ptr<Hasher> hasher;
    if (write) {
      // No encoding spends less than a byte on four changes.
      if (opt.prefault_targets) io::PrefaultForWrite(t.target, encoded->size() / 4);
      if (!t.digest.empty()) hasher = NewHasher(t.algo);
    }
    size_t hashed = 0;  // bytes of the target that are final (and hashed)
    uint64_t changed = 0;
    Status applied;
    auto take_run = [&](const ChangeSet& run) {
      if (!applied.ok()) return;
      applied = observer->Changes(lane, j, run);
      if (!write) {
        changed += run.count();
        return;
      }
      if (!applied.ok() || run.count() == 0) return;
      // Later runs change only later elements: up to this run's last
      // change the target is final.
      const size_t end = static_cast<size_t>(run.position(run.count() - 1) + 1) * es;
      applied = ScatterNewValuesAndVisit(run, t.target, hashed, end, opt.hash_piece_bytes,
                                         [&](std::span<const uint8_t> piece) {
                                           if (hasher) hasher->Update(piece);
                                         });
      if (!applied.ok()) return;
      changed += run.count();
      hashed = end;
      observer->Written(lane, j, run);
    };
    DecodeOptions decode;
    decode.on_changes = take_run;
    decode.max_chunk_changes = opt.run_changes;
    Status s =
        GetCodec(t.encoding).DecodeChanges(*encoded, t.target, es, decode, &scratch->changes);
    if (s.ok()) {
      take_run(scratch->changes);  // the last run of the tensor (maybe empty)
      s = applied;
    }
    if (s.ok()) observer->Done(lane, j);
    scratch_->Give(std::move(scratch));
    if (!s.ok()) {
      error.Note(s.WithContext(t.what));
      return;
    }
    outcome.done = true;
    outcome.changed_elements = changed;
    if (hasher) {
      hasher->Update(std::span<const uint8_t>(t.target).subspan(hashed));
      outcome.mismatch = hasher->HexDigest() != t.digest;
    }
  };

  // Largest first: tasks are handed out in order, so big tensors must not
  // start last and leave the other threads idle.
  std::vector<size_t> order(n);
  for (size_t k = 0; k < n; ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].target.size() > tensors[b].target.size();
  });
  pool_->ParallelFor(n, [&](size_t k) { process(order[k]); });
  return error.status();
}

}  // namespace deltasync::pipeline
