// The GPU data path (include/deltasync/cuda.h) against the CPU references:
// DiffTensor for the fused diff, the stream's state digest, libxxhash's
// XXH3_128bits. Data is random with NaN, -0.0, infinities and every byte
// value mixed in, at sizes that are multiples of nothing, densities from 0
// to 100%, aligned and misaligned by one element. GPU cases skip where
// there is no GPU; the cases that check what a build without one does run
// everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "deltasync/cuda.h"
#include "deltasync/diff.h"
#include "deltasync/quantize.h"
#include "stream/state_digest.h"

namespace deltasync::cuda {
namespace {

DType DTypeOfSize(uint32_t w) {
  switch (w) {
    case 1: return DType::kU8;
    case 2: return DType::kBF16;
    case 4: return DType::kF32;
    default: return DType::kF64;
  }
}

// Special bit patterns of each width: NaNs with payloads, -0.0, +-inf.
std::vector<uint64_t> Specials(uint32_t w) {
  switch (w) {
    case 1: return {0x00, 0x80, 0xFF, 0x7F};
    case 2: return {0x7FC0, 0xFFC1, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x7FFF};
    case 4: return {0x7FC00000, 0xFFC00001, 0x80000000, 0x0, 0x7F800000, 0xFF800000};
    default:
      return {0x7FF8000000000000ull, 0xFFF8000000000001ull, 0x8000000000000000ull, 0,
              0x7FF0000000000000ull, 0xFFF0000000000000ull};
  }
}

void PutBits(uint8_t* p, uint32_t w, uint64_t bits) { std::memcpy(p, &bits, w); }

std::vector<uint8_t> RandomElements(uint64_t n, uint32_t w, std::mt19937_64& rng) {
  std::vector<uint8_t> out(n * w);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  const auto specials = Specials(w);
  for (uint64_t i = 0; i < n; i += 1 + rng() % 7)
    PutBits(&out[i * w], w, specials[rng() % specials.size()]);
  return out;
}

// `base` with a `density` fraction of its elements changed; some changes
// only flip between NaN payloads or +-0.0, which a float compare misses.
std::vector<uint8_t> Mutate(const std::vector<uint8_t>& base, uint32_t w, double density,
                            std::mt19937_64& rng) {
  std::vector<uint8_t> out = base;
  const uint64_t n = base.size() / w;
  std::bernoulli_distribution pick(density);
  const auto specials = Specials(w);
  for (uint64_t i = 0; i < n; ++i) {
    if (!pick(rng)) continue;
    uint64_t old = 0, v = 0;
    std::memcpy(&old, &out[i * w], w);
    do {
      v = (rng() % 3 == 0) ? specials[rng() % specials.size()] : rng();
      if (w < 8) v &= (uint64_t{1} << (8 * w)) - 1;
    } while (v == old);
    PutBits(&out[i * w], w, v);
  }
  return out;
}

struct DeviceCopy {
  Buffer buffer;
  uint8_t* data;  // buffer.data() + offset
};

DeviceCopy ToDevice(const std::vector<uint8_t>& host, uint64_t offset, bool pinned = false) {
  auto buffer = pinned ? Buffer::PinnedHost(host.size() + offset + 16)
                       : Buffer::Device(host.size() + offset + 16);
  EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
  uint8_t* data = static_cast<uint8_t*>(buffer->data()) + offset;
  EXPECT_EQ(cudaMemcpy(data, host.data(), host.size(), cudaMemcpyDefault), cudaSuccess);
  return {std::move(*buffer), data};
}

std::vector<uint8_t> ToHost(const void* p, uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes > 0) {
    EXPECT_EQ(cudaMemcpy(out.data(), p, bytes, cudaMemcpyDefault), cudaSuccess);
  }
  return out;
}

DeviceTensor Tensor(std::string name, uint32_t w, uint64_t n, void* data) {
  return DeviceTensor{
      std::move(name), DTypeOfSize(w), {static_cast<int64_t>(n)}, data, nullptr, {}};
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto ws = Workspace::Create(0);
    ASSERT_TRUE(ws.ok()) << ws.status().ToString();
    ws_ = std::move(*ws);
  }
  std::unique_ptr<Workspace> ws_;
  std::mt19937_64 rng_{20261202};
};

// One fused diff against DiffTensor and the CPU digest, with the snapshot
// in device or pinned host memory.
void CheckDiff(Workspace& ws, std::mt19937_64& rng, uint32_t w, uint64_t n, double density,
               uint64_t misalign, bool pinned_snapshot) {
  SCOPED_TRACE("w=" + std::to_string(w) + " n=" + std::to_string(n) +
               " density=" + std::to_string(density) + " misalign=" + std::to_string(misalign) +
               (pinned_snapshot ? " pinned" : " device"));
  const std::vector<uint8_t> old_bytes = RandomElements(n, w, rng);
  const std::vector<uint8_t> new_bytes = Mutate(old_bytes, w, density, rng);

  ChangeSet want;
  std::vector<uint8_t> cpu_snapshot = old_bytes;
  DiffOptions options;
  options.elem_size = w;
  options.kernel = DiffKernel::kScalar;
  ASSERT_TRUE(DiffTensor(new_bytes, cpu_snapshot, options, &want).ok());

  DeviceCopy cur = ToDevice(new_bytes, misalign * w);
  DeviceCopy snap = ToDevice(old_bytes, misalign * w, pinned_snapshot);
  const bool wide = false;
  auto positions = Buffer::Device(std::max<uint64_t>(n, 1) * 4);
  auto values = Buffer::Device(std::max<uint64_t>(n, 1) * w);
  auto olds = Buffer::Device(std::max<uint64_t>(n, 1) * w);
  ASSERT_TRUE(positions.ok() && values.ok() && olds.ok());
  // Poisoned, so that an unwritten output shows.
  ASSERT_EQ(cudaMemset(positions->data(), 0xA5, positions->size()), cudaSuccess);
  ASSERT_EQ(cudaMemset(values->data(), 0xA5, values->size()), cudaSuccess);

  DeviceTensor current = Tensor("w", w, n, cur.data);
  DeviceTensor snapshot = Tensor("w", w, n, snap.data);
  DiffOutput out;
  out.positions = positions->data();
  out.values = values->data();
  out.old_values = olds->data();
  out.capacity = n;
  out.first_position = 1000;
  Result<DiffResult> got = DiffOnDevice(ws, current, snapshot, out);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->wide, wide);
  ASSERT_EQ(got->count, want.count());

  const std::vector<uint8_t> pos_bytes = ToHost(positions->data(), got->count * 4);
  std::vector<uint32_t> pos(got->count);
  if (!pos.empty()) std::memcpy(pos.data(), pos_bytes.data(), pos_bytes.size());
  EXPECT_EQ(pos, want.pos32);
  EXPECT_EQ(ToHost(values->data(), got->count * w), want.new_values);
  EXPECT_EQ(ToHost(olds->data(), got->count * w), want.old_values);
  EXPECT_EQ(ToHost(snap.data, n * w), new_bytes) << "snapshot not refreshed";

  stream::DigestOptions scalar;
  scalar.kernel = stream::DigestKernel::kScalar;
  auto before = stream::ComputeStateDigest(old_bytes, w, 1000, scalar);
  auto after = stream::ComputeStateDigest(new_bytes, w, 1000, scalar);
  ASSERT_TRUE(before.ok() && after.ok());
  const stream::StateDigest change = *after - *before;
  EXPECT_EQ(got->digest_change.a, change.a);
  EXPECT_EQ(got->digest_change.b, change.b);
}

