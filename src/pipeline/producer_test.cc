// The producer against independent references: each encoding a sink gets
// applies (DecodeApply) to the old bytes to give exactly the new ones, the
// digests are one-shot checksums of the old and new bytes, the counts a
// plain loop's; a refresh leaves the snapshot at the new bytes and its undo
// log puts it back; lanes are never shared by two calls at once.

#include "pipeline/producer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "deltasync/checksum.h"
#include "deltasync/codec.h"
#include "deltasync/thread_pool.h"

namespace deltasync::pipeline {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64* rng) {
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>((*rng)());
  return out;
}

// `old_bytes` with about `density` of its elements changed (one byte each).
std::vector<uint8_t> Mutate(const std::vector<uint8_t>& old_bytes, uint32_t elem_size,
                            double density, std::mt19937_64* rng) {
  std::vector<uint8_t> out = old_bytes;
  std::bernoulli_distribution pick(density);
  for (size_t i = 0; i < out.size() / elem_size; ++i) {
    if (pick(*rng)) out[i * elem_size + (*rng)() % elem_size] ^= 1 + (*rng)() % 255;
  }
  return out;
}

uint64_t NaiveChanged(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, uint32_t es) {
  uint64_t n = 0;
  for (size_t i = 0; i < a.size(); i += es) n += std::memcmp(&a[i], &b[i], es) != 0;
  return n;
}

// Keeps every encoding it is given, and checks that no lane is used by two
// calls at once.
class MemorySink final : public EncodingSink {
 public:
  Status Put(size_t lane, size_t index, const TensorDelta& delta,
             std::span<const uint8_t> encoding) override {
    std::atomic<int>& busy = Busy(lane);
    if (busy.fetch_add(1) != 0) shared_lane = true;
    if (!delta.diffed || !delta.changed || delta.encoded_bytes != encoding.size()) {
      inconsistent = true;
    }
    Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      lanes.insert(lane);
      if (!encodings.emplace(index, std::vector<uint8_t>(encoding.begin(), encoding.end()))
               .second) {
        inconsistent = true;
      }
      if (fail_after && encodings.size() >= *fail_after) {
        status = Status::IOError("sink full at tensor " + std::to_string(index));
      }
    }
    busy.fetch_sub(1);
    return status;
  }

  std::map<size_t, std::vector<uint8_t>> encodings;
  std::set<size_t> lanes;
  std::atomic<bool> shared_lane{false};
  std::atomic<bool> inconsistent{false};
  std::optional<size_t> fail_after;

 private:
  std::atomic<int>& Busy(size_t lane) {
    std::lock_guard<std::mutex> lock(mu_);
    while (busy_.size() <= lane) busy_.emplace_back(0);
    return busy_[lane];
  }
  std::mutex mu_;
  std::deque<std::atomic<int>> busy_;
};

struct Case {
  std::string name;
  uint32_t es;
  std::vector<uint8_t> old_bytes, new_bytes;
};

std::vector<Case> MakeCases(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  auto add = [&](std::string name, uint32_t es, size_t numel, double density) {
    Case c{std::move(name), es, RandomBytes(numel * es, &rng), {}};
    c.new_bytes = Mutate(c.old_bytes, es, density, &rng);
    cases.push_back(std::move(c));
  };
  // Across several fused chunks, below one, unchanged, fully changed, empty.
  add("big.bf16", 2, 700001, 0.02);
  add("u8", 1, (size_t{1} << 20) + 3, 0.01);
  add("same.f32", 4, 30001, 0.0);
  add("dense.f16", 2, 5000, 1.0);
  add("f64", 8, 333, 0.1);
  add("empty", 4, 0, 0.0);
  return cases;
}

std::vector<ProduceTensor> Inputs(const std::vector<Case>& cases,
                                  std::vector<std::vector<uint8_t>>* snapshots) {
  snapshots->clear();
  std::vector<ProduceTensor> inputs;
  for (const Case& c : cases) snapshots->push_back(c.old_bytes);
  for (size_t i = 0; i < cases.size(); ++i) {
    ProduceTensor t;
    t.name = cases[i].name;
    t.new_bytes = cases[i].new_bytes;
    t.snapshot = (*snapshots)[i];
    t.elem_size = cases[i].es;
    t.base_digests.Add(ChecksumAlgo::kXxh3_64);
    t.base_digests.Add(ChecksumAlgo::kBlake3);
    t.new_digests.Add(ChecksumAlgo::kAdler32);
    t.new_digests.Add(ChecksumAlgo::kXxh3_128);
    inputs.push_back(t);
  }
  return inputs;
}

