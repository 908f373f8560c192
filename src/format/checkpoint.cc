#include "deltasync/checkpoint.h"

#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "format/file_util.h"
#include "format/json_util.h"
#include "io/file.h"

namespace deltasync {
namespace {

using format_internal::QuoteForMessage;
using io::JoinPath;
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

// A Hugging Face shard name, "<prefix>-<ordinal>-of-<count>.safetensors"
// with both numbers written in at least five digits (HF writes %05d) and
// 1 <= ordinal <= count.
struct ShardName {
  std::string prefix;
  uint64_t ordinal = 0;
  uint64_t count = 0;
  size_t digits = 0;  // as the count is written
};

std::optional<ShardName> ParseShardName(std::string_view name) {
  static constexpr std::string_view kSuffix = ".safetensors";
  static constexpr std::string_view kOf = "-of-";
  if (!name.ends_with(kSuffix)) return std::nullopt;
  name.remove_suffix(kSuffix.size());
  // Splits off "-<digits>" (or, with `of`, "-of-<digits>") from the end.
  auto take_number = [&name](std::string_view separator, uint64_t* value, size_t* digits) -> bool {
    const size_t at = name.rfind(separator);
    if (at == name.npos) return false;
    const std::string_view text = name.substr(at + separator.size());
    if (text.size() < 5 || text.size() > 18) return false;  // 18 digits fit in 64 bits
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), *value);
    if (error != std::errc() || end != text.data() + text.size()) return false;
    *digits = text.size();
    name = name.substr(0, at);
    return true;
  };
  ShardName shard;
  size_t ordinal_digits = 0;
  if (!take_number(kOf, &shard.count, &shard.digits) ||
      !take_number("-", &shard.ordinal, &ordinal_digits)) {
    return std::nullopt;
  }
  if (shard.ordinal == 0 || shard.ordinal > shard.count) return std::nullopt;
  shard.prefix = std::string(name);
  return shard;
}

// Without an index nothing lists the shards, but Hugging Face shard names
// do: "model-00001-of-00003.safetensors" promises two more. A set with a
// member missing is what an interrupted download or sharded write leaves
// (our writer writes the index last), and reading it would silently drop
// tensors.
Status CheckShardSetsComplete(const std::string& dir, const std::vector<std::string>& names) {
  // (prefix, count) -> the ordinals present, and one name for the message.
  std::map<std::pair<std::string, uint64_t>, std::pair<std::set<uint64_t>, ShardName>> sets;
  for (const std::string& name : names) {
    std::optional<ShardName> shard = ParseShardName(name);
    if (!shard) continue;
    auto& set = sets[{shard->prefix, shard->count}];
    set.first.insert(shard->ordinal);
    set.second = *shard;
  }
  for (const auto& [key, set] : sets) {
    // Plain references, not a structured binding: the lambda below captures
    // them (clang 14 refuses to capture bindings).
    const std::set<uint64_t>& ordinals = set.first;
    const ShardName& example = set.second;
    uint64_t missing = 1;
    for (uint64_t ordinal : ordinals) {
      if (ordinal != missing) break;
      ++missing;
    }
    if (missing > example.count) continue;
    auto padded = [&](uint64_t value) {
      std::string text = std::to_string(value);
      if (text.size() < example.digits) text.insert(0, example.digits - text.size(), '0');
      return text;
    };
    const std::string expected =
        example.prefix + "-" + padded(missing) + "-of-" + padded(example.count) + ".safetensors";
    return Status::Corruption(dir + ": shard " + QuoteForMessage(expected) + " is missing (" +
                              std::to_string(ordinals.size()) + " of the " +
                              std::to_string(example.count) +
                              " shards are here and there is no index)");
  }
  return Status::OK();
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
    const std::string file_name = io::BaseName(file_path);
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
    if (io::BaseName(path) == kIndexFileName) {
      return Open(io::DirName(path));
    }
    DS_RETURN_IF_ERROR(add_single_file(path));
    return checkpoint;
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(path + ": neither a directory nor a regular file");
  }

  // Adds a shard's tensors; a name already held by another shard is
  // Corruption naming both files.
  auto add_shard = [&](std::unique_ptr<SafetensorsFile> file, const std::string& shard) -> Status {
    for (const TensorView& tensor : file->tensors()) {
      auto [it, inserted] = checkpoint->file_of_.emplace(tensor.name, shard);
      if (!inserted) {
        return Status::Corruption(path + ": tensor " + QuoteForMessage(tensor.name) +
                                  " appears in both " + QuoteForMessage(it->second) + " and " +
                                  QuoteForMessage(shard));
      }
      checkpoint->tensors_.emplace(tensor.name, tensor);
    }
    checkpoint->files_.push_back(std::move(file));
    return Status::OK();
  };

  const std::string index_path = JoinPath(path, kIndexFileName);
  Result<std::string> index_text = io::ReadFileLimited(index_path, kMaxIndexBytes);
  if (!index_text.ok()) {
    if (!index_text.status().IsNotFound()) return index_text.status();
    // No index: the checkpoint is the directory's *.safetensors files, as
    // vLLM and SGLang load such a directory by glob.
    DS_ASSIGN_OR_RETURN(std::vector<std::string> names,
                        format_internal::ListSafetensorsFiles(path));
    if (names.empty()) {
      return Status::NotFound(path + ": neither " + kIndexFileName +
                              " nor any *.safetensors file exists in this directory");
    }
    DS_RETURN_IF_ERROR(CheckShardSetsComplete(path, names));
    for (const std::string& name : names) {
      DS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                          SafetensorsFile::Open(JoinPath(path, name)));
      DS_RETURN_IF_ERROR(add_shard(std::move(file), name));
    }
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
    DS_RETURN_IF_ERROR(add_shard(std::move(*file), shard));
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
    DS_RETURN_IF_ERROR(io::CreateDirectories(dir));
    DS_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, kSingleFileName), tensors, metadata));
    // What the directory held before is replaced: a stale index would take
    // precedence over the new file, and without an index every other
    // *.safetensors file would be read with it. The other files go first,
    // while a stale index still stands for them, so an interrupted rewrite
    // leaves an index naming a missing shard (refused) rather than an
    // index-less directory that merges old tensors into the new ones.
    DS_ASSIGN_OR_RETURN(std::vector<std::string> names, format_internal::ListSafetensorsFiles(dir));
    for (const std::string& name : names) {
      if (name == kSingleFileName) continue;
      DS_RETURN_IF_ERROR(io::RemoveFileIfExists(JoinPath(dir, name)));
    }
    DS_RETURN_IF_ERROR(io::RemoveFileIfExists(index_path));
    return io::SyncDirectory(dir);
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

  DS_RETURN_IF_ERROR(io::CreateDirectories(dir));
  for (const Shard& shard : shards) {
    DS_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, shard.name), shard.tensors, shard.metadata));
  }
  return io::WriteFileAtomically(index_path, *index_text);
}

}  // namespace deltasync
