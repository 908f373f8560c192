#include "deltasync/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_test_util.h"
#include "format/format_test_util.h"
#include "format/json_util.h"

namespace deltasync {
namespace {

using testing_util::AsBytes;
using testing_util::AsChars;
using testing_util::HasError;
using testing_util::Image;
using testing_util::ImageWithLength;
using testing_util::ReadFileOrDie;
using testing_util::TempDir;
using testing_util::WriteFileOrDie;

const DType kAllDTypes[] = {DType::kBool,    DType::kU8,  DType::kI8,  DType::kF8_E4M3,
                            DType::kF8_E5M2, DType::kI16, DType::kU16, DType::kF16,
                            DType::kBF16,    DType::kI32, DType::kU32, DType::kF32,
                            DType::kI64,     DType::kU64, DType::kF64, DType::kF8_E8M0};

// Owns tensor bytes so that views can point at them.
struct OwnedTensors {
  std::vector<std::string> storage;
  std::vector<TensorView> views;

  void Add(std::string name, DType dtype, std::vector<int64_t> shape, uint32_t seed) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    std::string bytes(static_cast<size_t>(numel) * DTypeSize(dtype), '\0');
    std::mt19937 rng(seed);
    for (char& c : bytes) c = static_cast<char>(rng());
    storage.push_back(std::move(bytes));
    views.push_back(TensorView{std::move(name), dtype, std::move(shape), {}});
  }
  // Views are fixed up last: `storage` may reallocate while adding.
  const std::vector<TensorView>& Finish() {
    for (size_t i = 0; i < views.size(); ++i) views[i].bytes = AsBytes(storage[i]);
    return views;
  }
};

void ExpectSameTensor(const TensorView& actual, const TensorView& expected) {
  EXPECT_EQ(actual.name, expected.name);
  EXPECT_EQ(actual.dtype, expected.dtype) << expected.name;
  EXPECT_EQ(actual.shape, expected.shape) << expected.name;
  EXPECT_EQ(AsChars(actual.bytes), AsChars(expected.bytes)) << expected.name;
}

// Opens `bytes` from a file, checks that the message names the file and
// that an in-memory open of the same bytes reports the same error.
Status OpenBytes(const TempDir& dir, std::string_view bytes) {
  const std::string path = dir.Join("input.safetensors");
  WriteFileOrDie(path, bytes);
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  Result<std::unique_ptr<SafetensorsFile>> memory =
      SafetensorsFile::OpenMemory(path, AsBytes(bytes));
  EXPECT_EQ(file.status().ToString(), memory.status().ToString());
  if (!file.ok()) {
    EXPECT_EQ(file.status().message().rfind(path + ": ", 0), 0u)
        << "message does not start with the path: " << file.status().ToString();
  }
  return file.status();
}

std::string U8Entry(std::string_view name, uint64_t begin, uint64_t end) {
  return "\"" + std::string(name) + "\":{\"dtype\":\"U8\",\"shape\":[" +
         std::to_string(end - begin) + "],\"data_offsets\":[" + std::to_string(begin) + "," +
         std::to_string(end) + "]}";
}

// ---------------------------------------------------------------- round trips

TEST(SafetensorsRoundTrip, EveryDTypeScalarsAndZeroSizeTensors) {
  TempDir dir;
  OwnedTensors owned;
  uint32_t seed = 1;
  for (DType dtype : kAllDTypes) {
    const std::string name = "t." + std::string(DTypeName(dtype));
    owned.Add(name + ".matrix", dtype, {3, 5}, seed++);
    owned.Add(name + ".scalar", dtype, {}, seed++);
    owned.Add(name + ".empty", dtype, {4, 0, 2}, seed++);
  }
  const std::vector<TensorView>& tensors = owned.Finish();
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"quoted \"key\"", "line\nbreak\ttab \\ \x01 \xc3\xa9"}};
  const std::string path = dir.Join("all.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->metadata(), metadata);
  ASSERT_EQ((*file)->tensors().size(), tensors.size());
  // Data offsets follow the given order.
  uint64_t offset = 0;
  for (const TensorView& expected : tensors) {
    auto actual = (*file)->Get(expected.name);
    ASSERT_TRUE(actual.ok()) << actual.status().ToString();
    ExpectSameTensor(*actual, expected);
    EXPECT_EQ(static_cast<uint64_t>(actual->bytes.data() - (*file)->data().data()), offset)
        << expected.name;
    offset += expected.nbytes();
  }
  EXPECT_EQ((*file)->data().size(), offset);
  EXPECT_EQ((*file)->file_size(), 8 + (*file)->header_size() + offset);
}

