#include "deltasync/codec.h"

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "codec/codec_internal.h"

namespace deltasync {
namespace {

using CodecGetter = const Codec& (*)();

// The registry: every encoding's codec, at the index of its Encoding value.
// The only list of encodings; everything else enumerates it.
constexpr CodecGetter kCodecs[] = {
    &codec_internal::DenseCodec,     &codec_internal::IndicesCodec, &codec_internal::XorCodec,
    &codec_internal::OverwriteCodec, &codec_internal::SparseCodec,
};

}  // namespace

const Codec& GetCodec(Encoding encoding) {
  const size_t index = static_cast<size_t>(encoding);
  if (index >= std::size(kCodecs)) return codec_internal::InvalidCodec();
  return kCodecs[index]();
}

const EncodingInfo& GetEncodingInfo(Encoding encoding) { return GetCodec(encoding).info(); }

std::string_view EncodingName(Encoding encoding) { return GetEncodingInfo(encoding).name; }

std::span<const Encoding> AllEncodings() {
  static const std::array<Encoding, std::size(kCodecs)> all = [] {
    std::array<Encoding, std::size(kCodecs)> encodings{};
    for (size_t i = 0; i < encodings.size(); ++i) encodings[i] = kCodecs[i]().encoding();
    return encodings;
  }();
  return all;
}

Result<Encoding> ParseEncoding(std::string_view name) {
  for (Encoding encoding : AllEncodings()) {
    if (EncodingName(encoding) == name) return encoding;
  }
  return Status::InvalidArgument("unknown delta encoding '" + std::string(name) + "' (expected " +
                                 JoinEncodingNames(", ", " or ") + ")");
}

std::string JoinEncodingNames(std::string_view separator, std::string_view last_separator) {
  const std::span<const Encoding> all = AllEncodings();
  std::string joined;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i > 0) joined += i + 1 == all.size() ? last_separator : separator;
    joined += EncodingName(all[i]);
  }
  return joined;
}

std::string JoinEncodingNames(std::string_view separator) {
  return JoinEncodingNames(separator, separator);
}

Status Encode(Encoding encoding, std::span<const uint8_t> new_bytes, const ChangeSet& changes,
              const EncodeOptions& options, std::vector<uint8_t>* out) {
  return GetCodec(encoding).Encode(new_bytes, changes, options, out);
}

Status DecodeApply(Encoding encoding, std::span<const uint8_t> encoded, std::span<uint8_t> target,
                   uint32_t elem_size, const DecodeOptions& options) {
  return GetCodec(encoding).DecodeApply(encoded, target, elem_size, options);
}

Status DecodeChanges(Encoding encoding, std::span<const uint8_t> encoded,
                     std::span<const uint8_t> base, uint32_t elem_size, ChangeSet* out,
                     const DecodeOptions& options) {
  return GetCodec(encoding).DecodeChanges(encoded, base, elem_size, options, out);
}

namespace codec_internal {
namespace {

// Stands in for an Encoding value from outside the enum (a bad cast or a
// corrupted stored byte): every operation fails instead of guessing.
constexpr EncodingInfo kInvalidInfo = {
    .encoding = static_cast<Encoding>(0xFF),
    .name = "unknown",
    .compression = "",
    .needs_old_values = false,
    .needs_base = true,
    .idempotent = false,
    .streams = false,
    .carries_values = false,
    .read_by_python_receiver = false,
    .zstd_checksum_by_default = false,
    .max_tensor_bytes = 0,
};

class InvalidCodecImpl final : public Codec {
 public:
  const EncodingInfo& info() const override { return kInvalidInfo; }
  Status Encode(std::span<const uint8_t>, const ChangeSet&, const EncodeOptions&,
                std::vector<uint8_t>*) const override {
    return Status::InvalidArgument("encode: not a known delta encoding");
  }
  Status DecodeApply(std::span<const uint8_t>, std::span<uint8_t>, uint32_t,
                     const DecodeOptions&) const override {
    return Status::InvalidArgument("decode: not a known delta encoding");
  }
  Status DecodeChanges(std::span<const uint8_t>, std::span<const uint8_t>, uint32_t,
                       const DecodeOptions&, ChangeSet*) const override {
    return Status::InvalidArgument("decode: not a known delta encoding");
  }
};

}  // namespace

const Codec& InvalidCodec() {
  static const InvalidCodecImpl codec;
  return codec;
}

void XorInto(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t d[4], s[4];
    std::memcpy(d, dst + i, 32);
    std::memcpy(s, src + i, 32);
    for (int k = 0; k < 4; ++k) d[k] ^= s[k];
    std::memcpy(dst + i, d, 32);
  }
  for (; i < n; ++i) dst[i] ^= src[i];
}

