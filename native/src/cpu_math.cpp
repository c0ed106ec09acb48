// Elementwise kernels for MLX's CPU backend whose transcendental functions MLX 0.32.4 evaluates
// one element at a time (its CPU `exp`/`sigmoid`/`tanh` run at ~11-23 ns per fp32 element here).
//
// This file alone is compiled with -ffast-math -fopenmp-simd (see CMakeLists.txt) so that GCC on
// x86_64 glibc vectorizes expf and tanhf through glibc's vector math library (libmvec) inside the
// SIMD loops below; elsewhere the same loops are plain scalar code with the same results up to
// rounding. Fast-math assumes finite values: code here must never produce an infinity on its
// way to a finite result (the SwiGLU clamps its exponent, GeGLU, GELU and soft-capping their tanh or erf arguments; RMSNorm and RoPE, which must keep
// IEEE semantics for overflowing rows, live in cpu_norm.cpp without fast-math).

#include <cmath>
#include <cstddef>

#include "cpu_math.h"
#include "cpu_vec16.h"

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

VUN_CLONES void gelu_tanh_mul_f32(const float* gate, const float* up, float* out, size_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    // tanh saturates to +-1 in fp32 beyond +-9.02, which the cubic passes at |g| < 5: clamping
    // the cubic's argument to +-10 changes no result and keeps g^3 finite for any finite gate.
    const float c = fminf(fmaxf(g, -10.0f), 10.0f);
    const float t = tanhf(kSqrt2OverPi * (c + 0.044715f * c * c * c));
    out[i] = 0.5f * g * (1.0f + t) * up[i];
  }
}

VUN_CLONES void gelu_f32(const float* x, float* out, size_t n, bool tanh) {
  constexpr float kInvSqrt2 = 0.7071067811865476f;
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  if (tanh) {
#pragma omp simd
    for (size_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float c = fminf(fmaxf(v, -10.0f), 10.0f);  // as gelu_tanh_mul_f32
      out[i] = 0.5f * v * (1.0f + tanhf(kSqrt2OverPi * (c + 0.044715f * c * c * c)));
    }
    return;
  }
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    // erf is +-1 in fp32 beyond +-4: clamping its argument to +-10 changes no result and keeps
    // every lane finite.
    out[i] = 0.5f * v * (1.0f + erff(fminf(fmaxf(v * kInvSqrt2, -10.0f), 10.0f)));
  }
}

VUN_CLONES void softcap_f32(const float* x, float cap, float* out, size_t n) {
  const float inv = 1.0f / cap;
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    // tanh(+-10) is +-1 in fp32: the clamp changes no result and keeps every lane finite.
    out[i] = cap * tanhf(fminf(fmaxf(x[i] * inv, -10.0f), 10.0f));
  }
}

} // namespace vun

