// A tiny persistent thread pool for the CPU kernels: parallel_for over chunks [0, n), shared
// dynamically between the calling thread and the workers.
//
// Why dynamic: on a 2-core machine the workers compete with the engine's other threads (vLLM's
// Python thread building the next step, the API server). With a static split the caller spun
// while a descheduled worker's share waited (~60% of a decode step's samples in `perf`); here
// the caller takes chunks too and only ever waits for chunks a worker is already computing.
// Workers spin briefly for the next job (a decode step runs ~200 kernels back to back), then
// sleep on a C++20 atomic wait.
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
      workers_.emplace_back([this] { work(); });
    }
  }

  ~ThreadPool() {
    stop_.store(true);
    wake_.fetch_add(1);
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
  }

  // Threads that may take part in a job (the caller included).
  size_t size() const {
    return size_;
  }

  // Runs fn(chunk) for every chunk in [0, chunks) and returns when all are done; the first
  // exception a chunk throws is rethrown here (the other chunks still run). Jobs are
  // serialized (MLX runs a stream's CPU tasks on one thread anyway).
  void run(size_t chunks, const std::function<void(size_t)>& fn) {
    if (chunks == 0) {
      return;
    }
    if (size_ == 1 || chunks == 1) {
      for (size_t c = 0; c < chunks; ++c) {
        fn(c);
      }
      return;
    }
    std::lock_guard<std::mutex> lock(run_mutex_);
    const uint64_t gen = ++generation_;
    // Closed first: a worker still inside take_chunks of the previous job holds a snapshot
    // (previous generation, next = its chunk count) and compares it with chunks_. Were chunks_
    // raised while state_ still held that snapshot, its compare-and-swap would succeed and it
    // would run a chunk of this job under the old generation, a chunk the job then hands out
    // again: done_ would pass `chunks` and the wait below would never end (seen: an engine
    // spinning forever when a 3-chunk attention call was followed by a 16-chunk linear).
    state_.store((gen << 32) | kClosed);
    fn_ = &fn;
    chunks_ = chunks;
    done_.store(0);
    error_ = nullptr;
    state_.store(gen << 32);  // publishes fn_, chunks_: (generation, next chunk = 0)
    wake_.fetch_add(1);
    wake_.notify_all();
    take_chunks(gen);
    while (done_.load() != chunks) {
      // only chunks a worker is computing right now remain: they are short
    }
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  // Claims and runs chunks of job `gen` until none is left (or a newer job replaced it).
  void take_chunks(uint64_t gen) {
    while (true) {
      uint64_t s = state_.load();
      size_t chunk;
      do {
        if ((s >> 32) != gen || (s & 0xffffffffu) >= chunks_) {
          return;
        }
        chunk = s & 0xffffffffu;
      } while (!state_.compare_exchange_weak(s, s + 1));
      try {
        (*fn_)(chunk);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
      done_.fetch_add(1);
    }
  }

  void work() {
    uint64_t seen = 0;  // wake_ at construction: a job may be published before we first run
    while (true) {
      // Spin (yielding the core) up to ~0.5 ms for the next job, then sleep until woken.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(500);
      uint64_t now = wake_.load();
      while (now == seen && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
        now = wake_.load();
      }
      if (now == seen) {
        wake_.wait(seen);
        now = wake_.load();
      }
      seen = now;
      if (stop_.load()) {
        return;
      }
      take_chunks(state_.load() >> 32);
    }
  }

  static constexpr uint64_t kClosed = 0xffffffffu;  // next chunk past any job's chunks

  const size_t size_;
  std::vector<std::thread> workers_;
  // Last job's generation (caller side, under run_mutex_). 32 bits, as in state_: a wider
  // counter would stop matching state_'s from job 2^32 on and the caller would take no chunk.
  uint32_t generation_ = 0;
  std::atomic<uint64_t> state_{0};     // (generation << 32) | next unclaimed chunk
  std::atomic<uint64_t> wake_{0};      // bumped per job and at stop
  std::atomic<size_t> done_{0};        // chunks finished in the current job
  std::atomic<bool> stop_{false};
  const std::function<void(size_t)>* fn_ = nullptr;
  std::atomic<size_t> chunks_{0};     // written before state_ publishes the job
  std::exception_ptr error_;
  std::mutex run_mutex_;
  std::mutex error_mutex_;
};

} // namespace vun