Status ValidateChangeSet(std::span<const uint8_t> new_bytes, const ChangeSet& changes,
                         bool need_old_values, std::string_view encoding_name) {
  auto fail = [&](const std::string& what) {
    return Status::InvalidArgument(std::string(encoding_name) + " encode: " + what);
  };
  const uint64_t es = changes.elem_size;
  if (!IsValidElemSize(es)) {
    return fail("element size " + std::to_string(es) + " (expected 1, 2, 4 or 8)");
  }
  uint64_t numel_bytes = 0;
  if (__builtin_mul_overflow(changes.numel, es, &numel_bytes) || numel_bytes != new_bytes.size()) {
    return fail("ChangeSet describes " + std::to_string(changes.numel) + " elements of " +
                std::to_string(es) + " bytes but the tensor has " +
                std::to_string(new_bytes.size()) + " bytes");
  }
  if ((changes.wide ? changes.pos32.size() : changes.pos64.size()) != 0) {
    return fail("ChangeSet holds positions in both the 32- and the 64-bit vector");
  }
  const uint64_t count = changes.count();
  if (count > changes.numel) {
    return fail(std::to_string(count) + " changed elements out of " +
                std::to_string(changes.numel));
  }
  if (changes.new_values.size() != count * es) {
    return fail("new_values holds " + std::to_string(changes.new_values.size()) +
                " bytes, expected " + std::to_string(count * es));
  }
  if (need_old_values && changes.old_values.size() != count * es) {
    return fail(
        "needs the old values of changed elements (DiffOptions::keep_old_values): "
        "old_values holds " +
        std::to_string(changes.old_values.size()) + " bytes, expected " +
        std::to_string(count * es));
  }
  uint64_t next_allowed = 0;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t pos = changes.position(i);
    if (pos < next_allowed || pos >= changes.numel) {
      return fail("position " + std::to_string(pos) + " at index " + std::to_string(i) +
                  " is out of order or not below numel " + std::to_string(changes.numel));
    }
    next_allowed = pos + 1;
  }
  return Status::OK();
}

namespace {

// Spare encoder buffers of this thread, by kind; a few per kind are kept.
constexpr size_t kMaxSpareBuffers = 4;
std::vector<std::vector<uint8_t>>& SpareBuffers(PooledBuffer::Kind kind) {
  thread_local std::vector<std::vector<uint8_t>> spares[PooledBuffer::kKinds];
  return spares[kind];
}

}  // namespace

PooledBuffer::PooledBuffer(Kind kind) : kind_(kind) {
  std::vector<std::vector<uint8_t>>& spares = SpareBuffers(kind);
  if (!spares.empty()) {
    bytes_ = std::move(spares.back());
    spares.pop_back();
  }
}

PooledBuffer::~PooledBuffer() {
  std::vector<std::vector<uint8_t>>& spares = SpareBuffers(kind_);
  if (spares.size() < kMaxSpareBuffers) spares.push_back(std::move(bytes_));
}

Status StreamRanges::Add(uint64_t first, std::span<const uint8_t> new_chunk,
                         const ChangeSet& piece) {
  auto fail = [&](const std::string& what) {
    return Status::InvalidArgument(std::string(name_) + " encode stream: " + what);
  };
  if (first != covered_) {
    return fail("range starts at element " + std::to_string(first) + ", expected " +
                std::to_string(covered_));
  }
  if (piece.elem_size != es_) {
    return fail("element size " + std::to_string(piece.elem_size) + ", the stream's is " +
                std::to_string(es_));
  }
  DS_RETURN_IF_ERROR(ValidateChangeSet(new_chunk, piece, need_old_, name_));
  if (piece.numel > numel_ - covered_) {
    return fail("range of " + std::to_string(piece.numel) + " elements at " +
                std::to_string(first) + " runs past the tensor's " + std::to_string(numel_));
  }
  covered_ += piece.numel;
  return Status::OK();
}

Status StreamRanges::CheckComplete() const {
  if (covered_ == numel_) return Status::OK();
  return Status::InvalidArgument(std::string(name_) + " encode stream: finished after " +
                                 std::to_string(covered_) + " of " + std::to_string(numel_) +
                                 " elements");
}

ChangeCollector::ChangeCollector(std::span<const uint8_t> base, uint32_t elem_size,
                                 const DecodeOptions& options, ChangeSet* out)
    : base_(base.data()), es_(elem_size), out_(out) {
  if (options.on_changes) {
    sink_ = &options.on_changes;
    limit_ = std::max<uint64_t>(1, options.max_chunk_changes);
  }
  out->Clear();
  out->elem_size = elem_size;
  out->numel = elem_size ? base.size() / elem_size : 0;
  out->wide = out->numel > uint64_t{UINT32_MAX};
}

