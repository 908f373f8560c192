// Placements of local tensors (include/deltasync/shard.h): their checks
// and factories. Their changes' translation is shard_translate.cc.
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

namespace deltasync {

using shard_names::Quote;
using shard_names::SpecName;

namespace {

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

Result<ShardSpec> ShardSpec::StackedExperts(DType dtype,
                                            const std::vector<std::vector<std::string>>& experts,
                                            std::vector<int64_t> part_shape) {
  if (experts.empty()) return Status::InvalidArgument("stacked experts: no experts");
  const size_t parts = experts[0].size();
  const std::string what = "stacked experts from '" + (parts ? experts[0][0] : std::string()) + "'";
  if (parts == 0) return Status::InvalidArgument(what + ": an expert of no tensors");
  if (part_shape.empty()) return Status::InvalidArgument(what + ": a part of no dimensions");
  int64_t part_numel = 1;
  for (int64_t d : part_shape) {
    if (d < 0 || (d > 0 && part_numel > kMaxShardNumel / d)) {
      return Status::InvalidArgument(what + ": part shape " + ShapeString(part_shape));
    }
    part_numel *= d;
  }
  ShardSpec spec;
  spec.dtype = dtype;
  spec.local_shape = part_shape;
  spec.local_shape[0] *= static_cast<int64_t>(parts);
  spec.local_shape.insert(spec.local_shape.begin(), static_cast<int64_t>(experts.size()));
  int64_t at = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    if (experts[e].size() != parts) {
      return Status::InvalidArgument(what + ": expert " + std::to_string(e) + " has " +
                                     std::to_string(experts[e].size()) + " tensors, expert 0 " +
                                     std::to_string(parts));
    }
    for (const std::string& name : experts[e]) {
      spec.pieces.push_back(ShardPiece::Flat(name, part_shape, at, 0, part_numel));
      at += part_numel;
    }
  }
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
