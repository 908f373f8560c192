// The publisher diffs and hashes each tensor in one chunked pass (the
// pipeline's producer, tested against DiffTensor in src/pipeline). These
// tests hold the versions it writes to the whole-tensor references: what the
// codec makes of one DiffTensor call, one-shot ChecksumHex digests, and a
// plain loop for the changed-element counts.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/safetensors.h"
#include "deltasync/store.h"
#include "pipeline/pipeline_test_util.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

constexpr ChecksumAlgo kAlgos[] = {ChecksumAlgo::kXxh3_64, ChecksumAlgo::kXxh3_128,
                                   ChecksumAlgo::kBlake3, ChecksumAlgo::kAdler32};
// The publisher's chunk: tensors below cross it, and changes sit on it.
constexpr size_t kPublisherChunkBytes = size_t{512} << 10;

using pipeline_test::Mutate;
using pipeline_test::RandomBytes;

// ---------------------------------------------------------------------------
// Through the public API: what the publisher writes must equal what the
// codec makes of one whole-tensor diff, with one-shot digests.

// Tensors that cross the publisher's chunk (and are not multiples of it),
// one-byte elements, an unchanged tensor, a fully changed one, an empty one.
Model MakeChunkyModel(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model m;
  auto add = [&](std::string name, DType dtype, int64_t numel) {
    OwnedTensor t{std::move(name), dtype, {numel}, {}};
    t.data = RandomBytes(static_cast<size_t>(numel) * DTypeSize(dtype), &rng);
    m.push_back(std::move(t));
  };
  add("a.bf16", DType::kBF16, 700001);
  add("b.u8", DType::kU8, 1200007);
  add("c.same.f32", DType::kF32, 300001);
  add("d.small.f64", DType::kF64, 33);
  add("e.dense.f16", DType::kF16, 70000);
  add("f.empty", DType::kF32, 0);
  return m;
}

Model StepChunkyModel(const Model& model, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model next = model;
  for (OwnedTensor& t : next) {
    const uint32_t es = static_cast<uint32_t>(DTypeSize(t.dtype));
    if (t.name == "c.same.f32") continue;
    const double density = t.name == "e.dense.f16" ? 1.0 : 0.015;
    t.data = Mutate(t.data, es, density, &rng);
    // Both sides of each chunk boundary.
    const size_t chunk_numel = kPublisherChunkBytes / es;
    for (size_t b = chunk_numel; b < t.data.size() / es; b += chunk_numel) {
      t.data[(b - 1) * es] ^= 0x01;
      t.data[b * es] ^= 0x80;
    }
  }
  return next;
}

uint64_t NaiveChanged(const OwnedTensor& a, const OwnedTensor& b) {
  const size_t es = DTypeSize(a.dtype);
  uint64_t n = 0;
  for (size_t i = 0; i < a.data.size(); i += es) {
    n += std::memcmp(a.data.data() + i, b.data.data() + i, es) != 0;
  }
  return n;
}

struct Reference {
  uint64_t changed = 0;
  std::vector<uint8_t> encoded;
};

Reference Expect(const OwnedTensor& old_t, const OwnedTensor& new_t, const Codec& codec,
                 const EncodeOptions& encode) {
  Reference r;
  DiffOptions options;
  options.elem_size = static_cast<uint32_t>(DTypeSize(old_t.dtype));
  options.refresh_snapshot = false;
  options.keep_old_values = true;
  std::vector<uint8_t> snapshot = old_t.data;
  ChangeSet changes;
  EXPECT_TRUE(DiffTensor(new_t.data, snapshot, options, &changes).ok());
  r.changed = changes.count();
  if (r.changed > 0) {
    EXPECT_TRUE(codec.Encode(new_t.data, changes, encode, &r.encoded).ok());
  }
  return r;
}

