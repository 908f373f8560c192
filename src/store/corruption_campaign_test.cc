// Corruption campaign: random damage to one file of a store, then a pull
// from a local checkpoint at an earlier version. Whatever the damage, the
// pull either fails and leaves the checkpoint at a version it committed
// (untouched, file for file, when that is the version it started from), or
// succeeds with the target's exact weights; and once the store is repaired,
// a pull reaches the target exactly. The one exception is documented: a
// reset copies a full version without reading its tensors, so damage to
// them is copied (Verify must then find it where a sidecar records their
// checksums).
//
// The store is a chain of every encoding and a full version, published by
// the library, in two variants: with our sidecars and without any (as the
// Python publisher writes a store). Random trials damage a file in one of
// many ways; a sweep makes every kind of edit at every node of one delta's
// index. Each trial is a pure function of its seed (or sweep position), and
// every failure names it and the damage. Environment:
//   DELTASYNC_CORRUPTION_TRIALS  trials per variant (default 64)
//   DELTASYNC_CORRUPTION_SEED    first seed (default 1); with TRIALS=1 it
//                                replays one trial
// scripts/corrupt-campaign runs a long campaign.

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "deltasync/checkpoint.h"
#include "deltasync/store.h"
#include "io/file.h"
#include "store/store_test_util.h"

namespace deltasync::store_test {
namespace {

using nlohmann::json;

// Version v + 1 of the chain: an encoding, or nullopt for a full version.
const std::vector<std::optional<Encoding>> kChain = {
    Encoding::kXor,   Encoding::kOverwrite, Encoding::kSparse, Encoding::kIndices,
    Encoding::kDense, std::nullopt,         Encoding::kXor,    Encoding::kSparse};
const int64_t kLatest = static_cast<int64_t>(kChain.size());

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::strtoull(value, nullptr, 10) : fallback;
}

bool IsFull(int64_t v) { return v >= 1 && v <= kLatest && !kChain[v - 1].has_value(); }

// How the checkpoint at `dir` differs from `model` (tensor names, dtypes,
// shapes, bytes; HoldsModel compares bytes only), or "" when it does not.
std::string Mismatch(const std::string& dir, const Model& model) {
  Result<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir);
  if (!c.ok()) return "does not open: " + c.status().ToString();
  if ((*c)->tensors().size() != model.size()) {
    return "holds " + std::to_string((*c)->tensors().size()) + " tensors, not " +
           std::to_string(model.size());
  }
  for (const OwnedTensor& t : model) {
    Result<TensorView> v = (*c)->Get(t.name);
    if (!v.ok()) return "lacks " + t.name;
    if (v->dtype != t.dtype || v->shape != t.shape) return t.name + " has another dtype or shape";
    if (!std::equal(v->bytes.begin(), v->bytes.end(), t.data.begin(), t.data.end())) {
      return t.name + " has other bytes";
    }
  }
  return "";
}

// Every JSON pointer into `doc`, the root included, in document order.
void CollectPointers(const json& doc, const json::json_pointer& at,
                     std::vector<json::json_pointer>* out) {
  out->push_back(at);
  if (doc.is_object()) {
    for (auto it = doc.begin(); it != doc.end(); ++it) CollectPointers(*it, at / it.key(), out);
  } else if (doc.is_array()) {
    for (size_t i = 0; i < doc.size(); ++i) CollectPointers(doc[i], at / i, out);
  }
}

size_t CountNodes(const json& doc) {
  std::vector<json::json_pointer> pointers;
  CollectPointers(doc, json::json_pointer(), &pointers);
  return pointers.size();
}

// An edit chosen in advance: the node (in CollectPointers order) and the
// kind (EditJson's cases).
struct JsonEdit {
  size_t node = 0;
  uint64_t kind = 0;
};
constexpr uint64_t kJsonEditKinds = 6;

