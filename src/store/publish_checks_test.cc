// What the publisher refuses before anything becomes visible: a base that
// is not what the store's newest version holds, and a newest version that
// is empty or incomplete. Also the records that make those checks cheap
// (each version's state of every tensor) and the strong digests kept beside
// a weak checksum format, which the pull verifies.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "deltasync/checkpoint.h"
#include "deltasync/checksum.h"
#include "deltasync/store.h"
#include "io/file.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

using nlohmann::json;

const std::string kEmbed = "model.embed_tokens.weight";
const std::string kUp = "model.layers.0.mlp.up_proj.weight";
const std::string kNorm = "model.layers.0.input_layernorm.weight";

OwnedTensor& TensorNamed(Model& model, const std::string& name) {
  for (OwnedTensor& t : model) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return model.front();
}

const std::vector<uint8_t>& BytesOf(const Model& model, const std::string& name) {
  for (const OwnedTensor& t : model) {
    if (t.name == name) return t.data;
  }
  ADD_FAILURE() << "no tensor " << name;
  return model.front().data;
}

json ReadSidecar(const std::string& version_dir) {
  return json::parse(ReadFile(version_dir + "/" + kVersionManifestFileName));
}

// Asserts that `s` is `code` and that its message is one line holding every
// needle and none of `absent`.
::testing::AssertionResult Refused(const Status& s, StatusCode code,
                                   const std::vector<std::string>& needles,
                                   const std::vector<std::string>& absent = {}) {
  if (s.ok()) return ::testing::AssertionFailure() << "succeeded";
  if (s.code() != code) return ::testing::AssertionFailure() << "wrong code: " << s.ToString();
  if (s.message().find('\n') != std::string::npos) {
    return ::testing::AssertionFailure() << "more than one line: " << s.ToString();
  }
  for (const std::string& n : needles) {
    if (s.message().find(n) == std::string::npos) {
      return ::testing::AssertionFailure() << "lacks '" << n << "': " << s.ToString();
    }
  }
  for (const std::string& n : absent) {
    if (s.message().find(n) != std::string::npos) {
      return ::testing::AssertionFailure() << "names '" << n << "': " << s.ToString();
    }
  }
  return ::testing::AssertionSuccess();
}

// No version past `latest` and no temp dir in the store.
void ExpectNothingPublishedPast(const Fixture& f, int64_t latest) {
  Result<std::vector<int64_t>> versions = ListVersionNumbers(f.store);
  DS_ASSERT_OK(versions);
  ASSERT_FALSE(versions->empty());
  EXPECT_EQ(versions->back(), latest);
  for (const std::string& name : ListDir(f.store)) {
    EXPECT_NE(name.rfind(".tmp-", 0), 0u) << "left behind: " << name;
  }
}

