// The nccl communicator: CUDA device memory through NCCL.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0), so that
// nothing NCCL does can outlast the deadline: forming polls
// ncclCommGetAsyncError, every operation is enqueued on this
// communicator's stream and then polled (the stream and NCCL's
// asynchronous error) until it completes, fails or runs out of time, and a
// call out of time aborts the communicator (ncclCommAbort), which is what
// frees a rank stuck waiting for a dead peer. NCCL does not say which peer
// failed a collective, so only point-to-point errors name one.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "stream/communicator_internal.h"
#include "stream/communicator_rendezvous.h"

namespace deltasync::stream_internal {

namespace {

// How long a wait sleeps between looks at the stream. An operation of a
// few microseconds then costs at most this much more; an idle spin would
// take a core from the trainer.
constexpr auto kPollInterval = std::chrono::microseconds(50);

std::string NcclText(ncclResult_t r) { return ncclGetErrorString(r); }

std::string CudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const CommunicatorOptions& options, uint64_t generation)
      : options_(options),
        generation_(generation),
        member_(DescribeMember(options.group, generation, options.rank, options.size)) {}

  ~NcclCommunicator() override {
    cudaSetDevice(options_.cuda_device);
    if (comm_ != nullptr) {
      // Finalize flushes what was issued and completes like an operation;
      // a peer that is gone can keep it from completing, hence the bound.
      ncclResult_t state = ncclInternalError;
      if (broken_.ok()) {
        const ncclResult_t r = ncclCommFinalize(comm_);
        if (r == ncclSuccess || r == ncclInProgress) {
          const Deadline deadline(options_.timeout);
          while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
                 !deadline.expired()) {
            std::this_thread::sleep_for(kPollInterval);
          }
        }
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "nccl"; }
  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  uint64_t generation() const override { return generation_; }
  CommunicatorCapabilities capabilities() const override {
    CommunicatorCapabilities c;
    c.device_buffers = true;
    c.point_to_point = true;
    return c;
  }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  Status health() const override { return broken_; }

  // Sets the device, makes the stream, and forms the NCCL communicator
  // with the unique id rank 0 puts in `store`.
  Status Connect(RendezvousStore& store, const Deadline& deadline);

  Status Send(int peer, std::span<const uint8_t> data) override {
    const std::string_view call = "nccl send";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckPeer(call, size(), rank(), peer));
    DS_RETURN_IF_ERROR(CheckDevice(call, "data", data.data(), data.size()));
    if (data.empty()) return Status::OK();
    return Run(call, peer,
               [&] { return ncclSend(data.data(), data.size(), ncclUint8, peer, comm_, stream_); });
  }

