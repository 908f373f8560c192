// ScatterNewValuesAndVisit writes every change or none, and hands each
// piece over only once its changes are in.

#include "pipeline/scatter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace deltasync::pipeline {
namespace {

TEST(ScatterNewValues, WritesEveryChangeOrNothing) {
  auto scatter = [](const ChangeSet& c, std::span<uint8_t> target) {
    return ScatterNewValuesAndVisit(c, target, 0, target.size(), 64, [](auto) {});
  };
  ChangeSet c;
  c.numel = 6;
  c.elem_size = 2;
  c.pos32 = {1, 4};
  c.new_values = {0xa1, 0xa2, 0xb1, 0xb2};
  std::vector<uint8_t> target(12, 0);
  ASSERT_TRUE(scatter(c, target).ok());
  EXPECT_EQ(target, (std::vector<uint8_t>{0, 0, 0xa1, 0xa2, 0, 0, 0, 0, 0xb1, 0xb2, 0, 0}));
  c.pos32 = {1, 6};
  std::vector<uint8_t> untouched(12, 0);
  EXPECT_EQ(scatter(c, untouched).code(), StatusCode::kInternal);
  EXPECT_EQ(untouched, std::vector<uint8_t>(12, 0));
  c.pos32 = {1, 4};
  std::vector<uint8_t> wrong_size(10, 0);
  EXPECT_EQ(scatter(c, wrong_size).code(), StatusCode::kInternal);
}

TEST(ScatterNewValues, VisitsEachPieceOnceItsChangesAreWritten) {
  // 40 two-byte elements; changes at 11, 12, 17 and 30 of the visited
  // bytes [20, 64) (elements 10 to 31), in pieces of 5 elements.
  ChangeSet c;
  c.numel = 40;
  c.elem_size = 2;
  c.pos32 = {11, 12, 17, 30};
  c.new_values = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<uint8_t> expected(80, 0xee);
  for (size_t i = 0; i < c.pos32.size(); ++i) {
    expected[2 * c.pos32[i]] = c.new_values[2 * i];
    expected[2 * c.pos32[i] + 1] = c.new_values[2 * i + 1];
  }
  std::vector<uint8_t> target(80, 0xee);
  std::vector<std::pair<size_t, size_t>> pieces;
  ASSERT_TRUE(ScatterNewValuesAndVisit(c, target, 20, 64, 11, [&](std::span<const uint8_t> piece) {
                const size_t at = piece.data() - target.data();
                pieces.emplace_back(at, piece.size());
                // Final when visited: its changes are in.
                EXPECT_TRUE(std::equal(piece.begin(), piece.end(), expected.begin() + at)) << at;
              }).ok());
  // 11 bytes round down to whole elements: 10-byte pieces, the last short.
  EXPECT_EQ(pieces, (std::vector<std::pair<size_t, size_t>>{
                        {20, 10}, {30, 10}, {40, 10}, {50, 10}, {60, 4}}));
  EXPECT_EQ(target, expected);

  // Changes outside the visited bytes are refused before anything is written.
  auto refused = [&](size_t begin, size_t end) {
    std::vector<uint8_t> untouched(80, 0xee);
    size_t visits = 0;
    const Status s = ScatterNewValuesAndVisit(c, untouched, begin, end, 10,
                                              [&](std::span<const uint8_t>) { ++visits; });
    EXPECT_EQ(s.code(), StatusCode::kInternal) << begin << " " << end;
    EXPECT_EQ(untouched, std::vector<uint8_t>(80, 0xee));
    EXPECT_EQ(visits, 0u);
  };
  refused(24, 64);  // element 11 lies before
  refused(20, 60);  // element 30 lies after
  refused(21, 64);  // not whole elements
  refused(20, 63);  // not whole elements
  refused(20, 82);  // past the tensor
}

}  // namespace
}  // namespace deltasync::pipeline
