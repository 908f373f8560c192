// The stream's device tensors (stream/device_path.h) on the cuda module.
#include "stream/device_path.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>

#if DS_HAVE_CUDA
#include <set>

#include "core/endian.h"
#include "deltasync/cuda.h"
#endif

namespace deltasync::stream {

#if !DS_HAVE_CUDA

bool DevicePathBuilt() { return false; }

namespace {
Status NotBuilt(const std::string& what) {
  return Status::Unsupported(what +
                             ": CUDA device memory, but this build of deltasync has no CUDA");
}
}  // namespace

Result<std::unique_ptr<DeviceContext>> DeviceContext::Create(int cuda_device) {
  return NotBuilt("CUDA device " + std::to_string(cuda_device));
}
Result<std::unique_ptr<DeviceSource>> DeviceSource::Create(DeviceContext&, std::string name, DType,
                                                           uint64_t, uint64_t, uint64_t, bool) {
  return NotBuilt("tensor '" + name + "'");
}
Result<std::unique_ptr<DeviceFrame>> DeviceFrame::Create(DeviceContext& ctx, uint64_t) {
  return NotBuilt("a frame on CUDA device " + std::to_string(ctx.device()));
}
Result<std::unique_ptr<DeviceFrameReader>> DeviceFrameReader::Create(DeviceContext& ctx) {
  return NotBuilt("a frame on CUDA device " + std::to_string(ctx.device()));
}
Result<std::unique_ptr<DeviceDestination>> DeviceDestination::Create(DeviceContext&,
                                                                     std::string name, DType,
                                                                     const DestinationMap&,
                                                                     std::span<uint8_t>,
                                                                     const Placement&) {
  return NotBuilt("tensor '" + name + "'");
}
Result<std::unique_ptr<DeviceBatch>> DeviceBatch::Create(DeviceContext& ctx) {
  return NotBuilt("a frame on CUDA device " + std::to_string(ctx.device()));
}
Result<std::unique_ptr<HostFrameUpload>> HostFrameUpload::Create(DeviceContext& ctx) {
  return NotBuilt("a frame on CUDA device " + std::to_string(ctx.device()));
}
Result<std::unique_ptr<DeviceQuantized>> DeviceQuantized::Create(DeviceContext& ctx) {
  return NotBuilt("a weight quantized on CUDA device " + std::to_string(ctx.device()));
}

#else

bool DevicePathBuilt() { return true; }

namespace {

std::string Quoted(std::string_view name) { return "tensor '" + std::string(name) + "'"; }

StateDigest FromDevice(const cuda::Digest& d) { return StateDigest{d.a, d.b}; }

// Grows `buffer` to at least `bytes` (device memory of `device`, or pinned
// host memory for device -1); its contents are not kept. It grows to the
// next power of two, so that entries and chunks of slightly different sizes
// do not reallocate it time after time: freeing device or pinned memory
// waits for the whole device, and allocating pinned memory maps it for
// the device, each far slower than the copy the buffer serves.
Status Reserve(cuda::Buffer* buffer, uint64_t bytes, int device) {
  if (buffer->size() >= bytes) return Status::OK();
  *buffer = cuda::Buffer();
  uint64_t size = uint64_t{1} << 16;
  while (size < bytes) size *= 2;
  Result<cuda::Buffer> b =
      device < 0 ? cuda::Buffer::PinnedHost(size) : cuda::Buffer::Device(size, device);
  if (!b.ok()) return b.status();
  *buffer = std::move(*b);
  return Status::OK();
}

uint8_t* Bytes(const cuda::Buffer& b) { return static_cast<uint8_t*>(b.data()); }

class ContextImpl final : public DeviceContext {
 public:
  ContextImpl(int device, std::unique_ptr<cuda::Workspace> ws)
      : device_(device), ws_(std::move(ws)) {}
  int device() const override { return device_; }
  uint64_t buffer_bytes() const override {
    return positions.size() + values.size() + old_values.size() + changes.size() + dense.size() +
           staging.size();
  }
  cuda::Workspace& ws() { return *ws_; }

  // Device scratch: the diff's outputs, the apply's positions and values.
  cuda::Buffer positions, values, old_values;
  // The stream whose work last read the diff's outputs (copies into
  // device frames), when one did: a diff on another stream waits for it.
  std::optional<void*> scratch_stream;
  // Pinned host: a chunk's changes coming back; a unit's dense values; an
  // entry's positions and values going up.
  cuda::Buffer changes, dense, staging;

 private:
  int device_;
  std::unique_ptr<cuda::Workspace> ws_;
};

ContextImpl& Impl(DeviceContext& ctx) { return static_cast<ContextImpl&>(ctx); }

class SourceImpl final : public DeviceSource {
 public:
  SourceImpl(ContextImpl& ctx, std::string name, DType dtype, uint64_t numel, uint64_t unit,
             uint64_t chunk, cuda::Buffer snapshot)
      : ctx_(ctx),
        name_(std::move(name)),
        dtype_(dtype),
        w_(static_cast<uint32_t>(DTypeSize(dtype))),
        numel_(numel),
        unit_(unit),
        chunk_(chunk),
        snapshot_(std::move(snapshot)) {}

  Status Begin(std::span<const uint8_t> bytes, const Placement& place) override {
    if (place.cuda_device != ctx_.device()) {
      return Status::InvalidArgument(
          Quoted(name_) + ": on CUDA device " + std::to_string(place.cuda_device) +
          ", the first sync had it on device " + std::to_string(ctx_.device()));
    }
    cuda::DeviceTensor t = View(bytes.data(), 0, numel_);
    t.stream = place.cuda_stream;
    DS_RETURN_IF_ERROR(cuda::CheckDeviceTensor(t, ctx_.device()));
    current_ = bytes.data();
    stream_ = place.cuda_stream;
    chunk_count_ = 0;
    return Status::OK();
  }