TEST_F(CudaTest, FusedDiffMatchesTheCpuDiffAtEveryElementSizeAndDensity) {
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    for (uint64_t n :
         {uint64_t{1}, uint64_t{7}, uint64_t{4097}, uint64_t{70001}, uint64_t{(1u << 20) + 13}}) {
      for (double density : {0.0, 0.001, 0.02, 0.5, 1.0}) {
        CheckDiff(*ws_, rng_, w, n, density, 0, false);
      }
    }
  }
}

TEST_F(CudaTest, FusedDiffOnMisalignedTensorsAndPinnedSnapshots) {
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    for (uint64_t n : {uint64_t{33}, uint64_t{300007}}) {
      CheckDiff(*ws_, rng_, w, n, 0.03, 1, false);
      CheckDiff(*ws_, rng_, w, n, 0.03, 0, true);
      CheckDiff(*ws_, rng_, w, n, 0.6, 1, true);
    }
  }
  // A pinned snapshot is staged in 32 MiB chunks: several of them, the
  // last one partial.
  CheckDiff(*ws_, rng_, 2, (uint64_t{40} << 20) + 5, 0.02, 0, true);
  CheckDiff(*ws_, rng_, 4, (uint64_t{20} << 20) + 3, 0.3, 1, true);
}

TEST_F(CudaTest, FusedDiffTwiceFindsNothingTheSecondTime) {
  const uint64_t n = 123457;
  const std::vector<uint8_t> a = RandomElements(n, 2, rng_);
  const std::vector<uint8_t> b = Mutate(a, 2, 0.05, rng_);
  DeviceCopy cur = ToDevice(b, 0), snap = ToDevice(a, 0);
  auto positions = Buffer::Device(n * 4);
  auto values = Buffer::Device(n * 2);
  ASSERT_TRUE(positions.ok() && values.ok());
  DeviceTensor current = Tensor("w", 2, n, cur.data), snapshot = Tensor("w", 2, n, snap.data);
  DiffOutput out{positions->data(), values->data(), nullptr, n};
  auto first = DiffOnDevice(*ws_, current, snapshot, out);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_GT(first->count, 0u);
  auto second = DiffOnDevice(*ws_, current, snapshot, out);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->count, 0u);
  EXPECT_EQ(second->digest_change, Digest{});
}

TEST_F(CudaTest, ScatterWritesEveryBitPatternInPlace) {
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    const uint64_t n = 100003;
    const std::vector<uint8_t> old_bytes = RandomElements(n, w, rng_);
    const std::vector<uint8_t> new_bytes = Mutate(old_bytes, w, 0.3, rng_);
    ChangeSet changes;
    std::vector<uint8_t> scratch = old_bytes;
    DiffOptions options;
    options.elem_size = w;
    ASSERT_TRUE(DiffTensor(new_bytes, scratch, options, &changes).ok());
    std::vector<uint8_t> pos_bytes(changes.count() * 4);
    std::memcpy(pos_bytes.data(), changes.pos32.data(), pos_bytes.size());
    DeviceCopy dest = ToDevice(old_bytes, 0), pos = ToDevice(pos_bytes, 0),
               vals = ToDevice(changes.new_values, 0), olds = ToDevice(changes.old_values, 0);
    DeviceTensor t = Tensor("w", w, n, dest.data);
    const DeviceChanges c{pos.data, 4, vals.data, changes.count()};
    ASSERT_TRUE(ScatterOnDevice(*ws_, t, c).ok());
    EXPECT_EQ(ToHost(dest.data, n * w), new_bytes) << "w=" << w;

    // The digest change from the same changes matches the CPU update.
    auto got = DigestChangeOnDevice(*ws_, "w", w, c, olds.data, 5, n, nullptr);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    stream::StateDigest want;
    ASSERT_TRUE(stream::UpdateStateDigest(&want, stream::Positions::Of(changes, 5),
                                          changes.old_values, changes.new_values, w)
                    .ok());
    EXPECT_EQ(got->a, want.a);
    EXPECT_EQ(got->b, want.b);
  }
}

TEST_F(CudaTest, ScatterRefusesBadPositionsAndWritesNothing) {
  const uint64_t n = 1000;
  const std::vector<uint8_t> old_bytes = RandomElements(n, 2, rng_);
  DeviceCopy dest = ToDevice(old_bytes, 0);
  DeviceTensor t = Tensor("model.layers.3.mlp.up_proj.weight", 2, n, dest.data);
  const std::vector<int32_t> cases[] = {{1, 5, 1000}, {3, 3}, {9, 4}, {-1, 2}};
  for (const auto& positions : cases) {
    std::vector<uint8_t> pos_bytes(positions.size() * 4), vals(positions.size() * 2, 0x7F);
    std::memcpy(pos_bytes.data(), positions.data(), pos_bytes.size());
    DeviceCopy pos = ToDevice(pos_bytes, 0), v = ToDevice(vals, 0);
    const Status s = ScatterOnDevice(*ws_, t, DeviceChanges{pos.data, 4, v.data, positions.size()});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("model.layers.3.mlp.up_proj.weight"), std::string::npos)
        << s.message();
    EXPECT_EQ(ToHost(dest.data, n * 2), old_bytes) << "a refused scatter wrote";
  }
}

