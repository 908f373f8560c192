#include "agent/http_util.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

namespace deltasync::agent_internal {

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited whatever the contents; the
  // index into the shorter one wraps instead of branching on the data.
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char ca = a.empty() ? 0 : static_cast<unsigned char>(a[i % a.size()]);
    const unsigned char cb = b.empty() ? 0 : static_cast<unsigned char>(b[i % b.size()]);
    diff |= static_cast<unsigned>(ca ^ cb);
  }
  return diff == 0;
}

Result<HttpUrl> ParseHttpUrl(const std::string& url) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("URL '" + url + "': " + why);
  };
  std::string_view rest = url;
  std::string scheme = "http";
  if (const size_t sep = rest.find("://"); sep != std::string_view::npos) {
    scheme = std::string(rest.substr(0, sep));
    rest.remove_prefix(sep + 3);
  }
  if (scheme != "http" && scheme != "https") return bad("scheme must be http or https");
  if (rest.find_first_of("?#") != std::string_view::npos) {
    return bad("a query or fragment is not allowed");
  }
  for (char c : rest) {
    if (static_cast<unsigned char>(c) <= ' ' || c == 0x7f)
      return bad("contains a space or control character");
  }
  const size_t slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  std::string path = slash == std::string_view::npos ? "" : std::string(rest.substr(slash));
  while (!path.empty() && path.back() == '/') path.pop_back();
  if (authority.find('@') != std::string_view::npos) return bad("user info is not allowed");

  std::string_view host;
  std::string_view port_text;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == std::string_view::npos) return bad("unterminated '[' in the host");
    host = authority.substr(0, close + 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return bad("unexpected text after the host");
      port_text = after.substr(1);
      if (port_text.empty()) return bad("empty port");
    }
  } else {
    const size_t colon = authority.find(':');
    host = authority.substr(0, colon);
    if (colon != std::string_view::npos) {
      port_text = authority.substr(colon + 1);
      if (port_text.empty()) return bad("empty port");
    }
  }
  if (host.empty() || host == "[]") return bad("empty host");
  int port = scheme == "https" ? 443 : 80;
  if (!port_text.empty()) {
    const char* end = port_text.data() + port_text.size();
    auto [ptr, ec] = std::from_chars(port_text.data(), end, port);
    if (ec != std::errc() || ptr != end || port < 1 || port > 65535) {
      return bad("port must be a number in 1..65535");
    }
  }
  HttpUrl out;
  out.scheme_host_port = scheme + "://" + std::string(host) + ":" + std::to_string(port);
  out.path = std::move(path);
  out.host = std::string(host.front() == '[' ? host.substr(1, host.size() - 2) : host);
  out.port = port;
  return out;
}

std::string FormatDouble(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  if (ec != std::errc()) return "NaN";
  return std::string(buf, ptr);
}

// ---------------------------------------------------------------------------
// /pull_weights

PullBody ParsePullBody(std::string_view body) {
  using nlohmann::json;
  PullBody out;
  auto refuse = [&](const char* code, std::string why) {
    out.target.reset();
    out.error_code = code;
    out.error = std::move(why);
    return out;
  };
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) return out;
  // JSON text holds no raw NUL, and the parser would take one for the end
  // of the input, ignoring whatever follows it.
  if (body.find('\0') != std::string_view::npos) {
    return refuse("invalid_json", "request body holds a NUL byte");
  }
  const json parsed = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return refuse("invalid_json", "request body is not valid JSON");
  if (!parsed.is_object()) return refuse("invalid_request", "request body must be a JSON object");
  auto it = parsed.find("target_version");
  if (it == parsed.end() || it->is_null()) return out;
  const json& t = *it;
  auto bad_target = [&](const std::string& why) {
    return refuse("invalid_target_version", "target_version " + why);
  };
  if (t.is_number_unsigned()) {
    const uint64_t v = t.get<uint64_t>();
    if (v > static_cast<uint64_t>(INT64_MAX)) return bad_target("is out of range");
    out.target = static_cast<int64_t>(v);
    return out;
  }
  if (t.is_number_integer()) {
    const int64_t v = t.get<int64_t>();
    if (v < 0) return bad_target("must be >= 0, got " + std::to_string(v));
    out.target = v;
    return out;
  }
  if (t.is_string()) {
    const std::string& s = t.get_ref<const std::string&>();
    if (s == "latest") return out;
    int64_t v = 0;
    const char* end = s.data() + s.size();
    auto [ptr, ec] = std::from_chars(s.data(), end, v);
    const bool all_digits =
        !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
    if (!all_digits || ec != std::errc() || ptr != end) {
      return bad_target("must be a non-negative integer or \"latest\"");
    }
    out.target = v;
    return out;
  }
  return bad_target("must be a non-negative integer or \"latest\"");
}

