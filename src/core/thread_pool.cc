#include "deltasync/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>

namespace deltasync {

ThreadPool::ThreadPool(size_t num_threads) {
  if (num_threads == 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(num_threads);
  for (size_t i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop();
    }
    task();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Shared work counter: helpers and the caller pull indices until none are
  // left. The caller always participates, so progress never depends on a
  // free worker.
  struct Shared {
    std::atomic<size_t> next{0};
    std::atomic<size_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, n, &fn] {
    size_t finished = 0;
    for (size_t i; (i = shared->next.fetch_add(1)) < n;) {
      fn(i);
      ++finished;
    }
    if (finished && shared->done.fetch_add(finished) + finished == n) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  const size_t helpers = std::min(workers_.size(), n - 1);
  for (size_t h = 0; h < helpers; ++h) Submit(drain);
  drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n; });
}

ThreadPool& ThreadPool::Default() {
  static ThreadPool* pool = new ThreadPool(0);  // never destroyed: safe at exit
  return *pool;
}

uint32_t ThreadPool::CoresAvailable() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return static_cast<uint32_t>(std::max(1, CPU_COUNT(&set)));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Status ThreadPool::CheckThreads(uint32_t threads) {
  if (threads <= kMaxThreads) return Status::OK();
  return Status::InvalidArgument("threads " + std::to_string(threads) + ": at most " +
                                 std::to_string(kMaxThreads) + " (0: the cores available)");
}

std::unique_ptr<ThreadPool> ThreadPool::ForThreads(uint32_t threads) {
  const uint32_t n = threads != 0 ? threads : CoresAvailable();
  if (n <= 1) return nullptr;
  return std::make_unique<ThreadPool>(n - 1);
}

}  // namespace deltasync
