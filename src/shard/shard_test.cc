// Placements (ShardSpec), their translation into HF flat coordinates and
// the sharded gather, each against a reference computed element by
// element: coordinates mapped one at a time, and DiffTensor of the whole
// HF tensors. One file past 800 lines on purpose: every case checks
// against the same element-by-element reference (below), which a split
// would copy.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator_test_util.h"
#include "deltasync/checksum.h"
#include "deltasync/communicator.h"
#include "deltasync/diff.h"
#include "deltasync/shard.h"
#include "shard/shard_changes.h"
#include "shard/shard_gather.h"

namespace deltasync::stream {
namespace {

using std::chrono::milliseconds;

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// An HF tensor with its state before and after a step.
struct HfTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> old_bytes;
  std::vector<uint8_t> new_bytes;
  uint32_t w() const { return static_cast<uint32_t>(DTypeSize(dtype)); }
};

HfTensor MakeTensor(std::string name, DType dtype, std::vector<int64_t> shape, uint64_t seed) {
  HfTensor t{std::move(name), dtype, std::move(shape), {}, {}};
  t.old_bytes.resize(Numel(t.shape) * t.w());
  for (uint8_t& b : t.old_bytes) b = static_cast<uint8_t>(SplitMix(seed));
  t.new_bytes = t.old_bytes;
  return t;
}

// Gives element `i` of t a new value different from its old one.
void Mutate(HfTensor* t, uint64_t i, uint64_t& seed) {
  const uint32_t w = t->w();
  for (uint32_t b = 0; b < w; ++b) t->new_bytes[i * w + b] = static_cast<uint8_t>(SplitMix(seed));
  t->new_bytes[i * w] = static_cast<uint8_t>(t->old_bytes[i * w] ^ (1 + SplitMix(seed) % 255));
}

void MutateRandom(HfTensor* t, double density, uint64_t seed) {
  t->new_bytes = t->old_bytes;
  const uint64_t n = Numel(t->shape);
  for (uint64_t i = 0; i < n; ++i) {
    if (static_cast<double>(SplitMix(seed) % 1000) < density * 1000) Mutate(t, i, seed);
  }
}

// The reference placement: local flat element -> (piece, HF flat position),
// by mapping coordinates one element at a time.
struct Mapped {
  size_t piece = SIZE_MAX;
  uint64_t hf = 0;
};

std::vector<Mapped> ReferenceMap(const ShardSpec& spec) {
  const int64_t n = Numel(spec.local_shape);
  std::vector<Mapped> map(n);
  const size_t nd = spec.local_shape.size();
  for (int64_t e = 0; e < n; ++e) {
    std::vector<int64_t> c(nd);
    int64_t rest = e;
    for (size_t d = nd; d-- > 0;) {
      c[d] = rest % spec.local_shape[d];
      rest /= spec.local_shape[d];
    }
    for (size_t j = 0; j < spec.pieces.size(); ++j) {
      const ShardPiece& p = spec.pieces[j];
      if (p.kind == ShardPiece::Kind::kFlat) {
        if (e >= p.local_first && e < p.local_first + p.count) {
          map[e] = {j, static_cast<uint64_t>(e - p.local_first + p.hf_first)};
        }
        continue;
      }
      bool in = true;
      for (size_t d = 0; d < nd; ++d) {
        in = in && c[d] >= p.local_offset[d] && c[d] < p.local_offset[d] + p.extent[d];
      }
      if (!in) continue;
      uint64_t hf = 0;
      for (size_t d = 0; d < nd; ++d) {
        hf = hf * p.hf_shape[d] + (c[d] - p.local_offset[d] + p.hf_offset[d]);
      }
      map[e] = {j, hf};
    }
  }
  return map;
}

const HfTensor& Find(const std::vector<HfTensor>& model, const std::string& name) {
  for (const HfTensor& t : model) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return model[0];
}

// The local tensor's bytes, old or new, copied element by element from the
// HF tensors through the reference map.
std::vector<uint8_t> LocalBytes(const ShardSpec& spec, const std::vector<Mapped>& map,
                                const std::vector<HfTensor>& model, bool new_state) {
  const uint32_t w = static_cast<uint32_t>(DTypeSize(spec.dtype));
  std::vector<uint8_t> out(map.size() * w);
  for (size_t e = 0; e < map.size(); ++e) {
    const HfTensor& t = Find(model, spec.pieces[map[e].piece].hf_name);
    const std::vector<uint8_t>& src = new_state ? t.new_bytes : t.old_bytes;
    std::memcpy(&out[e * w], &src[map[e].hf * w], w);
  }
  return out;
}

ChangeSet Diff(std::span<const uint8_t> new_bytes, std::vector<uint8_t> snapshot, uint32_t w) {
  DiffOptions o;
  o.elem_size = w;
  o.refresh_snapshot = false;
  o.keep_old_values = true;
  ChangeSet cs;
  const Status s = DiffTensor(new_bytes, snapshot, o, &cs);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return cs;
}

// This rank's local changes of `spec`, as a trainer rank gets them.
ChangeSet LocalDiff(const ShardSpec& spec, const std::vector<HfTensor>& model) {
  const std::vector<Mapped> map = ReferenceMap(spec);
  return Diff(LocalBytes(spec, map, model, true), LocalBytes(spec, map, model, false),
              static_cast<uint32_t>(DTypeSize(spec.dtype)));
}

// DiffTensor of the whole HF tensor, kept at the positions `keep` holds.
ChangeSet WholeDiff(const HfTensor& t, const std::vector<bool>* keep = nullptr) {
  ChangeSet full = Diff(t.new_bytes, t.old_bytes, t.w());
  if (keep == nullptr) return full;
  ChangeSet out;
  out.numel = full.numel;
  out.elem_size = full.elem_size;
  out.wide = full.wide;
  for (uint64_t k = 0; k < full.count(); ++k) {
    const uint64_t p = full.position(k);
    if (!(*keep)[p]) continue;
    if (out.wide) {
      out.pos64.push_back(p);
    } else {
      out.pos32.push_back(static_cast<uint32_t>(p));
    }
    const uint8_t* nv = &full.new_values[k * t.w()];
    const uint8_t* ov = &full.old_values[k * t.w()];
    out.new_values.insert(out.new_values.end(), nv, nv + t.w());
    out.old_values.insert(out.old_values.end(), ov, ov + t.w());
  }
  return out;
}

::testing::AssertionResult SameChanges(const ChangeSet& got, const ChangeSet& want) {
  if (got.numel != want.numel || got.elem_size != want.elem_size || got.wide != want.wide) {
    return ::testing::AssertionFailure()
           << "numel/elem_size/wide " << got.numel << "/" << got.elem_size << "/" << got.wide
           << ", want " << want.numel << "/" << want.elem_size << "/" << want.wide;
  }
  if (got.count() != want.count()) {
    return ::testing::AssertionFailure()
           << got.count() << " changes, want " << want.count() << " (pos32 " << got.pos32.size()
           << ", pos64 " << got.pos64.size() << ")";
  }
  if (got.wide ? !got.pos32.empty() : !got.pos64.empty()) {
    return ::testing::AssertionFailure() << "positions in the vector wide does not select";
  }
  for (uint64_t k = 0; k < got.count(); ++k) {
    if (got.position(k) != want.position(k)) {
      return ::testing::AssertionFailure()
             << "position " << k << " is " << got.position(k) << ", want " << want.position(k);
    }
  }
  if (got.new_values != want.new_values) return ::testing::AssertionFailure() << "new values";
  if (got.old_values != want.old_values) return ::testing::AssertionFailure() << "old values";
  return ::testing::AssertionSuccess();
}

#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const ::deltasync::Status s_ = (expr);                  \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)

template <typename T>
T Value(Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : T{};
}

// Translates `spec`'s local diff and checks every HF tensor it names
// against the whole tensor's diff kept at the positions the spec's
// contributing pieces hold (the reference map). Adds what the spec covers
// to *covered (per tensor) when given.
void CheckTranslation(const ShardSpec& spec, const std::vector<HfTensor>& model,
                      std::map<std::string, std::vector<int>>* covered = nullptr) {
  SCOPED_TRACE("spec of " + (spec.pieces.empty() ? std::string() : spec.pieces[0].hf_name));
  ASSERT_OK(spec.Validate());
  const std::vector<Mapped> map = ReferenceMap(spec);
  std::map<std::string, std::vector<bool>> held;
  for (const ShardPiece& p : spec.pieces) held[p.hf_name].assign(Numel(p.hf_shape), false);
  for (const Mapped& m : map) {
    ASSERT_NE(m.piece, SIZE_MAX) << "the reference finds an element in no piece";
    const ShardPiece& p = spec.pieces[m.piece];
    if (spec.contributes && p.contributes) held[p.hf_name][m.hf] = true;
  }
  const ChangeSet local = LocalDiff(spec, model);
  Result<std::vector<TensorChanges>> got = TranslateChanges(spec, local);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), held.size());
  for (const TensorChanges& tc : *got) {
    SCOPED_TRACE("tensor " + tc.name);
    ASSERT_TRUE(held.count(tc.name));
    EXPECT_TRUE(SameChanges(tc.changes, WholeDiff(Find(model, tc.name), &held[tc.name])));
    if (covered != nullptr) {
      std::vector<int>& c = (*covered)[tc.name];
      c.resize(held[tc.name].size());
      for (size_t i = 0; i < c.size(); ++i) c[i] += held[tc.name][i];
    }
  }
}

