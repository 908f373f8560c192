// The stream's sender and receivers end to end, over gloo on loopback in
// one process: every receiver bit-exact after every sync, the commit
// protocol's repairs, and every bad input refused with no weight changed.
#include <gtest/gtest.h>

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "comm/communicator_test_util.h"
#include "comm/fault_communicator.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "stream/device_path.h"
#include "stream/frame.h"
#include "stream/sender.h"
#include "stream/sync_messages.h"
#include "stream/sync_rig.h"
#include "stream/sync_test_util.h"

namespace deltasync {
namespace {

using namespace sync_rig;

class SyncEncodings : public SyncTest, public ::testing::WithParamInterface<StreamEncoding> {};

TEST_P(SyncEncodings, EveryReceiverIsBitExactAfterEverySync) {
  SetUpGroup(3);
  Model m = Model::Make(1);
  SenderOptions o;
  o.encoding = GetParam();
  o.bucket_bytes = 64 << 10;  // several frames per sync
  o.verify_every = 3;
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ReceiverRig whole(m, Hold::kWhole, Factory(1));
  ReceiverRig rows(m, Hold::kRows, Factory(2));
  ReceiverRig cols(m, Hold::kColumns, Factory(3));
  for (ReceiverRig* r : {&whole, &rows, &cols}) r->Start();
  for (int step = 0; step < 6; ++step) {
    if (step > 0) m.Step(100 + step, step == 3 ? 0.0 : 0.02);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 3u : 0u);
    EXPECT_EQ(s->verify_all, s->sync_id % 3 == 0);
    if (step > 0 && step != 3) {
      EXPECT_GT(s->changed, 0u);
    }
    if (step == 3) {
      EXPECT_EQ(s->changed, 0u);
    }
    EXPECT_GT(s->frames, 0u);
    for (ReceiverRig* r : {&whole, &rows, &cols}) {
      Status same = r->Matches(m);
      EXPECT_TRUE(same.ok()) << "step " << step << ": " << same.ToString();
    }
    for (const SyncTensor& t : m.tensors) {
      Result<std::span<const uint8_t>> snap = sender->Snapshot(t.name);
      ASSERT_TRUE(snap.ok());
      EXPECT_TRUE(std::equal(snap->begin(), snap->end(), t.data.begin(), t.data.end()));
    }
    EXPECT_EQ(sender->committed_sync_id(), s->sync_id);
  }
  Finish(sender, {&whole, &rows, &cols});
  for (ReceiverRig* r : {&whole, &rows, &cols}) {
    const std::vector<ReceiveStats> stats = r->stats();
    ASSERT_EQ(stats.size(), 6u);
    EXPECT_TRUE(stats[0].seed);
    for (size_t k = 1; k < stats.size(); ++k) EXPECT_FALSE(stats[k].seed);
  }
}

INSTANTIATE_TEST_SUITE_P(Encodings, SyncEncodings,
                         ::testing::Values(StreamEncoding::kDense, StreamEncoding::kIndices,
                                           StreamEncoding::kSparse),
                         [](const auto& info) {
                           return std::string(StreamEncodingName(info.param));
                         });

// The commit log's coding: gaps of 1 to 5 bytes, decoded back to the very
// elements.
TEST(SenderCommitLog, PositionsRoundTripAndOnlyTheirElementsAreCopied) {
  const std::vector<uint32_t> positions = {
      0, 1, 127, 128, 16383, 16384, 2097151, 2097152, 268435455, 268435456, 4000000000u};
  std::vector<uint8_t> log(positions.size() * 5);
  const uint64_t bytes =
      stream_sender::LogPositions(positions.data(), positions.size(), log.data());
  EXPECT_EQ(bytes, stream_sender::LoggedBytes(positions.data(), positions.size()));
  // 0, 1, 126, 1, 16255, 1, 2080767, 1, 266338303, 1, 3731564544.
  EXPECT_EQ(bytes, 1u + 1 + 1 + 1 + 2 + 1 + 3 + 1 + 4 + 1 + 5);
  // Within a small tensor: positions 3, 4, 9 of 12 two-byte elements from
  // element 2.
  const std::vector<uint32_t> near = {1, 2, 7};
  std::vector<uint8_t> small_log(15);
  stream_sender::LogPositions(near.data(), near.size(), small_log.data());
  std::vector<uint8_t> x(24), snap(24, 0);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>(i + 1);
  stream_sender::CopyLogged({2, 3, 0}, 2, small_log.data(), x.data(), snap.data());
  for (size_t e = 0; e < 12; ++e) {
    const bool copied = e == 3 || e == 4 || e == 9;
    EXPECT_EQ(snap[2 * e], copied ? x[2 * e] : 0) << e;
    EXPECT_EQ(snap[2 * e + 1], copied ? x[2 * e + 1] : 0) << e;
  }
}

// A sparse delta's commit copies its changed elements alone while half a
// bucket holds their positions, whole units past that (and units too dense
// to be worth it); the snapshot is the model's after every sync either way.
TEST_F(SyncTest, TheCommitCopiesTheChangedElementsAloneWhileTheirLogHasRoom) {
  SetUpGroup(1);
  std::vector<Model::Spec> specs = Model::DefaultSpecs();
  specs.emplace_back("e.weight", DType::kBF16, std::vector<int64_t>{4000, 1000});
  Model m = Model::Make(5, specs);
  SenderOptions o;
  o.bucket_bytes = 64 << 10;  // a log of 32 KiB
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ReceiverRig r(m, Hold::kWhole, Factory(1));
  r.Start();
  uint64_t model_bytes = 0;
  for (const std::vector<uint8_t>& b : m.bytes) model_bytes += b.size();
  ASSERT_TRUE(sender->Sync(m.tensors).ok());
  // 0.2%: every unit logged. 0.6%: more than the log holds. 20%: every
  // changed unit copied whole.
  for (const double density : {0.002, 0.006, 0.2, 0.0015}) {
    const std::vector<std::vector<uint8_t>> before = m.bytes;
    m.Step(static_cast<uint64_t>(density * 1e6), density);
    uint64_t changed_bytes = 0;
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const size_t w = DTypeSize(m.tensors[i].dtype);
      for (size_t e = 0; e * w < before[i].size(); ++e) {
        if (std::memcmp(before[i].data() + e * w, m.bytes[i].data() + e * w, w) != 0) {
          changed_bytes += w;
        }
      }
    }
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << density << ": " << s.status().ToString();
    if (density < 0.005) {
      EXPECT_EQ(s->committed_bytes, changed_bytes) << density;
    } else if (density < 0.01) {
      EXPECT_GT(s->committed_bytes, changed_bytes) << density;
      EXPECT_LT(s->committed_bytes, model_bytes / 2) << density;
    } else {
      EXPECT_EQ(s->committed_bytes, model_bytes) << density;
    }
    for (const SyncTensor& t : m.tensors) {
      Result<std::span<const uint8_t>> snap = sender->Snapshot(t.name);
      ASSERT_TRUE(snap.ok());
      EXPECT_TRUE(std::equal(snap->begin(), snap->end(), t.data.begin(), t.data.end()))
          << density << ": " << t.name;
    }
    EXPECT_TRUE(r.Matches(m).ok()) << density;
  }
  Finish(sender, {&r});
}

