// The stream (include/deltasync/stream.h) with tensors in CUDA device
// memory, end to end over gloo on loopback in one process: a sender whose
// tensors are on the device (some on the host beside them), receivers that
// hold whole tensors and row and column slices on the device or on the
// host, checked bit-exact against host copies after every sync; a failed
// sync that rolls the device snapshot back; a tensor of more than one
// diff chunk; and memory that is not where its placement says, refused by
// name. GPU cases skip where there is no GPU; the case that checks what a
// machine without one does runs everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "deltasync/cuda.h"
#include "deltasync/stream.h"
#include "stream/communicator_test_util.h"
#include "stream/sync_test_util.h"

namespace deltasync {
namespace {

using namespace std::chrono_literals;
using sync_test::Model;

constexpr auto kTimeout = 20000ms;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// Every dtype width, sizes that are multiples of nothing, a 2-D tensor for
// slices and an empty one.
std::vector<Model::Spec> Specs() {
  return {
      {"embed.weight", DType::kBF16, {129, 67}},
      {"norm.weight", DType::kF32, {1001}},
      {"mask", DType::kU8, {4099}},
      {"scale", DType::kF64, {333}},
      {"proj.weight", DType::kF16, {7, 513}},
      {"empty", DType::kBF16, {0, 8}},
  };
}

// Device copies of a model's tensors: SyncTensors over device memory, but
// for the names kept on the host, which point at the model's bytes.
class DeviceModel {
 public:
  DeviceModel(const Model& m, std::vector<std::string> on_host, cudaStream_t stream)
      : on_host_(std::move(on_host)), stream_(stream) {
    for (const SyncTensor& t : m.tensors) {
      Result<cuda::Buffer> b = cuda::Buffer::Device(std::max<size_t>(t.data.size(), 1));
      EXPECT_TRUE(b.ok()) << b.status().ToString();
      buffers_.push_back(std::move(*b));
    }
    Upload(m);
  }
  // The model's current values into device memory; the SyncTensors.
  void Upload(const Model& m) {
    tensors_ = m.tensors;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      SyncTensor& t = tensors_[i];
      if (std::find(on_host_.begin(), on_host_.end(), t.name) != on_host_.end()) continue;
      ASSERT_EQ(cudaMemcpyAsync(buffers_[i].data(), t.data.data(), t.data.size(),
                                cudaMemcpyHostToDevice, stream_),
                cudaSuccess);
      t.data = {static_cast<const uint8_t*>(buffers_[i].data()), t.data.size()};
      t.place = Placement::Cuda(0, stream_);
    }
  }
  const std::vector<SyncTensor>& tensors() const { return tensors_; }