// Checks the delta version `version_dir` made from old -> next.
void CheckDeltaVersion(const std::string& version_dir, const Model& old_model,
                       const Model& next_model, const PublisherOptions& po,
                       const PublishResult& result) {
  SCOPED_TRACE(std::string(EncodingName(po.encoding)) + " / " +
               std::string(ChecksumAlgoName(po.checksum)));
  const Codec& codec = GetCodec(po.encoding);
  Result<std::optional<VersionManifest>> manifest = ReadVersionManifest(version_dir);
  ASSERT_TRUE(manifest.ok() && manifest->has_value()) << manifest.status().ToString();
  Result<std::unique_ptr<Checkpoint>> version = Checkpoint::Open(version_dir);
  ASSERT_TRUE(version.ok()) << version.status().ToString();
  uint64_t changed_total = 0, tensors_changed = 0;
  for (size_t i = 0; i < old_model.size(); ++i) {
    const OwnedTensor& o = old_model[i];
    const OwnedTensor& n = next_model[i];
    const Reference ref = Expect(o, n, codec, po.encode);
    EXPECT_EQ(ref.changed, NaiveChanged(o, n)) << o.name;
    auto t = (*manifest)->tensors.find(o.name);
    auto stored = (*version)->tensors().find(o.name);
    if (ref.changed == 0) {
      EXPECT_EQ(t, (*manifest)->tensors.end()) << o.name << " is unchanged but listed";
      EXPECT_EQ(stored, (*version)->tensors().end()) << o.name << " is unchanged but stored";
      continue;
    }
    ++tensors_changed;
    changed_total += ref.changed;
    ASSERT_NE(t, (*manifest)->tensors.end()) << o.name;
    ASSERT_NE(stored, (*version)->tensors().end()) << o.name;
    EXPECT_EQ(t->second.changed, ref.changed) << o.name;
    EXPECT_EQ(t->second.checksum, ChecksumHex(po.checksum, n.data)) << o.name;
    EXPECT_EQ(t->second.base_checksum, ChecksumHex(po.checksum, o.data)) << o.name;
    EXPECT_TRUE(std::equal(stored->second.bytes.begin(), stored->second.bytes.end(),
                           ref.encoded.begin(), ref.encoded.end()))
        << o.name << ": encoded bytes differ from the whole-tensor diff's";
    // The shard's own digest, the one the Python receiver reads.
    Result<std::string> file = (*version)->FileOf(o.name);
    ASSERT_TRUE(file.ok());
    Result<std::unique_ptr<SafetensorsFile>> shard =
        SafetensorsFile::Open(version_dir + "/" + *file);
    ASSERT_TRUE(shard.ok());
    EXPECT_EQ((*shard)->metadata().at(o.name), ChecksumHex(po.checksum, n.data)) << o.name;
  }
  EXPECT_EQ(result.changed_elements, changed_total);
  EXPECT_EQ(result.tensors_changed, tensors_changed);
}

TEST(FusedPublish, OneShotDeltaEqualsWholeTensorReferenceForEveryEncodingAndChecksum) {
  TempDir tmp;
  ThreadPool pool(2);
  const Model old_model = MakeChunkyModel(1);
  const Model next_model = StepChunkyModel(old_model, 2);
  int n = 0;
  for (ChecksumAlgo algo : kAlgos) {
    for (Encoding encoding : AllEncodings()) {
      PublisherOptions po;
      po.store = tmp.Join("store" + std::to_string(n++));
      po.encoding = encoding;
      po.checksum = algo;
      po.pool = &pool;
      Result<PublishResult> r = PublishOnce(po, Views(old_model), Views(next_model));
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      CheckDeltaVersion(po.store + "/" + VersionDirName(1), old_model, next_model, po, *r);
    }
  }
}

// A hook that fails while `flag` exists.
std::string FailWhileFlagHook(const TempDir& tmp, const std::string& flag) {
  const std::string hook = tmp.Join("hook.sh");
  WriteFile(hook, "#!/bin/sh\n[ ! -e " + flag + " ]\n");
  ::chmod(hook.c_str(), 0755);
  return hook;
}

