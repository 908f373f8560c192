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
//
// Host memory is staged through a device buffer the communicator owns
// (allocated at the first host-memory call, up to kChunk bytes for the
// point-to-point calls and the broadcast; a gather's records and output):
// the bytes are copied in before the NCCL call and out after it completes,
// on this communicator's stream and within the operation's deadline. Every
// call of more than kChunk bytes runs as NCCL calls of kChunk bytes,
// whatever memory holds the span, so that a rank passing device memory and
// a peer passing host memory issue the same NCCL calls.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "comm/communicator_internal.h"
#include "comm/communicator_rendezvous.h"

namespace deltasync::stream_internal {

namespace {

// How long a wait sleeps between looks at the stream. An operation of a
// few microseconds then costs at most this much more; an idle spin would
// take a core from the trainer.
constexpr auto kPollInterval = std::chrono::microseconds(50);

// The most bytes of one NCCL call (see the file comment).
constexpr size_t kChunk = size_t{64} << 20;

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
    if (staging_ != nullptr) cudaFree(staging_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "nccl"; }
  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  uint64_t generation() const override { return generation_; }
  CommunicatorCapabilities capabilities() const override {
    CommunicatorCapabilities c;
    c.host_buffers = true;  // staged through the device (see the file comment)
    c.device_buffers = true;
    c.cuda_device = options_.cuda_device;
    c.point_to_point = true;
    c.awaits_peer = true;
    c.cancels_in_flight = true;
    return c;
  }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  Status health() const override {
    if (!broken_.ok()) return broken_;
    return Cancelled();
  }

  void Cancel(std::string_view why) override {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    if (cancel_requested_.load()) return;
    cancel_why_ = std::string(why);
    cancel_requested_.store(true);
  }

  // Sets the device, makes the stream, and forms the NCCL communicator
  // with the unique id rank 0 puts in `store`.
  Status Connect(RendezvousStore& store, const Deadline& deadline);

  Status Send(int peer, std::span<const uint8_t> data) override {
    return SendWaiting(peer, data, options_.timeout);
  }

  Status Recv(int peer, std::span<uint8_t> data) override {
    return RecvWaiting(peer, data, options_.timeout);
  }

  // NCCL cannot tell when a peer begins a message, so the first call of
  // at most kChunk bytes waits `wait`, later ones the timeout.
  Status SendAwaiting(int peer, std::span<const uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return SendWaiting(peer, data, wait.value_or(kNoBound));
  }

  Status RecvAwaiting(int peer, std::span<uint8_t> data,
                      std::optional<std::chrono::milliseconds> wait) override {
    return RecvWaiting(peer, data, wait.value_or(kNoBound));
  }

  Status Broadcast(int root, std::span<uint8_t> data) override {
    const std::string_view call = "nccl broadcast";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckRoot(call, size(), root));
    return Chunked(call, -1, data.data(), data.size(), rank() == root ? Way::kOut : Way::kIn,
                   [&](uint8_t* p, size_t n) {
                     return ncclBroadcast(p, p, n, ncclUint8, root, comm_, stream_);
                   });
  }

