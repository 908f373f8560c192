// The stream (include/deltasync/stream.h) for deltasync.stream: the sender
// and receiver over a built-in communicator (gloo, nccl) or over a Python
// object (deltasync.torch_group: an existing torch.distributed group), and
// the shard placements of a sharded trainer.
#include <pybind11/numpy.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

#include "common.h"
#include "deltasync/communicator.h"
#include "deltasync/quantize.h"
#include "deltasync/shard.h"
#if DS_PY_HAVE_CUDA
#include "deltasync/cuda.h"
#endif

namespace deltasync::python {
namespace {

// A Communicator whose collectives are the methods of a Python object
// (deltasync/torch_group.py documents them). Each call takes the GIL; a
// Python exception becomes Unavailable (DeadlineExceeded for a timeout)
// with its text, and breaks the communicator.
class PyCommunicator final : public Communicator {
 public:
  // Reads the group's shape from `impl` (only touched under the GIL, which
  // this takes): InvalidArgument when it is not a communicator object.
  static Result<std::unique_ptr<Communicator>> Make(const py::object& impl) {
    py::gil_scoped_acquire gil;
    std::unique_ptr<PyCommunicator> c(new PyCommunicator());
    try {
      c->impl_ = impl;
      c->rank_ = impl.attr("rank").cast<int>();
      c->size_ = impl.attr("size").cast<int>();
      c->name_ = impl.attr("name").cast<std::string>();
      c->timeout_ = std::chrono::milliseconds(
          static_cast<int64_t>(impl.attr("timeout_s").cast<double>() * 1000));
      // An object that takes device memory says so (TorchGroup over NCCL).
      c->device_buffers_ =
          DS_PY_HAVE_CUDA && py::bool_(py::getattr(impl, "device_buffers", py::bool_(false)));
      if (c->device_buffers_) c->cuda_device_ = impl.attr("cuda_device").cast<int>();
    } catch (const std::exception& e) {
      return Status::InvalidArgument(std::string("a Python communicator: ") + e.what());
    }
    return std::unique_ptr<Communicator>(std::move(c));
  }
  ~PyCommunicator() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  std::string_view name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t generation() const override { return 0; }
  CommunicatorCapabilities capabilities() const override {
    CommunicatorCapabilities c;
    c.host_buffers = true;
    c.device_buffers = device_buffers_;
    c.cuda_device = cuda_device_;
    c.point_to_point = true;
    return c;
  }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  Status health() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  // A call in flight runs on to its own end (a torch collective cannot be
  // interrupted); later ones fail.
  void Cancel(std::string_view why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.ok()) broken_ = Status::Aborted("cancelled: " + std::string(why));
  }

  Status Send(int peer, std::span<const uint8_t> data) override {
    if (data.empty()) return Usable();
    py::gil_scoped_acquire gil;
    return CallHeld("send", peer, View(data));
  }
  Status Recv(int peer, std::span<uint8_t> data) override {
    if (data.empty()) return Usable();
    py::gil_scoped_acquire gil;
    return CallHeld("recv", peer, View(data));
  }
  Status Broadcast(int root, std::span<uint8_t> data) override {
    if (data.empty()) return Usable();
    py::gil_scoped_acquire gil;
    return CallHeld("broadcast", root, View(data));
  }
  Status Barrier() override {
    py::gil_scoped_acquire gil;
    return CallHeld("barrier");
  }
  Status Gather(int root, std::span<const uint8_t> record, std::span<uint8_t> out) override {
    if (rank_ == root && out.size() != record.size() * static_cast<size_t>(size_)) {
      return Status::InvalidArgument(name_ + " gather: out holds " + std::to_string(out.size()) +
                                     " bytes, not " + std::to_string(size_) + " records of " +
                                     std::to_string(record.size()));
    }
    if (record.empty()) return Usable();
    py::gil_scoped_acquire gil;
    py::object o = rank_ == root ? py::object(View(out)) : py::object(py::none());
    return CallHeld("gather", root, View(record), o);
  }
  Status AllGather(std::span<const uint8_t> record, std::span<uint8_t> out) override {
    if (out.size() != record.size() * static_cast<size_t>(size_)) {
      return Status::InvalidArgument(
          name_ + " all_gather: out holds " + std::to_string(out.size()) + " bytes, not " +
          std::to_string(size_) + " records of " + std::to_string(record.size()));
    }
    if (record.empty()) return Usable();
    py::gil_scoped_acquire gil;
    return CallHeld("all_gather", View(record), View(out));
  }

