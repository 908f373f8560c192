#include "bench_sharded.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "child_process.h"
#include "cli_util.h"
#include "deltasync/communicator.h"
#include "deltasync/shard.h"
#include "deltasync/stream.h"
#include "deltasync/synth.h"
#include "deltasync/timing.h"

namespace deltasync::cli {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Mib(uint64_t b) { return static_cast<double>(b) / (1u << 20); }
double Gib(uint64_t b) { return static_cast<double>(b) / (1u << 30); }

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element `i` of tensor `t` (flat, in the whole tensor) before the step, as
// BF16 bits with no infinity or NaN; the step changes one element in 60
// (1.7%, about what a step at lr 1e-6 changes) by its last bit.
uint16_t Before(uint64_t t, uint64_t i) {
  return static_cast<uint16_t>((Mix((t << 40) + i) >> 16) & 0x7f7f);
}
uint16_t After(uint64_t t, uint64_t i) {
  const uint16_t v = Before(t, i);
  return Mix(~((t << 40) + i)) % 60 == 0 ? static_cast<uint16_t>(v ^ 1) : v;
}

CommunicatorOptions Loopback(const std::string& rendezvous, const std::string& group, int rank,
                             int size, std::chrono::milliseconds timeout) {
  CommunicatorOptions o;
  Result<Rendezvous> where = ParseRendezvous(rendezvous);
  if (where.ok()) o.rendezvous = *where;
  o.group = group;
  o.rank = rank;
  o.size = size;
  o.timeout = timeout;
  o.connect_timeout = std::chrono::milliseconds(60000);
  o.hostname = "127.0.0.1";
  return o;
}

struct RankReport {
  int rank = 0;
  uint64_t shard_bytes = 0;
  // Peak resident beyond the shards and the snapshot, in the seed and in
  // the delta.
  uint64_t seed_beyond = 0, delta_beyond = 0;
  double seed_s = 0, delta_s = 0;
};

struct Row {
  uint64_t model_bytes = 0;
  int ranks = 0;
  std::vector<RankReport> reports;  // by rank
};

Result<Row> RunOne(const ShardedBenchConfig& c, const std::string& dir, uint64_t size, int ranks) {
  DS_ASSIGN_OR_RETURN(double scale, SynthScaleForBytes(c.preset, size));
  DS_ASSIGN_OR_RETURN(std::vector<SynthTensorSpec> specs, SynthPresetSpecs(c.preset, scale));
  Row row;
  row.ranks = ranks;
  for (const SynthTensorSpec& s : specs) {
    uint64_t n = 2;
    for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
    row.model_bytes += n;
  }
  const std::string run = dir + "/" + std::to_string(size) + "-" + std::to_string(ranks);
  std::error_code ec;
  std::filesystem::create_directories(run, ec);
  const std::string stream = "file:" + run + "/stream";
  const std::string trainers = "file:" + run + "/trainers";
  std::ostringstream scale_text;
  scale_text.precision(17);
  scale_text << scale;
  std::vector<std::unique_ptr<Child>> children;
  auto receiver = std::make_unique<Child>();
  DS_RETURN_IF_ERROR(receiver->Start({SelfPath(),     "bench-stream-peer",
                                      "--rendezvous", stream,
                                      "--group",      "stream",
                                      "--rank",       "1",
                                      "--size",       "2",
                                      "--hostname",   "127.0.0.1",
                                      "--preset",     c.preset,
                                      "--scale",      scale_text.str(),
                                      "--mode",       "stream",
                                      "--syncs",      "2",
                                      "--timeout-ms", std::to_string(c.timeout.count())},
                                     run + "/receiver"));
  for (int r = 0; r < ranks; ++r) {
    auto child = std::make_unique<Child>();
    DS_RETURN_IF_ERROR(child->Start(
        {SelfPath(), "bench-sharded-trainer", "--stream", stream, "--trainers", trainers, "--rank",
         std::to_string(r), "--ranks", std::to_string(ranks), "--preset", c.preset, "--scale",
         scale_text.str(), "--bucket", std::to_string(c.bucket_bytes), "--timeout-ms",
         std::to_string(c.timeout.count())},
        run + "/trainer-" + std::to_string(r)));
    children.push_back(std::move(child));
  }
  for (int r = 0; r < ranks; ++r) {
    DS_ASSIGN_OR_RETURN(json j, children[r]->Wait());
    RankReport rep;
    rep.rank = r;
    rep.shard_bytes = j["shard_bytes"].get<uint64_t>();
    rep.seed_beyond = j["seed_beyond_bytes"].get<uint64_t>();
    rep.delta_beyond = j["delta_beyond_bytes"].get<uint64_t>();
    rep.seed_s = j["seed_s"].get<double>();
    rep.delta_s = j["delta_s"].get<double>();
    row.reports.push_back(rep);
  }
  DS_RETURN_IF_ERROR(receiver->Wait().status());
  return row;
}

}  // namespace

