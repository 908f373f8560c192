// Rank 1 of the two-rank nccl tests (stream_nccl_test.cc), as a process of
// its own (tests/gpu/nccl_pair.h says why). Usage:
//   stream_nccl_peer collectives DIR TIMEOUT_MS
//       the counterpart of the test's calls: host and device buffers
//       against the other memory on rank 0, calls of more than one NCCL
//       chunk; checks what it receives; exits 0 when all held.
//   stream_nccl_peer receiver DIR OUT_FILE DIE_AT_SYNC TIMEOUT_MS [all]
//       a stream receiver of sync_test::Model's tensors (in device memory
//       but "b.bias"; with "all", every one of nccl_pair::DeviceFrameSpecs,
//       and then every frame must arrive in device memory); after each sync it applied it writes
//       every tensor's bytes back to back to OUT_FILE (through a rename).
//       With DIE_AT_SYNC > 0 it SIGKILLs itself while applying the second
//       entry of that sync. Runs until killed.
// Exits 1 with the error on stderr when a check fails, 2 for bad usage.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/gpu/nccl_pair.h"

namespace {

using namespace deltasync;
namespace ct = deltasync::comm_test;
using nccl_pair::DeviceBytes;

int Fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "stream_nccl_peer: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

#define PEER_CHECK(what, expr)                   \
  do {                                           \
    const Status peer_s = (expr);                \
    if (!peer_s.ok()) return Fail(what, peer_s); \
  } while (0)

int Collectives(const std::string& dir, std::chrono::milliseconds timeout) {
  Result<std::unique_ptr<Communicator>> c =
      CreateCommunicator("nccl", nccl_pair::PairOptions(dir, 1, timeout));
  if (!c.ok()) return Fail("forming", c.status());
  Communicator& comm = **c;

  DeviceBytes big(nccl_pair::kBigBytes);
  if (!big.ok()) return Fail("cudaMalloc", Status::Internal("no device memory"));
  PEER_CHECK("recv into device", comm.Recv(0, big.span()));
  PEER_CHECK("recv into device", ct::ExpectPattern(big.Download(), 1, "recv"));
  if (!big.Upload(ct::PatternBytes(2, nccl_pair::kBigBytes))) return 1;
  PEER_CHECK("send from device", comm.Send(0, big.span()));

  DeviceBytes bcast(nccl_pair::kBroadcastBytes);
  PEER_CHECK("broadcast into device", comm.Broadcast(0, bcast.span()));
  PEER_CHECK("broadcast into device", ct::ExpectPattern(bcast.Download(), 3, "broadcast"));
  std::vector<uint8_t> host = ct::PatternBytes(4, nccl_pair::kBroadcastBytes);
  PEER_CHECK("broadcast from host", comm.Broadcast(1, host));

  DeviceBytes record(nccl_pair::kRecordBytes), out(2 * nccl_pair::kRecordBytes);
  if (!record.Upload(ct::PatternBytes(11, nccl_pair::kRecordBytes))) return 1;
  PEER_CHECK("all-gather on device", comm.AllGather(record.span(), out.span()));
  std::vector<uint8_t> want = ct::PatternBytes(10, nccl_pair::kRecordBytes);
  const std::vector<uint8_t> mine = ct::PatternBytes(11, nccl_pair::kRecordBytes);
  want.insert(want.end(), mine.begin(), mine.end());
  if (out.Download() != want) {
    return Fail("all-gather on device", Status::Corruption("the gathered records differ"));
  }
  std::vector<uint8_t> host_record = ct::PatternBytes(21, nccl_pair::kRecordBytes);
  PEER_CHECK("gather from host", comm.Gather(0, host_record, {}));
  PEER_CHECK("barrier", comm.Barrier());
  return 0;
}

// sync_test::Model's tensors, where the receiver holds them.
struct Held {
  sync_test::Model model;
  std::vector<std::unique_ptr<DeviceBytes>> device;

  // Every tensor's bytes back to back, from wherever it lives.
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> all;
    for (size_t i = 0; i < model.tensors.size(); ++i) {
      const std::vector<uint8_t> b = device[i] ? device[i]->Download() : model.bytes[i];
      all.insert(all.end(), b.begin(), b.end());
    }
    return all;
  }
};

int Receiver(const std::string& dir, const std::string& out, uint64_t die_at,
             std::chrono::milliseconds timeout, bool all_device) {
  const CommunicatorOptions o = nccl_pair::PairOptions(dir, 1, timeout, "stream");
  ReceiverOptions options;
  options.apply_hook = [die_at](uint64_t sync_id, std::string_view, uint64_t entry) {
    if (die_at != 0 && sync_id == die_at && entry == 1) kill(getpid(), SIGKILL);
    return Status::OK();
  };
  Result<std::unique_ptr<StreamReceiver>> r =
      StreamReceiver::Create([o] { return CreateCommunicator("nccl", o); }, options);
  if (!r.ok()) return Fail("receiver", r.status());
  Held held{all_device ? sync_test::Model::Make(0, nccl_pair::DeviceFrameSpecs())
                       : sync_test::Model::Make(0),
            {}};
  for (size_t i = 0; i < held.model.tensors.size(); ++i) {
    const SyncTensor& t = held.model.tensors[i];
    std::span<uint8_t> dest = held.model.bytes[i];
    Placement place;
    held.device.emplace_back();
    if (all_device || nccl_pair::OnDevice(t.name)) {
      held.device.back() = std::make_unique<DeviceBytes>(dest.size());
      if (!held.device.back()->ok()) return Fail("cudaMalloc", Status::Internal(t.name));
      dest = held.device.back()->span();
      place = Placement::Cuda(0);
    }
    PEER_CHECK("register " + t.name, (*r)->Register(t.name, t.dtype, t.shape, dest, {}, place));
  }
  for (;;) {
    Result<ReceiveStats> got = (*r)->ReceiveSync();
    if (!got.ok()) {
      // The sender failed a sync or has gone; the group forms again when
      // it syncs again, and the test ends this process otherwise.
      std::fprintf(stderr, "stream_nccl_peer: %s\n", got.status().ToString().c_str());
      continue;
    }
    if (all_device && got->device_frames != got->frames) {
      return Fail("receiving", Status::Internal(std::to_string(got->frames - got->device_frames) +
                                                " of the sync's frames were taken into host "
                                                "memory"));
    }
    const std::vector<uint8_t> bytes = held.Bytes();
    const std::string tmp = out + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return 1;
    if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    std::rename(tmp.c_str(), out.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  nccl_pair::BecomeRank(1);
  const std::string scenario = argc > 1 ? argv[1] : "";
  if (scenario == "collectives" && argc == 4) {
    return Collectives(argv[2], std::chrono::milliseconds(std::atoi(argv[3])));
  }
  if (scenario == "receiver" && (argc == 6 || (argc == 7 && std::string(argv[6]) == "all"))) {
    return Receiver(argv[2], argv[3], std::strtoull(argv[4], nullptr, 10),
                    std::chrono::milliseconds(std::atoi(argv[5])), argc == 7);
  }
  std::fprintf(stderr,
               "usage: stream_nccl_peer collectives DIR TIMEOUT_MS\n"
               "       stream_nccl_peer receiver DIR OUT_FILE DIE_AT_SYNC TIMEOUT_MS [all]\n");
  return 2;
}
