// Crash safety: a pull killed at any instant leaves the local checkpoint at
// the old version or recoverable to the new one by the next pull, for every
// encoding (xor included: applying it twice would revert it). A forked child
// runs the pull and dies (_exit, as kill -9 would leave things: no
// destructors, no flushing) at an injected crash point; the parent recovers.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "deltasync/store.h"
#include "io/file.h"
#include "store/store_internal.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

constexpr int kCrashExit = 42;

const char* g_crash_point = nullptr;
int g_crash_hit = 1;
std::atomic<int> g_hits{0};
int g_signal_fd = -1;

void DieAtCrashPoint(std::string_view point) {
  if (g_crash_point != nullptr && point == g_crash_point && ++g_hits == g_crash_hit) {
    ::_exit(kCrashExit);
  }
}

// Tells the parent (through a pipe) that `g_crash_point` was reached, and
// carries on: the parent kills the child with SIGKILL at some later instant.
void SignalAtCrashPoint(std::string_view point) {
  if (g_crash_point != nullptr && point == g_crash_point && g_hits.fetch_add(1) == 0) {
    const char c = 'x';
    (void)!::write(g_signal_fd, &c, 1);
  }
}

// Runs Pull(target) in a child process that dies at the `hit`-th pass
// through `point`. Returns the child's exit code (kCrashExit when it died
// there, 0 when the pull finished, 3 when it failed).
int PullInChild(LocalCheckpointOptions options, std::optional<int64_t> target, const char* point,
                int hit = 1) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // The parent's pools have no threads here: use a fresh one.
    ThreadPool pool(2);
    options.pool = &pool;
    g_crash_point = point;
    g_crash_hit = hit;
    g_hits = 0;
    store_internal::SetCrashHookForTesting(&DieAtCrashPoint);
    auto local = LocalCheckpoint::Open(options);
    if (!local.ok()) ::_exit(2);
    Result<PullResult> r = (*local)->Pull(target);
    ::_exit(r.ok() ? 0 : 3);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

nlohmann::json ReadState(const std::string& local) {
  return nlohmann::json::parse(ReadFile(local + "/.weight_sync/state.json"));
}

struct CrashCase {
  Encoding encoding;
  const char* point;
  int hit;
  bool durable;
  bool after_applying_marked;  // the checkpoint may have been written
  int64_t version_after_open;  // what recovery alone reaches
};

class ApplyCrash : public ::testing::TestWithParam<CrashCase> {};

TEST_P(ApplyCrash, RecoversBitExactly) {
  const CrashCase c = GetParam();
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(c.encoding));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2, 100, 0.05);
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.durable = c.durable;
  // Several journal records per tensor, as a large tensor gets.
  lo.journal_record_changes = 5;
  {
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(local);
    DS_ASSERT_OK((*local)->Pull(1));
  }
  ASSERT_EQ(PullInChild(lo, 2, c.point, c.hit), kCrashExit) << "crash point not reached";

  // Mid-apply the checkpoint is at no version, for us and for the peer.
  const nlohmann::json state = ReadState(f.local);
  EXPECT_EQ(state.contains("version"), !c.after_applying_marked) << state.dump();
  EXPECT_EQ(state.value("streamed", false), c.after_applying_marked && !c.durable) << state.dump();
  {
    LocalCheckpointOptions peek = lo;
    peek.recover_on_open = false;
    auto local = LocalCheckpoint::Open(peek);
    DS_ASSERT_OK(local);
    Result<std::optional<int64_t>> v = (*local)->CurrentVersion();
    DS_ASSERT_OK(v);
    if (c.after_applying_marked) {
      EXPECT_FALSE(v->has_value());
    } else {
      EXPECT_TRUE(v->has_value());
    }
  }
  // Open alone recovers: old version, or the new one when the journal was
  // complete; either way bit-exact.
  {
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(local);
    Result<std::optional<int64_t>> v = (*local)->CurrentVersion();
    DS_ASSERT_OK(v);
    ASSERT_TRUE(v->has_value());
    EXPECT_EQ(**v, c.version_after_open);
    EXPECT_TRUE(HoldsModel(f.local, models[**v]));
    DS_EXPECT_OK((*local)->Verify());
    Result<PullResult> r = (*local)->Pull(2);
    DS_ASSERT_OK(r);
    EXPECT_TRUE(HoldsModel(f.local, models[2]));
    EXPECT_EQ(**(*local)->CurrentVersion(), 2);
    DS_EXPECT_OK((*local)->Verify());
    EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync/journal"));
  }
}

