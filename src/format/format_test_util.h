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
#include "io/io_test_util.h"

namespace deltasync::testing_util {

// Scratch directories and whole-file reads and writes are the io module's
// test helpers.
class TempDir : public io_test::TempDir {
 public:
  explicit TempDir(std::string_view prefix = "ds_format_test") : io_test::TempDir(prefix) {}
};
inline constexpr auto& ReadFileOrDie = io_test::ReadFile;
inline constexpr auto& WriteFileOrDie = io_test::WriteFile;

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
