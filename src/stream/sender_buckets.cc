// The stream's sender, its buckets (sender.h): a frame begun, filled with
// a tensor's units and flushed to its receivers (docs/format.md, "Stream:
// flush frame", "Fan-out"); shared by the whole-tensor and the sharded
// sender.
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

Status CheckOptions(const SenderOptions& options) {
  if (options.bucket_bytes < kMinBucketBytes ||
      options.bucket_bytes > stream::kMaxFlushFrameBytes) {
    return Status::InvalidArgument("bucket_bytes " + std::to_string(options.bucket_bytes) +
                                   ": at least 64 KiB and at most 2^40");
  }
  for (const auto& [name, send] : options.quantize) {
    if (name.empty()) return Status::InvalidArgument("SenderOptions::quantize: an empty name");
    Status ok = CheckQuantRecipe(send.recipe);
    if (!ok.ok()) return ok.WithContext("SenderOptions::quantize '" + name + "'");
    if (send.scale_name == name) {
      return Status::InvalidArgument("SenderOptions::quantize '" + name +
                                     "': the scales need a name of their own");
    }
  }
  return ThreadPool::CheckThreads(options.threads);
}

ThreadPool* Sender::Pool() {
  if (!pool_made_) {
    pool_made_ = true;
    pool_ = ThreadPool::ForThreads(options_.threads);
  }
  return pool_.get();
}

void Sender::CopyAll(std::span<const Copy> copies) {
  std::vector<Copy> pieces;
  for (const Copy& c : copies) {
    for (uint64_t at = 0; at < c.bytes; at += kParallelCopyBytes) {
      pieces.push_back({c.to + at, c.from + at, std::min(kParallelCopyBytes, c.bytes - at)});
    }
  }
  const auto copy = [&](size_t i) { std::memcpy(pieces[i].to, pieces[i].from, pieces[i].bytes); };
  if (ThreadPool* pool = Pool()) {
    pool->ParallelFor(pieces.size(), copy);
  } else {
    for (size_t i = 0; i < pieces.size(); ++i) copy(i);
  }
}

uint64_t Sender::FrameBudget(const Group& g) const {
  if (g.full_frames || g.frames >= 32) return options_.bucket_bytes;
  return std::min(options_.bucket_bytes, kFirstFrameBytes << g.frames);
}

Status Sender::Begin(Group& g, uint64_t sync_id, bool last, bool verify_all) {
  FlushHeader h;
  h.sync_id = sync_id;
  h.flush_index = g.frames;
  h.kind = g.seed ? FrameKind::kSeed : FrameKind::kDelta;
  h.last = last;
  h.verify_all = verify_all;
  // Reserved once, so that a frame never reallocates (and a small model
  // does not take a whole bucket).
  if (g.device) {
    DS_RETURN_IF_ERROR(g.device->Begin(h, frame_stream_));
    g.open = true;
    return Status::OK();
  }
  if (g.bucket.capacity() == 0) g.bucket.reserve(bucket_reserve_);
  g.writer.SetPool(Pool());
  DS_RETURN_IF_ERROR(g.writer.Begin(h, FrameBudget(g), &g.bucket));
  g.open = true;
  return Status::OK();
}

Status Sender::Flush(Group& g, SyncStats* stats) {
  const auto t0 = Clock::now();
  DS_RETURN_IF_ERROR(g.device ? g.device->Finish() : g.writer.Finish());
  stats->encode_s += SecondsSince(t0);
  g.open = false;
  ++g.frames;
  ++stats->frames;
  if (g.device) ++stats->device_frames;
  // Frames shared by the group go to its first member, which passes
  // them on; only its records frame is a receiver's own.
  const int head = peers_[g.members.front()].rank;
  if (!g.overlap) {
    const auto t1 = Clock::now();
    Status s = SendSharedFrame(*comm_, head,
                               g.device ? g.device->frame() : std::span<const uint8_t>(g.bucket),
                               &stats->bytes_sent);
    stats->transfer_s += SecondsSince(t1);
    return s;
  }
  DS_RETURN_IF_ERROR(Land(stats));
  const bool device = g.device != nullptr;
  if (device) {
    std::swap(g.device, flight_.device);
  } else {
    std::swap(g.bucket, flight_.frame);
  }
  flight_.thread = std::thread([this, head, device] {
    const auto t1 = Clock::now();
    flight_.status = SendSharedFrame(
        *comm_, head, device ? flight_.device->frame() : std::span<const uint8_t>(flight_.frame),
        &flight_.bytes);
    flight_.seconds = SecondsSince(t1);
  });
  return Status::OK();
}

