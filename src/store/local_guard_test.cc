// The local checkpoint refuses the mistakes a user makes with paths and
// bases, and reading it never writes: each test sets up the mistake, checks
// the specific error, and checks that nothing was changed.

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "deltasync/store.h"
#include "io/file.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

// Every regular file below `dir` with its bytes, for "nothing changed".
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) files[e.path().string()] = ReadFile(e.path().string());
  }
  return files;
}

LocalCheckpointOptions With(LocalCheckpointOptions o, std::string local, std::string base,
                            std::string store) {
  o.local = std::move(local);
  o.base = std::move(base);
  o.store = std::move(store);
  return o;
}

TEST(LocalGuard, RefusesALocalThatIsOrHoldsOrLiesInsideTheBaseOrTheStore) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 1);
  std::filesystem::create_symlink(f.base, f.tmp.Join("base-link"));
  const auto base_before = Snapshot(f.base);
  const auto store_before = Snapshot(f.store);
  struct Case {
    std::string local, base, store, relation;
  };
  const Case cases[] = {
      {f.base, f.base, f.store, "is the same directory as the base checkpoint"},
      {f.base + "/", f.base, f.store, "is the same directory as the base checkpoint"},
      {f.tmp.Join("base-link"), f.base, f.store, "is the same directory as the base checkpoint"},
      {f.tmp.Join("x/../base"), f.base, f.store, "is the same directory as the base checkpoint"},
      {f.base + "/sub/local", f.base, f.store, "lies inside the base checkpoint"},
      {f.tmp.Join("base-link") + "/new", f.base, f.store, "lies inside the base checkpoint"},
      {f.tmp.path(), f.base, f.store, "holds the base checkpoint"},
      {f.store, f.base, f.store, "is the same directory as the store"},
      {f.store + "/local", f.base, f.store, "lies inside the store"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.local);
    Result<std::unique_ptr<LocalCheckpoint>> opened =
        LocalCheckpoint::Open(With(f.LocalOpts(), c.local, c.base, c.store));
    ASSERT_FALSE(opened.ok());
    EXPECT_TRUE(opened.status().IsInvalidArgument()) << opened.status().ToString();
    EXPECT_NE(opened.status().message().find(c.relation), std::string::npos)
        << opened.status().ToString();
  }
  EXPECT_EQ(Snapshot(f.base), base_before);
  EXPECT_EQ(Snapshot(f.store), store_before);
  EXPECT_FALSE(io::PathExists(f.base + "/.weight_sync"));
  // A directory beside the base, whose name merely starts the same, is fine.
  DS_EXPECT_OK(LocalCheckpoint::Open(With(f.LocalOpts(), f.base + "2", f.base, f.store)));
}

TEST(LocalGuard, AMissingStoreIsAnErrorThatWritesNothing) {
  Fixture f;
  WriteModel(f.base, f.base_model);
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.store = f.tmp.Join("no-such-store");
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  for (std::optional<int64_t> target : {std::optional<int64_t>(), std::optional<int64_t>(0)}) {
    Result<PullResult> r = (*local)->Pull(target);
    ASSERT_TRUE(r.status().IsNotFound()) << r.status().ToString();
    EXPECT_NE(r.status().message().find("store " + lo.store + " does not exist"), std::string::npos)
        << r.status().ToString();
  }
  EXPECT_FALSE(io::PathExists(f.local));
  EXPECT_TRUE(ListVersions(lo.store).status().IsNotFound());
  EXPECT_TRUE(PruneStore(lo.store, 1).status().IsNotFound());
  EXPECT_FALSE(io::PathExists(lo.store));

  // An empty store is a store: latest is the base.
  std::filesystem::create_directories(f.store);
  auto empty = f.OpenLocal();
  Result<PullResult> r = empty->Pull(std::nullopt);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->version, 0);
  EXPECT_TRUE(HoldsModel(f.local, f.base_model));
  Result<std::vector<VersionInfo>> versions = ListVersions(f.store);
  DS_ASSERT_OK(versions);
  EXPECT_TRUE(versions->empty());
}

