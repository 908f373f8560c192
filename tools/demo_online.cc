#include "demo_online.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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
#include "deltasync/checksum.h"
#include "deltasync/communicator.h"
#include "deltasync/shard.h"
#include "deltasync/synth.h"
#include "deltasync/timing.h"

namespace deltasync::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// What every process of the demo agrees on.
struct Shared {
  std::string dir, preset;
  double scale = 1, lr = 1e-6;
  uint64_t seed = 0;
  int ranks = 2, receivers = 2, steps = 8;
  StreamEncoding encoding = StreamEncoding::kIndices;
  std::chrono::milliseconds timeout{120000};

  std::vector<std::string> Args() const {
    std::ostringstream s;
    s.precision(17);
    s << scale;
    std::ostringstream l;
    l.precision(17);
    l << lr;
    return {"--dir",        dir,
            "--preset",     preset,
            "--scale",      s.str(),
            "--lr",         l.str(),
            "--seed",       std::to_string(seed),
            "--ranks",      std::to_string(ranks),
            "--receivers",  std::to_string(receivers),
            "--steps",      std::to_string(steps),
            "--encoding",   std::string(StreamEncodingName(encoding)),
            "--timeout-ms", std::to_string(timeout.count())};
  }
  CommunicatorOptions Group(const std::string& name, int rank, int size) const {
    CommunicatorOptions o;
    o.rank = rank;
    o.size = size;
    o.rendezvous.kind = Rendezvous::Kind::kFile;
    o.rendezvous.path = dir + "/rendezvous";
    o.group = name;
    o.timeout = timeout;
    o.connect_timeout = timeout;
    o.hostname = "127.0.0.1";
    return o;
  }
};

// A trainer rank's placement of each tensor: rows split among the ranks
// (torch.chunk), vectors replicated (rank 0 sends theirs).
Result<std::vector<ShardSpec>> RankSpecs(const std::vector<SynthTensorSpec>& specs, int rank,
                                         int ranks) {
  std::vector<ShardSpec> out;
  for (const SynthTensorSpec& s : specs) {
    Result<ShardSpec> spec = s.shape.size() >= 2
                                 ? ShardSpec::Shard(s.name, DType::kBF16, s.shape, 0, rank, ranks)
                                 : ShardSpec::Replicate(s.name, DType::kBF16, s.shape, rank == 0);
    if (!spec.ok()) return spec.status();
    out.push_back(std::move(*spec));
  }
  return out;
}

// The rows [first, first + rows) of a row-major tensor, the bytes of a Shard(0)
// piece; the whole tensor for a replica.
std::span<const uint8_t> ShardBytes(const ShardSpec& spec, std::span<const uint8_t> whole) {
  const ShardPiece& p = spec.pieces.front();
  if (p.hf_offset.empty() || spec.local_shape == p.hf_shape) return whole;
  uint64_t row = 2;
  for (size_t d = 1; d < p.hf_shape.size(); ++d) row *= p.hf_shape[d];
  return whole.subspan(p.hf_offset[0] * row, p.extent[0] * row);
}

std::string HashOf(const std::vector<std::span<const uint8_t>>& tensors) {
  std::unique_ptr<Hasher> h = NewHasher(ChecksumAlgo::kXxh3_128);
  for (std::span<const uint8_t> t : tensors) h->Update(t);
  return h->HexDigest();
}

// One trainer rank's life: `on_step` sees each step's result (rank 0).
Status TrainerRank(const Shared& sh, int rank,
                   const std::function<Status(int, const SynthTrainer&, const Result<SyncStats>&,
                                              double)>& on_step) {
  SynthConfig sc;
  sc.preset = sh.preset;
  sc.scale = sh.scale;
  sc.lr = sh.lr;
  sc.seed = sh.seed;
  DS_ASSIGN_OR_RETURN(std::unique_ptr<SynthTrainer> trainer, SynthTrainer::Create(sc));
  DS_ASSIGN_OR_RETURN(std::vector<ShardSpec> specs, RankSpecs(trainer->specs(), rank, sh.ranks));
  std::vector<ModelTensor> model;
  for (const SynthTensorSpec& s : trainer->specs())
    model.push_back({s.name, DType::kBF16, s.shape});
  SenderOptions so;
  so.encoding = sh.encoding;
  const CommunicatorOptions tg = sh.Group("trainers", rank, sh.ranks);
  CommunicatorFactory stream;
  if (rank == 0) {
    const CommunicatorOptions sg = sh.Group("stream", 0, sh.receivers + 1);
    stream = [sg] { return CreateCommunicator("gloo", sg); };
  }
  DS_ASSIGN_OR_RETURN(
      std::unique_ptr<StreamSender> sender,
      StreamSender::CreateSharded([tg] { return CreateCommunicator("gloo", tg); }, stream, so));
  for (int step = 0; step < sh.steps; ++step) {
    const auto t0 = Clock::now();
    if (step > 0) trainer->Step();
    const double train_s = SecondsSince(t0);
    const std::vector<TensorView> weights = trainer->Weights();
    std::vector<ShardedTensor> shards;
    for (size_t i = 0; i < specs.size(); ++i) {
      shards.push_back({specs[i], ShardBytes(specs[i], weights[i].bytes), {}});
    }
    Result<SyncStats> got = sender->SyncShards(model, shards);
    if (on_step) {
      DS_RETURN_IF_ERROR(on_step(step, *trainer, got, train_s));
    } else if (!got.ok()) {
      return got.status();
    }
  }
  return Status::OK();
}

