// x @ dequantize(w).T at every number of rows on AVX2 (CPUs without AVX-512 VNNI): the
// arithmetic of the AVX-512 VNNI GEMM (cpu_q8_gemm.cpp) in ymm registers, bit-identical to it.
//
// x is quantized per block of 32 elements exactly as q8_gemm_prepare_x quantizes it (one int8
// term hi, or two: hi and lo), then held as one int16 per element: x16 = hi (one term) or
// 256 hi + lo (two terms; |x16| <= 32639, exact in int16). The weight's codes are unpacked
// (portable shifts: no PDEP, no VBMI) and widened to int16 in panels of 8 weight rows: per 2
// consecutive k, 32 bytes (2 codes of each of the 8 rows), so that one VPMADDWD multiplies 8
// weight rows by 2 elements of one x row and adds the pair. With one term and codes of 2-4
// bits the panel holds bytes instead (4 consecutive k of the 8 rows per 32 bytes) and
// VPMADDUBSW multiplies them by int8 hi, the products of a segment summed in int16 (exact:
// at most 8 * 2 * 15 * 127) and widened once per segment. Each panel of a work item is
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
#include <vector>

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
  l.hi = 0;                               // x16 [M, K] int16
  l.lo = round64(M * K * sizeof(int16_t));  // x8 [M, K] int8: hi alone (one term)
  l.dx = l.lo + round64(M * K);
  l.sx = l.dx + round64(M * (K / 32) * sizeof(float));
  l.bytes = l.sx + round64(M * l.groups * sizeof(float));
  return l;
}

size_t q8_avx2_panel_bytes(size_t K, size_t group_size) {
  return kBlockRows * K * sizeof(int16_t) + 2 * (K / group_size) * kBlockRows * sizeof(float);
}

#ifdef VUN_X86

#define VUN_AVX2_TARGET "avx2,fma,f16c"

namespace {

bool avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

// Codes 0-15 of 16 elements of a packed row from p (MLX's layout, p a multiple of 8 elements
// into the row) as int16 in order: a shuffle puts each code's 2 bytes in its word, a multiply
// by 2^(8 - shift) and a shift right by 8 bring its bits to the bottom (AVX2 has no per-word
// variable shift), a mask keeps BITS of them. Reads 16 bytes where `whole`, else 2 * BITS.
template <int BITS>
__attribute__((target(VUN_AVX2_TARGET))) inline __m256i codes16(const uint8_t* p, bool whole) {
  struct Tables {
    alignas(32) uint8_t gather[32];
    alignas(32) uint16_t mul[16];
  };
  static constexpr Tables t = [] {
    Tables v{};
    for (int i = 0; i < 16; ++i) {
      const int bit = BITS * i, byte = bit / 8;
      v.gather[2 * i] = static_cast<uint8_t>(byte);  // a lane's shuffle reads its own 16 bytes
      v.gather[2 * i + 1] = static_cast<uint8_t>(std::min(byte + 1, 15));
      v.mul[i] = static_cast<uint16_t>(1u << (8 - bit % 8));
    }
    return v;
  }();
  if constexpr (BITS == 8) {  // bytes in order: one widen (2 * BITS = 16 bytes: always whole)
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __m256i raw;
  if (whole) {
    raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    alignas(16) uint8_t tmp[16] = {};
    std::memcpy(tmp, p, 2 * BITS);
    raw = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
  }
  const __m256i g = _mm256_shuffle_epi8(
      raw, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.gather)));
  const __m256i v = _mm256_mullo_epi16(
      g, _mm256_load_si256(reinterpret_cast<const __m256i*>(t.mul)));
  return _mm256_and_si256(_mm256_srli_epi16(v, 8), _mm256_set1_epi16((1 << BITS) - 1));
}

// Whether the panel holds bytes and the products go through VPMADDUBSW: one term (x8) and
// codes below 16, so that a product pair is at most 2 * 15 * 127 and the 8 pairs of a segment
// (16 for groups of 16: 4) sum to at most 30480 in int16, exactly.
bool byte_products(int bits, bool two_terms) {
  return !two_terms && bits <= 4;
}

// The 8 x 8 dwords of r (dword c of row i) transposed to out[c] (dword i: row i's), in order.
__attribute__((target(VUN_AVX2_TARGET))) inline void transpose8_store(const __m256i (&r)[8],
                                                                      __m256i* out) {
  __m256i t[8], u[8];
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = _mm256_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm256_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 2; ++j) {  // u[4j + c], lane L: dword 4L + c of rows 4j .. 4j + 3
    u[4 * j] = _mm256_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 1] = _mm256_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 2] = _mm256_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    u[4 * j + 3] = _mm256_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_store_si256(out + c, _mm256_permute2x128_si256(u[c], u[4 + c], 0x20));
    _mm256_store_si256(out + 4 + c, _mm256_permute2x128_si256(u[c], u[4 + c], 0x31));
  }
}

