// The stream's receiver (include/deltasync/stream.h; docs/format.md,
// "Stream: commit protocol").
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

#include "comm/communicator_internal.h"
#include "deltasync/checksum.h"
#include "deltasync/stream.h"
#include "deltasync/tensor.h"
#include "deltasync/thread_pool.h"
#include "deltasync/timing.h"
#include "stream/device_path.h"
#include "stream/frame.h"
#include "stream/state_digest.h"
#include "stream/sync_messages.h"

namespace deltasync {

namespace {

using stream::DestinationMap;
using stream::DigestBlock;
using stream::FlushEntry;
using stream::FlushReader;
using stream::FrameKind;
using stream::MessageType;
using stream::StateDigest;
using Clock = std::chrono::steady_clock;

struct Destination {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint32_t w = 1;
  std::span<uint8_t> bytes;
  DestinationMap map;
  DigestBlock block;
  StateDigest running;  // the digest of what `bytes` holds of the block
  // In device memory: applied and digested there (`running` is then
  // recomputed at each sync that touches it).
  std::unique_ptr<stream::DeviceDestination> device;
  Placement place;
  // The sync (SyncState::stamp) that last applied an entry to it, and the
  // one whose frames last carried its digest record, `record`.
  uint64_t named_in = 0;
  uint64_t record_in = 0;
  StateDigest record;
};

// What one sync has done so far.
struct SyncState {
  uint64_t frames = 0;  // frames taken
  uint64_t sync_id = 0;
  FrameKind kind = FrameKind::kDelta;
  bool verify_all = false;
  uint64_t entries = 0;  // applied so far
  // This sync among the receiver's: a destination whose named_in (or
  // record_in) equals it was written (or given a digest record) by it.
  uint64_t stamp = 0;
  Status refused;     // the first refusal; later frames are taken, not applied
  bool clean = true;  // no unverified byte written
  // Refused for a reason of this receiver's own (a destination that moved,
  // a seed it waits for), not for a disagreement with the sender.
  bool local = false;
};

// Failed syncs in a row after which a receiver forms the group again.
constexpr uint32_t kRejoinAfterFailures = 3;

class Receiver final : public StreamReceiver {
 public:
  Receiver(CommunicatorFactory connect, ReceiverOptions options)
      : connect_(std::move(connect)), options_(std::move(options)) {}

  Status Register(std::string name, DType dtype, std::vector<int64_t> shape,
                  std::span<uint8_t> dest, std::vector<DestinationRun> runs,
                  Placement place) override;
  Status Rebind(std::string_view name, std::span<uint8_t> dest, Placement place) override;
  Result<ReceiveStats> ReceiveSync() override;
  void Cancel(std::string_view why) override;
  Health health() const override;

 private:
  Result<ReceiveStats> ReceiveSyncAlone();
  Status Join();
  void Drop() {
    std::lock_guard<std::mutex> lock(mu_);
    comm_.reset();
  }
  Status Cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }
  // Checks and applies the frame of `bytes` bytes just received (in
  // bucket_, or in the device bucket with `on_device`). `checksum`: the
  // xxh3-128 of the host frame's bytes before its trailer, taken as they
  // came in (empty: computed here).
  Status TakeFrame(bool envelope_last, bool on_device, uint64_t bytes,
                   std::span<const uint8_t> checksum, SyncState* sync, ReceiveStats* stats);
  // The device bucket frames are received into, when every registered
  // tensor lives on one device and the communicator takes device memory;
  // null otherwise.
  Result<stream::DeviceFrameReader*> DeviceFrames();
  // placed_: the checked frame's entries, those for device tensors put in
  // device memory (HostFrameUpload), each device's in one copy.
  Status PlaceOnDevices(bool on_device, std::span<const FlushEntry> entries);
  // The batched apply of a frame's entries in memory of CUDA device `device`.
  Result<stream::DeviceBatch*> Batch(int device);
  void Verify(SyncState* sync, ReceiveStats* stats);
  // The receiver's threads (ReceiverOptions::threads); nullptr for one.
  ThreadPool* Pool() {
    if (!pool_made_) {
      pool_made_ = true;
      pool_ = ThreadPool::ForThreads(options_.threads);
    }
    return pool_.get();
  }

