// The disk transport (include/deltasync/store.h) for deltasync.store: a
// publisher fed from in-memory tensors, a local checkpoint that pulls, and
// the store's listing and pruning.
#include <memory>
#include <optional>

#include "common.h"
#include "deltasync/codec.h"
#include "deltasync/store.h"

namespace deltasync::python {

std::vector<TensorView> HostViews(const TensorArgs& tensors, const char* what) {
  std::vector<TensorView> out;
  out.reserve(tensors.size());
  for (const TensorArg& t : tensors) {
    Check(t.Validate());
    Check(RequireHost(t, what));
    out.push_back(t.View());
  }
  return out;
}

py::dict PublishDict(const PublishResult& p) {
  py::dict d;
  d["version"] = p.info.version;
  d["is_delta"] = p.info.is_delta;
  d["dir"] = p.info.dir;
  d["tensors"] = p.tensors;
  d["tensors_changed"] = p.tensors_changed;
  d["changed_elements"] = p.changed_elements;
  d["total_elements"] = p.total_elements;
  d["bytes_written"] = p.bytes_written;
  d["seconds"] = p.seconds;
  return d;
}

PublisherOptions MakePublisherOptions(const std::string& store, const std::string& encoding,
                                      int64_t full_every, const std::string& checksum,
                                      int zstd_level) {
  PublisherOptions o;
  o.store = store;
  o.encoding = Take(ParseEncoding(encoding));
  o.checksum = Take(ParseChecksumAlgo(checksum));
  o.full_every = full_every;
  o.encode.zstd_level = zstd_level;
  return o;
}

namespace {

py::dict InfoDict(const VersionInfo& v) {
  py::dict d;
  d["version"] = v.version;
  d["dir"] = v.dir;
  d["is_delta"] = v.is_delta;
  d["base_version"] = v.is_delta ? py::object(py::int_(v.base_version)) : py::object(py::none());
  d["encoding"] = std::string(EncodingName(v.encoding));
  d["compression"] = v.compression;
  d["checksum"] = std::string(ChecksumAlgoName(v.checksum));
  d["tensors"] = v.tensors;
  d["bytes"] = v.bytes;
  return d;
}

py::dict PullDict(const PullResult& p) {
  py::dict d;
  d["from_version"] =
      p.from_version ? py::object(py::int_(*p.from_version)) : py::object(py::none());
  d["version"] = p.version;
  d["applied"] = p.applied;
  d["reset_to"] = p.reset_to ? py::object(py::int_(*p.reset_to)) : py::object(py::none());
  d["versions_applied"] = p.versions_applied;
  d["recovered"] = p.recovered;
  d["reseeded"] = p.reseeded;
  d["seconds"] = p.seconds;
  d["bytes_read"] = p.bytes_read;
  d["tensors_changed"] = p.tensors_changed;
  d["changed_elements"] = p.changed_elements;
  return d;
}

class PyPublisher {
 public:
  PyPublisher(const std::string& store, const TensorArgs& base, const std::string& base_path,
              const std::string& encoding, int64_t full_every, const std::string& checksum,
              int zstd_level) {
    const PublisherOptions o =
        MakePublisherOptions(store, encoding, full_every, checksum, zstd_level);
    const std::vector<TensorView> views = HostViews(base, "a publisher's base");
    Result<std::unique_ptr<Publisher>> p = Status::OK();
    {
      py::gil_scoped_release release;
      p = base_path.empty() ? Publisher::Create(o, views)
                            : Publisher::CreateFromCheckpoint(o, base_path);
    }
    publisher_.Set(Take(std::move(p)));
  }
  py::dict Publish(const TensorArgs& weights, bool full) {
    auto lease = publisher_.Enter("publish");
    const std::vector<TensorView> views = HostViews(weights, "publish");
    Result<PublishResult> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->Publish(views, full);
    }
    return PublishDict(Take(std::move(r)));
  }
  py::dict PublishCheckpoint(const std::string& path, bool full) {
    auto lease = publisher_.Enter("publish_checkpoint");
    Result<PublishResult> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->PublishCheckpoint(path, full);
    }
    return PublishDict(Take(std::move(r)));
  }
  int64_t latest_version() const { return publisher_.Use().latest_version(); }
  bool closed() const { return publisher_.closed(); }
  void Close() { publisher_.Close(); }