TEST_F(CudaTest, StateDigestMatchesTheCpuDigest) {
  for (uint32_t w : {1u, 2u, 4u, 8u}) {
    for (uint64_t n : {uint64_t{1}, uint64_t{15}, uint64_t{65537}, uint64_t{3000001}}) {
      for (uint64_t misalign : {uint64_t{0}, uint64_t{1}}) {
        const std::vector<uint8_t> bytes = RandomElements(n, w, rng_);
        DeviceCopy d = ToDevice(bytes, misalign * w, misalign == 1);
        auto got = StateDigestOnDevice(*ws_, Tensor("w", w, n, d.data), 77);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        auto want = stream::ComputeStateDigest(bytes, w, 77);
        ASSERT_TRUE(want.ok());
        EXPECT_EQ(got->a, want->a) << "w=" << w << " n=" << n;
        EXPECT_EQ(got->b, want->b) << "w=" << w << " n=" << n;
      }
    }
  }
}

TEST_F(CudaTest, Xxh3MatchesLibxxhashAtEveryPathLength) {
  std::vector<uint64_t> lengths;
  for (uint64_t len = 0; len <= 2200; len += (len < 300 ? 1 : 37)) lengths.push_back(len);
  for (uint64_t len : {uint64_t{1024}, uint64_t{1025}, uint64_t{1088}, uint64_t{1089},
                       uint64_t{(1u << 20) + 5}, uint64_t{(16u << 20) + 63}}) {
    lengths.push_back(len);
  }
  for (uint64_t misalign : {uint64_t{0}, uint64_t{3}}) {
    for (uint64_t len : lengths) {
      std::vector<uint8_t> bytes(len);
      for (auto& b : bytes) b = static_cast<uint8_t>(rng_());
      DeviceCopy d = ToDevice(bytes, misalign);
      auto got = Xxh3_128OnDevice(*ws_, "frame", d.data, len, nullptr);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      const XXH128_hash_t want = XXH3_128bits(bytes.data(), len);
      ASSERT_EQ(got->high64, want.high64) << "len=" << len << " misalign=" << misalign;
      ASSERT_EQ(got->low64, want.low64) << "len=" << len << " misalign=" << misalign;
    }
  }
}

