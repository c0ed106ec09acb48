// x @ dequantize(w).T against x quantized to int8 terms, for 1-4 rows of x: llama.cpp's CPU
// arithmetic for quantized layers (ggml's Q8_0 activations: one scale per 32 consecutive
// elements of x), on MLX's affine layout, with an optional second term.
//
// For a weight row with codes q, scales s and biases b per group g (w = s * q + b) and x in
// blocks of 32 with v = x * 127 / max|x|, xq = rint(v), dx = max|x| / 127 (one term), or also
// xq_lo = rint(256 (v - xq)) and dx / 256 as the step of 256 xq + xq_lo (two terms):
//   y = sum over 64-element spans of sum_lanes s_g * dx_blk * (sum of 4 products q * x~)
//     + sum_g b_g * (sum of x over g, in fp32)
// The integer products and their 4-element sums are exact (VNNI's VPDPBUSD: unsigned bytes q
// times signed bytes of x; two terms combined as 256 hi + lo in int32); the one approximation
// is the rounding of x: at most 1/254 of the block's largest |x| per element with one term,
// 1/65024 with two (1/32512 where the second term saturates at 127). The bias term uses the
// exact fp32 sums of x.
// Accuracy on real text: docs/features/quantization.md.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu_avx512.h"
#include "cpu_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VUN_X86 1
#endif

