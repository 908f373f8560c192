// The translation of a local tensor's changes into HF flat coordinates
// (src/shard/shard_changes.h), by its placement (include/deltasync/shard.h).
#include <algorithm>
#include <cstring>
#include <functional>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "core/endian.h"
#include "deltasync/shard.h"
#include "shard/shard_changes.h"
#include "shard/shard_names.h"

namespace deltasync::stream {

using shard_names::Quote;
using shard_names::SpecName;

namespace {

// Copies the positions of `run` from index `from` while they are below
// `bound` into out_pos (from index `o`), checking each against the one
// before and numel. Returns the index it stopped at: count, or the first
// position at or past bound (checked, not copied). *status is set on a bad
// position.
template <uint32_t W, typename Out>
uint64_t CopyPositions(const ChangeRun& run, uint64_t from, uint64_t bound, uint64_t numel,
                       std::string_view tensor, Out* out_pos, Status* status) {
  uint64_t prev = LoadLe<UintOfWidth<W>>(run.positions + from * W);
  out_pos[0] = static_cast<Out>(prev);
  uint64_t j = from + 1;
  for (; j < run.count; ++j) {
    const uint64_t q = LoadLe<UintOfWidth<W>>(run.positions + j * W);
    if (q <= prev) {
      *status = Status::Corruption("tensor " + Quote(tensor) + ": the positions of " +
                                   std::string(run.origin) + " are not strictly increasing (" +
                                   std::to_string(q) + " after " + std::to_string(prev) +
                                   " at index " + std::to_string(j) + ")");
      return j;
    }
    if (q >= numel) {
      *status = Status::Corruption("tensor " + Quote(tensor) + ": position " + std::to_string(q) +
                                   " of " + std::string(run.origin) + " is past the tensor's " +
                                   std::to_string(numel) + " elements");
      return j;
    }
    if (q >= bound) break;
    out_pos[j - from] = static_cast<Out>(q);
    prev = q;
  }
  return j;
}

}  // namespace

ChangeRun RunOf(const ChangeSet& changes, std::string_view origin) {
  ChangeRun run;
  run.positions = changes.wide ? reinterpret_cast<const uint8_t*>(changes.pos64.data())
                               : reinterpret_cast<const uint8_t*>(changes.pos32.data());
  run.position_width = changes.wide ? 8 : 4;
  run.new_values = changes.new_values.data();
  run.old_values = changes.old_values.data();
  run.count = changes.count();
  run.origin = origin;
  return run;
}

Status MergeChangeRuns(std::string_view tensor, std::span<const ChangeRun> runs, ChangeSet* out) {
  const uint64_t numel = out->numel;
  const uint32_t w = out->elem_size;
  uint64_t total = 0;
  for (const ChangeRun& r : runs) total += r.count;
  out->wide = numel > UINT32_MAX;
  out->pos32.clear();
  out->pos64.clear();
  if (out->wide) {
    out->pos64.resize(total);
  } else {
    out->pos32.resize(total);
  }
  out->new_values.resize(total * w);
  out->old_values.resize(total * w);

  // Heads of the lists not yet used up, smallest position on top.
  using Head = std::pair<uint64_t, size_t>;
  std::priority_queue<Head, std::vector<Head>, std::greater<Head>> heads;
  std::vector<uint64_t> next(runs.size(), 0);
  for (size_t s = 0; s < runs.size(); ++s) {
    if (runs[s].count == 0) continue;
    const uint64_t p = LoadLeWidth(runs[s].positions, runs[s].position_width);
    if (p >= numel) {
      return Status::Corruption("tensor " + Quote(tensor) + ": position " + std::to_string(p) +
                                " of " + std::string(runs[s].origin) + " is past the tensor's " +
                                std::to_string(numel) + " elements");
    }
    heads.push({p, s});
  }
  uint64_t o = 0;
  while (!heads.empty()) {
    // Plain copies: lambdas cannot capture structured bindings (C++20 as
    // clang 14 implements it).
    const uint64_t p = heads.top().first;
    const size_t s = heads.top().second;
    heads.pop();
    // Everything of list s below the next list's head goes out as one run.
    const uint64_t bound = heads.empty() ? UINT64_MAX : heads.top().first;
    const ChangeRun& run = runs[s];
    auto duplicate = [&](uint64_t position) {
      const size_t other = heads.top().second;
      return Status::InvalidArgument(
          "tensor " + Quote(tensor) + ": position " + std::to_string(position) +
          " is in the changes of " + std::string(runs[std::min(s, other)].origin) + " and of " +
          std::string(runs[std::max(s, other)].origin) + " (overlapping shards)");
    };
    if (p == bound) return duplicate(p);
    const uint64_t from = next[s];
    Status status;
    uint64_t end = 0;
    if (run.position_width == 4) {
      end = out->wide ? CopyPositions<4>(run, from, bound, numel, tensor, &out->pos64[o], &status)
                      : CopyPositions<4>(run, from, bound, numel, tensor, &out->pos32[o], &status);
    } else {
      end = out->wide ? CopyPositions<8>(run, from, bound, numel, tensor, &out->pos64[o], &status)
                      : CopyPositions<8>(run, from, bound, numel, tensor, &out->pos32[o], &status);
    }
    DS_RETURN_IF_ERROR(status);
    const uint64_t n = end - from;
    std::memcpy(out->new_values.data() + o * w, run.new_values + from * w, n * w);
    std::memcpy(out->old_values.data() + o * w, run.old_values + from * w, n * w);
    o += n;
    next[s] = end;
    if (end < run.count) {
      const uint64_t q = LoadLeWidth(run.positions + end * run.position_width, run.position_width);
      if (q == bound) return duplicate(q);
      heads.push({q, s});
    }
  }
  return Status::OK();
}

namespace {

// One piece's share of a local tensor's changes, in HF flat positions.
struct PieceChanges {
  std::vector<uint64_t> positions;
  std::vector<uint8_t> new_values;
  std::vector<uint8_t> old_values;
};

// Appends to `to` the values of local changes [from, end).
void AppendValues(const ChangeSet& local, uint64_t from, uint64_t end, PieceChanges* to) {
  const uint32_t w = local.elem_size;
  to->new_values.insert(to->new_values.end(), local.new_values.begin() + from * w,
                        local.new_values.begin() + end * w);
  to->old_values.insert(to->old_values.end(), local.old_values.begin() + from * w,
                        local.old_values.begin() + end * w);
}

// Sends change i of `local` to piece `piece` at HF position `hf`, copying
// values a run of consecutive changes of one piece at a time.
class Distributor {
 public:
  Distributor(const ChangeSet& local, std::vector<PieceChanges>* pieces)
      : local_(local), pieces_(*pieces) {}
  void Add(uint64_t i, size_t piece, uint64_t hf) {
    if (piece != run_piece_) {
      Flush(i);
      run_piece_ = piece;
      run_from_ = i;
    }
    pieces_[piece].positions.push_back(hf);
  }
  // A change that goes nowhere (a piece that does not contribute).
  void Skip(uint64_t i) {
    Flush(i);
    run_piece_ = SIZE_MAX;
  }
  void Flush(uint64_t end) {
    if (run_piece_ != SIZE_MAX) AppendValues(local_, run_from_, end, &pieces_[run_piece_]);
    run_piece_ = SIZE_MAX;
  }