 private:
  std::vector<std::string> on_host_;
  cudaStream_t stream_;
  std::vector<cuda::Buffer> buffers_;
  std::vector<SyncTensor> tensors_;
};

std::vector<uint8_t> ToHost(std::span<const uint8_t> bytes) {
  std::vector<uint8_t> out(bytes.size());
  if (!out.empty()) {
    EXPECT_EQ(cudaMemcpy(out.data(), bytes.data(), bytes.size(), cudaMemcpyDefault), cudaSuccess);
  }
  return out;
}

// What a receiver holds of the 2-D tensors, and where.
enum class Hold { kWhole, kRows, kColumns };

// One receiver on its own thread: every tensor registered in device memory
// (or host memory for `host`), the 2-D ones as `hold` says.
class ReceiverRig {
 public:
  ReceiverRig(const Model& m, Hold hold, bool host, CommunicatorFactory connect,
              ReceiverOptions options = {})
      : host_(host) {
    Result<std::unique_ptr<StreamReceiver>> r =
        StreamReceiver::Create(std::move(connect), std::move(options));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    receiver_ = std::move(*r);
    for (const SyncTensor& t : m.tensors) {
      const size_t w = DTypeSize(t.dtype);
      const uint64_t numel = t.data.size() / w;
      std::vector<DestinationRun> runs;
      uint64_t elements = numel;
      if (t.shape.size() == 2 && numel > 0 && hold != Hold::kWhole) {
        const uint64_t rows = t.shape[0], cols = t.shape[1];
        if (hold == Hold::kRows) {  // the middle rows, back to back
          runs.push_back({rows / 4 * cols, rows / 2 * cols, 0, 1});
          elements = rows / 2 * cols;
        } else {  // columns 3..(cols/2) of every row, with gaps between rows
          const uint64_t n = cols / 2 - 3;
          for (uint64_t r = 0; r < rows; ++r) runs.push_back({r * cols + 3, n, r * (n + 5), 1});
          elements = rows * (n + 5);
        }
      }
      host_bytes_.emplace_back(elements * w, 0);
      runs_.push_back(runs);
      std::span<uint8_t> dest = host_bytes_.back();
      Placement place;
      if (!host_) {
        Result<cuda::Buffer> b = cuda::Buffer::Device(std::max<uint64_t>(elements * w, 1));
        EXPECT_TRUE(b.ok()) << b.status().ToString();
        EXPECT_EQ(cudaMemset(b->data(), 0, b->size()), cudaSuccess);
        dest = {static_cast<uint8_t*>(b->data()), elements * w};
        device_.push_back(std::move(*b));
        place = Placement::Cuda(0);
      }
      Status s = receiver_->Register(t.name, t.dtype, t.shape, dest, runs, place);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
  ~ReceiverRig() { Stop(); }

  void Start() {
    thread_ = std::thread([this] {
      while (!stop_) {
        Result<ReceiveStats> r = receiver_->ReceiveSync();
        std::lock_guard<std::mutex> lock(mu_);
        results_.push_back(r.ok() ? Status::OK() : r.status());
      }
    });
  }
  void RequestStop() { stop_ = true; }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::vector<Status> results() {
    std::lock_guard<std::mutex> lock(mu_);
    return results_;
  }

  // Every held element equals the model's; the first difference otherwise.
  Status Matches(const Model& m) {
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const SyncTensor& t = m.tensors[i];
      const size_t w = DTypeSize(t.dtype);
      const std::vector<uint8_t>& want = m.bytes[i];
      const std::vector<uint8_t> got =
          host_ ? host_bytes_[i]
                : ToHost({static_cast<const uint8_t*>(device_[i].data()), host_bytes_[i].size()});
      DS_RETURN_IF_ERROR(sync_test::HeldMatches(t.name, w, want, got, runs_[i]));
    }
    return Status::OK();
  }

 private:
  bool host_;
  std::unique_ptr<StreamReceiver> receiver_;
  std::vector<std::vector<uint8_t>> host_bytes_;
  std::vector<cuda::Buffer> device_;
  std::vector<std::vector<DestinationRun>> runs_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<Status> results_;
};

class StreamCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CommunicatorFactory Factory(int rank) {
    const CommunicatorOptions o = comm_test::LoopbackOptions(comm_test::FileRendezvous(dir_.path()),
                                                             rank, size_, kTimeout, "cuda");
    return [o]() { return CreateCommunicator("gloo", o); };
  }
  std::unique_ptr<StreamSender> MakeSender(SenderOptions o = {}) {
    Result<std::unique_ptr<StreamSender>> s = StreamSender::Create(Factory(0), o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }
  // The sender's snapshot of every tensor, brought to the host.
  static std::vector<std::vector<uint8_t>> Snapshots(const StreamSender& s, const Model& m) {
    std::vector<std::vector<uint8_t>> out;
    for (const SyncTensor& t : m.tensors) {
      Result<std::span<const uint8_t>> snap = s.Snapshot(t.name);
      out.push_back(snap.ok() ? ToHost(*snap) : std::vector<uint8_t>());
    }
    return out;
  }
  static void Finish(std::unique_ptr<StreamSender>& sender,
                     std::initializer_list<ReceiverRig*> rigs) {
    for (ReceiverRig* r : rigs) r->RequestStop();
    sender.reset();
    for (ReceiverRig* r : rigs) r->Stop();
  }

  comm_test::TempDir dir_;
  int size_ = 1;
  cudaStream_t stream_ = nullptr;
};

class StreamCudaEncodings : public StreamCudaTest,
                            public ::testing::WithParamInterface<StreamEncoding> {};

TEST_P(StreamCudaEncodings, DeviceTensorsOnBothSidesStayBitExactAfterEverySync) {
  size_ = 5;
  Model m = Model::Make(11, Specs());
  DeviceModel dm(m, {"norm.weight"}, stream_);  // one tensor stays on the host
  SenderOptions o;
  o.encoding = GetParam();
  o.bucket_bytes = 64 << 10;  // several frames per sync
  o.verify_every = 2;
  std::unique_ptr<StreamSender> sender = MakeSender(o);
  ReceiverRig whole(m, Hold::kWhole, false, Factory(1));
  ReceiverRig rows(m, Hold::kRows, false, Factory(2));
  ReceiverRig cols(m, Hold::kColumns, false, Factory(3));
  ReceiverRig host(m, Hold::kColumns, true, Factory(4));
  std::initializer_list<ReceiverRig*> rigs = {&whole, &rows, &cols, &host};
  for (ReceiverRig* r : rigs) r->Start();
  for (int step = 0; step < 6; ++step) {
    if (step > 0) m.Step(200 + step, step == 3 ? 0.0 : (step == 4 ? 0.6 : 0.03));
    dm.Upload(m);
    Result<SyncStats> s = sender->Sync(dm.tensors());
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 4u : 0u);
    if (step == 3) {
      EXPECT_EQ(s->changed, 0u);
    } else if (step > 0) {
      EXPECT_GT(s->changed, 0u);
    }
    for (ReceiverRig* r : rigs) {
      Status same = r->Matches(m);
      EXPECT_TRUE(same.ok()) << "step " << step << ": " << same.ToString();
    }
    EXPECT_EQ(Snapshots(*sender, m), m.bytes) << "step " << step;
  }
  Finish(sender, rigs);
}

INSTANTIATE_TEST_SUITE_P(Encodings, StreamCudaEncodings,
                         ::testing::Values(StreamEncoding::kDense, StreamEncoding::kIndices,
                                           StreamEncoding::kSparse),
                         [](const auto& info) {
                           return std::string(StreamEncodingName(info.param));
                         });

TEST_F(StreamCudaTest, AFailedSyncRollsTheDeviceSnapshotBackAndTheNextRepairsIt) {
  size_ = 3;
  Model m = Model::Make(12, Specs());
  DeviceModel dm(m, {}, stream_);
  std::unique_ptr<StreamSender> sender = MakeSender();
  ReceiverOptions failing;
  failing.apply_hook = [](uint64_t sync_id, std::string_view, uint64_t entry) {
    return sync_id == 3 && entry == 1 ? Status::IOError("injected: the device fell over")
                                      : Status::OK();
  };
  ReceiverRig good(m, Hold::kWhole, false, Factory(1));
  ReceiverRig bad(m, Hold::kRows, false, Factory(2), failing);
  good.Start();
  bad.Start();
  for (int step = 0; step < 2; ++step) {
    m.Step(30 + step, 0.05);
    dm.Upload(m);
    ASSERT_TRUE(sender->Sync(dm.tensors()).ok());
  }
  const std::vector<std::vector<uint8_t>> before = Snapshots(*sender, m);
  m.Step(40, 0.05);
  dm.Upload(m);
  Result<SyncStats> failed = sender->Sync(dm.tensors());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIOError) << failed.status().ToString();
  EXPECT_TRUE(Contains(failed.status(), "the device fell over")) << failed.status().ToString();
  EXPECT_EQ(Snapshots(*sender, m), before);  // the refresh was undone
  EXPECT_EQ(sender->committed_sync_id(), 2u);

