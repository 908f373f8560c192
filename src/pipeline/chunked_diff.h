// The fused pass a producer runs over each tensor: the diff against the
// snapshot a chunk at a time, with the digests of the snapshot's bytes
// (before a refresh) and of the new bytes computed from the same chunks,
// so that each byte comes from memory once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "deltasync/checksum.h"
#include "deltasync/diff.h"
#include "deltasync/status.h"

namespace deltasync::pipeline {

// Bytes of each tensor handled at a time by the fused diff-and-hash pass:
// the snapshot and new pieces (2x this) stay in L2 between the base digest,
// the diff and the new digest, so each byte comes from memory once.
inline constexpr size_t kFusedChunkBytes = size_t{512} << 10;

// Elements per chunk of `chunk_bytes`: whole elements, at least one, and
// few enough that a chunk's positions fit in 32 bits. `elem_size` must not
// be 0.
uint64_t ChunkNumel(size_t chunk_bytes, uint32_t elem_size);

// The whole-tensor checks of DiffTensor (element size 1, 2, 4 or 8, equal
// lengths of whole elements, no partial overlap), done once before a
// chunked pass so that no chunk fails after earlier ones were refreshed.
// InvalidArgument naming the problem.
Status CheckChunkedOperands(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                            uint32_t elem_size);

// Takes the changes of one chunk: elements [first, first + new_chunk.size()
// / elem_size) hold new_chunk and `piece` lists their changes relative to
// `first`.
using ChunkSink = std::function<Status(uint64_t first, std::span<const uint8_t> new_chunk,
                                       const ChangeSet& piece)>;

// DiffTensor(new_bytes, snapshot, options, ...) done `chunk_bytes` (rounded
// down to whole elements, at least one) at a time, each chunk's changes
// handed to `sink` instead of gathered: every hasher of `base_hashers` is
// fed each snapshot piece before the diff may refresh it, and every one of
// `new_hashers` each new piece right after the diff read it. options.pool
// is not used; `piece` is scratch. Errors as DiffTensor's, with the
// snapshot untouched; a sink error stops the pass (earlier chunks stay
// refreshed).
Status DiffAndHashInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                           const DiffOptions& options, size_t chunk_bytes,
                           std::span<Hasher* const> base_hashers,
                           std::span<Hasher* const> new_hashers, ChangeSet* piece,
                           const ChunkSink& sink);

// The pass above with the chunks' changes gathered into `out`, which ends
// up exactly as DiffTensor(new_bytes, snapshot, options, out) leaves it;
// `base_hasher` and `new_hasher` may be null. InvalidArgument when `out` or
// `piece` is null. A failure past the first chunk (which the whole-tensor
// checks done first rule out) would leave the earlier chunks refreshed and
// their changes in `out`, so that a caller can still undo them.
Status DiffAndHashInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                           const DiffOptions& options, size_t chunk_bytes, Hasher* base_hasher,
                           Hasher* new_hasher, ChangeSet* piece, ChangeSet* out);

// Appends one chunk's changes, found at element `first` of the tensor, to
// the tensor's ChangeSet `out` (whose numel, elem_size and width are set):
// positions shifted by `first`, old values, and new values when
// `with_new_values`. The chunk is narrow (it holds < 2^32 elements); the
// tensor may be wide.
void AppendShifted(const ChangeSet& piece, uint64_t first, bool with_new_values, ChangeSet* out);

// Refreshes `snapshot` to `new_bytes` as DiffTensor does (only changed
// elements are written), kFusedChunkBytes at a time through `piece`,
// returning how many elements changed. Errors as CheckChunkedOperands.
Result<uint64_t> RefreshInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                                 uint32_t elem_size, ChangeSet* piece);

}  // namespace deltasync::pipeline
