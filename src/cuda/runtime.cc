// The host side of the cuda module: devices and buffers, the workspace, and
// every public call's argument checks before its kernels are launched.
#include <cuda_runtime.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_internal.h"
#include "deltasync/cuda.h"
#include "deltasync/tensor.h"

namespace deltasync::cuda {

namespace {

using internal::Results;

// Positions and counts of the stream's digest stay below this.
constexpr uint64_t kMaxNumel = uint64_t{1} << 56;
constexpr uint64_t kNarrowLimit = uint64_t{1} << 31;

Status CudaError(cudaError_t err, std::string_view what) {
  // Clears the sticky-free error state so the next call starts clean.
  (void)cudaGetLastError();
  return Status::Internal(std::string(what) + ": CUDA error " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

#define DS_CUDA_RETURN(expr, what)           \
  do {                                       \
    const cudaError_t ds_cuda_err_ = (expr); \
    if (ds_cuda_err_ != cudaSuccess) {       \
      return CudaError(ds_cuda_err_, what);  \
    }                                        \
  } while (false)

Status NoDevice() {
  return Status::FailedPrecondition("no CUDA device: the GPU data path needs one");
}

std::string Quoted(std::string_view name) { return "tensor '" + std::string(name) + "'"; }

bool IsElemSize(uint32_t w) { return w == 1 || w == 2 || w == 4 || w == 8; }

cudaStream_t AsStream(StreamHandle s) { return static_cast<cudaStream_t>(s); }

struct PointerInfo {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;
  const void* device_pointer = nullptr;
};

Result<PointerInfo> Inspect(const void* p) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) return CudaError(err, "cudaPointerGetAttributes");
  PointerInfo info;
  info.device = attr.device;
  info.device_pointer = attr.devicePointer;
  switch (attr.type) {
    case cudaMemoryTypeHost: info.kind = MemoryKind::kPinnedHost; break;
    case cudaMemoryTypeDevice: info.kind = MemoryKind::kDevice; break;
    case cudaMemoryTypeManaged: info.kind = MemoryKind::kManaged; break;
    default: info.kind = MemoryKind::kHost; break;
  }
  return info;
}

// Where a call may read or write a tensor.
enum class Place { kDevice, kDeviceOrPinned };

// That memory described by `info` (at `p`) is where the call may touch it
// on `device`.
Status CheckPlace(const PointerInfo& info, const void* p, const std::string& who, Place place,
                  int device) {
  const bool pinned_ok = place == Place::kDeviceOrPinned && info.kind == MemoryKind::kPinnedHost;
  if (info.kind != MemoryKind::kDevice && info.kind != MemoryKind::kManaged && !pinned_ok) {
    return Status::InvalidArgument(
        who + ": " + std::string(MemoryKindName(info.kind)) + " memory where the call needs " +
        (place == Place::kDevice ? "device memory" : "device or pinned host memory"));
  }
  if (info.kind == MemoryKind::kDevice && info.device != device) {
    return Status::InvalidArgument(who + ": memory of device " + std::to_string(info.device) +
                                   ", the workspace is on device " + std::to_string(device));
  }
  if (info.kind == MemoryKind::kPinnedHost && info.device_pointer != p) {
    // Kernels use the host address itself (unified addressing).
    return Status::InvalidArgument(who +
                                   ": pinned host memory not mapped into the device at "
                                   "its own address (allocate it mapped and portable)");
  }
  return Status::OK();
}

// Checks `t` as `role` of a call: known dtype, a valid shape, contiguous,
// element-aligned, and in memory the call may touch on `device`. Returns
// where it lives (kDevice for an empty tensor).
Result<MemoryKind> CheckTensor(const DeviceTensor& t, std::string_view role, Place place,
                               int device) {
  const std::string who = Quoted(t.name) + " (" + std::string(role) + ")";
  const size_t w = DTypeSize(t.dtype);
  if (!IsElemSize(static_cast<uint32_t>(w))) {
    return Status::InvalidArgument(who + ": dtype " + std::string(DTypeName(t.dtype)) +
                                   " has no element size the kernels take (1, 2, 4 or 8)");
  }
  const Result<int64_t> numel = ShapeNumel(t.shape);
  if (!numel.ok()) return Status::InvalidArgument(who + ": " + numel.status().message());
  if (static_cast<uint64_t>(*numel) >= kMaxNumel) {
    return Status::InvalidArgument(who + ": " + std::to_string(*numel) +
                                   " elements, at or past the 2^56 the digest allows");
  }
  if (!t.strides.empty()) {
    if (t.strides.size() != t.shape.size()) {
      return Status::InvalidArgument(who + ": " + std::to_string(t.strides.size()) +
                                     " strides for a shape of " + std::to_string(t.shape.size()) +
                                     " dimensions");
    }
    int64_t expected = 1;
    for (size_t d = t.shape.size(); d-- > 0;) {
      if (t.shape[d] != 1 && t.strides[d] != expected) {
        return Status::InvalidArgument(
            who + ": not contiguous (stride " + std::to_string(t.strides[d]) + " in dimension " +
            std::to_string(d) + ", expected " + std::to_string(expected) + ")");
      }
      expected *= t.shape[d];
    }
  }
  if (*numel == 0) return MemoryKind::kDevice;
  if (t.data == nullptr) return Status::InvalidArgument(who + ": null data");
  if (reinterpret_cast<uintptr_t>(t.data) % w != 0) {
    return Status::InvalidArgument(who + ": data not aligned to its " + std::to_string(w) +
                                   "-byte elements");
  }
  DS_ASSIGN_OR_RETURN(const PointerInfo info, Inspect(t.data));
  DS_RETURN_IF_ERROR(CheckPlace(info, t.data, who, place, device));
  return info.kind;
}

// A raw device buffer argument (outputs, positions, values).
Status CheckDevicePointer(const void* p, std::string_view name, std::string_view role,
                          uint32_t align, int device) {
  const std::string who = Quoted(name) + " (" + std::string(role) + ")";
  if (p == nullptr) return Status::InvalidArgument(who + ": null pointer");
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    return Status::InvalidArgument(who + ": not aligned to " + std::to_string(align) + " bytes");
  }
  DS_ASSIGN_OR_RETURN(const PointerInfo info, Inspect(p));
  return CheckPlace(info, p, who, Place::kDevice, device);
}

// That a tensor's numel elements from first_position stay below the 2^56
// the digest allows.
Status CheckDigestRange(std::string_view name, uint64_t first_position, uint64_t numel) {
  if (first_position > kMaxNumel - numel) {
    return Status::InvalidArgument(Quoted(name) + ": first position " +
                                   std::to_string(first_position) +
                                   " puts its elements past the 2^56 the digest allows");
  }
  return Status::OK();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

class WorkspaceImpl final : public Workspace {
 public:
  explicit WorkspaceImpl(int device) : device_(device) {}
  ~WorkspaceImpl() override {
    for (int i = 0; i < 2; ++i) {
      if (stage_[i] != nullptr) cudaFree(stage_[i]);
      if (copied_[i] != nullptr) cudaEventDestroy(copied_[i]);
      if (consumed_[i] != nullptr) cudaEventDestroy(consumed_[i]);
    }
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (quant_scratch_ != nullptr) cudaFree(quant_scratch_);
    if (results_ != nullptr) cudaFree(results_);
    if (host_results_ != nullptr) cudaFreeHost(host_results_);
  }

  int device() const override { return device_; }

  Status Init() {
    DS_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    DS_CUDA_RETURN(cudaMalloc(&results_, sizeof(Results)), "cudaMalloc (workspace results)");
    DS_CUDA_RETURN(cudaMallocHost(&host_results_, sizeof(Results)),
                   "cudaMallocHost (workspace results)");
    return Status::OK();
  }

  // At least `bytes` of device scratch, 256-byte aligned.
  Result<unsigned long long*> Scratch(uint64_t bytes) {
    DS_RETURN_IF_ERROR(Grow(&scratch_, &scratch_bytes_, bytes));
    return static_cast<unsigned long long*>(scratch_);
  }
  // A second such scratch, for the scale groups of a quantize-then-diff
  // (which runs a diff, using the first, while it holds them).
  Result<uint8_t*> QuantScratch(uint64_t bytes) {
    DS_RETURN_IF_ERROR(Grow(&quant_scratch_, &quant_scratch_bytes_, bytes));
    return static_cast<uint8_t*>(quant_scratch_);
  }

  Results* results() { return results_; }

 private:
  Status Grow(void** buffer, uint64_t* size, uint64_t bytes) {
    DS_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    if (bytes <= *size) return Status::OK();
    if (*buffer != nullptr) {
      // Earlier work on any stream may still use the old scratch.
      DS_CUDA_RETURN(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      cudaFree(*buffer);
      *buffer = nullptr;
      *size = 0;
    }
    // To the next power of two: sizes that creep up do not reallocate (and
    // synchronize the device) time after time.
    uint64_t grown = uint64_t{1} << 20;
    while (grown < bytes) grown *= 2;
    DS_CUDA_RETURN(cudaMalloc(buffer, grown), "cudaMalloc (workspace scratch)");
    *size = grown;
    return Status::OK();
  }

 public:
  // Two device chunks for staging a pinned snapshot, the stream that copies
  // into them, and the events that order the copies with the compares.
  Status EnsureStaging() {
    if (copy_stream_ != nullptr) return Status::OK();
    for (int i = 0; i < 2; ++i) {
      DS_CUDA_RETURN(cudaMalloc(&stage_[i], internal::kPinnedChunkBytes),
                     "cudaMalloc (staging chunk)");
      DS_CUDA_RETURN(cudaEventCreateWithFlags(&copied_[i], cudaEventDisableTiming),
                     "cudaEventCreate");
      DS_CUDA_RETURN(cudaEventCreateWithFlags(&consumed_[i], cudaEventDisableTiming),
                     "cudaEventCreate");
    }
    DS_CUDA_RETURN(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming), "cudaEventCreate");
    DS_CUDA_RETURN(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking),
                   "cudaStreamCreate");
    return Status::OK();
  }
  void* stage(int i) const { return stage_[i]; }
  cudaEvent_t copied(int i) const { return copied_[i]; }
  cudaEvent_t consumed(int i) const { return consumed_[i]; }
  cudaEvent_t start() const { return start_; }
  cudaStream_t copy_stream() const { return copy_stream_; }

  // Copies the device results back after the stream's work; waits.
  Result<Results> Fetch(cudaStream_t stream) {
    DS_CUDA_RETURN(
        cudaMemcpyAsync(host_results_, results_, sizeof(Results), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync (results)");
    DS_CUDA_RETURN(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return *host_results_;
  }

 private:
  int device_;
  void* scratch_ = nullptr;
  uint64_t scratch_bytes_ = 0;
  void* quant_scratch_ = nullptr;
  uint64_t quant_scratch_bytes_ = 0;
  Results* results_ = nullptr;
  Results* host_results_ = nullptr;
  void* stage_[2] = {nullptr, nullptr};
  cudaEvent_t copied_[2] = {nullptr, nullptr};
  cudaEvent_t consumed_[2] = {nullptr, nullptr};
  cudaEvent_t start_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;
};

WorkspaceImpl& Impl(Workspace& ws) { return static_cast<WorkspaceImpl&>(ws); }

uint64_t RoundUp(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

}  // namespace

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kPinnedHost: return "pinned host";
    case MemoryKind::kDevice: return "device";
    case MemoryKind::kManaged: return "managed";
  }
  return "unknown";
}

Result<MemoryKind> QueryMemory(const void* pointer) {
  if (DeviceCount() == 0) return NoDevice();
  DS_ASSIGN_OR_RETURN(const PointerInfo info, Inspect(pointer));
  return info.kind;
}

uint64_t DeviceTensor::numel() const {
  const Result<int64_t> n = ShapeNumel(shape);
  return n.ok() ? static_cast<uint64_t>(*n) : 0;
}

Result<std::unique_ptr<Workspace>> Workspace::Create(int device) {
  const int count = DeviceCount();
  if (count == 0) return NoDevice();
  if (device < 0 || device >= count) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                                   std::to_string(count) + " visible)");
  }
  auto ws = std::make_unique<WorkspaceImpl>(device);
  DS_RETURN_IF_ERROR(ws->Init());
  return std::unique_ptr<Workspace>(std::move(ws));
}