int RunShardedBench(const ShardedBenchConfig& config, bool json_out) {
  std::string tmpl = "/tmp/deltasync-bench-sharded-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return Fail("cannot make a temp dir under /tmp");
  ScratchDir scratch{tmpl, true};
  std::vector<Row> rows;
  for (int ranks : config.ranks) {
    for (uint64_t size : config.sizes) {
      Result<Row> row = RunOne(config, scratch.path, size, ranks);
      if (!row.ok()) {
        return Fail(row.status().WithContext(std::to_string(ranks) + " trainer ranks, " +
                                             FormatBytes(size)));
      }
      rows.push_back(std::move(*row));
    }
  }
  if (json_out) {
    json out = {{"mode", "stream-sharded"},
                {"preset", config.preset},
                {"bucket_bytes", config.bucket_bytes},
                {"rows", json::array()}};
    for (const Row& r : rows) {
      json ranks = json::array();
      for (const RankReport& p : r.reports) {
        ranks.push_back({{"rank", p.rank},
                         {"shard_bytes", p.shard_bytes},
                         {"seed_beyond_shards_and_snapshot_bytes", p.seed_beyond},
                         {"delta_beyond_shards_and_snapshot_bytes", p.delta_beyond},
                         {"seed_s", p.seed_s},
                         {"delta_s", p.delta_s}});
      }
      out["rows"].push_back({{"model_bytes", r.model_bytes}, {"ranks", ranks}});
    }
    std::cout << out.dump(2) << std::endl;
    return 0;
  }
  std::printf(
      "deltasync bench --stream --sharded: %s, bucket %s, trainer ranks as processes holding "
      "their rows of every tensor, one receiver, gloo on loopback; a seed, then a delta of 1.7%% "
      "of the elements\n",
      config.preset.c_str(), FormatBytes(config.bucket_bytes).c_str());
  std::printf("%6s %5s %10s %8s %8s %13s %13s %13s %13s\n", "ranks", "GiB", "shard MiB", "seed s",
              "delta s", "r0 seed +MiB", "r0 delta +MiB", "others seed", "others delta");
  for (const Row& r : rows) {
    uint64_t seed = 0, delta = 0;
    for (size_t i = 1; i < r.reports.size(); ++i) {
      seed = std::max(seed, r.reports[i].seed_beyond);
      delta = std::max(delta, r.reports[i].delta_beyond);
    }
    char seed_text[32] = "-", delta_text[32] = "-";
    if (r.reports.size() > 1) {
      std::snprintf(seed_text, sizeof(seed_text), "%.1f", Mib(seed));
      std::snprintf(delta_text, sizeof(delta_text), "%.1f", Mib(delta));
    }
    std::printf("%6d %5.2f %10.1f %8.3f %8.3f %13.1f %13.1f %13s %13s\n", r.ranks,
                Gib(r.model_bytes), Mib(r.reports[0].shard_bytes), r.reports[0].seed_s,
                r.reports[0].delta_s, Mib(r.reports[0].seed_beyond), Mib(r.reports[0].delta_beyond),
                seed_text, delta_text);
  }
  std::printf(
      "\n+MiB: peak resident memory beyond the rank's own shards (both states the benchmark "
      "holds) and its snapshot of them, in the seed and in the delta (others: the largest of "
      "ranks 1..)\n");
  return 0;
}