Status Receiver(const Shared& sh, int rank) {
  DS_ASSIGN_OR_RETURN(std::vector<SynthTensorSpec> specs, SynthPresetSpecs(sh.preset, sh.scale));
  const CommunicatorOptions sg = sh.Group("stream", rank, sh.receivers + 1);
  DS_ASSIGN_OR_RETURN(std::unique_ptr<StreamReceiver> r,
                      StreamReceiver::Create([sg] { return CreateCommunicator("gloo", sg); }));
  std::vector<std::vector<uint8_t>> bufs;
  for (const SynthTensorSpec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    bufs.emplace_back(static_cast<size_t>(n) * 2, 0);
    DS_RETURN_IF_ERROR(r->Register(s.name, DType::kBF16, s.shape, bufs.back()));
  }
  for (int step = 0; step < sh.steps; ++step) {
    DS_ASSIGN_OR_RETURN(ReceiveStats stats, r->ReceiveSync());
    std::vector<std::span<const uint8_t>> views(bufs.begin(), bufs.end());
    const std::string path =
        sh.dir + "/receiver" + std::to_string(rank) + "-" + std::to_string(stats.sync_id);
    std::ofstream(path + ".tmp") << HashOf(views) << "\n";
    fs::rename(path + ".tmp", path);
  }
  return Status::OK();
}