 private:
  Held<Publisher> publisher_{"Publisher"};
};

class PyLocalCheckpoint {
 public:
  PyLocalCheckpoint(const std::string& local, const std::string& store, const std::string& base,
                    bool replace_unknown, bool durable) {
    LocalCheckpointOptions o;
    o.local = local;
    o.store = store;
    o.base = base;
    o.replace_unknown_checkpoint = replace_unknown;
    o.durable = durable;
    Result<std::unique_ptr<LocalCheckpoint>> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = LocalCheckpoint::Open(o);
    }
    checkpoint_.Set(Take(std::move(r)));
  }
  py::dict Pull(std::optional<int64_t> target) {
    auto lease = checkpoint_.Enter("pull");
    Result<PullResult> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->Pull(target);
    }
    return PullDict(Take(std::move(r)));
  }
  std::optional<int64_t> CurrentVersion() {
    auto lease = checkpoint_.Enter("current_version");
    Result<std::optional<int64_t>> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->CurrentVersion();
    }
    return Take(std::move(r));
  }
  void Verify() {
    auto lease = checkpoint_.Enter("verify");
    Status s;
    {
      py::gil_scoped_release release;
      s = lease->Verify();
    }
    Check(s);
  }
  std::string local() const { return checkpoint_.Use().local(); }
  bool closed() const { return checkpoint_.closed(); }
  void Close() { checkpoint_.Close(); }

 private:
  Held<LocalCheckpoint> checkpoint_{"LocalCheckpoint"};
};

}  // namespace

void BindStore(py::module_& m) {
  py::class_<PyPublisher>(m, "Publisher")
      .def(py::init<const std::string&, const TensorArgs&, const std::string&, const std::string&,
                    int64_t, const std::string&, int>(),
           py::arg("store"), py::arg("base"), py::arg("base_path"), py::arg("encoding"),
           py::arg("full_every"), py::arg("checksum"), py::arg("zstd_level"))
      .def("publish", &PyPublisher::Publish)
      .def("publish_checkpoint", &PyPublisher::PublishCheckpoint)
      .def_property_readonly("latest_version", &PyPublisher::latest_version)
      .def_property_readonly("closed", &PyPublisher::closed)
      .def("close", &PyPublisher::Close);
  py::class_<PyLocalCheckpoint>(m, "LocalCheckpoint")
      .def(py::init<const std::string&, const std::string&, const std::string&, bool, bool>(),
           py::arg("local"), py::arg("store"), py::arg("base"), py::arg("replace_unknown"),
           py::arg("durable"))
      .def("pull", &PyLocalCheckpoint::Pull)
      .def("current_version", &PyLocalCheckpoint::CurrentVersion)
      .def("verify", &PyLocalCheckpoint::Verify)
      .def_property_readonly("local", &PyLocalCheckpoint::local)
      .def_property_readonly("closed", &PyLocalCheckpoint::closed)
      .def("close", &PyLocalCheckpoint::Close);
  m.def("list_versions", [](const std::string& store) {
    Result<std::vector<VersionInfo>> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = ListVersions(store);
    }
    py::list out;
    for (const VersionInfo& v : Take(std::move(r))) out.append(InfoDict(v));
    return out;
  });
  m.def("prune", [](const std::string& store, int64_t keep) {
    Result<std::vector<int64_t>> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = PruneStore(store, keep);
    }
    return Take(std::move(r));
  });
}

}  // namespace deltasync::python
