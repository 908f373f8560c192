#include "deltasync/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "format/format_test_util.h"

namespace deltasync {
namespace {

using testing_util::AsBytes;
using testing_util::AsChars;
using testing_util::HasError;
using testing_util::Image;
using testing_util::ReadFileOrDie;
using testing_util::TempDir;
using testing_util::WriteFileOrDie;

// Named U8 tensors of the given byte sizes, with distinct contents.
struct Tensors {
  std::vector<std::string> storage;
  std::vector<TensorView> views;

  Tensors(std::initializer_list<std::pair<const char*, int64_t>> sizes) {
    std::mt19937 rng(42);
    for (const auto& [name, size] : sizes) {
      std::string bytes(static_cast<size_t>(size), '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      storage.push_back(std::move(bytes));
      views.push_back(TensorView{name, DType::kU8, {size}, {}});
    }
    for (size_t i = 0; i < views.size(); ++i) views[i].bytes = AsBytes(storage[i]);
  }
};

void ExpectCheckpointHolds(const Checkpoint& checkpoint, const std::vector<TensorView>& tensors) {
  ASSERT_EQ(checkpoint.tensors().size(), tensors.size());
  uint64_t total = 0;
  for (const TensorView& expected : tensors) {
    auto actual = checkpoint.Get(expected.name);
    ASSERT_TRUE(actual.ok()) << actual.status().ToString();
    EXPECT_EQ(actual->dtype, expected.dtype);
    EXPECT_EQ(actual->shape, expected.shape);
    EXPECT_EQ(AsChars(actual->bytes), AsChars(expected.bytes)) << expected.name;
    total += expected.nbytes();
  }
  EXPECT_EQ(checkpoint.total_bytes(), total);
}

// A one-shard checkpoint directory written by hand: shard.safetensors holds
// U8 tensors "a" (2 bytes) and "b" (1 byte); the index is `index_json`.
void WriteHandMadeCheckpoint(const TempDir& dir, const std::string& index_json) {
  WriteFileOrDie(dir.Join("shard.safetensors"),
                 Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                       "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}",
                       "xyz"));
  WriteFileOrDie(dir.Join(kIndexFileName), index_json);
}

// ------------------------------------------------------------- round trips

TEST(CheckpointRoundTrip, SingleFileHasNoIndex) {
  TempDir dir;
  Tensors t({{"w1", 10}, {"w2", 0}, {"w3", 7}});
  ASSERT_TRUE(WriteCheckpoint(dir.path(), t.views).ok());
  EXPECT_EQ(dir.List(), std::vector<std::string>{kSingleFileName});
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_FALSE((*checkpoint)->sharded());
  EXPECT_TRUE((*checkpoint)->index().weight_map.empty());
  ExpectCheckpointHolds(**checkpoint, t.views);
  EXPECT_EQ(*(*checkpoint)->FileOf("w3"), kSingleFileName);
  EXPECT_TRUE(HasError((*checkpoint)->FileOf("nope").status(), StatusCode::kNotFound, "'nope'"));
  EXPECT_TRUE(HasError((*checkpoint)->Get("nope").status(), StatusCode::kNotFound, "'nope'"));
}

TEST(CheckpointRoundTrip, OneSafetensorsFileOpensAsACheckpoint) {
  TempDir dir;
  Tensors t({{"x", 3}});
  ASSERT_TRUE(WriteSafetensors(dir.Join("weights.safetensors"), t.views).ok());
  auto checkpoint = Checkpoint::Open(dir.Join("weights.safetensors"));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ExpectCheckpointHolds(**checkpoint, t.views);
  EXPECT_EQ(*(*checkpoint)->FileOf("x"), "weights.safetensors");
}

TEST(CheckpointRoundTrip, ShardingFollowsTheSizeLimitForSeveralSizes) {
  // Expected shards worked out by hand from the rule: a tensor starts a new
  // shard when adding it would pass the limit and the shard is not empty.
  struct Case {
    uint64_t max_shard_bytes;
    std::vector<std::vector<std::string>> shards;
  };
  const Case cases[] = {
      {1, {{"a"}, {"b"}, {"c"}, {"d"}, {"e"}, {"f"}}},
      {100, {{"a"}, {"b", "c"}, {"d"}, {"e", "f"}}},
      {150, {{"a", "b"}, {"c"}, {"d"}, {"e", "f"}}},
      {260, {{"a", "b", "c"}, {"d", "e", "f"}}},
      {1000, {{"a", "b", "c", "d", "e", "f"}}},
      {~uint64_t{0}, {{"a", "b", "c", "d", "e", "f"}}},
  };
  Tensors t({{"a", 100}, {"b", 50}, {"c", 50}, {"d", 200}, {"e", 0}, {"f", 10}});
  for (const Case& c : cases) {
    SCOPED_TRACE("max_shard_bytes=" + std::to_string(c.max_shard_bytes));
    TempDir dir;
    CheckpointWriteOptions options;
    options.max_shard_bytes = c.max_shard_bytes;
    options.index_metadata = {{"version", "000003"}};
    ASSERT_TRUE(WriteCheckpoint(dir.path(), t.views, options).ok());

    std::vector<std::string> expected_files = {kIndexFileName};
    std::map<std::string, std::string> expected_map;
    const size_t n = c.shards.size();
    for (size_t i = 0; i < n; ++i) {
      char name[64];
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, n);
      expected_files.push_back(name);
      for (const std::string& tensor : c.shards[i]) expected_map[tensor] = name;
    }
    std::sort(expected_files.begin(), expected_files.end());
    EXPECT_EQ(dir.List(), expected_files);

    auto checkpoint = Checkpoint::Open(dir.path());
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_TRUE((*checkpoint)->sharded());
    EXPECT_EQ((*checkpoint)->index().weight_map, expected_map);
    EXPECT_EQ((*checkpoint)->index().metadata.at("version"), "000003");
    EXPECT_EQ((*checkpoint)->index().total_size(), 410u);
    EXPECT_EQ((*checkpoint)->files().size(), n);
    ExpectCheckpointHolds(**checkpoint, t.views);
    for (const auto& [tensor, file] : expected_map) EXPECT_EQ(*(*checkpoint)->FileOf(tensor), file);
  }
}

TEST(CheckpointRoundTrip, IndexIsHuggingFaceShapedWithIntegerTotalSize) {
  TempDir dir;
  Tensors t({{"a", 3}, {"b", 5}});
  CheckpointWriteOptions options;
  options.max_shard_bytes = 4;
  options.index_metadata = {{"base_version", "000001"}, {"version", "000002"}};
  ASSERT_TRUE(WriteCheckpoint(dir.path(), t.views, options).ok());
  const nlohmann::json index = nlohmann::json::parse(ReadFileOrDie(dir.Join(kIndexFileName)));
  EXPECT_EQ(index, nlohmann::json::parse(R"({
    "metadata": {"total_size": 8, "base_version": "000001", "version": "000002"},
    "weight_map": {"a": "model-00001-of-00002.safetensors",
                   "b": "model-00002-of-00002.safetensors"}})"));
  EXPECT_TRUE(index["metadata"]["total_size"].is_number_unsigned());
}

TEST(CheckpointRoundTrip, ShardMetadataFixedOrPerShard) {
  TempDir dir;
  Tensors t({{"a", 3}, {"b", 5}, {"c", 1}});
  CheckpointWriteOptions options;
  options.max_shard_bytes = 6;
  options.shard_metadata = {{"format", "pt"}};
  ASSERT_TRUE(WriteCheckpoint(dir.Join("fixed"), t.views, options).ok());
  auto fixed = Checkpoint::Open(dir.Join("fixed"));
  ASSERT_TRUE(fixed.ok()) << fixed.status().ToString();
  ASSERT_EQ((*fixed)->files().size(), 2u);
  for (const auto& file : (*fixed)->files()) {
    EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  }

  options.shard_metadata_fn = [](const std::vector<TensorView>& shard) {
    std::map<std::string, std::string> metadata;
    for (const TensorView& tensor : shard) metadata[tensor.name] = std::to_string(tensor.nbytes());
    return metadata;
  };
  ASSERT_TRUE(WriteCheckpoint(dir.Join("per_shard"), t.views, options).ok());
  auto per_shard = Checkpoint::Open(dir.Join("per_shard"));
  ASSERT_TRUE(per_shard.ok()) << per_shard.status().ToString();
  ASSERT_EQ((*per_shard)->files().size(), 2u);
  EXPECT_EQ((*per_shard)->files()[0]->metadata(), (std::map<std::string, std::string>{{"a", "3"}}));
  EXPECT_EQ((*per_shard)->files()[1]->metadata(),
            (std::map<std::string, std::string>{{"b", "5"}, {"c", "1"}}));
}

TEST(CheckpointRoundTrip, IndexFilePathOpensItsDirectory) {
  TempDir dir;
  Tensors t({{"a", 3}, {"b", 5}});
  CheckpointWriteOptions options;
  options.max_shard_bytes = 4;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), t.views, options).ok());
  auto checkpoint = Checkpoint::Open(dir.Join(kIndexFileName));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE((*checkpoint)->sharded());
  EXPECT_EQ((*checkpoint)->path(), dir.path());
  ExpectCheckpointHolds(**checkpoint, t.views);
}