 private:
  // Host memory as a writable memoryview (torch.frombuffer warns on
  // read-only ones; the communicator's callers never write through a
  // record they send); device memory, for an object that takes it, as a
  // deltasync.torch_group.DeviceBytes (__cuda_array_interface__). Needs
  // the GIL.
  py::object View(std::span<const uint8_t> data) const {
#if DS_PY_HAVE_CUDA
    if (device_buffers_) {
      Result<cuda::MemoryKind> kind = cuda::QueryMemory(data.data());
      if (kind.ok() && *kind == cuda::MemoryKind::kDevice) {
        return py::module_::import("deltasync.torch_group")
            .attr("DeviceBytes")(reinterpret_cast<uintptr_t>(data.data()), data.size());
      }
    }
#endif
    return py::memoryview::from_memory(const_cast<uint8_t*>(data.data()),
                                       static_cast<py::ssize_t>(data.size()), false);
  }

  PyCommunicator() = default;
  Status Usable() const { return health(); }

  // Needs the GIL.
  template <typename... Args>
  Status CallHeld(const char* method, Args&&... args) {
    if (Status s = Usable(); !s.ok()) return s;
    try {
      impl_.attr(method)(std::forward<Args>(args)...);
      return Usable();
    } catch (py::error_already_set& e) {
      const bool timeout = e.matches(PyExc_TimeoutError) ||
                           std::string(e.what()).find("imed out") != std::string::npos;
      const std::string text = name_ + " " + method + ": " + e.what();
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.ok())
        broken_ = timeout ? Status::DeadlineExceeded(text) : Status::Unavailable(text);
      return broken_;
    }
  }

  py::object impl_;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  std::chrono::milliseconds timeout_{0};
  bool device_buffers_ = false;
  int cuda_device_ = -1;
  mutable std::mutex mu_;  // broken_: Cancel and health come from any thread
  Status broken_;
};

// How a sender or receiver reaches its group: a built-in communicator by
// name and options, or a Python object (see PyCommunicator). A factory may
// be called again after a failure (reconnect), so it makes a new one each
// time.
struct Connect {
  std::string backend;  // "gloo", "nccl", or "" for `impl`
  CommunicatorOptions options;
  py::object impl;

  CommunicatorFactory Factory() const {
    if (backend.empty()) {
      // The factory may die where the GIL is not held: its copy of the
      // object takes the GIL to let go.
      std::shared_ptr<py::object> held(new py::object(impl), [](py::object* p) {
        py::gil_scoped_acquire gil;
        delete p;
      });
      return [held, key = options.auth_key]() -> Result<std::unique_ptr<Communicator>> {
        DS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, PyCommunicator::Make(*held));
        if (!key) return c;
        const std::string name(c->name());
        return AuthenticateCommunicator(std::move(c), *key, name);
      };
    }
    return [b = backend, o = options]() { return CreateCommunicator(b, o); };
  }
};

// The stream key a group object names (`key_file`), or the environment's
// (AuthKeyFromEnvironment), or none.
std::optional<AuthKey> KeyOf(const py::object& spec) {
  const std::string file = py::str(py::getattr(spec, "key_file", py::str(""))).cast<std::string>();
  if (!file.empty()) return Take(DeriveAuthKey(Take(ReadSecretFile(file))));
  return Take(AuthKeyFromEnvironment());
}

Connect MakeConnect(const py::object& spec) {
  Connect c;
  if (py::hasattr(spec, "backend") && !py::isinstance<py::str>(spec)) {
    c.backend = spec.attr("backend").cast<std::string>();
    c.options.auth_key = KeyOf(spec);
    if (c.backend.empty()) {
      c.impl = spec.attr("impl");
      return c;
    }
    CommunicatorOptions& o = c.options;
    o.rendezvous = Take(ParseRendezvous(spec.attr("rendezvous").cast<std::string>()));
    o.rank = spec.attr("rank").cast<int>();
    o.size = spec.attr("size").cast<int>();
    o.group = spec.attr("group").cast<std::string>();
    o.hostname = spec.attr("hostname").cast<std::string>();
    o.timeout = std::chrono::milliseconds(
        static_cast<int64_t>(spec.attr("timeout_s").cast<double>() * 1000));
    o.connect_timeout = std::chrono::milliseconds(
        static_cast<int64_t>(spec.attr("connect_timeout_s").cast<double>() * 1000));
    o.cuda_device = spec.attr("cuda_device").cast<int>();
    const std::string password_file =
        py::str(py::getattr(spec, "redis_password_file", py::str(""))).cast<std::string>();
    if (!password_file.empty()) o.rendezvous.password = Take(ReadSecretFile(password_file));
    return c;
  }
  Raise(Status::InvalidArgument("a communicator: expected deltasync.Group or a torch group"));
}

