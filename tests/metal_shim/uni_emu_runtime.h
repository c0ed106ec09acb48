// The thread model of a Metal compute dispatch, run on the CPU (tests only; see
// tests/metal_emulation.py). One threadgroup at a time; each of its threads is a fiber
// (ucontext) on the calling OS thread, scheduled cooperatively: a fiber runs until it reaches
// a threadgroup barrier or a SIMD-group function, or returns. Then
//   * a SIMD-group function completes when every thread of its SIMD group (32 consecutive
//     threads by thread_index_in_threadgroup; the group's last one may be shorter) called the
//     same function; their values are combined and all resume;
//   * a barrier completes when every thread of the threadgroup reached it.
// A SIMD function that some lanes of the group skip (they are at a barrier, or returned), a
// barrier that some threads of the group skip, and lanes calling different SIMD functions at
// once are reported as errors: on the GPU they are undefined or deadlock (and CUDA's
// full-mask shuffles of the same body need all 32 lanes). Memory is sequentially consistent.
#pragma once

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700
#endif
#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

struct uint3 {
  unsigned int x, y, z;
  uint3() : x(0), y(0), z(0) {}
  uint3(unsigned int a, unsigned int b, unsigned int c) : x(a), y(b), z(c) {}
};

struct uint2 {
  unsigned int x, y;
  uint2() : x(0), y(0) {}
  uint2(unsigned int a, unsigned int b) : x(a), y(b) {}
};

namespace uni_emu {

constexpr int kSimdWidth = 32;
constexpr int kMaxThreadsPerGroup = 1024;
constexpr std::size_t kStackBytes = 256 * 1024;

// The values of Metal's thread attributes for one thread (named as the attributes are).
struct ThreadCtx {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid;
  uint3 threads_per_grid, grid_size, grid_origin;
  unsigned int thread_index_in_threadgroup, thread_index_in_simdgroup;
  unsigned int simdgroup_index_in_threadgroup, simdgroups_per_threadgroup;
  unsigned int dispatch_simdgroups_per_threadgroup, thread_execution_width;
  unsigned int threads_per_simdgroup, thread_index_in_quadgroup;
  unsigned int quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
  unsigned int dispatch_quadgroups_per_threadgroup;
};

enum State { kRunnable, kAtBarrier, kAtSimd, kDone };

struct Fiber;
using Combine = void (*)(Fiber* lanes, int count);

struct Fiber {
  ucontext_t uc;
  ThreadCtx ctx;
  State state;
  Combine combine;  // the SIMD function (and value type) this fiber waits in
  int arg;          // its lane argument (shuffle mask or source lane)
  alignas(16) unsigned char in[16];
  alignas(16) unsigned char out[16];
};

struct Runtime {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;  // malloc'd, never freed (the runtime lives as long as the library)
  ucontext_t scheduler;
  Fiber* current = nullptr;
  std::string error;
  void (*body)(const ThreadCtx&) = nullptr;
};

inline Runtime& rt() {
  static Runtime r;
  return r;
}

inline void fail(const std::string& msg) {
  if (rt().error.empty()) rt().error = msg;
}

inline Fiber& self() {
  Fiber* f = rt().current;
  if (f == nullptr) {
    std::fprintf(stderr, "uni_emu: a SIMD or barrier function called outside a kernel run\n");
    std::abort();
  }
  return *f;
}

inline void yield() {
  Fiber& f = self();
  swapcontext(&f.uc, &rt().scheduler);
}

inline void trampoline() {
  Runtime& r = rt();
  try {
    r.body(r.current->ctx);
  } catch (const std::exception& e) {
    fail(std::string("a kernel thread threw: ") + e.what());
  } catch (...) {
    fail("a kernel thread threw");
  }
  r.current->state = kDone;
  swapcontext(&r.current->uc, &r.scheduler);
}

template <typename T>
inline T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void store(unsigned char* p, const T& v) {
  std::memcpy(p, &v, sizeof(T));
}

// Wait until the whole SIMD group called the same function; returns this lane's result.
template <typename T>
inline T collective(T x, int arg, Combine combine) {
  static_assert(sizeof(T) <= 16, "SIMD value too large for the emulator");
  Fiber& f = self();
  store(f.in, x);
  f.arg = arg;
  f.combine = combine;
  f.state = kAtSimd;
  yield();
  return load<T>(f.out);
}

inline void barrier() {
  Fiber& f = self();
  f.state = kAtBarrier;
  yield();
}

inline std::string where(const ThreadCtx& c) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "threadgroup (%u, %u, %u)", c.threadgroup_position_in_grid.x,
                c.threadgroup_position_in_grid.y, c.threadgroup_position_in_grid.z);
  return buf;
}

inline unsigned int ceil_div(unsigned int a, unsigned int b) { return (a + b - 1) / b; }

