#include "deltasync/dtype.h"

#include <gtest/gtest.h>

#include <iterator>
#include <optional>
#include <vector>

#include "core/dtype_code.h"
#include "core/fp8_test_util.h"
#include "deltasync/tensor.h"

namespace deltasync {
namespace {

TEST(DTypeTest, SafetensorsNamesAndSizes) {
  struct Row {
    const char* name;
    size_t size;
  };
  const Row rows[] = {{"BOOL", 1},    {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1},
                      {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
                      {"BF16", 2},    {"I32", 4}, {"U32", 4}, {"F32", 4},
                      {"I64", 8},     {"U64", 8}, {"F64", 8}, {"F8_E8M0", 1}};
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
  // Types of the reference implementation that are not ours, and torch's
  // spelling of the scale type.
  for (const char* name : {"F4", "F8_E4M3FNUZ", "F8_E8M0FNU", "f8_e8m0", "C64"}) {
    EXPECT_EQ(ParseDType(name).status().code(), StatusCode::kUnsupported) << name;
  }
}

// The codes of docs/format.md ("Manifest": dtype codes), in order: frames
// and gather messages on disk and on the wire depend on none moving.
TEST(DTypeTest, WireCodesAreTheDocumentedOnes) {
  const char* const documented[] = {"BOOL", "U8",  "I8",   "F8_E4M3", "F8_E5M2", "I16",
                                    "U16",  "F16", "BF16", "I32",     "U32",     "F32",
                                    "I64",  "U64", "F64",  "F8_E8M0"};
  ASSERT_EQ(std::size(documented), static_cast<size_t>(kNumDTypes));
  for (size_t code = 0; code < std::size(documented); ++code) {
    const std::optional<DType> d = DTypeFromWireCode(static_cast<uint8_t>(code));
    ASSERT_TRUE(d.has_value()) << code;
    EXPECT_EQ(DTypeName(*d), documented[code]) << code;
    EXPECT_EQ(DTypeWireCode(*d), code) << documented[code];
  }
  EXPECT_EQ(DTypeWireCode(DType::kF8_E8M0), 15);
  for (int code = 16; code <= 255; ++code) {
    EXPECT_FALSE(DTypeFromWireCode(static_cast<uint8_t>(code)).has_value()) << code;
  }
}

TEST(DTypeTest, FloatClassification) {
  EXPECT_TRUE(DTypeIsFloat(DType::kBF16));
  EXPECT_TRUE(DTypeIsFloat(DType::kF8_E4M3));
  EXPECT_TRUE(DTypeIsFloat(DType::kF8_E5M2));
  EXPECT_TRUE(DTypeIsFloat(DType::kF8_E8M0));  // 2^(e - 127): a real value, torch's view too
  EXPECT_FALSE(DTypeIsFloat(DType::kU8));
  EXPECT_FALSE(DTypeIsFloat(DType::kI32));
  EXPECT_FALSE(DTypeIsFloat(DType::kBool));
}

// The FP8 test data's quantizer, against codes worked out by hand from the
// E4M3 and E8M0 definitions (docs/format.md, the safetensors dtypes).
TEST(Fp8TestData, QuantizesByTheDefinitions) {
  using fp8_test::E4M3Code;
  EXPECT_EQ(E4M3Code(1.0f), 0x38);
  EXPECT_EQ(E4M3Code(-1.0f), 0xB8);
  EXPECT_EQ(E4M3Code(0.0f), 0x00);
  EXPECT_EQ(E4M3Code(448.0f), 0x7E);
  EXPECT_EQ(E4M3Code(1000.0f), 0x7E);         // saturates
  EXPECT_EQ(E4M3Code(0.001953125f), 0x01);    // 2^-9, the smallest subnormal
  EXPECT_EQ(E4M3Code(1.0625f), 0x38);         // a tie: to the even code
  EXPECT_EQ(E4M3Code(1.1875f), 0x3A);         // a tie: to the even code
  EXPECT_EQ(E4M3Code(-0.3f), 0xAA);           // -0.3125
  EXPECT_EQ(fp8_test::E8M0Code(0), 0x7F);     // 1.0
  EXPECT_EQ(fp8_test::E8M0Code(-127), 0x00);  // 2^-127
  const std::vector<fp8_test::Tensor> layer = fp8_test::BlockScaledLayer("l", 1, 0);
  ASSERT_EQ(layer.size(), 3u);
  EXPECT_EQ(layer[0].dtype, DType::kF8_E4M3);
  EXPECT_EQ(layer[0].bytes.size(), 256u * 256u);
  EXPECT_EQ(layer[1].dtype, DType::kF8_E8M0);
  EXPECT_EQ(layer[1].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(layer[2].dtype, DType::kF32);
  // Weights ~N(0, 0.02) in blocks scaled to E4M3's range: scales near 2^-12.
  for (uint8_t s : layer[1].bytes) EXPECT_NEAR(s, 127 - 12, 1);
  // Block (1, 1)'s range doubles with each step: its scale rises by one.
  const std::vector<fp8_test::Tensor> next = fp8_test::BlockScaledLayer("l", 1, 1);
  EXPECT_EQ(next[1].bytes[3], layer[1].bytes[3] + 1);
  EXPECT_EQ(next[1].bytes[0], layer[1].bytes[0]);
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
