// AVX-512 helpers shared by the quantized kernels: a packed row's codes unpacked to bytes with
// VBMI (the integer gemv in cpu_q8.cpp, the AMX kernels in cpu_amx.cpp) and the 4-way lane
// reduction of the gemvs (cpu_quant.cpp, cpu_q8.cpp). Callers are compiled for (at least) each
// function's target and check the CPU for it first.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define VUN_CODES_TARGET "avx512f,avx512bw,avx512vl,avx512vbmi"

namespace vun {

// cpu_math.cpp's reduce4 (as GCC compiles it there) in intrinsics: the same pairs added in the
// same tree, so the lane sums of a0..a3 land at lanes 0, 4, 8, 12 bit-identical to its result.
__attribute__((target("avx512f"))) inline __m512 reduce4_512(__m512 a0, __m512 a1, __m512 a2,
                                                             __m512 a3) {
  const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                                   _mm512_shuffle_f32x4(a0, a1, 0xee));
  const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                                   _mm512_shuffle_f32x4(a2, a3, 0xee));
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88),
                                 _mm512_shuffle_f32x4(p01, p23, 0xdd));
  const __m512 r = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4e));
  return _mm512_add_ps(r, _mm512_permute_ps(r, 0xb1));
}

// The 16 x 16 matrix of 32-bit lanes r[0..16) transposed in place: lane j of r[i] becomes
// lane i of r[j] (the AMX kernels' tiles; the VNNI GEMM's weight panels).
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int j = 0; j < 8; ++j) {
    t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; ++j) {
    u[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  // u[4j + c], 128-bit lane L: column 4L + c of rows 4j .. 4j + 3.
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// 32 integral floats (a: the first 16) clamped to [-127, 127], as int8: the int8 terms of x
// (the integer kernels' activation quantization).
__attribute__((target("avx512f"))) inline __m256i int8_bytes32(__m512 a, __m512 b) {
  const __m512 ceiling = _mm512_set1_ps(127.0f), floor = _mm512_set1_ps(-127.0f);
  const __m128i lo16 = _mm512_cvtsepi32_epi8(
      _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(a, floor), ceiling)));
  const __m128i hi16 = _mm512_cvtsepi32_epi8(
      _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(b, floor), ceiling)));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo16), hi16, 1);
}

// The codes of `valid` elements (64, or 32) from element 0 at p of a packed row (MLX's layout:
// a little-endian bit stream of BITS per element; p a multiple of 8 elements into the row) as
// bytes, in order, the rest zero; only the valid * BITS / 8 bytes from p are read.
template <int BITS>
__attribute__((target(VUN_CODES_TARGET))) inline __m512i codes64(const uint8_t* p,
                                                                   size_t valid) {
  if constexpr (BITS == 8) {
    return _mm512_maskz_loadu_epi8(valid == 64 ? ~0ull : (1ull << valid) - 1, p);
  } else if constexpr (BITS == 4) {
    // each byte (two codes) widened to a word; the high nibble moved to the word's high byte
    const __m256i b = _mm256_maskz_loadu_epi8(valid == 64 ? ~0u : (1u << valid / 2) - 1, p);
    const __m512i v = _mm512_cvtepu8_epi16(b);
    return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi16(v, 4)),
                            _mm512_set1_epi8(0x0f));
  } else {
    // qword i gathers the BITS bytes of elements 8i..8i+7 (and neighbours above), then
    // VPMULTISHIFTQB takes the 8 bits at bit BITS * j for element 8i + j
    const size_t bytes = valid * BITS / 8;
    const __m512i raw = _mm512_maskz_loadu_epi8((1ull << bytes) - 1, p);
    alignas(64) static const auto gather = [] {
      struct { uint8_t b[64]; } t{};
      for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < 8; ++j) {
          t.b[8 * i + j] = static_cast<uint8_t>(std::min(63, BITS * i + j));
        }
      }
      return t;
    }();
    alignas(64) static const auto shifts = [] {
      struct { uint8_t b[64]; } t{};
      for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < 8; ++j) {
          t.b[8 * i + j] = static_cast<uint8_t>(BITS * j);
        }
      }
      return t;
    }();
    const __m512i g = _mm512_permutexvar_epi8(_mm512_load_si512(gather.b), raw);
    const __m512i f = _mm512_multishift_epi64_epi8(_mm512_load_si512(shifts.b), g);
    return _mm512_and_si512(f, _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1)));
  }
}

}  // namespace vun
#endif
