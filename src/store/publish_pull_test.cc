// Publish / pull round trips, chains, full versions, pruning, hooks.

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "core/fp8_test_util.h"
#include "deltasync/checkpoint.h"
#include "deltasync/codec.h"
#include "deltasync/safetensors.h"
#include "deltasync/store.h"
#include "deltasync/synth.h"
#include "io/file.h"
#include "store/store_internal.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

TEST(VersionNames, FormatAndParse) {
  EXPECT_EQ(VersionDirName(7), "weight_v000007");
  EXPECT_EQ(VersionDirName(1234567), "weight_v1234567");
  EXPECT_EQ(FormatVersion(0), "000000");
  DS_ASSERT_OK(ParseVersion("000042"));
  EXPECT_EQ(*ParseVersion("000042"), 42);
  EXPECT_EQ(*ParseVersion("1234567"), 1234567);
  EXPECT_EQ(*ParseVersionDirName("weight_v000003"), 3);
  for (const char* bad : {"", "42", "00004x", "-00001", "+000001", "0000000000000000001"}) {
    EXPECT_FALSE(ParseVersion(bad).ok()) << bad;
  }
  for (const char* bad : {"weight_v", "weight_v12", "weight_v00001a", ".tmp-weight_v000001-1",
                          "Weight_v000001", "weight_v000001x"}) {
    EXPECT_FALSE(ParseVersionDirName(bad).ok()) << bad;
  }
}

struct Combo {
  Encoding encoding;
  ChecksumAlgo checksum;
};

class RoundTrip : public ::testing::TestWithParam<Combo> {};

// Publishes three versions, checks the files are what the vime receiver
// expects, and pulls them one by one and all at once, bit-exactly.
TEST_P(RoundTrip, PublishAndPullEveryVersion) {
  const Combo combo = GetParam();
  Fixture f;
  PublisherOptions po = f.PublisherOpts(combo.encoding, combo.checksum);
  po.max_shard_bytes = 200;  // several shards
  auto publisher = f.MakePublisher(po);
  ASSERT_NE(publisher, nullptr);
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 3);
  EXPECT_EQ(publisher->latest_version(), 3);

  // The vime/slime layout: index metadata, U8 1-D deltas, per-file checksums.
  for (int64_t v = 1; v <= 3; ++v) {
    Result<VersionInfo> info = ReadVersionInfo(f.VersionPath(v));
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_TRUE(info->is_delta);
    EXPECT_EQ(info->base_version, v - 1);
    EXPECT_EQ(info->encoding, combo.encoding);
    EXPECT_EQ(info->checksum, combo.checksum);
    EXPECT_TRUE(info->has_manifest);
    Result<std::unique_ptr<Checkpoint>> version = Checkpoint::Open(f.VersionPath(v));
    ASSERT_TRUE(version.ok()) << version.status().ToString();
    const auto& md = (*version)->index().metadata;
    EXPECT_EQ(md.at("version"), FormatVersion(v));
    EXPECT_EQ(md.at("base_version"), FormatVersion(v - 1));
    EXPECT_EQ(md.at("delta_encoding"), EncodingName(combo.encoding));
    EXPECT_EQ(md.at("compression_format"), "zstd");
    EXPECT_EQ(md.at("checksum_format"), ChecksumAlgoName(combo.checksum));
    EXPECT_GT((*version)->files().size(), 1u);
    const auto expected = AsMap(models[v]);
    // Every tensor but the empty one changed.
    EXPECT_EQ((*version)->tensors().size(), expected.size() - 1);
    for (const auto& file : (*version)->files()) {
      const std::string name = file->path().substr(file->path().rfind('/') + 1);
      EXPECT_TRUE(
          name.starts_with("model-") &&
          name.ends_with("-of-0000" + std::to_string((*version)->files().size()) + ".safetensors"))
          << name;
      for (const TensorView& t : file->tensors()) {
        EXPECT_EQ(t.dtype, DType::kU8);
        EXPECT_EQ(t.shape.size(), 1u);
        ASSERT_TRUE(file->metadata().count(t.name)) << t.name;
        EXPECT_EQ(file->metadata().at(t.name), ChecksumHex(combo.checksum, expected.at(t.name)));
      }
    }
  }

  // One version at a time.
  auto local = f.OpenLocal();
  ASSERT_NE(local, nullptr);
  EXPECT_FALSE(local->CurrentVersion()->has_value());
  for (int64_t v = 0; v <= 3; ++v) {
    Result<PullResult> r = local->Pull(v);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->version, v);
    EXPECT_TRUE(HoldsModel(f.local, models[v]));
    EXPECT_EQ(**local->CurrentVersion(), v);
    EXPECT_TRUE(local->Verify().ok()) << local->Verify().ToString();
  }
  EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync/journal"));

  // All at once, from nothing, into a second local dir, with every tensor's
  // changes journaled as several records.
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.local = f.tmp.Join("local2");
  lo.journal_record_changes = 7;
  auto local2 = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local2);
  Result<PullResult> r = (*local2)->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->version, 3);
  EXPECT_FALSE(r->from_version.has_value());
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_EQ(r->versions_applied, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(HoldsModel(lo.local, models[3]));
  // The base's other files came along; state.json is what the peer reads.
  EXPECT_EQ(ReadFile(lo.local + "/config.json"), ReadFile(f.base + "/config.json"));
  const std::string state = ReadFile(lo.local + "/.weight_sync/state.json");
  EXPECT_NE(state.find("\"version\": \"000003\""), std::string::npos) << state;
  // Already there: nothing to do.
  Result<PullResult> again = (*local2)->Pull(std::nullopt);
  DS_ASSERT_OK(again);
  EXPECT_FALSE(again->applied);
}