// One edit of a JSON document at a node, `edit`'s or a random one: drop it,
// make it null, {} or [], give it another type, or change its number or
// string. Returns its description; *op names the kind of edit.
std::string EditJson(json* doc, std::mt19937_64& rng, std::string* op,
                     std::optional<JsonEdit> edit = std::nullopt) {
  std::vector<json::json_pointer> pointers;
  CollectPointers(*doc, json::json_pointer(), &pointers);
  if (!edit) edit = JsonEdit{static_cast<size_t>(rng() % pointers.size()), rng() % 7};
  const json::json_pointer at = pointers[edit->node % pointers.size()];
  json& node = (*doc)[at];
  const std::string where = at.to_string().empty() ? "(root)" : at.to_string();
  static const char* const kOps[] = {"drop", "null", "{}", "[]", "retype", "change", "change"};
  *op = kOps[edit->kind % 7];
  switch (edit->kind % 7) {
    case 0:
      if (!at.empty()) {
        json& parent = (*doc)[at.parent_pointer()];
        if (parent.is_object()) {
          parent.erase(at.back());
        } else {
          parent.erase(static_cast<size_t>(std::stoul(at.back())));
        }
        return where + " dropped";
      }
      node = json::object();
      return where + " = {}";
    case 1: node = nullptr; return where + " = null";
    case 2: node = json::object(); return where + " = {}";
    case 3: node = json::array(); return where + " = []";
    case 4:
      if (node.is_string()) {
        node = 7;
      } else if (node.is_number()) {
        node = node.dump();
      } else if (node.is_boolean()) {
        node = "true";
      } else if (node.is_object()) {
        node = "x";
      } else {
        node = 0;
      }
      return where + " given another type: " + node.dump();
    default: {
      if (node.is_number_integer() || node.is_number_unsigned()) {
        const int64_t v = node.get<int64_t>();
        const int64_t choices[] = {v + 1, v - 1, 0, -v, v * 2 + 1, int64_t{1} << 40};
        node = choices[rng() % 6];
      } else if (node.is_number()) {
        node = node.get<double>() * 2 + 0.5;
      } else if (node.is_string() && !node.get<std::string>().empty()) {
        std::string s = node.get<std::string>();
        const size_t i = rng() % s.size();
        const char c = s[i];
        s[i] = c >= '0' && c <= '8' ? static_cast<char>(c + 1) : c == '9' ? '0' : 'a';
        if (s[i] == c) s[i] = 'b';
        if (rng() % 4 == 0) s += s.back();
        node = s;
      } else {
        node = "1";
      }
      return where + " changed to " + node.dump();
    }
  }
}

// The safetensors file at `path` with its header JSON edited (the data
// buffer kept as it is).
std::optional<std::string> EditSafetensorsHeader(const std::string& bytes, std::mt19937_64& rng,
                                                 std::string* what, std::string* op) {
  if (bytes.size() < 8) return std::nullopt;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > bytes.size() - 8) return std::nullopt;
  json header = json::parse(bytes.substr(8, n), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return std::nullopt;
  *what = "header " + EditJson(&header, rng, op);
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(text.size() >> (8 * i));
  return out + text + bytes.substr(8 + n);
}

struct Outcome {
  bool refused = false;
  // The checkpoint copied a damaged full version, which the pull does not
  // check (and Verify, with a sidecar, found).
  bool copied_damage = false;
  std::string kind;     // of the damage: flip, set, truncate, edit, ...
  std::string failure;  // empty: the trial passed
};

class Campaign {
 public:
  explicit Campaign(bool sidecars) : sidecars_(sidecars) {}

  void Build() {
    // One publishing thread: shard layouts, and so the files a seed picks,
    // do not depend on timing.
    ThreadPool publish_pool(1);
    models_.push_back(MakeModel(1, 16));
    WriteModel(base_, models_[0]);
    for (int64_t v = 1; v <= kLatest; ++v) {
      models_.push_back(Step(models_.back(), 500 + static_cast<uint64_t>(v), 0.05));
      PublisherOptions o;
      o.store = store_;
      o.encoding = kChain[v - 1].value_or(Encoding::kSparse);
      o.full_max_shard_bytes = 8 << 10;  // a sharded full version
      o.pool = &publish_pool;
      Result<PublishResult> r = PublishOnce(o, Views(models_[v - 1]), Views(models_[v]),
                                            /*full=*/!kChain[v - 1].has_value());
      DS_ASSERT_OK(r);
      if (!sidecars_) {
        ASSERT_EQ(::unlink((VersionDir(v) + "/" + kVersionManifestFileName).c_str()), 0);
      }
    }
    CopyTree(store_, pristine_store_);
    for (int64_t v = 0; v < kLatest; ++v) {
      RemoveDir(local_);
      {
        Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(LocalOpts(false));
        DS_ASSERT_OK(l);
        DS_ASSERT_OK((*l)->Pull(v));
        ASSERT_EQ(Mismatch(local_, models_[v]), "");
      }
      CopyTree(local_, PristineLocal(v));
      local_files_.push_back(LocalFiles(local_));
    }
  }