// Run one threadgroup to completion; false (and rt().error set) on an error.
inline bool run_group(uint3 group, uint3 tg, uint3 grid) {
  Runtime& r = rt();
  const uint3 size(std::min(tg.x, grid.x - group.x * tg.x), std::min(tg.y, grid.y - group.y * tg.y),
                   std::min(tg.z, grid.z - group.z * tg.z));
  const int n = int(size.x * size.y * size.z);
  const int requested = int(tg.x * tg.y * tg.z);
  const int nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  for (int t = 0; t < n; ++t) {
    Fiber& f = r.fibers[t];
    ThreadCtx& c = f.ctx;
    const unsigned int lx = unsigned(t) % size.x, ly = (unsigned(t) / size.x) % size.y,
                       lz = unsigned(t) / (size.x * size.y);
    c.thread_position_in_threadgroup = uint3(lx, ly, lz);
    c.threadgroup_position_in_grid = group;
    c.thread_position_in_grid =
        uint3(group.x * tg.x + lx, group.y * tg.y + ly, group.z * tg.z + lz);
    c.threads_per_threadgroup = size;
    c.dispatch_threads_per_threadgroup = tg;
    c.threadgroups_per_grid =
        uint3(ceil_div(grid.x, tg.x), ceil_div(grid.y, tg.y), ceil_div(grid.z, tg.z));
    c.threads_per_grid = grid;
    c.grid_size = grid;
    c.grid_origin = uint3(0, 0, 0);
    c.thread_index_in_threadgroup = unsigned(t);
    c.thread_index_in_simdgroup = unsigned(t) % kSimdWidth;
    c.simdgroup_index_in_threadgroup = unsigned(t) / kSimdWidth;
    c.simdgroups_per_threadgroup = unsigned(nsimd);
    c.dispatch_simdgroups_per_threadgroup = ceil_div(unsigned(requested), kSimdWidth);
    c.thread_execution_width = kSimdWidth;
    c.threads_per_simdgroup = kSimdWidth;
    c.thread_index_in_quadgroup = unsigned(t) % 4;
    c.quadgroup_index_in_threadgroup = unsigned(t) / 4;
    c.quadgroups_per_threadgroup = ceil_div(unsigned(n), 4);
    c.dispatch_quadgroups_per_threadgroup = ceil_div(unsigned(requested), 4);
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = r.stacks[t];
    f.uc.uc_stack.ss_size = kStackBytes;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, trampoline, 0);
    f.state = kRunnable;
    f.combine = nullptr;
  }
  for (;;) {
    for (int t = 0; t < n; ++t) {
      Fiber& f = r.fibers[t];
      if (f.state != kRunnable) continue;
      r.current = &f;
      swapcontext(&r.scheduler, &f.uc);
      r.current = nullptr;
      if (!r.error.empty()) return false;
    }
    int done = 0;
    for (int t = 0; t < n; ++t) done += r.fibers[t].state == kDone;
    if (done == n) return true;
    bool resolved = false;
    for (int s = 0; s < nsimd; ++s) {
      Fiber* lanes = &r.fibers[s * kSimdWidth];
      const int count = std::min(kSimdWidth, n - s * kSimdWidth);
      int waiting = 0, at_barrier = 0, returned = 0;
      for (int l = 0; l < count; ++l) {
        waiting += lanes[l].state == kAtSimd;
        at_barrier += lanes[l].state == kAtBarrier;
        returned += lanes[l].state == kDone;
      }
      if (waiting == 0) continue;
      if (waiting != count) {
        fail(where(lanes[0].ctx) + ", SIMD group " + std::to_string(s) + ": " +
             std::to_string(waiting) + " of " + std::to_string(count) +
             " lanes called a SIMD-group function while " + std::to_string(at_barrier) +
             " wait at a threadgroup barrier and " + std::to_string(returned) +
             " returned (divergent SIMD-group function)");
        return false;
      }
      for (int l = 1; l < count; ++l) {
        if (lanes[l].combine != lanes[0].combine) {
          fail(where(lanes[0].ctx) + ", SIMD group " + std::to_string(s) +
               ": lanes called different SIMD-group functions at once");
          return false;
        }
      }
      lanes[0].combine(lanes, count);
      if (!r.error.empty()) return false;
      for (int l = 0; l < count; ++l) lanes[l].state = kRunnable;
      resolved = true;
    }
    if (resolved) continue;
    if (done > 0) {  // the rest wait at a barrier that the returned threads never reach
      fail(where(r.fibers[0].ctx) + ": threadgroup_barrier reached by " +
           std::to_string(n - done) + " of " + std::to_string(n) + " threads; " +
           std::to_string(done) + " returned without reaching it");
      return false;
    }
    for (int t = 0; t < n; ++t) r.fibers[t].state = kRunnable;
  }
}

// Run the whole dispatch (MLX's dispatch_threads(grid, min(threadgroup, grid))).
inline int run(void (*body)(const ThreadCtx&), const unsigned int* grid3,
               const unsigned int* tg3, char* err, int errlen) {
  Runtime& r = rt();
  r.error.clear();
  r.body = body;
  const uint3 grid(grid3[0], grid3[1], grid3[2]);
  const uint3 tg(std::min(tg3[0], grid3[0]), std::min(tg3[1], grid3[1]),
                 std::min(tg3[2], grid3[2]));
  const long long threads = (long long)tg.x * tg.y * tg.z;
  if (threads > kMaxThreadsPerGroup || threads == 0) {
    fail("threadgroup of " + std::to_string(threads) + " threads (1 to " +
         std::to_string(kMaxThreadsPerGroup) + " allowed)");
  } else {
    if (r.fibers.size() < std::size_t(threads)) {
      r.fibers.resize(threads);
      while (r.stacks.size() < std::size_t(threads))
        r.stacks.push_back(static_cast<char*>(std::malloc(kStackBytes)));
    }
    for (unsigned int z = 0; z < ceil_div(grid.z, tg.z) && r.error.empty(); ++z)
      for (unsigned int y = 0; y < ceil_div(grid.y, tg.y) && r.error.empty(); ++y)
        for (unsigned int x = 0; x < ceil_div(grid.x, tg.x); ++x)
          if (!run_group(uint3(x, y, z), tg, grid)) break;
  }
  if (r.error.empty()) return 0;
  std::snprintf(err, std::size_t(errlen), "%s", r.error.c_str());
  return 1;
}

}  // namespace uni_emu
