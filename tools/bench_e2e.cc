#include "bench_e2e.h"

#include <fcntl.h>
#include <malloc.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "cli_util.h"
#include "deltasync/checkpoint.h"
#include "deltasync/io.h"
#include "deltasync/synth.h"

extern char** environ;

#ifndef DS_SOURCE_DIR
#define DS_SOURCE_DIR ""
#endif

namespace deltasync::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// HF's save_pretrained shard size as WriteSynthChain uses it: a model that
// fits is one model.safetensors.
constexpr uint64_t kCheckpointShardBytes = 2ull << 30;
// How often a child's /proc/<pid>/status is read for its memory high-water marks.
constexpr auto kSampleInterval = std::chrono::milliseconds(10);

double Mib(uint64_t kib) { return static_cast<double>(kib) / 1024.0; }

std::string LastLine(const std::string& text) {
  std::string t = text;
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r')) t.pop_back();
  const size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

std::string ReadFileText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---------------------------------------------------------------------------
// Child processes

struct ChildRun {
  int exit_code = -1;  // 128 + signal when killed by one
  double wall_seconds = 0;
  double cpu_seconds = 0;  // user + system, the child's own
  uint64_t max_rss_kib = 0;
  uint64_t peak_anon_kib = 0;
  uint64_t peak_file_kib = 0;
  uint64_t floor_kib = 0;  // the bench's own RSS when it spawned the child
  std::string out;
  std::string err;
};

// RssAnon and RssFile of a live process, in KiB; false when the process has
// no memory map any more (exited) or cannot be read.
bool ReadRss(pid_t pid, uint64_t* anon_kib, uint64_t* file_kib) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/status", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char line[256];
  bool anon = false, file = false;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long kib = 0;
    if (std::sscanf(line, "RssAnon: %llu kB", &kib) == 1) {
      *anon_kib = kib;
      anon = true;
    } else if (std::sscanf(line, "RssFile: %llu kB", &kib) == 1) {
      *file_kib = kib;
      file = true;
    }
  }
  std::fclose(f);
  return anon && file;
}

// A spawned child's ru_maxrss also covers the memory map it replaced at
// exec, which for posix_spawn (and fork) is the bench's own: so the bench
// resets its high-water mark to its current RSS first (Linux >= 4.0), and
// that current RSS is the floor under every child's figure. Returns it, in
// KiB (0 when unknown).
uint64_t ResetOwnPeakRss() {
  if (FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
  uint64_t rss_kib = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      unsigned long long kib = 0;
      if (std::sscanf(line, "VmRSS: %llu kB", &kib) == 1) rss_kib = kib;
    }
    std::fclose(f);
  }
  return rss_kib;
}

// Polls a child's resident memory until told to stop. The child is never
// reaped while it runs (the bench waits with WNOWAIT first), so its pid
// cannot be reused under the sampler.
class RssSampler {
 public:
  explicit RssSampler(pid_t pid) : pid_(pid), thread_([this] { Loop(); }) {}
  ~RssSampler() { Stop(); }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  uint64_t peak_anon_kib() const { return peak_anon_; }
  uint64_t peak_file_kib() const { return peak_file_; }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      uint64_t anon = 0, file = 0;
      if (ReadRss(pid_, &anon, &file)) {
        peak_anon_ = std::max(peak_anon_, anon);
        peak_file_ = std::max(peak_file_, file);
      }
      cv_.wait_for(lock, kSampleInterval, [this] { return stop_; });
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t peak_anon_ = 0;
  uint64_t peak_file_ = 0;
  std::thread thread_;  // last: starts once the fields above exist
};

// Runs argv[0] (a path) with stdout and stderr in `io_stem`.out/.err and
// stdin from /dev/null. IOError when it cannot be started at all.
Result<ChildRun> RunChild(const std::vector<std::string>& argv, const std::string& io_stem) {
  const std::string out_path = io_stem + ".out", err_path = io_stem + ".err";
  posix_spawn_file_actions_t actions;
  if (int rc = posix_spawn_file_actions_init(&actions); rc != 0) {
    return Status::FromErrno(rc, "posix_spawn_file_actions_init");
  }
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);

  const uint64_t floor_kib = ResetOwnPeakRss();
  pid_t pid = -1;
  const Clock::time_point start = Clock::now();
  const int spawn_rc = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawn_rc != 0) return Status::FromErrno(spawn_rc, "cannot run " + argv[0]);

  RssSampler sampler(pid);
  siginfo_t info{};
  while (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) != 0) {
    if (errno != EINTR) return Status::FromErrno(errno, "waitid for " + argv[0]);
  }
  const Clock::time_point end = Clock::now();
  sampler.Stop();

  ChildRun run;
  int status = 0;
  struct rusage usage {};
  while (wait4(pid, &status, 0, &usage) < 0) {
    if (errno != EINTR) return Status::FromErrno(errno, "wait4 for " + argv[0]);
  }
  run.wall_seconds = std::chrono::duration<double>(end - start).count();
  run.cpu_seconds = static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                    static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
  run.max_rss_kib = static_cast<uint64_t>(usage.ru_maxrss);  // KiB on Linux
  run.peak_anon_kib = sampler.peak_anon_kib();
  run.peak_file_kib = sampler.peak_file_kib();
  run.floor_kib = floor_kib;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  run.out = ReadFileText(out_path);
  run.err = ReadFileText(err_path);
  return run;
}