Result<Buffer> Buffer::Device(uint64_t bytes, int device) {
  if (DeviceCount() == 0) return NoDevice();
  DS_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice");
  Buffer b;
  DS_CUDA_RETURN(cudaMalloc(&b.data_, std::max<uint64_t>(bytes, 1)),
                 "cudaMalloc (" + std::to_string(bytes) + " bytes)");
  b.size_ = bytes;
  return b;
}

Result<Buffer> Buffer::PinnedHost(uint64_t bytes) {
  if (DeviceCount() == 0) return NoDevice();
  Buffer b;
  DS_CUDA_RETURN(cudaHostAlloc(&b.data_, std::max<uint64_t>(bytes, 1),
                               cudaHostAllocMapped | cudaHostAllocPortable),
                 "cudaHostAlloc (" + std::to_string(bytes) + " bytes)");
  b.size_ = bytes;
  b.pinned_ = true;
  return b;
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      pinned_(other.pinned_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Buffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    pinned_ = other.pinned_;
  }
  return *this;
}

Buffer::~Buffer() {
  if (data_ == nullptr) return;
  if (pinned_) {
    cudaFreeHost(data_);
  } else {
    cudaFree(data_);
  }
}

namespace {

// `out` can take the diff of `numel` elements of `w` bytes.
Status CheckDiffOutput(std::string_view name, const DiffOutput& out, uint64_t numel, uint32_t w,
                       int device) {
  DS_RETURN_IF_ERROR(CheckDigestRange(name, out.first_position, numel));
  if (numel == 0) return Status::OK();
  if (out.capacity < numel) {
    return Status::InvalidArgument(Quoted(name) + ": output capacity " +
                                   std::to_string(out.capacity) + " below its " +
                                   std::to_string(numel) + " elements");
  }
  DS_RETURN_IF_ERROR(
      CheckDevicePointer(out.positions, name, "positions", numel >= kNarrowLimit ? 8 : 4, device));
  DS_RETURN_IF_ERROR(CheckDevicePointer(out.values, name, "values", w, device));
  if (out.old_values != nullptr) {
    DS_RETURN_IF_ERROR(CheckDevicePointer(out.old_values, name, "old values", w, device));
  }
  return Status::OK();
}

// The diff's launches once its tensors are checked: `current` holds
// `numel` elements of `w` bytes (or, with quant.weight set, is that weight,
// quantized on the fly into 1-byte codes), `snapshot` as many, and `out` is
// checked here.
Result<DiffResult> RunDiff(Workspace& ws, std::string_view name, const void* current,
                           StreamHandle stream, DeviceTensor& snapshot, MemoryKind snapshot_kind,
                           uint64_t numel, uint32_t w, const DiffOutput& out,
                           const internal::QuantLoad& quant) {
  DiffResult result;
  result.wide = numel >= kNarrowLimit;
  DS_RETURN_IF_ERROR(CheckDiffOutput(name, out, numel, w, ws.device()));
  if (numel == 0) return result;

  const uint64_t tiles = internal::DiffTiles(numel, w);
  const uint64_t state_words = RoundUp(tiles, 32);
  const uint64_t words = state_words + (out.digest ? 2 * tiles : 0) + 32;
  DS_ASSIGN_OR_RETURN(unsigned long long* scratch, Impl(ws).Scratch(words * 8));

  internal::DiffLaunch launch;
  launch.current = current;
  launch.quant = quant;
  launch.snapshot = snapshot.data;
  launch.numel = numel;
  launch.elem_size = w;
  launch.aligned16 = (quant.weight != nullptr || Aligned16(current)) && Aligned16(snapshot.data);
  launch.positions = out.positions;
  launch.wide = result.wide;
  launch.values = out.values;
  launch.old_values = out.old_values;
  launch.refresh = out.refresh_snapshot;
  launch.digest = out.digest;
  launch.first_position = out.first_position;
  launch.tile_state = scratch;
  launch.tile_digest = scratch + state_words;
  launch.ticket = scratch + state_words + (out.digest ? 2 * tiles : 0);
  launch.results = Impl(ws).results();
  launch.stream = AsStream(stream);
  const std::string what = "diff of " + Quoted(name);
  DS_CUDA_RETURN(internal::LaunchDiffReset(launch, tiles), what);
  if (snapshot_kind != MemoryKind::kPinnedHost) {
    launch.tiles = tiles;
    DS_CUDA_RETURN(internal::LaunchDiffTiles(launch), what);
  } else {
    // The copy engine brings the snapshot in chunk by chunk, two ahead at
    // most, while the kernel compares the chunk before; the kernel writes
    // the changed groups back into the pinned snapshot itself.
    WorkspaceImpl& impl = Impl(ws);
    DS_RETURN_IF_ERROR(impl.EnsureStaging());
    const cudaStream_t copy = impl.copy_stream();
    DS_CUDA_RETURN(cudaEventRecord(impl.start(), launch.stream), what);
    DS_CUDA_RETURN(cudaStreamWaitEvent(copy, impl.start(), 0), what);
    const uint64_t chunk = internal::kPinnedChunkBytes / w;
    const uint8_t* snap_bytes = static_cast<const uint8_t*>(snapshot.data);
    int c = 0;
    for (uint64_t first = 0; first < numel; first += chunk, ++c) {
      const int slot = c % 2;
      const uint64_t n = std::min(chunk, numel - first);
      if (c >= 2) DS_CUDA_RETURN(cudaStreamWaitEvent(copy, impl.consumed(slot), 0), what);
      DS_CUDA_RETURN(cudaMemcpyAsync(impl.stage(slot), snap_bytes + first * w, n * w,
                                     cudaMemcpyHostToDevice, copy),
                     what);
      DS_CUDA_RETURN(cudaEventRecord(impl.copied(slot), copy), what);
      DS_CUDA_RETURN(cudaStreamWaitEvent(launch.stream, impl.copied(slot), 0), what);
      launch.snapshot_read = impl.stage(slot);
      launch.read_first = first;
      launch.tiles = internal::DiffTiles(n, w);
      DS_CUDA_RETURN(internal::LaunchDiffTiles(launch), what);
      DS_CUDA_RETURN(cudaEventRecord(impl.consumed(slot), launch.stream), what);
    }
  }
  DS_CUDA_RETURN(internal::LaunchDiffFinish(launch, tiles), what);
  DS_ASSIGN_OR_RETURN(const Results r, Impl(ws).Fetch(launch.stream));
  result.count = r.count;
  result.digest_change = {r.a, r.b};
  return result;
}

}  // namespace

