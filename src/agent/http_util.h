// Small pieces shared by the agent and the coordinator: URL, request body and
// HTTP framing parsers (pure functions, fuzzed by fuzz/agent_request_fuzz.cc)
// and socket diagnostics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "deltasync/status.h"

namespace deltasync::agent_internal {

// Compares in time that depends only on the lengths, so that a token check
// does not reveal how many leading characters of a guess were right.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// An http(s) URL split the way httplib's Client wants it.
struct HttpUrl {
  std::string scheme_host_port;  // "http://host:port" (port defaulted per scheme)
  std::string path;              // "" or "/prefix" without a trailing '/'
  std::string host;              // without brackets: "127.0.0.1", "::1", "example.com"
  int port = 0;
};

// Parses "http://host[:port][/path]", "https://..." or "host:port[/path]"
// (http). IPv6 hosts go in brackets. InvalidArgument "URL '<url>': <why>"
// for an unknown scheme, an empty host, a bad port, or a query or fragment.
Result<HttpUrl> ParseHttpUrl(const std::string& url);

// Shortest text that reads back as the same double ("0.5", "1e-06", "+Inf").
std::string FormatDouble(double value);

// ---------------------------------------------------------------------------
// /pull_weights

// What a /pull_weights body asks for. When `error_code` is set the body is
// refused with 400 and that code ("invalid_json", "invalid_request",
// "invalid_target_version") and `error` as the reason; otherwise `target` is
// the version to pull, nullopt meaning the store's latest.
struct PullBody {
  std::optional<int64_t> target;
  std::string error_code;
  std::string error;
  bool ok() const { return error_code.empty(); }
};

// Parses a /pull_weights body (docs/format.md, "POST /pull_weights"): empty
// or whitespace, {}, {"target_version": null | "latest"} pull the latest;
// {"target_version": N} or {"target_version": "N"} with 0 <= N <= INT64_MAX
// pull N. Other fields are ignored. A NUL byte anywhere is invalid JSON.
// Never throws, whatever the bytes.
PullBody ParsePullBody(std::string_view body);

// The token of an Authorization header value "Bearer <token>" (scheme case
// insensitive, spaces around the token dropped); nullopt when the value is
// not of that form or the token is empty or holds a control character
// (a NUL included: the whole value is compared, never a C-string prefix).
std::optional<std::string_view> BearerToken(std::string_view header);

// Decodes a chunked request body (RFC 9112 section 7.1) fed in pieces, as
// it arrives: chunk sizes of hex digits only (at most 15 of them), optional
// chunk extensions, every line ended by CRLF, an optional trailer section.
// The body may not exceed `max_body` bytes: a chunk that would take it past
// the cap is refused before its data is read.
class ChunkedDecoder {
 public:
  enum class State { kMore, kDone, kMalformed, kTooLarge };
  explicit ChunkedDecoder(size_t max_body) : max_body_(max_body) {}
  // Consumes bytes of `data` and appends the payload to `*body`, stopping
  // at the end of the chunked body or at the first error. Returns the new
  // state; `*consumed` (when given) is how many bytes of `data` were used.
  // Once the state is not kMore, further calls change nothing.
  State Feed(std::string_view data, std::string* body, size_t* consumed = nullptr);
  State state() const { return state_; }
  // Why the body is malformed or too large (one line); empty otherwise.
  const std::string& error() const { return error_; }

 private:
  enum class Phase { kSize, kExtension, kSizeLf, kData, kDataCr, kDataLf, kTrailer, kTrailerLf };
  State Fail(State state, std::string why);

  size_t max_body_;
  State state_ = State::kMore;
  Phase phase_ = Phase::kSize;
  std::string error_;
  uint64_t chunk_size_ = 0;  // of the chunk being read (kSize .. kData)
  uint64_t chunk_left_ = 0;  // bytes of its data still to come (kData)
  int size_digits_ = 0;
  bool saw_semicolon_ = false;  // in the current chunk extension
  size_t line_bytes_ = 0;       // of the current chunk extension
  std::string trailer_line_;    // the trailer field line being read
  size_t trailer_bytes_ = 0;    // of the whole trailer section
  size_t total_ = 0;            // payload bytes so far
};

// The end of a request head (request line and header fields): the offset
// just past the first CRLF CRLF in `bytes`, or npos when it has not arrived.
size_t FindRequestHeadEnd(std::string_view bytes);

// Checks the framing of a request head (everything up to and including the
// blank line) before the HTTP parser sees it, which silently skips lines
// it cannot parse: every line ends with CRLF, no other control character
// than HTAB appears (no NUL, bare CR or bare LF), no field line is folded
// (starts with a space or tab), every field line has a non-empty name of
// token characters directly followed by ':', and the framing fields, which
// the parser would drop when empty and percent-decode otherwise, hold what
// they say as sent: Content-Length a decimal number, Transfer-Encoding a
// list of codings without '%'. InvalidArgument naming the problem and the
// line number otherwise.
Status CheckRequestHead(std::string_view head);

// ---------------------------------------------------------------------------
// Socket diagnostics (the HTTP library reports no errno)

// Why binding and listening on host:port fails now, e.g. "address already
// in use" or "cannot resolve 'h': Name or service not known"; empty when it
// succeeds (the socket is closed again at once).
std::string ListenFailureReason(const std::string& host, int port);

// Why a TCP connection to host:port fails now, within `timeout_seconds`,
// e.g. "connection refused", "no route to host", "timed out"; empty when it
// succeeds (the connection is closed again at once).
std::string ConnectFailureReason(const std::string& host, int port, double timeout_seconds);

}  // namespace deltasync::agent_internal