// Whether the int16 panel holds 4-bit codes in even/odd order, x16 following it (prepare_x):
// per block of 32 elements, the 16 low nibbles (elements 0, 2, ..., 30), then the 16 high
// ones. One load, widen, mask and shift unpack 32 codes (in order: two shuffles, multiplies and
// shifts). The integer sums of a block are the same in any order; groups of 16 keep the order.
bool even_odd(int bits, bool two_terms, size_t group_size) {
  return bits == 4 && !byte_products(bits, two_terms) && group_size % 32 == 0;
}

}  // namespace

bool q8_avx2_even_odd(int bits, bool two_terms, size_t group_size) {
  return even_odd(bits, two_terms, group_size);
}

bool q8_avx2_vnni_runs() {
  static const bool runs = [] {
    __builtin_cpu_init();
    return avx2_fma() && __builtin_cpu_supports("avxvnni") && isa_cap() >= IsaCap::kAvxVnni;
  }();
  return runs;
}

namespace {

// pack_block<4, ST, false> in even/odd order: the panel's dword p of a block of 32 holds
// positions 2p and 2p + 1 of that order, as x16's pairs.
template <ScaleType ST>
__attribute__((target(VUN_AVX2_TARGET))) void pack_block_even_odd(
    const uint8_t* w8, const void* scales, const void* biases, size_t N, size_t K,
    size_t group_size, size_t nb, uint8_t* dst) {
  const size_t row_bytes = K / 2, groups = K / group_size;
  const size_t rows = std::min(kBlockRows, N - nb * kBlockRows);
  auto* codes = reinterpret_cast<__m256i*>(dst);
  const __m256i mask = _mm256_set1_epi16(0x0f);
  for (size_t k = 0; k < K; k += 32) {
    __m256i lo[8], hi[8];
    for (size_t i = 0; i < kBlockRows; ++i) {
      if (i >= rows) {
        lo[i] = hi[i] = _mm256_setzero_si256();
        continue;
      }
      const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(w8 + (nb * kBlockRows + i) * row_bytes + k / 2)));
      lo[i] = _mm256_and_si256(v, mask);
      hi[i] = _mm256_srli_epi16(v, 4);
    }
    transpose8_store(lo, codes + k / 2);
    transpose8_store(hi, codes + k / 2 + 8);
  }
  widen_panel_scales<ST>(scales, biases, groups, nb * kBlockRows, rows, kBlockRows,
                         reinterpret_cast<float*>(dst + kBlockRows * K * sizeof(int16_t)));
}

// Panel block nb of w (rows 8 nb .. 8 nb + 7; rows past N zero): int16 codes at dst, element
// k of row r at (k / 2) * 16 + 2 r + k % 2, or (BYTES) uint8 codes, element k of row r at
// (k / 4) * 32 + 4 r + k % 4; then, at byte 16 K either way, the fp32 scales and biases
// [groups][8].
template <int BITS, ScaleType ST, bool BYTES>
__attribute__((target(VUN_AVX2_TARGET))) void pack_block(
    const uint8_t* w8, const void* scales, const void* biases, size_t N, size_t K,
    size_t group_size, size_t nb, uint8_t* dst) {
  const size_t row_bytes = K * BITS / 8, groups = K / group_size;
  const size_t rows = std::min(kBlockRows, N - nb * kBlockRows);
  const uint8_t* end = w8 + N * row_bytes;
  auto* codes = reinterpret_cast<__m256i*>(dst);
  // 16 (BYTES: 32) elements of the 8 rows at a time: 8 dwords (k pairs, or quads) per row,
  // transposed 8 x 8
  constexpr size_t step = BYTES ? 32 : 16;
  for (size_t k = 0; k < K; k += step) {
    __m256i r[8];
    for (size_t i = 0; i < kBlockRows; ++i) {
      const uint8_t* p = w8 + (nb * kBlockRows + i) * row_bytes + k * BITS / 8;
      if (i >= rows) {
        r[i] = _mm256_setzero_si256();
      } else if constexpr (BYTES) {  // codes 0-15 and 16-31 as words -> 32 bytes in order
        const __m256i a = codes16<BITS>(p, p + 16 <= end);
        const __m256i c = codes16<BITS>(p + 2 * BITS, p + 2 * BITS + 16 <= end);
        r[i] = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, c), 0xd8);
      } else {
        r[i] = codes16<BITS>(p, p + 16 <= end);
      }
    }
    transpose8_store(r, codes + k / (BYTES ? 4 : 2));
  }
  widen_panel_scales<ST>(scales, biases, groups, nb * kBlockRows, rows, kBlockRows,
                         reinterpret_cast<float*>(dst + kBlockRows * K * sizeof(int16_t)));
}

using PackFn = void (*)(const uint8_t*, const void*, const void*, size_t, size_t, size_t, size_t,
                        uint8_t*);

template <ScaleType ST>
PackFn pack_for_type(int bits, bool bytes, bool eo) {
  switch (bits) {
    case 2: return bytes ? pack_block<2, ST, true> : pack_block<2, ST, false>;
    case 3: return bytes ? pack_block<3, ST, true> : pack_block<3, ST, false>;
    case 4:
      return bytes ? pack_block<4, ST, true>
             : eo  ? pack_block_even_odd<ST>
                   : pack_block<4, ST, false>;
    case 5: return pack_block<5, ST, false>;
    case 6: return pack_block<6, ST, false>;
    default: return pack_block<8, ST, false>;
  }
}