Result<DiffResult> DiffOnDevice(Workspace& ws, const DeviceTensor& current, DeviceTensor& snapshot,
                                const DiffOutput& out) {
  const int device = ws.device();
  DS_RETURN_IF_ERROR(CheckTensor(current, "current", Place::kDevice, device).status());
  DS_ASSIGN_OR_RETURN(const MemoryKind snapshot_kind,
                      CheckTensor(snapshot, "snapshot", Place::kDeviceOrPinned, device));
  if (current.dtype != snapshot.dtype || current.shape != snapshot.shape) {
    return Status::InvalidArgument(
        Quoted(current.name) + ": current is " + std::string(DTypeName(current.dtype)) + " " +
        ShapeToString(current.shape) + ", its snapshot " + std::string(DTypeName(snapshot.dtype)) +
        " " + ShapeToString(snapshot.shape));
  }
  return RunDiff(ws, current.name, current.data, current.stream, snapshot, snapshot_kind,
                 current.numel(), static_cast<uint32_t>(DTypeSize(current.dtype)), out, {});
}

namespace {

// A weight's scale step done (QuantizeDiffOnDevice, QuantizeOnDevice): the
// loader that encodes it, and its scales in the workspace's quant scratch.
struct QuantSetup {
  internal::QuantLoad load;
  std::vector<int64_t> scale_shape;
  DType scale_dtype = DType::kF32;
  uint64_t groups = 0;
  uint8_t* scales = nullptr;
};

Result<QuantSetup> CheckQuantWeight(Workspace& ws, const QuantRecipe& recipe,
                                    const DeviceTensor& weight) {
  const std::string who = Quoted(weight.name);
  Status recipe_ok = CheckQuantRecipe(recipe);
  if (!recipe_ok.ok()) return recipe_ok.WithContext(who);
  QuantSetup q;
  switch (weight.dtype) {
    case DType::kBF16: q.load.kind = internal::QuantKind::kBf16; break;
    case DType::kF16: q.load.kind = internal::QuantKind::kF16; break;
    case DType::kF32: q.load.kind = internal::QuantKind::kF32; break;
    default:
      return Status::InvalidArgument(who + ": dtype " + std::string(DTypeName(weight.dtype)) +
                                     " cannot be quantized (BF16, F16 or F32 only)");
  }
  DS_RETURN_IF_ERROR(CheckTensor(weight, "weight", Place::kDevice, ws.device()).status());
  if (weight.shape.size() != 2 || weight.shape[0] < 1 || weight.shape[1] < 1) {
    return Status::InvalidArgument(who + ": quantizing takes a 2-D weight with elements, not " +
                                   ShapeToString(weight.shape));
  }
  DS_ASSIGN_OR_RETURN(q.scale_shape, QuantScaleShape(recipe, weight.shape[0], weight.shape[1]));
  q.scale_dtype = QuantScaleDType(recipe.scale_format);
  q.groups = 1;
  for (int64_t d : q.scale_shape) q.groups *= static_cast<uint64_t>(d);
  return q;
}

// The amax pass and the scale step: q.scales and the loader's inverses in
// the quant scratch. InvalidArgument, with nothing else written, for a NaN
// or an infinity.
Status RunQuantScales(Workspace& ws, const QuantRecipe& recipe, const DeviceTensor& weight,
                      QuantSetup* q) {
  WorkspaceImpl& impl = Impl(ws);
  // One 4-byte slot each per group: amax bits, inverses, the scales.
  const uint64_t slots = RoundUp(q->groups, 64) * 4;
  DS_ASSIGN_OR_RETURN(uint8_t * scratch, impl.QuantScratch(3 * slots));
  q->load.weight = weight.data;
  q->load.aligned16 = Aligned16(weight.data);
  q->load.scheme = static_cast<uint32_t>(recipe.scheme);
  q->load.cols = static_cast<uint64_t>(weight.shape[1]);
  q->load.scale_cols = static_cast<uint64_t>(q->scale_shape.size() > 1 ? q->scale_shape[1] : 1);
  q->load.inv = reinterpret_cast<const float*>(scratch + slots);
  q->scales = scratch + 2 * slots;
  internal::QuantScaleLaunch launch;
  launch.load = q->load;
  launch.rows = static_cast<uint64_t>(weight.shape[0]);
  launch.scale_format = static_cast<uint32_t>(recipe.scale_format);
  launch.groups = q->groups;
  launch.amax_bits = reinterpret_cast<unsigned int*>(scratch);
  launch.inv = reinterpret_cast<float*>(scratch + slots);
  launch.scales = q->scales;
  launch.results = impl.results();
  launch.stream = AsStream(weight.stream);
  DS_CUDA_RETURN(internal::LaunchQuantScales(launch), "quantize " + Quoted(weight.name));
  DS_ASSIGN_OR_RETURN(const Results flag, impl.Fetch(launch.stream));
  if (flag.count != 0) {
    return Status::InvalidArgument(Quoted(weight.name) +
                                   ": holds a NaN or an infinity; nothing was quantized");
  }
  return Status::OK();
}

}  // namespace

