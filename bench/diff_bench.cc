// Fused diff + snapshot refresh against a plain memcpy of the same bytes.
//
// The target (README.md, "Diff and encodings") is diff time <= 1.25x memcpy
// time on a large BF16 tensor with ~2% of elements changed at scattered
// positions, with one and with two threads. Both sides report bytes_per_second over
// the dense tensor bytes, so the ratio is read straight off the output.
//
// BM_CountChanged reads both inputs and writes nothing: the floor for the
// fused pass. On one core, reading two streams is itself slower than a
// memcpy of one (which streams its writes), so the single-thread ratio is
// bounded by that floor; with two threads the pass is bandwidth-bound and
// lands near memcpy.
//
// Every diff iteration must find real changes, so the snapshot alternates
// between two versions A and B that differ in 2% of elements: diffing B
// against a snapshot holding A refreshes it to B, and the next iteration
// diffs A against it.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/thread_pool.h"

namespace deltasync {
namespace {

constexpr size_t kTensorBytes = size_t{256} << 20;
constexpr uint32_t kBf16 = 2;
constexpr uint64_t kChangeOneIn = 50;  // 2% of elements

uint64_t NextRandom(uint64_t& state) {  // splitmix64: fast enough for 256 MiB
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Buffers shared by all cases, built once (building takes longer than a
// measurement).
struct BenchData {
  std::vector<uint8_t> version_a;
  std::vector<uint8_t> version_b;  // version_a with ~2% of elements changed
  std::vector<uint8_t> snapshot;   // holds version_a or version_b
  std::vector<uint8_t> copy_target;
  bool snapshot_is_a = true;

  static BenchData& Get() {
    static BenchData* data = [] {
      auto* d = new BenchData;
      d->version_a.resize(kTensorBytes);
      uint64_t rng = 42;
      for (size_t i = 0; i < kTensorBytes; i += 8) {
        const uint64_t r = NextRandom(rng);
        std::memcpy(d->version_a.data() + i, &r, 8);
      }
      d->version_b = d->version_a;
      for (size_t i = 0; i < kTensorBytes; i += kBf16) {
        // Flip a low mantissa bit: the kind of change an optimizer step makes.
        if (NextRandom(rng) % kChangeOneIn == 0) d->version_b[i] ^= 1;
      }
      d->snapshot = d->version_a;
      d->copy_target.assign(kTensorBytes, 0);
      return d;
    }();
    return *data;
  }
};

// A pool giving `threads` participants in total (the caller is one).
std::unique_ptr<ThreadPool> PoolFor(int threads) {
  return threads > 1 ? std::make_unique<ThreadPool>(threads - 1) : nullptr;
}

void BM_Memcpy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  BenchData& data = BenchData::Get();
  std::unique_ptr<ThreadPool> pool = PoolFor(threads);
  const size_t share = kTensorBytes / threads;
  for (auto _ : state) {
    if (pool == nullptr) {
      std::memcpy(data.copy_target.data(), data.version_a.data(), kTensorBytes);
    } else {
      pool->ParallelFor(threads, [&](size_t t) {
        const size_t begin = t * share;
        const size_t end = t + 1 == static_cast<size_t>(threads) ? kTensorBytes : begin + share;
        std::memcpy(data.copy_target.data() + begin, data.version_a.data() + begin, end - begin);
      });
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kTensorBytes);
}

void BM_DiffRefresh(benchmark::State& state, DiffKernel kernel, int threads) {
  const std::vector<DiffKernel> available = AvailableDiffKernels();
  if (std::find(available.begin(), available.end(), kernel) == available.end()) {
    state.SkipWithError("kernel not available on this CPU");
    return;
  }
  BenchData& data = BenchData::Get();
  std::unique_ptr<ThreadPool> pool = PoolFor(threads);
  DiffOptions options;
  options.elem_size = kBf16;
  options.kernel = kernel;
  options.pool = pool.get();
  ChangeSet changes;
  uint64_t changed = 0;
  for (auto _ : state) {
    const std::vector<uint8_t>& next = data.snapshot_is_a ? data.version_b : data.version_a;
    const Status status = DiffTensor(next, data.snapshot, options, &changes);
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    data.snapshot_is_a = !data.snapshot_is_a;
    changed += changes.count();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kTensorBytes);
  state.counters["changed_fraction"] = static_cast<double>(changed) /
                                       static_cast<double>(state.iterations()) /
                                       static_cast<double>(kTensorBytes / kBf16);
}

void BM_CountChanged(benchmark::State& state) {
  BenchData& data = BenchData::Get();
  for (auto _ : state) {
    Result<uint64_t> count = CountChanged(data.version_a, data.version_b, kBf16);
    benchmark::DoNotOptimize(count);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kTensorBytes);
}

BENCHMARK(BM_Memcpy)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_CountChanged)->UseRealTime()->Unit(benchmark::kMillisecond);

[[maybe_unused]] const bool kDiffCasesRegistered = [] {
  for (DiffKernel kernel : {DiffKernel::kScalar, DiffKernel::kAvx2, DiffKernel::kAvx512}) {
    for (int threads : {1, 2}) {
      const std::string name = "BM_DiffRefresh/" + std::string(DiffKernelName(kernel)) +
                               "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), BM_DiffRefresh, kernel, threads)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  return true;
}();

}  // namespace
}  // namespace deltasync