// A block-scaled FP8 layer (E4M3 weights, E8M0 block scales, an F32
// per-tensor scale): the file written is byte for byte the one built by
// hand from the format's rules, and reading either gives back every bit.
TEST(SafetensorsRoundTrip, BlockScaledFp8LayerKeepsEveryBit) {
  TempDir dir;
  const std::vector<fp8_test::Tensor> layer = fp8_test::BlockScaledLayer("mlp", 11, 0);
  // Names in sorted order, so that the reference writer's order is this too.
  ASSERT_EQ(layer[0].name, "mlp.weight");
  ASSERT_EQ(layer[1].name, "mlp.weight_scale_inv");
  ASSERT_EQ(layer[2].name, "mlp.input_scale");
  const std::string header =
      "{\"mlp.input_scale\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
      "\"mlp.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[256,256],\"data_offsets\":[4,65540]},"
      "\"mlp.weight_scale_inv\":{\"dtype\":\"F8_E8M0\",\"shape\":[2,2],"
      "\"data_offsets\":[65540,65544]}}";
  std::string data;
  for (const fp8_test::Tensor* t : {&layer[2], &layer[0], &layer[1]}) {
    data.append(t->bytes.begin(), t->bytes.end());
  }
  const std::string expected_image = Image(header, data);

  std::vector<TensorView> views;
  for (const fp8_test::Tensor* t : {&layer[2], &layer[0], &layer[1]}) {
    views.push_back(TensorView{t->name, t->dtype, t->shape, t->bytes});
  }
  const std::string written = dir.Join("written.safetensors");
  ASSERT_TRUE(WriteSafetensors(written, views).ok());
  EXPECT_EQ(ReadFileOrDie(written), expected_image);

  const std::string by_hand = dir.Join("by_hand.safetensors");
  WriteFileOrDie(by_hand, expected_image);
  for (const std::string& path : {written, by_hand}) {
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ASSERT_EQ((*file)->tensors().size(), 3u);
    for (const fp8_test::Tensor& t : layer) {
      Result<TensorView> got = (*file)->Get(t.name);
      ASSERT_TRUE(got.ok()) << path << ": " << got.status().ToString();
      EXPECT_EQ(got->dtype, t.dtype) << t.name;
      EXPECT_EQ(got->shape, t.shape) << t.name;
      EXPECT_EQ(AsChars(got->bytes), AsChars(t.bytes)) << path << ": " << t.name;
    }
  }
}

TEST(SafetensorsRoundTrip, HeaderIsPaddedWithSpacesToEightBytes) {
  TempDir dir;
  for (int name_length = 1; name_length <= 9; ++name_length) {
    OwnedTensors owned;
    owned.Add(std::string(name_length, 'x'), DType::kF32, {3}, 7);
    const std::string path = dir.Join("p.safetensors");
    ASSERT_TRUE(WriteSafetensors(path, owned.Finish()).ok());
    const std::string bytes = ReadFileOrDie(path);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
    EXPECT_EQ((8 + n) % 8, 0u) << name_length;
    ASSERT_EQ(bytes.size(), 8 + n + 12);
    EXPECT_EQ(bytes[8], '{');
    const std::string header = bytes.substr(8, n);
    const size_t close = header.rfind('}');
    EXPECT_LT(header.size() - close - 1, 8u);
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << header;
  }
}

TEST(SafetensorsRoundTrip, MetadataKeyOnlyWhenNonEmpty) {
  TempDir dir;
  OwnedTensors owned;
  owned.Add("w", DType::kBF16, {2}, 3);
  ASSERT_TRUE(WriteSafetensors(dir.Join("a"), owned.Finish()).ok());
  EXPECT_EQ(ReadFileOrDie(dir.Join("a")).find("__metadata__"), std::string::npos);
  ASSERT_TRUE(WriteSafetensors(dir.Join("b"), owned.Finish(), {{"k", "v"}}).ok());
  EXPECT_NE(ReadFileOrDie(dir.Join("b")).find("\"__metadata__\":{\"k\":\"v\"}"), std::string::npos);
}

