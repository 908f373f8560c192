// The extension module deltasync._deltasync: errors, tensors, and the diff
// and codec calls on tensors. The stream and the disk store are bound in
// their own files.
#include <pybind11/numpy.h>
#include <pybind11/stl_bind.h>

#include <cstring>

#include "common.h"
#include "deltasync/codec.h"
#include "deltasync/diff.h"
#include "deltasync/quantize.h"
#include "deltasync/tensor.h"

namespace deltasync::python {
namespace {

py::object& ErrorsModule() {
  static py::object* errors = new py::object(py::module_::import("deltasync.errors"));
  return *errors;
}

}  // namespace

void Raise(const Status& s) {
  py::gil_scoped_acquire gil;
  py::object cls = ErrorsModule().attr("error_for_code")(static_cast<int>(s.code()));
  PyErr_SetObject(cls.ptr(), py::str(s.message()).ptr());
  throw py::error_already_set();
}

DType TensorArg::ParsedDType() const {
  Result<DType> d = ParseDType(dtype);
  return d.ok() ? *d : DType::kU8;
}

Status TensorArg::Validate() const {
  // The message is built only on an error: this runs for every tensor of
  // every call.
  const auto fail = [this](const std::string& why) {
    return Status::InvalidArgument("tensor '" + name + "': " + why);
  };
  Result<DType> d = ParseDType(dtype);
  if (!d.ok()) return fail(d.status().message());
  uint64_t numel = 1;
  for (int64_t x : shape) {
    if (x < 0) return fail("a negative dimension");
    numel *= static_cast<uint64_t>(x);
  }
  if (numel * DTypeSize(*d) != nbytes) {
    return fail(std::to_string(nbytes) + " bytes, but its shape of " + dtype + " needs " +
                std::to_string(numel * DTypeSize(*d)));
  }
  if (nbytes > 0 && ptr == 0) return fail("null data");
  return Status::OK();
}

Status RequireHost(const TensorArg& t, const std::string& what) {
  if (t.device >= 0) {
    return Status::InvalidArgument("tensor '" + t.name + "': on CUDA device " +
                                   std::to_string(t.device) + ", but " + what +
                                   " takes host memory (move it with .cpu())");
  }
  return Status::OK();
}

QuantRecipe ParseQuantRecipe(const std::string& scheme, const std::string& scale_format) {
  QuantRecipe recipe;
  if (scheme == "block128") {
    recipe.scheme = QuantScheme::kBlock128;
  } else if (scheme == "per_tensor") {
    recipe.scheme = QuantScheme::kPerTensor;
  } else if (scheme == "per_channel") {
    recipe.scheme = QuantScheme::kPerChannel;
  } else {
    Raise(Status::InvalidArgument("quantize_fp8: unknown scheme '" + scheme +
                                  "' (block128, per_tensor, per_channel)"));
  }
  if (scale_format == "f32") {
    recipe.scale_format = ScaleFormat::kF32;
  } else if (scale_format == "ue8m0_f32") {
    recipe.scale_format = ScaleFormat::kUe8m0F32;
  } else if (scale_format == "ue8m0") {
    recipe.scale_format = ScaleFormat::kUe8m0;
  } else {
    Raise(Status::InvalidArgument("quantize_fp8: unknown scale format '" + scale_format +
                                  "' (f32, ue8m0_f32, ue8m0)"));
  }
  return recipe;
}

namespace {

// Both tensors usable, in host memory, of one dtype and shape; `role`
// names the second ("snapshot", "base") and `call` the call.
void CheckPair(const TensorArg& current, const TensorArg& other, const char* role,
               const char* call) {
  Check(current.Validate());
  Check(other.Validate());
  Check(RequireHost(current, call));
  Check(RequireHost(other, call));
  if (current.dtype != other.dtype || current.shape != other.shape) {
    Raise(Status::InvalidArgument("tensor '" + current.name + "': " + current.dtype + " " +
                                  ShapeText(current.shape) + " against a " + role + " of " +
                                  other.dtype + " " + ShapeText(other.shape) +
                                  " (dtypes and shapes must match)"));
  }
}

// The changes of `current` against `snapshot` (host tensors of one dtype
// and shape): positions (uint64) and the new values' bytes; the snapshot
// takes the new values when `refresh`.
py::tuple PyDiff(const TensorArg& current, const TensorArg& snapshot, bool refresh) {
  CheckPair(current, snapshot, "snapshot", "diff");
  if (refresh && !snapshot.writable) {
    Raise(Status::InvalidArgument("tensor '" + snapshot.name +
                                  "': read-only, but refresh writes the new values into it"));
  }
  ChangeSet changes;
  Status s;
  {
    py::gil_scoped_release release;
    DiffOptions o;
    o.elem_size = static_cast<uint32_t>(DTypeSize(current.ParsedDType()));
    o.refresh_snapshot = refresh;
    o.keep_old_values = false;
    s = DiffTensor(current.bytes(), snapshot.mutable_bytes(), o, &changes);
  }
  Check(s);
  py::array_t<uint64_t> positions(static_cast<py::ssize_t>(changes.count()));
  uint64_t* p = positions.mutable_data();
  for (uint64_t i = 0; i < changes.count(); ++i) p[i] = changes.position(i);
  py::bytes values(reinterpret_cast<const char*>(changes.new_values.data()),
                   changes.new_values.size());
  return py::make_tuple(positions, values);
}

// `current`'s changes against `base`, encoded (the disk store's per-tensor
// encodings, docs/format.md).
py::bytes PyEncode(const TensorArg& current, const TensorArg& base, const std::string& encoding) {
  CheckPair(current, base, "base", "encode");
  const Encoding e = Take(ParseEncoding(encoding));
  std::vector<uint8_t> out;
  Status s;
  {
    py::gil_scoped_release release;
    std::vector<uint8_t> scratch(base.bytes().begin(), base.bytes().end());
    ChangeSet changes;
    DiffOptions o;
    o.elem_size = static_cast<uint32_t>(DTypeSize(current.ParsedDType()));
    o.refresh_snapshot = false;
    o.keep_old_values = true;
    s = DiffTensor(current.bytes(), scratch, o, &changes);
    if (s.ok()) s = deltasync::Encode(e, current.bytes(), changes, EncodeOptions{}, &out);
  }
  Check(s);
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
}

// `weight` (a 2-D BF16, F16 or F32 host tensor) quantized to F8_E4M3 as the
// engines' loaders do it: (codes as uint8 in the weight's shape, scales as
// float32 or, for the "ue8m0" format, uint8 F8_E8M0 bytes, in the scale
// tensor's shape).
py::tuple PyQuantizeFp8(const TensorArg& weight, const std::string& scheme,
                        const std::string& scale_format) {
  Check(weight.Validate());
  Check(RequireHost(weight, "quantize_fp8"));
  const QuantRecipe recipe = ParseQuantRecipe(scheme, scale_format);
  if (weight.shape.size() != 2) {
    Raise(Status::InvalidArgument("tensor '" + weight.name +
                                  "': quantize_fp8 takes a 2-D weight, not " +
                                  std::to_string(weight.shape.size()) + "-D"));
  }
  const std::vector<int64_t> scale_shape =
      Take(QuantScaleShape(recipe, weight.shape[0], weight.shape[1]));
  const bool f32 = QuantScaleDType(recipe.scale_format) == DType::kF32;
  py::array codes(py::dtype("uint8"), weight.shape);
  py::array scales(py::dtype(f32 ? "float32" : "uint8"), scale_shape);
  Status s;
  {
    py::gil_scoped_release release;
    const QuantTensor tensor{weight.name, weight.ParsedDType(), weight.shape};
    s = Fp8Quantize(recipe, tensor, reinterpret_cast<const void*>(weight.ptr),
                    static_cast<uint8_t*>(codes.mutable_data()), scales.mutable_data());
  }
  Check(s);
  return py::make_tuple(codes, scales);
}

// Applies an encoding in place to `target` (which holds its base).
void PyDecodeApply(const py::bytes& encoded, const TensorArg& target, const std::string& encoding) {
  Check(target.Validate());
  Check(RequireHost(target, "decode_apply"));
  if (!target.writable) {
    Raise(Status::InvalidArgument("tensor '" + target.name + "': read-only"));
  }
  const Encoding e = Take(ParseEncoding(encoding));
  std::string_view view = encoded;
  Status s;
  {
    py::gil_scoped_release release;
    s = deltasync::DecodeApply(e, {reinterpret_cast<const uint8_t*>(view.data()), view.size()},
                               target.mutable_bytes(),
                               static_cast<uint32_t>(DTypeSize(target.ParsedDType())));
  }
  if (!s.ok()) Raise(Status(s.code(), "tensor '" + target.name + "': " + s.message()));
}

// What args_from_pairs needs of torch, looked up once by the Python layer:
// torch.Tensor, torch.strided, and {torch dtype: safetensors name}.
struct TorchTypes {
  py::object tensor_type;
  py::object strided;
  py::dict dtypes;
};

TorchTypes& Torch() {
  static TorchTypes* t = new TorchTypes();
  return *t;
}

// An attribute name made once and interned, for lookups run per tensor.
py::handle Name(const char* name) { return PyUnicode_InternFromString(name); }

// TensorArgs for (name, tensor) pairs: a host torch tensor that is dense
// and contiguous is read here; anything else (numpy, Raw, CUDA tensors, and
// every tensor the core would refuse, so that the error is the Python
// layer's) goes through `slow(name, obj)`, deltasync._tensors.arg. This runs
// for every tensor of every call given plain tensors, so it asks torch for
// as little as it can: its size comes from the shape and the dtype.
TensorArgs ArgsFromPairs(const py::list& pairs, const py::object& slow) {
  static const py::handle kLayout = Name("layout"), kIsCpu = Name("is_cpu"),
                          kIsContiguous = Name("is_contiguous"), kDType = Name("dtype"),
                          kShape = Name("shape"), kDataPtr = Name("data_ptr");
  TensorArgs out;
  out.reserve(pairs.size());
  const TorchTypes& torch = Torch();
  for (const py::handle item : pairs) {
    const py::tuple pair = py::reinterpret_borrow<py::tuple>(item);
    const py::handle obj = pair[1];
    if (torch.tensor_type && py::isinstance(obj, torch.tensor_type) &&
        obj.attr(kLayout).ptr() == torch.strided.ptr() && obj.attr(kIsCpu).ptr() == Py_True &&
        obj.attr(kIsContiguous)().ptr() == Py_True) {
      const py::object dtype = obj.attr(kDType);
      PyObject* code = PyDict_GetItemWithError(torch.dtypes.ptr(), dtype.ptr());  // borrowed
      if (code == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (code != nullptr) {
        TensorArg a;
        a.name = pair[0].cast<std::string>();
        a.dtype = py::handle(code).cast<std::string>();
        a.shape = obj.attr(kShape).cast<std::vector<int64_t>>();
        a.ptr = obj.attr(kDataPtr)().cast<uintptr_t>();
        const Result<int64_t> numel = ShapeNumel(a.shape);
        if (numel.ok()) {
          a.nbytes = static_cast<uint64_t>(*numel) * DTypeSize(a.ParsedDType());
          out.push_back(std::move(a));
          continue;
        }
      }
    }
    out.push_back(slow(pair[0], obj).cast<TensorArg>());
  }
  return out;
}

// deltasync._tensors.Prepared's check at each use: every torch tensor of
// `pairs` still lies where `args` (built from the same pairs) says, with
// as many bytes; FailedPrecondition naming the first that moved otherwise.
// A CUDA tensor's stream becomes `streams[device]` (the caller's current
// one).
void CheckPrepared(TensorArgs& args, const py::list& pairs, const py::dict& streams) {
  if (args.size() != pairs.size()) {
    Raise(Status::Internal("prepared tensors: " + std::to_string(args.size()) + " arguments for " +
                           std::to_string(pairs.size()) + " tensors"));
  }
  static const py::handle kDataPtr = Name("data_ptr"), kNumel = Name("numel");
  const TorchTypes& torch = Torch();
  for (size_t i = 0; i < args.size(); ++i) {
    TensorArg& a = args[i];
    const py::handle obj = py::reinterpret_borrow<py::tuple>(pairs[i])[1];
    if (torch.tensor_type && py::isinstance(obj, torch.tensor_type)) {
      const auto ptr = obj.attr(kDataPtr)().cast<uintptr_t>();
      // Its dtype cannot change without its memory moving.
      const uint64_t nbytes = obj.attr(kNumel)().cast<uint64_t>() * DTypeSize(a.ParsedDType());
      if (ptr != a.ptr || nbytes != a.nbytes) {
        Raise(Status::FailedPrecondition(
            "tensor '" + a.name + "': its memory " + (ptr != a.ptr ? "moved" : "changed size") +
            " since it was prepared (param.data assigned, model.to, load_state_dict with assign?); "
            "prepare the tensors again"));
      }
    }
    if (a.device >= 0) a.stream = streams[py::int_(a.device)].cast<uintptr_t>();
  }
}

}  // namespace
}  // namespace deltasync::python

PYBIND11_MODULE(_deltasync, m) {
  using namespace deltasync;
  using namespace deltasync::python;
  m.doc() = "deltasync's C++ core; use the deltasync package, which wraps it.";
  py::class_<TensorArg>(m, "TensorArg", "A tensor's memory, borrowed (see deltasync._tensors).")
      .def(py::init<>())
      .def(
          py::init([](std::string name, std::string dtype, std::vector<int64_t> shape,
                      uintptr_t ptr, uint64_t nbytes, int device, uintptr_t stream, bool writable) {
            return TensorArg{std::move(name), std::move(dtype), std::move(shape), ptr,
                             nbytes,          device,           stream,           writable};
          }),
          py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("ptr"), py::arg("nbytes"),
          py::arg("device"), py::arg("stream"), py::arg("writable"))
      .def_readwrite("name", &TensorArg::name)
      .def_readwrite("dtype", &TensorArg::dtype)
      .def_readwrite("shape", &TensorArg::shape)
      .def_readwrite("ptr", &TensorArg::ptr)
      .def_readwrite("nbytes", &TensorArg::nbytes)
      .def_readwrite("device", &TensorArg::device)
      .def_readwrite("stream", &TensorArg::stream)
      .def_readwrite("writable", &TensorArg::writable);
  py::bind_vector<TensorArgs>(m, "TensorArgs", "TensorArg values, passed as one list.");
  py::implicitly_convertible<py::list, TensorArgs>();
  m.def("set_torch_types", [](py::object tensor_type, py::object strided, py::dict dtypes) {
    Torch() = {std::move(tensor_type), std::move(strided), std::move(dtypes)};
  });
  m.def("args_from_pairs", &ArgsFromPairs, py::arg("pairs"), py::arg("slow"));
  m.def("check_prepared", &CheckPrepared, py::arg("args"), py::arg("pairs"), py::arg("streams"));
  m.def("diff", &PyDiff, py::arg("current"), py::arg("snapshot"), py::arg("refresh"));
  m.def("encode", &PyEncode, py::arg("current"), py::arg("base"), py::arg("encoding"));
  m.def("quantize_fp8", &PyQuantizeFp8, py::arg("weight"), py::arg("scheme"),
        py::arg("scale_format"));
  m.def("decode_apply", &PyDecodeApply, py::arg("encoded"), py::arg("target"), py::arg("encoding"));
  m.def("built_with_cuda", [] { return DS_PY_HAVE_CUDA != 0; });
  m.attr("__version__") = DS_PY_VERSION;
  m.def("encodings", [] {
    std::vector<std::string> out;
    for (Encoding e : AllEncodings()) out.emplace_back(EncodingName(e));
    return out;
  });
  m.def("dtype_size", [](const std::string& dtype) { return DTypeSize(Take(ParseDType(dtype))); });
  BindStream(m);
  BindStore(m);
  BindAgent(m);
}
