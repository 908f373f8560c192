// Bad input: every case gets a clear error, leaves the local checkpoint
// byte-identical and does not advance its state.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "deltasync/checkpoint.h"
#include "deltasync/codec.h"
#include "deltasync/safetensors.h"
#include "deltasync/store.h"
#include "io/file.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

using nlohmann::json;

// A store with versions 1 and 2 and a local checkpoint at version 1, pulled
// durably (the whole version journaled before the checkpoint is touched) or
// not (each record applied as it is journaled, rolled back on failure).
struct BadInputCase {
  Encoding encoding;
  bool durable;
};

class BadInput : public ::testing::TestWithParam<BadInputCase> {
 protected:
  void SetUp() override {
    publisher_ = f_.MakePublisher(f_.PublisherOpts(GetParam().encoding));
    ASSERT_NE(publisher_, nullptr);
    models_ = PublishSteps(publisher_.get(), f_.base_model, 2);
    LocalCheckpointOptions lo = f_.LocalOpts();
    lo.durable = GetParam().durable;
    Result<std::unique_ptr<LocalCheckpoint>> opened = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(opened);
    local_ = std::move(*opened);
    DS_ASSERT_OK(local_->Pull(1));
    before_ = LocalFiles(f_.local);
  }

  // Pulls version `target` expecting `code` and `needle` in the message,
  // then checks that nothing changed.
  void ExpectRefused(StatusCode code, std::string_view needle, int64_t target = 2) {
    Result<PullResult> r = local_->Pull(target);
    ASSERT_FALSE(r.ok()) << "pull succeeded";
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().ToString();
    ExpectUntouched();
  }
  void ExpectUntouched() {
    EXPECT_TRUE(LocalFiles(f_.local) == before_) << "local checkpoint changed";
    Result<std::optional<int64_t>> v = local_->CurrentVersion();
    DS_ASSERT_OK(v);
    EXPECT_EQ(*v, std::optional<int64_t>(1));
    EXPECT_FALSE(io::PathExists(f_.local + "/.weight_sync/journal"));
    EXPECT_TRUE(HoldsModel(f_.local, models_[1]));
  }

  std::string V2() const { return f_.VersionPath(2); }
  std::string IndexPath() const { return V2() + "/" + kIndexFileName; }
  json ReadIndex() const { return json::parse(ReadFile(IndexPath())); }
  void WriteIndex(const json& index) { WriteFile(IndexPath(), index.dump(2)); }
  void SetMetadata(const std::string& key, const std::string& value) {
    json index = ReadIndex();
    index["metadata"][key] = value;
    WriteIndex(index);
  }
  // Rewrites the shard holding `tensor` with its __metadata__ changed.
  void RewriteShardMetadata(const std::string& tensor,
                            const std::function<void(std::map<std::string, std::string>*)>& edit) {
    const std::string path = FileHolding(V2(), tensor);
    std::vector<OwnedTensor> copies;
    std::map<std::string, std::string> metadata;
    {
      auto file = SafetensorsFile::Open(path);
      DS_ASSERT_OK(file);
      metadata = (*file)->metadata();
      for (const TensorView& t : (*file)->tensors()) {
        copies.push_back({t.name, t.dtype, t.shape, {t.bytes.begin(), t.bytes.end()}});
      }
    }
    edit(&metadata);
    std::vector<TensorView> views;
    for (const OwnedTensor& t : copies) views.push_back(t.view());
    DS_ASSERT_OK(WriteSafetensors(path, views, metadata));
  }

  Fixture f_;
  std::unique_ptr<Publisher> publisher_;
  std::vector<Model> models_;
  std::unique_ptr<LocalCheckpoint> local_;
  std::map<std::string, std::string> before_;
};

constexpr const char* kBig = "model.embed_tokens.weight";

