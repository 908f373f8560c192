// libFuzzer target for the Hugging Face index, model.safetensors.index.json
// (docs/format.md, "Checkpoint directories" and "Delta versions").
//
// The input is an index's text:
//  1. ParseCheckpointIndex: what it accepts names only plain files and
//     survives a serialize/parse round trip.
//  2. Checkpoint::Open of a directory holding the text as its index beside
//     fixed files (two shards, a model.safetensors holding every tensor, a
//     config.json): it must accept exactly the indexes that parse and whose
//     weight_map lists, for each file it names, exactly the tensors that
//     file holds; then every tensor is that file's, byte for byte. Opening
//     through the index file's path must give the same result.
//  3. ReadVersionInfo of the same directory, named weight_v000002: it must
//     accept exactly the indexes whose metadata a reference reading of
//     docs/format.md accepts, and report what that metadata says.
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>

#include "deltasync/checkpoint.h"
#include "deltasync/safetensors.h"
#include "deltasync/store.h"
#include "fuzz_util.h"

namespace {

using deltasync::Checkpoint;
using deltasync::CheckpointIndex;
using deltasync::Result;
using deltasync::fuzz_util::Require;

struct Fixture {
  deltasync::fuzz_util::ScratchDir scratch{"ds_checkpoint_index_fuzz"};
  std::string dir = scratch.Join("weight_v000002");
  deltasync::fuzz_util::Model model;
  // What each safetensors file of `dir` holds: tensor names.
  std::map<std::string, std::set<std::string>> holds;