// ---------------------------------------------------------------------------
// Checkpoints

Status WriteStep(const std::string& dir, const std::vector<TensorView>& weights) {
  uint64_t total = 0;
  for (const TensorView& w : weights) total += w.nbytes();
  CheckpointWriteOptions options;
  options.max_shard_bytes = total <= kCheckpointShardBytes ? 0 : kCheckpointShardBytes;
  options.shard_metadata = {{"format", "pt"}};
  return WriteCheckpoint(dir, weights, options).WithContext("writing " + dir);
}

// Internal error unless the checkpoint at `pulled` holds exactly the
// tensors of `expected`, with the same dtypes, shapes and bytes.
Status CheckBitExact(const std::string& pulled, const std::string& expected,
                     const std::string& what) {
  const std::string failed = "bit-exactness check failed: " + what + ": ";
  Result<std::unique_ptr<Checkpoint>> got = Checkpoint::Open(pulled);
  if (!got.ok())
    return Status::Internal(failed + "cannot open " + pulled + ": " + got.status().message());
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> want, Checkpoint::Open(expected));
  const auto& g = (*got)->tensors();
  const auto& w = want->tensors();
  for (const auto& [name, view] : w) {
    auto it = g.find(name);
    if (it == g.end()) return Status::Internal(failed + "tensor " + name + " is missing");
    const TensorView& p = it->second;
    if (p.dtype != view.dtype || p.shape != view.shape || p.nbytes() != view.nbytes()) {
      return Status::Internal(failed + "tensor " + name + " has another dtype or shape");
    }
    if (std::memcmp(p.bytes.data(), view.bytes.data(), view.nbytes()) != 0) {
      size_t i = 0;
      while (p.bytes[i] == view.bytes[i]) ++i;
      return Status::Internal(failed + "tensor " + name +
                              " differs from the new checkpoint at byte " + std::to_string(i));
    }
  }
  if (g.size() != w.size()) {
    for (const auto& [name, view] : g) {
      if (!w.count(name)) return Status::Internal(failed + "extra tensor " + name);
    }
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------
// The run

double JsonNumber(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}
uint64_t JsonCount(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
}

// Keeps the best times and the highest memory peaks over repeats.
void Merge(const ChildRun& run, double self_seconds, bool first, E2eProcess* into) {
  if (first) {
    into->wall_seconds = run.wall_seconds;
    into->self_seconds = self_seconds;
    into->cpu_seconds = run.cpu_seconds;
  } else {
    into->wall_seconds = std::min(into->wall_seconds, run.wall_seconds);
    into->self_seconds = std::min(into->self_seconds, self_seconds);
    into->cpu_seconds = std::min(into->cpu_seconds, run.cpu_seconds);
  }
  into->peak_rss_mib = std::max(into->peak_rss_mib, Mib(run.max_rss_kib));
  into->peak_anon_mib = std::max(into->peak_anon_mib, Mib(run.peak_anon_kib));
  into->peak_file_mib = std::max(into->peak_file_mib, Mib(run.peak_file_kib));
}

// The 1-minute load average: on a shared machine it says how much the
// wall-clock figures are to be trusted.
json LoadAverage() {
  double load = 0;
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return nullptr;
  const bool ok = std::fscanf(f, "%lf", &load) == 1;
  std::fclose(f);
  return ok ? json(load) : json(nullptr);
}

class E2eRun {
 public:
  E2eRun(const E2eConfig& config, const BenchProgress& progress)
      : config_(config), progress_(progress) {}

  ~E2eRun() { Cleanup(); }

  Result<E2eResult> Run() {
    if (config_.repeat < 1) return Status::InvalidArgument("--repeat must be at least 1");
    if (config_.warmup_steps < 0) {
      return Status::InvalidArgument("--warmup-steps must not be negative");
    }
    result_.load_average_start = LoadAverage();
    DS_RETURN_IF_ERROR(ResolvePaths());
    DS_RETURN_IF_ERROR(PrepareWorkdir());
    DS_RETURN_IF_ERROR(MakeStepPair());
    CheckPeer();
    for (int r = 0; r < config_.repeat; ++r) {
      const bool first = r == 0;
      const std::string round = config_.repeat > 1 ? " (run " + std::to_string(r + 1) + "/" +
                                                         std::to_string(config_.repeat) + ")"
                                                   : "";
      Progress("deltasync sparse" + round);
      DS_RETURN_IF_ERROR(MeasureOurs("sparse", "sparse", false, first, &result_.sparse));
      Progress("deltasync xor" + round);
      DS_RETURN_IF_ERROR(MeasureOurs("xor", "xor", false, first, &result_.xor_delta));
      Progress("deltasync full version" + round);
      DS_RETURN_IF_ERROR(MeasureOurs("full", "sparse", true, first, &result_.full));
      if (result_.peer.ran) {
        Progress("python peer xor" + round);
        DS_RETURN_IF_ERROR(MeasurePeer(first, &result_.peer));
      }
    }
    result_.workdir = workdir_;
    result_.kept = config_.keep;
    return std::move(result_);
  }

 private:
  void Progress(const std::string& line) const {
    if (progress_) progress_(line);
  }

  Status ResolvePaths() {
    cli_path_ = config_.cli_path;
    if (cli_path_.empty()) {
      std::error_code ec;
      cli_path_ = fs::read_symlink("/proc/self/exe", ec).string();
      if (ec) return Status::IOError("cannot find this executable: " + ec.message());
    }
    if (::access(cli_path_.c_str(), X_OK) != 0) {
      return Status::InvalidArgument("deltasync binary " + cli_path_ + " is not executable");
    }
    result_.cli_path = cli_path_;
    peer_script_ = config_.peer_script.empty() ? DefaultPeerScript() : config_.peer_script;
    if (!config_.peer_script.empty() && ::access(peer_script_.c_str(), R_OK) != 0) {
      return Status::InvalidArgument("--peer " + peer_script_ + ": no such readable file");
    }
    result_.peer_script = peer_script_;
    return Status::OK();
  }

  Status PrepareWorkdir() {
    std::error_code ec;
    if (config_.workdir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern =
          std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/deltasync-bench-e2e-XXXXXX";
      if (::mkdtemp(pattern.data()) == nullptr) {
        return Status::FromErrno(errno, "cannot create a work directory " + pattern);
      }
      workdir_ = pattern;
      created_workdir_ = true;
    } else {
      workdir_ = config_.workdir;
      if (fs::exists(workdir_, ec)) {
        if (!fs::is_directory(workdir_, ec)) {
          return Status::InvalidArgument("--workdir " + workdir_ + " is not a directory");
        }
        if (!fs::is_empty(workdir_, ec)) {
          return Status::InvalidArgument("--workdir " + workdir_ +
                                         " is not empty (the bench removes what it writes "
                                         "there, so it must start empty)");
        }
      } else {
        fs::create_directories(workdir_, ec);
        if (ec) {
          return Status::IOError("cannot create --workdir " + workdir_ + ": " + ec.message());
        }
        created_workdir_ = true;
      }
    }
    workdir_ready_ = true;
    old_dir_ = workdir_ + "/old";
    new_dir_ = workdir_ + "/new";
    logs_dir_ = workdir_ + "/logs";
    fs::create_directories(logs_dir_, ec);
    if (ec) return Status::IOError("cannot create " + logs_dir_ + ": " + ec.message());
    return Status::OK();
  }

  void Cleanup() {
    if (!workdir_ready_ || config_.keep) return;
    std::error_code ec;
    if (created_workdir_) {
      fs::remove_all(workdir_, ec);
    } else {
      for (const fs::directory_entry& e : fs::directory_iterator(workdir_, ec)) {
        std::error_code ignored;
        fs::remove_all(e.path(), ignored);
      }
    }
  }

  Status MakeStepPair() {
    DS_ASSIGN_OR_RETURN(result_.scale, SynthScaleForBytes(config_.preset, config_.target_bytes));
    SynthConfig synth;
    synth.preset = config_.preset;
    synth.scale = result_.scale;
    synth.seed = config_.seed;
    synth.lr = config_.lr;
    Progress("building " + config_.preset + " at scale " + std::to_string(result_.scale));
    DS_ASSIGN_OR_RETURN(std::unique_ptr<SynthTrainer> trainer, SynthTrainer::Create(synth));
    for (int64_t step = 1; step <= config_.warmup_steps; ++step) {
      Progress("warm-up step " + std::to_string(step) + "/" + std::to_string(config_.warmup_steps));
      trainer->Step();
    }
    Progress("writing the old checkpoint");
    DS_RETURN_IF_ERROR(WriteStep(old_dir_, trainer->Weights()));
    Progress("measured step");
    trainer->Step();
    Progress("writing the new checkpoint");
    DS_RETURN_IF_ERROR(WriteStep(new_dir_, trainer->Weights()));
    const SynthStepStats& stats = trainer->last_step_stats();
    result_.changed = static_cast<uint64_t>(stats.changed_elements);
    result_.numel = static_cast<uint64_t>(stats.total_elements);
    result_.model_bytes = SynthBf16Bytes(trainer->specs());
    result_.tensors = trainer->specs().size();
    for (const TensorView& w : trainer->Weights()) {
      result_.largest_tensor_bytes = std::max<uint64_t>(result_.largest_tensor_bytes, w.nbytes());
    }
    trainer.reset();
    // Hands the trainer's freed heap back, so that the bench's own RSS (the
    // floor under the children's ru_maxrss) is small.
    malloc_trim(0);
    return Status::OK();
  }

  // Runs a command that prints a JSON summary; Internal error when it fails
  // or prints something else.
  Result<json> RunJson(const std::vector<std::string>& argv, const std::string& label,
                       ChildRun* run) {
    DS_ASSIGN_OR_RETURN(*run, RunChild(argv, logs_dir_ + "/" + label));
    result_.rss_floor_mib = std::max(result_.rss_floor_mib, Mib(run->floor_kib));
    if (run->exit_code != 0) {
      return Status::Internal(label + " failed (exit " + std::to_string(run->exit_code) +
                              "): " + LastLine(run->err));
    }
    json j = json::parse(run->out, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Status::Internal(label + " did not print a JSON object: " + LastLine(run->out));
    }
    return j;
  }

  static Status Expect(bool ok, const std::string& label, const std::string& what,
                       const json& got) {
    if (ok) return Status::OK();
    return Status::Internal(label + ": expected " + what + ", got " + got.dump());
  }

  // A fresh directory for one measurement's store and local checkpoints.
  Result<std::string> FreshDir(const std::string& name) {
    const std::string dir = workdir_ + "/" + name;
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::create_directories(dir, ec);
    if (ec) return Status::IOError("cannot create " + dir + ": " + ec.message());
    return dir;
  }

  void DoneWith(const std::string& dir) {
    if (config_.keep) return;
    std::error_code ec;
    fs::remove_all(dir, ec);  // frees the disk and the page cache before the next measurement
  }

  // Brings `local` to version 0 (a copy of the old checkpoint), untimed.
  Status MaterializeOurs(const std::string& store, const std::string& local,
                         const std::string& label) {
    ChildRun run;
    DS_ASSIGN_OR_RETURN(json j, RunJson({cli_path_, "pull", "--store", store, "--local", local,
                                         "--base", old_dir_, "--target", "0", "--json"},
                                        label, &run));
    return Expect(j.value("version", -1) == 0, label, "version 0", j);
  }

  Status MeasureOurs(const std::string& name, const std::string& encoding, bool full, bool first,
                     E2eMeasurement* m) {
    DS_ASSIGN_OR_RETURN(const std::string dir, FreshDir(name));
    const std::string store = dir + "/store", local = dir + "/local",
                      local_durable = dir + "/local_durable";
    // The trainer's store exists before the hosts seed from the base.
    std::error_code ec;
    fs::create_directories(store, ec);
    if (ec) return Status::FromErrno(ec.value(), store + ": create store directory");
    DS_RETURN_IF_ERROR(MaterializeOurs(store, local, name + "_base"));
    if (!full) DS_RETURN_IF_ERROR(MaterializeOurs(store, local_durable, name + "_base_durable"));

    // Publish.
    std::vector<std::string> publish = {cli_path_,    "publish", "--store", store,
                                        "--old",      old_dir_,  "--new",   new_dir_,
                                        "--encoding", encoding,  "--json"};
    if (full) publish.push_back("--full");
    ChildRun run;
    const std::string publish_label = name + "_publish";
    DS_ASSIGN_OR_RETURN(json pj, RunJson(publish, publish_label, &run));
    DS_RETURN_IF_ERROR(Expect(pj.value("version", -1) == 1, publish_label, "version 1", pj));
    DS_RETURN_IF_ERROR(Expect(pj.value("kind", "") == (full ? "full" : "delta"), publish_label,
                              full ? "a full version" : "a delta", pj));
    if (!full) {
      DS_RETURN_IF_ERROR(
          Expect(pj.value("encoding", "") == encoding, publish_label, encoding + " encoding", pj));
      // The store's diff and the trainer's count are independent.
      DS_RETURN_IF_ERROR(Expect(JsonCount(pj, "changed_elements") == result_.changed, publish_label,
                                std::to_string(result_.changed) + " changed elements", pj));
    }
    Merge(run, JsonNumber(pj, "seconds"), first, &m->publish);
    m->bytes = JsonCount(pj, "bytes_written");
    m->tensors_changed = JsonCount(pj, "tensors_changed");
    m->changed_elements = JsonCount(pj, "changed_elements");
    m->total_elements = JsonCount(pj, "total_elements");

    // Pull, as committed by default, then with --durable.
    auto pull = [&](const std::string& into, bool durable, E2eProcess* proc) -> Status {
      std::vector<std::string> argv = {cli_path_, "pull",   "--store", store,   "--local",
                                       into,      "--base", old_dir_,  "--json"};
      if (durable) argv.push_back("--durable");
      const std::string label = name + (durable ? "_pull_durable" : "_pull");
      if (config_.cold_store) DS_RETURN_IF_ERROR(io::DropFromPageCache(store));
      ChildRun pr;
      DS_ASSIGN_OR_RETURN(json j, RunJson(argv, label, &pr));
      DS_RETURN_IF_ERROR(Expect(j.value("version", -1) == 1 && j.value("applied", false) &&
                                    j.value("from_version", json()) == json(0),
                                label, "version 0 -> 1 applied", j));
      const json expected_versions = full ? json::array() : json::array({1});
      DS_RETURN_IF_ERROR(Expect(j.value("versions_applied", json()) == expected_versions &&
                                    j.value("reset_to", json()) == (full ? json(1) : json()),
                                label,
                                full ? "a reset to full version 1" : "delta version 1 applied", j));
      Merge(pr, JsonNumber(j, "seconds"), first, proc);
      if (!durable) m->pull_bytes_read = JsonCount(j, "bytes_read");
      return CheckBitExact(into, new_dir_, label);
    };
    DS_RETURN_IF_ERROR(pull(local, false, &m->pull));
    if (!full) {
      if (!m->pull_durable) m->pull_durable = E2eProcess{};
      DS_RETURN_IF_ERROR(pull(local_durable, true, &*m->pull_durable));
      m->pull_durable_seconds = m->pull_durable->wall_seconds;
    }
    m->ran = true;
    m->verified = true;
    m->publish_seconds = m->publish.wall_seconds;
    m->pull_seconds = m->pull.wall_seconds;
    DoneWith(dir);
    return Status::OK();
  }

  // Whether the Python peer can run here; the reason goes into its note.
  void CheckPeer() {
    E2eMeasurement& m = result_.peer;
    if (::access(peer_script_.c_str(), R_OK) != 0) {
      m.note = "skipped: peer script " + peer_script_ + " not found (give it with --peer PATH)";
      return;
    }
    if (::access(config_.python.c_str(), X_OK) != 0) {
      m.note = "skipped: Python interpreter " + config_.python + " not found";
      return;
    }
    Result<ChildRun> run = RunChild({config_.python, "-c", "import numpy, zstandard, xxhash"},
                                    logs_dir_ + "/peer_modules");
    if (!run.ok()) {
      m.note = "skipped: cannot run " + config_.python + ": " + run.status().message();
      return;
    }
    if (run->exit_code != 0) {
      m.note = "skipped: " + config_.python + " lacks numpy, zstandard or xxhash (" +
               LastLine(run->err) + ")";
      return;
    }
    m.ran = true;
    m.note =
        "times are the peer's own (from its command's start, after the interpreter has "
        "started and imported numpy); *_wall_s include the interpreter's start";
  }

  Status MeasurePeer(bool first, E2eMeasurement* m) {
    DS_ASSIGN_OR_RETURN(const std::string dir, FreshDir("peer"));
    const std::string store = dir + "/store", local = dir + "/local";
    ChildRun run;
    DS_ASSIGN_OR_RETURN(json bj, RunJson({config_.python, peer_script_, "pull", "--store", store,
                                          "--local", local, "--base", old_dir_, "--target", "0"},
                                         "peer_base", &run));
    DS_RETURN_IF_ERROR(
        Expect(bj.value("to_version", "") == "000000" && bj.value("materialized_base", false),
               "peer_base", "the base materialized at 000000", bj));

    DS_ASSIGN_OR_RETURN(json pj,
                        RunJson({config_.python, peer_script_, "publish", "--store", store, "--old",
                                 old_dir_, "--new", new_dir_, "--encoding", "xor"},
                                "peer_publish", &run));
    DS_RETURN_IF_ERROR(
        Expect(pj.value("version", "") == "000001" && pj.value("delta_encoding", "") == "xor",
               "peer_publish", "xor version 000001", pj));
    Merge(run, JsonNumber(pj, "seconds"), first, &m->publish);
    m->bytes = JsonCount(pj, "bytes_written");
    m->tensors_changed = JsonCount(pj, "tensors_changed");
    // Both implementations diff the same pair: they must agree on which
    // tensors changed.
    DS_RETURN_IF_ERROR(Expect(
        m->tensors_changed == result_.sparse.tensors_changed, "peer_publish",
        std::to_string(result_.sparse.tensors_changed) + " changed tensors, as deltasync found",
        pj));

    if (config_.cold_store) DS_RETURN_IF_ERROR(io::DropFromPageCache(store));
    DS_ASSIGN_OR_RETURN(json lj, RunJson({config_.python, peer_script_, "pull", "--store", store,
                                          "--local", local, "--base", old_dir_},
                                         "peer_pull", &run));
    DS_RETURN_IF_ERROR(Expect(lj.value("to_version", "") == "000001" &&
                                  lj.value("versions_applied", json()) == json::array({"000001"}),
                              "peer_pull", "version 000001 applied", lj));
    Merge(run, JsonNumber(lj, "seconds"), first, &m->pull);
    m->pull_bytes_read = JsonCount(lj, "bytes_read");
    DS_RETURN_IF_ERROR(CheckBitExact(local, new_dir_, "peer_pull"));
    m->verified = true;
    m->publish_seconds = m->publish.self_seconds;
    m->pull_seconds = m->pull.self_seconds;
    DoneWith(dir);
    return Status::OK();
  }

  const E2eConfig& config_;
  const BenchProgress& progress_;
  E2eResult result_;
  std::string cli_path_, peer_script_;
  std::string workdir_, old_dir_, new_dir_, logs_dir_;
  bool created_workdir_ = false;
  bool workdir_ready_ = false;
};

// ---------------------------------------------------------------------------
// Report

json Nullable(bool present, double value) { return present ? json(value) : json(nullptr); }

json RatioOrNull(const E2eMeasurement& a, const E2eMeasurement& b) {
  if (!a.ran || !b.ran || b.total_seconds() <= 0) return nullptr;
  return a.total_seconds() / b.total_seconds();
}

json WallRatioOrNull(const E2eMeasurement& a, const E2eMeasurement& b) {
  const double denom = b.publish.wall_seconds + b.pull.wall_seconds;
  if (!a.ran || !b.ran || denom <= 0) return nullptr;
  return (a.publish.wall_seconds + a.pull.wall_seconds) / denom;
}

double CpuTotal(const E2eMeasurement& m) { return m.publish.cpu_seconds + m.pull.cpu_seconds; }

json CpuRatioOrNull(const E2eMeasurement& a, const E2eMeasurement& b) {
  if (!a.ran || !b.ran || CpuTotal(b) <= 0) return nullptr;
  return CpuTotal(a) / CpuTotal(b);
}

json MetOrNull(const json& ratio, double target) {
  if (ratio.is_null()) return nullptr;
  return ratio.get<double>() <= target;
}

json OursJson(const E2eMeasurement& m, uint64_t model_bytes) {
  json j = {
      {"publish_s", m.publish_seconds},
      {"pull_s", m.pull_seconds},
      {"total_s", m.total_seconds()},
      {"bytes", m.bytes},
      {"pull_bytes_read", m.pull_bytes_read},
      {"publish_self_s", m.publish.self_seconds},
      {"pull_self_s", m.pull.self_seconds},
      {"publish_cpu_s", m.publish.cpu_seconds},
      {"pull_cpu_s", m.pull.cpu_seconds},
      {"publish_peak_rss_mib", m.publish.peak_rss_mib},
      {"pull_peak_rss_mib", m.pull.peak_rss_mib},
      {"publish_peak_anon_mib", m.publish.peak_anon_mib},
      {"pull_peak_anon_mib", m.pull.peak_anon_mib},
      {"publish_peak_file_mib", m.publish.peak_file_mib},
      {"pull_peak_file_mib", m.pull.peak_file_mib},
      {"pull_anon_vs_model", model_bytes ? m.pull.peak_anon_mib * 1048576.0 / model_bytes : 0.0},
      {"tensors_changed", m.tensors_changed},
      {"verified", m.verified}};
  if (m.pull_durable_seconds) {
    j["pull_durable_s"] = *m.pull_durable_seconds;
    j["total_durable_s"] = m.publish_seconds + *m.pull_durable_seconds;
    j["pull_durable_peak_rss_mib"] = m.pull_durable->peak_rss_mib;
    j["pull_durable_peak_anon_mib"] = m.pull_durable->peak_anon_mib;
  }
  return j;
}

json PeerJson(const E2eMeasurement& m) {
  json j = {{"ran", m.ran}, {"note", m.note}};
  const bool r = m.ran;
  j["encoding"] = "xor";
  j["publish_s"] = Nullable(r, m.publish_seconds);
  j["pull_s"] = Nullable(r, m.pull_seconds);
  j["total_s"] = Nullable(r, m.total_seconds());
  j["bytes"] = r ? json(m.bytes) : json(nullptr);
  j["pull_bytes_read"] = r ? json(m.pull_bytes_read) : json(nullptr);
  j["publish_wall_s"] = Nullable(r, m.publish.wall_seconds);
  j["pull_wall_s"] = Nullable(r, m.pull.wall_seconds);
  j["publish_cpu_s"] = Nullable(r, m.publish.cpu_seconds);
  j["pull_cpu_s"] = Nullable(r, m.pull.cpu_seconds);
  j["publish_peak_rss_mib"] = Nullable(r, m.publish.peak_rss_mib);
  j["pull_peak_rss_mib"] = Nullable(r, m.pull.peak_rss_mib);
  j["publish_peak_anon_mib"] = Nullable(r, m.publish.peak_anon_mib);
  j["pull_peak_anon_mib"] = Nullable(r, m.pull.peak_anon_mib);
  j["tensors_changed"] = r ? json(m.tensors_changed) : json(nullptr);
  j["verified"] = m.verified;
  return j;
}

std::vector<std::string> ReportNotes() {
  return {
      "page cache: nothing is dropped; the old and new checkpoints, the version a publish has "
      "just written and the local checkpoint just materialized at version 0 (untimed) are hot, "
      "for deltasync and the peer alike, as on a host that has just received them",
      "each implementation syncs as it does by default: publishes fsync their files; the "
      "peer's pull msyncs the applied tensors and fsyncs its state; deltasync's pull commits "
      "without a data sync (survives kill -9, not power loss) unless --durable, timed as "
      "pull_durable_s",
      "deltasync times are wall clock around the child process (process start included); the "
      "peer's publish_s/pull_s are its self-reported seconds (interpreter start and imports "
      "excluded), *_wall_s include them; ratios use publish_s + pull_s",
      "*_cpu_s are the child's user + system CPU seconds (for the peer including the "
      "interpreter's start and imports); on a loaded machine the *_cpu ratios are steadier "
      "than the wall-clock ones, and load_average_start/end say how loaded it was",
      "peak_rss_mib is ru_maxrss of the child: anonymous memory plus every touched page of "
      "file-backed mappings (the pull maps the local shards read-write and the version's "
      "files read-only, so it counts the page-cache pages of the tensors it touches, which "
      "are shared and reclaimable); peak_anon_mib is the RssAnon high-water, sampled every 10 "
      "ms, the process's private memory; ru_maxrss cannot be below rss_floor_mib, the "
      "bench's own RSS when it spawned the child (the kernel counts the memory map an exec "
      "replaces; the bench resets its own high-water mark before each spawn)",
  };
}

}  // namespace