  CommunicatorFactory connect_;
  ReceiverOptions options_;
  std::map<std::string, Destination, std::less<>> dests_;
  // dests_ by name, for the frames' lookups (map nodes do not move).
  std::unordered_map<std::string_view, Destination*> by_name_;
  uint64_t syncs_ = 0;  // SyncState::stamp of the last sync begun
  // TakeFrame's: each entry's and each digest record's destination, found
  // once when the frame is checked; the entries' maps and memory; their
  // digest moves.
  std::vector<Destination*> entry_dests_;
  std::vector<Destination*> record_dests_;
  std::vector<stream::EntryDestination> targets_;
  std::vector<StateDigest> moves_;
  std::map<int, std::unique_ptr<stream::DeviceContext>> devices_;  // by CUDA device
  // Set and reset by the calling thread under mu_, read by Cancel and
  // health under it; the calling thread reads it without.
  std::unique_ptr<Communicator> comm_;
  mutable std::mutex mu_;
  Status cancelled_;
  std::atomic<bool> cancel_requested_{false};  // cancelled_ set, for formations
  std::atomic<bool> busy_{false};
  bool waiting_ = false;  // under mu_
  Clock::time_point waiting_since_;
  bool started_ = false;
  bool seeded_ = false;        // holds a verified state of this connection
  uint64_t last_sync_id_ = 0;  // the highest sync id taken on this connection
  uint32_t failures_in_a_row_ = 0;
  FlushReader reader_;
  std::vector<uint8_t> bucket_;
  // The running xxh3-128 of a host frame as its chunks come in.
  std::unique_ptr<Hasher> frame_hash_ = NewHasher(ChecksumAlgo::kXxh3_128);
  std::unique_ptr<stream::DeviceFrameReader> device_frames_;
  std::map<int, std::unique_ptr<stream::HostFrameUpload>> uploads_;  // by CUDA device
  std::map<int, std::unique_ptr<stream::DeviceBatch>> batches_;      // by CUDA device
  std::vector<bool> wanted_;
  std::vector<FlushEntry> placed_, on_device_;
  std::unique_ptr<ThreadPool> pool_;
  bool pool_made_ = false;
};

Status Receiver::Register(std::string name, DType dtype, std::vector<int64_t> shape,
                          std::span<uint8_t> dest, std::vector<DestinationRun> runs,
                          Placement place) {
  const std::string what = "registering tensor '" + name + "'";
  if (started_) {
    return Status::FailedPrecondition(what + ": tensors are registered before the first sync");
  }
  if (name.empty() || name.size() > stream::kMaxTensorNameBytes) {
    return Status::InvalidArgument(what + ": the name is empty or too long");
  }
  if (dests_.count(name)) return Status::InvalidArgument(what + ": registered twice");
  const size_t w = DTypeSize(dtype);
  if (w != 1 && w != 2 && w != 4 && w != 8) {
    return Status::InvalidArgument(what + ": dtype " + std::string(DTypeName(dtype)) +
                                   " has no element size the stream carries");
  }
  if (shape.size() > stream::kMaxTensorDims) {
    return Status::InvalidArgument(what + ": too many dimensions");
  }
  Result<int64_t> numel = ShapeNumel(shape);
  if (!numel.ok()) return Status::InvalidArgument(what + ": " + numel.status().message());
  Result<DestinationMap> map = runs.empty() ? Result<DestinationMap>(DestinationMap::Whole(*numel))
                                            : DestinationMap::Create(*numel, std::move(runs));
  if (!map.ok()) return Status::InvalidArgument(what + ": " + map.status().message());
  if (dest.size() / w < map->dest_extent()) {
    return Status::InvalidArgument(what + ": the destination holds " +
                                   std::to_string(dest.size() / w) + " elements, its runs reach " +
                                   std::to_string(map->dest_extent()));
  }
  std::optional<DigestBlock> block = map->AsBlock();
  if (!block) {
    return Status::InvalidArgument(what +
                                   ": the elements its runs hold are not one block "
                                   "(a range, or equal rows at one stride)");
  }
  Destination d;
  if (place.on_device()) {
    std::unique_ptr<stream::DeviceContext>& ctx = devices_[place.cuda_device];
    if (!ctx) {
      Result<std::unique_ptr<stream::DeviceContext>> c =
          stream::DeviceContext::Create(place.cuda_device);
      if (!c.ok()) {
        devices_.erase(place.cuda_device);
        return Status(c.status().code(), what + ": " + c.status().message());
      }
      ctx = std::move(*c);
    }
    Result<std::unique_ptr<stream::DeviceDestination>> dev =
        stream::DeviceDestination::Create(*ctx, name, dtype, *map, dest, place);
    if (!dev.ok()) return Status(dev.status().code(), what + ": " + dev.status().message());
    d.device = std::move(*dev);
  }
  d.name = name;
  d.place = place;
  d.dtype = dtype;
  d.shape = std::move(shape);
  d.w = static_cast<uint32_t>(w);
  d.bytes = dest;
  d.map = std::move(*map);
  d.block = *block;
  auto it = dests_.emplace(std::move(name), std::move(d)).first;
  by_name_.emplace(it->first, &it->second);
  return Status::OK();
}

Status Receiver::Rebind(std::string_view name, std::span<uint8_t> dest, Placement place) {
  const std::string what = "rebinding tensor '" + std::string(name) + "'";
  if (busy_.load()) {
    return Status::FailedPrecondition(what + ": a ReceiveSync is running in another thread");
  }
  auto it = dests_.find(name);
  if (it == dests_.end()) return Status::InvalidArgument(what + ": not registered");
  Destination& d = it->second;
  if (dest.size() != d.bytes.size()) {
    return Status::InvalidArgument(what + ": the new memory holds " + std::to_string(dest.size()) +
                                   " bytes, the registered " + std::to_string(d.bytes.size()));
  }
  if (place.cuda_device != d.place.cuda_device) {
    return Status::InvalidArgument(what + ": the new memory is on another device than the old");
  }
  if (d.device) {
    Result<std::unique_ptr<stream::DeviceDestination>> dev = stream::DeviceDestination::Create(
        *devices_.at(place.cuda_device), d.name, d.dtype, d.map, dest, place);
    if (!dev.ok()) return Status(dev.status().code(), what + ": " + dev.status().message());
    d.device = std::move(*dev);
  }
  d.bytes = dest;
  d.place = place;
  // What the new memory holds is not known: only a seed brings it back.
  seeded_ = false;
  return Status::OK();
}

void Receiver::Cancel(std::string_view why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!cancelled_.ok()) return;
  cancelled_ = Status::Aborted("the receiver was cancelled: " + std::string(why));
  cancel_requested_.store(true);
  if (comm_) comm_->Cancel(why);
}