py::dict SyncDict(const SyncStats& s) {
  py::dict d;
  d["sync_id"] = s.sync_id;
  d["receivers"] = s.receivers;
  d["seeded"] = s.seeded;
  d["partial_receivers"] = s.partial_receivers;
  d["changed"] = s.changed;
  d["sent_elements"] = s.sent_elements;
  d["frames"] = s.frames;
  d["device_frames"] = s.device_frames;
  d["bytes_sent"] = s.bytes_sent;
  d["verify_all"] = s.verify_all;
  d["buffer_bytes"] = s.buffer_bytes;
  d["quantize_s"] = s.quantize_s;
  d["diff_s"] = s.diff_s;
  d["encode_s"] = s.encode_s;
  d["transfer_s"] = s.transfer_s;
  d["report_s"] = s.report_s;
  d["commit_s"] = s.commit_s;
  d["committed_bytes"] = s.committed_bytes;
  d["total_s"] = s.total_s;
  return d;
}

py::dict ReceiveDict(const ReceiveStats& s) {
  py::dict d;
  d["sync_id"] = s.sync_id;
  d["seed"] = s.seed;
  d["partial"] = s.partial;
  d["tensors"] = s.tensors;
  d["verify_all"] = s.verify_all;
  d["frames"] = s.frames;
  d["device_frames"] = s.device_frames;
  d["bytes"] = s.bytes;
  d["elements_written"] = s.elements_written;
  d["wait_s"] = s.wait_s;
  d["receive_s"] = s.receive_s;
  d["apply_s"] = s.apply_s;
  d["verify_s"] = s.verify_s;
  return d;
}

class PySender {
 public:
  PySender(
      const py::object& group, const py::object& trainers, const std::string& encoding,
      uint64_t bucket_bytes, uint32_t verify_every, int zstd_level, bool pinned_snapshot,
      uint32_t threads, bool dense_by_time,
      const std::map<std::string, std::tuple<std::string, std::string, std::string>>& quantize) {
    SenderOptions so;
    for (const auto& [name, spec] : quantize) {
      so.quantize[name] = {ParseQuantRecipe(std::get<0>(spec), std::get<1>(spec)),
                           std::get<2>(spec)};
    }
    so.pinned_snapshot = pinned_snapshot;
    so.threads = threads;
    so.dense_by_time = dense_by_time;
    so.encoding = Take(ParseStreamEncoding(encoding));
    so.bucket_bytes = bucket_bytes;
    so.verify_every = verify_every;
    so.zstd_level = zstd_level;
    // A sharded trainer's ranks other than 0 have no stream group.
    const CommunicatorFactory stream =
        group.is_none() ? CommunicatorFactory() : MakeConnect(group).Factory();
    std::optional<CommunicatorFactory> trainer;
    if (!trainers.is_none()) trainer = MakeConnect(trainers).Factory();
    Result<std::unique_ptr<StreamSender>> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = trainer ? StreamSender::CreateSharded(*trainer, stream, so)
                  : StreamSender::Create(stream, so);
    }
    sender_.Set(Take(std::move(r)));
  }

  py::dict Sync(const TensorArgs& tensors) {
    auto lease = sender_.Enter("sync");
    std::vector<SyncTensor> ts;
    ts.reserve(tensors.size());
    for (const TensorArg& t : tensors) {
      Check(t.Validate());
      ts.push_back({t.name, t.ParsedDType(), t.shape, t.bytes(), t.place()});
    }
    Result<SyncStats> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->Sync(ts);
    }
    return SyncDict(Take(std::move(r)));
  }

  py::dict SyncShards(
      const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>& model,
      const std::vector<std::pair<ShardSpec, TensorArg>>& shards) {
    auto lease = sender_.Enter("sync_shards");
    std::vector<ModelTensor> m;
    for (const auto& [name, dtype, shape] : model) {
      m.push_back({name, Take(ParseDType(dtype)), shape});
    }
    std::vector<ShardedTensor> s;
    for (const auto& [spec, t] : shards) {
      Check(t.Validate());
      if (spec.dtype != t.ParsedDType() || spec.local_shape != t.shape) {
        Raise(Status::InvalidArgument("tensor '" + t.name + "': " + t.dtype + " " +
                                      ShapeText(t.shape) + ", but its shard spec says " +
                                      std::string(DTypeName(spec.dtype)) + " " +
                                      ShapeText(spec.local_shape)));
      }
      s.push_back({spec, t.bytes(), t.place()});
    }
    Result<SyncStats> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->SyncShards(m, s);
    }
    return SyncDict(Take(std::move(r)));
  }

  py::bytes Snapshot(const std::string& name) {
    auto lease = sender_.Enter("snapshot");
    const std::span<const uint8_t> s = Take(lease->Snapshot(name));
    return py::bytes(reinterpret_cast<const char*>(s.data()), s.size());
  }

  uint64_t committed_sync_id() const { return sender_.Use().committed_sync_id(); }
  bool closed() const { return sender_.closed(); }
  void Close() { sender_.Close(); }

 private:
  Held<StreamSender> sender_{"StreamSender"};
};