TEST(SafetensorsRoundTrip, EmptyFileHasHeaderOfEmptyObject) {
  TempDir dir;
  const std::string path = dir.Join("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {}).ok());
  EXPECT_EQ(ReadFileOrDie(path), Image("{}"));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE((*file)->tensors().empty());
  EXPECT_TRUE((*file)->metadata().empty());
  EXPECT_TRUE((*file)->data().empty());
}

TEST(SafetensorsRoundTrip, LargeTensorPastTheWriteBuffer) {
  TempDir dir;
  OwnedTensors owned;
  owned.Add("small", DType::kU8, {5}, 1);
  owned.Add("big", DType::kF32, {3, 1 << 18}, 2);  // 3 MiB
  owned.Add("tail", DType::kI64, {3}, 3);
  const auto& tensors = owned.Finish();
  ASSERT_TRUE(WriteSafetensors(dir.Join("big"), tensors).ok());
  auto file = SafetensorsFile::Open(dir.Join("big"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  for (const TensorView& t : tensors) ExpectSameTensor(*(*file)->Get(t.name), t);
}

TEST(SafetensorsRoundTrip, StreamingAppendsInAnyChunkingMatchWholeWrite) {
  TempDir dir;
  OwnedTensors owned;
  owned.Add("a", DType::kF16, {7, 3}, 11);
  owned.Add("b", DType::kU8, {0}, 12);
  owned.Add("c", DType::kF64, {5}, 13);
  const auto& tensors = owned.Finish();
  ASSERT_TRUE(WriteSafetensors(dir.Join("whole"), tensors, {{"m", "1"}}).ok());

  std::string all;
  std::vector<TensorSpec> specs;
  for (const TensorView& t : tensors) {
    specs.push_back({t.name, t.dtype, t.shape});
    all.append(AsChars(t.bytes));
  }
  auto writer = SafetensorsWriter::Create(dir.Join("streamed"), specs, {{"m", "1"}});
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_EQ((*writer)->expected_bytes(), all.size());
  // Chunks that straddle tensor boundaries, including empty ones.
  size_t pos = 0, chunk = 0;
  while (pos < all.size()) {
    const size_t n = std::min(all.size() - pos, chunk++ % 9);
    ASSERT_TRUE((*writer)->Append(AsBytes(std::string_view(all).substr(pos, n))).ok());
    pos += n;
  }
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ(ReadFileOrDie(dir.Join("streamed")), ReadFileOrDie(dir.Join("whole")));
}

TEST(SafetensorsRoundTrip, ReplacingAFileLeavesNoTemporaries) {
  TempDir dir;
  OwnedTensors first, second;
  first.Add("a", DType::kU8, {4}, 1);
  second.Add("b", DType::kI32, {2}, 2);
  const std::string path = dir.Join("x.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, first.Finish()).ok());
  ASSERT_TRUE(WriteSafetensors(path, second.Finish()).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  ASSERT_EQ((*file)->tensors().size(), 1u);
  ExpectSameTensor((*file)->tensors()[0], second.views[0]);
  EXPECT_EQ(dir.List(), std::vector<std::string>{"x.safetensors"});
}

TEST(SafetensorsRoundTrip, ViewsPointIntoTheImageWithoutCopying) {
  std::string image = Image("{" + U8Entry("a", 0, 3) + "," + U8Entry("b", 3, 5) + "}", "hello");
  auto file = SafetensorsFile::OpenMemory("mem", AsBytes(image));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const auto data_begin = reinterpret_cast<const uint8_t*>(image.data()) + image.size() - 5;
  EXPECT_EQ((*file)->Get("a")->bytes.data(), data_begin);
  EXPECT_EQ((*file)->Get("b")->bytes.data(), data_begin + 3);
  EXPECT_EQ(AsChars((*file)->Get("b")->bytes), "lo");

  TempDir dir;
  WriteFileOrDie(dir.Join("f"), image);
  auto mapped = SafetensorsFile::Open(dir.Join("f"));
  ASSERT_TRUE(mapped.ok());
  const TensorView& a = (*mapped)->tensors()[0];
  EXPECT_EQ(a.bytes.data(), (*mapped)->data().data());
  EXPECT_EQ(AsChars(a.bytes), "hel");
  // Hints of every kind leave the bytes readable; foreign spans are ignored.
  for (AccessHint hint : {AccessHint::kSequential, AccessHint::kRandom, AccessHint::kWillNeed,
                          AccessHint::kDontNeed, AccessHint::kNormal}) {
    (*mapped)->Advise(hint);
    (*mapped)->Advise(hint, a.bytes);
    (*mapped)->Advise(hint, AsBytes(image));
  }
  EXPECT_EQ(AsChars((*mapped)->Get("b")->bytes), "lo");
}

TEST(SafetensorsRoundTrip, GetOfMissingTensorIsNotFound) {
  std::string image = Image("{" + U8Entry("a", 0, 1) + "}", "x");
  auto file = SafetensorsFile::OpenMemory("mem.safetensors", AsBytes(image));
  ASSERT_TRUE(file.ok());
  EXPECT_TRUE(HasError((*file)->Get("b").status(), StatusCode::kNotFound, "no tensor named 'b'"));
}

// ------------------------------------------------------------ what is accepted

TEST(SafetensorsAccepts, TrailingWhitespaceOfAnyJsonKind) {
  const std::string header = "{" + U8Entry("a", 0, 2) + "}";
  for (std::string tail : {"", " ", "      ", "\n", "\t\r\n "}) {
    auto file = SafetensorsFile::OpenMemory("m", AsBytes(Image(header + tail, "ab", false)));
    EXPECT_TRUE(file.ok()) << file.status().ToString();
  }
}

TEST(SafetensorsAccepts, ZeroSizeTensorsAnywhereIncludingSharedOffsets) {
  const std::string header = "{" + U8Entry("z0", 0, 0) + "," + U8Entry("a", 0, 2) + "," +
                             U8Entry("z1", 2, 2) + "," + U8Entry("z2", 2, 2) + "," +
                             U8Entry("b", 2, 3) + "," + U8Entry("z3", 3, 3) + "}";
  const std::string image = Image(header, "abc");
  auto file = SafetensorsFile::OpenMemory("m", AsBytes(image));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::vector<std::string> order;
  for (const TensorView& t : (*file)->tensors()) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"z0", "a", "z1", "z2", "b", "z3"}));
  EXPECT_TRUE((*file)->Get("z3")->bytes.empty());
}

TEST(SafetensorsAccepts, HeaderExactlyAtTheCap) {
  std::string header = "{}";
  header.resize(kMaxSafetensorsHeaderBytes, ' ');
  const std::string image = ImageWithLength(header.size(), header);
  auto file = SafetensorsFile::OpenMemory("m", AsBytes(image));
  EXPECT_TRUE(file.ok()) << file.status().ToString();
}

TEST(SafetensorsAccepts, ParseHeaderDirectly) {
  const std::string header =
      "{\"__metadata__\":{\"k\":\"v\"}," + U8Entry("b", 2, 4) + "," + U8Entry("a", 0, 2) + "}";
  auto parsed = ParseSafetensorsHeader(AsBytes(header), 4);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->entries.size(), 2u);
  EXPECT_EQ(parsed->entries[0].name, "a");
  EXPECT_EQ(parsed->entries[1].begin, 2u);
  EXPECT_EQ(parsed->entries[1].end, 4u);
  EXPECT_EQ(parsed->metadata.at("k"), "v");
  // Same header against a different data size is wrong in both directions.
  EXPECT_TRUE(HasError(ParseSafetensorsHeader(AsBytes(header), 5).status(), StatusCode::kCorruption,
                       "cover only 4"));
  EXPECT_TRUE(HasError(ParseSafetensorsHeader(AsBytes(header), 3).status(), StatusCode::kCorruption,
                       "extend past the end"));
}

// ---------------------------------------------------------- what is rejected
// One test per rule; each checks the code and the part of the message that
// only that rule produces.

TEST(SafetensorsRejects, FileShorterThanTheLengthPrefix) {
  TempDir dir;
  for (size_t n : {0, 1, 7}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, std::string(n, '\0')), StatusCode::kCorruption,
                         "shorter than the 8-byte header length prefix"));
  }
}

