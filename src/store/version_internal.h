// Version-directory internals shared by the publisher and the local checkpoint.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "deltasync/store.h"

namespace deltasync::store_internal {

// <store>/weight_vNNNNNN.
std::string VersionDir(const std::string& store, int64_t version);

// The sidecar's JSON text (sorted keys, one-space indent, final newline).
std::string SerializeVersionManifest(const VersionManifest& manifest);
// Parses and validates a sidecar; `where` (its path) prefixes messages.
Result<VersionManifest> ParseVersionManifest(std::string_view text, const std::string& where);

// The strong algorithm recorded beside a weak checksum_format.
inline constexpr ChecksumAlgo kStrongChecksum = ChecksumAlgo::kXxh3_128;

// True for a checksum_format that can be matched on purpose (adler32: two
// edits 65521 bytes apart that cancel pass it). Versions we publish with
// one also record kStrongChecksum digests in their sidecar.
bool IsWeakChecksum(ChecksumAlgo algo);

// What a pull verifies a changed tensor against: hex digests in `algo` of
// its new bytes and of the bytes the delta applies to.
struct ExpectedDigests {
  ChecksumAlgo algo = kStrongChecksum;
  std::string checksum;
  std::string base_checksum;
};

// The strong digests the sidecar `manifest` of a delta records for its
// tensor `t`, or nullopt when it records none (then the peer-readable
// checksum and base_checksum are what the pull has).
std::optional<ExpectedDigests> StrongDigestsOf(const VersionManifest& manifest,
                                               const ManifestTensor& t);

// Corruption naming `what` unless `digest` is the lowercase hex form of a
// digest of `algo`.
Status CheckDigestText(std::string_view digest, ChecksumAlgo algo, std::string_view what);

}  // namespace deltasync::store_internal