std::vector<CrashCase> ApplyCrashCases() {
  std::vector<CrashCase> cases;
  for (Encoding e : {Encoding::kXor, Encoding::kSparse, Encoding::kOverwrite}) {
    // Durable: the whole journal is written and synced before the state says
    // applying; from then on recovery replays it.
    cases.push_back({e, "journal:created", 1, true, false, 1});
    cases.push_back({e, "journal:record", 2, true, false, 1});
    cases.push_back({e, "journal:complete", 1, true, false, 1});
    cases.push_back({e, "state:applying", 1, true, true, 2});
    cases.push_back({e, "apply:record", 1, true, true, 2});
    cases.push_back({e, "apply:record", 4, true, true, 2});
    cases.push_back({e, "apply:done", 1, true, true, 2});
    cases.push_back({e, "apply:synced", 1, true, true, 2});
    cases.push_back({e, "state:committed", 1, true, false, 2});
    cases.push_back({e, "journal:removed", 1, true, false, 2});
    // Streamed: the state says applying before the first record, each
    // record is applied once written, and recovery rolls back every record
    // written until the state says committed.
    cases.push_back({e, "journal:created", 1, false, false, 1});
    cases.push_back({e, "state:applying", 1, false, true, 1});
    cases.push_back({e, "apply:record", 1, false, true, 1});
    cases.push_back({e, "apply:record", 4, false, true, 1});
    cases.push_back({e, "apply:record", 9, false, true, 1});
    cases.push_back({e, "apply:done", 1, false, true, 1});
    cases.push_back({e, "apply:synced", 1, false, true, 1});
    cases.push_back({e, "state:committed", 1, false, false, 2});
    cases.push_back({e, "journal:removed", 1, false, false, 2});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Points, ApplyCrash, ::testing::ValuesIn(ApplyCrashCases()),
                         [](const ::testing::TestParamInfo<CrashCase>& info) {
                           std::string name = std::string(EncodingName(info.param.encoding)) + "_" +
                                              info.param.point + "_" +
                                              std::to_string(info.param.hit) +
                                              (info.param.durable ? "_durable" : "");
                           for (char& ch : name) {
                             if (ch == ':') ch = '_';
                           }
                           return name;
                         });

// The Python receiver found our interrupted apply (no "version"), reseeded
// the checkpoint from the base and wrote its version while keeping our keys.
// Its commit wins: our journal must not be replayed onto its checkpoint.
TEST(ForeignCommit, AfterAnInterruptedApplyWins) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  {
    auto local = f.OpenLocal();
    DS_ASSERT_OK(local->Pull(1));
  }
  ASSERT_EQ(PullInChild(f.LocalOpts(), 2, "state:applying"), kCrashExit);
  ASSERT_TRUE(io::PathExists(f.local + "/.weight_sync/journal"));
  for (const std::string& name : ListDir(f.base)) {
    WriteFile(f.local + "/" + name, ReadFile(f.base + "/" + name));
  }
  nlohmann::json state = ReadState(f.local);
  state["version"] = "000000";
  WriteFile(f.local + "/.weight_sync/state.json", state.dump());
  auto local = f.OpenLocal();
  EXPECT_EQ(**local->CurrentVersion(), 0);
  EXPECT_TRUE(HoldsModel(f.local, f.base_model));
  EXPECT_FALSE(io::PathExists(f.local + "/.weight_sync/journal"));
  Result<PullResult> r = local->Pull(2);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->versions_applied, (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

class ResetCrash : public ::testing::TestWithParam<const char*> {};

TEST_P(ResetCrash, MaterializationRestartsCleanly) {
  Fixture f;
  PublisherOptions po = f.PublisherOpts(Encoding::kXor);
  auto publisher = f.MakePublisher(po);
  std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  models.push_back(Step(models.back(), 11));
  DS_ASSERT_OK(publisher->Publish(Views(models.back()), /*full=*/true));
  const std::vector<Model> more = PublishSteps(publisher.get(), models.back(), 1, 12);
  // A local checkpoint at version 1 resets to full version 2, then applies 3.
  {
    auto local = f.OpenLocal();
    DS_ASSERT_OK(local->Pull(1));
  }
  ASSERT_EQ(PullInChild(f.LocalOpts(), 3, GetParam()), kCrashExit);
  auto copies = [&] {
    size_t n = 0;
    for (const std::string& name : ListDir(f.local)) n += name.find(".copy.") != std::string::npos;
    return n;
  };
  if (std::string_view(GetParam()) == "copy:written") {
    EXPECT_GT(copies(), 0u) << "the crash must leave the copy's temporaries";
  }
  auto local = f.OpenLocal();
  Result<std::optional<int64_t>> v = local->CurrentVersion();
  DS_ASSERT_OK(v);
  if (std::string_view(GetParam()) == "reset:committed") {
    EXPECT_EQ(*v, std::optional<int64_t>(2));
    EXPECT_TRUE(HoldsModel(f.local, models[2]));
  } else if (std::string_view(GetParam()) != "reset:begin") {
    EXPECT_FALSE(v->has_value());  // mid-reset: no version
  }
  Result<PullResult> r = local->Pull(3);
  DS_ASSERT_OK(r);
  EXPECT_TRUE(HoldsModel(f.local, more[1]));
  DS_EXPECT_OK(local->Verify());
  EXPECT_EQ(copies(), 0u) << "the pull after a killed reset removes its partial copies";
}

INSTANTIATE_TEST_SUITE_P(Points, ResetCrash,
                         ::testing::Values("reset:begin", "reset:state", "copy:written",
                                           "reset:copied", "reset:committed"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           name[name.find(':')] = '_';
                           return name;
                         });

// The Open that recovers an interrupted apply says so through the next
// Pull, as a pull that recovers it itself does.
TEST(StreamedApply, RecoveryByOpenIsReported) {
  for (bool recover_on_open : {true, false}) {
    SCOPED_TRACE(recover_on_open);
    Fixture f;
    auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
    const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2, 100, 0.05);
    LocalCheckpointOptions lo = f.LocalOpts();
    lo.journal_record_changes = 5;
    DS_ASSERT_OK(f.OpenLocal()->Pull(1));
    ASSERT_EQ(PullInChild(lo, 2, "apply:record", 2), kCrashExit);
    lo.recover_on_open = recover_on_open;
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(local);
    Result<PullResult> r = (*local)->Pull(2);
    DS_ASSERT_OK(r);
    EXPECT_TRUE(r->recovered);
    EXPECT_EQ(r->versions_applied, (std::vector<int64_t>{2}));
    EXPECT_TRUE(HoldsModel(f.local, models[2]));
    // Reported once: the next pull recovered nothing.
    Result<PullResult> again = (*local)->Pull(2);
    DS_ASSERT_OK(again);
    EXPECT_FALSE(again->recovered);
  }
}

// A version whose checksum does not match: the apply rolls back. Dying
// during that apply, or during the rollback, must still end at version 1.
TEST(CrashDuringRollback, EndsAtTheOldVersion) {
  for (const char* point : {"apply:record", "undo:done"}) {
    Fixture f;
    auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
    const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
    // Forge the checksum of one tensor of version 2.
    const std::string dir = f.VersionPath(2);
    ASSERT_EQ(::unlink((dir + "/deltasync.json").c_str()), 0);
    const std::string name = "model.layers.0.mlp.up_proj.weight";
    const std::string path = FileHolding(dir, name);
    {
      std::vector<OwnedTensor> copies;
      std::map<std::string, std::string> md;
      {
        auto file = SafetensorsFile::Open(path);
        DS_ASSERT_OK(file);
        md = (*file)->metadata();
        for (const TensorView& t : (*file)->tensors()) {
          copies.push_back({t.name, t.dtype, t.shape, {t.bytes.begin(), t.bytes.end()}});
        }
      }
      md[name] = std::string(md[name].size(), 'a');
      std::vector<TensorView> views;
      for (const OwnedTensor& t : copies) views.push_back(t.view());
      DS_ASSERT_OK(WriteSafetensors(path, views, md));
    }
    {
      auto local = f.OpenLocal();
      DS_ASSERT_OK(local->Pull(1));
    }
    LocalCheckpointOptions lo = f.LocalOpts();
    lo.journal_record_changes = 3;  // the forged tensor spans several records
    ASSERT_EQ(PullInChild(lo, 2, point), kCrashExit) << point;
    auto local = f.OpenLocal();
    EXPECT_EQ(**local->CurrentVersion(), 1) << point;
    EXPECT_TRUE(HoldsModel(f.local, models[1])) << point;
    Result<PullResult> r = local->Pull(2);
    EXPECT_TRUE(r.status().IsCorruption()) << r.status().ToString();
    EXPECT_TRUE(HoldsModel(f.local, models[1])) << point;
    EXPECT_EQ(**local->CurrentVersion(), 1);
  }
}

// Publishes versions 1 and 2 in `encoding`, pulls version 1 with several
// journal records per tensor (options in *lo), then kills a pull of version
// 2 just after its `hit`-th record is applied. Returns the models.
std::vector<Model> KillStreamedPullAtRecord(Fixture* f, Encoding encoding, int hit,
                                            LocalCheckpointOptions* lo) {
  auto publisher = f->MakePublisher(f->PublisherOpts(encoding));
  std::vector<Model> models = PublishSteps(publisher.get(), f->base_model, 2, 100, 0.05);
  *lo = f->LocalOpts();
  lo->journal_record_changes = 5;
  {
    auto local = LocalCheckpoint::Open(*lo);
    DS_EXPECT_OK(local);
    if (local.ok()) DS_EXPECT_OK((*local)->Pull(1));
  }
  EXPECT_EQ(PullInChild(*lo, 2, "apply:record", hit), kCrashExit);
  return models;
}

// A streamed apply killed while appending a record leaves it torn at the
// journal's end; it was never applied. Recovery rolls back the intact
// records before it and ignores the torn bytes.
TEST(StreamedApply, RecoveryIgnoresATornLastRecord) {
  for (Encoding e : {Encoding::kXor, Encoding::kSparse}) {
    Fixture f;
    LocalCheckpointOptions lo;
    const std::vector<Model> models = KillStreamedPullAtRecord(&f, e, 3, &lo);
    ASSERT_FALSE(::testing::Test::HasFailure());
    const std::string journal = f.local + "/.weight_sync/journal";
    // The start of the first record again, cut short: a torn append.
    const std::string bytes = ReadFile(journal);
    ASSERT_GT(bytes.size(), 32u + 60u);
    {
      std::ofstream out(journal, std::ios::binary | std::ios::app);
      out.write(bytes.data() + 32, 60);
    }
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK(local);
    EXPECT_EQ(**(*local)->CurrentVersion(), 1) << EncodingName(e);
    EXPECT_TRUE(HoldsModel(f.local, models[1])) << EncodingName(e);
    EXPECT_FALSE(io::PathExists(journal));
    DS_ASSERT_OK((*local)->Pull(2));
    EXPECT_TRUE(HoldsModel(f.local, models[2])) << EncodingName(e);
  }
}

// A state that says streamed but whose journal lost its header cannot be
// rolled back: the checkpoint is reseeded, never trusted.
TEST(StreamedApply, AJournalWithoutItsHeaderIsReseeded) {
  Fixture f;
  LocalCheckpointOptions lo;
  const std::vector<Model> models = KillStreamedPullAtRecord(&f, Encoding::kSparse, 2, &lo);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string journal = f.local + "/.weight_sync/journal";
  std::string bytes = ReadFile(journal);
  bytes[3] ^= 0x20;
  WriteFile(journal, bytes);
  lo.recover_on_open = false;
  auto local = LocalCheckpoint::Open(lo);
  DS_ASSERT_OK(local);
  Result<PullResult> r = (*local)->Pull(2);
  DS_ASSERT_OK(r);
  EXPECT_TRUE(r->reseeded);
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

class BootId : public ::testing::Test {
 protected:
  void TearDown() override { store_internal::SetBootIdForTesting(std::nullopt); }
};

TEST_F(BootId, IsTheKernelsBootId) {
  const std::string id = store_internal::CurrentBootId();
  EXPECT_EQ(id.size(), 36u) << id;  // a UUID, newline stripped
  EXPECT_EQ(id, store_internal::CurrentBootId());
}

TEST_F(BootId, NonDurableCommitIsVerifiedAfterAReboot) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 1);
  store_internal::SetBootIdForTesting("boot-a");
  {
    auto local = f.OpenLocal();
    DS_ASSERT_OK(local->Pull(1));
  }
  EXPECT_EQ(ReadState(f.local)["boot_id"], "boot-a");
  EXPECT_EQ(ReadState(f.local)["durable"], false);
  // Reboot; the data survived: verified, trusted, marked durable.
  store_internal::SetBootIdForTesting("boot-b");
  {
    auto local = f.OpenLocal();
    Result<PullResult> r = local->Pull(1);
    DS_ASSERT_OK(r);
    EXPECT_FALSE(r->reseeded);
    EXPECT_EQ(ReadState(f.local)["durable"], true);
  }
  // A non-durable commit, then a reboot that lost some of the data: a
  // changed tensor and a base-copied one differ from what was committed.
  store_internal::SetBootIdForTesting("boot-c");
  {
    auto local = f.OpenLocal();
    DS_ASSERT_OK(local->Pull(0));
    DS_ASSERT_OK(local->Pull(1));
  }
  const std::string name = "model.norm.weight";
  const std::string path = FileHolding(f.local, name);
  FlipByte(path, TensorOffsetInFile(path, name) + 2);
  store_internal::SetBootIdForTesting("boot-d");
  auto local = f.OpenLocal();  // recovery happens here
  Result<PullResult> r = local->Pull(1);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_TRUE(HoldsModel(f.local, models[1]));
}

