// dense: the tensor's new bytes, raw. Used for the seeding pass, where every
// element is "changed" and positions would only add bytes.
#include <string>

#include "codec/codec_internal.h"

namespace deltasync::codec_internal {
namespace {

// The descriptor (codec.h, EncodingInfo).
constexpr EncodingInfo kDenseInfo = {
    .encoding = Encoding::kDense,
    .name = "dense",
    .compression = "none",
    .needs_old_values = false,
    .needs_base = false,
    .idempotent = true,
    .streams = false,
    .carries_values = true,
    .read_by_python_receiver = false,
    .zstd_checksum_by_default = false,
    .max_tensor_bytes = UINT64_MAX,
};

class DenseCodecImpl final : public Codec {
 public:
  const EncodingInfo& info() const override { return kDenseInfo; }

  Status Encode(std::span<const uint8_t> new_bytes, const ChangeSet& /*changes*/,
                const EncodeOptions& /*options*/, std::vector<uint8_t>* out) const override {
    out->insert(out->end(), new_bytes.begin(), new_bytes.end());
    return Status::OK();
  }

  Status DecodeApply(std::span<const uint8_t> encoded, std::span<uint8_t> target,
                     uint32_t elem_size, const DecodeOptions& /*options*/) const override {
    DS_RETURN_IF_ERROR(ValidateTarget(target, elem_size).WithContext("dense decode"));
    if (encoded.size() != target.size()) {
      return Status::Corruption("dense decode: " + std::to_string(encoded.size()) +
                                " encoded bytes for a tensor of " + std::to_string(target.size()) +
                                " bytes");
    }
    if (!encoded.empty()) std::memcpy(target.data(), encoded.data(), encoded.size());
    return Status::OK();
  }

  Status DecodeChanges(std::span<const uint8_t> encoded, std::span<const uint8_t> base,
                       uint32_t elem_size, const DecodeOptions& /*options*/,
                       ChangeSet* out) const override {
    DS_RETURN_IF_ERROR(ValidateTarget(base, elem_size).WithContext("dense decode"));
    if (encoded.size() != base.size()) {
      return Status::Corruption("dense decode: " + std::to_string(encoded.size()) +
                                " encoded bytes for a tensor of " + std::to_string(base.size()) +
                                " bytes");
    }
    // The encoding is the new tensor itself: the change list is its diff.
    return DiffAgainst(encoded, base, elem_size, /*keep_old_values=*/true, out);
  }
};

}  // namespace

const Codec& DenseCodec() {
  static const DenseCodecImpl codec;
  return codec;
}

}  // namespace deltasync::codec_internal