Result<QuantDiffResult> QuantizeDiffOnDevice(Workspace& ws, const QuantRecipe& recipe,
                                             const DeviceTensor& weight,
                                             DeviceTensor& code_snapshot,
                                             DeviceTensor& scale_snapshot,
                                             const DiffOutput& code_out,
                                             const DiffOutput& scale_out) {
  const int device = ws.device();
  const std::string who = Quoted(weight.name);
  DS_ASSIGN_OR_RETURN(QuantSetup q, CheckQuantWeight(ws, recipe, weight));
  DS_ASSIGN_OR_RETURN(const MemoryKind code_kind,
                      CheckTensor(code_snapshot, "code snapshot", Place::kDeviceOrPinned, device));
  DS_ASSIGN_OR_RETURN(const MemoryKind scale_kind, CheckTensor(scale_snapshot, "scale snapshot",
                                                               Place::kDeviceOrPinned, device));
  if (code_snapshot.dtype != DType::kF8_E4M3 || code_snapshot.shape != weight.shape) {
    return Status::InvalidArgument(
        who + ": its code snapshot is " + std::string(DTypeName(code_snapshot.dtype)) + " " +
        ShapeToString(code_snapshot.shape) + ", not F8_E4M3 " + ShapeToString(weight.shape));
  }
  if (scale_snapshot.dtype != q.scale_dtype || scale_snapshot.shape != q.scale_shape) {
    return Status::InvalidArgument(
        who + ": its scale snapshot is " + std::string(DTypeName(scale_snapshot.dtype)) + " " +
        ShapeToString(scale_snapshot.shape) + ", the recipe's scales " +
        std::string(DTypeName(q.scale_dtype)) + " " + ShapeToString(q.scale_shape));
  }
  const uint64_t numel = weight.numel();
  // Both outputs are checked before any kernel runs: a refusal writes
  // nothing.
  const uint32_t scale_size = static_cast<uint32_t>(DTypeSize(q.scale_dtype));
  DS_RETURN_IF_ERROR(CheckDiffOutput(weight.name, code_out, numel, 1, device));
  DS_RETURN_IF_ERROR(
      CheckDiffOutput(weight.name + " scales", scale_out, q.groups, scale_size, device));
  DS_RETURN_IF_ERROR(RunQuantScales(ws, recipe, weight, &q));
  QuantDiffResult result;
  DS_ASSIGN_OR_RETURN(result.codes, RunDiff(ws, weight.name, nullptr, weight.stream, code_snapshot,
                                            code_kind, numel, 1, code_out, q.load));
  DS_ASSIGN_OR_RETURN(result.scales,
                      RunDiff(ws, weight.name + " scales", q.scales, weight.stream, scale_snapshot,
                              scale_kind, q.groups, scale_size, scale_out, {}));
  return result;
}

