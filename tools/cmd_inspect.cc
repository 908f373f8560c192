// deltasync inspect PATH [--json]: tensors, dtypes, shapes, bytes, metadata
// and totals of a safetensors file or a checkpoint directory.
#include <sys/stat.h>

#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "deltasync/checkpoint.h"
#include "deltasync/store.h"

namespace deltasync::cli {
namespace {

struct DTypeTotal {
  uint64_t tensors = 0;
  uint64_t bytes = 0;
};

nlohmann::json ShapeJson(const std::vector<int64_t>& shape) {
  nlohmann::json arr = nlohmann::json::array();
  for (int64_t d : shape) arr.push_back(d);
  return arr;
}

int InspectCheckpoint(const Checkpoint& ckpt, bool json) {
  std::map<std::string, DTypeTotal> by_dtype;
  uint64_t total_bytes = 0;
  for (const auto& [name, t] : ckpt.tensors()) {
    DTypeTotal& d = by_dtype[std::string(DTypeName(t.dtype))];
    ++d.tensors;
    d.bytes += t.nbytes();
    total_bytes += t.nbytes();
  }
  // Per-file __metadata__ and the index metadata, kept apart.
  std::map<std::string, std::map<std::string, std::string>> file_metadata;
  for (const auto& f : ckpt.files()) {
    if (!f->metadata().empty()) file_metadata[f->path()] = f->metadata();
  }

  if (json) {
    nlohmann::json out;
    out["path"] = ckpt.path();
    out["kind"] =
        ckpt.sharded() ? "checkpoint" : (ckpt.files().size() == 1 ? "safetensors" : "checkpoint");
    out["sharded"] = ckpt.sharded();
    nlohmann::json files = nlohmann::json::array();
    for (const auto& f : ckpt.files()) {
      files.push_back(
          {{"path", f->path()}, {"bytes", f->file_size()}, {"tensors", f->tensors().size()}});
    }
    out["files"] = files;
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto& [name, t] : ckpt.tensors()) {
      Result<std::string> file = ckpt.FileOf(name);
      tensors.push_back({{"name", name},
                         {"dtype", DTypeName(t.dtype)},
                         {"shape", ShapeJson(t.shape)},
                         {"numel", t.numel()},
                         {"bytes", t.nbytes()},
                         {"file", file.ok() ? *file : ""}});
    }
    out["tensors"] = tensors;
    out["index_metadata"] = ckpt.index().metadata;
    out["file_metadata"] = file_metadata;
    nlohmann::json dtypes = nlohmann::json::object();
    for (const auto& [dt, tot] : by_dtype)
      dtypes[dt] = {{"tensors", tot.tensors}, {"bytes", tot.bytes}};
    out["totals"] = {
        {"tensors", ckpt.tensors().size()}, {"bytes", total_bytes}, {"by_dtype", dtypes}};
    std::cout << out.dump(2) << std::endl;
    return 0;
  }

