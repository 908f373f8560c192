#include "deltasync/blake3.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace deltasync {
namespace {

using Bytes = std::vector<uint8_t>;

constexpr size_t kVectorOutLen = 131;  // every official case carries 131 bytes

enum class Mode { kHash, kKeyedHash, kDeriveKey };
constexpr Mode kAllModes[] = {Mode::kHash, Mode::kKeyedHash, Mode::kDeriveKey};

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kHash: return "hash";
    case Mode::kKeyedHash: return "keyed_hash";
    case Mode::kDeriveKey: return "derive_key";
  }
  return "?";
}

std::string Hex(const Bytes& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

// The official vectors' input: the 251-byte cycle 0, 1, ..., 250, 0, 1, ...
Bytes PatternInput(size_t len) {
  Bytes input(len);
  for (size_t i = 0; i < len; ++i) input[i] = static_cast<uint8_t>(i % 251);
  return input;
}

Bytes RandomBytes(size_t len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes out(len);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

struct Vectors {
  std::string key;
  std::string context;
  struct Case {
    size_t input_len;
    std::string expected[3];  // indexed by Mode
  };
  std::vector<Case> cases;
};

const Vectors& OfficialVectors() {
  static const Vectors vectors = [] {
    const std::string path = DS_SOURCE_DIR "/tests/vectors/blake3_test_vectors.json";
    std::ifstream file(path);
    if (!file) {
      ADD_FAILURE() << "cannot open " << path;
      return Vectors{};
    }
    const nlohmann::json json = nlohmann::json::parse(file);
    Vectors v;
    v.key = json.at("key").get<std::string>();
    v.context = json.at("context_string").get<std::string>();
    for (const auto& c : json.at("cases")) {
      Vectors::Case parsed;
      parsed.input_len = c.at("input_len").get<size_t>();
      for (Mode mode : kAllModes) {
        parsed.expected[static_cast<int>(mode)] = c.at(ModeName(mode)).get<std::string>();
      }
      v.cases.push_back(std::move(parsed));
    }
    return v;
  }();
  return vectors;
}

Blake3 MakeHasher(Mode mode, const std::string& key, const std::string& context) {
  switch (mode) {
    case Mode::kHash: return Blake3();
    case Mode::kKeyedHash: {
      EXPECT_EQ(key.size(), Blake3::kKeyLen);
      std::array<uint8_t, Blake3::kKeyLen> key_bytes{};
      std::copy_n(key.begin(), std::min(key.size(), key_bytes.size()), key_bytes.begin());
      return Blake3::Keyed(key_bytes);
    }
    case Mode::kDeriveKey: return Blake3::DeriveKey(context);
  }
  return Blake3();
}

Blake3 MakeVectorHasher(Mode mode) {
  return MakeHasher(mode, OfficialVectors().key, OfficialVectors().context);
}

Bytes Output(const Blake3& hasher, size_t len) {
  Bytes out(len);
  hasher.Finalize(out);
  return out;
}

// Feeds `input` in pieces whose sizes cycle through `sizes` (0 means an
// empty Update, which must change nothing).
void FeedInPieces(Blake3& hasher, std::span<const uint8_t> input,
                  const std::vector<size_t>& sizes) {
  size_t pos = 0;
  for (size_t i = 0; pos < input.size(); ++i) {
    const size_t n = std::min(sizes[i % sizes.size()], input.size() - pos);
    hasher.Update({input.data() + pos, n});
    pos += n;
  }
}

TEST(Blake3Vectors, FileHasAllCases) {
  const Vectors& v = OfficialVectors();
  ASSERT_EQ(v.cases.size(), 22u);
  EXPECT_EQ(v.key.size(), Blake3::kKeyLen);
  EXPECT_EQ(v.cases.front().input_len, 0u);
  EXPECT_EQ(v.cases.back().input_len, 102400u);
  for (const auto& c : v.cases) {
    for (const auto& hex : c.expected) EXPECT_EQ(hex.size(), 2 * kVectorOutLen);
  }
}

TEST(Blake3Vectors, WholeInputEveryMode) {
  for (const auto& c : OfficialVectors().cases) {
    const Bytes input = PatternInput(c.input_len);
    for (Mode mode : kAllModes) {
      SCOPED_TRACE(std::string(ModeName(mode)) + " len=" + std::to_string(c.input_len));
      const std::string& expected = c.expected[static_cast<int>(mode)];
      Blake3 hasher = MakeVectorHasher(mode);
      hasher.Update(input);
      EXPECT_EQ(Hex(Output(hasher, kVectorOutLen)), expected);
      EXPECT_EQ(Hex(Output(hasher, Blake3::kOutLen)), expected.substr(0, 2 * Blake3::kOutLen));
      // Any shorter output is a prefix, including ones that end mid-word
      // and mid-block.
      for (size_t len : {0, 1, 3, 31, 33, 63, 64, 65, 127, 128, 130}) {
        EXPECT_EQ(Hex(Output(hasher, len)), expected.substr(0, 2 * len)) << "out len " << len;
      }
    }
  }
}

TEST(Blake3Vectors, StreamingSplitsMatch) {
  const std::vector<std::vector<size_t>> patterns = {{1},
                                                     {7},
                                                     {63},
                                                     {64},
                                                     {65},
                                                     {1000},
                                                     {1023},
                                                     {1024},
                                                     {1025},
                                                     {2048},
                                                     {4097},
                                                     {8191},
                                                     {1, 1023, 0, 2, 2048, 7, 5000, 65536}};
  for (const auto& c : OfficialVectors().cases) {
    const Bytes input = PatternInput(c.input_len);
    for (Mode mode : kAllModes) {
      const std::string& expected = c.expected[static_cast<int>(mode)];
      for (size_t p = 0; p < patterns.size(); ++p) {
        SCOPED_TRACE(std::string(ModeName(mode)) + " len=" + std::to_string(c.input_len) +
                     " pattern=" + std::to_string(p));
        Blake3 hasher = MakeVectorHasher(mode);
        FeedInPieces(hasher, input, patterns[p]);
        EXPECT_EQ(Hex(Output(hasher, kVectorOutLen)), expected);
      }
    }
  }
}

// One hasher grows its input through every vector length in turn: each
// Finalize must match that length's vector and leave the state usable.
TEST(Blake3Vectors, FinalizeTwiceAndContinue) {
  const Vectors& v = OfficialVectors();
  const Bytes input = PatternInput(v.cases.back().input_len);
  for (Mode mode : kAllModes) {
    SCOPED_TRACE(ModeName(mode));
    Blake3 hasher = MakeVectorHasher(mode);
    size_t fed = 0;
    for (const auto& c : v.cases) {
      hasher.Update({input.data() + fed, c.input_len - fed});
      fed = c.input_len;
      const std::string& expected = c.expected[static_cast<int>(mode)];
      EXPECT_EQ(Hex(Output(hasher, kVectorOutLen)), expected) << "len " << fed;
      EXPECT_EQ(Hex(Output(hasher, kVectorOutLen)), expected) << "again, len " << fed;
    }
  }
}

TEST(Blake3Vectors, ResetKeepsModeAndKey) {
  const auto& c = OfficialVectors().cases[4];  // 1025 bytes: two chunks
  const Bytes input = PatternInput(c.input_len);
  const Bytes noise = RandomBytes(5000, 1);
  for (Mode mode : kAllModes) {
    SCOPED_TRACE(ModeName(mode));
    Blake3 hasher = MakeVectorHasher(mode);
    hasher.Update(noise);
    hasher.Reset();
    hasher.Update(input);
    EXPECT_EQ(Hex(Output(hasher, kVectorOutLen)), c.expected[static_cast<int>(mode)]);
    hasher.Reset();
    EXPECT_EQ(Hex(Output(hasher, kVectorOutLen)),
              OfficialVectors().cases[0].expected[static_cast<int>(mode)]);
  }
}

TEST(Blake3, ModesAreDistinctAndKeysMatter) {
  const Bytes input = PatternInput(3000);
  std::array<uint8_t, 32> key_a{};
  std::array<uint8_t, 32> key_b{};
  key_b[31] = 1;
  Blake3 plain;
  Blake3 keyed_a = Blake3::Keyed(key_a);
  Blake3 keyed_b = Blake3::Keyed(key_b);
  Blake3 derive_a = Blake3::DeriveKey("deltasync test context a");
  Blake3 derive_b = Blake3::DeriveKey("deltasync test context b");
  std::vector<std::string> digests;
  for (Blake3* h : {&plain, &keyed_a, &keyed_b, &derive_a, &derive_b}) {
    h->Update(input);
    digests.push_back(Hex(Output(*h, 32)));
  }
  std::sort(digests.begin(), digests.end());
  EXPECT_EQ(std::unique(digests.begin(), digests.end()), digests.end());
}

TEST(Blake3, LongOutputIsConsistent) {
  Blake3 hasher;
  hasher.Update(PatternInput(5000));
  const Bytes long_out = Output(hasher, 100000);
  for (size_t len : {1, 64, 65, 4096, 99999}) {
    const Bytes short_out = Output(hasher, len);
    EXPECT_TRUE(std::equal(short_out.begin(), short_out.end(), long_out.begin())) << len;
  }
  // Successive 64-byte output blocks come from distinct counters.
  EXPECT_FALSE(std::equal(long_out.begin(), long_out.begin() + 64, long_out.begin() + 64));
}

TEST(Blake3, SetKernelRejectsUnknownAndUnsupported) {
  Blake3 hasher;
  const Blake3::Kernel before = hasher.kernel();
  const Status bad = hasher.SetKernel(static_cast<Blake3::Kernel>(7));
  EXPECT_TRUE(bad.IsInvalidArgument()) << bad.ToString();
  EXPECT_NE(bad.message().find("names no kernel"), std::string::npos) << bad.message();
  EXPECT_EQ(hasher.kernel(), before);

  EXPECT_TRUE(hasher.SetKernel(Blake3::Kernel::kPortable).ok());
  EXPECT_EQ(hasher.kernel(), Blake3::Kernel::kPortable);
  const Status avx2 = hasher.SetKernel(Blake3::Kernel::kAvx2);
  if (Blake3::KernelSupported(Blake3::Kernel::kAvx2)) {
    EXPECT_TRUE(avx2.ok()) << avx2.ToString();
    EXPECT_EQ(hasher.kernel(), Blake3::Kernel::kAvx2);
    EXPECT_EQ(Blake3::BestKernel(), Blake3::Kernel::kAvx2);
  } else {
    EXPECT_EQ(avx2.code(), StatusCode::kUnsupported) << avx2.ToString();
    EXPECT_EQ(hasher.kernel(), Blake3::Kernel::kPortable);
  }
}

// Every kernel must agree with the portable one, on lengths around the
// batch sizes (8 lanes, subtrees of up to 64 chunks, stack merges), in
// every mode, fed whole, in odd pieces and from misaligned addresses.
TEST(Blake3, Avx2KernelMatchesPortable) {
  if (!Blake3::KernelSupported(Blake3::Kernel::kAvx2)) GTEST_SKIP() << "no AVX2 on this CPU";
  std::vector<size_t> lengths;
  for (size_t chunks : {1,  2,  3,  4,  5,  7,  8,  9,   15,  16,  17,  31,
                        32, 33, 63, 64, 65, 66, 72, 127, 128, 129, 200, 257}) {
    for (ptrdiff_t delta : {-1, 0, 1}) lengths.push_back(chunks * Blake3::kChunkLen + delta);
  }
  std::mt19937_64 rng(42);
  for (int i = 0; i < 20; ++i) lengths.push_back(rng() % (300 * Blake3::kChunkLen));
  const std::vector<std::vector<size_t>> patterns = {
      {size_t{1} << 30}, {4096}, {8 * 1024 + 3}, {1, 1023, 5 * 1024, 777, 65536 + 1}};

  const Bytes base = RandomBytes(300 * Blake3::kChunkLen + 1024 + 8, 7);
  const std::string key(32, 'k');
  for (size_t n = 0; n < lengths.size(); ++n) {
    const size_t len = lengths[n];
    const size_t misalign = n % 8;
    // A view into `base`, not a copy, so the kernels also see unaligned data.
    const std::span<const uint8_t> input(base.data() + misalign, len);
    for (Mode mode : kAllModes) {
      for (size_t p = 0; p < patterns.size(); ++p) {
        if (p > 0 && mode != Mode::kHash && n % 3 != 0) continue;  // keep the test fast
        SCOPED_TRACE(std::string(ModeName(mode)) + " len=" + std::to_string(len) +
                     " pattern=" + std::to_string(p));
        Blake3 portable = MakeHasher(mode, key, "deltasync kernel test");
        Blake3 avx2 = MakeHasher(mode, key, "deltasync kernel test");
        ASSERT_TRUE(portable.SetKernel(Blake3::Kernel::kPortable).ok());
        ASSERT_TRUE(avx2.SetKernel(Blake3::Kernel::kAvx2).ok());
        FeedInPieces(portable, input, patterns[p]);
        FeedInPieces(avx2, input, patterns[p]);
        EXPECT_EQ(Hex(Output(avx2, 200)), Hex(Output(portable, 200)));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Cross-check with an independent implementation: the b3sum tool.

constexpr const char* kB3sum = "/usr/bin/b3sum";

std::string RunCommand(const std::string& command) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << command;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int rc = ::pclose(pipe);
  EXPECT_EQ(rc, 0) << command;
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(file.good()) << path;
}

TEST(Blake3, MatchesB3sum) {
  if (::access(kB3sum, X_OK) != 0) GTEST_SKIP() << kB3sum << " is not installed";
  std::string dir_template = ::testing::TempDir() + "blake3_b3sum_XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template.data()), nullptr);
  const std::string dir = dir_template;
  const std::string data_path = dir + "/input";
  const std::string key_path = dir + "/key";
  const Bytes key = RandomBytes(Blake3::kKeyLen, 99);
  WriteFile(key_path, key);
  const std::string context = "deltasync 2026 b3sum cross-check";

  const std::vector<size_t> sizes = {0,
                                     1,
                                     64,
                                     1023,
                                     1025,
                                     8 * 1024 + 1,
                                     64 * 1024 + 5,
                                     (size_t{1} << 20) + 777,
                                     (size_t{3} << 20) + 4095,
                                     (size_t{5} << 20) + 1};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const Bytes input = RandomBytes(sizes[i], 1000 + i);
    WriteFile(data_path, input);
    const size_t out_len = i % 2 == 0 ? 32 : 1000;  // also exercises --length
    const std::string length_arg = " --length " + std::to_string(out_len) + " ";
    for (Mode mode : kAllModes) {
      SCOPED_TRACE(std::string(ModeName(mode)) + " size=" + std::to_string(sizes[i]));
      std::string command = std::string(kB3sum) + " --no-names" + length_arg;
      Blake3 hasher;
      switch (mode) {
        case Mode::kHash: command += "'" + data_path + "'"; break;
        case Mode::kKeyedHash:
          command += "--keyed '" + data_path + "' < '" + key_path + "'";
          hasher = Blake3::Keyed(std::span<const uint8_t, 32>(key.data(), 32));
          break;
        case Mode::kDeriveKey:
          command += "--derive-key '" + context + "' '" + data_path + "'";
          hasher = Blake3::DeriveKey(context);
          break;
      }
      // Alternately one Update with everything and many odd-sized ones.
      const size_t piece = (i / 2) % 2 == 0 ? input.size() + 1 : (size_t{1} << 16) + 13;
      FeedInPieces(hasher, input, {piece});
      EXPECT_EQ(Hex(Output(hasher, out_len)), RunCommand(command));
    }
  }
  std::remove(data_path.c_str());
  std::remove(key_path.c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace deltasync
