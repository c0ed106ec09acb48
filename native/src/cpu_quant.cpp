// Dequantization of MLX's affine-quantized weights (mx.quantize's layout) on the CPU.
//
// Rounded exactly as MLX 0.32.4's own dequantize: scale * q, rounded, plus bias, rounded. This
// file is therefore compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add
// rounds once and differs in the last bit for ~20% of weights (measured on random data), which
// would make a quantized model's outputs differ from the same model dequantized at load.
//
// x86_64 gets AVX-512 and AVX2 variants written with intrinsics (GCC's generic vectors lowered
// the byte -> int widening to scalar inserts), chosen once by what the CPU supports
// (VLLM_UNIFIED_CPU_ISA=avx2|portable forces a lower one); other CPUs run the portable loops.

#include <cstddef>
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <cstdint>

#include "cpu_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VUN_X86 1
#endif

namespace vun {

namespace {

// The instruction set the dispatched kernels below may use: the CPU's best, or lower when
// VLLM_UNIFIED_CPU_ISA=avx2|portable asks (tests run every variant on one machine that way).
// 2: AVX-512, 1: AVX2, 0: portable C++.
int isa_level() {
  int level = 0;
#ifdef VUN_X86
  __builtin_cpu_init();
  level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
  if (const char* env = std::getenv("VLLM_UNIFIED_CPU_ISA"); env != nullptr) {
    const std::string want(env);
    const int cap = want == "portable" ? 0 : want == "avx2" ? 1 : 2;
    level = std::min(level, cap);
  }
  return level;
}

using RowsFn = void (*)(const uint32_t*, const float*, const float*, float*, size_t, size_t,
                        size_t, size_t);

// Element k of a row: bits [bits * (k % per_word), ...) of word k / per_word, low bits first;
// with little-endian words that is byte k (8 bits) or a nibble of byte k / 2 (4 bits: low
// nibble for even k).
template <int BITS>
void rows_portable(const uint32_t* wq, const float* scales, const float* biases, float* out,
                   size_t r0, size_t r1, size_t K, size_t group_size) {
  constexpr size_t per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  for (size_t r = r0; r < r1; ++r) {
    const uint32_t* wr = wq + r * (K / per_word);
    const float* sr = scales + r * (K / group_size);
    const float* br = biases + r * (K / group_size);
    float* o = out + (r - r0) * K;
    for (size_t k = 0; k < K; ++k) {
      const uint32_t q = (wr[k / per_word] >> (BITS * (k % per_word))) & mask;
      o[k] = sr[k / group_size] * static_cast<float>(q) + br[k / group_size];
    }
  }
}

#ifdef VUN_X86
// The 16 values of elements [k, k + 16) as bytes in order, from the row's bytes at k * BITS / 8.
template <int BITS>
__attribute__((target("avx2"))) inline __m128i bytes16(const uint8_t* p) {
  if constexpr (BITS == 8) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  }
}

template <int BITS>
__attribute__((target("avx512f,avx2"))) void rows_avx512(
    const uint32_t* wq, const float* scales, const float* biases, float* out, size_t r0,
    size_t r1, size_t K, size_t group_size) {
  const size_t row_bytes = K * BITS / 8;
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(wq) + r * row_bytes;
    const float* sr = scales + r * (K / group_size);
    const float* br = biases + r * (K / group_size);
    float* o = out + (r - r0) * K;
    for (size_t g = 0; g < K / group_size; ++g) {
      const __m512 s = _mm512_set1_ps(sr[g]);
      const __m512 b = _mm512_set1_ps(br[g]);
      for (size_t k = g * group_size; k < (g + 1) * group_size; k += 16) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16<BITS>(wr + k * BITS / 8)));
        _mm512_storeu_ps(o + k, _mm512_add_ps(_mm512_mul_ps(q, s), b));
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx2"))) void rows_avx2(
    const uint32_t* wq, const float* scales, const float* biases, float* out, size_t r0,
    size_t r1, size_t K, size_t group_size) {
  const size_t row_bytes = K * BITS / 8;
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(wq) + r * row_bytes;
    const float* sr = scales + r * (K / group_size);
    const float* br = biases + r * (K / group_size);
    float* o = out + (r - r0) * K;
    for (size_t g = 0; g < K / group_size; ++g) {
      const __m256 s = _mm256_set1_ps(sr[g]);
      const __m256 b = _mm256_set1_ps(br[g]);
      for (size_t k = g * group_size; k < (g + 1) * group_size; k += 16) {
        const __m128i v = bytes16<BITS>(wr + k * BITS / 8);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        _mm256_storeu_ps(o + k, _mm256_add_ps(_mm256_mul_ps(lo, s), b));
        _mm256_storeu_ps(o + k + 8, _mm256_add_ps(_mm256_mul_ps(hi, s), b));
      }
    }
  }
}
#endif