namespace vun {

namespace {

// s[j] = exp(s[j] - max(s)) for j < n (n >= 1); returns their sum. Always inlined, so that each
// ISA clone of its callers vectorizes it for its own instruction set.
inline __attribute__((always_inline)) float exp_shifted(float* s, size_t n) {
  float m = s[0];
  for (size_t j = 1; j < n; ++j) {
    m = s[j] > m ? s[j] : m;
  }
  float l = 0.f;
#pragma omp simd reduction(+ : l)
  for (size_t j = 0; j < n; ++j) {
    s[j] = expf(s[j] - m);
    l += s[j];
  }
  return l;
}

} // namespace

// exp_shifted with soft-capping and a sink logit (ScoreOpts). Always inlined, as exp_shifted.
inline __attribute__((always_inline)) float exp_shifted_opts(float* s, size_t n, float softcap,
                                                            const float* sink) {
  if (softcap > 0.f) {
    const float inv = 1.f / softcap;
#pragma omp simd
    for (size_t j = 0; j < n; ++j) {
      s[j] = softcap * tanhf(s[j] * inv);
    }
  }
  if (sink == nullptr) {
    return exp_shifted(s, n);
  }
  float m = *sink;
  for (size_t j = 0; j < n; ++j) {
    m = s[j] > m ? s[j] : m;
  }
  float l = expf(*sink - m);
#pragma omp simd reduction(+ : l)
  for (size_t j = 0; j < n; ++j) {
    s[j] = expf(s[j] - m);
    l += s[j];
  }
  return l;
}

VUN_CLONES float softmax_exp(float* s, size_t n) {
  return exp_shifted(s, n);
}

VUN_CLONES void softmax_rows_f32(const float* x, float* out, size_t rows, size_t n) {
  for (size_t r = 0; r < rows; ++r) {
    float* o = out + r * n;
    const float* xr = x + r * n;
    for (size_t j = 0; j < n; ++j) {
      o[j] = xr[j];
    }
    const float inv = 1.f / exp_shifted(o, n);
#pragma omp simd
    for (size_t j = 0; j < n; ++j) {
      o[j] *= inv;
    }
  }
}

VUN_CLONES float softmax_exp_opts(float* s, size_t n, float softcap, const float* sink) {
  return exp_shifted_opts(s, n, softcap, sink);
}

VUN_CLONES void attend_rows_f32(
    const float* q, size_t heads, size_t dim, const float* const* keys, const float* const* values,
    size_t n, float scale, float* scores, float* out, ScoreOpts opts) {
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
    const float inv =
        1.f / exp_shifted_opts(sr, n, opts.softcap, opts.sinks ? opts.sinks + r : nullptr);
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

namespace {

// Scores of query q (NC * 16 floats) against keys[0 .. n): 4 keys per pass, their four
// 16-wide dot products summed by one reduce4 tree.
template <int NC>
VUN_INLINE void scores_row(const float* q, const float* const* keys, size_t n, float scale,
                           float* s) {
  v16 qv[NC];
  for (int c = 0; c < NC; ++c) {
    qv[c] = load16(q + 16 * c);
  }
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    v16 acc[4] = {};
    for (int c = 0; c < NC; ++c) {
      for (int t = 0; t < 4; ++t) {
        acc[t] += qv[c] * load16(keys[j + t] + 16 * c);
      }
    }
    const v16 r = reduce4(acc[0], acc[1], acc[2], acc[3]);
    for (int t = 0; t < 4; ++t) {
      s[j + t] = r[4 * t] * scale;
    }
  }
  for (; j < n; ++j) {
    v16 acc = {};
    for (int c = 0; c < NC; ++c) {
      acc += qv[c] * load16(keys[j] + 16 * c);
    }
    s[j] = hsum(acc) * scale;
  }
}

// out = sum_j p[j] * inv * values[j] with the NC accumulators in registers across all keys.
template <int NC>
VUN_INLINE void weighted_values(const float* p, float inv, const float* const* values, size_t n,
                                float* out) {
  v16 o[NC] = {};
  for (size_t j = 0; j < n; ++j) {
    const float w = p[j] * inv;
    for (int c = 0; c < NC; ++c) {
      o[c] += w * load16(values[j] + 16 * c);
    }
  }
  for (int c = 0; c < NC; ++c) {
    __builtin_memcpy(out + 16 * c, &o[c], sizeof(v16));
  }
}

template <int NC>
VUN_INLINE void attend_fixed(const float* q, size_t heads, const float* const* keys,
                             const float* const* values, size_t n, float scale, float* scores,
                             float* out, ScoreOpts opts) {
  for (size_t r = 0; r < heads; ++r) {
    float* sr = scores + r * n;
    scores_row<NC>(q + r * NC * 16, keys, n, scale, sr);
    const float l =
        exp_shifted_opts(sr, n, opts.softcap, opts.sinks ? opts.sinks + r : nullptr);
    weighted_values<NC>(sr, 1.f / l, values, n, out + r * NC * 16);
  }
}

} // namespace

VUN_CLONES bool attend_rows_f32_fixed(
    const float* q, size_t heads, size_t dim, const float* const* keys, const float* const* values,
    size_t n, float scale, float* scores, float* out, ScoreOpts opts) {
  switch (dim) {
    case 64:
      attend_fixed<4>(q, heads, keys, values, n, scale, scores, out, opts);
      return true;
    case 128:
      attend_fixed<8>(q, heads, keys, values, n, scale, scores, out, opts);
      return true;
    case 256:
      attend_fixed<16>(q, heads, keys, values, n, scale, scores, out, opts);
      return true;
    default:
      return false;
  }
}

} // namespace vun
