// The stream's sender: what the whole-tensor and the sharded sender share
// (sender.h) but their buckets (sender_buckets.cc), and the whole-tensor
// sync (include/deltasync/stream.h; docs/format.md, "Stream: commit
// protocol").
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "comm/communicator_internal.h"
#include "core/endian.h"
#include "deltasync/diff.h"
#include "deltasync/stream.h"
#include "deltasync/tensor.h"
#include "deltasync/timing.h"
#include "stream/sender.h"

namespace deltasync {

namespace stream_sender {

Status Sender::CheckModel(std::span<const TensorMeta> tensors, std::vector<TensorState*>* order) {
  std::set<std::string_view> seen;
  for (const TensorMeta& x : tensors) {
    const std::string what = "tensor '" + std::string(x.name) + "'";
    if (x.name.empty() || x.name.size() > stream::kMaxTensorNameBytes) {
      return Status::InvalidArgument("tensor name '" + std::string(x.name) + "': empty or over " +
                                     std::to_string(stream::kMaxTensorNameBytes) + " bytes");
    }
    if (!seen.insert(x.name).second) return Status::InvalidArgument(what + " is passed twice");
    if (x.shape->size() > stream::kMaxTensorDims) {
      return Status::InvalidArgument(what + ": more than " +
                                     std::to_string(stream::kMaxTensorDims) + " dimensions");
    }
    DS_ASSIGN_OR_RETURN(int64_t numel, ShapeNumel(*x.shape));
    const size_t w = DTypeSize(x.dtype);
    if (w != 1 && w != 2 && w != 4 && w != 8) {
      return Status::InvalidArgument(what + ": dtype " + std::string(DTypeName(x.dtype)) +
                                     " has no element size the stream carries");
    }
    if (static_cast<uint64_t>(numel) >= stream::kMaxStreamNumel) {
      return Status::InvalidArgument(what + ": too many elements for the stream");
    }
    if (x.place.on_device() && x.data.size() > 0 && x.data.data() == nullptr) {
      return Status::InvalidArgument(what + ": null data");
    }
    if (!sharded_ && x.data.size() != static_cast<uint64_t>(numel) * w) {
      return Status::InvalidArgument(
          what + ": " + std::to_string(x.data.size()) + " bytes, shape " + ShapeToString(*x.shape) +
          " of " + std::string(DTypeName(x.dtype)) + " needs " + std::to_string(numel * w));
    }
    auto it = tensors_.find(x.name);
    if (it == tensors_.end()) {
      if (!tensors_.empty()) {
        return Status::InvalidArgument(what + " was not in the first sync's tensors");
      }
      continue;
    }
    if (it->second.dtype != x.dtype || it->second.shape != *x.shape) {
      return Status::InvalidArgument(what + ": " + std::string(DTypeName(x.dtype)) + " " +
                                     ShapeToString(*x.shape) + ", the first sync had " +
                                     std::string(DTypeName(it->second.dtype)) + " " +
                                     ShapeToString(it->second.shape));
    }
    if (x.place.on_device() != (it->second.device != nullptr)) {
      return Status::InvalidArgument(what + ": in " + (x.place.on_device() ? "device" : "host") +
                                     " memory, the first sync had it in " +
                                     (it->second.device ? "device" : "host") + " memory");
    }
  }
  if (!tensors_.empty() && seen.size() != tensors_.size()) {
    for (const auto& [name, t] : tensors_) {
      if (!seen.count(name)) {
        return Status::InvalidArgument("tensor '" + name + "' of the first sync is missing");
      }
    }
  }
  uint64_t model_bytes = 0;
  if (tensors_.empty()) {
    // Built aside, so that a refused first sync leaves none behind.
    std::map<std::string, TensorState, std::less<>> fresh;
    for (const TensorMeta& x : tensors) {
      TensorState t;
      t.name = std::string(x.name);
      t.dtype = x.dtype;
      t.shape = *x.shape;
      t.w = static_cast<uint32_t>(DTypeSize(x.dtype));
      t.numel = static_cast<uint64_t>(*ShapeNumel(*x.shape));
      const uint64_t room = (options_.bucket_bytes - kFrameReserve) / (2 * (8 + t.w));
      t.unit = std::max<uint64_t>(1, room);
      t.dirty.assign(t.units(), 0);
      if (x.place.on_device()) {
        DS_ASSIGN_OR_RETURN(stream::DeviceContext * ctx,
                            DeviceFor(x.place.cuda_device, "tensor '" + t.name + "'"));
        const uint64_t chunk = t.unit * std::max<uint64_t>(1, kDeviceChunkElements / t.unit);
        DS_ASSIGN_OR_RETURN(
            t.device, stream::DeviceSource::Create(*ctx, t.name, t.dtype, t.numel, t.unit, chunk,
                                                   options_.pinned_snapshot));
        // Memory that is not where the placement says refuses the model.
        DS_RETURN_IF_ERROR(t.device->Begin(x.data, x.place));
      }
      fresh.emplace(t.name, std::move(t));
    }
    tensors_ = std::move(fresh);
  }
  order->clear();
  for (const TensorMeta& x : tensors) {
    TensorState* t = &tensors_.find(x.name)->second;
    model_bytes += t->numel * t->w;
    order->push_back(t);
  }
  bucket_reserve_ = std::min(options_.bucket_bytes, 2 * model_bytes + (uint64_t{1} << 20));
  std::sort(order->begin(), order->end(),
            [](const TensorState* a, const TensorState* b) { return a->name < b->name; });
  return Status::OK();
}

Status Sender::Connect() {
  Result<std::unique_ptr<Communicator>> c = Status::OK();
  {
    stream_internal::FormationCancel cancel(&cancel_requested_);
    c = connect_();
  }
  if (!c.ok())
    return Status(c.status().code(), "forming the stream group: " + c.status().message());
  if ((*c)->rank() != 0) {
    return Status::InvalidArgument("the sender must be rank 0 of its stream group, not rank " +
                                   std::to_string((*c)->rank()));
  }
  DS_RETURN_IF_ERROR(Keep(&comm_, std::move(*c)));
  welcomed_ = false;
  return Status::OK();
}

Status Sender::Handshake(uint64_t sync_id) {
  peers_.clear();
  std::vector<std::string> refusals;
  for (int r = 1; r < comm_->size(); ++r) {
    const std::string who = "receiver " + std::to_string(r);
    // A hello that arrives damaged is refused in the welcome (the receiver
    // then knows why); only a failing communicator fails the handshake.
    Result<Envelope> env = stream::RecvEnvelope(*comm_, r, MessageType::kHello);
    if (!env.ok()) return Status(env.status().code(), who + ": " + env.status().message());
    std::vector<uint8_t> body(env->body_bytes);
    if (!body.empty()) {
      if (Status s = comm_->Recv(r, body); !s.ok()) {
        return Status(s.code(), who + ": " + s.message());
      }
    }
    Result<nlohmann::json> hello = stream::ParseJsonBody(body, "its hello");
    Result<stream::Hello> parsed =
        hello.ok() ? stream::ParseHello(*hello) : Result<stream::Hello>(hello.status());
    std::string refusal;
    Peer peer;
    peer.rank = r;
    if (!parsed.ok()) {
      refusal = parsed.status().message();
    } else if (parsed->max_frame_bytes < options_.bucket_bytes) {
      refusal = "it takes frames of at most " + std::to_string(parsed->max_frame_bytes) +
                " bytes, and the sender's frames may be " + std::to_string(options_.bucket_bytes) +
                " (its bucket_bytes): raise the receiver's max_frame_bytes or lower the sender's "
                "bucket_bytes";
    } else {
      peer.partial = parsed->partial;
      for (const Registration& reg : parsed->tensors) {
        auto it = tensors_.find(reg.name);
        if (it == tensors_.end()) {
          refusal =
              "registered tensors differ: tensor '" + reg.name + "' is not one the sender syncs";
          break;
        }
        const TensorState& t = it->second;
        if (t.dtype != reg.dtype || t.shape != reg.shape) {
          refusal = "registered tensors differ: tensor '" + reg.name + "' is " +
                    std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape) +
                    " at the sender, " + std::string(DTypeName(reg.dtype)) + " " +
                    ShapeToString(reg.shape) + " at the receiver";
          break;
        }
        if (reg.block.end() > t.numel) {
          refusal = "tensor '" + reg.name + "': block " + reg.block.ToString() + " is past its " +
                    std::to_string(t.numel) + " elements";
          break;
        }
        peer.blocks.emplace(reg.name, reg.block);
        peer.layout += reg.name;
        peer.layout += '\n';
      }
      if (refusal.empty() && !peer.partial && peer.blocks.size() != tensors_.size()) {
        for (const auto& [name, t] : tensors_) {
          if (peer.blocks.count(name)) continue;
          refusal = "it did not register tensor '" + name + "' (of " +
                    std::to_string(tensors_.size()) + " the sender syncs, it registered " +
                    std::to_string(peer.blocks.size()) +
                    "); a receiver that holds only some tensors on purpose says so (partial)";
          break;
        }
      }
    }
    nlohmann::json welcome = {{"ok", refusal.empty()}};
    if (!refusal.empty()) welcome["error"] = refusal;
    if (Status s = stream::SendJson(*comm_, r, MessageType::kWelcome, welcome); !s.ok()) {
      return Status(s.code(), who + ": " + s.message());
    }
    if (!refusal.empty()) refusals.push_back(who + ": " + refusal);
    peers_.push_back(std::move(peer));
  }
  if (!refusals.empty()) {
    std::string msg = "sync " + std::to_string(sync_id) + ": " + std::to_string(refusals.size()) +
                      " of " + std::to_string(comm_->size() - 1) + " receivers refused";
    for (const std::string& r : refusals) msg += "; " + r;
    return Status::InvalidArgument(msg);
  }
  // The committed digests are kept for the blocks receivers hold now:
  // blocks not seen before get theirs from the snapshot, and those no one
  // holds any more are dropped (nothing would keep them current).
  std::map<std::string_view, std::set<BlockKey>> held;
  for (const Peer& p : peers_) {
    for (const auto& [name, block] : p.blocks) held[name].insert(KeyOf(block));
  }
  for (auto& [name, t] : tensors_) {
    const std::set<BlockKey>& keys = held[name];
    std::erase_if(t.committed, [&](const auto& kv) { return !keys.count(kv.first); });
    // A sharded rank 0 has no copy to digest: a block new to it is
    // computed whole from the dense values of the seed its receiver takes.
    if (!have_snapshot_ || sharded_) continue;
    for (const BlockKey& key : keys) {
      if (t.committed.count(key)) continue;
      DS_ASSIGN_OR_RETURN(StateDigest d, t.device ? t.device->SnapshotDigest(BlockOf(key))
                                                  : stream::ComputeBlockPartDigest(
                                                        t.snapshot, t.w, 0, BlockOf(key)));
      t.committed.emplace(key, d);
    }
  }
  welcomed_ = true;
  return Status::OK();
}

Status Sender::SendRecords(Peer& peer, Group& g, uint64_t sync_id, bool verify_all,
                           const std::vector<TensorState*>& order, SyncStats* stats) {
  // A frame of this receiver's own: its group's count of frames is where
  // its flush index goes on, and other members go on from there too.
  const uint32_t base = g.frames;
  uint32_t own = 0;
  FlushWriter& w = g.writer;
  const auto begin = [&]() -> Status {
    FlushHeader h;
    h.sync_id = sync_id;
    h.flush_index = base + own;
    h.kind = g.seed ? FrameKind::kSeed : FrameKind::kDelta;
    h.last = true;
    h.verify_all = verify_all;
    return w.Begin(h, options_.bucket_bytes, &g.bucket);
  };
  const auto send = [&](bool last) -> Status {
    DS_RETURN_IF_ERROR(w.Finish());
    ++own;
    ++stats->frames;
    const auto t1 = Clock::now();
    Status s = SendOwnFrame(*comm_, peer.rank, last, g.bucket, &stats->bytes_sent);
    stats->transfer_s += SecondsSince(t1);
    return s;
  };
  DS_RETURN_IF_ERROR(begin());
  for (TensorState* t : order) {
    auto it = peer.blocks.find(t->name);
    if (it == peer.blocks.end()) continue;
    if (!g.seed && !verify_all && !g.named.count(t->name)) continue;
    const StateDigest& d = t->expected.at(KeyOf(it->second));
    DS_ASSIGN_OR_RETURN(bool fit, w.AddDigest(t->name, it->second, d));
    if (fit) continue;
    // Only the frame that ends the sync carries `last` (and verify_all).
    return Status::Unsupported("more digest records than one frame of " +
                               std::to_string(options_.bucket_bytes) +
                               " bytes holds; raise bucket_bytes");
  }
  return send(true);
}

Status Sender::BeginSync(Round* round, Clock::time_point start) {
  round->start = start;
  commit_log_.clear();
  if (!comm_) DS_RETURN_IF_ERROR(Connect());
  round->sync_id = next_sync_id_++;
  const std::string sync_name = "sync " + std::to_string(round->sync_id);
  if (!welcomed_) {
    if (Status s = Handshake(round->sync_id); !s.ok()) {
      Drop();
      if (s.code() == StatusCode::kInvalidArgument) return s;
      return Status(s.code(), sync_name + ": the handshake failed: " + s.message());
    }
  }
  SyncStats& stats = round->stats;
  stats.sync_id = round->sync_id;
  stats.receivers = static_cast<uint32_t>(peers_.size());
  for (const Peer& p : peers_) stats.partial_receivers += p.partial ? 1 : 0;
  stats.verify_all = options_.verify_every > 0 && round->sync_id % options_.verify_every == 0;
  // Receivers of one kind and layout take the same frames.
  std::map<std::pair<bool, std::string>, Group*> by_key;
  if (flight_.frame.capacity() > 0) {
    spare_buckets_.push_back(std::move(flight_.frame));
    flight_.frame = {};
  }
  // A device round takes its flight bucket again below.
  if (flight_.device) spare_device_frames_.push_back(std::move(flight_.device));
  round->group_of.assign(peers_.size(), nullptr);
  for (size_t i = 0; i < peers_.size(); ++i) {
    Peer& p = peers_[i];
    const bool seed = p.need_seed || !have_snapshot_;
    Group*& g = by_key[{seed, p.layout}];
    if (g == nullptr) {
      round->groups.push_back(std::make_unique<Group>());
      g = round->groups.back().get();
      if (!spare_buckets_.empty()) {
        g->bucket = std::move(spare_buckets_.back());
        spare_buckets_.pop_back();
      }
      g->seed = seed;
      g->writer.set_zstd_level(options_.zstd_level);
      for (const auto& [name, block] : p.blocks) g->holds.insert(name);
    }
    g->members.push_back(i);
    round->group_of[i] = g;
    stats.seeded += seed ? 1 : 0;
  }
  // Each group's members take its shared frames down a chain in rank
  // order; every receiver learns its place first.
  std::vector<stream::Route> routes(peers_.size());
  for (const std::unique_ptr<Group>& g : round->groups) {
    for (size_t j = 0; j < g->members.size(); ++j) {
      stream::Route& route = routes[g->members[j]];
      route.from = j == 0 ? 0 : peers_[g->members[j - 1]].rank;
      route.to = j + 1 < g->members.size() ? peers_[g->members[j + 1]].rank : 0;
    }
  }
  for (size_t i = 0; i < peers_.size(); ++i) {
    const int rank = peers_[i].rank;
    if (Status s =
            stream::SendJson(*comm_, rank, MessageType::kRoute, stream::RouteBody(routes[i]));
        !s.ok()) {
      Drop();
      return Status(s.code(), "sync " + std::to_string(round->sync_id) + ": receiver " +
                                  std::to_string(rank) + ": " + s.message());
    }
  }
  // One group sends a frame while it fills the next, in a second bucket.
  if (round->groups.size() == 1) {
    round->groups[0]->overlap = true;
    if (flight_.frame.capacity() == 0 && !spare_buckets_.empty()) {
      flight_.frame = std::move(spare_buckets_.back());
      spare_buckets_.pop_back();
    }
  }
  // Frames are built on the device when every tensor lives on one device
  // and the communicator sends that device's memory, unless a delta is sparse
  // (compressed on the host; seeds are dense). Buckets that cannot be had
  // leave this sync to host frames.
  bool deltas = false;
  for (const std::unique_ptr<Group>& g : round->groups) deltas = deltas || !g->seed;
  stream::DeviceContext* ctx = FrameDevice();
  const CommunicatorCapabilities caps = comm_->capabilities();
  if (ctx != nullptr && options_.device_frames && caps.device_buffers &&
      caps.cuda_device == ctx->device() &&
      (options_.encoding != StreamEncoding::kSparse || !deltas)) {
    const auto take = [&](std::unique_ptr<stream::DeviceFrame>* frame) -> bool {
      if (*frame) return true;
      if (!spare_device_frames_.empty()) {
        *frame = std::move(spare_device_frames_.back());
        spare_device_frames_.pop_back();
        return true;
      }
      Result<std::unique_ptr<stream::DeviceFrame>> f =
          stream::DeviceFrame::Create(*ctx, options_.bucket_bytes);
      if (!f.ok()) return false;
      *frame = std::move(*f);
      return true;
    };
    bool ok = true;
    for (const std::unique_ptr<Group>& g : round->groups) ok = ok && take(&g->device);
    if (round->groups.size() == 1) ok = ok && take(&flight_.device);
    round->device_frames = ok;
    if (!ok) {
      for (const std::unique_ptr<Group>& g : round->groups) {
        if (g->device) spare_device_frames_.push_back(std::move(g->device));
      }
    }
  }
  return Status::OK();
}

Result<stream::DeviceContext*> Sender::DeviceFor(int cuda_device, const std::string& what) {
  std::unique_ptr<stream::DeviceContext>& ctx = devices_[cuda_device];
  if (!ctx) {
    Result<std::unique_ptr<stream::DeviceContext>> c = stream::DeviceContext::Create(cuda_device);
    if (!c.ok()) {
      devices_.erase(cuda_device);
      return Status(c.status().code(), what + ": " + c.status().message());
    }
    ctx = std::move(*c);
  }
  return ctx.get();
}

stream::DeviceContext* Sender::FrameDevice() const {
  if (devices_.size() != 1) return nullptr;
  for (const auto& [name, t] : tensors_) {
    if (!t.device) return nullptr;
  }
  return devices_.begin()->second.get();
}

void Sender::ForgetSnapshot() {
  have_snapshot_ = false;
  for (auto& [name, t] : tensors_) {
    std::fill(t.dirty.begin(), t.dirty.end(), 0);
    t.committed.clear();
  }
  for (Peer& p : peers_) p.need_seed = true;
}

Result<SyncStats> Sender::EndSync(Round* round, const std::vector<TensorState*>& order,
                                  const std::function<Status()>& commit) {
  SyncStats& stats = round->stats;
  Status& streamed = round->streamed;
  for (const std::unique_ptr<Group>& g : round->groups) {
    if (streamed.ok() && g->open) streamed = Flush(*g, &stats);
  }
  if (Status landed = Land(&stats); streamed.ok()) streamed = landed;
  for (const std::unique_ptr<Group>& g : round->groups) {
    if (!streamed.ok()) break;
    const int head = peers_[g->members.front()].rank;
    if (Status s = stream::SendEnd(*comm_, head); !s.ok()) {
      streamed = Status(s.code(), "receiver " + std::to_string(head) + ": " + s.message());
    }
  }
  for (size_t i = 0; i < peers_.size() && streamed.ok(); ++i) {
    streamed = SendRecords(peers_[i], *round->group_of[i], round->sync_id, stats.verify_all, order,
                           &stats);
  }
  stats.buffer_bytes = changes_.pos32.capacity() * 4 + changes_.pos64.capacity() * 8 +
                       changes_.new_values.capacity() + changes_.old_values.capacity() +
                       scratch_.capacity() + staged_positions_.capacity() * 4 +
                       staged_values_.capacity() + host_kept_peak_ + host_scratch_peak_ +
                       commit_log_.capacity();
  for (const stream::SparseRegions& r : sparse_regions_) {
    stats.buffer_bytes += r.positions.capacity() + r.values.capacity();
  }
  host_kept_peak_ = 0;
  host_scratch_peak_ = 0;
  for (const std::unique_ptr<Group>& g : round->groups) {
    stats.buffer_bytes += g->bucket.capacity();
    if (g->device) stats.buffer_bytes += g->device->buffer_bytes();
  }
  stats.buffer_bytes += flight_.frame.capacity();
  if (flight_.device) stats.buffer_bytes += flight_.device->buffer_bytes();
  // The buckets serve the next sync: their pages are not faulted in again
  // (the flight's stays with it).
  for (const std::unique_ptr<Group>& g : round->groups) {
    if (spare_buckets_.size() + (flight_.frame.capacity() > 0 ? 1 : 0) < kSpareBuckets &&
        g->bucket.capacity() > 0) {
      spare_buckets_.push_back(std::move(g->bucket));
    }
    if (g->device && spare_device_frames_.size() + (flight_.device ? 1 : 0) < kSpareBuckets) {
      spare_device_frames_.push_back(std::move(g->device));
    }
  }
  for (const auto& [device, ctx] : devices_) stats.buffer_bytes += ctx->buffer_bytes();
  stats.buffer_bytes += quantized_.buffer_bytes();
  for (const TensorState* t : order) {
    if (t->device) stats.buffer_bytes += t->device->buffer_bytes();
  }
  std::vector<std::string> failures;
  std::vector<bool> failed(peers_.size(), false);
  StatusCode code = StatusCode::kOk;
  if (!streamed.ok()) {
    failures.push_back(streamed.message());
    code = streamed.code();
    Drop();
  } else {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < peers_.size(); ++i) {
      Peer& p = peers_[i];
      const std::string who = "receiver " + std::to_string(p.rank);
      Result<nlohmann::json> body = stream::RecvJson(*comm_, p.rank, MessageType::kReport);
      Result<stream::Report> report =
          body.ok() ? stream::ParseReport(*body) : Result<stream::Report>(body.status());
      if (!report.ok()) {
        failures.push_back(who + ": " + report.status().message());
        if (code == StatusCode::kOk) code = report.status().code();
        Drop();
        break;
      }
      if (!report->status.ok()) {
        failed[i] = true;
        failures.push_back(who + ": " + report->status.message());
        if (code == StatusCode::kOk) code = report->status.code();
        if (!report->clean) p.need_seed = true;
      }
    }
    stats.report_s = SecondsSince(t0);
  }

