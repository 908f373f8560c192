// Hugging Face checkpoint directories: a single `model.safetensors`, or
// shards `model-00001-of-0000N.safetensors` listed by
// `model.safetensors.index.json` =
//   {"metadata": {...}, "weight_map": {tensor name: shard file name}},
// or, without an index, the directory's `*.safetensors` files together.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/safetensors.h"

namespace deltasync {

inline constexpr const char* kIndexFileName = "model.safetensors.index.json";
inline constexpr const char* kSingleFileName = "model.safetensors";

// A parsed, validated index file.
struct CheckpointIndex {
  // String-valued "metadata" entries (vime's "version", "delta_encoding", ...).
  std::map<std::string, std::string> metadata;
  // Every other "metadata" entry (HF's numeric "total_size", ...) as its
  // compact JSON text, kept apart so that re-serializing preserves its type.
  std::map<std::string, std::string> metadata_json;
  std::map<std::string, std::string> weight_map;  // tensor name -> file name

  // HF's "total_size" when present as a non-negative integer.
  std::optional<uint64_t> total_size() const;
};

// Parses index JSON. Corruption when it is not a JSON object (duplicate keys
// included) with an object "weight_map" of string values, when "metadata" is
// present but not an object, or when a file name is not a plain file name
// inside the directory (see IsPlainFileName). Other top-level keys are
// ignored.
Result<CheckpointIndex> ParseCheckpointIndex(std::string_view json_text);
// Serializes an index as HF does (two-space indent, keys sorted, final
// newline). InvalidArgument when a metadata_json value is not valid JSON, a
// key is in both metadata maps, a string is not UTF-8, or a file name is not
// plain.
Result<std::string> SerializeCheckpointIndex(const CheckpointIndex& index);

// True for a name that is safe to join onto a directory: not empty, not "."
// or "..", and free of '/', '\\' and NUL. A hostile index must not make us
// open (or, on the write side, create) files outside the checkpoint.
bool IsPlainFileName(std::string_view name);

// An opened checkpoint: every tensor of every shard as one name -> view map.
class Checkpoint {
 public:
  // `path` is a checkpoint directory, its index file (which stands for the
  // directory), or one .safetensors file. A directory
  // with an index is read through it (even when a model.safetensors sits
  // beside it: the index is what lists the tensors). Validates that
  // every listed shard opens (a missing one is Corruption), that the index
  // lists exactly the tensors each shard holds, and that no name repeats
  // across shards. Shards the index does not name are ignored. A directory
  // without an index is its non-hidden regular *.safetensors files, merged
  // (a name in two files is Corruption naming both; a Hugging Face shard
  // set "<prefix>-<i>-of-<n>.safetensors" missing a member is Corruption),
  // and NotFound naming the directory when it has none. docs/format.md,
  // "Checkpoint directories", has the rules.
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& path);
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& path() const { return path_; }
  bool sharded() const { return has_index_; }              // read through an index
  const CheckpointIndex& index() const { return index_; }  // empty if not sharded
  // Opened files, by file name.
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // All tensors, sorted by name.
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // File name (within the directory) that holds `name`; NotFound if absent.
  Result<std::string> FileOf(const std::string& name) const;
  // NotFound if absent.
  Result<TensorView> Get(const std::string& name) const;
  // Sum of all tensors' bytes.
  uint64_t total_bytes() const;

 private:
  Checkpoint() = default;

  std::string path_;
  bool has_index_ = false;
  CheckpointIndex index_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> file_of_;
};

struct CheckpointWriteOptions {
  // Largest shard in bytes of tensor data: a tensor starts a new shard when
  // adding it would pass this and the current shard is not empty, so only a
  // single tensor larger than the limit makes a shard exceed it (HF's rule).
  // Shards are model-00001-of-0000N.safetensors plus an index.
  // 0 = one single file, `model.safetensors`, with no index.
  uint64_t max_shard_bytes = 0;
  // Written into the index's "metadata" next to "total_size" (the sum of all
  // tensor bytes, a JSON integer, as HF writes it). Requires an index
  // (max_shard_bytes > 0) and must not hold "total_size".
  std::map<std::string, std::string> index_metadata;
  // Written as every file's __metadata__ (when non-empty)...
  std::map<std::string, std::string> shard_metadata;
  // ...unless this is set: then each file's __metadata__ is what it returns
  // for the tensors that file holds (e.g. per-tensor checksums).
  std::function<std::map<std::string, std::string>(const std::vector<TensorView>&)>
      shard_metadata_fn;
};

// Writes `tensors`, in the given order, into directory `dir` (created if
// missing). Each file is written atomically; the index is written last, so a
// reader never finds an index naming a missing shard. Writing the single-file
// layout removes every other non-hidden *.safetensors file (an index-less
// reader would merge it in) and then a stale index, which would otherwise
// take precedence.
// InvalidArgument for invalid views, repeated names or bad options.
Status WriteCheckpoint(const std::string& dir, const std::vector<TensorView>& tensors,
                       const CheckpointWriteOptions& options = {});

}  // namespace deltasync
