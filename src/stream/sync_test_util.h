// Shared by the stream sync tests and their peer process.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/dtype.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"

namespace deltasync::sync_test {

// A communicator factory that never forms a group (Unavailable), counting
// its calls in `*connects` when given: for checks that fail before
// anything is sent.
inline CommunicatorFactory NoGroup(int* connects = nullptr) {
  return [connects]() -> Result<std::unique_ptr<Communicator>> {
    if (connects != nullptr) ++*connects;
    return Status::Unavailable("no group in this test");
  };
}

// That `got` (a receiver's buffer of tensor `name`, laid out by `runs`;
// empty runs: the whole tensor) holds `want`'s elements; Corruption naming
// the first differing element otherwise.
inline Status HeldMatches(const std::string& name, size_t w, const std::vector<uint8_t>& want,
                          const std::vector<uint8_t>& got,
                          const std::vector<DestinationRun>& runs) {
  if (runs.empty()) {
    return got == want ? Status::OK() : Status::Corruption("tensor " + name + " differs");
  }
  for (const DestinationRun& r : runs) {
    for (uint64_t k = 0; k < r.count; ++k) {
      if (std::memcmp(got.data() + (r.dest_offset + k * r.dest_stride) * w,
                      want.data() + (r.hf_first + k) * w, w) != 0) {
        return Status::Corruption("tensor " + name + " element " + std::to_string(r.hf_first + k) +
                                  " differs");
      }
    }
  }
  return Status::OK();
}

// A small model: BF16 and F32 tensors, one of them 2-D so that receivers
// can hold row and column slices of it.
struct Model {
  std::vector<SyncTensor> tensors;
  std::vector<std::vector<uint8_t>> bytes;

  using Spec = std::tuple<std::string, DType, std::vector<int64_t>>;
  static std::vector<Spec> DefaultSpecs() {
    return {
        {"a.weight", DType::kBF16, {64, 48}},
        {"b.bias", DType::kF32, {300}},
        {"c.weight", DType::kBF16, {5000}},
        {"d.empty", DType::kBF16, {0, 4}},
    };
  }
  // Random bytes for each tensor of `specs`.
  static Model Make(uint64_t seed, const std::vector<Spec>& specs = DefaultSpecs()) {
    Model m;
    std::mt19937_64 rng(seed);
    for (const auto& [name, dtype, shape] : specs) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<uint8_t> b(n * DTypeSize(dtype));
      for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
      m.bytes.push_back(std::move(b));
      m.tensors.push_back({name, dtype, shape, {}, {}});
    }
    m.Rebind();
    return m;
  }
  void Rebind() {
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = bytes[i];
  }
  // Changes about `fraction` of the elements, some to NaN payloads and -0.0.
  void Step(uint64_t seed, double fraction) {
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t w = DTypeSize(tensors[i].dtype);
      const size_t n = bytes[i].size() / w;
      for (size_t e = 0; e < n; ++e) {
        if (std::uniform_real_distribution<double>(0, 1)(rng) >= fraction) continue;
        uint8_t* p = bytes[i].data() + e * w;
        switch (rng() % 4) {
          case 0:  // -0.0
            std::memset(p, 0, w);
            p[w - 1] = 0x80;
            break;
          case 1:  // a NaN with a payload
            std::memset(p, 0xFF, w);
            p[0] = static_cast<uint8_t>(rng() | 1);
            break;
          default: p[0] ^= static_cast<uint8_t>(rng() | 1);
        }
      }
    }
  }
  const std::vector<uint8_t>& Of(const std::string& name) const {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].name == name) return bytes[i];
    }
    static const std::vector<uint8_t> none;
    return none;
  }
};

// That the file a peer process writes after each sync (every tensor's
// bytes back to back) holds `m`, within `limit` (polled: the peer writes it
// after its report).
inline bool PeerHolds(const std::string& path, const Model& m, std::chrono::milliseconds limit) {
  std::vector<uint8_t> want;
  for (const std::vector<uint8_t>& b : m.bytes) want.insert(want.end(), b.begin(), b.end());
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    std::vector<uint8_t> got;
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      uint8_t buf[4096];
      size_t n = 0;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) got.insert(got.end(), buf, buf + n);
      std::fclose(f);
    }
    if (got == want) return true;
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The model's tensors as a Model, for the receivers and the checks.
inline Model ShardedModel(uint64_t seed) {
  Model m = Model::Make(seed);
  std::mt19937_64 rng(seed + 1);
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"e.weight", {24, 37}}, {"q.weight", {16, 48}}, {"k.weight", {8, 48}}}) {
    std::vector<uint8_t> b(shape[0] * shape[1] * 2);
    for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
    m.bytes.push_back(std::move(b));
    m.tensors.push_back({name, DType::kBF16, shape, {}, {}});
  }
  m.Rebind();
  return m;
}

// Rank r's local tensors: a.weight Shard(0), c.weight uneven, e.weight
// Shard(1) (37 columns: 10, 10, 10, 7), b.bias replicated (rank 2 sends),
// q and k fused along dim 0 and split in 2 for tensor parallelism (ranks 2
// and 3 replicate ranks 0 and 1 and do not send), d.empty whole on rank 0.
// The spec; a spec that cannot be made is a bug of the test, which stops.
inline ShardSpec Spec(Result<ShardSpec> r) {
  if (!r.ok()) {
    std::fprintf(stderr, "sync_test::Spec: %s\n", r.status().ToString().c_str());
    std::abort();
  }
  return std::move(*r);
}

