// The stream's end-to-end test rig, shared by the sync tests: receivers on
// threads over gloo on loopback in this process, the fixture that forms
// their group, and a sharded model's placements.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator_test_util.h"
#include "comm/fault_communicator.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
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
  StreamReceiver::Health health() const { return receiver_->health(); }

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
  // The sharded senders of `n` trainer ranks (group "trainers", 64 KiB
  // buckets; `tune` adjusts each rank's options), rank 0 leading the stream
  // group; fewer than `n` where one cannot be made (the failure is
  // recorded).
  std::vector<std::unique_ptr<StreamSender>> ShardedRanks(
      int n, const std::function<void(int, SenderOptions*)>& tune) {
    std::vector<std::unique_ptr<StreamSender>> ranks;
    for (int r = 0; r < n; ++r) {
      const CommunicatorOptions o =
          comm_test::LoopbackOptions(comm_test::FileRendezvous(Dir()), r, n, kTimeout, "trainers");
      SenderOptions so;
      so.bucket_bytes = 64 << 10;
      tune(r, &so);
      Result<std::unique_ptr<StreamSender>> s = StreamSender::CreateSharded(
          [o] { return CreateCommunicator("gloo", o); }, r == 0 ? Factory(0) : nullptr, so);
      EXPECT_TRUE(s.ok()) << s.status().ToString();
      if (!s.ok()) break;
      ranks.push_back(std::move(*s));
    }
    return ranks;
  }
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

using sync_test::Extract;
using sync_test::RankSpecs;
using sync_test::ShardedModel;
using sync_test::Spec;

}  // namespace deltasync::sync_rig
