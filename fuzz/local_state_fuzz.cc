// libFuzzer target for the local checkpoint's state file,
// <local>/.weight_sync/state.json (docs/format.md, "The local checkpoint").
//
// The state's parser is internal to local_checkpoint.cc, so the input goes
// in through the file: it replaces state.json of a saved local checkpoint,
// which is then opened without recovery (CurrentVersion, Verify), opened
// with recovery, and pulled to the store's version 2. The saved checkpoint
// is picked by the input's size:
//  0: committed at version 1 (the state it had is replaced);
//  1: killed part way through a streamed (non-durable) apply of version 2:
//     journal of undo-only records, some of them applied;
//  2: killed after a durable apply of version 2 wrote every record, before
//     the commit: complete journal, data applied.
// Whatever the state says, nothing may crash, leak or hang, and a pull that
// succeeds must report version 2. When the state claims no committed
// version (or, for checkpoint 0, one no newer than 1, which is what it
// holds), the recovery and the pull must also give version 2's bytes
// exactly: the state can only make the pull slower (a reseed), not wrong.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "deltasync/store.h"
#include "format/json_util.h"
#include "store_fuzz_util.h"

namespace {

using deltasync::Encoding;
using deltasync::LocalCheckpoint;
using deltasync::Result;
using deltasync::fuzz_util::FuzzStore;
using deltasync::fuzz_util::Require;

const char* g_crash_point = nullptr;
int g_crash_hit = 1;

void DieAtCrashPoint(std::string_view point) {
  static std::atomic<int> hits{0};
  if (g_crash_point != nullptr && point == g_crash_point && ++hits == g_crash_hit) ::_exit(42);
}

// Pulls version 2 in a child process that dies at the `hit`-th pass through
// `point`, then keeps what it left as saved checkpoint `name`.
void SaveInterrupted(FuzzStore& s, const char* point, int hit, bool durable, const char* name) {
  s.Restore("v1");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    deltasync::ThreadPool pool(2);  // the parent's pool has no threads here
    deltasync::LocalCheckpointOptions o = s.LocalOpts(durable);
    o.pool = &pool;
    o.journal_record_changes = 4;  // several records per tensor
    g_crash_point = point;
    g_crash_hit = hit;
    deltasync::store_internal::SetCrashHookForTesting(&DieAtCrashPoint);
    Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(o);
    if (l.ok()) (void)(*l)->Pull(2);
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  Require(WIFEXITED(status) && WEXITSTATUS(status) == 42, "the interrupted pull died");
  s.SaveLocal(name);
}

FuzzStore& Store() {
  // Static (not leaked) so that its scratch directory goes at exit.
  static FuzzStore store("ds_local_state_fuzz", {Encoding::kSparse, Encoding::kXor});
  static const bool saved = [] {
    store.SaveLocalAt(1, "v1");
    SaveInterrupted(store, "apply:record", 3, /*durable=*/false, "streamed");
    SaveInterrupted(store, "apply:done", 1, /*durable=*/true, "durable");
    return true;
  }();
  (void)saved;
  return store;
}

// The committed version the state claims, as our reader would take it:
// "version" holding 6 to 18 digits. nullopt when it claims none.
std::optional<int64_t> ClaimedVersion(std::string_view text) {
  Result<nlohmann::json> doc = deltasync::format_internal::ParseJsonStrict(text, 6);
  if (!doc.ok() || !doc->is_object()) return std::nullopt;
  auto it = doc->find("version");
  if (it == doc->end() || !it->is_string()) return std::nullopt;
  Result<int64_t> v = deltasync::ParseVersion(it->get<std::string>());
  if (!v.ok()) return std::nullopt;
  return *v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzStore& s = Store();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  static const char* const kSaved[] = {"v1", "streamed", "durable"};
  const size_t which = size % 3;
  s.Restore(kSaved[which]);
  deltasync::fuzz_util::WriteFile(s.local() + "/.weight_sync/state.json", text);
  const bool durable = which == 2;
  {
    Result<std::unique_ptr<LocalCheckpoint>> l =
        LocalCheckpoint::Open(s.LocalOpts(durable, /*recover_on_open=*/false));
    Require(l.ok(), "a local checkpoint opens without recovery whatever its state");
    (void)(*l)->CurrentVersion();
    (void)(*l)->Verify();
  }
  Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(s.LocalOpts(durable));
  if (!l.ok()) return 0;
  Result<deltasync::PullResult> pulled = (*l)->Pull(2);
  if (!pulled.ok()) return 0;
  Require(pulled->version == 2, "a pull to version 2 reports version 2");
  Result<std::optional<int64_t>> now = (*l)->CurrentVersion();
  Require(now.ok() && *now == std::optional<int64_t>(2), "after the pull the state says 2");
  const std::optional<int64_t> claimed = ClaimedVersion(text);
  if (!claimed || (which == 0 && *claimed <= 1)) {
    Require(deltasync::fuzz_util::HoldsModel(s.local(), s.model(2)),
            "a state that claims nothing false leads to version 2's exact bytes");
  }
  return 0;
}