TEST_F(BootId, DurableCommitsAreTrustedAfterAReboot) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts());
  PublishSteps(publisher.get(), f.base_model, 1);
  LocalCheckpointOptions lo = f.LocalOpts();
  lo.durable = true;
  store_internal::SetBootIdForTesting("boot-a");
  {
    auto local = LocalCheckpoint::Open(lo);
    DS_ASSERT_OK((*local)->Pull(1));
  }
  EXPECT_EQ(ReadState(f.local)["durable"], true);
  const std::string name = "model.norm.weight";
  const std::string path = FileHolding(f.local, name);
  FlipByte(path, TensorOffsetInFile(path, name));
  store_internal::SetBootIdForTesting("boot-b");
  auto local = LocalCheckpoint::Open(lo);
  Result<PullResult> r = (*local)->Pull(1);
  DS_ASSERT_OK(r);
  EXPECT_FALSE(r->applied);  // trusted without reading it back
  EXPECT_TRUE((*local)->Verify().IsCorruption());
}

TEST_F(BootId, NonDurableApplyInterruptedByARebootIsReseeded) {
  Fixture f;
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2);
  store_internal::SetBootIdForTesting("boot-a");
  {
    auto local = f.OpenLocal();
    DS_ASSERT_OK(local->Pull(1));
  }
  ASSERT_EQ(PullInChild(f.LocalOpts(), 2, "apply:record", 2), kCrashExit);
  store_internal::SetBootIdForTesting("boot-b");
  auto local = f.OpenLocal();
  Result<PullResult> r = local->Pull(2);
  DS_ASSERT_OK(r);
  EXPECT_EQ(r->reset_to, 0);
  EXPECT_TRUE(HoldsModel(f.local, models[2]));
}

