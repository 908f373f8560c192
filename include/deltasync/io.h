// File-system operations the library's own tools and benchmarks need from
// outside it. The library's other file helpers are internal (src/io/).
#pragma once

#include <string>

#include "deltasync/status.h"

namespace deltasync::io {

// Syncs every regular file under `dir` (recursively) and asks the kernel to
// drop its cached pages (POSIX_FADV_DONTNEED), so that the next reader gets
// them from the disk, as if another host had written them. Pages another
// process keeps mapped may stay cached; the call is advisory past the sync.
// IOError naming the directory when it cannot be walked, or naming the file
// when one cannot be opened or synced.
Status DropFromPageCache(const std::string& dir);

}  // namespace deltasync::io
