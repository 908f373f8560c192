// Placements of local tensors (include/deltasync/shard.h) and the
// translation of their changes into HF flat coordinates
// (src/shard/shard_changes.h).
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

namespace deltasync {

namespace {

// Built by appending: GCC 12 warns (-Wrestrict, falsely) on "'" + string.
std::string Quote(std::string_view name) {
  std::string s(1, '\'');
  s.append(name);
  s += '\'';
  return s;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

// The element count of `shape`, checking rule 1 of "Placements"; `what`
// names the tensor in messages.
Status CheckShape(const std::string& what, const std::vector<int64_t>& shape, int64_t* numel) {
  if (shape.size() > kMaxShardDims) {
    return Status::InvalidArgument(what + " has " + std::to_string(shape.size()) +
                                   " dimensions, more than 16");
  }
  int64_t n = 1;
  bool too_big = false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) {
      return Status::InvalidArgument(what + " has a negative dimension (" +
                                     std::to_string(shape[d]) + " in dim " + std::to_string(d) +
                                     ")");
    }
    if (shape[d] > kMaxShardNumel) too_big = true;
    if (!too_big && shape[d] != 0 && n > kMaxShardNumel / shape[d]) too_big = true;
    if (!too_big) n *= shape[d];
  }
  if (too_big || n > kMaxShardNumel) {
    return Status::InvalidArgument(what + " of shape " + ShapeString(shape) +
                                   " has more than 2^56 elements");
  }
  *numel = n;
  return Status::OK();
}

// The first piece's HF tensor, which names a spec in messages about it as a
// whole.
std::string SpecName(const ShardSpec& spec) {
  return spec.pieces.empty() ? std::string("(no pieces)") : Quote(spec.pieces[0].hf_name);
}

std::string PieceName(const ShardSpec& spec, size_t i) {
  return "tensor " + Quote(spec.pieces[i].hf_name) + ", piece " + std::to_string(i);
}

bool BoxesOverlap(const std::vector<int64_t>& a_off, const std::vector<int64_t>& a_ext,
                  const std::vector<int64_t>& b_off, const std::vector<int64_t>& b_ext) {
  for (size_t d = 0; d < a_off.size(); ++d) {
    if (std::max(a_off[d], b_off[d]) >= std::min(a_off[d] + a_ext[d], b_off[d] + b_ext[d])) {
      return false;
    }
  }
  return true;
}

bool RangesOverlap(int64_t a_first, int64_t a_count, int64_t b_first, int64_t b_count) {
  return std::max(a_first, b_first) < std::min(a_first + a_count, b_first + b_count);
}

// Checks that [offset, offset + extent) lies within `shape`, per dimension.
Status CheckWithin(const std::string& what, const char* side, const std::vector<int64_t>& offset,
                   const std::vector<int64_t>& extent, const std::vector<int64_t>& shape) {
  for (size_t d = 0; d < shape.size(); ++d) {
    if (offset[d] < 0 || extent[d] < 0) {
      return Status::InvalidArgument(what + ": negative " + side + " offset or extent in dim " +
                                     std::to_string(d));
    }
    if (offset[d] > shape[d] || extent[d] > shape[d] - offset[d]) {
      return Status::InvalidArgument(what + " extends past the " + side + " tensor in dim " +
                                     std::to_string(d) + " (offset " + std::to_string(offset[d]) +
                                     " + extent " + std::to_string(extent[d]) + " > " +
                                     std::to_string(shape[d]) + ")");
    }
  }
  return Status::OK();
}

Status CheckPieceShape(const ShardSpec& spec, size_t i, int64_t* hf_numel) {
  const ShardPiece& p = spec.pieces[i];
  if (p.hf_name.empty()) {
    return Status::InvalidArgument("piece " + std::to_string(i) + ": empty HF tensor name");
  }
  if (p.hf_name.size() > kMaxShardNameBytes) {
    return Status::InvalidArgument("piece " + std::to_string(i) + ": HF tensor name of " +
                                   std::to_string(p.hf_name.size()) + " bytes, more than 1024");
  }
  return CheckShape("tensor " + Quote(p.hf_name), p.hf_shape, hf_numel);
}

}  // namespace

