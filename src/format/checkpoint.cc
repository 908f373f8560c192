#include "deltasync/checkpoint.h"

#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <set>
#include <utility>

#include "format/file_util.h"
#include "format/json_util.h"

namespace deltasync {
namespace {

using format_internal::JoinPath;
using format_internal::QuoteForMessage;
using nlohmann::json;

// An index lists one short line per tensor; even trillion-parameter models
// stay far below this, and it bounds what a hostile file makes us read.
constexpr uint64_t kMaxIndexBytes = 256ull << 20;
// Index metadata values may be nested JSON (we keep them as text), but no
// real index nests deeply; the cap bounds hostile input.
constexpr int kMaxIndexDepth = 32;

std::string ShardFileName(size_t ordinal, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", ordinal, count);
  return name;
}

Status RequireUtf8(std::string_view text, const char* what) {
  if (format_internal::FindInvalidUtf8(text) != text.npos) {
    return Status::InvalidArgument(std::string(what) + " " + QuoteForMessage(text) +
                                   " is not valid UTF-8");
  }
  return Status::OK();
}

}  // namespace

bool IsPlainFileName(std::string_view name) {
  if (name.empty() || name == "." || name == "..") return false;
  return name.find_first_of(std::string_view("/\\\0", 3)) == std::string_view::npos;
}

std::optional<uint64_t> CheckpointIndex::total_size() const {
  auto it = metadata_json.find("total_size");
  if (it == metadata_json.end()) return std::nullopt;
  const std::string& text = it->second;
  uint64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

Result<CheckpointIndex> ParseCheckpointIndex(std::string_view json_text) {
  if (const size_t bad = format_internal::FindInvalidUtf8(json_text); bad != json_text.npos) {
    return Status::Corruption("index is not valid UTF-8 (bad byte at offset " +
                              std::to_string(bad) + ")");
  }
  Result<json> parsed = format_internal::ParseJsonStrict(json_text, kMaxIndexDepth);
  if (!parsed.ok()) return parsed.status().WithContext("index");
  const json& root = *parsed;
  if (!root.is_object()) {
    return Status::Corruption(std::string("index is not a JSON object (found a JSON ") +
                              root.type_name() + ")");
  }

  CheckpointIndex index;
  if (auto it = root.find("metadata"); it != root.end()) {
    if (!it->is_object()) {
      return Status::Corruption(std::string("index \"metadata\" must be an object, found a JSON ") +
                                it->type_name());
    }
    for (const auto& [key, value] : it->get_ref<const json::object_t&>()) {
      if (value.is_string()) {
        index.metadata.emplace(key, value.get_ref<const std::string&>());
      } else {
        index.metadata_json.emplace(key,
                                    value.dump(-1, ' ', false, json::error_handler_t::replace));
      }
    }
  }

  auto weight_map = root.find("weight_map");
  if (weight_map == root.end()) return Status::Corruption("index has no \"weight_map\"");
  if (!weight_map->is_object()) {
    return Status::Corruption(std::string("index \"weight_map\" must be an object, found a JSON ") +
                              weight_map->type_name());
  }
  for (const auto& [tensor, file] : weight_map->get_ref<const json::object_t&>()) {
    if (!file.is_string()) {
      return Status::Corruption("index weight_map value for tensor " + QuoteForMessage(tensor) +
                                " is not a string (found a JSON " + file.type_name() + ")");
    }
    const std::string& file_name = file.get_ref<const std::string&>();
    if (!IsPlainFileName(file_name)) {
      return Status::Corruption("index maps tensor " + QuoteForMessage(tensor) + " to " +
                                QuoteForMessage(file_name) +
                                ", which is not a plain file name in the checkpoint directory");
    }
    index.weight_map.emplace(tensor, file_name);
  }
  return index;
}

Result<std::string> SerializeCheckpointIndex(const CheckpointIndex& index) {
  json metadata = json::object();
  for (const auto& [key, value] : index.metadata) {
    DS_RETURN_IF_ERROR(RequireUtf8(key, "index metadata key"));
    DS_RETURN_IF_ERROR(RequireUtf8(value, "index metadata value"));
    metadata[key] = value;
  }
  for (const auto& [key, text] : index.metadata_json) {
    DS_RETURN_IF_ERROR(RequireUtf8(key, "index metadata key"));
    if (index.metadata.count(key)) {
      return Status::InvalidArgument("index metadata key " + QuoteForMessage(key) +
                                     " is both a string and a JSON value");
    }
    json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) {
      return Status::InvalidArgument("index metadata value for " + QuoteForMessage(key) +
                                     " is not valid JSON: " + QuoteForMessage(text));
    }
    metadata[key] = std::move(value);
  }
  json weight_map = json::object();
  for (const auto& [tensor, file] : index.weight_map) {
    DS_RETURN_IF_ERROR(RequireUtf8(tensor, "tensor name"));
    if (!IsPlainFileName(file)) {
      return Status::InvalidArgument("tensor " + QuoteForMessage(tensor) + " maps to " +
                                     QuoteForMessage(file) + ", which is not a plain file name");
    }
    weight_map[tensor] = file;
  }
  json root = json::object();
  root["metadata"] = std::move(metadata);
  root["weight_map"] = std::move(weight_map);
  // Python's json.dumps(indent=2, sort_keys=True) escapes non-ASCII the same
  // way, so an index we write is byte-identical to HF's for the same content.
  return root.dump(2, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace) + "\n";
}

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file or directory");
    return Status::FromErrno(errno, path + ": stat");
  }
  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
  checkpoint->path_ = path;

  auto add_single_file = [&](const std::string& file_path) -> Status {
    DS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(file_path));
    const std::string file_name = format_internal::BaseName(file_path);
    for (const TensorView& tensor : file->tensors()) {
      checkpoint->tensors_.emplace(tensor.name, tensor);
      checkpoint->file_of_.emplace(tensor.name, file_name);
    }
    checkpoint->files_.push_back(std::move(file));
    return Status::OK();
  };

  if (S_ISREG(st.st_mode)) {
    // The index file stands for its directory (what a user pointing at "the
    // checkpoint" by its index means).
    if (format_internal::BaseName(path) == kIndexFileName) {
      return Open(format_internal::DirName(path));
    }
    DS_RETURN_IF_ERROR(add_single_file(path));
    return checkpoint;
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(path + ": neither a directory nor a regular file");
  }

  const std::string index_path = JoinPath(path, kIndexFileName);
  Result<std::string> index_text = format_internal::ReadFileLimited(index_path, kMaxIndexBytes);
  if (!index_text.ok()) {
    if (!index_text.status().IsNotFound()) return index_text.status();
    const std::string single_path = JoinPath(path, kSingleFileName);
    Status status = add_single_file(single_path);
    if (status.IsNotFound()) {
      return Status::NotFound(path + ": neither " + kIndexFileName + " nor " + kSingleFileName +
                              " exists in this directory");
    }
    DS_RETURN_IF_ERROR(status);
    return checkpoint;
  }

  Result<CheckpointIndex> index = ParseCheckpointIndex(*index_text);
  if (!index.ok()) return index.status().WithContext(index_path);
  checkpoint->has_index_ = true;
  checkpoint->index_ = std::move(*index);
  const std::map<std::string, std::string>& weight_map = checkpoint->index_.weight_map;

  std::set<std::string> shard_names;
  for (const auto& [tensor, file] : weight_map) shard_names.insert(file);
  for (const std::string& shard : shard_names) {
    Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(JoinPath(path, shard));
    if (!file.ok()) {
      if (file.status().IsNotFound()) {
        return Status::Corruption(index_path + ": lists shard " + QuoteForMessage(shard) +
                                  ", which does not exist");
      }
      return file.status();
    }
    for (const TensorView& tensor : (*file)->tensors()) {
      auto [it, inserted] = checkpoint->file_of_.emplace(tensor.name, shard);
      if (!inserted) {
        return Status::Corruption(path + ": tensor " + QuoteForMessage(tensor.name) +
                                  " appears in both " + QuoteForMessage(it->second) + " and " +
                                  QuoteForMessage(shard));
      }
      checkpoint->tensors_.emplace(tensor.name, tensor);
    }
    checkpoint->files_.push_back(std::move(*file));
  }

  // Both directions: a shard must not hold what the index does not list (the
  // index is what a reader trusts), and the index must not promise a tensor
  // its shard lacks.
  for (const auto& [tensor, shard] : checkpoint->file_of_) {
    auto listed = weight_map.find(tensor);
    if (listed == weight_map.end()) {
      return Status::Corruption(index_path + ": shard " + QuoteForMessage(shard) +
                                " holds tensor " + QuoteForMessage(tensor) +
                                ", which the index does not list");
    }
    if (listed->second != shard) {
      return Status::Corruption(index_path + ": tensor " + QuoteForMessage(tensor) +
                                " is in shard " + QuoteForMessage(shard) +
                                " but the index maps it to " + QuoteForMessage(listed->second));
    }
  }
  for (const auto& [tensor, shard] : weight_map) {
    if (!checkpoint->file_of_.count(tensor)) {
      return Status::Corruption(index_path + ": lists tensor " + QuoteForMessage(tensor) +
                                " in shard " + QuoteForMessage(shard) + ", which does not hold it");
    }
  }
  return checkpoint;
}