// The hash a receiver wrote after sync `id`, waiting for it up to `limit`.
std::string ReceiverHash(const std::string& dir, int rank, uint64_t id,
                         std::chrono::milliseconds limit) {
  const std::string path = dir + "/receiver" + std::to_string(rank) + "-" + std::to_string(id);
  const auto end = Clock::now() + limit;
  for (;;) {
    std::ifstream in(path);
    std::string h;
    if (in >> h) return h;
    if (Clock::now() >= end) return "";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

int RunOnlineDemo(const OnlineDemoConfig& c, bool json_out) {
  if (c.ranks < 1 || c.ranks > 16) return Fail("--ranks must be in [1, 16]");
  if (c.receivers < 1 || c.receivers > 16) return Fail("--receivers must be in [1, 16]");
  if (c.steps < 1) return Fail("--steps must be at least 1");
  Shared sh;
  ScratchDir scratch{c.workdir, c.workdir.empty()};
  if (scratch.owned) {
    std::string tmpl = "/tmp/deltasync-demo-online-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return Fail("cannot make a temp dir under /tmp");
    scratch.path = tmpl;
  }
  sh.dir = scratch.path;
  if (!scratch.owned) {
    std::error_code ec;
    fs::create_directories(sh.dir, ec);
    if (!fs::is_empty(sh.dir, ec)) return Fail("--workdir " + sh.dir + " is not empty");
  }
  Result<double> scale = SynthScaleForBytes(c.preset, c.target_bytes);
  if (!scale.ok()) return Fail(scale.status());
  sh.preset = c.preset;
  sh.scale = *scale;
  sh.lr = c.lr;
  sh.seed = c.seed;
  sh.ranks = c.ranks;
  sh.receivers = c.receivers;
  sh.steps = c.steps;
  sh.encoding = c.encoding;
  sh.timeout = c.timeout;

  std::vector<std::unique_ptr<Child>> children;
  const auto spawn = [&](const std::string& role, int rank) -> Status {
    std::vector<std::string> argv = {SelfPath(), "demo-online-peer", "--role",
                                     role,       "--rank",           std::to_string(rank)};
    for (const std::string& a : sh.Args()) argv.push_back(a);
    children.push_back(std::make_unique<Child>());
    return children.back()->Start(argv, sh.dir + "/" + role + std::to_string(rank));
  };
  for (int r = 1; r < c.ranks; ++r) {
    if (Status s = spawn("trainer", r); !s.ok()) return Fail(s);
  }
  for (int r = 1; r <= c.receivers; ++r) {
    if (Status s = spawn("receiver", r); !s.ok()) return Fail(s);
  }

  json rows = json::array();
  bool all_exact = true;
  if (!json_out) {
    std::printf(
        "deltasync demo --online: %s at scale %.4f, %d trainer ranks (rows sharded), %d "
        "receivers, gloo on loopback, %s, lr %g\n",
        c.preset.c_str(), sh.scale, c.ranks, c.receivers,
        std::string(StreamEncodingName(c.encoding)).c_str(), c.lr);
    std::printf("%4s %9s %8s %8s %8s %9s %7s  %s\n", "step", "changed", "train s", "sync s",
                "diff s", "sent MiB", "seeded", "receivers bit-exact");
  }
  Status ran = TrainerRank(
      sh, 0,
      [&](int step, const SynthTrainer& trainer, const Result<SyncStats>& got,
          double train_s) -> Status {
        if (!got.ok()) return got.status().WithContext("step " + std::to_string(step));
        std::vector<std::span<const uint8_t>> views;
        for (const TensorView& v : trainer.Weights()) views.push_back(v.bytes);
        const std::string want = HashOf(views);
        int exact = 0;
        for (int r = 1; r <= c.receivers; ++r) {
          exact += ReceiverHash(sh.dir, r, got->sync_id, c.timeout) == want ? 1 : 0;
        }
        all_exact = all_exact && exact == c.receivers;
        const double changed = step == 0 ? 1.0 : trainer.last_step_stats().changed_fraction();
        if (!json_out) {
          std::printf("%4d %8.3f%% %8.3f %8.3f %8.3f %9.2f %7u  %d/%d %s\n", step, 100 * changed,
                      train_s, got->total_s, got->diff_s,
                      static_cast<double>(got->bytes_sent) / (1 << 20), got->seeded, exact,
                      c.receivers, exact == c.receivers ? "yes" : "NO");
          std::fflush(stdout);
        }
        rows.push_back({{"step", step},
                        {"changed_fraction", changed},
                        {"train_s", train_s},
                        {"sync_s", got->total_s},
                        {"diff_s", got->diff_s},
                        {"bytes_sent", got->bytes_sent},
                        {"seeded", got->seeded},
                        {"receivers_exact", exact}});
        if (exact != c.receivers) {
          return Status::Internal("step " + std::to_string(step) + ": " +
                                  std::to_string(c.receivers - exact) +
                                  " receivers do not hold the trainer's weights");
        }
        return Status::OK();
      });
  Status peers = Status::OK();
  for (auto& child : children) {
    if (!ran.ok()) break;  // the others are killed as they go
    Result<json> j = child->Wait();
    if (!j.ok() && peers.ok()) peers = j.status();
  }
  if (json_out) {
    std::cout
        << json({{"mode", "online"}, {"steps", rows}, {"all_exact", all_exact && ran.ok()}}).dump(2)
        << std::endl;
  }
  if (!ran.ok()) return Fail(ran.WithContext("demo --online"));
  if (!peers.ok()) return Fail(peers.WithContext("demo --online"));
  if (!json_out) std::printf("every receiver matched the trainer after every step\n");
  return 0;
}

int RunOnlineDemoPeer(const std::vector<std::string>& args) {
  std::map<std::string, std::string> a;
  for (size_t i = 0; i + 1 < args.size(); i += 2) a[args[i]] = args[i + 1];
  for (const char* k : {"--role", "--rank", "--dir", "--preset", "--scale", "--lr", "--seed",
                        "--ranks", "--receivers", "--steps", "--encoding", "--timeout-ms"}) {
    if (!a.count(k)) return Fail(std::string("demo-online-peer: missing ") + k);
  }
  Shared sh;
  sh.dir = a["--dir"];
  sh.preset = a["--preset"];
  sh.scale = std::strtod(a["--scale"].c_str(), nullptr);
  sh.lr = std::strtod(a["--lr"].c_str(), nullptr);
  sh.seed = std::strtoull(a["--seed"].c_str(), nullptr, 10);
  sh.ranks = std::atoi(a["--ranks"].c_str());
  sh.receivers = std::atoi(a["--receivers"].c_str());
  sh.steps = std::atoi(a["--steps"].c_str());
  Result<StreamEncoding> e = ParseStreamEncoding(a["--encoding"]);
  if (!e.ok()) return Fail(e.status());
  sh.encoding = *e;
  sh.timeout = std::chrono::milliseconds(std::atoll(a["--timeout-ms"].c_str()));
  const int rank = std::atoi(a["--rank"].c_str());
  Status s = a["--role"] == "trainer" ? TrainerRank(sh, rank, nullptr) : Receiver(sh, rank);
  if (!s.ok()) return Fail(s);
  std::cout << "{}" << std::endl;
  return 0;
}

}  // namespace deltasync::cli