TEST(CheckpointRoundTrip, NoTensorsWithShardingWritesOnlyTheIndex) {
  TempDir dir;
  CheckpointWriteOptions options;
  options.max_shard_bytes = 10;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), {}, options).ok());
  EXPECT_EQ(dir.List(), std::vector<std::string>{kIndexFileName});
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE((*checkpoint)->tensors().empty());
  EXPECT_EQ((*checkpoint)->index().total_size(), 0u);
}

TEST(CheckpointRoundTrip, RewritingAsSingleFileRemovesTheStaleIndex) {
  TempDir dir;
  Tensors old_tensors({{"old", 4}});
  Tensors new_tensors({{"new", 2}});
  CheckpointWriteOptions sharded;
  sharded.max_shard_bytes = 100;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), old_tensors.views, sharded).ok());
  ASSERT_TRUE(WriteCheckpoint(dir.path(), new_tensors.views).ok());
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_FALSE((*checkpoint)->sharded());
  ExpectCheckpointHolds(**checkpoint, new_tensors.views);
}

TEST(CheckpointRoundTrip, IndexTakesPrecedenceOverModelSafetensors) {
  TempDir dir;
  Tensors indexed({{"indexed", 4}});
  Tensors single({{"single", 2}});
  CheckpointWriteOptions sharded;
  sharded.max_shard_bytes = 100;
  ASSERT_TRUE(WriteSafetensors(dir.Join(kSingleFileName), single.views).ok());
  ASSERT_TRUE(WriteCheckpoint(dir.path(), indexed.views, sharded).ok());
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE((*checkpoint)->sharded());
  ExpectCheckpointHolds(**checkpoint, indexed.views);
}