template <int BITS>
RowsFn pick() {
#ifdef VUN_X86
  switch (isa_level()) {
    case 2:
      return rows_avx512<BITS>;
    case 1:
      return rows_avx2<BITS>;
    default:
      break;
  }
#endif
  return rows_portable<BITS>;
}

} // namespace

void dequantize_rows_f32(
    const uint32_t* wq, const float* scales, const float* biases, float* out, size_t r0,
    size_t r1, size_t K, size_t group_size, int bits) {
  static const RowsFn four = pick<4>();
  static const RowsFn eight = pick<8>();
  (bits == 4 ? four : eight)(wq, scales, biases, out, r0, r1, K, group_size);
}

namespace {

// Panels (see cpu_math.h): the words of 16 weight rows at one word index are read into one
// vector (a gather), then each element position in the word is one shift, mask, convert,
// multiply and add for all 16 columns; no transpose.

template <int BITS>
void panel_portable(const uint32_t* wq, const float* scales, const float* biases, float* panel,
                    size_t n, size_t count, size_t K, size_t k0, size_t kc, size_t group_size) {
  constexpr size_t per_word = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  for (size_t j = 0; j < kPanel; ++j) {
    for (size_t k = k0; k < k0 + kc; ++k) {
      float v = 0.f;  // columns past count are 0
      if (j < count) {
        const size_t r = n + j;
        const uint32_t q = (wq[r * (K / per_word) + k / per_word] >> (BITS * (k % per_word))) & mask;
        const size_t g = r * (K / group_size) + k / group_size;
        v = scales[g] * static_cast<float>(q) + biases[g];
      }
      panel[(k - k0) * kPanel + j] = v;
    }
  }
}

#ifdef VUN_X86
// In-register transpose of 16 rows of 16 32-bit values: on return r[c] holds column c.
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4i + c]: rows 4i..4i+3 of columns c, c + 4, c + 8, c + 12 (one per 128-bit lane).
  __m512i u[16];
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[c + 4] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// 16 columns at a time: up to 16 words of each of the 16 rows loaded contiguously (masked at
// the chunk's end) and transposed in registers, so each vector holds one word index of all 16
// rows; the chunk's scales and biases the same way. No gathers (slow on CPUs with the
// gather-data-sampling mitigation).
template <int BITS>
__attribute__((target("avx512f"))) void panel_avx512(
    const uint32_t* wq, const float* scales, const float* biases, float* panel, size_t n,
    size_t count, size_t K, size_t k0, size_t kc, size_t group_size) {
  constexpr size_t per_word = 32 / BITS;
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  const size_t wpr = K / per_word;
  const size_t gpr = K / group_size;
  for (size_t c0 = 0; c0 < kPanel; c0 += 16) {
    const uint32_t* rows[16];
    const float* srow[16];
    const float* brow[16];
    __mmask16 live = 0;
    for (size_t j = 0; j < 16; ++j) {
      const bool on = c0 + j < count;
      const size_t r = n + (on ? c0 + j : 0);  // dead lanes read a real row, then get 0
      rows[j] = wq + r * wpr;
      srow[j] = scales + r * gpr;
      brow[j] = biases + r * gpr;
      live = static_cast<__mmask16>(live | (on ? 1u << j : 0u));
    }
    for (size_t kw0 = k0 / per_word; kw0 < (k0 + kc) / per_word; kw0 += 16) {
      const size_t nw = std::min<size_t>(16, (k0 + kc) / per_word - kw0);
      const __mmask16 wmask = static_cast<__mmask16>((1u << nw) - 1);
      __m512i w[16];
      for (int j = 0; j < 16; ++j) {
        w[j] = _mm512_maskz_loadu_epi32(wmask, rows[j] + kw0);
      }
      transpose16(w);
      // The groups this word chunk covers: g0 .. g0 + ng - 1 (ng <= 16: groups >= 16 elements).
      const size_t g0 = kw0 * per_word / group_size;
      const size_t ng = (nw * per_word + group_size - 1) / group_size;
      const __mmask16 gmask = static_cast<__mmask16>((1u << ng) - 1);
      __m512i sv[16];
      __m512i bv[16];
      for (int j = 0; j < 16; ++j) {
        sv[j] = _mm512_maskz_loadu_epi32(gmask, srow[j] + g0);
        bv[j] = _mm512_maskz_loadu_epi32(gmask, brow[j] + g0);
      }
      transpose16(sv);
      transpose16(bv);
      for (size_t wi = 0; wi < nw; ++wi) {
        const size_t gi = (kw0 + wi) * per_word / group_size - g0;
        // Dead lanes: scale and bias 0, so the column is exactly 0.0f.
        const __m512 s = _mm512_maskz_mov_ps(live, _mm512_castsi512_ps(sv[gi]));
        const __m512 b = _mm512_maskz_mov_ps(live, _mm512_castsi512_ps(bv[gi]));
        for (size_t t = 0; t < per_word; ++t) {
          const __m512i q = _mm512_and_si512(_mm512_srli_epi32(w[wi], BITS * t), mask);
          const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), b);
          _mm512_storeu_ps(panel + ((kw0 + wi) * per_word + t - k0) * kPanel + c0, v);
        }
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx2"))) void panel_avx2(
    const uint32_t* wq, const float* scales, const float* biases, float* panel, size_t n,
    size_t count, size_t K, size_t k0, size_t kc, size_t group_size) {
  constexpr size_t per_word = 32 / BITS;
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const int32_t wpr = static_cast<int32_t>(K / per_word);
  const int32_t gpr = static_cast<int32_t>(K / group_size);
  for (size_t c0 = 0; c0 < kPanel; c0 += 8) {
    alignas(32) int32_t widx[8];
    alignas(32) int32_t sidx[8];
    alignas(32) int32_t on[8];
    for (size_t j = 0; j < 8; ++j) {
      const bool live = c0 + j < count;
      const int32_t r = static_cast<int32_t>(n + (live ? c0 + j : 0));
      widx[j] = r * wpr;
      sidx[j] = r * gpr;
      on[j] = live ? -1 : 0;
    }
    const __m256i wbase = _mm256_load_si256(reinterpret_cast<const __m256i*>(widx));
    const __m256i sbase = _mm256_load_si256(reinterpret_cast<const __m256i*>(sidx));
    const __m256 live = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(on)));
    for (size_t g = k0 / group_size; g < (k0 + kc) / group_size; ++g) {
      const __m256i gi = _mm256_add_epi32(sbase, _mm256_set1_epi32(static_cast<int32_t>(g)));
      const __m256 s = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), scales, gi, live, 4);
      const __m256 b = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), biases, gi, live, 4);
      const size_t kw0 = g * group_size / per_word;
      for (size_t kw = kw0; kw < kw0 + group_size / per_word; ++kw) {
        const __m256i wi = _mm256_add_epi32(wbase, _mm256_set1_epi32(static_cast<int32_t>(kw)));
        const __m256i words =
            _mm256_i32gather_epi32(reinterpret_cast<const int*>(wq), wi, 4);
        for (size_t t = 0; t < per_word; ++t) {
          const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, BITS * t), mask);
          const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), s), b);
          _mm256_storeu_ps(panel + (kw * per_word + t - k0) * kPanel + c0, v);
        }
      }
    }
  }
}
#endif

