// Where a sharded trainer's local tensor lies in the Hugging Face (HF)
// checkpoint's tensors (docs/format.md, "Stream: sharded gather",
// "Placements"): the placements of tensor parallelism, FSDP1 and FSDP2,
// fused parameters and replicas, as the online stream translates a local
// tensor's changes into the HF tensors' flat coordinates.
//
// A local tensor is a list of pieces, each a part of one HF tensor: a box
// (same number of dimensions on both sides; a slice, a chunk, a 2-D shard,
// one part of a fused parameter) or a flat range (FSDP1's flat parameters).
// Every factory below returns a valid spec (Validate passes) or the
// InvalidArgument Validate or its own argument checks give.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <span>

#include "deltasync/dtype.h"
#include "deltasync/quantize.h"
#include "deltasync/status.h"

namespace deltasync {

// Tensors (local or HF) hold at most this many elements, every dimension
// included: the bound of the stream's flat positions.
inline constexpr int64_t kMaxShardNumel = int64_t{1} << 56;
// A tensor's most dimensions and its HF name's most bytes (the stream's
// frames carry the same limits).
inline constexpr size_t kMaxShardDims = 16;
inline constexpr size_t kMaxShardNameBytes = 1024;

// One part of a local tensor that is a part of one HF tensor.
struct ShardPiece {
  enum class Kind : uint8_t {
    // Local elements at coordinates local_offset + c are the HF tensor's at
    // hf_offset + c, for 0 <= c < extent in every dimension; the local
    // tensor, the HF tensor and the three vectors have the same number of
    // dimensions.
    kBox,
    // Local flat elements [local_first, local_first + count) are the HF
    // tensor's flat elements [hf_first, hf_first + count); the local tensor
    // may have any shape.
    kFlat,
  };
  Kind kind = Kind::kBox;
  std::string hf_name;
  std::vector<int64_t> hf_shape;
  // kBox.
  std::vector<int64_t> local_offset;
  std::vector<int64_t> hf_offset;
  std::vector<int64_t> extent;
  // kFlat.
  int64_t local_first = 0;
  int64_t hf_first = 0;
  int64_t count = 0;
  // False: this rank holds the piece but another replica sends its changes
  // (a part of a fused parameter replicated over more tensor-parallel ranks
  // than it has heads). ShardSpec::contributes applies on top.
  bool contributes = true;

  static ShardPiece Box(std::string hf_name, std::vector<int64_t> hf_shape,
                        std::vector<int64_t> local_offset, std::vector<int64_t> hf_offset,
                        std::vector<int64_t> extent);
  static ShardPiece Flat(std::string hf_name, std::vector<int64_t> hf_shape, int64_t local_first,
                         int64_t hf_first, int64_t count);

  // Elements in the piece (assumes a valid piece).
  int64_t elements() const;
};

// A local tensor: its dtype (the HF tensors' too), its shape, and its
// pieces, which cover it exactly (no element in two pieces or in none).
struct ShardSpec {
  DType dtype = DType::kU8;
  std::vector<int64_t> local_shape;
  std::vector<ShardPiece> pieces;
  // False on every replica but one: the others' changes are dropped.
  bool contributes = true;