std::string DefaultPeerScript() {
  const std::string source = DS_SOURCE_DIR;
  return source.empty() ? std::string("tests/peer/vime_peer.py")
                        : source + "/tests/peer/vime_peer.py";
}

Result<E2eResult> RunE2eBench(const E2eConfig& config, const BenchProgress& progress) {
  E2eRun run(config, progress);
  return run.Run();
}

json E2eReportJson(const E2eConfig& config, const E2eResult& r) {
  json out;
  out["mode"] = "e2e";
  out["config"] = {{"preset", config.preset},
                   {"scale", r.scale},
                   {"bytes", r.model_bytes},
                   {"requested_bytes", config.target_bytes},
                   {"lr", config.lr},
                   {"seed", config.seed},
                   {"warmup_steps", config.warmup_steps},
                   {"repeat", config.repeat},
                   {"statistic", "best"},
                   {"workdir", r.workdir},
                   {"kept", r.kept},
                   {"deltasync", r.cli_path},
                   {"peer", r.peer_script},
                   {"python", config.python},
                   {"page_cache", config.cold_store ? "store dropped before each pull" : "hot"},
                   {"rss_floor_mib", r.rss_floor_mib},
                   {"load_average_start", r.load_average_start},
                   {"load_average_end", LoadAverage()},
                   {"hardware_threads", std::thread::hardware_concurrency()}};
  out["cpu"] = CpuModelName();
  out["model_bytes"] = r.model_bytes;
  out["largest_tensor_bytes"] = r.largest_tensor_bytes;
  out["tensors"] = r.tensors;
  out["numel"] = r.numel;
  out["changed"] = r.changed;
  out["density"] = r.density();
  out["deltasync"] = {{"sparse", OursJson(r.sparse, r.model_bytes)},
                      {"xor", OursJson(r.xor_delta, r.model_bytes)}};
  json full = OursJson(r.full, r.model_bytes);
  out["full"] = full;
  out["python_peer"] = PeerJson(r.peer);
  const json sparse_vs_peer = RatioOrNull(r.sparse, r.peer);
  const json xor_vs_peer = RatioOrNull(r.xor_delta, r.peer);
  const json delta_vs_full = RatioOrNull(r.sparse, r.full);
  out["ratios"] = {{"sparse_vs_peer", sparse_vs_peer},
                   {"xor_vs_peer", xor_vs_peer},
                   {"delta_vs_full", delta_vs_full},
                   {"sparse_vs_peer_wall", WallRatioOrNull(r.sparse, r.peer)},
                   {"xor_vs_peer_wall", WallRatioOrNull(r.xor_delta, r.peer)},
                   {"sparse_vs_peer_cpu", CpuRatioOrNull(r.sparse, r.peer)},
                   {"xor_vs_peer_cpu", CpuRatioOrNull(r.xor_delta, r.peer)},
                   {"delta_vs_full_cpu", CpuRatioOrNull(r.sparse, r.full)}};
  out["targets"] = {{"sparse_vs_peer", kE2eSparseVsPeerTarget},
                    {"xor_vs_peer", kE2eXorVsPeerTarget},
                    {"delta_vs_full", kE2eDeltaVsFullTarget}};
  out["met"] = {{"sparse_vs_peer", MetOrNull(sparse_vs_peer, kE2eSparseVsPeerTarget)},
                {"xor_vs_peer", MetOrNull(xor_vs_peer, kE2eXorVsPeerTarget)},
                {"delta_vs_full", MetOrNull(delta_vs_full, kE2eDeltaVsFullTarget)}};
  out["verified"] = r.sparse.verified && r.xor_delta.verified && r.full.verified &&
                    (!r.peer.ran || r.peer.verified);
  out["notes"] = ReportNotes();
  return out;
}

