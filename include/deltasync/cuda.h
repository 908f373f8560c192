// The GPU data path (module `cuda`, built when CUDA is found:
// DELTASYNC_WITH_CUDA=AUTO|ON|OFF): the diff, compaction, apply and checksum
// kernels of the online transport on CUDA tensors. Each kernel gives, for the
// same bytes, exactly what the CPU code gives (include/deltasync/diff.h; the
// state digest and the flush checksum of docs/format.md), and the CPU code
// stays the reference the tests hold them to.
//
//   auto ws = cuda::Workspace::Create(/*device=*/0).value();
//   cuda::DeviceTensor w{"layer.0.weight", DType::kBF16, {4096, 4096}, ptr, stream};
//   cuda::DeviceTensor snap{"layer.0.weight", DType::kBF16, {4096, 4096}, snap_ptr, stream};
//   auto changes = cuda::DiffOnDevice(*ws, w, snap, out).value();   // out: cuda::DiffOutput
//
// Every call checks its arguments before it launches anything: a pointer
// that is not where the call needs it (a host pointer given as a device
// one), a misaligned or non-contiguous tensor, tensors whose dtypes or
// shapes differ, positions out of range. The error names the tensor and the
// problem; nothing is written then. CUDA's own errors are checked after
// every launch and come back as Status, never as a device fault left for a
// later call to find.
//
// Work is ordered on the tensors' stream (the caller's current stream, as
// torch's is). Calls that return a count or a checksum wait for that stream;
// the others only enqueue. A Workspace is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deltasync/dtype.h"
#include "deltasync/quantize.h"
#include "deltasync/status.h"

namespace deltasync::cuda {

// A cudaStream_t, opaque here; nullptr is the default stream.
using StreamHandle = void*;

// CUDA devices this process can use; 0 when there is no driver or no GPU
// (not an error: callers skip the GPU path then).
int DeviceCount();

// Where a pointer's memory lives.
enum class MemoryKind : uint8_t {
  kHost,        // ordinary host memory: no kernel may touch it
  kPinnedHost,  // page-locked host memory mapped into the device's space
  kDevice,      // device memory
  kManaged,     // CUDA managed memory
};
std::string_view MemoryKindName(MemoryKind kind);
// By cudaPointerGetAttributes; FailedPrecondition without a device.
Result<MemoryKind> QueryMemory(const void* pointer);

// A tensor in device memory (or, where a call says so, pinned host memory),
// with the stream that orders work on it. `strides` (in elements) may be
// empty for a contiguous tensor; given, they must be the contiguous ones:
// every call here works on contiguous tensors and refuses others by name.
struct DeviceTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  void* data = nullptr;
  StreamHandle stream = nullptr;
  std::vector<int64_t> strides;

  // Elements by the shape (0 for a malformed one).
  uint64_t numel() const;
  uint64_t nbytes() const { return numel() * DTypeSize(dtype); }
};

// That `tensor` is what the kernels take as a device tensor on `device`:
// a known dtype, a valid contiguous shape, element-aligned data in that
// device's memory (or managed memory). InvalidArgument naming the tensor
// and the problem otherwise (a host pointer: "host memory where the call
// needs device memory").
Status CheckDeviceTensor(const DeviceTensor& tensor, int device);

// The 128-bit state digest of docs/format.md ("Stream: state digest"):
// lane A and lane B, each a sum mod 2^64.
struct Digest {
  uint64_t a = 0;
  uint64_t b = 0;
  bool operator==(const Digest&) const = default;
};

// An xxh3-128 hash: Python's xxhash.xxh3_128(data).digest() is high64 then
// low64, each most significant byte first.
struct Hash128 {
  uint64_t high64 = 0;
  uint64_t low64 = 0;
  bool operator==(const Hash128&) const = default;
};

// Device scratch for the kernels (the scan's tile states, partial sums, a
// pinned slot for results) on one device, grown as calls need it.
class Workspace {
 public:
  // FailedPrecondition without a device; InvalidArgument for a device
  // index out of range.
  static Result<std::unique_ptr<Workspace>> Create(int device = 0);
  virtual ~Workspace() = default;
  virtual int device() const = 0;
};