  if (failures.empty()) {
    const auto t0 = Clock::now();
    committed_bytes_ = 0;
    if (Status c = commit(); !c.ok()) {
      ForgetSnapshot();
      for (TensorState* t : order) {
        t->changed.clear();
        t->logged.clear();
      }
      commit_log_.clear();
      return Status(c.code(), "sync " + std::to_string(round->sync_id) +
                                  ": every receiver applied it, but the sender could not keep "
                                  "its snapshot (the next sync reseeds every receiver): " +
                                  c.message());
    }
    for (TensorState* t : order) {
      std::fill(t->dirty.begin(), t->dirty.end(), 0);
      t->changed.clear();
      t->logged.clear();
      for (const auto& [key, d] : t->expected) t->committed[key] = d;
    }
    have_snapshot_ = true;
    for (Peer& p : peers_) p.need_seed = false;
    committed_id_ = round->sync_id;
    stats.commit_s = SecondsSince(t0);
    stats.committed_bytes = committed_bytes_;
    stats.total_s = SecondsSince(round->start);
    UpdateCostModel(stats);
    return stats;
  }

  // Nothing advances. What this sync changed is resent until one commits;
  // a receiver that failed while being seeded still needs its seed, and
  // one seeded now holds the sync's values, which the resend covers.
  for (TensorState* t : order) {
    // A sharded sync's changes are resent by the ranks that hold them.
    if (!sharded_) {
      for (uint64_t u = 0; u < t->changed.size(); ++u) t->dirty[u] |= t->changed[u];
    }
    t->changed.clear();
    t->logged.clear();
    if (t->device) t->device->Rollback();
  }
  commit_log_.clear();
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (round->group_of[i]->seed && !failed[i] && have_snapshot_ && comm_) {
      peers_[i].need_seed = false;
    }
  }
  std::string msg = "sync " + std::to_string(round->sync_id) + ": ";
  if (comm_) {
    msg += std::to_string(failures.size()) + " of " + std::to_string(peers_.size()) +
           " receivers failed";
  } else {
    msg +=
        "the stream group broke (it is formed again, and every receiver reseeded, at the "
        "next sync)";
  }
  for (const std::string& f : failures) msg += "; " + f;
  if (!comm_) {
    // The connection the sender lost may be to a receiver whose successor
    // died: it left the group when it could not pass the frames on.
    std::string chains;
    for (const std::unique_ptr<Group>& g : round->groups) {
      if (g->members.size() < 2) continue;
      std::vector<int> chain;
      for (size_t m : g->members) chain.push_back(peers_[m].rank);
      chains += (chains.empty() ? "" : ", ") + ChainName(chain);
    }
    if (!chains.empty()) {
      msg += " (receivers passed this sync's frames on: " + chains +
             "; one that lost the next in its chain leaves the group too)";
    }
  }
  return Status(code == StatusCode::kOk ? StatusCode::kAborted : code, msg);
}