  Status Changes(uint64_t first, uint64_t count, ChangeSet* out) override {
    DS_ASSIGN_OR_RETURN(const Slice s, Unit(first, count));
    if (!on_host_) DS_RETURN_IF_ERROR(ChunkToHost());
    const uint32_t pw = wide_ ? 8 : 4;
    const uint8_t* pos = Bytes(ctx_.changes);
    const uint64_t lo = first - chunk_first_;
    out->Clear();
    out->numel = count;
    out->elem_size = w_;
    out->wide = false;  // a unit has fewer than 2^31 elements
    out->pos32.resize(s.n);
    for (uint64_t k = 0; k < s.n; ++k) {
      const uint8_t* p = pos + (s.k0 + k) * pw;
      const uint64_t at = wide_ ? LoadLe<uint64_t>(p) : LoadLe<uint32_t>(p);
      out->pos32[k] = static_cast<uint32_t>(at - lo);
    }
    const uint8_t* values = pos + changed_ * pw;
    const uint8_t* old_values = values + changed_ * w_;
    out->new_values.assign(values + s.k0 * w_, values + (s.k0 + s.n) * w_);
    out->old_values.assign(old_values + s.k0 * w_, old_values + (s.k0 + s.n) * w_);
    return Status::OK();
  }

  Result<DeviceUnitChanges> DeviceChanges(uint64_t first, uint64_t count) override {
    DS_ASSIGN_OR_RETURN(const Slice s, Unit(first, count));
    const uint32_t pw = wide_ ? 8 : 4;
    DeviceUnitChanges c;
    c.positions = Bytes(ctx_.positions) + s.k0 * pw;
    c.wide = wide_;
    c.base = chunk_first_;
    c.values = Bytes(ctx_.values) + s.k0 * w_;
    c.old_values = Bytes(ctx_.old_values) + s.k0 * w_;
    c.count = s.n;
    return c;
  }

  Result<StateDigest> BlockDigestChange(const DeviceUnitChanges& c,
                                        const DigestBlock& block) override {
    const cuda::DeviceChanges changes{c.positions, c.wide ? 8u : 4u, c.values, c.count};
    const cuda::PositionBlock b{block.first, block.count, block.rows, block.row_stride};
    DS_ASSIGN_OR_RETURN(cuda::Digest d,
                        cuda::DigestChangeOnDevice(ctx_.ws(), name_, w_, changes, c.old_values,
                                                   c.base, numel_ - c.base, stream_, &b));
    return FromDevice(d);
  }

  const uint8_t* current(uint64_t first) const override { return current_ + first * w_; }
  void* stream() const override { return stream_; }

  Result<StateDigest> WholeDigest(uint64_t first, uint64_t count, bool seed) override {
    if (seed) {
      cuda::DeviceTensor t = View(current_, first, count);
      DS_ASSIGN_OR_RETURN(cuda::Digest d, cuda::StateDigestOnDevice(ctx_.ws(), t, first));
      return FromDevice(d);
    }
    if (chunk_count_ == 0 || first != chunk_first_) return StateDigest{};
    return chunk_digest_;
  }

  Result<std::span<const uint8_t>> Dense(uint64_t first, uint64_t count) override {
    const uint64_t bytes = count * w_;
    DS_RETURN_IF_ERROR(Reserve(&ctx_.dense, bytes, -1));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, ctx_.dense.data(), current_ + first * w_, bytes,
                                       stream_, /*wait=*/true));
    return std::span<const uint8_t>(Bytes(ctx_.dense), bytes);
  }

