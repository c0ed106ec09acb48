// The CPU kernels' two process-wide settings (cpu_math.h, "Settings"). The native code reads no
// environment variable: vllm_unified_native passes vllm_unified.envs' values to configure().

#include <mutex>
#include <stdexcept>
#include <string>

#include "cpu_math.h"

namespace vun {

namespace {

struct Settings {
  std::mutex mutex;
  IsaCap isa = IsaCap::kAmx;  // no cap
  size_t threads = 0;         // no cap
  bool isa_fixed = false;     // a kernel has decided with it
  bool threads_fixed = false;
};

Settings& settings() {
  static Settings* s = new Settings();  // never destroyed: kernels may run during exit
  return *s;
}

}  // namespace

void configure(const std::optional<std::string>& isa, std::optional<long> threads) {
  IsaCap cap = IsaCap::kAmx;
  if (isa) {
    if (*isa == "amx") {
      cap = IsaCap::kAmx;
    } else if (*isa == "avx512") {
      cap = IsaCap::kAvx512;
    } else if (*isa == "avxvnni") {
      cap = IsaCap::kAvxVnni;
    } else if (*isa == "avx2") {
      cap = IsaCap::kAvx2;
    } else if (*isa == "portable") {
      cap = IsaCap::kPortable;
    } else {
      throw std::invalid_argument("configure: cpu_isa must be amx, avx512, avxvnni, avx2, portable or "
                                  "None, got '" + *isa + "'");
    }
  }
  if (threads && *threads < 1) {
    throw std::invalid_argument("configure: cpu_threads must be >= 1 or None, got " +
                                std::to_string(*threads));
  }
  const size_t n = threads ? static_cast<size_t>(*threads) : 0;
  Settings& s = settings();
  std::lock_guard<std::mutex> lock(s.mutex);
  // All or nothing: a decision a kernel already took stays, so changing it is an error.
  if (s.isa_fixed && cap != s.isa) {
    throw std::runtime_error("configure: the kernels already chose their instruction set; "
                             "cpu_isa can no longer change (set it before the first kernel runs)");
  }
  if (s.threads_fixed && n != s.threads) {
    throw std::runtime_error("configure: the kernel thread pool already exists; cpu_threads "
                             "can no longer change (set it before the first kernel runs)");
  }
  s.isa = cap;
  s.threads = n;
}

IsaCap isa_cap() {
  Settings& s = settings();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.isa_fixed = true;
  return s.isa;
}

size_t thread_cap() {
  Settings& s = settings();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.threads_fixed = true;
  return s.threads;
}

}  // namespace vun
