// libFuzzer target for the delta decoders, built once per encoding with
// DS_FUZZ_ENCODING set to its name (fuzz/CMakeLists.txt); without it the
// second input byte picks the encoding.
//
// The first input byte picks the element size (bits 0-1), the mode
// (bits 2-3), a small decode chunk (bit 4) and the sparse layout (bits 5-6):
//  - raw: the rest of the input is applied as an encoding to a fixed-size
//    target. Any Status is fine; a crash or an access outside the target
//    (exact-size heap buffer, so ASan sees it) is a bug.
//  - round trip: the input describes a tensor pair; encode, decode onto the
//    old bytes, and abort unless the result is exactly the new bytes. The
//    encodings that stream (EncodingInfo::streams) must also give the same
//    bytes when fed the changes in ranges.
//  - mutated: as round trip, then flip a few bytes of the valid encoding
//    (positions and values from the input) before decoding. This reaches
//    the decoders' deep paths, which random bytes rarely pass a zstd frame
//    check to get to. Memory safety is checked, and that any failure is
//    Corruption; with zero flips it must round-trip exactly.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "deltasync/codec.h"
#include "deltasync/diff.h"

namespace {

using deltasync::ChangeSet;
using deltasync::DecodeOptions;
using deltasync::EncodeOptions;
using deltasync::Encoding;
using deltasync::SparseMode;
using deltasync::Status;

constexpr size_t kRawTargetElems = 1024;
constexpr size_t kMaxPairElems = 5000;

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

class InputReader {
 public:
  InputReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Next() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool empty() const { return pos_ >= size_; }
  std::span<const uint8_t> Rest() const { return {data_ + pos_, size_ - pos_}; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Encoding PickEncoding(InputReader& in) {
#ifdef DS_FUZZ_ENCODING
  (void)in;
  static const Encoding encoding = [] {
    auto parsed = deltasync::ParseEncoding(DS_FUZZ_ENCODING);
    Require(parsed.ok(), "DS_FUZZ_ENCODING names an encoding");
    return *parsed;
  }();
  return encoding;
#else
  return deltasync::AllEncodings()[in.Next() % deltasync::AllEncodings().size()];
#endif
}

// Exact-size heap copy, so that any access past either end is an ASan report.
std::unique_ptr<uint8_t[]> ExactCopy(std::span<const uint8_t> bytes) {
  std::unique_ptr<uint8_t[]> copy(new uint8_t[bytes.size() + (bytes.empty() ? 1 : 0)]);
  if (!bytes.empty()) std::memcpy(copy.get(), bytes.data(), bytes.size());
  return copy;
}

// DecodeChanges must accept exactly what DecodeApply accepts (same status
// code) and, when both succeed, list exactly the elements DecodeApply
// changed, ascending, without writing its base.
void CheckChangesMatchApply(Encoding encoding, std::span<const uint8_t> encoded,
                            std::span<const uint8_t> base, uint32_t elem_size,
                            const DecodeOptions& options, const Status& apply_status,
                            const uint8_t* applied) {
  std::unique_ptr<uint8_t[]> pristine = ExactCopy(base);
  ChangeSet changes;
  Status status = deltasync::DecodeChanges(encoding, encoded, {pristine.get(), base.size()},
                                           elem_size, &changes, options);
  Require(status.code() == apply_status.code(), "DecodeChanges and DecodeApply agree");
  Require(std::memcmp(pristine.get(), base.data(), base.size()) == 0,
          "DecodeChanges leaves its base alone");
  if (!status.ok()) return;
  const size_t numel = base.size() / elem_size;
  Require(changes.numel == numel && changes.elem_size == elem_size, "ChangeSet shape");
  uint64_t next = 0;
  for (size_t e = 0; e < numel; ++e) {
    const bool differs =
        std::memcmp(base.data() + e * elem_size, applied + e * elem_size, elem_size) != 0;
    const bool listed = next < changes.count() && changes.position(next) == e;
    Require(differs == listed, "DecodeChanges lists exactly the changed elements");
    if (!listed) continue;
    Require(std::memcmp(changes.new_values.data() + next * elem_size, applied + e * elem_size,
                        elem_size) == 0,
            "DecodeChanges gives the applied value");
    Require(std::memcmp(changes.old_values.data() + next * elem_size, base.data() + e * elem_size,
                        elem_size) == 0,
            "DecodeChanges gives the old value");
    ++next;
  }
  Require(next == changes.count(), "DecodeChanges positions ascend within the tensor");

  // In chunks of 3 through on_changes, the same list in the same order.
  std::vector<uint64_t> positions;
  std::vector<uint8_t> old_values, new_values;
  auto append = [&](const ChangeSet& c) {
    for (uint64_t i = 0; i < c.count(); ++i) positions.push_back(c.position(i));
    old_values.insert(old_values.end(), c.old_values.begin(), c.old_values.end());
    new_values.insert(new_values.end(), c.new_values.begin(), c.new_values.end());
  };
  DecodeOptions chunked = options;
  chunked.max_chunk_changes = 3;
  chunked.on_changes = [&](const ChangeSet& c) {
    Require(c.count() == 3, "DecodeChanges hands over full chunks");
    append(c);
  };
  ChangeSet rest;
  Status chunked_status = deltasync::DecodeChanges(encoding, encoded, {pristine.get(), base.size()},
                                                   elem_size, &rest, chunked);
  Require(chunked_status.ok(), "DecodeChanges in chunks accepts what it accepts whole");
  append(rest);
  Require(positions.size() == changes.count(), "chunks hold every change");
  for (uint64_t i = 0; i < positions.size(); ++i) {
    Require(positions[i] == changes.position(i), "chunks list the same positions");
  }
  Require(old_values == changes.old_values && new_values == changes.new_values,
          "chunks list the same values");
}

// Encodings that stream (EncodingInfo::streams) must give Encode's bytes
// from the tensor's changes handed over `range` elements at a time.
void CheckStreamedEncoding(Encoding encoding, uint32_t elem_size, const EncodeOptions& options,
                           const std::vector<uint8_t>& old_bytes,
                           const std::vector<uint8_t>& new_bytes, size_t range,
                           const std::vector<uint8_t>& expected) {
  const deltasync::Codec& codec = deltasync::GetCodec(encoding);
  const size_t numel = old_bytes.size() / elem_size;
  std::vector<uint8_t> streamed;
  std::unique_ptr<deltasync::EncodeStream> stream =
      codec.NewEncodeStream(numel, elem_size, options, &streamed);
  Require((stream != nullptr) == codec.info().streams,
          "a stream exactly when the encoding streams");
  if (stream == nullptr) return;
  ChangeSet piece;
  deltasync::DiffOptions diff;
  diff.elem_size = elem_size;
  diff.refresh_snapshot = false;
  for (size_t first = 0; first < numel; first += range) {
    const size_t n = std::min(range, numel - first);
    std::span<const uint8_t> new_range(new_bytes.data() + first * elem_size, n * elem_size);
    std::vector<uint8_t> old_range(old_bytes.begin() + first * elem_size,
                                   old_bytes.begin() + (first + n) * elem_size);
    Require(deltasync::DiffTensor(new_range, old_range, diff, &piece).ok(), "range diff");
    Require(stream->Add(first, new_range, piece).ok(), "a stream takes consistent ranges");
  }
  Require(stream->Finish().ok(), "a stream finishes once the tensor is covered");
  Require(streamed == expected, "the streamed encoding equals Encode's");
}

void FuzzRaw(Encoding encoding, uint32_t elem_size, const DecodeOptions& options,
             std::span<const uint8_t> encoded) {
  const size_t bytes = kRawTargetElems * elem_size;
  std::unique_ptr<uint8_t[]> target(new uint8_t[bytes]);
  for (size_t i = 0; i < bytes; ++i) target[i] = static_cast<uint8_t>(i * 131);
  std::unique_ptr<uint8_t[]> input = ExactCopy(encoded);
  std::vector<uint8_t> base(target.get(), target.get() + bytes);
  Status status = deltasync::DecodeApply(encoding, {input.get(), encoded.size()},
                                         {target.get(), bytes}, elem_size, options);
  Require(status.ok() || status.IsCorruption(), "decoders report bad bytes as Corruption");
  CheckChangesMatchApply(encoding, {input.get(), encoded.size()}, base, elem_size, options, status,
                         target.get());
}

void FuzzEncoded(Encoding encoding, uint32_t elem_size, SparseMode sparse_mode, bool mutate,
                 const DecodeOptions& options, InputReader& in) {
  const size_t numel = 1 + (in.Next() | size_t{in.Next()} << 8) % kMaxPairElems;
  const int mutations = mutate ? in.Next() % 8 : 0;
  uint32_t flips[8][2];
  for (int m = 0; m < mutations; ++m) {
    flips[m][0] = in.Next() | uint32_t{in.Next()} << 8;
    flips[m][1] = in.Next() | 1u;  // never a no-op
  }
  uint64_t seed = numel;
  std::vector<uint8_t> old_bytes(numel * elem_size);
  for (uint8_t& b : old_bytes) b = static_cast<uint8_t>(SplitMix(seed));
  std::vector<uint8_t> new_bytes = old_bytes;
  for (size_t element = in.Next(); element < numel && !in.empty(); element += 1 + in.Next()) {
    const uint8_t byte = in.Next();
    new_bytes[element * elem_size + byte % elem_size] ^= in.Next();
  }

  ChangeSet changes;
  std::vector<uint8_t> snapshot = old_bytes;
  deltasync::DiffOptions diff_options;
  diff_options.elem_size = elem_size;
  Require(deltasync::DiffTensor(new_bytes, snapshot, diff_options, &changes).ok(), "diff");
  EncodeOptions encode_options;
  encode_options.sparse_mode = sparse_mode;
  encode_options.chunk_bytes = options.chunk_bytes;
  std::vector<uint8_t> encoded;
  Require(deltasync::Encode(encoding, new_bytes, changes, encode_options, &encoded).ok(),
          "encoding a consistent ChangeSet succeeds");
  CheckStreamedEncoding(encoding, elem_size, encode_options, old_bytes, new_bytes,
                        1 + SplitMix(seed) % numel, encoded);
  for (int m = 0; m < mutations && !encoded.empty(); ++m) {
    encoded[flips[m][0] % encoded.size()] ^= static_cast<uint8_t>(flips[m][1]);
  }

  std::unique_ptr<uint8_t[]> target = ExactCopy(old_bytes);
  std::unique_ptr<uint8_t[]> input = ExactCopy(encoded);
  Status status = deltasync::DecodeApply(encoding, {input.get(), encoded.size()},
                                         {target.get(), old_bytes.size()}, elem_size, options);
  CheckChangesMatchApply(encoding, {input.get(), encoded.size()}, old_bytes, elem_size, options,
                         status, target.get());
  if (mutations == 0) {
    Require(status.ok(), "a fresh encoding decodes");
    Require(std::memcmp(target.get(), new_bytes.data(), new_bytes.size()) == 0,
            "decoding restores the new bytes exactly");
  } else {
    Require(status.ok() || status.IsCorruption(), "decoders report bad bytes as Corruption");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  InputReader in(data, size);
  const uint8_t control = in.Next();
  const uint32_t elem_size = 1u << (control & 3);
  const int mode = (control >> 2) & 3;
  DecodeOptions options;
  if (control & 0x10) options.chunk_bytes = 37;
  const SparseMode sparse_mode = static_cast<SparseMode>(((control >> 5) & 3) % 3);
  const Encoding encoding = PickEncoding(in);
  switch (mode) {
    case 1: FuzzEncoded(encoding, elem_size, sparse_mode, false, options, in); break;
    case 2: FuzzEncoded(encoding, elem_size, sparse_mode, true, options, in); break;
    default: FuzzRaw(encoding, elem_size, options, in.Rest()); break;
  }
  return 0;
}