ShardPiece ShardPiece::Box(std::string hf_name, std::vector<int64_t> hf_shape,
                           std::vector<int64_t> local_offset, std::vector<int64_t> hf_offset,
                           std::vector<int64_t> extent) {
  ShardPiece p;
  p.kind = Kind::kBox;
  p.hf_name = std::move(hf_name);
  p.hf_shape = std::move(hf_shape);
  p.local_offset = std::move(local_offset);
  p.hf_offset = std::move(hf_offset);
  p.extent = std::move(extent);
  return p;
}

ShardPiece ShardPiece::Flat(std::string hf_name, std::vector<int64_t> hf_shape, int64_t local_first,
                            int64_t hf_first, int64_t count) {
  ShardPiece p;
  p.kind = Kind::kFlat;
  p.hf_name = std::move(hf_name);
  p.hf_shape = std::move(hf_shape);
  p.local_first = local_first;
  p.hf_first = hf_first;
  p.count = count;
  return p;
}

int64_t ShardPiece::elements() const {
  if (kind == Kind::kFlat) return count;
  int64_t n = 1;
  for (int64_t e : extent) n *= e;
  return n;
}

int64_t ShardSpec::local_numel() const {
  int64_t n = 1;
  for (int64_t d : local_shape) n *= d;
  return n;
}

Status ShardSpec::Validate() const {
  const std::string spec_name = SpecName(*this);
  if (static_cast<int>(dtype) >= kNumDTypes) {
    return Status::InvalidArgument("local tensor of " + spec_name + ": unknown dtype " +
                                   std::to_string(static_cast<int>(dtype)));
  }
  int64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckShape("local tensor of " + spec_name, local_shape, &numel));
  const size_t ndim = local_shape.size();
  std::vector<int64_t> hf_numel(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ShardPiece& p = pieces[i];
    const std::string what = PieceName(*this, i);
    DS_RETURN_IF_ERROR(CheckPieceShape(*this, i, &hf_numel[i]));
    if (p.kind != pieces[0].kind) {
      return Status::InvalidArgument(what + ": a " +
                                     (p.kind == ShardPiece::Kind::kBox ? "box" : "flat range") +
                                     " among pieces of the other kind (a spec's pieces are all "
                                     "boxes or all flat ranges)");
    }
    for (size_t j = 0; j < i; ++j) {
      if (pieces[j].hf_name == p.hf_name && pieces[j].hf_shape != p.hf_shape) {
        return Status::InvalidArgument(what + ": shape " + ShapeString(p.hf_shape) +
                                       " differs from piece " + std::to_string(j) + "'s " +
                                       ShapeString(pieces[j].hf_shape));
      }
    }
    if (p.kind == ShardPiece::Kind::kBox) {
      if (p.hf_shape.size() != ndim || p.local_offset.size() != ndim ||
          p.hf_offset.size() != ndim || p.extent.size() != ndim) {
        return Status::InvalidArgument(
            what + ": a box needs the local tensor's number of dimensions (" +
            std::to_string(ndim) + ") in its HF shape (" + std::to_string(p.hf_shape.size()) +
            "), local offset (" + std::to_string(p.local_offset.size()) + "), HF offset (" +
            std::to_string(p.hf_offset.size()) + ") and extent (" +
            std::to_string(p.extent.size()) + ")");
      }
      DS_RETURN_IF_ERROR(CheckWithin(what, "local", p.local_offset, p.extent, local_shape));
      DS_RETURN_IF_ERROR(CheckWithin(what, "HF", p.hf_offset, p.extent, p.hf_shape));
    } else {
      if (p.local_first < 0 || p.hf_first < 0 || p.count < 0) {
        return Status::InvalidArgument(what + ": negative flat range (local first " +
                                       std::to_string(p.local_first) + ", HF first " +
                                       std::to_string(p.hf_first) + ", count " +
                                       std::to_string(p.count) + ")");
      }
      if (p.local_first > numel || p.count > numel - p.local_first) {
        return Status::InvalidArgument(what + ": flat range [" + std::to_string(p.local_first) +
                                       ", +" + std::to_string(p.count) +
                                       ") extends past the local tensor's " +
                                       std::to_string(numel) + " elements");
      }
      if (p.hf_first > hf_numel[i] || p.count > hf_numel[i] - p.hf_first) {
        return Status::InvalidArgument(
            what + ": flat range [" + std::to_string(p.hf_first) + ", +" + std::to_string(p.count) +
            ") extends past the HF tensor's " + std::to_string(hf_numel[i]) + " elements");
      }
    }
  }
  // Disjoint in the local tensor, and in each HF tensor among its pieces.
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ShardPiece& a = pieces[i];
    for (size_t j = i + 1; j < pieces.size(); ++j) {
      const ShardPiece& b = pieces[j];
      const bool box = a.kind == ShardPiece::Kind::kBox;
      if (box ? BoxesOverlap(a.local_offset, a.extent, b.local_offset, b.extent)
              : RangesOverlap(a.local_first, a.count, b.local_first, b.count)) {
        return Status::InvalidArgument(PieceName(*this, i) + " and piece " + std::to_string(j) +
                                       " (tensor " + Quote(b.hf_name) +
                                       ") overlap in the local tensor");
      }
      if (a.hf_name == b.hf_name &&
          (box ? BoxesOverlap(a.hf_offset, a.extent, b.hf_offset, b.extent)
               : RangesOverlap(a.hf_first, a.count, b.hf_first, b.count))) {
        return Status::InvalidArgument(PieceName(*this, i) + " and piece " + std::to_string(j) +
                                       " overlap in the HF tensor");
      }
    }
  }
  // Disjoint pieces within the local tensor cover it exactly when their
  // sizes add up to it (and the sum cannot overflow).
  int64_t covered = 0;
  for (const ShardPiece& p : pieces) covered += p.elements();
  if (covered != numel) {
    return Status::InvalidArgument("local tensor of " + spec_name + " (shape " +
                                   ShapeString(local_shape) + "): the pieces cover " +
                                   std::to_string(covered) + " of its " + std::to_string(numel) +
                                   " elements (they must cover it exactly)");
  }
  return Status::OK();
}

