// LocalCheckpoint: brings a host-local full checkpoint to a version of a
// store. Every change of a version is journaled as an idempotent (position,
// old, new) triple before it is applied in place through read-write shared
// mappings; each tensor is verified and the version committed. A durable
// pull journals (and syncs) the whole version before touching the
// checkpoint; otherwise each record is applied as soon as it is written.
// An interrupted apply is replayed or rolled back from the journal by the
// next Pull or Open.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "deltasync/checkpoint.h"
#include "deltasync/diff.h"
#include "deltasync/store.h"
#include "deltasync/timing.h"
#include "format/json_util.h"
#include "io/file.h"
#include "io/mapping.h"
#include "io/process.h"
#include "pipeline/applier.h"
#include "store/chain_state.h"
#include "store/journal.h"
#include "store/store_internal.h"
#include "store/version_internal.h"

namespace deltasync {
namespace {

using core_internal::FirstError;
using format_internal::QuoteForMessage;
using io::JoinPath;
using io::MappedFile;
using io::PrefaultForWrite;
using nlohmann::json;
using store_internal::CrashPoint;
using store_internal::Journal;
using store_internal::JournalRecord;
using store_internal::JournalWriter;

constexpr const char* kSyncDirName = ".weight_sync";
constexpr const char* kStateFileName = "state.json";
constexpr const char* kLockFileName = "lock";
// Ours alone: the Python receiver replaces state.json with {"version": ...}
// and would drop anything we kept there.
constexpr const char* kBaseRecordFileName = "deltasync-base.json";
constexpr uint64_t kMaxStateBytes = 256ull << 20;

// A file a checkpoint loader would read as weights.
bool IsWeightsFileName(const std::string& name) {
  return name == kIndexFileName || (name.size() > 12 && name.ends_with(".safetensors"));
}

// InvalidArgument unless the local checkpoint is a place of its own: a pull
// writes into it, so it must be neither the base checkpoint nor the store,
// nor inside either, nor hold either.
Status CheckSeparatePaths(const LocalCheckpointOptions& o) {
  const std::pair<const std::string*, const char*> others[] = {{&o.base, "base checkpoint"},
                                                               {&o.store, "store"}};
  for (const auto& [other, what] : others) {
    if (other->empty()) continue;
    const bool inside = io::IsSameOrInside(o.local, *other);
    const bool holds = io::IsSameOrInside(*other, o.local);
    if (!inside && !holds) continue;
    const std::string relation = inside && holds ? "is the same directory as"
                                 : inside        ? "lies inside"
                                                 : "holds";
    return Status::InvalidArgument(
        "local checkpoint " + o.local + " " + relation + " the " + what + " " + *other +
        ": a pull writes into the local checkpoint, so it needs a " + "directory of its own");
  }
  return Status::OK();
}

// "algo:hex", how state.json and the journal store a digest with its algorithm.
std::string TaggedDigest(ChecksumAlgo algo, std::string_view hex) {
  return std::string(ChecksumAlgoName(algo)) + ":" + std::string(hex);
}

struct ParsedDigest {
  ChecksumAlgo algo = ChecksumAlgo::kXxh3_128;
  std::string hex;
};
Result<ParsedDigest> ParseTaggedDigest(std::string_view tagged) {
  const size_t colon = tagged.find(':');
  if (colon == std::string_view::npos) {
    return Status::Corruption("digest " + QuoteForMessage(tagged, 80) + " lacks its algorithm");
  }
  DS_ASSIGN_OR_RETURN(ChecksumAlgo algo, ParseChecksumAlgo(tagged.substr(0, colon)));
  ParsedDigest d{algo, std::string(tagged.substr(colon + 1))};
  DS_RETURN_IF_ERROR(store_internal::CheckDigestText(d.hex, algo, "digest"));
  return d;
}

// What <local>/.weight_sync/state.json says. Keys of other writers are kept.
struct LocalState {
  bool exists = false;  // state.json was there (readable or not)
  json doc = json::object();
  std::optional<int64_t> version;
  std::optional<int64_t> applying;
  std::optional<int64_t> from_version;
  std::optional<int64_t> resetting;
  // While applying: records were applied as they were journaled, undo-only;
  // recovery rolls them back (see StreamVersion).
  bool streamed = false;
  std::string boot_id;  // empty: not recorded (e.g. written by the Python receiver)
  bool durable = false;
  // Tagged digests of the local tensors, valid for `version` (or, while
  // applying, for from_version); tensors absent from it equal `origin`'s.
  std::map<std::string, std::string> checksums;
  std::string origin_dir;
  std::optional<int64_t> origin_version;
};

constexpr const char* kOurKeys[] = {"version",  "applying",         "from_version", "resetting",
                                    "streamed", "boot_id",          "durable",      "checksums",
                                    "origin",   "checksums_version"};

std::optional<int64_t> VersionKey(const json& doc, const char* key) {
  auto it = doc.find(key);
  if (it == doc.end() || !it->is_string()) return std::nullopt;
  Result<int64_t> v = ParseVersion(it->get<std::string>());
  if (!v.ok()) return std::nullopt;
  return *v;
}

// A state file we cannot read tells us nothing: the checkpoint is then at no
// version (it will be reseeded), which is never wrong, only slower.
LocalState ParseState(std::string_view text) {
  LocalState st;
  Result<json> parsed = format_internal::ParseJsonStrict(text, 6);
  if (!parsed.ok() || !parsed->is_object()) return st;
  st.doc = std::move(*parsed);
  st.version = VersionKey(st.doc, "version");
  st.applying = VersionKey(st.doc, "applying");
  st.from_version = VersionKey(st.doc, "from_version");
  st.resetting = VersionKey(st.doc, "resetting");
  // We never write "version" next to "applying" or "resetting": finding both
  // means another writer (the Python receiver, which keeps keys it does not
  // know) committed a version after our apply or reset began. Its commit
  // wins; our journal no longer describes the checkpoint.
  if (st.version) {
    st.applying.reset();
    st.from_version.reset();
    st.resetting.reset();
  }
  if (st.applying && !st.from_version) st.applying.reset();
  if (auto it = st.doc.find("streamed"); st.applying && it != st.doc.end() && it->is_boolean()) {
    st.streamed = it->get<bool>();
  }
  if (auto it = st.doc.find("boot_id"); it != st.doc.end() && it->is_string()) {
    st.boot_id = it->get<std::string>();
  }
  if (auto it = st.doc.find("durable"); it != st.doc.end() && it->is_boolean()) {
    st.durable = it->get<bool>();
  }
  // Checksums describe the local bytes only if they were written for the
  // version the state now names (a writer that knows only "version" may have
  // moved it on and kept our other keys).
  const std::optional<int64_t> described = st.applying ? st.from_version : st.version;
  if (described && VersionKey(st.doc, "checksums_version") == described) {
    if (auto it = st.doc.find("checksums"); it != st.doc.end() && it->is_object()) {
      for (auto c = it->begin(); c != it->end(); ++c) {
        if (c->is_string()) st.checksums[c.key()] = c->get<std::string>();
      }
    }
    if (auto it = st.doc.find("origin"); it != st.doc.end() && it->is_object()) {
      if (auto d = it->find("dir"); d != it->end() && d->is_string()) {
        st.origin_dir = d->get<std::string>();
      }
      st.origin_version = VersionKey(*it, "version");
    }
  }
  return st;
}

std::string SerializeState(const LocalState& st) {
  json doc = st.doc;
  for (const char* key : kOurKeys) doc.erase(key);
  if (st.version) doc["version"] = FormatVersion(*st.version);
  if (st.applying) {
    doc["applying"] = FormatVersion(*st.applying);
    doc["from_version"] = FormatVersion(*st.from_version);
    if (st.streamed) doc["streamed"] = true;
  }
  if (st.resetting) doc["resetting"] = FormatVersion(*st.resetting);
  doc["boot_id"] = st.boot_id;
  doc["durable"] = st.durable;
  const std::optional<int64_t> described = st.applying ? st.from_version : st.version;
  if (described) {
    doc["checksums_version"] = FormatVersion(*described);
    doc["checksums"] = st.checksums;
    if (!st.origin_dir.empty()) {
      json origin = json::object();
      origin["dir"] = st.origin_dir;
      if (st.origin_version) origin["version"] = FormatVersion(*st.origin_version);
      doc["origin"] = std::move(origin);
    }
  }
  return doc.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

// The local checkpoint's tensors, writable in place.
struct LocalTensor {
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::span<uint8_t> bytes;
  size_t file = 0;
};

class LocalFiles {
 public:
  static Result<std::unique_ptr<LocalFiles>> Open(const std::string& local) {
    Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(local);
    if (!checkpoint.ok()) {
      return checkpoint.status().WithContext("local checkpoint " + local + " is not readable");
    }
    auto files = std::make_unique<LocalFiles>();
    const auto& shards = (*checkpoint)->files();
    for (size_t i = 0; i < shards.size(); ++i) {
      const SafetensorsFile& shard = *shards[i];
      DS_ASSIGN_OR_RETURN(MappedFile map, MappedFile::OpenReadWrite(shard.path()));
      if (map.bytes().size() != shard.file_size()) {
        return Status::Corruption(shard.path() + ": changed size while being opened");
      }
      const size_t data_offset = 8 + shard.header_size();
      for (const TensorView& t : shard.tensors()) {
        const size_t offset =
            data_offset + static_cast<size_t>(t.bytes.data() - shard.data().data());
        files->tensors_[t.name] = {t.dtype, t.shape, map.bytes().subspan(offset, t.bytes.size()),
                                   i};
      }
      files->maps_.push_back(std::move(map));
    }
    files->touched_.assign(files->maps_.size(), 0);
    return files;
  }

  const LocalTensor* Find(std::string_view name) const {
    auto it = tensors_.find(std::string(name));
    return it == tensors_.end() ? nullptr : &it->second;
  }
  const std::map<std::string, LocalTensor>& tensors() const { return tensors_; }
  void Touch(const LocalTensor& t) { touched_[t.file] = 1; }
  Status SyncTouched() {
    for (size_t i = 0; i < maps_.size(); ++i) {
      if (touched_[i]) DS_RETURN_IF_ERROR(maps_[i].Sync());
    }
    return Status::OK();
  }

 private:
  std::vector<MappedFile> maps_;
  std::map<std::string, LocalTensor> tensors_;
  std::vector<char> touched_;  // not vector<bool>: tasks set entries concurrently
};

// Bytes of a tensor written and then hashed together during apply: small
// enough to stay in L2 between the two.
constexpr size_t kVerifyPieceBytes = size_t{256} << 10;

// One tensor of a version being applied, checked before decoding.
struct ApplyJob {
  std::string name;
  TensorView delta;
  const LocalTensor* target = nullptr;
  std::string checksum;       // tagged
  std::string base_checksum;  // tagged, or empty
};

// A version's encodings, for the applier: views into its shards, which
// ApplyVersion keeps mapped while it applies them.
class ShardEncodings final : public pipeline::EncodingSource {
 public:
  explicit ShardEncodings(const std::vector<ApplyJob>& jobs) : jobs_(jobs) {}
  Result<std::span<const uint8_t>> EncodingOf(size_t index) override {
    return jobs_[index].delta.bytes;
  }

 private:
  const std::vector<ApplyJob>& jobs_;
};

// Journals each run of changes the applier decodes, before it is applied.
// A durable apply journals every record whole (old and new values) before
// the checkpoint is touched; a streamed one journals undo-only records, each
// applied right after it is written, and marks the tensors' files touched.
class JournalRuns final : public pipeline::ApplyObserver {
 public:
  JournalRuns(JournalWriter* writer, const std::vector<ApplyJob>& jobs, LocalFiles* streamed_into)
      : writer_(writer), jobs_(jobs), local_(streamed_into) {}

  void Begin(size_t, size_t index) override {
    if (local_ != nullptr) local_->Touch(*jobs_[index].target);
  }
  Status Changes(size_t lane, size_t index, const ChangeSet& run) override {
    const ApplyJob& job = jobs_[index];
    const uint32_t es = static_cast<uint32_t>(DTypeSize(job.target->dtype));
    return writer_->AppendRecord(job.name, job.target->bytes.size() / es, es, job.checksum,
                                 job.base_checksum, run, &Head(lane),
                                 /*undo_only=*/local_ != nullptr);
  }
  void Written(size_t, size_t, const ChangeSet&) override { CrashPoint("apply:record"); }
  void Done(size_t, size_t) override {
    if (local_ == nullptr) CrashPoint("journal:record");
  }

 private:
  // The lane's JournalWriter::AppendRecord head buffer; a deque keeps it in
  // place while other lanes' are added.
  std::vector<uint8_t>& Head(size_t lane) {
    std::lock_guard<std::mutex> lock(mu_);
    while (heads_.size() <= lane) heads_.emplace_back();
    return heads_[lane];
  }

  JournalWriter* writer_;
  const std::vector<ApplyJob>& jobs_;
  LocalFiles* local_;
  std::mutex mu_;
  std::deque<std::vector<uint8_t>> heads_;
};

// What the applier takes for each job: `whats` holds each one's error
// prefix (where + ": tensor '<name>'") and `digests`, when given, each
// one's parsed expected digest (the result is then verified against it).
std::vector<pipeline::ApplyTensor> ApplyTensorsOf(const std::vector<ApplyJob>& jobs,
                                                  Encoding encoding, const std::string& where,
                                                  const std::vector<ParsedDigest>* digests,
                                                  std::vector<std::string>* whats) {
  whats->clear();
  for (const ApplyJob& job : jobs)
    whats->push_back(where + ": tensor " + QuoteForMessage(job.name));
  std::vector<pipeline::ApplyTensor> tensors(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    const ApplyJob& job = jobs[j];
    pipeline::ApplyTensor& t = tensors[j];
    t.what = (*whats)[j];
    t.encoding = encoding;
    t.target = job.target->bytes;
    t.elem_size = static_cast<uint32_t>(DTypeSize(job.target->dtype));
    if (digests != nullptr) {
      t.algo = (*digests)[j].algo;
      t.digest = (*digests)[j].hex;
    }
  }
  return tensors;
}

// A tensor's journal records, in journal order (one unless it is large).
struct RecordGroup {
  const LocalTensor* target = nullptr;
  std::vector<const JournalRecord*> records;
};

// A tensor whose bytes did not match its checksum after apply.
struct Mismatch {
  std::string_view name;
  std::string_view base_checksum;  // tagged, or empty
  std::span<const uint8_t> bytes;  // rolled back
};

// The error for tensors that failed verification after apply (and were
// rolled back to `version`): a wrong base when a tensor's bytes do not match
// its base checksum either, else a corrupt delta.
Status MismatchError(const std::string& where, const std::vector<Mismatch>& failed,
                     int64_t version) {
  std::string wrong_base, corrupt;
  for (const Mismatch& m : failed) {
    std::string* list = &corrupt;
    if (!m.base_checksum.empty()) {
      Result<ParsedDigest> base = ParseTaggedDigest(m.base_checksum);
      if (base.ok() && ChecksumHex(base->algo, m.bytes) != base->hex) list = &wrong_base;
    }
    if (list->size() < 300) *list += (list->empty() ? "'" : ", '") + std::string(m.name) + "'";
  }
  if (!wrong_base.empty()) {
    return Status::FailedPrecondition(
        where + ": the local checkpoint is not this version's base (tensor " + wrong_base +
        " differs from the base checksum); rolled back to version " + FormatVersion(version));
  }
  return Status::Corruption(where + ": checksum mismatch after apply for tensor " + corrupt +
                            " (corrupt delta, or the local checkpoint was not at version " +
                            FormatVersion(version) + "); rolled back to version " +
                            FormatVersion(version));
}

}  // namespace

struct LocalCheckpoint::State {
  LocalCheckpointOptions options;
  ThreadPool* pool = nullptr;
  std::string sync_dir;
  std::string state_path;
  std::string lock_path;
  std::string journal_path;
  std::string base_record_path;
  // Decodes and applies versions; made by the first apply and kept, with its
  // per-task decode state, across versions and pulls (fresh memory costs a
  // page fault and a kernel zeroing per page).
  std::unique_ptr<pipeline::Applier> applier;

