// A whole-tensor sender's tensors sent quantized (SenderOptions::quantize):
// each sync quantizes them into buffers the sender keeps, and the stream
// then sends their codes and scales as two tensors of their own.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "deltasync/status.h"
#include "deltasync/stream.h"
#include "deltasync/thread_pool.h"
#include "stream/device_path.h"

namespace deltasync::stream {

class QuantizedInputs {
 public:
  explicit QuantizedInputs(std::map<std::string, QuantizedSend, std::less<>> sends)
      : sends_(std::move(sends)) {}

  // `tensors` as the stream sends them: each one named in the sends
  // replaced, in its place, by its F8_E4M3 codes (its own name) and its
  // scales (its scale_name, or name + "_scale_inv"), both quantized now
  // into this object's buffers (on `pool`'s threads when there is one); the
  // others as they are. Valid until the next call. A tensor in device
  // memory is quantized on its device into codes and scales held there
  // (`device_for` gives the sender's context of a CUDA device). Host
  // tensors are quantized on `pool`'s threads when there is one.
  // InvalidArgument naming the tensor for a weight the recipe cannot take
  // (quantize.h) or data of the wrong size (then the sync sends nothing); a
  // tensor named in the sends that `tensors` lacks is NotFound.
  using DeviceFor = std::function<Result<DeviceContext*>(int cuda_device, const std::string& what)>;
  Result<std::span<const SyncTensor>> Expand(std::span<const SyncTensor> tensors, ThreadPool* pool,
                                             const DeviceFor& device_for);

  // The codes and scales held (the sender's memory beside its snapshot).
  uint64_t buffer_bytes() const;

 private:
  struct Buffers {
    std::vector<uint8_t> codes;  // a host tensor's
    std::vector<uint8_t> scales;
    std::unique_ptr<DeviceQuantized> device;  // a device tensor's
  };
  std::map<std::string, QuantizedSend, std::less<>> sends_;
  std::map<std::string, Buffers, std::less<>> buffers_;
  std::vector<SyncTensor> expanded_;
};

}  // namespace deltasync::stream
