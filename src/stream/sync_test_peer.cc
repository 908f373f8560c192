// A member of the stream sync tests as a process of its own, so that a test
// can kill it (kill -9) at any instant and start it again.
//
//   stream_sync_test_peer receive RENDEZVOUS RANK SIZE OUT_FILE DIE_AT_SYNC TIMEOUT_MS
//   stream_sync_test_peer send RENDEZVOUS SIZE STEPS TIMEOUT_MS
//   stream_sync_test_peer shard TRAINER_RENDEZVOUS RANK START STEPS TIMEOUT_MS
//   stream_sync_test_peer ranks TRAINER_RENDEZVOUS STREAM_RENDEZVOUS RANK RANKS SIZE STEPS
//                               TIMEOUT_MS
//   stream_sync_test_peer shard-receive RENDEZVOUS RANK SIZE OUT_FILE DIE_AT_SYNC TIMEOUT_MS
//                                       STEPS
//
// receive: registers sync_test::Model's tensors whole and takes syncs until
// the test ends it. After each sync it applied, it writes every tensor's
// bytes back to back to OUT_FILE (through a rename). With DIE_AT_SYNC > 0 it
// SIGKILLs itself while applying the second entry of that sync.
//
// send: rank 0 of the group: syncs Model::Make(0) as it is, then after each
// of STEPS steps (Model::Step(1000 + k, 0.05), k = 1 .. STEPS), retrying a
// failed sync up to 5 times; exits 0 once every step is synced, 1 when a
// step could not be.
//
// shard: trainer rank RANK (1 .. 3) of the 4-rank sharded trainer of
// sync_test::RankSpecs, holding sync_test::ShardedModel(9) after step
// min(k, STEPS) for k = START .. STEPS + 3 (ShardedModel's Step(3000 + i,
// 0.05) for i = 1 .. k): one sync a step, as a trainer syncs after each
// step whatever became of the last one, and three more of the last step's
// model, which repair any that failed. Exits 0.
//
// ranks: trainer rank RANK of the RANKS-rank (4 or 2) sharded trainer of
// sync_test::RankSpecs(RANK, RANKS), rank 0 leading the stream group of SIZE
// members: syncs the model after step k = 0 .. STEPS (as shard makes it),
// retrying a failed step up to 8 times (every rank learns of a failure, so
// all retry together); exits 0 once every step is synced, 1 otherwise.
//
// shard-receive: as receive, holding the sharded trainer's model whole;
// after each sync it applied it appends "SYNC_ID K" to OUT_FILE, K the step
// 0 .. STEPS whose model it now holds bit for bit, or -1 for none.
//
// Exits 2 for bad usage.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>

#include "comm/communicator_test_util.h"
#include "stream/sync_test_util.h"

namespace {

using namespace deltasync;

int Usage() {
  std::fprintf(stderr,
               "usage: stream_sync_test_peer receive RENDEZVOUS RANK SIZE OUT_FILE DIE_AT_SYNC "
               "TIMEOUT_MS\n"
               "       stream_sync_test_peer send RENDEZVOUS SIZE STEPS TIMEOUT_MS\n"
               "       stream_sync_test_peer shard TRAINER_RENDEZVOUS RANK START STEPS "
               "TIMEOUT_MS\n"
               "       stream_sync_test_peer ranks TRAINER_RENDEZVOUS STREAM_RENDEZVOUS RANK RANKS "
               "SIZE STEPS TIMEOUT_MS\n"
               "       stream_sync_test_peer shard-receive RENDEZVOUS RANK SIZE OUT_FILE "
               "DIE_AT_SYNC TIMEOUT_MS STEPS\n");
  return 2;
}

// A receiver of the group "sync" holding `m`'s tensors whole, SIGKILLing
// itself while applying the second entry of sync `die_at` (0: never); takes
// syncs for ever, calling after(stats) for each it applied (a failed one,
// a lost group, is waited out: a new group forms when the sender syncs
// again, and the test ends this process). 2 when it cannot start; what
// after returns when not 0.
int ReceiveForEver(const Rendezvous& where, int rank, int size, uint64_t die_at, int timeout_ms,
                   sync_test::Model& m, const std::function<int(const ReceiveStats&)>& after) {
  const CommunicatorOptions o =
      comm_test::LoopbackOptions(where, rank, size, std::chrono::milliseconds(timeout_ms), "sync");
  ReceiverOptions options;
  options.apply_hook = [die_at](uint64_t sync_id, std::string_view, uint64_t entry) {
    if (die_at != 0 && sync_id == die_at && entry == 1) kill(getpid(), SIGKILL);
    return Status::OK();
  };
  Result<std::unique_ptr<StreamReceiver>> r =
      StreamReceiver::Create([o] { return CreateCommunicator("gloo", o); }, options);
  if (!r.ok()) return 2;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    Status s =
        (*r)->Register(m.tensors[i].name, m.tensors[i].dtype, m.tensors[i].shape, m.bytes[i]);
    if (!s.ok()) return 2;
  }
  for (;;) {
    Result<ReceiveStats> got = (*r)->ReceiveSync();
    if (!got.ok()) {
      std::fprintf(stderr, "stream_sync_test_peer: %s\n", got.status().ToString().c_str());
      continue;
    }
    if (const int rc = after(*got); rc != 0) return rc;
  }
}