Status Sender::Land(SyncStats* stats) {
  if (!flight_.thread.joinable()) return Status::OK();
  flight_.thread.join();
  if (stats != nullptr) {
    stats->transfer_s += flight_.seconds;
    stats->bytes_sent += flight_.bytes;
  }
  flight_.seconds = 0;
  flight_.bytes = 0;
  return std::exchange(flight_.status, Status::OK());
}

template <typename AddFn>
Status Sender::Add(Group& g, uint64_t sync_id, SyncStats* stats, AddFn&& add) {
  // A full frame is flushed, and a small first frame may give way to a
  // whole bucket: at most three tries.
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (!g.open) DS_RETURN_IF_ERROR(Begin(g, sync_id, false, false));
    const auto t0 = Clock::now();
    Result<bool> fit = add(g);
    stats->encode_s += SecondsSince(t0);
    if (!fit.ok()) return fit.status();
    if (*fit) return Status::OK();
    if ((g.device ? g.device->entry_count() : g.writer.entry_count()) == 0) {
      // A unit bigger than a first, small frame: this frame, and every
      // later one, takes a whole bucket.
      if (g.device || g.full_frames || FrameBudget(g) >= options_.bucket_bytes) break;
      g.full_frames = true;
      g.open = false;
      continue;
    }
    DS_RETURN_IF_ERROR(Flush(g, stats));
  }
  return Status::Internal("a unit of work does not fit an empty frame of " +
                          std::to_string(options_.bucket_bytes) + " bytes");
}

Status Sender::StreamTensor(TensorState& t, const UnitSource& src, Round* round) {
  TensorRound tr;
  BeginTensor(t, &tr);
  DS_RETURN_IF_ERROR(StreamUnits(t, src, round, &tr, 0, t.units()));
  EndTensor(t, tr);
  return Status::OK();
}

void Sender::BeginTensor(TensorState& t, TensorRound* tr) {
  // The blocks receivers hold of this tensor, and their digests' change
  // (or, with no committed digest to start from, the digests themselves).
  tr->delta.clear();
  tr->whole.clear();
  for (const Peer& p : peers_) {
    auto it = p.blocks.find(t.name);
    if (it == p.blocks.end()) continue;
    const BlockKey key = KeyOf(it->second);
    tr->delta.emplace(key, StateDigest{});
    if (!have_snapshot_ || !t.committed.count(key)) tr->whole.insert(key);
  }
  t.changed.assign(t.units(), 0);
  t.logged.clear();
}

void Sender::EndTensor(TensorState& t, const TensorRound& tr) {
  // The digest each held block must have at the end of the sync.
  t.expected.clear();
  for (const auto& [key, d] : tr.delta) {
    t.expected[key] = tr.whole.count(key) ? d : t.committed.at(key) + d;
  }
}

bool Sender::DenseIsCheaper(const TensorState& t, uint64_t count, uint64_t n) const {
  const uint64_t pw = stream::WrittenPositionWidth(t.numel);
  // The model measures the host's frame code: it decides for host frames
  // (a device tensor's changes come back to them); units framed on the
  // device keep the byte rule.
  if (options_.dense_by_time && cost_ && cost_->wire_byte > 0 &&
      (!t.device || !device_frames_now_)) {
    return stream::DenseIsFaster(*cost_, options_.encoding, count, n, t.w, pw);
  }
  // Until time is measured: by the bytes, where they are known ahead.
  return options_.encoding == StreamEncoding::kIndices && n * (pw + t.w) >= count * t.w;
}

