// Elementwise kernels for MLX's CPU backend whose transcendental functions MLX 0.32.4 evaluates
// one element at a time (its CPU `exp`/`sigmoid` run at ~11-18 ns per fp32 element here).
//
// This file alone is compiled with -ffast-math -fopenmp-simd (see CMakeLists.txt) so that GCC on
// x86_64 glibc vectorizes expf through glibc's vector math library (libmvec) inside the SIMD
// loops below; elsewhere the same loops are plain scalar code with the same results up to
// rounding. Fast-math assumes finite values: code here must never produce an infinity on its
// way to a finite result (the SwiGLU clamps its exponent; RMSNorm and RoPE, which must keep
// IEEE semantics for overflowing rows, live in cpu_norm.cpp without fast-math).

#include <cmath>
#include <cstddef>

#include "cpu_math.h"

namespace vun {

VUN_CLONES void silu_mul_f32(const float* gate, const float* up, float* out, size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    // Below -88.72 exp(-g) overflows fp32, and with -ffast-math the division is a reciprocal
    // estimate that gives NaN for 1 / (1 + inf): such gates give 0 (the reference's -0), and
    // the exponent is clamped so that no lane computes an infinity.
    const float s = g / (1.0f + expf(fminf(-g, 88.72f))) * up[i];
    out[i] = g < -88.72f ? 0.0f : s;
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

// The lane sums of a0..a3 at lanes 0, 4, 8, 12: a tree of shuffles and adds over all four at
// once (summing each vector's lanes one by one cost more than a tile's whole dot products).
VUN_INLINE v16 reduce4(v16 a0, v16 a1, v16 a2, v16 a3) {
  const v16 p01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                          28, 29, 30, 31);
  const v16 p23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                          28, 29, 30, 31);
  const v16 q = __builtin_shufflevector(p01, p23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                        26, 27) +
                __builtin_shufflevector(p01, p23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                        29, 30, 31);
  const v16 r = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15,
                                            12, 13);
  return r + __builtin_shufflevector(r, r, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

// y[m, n + j] for the RM x RN tile at (m, n), j < RN: 16-wide dot products over k < k16, scalar
// tail. wn points at the tile's first weight row (row n of the weight, or a dequantized copy).
template <int RM, int RN>
VUN_INLINE void tile(
    const float* x, const float* wn, float* y, size_t m, size_t n, size_t N, size_t K,
    size_t k16) {
  v16 acc[RM][RN] = {};
  for (size_t k = 0; k < k16; k += 16) {
    v16 wv[RN];
    for (int j = 0; j < RN; ++j) {
      wv[j] = load16(wn + j * K + k);
    }
    for (int i = 0; i < RM; ++i) {
      const v16 xv = load16(x + (m + i) * K + k);
      for (int j = 0; j < RN; ++j) {
        acc[i][j] += xv * wv[j];
      }
    }
  }
  for (int i = 0; i < RM; ++i) {
    float sums[RN];
    if constexpr (RN == 4) {
      const v16 r = reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      for (int j = 0; j < 4; ++j) {
        sums[j] = r[4 * j];
      }
    } else {
      for (int j = 0; j < RN; ++j) {
        sums[j] = hsum(acc[i][j]);
      }
    }
    for (int j = 0; j < RN; ++j) {
      float s = sums[j];
      for (size_t k = k16; k < K; ++k) {
        s += x[(m + i) * K + k] * wn[j * K + k];
      }
      y[(m + i) * N + n + j] = s;
    }
  }
}

template <int RN>
VUN_INLINE void rows_block(const float* x, const float* wn, float* y, size_t M, size_t N,
                           size_t K, size_t n) {
  const size_t k16 = K / 16 * 16;
  size_t m = 0;
  for (; m + 4 <= M; m += 4) {
    tile<4, RN>(x, wn, y, m, n, N, K, k16);
  }
  for (; m < M; ++m) {
    tile<1, RN>(x, wn, y, m, n, N, K, k16);
  }
}

// Columns [n, n + count) of y from their weight rows wn[0 .. count).
VUN_INLINE void cols(const float* x, const float* wn, float* y, size_t M, size_t N, size_t K,
                     size_t n, size_t count) {
  size_t j = 0;
  for (; j + 4 <= count; j += 4) {
    rows_block<4>(x, wn + j * K, y, M, N, K, n + j);
  }
  for (; j < count; ++j) {
    rows_block<1>(x, wn + j * K, y, M, N, K, n + j);
  }
}

} // namespace

VUN_CLONES void linear_rows_f32(
    const float* x, const float* w, float* y, size_t M, size_t N, size_t K, size_t n0,
    size_t n1) {
  cols(x, w + n0 * K, y, M, N, K, n0, n1 - n0);
}

VUN_CLONES void linear_cols_f32(
    const float* x, const float* wn, float* y, size_t M, size_t N, size_t K, size_t n,
    size_t count) {
  cols(x, wn, y, M, N, K, n, count);
}

} // namespace vun