int Receive(const Rendezvous& where, int rank, int size, const std::string& out, uint64_t die_at,
            int timeout_ms) {
  sync_test::Model m = sync_test::Model::Make(0);
  return ReceiveForEver(where, rank, size, die_at, timeout_ms, m, [&](const ReceiveStats&) {
    const std::string tmp = out + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return 1;
    for (const std::vector<uint8_t>& b : m.bytes) {
      if (!b.empty()) std::fwrite(b.data(), 1, b.size(), f);
    }
    std::fclose(f);
    std::rename(tmp.c_str(), out.c_str());
    return 0;
  });
}

int Send(const Rendezvous& where, int size, int steps, int timeout_ms) {
  const CommunicatorOptions o =
      comm_test::LoopbackOptions(where, 0, size, std::chrono::milliseconds(timeout_ms), "sync");
  Result<std::unique_ptr<StreamSender>> s =
      StreamSender::Create([o] { return CreateCommunicator("gloo", o); });
  if (!s.ok()) return 2;
  sync_test::Model m = sync_test::Model::Make(0);
  for (int k = 0; k <= steps; ++k) {
    if (k > 0) m.Step(1000 + k, 0.05);
    Status last;
    for (int attempt = 0; attempt < 5; ++attempt) {
      Result<SyncStats> r = (*s)->Sync(m.tensors);
      last = r.ok() ? Status::OK() : r.status();
      if (r.ok()) break;
    }
    if (!last.ok()) {
      std::fprintf(stderr, "stream_sync_test_peer send: step %d: %s\n", k, last.ToString().c_str());
      return 1;
    }
  }
  return 0;
}

// Syncs of the last step's model after the last step.
constexpr int kRepairSyncs = 3;

// The sharded trainer's model after step k (k = 0: as made).
sync_test::Model ShardedStep(int k) {
  sync_test::Model m = sync_test::ShardedModel(9);
  for (int i = 1; i <= k; ++i) m.Step(3000 + i, 0.05);
  return m;
}

int Shard(const Rendezvous& trainers, int rank, int start, int steps, int timeout_ms) {
  const CommunicatorOptions o = comm_test::LoopbackOptions(
      trainers, rank, 4, std::chrono::milliseconds(timeout_ms), "trainers");
  Result<std::unique_ptr<StreamSender>> s =
      StreamSender::CreateSharded([o] { return CreateCommunicator("gloo", o); }, nullptr);
  if (!s.ok()) return 2;
  const std::vector<ShardSpec> specs = sync_test::RankSpecs(rank);
  for (int k = start; k <= steps + kRepairSyncs; ++k) {
    const sync_test::Model m = ShardedStep(std::min(k, steps));
    std::vector<ModelTensor> model;
    for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
    std::vector<std::vector<uint8_t>> bytes;
    std::vector<ShardedTensor> shards;
    for (const ShardSpec& spec : specs) bytes.push_back(sync_test::Extract(spec, m));
    for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[i], {}});
    Result<SyncStats> r = (*s)->SyncShards(model, shards);
    if (!r.ok()) {
      std::fprintf(stderr, "stream_sync_test_peer shard: step %d: %s\n", k,
                   r.status().ToString().c_str());
    }
  }
  return 0;
}