  Status Barrier() override {
    const std::string_view call = "nccl barrier";
    DS_RETURN_IF_ERROR(Usable(call));
    return Run(call, -1, Deadline(options_.timeout), [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_);
    });
  }

  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override {
    const std::string_view call = "nccl gather";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckRoot(call, size(), root));
    const size_t bytes = record.size();
    const bool root_rank = rank() == root;
    if (root_rank) DS_RETURN_IF_ERROR(CheckSize(call, "out", bytes * size(), out.size()));
    if (bytes == 0) return Status::OK();
    if (!root_rank) out = {};
    const Deadline deadline(options_.timeout);
    DS_ASSIGN_OR_RETURN(Staged staged, Stage(call, deadline, record, out));
    DS_RETURN_IF_ERROR(Run(call, -1, deadline, [&]() -> ncclResult_t {
      if (root_rank) {
        const cudaError_t e = cudaMemcpyAsync(staged.out + root * bytes, staged.record, bytes,
                                              cudaMemcpyDeviceToDevice, stream_);
        if (e != cudaSuccess) return ncclUnhandledCudaError;
      }
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      if (root_rank) {
        for (int p = 0; p < size(); ++p) {
          if (p == root) continue;
          r = ncclRecv(staged.out + p * bytes, bytes, ncclUint8, p, comm_, stream_);
          if (r != ncclSuccess && r != ncclInProgress) break;
        }
      } else {
        r = ncclSend(staged.record, bytes, ncclUint8, root, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return (r != ncclSuccess && r != ncclInProgress) ? r : end;
    }));
    return Unstage(call, deadline, staged, out);
  }

  Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) override {
    const std::string_view call = "nccl all-gather";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckSize(call, "out", record.size() * size(), out.size()));
    if (record.empty()) return Status::OK();
    const Deadline deadline(options_.timeout);
    DS_ASSIGN_OR_RETURN(Staged staged, Stage(call, deadline, record, out));
    DS_RETURN_IF_ERROR(Run(call, -1, deadline, [&] {
      return ncclAllGather(staged.record, staged.out, record.size(), ncclUint8, comm_, stream_);
    }));
    return Unstage(call, deadline, staged, out);
  }

 private:
  static constexpr std::chrono::milliseconds kNoBound{std::chrono::hours(24 * 365)};

  Status SendWaiting(int peer, std::span<const uint8_t> data, std::chrono::milliseconds first) {
    const std::string_view call = "nccl send";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckPeer(call, size(), rank(), peer));
    return Chunked(
        call, peer, const_cast<uint8_t*>(data.data()), data.size(), Way::kOut,
        [&](uint8_t* p, size_t n) { return ncclSend(p, n, ncclUint8, peer, comm_, stream_); },
        first);
  }

  Status RecvWaiting(int peer, std::span<uint8_t> data, std::chrono::milliseconds first) {
    const std::string_view call = "nccl recv";
    DS_RETURN_IF_ERROR(Usable(call));
    DS_RETURN_IF_ERROR(CheckPeer(call, size(), rank(), peer));
    return Chunked(
        call, peer, data.data(), data.size(), Way::kIn,
        [&](uint8_t* p, size_t n) { return ncclRecv(p, n, ncclUint8, peer, comm_, stream_); },
        first);
  }

  // OK, or the Aborted error Cancel asked for.
  Status Cancelled() const {
    if (!cancel_requested_.load()) return Status::OK();
    std::lock_guard<std::mutex> lock(cancel_mu_);
    return Status::Aborted("cancelled: " + cancel_why_);
  }

  Status Usable(std::string_view call) {
    if (broken_.ok()) {
      if (Status c = Cancelled(); !c.ok()) (void)Fail(c);
    }
    if (!broken_.ok()) return BrokenError(call, member_, broken_);
    return Status::OK();
  }

  // Whether `ptr` is device (or managed) memory, which NCCL takes as it is;
  // anything else is host memory, staged.
  static bool OnDevice(const void* ptr) {
    cudaPointerAttributes attr = {};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
      cudaGetLastError();  // clears the error, which would otherwise stick
      return false;
    }
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  }

  // Which way a chunked call's bytes go: out of this rank (host bytes are
  // copied to the device before the call) or into it (copied back after).
  enum class Way : uint8_t { kOut, kIn };

  // Makes the staging buffer hold at least `bytes`. It grows to the next
  // power of two: frames of slightly different sizes must not reallocate it
  // time after time (cudaFree waits for the whole device, and a freed and
  // remapped buffer costs far more than the copy it stages).
  Status Reserve(std::string_view call, size_t bytes) {
    if (bytes <= staging_bytes_) return Status::OK();
    if (staging_ != nullptr) cudaFree(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
    size_t grown = size_t{1} << 16;
    while (grown < bytes) grown *= 2;
    bytes = grown;
    cudaError_t e = cudaSetDevice(options_.cuda_device);
    if (e == cudaSuccess) e = cudaMalloc(&staging_, bytes);
    if (e != cudaSuccess) {
      staging_ = nullptr;
      cudaGetLastError();
      return Fail(
          Status::Unavailable(Where(call, -1) + "staging " + std::to_string(bytes) +
                              " bytes of host memory needs as much device memory: " + CudaText(e)));
    }
    staging_bytes_ = bytes;
    return Status::OK();
  }

  // A copy on this communicator's stream, waited for within `deadline`.
  Status Copy(std::string_view call, const Deadline& deadline, void* dst, const void* src,
              size_t bytes, cudaMemcpyKind kind) {
    return Run(call, -1, deadline, [&]() -> ncclResult_t {
      return cudaMemcpyAsync(dst, src, bytes, kind, stream_) == cudaSuccess
                 ? ncclSuccess
                 : ncclUnhandledCudaError;
    });
  }

  // `op(p, n)` enqueues one NCCL call on the n device bytes at p; runs it
  // over `data` in calls of at most kChunk bytes, within one deadline.
  // `first` bounds the first call (the peer coming to the exchange); the
  // timeout, from when it completes, bounds the rest.
  template <typename Op>
  Status Chunked(std::string_view call, int peer, uint8_t* data, size_t bytes, Way way, Op&& op,
                 std::optional<std::chrono::milliseconds> first = std::nullopt) {
    if (bytes == 0) return Status::OK();
    std::optional<Deadline> deadline;
    deadline.emplace(first.value_or(options_.timeout));
    // After the first call the rest of the message gets the timeout.
    const auto next = [&] {
      if (first) {
        deadline.emplace(options_.timeout);
        first.reset();
      }
    };
    if (OnDevice(data)) {
      // One call at a time, as a non-blocking communicator wants them
      // (each taken before the next is issued), and as a peer staging host
      // memory issues them.
      for (size_t at = 0; at < bytes; at += kChunk) {
        const size_t n = std::min(kChunk, bytes - at);
        DS_RETURN_IF_ERROR(Run(call, peer, *deadline, [&] { return op(data + at, n); }));
        next();
      }
      return Status::OK();
    }
    DS_RETURN_IF_ERROR(Reserve(call, std::min(kChunk, bytes)));
    uint8_t* stage = static_cast<uint8_t*>(staging_);
    for (size_t at = 0; at < bytes; at += kChunk) {
      const size_t n = std::min(kChunk, bytes - at);
      if (way == Way::kOut) {
        DS_RETURN_IF_ERROR(Copy(call, *deadline, stage, data + at, n, cudaMemcpyHostToDevice));
      }
      DS_RETURN_IF_ERROR(Run(call, peer, *deadline, [&] { return op(stage, n); }));
      next();
      if (way == Way::kIn) {
        DS_RETURN_IF_ERROR(Copy(call, *deadline, data + at, stage, n, cudaMemcpyDeviceToHost));
      }
    }
    return Status::OK();
  }

  // A gather's record and output as device memory: as they are, or in the
  // staging buffer (a host record copied in).
  struct Staged {
    const uint8_t* record = nullptr;
    uint8_t* out = nullptr;
    bool out_staged = false;
  };
  Result<Staged> Stage(std::string_view call, const Deadline& deadline,
                       std::span<const uint8_t> record, std::span<uint8_t> out) {
    Staged s;
    const bool record_host = !OnDevice(record.data());
    const bool out_host = !out.empty() && !OnDevice(out.data());
    // The record's slot is rounded up so that the output stays aligned.
    const size_t record_slot = record_host ? (record.size() + 255) / 256 * 256 : 0;
    DS_RETURN_IF_ERROR(
        Reserve(call, std::max<size_t>(1, record_slot + (out_host ? out.size() : 0))));
    uint8_t* stage = static_cast<uint8_t*>(staging_);
    s.record = record.data();
    if (record_host) {
      DS_RETURN_IF_ERROR(
          Copy(call, deadline, stage, record.data(), record.size(), cudaMemcpyHostToDevice));
      s.record = stage;
    }
    s.out = out.data();
    if (out_host) {
      s.out = stage + record_slot;
      s.out_staged = true;
    }
    return s;
  }
  Status Unstage(std::string_view call, const Deadline& deadline, const Staged& s,
                 std::span<uint8_t> out) {
    if (!s.out_staged) return Status::OK();
    return Copy(call, deadline, out.data(), s.out, out.size(), cudaMemcpyDeviceToHost);
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
      DS_RETURN_IF_ERROR(CheckCancel(call, peer));
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

  // Cancel's error, aborting the communicator, once it was asked for.
  Status CheckCancel(std::string_view call, int peer) {
    if (!cancel_requested_.load(std::memory_order_relaxed)) return Status::OK();
    const Status c = Cancelled();
    return Fail(Status(c.code(), Where(call, peer) + c.message()));
  }

  Status TimedOut(std::string_view call, int peer, const Deadline& deadline) const {
    return Status::DeadlineExceeded(
        Where(call, peer) + "not complete within " + std::to_string(deadline.budget().count()) +
        " ms" + (peer >= 0 ? "" : " (a member died or stopped; nccl does not say which)") +
        "; the communicator was aborted");
  }

  // Enqueues through `enqueue` and waits for the stream.
  template <typename Enqueue>
  Status Run(std::string_view call, int peer, const Deadline& deadline, Enqueue&& enqueue) {
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
      DS_RETURN_IF_ERROR(CheckCancel(call, peer));
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  const CommunicatorOptions options_;
  const uint64_t generation_;
  const std::string member_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;  // the barrier's all-reduce operand: one int, on the device
  void* staging_ = nullptr;  // host memory's way through the device (see the file comment)
  size_t staging_bytes_ = 0;
  Status broken_;
  // Cancel's request, which the calling thread's waits look at.
  std::atomic<bool> cancel_requested_{false};
  mutable std::mutex cancel_mu_;
  std::string cancel_why_;
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
    if (Status c = FormationCancel::Check(where); !c.ok()) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return c;
    }
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
  if (Status s = comm->Connect(*store, deadline); !s.ok()) {
    AbandonGeneration(*store, options.group, generation,
                      "rank " + std::to_string(options.rank) + " gave up: " + s.message());
    return s;
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace deltasync::stream_internal
