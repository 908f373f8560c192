// Flush frames of the online transport (docs/format.md, "Stream: flush
// frame"): the buckets of changed values rank 0 streams to each receiver,
// their writer, their validating reader, and applying an entry in place into
// a receiver's destination through a map from the tensor's flat coordinates.
//
// Every encoding a frame carries gives new values, never differences, so
// applying an entry does not depend on what the destination held and
// applying it twice is harmless.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/dtype_code.h"
#include "core/endian.h"
#include "core/raw_bytes.h"
#include "deltasync/cuda.h"
#include "deltasync/dtype.h"
#include "deltasync/status.h"
#include "deltasync/stream.h"
#include "deltasync/thread_pool.h"
#include "stream/state_digest.h"

namespace deltasync::stream {

// A frame being written: a byte vector whose growth is not zero-filled
// (the writer writes or zeroes every byte it adds).
using FrameBuffer = core_internal::RawBytes;

inline constexpr uint16_t kFlushFrameVersion = 2;
// Readers also take frames of this version and later (version 1: indices
// positions are never u24).
inline constexpr uint16_t kOldestFlushFrameVersion = 1;

// The bytes of each position FlushWriter gives an indices entry of a tensor
// of `numel` elements: 3 (u24) up to 2^24 elements, 4 below 2^31, else 8.
uint32_t WrittenPositionWidth(uint64_t numel);
inline constexpr size_t kFlushHeaderBytes = 64;
inline constexpr size_t kFlushTrailerBytes = 16;
inline constexpr uint32_t kMaxFlushEntries = uint32_t{1} << 20;
inline constexpr uint32_t kMaxFlushDigests = uint32_t{1} << 20;
inline constexpr size_t kMaxTensorNameBytes = 1024;
inline constexpr uint32_t kMaxTensorDims = 16;
inline constexpr uint64_t kMaxFlushFrameBytes = uint64_t{1} << 40;
// All sparse entries of a frame together decompress to at most this.
inline constexpr uint64_t kMaxSparseDecodedBytes = uint64_t{1} << 30;

enum class FrameKind : uint8_t { kSeed, kDelta };

// Values are the wire codes.
enum class WireEncoding : uint8_t { kDense = 0, kIndices = 1, kSparse = 2 };

// "dense", "indices" or "sparse" ("unknown" outside the enum).
std::string_view WireEncodingName(WireEncoding encoding);

// The dtype's code in a frame: DTypeWireCode and DTypeFromWireCode in
// core/dtype_code.h.

struct FlushHeader {
  uint64_t sync_id = 0;      // at least 1
  uint32_t flush_index = 0;  // 0, 1, ... within the sync, per receiver
  FrameKind kind = FrameKind::kDelta;
  bool last = false;        // the sync's last frame to this receiver
  bool verify_all = false;  // only with last: recompute every held block's digest
};

// The tensor an entry belongs to and the element range [first, first +
// count) of its flat coordinates that the entry covers.
struct TensorRange {
  std::string_view name;
  DType dtype = DType::kU8;
  std::span<const int64_t> shape;
  uint64_t first = 0;
  uint64_t count = 0;
};

// Where a placed entry's regions lie in its frame (offsets from the frame's
// start; FlushWriter::BeginPlaced). Indices: positions_bytes holds n
// positions of position_width bytes; dense: no positions.
struct PlacedEntry {
  uint64_t positions_offset = 0;
  uint64_t positions_bytes = 0;
  uint32_t position_width = 0;
  uint64_t values_offset = 0;
  uint64_t values_bytes = 0;
};

// A sparse entry's two regions, compressed ahead of the frame that takes
// them (FlushWriter::AddSparseRegions): a sender compresses many units'
// entries at once on its threads, a SparseEncoder per thread. Records the
// range it was made for; a writer refuses it for another.
struct SparseRegions {
  std::string name;
  DType dtype = DType::kU8;
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t n = 0;                  // changed elements
  uint64_t decoded = 0;            // gap and value bytes once decompressed
  std::vector<uint8_t> positions;  // one zstd frame of the gap-coded positions
  std::vector<uint8_t> values;     // one zstd frame of the value planes
};

// Gap-codes and compresses sparse entries (docs/format.md, "sparse"): its
// scratch and zstd context are kept from entry to entry. Not thread-safe.
class SparseEncoder {
 public:
  SparseEncoder();
  ~SparseEncoder();
  SparseEncoder(const SparseEncoder&) = delete;
  SparseEncoder& operator=(const SparseEncoder&) = delete;

