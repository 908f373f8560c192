// Small pieces shared by the agent and the coordinator.
#pragma once

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
};

// Parses "http://host[:port][/path]", "https://..." or "host:port[/path]"
// (http). IPv6 hosts go in brackets. InvalidArgument naming the URL for an
// unknown scheme, an empty host, a bad port, or a query or fragment.
Result<HttpUrl> ParseHttpUrl(const std::string& url);

// Shortest text that reads back as the same double ("0.5", "1e-06", "+Inf").
std::string FormatDouble(double value);

}  // namespace deltasync::agent_internal
