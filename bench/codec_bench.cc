// Encode and decode-and-apply speed of every delta encoding on a 64 MiB
// BF16 tensor after one Adam-like step (~2% of elements changed), next to a
// memcpy of the same bytes.
//
// bytes_per_second counts the dense tensor bytes, so encode/decode rates read
// directly against memcpy and against the targets (sparse: encode >= 1.5 GB/s,
// decode+apply >= 2 GB/s per core). bytes_per_changed is the encoded size per
// changed element; the EntropyBound case reports the bound it is judged by.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "deltasync/codec.h"
#include "deltasync/diff.h"

namespace deltasync {
namespace {

constexpr size_t kCodecTensorElems = size_t{32} << 20;  // 64 MiB of BF16
constexpr float kCodecAdamStep = 4.2e-7f;               // ~2% of elements flip rounding

uint16_t RoundToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

struct CodecBenchData {
  std::vector<uint8_t> old_bytes;
  std::vector<uint8_t> new_bytes;
  ChangeSet changes;

  static CodecBenchData& Get() {
    static CodecBenchData* data = [] {
      auto* d = new CodecBenchData;
      d->old_bytes.resize(kCodecTensorElems * 2);
      d->new_bytes.resize(kCodecTensorElems * 2);
      std::mt19937_64 rng(2024);
      std::normal_distribution<float> weight(0.0f, 0.02f);
      for (size_t i = 0; i < kCodecTensorElems; ++i) {
        const float w = weight(rng);
        const uint16_t before = RoundToBf16(w);
        const uint16_t after = RoundToBf16(w - ((rng() & 1) ? kCodecAdamStep : -kCodecAdamStep));
        std::memcpy(&d->old_bytes[2 * i], &before, 2);
        std::memcpy(&d->new_bytes[2 * i], &after, 2);
      }
      std::vector<uint8_t> snapshot = d->old_bytes;
      DiffOptions options;
      options.elem_size = 2;
      if (!DiffTensor(d->new_bytes, snapshot, options, &d->changes).ok()) std::abort();
      return d;
    }();
    return *data;
  }
};

void SetRates(benchmark::State& state, size_t encoded_bytes) {
  const CodecBenchData& data = CodecBenchData::Get();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * data.new_bytes.size()));
  state.counters["density"] = data.changes.density();
  if (encoded_bytes) {
    state.counters["bytes_per_changed"] =
        static_cast<double>(encoded_bytes) / static_cast<double>(data.changes.count());
  }
}

void BM_CodecMemcpy(benchmark::State& state) {
  const CodecBenchData& data = CodecBenchData::Get();
  std::vector<uint8_t> target(data.new_bytes.size());
  for (auto _ : state) {
    std::memcpy(target.data(), data.new_bytes.data(), target.size());
    benchmark::DoNotOptimize(target.data());
    benchmark::ClobberMemory();
  }
  SetRates(state, 0);
}

void BM_CodecEncode(benchmark::State& state, Encoding encoding) {
  const CodecBenchData& data = CodecBenchData::Get();
  std::vector<uint8_t> encoded;
  for (auto _ : state) {
    encoded.clear();
    Status status = Encode(encoding, data.new_bytes, data.changes, {}, &encoded);
    if (!status.ok()) state.SkipWithError(status.ToString().c_str());
    benchmark::DoNotOptimize(encoded.data());
  }
  SetRates(state, encoded.size());
}

// Applying the same delta repeatedly is valid for every encoding: xor-based
// ones toggle between base and new (same work each time), the others are
// idempotent.
void BM_CodecDecodeApply(benchmark::State& state, Encoding encoding) {
  const CodecBenchData& data = CodecBenchData::Get();
  std::vector<uint8_t> encoded;
  if (!Encode(encoding, data.new_bytes, data.changes, {}, &encoded).ok()) {
    state.SkipWithError("encode failed");
    return;
  }
  std::vector<uint8_t> target = data.old_bytes;
  for (auto _ : state) {
    Status status = DecodeApply(encoding, encoded, target, 2);
    if (!status.ok()) state.SkipWithError(status.ToString().c_str());
    benchmark::ClobberMemory();
  }
  SetRates(state, encoded.size());
}

void BM_CodecEntropyBound(benchmark::State& state) {
  const CodecBenchData& data = CodecBenchData::Get();
  double per_changed = 0;
  for (auto _ : state) {
    Result<EntropyBound> bound = EntropyBoundBytes(data.changes);
    if (!bound.ok()) state.SkipWithError(bound.status().ToString().c_str());
    per_changed = bound.ok() ? bound->bytes_per_changed() : 0;
  }
  SetRates(state, 0);
  state.counters["bytes_per_changed"] = per_changed;
}

BENCHMARK(BM_CodecMemcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CodecEntropyBound)->Unit(benchmark::kMillisecond)->UseRealTime();
// Every encoding, from the registry: BM_CodecEncode/<name> for each, then
// BM_CodecDecodeApply/<name>.
[[maybe_unused]] const bool kCodecBenchmarksRegistered = [] {
  struct Kind {
    const char* name;
    void (*run)(benchmark::State&, Encoding);
  };
  for (const Kind& kind : {Kind{"BM_CodecEncode", &BM_CodecEncode},
                           Kind{"BM_CodecDecodeApply", &BM_CodecDecodeApply}}) {
    for (Encoding encoding : AllEncodings()) {
      const std::string name = std::string(kind.name) + "/" + std::string(EncodingName(encoding));
      benchmark::RegisterBenchmark(name.c_str(), kind.run, encoding)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  return true;
}();

}  // namespace
}  // namespace deltasync
