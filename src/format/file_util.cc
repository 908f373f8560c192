#include "format/file_util.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <string_view>

#include "io/file.h"

namespace deltasync::format_internal {

using io::JoinPath;

Result<std::vector<std::string>> ListSafetensorsFiles(const std::string& dir) {
  static constexpr std::string_view kSuffix = ".safetensors";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return Status::FromErrno(errno, dir + ": open directory");
  std::vector<std::string> names;
  Status status;
  while (true) {
    errno = 0;
    const struct dirent* entry = ::readdir(d);
    if (entry == nullptr) {
      if (errno != 0) status = Status::FromErrno(errno, dir + ": read directory");
      break;
    }
    const std::string_view name = entry->d_name;
    if (name.empty() || name[0] == '.' || !name.ends_with(kSuffix)) continue;
    const std::string path = JoinPath(dir, name);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      // ENOENT: a dangling link, or an entry removed since it was listed.
      if (errno == ENOENT) continue;
      status = Status::FromErrno(errno, path + ": stat");
      break;
    }
    if (S_ISREG(st.st_mode)) names.emplace_back(name);
  }
  ::closedir(d);
  if (!status.ok()) return status;
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace deltasync::format_internal
