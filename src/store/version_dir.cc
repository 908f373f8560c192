// Version directories: names, index metadata, the deltasync.json sidecar.

#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "deltasync/checkpoint.h"
#include "deltasync/store.h"
#include "format/json_util.h"
#include "io/file.h"
#include "store/version_internal.h"

namespace deltasync {
namespace {

using format_internal::QuoteForMessage;
using io::JoinPath;
using nlohmann::json;

constexpr std::string_view kVersionDirPrefix = "weight_v";
constexpr uint64_t kMaxIndexBytes = 256ull << 20;
constexpr uint64_t kMaxManifestBytes = 256ull << 20;
constexpr std::string_view kManifestFormat = "deltasync-version-manifest";

bool IsLowerHex(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

Status CheckDigest(std::string_view digest, ChecksumAlgo algo, std::string_view what) {
  if (digest.size() != 2 * ChecksumDigestSize(algo) || !IsLowerHex(digest)) {
    return Status::Corruption(std::string(what) + ": " + QuoteForMessage(digest, 80) +
                              " is not a " + std::string(ChecksumAlgoName(algo)) + " digest (" +
                              std::to_string(2 * ChecksumDigestSize(algo)) +
                              " lowercase hex digits)");
  }
  return Status::OK();
}

Result<int64_t> ParseVersionField(const std::map<std::string, std::string>& metadata,
                                  const std::string& key, const std::string& where) {
  auto it = metadata.find(key);
  if (it == metadata.end()) return Status::Corruption(where + ": metadata lacks \"" + key + "\"");
  Result<int64_t> v = ParseVersion(it->second);
  if (!v.ok()) {
    return Status::Corruption(where + ": metadata \"" + key + "\" is " +
                              QuoteForMessage(it->second, 40) + ", not a version (6+ digits)");
  }
  return *v;
}

}  // namespace

std::string VersionDirName(int64_t version) {
  return std::string(kVersionDirPrefix) + FormatVersion(version);
}

Result<int64_t> ParseVersionDirName(std::string_view name) {
  if (name.substr(0, kVersionDirPrefix.size()) != kVersionDirPrefix) {
    return Status::InvalidArgument(QuoteForMessage(name, 80) + " is not a version dir name");
  }
  Result<int64_t> v = ParseVersion(name.substr(kVersionDirPrefix.size()));
  if (!v.ok()) {
    return Status::InvalidArgument(QuoteForMessage(name, 80) + " is not a version dir name");
  }
  return *v;
}

std::string FormatVersion(int64_t version) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%06lld", static_cast<long long>(version < 0 ? 0 : version));
  return buf;
}

Result<int64_t> ParseVersion(std::string_view text) {
  if (text.size() < 6 || text.size() > 18 ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return Status::InvalidArgument(QuoteForMessage(text, 40) +
                                   " is not a version (6 to 18 decimal digits)");
  }
  int64_t v = 0;
  for (char c : text) v = v * 10 + (c - '0');
  return v;
}

Result<std::optional<VersionManifest>> ReadVersionManifest(const std::string& version_dir) {
  const std::string path = JoinPath(version_dir, kVersionManifestFileName);
  Result<std::string> text = io::ReadFileLimited(path, kMaxManifestBytes);
  if (!text.ok()) {
    if (text.status().IsNotFound()) return std::optional<VersionManifest>();
    return text.status();
  }
  Result<VersionManifest> manifest = store_internal::ParseVersionManifest(*text, path);
  if (!manifest.ok()) return manifest.status();
  return std::optional<VersionManifest>(std::move(*manifest));
}

Result<VersionInfo> ReadVersionInfo(const std::string& version_dir) {
  if (!io::IsDirectory(version_dir)) {
    if (!io::PathExists(version_dir)) {
      return Status::NotFound(version_dir + ": no such version directory");
    }
    return Status::Corruption(version_dir + ": not a directory");
  }
  VersionInfo info;
  info.dir = version_dir;
  Result<int64_t> dir_version = ParseVersionDirName(io::BaseName(version_dir));

  const std::string index_path = JoinPath(version_dir, kIndexFileName);
  Result<std::string> text = io::ReadFileLimited(index_path, kMaxIndexBytes);
  if (!text.ok()) {
    if (!text.status().IsNotFound()) return text.status();
    if (!io::PathExists(JoinPath(version_dir, kSingleFileName))) {
      return Status::Corruption(version_dir + ": holds neither " + kIndexFileName + " nor " +
                                kSingleFileName + ": not a checkpoint");
    }
    if (!dir_version.ok()) {
      return Status::InvalidArgument(version_dir + ": cannot tell its version (not named " +
                                     "weight_vNNNNNN and no index)");
    }
    info.version = *dir_version;
    info.tensors = 0;
  } else {
    Result<CheckpointIndex> index = ParseCheckpointIndex(*text);
    if (!index.ok()) return index.status().WithContext(index_path);
    const auto& md = index->metadata;
    info.tensors = index->weight_map.size();
    // A value that is not a string is not in `md`, and must not pass for an
    // absent one: a delta taken for a full version, or a delta whose version
    // only its directory name would give.
    auto not_a_string = [&](const char* key) {
      return Status::Corruption(index_path + ": metadata \"" + key + "\" is " +
                                QuoteForMessage(index->metadata_json.at(key), 40) +
                                ", not a string");
    };
    if (index->metadata_json.count("delta_encoding")) return not_a_string("delta_encoding");
    if (md.count("delta_encoding")) {
      if (index->metadata_json.count("version")) return not_a_string("version");
      if (!md.count("version")) {
        return Status::Corruption(index_path + ": metadata lacks \"version\", which a delta " +
                                  "version must carry");
      }
    }
    if (md.count("version")) {
      DS_ASSIGN_OR_RETURN(int64_t meta_version, ParseVersionField(md, "version", index_path));
      if (dir_version.ok() && meta_version != *dir_version) {
        return Status::Corruption(index_path + ": metadata says version " +
                                  FormatVersion(meta_version) + " but the directory is " +
                                  VersionDirName(*dir_version));
      }
      info.version = meta_version;
    } else if (dir_version.ok()) {
      info.version = *dir_version;
    } else {
      return Status::InvalidArgument(version_dir + ": cannot tell its version (not named " +
                                     "weight_vNNNNNN and no \"version\" in its index)");
    }
    auto enc_it = md.find("delta_encoding");
    if (enc_it != md.end()) {
      info.is_delta = true;
      Result<Encoding> encoding = ParseEncoding(enc_it->second);
      if (!encoding.ok()) {
        return Status::Unsupported(index_path + ": unknown delta_encoding " +
                                   QuoteForMessage(enc_it->second, 40) +
                                   " (known: " + JoinEncodingNames(", ") + ")");
      }
      info.encoding = *encoding;
      DS_ASSIGN_OR_RETURN(info.base_version, ParseVersionField(md, "base_version", index_path));
      if (info.base_version >= info.version) {
        return Status::Corruption(index_path + ": base_version " +
                                  FormatVersion(info.base_version) + " is not older than version " +
                                  FormatVersion(info.version));
      }
      auto comp_it = md.find("compression_format");
      if (comp_it == md.end()) {
        return Status::Corruption(index_path + ": metadata lacks \"compression_format\"");
      }
      const std::string expected(GetEncodingInfo(info.encoding).compression);
      if (comp_it->second != expected) {
        return Status::Unsupported(index_path + ": compression_format " +
                                   QuoteForMessage(comp_it->second, 40) + " is not supported for " +
                                   std::string(EncodingName(info.encoding)) + " (expected \"" +
                                   expected + "\")");
      }
      info.compression = comp_it->second;
      auto sum_it = md.find("checksum_format");
      if (sum_it == md.end()) {
        return Status::Corruption(index_path + ": metadata lacks \"checksum_format\"");
      }
      Result<ChecksumAlgo> algo = ParseChecksumAlgo(sum_it->second);
      if (!algo.ok()) {
        return Status::Unsupported(index_path + ": unknown checksum_format " +
                                   QuoteForMessage(sum_it->second, 40) +
                                   " (known: xxh3-128, blake3, adler32, xxh3-64)");
      }
      info.checksum = *algo;
      // A delta's index lists the changed tensors, so a shard it does not
      // name would be changes silently skipped (an index whose weight_map
      // lost entries reads as a delta that changed less, or nothing).
      std::set<std::string> named;
      for (const auto& [tensor, file] : index->weight_map) named.insert(file);
      DS_ASSIGN_OR_RETURN(std::vector<std::string> files, io::ListRegularFiles(version_dir));
      for (const std::string& file : files) {
        if (file.ends_with(".safetensors") && !named.count(file)) {
          return Status::Corruption(index_path + ": the version holds " + file +
                                    ", which its weight_map does not name");
        }
      }
    }
  }

  info.bytes = io::DirectoryBytes(version_dir);
  DS_ASSIGN_OR_RETURN(std::optional<VersionManifest> manifest, ReadVersionManifest(version_dir));
  if (manifest) {
    const std::string where = JoinPath(version_dir, kVersionManifestFileName);
    info.has_manifest = true;
    if (manifest->version != info.version || manifest->is_delta != info.is_delta ||
        (info.is_delta &&
         (manifest->base_version != info.base_version || manifest->checksum != info.checksum))) {
      return Status::Corruption(where + ": disagrees with the index on version, kind, base " +
                                "version or checksum format");
    }
  }
  return info;
}

Result<std::vector<int64_t>> ListVersionNumbers(const std::string& store) {
  std::vector<int64_t> versions;
  DIR* d = ::opendir(store.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return Status::NotFound("store " + store + " does not exist");
    return Status::FromErrno(errno, store + ": open store directory");
  }
  // What a store may hold besides its versions (see the contract): only
  // these leave a directory without a version an empty store.
  auto store_own = [](std::string_view name) {
    return name.starts_with(".") || name.starts_with(kVersionDirPrefix) || name == "lost+found";
  };
  std::string first_other;
  uint64_t others = 0;
  while (struct dirent* entry = ::readdir(d)) {
    const std::string_view name = entry->d_name;
    Result<int64_t> v = ParseVersionDirName(name);
    if (v.ok() && io::IsDirectory(JoinPath(store, entry->d_name))) {
      versions.push_back(*v);
    } else if (!store_own(name)) {
      if (others++ == 0 || name < first_other) first_other = name;
    }
  }
  ::closedir(d);
  if (versions.empty() && others > 0) {
    return Status::InvalidArgument(
        store + " is not a store: it holds no version (weight_vNNNNNN) but " +
        QuoteForMessage(first_other, 80) +
        (others == 1   ? std::string()
         : others == 2 ? std::string(" and 1 other entry")
                       : " and " + std::to_string(others - 1) + " other entries"));
  }
  std::sort(versions.begin(), versions.end());
  // "weight_v000007" and "weight_v0000007" name the same version; refuse to
  // guess which one is meant.
  for (size_t i = 1; i < versions.size(); ++i) {
    if (versions[i] == versions[i - 1]) {
      return Status::Corruption(store + ": two directories hold version " +
                                FormatVersion(versions[i]));
    }
  }
  return versions;
}

Result<std::vector<VersionInfo>> ListVersions(const std::string& store) {
  DS_ASSIGN_OR_RETURN(std::vector<int64_t> numbers, ListVersionNumbers(store));
  std::vector<VersionInfo> infos;
  infos.reserve(numbers.size());
  for (int64_t v : numbers) {
    DS_ASSIGN_OR_RETURN(VersionInfo info, ReadVersionInfo(store_internal::VersionDir(store, v)));
    infos.push_back(std::move(info));
  }
  return infos;
}

namespace store_internal {

std::string VersionDir(const std::string& store, int64_t version) {
  return JoinPath(store, VersionDirName(version));
}

std::string SerializeVersionManifest(const VersionManifest& manifest) {
  json doc = json::object();
  doc["format"] = kManifestFormat;
  doc["format_version"] = 1;
  doc["version"] = FormatVersion(manifest.version);
  doc["kind"] = manifest.is_delta ? "delta" : "full";
  if (manifest.is_delta) doc["base_version"] = FormatVersion(manifest.base_version);
  doc["checksum_format"] = ChecksumAlgoName(manifest.checksum);
  if (manifest.strong) doc["strong_checksum_format"] = ChecksumAlgoName(*manifest.strong);
  json tensors = json::object();
  for (const auto& [name, t] : manifest.tensors) {
    json entry = json::object();
    entry["dtype"] = DTypeName(t.dtype);
    entry["shape"] = t.shape;
    entry["checksum"] = t.checksum;
    if (manifest.strong) entry["strong_checksum"] = t.strong_checksum;
    if (manifest.is_delta) {
      entry["base_checksum"] = t.base_checksum;
      entry["changed"] = t.changed;
      if (manifest.strong) entry["strong_base_checksum"] = t.strong_base_checksum;
    }
    tensors[name] = std::move(entry);
  }
  doc["tensors"] = std::move(tensors);
  // A full version's state is its tensors' checksums, already written.
  if (manifest.is_delta && manifest.state) {
    doc["state"] = *manifest.state;
    if (manifest.strong) doc["strong_state"] = manifest.strong_state;
  }
  return doc.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

Result<VersionManifest> ParseVersionManifest(std::string_view text, const std::string& where) {
  Result<json> parsed = format_internal::ParseJsonStrict(text, 5);
  if (!parsed.ok()) return parsed.status().WithContext(where);
  const json& doc = *parsed;
  auto bad = [&where](const std::string& what) { return Status::Corruption(where + ": " + what); };
  if (!doc.is_object()) return bad("not a JSON object");
  auto get_string = [&](const json& obj, const char* key, std::string* out) -> Status {
    auto it = obj.find(key);
    if (it == obj.end() || !it->is_string()) {
      return bad(std::string("\"") + key + "\" is missing or not a string");
    }
    *out = it->get<std::string>();
    return Status::OK();
  };
  std::string s;
  DS_RETURN_IF_ERROR(get_string(doc, "format", &s));
  if (s != kManifestFormat) return bad("\"format\" is " + QuoteForMessage(s, 60));
  auto fv = doc.find("format_version");
  if (fv == doc.end() || !fv->is_number_unsigned() || fv->get<uint64_t>() != 1) {
    return bad("\"format_version\" is missing or not 1");
  }
  VersionManifest m;
  DS_RETURN_IF_ERROR(get_string(doc, "version", &s));
  Result<int64_t> version = ParseVersion(s);
  if (!version.ok()) return bad("\"version\" is " + QuoteForMessage(s, 40));
  m.version = *version;
  DS_RETURN_IF_ERROR(get_string(doc, "kind", &s));
  if (s != "delta" && s != "full") return bad("\"kind\" is " + QuoteForMessage(s, 40));
  m.is_delta = s == "delta";
  if (m.is_delta) {
    DS_RETURN_IF_ERROR(get_string(doc, "base_version", &s));
    Result<int64_t> base = ParseVersion(s);
    if (!base.ok()) return bad("\"base_version\" is " + QuoteForMessage(s, 40));
    m.base_version = *base;
  }
  DS_RETURN_IF_ERROR(get_string(doc, "checksum_format", &s));
  Result<ChecksumAlgo> algo = ParseChecksumAlgo(s);
  if (!algo.ok()) {
    return Status::Unsupported(where + ": unknown checksum_format " + QuoteForMessage(s, 40));
  }
  m.checksum = *algo;
  if (auto strong = doc.find("strong_checksum_format"); strong != doc.end()) {
    if (!strong->is_string()) return bad("\"strong_checksum_format\" is not a string");
    Result<ChecksumAlgo> strong_algo = ParseChecksumAlgo(strong->get<std::string>());
    if (!strong_algo.ok()) {
      return Status::Unsupported(where + ": unknown strong_checksum_format " +
                                 QuoteForMessage(strong->get<std::string>(), 40));
    }
    m.strong = *strong_algo;
  }
  auto tensors = doc.find("tensors");
  if (tensors == doc.end() || !tensors->is_object()) return bad("\"tensors\" is not an object");
  for (auto it = tensors->begin(); it != tensors->end(); ++it) {
    const std::string tname = QuoteForMessage(it.key());
    if (!it->is_object()) return bad("tensor " + tname + " is not an object");
    ManifestTensor t;
    DS_RETURN_IF_ERROR(get_string(*it, "dtype", &s));
    Result<DType> dtype = ParseDType(s);
    if (!dtype.ok()) return bad("tensor " + tname + ": unknown dtype " + QuoteForMessage(s, 40));
    t.dtype = *dtype;
    auto shape = it->find("shape");
    if (shape == it->end() || !shape->is_array()) return bad("tensor " + tname + ": bad shape");
    for (const json& dim : *shape) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > (uint64_t{1} << 62)) {
        return bad("tensor " + tname + ": bad shape");
      }
      t.shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
    }
    if (!ShapeNumel(t.shape).ok()) return bad("tensor " + tname + ": shape overflows");
    DS_RETURN_IF_ERROR(get_string(*it, "checksum", &t.checksum));
    DS_RETURN_IF_ERROR(CheckDigest(t.checksum, m.checksum, where + ": tensor " + tname));
    if (m.is_delta) {
      DS_RETURN_IF_ERROR(get_string(*it, "base_checksum", &t.base_checksum));
      DS_RETURN_IF_ERROR(CheckDigest(t.base_checksum, m.checksum, where + ": tensor " + tname));
      auto changed = it->find("changed");
      if (changed == it->end() || !changed->is_number_unsigned()) {
        return bad("tensor " + tname + ": \"changed\" is missing or not a count");
      }
      t.changed = changed->get<uint64_t>();
    }
    if (m.strong) {
      DS_RETURN_IF_ERROR(get_string(*it, "strong_checksum", &t.strong_checksum));
      DS_RETURN_IF_ERROR(CheckDigest(t.strong_checksum, *m.strong, where + ": tensor " + tname));
      if (m.is_delta) {
        DS_RETURN_IF_ERROR(get_string(*it, "strong_base_checksum", &t.strong_base_checksum));
        DS_RETURN_IF_ERROR(
            CheckDigest(t.strong_base_checksum, *m.strong, where + ": tensor " + tname));
      }
    }
    m.tensors.emplace(it.key(), std::move(t));
  }
  if (!m.is_delta) {
    m.state.emplace();
    for (const auto& [name, t] : m.tensors) {
      m.state->emplace(name, t.checksum);
      if (m.strong) m.strong_state.emplace(name, t.strong_checksum);
    }
    return m;
  }
  // A delta's state: every tensor's digest, which for a changed tensor must
  // be the one `tensors` records.
  auto read_state = [&](const char* key, ChecksumAlgo algo, std::string ManifestTensor::*field,
                        std::map<std::string, std::string>* out) -> Status {
    auto obj = doc.find(key);
    if (obj == doc.end() || !obj->is_object()) {
      return bad(std::string("\"") + key + "\" is missing or not an object");
    }
    for (auto it = obj->begin(); it != obj->end(); ++it) {
      const std::string what = where + ": \"" + key + "\" of tensor " + QuoteForMessage(it.key());
      if (!it->is_string()) return Status::Corruption(what + " is not a string");
      std::string digest = it->get<std::string>();
      DS_RETURN_IF_ERROR(CheckDigest(digest, algo, what));
      out->emplace(it.key(), std::move(digest));
    }
    for (const auto& [name, t] : m.tensors) {
      auto found = out->find(name);
      if (found == out->end() || found->second != t.*field) {
        return bad(std::string("\"") + key + "\" disagrees with tensor " + QuoteForMessage(name) +
                   " (a changed tensor's new digest)");
      }
    }
    return Status::OK();
  };
  if (doc.contains("state")) {
    m.state.emplace();
    DS_RETURN_IF_ERROR(read_state("state", m.checksum, &ManifestTensor::checksum, &*m.state));
    if (m.strong) {
      DS_RETURN_IF_ERROR(
          read_state("strong_state", *m.strong, &ManifestTensor::strong_checksum, &m.strong_state));
      if (m.strong_state.size() != m.state->size() ||
          !std::equal(m.state->begin(), m.state->end(), m.strong_state.begin(),
                      [](const auto& a, const auto& b) { return a.first == b.first; })) {
        return bad("\"strong_state\" and \"state\" name different tensors");
      }
    }
  } else if (m.strong) {
    return bad("\"strong_checksum_format\" without \"state\"");
  }
  return m;
}

Status CheckDigestText(std::string_view digest, ChecksumAlgo algo, std::string_view what) {
  return CheckDigest(digest, algo, what);
}

bool IsWeakChecksum(ChecksumAlgo algo) { return algo == ChecksumAlgo::kAdler32; }

std::optional<ExpectedDigests> StrongDigestsOf(const VersionManifest& manifest,
                                               const ManifestTensor& t) {
  if (!manifest.strong || !manifest.is_delta) return std::nullopt;
  return ExpectedDigests{*manifest.strong, t.strong_checksum, t.strong_base_checksum};
}

}  // namespace store_internal
}  // namespace deltasync
