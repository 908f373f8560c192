// Helpers shared by the format module's tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"

namespace deltasync::testing_util {

// A fresh directory under $TMPDIR (or /tmp), named after `prefix` and
// removed with its contents.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "ds_format_test") {
    const char* base = std::getenv("TMPDIR");
    std::string pattern =
        std::string(base && *base ? base : "/tmp") + "/" + std::string(prefix) + ".XXXXXX";
    path_ = ::mkdtemp(pattern.data()) ? pattern : std::string();
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(std::string_view name) const { return path_ + "/" + std::string(name); }
  // Every entry name in the directory (hidden ones included), sorted.
  std::vector<std::string> List(std::string_view sub = "") const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(sub.empty() ? path_ : Join(sub))) {
      names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

inline std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void WriteFileOrDie(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// A safetensors image built by hand, independently of the code under test:
// little-endian u64 length, `header` (padded with spaces to a multiple of 8
// including the prefix when `pad`), then `data`.
inline std::string Image(std::string_view header, std::string_view data = "", bool pad = true) {
  std::string padded(header);
  while (pad && (8 + padded.size()) % 8 != 0) padded.push_back(' ');
  std::string out;
  uint64_t n = padded.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(n >> (8 * i)));
  return out + padded + std::string(data);
}

// Image with an arbitrary declared header length.
inline std::string ImageWithLength(uint64_t declared, std::string_view rest) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(declared >> (8 * i)));
  return out + std::string(rest);
}

// Passes when `status` has `code` and its message contains `fragment`.
inline ::testing::AssertionResult HasError(const Status& status, StatusCode code,
                                           std::string_view fragment) {
  if (status.code() != code) {
    return ::testing::AssertionFailure()
           << "expected code " << StatusCodeName(code) << ", got " << status.ToString();
  }
  if (status.message().find(fragment) == std::string::npos) {
    return ::testing::AssertionFailure()
           << "message lacks \"" << fragment << "\": " << status.ToString();
  }
  return ::testing::AssertionSuccess();
}

inline std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

inline std::string_view AsChars(std::span<const uint8_t> s) {
  return {reinterpret_cast<const char*>(s.data()), s.size()};
}

}  // namespace deltasync::testing_util
