// The format module's own use of the file system: which files a checkpoint
// directory without an index is made of. Generic file helpers are in
// io/file.h.
#pragma once

#include <string>
#include <vector>

#include "deltasync/status.h"

namespace deltasync::format_internal {

// The names, sorted bytewise, of the files a checkpoint directory without an
// index consists of: every entry of `dir` whose name ends in ".safetensors",
// does not start with '.' (our writers' temporaries are hidden) and is a
// regular file, a symbolic link counting as what it points to (a dangling one
// is skipped, as are directories and special files). IOError naming `dir`
// when it cannot be listed, or naming the entry when it cannot be examined.
Result<std::vector<std::string>> ListSafetensorsFiles(const std::string& dir);

}  // namespace deltasync::format_internal
