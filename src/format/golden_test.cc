// The checked-in files under tests/golden/ (written by make_golden.py, which
// lays good files out as the reference writer does). Each corrupt file must
// produce its own error; the expectations here are stated independently of
// both the generator and the code under test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "deltasync/checkpoint.h"
#include "deltasync/safetensors.h"
#include "format/format_test_util.h"

namespace deltasync {
namespace {

using testing_util::AsBytes;
using testing_util::AsChars;
using testing_util::HasError;
using testing_util::ReadFileOrDie;
using testing_util::TempDir;

const std::string kGoldenDir = std::string(DS_SOURCE_DIR) + "/tests/golden";

std::string Golden(const std::string& name) { return kGoldenDir + "/" + name; }

struct Expected {
  const char* file;
  StatusCode code;
  const char* fragment;
};

constexpr StatusCode kCorrupt = StatusCode::kCorruption;

const Expected kCorruptFiles[] = {
    {"bad_short_file.safetensors", kCorrupt, "file is 5 bytes, shorter than the 8-byte header"},
    {"bad_header_length_past_end.safetensors", kCorrupt,
     "declared header length 1000 extends past the end of the file"},
    {"bad_header_too_large.safetensors", kCorrupt,
     "declared header length 1099511627776 exceeds the limit"},
    {"bad_empty_header.safetensors", kCorrupt, "header is empty"},
    {"bad_truncated_data.safetensors", kCorrupt,
     "tensor 'b': data_offsets [8, 12] extend past the end of the 9-byte data buffer"},
    {"bad_not_json.safetensors", kCorrupt, "header: invalid JSON"},
    {"bad_trailing_garbage.safetensors", kCorrupt, "header: invalid JSON"},
    {"bad_nul_padding.safetensors", kCorrupt, "header: invalid JSON: NUL byte at offset 53"},
    {"bad_not_utf8.safetensors", kCorrupt, "header is not valid UTF-8 (bad byte 0xff"},
    {"bad_overlong_utf8.safetensors", kCorrupt, "header is not valid UTF-8 (bad byte 0xc0"},
    {"bad_surrogate_utf8.safetensors", kCorrupt, "header is not valid UTF-8 (bad byte 0xed"},
    {"bad_top_level_array.safetensors", kCorrupt, "header is not a JSON object"},
    {"bad_leading_whitespace.safetensors", kCorrupt, "must begin with '{', found ' '"},
    {"bad_entry_not_object.safetensors", kCorrupt, "tensor 'a': entry must be a JSON object"},
    {"bad_unknown_dtype.safetensors", StatusCode::kUnsupported, "tensor 'a': unknown dtype 'Q4'"},
    {"bad_unknown_field.safetensors", kCorrupt, "tensor 'a': unknown field 'stride'"},
    {"bad_missing_field.safetensors", kCorrupt, "tensor 'a': missing field 'data_offsets'"},
    {"bad_duplicate_name.safetensors", kCorrupt, "duplicate key 'a'"},
    {"bad_duplicate_field.safetensors", kCorrupt, "duplicate key 'dtype'"},
    {"bad_shape_mismatch.safetensors", kCorrupt,
     "shape [2, 3] of F32 needs 24 bytes but data_offsets [0, 20] span 20"},
    {"bad_negative_dim.safetensors", kCorrupt, "shape dimension 0 is negative (-1)"},
    {"bad_float_dim.safetensors", kCorrupt,
     "shape dimension 0 must be a non-negative integer that fits in 64 bits, found 4.0"},
    {"bad_dim_over_int64.safetensors", kCorrupt,
     "shape dimension 0 (9223372036854775808) does not fit in int64"},
    {"bad_numel_overflow.safetensors", kCorrupt,
     "shape [4294967296, 4294967296] of U8 exceeds 2^64 bytes"},
    {"bad_negative_offset.safetensors", kCorrupt, "data_offsets[0] is negative (-4)"},
    {"bad_offset_over_64_bits.safetensors", kCorrupt,
     "data_offsets[1] must be a non-negative integer that fits in 64 bits"},
    {"bad_begin_after_end.safetensors", kCorrupt, "data_offsets [4, 0] begin after they end"},
    {"bad_offsets_out_of_bounds.safetensors", kCorrupt,
     "data_offsets [0, 100] extend past the end of the 4-byte data buffer"},
    {"bad_overlap.safetensors", kCorrupt, "tensor 'b' at [4, 12] overlaps tensor 'a' at [0, 8]"},
    {"bad_hole.safetensors", kCorrupt, "hole of 4 bytes between tensor 'a'"},
    {"bad_first_not_at_zero.safetensors", kCorrupt,
     "hole of 4 bytes at the start of the data buffer"},
    {"bad_uncovered_tail.safetensors", kCorrupt,
     "data buffer holds 8 bytes but the tensors cover only 4"},
    {"bad_metadata_not_string.safetensors", kCorrupt,
     "__metadata__ value for 'step' is not a string"},
    {"bad_metadata_not_object.safetensors", kCorrupt,
     "__metadata__ must be an object of string -> string"},
    {"bad_deep_nesting.safetensors", kCorrupt, "nested deeper than 3 levels"},
};

const Expected kCorruptCheckpoints[] = {
    {"bad_index_slash", kCorrupt,
     "maps tensor 'lm_head.weight' to 'sub/model-00002-of-00002.safetensors', which is not a "
     "plain file name"},
    {"bad_index_dotdot", kCorrupt, "to '..', which is not a plain file name"},
    {"bad_index_not_string", kCorrupt,
     "weight_map value for tensor 'lm_head.weight' is not a string"},
    {"bad_index_missing_shard", kCorrupt,
     "lists shard 'model-00003-of-00003.safetensors', which does not exist"},
    {"bad_index_unlisted_tensor", kCorrupt,
     "holds tensor 'model.norm.weight', which the index does not list"},
    {"bad_index_tensor_not_in_shard", kCorrupt,
     "lists tensor 'model.extra.weight' in shard 'model-00002-of-00002.safetensors', which does "
     "not hold it"},
    {"bad_index_wrong_shard", kCorrupt,
     "tensor 'model.norm.weight' is in shard 'model-00001-of-00002.safetensors' but the index "
     "maps it to 'model-00002-of-00002.safetensors'"},
    {"bad_index_duplicate_across_shards", kCorrupt,
     "tensor 'model.norm.weight' appears in both 'model-00001-of-00002.safetensors' and "
     "'model-00002-of-00002.safetensors'"},
    {"bad_index_trailing_nul", kCorrupt, "index: invalid JSON: NUL byte at offset 248"},
    {"bad_unindexed_duplicate", kCorrupt,
     "tensor 'model.norm.weight' appears in both 'extra.safetensors' and "
     "'model-00001-of-00002.safetensors'"},
    {"bad_unindexed_missing_shard", kCorrupt,
     "shard 'model-00001-of-00002.safetensors' is missing (1 of the 2 shards are here and there "
     "is no index)"},
    {"bad_no_checkpoint", StatusCode::kNotFound,
     "neither model.safetensors.index.json nor any *.safetensors file exists in this directory"},
};

TEST(GoldenFiles, EachCorruptFileGivesItsError) {
  for (const Expected& e : kCorruptFiles) {
    SCOPED_TRACE(e.file);
    const std::string path = Golden(e.file);
    Status status = SafetensorsFile::Open(path).status();
    EXPECT_TRUE(HasError(status, e.code, e.fragment));
    EXPECT_EQ(status.message().rfind(path + ": ", 0), 0u) << status.ToString();
    // The in-memory reader applies the very same rules.
    const std::string bytes = ReadFileOrDie(path);
    EXPECT_EQ(SafetensorsFile::OpenMemory(path, AsBytes(bytes)).status().ToString(),
              status.ToString());
  }
}

TEST(GoldenFiles, EachCorruptCheckpointGivesItsError) {
  for (const Expected& e : kCorruptCheckpoints) {
    SCOPED_TRACE(e.file);
    const std::string dir = Golden(std::string("checkpoints/") + e.file);
    Status status = Checkpoint::Open(dir).status();
    EXPECT_TRUE(HasError(status, e.code, e.fragment));
    EXPECT_EQ(status.message().rfind(dir, 0), 0u) << status.ToString();
  }
}

// A golden file nobody checks, or one the README does not document, is a
// gap: every file on disk must be in a table above (or a good one) and in
// README.md.
TEST(GoldenFiles, EveryFileIsTestedAndDocumented) {
  const std::string readme = ReadFileOrDie(Golden("README.md"));
  std::set<std::string> tested;
  for (const Expected& e : kCorruptFiles) tested.insert(e.file);
  for (const Expected& e : kCorruptCheckpoints) tested.insert(std::string("checkpoints/") + e.file);
  for (const char* good :
       {"good_all_dtypes.safetensors", "good_empty.safetensors",
        "good_scalar_and_empty.safetensors", "good_pretty_unsorted.safetensors",
        "checkpoints/good_sharded", "checkpoints/good_single", "checkpoints/good_unindexed"}) {
    tested.insert(good);
  }
  std::set<std::string> on_disk;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldenDir)) {
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() == ".safetensors") on_disk.insert(name);
  }
  for (const auto& entry : std::filesystem::directory_iterator(Golden("checkpoints"))) {
    on_disk.insert("checkpoints/" + entry.path().filename().string());
  }
  EXPECT_EQ(on_disk, tested);
  for (const std::string& name : on_disk) {
    const std::string base = std::filesystem::path(name).filename().string();
    EXPECT_NE(readme.find("`" + base + "`"), std::string::npos) << name << " not in README.md";
  }
}