TEST_F(CudaTest, BadTensorsAreRefusedByName) {
  const uint64_t n = 64;
  std::vector<uint8_t> host(n * 2, 1);
  DeviceCopy dev = ToDevice(host, 0), dev2 = ToDevice(host, 0);
  auto positions = Buffer::Device(n * 4);
  auto values = Buffer::Device(n * 2);
  ASSERT_TRUE(positions.ok() && values.ok());
  DiffOutput out{positions->data(), values->data(), nullptr, n};
  auto expect_refused = [&](DeviceTensor cur, DeviceTensor snap, const DiffOutput& o,
                            std::string_view text) {
    auto r = DiffOnDevice(*ws_, cur, snap, o);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("'emb'"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  };
  // A host pointer where device memory is needed.
  expect_refused(Tensor("emb", 2, n, host.data()), Tensor("emb", 2, n, dev2.data), out, "host");
  // A host (unpinned) snapshot.
  expect_refused(Tensor("emb", 2, n, dev.data), Tensor("emb", 2, n, host.data()), out, "host");
  // Misaligned.
  expect_refused(Tensor("emb", 2, n - 1, dev.data + 1), Tensor("emb", 2, n - 1, dev2.data), out,
                 "aligned");
  // Not contiguous.
  DeviceTensor strided{"emb", DType::kBF16, {8, 8}, dev.data, nullptr, {1, 8}};
  expect_refused(strided, DeviceTensor{"emb", DType::kBF16, {8, 8}, dev2.data, nullptr, {}}, out,
                 "contiguous");
  // Mismatched dtype and shape.
  expect_refused(
      Tensor("emb", 2, n, dev.data),
      DeviceTensor{"emb", DType::kF16, {static_cast<int64_t>(n)}, dev2.data, nullptr, {}}, out,
      "F16");
  expect_refused(Tensor("emb", 2, n, dev.data), Tensor("emb", 2, n / 2, dev2.data), out, "[32]");
  // Outputs too small or on the host.
  DiffOutput small = out;
  small.capacity = n - 1;
  expect_refused(Tensor("emb", 2, n, dev.data), Tensor("emb", 2, n, dev2.data), small, "capacity");
  DiffOutput host_out = out;
  host_out.values = host.data();
  expect_refused(Tensor("emb", 2, n, dev.data), Tensor("emb", 2, n, dev2.data), host_out, "host");
  // None of it touched the tensors.
  EXPECT_EQ(ToHost(dev.data, n * 2), host);
  EXPECT_EQ(ToHost(dev2.data, n * 2), host);
}

// Positions and values as bytes, for uploads.
template <typename T>
std::vector<uint8_t> AsBytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

TEST_F(CudaTest, FrameChecksFindTheFirstBadPaddingOrPositionRun) {
  // A payload of three position runs (int32, int64, int32) with padding
  // between them, all valid to start with.
  std::vector<uint8_t> frame(4096, 0);
  const auto put32 = [&](uint64_t off, const std::vector<int32_t>& v) {
    std::memcpy(&frame[off], v.data(), v.size() * 4);
  };
  const auto put64 = [&](uint64_t off, const std::vector<int64_t>& v) {
    std::memcpy(&frame[off], v.data(), v.size() * 8);
  };
  std::vector<int32_t> a(301);
  for (size_t k = 0; k < a.size(); ++k) a[k] = static_cast<int32_t>(1000 + 3 * k);
  std::vector<int64_t> b = {5, 6, 7, int64_t{1} << 40};
  std::vector<int32_t> c = {0};
  put32(64, a);
  put64(1280, b);
  put32(1344, c);
  std::vector<ZeroCheck> zeros = {{1268, 4}, {1348, 4}};
  std::vector<PositionCheck> checks = {{64, a.size(), 4, 1000, 1000 + 3 * 301},
                                       {1280, b.size(), 8, 5, (uint64_t{1} << 40) + 1},
                                       {1344, 1, 4, 0, 1}};
  const auto run = [&](const std::vector<uint8_t>& bytes) {
    DeviceCopy d = ToDevice(bytes, 0);
    Result<std::optional<uint64_t>> r =
        CheckFrameOnDevice(*ws_, "f", d.data, zeros, checks, nullptr);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::optional<uint64_t>(~0ull);
  };
  EXPECT_EQ(run(frame), std::nullopt);
  // Padding not zero: the zero check's index.
  std::vector<uint8_t> bad = frame;
  bad[1350] = 1;
  EXPECT_EQ(run(bad), std::optional<uint64_t>(1));
  // Not strictly increasing in the first run, and out of range in the
  // second: the first failing check wins.
  bad = frame;
  std::vector<int32_t> a2 = a;
  a2[200] = a2[199];
  std::memcpy(&bad[64], a2.data(), a2.size() * 4);
  std::vector<int64_t> b2 = b;
  b2[3] = int64_t{1} << 41;
  std::memcpy(&bad[1280], b2.data(), b2.size() * 8);
  EXPECT_EQ(run(bad), std::optional<uint64_t>(2));
  bad = frame;
  std::memcpy(&bad[1280], b2.data(), b2.size() * 8);
  EXPECT_EQ(run(bad), std::optional<uint64_t>(3));
  // Below the range's first, and a negative int32 (out of range too).
  bad = frame;
  a2 = a;
  a2[0] = 999;
  std::memcpy(&bad[64], a2.data(), a2.size() * 4);
  EXPECT_EQ(run(bad), std::optional<uint64_t>(2));
  std::vector<uint8_t> neg = frame;
  const int32_t minus_one = -1;
  std::memcpy(&neg[1344], &minus_one, 4);
  EXPECT_EQ(run(neg), std::optional<uint64_t>(4));
  // Bad arguments are refused by name.
  checks[1].width = 2;
  DeviceCopy d = ToDevice(frame, 0);
  Result<std::optional<uint64_t>> r = CheckFrameOnDevice(*ws_, "f", d.data, zeros, checks, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("width 2"), std::string::npos) << r.status().message();
  r = CheckFrameOnDevice(*ws_, "f", frame.data(), zeros, {}, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("host"), std::string::npos) << r.status().message();
}

TEST_F(CudaTest, PositionCopiesAddTheBaseAtEveryWidth) {
  std::vector<uint32_t> narrow(1000);
  for (size_t k = 0; k < narrow.size(); ++k) narrow[k] = static_cast<uint32_t>(7 * k + 1);
  DeviceCopy src = ToDevice(AsBytes(narrow), 0);
  auto dest = Buffer::Device(narrow.size() * 8);
  ASSERT_TRUE(dest.ok());
  ASSERT_TRUE(
      CopyPositionsOnDevice("p", dest->data(), 4, src.data, false, narrow.size(), 500, nullptr)
          .ok());
  std::vector<uint32_t> got32(narrow.size());
  std::memcpy(got32.data(), ToHost(dest->data(), narrow.size() * 4).data(), got32.size() * 4);
  for (size_t k = 0; k < narrow.size(); ++k) ASSERT_EQ(got32[k], narrow[k] + 500) << k;
  const uint64_t base = uint64_t{3} << 32;
  ASSERT_TRUE(
      CopyPositionsOnDevice("p", dest->data(), 8, src.data, false, narrow.size(), base, nullptr)
          .ok());
  std::vector<uint64_t> got64(narrow.size());
  std::memcpy(got64.data(), ToHost(dest->data(), narrow.size() * 8).data(), got64.size() * 8);
  for (size_t k = 0; k < narrow.size(); ++k) ASSERT_EQ(got64[k], narrow[k] + base) << k;
  // u24: three little-endian bytes each, packed.
  ASSERT_TRUE(
      CopyPositionsOnDevice("p", dest->data(), 3, src.data, false, narrow.size(), 9, nullptr).ok());
  const std::vector<uint8_t> got24 = ToHost(dest->data(), narrow.size() * 3);
  for (size_t k = 0; k < narrow.size(); ++k) {
    const uint32_t v = got24[3 * k] | got24[3 * k + 1] << 8 | got24[3 * k + 2] << 16;
    ASSERT_EQ(v, narrow[k] + 9) << k;
  }
  EXPECT_FALSE(CopyPositionsOnDevice("p", nullptr, 8, src.data, false, 1, 0, nullptr).ok());
  EXPECT_FALSE(CopyPositionsOnDevice("p", dest->data(), 5, src.data, false, 1, 0, nullptr).ok());
}

TEST_F(CudaTest, U24PositionsScatterAndAreCheckedLikeTheOthers) {
  // A tensor of 2^24 elements: its last element is the largest u24 position.
  const uint64_t numel = uint64_t{1} << 24;
  std::vector<uint16_t> host(numel, 0);
  DeviceCopy t = ToDevice(AsBytes(host), 0);
  const std::vector<uint32_t> positions = {0, 5, 65536, 1u << 23, (1u << 24) - 1};
  std::vector<uint8_t> packed(3 * positions.size());
  for (size_t k = 0; k < positions.size(); ++k) {
    for (int b = 0; b < 3; ++b) packed[3 * k + b] = static_cast<uint8_t>(positions[k] >> (8 * b));
  }
  std::vector<uint16_t> vals = {11, 22, 33, 44, 55};
  DeviceCopy pos = ToDevice(packed, 0);
  DeviceCopy v = ToDevice(AsBytes(vals), 0);
  DeviceTensor dest{"t", DType::kBF16, {static_cast<int64_t>(numel)}, t.data, nullptr, {}};
  ASSERT_TRUE(
      ScatterOnDevice(*ws_, dest, DeviceChanges{pos.data, 3, v.data, positions.size()}).ok());
  const std::vector<uint8_t> got = ToHost(t.data, numel * 2);
  for (size_t k = 0; k < positions.size(); ++k) {
    uint16_t x;
    std::memcpy(&x, got.data() + 2 * uint64_t{positions[k]}, 2);
    EXPECT_EQ(x, vals[k]) << k;
  }
  // Out of order: refused, nothing written.
  std::vector<uint8_t> bad = packed;
  std::swap_ranges(bad.begin(), bad.begin() + 3, bad.begin() + 3);
  DeviceCopy b = ToDevice(bad, 0);
  const std::vector<uint16_t> zeros(positions.size(), 0);
  DeviceCopy z = ToDevice(AsBytes(zeros), 0);
  Status s = ScatterOnDevice(*ws_, dest, DeviceChanges{b.data, 3, z.data, positions.size()});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(ToHost(t.data, numel * 2), got);
  s = ScatterOnDevice(*ws_, dest, DeviceChanges{pos.data, 5, v.data, positions.size()});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

TEST_F(CudaTest, UnitSplitsMatchLowerBound) {
  for (uint64_t n : {0ull, 1ull, 5000ull}) {
    std::vector<uint32_t> pos;
    std::bernoulli_distribution pick(0.3);
    for (uint32_t p = 0; pos.size() < n; ++p) {
      if (pick(rng_)) pos.push_back(p);
    }
    DeviceCopy d = ToDevice(AsBytes(pos), 0);
    const uint64_t unit = 97;
    const uint64_t units = pos.empty() ? 3 : pos.back() / unit + 1;
    Result<std::vector<uint64_t>> got =
        SplitPositionsOnDevice(*ws_, "p", d.data, false, pos.size(), unit, units, nullptr);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), units + 1);
    for (uint64_t k = 0; k <= units; ++k) {
      const uint64_t want = std::lower_bound(pos.begin(), pos.end(), k * unit) - pos.begin();
      ASSERT_EQ((*got)[k], want) << "n=" << n << " k=" << k;
    }
  }
}

