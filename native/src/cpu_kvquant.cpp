// Quantized KV cells of vLLM 0.32's per-token-head formats on the CPU (cpu_kvquant.h).
//
// Built with -ffp-contract=off (CMakeLists.txt): every product and sum rounds on its own, as
// vLLM's Triton kernels do when run by Triton's interpreter (the oracle of
// tests/test_kv_quant.py), so the quantizing write gives vLLM's page bytes exactly.

#include "cpu_kvquant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_math.h"  // VUN_CLONES

namespace vun {

namespace {

// vLLM's fast_hadamard_transform CPU path over one block of n (a power of two) floats: for
// h = 1, 2, 4, ... each pair (a, b) = (x[g*2h + i], x[g*2h + h + i]) becomes (a + b, a - b).
void butterfly(float* x, size_t n) {
  for (size_t h = 1; h < n; h <<= 1) {
    for (size_t g = 0; g < n; g += 2 * h) {
      for (size_t i = 0; i < h; ++i) {
        const float a = x[g + i];
        const float b = x[g + h + i];
        x[g + i] = a + b;
        x[g + h + i] = a - b;
      }
    }
  }
}

// Triton's `where(x >= 0, (x + 0.5).to(int32), (x - 0.5).to(int32))`: half away from zero.
inline float round_half_away(float x) {
  return static_cast<float>(x >= 0.f ? static_cast<int32_t>(x + 0.5f)
                                     : static_cast<int32_t>(x - 0.5f));
}

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

inline void store_f32(uint8_t* p, float f) {
  std::memcpy(p, &f, 4);
}

// The int4 scale word: the scale with its low 4 mantissa bits cleared, and the zero point.
inline void int4_scale_zp(const uint8_t* p, float* scale, float* zp) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  *zp = static_cast<float>(bits & 0xFu);
  bits &= ~0xFu;
  std::memcpy(scale, &bits, 4);
}

} // namespace

void rht_forward(float* x, size_t dim, size_t block, const float* signs) {
  for (size_t b = 0; b < dim; b += block) {
    for (size_t i = 0; i < block; ++i) {
      x[b + i] *= signs[i];
    }
    butterfly(x + b, block);
  }
}

void rht_inverse(float* x, size_t dim, size_t block, const float* signs) {
  for (size_t b = 0; b < dim; b += block) {
    butterfly(x + b, block);
    for (size_t i = 0; i < block; ++i) {
      x[b + i] *= signs[i];
    }
  }
}

void quantize_side(int mode, const float* x, size_t dim, uint8_t* dst) {
  if (mode == kKVInt8) {
    float amax = 0.f;
    for (size_t e = 0; e < dim; ++e) {
      amax = std::max(amax, std::fabs(x[e]));
    }
    const float scale = std::max(amax / 127.0f, 1e-6f);
    const float inv = 1.0f / scale;
    for (size_t e = 0; e < dim; ++e) {
      float q = x[e] * inv;
      q = q >= 0.f ? q + 0.5f : q - 0.5f;
      q = std::min(std::max(q, -128.0f), 127.0f);
      dst[e] = static_cast<uint8_t>(static_cast<int8_t>(q));  // truncates, as Triton's store
    }
    store_f32(dst + dim, scale);
    return;
  }
  // int4: asymmetric, 16 levels
  float lo = std::numeric_limits<float>::infinity();
  float hi = -std::numeric_limits<float>::infinity();
  for (size_t e = 0; e < dim; ++e) {
    lo = std::min(lo, x[e]);
    hi = std::max(hi, x[e]);
  }
  const float scale = std::max((hi - lo) / 15.0f, 1e-6f);
  const float zp = std::min(std::max(round_half_away(-lo / scale), 0.f), 15.f);
  const float inv = 1.0f / scale;
  for (size_t e = 0; e < dim; e += 2) {
    float s0 = x[e] * inv;
    s0 = s0 + zp;
    float s1 = x[e + 1] * inv;
    s1 = s1 + zp;
    const auto q0 = static_cast<uint32_t>(std::min(std::max(round_half_away(s0), 0.f), 15.f));
    const auto q1 = static_cast<uint32_t>(std::min(std::max(round_half_away(s1), 0.f), 15.f));
    dst[e / 2] = static_cast<uint8_t>((q0 & 0xFu) | ((q1 & 0xFu) << 4));
  }
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  bits = (bits & ~0xFu) | (static_cast<uint32_t>(zp) & 0xFu);
  std::memcpy(dst + dim / 2, &bits, 4);
}