  // The elements at `positions` (absolute, strictly increasing, inside the
  // range) and their values, as AddSparse takes them, into *out; the same
  // refusals (InvalidArgument). `decoded_limit`: OutOfRange when the
  // decompressed regions would exceed it (no frame could take them).
  Status Encode(const TensorRange& range, const Positions& positions,
                std::span<const uint8_t> values, int zstd_level, uint64_t decoded_limit,
                SparseRegions* out);
  // The gap section of the last Encode (or Build), before compression.
  std::span<const uint8_t> gaps() const { return gaps_; }
  std::span<const uint8_t> planes() const { return planes_; }
  // Only the gap section and the value planes, uncompressed (checked as
  // Encode checks): false when they exceed `decoded_limit`.
  Result<bool> Build(const TensorRange& range, const Positions& positions,
                     std::span<const uint8_t> values, uint64_t decoded_limit);
  // One zstd frame of `content`, its size recorded, into `out` (at least
  // ZSTD_compressBound(content.size()) bytes): the bytes written.
  Result<size_t> Compress(std::span<const uint8_t> content, int zstd_level, std::span<uint8_t> out);

 private:
  std::vector<uint8_t> gaps_;
  std::vector<uint8_t> planes_;
  struct Context;
  std::unique_ptr<Context> zstd_;
};

// Builds one frame at a time into a caller's buffer, appending each entry's
// positions and values straight into it, up to a byte budget. Reusable: its
// scratch buffers (sparse staging, the zstd context) are kept from frame to
// frame. Not thread-safe; one writer per thread.
//
// Everything it writes, FlushReader accepts: an Add call refuses
// (InvalidArgument, naming the tensor and the problem) whatever the reader
// would refuse, and leaves the frame as it was. An Add that returns false
// did not fit (the budget, or the frame's sparse decode limit) and also
// left the frame as it was: finish this frame and add it to the next, or,
// when an empty frame refuses it too, split the range.
class FlushWriter {
 public:
  FlushWriter();
  ~FlushWriter();
  FlushWriter(const FlushWriter&) = delete;
  FlushWriter& operator=(const FlushWriter&) = delete;

  // Starts a frame in *out (cleared; its capacity is kept, so reserve the
  // budget once to write without reallocating). `budget_bytes` bounds the
  // finished frame, at least 80 and at most kMaxFlushFrameBytes.
  // InvalidArgument for sync id 0, verify_all without last, a bad budget or
  // a null out.
  Status Begin(const FlushHeader& header, uint64_t budget_bytes, FrameBuffer* out);
  // Threads for copying large values into the frame (nullptr: the calling
  // thread alone); kept across frames.
  void SetPool(ThreadPool* pool) { pool_ = pool; }

  // A frame whose payload the caller writes elsewhere (a device bucket):
  // the writer lays the entries out (PlaceDense, PlaceIndices) and builds
  // the header and manifest. The caller writes each entry's bytes at the
  // offsets given and zeros every other payload byte (the padding), puts
  // *out's first 64 bytes (the header) at offset 0 of the frame and the
  // rest (the manifest) at payload_end(), and appends the trailer: the
  // xxh3-128 of all of it, as Finish would. The same checks and budget as
  // Begin; Add calls are refused on such a frame (FailedPrecondition).
  Status BeginPlaced(const FlushHeader& header, uint64_t budget_bytes, FrameBuffer* out);
  // Dense and indices entries of a placed frame (n positions): where their
  // regions go, or nullopt when the entry does not fit (the frame is as it
  // was). The same refusals as AddDense and AddIndices, but for the bytes,
  // which the writer never sees.
  Result<std::optional<PlacedEntry>> PlaceDense(const TensorRange& range);
  Result<std::optional<PlacedEntry>> PlaceIndices(const TensorRange& range, uint64_t n);

