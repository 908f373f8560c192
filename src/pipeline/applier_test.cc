// The applier against independent references: the codec's one-shot Encode
// of a DiffTensor ChangeSet is applied to a copy of the old bytes, which
// must end up as the new bytes, verified against one-shot checksums; the
// runs an observer sees are that ChangeSet, cut in ascending runs; a
// decode-only pass writes nothing; every failure names the tensor.

#include "pipeline/applier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/thread_pool.h"

namespace deltasync::pipeline {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64* rng) {
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>((*rng)());
  return out;
}

struct Case {
  std::string what;
  uint32_t es;
  std::vector<uint8_t> old_bytes, new_bytes;
  ChangeSet changes;  // DiffTensor's, with old values
  std::vector<uint8_t> encoded;
  std::string digest;  // xxh3-128 of new_bytes
};

std::vector<Case> MakeCases(Encoding encoding, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  auto add = [&](std::string what, uint32_t es, size_t numel, double density) {
    Case c{std::move(what), es, RandomBytes(numel * es, &rng), {}, {}, {}, {}};
    c.new_bytes = c.old_bytes;
    std::bernoulli_distribution pick(density);
    for (size_t i = 0; i < numel; ++i) {
      if (pick(rng)) c.new_bytes[i * es + rng() % es] ^= static_cast<uint8_t>(1 + rng() % 255);
    }
    DiffOptions diff;
    diff.elem_size = es;
    diff.refresh_snapshot = false;
    std::vector<uint8_t> snapshot = c.old_bytes;
    EXPECT_TRUE(DiffTensor(c.new_bytes, snapshot, diff, &c.changes).ok());
    EXPECT_TRUE(Encode(encoding, c.new_bytes, c.changes, EncodeOptions{}, &c.encoded).ok());
    c.digest = ChecksumHex(ChecksumAlgo::kXxh3_128, c.new_bytes);
    cases.push_back(std::move(c));
  };
  add("tensor 'big'", 2, 300001, 0.03);
  add("tensor 'bytes'", 1, 70000, 0.01);
  add("tensor 'dense'", 4, 2000, 1.0);
  add("tensor 'same'", 8, 500, 0.0);
  return cases;
}

class VectorSource final : public EncodingSource {
 public:
  explicit VectorSource(const std::vector<Case>& cases) : cases_(cases) {}
  Result<std::span<const uint8_t>> EncodingOf(size_t index) override {
    if (fail_at && *fail_at == index) return Status::IOError("the buffer went away");
    return std::span<const uint8_t>(cases_[index].encoded);
  }
  std::optional<size_t> fail_at;

 private:
  const std::vector<Case>& cases_;
};

// Records each tensor's runs, checking the order of calls and that no
// lane is used by two calls at once.
class Recorder final : public ApplyObserver {
 public:
  // `writes`: the applier writes each non-empty run (kApply).
  Recorder(size_t n, bool writes) : tensors_(n), writes_(writes) {}

  void Begin(size_t lane, size_t index) override {
    Enter(lane);
    T& t = tensors_[index];
    if (t.begun || t.done) misordered = true;
    t.begun = true;
    Leave(lane);
  }
  Status Changes(size_t lane, size_t index, const ChangeSet& run) override {
    Enter(lane);
    T& t = tensors_[index];
    if (!t.begun || t.done || t.pending) misordered = true;
    t.runs.push_back(run);
    t.pending = writes_ && run.count() > 0;
    Leave(lane);
    if (fail_at_run && t.runs.size() == *fail_at_run) return Status::Aborted("journal full");
    return Status::OK();
  }
  void Written(size_t lane, size_t index, const ChangeSet& run) override {
    Enter(lane);
    T& t = tensors_[index];
    if (!t.pending || run.count() != t.runs.back().count()) misordered = true;
    t.pending = false;
    ++t.written;
    Leave(lane);
  }
  void Done(size_t lane, size_t index) override {
    Enter(lane);
    T& t = tensors_[index];
    if (!t.begun || t.done || t.pending) misordered = true;
    t.done = true;
    Leave(lane);
  }

  struct T {
    bool begun = false, done = false, pending = false;
    size_t written = 0;
    std::vector<ChangeSet> runs;
  };
  const T& tensor(size_t i) const { return tensors_[i]; }
  std::atomic<bool> misordered{false};
  std::atomic<bool> shared_lane{false};
  std::optional<size_t> fail_at_run;

 private:
  void Enter(size_t lane) {
    std::lock_guard<std::mutex> lock(mu_);
    while (busy_.size() <= lane) busy_.emplace_back(0);
    if (busy_[lane].fetch_add(1) != 0) shared_lane = true;
  }
  void Leave(size_t lane) {
    std::lock_guard<std::mutex> lock(mu_);
    busy_[lane].fetch_sub(1);
  }
  std::vector<T> tensors_;
  const bool writes_;
  std::mutex mu_;
  std::deque<std::atomic<int>> busy_;
};

