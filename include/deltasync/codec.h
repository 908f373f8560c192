// Per-tensor delta encodings: turning a ChangeSet into bytes, and applying
// those bytes to a receiver's copy of the tensor in place.
//
// Five encodings, chosen by name (docs/format.md, "Delta encodings",
// describes each byte by byte):
//   dense      the tensor's new bytes, raw (the seeding pass).
//   indices    verl's (positions, values) pairs behind a 24-byte header.
//   xor        vime/slime: one zstd frame decompressing to new ^ old.
//   overwrite  vime/slime: one zstd frame decompressing to u32 K, K u32 byte
//              positions, K new bytes.
//   sparse     ours: gap-coded positions + byte-plane-split XOR values, zstd;
//              falls back per tensor to whole-tensor XOR planes when denser.
//
// Encoders read only the ChangeSet (and, for dense, the new bytes): the diff
// has already refreshed the snapshot, so the old values of changed elements
// exist only in ChangeSet::old_values. xor and sparse also encode from a stream
// of per-range ChangeSets (EncodeStream), byte for byte as from the whole
// list, so a publisher never holds a large tensor's changes at once. Decoders stream through
// bounded buffers (one decode chunk, or one format block for sparse) and never allocate in
// proportion to the tensor, so applying a delta to a huge tensor costs no more
// memory than applying it to a small one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/status.h"