  Result<std::span<const uint8_t>> Committed(uint64_t first, uint64_t count) override {
    if (!have_) return Status::FailedPrecondition(Quoted(name_) + ": no committed snapshot");
    const uint64_t bytes = count * w_;
    DS_RETURN_IF_ERROR(Reserve(&ctx_.dense, bytes, -1));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, ctx_.dense.data(), Bytes(snapshot_) + first * w_,
                                       bytes, stream_, /*wait=*/true));
    return std::span<const uint8_t>(Bytes(ctx_.dense), bytes);
  }

  Status Commit() override {
    chunk_count_ = 0;
    have_ = false;
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, snapshot_.data(), current_, numel_ * w_, stream_,
                                       /*wait=*/true));
    have_ = true;
    return Status::OK();
  }

  void Rollback() override { chunk_count_ = 0; }

  Result<StateDigest> SnapshotDigest(const DigestBlock& block) override {
    if (!have_) return Status::FailedPrecondition(Quoted(name_) + ": no committed snapshot");
    if (block.first == 0 && block.count == numel_ && block.rows == 1) {
      cuda::DeviceTensor t = View(Bytes(snapshot_), 0, numel_);
      DS_ASSIGN_OR_RETURN(cuda::Digest d, cuda::StateDigestOnDevice(ctx_.ws(), t, 0));
      return FromDevice(d);
    }
    // A part: digested on the host (a receiver joining with a slice).
    std::vector<uint8_t> host(numel_ * w_);
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, host.data(), Bytes(snapshot_), host.size(), stream_,
                                       /*wait=*/true));
    return ComputeBlockPartDigest(host, w_, 0, block);
  }

  std::span<const uint8_t> snapshot() const override {
    if (!have_) return {};
    return {Bytes(snapshot_), numel_ * w_};
  }
  uint64_t buffer_bytes() const override { return offsets_.capacity() * 8; }

 private:
  // A unit's changes among its chunk's: [k0, k0 + n).
  struct Slice {
    uint64_t k0 = 0;
    uint64_t n = 0;
  };

  // The unit at `first` (a multiple of the unit) within its chunk, which is
  // diffed first when it is not the current one.
  Result<Slice> Unit(uint64_t first, uint64_t count) {
    if (chunk_count_ == 0 || first < chunk_first_ || first + count > chunk_first_ + chunk_count_) {
      DS_RETURN_IF_ERROR(DiffChunk(first - first % chunk_));
    }
    const uint64_t u = (first - chunk_first_) / unit_;
    if (u + 1 >= offsets_.size()) {
      return Status::Internal(Quoted(name_) + ": unit at " + std::to_string(first) +
                              " outside its diffed chunk");
    }
    return Slice{offsets_[u], offsets_[u + 1] - offsets_[u]};
  }

  cuda::DeviceTensor View(const uint8_t* base, uint64_t first, uint64_t count) const {
    cuda::DeviceTensor t;
    t.name = name_;
    t.dtype = dtype_;
    t.shape = {static_cast<int64_t>(count)};
    t.data = const_cast<uint8_t*>(base) + first * w_;
    t.stream = stream_;
    return t;
  }

  // Diffs the chunk at `first` on the device into the context's scratch
  // (the snapshot is not written) and splits its changes by unit.
  Status DiffChunk(uint64_t first) {
    const uint64_t count = std::min(chunk_, numel_ - first);
    const uint32_t pw = count >= (uint64_t{1} << 31) ? 8 : 4;
    DS_RETURN_IF_ERROR(Reserve(&ctx_.positions, count * pw, ctx_.device()));
    DS_RETURN_IF_ERROR(Reserve(&ctx_.values, count * w_, ctx_.device()));
    DS_RETURN_IF_ERROR(Reserve(&ctx_.old_values, count * w_, ctx_.device()));
    cuda::DeviceTensor cur = View(current_, first, count);
    cuda::DeviceTensor snap = View(Bytes(snapshot_), first, count);
    // The last chunk's changes may still be copied into a frame on another
    // tensor's stream.
    if (ctx_.scratch_stream && *ctx_.scratch_stream != stream_) {
      DS_RETURN_IF_ERROR(cuda::Synchronize(*ctx_.scratch_stream));
    }
    ctx_.scratch_stream = stream_;
    cuda::DiffOutput out;
    out.positions = ctx_.positions.data();
    out.values = ctx_.values.data();
    out.old_values = ctx_.old_values.data();
    out.capacity = count;
    out.refresh_snapshot = false;
    out.digest = true;
    out.first_position = first;
    chunk_count_ = 0;
    DS_ASSIGN_OR_RETURN(cuda::DiffResult r, cuda::DiffOnDevice(ctx_.ws(), cur, snap, out));
    const uint64_t units = (count + unit_ - 1) / unit_;
    DS_ASSIGN_OR_RETURN(
        offsets_, cuda::SplitPositionsOnDevice(ctx_.ws(), name_, out.positions, r.wide, r.count,
                                               unit_, units, stream_));
    wide_ = r.wide;
    changed_ = r.count;
    on_host_ = false;
    chunk_first_ = first;
    chunk_count_ = count;
    chunk_digest_ = FromDevice(r.digest_change);
    return Status::OK();
  }

  // Brings the diffed chunk's changes into the pinned staging.
  Status ChunkToHost() {
    const uint64_t pos_bytes = changed_ * (wide_ ? 8 : 4);
    const uint64_t val_bytes = changed_ * w_;
    DS_RETURN_IF_ERROR(Reserve(&ctx_.changes, pos_bytes + 2 * val_bytes, -1));
    uint8_t* host = Bytes(ctx_.changes);
    DS_RETURN_IF_ERROR(
        cuda::CopyBytes(name_, host, ctx_.positions.data(), pos_bytes, stream_, false));
    DS_RETURN_IF_ERROR(
        cuda::CopyBytes(name_, host + pos_bytes, ctx_.values.data(), val_bytes, stream_, false));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, host + pos_bytes + val_bytes, ctx_.old_values.data(),
                                       val_bytes, stream_, true));
    on_host_ = true;
    return Status::OK();
  }

  ContextImpl& ctx_;
  std::string name_;
  DType dtype_;
  uint32_t w_;
  uint64_t numel_;
  uint64_t unit_;
  uint64_t chunk_;
  cuda::Buffer snapshot_;
  bool have_ = false;
  const uint8_t* current_ = nullptr;
  void* stream_ = nullptr;
  uint64_t chunk_first_ = 0;
  uint64_t chunk_count_ = 0;  // 0: no chunk diffed
  StateDigest chunk_digest_;
  std::vector<uint64_t> offsets_;  // per unit of the chunk, where its changes start
  bool wide_ = false;
  uint64_t changed_ = 0;
  bool on_host_ = false;
};

class DestinationImpl final : public DeviceDestination {
 public:
  DestinationImpl(ContextImpl& ctx, std::string name, DType dtype, DestinationMap map,
                  uint8_t* dest, void* stream, cuda::Buffer device_runs)
      : ctx_(ctx),
        name_(std::move(name)),
        dtype_(dtype),
        w_(static_cast<uint32_t>(DTypeSize(dtype))),
        map_(std::move(map)),
        dest_(dest),
        stream_(stream),
        runs_(std::move(device_runs)) {
    const auto runs = map_.runs();
    whole_ = runs.size() == 1 && runs[0].hf_first == 0 && runs[0].count == map_.hf_numel() &&
             runs[0].dest_offset == 0;
  }

