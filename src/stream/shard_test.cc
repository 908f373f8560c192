// Placements (ShardSpec) and their translation into HF flat coordinates,
// against a reference computed element by element: coordinates mapped one
// at a time, and DiffTensor of the whole HF tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "deltasync/diff.h"
#include "deltasync/shard.h"
#include "stream/shard_changes.h"

namespace deltasync::stream {
namespace {

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

}  // namespace
}  // namespace deltasync::stream
