// A local checkpoint whose state.json was last written by the Python
// receiver, which records only {"version": "NNNNNN"}: Verify rebuilds what
// each tensor must hold from the store's chain, and Pull continues from it.

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>
#include <string>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/store.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

using nlohmann::json;

const std::string kEmbed = "model.embed_tokens.weight";
const std::string kUp = "model.layers.0.mlp.up_proj.weight";
const std::string kQuery = "model.layers.0.self_attn.q_proj.weight";
const std::string kBias = "model.layers.0.self_attn.q_proj.bias";
const std::string kNorm = "model.norm.weight";  // never changed below

// `model` with ~2% of the elements of only the tensors in `names` changed.
Model ChangeOnly(const Model& model, const std::set<std::string>& names, uint64_t seed) {
  Model next = Step(model, seed);
  for (size_t i = 0; i < next.size(); ++i) {
    if (!names.count(next[i].name)) next[i].data = model[i].data;
  }
  return next;
}

// Publishes `next` against `prev` as the store's next version.
void PublishAs(Fixture& f, const Model& prev, const Model& next, Encoding encoding,
               ChecksumAlgo checksum, bool full = false) {
  Result<PublishResult> r =
      PublishOnce(f.PublisherOpts(encoding, checksum), Views(prev), Views(next), full);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
}

std::string StatePath(const Fixture& f) { return f.local + "/.weight_sync/state.json"; }

// What the Python receiver writes after committing `version`.
void WriteForeignState(const Fixture& f, int64_t version) {
  WriteFile(StatePath(f), "{\"version\": \"" + FormatVersion(version) + "\"}");
}

void FlipTensorByte(const std::string& dir, const std::string& name) {
  const std::string file = FileHolding(dir, name);
  FlipByte(file, TensorOffsetInFile(file, name) + 1);
}

std::unique_ptr<LocalCheckpoint> OpenWith(const LocalCheckpointOptions& options) {
  Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(options);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  return l.ok() ? std::move(*l) : nullptr;
}

::testing::AssertionResult CorruptionMentions(const Status& s,
                                              std::initializer_list<std::string> words) {
  if (!s.IsCorruption()) return ::testing::AssertionFailure() << "not Corruption: " << s.ToString();
  for (const std::string& w : words) {
    if (s.message().find(w) == std::string::npos) {
      return ::testing::AssertionFailure() << "'" << w << "' not in: " << s.ToString();
    }
  }
  return ::testing::AssertionSuccess();
}

// Versions 1-3 as deltas in three encodings and three checksum formats;
// model.norm.weight (and others) never change after the base.
std::vector<Model> PublishDeltaChain(Fixture& f) {
  WriteModel(f.base, f.base_model);
  std::vector<Model> m{f.base_model};
  m.push_back(ChangeOnly(m[0], {kEmbed, kUp, kQuery, kBias}, 11));
  PublishAs(f, m[0], m[1], Encoding::kSparse, ChecksumAlgo::kXxh3_128);
  m.push_back(ChangeOnly(m[1], {kUp, kQuery}, 12));
  PublishAs(f, m[1], m[2], Encoding::kXor, ChecksumAlgo::kBlake3);
  m.push_back(ChangeOnly(m[2], {kUp}, 13));
  PublishAs(f, m[2], m[3], Encoding::kOverwrite, ChecksumAlgo::kAdler32);
  return m;
}

