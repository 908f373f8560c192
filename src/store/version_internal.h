// Version-directory internals shared by the publisher and the local checkpoint.
#pragma once

#include <string>
#include <string_view>

#include "deltasync/store.h"

namespace deltasync::store_internal {

// The index's compression_format for an encoding: "zstd" for the encodings
// that hold zstd frames (xor, overwrite, sparse), "none" for dense and indices.
std::string_view CompressionOf(Encoding encoding);

// <store>/weight_vNNNNNN.
std::string VersionDir(const std::string& store, int64_t version);

// The sidecar's JSON text (sorted keys, one-space indent, final newline).
std::string SerializeVersionManifest(const VersionManifest& manifest);
// Parses and validates a sidecar; `where` (its path) prefixes messages.
Result<VersionManifest> ParseVersionManifest(std::string_view text, const std::string& where);

// Corruption naming `what` unless `digest` is the lowercase hex form of a
// digest of `algo`.
Status CheckDigestText(std::string_view digest, ChecksumAlgo algo, std::string_view what);

}  // namespace deltasync::store_internal
