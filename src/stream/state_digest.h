// The state digest of the online transport (docs/format.md, "Stream: state
// digest"): a 128-bit checksum of a set of a tensor's elements that is a sum
// of one hash per element, keyed by the element's flat position in the whole
// tensor. Digests of disjoint sets add, so a sharded trainer's ranks compute
// parts that rank 0 adds, and a change updates a digest from the changed
// elements alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/element_digest.h"
#include "deltasync/diff.h"
#include "deltasync/status.h"
#include "deltasync/thread_pool.h"

namespace deltasync::stream {

// Flat positions are below this (a bound of the digest's position key, far
// past any tensor); the frame refuses larger tensors.
inline constexpr uint64_t kMaxStreamNumel = uint64_t{1} << 56;

// Two independent 64-bit lanes, each a sum mod 2^64. Adding and subtracting
// digests adds and subtracts the sets they describe (disjoint ones).
struct StateDigest {
  uint64_t a = 0;
  uint64_t b = 0;

  StateDigest& operator+=(const StateDigest& o) {
    a += o.a;
    b += o.b;
    return *this;
  }
  StateDigest& operator-=(const StateDigest& o) {
    a -= o.a;
    b -= o.b;
    return *this;
  }
  friend StateDigest operator+(StateDigest x, const StateDigest& y) { return x += y; }
  friend StateDigest operator-(StateDigest x, const StateDigest& y) { return x -= y; }
  bool operator==(const StateDigest&) const = default;

  // 32 lowercase hex digits: lane A then lane B, most significant first.
  std::string ToHex() const;
};

// `rows` rows of `count` consecutive elements, row r starting at flat
// position first + r * row_stride. The whole tensor is {0, numel, 1, 0}.
struct DigestBlock {
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t rows = 1;
  uint64_t row_stride = 0;

  static DigestBlock Range(uint64_t first, uint64_t count) { return {first, count, 1, 0}; }

  // OK when the block is canonical (one representation per set of
  // elements) and in bounds: rows >= 1; for one row, row_stride 0 and first
  // 0 if count is 0; for several, count >= 1 and row_stride > count; the
  // last element below kMaxStreamNumel. InvalidArgument naming the problem
  // otherwise.
  Status Validate() const;
  // Elements in the block; and one past its last element (first for an
  // empty block). Assume a valid block.
  uint64_t elements() const { return count * rows; }
  uint64_t end() const { return rows == 0 ? first : first + (rows - 1) * row_stride + count; }
  // "[first, +count) x rows step row_stride", for messages.
  std::string ToString() const;
  bool operator==(const DigestBlock&) const = default;
};

// Element positions as callers hold them: 32-bit (`narrow`) or 64-bit
// (`wide`) offsets from `base`, so a diff's ChangeSet is used in place. At
// most one of the two spans is non-empty.
struct Positions {
  std::span<const uint32_t> narrow;
  std::span<const uint64_t> wide;
  uint64_t base = 0;

  static Positions Absolute(std::span<const uint64_t> positions) { return {{}, positions, 0}; }
  // The positions of `changes`, offset by `base` (the diffed range's first
  // element in the whole tensor).
  static Positions Of(const ChangeSet& changes, uint64_t base = 0);

