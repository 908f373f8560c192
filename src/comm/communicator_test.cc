// The communicator factory and what every communicator refuses before it
// touches a store or the network: names, options, rendezvous specs.
#include "deltasync/communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace deltasync {
namespace {

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

bool Built(std::string_view name) {
  const std::vector<std::string_view> built = BuiltCommunicators();
  return std::find(built.begin(), built.end(), name) != built.end();
}

CommunicatorOptions Valid() {
  CommunicatorOptions o;
  o.rendezvous = *ParseRendezvous("file:/nonexistent-never-used");
  return o;
}

TEST(RendezvousSpec, ParsesBothKindsAndPrintsThemBack) {
  Result<Rendezvous> f = ParseRendezvous("file:/shared/rdv");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->kind, Rendezvous::Kind::kFile);
  EXPECT_EQ(f->path, "/shared/rdv");
  EXPECT_EQ(RendezvousSpec(*f), "file:/shared/rdv");

  Result<Rendezvous> r = ParseRendezvous("redis:10.0.0.7:7000");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, Rendezvous::Kind::kRedis);
  EXPECT_EQ(r->host, "10.0.0.7");
  EXPECT_EQ(r->port, 7000);
  EXPECT_EQ(RendezvousSpec(*r), "redis:10.0.0.7:7000");

  Result<Rendezvous> d = ParseRendezvous("redis:cache");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->port, 6379);
}

// Every form the docs show: the URL forms ("redis://host:port",
// "file:///dir") read as the plain ones.
TEST(RendezvousSpec, ReadsEveryDocumentedForm) {
  struct Case {
    const char* spec;
    Rendezvous::Kind kind;
    const char* where;  // the path, or the host
    int port;
    const char* printed;
  };
  const Case cases[] = {
      {"file:/shared/rdv", Rendezvous::Kind::kFile, "/shared/rdv", 0, "file:/shared/rdv"},
      {"file:///shared/rdv", Rendezvous::Kind::kFile, "/shared/rdv", 0, "file:/shared/rdv"},
      {"file://localhost/shared/rdv", Rendezvous::Kind::kFile, "/shared/rdv", 0,
       "file:/shared/rdv"},
      {"file:relative/rdv", Rendezvous::Kind::kFile, "relative/rdv", 0, "file:relative/rdv"},
      {"redis:10.0.0.7:7000", Rendezvous::Kind::kRedis, "10.0.0.7", 7000, "redis:10.0.0.7:7000"},
      {"redis://10.0.0.7:7000", Rendezvous::Kind::kRedis, "10.0.0.7", 7000, "redis:10.0.0.7:7000"},
      {"redis://127.0.0.1:6380/", Rendezvous::Kind::kRedis, "127.0.0.1", 6380,
       "redis:127.0.0.1:6380"},
      {"redis://cache", Rendezvous::Kind::kRedis, "cache", 6379, "redis:cache:6379"},
      {"redis:cache", Rendezvous::Kind::kRedis, "cache", 6379, "redis:cache:6379"},
      {"redis://[::1]:7001", Rendezvous::Kind::kRedis, "::1", 7001, "redis:[::1]:7001"},
  };
  for (const Case& c : cases) {
    Result<Rendezvous> r = ParseRendezvous(c.spec);
    ASSERT_TRUE(r.ok()) << c.spec << ": " << r.status().ToString();
    EXPECT_EQ(r->kind, c.kind) << c.spec;
    EXPECT_EQ(c.kind == Rendezvous::Kind::kFile ? r->path : r->host, c.where) << c.spec;
    if (c.kind == Rendezvous::Kind::kRedis) {
      EXPECT_EQ(r->port, c.port) << c.spec;
    }
    EXPECT_EQ(RendezvousSpec(*r), c.printed) << c.spec;
    Result<Rendezvous> again = ParseRendezvous(RendezvousSpec(*r));
    ASSERT_TRUE(again.ok()) << c.printed;
    EXPECT_EQ(RendezvousSpec(*again), c.printed);
  }
}