// Every element of every tensor covered exactly once.
void ExpectCoveredOnce(const std::map<std::string, std::vector<int>>& covered) {
  for (const auto& [name, c] : covered) {
    for (size_t i = 0; i < c.size(); ++i) {
      ASSERT_EQ(c[i], 1) << name << " element " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// Placements and their translation.

TEST(ShardTranslate, Whole) {
  std::vector<HfTensor> model = {
      MakeTensor("w", DType::kBF16, {7, 5}, 1), MakeTensor("s", DType::kF32, {}, 2),
      MakeTensor("v", DType::kU8, {13}, 3), MakeTensor("c", DType::kF64, {3, 4, 5}, 4)};
  for (size_t i = 0; i < model.size(); ++i) MutateRandom(&model[i], 0.4, 10 + i);
  uint64_t seed = 5;
  Mutate(&model[1], 0, seed);  // the scalar changes
  for (const HfTensor& t : model) {
    const ShardSpec spec = Value(ShardSpec::Whole(t.name, t.dtype, t.shape));
    EXPECT_EQ(spec.local_shape, t.shape);
    CheckTranslation(spec, model);
  }
}

TEST(ShardTranslate, ShardDim0LikeTorchChunk) {
  std::vector<HfTensor> model = {MakeTensor("a", DType::kBF16, {10, 6}, 1),
                                 MakeTensor("b", DType::kU8, {5}, 2),
                                 MakeTensor("c", DType::kF32, {2, 3}, 3)};
  for (size_t i = 0; i < model.size(); ++i) MutateRandom(&model[i], 0.35, 20 + i);
  // torch.chunk(x, 4, dim=0) sizes: ceil(10/4) = 3 -> 3, 3, 3, 1; ceil(5/4) =
  // 2 -> 2, 2, 1 and an empty fourth (FSDP2 pads); 2 rows -> 1, 1, 0, 0.
  const std::vector<std::vector<int64_t>> want = {{3, 3, 3, 1}, {2, 2, 1, 0}, {1, 1, 0, 0}};
  std::map<std::string, std::vector<int>> covered;
  for (size_t t = 0; t < model.size(); ++t) {
    for (int r = 0; r < 4; ++r) {
      const ShardSpec spec =
          Value(ShardSpec::Shard(model[t].name, model[t].dtype, model[t].shape, 0, r, 4));
      EXPECT_EQ(spec.local_shape[0], want[t][r]) << model[t].name << " shard " << r;
      CheckTranslation(spec, model, &covered);
    }
  }
  ExpectCoveredOnce(covered);
}

TEST(ShardTranslate, ShardDim1Uneven) {
  std::vector<HfTensor> model = {MakeTensor("o", DType::kF32, {6, 11}, 1),
                                 MakeTensor("t", DType::kBF16, {2, 9, 3}, 2)};
  MutateRandom(&model[0], 0.3, 3);
  MutateRandom(&model[1], 0.3, 4);
  std::map<std::string, std::vector<int>> covered;
  const std::vector<int64_t> sizes = {4, 0, 7};
  for (int r = 0; r < 3; ++r) {
    const ShardSpec spec = Value(ShardSpec::ShardSizes("o", DType::kF32, {6, 11}, -1, sizes, r));
    EXPECT_EQ(spec.local_shape, (std::vector<int64_t>{6, sizes[r]}));
    CheckTranslation(spec, model, &covered);
  }
  // The middle dimension of a 3-D tensor, torch.chunk style: 3, 3, 3.
  for (int r = 0; r < 3; ++r) {
    const ShardSpec spec = Value(ShardSpec::Shard("t", DType::kBF16, {2, 9, 3}, 1, r, 3));
    EXPECT_EQ(spec.local_shape, (std::vector<int64_t>{2, 3, 3}));
    CheckTranslation(spec, model, &covered);
  }
  ExpectCoveredOnce(covered);
}

TEST(ShardTranslate, TwoDimensionalBoxes) {
  std::vector<HfTensor> model = {MakeTensor("m", DType::kBF16, {8, 9}, 1)};
  MutateRandom(&model[0], 0.5, 2);
  std::map<std::string, std::vector<int>> covered;
  const int64_t rows[] = {0, 3, 8}, cols[] = {0, 2, 6, 9};
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      const ShardSpec spec = Value(ShardSpec::Box("m", DType::kBF16, {8, 9}, {rows[i], cols[j]},
                                                  {rows[i + 1] - rows[i], cols[j + 1] - cols[j]}));
      CheckTranslation(spec, model, &covered);
    }
  }
  ExpectCoveredOnce(covered);
}

TEST(ShardTranslate, FusedQkvAndGateUpWithTensorParallelism) {
  std::vector<HfTensor> model = {
      MakeTensor("q", DType::kBF16, {8, 6}, 1),  MakeTensor("k", DType::kBF16, {4, 6}, 2),
      MakeTensor("v", DType::kBF16, {4, 6}, 3),  MakeTensor("gate", DType::kF32, {6, 5}, 4),
      MakeTensor("up", DType::kF32, {6, 5}, 5),  MakeTensor("left", DType::kU8, {4, 3}, 6),
      MakeTensor("right", DType::kU8, {4, 5}, 7)};
  for (size_t i = 0; i < model.size(); ++i) MutateRandom(&model[i], 0.4, 30 + i);
  std::map<std::string, std::vector<int>> covered;
  for (int r = 0; r < 2; ++r) {
    std::vector<ShardSpec> qkv;
    for (const char* n : {"q", "k", "v"}) {
      const HfTensor& t = Find(model, n);
      qkv.push_back(Value(ShardSpec::Shard(t.name, t.dtype, t.shape, 0, r, 2)));
    }
    const ShardSpec fused = Value(ShardSpec::Fused(DType::kBF16, 0, qkv));
    EXPECT_EQ(fused.local_shape, (std::vector<int64_t>{8, 6}));
    CheckTranslation(fused, model, &covered);

    const ShardSpec gate_up =
        Value(ShardSpec::Fused(DType::kF32, 0,
                               {Value(ShardSpec::Shard("gate", DType::kF32, {6, 5}, 0, r, 2)),
                                Value(ShardSpec::Shard("up", DType::kF32, {6, 5}, 0, r, 2))}));
    EXPECT_EQ(gate_up.local_shape, (std::vector<int64_t>{6, 5}));
    CheckTranslation(gate_up, model, &covered);

    // Fused along the last dimension: the pieces alternate within each
    // row, and each part is a row shard.
    const ShardSpec lr =
        Value(ShardSpec::Fused(DType::kU8, -1,
                               {Value(ShardSpec::Shard("left", DType::kU8, {4, 3}, 0, r, 2)),
                                Value(ShardSpec::Shard("right", DType::kU8, {4, 5}, 0, r, 2))}));
    EXPECT_EQ(lr.local_shape, (std::vector<int64_t>{2, 8}));
    CheckTranslation(lr, model, &covered);
  }
  ExpectCoveredOnce(covered);
}

// Megatron's fused linear_qkv (megatron/core/transformer/attention.py,
// get_query_key_value_tensors, NVIDIA/Megatron-LM d98e8a64): the weight's
// rows hold, per query group, its query heads, then its key head, then its
// value head; ColumnParallelLinear gives each tensor-parallel rank an equal
// run of those rows. The expected HF element of every local element comes
// from that rule directly, not from the spec.
TEST(ShardTranslate, MegatronQkvInterleavesHeadsPerQueryGroup) {
  struct Case {
    int64_t heads, groups, head_dim, hidden, tp;
  };
  // Grouped-query attention split on group boundaries, more ranks than
  // groups (a rank's rows cut a group), multi-head attention.
  for (const Case c :
       {Case{8, 2, 4, 6, 2}, Case{8, 2, 4, 6, 4}, Case{8, 2, 2, 3, 8}, Case{4, 4, 3, 5, 2}}) {
    SCOPED_TRACE(std::to_string(c.heads) + " heads, " + std::to_string(c.groups) + " groups, tp " +
                 std::to_string(c.tp));
    const int64_t per_group = c.heads / c.groups;
    // The fused weight's rows as (tensor, HF row).
    std::vector<std::pair<std::string, int64_t>> fused_rows;
    for (int64_t g = 0; g < c.groups; ++g) {
      for (int64_t r = 0; r < per_group * c.head_dim; ++r) {
        fused_rows.push_back({"q", g * per_group * c.head_dim + r});
      }
      for (int64_t r = 0; r < c.head_dim; ++r) fused_rows.push_back({"k", g * c.head_dim + r});
      for (int64_t r = 0; r < c.head_dim; ++r) fused_rows.push_back({"v", g * c.head_dim + r});
    }
    const int64_t rows = static_cast<int64_t>(fused_rows.size()) / c.tp;
    std::vector<HfTensor> model = {
        MakeTensor("q", DType::kBF16, {c.heads * c.head_dim, c.hidden}, 1),
        MakeTensor("k", DType::kBF16, {c.groups * c.head_dim, c.hidden}, 2),
        MakeTensor("v", DType::kBF16, {c.groups * c.head_dim, c.hidden}, 3)};
    for (size_t i = 0; i < model.size(); ++i) MutateRandom(&model[i], 0.4, 60 + i);
    std::map<std::string, std::vector<int>> covered;
    for (int64_t r = 0; r < c.tp; ++r) {
      const ShardSpec spec = Value(ShardSpec::MegatronQkv("q", "k", "v", DType::kBF16, c.heads,
                                                          c.groups, c.head_dim, c.hidden, r, c.tp));
      ASSERT_EQ(spec.local_shape, (std::vector<int64_t>{rows, c.hidden}));
      const std::vector<Mapped> map = ReferenceMap(spec);
      for (int64_t e = 0; e < rows * c.hidden; ++e) {
        const auto& [name, hf_row] = fused_rows[r * rows + e / c.hidden];
        ASSERT_NE(map[e].piece, SIZE_MAX);
        EXPECT_EQ(spec.pieces[map[e].piece].hf_name, name) << "local element " << e;
        EXPECT_EQ(map[e].hf, static_cast<uint64_t>(hf_row * c.hidden + e % c.hidden))
            << "local element " << e;
      }
      CheckTranslation(spec, model, &covered);
    }
    ExpectCoveredOnce(covered);
  }
  const Status odd = ShardSpec::MegatronQkv("q", "k", "v", DType::kBF16, 8, 3, 4, 6, 0, 2).status();
  EXPECT_EQ(odd.code(), StatusCode::kInvalidArgument) << odd.ToString();
  EXPECT_NE(odd.message().find("not a multiple of 3 query groups"), std::string::npos)
      << odd.ToString();
  const Status uneven =
      ShardSpec::MegatronQkv("q", "k", "v", DType::kBF16, 8, 2, 4, 6, 0, 5).status();
  EXPECT_NE(uneven.message().find("48 rows do not split into 5 equal parts"), std::string::npos)
      << uneven.ToString();
  const Status rank =
      ShardSpec::MegatronQkv("q", "k", "v", DType::kBF16, 8, 2, 4, 6, 2, 2).status();
  EXPECT_EQ(rank.code(), StatusCode::kInvalidArgument) << rank.ToString();
}

TEST(ShardTranslate, FusedWithReplicatedPart) {
  // Key and value heads replicated over tensor-parallel ranks: rank 1's
  // copy does not contribute, its query shard does.
  std::vector<HfTensor> model = {MakeTensor("q", DType::kBF16, {8, 4}, 1),
                                 MakeTensor("kv", DType::kBF16, {2, 4}, 2)};
  MutateRandom(&model[0], 0.5, 3);
  MutateRandom(&model[1], 0.9, 4);
  std::map<std::string, std::vector<int>> covered;
  for (int r = 0; r < 2; ++r) {
    const ShardSpec spec = Value(ShardSpec::Fused(
        DType::kBF16, 0,
        {Value(ShardSpec::Shard("q", DType::kBF16, {8, 4}, 0, r, 2)),
         Value(ShardSpec::Replicate("kv", DType::kBF16, {2, 4}, /*contributes=*/r == 0))}));
    EXPECT_EQ(spec.pieces[1].contributes, r == 0);
    CheckTranslation(spec, model, &covered);
  }
  ExpectCoveredOnce(covered);
}

TEST(ShardTranslate, StackedExpertsOfExpertParallelRanks) {
  // 4 experts, gate and up [3, 4] each, as vLLM's w13 on 2 EP ranks: rank
  // r holds experts 2r and 2r + 1 as one [2, 6, 4] tensor, each expert's
  // gate rows then its up rows.
  std::vector<HfTensor> model;
  for (int e = 0; e < 4; ++e) {
    for (const char* part : {"gate_proj", "up_proj"}) {
      model.push_back(MakeTensor("mlp.experts." + std::to_string(e) + "." + part + ".weight",
                                 DType::kBF16, {3, 4}, 10 + e));
      MutateRandom(&model.back(), 0.4, 20 + e);
    }
  }
  std::map<std::string, std::vector<int>> covered;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::vector<std::string>> experts;
    for (int e = 2 * r; e < 2 * r + 2; ++e) {
      const std::string x = "mlp.experts." + std::to_string(e) + ".";
      experts.push_back({x + "gate_proj.weight", x + "up_proj.weight"});
    }
    const ShardSpec spec = Value(ShardSpec::StackedExperts(DType::kBF16, experts, {3, 4}));
    EXPECT_EQ(spec.local_shape, (std::vector<int64_t>{2, 6, 4}));
    // Local [1, 3, 0] is the second expert's first up row.
    ASSERT_EQ(spec.pieces.size(), 4u);
    EXPECT_EQ(spec.pieces[3].hf_name, experts[1][1]);
    EXPECT_EQ(spec.pieces[3].local_first, (1 * 6 + 3) * 4);
    CheckTranslation(spec, model, &covered);
  }
  ExpectCoveredOnce(covered);
  EXPECT_FALSE(ShardSpec::StackedExperts(DType::kBF16, {}, {3, 4}).ok());
  EXPECT_FALSE(ShardSpec::StackedExperts(DType::kBF16, {{"a", "b"}, {"c"}}, {3, 4}).ok());
  EXPECT_FALSE(ShardSpec::StackedExperts(DType::kBF16, {{"a"}, {"a"}}, {3, 4}).ok());
}

