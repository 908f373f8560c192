// One rank of a multi-process communicator test, started by
// gloo_communicator_test.cc as its own process (so that it can be killed
// with SIGKILL and started again). Usage:
//   communicator_test_peer SCENARIO RANK SIZE RENDEZVOUS GROUP TIMEOUT_MS
// Scenarios:
//   collectives  RunCollectivesScenario, as every other rank runs it;
//   gather       a barrier, then its record in a gather to rank 0;
//   idle         a barrier, then sleeps (the test kills it or lets it time
//                out); exits 0 after 20 s;
//   rejoin       forms the group (automatic generation) and takes broadcast
//                rounds from rank 0 until the last; forms it again whenever
//                a call fails, up to 5 times.
// Exits 0 when its part went as expected, 1 with the error on stderr
// otherwise, 2 for bad usage.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/communicator_test_util.h"

namespace {

using deltasync::Communicator;
using deltasync::CommunicatorOptions;
using deltasync::Result;
using deltasync::Status;
namespace ct = deltasync::comm_test;

int Fail(const std::string& scenario, int rank, const Status& s) {
  std::fprintf(stderr, "communicator_test_peer %s rank %d: %s\n", scenario.c_str(), rank,
               s.ToString().c_str());
  return 1;
}

int Rejoin(const CommunicatorOptions& options) {
  for (int formation = 0; formation < 5; ++formation) {
    Result<std::unique_ptr<Communicator>> c = deltasync::CreateCommunicator("gloo", options);
    if (!c.ok()) {
      std::fprintf(stderr, "rejoin rank %d: forming: %s\n", options.rank,
                   c.status().ToString().c_str());
      continue;
    }
    for (;;) {
      std::vector<uint8_t> round(ct::kRoundBytes);
      Status s = (*c)->Broadcast(0, round);
      if (!s.ok()) break;  // form again
      bool more = true;
      s = ct::CheckRound(round, &more);
      if (!s.ok()) return Fail("rejoin", options.rank, s);
      if (more) continue;
      // Leave only once every member is done: a member may still be
      // finishing its formation with this one (Gloo's two sides of a
      // connection see it made at different moments), and leaving now would
      // fail it.
      s = (*c)->Barrier();
      return s.ok() ? 0 : Fail("rejoin", options.rank, s);
    }
  }
  return Fail("rejoin", options.rank, Status::Aborted("gave up after 5 formations"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr,
                 "usage: communicator_test_peer SCENARIO RANK SIZE RENDEZVOUS GROUP TIMEOUT_MS\n");
    return 2;
  }
  const std::string scenario = argv[1];
  Result<deltasync::Rendezvous> where = deltasync::ParseRendezvous(argv[4]);
  if (!where.ok()) return Fail(scenario, -1, where.status());
  CommunicatorOptions options =
      ct::LoopbackOptions(*where, std::atoi(argv[2]), std::atoi(argv[3]),
                          std::chrono::milliseconds(std::atoi(argv[6])), argv[5]);
  if (scenario == "rejoin") return Rejoin(options);

  Result<std::unique_ptr<Communicator>> c = deltasync::CreateCommunicator("gloo", options);
  if (!c.ok()) return Fail(scenario, options.rank, c.status());
  Communicator& comm = **c;
  if (scenario == "collectives") {
    Status s = ct::RunCollectivesScenario(comm);
    return s.ok() ? 0 : Fail(scenario, options.rank, s);
  }
  if (scenario == "gather") {
    Status s = comm.Barrier();
    const std::vector<uint8_t> record = ct::PatternBytes(500 + options.rank, 16);
    if (s.ok()) s = comm.Gather(0, record, {});
    return s.ok() ? 0 : Fail(scenario, options.rank, s);
  }
  if (scenario == "idle") {
    Status s = comm.Barrier();
    if (!s.ok()) return Fail(scenario, options.rank, s);
    std::this_thread::sleep_for(std::chrono::seconds(20));
    return 0;
  }
  std::fprintf(stderr, "communicator_test_peer: unknown scenario %s\n", scenario.c_str());
  return 2;
}
