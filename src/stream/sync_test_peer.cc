// A receiver of the stream sync tests as a process of its own, so that a
// test can kill it (kill -9) mid-sync and start it again.
//
//   stream_sync_test_peer RENDEZVOUS RANK SIZE OUT_FILE DIE_AT_SYNC TIMEOUT_MS
//
// Registers sync_test::Model's tensors whole and takes syncs until the
// sender is gone. After each sync it applied, it writes every tensor's bytes
// back to back to OUT_FILE (through a rename). With DIE_AT_SYNC > 0 it
// SIGKILLs itself while applying the second entry of that sync. Exits 0
// once the sender has gone, 2 for bad usage.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "stream/communicator_test_util.h"
#include "stream/sync_test_util.h"

int main(int argc, char** argv) {
  using namespace deltasync;
  if (argc != 7) {
    std::fprintf(stderr,
                 "usage: stream_sync_test_peer RENDEZVOUS RANK SIZE OUT_FILE "
                 "DIE_AT_SYNC TIMEOUT_MS\n");
    return 2;
  }
  Result<Rendezvous> where = ParseRendezvous(argv[1]);
  if (!where.ok()) {
    std::fprintf(stderr, "%s\n", where.status().ToString().c_str());
    return 2;
  }
  const CommunicatorOptions o =
      comm_test::LoopbackOptions(*where, std::atoi(argv[2]), std::atoi(argv[3]),
                                 std::chrono::milliseconds(std::atoi(argv[6])), "sync");
  const std::string out = argv[4];
  const uint64_t die_at = std::strtoull(argv[5], nullptr, 10);
  ReceiverOptions options;
  options.apply_hook = [die_at](uint64_t sync_id, std::string_view, uint64_t entry) {
    if (die_at != 0 && sync_id == die_at && entry == 1) kill(getpid(), SIGKILL);
    return Status::OK();
  };
  Result<std::unique_ptr<StreamReceiver>> r =
      StreamReceiver::Create([o] { return CreateCommunicator("gloo", o); }, options);
  if (!r.ok()) return 2;
  sync_test::Model m = sync_test::Model::Make(0);
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    Status s =
        (*r)->Register(m.tensors[i].name, m.tensors[i].dtype, m.tensors[i].shape, m.bytes[i]);
    if (!s.ok()) return 2;
  }
  for (;;) {
    Result<ReceiveStats> got = (*r)->ReceiveSync();
    if (!got.ok()) {
      // A lost group: the sender has gone, or failed a sync; a new one forms
      // when it syncs again, and the test ends this process otherwise.
      std::fprintf(stderr, "stream_sync_test_peer: %s\n", got.status().ToString().c_str());
      continue;
    }
    const std::string tmp = out + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return 1;
    for (const std::vector<uint8_t>& b : m.bytes) {
      if (!b.empty()) std::fwrite(b.data(), 1, b.size(), f);
    }
    std::fclose(f);
    std::rename(tmp.c_str(), out.c_str());
  }
}