INSTANTIATE_TEST_SUITE_P(EveryEncodingAndChecksum, RoundTrip,
                         ::testing::Values(Combo{Encoding::kSparse, ChecksumAlgo::kXxh3_128},
                                           Combo{Encoding::kSparse, ChecksumAlgo::kBlake3},
                                           Combo{Encoding::kSparse, ChecksumAlgo::kAdler32},
                                           Combo{Encoding::kXor, ChecksumAlgo::kXxh3_128},
                                           Combo{Encoding::kXor, ChecksumAlgo::kBlake3},
                                           Combo{Encoding::kXor, ChecksumAlgo::kAdler32},
                                           Combo{Encoding::kOverwrite, ChecksumAlgo::kXxh3_128},
                                           Combo{Encoding::kOverwrite, ChecksumAlgo::kBlake3},
                                           Combo{Encoding::kOverwrite, ChecksumAlgo::kAdler32}),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           std::string name = std::string(EncodingName(info.param.encoding)) + "_" +
                                              std::string(ChecksumAlgoName(info.param.checksum));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// A block-scaled FP8 checkpoint (two layers of E4M3 weights with E8M0
// block scales and F32 per-tensor scales, beside a BF16 tensor that never
// changes), re-quantized at each step, published and pulled bit-exactly
// with each encoding: one version at a time and all at once.
class Fp8RoundTrip : public ::testing::TestWithParam<Encoding> {};

Model Fp8Model(int step) {
  Model m;
  for (const char* layer : {"model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"}) {
    const uint64_t seed = std::string_view(layer).size() * 7 + 1;
    for (fp8_test::Tensor& t : fp8_test::BlockScaledLayer(layer, seed, step)) {
      m.push_back({std::move(t.name), t.dtype, std::move(t.shape), std::move(t.bytes)});
    }
  }
  m.push_back({"model.norm.weight", DType::kBF16, {64}, std::vector<uint8_t>(128, 0x3F)});
  return m;
}

TEST_P(Fp8RoundTrip, PublishAndPullEveryVersion) {
  const Encoding encoding = GetParam();
  Fixture f;
  f.base_model = Fp8Model(0);
  auto publisher = f.MakePublisher(f.PublisherOpts(encoding));
  ASSERT_NE(publisher, nullptr);
  std::vector<Model> models{f.base_model};
  for (int step = 1; step <= 2; ++step) {
    models.push_back(Fp8Model(step));
    Result<PublishResult> r = publisher->Publish(Views(models.back()));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tensors_changed, 6u);  // every FP8 tensor and scale, not the norm
  }
  Result<std::optional<VersionManifest>> m = ReadVersionManifest(f.VersionPath(1));
  ASSERT_TRUE(m.ok() && m->has_value());
  EXPECT_EQ((*m)->tensors.at("model.layers.0.mlp.down_proj.weight").dtype, DType::kF8_E4M3);
  EXPECT_EQ((*m)->tensors.at("model.layers.0.mlp.down_proj.weight_scale_inv").dtype,
            DType::kF8_E8M0);

  auto local = f.OpenLocal();
  ASSERT_NE(local, nullptr);
  for (int64_t v = 0; v <= 2; ++v) {
    Result<PullResult> r = local->Pull(v);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(HoldsModel(f.local, models[v])) << "version " << v;
  }
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.local = f.tmp.Join("local2");
  auto local2 = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local2);
  Result<PullResult> r = (*local2)->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->version, 2);
  EXPECT_TRUE(HoldsModel(lo.local, models[2]));
  // The pulled checkpoint names the FP8 dtypes as the base did.
  Result<std::unique_ptr<Checkpoint>> pulled = Checkpoint::Open(lo.local);
  DS_ASSERT_OK(pulled);
  for (const OwnedTensor& t : models[2]) {
    EXPECT_EQ((*pulled)->tensors().at(t.name).dtype, t.dtype) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryEncoding, Fp8RoundTrip, ::testing::ValuesIn(AllEncodings()),
                         [](const ::testing::TestParamInfo<Encoding>& info) {
                           return std::string(EncodingName(info.param));
                         });