TEST(ShardTranslate, FlatRangesOfAnFsdp1FlatParameter) {
  // a (35 elements) and b (12) flattened back to back, padded to 48, and
  // split in 4 shards of 12: the last shard holds 11 real elements and one
  // of padding, which is not part of its local tensor.
  std::vector<HfTensor> model = {MakeTensor("a", DType::kBF16, {5, 7}, 1),
                                 MakeTensor("b", DType::kBF16, {3, 4}, 2)};
  MutateRandom(&model[0], 0.4, 3);
  MutateRandom(&model[1], 0.4, 4);
  std::map<std::string, std::vector<int>> covered;
  for (int64_t r = 0; r < 4; ++r) {
    const int64_t first = 12 * r, end = std::min<int64_t>(12 * r + 12, 47);
    std::vector<ShardSpec> parts;
    if (first < 35) {
      parts.push_back(Value(ShardSpec::FlatRange("a", DType::kBF16, {5, 7}, first,
                                                 std::min<int64_t>(end, 35) - first)));
    }
    if (end > 35) {
      const int64_t b_first = std::max<int64_t>(first, 35) - 35;
      parts.push_back(
          Value(ShardSpec::FlatRange("b", DType::kBF16, {3, 4}, b_first, end - 35 - b_first)));
    }
    const ShardSpec spec = Value(ShardSpec::Fused(DType::kBF16, 0, parts));
    EXPECT_EQ(spec.local_shape, (std::vector<int64_t>{end - first}));
    CheckTranslation(spec, model, &covered);
  }
  ExpectCoveredOnce(covered);
}