namespace deltasync {

// Values are stable: they may be stored (e.g. in flush frames), never reused.
// They run from 0 without gaps (the codec registry is indexed by them), and
// an encoding's name is its enumerator's in lower case without the `k` (the
// build derives the per-encoding fuzz targets from this list; codec_test
// checks both rules).
enum class Encoding : uint8_t {
  kDense = 0,
  kIndices = 1,
  kXor = 2,
  kOverwrite = 3,
  kSparse = 4,
};

// What one encoding is and what it can do: its descriptor, defined beside
// its codec (src/codec/<name>.cc) and the one place that states these facts.
// The CLI, the store, the benchmarks and the tests read them from here
// instead of listing encodings themselves.
struct EncodingInfo {
  Encoding encoding;
  // The name used in index metadata (`delta_encoding`), on the command line
  // and in messages.
  std::string_view name;
  // The index's `compression_format` for a version in this encoding: "zstd"
  // when the encoding holds zstd frames, "none" otherwise.
  std::string_view compression;
  // Encode needs ChangeSet::old_values (DiffOptions::keep_old_values).
  bool needs_old_values = false;
  // DecodeApply reads the target's current contents, so the target must hold
  // exactly the base the delta was made against.
  bool needs_base = true;
  // Applying the same bytes twice leaves the same result as applying them
  // once (not so for XOR-valued encodings: twice reverts).
  bool idempotent = false;
  // Codec::NewEncodeStream gives a stream: the encoder takes a tensor's diff
  // a range at a time.
  bool streams = false;
  // The bytes hold every changed element's whole new value: applying them
  // sets those elements whatever the target held there, and the new values
  // can be read from the delta without the base. A transport that cannot
  // promise the exact base at the changed elements needs this (delivering a
  // delta again needs only `idempotent`). Not so for the encodings that hold
  // XORs with the base, nor for overwrite, which holds only the bytes that
  // changed within an element.
  bool carries_values = false;
  // The vime/slime Python receiver applies versions in this encoding.
  bool read_by_python_receiver = false;
  // zstd's content checksum when EncodeOptions::zstd_checksum is unset
  // (encodings with zstd frames only).
  bool zstd_checksum_by_default = false;
  // The largest tensor, in bytes, the format can address; Encode refuses a
  // larger one with Unsupported.
  uint64_t max_tensor_bytes = UINT64_MAX;
};

// The descriptor of `encoding`. A value outside the enum gets one named
// "unknown", with an empty compression, no capabilities and
// max_tensor_bytes 0.
const EncodingInfo& GetEncodingInfo(Encoding encoding);

// The name of `encoding` (GetEncodingInfo(encoding).name): "unknown" for a
// value outside the enum.
std::string_view EncodingName(Encoding encoding);

// Inverse of EncodingName (exact, lowercase). InvalidArgument naming the
// accepted values for anything else.
Result<Encoding> ParseEncoding(std::string_view name);

// Every encoding, in enum order (for CLIs, benchmarks and tests).
std::span<const Encoding> AllEncodings();

// Every encoding's name in enum order, joined by `separator`, with
// `last_separator` between the last two: JoinEncodingNames(", ", " or ")
// is "dense, indices, xor, overwrite or sparse".
std::string JoinEncodingNames(std::string_view separator, std::string_view last_separator);
std::string JoinEncodingNames(std::string_view separator);

// How the sparse encoding lays out one tensor. kAuto picks per tensor by
// density (trying both in the band where either can win).
enum class SparseMode : uint8_t {
  kAuto = 0,
  kPositions = 1,  // gap-coded positions + XOR planes of the changed elements
  kXorPlanes = 2,  // XOR planes of every element (dense fallback)
};

struct EncodeOptions {
  // zstd level for xor, overwrite and sparse. vime/slime always use 1, and at
  // this data's entropy higher levels buy almost nothing for much more time.
  int zstd_level = 1;
  // Adds zstd's content checksum (4 bytes per frame) so that a corrupted frame
  // fails to decode instead of applying wrong bytes. The peer's decoder
  // accepts frames with or without it. Unset: on for every encoding but
  // xor, whose frame content is the whole XOR image: hashing it costs a pass
  // over the tensor's size when publishing and again when pulling (0.09 s
  // of 0.97 for a 1 GiB model), while the store verifies every tensor's own
  // checksum after apply anyway, as the peers' frames (written without one)
  // need.
  std::optional<bool> zstd_checksum;
  // zstd_checksum, or the encoding's default when it is unset
  // (EncodingInfo::zstd_checksum_by_default).
  bool ZstdChecksumFor(Encoding encoding) const {
    return zstd_checksum.value_or(GetEncodingInfo(encoding).zstd_checksum_by_default);
  }
  SparseMode sparse_mode = SparseMode::kAuto;
  // Bytes of zeros-and-XOR (xor) or positions (overwrite) staged per step
  // while streaming into the compressor. Rounded down to whole elements.
  // Small enough for the stage to stay in L2 while it is built and
  // compressed (a 1 GiB xor publish took 2-7% longer with 1 MiB).
  size_t chunk_bytes = size_t{256} << 10;
};

struct DecodeOptions {
  // Bytes decompressed per step before being applied (xor, overwrite).
  // Small enough to stay in L2 between zstd's copy out and its use (a 1 GiB
  // xor pull took 3% longer with 1 MiB).
  size_t chunk_bytes = size_t{256} << 10;
  // Largest zstd window a frame may ask for (log2 bytes). Bounds decoder
  // memory against hostile frames; level-1 frames use at most 2^19.
  int zstd_window_log_max = 27;
  // DecodeChanges only. When set, each time *out holds max_chunk_changes
  // changes (1 if 0) they are handed to on_changes and *out starts over, so
  // a tensor of any size is listed in bounded memory; what is left at the
  // end stays in *out. Chunks come in ascending position order. The scratch-
  // copy fallback and dense deliver everything in *out. On error, chunks
  // already handed over are not taken back: the caller discards them.
  std::function<void(const ChangeSet&)> on_changes;
  uint64_t max_chunk_changes = 0;
};

// Encodes one tensor from its diff handed over a range at a time, so that the
// encoder never holds the tensor's whole ChangeSet: memory is its block
// buffers plus the output. Made by Codec::NewEncodeStream. Streams are
// independent: any number may be open at once, but each is used by one
// thread at a time.
class EncodeStream {
 public:
  virtual ~EncodeStream() = default;
  // Elements [first, first + new_chunk.size() / elem_size) hold new_chunk
  // and differ from the base exactly at `piece`'s positions, which are
  // relative to `first` (ascending, with new and old values, as DiffTensor
  // of the range gives them). Ranges must come in order, each starting where
  // the last ended. InvalidArgument otherwise, or when the piece does not
  // fit its range.
  virtual Status Add(uint64_t first, std::span<const uint8_t> new_chunk,
                     const ChangeSet& piece) = 0;
  // Appends to the output exactly the bytes Codec::Encode appends for the
  // whole tensor. InvalidArgument when the ranges do not cover the tensor.
  virtual Status Finish() = 0;
};

// One encoding: its descriptor and its two directions. Implementations are
// stateless singletons (GetCodec), safe to use from many threads at once.
class Codec {
 public:
  virtual ~Codec() = default;

  // What this encoding is and can do; the accessors below read it.
  virtual const EncodingInfo& info() const = 0;

  Encoding encoding() const { return info().encoding; }
  std::string_view name() const { return info().name; }
  // EncodingInfo::needs_old_values, needs_base and idempotent.
  bool needs_old_values() const { return info().needs_old_values; }
  bool needs_base() const { return info().needs_base; }
  bool idempotent() const { return info().idempotent; }

  // Appends the encoding of one tensor to *out (existing bytes are kept, so
  // several tensors can be packed into one buffer). `new_bytes` is the
  // tensor's new contents; `changes` is its diff against the base, with
  // ascending unique positions and changes.numel * changes.elem_size ==
  // new_bytes.size() (dense reads only new_bytes and ignores `changes`).
  // InvalidArgument when the ChangeSet is inconsistent or lacks old values
  // that this encoding needs; Unsupported when the tensor exceeds what the
  // format can address (EncodingInfo::max_tensor_bytes; overwrite: 2^32).
  // On error *out may hold a partial encoding past its original size.
  virtual Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                        const EncodeOptions& options, std::vector<uint8_t>* out) const = 0;

