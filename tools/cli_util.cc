#include "cli_util.h"

#include <memory>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"

namespace deltasync::cli {

int Fail(const Status& status) {
  return Fail(status.message().empty() ? status.ToString() : status.message());
}

int Fail(const std::string& message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::cerr << "deltasync: error: " << line << std::endl;
  return 1;
}

bool StdoutIsTerminal() { return isatty(STDOUT_FILENO) == 1; }

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[unit]);
  }
  return buf;
}

std::string FormatSeconds(double seconds) {
  // Decimals for three significant digits: 2 from 1 s, none from 100 s,
  // one more per decade below 1 s down to a microsecond.
  int decimals = 2;
  const double magnitude = std::fabs(seconds);
  for (double v = magnitude; decimals > 0 && v >= 10; v /= 10) --decimals;
  for (double v = magnitude; decimals < 6 && v > 0 && v < 1; v *= 10) ++decimals;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f s", decimals, seconds);
  return buf;
}

Result<std::vector<int>> ParseCounts(const std::string& flag, const std::string& text, int most) {
  std::vector<int> out;
  size_t at = 0;
  for (;;) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? comma : comma - at);
    char* end = nullptr;
    const long n = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || n < 1 || n > most) {
      return Status::InvalidArgument(flag + ": '" + item + "' is not a count in [1, " +
                                     std::to_string(most) + "]");
    }
    out.push_back(static_cast<int>(n));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

Result<uint64_t> ParseByteSize(const std::string& text) {
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (UINT64_MAX - digit) / 10)
      return Status::InvalidArgument("byte size '" + text + "' overflows");
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) return Status::InvalidArgument("byte size '" + text + "' must start with a number");
  const std::string suffix = text.substr(i);
  struct Unit {
    const char* name;
    uint64_t factor;
  };
  static const Unit kUnits[] = {{"", 1},
                                {"B", 1},
                                {"KiB", 1ull << 10},
                                {"MiB", 1ull << 20},
                                {"GiB", 1ull << 30},
                                {"TiB", 1ull << 40},
                                {"KB", 1000ull},
                                {"MB", 1000ull * 1000},
                                {"GB", 1000ull * 1000 * 1000},
                                {"TB", 1000ull * 1000 * 1000 * 1000}};
  for (const Unit& u : kUnits) {
    if (suffix == u.name) {
      if (value > UINT64_MAX / u.factor)
        return Status::InvalidArgument("byte size '" + text + "' overflows");
      return value * u.factor;
    }
  }
  return Status::InvalidArgument(
      "byte size '" + text + "' has an unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)");
}

std::string EncodingHelp(std::string_view default_encoding) {
  std::string help;
  std::vector<std::string_view> python;
  for (Encoding encoding : AllEncodings()) {
    const EncodingInfo& info = GetEncodingInfo(encoding);
    if (!help.empty()) help += " | ";
    help += info.name;
    if (info.name == default_encoding) help += " (default)";
    if (info.read_by_python_receiver) python.push_back(info.name);
  }
  for (size_t i = 0; i < python.size(); ++i) {
    help += i == 0 ? "; the Python receiver reads " : i + 1 == python.size() ? " and " : ", ";
    help += python[i];
  }
  return help;
}

void AddPublishFlags(CLI::App* cmd, const std::string& receivers, PublishFlags* flags) {
  cmd->add_option("--store", flags->store, "Store directory (created if missing)")->required();
  cmd->add_option("--old", flags->old_ckpt, "Checkpoint the " + receivers + " hold now")
      ->required();
  cmd->add_option("--new", flags->new_ckpt, "Checkpoint to publish")->required();
  cmd->add_option("--encoding,-e", flags->encoding, EncodingHelp(flags->encoding))
      ->capture_default_str();
  cmd->add_option("--checksum,-c", flags->checksum,
                  "xxh3-128 (default) | xxh3-64 | blake3 | adler32")
      ->capture_default_str();
  cmd->add_flag("--full", flags->full, "Publish a full version (resets the chain)");
}

Status ApplyPublishFlags(const PublishFlags& flags, PublisherOptions* options) {
  options->store = flags.store;
  DS_ASSIGN_OR_RETURN(options->encoding, ParseEncoding(flags.encoding));
  DS_ASSIGN_OR_RETURN(options->checksum, ParseChecksumAlgo(flags.checksum));
  return Status::OK();
}

void RegisterHiddenCommand(CLI::App& app, const std::string& name,
                           std::function<int(const std::vector<std::string>&)> body,
                           CommandFn* run) {
  auto args = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand(name, "");
  cmd->group("");
  cmd->allow_extras();
  cmd->callback([args, run, cmd, body] {
    *args = cmd->remaining();
    *run = [args, body]() -> int { return body(*args); };
  });
}

}  // namespace deltasync::cli