TEST(CheckpointRoundTrip, CreatesMissingDirectories) {
  TempDir dir;
  Tensors t({{"x", 1}});
  ASSERT_TRUE(WriteCheckpoint(dir.Join("a/b/c"), t.views).ok());
  EXPECT_TRUE(Checkpoint::Open(dir.Join("a/b/c")).ok());
}

TEST(CheckpointRoundTrip, RewritingAsSingleFileReplacesAnIndexlessDirectory) {
  TempDir dir;
  Tensors old_a({{"old_a", 3}});
  Tensors old_b({{"new", 5}});  // a name the new checkpoint reuses
  ASSERT_TRUE(WriteSafetensors(dir.Join("a.safetensors"), old_a.views).ok());
  ASSERT_TRUE(WriteSafetensors(dir.Join("model-00001-of-00001.safetensors"), old_b.views).ok());
  WriteFileOrDie(dir.Join("config.json"), "{}");
  Tensors new_tensors({{"new", 2}});
  ASSERT_TRUE(WriteCheckpoint(dir.path(), new_tensors.views).ok());
  EXPECT_EQ(dir.List(), (std::vector<std::string>{"config.json", kSingleFileName}));
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ExpectCheckpointHolds(**checkpoint, new_tensors.views);
}

// ------------------------------------------------------ without an index
// vLLM and SGLang load a directory's *.safetensors by glob when it has no
// index; so do we.