// The snapshot of every tensor, copied.
std::vector<std::vector<uint8_t>> Snapshots(const StreamSender& s, const Model& m) {
  std::vector<std::vector<uint8_t>> out;
  for (const SyncTensor& t : m.tensors) {
    Result<std::span<const uint8_t>> snap = s.Snapshot(t.name);
    out.emplace_back(snap.ok() ? std::vector<uint8_t>(snap->begin(), snap->end())
                               : std::vector<uint8_t>());
  }
  return out;
}

TEST_F(SyncTest, AReceiverThatFailsHalfwayFailsTheSyncAndTheNextRepairsIt) {
  SetUpGroup(2);
  Model m = Model::Make(2);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  ReceiverOptions failing;
  failing.apply_hook = [](uint64_t sync_id, std::string_view, uint64_t entry) {
    return sync_id == 3 && entry == 1 ? Status::IOError("injected: the device fell over")
                                      : Status::OK();
  };
  ReceiverRig good(m, Hold::kWhole, Factory(1));
  ReceiverRig bad(m, Hold::kRows, Factory(2), failing);
  good.Start();
  bad.Start();
  for (int step = 0; step < 2; ++step) {
    m.Step(7 + step, 0.05);
    ASSERT_TRUE(sender->Sync(m.tensors).ok());
  }
  const std::vector<std::vector<uint8_t>> before = Snapshots(*sender, m);
  m.Step(20, 0.05);
  Result<SyncStats> failed = sender->Sync(m.tensors);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIOError) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "sync 3: 1 of 2 receivers failed"))
      << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "receiver 2: ")) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "the device fell over")) << failed.status().ToString();
  EXPECT_EQ(Snapshots(*sender, m), before);  // nothing advanced
  EXPECT_EQ(sender->committed_sync_id(), 2u);

  // Some of it changes back, some goes on changing: the next sync brings
  // both receivers to it, reseeding the one that may hold unverified bytes.
  m.Step(21, 0.05);
  Result<SyncStats> next = sender->Sync(m.tensors);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 1u);
  EXPECT_TRUE(good.Matches(m).ok()) << good.Matches(m).ToString();
  EXPECT_TRUE(bad.Matches(m).ok()) << bad.Matches(m).ToString();
  m.Step(22, 0.05);
  next = sender->Sync(m.tensors);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 0u);
  EXPECT_TRUE(bad.Matches(m).ok());
  Finish(sender, {&good, &bad});
}

// A receiver-side fault aimed at the first delta frame with entries of sync
// `sync_id`: the body of a frame message, which starts with "DSFL".
FaultPlan OnFrame(uint64_t sync_id, FaultKind kind,
                  std::function<void(std::span<uint8_t>)> fn = {}) {
  FaultPlan p;
  p.op = CommOp::kRecv;
  p.kind = kind;
  p.match = [sync_id](std::span<const uint8_t> b) {
    if (b.size() < stream::kFlushHeaderBytes || std::memcmp(b.data(), "DSFL", 4) != 0) {
      return false;
    }
    uint64_t id = 0, entries = 0;
    std::memcpy(&id, b.data() + 8, 8);
    std::memcpy(&entries, b.data() + 20, 4);
    return id == sync_id && entries > 0;
  };
  p.rewrite = std::move(fn);
  p.byte_offset = 100;
  return p;
}

void Reseal(std::span<uint8_t> frame) { stream::ResealFlushFrame(frame); }

// Replaces the first occurrence of `from` in the frame's manifest (after
// the payload) by `to`, of the same length, and reseals it.
std::function<void(std::span<uint8_t>)> EditManifest(std::string from, std::string to) {
  return [from, to](std::span<uint8_t> f) {
    uint64_t payload = 0;
    std::memcpy(&payload, f.data() + 40, 8);
    const std::string_view text(reinterpret_cast<const char*>(f.data()), f.size());
    const size_t at = text.find(from, stream::kFlushHeaderBytes + payload);
    if (at != std::string_view::npos) std::memcpy(f.data() + at, to.data(), to.size());
    Reseal(f);
  };
}

struct BadFrame {
  std::string name;
  FaultPlan plan;
  std::string expect;  // in the receiver's error, as the sender reports it
};

class SyncBadFrames : public SyncTest, public ::testing::WithParamInterface<int> {};