PackFn pack_for(ScaleType st, int bits, bool bytes, bool eo) {
  switch (st) {
    case ScaleType::kF32: return pack_for_type<ScaleType::kF32>(bits, bytes, eo);
    case ScaleType::kF16: return pack_for_type<ScaleType::kF16>(bits, bytes, eo);
    default: return pack_for_type<ScaleType::kBF16>(bits, bytes, eo);
  }
}

using i32_alias = int32_t __attribute__((may_alias));

// sum[i][j] += madd(w_j, the pair of x16 at x + i * K) for 4 rows of x and 2 panel blocks: the
// hot step written out, since GCC computed all 8 products before the sums and spent a move per
// sum on its registers (16 ymm: 8 sums, 2 weights, 1 broadcast, 1 product).
__attribute__((target(VUN_AVX2_TARGET))) inline void step4x2(const int16_t* x, size_t K,
                                                             __m256i w0, __m256i w1,
                                                             __m256i (&sum)[4][2]) {
  __m256i t, u;
  __asm__(
      "vpbroadcastd %[x0], %[t]\n\t"
      "vpmaddwd %[w0], %[t], %[u]\n\t"
      "vpaddd %[u], %[s00], %[s00]\n\t"
      "vpmaddwd %[w1], %[t], %[u]\n\t"
      "vpaddd %[u], %[s01], %[s01]\n\t"
      "vpbroadcastd %[x1], %[t]\n\t"
      "vpmaddwd %[w0], %[t], %[u]\n\t"
      "vpaddd %[u], %[s10], %[s10]\n\t"
      "vpmaddwd %[w1], %[t], %[u]\n\t"
      "vpaddd %[u], %[s11], %[s11]\n\t"
      "vpbroadcastd %[x2], %[t]\n\t"
      "vpmaddwd %[w0], %[t], %[u]\n\t"
      "vpaddd %[u], %[s20], %[s20]\n\t"
      "vpmaddwd %[w1], %[t], %[u]\n\t"
      "vpaddd %[u], %[s21], %[s21]\n\t"
      "vpbroadcastd %[x3], %[t]\n\t"
      "vpmaddwd %[w0], %[t], %[u]\n\t"
      "vpaddd %[u], %[s30], %[s30]\n\t"
      "vpmaddwd %[w1], %[t], %[u]\n\t"
      "vpaddd %[u], %[s31], %[s31]"
      : [s00] "+x"(sum[0][0]), [s01] "+x"(sum[0][1]), [s10] "+x"(sum[1][0]),
        [s11] "+x"(sum[1][1]), [s20] "+x"(sum[2][0]), [s21] "+x"(sum[2][1]),
        [s30] "+x"(sum[3][0]), [s31] "+x"(sum[3][1]), [t] "=&x"(t), [u] "=&x"(u)
      : [w0] "x"(w0), [w1] "x"(w1), [x0] "m"(*reinterpret_cast<const i32_alias*>(x)),
        [x1] "m"(*reinterpret_cast<const i32_alias*>(x + K)),
        [x2] "m"(*reinterpret_cast<const i32_alias*>(x + 2 * K)),
        [x3] "m"(*reinterpret_cast<const i32_alias*>(x + 3 * K))
      : "memory");
}

// step4x2 by AVX-VNNI: one VPDPWSSD (the pairs' products added to the sum) per VPMADDWD +
// VPADDD, the same int32 sums (no saturation: |pair| <= 2 * 255 * 32639). Written as assembly
// ({vex}: the AVX-VNNI encoding, not AVX-512's), so that no function needs an avxvnni target.
__attribute__((target(VUN_AVX2_TARGET))) inline void step4x2_vnni(const int16_t* x, size_t K,
                                                                  __m256i w0, __m256i w1,
                                                                  __m256i (&sum)[4][2]) {
  __m256i t;
  __asm__(
      "vpbroadcastd %[x0], %[t]\n\t"
      "%{vex%} vpdpwssd %[w0], %[t], %[s00]\n\t"
      "%{vex%} vpdpwssd %[w1], %[t], %[s01]\n\t"
      "vpbroadcastd %[x1], %[t]\n\t"
      "%{vex%} vpdpwssd %[w0], %[t], %[s10]\n\t"
      "%{vex%} vpdpwssd %[w1], %[t], %[s11]\n\t"
      "vpbroadcastd %[x2], %[t]\n\t"
      "%{vex%} vpdpwssd %[w0], %[t], %[s20]\n\t"
      "%{vex%} vpdpwssd %[w1], %[t], %[s21]\n\t"
      "vpbroadcastd %[x3], %[t]\n\t"
      "%{vex%} vpdpwssd %[w0], %[t], %[s30]\n\t"
      "%{vex%} vpdpwssd %[w1], %[t], %[s31]"
      : [s00] "+x"(sum[0][0]), [s01] "+x"(sum[0][1]), [s10] "+x"(sum[1][0]),
        [s11] "+x"(sum[1][1]), [s20] "+x"(sum[2][0]), [s21] "+x"(sum[2][1]),
        [s30] "+x"(sum[3][0]), [s31] "+x"(sum[3][1]), [t] "=&x"(t)
      : [w0] "x"(w0), [w1] "x"(w1), [x0] "m"(*reinterpret_cast<const i32_alias*>(x)),
        [x1] "m"(*reinterpret_cast<const i32_alias*>(x + K)),
        [x2] "m"(*reinterpret_cast<const i32_alias*>(x + 2 * K)),
        [x3] "m"(*reinterpret_cast<const i32_alias*>(x + 3 * K))
      : "memory");
}

