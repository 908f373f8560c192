// The stream's device tensors (stream/device_path.h) on the cuda module.
#include "stream/device_path.h"

#include <algorithm>
#include <cstring>
#include <utility>

#if DS_HAVE_CUDA
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
                                                           uint64_t, uint64_t) {
  return NotBuilt("tensor '" + name + "'");
}
Result<std::unique_ptr<DeviceDestination>> DeviceDestination::Create(DeviceContext&,
                                                                     std::string name, DType,
                                                                     const DestinationMap&,
                                                                     std::span<uint8_t>,
                                                                     const Placement&) {
  return NotBuilt("tensor '" + name + "'");
}

#else

bool DevicePathBuilt() { return true; }

namespace {

std::string Quoted(std::string_view name) { return "tensor '" + std::string(name) + "'"; }

StateDigest FromDevice(const cuda::Digest& d) { return StateDigest{d.a, d.b}; }

// Grows `buffer` to at least `bytes` (device memory of `device`, or pinned
// host memory for device -1); its contents are not kept.
Status Reserve(cuda::Buffer* buffer, uint64_t bytes, int device) {
  if (buffer->size() >= bytes) return Status::OK();
  *buffer = cuda::Buffer();
  const uint64_t size = std::max<uint64_t>(bytes, uint64_t{1} << 16);
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
  // Pinned host: a chunk's changes coming back; a unit's dense values; an
  // entry's positions and values going up.
  cuda::Buffer changes, dense, staging;

 private:
  int device_;
  std::unique_ptr<cuda::Workspace> ws_;
};

ContextImpl& Impl(DeviceContext& ctx) { return static_cast<ContextImpl&>(ctx); }

// A chunk's refresh, to undo: its changed positions (from the chunk's
// first element, int32 or int64) and the values they had.
struct UndoChunk {
  uint64_t first = 0;
  uint64_t count = 0;  // elements of the chunk
  bool wide = false;
  uint64_t changed = 0;
  std::vector<uint8_t> positions;
  std::vector<uint8_t> old_values;
};

class SourceImpl final : public DeviceSource {
 public:
  SourceImpl(ContextImpl& ctx, std::string name, DType dtype, uint64_t numel, uint64_t chunk,
             cuda::Buffer snapshot)
      : ctx_(ctx),
        name_(std::move(name)),
        dtype_(dtype),
        w_(static_cast<uint32_t>(DTypeSize(dtype))),
        numel_(numel),
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
    undo_.clear();
    return Status::OK();
  }

  Status Changes(uint64_t first, uint64_t count, ChangeSet* out) override {
    if (chunk_count_ == 0 || first < chunk_first_ || first + count > chunk_first_ + chunk_count_) {
      DS_RETURN_IF_ERROR(DiffChunk(first));
    }
    const UndoChunk& c = undo_.back();
    const uint64_t lo = first - chunk_first_;
    const uint64_t hi = lo + count;
    const uint32_t pw = c.wide ? 8 : 4;
    const uint8_t* pos = Bytes(ctx_.changes);
    const auto at = [&](uint64_t k) -> uint64_t {
      return c.wide ? LoadLe<uint64_t>(pos + 8 * k) : LoadLe<uint32_t>(pos + 4 * k);
    };
    // The unit's changes: the positions in [lo, hi), found by bisection.
    const auto lower = [&](uint64_t p) {
      uint64_t a = 0, b = c.changed;
      while (a < b) {
        const uint64_t m = a + (b - a) / 2;
        if (at(m) < p) {
          a = m + 1;
        } else {
          b = m;
        }
      }
      return a;
    };
    const uint64_t k0 = lower(lo);
    const uint64_t k1 = lower(hi);
    const uint64_t n = k1 - k0;
    out->Clear();
    out->numel = count;
    out->elem_size = w_;
    out->wide = false;  // a unit has fewer than 2^31 elements
    out->pos32.resize(n);
    for (uint64_t k = 0; k < n; ++k) out->pos32[k] = static_cast<uint32_t>(at(k0 + k) - lo);
    const uint8_t* values = pos + c.changed * pw;
    const uint8_t* old_values = values + c.changed * w_;
    out->new_values.assign(values + k0 * w_, values + k1 * w_);
    out->old_values.assign(old_values + k0 * w_, old_values + k1 * w_);
    return Status::OK();
  }

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