StreamReceiver::Health Receiver::health() const {
  Health h;
  h.in_call = busy_.load();
  std::lock_guard<std::mutex> lock(mu_);
  h.connected = comm_ != nullptr;
  h.waiting = waiting_;
  if (waiting_) h.waiting_s = SecondsSince(waiting_since_);
  if (!h.in_call) {
    // Read by the calling thread otherwise.
    h.seeded = seeded_;
    h.last_sync_id = last_sync_id_;
    h.failures_in_a_row = failures_in_a_row_;
  }
  if (!cancelled_.ok()) {
    h.link = cancelled_;
  } else if (comm_) {
    h.link = comm_->health();
  } else {
    h.link = Status::Unavailable("not a member of a formed group (it forms at the next call)");
  }
  return h;
}

Status Receiver::Join() {
  Result<std::unique_ptr<Communicator>> c = Status::OK();
  {
    // Cancel reaches the rendezvous waits of a formation on this thread.
    stream_internal::FormationCancel cancel(&cancel_requested_);
    c = connect_();
  }
  if (!c.ok())
    return Status(c.status().code(), "forming the stream group: " + c.status().message());
  if ((*c)->rank() < 1) {
    return Status::InvalidArgument("a receiver is rank 1 or above of its stream group");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cancelled_.ok()) return cancelled_;
    comm_ = std::move(*c);
  }
  seeded_ = false;
  last_sync_id_ = 0;
  stream::Hello hello;
  hello.max_frame_bytes = options_.max_frame_bytes;
  hello.partial = options_.partial;
  for (const auto& [name, d] : dests_) hello.tensors.push_back({name, d.dtype, d.shape, d.block});
  // The sender takes hellos at its next sync, which may be a training step
  // away.
  Status s = stream::SendJsonAwaiting(*comm_, 0, MessageType::kHello, stream::HelloBody(hello),
                                      options_.sync_wait);
  Result<nlohmann::json> welcome =
      s.ok() ? stream::RecvJson(*comm_, 0, MessageType::kWelcome) : Result<nlohmann::json>(s);
  if (!welcome.ok()) {
    Drop();
    return Status(welcome.status().code(), "greeting the sender: " + welcome.status().message());
  }
  if (!welcome->contains("ok") || !(*welcome)["ok"].is_boolean()) {
    Drop();
    return Status::Corruption("the sender's welcome has no ok field");
  }
  if (!(*welcome)["ok"].get<bool>()) {
    Drop();
    const std::string why = welcome->contains("error") && (*welcome)["error"].is_string()
                                ? (*welcome)["error"].get<std::string>()
                                : std::string("(no reason given)");
    return Status::InvalidArgument("the sender refused this receiver: " + why);
  }
  return Status::OK();
}

