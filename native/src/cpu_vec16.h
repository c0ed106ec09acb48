// 16-float vectors for the kernels compiled once per ISA level (VUN_CLONES): one AVX-512
// register, two AVX2 or four SSE registers, by the clone compiled.
#pragma once

namespace vun {

typedef float v16 __attribute__((vector_size(64)));

// Helpers must be inlined into each clone to be compiled for its instruction set (a helper
// compiled once would run the baseline ISA inside every clone).
#define VUN_INLINE inline __attribute__((always_inline))

VUN_INLINE v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

VUN_INLINE void store16(float* p, v16 v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

VUN_INLINE float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) {
    s += v[i];
  }
  return s;
}

} // namespace vun
