// The stream's sender (include/deltasync/stream.h; docs/format.md, "Stream:
// commit protocol").
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "deltasync/diff.h"
#include "deltasync/stream.h"
#include "deltasync/tensor.h"
#include "deltasync/timing.h"
#include "stream/frame.h"
#include "stream/state_digest.h"
#include "stream/sync_messages.h"

namespace deltasync {

namespace {

using stream::DigestBlock;
using stream::Envelope;
using stream::FlushHeader;
using stream::FlushWriter;
using stream::FrameKind;
using stream::MessageType;
using stream::Positions;
using stream::Registration;
using stream::StateDigest;
using stream::TensorRange;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kMinBucketBytes = uint64_t{64} << 10;
// Room a frame keeps for its header, manifest entry and trailer beside one
// unit's positions and values.
constexpr uint64_t kFrameReserve = 8192;

using BlockKey = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t>;

BlockKey KeyOf(const DigestBlock& b) { return {b.first, b.count, b.rows, b.row_stride}; }
DigestBlock BlockOf(const BlockKey& k) {
  return {std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k)};
}

bool Covers(const DigestBlock& b, uint64_t numel) {
  return b.first == 0 && b.count == numel && b.rows == 1;
}

bool InBlock(const DigestBlock& b, uint64_t p) {
  if (p < b.first) return false;
  const uint64_t off = p - b.first;
  if (b.rows == 1) return off < b.count;
  const uint64_t row = off / b.row_stride;
  return row < b.rows && off % b.row_stride < b.count;
}

uint64_t LoadBits(const uint8_t* p, uint32_t w) {
  uint64_t v = 0;
  std::memcpy(&v, p, w);  // little-endian hosts only (the build checks)
  return v;
}

struct TensorState {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint32_t w = 1;
  uint64_t unit = 1;                          // elements per unit of work
  std::vector<uint8_t> snapshot;              // the committed state (empty before it)
  std::vector<uint8_t> dirty;                 // per unit: changed by a failed sync
  std::vector<uint8_t> changed;               // per unit: changed by the current sync
  std::map<BlockKey, StateDigest> committed;  // the snapshot's digest per held block
  std::map<BlockKey, StateDigest> expected;   // at the end of the current sync

  uint64_t units() const { return numel == 0 ? 0 : (numel + unit - 1) / unit; }
};

struct Peer {
  int rank = 0;
  bool need_seed = true;
  std::map<std::string, DigestBlock, std::less<>> blocks;  // held tensors
  std::string layout;                                      // the held names, one key per set
};

class Sender final : public StreamSender {
 public:
  Sender(CommunicatorFactory connect, SenderOptions options)
      : connect_(std::move(connect)), options_(options) {}

  Result<SyncStats> Sync(std::span<const SyncTensor> tensors) override;
  Result<std::span<const uint8_t>> Snapshot(std::string_view name) const override;
  uint64_t committed_sync_id() const override { return committed_id_; }

 private:
  // The receivers of one kind (seed or delta) holding one set of tensors:
  // they take the same frames.
  struct Group {
    bool seed = false;
    std::vector<size_t> members;  // indices into peers_
    std::set<std::string, std::less<>> holds;
    std::set<std::string, std::less<>> named;  // tensors its entries named
    FlushWriter writer;
    std::vector<uint8_t> bucket;
    uint32_t frames = 0;
    bool open = false;
  };

  Status CheckTensors(std::span<const SyncTensor> tensors,
                      std::vector<std::pair<TensorState*, const SyncTensor*>>* order);
  Status Connect();
  Status Handshake(uint64_t sync_id);
  void Drop() {
    comm_.reset();
    welcomed_ = false;
  }
  Status Begin(Group& g, uint64_t sync_id, bool last, bool verify_all);
  Status Flush(Group& g, bool last, SyncStats* stats);
  template <typename AddFn>
  Status Add(Group& g, uint64_t sync_id, SyncStats* stats, AddFn&& add);
  Status StreamTensor(TensorState& t, const SyncTensor& x, uint64_t sync_id,
                      std::vector<std::unique_ptr<Group>>& groups, SyncStats* stats);
  Status SendRecords(Peer& peer, Group& g, uint64_t sync_id, bool verify_all,
                     const std::vector<std::pair<TensorState*, const SyncTensor*>>& order,
                     SyncStats* stats);