  Status Recv(int peer, std::span<uint8_t> data) override {
    const std::string_view call = "nccl recv";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckPeer(call, size(), rank(), peer));
    DS_RETURN_IF_ERROR(CheckDevice(call, "data", data.data(), data.size()));
    if (data.empty()) return Status::OK();
    return Run(call, peer,
               [&] { return ncclRecv(data.data(), data.size(), ncclUint8, peer, comm_, stream_); });
  }

  Status Broadcast(int root, std::span<uint8_t> data) override {
    const std::string_view call = "nccl broadcast";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckRoot(call, size(), root));
    DS_RETURN_IF_ERROR(CheckDevice(call, "data", data.data(), data.size()));
    if (data.empty()) return Status::OK();
    return Run(call, -1, [&] {
      return ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, root, comm_, stream_);
    });
  }

  Status Barrier() override {
    const std::string_view call = "nccl barrier";
    DS_RETURN_IF_ERROR(Usable(call));
    return Run(call, -1, [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_);
    });
  }

  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override {
    const std::string_view call = "nccl gather";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckRoot(call, size(), root));
    DS_RETURN_IF_ERROR(CheckDevice(call, "record", record.data(), record.size()));
    const size_t bytes = record.size();
    if (rank() == root) {
      DS_RETURN_IF_ERROR(CheckSize(call, "out", bytes * size(), out.size()));
      DS_RETURN_IF_ERROR(CheckDevice(call, "out", out.data(), out.size()));
    }
    if (bytes == 0) return Status::OK();
    return Run(call, -1, [&]() -> ncclResult_t {
      if (rank() == root) {
        const cudaError_t e = cudaMemcpyAsync(out.data() + root * bytes, record.data(), bytes,
                                              cudaMemcpyDeviceToDevice, stream_);
        if (e != cudaSuccess) return ncclUnhandledCudaError;
      }
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      if (rank() == root) {
        for (int p = 0; p < size(); ++p) {
          if (p == root) continue;
          r = ncclRecv(out.data() + p * bytes, bytes, ncclUint8, p, comm_, stream_);
          if (r != ncclSuccess && r != ncclInProgress) break;
        }
      } else {
        r = ncclSend(record.data(), bytes, ncclUint8, root, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return (r != ncclSuccess && r != ncclInProgress) ? r : end;
    });
  }

  Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) override {
    const std::string_view call = "nccl all-gather";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckSize(call, "out", record.size() * size(), out.size()));
    DS_RETURN_IF_ERROR(CheckDevice(call, "record", record.data(), record.size()));
    DS_RETURN_IF_ERROR(CheckDevice(call, "out", out.data(), out.size()));
    if (record.empty()) return Status::OK();
    return Run(call, -1, [&] {
      return ncclAllGather(record.data(), out.data(), record.size(), ncclUint8, comm_, stream_);
    });
  }

 private:
  Status Usable(std::string_view call) const {
    if (!broken_.ok()) return BrokenError(call, member_, broken_);
    return Status::OK();
  }

  // InvalidArgument unless `ptr` is device (or managed) memory; an empty
  // buffer may be anything.
  Status CheckDevice(std::string_view call, std::string_view what, const void* ptr,
                     size_t bytes) const {
    if (bytes == 0) return Status::OK();
    cudaPointerAttributes attr = {};
    const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clears the error, which would otherwise stick
      return Status::InvalidArgument(std::string(call) + ": " + std::string(what) +
                                     " is not CUDA memory (" + CudaText(e) + ")");
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return Status::InvalidArgument(std::string(call) + ": " + std::string(what) +
                                     " is host memory; nccl takes device buffers");
    }
    return Status::OK();
  }

  // Aborts the communicator and records `status` as what broke it.
  Status Fail(Status status) {
    if (broken_.ok()) broken_ = status;
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    return status;
  }

  std::string Where(std::string_view call, int peer) const {
    std::string out = std::string(call) + " (" + member_ + "): ";
    if (peer >= 0) out += "peer rank " + std::to_string(peer) + ": ";
    return out;
  }

  // Waits until NCCL has taken the last call (non-blocking communicators
  // may still be working on it when it returns ncclInProgress).
  Status AwaitIssued(std::string_view call, int peer, const Deadline& deadline) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return Fail(NcclError(call, peer, r));
      if (state == ncclSuccess) return Status::OK();
      if (state != ncclInProgress) return Fail(NcclError(call, peer, state));
      if (deadline.expired()) return Fail(TimedOut(call, peer, deadline));
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  Status NcclError(std::string_view call, int peer, ncclResult_t r) const {
    std::string text = NcclText(r);
    if (comm_ != nullptr) {
      const char* last = ncclGetLastError(comm_);
      if (last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
    }
    if (r == ncclRemoteError || r == ncclSystemError) {
      return Status::Unavailable(Where(call, peer) + "connection lost: " + text);
    }
    return Status::Internal(Where(call, peer) + "nccl failed: " + text);
  }

  Status TimedOut(std::string_view call, int peer, const Deadline& deadline) const {
    return Status::DeadlineExceeded(
        Where(call, peer) + "not complete within " + std::to_string(deadline.budget().count()) +
        " ms" + (peer >= 0 ? "" : " (a member died or stopped; nccl does not say which)") +
        "; the communicator was aborted");
  }

  // Enqueues through `enqueue` and waits for the stream.
  template <typename Enqueue>
  Status Run(std::string_view call, int peer, Enqueue&& enqueue) {
    const Deadline deadline(options_.timeout);
    cudaError_t e = cudaSetDevice(options_.cuda_device);
    if (e != cudaSuccess) return Fail(Status::Internal(Where(call, peer) + CudaText(e)));
    const ncclResult_t r = enqueue();
    if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclError(call, peer, r));
    DS_RETURN_IF_ERROR(AwaitIssued(call, peer, deadline));
    for (;;) {
      e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return Status::OK();
      if (e != cudaErrorNotReady) {
        return Fail(Status::Internal(Where(call, peer) + "the stream failed: " + CudaText(e)));
      }
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        return Fail(NcclError(call, peer, state));
      }
      if (deadline.expired()) return Fail(TimedOut(call, peer, deadline));
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  const CommunicatorOptions options_;
  const uint64_t generation_;
  const std::string member_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;  // the barrier's all-reduce operand: one int, on the device
  Status broken_;
};