TEST(Producer, EncodingsApplyToTheNewBytesAndDigestsAreOneShotChecksums) {
  const std::vector<Case> cases = MakeCases(21);
  ThreadPool pool(3);
  for (Encoding encoding : AllEncodings()) {
    for (bool refresh : {false, true}) {
      SCOPED_TRACE(std::string(EncodingName(encoding)) + (refresh ? " refresh" : " no refresh"));
      std::vector<std::vector<uint8_t>> snapshots;
      const std::vector<ProduceTensor> inputs = Inputs(cases, &snapshots);
      ProducerOptions options;
      options.encoding = encoding;
      options.pool = &pool;
      options.refresh = refresh;
      Producer producer(options);
      MemorySink sink;
      std::vector<TensorDelta> deltas;
      const Status s = producer.Run(inputs, &sink, &deltas);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(deltas.size(), cases.size());
      EXPECT_FALSE(sink.shared_lane);
      EXPECT_FALSE(sink.inconsistent);
      EXPECT_LE(sink.lanes.size(), pool.size() + 1);
      for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        const TensorDelta& d = deltas[i];
        SCOPED_TRACE(c.name);
        const uint64_t changed = NaiveChanged(c.old_bytes, c.new_bytes, c.es);
        EXPECT_TRUE(d.diffed);
        EXPECT_EQ(d.changed, changed > 0);
        EXPECT_EQ(d.changed_elements, changed);
        EXPECT_EQ(d.base_digests[0], ChecksumHex(ChecksumAlgo::kXxh3_64, c.old_bytes));
        EXPECT_EQ(d.base_digests[1], ChecksumHex(ChecksumAlgo::kBlake3, c.old_bytes));
        EXPECT_EQ(d.new_digests[0], ChecksumHex(ChecksumAlgo::kAdler32, c.new_bytes));
        EXPECT_EQ(d.new_digests[1], ChecksumHex(ChecksumAlgo::kXxh3_128, c.new_bytes));
        EXPECT_EQ(d.refreshed, refresh);
        EXPECT_EQ(snapshots[i], refresh ? c.new_bytes : c.old_bytes);
        ASSERT_EQ(sink.encodings.count(i), changed > 0 ? 1u : 0u)
            << "unchanged tensors send nothing";
        if (changed > 0) {
          std::vector<uint8_t> target = c.old_bytes;
          const Status applied = DecodeApply(encoding, sink.encodings[i], target, c.es);
          ASSERT_TRUE(applied.ok()) << applied.ToString();
          EXPECT_TRUE(target == c.new_bytes) << "the encoding does not give the new bytes";
        }
        if (refresh) {
          UndoRefresh(d.undo, snapshots[i]);
          EXPECT_TRUE(snapshots[i] == c.old_bytes) << "the undo log does not restore the base";
        }
      }
    }
  }
}

TEST(Producer, AnElementRangeIsATensorOfItsOwn) {
  // A sharded trainer diffs the range it holds; the receiver applies the
  // range's encoding to the same range of its copy.
  std::mt19937_64 rng(22);
  const std::vector<uint8_t> old_bytes = RandomBytes(2 * 100000, &rng);
  const std::vector<uint8_t> new_bytes = Mutate(old_bytes, 2, 0.05, &rng);
  const size_t first = 2 * 30011, length = 2 * 40000;
  std::vector<uint8_t> snapshot(old_bytes.begin() + first, old_bytes.begin() + first + length);
  ProduceTensor t;
  t.name = "range";
  t.new_bytes = std::span(new_bytes).subspan(first, length);
  t.snapshot = snapshot;
  t.elem_size = 2;
  t.new_digests.Add(ChecksumAlgo::kXxh3_64);
  ProducerOptions options;
  options.encoding = Encoding::kSparse;
  Producer producer(options);
  MemorySink sink;
  std::vector<TensorDelta> deltas;
  ASSERT_TRUE(producer.Run({&t, 1}, &sink, &deltas).ok());
  ASSERT_EQ(sink.encodings.count(0), 1u);
  std::vector<uint8_t> receiver = old_bytes;
  ASSERT_TRUE(DecodeApply(Encoding::kSparse, sink.encodings[0],
                          std::span(receiver).subspan(first, length), 2)
                  .ok());
  std::vector<uint8_t> expected = old_bytes;
  std::copy(new_bytes.begin() + first, new_bytes.begin() + first + length,
            expected.begin() + first);
  EXPECT_TRUE(receiver == expected);
  EXPECT_EQ(deltas[0].new_digests[0],
            ChecksumHex(ChecksumAlgo::kXxh3_64, std::span(new_bytes).subspan(first, length)));
}