// Where a registered Python tensor's memory was at registration, to refuse
// a sync into memory it no longer owns (its storage swapped, freed or
// shrunk: `t.data = ...`, `set_`, `untyped_storage().resize_(0)`).
struct HeldTensor {
  std::string name;
  py::object tensor;  // a torch tensor; none for numpy memory, which cannot move
  uintptr_t ptr = 0;
  uint64_t nbytes = 0;
};

class PyReceiver {
 public:
  PyReceiver(const py::object& group, uint64_t max_frame_bytes, std::optional<double> sync_wait_s,
             bool partial) {
    ReceiverOptions ro;
    ro.max_frame_bytes = max_frame_bytes;
    if (sync_wait_s) {
      if (!(*sync_wait_s > 0)) {
        Raise(Status::InvalidArgument("StreamReceiver: sync_wait_s must be positive or None"));
      }
      ro.sync_wait = std::chrono::milliseconds(static_cast<int64_t>(*sync_wait_s * 1000));
    }
    ro.partial = partial;
    ro.before_apply = [this]() -> Status {
      py::gil_scoped_acquire gil;
      return CheckDestinations();
    };
    const CommunicatorFactory f = MakeConnect(group).Factory();
    Result<std::unique_ptr<StreamReceiver>> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = StreamReceiver::Create(f, ro);
    }
    receiver_.Set(Take(std::move(r)));
  }

  void Register(const TensorArg& t, const py::object& tensor,
                const std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t>>& runs,
                const std::string& hf_dtype, const std::vector<int64_t>& hf_shape) {
    auto lease = receiver_.Enter("register");
    Check(t.Validate());
    if (!t.writable) Raise(Status::InvalidArgument("tensor '" + t.name + "': read-only"));
    std::vector<DestinationRun> rs;
    rs.reserve(runs.size());
    for (const auto& [first, count, offset, stride] : runs) {
      rs.push_back({first, count, offset, stride});
    }
    const DType dtype = hf_dtype.empty() ? t.ParsedDType() : Take(ParseDType(hf_dtype));
    Check(lease->Register(t.name, dtype, runs.empty() ? t.shape : hf_shape, t.mutable_bytes(), rs,
                          t.place()));
    held_.push_back({t.name, tensor, t.ptr, t.nbytes});
  }

  void Rebind(const TensorArg& t, const py::object& tensor) {
    auto lease = receiver_.Enter("rebind");
    Check(t.Validate());
    if (!t.writable) Raise(Status::InvalidArgument("tensor '" + t.name + "': read-only"));
    Check(lease->Rebind(t.name, t.mutable_bytes(), t.place()));
    for (HeldTensor& h : held_) {
      if (h.name == t.name) h = {t.name, tensor, t.ptr, t.nbytes};
    }
  }

  py::dict Receive() {
    auto lease = receiver_.Enter("receive");
    Result<ReceiveStats> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->ReceiveSync();
    }
    return ReceiveDict(Take(std::move(r)));
  }

  py::dict Health() const {
    const StreamReceiver::Health h = receiver_.Use().health();
    py::dict d;
    d["connected"] = h.connected;
    d["seeded"] = h.seeded;
    d["in_call"] = h.in_call;
    d["waiting"] = h.waiting;
    d["waiting_s"] = h.waiting_s;
    d["last_sync_id"] = h.last_sync_id;
    d["failures_in_a_row"] = h.failures_in_a_row;
    d["ok"] = h.link.ok();
    d["error"] = h.link.ok() ? std::string() : h.link.ToString();
    return d;
  }
  bool closed() const { return receiver_.closed(); }
  void Close() { receiver_.Close(); }

 private:
  // Needs the GIL. FailedPrecondition naming the first registered torch
  // tensor whose memory is no longer where it was registered.
  Status CheckDestinations() const {
    static const py::object memory_of = py::module_::import("deltasync._tensors").attr("memory_of");
    for (const HeldTensor& h : held_) {
      if (h.tensor.is_none()) continue;
      uintptr_t ptr = 0;
      uint64_t owned = 0;
      try {
        auto [p, n] = memory_of(h.tensor).cast<std::pair<uintptr_t, uint64_t>>();
        ptr = p;
        owned = n;
      } catch (const std::exception& e) {
        return Status::FailedPrecondition("tensor '" + h.name +
                                          "': its memory cannot be checked: " + e.what());
      }
      const std::string what = "tensor '" + h.name + "': ";
      if (ptr != h.ptr) {
        return Status::FailedPrecondition(
            what + "its memory moved since it was registered (" + Hex(h.ptr) + " -> " + Hex(ptr) +
            "; its storage was replaced or freed): nothing was written; call rebind('" + h.name +
            "', tensor) with the tensor's new memory (the receiver is then reseeded)");
      }
      if (owned < h.nbytes) {
        return Status::FailedPrecondition(
            what + "its storage holds " + std::to_string(owned) + " bytes from the tensor on, " +
            std::to_string(h.nbytes) + " were registered (it was freed or shrunk): nothing was " +
            "written; give it its memory back, or rebind('" + h.name + "', tensor)");
      }
    }
    return Status::OK();
  }

  static std::string Hex(uintptr_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
    return buf;
  }

  std::vector<HeldTensor> held_;
  // Last, so that the receiver (whose before_apply reads held_) goes first.
  Held<StreamReceiver> receiver_{"StreamReceiver"};
};