TEST(SafetensorsRejects, LengthPrefixPastTheEnd) {
  TempDir dir;
  const std::string header = "{}";
  EXPECT_TRUE(HasError(OpenBytes(dir, ImageWithLength(3, header)), StatusCode::kCorruption,
                       "declared header length 3 extends past the end of the file"));
  EXPECT_TRUE(HasError(OpenBytes(dir, ImageWithLength(1, "")), StatusCode::kCorruption,
                       "extends past the end of the file"));
}

TEST(SafetensorsRejects, DeclaredHeaderOverTheCap) {
  TempDir dir;
  for (uint64_t n : {kMaxSafetensorsHeaderBytes + 1, uint64_t{1} << 40, ~uint64_t{0}}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, ImageWithLength(n, "{}")), StatusCode::kCorruption,
                         "exceeds the limit of 104857600 bytes"));
  }
}

TEST(SafetensorsRejects, TruncatedFile) {
  TempDir dir;
  const std::string whole =
      Image("{" + U8Entry("a", 0, 4) + "," + U8Entry("b", 4, 8) + "}", "abcdefgh");
  EXPECT_TRUE(HasError(OpenBytes(dir, whole.substr(0, whole.size() - 1)), StatusCode::kCorruption,
                       "tensor 'b': data_offsets [4, 8] extend past the end of the 7-byte data "
                       "buffer (file truncated?)"));
  // Cut inside the header.
  EXPECT_TRUE(HasError(OpenBytes(dir, whole.substr(0, 20)), StatusCode::kCorruption,
                       "extends past the end of the file (20 bytes; truncated?)"));
}

TEST(SafetensorsRejects, EmptyHeader) {
  TempDir dir;
  EXPECT_TRUE(
      HasError(OpenBytes(dir, ImageWithLength(0, "")), StatusCode::kCorruption, "header is empty"));
}

TEST(SafetensorsRejects, NonJsonHeader) {
  TempDir dir;
  for (std::string header : {"{not json}", "{\"a\":}", "{} {}", "{\"a\":1", "{} x"}) {
    EXPECT_TRUE(
        HasError(OpenBytes(dir, Image(header)), StatusCode::kCorruption, "header: invalid JSON"))
        << header;
  }
}