TEST(Publish, DenseAndIndicesEncodingsRoundTripToo) {
  for (Encoding e : {Encoding::kDense, Encoding::kIndices}) {
    Fixture f;
    auto publisher = f.MakePublisher(f.PublisherOpts(e));
    const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
    EXPECT_EQ(ReadVersionInfo(f.VersionPath(1))->compression, "none");
    auto local = f.OpenLocal();
    Result<PullResult> r = local->Pull(std::nullopt);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(HoldsModel(f.local, models[2]));
  }
}

TEST(Publish, UnchangedTensorsAreAbsentAndAnEmptyDeltaIsAVersion) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  Model next = f.base_model;
  next[1].data[5] ^= 1;  // one element of one tensor
  Result<PublishResult> r = publisher->Publish(Views(next));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tensors_changed, 1u);
  EXPECT_EQ(r->changed_elements, 1u);
  EXPECT_EQ(r->tensors, next.size());
  Result<std::unique_ptr<Checkpoint>> v1 = Checkpoint::Open(f.VersionPath(1));
  DS_ASSERT_OK(v1);
  ASSERT_EQ((*v1)->tensors().size(), 1u);
  EXPECT_EQ((*v1)->tensors().begin()->first, next[1].name);
  // The sidecar names the base checksum, dtype and shape.
  Result<std::optional<VersionManifest>> m = ReadVersionManifest(f.VersionPath(1));
  ASSERT_TRUE(m.ok() && m->has_value());
  const ManifestTensor& t = (*m)->tensors.at(next[1].name);
  EXPECT_EQ(t.base_checksum, ChecksumHex(ChecksumAlgo::kXxh3_128, f.base_model[1].data));
  EXPECT_EQ(t.checksum, ChecksumHex(ChecksumAlgo::kXxh3_128, next[1].data));
  EXPECT_EQ(t.dtype, next[1].dtype);
  EXPECT_EQ(t.shape, next[1].shape);
  EXPECT_EQ(t.changed, 1u);

  Result<PublishResult> empty = publisher->Publish(Views(next));
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(empty->tensors_changed, 0u);
  auto local = f.OpenLocal();
  Result<PullResult> pulled = local->Pull(std::nullopt);
  ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
  EXPECT_EQ(pulled->version, 2);
  EXPECT_TRUE(HoldsModel(f.local, next));
}