TEST_F(CudaTest, ScatterThroughRunsWritesHeldPositionsOnly) {
  // A 40 x 33 tensor of which the destination holds columns [5, 17): one
  // run per row, at 12 elements a row.
  const uint64_t rows = 40, cols = 33, c0 = 5, c1 = 17, w = 2;
  std::vector<DeviceRun> runs;
  for (uint64_t r = 0; r < rows; ++r) runs.push_back({r * cols + c0, c1 - c0, r * (c1 - c0)});
  const uint64_t extent = rows * (c1 - c0);
  std::vector<uint8_t> dest_host = RandomElements(extent, w, rng_);
  std::vector<uint64_t> pos;
  for (uint64_t p = 0; p < rows * cols; ++p) {
    if (rng_() % 3 == 0) pos.push_back(p);
  }
  const std::vector<uint8_t> values = RandomElements(pos.size(), w, rng_);
  std::vector<uint8_t> want = dest_host;
  for (size_t k = 0; k < pos.size(); ++k) {
    const uint64_t r = pos[k] / cols, c = pos[k] % cols;
    if (c < c0 || c >= c1) continue;
    std::memcpy(&want[(r * (c1 - c0) + c - c0) * w], &values[k * w], w);
  }
  DeviceCopy dest = ToDevice(dest_host, 0);
  DeviceCopy p = ToDevice(AsBytes(pos), 0);
  DeviceCopy v = ToDevice(values, 0);
  DeviceCopy r = ToDevice(AsBytes(runs), 0);
  DeviceTensor t = Tensor("cols", w, extent, dest.data);
  ASSERT_TRUE(ScatterRunsOnDevice(t, DeviceChanges{p.data, 8, v.data, pos.size()},
                                  reinterpret_cast<const DeviceRun*>(r.data), runs.size())
                  .ok());
  EXPECT_EQ(ToHost(dest.data, extent * w), want);
  // Runs in host memory are refused by name, the destination untouched.
  Status s = ScatterRunsOnDevice(t, DeviceChanges{p.data, 8, v.data, pos.size()}, runs.data(),
                                 runs.size());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'cols' (runs)"), std::string::npos) << s.message();
}

// Thousands of items in one launch: every element size, every position
// width and dense ranges, whole destinations and column slices, empty
// items between; each lands as a host reference writes it.
TEST_F(CudaTest, ABatchedScatterWritesEachItemAsItsOwnScatterWould) {
  struct Host {
    uint32_t w;
    uint64_t rows, cols;
    bool slice;  // columns [1, cols - 1) of every row
    std::vector<DeviceRun> runs;
    uint64_t extent;
    std::vector<uint8_t> dest, want;
    std::vector<uint8_t> positions, values;
    uint32_t width = 0;
    uint64_t first = 0, count = 0;
  };
  std::vector<Host> hosts;
  const uint32_t widths[] = {0, 3, 4, 8};
  const uint32_t sizes[] = {1, 2, 4, 8};
  for (int k = 0; k < 3000; ++k) {
    Host h;
    h.w = sizes[rng_() % 4];
    h.width = widths[rng_() % 4];
    h.rows = 1 + rng_() % 5;
    h.cols = 3 + rng_() % 9;
    h.slice = rng_() % 2 == 0;
    const uint64_t numel = h.rows * h.cols;
    if (h.slice) {
      for (uint64_t r = 0; r < h.rows; ++r)
        h.runs.push_back({r * h.cols + 1, h.cols - 2, r * (h.cols - 2)});
      h.extent = h.rows * (h.cols - 2);
    } else {
      h.runs.push_back({0, numel, 0});
      h.extent = numel;
    }
    h.dest = RandomElements(h.extent, h.w, rng_);
    h.want = h.dest;
    std::vector<uint64_t> pos;
    if (k % 7 == 3) {
      h.count = 0;  // an empty item
    } else if (h.width == 0) {
      h.first = rng_() % numel;
      h.count = 1 + rng_() % (numel - h.first);
      for (uint64_t p = h.first; p < h.first + h.count; ++p) pos.push_back(p);
    } else {
      for (uint64_t p = 0; p < numel; ++p) {
        if (rng_() % 3 == 0) pos.push_back(p);
      }
      h.count = pos.size();
      for (uint64_t p : pos) {
        for (uint32_t b = 0; b < h.width; ++b)
          h.positions.push_back(static_cast<uint8_t>(p >> (8 * b)));
      }
    }
    h.values = RandomElements(pos.size(), h.w, rng_);
    for (size_t i = 0; i < pos.size(); ++i) {
      for (const DeviceRun& r : h.runs) {
        if (pos[i] >= r.hf_first && pos[i] < r.hf_first + r.count) {
          std::memcpy(&h.want[(r.dest_offset + pos[i] - r.hf_first) * h.w], &h.values[i * h.w],
                      h.w);
        }
      }
    }
    hosts.push_back(std::move(h));
  }
  std::vector<DeviceCopy> keep;
  std::vector<ScatterItem> items;
  for (Host& h : hosts) {
    keep.push_back(ToDevice(h.dest, 0));
    keep.push_back(ToDevice(h.positions, 0));
    keep.push_back(ToDevice(h.values, 0));
    keep.push_back(ToDevice(AsBytes(h.runs), 0));
    const size_t n = keep.size();
    ScatterItem it;
    it.dest = keep[n - 4].data;
    it.dest_numel = h.extent;
    it.elem_size = h.w;
    it.changes = DeviceChanges{keep[n - 3].data, h.width, keep[n - 2].data, h.count};
    it.first = h.first;
    it.runs = reinterpret_cast<const DeviceRun*>(keep[n - 1].data);
    it.run_count = h.runs.size();
    items.push_back(it);
  }
  Result<Buffer> scratch = Buffer::Device(ScatterBatchBytes(items.size()));
  ASSERT_TRUE(scratch.ok());
  Status s = ScatterBatchOnDevice("test", 0, items, scratch->data(), nullptr);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t k = 0; k < hosts.size(); ++k) {
    ASSERT_EQ(ToHost(items[k].dest, hosts[k].extent * hosts[k].w), hosts[k].want) << "item " << k;
  }
  // Refused by name, nothing launched: a width it cannot read.
  items[1].changes.width = 5;
  items[1].changes.count = std::max<uint64_t>(items[1].changes.count, 1);
  s = ScatterBatchOnDevice("test", 0, items, scratch->data(), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("item 1: positions of 5 bytes"), std::string::npos) << s.message();
}

