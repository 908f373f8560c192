#include "shard/shard_gather.h"

#include <bit>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/dtype_code.h"
#include "core/endian.h"
#include "deltasync/checksum.h"
#include "deltasync/shard.h"

namespace deltasync::stream {

static_assert(std::endian::native == std::endian::little,
              "payloads carry the change sets' positions as they lie in memory");

namespace {

constexpr uint8_t kMagic[4] = {0x44, 0x53, 0x53, 0x47};  // "DSSG"
constexpr uint32_t kRefused = 1;

// Built by appending: GCC 12 warns (-Wrestrict, falsely) on "'" + string.
std::string Quote(std::string_view name) {
  std::string s(1, '\'');
  s.append(name);
  s += '\'';
  return s;
}
std::string Rank(int r) { return "rank " + std::to_string(r); }

// a + b, or UINT64_MAX when it would not fit.
uint64_t SatAdd(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t SatMul(uint64_t a, uint64_t b) {
  return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

struct Record {
  bool magic_ok = false;
  uint32_t flags = 0;
  uint64_t batch_id = 0;
  uint64_t key = 0;
  uint64_t tensors = 0;  // m
  uint64_t bytes = 0;    // B
};

void EncodeRecord(const Record& r, uint8_t* out) {
  std::memcpy(out, kMagic, 4);
  StoreLe<uint32_t>(out + 4, r.flags);
  StoreLe<uint64_t>(out + 8, r.batch_id);
  StoreLe<uint64_t>(out + 16, r.key);
  StoreLe<uint64_t>(out + 24, r.tensors);
  StoreLe<uint64_t>(out + 32, r.bytes);
}

Record DecodeRecord(const uint8_t* in) {
  Record r;
  r.magic_ok = std::memcmp(in, kMagic, 4) == 0;
  r.flags = LoadLe<uint32_t>(in + 4);
  r.batch_id = LoadLe<uint64_t>(in + 8);
  r.key = LoadLe<uint64_t>(in + 16);
  r.tensors = LoadLe<uint64_t>(in + 24);
  r.bytes = LoadLe<uint64_t>(in + 32);
  return r;
}

// A listed tensor as the payloads need it.
struct Listed {
  uint64_t numel = 0;
  uint32_t w = 1;  // element size
  uint32_t W = 4;  // position width
};

// This rank's changes, one (merged) change set per listed tensor.
struct Own {
  std::vector<const ChangeSet*> of;  // nullptr: no changes
  std::vector<ChangeSet> merged;     // where several entries of a tensor were merged
};

// Checks `mine` against the list and gathers it per tensor (the rank's own
// rule of "Messages": InvalidArgument naming the tensor and the problem).
Status PrepareOwn(std::span<const GatherTensor> tensors, const std::vector<Listed>& listed,
                  std::span<const TensorChanges> mine, Own* own) {
  std::unordered_map<std::string_view, uint32_t> index;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (!index.emplace(tensors[t].name, static_cast<uint32_t>(t)).second) {
      return Status::InvalidArgument("tensor " + Quote(tensors[t].name) +
                                     " is listed twice in the batch");
    }
  }
  std::vector<std::vector<size_t>> entries(tensors.size());
  for (size_t e = 0; e < mine.size(); ++e) {
    const TensorChanges& tc = mine[e];
    const ChangeSet& c = tc.changes;
    const std::string what = "changes of tensor " + Quote(tc.name);
    const auto it = index.find(tc.name);
    if (it == index.end()) return Status::InvalidArgument(what + ": not in the batch");
    const Listed& l = listed[it->second];
    if (c.elem_size != l.w || c.numel != l.numel) {
      return Status::InvalidArgument(what + ": element size " + std::to_string(c.elem_size) +
                                     " and numel " + std::to_string(c.numel) +
                                     ", the batch lists " + std::to_string(l.w) + " and " +
                                     std::to_string(l.numel));
    }
    if (c.wide != (l.W == 8) || (c.wide ? !c.pos32.empty() : !c.pos64.empty())) {
      return Status::InvalidArgument(what + ": positions not in pos" + std::to_string(8 * l.W) +
                                     " (the width numel " + std::to_string(l.numel) + " selects)");
    }
    const uint64_t n = c.count();
    if (c.new_values.size() != n * l.w || c.old_values.size() != n * l.w) {
      return Status::InvalidArgument(what + ": " + std::to_string(c.new_values.size()) +
                                     " bytes of new and " + std::to_string(c.old_values.size()) +
                                     " of old values for " + std::to_string(n) + " changes");
    }
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t p = c.position(k);
      if (p >= l.numel || (k > 0 && p <= c.position(k - 1))) {
        return Status::InvalidArgument(what + ": position " + std::to_string(p) + " at index " +
                                       std::to_string(k) + " is not increasing or is past numel " +
                                       std::to_string(l.numel));
      }
    }
    if (n > 0) entries[it->second].push_back(e);
  }
  own->of.assign(tensors.size(), nullptr);
  size_t merges = 0;
  for (const std::vector<size_t>& es : entries) merges += es.size() > 1;
  own->merged.resize(merges);  // never reallocated below: `of` points into it
  size_t m = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (entries[t].size() == 1) own->of[t] = &mine[entries[t][0]].changes;
    if (entries[t].size() <= 1) continue;
    std::vector<std::string> origins;
    for (size_t e : entries[t]) origins.push_back("entry " + std::to_string(e));
    std::vector<ChangeRun> runs;
    for (size_t k = 0; k < entries[t].size(); ++k) {
      runs.push_back(RunOf(mine[entries[t][k]].changes, origins[k]));
    }
    ChangeSet& cs = own->merged[m++];
    cs.numel = listed[t].numel;
    cs.elem_size = listed[t].w;
    DS_RETURN_IF_ERROR(MergeChangeRuns(tensors[t].name, runs, &cs));
    own->of[t] = &cs;
  }
  return Status::OK();
}

// The payload of `own` (docs/format.md, "Messages", step 2).
std::vector<uint8_t> EncodePayload(const std::vector<Listed>& listed, const Own& own,
                                   uint64_t* tensors) {
  uint64_t m = 0, bytes = 0;
  for (size_t t = 0; t < listed.size(); ++t) {
    if (own.of[t] == nullptr) continue;
    ++m;
    bytes += kGatherIndexRecordBytes + own.of[t]->count() * (listed[t].W + 2 * listed[t].w);
  }
  std::vector<uint8_t> out(bytes);
  uint8_t* index = out.data();
  uint8_t* data = out.data() + m * kGatherIndexRecordBytes;
  for (size_t t = 0; t < listed.size(); ++t) {
    const ChangeSet* c = own.of[t];
    if (c == nullptr) continue;
    const uint64_t n = c->count();
    StoreLe<uint32_t>(index, static_cast<uint32_t>(t));
    StoreLe<uint32_t>(index + 4, 0);
    StoreLe<uint64_t>(index + 8, n);
    index += kGatherIndexRecordBytes;
    const size_t pos_bytes = n * listed[t].W, val_bytes = n * listed[t].w;
    std::memcpy(data, c->wide ? static_cast<const void*>(c->pos64.data()) : c->pos32.data(),
                pos_bytes);
    data += pos_bytes;
    std::memcpy(data, c->new_values.data(), val_bytes);
    data += val_bytes;
    std::memcpy(data, c->old_values.data(), val_bytes);
    data += val_bytes;
  }
  *tensors = m;
  return out;
}

// Checks rank r's payload and adds its lists to runs[t] (views into it).
Status ParsePayload(int r, std::span<const uint8_t> payload, uint64_t m,
                    std::span<const GatherTensor> tensors, const std::vector<Listed>& listed,
                    const std::string& origin, std::vector<std::vector<ChangeRun>>* runs) {
  const std::string what = Rank(r) + "'s payload";
  const uint64_t index_bytes = m * kGatherIndexRecordBytes;
  uint64_t expect = index_bytes;
  int64_t prev = -1;
  for (uint64_t k = 0; k < m; ++k) {
    const uint8_t* rec = payload.data() + k * kGatherIndexRecordBytes;
    const uint32_t t = LoadLe<uint32_t>(rec);
    const uint64_t n = LoadLe<uint64_t>(rec + 8);
    if (static_cast<int64_t>(t) <= prev || t >= tensors.size()) {
      return Status::Corruption(what + ": index record " + std::to_string(k) + " names tensor " +
                                std::to_string(t) + " (indices strictly increase, below " +
                                std::to_string(tensors.size()) + ")");
    }
    if (LoadLe<uint32_t>(rec + 4) != 0) {
      return Status::Corruption(what + ": index record " + std::to_string(k) +
                                ": reserved bytes are not 0");
    }
    if (n == 0 || n > listed[t].numel) {
      return Status::Corruption(what + ": tensor " + Quote(tensors[t].name) + ": " +
                                std::to_string(n) + " changes (1 to numel " +
                                std::to_string(listed[t].numel) + ")");
    }
    expect = SatAdd(expect, SatMul(n, listed[t].W + 2 * listed[t].w));
    prev = t;
  }
  if (expect != payload.size()) {
    return Status::Corruption(what + ": " + std::to_string(payload.size()) +
                              " bytes, its index records give " + std::to_string(expect));
  }
  const uint8_t* data = payload.data() + index_bytes;
  for (uint64_t k = 0; k < m; ++k) {
    const uint8_t* rec = payload.data() + k * kGatherIndexRecordBytes;
    const uint32_t t = LoadLe<uint32_t>(rec);
    const uint64_t n = LoadLe<uint64_t>(rec + 8);
    ChangeRun run;
    run.count = n;
    run.position_width = listed[t].W;
    run.positions = data;
    data += n * listed[t].W;
    run.new_values = data;
    data += n * listed[t].w;
    run.old_values = data;
    data += n * listed[t].w;
    run.origin = origin;
    (*runs)[t].push_back(run);
  }
  return Status::OK();
}

}  // namespace