Result<ShardSpec> ShardSpec::Box(std::string name, DType dtype, std::vector<int64_t> global_shape,
                                 std::vector<int64_t> offset, std::vector<int64_t> extent) {
  ShardSpec spec;
  spec.dtype = dtype;
  spec.local_shape = extent;
  std::vector<int64_t> zeros(extent.size(), 0);
  spec.pieces.push_back(ShardPiece::Box(std::move(name), std::move(global_shape), std::move(zeros),
                                        std::move(offset), std::move(extent)));
  DS_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

Result<ShardSpec> ShardSpec::MegatronQkv(const std::string& q, const std::string& k,
                                         const std::string& v, DType dtype, int64_t num_heads,
                                         int64_t num_query_groups, int64_t head_dim, int64_t hidden,
                                         int64_t tp_rank, int64_t tp_size) {
  const std::string what = "Megatron qkv of " + Quote(q);
  if (num_heads <= 0 || num_query_groups <= 0 || head_dim <= 0 || hidden <= 0 || tp_size <= 0 ||
      tp_rank < 0 || tp_rank >= tp_size) {
    return Status::InvalidArgument(
        what +
        ": heads, query groups, head_dim, hidden and tp_size must be positive and tp_rank "
        "in [0, tp_size); got " +
        std::to_string(num_heads) + ", " + std::to_string(num_query_groups) + ", " +
        std::to_string(head_dim) + ", " + std::to_string(hidden) + ", " + std::to_string(tp_size) +
        ", " + std::to_string(tp_rank));
  }
  if (num_heads % num_query_groups != 0) {
    return Status::InvalidArgument(what + ": " + std::to_string(num_heads) +
                                   " heads are not a multiple of " +
                                   std::to_string(num_query_groups) + " query groups");
  }
  if (num_heads > kMaxShardNumel / head_dim / 3) {
    return Status::InvalidArgument(what + ": too many rows");
  }
  const int64_t per_group = num_heads / num_query_groups;
  const int64_t rows = (num_heads + 2 * num_query_groups) * head_dim;
  if (rows % tp_size != 0) {
    return Status::InvalidArgument(what + ": " + std::to_string(rows) + " rows do not split into " +
                                   std::to_string(tp_size) + " equal parts");
  }
  const int64_t lo = tp_rank * (rows / tp_size);
  const int64_t hi = lo + rows / tp_size;
  const std::vector<int64_t> q_shape = {num_heads * head_dim, hidden};
  const std::vector<int64_t> kv_shape = {num_query_groups * head_dim, hidden};
  std::vector<ShardSpec> parts;
  int64_t at = 0;  // the fused weight's row where the next run starts
  for (int64_t g = 0; g < num_query_groups && at < hi; ++g) {
    const struct {
      const std::string& name;
      const std::vector<int64_t>& shape;
      int64_t first;  // the run's first row in the HF tensor
      int64_t count;
    } runs[] = {{q, q_shape, g * per_group * head_dim, per_group * head_dim},
                {k, kv_shape, g * head_dim, head_dim},
                {v, kv_shape, g * head_dim, head_dim}};
    for (const auto& run : runs) {
      const int64_t a = std::max(at, lo);
      const int64_t b = std::min(at + run.count, hi);
      if (a < b) {
        DS_ASSIGN_OR_RETURN(ShardSpec part, Box(run.name, dtype, run.shape,
                                                {run.first + (a - at), 0}, {b - a, hidden}));
        parts.push_back(std::move(part));
      }
      at += run.count;
    }
  }
  Result<ShardSpec> fused = Fused(dtype, 0, parts);
  if (!fused.ok()) return fused.status().WithContext(what);
  return fused;
}

Result<ShardSpec> ShardSpec::Whole(std::string name, DType dtype, std::vector<int64_t> shape) {
  std::vector<int64_t> zeros(shape.size(), 0);
  return Box(std::move(name), dtype, shape, std::move(zeros), shape);
}

Result<ShardSpec> ShardSpec::Replicate(std::string name, DType dtype, std::vector<int64_t> shape,
                                       bool contributes) {
  DS_ASSIGN_OR_RETURN(ShardSpec spec, Whole(std::move(name), dtype, std::move(shape)));
  spec.contributes = contributes;
  return spec;
}

namespace {

// `dim` counted from the end when negative, checked against the shape.
Result<size_t> ShardDim(const std::string& name, const std::vector<int64_t>& shape, int dim) {
  const int ndim = static_cast<int>(shape.size());
  if (dim < -ndim || dim >= ndim) {
    return Status::InvalidArgument("tensor " + Quote(name) + ": dim " + std::to_string(dim) +
                                   " out of range for shape " + ShapeString(shape));
  }
  int64_t numel = 0;
  DS_RETURN_IF_ERROR(CheckShape("tensor " + Quote(name), shape, &numel));
  return static_cast<size_t>(dim < 0 ? dim + ndim : dim);
}

Result<ShardSpec> Slice(std::string name, DType dtype, std::vector<int64_t> shape, size_t dim,
                        int64_t first, int64_t size) {
  std::vector<int64_t> offset(shape.size(), 0);
  std::vector<int64_t> extent = shape;
  offset[dim] = first;
  extent[dim] = size;
  return ShardSpec::Box(std::move(name), dtype, std::move(shape), std::move(offset),
                        std::move(extent));
}

}  // namespace

Result<ShardSpec> ShardSpec::Shard(std::string name, DType dtype, std::vector<int64_t> global_shape,
                                   int dim, int64_t index, int64_t count) {
  DS_ASSIGN_OR_RETURN(const size_t d, ShardDim(name, global_shape, dim));
  if (count < 1 || index < 0 || index >= count) {
    return Status::InvalidArgument("tensor " + Quote(name) + ": shard " + std::to_string(index) +
                                   " of " + std::to_string(count) + " (need 0 <= index < count)");
  }
  const int64_t size = global_shape[d];
  const int64_t chunk = size / count + (size % count != 0 ? 1 : 0);
  const int64_t first = std::min(index * chunk, size);
  const int64_t last = std::min(first + chunk, size);
  return Slice(std::move(name), dtype, std::move(global_shape), d, first, last - first);
}

Result<ShardSpec> ShardSpec::ShardSizes(std::string name, DType dtype,
                                        std::vector<int64_t> global_shape, int dim,
                                        std::vector<int64_t> sizes, int64_t index) {
  DS_ASSIGN_OR_RETURN(const size_t d, ShardDim(name, global_shape, dim));
  if (index < 0 || index >= static_cast<int64_t>(sizes.size())) {
    return Status::InvalidArgument("tensor " + Quote(name) + ": part " + std::to_string(index) +
                                   " of " + std::to_string(sizes.size()) + " sizes");
  }
  int64_t sum = 0, first = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || sizes[i] > global_shape[d] - sum) {
      return Status::InvalidArgument("tensor " + Quote(name) + ": sizes " + ShapeString(sizes) +
                                     " do not split dim " + std::to_string(d) + " of shape " +
                                     ShapeString(global_shape));
    }
    if (static_cast<int64_t>(i) == index) first = sum;
    sum += sizes[i];
  }
  if (sum != global_shape[d]) {
    return Status::InvalidArgument("tensor " + Quote(name) + ": sizes " + ShapeString(sizes) +
                                   " sum to " + std::to_string(sum) + ", not dim " +
                                   std::to_string(d) + "'s " + std::to_string(global_shape[d]));
  }
  return Slice(std::move(name), dtype, std::move(global_shape), d, first, sizes[index]);
}

