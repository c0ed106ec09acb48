// x @ dequantize(w).T for 5 rows of x and more on AVX2 (CPUs without AVX-512 VNNI): the
// arithmetic of the AVX-512 VNNI GEMM (cpu_q8_gemm.cpp) in ymm registers, bit-identical to it.
//
// x is quantized per block of 32 elements exactly as q8_gemm_prepare_x quantizes it (one int8
// term hi, or two: hi and lo), then held as one int16 per element: x16 = hi (one term) or
// 256 hi + lo (two terms; |x16| <= 32639, exact in int16). The weight's codes are unpacked
// (portable shifts: no PDEP, no VBMI) and widened to int16 in panels of 8 weight rows: per 2
// consecutive k, 32 bytes (2 codes of each of the 8 rows), so that one VPMADDWD multiplies 8
// weight rows by 2 elements of one x row and adds the pair. Each panel of a work item is
// unpacked once and reused by every row of x; its scales and biases are widened to fp32 beside
// it.
//
// Per output y[m, n] and segment of D = 32 elements (16 for groups of 16): the integer sum of
// q times x16, exact in int32 (32 * 255 * 32639 < 2^31) and equal to cpu_q8_gemm.cpp's
// 256 hi_sum + lo_sum, then in fp32, per output lane in the same order as there:
//   acc = fma(float(sum), s[n, g] * dx[m, blk], acc)
//   acc = fma(b[n, g], sum of x over g, acc)        at the first segment of each group

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VUN_X86 1
#endif