  // Every element of the range, `values` holding count * elem_size bytes.
  Result<bool> AddDense(const TensorRange& range, std::span<const uint8_t> values);
  // The elements at `positions` (absolute flat positions, strictly
  // increasing, inside the range), as int32 (tensors under 2^31 elements) or
  // int64 positions, and their values (positions.size() * elem_size bytes,
  // in order). Not in a seed frame.
  Result<bool> AddIndices(const TensorRange& range, const Positions& positions,
                          std::span<const uint8_t> values);
  // The same elements as gap-coded positions and value planes, each one
  // zstd frame. Not in a seed frame.
  Result<bool> AddSparse(const TensorRange& range, const Positions& positions,
                         std::span<const uint8_t> values);
  // A sparse entry compressed ahead (SparseEncoder::Encode) for this
  // range: InvalidArgument when it was made for another.
  Result<bool> AddSparseRegions(const TensorRange& range, const SparseRegions& regions);
  // The expected digest of a block of a tensor. A frame holds at most one
  // record per tensor and block.
  Result<bool> AddDigest(std::string_view name, const DigestBlock& block,
                         const StateDigest& digest);

  // Writes the manifest, the header and the trailer: *out holds the frame
  // (placed: the header and the manifest, no trailer). FailedPrecondition
  // without Begin (or after Finish).
  Status Finish();

  // Where the payload ends (a multiple of 8): the manifest's offset once
  // finished.
  uint64_t payload_end() const { return (end_ + 7) & ~uint64_t{7}; }

  // The size the frame would have if finished now.
  uint64_t frame_bytes() const;
  uint32_t entry_count() const { return entry_count_; }
  uint32_t digest_count() const { return digest_count_; }
  // zstd level of sparse entries (default 1).
  void set_zstd_level(int level) { zstd_level_ = level; }
  // Lowers the frame's sparse decode limit (kMaxSparseDecodedBytes, never
  // raised): for receivers that keep less scratch, and for tests.
  void set_sparse_decoded_limit(uint64_t bytes) {
    sparse_decoded_limit_ = std::min(bytes, kMaxSparseDecodedBytes);
  }

 private:
  struct TensorEntries {
    DType dtype;
    std::vector<int64_t> shape;
    std::map<uint64_t, uint64_t> ranges;  // first -> end
  };
  Status Start(const FlushHeader& header, uint64_t budget_bytes, FrameBuffer* out, bool placed);
  Status CheckMode(bool placed) const;
  Status CheckRange(const TensorRange& range, WireEncoding encoding, uint64_t* numel) const;
  Status CheckValues(const TensorRange& range, const Positions* positions,
                     std::span<const uint8_t> values) const;
  bool Fits(uint64_t payload_end, size_t manifest_add) const;
  void AppendEntry(const TensorRange& range, WireEncoding encoding, uint64_t n, uint64_t pos_off,
                   uint64_t pos_bytes, uint64_t val_off, uint64_t val_bytes);
  // A sparse entry of no changes: no regions.
  Result<bool> AddEmptySparse(const TensorRange& range, uint64_t pos_off, size_t entry_bytes);
  // Appends `values` to the frame, on the pool when they are large.
  void CopyIn(std::span<const uint8_t> values);

  FrameBuffer* out_ = nullptr;
  ThreadPool* pool_ = nullptr;
  bool placed_ = false;
  uint64_t end_ = 0;  // the payload's end so far (its last region's)
  FlushHeader header_;
  uint64_t budget_ = 0;
  std::vector<uint8_t> manifest_;  // the entries
  std::vector<uint8_t> records_;   // the digest records, after the entries
  uint32_t entry_count_ = 0;
  uint32_t digest_count_ = 0;
  uint64_t sparse_decoded_ = 0;
  // By name, found by a string_view.
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view name) const { return std::hash<std::string_view>{}(name); }
  };
  std::unordered_map<std::string, TensorEntries, NameHash, std::equal_to<>> tensors_;
  std::set<std::tuple<std::string, uint64_t, uint64_t, uint64_t, uint64_t>> digest_keys_;
  SparseEncoder sparse_;
  int zstd_level_ = 1;
  uint64_t sparse_decoded_limit_ = kMaxSparseDecodedBytes;
};

// One entry of a frame that FlushReader accepted. Views into the frame or
// into the reader's scratch: valid until the reader reads another frame or
// is destroyed, and as long as the frame's bytes live.
struct FlushEntry {
  std::string_view name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t first = 0;  // the range [first, first + count)
  uint64_t count = 0;
  WireEncoding encoding = WireEncoding::kDense;
  uint64_t value_count = 0;     // n: values carried
  uint32_t position_width = 0;  // indices: 3, 4 or 8; otherwise 0
  // indices: n little-endian positions of position_width bytes; sparse: the
  // decompressed gap section; dense: empty.
  std::span<const uint8_t> positions;
  // n values of DTypeSize(dtype) bytes in position order (sparse: already
  // gathered back from its planes).
  std::span<const uint8_t> values;
  // False for a frame read with ReadPlaced: positions and values then view
  // memory the host does not read (a device bucket).
  bool host_readable = true;
};