using PanelFn = void (*)(const uint32_t*, const float*, const float*, float*, size_t, size_t,
                         size_t, size_t, size_t, size_t);

template <int BITS>
PanelFn pick_panel() {
#ifdef VUN_X86
  switch (isa_level()) {
    case 2:
      return panel_avx512<BITS>;
    case 1:
      return panel_avx2<BITS>;
    default:
      break;
  }
#endif
  return panel_portable<BITS>;
}

} // namespace

void dequantize_panel_f32(
    const uint32_t* wq, const float* scales, const float* biases, float* panel, size_t n,
    size_t count, size_t K, size_t k0, size_t kc, size_t group_size, int bits) {
  static const PanelFn four = pick_panel<4>();
  static const PanelFn eight = pick_panel<8>();
  // The gathers index words and groups with int32 lanes: matrices beyond that take the
  // portable loop.
  const size_t words = (n + kPanel) * (K * static_cast<size_t>(bits) / 32);
  if (words >= static_cast<size_t>(INT32_MAX)) {
    (bits == 4 ? panel_portable<4> : panel_portable<8>)(
        wq, scales, biases, panel, n, count, K, k0, kc, group_size);
    return;
  }
  (bits == 4 ? four : eight)(wq, scales, biases, panel, n, count, K, k0, kc, group_size);
}

} // namespace vun