// Small shards: a shard holds tensors up to max_shard_bytes of encoded
// bytes (one larger tensor alone), every changed tensor lands in exactly one,
// the temp data files are gone, and the version pulls bit-exactly.
TEST(Publish, ShardsStayWithinMaxShardBytes) {
  for (Encoding encoding : {Encoding::kSparse, Encoding::kOverwrite}) {
    Fixture f;
    PublisherOptions po = f.PublisherOpts();
    po.encoding = encoding;
    po.max_shard_bytes = 600;
    auto publisher = f.MakePublisher(po);
    const Model next = Step(f.base_model, 3);
    Result<PublishResult> r = publisher->Publish(Views(next));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_GT(r->tensors_changed, 2u);
    Result<std::unique_ptr<Checkpoint>> v1 = Checkpoint::Open(f.VersionPath(1));
    DS_ASSERT_OK(v1);
    EXPECT_EQ((*v1)->tensors().size(), r->tensors_changed);
    ASSERT_GT((*v1)->files().size(), 1u);
    for (const auto& file : (*v1)->files()) {
      uint64_t bytes = 0;
      for (const TensorView& t : file->tensors()) bytes += t.bytes.size();
      if (file->tensors().size() > 1) {
        EXPECT_LE(bytes, po.max_shard_bytes) << file->path();
      }
    }
    for (const std::string& name : ListDir(f.VersionPath(1))) EXPECT_NE(name[0], '.') << name;
    auto local = f.OpenLocal();
    DS_ASSERT_OK(local->Pull(std::nullopt));
    EXPECT_TRUE(HoldsModel(f.local, next));
  }
}

TEST(Publish, RefusesWeightsThatDoNotMatchTheSnapshot) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  Model wrong = f.base_model;
  wrong.pop_back();
  EXPECT_TRUE(publisher->Publish(Views(wrong)).status().IsInvalidArgument());
  wrong = f.base_model;
  wrong[0].shape = {wrong[0].shape[1], wrong[0].shape[0]};
  Result<PublishResult> r = publisher->Publish(Views(wrong));
  EXPECT_TRUE(r.status().IsInvalidArgument());
  EXPECT_NE(r.status().message().find(wrong[0].name), std::string::npos);
  wrong = f.base_model;
  wrong.push_back(wrong[0]);
  EXPECT_TRUE(publisher->Publish(Views(wrong)).status().IsInvalidArgument());
  EXPECT_TRUE(ListVersionNumbers(f.store)->empty());
}

TEST(Publish, FromCheckpointDirectories) {
  Fixture f;
  WriteModel(f.base, f.base_model, 3000);
  const Model next = Step(f.base_model, 5);
  WriteModel(f.tmp.Join("next"), next);
  auto publisher = Publisher::CreateFromCheckpoint(f.PublisherOpts(Encoding::kXor), f.base);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  Result<PublishResult> r = (*publisher)->PublishCheckpoint(f.tmp.Join("next"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->info.version, 1);
  EXPECT_GT(r->bytes_written, 0u);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  EXPECT_TRUE(HoldsModel(f.local, next));
  // The local checkpoint keeps the base's sharded layout.
  EXPECT_TRUE(io::PathExists(f.local + "/" + kIndexFileName));
}

TEST(Publish, OneShotFromCheckpointsReadsTheBaseInPlace) {
  Fixture f;
  WriteModel(f.base, f.base_model);
  std::vector<Model> models{f.base_model};
  std::vector<std::string> dirs{f.base};
  for (int v = 1; v <= 3; ++v) {
    models.push_back(Step(models.back(), 60 + v));
    dirs.push_back(f.tmp.Join("step" + std::to_string(v)));
    WriteModel(dirs.back(), models.back());
    Result<PublishResult> r = PublishCheckpointOnce(f.PublisherOpts(Encoding::kXor), dirs[v - 1],
                                                    dirs[v], /*full=*/v == 2);
    DS_ASSERT_OK(r);
    EXPECT_EQ(r->info.version, v);
    EXPECT_EQ(r->info.is_delta, v != 2);
    EXPECT_GT(r->changed_elements, 0u);
    EXPECT_EQ(r->bytes_written, r->info.bytes);
  }
  // The bases were only read.
  EXPECT_TRUE(HoldsModel(f.base, f.base_model));
  EXPECT_TRUE(HoldsModel(dirs[1], models[1]));
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  EXPECT_TRUE(HoldsModel(f.local, models[1]));
  Result<PullResult> r = local->Pull(3);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 2);
  EXPECT_TRUE(HoldsModel(f.local, models[3]));
  // Mismatched checkpoints are refused before anything is written.
  Model other = models[3];
  other.pop_back();
  WriteModel(f.tmp.Join("other"), other);
  EXPECT_TRUE(PublishCheckpointOnce(f.PublisherOpts(), dirs[3], f.tmp.Join("other"))
                  .status()
                  .IsInvalidArgument());
  EXPECT_EQ(ListVersionNumbers(f.store)->size(), 3u);
}