struct FlushDigest {
  std::string_view name;
  DigestBlock block;
  StateDigest digest;
};

// The checks of a frame's payload that a reader of a placed frame
// (FlushReader::ReadPlaced) leaves to the memory that holds it: bytes that
// must be 0 (padding), and indices positions that must be strictly
// increasing inside [first, end). Offsets are from the frame's start. The
// checks are the device's (cuda::CheckFrameOnDevice runs them as they are).
struct PayloadChecks {
  std::vector<cuda::ZeroCheck> zeros;
  std::vector<cuda::PositionCheck> positions;
};
// Runs every check where the payload lies: the index of the first that
// fails (the zeros first, then position check k as zeros.size() + k), or
// nullopt when all hold; an error when it could not check.
using PayloadChecker = std::function<Result<std::optional<uint64_t>>(const PayloadChecks&)>;

// Validates whole frames (docs/format.md, "Rules the reader enforces") and
// only then exposes their entries and digest records. Reusable: its sparse
// scratch is kept from frame to frame. Not thread-safe.
class FlushReader {
 public:
  FlushReader();
  ~FlushReader();
  FlushReader(const FlushReader&) = delete;
  FlushReader& operator=(const FlushReader&) = delete;

  // Checks `frame` completely: the trailer's xxh3-128 first, then every
  // field, region and position, decompressing sparse entries into the
  // reader's scratch. Corruption (Unsupported for another protocol version)
  // with a one-line message naming the frame's sync id and flush index (once
  // the checksum has passed) and the entry's index and tensor; nothing is
  // exposed then. `frame` must outlive the entries' views.
  Status Read(std::span<const uint8_t> frame);
  // As Read, with the xxh3-128 of the frame's bytes before its trailer
  // already computed by the caller (as the bytes came in: 16 bytes, in
  // the trailer's order); rule 2 compares it with the trailer.
  Status Read(std::span<const uint8_t> frame, std::span<const uint8_t> checksum);

  // A frame of `frame_bytes` bytes at `base`, in memory the host does not
  // read (a device bucket), whose trailer the caller has checked against
  // the rest (rule 2). `head` is a host copy of its first 64 bytes;
  // `manifest(offset, bytes)` gives a host copy of the manifest once the
  // header says where it is. Rules 3 to 11 as Read, except that the
  // payload's padding and positions are checked by `check`, before
  // anything is exposed. The entries' views point at `base` and are not
  // host_readable. A frame holding sparse entries (zstd content, decoded
  // on the host) sets *needs_host and exposes nothing: read it with Read.
  Status ReadPlaced(
      std::span<const uint8_t> head, uint64_t frame_bytes,
      const std::function<Result<std::span<const uint8_t>>(uint64_t, uint64_t)>& manifest,
      const uint8_t* base, const PayloadChecker& check, bool* needs_host);

  // Exposes nothing, as after a refusal (a caller that refuses a frame
  // before reading it).
  void Clear();

  // The last frame Read accepted (empty after a refusal).
  const FlushHeader& header() const { return header_; }
  std::span<const FlushEntry> entries() const {
    return std::span<const FlushEntry>(entries_).first(entry_count_);
  }
  std::span<const FlushDigest> digests() const {
    return std::span<const FlushDigest>(digests_).first(digest_count_);
  }

 private:
  // Rules 3 to 11 over a frame whose header is at `head`, whose manifest
  // `manifest` gives and whose payload is at `base`: checked here when
  // `check` is null (host memory), by `check` otherwise.
  Status ReadParts(
      uint64_t size, const uint8_t* head,
      const std::function<Result<std::span<const uint8_t>>(uint64_t, uint64_t)>& manifest,
      const uint8_t* base, const PayloadChecker* check, bool* needs_host);

  // One tensor's entries in a frame agree and do not overlap, and its
  // digest records are for distinct blocks (rule 11): "" or the problem.
  std::string CheckTensors(uint32_t entry_count, uint32_t digest_count);

