// The sharded gather (docs/format.md, "Stream: sharded gather",
// "Messages"): every trainer rank's changes of one batch of HF tensors,
// brought to rank 0 of the trainer group and merged per tensor.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/dtype.h"
#include "deltasync/status.h"
#include "deltasync/thread_pool.h"
#include "shard/shard_changes.h"

namespace deltasync::stream {

inline constexpr size_t kGatherRecordBytes = 40;
inline constexpr size_t kGatherIndexRecordBytes = 16;

// A tensor of a batch, as every rank lists it.
struct GatherTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
};

// The batch key of `tensors` (docs/format.md: xxh3-64 of the list's
// encoding). InvalidArgument for a list the gather refuses: more than 2^32
// - 1 tensors, a name of more than 65535 bytes or a shape of more than 255
// dimensions, a negative dimension or more than kMaxShardNumel elements.
Result<uint64_t> GatherBatchKey(std::span<const GatherTensor> tensors);

// Called by every rank of `group` with the same batch id and list; `mine`
// is this rank's changes of tensors of the list (TranslateChanges' output,
// any number of entries per tensor, none for a tensor it has no changes
// of). On rank 0 returns one TensorChanges per listed tensor, in list
// order: the union of every rank's changes, merged in increasing position
// order. Other ranks get an empty vector. Every rank returns only after its
// part of the exchange is done, whatever it found wrong, so that no rank is
// left waiting (a communicator failure aside).
//
// Fails with the communicator's error (Unavailable, DeadlineExceeded, ...,
// breaking it); with InvalidArgument when this rank's own `mine` is bad
// (a tensor not in the list, another elem_size or numel than the list's,
// positions not strictly increasing or past numel, value vectors of the
// wrong size, two entries of one tensor sharing a position) or the list is
// (GatherBatchKey); on rank 0, with InvalidArgument when another rank
// refused its own changes or gathers another batch or list, or when two
// ranks send the same position of a tensor (naming both, the tensor and
// the position), and with Corruption for a record or payload that breaks
// the format. These leave the group usable.
//
// A rank that could not make its changes passes its error as `refusal`: it
// then refuses (sends no payload) and returns that error, and rank 0 fails
// the batch naming it. Rank 0 merges the tensors' lists on `pool` when one
// is given (the first error in list order is the one returned).
Result<std::vector<TensorChanges>> GatherChanges(Communicator& group, uint64_t batch_id,
                                                 std::span<const GatherTensor> tensors,
                                                 std::span<const TensorChanges> mine,
                                                 const Status& refusal = Status::OK(),
                                                 ThreadPool* pool = nullptr);

}  // namespace deltasync::stream