TEST_P(BadInput, CorruptedZstdFrame) {
  const std::string path = FileHolding(V2(), kBig);
  auto file = SafetensorsFile::Open(path);
  DS_ASSERT_OK(file);
  const uint64_t size = (*file)->Get(kBig)->bytes.size();
  file->reset();
  FlipByte(path, TensorOffsetInFile(path, kBig) + size / 2);
  ExpectRefused(StatusCode::kCorruption, kBig);
}

TEST_P(BadInput, TruncatedFile) {
  const std::string path = FileHolding(V2(), kBig);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(ReadFile(path).size() - 10)), 0);
  ExpectRefused(StatusCode::kCorruption, "truncated");
}

TEST_P(BadInput, ChecksumMismatchIsRolledBack) {
  ASSERT_EQ(::unlink((V2() + "/deltasync.json").c_str()), 0);  // the peer writes none
  RewriteShardMetadata(kBig, [](std::map<std::string, std::string>* md) {
    std::string& hex = (*md)[kBig];
    hex[0] = hex[0] == '0' ? '1' : '0';
  });
  ExpectRefused(StatusCode::kCorruption, "checksum mismatch after apply");
}

TEST_P(BadInput, MissingOrMalformedChecksum) {
  RewriteShardMetadata(kBig, [](std::map<std::string, std::string>* md) { md->erase(kBig); });
  ExpectRefused(StatusCode::kCorruption, "records no checksum");
  RewriteShardMetadata(kBig, [](std::map<std::string, std::string>* md) { (*md)[kBig] = "xyz"; });
  ExpectRefused(StatusCode::kCorruption, "digest");
}

TEST_P(BadInput, SidecarThatDisagreesWithTheShards) {
  const std::string path = V2() + "/deltasync.json";
  const std::string original = ReadFile(path);
  json manifest = json::parse(original);
  std::string sum = manifest["tensors"][kBig]["checksum"];
  sum[0] = sum[0] == '0' ? '1' : '0';
  manifest["tensors"][kBig]["checksum"] = sum;
  WriteFile(path, manifest.dump());
  ExpectRefused(StatusCode::kCorruption, "disagree");
  manifest = json::parse(original);
  manifest["tensors"][kBig]["shape"] = {1, 2, 3};
  WriteFile(path, manifest.dump());
  ExpectRefused(StatusCode::kFailedPrecondition, "locally");
  WriteFile(path, "{\"format\": 7}");
  ExpectRefused(StatusCode::kCorruption, "deltasync.json");
}

TEST_P(BadInput, WrongBaseFromAnotherHistoryIsRefusedBeforeTouching) {
  // Another publisher, same base, different version 1: its version 2 does
  // not continue this checkpoint.
  Fixture other;
  auto publisher = other.MakePublisher(other.PublisherOpts(GetParam().encoding));
  PublishSteps(publisher.get(), other.base_model, 2, /*seed=*/900);
  LocalCheckpointOptions lo = f_.LocalOpts();
  lo.durable = GetParam().durable;
  lo.store = other.store;
  auto switched = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(switched);
  Result<PullResult> r = (*switched)->Pull(2);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("wrong base"), std::string::npos) << r.status().ToString();
  ExpectUntouched();
}

TEST_P(BadInput, WrongBaseFromATamperedLocalTensorIsRolledBack) {
  const std::string path = FileHolding(f_.local, kBig);
  FlipByte(path, TensorOffsetInFile(path, kBig) + 1);
  before_ = LocalFiles(f_.local);
  Result<PullResult> r = local_->Pull(2);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("not this version's base"), std::string::npos)
      << r.status().ToString();
  EXPECT_TRUE(LocalFiles(f_.local) == before_);
  EXPECT_EQ(**local_->CurrentVersion(), 1);
}