  FlushHeader header_;
  // The exposed entries and records are the first entry_count_ and
  // digest_count_; the vectors, and the entries' shapes, keep their
  // memory from frame to frame (a frame of thousands of small tensors
  // would otherwise allocate that much afresh each time).
  std::vector<FlushEntry> entries_;
  std::vector<FlushDigest> digests_;
  size_t entry_count_ = 0;
  size_t digest_count_ = 0;
  // Where each entry's regions lie, while the payload is checked.
  struct Regions {
    uint64_t pos_off, pos_bytes, val_off, val_bytes;
  };
  std::vector<Regions> regions_;
  std::vector<std::pair<uint64_t, uint64_t>> sparse_sizes_;  // gap and value bytes
  std::vector<uint32_t> order_;                              // rule 11's sorts
  std::vector<uint32_t> slots_;                              // rule 11's names
  std::vector<uint8_t> decoded_;
  std::vector<uint8_t> planes_;
  struct ZstdContexts;
  std::unique_ptr<ZstdContexts> zstd_;
};

// Rewrites the trailer of `frame` (at least kFlushTrailerBytes bytes) to the
// xxh3-128 of the bytes before it: a frame edited behind a good trailer, as
// tests and the fuzz target make them to reach the checks after it.
void ResealFlushFrame(std::span<uint8_t> frame);

// Read's refusal of a frame of `frame_bytes` bytes whose `trailer` is not
// the `computed` xxh3-128 of the rest (`header`: its first 64 bytes).
Status TrailerMismatch(uint64_t frame_bytes, std::span<const uint8_t> header,
                       std::span<const uint8_t> trailer, std::span<const uint8_t> computed);

// The size of the frame whose first 64 bytes are `header`, for a receiver
// reading frames from a byte stream: checks the magic, the version and that
// the size is in [80, kMaxFlushFrameBytes]. Nothing else is believed before
// the whole frame passes FlushReader::Read. Corruption (Unsupported for
// another version) otherwise.
Result<uint64_t> PeekFlushFrameBytes(std::span<const uint8_t> header);

// Calls fn(k, position) for each of a read entry's value_count values, in
// order (dense: first + k).
template <typename Fn>
void ForEachPosition(const FlushEntry& entry, Fn&& fn);

// The positions of a read entry, as absolute flat positions.
std::vector<uint64_t> EntryPositions(const FlushEntry& entry);

// A run of a destination map (include/deltasync/stream.h).
using ::deltasync::DestinationRun;

// Where a receiver keeps (part of) one tensor: runs from the tensor's flat
// coordinates into a destination buffer of elements of the tensor's dtype.
// The whole tensor is one run; a slice of rows one run; a slice of columns
// one run per row; a part of a fused parameter is the tensor's run at the
// part's offset in the fused buffer.
class DestinationMap {
 public:
  // The tensor in a buffer of its own: one run (0, numel, 0, 1); no run for
  // numel 0.
  static DestinationMap Whole(uint64_t numel);
  // Sorts `runs` by hf_first and checks them: numel at most kMaxStreamNumel;
  // every run of at least one element, a stride of at least 1, inside the
  // tensor, not overlapping another run in the tensor, and with destination
  // elements addressable in 64 bits. InvalidArgument naming the run
  // otherwise. Two tensor elements sent to one destination element are not
  // detected (strided runs may legitimately interleave).
  static Result<DestinationMap> Create(uint64_t hf_numel, std::vector<DestinationRun> runs);
  // The elements of `block`, row r contiguous at destination element
  // dest_offset + r * dest_row_stride (dest_row_stride >= block.count when
  // there are several rows). InvalidArgument for an invalid block or one
  // past the tensor.
  static Result<DestinationMap> FromBlock(uint64_t hf_numel, const DigestBlock& block,
                                          uint64_t dest_offset, uint64_t dest_row_stride);

  uint64_t hf_numel() const { return hf_numel_; }
  // Destination elements a buffer needs: one past the highest one mapped.
  uint64_t dest_extent() const { return dest_extent_; }
  // Tensor elements the map holds.
  uint64_t held() const { return held_; }
  std::span<const DestinationRun> runs() const { return runs_; }
  // The held elements as one block (runs that touch merged), or nullopt
  // when they are not one block. An empty map is the empty block.
  std::optional<DigestBlock> AsBlock() const;

 private:
  uint64_t hf_numel_ = 0;
  uint64_t dest_extent_ = 0;
  uint64_t held_ = 0;
  std::vector<DestinationRun> runs_;
};