  Result<uint64_t> Apply(const FlushEntry& e) override {
    const auto runs = map_.runs();
    if (e.value_count == 0) return uint64_t{0};
    if (!e.host_readable && e.encoding == WireEncoding::kIndices) {
      // Straight from the device bucket, through the runs: the frame's
      // check proved the positions inside the entry's range.
      cuda::DeviceTensor dest = View(0, map_.dest_extent());
      const cuda::DeviceChanges changes{e.positions.data(), e.position_width, e.values.data(),
                                        e.value_count};
      DS_RETURN_IF_ERROR(cuda::ScatterRunsOnDevice(
          dest, changes, static_cast<const cuda::DeviceRun*>(runs_.data()), runs.size()));
      return e.value_count;
    }
    if (!e.host_readable && e.encoding != WireEncoding::kDense) {
      return Status::Internal(Quoted(name_) + ": a " + std::string(WireEncodingName(e.encoding)) +
                              " entry left in device memory");
    }
    if (e.encoding == WireEncoding::kDense) {
      // Contiguous pieces, one per run the range meets.
      uint64_t written = 0;
      const uint64_t end = e.first + e.count;
      for (const DestinationRun& r : runs) {
        const uint64_t lo = std::max(r.hf_first, e.first);
        const uint64_t hi = std::min(r.hf_first + r.count, end);
        if (lo >= hi) continue;
        DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, dest_ + (r.dest_offset + lo - r.hf_first) * w_,
                                           e.values.data() + (lo - e.first) * w_, (hi - lo) * w_,
                                           stream_, false));
        written += hi - lo;
      }
      return written;
    }
    const void* positions = nullptr;
    uint32_t width = 8;  // the gathered destination positions below are int64
    const void* values = e.values.data();
    uint64_t n = e.value_count;
    if (whole_ && e.encoding == WireEncoding::kIndices) {
      positions = e.positions.data();
      width = e.position_width;
    } else {
      // Destination positions of the held elements, in order (the runs
      // ascend in the destination), and their values.
      dest_positions_.clear();
      gathered_.clear();
      size_t run = 0;
      ForEachPosition(e, [&](uint64_t k, uint64_t p) {
        while (run < runs.size() && runs[run].hf_first + runs[run].count <= p) ++run;
        if (run == runs.size() || p < runs[run].hf_first) return;
        dest_positions_.push_back(
            static_cast<int64_t>(runs[run].dest_offset + p - runs[run].hf_first));
        gathered_.insert(gathered_.end(), e.values.begin() + k * w_,
                         e.values.begin() + (k + 1) * w_);
      });
      positions = dest_positions_.data();
      values = gathered_.data();
      n = dest_positions_.size();
    }
    if (n == 0) return uint64_t{0};
    const uint64_t pos_bytes = n * width;
    const uint64_t val_bytes = n * w_;
    DS_RETURN_IF_ERROR(Reserve(&ctx_.staging, pos_bytes + val_bytes, -1));
    DS_RETURN_IF_ERROR(Reserve(&ctx_.positions, pos_bytes, ctx_.device()));
    DS_RETURN_IF_ERROR(Reserve(&ctx_.values, val_bytes, ctx_.device()));
    uint8_t* host = Bytes(ctx_.staging);
    std::memcpy(host, positions, pos_bytes);
    std::memcpy(host + pos_bytes, values, val_bytes);
    DS_RETURN_IF_ERROR(
        cuda::CopyBytes(name_, ctx_.positions.data(), host, pos_bytes, stream_, false));
    DS_RETURN_IF_ERROR(
        cuda::CopyBytes(name_, ctx_.values.data(), host + pos_bytes, val_bytes, stream_, false));
    cuda::DeviceTensor dest = View(0, map_.dest_extent());
    const cuda::DeviceChanges changes{ctx_.positions.data(), width, ctx_.values.data(), n};
    DS_RETURN_IF_ERROR(cuda::ScatterOnDevice(ctx_.ws(), dest, changes));
    return n;
  }

  Status Wait() override { return cuda::Synchronize(stream_); }

  // A checked entry in device memory as an item of a batched scatter (its
  // stream: this destination's), and the elements it writes.
  Result<uint64_t> Item(const FlushEntry& e, cuda::ScatterItem* item) const {
    if (e.host_readable) {
      return Status::Internal(Quoted(name_) + ": a host entry in a batched scatter");
    }
    if (e.encoding != WireEncoding::kDense && e.encoding != WireEncoding::kIndices) {
      return Status::Internal(Quoted(name_) + ": a " + std::string(WireEncodingName(e.encoding)) +
                              " entry left in device memory");
    }
    const auto runs = map_.runs();
    *item = {};
    item->dest = dest_;
    item->dest_numel = map_.dest_extent();
    item->elem_size = w_;
    item->runs = static_cast<const cuda::DeviceRun*>(runs_.data());
    item->run_count = runs.size();
    item->first = e.first;
    item->changes.values = e.values.data();
    item->changes.count = e.value_count;
    if (e.encoding == WireEncoding::kIndices) {
      item->changes.positions = e.positions.data();
      item->changes.width = e.position_width;
      return e.value_count;
    }
    item->changes.width = 0;
    uint64_t written = 0;
    for (const DestinationRun& r : runs) {
      const uint64_t lo = std::max(r.hf_first, e.first);
      const uint64_t hi = std::min(r.hf_first + r.count, e.first + e.count);
      if (lo < hi) written += hi - lo;
    }
    return written;
  }
  void* stream() const { return stream_; }

  Result<StateDigest> Digest() override {
    StateDigest sum;
    for (const DestinationRun& r : map_.runs()) {
      cuda::DeviceTensor t = View(r.dest_offset, r.count);
      DS_ASSIGN_OR_RETURN(cuda::Digest d, cuda::StateDigestOnDevice(ctx_.ws(), t, r.hf_first));
      sum += FromDevice(d);
    }
    return sum;
  }

 private:
  cuda::DeviceTensor View(uint64_t first, uint64_t count) const {
    cuda::DeviceTensor t;
    t.name = name_;
    t.dtype = dtype_;
    t.shape = {static_cast<int64_t>(count)};
    t.data = dest_ + first * w_;
    t.stream = stream_;
    return t;
  }

  ContextImpl& ctx_;
  std::string name_;
  DType dtype_;
  uint32_t w_;
  DestinationMap map_;
  uint8_t* dest_;
  void* stream_;
  cuda::Buffer runs_;  // the map's runs on the device (cuda::DeviceRun)
  bool whole_ = false;
  std::vector<int64_t> dest_positions_;
  std::vector<uint8_t> gathered_;
};

