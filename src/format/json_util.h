// JSON helpers shared by the format module's readers and writers.
//
// nlohmann::json is a private dependency of ds_format: nothing here appears
// in a public header.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "deltasync/status.h"

namespace deltasync::format_internal {

// Offset of the first byte of `text` that is not part of well-formed UTF-8
// (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF), or
// std::string_view::npos when all of it is well-formed.
size_t FindInvalidUtf8(std::string_view text);

// Parses `text` as exactly one JSON value (surrounding whitespace allowed).
// Stricter than nlohmann's defaults where our formats need it: a key repeated
// within one object is an error (nlohmann would silently keep the last one,
// letting two readers of one file disagree), nesting deeper than `max_depth`
// is an error (bounds what hostile input can make us build), a NUL byte
// anywhere is an error (nlohmann would stop reading at it and accept
// whatever follows), and nothing is thrown. Errors are Corruption; the message names the problem
// and, for syntax errors, its position, but not the file: callers add that.
Result<nlohmann::json> ParseJsonStrict(std::string_view text, int max_depth);

// Appends `text` to `out` as a JSON string literal. `text` must be valid
// UTF-8 (checked by the caller); control characters are escaped.
void AppendJsonString(std::string_view text, std::string* out);

// `text` in single quotes for an error message, with control characters
// escaped and anything past `max_bytes` elided, so that hostile names cannot
// garble or flood a message.
std::string QuoteForMessage(std::string_view text, size_t max_bytes = 200);

}  // namespace deltasync::format_internal
