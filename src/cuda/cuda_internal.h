// What the host side of the cuda module (runtime.cc) and its kernels (*.cu)
// share: one launch description per kernel family. Launchers only enqueue
// and return the launch's error; the host side checks arguments first and
// turns errors into Status.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deltasync::cuda::internal {

// The fused diff's tiles: 256 threads, each comparing eight 16-byte groups
// (four of one-byte elements, whose masks take more registers): 32 KiB of
// each tensor per tile, so that few tiles pass their offsets along.
inline constexpr uint32_t kDiffThreads = 256;
constexpr uint32_t DiffRounds(uint32_t elem_size) { return elem_size == 1 ? 4 : 8; }
constexpr uint64_t DiffTileElems(uint32_t elem_size) {
  return uint64_t{kDiffThreads} * DiffRounds(elem_size) * 16 / elem_size;
}

inline uint64_t DiffTiles(uint64_t numel, uint32_t elem_size) {
  const uint64_t per_tile = DiffTileElems(elem_size);
  return (numel + per_tile - 1) / per_tile;
}

// A pinned host snapshot is read in chunks of this many bytes (a multiple
// of every tile), copied in by the copy engine while the previous chunk is
// compared.
inline constexpr uint64_t kPinnedChunkBytes = uint64_t{32} << 20;

// Results the finishing kernels leave in device memory: the count (diff)
// or the first bad index (checks), then the two digest lanes.
struct Results {
  unsigned long long count;
  unsigned long long a;
  unsigned long long b;
  unsigned long long pad;
};

// A diff's current elements made by quantizing a weight on the fly (the
// fused quantize-then-diff): element e of the diff is the F8_E4M3 code of
// weight element first + e. `weight` null: the current elements are read
// as they are.
enum class QuantKind : uint32_t { kBf16 = 0, kF16 = 1, kF32 = 2 };
struct QuantLoad {
  const void* weight = nullptr;  // the whole [rows, cols] weight
  QuantKind kind = QuantKind::kBf16;
  bool aligned16 = false;  // weight 16-byte aligned
  uint32_t scheme = 0;     // a deltasync::QuantScheme
  uint64_t cols = 1;
  uint64_t scale_cols = 1;     // scale groups per scale row
  const float* inv = nullptr;  // per scale group: what its elements are multiplied by
  uint64_t first = 0;
};

struct DiffLaunch {
  const void* current = nullptr;
  void* snapshot = nullptr;  // refreshed here
  // Read here instead: element e of the snapshot at snapshot_read[e -
  // read_first] (a staged chunk of a pinned snapshot); nullptr: snapshot.
  const void* snapshot_read = nullptr;
  uint64_t read_first = 0;
  // Tiles this launch covers: the next `tiles` by ticket (the tile states
  // and the ticket carry over from the launches before it).
  uint64_t tiles = 0;
  uint64_t numel = 0;
  uint32_t elem_size = 2;
  bool aligned16 = false;  // both tensors 16-byte aligned
  void* positions = nullptr;
  bool wide = false;
  void* values = nullptr;
  void* old_values = nullptr;
  bool refresh = true;
  bool digest = true;
  uint64_t first_position = 0;
  // Scratch: DiffTiles() tile states and (with digest) 2 per tile digest
  // lanes; the tile ticket; where the finishing kernel writes.
  unsigned long long* tile_state = nullptr;
  unsigned long long* tile_digest = nullptr;
  unsigned long long* ticket = nullptr;
  Results* results = nullptr;
  cudaStream_t stream = nullptr;
  QuantLoad quant;  // elem_size 1 only
};
// Zeroes the tile states and the ticket for `tiles` tiles.
cudaError_t LaunchDiffReset(const DiffLaunch& launch, uint64_t tiles);
// Runs the diff over the launch's tiles.
cudaError_t LaunchDiffTiles(const DiffLaunch& launch);
// The count and digest change over `tiles` tiles, into results.
cudaError_t LaunchDiffFinish(const DiffLaunch& launch, uint64_t tiles);

