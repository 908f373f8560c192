// The sharded sender (docs/format.md, "Stream: sharded sync"): every trainer
// rank keeps the committed snapshot of its own shards only; the changes,
// and for a seed the current values, cross rank 0 one batch at a time.
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator_internal.h"
#include "deltasync/stream.h"
#include "deltasync/tensor.h"
#include "deltasync/timing.h"
#include "shard/shard_gather.h"
#include "stream/sender.h"

namespace deltasync::stream_sender {

namespace {

using stream::Segment;
using stream::TensorChanges;

// The plan byte rank 0 broadcasts at the start of a sync.
constexpr uint8_t kPlanOff = 0;
constexpr uint8_t kPlanDelta = 1;
constexpr uint8_t kPlanDense = 2;
// With the plan: the layout rank 0 holds is accepted (else every rank
// exchanges it again at the next sync).
constexpr uint8_t kPlanLayoutAccepted = 0x80;

// Elements of a tensor's unit on rank 0 (TensorState::unit): every rank
// computes the batches from it alike.
uint64_t UnitOf(uint64_t bucket_bytes, uint32_t w) {
  return std::max<uint64_t>(1, (bucket_bytes - kFrameReserve) / (2 * (8 + w)));
}

// The batches of a sharded sync: the model's tensors in name order, each cut
// into unit-aligned segments so that a batch's dense bytes stay within
// `budget` (a tensor of no elements is a segment of none, so that its
// blocks' digests are recorded too).
std::vector<std::vector<Segment>> Batches(std::span<const ModelTensor> model, uint64_t bucket_bytes,
                                          uint64_t budget) {
  std::vector<const ModelTensor*> sorted;
  for (const ModelTensor& m : model) sorted.push_back(&m);
  std::sort(sorted.begin(), sorted.end(),
            [](const ModelTensor* a, const ModelTensor* b) { return a->name < b->name; });
  std::vector<std::vector<Segment>> out(1);
  uint64_t bytes = 0;
  for (const ModelTensor* m : sorted) {
    Result<int64_t> n = ShapeNumel(m->shape);
    const uint64_t numel = n.ok() ? static_cast<uint64_t>(*n) : 0;
    const uint32_t w = static_cast<uint32_t>(DTypeSize(m->dtype));
    const uint64_t unit = UnitOf(bucket_bytes, w);
    uint64_t at = 0;
    do {
      uint64_t room = budget > bytes ? (budget - bytes) / w : 0;
      if (room < std::min(unit, numel - at) && !out.back().empty()) {
        out.emplace_back();
        bytes = 0;
        room = budget / w;
      }
      // The rest of the tensor where it fits (a tensor is named once per
      // batch), otherwise whole units, at least one.
      uint64_t take = numel - at;
      if (take > room) take = std::min(take, std::max<uint64_t>(1, room / unit) * unit);
      out.back().push_back({m->name, at, take, w});
      bytes += take * w;
      at += take;
    } while (at < numel);
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

// The list the changes gather of a batch names: its segments' tensors.
std::vector<stream::GatherTensor> GatherList(std::span<const Segment> segments,
                                             std::span<const ModelTensor> model) {
  std::map<std::string_view, const ModelTensor*> by_name;
  for (const ModelTensor& m : model) by_name[m.name] = &m;
  std::vector<stream::GatherTensor> list;
  for (const Segment& s : segments) {
    const ModelTensor* m = by_name.at(s.name);
    list.push_back({m->name, m->dtype, m->shape});
  }
  return list;
}

// The slice of `cs` (sorted positions) in [first, first + count): [*lo, *hi).
void SliceOf(const ChangeSet& cs, uint64_t first, uint64_t count, uint64_t* lo, uint64_t* hi) {
  const auto lower = [&](uint64_t bound, uint64_t from) {
    uint64_t a = from, z = cs.count();
    while (a < z) {
      const uint64_t mid = (a + z) / 2;
      if (cs.position(mid) < bound) {
        a = mid + 1;
      } else {
        z = mid;
      }
    }
    return a;
  };
  *lo = lower(first, 0);
  *hi = lower(first + count, *lo);
}

// Changes [lo, hi) of `cs`'s (absolute) positions, in place.
Positions PositionsOf(const ChangeSet& cs, uint64_t lo, uint64_t hi) {
  if (cs.wide) return Positions{{}, std::span(cs.pos64).subspan(lo, hi - lo), 0};
  return Positions{std::span(cs.pos32).subspan(lo, hi - lo), {}, 0};
}

}  // namespace

Status Sender::ConnectTrainers() {
  if (trainers_) return Status::OK();
  Result<std::unique_ptr<Communicator>> c = Status::OK();
  {
    stream_internal::FormationCancel cancel(&cancel_requested_);
    c = trainer_connect_();
  }
  if (!c.ok()) {
    return Status(c.status().code(), "forming the trainer group: " + c.status().message());
  }
  if ((*c)->rank() == 0 && !connect_) {
    return Status::InvalidArgument("trainer rank 0 needs the stream group's factory");
  }
  // A new formation exchanges its layout again, and counts its syncs
  // afresh (the batch ids).
  layout_ready_ = false;
  local_syncs_ = 0;
  return Keep(&trainers_, std::move(*c));
}

void Sender::LoseTrainers() {
  (void)Keep(&trainers_, nullptr);
  // The other ranks may not have had the decision: no rank's snapshot can
  // be trusted to match the others', so every rank starts again from a
  // seed (rank 0 reseeds every receiver).
  have_local_ = false;
  layout_ready_ = false;
  for (LocalShard& l : local_) {
    l.snapshot.clear();
    l.snapshot.shrink_to_fit();
    std::fill(l.dirty.begin(), l.dirty.end(), 0);
  }
  if (sharded_ && connect_) {
    Drop();
    ForgetSnapshot();
  }
}

Status Sender::CheckShards(std::span<const ModelTensor> model,
                           std::span<const ShardedTensor> shards) {
  std::map<std::string_view, const ModelTensor*> by_name;
  for (const ModelTensor& m : model) by_name[m.name] = &m;
  if (!local_.empty() && local_.size() != shards.size()) {
    return Status::InvalidArgument("this rank passed " + std::to_string(shards.size()) +
                                   " shards; its first sync passed " +
                                   std::to_string(local_.size()));
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardedTensor& sh = shards[i];
    DS_RETURN_IF_ERROR(sh.spec.Validate());
    const std::string what =
        "shard " + std::to_string(i) + " (of '" +
        (sh.spec.pieces.empty() ? std::string("?") : sh.spec.pieces[0].hf_name) + "')";
    const uint64_t w = DTypeSize(sh.spec.dtype);
    const uint64_t numel = static_cast<uint64_t>(sh.spec.local_numel());
    if (sh.data.size() != numel * w) {
      return Status::InvalidArgument(what + ": " + std::to_string(sh.data.size()) +
                                     " bytes, its spec needs " + std::to_string(numel * w));
    }
    for (const ShardPiece& p : sh.spec.pieces) {
      auto it = by_name.find(p.hf_name);
      if (it == by_name.end()) {
        return Status::InvalidArgument(what + ": tensor '" + p.hf_name + "' is not in the model");
      }
      if (it->second->dtype != sh.spec.dtype || it->second->shape != p.hf_shape) {
        return Status::InvalidArgument(what + ": tensor '" + p.hf_name + "' is " +
                                       std::string(DTypeName(it->second->dtype)) + " " +
                                       ShapeToString(it->second->shape) + " in the model, " +
                                       std::string(DTypeName(sh.spec.dtype)) + " " +
                                       ShapeToString(p.hf_shape) + " in the shard");
      }
    }
    if (!local_.empty() && local_[i].place.cuda_device != sh.place.cuda_device) {
      const auto where = [](const Placement& p) {
        return p.on_device() ? "on CUDA device " + std::to_string(p.cuda_device)
                             : std::string("in host memory");
      };
      return Status::InvalidArgument(what + ": " + where(sh.place) + ", the first sync had it " +
                                     where(local_[i].place));
    }
    if (!local_.empty()) {
      const ShardSpec& was = local_[i].spec;
      if (was.dtype != sh.spec.dtype || was.local_shape != sh.spec.local_shape ||
          was.contributes != sh.spec.contributes ||
          stream::EncodeLayout(std::span(&was, 1)) !=
              stream::EncodeLayout(std::span(&sh.spec, 1))) {
        return Status::InvalidArgument(what + ": another placement than in the first sync");
      }
    }
  }
  if (local_.empty()) {
    // Built aside, so that a refused first sync leaves none behind.
    std::vector<LocalShard> fresh;
    for (const ShardedTensor& sh : shards) {
      LocalShard l;
      l.spec = sh.spec;
      l.w = static_cast<uint32_t>(DTypeSize(sh.spec.dtype));
      l.numel = static_cast<uint64_t>(sh.spec.local_numel());
      l.place = sh.place;
      for (const ShardPiece& p : sh.spec.pieces) {
        l.contributes = l.contributes || (sh.spec.contributes && p.contributes);
      }
      const uint64_t units = (l.numel + kLocalUnit - 1) / kLocalUnit;
      l.dirty.assign(units, 0);
      l.changed.assign(units, 0);
      if (sh.place.on_device() && l.contributes) {
        const std::string what =
            "shard " + std::to_string(fresh.size()) + " (of '" + sh.spec.pieces[0].hf_name + "')";
        DS_ASSIGN_OR_RETURN(stream::DeviceContext * ctx, DeviceFor(sh.place.cuda_device, what));
        const uint64_t chunk =
            kLocalUnit * std::max<uint64_t>(1, kDeviceChunkElements / kLocalUnit);
        DS_ASSIGN_OR_RETURN(
            l.device, stream::DeviceSource::Create(*ctx, what, sh.spec.dtype, l.numel, kLocalUnit,
                                                   chunk, options_.pinned_snapshot));
      }
      fresh.push_back(std::move(l));
    }
    std::vector<ShardSpec> specs;
    for (const LocalShard& l : fresh) specs.push_back(l.spec);
    my_pieces_ = stream::ContributingPieces(specs);
    local_ = std::move(fresh);
  }
  // A device shard's memory must be where its placement says, every sync.
  last_diffed_ = nullptr;
  read_cache_shard_ = SIZE_MAX;
  for (size_t i = 0; i < shards.size(); ++i) {
    if (local_[i].device)
      DS_RETURN_IF_ERROR(local_[i].device->Begin(shards[i].data, shards[i].place));
  }
  return device_broken_;
}

Status Sender::ExchangeShardLayout(std::span<const ModelTensor> model,
                                   std::span<const ShardedTensor> shards, const Status& local) {
  std::vector<ShardSpec> specs;
  for (const ShardedTensor& sh : shards) specs.push_back(sh.spec);
  Result<std::vector<std::vector<ShardSpec>>> all =
      stream::ExchangeLayout(*trainers_, specs, local);
  if (!trainers_->health().ok()) return all.status();
  if (trainers_->rank() != 0) return all.ok() ? Status::OK() : all.status();
  if (!all.ok()) return all.status();
  std::vector<stream::LayoutTensor> tensors;
  for (const ModelTensor& m : model) tensors.push_back({m.name, m.dtype, m.shape});
  DS_RETURN_IF_ERROR(stream::CheckLayout(tensors, *all));
  layouts_ = std::move(*all);
  pieces_.clear();
  for (const std::vector<ShardSpec>& l : layouts_) pieces_.push_back(stream::ContributingPieces(l));
  layout_ready_ = true;
  return Status::OK();
}

Status Sender::DiffSegments(std::span<const ShardedTensor> shards,
                            std::span<const Segment> segments, std::vector<TensorChanges>* out,
                            uint64_t* changed) {
  out->clear();
  if (!have_local_) return Status::OK();  // before the first commit: a seed
  const stream::PiecesByTensor& pieces = my_pieces_;
  DiffOptions o;
  o.refresh_snapshot = false;
  o.keep_old_values = true;
  o.pool = Pool();
  o.parallel_chunk_bytes = kParallelDiffBytes;
  ChangeSet part;
  for (const Segment& seg : segments) {
    auto it = pieces.find(seg.name);
    if (it == pieces.end()) continue;
    // This rank's runs of the segment, in HF order (several pieces of one
    // tensor may interleave).
    struct Run {
      stream::PieceRun run;
      size_t shard;
    };
    std::vector<Run> runs;
    uint64_t numel = 0;
    for (const auto& ij : it->second) {
      const size_t i = ij.first;  // captured below: not a structured binding (clang 14)
      const ShardPiece& p = local_[i].spec.pieces[ij.second];
      if (numel == 0) {
        numel = 1;
        for (int64_t d : p.hf_shape) numel *= static_cast<uint64_t>(d);
      }
      stream::ForEachPieceRun(p, local_[i].spec.local_shape, seg.first, seg.count,
                              [&](const stream::PieceRun& r) {
                                runs.push_back({r, i});
                              });
    }
    std::sort(runs.begin(), runs.end(),
              [](const Run& a, const Run& b) { return a.run.hf < b.run.hf; });
    TensorChanges tc;
    tc.name = seg.name;
    ChangeSet& cs = tc.changes;
    cs.numel = numel;
    cs.elem_size = seg.w;
    cs.wide = numel >= (uint64_t{1} << 32);
    const uint32_t w = seg.w;
    const auto append = [&](uint64_t hf, const uint8_t* now, const uint8_t* old) {
      if (cs.wide) {
        cs.pos64.push_back(hf);
      } else {
        cs.pos32.push_back(static_cast<uint32_t>(hf));
      }
      cs.new_values.insert(cs.new_values.end(), now, now + w);
      cs.old_values.insert(cs.old_values.end(), old, old + w);
    };
    for (const Run& r : runs) {
      LocalShard& l = local_[r.shard];
      if (l.device) {
        DS_RETURN_IF_ERROR(DiffDeviceRun(l, r.run, append, changed));
        continue;
      }
      const uint8_t* data = shards[r.shard].data.data();
      // Unit by unit: a dirty unit resends every element of the run in it.
      uint64_t at = r.run.local;
      const uint64_t end = r.run.local + r.run.count;
      while (at < end) {
        const uint64_t u = at / kLocalUnit;
        const uint64_t stop = std::min(end, (u + 1) * kLocalUnit);
        const uint64_t hf0 = r.run.hf + (at - r.run.local);
        if (l.dirty[u]) {
          for (uint64_t k = at; k < stop; ++k) {
            append(hf0 + (k - at), data + k * w, l.snapshot.data() + k * w);
          }
          l.changed[u] = 1;
          *changed += stop - at;
        } else {
          o.elem_size = w;
          std::span<uint8_t> snap(l.snapshot.data() + at * w, (stop - at) * w);
          DS_RETURN_IF_ERROR(DiffTensor(std::span(data + at * w, (stop - at) * w), snap, o, &part));
          for (uint64_t k = 0; k < part.count(); ++k) {
            append(hf0 + part.position(k), part.new_values.data() + k * w,
                   part.old_values.data() + k * w);
          }
          if (part.count() > 0) l.changed[u] = 1;
          *changed += part.count();
        }
        at = stop;
      }
    }
    if (cs.count() > 0) out->push_back(std::move(tc));
  }
  return Status::OK();
}

Status Sender::DiffDeviceRun(
    LocalShard& l, const stream::PieceRun& run,
    const std::function<void(uint64_t, const uint8_t*, const uint8_t*)>& append,
    uint64_t* changed) {
  // The device sources of one device share its scratch: the one diffed
  // last forgets its diffed chunk when another takes the scratch.
  if (last_diffed_ != nullptr && last_diffed_ != l.device.get()) last_diffed_->Rollback();
  last_diffed_ = l.device.get();
  const uint32_t w = l.w;
  uint64_t at = run.local;
  const uint64_t end = run.local + run.count;
  while (at < end) {
    const uint64_t u = at / kLocalUnit;
    const uint64_t stop = std::min(end, (u + 1) * kLocalUnit);
    const uint64_t hf0 = run.hf + (at - run.local);
    if (l.dirty[u]) {
      // A failed sync's unit: every element of the run in it, as it is now
      // and as committed.
      DS_ASSIGN_OR_RETURN(std::span<const uint8_t> now, l.device->Dense(at, stop - at));
      dense_scratch_.assign(now.begin(), now.end());
      DS_ASSIGN_OR_RETURN(std::span<const uint8_t> old, l.device->Committed(at, stop - at));
      for (uint64_t k = 0; k < stop - at; ++k) {
        append(hf0 + k, dense_scratch_.data() + k * w, old.data() + k * w);
      }
      l.changed[u] = 1;
      *changed += stop - at;
    } else {
      // The unit's changes, diffed on the device (a chunk of units at a
      // time), of which the run keeps its own.
      const uint64_t first = u * kLocalUnit;
      DS_RETURN_IF_ERROR(
          l.device->Changes(first, std::min(kLocalUnit, l.numel - first), &device_part_));
      uint64_t n = 0;
      for (uint64_t k = 0; k < device_part_.count(); ++k) {
        const uint64_t p = first + device_part_.position(k);
        if (p < at || p >= stop) continue;
        append(hf0 + (p - at), device_part_.new_values.data() + k * w,
               device_part_.old_values.data() + k * w);
        ++n;
      }
      if (n > 0) l.changed[u] = 1;
      *changed += n;
    }
    at = stop;
  }
  return Status::OK();
}

// A batch of a delta is a few MiB of changes: left to fill a 16 MiB frame,
// the last frames of a sync would wait for the last gathers and then go
// out one after another, after all of them.
constexpr uint64_t kBatchFrameBytes = uint64_t{1} << 20;

Status Sender::SendBatchFrames(Round* round) {
  for (const std::unique_ptr<Group>& g : round->groups) {
    if (!g->open || g->device || !g->overlap) continue;
    if (g->writer.frame_bytes() < kBatchFrameBytes) continue;
    DS_RETURN_IF_ERROR(Flush(*g, &round->stats));
  }
  return Status::OK();
}

Status Sender::StreamSegments(std::span<const Segment> segments, std::span<TensorChanges> changes,
                              std::span<const std::span<uint8_t>> dense, Round* round,
                              std::map<std::string, TensorRound, std::less<>>* rounds) {
  for (size_t s = 0; s < segments.size(); ++s) {
    const Segment& seg = segments[s];
    TensorState& t = tensors_.find(seg.name)->second;
    TensorRound& tr = (*rounds)[seg.name];
    if (seg.first == 0) BeginTensor(t, &tr);
    const ChangeSet& cs = changes[s].changes;
    const bool have_dense = !dense.empty();
    const uint64_t u_begin = seg.first / t.unit;
    const uint64_t u_end = (seg.first + seg.count + t.unit - 1) / t.unit;
    // Each unit's slice of the changes and, on the sender's threads, what
    // it moves the tensor's digest by (rank 0's serial pass over the
    // gathered changes would otherwise bound the sync).
    std::vector<std::pair<uint64_t, uint64_t>> slices(u_end - u_begin);
    std::vector<StateDigest> moved(u_end - u_begin);
    std::vector<Status> failed(u_end - u_begin);
    const bool digests = have_snapshot_ && !tr.delta.empty();
    const auto slice = [&](size_t i) {
      const uint64_t first = (u_begin + i) * t.unit;
      const uint64_t count = std::min(t.unit, t.numel - first);
      SliceOf(cs, first, count, &slices[i].first, &slices[i].second);
      if (!digests) return;
      const auto [lo, hi] = slices[i];
      failed[i] = stream::UpdateStateDigest(
          &moved[i], PositionsOf(cs, lo, hi),
          std::span(cs.old_values).subspan(lo * t.w, (hi - lo) * t.w),
          std::span(cs.new_values).subspan(lo * t.w, (hi - lo) * t.w), t.w);
    };
    if (ThreadPool* pool = Pool(); pool != nullptr && slices.size() > 1) {
      pool->ParallelFor(slices.size(), slice);
    } else {
      for (size_t i = 0; i < slices.size(); ++i) slice(i);
    }
    for (const Status& f : failed) DS_RETURN_IF_ERROR(f);
    UnitSource src;
    src.view = [&](uint64_t first, uint64_t, UnitChanges* out) -> Status {
      const uint64_t i = first / t.unit - u_begin;
      const auto [lo, hi] = slices[i];
      out->pos = PositionsOf(cs, lo, hi);
      out->new_values = std::span(cs.new_values).subspan(lo * t.w, (hi - lo) * t.w);
      out->old_values = std::span(cs.old_values).subspan(lo * t.w, (hi - lo) * t.w);
      if (digests) out->digest_change = moved[i];
      return Status::OK();
    };
    src.can_dense = [&](uint64_t, uint64_t count, uint64_t n) { return have_dense || n == count; };
    src.dense = [&](uint64_t first, uint64_t count) -> Result<std::span<const uint8_t>> {
      if (have_dense) {
        return std::span<const uint8_t>(dense[s].data() + (first - seg.first) * t.w, count * t.w);
      }
      // Every element changed: the new values are the unit's, in order.
      uint64_t lo = 0, hi = 0;
      SliceOf(cs, first, count, &lo, &hi);
      if (hi - lo != count) {
        return Status::Internal("tensor '" + t.name + "': a unit's dense values are not at hand");
      }
      return std::span<const uint8_t>(cs.new_values.data() + lo * t.w, count * t.w);
    };
    DS_RETURN_IF_ERROR(StreamUnits(t, src, round, &tr, u_begin, u_end));
    if (seg.first + seg.count == t.numel) {
      EndTensor(t, tr);
      rounds->erase(seg.name);
    }
  }
  return Status::OK();
}

Status Sender::ReadDevice(size_t i, uint64_t first, uint64_t count, uint8_t* out) {
  const LocalShard& l = local_[i];
  uint64_t done = 0;
  while (done < count) {
    const uint64_t at = first + done;
    if (read_cache_shard_ != i || at < read_cache_first_ ||
        at >= read_cache_first_ + read_cache_.size() / l.w) {
      // The unit around `at`, in one copy: a column shard's short runs
      // would otherwise each cost a copy and a wait.
      read_cache_shard_ = SIZE_MAX;
      const uint64_t unit_first = at / kLocalUnit * kLocalUnit;
      DS_ASSIGN_OR_RETURN(std::span<const uint8_t> v,
                          l.device->Dense(unit_first, std::min(kLocalUnit, l.numel - unit_first)));
      read_cache_.assign(v.begin(), v.end());
      read_cache_first_ = unit_first;
      read_cache_shard_ = i;
    }
    const uint64_t n = std::min(count - done, read_cache_first_ + read_cache_.size() / l.w - at);
    std::memcpy(out + done * l.w, read_cache_.data() + (at - read_cache_first_) * l.w, n * l.w);
    done += n;
  }
  return Status::OK();
}

void Sender::SettleShards(std::span<const ShardedTensor> shards, bool commit) {
  std::vector<Copy> copies;  // host shards' changed units, on the sender's threads
  for (size_t i = 0; i < local_.size(); ++i) {
    LocalShard& l = local_[i];
    if (commit) {
      if (l.device) {
        // One device copy of the whole shard: cheaper than logging the
        // diff's writes to undo them. A copy that fails leaves no snapshot
        // to diff against: every later sync fails, naming it.
        if (Status s = l.device->Commit(); !s.ok() && device_broken_.ok()) {
          device_broken_ = Status(s.code(),
                                  "a shard's snapshot could not be committed, so this "
                                  "sender cannot sync again: " +
                                      s.message());
        }
      } else if (!have_local_) {
        // The first commit: the whole of what this rank sends.
        if (l.contributes) {
          l.snapshot.resize(shards[i].data.size());
          copies.push_back({l.snapshot.data(), shards[i].data.data(), shards[i].data.size()});
        }
      } else if (l.contributes) {
        for (uint64_t u = 0; u < l.changed.size(); ++u) {
          if (!l.changed[u]) continue;
          const uint64_t first = u * kLocalUnit;
          const uint64_t count = std::min(kLocalUnit, l.numel - first);
          copies.push_back(
              {l.snapshot.data() + first * l.w, shards[i].data.data() + first * l.w, count * l.w});
        }
      }
      std::fill(l.dirty.begin(), l.dirty.end(), 0);
    } else {
      if (l.device) l.device->Rollback();
      for (uint64_t u = 0; u < l.changed.size(); ++u) l.dirty[u] |= l.changed[u];
    }
    std::fill(l.changed.begin(), l.changed.end(), 0);
  }
  CopyAll(copies);
  if (commit) have_local_ = true;
}

Result<SyncStats> Sender::SyncShardsAlone(std::span<const ModelTensor> model,
                                          std::span<const ShardedTensor> shards) {
  if (!sharded_) return Status::FailedPrecondition("this sender syncs whole tensors with Sync");
  const Clock::time_point start = Clock::now();
  DS_RETURN_IF_ERROR(ConnectTrainers());
  const bool root = trainers_->rank() == 0;
  ++local_syncs_;
  // A rank that cannot take part still does, sending nothing, so that the
  // others are not left waiting; rank 0 then fails the sync.
  Status local = CheckShards(model, shards);
  const auto lost = [&](const Status& s, const char* during) -> Result<SyncStats> {
    LoseTrainers();
    return Status(s.code(), std::string("sharded sync: ") + during + ": " + s.message());
  };
  Status layout = Status::OK();
  const bool exchange = !layout_ready_;
  if (exchange) {
    layout = ExchangeShardLayout(model, shards, local);
    if (!trainers_->health().ok()) return lost(layout, "exchanging the layout");
  }

  // Rank 0 begins the sync with the receivers, and tells the plan.
  std::vector<TensorState*> order;
  Round round;
  Status begun = Status::OK();
  uint8_t plan = kPlanOff;
  if (root) {
    std::vector<TensorMeta> metas;
    for (const ModelTensor& m : model) metas.push_back({m.name, m.dtype, &m.shape, {}, {}});
    begun = local;
    if (begun.ok()) begun = layout;
    if (begun.ok()) begun = CheckModel(metas, &order);
    if (begun.ok()) begun = BeginSync(&round, start);
    if (begun.ok()) {
      bool seeds = false;
      for (const std::unique_ptr<Group>& g : round.groups) seeds = seeds || g->seed;
      plan = seeds ? kPlanDense : kPlanDelta;
    }
    if (layout_ready_) plan |= kPlanLayoutAccepted;
  }
  if (Status s = trainers_->Broadcast(0, std::span(&plan, 1)); !s.ok()) {
    return lost(s, "telling the plan");
  }
  layout_ready_ = (plan & kPlanLayoutAccepted) != 0;
  const uint8_t kind = plan & 0x3;
  SyncStats stats;
  if (root) stats = round.stats;
  Status streamed = Status::OK();
  if (kind != kPlanOff) {
    const uint64_t budget = 4 * options_.bucket_bytes;
    const std::vector<std::vector<Segment>> batches = Batches(model, options_.bucket_bytes, budget);
    std::map<std::string, TensorRound, std::less<>> rounds;
    std::vector<uint8_t> message;
    std::vector<uint8_t> dense_buffer;
    std::vector<std::span<uint8_t>> dense_spans;
    uint64_t changed = 0;
    for (size_t b = 0; b < batches.size(); ++b) {
      const std::vector<Segment>& segs = batches[b];
      const uint64_t batch_id = (local_syncs_ << 21) + 2 * b;
      const auto t0 = Clock::now();
      std::vector<TensorChanges> mine;
      Status diffed = local.ok() ? DiffSegments(shards, segs, &mine, &changed) : local;
      const std::vector<stream::GatherTensor> list = GatherList(segs, model);
      Result<std::vector<TensorChanges>> all =
          stream::GatherChanges(*trainers_, batch_id, list, mine, diffed, Pool());
      stats.diff_s += SecondsSince(t0);
      if (!trainers_->health().ok()) return lost(all.status(), "gathering the changes");
      if (!all.ok() && streamed.ok()) streamed = all.status();
      // The dense gather of a seed: every rank's current values of its
      // contributing pieces in the batch.
      dense_spans.clear();
      if (kind == kPlanDense) {
        const auto t1 = Clock::now();
        std::vector<ShardSpec> specs;
        for (const LocalShard& l : local_) specs.push_back(l.spec);
        const stream::LocalReader read = [&](size_t i, uint64_t first, uint64_t count,
                                             uint8_t* out) -> Status {
          const uint64_t bytes = count * local_[i].w;
          if (!local_[i].device) {
            std::memcpy(out, shards[i].data.data() + first * local_[i].w, bytes);
            return Status::OK();
          }
          return ReadDevice(i, first, count, out);
        };
        if (!root) {
          Status packed = local;
          if (packed.ok()) packed = PackDense(specs, my_pieces_, read, segs, &message);
          if (!packed.ok()) {
            // Zeros of the message's size: rank 0 fails the sync.
            message.assign(stream::DenseBytes(specs, my_pieces_, segs), 0);
            if (local.ok()) local = packed;
          }
          if (!message.empty()) {
            if (Status s = trainers_->Send(0, message); !s.ok()) {
              return lost(s, "sending dense values");
            }
          }
        } else {
          // One buffer for the batch, its segments side by side: its
          // capacity stays one batch whatever the batches' cuts.
          uint64_t total = 0;
          for (const Segment& seg : segs) total += seg.count * seg.w;
          dense_buffer.assign(total, 0);
          uint64_t at = 0;
          for (const Segment& seg : segs) {
            dense_spans.push_back(std::span<uint8_t>(dense_buffer).subspan(at, seg.count * seg.w));
            at += seg.count * seg.w;
          }
          for (int r = 0; r < trainers_->size(); ++r) {
            const std::vector<ShardSpec>& rs = layouts_[r];
            if (r == 0) {
              if (Status s = PackDense(rs, pieces_[0], read, segs, &message); !s.ok()) {
                if (streamed.ok()) streamed = s;
              }
            } else {
              message.resize(stream::DenseBytes(rs, pieces_[r], segs));
              if (!message.empty()) {
                if (Status s = trainers_->Recv(r, message); !s.ok()) {
                  return lost(s, "taking dense values");
                }
              }
            }
            UnpackDense(rs, pieces_[r], message, segs, dense_spans);
          }
        }
        stats.diff_s += SecondsSince(t1);
      }
      if (!root || !streamed.ok() || !round.streamed.ok()) continue;
      // Rank 0: the batch's segments, with their changes in segment order.
      std::vector<TensorChanges> by_segment(segs.size());
      for (size_t s = 0; s < segs.size(); ++s) {
        by_segment[s] = std::move((*all)[s]);
        if (by_segment[s].changes.numel == 0) {
          // No rank changed it: an empty list of the tensor's size.
          const TensorState& t = tensors_.find(segs[s].name)->second;
          by_segment[s].changes.numel = t.numel;
          by_segment[s].changes.elem_size = t.w;
          by_segment[s].changes.wide = t.numel >= (uint64_t{1} << 32);
        }
      }
      round.streamed = StreamSegments(segs, by_segment, dense_spans, &round, &rounds);
      if (round.streamed.ok() && b + 1 < batches.size()) round.streamed = SendBatchFrames(&round);
    }
    if (root) {
      stats.changed = round.stats.changed;
      round.stats.diff_s += stats.diff_s;
    }
    if (!root) stats.changed = changed;
  }

  // Rank 0 ends the sync with the receivers and tells the decision.
  Result<SyncStats> ended = begun;
  if (root && begun.ok()) {
    if (!streamed.ok() && round.streamed.ok()) round.streamed = streamed;
    ended = EndSync(&round, order, [] { return Status::OK(); });
  }
  uint8_t decision = root && ended.ok() ? 1 : 0;
  if (Status s = trainers_->Broadcast(0, std::span(&decision, 1)); !s.ok()) {
    return lost(s, "telling the trainer ranks");
  }
  SettleShards(shards, decision == 1 && local.ok());
  if (!local.ok()) return local;
  if (root) {
    if (!ended.ok()) return ended.status();
    return ended;
  }
  if (decision != 1) {
    return Status::Aborted("sharded sync: rank 0 failed the sync (its error says why)");
  }
  stats.sync_id = local_syncs_;
  return stats;
}

Result<std::span<const uint8_t>> Sender::ShardSnapshot(size_t index) const {
  if (!sharded_) {
    return Status::FailedPrecondition("a whole-tensor sender has no shards (Snapshot)");
  }
  if (index >= local_.size() || !have_local_ || !local_[index].contributes) {
    return Status::NotFound("no committed snapshot of local tensor " + std::to_string(index));
  }
  if (local_[index].device) return local_[index].device->snapshot();
  return std::span<const uint8_t>(local_[index].snapshot);
}

}  // namespace deltasync::stream_sender