TEST(FusedPublish, KeptSnapshotDigestsFollowRefreshesFailuresAndFullVersions) {
  for (uint64_t budget : {uint64_t{1} << 30, uint64_t{0}}) {  // refresh in the diff, or after
    SCOPED_TRACE("undo budget " + std::to_string(budget));
    TempDir tmp;
    ThreadPool pool(2);
    const std::string flag = tmp.Join("fail");
    PublisherOptions po;
    po.store = tmp.Join("store");
    po.pool = &pool;
    po.undo_budget_bytes = budget;
    po.post_write_hook = FailWhileFlagHook(tmp, flag);
    std::vector<Model> models{MakeChunkyModel(3)};
    for (int k = 0; k < 4; ++k) models.push_back(StepChunkyModel(models.back(), 10 + k));
    Result<std::unique_ptr<Publisher>> publisher = Publisher::Create(po, Views(models[0]));
    ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
    Publisher& p = **publisher;

    // v1: the base digests are computed in the diff pass.
    Result<PublishResult> r = p.Publish(Views(models[1]));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    CheckDeltaVersion(po.store + "/" + VersionDirName(1), models[0], models[1], po, *r);

    // A failed publish restores the snapshot, and with it the digest of
    // what it holds: v2 must still name models[1]'s digests as its base.
    WriteFile(flag, "");
    r = p.Publish(Views(models[2]));
    ASSERT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
    for (const TensorView& t : p.snapshot()) {
      const auto expected = AsMap(models[1]).at(t.name);
      ASSERT_TRUE(std::equal(t.bytes.begin(), t.bytes.end(), expected.begin(), expected.end()))
          << t.name;
    }
    ::unlink(flag.c_str());
    r = p.Publish(Views(models[2]));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    CheckDeltaVersion(po.store + "/" + VersionDirName(2), models[1], models[2], po, *r);

    // A full version reports its changes against the snapshot and leaves
    // the digests of its weights for the next delta.
    r = p.Publish(Views(models[3]), /*full=*/true);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    uint64_t expected_changed = 0;
    for (size_t i = 0; i < models[3].size(); ++i) {
      expected_changed += NaiveChanged(models[2][i], models[3][i]);
    }
    EXPECT_EQ(r->changed_elements, expected_changed);
    EXPECT_EQ(r->tensors_changed, models[3].size());
    r = p.Publish(Views(models[4]));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    CheckDeltaVersion(po.store + "/" + VersionDirName(4), models[3], models[4], po, *r);
  }
}

TEST(FusedPublish, OneShotFullVersionCountsChangesAgainstTheBase) {
  TempDir tmp;
  ThreadPool pool(2);
  const Model old_model = MakeChunkyModel(5);
  const Model next_model = StepChunkyModel(old_model, 6);
  for (ChecksumAlgo algo : kAlgos) {
    PublisherOptions po;
    po.store = tmp.Join("store-" + std::string(ChecksumAlgoName(algo)));
    po.checksum = algo;
    po.pool = &pool;
    Result<PublishResult> r = PublishOnce(po, Views(old_model), Views(next_model), /*full=*/true);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    uint64_t expected_changed = 0;
    for (size_t i = 0; i < old_model.size(); ++i) {
      expected_changed += NaiveChanged(old_model[i], next_model[i]);
    }
    EXPECT_GT(expected_changed, 0u);
    EXPECT_EQ(r->changed_elements, expected_changed);
    EXPECT_EQ(r->tensors_changed, old_model.size());
    EXPECT_EQ(r->total_elements, [&] {
      uint64_t total = 0;
      for (const OwnedTensor& t : old_model) total += t.data.size() / DTypeSize(t.dtype);
      return total;
    }());
    const std::string dir = po.store + "/" + VersionDirName(1);
    EXPECT_TRUE(HoldsModel(dir, next_model));
    Result<std::optional<VersionManifest>> manifest = ReadVersionManifest(dir);
    ASSERT_TRUE(manifest.ok() && manifest->has_value());
    for (const OwnedTensor& t : next_model) {
      EXPECT_EQ((*manifest)->tensors.at(t.name).checksum, ChecksumHex(algo, t.data)) << t.name;
    }
  }
}

}  // namespace
}  // namespace deltasync::store_test
