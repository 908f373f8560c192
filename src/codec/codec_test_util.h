// Test data for the codec tests: tensor pairs with controlled changes and
// realistic BF16 optimizer steps, plus their ChangeSets.
#pragma once

#include <gtest/gtest.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "deltasync/codec.h"
#include "deltasync/diff.h"

namespace deltasync::codec_test {

struct TensorPair {
  std::vector<uint8_t> old_bytes;
  std::vector<uint8_t> new_bytes;
  uint32_t elem_size = 1;
  size_t numel() const { return old_bytes.size() / elem_size; }
};

// Flips bits of one element (possibly none: callers retry). Low-bit flips
// model optimizer steps; whole-element noise models everything else.
inline void ChangeElement(uint8_t* element, uint32_t elem_size, std::mt19937_64& rng) {
  if (rng() & 1) {
    element[0] ^= static_cast<uint8_t>(1 + rng() % 7);
    return;
  }
  for (uint32_t b = 0; b < elem_size; ++b) element[b] ^= static_cast<uint8_t>(rng());
}

// Random old bytes; every element in `positions` is changed in new.
inline TensorPair MakePairAt(size_t numel, uint32_t elem_size, const std::vector<size_t>& positions,
                             uint64_t seed) {
  std::mt19937_64 rng(seed);
  TensorPair pair;
  pair.elem_size = elem_size;
  pair.old_bytes.resize(numel * elem_size);
  for (uint8_t& b : pair.old_bytes) b = static_cast<uint8_t>(rng());
  pair.new_bytes = pair.old_bytes;
  for (size_t pos : positions) {
    uint8_t* element = pair.new_bytes.data() + pos * elem_size;
    std::vector<uint8_t> before(element, element + elem_size);
    do {
      ChangeElement(element, elem_size, rng);
    } while (std::memcmp(element, before.data(), elem_size) == 0);
  }
  return pair;
}

// About `density` of the elements changed, at i.i.d. positions (1.0: all).
inline TensorPair MakePair(size_t numel, uint32_t elem_size, double density, uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x5eed);
  std::bernoulli_distribution pick(density);
  std::vector<size_t> positions;
  for (size_t i = 0; i < numel; ++i) {
    if (density >= 1.0 || pick(rng)) positions.push_back(i);
  }
  return MakePairAt(numel, elem_size, positions, seed);
}

// IEEE binary32 -> bfloat16, round to nearest even (as torch does).
inline uint16_t ToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// BF16 weights before and after one Adam-like step: fp32 master weights
// ~N(0, 0.02) move by `step` in a random direction and are re-rounded, so
// only elements whose rounding flips change (~1-3% for step ~ 3e-7..6e-7).
inline TensorPair MakeBf16Step(size_t numel, float step, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  TensorPair pair;
  pair.elem_size = 2;
  pair.old_bytes.resize(numel * 2);
  pair.new_bytes.resize(numel * 2);
  for (size_t i = 0; i < numel; ++i) {
    float w = weight(rng);
    uint16_t before = ToBf16(w);
    uint16_t after = ToBf16(w - ((rng() & 1) ? step : -step));
    std::memcpy(&pair.old_bytes[2 * i], &before, 2);
    std::memcpy(&pair.new_bytes[2 * i], &after, 2);
  }
  return pair;
}

// The ChangeSet a trainer would produce: DiffTensor against a snapshot that
// holds the old bytes, keeping old values.
inline ChangeSet DiffPair(const TensorPair& pair) {
  std::vector<uint8_t> snapshot = pair.old_bytes;
  DiffOptions options;
  options.elem_size = pair.elem_size;
  options.refresh_snapshot = true;
  options.keep_old_values = true;
  ChangeSet changes;
  Status status = DiffTensor(pair.new_bytes, snapshot, options, &changes);
  EXPECT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(snapshot, pair.new_bytes);
  return changes;
}

// The encoding of `pair` through the codec's EncodeStream, the tensor cut
// into ranges of `range_numel` elements, each diffed on its own as a
// publisher's chunked pass does. Fails the test on any error.
inline std::vector<uint8_t> EncodeByRanges(Encoding encoding, const TensorPair& pair,
                                           const EncodeOptions& options, size_t range_numel) {
  std::vector<uint8_t> out;
  const size_t es = pair.elem_size;
  const size_t numel = pair.new_bytes.size() / es;
  std::unique_ptr<EncodeStream> stream =
      GetCodec(encoding).NewEncodeStream(numel, pair.elem_size, options, &out);
  EXPECT_NE(stream, nullptr);
  if (stream == nullptr) return out;
  ChangeSet piece;
  for (size_t first = 0; first < numel; first += range_numel) {
    const size_t n = std::min(range_numel, numel - first);
    std::span<const uint8_t> new_range(pair.new_bytes.data() + first * es, n * es);
    std::vector<uint8_t> old_range(pair.old_bytes.begin() + first * es,
                                   pair.old_bytes.begin() + (first + n) * es);
    DiffOptions diff;
    diff.elem_size = pair.elem_size;
    diff.refresh_snapshot = false;
    Status status = DiffTensor(new_range, old_range, diff, &piece);
    if (status.ok()) status = stream->Add(first, new_range, piece);
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (!status.ok()) return out;
  }
  Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.ToString();
  return out;
}