  Fixture() {
    model.push_back({"a", deltasync::DType::kBF16, {4}, std::vector<uint8_t>(8, 1)});
    model.push_back({"b", deltasync::DType::kF32, {2}, std::vector<uint8_t>(8, 2)});
    model.push_back({"c", deltasync::DType::kU8, {40}, std::vector<uint8_t>(40, 3)});
    deltasync::CheckpointWriteOptions options;
    options.max_shard_bytes = 16;  // {a, b} and {c}
    Require(deltasync::WriteCheckpoint(dir, deltasync::fuzz_util::Views(model), options).ok(),
            "write the shards");
    Require(deltasync::WriteSafetensors(dir + "/" + deltasync::kSingleFileName,
                                        deltasync::fuzz_util::Views(model))
                .ok(),
            "write model.safetensors");
    deltasync::fuzz_util::WriteFile(dir + "/config.json", "{}\n");
    for (const auto& [name, bytes] : deltasync::fuzz_util::VisibleFiles(dir)) {
      if (!name.ends_with(".safetensors")) continue;
      auto file = deltasync::SafetensorsFile::Open(dir + "/" + name);
      Require(file.ok(), "a written shard opens");
      for (const deltasync::TensorView& t : (*file)->tensors()) holds[name].insert(t.name);
    }
    Require(holds.size() == 3, "two shards and model.safetensors");
  }
};

Fixture& GetFixture() {
  static Fixture fixture;  // static (not leaked): its scratch directory goes at exit
  return fixture;
}

// Rules 5 and 6 of "Checkpoint directories", read independently: each named
// file exists and holds exactly the tensors listed for it.
bool ShardsMatch(const Fixture& f, const CheckpointIndex& index) {
  std::map<std::string, std::set<std::string>> listed;
  for (const auto& [tensor, file] : index.weight_map) listed[file].insert(tensor);
  for (const auto& [file, tensors] : listed) {
    auto it = f.holds.find(file);
    if (it == f.holds.end() || it->second != tensors) return false;
  }
  return true;
}

void CheckOpen(const Fixture& f, const Result<CheckpointIndex>& index) {
  Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(f.dir);
  Result<std::unique_ptr<Checkpoint>> via_index =
      Checkpoint::Open(f.dir + "/" + deltasync::kIndexFileName);
  Require(opened.ok() == via_index.ok(), "the index file stands for its directory");
  const bool expected = index.ok() && ShardsMatch(f, *index);
  Require(opened.ok() == expected,
          "Checkpoint::Open accepts exactly the indexes that match the shards");
  if (!opened.ok()) {
    // A name past NAME_MAX cannot be opened: the reader reports open's
    // IOError (ENAMETOOLONG), not the Corruption of a missing shard.
    bool long_name = false;
    if (index.ok()) {
      for (const auto& [tensor, file] : index->weight_map) long_name |= file.size() > NAME_MAX;
    }
    Require(opened.status().IsCorruption() ||
                (long_name && opened.status().code() == deltasync::StatusCode::kIOError),
            "a bad index is Corruption");
    return;
  }
  const Checkpoint& c = **opened;
  Require(c.sharded() && c.index().weight_map == index->weight_map, "the index is kept");
  Require(c.tensors().size() == index->weight_map.size(), "one tensor per weight_map entry");
  for (const auto& [name, file] : index->weight_map) {
    Result<std::string> holder = c.FileOf(name);
    Require(holder.ok() && *holder == file, "each tensor comes from the file listed for it");
    Result<deltasync::TensorView> view = c.Get(name);
    Require(view.ok(), "each listed tensor is there");
    bool found = false;
    for (const auto& t : f.model) {
      if (t.name != name) continue;
      found = view->dtype == t.dtype && view->shape == t.shape &&
              view->bytes.size() == t.data.size() &&
              std::memcmp(view->bytes.data(), t.data.data(), t.data.size()) == 0;
    }
    Require(found, "each tensor has its bytes");
  }
}

// "Delta versions", read independently: what ReadVersionInfo must accept
// for a directory named weight_v000002, and what it must report then.
void CheckVersionInfo(const Fixture& f, const Result<CheckpointIndex>& index) {
  Result<deltasync::VersionInfo> info = deltasync::ReadVersionInfo(f.dir);
  if (!index.ok()) {
    Require(!info.ok() && info.status().IsCorruption(), "a malformed index is Corruption");
    return;
  }
  const auto& md = index->metadata;
  auto get = [&md](const char* key) -> const std::string* {
    auto it = md.find(key);
    return it == md.end() ? nullptr : &it->second;
  };
  auto version_of = [&](const char* key) -> std::optional<int64_t> {
    const std::string* text = get(key);
    if (text == nullptr) return std::nullopt;
    Result<int64_t> v = deltasync::ParseVersion(*text);
    return v.ok() ? std::optional<int64_t>(*v) : std::nullopt;
  };
  bool expected = get("version") == nullptr || version_of("version") == 2;
  const std::string* encoding = get("delta_encoding");
  std::optional<deltasync::Encoding> parsed_encoding;
  std::optional<deltasync::ChecksumAlgo> algo;
  if (encoding != nullptr && expected) {
    Result<deltasync::Encoding> e = deltasync::ParseEncoding(*encoding);
    if (e.ok()) parsed_encoding = *e;
    const std::string zstd_or_none(e.ok() ? deltasync::GetEncodingInfo(*e).compression : "");
    const std::string* compression = get("compression_format");
    const std::string* checksum = get("checksum_format");
    if (checksum != nullptr) {
      Result<deltasync::ChecksumAlgo> a = deltasync::ParseChecksumAlgo(*checksum);
      if (a.ok()) algo = *a;
    }
    const std::optional<int64_t> base = version_of("base_version");
    // A delta's directory holds no shard its weight_map does not name.
    bool every_shard_named = true;
    for (const auto& [file, tensors] : f.holds) {
      bool named = false;
      for (const auto& [tensor, in] : index->weight_map) named = named || in == file;
      every_shard_named = every_shard_named && named;
    }
    expected = e.ok() && base && *base < 2 && compression != nullptr &&
               *compression == zstd_or_none && algo.has_value() && every_shard_named;
  }
  Require(info.ok() == expected, "ReadVersionInfo accepts exactly the metadata the format allows");
  if (!info.ok()) return;
  Require(info->version == 2 && info->dir == f.dir && !info->has_manifest, "version and dir");
  Require(info->tensors == index->weight_map.size(), "tensor count");
  Require(info->is_delta == (encoding != nullptr), "a version is a delta exactly when it says so");
  if (info->is_delta) {
    Require(info->encoding == *parsed_encoding && info->checksum == *algo &&
                info->base_version == *version_of("base_version") &&
                info->compression == *get("compression_format"),
            "a delta's metadata is reported as written");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = GetFixture();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const Result<CheckpointIndex> index = deltasync::fuzz_util::CheckIndexRoundTrip(text);
  Require(index.ok() || index.status().IsCorruption(), "a bad index is Corruption");
  deltasync::fuzz_util::WriteFile(f.dir + "/" + deltasync::kIndexFileName, text);
  CheckOpen(f, index);
  CheckVersionInfo(f, index);
  return 0;
}