ShardSpec Named(Result<ShardSpec> r) { return Take(std::move(r)); }

// The windows' bounds, (row_begin, row_end, col_begin, col_end) each, of
// the 2-D weight `name` of `shape`; InvalidArgument otherwise.
std::vector<QuantWindow> WindowBounds(const std::string& name,
                                      const std::vector<std::vector<int64_t>>& windows,
                                      const std::vector<int64_t>& shape, std::string_view caller) {
  const auto bad = [&](const std::string& what) {
    Raise(Status::InvalidArgument("tensor '" + name + "': " + std::string(caller) + ": " + what));
  };
  if (shape.size() != 2) bad("the weight's shape must be 2-D");
  std::vector<QuantWindow> bounds;
  for (const std::vector<int64_t>& w : windows) {
    if (w.size() != 4) bad("each window is (row_begin, row_end, col_begin, col_end)");
    bounds.push_back({nullptr, w[0], w[1], w[2], w[3]});
  }
  return bounds;
}

// Rank `comm`.rank's window of a sharded weight quantized as the whole
// weight would be (Fp8QuantizeShard): (codes of the window, scales of the
// scale groups it touches, (row_begin, row_end, col_begin, col_end) of
// those groups in the scale grid).
py::tuple QuantizeShardOver(Communicator& comm, const TensorArg& window,
                            const std::vector<std::vector<int64_t>>& windows,
                            const std::vector<int64_t>& shape, const std::string& scheme,
                            const std::string& scale_format) {
  Check(window.Validate());
  Check(RequireHost(window, "quantize_fp8_shard"));
  const QuantRecipe recipe = ParseQuantRecipe(scheme, scale_format);
  const auto bad = [&](const std::string& what) {
    Raise(Status::InvalidArgument("tensor '" + window.name + "': quantize_fp8_shard: " + what));
  };
  std::vector<QuantWindow> bounds = WindowBounds(window.name, windows, shape, "quantize_fp8_shard");
  const QuantTensor tensor{window.name, window.ParsedDType(), shape};
  const int me = comm.rank();
  if (me < 0 || me >= static_cast<int>(bounds.size())) {
    bad(std::to_string(bounds.size()) + " windows for a group of " + std::to_string(comm.size()));
  }
  const QuantWindow& mine = bounds[me];
  if ((mine.row_end - mine.row_begin) * (mine.col_end - mine.col_begin) !=
          static_cast<int64_t>(window.nbytes / DTypeSize(tensor.dtype)) ||
      window.shape.size() != 2 || window.shape[0] != mine.row_end - mine.row_begin) {
    bad("this rank's tensor is not the shape of its window");
  }
  bounds[me].data = reinterpret_cast<const void*>(window.ptr);
  const QuantGroups groups = Take(Fp8WindowGroups(recipe, tensor, bounds[me]));
  const bool f32 = QuantScaleDType(recipe.scale_format) == DType::kF32;
  py::array codes(py::dtype("uint8"), window.shape);
  py::array scales(
      py::dtype(f32 ? "float32" : "uint8"),
      std::vector<int64_t>{groups.row_end - groups.row_begin, groups.col_end - groups.col_begin});
  Status s;
  {
    py::gil_scoped_release release;
    s = Fp8QuantizeShard(comm, recipe, tensor, bounds, static_cast<uint8_t*>(codes.mutable_data()),
                         scales.mutable_data());
  }
  Check(s);
  return py::make_tuple(
      codes, scales,
      py::make_tuple(groups.row_begin, groups.row_end, groups.col_begin, groups.col_end));
}