// sum += the pairs' products of w and x (int16), by VPDPWSSD (VNNI) or VPMADDWD + VPADDD.
template <bool VNNI>
__attribute__((target(VUN_AVX2_TARGET))) inline __m256i dot_pairs(__m256i sum, __m256i w,
                                                                 __m256i x) {
  if constexpr (VNNI) {
    __asm__("%{vex%} vpdpwssd %[w], %[x], %[s]" : [s] "+x"(sum) : [w] "x"(w), [x] "x"(x));
    return sum;
  } else {
    return _mm256_add_epi32(_mm256_madd_epi16(w, x), sum);
  }
}

// The same for the byte panel: sum[i][j] += maddubs(w_j, the 4 int8 of x at x + i * K), in
// int16 lanes.
__attribute__((target(VUN_AVX2_TARGET))) inline void step4x2_bytes(const int8_t* x, size_t K,
                                                                   __m256i w0, __m256i w1,
                                                                   __m256i (&sum)[4][2]) {
  __m256i t, u;
  __asm__(
      "vpbroadcastd %[x0], %[t]\n\t"
      "vpmaddubsw %[t], %[w0], %[u]\n\t"
      "vpaddw %[u], %[s00], %[s00]\n\t"
      "vpmaddubsw %[t], %[w1], %[u]\n\t"
      "vpaddw %[u], %[s01], %[s01]\n\t"
      "vpbroadcastd %[x1], %[t]\n\t"
      "vpmaddubsw %[t], %[w0], %[u]\n\t"
      "vpaddw %[u], %[s10], %[s10]\n\t"
      "vpmaddubsw %[t], %[w1], %[u]\n\t"
      "vpaddw %[u], %[s11], %[s11]\n\t"
      "vpbroadcastd %[x2], %[t]\n\t"
      "vpmaddubsw %[t], %[w0], %[u]\n\t"
      "vpaddw %[u], %[s20], %[s20]\n\t"
      "vpmaddubsw %[t], %[w1], %[u]\n\t"
      "vpaddw %[u], %[s21], %[s21]\n\t"
      "vpbroadcastd %[x3], %[t]\n\t"
      "vpmaddubsw %[t], %[w0], %[u]\n\t"
      "vpaddw %[u], %[s30], %[s30]\n\t"
      "vpmaddubsw %[t], %[w1], %[u]\n\t"
      "vpaddw %[u], %[s31], %[s31]"
      : [s00] "+x"(sum[0][0]), [s01] "+x"(sum[0][1]), [s10] "+x"(sum[1][0]),
        [s11] "+x"(sum[1][1]), [s20] "+x"(sum[2][0]), [s21] "+x"(sum[2][1]),
        [s30] "+x"(sum[3][0]), [s31] "+x"(sum[3][1]), [t] "=&x"(t), [u] "=&x"(u)
      : [w0] "x"(w0), [w1] "x"(w1), [x0] "m"(*reinterpret_cast<const i32_alias*>(x)),
        [x1] "m"(*reinterpret_cast<const i32_alias*>(x + K)),
        [x2] "m"(*reinterpret_cast<const i32_alias*>(x + 2 * K)),
        [x3] "m"(*reinterpret_cast<const i32_alias*>(x + 3 * K))
      : "memory");
}

// One segment's epilogue (the file's header): acc[i][j] += float(sum[i][j]) * (s_j * dx_i),
// then, at the first segment of a group (FIRST), += b_j * sx_i. s: block 0's scales of the
// group (block j's panel_floats further, its biases at b + j * panel_floats), dx: row 0's scale
// of the block (row i's i * blocks further), sx: row 0's sum over the group (i * groups).
template <int MR, int NR, bool FIRST>
__attribute__((target(VUN_AVX2_TARGET))) inline void epilogue(
    const __m256i (&sum)[MR][NR], float (&acc)[MR][NR][kBlockRows], const float* s,
    const float* b, size_t panel_floats, const float* dx, size_t blocks, const float* sx,
    size_t groups) {
  for (int i = 0; i < MR; ++i) {
    const __m256 dxv = _mm256_set1_ps(dx[i * blocks]);
    for (int j = 0; j < NR; ++j) {
      __m256 a = _mm256_load_ps(acc[i][j]);
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][j]),
                          _mm256_mul_ps(_mm256_load_ps(s + j * panel_floats), dxv), a);
      if constexpr (FIRST) {
        a = _mm256_fmadd_ps(_mm256_load_ps(b + j * panel_floats), _mm256_set1_ps(sx[i * groups]),
                            a);
      }
      _mm256_store_ps(acc[i][j], a);
    }
  }
}

