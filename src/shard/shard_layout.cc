// A sharded trainer's layout, the runs of its pieces and the dense gather
// (shard_layout.h; docs/format.md, "Stream: sharded sync").
#include "shard/shard_layout.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <nlohmann/json.hpp>

#include "core/endian.h"
#include "deltasync/checksum.h"
#include "deltasync/tensor.h"

namespace deltasync::stream {

namespace {

constexpr uint8_t kMagic[4] = {'D', 'S', 'S', 'L'};
constexpr size_t kRecordBytes = 24;
constexpr uint32_t kFlagRefused = 1;
constexpr uint64_t kMaxLayoutBytes = uint64_t{1} << 30;
constexpr size_t kChecksumBytes = 8;

std::vector<uint64_t> Strides(const std::vector<int64_t>& shape) {
  std::vector<uint64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * static_cast<uint64_t>(shape[d]);
  return s;
}

bool PieceContributes(const ShardSpec& spec, const ShardPiece& p) {
  return spec.contributes && p.contributes;
}

}  // namespace

void ForEachPieceRun(const ShardPiece& piece, const std::vector<int64_t>& local_shape,
                     uint64_t first, uint64_t count,
                     const std::function<void(const PieceRun&)>& fn) {
  const uint64_t end = first + count;
  const auto emit = [&](uint64_t hf, uint64_t local, uint64_t n) {
    const uint64_t lo = std::max(hf, first);
    const uint64_t hi = std::min(hf + n, end);
    if (lo < hi) fn({lo, local + (lo - hf), hi - lo});
  };
  if (piece.kind == ShardPiece::Kind::kFlat) {
    emit(static_cast<uint64_t>(piece.hf_first), static_cast<uint64_t>(piece.local_first),
         static_cast<uint64_t>(piece.count));
    return;
  }
  const size_t k = piece.extent.size();
  if (k == 0) {  // a scalar
    emit(0, 0, 1);
    return;
  }
  for (int64_t e : piece.extent) {
    if (e == 0) return;
  }
  const std::vector<uint64_t> hs = Strides(piece.hf_shape);
  const std::vector<uint64_t> ls = Strides(local_shape);
  const uint64_t len = static_cast<uint64_t>(piece.extent[k - 1]);
  uint64_t rows = 1;
  for (size_t d = 0; d + 1 < k; ++d) rows *= static_cast<uint64_t>(piece.extent[d]);
  // Row r's start on both sides: its coordinates over extent[0 .. k-2].
  const auto row_start = [&](uint64_t r, uint64_t* hf, uint64_t* local) {
    uint64_t h = static_cast<uint64_t>(piece.hf_offset[k - 1]);
    uint64_t l = static_cast<uint64_t>(piece.local_offset[k - 1]);
    for (size_t d = k - 1; d-- > 0;) {
      const uint64_t ext = static_cast<uint64_t>(piece.extent[d]);
      const uint64_t c = r % ext;
      r /= ext;
      h += (static_cast<uint64_t>(piece.hf_offset[d]) + c) * hs[d];
      l += (static_cast<uint64_t>(piece.local_offset[d]) + c) * ls[d];
    }
    *hf = h;
    *local = l;
  };
  // Rows start at increasing HF positions: the first row that reaches past
  // `first` by bisection.
  uint64_t lo = 0, hi = rows;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    uint64_t h = 0, l = 0;
    row_start(mid, &h, &l);
    if (h + len <= first) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (uint64_t r = lo; r < rows; ++r) {
    uint64_t h = 0, l = 0;
    row_start(r, &h, &l);
    if (h >= end) break;
    emit(h, l, len);
  }
}

PiecesByTensor ContributingPieces(std::span<const ShardSpec> specs) {
  PiecesByTensor out;
  for (size_t i = 0; i < specs.size(); ++i) {
    for (size_t j = 0; j < specs[i].pieces.size(); ++j) {
      const ShardPiece& p = specs[i].pieces[j];
      if (PieceContributes(specs[i], p)) out[p.hf_name].push_back({i, j});
    }
  }
  return out;
}

std::vector<uint8_t> EncodeLayout(std::span<const ShardSpec> specs) {
  nlohmann::json list = nlohmann::json::array();
  for (const ShardSpec& s : specs) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const ShardPiece& p : s.pieces) {
      nlohmann::json j = {{"name", p.hf_name}, {"hf_shape", p.hf_shape}};
      if (p.kind == ShardPiece::Kind::kBox) {
        j["box"] = {p.local_offset, p.hf_offset, p.extent};
      } else {
        j["flat"] = {p.local_first, p.hf_first, p.count};
      }
      if (!p.contributes) j["contributes"] = false;
      pieces.push_back(std::move(j));
    }
    list.push_back({{"dtype", std::string(DTypeName(s.dtype))},
                    {"local_shape", s.local_shape},
                    {"contributes", s.contributes},
                    {"pieces", std::move(pieces)}});
  }
  const std::string text = list.dump();
  std::vector<uint8_t> out(text.begin(), text.end());
  const std::vector<uint8_t> sum = ChecksumBytes(ChecksumAlgo::kXxh3_64, std::span(out));
  out.insert(out.end(), sum.begin(), sum.end());
  return out;
}