TEST(Producer, ASinkErrorStopsTheRunAndEveryRefreshCanBeUndone) {
  const std::vector<Case> cases = MakeCases(23);
  // One worker and the caller: the two largest tensors run first, and every
  // later one starts only after one of them has failed in the sink.
  ThreadPool pool(1);
  std::vector<std::vector<uint8_t>> snapshots;
  const std::vector<ProduceTensor> inputs = Inputs(cases, &snapshots);
  ProducerOptions options;
  options.encoding = Encoding::kXor;
  options.pool = &pool;
  Producer producer(options);
  MemorySink sink;
  sink.fail_after = 1;
  std::vector<TensorDelta> deltas;
  const Status s = producer.Run(inputs, &sink, &deltas);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("sink full"), std::string::npos) << s.ToString();
  size_t skipped = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!deltas[i].diffed) ++skipped;
    if (deltas[i].refreshed) UndoRefresh(deltas[i].undo, snapshots[i]);
    EXPECT_TRUE(snapshots[i] == cases[i].old_bytes) << cases[i].name << " not restored";
  }
  EXPECT_GE(skipped, cases.size() - 2) << "tensors started after the error";
}

TEST(Producer, RefreshingStopsOnceTheUndoLogsHoldTheBudget) {
  const std::vector<Case> cases = MakeCases(24);
  std::vector<std::vector<uint8_t>> snapshots;
  const std::vector<ProduceTensor> inputs = Inputs(cases, &snapshots);
  ProducerOptions options;
  options.encoding = Encoding::kSparse;
  options.undo_budget_bytes = 0;
  Producer producer(options);
  MemorySink sink;
  std::vector<TensorDelta> deltas;
  ASSERT_TRUE(producer.Run(inputs, &sink, &deltas).ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_FALSE(deltas[i].refreshed) << cases[i].name;
    EXPECT_TRUE(snapshots[i] == cases[i].old_bytes) << cases[i].name << " was written";
  }
  // One byte of budget: the tensors started first (the largest) refresh and
  // use it up; the later ones find it spent.
  options.undo_budget_bytes = 1;
  ThreadPool pool(1);
  options.pool = &pool;
  Producer budgeted(options);
  std::vector<std::vector<uint8_t>> again;
  const std::vector<ProduceTensor> more = Inputs(cases, &again);
  ASSERT_TRUE(budgeted.Run(more, &sink, &deltas).ok());
  size_t refreshed = 0;
  for (const TensorDelta& d : deltas) refreshed += d.refreshed;
  EXPECT_GE(refreshed, 1u);
  EXPECT_LT(refreshed, cases.size());
}

TEST(Producer, BadOperandsAreRefusedNamingTheTensor) {
  std::vector<uint8_t> a(12, 1), b(12, 0);
  ProduceTensor t;
  t.name = "odd";
  t.new_bytes = a;
  t.snapshot = b;
  t.elem_size = 3;
  Producer producer(ProducerOptions{});
  MemorySink sink;
  std::vector<TensorDelta> deltas;
  Status s = producer.Run({&t, 1}, &sink, &deltas);
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  EXPECT_EQ(s.message().rfind("tensor 'odd': ", 0), 0u) << s.ToString();
  EXPECT_NE(s.message().find("element size 3"), std::string::npos) << s.ToString();
  EXPECT_FALSE(deltas[0].diffed);
  EXPECT_EQ(b, std::vector<uint8_t>(12, 0));
  t.elem_size = 2;
  t.snapshot = std::span(b).first(10);
  s = producer.Run({&t, 1}, &sink, &deltas);
  EXPECT_NE(s.message().find("length mismatch"), std::string::npos) << s.ToString();
  EXPECT_TRUE(sink.encodings.empty());
}

}  // namespace
}  // namespace deltasync::pipeline