template <typename T>
std::vector<T> Values(const TensorView& tensor) {
  std::vector<T> out(tensor.nbytes() / sizeof(T));
  std::memcpy(out.data(), tensor.bytes.data(), tensor.nbytes());
  return out;
}

TEST(GoldenFiles, AllDTypesHoldTheirKnownValues) {
  auto file = SafetensorsFile::Open(Golden("good_all_dtypes.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const SafetensorsFile& f = **file;
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(f.tensors().size(), static_cast<size_t>(kNumDTypes));
  auto get = [&](const char* name, DType dtype, std::vector<int64_t> shape) {
    Result<TensorView> t = f.Get(name);
    EXPECT_TRUE(t.ok()) << name;
    if (!t.ok()) return TensorView{};
    EXPECT_EQ(t->dtype, dtype) << name;
    EXPECT_EQ(t->shape, shape) << name;
    return *t;
  };
  EXPECT_EQ(Values<uint8_t>(get("t_bool", DType::kBool, {3})), (std::vector<uint8_t>{1, 0, 1}));
  EXPECT_EQ(Values<uint8_t>(get("t_u8", DType::kU8, {2, 2})),
            (std::vector<uint8_t>{0, 1, 254, 255}));
  EXPECT_EQ(Values<int8_t>(get("t_i8", DType::kI8, {3})), (std::vector<int8_t>{-128, -1, 127}));
  EXPECT_EQ(Values<uint8_t>(get("t_f8_e4m3", DType::kF8_E4M3, {2})),
            (std::vector<uint8_t>{0x38, 0xB8}));
  EXPECT_EQ(Values<uint8_t>(get("t_f8_e5m2", DType::kF8_E5M2, {2})),
            (std::vector<uint8_t>{0x3C, 0x7C}));
  EXPECT_EQ(Values<uint8_t>(get("t_f8_e8m0", DType::kF8_E8M0, {4})),
            (std::vector<uint8_t>{0x7F, 0x00, 0xFE, 0xFF}));  // 1.0, 2^-127, 2^127, NaN
  EXPECT_EQ(Values<int16_t>(get("t_i16", DType::kI16, {2})), (std::vector<int16_t>{-2, 32767}));
  EXPECT_EQ(Values<uint16_t>(get("t_u16", DType::kU16, {2})), (std::vector<uint16_t>{1, 65535}));
  EXPECT_EQ(Values<uint16_t>(get("t_f16", DType::kF16, {2})),
            (std::vector<uint16_t>{0x3C00, 0xC000}));  // 1.0, -2.0
  EXPECT_EQ(Values<uint16_t>(get("t_bf16", DType::kBF16, {2})),
            (std::vector<uint16_t>{0x3F80, 0xC020}));  // 1.0, -2.5
  EXPECT_EQ(Values<int32_t>(get("t_i32", DType::kI32, {2})),
            (std::vector<int32_t>{-7, 2147483647}));
  EXPECT_EQ(Values<uint32_t>(get("t_u32", DType::kU32, {1})), (std::vector<uint32_t>{4294967295u}));
  EXPECT_EQ(Values<uint32_t>(get("t_f32", DType::kF32, {2, 2})),
            (std::vector<uint32_t>{0x3F800000, 0xC0200000, 0x00000000, 0x80000000}));
  EXPECT_EQ(Values<int64_t>(get("t_i64", DType::kI64, {1})), (std::vector<int64_t>{INT64_MIN}));
  EXPECT_EQ(Values<uint64_t>(get("t_u64", DType::kU64, {1})), (std::vector<uint64_t>{UINT64_MAX}));
  EXPECT_EQ(Values<uint64_t>(get("t_f64", DType::kF64, {2})),
            (std::vector<uint64_t>{0x400921FB54442D18, 0x7FF8000000000001}));  // pi, NaN payload
}

TEST(GoldenFiles, OtherGoodFiles) {
  auto empty = SafetensorsFile::Open(Golden("good_empty.safetensors"));
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE((*empty)->tensors().empty());
  EXPECT_EQ((*empty)->file_size(), 16u);

  auto mixed = SafetensorsFile::Open(Golden("good_scalar_and_empty.safetensors"));
  ASSERT_TRUE(mixed.ok()) << mixed.status().ToString();
  EXPECT_EQ(mixed->get()->Get("scalar")->shape, std::vector<int64_t>{});
  EXPECT_EQ(Values<float>(*mixed->get()->Get("scalar")), std::vector<float>{0.5f});
  EXPECT_EQ(mixed->get()->Get("empty")->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(mixed->get()->Get("empty")->bytes.empty());
  EXPECT_EQ(AsChars(mixed->get()->Get("bytes")->bytes), "\x07\x08\x09");

  auto pretty = SafetensorsFile::Open(Golden("good_pretty_unsorted.safetensors"));
  ASSERT_TRUE(pretty.ok()) << pretty.status().ToString();
  ASSERT_EQ((*pretty)->tensors().size(), 2u);
  EXPECT_EQ((*pretty)->tensors()[0].name, "z_first");  // data order, not name order
  EXPECT_EQ(AsChars((*pretty)->tensors()[0].bytes), "\x0a\x14");
  EXPECT_EQ(AsChars((*pretty)->tensors()[1].bytes), "\x1e\x28");
}

// Our writer lays files out exactly as the reference writer does, so
// rewriting a reference-layout file reproduces it byte for byte.
TEST(GoldenFiles, RewritingReferenceLayoutFilesIsByteIdentical) {
  TempDir dir;
  for (const char* name : {"good_all_dtypes.safetensors", "good_empty.safetensors",
                           "good_scalar_and_empty.safetensors"}) {
    SCOPED_TRACE(name);
    auto file = SafetensorsFile::Open(Golden(name));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ASSERT_TRUE(WriteSafetensors(dir.Join(name), (*file)->tensors(), (*file)->metadata()).ok());
    EXPECT_EQ(ReadFileOrDie(dir.Join(name)), ReadFileOrDie(Golden(name)));
  }
}

TEST(GoldenFiles, GoodCheckpoints) {
  auto sharded = Checkpoint::Open(Golden("checkpoints/good_sharded"));
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_TRUE((*sharded)->sharded());
  EXPECT_EQ((*sharded)->tensors().size(), 3u);
  EXPECT_EQ((*sharded)->total_bytes(), 28u);
  EXPECT_EQ((*sharded)->index().total_size(), 28u);
  EXPECT_EQ((*sharded)->index().metadata.at("version"), "000007");
  EXPECT_EQ(*(*sharded)->FileOf("lm_head.weight"), "model-00002-of-00002.safetensors");
  EXPECT_EQ(Values<float>(*(*sharded)->Get("model.embed.weight")),
            (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
  // The index was written by Python's json.dumps(indent=2, sort_keys=True):
  // serializing what we parsed must give the same bytes.
  const std::string index_path = Golden("checkpoints/good_sharded/model.safetensors.index.json");
  auto text = SerializeCheckpointIndex((*sharded)->index());
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, ReadFileOrDie(index_path));

  auto single = Checkpoint::Open(Golden("checkpoints/good_single"));
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  EXPECT_FALSE((*single)->sharded());
  ASSERT_EQ((*single)->tensors().size(), 3u);
  for (const auto& [name, tensor] : (*single)->tensors()) {
    EXPECT_EQ(AsChars(tensor.bytes), AsChars((*sharded)->Get(name)->bytes)) << name;
  }

  auto unindexed = Checkpoint::Open(Golden("checkpoints/good_unindexed"));
  ASSERT_TRUE(unindexed.ok()) << unindexed.status().ToString();
  EXPECT_FALSE((*unindexed)->sharded());
  EXPECT_EQ((*unindexed)->files().size(), 2u);
  ASSERT_EQ((*unindexed)->tensors().size(), 3u);
  for (const auto& [name, tensor] : (*unindexed)->tensors()) {
    EXPECT_EQ(AsChars(tensor.bytes), AsChars((*sharded)->Get(name)->bytes)) << name;
    EXPECT_EQ(*(*unindexed)->FileOf(name), *(*sharded)->FileOf(name)) << name;
  }
}

}  // namespace
}  // namespace deltasync
