// Little-endian integers in byte buffers, the byte order of every format in
// docs/format.md: one set of loads and stores for all modules. They are
// memcpys, so each compiles to a single (unaligned) mov.
#pragma once

#include <bit>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace deltasync {

// The loads and stores below copy host integers as they are, and the data
// path reads integers that lie in memory (change positions, element bits)
// as wire bytes in place: both hold on little-endian hosts only.
static_assert(std::endian::native == std::endian::little,
              "deltasync needs a little-endian host: its formats store integers little-endian "
              "and it reads and writes them in host byte order");

// The T (an unsigned integer) stored little-endian at p; p needs no alignment.
template <std::unsigned_integral T>
inline T LoadLe(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Writes v little-endian to the sizeof(T) bytes at p (no alignment needed).
// T is never deduced, so the width written is always the one named.
template <std::unsigned_integral T>
inline void StoreLe(uint8_t* p, std::type_identity_t<T> v) {
  std::memcpy(p, &v, sizeof(T));
}

// The unsigned integer of W bytes, for loops whose width is a template
// argument: LoadLe<UintOfWidth<W>>(p) stays one mov. void for a W other
// than 1, 2, 4 or 8, which LoadLe and StoreLe then reject.
template <uint32_t W>
using UintOfWidth = std::conditional_t<
    W == 1, uint8_t,
    std::conditional_t<
        W == 2, uint16_t,
        std::conditional_t<W == 4, uint32_t, std::conditional_t<W == 8, uint64_t, void>>>>;

// A flush frame's position of W bytes (3: u24, 4 or 8), zero-extended:
// loops over positions take W as a template argument and stay branch-free.
template <uint32_t W>
inline uint64_t LoadPosition(const uint8_t* p) {
  if constexpr (W == 3) {
    return uint64_t{p[0]} | uint64_t{p[1]} << 8 | uint64_t{p[2]} << 16;
  } else {
    return LoadLe<UintOfWidth<W>>(p);
  }
}

// The `width`-byte integer at p, zero-extended, for a width known only at
// run time. width must be 1, 2, 3, 4 or 8 (callers have checked it; any
// other value reads 8 bytes).
inline uint64_t LoadLeWidth(const uint8_t* p, uint32_t width) {
  switch (width) {
    case 1: return LoadLe<uint8_t>(p);
    case 2: return LoadLe<uint16_t>(p);
    case 3: return LoadPosition<3>(p);
    case 4: return LoadLe<uint32_t>(p);
    default: return LoadLe<uint64_t>(p);
  }
}

// Writes the low `width` bytes of v little-endian at p; width as for
// LoadLeWidth (1, 2, 3, 4 or 8; any other value writes 8 bytes).
inline void StoreLeWidth(uint8_t* p, uint64_t v, uint32_t width) {
  switch (width) {
    case 1: StoreLe<uint8_t>(p, static_cast<uint8_t>(v)); return;
    case 2: StoreLe<uint16_t>(p, static_cast<uint16_t>(v)); return;
    case 3:
      p[0] = static_cast<uint8_t>(v);
      p[1] = static_cast<uint8_t>(v >> 8);
      p[2] = static_cast<uint8_t>(v >> 16);
      return;
    case 4: StoreLe<uint32_t>(p, static_cast<uint32_t>(v)); return;
    default: StoreLe<uint64_t>(p, v); return;
  }
}

}  // namespace deltasync