Status QuantizeOnDevice(Workspace& ws, const QuantRecipe& recipe, const DeviceTensor& weight,
                        void* codes, void* scales) {
  DS_ASSIGN_OR_RETURN(QuantSetup q, CheckQuantWeight(ws, recipe, weight));
  const uint32_t scale_size = static_cast<uint32_t>(DTypeSize(q.scale_dtype));
  DS_RETURN_IF_ERROR(CheckDevicePointer(codes, weight.name, "codes", 1, ws.device()));
  DS_RETURN_IF_ERROR(CheckDevicePointer(scales, weight.name, "scales", scale_size, ws.device()));
  DS_RETURN_IF_ERROR(RunQuantScales(ws, recipe, weight, &q));
  const std::string what = "quantize " + Quoted(weight.name);
  const cudaStream_t stream = AsStream(weight.stream);
  DS_CUDA_RETURN(
      internal::LaunchQuantEncode(q.load, weight.numel(), static_cast<uint8_t*>(codes), stream),
      what);
  DS_CUDA_RETURN(
      cudaMemcpyAsync(scales, q.scales, q.groups * scale_size, cudaMemcpyDeviceToDevice, stream),
      what);
  DS_CUDA_RETURN(cudaStreamSynchronize(stream), what);
  return Status::OK();
}

namespace {

// The alignment a change list's positions need (u24 ones: none).
uint32_t PositionAlign(const DeviceChanges& changes) {
  return changes.width == 3 ? 1 : changes.width == 8 ? 8 : 4;
}

Status CheckPositionWidth(std::string_view name, const DeviceChanges& changes) {
  if (changes.width == 3 || changes.width == 4 || changes.width == 8) return Status::OK();
  return Status::InvalidArgument(Quoted(name) + ": positions of " + std::to_string(changes.width) +
                                 " bytes (3, 4 or 8)");
}

// Checks changes for `name` against `limit` on the device; InvalidArgument
// naming the first bad index.
Status CheckChanges(WorkspaceImpl& ws, std::string_view name, const DeviceChanges& changes,
                    uint64_t limit, StreamHandle stream) {
  DS_RETURN_IF_ERROR(CheckPositionWidth(name, changes));
  DS_RETURN_IF_ERROR(CheckDevicePointer(changes.positions, name, "positions",
                                        PositionAlign(changes), ws.device()));
  internal::ScatterLaunch check;
  check.positions = changes.positions;
  check.width = changes.width;
  check.count = changes.count;
  check.limit = limit;
  check.results = ws.results();
  check.stream = AsStream(stream);
  DS_CUDA_RETURN(internal::LaunchCheckPositions(check), "position check of " + Quoted(name));
  DS_ASSIGN_OR_RETURN(const Results r, ws.Fetch(check.stream));
  if (r.count != ~0ull) {
    return Status::InvalidArgument(Quoted(name) + ": change " + std::to_string(r.count) + " of " +
                                   std::to_string(changes.count) +
                                   " has a position out of range (below " + std::to_string(limit) +
                                   ") or not above the one before");
  }
  return Status::OK();
}

}  // namespace

Status ScatterOnDevice(Workspace& ws, DeviceTensor& dest, const DeviceChanges& changes) {
  DS_RETURN_IF_ERROR(CheckTensor(dest, "destination", Place::kDevice, ws.device()).status());
  if (changes.count == 0) return Status::OK();
  const uint32_t w = static_cast<uint32_t>(DTypeSize(dest.dtype));
  const uint64_t numel = dest.numel();
  if (changes.count > numel) {
    return Status::InvalidArgument(Quoted(dest.name) + ": " + std::to_string(changes.count) +
                                   " changes for " + std::to_string(numel) + " elements");
  }
  DS_RETURN_IF_ERROR(CheckDevicePointer(changes.values, dest.name, "values", w, ws.device()));
  DS_RETURN_IF_ERROR(CheckChanges(Impl(ws), dest.name, changes, numel, dest.stream));
  internal::ScatterLaunch launch;
  launch.dest = dest.data;
  launch.elem_size = w;
  launch.positions = changes.positions;
  launch.width = changes.width;
  launch.values = changes.values;
  launch.count = changes.count;
  launch.limit = numel;
  launch.stream = AsStream(dest.stream);
  DS_CUDA_RETURN(internal::LaunchScatter(launch), "scatter into " + Quoted(dest.name));
  return Status::OK();
}

Status CopyToDevice(DeviceTensor& dest, const void* source, uint64_t source_bytes) {
  if (DeviceCount() == 0) return NoDevice();
  int device = 0;
  DS_CUDA_RETURN(cudaGetDevice(&device), "cudaGetDevice");
  if (dest.data != nullptr) {
    DS_ASSIGN_OR_RETURN(const PointerInfo info, Inspect(dest.data));
    if (info.kind == MemoryKind::kDevice) device = info.device;
  }
  DS_RETURN_IF_ERROR(CheckTensor(dest, "destination", Place::kDevice, device).status());
  if (source_bytes != dest.nbytes()) {
    return Status::InvalidArgument(Quoted(dest.name) + ": " + std::to_string(source_bytes) +
                                   " source bytes for " + std::to_string(dest.nbytes()));
  }
  if (source_bytes == 0) return Status::OK();
  if (source == nullptr) return Status::InvalidArgument(Quoted(dest.name) + ": null source");
  DS_CUDA_RETURN(
      cudaMemcpyAsync(dest.data, source, source_bytes, cudaMemcpyDefault, AsStream(dest.stream)),
      "copy into " + Quoted(dest.name));
  return Status::OK();
}