Result<stream::DeviceFrameReader*> Receiver::DeviceFrames() {
  if (device_frames_) return device_frames_.get();
  const CommunicatorCapabilities caps = comm_->capabilities();
  if (!options_.device_frames || !caps.device_buffers || devices_.size() != 1 ||
      caps.cuda_device != devices_.begin()->first) {
    return nullptr;
  }
  for (const auto& [name, d] : dests_) {
    if (!d.device) return nullptr;
  }
  Result<std::unique_ptr<stream::DeviceFrameReader>> r =
      stream::DeviceFrameReader::Create(*devices_.begin()->second);
  if (!r.ok()) return Status(r.status().code(), "a device frame bucket: " + r.status().message());
  device_frames_ = std::move(*r);
  return device_frames_.get();
}

Result<stream::DeviceBatch*> Receiver::Batch(int device) {
  std::unique_ptr<stream::DeviceBatch>& b = batches_[device];
  if (!b) {
    Result<std::unique_ptr<stream::DeviceBatch>> made =
        stream::DeviceBatch::Create(*devices_.at(device));
    if (!made.ok()) {
      batches_.erase(device);
      return made.status();
    }
    b = std::move(*made);
  }
  return b.get();
}

Status Receiver::PlaceOnDevices(bool on_device, std::span<const FlushEntry> entries) {
  const std::span<const uint8_t> frame = on_device ? device_frames_->host_copy() : bucket_;
  const uint8_t* there = on_device ? device_frames_->bucket() : nullptr;
  placed_.assign(entries.begin(), entries.end());
  for (auto& [device, ctx] : devices_) {
    wanted_.assign(entries.size(), false);
    bool any = false;
    for (size_t k = 0; k < entries.size(); ++k) {
      const Destination& d = *entry_dests_[k];
      wanted_[k] = d.device != nullptr && d.place.cuda_device == device;
      any = any || wanted_[k];
    }
    if (!any) continue;
    std::unique_ptr<stream::HostFrameUpload>& up = uploads_[device];
    if (!up) {
      Result<std::unique_ptr<stream::HostFrameUpload>> u = stream::HostFrameUpload::Create(*ctx);
      if (!u.ok()) return u.status();
      up = std::move(*u);
    }
    DS_RETURN_IF_ERROR(up->Place(frame, there, entries, wanted_, &on_device_));
    for (size_t k = 0; k < entries.size(); ++k) {
      if (wanted_[k]) placed_[k] = std::move(on_device_[k]);
    }
  }
  return Status::OK();
}

