// FP8 quantization of a sharded weight: partial amax per scale group on
// each rank, one all-gather of the groups more than one rank touches, MAX,
// then each rank encodes its own window.
#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <vector>

#include "core/endian.h"
#include "deltasync/communicator.h"
#include "deltasync/shard.h"

namespace deltasync {
namespace {

// A rank's record: its verdict (0: its amax below is good), then the
// partial amax of every shared group as float32 bits (0 where it touches
// none of the group). Non-negative floats order like their bits.
constexpr uint32_t kRecordOk = 0;
constexpr uint32_t kRecordRefused = 1;

std::string Who(const QuantTensor& tensor) { return "tensor '" + std::string(tensor.name) + "'"; }

// The scale groups each window touches (Fp8WindowGroups of its bounds
// alone: a window without data is checked as if it had some).
// InvalidArgument naming the first rank whose window is refused.
Result<std::vector<QuantGroups>> WindowGroups(const QuantRecipe& recipe, const QuantTensor& tensor,
                                              std::span<const QuantWindow> windows) {
  std::vector<QuantGroups> rects(windows.size());
  for (size_t r = 0; r < windows.size(); ++r) {
    QuantWindow bounds = windows[r];
    if (bounds.data == nullptr) bounds.data = &rects;  // only the bounds matter here
    Result<QuantGroups> g = Fp8WindowGroups(recipe, tensor, bounds);
    if (!g.ok()) {
      return Status::InvalidArgument("rank " + std::to_string(r) +
                                     "'s window: " + g.status().message());
    }
    rects[r] = *g;
  }
  return rects;
}

}  // namespace

Status Fp8QuantizeShard(Communicator& group, const QuantRecipe& recipe, const QuantTensor& tensor,
                        std::span<const QuantWindow> windows, uint8_t* codes, void* scales) {
  const int ranks = group.size(), me = group.rank();
  if (static_cast<int>(windows.size()) != ranks) {
    return Status::InvalidArgument(Who(tensor) + ": " + std::to_string(windows.size()) +
                                   " windows for a trainer group of " + std::to_string(ranks));
  }
  // Every rank finds the same groups from the same bounds: the rectangle
  // of each window, and how many windows touch each group.
  DS_ASSIGN_OR_RETURN(const std::vector<QuantGroups> rects, WindowGroups(recipe, tensor, windows));
  Result<std::vector<int64_t>> scale_shape =
      QuantScaleShape(recipe, tensor.shape[0], tensor.shape[1]);
  if (!scale_shape.ok()) return scale_shape.status();
  const int64_t grid_cols = scale_shape->size() == 2 ? (*scale_shape)[1] : 1;
  const int64_t grid_rows = (*scale_shape)[0];
  std::vector<uint16_t> touches(static_cast<size_t>(grid_rows * grid_cols), 0);
  for (const QuantGroups& g : rects) {
    for (int64_t r = g.row_begin; r < g.row_end; ++r) {
      for (int64_t c = g.col_begin; c < g.col_end; ++c) {
        uint16_t& t = touches[static_cast<size_t>(r * grid_cols + c)];
        t = static_cast<uint16_t>(std::min<int>(t + 1, 2));
      }
    }
  }
  std::vector<int64_t> shared;  // grid indices, ascending
  for (size_t i = 0; i < touches.size(); ++i) {
    if (touches[i] >= 2) shared.push_back(static_cast<int64_t>(i));
  }

  // This rank's partial amax over its window.
  const QuantGroups& mine = rects[me];
  std::vector<float> amax(static_cast<size_t>(mine.count()), 0.0f);
  const Status local = Fp8GroupAmax(recipe, tensor, windows[me], amax.data());
  const auto local_index = [&](int64_t grid) -> int64_t {
    const int64_t r = grid / grid_cols, c = grid % grid_cols;
    if (r < mine.row_begin || r >= mine.row_end || c < mine.col_begin || c >= mine.col_end) {
      return -1;
    }
    return (r - mine.row_begin) * (mine.col_end - mine.col_begin) + (c - mine.col_begin);
  };
  const size_t record_bytes = 4 * (1 + shared.size());
  std::vector<uint8_t> record(record_bytes, 0);
  StoreLe<uint32_t>(record.data(), local.ok() ? kRecordOk : kRecordRefused);
  if (local.ok()) {
    for (size_t k = 0; k < shared.size(); ++k) {
      const int64_t at = local_index(shared[k]);
      if (at >= 0)
        StoreLe<uint32_t>(record.data() + 4 * (k + 1), std::bit_cast<uint32_t>(amax[at]));
    }
  }
  std::vector<uint8_t> all(record_bytes * static_cast<size_t>(ranks));
  Status gathered = group.AllGather(record, all);
  if (!gathered.ok()) return gathered;
  for (int r = 0; r < ranks; ++r) {
    if (LoadLe<uint32_t>(all.data() + r * record_bytes) == kRecordOk) continue;
    if (r == me) return local;
    return Status::InvalidArgument(Who(tensor) + ": rank " + std::to_string(r) +
                                   " could not quantize its window (it names the reason)");
  }
  for (size_t k = 0; k < shared.size(); ++k) {
    const int64_t at = local_index(shared[k]);
    if (at < 0) continue;
    uint32_t most = 0;
    for (int r = 0; r < ranks; ++r) {
      most = std::max(most, LoadLe<uint32_t>(all.data() + r * record_bytes + 4 * (k + 1)));
    }
    amax[at] = std::bit_cast<float>(most);
  }
  return Fp8QuantizeWindow(recipe, tensor, windows[me], amax.data(), codes, scales);
}

Result<Fp8ShardSpecs> Fp8ShardSpecsOf(const QuantRecipe& recipe, const QuantTensor& tensor,
                                      std::span<const QuantWindow> windows, int rank,
                                      const std::string& scale_name) {
  const int ranks = static_cast<int>(windows.size());
  if (rank < 0 || rank >= ranks) {
    return Status::InvalidArgument(Who(tensor) + ": rank " + std::to_string(rank) + " of " +
                                   std::to_string(ranks) + " windows");
  }
  if (scale_name.empty() || scale_name == tensor.name) {
    return Status::InvalidArgument(Who(tensor) + ": its scales need a name of their own, not '" +
                                   scale_name + "'");
  }
  DS_ASSIGN_OR_RETURN(const std::vector<QuantGroups> rects, WindowGroups(recipe, tensor, windows));
  DS_ASSIGN_OR_RETURN(const std::vector<int64_t> scale_shape,
                      QuantScaleShape(recipe, tensor.shape[0], tensor.shape[1]));
  const DType scale_dtype = QuantScaleDType(recipe.scale_format);
  const QuantWindow& w = windows[rank];
  const std::vector<int64_t> shape(tensor.shape.begin(), tensor.shape.end());
  Fp8ShardSpecs out;
  DS_ASSIGN_OR_RETURN(
      out.codes,
      ShardSpec::Box(std::string(tensor.name), DType::kF8_E4M3, shape, {w.row_begin, w.col_begin},
                     {w.row_end - w.row_begin, w.col_end - w.col_begin}));
  // The lowest rank whose window touches grid group (r, c).
  const auto owner = [&](int64_t r, int64_t c) {
    for (int k = 0; k < ranks; ++k) {
      const QuantGroups& g = rects[k];
      if (r >= g.row_begin && r < g.row_end && c >= g.col_begin && c < g.col_end) return k;
    }
    return ranks;
  };
  if (scale_shape.size() == 1) {  // one per-tensor scale
    DS_ASSIGN_OR_RETURN(out.scales, ShardSpec::Replicate(scale_name, scale_dtype, scale_shape,
                                                         owner(0, 0) == rank));
    return out;
  }
  // The rank's rectangle of the grid, in runs of columns that it sends or
  // not; rows whose runs are alike form one box.
  const QuantGroups& mine = rects[rank];
  struct Run {
    int64_t begin, end;
    bool sends;
    bool operator==(const Run&) const = default;
  };
  const auto runs_of = [&](int64_t r) {
    std::vector<Run> runs;
    for (int64_t c = mine.col_begin; c < mine.col_end; ++c) {
      const bool sends = owner(r, c) == rank;
      if (!runs.empty() && runs.back().sends == sends) {
        runs.back().end = c + 1;
      } else {
        runs.push_back({c, c + 1, sends});
      }
    }
    return runs;
  };
  ShardSpec& spec = out.scales;
  spec.dtype = scale_dtype;
  spec.local_shape = {mine.row_end - mine.row_begin, mine.col_end - mine.col_begin};
  for (int64_t r = mine.row_begin; r < mine.row_end;) {
    const std::vector<Run> runs = runs_of(r);
    int64_t next = r + 1;
    while (next < mine.row_end && runs_of(next) == runs) ++next;
    for (const Run& run : runs) {
      ShardPiece piece =
          ShardPiece::Box(scale_name, scale_shape, {r - mine.row_begin, run.begin - mine.col_begin},
                          {r, run.begin}, {next - r, run.end - run.begin});
      piece.contributes = run.sends;
      spec.pieces.push_back(std::move(piece));
    }
    r = next;
  }
  DS_RETURN_IF_ERROR(spec.Validate());
  return out;
}

}  // namespace deltasync