TEST(ForeignState, VerifyRebuildsTheExpectedStateFromTheDeltaChain) {
  Fixture f;
  const std::vector<Model> models = PublishDeltaChain(f);
  auto local = f.OpenLocal();
  ASSERT_NE(local, nullptr);
  DS_ASSERT_OK(local->Pull(3));
  WriteForeignState(f, 3);
  DS_ASSERT_OK(local->Verify());
  const std::string state_before = ReadFile(StatePath(f));

  // A tensor version 2 changed and version 3 did not: its digest comes from
  // version 2, in version 2's checksum format.
  FlipTensorByte(f.local, kQuery);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kQuery, "version 000002", "blake3"}));
  FlipTensorByte(f.local, kQuery);
  DS_ASSERT_OK(local->Verify());
  FlipTensorByte(f.local, kEmbed);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kEmbed, "version 000001", "xxh3-128"}));
  FlipTensorByte(f.local, kEmbed);
  FlipTensorByte(f.local, kUp);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kUp, "version 000003", "adler32"}));
  FlipTensorByte(f.local, kUp);
  // Unchanged since the base: compared with the base byte for byte.
  FlipTensorByte(f.local, kNorm);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kNorm, "base checkpoint", f.base}));
  // Two damaged tensors: the first by name is reported, the other counted.
  FlipTensorByte(f.local, kQuery);
  Status two = local->Verify();
  EXPECT_TRUE(CorruptionMentions(two, {kQuery, "and 1 more"}));
  FlipTensorByte(f.local, kQuery);
  FlipTensorByte(f.local, kNorm);
  DS_ASSERT_OK(local->Verify());
  // Verify only reads.
  EXPECT_EQ(ReadFile(StatePath(f)), state_before);
  EXPECT_TRUE(HoldsModel(f.local, models[3]));

  // The base is needed (for the tensors no version changed) but not given:
  // the one our last pull was given is used...
  LocalCheckpointOptions no_base = f.LocalOpts();
  no_base.base.clear();
  DS_ASSERT_OK(OpenWith(no_base)->Verify());
  FlipTensorByte(f.local, kNorm);
  EXPECT_TRUE(CorruptionMentions(OpenWith(no_base)->Verify(), {kNorm, "base checkpoint"}));
  FlipTensorByte(f.local, kNorm);
  // ...and without that record, nothing can stand in for it.
  ASSERT_TRUE(std::filesystem::remove(f.local + "/.weight_sync/deltasync-base.json"));
  Status s = OpenWith(no_base)->Verify();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("base checkpoint (version 0)"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(kNorm), std::string::npos) << s.ToString();
  // Nor the store.
  LocalCheckpointOptions no_store = f.LocalOpts();
  no_store.store.clear();
  s = OpenWith(no_store)->Verify();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("store"), std::string::npos) << s.ToString();

  // A delta whose base_version breaks the chain (a Python-published
  // version, without our sidecar, so the index alone says so).
  const std::string index_path = f.VersionPath(2) + "/" + kIndexFileName;
  const std::string index_text = ReadFile(index_path);
  const std::string sidecar_path = f.VersionPath(2) + "/" + kVersionManifestFileName;
  const std::string sidecar_text = ReadFile(sidecar_path);
  std::filesystem::remove(sidecar_path);
  json index = json::parse(index_text);
  index["metadata"]["base_version"] = "000000";
  WriteFile(index_path, index.dump());
  s = local->Verify();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("out-of-order"), std::string::npos) << s.ToString();
  WriteFile(index_path, index_text);
  DS_ASSERT_OK(local->Verify());  // without the sidecar: from the shards' metadata
  WriteFile(sidecar_path, sidecar_text);

  // A version of the chain is gone.
  RemoveDir(f.VersionPath(1));
  s = local->Verify();
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  EXPECT_NE(s.message().find("version 000001 is missing"), std::string::npos) << s.ToString();
}

TEST(ForeignState, VerifyStopsAtTheNewestFullVersion) {
  Fixture f;
  WriteModel(f.base, f.base_model);
  std::vector<Model> m{f.base_model};
  m.push_back(ChangeOnly(m[0], {kEmbed, kUp}, 21));
  PublishAs(f, m[0], m[1], Encoding::kXor, ChecksumAlgo::kXxh3_128);
  m.push_back(ChangeOnly(m[1], {kQuery}, 22));
  PublishAs(f, m[1], m[2], Encoding::kXor, ChecksumAlgo::kBlake3, /*full=*/true);
  m.push_back(ChangeOnly(m[2], {kUp}, 23));
  PublishAs(f, m[2], m[3], Encoding::kXor, ChecksumAlgo::kXxh3_128);
  {
    auto local = f.OpenLocal();
    ASSERT_NE(local, nullptr);
    DS_ASSERT_OK(local->Pull(3));
  }
  WriteForeignState(f, 3);
  // Neither the base nor the versions before the full one are read.
  LocalCheckpointOptions options = f.LocalOpts();
  options.base.clear();
  std::filesystem::remove(f.local + "/.weight_sync/deltasync-base.json");
  RemoveDir(f.VersionPath(1));
  auto local = OpenWith(options);
  ASSERT_NE(local, nullptr);
  DS_ASSERT_OK(local->Verify());
  // Our full version: its sidecar's digests.
  FlipTensorByte(f.local, kNorm);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kNorm, "version 000002", "blake3"}));
  FlipTensorByte(f.local, kNorm);
  FlipTensorByte(f.local, kUp);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kUp, "version 000003"}));
  FlipTensorByte(f.local, kUp);
  // A full version without a sidecar (the Python publisher's): its bytes.
  std::filesystem::remove(f.VersionPath(2) + "/" + kVersionManifestFileName);
  DS_ASSERT_OK(local->Verify());
  FlipTensorByte(f.local, kQuery);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kQuery, "differs from version 000002"}));
  FlipTensorByte(f.local, kQuery);
  DS_ASSERT_OK(local->Verify());
  EXPECT_TRUE(HoldsModel(f.local, m[3]));
}

