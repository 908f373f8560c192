#include "stream/quantized_inputs.h"

#include <algorithm>

#include "deltasync/quantize.h"
#include "deltasync/tensor.h"

namespace deltasync::stream {

namespace {

std::string Quoted(std::string_view name) { return "tensor '" + std::string(name) + "'"; }

}  // namespace

Result<std::span<const SyncTensor>> QuantizedInputs::Expand(std::span<const SyncTensor> tensors,
                                                            ThreadPool* pool,
                                                            const DeviceFor& device_for) {
  if (sends_.empty()) return tensors;
  struct Job {
    const SyncTensor* tensor;
    const QuantRecipe* recipe;
    Buffers* buffers;
  };
  std::vector<Job> jobs;
  expanded_.clear();
  size_t found = 0;
  for (const SyncTensor& t : tensors) {
    const auto send = sends_.find(t.name);
    if (send == sends_.end()) {
      expanded_.push_back(t);
      continue;
    }
    ++found;
    const QuantRecipe& recipe = send->second.recipe;
    Status recipe_ok = CheckQuantRecipe(recipe);
    if (!recipe_ok.ok()) return recipe_ok.WithContext(Quoted(t.name));
    if (t.shape.size() != 2 || t.shape[0] < 1 || t.shape[1] < 1) {
      return Status::InvalidArgument(Quoted(t.name) + ": quantizing takes a 2-D weight with " +
                                     "elements, not " + ShapeToString(t.shape));
    }
    if (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32) {
      return Status::InvalidArgument(Quoted(t.name) + ": dtype " + std::string(DTypeName(t.dtype)) +
                                     " cannot be quantized (BF16, F16 or F32 only)");
    }
    const uint64_t numel = static_cast<uint64_t>(t.shape[0]) * static_cast<uint64_t>(t.shape[1]);
    if (t.data.size() != numel * DTypeSize(t.dtype)) {
      return Status::InvalidArgument(Quoted(t.name) + ": " + std::to_string(t.data.size()) +
                                     " bytes of data for " + std::to_string(numel) + " " +
                                     std::string(DTypeName(t.dtype)) + " elements");
    }
    DS_ASSIGN_OR_RETURN(const std::vector<int64_t> scale_shape,
                        QuantScaleShape(recipe, t.shape[0], t.shape[1]));
    const DType scale_dtype = QuantScaleDType(recipe.scale_format);
    Buffers& b = buffers_[t.name];
    std::span<const uint8_t> codes_bytes, scale_bytes;
    if (t.place.on_device()) {
      // On its device, now, one after the other (the kernels fill the GPU).
      if (!b.device) {
        DS_ASSIGN_OR_RETURN(DeviceContext * ctx, device_for(t.place.cuda_device, Quoted(t.name)));
        DS_ASSIGN_OR_RETURN(b.device, DeviceQuantized::Create(*ctx));
      }
      DS_RETURN_IF_ERROR(
          b.device->Quantize(recipe, t.name, t.dtype, t.shape, t.data.data(), t.place.cuda_stream));
      codes_bytes = b.device->codes();
      scale_bytes = b.device->scales();
    } else {
      b.codes.resize(numel);
      int64_t groups = 1;
      for (int64_t d : scale_shape) groups *= d;  // [1] for a per-tensor scale
      b.scales.resize(static_cast<size_t>(groups) * DTypeSize(scale_dtype));
      jobs.push_back({&t, &recipe, &b});
      codes_bytes = b.codes;
      scale_bytes = b.scales;
    }
    SyncTensor codes;
    codes.name = t.name;
    codes.dtype = DType::kF8_E4M3;
    codes.shape = t.shape;
    codes.data = codes_bytes;
    codes.place = t.place;
    expanded_.push_back(std::move(codes));
    SyncTensor scales;
    scales.name = send->second.scale_name.empty() ? t.name + "_scale_inv" : send->second.scale_name;
    scales.dtype = scale_dtype;
    scales.shape = scale_shape;
    scales.data = scale_bytes;
    scales.place = t.place;
    expanded_.push_back(std::move(scales));
  }
  if (found < sends_.size()) {
    for (const auto& send : sends_) {
      const std::string& name = send.first;
      if (std::none_of(tensors.begin(), tensors.end(),
                       [&](const SyncTensor& t) { return t.name == name; })) {
        return Status::NotFound(Quoted(name) +
                                ": named in SenderOptions::quantize, but the sync has no such "
                                "tensor");
      }
    }
  }
  std::vector<Status> results(jobs.size());
  const auto quantize = [&](size_t i) {
    const SyncTensor& t = *jobs[i].tensor;
    results[i] = Fp8Quantize(*jobs[i].recipe, {t.name, t.dtype, t.shape}, t.data.data(),
                             jobs[i].buffers->codes.data(), jobs[i].buffers->scales.data());
  };
  if (pool != nullptr && jobs.size() > 1) {
    pool->ParallelFor(jobs.size(), quantize);
  } else {
    for (size_t i = 0; i < jobs.size(); ++i) quantize(i);
  }
  for (const Status& s : results) DS_RETURN_IF_ERROR(s);
  return std::span<const SyncTensor>(expanded_);
}

uint64_t QuantizedInputs::buffer_bytes() const {
  uint64_t bytes = 0;
  for (const auto& [name, b] : buffers_) {
    bytes += b.codes.capacity() + b.scales.capacity() + (b.device ? b.device->buffer_bytes() : 0);
  }
  return bytes;
}

}  // namespace deltasync::stream