std::vector<BadFrame> BadFrames() {
  std::vector<BadFrame> out;
  out.push_back(
      {"CorruptedManifestByte",
       OnFrame(3, FaultKind::kRewrite, [](std::span<uint8_t> f) { f[f.size() - 17] ^= 0x20; }),
       "xxh3-128 mismatch"});
  {
    FaultPlan p = OnFrame(3, FaultKind::kCorruptByte);
    p.byte_offset = 70;  // in the payload
    out.push_back({"CorruptedPayloadByte", p, "xxh3-128 mismatch"});
  }
  out.push_back({"UnknownTensor",
                 OnFrame(3, FaultKind::kRewrite, EditManifest("c.weight", "x.weight")),
                 "tensor 'x.weight' is not registered here"});
  {
    // The shape of c.weight, 5000, as 5001: it lies just before the name.
    FaultPlan p = OnFrame(3, FaultKind::kRewrite, [](std::span<uint8_t> f) {
      uint64_t payload = 0;
      std::memcpy(&payload, f.data() + 40, 8);
      const std::string_view text(reinterpret_cast<const char*>(f.data()), f.size());
      const size_t at = text.find("c.weight", stream::kFlushHeaderBytes + payload);
      if (at != std::string_view::npos) f[at - 8] = 0x89;  // 0x1388 -> 0x1389
      Reseal(f);
    });
    out.push_back({"WrongShape", p, "[5001] in the frame"});
  }
  {
    // The sync id, 3, as 2: an id it has seen.
    FaultPlan p = OnFrame(3, FaultKind::kRewrite, [](std::span<uint8_t> f) {
      f[8] = 2;
      Reseal(f);
    });
    out.push_back({"SyncIdOutOfOrder", p, "out of order"});
  }
  return out;
}

TEST_P(SyncBadFrames, IsRefusedNamingItAndChangesNoWeight) {
  const BadFrame bad = BadFrames()[GetParam()];
  SetUpGroup(2);
  Model m = Model::Make(3);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  ReceiverRig good(m, Hold::kWhole, Factory(1));
  ReceiverRig victim(m, Hold::kWhole, Factory(2, {bad.plan}));
  good.Start();
  victim.Start();
  for (int step = 0; step < 2; ++step) {
    m.Step(30 + step, 0.05);
    ASSERT_TRUE(sender->Sync(m.tensors).ok());
  }
  const std::vector<std::vector<uint8_t>> held = victim.buffers();
  m.Step(40, 0.05);
  Result<SyncStats> failed = sender->Sync(m.tensors);
  ASSERT_FALSE(failed.ok()) << bad.name;
  EXPECT_TRUE(Contains(failed.status(), "receiver 2: ")) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), bad.expect)) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "sync 3")) << failed.status().ToString();
  // The refused frame was the first with entries, so nothing was applied.
  EXPECT_EQ(victim.buffers(), held) << bad.name;
  EXPECT_TRUE(good.Matches(m).ok());

  Result<SyncStats> next = sender->Sync(m.tensors);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 0u);  // it holds only verified values: no reseed
  EXPECT_TRUE(victim.Matches(m).ok()) << victim.Matches(m).ToString();
  Finish(sender, {&good, &victim});
}

INSTANTIATE_TEST_SUITE_P(Cases, SyncBadFrames, ::testing::Range(0, 5),
                         [](const auto& info) { return BadFrames()[info.param].name; });

// Receivers that hold the same tensors take the same frames: the sender
// sends them once, to the first, and each passes them on to the next
// (docs/format.md, "Fan-out"); a receiver holding other tensors has a chain
// of its own. Every receiver is exact after every sync, and the sender's
// egress is about one copy per chain, not one per receiver.
TEST_F(SyncTest, ReceiversHoldingTheSameTensorsTakeOneCopyDownAChain) {
  SetUpGroup(4);
  Model m = Model::Make(8);
  SenderOptions o;
  o.bucket_bytes = 64 << 10;  // several frames per sync, each several chunks
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ReceiverRig first(m, Hold::kWhole, Factory(1));
  ReceiverRig rows(m, Hold::kRows, Factory(2));
  ReceiverRig second(m, Hold::kWhole, Factory(3));
  ReceiverRig third(m, Hold::kWhole, Factory(4));
  const std::initializer_list<ReceiverRig*> all = {&first, &rows, &second, &third};
  for (ReceiverRig* r : all) r->Start();
  for (int step = 0; step < 4; ++step) {
    if (step > 0) m.Step(80 + step, 0.05);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_GT(s->frames, 1u);
    for (ReceiverRig* r : all) {
      EXPECT_TRUE(r->Matches(m).ok()) << "step " << step << ": " << r->Matches(m).ToString();
    }
    // Each receiver records its sync's figures once its call returns,
    // after its report.
    for (ReceiverRig* r : all) {
      for (int i = 0; i < 500 && r->stats().size() < static_cast<size_t>(step + 1); ++i) {
        std::this_thread::sleep_for(10ms);
      }
      ASSERT_EQ(r->stats().size(), static_cast<size_t>(step + 1));
    }
    // Sent once per chain: what the first whole receiver and the rows
    // receiver took, and the other two their own records frames (sent one
    // per receiver, they are small).
    const uint64_t whole = first.stats().back().bytes;
    const uint64_t own = rows.stats().back().bytes;
    EXPECT_LT(s->bytes_sent, whole + own + whole / 4) << "step " << step;
    EXPECT_EQ(second.stats().back().bytes, whole);
    EXPECT_EQ(third.stats().back().bytes, whole);
  }
  Finish(sender, all);
}

// A frame found damaged after others of its sync were applied (the sync's
// third) fails the sync, naming it; the frames after it are taken, not
// applied; and the next sync repairs the receiver, which holds the first
// two frames' checked values, by sending the failed sync's units again (no
// seed).
TEST_F(SyncTest, ALaterFrameRefusedFailsTheSyncAndTheNextRepairsIt) {
  SetUpGroup(2);
  Model m =
      Model::Make(8, {{"a.weight", DType::kBF16, {512, 512}}, {"b.bias", DType::kF32, {512}}});
  SenderOptions o;
  o.bucket_bytes = 64 << 10;  // frames of at most 64 KiB, one chunk each
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  FaultPlan third;
  third.op = CommOp::kRecv;
  third.kind = FaultKind::kCorruptByte;
  third.match = [](std::span<const uint8_t> b) {
    if (b.size() < stream::kFlushHeaderBytes || std::memcmp(b.data(), "DSFL", 4) != 0) {
      return false;
    }
    uint64_t id = 0;
    uint32_t index = 0;
    std::memcpy(&id, b.data() + 8, 8);
    std::memcpy(&index, b.data() + 16, 4);
    return id == 3 && index == 2;
  };
  third.byte_offset = 100;  // in the payload
  ReceiverRig good(m, Hold::kWhole, Factory(1));
  ReceiverRig victim(m, Hold::kWhole, Factory(2, {third}));
  good.Start();
  victim.Start();
  for (int step = 0; step < 2; ++step) {
    if (step > 0) m.Step(90 + step, 0.3);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_GT(s->frames, 4u);  // the third frame has frames after it
  }
  m.Step(95, 0.3);
  Result<SyncStats> failed = sender->Sync(m.tensors);
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(Contains(failed.status(), "receiver 2: ")) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "flush frame 2 of the sync")) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "xxh3-128 mismatch")) << failed.status().ToString();
  EXPECT_TRUE(good.Matches(m).ok());
  EXPECT_FALSE(victim.Matches(m).ok());  // the frames after the third were not applied
  Result<SyncStats> next = sender->Sync(m.tensors);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 0u);
  EXPECT_TRUE(victim.Matches(m).ok()) << victim.Matches(m).ToString();
  EXPECT_TRUE(good.Matches(m).ok()) << good.Matches(m).ToString();
  Finish(sender, {&good, &victim});
}