TEST(CheckpointIndexless, EverySafetensorsFileOfTheDirectoryMerged) {
  TempDir dir;
  Tensors a({{"a1", 4}, {"a2", 1}});
  Tensors b({{"b1", 3}});
  Tensors c({{"c1", 2}});
  ASSERT_TRUE(WriteSafetensors(dir.Join("part-b.safetensors"), b.views).ok());
  ASSERT_TRUE(WriteSafetensors(dir.Join("part-a.safetensors"), a.views).ok());
  ASSERT_TRUE(WriteSafetensors(dir.Join("elsewhere.bin"), c.views).ok());
  std::filesystem::create_symlink(dir.Join("elsewhere.bin"), dir.Join("linked.safetensors"));
  // None of these is part of the checkpoint, though each holds tensors or
  // would fail to parse: hidden files (our writers' temporaries), names
  // that merely contain ".safetensors", a directory, a dangling link.
  Tensors hidden({{"hidden", 1}});
  ASSERT_TRUE(WriteSafetensors(dir.Join(".model.safetensors.tmp.123.0"), hidden.views).ok());
  ASSERT_TRUE(WriteSafetensors(dir.Join(".hidden.safetensors"), hidden.views).ok());
  WriteFileOrDie(dir.Join("model.safetensors.bak"), "junk");
  WriteFileOrDie(dir.Join("config.json"), "{}");
  std::filesystem::create_directory(dir.Join("sub.safetensors"));
  std::filesystem::create_symlink(dir.Join("gone"), dir.Join("dangling.safetensors"));

  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_FALSE((*checkpoint)->sharded());
  EXPECT_TRUE((*checkpoint)->index().weight_map.empty());
  std::vector<TensorView> all = a.views;
  all.insert(all.end(), b.views.begin(), b.views.end());
  all.insert(all.end(), c.views.begin(), c.views.end());
  ExpectCheckpointHolds(**checkpoint, all);
  EXPECT_EQ(*(*checkpoint)->FileOf("a2"), "part-a.safetensors");
  EXPECT_EQ(*(*checkpoint)->FileOf("b1"), "part-b.safetensors");
  EXPECT_EQ(*(*checkpoint)->FileOf("c1"), "linked.safetensors");
  std::vector<std::string> files;
  for (const auto& file : (*checkpoint)->files()) files.push_back(file->path());
  EXPECT_EQ(files, (std::vector<std::string>{dir.Join("linked.safetensors"),
                                             dir.Join("part-a.safetensors"),
                                             dir.Join("part-b.safetensors")}));
}

TEST(CheckpointIndexless, CompleteShardSetWithoutItsIndex) {
  TempDir dir;
  Tensors t({{"x", 6}, {"y", 6}, {"z", 6}});
  CheckpointWriteOptions sharded;
  sharded.max_shard_bytes = 6;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), t.views, sharded).ok());
  std::filesystem::remove(dir.Join(kIndexFileName));
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ExpectCheckpointHolds(**checkpoint, t.views);
  EXPECT_EQ(*(*checkpoint)->FileOf("z"), "model-00003-of-00003.safetensors");
}

