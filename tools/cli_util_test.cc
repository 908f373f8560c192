// The CLI's own helpers, tested directly: how it writes seconds for people,
// and the per-run names of `bench --stream`'s shaped links (making them
// needs root, so only their generation is tested here).
#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>

#include "bench_stream.h"
#include "cli_util.h"

namespace deltasync::cli {
namespace {

TEST(CliUtil, FormatSecondsKeepsThreeSignificantDigits) {
  EXPECT_EQ(FormatSeconds(0.0834327), "0.0834 s");
  EXPECT_EQ(FormatSeconds(0.5), "0.500 s");
  EXPECT_EQ(FormatSeconds(2.3449), "2.34 s");
  EXPECT_EQ(FormatSeconds(12.345), "12.3 s");
  EXPECT_EQ(FormatSeconds(184.2), "184 s");
  // Never coarser than a second, nor finer than a microsecond.
  EXPECT_EQ(FormatSeconds(4321.4), "4321 s");
  EXPECT_EQ(FormatSeconds(0.0000012345), "0.000001 s");
  EXPECT_EQ(FormatSeconds(0), "0.00 s");
}

TEST(CliUtil, StreamBenchNetNamesAreTheRunsOwnAndFitInterfaceNames) {
  std::set<std::string> seen;
  for (int64_t pid : {int64_t{1}, int64_t{4242}, int64_t{4194304}, int64_t{99999999}}) {
    const StreamBenchNet net = StreamBenchNetFor(pid);
    const std::string id = std::to_string(pid);
    EXPECT_EQ(net.ns, "dsbench-" + id);
    EXPECT_EQ(net.ReceiverNs(3), "dsbench-" + id + "-r3");
    EXPECT_NE(net.host_veth.find(id), std::string::npos) << net.host_veth;
    // IFNAMSIZ is 16 with the terminating NUL.
    EXPECT_LE(net.host_veth.size(), 15u) << net.host_veth;
    for (const std::string& name : {net.ns, net.host_veth, net.ReceiverNs(1), net.ReceiverNs(2)}) {
      EXPECT_TRUE(seen.insert(name).second) << name << " is another run's too";
    }
  }
  EXPECT_EQ(StreamBenchNetFor(4242).ns, StreamBenchNetFor(4242, 3).ns);  // same run, same names
}

// "10.77.A.B" -> A * 256 + B; -1 when it is not in 10.77.0.0/16.
int HostIndex(const std::string& address) {
  unsigned a = 0, b = 0;
  char rest = 0;
  if (std::sscanf(address.c_str(), "10.77.%u.%u%c", &a, &b, &rest) != 2 || a > 255 || b > 255) {
    return -1;
  }
  return static_cast<int>(a * 256 + b);
}

TEST(CliUtil, StreamBenchNetAddressesAreASlash24OfTheirOwn) {
  std::set<int> subnets;
  for (int64_t pid : {int64_t{100}, int64_t{101}, int64_t{102}, int64_t{4194303}}) {
    for (int attempt : {0, 1}) {
      const StreamBenchNet net = StreamBenchNetFor(pid, attempt);
      EXPECT_EQ(net.prefix_length, 24);
      const int sender = HostIndex(net.sender_address);
      ASSERT_GE(sender, 0) << net.sender_address;
      EXPECT_EQ(sender % 256, 1) << net.sender_address;
      std::set<int> hosts = {sender};
      for (int i = 1; i <= 64; ++i) {
        const int receiver = HostIndex(net.ReceiverAddress(i));
        ASSERT_GE(receiver, 0) << net.ReceiverAddress(i);
        EXPECT_EQ(receiver / 256, sender / 256) << net.ReceiverAddress(i);  // one /24
        EXPECT_TRUE(hosts.insert(receiver).second) << net.ReceiverAddress(i);
        EXPECT_LT(receiver % 256, 255);  // not the broadcast address
      }
      subnets.insert(sender / 256);
    }
  }
  // Neighbouring pids and the next attempt take other /24s (pid + attempt
  // overlap between neighbours: 100+1 is 101+0).
  EXPECT_GE(subnets.size(), 5u);
  EXPECT_NE(StreamBenchNetFor(100).sender_address, StreamBenchNetFor(101).sender_address);
  EXPECT_NE(StreamBenchNetFor(100).sender_address, StreamBenchNetFor(100, 1).sender_address);
}

}  // namespace
}  // namespace deltasync::cli