TEST(Publish, FullVersionsResetTheChain) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  // A receiver at version 1.
  auto lagging = f.OpenLocal();
  DS_ASSERT_OK(lagging->Pull(1));

  models.push_back(Step(models.back(), 77));
  Result<PublishResult> full = publisher->Publish(Views(models.back()), /*full=*/true);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_FALSE(full->info.is_delta);
  EXPECT_GT(full->changed_elements, 0u);
  // A full version is a plain HF checkpoint: no delta metadata, format=pt.
  Result<std::unique_ptr<Checkpoint>> v2 = Checkpoint::Open(f.VersionPath(2));
  DS_ASSERT_OK(v2);
  EXPECT_FALSE((*v2)->index().metadata.count("delta_encoding"));
  EXPECT_EQ((*v2)->files()[0]->metadata().at("format"), "pt");
  EXPECT_TRUE(HoldsModel(f.VersionPath(2), models[2]));
  const std::vector<Model> more = PublishSteps(publisher.get(), models.back(), 1, 300);
  models.push_back(more[1]);

  // Fresh receiver: copies version 2, applies 3.
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.local = f.tmp.Join("fresh");
  auto fresh = LocalCheckpoint::Open(lo);
  Result<PullResult> r = (*fresh)->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->reset_to, 2);
  EXPECT_EQ(r->versions_applied, (std::vector<int64_t>{3}));
  EXPECT_TRUE(HoldsModel(lo.local, models[3]));
  DS_EXPECT_OK((*fresh)->Verify());
  EXPECT_FALSE(io::PathExists(lo.local + "/deltasync.json"));

  // The receiver at 1 resets to 2 as well (newer full version), then 3.
  r = lagging->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->from_version, 1);
  EXPECT_EQ(r->reset_to, 2);
  EXPECT_TRUE(HoldsModel(f.local, models[3]));
  // The config the base brought is kept next to the full version's files.
  EXPECT_TRUE(io::PathExists(f.local + "/config.json"));

  // Back in time: reset to the base, replay version 1.
  r = lagging->Pull(1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_TRUE(HoldsModel(f.local, models[1]));
}

TEST(Publish, FullEveryAndPruneKeepTheChainReplayable) {
  Fixture f;
  PublisherOptions po = f.PublisherOpts(Encoding::kXor);
  po.full_every = 3;
  auto publisher = f.MakePublisher(po);
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 7);
  Result<std::vector<VersionInfo>> infos = ListVersions(f.store);
  DS_ASSERT_OK(infos);
  ASSERT_EQ(infos->size(), 7u);
  for (const VersionInfo& info : *infos) {
    EXPECT_EQ(info.is_delta, info.version % 3 != 0) << info.version;
  }
  auto lagging = f.OpenLocal();
  DS_ASSERT_OK(lagging->Pull(2));

  // Keep 2: 6 (full) and 7 remain; nothing before the newest full is needed.
  Result<std::vector<int64_t>> removed = PruneStore(f.store, 2);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(*ListVersionNumbers(f.store), (std::vector<int64_t>{6, 7}));
  // Keeping fewer than the newest full version needs is not possible.
  removed = PruneStore(f.store, 1);
  DS_ASSERT_OK(removed);
  EXPECT_TRUE(removed->empty());
  EXPECT_TRUE(PruneStore(f.store, 0).status().IsInvalidArgument());

  // Both a fresh and a lagging receiver still reach the latest.
  Result<PullResult> r = lagging->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->reset_to, 6);
  EXPECT_TRUE(HoldsModel(f.local, models[7]));
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.local = f.tmp.Join("fresh");
  auto fresh = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK((*fresh)->Pull(std::nullopt));
  EXPECT_TRUE(HoldsModel(lo.local, models[7]));
}