Result<SyncStats> Sender::SyncAlone(std::span<const SyncTensor> given) {
  const Clock::time_point start = Clock::now();
  if (sharded_) return Status::FailedPrecondition("a sharded sender syncs with SyncShards");
  // Tensors sent quantized become their codes and scales here.
  DS_ASSIGN_OR_RETURN(const std::span<const SyncTensor> tensors,
                      quantized_.Expand(given, Pool(), [this](int device, const std::string& what) {
                        return DeviceFor(device, what);
                      }));
  const double quantize_s = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<TensorMeta> metas;
  for (const SyncTensor& x : tensors) {
    metas.push_back({x.name, x.dtype, &x.shape, x.data, x.place});
  }
  std::vector<TensorState*> order;
  DS_RETURN_IF_ERROR(CheckModel(metas, &order));
  std::map<std::string_view, std::span<const uint8_t>> data;
  for (const SyncTensor& x : tensors) {
    data[x.name] = x.data;
    // Device tensors are checked (device memory of their device) before
    // anything is sent.
    if (x.place.on_device()) {
      DS_RETURN_IF_ERROR(tensors_.find(x.name)->second.device->Begin(x.data, x.place));
    }
  }
  Round round;
  DS_RETURN_IF_ERROR(BeginSync(&round, start));
  round.stats.quantize_s = quantize_s;
  diff_.refresh_snapshot = false;
  diff_.keep_old_values = true;
  diff_.pool = Pool();
  diff_.parallel_chunk_bytes = kParallelDiffBytes;
  for (TensorState* t : order) {
    const std::span<const uint8_t> x = data.at(t->name);
    UnitSource src;
    if (stream::DeviceSource* dev = t->device.get()) {
      src.changes = [dev](uint64_t first, uint64_t count, ChangeSet* out) {
        return dev->Changes(first, count, out);
      };
      src.dense = [dev](uint64_t first, uint64_t count) { return dev->Dense(first, count); };
      src.whole_digest = [dev](uint64_t first, uint64_t count, bool seed) {
        return dev->WholeDigest(first, count, seed);
      };
      round.streamed = StreamTensor(*t, src, &round);
      if (!round.streamed.ok()) break;
      continue;
    }
    src.changes = [&](uint64_t first, uint64_t count, ChangeSet* out) {
      diff_.elem_size = t->w;
      std::span<uint8_t> su(t->snapshot.data() + first * t->w, count * t->w);
      return DiffTensor(x.subspan(first * t->w, count * t->w), su, diff_, out);
    };
    src.dense = [&](uint64_t first, uint64_t count) -> Result<std::span<const uint8_t>> {
      return x.subspan(first * t->w, count * t->w);
    };
    src.host = true;
    src.host_current = x;
    src.host_snapshot = t->snapshot;
    round.streamed = StreamTensor(*t, src, &round);
    if (!round.streamed.ok()) break;
  }
  return EndSync(&round, order, [&]() -> Status {
    // The changed units of host tensors copied, and the logged elements of
    // the others, on the sender's threads.
    std::vector<Copy> copies;
    std::vector<std::pair<TensorState*, const uint8_t*>> runs_of;
    std::vector<const LoggedRun*> runs;
    for (TensorState* t : order) {
      if (t->device) {
        DS_RETURN_IF_ERROR(t->device->Commit());
        continue;
      }
      const std::span<const uint8_t> x = data.at(t->name);
      if (t->snapshot.empty()) {
        t->snapshot.resize(x.size());
        copies.push_back({t->snapshot.data(), x.data(), x.size()});
        continue;
      }
      for (uint64_t u = 0; u < t->changed.size(); ++u) {
        if (t->changed[u] != kUnitCopied) continue;
        const uint64_t first = u * t->unit;
        const uint64_t count = std::min(t->unit, t->numel - first);
        copies.push_back(
            {t->snapshot.data() + first * t->w, x.data() + first * t->w, count * t->w});
      }
      for (const LoggedRun& r : t->logged) {
        runs_of.emplace_back(t, x.data());
        runs.push_back(&r);
      }
    }
    CopyAll(copies);
    for (const Copy& c : copies) committed_bytes_ += c.bytes;
    for (size_t i = 0; i < runs.size(); ++i) committed_bytes_ += runs[i]->n * runs_of[i].first->w;
    const auto copy_run = [&](size_t i) {
      TensorState& t = *runs_of[i].first;
      CopyLogged(*runs[i], t.w, commit_log_.data(), runs_of[i].second, t.snapshot.data());
    };
    if (ThreadPool* pool = Pool(); pool != nullptr && runs.size() > 1) {
      pool->ParallelFor(runs.size(), copy_run);
    } else {
      for (size_t i = 0; i < runs.size(); ++i) copy_run(i);
    }
    commit_log_.clear();
    return Status::OK();
  });
}