// A unit goes dense when that takes less time (SenderOptions::
// dense_by_time). With a model of a fast wire (0.25 ns a byte, where a
// BF16 element dense costs 0.7 ns and a change by indices 11.25 ns), a
// step that changes 35% of the elements goes dense, where its `indices`
// bytes (1.75 a BF16 element against 2) would keep it by positions, and a
// step of 0.1% by positions; with the option off, both go by positions.
// The receivers are exact either way. The model is fixed rather than
// measured, so the decisions do not hang on the machine's load.
TEST_F(SyncTest, UnitsGoDenseWhenThatTakesLessTime) {
  stream::CostModel fast;
  fast.dense_byte = 0.1e-9;
  fast.indices_change = 10e-9;
  fast.sparse_change = 20e-9;
  fast.sparse_change_bytes = 1.5;
  fast.wire_byte = 0.25e-9;
  for (const bool by_time : {true, false}) {
    SCOPED_TRACE(by_time ? "dense_by_time" : "by bytes");
    SetUpGroup(1);
    Model m = Model::Make(5, {{"big.weight", DType::kBF16, {9 << 19}}});
    SenderOptions o;
    o.dense_by_time = by_time;
    std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
    auto* internal = dynamic_cast<stream_sender::Sender*>(sender.get());
    ASSERT_NE(internal, nullptr);
    internal->SetCostModel(fast);
    ReceiverRig one(m, Hold::kWhole, Factory(1));
    one.Start();
    Result<SyncStats> seed = sender->Sync(m.tensors);
    ASSERT_TRUE(seed.ok()) << seed.status().ToString();
    m.Step(51, 0.35);
    Result<SyncStats> dense = sender->Sync(m.tensors);
    ASSERT_TRUE(dense.ok()) << dense.status().ToString();
    if (by_time) {
      EXPECT_GT(dense->sent_elements, dense->changed);
    } else {
      EXPECT_EQ(dense->sent_elements, dense->changed);
    }
    EXPECT_TRUE(one.Matches(m).ok()) << one.Matches(m).ToString();
    m.Step(52, 0.001);
    Result<SyncStats> sparse = sender->Sync(m.tensors);
    ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
    EXPECT_EQ(sparse->sent_elements, sparse->changed);
    EXPECT_TRUE(one.Matches(m).ok()) << one.Matches(m).ToString();
    Finish(sender, {&one});
  }
}

TEST_F(SyncTest, ATruncatedFrameBreaksTheGroupWhichIsFormedAgainAndReseeded) {
  SetUpGroup(2);
  Model m = Model::Make(4);
  // The sender cuts the first frame of sync 2 to receiver 1 short.
  FaultPlan cut;
  cut.op = CommOp::kSend;
  cut.kind = FaultKind::kTruncate;
  cut.byte_offset = 200;
  cut.match = OnFrame(2, FaultKind::kTruncate).match;
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0, {cut}));
  ReceiverRig one(m, Hold::kWhole, Factory(1));
  ReceiverRig two(m, Hold::kColumns, Factory(2));
  one.Start();
  two.Start();
  ASSERT_TRUE(sender->Sync(m.tensors).ok());
  const std::vector<std::vector<uint8_t>> held = one.buffers();
  m.Step(50, 0.05);
  Result<SyncStats> failed = sender->Sync(m.tensors);
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(Contains(failed.status(), "the stream group broke")) << failed.status().ToString();
  EXPECT_EQ(one.buffers(), held);
  Result<SyncStats> next = sender->Sync(m.tensors);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 2u);
  EXPECT_TRUE(one.Matches(m).ok());
  EXPECT_TRUE(two.Matches(m).ok());
  Finish(sender, {&one, &two});
  bool saw_size = false;
  for (const Status& s : one.results()) saw_size |= Contains(s, "bytes");
  EXPECT_TRUE(saw_size);
}

// Receivers of one layout take the same frames: each is sent while the
// next fills. A send that fails in flight fails the sync, leaves the
// snapshot as it was, and the next sync repairs the group.
TEST_F(SyncTest, FramesSentWhileTheNextFillsKeepReceiversExactAndASendFailedInFlightIsRepaired) {
  SetUpGroup(2);
  std::vector<Model::Spec> specs = Model::DefaultSpecs();
  specs.emplace_back("e.weight", DType::kBF16, std::vector<int64_t>{512, 512});  // 512 KiB
  Model m = Model::Make(6, specs);
  FaultPlan fail;
  fail.op = CommOp::kSend;
  fail.kind = FaultKind::kFail;
  fail.error = Status::IOError("injected: the link went down");
  fail.match = OnFrame(4, FaultKind::kFail).match;
  SenderOptions o;
  o.bucket_bytes = 64 << 10;  // several frames per sync
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0, {fail}), o);
  ReceiverRig one(m, Hold::kWhole, Factory(1));
  ReceiverRig two(m, Hold::kWhole, Factory(2));
  one.Start();
  two.Start();
  for (int step = 0; step < 3; ++step) {
    if (step > 0) m.Step(60 + step, 0.2);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_GT(s->frames, 1u);
    EXPECT_GT(s->bytes_sent, 2 * s->frames * stream::kEnvelopeBytes);
    EXPECT_GT(s->transfer_s, 0);
    EXPECT_TRUE(one.Matches(m).ok()) << one.Matches(m).ToString();
    EXPECT_TRUE(two.Matches(m).ok()) << two.Matches(m).ToString();
  }
  const std::vector<std::vector<uint8_t>> before = Snapshots(*sender, m);
  m.Step(70, 0.2);
  Result<SyncStats> failed = sender->Sync(m.tensors);
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(Contains(failed.status(), "the link went down")) << failed.status().ToString();
  EXPECT_EQ(Snapshots(*sender, m), before);
  EXPECT_EQ(sender->committed_sync_id(), 3u);
  Result<SyncStats> next = sender->Sync(m.tensors);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_TRUE(one.Matches(m).ok()) << one.Matches(m).ToString();
  EXPECT_TRUE(two.Matches(m).ok()) << two.Matches(m).ToString();
  Finish(sender, {&one, &two});
}