TEST(Prune, WithoutAFullVersionNothingIsDeleted) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 4);
  // Debris: a stale temp dir of version 2 and of a future version 9.
  ASSERT_EQ(::mkdir((f.store + "/.tmp-weight_v000002-1-0").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((f.store + "/.tmp-weight_v000009-1-0").c_str(), 0755), 0);
  Result<std::vector<int64_t>> removed = PruneStore(f.store, 1);
  DS_ASSERT_OK(removed);
  EXPECT_TRUE(removed->empty());
  EXPECT_EQ(ListVersionNumbers(f.store)->size(), 4u);
  EXPECT_FALSE(io::PathExists(f.store + "/.tmp-weight_v000002-1-0"));
  EXPECT_TRUE(io::PathExists(f.store + "/.tmp-weight_v000009-1-0"));
}

TEST(Pull, TargetZeroMaterializesTheBase) {
  Fixture f;
  WriteModel(f.base, f.base_model, 2500);
  LocalCheckpointOptions lo = f.LocalOpts();
  std::filesystem::create_directories(lo.store);
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  Result<PullResult> r = (*local)->Pull(std::nullopt);  // empty store: latest = 0
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->version, 0);
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_GT(r->bytes_read, 0u);
  EXPECT_TRUE(HoldsModel(f.local, f.base_model));
  EXPECT_EQ(ListDir(f.local).size(), ListDir(f.base).size() + 1);  // + .weight_sync
  DS_EXPECT_OK((*local)->Verify());
  EXPECT_EQ(**(*local)->CurrentVersion(), 0);
  // A missing version is NotFound.
  Result<PullResult> missing = (*local)->Pull(4);
  EXPECT_TRUE(missing.status().IsNotFound()) << missing.status().ToString();
}

TEST(Pull, LaggingReceiverCatchesUpThroughTheChain) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  const std::vector<Model> more = PublishSteps(publisher.get(), models[1], 4, 500);
  Result<PullResult> r = local->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->from_version, 1);
  EXPECT_FALSE(r->reset_to.has_value());
  EXPECT_EQ(r->versions_applied, (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_GT(r->changed_elements, 0u);
  EXPECT_TRUE(HoldsModel(f.local, more[4]));
}

TEST(Pull, StateWrittenByThePythonReceiverIsUnderstood) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  // The peer rewrites state.json with only the version.
  WriteFile(f.local + "/.weight_sync/state.json", "{\"version\": \"000001\"}");
  EXPECT_EQ(**local->CurrentVersion(), 1);
  DS_ASSERT_OK(local->Pull(2));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
  // A state file nobody can parse is no version: the checkpoint is reseeded.
  WriteFile(f.local + "/.weight_sync/state.json", "{\"version\": ");
  Result<PullResult> r = local->Pull(2);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

TEST(Pull, VersionsWrittenByThePythonPublisherAreApplied) {
  // No sidecars, and a full version that is a single model.safetensors with
  // no index, as vime's full-mode sync writes it.
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  RemoveDir(f.base);
  WriteModel(f.base, f.base_model, 3000);  // a sharded base
  std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  models.push_back(Step(models.back(), 31));
  WriteModel(f.VersionPath(3), models.back());
  for (int64_t v = 1; v <= 2; ++v) {
    ASSERT_EQ(::unlink((f.VersionPath(v) + "/deltasync.json").c_str()), 0);
  }
  Result<VersionInfo> full = ReadVersionInfo(f.VersionPath(3));
  DS_ASSERT_OK(full);
  EXPECT_FALSE(full->is_delta);
  EXPECT_FALSE(full->has_manifest);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(2));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
  const std::vector<std::string> sharded = ListDir(f.local);
  EXPECT_GT(std::count_if(sharded.begin(), sharded.end(),
                          [](const std::string& n) { return n.starts_with("model-00001-of-"); }),
            0);
  DS_EXPECT_OK(local->Verify());
  Result<PullResult> r = local->Pull(3);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 3);
  EXPECT_TRUE(HoldsModel(f.local, models[3]));
  // The reset replaced the sharded layout: no stale index or shard remains.
  EXPECT_EQ(ListDir(f.local),
            (std::vector<std::string>{".weight_sync", "config.json", "model.safetensors"}));
  DS_EXPECT_OK(local->Verify());
}