int Ranks(const Rendezvous& trainers, const Rendezvous& stream, int rank, int ranks, int size,
          int steps, int timeout_ms) {
  const CommunicatorOptions o = comm_test::LoopbackOptions(
      trainers, rank, ranks, std::chrono::milliseconds(timeout_ms), "trainers");
  const CommunicatorOptions so =
      comm_test::LoopbackOptions(stream, 0, size, std::chrono::milliseconds(timeout_ms), "sync");
  CommunicatorFactory lead;
  if (rank == 0) lead = [so] { return CreateCommunicator("gloo", so); };
  Result<std::unique_ptr<StreamSender>> s =
      StreamSender::CreateSharded([o] { return CreateCommunicator("gloo", o); }, lead);
  if (!s.ok()) return 2;
  const std::vector<ShardSpec> specs = sync_test::RankSpecs(rank, ranks);
  for (int k = 0; k <= steps; ++k) {
    const sync_test::Model m = ShardedStep(k);
    std::vector<ModelTensor> model;
    for (const SyncTensor& t : m.tensors) model.push_back({t.name, t.dtype, t.shape});
    std::vector<std::vector<uint8_t>> bytes;
    std::vector<ShardedTensor> shards;
    for (const ShardSpec& spec : specs) bytes.push_back(sync_test::Extract(spec, m));
    for (size_t i = 0; i < specs.size(); ++i) shards.push_back({specs[i], bytes[i], {}});
    Status last;
    for (int attempt = 0; attempt < 8; ++attempt) {
      Result<SyncStats> r = (*s)->SyncShards(model, shards);
      last = r.ok() ? Status::OK() : r.status();
      if (r.ok()) break;
      std::fprintf(stderr, "stream_sync_test_peer ranks: rank %d step %d: %s\n", rank, k,
                   last.ToString().c_str());
    }
    if (!last.ok()) return 1;
  }
  return 0;
}

int ShardReceive(const Rendezvous& where, int rank, int size, const std::string& out,
                 uint64_t die_at, int timeout_ms, int steps) {
  sync_test::Model m = sync_test::ShardedModel(9);
  // Nothing of the trainer's yet.
  for (std::vector<uint8_t>& b : m.bytes) std::fill(b.begin(), b.end(), uint8_t{0});
  std::vector<sync_test::Model> want;
  for (int k = 0; k <= steps; ++k) want.push_back(ShardedStep(k));
  return ReceiveForEver(where, rank, size, die_at, timeout_ms, m, [&](const ReceiveStats& got) {
    int held = -1;
    for (int k = 0; k <= steps && held < 0; ++k) {
      if (want[k].bytes == m.bytes) held = k;
    }
    FILE* f = std::fopen(out.c_str(), "a");
    if (f == nullptr) return 1;
    std::fprintf(f, "%llu %d\n", static_cast<unsigned long long>(got.sync_id), held);
    std::fclose(f);
    return 0;
  });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string role = argv[1];
  if ((role == "receive" && argc != 8) || (role == "send" && argc != 6) ||
      (role == "shard" && argc != 7) || (role == "ranks" && argc != 9) ||
      (role == "shard-receive" && argc != 9) ||
      (role != "receive" && role != "send" && role != "shard" && role != "ranks" &&
       role != "shard-receive")) {
    return Usage();
  }
  Result<Rendezvous> where = ParseRendezvous(argv[2]);
  if (!where.ok()) {
    std::fprintf(stderr, "%s\n", where.status().ToString().c_str());
    return 2;
  }
  if (role == "receive") {
    return Receive(*where, std::atoi(argv[3]), std::atoi(argv[4]), argv[5],
                   std::strtoull(argv[6], nullptr, 10), std::atoi(argv[7]));
  }
  if (role == "ranks") {
    Result<Rendezvous> stream = ParseRendezvous(argv[3]);
    if (!stream.ok()) return 2;
    return Ranks(*where, *stream, std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]),
                 std::atoi(argv[7]), std::atoi(argv[8]));
  }
  if (role == "shard-receive") {
    return ShardReceive(*where, std::atoi(argv[3]), std::atoi(argv[4]), argv[5],
                        std::strtoull(argv[6], nullptr, 10), std::atoi(argv[7]),
                        std::atoi(argv[8]));
  }
  if (role == "shard") {
    return Shard(*where, std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]),
                 std::atoi(argv[6]));
  }
  return Send(*where, std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]));
}