// y[m0 + i, n0 + 8 j + lane] for i < MR, j < NR (NR panel blocks from `panel`, each
// panel_bytes apart): segments of D elements, the epilogue of each as the file's header says.
template <size_t D, int MR, int NR, bool BYTES, bool VNNI>
__attribute__((target(VUN_AVX2_TARGET))) void micro(const uint8_t* xbuf, const Q8GemmXLayout& l,
                                                    const uint8_t* panel, size_t panel_bytes,
                                                    size_t group_size, float* y, size_t N,
                                                    size_t m0, size_t n0) {
  const size_t K = l.K, groups = l.groups, blocks = K / 32;
  const auto* x16 = reinterpret_cast<const int16_t*>(xbuf + l.hi) + m0 * K;
  const auto* x8 = reinterpret_cast<const int8_t*>(xbuf + l.lo) + m0 * K;
  const auto* dx = reinterpret_cast<const float*>(xbuf + l.dx) + m0 * blocks;
  const auto* sx = reinterpret_cast<const float*>(xbuf + l.sx) + m0 * groups;
  const uint8_t* codes[NR];
  for (int j = 0; j < NR; ++j) {
    codes[j] = panel + j * panel_bytes;
  }
  // block j's scales at s0 + j * panel_floats, its biases groups * kBlockRows after them
  const auto* s0 = reinterpret_cast<const float*>(panel + kBlockRows * K * sizeof(int16_t));
  const size_t panel_floats = panel_bytes / sizeof(float);
  // the fp32 accumulators live in memory between segments: in registers beside the 8 integer
  // sums, GCC spilled sums inside the hot loop instead (16 ymm registers only)
  alignas(32) float acc_mem[MR][NR][kBlockRows] = {};
  __asm__ volatile("" : : "r"(acc_mem) : "memory");
  // y's lines requested now, so that the stores at the end find them in cache: a store that
  // misses held the epilogues' stores to acc_mem behind it in the store buffer
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      __builtin_prefetch(y + (m0 + i) * N + n0 + j * kBlockRows, 1, 3);
    }
  }
  const size_t group_segments = group_size / D;
  size_t g = 0, seg = 0;  // the segment's group, and its index in the group
  for (size_t k0 = 0; k0 < K; k0 += D) {
    __m256i sum[MR][NR];
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        sum[i][j] = _mm256_setzero_si256();
      }
    }
#pragma GCC unroll 1
    for (size_t k = k0; k < k0 + D && BYTES; k += 4) {
      __m256i w[NR];
      for (int j = 0; j < NR; ++j) {
        w[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j] + k * 8));
      }
      if constexpr (MR == 4 && NR == 2) {
        step4x2_bytes(x8 + k, K, w[0], w[1], sum);
      } else {
        for (int i = 0; i < MR; ++i) {
          int32_t quad;
          std::memcpy(&quad, x8 + i * K + k, 4);
          const __m256i xv = _mm256_set1_epi32(quad);
          for (int j = 0; j < NR; ++j) {
            sum[i][j] = _mm256_add_epi16(_mm256_maddubs_epi16(w[j], xv), sum[i][j]);
          }
        }
      }
    }
    if constexpr (BYTES) {  // int16 pairs of sums -> int32
      for (int i = 0; i < MR; ++i) {
        for (int j = 0; j < NR; ++j) {
          sum[i][j] = _mm256_madd_epi16(sum[i][j], _mm256_set1_epi16(1));
        }
      }
    }
#pragma GCC unroll 1
    for (size_t k = k0; k < k0 + D && !BYTES; k += 2) {
      __m256i w[NR];
      for (int j = 0; j < NR; ++j) {
        w[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[j] + k * 16));
      }
      if constexpr (MR == 4 && NR == 2 && VNNI) {
        step4x2_vnni(x16 + k, K, w[0], w[1], sum);
      } else if constexpr (MR == 4 && NR == 2) {
        step4x2(x16 + k, K, w[0], w[1], sum);
      } else {
        for (int i = 0; i < MR; ++i) {
          int32_t pair;
          std::memcpy(&pair, x16 + i * K + k, 4);
          const __m256i xv = _mm256_set1_epi32(pair);
          for (int j = 0; j < NR; ++j) {
            sum[i][j] = dot_pairs<VNNI>(sum[i][j], w[j], xv);
          }
        }
      }
    }
    // the segment's scales: group g (counted, not divided: a division per segment cost as
    // much as the epilogue), x's block k0 / 32
    const float* sg = s0 + g * kBlockRows;
    const float* dxk = dx + k0 / 32;
    if (seg == 0) {
      epilogue<MR, NR, true>(sum, acc_mem, sg, sg + groups * kBlockRows, panel_floats, dxk,
                             blocks, sx + g, groups);
    } else {
      epilogue<MR, NR, false>(sum, acc_mem, sg, nullptr, panel_floats, dxk, blocks, nullptr,
                              groups);
    }
    if (++seg == group_segments) {
      seg = 0;
      ++g;
    }
  }
  for (int j = 0; j < NR; ++j) {
    const size_t n = n0 + j * kBlockRows;
    const size_t cols = std::min(kBlockRows, N - n);
    for (int i = 0; i < MR; ++i) {
      float* dst = y + (m0 + i) * N + n;
      if (cols == kBlockRows) {  // a vector store, not memcpy's 8-byte moves
        _mm256_storeu_ps(dst, _mm256_load_ps(acc_mem[i][j]));
      } else {
        std::memcpy(dst, acc_mem[i][j], cols * sizeof(float));
      }
    }
  }
}