// Forms `group`'s communicator (a collective), the GIL released.
std::unique_ptr<Communicator> FormCommunicator(const py::object& group) {
  const Connect connect = MakeConnect(group);
  Result<std::unique_ptr<Communicator>> made = Status::Internal("not formed");
  {
    py::gil_scoped_release release;
    made = connect.Factory()();
  }
  return Take(std::move(made));
}

py::tuple PyQuantizeFp8Shard(const py::object& group, const TensorArg& window,
                             const std::vector<std::vector<int64_t>>& windows,
                             const std::vector<int64_t>& shape, const std::string& scheme,
                             const std::string& scale_format) {
  std::unique_ptr<Communicator> comm = FormCommunicator(group);
  py::tuple out = QuantizeShardOver(*comm, window, windows, shape, scheme, scale_format);
  py::gil_scoped_release release;
  comm.reset();
  return out;
}

// The ShardSpecs of rank `rank`'s codes and scales (Fp8ShardSpecsOf).
py::tuple PyFp8ShardSpecs(const std::string& name, const std::vector<std::vector<int64_t>>& windows,
                          const std::vector<int64_t>& shape, int rank, const std::string& scheme,
                          const std::string& scale_format, const std::string& scale_name) {
  const QuantRecipe recipe = ParseQuantRecipe(scheme, scale_format);
  const std::vector<QuantWindow> bounds = WindowBounds(name, windows, shape, "fp8_shard_specs");
  // The dtype only decides which elements a window reads; any will do.
  const QuantTensor tensor{name, DType::kBF16, shape};
  Fp8ShardSpecs specs = Take(Fp8ShardSpecsOf(recipe, tensor, bounds, rank, scale_name));
  return py::make_tuple(std::move(specs.codes), std::move(specs.scales));
}

// Fp8ShardQuantizer: one communicator over the trainer's ranks, formed
// once, for every weight of every step (quantize_fp8_shard forms one per
// call).
class ShardQuantizer {
 public:
  explicit ShardQuantizer(const py::object& group) : comm_(FormCommunicator(group)) {}

  py::tuple Quantize(const TensorArg& window, const std::vector<std::vector<int64_t>>& windows,
                     const std::vector<int64_t>& shape, const std::string& scheme,
                     const std::string& scale_format) {
    if (!comm_) {
      Raise(Status::FailedPrecondition("Fp8ShardQuantizer is closed (make a new one)"));
    }
    return QuantizeShardOver(*comm_, window, windows, shape, scheme, scale_format);
  }

  void Close() {
    std::unique_ptr<Communicator> comm = std::move(comm_);
    py::gil_scoped_release release;
    comm.reset();
  }
  int rank() const { return comm_ ? comm_->rank() : -1; }
  int size() const { return comm_ ? comm_->size() : 0; }

 private:
  std::unique_ptr<Communicator> comm_;
};

}  // namespace