  // Some elements change back, some go on: both receivers reach it.
  m.Step(41, 0.05);
  dm.Upload(m);
  Result<SyncStats> next = sender->Sync(dm.tensors());
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 1u);
  EXPECT_TRUE(good.Matches(m).ok()) << good.Matches(m).ToString();
  EXPECT_TRUE(bad.Matches(m).ok()) << bad.Matches(m).ToString();
  m.Step(42, 0.05);
  dm.Upload(m);
  next = sender->Sync(dm.tensors());
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->seeded, 0u);
  EXPECT_TRUE(bad.Matches(m).ok()) << bad.Matches(m).ToString();
  EXPECT_EQ(Snapshots(*sender, m), m.bytes);
  Finish(sender, {&good, &bad});
}

// More elements than one diff chunk (2^25): units on both sides of the
// chunk boundary, changes at its edges, and a failed sync between.
TEST_F(StreamCudaTest, ATensorOfSeveralDiffChunksStaysBitExact) {
  size_ = 2;
  const uint64_t n = (uint64_t{1} << 25) + 4097;
  Model m = Model::Make(13, {{"big", DType::kBF16, {static_cast<int64_t>(n)}}});
  DeviceModel dm(m, {}, stream_);
  SenderOptions o;
  o.bucket_bytes = 1 << 20;  // hundreds of units per chunk
  std::unique_ptr<StreamSender> sender = MakeSender(o);
  ReceiverOptions failing;
  failing.apply_hook = [](uint64_t sync_id, std::string_view, uint64_t entry) {
    return sync_id == 3 && entry == 2 ? Status::IOError("injected") : Status::OK();
  };
  ReceiverRig r(m, Hold::kWhole, false, Factory(1), failing);
  r.Start();
  std::mt19937_64 rng(5);
  const uint64_t edge = uint64_t{1} << 25;
  for (int step = 0; step < 5; ++step) {
    if (step > 0) {
      std::vector<uint8_t>& b = m.bytes[0];
      for (uint64_t p : {uint64_t{0}, edge - 1, edge, n - 1}) b[2 * p] ^= 0x5A;
      for (int k = 0; k < 20000; ++k) b[2 * (rng() % n) + (rng() & 1)] ^= 1 + (rng() & 0x7F);
    }
    dm.Upload(m);
    Result<SyncStats> s = sender->Sync(dm.tensors());
    if (step == 2) {
      ASSERT_FALSE(s.ok());
      continue;
    }
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_TRUE(r.Matches(m).ok()) << "step " << step << ": " << r.Matches(m).ToString();
    EXPECT_EQ(Snapshots(*sender, m), m.bytes) << "step " << step;
  }
  Finish(sender, {&r});
}

