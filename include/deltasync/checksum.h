// Streaming checksums over tensor bytes: xxh3-64, xxh3-128, BLAKE3, adler32.
//
// Hex digests are formatted exactly as the Python libraries print them, so a
// digest written by deltasync compares equal, as a string, with one written by
// a Python peer:
//   xxh3-64   xxhash.xxh3_64(b).hexdigest()    16 hex digits (big-endian)
//   xxh3-128  xxhash.xxh3_128(b).hexdigest()   32 hex digits (high 64 first)
//   blake3    blake3.blake3(b).hexdigest()     64 hex digits (output bytes)
//   adler32   f"{zlib.adler32(b):08x}"         8 hex digits
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"

namespace deltasync {

enum class ChecksumAlgo : uint8_t { kXxh3_64, kXxh3_128, kBlake3, kAdler32 };

// "xxh3-64", "xxh3-128", "blake3", "adler32".
std::string_view ChecksumAlgoName(ChecksumAlgo algo);
// Inverse of ChecksumAlgoName; anything else is Unsupported.
Result<ChecksumAlgo> ParseChecksumAlgo(std::string_view name);
// Digest length in bytes (8, 16, 32, 4); the hex form is twice as long.
size_t ChecksumDigestSize(ChecksumAlgo algo);

// One incremental hasher. Feeding the same bytes in any split gives the same
// digest as feeding them at once.
class Hasher {
 public:
  virtual ~Hasher() = default;
  virtual ChecksumAlgo algo() const = 0;
  virtual void Update(std::span<const uint8_t> data) = 0;
  // The digest in the byte order its hex form is printed in. Does not
  // disturb the state: more Update calls may follow.
  virtual std::vector<uint8_t> Digest() const = 0;
  // Back to the empty-input state.
  virtual void Reset() = 0;

  std::string HexDigest() const;
};

std::unique_ptr<Hasher> NewHasher(ChecksumAlgo algo);

// One-shot helpers.
std::vector<uint8_t> ChecksumBytes(ChecksumAlgo algo, std::span<const uint8_t> data);
std::string ChecksumHex(ChecksumAlgo algo, std::span<const uint8_t> data);

// Lowercase hex of arbitrary bytes.
std::string ToHex(std::span<const uint8_t> bytes);

// Hashes the file at `path` with buffered reads.
Result<std::string> ChecksumFileHex(ChecksumAlgo algo, const std::string& path);

}  // namespace deltasync