  size_t size() const { return wide.empty() ? narrow.size() : wide.size(); }
  // Callers have checked that base + offset does not overflow (Check).
  uint64_t operator[](size_t k) const { return base + (wide.empty() ? narrow[k] : wide[k]); }
  // OK when at most one span is non-empty and the positions are strictly
  // increasing and below `limit`; InvalidArgument naming the first
  // offending index otherwise.
  Status Check(uint64_t limit) const;
};

// The hash of one element (the digest of the set holding only it): position
// below kMaxStreamNumel, `bits` its elem_size bytes as a little-endian
// integer, elem_size 1, 2, 4 or 8 (assumed, not checked). Inline: appliers
// call it once per changed element.
inline StateDigest ElementDigest(uint64_t position, uint64_t bits, uint32_t elem_size) {
  const uint64_t t = element_digest::PositionKey(position, elem_size);
  return {element_digest::FmixA(element_digest::KeyA(t) ^ bits),
          element_digest::FmixB(element_digest::KeyB(t) ^ bits)};
}

// What the digest gains when the element at `position` changes from
// `old_bits` to `new_bits`: ElementDigest(new) - ElementDigest(old), with
// the position's keys computed once.
inline StateDigest ElementChangeDigest(uint64_t position, uint64_t old_bits, uint64_t new_bits,
                                       uint32_t elem_size) {
  const uint64_t t = element_digest::PositionKey(position, elem_size);
  const uint64_t ka = element_digest::KeyA(t), kb = element_digest::KeyB(t);
  return {element_digest::FmixA(ka ^ new_bits) - element_digest::FmixA(ka ^ old_bits),
          element_digest::FmixB(kb ^ new_bits) - element_digest::FmixB(kb ^ old_bits)};
}

// Implementations of the full compute. All give identical digests.
enum class DigestKernel : uint8_t { kScalar, kAvx2, kAvx512 };

// "scalar", "avx2" or "avx512".
std::string_view DigestKernelName(DigestKernel kernel);
// Kernels this CPU can run, slowest first; always starts with kScalar.
std::vector<DigestKernel> AvailableDigestKernels();
// The fastest available kernel. Detected once.
DigestKernel BestDigestKernel();

struct DigestOptions {
  DigestKernel kernel = BestDigestKernel();
  // Worker pool; nullptr = the calling thread only. Must not be called from
  // inside one of the pool's tasks.
  ThreadPool* pool = nullptr;
  // With a pool, spans larger than this are cut into chunks of this many
  // bytes (whole elements) computed in parallel. The digest never depends
  // on it.
  size_t parallel_chunk_bytes = size_t{4} << 20;
};

// The digest of the elements first_position, first_position + 1, ... held
// back to back in `bytes` (a whole number of elem_size-byte elements).
// InvalidArgument for an element size other than 1, 2, 4, 8, a length that
// is not whole elements, positions reaching kMaxStreamNumel, or a kernel
// this CPU cannot run.
Result<StateDigest> ComputeStateDigest(std::span<const uint8_t> bytes, uint32_t elem_size,
                                       uint64_t first_position, const DigestOptions& options = {});

// The same for `count` elements spaced `stride` elements apart in `bytes`
// (element k at byte offset k * stride * elem_size): a destination run with
// a stride. Scalar. InvalidArgument as above, or when the elements do not
// lie within `bytes` or stride is 0.
Result<StateDigest> ComputeStridedStateDigest(std::span<const uint8_t> bytes, uint32_t elem_size,
                                              uint64_t first_position, uint64_t count,
                                              uint64_t stride);

// The digest of the part of `block` that lies in `held`, which holds the
// tensor's elements [held_first, held_first + held.size() / elem_size) back
// to back: a trainer rank's share of a block (a flat shard), or the whole
// block when `held` is the whole tensor (held_first 0). Summing the parts of
// disjoint shards that cover the block gives its digest. InvalidArgument as
// ComputeStateDigest, or for an invalid block.
Result<StateDigest> ComputeBlockPartDigest(std::span<const uint8_t> held, uint32_t elem_size,
                                           uint64_t held_first, const DigestBlock& block,
                                           const DigestOptions& options = {});

// Updates *digest for elements at `positions` changing from `old_values` to
// `new_values` (elem_size bytes each, in position order): subtracts each old
// element's hash and adds the new one's. Positions must be strictly
// increasing and below kMaxStreamNumel (an element listed twice would be
// subtracted twice). InvalidArgument, leaving *digest unchanged, when they
// are not or the value spans are not positions.size() * elem_size bytes.
Status UpdateStateDigest(StateDigest* digest, const Positions& positions,
                         std::span<const uint8_t> old_values, std::span<const uint8_t> new_values,
                         uint32_t elem_size);

}  // namespace deltasync::stream