// Writes a read entry's values into `dest` through `map`, in place, as byte
// copies (NaN payloads, -0.0 and every other bit pattern land as sent);
// positions the map does not hold are skipped. With `digest`, it is updated
// for every element written: the hash of the bytes replaced subtracted, the
// new one added, so a running digest of the held elements stays the digest
// of dest. Returns the number of elements written. InvalidArgument, before
// writing anything, when the map is for another element count than the
// entry's tensor, dest is smaller than map.dest_extent() elements, or the
// entry is not host_readable. `dest` must not overlap the frame.
Result<uint64_t> ApplyEntry(const FlushEntry& entry, const DestinationMap& map,
                            std::span<uint8_t> dest, StateDigest* digest = nullptr);

// Where ApplyEntries writes one entry: its tensor's map and memory.
struct EntryDestination {
  const DestinationMap* map = nullptr;
  std::span<uint8_t> dest;
};

// What ApplyEntries did.
struct AppliedEntries {
  // Entries [0, applied) were applied: every entry, or those before the
  // first that failed (the others were applied too, but for those that
  // failed, which wrote nothing).
  size_t applied = 0;
  uint64_t written = 0;  // elements written by entries [0, applied)
  Status failed;         // entry `applied`'s error, when applied < entries
};

// Applies entries[k] into dests[k] for every k, as ApplyEntry does, on
// `pool` and the calling thread (nullptr: the caller alone), in the order
// of the memory they write rather than the frame's: entries next to each
// other there form tasks balanced by their bytes, many small entries to a
// task and a large one possibly alone, so that a frame of thousands of
// small tensors costs about what the same bytes in a few tensors do, and a
// dense entry larger than a task is cut into pieces of a task's bytes (a
// seed's frame of one large tensor is copied on every thread). With
// `moves`, it is resized to the entries' count and moves[k] set to entry
// k's digest move (the change ApplyEntry makes to a digest), for the
// caller to add to each tensor's running digest; without it no digest is
// computed (a seed). The entries must write distinct elements: those of a
// tensor do not overlap (a read frame's rule), and two tensors' memories
// must not either. A dests.size() other than entries.size() is refused
// (InvalidArgument, nothing applied).
AppliedEntries ApplyEntries(std::span<const FlushEntry> entries,
                            std::span<const EntryDestination> dests, ThreadPool* pool,
                            std::vector<StateDigest>* moves);

// The digest of every element `map` holds, read from `dest` (elements of
// elem_size bytes): what a running digest must equal, recomputed. The same
// errors as ComputeStateDigest, and InvalidArgument when dest is smaller
// than map.dest_extent() elements.
Result<StateDigest> DigestDestination(const DestinationMap& map, std::span<const uint8_t> dest,
                                      uint32_t elem_size, const DigestOptions& options = {});

// ---------------------------------------------------------------------------

template <typename Fn>
void ForEachPosition(const FlushEntry& entry, Fn&& fn) {
  const uint64_t n = entry.value_count;
  switch (entry.encoding) {
    case WireEncoding::kDense:
      for (uint64_t k = 0; k < n; ++k) fn(k, entry.first + k);
      return;
    case WireEncoding::kIndices: {
      const uint8_t* p = entry.positions.data();
      if (entry.position_width == 3) {
        for (uint64_t k = 0; k < n; ++k) fn(k, LoadPosition<3>(p + 3 * k));
      } else if (entry.position_width == 4) {
        for (uint64_t k = 0; k < n; ++k) fn(k, LoadLe<uint32_t>(p + 4 * k));
      } else {
        for (uint64_t k = 0; k < n; ++k) fn(k, LoadLe<uint64_t>(p + 8 * k));
      }
      return;
    }
    case WireEncoding::kSparse: {
      // The reader checked the section: exactly n minimal gaps.
      const uint8_t* p = entry.positions.data();
      uint64_t next = entry.first;  // the smallest position the next gap can give
      for (uint64_t k = 0; k < n; ++k) {
        uint64_t gap = *p++;
        if (gap == 0xFF) {
          uint64_t extra = 0;
          for (int shift = 0;; shift += 7) {
            const uint8_t b = *p++;
            extra |= uint64_t{b & 0x7Fu} << shift;
            if ((b & 0x80) == 0) break;
          }
          gap = 255 + extra;
        }
        const uint64_t position = next + gap;
        fn(k, position);
        next = position + 1;
      }
      return;
    }
  }
}

}  // namespace deltasync::stream
