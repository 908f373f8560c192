// A sharded trainer's layout (docs/format.md, "Stream: sharded sync"): which
// rank holds which part of which HF tensor, exchanged once per formation of
// the trainer group so that rank 0 can check that every element has one
// contributing rank and place the dense values of a seed without holding
// any copy of the model; the runs of a piece inside a range of an HF
// tensor; and the dense gather of one batch.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/shard.h"
#include "deltasync/status.h"

namespace deltasync::stream {

// `count` consecutive elements of a piece: HF flat position `hf`, local
// flat position `local`.
struct PieceRun {
  uint64_t hf = 0;
  uint64_t local = 0;
  uint64_t count = 0;
};

// Calls fn for each run of `piece` (of a local tensor of `local_shape`; a
// valid spec's) that lies in the HF flat range [first, first + count), in
// increasing HF position, clipped to the range.
void ForEachPieceRun(const ShardPiece& piece, const std::vector<int64_t>& local_shape,
                     uint64_t first, uint64_t count,
                     const std::function<void(const PieceRun&)>& fn);

// One HF tensor of the model, by name, dtype and shape.
struct LayoutTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
};

// A range of one HF tensor's flat elements: a batch's part of it.
struct Segment {
  std::string name;
  uint64_t first = 0;
  uint64_t count = 0;
  uint32_t w = 1;  // element size
};

// A rank's contributing pieces by HF tensor: (local tensor, piece) indices
// in layout order.
using PiecesByTensor = std::map<std::string, std::vector<std::pair<size_t, size_t>>, std::less<>>;
PiecesByTensor ContributingPieces(std::span<const ShardSpec> specs);

// The layout's wire form (docs/format.md, "Layout messages": the JSON and
// its checksum) and its reading: Corruption for bytes that do not parse.
std::vector<uint8_t> EncodeLayout(std::span<const ShardSpec> specs);
Result<std::vector<ShardSpec>> DecodeLayout(std::span<const uint8_t> bytes);

// Every rank of `group`: sends its layout to rank 0. On rank 0 returns every
// rank's layout (index: rank); on the others an empty vector. A rank whose
// own specs are bad passes the error as `refusal`: it sends none and returns
// that error, and rank 0 fails naming it. Rank 0 receives every layout sent
// before it fails, so that no rank is left waiting. The communicator's
// errors as they come; Corruption for a record or layout that breaks the
// format, InvalidArgument for a refusal or a spec Validate refuses.
Result<std::vector<std::vector<ShardSpec>>> ExchangeLayout(Communicator& group,
                                                           std::span<const ShardSpec> mine,
                                                           const Status& refusal);

// Rank 0's check of the layouts against the model: every spec's dtype and
// pieces' shapes are the model's, and the contributing pieces of each HF
// tensor neither overlap (InvalidArgument naming the tensor and both
// ranks) nor leave an element uncovered (InvalidArgument naming the tensor
// and the first such element).
Status CheckLayout(std::span<const LayoutTensor> model,
                   const std::vector<std::vector<ShardSpec>>& by_rank);

// The bytes a rank's dense gather message of `segments` holds.
uint64_t DenseBytes(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                    std::span<const Segment> segments);
// Reads local tensor i's current elements [first, first + count) into
// `out` (count * its element size bytes).
using LocalReader = std::function<Status(size_t i, uint64_t first, uint64_t count, uint8_t* out)>;
// This rank's dense gather message: the current values of its contributing
// pieces in `segments`, in the message's order, read through `read` (a
// device shard's come from the device); `out` is resized to DenseBytes.
// The reader's error, as it is.
Status PackDense(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                 const LocalReader& read, std::span<const Segment> segments,
                 std::vector<uint8_t>* out);
// The same from host memory: `data[i]` is local tensor i's bytes.
void PackDense(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
               std::span<const std::span<const uint8_t>> data, std::span<const Segment> segments,
               std::vector<uint8_t>* out);
// Places a rank's message into `buffers` (one per segment, count * w bytes:
// the segment's dense values).
void UnpackDense(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                 std::span<const uint8_t> message, std::span<const Segment> segments,
                 std::span<const std::span<uint8_t>> buffers);

}  // namespace deltasync::stream
