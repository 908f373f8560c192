// The nccl communicator and the stream over it with two real ranks on one
// GPU: this process is rank 0, stream_nccl_peer rank 1 (nccl_pair.h says
// how NCCL is made to accept that). Host memory against device memory on
// the other rank, calls of more than one NCCL chunk; a stream sender of
// device and host tensors and a receiver process holding them in device
// and host memory, bit-exact after every sync; a receiver killed mid-sync
// fails the sync within the timeout, and is reseeded once restarted. Skips
// without a GPU.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tests/gpu/nccl_pair.h"

namespace deltasync {
namespace {

using namespace std::chrono_literals;
namespace ct = deltasync::comm_test;
using nccl_pair::DeviceBytes;
using sync_test::Model;

constexpr auto kTimeout = 10000ms;

class StreamNcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_pair::HaveGpu()) GTEST_SKIP() << "no CUDA device";
    nccl_pair::BecomeRank(0);
  }

  std::vector<std::string> PeerArgs(std::vector<std::string> args) const {
    args.insert(args.begin(), DS_NCCL_PEER_PATH);
    return args;
  }

  ct::TempDir dir_;
};

TEST_F(StreamNcclTest, HostAndDeviceBuffersMeetAcrossRanksInChunks) {
  ct::Children peer;
  ASSERT_EQ(peer.Spawn(PeerArgs({"collectives", dir_.path(), std::to_string(kTimeout.count())})),
            0);
  Result<std::unique_ptr<Communicator>> c =
      CreateCommunicator("nccl", nccl_pair::PairOptions(dir_.path(), 0, kTimeout));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Communicator& comm = **c;
  EXPECT_TRUE(comm.capabilities().host_buffers);
  EXPECT_TRUE(comm.capabilities().device_buffers);

  // Host memory here, device memory there, and back.
  std::vector<uint8_t> host = ct::PatternBytes(1, nccl_pair::kBigBytes);
  Status s = comm.Send(1, host);
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint8_t> got(nccl_pair::kBigBytes);
  s = comm.Recv(1, got);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(ct::ExpectPattern(got, 2, "recv").ok());

  std::vector<uint8_t> bcast = ct::PatternBytes(3, nccl_pair::kBroadcastBytes);
  s = comm.Broadcast(0, bcast);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(bcast, ct::PatternBytes(3, nccl_pair::kBroadcastBytes));  // root's is not written
  DeviceBytes into(nccl_pair::kBroadcastBytes);
  s = comm.Broadcast(1, into.span());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(ct::ExpectPattern(into.Download(), 4, "broadcast").ok());

  const std::vector<uint8_t> record = ct::PatternBytes(10, nccl_pair::kRecordBytes);
  std::vector<uint8_t> all(2 * nccl_pair::kRecordBytes);
  s = comm.AllGather(record, all);
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<uint8_t> want = record;
  const std::vector<uint8_t> theirs = ct::PatternBytes(11, nccl_pair::kRecordBytes);
  want.insert(want.end(), theirs.begin(), theirs.end());
  EXPECT_EQ(all, want);

  DeviceBytes mine(nccl_pair::kRecordBytes);
  ASSERT_TRUE(mine.Upload(ct::PatternBytes(20, nccl_pair::kRecordBytes)));
  std::vector<uint8_t> gathered(2 * nccl_pair::kRecordBytes);
  s = comm.Gather(0, mine.span(), gathered);
  ASSERT_TRUE(s.ok()) << s.ToString();
  want = ct::PatternBytes(20, nccl_pair::kRecordBytes);
  const std::vector<uint8_t> peer_record = ct::PatternBytes(21, nccl_pair::kRecordBytes);
  want.insert(want.end(), peer_record.begin(), peer_record.end());
  EXPECT_EQ(gathered, want);
  s = comm.Barrier();
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(peer.Wait(0, kTimeout), 0);
}

// The sender's tensors: sync_test::Model's in device memory, but "b.bias"
// straight from the model's host bytes (unless `all`).
class DeviceTensors {
 public:
  explicit DeviceTensors(const Model& m, bool all = false) {
    for (const SyncTensor& t : m.tensors) {
      buffers_.push_back(all || nccl_pair::OnDevice(t.name)
                             ? std::make_unique<DeviceBytes>(t.data.size())
                             : nullptr);
    }
  }
  const std::vector<SyncTensor>& Upload(const Model& m) {
    tensors_ = m.tensors;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (!buffers_[i]) continue;
      EXPECT_TRUE(buffers_[i]->Upload(m.bytes[i]));
      tensors_[i].data = buffers_[i]->span();
      tensors_[i].place = Placement::Cuda(0);
    }
    return tensors_;
  }

 private:
  std::vector<std::unique_ptr<DeviceBytes>> buffers_;
  std::vector<SyncTensor> tensors_;
};