namespace vun {


void q8_quantize_rows(const float* x, size_t M, size_t K, size_t group_size, bool two_terms,
                      int8_t* xq, int8_t* xq_lo, float* dx, float* sx) {
  const size_t blocks = (K + 31) / 32, spans = (K + 63) / 64, groups = K / group_size;
  for (size_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* qr = xq + m * spans * 64;
    int8_t* lr = two_terms ? xq_lo + m * spans * 64 : nullptr;
    float* dr = dx + m * spans * 16;
    std::fill(qr, qr + spans * 64, int8_t{0});
    if (two_terms) {
      std::fill(lr, lr + spans * 64, int8_t{0});
    }
    std::fill(dr, dr + spans * 16, 0.0f);
    for (size_t blk = 0; blk < blocks; ++blk) {
      const size_t k0 = blk * 32, k1 = std::min(K, k0 + 32);
      float amax = 0.0f;
      for (size_t k = k0; k < k1; ++k) {
        amax = std::max(amax, std::fabs(xr[k]));
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (size_t k = k0; k < k1; ++k) {
        const float v = xr[k] * inv;           // in [-127, 127]
        const float hi = std::nearbyint(v);    // round half to even
        qr[k] = static_cast<int8_t>(std::clamp(hi, -127.0f, 127.0f));
        if (two_terms) {  // v - hi in [-0.5, 0.5], exact; * 256 exact
          lr[k] = static_cast<int8_t>(std::clamp(std::nearbyint((v - hi) * 256.0f), -127.0f,
                                                 127.0f));
        }
      }
      // the 8 VPDPBUSD lanes (4 elements each) of this block within its 64-element span
      const float d = two_terms ? amax / 127.0f / 256.0f : amax / 127.0f;
      std::fill_n(dr + (blk / 2) * 16 + (blk % 2) * 8, 8, d);
    }
    for (size_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (size_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        s += xr[k];
      }
      sx[m * groups + g] = s;
    }
  }
}

namespace {

#ifdef VUN_X86
#define VUN_Q8_TARGET "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni"

// 16 scales or biases of type ST from p (fewer under `mask`, the others 0) as fp32, exactly.
template <ScaleType ST>
__attribute__((target(VUN_Q8_TARGET))) inline __m512 load16(const void* p, __mmask16 mask) {
  if constexpr (ST == ScaleType::kF32) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    return ST == ScaleType::kF16
        ? _mm512_cvtph_ps(h)
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

constexpr size_t elem_bytes(ScaleType st) {
  return st == ScaleType::kF32 ? 4 : 2;
}

// The scales of span c (elements [64 c, 64 c + 64)) of one row, one per VPDPBUSD lane (lane l
// holds elements 4l..4l+3 of the span): GROUP 16 -> s[4c + l / 4], 32 -> s[2c + l / 8], 64
// (group_size any multiple of 64) -> s[64 c / group_size]. Only the groups of the span's
// `valid` elements are read.
template <int GROUP, ScaleType ST>
__attribute__((target(VUN_Q8_TARGET))) inline __m512 lane_scales(const void* s, size_t c,
                                                                size_t valid,
                                                                size_t group_size) {
  if constexpr (GROUP >= 64) {
    return _mm512_set1_ps(scale_at<ST>(s, c * 64 / group_size));
  } else {
    constexpr size_t per_span = 64 / GROUP;
    const __m512 v = load16<ST>(
        static_cast<const char*>(s) + c * per_span * elem_bytes(ST),
        static_cast<__mmask16>((1u << std::min(per_span, valid / GROUP)) - 1));
    const __m512i idx = GROUP == 16
        ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
        : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, v);
  }
}

// y[m, n + j] for j < 4, m < MR: four whole weight rows from row n.
// The next 4 rows' bytes are prefetched as these are read, at the same offsets: rows are short
// (SmolLM2's: 288 bytes) and the hardware prefetcher alone left the loads waiting.
template <int BITS, int GROUP, ScaleType ST, int MR, bool TWO>
__attribute__((target(VUN_Q8_TARGET))) void q8_block4(const Q8Activations& a, const uint8_t* w8,
                                                      const void* scales, const void* biases,
                                                      float* y, size_t N, size_t K,
                                                      size_t group_size, size_t n) {
  const size_t row_bytes = K * BITS / 8, groups = K / group_size, spans = (K + 63) / 64;
  constexpr size_t eb = elem_bytes(ST);
  const uint8_t* wr[4];
  const char* sr[4];
  const char* br[4];
  for (int j = 0; j < 4; ++j) {
    wr[j] = w8 + (n + j) * row_bytes;
    sr[j] = static_cast<const char*>(scales) + (n + j) * groups * eb;
    br[j] = static_cast<const char*>(biases) + (n + j) * groups * eb;
  }
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) {
      acc[m][j] = _mm512_setzero_ps();
    }
  }
  for (size_t c = 0; c < spans; ++c) {
    const size_t valid = std::min<size_t>(64, K - 64 * c);
    __m512i q[4];
    __m512 s[4];
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[j] + 4 * row_bytes + c * 8 * BITS),
                   _MM_HINT_T0);  // no fault past the weight's end
      q[j] = codes64<BITS>(wr[j] + c * 8 * BITS, valid);
      s[j] = lane_scales<GROUP, ST>(sr[j], c, valid, group_size);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_load_si512(a.xq + (m * spans + c) * 64);
      __m512i lo = _mm512_setzero_si512();
      if constexpr (TWO) {
        lo = _mm512_load_si512(a.xq_lo + (m * spans + c) * 64);
      }
      const __m512 dv = _mm512_load_ps(a.dx + (m * spans + c) * 16);
      for (int j = 0; j < 4; ++j) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[j], xv);
        if constexpr (TWO) {  // 256 * hi + lo: |4 * 255 * 127| * 256 + ... fits in int32
          dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8),
                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[j], lo));
        }
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[j], dv),
                                    acc[m][j]);
      }
    }
  }
  // + sum_g b_g * sum(x over g), 16 groups at a time
  for (int m = 0; m < MR; ++m) {
    const float* sx = a.sx + m * groups;
    for (size_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = groups - g >= 16 ? 0xffff : (1u << (groups - g)) - 1;
      const __m512 xs = _mm512_maskz_loadu_ps(mask, sx + g);
      for (int j = 0; j < 4; ++j) {
        acc[m][j] = _mm512_fmadd_ps(load16<ST>(br[j] + g * eb, mask), xs, acc[m][j]);
      }
    }
    const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128 r = _mm512_castps512_ps128(
        _mm512_permutexvar_ps(lanes, reduce4_512(acc[m][0], acc[m][1], acc[m][2], acc[m][3])));
    _mm_storeu_ps(y + m * N + n, r);
  }
}

using Q8Fn = void (*)(const Q8Activations&, const uint8_t*, const void*, const void*, float*,
                      size_t, size_t, size_t, size_t);