TEST(CheckpointIndexless, TensorHeldByTwoFilesIsCorruptionNamingBoth) {
  TempDir dir;
  Tensors first({{"only_first", 1}, {"shared", 2}});
  Tensors second({{"shared", 2}, {"only_second", 1}});
  ASSERT_TRUE(WriteSafetensors(dir.Join("first.safetensors"), first.views).ok());
  ASSERT_TRUE(WriteSafetensors(dir.Join("second.safetensors"), second.views).ok());
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       dir.path() + ": tensor 'shared' appears in both 'first.safetensors' and "
                                    "'second.safetensors'"));
  // model.safetensors is no exception once another file sits beside it.
  std::filesystem::rename(dir.Join("first.safetensors"), dir.Join(kSingleFileName));
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "tensor 'shared' appears in both 'model.safetensors' and "
                       "'second.safetensors'"));
}

// What an interrupted download, or a sharded write stopped before its index,
// leaves: the names promise shards that are not there.
TEST(CheckpointIndexless, IncompleteShardSetIsCorruptionNamingTheMissingShard) {
  TempDir dir;
  Tensors t({{"x", 6}, {"y", 6}, {"z", 6}});
  CheckpointWriteOptions sharded;
  sharded.max_shard_bytes = 6;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), t.views, sharded).ok());
  std::filesystem::remove(dir.Join(kIndexFileName));
  std::filesystem::remove(dir.Join("model-00002-of-00003.safetensors"));
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       dir.path() + ": shard 'model-00002-of-00003.safetensors' is missing (2 of "
                                    "the 3 shards are here and there is no index)"));
  std::filesystem::remove(dir.Join("model-00003-of-00003.safetensors"));
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "shard 'model-00002-of-00003.safetensors' is missing (1 of the 3"));
  // Sets are told apart by prefix and count; the last shard missing counts.
  TempDir other;
  Tensors one({{"p", 1}});
  Tensors two({{"q", 1}});
  ASSERT_TRUE(WriteSafetensors(other.Join("model-00001-of-00001.safetensors"), one.views).ok());
  ASSERT_TRUE(WriteSafetensors(other.Join("extra-000001-of-000002.safetensors"), two.views).ok());
  EXPECT_TRUE(HasError(Checkpoint::Open(other.path()).status(), StatusCode::kCorruption,
                       "shard 'extra-000002-of-000002.safetensors' is missing (1 of the 2"));
  // Names that only look like shards (four digits, ordinal past the count)
  // are plain files.
  std::filesystem::rename(other.Join("extra-000001-of-000002.safetensors"),
                          other.Join("extra-0001-of-0002.safetensors"));
  Tensors three({{"r", 1}});
  ASSERT_TRUE(WriteSafetensors(other.Join("odd-00003-of-00002.safetensors"), three.views).ok());
  auto checkpoint = Checkpoint::Open(other.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ((*checkpoint)->tensors().size(), 3u);
}

TEST(CheckpointIndexless, ACorruptFileFailsTheCheckpointNamingIt) {
  TempDir dir;
  Tensors t({{"x", 1}});
  ASSERT_TRUE(WriteSafetensors(dir.Join("a.safetensors"), t.views).ok());
  WriteFileOrDie(dir.Join("b.safetensors"), "short");
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       dir.Join("b.safetensors") + ": file is 5 bytes, shorter"));
}

TEST(CheckpointIndexless, TheIndexStaysTheRuleWhenPresent) {
  TempDir dir;
  WriteHandMadeCheckpoint(dir,
                          R"({"weight_map":{"a":"shard.safetensors","b":"shard.safetensors"}})");
  Tensors unlisted({{"unlisted", 1}});
  ASSERT_TRUE(WriteSafetensors(dir.Join("unlisted.safetensors"), unlisted.views).ok());
  WriteFileOrDie(dir.Join("broken.safetensors"), "short");
  auto checkpoint = Checkpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE((*checkpoint)->sharded());
  EXPECT_EQ((*checkpoint)->tensors().size(), 2u);
  EXPECT_EQ((*checkpoint)->files().size(), 1u);
}

// ------------------------------------------------------------ write errors

