#include "pipeline/chunked_diff.h"

#include <algorithm>
#include <string>

namespace deltasync::pipeline {

uint64_t ChunkNumel(size_t chunk_bytes, uint32_t elem_size) {
  return std::clamp<uint64_t>(chunk_bytes / elem_size, 1, uint64_t{UINT32_MAX});
}

Status CheckChunkedOperands(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                            uint32_t elem_size) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
    return Status::InvalidArgument("chunked diff: element size " + std::to_string(elem_size) +
                                   " is not 1, 2, 4 or 8");
  }
  const size_t bytes = new_bytes.size();
  if (bytes != snapshot.size()) {
    return Status::InvalidArgument("chunked diff: length mismatch, new tensor has " +
                                   std::to_string(bytes) + " bytes but snapshot has " +
                                   std::to_string(snapshot.size()));
  }
  if (bytes % elem_size != 0) {
    return Status::InvalidArgument("chunked diff: length " + std::to_string(bytes) +
                                   " bytes is not a multiple of element size " +
                                   std::to_string(elem_size));
  }
  // Pieces of partially overlapping spans need not overlap themselves, but
  // refreshing one would change later pieces of the new bytes.
  const auto new_begin = reinterpret_cast<uintptr_t>(new_bytes.data());
  const auto old_begin = reinterpret_cast<uintptr_t>(snapshot.data());
  if (bytes != 0 && new_begin != old_begin && new_begin < old_begin + bytes &&
      old_begin < new_begin + bytes) {
    return Status::InvalidArgument("chunked diff: new tensor and snapshot partially overlap");
  }
  return Status::OK();
}

void AppendShifted(const ChangeSet& piece, uint64_t first, bool with_new_values, ChangeSet* out) {
  const size_t count = piece.pos32.size();
  if (count == 0) return;
  if (out->wide) {
    const size_t old = out->pos64.size();
    out->pos64.resize(old + count);
    for (size_t k = 0; k < count; ++k) out->pos64[old + k] = first + piece.pos32[k];
  } else {
    const size_t old = out->pos32.size();
    const auto base = static_cast<uint32_t>(first);
    out->pos32.resize(old + count);
    for (size_t k = 0; k < count; ++k) out->pos32[old + k] = base + piece.pos32[k];
  }
  if (with_new_values) {
    out->new_values.insert(out->new_values.end(), piece.new_values.begin(), piece.new_values.end());
  }
  out->old_values.insert(out->old_values.end(), piece.old_values.begin(), piece.old_values.end());
}

Status DiffAndHashInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                           const DiffOptions& options, size_t chunk_bytes, Hasher* base_hasher,
                           Hasher* new_hasher, ChangeSet* piece, ChangeSet* out) {
  if (out == nullptr || piece == nullptr) {
    return Status::InvalidArgument("chunked diff: output ChangeSet is null");
  }
  DS_RETURN_IF_ERROR(CheckChunkedOperands(new_bytes, snapshot, options.elem_size));
  out->Clear();
  out->elem_size = options.elem_size;
  if (options.elem_size != 0) out->numel = new_bytes.size() / options.elem_size;
  out->wide = out->numel > uint64_t{UINT32_MAX};
  const std::span<Hasher* const> none;
  return DiffAndHashInChunks(new_bytes, snapshot, options, chunk_bytes,
                             base_hasher ? std::span<Hasher* const>(&base_hasher, 1) : none,
                             new_hasher ? std::span<Hasher* const>(&new_hasher, 1) : none, piece,
                             [&](uint64_t first, std::span<const uint8_t>, const ChangeSet& p) {
                               AppendShifted(p, first, /*with_new_values=*/true, out);
                               return Status::OK();
                             });
}

Status DiffAndHashInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                           const DiffOptions& options, size_t chunk_bytes,
                           std::span<Hasher* const> base_hashers,
                           std::span<Hasher* const> new_hashers, ChangeSet* piece,
                           const ChunkSink& sink) {
  if (piece == nullptr) return Status::InvalidArgument("chunked diff: piece ChangeSet is null");
  const uint32_t elem_size = options.elem_size;
  DS_RETURN_IF_ERROR(CheckChunkedOperands(new_bytes, snapshot, elem_size));
  const uint64_t numel = new_bytes.size() / elem_size;
  const uint64_t chunk_numel = ChunkNumel(chunk_bytes, elem_size);
  DiffOptions piece_options = options;
  piece_options.pool = nullptr;
  for (uint64_t first = 0; first < numel; first += chunk_numel) {
    const size_t offset = first * elem_size;
    const size_t length = std::min(chunk_numel, numel - first) * elem_size;
    const std::span<const uint8_t> new_chunk = new_bytes.subspan(offset, length);
    for (Hasher* h : base_hashers) h->Update(snapshot.subspan(offset, length));
    DS_RETURN_IF_ERROR(
        DiffTensor(new_chunk, snapshot.subspan(offset, length), piece_options, piece));
    for (Hasher* h : new_hashers) h->Update(new_chunk);
    DS_RETURN_IF_ERROR(sink(first, new_chunk, *piece));
  }
  return Status::OK();
}

Result<uint64_t> RefreshInChunks(std::span<const uint8_t> new_bytes, std::span<uint8_t> snapshot,
                                 uint32_t elem_size, ChangeSet* piece) {
  DS_RETURN_IF_ERROR(CheckChunkedOperands(new_bytes, snapshot, elem_size));
  DiffOptions options;
  options.elem_size = elem_size;
  options.refresh_snapshot = true;
  options.keep_old_values = false;
  const uint64_t numel = new_bytes.size() / elem_size;
  const uint64_t chunk_numel = ChunkNumel(kFusedChunkBytes, elem_size);
  uint64_t changed = 0;
  for (uint64_t first = 0; first < numel; first += chunk_numel) {
    const size_t offset = first * elem_size;
    const size_t length = std::min(chunk_numel, numel - first) * elem_size;
    DS_RETURN_IF_ERROR(DiffTensor(new_bytes.subspan(offset, length),
                                  snapshot.subspan(offset, length), options, piece));
    changed += piece->count();
  }
  return changed;
}

}  // namespace deltasync::pipeline