TEST_F(CudaTest, DigestChangeOverABlockMatchesTheCpu) {
  const uint32_t w = 4;
  const uint64_t n = 5000, base = 123;
  std::vector<uint32_t> pos;
  for (uint32_t p = 0; p < n; ++p) {
    if (rng_() % 4 == 0) pos.push_back(p);
  }
  const std::vector<uint8_t> olds = RandomElements(pos.size(), w, rng_);
  const std::vector<uint8_t> news = RandomElements(pos.size(), w, rng_);
  DeviceCopy p = ToDevice(AsBytes(pos), 0);
  DeviceCopy o = ToDevice(olds, 0);
  DeviceCopy v = ToDevice(news, 0);
  for (const PositionBlock& b : {PositionBlock{0, n + base, 1, 0}, PositionBlock{500, 1000, 1, 0},
                                 PositionBlock{200, 30, 50, 97}}) {
    stream::StateDigest want;
    for (size_t k = 0; k < pos.size(); ++k) {
      const uint64_t at = pos[k] + base;
      if (at < b.first) continue;
      const uint64_t off = at - b.first;
      if (b.rows == 1 ? off >= b.count
                      : off / b.row_stride >= b.rows || off % b.row_stride >= b.count)
        continue;
      uint32_t ov = 0, nv = 0;
      std::memcpy(&ov, &olds[k * w], w);
      std::memcpy(&nv, &news[k * w], w);
      want += stream::ElementChangeDigest(at, ov, nv, w);
    }
    Result<Digest> got = DigestChangeOnDevice(*ws_, "d", w, {p.data, 4, v.data, pos.size()}, o.data,
                                              base, n, nullptr, &b);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->a, want.a) << b.first << " " << b.rows;
    EXPECT_EQ(got->b, want.b) << b.first << " " << b.rows;
  }
  const PositionBlock bad{0, 10, 2, 5};
  EXPECT_FALSE(DigestChangeOnDevice(*ws_, "d", w, {p.data, 4, v.data, pos.size()}, o.data, base, n,
                                    nullptr, &bad)
                   .ok());
}

// Finite random weights of `dtype` (BF16, F16, F32) with magnitudes over a
// few binades, zeros and subnormals mixed in, as bytes.
std::vector<uint8_t> RandomWeights(DType dtype, uint64_t n, std::mt19937_64& rng) {
  const uint32_t w = static_cast<uint32_t>(DTypeSize(dtype));
  std::vector<uint8_t> out(n * w);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    uint32_t bits = 0;
    if (dtype == DType::kF16) {
      // exponent 6..16 of bias 15; 1 in 50 a subnormal or zero
      const uint32_t e = r % 50 == 0 ? 0 : 6 + static_cast<uint32_t>((r >> 8) % 11);
      bits = (static_cast<uint32_t>(r >> 20) & 0x8000u) | e << 10 |
             static_cast<uint32_t>(r >> 32) % 1024u;
    } else {
      const uint32_t e = r % 50 == 0 ? 0 : 118 + static_cast<uint32_t>((r >> 8) % 11);
      const uint32_t f32 = (static_cast<uint32_t>(r >> 20) & 0x80000000u) | e << 23 |
                           static_cast<uint32_t>(r >> 32) % (1u << 23);
      bits = dtype == DType::kBF16 ? f32 >> 16 : f32;
    }
    std::memcpy(&out[i * w], &bits, w);
  }
  return out;
}

// `base` with a `density` fraction of its elements nudged by a few ULPs,
// and element `big` doubled (its group's amax, and so its scale, moves).
std::vector<uint8_t> NudgeWeights(const std::vector<uint8_t>& base, DType dtype, double density,
                                  uint64_t big, std::mt19937_64& rng) {
  const uint32_t w = static_cast<uint32_t>(DTypeSize(dtype));
  const uint32_t mantissa = dtype == DType::kF16 ? 10 : dtype == DType::kBF16 ? 7 : 23;
  std::vector<uint8_t> out = base;
  std::bernoulli_distribution pick(density);
  for (uint64_t i = 0; i < base.size() / w; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, &out[i * w], w);
    if (i == big) {
      bits += 1u << mantissa;  // one binade up
    } else if (pick(rng)) {
      bits ^= (1u + static_cast<uint32_t>(rng() % 3)) << (mantissa > 6 ? mantissa - 6 : 0);
    } else {
      continue;
    }
    std::memcpy(&out[i * w], &bits, w);
  }
  return out;
}

