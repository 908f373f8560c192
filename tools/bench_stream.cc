#include "bench_stream.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
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
#include "deltasync/checksum.h"
#include "deltasync/communicator.h"
#include "deltasync/diff.h"
#include "deltasync/synth.h"
#include "deltasync/timing.h"

extern char** environ;

namespace deltasync::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// A sync's shared frames travel down a chain of receivers in chunks of this
// size (docs/format.md, "Fan-out"); the chain broadcast measured beside it
// uses the same.
constexpr size_t kRelayChunk = size_t{1} << 20;

double Gib(uint64_t b) { return static_cast<double>(b) / (1u << 30); }
double Mib(uint64_t b) { return static_cast<double>(b) / (1u << 20); }

int Shell(const std::string& command) {
  const int rc = std::system((command + " >/dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 1;
}

// The shaped network (StreamBenchNet): a switch, the sender's uplink from
// the host's namespace, and a namespace and uplink per receiver, made once
// for the most receivers a run takes and removed at the end; a run removes
// only what it made.
class ShapedNet {
 public:
  ~ShapedNet() { Remove(); }
  const StreamBenchNet& net() const { return net_; }
  // Empty when made; otherwise why not.
  std::string Make(int receivers) {
    // A /24 that no other run (nor anything else) has on this host.
    const int64_t pid = ::getpid();
    for (int attempt = 0;; ++attempt) {
      if (attempt == 64) return "no free /24 in 10.77.0.0/16 for the switch";
      net_ = StreamBenchNetFor(pid, attempt);
      if (Shell("ip -o -4 addr show to " + net_.subnet + "0/24 | grep -q .") != 0) break;
    }
    const std::string sw = "ip -n " + net_.ns + " ";
    const std::string prefix = "/" + std::to_string(net_.prefix_length);
    std::vector<std::string> steps = {
        "ip netns add " + net_.ns,
        sw + "link set lo up",
        sw + "link add br0 type bridge",
        sw + "link set br0 up",
        "ip link add " + net_.host_veth + " type veth peer name s0 netns " + net_.ns,
        "ip addr add " + net_.sender_address + prefix + " dev " + net_.host_veth,
        "ip link set " + net_.host_veth + " up",
        sw + "link set s0 master br0",
        sw + "link set s0 up",
    };
    for (int i = 1; i <= receivers; ++i) {
      const std::string ns = net_.ReceiverNs(i);
      const std::string port = "r" + std::to_string(i);
      for (const std::string& step : {
               "ip netns add " + ns,
               "ip -n " + ns + " link set lo up",
               sw + "link add " + port + " type veth peer name uplink netns " + ns,
               sw + "link set " + port + " master br0",
               sw + "link set " + port + " up",
               "ip -n " + ns + " addr add " + net_.ReceiverAddress(i) + prefix + " dev uplink",
               "ip -n " + ns + " link set uplink up",
           }) {
        steps.push_back(step);
      }
    }
    for (const std::string& step : steps) {
      if (step.rfind("ip netns add ", 0) == 0) {
        if (Shell(step) != 0) {
          Remove();
          return "'" + step + "' failed (this needs root and iproute2; a killed run's namespace?)";
        }
        made_.push_back(step.substr(13));
        continue;
      }
      if (Shell(step) != 0) {
        Remove();
        return "'" + step + "' failed";
      }
    }
    receivers_ = receivers;
    return "";
  }
  // Token-bucket shaping of every uplink, both directions, at `gbit`; 0
  // removes it.
  bool Shape(double gbit) {
    // Each uplink's two ends: (namespace, interface); "" the host's.
    std::vector<std::pair<std::string, std::string>> ends = {{"", net_.host_veth}, {net_.ns, "s0"}};
    for (int i = 1; i <= receivers_; ++i) {
      ends.push_back({net_.ns, "r" + std::to_string(i)});
      ends.push_back({net_.ReceiverNs(i), "uplink"});
    }
    // A burst of 10 ms at the rate keeps tbf from under-running it.
    const uint64_t burst =
        std::max<uint64_t>(64 << 10, static_cast<uint64_t>(gbit * 1e9 / 8 / 100));
    std::ostringstream q;
    q << "root tbf rate " << gbit << "gbit burst " << burst << " latency 100ms";
    bool ok = true;
    for (const auto& [ns, dev] : ends) {
      const std::string tc = ns.empty() ? "tc " : "tc -n " + ns + " ";
      Shell(tc + "qdisc del dev " + dev + " root");
      if (gbit > 0) ok = Shell(tc + "qdisc add dev " + dev + " " + q.str()) == 0 && ok;
    }
    return ok;
  }
  // The bytes the sender's uplink has sent so far.
  uint64_t SenderUplinkBytes() const {
    uint64_t n = 0;
    std::ifstream in("/sys/class/net/" + net_.host_veth + "/statistics/tx_bytes");
    in >> n;
    return n;
  }

 private:
  // Deleting a namespace deletes the veths in it, and with each its other
  // end, wherever that is.
  void Remove() {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) Shell("ip netns del " + *it);
    Shell("ip link del " + net_.host_veth);
    made_.clear();
    receivers_ = 0;
  }

  StreamBenchNet net_;
  std::vector<std::string> made_;  // namespaces this run made
  int receivers_ = 0;
};

struct Link {
  std::string name;  // "loopback", "10 Gbit/s"
  double gbit = 0;   // 0: loopback
};

struct Run {
  int receivers = 0;
  int trainer_ranks = 1;
  std::string what;  // "full", "tree" or an encoding
  double seconds = 0;
  uint64_t uplink_bytes = 0;  // what left the sender's uplink (shaped links)
  SyncStats stats;            // delta syncs
  double seed_s = 0;
  double peer_apply_s = 0, peer_verify_s = 0, peer_receive_s = 0;
  uint64_t peer_peak_beyond_weights = 0;
};

class Bench {
 public:
  Bench(const StreamBenchConfig& c, std::string dir) : c_(c), dir_(std::move(dir)) {}

  Status Prepare() {
    DS_ASSIGN_OR_RETURN(scale_, SynthScaleForBytes(c_.preset, c_.target_bytes));
    SynthConfig sc;
    sc.preset = c_.preset;
    sc.scale = scale_;
    sc.lr = c_.lr;
    sc.seed = c_.seed;
    DS_ASSIGN_OR_RETURN(trainer_, SynthTrainer::Create(sc));
    for (int64_t i = 0; i < c_.warmup_steps; ++i) trainer_->Step();
    for (const TensorView& v : trainer_->Weights()) {
      before_.emplace_back(v.bytes.begin(), v.bytes.end());
      model_bytes_ += v.nbytes();
    }
    trainer_->Step();
    changed_ = trainer_->last_step_stats().changed_fraction();
    for (size_t i = 0; i < trainer_->Weights().size(); ++i) {
      const TensorView v = trainer_->Weights()[i];
      old_.push_back({v.name, v.dtype, v.shape, before_[i], {}});
      new_.push_back({v.name, v.dtype, v.shape, v.bytes, {}});
    }
    // The diff's read of the weights: both states once, one thread, as the
    // sender reads them; the best of three.
    read_s_ = 1e30;
    for (int r = 0; r < 3; ++r) {
      const auto t0 = Clock::now();
      for (size_t i = 0; i < new_.size(); ++i) {
        DS_RETURN_IF_ERROR(CountChanged(new_[i].data, old_[i].data, 2).status());
      }
      read_s_ = std::min(read_s_, SecondsSince(t0));
    }
    // The same on every core, as the sender's threads read them (4 MiB
    // pieces): the bound's read.
    struct Piece {
      size_t tensor;
      uint64_t at, bytes;
    };
    std::vector<Piece> pieces;
    for (size_t i = 0; i < new_.size(); ++i) {
      for (uint64_t at = 0; at < new_[i].data.size(); at += uint64_t{4} << 20) {
        pieces.push_back({i, at, std::min<uint64_t>(uint64_t{4} << 20, new_[i].data.size() - at)});
      }
    }
    ThreadPool pool(std::max(1u, std::thread::hardware_concurrency()) - 1);
    threads_ = pool.size() + 1;
    read_all_s_ = 1e30;
    for (int r = 0; r < 3; ++r) {
      std::atomic<bool> bad{false};
      const auto t0 = Clock::now();
      pool.ParallelFor(pieces.size(), [&](size_t k) {
        const Piece& p = pieces[k];
        if (!CountChanged(new_[p.tensor].data.subspan(p.at, p.bytes),
                          old_[p.tensor].data.subspan(p.at, p.bytes), 2)
                 .ok()) {
          bad = true;
        }
      });
      read_all_s_ = std::min(read_all_s_, SecondsSince(t0));
      if (bad) return Status::Internal("the diff's read on every core failed");
    }
    // What a dense frame costs beyond its bytes on the wire, for the
    // model's bytes, best of three: its xxh3-128 on one thread (the sender
    // hashes each frame, each receiver each chunk as it comes in) and the
    // sender's copy of the values into its frames on every core.
    hash_s_ = copy_s_ = 1e30;
    std::unique_ptr<Hasher> hash = NewHasher(ChecksumAlgo::kXxh3_128);
    std::vector<uint8_t> frame(c_.bucket_bytes);
    constexpr uint64_t kCopyPiece = uint64_t{4} << 20;  // as the sender cuts its copies
    for (int r = 0; r < 3; ++r) {
      auto t0 = Clock::now();
      for (const SyncTensor& t : new_) {
        hash->Reset();
        hash->Update(t.data);
        (void)hash->Digest();
      }
      hash_s_ = std::min(hash_s_, SecondsSince(t0));
      t0 = Clock::now();
      for (const SyncTensor& t : new_) {
        for (uint64_t at = 0; at < t.data.size(); at += frame.size()) {
          const uint64_t n = std::min<uint64_t>(frame.size(), t.data.size() - at);
          pool.ParallelFor((n + kCopyPiece - 1) / kCopyPiece, [&](size_t k) {
            const uint64_t from = k * kCopyPiece;
            std::memcpy(frame.data() + from, t.data.data() + at + from,
                        std::min(kCopyPiece, n - from));
          });
        }
      }
      copy_s_ = std::min(copy_s_, SecondsSince(t0));
    }
    return Status::OK();
  }

  Status RunLink(const Link& link, ShapedNet* shaped) {
    for (int n : c_.receivers) {
      for (const char* how : {"full", "tree"}) {
        DS_ASSIGN_OR_RETURN(Run full, RunFull(link, shaped, n, how));
        runs_[link.name].push_back(full);
      }
      for (StreamEncoding e : c_.encodings) {
        DS_ASSIGN_OR_RETURN(Run r, RunDelta(link, shaped, n, e));
        runs_[link.name].push_back(r);
      }
      for (int t : c_.trainer_ranks) {
        if (t < 2) continue;
        DS_ASSIGN_OR_RETURN(Run r, RunSharded(link, shaped, n, t));
        runs_[link.name].push_back(r);
      }
    }
    return Status::OK();
  }

  json Report() const;
  void Print() const;
  // The shaped links' names and addresses, once they are made.
  void SetNet(const StreamBenchNet& net) { net_ = net; }
  std::vector<Link> links;
  std::vector<std::string> skipped;

 private:
  CommunicatorOptions Options(const Link& link, const std::string& group, int size) {
    CommunicatorOptions o;
    o.rank = 0;
    o.size = size;
    o.rendezvous.kind = Rendezvous::Kind::kFile;
    o.rendezvous.path = dir_ + "/rdv-" + group;
    o.group = group;
    o.timeout = c_.timeout;
    o.connect_timeout = std::chrono::milliseconds(60000);
    o.hostname = link.gbit > 0 ? net_.sender_address : "127.0.0.1";
    return o;
  }

  Status StartPeers(const Link& link, const std::string& group, int n, const std::string& mode,
                    int syncs, std::vector<std::unique_ptr<Child>>* peers) {
    for (int r = 1; r <= n; ++r) {
      std::vector<std::string> argv;
      if (link.gbit > 0) argv = {"ip", "netns", "exec", net_.ReceiverNs(r)};
      const CommunicatorOptions o = Options(link, group, n + 1);
      std::ostringstream scale;
      scale.precision(17);
      scale << scale_;
      for (const std::string& a : {SelfPath(),
                                   std::string("bench-stream-peer"),
                                   std::string("--rendezvous"),
                                   RendezvousSpec(o.rendezvous),
                                   std::string("--group"),
                                   group,
                                   std::string("--rank"),
                                   std::to_string(r),
                                   std::string("--size"),
                                   std::to_string(n + 1),
                                   std::string("--hostname"),
                                   link.gbit > 0 ? net_.ReceiverAddress(r) : "127.0.0.1",
                                   std::string("--preset"),
                                   c_.preset,
                                   std::string("--scale"),
                                   scale.str(),
                                   std::string("--mode"),
                                   mode,
                                   std::string("--syncs"),
                                   std::to_string(syncs),
                                   std::string("--timeout-ms"),
                                   std::to_string(c_.timeout.count())}) {
        argv.push_back(a);
      }
      auto child = std::make_unique<Child>();
      DS_RETURN_IF_ERROR(child->Start(argv, dir_ + "/" + group + "-" + std::to_string(r)));
      peers->push_back(std::move(child));
    }
    return Status::OK();
  }

  // The weights to every receiver: `how` "full" down a chain of the
  // receivers in the stream's relay chunks (each passes each chunk on as it
  // takes it, as a sync's shared frames go), "tree" by the communicator's
  // broadcast (a binomial tree: its root sends log2 of the group's size
  // copies).
  Result<Run> RunFull(const Link& link, ShapedNet* shaped, int n, const std::string& how) {
    const std::string group =
        how + "-" + std::to_string(static_cast<int>(link.gbit)) + "-" + std::to_string(n);
    std::vector<std::unique_ptr<Child>> peers;
    DS_RETURN_IF_ERROR(StartPeers(link, group, n, how == "full" ? "chain" : "tree", 1, &peers));
    DS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                        CreateCommunicator("gloo", Options(link, group, n + 1)));
    DS_RETURN_IF_ERROR(comm->Barrier());
    if (shaped != nullptr && !shaped->Shape(link.gbit)) return Status::Internal("tc failed");
    const uint64_t up0 = shaped != nullptr ? shaped->SenderUplinkBytes() : 0;
    const auto t0 = Clock::now();
    for (const SyncTensor& t : new_) {
      // The root's span is only read (Communicator::Broadcast): the weights
      // go out as they lie, with no copy in the timed loop.
      std::span<uint8_t> weights(const_cast<uint8_t*>(t.data.data()), t.data.size());
      if (how == "tree") {
        DS_RETURN_IF_ERROR(comm->Broadcast(0, weights));
        continue;
      }
      for (size_t at = 0; at < weights.size(); at += kRelayChunk) {
        DS_RETURN_IF_ERROR(
            comm->Send(1, weights.subspan(at, std::min(kRelayChunk, weights.size() - at))));
      }
    }
    DS_RETURN_IF_ERROR(comm->Barrier());
    Run run;
    run.receivers = n;
    run.what = how;
    run.seconds = SecondsSince(t0);
    if (shaped != nullptr) {
      run.uplink_bytes = shaped->SenderUplinkBytes() - up0;
      shaped->Shape(0);
    }
    for (auto& p : peers) DS_RETURN_IF_ERROR(p->Wait().status());
    return run;
  }

  Result<Run> RunDelta(const Link& link, ShapedNet* shaped, int n, StreamEncoding e) {
    const std::string group = std::string(StreamEncodingName(e)) + "-" +
                              std::to_string(static_cast<int>(link.gbit)) + "-" + std::to_string(n);
    std::vector<std::unique_ptr<Child>> peers;
    DS_RETURN_IF_ERROR(StartPeers(link, group, n, "stream", 2, &peers));
    SenderOptions so;
    so.encoding = e;
    so.bucket_bytes = c_.bucket_bytes;
    const CommunicatorOptions o = Options(link, group, n + 1);
    DS_ASSIGN_OR_RETURN(std::unique_ptr<StreamSender> sender,
                        StreamSender::Create([o] { return CreateCommunicator("gloo", o); }, so));
    Run run;
    run.receivers = n;
    run.what = std::string(StreamEncodingName(e));
    // The seed goes unshaped (it is not what is measured here).
    DS_ASSIGN_OR_RETURN(SyncStats seed, sender->Sync(old_));
    run.seed_s = seed.total_s;
    if (shaped != nullptr && !shaped->Shape(link.gbit)) return Status::Internal("tc failed");
    const uint64_t up0 = shaped != nullptr ? shaped->SenderUplinkBytes() : 0;
    const auto t0 = Clock::now();
    DS_ASSIGN_OR_RETURN(run.stats, sender->Sync(new_));
    run.seconds = SecondsSince(t0);
    if (shaped != nullptr) {
      run.uplink_bytes = shaped->SenderUplinkBytes() - up0;
      shaped->Shape(0);
    }
    sender.reset();
    DS_RETURN_IF_ERROR(ReadPeers(peers, &run));
    return run;
  }

  // The receivers' reports of the run's last sync: the slowest phases and
  // the largest memory beyond the weights.
  static Status ReadPeers(std::vector<std::unique_ptr<Child>>& peers, Run* run) {
    for (auto& p : peers) {
      DS_ASSIGN_OR_RETURN(json j, p->Wait());
      const json& last = j["syncs"].back();
      run->peer_apply_s = std::max(run->peer_apply_s, last["apply_s"].get<double>());
      run->peer_verify_s = std::max(run->peer_verify_s, last["verify_s"].get<double>());
      run->peer_receive_s = std::max(run->peer_receive_s, last["receive_s"].get<double>());
      // Beyond the process with its weights in place (binary, libraries
      // and the zeroed weights themselves).
      const uint64_t peak = j["peak_rss_bytes"].get<uint64_t>();
      const uint64_t floor = j["floor_rss_bytes"].get<uint64_t>();
      run->peer_peak_beyond_weights =
          std::max(run->peer_peak_beyond_weights, peak > floor ? peak - floor : 0);
    }
    return Status::OK();
  }

  // A sharded trainer of `ranks` processes on the sender's host (the
  // hidden bench-sharded-trainer command: rows of every tensor of the same
  // shapes, a step changing 1.7% of the elements), its rank 0 leading the
  // receivers over the link, an `indices` delta after an unshaped seed.
  Result<Run> RunSharded(const Link& link, ShapedNet* shaped, int n, int ranks) {
    const std::string group = "sharded" + std::to_string(ranks) + "-" +
                              std::to_string(static_cast<int>(link.gbit)) + "-" + std::to_string(n);
    std::vector<std::unique_ptr<Child>> peers;
    DS_RETURN_IF_ERROR(StartPeers(link, group, n, "stream", 2, &peers));
    const CommunicatorOptions o = Options(link, group, n + 1);
    const std::string go = dir_ + "/go-" + group;
    std::ostringstream scale;
    scale.precision(17);
    scale << scale_;
    std::vector<std::unique_ptr<Child>> trainers;
    for (int r = 0; r < ranks; ++r) {
      auto child = std::make_unique<Child>();
      DS_RETURN_IF_ERROR(child->Start({SelfPath(),     "bench-sharded-trainer",
                                       "--stream",     RendezvousSpec(o.rendezvous),
                                       "--group",      group,
                                       "--trainers",   "file:" + dir_ + "/rdv-trainers-" + group,
                                       "--rank",       std::to_string(r),
                                       "--ranks",      std::to_string(ranks),
                                       "--preset",     c_.preset,
                                       "--scale",      scale.str(),
                                       "--bucket",     std::to_string(c_.bucket_bytes),
                                       "--timeout-ms", std::to_string(c_.timeout.count()),
                                       "--receivers",  std::to_string(n),
                                       "--hostname",   o.hostname,
                                       "--encoding",   "indices",
                                       "--go-file",    go},
                                      dir_ + "/" + group + "-trainer-" + std::to_string(r)));
      trainers.push_back(std::move(child));
    }
    // The seed goes unshaped; the delta waits for the shaping.
    const auto deadline = Clock::now() + c_.timeout;
    const auto all_seeded = [&] {
      for (int r = 0; r < ranks; ++r) {
        if (!fs::exists(go + ".seeded." + std::to_string(r))) return false;
      }
      return true;
    };
    while (!all_seeded()) {
      // A rank that ended before it said it is seeded fails the run with
      // its own error, not after the deadline.
      for (const std::unique_ptr<Child>& t : trainers) {
        if (t->Running()) continue;
        DS_RETURN_IF_ERROR(t->Wait().status());
        return Status::Internal("a sharded trainer rank ended before its delta");
      }
      if (Clock::now() > deadline) {
        return Status::DeadlineExceeded("the sharded trainer's seed did not end in time");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (shaped != nullptr && !shaped->Shape(link.gbit)) return Status::Internal("tc failed");
    const uint64_t up0 = shaped != nullptr ? shaped->SenderUplinkBytes() : 0;
    std::ofstream(go) << "1";
    Run run;
    run.receivers = n;
    run.trainer_ranks = ranks;
    run.what = "indices/" + std::to_string(ranks) + "r";
    for (int r = 0; r < ranks; ++r) {
      DS_ASSIGN_OR_RETURN(json j, trainers[r]->Wait());
      if (r != 0) continue;
      run.seconds = j["delta_s"].get<double>();
      run.seed_s = j["seed_s"].get<double>();
      const json& d = j["delta"];
      run.stats.bytes_sent = d["bytes_sent"].get<uint64_t>();
      run.stats.diff_s = d["diff_s"].get<double>();
      run.stats.encode_s = d["encode_s"].get<double>();
      run.stats.transfer_s = d["transfer_s"].get<double>();
      run.stats.report_s = d["report_s"].get<double>();
      run.stats.commit_s = d["commit_s"].get<double>();
      run.stats.buffer_bytes = d["buffer_bytes"].get<uint64_t>();
    }
    if (shaped != nullptr) {
      run.uplink_bytes = shaped->SenderUplinkBytes() - up0;
      shaped->Shape(0);
    }
    DS_RETURN_IF_ERROR(ReadPeers(peers, &run));
    return run;
  }

  // The link's speed: the fastest one receiver was sent bytes in this run,
  // by the full broadcast or by a sync's frames (their send time), and on
  // a shaped link never above its shaper's rate: a sync's send time ends
  // when its last bytes are queued, not when they arrive, so a short
  // sync's rate can exceed what the link carries.
  double LinkBytesPerSecond(const Link& link) const {
    double bps = LinkBytesPerSecond(link.name);
    if (link.gbit > 0) bps = std::min(bps, link.gbit * 1e9 / 8);
    return bps;
  }
  double LinkBytesPerSecond(const std::string& link) const {
    double bps = 0;
    for (const Run& r : runs_.at(link)) {
      if (r.receivers != 1) continue;
      if (r.what == "full") {
        bps = std::max(bps, model_bytes_ / r.seconds);
      } else if (r.stats.transfer_s > 0) {
        bps = std::max(bps, r.stats.bytes_sent / r.stats.transfer_s);
      }
    }
    return bps;
  }

  double FullBytesPerSecond(const std::string& link) const {
    for (const Run& r : runs_.at(link)) {
      if (r.what == "full" && r.receivers == 1) return model_bytes_ / r.seconds;
    }
    return 0;
  }

  const StreamBenchConfig& c_;
  std::string dir_;
  StreamBenchNet net_;
  double scale_ = 1;
  std::unique_ptr<SynthTrainer> trainer_;
  std::vector<std::vector<uint8_t>> before_;
  std::vector<SyncTensor> old_, new_;
  uint64_t model_bytes_ = 0;
  double changed_ = 0;
  double read_s_ = 0;      // one thread
  double read_all_s_ = 0;  // every core: the bound's
  // A dense frame's work beyond the wire for the model's bytes: its
  // xxh3-128 on one thread, and the copy into bucket-sized frames on every
  // core.
  double hash_s_ = 0, copy_s_ = 0;
  size_t threads_ = 1;
  std::map<std::string, std::vector<Run>> runs_;
};

json Bench::Report() const {
  json out;
  out["mode"] = "stream";
  out["config"] = {{"preset", c_.preset},
                   {"bytes", model_bytes_},
                   {"lr", c_.lr},
                   {"seed", c_.seed},
                   {"bucket_bytes", c_.bucket_bytes}};
  out["changed_fraction"] = changed_;
  out["diff_read_s"] = read_all_s_;
  out["diff_read_one_thread_s"] = read_s_;
  out["frame_hash_s"] = hash_s_;
  out["frame_copy_s"] = copy_s_;
  out["threads"] = threads_;
  out["skipped"] = skipped;
  for (const Link& link : links) {
    const double bps = LinkBytesPerSecond(link);
    json rows = json::array();
    for (const Run& r : runs_.at(link.name)) {
      json row = {{"receivers", r.receivers},
                  {"what", r.what},
                  {"trainer_ranks", r.trainer_ranks},
                  {"seconds", r.seconds}};
      if (link.gbit > 0) row["sender_uplink_bytes"] = r.uplink_bytes;
      if (r.what != "full" && r.what != "tree") {
        const double bound = read_all_s_ + (bps > 0 ? r.stats.bytes_sent / bps : 0);
        row["bound_s"] = bound;
        row["bytes_sent"] = r.stats.bytes_sent;
        row["diff_s"] = r.stats.diff_s;
        row["encode_s"] = r.stats.encode_s;
        row["transfer_s"] = r.stats.transfer_s;
        row["report_s"] = r.stats.report_s;
        row["commit_s"] = r.stats.commit_s;
        row["committed_bytes"] = r.stats.committed_bytes;
        row["receiver_receive_s"] = r.peer_receive_s;
        row["receiver_apply_s"] = r.peer_apply_s;
        row["receiver_verify_s"] = r.peer_verify_s;
        row["sender_buffer_bytes"] = r.stats.buffer_bytes;
        row["receiver_peak_beyond_weights_bytes"] = r.peer_peak_beyond_weights;
      }
      rows.push_back(row);
    }
    out["links"][link.name] = {{"bytes_per_s", bps}, {"runs", rows}};
  }
  return out;
}

void Bench::Print() const {
  std::printf(
      "deltasync bench --stream: %s, %.2f GiB BF16, lr %g, %.2f%% of elements changed, "
      "bucket %s\n",
      c_.preset.c_str(), Gib(model_bytes_), c_.lr, 100 * changed_,
      FormatBytes(c_.bucket_bytes).c_str());
  std::printf(
      "the diff's read of both states: %.3f s on one thread, %.3f s on %zu (the bound's, and the "
      "sender's threads)\n",
      read_s_, read_all_s_, threads_);
  std::printf(
      "dense frames beyond the wire: their xxh3-128 %.3f s on one thread (at the sender and at "
      "each receiver), the copy into %s frames %.3f s on %zu\n",
      hash_s_, FormatBytes(c_.bucket_bytes).c_str(), copy_s_, threads_);
  for (const std::string& s : skipped) std::printf("skipped: %s\n", s.c_str());
  for (const Link& link : links) {
    const double bps = LinkBytesPerSecond(link);
    std::printf("\n%s (to 1 receiver: %.2f GB/s at best, full broadcast %.2f GB/s)\n",
                link.name.c_str(), bps / 1e9, FullBytesPerSecond(link.name) / 1e9);
    std::printf("%4s %-10s %8s %7s %8s %7s %7s %7s %7s %7s %7s %8s %8s %9s %9s %9s\n", "recv",
                "sync", "time s", "x full", "bound s", "x bound", "diff", "encode", "send",
                "report", "commit", "rx apply", "rx vrfy", "sent MiB", "rx +mem MiB", "up MiB");
    const bool counted = link.gbit > 0;
    const auto up = [&](const Run& r) {
      if (!counted) return std::string("-");
      char text[32];
      std::snprintf(text, sizeof(text), "%.1f", Mib(r.uplink_bytes));
      return std::string(text);
    };
    double full_s = 0;
    for (const Run& r : runs_.at(link.name)) {
      if (r.what == "full" || r.what == "tree") {
        if (r.what == "full") full_s = r.seconds;
        std::printf("%4d %-10s %8.3f %7.3f %8s %7s %7s %7s %7s %7s %7s %8s %8s %9s %9s %9s\n",
                    r.receivers, r.what.c_str(), r.seconds, r.seconds / full_s, "", "", "", "", "",
                    "", "", "", "", "", "", up(r).c_str());
        continue;
      }
      const double bound = read_all_s_ + (bps > 0 ? r.stats.bytes_sent / bps : 0);
      std::printf(
          "%4d %-10s %8.3f %7.3f %8.3f %7.2f %7.3f %7.3f %7.3f %7.3f %7.3f %8.3f %8.3f "
          "%9.1f %9.1f %9s\n",
          r.receivers, r.what.c_str(), r.seconds, r.seconds / full_s, bound, r.seconds / bound,
          r.stats.diff_s, r.stats.encode_s, r.stats.transfer_s, r.stats.report_s, r.stats.commit_s,
          r.peer_apply_s, r.peer_verify_s, Mib(r.stats.bytes_sent), Mib(r.peer_peak_beyond_weights),
          up(r).c_str());
    }
  }
  std::printf(
      "\nsender buffers beside its snapshot: at most %s (bucket %s)\n",
      [&] {
        uint64_t m = 0;
        for (const auto& [name, runs] : runs_) {
          for (const Run& r : runs) m = std::max(m, r.stats.buffer_bytes);
        }
        return FormatBytes(m);
      }()
          .c_str(),
      FormatBytes(c_.bucket_bytes).c_str());
}

}  // namespace

StreamBenchNet StreamBenchNetFor(int64_t pid, int attempt) {
  // Eight digits keep "dsb<pid>-0" within an interface name's 15 characters
  // (Linux pids stay below 2^22).
  const std::string id = std::to_string(pid % 100000000);
  StreamBenchNet net;
  net.ns = "dsbench-" + id;
  net.host_veth = "dsb" + id + "-0";
  // 256 /24s in 10.77.0.0/16: .1 the sender, .10 + i receiver i.
  const uint64_t k = (static_cast<uint64_t>(pid) + static_cast<uint64_t>(attempt)) % 256;
  net.subnet = "10.77." + std::to_string(k) + ".";
  net.sender_address = net.subnet + "1";
  return net;
}

int RunStreamBench(const StreamBenchConfig& config, bool json_out) {
  ScratchDir scratch{config.workdir, config.workdir.empty()};
  if (scratch.owned) {
    std::string tmpl = "/tmp/deltasync-bench-stream-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return Fail("cannot make a temp dir under /tmp");
    scratch.path = tmpl;
  }
  const std::string dir = scratch.path;
  std::error_code ec;
  fs::create_directories(dir, ec);
  Bench bench(config, dir);
  if (Status s = bench.Prepare(); !s.ok()) return Fail(s);
  std::unique_ptr<ShapedNet> shaped;
  std::vector<Link> links = {{"loopback", 0}};
  if (!config.shaped_gbit.empty()) {
    shaped = std::make_unique<ShapedNet>();
    const int most = *std::max_element(config.receivers.begin(), config.receivers.end());
    const std::string why = geteuid() == 0 ? shaped->Make(most) : "not root";
    if (why.empty()) {
      bench.SetNet(shaped->net());
      for (double g : config.shaped_gbit) {
        std::ostringstream name;
        name << g << " Gbit/s uplinks";
        links.push_back({name.str(), g});
      }
    } else {
      bench.skipped.push_back("shaped links (" + why + ")");
      shaped.reset();
    }
  }
  for (const Link& link : links) {
    if (Status s = bench.RunLink(link, link.gbit > 0 ? shaped.get() : nullptr); !s.ok()) {
      return Fail(s.WithContext(link.name));
    }
    bench.links.push_back(link);
  }
  if (json_out) {
    std::cout << bench.Report().dump(2) << std::endl;
  } else {
    bench.Print();
  }
  return 0;
}

// bench-stream-peer --rendezvous SPEC --group G --rank R --size N --hostname H
//   --preset P --scale S --mode stream|tree|chain --syncs K --timeout-ms T
// Holds the preset's tensors (zeros), takes K syncs (stream) or K
// broadcasts of every tensor (tree: the communicator's; chain: passed on
// down the ranks in relay chunks), and prints one JSON object: its
// per-sync figures, its peak resident set and its weights' bytes.
int RunStreamBenchPeer(const std::vector<std::string>& args) {
  std::map<std::string, std::string> a;
  for (size_t i = 0; i + 1 < args.size(); i += 2) a[args[i]] = args[i + 1];
  for (const char* k : {"--rendezvous", "--group", "--rank", "--size", "--hostname", "--preset",
                        "--scale", "--mode", "--syncs", "--timeout-ms"}) {
    if (!a.count(k)) return Fail(std::string("bench-stream-peer: missing ") + k);
  }
  Result<Rendezvous> where = ParseRendezvous(a["--rendezvous"]);
  if (!where.ok()) return Fail(where.status());
  CommunicatorOptions o;
  o.rendezvous = *where;
  o.group = a["--group"];
  o.rank = std::atoi(a["--rank"].c_str());
  o.size = std::atoi(a["--size"].c_str());
  o.hostname = a["--hostname"];
  o.timeout = std::chrono::milliseconds(std::atoll(a["--timeout-ms"].c_str()));
  o.connect_timeout = std::chrono::milliseconds(60000);
  Result<std::vector<SynthTensorSpec>> specs =
      SynthPresetSpecs(a["--preset"], std::strtod(a["--scale"].c_str(), nullptr));
  if (!specs.ok()) return Fail(specs.status());
  std::vector<std::vector<uint8_t>> bufs;
  uint64_t weights = 0;
  for (const SynthTensorSpec& s : *specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    bufs.emplace_back(static_cast<size_t>(n) * 2, 0);
    weights += bufs.back().size();
  }
  // What the process holds with its weights in place: the floor of what
  // receiving adds.
  const uint64_t floor = OwnMemory("VmRSS");
  const int syncs = std::atoi(a["--syncs"].c_str());
  json out;
  out["syncs"] = json::array();
  if (a["--mode"] == "tree" || a["--mode"] == "chain") {
    const bool tree = a["--mode"] == "tree";
    Result<std::unique_ptr<Communicator>> comm = CreateCommunicator("gloo", o);
    if (!comm.ok()) return Fail(comm.status());
    // Down the chain in rank order: from the rank before, to the one after.
    const int next = o.rank + 1 < o.size ? o.rank + 1 : -1;
    for (int k = 0; k < syncs; ++k) {
      if (Status s = (*comm)->Barrier(); !s.ok()) return Fail(s);
      for (std::vector<uint8_t>& b : bufs) {
        Status s = tree ? (*comm)->Broadcast(0, b)
                        : (*comm)->Relay(o.rank - 1, next, b, kRelayChunk, nullptr);
        if (!s.ok()) return Fail(s);
      }
      if (Status s = (*comm)->Barrier(); !s.ok()) return Fail(s);
      out["syncs"].push_back(json::object());
    }
  } else {
    Result<std::unique_ptr<StreamReceiver>> r =
        StreamReceiver::Create([o] { return CreateCommunicator("gloo", o); });
    if (!r.ok()) return Fail(r.status());
    for (size_t i = 0; i < specs->size(); ++i) {
      if (Status s = (*r)->Register((*specs)[i].name, DType::kBF16, (*specs)[i].shape, bufs[i]);
          !s.ok()) {
        return Fail(s);
      }
    }
    for (int k = 0; k < syncs; ++k) {
      Result<ReceiveStats> s = (*r)->ReceiveSync();
      if (!s.ok()) return Fail(s.status());
      out["syncs"].push_back({{"seed", s->seed},
                              {"wait_s", s->wait_s},
                              {"receive_s", s->receive_s},
                              {"apply_s", s->apply_s},
                              {"verify_s", s->verify_s},
                              {"bytes", s->bytes}});
    }
  }
  out["peak_rss_bytes"] = OwnMemory("VmHWM");
  out["floor_rss_bytes"] = floor;
  out["weights_bytes"] = weights;
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace deltasync::cli