TEST_P(BadInput, OutOfOrderAndMissingVersions) {
  ASSERT_EQ(::unlink((V2() + "/deltasync.json").c_str()), 0);
  SetMetadata("base_version", "000000");
  ExpectRefused(StatusCode::kFailedPrecondition, "out-of-order");
  SetMetadata("base_version", "000001");
  SetMetadata("version", "000003");
  ExpectRefused(StatusCode::kCorruption, "weight_v000002");
  // Version 3 exists but 2 does not.
  ASSERT_EQ(::rename(V2().c_str(), (f_.store + "/weight_v000003").c_str()), 0);
  ExpectRefused(StatusCode::kNotFound, "version 000002 is missing", 3);
  ExpectRefused(StatusCode::kNotFound, "missing", 2);
}

TEST_P(BadInput, UnknownEncodingCompressionOrChecksum) {
  SetMetadata("delta_encoding", "lz4-xor");
  ExpectRefused(StatusCode::kUnsupported, "lz4-xor");
  SetMetadata("delta_encoding", std::string(EncodingName(GetParam().encoding)));
  SetMetadata("compression_format", "lz4");
  ExpectRefused(StatusCode::kUnsupported, "compression_format");
  SetMetadata("compression_format", "zstd");
  SetMetadata("checksum_format", "md5");
  ExpectRefused(StatusCode::kUnsupported, "md5");
}

TEST_P(BadInput, MalformedIndex) {
  const std::string good = ReadFile(IndexPath());
  WriteFile(IndexPath(), "{\"metadata\": {\"version\": \"000002\"");
  ExpectRefused(StatusCode::kCorruption, kIndexFileName);
  for (const char* hostile : {"../model-00001-of-00001.safetensors", "sub/x.safetensors", ".."}) {
    json index = json::parse(good);
    index["weight_map"][kBig] = hostile;
    WriteIndex(index);
    ExpectRefused(StatusCode::kCorruption, "not a plain file name");
  }
  json index = json::parse(good);
  index["metadata"].erase("base_version");
  WriteIndex(index);
  ExpectRefused(StatusCode::kCorruption, "base_version");
}

TEST_P(BadInput, TensorMissingFromTheLocalCheckpoint) {
  // The publisher knows a tensor the engine's base lacks.
  Fixture g;
  Model with_extra = g.base_model;
  with_extra.push_back({"extra.weight", DType::kBF16, {16}, std::vector<uint8_t>(32, 1)});
  WriteModel(g.base, g.base_model);
  auto publisher = Publisher::Create(g.PublisherOpts(GetParam().encoding), Views(with_extra));
  DS_ASSERT_OK(publisher);
  PublishSteps(publisher->get(), with_extra, 1);
  auto local = g.OpenLocal();
  // Version 1's sidecar records the base it was made against: this base is
  // refused before it is copied.
  Result<PullResult> r = local->Pull(1);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("extra.weight"), std::string::npos);
  EXPECT_FALSE(local->CurrentVersion()->has_value());
  // Without the sidecar, the apply finds the tensor missing.
  std::filesystem::remove(g.VersionPath(1) + "/" + kVersionManifestFileName);
  r = local->Pull(1);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("extra.weight"), std::string::npos);
  EXPECT_NE(r.status().message().find("does not have"), std::string::npos);
  // The base was materialized and stays: version 0, untouched.
  EXPECT_EQ(**local->CurrentVersion(), 0);
  EXPECT_TRUE(HoldsModel(g.local, g.base_model));
}