void PrintE2eReport(const E2eConfig& config, const E2eResult& r) {
  const json j = E2eReportJson(config, r);
  std::printf("deltasync bench --e2e: %s at scale %.4f, %zu tensors, %s BF16, lr %g, seed %llu\n",
              config.preset.c_str(), r.scale, r.tensors, FormatBytes(r.model_bytes).c_str(),
              config.lr, static_cast<unsigned long long>(config.seed));
  std::printf("cpu: %s, %u hardware threads; each time the best of %d runs\n",
              CpuModelName().c_str(), std::thread::hardware_concurrency(), config.repeat);
  std::printf("changed: %llu of %llu elements (density %.4f%%) after %lld warm-up steps\n",
              static_cast<unsigned long long>(r.changed), static_cast<unsigned long long>(r.numel),
              100.0 * r.density(), static_cast<long long>(config.warmup_steps));
  std::printf("%s; deltasync times are wall clock, the peer's its own\n\n",
              config.cold_store ? "store files dropped from the page cache before each pull, "
                                  "checkpoints hot"
                                : "files hot in page cache for everyone");
  std::printf("%-30s %9s %9s %8s %12s %11s %11s\n", "operation", "seconds", "vs peer", "cpu s",
              "bytes", "peak RSS", "peak anon");
  const double peer_total = r.peer.ran ? r.peer.total_seconds() : 0.0;
  auto row = [&](const std::string& op, double seconds, const char* bytes_label, uint64_t bytes,
                 const E2eProcess* proc, bool ratio) {
    char vs[32] = "";
    if (ratio && peer_total > 0) std::snprintf(vs, sizeof(vs), "%.3fx", seconds / peer_total);
    const std::string b = bytes_label == nullptr ? "" : FormatBytes(bytes) + " " + bytes_label;
    char rss[32] = "", anon[32] = "", cpu[32] = "";
    if (proc != nullptr) {
      std::snprintf(rss, sizeof(rss), "%.1f MiB", proc->peak_rss_mib);
      std::snprintf(anon, sizeof(anon), "%.1f MiB", proc->peak_anon_mib);
      std::snprintf(cpu, sizeof(cpu), "%.3f", proc->cpu_seconds);
    }
    std::printf("%-30s %9.3f %9s %8s %12s %11s %11s\n", op.c_str(), seconds, vs, cpu, b.c_str(),
                rss, anon);
  };
  auto ours = [&](const char* name, const E2eMeasurement& m) {
    const std::string n = name;
    row(n + " publish", m.publish_seconds, "w", m.bytes, &m.publish, false);
    row(n + " pull", m.pull_seconds, "r", m.pull_bytes_read, &m.pull, false);
    if (m.pull_durable_seconds) {
      row(n + " pull --durable", *m.pull_durable_seconds, nullptr, 0, &*m.pull_durable, false);
    }
    row(n + " total", m.total_seconds(), nullptr, 0, nullptr, true);
  };
  ours("deltasync sparse", r.sparse);
  ours("deltasync xor", r.xor_delta);
  ours("deltasync full", r.full);
  if (r.peer.ran) {
    row("peer xor publish", r.peer.publish_seconds, "w", r.peer.bytes, &r.peer.publish, false);
    row("peer xor pull", r.peer.pull_seconds, "r", r.peer.pull_bytes_read, &r.peer.pull, false);
    row("peer xor total", r.peer.total_seconds(), nullptr, 0, nullptr, true);
    std::printf("(peer wall clock with interpreter start: publish %.3f s, pull %.3f s)\n",
                r.peer.publish.wall_seconds, r.peer.pull.wall_seconds);
  } else {
    std::printf("python peer %s\n", r.peer.note.c_str());
  }
  auto ratio_line = [&](const char* label, const char* key) {
    const json& ratio = j["ratios"][key];
    const json& met = j["met"][key];
    if (ratio.is_null()) {
      std::printf("%-26s n/a\n", label);
    } else {
      std::printf("%-26s %.3f (target <= %g: %s)\n", label, ratio.get<double>(),
                  j["targets"][key].get<double>(), met.get<bool>() ? "met" : "NOT met");
    }
  };
  std::printf("\n");
  ratio_line("sparse total / peer total", "sparse_vs_peer");
  ratio_line("xor total / peer total", "xor_vs_peer");
  ratio_line("sparse total / full total", "delta_vs_full");
  auto cpu_line = [&](const char* label, const char* key) {
    const json& ratio = j["ratios"][key];
    if (!ratio.is_null()) std::printf("%-26s %.3f (CPU seconds)\n", label, ratio.get<double>());
  };
  cpu_line("sparse / peer, CPU", "sparse_vs_peer_cpu");
  cpu_line("xor / peer, CPU", "xor_vs_peer_cpu");
  cpu_line("sparse / full, CPU", "delta_vs_full_cpu");
  const json& load_start = j["config"]["load_average_start"];
  const json& load_end = j["config"]["load_average_end"];
  if (load_start.is_number() && load_end.is_number()) {
    std::printf("load average %.2f at the start, %.2f at the end (%u hardware threads)\n",
                load_start.get<double>(), load_end.get<double>(),
                std::thread::hardware_concurrency());
  }
  std::printf("\nevery pulled checkpoint equals the new one bit for bit\n");
  std::printf(
      "peak RSS counts touched pages of the mapped files (shared page cache); peak anon "
      "is private memory (RssAnon, sampled every 10 ms). Model: %s, largest tensor: %s\n",
      FormatBytes(r.model_bytes).c_str(), FormatBytes(r.largest_tensor_bytes).c_str());
  if (r.kept) std::printf("work directory kept: %s\n", r.workdir.c_str());
  std::fflush(stdout);
}

int RunE2eCommand(const E2eConfig& config, bool json) {
  BenchProgress progress;
  if (isatty(STDERR_FILENO) == 1) {
    progress = [](std::string_view line) {
      std::fprintf(stderr, "deltasync bench --e2e: %.*s\n", static_cast<int>(line.size()),
                   line.data());
    };
  }
  Result<E2eResult> result = RunE2eBench(config, progress);
  if (!result.ok()) return Fail(result.status());
  if (json) {
    std::printf("%s\n", E2eReportJson(config, *result).dump(2).c_str());
    std::fflush(stdout);
  } else {
    PrintE2eReport(config, *result);
  }
  return 0;
}

}  // namespace deltasync::cli