Status CheckDeviceTensor(const DeviceTensor& tensor, int device) {
  if (DeviceCount() == 0) return NoDevice();
  return CheckTensor(tensor, "device tensor", Place::kDevice, device).status();
}

Status CopyBytes(std::string_view name, void* dest, const void* source, uint64_t bytes,
                 StreamHandle stream, bool wait) {
  if (bytes == 0) return Status::OK();
  if (DeviceCount() == 0) return NoDevice();
  if (dest == nullptr || source == nullptr) {
    return Status::InvalidArgument(Quoted(name) + ": a copy with a null pointer");
  }
  DS_CUDA_RETURN(cudaMemcpyAsync(dest, source, bytes, cudaMemcpyDefault, AsStream(stream)),
                 "copying " + Quoted(name));
  if (wait) DS_CUDA_RETURN(cudaStreamSynchronize(AsStream(stream)), "copying " + Quoted(name));
  return Status::OK();
}

Status ScatterRunsOnDevice(DeviceTensor& dest, const DeviceChanges& changes, const DeviceRun* runs,
                           uint64_t run_count) {
  if (DeviceCount() == 0) return NoDevice();
  if (changes.count == 0 || run_count == 0) return Status::OK();
  int device = 0;
  if (dest.data != nullptr) {
    DS_ASSIGN_OR_RETURN(const PointerInfo info, Inspect(dest.data));
    if (info.kind == MemoryKind::kDevice) device = info.device;
  }
  DS_RETURN_IF_ERROR(CheckTensor(dest, "destination", Place::kDevice, device).status());
  const uint32_t w = static_cast<uint32_t>(DTypeSize(dest.dtype));
  DS_RETURN_IF_ERROR(CheckPositionWidth(dest.name, changes));
  DS_RETURN_IF_ERROR(CheckDevicePointer(changes.positions, dest.name, "positions",
                                        PositionAlign(changes), device));
  DS_RETURN_IF_ERROR(CheckDevicePointer(changes.values, dest.name, "values", w, device));
  DS_RETURN_IF_ERROR(CheckDevicePointer(runs, dest.name, "runs", 8, device));
  static_assert(sizeof(DeviceRun) == sizeof(internal::RunLaunch));
  internal::ScatterRunsLaunch launch;
  launch.dest = dest.data;
  launch.dest_numel = dest.numel();
  launch.elem_size = w;
  launch.positions = changes.positions;
  launch.width = changes.width;
  launch.values = changes.values;
  launch.count = changes.count;
  launch.runs = reinterpret_cast<const internal::RunLaunch*>(runs);
  launch.nruns = run_count;
  launch.stream = AsStream(dest.stream);
  DS_CUDA_RETURN(internal::LaunchScatterRuns(launch), "scatter into " + Quoted(dest.name));
  return Status::OK();
}

uint64_t ScatterBatchBytes(uint64_t items) {
  return items * sizeof(internal::BatchItemLaunch) + (items + 1) * sizeof(uint64_t);
}

namespace {

// Pinned host memory a device's batched scatters stage their descriptors
// in (an upload from pageable memory goes through a staging copy of the
// driver's, and a fresh vector's pages fault in), reused once the last
// upload from it is done. Held for the life of the process.
struct BatchStaging {
  std::mutex mu;
  uint8_t* host = nullptr;
  uint64_t bytes = 0;
  cudaEvent_t uploaded = nullptr;  // recorded after the last upload
};

BatchStaging& StagingOf(int device) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<BatchStaging>> staging;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<BatchStaging>& s = staging[device];
  if (!s) s = std::make_unique<BatchStaging>();
  return *s;
}

}  // namespace

Status ScatterBatchOnDevice(std::string_view name, int device, std::span<const ScatterItem> items,
                            void* scratch, StreamHandle stream) {
  if (DeviceCount() == 0) return NoDevice();
  DS_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice");
  const std::string what = "batched scatter of " + std::string(name);
  uint64_t n = 0;
  for (const ScatterItem& it : items) {
    const DeviceChanges& c = it.changes;
    if (c.count == 0 || it.run_count == 0) continue;
    // Named only on a refusal: a batch may hold tens of thousands of items.
    const auto refuse = [&](const std::string& why) {
      return Status::InvalidArgument(what + ", item " + std::to_string(&it - items.data()) + ": " +
                                     why);
    };
    if (it.dest == nullptr || c.values == nullptr || it.runs == nullptr ||
        (c.width != 0 && c.positions == nullptr)) {
      return refuse("a null pointer");
    }
    if (it.elem_size != 1 && it.elem_size != 2 && it.elem_size != 4 && it.elem_size != 8) {
      return refuse("elements of " + std::to_string(it.elem_size) + " bytes");
    }
    if (c.width != 0 && c.width != 3 && c.width != 4 && c.width != 8) {
      return refuse("positions of " + std::to_string(c.width) + " bytes");
    }
    ++n;
  }
  if (n == 0) return Status::OK();
  if (scratch == nullptr) return Status::InvalidArgument(what + ": no descriptor memory");
  const uint64_t bytes = ScatterBatchBytes(n);
  BatchStaging& staging = StagingOf(device);
  std::lock_guard<std::mutex> lock(staging.mu);
  if (staging.uploaded == nullptr) {
    DS_CUDA_RETURN(cudaEventCreateWithFlags(&staging.uploaded, cudaEventDisableTiming), what);
  } else {
    DS_CUDA_RETURN(cudaEventSynchronize(staging.uploaded), what);
  }
  if (staging.bytes < bytes) {
    if (staging.host != nullptr) cudaFreeHost(staging.host);
    staging.host = nullptr;
    staging.bytes = 0;
    uint64_t grown = uint64_t{1} << 16;
    while (grown < bytes) grown *= 2;
    DS_CUDA_RETURN(cudaMallocHost(reinterpret_cast<void**>(&staging.host), grown),
                   what + ": pinned staging for its descriptors");
    staging.bytes = grown;
  }
  // The n launched items, then their n + 1 starts.
  auto* launches = reinterpret_cast<internal::BatchItemLaunch*>(staging.host);
  auto* starts = reinterpret_cast<uint64_t*>(staging.host + n * sizeof(*launches));
  uint64_t total = 0, k = 0;
  for (const ScatterItem& it : items) {
    const DeviceChanges& c = it.changes;
    if (c.count == 0 || it.run_count == 0) continue;
    launches[k] = {it.dest,
                   it.dest_numel,
                   c.width == 0 ? nullptr : c.positions,
                   c.values,
                   c.count,
                   it.first,
                   reinterpret_cast<const internal::RunLaunch*>(it.runs),
                   it.run_count,
                   it.elem_size,
                   c.width};
    starts[k++] = total;
    total += c.count;
  }
  starts[n] = total;
  DS_CUDA_RETURN(
      cudaMemcpyAsync(scratch, staging.host, bytes, cudaMemcpyHostToDevice, AsStream(stream)),
      what + ": its descriptors");
  DS_CUDA_RETURN(cudaEventRecord(staging.uploaded, AsStream(stream)), what);
  internal::ScatterBatchLaunch launch;
  launch.items = static_cast<internal::BatchItemLaunch*>(scratch);
  launch.starts =
      reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(scratch) + n * sizeof(*launches));
  launch.nitems = n;
  launch.total = total;
  launch.stream = AsStream(stream);
  DS_CUDA_RETURN(internal::LaunchScatterBatch(launch), what);
  return Status::OK();
}

