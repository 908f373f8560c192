// The publisher diffs and hashes each tensor in one chunked pass. These
// tests hold that pass to the whole-tensor references it replaces: one
// DiffTensor call for the ChangeSet, one-shot ChecksumHex for the digests,
// and a plain loop for the changed-element counts.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

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
#include "store/store_test_util.h"

namespace deltasync::store_internal {
// Defined in publisher.cc, which has no header of internals to put it in.
Status DiffAndHashInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                           const DiffOptions& options, size_t chunk_bytes, Hasher* base_hasher,
                           Hasher* new_hasher, ChangeSet* piece, ChangeSet* out);
}  // namespace deltasync::store_internal

namespace deltasync::store_test {
namespace {

using store_internal::DiffAndHashInChunks;

constexpr ChecksumAlgo kAlgos[] = {ChecksumAlgo::kXxh3_64, ChecksumAlgo::kXxh3_128,
                                   ChecksumAlgo::kBlake3, ChecksumAlgo::kAdler32};
// The publisher's chunk: tensors below cross it, and changes sit on it.
constexpr size_t kPublisherChunkBytes = size_t{512} << 10;

::testing::AssertionResult SameChangeSet(const ChangeSet& actual, const ChangeSet& expected) {
  if (actual.numel != expected.numel) {
    return ::testing::AssertionFailure() << "numel " << actual.numel << " vs " << expected.numel;
  }
  if (actual.elem_size != expected.elem_size) {
    return ::testing::AssertionFailure()
           << "elem_size " << actual.elem_size << " vs " << expected.elem_size;
  }
  if (actual.wide != expected.wide) {
    return ::testing::AssertionFailure() << "wide " << actual.wide << " vs " << expected.wide;
  }
  if (actual.pos32 != expected.pos32) {
    return ::testing::AssertionFailure() << "pos32 differ (" << actual.pos32.size() << " vs "
                                         << expected.pos32.size() << " entries)";
  }
  if (actual.pos64 != expected.pos64) {
    return ::testing::AssertionFailure() << "pos64 differ (" << actual.pos64.size() << " vs "
                                         << expected.pos64.size() << " entries)";
  }
  if (actual.new_values != expected.new_values) {
    return ::testing::AssertionFailure() << "new_values differ";
  }
  if (actual.old_values != expected.old_values) {
    return ::testing::AssertionFailure() << "old_values differ";
  }
  return ::testing::AssertionSuccess();
}

// `old_bytes` with about `density` of its elements changed, always
// including the first and last (when density > 0).
std::vector<uint8_t> Mutate(const std::vector<uint8_t>& old_bytes, uint32_t elem_size,
                            double density, std::mt19937_64* rng) {
  std::vector<uint8_t> out = old_bytes;
  const size_t numel = out.size() / elem_size;
  if (density <= 0 || numel == 0) return out;
  std::bernoulli_distribution pick(density);
  for (size_t i = 0; i < numel; ++i) {
    if (i == 0 || i + 1 == numel || pick(*rng)) {
      // Any byte of the element, so that every byte lane is exercised.
      out[i * elem_size + (*rng)() % elem_size] ^= static_cast<uint8_t>(1 + (*rng)() % 255);
    }
  }
  return out;
}

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64* rng) {
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>((*rng)());
  return out;
}

TEST(FusedDiff, ChunkedDiffEqualsOneWholeTensorDiff) {
  std::mt19937_64 rng(11);
  // Reused across every case, as the publisher reuses them across tensors.
  ChangeSet out, piece;
  int cases = 0;
  for (uint32_t es : {1u, 2u, 4u, 8u}) {
    for (size_t numel : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
      const std::vector<uint8_t> old_bytes = RandomBytes(numel * es, &rng);
      for (double density : {0.0, 0.01, 0.5, 1.0}) {
        const std::vector<uint8_t> new_bytes = Mutate(old_bytes, es, density, &rng);
        for (size_t chunk : {size_t{1}, size_t{es}, size_t{3 * es + 1}, size_t{64}, size_t{4096},
                             kPublisherChunkBytes}) {
          for (bool refresh : {false, true}) {
            for (bool keep_old : {false, true}) {
              DiffOptions options;
              options.elem_size = es;
              options.refresh_snapshot = refresh;
              options.keep_old_values = keep_old;
              std::vector<uint8_t> expected_snapshot = old_bytes;
              ChangeSet expected;
              ASSERT_TRUE(DiffTensor(new_bytes, expected_snapshot, options, &expected).ok());
              std::vector<uint8_t> snapshot = old_bytes;
              const Status s = DiffAndHashInChunks(new_bytes, snapshot, options, chunk, nullptr,
                                                   nullptr, &piece, &out);
              ASSERT_TRUE(s.ok()) << s.ToString();
              ASSERT_TRUE(SameChangeSet(out, expected))
                  << "es " << es << " numel " << numel << " density " << density << " chunk "
                  << chunk << " refresh " << refresh << " keep_old " << keep_old;
              ASSERT_EQ(snapshot, expected_snapshot);
              ASSERT_EQ(snapshot, refresh ? new_bytes : old_bytes);
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 5 * 4 * 6 * 2 * 2);
}

TEST(FusedDiff, DigestsEqualOneShotChecksumsOfOldAndNewBytes) {
  std::mt19937_64 rng(12);
  for (ChecksumAlgo algo : kAlgos) {
    // Reset between tensors, as the publisher does.
    std::unique_ptr<Hasher> base_hasher = NewHasher(algo);
    std::unique_ptr<Hasher> new_hasher = NewHasher(algo);
    ChangeSet out, piece;
    for (uint32_t es : {1u, 2u, 8u}) {
      // Sizes below, at, and not a multiple of the chunk; one unchanged.
      for (size_t bytes :
           {size_t{0}, size_t{8}, kPublisherChunkBytes, kPublisherChunkBytes * 2 + 8 * 123}) {
        for (double density : {0.0, 0.02}) {
          const std::vector<uint8_t> old_bytes = RandomBytes(bytes, &rng);
          const std::vector<uint8_t> new_bytes = Mutate(old_bytes, es, density, &rng);
          DiffOptions options;
          options.elem_size = es;
          options.refresh_snapshot = true;  // the base digest must predate the refresh
          std::vector<uint8_t> snapshot = old_bytes;
          base_hasher->Reset();
          new_hasher->Reset();
          const Status s = DiffAndHashInChunks(new_bytes, snapshot, options, kPublisherChunkBytes,
                                               base_hasher.get(), new_hasher.get(), &piece, &out);
          ASSERT_TRUE(s.ok()) << s.ToString();
          EXPECT_EQ(base_hasher->HexDigest(), ChecksumHex(algo, old_bytes))
              << ChecksumAlgoName(algo) << " es " << es << " bytes " << bytes;
          EXPECT_EQ(new_hasher->HexDigest(), ChecksumHex(algo, new_bytes))
              << ChecksumAlgoName(algo) << " es " << es << " bytes " << bytes;
          EXPECT_EQ(snapshot, new_bytes);
        }
      }
    }
  }
}

TEST(FusedDiff, BadOperandsAreRefusedBeforeAnyChunkIsTouched) {
  std::vector<uint8_t> buffer(4096, 0);
  std::vector<uint8_t> next(4096, 1);
  ChangeSet out, piece;
  DiffOptions options;
  options.elem_size = 2;
  auto expect_invalid = [&](std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                            const DiffOptions& o, const std::string& words) {
    const std::vector<uint8_t> before(snapshot.begin(), snapshot.end());
    const Status s =
        DiffAndHashInChunks(new_bytes, snapshot, o, 64, nullptr, nullptr, &piece, &out);
    EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
    EXPECT_NE(s.message().find(words), std::string::npos) << s.ToString();
    EXPECT_TRUE(std::equal(before.begin(), before.end(), snapshot.begin()));
  };
  expect_invalid(std::span(next).first(100), std::span(buffer).first(102), options,
                 "length mismatch");
  expect_invalid(std::span(next).first(101), std::span(buffer).first(101), options,
                 "not a multiple of element size");
  DiffOptions three = options;
  three.elem_size = 3;
  expect_invalid(std::span(next).first(99), std::span(buffer).first(99), three, "element size 3");
  // Chunks of the two spans would not overlap, but the spans do.
  expect_invalid(std::span(buffer).subspan(0, 2048), std::span(buffer).subspan(1024, 2048), options,
                 "partially overlap");
  const Status s =
      DiffAndHashInChunks(next, buffer, options, 64, nullptr, nullptr, &piece, nullptr);
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  // The same memory as both operands is allowed (nothing changed).
  ASSERT_TRUE(
      DiffAndHashInChunks(buffer, buffer, options, 64, nullptr, nullptr, &piece, &out).ok());
  EXPECT_EQ(out.count(), 0u);
  EXPECT_EQ(out.numel, 2048u);
}

// Address space that reads as zeros and costs memory only where written.
class SparseRegion {
 public:
  explicit SparseRegion(size_t size) : size_(size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
#ifdef MADV_HUGEPAGE
    // Reads then map the huge zero page: far fewer faults.
    if (data_ != nullptr) (void)::madvise(data_, size_, MADV_HUGEPAGE);
#endif
  }
  ~SparseRegion() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  SparseRegion(const SparseRegion&) = delete;
  SparseRegion& operator=(const SparseRegion&) = delete;
  uint8_t* data() const { return data_; }
  std::span<uint8_t> span() const { return {data_, size_}; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

TEST(FusedDiff, TensorsOfMoreThan2To32ElementsGetWidePositionsAcrossChunks) {
  // One-byte elements, so 2^32 + a few pages of elements fit in 4 GiB of
  // address space that is almost all the zero page.
  const size_t numel = (size_t{1} << 32) + 3 * 4096 + 5;
  SparseRegion old_region(numel), new_region(numel);
  if (old_region.data() == nullptr || new_region.data() == nullptr) {
    GTEST_SKIP() << "cannot reserve 2 x 4 GiB of address space";
  }
  for (uint64_t pos :
       {uint64_t{0}, uint64_t{524287}, uint64_t{524288}, uint64_t{UINT32_MAX} - 1,
        uint64_t{UINT32_MAX}, uint64_t{1} << 32, (uint64_t{1} << 32) + 7, uint64_t{numel} - 1}) {
    new_region.data()[pos] = static_cast<uint8_t>(pos % 251 + 1);
  }
  old_region.data()[(uint64_t{1} << 32) + 7] = 0x77;  // a changed element with a non-zero old value
  DiffOptions options;
  options.elem_size = 1;
  options.refresh_snapshot = false;
  options.keep_old_values = true;
  ChangeSet expected, out, piece;
  ASSERT_TRUE(DiffTensor(new_region.span(), old_region.span(), options, &expected).ok());
  ASSERT_TRUE(expected.wide);
  ASSERT_EQ(expected.count(), 8u);
  const Status s = DiffAndHashInChunks(new_region.span(), old_region.span(), options,
                                       kPublisherChunkBytes, nullptr, nullptr, &piece, &out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(SameChangeSet(out, expected));
}

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