std::vector<ApplyTensor> Targets(const std::vector<Case>& cases, Encoding encoding,
                                 std::vector<std::vector<uint8_t>>* targets) {
  targets->clear();
  for (const Case& c : cases) targets->push_back(c.old_bytes);
  std::vector<ApplyTensor> tensors;
  for (size_t i = 0; i < cases.size(); ++i) {
    ApplyTensor t;
    t.what = cases[i].what;
    t.encoding = encoding;
    t.target = (*targets)[i];
    t.elem_size = cases[i].es;
    t.algo = ChecksumAlgo::kXxh3_128;
    t.digest = cases[i].digest;
    tensors.push_back(t);
  }
  return tensors;
}

// The runs, concatenated, are `changes` (positions, old and new values),
// each past the one before and, when there are several, each of at most
// `limit` changes (a decoder that falls back to a scratch copy, and dense,
// hand everything over in one).
void ExpectRunsAre(const std::vector<ChangeSet>& runs, const ChangeSet& changes, uint64_t limit) {
  ASSERT_FALSE(runs.empty()) << "every tensor has a run";
  uint64_t k = 0;
  std::vector<uint8_t> old_values, new_values;
  for (const ChangeSet& run : runs) {
    EXPECT_TRUE(runs.size() == 1 || run.count() <= limit) << run.count() << " changes in a run";
    for (uint64_t r = 0; r < run.count(); ++r, ++k) {
      ASSERT_LT(k, changes.count());
      ASSERT_EQ(run.position(r), changes.position(k)) << "change " << k;
    }
    old_values.insert(old_values.end(), run.old_values.begin(), run.old_values.end());
    new_values.insert(new_values.end(), run.new_values.begin(), run.new_values.end());
  }
  EXPECT_EQ(k, changes.count());
  EXPECT_TRUE(old_values == changes.old_values);
  EXPECT_TRUE(new_values == changes.new_values);
}

TEST(Applier, EveryValueCarryingEncodingGivesTheNewBytesVerified) {
  ThreadPool pool(3);
  for (Encoding encoding : AllEncodings()) {
    SCOPED_TRACE(std::string(EncodingName(encoding)));
    const std::vector<Case> cases = MakeCases(encoding, 31);
    std::vector<std::vector<uint8_t>> targets;
    const std::vector<ApplyTensor> tensors = Targets(cases, encoding, &targets);
    ApplierOptions options;
    options.pool = &pool;
    options.run_changes = 1000;
    options.hash_piece_bytes = 4096;
    Applier applier(options);
    VectorSource source(cases);
    std::vector<ApplyOutcome> outcomes;
    // Twice: the scratch of the first run is reused by the second.
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < cases.size(); ++i) targets[i] = cases[i].old_bytes;
      Recorder recorder(cases.size(), /*writes=*/true);
      const Status s = applier.Run(tensors, &source, &recorder, &outcomes);
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_FALSE(recorder.misordered);
      EXPECT_FALSE(recorder.shared_lane);
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(cases[i].what);
        EXPECT_TRUE(outcomes[i].done);
        EXPECT_FALSE(outcomes[i].mismatch);
        EXPECT_EQ(outcomes[i].changed_elements, cases[i].changes.count());
        EXPECT_TRUE(targets[i] == cases[i].new_bytes);
        EXPECT_TRUE(recorder.tensor(i).done);
        ExpectRunsAre(recorder.tensor(i).runs, cases[i].changes, options.run_changes);
        if (encoding != Encoding::kDense && cases[i].changes.count() > 3 * options.run_changes) {
          EXPECT_GT(recorder.tensor(i).runs.size(), 3u) << "the decode did not stream";
        }
      }
    }
  }
}

TEST(Applier, AWrongDigestIsAMismatchAndNoDigestIsNoCheck) {
  const std::vector<Case> cases = MakeCases(Encoding::kSparse, 32);
  std::vector<std::vector<uint8_t>> targets;
  std::vector<ApplyTensor> tensors = Targets(cases, Encoding::kSparse, &targets);
  const std::string wrong = ChecksumHex(ChecksumAlgo::kXxh3_128, cases[0].old_bytes);
  tensors[0].digest = wrong;
  tensors[1].digest = "";
  tensors[2].algo = ChecksumAlgo::kAdler32;
  const std::string adler = ChecksumHex(ChecksumAlgo::kAdler32, cases[2].new_bytes);
  tensors[2].digest = adler;
  Applier applier(ApplierOptions{});
  VectorSource source(cases);
  std::vector<ApplyOutcome> outcomes;
  ASSERT_TRUE(applier.Run(tensors, &source, nullptr, &outcomes).ok());
  EXPECT_TRUE(outcomes[0].done);
  EXPECT_TRUE(outcomes[0].mismatch);
  EXPECT_TRUE(targets[0] == cases[0].new_bytes) << "written all the same";
  EXPECT_FALSE(outcomes[1].mismatch);
  EXPECT_TRUE(targets[1] == cases[1].new_bytes);
  EXPECT_FALSE(outcomes[2].mismatch);
  EXPECT_FALSE(outcomes[3].mismatch);
}

