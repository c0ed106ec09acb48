// Elementwise kernels for MLX's CPU backend whose transcendental functions MLX 0.32.4 evaluates
// one element at a time (its CPU `exp`/`sigmoid` run at ~11-18 ns per fp32 element here).
//
// This file alone is compiled with -ffast-math -fopenmp-simd (see CMakeLists.txt) so that GCC on
// x86_64 glibc vectorizes expf through glibc's vector math library (libmvec) inside the SIMD
// loops below; elsewhere the same loops are plain scalar code with the same results up to
// rounding. Nothing here depends on NaN/infinity semantics beyond IEEE hardware behaviour: for
// very negative gates expf(-g) overflows to +inf and 1 / (1 + inf) is 0, as in the reference.

#include <cmath>
#include <cstddef>

#include "cpu_math.h"

namespace vun {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// One variant per ISA level, chosen at load time by the dynamic linker (GCC function
// multiversioning): a build machine's flags never decide what a user's CPU must support.
#define VUN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VUN_CLONES
#endif

VUN_CLONES void silu_mul_f32(const float* gate, const float* up, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

} // namespace vun

namespace vun {

VUN_CLONES void attend_rows_f32(
    const float* q, size_t heads, size_t dim, const float* const* keys, const float* const* values,
    size_t n, float scale, float* scores, float* out) {
  for (size_t j = 0; j < n; ++j) {
    const float* k = keys[j];
    for (size_t r = 0; r < heads; ++r) {
      const float* qr = q + r * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (size_t e = 0; e < dim; ++e) {
        s += qr[e] * k[e];
      }
      scores[r * n + j] = s * scale;
    }
  }
  for (size_t r = 0; r < heads; ++r) {
    float* sr = scores + r * n;
    float m = sr[0];
    for (size_t j = 1; j < n; ++j) {
      m = sr[j] > m ? sr[j] : m;
    }
    float l = 0.f;
#pragma omp simd reduction(+ : l)
    for (size_t j = 0; j < n; ++j) {
      sr[j] = expf(sr[j] - m);
      l += sr[j];
    }
    const float inv = 1.f / l;
    float* o = out + r * dim;
    for (size_t e = 0; e < dim; ++e) {
      o[e] = 0.f;
    }
    for (size_t j = 0; j < n; ++j) {
      const float p = sr[j] * inv;
      const float* v = values[j];
#pragma omp simd
      for (size_t e = 0; e < dim; ++e) {
        o[e] += p * v[e];
      }
    }
  }
}

} // namespace vun

namespace vun {

namespace {

// 16 floats: one AVX-512 register, two AVX2 or four SSE registers, by the clone compiled.
typedef float v16 __attribute__((vector_size(64)));

// The helpers below must be inlined into each clone of linear_rows_f32 to be compiled for its
// instruction set (a helper compiled once would run the baseline ISA inside every clone).
#define VUN_INLINE inline __attribute__((always_inline))

VUN_INLINE v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

VUN_INLINE float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) {
    s += v[i];
  }
  return s;
}

// y[m, n] for the RM x RN tile at (m, n): 16-wide dot products over k < k16, scalar tail.
template <int RM, int RN>
VUN_INLINE void tile(
    const float* x, const float* w, float* y, size_t m, size_t n, size_t N, size_t K,
    size_t k16) {
  v16 acc[RM][RN] = {};
  for (size_t k = 0; k < k16; k += 16) {
    v16 wv[RN];
    for (int j = 0; j < RN; ++j) {
      wv[j] = load16(w + (n + j) * K + k);
    }
    for (int i = 0; i < RM; ++i) {
      const v16 xv = load16(x + (m + i) * K + k);
      for (int j = 0; j < RN; ++j) {
        acc[i][j] += xv * wv[j];
      }
    }
  }
  for (int i = 0; i < RM; ++i) {
    for (int j = 0; j < RN; ++j) {
      float s = hsum(acc[i][j]);
      for (size_t k = k16; k < K; ++k) {
        s += x[(m + i) * K + k] * w[(n + j) * K + k];
      }
      y[(m + i) * N + n + j] = s;
    }
  }
}

template <int RN>
VUN_INLINE void rows_block(const float* x, const float* w, float* y, size_t M, size_t N, size_t K,
                       size_t n) {
  const size_t k16 = K / 16 * 16;
  size_t m = 0;
  for (; m + 4 <= M; m += 4) {
    tile<4, RN>(x, w, y, m, n, N, K, k16);
  }
  for (; m < M; ++m) {
    tile<1, RN>(x, w, y, m, n, N, K, k16);
  }
}

} // namespace

VUN_CLONES void linear_rows_f32(
    const float* x, const float* w, float* y, size_t M, size_t N, size_t K, size_t n0,
    size_t n1) {
  size_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    rows_block<4>(x, w, y, M, N, K, n);
  }
  for (; n < n1; ++n) {
    rows_block<1>(x, w, y, M, N, K, n);
  }
}

} // namespace vun