ChangeCollector::~ChangeCollector() {
  if (out_->wide) {
    out_->pos64.resize(count_);
  } else {
    out_->pos32.resize(count_);
  }
  out_->old_values.resize(count_ * es_);
  out_->new_values.resize(count_ * es_);
}

void ChangeCollector::Reserve(uint64_t changes) {
  if (limit_ != 0) changes = std::min(changes, limit_);
  if (changes > capacity_) Grow(changes);
}

void ChangeCollector::Flush() {
  // Grow sizes the vectors to capacity_, which equals count_ here.
  (*sink_)(*out_);
  flushed_ += count_;
  count_ = 0;
}

void ChangeCollector::Grow(uint64_t at_least) {
  // Doubling, from a floor that spares small tensors repeated regrowth.
  capacity_ = std::max<uint64_t>({at_least, 2 * capacity_, 4096});
  if (limit_ != 0) capacity_ = std::min(capacity_, limit_);
  if (out_->wide) {
    out_->pos64.resize(capacity_);
    pos64_ = out_->pos64.data();
  } else {
    out_->pos32.resize(capacity_);
    pos32_ = out_->pos32.data();
  }
  out_->old_values.resize(capacity_ * es_);
  out_->new_values.resize(capacity_ * es_);
  old_ = out_->old_values.data();
  new_ = out_->new_values.data();
}

void ChangeCollector::AddNew(uint64_t pos, const uint8_t* v) {
  uint8_t x[8];
  const uint8_t* old = base_ + pos * es_;
  for (uint32_t b = 0; b < es_; ++b) x[b] = old[b] ^ v[b];
  switch (es_) {
    case 1: return AddXor<1>(pos, x);
    case 2: return AddXor<2>(pos, x);
    case 4: return AddXor<4>(pos, x);
    default: return AddXor<8>(pos, x);
  }
}

template <size_t ES>
void ChangeCollector::AddXorListTyped(uint64_t first, const ChangeSet& found) {
  const uint64_t n = found.count();
  if (limit_ == 0 && count_ + n > capacity_) Grow(count_ + n);
  const uint8_t* x = found.new_values.data();
  // The base lines are requested ahead, as DecodePositions does (sparse.cc).
  const uint64_t lead = std::min<uint64_t>(n, kPrefetchLeadChanges);
  for (uint64_t i = 0; i < lead; ++i) Prefetch<ES>(first + found.position(i));
  for (uint64_t i = 0; i < n; ++i) {
    if (i + lead < n) Prefetch<ES>(first + found.position(i + lead));
    AddXor<ES>(first + found.position(i), x + i * ES);
  }
}

void ChangeCollector::AddXorList(uint64_t first, const ChangeSet& found) {
  switch (es_) {
    case 1: return AddXorListTyped<1>(first, found);
    case 2: return AddXorListTyped<2>(first, found);
    case 4: return AddXorListTyped<4>(first, found);
    default: return AddXorListTyped<8>(first, found);
  }
}

Status DecodeChangesViaCopy(const Codec& codec, std::span<const uint8_t> encoded,
                            std::span<const uint8_t> base, uint32_t elem_size,
                            const DecodeOptions& options, ChangeSet* out) {
  std::vector<uint8_t> copy(base.begin(), base.end());
  DS_RETURN_IF_ERROR(codec.DecodeApply(encoded, copy, elem_size, options));
  return DiffAgainst(copy, base, elem_size, /*keep_old_values=*/true, out);
}

Status DiffAgainst(std::span<const uint8_t> new_bytes, std::span<const uint8_t> base,
                   uint32_t elem_size, bool keep_old_values, ChangeSet* out) {
  DiffOptions diff;
  diff.elem_size = elem_size;
  diff.refresh_snapshot = false;  // so DiffTensor never writes `base`
  diff.keep_old_values = keep_old_values;
  diff.pool = nullptr;
  return DiffTensor(new_bytes, {const_cast<uint8_t*>(base.data()), base.size()}, diff, out);
}

Status ValidateTarget(std::span<const uint8_t> target, uint32_t elem_size) {
  if (!IsValidElemSize(elem_size)) {
    return Status::InvalidArgument("element size " + std::to_string(elem_size) +
                                   " (expected 1, 2, 4 or 8)");
  }
  if (target.size() % elem_size != 0) {
    return Status::InvalidArgument("target of " + std::to_string(target.size()) +
                                   " bytes is not a whole number of " + std::to_string(elem_size) +
                                   "-byte elements");
  }
  return Status::OK();
}

}  // namespace codec_internal
}  // namespace deltasync