std::vector<BadInputCase> BadInputCases() {
  std::vector<BadInputCase> cases;
  for (bool durable : {false, true}) {
    for (Encoding e : {Encoding::kSparse, Encoding::kXor, Encoding::kOverwrite}) {
      cases.push_back({e, durable});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Encodings, BadInput, ::testing::ValuesIn(BadInputCases()),
                         [](const ::testing::TestParamInfo<BadInputCase>& info) {
                           return std::string(EncodingName(info.param.encoding)) +
                                  (info.param.durable ? "_durable" : "");
                         });

// Hand-made version 2 holding one tensor's encoded bytes.
void WriteHandVersion(const std::string& dir, Encoding encoding, const std::string& name,
                      DType dtype, std::vector<int64_t> shape, const std::vector<uint8_t>& bytes) {
  std::filesystem::create_directories(dir);
  const std::string shard = "model-00001-of-00001.safetensors";
  TensorView view{name, dtype, std::move(shape), bytes};
  DS_ASSERT_OK(WriteSafetensors(dir + "/" + shard, {view}, {{name, std::string(32, '0')}}));
  CheckpointIndex index;
  index.metadata = {{"version", "000002"},
                    {"base_version", "000001"},
                    {"delta_encoding", std::string(EncodingName(encoding))},
                    {"compression_format", "zstd"},
                    {"checksum_format", "xxh3-128"}};
  index.weight_map[name] = shard;
  WriteFile(dir + "/" + kIndexFileName, *SerializeCheckpointIndex(index));
}

// Encodes a change of one element at `position` for a tensor of `numel`
// elements of `elem_size` bytes.
std::vector<uint8_t> EncodeOne(Encoding encoding, uint64_t numel, uint32_t elem_size,
                               uint64_t position) {
  ChangeSet changes;
  changes.numel = numel;
  changes.elem_size = elem_size;
  changes.pos32 = {static_cast<uint32_t>(position)};
  changes.new_values.assign(elem_size, 0x11);
  changes.old_values.assign(elem_size, 0x22);
  std::vector<uint8_t> new_bytes(numel * elem_size);
  std::vector<uint8_t> out;
  DS_EXPECT_OK(Encode(encoding, new_bytes, changes, {}, &out));
  return out;
}

class HandMade : public BadInput {};

TEST_P(HandMade, FramesThatDoNotFitTheTensor) {
  const OwnedTensor& big = models_[1][0];
  ASSERT_EQ(big.name, kBig);
  const uint64_t numel = big.data.size() / 2;
  // An xor frame for a longer tensor.
  {
    const std::vector<uint8_t> frame = EncodeOne(Encoding::kXor, numel + 8, 2, 1);
    RemoveDir(V2());
    WriteHandVersion(V2(), Encoding::kXor, kBig, DType::kU8, {static_cast<int64_t>(frame.size())},
                     frame);
    ExpectRefused(StatusCode::kCorruption, kBig);
  }
  // An overwrite frame whose byte position is past the tensor.
  {
    const std::vector<uint8_t> frame = EncodeOne(Encoding::kOverwrite, numel * 2, 2, numel + 5);
    RemoveDir(V2());
    WriteHandVersion(V2(), Encoding::kOverwrite, kBig, DType::kU8,
                     {static_cast<int64_t>(frame.size())}, frame);
    ExpectRefused(StatusCode::kCorruption, kBig);
  }
  // A sparse delta for a tensor of another size.
  {
    const std::vector<uint8_t> frame = EncodeOne(Encoding::kSparse, numel + 1, 2, numel);
    RemoveDir(V2());
    WriteHandVersion(V2(), Encoding::kSparse, kBig, DType::kU8,
                     {static_cast<int64_t>(frame.size())}, frame);
    ExpectRefused(StatusCode::kCorruption, kBig);
  }
  // A delta tensor that is not 1-D U8.
  {
    const std::vector<uint8_t> frame = EncodeOne(Encoding::kXor, numel, 2, 1);
    std::vector<uint8_t> padded = frame;
    padded.resize(frame.size() + frame.size() % 2);
    RemoveDir(V2());
    WriteHandVersion(V2(), Encoding::kXor, kBig, DType::kBF16,
                     {static_cast<int64_t>(padded.size() / 2)}, padded);
    ExpectRefused(StatusCode::kCorruption, "not a 1-D U8 delta");
  }
}

INSTANTIATE_TEST_SUITE_P(Xor, HandMade,
                         ::testing::Values(BadInputCase{Encoding::kXor, false},
                                           BadInputCase{Encoding::kXor, true}),
                         [](const ::testing::TestParamInfo<BadInputCase>& info) {
                           return info.param.durable ? "xor_durable" : "xor";
                         });

}  // namespace
}  // namespace deltasync::store_test