struct Quantized {
  std::vector<uint8_t> codes, scales;
};
Quantized QuantizeOnCpu(const QuantRecipe& recipe, DType dtype, std::span<const int64_t> shape,
                        const std::vector<uint8_t>& weight) {
  Quantized q;
  q.codes.resize(static_cast<size_t>(shape[0] * shape[1]));
  auto scale_shape = QuantScaleShape(recipe, shape[0], shape[1]);
  EXPECT_TRUE(scale_shape.ok());
  int64_t groups = 1;
  for (int64_t d : *scale_shape) groups *= d;  // [1] for a per-tensor scale
  q.scales.resize(static_cast<size_t>(groups) * DTypeSize(QuantScaleDType(recipe.scale_format)));
  const Status s = Fp8Quantize(recipe, {"w", dtype, shape}, weight.data(), q.codes.data(),
                               q.scales.data(), QuantKernel::kGeneric);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return q;
}

// The changed positions and values of `now` against `before` (1- or
// 4-byte elements).
std::pair<std::vector<uint32_t>, std::vector<uint8_t>> Changes(const std::vector<uint8_t>& before,
                                                               const std::vector<uint8_t>& now,
                                                               uint32_t w) {
  std::pair<std::vector<uint32_t>, std::vector<uint8_t>> c;
  for (uint32_t i = 0; i < now.size() / w; ++i) {
    if (std::memcmp(&before[i * w], &now[i * w], w) == 0) continue;
    c.first.push_back(i);
    c.second.insert(c.second.end(), now.begin() + i * w, now.begin() + (i + 1) * w);
  }
  return c;
}

// One quantize-then-diff on the device against the CPU quantizer and a
// CPU compare of its outputs: the changes, the refreshed snapshots, the
// digest changes; then the same weight again changes nothing.
void CheckQuantizeDiff(Workspace& ws, std::mt19937_64& rng, const QuantRecipe& recipe, DType dtype,
                       int64_t rows, int64_t cols, uint64_t misalign) {
  SCOPED_TRACE(std::string(QuantSchemeName(recipe.scheme)) + "/" +
               std::string(ScaleFormatName(recipe.scale_format)) + " " +
               std::string(DTypeName(dtype)) + " [" + std::to_string(rows) + ", " +
               std::to_string(cols) + "] misalign " + std::to_string(misalign));
  const std::vector<int64_t> shape = {rows, cols};
  const uint64_t n = static_cast<uint64_t>(rows * cols);
  const uint32_t w = static_cast<uint32_t>(DTypeSize(dtype));
  const std::vector<uint8_t> before = RandomWeights(dtype, n, rng);
  const std::vector<uint8_t> now = NudgeWeights(before, dtype, 0.03, rng() % n, rng);
  const Quantized q0 = QuantizeOnCpu(recipe, dtype, shape, before);
  const Quantized q1 = QuantizeOnCpu(recipe, dtype, shape, now);
  const auto want_codes = Changes(q0.codes, q1.codes, 1);
  const uint32_t sw = static_cast<uint32_t>(DTypeSize(QuantScaleDType(recipe.scale_format)));
  const auto want_scales = Changes(q0.scales, q1.scales, sw);
  const uint64_t groups = q0.scales.size() / sw;

  DeviceCopy weight = ToDevice(now, misalign * w);
  DeviceCopy codes = ToDevice(q0.codes, 0);
  DeviceCopy scales = ToDevice(q0.scales, 0);
  auto positions = Buffer::Device(n * 4), values = Buffer::Device(n);
  auto scale_positions = Buffer::Device(groups * 4), scale_values = Buffer::Device(groups * 4);
  ASSERT_TRUE(positions.ok() && values.ok() && scale_positions.ok() && scale_values.ok());
  auto scale_shape = QuantScaleShape(recipe, rows, cols);
  ASSERT_TRUE(scale_shape.ok());
  DeviceTensor weight_t{"w", dtype, shape, weight.data, nullptr, {}};
  DeviceTensor codes_t{"w", DType::kF8_E4M3, shape, codes.data, nullptr, {}};
  DeviceTensor scales_t{
      "w_scale", QuantScaleDType(recipe.scale_format), *scale_shape, scales.data, nullptr, {}};
  DiffOutput code_out{positions->data(), values->data(), nullptr, n};
  code_out.first_position = 77;
  DiffOutput scale_out{scale_positions->data(), scale_values->data(), nullptr, groups};
  auto got = QuantizeDiffOnDevice(ws, recipe, weight_t, codes_t, scales_t, code_out, scale_out);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->codes.count, want_codes.first.size());
  ASSERT_EQ(got->scales.count, want_scales.first.size());
  std::vector<uint32_t> pos(got->codes.count);
  if (!pos.empty())
    std::memcpy(pos.data(), ToHost(positions->data(), pos.size() * 4).data(), pos.size() * 4);
  EXPECT_EQ(pos, want_codes.first);
  EXPECT_EQ(ToHost(values->data(), pos.size()), want_codes.second);
  std::vector<uint32_t> spos(got->scales.count);
  if (!spos.empty())
    std::memcpy(spos.data(), ToHost(scale_positions->data(), spos.size() * 4).data(),
                spos.size() * 4);
  EXPECT_EQ(spos, want_scales.first);
  EXPECT_EQ(ToHost(scale_values->data(), spos.size() * sw), want_scales.second);
  EXPECT_EQ(ToHost(codes.data, n), q1.codes) << "code snapshot";
  EXPECT_EQ(ToHost(scales.data, q1.scales.size()), q1.scales) << "scale snapshot";
  stream::DigestOptions scalar;
  scalar.kernel = stream::DigestKernel::kScalar;
  auto d0 = stream::ComputeStateDigest(q0.codes, 1, 77, scalar);
  auto d1 = stream::ComputeStateDigest(q1.codes, 1, 77, scalar);
  ASSERT_TRUE(d0.ok() && d1.ok());
  EXPECT_EQ(got->codes.digest_change.a, (*d1 - *d0).a);
  EXPECT_EQ(got->codes.digest_change.b, (*d1 - *d0).b);

  auto again = QuantizeDiffOnDevice(ws, recipe, weight_t, codes_t, scales_t, code_out, scale_out);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->codes.count, 0u);
  EXPECT_EQ(again->scales.count, 0u);

  // The quantization alone, into fresh (poisoned) buffers.
  DeviceCopy fresh_codes = ToDevice(std::vector<uint8_t>(n, 0xA5), 0);
  DeviceCopy fresh_scales = ToDevice(std::vector<uint8_t>(q1.scales.size(), 0xA5), 0);
  const Status s = QuantizeOnDevice(ws, recipe, weight_t, fresh_codes.data, fresh_scales.data);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(ToHost(fresh_codes.data, n), q1.codes) << "QuantizeOnDevice codes";
  EXPECT_EQ(ToHost(fresh_scales.data, q1.scales.size()), q1.scales) << "QuantizeOnDevice scales";
}