TEST(RendezvousSpec, RefusesWhatItCannotRead) {
  for (const char* bad :
       {"file:", "file://", "file://otherhost/x", "redis:", "redis://", "redis::6379", "redis:h:0",
        "redis:h:70000", "redis:h:12x", "redis://h:1/2", "redis://h:", "redis://[::1",
        "redis://::1:7", "etcd:h:1", ""}) {
    Result<Rendezvous> r = ParseRendezvous(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Contains(r.status(), std::string("rendezvous \"") + bad + "\"")) << bad;
    EXPECT_TRUE(Contains(r.status(),
                         "expected file:<directory>, file://<directory>, "
                         "redis:<host>[:<port>] or redis://<host>[:<port>]"))
        << r.status().ToString();
  }
  // A password never goes in a spec.
  Result<Rendezvous> pw = ParseRendezvous("redis://user:hunter2@cache:6379");
  ASSERT_FALSE(pw.ok());
  EXPECT_TRUE(Contains(pw.status(), "a password in the spec")) << pw.status().ToString();
}

TEST(CreateCommunicator, AnUnknownNameIsInvalidArgumentNamingTheKnownOnes) {
  Result<std::unique_ptr<Communicator>> c = CreateCommunicator("mpi", Valid());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status(), "unknown communicator \"mpi\" (known: gloo, nccl; built: "))
      << c.status().ToString();
  const std::vector<std::string_view> known = KnownCommunicators();
  EXPECT_EQ(known, (std::vector<std::string_view>{"gloo", "nccl"}));
}

TEST(CreateCommunicator, AKnownNameThisBuildLacksIsUnsupportedNamingWhatWasBuilt) {
  for (std::string_view name : KnownCommunicators()) {
    if (Built(name)) continue;
    Result<std::unique_ptr<Communicator>> c = CreateCommunicator(name, Valid());
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kUnsupported) << c.status().ToString();
    EXPECT_TRUE(Contains(
        c.status(), "communicator \"" + std::string(name) + "\" is not in this build (built: "))
        << c.status().ToString();
    for (std::string_view b : BuiltCommunicators()) {
      EXPECT_TRUE(Contains(c.status(), std::string(b))) << c.status().ToString();
    }
  }
}

TEST(CreateCommunicator, BadOptionsAreInvalidArgumentNamingTheProblem) {
  struct Case {
    std::function<void(CommunicatorOptions&)> change;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](CommunicatorOptions& o) { o.size = 0; }, "group size 0 (must be at least 1)"},
      {[](CommunicatorOptions& o) { o.rank = 1; }, "rank 1 is outside the group of 1"},
      {[](CommunicatorOptions& o) { o.rank = -1; }, "rank -1 is outside the group of 1"},
      {[](CommunicatorOptions& o) { o.group = "a/b"; }, "group name \"a/b\" must be non-empty"},
      {[](CommunicatorOptions& o) { o.group.clear(); }, "group name \"\" must be non-empty"},
      {[](CommunicatorOptions& o) { o.timeout = std::chrono::milliseconds(0); },
       "timeouts must be positive (timeout 0 ms"},
      {[](CommunicatorOptions& o) { o.connect_timeout = std::chrono::milliseconds(-5); },
       "timeouts must be positive (timeout 30000 ms, connect_timeout -5 ms)"},
      {[](CommunicatorOptions& o) { o.rendezvous.path.clear(); },
       "file rendezvous without a directory"},
      {[](CommunicatorOptions& o) {
         o.rendezvous.kind = Rendezvous::Kind::kRedis;
         // Moved in: assigning the literal trips a false -Wrestrict of GCC 12.
         o.rendezvous.host = std::string("h");
         o.rendezvous.port = 0;
       },
       "redis rendezvous needs a host and a port"},
  };
  for (std::string_view name : KnownCommunicators()) {
    for (const Case& c : cases) {
      CommunicatorOptions o = Valid();
      c.change(o);
      Result<std::unique_ptr<Communicator>> r = CreateCommunicator(name, o);
      ASSERT_FALSE(r.ok()) << c.message;
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
      EXPECT_TRUE(Contains(r.status(), std::string(name) + ": " + c.message))
          << r.status().ToString();
    }
  }
}

}  // namespace
}  // namespace deltasync