void BindStream(py::module_& m) {
  m.def("quantize_fp8_shard", &PyQuantizeFp8Shard, py::arg("group"), py::arg("window"),
        py::arg("windows"), py::arg("shape"), py::arg("scheme"), py::arg("scale_format"));
  m.def("fp8_shard_specs", &PyFp8ShardSpecs, py::arg("name"), py::arg("windows"), py::arg("shape"),
        py::arg("rank"), py::arg("scheme"), py::arg("scale_format"), py::arg("scale_name"));
  py::class_<ShardQuantizer>(m, "Fp8ShardQuantizer")
      .def(py::init<const py::object&>(), py::arg("group"))
      .def("quantize", &ShardQuantizer::Quantize, py::arg("window"), py::arg("windows"),
           py::arg("shape"), py::arg("scheme"), py::arg("scale_format"))
      .def("close", &ShardQuantizer::Close)
      .def_property_readonly("rank", &ShardQuantizer::rank)
      .def_property_readonly("size", &ShardQuantizer::size);
  py::class_<ShardPiece>(m, "ShardPiece",
                         "A box or flat range of one checkpoint tensor inside a local tensor.")
      .def_readonly("hf_name", &ShardPiece::hf_name)
      .def_readonly("hf_shape", &ShardPiece::hf_shape)
      .def_readonly("local_offset", &ShardPiece::local_offset)
      .def_readonly("hf_offset", &ShardPiece::hf_offset)
      .def_readonly("extent", &ShardPiece::extent)
      .def_readonly("contributes", &ShardPiece::contributes)
      .def_property_readonly("elements", &ShardPiece::elements);
  py::class_<ShardSpec>(m, "ShardSpec",
                        "Which parts of which checkpoint tensors one trainer rank's local tensor "
                        "holds (a sharded trainer's StreamSender.sync_shards). Made by its static "
                        "constructors: whole, replicate, shard, shard_sizes, box, flat_range, "
                        "fused, from_dtensor.")
      .def_property_readonly(
          "dtype", [](const ShardSpec& s) { return std::string(DTypeName(s.dtype)); },
          "The local tensor's dtype (a safetensors name).")
      .def_readonly("local_shape", &ShardSpec::local_shape, "The local tensor's shape.")
      .def_readonly("pieces", &ShardSpec::pieces,
                    "The ShardPieces that cover the local tensor exactly.")
      .def_readwrite("contributes", &ShardSpec::contributes,
                     "False for a replica whose values another rank sends.")
      .def_property_readonly("local_numel", &ShardSpec::local_numel,
                             "Elements of the local tensor.")
      .def_static(
          "whole",
          [](std::string name, const std::string& dtype, std::vector<int64_t> shape) {
            return Named(
                ShardSpec::Whole(std::move(name), Take(ParseDType(dtype)), std::move(shape)));
          },
          "A tensor held whole: whole(name, dtype, shape).")
      .def_static(
          "replicate",
          [](std::string name, const std::string& dtype, std::vector<int64_t> shape,
             bool contributes) {
            return Named(ShardSpec::Replicate(std::move(name), Take(ParseDType(dtype)),
                                              std::move(shape), contributes));
          },
          "A replica of a whole tensor; only one with contributes=True sends it.")
      .def_static(
          "shard",
          [](std::string name, const std::string& dtype, std::vector<int64_t> shape, int dim,
             int64_t index, int64_t count) {
            return Named(ShardSpec::Shard(std::move(name), Take(ParseDType(dtype)),
                                          std::move(shape), dim, index, count));
          },
          "Part `index` of `count` equal parts along `dim`: shard(name, dtype, shape, dim, index, "
          "count).")
      .def_static(
          "shard_sizes",
          [](std::string name, const std::string& dtype, std::vector<int64_t> shape, int dim,
             std::vector<int64_t> sizes, int64_t index) {
            return Named(ShardSpec::ShardSizes(std::move(name), Take(ParseDType(dtype)),
                                               std::move(shape), dim, std::move(sizes), index));
          },
          "Part `index` of uneven parts of `sizes` along `dim`.")
      .def_static(
          "box",
          [](std::string name, const std::string& dtype, std::vector<int64_t> shape,
             std::vector<int64_t> offset, std::vector<int64_t> extent) {
            return Named(ShardSpec::Box(std::move(name), Take(ParseDType(dtype)), std::move(shape),
                                        std::move(offset), std::move(extent)));
          },
          "The box at `offset` of `extent` of a tensor of `shape`.")
      .def_static(
          "flat_range",
          [](std::string name, const std::string& dtype, std::vector<int64_t> hf_shape,
             int64_t hf_first, int64_t count) {
            return Named(ShardSpec::FlatRange(std::move(name), Take(ParseDType(dtype)),
                                              std::move(hf_shape), hf_first, count));
          },
          "Flat elements hf_first .. hf_first+count-1 of a tensor (FSDP1 flat parameters).")
      .def_static(
          "fused",
          [](const std::string& dtype, int dim, const std::vector<ShardSpec>& parts) {
            return Named(ShardSpec::Fused(Take(ParseDType(dtype)), dim, parts));
          },
          "Parts concatenated along `dim` in one local tensor (vLLM's fused QKV, gate/up).")
      .def_static(
          "megatron_qkv",
          [](const std::string& q, const std::string& k, const std::string& v,
             const std::string& dtype, int64_t num_heads, int64_t num_query_groups,
             int64_t head_dim, int64_t hidden, int64_t tp_rank, int64_t tp_size) {
            return Named(ShardSpec::MegatronQkv(q, k, v, Take(ParseDType(dtype)), num_heads,
                                                num_query_groups, head_dim, hidden, tp_rank,
                                                tp_size));
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dtype"), py::arg("num_heads"),
          py::arg("num_query_groups"), py::arg("head_dim"), py::arg("hidden"), py::arg("tp_rank"),
          py::arg("tp_size"),
          "Tensor-parallel rank tp_rank's part of Megatron's fused linear_qkv weight (heads "
          "interleaved per query group: its query heads, its key head, its value head), as the "
          "HF q, k and v projections.")
      .def_static(
          "stacked_experts",
          [](const std::string& dtype, const std::vector<std::vector<std::string>>& experts,
             std::vector<int64_t> part_shape) {
            return Named(
                ShardSpec::StackedExperts(Take(ParseDType(dtype)), experts, std::move(part_shape)));
          },
          py::arg("dtype"), py::arg("experts"), py::arg("part_shape"),
          "An expert-parallel rank's experts stacked in one local tensor [len(experts), "
          "parts * part_shape[0], ...]: slice i is the HF tensors experts[i] (one name each for "
          "a stacked down_proj, gate then up for a fused w13) along their first dimension.")
      .def(
          "validate", [](const ShardSpec& s) { Check(s.Validate()); },
          "Raises InvalidArgumentError unless the pieces cover the local tensor exactly.");

  py::class_<PySender>(m, "StreamSender")
      .def(py::init<
               const py::object&, const py::object&, const std::string&, uint64_t, uint32_t, int,
               bool, uint32_t, bool,
               const std::map<std::string, std::tuple<std::string, std::string, std::string>>&>(),
           py::arg("group"), py::arg("trainers"), py::arg("encoding"), py::arg("bucket_bytes"),
           py::arg("verify_every"), py::arg("zstd_level"), py::arg("pinned_snapshot") = false,
           py::arg("threads") = 0, py::arg("dense_by_time") = true,
           py::arg("quantize") =
               std::map<std::string, std::tuple<std::string, std::string, std::string>>())
      .def("sync", &PySender::Sync)
      .def("sync_shards", &PySender::SyncShards)
      .def("snapshot", &PySender::Snapshot)
      .def_property_readonly("committed_sync_id", &PySender::committed_sync_id)
      .def_property_readonly("closed", &PySender::closed)
      .def("close", &PySender::Close);
  py::class_<PyReceiver>(m, "StreamReceiver")
      .def(py::init<const py::object&, uint64_t, std::optional<double>, bool>(), py::arg("group"),
           py::arg("max_frame_bytes"), py::arg("sync_wait_s"), py::arg("partial"))
      .def("register", &PyReceiver::Register)
      .def("rebind", &PyReceiver::Rebind)
      .def("receive", &PyReceiver::Receive)
      .def("health", &PyReceiver::Health)
      .def_property_readonly("closed", &PyReceiver::closed)
      .def("close", &PyReceiver::Close);
  m.def("parse_rendezvous", [](const std::string& spec) { (void)Take(ParseRendezvous(spec)); });
  m.def("built_communicators", [] {
    std::vector<std::string> out;
    for (std::string_view n : BuiltCommunicators()) out.emplace_back(n);
    return out;
  });
}

}  // namespace deltasync::python