Status Receiver::TakeFrame(bool envelope_last, bool on_device, uint64_t bytes,
                           std::span<const uint8_t> checksum, SyncState* sync,
                           ReceiveStats* stats) {
  const uint64_t index = sync->frames - 1;
  const std::string where = "flush frame " + std::to_string(index) + " of the sync";
  Status read = Status::OK();
  if (on_device) {
    read = device_frames_->Read(&reader_, bytes);
  } else {
    read = checksum.empty() ? reader_.Read(bucket_) : reader_.Read(bucket_, checksum);
  }
  if (Status s = read; !s.ok()) {
    return Status(s.code(), where + ": " + s.message());
  }
  const stream::FlushHeader& h = reader_.header();
  const std::string frame =
      "sync " + std::to_string(h.sync_id) + " flush " + std::to_string(h.flush_index);
  if (h.last != envelope_last) {
    return Status::Corruption(frame + ": its envelope and its header disagree on being last");
  }
  if (index == 0) {
    if (last_sync_id_ != 0 && h.sync_id <= last_sync_id_) {
      return Status::InvalidArgument(frame + ": sync id " + std::to_string(h.sync_id) +
                                     " out of order: this receiver has seen sync " +
                                     std::to_string(last_sync_id_));
    }
    if (h.flush_index != 0) {
      return Status::InvalidArgument(frame + ": a sync's first frame has flush index 0");
    }
    sync->sync_id = h.sync_id;
    sync->kind = h.kind;
    last_sync_id_ = h.sync_id;
    if (h.kind == FrameKind::kDelta && !seeded_) {
      // Not clean, so that the sender seeds it at the next sync.
      sync->clean = false;
      sync->local = true;
      return Status::FailedPrecondition(
          frame + ": a delta, but this receiver holds no seeded state (it asks for a seed)");
    }
    if (options_.before_apply) {
      if (Status s = options_.before_apply(); !s.ok()) {
        sync->local = true;
        return Status(s.code(), "sync " + std::to_string(h.sync_id) + ": " + s.message());
      }
    }
  } else {
    if (h.sync_id != sync->sync_id) {
      return Status::InvalidArgument(frame + ": inside sync " + std::to_string(sync->sync_id));
    }
    if (h.flush_index != index) {
      return Status::InvalidArgument(frame + ": expected flush index " + std::to_string(index));
    }
    if (h.kind != sync->kind) {
      return Status::InvalidArgument(frame + ": a seed and a delta frame in one sync");
    }
  }
  // The whole frame is checked before any weight is touched; each entry's
  // and each record's destination is found once, here.
  const std::span<const FlushEntry> entries = reader_.entries();
  const std::span<const stream::FlushDigest> records = reader_.digests();
  entry_dests_.clear();
  targets_.clear();
  record_dests_.clear();
  entry_dests_.reserve(entries.size());
  targets_.reserve(entries.size());
  record_dests_.reserve(records.size());
  bool any_device = false;
  for (size_t k = 0; k < entries.size(); ++k) {
    const FlushEntry& e = entries[k];
    const auto entry = [&] {
      return frame + ": entry " + std::to_string(k) + ": tensor '" + std::string(e.name) + "'";
    };
    auto it = by_name_.find(e.name);
    if (it == by_name_.end()) return Status::InvalidArgument(entry() + " is not registered here");
    Destination& d = *it->second;
    if (e.dtype != d.dtype || e.shape != d.shape) {
      return Status::InvalidArgument(entry() + " is " + std::string(DTypeName(e.dtype)) + " " +
                                     ShapeToString(e.shape) + " in the frame, " +
                                     std::string(DTypeName(d.dtype)) + " " +
                                     ShapeToString(d.shape) + " here");
    }
    entry_dests_.push_back(&d);
    targets_.push_back({&d.map, d.bytes});
    any_device = any_device || d.device != nullptr;
  }
  for (const stream::FlushDigest& r : records) {
    const auto record = [&] {
      return frame + ": the digest record of tensor '" + std::string(r.name) + "'";
    };
    auto it = by_name_.find(r.name);
    if (it == by_name_.end()) return Status::InvalidArgument(record() + ": not registered here");
    if (!(r.block == it->second->block)) {
      return Status::InvalidArgument(record() + " is for block " + r.block.ToString() +
                                     ", this receiver holds " + it->second->block.ToString());
    }
    record_dests_.push_back(it->second);
  }
  const bool seed = sync->kind == FrameKind::kSeed;
  // Host entries for device tensors: a host frame's, or a device frame's
  // read on the host (sparse entries).
  const bool staged =
      any_device && (!on_device || !device_frames_->host_copy().empty()) && !entries.empty();
  const auto t0 = Clock::now();
  Status applied;
  // What each applied entry (or the first that fails) leaves behind.
  const auto failed = [&](const Destination& d, const Status& s) {
    return Status(s.code(), frame + ": applying tensor '" + d.name + "': " + s.message());
  };
  const auto written_by = [&](Destination& d) {
    ++sync->entries;
    d.named_in = sync->stamp;
  };
  if (!on_device && !options_.apply_hook && !any_device) {
    // Host destinations only: the frame's entries in tasks of the
    // receiver's threads, each entry writing its own range and moving a
    // digest of its own, added to its tensor's in entry order.
    const stream::AppliedEntries done =
        stream::ApplyEntries(entries, targets_, Pool(), seed ? nullptr : &moves_);
    for (size_t k = 0; k < done.applied; ++k) {
      Destination& d = *entry_dests_[k];
      if (!seed) d.running += moves_[k];
      written_by(d);
    }
    stats->elements_written += done.written;
    if (done.applied < entries.size()) applied = failed(*entry_dests_[done.applied], done.failed);
  } else {
    // A device tensor takes a host frame's entries from device memory: the
    // frame goes up whole (or is found in the device bucket it came in),
    // and each entry is scattered from there with no wait of its own.
    std::span<const FlushEntry> apply = entries;
    if (staged) {
      if (Status s = PlaceOnDevices(on_device, entries); !s.ok()) {
        return Status(s.code(), frame + ": " + s.message());
      }
      apply = placed_;
    }
    for (size_t k = 0; k < apply.size(); ++k) {
      const FlushEntry& e = apply[k];
      Destination& d = *entry_dests_[k];
      if (options_.apply_hook) {
        if (Status s = options_.apply_hook(sync->sync_id, e.name, sync->entries); !s.ok()) {
          applied = failed(d, s);
          break;
        }
      }
      // An entry in device memory joins its device's batch: one launch
      // per stream for the whole frame.
      const auto apply_one = [&]() -> Result<uint64_t> {
        if (!d.device) return stream::ApplyEntry(e, d.map, d.bytes, seed ? nullptr : &d.running);
        if (e.host_readable) return d.device->Apply(e);
        DS_ASSIGN_OR_RETURN(stream::DeviceBatch * batch, Batch(d.place.cuda_device));
        return batch->Add(*d.device, e);
      };
      Result<uint64_t> written = apply_one();
      if (!written.ok()) {
        applied = failed(d, written.status());
        break;
      }
      stats->elements_written += *written;
      written_by(d);
    }
    // What was added runs, whether or not the whole frame was applied (the
    // stamps above say it was written).
    for (auto& [device, batch] : batches_) {
      if (Status s = batch->Launch(); !s.ok() && applied.ok()) {
        applied = Status(s.code(), frame + ": " + s.message());
      }
    }
  }
  if (on_device || staged) {
    // The bucket takes the next frame only once every scatter from it ran,
    // whether or not the whole frame was applied.
    std::set<std::string_view> waited;
    for (size_t k = 0; k < entries.size(); ++k) {
      const FlushEntry& e = entries[k];
      if (!entry_dests_[k]->device || !waited.insert(e.name).second) continue;
      Status s = entry_dests_[k]->device->Wait();
      if (!s.ok() && applied.ok()) {
        applied = Status(s.code(),
                         frame + ": applying tensor '" + std::string(e.name) + "': " + s.message());
      }
    }
    if (on_device) ++stats->device_frames;
  }
  if (!applied.ok()) {
    sync->clean = false;
    return applied;
  }
  stats->apply_s += SecondsSince(t0);
  for (size_t g = 0; g < records.size(); ++g) {
    Destination& d = *record_dests_[g];
    d.record = records[g].digest;
    d.record_in = sync->stamp;
  }
  if (h.last) sync->verify_all = h.verify_all;
  return Status::OK();
}

