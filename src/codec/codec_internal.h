// Shared pieces of the encoding implementations; not a public interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/status.h"

namespace deltasync::codec_internal {

// The formats are little-endian on every host; these compile to plain loads
// and stores on little-endian machines.
inline void StoreLE32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void StoreLE64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline uint32_t LoadLE32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline uint64_t LoadLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

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

const Codec& DenseCodec();
const Codec& IndicesCodec();
const Codec& XorCodec();
const Codec& OverwriteCodec();
const Codec& SparseCodec();
const Codec& InvalidCodec();

}  // namespace deltasync::codec_internal
