// Shared pieces of the encoding implementations; not a public interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/status.h"

namespace deltasync::codec_internal {

inline bool IsValidElemSize(uint64_t elem_size) {
  return elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8;
}

// dst[i] ^= src[i] for n bytes, a word at a time.
void XorInto(uint8_t* dst, const uint8_t* src, size_t n);

// Checks what every ChangeSet-reading encoder relies on: element size,
// numel * elem_size == new_bytes.size(), value vectors of count * elem_size
// bytes (old values only when `need_old_values`), positions strictly
// ascending and below numel. InvalidArgument naming the first violation.
Status ValidateChangeSet(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                         bool need_old_values, std::string_view encoding_name);

// What every EncodeStream checks of its ranges: each Add continues where
// the last ended, fits the tensor, and carries a valid ChangeSet for its
// range (old values when `need_old_values`); Finish needs the whole tensor.
class StreamRanges {
 public:
  StreamRanges(uint64_t numel, uint32_t elem_size, bool need_old_values,
               std::string_view encoding_name)
      : numel_(numel), es_(elem_size), need_old_(need_old_values), name_(encoding_name) {}
  // Checks one Add and counts its range as covered.
  Status Add(uint64_t first, std::span<const uint8_t> new_chunk, const ChangeSet& piece);
  Status CheckComplete() const;
  uint64_t numel() const { return numel_; }

 private:
  uint64_t numel_;
  uint32_t es_;
  bool need_old_;
  std::string_view name_;
  uint64_t covered_ = 0;
};

// A byte buffer an encoder owns for its lifetime, taken from a per-thread
// pool of spares of its kind and given back to the pool of the thread that
// destroys it: a fresh buffer per tensor would cost a page fault per 4 KiB
// for every tensor of a publish. kZeroed buffers are all zeros whenever they
// are in the pool (their users clear what they wrote before giving back).
class PooledBuffer {
 public:
  enum Kind { kGaps = 0, kPlanes = 1, kZeroed = 2, kKinds = 3 };
  explicit PooledBuffer(Kind kind);
  ~PooledBuffer();
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  Kind kind_;
  std::vector<uint8_t> bytes_;
};

// Codec::Encode through an EncodeStream type: the whole tensor as one range.
template <typename Stream>
Status EncodeAsOneRange(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                        const EncodeOptions& options, std::vector<uint8_t>* out) {
  Stream stream(changes.numel, changes.elem_size, options, out);
  DS_RETURN_IF_ERROR(stream.Add(0, new_bytes, changes));
  return stream.Finish();
}

// Checks the decoder's caller-supplied arguments: a valid element size and a
// target made of whole elements. InvalidArgument otherwise.
Status ValidateTarget(std::span<const uint8_t> target, uint32_t elem_size);

// XOR of the i-th changed element (new ^ old), elem_size bytes, into dst.
inline void ChangedXor(const ChangeSet& changes, uint64_t i, uint8_t* dst) {
  const size_t es = changes.elem_size;
  const uint8_t* n = changes.new_values.data() + i * es;
  const uint8_t* o = changes.old_values.data() + i * es;
  for (size_t b = 0; b < es; ++b) dst[b] = n[b] ^ o[b];
}

// Number of elements in a chunk of about `chunk_bytes`, at least one.
inline size_t ElementsPerChunk(size_t chunk_bytes, size_t elem_size) {
  size_t n = chunk_bytes / elem_size;
  return n ? n : 1;
}

// How many changes ahead of the one being applied a decoder requests the
// tensor's cache line for (ChangeCollector::Prefetch). At 1-3% density the
// changes of a BF16 tensor sit about two lines apart in irregular steps, and
// the hardware prefetcher leaves most of their lines to a miss. Measured on
// a sparse pull (1 GiB, 1.7% changed): 512 ahead (some 60 KB of the tensor)
// 8-12% faster than none, 64 ahead about half that, 4096 slower than 1024.
constexpr size_t kPrefetchLeadChanges = 512;
static_assert((kPrefetchLeadChanges & (kPrefetchLeadChanges - 1)) == 0,
              "a power of two: decoders keep a ring of this many positions");

// Builds the ChangeSet of a delta decoded against a receiver's current bytes
// (Codec::DecodeChanges): each Add* call names an element and either the XOR
// the delta applies to it or the value it writes; elements that end up
// unchanged are skipped. Positions must be added in strictly ascending
// order (decoders whose formats allow any order sort first). The ChangeSet's
// vectors are grown in steps and trimmed to the recorded changes when the
// collector is destroyed, so the hot path is a few fixed-size stores.
class ChangeCollector {
 public:
  // Clears *out (keeping capacity) and sets its numel, elem_size and
  // position width for a tensor of base.size() / elem_size elements.
  // With options.on_changes, full chunks of options.max_chunk_changes go
  // there as they fill.
  ChangeCollector(std::span<const uint8_t> base, uint32_t elem_size, const DecodeOptions& options,
                  ChangeSet* out);
  ~ChangeCollector();
  ChangeCollector(const ChangeCollector&) = delete;
  ChangeCollector& operator=(const ChangeCollector&) = delete;