  // A random trial: damage drawn from `seed`.
  Outcome Run(uint64_t seed) {
    std::mt19937_64 rng(seed * 2 + (sidecars_ ? 1 : 0));
    const int64_t from = static_cast<int64_t>(rng() % kLatest);
    const int64_t target =
        rng() % 2 ? from + 1 : from + 1 + static_cast<int64_t>(rng() % (kLatest - from));
    const bool durable = rng() % 2;
    // Mostly a version the pull reads.
    const int64_t victim = rng() % 8 != 0 ? from + 1 + static_cast<int64_t>(rng() % (target - from))
                                          : 1 + static_cast<int64_t>(rng() % kLatest);
    return Run("seed=" + std::to_string(seed), from, target, durable, victim, std::nullopt, rng);
  }

  // Nodes of version `v`'s index, for EditIndex.
  size_t IndexNodes(int64_t v) const {
    return CountNodes(
        json::parse(ReadFile(pristine_store_ + "/" + VersionDirName(v) + "/" + kIndexFileName)));
  }
  // A trial that makes `edit` to version v's index and pulls it from v - 1.
  Outcome EditIndex(int64_t v, JsonEdit edit) {
    std::mt19937_64 rng(edit.node * kJsonEditKinds + edit.kind);
    return Run("sweep node=" + std::to_string(edit.node) + " kind=" + std::to_string(edit.kind),
               v - 1, v, /*durable=*/false, v, edit, rng);
  }

 private:
  // One trial: restore, damage one file of `victim` (with `index_edit`,
  // that edit to its index), pull, judge.
  Outcome Run(const std::string& name, int64_t from, int64_t target, bool durable, int64_t victim,
              std::optional<JsonEdit> index_edit, std::mt19937_64& rng) {
    CopyTree(pristine_store_, store_);
    CopyTree(PristineLocal(from), local_);
    Damage(victim, rng, index_edit);

    Outcome out;
    out.kind = kind_;
    std::string what = name + (sidecars_ ? " sidecars" : " no-sidecars") +
                       " from=" + std::to_string(from) + " target=" + std::to_string(target) +
                       (durable ? " durable" : "") + " damage: " + damage_;
    auto fail = [&](const std::string& problem) {
      if (out.failure.empty()) out.failure = what + ": " + problem;
    };
    Result<std::unique_ptr<LocalCheckpoint>> l = LocalCheckpoint::Open(LocalOpts(durable));
    if (!l.ok()) {
      fail("open: " + l.status().ToString());
      return out;
    }
    Result<PullResult> pulled = (*l)->Pull(target);
    out.refused = !pulled.ok();
    if (!pulled.ok()) what += " (refused: " + pulled.status().ToString() + ")";
    Result<std::optional<int64_t>> now = (*l)->CurrentVersion();
    if (!now.ok() || !now->has_value()) {
      fail("the checkpoint is at no version afterwards");
      return out;
    }
    const int64_t at = **now;
    if (io::PathExists(local_ + "/.weight_sync/journal")) fail("a journal was left");
    // A reset copies a full version without reading its tensors (docs/format.md,
    // "Pulling"): damage to one is not the pull's to find. Verify, with the
    // sidecar's checksums, must find it; without a sidecar nothing records them.
    const bool copied_damage = !sidecars_ && IsFull(victim) && from < victim && victim <= at;
    std::string wrong;
    if (pulled.ok()) {
      if (pulled->version != target || at != target) fail("a pull reported another version");
      wrong = Mismatch(local_, models_[target]);
    } else if (at < from || at >= target) {
      fail("a failed pull left version " + std::to_string(at));
    } else {
      wrong = Mismatch(local_, models_[at]);
      if (wrong.empty() && at == from && LocalFiles(local_) != local_files_[from]) {
        fail("a failed pull changed the files of version " + std::to_string(from));
      }
    }
    if (!wrong.empty()) {
      out.copied_damage = copied_damage;
      if (!copied_damage) {
        fail("version " + std::to_string(pulled.ok() ? target : at) + " is wrong: " + wrong);
      } else if (sidecars_ && (*l)->Verify().ok()) {
        fail("Verify passes a checkpoint that copied a damaged full version: " + wrong);
      }
      return out;
    }
    // The damage must not outlive the store's repair.
    CopyTree(pristine_store_, store_);
    Result<PullResult> again = (*l)->Pull(target);
    if (!again.ok()) {
      fail("after the store is repaired the pull fails: " + again.status().ToString());
    } else if (std::string w = Mismatch(local_, models_[target]); !w.empty()) {
      fail("after the store is repaired the pull gives a wrong version: " + w);
    }
    return out;
  }

