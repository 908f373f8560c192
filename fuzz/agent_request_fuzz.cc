// libFuzzer target for what the agent makes of a request's bytes before
// any pull: the /pull_weights body (ParsePullBody), a chunked body
// (ChunkedDecoder) and a request head (CheckRequestHead, BearerToken).
//
// The whole input is taken as each of these. Beyond memory safety (ASan,
// UBSan) it aborts when:
//  - ParsePullBody says ok with a negative target or an error text, or
//    refuses without a known code and a reason, or leaves a target set;
//  - the chunked decoder ends differently, or with other bytes, when the
//    input is fed in pieces (sizes from the first input byte) than when fed
//    whole; puts out more payload than its cap or than it took in; or, on a
//    complete body, does not decode that payload sent again as one chunk
//    to the same bytes;
//  - CheckRequestHead passes a head with a NUL or a bare LF, or one that
//    does not end with CRLF CRLF;
//  - BearerToken returns a token that is empty or holds a space or a
//    control character.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "agent/http_util.h"

namespace {

using deltasync::agent_internal::BearerToken;
using deltasync::agent_internal::CheckRequestHead;
using deltasync::agent_internal::ChunkedDecoder;
using deltasync::agent_internal::ParsePullBody;
using deltasync::agent_internal::PullBody;

constexpr size_t kMaxBody = 4096;  // small, so that the cap is reached

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "agent_request_fuzz: %s\n", what);
    std::abort();
  }
}

void CheckPullBody(std::string_view body) {
  const PullBody parsed = ParsePullBody(body);
  if (parsed.ok()) {
    Check(parsed.error.empty(), "an accepted body carries an error text");
    Check(!parsed.target || *parsed.target >= 0, "a negative target was accepted");
    return;
  }
  Check(parsed.error_code == "invalid_json" || parsed.error_code == "invalid_request" ||
            parsed.error_code == "invalid_target_version",
        "a refusal with an unknown code");
  Check(!parsed.error.empty(), "a refusal without a reason");
  Check(!parsed.target, "a refusal with a target");
}

struct Decoded {
  ChunkedDecoder::State state;
  std::string body;
  size_t used = 0;  // input bytes the decoder took
};

Decoded DecodeInPieces(std::string_view wire, size_t piece) {
  ChunkedDecoder decoder(kMaxBody);
  Decoded out;
  while (out.used < wire.size() && decoder.state() == ChunkedDecoder::State::kMore) {
    const std::string_view next = wire.substr(out.used, piece);
    size_t used = 0;
    decoder.Feed(next, &out.body, &used);
    Check(used <= next.size(), "the decoder took more than it was given");
    Check(decoder.state() != ChunkedDecoder::State::kMore || used == next.size(),
          "the decoder stopped early but wants more");
    out.used += used;
  }
  out.state = decoder.state();
  if (out.state == ChunkedDecoder::State::kMalformed ||
      out.state == ChunkedDecoder::State::kTooLarge) {
    Check(!decoder.error().empty(), "a refused chunked body without a reason");
  }
  return out;
}

void CheckChunked(std::string_view wire, size_t piece) {
  const Decoded whole = DecodeInPieces(wire, wire.size() + 1);
  const Decoded pieces = DecodeInPieces(wire, piece);
  Check(whole.state == pieces.state, "the pieces decode to another state");
  Check(whole.body == pieces.body, "the pieces decode to other bytes");
  Check(whole.used == pieces.used, "the pieces end the body elsewhere");
  Check(whole.body.size() <= kMaxBody, "the payload exceeds the cap");
  Check(whole.body.size() <= whole.used, "more payload than input");
  if (whole.state == ChunkedDecoder::State::kDone) {
    char size_line[32];
    std::snprintf(size_line, sizeof(size_line), "%zx\r\n", whole.body.size());
    const std::string again =
        whole.body.empty() ? std::string("0\r\n\r\n") : size_line + whole.body + "\r\n0\r\n\r\n";
    const Decoded round = DecodeInPieces(again, again.size());
    Check(round.state == ChunkedDecoder::State::kDone, "the re-encoded body does not decode");
    Check(round.body == whole.body, "the re-encoded body decodes to other bytes");
    CheckPullBody(whole.body);
  }
}

void CheckHead(std::string_view head) {
  if (!CheckRequestHead(head).ok()) return;
  Check(head.size() >= 4 && head.substr(head.size() - 4) == "\r\n\r\n",
        "a head that does not end with a blank line passed");
  Check(head.find('\0') == std::string_view::npos, "a head with a NUL passed");
  for (size_t i = 0; i < head.size(); ++i) {
    if (head[i] == '\n') Check(i > 0 && head[i - 1] == '\r', "a head with a bare LF passed");
  }
}

void CheckBearer(std::string_view header) {
  const std::optional<std::string_view> token = BearerToken(header);
  if (!token) return;
  Check(!token->empty(), "an empty bearer token");
  for (char c : *token) {
    const auto u = static_cast<unsigned char>(c);
    Check(u > ' ' && u != 0x7f, "a bearer token with a space or control character");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  CheckPullBody(input);
  CheckHead(input);
  CheckBearer(input);
  const size_t piece = size == 0 ? 1 : 1 + data[0] % 13;
  CheckChunked(input, piece);
  return 0;
}