TEST(LocalGuard, ADirectoryHoldingOtherThingsAndNoVersionIsNotAStore) {
  Fixture f;
  WriteModel(f.base, f.base_model);
  // What a store holds beside its versions keeps it an empty store.
  std::filesystem::create_directories(f.store + "/.tmp-weight_v000001-7-0");
  std::filesystem::create_directories(f.store + "/.trash-weight_v000001-7-0");
  std::filesystem::create_directories(f.store + "/lost+found");
  WriteFile(f.store + "/.nfs0000000000001234", "x");
  WriteFile(f.store + "/weight_v000001.tmp", "x");
  Result<std::vector<int64_t>> empty = ListVersionNumbers(f.store);
  DS_ASSERT_OK(empty);
  EXPECT_TRUE(empty->empty());

  // Anything else makes it a mistyped store, for every reader.
  WriteModel(f.store + "/step_000000", f.base_model);
  WriteFile(f.store + "/synth_chain.json", "{}");
  auto not_a_store = [&](const Status& s) {
    EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
    EXPECT_NE(s.message().find(f.store + " is not a store"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("step_000000"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("and 1 other entry"), std::string::npos) << s.ToString();
  };
  not_a_store(ListVersionNumbers(f.store).status());
  not_a_store(ListVersions(f.store).status());
  not_a_store(PruneStore(f.store, 1).status());
  not_a_store(Publisher::Create(f.PublisherOpts(), Views(f.base_model)).status());
  not_a_store(LocalCheckpoint::Open(f.LocalOpts()).status());
  EXPECT_FALSE(io::PathExists(f.local));
  // Opened while it was still empty: the pull refuses it, whatever its
  // target, before creating anything.
  std::filesystem::rename(f.store + "/step_000000", f.tmp.Join("aside"));
  std::filesystem::rename(f.store + "/synth_chain.json", f.tmp.Join("aside.json"));
  auto local = f.OpenLocal();
  std::filesystem::rename(f.tmp.Join("aside"), f.store + "/step_000000");
  std::filesystem::rename(f.tmp.Join("aside.json"), f.store + "/synth_chain.json");
  for (std::optional<int64_t> target : {std::optional<int64_t>(), std::optional<int64_t>(0)}) {
    not_a_store(local->Pull(target).status());
  }
  EXPECT_FALSE(io::PathExists(f.local));
  // With a version it is a store, whatever else it holds.
  std::filesystem::rename(f.store + "/step_000000", f.tmp.Join("aside"));
  std::filesystem::rename(f.store + "/synth_chain.json", f.tmp.Join("aside.json"));
  auto publisher = Publisher::Create(f.PublisherOpts(), Views(f.base_model));
  DS_ASSERT_OK(publisher);
  DS_ASSERT_OK((*publisher)->Publish(Views(Step(f.base_model, 1))));
  std::filesystem::rename(f.tmp.Join("aside"), f.store + "/step_000000");
  std::filesystem::rename(f.tmp.Join("aside.json"), f.store + "/synth_chain.json");
  Result<std::vector<int64_t>> listed = ListVersionNumbers(f.store);
  DS_ASSERT_OK(listed);
  EXPECT_EQ(*listed, std::vector<int64_t>{1});
  DS_ASSERT_OK(local->Pull(std::nullopt));
}

TEST(LocalGuard, RefusesToReplaceACheckpointNoPullMadeUnlessTold) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  const Model trainer = MakeModel(77);
  WriteModel(f.local, trainer, 3000);  // sharded: an index and its shards
  const auto before = Snapshot(f.local);
  auto local = f.OpenLocal();
  Result<PullResult> r = local->Pull(std::nullopt);
  ASSERT_TRUE(r.status().code() == StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("a checkpoint that no pull made"), std::string::npos);
  EXPECT_NE(r.status().message().find("--force"), std::string::npos);
  // Nothing of the pull's: no lock, no .weight_sync.
  EXPECT_EQ(Snapshot(f.local), before);
  EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync"));

  LocalCheckpointOptions forced = f.LocalOpts();
  forced.replace_unknown_checkpoint = true;
  auto replacing = LocalCheckpoint::Open(forced);
  DS_ASSERT_OK(replacing);
  DS_ASSERT_OK((*replacing)->Pull(std::nullopt));
  EXPECT_TRUE(HoldsModel(f.local, models[1]));
  // From then on the checkpoint is one a pull made: no flag needed.
  auto again = f.OpenLocal();
  DS_EXPECT_OK(again->Pull(0));
  EXPECT_TRUE(HoldsModel(f.local, f.base_model));
}

TEST(LocalGuard, VerifyAndCurrentVersionNeverWrite) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 1);
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.recover_on_open = false;

  // A local that does not exist: NotFound, and still nothing there.
  {
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(local);
    Status s = (*local)->Verify();
    EXPECT_TRUE(s.IsNotFound()) << s.ToString();
    Result<std::optional<int64_t>> v = (*local)->CurrentVersion();
    DS_ASSERT_OK(v);
    EXPECT_FALSE(v->has_value());
  }
  EXPECT_FALSE(io::PathExists(f.local));

  // A trainer's checkpoint: not at any version, and left as it was.
  WriteModel(f.local, f.base_model);
  const auto trainer = Snapshot(f.local);
  for (bool recover : {false, true}) {
    LocalCheckpointOptions o = lo;
    o.recover_on_open = recover;
    auto local = LocalCheckpoint::Open(o);
    DS_ASSERT_OK(local);
    Status s = (*local)->Verify();
    EXPECT_TRUE(s.code() == StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("never pulled"), std::string::npos) << s.ToString();
    DS_EXPECT_OK((*local)->CurrentVersion());
  }
  EXPECT_EQ(Snapshot(f.local), trainer);
  EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync"));

  // A pulled checkpoint: verifying it changes no byte of any file.
  RemoveDir(f.local);
  DS_ASSERT_OK(f.OpenLocal()->Pull(std::nullopt));
  const auto pulled = Snapshot(f.local);
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  DS_EXPECT_OK((*local)->Verify());
  EXPECT_EQ(Snapshot(f.local), pulled);
}