// The trailer of docs/format.md: high64 then low64, most significant byte
// first.
std::array<uint8_t, kFlushTrailerBytes> Trailer(const cuda::Hash128& h) {
  std::array<uint8_t, kFlushTrailerBytes> t{};
  for (int k = 0; k < 8; ++k) {
    t[k] = static_cast<uint8_t>(h.high64 >> (56 - 8 * k));
    t[8 + k] = static_cast<uint8_t>(h.low64 >> (56 - 8 * k));
  }
  return t;
}

constexpr std::string_view kFrameName = "a device frame";

class FrameImpl final : public DeviceFrame {
 public:
  FrameImpl(ContextImpl& ctx, uint64_t budget, cuda::Buffer bucket)
      : ctx_(ctx), budget_(budget), bucket_(std::move(bucket)) {}

  Status Begin(const FlushHeader& header, void* stream) override {
    finished_ = 0;
    streams_.clear();
    stream_ = stream;
    streams_.insert(stream);
    DS_RETURN_IF_ERROR(writer_.BeginPlaced(header, budget_, &head_));
    return cuda::ZeroBytes(kFrameName, bucket_.data(), budget_, stream);
  }

  Result<bool> AddDense(const TensorRange& range, const uint8_t* values, void* stream) override {
    DS_ASSIGN_OR_RETURN(std::optional<PlacedEntry> e, writer_.PlaceDense(range));
    if (!e) return false;
    DS_RETURN_IF_ERROR(On(stream));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(range.name, Bytes(bucket_) + e->values_offset, values,
                                       e->values_bytes, stream, false));
    return true;
  }

  Result<bool> AddIndices(const TensorRange& range, const DeviceUnitChanges& c,
                          void* stream) override {
    DS_ASSIGN_OR_RETURN(std::optional<PlacedEntry> e, writer_.PlaceIndices(range, c.count));
    if (!e) return false;
    DS_RETURN_IF_ERROR(On(stream));
    DS_RETURN_IF_ERROR(cuda::CopyPositionsOnDevice(range.name, Bytes(bucket_) + e->positions_offset,
                                                   e->position_width, c.positions, c.wide, c.count,
                                                   c.base, stream));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(range.name, Bytes(bucket_) + e->values_offset, c.values,
                                       e->values_bytes, stream, false));
    return true;
  }

  Result<bool> AddDigest(std::string_view name, const DigestBlock& block,
                         const StateDigest& digest) override {
    return writer_.AddDigest(name, block, digest);
  }

  Status Finish() override {
    const uint64_t payload_end = writer_.payload_end();
    DS_RETURN_IF_ERROR(writer_.Finish());
    // Every copy into the payload is done before the hash reads it.
    for (void* s : streams_) {
      if (s != stream_) DS_RETURN_IF_ERROR(cuda::Synchronize(s));
    }
    const uint64_t manifest = head_.size() - kFlushHeaderBytes;
    const uint64_t total = payload_end + manifest + kFlushTrailerBytes;
    uint8_t* f = Bytes(bucket_);
    DS_RETURN_IF_ERROR(
        cuda::CopyBytes(kFrameName, f, head_.data(), kFlushHeaderBytes, stream_, false));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(kFrameName, f + payload_end,
                                       head_.data() + kFlushHeaderBytes, manifest, stream_, false));
    DS_ASSIGN_OR_RETURN(
        const cuda::Hash128 h,
        cuda::Xxh3_128OnDevice(ctx_.ws(), kFrameName, f, total - kFlushTrailerBytes, stream_));
    trailer_ = Trailer(h);
    DS_RETURN_IF_ERROR(cuda::CopyBytes(kFrameName, f + total - kFlushTrailerBytes, trailer_.data(),
                                       kFlushTrailerBytes, stream_, true));
    finished_ = total;
    return Status::OK();
  }

  std::span<const uint8_t> frame() const override { return {Bytes(bucket_), finished_}; }
  uint32_t entry_count() const override { return writer_.entry_count(); }
  uint64_t buffer_bytes() const override { return bucket_.size(); }

 private:
  // Work on `stream` after the frame's own: the zeroing, and copies queued
  // on another stream (tensors on several streams), are done first.
  Status On(void* stream) {
    if (streams_.insert(stream).second) DS_RETURN_IF_ERROR(cuda::Synchronize(stream_));
    return Status::OK();
  }

  ContextImpl& ctx_;
  uint64_t budget_;
  cuda::Buffer bucket_;
  FlushWriter writer_;
  FrameBuffer head_;  // the header and manifest, on the host
  void* stream_ = nullptr;
  std::set<void*> streams_;
  std::array<uint8_t, kFlushTrailerBytes> trailer_{};
  uint64_t finished_ = 0;
};

constexpr std::string_view kReceivedName = "a received frame";

class FrameReaderImpl final : public DeviceFrameReader {
 public:
  FrameReaderImpl(ContextImpl& ctx, cuda::OwnedStream stream)
      : ctx_(ctx), stream_(std::move(stream)) {}

  Result<std::span<uint8_t>> Bucket(uint64_t bytes) override {
    DS_RETURN_IF_ERROR(Reserve(&bucket_, bytes, ctx_.device()));
    return std::span<uint8_t>(Bytes(bucket_), bytes);
  }