// docs/format.md allows only JSON whitespace after the object. A NUL is
// not whitespace, and a parser that stops at it would also skip whatever
// follows (here a second object that could hide tensors from one reader).
TEST(SafetensorsRejects, NulBytesInTheHeaderPadding) {
  TempDir dir;
  const std::string header = "{" + U8Entry("a", 0, 2) + "}";
  const std::string at = std::to_string(header.size());
  using namespace std::string_literals;
  for (std::string tail : {"\0"s, "\0\0\0\0\0\0\0"s, "\0   "s, "\0{\"b\":1}"s}) {
    SCOPED_TRACE(::testing::PrintToString(tail));
    EXPECT_TRUE(HasError(OpenBytes(dir, Image(header + tail, "ab", false)), StatusCode::kCorruption,
                         "header: invalid JSON: NUL byte at offset " + at +
                             " (only space, tab, CR and LF may follow a JSON value)"));
  }
  // After whitespace padding too: the offset is the NUL's.
  EXPECT_TRUE(
      HasError(OpenBytes(dir, Image(header + "  \0"s, "ab", false)), StatusCode::kCorruption,
               "header: invalid JSON: NUL byte at offset " + std::to_string(header.size() + 2)));
  // Refusing changes nothing: the file is still there, byte for byte.
  const std::string bad = Image(header + "\0"s, "ab", false);
  ASSERT_FALSE(OpenBytes(dir, bad).ok());
  EXPECT_EQ(ReadFileOrDie(dir.Join("input.safetensors")), bad);
}

TEST(SafetensorsRejects, NonUtf8Header) {
  TempDir dir;
  // Invalid inside a string, and invalid where JSON allows no byte at all.
  for (std::string bad : {"\xff", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"__metadata__\":{\"k\":\"" + bad + "\"}}")),
                         StatusCode::kCorruption, "header is not valid UTF-8"));
  }
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{}\x80")), StatusCode::kCorruption,
                       "not valid UTF-8 (bad byte 0x80 at header offset 2)"));
}

TEST(SafetensorsRejects, TopLevelNotAnObject) {
  TempDir dir;
  for (std::string header : {"[1, 2]", "\"s\"", "42", "null", " {}", "\n{}"}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, Image(header)), StatusCode::kCorruption,
                         "header is not a JSON object: it must begin with '{'"))
        << header;
  }
}

TEST(SafetensorsRejects, UnknownDType) {
  TempDir dir;
  for (std::string dtype : {"F128", "bf16", "", "C64"}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"a\":{\"dtype\":\"" + dtype +
                                                  "\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                                              "x")),
                         StatusCode::kUnsupported, "tensor 'a': unknown dtype '" + dtype + "'"));
  }
}

TEST(SafetensorsRejects, ShapeTimesElementSizeDiffersFromByteRange) {
  TempDir dir;
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}",
                           std::string(20, '\0'))),
      StatusCode::kCorruption,
      "shape [2, 3] of F32 needs 24 bytes but data_offsets [0, 20] span 20"));
  // A scalar needs one element.
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,0]}}")),
      StatusCode::kCorruption, "needs 8 bytes"));
}

TEST(SafetensorsRejects, OverlappingTensors) {
  TempDir dir;
  EXPECT_TRUE(
      HasError(OpenBytes(dir, Image("{" + U8Entry("a", 0, 8) + "," + U8Entry("b", 4, 12) + "}",
                                    std::string(12, 'x'))),
               StatusCode::kCorruption, "tensor 'b' at [4, 12] overlaps tensor 'a' at [0, 8]"));
  // Identical ranges, and a zero-size tensor inside another one.
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{" + U8Entry("a", 0, 4) + "," + U8Entry("b", 0, 4) + "}", "wxyz")),
      StatusCode::kCorruption, "overlaps"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{" + U8Entry("a", 0, 4) + "," + U8Entry("z", 2, 2) + "}", "wxyz")),
      StatusCode::kCorruption, "tensor 'z' at [2, 2] overlaps tensor 'a'"));
}

TEST(SafetensorsRejects, HoleBetweenTensors) {
  TempDir dir;
  EXPECT_TRUE(
      HasError(OpenBytes(dir, Image("{" + U8Entry("a", 0, 4) + "," + U8Entry("b", 8, 12) + "}",
                                    std::string(12, 'x'))),
               StatusCode::kCorruption,
               "hole of 4 bytes between tensor 'a' (ends at 4) and tensor 'b' (begins at 8)"));
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{" + U8Entry("a", 4, 8) + "}", "12345678")),
                       StatusCode::kCorruption, "hole of 4 bytes at the start of the data buffer"));
}

TEST(SafetensorsRejects, DataNotFullyCovered) {
  TempDir dir;
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{" + U8Entry("a", 0, 4) + "}", "12345678")),
                       StatusCode::kCorruption,
                       "data buffer holds 8 bytes but the tensors cover only 4"));
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{}", "1")), StatusCode::kCorruption,
                       "data buffer holds 1 bytes but the tensors cover only 0"));
}

TEST(SafetensorsRejects, OffsetsOutOfBounds) {
  TempDir dir;
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{" + U8Entry("a", 0, 100) + "}", "1234")),
                       StatusCode::kCorruption,
                       "data_offsets [0, 100] extend past the end of the 4-byte data buffer"));
  // Offsets near 2^64: the range check must not wrap around.
  const std::string huge = std::to_string(~uint64_t{0});
  EXPECT_TRUE(
      HasError(OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[" +
                                    huge + "," + huge + "]}}")),
               StatusCode::kCorruption, "extend past the end of the 0-byte data buffer"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[8,4]}}",
                           "12345678")),
      StatusCode::kCorruption, "data_offsets [8, 4] begin after they end"));
}