void Receiver::Verify(SyncState* sync, ReceiveStats* stats) {
  const bool all = sync->kind == FrameKind::kSeed || sync->verify_all;
  {
    // From memory: everything, for a seed or verify_all; else the device
    // destinations the sync wrote (they keep no running digest).
    const auto t0 = Clock::now();
    for (auto& [name, d] : dests_) {
      if (!all && !(d.device && d.named_in == sync->stamp)) continue;
      Result<StateDigest> now =
          d.device ? d.device->Digest() : stream::DigestDestination(d.map, d.bytes, d.w);
      if (!now.ok()) {
        sync->refused = Status(now.status().code(),
                               "tensor '" + name + "': digesting: " + now.status().message());
        sync->clean = false;
        return;
      }
      d.running = *now;
    }
    stats->verify_s += SecondsSince(t0);
  }
  const std::string head = "sync " + std::to_string(sync->sync_id) + ": ";
  for (const auto& [name, d] : dests_) {
    const bool needed = all || d.named_in == sync->stamp;
    if (d.record_in != sync->stamp) {
      if (!needed) continue;
      sync->refused = Status::Corruption(head + "tensor '" + name + "': no digest record");
      sync->clean = false;
      return;
    }
    if (!(d.record == d.running)) {
      sync->refused =
          Status::Corruption(head + "tensor '" + name + "': digest mismatch: it holds " +
                             d.running.ToHex() + ", the sender expects " + d.record.ToHex());
      sync->clean = false;
      return;
    }
  }
}