// Device memory, freed on destruction (cudaFree), or page-locked host
// memory mapped into the device's space (cudaHostAlloc), which kernels read
// and write over PCIe: the placement for a snapshot that the GPU cannot
// spare memory for.
class Buffer {
 public:
  static Result<Buffer> Device(uint64_t bytes, int device = 0);
  static Result<Buffer> PinnedHost(uint64_t bytes);
  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool pinned_host() const { return pinned_; }

 private:
  void* data_ = nullptr;
  uint64_t size_ = 0;
  bool pinned_ = false;
};

// Where DiffOnDevice writes what changed, in device memory. Positions are
// element indices from the tensor's start, ascending, int32 while the
// tensor has fewer than 2^31 elements and int64 from there (`wide`).
struct DiffOutput {
  void* positions = nullptr;     // at least numel elements of int32 or int64
  void* values = nullptr;        // at least numel elements: the new values
  void* old_values = nullptr;    // optional, as values: the snapshot's values
  uint64_t capacity = 0;         // elements each buffer holds
  bool refresh_snapshot = true;  // write the changed elements into the snapshot
  bool digest = true;            // compute the digest change
  uint64_t first_position = 0;   // the tensor's element 0 in the digest's flat coordinates
};

struct DiffResult {
  uint64_t count = 0;  // changed elements (positions and values written)
  bool wide = false;   // positions are int64
  // With DiffOutput::digest: digest(new) - digest(old) over the changed
  // elements, at their positions + first_position; add it to the
  // tensor's running digest.
  Digest digest_change;
};

// The fused diff: compares `current` (device memory) with `snapshot`
// (device or pinned host memory, same dtype and shape) bit-exactly as
// integers of the element size, writes the changed elements' positions and
// values (and old values) in order, refreshes the snapshot's changed
// elements (rewriting only the 16-byte groups that hold a change, so a
// pinned host snapshot takes only those writes over PCIe) and sums the
// digest change, in one pass over the two tensors. Waits for the stream.
// InvalidArgument naming the tensor for any bad argument (above), an output
// capacity below numel or a tensor of 2^56 elements or more.
Result<DiffResult> DiffOnDevice(Workspace& ws, const DeviceTensor& current, DeviceTensor& snapshot,
                                const DiffOutput& out);

// Quantize-then-diff on the device: the F8_E4M3 codes and scales of
// `weight` (device memory, BF16, F16 or F32, [rows, cols], contiguous)
// under `recipe`, exactly as deltasync/quantize.h's Fp8Quantize makes them
// on the CPU, diffed against `code_snapshot` (F8_E4M3, the weight's shape)
// and `scale_snapshot` (QuantScaleDType, QuantScaleShape), both in device or
// pinned host memory, as DiffOnDevice diffs: the codes' changes go to
// `code_out` (1-byte values), the scales' to `scale_out`, and each snapshot
// takes its changes when its output says so. One pass over the weight takes
// the scale groups' amax; a second quantizes each element as the diff reads
// it, compares its code with the snapshot's and compacts the changes, so the
// codes are never written out whole. A group whose scale changed shows in
// `scales` with its new scale, and every code of it that changed in `codes`.
// Waits for the weight's stream. InvalidArgument naming the tensor for a bad
// argument (DiffOnDevice's, CheckQuantRecipe's, a weight that is not 2-D of
// those dtypes, snapshots of the wrong dtype or shape) and for a weight that
// holds a NaN or an infinity: then nothing is written.
struct QuantDiffResult {
  DiffResult codes;
  DiffResult scales;
};
Result<QuantDiffResult> QuantizeDiffOnDevice(Workspace& ws, const QuantRecipe& recipe,
                                             const DeviceTensor& weight,
                                             DeviceTensor& code_snapshot,
                                             DeviceTensor& scale_snapshot,
                                             const DiffOutput& code_out,
                                             const DiffOutput& scale_out);