TEST(ShardTranslate, Replicate) {
  std::vector<HfTensor> model = {MakeTensor("norm", DType::kF32, {37}, 1)};
  MutateRandom(&model[0], 0.5, 2);
  const ShardSpec yes = Value(ShardSpec::Replicate("norm", DType::kF32, {37}, true));
  const ShardSpec no = Value(ShardSpec::Replicate("norm", DType::kF32, {37}, false));
  CheckTranslation(yes, model);
  CheckTranslation(no, model);
  const std::vector<TensorChanges> none = Value(TranslateChanges(no, LocalDiff(no, model)));
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0].name, "norm");
  EXPECT_EQ(none[0].changes.count(), 0u);
  EXPECT_EQ(none[0].changes.numel, 37u);
  EXPECT_GT(LocalDiff(no, model).count(), 0u);
}

TEST(ShardTranslate, BlockPlacementsMergeInHfOrder) {
  // One local tensor holding boxes of one HF tensor out of order: row
  // blocks swapped, and column blocks swapped (which interleaves the
  // pieces' changes within every HF row).
  std::vector<HfTensor> model = {MakeTensor("r", DType::kBF16, {4, 8}, 1),
                                 MakeTensor("c", DType::kF64, {4, 8}, 2)};
  MutateRandom(&model[0], 0.6, 3);
  MutateRandom(&model[1], 0.6, 4);
  ShardSpec rows;
  rows.dtype = DType::kBF16;
  rows.local_shape = {4, 8};
  rows.pieces = {ShardPiece::Box("r", {4, 8}, {0, 0}, {2, 0}, {2, 8}),
                 ShardPiece::Box("r", {4, 8}, {2, 0}, {0, 0}, {2, 8})};
  CheckTranslation(rows, model);
  ShardSpec cols;
  cols.dtype = DType::kF64;
  cols.local_shape = {4, 8};
  cols.pieces = {ShardPiece::Box("c", {4, 8}, {0, 0}, {0, 5}, {4, 3}),
                 ShardPiece::Box("c", {4, 8}, {0, 3}, {0, 2}, {4, 3}),
                 ShardPiece::Box("c", {4, 8}, {0, 6}, {0, 0}, {4, 2})};
  CheckTranslation(cols, model);
}

TEST(ShardTranslate, WidePositionsOfAHugeTensor) {
  // 2^33 elements: never materialised; the local boxes are small. The
  // reference maps each local change by coordinates.
  const std::vector<int64_t> shape = {int64_t{1} << 20, int64_t{1} << 13};
  ShardSpec spec;
  spec.dtype = DType::kBF16;
  spec.local_shape = {3, 100};
  spec.pieces = {ShardPiece::Box("huge", shape, {0, 0}, {700001, 8000}, {3, 60}),
                 ShardPiece::Box("huge", shape, {0, 60}, {5, 100}, {3, 40})};
  ASSERT_OK(spec.Validate());
  uint64_t seed = 9;
  std::vector<uint8_t> old_bytes(600), new_bytes;
  for (uint8_t& b : old_bytes) b = static_cast<uint8_t>(SplitMix(seed));
  new_bytes = old_bytes;
  for (size_t e = 0; e < 300; ++e) {
    if (SplitMix(seed) % 3 == 0) new_bytes[2 * e + 1] ^= 0x80;
  }
  const ChangeSet local = Diff(new_bytes, old_bytes, 2);
  ASSERT_FALSE(local.wide);
  const std::vector<Mapped> map = ReferenceMap(spec);
  std::map<uint64_t, uint64_t> want;  // HF position -> local element
  for (uint64_t k = 0; k < local.count(); ++k) want[map[local.position(k)].hf] = local.position(k);
  const std::vector<TensorChanges> got = Value(TranslateChanges(spec, local));
  ASSERT_EQ(got.size(), 1u);
  const ChangeSet& cs = got[0].changes;
  EXPECT_EQ(cs.numel, uint64_t{1} << 33);
  ASSERT_TRUE(cs.wide);
  ASSERT_EQ(cs.count(), want.size());
  size_t k = 0;
  for (const auto& [hf, e] : want) {
    ASSERT_EQ(cs.pos64[k], hf) << k;
    EXPECT_EQ(0, std::memcmp(&cs.new_values[2 * k], &new_bytes[2 * e], 2));
    EXPECT_EQ(0, std::memcmp(&cs.old_values[2 * k], &old_bytes[2 * e], 2));
    ++k;
  }
}

TEST(ShardTranslate, RefusesChangesThatDoNotFitTheSpec) {
  std::vector<HfTensor> model = {MakeTensor("w", DType::kBF16, {4, 4}, 1)};
  MutateRandom(&model[0], 0.5, 2);
  const ShardSpec spec = Value(ShardSpec::Shard("w", DType::kBF16, {4, 4}, 0, 1, 2));
  const ChangeSet good = LocalDiff(spec, model);
  ASSERT_GT(good.count(), 2u);
  auto refused = [&](ChangeSet c, const std::string& want) {
    const Result<std::vector<TensorChanges>> r = TranslateChanges(spec, c);
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("'w'"), std::string::npos) << r.status().message();
  };
  ChangeSet c = good;
  c.elem_size = 4;
  refused(c, "element size 4");
  c = good;
  c.numel = 16;
  refused(c, "numel 16");
  c = good;
  c.old_values.clear();
  refused(c, "keep_old_values");
  c = good;
  std::swap(c.pos32[0], c.pos32[1]);
  refused(c, "not strictly increasing");
  c = good;
  c.pos32.back() = 8;
  refused(c, "past its 8 elements");
  c = good;
  c.pos64.assign(c.pos32.begin(), c.pos32.end());
  refused(c, "wide");
  ShardSpec bad = spec;
  bad.local_shape = {3, 4};
  const Result<std::vector<TensorChanges>> r = TranslateChanges(bad, good);
  EXPECT_FALSE(r.ok());
}

// ---------------------------------------------------------------------------
// Validate and the factories' refusals.

void ExpectInvalid(const Status& s, const std::string& want) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(want), std::string::npos)
      << "want '" << want << "' in: " << s.message();
}
template <typename T>
void ExpectInvalid(const Result<T>& r, const std::string& want) {
  ExpectInvalid(r.status(), want);
}

ShardSpec TwoRowBoxes() {
  ShardSpec s;
  s.dtype = DType::kBF16;
  s.local_shape = {4, 6};
  s.pieces = {ShardPiece::Box("x", {8, 6}, {0, 0}, {0, 0}, {2, 6}),
              ShardPiece::Box("y", {2, 6}, {2, 0}, {0, 0}, {2, 6})};
  return s;
}

TEST(ShardValidate, AcceptsTheReferenceSpec) { ASSERT_OK(TwoRowBoxes().Validate()); }

TEST(ShardValidate, RefusesEachBrokenRule) {
  ShardSpec s = TwoRowBoxes();
  s.local_shape = {4, -6};
  ExpectInvalid(s.Validate(), "local tensor of 'x' has a negative dimension (-6 in dim 1)");

  s = TwoRowBoxes();
  s.local_shape.assign(17, 1);
  ExpectInvalid(s.Validate(), "17 dimensions, more than 16");

  s = TwoRowBoxes();
  s.pieces[0].hf_shape = {int64_t{1} << 30, int64_t{1} << 27};
  ExpectInvalid(s.Validate(), "tensor 'x' of shape [1073741824, 134217728] has more than 2^56");

  s = TwoRowBoxes();
  s.dtype = static_cast<DType>(99);
  ExpectInvalid(s.Validate(), "unknown dtype 99");

  s = TwoRowBoxes();
  s.pieces[1].hf_name.clear();
  ExpectInvalid(s.Validate(), "piece 1: empty HF tensor name");

  s = TwoRowBoxes();
  s.pieces[1].hf_name.assign(1025, 'n');
  ExpectInvalid(s.Validate(), "1025 bytes, more than 1024");

  s = TwoRowBoxes();
  s.pieces[1].extent = {2, 6, 1};
  ExpectInvalid(s.Validate(),
                "tensor 'y', piece 1: a box needs the local tensor's number of "
                "dimensions (2)");

  s = TwoRowBoxes();
  s.pieces[1].local_offset = {2, 1};
  ExpectInvalid(s.Validate(),
                "tensor 'y', piece 1 extends past the local tensor in dim 1 (offset 1 + extent 6 "
                "> 6)");

  s = TwoRowBoxes();
  s.pieces[0].hf_offset = {7, 0};
  ExpectInvalid(
      s.Validate(),
      "tensor 'x', piece 0 extends past the HF tensor in dim 0 (offset 7 + extent 2 > 8)");

  s = TwoRowBoxes();
  s.pieces[0].local_offset = {-1, 0};
  ExpectInvalid(s.Validate(), "negative local offset or extent in dim 0");

  s = TwoRowBoxes();
  s.pieces[1].local_offset = {1, 0};
  ExpectInvalid(s.Validate(), "tensor 'x', piece 0 and piece 1 (tensor 'y') overlap in the local");

  s = TwoRowBoxes();
  s.pieces[1] = ShardPiece::Box("x", {8, 6}, {2, 0}, {1, 0}, {2, 6});
  ExpectInvalid(s.Validate(), "tensor 'x', piece 0 and piece 1 overlap in the HF tensor");

  s = TwoRowBoxes();
  s.pieces[1].extent = {1, 6};
  ExpectInvalid(s.Validate(), "the pieces cover 18 of its 24 elements");

  s = TwoRowBoxes();
  s.pieces.clear();
  ExpectInvalid(s.Validate(), "local tensor of (no pieces) (shape [4, 6]): the pieces cover 0");

  s = TwoRowBoxes();
  s.pieces[1] = ShardPiece::Box("x", {8, 5}, {2, 0}, {4, 0}, {2, 6});
  ExpectInvalid(s.Validate(), "tensor 'x', piece 1: shape [8, 5] differs from piece 0's [8, 6]");

  s = TwoRowBoxes();
  s.pieces[1] = ShardPiece::Flat("y", {12}, 12, 0, 12);
  ExpectInvalid(s.Validate(), "a flat range among pieces of the other kind");
}