TEST(Pull, ConcurrentPullsOnOneHostAreSerializedByTheLock) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 3);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&] {
      ThreadPool pool(1);
      LocalCheckpointOptions lo = f.LocalOpts();
      lo.pool = &pool;
      auto local = LocalCheckpoint::Open(lo);
      if (!local.ok() || !(*local)->Pull(std::nullopt).ok()) failures++;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(HoldsModel(f.local, models[3]));
  auto local = f.OpenLocal();
  DS_EXPECT_OK(local->Verify());
}

TEST(Hooks, PostWriteHookFailureLeavesNothingPublishedAndTheSnapshotIntact) {
  Fixture f;
  const std::string log = f.tmp.Join("hook.log");
  const std::string ok_hook = f.tmp.Join("ok.sh");
  const std::string bad_hook = f.tmp.Join("bad.sh");
  WriteFile(ok_hook, "#!/bin/sh\necho \"$@\" >> " + log + "\ntest -f \"$1/deltasync.json\"\n");
  WriteFile(bad_hook, "#!/bin/sh\nexit 3\n");
  ::chmod(ok_hook.c_str(), 0755);
  ::chmod(bad_hook.c_str(), 0755);
  // Undo log or refresh later; streamed encodings (sparse, xor) and one
  // encoded from the whole change list (overwrite).
  for (uint64_t budget : {uint64_t{1} << 30, uint64_t{0}}) {
    for (Encoding encoding : {Encoding::kSparse, Encoding::kXor, Encoding::kOverwrite}) {
      Fixture g;
      PublisherOptions po = g.PublisherOpts();
      po.post_write_hook = bad_hook;
      po.undo_budget_bytes = budget;
      po.encoding = encoding;
      auto publisher = g.MakePublisher(po);
      const Model next = Step(g.base_model, 9);
      Result<PublishResult> r = publisher->Publish(Views(next));
      EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
      EXPECT_NE(r.status().message().find("exited with status 3"), std::string::npos);
      EXPECT_EQ(ListDir(g.store), std::vector<std::string>{});  // no version, no temp dir
      EXPECT_EQ(publisher->latest_version(), 0);
      for (const TensorView& t : publisher->snapshot()) {
        const auto expected = AsMap(g.base_model).at(t.name);
        EXPECT_TRUE(std::equal(t.bytes.begin(), t.bytes.end(), expected.begin(), expected.end()))
            << t.name << " budget " << budget << " " << EncodingName(encoding);
      }
    }
  }
  // With a hook that succeeds (and sees a complete version), publishes work.
  PublisherOptions po = f.PublisherOpts();
  po.post_write_hook = ok_hook;
  po.undo_budget_bytes = 0;
  auto publisher = f.MakePublisher(po);
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  const std::string logged = ReadFile(log);
  EXPECT_NE(logged.find("/.tmp-weight_v000001-"), std::string::npos) << logged;
  EXPECT_NE(logged.find(f.VersionPath(1) + " 000001"), std::string::npos) << logged;
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(std::nullopt));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

TEST(Hooks, PreReadHookRunsBeforeThePullAndCanFailIt) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 1);
  const std::string log = f.tmp.Join("pre.log");
  const std::string hook = f.tmp.Join("pre.sh");
  WriteFile(hook, "#!/bin/sh\necho \"$@\" >> " + log + "\n[ \"$2\" != 000009 ]\n");
  ::chmod(hook.c_str(), 0755);
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.pre_read_hook = hook;
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK((*local)->Pull(std::nullopt));
  Result<PullResult> r = (*local)->Pull(9);
  EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
  EXPECT_EQ(ReadFile(log), f.store + " latest\n" + f.store + " 000009\n");
  lo.pre_read_hook = f.tmp.Join("missing-hook");
  local = LocalCheckpoint::Open(lo);
  EXPECT_FALSE((*local)->Pull(1).ok());
}