  Result<LocalState> LoadState();
  Status SaveState(LocalState& st);
  Status Recover(LocalState* st, PullResult* result);
  Status Reseed(LocalState* st, PullResult* result);
  Status Materialize(const std::string& source, int64_t version, LocalState* st,
                     PullResult* result);
  Status ApplyVersion(const VersionInfo& info, LocalState* st, PullResult* result);
  Status StreamVersion(const VersionInfo& info, const std::vector<ApplyJob>& jobs,
                       LocalFiles* local, JournalWriter* writer, LocalState* st,
                       PullResult* result);
  Status ReplayJournal(const Journal& journal, LocalState* st);
  Result<std::vector<RecordGroup>> GroupRecords(const Journal& journal, const LocalFiles& local,
                                                const std::string& where);
  // Commits `version`, whose tensors now hold `checksums` (name, tagged).
  Status Commit(int64_t version,
                const std::vector<std::pair<std::string_view, std::string_view>>& checksums,
                LocalFiles* local, LocalState* st);
  // Writes every record's old values back (idempotent) and returns the
  // state to from_version.
  Status RollBack(const std::vector<RecordGroup>& groups, LocalFiles* local, LocalState* st,
                  const std::string& where);
  // RollBack of `journal`'s records, through `local` (opened here if null).
  Status RollBackJournal(const Journal& journal, LocalFiles* local, LocalState* st);
  Status VerifyAll(const LocalState& st);
  // The base checkpoint the checkpoint was last reset to, as an absolute
  // path, so that a Verify given none can still check the tensors no
  // version changed. "" when none is recorded (or the record is unreadable).
  std::string RecordedBase();
  Status RecordBase(const std::string& resolved_base);
  // Records options.base when no base is recorded yet (the checkpoint was
  // seeded by another receiver) and the store's version 1 vouches for it;
  // a base the store cannot check, or refuses, is not recorded.
  Status RecordVouchedBase();
  // FailedPrecondition unless a reset may replace what `local` holds: the
  // files of a checkpoint that no receiver made (no state.json) are kept
  // unless options.replace_unknown_checkpoint says otherwise.
  Status CheckReplaceable(const LocalState& st);
  // FailedPrecondition naming the first weights file `local` holds, if any.
  Status RefuseToReplaceWeights();
  // FailedPrecondition unless options.base (when given) is the base this
  // checkpoint's history starts from: the recorded one (the same directory),
  // or one the store's version 1 vouches for; a base the store refuses is
  // refused even with nothing recorded. Nothing to check when the pull
  // copies the given base (`copies_base`: the copy checks it). Sets
  // given_base_vouched when the store vouched for it.
  Status CheckGivenBase(bool copies_base);
  bool given_base_vouched = false;
  // Checks `base` against what the store's version 1 records about the base
  // it was made against, before anything is copied, and returns those
  // digests (name -> tagged) for state.json. Empty when the store records
  // nothing (no version 1 on the base, or no sidecar).
  Result<std::map<std::string, std::string>> CheckBaseAgainstStore(const Checkpoint& base,
                                                                   const std::string& base_path);
  // Corruption unless the full version `full` has exactly the tensor names,
  // dtypes and shapes of the base checkpoint (the option, else the recorded
  // one, else the local checkpoint when it is at a version).
  Status CheckFullLayout(const Checkpoint& full, const std::string& where, const LocalState& st);
  // A checkpoint at version 0 copied from another base than options.base
  // (a wrong base earlier, which the store could not check) counts as
  // nothing applied, so that the given base is copied instead.
  void ForgetACopyOfAnotherBase(LocalState* st);
  // An interrupted apply recovered (or reseeded) by Open, reported by the
  // next Pull.
  bool recovered_on_open = false;
  bool reseeded_on_open = false;
};

Result<LocalState> LocalCheckpoint::State::LoadState() {
  Result<std::string> text = io::ReadFileLimited(state_path, kMaxStateBytes);
  LocalState st;
  if (!text.ok()) {
    if (text.status().IsNotFound()) return st;
    if (!text.status().IsCorruption()) return text.status();
    // Too large to be ours: no version, but a state file all the same.
  } else {
    st = ParseState(*text);
  }
  st.exists = true;
  return st;
}

Status LocalCheckpoint::State::SaveState(LocalState& st) {
  DS_RETURN_IF_ERROR(io::WriteFileAtomically(state_path, SerializeState(st)));
  st.exists = true;
  return Status::OK();
}

std::string LocalCheckpoint::State::RecordedBase() {
  Result<std::string> text = io::ReadFileLimited(base_record_path, 1 << 20);
  if (!text.ok()) return "";
  Result<json> doc = format_internal::ParseJsonStrict(*text, 2);
  if (!doc.ok() || !doc->is_object()) return "";
  auto it = doc->find("base");
  return it != doc->end() && it->is_string() ? it->get<std::string>() : "";
}

Status LocalCheckpoint::State::RecordBase(const std::string& resolved_base) {
  if (RecordedBase() == resolved_base) return Status::OK();
  json doc = json::object();
  doc["base"] = resolved_base;
  return io::WriteFileAtomically(base_record_path,
                                 doc.dump(1, ' ', false, json::error_handler_t::replace) + "\n");
}

Status LocalCheckpoint::State::RecordVouchedBase() {
  if (!std::exchange(given_base_vouched, false)) return Status::OK();
  DS_ASSIGN_OR_RETURN(const std::string resolved, io::ResolvedPath(options.base));
  return RecordBase(resolved);
}

Status LocalCheckpoint::State::CheckGivenBase(bool copies_base) {
  given_base_vouched = false;
  if (options.base.empty() || copies_base) return Status::OK();
  const std::string recorded = RecordedBase();
  if (!recorded.empty() && io::IsSameOrInside(options.base, recorded) &&
      io::IsSameOrInside(recorded, options.base)) {
    return Status::OK();
  }
  const std::string not_ours = "base checkpoint " + options.base +
                               " is not the base local checkpoint " + options.local +
                               " was pulled from (" + recorded + ")";
  Result<std::unique_ptr<Checkpoint>> base = Checkpoint::Open(options.base);
  if (!base.ok()) {
    // Not needed by this pull, so not its error unless there is a base to
    // compare it with.
    if (recorded.empty()) return Status::OK();
    return Status::FailedPrecondition(not_ours +
                                      ", and it cannot be read: " + base.status().message());
  }
  // The store's record compares contents: a copy of the right base passes,
  // anything else is refused before this pull changes anything.
  Result<std::map<std::string, std::string>> vouched = CheckBaseAgainstStore(**base, options.base);
  if (!vouched.ok()) return vouched.status();
  if (!vouched->empty()) {
    given_base_vouched = true;
    return Status::OK();
  }
  if (recorded.empty()) return Status::OK();  // nothing to compare it with
  return Status::FailedPrecondition(not_ours + " and the store records nothing to compare them " +
                                    "by; give that base, or pull into a fresh local checkpoint");
}

[[gnu::noinline]] void LocalCheckpoint::State::ForgetACopyOfAnotherBase(LocalState* st) {
  if (!st->version || *st->version != 0 || st->origin_version != 0 || options.base.empty() ||
      st->origin_dir.empty()) {
    return;
  }
  if (io::IsSameOrInside(options.base, st->origin_dir) &&
      io::IsSameOrInside(st->origin_dir, options.base)) {
    return;
  }
  st->version.reset();
}

Status LocalCheckpoint::State::CheckReplaceable(const LocalState& st) {
  if (st.exists || options.replace_unknown_checkpoint) return Status::OK();
  return RefuseToReplaceWeights();
}

Status LocalCheckpoint::State::RefuseToReplaceWeights() {
  Result<std::vector<std::string>> names = io::ListRegularFiles(options.local);
  if (!names.ok()) return names.status().IsNotFound() ? Status::OK() : names.status();
  for (const std::string& name : *names) {
    if (!IsWeightsFileName(name)) continue;
    return Status::FailedPrecondition(
        "local checkpoint " + options.local + " already holds " + name +
        ", a checkpoint that no pull made (there is no .weight_sync/state.json); refusing to " +
        "replace it: give the local checkpoint a directory of its own, or force the " +
        "replacement (--force)");
  }
  return Status::OK();
}

Result<std::map<std::string, std::string>> LocalCheckpoint::State::CheckBaseAgainstStore(
    const Checkpoint& base, const std::string& base_path) {
  std::map<std::string, std::string> digests;
  if (options.store.empty()) return digests;
  const std::string first = store_internal::VersionDir(options.store, 1);
  if (!io::IsDirectory(first)) return digests;
  // A malformed version 1 is reported by the pull that applies it.
  Result<VersionInfo> info = ReadVersionInfo(first);
  if (!info.ok() || !info->is_delta || info->base_version != 0) return digests;
  Result<std::optional<VersionManifest>> manifest = ReadVersionManifest(first);
  if (!manifest.ok() || !manifest->has_value()) return digests;
  const VersionManifest& m = **manifest;
  // What the base held, tensor by tensor: a changed tensor's base checksum;
  // an unchanged one's digest at version 1 (its `state`, when recorded).
  // The strong digests when the sidecar keeps them beside a weak format.
  const ChecksumAlgo algo = m.strong.value_or(m.checksum);
  struct Expected {
    const std::string* name;
    const ManifestTensor* changed;  // null: unchanged by version 1
    const std::string* hex;
  };
  std::vector<Expected> expected;
  for (const auto& [name, t] : m.tensors) {
    expected.push_back({&name, &t, m.strong ? &t.strong_base_checksum : &t.base_checksum});
  }
  if (m.state) {
    for (const auto& [name, hex] : m.strong ? m.strong_state : *m.state) {
      if (!m.tensors.count(name)) expected.push_back({&name, nullptr, &hex});
    }
    for (const auto& [name, t] : base.tensors()) {
      if (!m.state->count(name)) {
        return Status::FailedPrecondition(
            "base checkpoint " + base_path + " is not the base of store " + options.store +
            ": it has tensor " + QuoteForMessage(name) + ", which version 000001 does not know");
      }
    }
  }
  std::sort(expected.begin(), expected.end(),
            [](const Expected& a, const Expected& b) { return *a.name < *b.name; });
  const std::string not_base =
      "base checkpoint " + base_path + " is not the base of store " + options.store + ": ";
  std::vector<Status> outcome(expected.size());
  pool->ParallelFor(expected.size(), [&](size_t i) {
    const Expected& e = expected[i];
    const std::string name = QuoteForMessage(*e.name);
    Result<TensorView> t = base.Get(*e.name);
    if (!t.ok()) {
      outcome[i] = Status::FailedPrecondition(not_base + "it lacks tensor " + name +
                                              ", which version 000001 records");
    } else if (e.changed && (t->dtype != e.changed->dtype || t->shape != e.changed->shape)) {
      outcome[i] = Status::FailedPrecondition(
          not_base + "tensor " + name + " is " + std::string(DTypeName(t->dtype)) +
          ShapeToString(t->shape) + " there, " + std::string(DTypeName(e.changed->dtype)) +
          ShapeToString(e.changed->shape) + " in version 000001");
    } else if (const std::string actual = ChecksumHex(algo, t->bytes); actual != *e.hex) {
      outcome[i] = Status::FailedPrecondition(not_base + "tensor " + name + " has " +
                                              std::string(ChecksumAlgoName(algo)) + " " + actual +
                                              ", version 000001 was made against " + *e.hex);
    }
  });
  for (const Status& st : outcome) DS_RETURN_IF_ERROR(st);  // the first by name
  for (const Expected& e : expected) digests[*e.name] = TaggedDigest(algo, *e.hex);
  return digests;
}

Status LocalCheckpoint::State::CheckFullLayout(const Checkpoint& full, const std::string& where,
                                               const LocalState& st) {
  std::unique_ptr<Checkpoint> reference;
  std::string what;
  const std::string base = options.base.empty() ? RecordedBase() : options.base;
  if (!base.empty()) {
    Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(base);
    if (!opened.ok()) return opened.status().WithContext("base checkpoint");
    reference = std::move(*opened);
    what = "the base checkpoint " + base;
  } else if (st.version) {
    Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(options.local);
    if (!opened.ok()) return Status::OK();  // nothing to compare with; the reset rebuilds it
    reference = std::move(*opened);
    what = "the local checkpoint " + options.local;
  } else {
    return Status::OK();
  }
  auto mismatch = [&](const std::string& detail) {
    return Status::Corruption(where + " is not a full checkpoint of this model: " + detail +
                              " (a delta whose index lost its delta metadata?); nothing was " +
                              "replaced");
  };
  for (const auto& [name, t] : full.tensors()) {
    Result<TensorView> r = reference->Get(name);
    if (!r.ok()) return mismatch("it has tensor " + QuoteForMessage(name) + ", " + what + " not");
    if (r->dtype != t.dtype || r->shape != t.shape) {
      return mismatch("tensor " + QuoteForMessage(name) + " is " + std::string(DTypeName(t.dtype)) +
                      ShapeToString(t.shape) + " there, " + std::string(DTypeName(r->dtype)) +
                      ShapeToString(r->shape) + " in " + what);
    }
  }
  for (const auto& [name, r] : reference->tensors()) {
    if (!full.Get(name).ok()) {
      return mismatch("it lacks tensor " + QuoteForMessage(name) + ", which " + what + " has");
    }
  }
  return Status::OK();
}

Status LocalCheckpoint::State::Reseed(LocalState* st, PullResult* result) {
  DS_RETURN_IF_ERROR(io::RemoveFileIfExists(journal_path));
  json keep = st->doc;
  *st = LocalState();
  st->doc = std::move(keep);
  st->boot_id = store_internal::CurrentBootId();
  DS_RETURN_IF_ERROR(SaveState(*st));
  if (result) result->reseeded = true;
  return Status::OK();
}

Status LocalCheckpoint::State::Recover(LocalState* st, PullResult* result) {
  const std::string boot = store_internal::CurrentBootId();
  const bool rebooted = !st->boot_id.empty() && !boot.empty() && st->boot_id != boot;
  Result<std::unique_ptr<Journal>> journal = Journal::OpenIntactPrefix(journal_path, pool);
  if (st->applying) {
    if (rebooted && !st->durable) return Reseed(st, result);
    if (!journal.ok() || (*journal)->version() != *st->applying ||
        (*journal)->from_version() != *st->from_version) {
      // The journal is written before the state says applying: without it
      // the checkpoint may have been touched and nothing can restore it.
      return Reseed(st, result);
    }
    if (st->streamed) {
      // Applied at most the journal's intact records: undo them.
      if (!RollBackJournal(**journal, nullptr, st).ok()) return Reseed(st, result);
      if (result) result->recovered = true;
      return Status::OK();
    }
    // A durable apply says applying only once its journal is complete.
    if (!(*journal)->complete()) return Reseed(st, result);
    if (result) result->recovered = true;
    Status s = ReplayJournal(**journal, st);
    // A replay that failed verification rolled back and committed the old
    // version; the next apply of that version will report why. Anything
    // else leaves the checkpoint unknown.
    if (!s.ok() && !st->version) return Reseed(st, result);
    return Status::OK();
  }
  if (journal.ok() || journal.status().IsCorruption()) {
    // Written before the state said applying (the checkpoint is untouched)
    // or left after a commit.
    journal = Status::NotFound("");
    DS_RETURN_IF_ERROR(io::RemoveFileIfExists(journal_path));
  }
  if (st->version && rebooted && !st->durable) {
    // Data committed without sync may not have reached the disk before the
    // machine went down: check it (the page cache is gone, so what we read
    // is what the disk holds), else rebuild.
    if (!VerifyAll(*st).ok()) return Reseed(st, result);
    st->boot_id = boot;
    st->durable = true;
    DS_RETURN_IF_ERROR(SaveState(*st));
  }
  return Status::OK();
}

Status LocalCheckpoint::State::VerifyAll(const LocalState& st) {
  if (!st.version) {
    std::string why = " (never pulled)";
    if (st.applying) {
      why = ": an apply of version " + FormatVersion(*st.applying) + " onto " +
            FormatVersion(*st.from_version) + " was interrupted; pull to recover it";
    } else if (st.resetting) {
      why = ": a reset to version " + FormatVersion(*st.resetting) +
            " was interrupted; pull to finish it";
    } else if (st.exists) {
      why = " (state.json names none; pull to rebuild it)";
    }
    return Status::FailedPrecondition(options.local + " is not at any version" + why);
  }
  DS_ASSIGN_OR_RETURN(std::unique_ptr<LocalFiles> files, LocalFiles::Open(options.local));
  for (const auto& [name, digest] : st.checksums) {
    if (files->Find(name) == nullptr) {
      return Status::Corruption(options.local + ": tensor '" + name +
                                "' recorded in state.json is missing from the checkpoint");
    }
  }
  std::set<std::string> unrecorded;
  for (const auto& [name, t] : files->tensors()) {
    if (!st.checksums.count(name)) unrecorded.insert(name);
  }
  // Tensors without a recorded checksum equal the checkpoint the last reset
  // copied (`origin`), when we did that reset. A state written by another
  // tool (the Python receiver keeps only "version") names no origin: what
  // those tensors must hold is then rebuilt from the store's chain.
  std::unique_ptr<Checkpoint> origin;
  std::optional<store_internal::ChainExpectation> chain;
  if (!unrecorded.empty() && !st.origin_dir.empty()) {
    Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(st.origin_dir);
    if (!opened.ok()) {
      return Status::FailedPrecondition(options.local + ": cannot verify tensors copied from " +
                                        st.origin_dir + ": " + opened.status().ToString());
    }
    origin = std::move(*opened);
  } else if (!unrecorded.empty()) {
    store_internal::ChainQuery query;
    query.store = options.store;
    query.base = options.base.empty() ? RecordedBase() : options.base;
    query.version = *st.version;
    query.wanted = std::move(unrecorded);
    for (const auto& [name, t] : files->tensors()) query.local_names.insert(name);
    Result<store_internal::ChainExpectation> rebuilt = store_internal::RebuildExpectedState(query);
    if (!rebuilt.ok()) {
      return rebuilt.status().WithContext(
          options.local + ": verifying version " + FormatVersion(*st.version) +
          " against the store's chain (state.json records no checksum for some tensors and " +
          "no origin: written by another tool?)");
    }
    chain = std::move(*rebuilt);
  }

  auto digest_mismatch = [&](const std::string& name, ChecksumAlgo algo, const std::string& actual,
                             const std::string& expected, const std::string& source) {
    return Status::Corruption(options.local + ": tensor '" + name + "' has " +
                              std::string(ChecksumAlgoName(algo)) + " " + actual + ", expected " +
                              expected + " " + source);
  };
  auto check = [&](const std::string& name, const LocalTensor& t) -> Status {
    if (auto it = st.checksums.find(name); it != st.checksums.end()) {
      Result<ParsedDigest> d = ParseTaggedDigest(it->second);
      if (!d.ok())
        return d.status().WithContext(options.local + ": state.json, tensor '" + name + "'");
      const std::string actual = ChecksumHex(d->algo, t.bytes);
      if (actual != d->hex) return digest_mismatch(name, d->algo, actual, d->hex, "(state.json)");
      return Status::OK();
    }
    if (chain) {
      const store_internal::ExpectedTensor& e = chain->tensors.at(name);
      const std::string set_by =
          e.set_by == 0 ? "the base checkpoint " + chain->reference_dir + " (version 000000)"
                        : "version " + FormatVersion(e.set_by) + " of " + options.store;
      if (e.by_digest) {
        const std::string actual = ChecksumHex(e.algo, t.bytes);
        if (actual == e.hex) return Status::OK();
        return digest_mismatch(name, e.algo, actual, e.hex,
                               "as set by " + set_by + ", the last version that changed it");
      }
      if (e.bytes.size() == t.bytes.size() &&
          std::memcmp(e.bytes.data(), t.bytes.data(), t.bytes.size()) == 0) {
        return Status::OK();
      }
      return Status::Corruption(options.local + ": tensor '" + name + "' differs from " + set_by +
                                ", unchanged since then");
    }
    Result<TensorView> source = origin->Get(name);
    if (!source.ok() || source->bytes.size() != t.bytes.size() ||
        std::memcmp(source->bytes.data(), t.bytes.data(), t.bytes.size()) != 0) {
      return Status::Corruption(options.local + ": tensor '" + name + "' differs from " +
                                st.origin_dir + ", which it was copied from");
    }
    return Status::OK();
  };

  // Checked in parallel, largest first (tasks are handed out in order);
  // reported in name order, so the same damage always gives the same message.
  std::vector<std::pair<const std::string*, const LocalTensor*>> work;
  for (const auto& [name, t] : files->tensors()) work.push_back({&name, &t});
  std::vector<size_t> order(work.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return work[a].second->bytes.size() > work[b].second->bytes.size();
  });
  std::vector<Status> outcome(work.size());
  pool->ParallelFor(order.size(), [&](size_t k) {
    const size_t i = order[k];
    outcome[i] = check(*work[i].first, *work[i].second);
  });
  const Status* first = nullptr;
  size_t failures = 0;
  for (const Status& s : outcome) {
    if (s.ok()) continue;
    if (first == nullptr) first = &s;
    ++failures;
  }
  if (first == nullptr) return Status::OK();
  if (failures == 1) return *first;
  return Status(first->code(), first->message() + " (and " + std::to_string(failures - 1) +
                                   " more tensor" + (failures > 2 ? "s" : "") + " fail)");
}

Status LocalCheckpoint::State::Materialize(const std::string& source, int64_t version,
                                           LocalState* st, PullResult* result) {
  // Validate the source before touching anything.
  Result<std::unique_ptr<Checkpoint>> source_checkpoint = Checkpoint::Open(source);
  if (!source_checkpoint.ok()) {
    return source_checkpoint.status().WithContext(
        version == 0 ? "base checkpoint" : "full version " + FormatVersion(version));
  }
  DS_RETURN_IF_ERROR(CheckReplaceable(*st));
  const std::string where = version == 0
                                ? "base checkpoint " + source
                                : "full version " + FormatVersion(version) + " (" + source + ")";
  std::map<std::string, std::string> base_digests;
  if (version == 0) {
    DS_ASSIGN_OR_RETURN(base_digests, CheckBaseAgainstStore(**source_checkpoint, source));
  } else {
    DS_RETURN_IF_ERROR(CheckFullLayout(**source_checkpoint, where, *st));
  }
  DS_ASSIGN_OR_RETURN(std::optional<VersionManifest> manifest,
                      version == 0 ? Result<std::optional<VersionManifest>>(std::nullopt)
                                   : ReadVersionManifest(source));
  // A full version's sidecar records every tensor's digest: the version is
  // checked against it before anything is replaced, as a delta is verified
  // (its pages are then hot for the copy).
  std::map<std::string, std::string> full_digests;
  if (manifest && !manifest->is_delta) {
    for (const auto& [name, t] : manifest->tensors) {
      std::optional<store_internal::ExpectedDigests> strong =
          store_internal::StrongDigestsOf(*manifest, t);
      full_digests[name] = strong ? TaggedDigest(strong->algo, strong->checksum)
                                  : TaggedDigest(manifest->checksum, t.checksum);
    }
    std::vector<const std::pair<const std::string, std::string>*> entries;
    for (const auto& entry : full_digests) entries.push_back(&entry);
    std::vector<Status> outcome(entries.size());
    pool->ParallelFor(entries.size(), [&](size_t i) {
      const auto& [name, tagged] = *entries[i];
      Result<TensorView> t = (*source_checkpoint)->Get(name);
      Result<ParsedDigest> d = ParseTaggedDigest(tagged);
      if (!t.ok() || !d.ok()) {
        outcome[i] = Status::Corruption(where + ": tensor " + QuoteForMessage(name) + " of its " +
                                        kVersionManifestFileName + " is not in its shards");
      } else if (const std::string actual = ChecksumHex(d->algo, t->bytes); actual != d->hex) {
        outcome[i] = Status::Corruption(where + ": tensor " + QuoteForMessage(name) + " has " +
                                        std::string(ChecksumAlgoName(d->algo)) + " " + actual +
                                        ", its " + kVersionManifestFileName + " records " + d->hex +
                                        "; nothing was replaced");
      }
    });
    for (const Status& o : outcome) DS_RETURN_IF_ERROR(o);
  }
  source_checkpoint->reset();
  DS_ASSIGN_OR_RETURN(const std::string resolved_source, io::ResolvedPath(source));
  DS_ASSIGN_OR_RETURN(std::vector<std::string> names, io::ListRegularFiles(source));
  CrashPoint("reset:begin");
  json keep = st->doc;
  *st = LocalState();
  st->doc = std::move(keep);
  st->resetting = version;
  st->boot_id = store_internal::CurrentBootId();
  st->durable = options.durable;
  DS_RETURN_IF_ERROR(SaveState(*st));
  DS_RETURN_IF_ERROR(io::RemoveFileIfExists(journal_path));
  CrashPoint("reset:state");

  std::vector<io::CopyJob> jobs;
  std::set<std::string> copied;
  for (const std::string& name : names) {
    if (name == kVersionManifestFileName) continue;  // ours, about the store
    jobs.push_back({JoinPath(source, name), JoinPath(options.local, name)});
    copied.insert(name);
  }
  DS_ASSIGN_OR_RETURN(uint64_t bytes, io::CopyFiles(jobs, options.durable, pool,
                                                    [] { CrashPoint("copy:written"); }));
  CrashPoint("reset:copied");
  // Weights of the previous layout would confuse a loader (a stale index
  // wins over a new model.safetensors).
  DS_ASSIGN_OR_RETURN(std::vector<std::string> local_names, io::ListRegularFiles(options.local));
  for (const std::string& name : local_names) {
    if (IsWeightsFileName(name) && !copied.count(name)) {
      DS_RETURN_IF_ERROR(io::RemoveFileIfExists(JoinPath(options.local, name)));
    }
  }
  if (options.durable) DS_RETURN_IF_ERROR(io::SyncDirectory(options.local));
  DS_RETURN_IF_ERROR(LocalFiles::Open(options.local).status());

  st->resetting.reset();
  st->version = version;
  st->origin_dir = resolved_source;
  st->origin_version = version;
  for (auto& [name, digest] : full_digests) st->checksums[name] = std::move(digest);
  // What the store says the base holds, checked above: verifying against
  // it catches a base that changed after the copy, which a byte comparison
  // with the base itself never would.
  for (auto& [name, digest] : base_digests) st->checksums[name] = std::move(digest);
  DS_RETURN_IF_ERROR(SaveState(*st));
  CrashPoint("reset:committed");
  if (version == 0) DS_RETURN_IF_ERROR(RecordBase(resolved_source));
  result->reset_to = version;
  result->bytes_read += bytes;
  return Status::OK();
}

Status LocalCheckpoint::State::ApplyVersion(const VersionInfo& info, LocalState* st,
                                            PullResult* result) {
  const std::string where = "version " + FormatVersion(info.version) + " (" + info.dir + ")";
  if (!st->version || *st->version != info.base_version) {
    return Status::FailedPrecondition(where + " applies to version " +
                                      FormatVersion(info.base_version) +
                                      " but the local checkpoint is at " +
                                      (st->version ? FormatVersion(*st->version) : "no version"));
  }
  CrashPoint("apply:begin");
  Result<std::unique_ptr<Checkpoint>> opened = Checkpoint::Open(info.dir);
  if (!opened.ok()) return opened.status().WithContext(where);
  const Checkpoint& version = **opened;
  DS_ASSIGN_OR_RETURN(std::optional<VersionManifest> manifest, ReadVersionManifest(info.dir));
  DS_ASSIGN_OR_RETURN(std::unique_ptr<LocalFiles> local, LocalFiles::Open(options.local));

  // Everything that can be checked without decoding.
  std::vector<ApplyJob> jobs;
  for (const auto& file : version.files()) {
    for (const TensorView& t : file->tensors()) {
      const std::string name = QuoteForMessage(t.name);
      if (t.dtype != DType::kU8 || t.shape.size() != 1) {
        return Status::Corruption(where + ": tensor " + name + " is " +
                                  std::string(DTypeName(t.dtype)) + ShapeToString(t.shape) +
                                  ", not a 1-D U8 delta");
      }
      auto md = file->metadata().find(t.name);
      if (md == file->metadata().end()) {
        return Status::Corruption(where + ": " + file->path() + " records no checksum for tensor " +
                                  name);
      }
      DS_RETURN_IF_ERROR(store_internal::CheckDigestText(md->second, info.checksum,
                                                         where + ": checksum of tensor " + name));
      const LocalTensor* target = local->Find(t.name);
      if (target == nullptr) {
        return Status::FailedPrecondition(where + " changes tensor " + name +
                                          ", which the local checkpoint " + options.local +
                                          " does not have");
      }
      ApplyJob job{t.name, t, target, TaggedDigest(info.checksum, md->second), ""};
      if (manifest) {
        auto m = manifest->tensors.find(t.name);
        if (m == manifest->tensors.end()) {
          return Status::Corruption(where + ": tensor " + name + " is missing from " +
                                    kVersionManifestFileName);
        }
        if (m->second.dtype != target->dtype || m->second.shape != target->shape) {
          return Status::FailedPrecondition(
              where + ": tensor " + name + " is " + std::string(DTypeName(m->second.dtype)) +
              ShapeToString(m->second.shape) + " in the version but " +
              std::string(DTypeName(target->dtype)) + ShapeToString(target->shape) + " locally");
        }
        if (m->second.checksum != md->second) {
          return Status::Corruption(where + ": checksums of tensor " + name + " disagree between " +
                                    file->path() + " and " + kVersionManifestFileName);
        }
        job.base_checksum = TaggedDigest(info.checksum, m->second.base_checksum);
        // A weak checksum_format (adler32) can be matched on purpose: the
        // strong digests the sidecar keeps beside it are what the apply is
        // verified against, and what the state records.
        store_internal::ExpectedDigests expected{info.checksum, m->second.checksum,
                                                 m->second.base_checksum};
        if (auto strong = store_internal::StrongDigestsOf(*manifest, m->second)) {
          expected = std::move(*strong);
          job.checksum = TaggedDigest(expected.algo, expected.checksum);
          job.base_checksum = TaggedDigest(expected.algo, expected.base_checksum);
        }
        auto known = st->checksums.find(t.name);
        if (known != st->checksums.end() && known->second != job.base_checksum) {
          Result<ParsedDigest> k = ParseTaggedDigest(known->second);
          if (k.ok() && k->algo == expected.algo) {
            return Status::FailedPrecondition(
                where + " is based on a different tensor " + name + " than the local checkpoint " +
                "holds (base checksum " + expected.base_checksum + ", local " + k->hex +
                "): wrong base; the store does not continue this checkpoint's history");
          }
        }
      }
      jobs.push_back(std::move(job));
    }
  }
  if (manifest && manifest->tensors.size() != jobs.size()) {
    return Status::Corruption(where + ": " + kVersionManifestFileName + " lists " +
                              std::to_string(manifest->tensors.size()) + " tensors, the shards " +
                              std::to_string(jobs.size()));
  }
  for (const auto& file : version.files()) {
    file->Advise(AccessHint::kWillNeed);
    result->bytes_read += file->file_size();
  }
  // Largest first: tasks are handed out in order, so big tensors must not
  // start last and leave the other threads idle.
  std::stable_sort(jobs.begin(), jobs.end(), [](const ApplyJob& a, const ApplyJob& b) {
    return a.target->bytes.size() > b.target->bytes.size();
  });

  DS_ASSIGN_OR_RETURN(std::unique_ptr<JournalWriter> writer,
                      JournalWriter::Create(journal_path, info.version, info.base_version));
  CrashPoint("journal:created");
  if (!applier) {
    pipeline::ApplierOptions apply;
    apply.pool = pool;
    // Durable: decode only, into the journal; the replay applies it. A
    // tensor's changes go to the journal in records of at most
    // journal_record_changes, so memory does not grow with the tensor.
    apply.mode = options.durable ? pipeline::ApplyMode::kDecodeOnly : pipeline::ApplyMode::kApply;
    apply.run_changes = options.durable
                            ? options.journal_record_changes
                            : std::min(options.journal_record_changes, apply.run_changes);
    applier = std::make_unique<pipeline::Applier>(apply);
  }
  if (!options.durable) {
    return StreamVersion(info, jobs, local.get(), writer.get(), st, result);
  }

  // Durable: decode every tensor into the journal and sync it before the
  // checkpoint is touched (it is only read). The decoder lists (position,
  // old, new) straight from the delta, so memory is the changed elements of
  // the tensors in flight, never a tensor's size.
  std::vector<std::string> whats;
  const std::vector<pipeline::ApplyTensor> tensors =
      ApplyTensorsOf(jobs, info.encoding, where, nullptr, &whats);
  ShardEncodings source(jobs);
  JournalRuns journal_runs(writer.get(), jobs, nullptr);
  std::vector<pipeline::ApplyOutcome> outcomes;
  Status status = applier->Run(tensors, &source, &journal_runs, &outcomes);
  if (status.ok()) status = writer->Finish(options.durable);
  writer.reset();
  if (!status.ok()) {
    (void)io::RemoveFileIfExists(journal_path);
    return status;
  }
  uint64_t changed = 0;
  for (const pipeline::ApplyOutcome& o : outcomes) changed += o.changed_elements;
  CrashPoint("journal:complete");

  // Past this point the checkpoint may change: the state says so.
  st->applying = info.version;
  st->from_version = info.base_version;
  st->streamed = false;
  st->version.reset();
  st->boot_id = store_internal::CurrentBootId();
  st->durable = options.durable;
  DS_RETURN_IF_ERROR(SaveState(*st));
  CrashPoint("state:applying");
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Journal> journal, Journal::Open(journal_path, pool));
  local.reset();
  DS_RETURN_IF_ERROR(ReplayJournal(*journal, st));
  result->tensors_changed += jobs.size();
  result->changed_elements += changed;
  return Status::OK();
}

