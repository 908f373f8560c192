#include "deltasync/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace deltasync {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = Status::Corruption("bad header");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.IsCorruption());
  EXPECT_EQ(s.message(), "bad header");
  EXPECT_EQ(s.ToString(), "Corruption: bad header");
}

TEST(StatusTest, CodesAreStable) {
  // These numbers are part of the external contract (exit codes, JSON).
  EXPECT_EQ(static_cast<int>(StatusCode::kInvalidArgument), 1);
  EXPECT_EQ(static_cast<int>(StatusCode::kNotFound), 2);
  EXPECT_EQ(static_cast<int>(StatusCode::kCorruption), 3);
  EXPECT_EQ(static_cast<int>(StatusCode::kIOError), 4);
  EXPECT_EQ(static_cast<int>(StatusCode::kOutOfRange), 5);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnsupported), 6);
  EXPECT_EQ(static_cast<int>(StatusCode::kInternal), 10);
  EXPECT_EQ(static_cast<int>(StatusCode::kDeadlineExceeded), 11);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 12);
  EXPECT_EQ(StatusCodeName(StatusCode::kDeadlineExceeded), "DeadlineExceeded");
  EXPECT_EQ(StatusCodeName(StatusCode::kUnavailable), "Unavailable");
  EXPECT_EQ(Status::Unavailable("x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(Status::DeadlineExceeded("x").code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(StatusCodeName(StatusCode::kOutOfRange), "OutOfRange");
}

TEST(StatusTest, WithContextPrefixes) {
  Status s = Status::NotFound("x").WithContext("file a.safetensors");
  EXPECT_EQ(s.message(), "file a.safetensors: x");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Status::OK().WithContext("ignored").ok());
}

TEST(StatusTest, FromErrno) {
  Status s = Status::FromErrno(ENOENT, "open /nope");
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("open /nope: "), std::string::npos);
  EXPECT_NE(s.message().find("No such file"), std::string::npos);
}

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  DS_ASSIGN_OR_RETURN(int h, Half(x));
  DS_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckEven(int x) {
  DS_RETURN_IF_ERROR(Half(x).status());
  return Status::OK();
}

TEST(ResultTest, ValueAndErrorPropagate) {
  Result<int> r = Quarter(12);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 3);
  Result<int> bad = Quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "odd");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_TRUE(CheckEven(5).IsInvalidArgument());
}

TEST(ResultTest, MoveOnlyValue) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

}  // namespace
}  // namespace deltasync
