#include "bench_gpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "cli_util.h"
#include "deltasync/communicator.h"
#include "deltasync/stream.h"

#if DS_HAVE_CUDA
#include <cuda_runtime.h>
#include <unistd.h>

#include "deltasync/cuda.h"
#endif

namespace deltasync::cli {

#if !DS_HAVE_CUDA

int RunGpuBench(const GpuBenchConfig&, bool) {
  return Fail("bench --gpu: this deltasync was built without CUDA (DELTASYNC_WITH_CUDA)");
}

int RunGpuNcclPeer(const std::vector<std::string>&) {
  return Fail("bench-gpu-nccl-peer: this deltasync was built without CUDA");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// fill(i) for i in [0, n), split over every core.
void FillInParallel(uint64_t n, const std::function<void(uint64_t)>& fill) {
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      const uint64_t lo = n * w / workers, hi = n * (w + 1) / workers;
      for (uint64_t i = lo; i < hi; ++i) fill(i);
    });
  }
  for (auto& t : threads) t.join();
}

// A random BF16 step: `a` random bits, `b` the same with a `density`
// fraction of elements changed.
void MakeStep(uint64_t n, double density, uint64_t seed, std::vector<uint16_t>& a,
              std::vector<uint16_t>& b) {
  a.resize(n);
  b.resize(n);
  const uint64_t threshold = static_cast<uint64_t>(density * 18446744073709551615.0);
  FillInParallel(n, [&](uint64_t i) {
    const uint64_t r = SplitMix(seed * 0x100000001B3ull + i);
    a[i] = static_cast<uint16_t>(r);
    const uint64_t pick = SplitMix(r);
    b[i] = pick < threshold ? static_cast<uint16_t>(a[i] ^ (1 + (r >> 48) % 0xFFFF)) : a[i];
  });
}

