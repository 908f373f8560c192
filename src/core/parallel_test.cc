// FreeList hands back what was given to it before making anything new;
// FirstError keeps exactly the first error noted, from any thread.

#include "core/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "deltasync/thread_pool.h"

namespace deltasync::core_internal {
namespace {

TEST(FreeList, TakeReusesTheLastObjectGivenBackAndMakesOneOnlyWhenNoneIsFree) {
  FreeList<std::vector<int>> list;
  std::unique_ptr<std::vector<int>> a = list.Take();
  std::unique_ptr<std::vector<int>> b = list.Take();
  ASSERT_NE(a.get(), b.get());
  a->assign(1000, 7);
  const std::vector<int>* a_address = a.get();
  const std::vector<int>* b_address = b.get();
  list.Give(std::move(b));
  list.Give(std::move(a));
  std::unique_ptr<std::vector<int>> again = list.Take();
  EXPECT_EQ(again.get(), a_address) << "not the last one given back";
  EXPECT_EQ(again->size(), 1000u) << "contents are kept";
  std::unique_ptr<std::vector<int>> next = list.Take();
  EXPECT_EQ(next.get(), b_address);
  std::unique_ptr<std::vector<int>> fresh = list.Take();
  EXPECT_NE(fresh.get(), a_address);
  EXPECT_NE(fresh.get(), b_address);
  EXPECT_TRUE(fresh->empty());
}

TEST(FreeList, ParallelTasksNeverShareAnObject) {
  FreeList<std::atomic<int>> list;
  ThreadPool pool(3);
  std::atomic<bool> shared{false};
  std::mutex mu;
  std::set<const void*> seen;
  pool.ParallelFor(2000, [&](size_t) {
    std::unique_ptr<std::atomic<int>> item = list.Take();
    if (item->fetch_add(1) != 0) shared = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      seen.insert(item.get());
    }
    item->fetch_sub(1);
    list.Give(std::move(item));
  });
  EXPECT_FALSE(shared) << "two tasks held one object at once";
  EXPECT_LE(seen.size(), pool.size() + 1) << "more objects than tasks ran at once";
}

TEST(FirstError, KeepsTheFirstErrorAndIgnoresOk) {
  FirstError error;
  EXPECT_FALSE(error.failed());
  EXPECT_TRUE(error.status().ok());
  error.Note(Status::OK());
  EXPECT_FALSE(error.failed());
  error.Note(Status::NotFound("first"));
  error.Note(Status::OK());
  error.Note(Status::Corruption("second"));
  EXPECT_TRUE(error.failed());
  EXPECT_TRUE(error.status().IsNotFound()) << error.status().ToString();
  EXPECT_EQ(error.status().message(), "first");
}

TEST(FirstError, ParallelTasksLeaveOneOfTheirErrors) {
  FirstError error;
  ThreadPool pool(3);
  pool.ParallelFor(500, [&](size_t i) {
    error.Note(i % 2 == 0 ? Status::OK() : Status::Corruption("task " + std::to_string(i)));
  });
  ASSERT_TRUE(error.failed());
  const std::string message = error.status().message();
  ASSERT_EQ(message.rfind("task ", 0), 0u) << message;
  EXPECT_EQ(std::stoul(message.substr(5)) % 2, 1u) << message;
}

}  // namespace
}  // namespace deltasync::core_internal
