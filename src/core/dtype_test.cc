#include "deltasync/dtype.h"

#include <gtest/gtest.h>

#include "deltasync/tensor.h"

namespace deltasync {
namespace {

TEST(DTypeTest, SafetensorsNamesAndSizes) {
  struct Row {
    const char* name;
    size_t size;
  };
  const Row rows[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
                      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
                      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  ASSERT_EQ(std::size(rows), static_cast<size_t>(kNumDTypes));
  for (const Row& row : rows) {
    Result<DType> d = ParseDType(row.name);
    ASSERT_TRUE(d.ok()) << row.name;
    EXPECT_EQ(DTypeName(*d), row.name);
    EXPECT_EQ(DTypeSize(*d), row.size) << row.name;
  }
}

TEST(DTypeTest, UnknownAndWrongCaseRejected) {
  EXPECT_EQ(ParseDType("bf16").status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(ParseDType("F128").status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(ParseDType("").status().code(), StatusCode::kUnsupported);
}

TEST(DTypeTest, FloatClassification) {
  EXPECT_TRUE(DTypeIsFloat(DType::kBF16));
  EXPECT_TRUE(DTypeIsFloat(DType::kF8_E4M3));
  EXPECT_FALSE(DTypeIsFloat(DType::kI32));
  EXPECT_FALSE(DTypeIsFloat(DType::kBool));
}

TEST(TensorTest, NumelAndValidate) {
  EXPECT_EQ(*ShapeNumel({}), 1);
  EXPECT_EQ(*ShapeNumel({2, 3, 4}), 24);
  EXPECT_EQ(*ShapeNumel({5, 0}), 0);
  EXPECT_EQ(ShapeNumel({-1}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ShapeNumel({1LL << 40, 1LL << 40}).status().code(), StatusCode::kOutOfRange);

  std::vector<uint8_t> buf(12);
  TensorView v{"w", DType::kBF16, {2, 3}, buf};
  EXPECT_TRUE(v.Validate().ok());
  v.shape = {2, 2};
  EXPECT_TRUE(v.Validate().IsInvalidArgument());
  EXPECT_EQ(ShapeToString({2, 3}), "[2, 3]");
}

}  // namespace
}  // namespace deltasync