template <int BITS, int GROUP, ScaleType ST, bool TWO>
Q8Fn q8_for_terms(size_t M) {
  switch (M) {
    case 1: return q8_block4<BITS, GROUP, ST, 1, TWO>;
    case 2: return q8_block4<BITS, GROUP, ST, 2, TWO>;
    case 3: return q8_block4<BITS, GROUP, ST, 3, TWO>;
    default: return q8_block4<BITS, GROUP, ST, 4, TWO>;
  }
}

template <int BITS, int GROUP, ScaleType ST>
Q8Fn q8_for_rows(size_t M, bool two) {
  return two ? q8_for_terms<BITS, GROUP, ST, true>(M) : q8_for_terms<BITS, GROUP, ST, false>(M);
}

template <int BITS, ScaleType ST>
Q8Fn q8_for_group(size_t group_size, size_t M, bool two) {
  switch (group_size) {
    case 16: return q8_for_rows<BITS, 16, ST>(M, two);
    case 32: return q8_for_rows<BITS, 32, ST>(M, two);
    default: return q8_for_rows<BITS, 64, ST>(M, two);  // any multiple of 64
  }
}

template <ScaleType ST>
Q8Fn q8_for_type(int bits, size_t group_size, size_t M, bool two) {
  switch (bits) {
    case 2: return q8_for_group<2, ST>(group_size, M, two);
    case 3: return q8_for_group<3, ST>(group_size, M, two);
    case 4: return q8_for_group<4, ST>(group_size, M, two);
    case 5: return q8_for_group<5, ST>(group_size, M, two);
    case 6: return q8_for_group<6, ST>(group_size, M, two);
    default: return q8_for_group<8, ST>(group_size, M, two);
  }
}

Q8Fn q8_for(ScaleType st, int bits, size_t group_size, size_t M, bool two) {
  switch (st) {
    case ScaleType::kF32: return q8_for_type<ScaleType::kF32>(bits, group_size, M, two);
    case ScaleType::kF16: return q8_for_type<ScaleType::kF16>(bits, group_size, M, two);
    default: return q8_for_type<ScaleType::kBF16>(bits, group_size, M, two);
  }
}

bool vnni_vbmi() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512vnni");
}
#endif

}  // namespace

bool q8_usable(size_t K, size_t group_size, int bits) {
#ifdef VUN_X86
  static const bool cpu = vnni_vbmi();
  const bool group_ok = group_size == 16 || group_size == 32 || group_size % 64 == 0;
  const bool bits_ok = bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 ||
                       bits == 8;
  return cpu && isa_cap() >= IsaCap::kAvx512 && bits_ok && group_ok && K % 32 == 0 &&
         K % group_size == 0;
#else
  (void)K; (void)group_size; (void)bits;
  return false;
#endif
}

size_t quantized_gemv_q8(const Q8Activations& a, const uint32_t* wq, const void* scales,
                         const void* biases, ScaleType st, float* y, size_t M, size_t N,
                         size_t K, size_t group_size, int bits, size_t n0, size_t n1) {
#ifdef VUN_X86
  if (!q8_usable(K, group_size, bits) || M < 1) {
    return n0;
  }
  const size_t end = n0 + (n1 - n0) / 4 * 4;
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  const size_t spans = (K + 63) / 64, groups = K / group_size;
  // x's rows in chunks of 4 inside the loop over weight rows: each 4 weight rows are read from
  // memory once per call and from L1 for the other chunks
  const bool two = a.xq_lo != nullptr;
  const Q8Fn full = q8_for(st, bits, group_size, 4, two);
  const Q8Fn last = q8_for(st, bits, group_size, (M - 1) % 4 + 1, two);
  for (size_t n = n0; n < end; n += 4) {
    for (size_t m0 = 0; m0 < M; m0 += 4) {
      const Q8Activations part{a.xq + m0 * spans * 64,
                               two ? a.xq_lo + m0 * spans * 64 : nullptr,
                               a.dx + m0 * spans * 16, a.sx + m0 * groups};
      (M - m0 >= 4 ? full : last)(part, w8, scales, biases, y + m0 * N, N, K, group_size, n);
    }
  }
  return end;
#else
  (void)a; (void)wq; (void)scales; (void)biases; (void)st; (void)y; (void)M; (void)N; (void)K;
  (void)group_size; (void)bits; (void)n1;
  return n0;
#endif
}

}  // namespace vun