namespace {

bool IsControl(unsigned char c) { return (c < 0x20 && c != '\t') || c == 0x7f; }

// RFC 9110 tchar.
bool IsTokenChar(unsigned char c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  return c != 0 && std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

// A field line (no CRLF): a token name directly followed by ':'. Empty when
// it is one, else why not.
std::string FieldLineProblem(std::string_view line) {
  if (!line.empty() && (line.front() == ' ' || line.front() == '\t')) {
    return "is folded onto the previous one (starts with a space or tab)";
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return "has no ':'";
  if (colon == 0) return "has an empty field name";
  for (size_t i = 0; i < colon; ++i) {
    if (!IsTokenChar(static_cast<unsigned char>(line[i]))) {
      return "has a field name that is not a token (a space before ':'?)";
    }
  }
  return {};
}

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

// The raw value of a Content-Length or Transfer-Encoding field line (which
// FieldLineProblem accepted). The HTTP parser drops a field with an empty
// value and percent-decodes the others, so what it would make of these
// framing fields is checked here, on the bytes as sent: a decimal number, a
// list of transfer codings without '%'. Empty when the value is fine (or
// the field is another one), else why not.
std::string FramingValueProblem(std::string_view line) {
  const size_t colon = line.find(':');
  const std::string_view name = line.substr(0, colon);
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
  if (EqualsIgnoringCase(name, "Content-Length")) {
    if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
      return "has a Content-Length that is not a decimal number";
    }
  } else if (EqualsIgnoringCase(name, "Transfer-Encoding")) {
    if (value.empty()) return "has an empty Transfer-Encoding";
    for (char c : value) {
      const auto u = static_cast<unsigned char>(c);
      if (u == '%' || !(IsTokenChar(u) || u == ',' || u == ' ' || u == '\t')) {
        return "has a Transfer-Encoding that is not a list of codings";
      }
    }
  }
  return {};
}

std::string HexByte(unsigned char c) {
  static const char kDigits[] = "0123456789abcdef";
  return std::string("0x") + kDigits[c >> 4] + kDigits[c & 15];
}

}  // namespace

std::optional<std::string_view> BearerToken(std::string_view header) {
  constexpr std::string_view kScheme = "bearer ";
  if (header.size() < kScheme.size()) return std::nullopt;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != kScheme[i]) return std::nullopt;
  }
  header.remove_prefix(kScheme.size());
  while (!header.empty() && header.front() == ' ') header.remove_prefix(1);
  while (!header.empty() && header.back() == ' ') header.remove_suffix(1);
  if (header.empty()) return std::nullopt;
  for (char c : header) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= ' ' || u == 0x7f) return std::nullopt;
  }
  return header;
}

ChunkedDecoder::State ChunkedDecoder::Fail(State state, std::string why) {
  state_ = state;
  error_ = std::move(why);
  return state_;
}

