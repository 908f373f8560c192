// The nccl communicator on one GPU: forming a group of one, every
// operation on device memory and on host memory (staged through the
// device), and the error paths (a bad device, a bad peer, a member that
// never comes). Two real ranks: tests/gpu/stream_nccl_test.cc. Skips
// without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "comm/communicator_test_util.h"
#include "deltasync/communicator.h"
#include "tests/gpu/nccl_pair.h"

namespace deltasync {
namespace {

using namespace std::chrono_literals;
using nccl_pair::DeviceBytes;
using Clock = std::chrono::steady_clock;

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_pair::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }

  CommunicatorOptions Options(int rank, int size) const {
    return comm_test::LoopbackOptions(comm_test::FileRendezvous(dir_.path()), rank, size, 5000ms,
                                      "nccl");
  }

  comm_test::TempDir dir_;
};

TEST_F(NcclTest, AGroupOfOneRunsEveryOperationOnDeviceMemory) {
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("nccl", Options(0, 1));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Communicator& comm = **c;
  EXPECT_EQ(comm.name(), "nccl");
  EXPECT_TRUE(comm.capabilities().device_buffers);
  EXPECT_TRUE(comm.capabilities().host_buffers);
  EXPECT_FALSE(comm.capabilities().checks_sizes);

  const std::vector<uint8_t> bytes = comm_test::PatternBytes(1, (1 << 20) + 3);
  DeviceBytes data(bytes.size());
  ASSERT_TRUE(data.Upload(bytes));
  Status s = comm.Broadcast(0, data.span());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(data.Download(), bytes);
  s = comm.Barrier();
  ASSERT_TRUE(s.ok()) << s.ToString();

  DeviceBytes record(64), out(64);
  ASSERT_TRUE(record.Upload(comm_test::PatternBytes(2, 64)));
  s = comm.AllGather(record.span(), out.span());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(out.Download(), comm_test::PatternBytes(2, 64));
  ASSERT_TRUE(out.Upload(std::vector<uint8_t>(64)));
  s = comm.Gather(0, record.span(), out.span());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(out.Download(), comm_test::PatternBytes(2, 64));
  EXPECT_TRUE(comm.health().ok());
}

TEST_F(NcclTest, AGroupOfOneRunsEveryOperationOnHostMemory) {
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("nccl", Options(0, 1));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Communicator& comm = **c;
  // More than one of the communicator's 64 MiB calls.
  const std::vector<uint8_t> bytes = comm_test::PatternBytes(1, (size_t{64} << 20) + 7);
  std::vector<uint8_t> data = bytes;
  Status s = comm.Broadcast(0, data);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(data, bytes);

  const std::vector<uint8_t> record = comm_test::PatternBytes(2, 100);
  std::vector<uint8_t> out(100);
  s = comm.AllGather(record, out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(out, record);
  // A host record into a device output, and the other way round.
  DeviceBytes dev_out(100);
  s = comm.Gather(0, record, dev_out.span());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(dev_out.Download(), record);
  std::vector<uint8_t> host_out(100);
  s = comm.Gather(0, dev_out.span(), host_out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(host_out, record);
  EXPECT_TRUE(comm.health().ok());
}

TEST_F(NcclTest, BadArgumentsAreRefusedAndLeaveItUsable) {
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("nccl", Options(0, 1));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Communicator& comm = **c;
  DeviceBytes dev(64);
  Status s = comm.Send(0, dev.span());
  EXPECT_TRUE(Contains(s, "nccl send: peer rank 0 is this rank")) << s.ToString();
  s = comm.Recv(3, dev.span());
  EXPECT_TRUE(Contains(s, "nccl recv: peer rank 3 is outside the group of 1")) << s.ToString();
  s = comm.Broadcast(1, dev.span());
  EXPECT_TRUE(Contains(s, "root rank 1 is outside the group of 1")) << s.ToString();
  s = comm.AllGather(dev.span().first(8), dev.span());
  EXPECT_TRUE(Contains(s, "nccl all-gather: out is 64 bytes, expected 8")) << s.ToString();
  EXPECT_TRUE(comm.health().ok());
  EXPECT_TRUE(comm.Barrier().ok());
}

TEST_F(NcclTest, ABadDeviceOrRankIsInvalidArgument) {
  CommunicatorOptions o = Options(0, 1);
  o.cuda_device = 1000;
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("nccl", o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status(), "nccl: cuda_device 1000 is not one of this host's"))
      << c.status().ToString();
  c = CreateCommunicator("nccl", Options(2, 2));
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(Contains(c.status(), "nccl: rank 2 is outside the group of 2"))
      << c.status().ToString();
}

TEST_F(NcclTest, AMemberThatNeverComesIsDeadlineExceededWithinTheConnectTimeout) {
  // Rank 0 of two publishes NCCL's unique id and waits in NCCL's bootstrap
  // for rank 1, which never starts: the wait ends at the connect timeout
  // and the half-formed communicator is aborted.
  CommunicatorOptions o = Options(0, 2);
  o.connect_timeout = 1500ms;
  const auto start = Clock::now();
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("nccl", o);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().ToString();
  EXPECT_TRUE(Contains(c.status(), "not every member joined within 1500 ms"))
      << c.status().ToString();
  EXPECT_LT(took, 1500ms + 3000ms);  // the abort itself may take a moment
  // The device is still good for a new group.
  CommunicatorOptions one = Options(0, 1);
  one.group = "nccl-after";
  EXPECT_TRUE(CreateCommunicator("nccl", one).ok());
}

}  // namespace
}  // namespace deltasync
