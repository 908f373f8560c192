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
#include <bit>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "comm/communicator_test_util.h"
#include "deltasync/checksum.h"
#include "deltasync/cuda.h"
#include "deltasync/diff.h"
#include "deltasync/quantize.h"
#include "deltasync/stream.h"
#include "stream/device_path.h"
#include "stream/frame.h"
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
// (or host memory for `host`, and those named in `on_host`), the 2-D ones
// as `hold` says.
class ReceiverRig {
 public:
  ReceiverRig(const Model& m, Hold hold, bool host, CommunicatorFactory connect,
              ReceiverOptions options = {}, const std::set<std::string>& on_host = {}) {
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
      here_.push_back(host || on_host.count(t.name) > 0);
      device_.emplace_back();
      if (!here_.back()) {
        Result<cuda::Buffer> b = cuda::Buffer::Device(std::max<uint64_t>(elements * w, 1));
        EXPECT_TRUE(b.ok()) << b.status().ToString();
        EXPECT_EQ(cudaMemset(b->data(), 0, b->size()), cudaSuccess);
        dest = {static_cast<uint8_t*>(b->data()), elements * w};
        device_.back() = std::move(*b);
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
          here_[i]
              ? host_bytes_[i]
              : ToHost({static_cast<const uint8_t*>(device_[i].data()), host_bytes_[i].size()});
      DS_RETURN_IF_ERROR(sync_test::HeldMatches(t.name, w, want, got, runs_[i]));
    }
    return Status::OK();
  }

