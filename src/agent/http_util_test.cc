#include "agent/http_util.h"

#include <gtest/gtest.h>

#include <cmath>

#include "agent/agent_test_util.h"

namespace deltasync::agent_internal {
namespace {

using namespace std::string_literals;

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

TEST(ParseHttpUrlTest, HostAndPort) {
  Result<HttpUrl> v4 = ParseHttpUrl("127.0.0.1:8470/x");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->host, "127.0.0.1");
  EXPECT_EQ(v4->port, 8470);
  Result<HttpUrl> v6 = ParseHttpUrl("https://[::1]/");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 443);
}

TEST(ParsePullBodyTest, Targets) {
  struct Case {
    std::string body;
    std::optional<int64_t> target;
  };
  for (const Case& c :
       std::vector<Case>{{"", std::nullopt},
                         {" \r\n\t", std::nullopt},
                         {"{}", std::nullopt},
                         {R"({"target_version": null})", std::nullopt},
                         {R"({"target_version": "latest"})", std::nullopt},
                         {R"({"target_version": 0})", 0},
                         {R"({"target_version": "12", "x": [1]})", 12},
                         {R"({"target_version": 9223372036854775807})", INT64_MAX}}) {
    const PullBody b = ParsePullBody(c.body);
    EXPECT_TRUE(b.ok()) << c.body << ": " << b.error;
    EXPECT_EQ(b.target, c.target) << c.body;
  }
  struct Bad {
    std::string body;
    const char* code;
  };
  for (const Bad& c : std::vector<Bad>{
           {"{", "invalid_json"},
           // The JSON parser stops at a NUL: what follows must not be ignored.
           {"{}\0{\"target_version\": 2}"s, "invalid_json"},
           {"{\"target_version\": 1}\0"s, "invalid_json"},
           {"[]", "invalid_request"},
           {"\"latest\"", "invalid_request"},
           {R"({"target_version": -1})", "invalid_target_version"},
           {R"({"target_version": 9223372036854775808})", "invalid_target_version"},
           {R"({"target_version": 2.0})", "invalid_target_version"},
           {R"({"target_version": "0x10"})", "invalid_target_version"},
           {R"({"target_version": " 1"})", "invalid_target_version"},
           {R"({"target_version": "1234567890123456789"})", "invalid_target_version"},
           {R"({"target_version": {}})", "invalid_target_version"},
       }) {
    const PullBody b = ParsePullBody(c.body);
    EXPECT_FALSE(b.ok()) << c.body;
    EXPECT_EQ(b.error_code, c.code) << c.body;
    EXPECT_FALSE(b.error.empty()) << c.body;
    EXPECT_FALSE(b.target.has_value()) << c.body;
  }
}

TEST(BearerTokenTest, Forms) {
  EXPECT_EQ(BearerToken("Bearer abc"), std::optional<std::string_view>("abc"));
  EXPECT_EQ(BearerToken("bearer   abc  "), std::optional<std::string_view>("abc"));
  EXPECT_EQ(BearerToken("BEARER a.b-c_d~+/="), std::optional<std::string_view>("a.b-c_d~+/="));
  for (const std::string& bad :
       {std::string("Basic abc"), std::string("Bearer"), std::string("Bearer "),
        std::string("Bearerabc"), std::string("Bearer a b"), "Bearer abc\0extra"s,
        std::string("Bearer abc\textra"), std::string("Bearer abc\x7f")}) {
    EXPECT_EQ(BearerToken(bad), std::nullopt) << bad;
  }
}

// Decodes `wire` fed in pieces of `piece` bytes.
ChunkedDecoder::State DecodeChunked(const std::string& wire, size_t piece, std::string* body,
                                    std::string* error = nullptr, size_t max_body = 1 << 20) {
  ChunkedDecoder decoder(max_body);
  size_t at = 0;
  while (at < wire.size() && decoder.state() == ChunkedDecoder::State::kMore) {
    const size_t n = std::min(piece, wire.size() - at);
    size_t used = 0;
    decoder.Feed(std::string_view(wire).substr(at, n), body, &used);
    EXPECT_LE(used, n);
    if (decoder.state() == ChunkedDecoder::State::kMore) {
      EXPECT_EQ(used, n);
    }
    at += used;
    if (used < n) break;
  }
  if (error != nullptr) *error = decoder.error();
  return decoder.state();
}