TEST(ShardValidate, RefusesBadFlatRanges) {
  ShardSpec s;
  s.dtype = DType::kU8;
  s.local_shape = {10};
  s.pieces = {ShardPiece::Flat("a", {20}, 0, 5, 6), ShardPiece::Flat("b", {4}, 6, 0, 4)};
  ASSERT_OK(s.Validate());
  ShardSpec t = s;
  t.pieces[1].local_first = 7;
  ExpectInvalid(t.Validate(), "flat range [7, +4) extends past the local tensor's 10 elements");
  t = s;
  t.pieces[1].hf_first = 1;
  ExpectInvalid(t.Validate(), "flat range [1, +4) extends past the HF tensor's 4 elements");
  t = s;
  t.pieces[0].count = -1;
  ExpectInvalid(t.Validate(), "negative flat range");
  t = s;
  t.pieces[1].local_first = 5;
  t.pieces[1].count = 5;
  t.pieces[1].hf_shape = {5};
  ExpectInvalid(t.Validate(), "overlap in the local tensor");
  t = s;
  t.pieces[1] = ShardPiece::Flat("a", {20}, 6, 10, 4);
  ExpectInvalid(t.Validate(), "overlap in the HF tensor");
}

TEST(ShardValidate, FactoriesRefuseBadArguments) {
  ExpectInvalid(ShardSpec::Shard("w", DType::kBF16, {8, 4}, 0, 4, 4), "shard 4 of 4");
  ExpectInvalid(ShardSpec::Shard("w", DType::kBF16, {8, 4}, 0, 0, 0), "shard 0 of 0");
  ExpectInvalid(ShardSpec::Shard("w", DType::kBF16, {8, 4}, 2, 0, 2),
                "tensor 'w': dim 2 out of range for shape [8, 4]");
  ExpectInvalid(ShardSpec::Shard("w", DType::kBF16, {8, -4}, 0, 0, 2), "negative dimension");
  ExpectInvalid(ShardSpec::ShardSizes("w", DType::kBF16, {8, 4}, 0, {3, 4}, 0),
                "sizes [3, 4] sum to 7, not dim 0's 8");
  ExpectInvalid(ShardSpec::ShardSizes("w", DType::kBF16, {8, 4}, 0, {9, -1}, 0),
                "do not split dim 0");
  ExpectInvalid(ShardSpec::ShardSizes("w", DType::kBF16, {8, 4}, 0, {8}, 1), "part 1 of 1");
  ExpectInvalid(ShardSpec::Box("w", DType::kBF16, {8, 4}, {4, 0}, {5, 4}),
                "extends past the HF tensor in dim 0");
  ExpectInvalid(ShardSpec::FlatRange("w", DType::kBF16, {8, 4}, 30, 3),
                "flat range [30, +3) extends past the HF tensor's 32 elements");
  ExpectInvalid(ShardSpec::Fused(DType::kBF16, 0, {}), "no parts");
  const ShardSpec a = Value(ShardSpec::Whole("a", DType::kBF16, {2, 4}));
  const ShardSpec b = Value(ShardSpec::Whole("b", DType::kBF16, {2, 5}));
  const ShardSpec c = Value(ShardSpec::Whole("c", DType::kF32, {2, 4}));
  ExpectInvalid(ShardSpec::Fused(DType::kBF16, 0, {a, b}),
                "fused tensor of 'a', part 1 ('b'): shape [2, 5] does not concatenate with [2, 4] "
                "along dim 0");
  ExpectInvalid(ShardSpec::Fused(DType::kBF16, 0, {a, c}), "dtype F32, not BF16");
  ExpectInvalid(ShardSpec::Fused(DType::kBF16, 2, {a, a}), "dim 2 out of range");
  const ShardSpec f = Value(ShardSpec::FlatRange("f", DType::kBF16, {8}, 0, 8));
  ShardSpec f2 = f;
  f2.local_shape = {2, 4};
  ExpectInvalid(ShardSpec::Fused(DType::kBF16, 0, {f2, f2}), "flat ranges fuse only into 1-D");
  // The same HF tensor twice in one fused tensor: overlapping in the HF
  // tensor.
  ExpectInvalid(ShardSpec::Fused(DType::kBF16, 0, {a, a}), "overlap in the HF tensor");
}

// ---------------------------------------------------------------------------
// The gather's wire layout and rank 0's checks, over a scripted
// communicator: the bytes are built here from docs/format.md.