TEST(Publish, RefusesToOverwriteAVersionThatAppearsMeanwhile) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  static std::string target;
  target = f.VersionPath(1);
  store_internal::SetCrashHookForTesting([](std::string_view point) {
    if (point == "publish:before-rename") {
      ::mkdir(target.c_str(), 0755);
      std::ofstream(target + "/other").put('x');
    }
  });
  Result<PublishResult> r = publisher->Publish(Views(Step(f.base_model, 3)));
  store_internal::SetCrashHookForTesting(nullptr);
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists) << r.status().ToString();
  EXPECT_EQ(ListDir(target), std::vector<std::string>{"other"});
  EXPECT_EQ(publisher->latest_version(), 0);
  // Someone else's version now exists: this publisher must not continue.
  r = publisher->Publish(Views(Step(f.base_model, 3)));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
}

TEST(Verify, DetectsACorruptedLocalTensor) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 1);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  DS_ASSERT_OK(local->Verify());
  // A tensor the delta changed: checked by its recorded checksum.
  const std::string file = FileHolding(f.local, "model.layers.0.mlp.up_proj.weight");
  const uint64_t at = TensorOffsetInFile(file, "model.layers.0.mlp.up_proj.weight");
  FlipByte(file, at + 3);
  Status s = local->Verify();
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_NE(s.message().find("up_proj"), std::string::npos);
  FlipByte(file, at + 3);
  DS_ASSERT_OK(local->Verify());
  // A tensor copied from the base: checked against the store's record of
  // the base (version 1's base checksums).
  DS_ASSERT_OK(local->Pull(0));
  const std::string f0 = FileHolding(f.local, "model.norm.weight");
  FlipByte(f0, TensorOffsetInFile(f0, "model.norm.weight"));
  s = local->Verify();
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_NE(s.message().find("model.norm.weight"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("(state.json)"), std::string::npos) << s.ToString();
  // Without that record (no sidecar): compared with the base byte for byte.
  std::filesystem::remove(f.VersionPath(1) + "/" + kVersionManifestFileName);
  RemoveDir(f.local);
  local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(0));
  FlipByte(f0, TensorOffsetInFile(f0, "model.norm.weight"));
  s = local->Verify();
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_NE(s.message().find("copied from"), std::string::npos) << s.ToString();
}

TEST(Synth, RealisticChainWithTheSparseEncoding) {
  SynthConfig config;
  config.preset = "tiny";
  config.scale = 0.5;
  config.num_threads = 2;
  config.lr = 2e-6;
  auto trainer = SynthTrainer::Create(config);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  TempDir tmp;
  ThreadPool pool(2);
  const std::string base = tmp.Join("base");
  CheckpointWriteOptions wo;
  wo.max_shard_bytes = 1 << 20;
  DS_ASSERT_OK(WriteCheckpoint(base, (*trainer)->Weights(), wo));
  PublisherOptions po;
  po.store = tmp.Join("store");
  po.pool = &pool;
  auto publisher = Publisher::Create(po, (*trainer)->Weights());
  DS_ASSERT_OK(publisher);
  uint64_t dense_bytes = 0;
  for (const TensorView& t : (*trainer)->Weights()) dense_bytes += t.nbytes();
  for (int step = 1; step <= 3; ++step) {
    (*trainer)->Step();
    Result<PublishResult> r = (*publisher)->Publish((*trainer)->Weights());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const double fraction = static_cast<double>(r->changed_elements) / r->total_elements;
    EXPECT_GT(fraction, 0.001);
    EXPECT_LT(fraction, 0.2);
    // Deltas are a small fraction of the model.
    EXPECT_LT(r->bytes_written, dense_bytes / 5);
  }
  LocalCheckpointOptions lo;
  lo.local = tmp.Join("local");
  lo.store = po.store;
  lo.base = base;
  lo.pool = &pool;
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  Result<PullResult> r = (*local)->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->version, 3);
  const auto actual = ReadModel(lo.local);
  for (const TensorView& t : (*trainer)->Weights()) {
    ASSERT_TRUE(actual.count(t.name));
    EXPECT_TRUE(std::equal(t.bytes.begin(), t.bytes.end(), actual.at(t.name).begin(),
                           actual.at(t.name).end()))
        << t.name;
  }
}

}  // namespace
}  // namespace deltasync::store_test