// The same quantization without a diff: the F8_E4M3 codes of `weight` into
// `codes` (rows * cols bytes of device memory) and its scales into `scales`
// (device memory of QuantScaleShape elements of QuantScaleDType), as
// Fp8Quantize makes them. Waits for the weight's stream. InvalidArgument
// naming the tensor for a bad argument and for a weight that holds a NaN or
// an infinity (then nothing is written).
Status QuantizeOnDevice(Workspace& ws, const QuantRecipe& recipe, const DeviceTensor& weight,
                        void* codes, void* scales);

// Changes to apply on the device: `count` positions into `dest`'s
// elements, strictly ascending, of `width` bytes each (3: u24, a flush
// frame's positions in a tensor of at most 2^24 elements; 4: int32; 8:
// int64), and their values, all in device memory.
struct DeviceChanges {
  const void* positions = nullptr;
  uint32_t width = 4;
  const void* values = nullptr;
  uint64_t count = 0;
};

// Writes each value at its position in `dest` (device memory), in place:
// every bit pattern is a value (no NaN staging). The positions are checked
// on the device first (in range, strictly ascending); InvalidArgument naming
// the tensor and the first bad index, with `dest` untouched, otherwise.
// Waits for the stream (the check's outcome).
Status ScatterOnDevice(Workspace& ws, DeviceTensor& dest, const DeviceChanges& changes);

// The dense seed: copies nbytes() of `source` (host, pinned host or device
// memory) into `dest` (device memory) on dest's stream. Enqueues only.
Status CopyToDevice(DeviceTensor& dest, const void* source, uint64_t source_bytes);

// Copies `bytes` bytes from `source` to `dest`, each host, pinned host or
// device memory, on `stream` (the stream layer's staging of changes and
// values between a device and its frames); with `wait`, waits for the
// stream. InvalidArgument naming `name` for a null pointer with bytes > 0.
Status CopyBytes(std::string_view name, void* dest, const void* source, uint64_t bytes,
                 StreamHandle stream, bool wait);

// Writes each value whose position falls in one of `runs` (stride-1 runs
// of the receiver's map: tensor elements hf_first + k live at dest element
// dest_offset + k) at that element of `dest`, in place, and skips the
// others: the apply of a frame entry into a slice the receiver holds.
// `changes` are absolute tensor positions that the caller has checked
// (CheckFrameOnDevice); a destination element past `dest` is never
// written. `runs` is device memory (ascending hf_first, not overlapping).
// Enqueues only.
struct DeviceRun {
  uint64_t hf_first = 0;
  uint64_t count = 0;
  uint64_t dest_offset = 0;
};
Status ScatterRunsOnDevice(DeviceTensor& dest, const DeviceChanges& changes, const DeviceRun* runs,
                           uint64_t run_count);

// One entry of a batched scatter: `changes` (absolute tensor positions the
// caller has checked, as ScatterRunsOnDevice takes them; a `width` of 0: a
// dense range, value k at tensor position `first` + k) written through the
// stride-1 `runs` (device memory, ascending hf_first) into `dest`, a
// destination of `dest_numel` elements of `elem_size` bytes (1, 2, 4 or 8).
struct ScatterItem {
  void* dest = nullptr;
  uint64_t dest_numel = 0;
  uint32_t elem_size = 2;
  DeviceChanges changes;
  uint64_t first = 0;
  const DeviceRun* runs = nullptr;
  uint64_t run_count = 0;
};
// Device memory a batch of `items` items needs for its descriptors.
uint64_t ScatterBatchBytes(uint64_t items);
// Every item's scatter in one kernel launch on `stream` (of CUDA device
// `device`, made current), whatever the number of items: the items write
// disjoint elements (they run in no order), the descriptors go up into
// `scratch` (device memory of
// ScatterBatchBytes(items.size()) bytes that stays untouched until the
// launch ran), then one thread per value finds its item. The pointers are
// the caller's to vouch for (they are not inspected one by one: a frame
// may hold thousands of entries). InvalidArgument naming `name` for a null
// pointer or an element size or width it cannot take. Enqueues only (the
// descriptors' copy may wait for work queued on `stream` before it).
Status ScatterBatchOnDevice(std::string_view name, int device, std::span<const ScatterItem> items,
                            void* scratch, StreamHandle stream);