class ScriptedCommunicator : public Communicator {
 public:
  ScriptedCommunicator(int rank, int size) : records(size), rank_(rank), size_(size) {}
  std::string_view name() const override { return "scripted"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t generation() const override { return 0; }
  CommunicatorCapabilities capabilities() const override {
    CommunicatorCapabilities c;
    c.host_buffers = c.point_to_point = c.checks_sizes = true;
    return c;
  }
  milliseconds timeout() const override { return milliseconds(1000); }
  Status health() const override { return Status::OK(); }
  Status Send(int peer, std::span<const uint8_t> data) override {
    sent.push_back({peer, std::vector<uint8_t>(data.begin(), data.end())});
    return Status::OK();
  }
  Status Recv(int peer, std::span<uint8_t> data) override {
    auto it = payloads.find(peer);
    if (it == payloads.end())
      return Status::DeadlineExceeded("nothing from " + std::to_string(peer));
    if (it->second.size() != data.size()) {
      return Status::InvalidArgument("peer sent " + std::to_string(it->second.size()) +
                                     " bytes; this rank expects " + std::to_string(data.size()));
    }
    std::memcpy(data.data(), it->second.data(), data.size());
    received.push_back(peer);
    payloads.erase(it);
    return Status::OK();
  }
  Status Broadcast(int, std::span<uint8_t>) override { return Status::Unsupported("scripted"); }
  Status Barrier() override { return Status::Unsupported("scripted"); }
  void Cancel(std::string_view) override {}
  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override {
    gathered.assign(record.begin(), record.end());
    if (rank_ != root) return Status::OK();
    if (out.size() != record.size() * size_) return Status::InvalidArgument("gather out size");
    for (int r = 0; r < size_; ++r) {
      const std::vector<uint8_t>& rec = r == rank_ ? gathered : records[r];
      if (rec.size() != record.size()) return Status::InvalidArgument("scripted record size");
      std::memcpy(out.data() + r * record.size(), rec.data(), rec.size());
    }
    return Status::OK();
  }
  Status AllGather(std::span<const uint8_t>, std::span<uint8_t>) override {
    return Status::Unsupported("scripted");
  }

  std::vector<std::vector<uint8_t>> records;     // what the other ranks gather (root)
  std::map<int, std::vector<uint8_t>> payloads;  // what they send (root)
  std::vector<uint8_t> gathered;                 // this rank's record
  std::vector<std::pair<int, std::vector<uint8_t>>> sent;
  std::vector<int> received;

 private:
  int rank_, size_;
};

void Le(std::vector<uint8_t>* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// The batch key, built from the table in docs/format.md.
uint64_t KeyOf(const std::vector<GatherTensor>& list) {
  std::vector<uint8_t> enc;
  for (const GatherTensor& t : list) {
    Le(&enc, t.name.size(), 2);
    enc.insert(enc.end(), t.name.begin(), t.name.end());
    enc.push_back(static_cast<uint8_t>(t.dtype));  // the wire codes are the enum's order
    enc.push_back(static_cast<uint8_t>(t.shape.size()));
    for (int64_t d : t.shape) Le(&enc, d, 8);
  }
  uint64_t key = 0;
  for (uint8_t b : ChecksumBytes(ChecksumAlgo::kXxh3_64, enc)) key = key << 8 | b;
  return key;
}

std::vector<uint8_t> RecordOf(uint32_t flags, uint64_t batch, uint64_t key, uint64_t m,
                              uint64_t bytes) {
  std::vector<uint8_t> r = {'D', 'S', 'S', 'G'};
  Le(&r, flags, 4);
  Le(&r, batch, 8);
  Le(&r, key, 8);
  Le(&r, m, 8);
  Le(&r, bytes, 8);
  return r;
}

// One tensor's part of a payload.
struct Part {
  uint32_t index;
  std::vector<uint64_t> positions;
  std::vector<uint8_t> new_values, old_values;
};

std::vector<uint8_t> PayloadOf(const std::vector<Part>& parts,
                               const std::vector<uint32_t>& widths) {
  std::vector<uint8_t> p;
  for (const Part& part : parts) {
    Le(&p, part.index, 4);
    Le(&p, 0, 4);
    Le(&p, part.positions.size(), 8);
  }
  for (const Part& part : parts) {
    for (uint64_t pos : part.positions) Le(&p, pos, widths[part.index]);
    p.insert(p.end(), part.new_values.begin(), part.new_values.end());
    p.insert(p.end(), part.old_values.begin(), part.old_values.end());
  }
  return p;
}

TensorChanges Changes(std::string name, uint64_t numel, uint32_t w, std::vector<uint64_t> pos,
                      std::vector<uint8_t> nv, std::vector<uint8_t> ov) {
  TensorChanges tc;
  tc.name = std::move(name);
  tc.changes.numel = numel;
  tc.changes.elem_size = w;
  tc.changes.wide = numel > UINT32_MAX;
  if (tc.changes.wide) {
    tc.changes.pos64 = pos;
  } else {
    tc.changes.pos32.assign(pos.begin(), pos.end());
  }
  tc.changes.new_values = std::move(nv);
  tc.changes.old_values = std::move(ov);
  return tc;
}

// a: BF16 [3, 4] (12 elements, W 4); b: U8 [10]; h: F32 of 2^33 (W 8).
const std::vector<GatherTensor> kList = {{"a", DType::kBF16, {3, 4}},
                                         {"b", DType::kU8, {10}},
                                         {"h", DType::kF32, {int64_t{1} << 23, 1024}}};
const std::vector<uint32_t> kWidths = {4, 4, 8};

TEST(ShardGatherWire, ASenderWritesTheDocumentedBytes) {
  ScriptedCommunicator c(1, 2);
  // Two entries of b (merged), one of h; none of a.
  const std::vector<TensorChanges> mine = {
      Changes("b", 10, 1, {7}, {0x77}, {0x70}),
      Changes("h", uint64_t{1} << 33, 4, {uint64_t{1} << 32 | 5}, {1, 2, 3, 4}, {5, 6, 7, 8}),
      Changes("b", 10, 1, {2}, {0x22}, {0x20})};
  const Result<std::vector<TensorChanges>> r = GatherChanges(c, 42, kList, mine);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->empty());
  const std::vector<uint8_t> payload =
      PayloadOf({{1, {2, 7}, {0x22, 0x77}, {0x20, 0x70}},
                 {2, {uint64_t{1} << 32 | 5}, {1, 2, 3, 4}, {5, 6, 7, 8}}},
                kWidths);
  ASSERT_EQ(payload.size(), 16u * 2 + 2 * (4 + 2) + 1 * (8 + 8));
  EXPECT_EQ(c.gathered, RecordOf(0, 42, KeyOf(kList), 2, payload.size()));
  ASSERT_EQ(c.sent.size(), 1u);
  EXPECT_EQ(c.sent[0].first, 0);
  EXPECT_EQ(c.sent[0].second, payload);
  EXPECT_EQ(Value(GatherBatchKey(kList)), KeyOf(kList));
}

TEST(ShardGatherWire, ASenderWithNothingSendsNoPayload) {
  ScriptedCommunicator c(2, 3);
  const std::vector<TensorChanges> mine = {Changes("a", 12, 2, {}, {}, {})};
  ASSERT_TRUE(GatherChanges(c, 7, kList, mine).ok());
  EXPECT_EQ(c.gathered, RecordOf(0, 7, KeyOf(kList), 0, 0));
  EXPECT_TRUE(c.sent.empty());
}

TEST(ShardGatherWire, ASenderRefusesBadChangesAndSendsNothing) {
  const std::vector<std::pair<std::vector<TensorChanges>, std::string>> cases = {
      {{Changes("zz", 12, 2, {1}, {1, 1}, {2, 2})}, "changes of tensor 'zz': not in the batch"},
      {{Changes("a", 12, 4, {1}, {1, 1, 1, 1}, {2, 2, 2, 2})}, "element size 4 and numel 12"},
      {{Changes("a", 13, 2, {1}, {1, 1}, {2, 2})}, "numel 13"},
      {{Changes("a", 12, 2, {3, 3}, {1, 1, 1, 1}, {2, 2, 2, 2})}, "position 3 at index 1"},
      {{Changes("a", 12, 2, {12}, {1, 1}, {2, 2})}, "position 12 at index 0"},
      {{Changes("a", 12, 2, {1}, {1, 1}, {})}, "2 bytes of new and 0 of old"},
      {{Changes("a", 12, 2, {1}, {1, 1}, {2, 2}), Changes("a", 12, 2, {1}, {3, 3}, {2, 2})},
       "tensor 'a': position 1 is in the changes of entry 0 and of entry 1"},
  };
  for (const auto& [mine, want] : cases) {
    ScriptedCommunicator c(1, 2);
    const Result<std::vector<TensorChanges>> r = GatherChanges(c, 7, kList, mine);
    ExpectInvalid(r, want);
    EXPECT_EQ(c.gathered, RecordOf(1, 7, KeyOf(kList), 0, 0)) << want;
    EXPECT_TRUE(c.sent.empty()) << want;
  }
  TensorChanges wide_wrong = Changes("a", 12, 2, {1}, {1, 1}, {2, 2});
  wide_wrong.changes.wide = true;
  wide_wrong.changes.pos64 = {1};
  wide_wrong.changes.pos32.clear();
  ScriptedCommunicator c(1, 2);
  const std::vector<TensorChanges> wide_mine = {wide_wrong};
  ExpectInvalid(GatherChanges(c, 7, kList, wide_mine), "positions not in pos32");
  std::vector<GatherTensor> twice = {kList[0], kList[0]};
  ScriptedCommunicator d(1, 2);
  ExpectInvalid(GatherChanges(d, 7, twice, {}), "tensor 'a' is listed twice");
  EXPECT_EQ(d.gathered, RecordOf(1, 7, KeyOf(twice), 0, 0));
}

// Rank 0 of 3 with scripted ranks 1 and 2.
struct Root {
  ScriptedCommunicator c{0, 3};
  std::vector<TensorChanges> mine;
  uint64_t batch = 9;
  Root() {
    // Valid defaults: rank 1 sends b {1, 4}, rank 2 sends a {0} and b {3}.
    Set(1, PayloadOf({{1, {1, 4}, {11, 14}, {1, 4}}}, kWidths), 1);
    Set(2, PayloadOf({{0, {0}, {0xA0, 0xA1}, {0xB0, 0xB1}}, {1, {3}, {13}, {3}}}, kWidths), 2);
  }
  // Rank r's record announces `m` tensors and the payload's size.
  void Set(int r, std::vector<uint8_t> payload, uint64_t m) {
    c.records[r] = RecordOf(0, batch, KeyOf(kList), m, payload.size());
    c.payloads[r] = std::move(payload);
  }
  Result<std::vector<TensorChanges>> Run() { return GatherChanges(c, batch, kList, mine); }
};

TEST(ShardGatherWire, RootMergesRanksInPositionOrder) {
  Root root;
  root.mine = {Changes("b", 10, 1, {0, 2, 9}, {10, 12, 19}, {0, 2, 9})};
  const std::vector<TensorChanges> got = Value(root.Run());
  EXPECT_EQ(root.c.received, (std::vector<int>{1, 2}));
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].name, "a");
  EXPECT_TRUE(
      SameChanges(got[0].changes, Changes("a", 12, 2, {0}, {0xA0, 0xA1}, {0xB0, 0xB1}).changes));
  EXPECT_TRUE(SameChanges(got[1].changes, Changes("b", 10, 1, {0, 1, 2, 3, 4, 9},
                                                  {10, 11, 12, 13, 14, 19}, {0, 1, 2, 3, 4, 9})
                                              .changes));
  EXPECT_EQ(got[2].name, "h");
  EXPECT_EQ(got[2].changes.numel, uint64_t{1} << 33);
  EXPECT_TRUE(got[2].changes.wide);
  EXPECT_EQ(got[2].changes.count(), 0u);
}

