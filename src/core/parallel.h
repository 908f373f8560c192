// Helpers for the tasks of one ThreadPool::ParallelFor: reusing per-task
// scratch, and keeping the first error any task reports.
#pragma once

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "deltasync/status.h"

namespace deltasync::core_internal {

// A mutex-guarded free list of per-task scratch objects, reused across the
// tasks of a parallel loop: vectors sized for large tensors are an mmap, a
// page-fault storm and an munmap each when made fresh. As many exist as
// tasks ever ran at once. Take and Give may be called from any thread.
template <typename T>
class FreeList {
 public:
  // The most recently given back object, or a new default-constructed one
  // when none is free.
  std::unique_ptr<T> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<T>();
    std::unique_ptr<T> item = std::move(free_.back());
    free_.pop_back();
    return item;
  }
  // Keeps `item` for a later Take, contents and capacity as they are.
  void Give(std::unique_ptr<T> item) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(item));
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<T>> free_;
};

// Keeps the first error that any of several parallel tasks reports. Every
// member is thread-safe.
class FirstError {
 public:
  // Keeps `s` unless it is OK or an error was kept before.
  void Note(Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = std::move(s);
  }
  // Whether an error was noted (tasks check it to stop early).
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return !status_.ok();
  }
  // The first error noted, or OK.
  Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  Status status_;
};

}  // namespace deltasync::core_internal