  Status Read(FlushReader* reader, uint64_t bytes) override {
    reader->Clear();
    host_read_ = false;
    if (bytes < kFlushHeaderBytes + kFlushTrailerBytes || bytes > bucket_.size()) {
      return Status::Corruption("flush frame of " + std::to_string(bytes) +
                                " bytes: shorter than a 64-byte header and a 16-byte trailer");
    }
    void* s = stream_.get();
    const uint8_t* f = Bytes(bucket_);
    // Nothing is believed before the trailer.
    DS_ASSIGN_OR_RETURN(
        const cuda::Hash128 h,
        cuda::Xxh3_128OnDevice(ctx_.ws(), kReceivedName, f, bytes - kFlushTrailerBytes, s));
    std::array<uint8_t, kFlushHeaderBytes + kFlushTrailerBytes> ends{};
    DS_RETURN_IF_ERROR(cuda::CopyBytes(kReceivedName, ends.data(), f, kFlushHeaderBytes, s, false));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(kReceivedName, ends.data() + kFlushHeaderBytes,
                                       f + bytes - kFlushTrailerBytes, kFlushTrailerBytes, s,
                                       true));
    const std::array<uint8_t, kFlushTrailerBytes> sum = Trailer(h);
    const std::span<const uint8_t> trailer(ends.data() + kFlushHeaderBytes, kFlushTrailerBytes);
    if (!std::equal(sum.begin(), sum.end(), trailer.begin())) {
      return TrailerMismatch(bytes, std::span<const uint8_t>(ends.data(), kFlushHeaderBytes),
                             trailer, sum);
    }
    const auto manifest = [&](uint64_t offset, uint64_t size) -> Result<std::span<const uint8_t>> {
      manifest_.resize(size);
      DS_RETURN_IF_ERROR(cuda::CopyBytes(kReceivedName, manifest_.data(), f + offset, size, s,
                                         /*wait=*/true));
      return std::span<const uint8_t>(manifest_);
    };
    const PayloadChecker check = [&](const PayloadChecks& c) -> Result<std::optional<uint64_t>> {
      return cuda::CheckFrameOnDevice(ctx_.ws(), kReceivedName, f, c.zeros, c.positions, s);
    };
    bool needs_host = false;
    DS_RETURN_IF_ERROR(reader->ReadPlaced(std::span<const uint8_t>(ends.data(), kFlushHeaderBytes),
                                          bytes, manifest, f, check, &needs_host));
    if (!needs_host) return Status::OK();
    host_.resize(bytes);
    DS_RETURN_IF_ERROR(cuda::CopyBytes(kReceivedName, host_.data(), f, bytes, s, /*wait=*/true));
    host_read_ = true;
    return reader->Read(host_);
  }

  const uint8_t* bucket() const override { return Bytes(bucket_); }
  std::span<const uint8_t> host_copy() const override {
    return host_read_ ? std::span<const uint8_t>(host_) : std::span<const uint8_t>();
  }

  uint64_t buffer_bytes() const override {
    return bucket_.size() + manifest_.capacity() + host_.capacity();
  }

 private:
  ContextImpl& ctx_;
  cuda::OwnedStream stream_;
  cuda::Buffer bucket_;
  std::vector<uint8_t> manifest_;
  std::vector<uint8_t> host_;
  bool host_read_ = false;
};

class BatchImpl final : public DeviceBatch {
 public:
  explicit BatchImpl(ContextImpl& ctx) : ctx_(ctx) {}

  Result<uint64_t> Add(DeviceDestination& dest, const FlushEntry& e) override {
    if (e.value_count == 0) return uint64_t{0};
    const auto& d = static_cast<const DestinationImpl&>(dest);
    cuda::ScatterItem item;
    DS_ASSIGN_OR_RETURN(const uint64_t written, d.Item(e, &item));
    items_.push_back({d.stream(), item});
    return written;
  }

  Status Launch() override {
    if (items_.empty()) return Status::OK();
    // One launch per stream. The entries of a checked frame write disjoint
    // elements (no two overlap), so the order they run in does not matter.
    std::stable_sort(items_.begin(), items_.end(),
                     [](const Pending& a, const Pending& b) { return a.stream < b.stream; });
    uint64_t scratch = 0;
    for (size_t i = 0, j = 0; i < items_.size(); i = j) {
      while (j < items_.size() && items_[j].stream == items_[i].stream) ++j;
      scratch += Aligned256(cuda::ScatterBatchBytes(j - i));
    }
    Status s = Reserve(&scratch_, scratch, ctx_.device());
    uint64_t at = 0;
    for (size_t i = 0, j = 0; s.ok() && i < items_.size(); i = j) {
      group_.clear();
      while (j < items_.size() && items_[j].stream == items_[i].stream) {
        group_.push_back(items_[j].item);
        ++j;
      }
      s = cuda::ScatterBatchOnDevice("a frame's entries", ctx_.device(), group_,
                                     Bytes(scratch_) + at, items_[i].stream);
      at += Aligned256(cuda::ScatterBatchBytes(group_.size()));
    }
    items_.clear();
    return s;
  }

  uint64_t buffer_bytes() const override { return scratch_.size(); }

 private:
  static uint64_t Aligned256(uint64_t n) { return (n + 255) / 256 * 256; }
  struct Pending {
    void* stream;
    cuda::ScatterItem item;
  };
  ContextImpl& ctx_;
  std::vector<Pending> items_;
  std::vector<cuda::ScatterItem> group_;
  cuda::Buffer scratch_;
};

constexpr uint64_t kPlaceAlign = 16;
uint64_t Aligned(uint64_t n) { return (n + kPlaceAlign - 1) / kPlaceAlign * kPlaceAlign; }

