// libFuzzer target for the version sidecar, deltasync.json (docs/format.md,
// "The sidecar").
//
// The input is a sidecar's text:
//  1. ParseVersionManifest: what it accepts must serialize and parse back
//     to the same manifest, with every digest the right length of lowercase
//     hex; ReadVersionManifest of a directory holding the text must give
//     the same result.
//  2. Pull: the text replaces the sidecar of a version of a small store
//     (versions 1 sparse, 2 xor, 3 full, 4 overwrite): version 2's when it
//     does not parse as a full version's, and the local checkpoint, at
//     version 1, is pulled to 2; version 3's otherwise, pulled to 4 (a
//     reset that records the sidecar's checksums, then a delta checked
//     against them). A pull that succeeds must give the target's exact
//     bytes. One that fails must leave the checkpoint at a version it
//     passed (1, or 3 on the way to 4) with that version's exact bytes,
//     untouched when it is still at 1, and no journal behind.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "deltasync/store.h"
#include "io/file.h"
#include "store/version_internal.h"
#include "store_fuzz_util.h"

namespace {

using deltasync::Encoding;
using deltasync::LocalCheckpoint;
using deltasync::ManifestTensor;
using deltasync::Result;
using deltasync::VersionManifest;
using deltasync::fuzz_util::FuzzStore;
using deltasync::fuzz_util::Require;

struct Fixture {
  FuzzStore store{"ds_version_manifest_fuzz",
                  {Encoding::kSparse, Encoding::kXor, std::nullopt, Encoding::kOverwrite}};
  std::string sidecar2, sidecar3;  // as published
  std::map<std::string, std::string> v1_files;
  deltasync::fuzz_util::ScratchDir scratch{"ds_version_manifest_fuzz_dir"};

  Fixture() {
    store.SaveLocalAt(1, "v1");
    v1_files = deltasync::fuzz_util::VisibleFiles(store.local());
    sidecar2 = deltasync::fuzz_util::ReadFile(Sidecar(2));
    sidecar3 = deltasync::fuzz_util::ReadFile(Sidecar(3));
    Require(!sidecar2.empty() && !sidecar3.empty(), "published versions hold a sidecar");
  }
  std::string Sidecar(int64_t v) const {
    return store.version_dir(v) + "/" + deltasync::kVersionManifestFileName;
  }
};

Fixture& GetFixture() {
  static Fixture fixture;  // static (not leaked): its scratch directory goes at exit
  return fixture;
}

bool SameTensor(const ManifestTensor& a, const ManifestTensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.checksum == b.checksum &&
         a.base_checksum == b.base_checksum && a.changed == b.changed;
}

bool SameManifest(const VersionManifest& a, const VersionManifest& b) {
  if (a.version != b.version || a.is_delta != b.is_delta || a.base_version != b.base_version ||
      a.checksum != b.checksum || a.tensors.size() != b.tensors.size()) {
    return false;
  }
  for (const auto& [name, t] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end() || !SameTensor(t, it->second)) return false;
  }
  return true;
}

bool IsDigest(const std::string& hex, deltasync::ChecksumAlgo algo) {
  if (hex.size() != 2 * deltasync::ChecksumDigestSize(algo)) return false;
  for (char c : hex) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// Whether the text parses as a full version's sidecar.
bool CheckParse(Fixture& f, std::string_view text) {
  Result<VersionManifest> parsed = deltasync::store_internal::ParseVersionManifest(text, "fuzz");
  Require(parsed.ok() || parsed.status().IsCorruption() ||
              parsed.status().code() == deltasync::StatusCode::kUnsupported,
          "a bad sidecar is Corruption or Unsupported");
  deltasync::fuzz_util::WriteFile(f.scratch.Join(deltasync::kVersionManifestFileName), text);
  Result<std::optional<VersionManifest>> read = deltasync::ReadVersionManifest(f.scratch.path());
  Require(read.ok() == parsed.ok(), "ReadVersionManifest accepts what the parser accepts");
  if (!parsed.ok()) return false;
  Require(read->has_value() && SameManifest(**read, *parsed), "both read the same manifest");
  const VersionManifest& m = *parsed;
  for (const auto& [name, t] : m.tensors) {
    Require(IsDigest(t.checksum, m.checksum), "checksums are digests");
    Require(!m.is_delta || IsDigest(t.base_checksum, m.checksum), "base checksums are digests");
    Require(deltasync::ShapeNumel(t.shape).ok(), "shapes have a numel");
  }
  const std::string again = deltasync::store_internal::SerializeVersionManifest(m);
  Result<VersionManifest> reparsed = deltasync::store_internal::ParseVersionManifest(again, "fuzz");
  Require(reparsed.ok() && SameManifest(*reparsed, m), "a manifest survives a round trip");
  return !m.is_delta;
}

void CheckPull(Fixture& f, std::string_view text, bool full) {
  FuzzStore& s = f.store;
  const int64_t edited = full ? 3 : 2;
  const int64_t target = full ? 4 : 2;
  s.Restore("v1");
  deltasync::fuzz_util::WriteFile(f.Sidecar(edited), text);
  {
    Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(s.LocalOpts(false));
    Require(l.ok(), "open the local checkpoint");
    Result<deltasync::PullResult> pulled = (*l)->Pull(target);
    Result<std::optional<int64_t>> now = (*l)->CurrentVersion();
    Require(now.ok() && now->has_value(), "a pull leaves a committed version");
    Require(!deltasync::io::PathExists(s.local() + "/.weight_sync/journal"),
            "a pull leaves no journal");
    if (pulled.ok()) {
      Require(pulled->version == target && **now == target, "a pull reaches its target");
      Require(deltasync::fuzz_util::HoldsModel(s.local(), s.model(target)),
              "a pull that succeeds gives the target's exact bytes");
    } else {
      Require(**now == 1 || (full && **now == 3), "a failed pull stays at a version it passed");
      Require(deltasync::fuzz_util::HoldsModel(s.local(), s.model(**now)),
              "a failed pull leaves a version's exact bytes");
      Require(**now != 1 || deltasync::fuzz_util::VisibleFiles(s.local()) == f.v1_files,
              "a failed pull that stays at version 1 leaves its files untouched");
    }
  }
  deltasync::fuzz_util::WriteFile(f.Sidecar(edited), full ? f.sidecar3 : f.sidecar2);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = GetFixture();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  CheckPull(f, text, CheckParse(f, text));
  return 0;
}
