// The CLI's own helpers, tested directly: how it writes seconds for people.
#include <gtest/gtest.h>

#include <string>

#include "cli_util.h"

namespace deltasync::cli {
namespace {

TEST(CliUtil, FormatSecondsKeepsThreeSignificantDigits) {
  EXPECT_EQ(FormatSeconds(0.0834327), "0.0834 s");
  EXPECT_EQ(FormatSeconds(0.5), "0.500 s");
  EXPECT_EQ(FormatSeconds(2.3449), "2.34 s");
  EXPECT_EQ(FormatSeconds(12.345), "12.3 s");
  EXPECT_EQ(FormatSeconds(184.2), "184 s");
  // Never coarser than a second, nor finer than a microsecond.
  EXPECT_EQ(FormatSeconds(4321.4), "4321 s");
  EXPECT_EQ(FormatSeconds(0.0000012345), "0.000001 s");
  EXPECT_EQ(FormatSeconds(0), "0.00 s");
}

}  // namespace
}  // namespace deltasync::cli