TEST_F(SyncTest, ASyncsFirstFramesAreSmallAndAUnitTooBigForThemTakesAWholeBucket) {
  SetUpGroup(1);
  // 16 MiB buckets: a unit of 838,451 BF16 elements, 1.6 MiB dense, more
  // than the first frame's 1 MiB; a 10% delta of it 0.5 MB of indices.
  Model m = Model::Make(8, {{"e.weight", DType::kBF16, {3 << 20}}});
  SenderOptions o;
  o.threads = 3;  // the diff and the commit on three threads
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ReceiverRig one(m, Hold::kWhole, Factory(1));
  one.Start();
  // The seed: the first unit does not fit the first frame, which gives way
  // to a whole bucket, and the 6 MiB go in one.
  Result<SyncStats> seed = sender->Sync(m.tensors);
  ASSERT_TRUE(seed.ok()) << seed.status().ToString();
  EXPECT_TRUE(one.Matches(m).ok()) << one.Matches(m).ToString();
  // The delta's 1.9 MB go in a 1 MiB frame, then a 2 MiB one, where one
  // bucket would have taken them all.
  m.Step(81, 0.1);
  Result<SyncStats> delta = sender->Sync(m.tensors);
  ASSERT_TRUE(delta.ok()) << delta.status().ToString();
  EXPECT_EQ(delta->frames, seed->frames + 1);
  EXPECT_GT(delta->changed, uint64_t{300000});
  EXPECT_TRUE(one.Matches(m).ok()) << one.Matches(m).ToString();
  EXPECT_EQ(Snapshots(*sender, m), m.bytes);
  Finish(sender, {&one});
}

TEST_F(SyncTest, ReceiversApplyingAFramesEntriesOnSeveralThreadsStayBitExact) {
  SetUpGroup(2);
  std::vector<Model::Spec> specs = Model::DefaultSpecs();
  specs.emplace_back("e.weight", DType::kBF16, std::vector<int64_t>{512, 512});
  Model m = Model::Make(9, specs);
  SenderOptions o;
  o.bucket_bytes = 256 << 10;  // frames of many entries, some tensors split over them
  o.verify_every = 2;          // every other sync, the receivers rehash what they hold
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ReceiverOptions four;
  four.threads = 4;
  ReceiverOptions one;
  one.threads = 1;
  ReceiverRig whole(m, Hold::kWhole, Factory(1), four);
  ReceiverRig rows(m, Hold::kRows, Factory(2), one);
  whole.Start();
  rows.Start();
  for (int step = 0; step < 5; ++step) {
    if (step > 0) m.Step(90 + step, 0.1);
    Result<SyncStats> s = sender->Sync(m.tensors);
    if (!s.ok()) {
      // The receivers are stopped below either way: a failure never hangs.
      ADD_FAILURE() << "step " << step << ": " << s.status().ToString();
      break;
    }
    EXPECT_TRUE(whole.Matches(m).ok()) << whole.Matches(m).ToString();
    EXPECT_TRUE(rows.Matches(m).ok()) << rows.Matches(m).ToString();
  }
  Finish(sender, {&whole, &rows});
  ReceiverOptions crowded;
  crowded.threads = 2000;
  EXPECT_TRUE(Contains(StreamReceiver::Create(sync_test::NoGroup(), crowded).status(),
                       "threads 2000: at most 1024"));
}

// A mixture of experts' layout: 2,000 small tensors and a large one, so
// that a delta frame's entries span hundreds of tensors, applied in tasks
// of many entries on the receivers' threads. Every receiver is bit-exact
// after every sync (the running digests checked by the sender's records
// each time, and rehashed every other sync); an entry in the middle of a
// sync that fails is reported with its own tensor's name.
TEST_F(SyncTest, ManySmallTensorsApplyInTasksBitExactAndAFailingEntryIsNamed) {
  SetUpGroup(3);
  std::vector<Model::Spec> specs;
  for (int i = 0; i < 2000; ++i) {
    specs.emplace_back(
        "model.layers." + std::to_string(i / 64) + ".experts." + std::to_string(i % 64) + ".w",
        DType::kBF16, std::vector<int64_t>{12, 25});
  }
  specs.emplace_back("model.embed.weight", DType::kBF16, std::vector<int64_t>{256, 512});
  Model m = Model::Make(11, specs);
  SenderOptions o;
  o.bucket_bytes = 256 << 10;  // a sync's entries over a few frames
  o.verify_every = 2;
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0), o);
  ReceiverOptions two;
  two.threads = 2;
  ReceiverOptions four;
  four.threads = 4;
  // The third receiver fails at the 1001st entry of sync 3, noting its
  // tensor.
  auto failed_at = std::make_shared<std::pair<std::mutex, std::string>>();
  ReceiverOptions failing;
  failing.threads = 4;
  failing.apply_hook = [failed_at](uint64_t sync_id, std::string_view tensor, uint64_t entry) {
    if (sync_id != 3 || entry != 1000) return Status::OK();
    std::lock_guard<std::mutex> lock(failed_at->first);
    failed_at->second = std::string(tensor);
    return Status::IOError("injected: entry 1000 fell over");
  };
  ReceiverRig a(m, Hold::kWhole, Factory(1), two);
  ReceiverRig b(m, Hold::kWhole, Factory(2), four);
  ReceiverRig c(m, Hold::kWhole, Factory(3), failing);
  for (ReceiverRig* r : {&a, &b, &c}) r->Start();
  for (int step = 0; step < 5; ++step) {
    if (step > 0) m.Step(200 + step, 0.05);
    Result<SyncStats> s = sender->Sync(m.tensors);
    if (step == 2) {
      // Sync 3.
      ASSERT_FALSE(s.ok());
      std::string tensor;
      {
        std::lock_guard<std::mutex> lock(failed_at->first);
        tensor = failed_at->second;
      }
      ASSERT_FALSE(tensor.empty());
      EXPECT_TRUE(Contains(s.status(), "receiver 3: ")) << s.status().ToString();
      EXPECT_TRUE(
          Contains(s.status(), "applying tensor '" + tensor + "': injected: entry 1000 fell over"))
          << s.status().ToString();
      EXPECT_TRUE(a.Matches(m).ok() && b.Matches(m).ok());
      continue;
    }
    if (!s.ok()) {
      // The receivers are stopped below either way: a failure never hangs.
      ADD_FAILURE() << "step " << step << ": " << s.status().ToString();
      break;
    }
    EXPECT_GT(s->frames, 1u);
    EXPECT_EQ(s->seeded, step == 0 ? 3u : step == 3 ? 1u : 0u);
    for (ReceiverRig* r : {&a, &b, &c}) {
      Status same = r->Matches(m);
      EXPECT_TRUE(same.ok()) << "step " << step << ": " << same.ToString();
    }
  }
  Finish(sender, {&a, &b, &c});
}

