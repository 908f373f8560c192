// The stream's sender, a host tensor's delta (sender.h, StreamHostUnits):
// its units diffed against the snapshot a window at a time on the sender's
// threads, so that a sync pays one parallel pass per window rather than
// one per unit. The pass diffs every piece of the window, moves the held
// blocks' digests by its changes and keeps its positions and values while
// they fit half a bucket; the units that go by positions then have them
// staged, a unit's pieces side by side (a piece not kept is diffed again),
// half a bucket at a time, and the units are added to the frames in order
// as StreamUnits does. The staged positions of a sparse enough unit also
// go to the commit log (LEB128 gaps, half a bucket in all): the commit then
// copies its changed elements alone, not the whole unit.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/endian.h"
#include "core/parallel.h"
#include "deltasync/diff.h"
#include "deltasync/timing.h"
#include "stream/sender.h"

namespace deltasync {

namespace stream_sender {

namespace {

// A piece of a unit: elements [first, first + count) of the tensor.
struct Piece {
  uint64_t unit;
  uint64_t first;
  uint64_t count;
};

// Writes the piece's changes `cs` as positions from its unit's first
// element (the piece starts `from_unit` elements in) and new values.
void StageChanges(const ChangeSet& cs, uint32_t from_unit, uint32_t elem_size, uint32_t* positions,
                  uint8_t* values) {
  for (uint64_t k = 0; k < cs.count(); ++k) {
    positions[k] = from_unit + static_cast<uint32_t>(cs.position(k));
  }
  if (cs.count() != 0) std::memcpy(values, cs.new_values.data(), cs.count() * elem_size);
}

// The bytes a ChangeSet's vectors hold.
uint64_t Held(const ChangeSet& c) {
  return c.pos32.capacity() * 4 + c.pos64.capacity() * 8 + c.new_values.capacity() +
         c.old_values.capacity();
}

// Runs task(piece index, changes, scratch) for every piece on the pool (or
// inline), each thread with a ChangeSet and a diff scratch of its own,
// taken from `scratch` and given back; the first error wins. *held: the
// most those held, all threads together.
template <typename Task>
Status RunPieces(ThreadPool* pool, core_internal::FreeList<PieceScratch>* scratch, size_t pieces,
                 uint64_t* held, Task&& task) {
  core_internal::FirstError error;
  const size_t tasks = pool == nullptr ? 1 : std::min(pieces, pool->size() + 1);
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> bytes{0};
  const auto run = [&](size_t) {
    std::unique_ptr<PieceScratch> s = scratch->Take();
    for (size_t i; (i = next.fetch_add(1)) < pieces;) {
      if (error.failed()) break;
      error.Note(task(i, s->changes, s->scratch));
    }
    bytes.fetch_add(Held(s->changes) + s->scratch.bytes());
    scratch->Give(std::move(s));
  };
  if (pool == nullptr || tasks <= 1) {
    run(0);
  } else {
    pool->ParallelFor(tasks, run);
  }
  *held = std::max(*held, bytes.load());
  return error.status();
}

}  // namespace

uint64_t LoggedBytes(const uint32_t* positions, uint64_t n) {
  uint64_t bytes = 0;
  uint32_t prev = 0;
  for (uint64_t k = 0; k < n; ++k) {
    const uint32_t gap = positions[k] - prev;
    prev = positions[k];
    bytes +=
        1 + (gap >= (1u << 7)) + (gap >= (1u << 14)) + (gap >= (1u << 21)) + (gap >= (1u << 28));
  }
  return bytes;
}

uint64_t LogPositions(const uint32_t* positions, uint64_t n, uint8_t* out) {
  uint8_t* o = out;
  uint32_t prev = 0;
  for (uint64_t k = 0; k < n; ++k) {
    uint32_t gap = positions[k] - prev;
    prev = positions[k];
    while (gap >= 0x80) {
      *o++ = static_cast<uint8_t>(gap | 0x80);
      gap >>= 7;
    }
    *o++ = static_cast<uint8_t>(gap);
  }
  return static_cast<uint64_t>(o - out);
}

void CopyLogged(const LoggedRun& r, uint32_t w, const uint8_t* log, const uint8_t* x,
                uint8_t* snapshot) {
  const uint8_t* in = log + r.at;
  uint64_t p = r.first;
  for (uint64_t k = 0; k < r.n; ++k) {
    uint64_t gap = 0;
    for (int shift = 0;; shift += 7) {
      const uint8_t b = *in++;
      gap |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (b < 0x80) break;
    }
    p += gap;
    std::memcpy(snapshot + p * w, x + p * w, w);
  }
}

// A changed element copied on its own into the snapshot costs about what
// a copy of this many bytes of a whole unit does: on the 2-core
// development machine one thread scattered 2.28 M two-byte changes (1.7%
// of 256 MiB, LEB128-coded positions) in 34 ms, 15 ns each, where memcpy
// moved the 256 MiB in 17-22 ms, 0.063-0.082 ns a byte; a plain scatter
// from 8-byte positions took 11-12 ns a change. Both are memory bound:
// a 1.7% change of two-byte elements touches 42% of the cache lines.
// So the commit logs a unit's changes below about 1 in 128 two-byte
// elements (1 in 64 four-byte ones) and copies denser units whole.
constexpr uint64_t kScatteredChangeBytes = 256;

// One change in this many elements or more: a piece's digest move is
// computed from both states whole (0.55 ns an element for the two, against
// 5.2 ns a change for the update, measured on an AVX-512 host).
constexpr uint64_t kWholeDigestDensity = 8;

Status Sender::EncodeSparse(const TensorState& t, ThreadPool* pool, std::span<const size_t> which,
                            std::vector<UnitOut>* units, SyncStats* stats) {
  if (which.empty()) return Status::OK();
  const auto t0 = Clock::now();
  if (sparse_regions_.size() < which.size()) sparse_regions_.resize(which.size());
  core_internal::FirstError error;
  const auto encode = [&](size_t j) {
    if (error.failed()) return;
    std::unique_ptr<stream::SparseEncoder> encoder = sparse_encoders_.Take();
    UnitOut& c = (*units)[which[j]];
    const TensorRange range{t.name, t.dtype, t.shape, c.first, c.count};
    error.Note(encoder->Encode(range, c.pos, c.values, options_.zstd_level,
                               stream::kMaxSparseDecodedBytes, &sparse_regions_[j]));
    c.sparse = &sparse_regions_[j];
    sparse_encoders_.Give(std::move(encoder));
  };
  if (pool != nullptr && which.size() > 1) {
    pool->ParallelFor(which.size(), encode);
  } else {
    for (size_t j = 0; j < which.size(); ++j) encode(j);
  }
  stats->encode_s += SecondsSince(t0);
  return error.status();
}

Status Sender::StreamHostUnits(TensorState& t, const UnitSource& src, Round* round, TensorRound* tr,
                               uint64_t u_begin, uint64_t u_end) {
  SyncStats* stats = &round->stats;
  ThreadPool* pool = Pool();
  const std::span<const uint8_t> x = src.host_current;
  const std::span<uint8_t> snap = src.host_snapshot;
  if (x.size() != t.numel * t.w || snap.size() != x.size()) {
    return Status::Internal("tensor '" + t.name + "': host views of the wrong size");
  }
  DiffOptions options = diff_;
  options.refresh_snapshot = false;
  options.pool = nullptr;
  options.elem_size = t.w;
  // The blocks whose digest moves by the changes (the others are computed
  // whole from the dense values).
  struct Moved {
    DigestBlock block;
    bool covers;
    StateDigest* digest;
  };
  std::vector<Moved> moved;
  std::vector<std::pair<BlockKey, StateDigest*>> whole;
  for (auto& [key, d] : tr->delta) {
    if (tr->whole.count(key)) {
      whole.push_back({key, &d});
    } else {
      moved.push_back({BlockOf(key), Covers(BlockOf(key), t.numel), &d});
    }
  }
  bool any_delta = false;  // a group takes this tensor's changes
  for (const std::unique_ptr<Group>& g : round->groups) {
    any_delta = any_delta || (!g->seed && g->holds.count(t.name));
  }
  // A piece's changes, kept from the pass: positions from its unit's first
  // element, and new values.
  struct Kept {
    bool kept = false;
    std::vector<uint32_t> positions;
    std::vector<uint8_t> values;
  };
  const uint64_t half_bucket = options_.bucket_bytes / 2;
  // Whether a piece of `count` elements, `n` changed, looks like part of a
  // unit that goes by positions (EncodingOf's rule on the piece alone).
  const auto likely_by_positions = [&](uint64_t count, uint64_t n) {
    if (options_.encoding == StreamEncoding::kDense) return false;
    return !DenseIsCheaper(t, count, n);
  };
  const uint64_t change_bytes = 4 + t.w;  // a staged or kept change
  const uint64_t piece_numel = std::max<uint64_t>(1, kParallelDiffBytes / t.w);
  const uint64_t window_units = std::max<uint64_t>(1, kHostWindowBytes / (t.unit * t.w));
  std::vector<Piece> pieces;
  std::vector<size_t> unit_pieces;  // the window's units' first piece, and the end
  std::vector<uint64_t> counts;     // per piece
  std::vector<StateDigest> parts;   // per piece and moved block
  std::vector<Kept> kept;           // per piece
  std::vector<UnitOut> units;
  std::vector<uint64_t> at;    // per piece: its first staged change
  std::vector<uint64_t> from;  // per unit: its first staged change
  constexpr uint64_t kNotStaged = UINT64_MAX;
  std::vector<size_t> wanted;                   // pieces to stage
  std::vector<size_t> sparse_units;             // staged units that go sparse
  std::vector<std::vector<uint8_t>> piece_log;  // per piece: its logged positions
  // Whether the commit copies a unit's changes faster one by one than the
  // whole unit (kScatteredChangeBytes).
  const auto worth_logging = [&](const UnitOut& c) {
    return c.n * kScatteredChangeBytes < c.count * t.w;
  };
  uint64_t w0 = u_begin;
  // How far into its unit a piece of the current window starts.
  const auto from_unit = [&](const Piece& pc) {
    return static_cast<uint32_t>(pc.first - units[pc.unit - w0].first);
  };
  while (w0 < u_end) {
    const uint64_t w1 = std::min(u_end, w0 + window_units);
    pieces.clear();
    unit_pieces.clear();
    units.clear();
    for (uint64_t u = w0; u < w1; ++u) {
      UnitOut c;
      c.first = u * t.unit;
      c.count = std::min(t.unit, t.numel - c.first);
      c.resend = t.dirty[u] != 0;
      units.push_back(c);
      unit_pieces.push_back(pieces.size());
      for (uint64_t p = 0; p < c.count; p += piece_numel) {
        pieces.push_back({u, c.first + p, std::min(piece_numel, c.count - p)});
      }
    }
    unit_pieces.push_back(pieces.size());
    // The pass: each piece's changes counted, each moved block's digest
    // moved by them, and kept while half a bucket holds them.
    const auto t0 = Clock::now();
    counts.assign(pieces.size(), 0);
    parts.assign(pieces.size() * moved.size(), StateDigest{});
    kept.clear();
    kept.resize(pieces.size());
    std::atomic<uint64_t> kept_bytes{0};
    DS_RETURN_IF_ERROR(RunPieces(
        pool, &piece_scratch_, pieces.size(), &host_scratch_peak_,
        [&](size_t i, ChangeSet& cs, DiffScratch& scratch) -> Status {
          const Piece& pc = pieces[i];
          DiffOptions o = options;
          o.keep_old_values = !moved.empty();
          o.scratch = &scratch;
          DS_RETURN_IF_ERROR(DiffTensor(x.subspan(pc.first * t.w, pc.count * t.w),
                                        snap.subspan(pc.first * t.w, pc.count * t.w), o, &cs));
          const uint64_t n = cs.count();
          counts[i] = n;
          if (n == 0) return Status::OK();
          const Positions pos = Positions::Of(cs, pc.first);
          // A dense piece's digest moves by the whole piece's digest, now
          // less then: two vector passes cost less than a scalar update
          // per change from about one change in kWholeDigestDensity.
          std::optional<StateDigest> whole_move;
          if (n * kWholeDigestDensity >= pc.count) {
            const auto bytes = [&](std::span<const uint8_t> of) {
              return of.subspan(pc.first * t.w, pc.count * t.w);
            };
            DS_ASSIGN_OR_RETURN(StateDigest now,
                                stream::ComputeStateDigest(bytes(x), t.w, pc.first));
            DS_ASSIGN_OR_RETURN(StateDigest then,
                                stream::ComputeStateDigest(bytes(snap), t.w, pc.first));
            whole_move = now - then;
          }
          for (size_t k = 0; k < moved.size(); ++k) {
            StateDigest& d = parts[i * moved.size() + k];
            if (moved[k].covers && whole_move) {
              d += *whole_move;
              continue;
            }
            if (moved[k].covers) {
              DS_RETURN_IF_ERROR(
                  stream::UpdateStateDigest(&d, pos, cs.old_values, cs.new_values, t.w));
              continue;
            }
            for (uint64_t j = 0; j < n; ++j) {
              const uint64_t p = pos[j];
              if (!InBlock(moved[k].block, p)) continue;
              d += stream::ElementChangeDigest(p, LoadLeWidth(cs.old_values.data() + j * t.w, t.w),
                                               LoadLeWidth(cs.new_values.data() + j * t.w, t.w),
                                               t.w);
            }
          }
          // Kept only for a unit that will likely go by positions: dense
          // ones take their values from the tensor.
          if (!any_delta || !likely_by_positions(pc.count, n)) return Status::OK();
          const uint64_t bytes = n * change_bytes;
          if (kept_bytes.fetch_add(bytes) + bytes > half_bucket) {
            kept_bytes.fetch_sub(bytes);
            return Status::OK();
          }
          Kept& kp = kept[i];
          kp.positions.resize(n);
          kp.values.resize(n * t.w);
          StageChanges(cs, from_unit(pc), t.w, kp.positions.data(), kp.values.data());
          kp.kept = true;
          return Status::OK();
        }));
    host_kept_peak_ = std::max(host_kept_peak_, kept_bytes.load());
    for (size_t i = 0; i < pieces.size(); ++i) {
      units[pieces[i].unit - w0].n += counts[i];
      for (size_t k = 0; k < moved.size(); ++k) *moved[k].digest += parts[i * moved.size() + k];
    }
    for (UnitOut& c : units) {
      stats->changed += c.n;
      if (c.resend || c.n > 0) t.changed[c.first / t.unit] = 1;
    }
    stats->diff_s += SecondsSince(t0);
    // Half a bucket of staged changes at a time: the positions and values
    // of the units that go by positions, then every unit of the run
    // emitted in order.
    for (uint64_t v0 = w0; v0 < w1;) {
      const auto t1 = Clock::now();
      uint64_t staged = 0;
      uint64_t v1 = v0;
      wanted.clear();
      at.assign(pieces.size(), 0);
      from.assign(units.size(), kNotStaged);
      for (; v1 < w1; ++v1) {
        const UnitOut& c = units[v1 - w0];
        const bool by_positions =
            any_delta && !c.resend && c.n > 0 &&
            EncodingOf(t, src, c.first, c.count, c.n) != StreamEncoding::kDense;
        if (!by_positions) continue;
        if (staged > 0 && (staged + c.n) * change_bytes > half_bucket) break;
        from[v1 - w0] = staged;
        for (size_t i = unit_pieces[v1 - w0]; i < unit_pieces[v1 - w0 + 1]; ++i) {
          at[i] = staged;
          staged += counts[i];
          if (counts[i] > 0) wanted.push_back(i);
        }
      }
      staged_positions_.resize(staged);
      staged_values_.resize(staged * t.w);
      // A staged piece's positions logged for the commit while the log
      // has room (a unit is logged only with all its pieces).
      piece_log.assign(pieces.size(), {});
      const uint64_t log_room =
          half_bucket > commit_log_.size() ? half_bucket - commit_log_.size() : 0;
      std::atomic<uint64_t> log_bytes{0};
      const auto log_piece = [&](size_t i, const uint32_t* positions) {
        if (log_room == 0 || !worth_logging(units[pieces[i].unit - w0])) return;
        const uint64_t bytes = LoggedBytes(positions, counts[i]);
        if (log_bytes.fetch_add(bytes) + bytes > log_room) {
          log_bytes.fetch_sub(bytes);
          return;
        }
        piece_log[i].resize(bytes);
        LogPositions(positions, counts[i], piece_log[i].data());
      };
      DS_RETURN_IF_ERROR(RunPieces(
          pool, &piece_scratch_, wanted.size(), &host_scratch_peak_,
          [&](size_t j, ChangeSet& cs, DiffScratch& scratch) -> Status {
            const size_t i = wanted[j];
            const Piece& pc = pieces[i];
            uint32_t* positions = staged_positions_.data() + at[i];
            uint8_t* values = staged_values_.data() + at[i] * t.w;
            if (kept[i].kept) {
              std::memcpy(positions, kept[i].positions.data(), counts[i] * sizeof(uint32_t));
              std::memcpy(values, kept[i].values.data(), counts[i] * t.w);
              kept[i] = Kept{};
              log_piece(i, positions);
              return Status::OK();
            }
            DiffOptions o = options;
            o.keep_old_values = false;
            o.scratch = &scratch;
            DS_RETURN_IF_ERROR(DiffTensor(x.subspan(pc.first * t.w, pc.count * t.w),
                                          snap.subspan(pc.first * t.w, pc.count * t.w), o, &cs));
            if (cs.count() != counts[i]) {
              return Status::FailedPrecondition(
                  "tensor '" + t.name + "' changed while it was being synced (elements " +
                  std::to_string(pc.first) + " to " + std::to_string(pc.first + pc.count) + ")");
            }
            StageChanges(cs, from_unit(pc), t.w, positions, values);
            log_piece(i, positions);
            return Status::OK();
          }));
      for (uint64_t v = v0; v < v1; ++v) {
        const UnitOut& c = units[v - w0];
        if (from[v - w0] == kNotStaged || !worth_logging(c)) continue;
        bool all = true;
        for (size_t i = unit_pieces[v - w0]; i < unit_pieces[v - w0 + 1]; ++i) {
          all = all && (counts[i] == 0 || !piece_log[i].empty());
        }
        if (!all) continue;
        for (size_t i = unit_pieces[v - w0]; i < unit_pieces[v - w0 + 1]; ++i) {
          if (counts[i] == 0) continue;
          t.logged.push_back({c.first, counts[i], commit_log_.size()});
          commit_log_.insert(commit_log_.end(), piece_log[i].begin(), piece_log[i].end());
        }
        t.changed[v] = kUnitLogged;
      }
      stats->diff_s += SecondsSince(t1);
      sparse_units.clear();
      for (uint64_t v = v0; v < v1; ++v) {
        UnitOut& c = units[v - w0];
        if (from[v - w0] == kNotStaged) continue;
        c.pos = Positions{
            std::span<const uint32_t>(staged_positions_).subspan(from[v - w0], c.n), {}, c.first};
        c.values = std::span<const uint8_t>(staged_values_).subspan(from[v - w0] * t.w, c.n * t.w);
        if (EncodingOf(t, src, c.first, c.count, c.n) == StreamEncoding::kSparse) {
          sparse_units.push_back(v - w0);
        }
      }
      DS_RETURN_IF_ERROR(EncodeSparse(t, pool, sparse_units, &units, stats));
      for (uint64_t v = v0; v < v1; ++v) {
        UnitOut& c = units[v - w0];
        const uint64_t first = c.first, count = c.count;
        std::optional<std::span<const uint8_t>> dense_view;
        const DenseView dense = DenseOnce(src, first, count, &dense_view);
        if (!whole.empty()) {
          const auto t2 = Clock::now();
          for (auto& [key, d] : whole) {
            DS_RETURN_IF_ERROR(AddWholeDigest(t, src, key, first, count, dense, d));
          }
          stats->diff_s += SecondsSince(t2);
        }
        DS_RETURN_IF_ERROR(EmitUnit(t, src, round, nullptr, c, dense));
      }
      // The kept changes of units that went dense are let go with them.
      for (size_t i = unit_pieces[v0 - w0]; i < unit_pieces[v1 - w0]; ++i) kept[i] = Kept{};
      v0 = v1;
    }
    w0 = w1;
  }
  return Status::OK();
}

}  // namespace stream_sender

}  // namespace deltasync