// Without --durable nothing has to reach the disk before the checkpoint is
// written, so each record is applied as soon as it is journaled, and the
// tensor is hashed right behind its changes: the checkpoint's lines are read
// once, while they are in cache, instead of once to decode and again to
// apply. The records are undo-only (old values, gap-coded positions: half
// the bytes of a durable journal), and the state says "streamed" before the
// first one. Records are appended one at a time and each is applied only
// once written, so recovery rolls back the intact records (at most the last
// can be torn, and it was not applied); the next pull applies the version
// again.
Status LocalCheckpoint::State::StreamVersion(const VersionInfo& info,
                                             const std::vector<ApplyJob>& jobs, LocalFiles* local,
                                             JournalWriter* writer, LocalState* st,
                                             PullResult* result) {
  const std::string where = "applying version " + FormatVersion(info.version);
  st->applying = info.version;
  st->from_version = info.base_version;
  st->version.reset();
  st->streamed = true;
  st->boot_id = store_internal::CurrentBootId();
  st->durable = false;
  DS_RETURN_IF_ERROR(SaveState(*st));
  CrashPoint("state:applying");

  // Each tensor is verified against its digest as it is applied.
  Status status;
  std::vector<ParsedDigest> digests(jobs.size());
  for (size_t j = 0; j < jobs.size() && status.ok(); ++j) {
    Result<ParsedDigest> expected = ParseTaggedDigest(jobs[j].checksum);
    if (expected.ok()) {
      digests[j] = std::move(*expected);
    } else {
      status = expected.status().WithContext(where);
    }
  }
  std::vector<pipeline::ApplyOutcome> outcomes;
  if (status.ok()) {
    std::vector<std::string> whats;
    const std::vector<pipeline::ApplyTensor> tensors =
        ApplyTensorsOf(jobs, info.encoding, where, &digests, &whats);
    ShardEncodings source(jobs);
    JournalRuns journal_runs(writer, jobs, local);
    status = applier->Run(tensors, &source, &journal_runs, &outcomes);
  }
  bool any_mismatch = false;
  uint64_t changed = 0;
  for (const pipeline::ApplyOutcome& o : outcomes) {
    any_mismatch = any_mismatch || o.mismatch;
    changed += o.changed_elements;
  }
  if (status.ok() && !any_mismatch) {
    result->tensors_changed += jobs.size();
    result->changed_elements += changed;
    std::vector<std::pair<std::string_view, std::string_view>> checksums;
    for (const ApplyJob& job : jobs) checksums.emplace_back(job.name, job.checksum);
    return Commit(info.version, checksums, local, st);
  }

  // Roll back what was applied, from the records as written.
  DS_ASSIGN_OR_RETURN(std::unique_ptr<Journal> journal,
                      Journal::OpenIntactPrefix(journal_path, pool));
  DS_RETURN_IF_ERROR(RollBackJournal(*journal, local, st));
  if (!status.ok()) return status.WithContext(where + " (rolled back)");
  std::vector<Mismatch> failed;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (outcomes[j].mismatch) {
      failed.push_back({jobs[j].name, jobs[j].base_checksum, jobs[j].target->bytes});
    }
  }
  return MismatchError(where, failed, *st->version);
}

