// A whole-tensor sender's tensors sent quantized (SenderOptions::quantize):
// each sync quantizes them into buffers the sender keeps, and the stream
// then sends their codes and scales as two tensors of their own.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/stream.h"
#include "deltasync/thread_pool.h"

namespace deltasync::stream {

class QuantizedInputs {
 public:
  explicit QuantizedInputs(std::map<std::string, QuantizedSend, std::less<>> sends)
      : sends_(std::move(sends)) {}

  // `tensors` as the stream sends them: each one named in the sends
  // replaced, in its place, by its F8_E4M3 codes (its own name) and its
  // scales (its scale_name, or name + "_scale_inv"), both quantized now
  // into this object's buffers (on `pool`'s threads when there is one); the
  // others as they are. Valid until the next call. InvalidArgument naming
  // the tensor for a weight the recipe cannot take (quantize.h), a device
  // tensor, or data of the wrong size (then the sync sends nothing); a
  // tensor named in the sends that `tensors` lacks is NotFound.
  Result<std::span<const SyncTensor>> Expand(std::span<const SyncTensor> tensors, ThreadPool* pool);

  // The codes and scales held (the sender's memory beside its snapshot).
  uint64_t buffer_bytes() const;

 private:
  struct Buffers {
    std::vector<uint8_t> codes;
    std::vector<uint8_t> scales;
  };
  std::map<std::string, QuantizedSend, std::less<>> sends_;
  std::map<std::string, Buffers, std::less<>> buffers_;
  std::vector<SyncTensor> expanded_;
};

}  // namespace deltasync::stream