// Rewrites the index metadata of `dir` through `edit`.
void EditIndexMetadata(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = dir + "/" + kIndexFileName;
  nlohmann::json index = nlohmann::json::parse(ReadFile(path));
  edit(index);
  WriteFile(path, index.dump(2));
}

TEST(LocalGuard, ADeltaThatLostItsDeltaMetadataIsNotInstalledAsAFullVersion) {
  const std::function<void(nlohmann::json&)> edits[] = {
      [](nlohmann::json& i) { i["metadata"].erase("delta_encoding"); },
      [](nlohmann::json& i) { i.erase("metadata"); },
      [](nlohmann::json& i) { i["metadata"] = nlohmann::json::object(); },
  };
  for (const Encoding encoding : {Encoding::kXor, Encoding::kOverwrite, Encoding::kSparse}) {
    for (size_t e = 0; e < std::size(edits); ++e) {
      SCOPED_TRACE(std::string(EncodingName(encoding)) + " edit " + std::to_string(e));
      Fixture f;
      auto publisher = f.MakePublisher(f.PublisherOpts(encoding));
      PublishSteps(publisher.get(), f.base_model, 2);
      // As the Python publisher writes a store: no sidecar.
      for (int v : {1, 2})
        std::filesystem::remove(f.VersionPath(v) + "/" + kVersionManifestFileName);
      auto local = f.OpenLocal();
      DS_ASSERT_OK(local->Pull(1));
      const auto before = Snapshot(f.local);
      EditIndexMetadata(f.VersionPath(2), edits[e]);
      Result<VersionInfo> info = ReadVersionInfo(f.VersionPath(2));
      ASSERT_TRUE(info.ok() && !info->is_delta) << "the edit must make it read as full";
      Result<PullResult> r = local->Pull(2);
      ASSERT_TRUE(r.status().IsCorruption()) << r.status().ToString();
      EXPECT_NE(r.status().message().find("is not a full checkpoint of this model"),
                std::string::npos)
          << r.status().ToString();
      EXPECT_EQ(Snapshot(f.local), before);
      EXPECT_EQ(**local->CurrentVersion(), 1);
      DS_EXPECT_OK(local->Verify());
    }
  }
}

TEST(LocalGuard, ADeltaIndexThatLostItsShardsIsRefused) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  PublishSteps(publisher.get(), f.base_model, 2);
  for (int v : {1, 2}) std::filesystem::remove(f.VersionPath(v) + "/" + kVersionManifestFileName);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  const auto before = Snapshot(f.local);
  // An emptied weight_map reads as "nothing changed": the shards beside it
  // say otherwise.
  const std::string path = f.VersionPath(2) + "/" + kIndexFileName;
  nlohmann::json index = nlohmann::json::parse(ReadFile(path));
  index["weight_map"] = nlohmann::json::object();
  WriteFile(path, index.dump(2));
  Result<PullResult> r = local->Pull(2);
  ASSERT_TRUE(r.status().IsCorruption()) << r.status().ToString();
  EXPECT_NE(r.status().message().find("which its weight_map does not name"), std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(Snapshot(f.local), before);
  EXPECT_EQ(**local->CurrentVersion(), 1);
}

TEST(LocalGuard, AFullVersionOfTheModelStillResetsTheCheckpoint) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  models.push_back(Step(models.back(), 9));
  DS_ASSERT_OK(publisher->Publish(Views(models.back()), /*full=*/true));
  auto local = f.OpenLocal();
  Result<PullResult> r = local->Pull(std::nullopt);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 2);
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