  // The whole tensor.
  static Result<ShardSpec> Whole(std::string name, DType dtype, std::vector<int64_t> shape);
  // A replica of the whole tensor; only the replica with `contributes`
  // sends its changes.
  static Result<ShardSpec> Replicate(std::string name, DType dtype, std::vector<int64_t> shape,
                                     bool contributes);
  // Chunk `index` of `count` along `dim` (negative counts from the end), as
  // torch.chunk and FSDP2 split: chunks of ceil(size / count) elements, the
  // last ones smaller or empty (0 <= index < count).
  static Result<ShardSpec> Shard(std::string name, DType dtype, std::vector<int64_t> global_shape,
                                 int dim, int64_t index, int64_t count);
  // Part `index` of an uneven split along `dim` into parts of `sizes`
  // elements (each >= 0, summing to the dimension's size).
  static Result<ShardSpec> ShardSizes(std::string name, DType dtype,
                                      std::vector<int64_t> global_shape, int dim,
                                      std::vector<int64_t> sizes, int64_t index);
  // The box [offset, offset + extent) of the tensor, held as a tensor of
  // shape `extent`: a 2-D shard, a slice along several dimensions.
  static Result<ShardSpec> Box(std::string name, DType dtype, std::vector<int64_t> global_shape,
                               std::vector<int64_t> offset, std::vector<int64_t> extent);
  // HF flat elements [hf_first, hf_first + count) held as a 1-D tensor of
  // `count` elements. FSDP1's flat parameter is Fused(dtype, 0, {FlatRange
  // of each tensor it holds a part of}).
  static Result<ShardSpec> FlatRange(std::string name, DType dtype, std::vector<int64_t> hf_shape,
                                     int64_t hf_first, int64_t count);
  // The local tensors of `parts` concatenated along `dim`, as Megatron
  // fuses q, k, v (each possibly a tensor-parallel shard of its HF tensor)
  // into one parameter. Parts have `dtype` and the same shape but along
  // `dim`; a part that does not contribute marks its pieces so. Parts with
  // flat ranges only along dim 0 of 1-D tensors.
  static Result<ShardSpec> Fused(DType dtype, int dim, const std::vector<ShardSpec>& parts);
  // An expert-parallel rank's experts stacked along a leading dimension in
  // one local tensor, [experts.size(), parts * part_shape[0],
  // part_shape[1], ...]: slice i is the HF tensors experts[i] (each of
  // `part_shape`, all with the same number of names) concatenated along
  // their first dimension. One name per expert for a stacked down_proj
  // (vLLM's and SGLang's w2 on an EP rank, Megatron's grouped weights);
  // gate then up for their fused w13. The rank holding experts [first,
  // first + n) passes those n experts' names; per-expert HF tensors that a
  // rank holds unstacked are each Whole.
  static Result<ShardSpec> StackedExperts(DType dtype,
                                          const std::vector<std::vector<std::string>>& experts,
                                          std::vector<int64_t> part_shape);
  // Tensor-parallel rank `tp_rank` of `tp_size`'s part of Megatron's fused
  // linear_qkv weight, whose rows interleave the heads per query group (for
  // each group g: its num_heads / num_query_groups query heads, then its
  // key head, then its value head, head_dim rows each) and which
  // ColumnParallelLinear splits into equal runs of rows, as the HF q, k and
  // v projections (`q`: [num_heads * head_dim, hidden], `k` and `v`:
  // [num_query_groups * head_dim, hidden]). A rank's run may cut a group
  // (more ranks than query groups). InvalidArgument unless num_heads is a
  // multiple of num_query_groups and the rows a multiple of tp_size. Not
  // Fused(Shard(q), Shard(k), Shard(v)): that is vLLM's and SGLang's layout.
  // Megatron's gate and up (SwiGLU's linear_fc1) are Fused(dtype, 0,
  // {Shard(gate, ..., 0, tp_rank, tp_size), Shard(up, ...)}).
  static Result<ShardSpec> MegatronQkv(const std::string& q, const std::string& k,
                                       const std::string& v, DType dtype, int64_t num_heads,
                                       int64_t num_query_groups, int64_t head_dim, int64_t hidden,
                                       int64_t tp_rank, int64_t tp_size);

  // OK when the spec satisfies docs/format.md ("Placements", rules 1 to 5):
  // at most 16 dimensions, none negative, at most kMaxShardNumel elements
  // per tensor, HF names of 1 to 1024 bytes, all pieces of one kind, boxes
  // of the local tensor's and their HF tensor's number of dimensions,
  // pieces within both tensors, one shape per HF tensor, pieces of one HF
  // tensor disjoint in it, and the local tensor covered exactly.
  // InvalidArgument naming the HF tensor (or the piece) and the problem
  // otherwise. Costs O(pieces^2).
  Status Validate() const;

  // Elements of the local tensor (assumes a valid shape).
  int64_t local_numel() const;
};

class Communicator;

// FP8 quantization of a weight that the trainer ranks hold in pieces
// (docs/format.md, "FP8 quantization recipes"): rank r of `trainer_group`
// holds `windows[r]` of the [M, N] weight `tensor` (every rank passes
// every rank's window bounds; only its own window's `data` is read). A
// scale group that lies in more than one rank's window (a 128 x 128 block
// across a shard border, the one group of a per-tensor scale) takes the
// MAX of those ranks' partial amax, exchanged as one small all-gather of
// just those groups' amax, never of their elements; every other group is
// its rank's own. Each rank then writes its window's codes (window-shaped)
// and the scales of the groups its window touches (Fp8WindowGroups), equal
// byte for byte to quantizing the whole weight at once. A collective:
// every rank calls it, with the same recipe, tensor and windows, and every
// rank gets the same outcome: InvalidArgument on every rank when any rank's
// window is refused (a NaN or infinite weight, a bad window), naming it;
// the communicator's error when the exchange fails.
Status Fp8QuantizeShard(Communicator& trainer_group, const QuantRecipe& recipe,
                        const QuantTensor& tensor, std::span<const QuantWindow> windows,
                        uint8_t* codes, void* scales);

// What rank `rank` passes a sharded sender (StreamSender::SyncShards) for
// the codes and scales Fp8QuantizeShard gave it: `codes`, its window of the
// F8_E4M3 [M, N] tensor named tensor.name (a box); `scales`, the scale
// groups its window touches (Fp8WindowGroups: the local tensor is that
// rectangle of the grid, [rows, cols], or [1] for a per-tensor scale) of
// the scale tensor named `scale_name` (QuantScaleDType, QuantScaleShape).
// A group that several windows touch is sent by the lowest of those ranks
// only: its pieces on the others do not contribute. Across the ranks the
// specs cover the codes and the scales once each. InvalidArgument as
// Fp8QuantizeShard refuses windows (naming the rank), for a rank outside
// them, and for a scale name that is empty or the weight's.
struct Fp8ShardSpecs {
  ShardSpec codes;
  ShardSpec scales;
};
Result<Fp8ShardSpecs> Fp8ShardSpecsOf(const QuantRecipe& recipe, const QuantTensor& tensor,
                                      std::span<const QuantWindow> windows, int rank,
                                      const std::string& scale_name);

}  // namespace deltasync