// The scale step of the fused quantize-then-diff: each scale group's amax
// (MAX-reduced as float bits into `amax_bits`, zeroed first), then its
// scale (into `scales`, as the recipe stores it) and inverse (into `inv`).
// A group whose amax is a NaN or an infinity sets results->count to 1
// (zeroed first).
struct QuantScaleLaunch {
  QuantLoad load;  // weight, kind, aligned16, scheme, cols, scale_cols
  uint64_t rows = 0;
  uint32_t scale_format = 0;  // a deltasync::ScaleFormat
  uint64_t groups = 0;
  unsigned int* amax_bits = nullptr;
  float* inv = nullptr;
  void* scales = nullptr;
  Results* results = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchQuantScales(const QuantScaleLaunch& launch);
// Writes the codes of weight elements 0 .. numel - 1 (q.first 0) to `codes`.
cudaError_t LaunchQuantEncode(const QuantLoad& q, uint64_t numel, uint8_t* codes,
                              cudaStream_t stream);

struct ScatterLaunch {
  void* dest = nullptr;
  uint32_t elem_size = 2;
  const void* positions = nullptr;
  uint32_t width = 4;  // position bytes: 3 (u24), 4 (int32) or 8 (int64)
  const void* values = nullptr;
  uint64_t count = 0;
  uint64_t limit = 0;  // positions must be below it
  Results* results = nullptr;
  cudaStream_t stream = nullptr;
};
// Writes in results->count the first index whose position is out of range
// or not above the one before (UINT64_MAX when none).
cudaError_t LaunchCheckPositions(const ScatterLaunch& launch);
cudaError_t LaunchScatter(const ScatterLaunch& launch);

// A destination run with stride 1 (the receiver's map), in device memory.
struct RunLaunch {
  uint64_t hf_first;
  uint64_t count;
  uint64_t dest_offset;
};
// Writes each value whose (checked) position lies in one of `nruns` runs,
// ascending by hf_first, at the run's destination element; skips the
// others, and any destination element at or past `dest_numel`.
struct ScatterRunsLaunch {
  void* dest = nullptr;
  uint64_t dest_numel = 0;
  uint32_t elem_size = 2;
  const void* positions = nullptr;
  uint32_t width = 4;  // position bytes: 3, 4 or 8
  const void* values = nullptr;
  uint64_t count = 0;
  const RunLaunch* runs = nullptr;
  uint64_t nruns = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchScatterRuns(const ScatterRunsLaunch& launch);

// A batched scatter (ScatterBatchOnDevice): `items` and `starts` (items + 1
// entries: the index of each item's first value among all `total`) in
// device memory.
struct BatchItemLaunch {
  void* dest;
  uint64_t dest_numel;
  const void* positions;  // null for a dense range from `first`
  const void* values;
  uint64_t count;
  uint64_t first;
  const RunLaunch* runs;
  uint64_t nruns;
  uint32_t elem_size;
  uint32_t width;
};
struct ScatterBatchLaunch {
  const BatchItemLaunch* items = nullptr;
  const uint64_t* starts = nullptr;
  uint64_t nitems = 0;
  uint64_t total = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchScatterBatch(const ScatterBatchLaunch& launch);

// The frame checks (include/deltasync/cuda.h, CheckFrameOnDevice): `zeros`
// then `position_checks`, and per position check the index of its first
// element among all positions (`starts`, position_checks + 1 entries), in
// device memory. Writes the index of the first failing check in
// results->count (UINT64_MAX when none).
struct FrameZero {
  uint64_t offset;
  uint64_t bytes;
};
struct FramePositions {
  uint64_t offset;
  uint64_t count;
  uint64_t width;
  uint64_t first;
  uint64_t end;
};
struct FrameCheckLaunch {
  const uint8_t* base = nullptr;
  const FrameZero* zeros = nullptr;
  uint64_t nzeros = 0;
  const FramePositions* positions = nullptr;
  const uint64_t* starts = nullptr;
  uint64_t npositions = 0;
  uint64_t total_positions = 0;
  Results* results = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchFrameCheck(const FrameCheckLaunch& launch);

// dest[i] = src[i] + add: int32 or int64 sources, u24, int32 or int64
// destinations (dest_width 3, 4 or 8).
struct CopyPositionsLaunch {
  void* dest = nullptr;
  uint32_t dest_width = 4;
  const void* src = nullptr;
  bool src_wide = false;
  uint64_t count = 0;
  uint64_t add = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchCopyPositions(const CopyPositionsLaunch& launch);

// offsets[k] = the number of sorted positions below k * unit, for k in
// [0, units]; offsets in device memory.
struct SplitLaunch {
  const void* positions = nullptr;
  bool wide = false;
  uint64_t count = 0;
  uint64_t unit = 1;
  uint64_t units = 0;
  unsigned long long* offsets = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchSplitPositions(const SplitLaunch& launch);

// Partial sums per block of the digest kernels: at most this many blocks.
inline constexpr uint32_t kDigestMaxBlocks = 2048;

struct DigestLaunch {
  const void* data = nullptr;  // full digest: the elements
  uint64_t numel = 0;
  uint32_t elem_size = 2;
  bool aligned16 = false;
  uint64_t first_position = 0;
  // Digest change: positions (+ base) with old and new values.
  const void* positions = nullptr;
  uint32_t width = 4;  // position bytes: 3, 4 or 8
  const void* old_values = nullptr;
  const void* new_values = nullptr;
  uint64_t base = 0;
  // Digest change: only positions (+ base) in this block count (rows 0:
  // every position).
  uint64_t block_first = 0;
  uint64_t block_count = 0;
  uint64_t block_rows = 0;
  uint64_t block_row_stride = 0;
  unsigned long long* partials = nullptr;  // 2 * kDigestMaxBlocks
  Results* results = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t LaunchStateDigest(const DigestLaunch& launch);
cudaError_t LaunchDigestChange(const DigestLaunch& launch);

// xxh3-128 of more than 240 bytes: per 1 KiB block sums, then the chain of
// scrambles. `block_sums` holds 8 lanes per whole block. Writes high64 in
// results->a and low64 in results->b.
inline constexpr uint64_t kXxhBlockBytes = 1024;
struct XxhLaunch {
  const void* data = nullptr;
  uint64_t bytes = 0;
  unsigned long long* block_sums = nullptr;
  Results* results = nullptr;
  cudaStream_t stream = nullptr;
};
inline uint64_t XxhBlocks(uint64_t bytes) { return (bytes - 1) / kXxhBlockBytes; }
cudaError_t LaunchXxh3_128(const XxhLaunch& launch);

}  // namespace deltasync::cuda::internal