Status NcclCommunicator::Connect(RendezvousStore& store, const Deadline& deadline) {
  const std::string where = "nccl: forming " + member_ + " through " + store.spec();
  cudaError_t e = cudaSetDevice(options_.cuda_device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMalloc(&scratch_, sizeof(int));
  if (e == cudaSuccess) e = cudaMemset(scratch_, 0, sizeof(int));
  if (e != cudaSuccess) {
    return Status::Unavailable(where + ": CUDA device " + std::to_string(options_.cuda_device) +
                               ": " + CudaText(e));
  }

  ncclUniqueId id;
  const std::string key = GenerationPrefix(options_.group, generation_) + "/nccl_unique_id";
  if (rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return Status::Unavailable(where + ": ncclGetUniqueId: " + NcclText(r));
    }
    DS_RETURN_IF_ERROR(store.Set(key, std::span<const char>(id.internal, sizeof(id.internal))));
  } else {
    Result<std::vector<char>> value = store.Get(key, deadline);
    if (!value.ok()) {
      if (value.status().code() == StatusCode::kDeadlineExceeded) {
        return Status::DeadlineExceeded(where + ": rank 0 did not join within " +
                                        std::to_string(deadline.budget().count()) + " ms");
      }
      return value.status();
    }
    if (value->size() != sizeof(id.internal)) {
      return Status::Corruption(where + ": the unique id in the store is " +
                                std::to_string(value->size()) + " bytes, expected " +
                                std::to_string(sizeof(id.internal)));
    }
    std::memcpy(id.internal, value->data(), sizeof(id.internal));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, size(), id, rank(), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    return Status::Unavailable(where + ": ncclCommInitRankConfig: " + NcclText(r));
  }
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      const std::string text = NcclText(q != ncclSuccess ? q : state);
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return Status::Unavailable(where + ": " + text);
    }
    if (state == ncclSuccess) return Status::OK();
    if (deadline.expired()) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return Status::DeadlineExceeded(where + ": not every member joined within " +
                                      std::to_string(deadline.budget().count()) +
                                      " ms (nccl does not say which)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const CommunicatorOptions& options) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return Status::Unavailable("nccl: no CUDA device (" +
                               (e != cudaSuccess ? CudaText(e) : std::string("none found")) + ")");
  }
  if (options.cuda_device < 0 || options.cuda_device >= devices) {
    return Status::InvalidArgument("nccl: cuda_device " + std::to_string(options.cuda_device) +
                                   " is not one of this host's " + std::to_string(devices) +
                                   " CUDA devices");
  }
  const Deadline deadline(options.connect_timeout);
  DS_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousStore> store,
                      RendezvousStore::Open(options.rendezvous, options.connect_timeout));
  DS_ASSIGN_OR_RETURN(uint64_t generation, JoinGeneration(*store, options, deadline));
  auto comm = std::make_unique<NcclCommunicator>(options, generation);
  DS_RETURN_IF_ERROR(comm->Connect(*store, deadline));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace deltasync::stream_internal