TEST(LocalGuard, AFullVersionWhoseBytesDisagreeWithItsSidecarReplacesNothing) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  models.push_back(Step(models.back(), 9));
  DS_ASSERT_OK(publisher->Publish(Views(models.back()), /*full=*/true));
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(1));
  const auto before = Snapshot(f.local);
  const std::string tensor = "model.layers.0.mlp.up_proj.weight";
  const std::string file = FileHolding(f.VersionPath(2), tensor);
  FlipByte(file, TensorOffsetInFile(file, tensor) + 7);
  Result<PullResult> r = local->Pull(2);
  ASSERT_TRUE(r.status().IsCorruption()) << r.status().ToString();
  EXPECT_NE(r.status().message().find(tensor), std::string::npos) << r.status().ToString();
  EXPECT_EQ(Snapshot(f.local), before);
  EXPECT_EQ(**local->CurrentVersion(), 1);
  // Repaired, the same pull goes through.
  FlipByte(file, TensorOffsetInFile(file, tensor) + 7);
  DS_ASSERT_OK(local->Pull(2));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

TEST(LocalGuard, AWrongBaseIsRefusedBeforeAnythingIsCopied) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  const std::string wrong = f.tmp.Join("wrong-base");
  WriteModel(wrong, Step(f.base_model, 5));  // same layout, other weights
  for (std::optional<int64_t> target : {std::optional<int64_t>(), std::optional<int64_t>(0)}) {
    LocalCheckpointOptions lo = f.LocalOpts();
    lo.base = wrong;
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(local);
    Result<PullResult> r = (*local)->Pull(target);
    ASSERT_TRUE(r.status().code() == StatusCode::kFailedPrecondition) << r.status().ToString();
    EXPECT_NE(r.status().message().find("is not the base of store"), std::string::npos)
        << r.status().ToString();
    EXPECT_FALSE(io::PathExists(f.local + "/" + kSingleFileName));
    EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync/state.json"));
  }
  // The right base then works as if nothing had happened.
  Result<PullResult> r = f.OpenLocal()->Pull(std::nullopt);
  DS_ASSERT_OK(r);
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

TEST(LocalGuard, ABaseThatDiffersOnlyWhereVersionOneChangedNothingIsRefusedToo) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor, ChecksumAlgo::kAdler32));
  Model next = f.base_model;
  next[1].data[0] ^= 1;  // version 1 changes one tensor only
  DS_ASSERT_OK(publisher->Publish(Views(next)));
  Model wrong = f.base_model;
  wrong[2].data[5] ^= 1;  // a tensor version 1 leaves alone
  WriteModel(f.tmp.Join("wrong-base"), wrong);
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.base = f.tmp.Join("wrong-base");
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  Result<PullResult> r = (*local)->Pull(std::nullopt);
  ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find(wrong[2].name), std::string::npos) << r.status().ToString();
  // Checked with the strong digest the sidecar keeps beside adler32.
  EXPECT_NE(r.status().message().find("xxh3-128"), std::string::npos) << r.status().ToString();
  EXPECT_FALSE(io::PathExists(f.local + "/" + kSingleFileName));
  DS_ASSERT_OK(f.OpenLocal()->Pull(std::nullopt));
  EXPECT_TRUE(HoldsModel(f.local, next));
}

TEST(LocalGuard, TheRightBaseRepairsACheckpointSeededFromAWrongOne) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  // Without sidecars the store records nothing about its base: a wrong base
  // is only found when the first delta fails to verify.
  for (int v : {1, 2}) std::filesystem::remove(f.VersionPath(v) + "/" + kVersionManifestFileName);
  const std::string wrong = f.tmp.Join("wrong-base");
  WriteModel(wrong, Step(f.base_model, 5));
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.base = wrong;
  auto bad = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(bad);
  EXPECT_FALSE((*bad)->Pull(std::nullopt).ok());
  EXPECT_EQ(**(*bad)->CurrentVersion(), 0);  // a copy of the wrong base
  // The right base replaces it, then every delta applies.
  auto local = f.OpenLocal();
  Result<PullResult> r = local->Pull(std::nullopt);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
  DS_EXPECT_OK(local->Verify());
}