Result<std::vector<RecordGroup>> LocalCheckpoint::State::GroupRecords(const Journal& journal,
                                                                      const LocalFiles& local,
                                                                      const std::string& where) {
  std::vector<RecordGroup> groups;
  std::unordered_map<std::string_view, size_t> group_of;
  for (const JournalRecord& r : journal.records()) {
    auto [it, added] = group_of.emplace(r.name, groups.size());
    if (added) {
      const LocalTensor* t = local.Find(r.name);
      if (t == nullptr || t->bytes.size() != r.numel * r.elem_size ||
          DTypeSize(t->dtype) != r.elem_size) {
        return Status::FailedPrecondition(where + ": tensor '" + std::string(r.name) +
                                          "' of the journal does not match the local checkpoint");
      }
      groups.push_back({t, {}});
    }
    RecordGroup& g = groups[it->second];
    if (!g.records.empty() &&
        (r.numel != g.records[0]->numel || r.elem_size != g.records[0]->elem_size ||
         r.checksum != g.records[0]->checksum)) {
      return Status::Corruption(where + ": the journal's records of tensor '" +
                                std::string(r.name) + "' disagree on its size or checksum");
    }
    g.records.push_back(&r);
  }
  return groups;
}

Status LocalCheckpoint::State::ReplayJournal(const Journal& journal, LocalState* st) {
  const std::string where = "applying version " + FormatVersion(journal.version());
  DS_ASSIGN_OR_RETURN(std::unique_ptr<LocalFiles> local, LocalFiles::Open(options.local));
  DS_ASSIGN_OR_RETURN(std::vector<RecordGroup> groups, GroupRecords(journal, *local, where));
  std::vector<size_t> order(groups.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return groups[a].target->bytes.size() > groups[b].target->bytes.size();
  });
  FirstError error;
  std::vector<char> mismatch(groups.size(), 0);
  pool->ParallelFor(groups.size(), [&](size_t k) {
    const size_t i = order[k];
    const RecordGroup& g = groups[i];
    const LocalTensor& t = *g.target;
    local->Touch(t);
    Result<ParsedDigest> expected = ParseTaggedDigest(g.records[0]->checksum);
    if (!expected.ok()) {
      error.Note(expected.status());
      return;
    }
    uint64_t count = 0;
    for (const JournalRecord* r : g.records) count += r->count;
    PrefaultForWrite(t.bytes, count);
    // Each piece is hashed right after its changes land, while in cache.
    std::unique_ptr<Hasher> hasher = NewHasher(expected->algo);
    Status s = store_internal::ApplyRecordsAndVisit(
        g.records, t.bytes, /*undo=*/false, kVerifyPieceBytes,
        [&](std::span<const uint8_t> piece) { hasher->Update(piece); });
    if (!s.ok()) {
      error.Note(s);
      return;
    }
    CrashPoint("apply:record");
    if (hasher->HexDigest() != expected->hex) mismatch[i] = 1;
  });
  const bool any_mismatch = std::find(mismatch.begin(), mismatch.end(), 1) != mismatch.end();
  if (!error.failed() && !any_mismatch) {
    std::vector<std::pair<std::string_view, std::string_view>> checksums;
    for (const RecordGroup& g : groups) {
      checksums.emplace_back(g.records[0]->name, g.records[0]->checksum);
    }
    return Commit(journal.version(), checksums, local.get(), st);
  }
  DS_RETURN_IF_ERROR(RollBack(groups, local.get(), st, where));
  if (error.failed()) return error.status().WithContext(where + " (rolled back)");
  std::vector<Mismatch> failed;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (mismatch[i]) {
      const JournalRecord& r = *groups[i].records[0];
      failed.push_back({r.name, r.base_checksum, groups[i].target->bytes});
    }
  }
  return MismatchError(where, failed, *st->version);
}