ChunkedDecoder::State ChunkedDecoder::Feed(std::string_view data, std::string* body,
                                           size_t* consumed) {
  // Longest chunk extension line and trailer section taken: they carry
  // nothing the agent uses.
  constexpr size_t kMaxExtensionBytes = 4096;
  constexpr size_t kMaxTrailerBytes = 8192;
  size_t i = 0;
  auto done = [&](State s) {
    if (consumed != nullptr) *consumed = i;
    return s;
  };
  if (state_ != State::kMore) return done(state_);
  while (i < data.size()) {
    if (phase_ == Phase::kData) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_left_, data.size() - i));
      body->append(data.data() + i, n);
      i += n;
      chunk_left_ -= n;
      total_ += n;
      if (chunk_left_ == 0) phase_ = Phase::kDataCr;
      continue;
    }
    const auto c = static_cast<unsigned char>(data[i++]);
    switch (phase_) {
      case Phase::kSize: {
        int digit = -1;
        if (c >= '0' && c <= '9') digit = c - '0';
        if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
        if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
        if (digit >= 0) {
          if (++size_digits_ > 15) {
            return done(Fail(State::kMalformed, "chunk size has more than 15 hex digits"));
          }
          chunk_size_ = chunk_size_ * 16 + static_cast<uint64_t>(digit);
        } else if (size_digits_ == 0) {
          return done(Fail(State::kMalformed, "chunk size is not a hexadecimal number (got " +
                                                  HexByte(c) + " first)"));
        } else if (c == '\r') {
          phase_ = Phase::kSizeLf;
        } else if (c == ';' || c == ' ' || c == '\t') {
          phase_ = Phase::kExtension;
          line_bytes_ = 0;
          saw_semicolon_ = c == ';';
        } else {
          return done(
              Fail(State::kMalformed, "unexpected byte " + HexByte(c) + " after the chunk size"));
        }
        break;
      }
      case Phase::kExtension:
        if (++line_bytes_ > kMaxExtensionBytes) {
          return done(Fail(State::kMalformed, "chunk extension is longer than 4096 bytes"));
        }
        if (c == '\r') {
          if (!saw_semicolon_) {
            return done(Fail(State::kMalformed, "whitespace after the chunk size without ';'"));
          }
          phase_ = Phase::kSizeLf;
        } else if (IsControl(c)) {
          return done(
              Fail(State::kMalformed, "control character " + HexByte(c) + " in a chunk extension"));
        } else if (c == ';') {
          saw_semicolon_ = true;
        } else if (!saw_semicolon_ && c != ' ' && c != '\t') {
          return done(
              Fail(State::kMalformed, "unexpected byte " + HexByte(c) + " after the chunk size"));
        }
        break;
      case Phase::kSizeLf:
        if (c != '\n') {
          return done(Fail(State::kMalformed, "chunk size line does not end with CRLF"));
        }
        if (chunk_size_ == 0) {
          phase_ = Phase::kTrailer;
          line_bytes_ = 0;
          trailer_line_.clear();
        } else if (chunk_size_ > max_body_ - total_) {
          return done(Fail(State::kTooLarge, "request body exceeds the limit of " +
                                                 std::to_string(max_body_) + " bytes"));
        } else {
          chunk_left_ = chunk_size_;
          phase_ = Phase::kData;
        }
        break;
      case Phase::kDataCr:
        if (c != '\r') return done(Fail(State::kMalformed, "chunk data is not followed by CRLF"));
        phase_ = Phase::kDataLf;
        break;
      case Phase::kDataLf:
        if (c != '\n') return done(Fail(State::kMalformed, "chunk data is not followed by CRLF"));
        chunk_size_ = 0;
        size_digits_ = 0;
        phase_ = Phase::kSize;
        break;
      case Phase::kTrailer:
        if (++trailer_bytes_ > kMaxTrailerBytes) {
          return done(Fail(State::kMalformed, "chunked trailer is longer than 8192 bytes"));
        }
        if (c == '\r') {
          phase_ = Phase::kTrailerLf;
        } else if (IsControl(c)) {
          return done(Fail(State::kMalformed,
                           "control character " + HexByte(c) + " in the chunked trailer"));
        } else {
          trailer_line_ += static_cast<char>(c);
        }
        break;
      case Phase::kTrailerLf: {
        if (c != '\n') {
          return done(Fail(State::kMalformed, "chunked trailer line does not end with CRLF"));
        }
        if (trailer_line_.empty()) {
          state_ = State::kDone;
          return done(state_);
        }
        const std::string problem = FieldLineProblem(trailer_line_);
        if (!problem.empty()) {
          return done(Fail(State::kMalformed, "chunked trailer field " + problem));
        }
        trailer_line_.clear();
        phase_ = Phase::kTrailer;
        break;
      }
      case Phase::kData: break;  // handled above
    }
  }
  return done(state_);
}