Result<ReceiveStats> Receiver::ReceiveSync() {
  if (busy_.exchange(true)) {
    return Status::FailedPrecondition(
        "ReceiveSync is already running in another thread (one call at a time)");
  }
  Result<ReceiveStats> r = ReceiveSyncAlone();
  busy_.store(false);
  return r;
}

Result<ReceiveStats> Receiver::ReceiveSyncAlone() {
  DS_RETURN_IF_ERROR(Cancelled());
  if (dests_.empty()) {
    return Status::FailedPrecondition("a receiver registers its tensors before it syncs");
  }
  started_ = true;
  const auto start = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ = true;
    waiting_since_ = start;
  }
  const auto stop_waiting = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ = false;
  };
  if (!comm_) {
    if (Status s = Join(); !s.ok()) {
      stop_waiting();
      return s;
    }
  }
  ReceiveStats stats;
  stats.partial = options_.partial;
  stats.tensors = dests_.size();
  SyncState sync;
  sync.stamp = ++syncs_;
  // The route opens the sync, which comes when the trainer is done with
  // its step: it waits as long as the user allows.
  Result<nlohmann::json> body =
      stream::RecvJsonAwaiting(*comm_, 0, MessageType::kRoute, options_.sync_wait);
  stats.wait_s = SecondsSince(start);
  stop_waiting();
  Result<stream::Route> route = body.ok() ? stream::ParseRoute(*body, comm_->rank(), comm_->size())
                                          : Result<stream::Route>(body.status());
  if (!route.ok()) {
    // Without it this receiver cannot know where the frames come from.
    Drop();
    return Status(route.status().code(), "taking the sync's route: " + route.status().message());
  }
  const int from = route->from;
  const int to = route->to;
  const auto leave = [&](const Status& s, const std::string& doing) {
    Drop();
    return Status(s.code(), doing + ": " + s.message());
  };
  // The shared frames come from `from` (passed on to `to`) until an `end`;
  // then this receiver's own from rank 0, the last flagged so.
  bool shared = true;
  for (;;) {
    const int source = shared ? from : 0;
    const std::string taking = "taking the sync's frame " + std::to_string(sync.frames) +
                               " from rank " + std::to_string(source);
    Result<stream::Envelope> env = stream::RecvEnvelope(*comm_, source, MessageType::kFrame);
    if (!env.ok()) return leave(env.status(), taking);
    if ((!shared && env->end) || (shared && env->last)) {
      return leave(Status::Corruption(env->end ? "an end of the shared frames among its own"
                                               : "a last frame among the shared ones"),
                   taking);
    }
    if (shared && to != 0) {
      if (Status s = comm_->Send(to, stream::EncodeEnvelope(*env)); !s.ok()) {
        return leave(s, "passing the sync's frames on to rank " + std::to_string(to));
      }
    }
    if (env->end) {
      shared = false;
      continue;
    }
    if (env->body_bytes > options_.max_frame_bytes) {
      Drop();
      return Status::OutOfRange("a flush frame of " + std::to_string(env->body_bytes) +
                                " bytes, past this receiver's max_frame_bytes of " +
                                std::to_string(options_.max_frame_bytes) +
                                " (it leaves the group)");
    }
    const auto t0 = Clock::now();
    // Into device memory when the frames are applied there.
    Result<stream::DeviceFrameReader*> device = DeviceFrames();
    Status s = device.status();
    std::span<uint8_t> into;
    if (s.ok() && *device != nullptr) {
      Result<std::span<uint8_t>> b = (*device)->Bucket(env->body_bytes);
      s = b.status();
      if (b.ok()) into = *b;
    } else if (s.ok()) {
      bucket_.resize(env->body_bytes);
      into = bucket_;
    }
    // A shared host frame is hashed chunk by chunk as it comes in (its
    // bytes before the trailer), while the next chunk is on its way.
    std::vector<uint8_t> checksum;
    const uint64_t hashed =
        into.size() > stream::kFlushTrailerBytes ? into.size() - stream::kFlushTrailerBytes : 0;
    uint64_t fed = 0;
    const bool hash_in = s.ok() && shared && *device == nullptr && hashed > 0;
    if (hash_in) frame_hash_->Reset();
    const Communicator::ChunkTaken take = [&](std::span<const uint8_t> part) {
      const uint64_t n = std::min<uint64_t>(part.size(), hashed - std::min(fed, hashed));
      if (n > 0) frame_hash_->Update(part.first(n));
      fed += part.size();
    };
    if (s.ok()) {
      s = shared ? stream::RelayShared(*comm_, from, to, into, hash_in ? take : nullptr)
                 : comm_->Recv(0, into);
    }
    if (!s.ok()) return leave(s, "taking a flush frame");
    if (hash_in) checksum = frame_hash_->Digest();
    stats.receive_s += SecondsSince(t0);
    ++sync.frames;
    stats.bytes += env->body_bytes;
    if (sync.refused.ok()) {
      sync.refused =
          TakeFrame(env->last, *device != nullptr, env->body_bytes, checksum, &sync, &stats);
    }
    if (env->last) break;
  }
  if (sync.refused.ok()) Verify(&sync, &stats);
  if (!sync.refused.ok() && !sync.clean) seeded_ = false;
  if (sync.refused.ok() && sync.kind == FrameKind::kSeed) seeded_ = true;
  stream::Report report{sync.refused, sync.clean};
  if (Status s = stream::SendJson(*comm_, 0, MessageType::kReport, stream::ReportBody(report));
      !s.ok()) {
    Drop();
    return Status(s.code(), "reporting to the sender: " + s.message());
  }
  if (sync.refused.ok() || sync.local) {
    if (sync.refused.ok()) failures_in_a_row_ = 0;
  } else if (++failures_in_a_row_ >= kRejoinAfterFailures) {
    // Whatever keeps this receiver and the sender apart (a registration the
    // sender took wrongly, say) goes away with a new hello.
    failures_in_a_row_ = 0;
    Drop();
    return Status(sync.refused.code(),
                  sync.refused.message() + " (" + std::to_string(kRejoinAfterFailures) +
                      " failed syncs in a row: this receiver forms the group again and is "
                      "reseeded)");
  }
  stats.sync_id = sync.sync_id;
  stats.seed = sync.kind == FrameKind::kSeed;
  stats.verify_all = sync.verify_all;
  stats.frames = sync.frames;
  if (!sync.refused.ok()) return sync.refused;
  return stats;
}

}  // namespace

Result<std::unique_ptr<StreamReceiver>> StreamReceiver::Create(CommunicatorFactory connect,
                                                               ReceiverOptions options) {
  if (!connect) return Status::InvalidArgument("StreamReceiver: no communicator factory");
  DS_RETURN_IF_ERROR(ThreadPool::CheckThreads(options.threads));
  return std::unique_ptr<StreamReceiver>(new Receiver(std::move(connect), std::move(options)));
}

}  // namespace deltasync
