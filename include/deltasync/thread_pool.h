// A fixed-size pool of worker threads with a blocking parallel-for.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "deltasync/status.h"

namespace deltasync {

class ThreadPool {
 public:
  // `num_threads` == 0 means std::thread::hardware_concurrency() (at least 1).
  explicit ThreadPool(size_t num_threads = 0);
  // Finishes every queued task, then joins the workers.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size(); }

  // Queues `task`. Tasks must not throw.
  void Submit(std::function<void()> task);

  // Runs fn(i) for i in [0, n) on the pool and the calling thread, returning
  // when all calls have returned. Safe to call from several threads at once;
  // must not be called from inside a pool task (it would wait on itself).
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

  // The process-wide default pool (hardware_concurrency threads).
  static ThreadPool& Default();

  // The cores this process may run on (its CPU affinity: a cpuset or
  // taskset narrows it), at least 1.
  static uint32_t CoresAvailable();

  // The most threads a component may be asked to run on.
  static constexpr uint32_t kMaxThreads = 1024;
  // InvalidArgument when `threads` is above kMaxThreads (0 means the cores
  // available).
  static Status CheckThreads(uint32_t threads);
  // The pool of a component that runs on `threads` threads, the calling
  // thread among them (0: CoresAvailable()): nullptr when that is one.
  static std::unique_ptr<ThreadPool> ForThreads(uint32_t threads);

 private:
  void WorkerLoop();

  std::vector<std::thread> workers_;
  std::queue<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

}  // namespace deltasync
