// The stream's end-to-end test rig, shared by the sync tests: receivers on
// threads over gloo on loopback in this process, the fixture that forms
// their group, and a sharded model's placements.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "stream/communicator_test_util.h"
#include "stream/fault_communicator.h"
#include "stream/sync_test_util.h"

namespace deltasync::sync_rig {

using sync_test::Model;

using namespace std::chrono_literals;
using stream_internal::CommOp;
using stream_internal::FaultCommunicator;
using stream_internal::FaultKind;
using stream_internal::FaultPlan;

inline constexpr auto kTimeout = 5000ms;

inline bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// What a receiver holds of a tensor.
enum class Hold { kWhole, kRows, kColumns };

// One receiver: its buffers, a thread that takes syncs until stopped, and
// what each sync returned.
class ReceiverRig {
 public:
  ReceiverRig(const Model& m, Hold hold, CommunicatorFactory connect,
              ReceiverOptions options = {}) {
    Result<std::unique_ptr<StreamReceiver>> r =
        StreamReceiver::Create(std::move(connect), std::move(options));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    receiver_ = std::move(*r);
    for (const SyncTensor& t : m.tensors) {
      const size_t w = DTypeSize(t.dtype);
      const uint64_t numel = t.data.size() / w;
      std::vector<DestinationRun> runs;
      uint64_t elements = numel;
      if (t.name == "a.weight" && hold != Hold::kWhole) {
        const uint64_t rows = t.shape[0], cols = t.shape[1];
        if (hold == Hold::kRows) {  // rows 16..47, back to back
          runs.push_back({16 * cols, 32 * cols, 0, 1});
          elements = 32 * cols;
        } else {  // columns 8..23 of every row, into a buffer with a gap
          for (uint64_t r = 0; r < rows; ++r) runs.push_back({r * cols + 8, 16, r * 20, 1});
          elements = rows * 20;
        }
      }
      buffers_.emplace_back(elements * w, 0);
      runs_.push_back(runs);
      Status s = receiver_->Register(t.name, t.dtype, t.shape, buffers_.back(), runs);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  ~ReceiverRig() { Stop(); }

  // Takes syncs until stopped (`once`: only one).
  void Start(bool once = false) {
    thread_ = std::thread([this, once] {
      while (!stop_) {
        Result<ReceiveStats> r = receiver_->ReceiveSync();
        std::lock_guard<std::mutex> lock(mu_);
        results_.push_back(r.ok() ? Status::OK() : r.status());
        if (r.ok()) stats_.push_back(*r);
        if (once) break;
      }
    });
  }
  // Stops once the sender is gone (its calls then fail): ask every
  // receiver to stop, then end the sender, then Stop.
  void RequestStop() { stop_ = true; }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::vector<Status> results() {
    std::lock_guard<std::mutex> lock(mu_);
    return results_;
  }
  std::vector<ReceiveStats> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // Every element this receiver holds equals the model's; the first
  // difference otherwise.
  Status Matches(const Model& m) const {
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const SyncTensor& t = m.tensors[i];
      DS_RETURN_IF_ERROR(
          sync_test::HeldMatches(t.name, DTypeSize(t.dtype), m.bytes[i], buffers_[i], runs_[i]));
    }
    return Status::OK();
  }
  const std::vector<std::vector<uint8_t>>& buffers() const { return buffers_; }
  // Ends a call in flight (a wait to rejoin a group that will not form
  // again) and closes the receiver.
  void Cancel() { receiver_->Cancel("the test ends"); }

 private:
  std::unique_ptr<StreamReceiver> receiver_;
  std::vector<std::vector<uint8_t>> buffers_;
  std::vector<std::vector<DestinationRun>> runs_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<Status> results_;
  std::vector<ReceiveStats> stats_;
};

// A stream group of one sender and `n` receivers in this process.
class SyncTest : public ::testing::Test {
 protected:
  CommunicatorFactory Factory(int rank, std::vector<FaultPlan> plans = {}) {
    CommunicatorOptions o =
        comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), rank, size_, kTimeout, "sync");
    if (connect_timeout_) o.connect_timeout = *connect_timeout_;
    auto shared = std::make_shared<std::vector<FaultPlan>>(std::move(plans));
    return [o, shared]() -> Result<std::unique_ptr<Communicator>> {
      DS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, CreateCommunicator("gloo", o));
      if (shared->empty()) return c;
      // The faults go with the first formation only.
      std::vector<FaultPlan> plans = std::move(*shared);
      shared->clear();
      return std::unique_ptr<Communicator>(new FaultCommunicator(std::move(c), std::move(plans)));
    };
  }
  void SetUpGroup(int receivers) { size_ = receivers + 1; }
  // The rendezvous directory of this test's groups (a fresh one after
  // NewDir).
  std::string Dir() const { return dir_.path() + sub_; }
  void NewDir() { sub_ = "/run" + std::to_string(++runs_); }

  comm_test::TempDir dir_;
  std::string sub_;
  int runs_ = 0;
  std::optional<std::chrono::milliseconds> connect_timeout_;
  int size_ = 1;
};