TEST_F(StreamNcclTest, ASyncOverNcclIsBitExactAndAKilledReceiverIsReseeded) {
  const std::string file = dir_.path() + "/receiver1.bin";
  const auto peer_args = [&](int die_at) {
    return PeerArgs(
        {"receiver", dir_.path(), file, std::to_string(die_at), std::to_string(kTimeout.count())});
  };
  ct::Children peer;
  ASSERT_EQ(peer.Spawn(peer_args(4)), 0);
  const CommunicatorOptions o = nccl_pair::PairOptions(dir_.path(), 0, kTimeout, "stream");
  Result<std::unique_ptr<StreamSender>> made =
      StreamSender::Create([o] { return CreateCommunicator("nccl", o); });
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  StreamSender& sender = **made;

  Model m = Model::Make(0);
  m.Step(1, 1.0);  // the receiver's registered bytes are Model::Make(0)'s
  DeviceTensors device(m);
  for (int step = 0; step < 3; ++step) {
    if (step > 0) m.Step(10 + step, 0.05);
    Result<SyncStats> s = sender.Sync(device.Upload(m));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 1u : 0u);
    if (step > 0) {
      EXPECT_GT(s->changed, 0u);
    }
    EXPECT_TRUE(sync_test::PeerHolds(file, m, 5000ms)) << "step " << step;
  }

  // The receiver dies applying sync 4: the sync fails within the timeout
  // and the snapshot stays where sync 3 left it.
  m.Step(20, 0.05);
  const auto start = std::chrono::steady_clock::now();
  Result<SyncStats> failed = sender.Sync(device.Upload(m));
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(failed.status().code() == StatusCode::kUnavailable ||
              failed.status().code() == StatusCode::kDeadlineExceeded)
      << failed.status().ToString();
  EXPECT_LT(took, kTimeout + 5000ms);
  EXPECT_EQ(peer.Wait(0, 5000ms), 128 + SIGKILL);
  EXPECT_EQ(sender.committed_sync_id(), 3u);

  // Restarted, it joins the group the sender forms again and is reseeded.
  ASSERT_TRUE(peer.Respawn(0, peer_args(0)));
  for (int step = 0; step < 2; ++step) {
    m.Step(30 + step, 0.05);
    Result<SyncStats> s = sender.Sync(device.Upload(m));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 1u : 0u);
    EXPECT_TRUE(sync_test::PeerHolds(file, m, 5000ms)) << "after the restart, step " << step;
  }
}

// Every tensor on the device on both sides: the frames stay there end to
// end (built, sent, received, checked and applied in device memory), with
// the dense and indices encodings; sparse deltas, compressed on the host,
// come in host frames (after a seed built on the device) that the receiver
// takes into its device bucket and reads from a host copy. Many frames a
// sync, bit-exact after every sync either way.
TEST_F(StreamNcclTest, FramesStayOnTheDeviceWhenEveryTensorDoes) {
  for (StreamEncoding encoding :
       {StreamEncoding::kIndices, StreamEncoding::kDense, StreamEncoding::kSparse}) {
    SCOPED_TRACE(std::string(StreamEncodingName(encoding)));
    const std::string group = "frames-" + std::string(StreamEncodingName(encoding));
    const std::string file = dir_.path() + "/" + group + ".bin";
    ct::Children peer;
    ASSERT_EQ(peer.Spawn(PeerArgs({"receiver", dir_.path() + "/" + group, file, "0",
                                   std::to_string(kTimeout.count()), "all"})),
              0);
    const CommunicatorOptions o =
        nccl_pair::PairOptions(dir_.path() + "/" + group, 0, kTimeout, "stream");
    SenderOptions options;
    options.encoding = encoding;
    options.bucket_bytes = 64 << 10;  // several frames a sync, two buckets in turn
    options.verify_every = 3;
    Result<std::unique_ptr<StreamSender>> made =
        StreamSender::Create([o] { return CreateCommunicator("nccl", o); }, options);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    StreamSender& sender = **made;
    Model m = Model::Make(0, nccl_pair::DeviceFrameSpecs());
    m.Step(1, 1.0);
    DeviceTensors device(m, /*all=*/true);
    for (int step = 0; step < 4; ++step) {
      if (step > 0) m.Step(40 + step, step == 2 ? 0.5 : 0.05);
      Result<SyncStats> s = sender.Sync(device.Upload(m));
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      EXPECT_EQ(s->seeded, step == 0 ? 1u : 0u);
      // The seed and the half-changed step span many frames; a 5% step
      // fits in two or three (sparse: compressed, fewer still).
      if (step == 0 || (step == 2 && encoding != StreamEncoding::kSparse)) {
        EXPECT_GT(s->frames, 3u) << "step " << step;
      } else {
        EXPECT_GE(s->frames, 2u) << "step " << step;
      }
      // All but the records frame that ends the sync, unless sparse.
      if (encoding == StreamEncoding::kSparse && step > 0) {
        EXPECT_EQ(s->device_frames, 0u);
      } else {
        EXPECT_EQ(s->device_frames, s->frames - 1) << "step " << step;
      }
      EXPECT_TRUE(sync_test::PeerHolds(file, m, 5000ms)) << "step " << step;
    }
    made->reset();  // the peer is killed at the end of the iteration
  }
}

}  // namespace
}  // namespace deltasync