Result<std::optional<uint64_t>> CheckFrameOnDevice(Workspace& ws, std::string_view name,
                                                   const void* base,
                                                   const std::vector<ZeroCheck>& zeros,
                                                   const std::vector<PositionCheck>& positions,
                                                   StreamHandle stream) {
  if (zeros.empty() && positions.empty()) return std::optional<uint64_t>();
  const std::string who = "frame of " + std::string(name);
  DS_RETURN_IF_ERROR(CheckDevicePointer(base, name, "frame", 8, ws.device()));
  // One upload: the zero checks, the position checks, their starts.
  std::vector<uint64_t> words;
  words.reserve(2 * zeros.size() + 6 * positions.size() + 1);
  for (const ZeroCheck& z : zeros) {
    words.push_back(z.offset);
    words.push_back(z.bytes);
  }
  uint64_t total = 0;
  std::vector<uint64_t> starts;
  for (size_t k = 0; k < positions.size(); ++k) {
    const PositionCheck& c = positions[k];
    if ((c.width != 3 && c.width != 4 && c.width != 8) || c.offset % 8 != 0) {
      return Status::InvalidArgument(who + ": position check " + std::to_string(k) + " has width " +
                                     std::to_string(c.width) + " at offset " +
                                     std::to_string(c.offset));
    }
    words.insert(words.end(), {c.offset, c.count, c.width, c.first, c.end});
    starts.push_back(total);
    total += c.count;
  }
  starts.push_back(total);
  words.insert(words.end(), starts.begin(), starts.end());
  DS_ASSIGN_OR_RETURN(unsigned long long* scratch, Impl(ws).Scratch(words.size() * 8));
  const cudaStream_t s = AsStream(stream);
  DS_CUDA_RETURN(
      cudaMemcpyAsync(scratch, words.data(), words.size() * 8, cudaMemcpyHostToDevice, s),
      "upload of the checks of the " + who);
  internal::FrameCheckLaunch launch;
  launch.base = static_cast<const uint8_t*>(base);
  launch.zeros = reinterpret_cast<const internal::FrameZero*>(scratch);
  launch.nzeros = zeros.size();
  launch.positions = reinterpret_cast<const internal::FramePositions*>(scratch + 2 * zeros.size());
  launch.npositions = positions.size();
  launch.starts =
      reinterpret_cast<const uint64_t*>(scratch + 2 * zeros.size() + 5 * positions.size());
  launch.total_positions = total;
  launch.results = Impl(ws).results();
  launch.stream = s;
  DS_CUDA_RETURN(internal::LaunchFrameCheck(launch), "checks of the " + who);
  DS_ASSIGN_OR_RETURN(const Results r, Impl(ws).Fetch(s));
  if (r.count == ~0ull) return std::optional<uint64_t>();
  return std::optional<uint64_t>(r.count);
}

Status CopyPositionsOnDevice(std::string_view name, void* dest, uint32_t dest_width,
                             const void* src, bool src_wide, uint64_t count, uint64_t add,
                             StreamHandle stream) {
  if (count == 0) return Status::OK();
  if (dest_width != 3 && dest_width != 4 && dest_width != 8) {
    return Status::InvalidArgument(Quoted(name) + ": positions of " + std::to_string(dest_width) +
                                   " bytes (3, 4 or 8)");
  }
  if (dest == nullptr || src == nullptr) {
    return Status::InvalidArgument(Quoted(name) + ": a position copy with a null pointer");
  }
  internal::CopyPositionsLaunch launch;
  launch.dest = dest;
  launch.dest_width = dest_width;
  launch.src = src;
  launch.src_wide = src_wide;
  launch.count = count;
  launch.add = add;
  launch.stream = AsStream(stream);
  DS_CUDA_RETURN(internal::LaunchCopyPositions(launch), "position copy of " + Quoted(name));
  return Status::OK();
}

Result<std::vector<uint64_t>> SplitPositionsOnDevice(Workspace& ws, std::string_view name,
                                                     const void* positions, bool wide,
                                                     uint64_t count, uint64_t unit, uint64_t units,
                                                     StreamHandle stream) {
  if (unit == 0) return Status::InvalidArgument(Quoted(name) + ": a unit of 0 elements");
  std::vector<uint64_t> offsets(units + 1, 0);
  if (count == 0) return offsets;
  DS_RETURN_IF_ERROR(CheckDevicePointer(positions, name, "positions", wide ? 8 : 4, ws.device()));
  DS_ASSIGN_OR_RETURN(unsigned long long* scratch, Impl(ws).Scratch((units + 1) * 8));
  internal::SplitLaunch launch;
  launch.positions = positions;
  launch.wide = wide;
  launch.count = count;
  launch.unit = unit;
  launch.units = units;
  launch.offsets = scratch;
  launch.stream = AsStream(stream);
  const std::string what = "unit split of " + Quoted(name);
  DS_CUDA_RETURN(internal::LaunchSplitPositions(launch), what);
  DS_CUDA_RETURN(cudaMemcpyAsync(offsets.data(), scratch, offsets.size() * 8,
                                 cudaMemcpyDeviceToHost, launch.stream),
                 what);
  DS_CUDA_RETURN(cudaStreamSynchronize(launch.stream), what);
  return offsets;
}

Status Synchronize(StreamHandle stream) {
  if (DeviceCount() == 0) return NoDevice();
  DS_CUDA_RETURN(cudaStreamSynchronize(AsStream(stream)), "cudaStreamSynchronize");
  return Status::OK();
}

