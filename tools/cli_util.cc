#include "cli_util.h"

#include <unistd.h>

#include <cstdio>
#include <iostream>

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

}  // namespace deltasync::cli
