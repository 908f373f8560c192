// Shared by the nccl tests (nccl_communicator_test.cc, stream_nccl_test.cc)
// and their peer process (stream_nccl_peer.cc).
//
// NCCL refuses two ranks of one group on one GPU of one host ("Duplicate
// GPU detected"). The tests run each rank in its own process with its own
// NCCL_HOSTID, which makes NCCL take the two processes for two hosts and
// join them over its socket transport: a real two-rank NCCL group on a
// one-GPU machine (test-only; the bytes then travel through host memory,
// so nothing here measures a GPU link).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/communicator_test_util.h"
#include "deltasync/communicator.h"
#include "deltasync/stream.h"
#include "stream/sync_test_util.h"

namespace deltasync::nccl_pair {

// More than one of the communicator's 64 MiB calls, and not a multiple of
// anything.
inline constexpr size_t kBigBytes = (size_t{64} << 20) + 12345;
inline constexpr size_t kBroadcastBytes = (size_t{1} << 20) + 5;
inline constexpr size_t kRecordBytes = 100;

// Whether this machine has a CUDA device (clearing the error when not).
inline bool HaveGpu() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

// This process as rank `rank` of a pair: its own NCCL host id, NCCL's
// sockets on loopback, NVLink multicast off. Before any NCCL call.
inline void BecomeRank(int rank) {
  setenv("NCCL_HOSTID", ("deltasync-test-rank" + std::to_string(rank)).c_str(), 1);
  setenv("NCCL_SOCKET_IFNAME", "lo", 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
}

inline CommunicatorOptions PairOptions(const std::string& dir, int rank,
                                       std::chrono::milliseconds timeout,
                                       std::string group = "pair") {
  return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir), rank, 2, timeout,
                                    std::move(group));
}

// Device memory of `n` bytes (at least 1), freed at the end.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t n) : n_(n) {
    if (cudaMalloc(&ptr_, n == 0 ? 1 : n) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBytes() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  bool ok() const { return ptr_ != nullptr; }
  std::span<uint8_t> span() { return {static_cast<uint8_t*>(ptr_), n_}; }
  bool Upload(const std::vector<uint8_t>& v) {
    return v.size() == n_ && cudaMemcpy(ptr_, v.data(), n_, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> v(n_);
    if (n_ != 0 && cudaMemcpy(v.data(), ptr_, n_, cudaMemcpyDeviceToHost) != cudaSuccess) {
      v.clear();
    }
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

// The model of the tests whose every tensor lives on the device: larger
// than their 64 KiB bucket, so that a sync takes many frames (sent while
// the next fills), with every element width the frames carry.
inline std::vector<sync_test::Model::Spec> DeviceFrameSpecs() {
  return {{"embed.weight", DType::kBF16, {517, 601}},
          {"norm.weight", DType::kF32, {1001}},
          {"mask", DType::kU8, {4099}},
          {"scale", DType::kF64, {333}},
          {"proj.weight", DType::kF16, {7, 513}}};
}

// The stream tests' model; every tensor but "b.bias" lives in device
// memory on both sides.
inline bool OnDevice(const std::string& name) { return name != "b.bias"; }

}  // namespace deltasync::nccl_pair
