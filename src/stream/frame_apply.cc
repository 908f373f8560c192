// Applying a flush frame's entries in place through a destination map from
// the tensor's flat coordinates (docs/format.md, "Stream: flush frame").
#include "stream/frame.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <numeric>
#include <utility>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/tensor.h"
#include "stream/frame_wire.h"

namespace deltasync::stream {

using namespace frame_wire;  // NOLINT(google-build-using-namespace): the frame's own fields

// ---------------------------------------------------------------------------
// Destinations

DestinationMap DestinationMap::Whole(uint64_t numel) {
  DestinationMap map;
  map.hf_numel_ = numel;
  if (numel > 0) {
    map.runs_.push_back({0, numel, 0, 1});
    map.dest_extent_ = numel;
    map.held_ = numel;
  }
  return map;
}

Result<DestinationMap> DestinationMap::Create(uint64_t hf_numel, std::vector<DestinationRun> runs) {
  if (hf_numel > kMaxStreamNumel) {
    return Status::InvalidArgument("destination map: " + U64(hf_numel) + " elements is past 2^56");
  }
  std::sort(runs.begin(), runs.end(), [](const DestinationRun& x, const DestinationRun& y) {
    return x.hf_first < y.hf_first;
  });
  DestinationMap map;
  map.hf_numel_ = hf_numel;
  uint64_t previous_end = 0;
  for (size_t k = 0; k < runs.size(); ++k) {
    const DestinationRun& r = runs[k];
    const std::string what = "destination map: run [" + U64(r.hf_first) + ", +" + U64(r.count) +
                             ") -> " + U64(r.dest_offset) + " step " + U64(r.dest_stride);
    if (r.count == 0) return Status::InvalidArgument(what + ": no elements");
    if (r.dest_stride == 0) return Status::InvalidArgument(what + ": stride 0");
    if (r.hf_first > hf_numel || r.count > hf_numel - r.hf_first) {
      return Status::InvalidArgument(what + ": outside the tensor's " + U64(hf_numel) +
                                     " elements");
    }
    if (k > 0 && r.hf_first < previous_end) {
      return Status::InvalidArgument(what + ": overlaps the run before it in the tensor");
    }
    uint64_t span = 0, last = 0;
    if (__builtin_mul_overflow(r.count - 1, r.dest_stride, &span) ||
        __builtin_add_overflow(r.dest_offset, span, &last) || last == ~uint64_t{0}) {
      return Status::InvalidArgument(what + ": destination elements past 2^64");
    }
    map.dest_extent_ = std::max(map.dest_extent_, last + 1);
    map.held_ += r.count;
    previous_end = r.hf_first + r.count;
  }
  map.runs_ = std::move(runs);
  return map;
}

Result<DestinationMap> DestinationMap::FromBlock(uint64_t hf_numel, const DigestBlock& block,
                                                 uint64_t dest_offset, uint64_t dest_row_stride) {
  Status valid = block.Validate();
  if (!valid.ok()) return valid.WithContext("destination map");
  if (block.end() > hf_numel) {
    return Status::InvalidArgument("destination map: block " + block.ToString() +
                                   " is outside the tensor's " + U64(hf_numel) + " elements");
  }
  if (block.rows > 1 && dest_row_stride < block.count) {
    return Status::InvalidArgument("destination map: block " + block.ToString() +
                                   ": destination rows of " + U64(dest_row_stride) +
                                   " elements are shorter than the block's " + U64(block.count));
  }
  std::vector<DestinationRun> runs;
  if (block.count == 0) return Create(hf_numel, std::move(runs));
  runs.reserve(block.rows);
  for (uint64_t r = 0; r < block.rows; ++r) {
    uint64_t offset = 0;
    if (__builtin_mul_overflow(r, dest_row_stride, &offset) ||
        __builtin_add_overflow(offset, dest_offset, &offset)) {
      return Status::InvalidArgument("destination map: block " + block.ToString() +
                                     ": destination elements past 2^64");
    }
    runs.push_back({block.first + r * block.row_stride, block.count, offset, 1});
  }
  return Create(hf_numel, std::move(runs));
}

std::optional<DigestBlock> DestinationMap::AsBlock() const {
  // Runs that touch in the tensor are one row.
  std::vector<std::pair<uint64_t, uint64_t>> rows;  // first, count
  for (const DestinationRun& r : runs_) {
    if (!rows.empty() && rows.back().first + rows.back().second == r.hf_first) {
      rows.back().second += r.count;
    } else {
      rows.emplace_back(r.hf_first, r.count);
    }
  }
  if (rows.empty()) return DigestBlock{};
  if (rows.size() == 1) return DigestBlock::Range(rows[0].first, rows[0].second);
  const uint64_t count = rows[0].second, stride = rows[1].first - rows[0].first;
  for (size_t k = 1; k < rows.size(); ++k) {
    if (rows[k].second != count || rows[k].first - rows[k - 1].first != stride) {
      return std::nullopt;
    }
  }
  return DigestBlock{rows[0].first, count, rows.size(), stride};
}

namespace {

// The first run whose end is past `position`.
size_t FirstRunFrom(std::span<const DestinationRun> runs, uint64_t position) {
  auto it = std::upper_bound(runs.begin(), runs.end(), position,
                             [](uint64_t p, const DestinationRun& r) { return p < r.hf_first; });
  if (it != runs.begin() && std::prev(it)->hf_first + std::prev(it)->count > position) --it;
  return static_cast<size_t>(it - runs.begin());
}

template <uint32_t W>
inline void CopyElement(uint8_t* dst, const uint8_t* src) {
  std::memcpy(dst, src, W);
}

template <uint32_t W, bool kDigest>
uint64_t ApplyDense(const FlushEntry& entry, std::span<const DestinationRun> runs, uint8_t* dest,
                    StateDigest* digest) {
  const uint64_t first = entry.first, end = entry.first + entry.count;
  uint64_t written = 0;
  for (size_t r = FirstRunFrom(runs, first); r < runs.size() && runs[r].hf_first < end; ++r) {
    const DestinationRun& run = runs[r];
    const uint64_t lo = std::max(first, run.hf_first);
    const uint64_t hi = std::min(end, run.hf_first + run.count);
    if (lo >= hi) continue;
    const uint8_t* src = entry.values.data() + (lo - first) * W;
    uint8_t* dst = dest + (run.dest_offset + (lo - run.hf_first) * run.dest_stride) * W;
    const uint64_t n = hi - lo;
    if (run.dest_stride == 1) {
      if constexpr (kDigest) {
        // Both spans are valid element runs below 2^56: these cannot fail.
        *digest -= ComputeStateDigest({dst, n * W}, W, lo).value();
        *digest += ComputeStateDigest({src, n * W}, W, lo).value();
      }
      std::memcpy(dst, src, n * W);
    } else {
      const uint64_t step = run.dest_stride * W;
      for (uint64_t k = 0; k < n; ++k, dst += step, src += W) {
        if constexpr (kDigest) {
          *digest += ElementChangeDigest(lo + k, LoadLe<UintOfWidth<W>>(dst),
                                         LoadLe<UintOfWidth<W>>(src), W);
        }
        CopyElement<W>(dst, src);
      }
    }
    written += n;
  }
  return written;
}

// Scattered positions touch a new cache line every few elements, and the
// digest reads each old value before it is overwritten: resolved in batches,
// with each destination prefetched a few slots ahead, the reads overlap
// instead of waiting on memory one at a time.
template <uint32_t W, bool kDigest>
uint64_t ApplyScattered(const FlushEntry& entry, std::span<const DestinationRun> runs,
                        uint8_t* dest, StateDigest* digest) {
  constexpr size_t kBatch = 256, kAhead = 16;
  struct Slot {
    uint64_t position;
    const uint8_t* src;
    uint8_t* dst;
  };
  Slot batch[kBatch];
  size_t fill = 0;
  size_t r = FirstRunFrom(runs, entry.first);
  uint64_t written = 0;
  StateDigest d;
  if constexpr (kDigest) d = *digest;
  const auto drain = [&] {
    for (size_t i = 0; i < fill; ++i) {
      if (i + kAhead < fill) __builtin_prefetch(batch[i + kAhead].dst, 1);
      const Slot& s = batch[i];
      if constexpr (kDigest) {
        d += ElementChangeDigest(s.position, LoadLe<UintOfWidth<W>>(s.dst),
                                 LoadLe<UintOfWidth<W>>(s.src), W);
      }
      CopyElement<W>(s.dst, s.src);
    }
    written += fill;
    fill = 0;
  };
  const uint8_t* values = entry.values.data();
  ForEachPosition(entry, [&](uint64_t k, uint64_t p) {
    while (r < runs.size() && runs[r].hf_first + runs[r].count <= p) ++r;
    if (r == runs.size() || p < runs[r].hf_first) return;  // another receiver's
    const DestinationRun& run = runs[r];
    uint8_t* dst = dest + (run.dest_offset + (p - run.hf_first) * run.dest_stride) * W;
    if (fill < kAhead) __builtin_prefetch(dst, 1);
    batch[fill++] = {p, values + k * W, dst};
    if (fill == kBatch) drain();
  });
  drain();
  if constexpr (kDigest) *digest = d;
  return written;
}

template <uint32_t W>
uint64_t ApplyWidth(const FlushEntry& entry, std::span<const DestinationRun> runs, uint8_t* dest,
                    StateDigest* digest) {
  if (entry.encoding == WireEncoding::kDense) {
    return digest ? ApplyDense<W, true>(entry, runs, dest, digest)
                  : ApplyDense<W, false>(entry, runs, dest, digest);
  }
  return digest ? ApplyScattered<W, true>(entry, runs, dest, digest)
                : ApplyScattered<W, false>(entry, runs, dest, digest);
}

}  // namespace

Result<uint64_t> ApplyEntry(const FlushEntry& entry, const DestinationMap& map,
                            std::span<uint8_t> dest, StateDigest* digest) {
  const uint32_t w = static_cast<uint32_t>(DTypeSize(entry.dtype));
  if (!entry.host_readable) {
    return Status::InvalidArgument("apply: tensor " + Quote(entry.name) +
                                   ": the entry lies in memory the host does not read (a "
                                   "placed frame); apply it where it lies");
  }
  if (map.hf_numel() != entry.numel) {
    return Status::InvalidArgument("apply: tensor " + Quote(entry.name) + " has " +
                                   U64(entry.numel) + " elements, its destination map " +
                                   U64(map.hf_numel()));
  }
  if (dest.size() / w < map.dest_extent()) {
    return Status::InvalidArgument("apply: tensor " + Quote(entry.name) + ": destination of " +
                                   U64(dest.size()) + " bytes, its map needs " +
                                   U64(map.dest_extent()) + " elements of " + U64(w));
  }
  switch (w) {
    case 1: return ApplyWidth<1>(entry, map.runs(), dest.data(), digest);
    case 2: return ApplyWidth<2>(entry, map.runs(), dest.data(), digest);
    case 4: return ApplyWidth<4>(entry, map.runs(), dest.data(), digest);
    default: return ApplyWidth<8>(entry, map.runs(), dest.data(), digest);
  }
}

namespace {

// An entry's fixed cost (finding its run, its checks, the call), counted
// as this many bytes of its regions when tasks are balanced.
constexpr uint64_t kEntryCostBytes = 256;
// Tasks per thread: the threads take them as they finish the last, so the
// one left working at the end has at most one small task to go; and the
// least a task carries, so that a small frame is not cut into tasks that
// cost less than handing them out.
constexpr uint64_t kTasksPerThread = 32;
constexpr uint64_t kMinTaskBytes = uint64_t{16} << 10;

uint64_t EntryCost(const FlushEntry& e) {
  return e.positions.size() + e.values.size() + kEntryCostBytes;
}

}  // namespace

AppliedEntries ApplyEntries(std::span<const FlushEntry> entries,
                            std::span<const EntryDestination> dests, ThreadPool* pool,
                            std::vector<StateDigest>* moves) {
  const size_t n = entries.size();
  AppliedEntries out;
  if (dests.size() != n) {
    out.failed = Status::InvalidArgument("apply: " + U64(dests.size()) + " destinations for " +
                                         U64(n) + " entries");
    return out;
  }
  if (moves != nullptr) moves->assign(n, StateDigest{});
  // The entries in the order of the memory they write (where each starts):
  // a frame lists a sender's tensors by name, which is not how a
  // receiver's small tensors lie, and a walk forwards through memory costs
  // less than one that jumps about. Entries write distinct elements, so
  // the order changes nothing but the time.
  std::vector<std::pair<uintptr_t, size_t>> order(n);
  for (size_t k = 0; k < n; ++k) {
    order[k] = {reinterpret_cast<uintptr_t>(dests[k].dest.data()) +
                    entries[k].first * DTypeSize(entries[k].dtype),
                k};
  }
  if (!std::is_sorted(order.begin(), order.end())) std::sort(order.begin(), order.end());
  const size_t threads = pool == nullptr ? 1 : pool->size() + 1;
  uint64_t target = ~uint64_t{0};
  if (threads > 1 && n > 0) {
    uint64_t total = 0;
    for (const FlushEntry& e : entries) total += EntryCost(e);
    target = std::max(kMinTaskBytes, total / (threads * kTasksPerThread));
  }
  // What is applied, in memory order: whole entries, and a dense entry
  // larger than a task in pieces of about a task's bytes (a seed's or a
  // dense range's frame is one or a few large entries, which would
  // otherwise each be copied on one thread). A piece is the entry over a
  // sub-range of its elements; digest moves of disjoint ranges add up.
  struct Piece {
    size_t k = 0;
    uint64_t first = 0, count = 0;  // of the entry's elements; count 0: whole
  };
  std::vector<Piece> pieces;
  pieces.reserve(n);
  for (const auto& [at, k] : order) {
    const FlushEntry& e = entries[k];
    const uint64_t w = DTypeSize(e.dtype);
    const uint64_t bytes = e.count * w;
    if (e.encoding != WireEncoding::kDense || !e.host_readable || bytes <= 2 * target ||
        e.values.size() != bytes) {
      pieces.push_back({k, 0, 0});
      continue;
    }
    const uint64_t step = std::max<uint64_t>(1, target / w);
    for (uint64_t lo = 0; lo < e.count; lo += step) {
      pieces.push_back({k, e.first + lo, std::min(step, e.count - lo)});
    }
  }
  // Each piece's elements written and digest move; a task's first failure
  // (by entry index, n when none) and its error. Every entry is tried: one
  // that fails writes nothing (a piece fails on the entry's own checks,
  // before it writes, so all of an entry's pieces fail alike), and the
  // caller learns of the first in the frame.
  std::vector<uint64_t> written(pieces.size(), 0);
  std::vector<StateDigest> piece_moves(moves != nullptr ? pieces.size() : 0);
  struct Task {
    size_t begin = 0, end = 0;  // in `pieces`
    size_t failed_at = 0;
    Status status;
  };
  const auto run = [&](Task& t) {
    t.failed_at = n;
    for (size_t i = t.begin; i < t.end; ++i) {
      const Piece& piece = pieces[i];
      const FlushEntry& whole = entries[piece.k];
      FlushEntry part;
      const FlushEntry* e = &whole;
      if (piece.count > 0) {
        const uint64_t w = DTypeSize(whole.dtype);
        part = whole;
        part.first = piece.first;
        part.count = piece.count;
        part.value_count = piece.count;
        part.values = whole.values.subspan((piece.first - whole.first) * w, piece.count * w);
        e = &part;
      }
      StateDigest* move = moves != nullptr ? &piece_moves[i] : nullptr;
      Result<uint64_t> w = ApplyEntry(*e, *dests[piece.k].map, dests[piece.k].dest, move);
      if (w.ok()) {
        written[i] = *w;
      } else if (piece.k < t.failed_at) {
        t.failed_at = piece.k;
        t.status = w.status();
      }
    }
  };
  std::vector<Task> tasks;
  const auto add_task = [&](size_t begin, size_t end) {
    tasks.emplace_back();
    tasks.back().begin = begin;
    tasks.back().end = end;
  };
  if (threads == 1 || pieces.size() <= 1) {
    add_task(0, pieces.size());
  } else {
    uint64_t filled = 0;
    size_t begin = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& piece = pieces[i];
      filled += piece.count > 0 ? piece.count * DTypeSize(entries[piece.k].dtype) + kEntryCostBytes
                                : EntryCost(entries[piece.k]);
      if (filled >= target || i + 1 == pieces.size()) {
        add_task(begin, i + 1);
        begin = i + 1;
        filled = 0;
      }
    }
  }
  if (tasks.size() == 1) {
    run(tasks[0]);
  } else {
    pool->ParallelFor(tasks.size(), [&](size_t i) { run(tasks[i]); });
  }
  out.applied = n;
  for (Task& t : tasks) {
    if (t.failed_at < out.applied) {
      out.applied = t.failed_at;
      out.failed = std::move(t.status);
    }
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const size_t k = pieces[i].k;
    if (moves != nullptr) (*moves)[k] += piece_moves[i];
    if (k < out.applied) out.written += written[i];
  }
  return out;
}

Result<StateDigest> DigestDestination(const DestinationMap& map, std::span<const uint8_t> dest,
                                      uint32_t elem_size, const DigestOptions& options) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
    return Status::InvalidArgument("destination digest: element size " + U64(elem_size) +
                                   " is not 1, 2, 4 or 8");
  }
  if (dest.size() / elem_size < map.dest_extent()) {
    return Status::InvalidArgument("destination digest: destination of " + U64(dest.size()) +
                                   " bytes, its map needs " + U64(map.dest_extent()) +
                                   " elements of " + U64(elem_size));
  }
  StateDigest d;
  for (const DestinationRun& run : map.runs()) {
    const std::span<const uint8_t> from = dest.subspan(run.dest_offset * elem_size);
    if (run.dest_stride == 1) {
      DS_ASSIGN_OR_RETURN(StateDigest part, ComputeStateDigest(from.first(run.count * elem_size),
                                                               elem_size, run.hf_first, options));
      d += part;
    } else {
      DS_ASSIGN_OR_RETURN(StateDigest part, ComputeStridedStateDigest(from, elem_size, run.hf_first,
                                                                      run.count, run.dest_stride));
      d += part;
    }
  }
  return d;
}

}  // namespace deltasync::stream