// A real SIGKILL at arbitrary instants of a larger xor apply.
TEST(KillNine, MidApplyOfALargerModel) {
  Fixture f;
  f.base_model = MakeModel(3, /*rows=*/4096);
  auto publisher = f.MakePublisher(f.PublisherOpts(Encoding::kXor));
  const std::vector<Model> models = PublishSteps(publisher.get(), f.base_model, 2, 40, 0.2);
  int killed_mid_apply = 0;
  int pending_apply = 0;
  for (int round = 0; round < 8; ++round) {
    {
      auto local = f.OpenLocal();
      DS_ASSERT_OK(local->Pull(1));
    }
    int pipe_fds[2];
    ASSERT_EQ(::pipe(pipe_fds), 0);
    const char* point = round % 2 == 0 ? "state:applying" : "journal:created";
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipe_fds[0]);
      ThreadPool pool(2);
      LocalCheckpointOptions lo = f.LocalOpts();
      lo.pool = &pool;
      g_crash_point = point;
      g_hits = 0;
      g_signal_fd = pipe_fds[1];
      store_internal::SetCrashHookForTesting(&SignalAtCrashPoint);
      auto local = LocalCheckpoint::Open(lo);
      if (!local.ok()) ::_exit(2);
      ::_exit((*local)->Pull(2).ok() ? 0 : 3);
    }
    ::close(pipe_fds[1]);
    char c;
    const bool reached = ::read(pipe_fds[0], &c, 1) == 1;
    ::close(pipe_fds[0]);
    std::this_thread::sleep_for(std::chrono::microseconds(250 * (round / 2)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(reached);
    if (WIFSIGNALED(status)) {
      ++killed_mid_apply;
      const nlohmann::json state = ReadState(f.local);
      if (!state.contains("version")) {
        EXPECT_TRUE(state.contains("applying")) << state.dump();
        ++pending_apply;
      }
    }
    auto local = f.OpenLocal();
    Result<PullResult> r = local->Pull(2);
    DS_ASSERT_OK(r);
    EXPECT_TRUE(HoldsModel(f.local, models[2])) << "round " << round;
    DS_EXPECT_OK(local->Verify());
  }
  EXPECT_GT(killed_mid_apply, 0);
  EXPECT_GT(pending_apply, 0);  // some kills landed while the checkpoint was being written
}

}  // namespace
}  // namespace deltasync::store_test
