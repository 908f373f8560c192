#include "pipeline/producer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "io/mapping.h"

namespace deltasync::pipeline {

// What one task reuses from tensor to tensor. Large fresh allocations cost
// a page fault and a page clear per 4 KiB, as much as the diff itself at
// typical densities, so these stay mapped for the whole run.
struct Producer::Scratch {
  static constexpr size_t kNoLane = static_cast<size_t>(-1);
  size_t lane = kNoLane;
  ChangeSet changes;             // the tensor's (moved out when kept as an undo log)
  ChangeSet piece;               // one chunk's
  std::vector<uint8_t> encoded;  // the tensor's encoding, until handed over
  std::array<std::unique_ptr<Hasher>, kMaxDigests> base_hashers;
  std::array<std::unique_ptr<Hasher>, kMaxDigests> new_hashers;
};

namespace {

// The hasher for `algo` in `slot`, made on first use and reset.
Hasher* FreshHasher(ChecksumAlgo algo, std::unique_ptr<Hasher>* slot) {
  if (*slot == nullptr || (*slot)->algo() != algo) {
    *slot = NewHasher(algo);
  } else {
    (*slot)->Reset();
  }
  return slot->get();
}

}  // namespace

Producer::Producer(const ProducerOptions& options)
    : options_(options),
      pool_(options.pool ? options.pool : &ThreadPool::Default()),
      codec_(GetCodec(options.encoding)),
      scratch_(std::make_unique<core_internal::FreeList<Scratch>>()) {}

Producer::~Producer() = default;

Status Producer::Run(std::span<const ProduceTensor> tensors, EncodingSink* sink,
                     std::vector<TensorDelta>* deltas) {
  const size_t n = tensors.size();
  deltas->assign(n, TensorDelta());
  std::atomic<uint64_t> undo_bytes{0};
  core_internal::FirstError error;
  const ProducerOptions& opt = options_;
  const Codec& codec = codec_;

  auto process = [&](size_t i) {
    if (error.failed()) return;
    const ProduceTensor& t = tensors[i];
    TensorDelta& out = (*deltas)[i];
    std::unique_ptr<Scratch> scratch = scratch_->Take();
    if (scratch->lane == Scratch::kNoLane) scratch->lane = lanes_.fetch_add(1);
    ChangeSet& changes = scratch->changes;
    DiffOptions diff;
    diff.elem_size = t.elem_size;
    diff.refresh_snapshot =
        opt.refresh && undo_bytes.load(std::memory_order_relaxed) < opt.undo_budget_bytes;
    // Old values serve the encoding and, once refreshed, the undo log.
    diff.keep_old_values = diff.refresh_snapshot || codec.needs_old_values();
    diff.pool = nullptr;
    Hasher* base_hashers[kMaxDigests];
    Hasher* new_hashers[kMaxDigests];
    for (size_t k = 0; k < t.base_digests.count; ++k) {
      base_hashers[k] = FreshHasher(t.base_digests.algo[k], &scratch->base_hashers[k]);
    }
    for (size_t k = 0; k < t.new_digests.count; ++k) {
      new_hashers[k] = FreshHasher(t.new_digests.algo[k], &scratch->new_hashers[k]);
    }
    const uint64_t numel = t.elem_size == 0 ? 0 : t.snapshot.size() / t.elem_size;
    // Encodings that stream take each chunk's changes as the pass finds them,
    // so the tensor's whole change list is never held; the undo log of a
    // refreshed tensor keeps only positions and old values.
    std::vector<uint8_t>& encoded = scratch->encoded;
    encoded.clear();
    std::unique_ptr<EncodeStream> stream =
        codec.NewEncodeStream(numel, t.elem_size, opt.encode, &encoded);
    uint64_t count = 0;
    changes.Clear();
    changes.numel = numel;
    changes.elem_size = t.elem_size;
    changes.wide = numel > uint64_t{UINT32_MAX};
    auto chunk_sink = [&](uint64_t first, std::span<const uint8_t> new_chunk,
                          const ChangeSet& piece) {
      count += piece.count();
      // Recorded first: the chunk is already refreshed, whatever the stream says.
      if (diff.refresh_snapshot || !stream) {
        AppendShifted(piece, first, /*with_new_values=*/!stream, &changes);
      }
      return stream ? stream->Add(first, new_chunk, piece) : Status::OK();
    };
    // Mapped in one call each rather than a fault at a time as the pass
    // reads them (only a page-table walk for memory already mapped).
    io::PrefaultForRead(t.new_bytes);
    if (opt.prefault_snapshot) io::PrefaultForRead(t.snapshot);
    // One pass computes the base digests (of the bytes before the refresh),
    // the diff and the new digests.
    Status s = DiffAndHashInChunks(t.new_bytes, t.snapshot, diff, opt.chunk_bytes,
                                   {base_hashers, t.base_digests.count},
                                   {new_hashers, t.new_digests.count}, &scratch->piece, chunk_sink);
    out.refreshed = diff.refresh_snapshot;
    if (s.ok()) {
      out.diffed = true;
      for (size_t k = 0; k < t.base_digests.count; ++k) {
        out.base_digests[k] = base_hashers[k]->HexDigest();
      }
      for (size_t k = 0; k < t.new_digests.count; ++k) {
        out.new_digests[k] = new_hashers[k]->HexDigest();
      }
      if (count > 0) {
        out.changed = true;
        out.changed_elements = count;
        s = stream ? stream->Finish() : codec.Encode(t.new_bytes, changes, opt.encode, &encoded);
        if (!s.ok()) s = s.WithContext("encoding tensor '" + std::string(t.name) + "'");
      }
    } else {
      s = s.WithContext("tensor '" + std::string(t.name) + "'");
    }
    stream.reset();
    if (s.ok() && out.changed) {
      out.encoded_bytes = encoded.size();
      s = sink->Put(scratch->lane, i, out, encoded);
    }
    error.Note(std::move(s));
    // Kept even on failure: a refreshed snapshot must be restorable.
    if (out.refreshed && changes.count() > 0) {
      std::vector<uint8_t>().swap(changes.new_values);
      undo_bytes.fetch_add(changes.count() * (changes.wide ? 8 : 4) + changes.old_values.size(),
                           std::memory_order_relaxed);
      out.undo = std::move(changes);
      changes = ChangeSet();
    }
    scratch_->Give(std::move(scratch));
  };

  // Largest tensors first, so that a big one does not start last and leave
  // the other threads idle.
  std::vector<size_t> order(n);
  for (size_t k = 0; k < n; ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].snapshot.size() > tensors[b].snapshot.size();
  });
  pool_->ParallelFor(n, [&](size_t k) { process(order[k]); });
  return error.status();
}

void UndoRefresh(const ChangeSet& undo, std::span<uint8_t> snapshot) {
  const uint32_t es = undo.elem_size;
  uint8_t* dst = snapshot.data();
  for (uint64_t k = 0; k < undo.count(); ++k) {
    std::memcpy(dst + undo.position(k) * es, undo.old_values.data() + k * es, es);
  }
}

}  // namespace deltasync::pipeline