TEST_F(SyncTest, AReceiverWhoseTensorsDifferIsRefusedNamingTheTensor) {
  SetUpGroup(1);
  Model m = Model::Make(5);
  Model other = m;
  other.tensors[1].dtype = DType::kI32;  // same size, another dtype
  other.Rebind();
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  ReceiverRig r(other, Hold::kWhole, Factory(1));
  r.Start(/*once=*/true);
  Result<SyncStats> s = sender->Sync(m.tensors);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.status(),
                       "receiver 1: registered tensors differ: tensor 'b.bias' is F32 "
                       "[300] at the sender, I32 [300] at the receiver"))
      << s.status().ToString();
  Finish(sender, {&r});
  ASSERT_FALSE(r.results().empty());
  EXPECT_TRUE(Contains(r.results()[0], "the sender refused this receiver"))
      << r.results()[0].ToString();
  for (const std::vector<uint8_t>& b : r.buffers()) {
    EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](uint8_t x) { return x == 0; }));
  }
}

TEST(SyncArguments, BadTensorsAreRefusedBeforeAnythingIsSent) {
  int connects = 0;
  Result<std::unique_ptr<StreamSender>> s = StreamSender::Create(sync_test::NoGroup(&connects));
  ASSERT_TRUE(s.ok());
  std::vector<uint8_t> bytes(8);
  std::vector<SyncTensor> t = {{"w", DType::kBF16, {3}, bytes, {}}};
  EXPECT_TRUE(Contains((*s)->Sync(t).status(), "8 bytes, shape [3] of BF16 needs 6"));
  t = {{"w", DType::kBF16, {4}, bytes, {}}, {"w", DType::kBF16, {4}, bytes, {}}};
  EXPECT_TRUE(Contains((*s)->Sync(t).status(), "passed twice"));
  EXPECT_EQ(connects, 0);
  t = {{"w", DType::kBF16, {4}, bytes, {}}};
  Result<SyncStats> first = (*s)->Sync(t);
  EXPECT_EQ(first.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(connects, 1);
  t = {{"w", DType::kF32, {2}, bytes, {}}};
  EXPECT_TRUE(Contains((*s)->Sync(t).status(), "the first sync had BF16 [4]"));
  t = {{"v", DType::kBF16, {4}, bytes, {}}};
  EXPECT_TRUE(Contains((*s)->Sync(t).status(), "was not in the first sync"));
  EXPECT_EQ(connects, 1);
  SenderOptions small;
  small.bucket_bytes = 1000;
  EXPECT_EQ(StreamSender::Create(sync_test::NoGroup(), small).status().code(),
            StatusCode::kInvalidArgument);
  SenderOptions crowded;
  crowded.threads = 1025;
  Result<std::unique_ptr<StreamSender>> refused =
      StreamSender::CreateSharded(sync_test::NoGroup(), sync_test::NoGroup(), crowded);
  EXPECT_TRUE(Contains(refused.status(), "threads 1025: at most 1024"))
      << refused.status().ToString();
  EXPECT_EQ(ParseStreamEncoding("xor").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseStreamEncoding("sparse"), StreamEncoding::kSparse);
}

TEST(SyncArguments, ARegistrationThatCannotBeHeldIsRefused) {
  Result<std::unique_ptr<StreamReceiver>> r = StreamReceiver::Create(sync_test::NoGroup());
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> small(10);
  EXPECT_TRUE(Contains((*r)->Register("w", DType::kBF16, {8}, small), "holds 5 elements"));
  std::vector<uint8_t> big(64);
  // Three ranges at unequal gaps are not one block.
  EXPECT_TRUE(Contains(
      (*r)->Register("w", DType::kBF16, {32}, big, {{0, 4, 0, 1}, {10, 4, 4, 1}, {24, 4, 8, 1}}),
      "not one block"));
  ASSERT_TRUE((*r)->Register("w", DType::kBF16, {32}, big).ok());
  EXPECT_TRUE(Contains((*r)->Register("w", DType::kBF16, {32}, big), "registered twice"));
  EXPECT_EQ((*r)->ReceiveSync().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ((*r)->Register("v", DType::kBF16, {32}, big).code(), StatusCode::kFailedPrecondition);
}

// A device placement this build or machine cannot serve is refused naming
// the tensor, before anything is sent and with nothing registered (the
// GPU cases are in tests/gpu/stream_cuda_test.cc).
TEST(SyncArguments, ADevicePlacementThatCannotBeServedIsRefusedNamingTheTensor) {
  int connects = 0;
  Result<std::unique_ptr<StreamSender>> s = StreamSender::Create(sync_test::NoGroup(&connects));
  ASSERT_TRUE(s.ok());
  std::vector<uint8_t> bytes(8);
  std::vector<SyncTensor> t = {{"w", DType::kBF16, {4}, bytes, Placement::Cuda(0)}};
  const Status sent = (*s)->Sync(t).status();
  EXPECT_TRUE(Contains(sent, "tensor 'w'")) << sent.ToString();
  // Without CUDA: Unsupported; without a GPU: FailedPrecondition; with one,
  // host memory passed as device memory: InvalidArgument.
  if (!stream::DevicePathBuilt()) {
    EXPECT_EQ(sent.code(), StatusCode::kUnsupported) << sent.ToString();
    EXPECT_TRUE(Contains(sent, "no CUDA")) << sent.ToString();
  } else {
    EXPECT_TRUE(sent.code() == StatusCode::kFailedPrecondition ||
                sent.code() == StatusCode::kInvalidArgument)
        << sent.ToString();
  }
  EXPECT_EQ(connects, 0);
  // The refused first sync left nothing behind: the tensor may come again
  // from host memory.
  t[0].place = {};
  EXPECT_EQ((*s)->Sync(t).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(connects, 1);

  Result<std::unique_ptr<StreamReceiver>> r = StreamReceiver::Create(sync_test::NoGroup());
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> dest(8);
  const Status registered = (*r)->Register("w", DType::kBF16, {4}, dest, {}, Placement::Cuda(0));
  EXPECT_FALSE(registered.ok());
  EXPECT_TRUE(Contains(registered, "registering tensor 'w'")) << registered.ToString();
  if (!stream::DevicePathBuilt()) {
    EXPECT_EQ(registered.code(), StatusCode::kUnsupported);
  }
  // Nothing was registered: the same name goes in from host memory.
  EXPECT_TRUE((*r)->Register("w", DType::kBF16, {4}, dest).ok());
}

TEST_F(SyncTest, AReceiverKilledMidSyncFailsItInTimeAndIsReseededOnceRestarted) {
  SetUpGroup(2);
  Model m = Model::Make(0);
  const std::string file = Dir() + "/receiver2.bin";
  const auto peer_args = [&](int die_at) {
    return std::vector<std::string>{DS_SYNC_PEER_PATH,
                                    "receive",
                                    "file:" + Dir(),
                                    "2",
                                    "3",
                                    file,
                                    std::to_string(die_at),
                                    std::to_string(kTimeout.count())};
  };
  comm_test::Children peers;
  ASSERT_EQ(peers.Spawn(peer_args(3)), 0);
  std::unique_ptr<StreamSender> sender = MakeSender(Factory(0));
  ReceiverRig local(m, Hold::kRows, Factory(1));
  local.Start();
  for (int step = 0; step < 2; ++step) {
    m.Step(60 + step, 0.05);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_TRUE(sync_test::PeerHolds(file, m, 5000ms));
  }
  const std::vector<std::vector<uint8_t>> before = Snapshots(*sender, m);
  m.Step(70, 0.05);
  const auto start = std::chrono::steady_clock::now();
  Result<SyncStats> failed = sender->Sync(m.tensors);  // the peer dies applying it
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(failed.status().code() == StatusCode::kUnavailable ||
              failed.status().code() == StatusCode::kDeadlineExceeded)
      << failed.status().ToString();
  // Receiver 2 takes the frames from receiver 1: the sender names the chain.
  EXPECT_TRUE(Contains(failed.status(), "receiver 2: ") ||
              Contains(failed.status(), "passed this sync's frames on: 1 -> 2"))
      << failed.status().ToString();
  EXPECT_LT(took, kTimeout + 1000ms);
  EXPECT_EQ(peers.Wait(0, 5000ms), 128 + SIGKILL);
  EXPECT_EQ(Snapshots(*sender, m), before);
  EXPECT_EQ(sender->committed_sync_id(), 2u);

  // Restarted, it joins the group the sender forms again, and is seeded.
  ASSERT_TRUE(peers.Respawn(0, peer_args(0)));
  for (int step = 0; step < 3; ++step) {
    m.Step(80 + step, 0.05);
    Result<SyncStats> s = sender->Sync(m.tensors);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 2u : 0u);
    EXPECT_TRUE(local.Matches(m).ok()) << local.Matches(m).ToString();
    EXPECT_TRUE(sync_test::PeerHolds(file, m, 5000ms)) << "step " << step;
  }
  Finish(sender, {&local});
}

// A tensor cut into segments across batches whose tail fits the room its
// first batch has left: each batch names a tensor once (the tail goes with
// the rest that fits), and the receivers stay bit-exact. With 64 KiB
// buckets a unit is 2867 BF16 elements and a batch 131072: 130000 elements
// take 45 units and leave a tail of 985 beside 2057 of room.
TEST_F(SyncTest, ATensorWhoseTailFitsTheRoomItsBatchLeftSyncsBitExact) {
  SetUpGroup(1);
  const std::vector<Model::Spec> specs = {{"big", DType::kBF16, {325, 400}},
                                          {"next", DType::kBF16, {300, 1000}}};
  Model m = Model::Make(12, specs);
  std::vector<ModelTensor> model;
  for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
  constexpr int kRanks = 2;
  std::vector<std::unique_ptr<StreamSender>> ranks =
      ShardedRanks(kRanks, [](int, SenderOptions*) {});
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kRanks));
  ReceiverRig whole(m, Hold::kWhole, Factory(1));
  whole.Start();
  for (int step = 0; step < 3; ++step) {
    if (step > 0) m.Step(700 + step, 0.05);
    const std::vector<Status> results = SyncRowShards(ranks, model, m);
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(results[r].ok())
          << "step " << step << " rank " << r << ": " << results[r].ToString();
    }
    EXPECT_TRUE(whole.Matches(m).ok()) << "step " << step << ": " << whole.Matches(m).ToString();
  }
  whole.RequestStop();
  ranks.clear();
  whole.Stop();
}