Result<std::vector<ShardSpec>> DecodeLayout(std::span<const uint8_t> bytes) {
  const auto bad = [](const std::string& why) { return Status::Corruption("layout: " + why); };
  if (bytes.size() < kChecksumBytes) return bad("too short");
  const std::span<const uint8_t> text = bytes.first(bytes.size() - kChecksumBytes);
  const std::vector<uint8_t> sum = ChecksumBytes(ChecksumAlgo::kXxh3_64, text);
  if (!std::equal(sum.begin(), sum.end(), bytes.end() - kChecksumBytes)) {
    return bad("checksum mismatch");
  }
  const nlohmann::json list = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (!list.is_array()) return bad("not a JSON array");
  const auto ints = [](const nlohmann::json& j, std::vector<int64_t>* out) {
    if (!j.is_array()) return false;
    for (const nlohmann::json& v : j) {
      if (!v.is_number_integer()) return false;
      out->push_back(v.get<int64_t>());
    }
    return true;
  };
  std::vector<ShardSpec> specs;
  for (const nlohmann::json& s : list) {
    ShardSpec spec;
    if (!s.is_object() || !s.contains("dtype") || !s["dtype"].is_string() ||
        !s.contains("local_shape") || !ints(s["local_shape"], &spec.local_shape) ||
        !s.contains("contributes") || !s["contributes"].is_boolean() || !s.contains("pieces") ||
        !s["pieces"].is_array()) {
      return bad("local tensor " + std::to_string(specs.size()) + ": missing or bad fields");
    }
    Result<DType> dtype = ParseDType(s["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(dtype.status().message());
    spec.dtype = *dtype;
    spec.contributes = s["contributes"].get<bool>();
    for (const nlohmann::json& j : s["pieces"]) {
      ShardPiece p;
      if (!j.is_object() || !j.contains("name") || !j["name"].is_string() ||
          !j.contains("hf_shape") || !ints(j["hf_shape"], &p.hf_shape)) {
        return bad("a piece without a name or shape");
      }
      p.hf_name = j["name"].get<std::string>();
      if (j.contains("box")) {
        const nlohmann::json& b = j["box"];
        p.kind = ShardPiece::Kind::kBox;
        if (!b.is_array() || b.size() != 3 || !ints(b[0], &p.local_offset) ||
            !ints(b[1], &p.hf_offset) || !ints(b[2], &p.extent)) {
          return bad("tensor '" + p.hf_name + "': a bad box");
        }
      } else if (j.contains("flat")) {
        std::vector<int64_t> f;
        if (!ints(j["flat"], &f) || f.size() != 3) {
          return bad("tensor '" + p.hf_name + "': a bad flat range");
        }
        p.kind = ShardPiece::Kind::kFlat;
        p.local_first = f[0];
        p.hf_first = f[1];
        p.count = f[2];
      } else {
        return bad("tensor '" + p.hf_name + "': a piece neither box nor flat");
      }
      if (j.contains("contributes")) {
        if (!j["contributes"].is_boolean()) return bad("a bad contributes flag");
        p.contributes = j["contributes"].get<bool>();
      }
      spec.pieces.push_back(std::move(p));
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

Result<std::vector<std::vector<ShardSpec>>> ExchangeLayout(Communicator& group,
                                                           std::span<const ShardSpec> mine,
                                                           const Status& refusal) {
  const int n = group.size();
  const std::vector<uint8_t> body = refusal.ok() ? EncodeLayout(mine) : std::vector<uint8_t>();
  uint8_t record[kRecordBytes] = {};
  std::memcpy(record, kMagic, 4);
  StoreLe<uint32_t>(record + 4, refusal.ok() ? 0 : kFlagRefused);
  StoreLe<uint64_t>(record + 8, group.generation());
  StoreLe<uint64_t>(record + 16, body.size());
  std::vector<uint8_t> records(group.rank() == 0 ? kRecordBytes * n : 0);
  DS_RETURN_IF_ERROR(group.Gather(0, record, records));
  if (group.rank() != 0) {
    if (!body.empty()) DS_RETURN_IF_ERROR(group.Send(0, body));
    if (!refusal.ok()) return refusal;
    return std::vector<std::vector<ShardSpec>>();
  }
  std::vector<std::vector<ShardSpec>> all(n);
  Status first = refusal;
  if (refusal.ok()) all[0].assign(mine.begin(), mine.end());
  for (int r = 1; r < n; ++r) {
    const uint8_t* rec = records.data() + r * kRecordBytes;
    const std::string who = "rank " + std::to_string(r);
    const uint64_t bytes = LoadLe<uint64_t>(rec + 16);
    Status problem;
    bool take = bytes > 0;
    if (std::memcmp(rec, kMagic, 4) != 0) {
      problem = Status::Corruption("layout: " + who + " sent a record that is not a layout's");
      take = false;
    } else if (bytes > kMaxLayoutBytes) {
      problem = Status::Corruption("layout: " + who + "'s layout of " + std::to_string(bytes) +
                                   " bytes is past its bound");
      take = false;
    } else if ((LoadLe<uint32_t>(rec + 4) & kFlagRefused) != 0) {
      problem = Status::InvalidArgument("layout: " + who + " refused its own shards");
    } else if (LoadLe<uint64_t>(rec + 8) != group.generation()) {
      problem = Status::InvalidArgument("layout: " + who + " is in generation " +
                                        std::to_string(LoadLe<uint64_t>(rec + 8)) + ", rank 0 in " +
                                        std::to_string(group.generation()));
    }
    if (take) {
      std::vector<uint8_t> got(bytes);
      DS_RETURN_IF_ERROR(group.Recv(r, got));
      if (problem.ok()) {
        Result<std::vector<ShardSpec>> specs = DecodeLayout(got);
        if (!specs.ok()) {
          problem = Status(specs.status().code(), who + ": " + specs.status().message());
        } else {
          all[r] = std::move(*specs);
        }
      }
    }
    if (first.ok() && !problem.ok()) first = problem;
  }
  if (!first.ok()) return first;
  return all;
}

namespace {

// First element of [0, numel) that none of `runs` covers (sorted by hf), or
// numel when they cover it all.
uint64_t FirstUncovered(std::vector<PieceRun>* runs, uint64_t numel) {
  std::sort(runs->begin(), runs->end(),
            [](const PieceRun& a, const PieceRun& b) { return a.hf < b.hf; });
  uint64_t next = 0;
  for (const PieceRun& r : *runs) {
    if (r.hf > next) return next;
    next = std::max(next, r.hf + r.count);
  }
  return next < numel ? next : numel;
}

}  // namespace

Status CheckLayout(std::span<const LayoutTensor> model,
                   const std::vector<std::vector<ShardSpec>>& by_rank) {
  std::map<std::string_view, const LayoutTensor*> tensors;
  for (const LayoutTensor& t : model) tensors[t.name] = &t;
  struct Held {
    int rank;
    const ShardSpec* spec;
    const ShardPiece* piece;
  };
  std::map<std::string_view, std::vector<Held>> by_tensor;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    for (size_t i = 0; i < by_rank[r].size(); ++i) {
      const ShardSpec& s = by_rank[r][i];
      const std::string who = "rank " + std::to_string(r) + ", local tensor " + std::to_string(i);
      if (Status v = s.Validate(); !v.ok()) return Status(v.code(), who + ": " + v.message());
      for (const ShardPiece& p : s.pieces) {
        auto it = tensors.find(p.hf_name);
        if (it == tensors.end()) {
          return Status::InvalidArgument(who + ": tensor '" + p.hf_name + "' is not in the model");
        }
        if (it->second->dtype != s.dtype || it->second->shape != p.hf_shape) {
          return Status::InvalidArgument(who + ": tensor '" + p.hf_name +
                                         "' has another dtype or shape than in the model");
        }
        if (PieceContributes(s, p)) by_tensor[p.hf_name].push_back({static_cast<int>(r), &s, &p});
      }
    }
  }
  for (const LayoutTensor& t : model) {
    Result<int64_t> numel = ShapeNumel(t.shape);
    if (!numel.ok()) return numel.status();
    const uint64_t n = static_cast<uint64_t>(*numel);
    const std::vector<Held>& held = by_tensor[t.name];
    // Overlaps: pieces sorted by their first HF position, then a sweep that
    // compares each with the ones whose span it starts inside.
    struct Span {
      uint64_t lo, hi;
      const Held* h;
    };
    std::vector<Span> spans;
    uint64_t covered = 0;
    for (const Held& h : held) {
      uint64_t lo = UINT64_MAX, hi = 0, count = 0;
      ForEachPieceRun(*h.piece, h.spec->local_shape, 0, n, [&](const PieceRun& r) {
        lo = std::min(lo, r.hf);
        hi = std::max(hi, r.hf + r.count);
        count += r.count;
      });
      if (count == 0) continue;
      covered += count;
      spans.push_back({lo, hi, &h});
    }
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
    bool meet = false;
    for (size_t a = 1; a < spans.size() && !meet; ++a) meet = spans[a].lo < spans[a - 1].hi;
    if (meet) {
      // Pieces whose spans meet (column shards, blocks): their runs, sorted,
      // must not overlap.
      struct Owned {
        PieceRun run;
        int rank;
      };
      std::vector<Owned> runs;
      for (const Span& sp : spans) {
        ForEachPieceRun(*sp.h->piece, sp.h->spec->local_shape, 0, n, [&](const PieceRun& r) {
          runs.push_back({r, sp.h->rank});
        });
      }
      std::sort(runs.begin(), runs.end(),
                [](const Owned& a, const Owned& b) { return a.run.hf < b.run.hf; });
      uint64_t reach = 0;  // the furthest end so far, and whose run it is
      int reach_rank = -1;
      for (const Owned& o : runs) {
        if (reach_rank >= 0 && o.run.hf < reach) {
          return Status::InvalidArgument(
              "tensor '" + t.name + "': element " + std::to_string(o.run.hf) +
              " is held by two contributing pieces, of rank " + std::to_string(reach_rank) +
              " and of rank " + std::to_string(o.rank) +
              " (overlapping shards: mark all replicas but one contributes=False)");
        }
        if (o.run.hf + o.run.count > reach) {
          reach = o.run.hf + o.run.count;
          reach_rank = o.rank;
        }
      }
    }
    if (covered < n) {
      std::vector<PieceRun> runs;
      for (const Held& h : held) {
        ForEachPieceRun(*h.piece, h.spec->local_shape, 0, n,
                        [&](const PieceRun& r) { runs.push_back(r); });
      }
      const uint64_t gap = FirstUncovered(&runs, n);
      return Status::InvalidArgument(
          "tensor '" + t.name + "': element " + std::to_string(gap) + " (of " + std::to_string(n) +
          ", " + std::to_string(n - covered) +
          " in all) is held by no trainer rank that contributes (a rank whose shard spec has "
          "contributes=False sends nothing): every element needs a contributing rank");
    }
  }
  return Status::OK();
}

namespace {

// Calls fn(segment index, piece run, spec index) for every run of the
// rank's contributing pieces in `segments`, in the dense message's order.
template <typename Fn>
void ForEachDenseRun(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                     std::span<const Segment> segments, Fn&& fn) {
  for (size_t s = 0; s < segments.size(); ++s) {
    auto it = pieces.find(segments[s].name);
    if (it == pieces.end()) continue;
    for (const auto& ij : it->second) {
      // A named copy: a lambda cannot capture a structured binding before
      // C++20 as clang 14 implements it.
      const size_t i = ij.first;
      ForEachPieceRun(specs[i].pieces[ij.second], specs[i].local_shape, segments[s].first,
                      segments[s].count, [&](const PieceRun& r) { fn(s, r, i); });
    }
  }
}

}  // namespace

uint64_t DenseBytes(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                    std::span<const Segment> segments) {
  uint64_t bytes = 0;
  ForEachDenseRun(specs, pieces, segments,
                  [&](size_t s, const PieceRun& r, size_t) { bytes += r.count * segments[s].w; });
  return bytes;
}

Status PackDense(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                 const LocalReader& read, std::span<const Segment> segments,
                 std::vector<uint8_t>* out) {
  out->resize(DenseBytes(specs, pieces, segments));
  uint8_t* at = out->data();
  Status status = Status::OK();
  ForEachDenseRun(specs, pieces, segments, [&](size_t s, const PieceRun& r, size_t i) {
    if (!status.ok()) return;
    status = read(i, r.local, r.count, at);
    at += r.count * segments[s].w;
  });
  return status;
}

void PackDense(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
               std::span<const std::span<const uint8_t>> data, std::span<const Segment> segments,
               std::vector<uint8_t>* out) {
  (void)PackDense(
      specs, pieces,
      [&](size_t i, uint64_t first, uint64_t count, uint8_t* dst) {
        const uint64_t elem = DTypeSize(specs[i].dtype);
        std::memcpy(dst, data[i].data() + first * elem, count * elem);
        return Status::OK();
      },
      segments, out);
}

void UnpackDense(std::span<const ShardSpec> specs, const PiecesByTensor& pieces,
                 std::span<const uint8_t> message, std::span<const Segment> segments,
                 std::span<const std::span<uint8_t>> buffers) {
  const uint8_t* at = message.data();
  ForEachDenseRun(specs, pieces, segments, [&](size_t s, const PieceRun& r, size_t) {
    const uint32_t w = segments[s].w;
    std::memcpy(buffers[s].data() + (r.hf - segments[s].first) * w, at, r.count * w);
    at += r.count * w;
  });
}

}  // namespace deltasync::stream