Result<uint64_t> GatherBatchKey(std::span<const GatherTensor> tensors) {
  if (tensors.size() > UINT32_MAX) {
    return Status::InvalidArgument("a batch of " + std::to_string(tensors.size()) +
                                   " tensors (at most 2^32 - 1)");
  }
  std::vector<uint8_t> enc;
  for (const GatherTensor& t : tensors) {
    const std::string what = "batch tensor " + Quote(t.name);
    if (t.name.size() > UINT16_MAX) {
      return Status::InvalidArgument(what + ": a name of more than 65535 bytes");
    }
    if (t.shape.size() > UINT8_MAX) {
      return Status::InvalidArgument(what + ": more than 255 dimensions");
    }
    if (static_cast<int>(t.dtype) >= kNumDTypes) {
      return Status::InvalidArgument(what + ": unknown dtype " +
                                     std::to_string(static_cast<int>(t.dtype)));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || d > kMaxShardNumel || (d != 0 && numel > uint64_t{kMaxShardNumel} / d)) {
        return Status::InvalidArgument(what + ": a negative dimension or more than 2^56 elements");
      }
      numel *= static_cast<uint64_t>(d);
    }
    const size_t at = enc.size();
    enc.resize(at + 4 + t.name.size() + 8 * t.shape.size());
    uint8_t* p = enc.data() + at;
    p[0] = static_cast<uint8_t>(t.name.size());
    p[1] = static_cast<uint8_t>(t.name.size() >> 8);
    std::memcpy(p + 2, t.name.data(), t.name.size());
    p += 2 + t.name.size();
    p[0] = DTypeWireCode(t.dtype);
    p[1] = static_cast<uint8_t>(t.shape.size());
    p += 2;
    for (int64_t d : t.shape) {
      StoreLe<uint64_t>(p, static_cast<uint64_t>(d));
      p += 8;
    }
  }
  const std::vector<uint8_t> digest = ChecksumBytes(ChecksumAlgo::kXxh3_64, enc);
  uint64_t key = 0;
  for (uint8_t b : digest) key = key << 8 | b;  // the digest is big-endian
  return key;
}

