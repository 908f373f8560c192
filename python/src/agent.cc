// The agent (include/deltasync/agent.h) for deltasync.agent: the HTTP agent
// an engine host runs (its reload step may be a Python callable), the
// client call that has agents pull, and the coordinator that publishes and
// then has every engine pull.
#include <memory>
#include <optional>

#include "common.h"
#include "deltasync/agent.h"
#include "deltasync/store.h"

namespace deltasync::python {

namespace {

EnginePullOptions PullOptions(const std::string& token, double connect_timeout_s, double timeout_s,
                              int retries) {
  EnginePullOptions o;
  o.token = token;
  o.connect_timeout_seconds = connect_timeout_s;
  o.timeout_seconds = timeout_s;
  o.retries = retries;
  return o;
}

py::dict OutcomeDict(const EnginePullOutcome& e) {
  py::dict d;
  d["engine"] = e.engine;
  d["ok"] = e.ok;
  d["error"] = e.error;
  d["error_code"] = e.error_code;
  d["http_status"] = e.http_status;
  d["attempts"] = e.attempts;
  d["seconds"] = e.seconds;
  d["version"] = e.version ? py::object(py::int_(*e.version)) : py::object(py::none());
  d["applied"] = e.applied;
  d["bytes_read"] = e.bytes_read;
  d["tensors_changed"] = e.tensors_changed;
  return d;
}

py::list OutcomeList(const std::vector<EnginePullOutcome>& outcomes) {
  py::list out;
  for (const EnginePullOutcome& e : outcomes) out.append(OutcomeDict(e));
  return out;
}

// {"outcomes": [...], "error": None or (code, message)}: the Python layer
// raises for a failure with the outcomes attached.
py::dict Outcomes(const std::vector<EnginePullOutcome>& outcomes) {
  py::dict d;
  d["engines"] = OutcomeList(outcomes);
  const Status s = SummarizeEngineOutcomes(outcomes);
  d["error"] = s.ok() ? py::object(py::none())
                      : py::object(py::make_tuple(static_cast<int>(s.code()), s.message()));
  return d;
}

// An EngineReloader that calls a Python callable(model_path, version).
class PyReloader final : public EngineReloader {
 public:
  explicit PyReloader(py::object fn) : fn_(std::move(fn)) {}
  ~PyReloader() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  Status Reload(const std::string& model_path, int64_t version) override {
    py::gil_scoped_acquire gil;
    try {
      fn_(model_path, version);
      return Status::OK();
    } catch (py::error_already_set& e) {
      return Status::Aborted("reload callback: " + std::string(e.what()));
    }
  }
  std::string Describe() const override { return "a Python callable"; }

 private:
  py::object fn_;
};

class PyAgent {
 public:
  PyAgent(const std::string& local, const std::string& store, const std::string& base,
          const py::object& reload, const std::string& reload_url,
          const std::string& reload_command, const std::string& host, int port,
          const std::string& token, bool verify_after_pull) {
    LocalCheckpointOptions lo;
    lo.local = local;
    lo.store = store;
    lo.base = base;
    AgentOptions ao;
    ao.host = host;
    ao.port = port;
    ao.token = token;
    ao.verify_after_pull = verify_after_pull;
    ao.request_nice = 0;
    std::unique_ptr<EngineReloader> reloader;
    if (!reload.is_none()) {
      reloader = std::make_unique<PyReloader>(reload);
    } else if (!reload_url.empty()) {
      reloader = Take(MakeHttpReloader(reload_url));
    } else if (!reload_command.empty()) {
      reloader = Take(MakeCommandReloader(reload_command));
    }
    Result<std::unique_ptr<Agent>> r = Status::OK();
    {
      py::gil_scoped_release release;
      Result<std::unique_ptr<CheckpointPuller>> puller = OpenLocalCheckpointPuller(lo);
      if (!puller.ok()) {
        r = puller.status();
      } else {
        r = Agent::Create(ao, std::move(*puller), std::move(reloader));
        if (r.ok()) {
          if (Status s = (*r)->Start(); !s.ok()) r = s;
        }
      }
    }
    agent_ = Take(std::move(r));
  }
  ~PyAgent() { Stop(); }
  int port() const {
    if (!agent_) Raise(Status::FailedPrecondition("Agent is stopped"));
    return agent_->port();
  }
  bool stopped() const { return agent_ == nullptr; }
  void Stop() {
    py::gil_scoped_release release;
    if (agent_) agent_->Stop();
    agent_.reset();
  }

