// x @ dequantize(w).T for 5 rows of x and more on AVX-512 VNNI without AMX: the integer
// arithmetic of the AMX-INT8 tiles (cpu_amx.cpp) in zmm registers.
//
// x is quantized per block of 32 elements as quantized_gemv_q8 quantizes it (one int8 term, or
// two: 256 hi + lo), rows stored as they are, so 4 consecutive elements of a row are one dword
// that VPDPBUSD broadcasts. The weight's codes are unpacked (VBMI) and transposed into panels
// of 16 weight rows: per 4 consecutive k, 64 bytes (4 codes of each of the 16 rows), so that one
// VPDPBUSD multiplies 16 weight rows by 4 elements of one x row. Each panel of a work item is
// unpacked once and reused by every row of x; the item's scales and biases are widened to fp32
// beside it.
//
// Per output y[m, n] and segment of D = 32 elements (16 for groups of 16): the integer sum of
// q times each term of x, exact in int32 (|32 * 255 * 127| * 257 < 2^31), then in fp32
//   acc = fma(float(256 hi_sum + lo_sum), s[n, g] * dx[m, blk], acc)       (two terms)
//   acc = fma(b[n, g], sum of x over g, acc)        at the first segment of each group
// in k order: the AMX-INT8 epilogue's operations in its order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VUN_X86 1
#endif

