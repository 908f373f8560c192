#include "deltasync/checksum.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace deltasync {
namespace {

std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i % 251);
  return v;
}

std::vector<uint8_t> Bytes(std::string_view s) { return {s.begin(), s.end()}; }

// Expected digests printed by the Python libraries (python3-xxhash 3.0,
// zlib) as xxhash.xxh3_64(b).hexdigest(), xxhash.xxh3_128(b).hexdigest() and
// f"{zlib.adler32(b):08x}": an independent reference for value and format.
struct Vector {
  std::vector<uint8_t> input;
  const char* xxh3_64;
  const char* xxh3_128;
  const char* adler32;
};

std::vector<Vector> PythonVectors() {
  return {
      {Bytes(""), "2d06800538d394c2", "99aa06d3014798d86001c324468d497f", "00000001"},
      {Bytes("abc"), "78af5f94892f3950", "06b05ab6733a618578af5f94892f3950", "024d0127"},
      {Pattern(1000), "33ef703fb2b20ed1", "18bf41bc8229e27733ef703fb2b20ed1", "6cf4e66a"},
      {Pattern(100003), "acf33ba3cf61e369", "b02e921ecad88f0facf33ba3cf61e369", "840daac9"},
  };
}

TEST(ChecksumTest, MatchesPythonHexFormatting) {
  for (const Vector& v : PythonVectors()) {
    EXPECT_EQ(ChecksumHex(ChecksumAlgo::kXxh3_64, v.input), v.xxh3_64);
    EXPECT_EQ(ChecksumHex(ChecksumAlgo::kXxh3_128, v.input), v.xxh3_128);
    EXPECT_EQ(ChecksumHex(ChecksumAlgo::kAdler32, v.input), v.adler32);
  }
}

TEST(ChecksumTest, Blake3HexIsTheStandardDigest) {
  // BLAKE3("") and BLAKE3("abc") from the BLAKE3 reference.
  EXPECT_EQ(ChecksumHex(ChecksumAlgo::kBlake3, {}),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262");
  EXPECT_EQ(ChecksumHex(ChecksumAlgo::kBlake3, Bytes("abc")),
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85");
}

TEST(ChecksumTest, DigestSizesAndNames) {
  for (ChecksumAlgo a : {ChecksumAlgo::kXxh3_64, ChecksumAlgo::kXxh3_128, ChecksumAlgo::kBlake3,
                         ChecksumAlgo::kAdler32}) {
    Result<ChecksumAlgo> parsed = ParseChecksumAlgo(ChecksumAlgoName(a));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, a);
    EXPECT_EQ(ChecksumHex(a, Pattern(10)).size(), 2 * ChecksumDigestSize(a));
  }
  EXPECT_EQ(ChecksumDigestSize(ChecksumAlgo::kXxh3_128), 16u);
  Result<ChecksumAlgo> bad = ParseChecksumAlgo("sha256");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(bad.status().message().find("sha256"), std::string::npos);
}

TEST(ChecksumTest, StreamingEqualsOneShotForEverySplit) {
  const std::vector<uint8_t> data = Pattern(5000);
  for (ChecksumAlgo a : {ChecksumAlgo::kXxh3_64, ChecksumAlgo::kXxh3_128, ChecksumAlgo::kBlake3,
                         ChecksumAlgo::kAdler32}) {
    const std::string whole = ChecksumHex(a, data);
    for (size_t step : {1u, 7u, 64u, 1023u, 1024u, 4999u}) {
      std::unique_ptr<Hasher> h = NewHasher(a);
      for (size_t off = 0; off < data.size(); off += step) {
        h->Update({data.data() + off, std::min(step, data.size() - off)});
      }
      EXPECT_EQ(h->HexDigest(), whole) << ChecksumAlgoName(a) << " step " << step;
    }
    std::unique_ptr<Hasher> h = NewHasher(a);
    h->Update(Bytes("garbage"));
    h->Reset();
    h->Update(data);
    EXPECT_EQ(h->HexDigest(), whole) << "Reset must restore the empty state";
  }
}

TEST(ChecksumTest, FileChecksumAndMissingFile) {
  const std::string path = testing::TempDir() + "/checksum_test_file.bin";
  const std::vector<uint8_t> data = Pattern(3u << 20);
  {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  Result<std::string> hex = ChecksumFileHex(ChecksumAlgo::kXxh3_128, path);
  ASSERT_TRUE(hex.ok()) << hex.status().ToString();
  EXPECT_EQ(*hex, ChecksumHex(ChecksumAlgo::kXxh3_128, data));
  std::remove(path.c_str());
  Result<std::string> missing = ChecksumFileHex(ChecksumAlgo::kXxh3_128, path);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().IsNotFound());
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

// Cross-check against the Python libraries themselves where they are
// installed (scripts/install-deps installs python3-xxhash).
TEST(ChecksumTest, CrossCheckWithPythonLibraries) {
  FILE* probe = popen("/usr/bin/python3 -c 'import xxhash, zlib' 2>/dev/null", "r");
  if (probe == nullptr || pclose(probe) != 0) GTEST_SKIP() << "python3-xxhash not installed";
  const std::string cmd =
      "/usr/bin/python3 -c \"import xxhash, zlib; b=bytes((i*7+3)%256 for i in range(77777)); "
      "print(xxhash.xxh3_64(b).hexdigest(), xxhash.xxh3_128(b).hexdigest(), "
      "'%08x' % zlib.adler32(b))\"";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[256] = {};
  ASSERT_NE(fgets(buf, sizeof(buf), p), nullptr);
  ASSERT_EQ(pclose(p), 0);
  std::vector<uint8_t> data(77777);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>((i * 7 + 3) % 256);
  const std::string expected = ChecksumHex(ChecksumAlgo::kXxh3_64, data) + " " +
                               ChecksumHex(ChecksumAlgo::kXxh3_128, data) + " " +
                               ChecksumHex(ChecksumAlgo::kAdler32, data) + "\n";
  EXPECT_EQ(std::string(buf), expected);
}

}  // namespace
}  // namespace deltasync
