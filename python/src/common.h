// Shared by the extension's files: Status to the package's exceptions,
// and the tensors the Python layer passes in (python/deltasync/_tensors.py
// turns numpy arrays and torch tensors into TensorArg, zero-copy).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "deltasync/dtype.h"
#include "deltasync/quantize.h"
#include "deltasync/status.h"
#include "deltasync/store.h"
#include "deltasync/stream.h"
#include "deltasync/tensor.h"

namespace deltasync::python {

namespace py = pybind11;

// Raises the package's exception for `s` (deltasync.errors: one class per
// code) with its message. Never returns.
[[noreturn]] void Raise(const Status& s);

inline void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

// A tensor's memory as the Python layer found it: no ownership (the Python
// object holding it stays referenced by the caller for as long as it is
// used).
struct TensorArg {
  std::string name;
  std::string dtype;  // safetensors name: "BF16", "F32", ...
  std::vector<int64_t> shape;
  uintptr_t ptr = 0;
  uint64_t nbytes = 0;
  int device = -1;       // CUDA device, -1 for host memory
  uintptr_t stream = 0;  // cudaStream_t of a CUDA tensor
  bool writable = true;

  DType ParsedDType() const;
  // Checks the byte count against the shape; InvalidArgument naming the
  // tensor.
  Status Validate() const;
  std::span<const uint8_t> bytes() const {
    return {reinterpret_cast<const uint8_t*>(ptr), static_cast<size_t>(nbytes)};
  }
  std::span<uint8_t> mutable_bytes() const {
    return {reinterpret_cast<uint8_t*>(ptr), static_cast<size_t>(nbytes)};
  }
  Placement place() const {
    return device < 0 ? Placement{} : Placement::Cuda(device, reinterpret_cast<void*>(stream));
  }
  TensorView View() const { return {name, ParsedDType(), shape, bytes()}; }
};

// "[2, 3]".
inline std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// TensorArgs pass between the Python layer and the calls as one opaque
// list (deltasync._deltasync.TensorArgs), built by args_from_pairs without
// a Python object per tensor; a Python list of TensorArg converts to it.
using TensorArgs = std::vector<TensorArg>;

// A core object a binding holds until Close(): Use() raises
// FailedPrecondition "<what> is closed" after it.
//
// Calls that release the GIL run under a Lease (Enter): a second such call
// from another thread while one runs raises FailedPrecondition at once
// (the core objects take one call at a time), and Close() from another
// thread cancels the call in flight where the object can be cancelled (its
// Cancel), waits for it to return, and only then destroys the object, with
// the GIL released (its threads and connections end there). Calls that
// keep the GIL need no lease: Close cannot run beside them.
template <typename T>
class Held {
 public:
  explicit Held(const char* what) : what_(what) {}
  ~Held() { Close(); }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  void Set(std::unique_ptr<T> p) { p_ = std::move(p); }
  T& Use() const {
    if (!p_) Raise(Status::FailedPrecondition(std::string(what_) + " is closed"));
    return *p_;
  }
  bool closed() const { return p_ == nullptr; }

  class Lease {
   public:
    explicit Lease(Held* h) : h_(h) {}
    Lease(Lease&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
    Lease(const Lease&) = delete;
    ~Lease() {
      if (h_ != nullptr) h_->Leave();
    }
    T& operator*() const { return *h_->p_; }
    T* operator->() const { return h_->p_.get(); }

   private:
    Held* h_;
  };

  // With the GIL held.
  Lease Enter(const char* call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!p_ || closing_) Raise(Status::FailedPrecondition(std::string(what_) + " is closed"));
    if (in_flight_ != nullptr) {
      Raise(Status::FailedPrecondition(std::string(what_) + "." + call +
                                       "() while another thread is in " + what_ + "." + in_flight_ +
                                       "(): one call at a time"));
    }
    in_flight_ = call;
    return Lease(this);
  }

  void Close() {
    if (!p_) return;
    std::unique_ptr<T> gone;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu_);
      if (closing_) return;  // another thread is closing it
      closing_ = true;
      if (in_flight_ != nullptr) {
        if constexpr (requires(T & t) { t.Cancel(std::string_view()); }) {
          p_->Cancel(std::string(what_) + " was closed by another thread");
        }
        idle_.wait(lock, [&] { return in_flight_ == nullptr; });
      }
      gone = std::move(p_);
      lock.unlock();
      gone.reset();
    }
  }

 private:
  void Leave() {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ = nullptr;
    idle_.notify_all();
  }

  const char* what_;
  std::unique_ptr<T> p_;
  std::mutex mu_;
  std::condition_variable idle_;
  const char* in_flight_ = nullptr;  // the call under a lease
  bool closing_ = false;
};

// Host memory only: InvalidArgument naming the tensor and `what` otherwise.
Status RequireHost(const TensorArg& t, const std::string& what);

// A recipe by its Python names ("block128", "per_tensor", "per_channel";
// "f32", "ue8m0_f32", "ue8m0"); raises InvalidArgumentError otherwise.
QuantRecipe ParseQuantRecipe(const std::string& scheme, const std::string& scale_format);

// Host views of `tensors` (RequireHost, naming `what`), for the disk
// transport; store.cc.
std::vector<TensorView> HostViews(const TensorArgs& tensors, const char* what);

void BindStream(py::module_& m);
void BindStore(py::module_& m);
void BindAgent(py::module_& m);

// Shared by store.cc and agent.cc (the coordinator holds a publisher).
py::dict PublishDict(const PublishResult& p);
PublisherOptions MakePublisherOptions(const std::string& store, const std::string& encoding,
                                      int64_t full_every, const std::string& checksum,
                                      int zstd_level);

}  // namespace deltasync::python

PYBIND11_MAKE_OPAQUE(deltasync::python::TensorArgs)
