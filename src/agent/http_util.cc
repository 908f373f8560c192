#include "agent/http_util.h"

#include <charconv>
#include <cmath>
#include <cstdint>

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

}  // namespace deltasync::agent_internal