namespace vun {

namespace {

constexpr size_t kBlockRows = 16;  // weight rows per panel block: one zmm of outputs

size_t round64(size_t bytes) {
  return (bytes + 63) / 64 * 64;
}

}  // namespace

Q8GemmXLayout q8_gemm_x_layout(size_t M, size_t K, size_t group_size, bool two_terms) {
  Q8GemmXLayout l{};
  l.M = M;
  l.K = K;
  l.groups = K / group_size;
  l.hi = 0;
  l.lo = round64(M * K);
  l.dx = two_terms ? 2 * l.lo : l.lo;
  l.sx = l.dx + round64(M * (K / 32) * sizeof(float));
  l.bytes = l.sx + round64(M * l.groups * sizeof(float));
  return l;
}

size_t q8_gemm_panel_bytes(size_t K, size_t group_size) {
  return kBlockRows * K + 2 * (K / group_size) * kBlockRows * sizeof(float);
}

#ifdef VUN_X86

#define VUN_GEMM_TARGET "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx512dq"

namespace {

// Panel block nb of w (rows 16 nb .. 16 nb + 15; rows past N zero): codes at dst (K / 4 x 64
// bytes), then the fp32 scales and biases [groups][16].
template <int BITS, ScaleType ST>
__attribute__((target(VUN_GEMM_TARGET))) void pack_block(
    const uint8_t* w8, const void* scales, const void* biases, size_t N, size_t K,
    size_t group_size, size_t nb, uint8_t* dst) {
  const size_t row_bytes = K * BITS / 8, groups = K / group_size;
  const size_t rows = std::min(kBlockRows, N - nb * kBlockRows);
  for (size_t k = 0; k < K; k += 64) {
    const size_t valid = std::min<size_t>(64, K - k);
    __m512i t[16];
    for (size_t r = 0; r < kBlockRows; ++r) {
      t[r] = r < rows ? codes64<BITS>(w8 + (nb * kBlockRows + r) * row_bytes + k * BITS / 8,
                                      valid)
                      : _mm512_setzero_si512();
    }
    transpose16(t);  // t[c]: elements k + 4c .. k + 4c + 3 of the 16 rows
    if (valid == 64) {  // a constant count: 16 stores from registers (else GCC made the loop a
                        // memcpy of the array, spilled to the stack, by rep movsq)
#pragma GCC unroll 16
      for (size_t c = 0; c < 16; ++c) {
        _mm512_store_si512(dst + (k / 4 + c) * 64, t[c]);
      }
    } else {
      for (size_t c = 0; c < valid / 4; ++c) {
        _mm512_store_si512(dst + (k / 4 + c) * 64, t[c]);
      }
    }
  }
  widen_panel_scales<ST>(scales, biases, groups, nb * kBlockRows, rows, kBlockRows,
                         reinterpret_cast<float*>(dst + kBlockRows * K));
}

using PackFn = void (*)(const uint8_t*, const void*, const void*, size_t, size_t, size_t, size_t,
                        uint8_t*);

template <ScaleType ST>
PackFn pack_for_type(int bits) {
  switch (bits) {
    case 2: return pack_block<2, ST>;
    case 3: return pack_block<3, ST>;
    case 4: return pack_block<4, ST>;
    case 5: return pack_block<5, ST>;
    case 6: return pack_block<6, ST>;
    default: return pack_block<8, ST>;
  }
}

PackFn pack_for(ScaleType st, int bits) {
  switch (st) {
    case ScaleType::kF32: return pack_for_type<ScaleType::kF32>(bits);
    case ScaleType::kF16: return pack_for_type<ScaleType::kF16>(bits);
    default: return pack_for_type<ScaleType::kBF16>(bits);
  }
}

// y[m0 + i, 16 nb + 16 j + lane] for i < MR, j < NR (NR panel blocks from `panel`, each
// panel_bytes apart): segments of D elements, the epilogue of each as the file's header says.
template <bool TWO, size_t D, int MR, int NR>
__attribute__((target(VUN_GEMM_TARGET))) void micro(const uint8_t* xbuf, const Q8GemmXLayout& l,
                                                    const uint8_t* panel, size_t panel_bytes,
                                                    size_t group_size, float* y, size_t N,
                                                    size_t m0, size_t n0) {
  const size_t K = l.K, groups = l.groups, blocks = K / 32;
  const auto* hi = reinterpret_cast<const int8_t*>(xbuf + l.hi) + m0 * K;
  const auto* lo = reinterpret_cast<const int8_t*>(xbuf + l.lo) + m0 * K;
  const auto* dx = reinterpret_cast<const float*>(xbuf + l.dx) + m0 * blocks;
  const auto* sx = reinterpret_cast<const float*>(xbuf + l.sx) + m0 * groups;
  const uint8_t* codes[NR];
  const float* s[NR];
  const float* b[NR];
  for (int j = 0; j < NR; ++j) {
    codes[j] = panel + j * panel_bytes;
    s[j] = reinterpret_cast<const float*>(codes[j] + kBlockRows * K);
    b[j] = s[j] + groups * kBlockRows;
  }
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      acc[i][j] = _mm512_setzero_ps();
    }
  }
  for (size_t k0 = 0; k0 < K; k0 += D) {
    __m512i sh[MR][NR], sl[MR][NR];
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        sh[i][j] = _mm512_setzero_si512();
        sl[i][j] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (size_t k = k0; k < k0 + D; k += 4) {
      __m512i w[NR];
      for (int j = 0; j < NR; ++j) {
        w[j] = _mm512_load_si512(codes[j] + k * 16);
      }
      for (int i = 0; i < MR; ++i) {
        int32_t word;
        std::memcpy(&word, hi + i * K + k, 4);
        const __m512i xh = _mm512_set1_epi32(word);
        for (int j = 0; j < NR; ++j) {
          sh[i][j] = _mm512_dpbusd_epi32(sh[i][j], w[j], xh);
        }
        if constexpr (TWO) {
          std::memcpy(&word, lo + i * K + k, 4);
          const __m512i xl = _mm512_set1_epi32(word);
          for (int j = 0; j < NR; ++j) {
            sl[i][j] = _mm512_dpbusd_epi32(sl[i][j], w[j], xl);
          }
        }
      }
    }
    const size_t g = k0 / group_size;
    const bool first = k0 % group_size == 0;
    for (int i = 0; i < MR; ++i) {
      const __m512 dxv = _mm512_set1_ps(dx[i * blocks + k0 / 32]);
      const __m512 sxv = _mm512_set1_ps(sx[i * groups + g]);
      for (int j = 0; j < NR; ++j) {
        __m512i tot = sh[i][j];
        if constexpr (TWO) {
          tot = _mm512_add_epi32(_mm512_slli_epi32(tot, 8), sl[i][j]);
        }
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot),
                                    _mm512_mul_ps(_mm512_load_ps(s[j] + g * kBlockRows), dxv),
                                    acc[i][j]);
        if (first) {
          acc[i][j] = _mm512_fmadd_ps(_mm512_load_ps(b[j] + g * kBlockRows), sxv, acc[i][j]);
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const size_t n = n0 + j * kBlockRows;
    const size_t cols = std::min(kBlockRows, N - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    for (int i = 0; i < MR; ++i) {
      _mm512_mask_storeu_ps(y + (m0 + i) * N + n, mask, acc[i][j]);
    }
  }
}

using MicroFn = void (*)(const uint8_t*, const Q8GemmXLayout&, const uint8_t*, size_t, size_t,
                         float*, size_t, size_t, size_t);

template <bool TWO, size_t D, int NR>
MicroFn micro_rows(size_t rows) {
  switch (rows) {
    case 1: return micro<TWO, D, 1, NR>;
    case 2: return micro<TWO, D, 2, NR>;
    case 3: return micro<TWO, D, 3, NR>;
    default: return micro<TWO, D, 4, NR>;
  }
}

template <bool TWO, size_t D>
MicroFn micro_for(size_t rows, int nr) {
  return nr == 2 ? micro_rows<TWO, D, 2>(rows) : micro_rows<TWO, D, 1>(rows);
}

MicroFn micro_fn(bool two, size_t group_size, size_t rows, int nr) {
  if (group_size == 16) {
    return two ? micro_for<true, 16>(rows, nr) : micro_for<false, 16>(rows, nr);
  }
  return two ? micro_for<true, 32>(rows, nr) : micro_for<false, 32>(rows, nr);
}

}  // namespace

__attribute__((target(VUN_GEMM_TARGET))) void q8_gemm_prepare_x(
    const float* x, const Q8GemmXLayout& l, size_t group_size, bool two_terms, uint8_t* buf,
    size_t m0, size_t m1) {
  const size_t K = l.K, blocks = K / 32;
  auto* hi = reinterpret_cast<int8_t*>(buf + l.hi);
  auto* lo = reinterpret_cast<int8_t*>(buf + l.lo);
  auto* dx = reinterpret_cast<float*>(buf + l.dx);
  auto* sx = reinterpret_cast<float*>(buf + l.sx);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // rint: ties to even
  for (size_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    for (size_t blk = 0; blk < blocks; ++blk) {
      const __m512 x0 = _mm512_loadu_ps(xr + 32 * blk), x1 = _mm512_loadu_ps(xr + 32 * blk + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512 v0 = _mm512_mul_ps(x0, inv), v1 = _mm512_mul_ps(x1, inv);
      const __m512 h0 = _mm512_roundscale_ps(v0, kRound), h1 = _mm512_roundscale_ps(v1, kRound);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + m * K + 32 * blk),
                          int8_bytes32(h0, h1));
      if (two_terms) {
        const __m512 scale = _mm512_set1_ps(256.0f);
        const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v0, h0), scale), kRound);
        const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v1, h1), scale), kRound);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + m * K + 32 * blk),
                            int8_bytes32(r0, r1));
      }
      dx[m * blocks + blk] = two_terms ? amax / 127.0f / 256.0f : amax / 127.0f;
    }
    // each group summed in order, as the AMX-INT8 path sums; the groups' chains interleaved
    // (one add of each group per step), so that they overlap instead of waiting on each other
    float* sr = sx + m * l.groups;
    std::fill(sr, sr + l.groups, 0.0f);
    for (size_t i = 0; i < group_size; ++i) {
      for (size_t g = 0; g < l.groups; ++g) {
        sr[g] += xr[g * group_size + i];
      }
    }
  }
}