// Checks of a flush frame's payload in device memory (docs/format.md,
// "Rules the reader enforces", 9 and 10): `bytes` bytes at base + offset
// are 0 (padding), or `count` positions of `width` bytes (3, 4 or 8) at base +
// offset are strictly increasing inside [first, end).
struct ZeroCheck {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
struct PositionCheck {
  uint64_t offset = 0;
  uint64_t count = 0;
  uint32_t width = 4;
  uint64_t first = 0;
  uint64_t end = 0;
};
// Runs every check in one pass: the index of the first that fails (the
// zero checks first, then position check k as zeros.size() + k), or
// nullopt when all hold. `base` is device memory of the workspace's device;
// offsets are 8-byte aligned. Waits for the stream.
Result<std::optional<uint64_t>> CheckFrameOnDevice(Workspace& ws, std::string_view name,
                                                   const void* base,
                                                   const std::vector<ZeroCheck>& zeros,
                                                   const std::vector<PositionCheck>& positions,
                                                   StreamHandle stream);

// Copies `count` positions (int32, or int64 with src_wide) to `dest`
// (`dest_width` bytes each: 3 for u24, 4 or 8), adding `add` to each: a
// chunk's diff positions made a frame's absolute ones. Device memory.
// Enqueues only.
Status CopyPositionsOnDevice(std::string_view name, void* dest, uint32_t dest_width,
                             const void* src, bool src_wide, uint64_t count, uint64_t add,
                             StreamHandle stream);

// For `count` ascending positions (int32, or int64 with `wide`) in device
// memory, offsets[k] = how many are below k * unit, for k = 0 .. units:
// where each unit of a diffed chunk starts among its changes. Waits.
Result<std::vector<uint64_t>> SplitPositionsOnDevice(Workspace& ws, std::string_view name,
                                                     const void* positions, bool wide,
                                                     uint64_t count, uint64_t unit, uint64_t units,
                                                     StreamHandle stream);

// Waits for the work queued on `stream`.
Status Synchronize(StreamHandle stream);

// Sets `bytes` bytes of device memory at `dest` to 0 on `stream`. Enqueues
// only.
Status ZeroBytes(std::string_view name, void* dest, uint64_t bytes, StreamHandle stream);

// A stream of this module's own on one device, that does not wait for the
// legacy default stream (the stream layer's receiver checks its frames on
// one), destroyed with it.
class OwnedStream {
 public:
  static Result<OwnedStream> Create(int device);
  OwnedStream() = default;
  OwnedStream(OwnedStream&& other) noexcept;
  OwnedStream& operator=(OwnedStream&& other) noexcept;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream();
  StreamHandle get() const { return stream_; }

 private:
  StreamHandle stream_ = nullptr;
};

// The state digest of `tensor`'s elements (device or pinned host memory)
// at flat positions first_position, first_position + 1, ... Waits for the
// stream.
Result<Digest> StateDigestOnDevice(Workspace& ws, const DeviceTensor& tensor,
                                   uint64_t first_position = 0);

// A block of flat positions (docs/format.md, "Stream: state digest"):
// first + r * row_stride + c for r < rows, c < count.
struct PositionBlock {
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t rows = 1;
  uint64_t row_stride = 0;
};

// The digest change of elements at `changes.positions + base` going from
// `old_values` to the changes' values (both device memory, elem_size
// each): digest(new) - digest(old); with `block`, over the elements whose
// position + base lies in it only (a receiver's slice). Positions as
// ScatterOnDevice checks them, against `limit`. Waits for the stream.
Result<Digest> DigestChangeOnDevice(Workspace& ws, std::string_view name, uint32_t elem_size,
                                    const DeviceChanges& changes, const void* old_values,
                                    uint64_t base, uint64_t limit, StreamHandle stream,
                                    const PositionBlock* block = nullptr);

// xxh3-128 (the flush frame's trailer) of `bytes` bytes at `data` (device
// or pinned host memory), the same value libxxhash's XXH3_128bits gives.
// Inputs of 240 bytes or fewer are hashed on the host (their hash has other
// paths and costs nothing). Waits for the stream.
Result<Hash128> Xxh3_128OnDevice(Workspace& ws, std::string_view name, const void* data,
                                 uint64_t bytes, StreamHandle stream);

}  // namespace deltasync::cuda