  Status Commit(bool whole) override {
    undo_.clear();
    chunk_count_ = 0;
    if (whole || !have_) {
      have_ = false;
      DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, snapshot_.data(), current_, numel_ * w_, stream_,
                                         /*wait=*/true));
      have_ = true;
    }
    return Status::OK();
  }

  Status Rollback() override {
    chunk_count_ = 0;
    std::vector<UndoChunk> undo = std::move(undo_);
    undo_.clear();
    Status s = Undo(undo);
    if (!s.ok()) have_ = false;
    return s;
  }

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
  uint64_t buffer_bytes() const override {
    uint64_t n = 0;
    for (const UndoChunk& c : undo_) n += c.positions.capacity() + c.old_values.capacity();
    return n;
  }

 private:
  // Scatters the logged old values back into the snapshot.
  Status Undo(const std::vector<UndoChunk>& undo) {
    for (const UndoChunk& c : undo) {
      if (c.changed == 0) continue;
      DS_RETURN_IF_ERROR(Reserve(&ctx_.positions, c.positions.size(), ctx_.device()));
      DS_RETURN_IF_ERROR(Reserve(&ctx_.values, c.old_values.size(), ctx_.device()));
      DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, ctx_.positions.data(), c.positions.data(),
                                         c.positions.size(), stream_, false));
      DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, ctx_.values.data(), c.old_values.data(),
                                         c.old_values.size(), stream_, false));
      cuda::DeviceTensor snap = View(Bytes(snapshot_), c.first, c.count);
      const cuda::DeviceChanges back{ctx_.positions.data(), c.wide, ctx_.values.data(), c.changed};
      DS_RETURN_IF_ERROR(cuda::ScatterOnDevice(ctx_.ws(), snap, back));
    }
    return Status::OK();
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

  // Diffs the chunk at `first` on the device (refreshing the snapshot) and
  // brings its changes back into the pinned staging; logs the refresh.
  Status DiffChunk(uint64_t first) {
    const uint64_t count = std::min(chunk_, numel_ - first);
    const uint32_t pw = count >= (uint64_t{1} << 31) ? 8 : 4;
    DS_RETURN_IF_ERROR(Reserve(&ctx_.positions, count * pw, ctx_.device()));
    DS_RETURN_IF_ERROR(Reserve(&ctx_.values, count * w_, ctx_.device()));
    DS_RETURN_IF_ERROR(Reserve(&ctx_.old_values, count * w_, ctx_.device()));
    cuda::DeviceTensor cur = View(current_, first, count);
    cuda::DeviceTensor snap = View(Bytes(snapshot_), first, count);
    cuda::DiffOutput out;
    out.positions = ctx_.positions.data();
    out.values = ctx_.values.data();
    out.old_values = ctx_.old_values.data();
    out.capacity = count;
    out.refresh_snapshot = true;
    out.digest = true;
    out.first_position = first;
    chunk_count_ = 0;
    DS_ASSIGN_OR_RETURN(cuda::DiffResult r, cuda::DiffOnDevice(ctx_.ws(), cur, snap, out));
    UndoChunk c;
    c.first = first;
    c.count = count;
    c.wide = r.wide;
    c.changed = r.count;
    const uint64_t pos_bytes = r.count * (r.wide ? 8 : 4);
    const uint64_t val_bytes = r.count * w_;
    // Logged before anything can fail: the snapshot already holds the
    // refresh.
    undo_.push_back(std::move(c));
    UndoChunk& logged = undo_.back();
    DS_RETURN_IF_ERROR(Reserve(&ctx_.changes, pos_bytes + 2 * val_bytes, -1));
    uint8_t* host = Bytes(ctx_.changes);
    logged.positions.resize(pos_bytes);
    logged.old_values.resize(val_bytes);
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, host, out.positions, pos_bytes, stream_, false));
    DS_RETURN_IF_ERROR(
        cuda::CopyBytes(name_, host + pos_bytes, out.values, val_bytes, stream_, false));
    DS_RETURN_IF_ERROR(cuda::CopyBytes(name_, host + pos_bytes + val_bytes, out.old_values,
                                       val_bytes, stream_, true));
    if (pos_bytes > 0) std::memcpy(logged.positions.data(), host, pos_bytes);
    if (val_bytes > 0) {
      std::memcpy(logged.old_values.data(), host + pos_bytes + val_bytes, val_bytes);
    }
    chunk_first_ = first;
    chunk_count_ = count;
    chunk_digest_ = FromDevice(r.digest_change);
    return Status::OK();
  }

  ContextImpl& ctx_;
  std::string name_;
  DType dtype_;
  uint32_t w_;
  uint64_t numel_;
  uint64_t chunk_;
  cuda::Buffer snapshot_;
  bool have_ = false;
  const uint8_t* current_ = nullptr;
  void* stream_ = nullptr;
  uint64_t chunk_first_ = 0;
  uint64_t chunk_count_ = 0;  // 0: no chunk diffed
  StateDigest chunk_digest_;
  std::vector<UndoChunk> undo_;
};