namespace vun {

namespace {

constexpr size_t kBlockRows = 8;  // weight rows per panel block: one ymm of outputs

size_t round64(size_t bytes) {
  return (bytes + 63) / 64 * 64;
}

}  // namespace

Q8GemmXLayout q8_avx2_x_layout(size_t M, size_t K, size_t group_size) {
  Q8GemmXLayout l{};
  l.M = M;
  l.K = K;
  l.groups = K / group_size;
  l.hi = 0;  // x16 [M, K] int16
  l.lo = 0;  // unused: both terms live in x16
  l.dx = round64(M * K * sizeof(int16_t));
  l.sx = l.dx + round64(M * (K / 32) * sizeof(float));
  l.bytes = l.sx + round64(M * l.groups * sizeof(float));
  return l;
}

size_t q8_avx2_panel_bytes(size_t K, size_t group_size) {
  return kBlockRows * K * sizeof(int16_t) + 2 * (K / group_size) * kBlockRows * sizeof(float);
}

#ifdef VUN_X86

#define VUN_AVX2_TARGET "avx2,fma"

namespace {

bool avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

template <ScaleType ST>
inline float widen1(const void* p, size_t i) {
  if constexpr (ST == ScaleType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == ScaleType::kF16) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// The K codes of one packed row (MLX's layout: a little-endian bit stream of BITS per element,
// K a multiple of 8) as bytes: 8 elements are BITS whole bytes.
template <int BITS>
void unpack_row(const uint8_t* p, size_t K, uint8_t* out) {
  constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
  for (size_t k = 0; k < K; k += 8, p += BITS) {
    uint64_t v = 0;
    for (int i = 0; i < BITS; ++i) {
      v |= static_cast<uint64_t>(p[i]) << (8 * i);
    }
    for (int j = 0; j < 8; ++j) {
      out[k + j] = static_cast<uint8_t>((v >> (BITS * j)) & mask);
    }
  }
}

// Panel block nb of w (rows 8 nb .. 8 nb + 7; rows past N zero): int16 codes at dst, element
// k of row r at (k / 2) * 16 + 2 r + k % 2, then the fp32 scales and biases [groups][8].
template <int BITS, ScaleType ST>
__attribute__((target(VUN_AVX2_TARGET))) void pack_block(
    const uint8_t* w8, const void* scales, const void* biases, size_t N, size_t K,
    size_t group_size, size_t nb, uint8_t* dst) {
  const size_t row_bytes = K * BITS / 8, groups = K / group_size;
  const size_t rows = std::min(kBlockRows, N - nb * kBlockRows);
  auto* codes = reinterpret_cast<int16_t*>(dst);
  alignas(32) uint8_t row[256];
  // 128 elements of each row at a time: interleaved as pairs of k per row
  for (size_t k0 = 0; k0 < K; k0 += 128) {
    const size_t len = std::min<size_t>(128, K - k0);
    for (size_t r = 0; r < kBlockRows; ++r) {
      if (r < rows) {
        unpack_row<BITS>(w8 + (nb * kBlockRows + r) * row_bytes + k0 * BITS / 8, len, row);
      } else {
        std::memset(row, 0, len);
      }
      for (size_t k = 0; k < len; k += 2) {
        int16_t* d = codes + (k0 + k) / 2 * 16 + 2 * r;
        d[0] = row[k];
        d[1] = row[k + 1];
      }
    }
  }
  auto* s = reinterpret_cast<float*>(dst + kBlockRows * K * sizeof(int16_t));
  float* b = s + groups * kBlockRows;
  for (size_t g = 0; g < groups; ++g) {
    for (size_t r = 0; r < kBlockRows; ++r) {
      const size_t n = nb * kBlockRows + r;
      s[g * kBlockRows + r] = r < rows ? widen1<ST>(scales, n * groups + g) : 0.0f;
      b[g * kBlockRows + r] = r < rows ? widen1<ST>(biases, n * groups + g) : 0.0f;
    }
  }
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

// y[m0 + i, n0 + 8 j + lane] for i < MR, j < NR (NR panel blocks from `panel`, each
// panel_bytes apart): segments of D elements, the epilogue of each as the file's header says.
template <size_t D, int MR, int NR>
__attribute__((target(VUN_AVX2_TARGET))) void micro(const uint8_t* xbuf, const Q8GemmXLayout& l,
                                                    const uint8_t* panel, size_t panel_bytes,
                                                    size_t group_size, float* y, size_t N,
                                                    size_t m0, size_t n0) {
  const size_t K = l.K, groups = l.groups, blocks = K / 32;
  const auto* x16 = reinterpret_cast<const int16_t*>(xbuf + l.hi) + m0 * K;
  const auto* dx = reinterpret_cast<const float*>(xbuf + l.dx) + m0 * blocks;
  const auto* sx = reinterpret_cast<const float*>(xbuf + l.sx) + m0 * groups;
  const uint8_t* codes[NR];
  const float* s[NR];
  const float* b[NR];
  for (int j = 0; j < NR; ++j) {
    codes[j] = panel + j * panel_bytes;
    s[j] = reinterpret_cast<const float*>(codes[j] + kBlockRows * K * sizeof(int16_t));
    b[j] = s[j] + groups * kBlockRows;
  }
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      acc[i][j] = _mm256_setzero_ps();
    }
  }
  for (size_t k0 = 0; k0 < K; k0 += D) {
    __m256i sum[MR][NR];
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        sum[i][j] = _mm256_setzero_si256();
      }
    }
#pragma GCC unroll 16
    for (size_t k = k0; k < k0 + D; k += 2) {
      __m256i w[NR];
      for (int j = 0; j < NR; ++j) {
        w[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j] + k * 16));
      }
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, x16 + i * K + k, 4);
        const __m256i xv = _mm256_set1_epi32(pair);
        for (int j = 0; j < NR; ++j) {
          sum[i][j] = _mm256_add_epi32(sum[i][j], _mm256_madd_epi16(w[j], xv));
        }
      }
    }
    const size_t g = k0 / group_size;
    const bool first = k0 % group_size == 0;
    for (int i = 0; i < MR; ++i) {
      const __m256 dxv = _mm256_set1_ps(dx[i * blocks + k0 / 32]);
      const __m256 sxv = _mm256_set1_ps(sx[i * groups + g]);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][j]),
                                    _mm256_mul_ps(_mm256_load_ps(s[j] + g * kBlockRows), dxv),
                                    acc[i][j]);
        if (first) {
          acc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(b[j] + g * kBlockRows), sxv, acc[i][j]);
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const size_t n = n0 + j * kBlockRows;
    const size_t cols = std::min(kBlockRows, N - n);
    for (int i = 0; i < MR; ++i) {
      if (cols == kBlockRows) {
        _mm256_storeu_ps(y + (m0 + i) * N + n, acc[i][j]);
      } else {
        alignas(32) float part[kBlockRows];
        _mm256_store_ps(part, acc[i][j]);
        std::memcpy(y + (m0 + i) * N + n, part, cols * sizeof(float));
      }
    }
  }
}

using MicroFn = void (*)(const uint8_t*, const Q8GemmXLayout&, const uint8_t*, size_t, size_t,
                         float*, size_t, size_t, size_t);

template <size_t D, int NR>
MicroFn micro_rows(size_t rows) {
  switch (rows) {
    case 1: return micro<D, 1, NR>;
    case 2: return micro<D, 2, NR>;
    case 3: return micro<D, 3, NR>;
    default: return micro<D, 4, NR>;
  }
}

MicroFn micro_fn(size_t group_size, size_t rows, int nr) {
  if (group_size == 16) {
    return nr == 2 ? micro_rows<16, 2>(rows) : micro_rows<16, 1>(rows);
  }
  return nr == 2 ? micro_rows<32, 2>(rows) : micro_rows<32, 1>(rows);
}

}  // namespace