void dequantize_side(int mode, const uint8_t* src, size_t dim, float* out) {
  if (mode == kKVInt8) {
    const float scale = load_f32(src + dim);
    for (size_t e = 0; e < dim; ++e) {
      out[e] = static_cast<float>(static_cast<int8_t>(src[e])) * scale;
    }
    return;
  }
  float scale, zp;
  int4_scale_zp(src + dim / 2, &scale, &zp);
  for (size_t e = 0; e < dim; e += 2) {
    out[e] = (static_cast<float>(src[e / 2] & 0xF) - zp) * scale;
    out[e + 1] = (static_cast<float>(src[e / 2] >> 4) - zp) * scale;
  }
}

VUN_CLONES void attend_rows_quant(
    int mode, const float* q, size_t heads, size_t dim, const uint8_t* const* cells, size_t n,
    float scale, float* scores, float* out) {
  const size_t dk = kv_data_bytes(mode, dim);
  const bool int4 = mode == kKVInt4;
  // One key or value row widened at a time (L1-resident; the context is never densified).
  float row[512];
  float qsum[64];
  for (size_t r = 0; r < heads; ++r) {
    float s = 0.f;
    for (size_t e = 0; e < dim; ++e) {
      s += q[r * dim + e];
    }
    qsum[r] = s;
  }
  for (size_t j = 0; j < n; ++j) {
    const uint8_t* c = cells[j];
    float ks, kz = 0.f;
    if (int4) {
      int4_scale_zp(c + dk, &ks, &kz);
      for (size_t e = 0; e < dk; ++e) {
        row[2 * e] = static_cast<float>(c[e] & 0xF);
        row[2 * e + 1] = static_cast<float>(c[e] >> 4);
      }
    } else {
      ks = load_f32(c + dk);
#pragma omp simd
      for (size_t e = 0; e < dim; ++e) {
        row[e] = static_cast<float>(static_cast<int8_t>(c[e]));
      }
    }
    const float f = scale * ks;
    for (size_t r = 0; r < heads; ++r) {
      const float* qr = q + r * dim;
      float d = 0.f;
#pragma omp simd reduction(+ : d)
      for (size_t e = 0; e < dim; ++e) {
        d += qr[e] * row[e];
      }
      scores[r * n + j] = (d - qsum[r] * kz) * f;
    }
  }
  for (size_t r = 0; r < heads; ++r) {
    float* sr = scores + r * n;
    float m = sr[0];
    for (size_t j = 1; j < n; ++j) {
      m = std::max(m, sr[j]);
    }
    float l = 0.f;
    for (size_t j = 0; j < n; ++j) {
      sr[j] = std::exp(sr[j] - m);
      l += sr[j];
    }
    const float inv = 1.f / l;
    for (size_t j = 0; j < n; ++j) {
      sr[j] *= inv;
    }
    std::fill(out + r * dim, out + (r + 1) * dim, 0.f);
  }
  const uint8_t* c;
  for (size_t j = 0; j < n; ++j) {
    c = cells[j] + dk + 4;  // the V side
    float vs, vz = 0.f;
    if (int4) {
      int4_scale_zp(c + dk, &vs, &vz);
      for (size_t e = 0; e < dk; ++e) {
        row[2 * e] = static_cast<float>(c[e] & 0xF) - vz;
        row[2 * e + 1] = static_cast<float>(c[e] >> 4) - vz;
      }
    } else {
      vs = load_f32(c + dk);
#pragma omp simd
      for (size_t e = 0; e < dim; ++e) {
        row[e] = static_cast<float>(static_cast<int8_t>(c[e]));
      }
    }
    for (size_t r = 0; r < heads; ++r) {
      const float w = scores[r * n + j] * vs;
      float* o = out + r * dim;
#pragma omp simd
      for (size_t e = 0; e < dim; ++e) {
        o[e] += w * row[e];
      }
    }
  }
}

} // namespace vun