// bench-sharded-trainer --stream SPEC --trainers SPEC --rank R --ranks N
//   --preset P --scale S --bucket BYTES --timeout-ms T
//   [--group G] [--receivers K] [--hostname H] [--encoding E] [--go-file PATH]
// Holds rows [R * ceil(rows / N), ...) of every tensor of the preset at
// `scale` (torch.chunk's split along dim 0) before and after a step, syncs
// both through a sharded sender (rank 0 also leads the stream group G,
// default "stream", of K receivers, default 1, at address H, default
// 127.0.0.1; the trainer group
// stays on loopback), and prints one JSON object: its shards' bytes, its
// peak resident memory beyond them and its snapshot, the two syncs' times,
// and rank 0's delta SyncStats. With --go-file, each rank R makes
// PATH.seeded.R after the seed and every rank waits for PATH before the
// delta (the caller, once every rank is seeded, shapes the links in
// between).
int RunShardedBenchTrainer(const std::vector<std::string>& args) {
  std::map<std::string, std::string> a;
  for (size_t i = 0; i + 1 < args.size(); i += 2) a[args[i]] = args[i + 1];
  for (const char* k : {"--stream", "--trainers", "--rank", "--ranks", "--preset", "--scale",
                        "--bucket", "--timeout-ms"}) {
    if (!a.count(k)) return Fail(std::string("bench-sharded-trainer: missing ") + k);
  }
  const int rank = std::atoi(a["--rank"].c_str());
  const int ranks = std::atoi(a["--ranks"].c_str());
  const std::chrono::milliseconds timeout(std::atoll(a["--timeout-ms"].c_str()));
  Result<std::vector<SynthTensorSpec>> specs =
      SynthPresetSpecs(a["--preset"], std::strtod(a["--scale"].c_str(), nullptr));
  if (!specs.ok()) return Fail(specs.status());
  std::vector<ModelTensor> model;
  std::vector<ShardSpec> shard_specs;
  std::vector<std::vector<uint8_t>> before, after;
  uint64_t shard_bytes = 0;
  for (size_t t = 0; t < specs->size(); ++t) {
    const SynthTensorSpec& s = (*specs)[t];
    model.push_back({s.name, DType::kBF16, s.shape});
    Result<ShardSpec> spec = ShardSpec::Shard(s.name, DType::kBF16, s.shape, 0, rank, ranks);
    if (!spec.ok()) return Fail(spec.status());
    // Elements before this rank's first row, in the whole tensor.
    const int64_t rows = s.shape.empty() ? 1 : s.shape[0];
    const int64_t chunk = (rows + ranks - 1) / ranks;
    const int64_t first_row = std::min<int64_t>(rows, rank * chunk);
    int64_t inner = 1;
    for (size_t d = 1; d < s.shape.size(); ++d) inner *= s.shape[d];
    const uint64_t n = static_cast<uint64_t>(spec->local_numel());
    const uint64_t first = static_cast<uint64_t>(first_row * inner);
    std::vector<uint8_t> b(n * 2), f(n * 2);
    for (uint64_t i = 0; i < n; ++i) {
      const uint16_t x = Before(t, first + i), y = After(t, first + i);
      std::memcpy(b.data() + 2 * i, &x, 2);
      std::memcpy(f.data() + 2 * i, &y, 2);
    }
    shard_bytes += b.size();
    shard_specs.push_back(std::move(*spec));
    before.push_back(std::move(b));
    after.push_back(std::move(f));
  }
  // The peak from here on: what syncing adds to the shards held.
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";
  }
  const uint64_t floor = OwnMemory("VmRSS");
  const CommunicatorOptions trainer_o = Loopback(a["--trainers"], "trainers", rank, ranks, timeout);
  CommunicatorFactory stream_factory;
  if (rank == 0) {
    const int receivers = a.count("--receivers") ? std::atoi(a["--receivers"].c_str()) : 1;
    const std::string group = a.count("--group") ? a["--group"] : "stream";
    CommunicatorOptions o = Loopback(a["--stream"], group, 0, receivers + 1, timeout);
    if (a.count("--hostname")) o.hostname = a["--hostname"];
    stream_factory = [o] { return CreateCommunicator("gloo", o); };
  }
  SenderOptions so;
  so.bucket_bytes = std::strtoull(a["--bucket"].c_str(), nullptr, 10);
  // The ranks share this host, as a node's ranks share its cores: each
  // diffs and commits on its share.
  so.threads = std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(ranks));
  if (a.count("--encoding")) {
    Result<StreamEncoding> e = ParseStreamEncoding(a["--encoding"]);
    if (!e.ok()) return Fail(e.status());
    so.encoding = *e;
  }
  const std::string go = a.count("--go-file") ? a["--go-file"] : "";
  Result<std::unique_ptr<StreamSender>> sender = StreamSender::CreateSharded(
      [trainer_o] { return CreateCommunicator("gloo", trainer_o); }, stream_factory, so);
  if (!sender.ok()) return Fail(sender.status());
  json out;
  for (const auto* state : {&before, &after}) {
    std::vector<ShardedTensor> shards;
    for (size_t i = 0; i < shard_specs.size(); ++i)
      shards.push_back({shard_specs[i], (*state)[i], {}});
    const bool seed = state == &before;
    if (!seed && !go.empty()) {
      // Each rank once its seed is done (its snapshot taken): the delta's
      // clock starts with every rank ready, not while one still settles
      // the seed.
      std::ofstream(go + ".seeded." + std::to_string(rank)) << "1";
      const auto deadline = Clock::now() + timeout;
      while (!std::filesystem::exists(go)) {
        if (Clock::now() > deadline) return Fail("bench-sharded-trainer: no " + go + " in time");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    const auto t0 = Clock::now();
    Result<SyncStats> s = (*sender)->SyncShards(model, shards);
    if (!s.ok()) return Fail(s.status());
    if (!seed && rank == 0) {
      out["delta"] = {{"bytes_sent", s->bytes_sent},    {"diff_s", s->diff_s},
                      {"encode_s", s->encode_s},        {"transfer_s", s->transfer_s},
                      {"report_s", s->report_s},        {"commit_s", s->commit_s},
                      {"buffer_bytes", s->buffer_bytes}};
    }
    out[seed ? "seed_s" : "delta_s"] = SecondsSince(t0);
    // Each sync's own peak beyond the shards and the snapshot (a copy of
    // the shards, made by the seed).
    const uint64_t peak = OwnMemory("VmHWM");
    out[seed ? "seed_beyond_bytes" : "delta_beyond_bytes"] =
        peak > floor + shard_bytes ? peak - floor - shard_bytes : 0;
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";
  }
  out["rank"] = rank;
  out["shard_bytes"] = shard_bytes;
  out["floor_rss_bytes"] = floor;
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace deltasync::cli