// A store with versions 1..3 published one shot at a time (as the CLI
// does) with `checksum`; models[v] is what version v holds.
std::vector<Model> PublishThree(Fixture& f, ChecksumAlgo checksum,
                                Encoding encoding = Encoding::kSparse) {
  std::vector<Model> models{f.base_model};
  for (int v = 1; v <= 3; ++v) {
    models.push_back(Step(models.back(), 200 + v));
    Result<PublishResult> r =
        PublishOnce(f.PublisherOpts(encoding, checksum), Views(models[v - 1]), Views(models[v]));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
  return models;
}

// ---------------------------------------------------------------------------
// The state record

class EveryChecksum : public ::testing::TestWithParam<ChecksumAlgo> {};

TEST_P(EveryChecksum, EveryVersionRecordsTheStateOfEveryTensor) {
  Fixture f;
  const ChecksumAlgo algo = GetParam();
  std::vector<Model> models = PublishThree(f, algo);
  DS_ASSERT_OK(PublishOnce(f.PublisherOpts(Encoding::kSparse, algo), Views(models[3]),
                           Views(models[3]), /*full=*/true));
  models.push_back(models[3]);
  const bool weak = algo == ChecksumAlgo::kAdler32;
  for (int64_t v = 1; v <= 4; ++v) {
    SCOPED_TRACE("version " + std::to_string(v));
    Result<std::optional<VersionManifest>> m = ReadVersionManifest(f.VersionPath(v));
    DS_ASSERT_OK(m);
    ASSERT_TRUE(m->has_value());
    ASSERT_TRUE((*m)->state.has_value());
    EXPECT_EQ((*m)->state->size(), models[v].size());
    EXPECT_EQ((*m)->strong.has_value(), weak);
    for (const OwnedTensor& t : models[v]) {
      EXPECT_EQ((*m)->state->at(t.name), ChecksumHex(algo, t.data)) << t.name;
      if (weak) {
        EXPECT_EQ((*m)->strong_state.at(t.name), ChecksumHex(ChecksumAlgo::kXxh3_128, t.data))
            << t.name;
      }
    }
    // The delta's sidecar keeps the state apart from the changed tensors.
    const json doc = ReadSidecar(f.VersionPath(v));
    EXPECT_EQ(doc.contains("state"), v < 4);
    EXPECT_EQ(doc["format_version"], 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Algos, EveryChecksum,
                         ::testing::Values(ChecksumAlgo::kXxh3_128, ChecksumAlgo::kBlake3,
                                           ChecksumAlgo::kAdler32, ChecksumAlgo::kXxh3_64),
                         [](const ::testing::TestParamInfo<ChecksumAlgo>& info) {
                           std::string name(ChecksumAlgoName(info.param));
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

TEST(StateRecord, ASidecarWhoseStateDisagreesWithItsTensorsIsCorrupt) {
  Fixture f;
  PublishThree(f, ChecksumAlgo::kAdler32);
  const std::string path = f.VersionPath(3) + "/" + kVersionManifestFileName;
  const json good = ReadSidecar(f.VersionPath(3));
  auto expect_corrupt = [&](const std::function<void(json*)>& edit, const std::string& needle) {
    json doc = good;
    edit(&doc);
    WriteFile(path, doc.dump(1));
    EXPECT_TRUE(
        Refused(ReadVersionManifest(f.VersionPath(3)).status(), StatusCode::kCorruption, {needle}));
  };
  expect_corrupt([](json* d) { (*d)["state"][kEmbed] = std::string(8, '0'); }, "\"state\"");
  expect_corrupt([](json* d) { (*d)["state"].erase(kEmbed); }, "\"state\"");
  expect_corrupt([](json* d) { (*d)["state"]["model.norm.weight"] = "xyz"; }, "adler32 digest");
  expect_corrupt([](json* d) { (*d)["strong_state"][kEmbed] = std::string(32, '0'); },
                 "\"strong_state\"");
  expect_corrupt([](json* d) { (*d)["strong_state"].erase("model.empty"); },
                 "name different tensors");
  expect_corrupt([](json* d) { (*d)["tensors"][kEmbed].erase("strong_checksum"); },
                 "\"strong_checksum\"");
  expect_corrupt([](json* d) { d->erase("state"); }, "\"strong_checksum_format\" without");
  // What an older publisher wrote: no state, no strong digests.
  json old = good;
  old.erase("state");
  old.erase("strong_state");
  old.erase("strong_checksum_format");
  WriteFile(path, old.dump(1));
  Result<std::optional<VersionManifest>> m = ReadVersionManifest(f.VersionPath(3));
  DS_ASSERT_OK(m);
  EXPECT_FALSE((*m)->state.has_value());
  EXPECT_FALSE((*m)->strong.has_value());
}

// ---------------------------------------------------------------------------
// The base must be what the newest version holds

TEST_P(EveryChecksum, OneShotPublishOnAnOlderBaseIsRefusedNamingTheFirstTensor) {
  Fixture f;
  const ChecksumAlgo algo = GetParam();
  std::vector<Model> models = PublishThree(f, algo);
  const Model next = Step(models[3], 300);
  // Re-running a publish with an older base.
  EXPECT_TRUE(Refused(
      PublishOnce(f.PublisherOpts(Encoding::kSparse, algo), Views(models[2]), Views(next)).status(),
      StatusCode::kFailedPrecondition, {"version 000003", kEmbed, "differs"}));
  ExpectNothingPublishedPast(f, 3);
  // Two tensors off: the first by name is named, whatever the model's order.
  Model off = models[3];
  TensorNamed(off, kUp).data[5] ^= 1;
  TensorNamed(off, kNorm).data[3] ^= 1;
  EXPECT_TRUE(
      Refused(PublishOnce(f.PublisherOpts(Encoding::kXor, algo), Views(off), Views(next)).status(),
              StatusCode::kFailedPrecondition, {kNorm}, {kUp}));
  ExpectNothingPublishedPast(f, 3);
  // A tensor more, or one fewer, than the version holds.
  Model more = models[3];
  more.push_back({"model.extra", DType::kF32, {4}, std::vector<uint8_t>(16, 1)});
  Model more_next = next;
  more_next.push_back(more.back());
  EXPECT_TRUE(Refused(
      PublishOnce(f.PublisherOpts(Encoding::kSparse, algo), Views(more), Views(more_next)).status(),
      StatusCode::kFailedPrecondition, {"model.extra", "is not in it"}));
  Model fewer = models[3];
  fewer.erase(fewer.begin() + 1);
  Model fewer_next = next;
  fewer_next.erase(fewer_next.begin() + 1);
  EXPECT_TRUE(
      Refused(PublishOnce(f.PublisherOpts(Encoding::kSparse, algo), Views(fewer), Views(fewer_next))
                  .status(),
              StatusCode::kFailedPrecondition, {kUp, "is not in the base"}));
  ExpectNothingPublishedPast(f, 3);

  // The right base publishes, and the chain pulls.
  DS_ASSERT_OK(
      PublishOnce(f.PublisherOpts(Encoding::kSparse, algo), Views(models[3]), Views(next)));
  WriteModel(f.base, f.base_model);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(4));
  EXPECT_TRUE(HoldsModel(f.local, next));
}

TEST(BaseCheck, TheNewestVersionsRecordInAnotherChecksumIsUsed) {
  Fixture f;
  std::vector<Model> models = PublishThree(f, ChecksumAlgo::kXxh3_128);
  const Model next = Step(models[3], 301);
  for (ChecksumAlgo algo : {ChecksumAlgo::kBlake3, ChecksumAlgo::kAdler32}) {
    EXPECT_TRUE(Refused(
        PublishOnce(f.PublisherOpts(Encoding::kXor, algo), Views(models[1]), Views(next)).status(),
        StatusCode::kFailedPrecondition, {"xxh3-128", kEmbed}));
  }
  ExpectNothingPublishedPast(f, 3);
  DS_ASSERT_OK(PublishOnce(f.PublisherOpts(Encoding::kXor, ChecksumAlgo::kBlake3), Views(models[3]),
                           Views(next)));
}

TEST(BaseCheck, AFullVersionDoesNotDependOnTheBase) {
  Fixture f;
  std::vector<Model> models = PublishThree(f, ChecksumAlgo::kXxh3_128);
  const Model next = Step(models[3], 302);
  Result<PublishResult> r =
      PublishOnce(f.PublisherOpts(), Views(models[1]), Views(next), /*full=*/true);
  DS_ASSERT_OK(r);
  EXPECT_FALSE(r->info.is_delta);
  // On top of the full version, its tensors are the record.
  const Model after = Step(next, 303);
  EXPECT_TRUE(Refused(PublishOnce(f.PublisherOpts(), Views(models[3]), Views(after)).status(),
                      StatusCode::kFailedPrecondition, {"version 000004", kEmbed}));
  DS_ASSERT_OK(PublishOnce(f.PublisherOpts(), Views(next), Views(after)));
}

TEST(BaseCheck, PublisherCreateRefusesABaseThatIsNotTheNewestVersion) {
  Fixture f;
  std::vector<Model> models = PublishThree(f, ChecksumAlgo::kAdler32, Encoding::kXor);
  for (ChecksumAlgo algo : {ChecksumAlgo::kAdler32, ChecksumAlgo::kXxh3_128}) {
    EXPECT_TRUE(
        Refused(Publisher::Create(f.PublisherOpts(Encoding::kXor, algo), Views(models[2])).status(),
                StatusCode::kFailedPrecondition, {"version 000003", kEmbed}));
  }
  Result<std::unique_ptr<Publisher>> p =
      Publisher::Create(f.PublisherOpts(Encoding::kXor, ChecksumAlgo::kAdler32), Views(models[3]));
  DS_ASSERT_OK(p);
  EXPECT_EQ((*p)->latest_version(), 3);
  std::vector<Model> more = PublishSteps(p->get(), models[3], 2, 400);
  WriteModel(f.base, f.base_model);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(5));
  EXPECT_TRUE(HoldsModel(f.local, more[2]));
  DS_ASSERT_OK(local->Verify());
}

// Versions whose sidecar has no state (an older publisher) or that have no
// sidecar (the Python publisher): the changed tensors' checksums are what
// they record; the other tensors cannot be checked without reading the
// version's own base.
TEST(BaseCheck, WithoutAStateRecordTheChangedTensorsAreChecked) {
  for (bool sidecar : {true, false}) {
    SCOPED_TRACE(sidecar ? "older sidecar" : "no sidecar");
    Fixture f;
    std::vector<Model> models{f.base_model};
    models.push_back(Step(models[0], 500));
    DS_ASSERT_OK(PublishOnce(f.PublisherOpts(Encoding::kXor), Views(models[0]), Views(models[1])));
    // Version 2 changes only kUp.
    models.push_back(models[1]);
    TensorNamed(models[2], kUp).data[7] ^= 4;
    DS_ASSERT_OK(PublishOnce(f.PublisherOpts(Encoding::kXor), Views(models[1]), Views(models[2])));
    const std::string sidecar_path = f.VersionPath(2) + "/" + kVersionManifestFileName;
    if (sidecar) {
      json doc = ReadSidecar(f.VersionPath(2));
      doc.erase("state");
      WriteFile(sidecar_path, doc.dump(1));
    } else {
      std::filesystem::remove(sidecar_path);
    }
    const Model next = Step(models[2], 501);
    EXPECT_TRUE(Refused(
        PublishOnce(f.PublisherOpts(Encoding::kXor), Views(models[1]), Views(next)).status(),
        StatusCode::kFailedPrecondition, {kUp}));
    Model base = models[2];
    base.erase(base.begin() + 1);
    Model base_next = next;
    base_next.erase(base_next.begin() + 1);
    EXPECT_TRUE(Refused(
        PublishOnce(f.PublisherOpts(Encoding::kXor), Views(base), Views(base_next)).status(),
        StatusCode::kFailedPrecondition, {kUp, "is not in the base"}));
    ExpectNothingPublishedPast(f, 2);
    // The limit: a tensor version 2 did not change is not checked.
    Model unchecked = models[2];
    TensorNamed(unchecked, kEmbed).data[0] ^= 1;
    DS_EXPECT_OK(PublishOnce(f.PublisherOpts(Encoding::kXor), Views(unchecked), Views(next)));
  }
}

TEST(BaseCheck, AFullVersionWithoutASidecarIsKnownByItsTensorsNamesDtypesAndShapes) {
  Fixture f;
  const Model v1 = Step(f.base_model, 600);
  DS_ASSERT_OK(PublishOnce(f.PublisherOpts(), Views(f.base_model), Views(v1), /*full=*/true));
  std::filesystem::remove(f.VersionPath(1) + "/" + kVersionManifestFileName);
  const Model next = Step(v1, 601);
  Model reshaped = v1;
  TensorNamed(reshaped, kUp).shape = {96, 48};
  Model reshaped_next = next;
  TensorNamed(reshaped_next, kUp).shape = {96, 48};
  EXPECT_TRUE(
      Refused(PublishOnce(f.PublisherOpts(), Views(reshaped), Views(reshaped_next)).status(),
              StatusCode::kFailedPrecondition, {kUp, "BF16[96, 48]"}));
  ExpectNothingPublishedPast(f, 1);
  DS_ASSERT_OK(PublishOnce(f.PublisherOpts(), Views(v1), Views(next)));
}

// ---------------------------------------------------------------------------
// An empty or incomplete newest version

TEST(NewestVersion, EmptyOrIncompleteIsRefusedNamingItUntilRemoved) {
  struct Case {
    const char* what;
    std::function<void(const Fixture&)> damage;
  };
  const std::vector<Case> cases = {
      {"empty", [](const Fixture& f) { std::filesystem::create_directory(f.VersionPath(2)); }},
      {"no index",
       [](const Fixture& f) {
         std::filesystem::copy(f.VersionPath(1), f.VersionPath(2));
         std::filesystem::remove(f.VersionPath(2) + "/" + kIndexFileName);
         std::filesystem::remove(f.VersionPath(2) + "/" + kVersionManifestFileName);
       }},
      {"missing shard",
       [](const Fixture& f) {
         std::filesystem::copy(f.VersionPath(1), f.VersionPath(2));
         json index = json::parse(ReadFile(f.VersionPath(2) + "/" + kIndexFileName));
         index["metadata"]["version"] = "000002";
         index["metadata"]["base_version"] = "000001";
         WriteFile(f.VersionPath(2) + "/" + kIndexFileName, index.dump(2));
         json sidecar = ReadSidecar(f.VersionPath(2));
         sidecar["version"] = "000002";
         sidecar["base_version"] = "000001";
         WriteFile(f.VersionPath(2) + "/" + kVersionManifestFileName, sidecar.dump(1));
         const std::string shard =
             std::filesystem::path(FileHolding(f.VersionPath(1), kEmbed)).filename();
         ASSERT_TRUE(std::filesystem::remove(f.VersionPath(2) + "/" + shard));
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture f;
    const Model v1 = Step(f.base_model, 700);
    PublisherOptions o = f.PublisherOpts(Encoding::kXor);
    o.max_shard_bytes = 4096;  // several shards
    DS_ASSERT_OK(PublishOnce(o, Views(f.base_model), Views(v1)));
    c.damage(f);
    const Model next = Step(v1, 701);
    for (bool full : {false, true}) {
      EXPECT_TRUE(Refused(PublishOnce(o, Views(v1), Views(next), full).status(),
                          StatusCode::kFailedPrecondition,
                          {f.VersionPath(2), "incomplete", "remove it"}));
    }
    EXPECT_TRUE(Refused(Publisher::Create(o, Views(v1)).status(), StatusCode::kFailedPrecondition,
                        {f.VersionPath(2), "remove it"}));
    EXPECT_FALSE(io::PathExists(f.VersionPath(3)));
    ExpectNothingPublishedPast(f, 2);
    // Once it is removed, the next version is 2 again.
    RemoveDir(f.VersionPath(2));
    Result<PublishResult> r = PublishOnce(o, Views(v1), Views(next));
    DS_ASSERT_OK(r);
    EXPECT_EQ(r->info.version, 2);
  }
}

TEST(NewestVersion, ADeltaIndexMustCarryItsVersionAsAString) {
  Fixture f;
  const Model v1 = Step(f.base_model, 800);
  DS_ASSERT_OK(PublishOnce(f.PublisherOpts(Encoding::kXor), Views(f.base_model), Views(v1)));
  const std::string index_path = f.VersionPath(1) + "/" + kIndexFileName;
  const json good = json::parse(ReadFile(index_path));
  auto read_with = [&](const std::function<void(json*)>& edit) {
    json index = good;
    edit(&index);
    WriteFile(index_path, index.dump(2));
    return ReadVersionInfo(f.VersionPath(1)).status();
  };
  EXPECT_TRUE(Refused(read_with([](json* i) { (*i)["metadata"].erase("version"); }),
                      StatusCode::kCorruption, {index_path, "lacks \"version\""}));
  // Nothing is published on top of it either.
  EXPECT_TRUE(Refused(PublishOnce(f.PublisherOpts(), Views(v1), Views(Step(v1, 801))).status(),
                      StatusCode::kFailedPrecondition, {f.VersionPath(1), "\"version\""}));
  EXPECT_TRUE(Refused(read_with([](json* i) { (*i)["metadata"]["version"] = 1; }),
                      StatusCode::kCorruption, {index_path, "\"version\" is '1', not a string"}));
  EXPECT_TRUE(Refused(read_with([](json* i) { (*i)["metadata"]["version"] = nullptr; }),
                      StatusCode::kCorruption, {"\"version\"", "not a string"}));
  EXPECT_TRUE(Refused(read_with([](json* i) { (*i)["metadata"]["delta_encoding"] = 3; }),
                      StatusCode::kCorruption, {"\"delta_encoding\"", "not a string"}));
  // A full version may lack it (a plain checkpoint: the name gives it).
  std::filesystem::remove(f.VersionPath(1) + "/" + kVersionManifestFileName);
  DS_ASSERT_OK(read_with([](json* i) { i->erase("metadata"); }));
  DS_ASSERT_OK(read_with([](json*) {}));
}

// ---------------------------------------------------------------------------
// Strong digests beside adler32

// A bigger model: the first tensor spans more than 65521 bytes.
struct BigFixture : Fixture {
  BigFixture() { base_model = MakeModel(1, 600); }
};

class AdlerCollision : public ::testing::TestWithParam<bool> {};

TEST_P(AdlerCollision, ADeltaMatchingAdler32WithOtherBytesIsRefusedAndRolledBack) {
  BigFixture f;
  WriteModel(f.base, f.base_model);
  const Model v1 = Step(f.base_model, 900);
  const Model v2 = Step(v1, 901);
  const PublisherOptions o = f.PublisherOpts(Encoding::kXor, ChecksumAlgo::kAdler32);
  DS_ASSERT_OK(PublishOnce(o, Views(f.base_model), Views(v1)));
  DS_ASSERT_OK(PublishOnce(o, Views(v1), Views(v2)));

  // Two edits 65521 bytes apart, +d and -d, leave adler32 unchanged.
  Model forged = v2;
  std::vector<uint8_t>& bytes = TensorNamed(forged, kEmbed).data;
  ASSERT_GT(bytes.size(), 65521u + 200u);
  size_t at = 100;
  while (bytes[at] == 0xff || bytes[at + 65521] == 0) ++at;
  bytes[at] += 1;
  bytes[at + 65521] -= 1;
  ASSERT_EQ(ChecksumHex(ChecksumAlgo::kAdler32, bytes),
            ChecksumHex(ChecksumAlgo::kAdler32, BytesOf(v2, kEmbed)));
  ASSERT_NE(bytes, BytesOf(v2, kEmbed));

  // Its delta, in a store of its own, with version 2's sidecar put back:
  // every peer-readable checksum is version 2's.
  const std::string other = f.tmp.Join("forged");
  std::filesystem::create_directories(other);
  std::filesystem::copy(f.VersionPath(1), other + "/" + VersionDirName(1));
  PublisherOptions forged_opts = o;
  forged_opts.store = other;
  DS_ASSERT_OK(PublishOnce(forged_opts, Views(v1), Views(forged)));
  const std::string sidecar = ReadFile(f.VersionPath(2) + "/" + kVersionManifestFileName);
  RemoveDir(f.VersionPath(2));
  std::filesystem::copy(other + "/" + VersionDirName(2), f.VersionPath(2));
  WriteFile(f.VersionPath(2) + "/" + kVersionManifestFileName, sidecar);

  LocalCheckpointOptions lo = f.LocalOpts();
  lo.durable = GetParam();
  Result<std::unique_ptr<LocalCheckpoint>> local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  DS_ASSERT_OK((*local)->Pull(1));
  EXPECT_TRUE(Refused((*local)->Pull(2).status(), StatusCode::kCorruption,
                      {"checksum mismatch", kEmbed, "rolled back to version 000001"}));
  EXPECT_TRUE(HoldsModel(f.local, v1));
  Result<std::optional<int64_t>> current = (*local)->CurrentVersion();
  DS_ASSERT_OK(current);
  EXPECT_EQ(*current, std::optional<int64_t>(1));
  EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync/journal"));
  DS_EXPECT_OK((*local)->Verify());

  // The genuine version 2 applies, and the state records its strong digests.
  RemoveDir(f.VersionPath(2));
  RemoveDir(other);
  DS_ASSERT_OK(PublishOnce(o, Views(v1), Views(v2)));
  DS_ASSERT_OK((*local)->Pull(2));
  EXPECT_TRUE(HoldsModel(f.local, v2));
  const json state = json::parse(ReadFile(f.local + "/.weight_sync/state.json"));
  EXPECT_EQ(state["checksums"][kEmbed],
            "xxh3-128:" + ChecksumHex(ChecksumAlgo::kXxh3_128, BytesOf(v2, kEmbed)));
  DS_EXPECT_OK((*local)->Verify());
}

INSTANTIATE_TEST_SUITE_P(Pulls, AdlerCollision, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "durable" : "streamed";
                         });

TEST(StrongDigests, AWrongBaseIsCaughtByTheStrongBaseChecksumBeforeTouching) {
  BigFixture f;
  WriteModel(f.base, f.base_model);
  const PublisherOptions o = f.PublisherOpts(Encoding::kOverwrite, ChecksumAlgo::kAdler32);
  const Model v1 = Step(f.base_model, 910);
  const Model v2 = Step(v1, 911);
  DS_ASSERT_OK(PublishOnce(o, Views(f.base_model), Views(v1)));
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  // Another history's version 2, on a version 1 with the same adler32 but
  // other bytes.
  Model forged_v1 = v1;
  std::vector<uint8_t>& bytes = TensorNamed(forged_v1, kEmbed).data;
  size_t at = 100;
  while (bytes[at] == 0xff || bytes[at + 65521] == 0) ++at;
  bytes[at] += 1;
  bytes[at + 65521] -= 1;
  RemoveDir(f.VersionPath(1));
  DS_ASSERT_OK(PublishOnce(o, Views(f.base_model), Views(forged_v1)));
  DS_ASSERT_OK(PublishOnce(o, Views(forged_v1), Views(v2)));
  const std::string state_before = ReadFile(f.local + "/.weight_sync/state.json");
  EXPECT_TRUE(
      Refused(local->Pull(2).status(), StatusCode::kFailedPrecondition, {"wrong base", kEmbed}));
  EXPECT_TRUE(HoldsModel(f.local, v1));
  EXPECT_EQ(ReadFile(f.local + "/.weight_sync/state.json"), state_before);
}

}  // namespace
}  // namespace deltasync::store_test
