// What a checkpoint at version V of a store must hold, rebuilt from the
// store itself. Used to verify a local checkpoint whose state.json records
// only {"version": V} (written by the Python receiver, which keeps neither
// per-tensor checksums nor where the checkpoint was copied from).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>

#include "deltasync/checkpoint.h"
#include "deltasync/checksum.h"
#include "deltasync/status.h"

namespace deltasync::store_internal {

// The value one tensor must have at the queried version.
struct ExpectedTensor {
  // The version whose data fixed this value: the newest delta <= V that
  // changed the tensor, else the full version the chain starts from, else 0
  // (the base checkpoint).
  int64_t set_by = 0;
  // Either a digest of the bytes (from a delta's shard metadata or a full
  // version's sidecar)...
  bool by_digest = false;
  ChecksumAlgo algo = ChecksumAlgo::kXxh3_128;
  std::string hex;
  // ...or, when no digest was recorded, the bytes themselves: a read-only
  // mapping into ChainExpectation::reference.
  std::span<const uint8_t> bytes;
};

struct ChainExpectation {
  // One entry per requested name.
  std::map<std::string, ExpectedTensor> tensors;
  // The full version or base checkpoint that byte comparisons read; null
  // when every value is known by digest. Keeps `bytes` above mapped.
  std::unique_ptr<Checkpoint> reference;
  // Where the chain starts: the full version's dir or the base's; empty
  // when the walk never had to go that far.
  std::string reference_dir;
};

struct ChainQuery {
  std::string store;  // may be empty only when version is 0
  std::string base;   // the base checkpoint (version 0); needed only when the chain reaches it
  int64_t version = 0;
  // Names to find expected values for.
  std::set<std::string> wanted;
  // Every tensor the local checkpoint holds: a tensor of the full version or
  // base that the local checkpoint lacks is a mismatch too.
  std::set<std::string> local_names;
};

// Walks back from query.version through the store's deltas to the newest
// full version <= it (or to the base when there is none), stopping early
// once every wanted name has a value. Reads only version metadata, shard
// headers and (for byte comparisons) read-only mappings; no tensor data is
// copied.
// Errors: FailedPrecondition when the store is needed but not given, when
// the base is needed but not given or does not open, or when a delta's
// base_version breaks the chain; NotFound naming a missing version dir;
// Corruption for a delta shard without a well-formed digest for one of its
// tensors, or when a wanted tensor is absent from the full version or base
// (or one of theirs is absent locally); whatever ReadVersionInfo reports for
// a malformed version.
Result<ChainExpectation> RebuildExpectedState(const ChainQuery& query);

}  // namespace deltasync::store_internal
