#include "deltasync/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace deltasync {
namespace {

TEST(ThreadPoolTest, ParallelForVisitsEachIndexOnce) {
  ThreadPool pool(3);
  for (size_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPoolTest, SubmitRunsEverythingBeforeDestruction) {
  std::atomic<int> count{0};
  {
    ThreadPool pool(2);
    for (int i = 0; i < 100; ++i) pool.Submit([&] { count.fetch_add(1); });
  }
  EXPECT_EQ(count.load(), 100);
}

TEST(ThreadPoolTest, ConcurrentParallelForCalls) {
  ThreadPool pool(2);
  std::atomic<long> sum{0};
  std::thread other([&] { pool.ParallelFor(500, [&](size_t i) { sum += static_cast<long>(i); }); });
  pool.ParallelFor(500, [&](size_t i) { sum += static_cast<long>(i); });
  other.join();
  EXPECT_EQ(sum.load(), 2L * (499L * 500L / 2));
}

TEST(ThreadPoolTest, DefaultPoolHasThreads) { EXPECT_GE(ThreadPool::Default().size(), 1u); }

}  // namespace
}  // namespace deltasync
