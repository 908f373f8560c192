// The state digest's full compute (src/stream/state_digest.h) against a
// plain memcpy of the same bytes, per kernel and element width. Both report
// bytes_per_second over the tensor bytes, so the ratio is read straight off
// the output. A receiver recomputes it over everything it holds every K-th
// sync, and a trainer over its shards at seeding. Then a receiver's apply:
// one delta entry, and a whole frame of the same changes in few large
// tensors and in thousands of small ones (BM_ApplyFrame: the two should
// take about the same time).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "deltasync/thread_pool.h"
#include "stream/frame.h"
#include "stream/state_digest.h"

namespace deltasync::stream {
namespace {

constexpr size_t kBytes = size_t{64} << 20;

const std::vector<uint8_t>& Data() {
  static const std::vector<uint8_t>* data = [] {
    auto* d = new std::vector<uint8_t>(kBytes);
    uint64_t z = 42;
    for (size_t i = 0; i < kBytes; i += 8) {
      z += 0x9E3779B97F4A7C15ull;
      uint64_t x = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
      x ^= x >> 31;
      std::memcpy(d->data() + i, &x, 8);
    }
    return d;
  }();
  return *data;
}

void BM_StateDigestMemcpy(benchmark::State& state) {
  const std::vector<uint8_t>& data = Data();
  std::vector<uint8_t> target(kBytes, 1);
  for (auto _ : state) {
    std::memcpy(target.data(), data.data(), kBytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBytes);
}

void BM_StateDigest(benchmark::State& state, DigestKernel kernel, uint32_t elem_size, int threads) {
  const std::vector<DigestKernel> available = AvailableDigestKernels();
  if (std::find(available.begin(), available.end(), kernel) == available.end()) {
    state.SkipWithError("kernel not available on this CPU");
    return;
  }
  const std::vector<uint8_t>& data = Data();
  std::unique_ptr<ThreadPool> pool =
      threads > 1 ? std::make_unique<ThreadPool>(threads - 1) : nullptr;
  DigestOptions options;
  options.kernel = kernel;
  options.pool = pool.get();
  for (auto _ : state) {
    Result<StateDigest> d = ComputeStateDigest(data, elem_size, 0, options);
    if (!d.ok()) {
      state.SkipWithError(d.status().ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(d->a);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kBytes);
}

BENCHMARK(BM_StateDigestMemcpy)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, scalar_bf16, DigestKernel::kScalar, 2, 1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, avx2_bf16, DigestKernel::kAvx2, 2, 1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, avx512_bf16, DigestKernel::kAvx512, 2, 1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, avx512_u8, DigestKernel::kAvx512, 1, 1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, avx512_f32, DigestKernel::kAvx512, 4, 1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, avx512_f64, DigestKernel::kAvx512, 8, 1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StateDigest, best_bf16_2threads, BestDigestKernel(), 2, 2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// A receiver's delta apply: one indices entry of a BF16 tensor (the digest
// data, 32M elements) with about 1.7% of its elements changed, scattered in
// place with and without the running digest update, against the digest
// update alone.
struct ApplyCase {
  std::vector<int64_t> shape;
  std::vector<uint8_t> positions;  // little-endian u32
  std::vector<uint8_t> values;
  std::vector<uint64_t> absolute;
  FlushEntry entry;
};

const ApplyCase& Delta() {
  static const ApplyCase* c = [] {
    auto* a = new ApplyCase;
    const uint64_t numel = kBytes / 2;
    a->shape = {static_cast<int64_t>(numel)};
    const std::vector<uint8_t>& data = Data();
    for (uint64_t p = 0; p < numel; ++p) {
      if (data[p] >= 4) continue;  // 4 in 256 of the bytes: ~1.6%
      a->absolute.push_back(p);
      const uint32_t p32 = static_cast<uint32_t>(p);
      a->positions.insert(a->positions.end(), reinterpret_cast<const uint8_t*>(&p32),
                          reinterpret_cast<const uint8_t*>(&p32) + 4);
      a->values.push_back(data[(p * 7) % kBytes]);
      a->values.push_back(data[(p * 13) % kBytes]);
    }
    a->entry.name = "t";
    a->entry.dtype = DType::kBF16;
    a->entry.shape = a->shape;
    a->entry.numel = numel;
    a->entry.count = numel;
    a->entry.encoding = WireEncoding::kIndices;
    a->entry.value_count = a->absolute.size();
    a->entry.position_width = 4;
    a->entry.positions = a->positions;
    a->entry.values = a->values;
    return a;
  }();
  return *c;
}

void BM_ApplyIndices(benchmark::State& state, bool digest) {
  const ApplyCase& c = Delta();
  std::vector<uint8_t> dest(Data());
  const DestinationMap map = DestinationMap::Whole(c.entry.numel);
  StateDigest running;
  for (auto _ : state) {
    Result<uint64_t> n = ApplyEntry(c.entry, map, dest, digest ? &running : nullptr);
    if (!n.ok()) {
      state.SkipWithError(n.status().ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(running.a);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * c.absolute.size()));
}

void BM_UpdateStateDigest(benchmark::State& state) {
  const ApplyCase& c = Delta();
  std::vector<uint8_t> old(c.values.rbegin(), c.values.rend());
  StateDigest running;
  for (auto _ : state) {
    Status s = UpdateStateDigest(&running, Positions::Absolute(c.absolute), old, c.values, 2);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(running.a);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * c.absolute.size()));
}

BENCHMARK_CAPTURE(BM_ApplyIndices, bf16_no_digest, false)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ApplyIndices, bf16_digest, true)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_UpdateStateDigest)->UseRealTime()->Unit(benchmark::kMillisecond);

// A receiver's apply of a delta frame (ApplyEntries on two threads, digest
// moves on): the same 256 MiB of BF16 and about 1.7% of its elements
// changed, held as 16 large tensors (entries of 786,432 elements, units as
// a sender of 16 MiB buckets cuts them) or as 10,922 small ones (64 x 192,
// a mixture of experts' projections), each its own allocation. The frame
// lists a sender's tensors by name, so the small ones come in an order
// other than their memory's (experts 0, 1, 10, 100, ...): `memory_order`
// lists them as they lie instead.
enum class Layout { kFewLarge, kManySmall, kManySmallMemoryOrder };

struct FrameCase {
  std::vector<std::vector<uint8_t>> tensors;
  std::vector<DestinationMap> maps;
  FrameBuffer frame;
  FlushReader reader;
  std::vector<EntryDestination> dests;
  uint64_t changes = 0;
};

const FrameCase& Frame(Layout layout) {
  static FrameCase* cases[3] = {};
  FrameCase*& c = cases[static_cast<int>(layout)];
  if (c != nullptr) return *c;
  c = new FrameCase;
  constexpr uint64_t kElements = uint64_t{128} << 20;
  const bool small = layout != Layout::kFewLarge;
  const uint64_t numel = small ? 64 * 192 : kElements / 16;
  const uint64_t unit = small ? numel : 786432;
  const size_t count = static_cast<size_t>(kElements / numel);
  std::vector<std::string> names;
  for (size_t t = 0; t < count; ++t) {
    names.push_back("model.layers." + std::to_string(t / 128) + ".mlp.experts." +
                    std::to_string(t % 128) + ".up_proj.weight");
    c->tensors.emplace_back(numel * 2, 1);
    c->maps.push_back(DestinationMap::Whole(numel));
  }
  std::vector<size_t> order(count);
  for (size_t t = 0; t < count; ++t) order[t] = t;
  if (layout != Layout::kManySmallMemoryOrder) {
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return names[a] < names[b]; });
  }
  FlushWriter writer;
  FlushHeader header;
  header.sync_id = 1;
  if (!writer.Begin(header, uint64_t{1} << 30, &c->frame).ok()) std::abort();
  uint64_t z = 7;
  std::vector<uint64_t> positions;
  std::vector<uint8_t> values;
  std::vector<size_t> entry_tensor;
  for (size_t t : order) {
    const std::vector<int64_t> shape = {static_cast<int64_t>(numel)};
    for (uint64_t first = 0; first < numel; first += unit) {
      positions.clear();
      values.clear();
      const uint64_t n = std::min(unit, numel - first);
      for (uint64_t p = first; p < first + n; ++p) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        if ((z >> 33) % 1000 >= 17) continue;
        positions.push_back(p);
        values.push_back(static_cast<uint8_t>(z >> 8));
        values.push_back(static_cast<uint8_t>(z >> 16));
      }
      Result<bool> added = writer.AddIndices({names[t], DType::kBF16, shape, first, n},
                                             Positions::Absolute(positions), values);
      if (!added.ok() || !*added) std::abort();
      entry_tensor.push_back(t);
      c->changes += positions.size();
    }
  }
  if (!writer.Finish().ok() || !c->reader.Read(c->frame).ok()) std::abort();
  for (size_t t : entry_tensor) c->dests.push_back({&c->maps[t], c->tensors[t]});
  return *c;
}

void BM_ApplyFrame(benchmark::State& state, Layout layout) {
  const FrameCase& c = Frame(layout);
  ThreadPool pool(1);
  std::vector<StateDigest> moves;
  for (auto _ : state) {
    const AppliedEntries done = ApplyEntries(c.reader.entries(), c.dests, &pool, &moves);
    if (!done.failed.ok()) {
      state.SkipWithError(done.failed.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(moves.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * c.changes));
  state.counters["entries"] = static_cast<double>(c.dests.size());
}

BENCHMARK_CAPTURE(BM_ApplyFrame, few_large, Layout::kFewLarge)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ApplyFrame, many_small, Layout::kManySmall)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_ApplyFrame, many_small_memory_order, Layout::kManySmallMemoryOrder)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace deltasync::stream
