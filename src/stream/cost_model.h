// What a unit of a delta costs in time by each wire encoding, for the
// sender's choice between its positions and its dense values
// (Sender::EncodingOf): the work per byte of a dense entry and per change
// of a positional one, measured on this machine through the frame code
// itself, and the time per byte on the wire, measured from the syncs.
#pragma once

#include <cstdint>

#include "deltasync/status.h"
#include "deltasync/stream.h"

namespace deltasync::stream {

struct CostModel {
  // Seconds: a dense entry's byte written into a frame, the frame read
  // (checked) and the byte applied with its digest move.
  double dense_byte = 0;
  // Seconds: the same for one change of an `indices` and of a `sparse`
  // entry (positions and value written, compressed for sparse, read,
  // scattered).
  double indices_change = 0;
  double sparse_change = 0;
  // Bytes a change of the sample took in a sparse entry.
  double sparse_change_bytes = 0;
  // Seconds per byte on the wire (0: not measured, and then time is not
  // weighed: the bytes are).
  double wire_byte = 0;
};

// The CPU terms, measured on one thread: a sample of 2^19 BF16 elements,
// 10% of them changed, written, read and applied through each encoding,
// the fastest of three rounds. A few milliseconds.
Result<CostModel> MeasureCostModel();

// Whether a unit of `count` elements of `w` bytes, `n` of them changed,
// costs less time dense than by the positions of `e` (indices or sparse;
// `pw` bytes a position for indices), by `m`; false until m.wire_byte is
// measured.
bool DenseIsFaster(const CostModel& m, StreamEncoding e, uint64_t count, uint64_t n, uint32_t w,
                   uint32_t pw);

}  // namespace deltasync::stream