void Sender::UpdateCostModel(const SyncStats& stats) {
  if (!options_.dense_by_time || options_.encoding == StreamEncoding::kDense || cost_failed_ ||
      cost_fixed_) {
    return;
  }
  if (stats.bytes_sent < kWireSampleBytes || stats.transfer_s <= 0) return;
  if (!cost_) {
    Result<stream::CostModel> m = stream::MeasureCostModel();
    if (!m.ok()) {
      cost_failed_ = true;
      return;
    }
    cost_ = *m;
  }
  const double wire = stats.transfer_s / static_cast<double>(stats.bytes_sent);
  cost_->wire_byte = cost_->wire_byte > 0 ? (cost_->wire_byte + wire) / 2 : wire;
}

StreamEncoding Sender::EncodingOf(const TensorState& t, const UnitSource& src, uint64_t first,
                                  uint64_t count, uint64_t n) const {
  // The encoding asked for, or dense when that is cheaper (and the values
  // can be had).
  StreamEncoding e = options_.encoding;
  if (e != StreamEncoding::kDense && DenseIsCheaper(t, count, n) &&
      (!src.can_dense || src.can_dense(first, count, n))) {
    e = StreamEncoding::kDense;
  }
  if (e == StreamEncoding::kDense && src.can_dense && !src.can_dense(first, count, n)) {
    e = StreamEncoding::kIndices;
  }
  return e;
}

Status Sender::AddWholeDigest(const TensorState& t, const UnitSource& src, const BlockKey& key,
                              uint64_t first, uint64_t count, const DenseView& dense,
                              StateDigest* d) {
  if (src.whole_digest && Covers(BlockOf(key), t.numel)) {
    DS_ASSIGN_OR_RETURN(StateDigest part, src.whole_digest(first, count, true));
    *d += part;
    return Status::OK();
  }
  DS_ASSIGN_OR_RETURN(std::span<const uint8_t> xu, dense());
  DS_ASSIGN_OR_RETURN(StateDigest part,
                      stream::ComputeBlockPartDigest(xu, t.w, first, BlockOf(key)));
  *d += part;
  return Status::OK();
}

Status Sender::EmitUnit(TensorState& t, const UnitSource& src, Round* round,
                        stream::DeviceSource* dev, const UnitOut& c, const DenseView& dense) {
  SyncStats* stats = &round->stats;
  TensorRange range{t.name, t.dtype, t.shape, c.first, c.count};
  for (const std::unique_ptr<Group>& gp : round->groups) {
    Group& g = *gp;
    if (!g.holds.count(t.name)) continue;
    // A seed or a resent unit goes whole (dense).
    const bool whole = g.seed || c.resend;
    if (!whole && c.n == 0) continue;
    const StreamEncoding e =
        whole ? StreamEncoding::kDense : EncodingOf(t, src, c.first, c.count, c.n);
    if (dev) {
      // BeginSync leaves sparse deltas, compressed on the host, to host
      // frames.
      DS_RETURN_IF_ERROR(Add(g, round->sync_id, stats, [&](Group& gr) -> Result<bool> {
        if (e == StreamEncoding::kDense) {
          return gr.device->AddDense(range, dev->current(c.first), dev->stream());
        }
        return gr.device->AddIndices(range, *c.device, dev->stream());
      }));
    } else {
      std::span<const uint8_t> xu;
      if (e == StreamEncoding::kDense) {
        DS_ASSIGN_OR_RETURN(xu, dense());
      }
      DS_RETURN_IF_ERROR(Add(g, round->sync_id, stats, [&](Group& gr) -> Result<bool> {
        FlushWriter& w = gr.writer;
        switch (e) {
          case StreamEncoding::kDense: return w.AddDense(range, xu);
          case StreamEncoding::kIndices: return w.AddIndices(range, c.pos, c.values);
          case StreamEncoding::kSparse:
            return c.sparse ? w.AddSparseRegions(range, *c.sparse)
                            : w.AddSparse(range, c.pos, c.values);
        }
        return Status::Internal("unknown stream encoding");
      }));
    }
    if (!g.seed) stats->sent_elements += e == StreamEncoding::kDense ? c.count : c.n;
    g.named.insert(t.name);
  }
  return Status::OK();
}

