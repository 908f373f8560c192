// Running external programs (the store's hooks).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "deltasync/status.h"

namespace deltasync::io {

// Runs `executable` with `args` (no shell), stdio inherited, and waits.
// Aborted naming `what`, the executable and the exit status when it exits
// non-zero or dies of a signal; IOError when it cannot be started.
Status RunHook(const std::string& executable, const std::vector<std::string>& args,
               std::string_view what);

}  // namespace deltasync::io