 private:
  std::unique_ptr<Agent> agent_;
};

class PyCoordinator {
 public:
  PyCoordinator(const std::string& store, const TensorArgs& base, const std::string& base_path,
                const std::vector<std::string>& engines, const std::string& encoding,
                int64_t full_every, const std::string& checksum, int zstd_level,
                const std::string& token, double connect_timeout_s, double timeout_s, int retries) {
    const PublisherOptions po =
        MakePublisherOptions(store, encoding, full_every, checksum, zstd_level);
    SyncOptions so;
    so.engines = engines;
    so.pull = PullOptions(token, connect_timeout_s, timeout_s, retries);
    Check(CheckEngineUrls(engines));
    const std::vector<TensorView> views = HostViews(base, "a coordinator's base");
    Result<std::unique_ptr<SyncCoordinator>> r = Status::OK();
    {
      py::gil_scoped_release release;
      Result<std::unique_ptr<Publisher>> p = base_path.empty()
                                                 ? Publisher::Create(po, views)
                                                 : Publisher::CreateFromCheckpoint(po, base_path);
      r = p.ok() ? SyncCoordinator::Create(so, std::move(*p))
                 : Result<std::unique_ptr<SyncCoordinator>>(p.status());
    }
    coordinator_.Set(Take(std::move(r)));
  }
  py::dict Sync(const TensorArgs& weights, bool full) {
    auto lease = coordinator_.Enter("sync");
    const std::vector<TensorView> views = HostViews(weights, "a coordinated sync");
    Result<SyncReport> r = Status::OK();
    {
      py::gil_scoped_release release;
      r = lease->Sync(views, full);
    }
    const SyncReport report = Take(std::move(r));
    py::dict d = Outcomes(report.engines);
    d["version"] = report.version;
    d["publish"] = PublishDict(report.publish);
    d["publish_seconds"] = report.publish_seconds;
    d["pull_seconds"] = report.pull_seconds;
    d["total_seconds"] = report.total_seconds;
    return d;
  }
  py::dict PullAll(std::optional<int64_t> target) {
    auto lease = coordinator_.Enter("pull_all");
    std::vector<EnginePullOutcome> outcomes;
    {
      py::gil_scoped_release release;
      outcomes = lease->PullAll(target);
    }
    return Outcomes(outcomes);
  }
  int64_t latest_version() { return coordinator_.Use().publisher().latest_version(); }
  bool closed() const { return coordinator_.closed(); }
  void Close() { coordinator_.Close(); }

 private:
  Held<SyncCoordinator> coordinator_{"SyncCoordinator"};
};

}  // namespace

void BindAgent(py::module_& m) {
  py::class_<PyAgent>(m, "Agent")
      .def(py::init<const std::string&, const std::string&, const std::string&, const py::object&,
                    const std::string&, const std::string&, const std::string&, int,
                    const std::string&, bool>(),
           py::arg("local"), py::arg("store"), py::arg("base"), py::arg("reload"),
           py::arg("reload_url"), py::arg("reload_command"), py::arg("host"), py::arg("port"),
           py::arg("token"), py::arg("verify_after_pull"))
      .def_property_readonly("port", &PyAgent::port)
      .def_property_readonly("stopped", &PyAgent::stopped)
      .def("close", &PyAgent::Stop);
  py::class_<PyCoordinator>(m, "SyncCoordinator")
      .def(py::init<const std::string&, const TensorArgs&, const std::string&,
                    const std::vector<std::string>&, const std::string&, int64_t,
                    const std::string&, int, const std::string&, double, double, int>(),
           py::arg("store"), py::arg("base"), py::arg("base_path"), py::arg("engines"),
           py::arg("encoding"), py::arg("full_every"), py::arg("checksum"), py::arg("zstd_level"),
           py::arg("token"), py::arg("connect_timeout_s"), py::arg("timeout_s"), py::arg("retries"))
      .def("sync", &PyCoordinator::Sync)
      .def("pull_all", &PyCoordinator::PullAll)
      .def_property_readonly("latest_version", &PyCoordinator::latest_version)
      .def_property_readonly("closed", &PyCoordinator::closed)
      .def("close", &PyCoordinator::Close);
  m.def(
      "pull_on_engines",
      [](const std::vector<std::string>& engines, std::optional<int64_t> target,
         const std::string& token, double connect_timeout_s, double timeout_s, int retries) {
        const EnginePullOptions o = PullOptions(token, connect_timeout_s, timeout_s, retries);
        std::vector<EnginePullOutcome> outcomes;
        {
          py::gil_scoped_release release;
          outcomes = PullOnEngines(engines, target, o);
        }
        return Outcomes(outcomes);
      },
      py::arg("engines"), py::arg("target"), py::arg("token"), py::arg("connect_timeout_s"),
      py::arg("timeout_s"), py::arg("retries"));
}

}  // namespace deltasync::python