class UploadImpl final : public HostFrameUpload {
 public:
  UploadImpl(ContextImpl& ctx, cuda::OwnedStream stream) : ctx_(ctx), stream_(std::move(stream)) {}

  Status Place(std::span<const uint8_t> frame, const uint8_t* on_device,
               std::span<const FlushEntry> entries, const std::vector<bool>& wanted,
               std::vector<FlushEntry>* placed) override {
    placed->assign(entries.begin(), entries.end());
    const auto inside = [&](std::span<const uint8_t> s) {
      return s.empty() ||
             (s.data() >= frame.data() && s.data() + s.size() <= frame.data() + frame.size());
    };
    // What views the frame is found where the frame lies on the device;
    // the rest is packed after it.
    const auto packs = [&](const FlushEntry& e) {
      return e.encoding == WireEncoding::kSparse || !inside(e.positions) || !inside(e.values);
    };
    const auto position_width = [](const FlushEntry& e) -> uint32_t {
      if (e.encoding == WireEncoding::kDense) return 0;  // the range says where
      // The kernels read 4-byte positions as int32.
      return e.numel < (uint64_t{1} << 31) ? 4 : 8;
    };
    bool views = false;
    uint64_t packed = 0;
    for (size_t k = 0; k < entries.size(); ++k) {
      const FlushEntry& e = entries[k];
      if (!wanted[k] || e.value_count == 0) continue;
      if (packs(e)) {
        packed += Aligned(e.value_count * position_width(e)) + Aligned(e.values.size());
      } else {
        views = true;
      }
    }
    const uint64_t frame_bytes = views && on_device == nullptr ? Aligned(frame.size()) : 0;
    DS_RETURN_IF_ERROR(Reserve(&device_, frame_bytes + packed, ctx_.device()));
    if (packed > 0) DS_RETURN_IF_ERROR(Reserve(&ctx_.staging, packed, -1));
    void* s = stream_.get();
    uint8_t* up = Bytes(device_);
    const uint8_t* base = on_device;
    if (frame_bytes > 0) {
      DS_RETURN_IF_ERROR(cuda::CopyBytes(kUploadName, up, frame.data(), frame.size(), s, false));
      base = up;
    }
    const auto moved = [&](std::span<const uint8_t> v) {
      return v.empty() ? v : std::span<const uint8_t>(base + (v.data() - frame.data()), v.size());
    };
    uint8_t* host = Bytes(ctx_.staging);
    uint64_t at = 0;
    for (size_t k = 0; k < entries.size(); ++k) {
      const FlushEntry& e = entries[k];
      if (!wanted[k] || e.value_count == 0) continue;
      FlushEntry& p = (*placed)[k];
      p.host_readable = false;
      if (!packs(e)) {
        p.positions = moved(e.positions);
        p.values = moved(e.values);
        continue;
      }
      const uint32_t pw = position_width(e);
      uint8_t* positions = host + at;
      if (pw == 4) {
        ForEachPosition(e, [&](uint64_t i, uint64_t q) {
          StoreLe<uint32_t>(positions + 4 * i, static_cast<uint32_t>(q));
        });
      } else if (pw == 8) {
        ForEachPosition(e,
                        [&](uint64_t i, uint64_t q) { StoreLe<uint64_t>(positions + 8 * i, q); });
      }
      if (pw > 0) {
        p.encoding = WireEncoding::kIndices;
        p.position_width = pw;
        p.positions = {up + frame_bytes + at, e.value_count * pw};
      }
      at += Aligned(e.value_count * pw);
      std::memcpy(host + at, e.values.data(), e.values.size());
      p.values = {up + frame_bytes + at, e.values.size()};
      at += Aligned(e.values.size());
    }
    if (packed > 0) {
      DS_RETURN_IF_ERROR(cuda::CopyBytes(kUploadName, up + frame_bytes, host, packed, s, true));
    } else {
      DS_RETURN_IF_ERROR(cuda::Synchronize(s));
    }
    return Status::OK();
  }

  uint64_t buffer_bytes() const override { return device_.size(); }

 private:
  static constexpr std::string_view kUploadName = "a host frame going to the device";
  ContextImpl& ctx_;
  cuda::OwnedStream stream_;
  cuda::Buffer device_;
};

class QuantizedImpl final : public DeviceQuantized {
 public:
  explicit QuantizedImpl(ContextImpl& ctx) : ctx_(ctx) {}

  Status Quantize(const QuantRecipe& recipe, const std::string& name, DType dtype,
                  std::span<const int64_t> shape, const uint8_t* weight, void* stream) override {
    if (shape.size() != 2) {
      return Status::InvalidArgument(Quoted(name) + ": quantizing takes a 2-D weight");
    }
    DS_ASSIGN_OR_RETURN(const std::vector<int64_t> scale_shape,
                        QuantScaleShape(recipe, shape[0], shape[1]));
    uint64_t groups = 1;
    for (int64_t d : scale_shape) groups *= static_cast<uint64_t>(d);
    const uint64_t numel = static_cast<uint64_t>(shape[0]) * static_cast<uint64_t>(shape[1]);
    codes_bytes_ = numel;
    scales_bytes_ = groups * DTypeSize(QuantScaleDType(recipe.scale_format));
    // Exactly the sizes: a weight keeps its shape from sync to sync.
    DS_RETURN_IF_ERROR(Exactly(&codes_, codes_bytes_));
    DS_RETURN_IF_ERROR(Exactly(&scales_, scales_bytes_));
    cuda::DeviceTensor t;
    t.name = name;
    t.dtype = dtype;
    t.shape.assign(shape.begin(), shape.end());
    t.data = const_cast<uint8_t*>(weight);
    t.stream = stream;
    return cuda::QuantizeOnDevice(ctx_.ws(), recipe, t, codes_.data(), scales_.data());
  }
  Status Exactly(cuda::Buffer* buffer, uint64_t bytes) {
    if (buffer->size() == bytes) return Status::OK();
    *buffer = cuda::Buffer();
    DS_ASSIGN_OR_RETURN(*buffer, cuda::Buffer::Device(bytes, ctx_.device()));
    return Status::OK();
  }
  std::span<const uint8_t> codes() const override { return {Bytes(codes_), codes_bytes_}; }
  std::span<const uint8_t> scales() const override { return {Bytes(scales_), scales_bytes_}; }
  uint64_t buffer_bytes() const override { return codes_.size() + scales_.size(); }

