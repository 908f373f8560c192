#include "agent/http_util.h"

#include <gtest/gtest.h>

#include <cmath>

namespace deltasync::agent_internal {
namespace {

TEST(ConstantTimeEqualsTest, Equality) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("token", "token"));
  EXPECT_FALSE(ConstantTimeEquals("token", "tokeN"));
  EXPECT_FALSE(ConstantTimeEquals("token", "toke"));
  EXPECT_FALSE(ConstantTimeEquals("toke", "token"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals("x", ""));
  // A prefix repeated: wrapping indices must not make these compare equal.
  EXPECT_FALSE(ConstantTimeEquals("ab", "abab"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), "a"));
}

TEST(ParseHttpUrlTest, Forms) {
  struct Case {
    const char* url;
    const char* base;
    const char* path;
  };
  for (const Case& c : std::initializer_list<Case>{
           {"http://127.0.0.1:8000", "http://127.0.0.1:8000", ""},
           {"http://127.0.0.1:8000/", "http://127.0.0.1:8000", ""},
           {"127.0.0.1:8000", "http://127.0.0.1:8000", ""},
           {"http://host", "http://host:80", ""},
           {"https://host", "https://host:443", ""},
           {"https://host:9443/a/b/", "https://host:9443", "/a/b"},
           {"http://[::1]:30000/update_weights_from_disk", "http://[::1]:30000",
            "/update_weights_from_disk"},
       }) {
    Result<HttpUrl> u = ParseHttpUrl(c.url);
    ASSERT_TRUE(u.ok()) << c.url << ": " << u.status().ToString();
    EXPECT_EQ(u->scheme_host_port, c.base) << c.url;
    EXPECT_EQ(u->path, c.path) << c.url;
  }
  for (const char* bad : {"", "ftp://h:1", "http://", "http://:80", "http://h:", "http://h:0",
                          "http://h:65536", "http://h:80x", "http://h:80?x=1", "http://h/#f",
                          "http://u:p@h:1", "http://h 1:2", "http://[::1", "http://[::1]x"}) {
    Result<HttpUrl> u = ParseHttpUrl(bad);
    EXPECT_FALSE(u.ok()) << bad;
    if (!u.ok()) {
      EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(FormatDoubleTest, RoundTrips) {
  EXPECT_EQ(FormatDouble(0.5), "0.5");
  EXPECT_EQ(FormatDouble(10), "10");
  EXPECT_EQ(FormatDouble(HUGE_VAL), "+Inf");
  for (double v : {0.1, 0.025, 1e-9, 123456.789, 2.5}) {
    EXPECT_EQ(std::stod(FormatDouble(v)), v);
  }
}

}  // namespace
}  // namespace deltasync::agent_internal
