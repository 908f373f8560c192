// Shared by the stream sync tests and their peer process.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "deltasync/communicator.h"
#include "deltasync/dtype.h"
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

}  // namespace deltasync::sync_test