Status ZeroBytes(std::string_view name, void* dest, uint64_t bytes, StreamHandle stream) {
  if (bytes == 0) return Status::OK();
  if (dest == nullptr) return Status::InvalidArgument(Quoted(name) + ": zeroing a null pointer");
  DS_CUDA_RETURN(cudaMemsetAsync(dest, 0, bytes, AsStream(stream)), "zeroing " + Quoted(name));
  return Status::OK();
}

Result<OwnedStream> OwnedStream::Create(int device) {
  if (DeviceCount() == 0) return NoDevice();
  DS_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t s = nullptr;
  DS_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  OwnedStream owned;
  owned.stream_ = s;
  return owned;
}

OwnedStream::OwnedStream(OwnedStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

OwnedStream& OwnedStream::operator=(OwnedStream&& other) noexcept {
  if (this != &other) {
    OwnedStream old(std::move(*this));
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

OwnedStream::~OwnedStream() {
  if (stream_ != nullptr) cudaStreamDestroy(AsStream(stream_));
}

Result<Digest> StateDigestOnDevice(Workspace& ws, const DeviceTensor& tensor,
                                   uint64_t first_position) {
  DS_RETURN_IF_ERROR(CheckTensor(tensor, "digest", Place::kDeviceOrPinned, ws.device()).status());
  const uint64_t numel = tensor.numel();
  DS_RETURN_IF_ERROR(CheckDigestRange(tensor.name, first_position, numel));
  if (numel == 0) return Digest{};
  DS_ASSIGN_OR_RETURN(unsigned long long* scratch,
                      Impl(ws).Scratch(2 * internal::kDigestMaxBlocks * 8));
  internal::DigestLaunch launch;
  launch.data = tensor.data;
  launch.numel = numel;
  launch.elem_size = static_cast<uint32_t>(DTypeSize(tensor.dtype));
  launch.aligned16 = Aligned16(tensor.data);
  launch.first_position = first_position;
  launch.partials = scratch;
  launch.results = Impl(ws).results();
  launch.stream = AsStream(tensor.stream);
  DS_CUDA_RETURN(internal::LaunchStateDigest(launch), "state digest of " + Quoted(tensor.name));
  DS_ASSIGN_OR_RETURN(const Results r, Impl(ws).Fetch(launch.stream));
  return Digest{r.a, r.b};
}

Result<Digest> DigestChangeOnDevice(Workspace& ws, std::string_view name, uint32_t elem_size,
                                    const DeviceChanges& changes, const void* old_values,
                                    uint64_t base, uint64_t limit, StreamHandle stream,
                                    const PositionBlock* block) {
  if (!IsElemSize(elem_size)) {
    return Status::InvalidArgument(Quoted(name) + ": element size " + std::to_string(elem_size) +
                                   " is not 1, 2, 4 or 8");
  }
  if (limit > kMaxNumel || base > kMaxNumel - limit) {
    return Status::InvalidArgument(Quoted(name) + ": positions past the 2^56 the digest allows");
  }
  if (changes.count == 0) return Digest{};
  const int device = ws.device();
  DS_RETURN_IF_ERROR(CheckDevicePointer(changes.values, name, "new values", elem_size, device));
  DS_RETURN_IF_ERROR(CheckDevicePointer(old_values, name, "old values", elem_size, device));
  DS_RETURN_IF_ERROR(CheckChanges(Impl(ws), name, changes, limit, stream));
  DS_ASSIGN_OR_RETURN(unsigned long long* scratch,
                      Impl(ws).Scratch(2 * internal::kDigestMaxBlocks * 8));
  internal::DigestLaunch launch;
  launch.numel = changes.count;
  launch.elem_size = elem_size;
  launch.positions = changes.positions;
  launch.width = changes.width;
  launch.old_values = old_values;
  launch.new_values = changes.values;
  launch.base = base;
  if (block != nullptr) {
    if (block->rows == 0 || (block->rows > 1 && block->row_stride <= block->count)) {
      return Status::InvalidArgument(Quoted(name) + ": a block of " + std::to_string(block->rows) +
                                     " rows of " + std::to_string(block->count) + " at stride " +
                                     std::to_string(block->row_stride));
    }
    launch.block_first = block->first;
    launch.block_count = block->count;
    launch.block_rows = block->rows;
    launch.block_row_stride = block->row_stride;
  }
  launch.partials = scratch;
  launch.results = Impl(ws).results();
  launch.stream = AsStream(stream);
  DS_CUDA_RETURN(internal::LaunchDigestChange(launch), "digest change of " + Quoted(name));
  DS_ASSIGN_OR_RETURN(const Results r, Impl(ws).Fetch(launch.stream));
  return Digest{r.a, r.b};
}

Result<Hash128> Xxh3_128OnDevice(Workspace& ws, std::string_view name, const void* data,
                                 uint64_t bytes, StreamHandle stream) {
  if (bytes > 0) {
    if (data == nullptr) return Status::InvalidArgument(Quoted(name) + ": null data");
    DS_ASSIGN_OR_RETURN(const PointerInfo info, Inspect(data));
    if (info.kind == MemoryKind::kHost) {
      return Status::InvalidArgument(Quoted(name) +
                                     ": host memory where the call needs device or pinned host "
                                     "memory");
    }
  }
  if (bytes <= 240) {
    // The short paths of xxh3 (no blocks, no chain): hashed here.
    unsigned char copy[240];
    if (bytes > 0) {
      DS_CUDA_RETURN(cudaMemcpyAsync(copy, data, bytes, cudaMemcpyDefault, AsStream(stream)),
                     "copy of " + Quoted(name));
      DS_CUDA_RETURN(cudaStreamSynchronize(AsStream(stream)), "cudaStreamSynchronize");
    }
    const XXH128_hash_t h = XXH3_128bits(copy, bytes);
    return Hash128{h.high64, h.low64};
  }
  const uint64_t blocks = internal::XxhBlocks(bytes);
  DS_ASSIGN_OR_RETURN(unsigned long long* scratch,
                      Impl(ws).Scratch(std::max<uint64_t>(blocks, 1) * 64));
  internal::XxhLaunch launch;
  launch.data = data;
  launch.bytes = bytes;
  launch.block_sums = scratch;
  launch.results = Impl(ws).results();
  launch.stream = AsStream(stream);
  DS_CUDA_RETURN(internal::LaunchXxh3_128(launch), "xxh3-128 of " + Quoted(name));
  DS_ASSIGN_OR_RETURN(const Results r, Impl(ws).Fetch(launch.stream));
  return Hash128{r.a, r.b};
}

}  // namespace deltasync::cuda
