// Helpers shared by the store module's tests: small synthetic models with
// scattered changes, stores and local checkpoints in temp dirs, file surgery.
#pragma once

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/checkpoint.h"
#include "deltasync/store.h"
#include "deltasync/thread_pool.h"
#include "format/format_test_util.h"

namespace deltasync::store_test {

inline Status StatusOf(const Status& s) { return s; }
template <typename T>
Status StatusOf(const Result<T>& r) {
  return r.status();
}

// Asserts that a Status or Result is OK, printing the error otherwise.
#define DS_ASSERT_OK(expr)                                                                 \
  do {                                                                                     \
    const ::deltasync::Status ds_assert_status_ = ::deltasync::store_test::StatusOf(expr); \
    ASSERT_TRUE(ds_assert_status_.ok()) << ds_assert_status_.ToString();                   \
  } while (0)
#define DS_EXPECT_OK(expr)                                                                 \
  do {                                                                                     \
    const ::deltasync::Status ds_expect_status_ = ::deltasync::store_test::StatusOf(expr); \
    EXPECT_TRUE(ds_expect_status_.ok()) << ds_expect_status_.ToString();                   \
  } while (0)

// The format tests' TempDir, ReadFileOrDie and WriteFileOrDie.
class TempDir : public testing_util::TempDir {
 public:
  TempDir() : testing_util::TempDir("ds_store_test") {}
};

inline std::string ReadFile(const std::string& path) { return testing_util::ReadFileOrDie(path); }

inline void WriteFile(const std::string& path, std::string_view bytes) {
  testing_util::WriteFileOrDie(path, bytes);
}

inline void RemoveDir(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

using io_test::ListDir;

// Every file of the local checkpoint but .weight_sync, for before/after
// comparison.
inline std::map<std::string, std::string> LocalFiles(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const std::string& name : ListDir(dir)) {
    if (name == ".weight_sync") continue;
    files[name] = ReadFile(dir + "/" + name);
  }
  return files;
}

// A tensor that owns its bytes.
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

// A small model of mixed dtypes: BF16 matrices (most of the bytes), an F32
// and an F16 tensor, an F64 vector, a U8 tensor and a zero-size one. Values
// look like weights (BF16/F16/F32/F64 around N(0, 0.02)) so XOR deltas have
// realistic low-mantissa structure.
inline Model MakeModel(uint64_t seed, int64_t rows = 48) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  Model m;
  auto add = [&](std::string name, DType dtype, std::vector<int64_t> shape) {
    OwnedTensor t{std::move(name), dtype, std::move(shape), {}};
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    t.data.resize(static_cast<size_t>(numel) * DTypeSize(dtype));
    for (int64_t i = 0; i < numel; ++i) {
      const float f = normal(rng);
      uint8_t* p = t.data.data() + i * DTypeSize(dtype);
      switch (dtype) {
        case DType::kBF16: {
          uint32_t bits;
          std::memcpy(&bits, &f, 4);
          const uint16_t h = static_cast<uint16_t>(bits >> 16);
          std::memcpy(p, &h, 2);
          break;
        }
        case DType::kF16: {
          const uint16_t h = static_cast<uint16_t>(0x2000 + (rng() & 0x0fff));
          std::memcpy(p, &h, 2);
          break;
        }
        case DType::kF32: std::memcpy(p, &f, 4); break;
        case DType::kF64: {
          const double d = f;
          std::memcpy(p, &d, 8);
          break;
        }
        default: *p = static_cast<uint8_t>(rng()); break;
      }
    }
    m.push_back(std::move(t));
  };
  add("model.embed_tokens.weight", DType::kBF16, {rows * 2, 64});
  add("model.layers.0.mlp.up_proj.weight", DType::kBF16, {rows, 96});
  add("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {rows, 64});
  add("model.layers.0.self_attn.q_proj.bias", DType::kF32, {rows});
  add("model.layers.0.input_layernorm.weight", DType::kF16, {64});
  add("model.norm.weight", DType::kF64, {40});
  add("model.quant.scales", DType::kU8, {123});
  add("model.empty", DType::kF32, {0, 8});
  return m;
}

// Changes about `fraction` of each tensor's elements (scattered, at least
// one per non-empty tensor unless fraction is 0) by flipping low bits, as a
// small optimizer step does to BF16 weights.
inline Model Step(const Model& model, uint64_t seed, double fraction = 0.02) {
  std::mt19937_64 rng(seed);
  Model next = model;
  for (OwnedTensor& t : next) {
    const size_t es = DTypeSize(t.dtype);
    const size_t numel = t.data.size() / es;
    if (numel == 0 || fraction <= 0) continue;
    std::bernoulli_distribution pick(fraction);
    bool any = false;
    for (size_t i = 0; i < numel; ++i) {
      if (!pick(rng) && (any || i + 1 < numel)) continue;
      any = true;
      t.data[i * es] ^= static_cast<uint8_t>(1 + (rng() % 7));
    }
  }
  return next;
}

// Writes `model` as an HF checkpoint dir (sharded when max_shard_bytes > 0),
// plus a config.json a loader would want.
inline void WriteModel(const std::string& dir, const Model& model, uint64_t max_shard_bytes = 0) {
  CheckpointWriteOptions options;
  options.max_shard_bytes = max_shard_bytes;
  ASSERT_TRUE(WriteCheckpoint(dir, Views(model), options).ok());
  WriteFile(dir + "/config.json", "{\"model_type\": \"test\"}\n");
}

// The tensors of the checkpoint at `dir`, by name.
inline std::map<std::string, std::vector<uint8_t>> ReadModel(const std::string& dir) {
  std::map<std::string, std::vector<uint8_t>> out;
  Result<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return out;
  for (const auto& [name, view] : (*c)->tensors()) {
    out[name].assign(view.bytes.begin(), view.bytes.end());
  }
  return out;
}

inline std::map<std::string, std::vector<uint8_t>> AsMap(const Model& model) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const OwnedTensor& t : model) out[t.name] = t.data;
  return out;
}