void q8_gemm_pack(const uint32_t* wq, const void* scales, const void* biases, ScaleType st,
                  size_t N, size_t K, size_t group_size, int bits, size_t nb0, size_t nb1,
                  uint8_t* panel) {
  const PackFn pack = pack_for(st, bits);
  const size_t bytes = q8_gemm_panel_bytes(K, group_size);
  for (size_t nb = nb0; nb < nb1; ++nb) {
    pack(reinterpret_cast<const uint8_t*>(wq), scales, biases, N, K, group_size, nb,
         panel + (nb - nb0) * bytes);
  }
}

void q8_gemm_compute(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint8_t* panel,
                     float* y, size_t N, size_t group_size, bool two_terms, size_t nb0,
                     size_t nb1, size_t m0, size_t m1) {
  constexpr size_t kChunkRows = 64;  // x's rows that stay in L2 while every panel pair passes
  const size_t bytes = q8_gemm_panel_bytes(l.K, group_size);
  for (size_t c0 = m0; c0 < m1; c0 += kChunkRows) {
    const size_t c1 = std::min(m1, c0 + kChunkRows);
    for (size_t nb = nb0; nb < nb1; nb += 2) {
      const int nr = nb + 1 < nb1 ? 2 : 1;
      const MicroFn full = micro_fn(two_terms, group_size, 4, nr);
      for (size_t m = c0; m < c1; m += 4) {
        const MicroFn fn = c1 - m >= 4 ? full : micro_fn(two_terms, group_size, c1 - m, nr);
        fn(xbuf, l, panel + (nb - nb0) * bytes, bytes, group_size, y, N, m, nb * kBlockRows);
      }
    }
  }
}

#else

void q8_gemm_prepare_x(const float*, const Q8GemmXLayout&, size_t, bool, uint8_t*, size_t,
                       size_t) {
  std::abort();
}
void q8_gemm_pack(const uint32_t*, const void*, const void*, ScaleType, size_t, size_t, size_t,
                  int, size_t, size_t, uint8_t*) {
  std::abort();
}
void q8_gemm_compute(const uint8_t*, const Q8GemmXLayout&, const uint8_t*, float*, size_t,
                     size_t, bool, size_t, size_t, size_t, size_t) {
  std::abort();
}

#endif

}  // namespace vun