  CommunicatorFactory connect_;
  SenderOptions options_;
  std::unique_ptr<Communicator> comm_;
  bool welcomed_ = false;
  std::vector<Peer> peers_;
  std::map<std::string, TensorState, std::less<>> tensors_;
  bool have_snapshot_ = false;
  uint64_t next_sync_id_ = 1;
  uint64_t committed_id_ = 0;
  DiffOptions diff_;
  ChangeSet changes_;
  std::vector<uint64_t> scratch_positions_;
};

Status Sender::CheckTensors(std::span<const SyncTensor> tensors,
                            std::vector<std::pair<TensorState*, const SyncTensor*>>* order) {
  std::set<std::string_view> seen;
  for (const SyncTensor& x : tensors) {
    const std::string what = "tensor '" + x.name + "'";
    if (x.name.empty() || x.name.size() > stream::kMaxTensorNameBytes) {
      return Status::InvalidArgument("tensor name '" + x.name + "': empty or over " +
                                     std::to_string(stream::kMaxTensorNameBytes) + " bytes");
    }
    if (!seen.insert(x.name).second) return Status::InvalidArgument(what + " is passed twice");
    if (x.shape.size() > stream::kMaxTensorDims) {
      return Status::InvalidArgument(what + ": more than " +
                                     std::to_string(stream::kMaxTensorDims) + " dimensions");
    }
    DS_ASSIGN_OR_RETURN(int64_t numel, ShapeNumel(x.shape));
    const size_t w = DTypeSize(x.dtype);
    if (w != 1 && w != 2 && w != 4 && w != 8) {
      return Status::InvalidArgument(what + ": dtype " + std::string(DTypeName(x.dtype)) +
                                     " has no element size the stream carries");
    }
    if (static_cast<uint64_t>(numel) >= stream::kMaxStreamNumel) {
      return Status::InvalidArgument(what + ": too many elements for the stream");
    }
    if (x.data.size() != static_cast<uint64_t>(numel) * w) {
      return Status::InvalidArgument(what + ": " + std::to_string(x.data.size()) +
                                     " bytes, shape " + stream::ShapeText(x.shape) + " of " +
                                     std::string(DTypeName(x.dtype)) + " needs " +
                                     std::to_string(numel * w));
    }
    auto it = tensors_.find(x.name);
    if (it == tensors_.end()) {
      if (!tensors_.empty()) {
        return Status::InvalidArgument(what + " was not in the first sync's tensors");
      }
      continue;
    }
    if (it->second.dtype != x.dtype || it->second.shape != x.shape) {
      return Status::InvalidArgument(what + ": " + std::string(DTypeName(x.dtype)) + " " +
                                     stream::ShapeText(x.shape) + ", the first sync had " +
                                     std::string(DTypeName(it->second.dtype)) + " " +
                                     stream::ShapeText(it->second.shape));
    }
  }
  if (!tensors_.empty() && seen.size() != tensors_.size()) {
    for (const auto& [name, t] : tensors_) {
      if (!seen.count(name)) {
        return Status::InvalidArgument("tensor '" + name + "' of the first sync is missing");
      }
    }
  }
  if (tensors_.empty()) {
    for (const SyncTensor& x : tensors) {
      TensorState t;
      t.name = x.name;
      t.dtype = x.dtype;
      t.shape = x.shape;
      t.w = static_cast<uint32_t>(DTypeSize(x.dtype));
      t.numel = x.data.size() / t.w;
      const uint64_t room = (options_.bucket_bytes - kFrameReserve) / (2 * (8 + t.w));
      t.unit = std::max<uint64_t>(1, room);
      t.dirty.assign(t.units(), 0);
      tensors_.emplace(x.name, std::move(t));
    }
  }
  order->clear();
  for (const SyncTensor& x : tensors) order->emplace_back(&tensors_.find(x.name)->second, &x);
  std::sort(order->begin(), order->end(),
            [](const auto& a, const auto& b) { return a.first->name < b.first->name; });
  return Status::OK();
}

Status Sender::Connect() {
  Result<std::unique_ptr<Communicator>> c = connect_();
  if (!c.ok())
    return Status(c.status().code(), "forming the stream group: " + c.status().message());
  if ((*c)->rank() != 0) {
    return Status::InvalidArgument("the sender must be rank 0 of its stream group, not rank " +
                                   std::to_string((*c)->rank()));
  }
  comm_ = std::move(*c);
  welcomed_ = false;
  return Status::OK();
}

Status Sender::Handshake(uint64_t sync_id) {
  peers_.clear();
  std::vector<std::string> refusals;
  for (int r = 1; r < comm_->size(); ++r) {
    const std::string who = "receiver " + std::to_string(r);
    Result<nlohmann::json> hello = stream::RecvJson(*comm_, r, MessageType::kHello);
    if (!hello.ok()) return Status(hello.status().code(), who + ": " + hello.status().message());
    Result<std::vector<Registration>> regs = stream::ParseHello(*hello);
    std::string refusal;
    Peer peer;
    peer.rank = r;
    if (!regs.ok()) {
      refusal = regs.status().message();
    } else {
      for (const Registration& reg : *regs) {
        auto it = tensors_.find(reg.name);
        if (it == tensors_.end()) {
          refusal =
              "registered tensors differ: tensor '" + reg.name + "' is not one the sender syncs";
          break;
        }
        const TensorState& t = it->second;
        if (t.dtype != reg.dtype || t.shape != reg.shape) {
          refusal = "registered tensors differ: tensor '" + reg.name + "' is " +
                    std::string(DTypeName(t.dtype)) + " " + stream::ShapeText(t.shape) +
                    " at the sender, " + std::string(DTypeName(reg.dtype)) + " " +
                    stream::ShapeText(reg.shape) + " at the receiver";
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
    if (!have_snapshot_) continue;
    for (const BlockKey& key : keys) {
      if (t.committed.count(key)) continue;
      DS_ASSIGN_OR_RETURN(StateDigest d,
                          stream::ComputeBlockPartDigest(t.snapshot, t.w, 0, BlockOf(key)));
      t.committed.emplace(key, d);
    }
  }
  welcomed_ = true;
  return Status::OK();
}

Status Sender::Begin(Group& g, uint64_t sync_id, bool last, bool verify_all) {
  FlushHeader h;
  h.sync_id = sync_id;
  h.flush_index = g.frames;
  h.kind = g.seed ? FrameKind::kSeed : FrameKind::kDelta;
  h.last = last;
  h.verify_all = verify_all;
  DS_RETURN_IF_ERROR(g.writer.Begin(h, options_.bucket_bytes, &g.bucket));
  g.open = true;
  return Status::OK();
}

Status Sender::Flush(Group& g, bool last, SyncStats* stats) {
  const auto t0 = Clock::now();
  DS_RETURN_IF_ERROR(g.writer.Finish());
  stats->encode_s += SecondsSince(t0);
  g.open = false;
  ++g.frames;
  ++stats->frames;
  const auto t1 = Clock::now();
  for (size_t m : g.members) {
    const int r = peers_[m].rank;
    if (Status s = stream::SendMessage(*comm_, r, MessageType::kFrame, last, g.bucket); !s.ok()) {
      return Status(s.code(), "receiver " + std::to_string(r) + ": " + s.message());
    }
    stats->bytes_sent += stream::kEnvelopeBytes + g.bucket.size();
  }
  stats->transfer_s += SecondsSince(t1);
  return Status::OK();
}

template <typename AddFn>
Status Sender::Add(Group& g, uint64_t sync_id, SyncStats* stats, AddFn&& add) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (!g.open) DS_RETURN_IF_ERROR(Begin(g, sync_id, false, false));
    const auto t0 = Clock::now();
    Result<bool> fit = add(g.writer);
    stats->encode_s += SecondsSince(t0);
    if (!fit.ok()) return fit.status();
    if (*fit) return Status::OK();
    if (g.writer.entry_count() == 0) break;
    DS_RETURN_IF_ERROR(Flush(g, false, stats));
  }
  return Status::Internal("a unit of work does not fit an empty frame of " +
                          std::to_string(options_.bucket_bytes) + " bytes");
}

Status Sender::StreamTensor(TensorState& t, const SyncTensor& x, uint64_t sync_id,
                            std::vector<std::unique_ptr<Group>>& groups, SyncStats* stats) {
  // The blocks receivers hold of this tensor, and their digests' change.
  std::map<BlockKey, StateDigest> delta;
  for (const Peer& p : peers_) {
    auto it = p.blocks.find(t.name);
    if (it != p.blocks.end()) delta.emplace(KeyOf(it->second), StateDigest{});
  }
  t.changed.assign(t.units(), 0);
  diff_.elem_size = t.w;
  diff_.refresh_snapshot = false;
  diff_.keep_old_values = true;
  const TensorRange whole{t.name, t.dtype, t.shape, 0, t.numel};
  for (uint64_t u = 0; u < t.units(); ++u) {
    const uint64_t first = u * t.unit;
    const uint64_t count = std::min(t.unit, t.numel - first);
    const std::span<const uint8_t> xu = x.data.subspan(first * t.w, count * t.w);
    TensorRange range = whole;
    range.first = first;
    range.count = count;
    bool resend = false;  // the whole unit, dense
    if (have_snapshot_) {
      const auto t0 = Clock::now();
      std::span<uint8_t> su(t.snapshot.data() + first * t.w, count * t.w);
      DS_RETURN_IF_ERROR(DiffTensor(xu, su, diff_, &changes_));
      stats->changed += changes_.count();
      resend = t.dirty[u] != 0;
      if (resend || changes_.count() > 0) t.changed[u] = 1;
      for (auto& [key, d] : delta) {
        const DigestBlock b = BlockOf(key);
        if (resend) {
          DS_ASSIGN_OR_RETURN(StateDigest now, stream::ComputeBlockPartDigest(xu, t.w, first, b));
          DS_ASSIGN_OR_RETURN(StateDigest was, stream::ComputeBlockPartDigest(su, t.w, first, b));
          d += now - was;
        } else if (changes_.count() == 0) {
          continue;
        } else if (Covers(b, t.numel)) {
          DS_RETURN_IF_ERROR(stream::UpdateStateDigest(
              &d, Positions::Of(changes_, first), changes_.old_values, changes_.new_values, t.w));
        } else {
          for (uint64_t k = 0; k < changes_.count(); ++k) {
            const uint64_t p = first + changes_.position(k);
            if (!InBlock(b, p)) continue;
            d -= stream::ElementDigest(p, LoadBits(changes_.old_values.data() + k * t.w, t.w), t.w);
            d += stream::ElementDigest(p, LoadBits(changes_.new_values.data() + k * t.w, t.w), t.w);
          }
        }
      }
      stats->diff_s += SecondsSince(t0);
    }
    for (const std::unique_ptr<Group>& gp : groups) {
      Group& g = *gp;
      if (!g.holds.count(t.name)) continue;
      if (g.seed || resend) {
        DS_RETURN_IF_ERROR(
            Add(g, sync_id, stats, [&](FlushWriter& w) { return w.AddDense(range, xu); }));
        if (!g.seed) stats->sent_elements += count;
      } else if (changes_.count() > 0) {
        const Positions pos = Positions::Of(changes_, first);
        const uint64_t n = changes_.count();
        const uint64_t pw = t.numel >= (uint64_t{1} << 31) ? 8 : 4;
        StreamEncoding e = options_.encoding;
        if (e == StreamEncoding::kIndices && n * (pw + t.w) >= count * t.w) {
          e = StreamEncoding::kDense;
        }
        DS_RETURN_IF_ERROR(Add(g, sync_id, stats, [&](FlushWriter& w) -> Result<bool> {
          switch (e) {
            case StreamEncoding::kDense: return w.AddDense(range, xu);
            case StreamEncoding::kIndices: return w.AddIndices(range, pos, changes_.new_values);
            case StreamEncoding::kSparse: return w.AddSparse(range, pos, changes_.new_values);
          }
          return Status::Internal("unknown stream encoding");
        }));
        stats->sent_elements += e == StreamEncoding::kDense ? count : n;
      } else {
        continue;
      }
      g.named.insert(t.name);
    }
  }
  // The digest each held block must have at the end of the sync.
  t.expected.clear();
  for (const auto& [key, d] : delta) {
    if (have_snapshot_) {
      t.expected[key] = t.committed.at(key) + d;
    } else {
      DS_ASSIGN_OR_RETURN(StateDigest full,
                          stream::ComputeBlockPartDigest(x.data, t.w, 0, BlockOf(key)));
      t.expected[key] = full;
    }
  }
  return Status::OK();
}

Status Sender::SendRecords(Peer& peer, Group& g, uint64_t sync_id, bool verify_all,
                           const std::vector<std::pair<TensorState*, const SyncTensor*>>& order,
                           SyncStats* stats) {
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
    Status s = stream::SendMessage(*comm_, peer.rank, MessageType::kFrame, last, g.bucket);
    stats->transfer_s += SecondsSince(t1);
    stats->bytes_sent += stream::kEnvelopeBytes + g.bucket.size();
    if (!s.ok())
      return Status(s.code(), "receiver " + std::to_string(peer.rank) + ": " + s.message());
    return Status::OK();
  };
  DS_RETURN_IF_ERROR(begin());
  for (const auto& [t, x] : order) {
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

Result<SyncStats> Sender::Sync(std::span<const SyncTensor> tensors) {
  const auto start = Clock::now();
  std::vector<std::pair<TensorState*, const SyncTensor*>> order;
  if (options_.bucket_bytes < kMinBucketBytes ||
      options_.bucket_bytes > stream::kMaxFlushFrameBytes) {
    return Status::InvalidArgument("bucket_bytes " + std::to_string(options_.bucket_bytes) +
                                   ": at least 64 KiB and at most 2^40");
  }
  DS_RETURN_IF_ERROR(CheckTensors(tensors, &order));
  if (!comm_) DS_RETURN_IF_ERROR(Connect());
  const uint64_t sync_id = next_sync_id_++;
  const std::string sync_name = "sync " + std::to_string(sync_id);
  if (!welcomed_) {
    if (Status s = Handshake(sync_id); !s.ok()) {
      Drop();
      if (s.code() == StatusCode::kInvalidArgument) return s;
      return Status(s.code(), sync_name + ": the handshake failed: " + s.message());
    }
  }
  SyncStats stats;
  stats.sync_id = sync_id;
  stats.receivers = static_cast<uint32_t>(peers_.size());
  stats.verify_all = options_.verify_every > 0 && sync_id % options_.verify_every == 0;

  // Receivers of one kind and layout take the same frames.
  std::vector<std::unique_ptr<Group>> groups;
  std::vector<Group*> group_of(peers_.size());
  {
    std::map<std::pair<bool, std::string>, Group*> by_key;
    for (size_t i = 0; i < peers_.size(); ++i) {
      Peer& p = peers_[i];
      const bool seed = p.need_seed || !have_snapshot_;
      Group*& g = by_key[{seed, p.layout}];
      if (g == nullptr) {
        groups.push_back(std::make_unique<Group>());
        g = groups.back().get();
        g->seed = seed;
        g->writer.set_zstd_level(options_.zstd_level);
        for (const auto& [name, block] : p.blocks) g->holds.insert(name);
      }
      g->members.push_back(i);
      group_of[i] = g;
      stats.seeded += seed ? 1 : 0;
    }
  }

  // Everything is sent; then every receiver reports.
  Status streamed = Status::OK();
  for (const auto& [t, x] : order) {
    streamed = StreamTensor(*t, *x, sync_id, groups, &stats);
    if (!streamed.ok()) break;
  }
  for (const std::unique_ptr<Group>& g : groups) {
    if (streamed.ok() && g->open) streamed = Flush(*g, false, &stats);
  }
  for (size_t i = 0; i < peers_.size() && streamed.ok(); ++i) {
    streamed = SendRecords(peers_[i], *group_of[i], sync_id, stats.verify_all, order, &stats);
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
    for (const auto& [t, x] : order) {
      if (!have_snapshot_) {
        t->snapshot.assign(x->data.begin(), x->data.end());
      } else {
        for (uint64_t u = 0; u < t->units(); ++u) {
          if (!t->changed[u]) continue;
          const uint64_t first = u * t->unit;
          const uint64_t count = std::min(t->unit, t->numel - first);
          std::memcpy(t->snapshot.data() + first * t->w, x->data.data() + first * t->w,
                      count * t->w);
        }
      }
      std::fill(t->dirty.begin(), t->dirty.end(), 0);
      t->changed.clear();
      for (const auto& [key, d] : t->expected) t->committed[key] = d;
    }
    have_snapshot_ = true;
    for (Peer& p : peers_) p.need_seed = false;
    committed_id_ = sync_id;
    stats.commit_s = SecondsSince(t0);
    stats.total_s = SecondsSince(start);
    return stats;
  }

  // Nothing advances. What this sync changed is resent until one commits;
  // a receiver that failed while being seeded still needs its seed, and
  // one seeded now holds the sync's values, which the resend covers.
  for (const auto& [t, x] : order) {
    for (uint64_t u = 0; u < t->changed.size(); ++u) t->dirty[u] |= t->changed[u];
    t->changed.clear();
  }
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (group_of[i]->seed && !failed[i] && have_snapshot_ && comm_) peers_[i].need_seed = false;
  }
  const size_t receivers = peers_.size();
  std::string msg = sync_name + ": ";
  if (comm_) {
    msg +=
        std::to_string(failures.size()) + " of " + std::to_string(receivers) + " receivers failed";
  } else {
    msg +=
        "the stream group broke (it is formed again, and every receiver reseeded, at the "
        "next sync)";
  }
  for (const std::string& f : failures) msg += "; " + f;
  return Status(code, msg);
}

Result<std::span<const uint8_t>> Sender::Snapshot(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end() || !have_snapshot_) {
    return Status::NotFound("no committed state of tensor '" + std::string(name) + "'");
  }
  return std::span<const uint8_t>(it->second.snapshot);
}

}  // namespace

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

Result<std::unique_ptr<StreamSender>> StreamSender::Create(CommunicatorFactory connect,
                                                           SenderOptions options) {
  if (!connect) return Status::InvalidArgument("StreamSender: no communicator factory");
  if (options.bucket_bytes < kMinBucketBytes ||
      options.bucket_bytes > stream::kMaxFlushFrameBytes) {
    return Status::InvalidArgument("bucket_bytes " + std::to_string(options.bucket_bytes) +
                                   ": at least 64 KiB and at most 2^40");
  }
  return std::unique_ptr<StreamSender>(new Sender(std::move(connect), options));
}

}  // namespace deltasync