TEST(ChunkedDecoderTest, DecodesWhateverThePieces) {
  const std::string wire =
      "5\r\nhello\r\n"
      "1A;name=value;flag\r\n" +
      std::string(26, 'x') +
      "\r\n"
      "0 ; last\r\n"
      "X-Trailer: 1\r\n"
      "\r\n"
      "next request bytes";
  for (size_t piece : {size_t{1}, size_t{2}, size_t{7}, wire.size()}) {
    std::string body;
    std::string error;
    EXPECT_EQ(DecodeChunked(wire, piece, &body, &error), ChunkedDecoder::State::kDone)
        << piece << ": " << error;
    EXPECT_EQ(body, "hello" + std::string(26, 'x')) << piece;
  }
  // Where the body ends: nothing past the final CRLF is taken.
  ChunkedDecoder decoder(100);
  std::string body;
  size_t used = 0;
  EXPECT_EQ(decoder.Feed("0\r\n\r\nGET /", &body, &used), ChunkedDecoder::State::kDone);
  EXPECT_EQ(used, 5u);
  EXPECT_EQ(decoder.Feed("more", &body, &used), ChunkedDecoder::State::kDone);
  EXPECT_EQ(used, 0u);
  EXPECT_TRUE(body.empty());
}

TEST(ChunkedDecoderTest, RefusesMalformedBodies) {
  for (const std::string& wire : {
           std::string("zz\r\n"),                        // not a size at all
           std::string("\r\n"),                          // empty size
           std::string("-1\r\n"),                        // a sign
           std::string("0x5\r\nhello\r\n0\r\n\r\n"),     // a C prefix
           std::string("5\r\nhelloXX\r\n0\r\n\r\n"),     // data longer than its size
           std::string("5\r\nhello\n0\r\n\r\n"),         // bare LF after data
           std::string("5\nhello\r\n0\r\n\r\n"),         // bare LF after the size
           std::string("5 x\r\nhello\r\n0\r\n\r\n"),     // junk after the size
           std::string("5;\x01\r\nhello\r\n0\r\n\r\n"),  // control in an extension
           std::string("1000000000000000\r\n"),          // 16 hex digits
           std::string("0\r\nno colon\r\n\r\n"),         // trailer without a name
           std::string("0\r\n folded: x\r\n\r\n"),       // folded trailer
           std::string("0\r\nX: 1\n\r\n"),               // bare LF in the trailer
           std::string("0\r\n\r"),                       // CR, then not LF
           std::string("0\r\n\rX"),
       }) {
    for (size_t piece : {size_t{1}, wire.size()}) {
      std::string body;
      std::string error;
      EXPECT_EQ(DecodeChunked(wire + "\r\n\r\n", piece, &body, &error),
                ChunkedDecoder::State::kMalformed)
          << wire;
      EXPECT_FALSE(error.empty()) << wire;
    }
  }
}

TEST(ChunkedDecoderTest, TooLargeIsRefusedBeforeTheData) {
  std::string body;
  std::string error;
  EXPECT_EQ(DecodeChunked("4\r\nabcd\r\n7\r\n", 1, &body, &error, 10),
            ChunkedDecoder::State::kTooLarge);
  EXPECT_EQ(body, "abcd");
  EXPECT_NE(error.find("limit of 10 bytes"), std::string::npos) << error;
  body.clear();
  EXPECT_EQ(DecodeChunked("a\r\n0123456789\r\n0\r\n\r\n", 3, &body, nullptr, 10),
            ChunkedDecoder::State::kDone);
  EXPECT_EQ(body, "0123456789");
  // A size past any cap is refused as soon as its line ends.
  EXPECT_EQ(DecodeChunked("fffffffffffffff\r\n", 100, &body, nullptr, 1 << 20),
            ChunkedDecoder::State::kTooLarge);
}