TEST(LocalGuard, AWrongBaseIsRefusedOnACheckpointAlreadyAtAVersion) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  DS_ASSERT_OK(f.OpenLocal()->Pull(1));
  const std::string record = f.local + "/.weight_sync/deltasync-base.json";
  const std::string recorded = ReadFile(record);
  const auto state_before = Snapshot(f.local);
  const std::string wrong = f.tmp.Join("wrong-base");
  WriteModel(wrong, Step(f.base_model, 5));
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.base = wrong;
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  // The base plays no part in either pull (nothing to pull; a delta on
  // top), but a wrong one is a mistake all the same: the store says so.
  for (int64_t target : {1, 2}) {
    Result<PullResult> r = (*local)->Pull(target);
    ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
    EXPECT_NE(r.status().message().find("base checkpoint " + wrong + " is not the base of store"),
              std::string::npos)
        << r.status().ToString();
  }
  EXPECT_EQ(ReadFile(record), recorded);
  EXPECT_EQ(Snapshot(f.local), state_before);
  EXPECT_EQ(**(*local)->CurrentVersion(), 1);
  // A copy of the right base elsewhere is the same base: the store vouches
  // for its contents, and it becomes the recorded one.
  const std::string copy = f.tmp.Join("base-copy");
  WriteModel(copy, f.base_model);
  lo.base = copy;
  auto copied = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(copied);
  DS_ASSERT_OK((*copied)->Pull(2));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
  EXPECT_NE(ReadFile(record).find("base-copy"), std::string::npos) << ReadFile(record);
  DS_ASSERT_OK(f.OpenLocal()->Pull(2));  // and the original still is
}

TEST(LocalGuard, AWrongBaseTheStoreCannotCheckIsComparedWithTheRecordedOne) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  // Without sidecars the store records nothing about its base.
  for (int v : {1, 2}) std::filesystem::remove(f.VersionPath(v) + "/" + kVersionManifestFileName);
  DS_ASSERT_OK(f.OpenLocal()->Pull(1));
  const std::string wrong = f.tmp.Join("wrong-base");
  WriteModel(wrong, Step(f.base_model, 5));
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.base = wrong;
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  for (std::optional<int64_t> target : {std::optional<int64_t>(1), std::optional<int64_t>()}) {
    Result<PullResult> r = (*local)->Pull(target);
    ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
    EXPECT_NE(r.status().message().find("base checkpoint " + wrong +
                                        " is not the base local checkpoint " + f.local +
                                        " was pulled from"),
              std::string::npos)
        << r.status().ToString();
  }
  EXPECT_EQ(**(*local)->CurrentVersion(), 1);
  // The recorded base itself, by another path to the same directory.
  const std::string link = f.tmp.Join("base-link");
  std::filesystem::create_directory_symlink(f.base, link);
  lo.base = link;
  auto linked = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(linked);
  DS_ASSERT_OK((*linked)->Pull(std::nullopt));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

TEST(LocalGuard, VersionZeroIsVerifiedAgainstTheStoresRecordOfTheBase) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 1);
  auto local = f.OpenLocal();
  DS_ASSERT_OK(local->Pull(0));
  DS_ASSERT_OK(local->Verify());
  // The same bytes changed in the base and in its copy, as a pull into the
  // base itself would leave them: a byte comparison with the base agrees,
  // the store's record of the base does not.
  const std::string tensor = "model.layers.0.mlp.up_proj.weight";
  for (const std::string& dir : {f.base, f.local}) {
    const std::string file = FileHolding(dir, tensor);
    FlipByte(file, TensorOffsetInFile(file, tensor) + 3);
  }
  Status s = local->Verify();
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_NE(s.message().find(tensor), std::string::npos) << s.ToString();
  // And a changed base is refused by the next reset to it.
  RemoveDir(f.local);
  Result<PullResult> r = f.OpenLocal()->Pull(0);
  EXPECT_TRUE(r.status().code() == StatusCode::kFailedPrecondition) << r.status().ToString();
}

TEST(LocalGuard, ThePullRemovesWhatAKilledWriterLeft) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  DS_ASSERT_OK(f.OpenLocal()->Pull(0));
  const std::string leftovers[] = {
      f.local + "/.model.safetensors.copy.4242.0",
      f.local + "/.model-00001-of-00002.safetensors.copy.17.3",
      f.local + "/.weight_sync/.state.json.tmp.4242.7",
      f.local + "/.weight_sync/.deltasync-base.json.tmp.1.0",
  };
  const std::string kept[] = {f.local + "/.cache", f.local + "/.model.safetensors.copy.x.0",
                              f.local + "/notes.tmp.1.2"};
  for (const std::string& p : leftovers) WriteFile(p, std::string(4096, 'x'));
  for (const std::string& p : kept) WriteFile(p, "keep");
  DS_ASSERT_OK(f.OpenLocal()->Pull(1));
  for (const std::string& p : leftovers) EXPECT_FALSE(io::PathExists(p)) << p;
  for (const std::string& p : kept) EXPECT_TRUE(io::PathExists(p)) << p;
  EXPECT_TRUE(HoldsModel(f.local, models[1]));
}

}  // namespace
}  // namespace deltasync::store_test