const QuantRecipe kRecipes[] = {{QuantScheme::kBlock128, ScaleFormat::kF32},
                                {QuantScheme::kBlock128, ScaleFormat::kUe8m0},
                                {QuantScheme::kBlock128, ScaleFormat::kUe8m0F32},
                                {QuantScheme::kPerTensor, ScaleFormat::kF32},
                                {QuantScheme::kPerChannel, ScaleFormat::kF32}};

TEST_F(CudaTest, QuantizeDiffMatchesTheCpuQuantizerForEveryRecipeAndDtype) {
  for (const QuantRecipe& recipe : kRecipes) {
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      // Whole blocks; partial edge blocks; rows wider than a row tile of
      // the amax pass (8192); a row shorter than one load; misaligned.
      CheckQuantizeDiff(*ws_, rng_, recipe, dtype, 256, 512, 0);
      CheckQuantizeDiff(*ws_, rng_, recipe, dtype, 300, 700, 0);
      CheckQuantizeDiff(*ws_, rng_, recipe, dtype, 3, 9000, 0);
      CheckQuantizeDiff(*ws_, rng_, recipe, dtype, 5, 3, 0);
      CheckQuantizeDiff(*ws_, rng_, recipe, dtype, 130, 256, 1);
    }
  }
}

TEST_F(CudaTest, QuantizeDiffRefusesNonFiniteWeightsAndBadSnapshotsAndWritesNothing) {
  const QuantRecipe recipe{QuantScheme::kBlock128, ScaleFormat::kUe8m0};
  const std::vector<int64_t> shape = {200, 300};
  const uint64_t n = 200 * 300;
  std::vector<uint8_t> weight = RandomWeights(DType::kBF16, n, rng_);
  const Quantized q = QuantizeOnCpu(recipe, DType::kBF16, shape, weight);
  const uint16_t nan = 0x7FC0;
  std::memcpy(&weight[2 * 12345], &nan, 2);
  DeviceCopy wd = ToDevice(weight, 0), codes = ToDevice(q.codes, 0), scales = ToDevice(q.scales, 0);
  auto positions = Buffer::Device(n * 4), values = Buffer::Device(n);
  ASSERT_TRUE(positions.ok() && values.ok());
  DeviceTensor weight_t{"layer.w", DType::kBF16, shape, wd.data, nullptr, {}};
  DeviceTensor codes_t{"layer.w", DType::kF8_E4M3, shape, codes.data, nullptr, {}};
  DeviceTensor scales_t{"layer.w_scale", DType::kF8_E8M0, {2, 3}, scales.data, nullptr, {}};
  const DiffOutput code_out{positions->data(), values->data(), nullptr, n};
  const DiffOutput scale_out{positions->data(), values->data(), nullptr, 6};
  auto got = QuantizeDiffOnDevice(*ws_, recipe, weight_t, codes_t, scales_t, code_out, scale_out);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("'layer.w': holds a NaN"), std::string::npos)
      << got.status().message();
  EXPECT_EQ(ToHost(codes.data, n), q.codes);
  EXPECT_EQ(ToHost(scales.data, q.scales.size()), q.scales);

  DeviceTensor wrong_scales = scales_t;
  wrong_scales.dtype = DType::kF32;
  got = QuantizeDiffOnDevice(*ws_, recipe, weight_t, codes_t, wrong_scales, code_out, scale_out);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("scale snapshot is F32"), std::string::npos)
      << got.status().message();
  DeviceTensor wrong_codes = codes_t;
  wrong_codes.shape = {300, 200};
  got = QuantizeDiffOnDevice(*ws_, recipe, weight_t, wrong_codes, scales_t, code_out, scale_out);
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeOnDevice(*ws_, recipe, weight_t, codes.data, scales.data).code(),
            StatusCode::kInvalidArgument);  // the NaN
  EXPECT_EQ(ToHost(codes.data, n), q.codes);
  got = QuantizeDiffOnDevice(*ws_, {QuantScheme::kPerTensor, ScaleFormat::kUe8m0}, weight_t,
                             codes_t, scales_t, code_out, scale_out);
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  DiffOutput small = code_out;
  small.capacity = n - 1;
  got = QuantizeDiffOnDevice(*ws_, recipe, weight_t, codes_t, scales_t, small, scale_out);
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ToHost(codes.data, n), q.codes);
}

// Runs everywhere: without a GPU every entry point is a clean error, never
// a crash.
TEST(CudaWithoutGpu, EveryCallIsAFailedPrecondition) {
  if (DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  auto ws = Workspace::Create(0);
  ASSERT_FALSE(ws.ok());
  EXPECT_EQ(ws.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(ws.status().message().find("no CUDA device"), std::string::npos);
  EXPECT_EQ(Buffer::Device(16).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Buffer::PinnedHost(16).status().code(), StatusCode::kFailedPrecondition);
  int x = 0;
  EXPECT_EQ(QueryMemory(&x).status().code(), StatusCode::kFailedPrecondition);
  DeviceTensor t{"w", DType::kBF16, {1}, &x, nullptr, {}};
  EXPECT_EQ(CopyToDevice(t, &x, 2).code(), StatusCode::kFailedPrecondition);
}

TEST(CudaNames, MemoryKindsHaveNames) {
  EXPECT_EQ(MemoryKindName(MemoryKind::kHost), "host");
  EXPECT_EQ(MemoryKindName(MemoryKind::kPinnedHost), "pinned host");
  EXPECT_EQ(MemoryKindName(MemoryKind::kDevice), "device");
  EXPECT_EQ(MemoryKindName(MemoryKind::kManaged), "managed");
}

}  // namespace
}  // namespace deltasync::cuda
