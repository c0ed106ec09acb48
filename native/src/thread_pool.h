// A tiny persistent thread pool for the CPU kernels: parallel_for over [0, n) in `size()` parts,
// the calling thread taking part 0. Workers spin briefly for the next job (a decode step runs
// ~200 linears back to back, each a few hundred microseconds; waking a sleeping thread per
// call would cost as much), then sleep on a C++20 atomic wait.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vun {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads) : size_(threads < 1 ? 1 : threads) {
    for (size_t i = 1; i < size_; ++i) {
      workers_.emplace_back([this, i] { work(i); });
    }
  }

  ~ThreadPool() {
    stop_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
  }

  size_t size() const {
    return size_;
  }

  // Runs fn(part) for part in [0, size()) and returns when all parts are done. One job at a
  // time (callers serialize: MLX runs a stream's CPU tasks on one thread). The first exception
  // thrown by a part is rethrown here after all parts finished.
  void run(const std::function<void(size_t)>& fn) {
    if (size_ == 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> lock(run_mutex_);
    job_ = &fn;
    error_ = nullptr;
    remaining_.store(size_ - 1);
    generation_.fetch_add(1);
    generation_.notify_all();
    call(fn, 0);
    while (remaining_.load() != 0) {
      // the other parts are about as long as ours: spin
    }
    job_ = nullptr;
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  void call(const std::function<void(size_t)>& fn, size_t part) {
    try {
      fn(part);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) {
        error_ = std::current_exception();
      }
    }
  }

  void work(size_t part) {
    uint64_t seen = 0;  // the generation at construction: a job may start before we run
    while (true) {
      // Spin up to ~1 ms for the next job, then sleep until the generation changes.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
      uint64_t now = generation_.load();
      while (now == seen && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
        now = generation_.load();
      }
      if (now == seen) {
        generation_.wait(seen);
        now = generation_.load();
      }
      seen = now;
      if (stop_.load()) {
        return;
      }
      call(*job_, part);
      remaining_.fetch_sub(1);
    }
  }

  const size_t size_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<size_t> remaining_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(size_t)>* job_ = nullptr;
  std::exception_ptr error_;
  std::mutex run_mutex_;
  std::mutex error_mutex_;
};

} // namespace vun