TEST_F(SyncTest, FourShardedTrainerRanksKeepThreeReceiversBitExactOverTwentySyncs) {
  SetUpGroup(3);
  Model m = ShardedModel(9);
  std::vector<ModelTensor> model;
  for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
  constexpr int kRanks = 4;
  std::vector<std::unique_ptr<StreamSender>> ranks =
      ShardedRanks(kRanks, [](int r, SenderOptions* so) {
        so->verify_every = 5;
        so->encoding = static_cast<StreamEncoding>(r % 3);  // only rank 0's counts
      });
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kRanks));
  ReceiverOptions failing;
  failing.apply_hook = [](uint64_t sync_id, std::string_view, uint64_t) {
    return sync_id == 7 ? Status::IOError("injected at sync 7") : Status::OK();
  };
  ReceiverRig whole(m, Hold::kWhole, Factory(1));
  ReceiverRig rows(m, Hold::kRows, Factory(2));
  ReceiverRig cols(m, Hold::kColumns, Factory(3), failing);
  for (ReceiverRig* r : {&whole, &rows, &cols}) r->Start();

  for (int step = 0; step < 20; ++step) {
    if (step > 0) m.Step(500 + step, step % 4 == 0 ? 0.5 : 0.03);
    std::vector<std::vector<std::vector<uint8_t>>> bytes(kRanks);
    std::vector<Status> results(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        std::vector<ShardedTensor> shards;
        for (const ShardSpec& spec : RankSpecs(r)) bytes[r].push_back(Extract(spec, m));
        const std::vector<ShardSpec> specs = RankSpecs(r);
        for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[r][i], {}});
        Result<SyncStats> got = ranks[r]->SyncShards(model, shards);
        results[r] = got.ok() ? Status::OK() : got.status();
      });
    }
    for (std::thread& t : threads) t.join();
    const uint64_t sync_id = step + 1;
    if (sync_id == 7) {
      EXPECT_TRUE(Contains(results[0], "receiver 3: ")) << results[0].ToString();
      EXPECT_TRUE(Contains(results[0], "injected at sync 7")) << results[0].ToString();
      for (int r = 1; r < kRanks; ++r) {
        EXPECT_EQ(results[r].code(), StatusCode::kAborted) << results[r].ToString();
      }
      continue;
    }
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok())
          << "sync " << sync_id << " rank " << r << ": " << results[r].ToString();
    }
    for (ReceiverRig* rig : {&whole, &rows, &cols}) {
      Status same = rig->Matches(m);
      EXPECT_TRUE(same.ok()) << "sync " << sync_id << ": " << same.ToString();
    }
    // Each rank's snapshot holds its own shards as committed, and no rank
    // holds a whole tensor.
    for (int r = 0; r < kRanks; ++r) {
      const std::vector<ShardSpec> specs = RankSpecs(r);
      for (size_t i = 0; i < specs.size(); ++i) {
        Result<std::span<const uint8_t>> snap = ranks[r]->ShardSnapshot(i);
        bool contributes = false;
        for (const ShardPiece& p : specs[i].pieces) {
          contributes = contributes || (specs[i].contributes && p.contributes);
        }
        if (!contributes) {
          EXPECT_EQ(snap.status().code(), StatusCode::kNotFound) << "rank " << r << " shard " << i;
          continue;
        }
        ASSERT_TRUE(snap.ok()) << snap.status().ToString();
        const std::vector<uint8_t> want = Extract(specs[i], m);
        EXPECT_TRUE(std::equal(snap->begin(), snap->end(), want.begin(), want.end()))
            << "sync " << sync_id << ": rank " << r << "'s snapshot of shard " << i;
      }
    }
    EXPECT_EQ(ranks[0]->Snapshot("a.weight").status().code(), StatusCode::kFailedPrecondition);
  }
  for (ReceiverRig* r : {&whole, &rows, &cols}) r->RequestStop();
  ranks.clear();
  for (ReceiverRig* r : {&whole, &rows, &cols}) r->Stop();
  // The failed receiver was reseeded once; the others never after the first.
  const std::vector<ReceiveStats> cs = cols.stats();
  EXPECT_EQ(std::count_if(cs.begin(), cs.end(), [](const ReceiveStats& s) { return s.seed; }), 2);
  const std::vector<ReceiveStats> ws = whole.stats();
  EXPECT_EQ(std::count_if(ws.begin(), ws.end(), [](const ReceiveStats& s) { return s.seed; }), 1);
}