Result<std::span<const uint8_t>> Sender::Snapshot(std::string_view name) const {
  if (sharded_) {
    return Status::FailedPrecondition(
        "a sharded sender holds no whole tensor (each rank keeps its own shards: ShardSnapshot)");
  }
  auto it = tensors_.find(name);
  if (it == tensors_.end() || !have_snapshot_) {
    return Status::NotFound("no committed state of tensor '" + std::string(name) + "'");
  }
  if (it->second.device) return it->second.device->snapshot();
  return std::span<const uint8_t>(it->second.snapshot);
}

}  // namespace stream_sender

std::string_view StreamEncodingName(StreamEncoding encoding) {
  switch (encoding) {
    case StreamEncoding::kDense: return "dense";
    case StreamEncoding::kIndices: return "indices";
    case StreamEncoding::kSparse: return "sparse";
  }
  return "unknown";
}

Result<StreamEncoding> ParseStreamEncoding(std::string_view name) {
  for (StreamEncoding e :
       {StreamEncoding::kDense, StreamEncoding::kIndices, StreamEncoding::kSparse}) {
    if (StreamEncodingName(e) == name) return e;
  }
  return Status::InvalidArgument("stream encoding '" + std::string(name) +
                                 "': expected dense, indices or sparse");
}

Result<std::unique_ptr<StreamSender>> StreamSender::CreateSharded(CommunicatorFactory trainer_group,
                                                                  CommunicatorFactory stream_group,
                                                                  SenderOptions options) {
  if (!trainer_group) return Status::InvalidArgument("StreamSender: no trainer group factory");
  DS_RETURN_IF_ERROR(stream_sender::CheckOptions(options));
  if (!options.quantize.empty()) {
    return Status::InvalidArgument(
        "SenderOptions::quantize: a sharded sender sends its ranks' tensors as they are (quantize "
        "each rank's part with Fp8QuantizeShard, deltasync/shard.h)");
  }
  return std::unique_ptr<StreamSender>(
      new stream_sender::Sender(std::move(trainer_group), std::move(stream_group), options));
}

Result<std::unique_ptr<StreamSender>> StreamSender::Create(CommunicatorFactory connect,
                                                           SenderOptions options) {
  if (!connect) return Status::InvalidArgument("StreamSender: no communicator factory");
  DS_RETURN_IF_ERROR(stream_sender::CheckOptions(options));
  return std::unique_ptr<StreamSender>(new stream_sender::Sender(std::move(connect), options));
}

}  // namespace deltasync