TEST(Applier, DecodeOnlyHandsOverTheChangesAndWritesNothing) {
  ThreadPool pool(2);
  for (Encoding encoding : {Encoding::kXor, Encoding::kIndices, Encoding::kSparse}) {
    SCOPED_TRACE(std::string(EncodingName(encoding)));
    const std::vector<Case> cases = MakeCases(encoding, 33);
    std::vector<std::vector<uint8_t>> targets;
    std::vector<ApplyTensor> tensors = Targets(cases, encoding, &targets);
    tensors[0].digest = "not even hex";  // never compared
    ApplierOptions options;
    options.mode = ApplyMode::kDecodeOnly;
    options.pool = &pool;
    options.run_changes = 777;
    Applier applier(options);
    VectorSource source(cases);
    Recorder recorder(cases.size(), /*writes=*/false);
    std::vector<ApplyOutcome> outcomes;
    ASSERT_TRUE(applier.Run(tensors, &source, &recorder, &outcomes).ok());
    EXPECT_FALSE(recorder.misordered);
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(cases[i].what);
      EXPECT_TRUE(targets[i] == cases[i].old_bytes) << "a decode-only pass wrote the target";
      EXPECT_TRUE(outcomes[i].done);
      EXPECT_FALSE(outcomes[i].mismatch);
      EXPECT_EQ(outcomes[i].changed_elements, cases[i].changes.count());
      EXPECT_EQ(recorder.tensor(i).written, 0u);
      ExpectRunsAre(recorder.tensor(i).runs, cases[i].changes, options.run_changes);
    }
  }
}

TEST(Applier, FailuresNameTheTensorAndStopTheRun) {
  ThreadPool pool(2);
  const std::vector<Case> cases = MakeCases(Encoding::kSparse, 34);
  ApplierOptions options;
  options.pool = &pool;
  options.run_changes = 500;
  Applier applier(options);
  std::vector<ApplyOutcome> outcomes;
  {
    // Bytes that violate the format.
    std::vector<Case> corrupt = cases;
    corrupt[1].encoded.resize(corrupt[1].encoded.size() / 2);
    std::vector<std::vector<uint8_t>> targets;
    const std::vector<ApplyTensor> tensors = Targets(corrupt, Encoding::kSparse, &targets);
    VectorSource source(corrupt);
    const Status s = applier.Run(tensors, &source, nullptr, &outcomes);
    EXPECT_TRUE(s.IsCorruption()) << s.ToString();
    EXPECT_EQ(s.message().rfind("tensor 'bytes': ", 0), 0u) << s.ToString();
    EXPECT_FALSE(outcomes[1].done);
  }
  {
    // The source's error.
    std::vector<std::vector<uint8_t>> targets;
    const std::vector<ApplyTensor> tensors = Targets(cases, Encoding::kSparse, &targets);
    VectorSource source(cases);
    source.fail_at = 2;
    const Status s = applier.Run(tensors, &source, nullptr, &outcomes);
    EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
    EXPECT_EQ(s.message(), "tensor 'dense': the buffer went away");
    EXPECT_FALSE(outcomes[2].done);
    EXPECT_TRUE(targets[2] == cases[2].old_bytes);
  }
  {
    // The observer's error, at a tensor's second run: its first run is
    // written, the second not.
    std::vector<std::vector<uint8_t>> targets;
    const std::vector<ApplyTensor> tensors = Targets(cases, Encoding::kSparse, &targets);
    VectorSource source(cases);
    Recorder recorder(cases.size(), /*writes=*/true);
    recorder.fail_at_run = 2;
    const Status s = applier.Run(tensors, &source, &recorder, &outcomes);
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_EQ(s.message().rfind("tensor '", 0), 0u) << s.ToString();
    size_t failed = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      if (outcomes[i].done) continue;
      ++failed;
      EXPECT_FALSE(recorder.tensor(i).done);
    }
    EXPECT_GE(failed, 1u);
  }
}

}  // namespace
}  // namespace deltasync::pipeline