// Median seconds of `repeat` runs of `fn` (after one warm-up), each timed
// on the host around the call and a device synchronize.
double Median(int repeat, const std::function<bool()>& fn, bool* ok) {
  if (!fn()) *ok = false;
  cudaDeviceSynchronize();
  std::vector<double> times;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    if (!fn()) *ok = false;
    cudaDeviceSynchronize();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct SizeFigures {
  uint64_t bytes = 0;
  uint64_t changed = 0;
  double copy_s = 0, pcie_read_s = 0;
  double diff_device_s = 0, diff_pinned_s = 0, diff_identical_s = 0, diff_pinned_no_refresh_s = 0,
         scatter_s = 0, digest_s = 0, digest_f32_s = 0, xxh3_s = 0;
  // The apply of one frame's changes (the step's density, positions and
  // values in device memory) into `experts` tensors of a mixture-of-experts
  // layout in one batched launch, into one tensor of all the elements, and
  // into the small tensors with a launch each.
  uint64_t experts = 0, batch_changed = 0;
  double batch_one_s = 0, batch_many_s = 0, launch_each_s = 0;
  // Quantize-then-diff of the same bytes as a [n / 4096, 4096] BF16 weight
  // of finite values (block-scaled 128 x 128, ue8m0 scales), the step's
  // density of its elements nudged: the fused pass against the snapshot of
  // codes and scales, and the quantization's changed codes and scales.
  uint64_t quant_changed = 0, quant_scales_changed = 0;
  double quant_diff_s = 0;
  bool have_torch = false;
  double torch_device_s = 0, torch_pinned_s = 0, torch_index_put_s = 0, torch_copy_s = 0,
         torch_quant_diff_s = 0;
  std::string torch_error;
  // The stream (one sender, one receiver, gloo on loopback): a sync of the
  // tensor on the device at both ends, the same in host memory, and the
  // copies the host path adds for a tensor that lives on the device.
  bool have_stream = false;
  double sync_device_s = 0, sync_host_s = 0, to_host_s = 0, to_device_s = 0;
  uint64_t sync_bytes_sent = 0;
  std::string stream_error;
  // The same sync of device tensors over nccl to a receiver process on the
  // same GPU, with the frames built and taken in device memory, and with
  // them forced through host memory; both over the same link.
  bool have_nccl = false;
  double nccl_device_frames_s = 0, nccl_host_frames_s = 0;
  uint64_t nccl_frames = 0, nccl_device_frames = 0;
  // Where a delta sync's time goes over nccl, means over the timed syncs:
  // the sender's phases (SyncStats) and the receiver's (ReceiveStats,
  // waiting for and taking frames; checking and applying them). [0]: frames
  // on the device, [1]: through host memory.
  struct Phases {
    double diff_s = 0, encode_s = 0, transfer_s = 0, report_s = 0, receive_s = 0, apply_s = 0;
  } nccl_phases[2];
  std::string nccl_error;
};

// This process as rank `rank` of a one-GPU nccl pair: a host of its own to
// NCCL (which refuses two ranks of one group on one GPU), the two joined
// over NCCL's socket transport on loopback, NVLink multicast off. Before
// any NCCL call.
void BecomeNcclRank(int rank) {
  setenv("NCCL_HOSTID", ("deltasync-bench-rank" + std::to_string(rank)).c_str(), 1);
  setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
}

CommunicatorOptions NcclPairOptions(const std::string& dir, int rank, const std::string& group) {
  CommunicatorOptions o;
  o.rank = rank;
  o.size = 2;
  o.rendezvous.kind = Rendezvous::Kind::kFile;
  o.rendezvous.path = dir;
  o.group = group;
  o.timeout = std::chrono::seconds(300);
  o.connect_timeout = std::chrono::seconds(120);
  o.hostname = "127.0.0.1";
  return o;
}

// Median seconds of `repeat` syncs over nccl after a seeding one,
// alternating the device tensor between `a` and `b`, to a receiver process
// (bench-gpu-nccl-peer) holding it in device memory on the same GPU; with
// `device_frames` false both ends keep their frames in host memory.
Result<double> TimeNcclSyncs(const GpuBenchConfig& config, uint64_t n, const uint8_t* a,
                             const uint8_t* b, bool device_frames, SizeFigures* f) {
  const std::string self = SelfPath();
  if (self.empty()) return Status::Unavailable("cannot find this executable to start the peer");
  const std::string mode = device_frames ? "device" : "host";
  ScratchDir dir{(std::filesystem::temp_directory_path() /
                  ("deltasync-bench-nccl-" + std::to_string(::getpid()) + "-" + mode))
                     .string()};
  std::filesystem::remove_all(dir.path);
  std::filesystem::create_directories(dir.path);
  const int syncs = config.repeat + 1;
  BecomeNcclRank(0);
  Child peer;
  DS_RETURN_IF_ERROR(
      peer.Start({self, "bench-gpu-nccl-peer", "--dir", dir.path, "--elements", std::to_string(n),
                  "--syncs", std::to_string(syncs), "--device-frames", device_frames ? "1" : "0"},
                 dir.path + "/peer"));
  const CommunicatorOptions o = NcclPairOptions(dir.path, 0, "bench-" + mode);
  SenderOptions so;
  so.device_frames = device_frames;
  DS_ASSIGN_OR_RETURN(std::unique_ptr<StreamSender> sender,
                      StreamSender::Create([o] { return CreateCommunicator("nccl", o); }, so));
  const std::vector<int64_t> shape = {static_cast<int64_t>(n)};
  std::vector<double> times;
  SizeFigures::Phases& phases = f->nccl_phases[device_frames ? 0 : 1];
  phases = {};
  for (int i = 0; i < syncs; ++i) {
    const SyncTensor t{"w", DType::kBF16, shape, {i % 2 == 0 ? a : b, n * 2}, Placement::Cuda(0)};
    const auto t0 = Clock::now();
    DS_ASSIGN_OR_RETURN(SyncStats r, sender->Sync({&t, 1}));
    if (i > 0) {
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      f->nccl_frames = r.frames;
      if (device_frames) f->nccl_device_frames = r.device_frames;
      phases.diff_s += r.diff_s / config.repeat;
      phases.encode_s += r.encode_s / config.repeat;
      phases.transfer_s += r.transfer_s / config.repeat;
      phases.report_s += r.report_s / config.repeat;
    }
  }
  sender.reset();
  DS_ASSIGN_OR_RETURN(nlohmann::json report, peer.Wait());
  if (device_frames && report.value("device_frames", uint64_t{0}) == 0) {
    return Status::Internal("the receiver took no frame into device memory");
  }
  phases.receive_s = report.value("receive_s", 0.0);
  phases.apply_s = report.value("apply_s", 0.0);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median seconds of `repeat` syncs after a seeding one, alternating the
// tensor between `a` and `b` (each sync finds a step's changes), with the
// receiver holding `dest`; both ends in `place`.
Result<double> TimeSyncs(const GpuBenchConfig& config, uint64_t n, const uint8_t* a,
                         const uint8_t* b, uint8_t* dest, Placement place, uint64_t* bytes_sent) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("deltasync-bench-gpu-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  CommunicatorOptions o;
  o.size = 2;
  o.rendezvous.kind = Rendezvous::Kind::kFile;
  o.rendezvous.path = dir.string();
  o.group = place.on_device() ? "device" : "host";
  o.timeout = std::chrono::seconds(300);
  o.hostname = "127.0.0.1";
  CommunicatorOptions ro = o;
  ro.rank = 1;
  const std::vector<int64_t> shape = {static_cast<int64_t>(n)};
  DS_ASSIGN_OR_RETURN(std::unique_ptr<StreamReceiver> receiver,
                      StreamReceiver::Create([ro] { return CreateCommunicator("gloo", ro); }));
  DS_RETURN_IF_ERROR(receiver->Register("w", DType::kBF16, shape, {dest, n * 2}, {}, place));
  DS_ASSIGN_OR_RETURN(std::unique_ptr<StreamSender> sender,
                      StreamSender::Create([o] { return CreateCommunicator("gloo", o); }));
  const int syncs = config.repeat + 1;
  Status received;
  std::thread rx([&] {
    for (int i = 0; i < syncs && received.ok(); ++i) received = receiver->ReceiveSync().status();
  });
  std::vector<double> times;
  Status sent;
  for (int i = 0; i < syncs && sent.ok(); ++i) {
    const SyncTensor t{"w", DType::kBF16, shape, {i % 2 == 0 ? a : b, n * 2}, place};
    const auto t0 = Clock::now();
    Result<SyncStats> r = sender->Sync({&t, 1});
    if (!r.ok()) {
      sent = r.status();
      break;
    }
    if (i > 0) {
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      *bytes_sent = r->bytes_sent;
    }
  }
  if (!sent.ok()) sender.reset();  // the receiver's calls then fail
  rx.join();
  std::filesystem::remove_all(dir);
  DS_RETURN_IF_ERROR(sent);
  DS_RETURN_IF_ERROR(received);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The stream rows of `f`, from the step `a` -> `b` on the host and on the
// device.
Status MeasureStream(const GpuBenchConfig& config, const std::vector<uint16_t>& a,
                     const std::vector<uint16_t>& b, const cuda::Buffer& dev_a,
                     const cuda::Buffer& dev_b, SizeFigures* f) {
  const uint64_t n = a.size();
  {
    DS_ASSIGN_OR_RETURN(cuda::Buffer dest, cuda::Buffer::Device(f->bytes));
    DS_ASSIGN_OR_RETURN(
        f->sync_device_s,
        TimeSyncs(config, n, static_cast<const uint8_t*>(dev_a.data()),
                  static_cast<const uint8_t*>(dev_b.data()), static_cast<uint8_t*>(dest.data()),
                  Placement::Cuda(0), &f->sync_bytes_sent));
  }
  std::vector<uint8_t> dest(f->bytes);
  uint64_t host_sent = 0;
  DS_ASSIGN_OR_RETURN(
      f->sync_host_s,
      TimeSyncs(config, n, reinterpret_cast<const uint8_t*>(a.data()),
                reinterpret_cast<const uint8_t*>(b.data()), dest.data(), {}, &host_sent));
  bool ok = true;
  f->to_host_s = Median(
      config.repeat,
      [&] {
        return cudaMemcpy(dest.data(), dev_a.data(), f->bytes, cudaMemcpyDeviceToHost) ==
               cudaSuccess;
      },
      &ok);
  f->to_device_s = Median(
      config.repeat,
      [&] {
        return cudaMemcpy(dev_a.data(), a.data(), f->bytes, cudaMemcpyHostToDevice) == cudaSuccess;
      },
      &ok);
  if (!ok) return Status::Internal("a CUDA copy failed during the stream benchmark");
  f->have_stream = true;
  if (!config.nccl) return Status::OK();
  const std::vector<std::string_view> built = BuiltCommunicators();
  if (std::find(built.begin(), built.end(), "nccl") == built.end()) {
    f->nccl_error = "this build has no nccl communicator";
    return Status::OK();
  }
  const auto* da = static_cast<const uint8_t*>(dev_a.data());
  const auto* db = static_cast<const uint8_t*>(dev_b.data());
  Result<double> on_device = TimeNcclSyncs(config, n, da, db, true, f);
  Result<double> on_host =
      on_device.ok() ? TimeNcclSyncs(config, n, da, db, false, f) : on_device.status();
  if (!on_host.ok()) {
    f->nccl_error = on_host.status().ToString();
    return Status::OK();
  }
  f->nccl_device_frames_s = *on_device;
  f->nccl_host_frames_s = *on_host;
  f->have_nccl = true;
  return Status::OK();
}

Result<nlohmann::json> RunTorchBaseline(const GpuBenchConfig& config, uint64_t bytes) {
  std::string script = config.baseline_script.empty()
                           ? std::string(DS_SOURCE_DIR) + "/bench/gpu_torch_baseline.py"
                           : config.baseline_script;
  const std::string cmd = config.python + " " + script + " --bytes " + std::to_string(bytes) +
                          " --density " + std::to_string(config.density) + " --repeat " +
                          std::to_string(config.repeat) + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return Status::IOError("cannot run " + cmd);
  std::string output;
  char buf[4096];
  while (size_t got = fread(buf, 1, sizeof buf, pipe)) output.append(buf, got);
  const int rc = pclose(pipe);
  const size_t brace = output.rfind("\n{");
  const std::string last = brace == std::string::npos ? output : output.substr(brace + 1);
  if (rc != 0 || last.empty() || last[0] != '{') {
    return Status::Unavailable("torch baseline failed (" + cmd + "): " +
                               output.substr(output.size() > 400 ? output.size() - 400 : 0));
  }
  try {
    return nlohmann::json::parse(last);
  } catch (const std::exception& e) {
    return Status::Corruption(std::string("torch baseline printed no JSON: ") + e.what());
  }
}

// 48 layers x 128 experts x 3 projections (Qwen3-30B-A3B's expert tensors),
// scaled to `n` elements; `density` of each tensor's elements changed at
// spread positions. Times the batched scatter of all of them against the
// same changes in one tensor and against a launch per tensor.
Status MeasureBatchedApply(const GpuBenchConfig& config, uint64_t n, void* dest, SizeFigures* f) {
  const uint64_t experts = 48 * 128 * 3;
  const uint64_t m = n / experts;
  const uint64_t step = std::max<uint64_t>(1, static_cast<uint64_t>(1.0 / config.density + 0.5));
  const uint64_t per = m / step;
  const uint64_t count = per * experts;
  if (per == 0) return Status::InvalidArgument("too few elements for the expert layout");
  // Positions within each tensor (relative) and in the whole (absolute).
  // Absolute positions in 4 bytes where they fit the kernel's int32.
  const uint32_t aw = m * experts < (uint64_t{1} << 31) ? 4 : 8;
  std::vector<uint32_t> rel(count);
  std::vector<uint8_t> abs(count * aw);
  std::vector<uint16_t> values(count);
  for (uint64_t e = 0; e < experts; ++e) {
    for (uint64_t j = 0; j < per; ++j) {
      const uint64_t r = SplitMix(config.seed * 7919 + e * per + j);
      const uint64_t p = j * step + r % step;
      rel[e * per + j] = static_cast<uint32_t>(p);
      const uint64_t q = e * m + p;
      std::memcpy(&abs[(e * per + j) * aw], &q, aw);  // little-endian
      values[e * per + j] = static_cast<uint16_t>(r >> 32);
    }
  }
  DS_ASSIGN_OR_RETURN(cuda::Buffer d_rel, cuda::Buffer::Device(count * 4));
  DS_ASSIGN_OR_RETURN(cuda::Buffer d_abs, cuda::Buffer::Device(count * aw));
  DS_ASSIGN_OR_RETURN(cuda::Buffer d_val, cuda::Buffer::Device(count * 2));
  std::vector<cuda::DeviceRun> runs = {{0, m, 0}, {0, m * experts, 0}};
  DS_ASSIGN_OR_RETURN(cuda::Buffer d_runs, cuda::Buffer::Device(runs.size() * sizeof(runs[0])));
  if (cudaMemcpy(d_rel.data(), rel.data(), count * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(d_abs.data(), abs.data(), count * aw, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(d_val.data(), values.data(), count * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(d_runs.data(), runs.data(), runs.size() * sizeof(runs[0]),
                 cudaMemcpyHostToDevice) != cudaSuccess) {
    return Status::Internal("copying the expert changes to the device failed");
  }
  const auto* run = static_cast<const cuda::DeviceRun*>(d_runs.data());
  auto* out = static_cast<uint8_t*>(dest);
  std::vector<cuda::ScatterItem> many(experts), one(1);
  for (uint64_t e = 0; e < experts; ++e) {
    cuda::ScatterItem& it = many[e];
    it.dest = out + e * m * 2;
    it.dest_numel = m;
    it.elem_size = 2;
    it.changes = {static_cast<uint8_t*>(d_rel.data()) + e * per * 4, 4,
                  static_cast<uint8_t*>(d_val.data()) + e * per * 2, per};
    it.runs = run;
    it.run_count = 1;
  }
  one[0] = {dest, m * experts, 2, {d_abs.data(), aw, d_val.data(), count}, 0, run + 1, 1};
  DS_ASSIGN_OR_RETURN(cuda::Buffer scratch, cuda::Buffer::Device(cuda::ScatterBatchBytes(experts)));
  Status first_error;
  bool ok = true;
  const auto note = [&](const Status& s) {
    if (!s.ok() && first_error.ok()) first_error = s;
    return s.ok();
  };
  f->experts = experts;
  f->batch_changed = count;
  f->batch_one_s = Median(
      config.repeat,
      [&] { return note(cuda::ScatterBatchOnDevice("one", 0, one, scratch.data(), nullptr)); },
      &ok);
  f->batch_many_s = Median(
      config.repeat,
      [&] { return note(cuda::ScatterBatchOnDevice("experts", 0, many, scratch.data(), nullptr)); },
      &ok);
  f->launch_each_s = Median(
      config.repeat,
      [&] {
        for (const cuda::ScatterItem& it : many) {
          cuda::DeviceTensor t{"expert", DType::kBF16, {static_cast<int64_t>(m)},
                               it.dest,  nullptr,      {}};
          if (!note(cuda::ScatterRunsOnDevice(t, it.changes, it.runs, 1))) return false;
        }
        return true;
      },
      &ok);
  if (!first_error.ok()) return first_error;
  if (!ok) return Status::Internal("a CUDA call failed during the batched apply");
  return Status::OK();
}

// A finite BF16 weight (magnitudes over about 11 binades, 1 in 64 a zero
// or subnormal) into `a`, and in `b` the same with a `density` fraction of
// elements nudged by a few ULPs, as an optimizer step moves them.
void MakeWeightStep(uint64_t n, double density, uint64_t seed, std::vector<uint16_t>& a,
                    std::vector<uint16_t>& b) {
  a.resize(n);
  b.resize(n);
  const uint64_t threshold = static_cast<uint64_t>(density * 18446744073709551615.0);
  FillInParallel(n, [&](uint64_t i) {
    const uint64_t r = SplitMix(seed * 0x9E3779B97F4A7C15ull + i);
    const uint32_t e = r % 64 == 0 ? 0 : 118 + static_cast<uint32_t>((r >> 8) % 11);
    a[i] = static_cast<uint16_t>(((r >> 20) & 0x8000u) | e << 7 | ((r >> 32) & 0x7Fu));
    const uint64_t pick = SplitMix(r);
    b[i] = pick < threshold ? static_cast<uint16_t>(a[i] ^ (1 + (r >> 48) % 3)) : a[i];
  });
}

// The fused quantize-then-diff of a weight step in dev_a / dev_b (their
// bytes are overwritten), each run against the codes the run before left.
Status MeasureQuantizeDiff(cuda::Workspace& ws, const GpuBenchConfig& config, uint64_t n,
                           cuda::Buffer& dev_a, cuda::Buffer& dev_b, cuda::Buffer& positions,
                           cuda::Buffer& values, SizeFigures* f) {
  constexpr int64_t kCols = 4096;
  const int64_t rows = static_cast<int64_t>(n) / kCols;
  if (rows == 0) return Status::OK();
  const uint64_t m = static_cast<uint64_t>(rows * kCols);
  std::vector<uint16_t> a, b;
  MakeWeightStep(m, config.density, config.seed, a, b);
  if (cudaMemcpy(dev_a.data(), a.data(), m * 2, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(dev_b.data(), b.data(), m * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
    return Status::Internal("copying the weights to the device failed");
  }
  const QuantRecipe recipe{QuantScheme::kBlock128, ScaleFormat::kUe8m0};
  DS_ASSIGN_OR_RETURN(const std::vector<int64_t> scale_shape, QuantScaleShape(recipe, rows, kCols));
  const uint64_t groups = static_cast<uint64_t>(scale_shape[0] * scale_shape[1]);
  DS_ASSIGN_OR_RETURN(cuda::Buffer codes, cuda::Buffer::Device(m));
  DS_ASSIGN_OR_RETURN(cuda::Buffer scales, cuda::Buffer::Device(groups));
  DS_ASSIGN_OR_RETURN(cuda::Buffer scale_positions, cuda::Buffer::Device(groups * 4));
  DS_ASSIGN_OR_RETURN(cuda::Buffer scale_values, cuda::Buffer::Device(groups));
  const std::vector<int64_t> shape = {rows, kCols};
  cuda::DeviceTensor weight[2] = {{"a", DType::kBF16, shape, dev_a.data(), nullptr, {}},
                                  {"b", DType::kBF16, shape, dev_b.data(), nullptr, {}}};
  cuda::DeviceTensor codes_t{"a", DType::kF8_E4M3, shape, codes.data(), nullptr, {}};
  cuda::DeviceTensor scales_t{"a", DType::kF8_E8M0, scale_shape, scales.data(), nullptr, {}};
  const cuda::DiffOutput code_out{positions.data(), values.data(), nullptr, m};
  const cuda::DiffOutput scale_out{scale_positions.data(), scale_values.data(), nullptr, groups};
  // The first quantization of a, into zeroed snapshots.
  cudaMemset(codes.data(), 0, m);
  cudaMemset(scales.data(), 0, groups);
  DS_RETURN_IF_ERROR(
      cuda::QuantizeDiffOnDevice(ws, recipe, weight[0], codes_t, scales_t, code_out, scale_out)
          .status());
  Status first_error;
  bool ok = true;
  int k = 1;
  f->quant_diff_s = Median(
      config.repeat,
      [&] {
        auto r = cuda::QuantizeDiffOnDevice(ws, recipe, weight[k], codes_t, scales_t, code_out,
                                            scale_out);
        k ^= 1;
        if (r.ok()) {
          f->quant_changed = r->codes.count;
          f->quant_scales_changed = r->scales.count;
        } else if (first_error.ok()) {
          first_error = r.status();
        }
        return r.ok();
      },
      &ok);
  if (!first_error.ok()) return first_error;
  return ok ? Status::OK() : Status::Internal("a CUDA call failed during the quantize-then-diff");
}

Result<SizeFigures> MeasureSize(cuda::Workspace& ws, const GpuBenchConfig& config, uint64_t bytes) {
  SizeFigures f;
  const uint64_t n = bytes / 2;
  f.bytes = n * 2;
  std::vector<uint16_t> a, b;
  MakeStep(n, config.density, config.seed, a, b);
  DS_ASSIGN_OR_RETURN(cuda::Buffer dev_a, cuda::Buffer::Device(f.bytes));
  DS_ASSIGN_OR_RETURN(cuda::Buffer dev_b, cuda::Buffer::Device(f.bytes));
  DS_ASSIGN_OR_RETURN(cuda::Buffer snap, cuda::Buffer::Device(f.bytes));
  DS_ASSIGN_OR_RETURN(cuda::Buffer dest, cuda::Buffer::Device(f.bytes));
  DS_ASSIGN_OR_RETURN(cuda::Buffer positions, cuda::Buffer::Device(n * 4));
  DS_ASSIGN_OR_RETURN(cuda::Buffer values, cuda::Buffer::Device(f.bytes));
  cudaMemcpy(dev_a.data(), a.data(), f.bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dev_b.data(), b.data(), f.bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(snap.data(), a.data(), f.bytes, cudaMemcpyHostToDevice);
  if (config.stream) {
    Status s = MeasureStream(config, a, b, dev_a, dev_b, &f);
    if (!s.ok()) f.stream_error = s.ToString();
  }
  a.clear();
  a.shrink_to_fit();
  b.clear();
  b.shrink_to_fit();

  const std::vector<int64_t> shape = {static_cast<int64_t>(n)};
  cuda::DeviceTensor cur[2] = {{"a", DType::kBF16, shape, dev_a.data(), nullptr, {}},
                               {"b", DType::kBF16, shape, dev_b.data(), nullptr, {}}};
  cuda::DeviceTensor snap_t{"snapshot", DType::kBF16, shape, snap.data(), nullptr, {}};
  cuda::DiffOutput out{positions.data(), values.data(), nullptr, n};
  bool ok = true;
  Status first_error;
  auto note = [&](const Status& s) {
    if (!s.ok() && first_error.ok()) first_error = s;
    return s.ok();
  };

  f.copy_s = Median(
      config.repeat,
      [&] {
        return cudaMemcpyAsync(dest.data(), dev_a.data(), f.bytes, cudaMemcpyDeviceToDevice) ==
               cudaSuccess;
      },
      &ok);

  // Each run diffs the other tensor against the snapshot the run before
  // left: every run finds the step's changes.
  int k = 1;
  f.diff_device_s = Median(
      config.repeat,
      [&] {
        auto r = cuda::DiffOnDevice(ws, cur[k], snap_t, out);
        k ^= 1;
        if (r.ok()) f.changed = r->count;
        return note(r.status());
      },
      &ok);

  {
    DS_ASSIGN_OR_RETURN(cuda::Buffer pinned, cuda::Buffer::PinnedHost(f.bytes));
    cudaMemcpy(pinned.data(), cur[k ^ 1].data, f.bytes, cudaMemcpyDeviceToHost);
    cuda::DeviceTensor pinned_t{"snapshot", DType::kBF16, shape, pinned.data(), nullptr, {}};
    f.diff_pinned_s = Median(
        config.repeat,
        [&] {
          auto r = cuda::DiffOnDevice(ws, cur[k], pinned_t, out);
          k ^= 1;
          return note(r.status());
        },
        &ok);
    // Where the time goes: the same without writing the snapshot back.
    cuda::DiffOutput no_refresh = out;
    no_refresh.refresh_snapshot = false;
    f.diff_pinned_no_refresh_s = Median(
        config.repeat,
        [&] { return note(cuda::DiffOnDevice(ws, cur[k], pinned_t, no_refresh).status()); }, &ok);
    f.pcie_read_s = Median(
        config.repeat,
        [&] {
          return cudaMemcpyAsync(dest.data(), pinned.data(), f.bytes, cudaMemcpyHostToDevice) ==
                 cudaSuccess;
        },
        &ok);
  }

  // The read-only floor of the fused diff: identical tensors, nothing to
  // write.
  cudaMemcpy(snap.data(), dev_a.data(), f.bytes, cudaMemcpyDeviceToDevice);
  f.diff_identical_s = Median(
      config.repeat, [&] { return note(cuda::DiffOnDevice(ws, cur[0], snap_t, out).status()); },
      &ok);

  // One more diff, of b against a, and its changes applied to a copy of a.
  cudaMemcpy(snap.data(), dev_a.data(), f.bytes, cudaMemcpyDeviceToDevice);
  k = 1;
  auto last = cuda::DiffOnDevice(ws, cur[k], snap_t, out);
  if (!last.ok()) return last.status();
  f.changed = last->count;
  cudaMemcpy(dest.data(), cur[k ^ 1].data, f.bytes, cudaMemcpyDeviceToDevice);
  cuda::DeviceTensor dest_t{"dest", DType::kBF16, shape, dest.data(), nullptr, {}};
  const cuda::DeviceChanges changes{positions.data(), last->wide ? 8u : 4u, values.data(),
                                    last->count};
  f.scatter_s = Median(
      config.repeat, [&] { return note(cuda::ScatterOnDevice(ws, dest_t, changes)); }, &ok);
  DS_RETURN_IF_ERROR(MeasureBatchedApply(config, n, dest.data(), &f));
  f.digest_s = Median(
      config.repeat, [&] { return note(cuda::StateDigestOnDevice(ws, cur[0]).status()); }, &ok);
  const cuda::DeviceTensor as_f32{"a",          DType::kF32, {static_cast<int64_t>(n / 2)},
                                  dev_a.data(), nullptr,     {}};
  f.digest_f32_s = Median(
      config.repeat, [&] { return note(cuda::StateDigestOnDevice(ws, as_f32).status()); }, &ok);
  f.xxh3_s = Median(
      config.repeat,
      [&] {
        return note(cuda::Xxh3_128OnDevice(ws, "a", dev_a.data(), f.bytes, nullptr).status());
      },
      &ok);
  if (!first_error.ok()) return first_error;
  if (!ok) return Status::Internal("a CUDA copy failed during the benchmark");
  DS_RETURN_IF_ERROR(MeasureQuantizeDiff(ws, config, n, dev_a, dev_b, positions, values, &f));
  return f;
}

std::string Ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", s * 1e3);
  return buf;
}

std::string Ratio(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", x);
  return buf;
}

std::string Rate(uint64_t bytes, double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f GB/s", bytes / s / 1e9);
  return buf;
}

}  // namespace

int RunGpuBench(const GpuBenchConfig& config, bool json) {
  if (cuda::DeviceCount() == 0) return Fail("bench --gpu: no CUDA device");
  auto ws = cuda::Workspace::Create(0);
  if (!ws.ok()) return Fail(ws.status());
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::vector<SizeFigures> all;
  for (uint64_t bytes : config.sizes) {
    auto f = MeasureSize(**ws, config, bytes);
    if (!f.ok()) return Fail(f.status());
    if (!config.python.empty()) {
      auto t = RunTorchBaseline(config, f->bytes);
      if (t.ok()) {
        f->have_torch = true;
        f->torch_device_s = (*t)["torch_diff_device_s"];
        f->torch_pinned_s = (*t)["torch_diff_pinned_s"];
        f->torch_index_put_s = (*t)["torch_index_put_s"];
        f->torch_copy_s = (*t)["torch_copy_s"];
        f->torch_quant_diff_s = (*t)["torch_quant_diff_s"];
      } else {
        f->torch_error = t.status().message();
      }
    }
    all.push_back(*f);
  }
  if (json) {
    nlohmann::json j;
    j["device"] = prop.name;
    j["density"] = config.density;
    j["repeat"] = config.repeat;
    for (const auto& f : all) {
      nlohmann::json s = {{"bytes", f.bytes},
                          {"changed", f.changed},
                          {"copy_s", f.copy_s},
                          {"pcie_read_s", f.pcie_read_s},
                          {"diff_device_s", f.diff_device_s},
                          {"diff_pinned_s", f.diff_pinned_s},
                          {"diff_identical_s", f.diff_identical_s},
                          {"diff_pinned_no_refresh_s", f.diff_pinned_no_refresh_s},
                          {"scatter_s", f.scatter_s},
                          {"digest_s", f.digest_s},
                          {"digest_f32_s", f.digest_f32_s},
                          {"xxh3_s", f.xxh3_s},
                          {"experts", f.experts},
                          {"batch_changed", f.batch_changed},
                          {"batch_one_s", f.batch_one_s},
                          {"batch_many_s", f.batch_many_s},
                          {"launch_each_s", f.launch_each_s},
                          {"quant_diff_s", f.quant_diff_s},
                          {"quant_changed", f.quant_changed},
                          {"quant_scales_changed", f.quant_scales_changed}};
      if (f.have_stream) {
        s["sync_device_s"] = f.sync_device_s;
        s["sync_host_s"] = f.sync_host_s;
        s["to_host_s"] = f.to_host_s;
        s["to_device_s"] = f.to_device_s;
        s["sync_bytes_sent"] = f.sync_bytes_sent;
      } else if (!f.stream_error.empty()) {
        s["stream_error"] = f.stream_error;
      }
      if (f.have_nccl) {
        s["nccl_device_frames_s"] = f.nccl_device_frames_s;
        s["nccl_host_frames_s"] = f.nccl_host_frames_s;
        s["nccl_frames"] = f.nccl_frames;
        s["nccl_device_frames"] = f.nccl_device_frames;
        for (int k = 0; k < 2; ++k) {
          const SizeFigures::Phases& p = f.nccl_phases[k];
          s[k == 0 ? "nccl_device_frames_phases" : "nccl_host_frames_phases"] = {
              {"diff_s", p.diff_s},     {"encode_s", p.encode_s},   {"transfer_s", p.transfer_s},
              {"report_s", p.report_s}, {"receive_s", p.receive_s}, {"apply_s", p.apply_s}};
        }
      } else if (!f.nccl_error.empty()) {
        s["nccl_error"] = f.nccl_error;
      }
      if (f.have_torch) {
        s["torch_diff_device_s"] = f.torch_device_s;
        s["torch_diff_pinned_s"] = f.torch_pinned_s;
        s["torch_index_put_s"] = f.torch_index_put_s;
        s["torch_copy_s"] = f.torch_copy_s;
        s["torch_quant_diff_s"] = f.torch_quant_diff_s;
      } else if (!f.torch_error.empty()) {
        s["torch_error"] = f.torch_error;
      }
      j["sizes"].push_back(s);
    }
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "deltasync bench --gpu on " << prop.name << ": BF16, " << config.density * 100
            << "% of elements changed, median of " << config.repeat << " runs\n";
  for (const auto& f : all) {
    std::cout << "\n" << FormatBytes(f.bytes) << ", " << f.changed << " changed elements\n";
    std::printf("  %-44s %10s  %-22s\n", "what", "ms", "against");
    auto row = [](const std::string& what, double s, const std::string& against) {
      std::printf("  %-44s %10s  %-22s\n", what.c_str(), Ms(s).c_str(), against.c_str());
    };
    row("device copy (read + write " + FormatBytes(f.bytes) + ")", f.copy_s,
        Rate(2 * f.bytes, f.copy_s));
    row("PCIe read of the snapshot (pinned -> device)", f.pcie_read_s,
        Rate(f.bytes, f.pcie_read_s));
    row("fused diff, snapshot on the device", f.diff_device_s,
        Ratio(f.diff_device_s / f.copy_s) + " of the copy");
    row("fused diff, snapshot in pinned host memory", f.diff_pinned_s,
        Ratio(f.diff_pinned_s / f.pcie_read_s) + " of the PCIe read");
    row("  the same, identical tensors (no writes)", f.diff_identical_s,
        Ratio(f.diff_identical_s / f.copy_s) + " of the copy");
    row("  pinned, without the snapshot write-back", f.diff_pinned_no_refresh_s,
        Ratio(f.diff_pinned_no_refresh_s / f.pcie_read_s) + " of the PCIe read");
    row("scatter of the changes", f.scatter_s, "");
    row("batched apply, " + std::to_string(f.batch_changed) + " changes in 1 tensor", f.batch_one_s,
        "");
    row("  the same in " + std::to_string(f.experts) + " expert tensors", f.batch_many_s,
        Ratio(f.batch_many_s / f.batch_one_s) + " of 1 tensor");
    row("  a launch per expert tensor", f.launch_each_s,
        Ratio(f.launch_each_s / f.batch_one_s) + " of 1 tensor");
    row("quantize-then-diff to FP8 (block128, ue8m0)", f.quant_diff_s,
        Ratio(f.quant_diff_s / f.copy_s) + " of the copy");
    std::printf("    %llu codes and %llu scales changed\n",
                static_cast<unsigned long long>(f.quant_changed),
                static_cast<unsigned long long>(f.quant_scales_changed));
    row("state digest (BF16 elements)", f.digest_s, Rate(f.bytes, f.digest_s));
    row("state digest (the same bytes as F32)", f.digest_f32_s, Rate(f.bytes, f.digest_f32_s));
    row("xxh3-128", f.xxh3_s, Rate(f.bytes, f.xxh3_s));
    if (f.have_torch) {
      row("torch: diff ops, snapshot on the device", f.torch_device_s,
          Ratio(f.torch_device_s / f.diff_device_s) + " of the fused diff");
      row("torch: the same, snapshot in pinned memory", f.torch_pinned_s,
          "fused: " + Ratio(f.diff_pinned_s / f.torch_pinned_s) + " of it");
      row("torch: index_put_ of the changes", f.torch_index_put_s,
          "scatter: " + Ratio(f.scatter_s / f.torch_index_put_s) + " of it");
      row("torch: copy_", f.torch_copy_s, Rate(2 * f.bytes, f.torch_copy_s));
      row("torch: quantize to FP8, then diff ops", f.torch_quant_diff_s,
          Ratio(f.torch_quant_diff_s / f.quant_diff_s) + " of the fused pass");
    } else if (!f.torch_error.empty()) {
      std::cout << "  torch baseline skipped: " << f.torch_error << "\n";
    }
    if (f.have_stream) {
      const double host_path = f.to_host_s + f.sync_host_s + f.to_device_s;
      row("stream sync, device tensors at both ends", f.sync_device_s,
          FormatBytes(f.sync_bytes_sent) + " sent");
      row("stream sync, host tensors at both ends", f.sync_host_s,
          "device: " + Ratio(f.sync_device_s / f.sync_host_s) + " of it");
      row("  + copies device -> host -> device", host_path,
          "device: " + Ratio(f.sync_device_s / host_path) + " of it");
    } else if (!f.stream_error.empty()) {
      std::cout << "  stream rows skipped: " << f.stream_error << "\n";
    }
    if (f.have_nccl) {
      row("stream sync over nccl, frames on the device", f.nccl_device_frames_s,
          std::to_string(f.nccl_device_frames) + " of " + std::to_string(f.nccl_frames) +
              " frames");
      row("  frames through host memory", f.nccl_host_frames_s,
          "device: " + Ratio(f.nccl_device_frames_s / f.nccl_host_frames_s) + " of it");
      for (int k = 0; k < 2; ++k) {
        const SizeFigures::Phases& p = f.nccl_phases[k];
        std::printf(
            "    %s: sender diff %s / encode %s / transfer %s / report %s ms, receiver "
            "receive %s / apply %s ms\n",
            k == 0 ? "device frames" : "host frames", Ms(p.diff_s).c_str(), Ms(p.encode_s).c_str(),
            Ms(p.transfer_s).c_str(), Ms(p.report_s).c_str(), Ms(p.receive_s).c_str(),
            Ms(p.apply_s).c_str());
      }
    } else if (!f.nccl_error.empty()) {
      std::cout << "  nccl rows skipped: " << f.nccl_error << "\n";
    }
  }
  if (config.nccl) {
    std::cout << "\nnccl rows: a receiver process on the same GPU, the two ranks joined over "
                 "NCCL's socket transport on loopback (NCCL takes one GPU per rank only across "
                 "hosts): the link is a TCP loopback, not NVLink.\n";
  }
  return 0;
}

int RunGpuNcclPeer(const std::vector<std::string>& args) {
  std::map<std::string, std::string> a;
  for (size_t i = 0; i + 1 < args.size(); i += 2) a[args[i]] = args[i + 1];
  for (const char* k : {"--dir", "--elements", "--syncs", "--device-frames"}) {
    if (!a.count(k)) return Fail(std::string("bench-gpu-nccl-peer: missing ") + k);
  }
  BecomeNcclRank(1);
  const bool device_frames = a["--device-frames"] == "1";
  const uint64_t n = std::strtoull(a["--elements"].c_str(), nullptr, 10);
  const int syncs = std::atoi(a["--syncs"].c_str());
  const CommunicatorOptions o =
      NcclPairOptions(a["--dir"], 1, std::string("bench-") + (device_frames ? "device" : "host"));
  ReceiverOptions ro;
  ro.device_frames = device_frames;
  Result<std::unique_ptr<StreamReceiver> > r =
      StreamReceiver::Create([o] { return CreateCommunicator("nccl", o); }, ro);
  if (!r.ok()) return Fail(r.status());
  Result<cuda::Buffer> dest = cuda::Buffer::Device(n * 2);
  if (!dest.ok()) return Fail(dest.status());
  Status s = (*r)->Register("w", DType::kBF16, {static_cast<int64_t>(n)},
                            {static_cast<uint8_t*>(dest->data()), n * 2}, {}, Placement::Cuda(0));
  if (!s.ok()) return Fail(s);
  uint64_t frames = 0, on_device = 0;
  double receive_s = 0, apply_s = 0;  // means over the syncs after the seed
  for (int k = 0; k < syncs; ++k) {
    Result<ReceiveStats> got = (*r)->ReceiveSync();
    if (!got.ok()) return Fail(got.status());
    frames += got->frames;
    on_device += got->device_frames;
    if (k > 0 && syncs > 1) {
      receive_s += (got->wait_s + got->receive_s) / (syncs - 1);
      apply_s += got->apply_s / (syncs - 1);
    }
  }
  nlohmann::json out = {{"frames", frames},
                        {"device_frames", on_device},
                        {"receive_s", receive_s},
                        {"apply_s", apply_s}};
  std::cout << out.dump() << "\n";
  return 0;
}

#endif

}  // namespace deltasync::cli