using MicroFn = void (*)(const uint8_t*, const Q8GemmXLayout&, const uint8_t*, size_t, size_t,
                         float*, size_t, size_t, size_t);

template <size_t D, int NR, bool BYTES, bool VNNI>
MicroFn micro_rows(size_t rows) {
  switch (rows) {
    case 1: return micro<D, 1, NR, BYTES, VNNI>;
    case 2: return micro<D, 2, NR, BYTES, VNNI>;
    case 3: return micro<D, 3, NR, BYTES, VNNI>;
    default: return micro<D, 4, NR, BYTES, VNNI>;
  }
}

template <size_t D, bool BYTES, bool VNNI>
MicroFn micro_for(size_t rows, int nr) {
  return nr == 2 ? micro_rows<D, 2, BYTES, VNNI>(rows) : micro_rows<D, 1, BYTES, VNNI>(rows);
}

// The byte panel's products (VPMADDUBSW) take no VNNI form here.
template <size_t D>
MicroFn micro_for_d(bool bytes, bool vnni, size_t rows, int nr) {
  return bytes ? micro_for<D, true, false>(rows, nr)
         : vnni ? micro_for<D, false, true>(rows, nr)
                : micro_for<D, false, false>(rows, nr);
}

MicroFn micro_fn(size_t group_size, bool bytes, bool vnni, size_t rows, int nr) {
  return group_size == 16 ? micro_for_d<16>(bytes, vnni, rows, nr)
                          : micro_for_d<32>(bytes, vnni, rows, nr);
}


// ---- the gemv: 1 to a few rows of x, the codes unpacked in registers, each weight row read once ----

// The 8 lanes' sum as one float, in a fixed order.
__attribute__((target(VUN_AVX2_TARGET))) inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 8 scales or biases of type ST from p as fp32, exactly.
template <ScaleType ST>
__attribute__((target(VUN_AVX2_TARGET))) inline __m256 load8(const void* p) {
  if constexpr (ST == ScaleType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
    return ST == ScaleType::kF16
        ? _mm256_cvtph_ps(h)
        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// The `groups` scales of type ST at src as fp32 into dst (vectors of 8 where they fit: the
// scalar half_to_float branches per value).
template <ScaleType ST>
__attribute__((target(VUN_AVX2_TARGET))) inline void widen_row(const char* src, size_t groups,
                                                                float* dst) {
  constexpr size_t eb = ST == ScaleType::kF32 ? 4 : 2;
  size_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    _mm256_storeu_ps(dst + g, load8<ST>(src + g * eb));
  }
  for (; g < groups; ++g) {
    dst[g] = scale_at<ST>(src, g);
  }
}

// The codes of block `blk` (32 elements) of a packed row as int16: c[0] and c[1]. For BITS 4,
// c[0] holds the low nibbles of the block's 16 bytes (elements 0, 2, ..., 30) and c[1] the
// high ones (1, 3, ..., 31), which x in even/odd order meets (q8_avx2_prepare_x); otherwise
// elements 0-15 and 16-31 in order. `end` is the weight's end (codes16 reads 16 bytes).
template <int BITS>
__attribute__((target(VUN_AVX2_TARGET))) inline void block_codes(const uint8_t* row, size_t blk,
                                                                 const uint8_t* end,
                                                                 __m256i (&c)[2]) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + blk * 16)));
    c[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
    c[1] = _mm256_srli_epi16(v, 4);
  } else if constexpr (BITS == 8) {
    const auto* p = reinterpret_cast<const __m128i*>(row + blk * 32);
    c[0] = _mm256_cvtepu8_epi16(_mm_loadu_si128(p));
    c[1] = _mm256_cvtepu8_epi16(_mm_loadu_si128(p + 1));
  } else {
    const uint8_t* p = row + blk * 4 * BITS;
    c[0] = codes16<BITS>(p, p + 16 <= end);
    c[1] = codes16<BITS>(p + 2 * BITS, p + 2 * BITS + 16 <= end);
  }
}