Status LocalCheckpoint::State::Commit(
    int64_t version, const std::vector<std::pair<std::string_view, std::string_view>>& checksums,
    LocalFiles* local, LocalState* st) {
  CrashPoint("apply:done");
  if (options.durable) DS_RETURN_IF_ERROR(local->SyncTouched());
  CrashPoint("apply:synced");
  st->applying.reset();
  st->from_version.reset();
  st->streamed = false;
  st->version = version;
  for (const auto& [name, checksum] : checksums) {
    st->checksums[std::string(name)] = std::string(checksum);
  }
  st->boot_id = store_internal::CurrentBootId();
  st->durable = options.durable;
  DS_RETURN_IF_ERROR(SaveState(*st));
  CrashPoint("state:committed");
  DS_RETURN_IF_ERROR(io::RemoveFileIfExists(journal_path));
  CrashPoint("journal:removed");
  return Status::OK();
}

Status LocalCheckpoint::State::RollBack(const std::vector<RecordGroup>& groups, LocalFiles* local,
                                        LocalState* st, const std::string& where) {
  FirstError undo_error;
  pool->ParallelFor(groups.size(), [&](size_t i) {
    local->Touch(*groups[i].target);
    undo_error.Note(store_internal::ApplyRecordsAndVisit(groups[i].records, groups[i].target->bytes,
                                                         /*undo=*/true, SIZE_MAX,
                                                         [](std::span<const uint8_t>) {}));
  });
  DS_RETURN_IF_ERROR(undo_error.status().WithContext(where + ": rolling back"));
  CrashPoint("undo:done");
  if (options.durable) DS_RETURN_IF_ERROR(local->SyncTouched());
  st->applying.reset();
  st->streamed = false;
  st->version = st->from_version;
  st->from_version.reset();
  DS_RETURN_IF_ERROR(SaveState(*st));
  return io::RemoveFileIfExists(journal_path);
}

