// Internals shared by the store module's sources and tests: test-only
// fault injection and the boot id a local checkpoint records. Generic file
// helpers are in io/.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace deltasync::store_internal {

// ---------------------------------------------------------------------------
// Fault injection (tests only). Production code calls CrashPoint at every
// step whose interruption must be survivable; a test installs a hook that
// ends the process there (_exit) to simulate kill -9 at that instant.

using CrashHook = void (*)(std::string_view point);
// nullptr removes the hook.
void SetCrashHookForTesting(CrashHook hook);
// Calls the hook, if any. Thread-safe; may be called from pool tasks.
void CrashPoint(std::string_view point);

// Overrides the boot id that CurrentBootId reports (nullopt: the real one),
// so tests can simulate a reboot.
void SetBootIdForTesting(std::optional<std::string> boot_id);
// /proc/sys/kernel/random/boot_id without its newline; "" when unreadable.
std::string CurrentBootId();

}  // namespace deltasync::store_internal