 private:
  ContextImpl& ctx_;
  cuda::Buffer codes_, scales_;
  uint64_t codes_bytes_ = 0, scales_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<DeviceQuantized>> DeviceQuantized::Create(DeviceContext& ctx) {
  return std::unique_ptr<DeviceQuantized>(new QuantizedImpl(Impl(ctx)));
}

Result<std::unique_ptr<DeviceContext>> DeviceContext::Create(int cuda_device) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Workspace> ws, cuda::Workspace::Create(cuda_device));
  return std::unique_ptr<DeviceContext>(new ContextImpl(cuda_device, std::move(ws)));
}

Result<std::unique_ptr<DeviceSource>> DeviceSource::Create(DeviceContext& ctx, std::string name,
                                                           DType dtype, uint64_t numel,
                                                           uint64_t unit, uint64_t chunk,
                                                           bool pinned_snapshot) {
  if (unit == 0 || chunk % unit != 0) {
    return Status::InvalidArgument(Quoted(name) + ": a chunk of " + std::to_string(chunk) +
                                   " elements is not a multiple of the unit of " +
                                   std::to_string(unit));
  }
  const uint64_t bytes = std::max<uint64_t>(numel * DTypeSize(dtype), 1);
  Result<cuda::Buffer> snapshot =
      pinned_snapshot ? cuda::Buffer::PinnedHost(bytes) : cuda::Buffer::Device(bytes, ctx.device());
  if (!snapshot.ok()) {
    return Status(snapshot.status().code(),
                  Quoted(name) +
                      (pinned_snapshot ? ": its pinned snapshot: " : ": its device snapshot: ") +
                      snapshot.status().message());
  }
  return std::unique_ptr<DeviceSource>(
      new SourceImpl(Impl(ctx), std::move(name), dtype, numel, unit, chunk, std::move(*snapshot)));
}

Result<std::unique_ptr<DeviceDestination>> DeviceDestination::Create(DeviceContext& ctx,
                                                                     std::string name, DType dtype,
                                                                     const DestinationMap& map,
                                                                     std::span<uint8_t> dest,
                                                                     const Placement& place) {
  const auto runs = map.runs();
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].dest_stride != 1 ||
        (i > 0 && runs[i].dest_offset < runs[i - 1].dest_offset + runs[i - 1].count)) {
      return Status::InvalidArgument(
          Quoted(name) +
          ": on a CUDA device, destination runs must have stride 1 and ascend in the "
          "destination (run " +
          std::to_string(i) + " does not)");
    }
  }
  cuda::DeviceTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = {static_cast<int64_t>(map.dest_extent())};
  t.data = dest.data();
  t.stream = place.cuda_stream;
  DS_RETURN_IF_ERROR(cuda::CheckDeviceTensor(t, ctx.device()));
  // The runs go to the device once, for the scatter from device frames.
  std::vector<cuda::DeviceRun> device_runs;
  for (const DestinationRun& r : runs) device_runs.push_back({r.hf_first, r.count, r.dest_offset});
  DS_ASSIGN_OR_RETURN(
      cuda::Buffer runs_buffer,
      cuda::Buffer::Device(device_runs.size() * sizeof(cuda::DeviceRun), ctx.device()));
  DS_RETURN_IF_ERROR(cuda::CopyBytes(name, runs_buffer.data(), device_runs.data(),
                                     device_runs.size() * sizeof(cuda::DeviceRun),
                                     place.cuda_stream, /*wait=*/true));
  return std::unique_ptr<DeviceDestination>(new DestinationImpl(Impl(ctx), std::move(name), dtype,
                                                                map, dest.data(), place.cuda_stream,
                                                                std::move(runs_buffer)));
}

Result<std::unique_ptr<DeviceFrame>> DeviceFrame::Create(DeviceContext& ctx,
                                                         uint64_t budget_bytes) {
  DS_ASSIGN_OR_RETURN(cuda::Buffer bucket, cuda::Buffer::Device(budget_bytes, ctx.device()));
  return std::unique_ptr<DeviceFrame>(new FrameImpl(Impl(ctx), budget_bytes, std::move(bucket)));
}

Result<std::unique_ptr<DeviceFrameReader>> DeviceFrameReader::Create(DeviceContext& ctx) {
  DS_ASSIGN_OR_RETURN(cuda::OwnedStream stream, cuda::OwnedStream::Create(ctx.device()));
  return std::unique_ptr<DeviceFrameReader>(new FrameReaderImpl(Impl(ctx), std::move(stream)));
}

Result<std::unique_ptr<DeviceBatch>> DeviceBatch::Create(DeviceContext& ctx) {
  return std::unique_ptr<DeviceBatch>(new BatchImpl(Impl(ctx)));
}

Result<std::unique_ptr<HostFrameUpload>> HostFrameUpload::Create(DeviceContext& ctx) {
  DS_ASSIGN_OR_RETURN(cuda::OwnedStream stream, cuda::OwnedStream::Create(ctx.device()));
  return std::unique_ptr<HostFrameUpload>(new UploadImpl(Impl(ctx), std::move(stream)));
}

#endif  // DS_HAVE_CUDA

}  // namespace deltasync::stream
