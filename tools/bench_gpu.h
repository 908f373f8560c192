// `deltasync bench --gpu`: the CUDA kernels (include/deltasync/cuda.h) on
// BF16 tensors at a synthetic step's change density, side by side in one
// run with a device-to-device copy of the same bytes, one PCIe read of the
// snapshot, and the torch-op pipeline trainers use today (timed by
// bench/gpu_torch_baseline.py in a child process on the same GPU); then
// stream syncs of the same step, device tensors against host ones, and
// over nccl with the frames in device memory against frames through host
// memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deltasync::cli {

struct GpuBenchConfig {
  std::vector<uint64_t> sizes = {uint64_t{1} << 30, uint64_t{8} << 30};  // bytes of BF16
  double density = 0.015;  // fraction of elements changed per step
  int repeat = 10;         // runs per figure; the median is reported
  uint64_t seed = 0;
  std::string python = "python3";  // for the torch baseline; empty: skip it
  std::string baseline_script;     // default: the source tree's bench/gpu_torch_baseline.py
  // Also time stream syncs (gloo on loopback) of each size with the tensor
  // on the device and in host memory.
  bool stream = true;
  // Also time them over nccl, to a receiver process on the same GPU, with
  // the frames in device memory and through host memory.
  bool nccl = true;
};

// Runs the benchmark and prints its table (or one JSON object); the exit
// code. Without CUDA in the build, or without a GPU, an error and 1.
int RunGpuBench(const GpuBenchConfig& config, bool json);
// The receiver process of the nccl rows (hidden subcommand
// bench-gpu-nccl-peer).
int RunGpuNcclPeer(const std::vector<std::string>& args);

}  // namespace deltasync::cli