TEST(RequestHeadTest, FindsTheEnd) {
  EXPECT_EQ(FindRequestHeadEnd("GET / HTTP/1.1\r\nHost: x\r\n\r\nbody"), 27u);
  EXPECT_EQ(FindRequestHeadEnd("GET / HTTP/1.1\r\nHost: x\r\n"), std::string_view::npos);
  EXPECT_EQ(FindRequestHeadEnd("GET / HTTP/1.1\n\n"), std::string_view::npos);
}

TEST(RequestHeadTest, ChecksFraming) {
  for (const std::string& ok : {
           std::string("GET / HTTP/1.1\r\n\r\n"),
           std::string("GET /health HTTP/1.1\r\nHost: x\r\nX-Empty:\r\n\r\n"),
           std::string("POST /p HTTP/1.1\r\nContent-Length:  12 \r\nA: b\tc\xc3\xa9\r\n\r\n"),
           std::string("POST /p HTTP/1.1\r\ntransfer-encoding: gzip, Chunked\r\n\r\n"),
       }) {
    EXPECT_TRUE(CheckRequestHead(ok).ok()) << ok << ": " << CheckRequestHead(ok).ToString();
  }
  struct Bad {
    std::string head;
    const char* why;
  };
  for (const Bad& c : std::vector<Bad>{
           {"GET / HTTP/1.1\nHost: x\r\n\r\n", "line 1 has a bare LF"},
           {"GET / HTTP/1.1\r\nHost: x\n\r\n", "line 2 has a bare LF"},
           {"GET / HTTP/1.1\r\nHost: x\ry\r\n\r\n", "line 2 has a bare CR"},
           {"GET / HTTP/1.1\r\nAuthorization: Bearer t\0x\r\n\r\n"s,
            "line 2 holds control character 0x00"},
           {"GET / HTTP/1.1\r\nA: \x1b[0m\r\n\r\n", "control character 0x1b"},
           {"GET / HTTP/1.1\r\nA: b\r\n  folded\r\n\r\n", "line 3 is folded"},
           {"GET / HTTP/1.1\r\nno colon\r\n\r\n", "has no ':'"},
           {"GET / HTTP/1.1\r\n: empty name\r\n\r\n", "empty field name"},
           {"GET / HTTP/1.1\r\nContent-Length : 5\r\n\r\n", "not a token"},
           {"GET / HTTP/1.1\r\nContent-Length:\r\n\r\n", "Content-Length that is not a decimal"},
           {"GET / HTTP/1.1\r\nContent-Length: %35\r\n\r\n", "not a decimal number"},
           {"GET / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n", "not a decimal number"},
           {"GET / HTTP/1.1\r\nContent-Length: +5\r\n\r\n", "not a decimal number"},
           {"GET / HTTP/1.1\r\nTransfer-Encoding: \r\n\r\n", "empty Transfer-Encoding"},
           {"GET / HTTP/1.1\r\nTransfer-Encoding: %63hunked\r\n\r\n", "not a list of codings"},
           {"\r\nGET / HTTP/1.1\r\n\r\n", "line 1 is empty"},
           {"GET / HTTP/1.1\r\n\r\n\r\n", "blank before the end"},
           {"GET / HTTP/1.1\r\nA: b\r\n", "does not end with a blank line"},
       }) {
    const Status s = CheckRequestHead(c.head);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.head;
    EXPECT_NE(s.message().find(c.why), std::string::npos) << c.head << ": " << s.message();
  }
}

TEST(SocketDiagnosticsTest, SayWhy) {
  testing_agent::LoopbackServer taken;
  const int port = taken.Start();
  ASSERT_GT(port, 0);
  EXPECT_EQ(ListenFailureReason("127.0.0.1", port), "address already in use");
  EXPECT_EQ(ListenFailureReason("127.0.0.1", 0), "");
  EXPECT_EQ(ConnectFailureReason("127.0.0.1", port, 2), "");
  EXPECT_EQ(ConnectFailureReason("127.0.0.1", testing_agent::UnusedLoopbackPort(), 2),
            "connection refused");
}

}  // namespace
}  // namespace deltasync::agent_internal