// Runs root with rank `r`'s record or payload changed by `edit`, and checks
// the error and that every well-announced payload was still received.
void ExpectRootRefuses(const std::function<void(Root*)>& edit, StatusCode code,
                       const std::string& want, std::vector<int> received = {1, 2}) {
  SCOPED_TRACE(want);
  Root root;
  edit(&root);
  const Result<std::vector<TensorChanges>> r = root.Run();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  EXPECT_EQ(root.c.received, received);
}

TEST(ShardGatherWire, RootRefusesBadRecords) {
  ExpectRootRefuses([](Root* r) { r->c.records[1][0] = 'X'; }, StatusCode::kCorruption,
                    "rank 1 sent a gather record that is not one (bad magic)", {2});
  ExpectRootRefuses([](Root* r) { r->c.records[2][4] = 2; }, StatusCode::kCorruption,
                    "rank 2 sent unknown gather flags 2");
  ExpectRootRefuses(
      [](Root* r) {
        r->c.records[1] = RecordOf(1, r->batch, KeyOf(kList), 0, 0);
        r->c.payloads.erase(1);
      },
      StatusCode::kInvalidArgument, "rank 1 refused its own changes", {2});
  ExpectRootRefuses([](Root* r) { r->c.records[1] = RecordOf(0, 8, KeyOf(kList), 1, 28); },
                    StatusCode::kInvalidArgument, "rank 1 gathers batch 8, rank 0 batch 9");
  ExpectRootRefuses(
      [](Root* r) {
        r->c.records[2] = RecordOf(0, r->batch, KeyOf({kList[0]}), 2, r->c.payloads[2].size());
      },
      StatusCode::kInvalidArgument, "rank 2 gathers batch 9 with a different tensor list");
  ExpectRootRefuses([](Root* r) { r->c.records[1] = RecordOf(0, r->batch, KeyOf(kList), 4, 28); },
                    StatusCode::kCorruption, "rank 1 announces 4 tensors in 28 bytes");
  ExpectRootRefuses(
      [](Root* r) {
        r->c.records[1] = RecordOf(0, r->batch, KeyOf(kList), 1, 0);
        r->c.payloads.erase(1);
      },
      StatusCode::kCorruption, "rank 1 announces 1 tensors in 0 bytes", {2});
  // 16 * 3 + 12 * (4 + 4) + 10 * (4 + 2) + 2^33 * (8 + 8).
  const uint64_t bound = 48 + 96 + 60 + (uint64_t{1} << 37);
  ExpectRootRefuses(
      [&](Root* r) { r->c.records[2] = RecordOf(0, r->batch, KeyOf(kList), 2, bound + 1); },
      StatusCode::kCorruption,
      "rank 2 announces a payload of " + std::to_string(bound + 1) +
          " bytes, more than the batch can hold (" + std::to_string(bound) + ")",
      {1});
  // A refusal by rank 0 itself still lets every payload in.
  ExpectRootRefuses([](Root* r) { r->mine = {Changes("zz", 1, 1, {0}, {1}, {2})}; },
                    StatusCode::kInvalidArgument, "rank 0: changes of tensor 'zz': not in");
}

TEST(ShardGatherWire, RootRefusesBadPayloads) {
  auto payload = [](std::vector<uint8_t> p, int m) { return [p, m](Root* r) { r->Set(1, p, m); }; };
  std::vector<uint8_t> p = PayloadOf({{1, {1, 4}, {11, 14}, {1, 4}}}, kWidths);
  std::vector<uint8_t> q = p;
  q[0] = 3;  // tensor index 3 of 3
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption,
                    "rank 1's payload: index record 0 names tensor 3 (indices strictly increase, "
                    "below 3)");
  q = PayloadOf({{1, {1}, {11}, {1}}, {1, {4}, {14}, {4}}}, kWidths);
  ExpectRootRefuses(payload(q, 2), StatusCode::kCorruption, "index record 1 names tensor 1");
  q = p;
  q[4] = 1;
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption,
                    "index record 0: reserved bytes are not 0");
  q = PayloadOf({{1, {}, {}, {}}}, kWidths);
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption,
                    "tensor 'b': 0 changes (1 to numel 10)");
  q = PayloadOf(
      {{1, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, std::vector<uint8_t>(11), std::vector<uint8_t>(11)}},
      kWidths);
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption, "11 changes (1 to numel 10)");
  q = p;
  q.push_back(0);
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption,
                    "rank 1's payload: 29 bytes, its index records give 28");
  q = PayloadOf({{1, {4, 1}, {11, 14}, {1, 4}}}, kWidths);
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption,
                    "tensor 'b': the positions of rank 1 are not strictly increasing (1 after 4 "
                    "at index 1)");
  q = PayloadOf({{1, {1, 10}, {11, 14}, {1, 4}}}, kWidths);
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption,
                    "tensor 'b': position 10 of rank 1 is past the tensor's 10 elements");
  q = PayloadOf({{1, {12}, {11}, {1}}}, kWidths);
  ExpectRootRefuses(payload(q, 1), StatusCode::kCorruption, "position 12 of rank 1 is past");
  q = PayloadOf({{1, {1, 3}, {11, 14}, {1, 4}}}, kWidths);
  ExpectRootRefuses(payload(q, 1), StatusCode::kInvalidArgument,
                    "tensor 'b': position 3 is in the changes of rank 1 and of rank 2 "
                    "(overlapping shards)");
}

// ---------------------------------------------------------------------------
// The gather over gloo: 4 trainer ranks as threads, each diffing its own
// shards, against DiffTensor of the whole tensors.

constexpr int kRanks = 4;

// The model every rank holds parts of, and the ranks' placements.
struct Trainer {
  std::vector<HfTensor> model;
  std::vector<GatherTensor> list;

  Trainer() {
    model = {MakeTensor("embed", DType::kBF16, {50, 12}, 1),
             MakeTensor("o_proj", DType::kF32, {10, 23}, 2),
             MakeTensor("norm", DType::kBF16, {37}, 3),
             MakeTensor("q", DType::kBF16, {16, 8}, 4),
             MakeTensor("k", DType::kBF16, {8, 8}, 5),
             MakeTensor("v", DType::kBF16, {8, 8}, 6),
             MakeTensor("gate", DType::kF64, {12, 6}, 7),
             MakeTensor("up", DType::kF64, {12, 6}, 8),
             MakeTensor("bias", DType::kU8, {5}, 9)};
    // Listed in an order of its own.
    for (const char* n : {"up", "norm", "embed", "bias", "v", "q", "o_proj", "gate", "k"}) {
      const HfTensor& t = Find(model, n);
      list.push_back({t.name, t.dtype, t.shape});
    }
  }

  // Rank r's local tensors; with `overlap`, rank 1 also contributes norm.
  std::vector<ShardSpec> Specs(int r, bool overlap = false) const {
    std::vector<ShardSpec> s;
    s.push_back(Value(ShardSpec::Shard("embed", DType::kBF16, {50, 12}, 0, r, kRanks)));
    s.push_back(Value(ShardSpec::ShardSizes("o_proj", DType::kF32, {10, 23}, 1, {7, 0, 10, 6}, r)));
    s.push_back(
        Value(ShardSpec::Replicate("norm", DType::kBF16, {37}, r == 2 || (overlap && r == 1))));
    s.push_back(Value(
        ShardSpec::Fused(DType::kBF16, 0,
                         {Value(ShardSpec::Shard("q", DType::kBF16, {16, 8}, 0, r, kRanks)),
                          Value(ShardSpec::Shard("k", DType::kBF16, {8, 8}, 0, r, kRanks)),
                          Value(ShardSpec::Shard("v", DType::kBF16, {8, 8}, 0, r, kRanks))})));
    s.push_back(Value(
        ShardSpec::Fused(DType::kF64, 0,
                         {Value(ShardSpec::Shard("gate", DType::kF64, {12, 6}, 0, r, kRanks)),
                          Value(ShardSpec::Shard("up", DType::kF64, {12, 6}, 0, r, kRanks))})));
    s.push_back(Value(ShardSpec::Shard("bias", DType::kU8, {5}, 0, r, kRanks)));
    return s;
  }