  // Room for this many changes in all (a hint).
  void Reserve(uint64_t changes);

  // Element `pos` becomes base ^ x (x: ES == elem_size bytes).
  template <size_t ES>
  void AddXor(uint64_t pos, const uint8_t* x) {
    using Elem = ElemOf<ES>;
    Elem xv, ov;
    std::memcpy(&xv, x, ES);
    if (xv == 0) return;
    std::memcpy(&ov, base_ + pos * ES, ES);
    Push<ES>(pos, ov, static_cast<Elem>(ov ^ xv));
  }
  // Asks for the cache line of base element `pos` ahead of its Add (a hint).
  template <size_t ES>
  void Prefetch(uint64_t pos) const {
    __builtin_prefetch(base_ + pos * ES, /*rw=*/0);
  }
  void Prefetch(uint64_t pos) const { __builtin_prefetch(base_ + pos * es_, /*rw=*/0); }
  // Element `pos` becomes v (elem_size bytes).
  void AddNew(uint64_t pos, const uint8_t* v);
  // The elements `found` lists (positions relative to element `first`,
  // new_values holding XOR values, as DiffTensor of an XOR image against
  // zeros gives them) are XORed in.
  void AddXorList(uint64_t first, const ChangeSet& found);
  // Number of elements recorded so far, flushed chunks included.
  uint64_t count() const { return flushed_ + count_; }

 private:
  template <size_t ES>
  using ElemOf = std::conditional_t<
      ES == 1, uint8_t,
      std::conditional_t<ES == 2, uint16_t, std::conditional_t<ES == 4, uint32_t, uint64_t>>>;

  template <size_t ES>
  void Push(uint64_t pos, ElemOf<ES> old_value, ElemOf<ES> new_value) {
    if (count_ == capacity_) {
      if (limit_ != 0 && count_ >= limit_) {
        Flush();
      } else {
        Grow(count_ + 1);
      }
    }
    if (pos32_ != nullptr) {
      pos32_[count_] = static_cast<uint32_t>(pos);
    } else {
      pos64_[count_] = pos;
    }
    std::memcpy(old_ + count_ * ES, &old_value, ES);
    std::memcpy(new_ + count_ * ES, &new_value, ES);
    ++count_;
  }
  template <size_t ES>
  void AddXorListTyped(uint64_t first, const ChangeSet& found);
  void Grow(uint64_t at_least);
  // Hands the full chunk (*out_ sized exactly count_) to the sink and starts over.
  void Flush();

  const uint8_t* base_;
  uint32_t es_;
  ChangeSet* out_;
  const std::function<void(const ChangeSet&)>* sink_ = nullptr;
  uint64_t limit_ = 0;    // chunk size with a sink, else 0
  uint64_t flushed_ = 0;  // changes handed to the sink
  uint64_t count_ = 0;
  uint64_t capacity_ = 0;
  uint32_t* pos32_ = nullptr;
  uint64_t* pos64_ = nullptr;
  uint8_t* old_ = nullptr;
  uint8_t* new_ = nullptr;
};

// The ChangeSet of `new_bytes` against `base` (old values kept only with
// keep_old_values), with the diff kernel and one thread; `base` is never
// written. What a decoder calls when it holds new bytes or XOR values whole.
Status DiffAgainst(std::span<const uint8_t> new_bytes, std::span<const uint8_t> base,
                   uint32_t elem_size, bool keep_old_values, ChangeSet* out);

// Codec::DecodeChanges by way of a scratch copy of `base`: DecodeApply onto
// the copy, then a diff against `base`. Memory is one tensor; decoders use it
// where gathering or ordering their entries would cost more (entries out of
// order, or more entries than the tensor has bytes).
Status DecodeChangesViaCopy(const Codec& codec, std::span<const uint8_t> encoded,
                            std::span<const uint8_t> base, uint32_t elem_size,
                            const DecodeOptions& options, ChangeSet* out);

// Each encoding's codec, defined in its own file with its descriptor
// (EncodingInfo); kCodecs in codec.cc lists them by Encoding value.
const Codec& DenseCodec();
const Codec& IndicesCodec();
const Codec& XorCodec();
const Codec& OverwriteCodec();
const Codec& SparseCodec();
// What GetCodec gives for a value outside the enum.
const Codec& InvalidCodec();

}  // namespace deltasync::codec_internal