Result<std::string> Checkpoint::FileOf(const std::string& name) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) {
    return Status::NotFound(path_ + ": no tensor named " + QuoteForMessage(name));
  }
  return it->second;
}

Result<TensorView> Checkpoint::Get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return Status::NotFound(path_ + ": no tensor named " + QuoteForMessage(name));
  }
  return it->second;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, tensor] : tensors_) total += tensor.nbytes();
  return total;
}

Status WriteCheckpoint(const std::string& dir, const std::vector<TensorView>& tensors,
                       const CheckpointWriteOptions& options) {
  // Everything that can be refused is refused before the first byte lands,
  // so a bad call leaves the directory as it was.
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  uint64_t total_bytes = 0;
  for (const TensorView& tensor : tensors) {
    if (Status valid = tensor.Validate(); !valid.ok()) {
      return Status::InvalidArgument(dir + ": tensor " + QuoteForMessage(tensor.name) + ": " +
                                     valid.message());
    }
    specs.push_back(TensorSpec{tensor.name, tensor.dtype, tensor.shape});
    total_bytes += tensor.nbytes();
  }
  if (Result<std::string> header = BuildSafetensorsHeader(specs, {}); !header.ok()) {
    return header.status().WithContext(dir);
  }
  if (options.max_shard_bytes == 0 && !options.index_metadata.empty()) {
    return Status::InvalidArgument(
        dir + ": index_metadata needs an index; set max_shard_bytes to write shards");
  }
  if (options.index_metadata.count("total_size")) {
    return Status::InvalidArgument(dir + ": index_metadata must not set \"total_size\"");
  }
  auto metadata_for = [&](const std::vector<TensorView>& shard) {
    return options.shard_metadata_fn ? options.shard_metadata_fn(shard) : options.shard_metadata;
  };
  const std::string index_path = JoinPath(dir, kIndexFileName);

  if (options.max_shard_bytes == 0) {
    const std::map<std::string, std::string> metadata = metadata_for(tensors);
    if (Result<std::string> header = BuildSafetensorsHeader(specs, metadata); !header.ok()) {
      return header.status().WithContext(dir);
    }
    DS_RETURN_IF_ERROR(format_internal::CreateDirectories(dir));
    DS_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, kSingleFileName), tensors, metadata));
    DS_RETURN_IF_ERROR(format_internal::RemoveFileIfExists(index_path));
    return format_internal::SyncDirectory(dir);
  }

  struct Shard {
    std::string name;
    std::vector<TensorView> tensors;
    std::map<std::string, std::string> metadata;
  };
  std::vector<Shard> shards;
  uint64_t shard_bytes = 0;
  for (const TensorView& tensor : tensors) {
    const bool full = shard_bytes > options.max_shard_bytes ||
                      tensor.nbytes() > options.max_shard_bytes - shard_bytes;
    if (shards.empty() || (!shards.back().tensors.empty() && full)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().tensors.push_back(tensor);
    shard_bytes += tensor.nbytes();
  }

  CheckpointIndex index;
  index.metadata = options.index_metadata;
  index.metadata_json["total_size"] = std::to_string(total_bytes);
  for (size_t i = 0; i < shards.size(); ++i) {
    Shard& shard = shards[i];
    shard.name = ShardFileName(i + 1, shards.size());
    shard.metadata = metadata_for(shard.tensors);
    std::vector<TensorSpec> shard_specs;
    for (const TensorView& tensor : shard.tensors) {
      index.weight_map[tensor.name] = shard.name;
      shard_specs.push_back(TensorSpec{tensor.name, tensor.dtype, tensor.shape});
    }
    if (Result<std::string> header = BuildSafetensorsHeader(shard_specs, shard.metadata);
        !header.ok()) {
      return header.status().WithContext(JoinPath(dir, shard.name));
    }
  }
  Result<std::string> index_text = SerializeCheckpointIndex(index);
  if (!index_text.ok()) return index_text.status().WithContext(index_path);

  DS_RETURN_IF_ERROR(format_internal::CreateDirectories(dir));
  for (const Shard& shard : shards) {
    DS_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, shard.name), shard.tensors, shard.metadata));
  }
  return format_internal::WriteFileAtomically(index_path, *index_text);
}

}  // namespace deltasync
