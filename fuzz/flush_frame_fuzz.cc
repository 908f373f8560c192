// libFuzzer target for the online transport's flush frames
// (src/stream/frame.h).
//
// The first input byte picks the mode: bit 0 clear, the rest is a frame as
// it arrived; bit 0 set, the target first rewrites the rest's last 16 bytes
// with the xxh3-128 of what precedes them, so that mutations get past the
// checksum to every field behind it. Either way, a frame FlushReader
// accepts must
//  - be rebuilt by FlushWriter from what the reader exposed (the writer
//    accepts everything the reader does), and read back to the same entries
//    and records; without sparse entries (whose zstd bytes an encoder may
//    choose) byte for byte the input;
//  - apply, entry by entry, into exact-size heap destinations (so ASan sees
//    any access outside them) through a whole-tensor map and a two-run map,
//    giving what a plain reference scatter gives, with running digests
//    equal to a recompute.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "deltasync/checksum.h"
#include "stream/frame.h"

namespace {

using deltasync::ChecksumAlgo;
using deltasync::ChecksumBytes;
using deltasync::DTypeSize;
using deltasync::Result;
using namespace deltasync::stream;

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

// Entries of larger tensors are checked but not applied.
constexpr uint64_t kMaxApplyElements = 1 << 16;

bool SameEntry(const FlushEntry& a, const FlushEntry& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.numel == b.numel &&
         a.first == b.first && a.count == b.count && a.encoding == b.encoding &&
         a.value_count == b.value_count && EntryPositions(a) == EntryPositions(b) &&
         std::equal(a.values.begin(), a.values.end(), b.values.begin(), b.values.end());
}

void CheckRebuild(std::span<const uint8_t> frame, const FlushReader& reader) {
  FlushWriter writer;
  FrameBuffer again;
  Require(writer.Begin(reader.header(), kMaxFlushFrameBytes, &again).ok(), "writer takes header");
  bool sparse = false;
  for (const FlushEntry& e : reader.entries()) {
    const TensorRange range{e.name, e.dtype, e.shape, e.first, e.count};
    const std::vector<uint64_t> positions = EntryPositions(e);
    Result<bool> added = false;
    switch (e.encoding) {
      case WireEncoding::kDense: added = writer.AddDense(range, e.values); break;
      case WireEncoding::kIndices:
        added = writer.AddIndices(range, Positions::Absolute(positions), e.values);
        break;
      case WireEncoding::kSparse:
        sparse = true;
        added = writer.AddSparse(range, Positions::Absolute(positions), e.values);
        break;
    }
    Require(added.ok() && *added, "writer takes every entry the reader accepted");
  }
  for (const FlushDigest& d : reader.digests()) {
    Result<bool> added = writer.AddDigest(d.name, d.block, d.digest);
    Require(added.ok() && *added, "writer takes every record the reader accepted");
  }
  Require(writer.Finish().ok(), "writer finishes");
  // The writer writes the current version: an older frame (version 1,
  // 4-byte positions where version 2 takes 3) rebuilds to the same entries,
  // not the same bytes.
  const bool current = frame.size() >= 6 && (frame[4] | (frame[5] << 8)) == kFlushFrameVersion;
  if (!sparse && current) {
    Require(std::equal(again.begin(), again.end(), frame.begin(), frame.end()),
            "rebuilt frame is byte for byte the input");
  }
  FlushReader second;
  Require(second.Read(again).ok(), "rebuilt frame reads");
  Require(second.entries().size() == reader.entries().size(), "same entry count");
  for (size_t k = 0; k < reader.entries().size(); ++k) {
    Require(SameEntry(second.entries()[k], reader.entries()[k]), "same entry");
  }
  Require(second.digests().size() == reader.digests().size(), "same record count");
  for (size_t k = 0; k < reader.digests().size(); ++k) {
    const FlushDigest &a = second.digests()[k], &b = reader.digests()[k];
    Require(a.name == b.name && a.block == b.block && a.digest == b.digest, "same record");
  }
}

void CheckApply(const FlushEntry& e, const DestinationMap& map, uint64_t dest_elements,
                uint64_t salt) {
  const uint32_t w = static_cast<uint32_t>(DTypeSize(e.dtype));
  std::vector<uint8_t> dest(dest_elements * w);
  for (size_t i = 0; i < dest.size(); ++i) dest[i] = static_cast<uint8_t>(i * 131 + salt);
  std::vector<uint8_t> want = dest;
  uint64_t want_written = 0;
  const std::vector<uint64_t> positions = EntryPositions(e);
  for (size_t k = 0; k < positions.size(); ++k) {
    for (const DestinationRun& r : map.runs()) {
      if (positions[k] < r.hf_first || positions[k] >= r.hf_first + r.count) continue;
      const uint64_t d = r.dest_offset + (positions[k] - r.hf_first) * r.dest_stride;
      std::memcpy(&want[d * w], &e.values[k * w], w);
      ++want_written;
    }
  }
  Result<StateDigest> before = DigestDestination(map, dest, w);
  Require(before.ok(), "destination digest");
  StateDigest running = *before;
  Result<uint64_t> written = ApplyEntry(e, map, dest, &running);
  Require(written.ok() && *written == want_written, "apply writes each held position once");
  Require(dest == want, "apply matches the reference scatter");
  Result<StateDigest> after = DigestDestination(map, dest, w);
  Require(after.ok() && *after == running, "running digest equals a recompute");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::vector<uint8_t> frame(data + 1, data + size);
  if (data[0] & 1) {
    deltasync::stream::ResealFlushFrame(frame);
  }
  FlushReader reader;
  if (!reader.Read(frame).ok()) {
    Require(reader.entries().empty() && reader.digests().empty(), "a refusal exposes nothing");
    return 0;
  }
  CheckRebuild(frame, reader);
  uint64_t salt = 0;
  for (const FlushEntry& e : reader.entries()) {
    if (e.numel > kMaxApplyElements) continue;
    CheckApply(e, DestinationMap::Whole(e.numel), e.numel, ++salt);
    if (e.numel >= 2) {
      // The two halves swapped, the second one strided.
      const uint64_t half = e.numel / 2;
      Result<DestinationMap> map = DestinationMap::Create(
          e.numel, {{0, half, 2 * (e.numel - half), 1}, {half, e.numel - half, 0, 2}});
      Require(map.ok(), "two-run map");
      CheckApply(e, *map, map->dest_extent(), ++salt);
    }
  }
  return 0;
}