Status LocalCheckpoint::State::RollBackJournal(const Journal& journal, LocalFiles* local,
                                               LocalState* st) {
  const std::string where = "rolling back version " + FormatVersion(journal.version());
  std::unique_ptr<LocalFiles> opened;
  if (local == nullptr) {
    DS_ASSIGN_OR_RETURN(opened, LocalFiles::Open(options.local));
    local = opened.get();
  }
  DS_ASSIGN_OR_RETURN(std::vector<RecordGroup> groups, GroupRecords(journal, *local, where));
  return RollBack(groups, local, st, where);
}

LocalCheckpoint::LocalCheckpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}
LocalCheckpoint::~LocalCheckpoint() = default;

const std::string& LocalCheckpoint::local() const { return state_->options.local; }

Result<std::unique_ptr<LocalCheckpoint>> LocalCheckpoint::Open(
    const LocalCheckpointOptions& options) {
  if (options.local.empty()) return Status::InvalidArgument("no local checkpoint dir given");
  if (options.journal_record_changes == 0) {
    return Status::InvalidArgument("journal_record_changes must be at least 1");
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->pool = options.pool ? options.pool : &ThreadPool::Default();
  state->sync_dir = JoinPath(options.local, kSyncDirName);
  state->state_path = JoinPath(state->sync_dir, kStateFileName);
  state->lock_path = JoinPath(state->sync_dir, kLockFileName);
  state->journal_path = JoinPath(state->sync_dir, store_internal::kJournalFileName);
  state->base_record_path = JoinPath(state->sync_dir, kBaseRecordFileName);
  DS_RETURN_IF_ERROR(CheckSeparatePaths(options));
  // A directory that is not a store is refused here, before anything reads
  // or writes the checkpoint; one that does not exist (yet: an agent may
  // start before the trainer publishes) is the pull's to report.
  if (!options.store.empty() && io::IsDirectory(options.store)) {
    Result<std::vector<int64_t>> listed = ListVersionNumbers(options.store);
    if (listed.status().code() == StatusCode::kInvalidArgument) return listed.status();
  }
  // Nothing is created here: only a pull writes, so that opening a
  // checkpoint to read or verify it leaves no trace.
  if (options.recover_on_open && io::IsDirectory(state->sync_dir)) {
    DS_ASSIGN_OR_RETURN(io::FileLock lock, io::FileLock::Acquire(state->lock_path));
    DS_ASSIGN_OR_RETURN(LocalState st, state->LoadState());
    PullResult recovery;
    DS_RETURN_IF_ERROR(state->Recover(&st, &recovery));
    state->recovered_on_open = recovery.recovered;
    state->reseeded_on_open = recovery.reseeded;
  }
  return std::unique_ptr<LocalCheckpoint>(new LocalCheckpoint(std::move(state)));
}

Result<std::optional<int64_t>> LocalCheckpoint::CurrentVersion() {
  DS_ASSIGN_OR_RETURN(io::FileLock lock, io::FileLock::AcquireSharedIfExists(state_->lock_path));
  DS_ASSIGN_OR_RETURN(LocalState st, state_->LoadState());
  return st.version;
}

Status LocalCheckpoint::Verify() {
  if (!io::IsDirectory(state_->options.local)) {
    return Status::NotFound("local checkpoint " + state_->options.local + " does not exist");
  }
  DS_ASSIGN_OR_RETURN(io::FileLock lock, io::FileLock::AcquireSharedIfExists(state_->lock_path));
  DS_ASSIGN_OR_RETURN(LocalState st, state_->LoadState());
  return state_->VerifyAll(st);
}

Result<PullResult> LocalCheckpoint::Pull(std::optional<int64_t> target) {
  const auto t0 = std::chrono::steady_clock::now();
  State& s = *state_;
  const LocalCheckpointOptions& opt = s.options;
  if (target && *target < 0) {
    return Status::InvalidArgument("pull: target version " + std::to_string(*target) +
                                   " is negative");
  }
  if (!opt.pre_read_hook.empty()) {
    DS_RETURN_IF_ERROR(io::RunHook(opt.pre_read_hook,
                                   {opt.store, target ? FormatVersion(*target) : "latest"},
                                   "pre-read hook"));
  }
  if (!opt.store.empty()) {
    if (!io::IsDirectory(opt.store)) {
      return Status::NotFound("store " + opt.store + " does not exist" +
                              (io::PathExists(opt.store) ? " as a directory" : ""));
    }
    // Whatever the target: a directory that is not a store is a mistyped
    // store, refused before anything is created.
    DS_RETURN_IF_ERROR(ListVersionNumbers(opt.store).status());
  }
  // No receiver has been here (each makes .weight_sync first): weights in
  // `local` are a checkpoint that no pull made, which the reset this pull
  // needs must not replace. Refused before anything is created beside them.
  if (!opt.replace_unknown_checkpoint && !io::PathExists(s.sync_dir)) {
    DS_RETURN_IF_ERROR(s.RefuseToReplaceWeights());
  }
  DS_RETURN_IF_ERROR(io::CreateDirectories(s.sync_dir));
  DS_ASSIGN_OR_RETURN(io::FileLock lock, io::FileLock::Acquire(s.lock_path));
  // Under the lock no writer of ours is running here: what one left behind
  // (a killed reset's copy, a state file's temporary) is garbage.
  DS_RETURN_IF_ERROR(io::RemoveLeftoverTemporaries(opt.local).status());
  DS_RETURN_IF_ERROR(io::RemoveLeftoverTemporaries(s.sync_dir).status());
  DS_ASSIGN_OR_RETURN(LocalState st, s.LoadState());
  PullResult result;
  result.recovered = std::exchange(s.recovered_on_open, false);
  result.reseeded = std::exchange(s.reseeded_on_open, false);
  DS_RETURN_IF_ERROR(s.Recover(&st, &result));
  result.from_version = st.version;

  int64_t goal = 0;
  if (target) {
    goal = *target;
  } else if (!opt.store.empty()) {
    DS_ASSIGN_OR_RETURN(std::vector<int64_t> versions, ListVersionNumbers(opt.store));
    if (!versions.empty()) goal = versions.back();
  }
  result.version = goal;
  // A copy of another base (a wrong --base earlier, which the store could
  // not check) counts as nothing applied: the base given now is copied
  // instead of keeping what failed.
  s.ForgetACopyOfAnotherBase(&st);
  const std::optional<int64_t> current = st.version;
  if (current && *current == goal) {
    DS_RETURN_IF_ERROR(s.CheckGivenBase(/*copies_base=*/false));
    DS_RETURN_IF_ERROR(s.RecordVouchedBase());
    result.seconds = SecondsSince(t0);
    return result;
  }
  if (goal > 0 && opt.store.empty()) {
    return Status::InvalidArgument("pull: version " + FormatVersion(goal) +
                                   " requested but no store given");
  }

  // Plan: walk down from the goal to the newest full version, or to the
  // applied version, reading only version metadata.
  const bool reset_needed = !current || goal < *current;
  const int64_t floor = reset_needed ? 0 : *current;
  std::map<int64_t, VersionInfo> deltas;
  std::optional<int64_t> reset_to;
  std::string reset_dir;
  for (int64_t v = goal; v > floor; --v) {
    Result<VersionInfo> info = ReadVersionInfo(store_internal::VersionDir(opt.store, v));
    if (!info.ok()) {
      if (info.status().IsNotFound()) {
        return Status::NotFound("version " + FormatVersion(v) + " is missing from store " +
                                opt.store + " (needed to go from " +
                                (current ? FormatVersion(*current) : std::string("nothing")) +
                                " to " + FormatVersion(goal) + ")");
      }
      return info.status();
    }
    if (!info->is_delta) {
      reset_to = v;
      reset_dir = info->dir;
      break;
    }
    deltas.emplace(v, std::move(*info));
  }
  if (reset_needed && !reset_to) {
    if (opt.base.empty()) {
      return Status::InvalidArgument("pull: the base checkpoint (version 0) is needed to reach " +
                                     FormatVersion(goal) + " but none was given");
    }
    reset_to = 0;
    reset_dir = opt.base;
  }
  const int64_t start = reset_to ? *reset_to : *current;
  for (const auto& [v, info] : deltas) {
    if (v <= start) continue;
    if (info.base_version != v - 1) {
      return Status::FailedPrecondition("version " + FormatVersion(v) + " applies to version " +
                                        FormatVersion(info.base_version) + ", not " +
                                        FormatVersion(v - 1) + ": out-of-order chain in " +
                                        opt.store);
    }
  }

  DS_RETURN_IF_ERROR(s.CheckGivenBase(/*copies_base=*/reset_to == 0));
  if (reset_to) {
    DS_RETURN_IF_ERROR(s.Materialize(reset_dir, *reset_to, &st, &result));
  }
  for (const auto& [v, info] : deltas) {
    if (v <= start) continue;
    DS_RETURN_IF_ERROR(s.ApplyVersion(info, &st, &result));
    result.versions_applied.push_back(v);
  }
  DS_RETURN_IF_ERROR(s.RecordVouchedBase());
  result.applied = true;
  result.seconds = SecondsSince(t0);
  return result;
}

}  // namespace deltasync