TEST_F(SyncTest, AShardedRankWithBadInputFailsTheSyncOnEveryRankAndTheNextSucceeds) {
  SetUpGroup(1);
  Model m = ShardedModel(10);
  std::vector<ModelTensor> model;
  for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
  std::vector<std::unique_ptr<StreamSender>> ranks;
  for (int r = 0; r < 4; ++r) {
    const CommunicatorOptions o =
        comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), r, 4, kTimeout, "trainers");
    Result<std::unique_ptr<StreamSender>> s = StreamSender::CreateSharded(
        [o] { return CreateCommunicator("gloo", o); }, r == 0 ? Factory(0) : nullptr);
    ASSERT_TRUE(s.ok());
    ranks.push_back(std::move(*s));
  }
  ReceiverRig rig(m, Hold::kWhole, Factory(1));
  rig.Start();
  for (int step = 0; step < 3; ++step) {
    m.Step(700 + step, 0.05);
    std::vector<Status> results(4);
    std::vector<std::thread> threads;
    std::vector<std::vector<std::vector<uint8_t>>> bytes(4);
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        const std::vector<ShardSpec> specs = RankSpecs(r);
        std::vector<ShardedTensor> shards;
        for (const ShardSpec& spec : specs) bytes[r].push_back(Extract(spec, m));
        // At step 1, rank 3 passes a shard of the wrong size.
        if (step == 1 && r == 3) bytes[r][0].pop_back();
        for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[r][i], {}});
        Result<SyncStats> got = ranks[r]->SyncShards(model, shards);
        results[r] = got.ok() ? Status::OK() : got.status();
      });
    }
    for (std::thread& t : threads) t.join();
    if (step == 1) {
      EXPECT_TRUE(Contains(results[3], "bytes, its spec needs")) << results[3].ToString();
      EXPECT_TRUE(Contains(results[0], "rank 3")) << results[0].ToString();
      EXPECT_FALSE(results[1].ok());
      continue;
    }
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(results[r].ok()) << r << ": " << results[r].ToString();
    EXPECT_TRUE(rig.Matches(m).ok()) << rig.Matches(m).ToString();
  }
  rig.RequestStop();
  ranks.clear();
  rig.Stop();
}

}  // namespace
}  // namespace deltasync