Status Sender::StreamUnits(TensorState& t, const UnitSource& src, Round* round, TensorRound* tr,
                           uint64_t u_begin, uint64_t u_end) {
  SyncStats* stats = &round->stats;
  std::map<BlockKey, StateDigest>& delta = tr->delta;
  // Frames on the device: the changes stay there, and entries are copied
  // into the device buckets from the diff's outputs and the tensor.
  stream::DeviceSource* dev = round->device_frames ? t.device.get() : nullptr;
  device_frames_now_ = round->device_frames;
  if (dev) frame_stream_ = dev->stream();
  if (src.host && have_snapshot_ && t.unit <= UINT32_MAX) {
    return StreamHostUnits(t, src, round, tr, u_begin, u_end);
  }
  for (uint64_t u = u_begin; u < u_end; ++u) {
    UnitOut c;
    c.first = u * t.unit;
    c.count = std::min(t.unit, t.numel - c.first);
    const uint64_t first = c.first, count = c.count;
    std::optional<std::span<const uint8_t>> dense_view;
    const DenseView dense = DenseOnce(src, first, count, &dense_view);
    changes_.Clear();
    UnitChanges in_place;
    stream::DeviceUnitChanges device_changes;
    const auto t0 = Clock::now();
    if (have_snapshot_) {
      if (dev) {
        DS_ASSIGN_OR_RETURN(device_changes, dev->DeviceChanges(first, count));
        c.n = device_changes.count;
        c.device = &device_changes;
      } else if (src.view) {
        DS_RETURN_IF_ERROR(src.view(first, count, &in_place));
      } else {
        DS_RETURN_IF_ERROR(src.changes(first, count, &changes_));
        in_place.pos = Positions::Of(changes_, first);
        in_place.new_values = changes_.new_values;
        in_place.old_values = changes_.old_values;
      }
      if (!dev) {
        c.n = in_place.pos.size();
        c.pos = in_place.pos;
        c.values = in_place.new_values;
      }
      stats->changed += c.n;
      c.resend = t.dirty[u] != 0;
      if (c.resend || c.n > 0) t.changed[u] = 1;
      // A block's digest moves by what its changed elements move it (a
      // resent unit's other elements hold what the snapshot holds).
      for (auto& [key, d] : delta) {
        const DigestBlock b = BlockOf(key);
        if (tr->whole.count(key)) {
          DS_RETURN_IF_ERROR(AddWholeDigest(t, src, key, first, count, dense, &d));
        } else if (src.whole_digest && Covers(b, t.numel)) {
          DS_ASSIGN_OR_RETURN(StateDigest part, src.whole_digest(first, count, false));
          d += part;
        } else if (c.n == 0) {
          continue;
        } else if (dev) {
          DS_ASSIGN_OR_RETURN(StateDigest part, dev->BlockDigestChange(device_changes, b));
          d += part;
        } else if (Covers(b, t.numel) && in_place.digest_change) {
          d += *in_place.digest_change;
        } else if (Covers(b, t.numel)) {
          DS_RETURN_IF_ERROR(
              stream::UpdateStateDigest(&d, c.pos, in_place.old_values, in_place.new_values, t.w));
        } else {
          for (uint64_t k = 0; k < c.n; ++k) {
            const uint64_t p = c.pos[k];
            if (!InBlock(b, p)) continue;
            d += stream::ElementChangeDigest(
                p, LoadLeWidth(in_place.old_values.data() + k * t.w, t.w),
                LoadLeWidth(in_place.new_values.data() + k * t.w, t.w), t.w);
          }
        }
      }
    } else {
      t.changed[u] = 1;
      for (auto& [key, d] : delta) {
        DS_RETURN_IF_ERROR(AddWholeDigest(t, src, key, first, count, dense, &d));
      }
    }
    stats->diff_s += SecondsSince(t0);
    DS_RETURN_IF_ERROR(EmitUnit(t, src, round, dev, c, dense));
  }
  return Status::OK();
}
}  // namespace stream_sender

}  // namespace deltasync