TEST_F(StreamCudaTest, MemoryThatIsNotWhereItsPlacementSaysIsRefusedByName) {
  int connects = 0;
  Result<std::unique_ptr<StreamSender>> s = StreamSender::Create(sync_test::NoGroup(&connects));
  ASSERT_TRUE(s.ok());
  std::vector<uint8_t> host(64);
  std::vector<SyncTensor> t = {{"w", DType::kBF16, {32}, host, Placement::Cuda(0)}};
  Status refused = (*s)->Sync(t).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_TRUE(Contains(refused, "'w'")) << refused.ToString();
  EXPECT_TRUE(Contains(refused, "host memory")) << refused.ToString();
  EXPECT_EQ(connects, 0);

  Result<cuda::Buffer> dev = cuda::Buffer::Device(64);
  ASSERT_TRUE(dev.ok());
  const std::span<const uint8_t> on_device(static_cast<const uint8_t*>(dev->data()), 64);
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  t[0] = {"w", DType::kBF16, {32}, on_device, Placement::Cuda(devices)};  // no such device
  refused = (*s)->Sync(t).status();
  EXPECT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused, "'w'")) << refused.ToString();
  EXPECT_EQ(connects, 0);

  // Accepted (the group is not there): the model is now fixed on the device.
  t[0].place = Placement::Cuda(0, stream_);
  EXPECT_EQ((*s)->Sync(t).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(connects, 1);
  t[0] = {"w", DType::kBF16, {32}, host, {}};
  EXPECT_TRUE(Contains((*s)->Sync(t).status(), "the first sync had it in device memory"));
  t[0].place = Placement::Cuda(0);
  refused = (*s)->Sync(t).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_TRUE(Contains(refused, "'w'")) << refused.ToString();
  EXPECT_EQ(connects, 1);

  Result<std::unique_ptr<StreamReceiver>> r = StreamReceiver::Create(sync_test::NoGroup());
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> dest_host(64);
  Status reg = (*r)->Register("w", DType::kBF16, {32}, dest_host, {}, Placement::Cuda(0));
  EXPECT_EQ(reg.code(), StatusCode::kInvalidArgument) << reg.ToString();
  EXPECT_TRUE(Contains(reg, "registering tensor 'w'")) << reg.ToString();
  const std::span<uint8_t> dest(static_cast<uint8_t*>(dev->data()), 64);
  reg = (*r)->Register("w", DType::kBF16, {4, 8}, dest, {{0, 4, 0, 2}, {8, 4, 8, 2}},
                       Placement::Cuda(0));
  EXPECT_EQ(reg.code(), StatusCode::kInvalidArgument) << reg.ToString();
  EXPECT_TRUE(Contains(reg, "stride 1")) << reg.ToString();
  reg = (*r)->Register("w", DType::kBF16, {4, 8}, dest, {{0, 4, 8, 1}, {8, 4, 0, 1}},
                       Placement::Cuda(0));
  EXPECT_EQ(reg.code(), StatusCode::kInvalidArgument) << reg.ToString();
  EXPECT_TRUE(Contains(reg, "ascend")) << reg.ToString();
  // None of those registered it.
  EXPECT_TRUE((*r)->Register("w", DType::kBF16, {32}, dest, {}, Placement::Cuda(0)).ok());
}

TEST(StreamCudaWithoutGpu, DevicePlacementsAreAFailedPreconditionNamingTheTensor) {
  if (HaveGpu()) GTEST_SKIP() << "a CUDA device is present";
  Result<std::unique_ptr<StreamSender>> s = StreamSender::Create(sync_test::NoGroup());
  ASSERT_TRUE(s.ok());
  std::vector<uint8_t> bytes(8);
  std::vector<SyncTensor> t = {{"w", DType::kBF16, {4}, bytes, Placement::Cuda(0)}};
  const Status sent = (*s)->Sync(t).status();
  EXPECT_EQ(sent.code(), StatusCode::kFailedPrecondition) << sent.ToString();
  EXPECT_TRUE(Contains(sent, "tensor 'w'")) << sent.ToString();
  Result<std::unique_ptr<StreamReceiver>> r = StreamReceiver::Create(sync_test::NoGroup());
  ASSERT_TRUE(r.ok());
  const Status reg = (*r)->Register("w", DType::kBF16, {4}, bytes, {}, Placement::Cuda(0));
  EXPECT_EQ(reg.code(), StatusCode::kFailedPrecondition) << reg.ToString();
  EXPECT_TRUE(Contains(reg, "registering tensor 'w'")) << reg.ToString();
}

}  // namespace
}  // namespace deltasync
