// The store's fault injection and the boot id its local checkpoints record.

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>

#include "store/store_internal.h"

namespace deltasync::store_internal {
namespace {

std::atomic<CrashHook> g_crash_hook{nullptr};

std::mutex g_boot_mu;
std::optional<std::string> g_boot_override;

}  // namespace

void SetCrashHookForTesting(CrashHook hook) { g_crash_hook.store(hook); }

void CrashPoint(std::string_view point) {
  if (CrashHook hook = g_crash_hook.load(std::memory_order_relaxed)) hook(point);
}

void SetBootIdForTesting(std::optional<std::string> boot_id) {
  std::lock_guard<std::mutex> lock(g_boot_mu);
  g_boot_override = std::move(boot_id);
}

std::string CurrentBootId() {
  {
    std::lock_guard<std::mutex> lock(g_boot_mu);
    if (g_boot_override) return *g_boot_override;
  }
  // A /proc file reports size 0: read until EOF rather than by its size.
  const int fd = ::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buf[128];
  ssize_t n;
  do {
    n = ::read(fd, buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n <= 0) return "";
  std::string id(buf, static_cast<size_t>(n));
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

}  // namespace deltasync::store_internal
