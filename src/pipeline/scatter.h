// Writing changes' values into a tensor in place, in ascending position
// order, a piece at a time so that a caller can hash (or otherwise read)
// each piece while it is still in cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>

#include "deltasync/diff.h"
#include "deltasync/status.h"

namespace deltasync::pipeline {

// Writes entries *next, *next + 1, ... of (positions, values) into `target`
// while their position is below `end` (element indices; positions are
// `Pos` integers and values `Elem`-sized, both unaligned, little-endian as
// the host), leaving *next at the first entry not written. The caller has
// checked that every position written lies in the target.
template <typename Elem, typename Pos>
inline void ScatterBelow(const uint8_t* positions, uint64_t count, const uint8_t* values,
                         uint8_t* target, uint64_t end, uint64_t* next) {
  uint64_t i = *next;
  for (; i < count; ++i) {
    Pos p;
    std::memcpy(&p, positions + i * sizeof(Pos), sizeof(Pos));
    if (static_cast<uint64_t>(p) >= end) break;
    std::memcpy(target + static_cast<size_t>(p) * sizeof(Elem), values + i * sizeof(Elem),
                sizeof(Elem));
  }
  *next = i;
}

// ScatterBelow for elements of `elem_size` bytes (1, 2, 4; anything else
// is taken as 8).
template <typename Pos>
inline void ScatterBelowPos(uint32_t elem_size, const uint8_t* positions, uint64_t count,
                            const uint8_t* values, uint8_t* target, uint64_t end, uint64_t* next) {
  switch (elem_size) {
    case 1: return ScatterBelow<uint8_t, Pos>(positions, count, values, target, end, next);
    case 2: return ScatterBelow<uint16_t, Pos>(positions, count, values, target, end, next);
    case 4: return ScatterBelow<uint32_t, Pos>(positions, count, values, target, end, next);
    default: return ScatterBelow<uint64_t, Pos>(positions, count, values, target, end, next);
  }
}

// Writes each change's new value into `target`, the tensor's
// changes.numel * changes.elem_size bytes, in pieces of `piece_bytes`
// (rounded down to whole elements) from byte `begin` to `end`, handing each
// piece to `visit` once its changes are written, while it is still in cache.
// Internal, with nothing written, when a change lies outside [begin, end)
// or the tensor, or the bounds are not whole elements (positions must
// ascend, as the decoders list them).
Status ScatterNewValuesAndVisit(const ChangeSet& changes, std::span<uint8_t> target, size_t begin,
                                size_t end, size_t piece_bytes,
                                const std::function<void(std::span<const uint8_t>)>& visit);

}  // namespace deltasync::pipeline