Result<std::vector<TensorChanges>> GatherChanges(Communicator& group, uint64_t batch_id,
                                                 std::span<const GatherTensor> tensors,
                                                 std::span<const TensorChanges> mine,
                                                 const Status& refusal, ThreadPool* pool) {
  const int rank = group.rank();
  const int size = group.size();
  const std::string me = "sharded gather of batch " + std::to_string(batch_id) + ", " + Rank(rank);

  // This rank's own input: a problem with it is a refusal, still taking
  // part in the exchange.
  std::vector<Listed> listed(tensors.size());
  Own own;
  Result<uint64_t> key = GatherBatchKey(tensors);
  Status own_status = key.status();
  if (own_status.ok()) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      uint64_t numel = 1;
      for (int64_t d : tensors[t].shape) numel *= static_cast<uint64_t>(d);
      listed[t].numel = numel;
      listed[t].w = static_cast<uint32_t>(DTypeSize(tensors[t].dtype));
      listed[t].W = numel > UINT32_MAX ? 8 : 4;
    }
    own_status = PrepareOwn(tensors, listed, mine, &own);
  }
  if (own_status.ok() && !refusal.ok()) own_status = refusal;
  own_status = own_status.WithContext(me);

  Record record;
  record.batch_id = batch_id;
  record.key = key.ok() ? *key : 0;
  std::vector<uint8_t> payload;
  if (!own_status.ok()) {
    record.flags = kRefused;
  } else if (rank != 0) {
    payload = EncodePayload(listed, own, &record.tensors);
    record.bytes = payload.size();
  }
  uint8_t mine_record[kGatherRecordBytes];
  EncodeRecord(record, mine_record);
  std::vector<uint8_t> records(rank == 0 ? kGatherRecordBytes * size : 0);
  DS_RETURN_IF_ERROR(group.Gather(0, mine_record, records).WithContext(me + ": gather of sizes"));

  if (rank != 0) {
    if (!payload.empty()) {
      DS_RETURN_IF_ERROR(group.Send(0, payload).WithContext(me + ": send of the payload"));
    }
    if (!own_status.ok()) return own_status;
    return std::vector<TensorChanges>{};
  }

  // Rank 0. The most a payload of this list can hold.
  uint64_t bound = SatMul(tensors.size(), kGatherIndexRecordBytes);
  for (const Listed& l : listed) bound = SatAdd(bound, SatMul(l.numel, l.W + 2 * l.w));
  Status first_error = own_status;
  auto fail = [&](Status s) {
    if (first_error.ok()) first_error = s.WithContext(me);
  };
  std::vector<Record> recs(size);
  std::vector<bool> receive(size, false);
  for (int r = 1; r < size; ++r) {
    const Record& rec = recs[r] = DecodeRecord(records.data() + kGatherRecordBytes * r);
    const std::string who = Rank(r);
    if (!rec.magic_ok) {
      fail(Status::Corruption(who + " sent a gather record that is not one (bad magic)"));
      continue;
    }
    if (rec.bytes > bound) {
      fail(Status::Corruption(who + " announces a payload of " + std::to_string(rec.bytes) +
                              " bytes, more than the batch can hold (" + std::to_string(bound) +
                              ")"));
      continue;
    }
    // A refusing rank sends nothing, whatever its record says.
    receive[r] = rec.bytes > 0 && (rec.flags & kRefused) == 0;
    if ((rec.flags & ~kRefused) != 0) {
      fail(Status::Corruption(who + " sent unknown gather flags " + std::to_string(rec.flags)));
    } else if (rec.flags & kRefused) {
      fail(Status::InvalidArgument(who + " refused its own changes"));
      if (rec.bytes != 0 || rec.tensors != 0) {
        fail(Status::Corruption(who + " refused but announces a payload"));
      }
    } else if (rec.batch_id != batch_id) {
      fail(Status::InvalidArgument(who + " gathers batch " + std::to_string(rec.batch_id) +
                                   ", rank 0 batch " + std::to_string(batch_id)));
    } else if (rec.key != record.key) {
      fail(Status::InvalidArgument(who + " gathers batch " + std::to_string(batch_id) +
                                   " with a different tensor list"));
    } else if (rec.tensors > tensors.size() || (rec.tensors == 0) != (rec.bytes == 0) ||
               rec.bytes < rec.tensors * kGatherIndexRecordBytes) {
      fail(Status::Corruption(who + " announces " + std::to_string(rec.tensors) + " tensors in " +
                              std::to_string(rec.bytes) + " bytes, for a batch of " +
                              std::to_string(tensors.size())));
    }
  }
  // Every payload that can be received is, so that no sender is left
  // waiting; only then do problems count.
  std::vector<std::vector<uint8_t>> payloads(size);
  for (int r = 1; r < size; ++r) {
    if (!receive[r]) continue;
    payloads[r].resize(recs[r].bytes);
    DS_RETURN_IF_ERROR(
        group.Recv(r, payloads[r]).WithContext(me + ": receive of " + Rank(r) + "'s payload"));
  }
  DS_RETURN_IF_ERROR(first_error);

  std::vector<std::string> origins(size);
  for (int r = 0; r < size; ++r) origins[r] = Rank(r);
  std::vector<std::vector<ChangeRun>> runs(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (own.of[t] != nullptr) runs[t].push_back(RunOf(*own.of[t], origins[0]));
  }
  for (int r = 1; r < size; ++r) {
    if (payloads[r].empty()) continue;
    DS_RETURN_IF_ERROR(
        ParsePayload(r, payloads[r], recs[r].tensors, tensors, listed, origins[r], &runs)
            .WithContext(me));
  }
  std::vector<TensorChanges> out(tensors.size());
  std::vector<Status> merged(tensors.size());
  const auto merge = [&](size_t t) {
    out[t].name = tensors[t].name;
    ChangeSet& cs = out[t].changes;
    cs.numel = listed[t].numel;
    cs.elem_size = listed[t].w;
    merged[t] = MergeChangeRuns(tensors[t].name, runs[t], &cs);
  };
  if (pool != nullptr && tensors.size() > 1) {
    pool->ParallelFor(tensors.size(), merge);
  } else {
    for (size_t t = 0; t < tensors.size(); ++t) merge(t);
  }
  for (const Status& s : merged) DS_RETURN_IF_ERROR(s.WithContext(me));
  return out;
}

}  // namespace deltasync::stream
