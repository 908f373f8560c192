// Helpers shared by the tests of the fused diff (the pipeline's and the
// publisher's): random tensors and mutations of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace deltasync::pipeline_test {

// `old_bytes` with about `density` of its elements changed, always
// including the first and last (when density > 0).
inline std::vector<uint8_t> Mutate(const std::vector<uint8_t>& old_bytes, uint32_t elem_size,
                                   double density, std::mt19937_64* rng) {
  std::vector<uint8_t> out = old_bytes;
  const size_t numel = out.size() / elem_size;
  if (density <= 0 || numel == 0) return out;
  std::bernoulli_distribution pick(density);
  for (size_t i = 0; i < numel; ++i) {
    if (i == 0 || i + 1 == numel || pick(*rng)) {
      // Any byte of the element, so that every byte lane is exercised.
      out[i * elem_size + (*rng)() % elem_size] ^= static_cast<uint8_t>(1 + (*rng)() % 255);
    }
  }
  return out;
}

inline std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64* rng) {
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>((*rng)());
  return out;
}

}  // namespace deltasync::pipeline_test
