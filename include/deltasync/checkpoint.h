// Hugging Face checkpoint directories: a single `model.safetensors`, or
// shards `model-00001-of-0000N.safetensors` listed by
// `model.safetensors.index.json` =
//   {"metadata": {...}, "weight_map": {tensor name: shard file name}}.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "deltasync/safetensors.h"

namespace deltasync {

inline constexpr const char* kIndexFileName = "model.safetensors.index.json";
inline constexpr const char* kSingleFileName = "model.safetensors";

// A parsed, validated index file.
struct CheckpointIndex {
  // String-valued metadata entries as-is; other JSON values (such as HF's
  // numeric "total_size") as their compact JSON text.
  std::map<std::string, std::string> metadata;
  std::map<std::string, std::string> weight_map;  // tensor name -> file name
};

// Parses index JSON. Corruption when it is not a JSON object with an object
// "weight_map" of string values, or when a file name is not a plain file
// name inside the directory (empty, ".", "..", or holding '/' or '\\' or NUL).
Result<CheckpointIndex> ParseCheckpointIndex(std::string_view json_text);
// Serializes an index (pretty-printed, keys sorted).
std::string SerializeCheckpointIndex(const CheckpointIndex& index);

// True for a name that is safe to join onto a directory.
bool IsPlainFileName(std::string_view name);

// An opened checkpoint: every tensor of every shard as one name -> view map.
class Checkpoint {
 public:
  // `path` is a checkpoint directory (indexed or single-file) or one
  // .safetensors file. Validates that every shard opens, that the index
  // lists exactly the tensors each shard holds, and that no name repeats
  // across shards.
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  bool sharded() const { return has_index_; }
  const CheckpointIndex& index() const { return index_; }  // empty if not sharded
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // All tensors, sorted by name.
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // File (within the directory) that holds `name`.
  Result<std::string> FileOf(const std::string& name) const;
  Result<TensorView> Get(const std::string& name) const;
  uint64_t total_bytes() const;

 private:
  std::string path_;
  bool has_index_ = false;
  CheckpointIndex index_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> file_of_;
};

struct CheckpointWriteOptions {
  // Start a new shard once a shard holds at least this many bytes (a single
  // tensor larger than this gets a shard of its own). 0 = one single file,
  // `model.safetensors`, with no index.
  uint64_t max_shard_bytes = 0;
  // Written into the index's "metadata" (alongside "total_size"), and into
  // each shard's __metadata__ when `shard_metadata` is set.
  std::map<std::string, std::string> index_metadata;
  std::map<std::string, std::string> shard_metadata;
};

// Writes `tensors`, in the given order, into directory `dir` (created if
// missing). Each file is written atomically; the index is written last, so a
// reader never finds an index naming a missing shard.
Status WriteCheckpoint(const std::string& dir, const std::vector<TensorView>& tensors,
                       const CheckpointWriteOptions& options = {});

}  // namespace deltasync
