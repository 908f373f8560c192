// What the flush frame's writer, reader and destinations share
// (docs/format.md, "Stream: flush frame"): the header's constants and flags
// and the small encoders and checks of its fields. Internal to
// src/stream/frame_*.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace deltasync::stream::frame_wire {

constexpr uint8_t kMagic[4] = {'D', 'S', 'F', 'L'};
constexpr uint8_t kZstdMagic[4] = {0x28, 0xB5, 0x2F, 0xFD};
constexpr uint16_t kFlagSeed = 1;
constexpr uint16_t kFlagDelta = 2;
constexpr uint16_t kFlagLast = 4;
constexpr uint16_t kFlagVerifyAll = 8;
constexpr uint16_t kKnownFlags = kFlagSeed | kFlagDelta | kFlagLast | kFlagVerifyAll;
constexpr size_t kEntryFixedBytes = 64;
constexpr size_t kDigestFixedBytes = 56;
constexpr uint64_t kWidePositionsFrom = uint64_t{1} << 31;
constexpr uint64_t kU24PositionsUpTo = uint64_t{1} << 24;
// A gap is below 2^56: FF and at most 8 LEB128 bytes.
constexpr uint64_t kMaxGapBytes = 9;

inline std::string U64(uint64_t v) { return std::to_string(v); }

inline uint64_t Align8(uint64_t v) { return (v + 7) & ~uint64_t{7}; }

// Appends v as `width` (2 or 8) little-endian bytes.
inline void Append(std::vector<uint8_t>* out, uint64_t v, uint32_t width) {
  const size_t at = out->size();
  out->resize(at + width);
  StoreLeWidth(out->data() + at, v, width);
}

inline bool AllZero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// RFC 3629 UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF.
inline bool IsUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;  // bounds of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    }
    i += len;
  }
  return true;
}

// `name` in single quotes for a message: control characters, quotes,
// backslashes and bytes past ASCII escaped, long names cut short.
inline std::string Quote(std::string_view name) {
  constexpr size_t kMaxShown = 200;
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c >= 0x7F || c == '\'' || c == '\\') {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (name.size() > kMaxShown) out += "...";
  return out + "'";
}

// The element count of a shape, or nullopt when a dimension or the product
// exceeds kMaxStreamNumel (a zero dimension makes it 0 whatever the rest).
inline std::optional<uint64_t> ShapeElements(std::span<const uint64_t> shape) {
  bool zero = false;
  for (uint64_t d : shape) {
    if (d > kMaxStreamNumel) return std::nullopt;
    if (d == 0) zero = true;
  }
  if (zero) return 0;
  uint64_t numel = 1;
  for (uint64_t d : shape) {
    if (numel > kMaxStreamNumel / d) return std::nullopt;
    numel *= d;
  }
  return numel;
}

// The width of an indices entry's positions (docs/format.md, "Encodings"):
// u24 for tensors of at most 2^24 elements from protocol version 2 on.
inline uint32_t PositionWidth(uint64_t numel, uint16_t version) {
  if (version >= 2 && numel <= kU24PositionsUpTo) return 3;
  return numel < kWidePositionsFrom ? 4 : 8;
}

// The gap code of docs/format.md: g < 255 as one byte, else FF and g - 255
// as minimal LEB128.
inline void AppendGap(std::vector<uint8_t>* out, uint64_t gap) {
  if (gap < 255) {
    out->push_back(static_cast<uint8_t>(gap));
    return;
  }
  out->push_back(0xFF);
  uint64_t extra = gap - 255;
  do {
    uint8_t b = extra & 0x7F;
    extra >>= 7;
    if (extra != 0) b |= 0x80;
    out->push_back(b);
  } while (extra != 0);
}

}  // namespace deltasync::stream::frame_wire
