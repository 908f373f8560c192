// The sender's time model of a unit's encodings (cost_model.h).
#include "stream/cost_model.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <vector>

#include "stream/frame.h"
#include "stream/state_digest.h"

namespace deltasync::stream {

namespace {

constexpr uint64_t kSampleElements = uint64_t{1} << 19;
constexpr uint64_t kChangeEvery = 10;  // 10% of the sample changed
constexpr int kRounds = 3;

// Seconds to write `add`'s entry into a frame, read the frame and apply
// its entry into `dest` with a digest move; the fastest of kRounds.
template <typename Add>
Result<double> TimeEntry(Add&& add, std::vector<uint8_t>& dest, uint64_t* frame_bytes) {
  double best = std::numeric_limits<double>::infinity();
  FlushWriter writer;
  FlushReader reader;
  FrameBuffer frame;
  const DestinationMap map = DestinationMap::Whole(kSampleElements);
  for (int round = 0; round < kRounds; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    FlushHeader h;
    h.sync_id = 1;
    DS_RETURN_IF_ERROR(writer.Begin(h, uint64_t{64} << 20, &frame));
    DS_ASSIGN_OR_RETURN(bool fit, add(writer));
    if (!fit) return Status::Internal("cost model: the sample does not fit a frame");
    DS_RETURN_IF_ERROR(writer.Finish());
    DS_RETURN_IF_ERROR(reader.Read(frame));
    StateDigest move;
    DS_RETURN_IF_ERROR(ApplyEntry(reader.entries()[0], map, dest, &move).status());
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    *frame_bytes = frame.size();
  }
  return best;
}

}  // namespace

Result<CostModel> MeasureCostModel() {
  const std::vector<int64_t> shape = {static_cast<int64_t>(kSampleElements)};
  const TensorRange range{"cost.sample", DType::kBF16, shape, 0, kSampleElements};
  std::vector<uint8_t> dense(kSampleElements * 2);
  std::vector<uint64_t> positions;
  std::vector<uint8_t> values;
  uint64_t z = 0x9e3779b97f4a7c15ull;
  for (uint64_t i = 0; i < kSampleElements; ++i) {
    z = z * 6364136223846793005ull + 1442695040888963407ull;
    // Values near one another, as a trained weight's are.
    dense[2 * i] = static_cast<uint8_t>(z >> 40);
    dense[2 * i + 1] = static_cast<uint8_t>(0x3c + ((z >> 56) & 1));
    if ((z >> 33) % kChangeEvery == 0) {
      positions.push_back(i);
      values.push_back(dense[2 * i]);
      values.push_back(dense[2 * i + 1]);
    }
  }
  std::vector<uint8_t> dest(dense.size(), 0);
  CostModel m;
  uint64_t bytes = 0;
  DS_ASSIGN_OR_RETURN(
      const double d,
      TimeEntry([&](FlushWriter& w) { return w.AddDense(range, dense); }, dest, &bytes));
  DS_ASSIGN_OR_RETURN(const double i, TimeEntry(
                                          [&](FlushWriter& w) {
                                            return w.AddIndices(
                                                range, Positions::Absolute(positions), values);
                                          },
                                          dest, &bytes));
  DS_ASSIGN_OR_RETURN(const double s, TimeEntry(
                                          [&](FlushWriter& w) {
                                            return w.AddSparse(
                                                range, Positions::Absolute(positions), values);
                                          },
                                          dest, &bytes));
  const double n = static_cast<double>(positions.size());
  m.dense_byte = d / static_cast<double>(dense.size());
  m.indices_change = i / n;
  m.sparse_change = s / n;
  m.sparse_change_bytes = static_cast<double>(bytes) / n;
  return m;
}

bool DenseIsFaster(const CostModel& m, StreamEncoding e, uint64_t count, uint64_t n, uint32_t w,
                   uint32_t pw) {
  if (m.wire_byte <= 0 || e == StreamEncoding::kDense) return false;
  const double dense =
      static_cast<double>(count) * static_cast<double>(w) * (m.dense_byte + m.wire_byte);
  const double per_change = e == StreamEncoding::kIndices
                                ? m.indices_change + static_cast<double>(pw + w) * m.wire_byte
                                : m.sparse_change + m.sparse_change_bytes * m.wire_byte;
  return dense < static_cast<double>(n) * per_change;
}

}  // namespace deltasync::stream