bool q8_avx2_usable(size_t K, size_t group_size, int bits) {
  static const bool cpu = avx2_fma();
  const bool group_ok = group_size == 16 || group_size == 32 || group_size % 64 == 0;
  const bool bits_ok = bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 ||
                       bits == 8;
  return cpu && isa_cap() >= IsaCap::kAvx2 && bits_ok && group_ok && K % 32 == 0 &&
         K % group_size == 0;
}

__attribute__((target(VUN_AVX2_TARGET))) void q8_avx2_prepare_x(
    const float* x, const Q8GemmXLayout& l, size_t group_size, bool two_terms, uint8_t* buf,
    size_t m0, size_t m1) {
  const size_t K = l.K, blocks = K / 32;
  auto* x16 = reinterpret_cast<int16_t*>(buf + l.hi);
  auto* dx = reinterpret_cast<float*>(buf + l.dx);
  auto* sx = reinterpret_cast<float*>(buf + l.sx);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // rint: ties to even
  const __m256 ceiling = _mm256_set1_ps(127.0f), floor = _mm256_set1_ps(-127.0f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (size_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    for (size_t blk = 0; blk < blocks; ++blk) {
      __m256 xv[4];
      __m256 top = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        xv[c] = _mm256_loadu_ps(xr + 32 * blk + 8 * c);
        top = _mm256_max_ps(top, _mm256_and_ps(xv[c], absmask));
      }
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
      const float amax = _mm_cvtss_f32(t);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i q[4];
      for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_mul_ps(xv[c], inv);
        const __m256 h = _mm256_round_ps(v, kRound);
        __m256i term = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(h, floor), ceiling));
        if (two_terms) {  // 256 hi + lo, lo = rint(256 (v - hi)) clamped to [-127, 127]
          const __m256 r = _mm256_round_ps(
              _mm256_mul_ps(_mm256_sub_ps(v, h), _mm256_set1_ps(256.0f)), kRound);
          const __m256i lo =
              _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, floor), ceiling));
          term = _mm256_add_epi32(_mm256_slli_epi32(term, 8), lo);
        }
        q[c] = term;
      }
      // int32 -> int16 (exact: |x16| <= 32639), the lanes' order restored after the pack
      const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
      const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + m * K + 32 * blk), p01);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + m * K + 32 * blk + 16), p23);
      dx[m * blocks + blk] = two_terms ? amax / 127.0f / 256.0f : amax / 127.0f;
    }
    for (size_t g = 0; g < l.groups; ++g) {  // in order, as q8_gemm_prepare_x sums
      float sum = 0.0f;
      for (size_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        sum += xr[k];
      }
      sx[m * l.groups + g] = sum;
    }
  }
}

void q8_avx2_pack(const uint32_t* wq, const void* scales, const void* biases, ScaleType st,
                  size_t N, size_t K, size_t group_size, int bits, size_t nb0, size_t nb1,
                  uint8_t* panel) {
  const PackFn pack = pack_for(st, bits);
  const size_t bytes = q8_avx2_panel_bytes(K, group_size);
  for (size_t nb = nb0; nb < nb1; ++nb) {
    pack(reinterpret_cast<const uint8_t*>(wq), scales, biases, N, K, group_size, nb,
         panel + (nb - nb0) * bytes);
  }
}

void q8_avx2_compute(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint8_t* panel,
                     float* y, size_t N, size_t group_size, size_t nb0, size_t nb1, size_t m0,
                     size_t m1) {
  const size_t bytes = q8_avx2_panel_bytes(l.K, group_size);
  // the panel pair outermost: its codes stay in cache while x's rows stream past them
  for (size_t nb = nb0; nb < nb1; nb += 2) {
    const int nr = nb + 1 < nb1 ? 2 : 1;
    const MicroFn full = micro_fn(group_size, 4, nr);
    for (size_t m = m0; m < m1; m += 4) {
      const MicroFn fn = m1 - m >= 4 ? full : micro_fn(group_size, m1 - m, nr);
      fn(xbuf, l, panel + (nb - nb0) * bytes, bytes, group_size, y, N, m, nb * kBlockRows);
    }
  }
}

#else

bool q8_avx2_usable(size_t, size_t, int) {
  return false;
}
void q8_avx2_prepare_x(const float*, const Q8GemmXLayout&, size_t, bool, uint8_t*, size_t,
                       size_t) {
  std::abort();
}
void q8_avx2_pack(const uint32_t*, const void*, const void*, ScaleType, size_t, size_t, size_t,
                  int, size_t, size_t, uint8_t*) {
  std::abort();
}
void q8_avx2_compute(const uint8_t*, const Q8GemmXLayout&, const uint8_t*, float*, size_t,
                     size_t, size_t, size_t, size_t, size_t) {
  std::abort();
}

#endif

}  // namespace vun
