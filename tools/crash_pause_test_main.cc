// deltasync-crash-pause: the `deltasync` CLI plus fault injection, for the
// end-to-end tests only (never installed), which must kill a real agent at a
// known instant of an apply: a timing-based kill would land anywhere or
// nowhere. The shipped binary has none of this.
//
// With DELTASYNC_TEST_PAUSE_AT=<crash point> (the names passed to
// store_internal::CrashPoint, e.g. "apply:record") in the environment, the
// first thread to reach that point prints "deltasync agent: paused at crash
// point <point>" on stderr, and every thread that reaches it stops there
// until the process is killed. Unset or empty, nothing is installed and the
// binary behaves as `deltasync`.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>

#include "cli_util.h"
#include "store/store_internal.h"

namespace {

const char* g_pause_point = nullptr;

void PauseAtCrashPoint(std::string_view point) {
  if (g_pause_point == nullptr || point != g_pause_point) return;
  static std::atomic<bool> announced{false};
  if (!announced.exchange(true)) {
    const std::string line = "deltasync agent: paused at crash point " + std::string(point) + "\n";
    (void)!::write(2, line.data(), line.size());
  }
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace

int main(int argc, char** argv) {
  const char* point = std::getenv("DELTASYNC_TEST_PAUSE_AT");
  if (point != nullptr && *point != '\0') {
    g_pause_point = point;
    deltasync::store_internal::SetCrashHookForTesting(&PauseAtCrashPoint);
  }
  return deltasync::cli::Main(argc, argv);
}