  std::cout << ckpt.path() << ": " << ckpt.tensors().size() << " tensors in " << ckpt.files().size()
            << (ckpt.files().size() == 1 ? " file" : " files")
            << (ckpt.sharded() ? " (indexed)" : "") << "\n";
  size_t name_width = 4;
  for (const auto& [name, t] : ckpt.tensors()) name_width = std::max(name_width, name.size());
  std::cout << "  " << std::left << std::setw(static_cast<int>(name_width)) << "name"
            << "  " << std::setw(8) << "dtype" << std::setw(22) << "shape" << std::right
            << std::setw(14) << "bytes"
            << "\n";
  for (const auto& [name, t] : ckpt.tensors()) {
    std::cout << "  " << std::left << std::setw(static_cast<int>(name_width)) << name << "  "
              << std::setw(8) << DTypeName(t.dtype) << std::setw(22) << ShapeToString(t.shape)
              << std::right << std::setw(14) << t.nbytes() << "\n";
  }
  if (!ckpt.index().metadata.empty()) {
    std::cout << "index metadata:\n";
    for (const auto& [k, v] : ckpt.index().metadata) std::cout << "  " << k << " = " << v << "\n";
  }
  for (const auto& [file, md] : file_metadata) {
    std::cout << "metadata of " << file << ":\n";
    for (const auto& [k, v] : md) std::cout << "  " << k << " = " << v << "\n";
  }
  std::cout << "total: " << ckpt.tensors().size() << " tensors, " << total_bytes << " bytes ("
            << FormatBytes(total_bytes) << ")\n";
  for (const auto& [dt, tot] : by_dtype) {
    std::cout << "  " << std::left << std::setw(8) << dt << std::right << std::setw(8)
              << tot.tensors << " tensors " << std::setw(16) << tot.bytes << " bytes\n";
  }
  return 0;
}

// A store: the directory listing of its versions, their kinds and sizes.
int InspectStore(const std::string& path, bool json) {
  Result<std::vector<VersionInfo>> versions = ListVersions(path);
  if (!versions.ok()) return Fail(versions.status());
  std::error_code ec;
  auto dir_bytes = [&](const std::string& dir) {
    uint64_t total = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      if (e.is_regular_file(ec)) total += e.file_size(ec);
    }
    return total;
  };
  int64_t newest_full = 0;  // 0: the base
  for (const VersionInfo& v : *versions) {
    if (!v.is_delta) newest_full = v.version;
  }
  if (json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const VersionInfo& v : *versions) {
      nlohmann::json j = {{"version", v.version},
                          {"kind", v.is_delta ? "delta" : "full"},
                          {"bytes", dir_bytes(v.dir)}};
      j[v.is_delta ? "tensors_changed" : "tensors"] = v.tensors;
      if (v.is_delta) {
        j["base_version"] = v.base_version;
        j["encoding"] = EncodingName(v.encoding);
        j["checksum"] = ChecksumAlgoName(v.checksum);
      }
      arr.push_back(j);
    }
    nlohmann::json out = {{"path", path},
                          {"kind", "store"},
                          {"versions", arr},
                          {"latest", versions->empty() ? 0 : versions->back().version},
                          {"newest_full", newest_full}};
    std::cout << out.dump(2) << std::endl;
    return 0;
  }
  std::cout << path << ": delta store, " << versions->size() << " versions, latest "
            << FormatVersion(versions->empty() ? 0 : versions->back().version)
            << ", replayable from " << (newest_full ? FormatVersion(newest_full) : "the base")
            << "\n";
  for (const VersionInfo& v : *versions) {
    std::cout << "  " << FormatVersion(v.version) << "  "
              << (v.is_delta ? "delta on " + FormatVersion(v.base_version) + "  " +
                                   std::string(EncodingName(v.encoding)) + "/" + v.compression +
                                   "/" + std::string(ChecksumAlgoName(v.checksum))
                             : std::string("full"))
              << "  " << v.tensors << (v.is_delta ? " tensors changed  " : " tensors  ")
              << FormatBytes(dir_bytes(v.dir)) << "\n";
  }
  return 0;
}

// A delta version: what it declares, then its tensors (encoded changes).
void PrintVersionHeader(const VersionInfo& v) {
  std::cout << v.dir << ": version " << FormatVersion(v.version) << ", "
            << (v.is_delta
                    ? "delta on " + FormatVersion(v.base_version) + ", encoding " +
                          std::string(EncodingName(v.encoding)) + ", compression " + v.compression +
                          ", checksum " + std::string(ChecksumAlgoName(v.checksum))
                    : std::string("full version"))
            << (v.has_manifest ? "" : " (no deltasync.json: written by another publisher)") << "\n";
}

}  // namespace

void RegisterInspect(CLI::App& app, CommandFn* run) {
  struct Opts {
    std::string path;
    bool json = false;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "inspect",
      "Show the tensors, dtypes, shapes, sizes and metadata of a safetensors file or "
      "a checkpoint directory");
  cmd->add_option("path", opts->path, "A .safetensors file or a checkpoint directory")->required();
  cmd->add_flag("--json", opts->json, "Machine-readable output");
  cmd->callback([opts, run] {
    *run = [opts]() -> int {
      std::error_code ec;
      if (std::filesystem::is_directory(opts->path, ec)) {
        // A store holds version dirs and no checkpoint of its own.
        Result<std::vector<int64_t>> versions = ListVersionNumbers(opts->path);
        const bool has_checkpoint =
            std::filesystem::exists(std::filesystem::path(opts->path) / kIndexFileName, ec) ||
            std::filesystem::exists(std::filesystem::path(opts->path) / kSingleFileName, ec);
        if (versions.ok() && !versions->empty() && !has_checkpoint) {
          return InspectStore(opts->path, opts->json);
        }
      }
      Result<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(opts->path);
      if (!ckpt.ok()) {
        if (ckpt.status().IsCorruption() && std::filesystem::is_regular_file(opts->path, ec)) {
          std::string why = ckpt.status().message();  // status() is a copy: keep its text
          if (why.starts_with(opts->path + ": ")) why.erase(0, opts->path.size() + 2);
          return Fail(opts->path + " is not a safetensors file: " + why);
        }
        return Fail(ckpt.status());
      }
      if (!opts->json && std::filesystem::is_directory(opts->path, ec)) {
        Result<VersionInfo> info = ReadVersionInfo(opts->path);
        if (info.ok() && info->is_delta) PrintVersionHeader(*info);
      }
      return InspectCheckpoint(**ckpt, opts->json);
    };
  });
}

}  // namespace deltasync::cli