TEST(SafetensorsRejects, DuplicateTensorNames) {
  TempDir dir;
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{" + U8Entry("a", 0, 2) + "," + U8Entry("a", 2, 4) + "}", "1234")),
      StatusCode::kCorruption, "duplicate key 'a'"));
  // Duplicate fields inside an entry and inside __metadata__ too.
  EXPECT_TRUE(
      HasError(OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],"
                                    "\"data_offsets\":[0,1]}}",
                                    "1")),
               StatusCode::kCorruption, "duplicate key 'dtype'"));
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}")),
                       StatusCode::kCorruption, "duplicate key 'k'"));
}

TEST(SafetensorsRejects, MetadataNotStringToString) {
  TempDir dir;
  for (std::string value : {"7", "null", "true", "[\"x\"]", "{}"}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"__metadata__\":{\"k\":" + value + "}}")),
                         StatusCode::kCorruption, "__metadata__ value for 'k' is not a string"))
        << value;
  }
  for (std::string value : {"[]", "\"pt\"", "null", "3"}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"__metadata__\":" + value + "}")),
                         StatusCode::kCorruption,
                         "__metadata__ must be an object of string -> string"))
        << value;
  }
}

TEST(SafetensorsRejects, NegativeDimsAndOffsets) {
  TempDir dir;
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[2,-1],\"data_offsets\":[0,0]}}")),
      StatusCode::kCorruption, "tensor 'a': shape dimension 1 is negative (-1)"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[-1,0]}}")),
      StatusCode::kCorruption, "tensor 'a': data_offsets[0] is negative"));
}

TEST(SafetensorsRejects, NumbersThatAreNotSixtyFourBitIntegers) {
  TempDir dir;
  auto header = [](std::string shape, std::string offsets) {
    return Image("{\"a\":{\"dtype\":\"U8\",\"shape\":" + shape + ",\"data_offsets\":" + offsets +
                 "}}");
  };
  for (std::string dim : {"1.0", "1e0", "18446744073709551616", "\"1\"", "true", "null"}) {
    EXPECT_TRUE(HasError(OpenBytes(dir, header("[" + dim + "]", "[0,1]")), StatusCode::kCorruption,
                         "shape dimension 0 must be a non-negative integer that fits in 64 bits"))
        << dim;
  }
  EXPECT_TRUE(HasError(OpenBytes(dir, header("[0]", "[0,18446744073709551616]")),
                       StatusCode::kCorruption, "data_offsets[1] must be a non-negative integer"));
  EXPECT_TRUE(HasError(OpenBytes(dir, header("[9223372036854775808]", "[0,0]")),
                       StatusCode::kCorruption, "does not fit in int64"));
  EXPECT_TRUE(HasError(OpenBytes(dir, header("[4294967296,4294967296]", "[0,0]")),
                       StatusCode::kCorruption, "exceeds 2^64 bytes"));
  // Element count fits, byte count does not.
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"a\":{\"dtype\":\"F64\",\"shape\":"
                                            "[2305843009213693952],\"data_offsets\":[0,0]}}")),
                       StatusCode::kCorruption, "exceeds 2^64 bytes"));
}

TEST(SafetensorsRejects, EntryShapeErrors) {
  TempDir dir;
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"a\":5}")), StatusCode::kCorruption,
                       "tensor 'a': entry must be a JSON object"));
  EXPECT_TRUE(
      HasError(OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],"
                                    "\"offset\":0}}",
                                    "1")),
               StatusCode::kCorruption, "tensor 'a': unknown field 'offset'"));
  EXPECT_TRUE(HasError(OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", "1")),
                       StatusCode::kCorruption, "tensor 'a': missing field 'data_offsets'"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":8,\"shape\":[1],\"data_offsets\":[0,1]}}", "1")),
      StatusCode::kCorruption, "dtype must be a string"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir, Image("{\"a\":{\"dtype\":\"U8\",\"shape\":1,\"data_offsets\":[0,1]}}", "1")),
      StatusCode::kCorruption, "shape must be an array"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir,
                Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", "1")),
      StatusCode::kCorruption, "data_offsets must be an array [begin, end], found 3 elements"));
  EXPECT_TRUE(HasError(
      OpenBytes(dir,
                Image("{\"a\":{\"dtype\":\"U8\",\"shape\":[[1]],\"data_offsets\":[0,1]}}", "1")),
      StatusCode::kCorruption, "nested deeper than 3 levels"));
}

TEST(SafetensorsRejects, HostileNamesAreQuotedSafelyInMessages) {
  TempDir dir;
  Status status = OpenBytes(dir, Image("{\"" + std::string(1000, 'n') + "\":5}"));
  EXPECT_TRUE(HasError(status, StatusCode::kCorruption, "'" + std::string(200, 'n') + "...'"));
  EXPECT_LT(status.message().size(), 400u) << status.ToString();
  status = OpenBytes(dir, Image("{\"\\u0001\\n\":5}"));
  EXPECT_TRUE(HasError(status, StatusCode::kCorruption, "tensor '\\x01\\x0a'"));
}