 private:
  std::vector<bool> here_;  // per tensor: in host memory
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
  size_ = 6;
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
  // Device tensors beside host ones in one receiver.
  ReceiverRig mixed(m, Hold::kRows, false, Factory(5), {}, {"embed.weight", "scale"});
  std::initializer_list<ReceiverRig*> rigs = {&whole, &rows, &cols, &host, &mixed};
  for (ReceiverRig* r : rigs) r->Start();
  for (int step = 0; step < 6; ++step) {
    if (step > 0) m.Step(200 + step, step == 3 ? 0.0 : (step == 4 ? 0.6 : 0.03));
    dm.Upload(m);
    Result<SyncStats> s = sender->Sync(dm.tensors());
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_EQ(s->seeded, step == 0 ? 5u : 0u);
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

// A sender given BF16 weights in device memory and a recipe for each
// (SenderOptions::quantize) quantizes them on the GPU and sends their FP8
// codes and scales: receivers in host and in device memory hold, after
// every sync, exactly what the CPU quantizer makes of the weights.
TEST_F(StreamCudaTest, DeviceWeightsSentQuantizedEqualTheCpuQuantizer) {
  size_ = 3;
  const QuantRecipe recipe{QuantScheme::kBlock128, ScaleFormat::kUe8m0};
  const std::vector<std::vector<int64_t>> shapes = {{300, 200}, {129, 640}};
  std::vector<Model::Spec> specs;
  SenderOptions o;
  o.bucket_bytes = 64 << 10;
  for (size_t t = 0; t < shapes.size(); ++t) {
    const std::string name = "layers." + std::to_string(t) + ".up_proj.weight";
    specs.emplace_back(name, DType::kF8_E4M3, shapes[t]);
    specs.emplace_back(name + "_scale_inv", DType::kF8_E8M0,
                       *QuantScaleShape(recipe, shapes[t][0], shapes[t][1]));
    o.quantize[name] = {recipe, ""};
  }
  specs.emplace_back("norm.weight", DType::kBF16, std::vector<int64_t>{64});
  Model want = Model::Make(21, specs);
  std::mt19937_64 rng(21);
  std::normal_distribution<float> init(0.0f, 0.02f);
  std::vector<std::vector<uint16_t>> weights;
  std::vector<cuda::Buffer> device;
  std::vector<SyncTensor> given;
  for (size_t t = 0; t < shapes.size(); ++t) {
    std::vector<uint16_t>& w = weights.emplace_back(shapes[t][0] * shapes[t][1]);
    for (uint16_t& x : w) x = static_cast<uint16_t>(std::bit_cast<uint32_t>(init(rng)) >> 16);
    Result<cuda::Buffer> b = cuda::Buffer::Device(w.size() * 2);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    device.push_back(std::move(*b));
    given.push_back({std::get<0>(specs[2 * t]),
                     DType::kBF16,
                     shapes[t],
                     {static_cast<const uint8_t*>(device.back().data()), w.size() * 2},
                     Placement::Cuda(0, stream_)});
  }
  given.push_back(want.tensors.back());  // on the host, as it is
  std::unique_ptr<StreamSender> sender = MakeSender(o);
  ReceiverRig on_host(want, Hold::kWhole, true, Factory(1));
  ReceiverRig on_device(want, Hold::kWhole, false, Factory(2));
  on_host.Start();
  on_device.Start();
  for (int step = 0; step < 4; ++step) {
    for (size_t t = 0; t < shapes.size(); ++t) {
      std::vector<uint16_t>& w = weights[t];
      if (step > 0) {
        for (int k = 0; k < 500; ++k) w[rng() % w.size()] ^= 1 + (rng() & 3);
        w[step] = static_cast<uint16_t>(w[step] + 0x80);  // one binade up: a scale moves
      }
      ASSERT_TRUE(Fp8Quantize(recipe, {given[t].name, DType::kBF16, shapes[t]}, w.data(),
                              want.bytes[2 * t].data(), want.bytes[2 * t + 1].data())
                      .ok());
      ASSERT_EQ(cudaMemcpy(device[t].data(), w.data(), w.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    want.Rebind();
    given.back() = want.tensors.back();
    Result<SyncStats> r = sender->Sync(given);
    ASSERT_TRUE(r.ok()) << "step " << step << ": " << r.status().ToString();
    EXPECT_GT(r->quantize_s, 0.0);
    EXPECT_TRUE(on_host.Matches(want).ok())
        << "step " << step << ": " << on_host.Matches(want).ToString();
    EXPECT_TRUE(on_device.Matches(want).ok())
        << "step " << step << ": " << on_device.Matches(want).ToString();
    if (step > 0) {
      EXPECT_LT(r->sent_elements, want.bytes[0].size() / 2) << "a delta";
    }
  }
  // A weight the recipe cannot take is refused by name; nothing is sent.
  const uint16_t inf = 0x7F80;
  ASSERT_EQ(cudaMemcpy(device[1].data(), &inf, 2, cudaMemcpyHostToDevice), cudaSuccess);
  Result<SyncStats> bad = sender->Sync(given);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'layers.1.up_proj.weight'"), std::string::npos)
      << bad.status().ToString();
  EXPECT_EQ(sender->committed_sync_id(), 4u);
  Finish(sender, {&on_host, &on_device});
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

// ---------------------------------------------------------------------------
// Frames in device memory (stream/device_path.h): built on the device and
// read there, against the host's FlushWriter and FlushReader.

// One frame's worth of entries: a dense range and an indices range of a
// BF16 tensor, an indices range of an F32 [3, 7] tensor (an odd count, so
// its values region needs padding), a digest record.
struct FrameParts {
  std::vector<int64_t> a_shape{1000};
  std::vector<int64_t> b_shape{3, 7};
  std::vector<uint8_t> a_dense;  // elements [0, 300) of a
  ChangeSet a_changes;           // positions from 300
  ChangeSet b_changes;           // positions from 0
  stream::FlushHeader header;

  static FrameParts Make(std::mt19937_64& rng) {
    FrameParts p;
    p.a_dense.resize(300 * 2);
    for (auto& x : p.a_dense) x = static_cast<uint8_t>(rng());
    for (uint32_t k = 0; k < 700; k += 1 + rng() % 9) p.a_changes.pos32.push_back(k);
    p.a_changes.new_values.resize(p.a_changes.pos32.size() * 2);
    for (auto& x : p.a_changes.new_values) x = static_cast<uint8_t>(rng());
    p.b_changes.pos32 = {0, 3, 4, 9, 12, 16, 20};
    p.b_changes.new_values.resize(p.b_changes.pos32.size() * 4);
    for (auto& x : p.b_changes.new_values) x = static_cast<uint8_t>(rng());
    p.header.sync_id = 9;
    p.header.flush_index = 2;
    p.header.kind = stream::FrameKind::kDelta;
    return p;
  }
  stream::TensorRange A(uint64_t first, uint64_t count) const {
    return {"a", DType::kBF16, a_shape, first, count};
  }
  stream::TensorRange B() const { return {"b", DType::kF32, b_shape, 0, 21}; }
  stream::DigestBlock Block() const { return {0, 21, 1, 0}; }

  stream::FrameBuffer OnHost() const {
    stream::FlushWriter w;
    stream::FrameBuffer out;
    EXPECT_TRUE(w.Begin(header, 1 << 20, &out).ok());
    EXPECT_TRUE(*w.AddDense(A(0, 300), a_dense));
    EXPECT_TRUE(
        *w.AddIndices(A(300, 700), stream::Positions::Of(a_changes, 300), a_changes.new_values));
    EXPECT_TRUE(*w.AddIndices(B(), stream::Positions::Of(b_changes, 0), b_changes.new_values));
    EXPECT_TRUE(*w.AddDigest("b", Block(), {1, 2}));
    EXPECT_TRUE(w.Finish().ok());
    return out;
  }
};

// Host bytes copied into fresh device memory.
struct OnDevice {
  cuda::Buffer buffer;
  explicit OnDevice(std::span<const uint8_t> bytes) {
    Result<cuda::Buffer> b = cuda::Buffer::Device(std::max<size_t>(bytes.size(), 1));
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    buffer = std::move(*b);
    if (!bytes.empty()) {
      EXPECT_EQ(cudaMemcpy(buffer.data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  const uint8_t* data() const { return static_cast<const uint8_t*>(buffer.data()); }
};

TEST_F(StreamCudaTest, AFrameBuiltOnTheDeviceIsTheFrameTheHostWriterBuilds) {
  std::mt19937_64 rng(41);
  const FrameParts p = FrameParts::Make(rng);
  Result<std::unique_ptr<stream::DeviceContext>> ctx = stream::DeviceContext::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  Result<std::unique_ptr<stream::DeviceFrame>> made = stream::DeviceFrame::Create(**ctx, 1 << 20);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  stream::DeviceFrame& frame = **made;
  const OnDevice dense(p.a_dense),
      a_pos(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(p.a_changes.pos32.data()),
                                     p.a_changes.pos32.size() * 4)),
      a_val(p.a_changes.new_values),
      b_pos(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(p.b_changes.pos32.data()),
                                     p.b_changes.pos32.size() * 4)),
      b_val(p.b_changes.new_values);
  // Twice: a reused bucket holds nothing of the frame before.
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(frame.Begin(p.header, stream_).ok());
    ASSERT_TRUE(*frame.AddDense(p.A(0, 300), dense.data(), stream_));
    stream::DeviceUnitChanges a{a_pos.data(), false,   300,
                                a_val.data(), nullptr, p.a_changes.pos32.size()};
    ASSERT_TRUE(*frame.AddIndices(p.A(300, 700), a, stream_));
    stream::DeviceUnitChanges b{b_pos.data(), false,   0,
                                b_val.data(), nullptr, p.b_changes.pos32.size()};
    ASSERT_TRUE(*frame.AddIndices(p.B(), b, nullptr));  // another stream
    ASSERT_TRUE(*frame.AddDigest("b", p.Block(), {1, 2}));
    ASSERT_TRUE(frame.Finish().ok());
    const stream::FrameBuffer host = p.OnHost();
    EXPECT_EQ(ToHost(frame.frame()), std::vector<uint8_t>(host.begin(), host.end()))
        << "round " << round;
  }
  // What the host writer refuses, the device frame refuses, unchanged.
  ASSERT_TRUE(frame.Begin(p.header, stream_).ok());
  Result<bool> bad = frame.AddDense({"", DType::kBF16, p.a_shape, 0, 300}, dense.data(), stream_);
  EXPECT_FALSE(bad.ok());
  stream::FlushHeader seed = p.header;
  seed.kind = stream::FrameKind::kSeed;
  ASSERT_TRUE(frame.Begin(seed, stream_).ok());
  stream::DeviceUnitChanges a{a_pos.data(), false, 300, a_val.data(), nullptr, 3};
  bad = frame.AddIndices(p.A(300, 700), a, stream_);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status(), "seed frame")) << bad.status().ToString();
  // An entry past the budget does not fit.
  Result<std::unique_ptr<stream::DeviceFrame>> small = stream::DeviceFrame::Create(**ctx, 256);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE((*small)->Begin(p.header, stream_).ok());
  Result<bool> fit = (*small)->AddDense(p.A(0, 300), dense.data(), stream_);
  ASSERT_TRUE(fit.ok());
  EXPECT_FALSE(*fit);
}

// The entries a reader exposes, with their bytes brought to the host.
struct SeenEntry {
  std::string name;
  uint64_t first, count, n;
  stream::WireEncoding encoding;
  uint32_t width;
  std::vector<uint8_t> positions, values;
  bool operator==(const SeenEntry&) const = default;
};
std::vector<SeenEntry> Seen(const stream::FlushReader& r) {
  std::vector<SeenEntry> out;
  for (const stream::FlushEntry& e : r.entries()) {
    out.push_back({std::string(e.name), e.first, e.count, e.value_count, e.encoding,
                   e.position_width, ToHost(e.positions), ToHost(e.values)});
  }
  return out;
}

// The absolute positions of a placed entry, read back from the device.
std::vector<uint64_t> PlacedPositions(const stream::FlushEntry& e) {
  const std::vector<uint8_t> positions = ToHost(e.positions), values = ToHost(e.values);
  stream::FlushEntry h = e;
  h.positions = positions;
  h.values = values;
  h.host_readable = true;
  return stream::EntryPositions(h);
}

TEST_F(StreamCudaTest, AFrameReadOnTheDeviceExposesWhatTheHostReaderDoes) {
  std::mt19937_64 rng(42);
  const FrameParts p = FrameParts::Make(rng);
  const stream::FrameBuffer frame = p.OnHost();
  Result<std::unique_ptr<stream::DeviceContext>> ctx = stream::DeviceContext::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  Result<std::unique_ptr<stream::DeviceFrameReader>> made =
      stream::DeviceFrameReader::Create(**ctx);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  stream::DeviceFrameReader& device = **made;
  const auto read_on_device = [&](std::span<const uint8_t> bytes, stream::FlushReader* r) {
    Result<std::span<uint8_t>> bucket = device.Bucket(bytes.size());
    EXPECT_TRUE(bucket.ok());
    EXPECT_EQ(cudaMemcpy(bucket->data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    return device.Read(r, bytes.size());
  };
  stream::FlushReader host, dev;
  ASSERT_TRUE(host.Read(frame).ok());
  Status s = read_on_device(frame, &dev);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(Seen(dev), Seen(host));
  for (const stream::FlushEntry& e : dev.entries()) EXPECT_FALSE(e.host_readable);
  ASSERT_EQ(dev.digests().size(), 1u);
  EXPECT_EQ(dev.header().sync_id, 9u);

  // Applied from the bucket into a slice (columns 2..4 of b), as the host
  // applies the host reader's entry.
  Result<stream::DestinationMap> map =
      stream::DestinationMap::Create(21, {{2, 3, 0, 1}, {9, 3, 3, 1}, {16, 3, 6, 1}});
  ASSERT_TRUE(map.ok());
  std::vector<uint8_t> want(9 * 4, 0x5A);
  const OnDevice dest_init(want);
  std::span<uint8_t> dest(static_cast<uint8_t*>(dest_init.buffer.data()), want.size());
  Result<std::unique_ptr<stream::DeviceDestination>> d = stream::DeviceDestination::Create(
      **ctx, "b", DType::kF32, *map, dest, Placement::Cuda(0, stream_));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  for (size_t k = 0; k < dev.entries().size(); ++k) {
    if (dev.entries()[k].name != "b") continue;
    ASSERT_TRUE(stream::ApplyEntry(host.entries()[k], *map, want).ok());
    Result<uint64_t> wrote = (*d)->Apply(dev.entries()[k]);
    ASSERT_TRUE(wrote.ok()) << wrote.status().ToString();
    // A host apply of a device entry is refused, not a fault.
    std::vector<uint8_t> scratch(want.size());
    EXPECT_FALSE(stream::ApplyEntry(dev.entries()[k], *map, scratch).ok());
  }
  ASSERT_TRUE((*d)->Wait().ok());
  EXPECT_EQ(ToHost(dest), want);

  // Damage in transit fails the trailer; damage behind a good trailer
  // fails the check it breaks, on the device as on the host.
  std::vector<uint8_t> bad(frame.begin(), frame.end());
  bad[100] ^= 1;
  s = read_on_device(bad, &dev);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(s, "xxh3-128 mismatch")) << s.ToString();
  EXPECT_TRUE(dev.entries().empty());
  const auto resealed = [](std::vector<uint8_t> f) {
    stream::ResealFlushFrame(f);
    return f;
  };
  const stream::FlushEntry& a1 = host.entries()[1];
  const uint64_t pos_off = a1.positions.data() - frame.data();
  bad.assign(frame.begin(), frame.end());
  std::memcpy(&bad[pos_off + 4], &bad[pos_off], 4);  // positions 0 and 1 equal
  bad = resealed(bad);
  s = read_on_device(bad, &dev);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(s, "entry 1 ('a'): positions not strictly increasing")) << s.ToString();
  EXPECT_FALSE(host.Read(bad).ok());
  ASSERT_TRUE(host.Read(frame).ok());
  const uint64_t b_end =
      (host.entries()[2].positions.data() - frame.data()) + host.entries()[2].positions.size();
  bad.assign(frame.begin(), frame.end());
  bad[b_end] = 7;  // padding after b's 7 positions
  bad = resealed(bad);
  s = read_on_device(bad, &dev);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(s, "padding before its values is not 0")) << s.ToString();
  EXPECT_FALSE(host.Read(bad).ok());

  // A frame with sparse entries is read from a host copy.
  stream::FrameBuffer sparse;
  stream::FlushWriter w;
  ASSERT_TRUE(w.Begin(p.header, 1 << 20, &sparse).ok());
  ASSERT_TRUE(
      *w.AddSparse(p.A(300, 700), stream::Positions::Of(p.a_changes, 300), p.a_changes.new_values));
  ASSERT_TRUE(w.Finish().ok());
  ASSERT_TRUE(host.Read(sparse).ok());
  s = read_on_device(sparse, &dev);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(dev.entries().size(), 1u);
  EXPECT_TRUE(dev.entries()[0].host_readable);
  EXPECT_EQ(stream::EntryPositions(dev.entries()[0]), stream::EntryPositions(host.entries()[0]));
}

// A host frame's entries put on the device a frame at a time: what views
// the frame goes up with it (or is found in a device bucket holding the same
// bytes), a sparse entry's decoded positions and values are packed beside,
// and each placed entry applies into a whole tensor and into a slice as the
// host applies the host entry, one by one or in a batch. Entries not wanted
// stay as they were.
TEST_F(StreamCudaTest, AHostFramePlacedOnTheDeviceAppliesAsTheHostEntry) {
  std::mt19937_64 rng(43);
  const FrameParts p = FrameParts::Make(rng);
  stream::FrameBuffer sparse;
  stream::FlushWriter w;
  ASSERT_TRUE(w.Begin(p.header, 1 << 20, &sparse).ok());
  ASSERT_TRUE(
      *w.AddSparse(p.A(300, 700), stream::Positions::Of(p.a_changes, 300), p.a_changes.new_values));
  ASSERT_TRUE(*w.AddSparse(p.B(), stream::Positions::Of(p.b_changes, 0), p.b_changes.new_values));
  ASSERT_TRUE(w.Finish().ok());
  const stream::FrameBuffer plain = p.OnHost();
  Result<std::unique_ptr<stream::DeviceContext>> ctx = stream::DeviceContext::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  Result<std::unique_ptr<stream::HostFrameUpload>> up = stream::HostFrameUpload::Create(**ctx);
  ASSERT_TRUE(up.ok()) << up.status().ToString();
  Result<std::unique_ptr<stream::DeviceBatch>> batch = stream::DeviceBatch::Create(**ctx);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  // a whole; b's columns 2..4 (three runs).
  Result<stream::DestinationMap> a_map = stream::DestinationMap::Create(1000, {{0, 1000, 0, 1}});
  Result<stream::DestinationMap> b_map =
      stream::DestinationMap::Create(21, {{2, 3, 0, 1}, {9, 3, 3, 1}, {16, 3, 6, 1}});
  ASSERT_TRUE(a_map.ok() && b_map.ok());
  for (const stream::FrameBuffer* frame :
       {&plain, static_cast<const stream::FrameBuffer*>(&sparse)}) {
    for (bool from_bucket : {false, true}) {
      SCOPED_TRACE(std::string(frame == &plain ? "dense and indices" : "sparse") +
                   (from_bucket ? ", frame in a device bucket" : ", frame on the host"));
      stream::FlushReader host;
      ASSERT_TRUE(host.Read(*frame).ok());
      std::vector<uint8_t> a_want(1000 * 2), b_want(9 * 4);
      for (auto& x : a_want) x = static_cast<uint8_t>(rng());
      for (auto& x : b_want) x = static_cast<uint8_t>(rng());
      const OnDevice a_init(a_want), b_init(b_want), bucket(*frame);
      std::span<uint8_t> a_dest(static_cast<uint8_t*>(a_init.buffer.data()), a_want.size());
      std::span<uint8_t> b_dest(static_cast<uint8_t*>(b_init.buffer.data()), b_want.size());
      Result<std::unique_ptr<stream::DeviceDestination>> a = stream::DeviceDestination::Create(
          **ctx, "a", DType::kBF16, *a_map, a_dest, Placement::Cuda(0, stream_));
      Result<std::unique_ptr<stream::DeviceDestination>> b = stream::DeviceDestination::Create(
          **ctx, "b", DType::kF32, *b_map, b_dest, Placement::Cuda(0, stream_));
      ASSERT_TRUE(a.ok() && b.ok());
      const std::span<const stream::FlushEntry> entries = host.entries();
      std::vector<bool> wanted(entries.size(), true);
      wanted[0] = false;  // left to the host, as it was
      std::vector<stream::FlushEntry> placed;
      Status s =
          (*up)->Place(*frame, from_bucket ? bucket.data() : nullptr, entries, wanted, &placed);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(placed.size(), entries.size());
      EXPECT_TRUE(placed[0].host_readable);
      EXPECT_EQ(placed[0].values.data(), entries[0].values.data());
      for (size_t k = 0; k < entries.size(); ++k) {
        const bool is_a = entries[k].name == "a";
        stream::DeviceDestination& d = is_a ? **a : **b;
        ASSERT_TRUE(stream::ApplyEntry(entries[k], is_a ? *a_map : *b_map,
                                       is_a ? std::span<uint8_t>(a_want) : b_want)
                        .ok());
        if (!wanted[k]) {
          // A host entry into the device destination, as before.
          Result<uint64_t> wrote = d.Apply(entries[k]);
          ASSERT_TRUE(wrote.ok()) << wrote.status().ToString();
          continue;
        }
        EXPECT_FALSE(placed[k].host_readable);
        EXPECT_EQ(ToHost(placed[k].values), ToHost(entries[k].values)) << "entry " << k;
        EXPECT_EQ(PlacedPositions(placed[k]), stream::EntryPositions(entries[k])) << "entry " << k;
        // Entry by entry, or all in one batched launch.
        Result<uint64_t> wrote = from_bucket ? (*batch)->Add(d, placed[k]) : d.Apply(placed[k]);
        ASSERT_TRUE(wrote.ok()) << wrote.status().ToString();
      }
      if (from_bucket) {
        ASSERT_TRUE((*batch)->Launch().ok());
      }
      ASSERT_TRUE((*a)->Wait().ok());
      ASSERT_TRUE((*b)->Wait().ok());
      EXPECT_EQ(ToHost(a_dest), a_want);
      EXPECT_EQ(ToHost(b_dest), b_want);
    }
  }
}

// A sparse entry of a tensor past 2^31 elements is placed with 8-byte
// positions (the kernels read 4-byte ones as int32), and lands in a slice
// the receiver holds near the tensor's end.
TEST_F(StreamCudaTest, ASparseEntryPastTwoToThe31IsPlacedWithWidePositions) {
  const uint64_t numel = (uint64_t{1} << 31) + 100, first = (uint64_t{1} << 31) + 20;
  const std::vector<int64_t> shape = {static_cast<int64_t>(numel)};
  ChangeSet changes;
  changes.pos32 = {0, 5, 6, 30, 59};  // from `first`
  changes.new_values = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  stream::FlushHeader header;
  header.sync_id = 3;
  header.kind = stream::FrameKind::kDelta;
  stream::FrameBuffer frame;
  stream::FlushWriter w;
  ASSERT_TRUE(w.Begin(header, 1 << 20, &frame).ok());
  ASSERT_TRUE(*w.AddSparse({"big", DType::kBF16, shape, first, 60},
                           stream::Positions::Of(changes, first), changes.new_values));
  ASSERT_TRUE(w.Finish().ok());
  stream::FlushReader host;
  ASSERT_TRUE(host.Read(frame).ok());
  // The receiver holds elements [first + 4, first + 44).
  Result<stream::DestinationMap> map =
      stream::DestinationMap::Create(numel, {{first + 4, 40, 0, 1}});
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::vector<uint8_t> want(40 * 2, 0x77);
  const OnDevice init(want);
  std::span<uint8_t> dest(static_cast<uint8_t*>(init.buffer.data()), want.size());
  ASSERT_TRUE(stream::ApplyEntry(host.entries()[0], *map, want).ok());
  Result<std::unique_ptr<stream::DeviceContext>> ctx = stream::DeviceContext::Create(0);
  ASSERT_TRUE(ctx.ok());
  Result<std::unique_ptr<stream::DeviceDestination>> d = stream::DeviceDestination::Create(
      **ctx, "big", DType::kBF16, *map, dest, Placement::Cuda(0, stream_));
  Result<std::unique_ptr<stream::HostFrameUpload>> up = stream::HostFrameUpload::Create(**ctx);
  Result<std::unique_ptr<stream::DeviceBatch>> batch = stream::DeviceBatch::Create(**ctx);
  ASSERT_TRUE(d.ok() && up.ok() && batch.ok());
  std::vector<stream::FlushEntry> placed;
  ASSERT_TRUE((*up)->Place(frame, nullptr, host.entries(), {true}, &placed).ok());
  EXPECT_EQ(placed[0].position_width, 8u);
  ASSERT_TRUE((*batch)->Add(**d, placed[0]).ok());
  ASSERT_TRUE((*batch)->Launch().ok());
  ASSERT_TRUE((*d)->Wait().ok());
  EXPECT_EQ(ToHost(dest), want);
  EXPECT_NE(want, std::vector<uint8_t>(40 * 2, 0x77));  // the slice took changes
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