Result<ShardSpec> ShardSpec::FlatRange(std::string name, DType dtype, std::vector<int64_t> hf_shape,
                                       int64_t hf_first, int64_t count) {
  ShardSpec spec;
  spec.dtype = dtype;
  spec.local_shape = {count};
  spec.pieces.push_back(ShardPiece::Flat(std::move(name), std::move(hf_shape), 0, hf_first, count));
  DS_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

Result<ShardSpec> ShardSpec::Fused(DType dtype, int dim, const std::vector<ShardSpec>& parts) {
  if (parts.empty()) return Status::InvalidArgument("fused tensor: no parts");
  const std::string fused = "fused tensor of " + SpecName(parts[0]);
  for (size_t i = 0; i < parts.size(); ++i) {
    DS_RETURN_IF_ERROR(parts[i].Validate().WithContext(fused + ", part " + std::to_string(i)));
  }
  const std::vector<int64_t>& shape0 = parts[0].local_shape;
  const int ndim = static_cast<int>(shape0.size());
  if (dim < -ndim || dim >= ndim) {
    return Status::InvalidArgument(fused + ": dim " + std::to_string(dim) +
                                   " out of range for parts of shape " + ShapeString(shape0));
  }
  const size_t d = static_cast<size_t>(dim < 0 ? dim + ndim : dim);
  ShardSpec spec;
  spec.dtype = dtype;
  spec.local_shape = shape0;
  spec.local_shape[d] = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const ShardSpec& part = parts[i];
    const std::string what = fused + ", part " + std::to_string(i) + " (" + SpecName(part) + ")";
    if (part.dtype != dtype) {
      return Status::InvalidArgument(what + ": dtype " + std::string(DTypeName(part.dtype)) +
                                     ", not " + std::string(DTypeName(dtype)));
    }
    bool same = part.local_shape.size() == shape0.size();
    for (size_t k = 0; same && k < shape0.size(); ++k) {
      same = k == d || part.local_shape[k] == shape0[k];
    }
    if (!same) {
      return Status::InvalidArgument(what + ": shape " + ShapeString(part.local_shape) +
                                     " does not concatenate with " + ShapeString(shape0) +
                                     " along dim " + std::to_string(d));
    }
    const int64_t offset = spec.local_shape[d];
    for (ShardPiece p : part.pieces) {
      if (p.kind == ShardPiece::Kind::kFlat) {
        if (ndim != 1) {
          return Status::InvalidArgument(what + ": flat ranges fuse only into 1-D tensors");
        }
        p.local_first += offset;
      } else {
        p.local_offset[d] += offset;
      }
      p.contributes = p.contributes && part.contributes;
      spec.pieces.push_back(std::move(p));
    }
    if (part.local_shape[d] > kMaxShardNumel - offset) {
      return Status::InvalidArgument(fused + ": more than 2^56 elements along dim " +
                                     std::to_string(d));
    }
    spec.local_shape[d] = offset + part.local_shape[d];
  }
  DS_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

}  // namespace deltasync

namespace deltasync::stream {

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