TEST(CheckpointWrite, RefusesBadInputBeforeWritingAnything) {
  TempDir dir;
  Tensors dup({{"x", 1}, {"x", 2}});
  CheckpointWriteOptions sharded;
  sharded.max_shard_bytes = 1;
  EXPECT_TRUE(HasError(WriteCheckpoint(dir.Join("out"), dup.views, sharded),
                       StatusCode::kInvalidArgument, "tensor 'x' appears more than once"));
  Tensors t({{"x", 1}});
  CheckpointWriteOptions single_with_index_metadata;
  single_with_index_metadata.index_metadata = {{"version", "000001"}};
  EXPECT_TRUE(HasError(WriteCheckpoint(dir.Join("out"), t.views, single_with_index_metadata),
                       StatusCode::kInvalidArgument, "index_metadata needs an index"));
  CheckpointWriteOptions total_size;
  total_size.max_shard_bytes = 10;
  total_size.index_metadata = {{"total_size", "1"}};
  EXPECT_TRUE(HasError(WriteCheckpoint(dir.Join("out"), t.views, total_size),
                       StatusCode::kInvalidArgument, "must not set \"total_size\""));
  const std::string bytes = "abc";
  const std::vector<TensorView> mismatched = {{"m", DType::kI16, {2}, AsBytes(bytes)}};
  EXPECT_TRUE(HasError(WriteCheckpoint(dir.Join("out"), mismatched), StatusCode::kInvalidArgument,
                       "does not match 3 bytes"));
  CheckpointWriteOptions bad_utf8;
  bad_utf8.max_shard_bytes = 10;
  bad_utf8.index_metadata = {{"k", "\xff"}};
  EXPECT_TRUE(HasError(WriteCheckpoint(dir.Join("out"), t.views, bad_utf8),
                       StatusCode::kInvalidArgument, "not valid UTF-8"));
  EXPECT_TRUE(dir.List().empty());
}

// ------------------------------------------------------------- open errors

TEST(CheckpointOpen, DirectoryWithoutCheckpointIsNotFoundNamingIt) {
  TempDir dir;
  WriteFileOrDie(dir.Join("config.json"), "{}");
  // A temporary of our own writer, interrupted, is not a checkpoint.
  Tensors t({{"x", 1}});
  ASSERT_TRUE(WriteSafetensors(dir.Join(".model.safetensors.tmp.123.0"), t.views).ok());
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kNotFound,
                       dir.path() + ": neither model.safetensors.index.json nor any "
                                    "*.safetensors file exists in this directory"));
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.Join("missing")).status(), StatusCode::kNotFound,
                       "missing: no such file or directory"));
}

TEST(CheckpointOpen, IndexFileNamesMustBePlain) {
  for (std::string bad : {"sub/shard.safetensors", "../shard.safetensors", "..", ".", "", "a\\\\b",
                          "/etc/passwd", "shard\\u0000.safetensors"}) {
    SCOPED_TRACE(bad);
    TempDir dir;
    WriteHandMadeCheckpoint(dir,
                            "{\"weight_map\":{\"a\":\"shard.safetensors\",\"b\":\"" + bad + "\"}}");
    EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                         "which is not a plain file name in the checkpoint directory"));
  }
}

TEST(CheckpointOpen, ShardHoldingATensorTheIndexDoesNotList) {
  TempDir dir;
  WriteHandMadeCheckpoint(dir, "{\"weight_map\":{\"a\":\"shard.safetensors\"}}");
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "shard 'shard.safetensors' holds tensor 'b', which the index does not "
                       "list"));
}

TEST(CheckpointOpen, IndexListingATensorItsShardLacks) {
  TempDir dir;
  WriteHandMadeCheckpoint(dir, R"({"weight_map":{"a":"shard.safetensors","b":"shard.safetensors",
                                  "c":"shard.safetensors"}})");
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "lists tensor 'c' in shard 'shard.safetensors', which does not hold it"));
}

TEST(CheckpointOpen, IndexMappingATensorToTheWrongShard) {
  TempDir dir;
  WriteHandMadeCheckpoint(dir,
                          R"({"weight_map":{"a":"shard.safetensors","b":"other.safetensors"}})");
  WriteFileOrDie(dir.Join("other.safetensors"), Image("{}"));
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "tensor 'b' is in shard 'shard.safetensors' but the index maps it to "
                       "'other.safetensors'"));
}

