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

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

uint8_t f32_to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const float a = std::fabs(x);
  if (std::isnan(x)) {
    return static_cast<uint8_t>(sign | 0x7f);
  }
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 of them make the first normal)
    const float q = std::nearbyint(a * 512.0f);  // exact scaling; the default mode is RNE
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));  // q == 8: 2^-6 (exp 1)
  }
  uint32_t r = bits & 0x7fffffffu;
  r += 0x7ffffu + ((r >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
  const int32_t e = static_cast<int32_t>(r >> 23) - 127 + 7;
  const uint32_t m = (r >> 20) & 7u;
  if (e > 15 || (e == 15 && m == 7)) {
    return static_cast<uint8_t>(sign | 0x7f);  // beyond 448: e4m3fn has no infinity (NaN)
  }
  return static_cast<uint8_t>(sign | (static_cast<uint32_t>(e) << 3) | m);
}

float e4m3_to_f32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15u;
  const uint32_t m = b & 7u;
  if (e == 15 && m == 7) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(static_cast<float>(8 + m), static_cast<int>(e) - 10);
  return (b & 0x80) ? -mag : mag;
}

uint16_t f32_to_f16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  }
  if (a >= 0x477ff000u) {  // from 65520 (half way past 65504) up: infinity
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (a < 0x38800000u) {  // below 2^-14: subnormal steps of 2^-24 (1024 of them: 2^-14)
    float f;
    std::memcpy(&f, &a, 4);
    const float q = std::nearbyint(f * 16777216.0f);  // exact scaling; the default mode is RNE
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // 23 -> 10 mantissa bits, ties to even
  r -= (127u - 15u) << 23;                     // rebias the exponent (a carry lands in it)
  return static_cast<uint16_t>(sign | (r >> 13));
}

float f16_to_f32(uint16_t h) {
  const uint32_t e = (h >> 10) & 31u;
  const uint32_t m = h & 0x3ffu;
  float mag;
  if (e == 0) {
    mag = std::ldexp(static_cast<float>(m), -24);
  } else if (e == 31) {
    mag = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    mag = std::ldexp(static_cast<float>(m + 1024u), static_cast<int>(e) - 25);
  }
  return (h & 0x8000u) ? -mag : mag;
}

void quantize_tq_k8v4(const float* k, const float* v, size_t dim, uint8_t* cell) {
  // keys: float8 e4m3fn of the value itself (no scale); GPUs saturate to +-448
  for (size_t e = 0; e < dim; ++e) {
    cell[e] = f32_to_e4m3(std::min(std::max(k[e], -448.0f), 448.0f));
  }
  // values: 16 levels over [min, max] of the row
  float lo = std::numeric_limits<float>::infinity();
  float hi = -std::numeric_limits<float>::infinity();
  for (size_t e = 0; e < dim; ++e) {
    lo = std::min(lo, v[e]);
    hi = std::max(hi, v[e]);
  }
  float s = (hi - lo) / 15.0f;
  s = s > 1e-8f ? s : 1e-8f;
  uint8_t* data = cell + dim;
  for (size_t e = 0; e < dim; e += 2) {
    // clamping before the truncation gives clamp(trunc(.)): the bounds are whole numbers
    // (fmax/fmin take a NaN to 0, as Triton's int32 cast then max(., 0) does)
    const float q0 = std::fmin(std::fmax((v[e] - lo) / s + 0.5f, 0.f), 15.f);
    const float q1 = std::fmin(std::fmax((v[e + 1] - lo) / s + 0.5f, 0.f), 15.f);
    data[e / 2] = static_cast<uint8_t>(static_cast<uint32_t>(q0) |
                                       (static_cast<uint32_t>(q1) << 4));
  }
  const uint16_t sb = f32_to_f16(s);
  const uint16_t zb = f32_to_f16(lo);
  std::memcpy(data + dim / 2, &sb, 2);  // little-endian, as vLLM's byte stores
  std::memcpy(data + dim / 2 + 2, &zb, 2);
}

namespace {

// e4m3_to_f32 of every byte.
const float* e4m3_table() {
  static const auto* table = [] {
    auto* t = new float[256];
    for (int i = 0; i < 256; ++i) {
      t[i] = e4m3_to_f32(static_cast<uint8_t>(i));
    }
    return t;
  }();
  return table;
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
  if (mode == kKVFp8) {
    float amax = 0.f;
    for (size_t e = 0; e < dim; ++e) {
      amax = std::max(amax, std::fabs(x[e]));
    }
    const float scale = std::max(amax / 448.0f, 1e-6f);
    const float inv = 1.0f / scale;
    for (size_t e = 0; e < dim; ++e) {
      const float q = std::min(std::max(x[e] * inv, -448.0f), 448.0f);
      dst[e] = f32_to_e4m3(q);
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
  if (mode == kKVFp8) {
    const float scale = load_f32(src + dim);
    const float* t = e4m3_table();
    for (size_t e = 0; e < dim; ++e) {
      out[e] = t[src[e]] * scale;
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

namespace {

// turboquant_k8v4's value scale and zero (fp16 each, after the D / 2 data bytes at p).
inline void tq_scale_zero(const uint8_t* p, size_t dim, float* scale, float* zero) {
  uint16_t sb, zb;
  std::memcpy(&sb, p + dim / 2, 2);
  std::memcpy(&zb, p + dim / 2 + 2, 2);
  *scale = f16_to_f32(sb);
  *zero = f16_to_f32(zb);
}

} // namespace

void dequantize_tq_k8v4(const uint8_t* cell, size_t dim, float* k, float* v) {
  for (size_t e = 0; e < dim; ++e) {
    k[e] = e4m3_to_f32(cell[e]);
  }
  const uint8_t* data = cell + dim;
  float s, z;
  tq_scale_zero(data, dim, &s, &z);
  for (size_t e = 0; e < dim; e += 2) {
    v[e] = static_cast<float>(data[e / 2] & 0xF) * s + z;
    v[e + 1] = static_cast<float>(data[e / 2] >> 4) * s + z;
  }
}

// Any head size (a multiple of 8): one key or value row widened at a time.
VUN_CLONES void attend_rows_quant_generic(
    int mode, const float* q, size_t heads, size_t dim, const uint8_t* const* cells, size_t n,
    float scale, float* scores, float* out, const float* const* raw_k,
    const float* const* raw_v, ScoreOpts opts) {
  const size_t dk = kv_data_bytes(mode, dim);
  const bool int4 = mode == kKVInt4;
  const float* lut = e4m3_table();
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
    if (raw_k != nullptr && raw_k[j] != nullptr) {  // this step's unquantized key
      ks = 1.f;
      std::memcpy(row, raw_k[j], dim * sizeof(float));
    } else if (int4) {
      int4_scale_zp(c + dk, &ks, &kz);
      for (size_t e = 0; e < dk; ++e) {
        row[2 * e] = static_cast<float>(c[e] & 0xF);
        row[2 * e + 1] = static_cast<float>(c[e] >> 4);
      }
    } else if (mode == kKVFp8 || mode == kKVTqK8V4) {
      ks = mode == kKVTqK8V4 ? 1.f : load_f32(c + dk);  // turboquant: fp8 keys, no scale
      for (size_t e = 0; e < dim; ++e) {
        row[e] = lut[c[e]];
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
    const float inv = 1.f / softmax_exp_opts(sr, n, opts.softcap,
                                            opts.sinks ? opts.sinks + r : nullptr);
    for (size_t j = 0; j < n; ++j) {
      sr[j] *= inv;
    }
    std::fill(out + r * dim, out + (r + 1) * dim, 0.f);
  }
  const uint8_t* c;
  for (size_t j = 0; j < n; ++j) {
    c = cells[j] + (mode == kKVTqK8V4 ? dim : dk + 4);  // the V side
    float vs, vz = 0.f;
    if (raw_v != nullptr && raw_v[j] != nullptr) {  // this step's unquantized value
      vs = 1.f;
      std::memcpy(row, raw_v[j], dim * sizeof(float));
    } else if (mode == kKVTqK8V4) {  // q * s + min, weighted by p_j
      float s, z;
      tq_scale_zero(c, dim, &s, &z);
      vs = 1.f;
      for (size_t e = 0; e < dim / 2; ++e) {
        row[2 * e] = static_cast<float>(c[e] & 0xF) * s + z;
        row[2 * e + 1] = static_cast<float>(c[e] >> 4) * s + z;
      }
    } else if (int4) {
      int4_scale_zp(c + dk, &vs, &vz);
      for (size_t e = 0; e < dk; ++e) {
        row[2 * e] = static_cast<float>(c[e] & 0xF) - vz;
        row[2 * e + 1] = static_cast<float>(c[e] >> 4) - vz;
      }
    } else if (mode == kKVFp8) {
      vs = load_f32(c + dk);
      for (size_t e = 0; e < dim; ++e) {
        row[e] = lut[c[e]];
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


#if defined(__x86_64__) && defined(__GNUC__)
#define VUN_KVQ_X86 1
namespace {

// 16 floats: one AVX-512 register (two AVX2, four SSE), by the clone compiled.
typedef float v16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

#define VUN_KVQ_INLINE inline __attribute__((always_inline))

#define VUN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// 16 int8 values at p, widened.
VUN_KVQ_INLINE VUN_AVX512 v16 widen_i8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

// 16 int4 values packed in the 8 bytes at p (element 2i in byte i's low nibble, 2i + 1 in its
// high nibble), widened.
VUN_KVQ_INLINE VUN_AVX512 v16 widen_u4(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

// 16 float8 e4m3fn values at p, decoded: (m + 8 [normal]) * 2^(max(e, 1) - 10), signed (the
// NaN code never occurs in pages the write made).
VUN_KVQ_INLINE VUN_AVX512 v16 widen_fp8(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(b, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(b, _mm512_set1_epi32(7));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i mant = _mm512_or_si512(m, _mm512_slli_epi32(_mm512_min_epi32(e, one), 3));
  const __m512i pow2 = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_max_epi32(e, one), _mm512_set1_epi32(127 - 10)), 23);
  const __m512 mag = _mm512_mul_ps(_mm512_cvtepi32_ps(mant), _mm512_castsi512_ps(pow2));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

// Element c * 16 ... c * 16 + 15 of a side's data at p (MODE: kKVInt8, kKVInt4, kKVFp8).
template <int MODE>
VUN_KVQ_INLINE VUN_AVX512 v16 widen(const uint8_t* p, int c) {
  if constexpr (MODE == kKVInt4) {
    return widen_u4(p + 8 * c);
  } else if constexpr (MODE == kKVFp8) {
    return widen_fp8(p + 16 * c);
  } else {
    return widen_i8(p + 16 * c);
  }
}

VUN_KVQ_INLINE VUN_AVX512 v16 load16f(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// The lane sums of a0..a3 at lanes 0, 4, 8, 12 (a shuffle-and-add tree).
VUN_KVQ_INLINE VUN_AVX512 v16 reduce4(v16 a0, v16 a1, v16 a2, v16 a3) {
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

VUN_KVQ_INLINE VUN_AVX512 float hsum16(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) {
    s += v[i];
  }
  return s;
}

VUN_KVQ_INLINE VUN_AVX512 void side_scale(bool int4, const uint8_t* p, float* scale, float* zp) {
  if (int4) {
    int4_scale_zp(p, scale, zp);
  } else {
    *scale = load_f32(p);
    *zp = 0.f;
  }
}

// attend_rows_quant for D = 16 * NC, a block of kBlock keys at a time: the block's key (then
// value) data widened once into a small scratch (kBlock x D floats, L1-resident; never the
// whole context), then every query head's dot products over it 4 keys per reduction tree, and
// the weighted values accumulated into the head's output.
constexpr size_t kBlock = 16;

template <int NC, int MODE>
VUN_KVQ_INLINE VUN_AVX512 void attend_quant_fixed(const float* q, size_t heads,
                                                  const uint8_t* const* cells, size_t n,
                                                  float scale, float* scores, float* out,
                                                  const float* const* raw_k,
                                                  const float* const* raw_v, ScoreOpts opts) {
  constexpr size_t D = 16 * NC;
  constexpr bool INT4 = MODE == kKVInt4;
  constexpr bool TQ = MODE == kKVTqK8V4;
  constexpr size_t dk = INT4 ? D / 2 : D;
  alignas(64) float blk[kBlock * D];
  float fac[kBlock], zp[kBlock];
  float qsum[64];
  for (size_t r = 0; r < heads; ++r) {
    v16 qs = {};
    for (int c = 0; c < NC; ++c) {
      qs += load16f(q + r * D + 16 * c);
    }
    qsum[r] = hsum16(qs);
  }
  // scores
  for (size_t j0 = 0; j0 < n; j0 += kBlock) {
    const size_t nb = std::min(kBlock, n - j0);
    for (size_t t = 0; t < nb; ++t) {
      if (raw_k != nullptr && raw_k[j0 + t] != nullptr) {  // this step's unquantized key
        __builtin_memcpy(blk + t * D, raw_k[j0 + t], D * sizeof(float));
        fac[t] = scale;
        zp[t] = 0.f;
        continue;
      }
      const uint8_t* k = cells[j0 + t];
      for (int c = 0; c < NC; ++c) {
        const v16 x = TQ ? widen_fp8(k + 16 * c) : widen<MODE>(k, c);
        __builtin_memcpy(blk + t * D + 16 * c, &x, sizeof(v16));
      }
      if constexpr (TQ) {  // fp8 keys without a scale
        fac[t] = scale;
        zp[t] = 0.f;
      } else {
        side_scale(INT4, k + dk, &fac[t], &zp[t]);
        fac[t] *= scale;
      }
    }
    for (size_t r = 0; r < heads; ++r) {
      v16 qv[NC];
      for (int c = 0; c < NC; ++c) {
        qv[c] = load16f(q + r * D + 16 * c);
      }
      float* sr = scores + r * n + j0;
      size_t t = 0;
      for (; t + 4 <= nb; t += 4) {
        v16 acc[4] = {};
        for (int c = 0; c < NC; ++c) {
          for (int u = 0; u < 4; ++u) {
            acc[u] += qv[c] * load16f(blk + (t + u) * D + 16 * c);
          }
        }
        const v16 red = reduce4(acc[0], acc[1], acc[2], acc[3]);
        for (int u = 0; u < 4; ++u) {
          sr[t + u] = (red[4 * u] - qsum[r] * zp[t + u]) * fac[t + u];
        }
      }
      for (; t < nb; ++t) {
        v16 acc = {};
        for (int c = 0; c < NC; ++c) {
          acc += qv[c] * load16f(blk + t * D + 16 * c);
        }
        sr[t] = (hsum16(acc) - qsum[r] * zp[t]) * fac[t];
      }
    }
  }
  // softmax numerators; out = 0
  for (size_t r = 0; r < heads; ++r) {
    float* sr = scores + r * n;
    const float inv = 1.f / softmax_exp_opts(sr, n, opts.softcap,
                                            opts.sinks ? opts.sinks + r : nullptr);
    for (size_t j = 0; j < n; ++j) {
      sr[j] *= inv;
    }
    std::fill(out + r * D, out + (r + 1) * D, 0.f);
  }
  // values (int4: the zero point taken off each widened value)
  for (size_t j0 = 0; j0 < n; j0 += kBlock) {
    const size_t nb = std::min(kBlock, n - j0);
    for (size_t t = 0; t < nb; ++t) {
      if (raw_v != nullptr && raw_v[j0 + t] != nullptr) {  // this step's unquantized value
        __builtin_memcpy(blk + t * D, raw_v[j0 + t], D * sizeof(float));
        fac[t] = 1.f;
        zp[t] = 0.f;
        continue;
      }
      if constexpr (TQ) {  // q * s + min, weighted by p_j alone
        const uint8_t* v = cells[j0 + t] + D;
        float s, z;
        tq_scale_zero(v, D, &s, &z);
        fac[t] = 1.f;
        for (int c = 0; c < NC; ++c) {
          const v16 x = widen_u4(v + 8 * c) * s + z;
          __builtin_memcpy(blk + t * D + 16 * c, &x, sizeof(v16));
        }
        continue;
      }
      const uint8_t* v = cells[j0 + t] + dk + 4;
      side_scale(INT4, v + dk, &fac[t], &zp[t]);
      for (int c = 0; c < NC; ++c) {
        const v16 x = widen<MODE>(v, c) - zp[t];
        __builtin_memcpy(blk + t * D + 16 * c, &x, sizeof(v16));
      }
    }
    for (size_t r = 0; r < heads; ++r) {
      const float* sr = scores + r * n + j0;
      v16 o[NC];
      for (int c = 0; c < NC; ++c) {
        o[c] = load16f(out + r * D + 16 * c);
      }
      for (size_t t = 0; t < nb; ++t) {
        const float w = sr[t] * fac[t];
        for (int c = 0; c < NC; ++c) {
          o[c] += w * load16f(blk + t * D + 16 * c);
        }
      }
      for (int c = 0; c < NC; ++c) {
        __builtin_memcpy(out + r * D + 16 * c, &o[c], sizeof(v16));
      }
    }
  }
}

template <int MODE>
VUN_AVX512 bool attend_quant_dispatch(size_t dim, const float* q, size_t heads,
                                          const uint8_t* const* cells, size_t n, float scale,
                                          float* scores, float* out, const float* const* rk,
                                          const float* const* rv, ScoreOpts opts) {
  switch (dim) {
    case 64:
      attend_quant_fixed<4, MODE>(q, heads, cells, n, scale, scores, out, rk, rv, opts);
      return true;
    case 128:
      attend_quant_fixed<8, MODE>(q, heads, cells, n, scale, scores, out, rk, rv, opts);
      return true;
    case 256:
      attend_quant_fixed<16, MODE>(q, heads, cells, n, scale, scores, out, rk, rv, opts);
      return true;
    default:
      return false;
  }
}

} // namespace
#endif  // __x86_64__

void attend_rows_quant(
    int mode, const float* q, size_t heads, size_t dim, const uint8_t* const* cells, size_t n,
    float scale, float* scores, float* out, const float* const* raw_k,
    const float* const* raw_v, ScoreOpts opts) {
  bool done = false;
#if defined(VUN_KVQ_X86)
  // The register path needs AVX-512 (and the ISA cap to allow it); else the generic loops.
  static const bool avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && isa_cap() >= IsaCap::kAvx512;
  if (avx512) {
    switch (mode) {
      case kKVInt4:
        done = attend_quant_dispatch<kKVInt4>(dim, q, heads, cells, n, scale, scores, out,
                                              raw_k, raw_v, opts);
        break;
      case kKVFp8:
        done = attend_quant_dispatch<kKVFp8>(dim, q, heads, cells, n, scale, scores, out,
                                             raw_k, raw_v, opts);
        break;
      case kKVTqK8V4:
        done = attend_quant_dispatch<kKVTqK8V4>(dim, q, heads, cells, n, scale, scores, out,
                                                raw_k, raw_v, opts);
        break;
      default:
        done = attend_quant_dispatch<kKVInt8>(dim, q, heads, cells, n, scale, scores, out,
                                              raw_k, raw_v, opts);
    }
  }
#endif
  if (!done) {
    attend_rows_quant_generic(mode, q, heads, dim, cells, n, scale, scores, out, raw_k, raw_v,
                              opts);
  }
}

} // namespace vun
