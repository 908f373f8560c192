// Both directions of safetensors interoperability with the reference Python
// library, driven by tests/interop/manifest.json:
//  - reference/ holds files the Python library wrote: they must load in our
//    reader with exactly the manifest's dtypes, shapes, bytes and metadata;
//  - ours/ holds files our writer wrote, which the Python library loaded and
//    verified (ours/VERIFIED.txt records that run): our writer must still
//    produce them byte for byte, so that verification stays true.
// DS_REGENERATE_INTEROP=1 rewrites ours/ (then re-run make_reference.py check).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "deltasync/checkpoint.h"

namespace deltasync {
namespace {

namespace fs = std::filesystem;
const std::string kInteropDir = std::string(DS_SOURCE_DIR) + "/tests/interop";

nlohmann::json Manifest() {
  std::ifstream f(kInteropDir + "/manifest.json");
  return nlohmann::json::parse(f);
}

std::vector<uint8_t> ExpectedBytes(const nlohmann::json& spec) {
  DType dtype = *ParseDType(spec["dtype"].get<std::string>());
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : spec["shape"]) n *= static_cast<uint64_t>(d);
  const uint64_t mul = spec["mul"], add = spec["add"];
  std::vector<uint8_t> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint8_t>((i * mul + add) % 256);
    if (dtype == DType::kBool) out[i] %= 2;
  }
  return out;
}

void ExpectTensorMatches(const TensorView& t, const nlohmann::json& spec) {
  SCOPED_TRACE(spec["name"].get<std::string>());
  EXPECT_EQ(DTypeName(t.dtype), spec["dtype"].get<std::string>());
  EXPECT_EQ(t.shape, spec["shape"].get<std::vector<int64_t>>());
  std::vector<uint8_t> want = ExpectedBytes(spec);
  ASSERT_EQ(t.bytes.size(), want.size());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), t.bytes.begin()));
}

std::map<std::string, std::string> MetadataOf(const nlohmann::json& file_spec) {
  std::map<std::string, std::string> md;
  for (auto& [k, v] : file_spec["metadata"].items()) md[k] = v.get<std::string>();
  return md;
}

TEST(InteropTest, ReferenceFilesLoadInOurReader) {
  const nlohmann::json manifest = Manifest();
  for (const auto& fspec : manifest["files"]) {
    const std::string path = kInteropDir + "/reference/" + fspec["file"].get<std::string>();
    Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ((*file)->tensors().size(), fspec["tensors"].size());
    // The Python library writes "__metadata__" only when given some.
    EXPECT_EQ((*file)->metadata(), MetadataOf(fspec)) << path;
    for (const auto& spec : fspec["tensors"]) {
      Result<TensorView> t = (*file)->Get(spec["name"]);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      ExpectTensorMatches(*t, spec);
    }
  }
}

TEST(InteropTest, ReferenceShardedCheckpointLoads) {
  const nlohmann::json manifest = Manifest();
  for (const auto& cspec : manifest["checkpoints"]) {
    const std::string dir = kInteropDir + "/reference/" + cspec["dir"].get<std::string>();
    Result<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    EXPECT_TRUE((*ckpt)->sharded());
    EXPECT_GT((*ckpt)->files().size(), 1u);
    EXPECT_EQ((*ckpt)->tensors().size(), cspec["tensors"].size());
    for (const auto& spec : cspec["tensors"]) {
      Result<TensorView> t = (*ckpt)->Get(spec["name"]);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      ExpectTensorMatches(*t, spec);
    }
  }
}

// Writes ours/ into `root` exactly as the committed copy was made.
void WriteOurs(const std::string& root, std::vector<std::vector<uint8_t>>* storage) {
  const nlohmann::json manifest = Manifest();
  fs::create_directories(root);
  auto views_of = [&](const nlohmann::json& specs) {
    std::vector<TensorView> views;
    for (const auto& spec : specs) {
      storage->push_back(ExpectedBytes(spec));
      views.push_back({spec["name"], *ParseDType(spec["dtype"].get<std::string>()),
                       spec["shape"].get<std::vector<int64_t>>(), storage->back()});
    }
    return views;
  };
  for (const auto& fspec : manifest["files"]) {
    Status s = WriteSafetensors(root + "/" + fspec["file"].get<std::string>(),
                                views_of(fspec["tensors"]), MetadataOf(fspec));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  for (const auto& cspec : manifest["checkpoints"]) {
    CheckpointWriteOptions opts;
    opts.max_shard_bytes = cspec["max_shard_bytes"];
    Status s = WriteCheckpoint(root + "/" + cspec["dir"].get<std::string>(),
                               views_of(cspec["tensors"]), opts);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
}

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(InteropTest, OurWriterStillProducesTheVerifiedFiles) {
  std::vector<std::vector<uint8_t>> storage;
  storage.reserve(64);
  const fs::path committed = kInteropDir + "/ours";
  if (std::getenv("DS_REGENERATE_INTEROP") != nullptr) {
    fs::remove_all(committed / "sharded_ckpt");
    WriteOurs(committed.string(), &storage);
    GTEST_SKIP() << "regenerated " << committed << "; verify it with make_reference.py check";
  }
  const fs::path fresh = fs::path(testing::TempDir()) / "interop_ours";
  fs::remove_all(fresh);
  WriteOurs(fresh.string(), &storage);
  size_t compared = 0;
  for (const auto& entry : fs::recursive_directory_iterator(committed)) {
    if (!entry.is_regular_file() || entry.path().filename() == "VERIFIED.txt") continue;
    const fs::path rel = fs::relative(entry.path(), committed);
    ASSERT_TRUE(fs::exists(fresh / rel)) << rel;
    EXPECT_EQ(Slurp(entry.path()), Slurp(fresh / rel)) << "writer output changed: " << rel;
    ++compared;
  }
  EXPECT_GE(compared, 4u);
  // And every file we write loads back in our reader with the right content.
  const nlohmann::json manifest = Manifest();
  for (const auto& fspec : manifest["files"]) {
    auto file = SafetensorsFile::Open((fresh / fspec["file"].get<std::string>()).string());
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    for (const auto& spec : fspec["tensors"])
      ExpectTensorMatches(*(*file)->Get(spec["name"]), spec);
  }
}

}  // namespace
}  // namespace deltasync