TEST(CheckpointOpen, TensorRepeatedAcrossShards) {
  TempDir dir;
  WriteHandMadeCheckpoint(dir, R"({"weight_map":{"a":"shard.safetensors","b":"shard.safetensors",
                                  "c":"second.safetensors"}})");
  WriteFileOrDie(dir.Join("second.safetensors"),
                 Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                       "\"c\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                       "qq"));
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "tensor 'a' appears in both 'second.safetensors' and 'shard.safetensors'"));
}

TEST(CheckpointOpen, MissingOrCorruptShard) {
  TempDir dir;
  WriteHandMadeCheckpoint(dir,
                          R"({"weight_map":{"a":"shard.safetensors","b":"gone.safetensors"}})");
  EXPECT_TRUE(HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                       "lists shard 'gone.safetensors', which does not exist"));
  WriteFileOrDie(dir.Join("gone.safetensors"), "short");
  Status status = Checkpoint::Open(dir.path()).status();
  EXPECT_TRUE(HasError(status, StatusCode::kCorruption,
                       dir.Join("gone.safetensors") + ": file is 5 bytes, shorter"));
}

TEST(CheckpointOpen, MalformedIndexFiles) {
  struct Case {
    std::string json;
    std::string fragment;
  };
  const Case cases[] = {
      {"not json", "index: invalid JSON"},
      {"[]", "index is not a JSON object"},
      {"{}", "index has no \"weight_map\""},
      {R"({"weight_map":[]})", "\"weight_map\" must be an object"},
      {R"({"weight_map":{"a":1}})", "weight_map value for tensor 'a' is not a string"},
      {R"({"weight_map":{"a":null}})", "weight_map value for tensor 'a' is not a string"},
      {R"({"metadata":[],"weight_map":{}})", "\"metadata\" must be an object"},
      {R"({"weight_map":{"a":"x","a":"y"}})", "duplicate key 'a'"},
      {"{\"weight_map\":{\"\xff\":\"x\"}}", "index is not valid UTF-8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    TempDir dir;
    WriteHandMadeCheckpoint(dir, c.json);
    Status status = Checkpoint::Open(dir.path()).status();
    EXPECT_TRUE(HasError(status, StatusCode::kCorruption, c.fragment));
    EXPECT_TRUE(HasError(status, StatusCode::kCorruption, dir.Join(kIndexFileName) + ": "));
  }
}

// A NUL is not JSON whitespace; nlohmann would stop reading at it and take
// the index for valid (some tools zero-fill a file they rewrite in place).
TEST(CheckpointOpen, IndexWithTrailingNulBytes) {
  const std::string index = R"({"weight_map":{"a":"shard.safetensors","b":"shard.safetensors"}})";
  using namespace std::string_literals;
  for (std::string tail : {"\0"s, "\n\0\0\0\0"s, "\0{\"weight_map\":{}}"s}) {
    SCOPED_TRACE(::testing::PrintToString(tail));
    TempDir dir;
    WriteHandMadeCheckpoint(dir, index + tail);
    const std::string at = std::to_string(index.size() + tail.find('\0'));
    EXPECT_TRUE(
        HasError(Checkpoint::Open(dir.path()).status(), StatusCode::kCorruption,
                 dir.Join(kIndexFileName) + ": index: invalid JSON: NUL byte at offset " + at));
    EXPECT_TRUE(HasError(ParseCheckpointIndex(index + tail).status(), StatusCode::kCorruption,
                         "index: invalid JSON: NUL byte at offset " + at));
    EXPECT_EQ(ReadFileOrDie(dir.Join(kIndexFileName)), index + tail);  // left as it was
  }
  TempDir dir;
  WriteHandMadeCheckpoint(dir, index + "\n");
  EXPECT_TRUE(Checkpoint::Open(dir.path()).ok());
}

// -------------------------------------------------- index parse / serialize

TEST(CheckpointIndexTest, PlainFileNames) {
  for (std::string_view good : {"model.safetensors", "a", "...", "a..b", ".hidden", "é"}) {
    EXPECT_TRUE(IsPlainFileName(good)) << good;
  }
  const std::string_view with_nul("a\0b", 3);
  for (std::string_view bad : {std::string_view(""), std::string_view("."), std::string_view(".."),
                               std::string_view("a/b"), std::string_view("/a"),
                               std::string_view("a/"), std::string_view("a\\b"), with_nul}) {
    EXPECT_FALSE(IsPlainFileName(bad)) << ::testing::PrintToString(bad);
  }
}

TEST(CheckpointIndexTest, ParseKeepsStringAndJsonMetadataApart) {
  auto index = ParseCheckpointIndex(R"({
    "metadata": {"total_size": 123, "version": "000007", "nested": {"x": [1, 2]}},
    "weight_map": {"w": "model-00001-of-00001.safetensors"},
    "extra": "ignored"})");
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->metadata, (std::map<std::string, std::string>{{"version", "000007"}}));
  EXPECT_EQ(index->metadata_json, (std::map<std::string, std::string>{{"nested", "{\"x\":[1,2]}"},
                                                                      {"total_size", "123"}}));
  EXPECT_EQ(index->total_size(), 123u);
  EXPECT_EQ(index->weight_map.at("w"), "model-00001-of-00001.safetensors");

  for (std::string json :
       {R"({"metadata":{"total_size":"5"},"weight_map":{}})",
        R"({"metadata":{"total_size":-5},"weight_map":{}})",
        R"({"metadata":{"total_size":1.5},"weight_map":{}})", R"({"weight_map":{}})"}) {
    auto parsed = ParseCheckpointIndex(json);
    ASSERT_TRUE(parsed.ok()) << json;
    EXPECT_FALSE(parsed->total_size().has_value()) << json;
  }
}