TEST(ForeignState, PullContinuesAndRecordsOurKeysAgain) {
  Fixture f;
  std::vector<Model> models = PublishDeltaChain(f);
  models.push_back(ChangeOnly(models[3], {kQuery}, 14));
  PublishAs(f, models[3], models[4], Encoding::kXor, ChecksumAlgo::kXxh3_128);
  auto local = f.OpenLocal();
  ASSERT_NE(local, nullptr);
  DS_ASSERT_OK(local->Pull(2));
  WriteForeignState(f, 2);
  Result<PullResult> r = local->Pull(std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->from_version, 2);
  EXPECT_EQ(r->versions_applied, (std::vector<int64_t>{3, 4}));
  EXPECT_FALSE(r->reset_to.has_value());
  EXPECT_TRUE(HoldsModel(f.local, models[4]));

  const json state = json::parse(ReadFile(StatePath(f)));
  EXPECT_EQ(state["version"], "000004");
  EXPECT_EQ(state["checksums_version"], "000004");
  EXPECT_TRUE(state.contains("boot_id"));
  EXPECT_FALSE(state.contains("origin"));  // unknown: no reset of ours
  // Version 3 is adler32: its sidecar's strong digest is what is recorded.
  const json expected_checksums = {
      {kUp, "xxh3-128:" + ChecksumHex(ChecksumAlgo::kXxh3_128, models[4][1].data)},
      {kQuery, "xxh3-128:" + ChecksumHex(ChecksumAlgo::kXxh3_128, models[4][2].data)}};
  ASSERT_EQ(models[4][1].name, kUp);
  ASSERT_EQ(models[4][2].name, kQuery);
  EXPECT_EQ(state["checksums"], expected_checksums) << state.dump();

  // Recorded checksums for some tensors, the chain for the rest.
  DS_ASSERT_OK(local->Verify());
  FlipTensorByte(f.local, kQuery);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kQuery, "state.json"}));
  FlipTensorByte(f.local, kQuery);
  FlipTensorByte(f.local, kEmbed);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kEmbed, "version 000001"}));
  FlipTensorByte(f.local, kEmbed);
  FlipTensorByte(f.local, kNorm);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kNorm, "base checkpoint"}));
  FlipTensorByte(f.local, kNorm);
  DS_ASSERT_OK(local->Verify());
}

TEST(ForeignState, VersionZeroNeedsOnlyTheBase) {
  Fixture f;
  WriteModel(f.base, f.base_model);
  std::filesystem::create_directories(f.store);
  {
    auto local = f.OpenLocal();
    ASSERT_NE(local, nullptr);
    DS_ASSERT_OK(local->Pull(0));
  }
  WriteForeignState(f, 0);
  LocalCheckpointOptions options = f.LocalOpts();
  options.store.clear();
  auto local = OpenWith(options);
  ASSERT_NE(local, nullptr);
  DS_ASSERT_OK(local->Verify());
  FlipTensorByte(f.local, kBias);
  EXPECT_TRUE(CorruptionMentions(local->Verify(), {kBias, "base checkpoint"}));
}

}  // namespace
}  // namespace deltasync::store_test