inline std::vector<ShardSpec> RankSpecs(int r) {
  std::vector<ShardSpec> out;
  out.push_back(Spec(ShardSpec::Shard("a.weight", DType::kBF16, {64, 48}, 0, r, 4)));
  out.push_back(
      Spec(ShardSpec::ShardSizes("c.weight", DType::kBF16, {5000}, 0, {2000, 1500, 1500, 0}, r)));
  out.push_back(Spec(ShardSpec::Shard("e.weight", DType::kBF16, {24, 37}, 1, r, 4)));
  out.push_back(Spec(ShardSpec::Replicate("b.bias", DType::kF32, {300}, r == 2)));
  ShardSpec fused = Spec(
      ShardSpec::Fused(DType::kBF16, 0,
                       {Spec(ShardSpec::Shard("q.weight", DType::kBF16, {16, 48}, 0, r % 2, 2)),
                        Spec(ShardSpec::Shard("k.weight", DType::kBF16, {8, 48}, 0, r % 2, 2))}));
  fused.contributes = r < 2;
  out.push_back(fused);
  if (r == 0) out.push_back(Spec(ShardSpec::Whole("d.empty", DType::kBF16, {0, 4})));
  return out;
}

// The same placements over `ranks` trainer ranks, 4 or 2: with 2, c.weight
// splits 2000 and 3000, b.bias is sent by rank 1, and q and k are fused
// and split in 2 with no replicas.
inline std::vector<ShardSpec> RankSpecs(int r, int ranks) {
  if (ranks == 4) return RankSpecs(r);
  std::vector<ShardSpec> out;
  out.push_back(Spec(ShardSpec::Shard("a.weight", DType::kBF16, {64, 48}, 0, r, 2)));
  out.push_back(Spec(ShardSpec::ShardSizes("c.weight", DType::kBF16, {5000}, 0, {2000, 3000}, r)));
  out.push_back(Spec(ShardSpec::Shard("e.weight", DType::kBF16, {24, 37}, 1, r, 2)));
  out.push_back(Spec(ShardSpec::Replicate("b.bias", DType::kF32, {300}, r == 1)));
  out.push_back(
      Spec(ShardSpec::Fused(DType::kBF16, 0,
                            {Spec(ShardSpec::Shard("q.weight", DType::kBF16, {16, 48}, 0, r, 2)),
                             Spec(ShardSpec::Shard("k.weight", DType::kBF16, {8, 48}, 0, r, 2))})));
  if (r == 0) out.push_back(Spec(ShardSpec::Whole("d.empty", DType::kBF16, {0, 4})));
  return out;
}

// A local tensor's bytes, read out of the whole tensors element by element.
inline std::vector<uint8_t> Extract(const ShardSpec& spec, const Model& m) {
  const size_t w = DTypeSize(spec.dtype);
  std::vector<uint8_t> out(spec.local_numel() * w);
  const size_t nd = spec.local_shape.size();
  for (const ShardPiece& p : spec.pieces) {
    const std::vector<uint8_t>& hf = m.Of(p.hf_name);
    std::vector<int64_t> c(nd, 0);
    for (int64_t e = 0; e < p.elements(); ++e) {
      int64_t rem = e, local = 0, global = 0;
      for (size_t d = nd; d-- > 0;) {
        c[d] = rem % p.extent[d];
        rem /= p.extent[d];
      }
      for (size_t d = 0; d < nd; ++d) {
        local = local * spec.local_shape[d] + p.local_offset[d] + c[d];
        global = global * p.hf_shape[d] + p.hf_offset[d] + c[d];
      }
      std::memcpy(out.data() + local * w, hf.data() + global * w, w);
    }
  }
  return out;
}

// Every rank's SyncShards at once, each holding its rows (Shard(0)) of
// every tensor of `m` (a 0-dim tensor replicated, the last rank sending
// it): the ranks' results.
inline std::vector<Status> SyncRowShards(const std::vector<std::unique_ptr<StreamSender>>& ranks,
                                         const std::vector<ModelTensor>& model, const Model& m) {
  const int n = static_cast<int>(ranks.size());
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::vector<uint8_t>> bytes;
      std::vector<ShardedTensor> shards;
      for (const SyncTensor& t : m.tensors) {
        Result<ShardSpec> spec = t.shape.empty()
                                     ? ShardSpec::Replicate(t.name, t.dtype, t.shape, r == n - 1)
                                     : ShardSpec::Shard(t.name, t.dtype, t.shape, 0, r, n);
        if (!spec.ok()) {
          results[r] = spec.status();
          return;
        }
        bytes.push_back(Extract(*spec, m));
        shards.push_back({std::move(*spec), {}, {}});
      }
      for (size_t i = 0; i < shards.size(); ++i) shards[i].data = bytes[i];
      Result<SyncStats> got = ranks[r]->SyncShards(model, shards);
      results[r] = got.ok() ? Status::OK() : got.status();
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

}  // namespace deltasync::sync_test
