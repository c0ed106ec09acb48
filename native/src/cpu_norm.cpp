// RMSNorm and rotary embedding for MLX's CPU backend (MLX 0.32.4 evaluates mx.fast.rms_norm and
// mx.fast.rope there as graphs of ~10 and ~30 primitives).
//
// Compiled without -ffast-math (unlike cpu_math.cpp): a row whose sum of squares overflows must
// normalize to 0 as MLX's does (1 / sqrt(inf) = 0), where fast-math's reciprocal-square-root
// estimate gives NaN.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu_math.h"

namespace vun {

VUN_CLONES void rms_norm_f32(
    const float* x, const float* w, float* out, size_t rows, size_t D, float eps) {
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (size_t d = 0; d < D; ++d) {
      ss += xr[d] * xr[d];
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
    for (size_t d = 0; d < D; ++d) {
      o[d] = xr[d] * inv * w[d];
    }
  }
}

VUN_CLONES void rope_table_f32(
    const int32_t* offsets, size_t num_offsets, size_t B, size_t L, size_t half,
    const float* inv_freq, float scale, float* table) {
  for (size_t b = 0; b < B; ++b) {
    const int32_t offset = offsets[num_offsets == 1 ? 0 : b];
    for (size_t l = 0; l < L; ++l) {
      // As mx.fast.rope's fallback: (arange(L) + offset) in fp32, times scale (signed: offsets
      // may be negative).
      const float pos = (static_cast<float>(l) + static_cast<float>(offset)) * scale;
      float* c = table + (b * L + l) * 2 * half;
      float* s = c + half;
      for (size_t i = 0; i < half; ++i) {
        const float theta = pos * inv_freq[i];
        c[i] = std::cos(theta);
        s[i] = std::sin(theta);
      }
    }
  }
}

VUN_CLONES void rope_apply_f32(
    const float* x, float* out, const float* table, size_t H, size_t L, size_t D, size_t dims,
    bool traditional, size_t row0, size_t row1) {
  const size_t half = dims / 2;
  for (size_t row = row0; row < row1; ++row) {  // row = (b * H + h) * L + l
    const size_t b = row / (H * L);
    const size_t l = row % L;
    const float* c = table + (b * L + l) * 2 * half;
    const float* s = c + half;
    const float* xr = x + row * D;
    float* o = out + row * D;
    if (traditional) {
      for (size_t i = 0; i < half; ++i) {
        const float x1 = xr[2 * i];
        const float x2 = xr[2 * i + 1];
        o[2 * i] = x1 * c[i] - x2 * s[i];
        o[2 * i + 1] = x1 * s[i] + x2 * c[i];
      }
    } else {
#pragma omp simd
      for (size_t i = 0; i < half; ++i) {
        const float x1 = xr[i];
        const float x2 = xr[i + half];
        o[i] = x1 * c[i] - x2 * s[i];
        o[i + half] = x1 * s[i] + x2 * c[i];
      }
    }
    for (size_t d = dims; d < D; ++d) {
      o[d] = xr[d];
    }
  }
}

} // namespace vun