// y[m, n] for m < MR and rows n in [n0, n1): x16 [MR, K] in gemv order, dx [MR, K / 32] and
// sx [MR, groups] as q8_avx2_prepare_x writes them. BPG: blocks per group (0: groups of 16;
// -1: any multiple of 64, counted at run time, as a division per block would cost more than
// the block's products). Per block of 32 and x row the integer
// sums are exact (as the GEMM's); in fp32: acc = fma(float(sum), s[n, g] * dx[m, blk], acc),
// over two accumulators (even and odd blocks), then + sum_g b[n, g] * sx[m, g].
template <int BITS, int BPG, ScaleType ST, int MR>
__attribute__((target(VUN_AVX2_TARGET))) void gemv_rows(
    const int16_t* x16, const float* dx, const float* sx, const uint8_t* w8,
    const void* scales, const void* biases, float* y, size_t N, size_t K, size_t group_size,
    size_t n0, size_t n1) {
  const size_t row_bytes = K * BITS / 8, groups = K / group_size, blocks = K / 32;
  const uint8_t* end = w8 + N * row_bytes;
  constexpr size_t eb = ST == ScaleType::kF32 ? 4 : 2;
  thread_local std::vector<float> srow_buf;
  srow_buf.resize(groups);
  float* srow = srow_buf.data();
  for (size_t n = n0; n < n1; ++n) {
    const uint8_t* row = w8 + n * row_bytes;
    widen_row<ST>(static_cast<const char*>(scales) + n * groups * eb, groups, srow);
    const char* br = static_cast<const char*>(biases) + n * groups * eb;
    // rows are short (SmolLM2's: 288 bytes): fetch 4 rows ahead, where the stream continues
    for (size_t off = 0; off < row_bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(row + 4 * row_bytes + off), _MM_HINT_T0);
    }
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    }
    size_t g = 0, left = group_size / 32;  // BPG -1: the block's group, blocks left in it
    for (size_t blk = 0; blk < blocks; ++blk) {
      __m256i c[2];
      block_codes<BITS>(row, blk, end, c);
      float s0, s1 = 0.0f;
      if constexpr (BPG == 0) {
        s0 = srow[2 * blk];
        s1 = srow[2 * blk + 1];
      } else if constexpr (BPG > 0) {
        s0 = srow[blk / BPG];
      } else {
        s0 = srow[g];
        if (--left == 0) {
          ++g;
          left = group_size / 32;
        }
      }
      for (int m = 0; m < MR; ++m) {
        const auto* xv = reinterpret_cast<const __m256i*>(x16 + m * K + blk * 32);
        const __m256i sa = _mm256_madd_epi16(c[0], _mm256_loadu_si256(xv));
        const __m256i sb = _mm256_madd_epi16(c[1], _mm256_loadu_si256(xv + 1));
        const float d = dx[m * blocks + blk];
        __m256& a = acc[m][blk & 1];
        if constexpr (BPG != 0) {
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sa, sb)),
                              _mm256_set1_ps(s0 * d), a);
        } else if constexpr (BITS == 4) {  // lanes 0-3: elements 0-15; lanes 4-7: 16-31
          const __m256 sv = _mm256_blend_ps(_mm256_set1_ps(s0), _mm256_set1_ps(s1), 0xf0);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sa, sb)),
                              _mm256_mul_ps(sv, _mm256_set1_ps(d)), a);
        } else {
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_set1_ps(s0 * d), a);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_set1_ps(s1 * d), a);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      __m256 a = _mm256_add_ps(acc[m][0], acc[m][1]);
      const float* sxm = sx + m * groups;
      size_t g = 0;
      for (; g + 8 <= groups; g += 8) {
        a = _mm256_fmadd_ps(load8<ST>(br + g * eb), _mm256_loadu_ps(sxm + g), a);
      }
      float tail = 0.0f;
      for (; g < groups; ++g) {
        tail += scale_at<ST>(br, g) * sxm[g];
      }
      y[m * N + n] = hsum8(a) + tail;
    }
  }
}

using GemvFn = void (*)(const int16_t*, const float*, const float*, const uint8_t*, const void*,
                        const void*, float*, size_t, size_t, size_t, size_t, size_t);

template <int BITS, int BPG, ScaleType ST>
GemvFn gemv_for_rows(size_t rows) {
  switch (rows) {
    case 1: return gemv_rows<BITS, BPG, ST, 1>;
    case 2: return gemv_rows<BITS, BPG, ST, 2>;
    case 3: return gemv_rows<BITS, BPG, ST, 3>;
    default: return gemv_rows<BITS, BPG, ST, 4>;
  }
}

template <int BITS, ScaleType ST>
GemvFn gemv_for_group(size_t group_size, size_t rows) {
  switch (group_size) {
    case 16: return gemv_for_rows<BITS, 0, ST>(rows);
    case 32: return gemv_for_rows<BITS, 1, ST>(rows);
    case 64: return gemv_for_rows<BITS, 2, ST>(rows);
    case 128: return gemv_for_rows<BITS, 4, ST>(rows);
    default: return gemv_for_rows<BITS, -1, ST>(rows);
  }
}

template <ScaleType ST>
GemvFn gemv_for_type(int bits, size_t group_size, size_t rows) {
  switch (bits) {
    case 2: return gemv_for_group<2, ST>(group_size, rows);
    case 3: return gemv_for_group<3, ST>(group_size, rows);
    case 4: return gemv_for_group<4, ST>(group_size, rows);
    case 5: return gemv_for_group<5, ST>(group_size, rows);
    case 6: return gemv_for_group<6, ST>(group_size, rows);
    default: return gemv_for_group<8, ST>(group_size, rows);
  }
}