TEST(CheckpointIndexTest, SerializeMatchesPythonJsonDumps) {
  CheckpointIndex index;
  index.metadata = {{"version", "000002"}, {"name", "caf\xc3\xa9"}};
  index.metadata_json = {{"total_size", "42"}};
  index.weight_map = {{"b.weight", "model-00002-of-00002.safetensors"},
                      {"a.weight", "model-00001-of-00002.safetensors"}};
  auto text = SerializeCheckpointIndex(index);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  // What json.dumps(index, indent=2, sort_keys=True) + "\n" prints.
  EXPECT_EQ(*text, R"({
  "metadata": {
    "name": "caf\u00e9",
    "total_size": 42,
    "version": "000002"
  },
  "weight_map": {
    "a.weight": "model-00001-of-00002.safetensors",
    "b.weight": "model-00002-of-00002.safetensors"
  }
}
)");
  auto back = ParseCheckpointIndex(*text);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->metadata, index.metadata);
  EXPECT_EQ(back->metadata_json, index.metadata_json);
  EXPECT_EQ(back->weight_map, index.weight_map);
}

TEST(CheckpointIndexTest, SerializeRefusesWhatCannotBeRead) {
  CheckpointIndex bad_json;
  bad_json.metadata_json = {{"total_size", "12 34"}};
  EXPECT_TRUE(HasError(SerializeCheckpointIndex(bad_json).status(), StatusCode::kInvalidArgument,
                       "is not valid JSON"));
  CheckpointIndex both;
  both.metadata = {{"k", "v"}};
  both.metadata_json = {{"k", "1"}};
  EXPECT_TRUE(HasError(SerializeCheckpointIndex(both).status(), StatusCode::kInvalidArgument,
                       "both a string and a JSON value"));
  CheckpointIndex bad_file;
  bad_file.weight_map = {{"t", "../x"}};
  EXPECT_TRUE(HasError(SerializeCheckpointIndex(bad_file).status(), StatusCode::kInvalidArgument,
                       "not a plain file name"));
}

}  // namespace
}  // namespace deltasync