size_t FindRequestHeadEnd(std::string_view bytes) {
  const size_t at = bytes.find("\r\n\r\n");
  return at == std::string_view::npos ? std::string_view::npos : at + 4;
}

Status CheckRequestHead(std::string_view head) {
  size_t line_start = 0;
  int line_number = 1;
  for (size_t i = 0; i < head.size(); ++i) {
    const auto c = static_cast<unsigned char>(head[i]);
    auto bad = [&](const std::string& why) {
      return Status::InvalidArgument("request head line " + std::to_string(line_number) + " " +
                                     why);
    };
    if (c == '\n') return bad("has a bare LF (lines must end with CRLF)");
    if (c == '\r') {
      if (i + 1 >= head.size() || head[i + 1] != '\n') return bad("has a bare CR");
      const std::string_view line = head.substr(line_start, i - line_start);
      if (line_number == 1 && line.empty()) return bad("is empty (no request line)");
      if (line_number > 1 && !line.empty()) {
        const std::string problem = FieldLineProblem(line);
        if (!problem.empty()) return bad(problem);
        const std::string framing = FramingValueProblem(line);
        if (!framing.empty()) return bad(framing);
      }
      if (line_number > 1 && line.empty()) {
        if (i + 2 != head.size()) return bad("is blank before the end of the head");
        return Status::OK();
      }
      ++i;
      line_start = i + 1;
      ++line_number;
      continue;
    }
    if (IsControl(c)) return bad("holds control character " + HexByte(c));
  }
  return Status::InvalidArgument("request head does not end with a blank line");
}

// ---------------------------------------------------------------------------
// Socket diagnostics

namespace {

// strerror's text with a lower-case first letter, for the middle of a message.
std::string ErrnoText(int err) {
  char buf[256];
  std::string text = strerror_r(err, buf, sizeof(buf));
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head != nullptr) ::freeaddrinfo(head);
  }
};

// Resolves host:port for a TCP socket; on failure returns the reason.
std::string Resolve(const std::string& host, int port, int flags, AddrInfoList* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out->head);
  if (rc != 0) {
    return "cannot resolve '" + host +
           "': " + (rc == EAI_SYSTEM ? ErrnoText(errno) : std::string(::gai_strerror(rc)));
  }
  return {};
}

}  // namespace

std::string ListenFailureReason(const std::string& host, int port) {
  AddrInfoList addrs;
  if (std::string why = Resolve(host, port, AI_PASSIVE, &addrs); !why.empty()) return why;
  std::string reason = "no address to bind";
  for (addrinfo* ai = addrs.head; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      reason = ErrnoText(errno);
      continue;
    }
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    const bool ok = ::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1) == 0;
    const int err = errno;
    ::close(fd);
    if (ok) return {};
    reason = ErrnoText(err);
  }
  return reason;
}

std::string ConnectFailureReason(const std::string& host, int port, double timeout_seconds) {
  AddrInfoList addrs;
  if (std::string why = Resolve(host, port, 0, &addrs); !why.empty()) return why;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::max(0.0, timeout_seconds)));
  std::string reason = "no address to connect to";
  for (addrinfo* ai = addrs.head; ai != nullptr; ai = ai->ai_next) {
    const int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      reason = ErrnoText(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        pollfd p{fd, POLLOUT, 0};
        const int ready = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
        if (ready == 0) {
          err = ETIMEDOUT;
        } else {
          socklen_t len = sizeof(err);
          if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
      }
    }
    ::close(fd);
    if (err == 0) return {};
    reason = ErrnoText(err);
  }
  return reason;
}

}  // namespace deltasync::agent_internal