// Ends a group quickly: receivers told to stop, the sender gone (their calls
// fail at once), then their threads joined.
inline void Finish(std::unique_ptr<StreamSender>& sender,
                   std::initializer_list<ReceiverRig*> rigs) {
  for (ReceiverRig* r : rigs) r->RequestStop();
  sender.reset();
  for (ReceiverRig* r : rigs) r->Stop();
}

inline std::unique_ptr<StreamSender> MakeSender(CommunicatorFactory f, SenderOptions o = {}) {
  Result<std::unique_ptr<StreamSender>> s = StreamSender::Create(std::move(f), o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

// ---------------------------------------------------------------------------
// A sharded trainer: 4 ranks, each holding its own pieces of the model.

// The model's tensors as a Model, for the receivers and the checks.
inline Model ShardedModel(uint64_t seed) {
  Model m = Model::Make(seed);
  std::mt19937_64 rng(seed + 1);
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"e.weight", {24, 37}}, {"q.weight", {16, 48}}, {"k.weight", {8, 48}}}) {
    std::vector<uint8_t> b(shape[0] * shape[1] * 2);
    for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
    m.bytes.push_back(std::move(b));
    m.tensors.push_back({name, DType::kBF16, shape, {}, {}});
  }
  m.Rebind();
  return m;
}

// Rank r's local tensors: a.weight Shard(0), c.weight uneven, e.weight
// Shard(1) (37 columns: 10, 10, 10, 7), b.bias replicated (rank 2 sends),
// q and k fused along dim 0 and split in 2 for tensor parallelism (ranks 2
// and 3 replicate ranks 0 and 1 and do not send), d.empty whole on rank 0.
// The spec, or a failed test naming why (an empty spec then).
inline ShardSpec Spec(Result<ShardSpec> r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : ShardSpec{};
}

inline std::vector<ShardSpec> RankSpecs(int r) {
  std::vector<ShardSpec> out;
  out.push_back(Spec(ShardSpec::Shard("a.weight", DType::kBF16, {64, 48}, 0, r, 4)));
  out.push_back(
      Spec(ShardSpec::ShardSizes("c.weight", DType::kBF16, {5000}, 0, {2000, 1500, 1500, 0}, r)));
  out.push_back(Spec(ShardSpec::Shard("e.weight", DType::kBF16, {24, 37}, 1, r, 4)));
  out.push_back(Spec(ShardSpec::Replicate("b.bias", DType::kF32, {300}, r == 2)));
  ShardSpec fused = Spec(
      ShardSpec::Fused(DType::kBF16, 0,
                       {Spec(ShardSpec::Shard("q.weight", DType::kBF16, {16, 48}, 0, r % 2, 2)),
                        Spec(ShardSpec::Shard("k.weight", DType::kBF16, {8, 48}, 0, r % 2, 2))}));
  fused.contributes = r < 2;
  out.push_back(fused);
  if (r == 0) out.push_back(Spec(ShardSpec::Whole("d.empty", DType::kBF16, {0, 4})));
  return out;
}

// A local tensor's bytes, read out of the whole tensors element by element.
inline std::vector<uint8_t> Extract(const ShardSpec& spec, const Model& m) {
  const size_t w = DTypeSize(spec.dtype);
  std::vector<uint8_t> out(spec.local_numel() * w);
  const size_t nd = spec.local_shape.size();
  for (const ShardPiece& p : spec.pieces) {
    const std::vector<uint8_t>& hf = m.Of(p.hf_name);
    std::vector<int64_t> c(nd, 0);
    for (int64_t e = 0; e < p.elements(); ++e) {
      int64_t rem = e, local = 0, global = 0;
      for (size_t d = nd; d-- > 0;) {
        c[d] = rem % p.extent[d];
        rem /= p.extent[d];
      }
      for (size_t d = 0; d < nd; ++d) {
        local = local * spec.local_shape[d] + p.local_offset[d] + c[d];
        global = global * p.hf_shape[d] + p.hf_offset[d] + c[d];
      }
      std::memcpy(out.data() + local * w, hf.data() + global * w, w);
    }
  }
  return out;
}

}  // namespace deltasync::sync_rig