  std::string VersionDir(int64_t v) const { return store_ + "/" + VersionDirName(v); }
  std::string PristineLocal(int64_t v) const { return tmp_.Join("local-" + std::to_string(v)); }

  LocalCheckpointOptions LocalOpts(bool durable) {
    LocalCheckpointOptions o;
    o.local = local_;
    o.store = store_;
    o.base = base_;
    o.durable = durable;
    o.pool = &pool_;
    return o;
  }

  static void CopyTree(const std::string& from, const std::string& to) {
    RemoveDir(to);
    std::error_code ec;
    std::filesystem::copy(from, to, std::filesystem::copy_options::recursive, ec);
    ASSERT_FALSE(ec) << "copy " << from << " to " << to << ": " << ec.message();
  }

  // Damages one file of version `v` (or removes the version), describing
  // the damage in damage_. With `index_edit`, makes that edit to its index.
  void Damage(int64_t v, std::mt19937_64& rng, std::optional<JsonEdit> index_edit) {
    const std::string dir = VersionDir(v);
    std::vector<std::string> files = ListDir(dir);
    const std::string name = VersionDirName(v) + "/";
    if (index_edit) {
      std::string op;
      json doc = json::parse(ReadFile(dir + "/" + kIndexFileName));
      damage_ = name + kIndexFileName + " edit " + EditJson(&doc, rng, &op, index_edit);
      kind_ = "json-" + op;
      WriteFile(dir + "/" + kIndexFileName, doc.dump(2));
      return;
    }
    if (rng() % 40 == 0 || files.empty()) {
      RemoveDir(dir);
      kind_ = "remove-version";
      damage_ = "removed " + VersionDirName(v);
      return;
    }
    const std::string file = files[rng() % files.size()];
    const std::string path = dir + "/" + file;
    std::string bytes = ReadFile(path);
    const bool is_json = file.ends_with(".json");
    const bool is_shard = file.ends_with(".safetensors");
    std::string what, op;
    kind_.clear();
    const uint64_t kind = rng() % 8;
    if (is_json && kind < 4) {
      json doc = json::parse(bytes, nullptr, /*allow_exceptions=*/false);
      if (!doc.is_discarded()) {
        what = "edit " + EditJson(&doc, rng, &op);
        bytes = doc.dump(2);
        kind_ = "json-" + op;
      }
    } else if (is_shard && kind < 2) {
      if (std::optional<std::string> edited = EditSafetensorsHeader(bytes, rng, &what, &op)) {
        bytes = *edited;
        kind_ = "header-" + op;
      }
    }
    if (what.empty()) {
      switch (rng() % 6) {
        case 0:
        case 1: {
          const int flips = 1 + static_cast<int>(rng() % 3);
          what = "flip";
          for (int i = 0; i < flips && !bytes.empty(); ++i) {
            const size_t at = rng() % bytes.size();
            const uint8_t mask = static_cast<uint8_t>(1 + rng() % 255);
            bytes[at] = static_cast<char>(bytes[at] ^ mask);
            what += " @" + std::to_string(at) + "^" + std::to_string(mask);
          }
          break;
        }
        case 2: {
          if (bytes.empty()) break;
          const size_t at = rng() % bytes.size();
          const size_t n = std::min<size_t>(1 + rng() % 16, bytes.size() - at);
          const char values[] = {'\0', '\xff', static_cast<char>(rng())};
          const char value = values[rng() % 3];
          bytes.replace(at, n, n, value);
          what = "set " + std::to_string(n) + " bytes @" + std::to_string(at) + " to " +
                 std::to_string(static_cast<uint8_t>(value));
          break;
        }
        case 3: {
          const size_t n = bytes.empty() ? 0 : rng() % bytes.size();
          what = "truncate to " + std::to_string(n) + " of " + std::to_string(bytes.size());
          bytes.resize(n);
          break;
        }
        case 4: {
          const size_t n = 1 + rng() % 64;
          for (size_t i = 0; i < n; ++i) bytes.push_back(static_cast<char>(rng()));
          what = "append " + std::to_string(n) + " bytes";
          break;
        }
        default:
          kind_ = "remove-file";
          damage_ = "removed " + name + file;
          EXPECT_EQ(::unlink(path.c_str()), 0);
          return;
      }
    }
    if (what.empty()) what = "none (empty file)";
    if (kind_.empty()) kind_ = what.substr(0, what.find(' '));
    damage_ = name + file + " " + what;
    WriteFile(path, bytes);
  }

