#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "agent/agent_test_util.h"
#include "deltasync/agent.h"

namespace deltasync {
namespace {

using nlohmann::json;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class CommandReloaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/reloader_test_" + std::to_string(::getpid());
    ::mkdir(dir_.c_str(), 0755);
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::string dir_;
};

TEST_F(CommandReloaderTest, PassesPathAndVersionAsArgumentsAndEnvironment) {
  const std::string out = dir_ + "/out.txt";
  // The command carries its own argument; ours come after it.
  const std::string script = dir_ + "/reload.sh";
  {
    std::ofstream s(script);
    s << "#!/bin/sh\nprintf '%s|%s|%s|%s|%s' \"$1\" \"$2\" \"$3\" \"$DELTASYNC_MODEL_PATH\" "
         "\"$DELTASYNC_WEIGHT_VERSION\" > '"
      << out << "'\n";
  }
  ::chmod(script.c_str(), 0755);
  Result<std::unique_ptr<EngineReloader>> reloader = MakeCommandReloader(script + " --flag");
  ASSERT_TRUE(reloader.ok()) << reloader.status().ToString();
  const std::string local = dir_ + "/local ckpt; $(touch pwned)";
  Status s = (*reloader)->Reload(local, 42);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(ReadAll(out), "--flag|" + local + "|42|" + local + "|42");
  // The path went through as data, never as shell text.
  EXPECT_FALSE(std::ifstream(dir_ + "/pwned").good());
  EXPECT_FALSE(std::ifstream("pwned").good());
}

TEST_F(CommandReloaderTest, NonZeroExitFails) {
  Result<std::unique_ptr<EngineReloader>> reloader = MakeCommandReloader("exit 3 #");
  ASSERT_TRUE(reloader.ok());
  Status s = (*reloader)->Reload(dir_, 1);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("status 3"), std::string::npos) << s.message();
}

TEST_F(CommandReloaderTest, TimeoutKillsTheCommand) {
  Result<std::unique_ptr<EngineReloader>> reloader = MakeCommandReloader("sleep 5 #", 0.2);
  ASSERT_TRUE(reloader.ok());
  const auto start = std::chrono::steady_clock::now();
  Status s = (*reloader)->Reload(dir_, 1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("timed out"), std::string::npos) << s.message();
}

TEST(CommandReloaderCreateTest, RejectsBadArguments) {
  EXPECT_FALSE(MakeCommandReloader("").ok());
  EXPECT_FALSE(MakeCommandReloader("  ").ok());
  EXPECT_FALSE(MakeCommandReloader("true", 0).ok());
  EXPECT_FALSE(MakeHttpReloader("ftp://x:1/").ok());
  EXPECT_FALSE(MakeHttpReloader("http://127.0.0.1:1/u", -1).ok());
}

TEST(HttpReloaderTest, PostsSglangsBody) {
  testing_agent::LoopbackServer engine;
  json received;
  std::string content_type;
  int answer_status = 200;
  std::string answer_body = R"({"success": true, "message": "ok"})";
  engine.server().Post("/update_weights_from_disk",
                       [&](const httplib::Request& req, httplib::Response& res) {
                         received = json::parse(req.body, nullptr, false);
                         content_type = req.get_header_value("Content-Type");
                         res.status = answer_status;
                         res.set_content(answer_body, "application/json");
                       });
  ASSERT_GT(engine.Start(), 0);
  Result<std::unique_ptr<EngineReloader>> reloader =
      MakeHttpReloader(engine.url() + "/update_weights_from_disk", 5);
  ASSERT_TRUE(reloader.ok());
  Status s = (*reloader)->Reload("/nvme/ckpt", 7);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(received["model_path"], "/nvme/ckpt");
  EXPECT_EQ(received["weight_version"], "7");
  EXPECT_EQ(content_type, "application/json");

  answer_body = R"({"success": false, "message": "shape mismatch"})";
  s = (*reloader)->Reload("/nvme/ckpt", 8);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("shape mismatch"), std::string::npos) << s.message();

  answer_status = 500;
  answer_body = "internal error";
  s = (*reloader)->Reload("/nvme/ckpt", 9);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("500"), std::string::npos) << s.message();

  engine.Stop();
  s = (*reloader)->Reload("/nvme/ckpt", 10);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIOError);
}

}  // namespace
}  // namespace deltasync