class DestinationImpl final : public DeviceDestination {
 public:
  DestinationImpl(ContextImpl& ctx, std::string name, DType dtype, DestinationMap map,
                  uint8_t* dest, void* stream)
      : ctx_(ctx),
        name_(std::move(name)),
        dtype_(dtype),
        w_(static_cast<uint32_t>(DTypeSize(dtype))),
        map_(std::move(map)),
        dest_(dest),
        stream_(stream) {
    const auto runs = map_.runs();
    whole_ = runs.size() == 1 && runs[0].hf_first == 0 && runs[0].count == map_.hf_numel() &&
             runs[0].dest_offset == 0;
  }

  Result<uint64_t> Apply(const FlushEntry& e) override {
    const auto runs = map_.runs();
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
    bool wide = true;
    const void* values = e.values.data();
    uint64_t n = e.value_count;
    if (whole_ && e.encoding == WireEncoding::kIndices) {
      positions = e.positions.data();
      wide = e.position_width == 8;
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
    const uint64_t pos_bytes = n * (wide ? 8 : 4);
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
    const cuda::DeviceChanges changes{ctx_.positions.data(), wide, ctx_.values.data(), n};
    DS_RETURN_IF_ERROR(cuda::ScatterOnDevice(ctx_.ws(), dest, changes));
    return n;
  }

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
  bool whole_ = false;
  std::vector<int64_t> dest_positions_;
  std::vector<uint8_t> gathered_;
};

}  // namespace

Result<std::unique_ptr<DeviceContext>> DeviceContext::Create(int cuda_device) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Workspace> ws, cuda::Workspace::Create(cuda_device));
  return std::unique_ptr<DeviceContext>(new ContextImpl(cuda_device, std::move(ws)));
}

Result<std::unique_ptr<DeviceSource>> DeviceSource::Create(DeviceContext& ctx, std::string name,
                                                           DType dtype, uint64_t numel,
                                                           uint64_t chunk) {
  Result<cuda::Buffer> snapshot =
      cuda::Buffer::Device(std::max<uint64_t>(numel * DTypeSize(dtype), 1), ctx.device());
  if (!snapshot.ok()) {
    return Status(snapshot.status().code(),
                  Quoted(name) + ": its device snapshot: " + snapshot.status().message());
  }
  return std::unique_ptr<DeviceSource>(new SourceImpl(Impl(ctx), std::move(name), dtype, numel,
                                                      std::max<uint64_t>(chunk, 1),
                                                      std::move(*snapshot)));
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
  return std::unique_ptr<DeviceDestination>(
      new DestinationImpl(Impl(ctx), std::move(name), dtype, map, dest.data(), place.cuda_stream));
}

#endif  // DS_HAVE_CUDA

}  // namespace deltasync::stream