TEST(SafetensorsRejects, PathThatIsMissingOrADirectory) {
  TempDir dir;
  EXPECT_TRUE(HasError(SafetensorsFile::Open(dir.Join("nope")).status(), StatusCode::kNotFound,
                       "nope: no such file"));
  EXPECT_TRUE(HasError(SafetensorsFile::Open(dir.path()).status(), StatusCode::kInvalidArgument,
                       "not a regular file"));
}

// ------------------------------------------------------------ writer contract

TEST(SafetensorsWriterTest, AppendPastTheDeclaredBytesIsRefused) {
  TempDir dir;
  auto writer = SafetensorsWriter::Create(dir.Join("w"), {{"a", DType::kU8, {3}}});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Append(AsBytes("ab")).ok());
  EXPECT_TRUE(HasError((*writer)->Append(AsBytes("cd")), StatusCode::kInvalidArgument,
                       "appending 2 bytes would pass the 3 bytes the specs declare"));
  ASSERT_TRUE((*writer)->Append(AsBytes("c")).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ(AsChars((*SafetensorsFile::Open(dir.Join("w")))->tensors()[0].bytes), "abc");
  EXPECT_TRUE(HasError((*writer)->Finish(), StatusCode::kFailedPrecondition, "twice"));
  EXPECT_TRUE(
      HasError((*writer)->Append(AsBytes("")), StatusCode::kFailedPrecondition, "after Finish"));
}

TEST(SafetensorsWriterTest, FinishBeforeAllBytesIsRefused) {
  TempDir dir;
  auto writer = SafetensorsWriter::Create(dir.Join("w"), {{"a", DType::kF32, {2}}});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Append(AsBytes("1234")).ok());
  EXPECT_TRUE(HasError((*writer)->Finish(), StatusCode::kFailedPrecondition,
                       "only 4 of the 8 declared tensor bytes were appended"));
  EXPECT_EQ(dir.List().size(), 1u);  // just the temporary
  EXPECT_NE(dir.List()[0], "w");
}

TEST(SafetensorsWriterTest, AbandonedWriterRemovesItsTemporary) {
  TempDir dir;
  {
    auto writer = SafetensorsWriter::Create(dir.Join("w"), {{"a", DType::kU8, {3}}});
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Append(AsBytes("ab")).ok());
    EXPECT_EQ(dir.List().size(), 1u);
  }
  EXPECT_TRUE(dir.List().empty());
  // An abandoned rewrite leaves the old file untouched.
  WriteFileOrDie(dir.Join("w"), "old");
  { auto writer = SafetensorsWriter::Create(dir.Join("w"), {{"a", DType::kU8, {3}}}); }
  EXPECT_EQ(ReadFileOrDie(dir.Join("w")), "old");
  EXPECT_EQ(dir.List(), std::vector<std::string>{"w"});
}