  bool sidecars_;
  TempDir tmp_;
  ThreadPool pool_{2};
  std::string base_ = tmp_.Join("base");
  std::string store_ = tmp_.Join("store");
  std::string pristine_store_ = tmp_.Join("pristine-store");
  std::string local_ = tmp_.Join("local");
  std::vector<Model> models_;  // models_[v]: the weights of version v
  std::vector<std::map<std::string, std::string>> local_files_;  // of the pristine locals
  std::string damage_;
  std::string kind_;
};

// Outcomes by kind of damage: trials, then those that passed refused or
// with copied damage, then those that failed (each reported as it comes).
class Tally {
 public:
  void Add(const Outcome& out) {
    std::array<uint64_t, 4>& c = counts_[out.kind];
    ++c[0];
    if (!out.failure.empty()) {
      ++c[3];
      ADD_FAILURE() << out.failure;
    } else if (out.copied_damage) {
      ++c[2];
    } else if (out.refused) {
      ++c[1];
    }
  }
  void Print(const std::string& title) const {
    std::printf("corruption campaign, %s:\n", title.c_str());
    std::printf("  %-16s %7s %7s %7s %7s %7s\n", "damage", "trials", "refused", "exact", "copied",
                "failed");
    std::array<uint64_t, 4> total{};
    for (const auto& [name, c] : counts_) {
      Row(name, c);
      for (size_t i = 0; i < 4; ++i) total[i] += c[i];
    }
    Row("all", total);
  }

 private:
  static void Row(const std::string& name, const std::array<uint64_t, 4>& c) {
    std::printf("  %-16s %7llu %7llu %7llu %7llu %7llu\n", name.c_str(),
                static_cast<unsigned long long>(c[0]), static_cast<unsigned long long>(c[1]),
                static_cast<unsigned long long>(c[0] - c[1] - c[2] - c[3]),
                static_cast<unsigned long long>(c[2]), static_cast<unsigned long long>(c[3]));
  }
  std::map<std::string, std::array<uint64_t, 4>> counts_;
};

std::string VariantName(bool sidecars) { return sidecars ? "sidecars" : "no sidecars"; }

class CorruptionCampaign : public ::testing::TestWithParam<bool> {};

TEST_P(CorruptionCampaign, EveryPullFailsCleanlyOrIsExact) {
  Campaign campaign(GetParam());
  ASSERT_NO_FATAL_FAILURE(campaign.Build());
  const uint64_t trials = EnvOr("DELTASYNC_CORRUPTION_TRIALS", 64);
  const uint64_t first = EnvOr("DELTASYNC_CORRUPTION_SEED", 1);
  Tally tally;
  for (uint64_t seed = first; seed < first + trials; ++seed) tally.Add(campaign.Run(seed));
  tally.Print(VariantName(GetParam()) + ", seeds " + std::to_string(first) + ".." +
              std::to_string(first + trials - 1));
}

// Every kind of edit at every node of a delta's index (random trials reach
// the few keys that decide what a version is only now and then).
TEST_P(CorruptionCampaign, EveryEditOfADeltaIndex) {
  Campaign campaign(GetParam());
  ASSERT_NO_FATAL_FAILURE(campaign.Build());
  constexpr int64_t kVersion = 3;
  ASSERT_FALSE(IsFull(kVersion));
  Tally tally;
  const size_t nodes = campaign.IndexNodes(kVersion);
  for (size_t node = 0; node < nodes; ++node) {
    for (uint64_t kind = 0; kind < kJsonEditKinds; ++kind) {
      tally.Add(campaign.EditIndex(kVersion, {node, kind}));
    }
  }
  tally.Print(VariantName(GetParam()) + ", every edit of version " + std::to_string(kVersion) +
              "'s index");
}

INSTANTIATE_TEST_SUITE_P(Stores, CorruptionCampaign, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "WithSidecars" : "WithoutSidecars";
                         });

}  // namespace
}  // namespace deltasync::store_test
