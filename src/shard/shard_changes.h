// A local tensor's changes translated into the HF tensors' flat coordinates
// (docs/format.md, "Stream: sharded gather", "Placements"), and the merge of
// several sorted change lists of one tensor that the translation and the
// gather share.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/shard.h"
#include "deltasync/status.h"

namespace deltasync::stream {

// One HF tensor's changes. `changes` is in the tensor's flat coordinates,
// as DiffTensor of the whole tensor would give them: numel the HF tensor's,
// positions strictly increasing, in pos32 while numel < 2^32 and in pos64
// otherwise, new and old values elem_size bytes each in position order.
struct TensorChanges {
  std::string name;
  ChangeSet changes;
};

// Translates `local`, the changes of the local tensor `spec` describes
// (DiffTensor of it with keep_old_values: local flat positions, new and old
// values), into one TensorChanges per HF tensor the spec's pieces name, in
// the order the pieces first name them. A tensor of pieces that do not
// contribute gets no changes (its entry is still there). Costs O(n) plus
// O(pieces) per local row the changes touch (a box spec), or O(n log k)
// for k pieces of one HF tensor. InvalidArgument, naming the HF tensor of
// the spec's first piece, for a spec Validate refuses, or for changes that
// do not fit it: elem_size other than the dtype's, numel other than the
// local tensor's, positions not strictly increasing or not below numel (or
// in the vector `wide` does not select), value vectors (new and old, both
// required) not count * elem_size bytes.
Result<std::vector<TensorChanges>> TranslateChanges(const ShardSpec& spec, const ChangeSet& local);

// One sorted list of changes of a tensor, as the merge reads it: `count`
// positions of `position_width` (4 or 8) little-endian bytes each, and
// `count` new and old values of the tensor's elem_size bytes each.
struct ChangeRun {
  const uint8_t* positions = nullptr;
  uint32_t position_width = 8;
  const uint8_t* new_values = nullptr;
  const uint8_t* old_values = nullptr;
  uint64_t count = 0;
  // Names the list's origin in messages ("rank 2", "piece 1").
  std::string_view origin;
};

// The positions of `changes` as a ChangeRun.
ChangeRun RunOf(const ChangeSet& changes, std::string_view origin);

// Replaces the contents of `out` with the union of `runs`, in increasing
// position order: out->numel and out->elem_size are kept (set them first),
// out->wide follows numel (narrow below 2^32). Copies runs of consecutive
// changes that come from one list at a time, so lists that hold ranges
// (row shards) cost O(n) and interleaved ones O(n log k). Corruption naming
// the list's origin when a list is not strictly increasing or reaches
// numel; InvalidArgument naming the tensor, the position and both origins
// when two lists hold the same position. `out` is unspecified after an
// error.
Status MergeChangeRuns(std::string_view tensor, std::span<const ChangeRun> runs, ChangeSet* out);

}  // namespace deltasync::stream