 private:
  const ChangeSet& local_;
  std::vector<PieceChanges>& pieces_;
  size_t run_piece_ = SIZE_MAX;
  uint64_t run_from_ = 0;
};

Status PositionError(const ShardSpec& spec, uint64_t i, uint64_t p, uint64_t prev, uint64_t numel) {
  const std::string what = "changes of the local tensor of " + SpecName(spec);
  if (p >= numel) {
    return Status::InvalidArgument(what + ": position " + std::to_string(p) + " at index " +
                                   std::to_string(i) + " is past its " + std::to_string(numel) +
                                   " elements");
  }
  return Status::InvalidArgument(what + ": positions not strictly increasing (" +
                                 std::to_string(p) + " after " + std::to_string(prev) +
                                 " at index " + std::to_string(i) + ")");
}

// Box pieces: each local row (all coordinates but the last) lies in the
// pieces whose boxes hold it, each as an interval of the last coordinate,
// found once per row the changes touch.
Status DistributeBoxes(const ShardSpec& spec, const ChangeSet& local, uint64_t numel,
                       Distributor* dist) {
  // A scalar is a tensor of one row of one element.
  const size_t nd = std::max<size_t>(spec.local_shape.size(), 1);
  auto dim_or_1 = [](const std::vector<int64_t>& v, size_t d) {
    return v.empty() ? int64_t{1} : v[d];
  };
  auto dim_or_0 = [](const std::vector<int64_t>& v, size_t d) {
    return v.empty() ? int64_t{0} : v[d];
  };
  const uint64_t inner = static_cast<uint64_t>(dim_or_1(spec.local_shape, nd - 1));
  struct Box {
    std::vector<uint64_t> hf_stride;
  };
  std::vector<Box> boxes(spec.pieces.size());
  for (size_t j = 0; j < spec.pieces.size(); ++j) {
    const ShardPiece& p = spec.pieces[j];
    boxes[j].hf_stride.assign(nd, 1);
    for (size_t d = nd - 1; d > 0; --d) {
      boxes[j].hf_stride[d - 1] =
          boxes[j].hf_stride[d] * static_cast<uint64_t>(dim_or_1(p.hf_shape, d));
    }
  }
  struct Segment {
    uint64_t col_first, col_end;
    size_t piece;
    uint64_t hf_base;  // HF position = hf_base + column (mod 2^64)
  };
  std::vector<Segment> segments;
  std::vector<uint64_t> coords(nd, 0);
  uint64_t row_now = UINT64_MAX;
  size_t seg = 0;
  uint64_t prev = 0;
  const uint64_t n = local.count();
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t p = local.position(i);
    if (p >= numel || (i > 0 && p <= prev)) {
      return PositionError(spec, i, p, prev, numel);
    }
    prev = p;
    const uint64_t row = p / inner;
    const uint64_t col = p % inner;
    if (row != row_now) {
      uint64_t rest = row;
      for (size_t d = nd - 1; d > 0; --d) {
        const uint64_t size = static_cast<uint64_t>(spec.local_shape[d - 1]);
        coords[d - 1] = rest % size;
        rest /= size;
      }
      segments.clear();
      for (size_t j = 0; j < spec.pieces.size(); ++j) {
        const ShardPiece& pc = spec.pieces[j];
        bool holds = dim_or_1(pc.extent, nd - 1) > 0;
        uint64_t hf_row = 0;
        for (size_t d = 0; holds && d + 1 < nd; ++d) {
          const uint64_t lo = static_cast<uint64_t>(pc.local_offset[d]);
          holds = coords[d] >= lo && coords[d] < lo + static_cast<uint64_t>(pc.extent[d]);
          hf_row +=
              (coords[d] - lo + static_cast<uint64_t>(pc.hf_offset[d])) * boxes[j].hf_stride[d];
        }
        if (!holds) continue;
        const uint64_t lo = static_cast<uint64_t>(dim_or_0(pc.local_offset, nd - 1));
        segments.push_back({lo, lo + static_cast<uint64_t>(dim_or_1(pc.extent, nd - 1)), j,
                            hf_row + static_cast<uint64_t>(dim_or_0(pc.hf_offset, nd - 1)) - lo});
      }
      std::sort(segments.begin(), segments.end(),
                [](const Segment& a, const Segment& b) { return a.col_first < b.col_first; });
      row_now = row;
      seg = 0;
    }
    while (seg < segments.size() && col >= segments[seg].col_end) ++seg;
    if (seg == segments.size() || col < segments[seg].col_first) {
      return Status::Internal("local tensor of " + SpecName(spec) + ": position " +
                              std::to_string(p) + " is in no piece of a validated spec");
    }
    const Segment& s = segments[seg];
    if (spec.pieces[s.piece].contributes) {
      dist->Add(i, s.piece, s.hf_base + col);
    } else {
      dist->Skip(i);
    }
  }
  return Status::OK();
}

// Flat ranges: a sweep over the ranges in local order.
Status DistributeFlat(const ShardSpec& spec, const ChangeSet& local, uint64_t numel,
                      Distributor* dist) {
  std::vector<size_t> order;
  for (size_t j = 0; j < spec.pieces.size(); ++j) {
    if (spec.pieces[j].count > 0) order.push_back(j);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return spec.pieces[a].local_first < spec.pieces[b].local_first;
  });
  size_t k = 0;
  uint64_t prev = 0;
  const uint64_t n = local.count();
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t p = local.position(i);
    if (p >= numel || (i > 0 && p <= prev)) {
      return PositionError(spec, i, p, prev, numel);
    }
    prev = p;
    while (k < order.size() && p >= static_cast<uint64_t>(spec.pieces[order[k]].local_first +
                                                          spec.pieces[order[k]].count)) {
      ++k;
    }
    if (k == order.size() || p < static_cast<uint64_t>(spec.pieces[order[k]].local_first)) {
      return Status::Internal("local tensor of " + SpecName(spec) + ": position " +
                              std::to_string(p) + " is in no piece of a validated spec");
    }
    const ShardPiece& pc = spec.pieces[order[k]];
    if (pc.contributes) {
      dist->Add(i, order[k],
                p - static_cast<uint64_t>(pc.local_first) + static_cast<uint64_t>(pc.hf_first));
    } else {
      dist->Skip(i);
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::vector<TensorChanges>> TranslateChanges(const ShardSpec& spec, const ChangeSet& local) {
  DS_RETURN_IF_ERROR(spec.Validate());
  const std::string what = "changes of the local tensor of " + SpecName(spec);
  const uint32_t w = static_cast<uint32_t>(DTypeSize(spec.dtype));
  const uint64_t numel = static_cast<uint64_t>(spec.local_numel());
  const uint64_t n = local.count();
  if (local.elem_size != w) {
    return Status::InvalidArgument(what + ": element size " + std::to_string(local.elem_size) +
                                   ", the dtype's is " + std::to_string(w));
  }
  if (local.numel != numel) {
    return Status::InvalidArgument(what + ": numel " + std::to_string(local.numel) +
                                   ", the local tensor has " + std::to_string(numel));
  }
  if (local.wide ? !local.pos32.empty() : !local.pos64.empty()) {
    return Status::InvalidArgument(what + ": positions in the vector `wide` does not select");
  }
  if (local.new_values.size() != n * w || local.old_values.size() != n * w) {
    return Status::InvalidArgument(what + ": " + std::to_string(local.new_values.size()) +
                                   " bytes of new and " + std::to_string(local.old_values.size()) +
                                   " of old values for " + std::to_string(n) +
                                   " changes (both needed: diff with keep_old_values)");
  }

  // The HF tensors, in the order the pieces first name them.
  std::vector<TensorChanges> out;
  std::vector<size_t> tensor_of(spec.pieces.size());
  for (size_t j = 0; j < spec.pieces.size(); ++j) {
    const ShardPiece& p = spec.pieces[j];
    size_t t = 0;
    while (t < out.size() && out[t].name != p.hf_name) ++t;
    if (t == out.size()) {
      TensorChanges tc;
      tc.name = p.hf_name;
      int64_t hf_numel = 1;
      for (int64_t d : p.hf_shape) hf_numel *= d;
      tc.changes.numel = static_cast<uint64_t>(hf_numel);
      tc.changes.elem_size = w;
      tc.changes.wide = tc.changes.numel > UINT32_MAX;
      out.push_back(std::move(tc));
    }
    tensor_of[j] = t;
  }
  if (!spec.contributes || n == 0) return out;

  std::vector<PieceChanges> pieces(spec.pieces.size());
  Distributor dist(local, &pieces);
  if (!spec.pieces.empty() && spec.pieces[0].kind == ShardPiece::Kind::kFlat) {
    DS_RETURN_IF_ERROR(DistributeFlat(spec, local, numel, &dist));
  } else {
    DS_RETURN_IF_ERROR(DistributeBoxes(spec, local, numel, &dist));
  }
  dist.Flush(n);

  std::vector<std::string> origins(spec.pieces.size());
  for (size_t t = 0; t < out.size(); ++t) {
    std::vector<size_t> held;
    for (size_t j = 0; j < spec.pieces.size(); ++j) {
      if (tensor_of[j] == t && !pieces[j].positions.empty()) held.push_back(j);
    }
    ChangeSet& cs = out[t].changes;
    if (held.size() == 1) {
      // One piece: its changes are in order already (a box keeps row-major
      // order).
      PieceChanges& pc = pieces[held[0]];
      if (cs.wide) {
        cs.pos64 = std::move(pc.positions);
      } else {
        cs.pos32.assign(pc.positions.begin(), pc.positions.end());
      }
      cs.new_values = std::move(pc.new_values);
      cs.old_values = std::move(pc.old_values);
      continue;
    }
    std::vector<ChangeRun> runs;
    for (size_t j : held) {
      origins[j] = "piece " + std::to_string(j);
      ChangeRun r;
      r.positions = reinterpret_cast<const uint8_t*>(pieces[j].positions.data());
      r.position_width = 8;
      r.new_values = pieces[j].new_values.data();
      r.old_values = pieces[j].old_values.data();
      r.count = pieces[j].positions.size();
      r.origin = origins[j];
      runs.push_back(r);
    }
    DS_RETURN_IF_ERROR(MergeChangeRuns(out[t].name, runs, &cs).WithContext(what));
  }
  return out;
}

}  // namespace deltasync::stream
