// The entropy bound that encoded sizes are judged against.
#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "codec/codec_internal.h"

namespace deltasync {
namespace {

// Binary entropy in bits, 0 at the ends.
double BinaryEntropy(double p) {
  if (p <= 0.0 || p >= 1.0) return 0.0;
  return -(p * std::log2(p) + (1.0 - p) * std::log2(1.0 - p));
}

// Sum over symbols of -c * log2(c / total): total information in bits.
template <typename Counts>
double InformationBits(const Counts& counts, uint64_t total) {
  double bits = 0.0;
  const double log_total = std::log2(static_cast<double>(total));
  for (const auto& c : counts) {
    const uint64_t n = c;
    if (n) bits += static_cast<double>(n) * (log_total - std::log2(static_cast<double>(n)));
  }
  return bits;
}

}  // namespace

Result<EntropyBound> EntropyBoundBytes(const ChangeSet& changes) {
  const uint64_t es = changes.elem_size;
  if (!codec_internal::IsValidElemSize(es)) {
    return Status::InvalidArgument("entropy bound: element size " + std::to_string(es));
  }
  const uint64_t count = changes.count();
  if (count > changes.numel || changes.new_values.size() != count * es ||
      changes.old_values.size() != count * es) {
    return Status::InvalidArgument(
        "entropy bound: needs new and old values of every changed element (" +
        std::to_string(count) + " changes, " + std::to_string(changes.new_values.size()) +
        " new and " + std::to_string(changes.old_values.size()) + " old value bytes)");
  }
  EntropyBound bound;
  bound.numel = changes.numel;
  bound.count = count;
  bound.position_bytes = static_cast<double>(changes.numel) * BinaryEntropy(changes.density()) / 8;
  if (count == 0) return bound;

  auto xor_symbol = [&](uint64_t i) {
    uint64_t symbol = 0;
    for (uint64_t b = 0; b < es; ++b) {
      uint64_t x = changes.new_values[i * es + b] ^ changes.old_values[i * es + b];
      symbol |= x << (8 * b);
    }
    return symbol;
  };
  double bits = 0.0;
  if (es <= 2) {
    std::vector<uint64_t> counts(size_t{1} << (8 * es), 0);
    for (uint64_t i = 0; i < count; ++i) ++counts[xor_symbol(i)];
    bits = InformationBits(counts, count);
  } else {
    std::unordered_map<uint64_t, uint64_t> counts;
    counts.reserve(static_cast<size_t>(std::min<uint64_t>(count, uint64_t{1} << 20)));
    for (uint64_t i = 0; i < count; ++i) ++counts[xor_symbol(i)];
    std::vector<uint64_t> values;
    values.reserve(counts.size());
    for (const auto& [symbol, n] : counts) values.push_back(n);
    bits = InformationBits(values, count);
  }
  bound.value_bytes = bits / 8;
  return bound;
}

}  // namespace deltasync