// Asserts that the checkpoint at `dir` holds exactly `model`'s tensors.
inline ::testing::AssertionResult HoldsModel(const std::string& dir, const Model& model) {
  const auto actual = ReadModel(dir);
  const auto expected = AsMap(model);
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << dir << " holds " << actual.size() << " tensors, expected " << expected.size();
  }
  for (const auto& [name, bytes] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) return ::testing::AssertionFailure() << "missing " << name;
    if (it->second != bytes) {
      return ::testing::AssertionFailure() << "tensor " << name << " differs in " << dir;
    }
  }
  return ::testing::AssertionSuccess();
}

// A store, a base checkpoint and a local dir, with a publisher seeded from
// the base, all in one temp dir.
struct Fixture {
  TempDir tmp;
  ThreadPool pool{2};
  std::string store = tmp.Join("store");
  std::string base = tmp.Join("base");
  std::string local = tmp.Join("local");
  Model base_model = MakeModel(1);

  PublisherOptions PublisherOpts(Encoding encoding = Encoding::kSparse,
                                 ChecksumAlgo checksum = ChecksumAlgo::kXxh3_128) {
    PublisherOptions o;
    o.store = store;
    o.encoding = encoding;
    o.checksum = checksum;
    o.pool = &pool;
    return o;
  }
  LocalCheckpointOptions LocalOpts() {
    LocalCheckpointOptions o;
    o.local = local;
    o.store = store;
    o.base = base;
    o.pool = &pool;
    return o;
  }
  std::unique_ptr<Publisher> MakePublisher(const PublisherOptions& options) {
    WriteModel(base, base_model);
    Result<std::unique_ptr<Publisher>> p = Publisher::Create(options, Views(base_model));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? std::move(*p) : nullptr;
  }
  std::unique_ptr<LocalCheckpoint> OpenLocal() {
    Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(LocalOpts());
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return l.ok() ? std::move(*l) : nullptr;
  }
  std::string VersionPath(int64_t v) const { return store + "/" + VersionDirName(v); }
};

// Publishes `count` steps of ~2% changes after `start`, returning every
// model: result[0] = start, result[k] = version first + k - 1.
inline std::vector<Model> PublishSteps(Publisher* publisher, const Model& start, int count,
                                       uint64_t seed = 100, double fraction = 0.02) {
  std::vector<Model> models{start};
  for (int i = 0; i < count; ++i) {
    models.push_back(Step(models.back(), seed + static_cast<uint64_t>(i), fraction));
    Result<PublishResult> r = publisher->Publish(Views(models.back()));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  return models;
}

// Byte offset of tensor `name` inside the safetensors file at `path`.
inline uint64_t TensorOffsetInFile(const std::string& path, const std::string& name) {
  Result<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return 0;
  Result<TensorView> t = (*f)->Get(name);
  EXPECT_TRUE(t.ok());
  return 8 + (*f)->header_size() + static_cast<uint64_t>(t->bytes.data() - (*f)->data().data());
}

// The file (within `dir`) that holds tensor `name`.
inline std::string FileHolding(const std::string& dir, const std::string& name) {
  Result<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return "";
  Result<std::string> f = (*c)->FileOf(name);
  EXPECT_TRUE(f.ok());
  return dir + "/" + *f;
}

inline void FlipByte(const std::string& path, uint64_t offset) {
  std::string bytes = ReadFile(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x5a);
  WriteFile(path, bytes);
}

}  // namespace deltasync::store_test