TEST(SafetensorsWriterTest, SpecsTheFormatCannotHoldAreRefused) {
  TempDir dir;
  const std::string path = dir.Join("w");
  EXPECT_TRUE(HasError(
      SafetensorsWriter::Create(path, {{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}).status(),
      StatusCode::kInvalidArgument, "tensor 'a' appears more than once"));
  EXPECT_TRUE(
      HasError(SafetensorsWriter::Create(path, {{"__metadata__", DType::kU8, {1}}}).status(),
               StatusCode::kInvalidArgument, "reserved"));
  EXPECT_TRUE(HasError(SafetensorsWriter::Create(path, {{"a", DType::kU8, {2, -1}}}).status(),
                       StatusCode::kInvalidArgument, "negative dimension"));
  EXPECT_TRUE(HasError(SafetensorsWriter::Create(path, {{"\xff", DType::kU8, {1}}}).status(),
                       StatusCode::kInvalidArgument, "tensor name '\xff' is not valid UTF-8"));
  EXPECT_TRUE(HasError(SafetensorsWriter::Create(path, {}, {{"k", "\xc0\x80"}}).status(),
                       StatusCode::kInvalidArgument, "metadata value"));
  EXPECT_TRUE(
      HasError(SafetensorsWriter::Create(path, {{"a", DType::kF64, {int64_t{1} << 62}}}).status(),
               StatusCode::kInvalidArgument, "exceeds 2^64 bytes"));
  EXPECT_TRUE(HasError(SafetensorsWriter::Create(path, {{"a", DType::kU8, {int64_t{1} << 62}},
                                                        {"b", DType::kU8, {int64_t{1} << 62}},
                                                        {"c", DType::kU8, {int64_t{1} << 62}},
                                                        {"d", DType::kU8, {int64_t{1} << 62}}})
                           .status(),
                       StatusCode::kInvalidArgument, "data buffer would exceed 2^64 bytes"));
  EXPECT_TRUE(dir.List().empty());
}

TEST(SafetensorsWriterTest, ViewWhoseBytesDoNotMatchItsShapeIsRefused) {
  TempDir dir;
  const std::string bytes = "12345";
  const std::vector<TensorView> tensors = {{"a", DType::kF32, {1}, AsBytes(bytes)}};
  EXPECT_TRUE(HasError(WriteSafetensors(dir.Join("w"), tensors), StatusCode::kInvalidArgument,
                       "does not match 5 bytes"));
  EXPECT_TRUE(dir.List().empty());
}

TEST(SafetensorsWriterTest, MissingDirectoryIsAnIOErrorNamingThePath) {
  TempDir dir;
  EXPECT_TRUE(HasError(WriteSafetensors(dir.Join("no/such/dir/x.safetensors"), {}),
                       StatusCode::kIOError, "no/such/dir/x.safetensors"));
}

// --------------------------------------------------------------- JSON helpers

TEST(JsonUtilTest, Utf8ValidationFollowsRfc3629) {
  using format_internal::FindInvalidUtf8;
  constexpr size_t kOk = std::string_view::npos;
  // Boundaries of each sequence length: U+007F, U+0080, U+07FF, U+0800,
  // U+D7FF, U+E000, U+FFFF, U+10000, U+10FFFF.
  for (std::string_view good :
       {"", "ascii", "\x7f", "\xc2\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf", "\xee\x80\x80",
        "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf", "caf\xc3\xa9"}) {
    EXPECT_EQ(FindInvalidUtf8(good), kOk) << ::testing::PrintToString(good);
  }
  struct Bad {
    std::string_view text;
    size_t offset;
  };
  for (Bad bad : {Bad{"\x80", 0}, Bad{"ab\xbf", 2}, Bad{"\xc0\x80", 0}, Bad{"\xc1\xbf", 0},
                  Bad{"\xe0\x9f\xbf", 0}, Bad{"\xed\xa0\x80", 0}, Bad{"\xed\xbf\xbf", 0},
                  Bad{"\xf0\x8f\xbf\xbf", 0}, Bad{"\xf4\x90\x80\x80", 0},
                  Bad{"\xf5\x80\x80\x80", 0}, Bad{"\xff", 0}, Bad{"x\xc3", 1}, Bad{"\xe2\x82", 0},
                  Bad{"\xe2\x28\xa1", 0}, Bad{"\xf0\x90\x80", 0}}) {
    EXPECT_EQ(FindInvalidUtf8(bad.text), bad.offset) << ::testing::PrintToString(bad.text);
  }
}

TEST(JsonUtilTest, StrictParserRefusesDuplicatesAndDepth) {
  using format_internal::ParseJsonStrict;
  EXPECT_TRUE(ParseJsonStrict("{\"a\":[1,{\"b\":2}],\"c\":{}}", 3).ok());
  EXPECT_TRUE(HasError(ParseJsonStrict("{\"a\":1,\"b\":{\"x\":1,\"x\":2}}", 8).status(),
                       StatusCode::kCorruption, "duplicate key 'x'"));
  EXPECT_TRUE(HasError(ParseJsonStrict("[[[[1]]]]", 3).status(), StatusCode::kCorruption,
                       "nested deeper than 3 levels"));
  EXPECT_TRUE(HasError(ParseJsonStrict("{\"a\":1} 2", 3).status(), StatusCode::kCorruption,
                       "invalid JSON"));
  using namespace std::string_literals;
  for (std::string nul : {"{}\0"s, "{\"a\":1}\0\0"s, "{\"a\":\"x\0y\"}"s, "\0{}"s}) {
    EXPECT_TRUE(HasError(ParseJsonStrict(nul, 3).status(), StatusCode::kCorruption,
                         "invalid JSON: NUL byte at offset " + std::to_string(nul.find('\0'))))
        << ::testing::PrintToString(nul);
  }
  // Deep hostile nesting is refused without recursion.
  EXPECT_FALSE(ParseJsonStrict(std::string(100000, '['), 64).ok());
  auto parsed = ParseJsonStrict("{\"a\":[1,-2,3.5,\"s\",null,true]}", 3);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->dump(), "{\"a\":[1,-2,3.5,\"s\",null,true]}");
}

TEST(JsonUtilTest, StringEscapingAndMessageQuoting) {
  std::string out;
  format_internal::AppendJsonString("a\"b\\c\n\x01\xc3\xa9", &out);
  EXPECT_EQ(out, "\"a\\\"b\\\\c\\n\\u0001\xc3\xa9\"");
  EXPECT_EQ(format_internal::QuoteForMessage("a'\n"), "'a\\'\\x0a'");
  EXPECT_EQ(format_internal::QuoteForMessage("abcdef", 3), "'abc...'");
  // Never cuts a multi-byte character in half.
  EXPECT_EQ(format_internal::QuoteForMessage("a\xc3\xa9", 2), "'a...'");
}

}  // namespace
}  // namespace deltasync
