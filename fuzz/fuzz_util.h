// Helpers shared by the libFuzzer targets that read files: a scratch
// directory (tmpfs when there is one), whole-file reads and writes, small
// models with scattered changes, and comparisons of checkpoints with them.
// The targets cannot use the GoogleTest helpers of the tests.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/checkpoint.h"
#include "deltasync/tensor.h"

namespace deltasync::fuzz_util {

inline void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

// A fresh directory, removed when the process exits normally. tmpfs when
// available: the targets rewrite files for every input, which costs more
// than the parse itself on a journaling file system.
class ScratchDir {
 public:
  explicit ScratchDir(const char* prefix) {
    const char* env = std::getenv("TMPDIR");
    const std::string dir = env && *env                       ? env
                            : ::access("/dev/shm", W_OK) == 0 ? "/dev/shm"
                                                              : "/tmp";
    std::string pattern = dir + "/" + prefix + "_XXXXXX";
    Require(::mkdtemp(pattern.data()) != nullptr, "mkdtemp");
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

inline void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  Require(out.good(), "write scratch file");
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Replaces `to` with a copy of directory `from` (recursively).
inline void CopyDir(const std::string& from, const std::string& to) {
  std::error_code ec;
  std::filesystem::remove_all(to, ec);
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive, ec);
  Require(!ec, "copy scratch directory");
}

inline uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct OwnedTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
  TensorView view() const { return {name, dtype, shape, data}; }
};
using Model = std::vector<OwnedTensor>;

inline std::vector<TensorView> Views(const Model& model) {
  std::vector<TensorView> views;
  for (const OwnedTensor& t : model) views.push_back(t.view());
  return views;
}

// A few small tensors of mixed element sizes, deterministic in `seed`.
inline Model SmallModel(uint64_t seed) {
  Model m;
  auto add = [&](std::string name, DType dtype, std::vector<int64_t> shape) {
    OwnedTensor t{std::move(name), dtype, std::move(shape), {}};
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    t.data.resize(static_cast<size_t>(numel) * DTypeSize(dtype));
    for (uint8_t& b : t.data) b = static_cast<uint8_t>(SplitMix(seed));
    m.push_back(std::move(t));
  };
  add("model.embed_tokens.weight", DType::kBF16, {32, 16});
  add("model.layers.0.mlp.up_proj.weight", DType::kBF16, {16, 24});
  add("model.layers.0.self_attn.q_proj.bias", DType::kF32, {16});
  add("model.norm.weight", DType::kF64, {8});
  add("model.quant.scales", DType::kU8, {40});
  return m;
}

// Changes about one element in 16 of each tensor (at least one).
inline Model Step(const Model& model, uint64_t seed) {
  Model next = model;
  for (OwnedTensor& t : next) {
    const size_t es = DTypeSize(t.dtype);
    const size_t numel = t.data.size() / es;
    for (size_t i = SplitMix(seed) % 16; i < numel; i += 1 + SplitMix(seed) % 31) {
      t.data[i * es + SplitMix(seed) % es] ^= static_cast<uint8_t>(1 + SplitMix(seed) % 255);
    }
  }
  return next;
}

// Whether the checkpoint at `dir` holds exactly `model`'s tensors: the same
// names, dtypes, shapes and bytes.
inline bool HoldsModel(const std::string& dir, const Model& model) {
  Result<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  if (!c.ok() || (*c)->tensors().size() != model.size()) return false;
  for (const OwnedTensor& t : model) {
    Result<TensorView> v = (*c)->Get(t.name);
    if (!v.ok() || v->dtype != t.dtype || v->shape != t.shape || v->bytes.size() != t.data.size() ||
        (!t.data.empty() && std::memcmp(v->bytes.data(), t.data.data(), t.data.size()) != 0)) {
      return false;
    }
  }
  return true;
}

// Every regular file directly inside `dir` except hidden ones, by name.
inline std::map<std::string, std::string> VisibleFiles(const std::string& dir) {
  std::map<std::string, std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] == '.' || !e.is_regular_file()) continue;
    files[name] = ReadFile(e.path().string());
  }
  return files;
}

// Parses `text` as a checkpoint index; what is accepted must name only plain
// files and survive a serialize/parse round trip unchanged.
inline Result<CheckpointIndex> CheckIndexRoundTrip(std::string_view text) {
  Result<CheckpointIndex> index = ParseCheckpointIndex(text);
  if (!index.ok()) return index;
  for (const auto& [tensor, file] : index->weight_map) {
    Require(IsPlainFileName(file), "index file names are plain");
  }
  Result<std::string> serialized = SerializeCheckpointIndex(*index);
  Require(serialized.ok(), "an accepted index can be serialized");
  Result<CheckpointIndex> again = ParseCheckpointIndex(*serialized);
  Require(again.ok(), "a serialized index parses");
  Require(again->metadata == index->metadata && again->metadata_json == index->metadata_json &&
              again->weight_map == index->weight_map,
          "index survives a round trip");
  return index;
}

}  // namespace deltasync::fuzz_util