// One-shot zstd of `content` at `level`, as python-zstandard's compress()
// makes it (the Python peers write xor this way, at level 1).
inline std::vector<uint8_t> ZstdCompress(std::span<const uint8_t> content, int level = 1) {
  std::vector<uint8_t> out(ZSTD_compressBound(content.size()));
  const size_t n = ZSTD_compress(out.data(), out.size(), content.data(), content.size(), level);
  EXPECT_FALSE(ZSTD_isError(n)) << ZSTD_getErrorName(n);
  out.resize(ZSTD_isError(n) ? 0 : n);
  return out;
}

// new ^ old over every byte: the content of a vime xor frame.
inline std::vector<uint8_t> XorImage(const TensorPair& pair) {
  std::vector<uint8_t> image(pair.new_bytes.size());
  for (size_t i = 0; i < image.size(); ++i) image[i] = pair.new_bytes[i] ^ pair.old_bytes[i];
  return image;
}

// Checks Codec::DecodeChanges against DecodeApply: given the status and
// result of DecodeApply on a copy of `base`, DecodeChanges must fail with the
// same code when it failed, and otherwise list exactly the elements that
// differ between `base` and `applied` (ascending, with their old and new
// values), without writing `base`.
// The changes DecodeChanges listed, flattened (positions widened).
struct ListedChanges {
  std::vector<uint64_t> positions;
  std::vector<uint8_t> old_values;
  std::vector<uint8_t> new_values;

  void Append(const ChangeSet& c) {
    for (uint64_t i = 0; i < c.count(); ++i) positions.push_back(c.position(i));
    old_values.insert(old_values.end(), c.old_values.begin(), c.old_values.end());
    new_values.insert(new_values.end(), c.new_values.begin(), c.new_values.end());
  }
};

// Exactly the elements that differ between `base` and `applied`, ascending,
// with their old and new values.
inline ::testing::AssertionResult ListsTheDifference(const ListedChanges& listed,
                                                     const std::vector<uint8_t>& base,
                                                     const std::vector<uint8_t>& applied,
                                                     uint32_t elem_size) {
  const uint64_t count = listed.positions.size();
  if (listed.new_values.size() != count * elem_size ||
      listed.old_values.size() != count * elem_size) {
    return ::testing::AssertionFailure() << "value vectors of the wrong size";
  }
  uint64_t next = 0;
  for (uint64_t e = 0; e < base.size() / elem_size; ++e) {
    const uint8_t* old_element = base.data() + e * elem_size;
    const uint8_t* new_element = applied.data() + e * elem_size;
    const bool differs = std::memcmp(old_element, new_element, elem_size) != 0;
    const bool is_listed = next < count && listed.positions[next] == e;
    if (differs != is_listed) {
      return ::testing::AssertionFailure()
             << "element " << e << (differs ? " changed but is not listed" : " listed unchanged");
    }
    if (!is_listed) continue;
    if (std::memcmp(listed.old_values.data() + next * elem_size, old_element, elem_size) != 0 ||
        std::memcmp(listed.new_values.data() + next * elem_size, new_element, elem_size) != 0) {
      return ::testing::AssertionFailure() << "wrong values for element " << e;
    }
    ++next;
  }
  if (next != count)
    return ::testing::AssertionFailure() << "positions out of order or out of range";
  return ::testing::AssertionSuccess();
}

// Checks Codec::DecodeChanges against DecodeApply: given the status and
// result of DecodeApply on a copy of `base`, DecodeChanges must fail with the
// same code when it failed, and otherwise list exactly the elements that
// differ between `base` and `applied` (ascending, with their old and new
// values), without writing `base`. Checked whole and in chunks of 1 and 5
// changes handed to DecodeOptions::on_changes.
inline ::testing::AssertionResult ChangesMatchApply(
    Encoding encoding, std::span<const uint8_t> encoded, const std::vector<uint8_t>& base,
    uint32_t elem_size, const DecodeOptions& options, const Status& apply_status,
    const std::vector<uint8_t>& applied) {
  const std::vector<uint8_t> before = base;
  for (uint64_t chunk : {uint64_t{0}, uint64_t{1}, uint64_t{5}}) {
    ChangeSet changes;
    changes.pos32 = {7, 7};  // stale contents must be replaced
    ListedChanges listed;
    DecodeOptions chunked = options;
    bool chunk_sizes_ok = true;
    if (chunk != 0) {
      chunked.max_chunk_changes = chunk;
      chunked.on_changes = [&](const ChangeSet& c) {
        if (c.count() != chunk || c.elem_size != elem_size || c.numel != base.size() / elem_size) {
          chunk_sizes_ok = false;
        }
        listed.Append(c);
      };
    }
    Status status = DecodeChanges(encoding, encoded, base, elem_size, &changes, chunked);
    if (base != before) return ::testing::AssertionFailure() << "DecodeChanges wrote its base";
    if (status.code() != apply_status.code()) {
      return ::testing::AssertionFailure() << "DecodeChanges: " << status.ToString()
                                           << "; DecodeApply: " << apply_status.ToString();
    }
    if (!status.ok()) continue;
    if (changes.elem_size != elem_size || changes.numel != base.size() / elem_size) {
      return ::testing::AssertionFailure() << "wrong numel or elem_size";
    }
    if (!chunk_sizes_ok) {
      return ::testing::AssertionFailure() << "a chunk of other than " << chunk << " changes";
    }
    listed.Append(changes);
    ::testing::AssertionResult r = ListsTheDifference(listed, base, applied, elem_size);
    if (!r) return r << " (chunks of " << chunk << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace deltasync::codec_test