GemvFn gemv_for(ScaleType st, int bits, size_t group_size, size_t rows) {
  switch (st) {
    case ScaleType::kF32: return gemv_for_type<ScaleType::kF32>(bits, group_size, rows);
    case ScaleType::kF16: return gemv_for_type<ScaleType::kF16>(bits, group_size, rows);
    default: return gemv_for_type<ScaleType::kBF16>(bits, group_size, rows);
  }
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
    const float* x, const Q8GemmXLayout& l, size_t group_size, bool two_terms, bool even_odd,
    uint8_t* buf, size_t m0, size_t m1) {
  const size_t K = l.K, blocks = K / 32;
  auto* x16 = reinterpret_cast<int16_t*>(buf + l.hi);
  auto* x8 = reinterpret_cast<int8_t*>(buf + l.lo);
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
      if (!two_terms) {  // hi alone fits int8: the byte panel's operand
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8 + m * K + 32 * blk),
                            _mm256_permute4x64_epi64(_mm256_packs_epi16(p01, p23), 0xd8));
      }
      __m256i first = p01, second = p23;
      if (even_odd) {  // per lane even words, then odd; then the lanes' halves regrouped
        const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14,
                                               15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11,
                                               14, 15);
        const __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p01, split), 0xd8);
        const __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p23, split), 0xd8);
        first = _mm256_permute2x128_si256(a, b, 0x20);   // elements 0, 2, ..., 30
        second = _mm256_permute2x128_si256(a, b, 0x31);  // elements 1, 3, ..., 31
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + m * K + 32 * blk), first);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + m * K + 32 * blk + 16), second);
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
                  size_t N, size_t K, size_t group_size, int bits, bool two_terms, size_t nb0,
                  size_t nb1, uint8_t* panel) {
  const PackFn pack = pack_for(st, bits, byte_products(bits, two_terms),
                               even_odd(bits, two_terms, group_size));
  const size_t bytes = q8_avx2_panel_bytes(K, group_size);
  for (size_t nb = nb0; nb < nb1; ++nb) {
    pack(reinterpret_cast<const uint8_t*>(wq), scales, biases, N, K, group_size, nb,
         panel + (nb - nb0) * bytes);
  }
}

void q8_avx2_compute(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint8_t* panel,
                     float* y, size_t N, size_t group_size, int bits, bool two_terms,
                     size_t nb0, size_t nb1, size_t m0, size_t m1) {
  constexpr size_t kChunkRows = 64;  // x's rows that stay in L2 while every panel pair passes
  const size_t bytes = q8_avx2_panel_bytes(l.K, group_size);
  const bool byte_panel = byte_products(bits, two_terms), vnni = q8_avx2_vnni_runs();
  for (size_t c0 = m0; c0 < m1; c0 += kChunkRows) {
    const size_t c1 = std::min(m1, c0 + kChunkRows);
    // a panel pair, then the chunk's rows: the pair's codes stay in cache as the rows pass
    for (size_t nb = nb0; nb < nb1; nb += 2) {
      const int nr = nb + 1 < nb1 ? 2 : 1;
      const MicroFn full = micro_fn(group_size, byte_panel, vnni, 4, nr);
      for (size_t m = c0; m < c1; m += 4) {
        const MicroFn fn =
            c1 - m >= 4 ? full : micro_fn(group_size, byte_panel, vnni, c1 - m, nr);
        fn(xbuf, l, panel + (nb - nb0) * bytes, bytes, group_size, y, N, m, nb * kBlockRows);
      }
    }
  }
}

void q8_avx2_gemv(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint32_t* wq, const void* scales, const void* biases, ScaleType st,
                  float* y, size_t N, size_t group_size, int bits, size_t n0, size_t n1) {
  const size_t K = l.K, blocks = K / 32;
  const auto* x16 = reinterpret_cast<const int16_t*>(xbuf + l.hi);
  const auto* dx = reinterpret_cast<const float*>(xbuf + l.dx);
  const auto* sx = reinterpret_cast<const float*>(xbuf + l.sx);
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  for (size_t m = 0; m < l.M; m += 4) {  // x's rows 4 at a time: the codes unpack once per 4
    const size_t rows = std::min<size_t>(4, l.M - m);
    gemv_for(st, bits, group_size, rows)(x16 + m * K, dx + m * blocks, sx + m * l.groups, w8,
                                         scales, biases, y + m * N, N, K, group_size, n0, n1);
  }
}

#else

bool q8_avx2_usable(size_t, size_t, int) {
  return false;
}
bool q8_avx2_even_odd(int, bool, size_t) {
  return false;
}
bool q8_avx2_vnni_runs() {
  return false;
}
void q8_avx2_prepare_x(const float*, const Q8GemmXLayout&, size_t, bool, bool, uint8_t*, size_t,
                       size_t) {
  std::abort();
}
void q8_avx2_pack(const uint32_t*, const void*, const void*, ScaleType, size_t, size_t, size_t,
                  int, bool, size_t, size_t, uint8_t*) {
  std::abort();
}
void q8_avx2_compute(const uint8_t*, const Q8GemmXLayout&, const uint8_t*, float*, size_t,
                     size_t, int, bool, size_t, size_t, size_t, size_t) {
  std::abort();
}
void q8_avx2_gemv(const uint8_t*, const Q8GemmXLayout&, const uint32_t*,
                  const void*, const void*, ScaleType, float*, size_t, size_t, int, size_t,
                  size_t) {
  std::abort();
}

#endif

}  // namespace vun