  // Applies `encoded` (exactly one tensor's encoding) to `target` in place.
  // `elem_size` (1, 2, 4 or 8) must match the encoder's; target.size() must
  // be a multiple of it. Corruption when the bytes violate the format, do not
  // fit the target, or fail the zstd checksum; never reads or writes outside
  // `encoded` and `target`. Decoding streams, so on error the target may have
  // been partly updated: callers must treat it as damaged (the store verifies
  // per-tensor checksums and never serves a partial checkpoint).
  virtual Status DecodeApply(std::span<const uint8_t> encoded, std::span<uint8_t> target,
                             uint32_t elem_size, const DecodeOptions& options) const = 0;

  // What DecodeApply would do to `base`, without writing it: replaces *out
  // with the ChangeSet (numel, elem_size, ascending unique positions, old
  // values read from `base`, new values) of every element whose bytes the
  // delta changes. An element the delta writes with its current value is not
  // listed. Accepts and rejects exactly the input DecodeApply does, with the
  // same status codes. Memory is the decoder's bounded buffers plus *out
  // (proportional to the changed elements), which lets a receiver journal a
  // delta before it touches its checkpoint; only indices/overwrite entries
  // out of order (or more overwrite entries than the tensor has bytes) are
  // applied to one scratch copy of the tensor and diffed instead. *out's
  // vectors keep their capacity, so reusing one ChangeSet avoids
  // reallocation; on error its contents are unspecified.
  virtual Status DecodeChanges(std::span<const uint8_t> encoded, std::span<const uint8_t> base,
                               uint32_t elem_size, const DecodeOptions& options,
                               ChangeSet* out) const = 0;
  // A stream that appends the encoding of a tensor of `numel` elements of
  // `elem_size` bytes to *out (which must outlive it), or null when this
  // encoding only encodes whole ChangeSets (EncodingInfo::streams false).
  virtual std::unique_ptr<EncodeStream> NewEncodeStream(uint64_t numel, uint32_t elem_size,
                                                        const EncodeOptions& options,
                                                        std::vector<uint8_t>* out) const {
    (void)numel, (void)elem_size, (void)options, (void)out;
    return nullptr;
  }
};

// The implementation of `encoding`; lives for the whole program. A value
// outside the enum gets a codec whose operations fail with InvalidArgument.
const Codec& GetCodec(Encoding encoding);

// GetCodec(encoding).Encode(...).
Status Encode(Encoding encoding, std::span<const uint8_t> new_bytes, const ChangeSet& changes,
              const EncodeOptions& options, std::vector<uint8_t>* out);

// GetCodec(encoding).DecodeApply(...).
Status DecodeApply(Encoding encoding, std::span<const uint8_t> encoded, std::span<uint8_t> target,
                   uint32_t elem_size, const DecodeOptions& options = {});

// GetCodec(encoding).DecodeChanges(...).
Status DecodeChanges(Encoding encoding, std::span<const uint8_t> encoded,
                     std::span<const uint8_t> base, uint32_t elem_size, ChangeSet* out,
                     const DecodeOptions& options = {});

// The fixed fields of a sparse encoding, for inspection tools.
struct SparseHeader {
  SparseMode mode = SparseMode::kPositions;  // never kAuto
  uint32_t elem_size = 0;
  uint64_t numel = 0;
  uint64_t count = 0;  // changed elements
};
inline constexpr size_t kSparseHeaderBytes = 24;

// Parses and checks the header at the start of a sparse encoding (magic,
// version, mode, element size, count <= numel). Corruption otherwise.
Result<SparseHeader> ReadSparseHeader(std::span<const uint8_t> encoded);

// The information-theoretic size of a delta under a simple model: positions
// i.i.d. with probability p = count / numel, and XOR values (new ^ old, one
// elem_size-wide symbol per changed element) i.i.d. with their empirical
// distribution. Real encoders are measured against it.
struct EntropyBound {
  uint64_t numel = 0;
  uint64_t count = 0;
  double position_bytes = 0;  // numel * H2(p) / 8
  double value_bytes = 0;     // count * H(xor symbols) / 8
  double total_bytes() const { return position_bytes + value_bytes; }
  // 0 when nothing changed.
  double bytes_per_changed() const { return count ? total_bytes() / count : 0.0; }
};

// Computes the bound for `changes`, which must carry old values.
// InvalidArgument when it does not or its vectors disagree in size.
Result<EntropyBound> EntropyBoundBytes(const ChangeSet& changes);

}  // namespace deltasync
