// The stream group's envelopes and routes (docs/format.md, "Messages" and
// "Fan-out"): what they carry, and what a receiver refuses.
#include "stream/sync_messages.h"

#include <gtest/gtest.h>

#include <array>
#include <string>

namespace deltasync::stream {
namespace {

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(Envelope, AnEndOfTheSharedFramesTravelsAndIsRefusedWithABodyOrWithLast) {
  Envelope end;
  end.type = MessageType::kFrame;
  end.end = true;
  std::array<uint8_t, kEnvelopeBytes> bytes = EncodeEnvelope(end);
  EXPECT_EQ(bytes[5], 0x02);
  Result<Envelope> back = DecodeEnvelope(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->end);
  EXPECT_FALSE(back->last);

  bytes[8] = 1;  // a body
  Result<Envelope> with_body = DecodeEnvelope(bytes);
  EXPECT_EQ(with_body.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(with_body.status(), "an end envelope with a body of 1 bytes"))
      << with_body.status().ToString();

  bytes[8] = 0;
  bytes[5] = 0x03;  // end and last
  EXPECT_EQ(DecodeEnvelope(bytes).status().code(), StatusCode::kCorruption);
  bytes[5] = 0x02;
  bytes[4] = static_cast<uint8_t>(MessageType::kReport);  // end on another type
  EXPECT_EQ(DecodeEnvelope(bytes).status().code(), StatusCode::kCorruption);
  bytes[4] = 6;  // past the known types
  bytes[5] = 0;
  EXPECT_TRUE(Contains(DecodeEnvelope(bytes).status(), "unknown type 6"));
}

TEST(Route, ReadsWhereFramesComeFromAndGoTo) {
  Result<Route> r = ParseRoute(RouteBody({2, 5}), 3, 6);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->from, 2);
  EXPECT_EQ(r->to, 5);
  Result<Route> alone = ParseRoute(RouteBody({0, 0}), 1, 2);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_EQ(alone->from, 0);
  EXPECT_EQ(alone->to, 0);
}

TEST(Route, RefusesRanksOutsideTheGroupItsOwnAndMissingFields) {
  const auto refused = [](const nlohmann::json& body, int self, int size, const std::string& text) {
    Result<Route> r = ParseRoute(body, self, size);
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << body.dump();
    EXPECT_TRUE(Contains(r.status(), text)) << r.status().ToString();
  };
  refused({{"to", 0}}, 1, 3, "no integer \"from\"");
  refused({{"from", "0"}, {"to", 0}}, 1, 3, "no integer \"from\"");
  refused({{"from", 0}, {"to", 3}}, 1, 3, "\"to\" is rank 3, not another member of the group of 3");
  refused({{"from", -1}, {"to", 0}}, 1, 3, "\"from\" is rank -1");
  refused({{"from", 1}, {"to", 0}}, 1, 3, "\"from\" is rank 1");
  refused({{"from", 2}, {"to", 2}}, 1, 3, "frames come from and go to rank 2");
}

}  // namespace
}  // namespace deltasync::stream
