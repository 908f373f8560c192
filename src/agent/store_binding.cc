// The pieces of the agent module that run on the real store: the
// LocalCheckpoint-backed puller and the publishing SyncCoordinator.
#include <sys/stat.h>
#include <time.h>

#include <chrono>
#include <mutex>

#include "deltasync/agent.h"
#include "deltasync/timing.h"

namespace deltasync {
namespace {

class LocalCheckpointPuller final : public CheckpointPuller {
 public:
  LocalCheckpointPuller(std::unique_ptr<LocalCheckpoint> checkpoint, std::string store)
      : checkpoint_(std::move(checkpoint)), store_(std::move(store)) {}

  Result<PullResult> Pull(std::optional<int64_t> target) override {
    std::lock_guard<std::mutex> lock(mu_);
    return checkpoint_->Pull(target);
  }
  Result<std::optional<int64_t>> CurrentVersion() override {
    std::lock_guard<std::mutex> lock(mu_);
    return checkpoint_->CurrentVersion();
  }
  // /status asks on every request: the listing (a stat per version) is
  // reused while the store directory's mtime and inode stay the same, once
  // that mtime is at least a full second older than the listing (two
  // clock seconds apart), so that a version added within the same timestamp
  // tick cannot hide behind it.
  Result<int64_t> LatestVersion() override {
    if (store_.empty()) return int64_t{0};
    struct stat st {};
    const bool stated = ::stat(store_.c_str(), &st) == 0;
    std::lock_guard<std::mutex> lock(latest_mu_);
    if (stated && cache_.settled && cache_.ino == st.st_ino &&
        cache_.mtime.tv_sec == st.st_mtim.tv_sec && cache_.mtime.tv_nsec == st.st_mtim.tv_nsec) {
      return cache_.latest;
    }
    timespec now{};
    ::clock_gettime(CLOCK_REALTIME, &now);
    cache_.settled = false;
    DS_ASSIGN_OR_RETURN(std::vector<int64_t> versions, ListVersionNumbers(store_));
    const int64_t latest = versions.empty() ? int64_t{0} : versions.back();
    if (stated) {
      cache_.ino = st.st_ino;
      cache_.mtime = st.st_mtim;
      cache_.latest = latest;
      cache_.settled = now.tv_sec - st.st_mtim.tv_sec >= 2;
    }
    return latest;
  }
  Status Verify() override {
    std::lock_guard<std::mutex> lock(mu_);
    return checkpoint_->Verify();
  }
  const std::string& local() const override { return checkpoint_->local(); }

 private:
  std::mutex mu_;  // LocalCheckpoint is not promised to be thread-safe
  std::mutex latest_mu_;
  struct {
    bool settled = false;  // the listing may be reused while the directory is unchanged
    ino_t ino = 0;
    timespec mtime{};
    int64_t latest = 0;
  } cache_;
  std::unique_ptr<LocalCheckpoint> checkpoint_;
  std::string store_;
};

}  // namespace

Result<std::unique_ptr<CheckpointPuller>> OpenLocalCheckpointPuller(
    const LocalCheckpointOptions& options) {
  DS_ASSIGN_OR_RETURN(std::unique_ptr<LocalCheckpoint> checkpoint, LocalCheckpoint::Open(options));
  return std::unique_ptr<CheckpointPuller>(
      new LocalCheckpointPuller(std::move(checkpoint), options.store));
}

struct SyncCoordinator::State {
  SyncOptions options;
  std::unique_ptr<Publisher> publisher;
};

SyncCoordinator::SyncCoordinator(std::unique_ptr<State> state) : state_(std::move(state)) {}
SyncCoordinator::~SyncCoordinator() = default;

Result<std::unique_ptr<SyncCoordinator>> SyncCoordinator::Create(
    const SyncOptions& options, std::unique_ptr<Publisher> publisher) {
  DS_RETURN_IF_ERROR(CheckEngineUrls(options.engines));
  if (publisher == nullptr) return Status::InvalidArgument("sync needs a publisher");
  auto state = std::make_unique<State>();
  state->options = options;
  state->publisher = std::move(publisher);
  return std::unique_ptr<SyncCoordinator>(new SyncCoordinator(std::move(state)));
}

Publisher& SyncCoordinator::publisher() { return *state_->publisher; }

std::vector<EnginePullOutcome> SyncCoordinator::PullAll(std::optional<int64_t> target) {
  return PullOnEngines(state_->options.engines, target, state_->options.pull);
}

namespace {

// Publish (by `publish`), then have every engine pull what was published.
template <typename PublishFn>
Result<SyncReport> PublishAndPull(SyncCoordinator& coordinator, PublishFn&& publish) {
  const auto start = std::chrono::steady_clock::now();
  SyncReport report;
  DS_ASSIGN_OR_RETURN(report.publish, publish());
  report.publish_seconds = SecondsSince(start);
  report.version = report.publish.info.version;
  const auto pull_start = std::chrono::steady_clock::now();
  report.engines = coordinator.PullAll(report.version);
  report.pull_seconds = SecondsSince(pull_start);
  report.status = SummarizeEngineOutcomes(report.engines);
  report.total_seconds = SecondsSince(start);
  return report;
}

}  // namespace

Result<SyncReport> SyncCoordinator::Sync(const std::vector<TensorView>& weights, bool full) {
  return PublishAndPull(*this, [&] { return state_->publisher->Publish(weights, full); });
}

Result<SyncReport> SyncCoordinator::SyncCheckpoint(const std::string& path, bool full) {
  return PublishAndPull(*this, [&] { return state_->publisher->PublishCheckpoint(path, full); });
}

}  // namespace deltasync
