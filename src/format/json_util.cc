#include "format/json_util.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace deltasync::format_internal {
namespace {

using nlohmann::json;

// Builds a DOM from SAX events, refusing duplicate keys and deep nesting.
// nlohmann's own DOM builder cannot report duplicates: by the time a value
// lands in the object the earlier one is already gone.
class StrictDomBuilder {
 public:
  explicit StrictDomBuilder(int max_depth) : max_depth_(max_depth) {}

  bool null() { return Put(json(nullptr)); }
  bool boolean(bool value) { return Put(json(value)); }
  bool number_integer(json::number_integer_t value) { return Put(json(value)); }
  bool number_unsigned(json::number_unsigned_t value) { return Put(json(value)); }
  bool number_float(json::number_float_t value, const json::string_t& /*text*/) {
    return Put(json(value));
  }
  bool string(json::string_t& value) { return Put(json(std::move(value))); }
  bool binary(json::binary_t& /*value*/) {
    error_ = "binary values are not JSON";
    return false;
  }
  bool start_object(size_t /*elements*/) { return Open(json::object()); }
  bool key(json::string_t& key) {
    json* object = stack_.back();
    if (object->contains(key)) {
      error_ = "duplicate key " + QuoteForMessage(key) + " in one JSON object";
      return false;
    }
    pending_key_ = std::move(key);
    return true;
  }
  bool end_object() {
    stack_.pop_back();
    return true;
  }
  bool start_array(size_t /*elements*/) { return Open(json::array()); }
  bool end_array() {
    stack_.pop_back();
    return true;
  }
  bool parse_error(size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) {
    // what() starts with "[json.exception.parse_error.101] "; the id means
    // nothing to a reader of our messages.
    std::string_view what = ex.what();
    if (size_t close = what.find("] "); !what.empty() && what[0] == '[' && close != what.npos) {
      what.remove_prefix(close + 2);
    }
    error_ = "invalid JSON: " + std::string(what);
    return false;
  }

  json& root() { return root_; }
  const std::string& error() const { return error_; }

 private:
  // Places a value at the current position; returns the stored copy.
  json* Place(json&& value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    json* parent = stack_.back();
    if (parent->is_object()) {
      json& slot = (*parent)[pending_key_];
      slot = std::move(value);
      return &slot;
    }
    // Only the last element of an array is ever on the stack, and it is
    // popped before the next element is pushed, so the pointer stays valid.
    parent->push_back(std::move(value));
    return &parent->back();
  }
  bool Put(json&& value) {
    Place(std::move(value));
    return true;
  }
  bool Open(json&& container) {
    if (static_cast<int>(stack_.size()) >= max_depth_) {
      error_ = "JSON nested deeper than " + std::to_string(max_depth_) + " levels";
      return false;
    }
    stack_.push_back(Place(std::move(container)));
    return true;
  }

  const int max_depth_;
  json root_;
  std::vector<json*> stack_;
  std::string pending_key_;
  std::string error_;
};

}  // namespace

size_t FindInvalidUtf8(std::string_view text) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const size_t size = text.size();
  size_t i = 0;
  while (i < size) {
    const uint8_t lead = bytes[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    uint8_t second_min = 0x80, second_max = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) second_min = 0xA0;  // overlong below U+0800
      if (lead == 0xED) second_max = 0x9F;  // UTF-16 surrogates
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) second_min = 0x90;  // overlong below U+10000
      if (lead == 0xF4) second_max = 0x8F;  // past U+10FFFF
    } else {
      return i;  // continuation byte, overlong C0/C1, or F5..FF
    }
    if (size - i < length) return i;
    if (bytes[i + 1] < second_min || bytes[i + 1] > second_max) return i;
    for (size_t k = 2; k < length; ++k) {
      if ((bytes[i + k] & 0xC0) != 0x80) return i;
    }
    i += length;
  }
  return std::string_view::npos;
}

Result<nlohmann::json> ParseJsonStrict(std::string_view text, int max_depth) {
  // nlohmann's lexer takes a NUL byte for the end of the input and ignores
  // everything after it, so "{}\0<anything>" would parse as "{}". No JSON
  // text holds a raw NUL (inside a string it must be escaped), so any NUL is
  // refused before parsing.
  if (const size_t nul = text.find('\0'); nul != text.npos) {
    return Status::Corruption("invalid JSON: NUL byte at offset " + std::to_string(nul) +
                              " (only space, tab, CR and LF may follow a JSON value)");
  }
  StrictDomBuilder builder(max_depth);
  const bool ok = json::sax_parse(text.data(), text.data() + text.size(), &builder,
                                  json::input_format_t::json, /*strict=*/true,
                                  /*ignore_comments=*/false);
  if (!ok) {
    return Status::Corruption(builder.error().empty() ? std::string("invalid JSON")
                                                      : builder.error());
  }
  return std::move(builder.root());
}

void AppendJsonString(std::string_view text, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (char c : text) {
    const auto byte = static_cast<uint8_t>(c);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      default:
        if (byte < 0x20) {
          out->append("\\u00");
          out->push_back(kHex[byte >> 4]);
          out->push_back(kHex[byte & 0xF]);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

std::string QuoteForMessage(std::string_view text, size_t max_bytes) {
  bool elided = false;
  if (text.size() > max_bytes) {
    size_t cut = max_bytes;
    // Back off to a character boundary so the message stays valid UTF-8.
    while (cut > 0 && (static_cast<uint8_t>(text[cut]) & 0xC0) == 0x80) --cut;
    text = text.substr(0, cut);
    elided = true;
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (char c : text) {
    const auto byte = static_cast<uint8_t>(c);
    if (byte < 0x20 || byte == 0x7F) {
      out += "\\x";
      out.push_back(kHex[byte >> 4]);
      out.push_back(kHex[byte & 0xF]);
    } else if (c == '\'' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else {
      out.push_back(c);
    }
  }
  out += elided ? "...'" : "'";
  return out;
}

}  // namespace deltasync::format_internal