  // What rank r passes to the gather: each local tensor diffed and
  // translated.
  Status Translate(int r, bool overlap, std::vector<TensorChanges>* out) const {
    out->clear();
    for (const ShardSpec& spec : Specs(r, overlap)) {
      DS_ASSIGN_OR_RETURN(std::vector<TensorChanges> tc,
                          TranslateChanges(spec, LocalDiff(spec, model)));
      for (TensorChanges& t : tc) out->push_back(std::move(t));
    }
    return Status::OK();
  }

  // New values only where rank r's contributing pieces hold elements.
  void MutateOnlyRank(int r, uint64_t seed) {
    for (HfTensor& t : model) t.new_bytes = t.old_bytes;
    for (const ShardSpec& spec : Specs(r)) {
      const std::vector<Mapped> map = ReferenceMap(spec);
      for (const Mapped& m : map) {
        const ShardPiece& p = spec.pieces[m.piece];
        if (spec.contributes && p.contributes && SplitMix(seed) % 2 == 0) {
          HfTensor* t = nullptr;
          for (HfTensor& u : model) {
            if (u.name == p.hf_name) t = &u;
          }
          Mutate(t, m.hf, seed);
        }
      }
    }
  }
};

class ShardGatherGloo : public ::testing::Test {
 protected:
  void SetUp() override {
#if !DS_HAVE_GLOO
    GTEST_SKIP() << "built without Gloo (DELTASYNC_WITH_GLOO)";
#else
    std::vector<Status> errors;
    comms_ = comm_test::FormInThreads(
        kRanks,
        [&](int r) {
          return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir_.path()), r, kRanks,
                                            milliseconds(10000), "shard");
        },
        &errors);
    for (const Status& s : errors) ASSERT_TRUE(s.ok()) << s.ToString();
#endif
  }

  // Every rank gathers batch `batch`: rank r passes inputs[r] (and its list
  // from lists[r] when given). Results by rank.
  std::vector<Result<std::vector<TensorChanges>>> Gather(
      uint64_t batch, const std::vector<std::vector<TensorChanges>>& inputs,
      const std::vector<GatherTensor>& list,
      const std::vector<std::vector<GatherTensor>>* lists = nullptr,
      const std::vector<uint64_t>* batches = nullptr) {
    std::vector<Result<std::vector<TensorChanges>>> out(kRanks, Status::Internal("did not run"));
    comm_test::OnEveryRank(kRanks, [&](int r) {
      out[r] = GatherChanges(*comms_[r], batches ? (*batches)[r] : batch,
                             lists ? (*lists)[r] : list, inputs[r], Status::OK(), pool_);
      return Status::OK();
    });
    return out;
  }

  std::vector<std::vector<TensorChanges>> Inputs(const Trainer& t, bool overlap = false) {
    std::vector<std::vector<TensorChanges>> in(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      const Status s = t.Translate(r, overlap, &in[r]);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    return in;
  }

  // Rank 0's result equals DiffTensor of each whole tensor, the others'
  // are empty.
  void ExpectWholeDiffs(const Trainer& t,
                        const std::vector<Result<std::vector<TensorChanges>>>& got) {
    for (int r = 1; r < kRanks; ++r) {
      ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r].status().ToString();
      EXPECT_TRUE(got[r]->empty());
    }
    ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
    ASSERT_EQ(got[0]->size(), t.list.size());
    for (size_t i = 0; i < t.list.size(); ++i) {
      SCOPED_TRACE(t.list[i].name);
      EXPECT_EQ((*got[0])[i].name, t.list[i].name);
      EXPECT_TRUE(SameChanges((*got[0])[i].changes, WholeDiff(Find(t.model, t.list[i].name))));
    }
  }

  comm_test::TempDir dir_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  ThreadPool* pool_ = nullptr;  // rank 0 merges on it when set
};

TEST_F(ShardGatherGloo, RankZeroGetsTheWholeTensorsDiffs) {
  Trainer t;
  for (size_t i = 0; i < t.model.size(); ++i) MutateRandom(&t.model[i], 0.3, 100 + i);
  std::vector<std::vector<TensorChanges>> in = Inputs(t);
  ExpectWholeDiffs(t, Gather(1, in, t.list));

  // Nothing changed: every result empty, nothing sent.
  for (HfTensor& h : t.model) h.new_bytes = h.old_bytes;
  ExpectWholeDiffs(t, Gather(2, Inputs(t), t.list));

  // Only rank 3 has changes (ranks 0 to 2 send nothing), then only rank 0.
  t.MutateOnlyRank(3, 7);
  in = Inputs(t);
  for (int r = 0; r < 3; ++r) {
    for (const TensorChanges& tc : in[r]) ASSERT_EQ(tc.changes.count(), 0u) << r;
  }
  ExpectWholeDiffs(t, Gather(3, in, t.list));
  t.MutateOnlyRank(0, 8);
  ExpectWholeDiffs(t, Gather(4, Inputs(t), t.list));

  // Every element changed.
  for (size_t i = 0; i < t.model.size(); ++i) MutateRandom(&t.model[i], 1.0, 200 + i);
  ExpectWholeDiffs(t, Gather(5, Inputs(t), t.list));
}

TEST_F(ShardGatherGloo, RankZeroMergesOnItsThreadsToTheSameListsAndErrors) {
  ThreadPool pool(4);
  pool_ = &pool;
  Trainer t;
  for (size_t i = 0; i < t.model.size(); ++i) MutateRandom(&t.model[i], 0.3, 500 + i);
  ExpectWholeDiffs(t, Gather(1, Inputs(t), t.list));
  for (size_t i = 0; i < t.model.size(); ++i) MutateRandom(&t.model[i], 1.0, 600 + i);
  ExpectWholeDiffs(t, Gather(2, Inputs(t), t.list));
  // The first bad tensor in list order is named, whichever thread found it.
  const std::vector<Result<std::vector<TensorChanges>>> got = Gather(3, Inputs(t, true), t.list);
  ExpectInvalid(got[0], "tensor 'norm': position ");
  ExpectWholeDiffs(t, Gather(4, Inputs(t), t.list));
}

TEST_F(ShardGatherGloo, OverlappingShardsFailOnRankZeroAndTheGroupGoesOn) {
  Trainer t;
  for (size_t i = 0; i < t.model.size(); ++i) MutateRandom(&t.model[i], 0.5, 300 + i);
  // Rank 1 contributes its replica of norm too.
  std::vector<Result<std::vector<TensorChanges>>> got = Gather(1, Inputs(t, true), t.list);
  ASSERT_FALSE(got[0].ok());
  ExpectInvalid(got[0], "tensor 'norm': position ");
  ExpectInvalid(got[0], " is in the changes of rank 1 and of rank 2 (overlapping shards)");
  for (int r = 1; r < kRanks; ++r) EXPECT_TRUE(got[r].ok()) << got[r].status().ToString();

  // A rank that refuses its own changes, one at another batch, one with
  // another list: rank 0 names it, every rank returns, and the next batch
  // works.
  std::vector<std::vector<TensorChanges>> in = Inputs(t);
  in[2].push_back(Changes("nope", 1, 1, {0}, {1}, {2}));
  got = Gather(2, in, t.list);
  ExpectInvalid(got[0], "rank 2 refused its own changes");
  ExpectInvalid(got[2], "changes of tensor 'nope': not in the batch");
  EXPECT_TRUE(got[1].ok() && got[3].ok());

  const std::vector<uint64_t> batches = {3, 3, 3, 4};
  got = Gather(3, Inputs(t), t.list, nullptr, &batches);
  ExpectInvalid(got[0], "rank 3 gathers batch 4, rank 0 batch 3");

  std::vector<std::vector<GatherTensor>> lists(kRanks, t.list);
  lists[1].pop_back();
  in = Inputs(t);
  std::erase_if(in[1], [&](const TensorChanges& c) { return c.name == t.list.back().name; });
  got = Gather(5, in, t.list, &lists);
  ExpectInvalid(got[0], "rank 1 gathers batch 5 with a different tensor list");

  ExpectWholeDiffs(t, Gather(6, Inputs(t), t.list));
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(comms_[r]->health().ok());
}

}  // namespace
}  // namespace deltasync::stream
