// x @ dequantize(w).T on Intel AMX tiles (Sapphire Rapids and later), fp32-accurate.
//
// AMX multiplies bf16 tiles into fp32 accumulators: TDPBF16PS does 16 x 16 x 32 multiply-adds,
// 16x the work of an AVX-512 FMA per cycle. Rounding fp32 activations to bf16 would cost 16
// bits of precision (vLLM's bf16 CPU backend answers SmolLM2's chat prompt wrongly), so neither
// side is rounded:
// * an affine-quantized weight is w[n, k] = s[n, g] * q[n, k] + b[n, g] with integer q < 256,
//   exact in bf16, so the tiles multiply q and the scale and bias are applied per group in
//   fp32: y[m, n] = sum_g s[n, g] * (sum_{k in g} x[m, k] q[n, k])
//                 + b[n, g] * (sum_{k in g} x[m, k]);
// * each row of x is first scaled by a power of two (exact) so that its largest magnitude is in
//   [1, 2), and its outputs scaled back: the bf16 instructions flush subnormals (most of a value
//   below ~1e-33 was lost) and x * q summed over a group would overflow fp32 for rows of ~1e36
//   (NaN where dequantize-then-multiply is finite); scaled, neither happens for a finite row;
// * x is split into three bf16 parts, x = hi + mid + lo exactly (each part the bf16 rounding
//   of what the previous ones left; 3 x 8 significant bits cover fp32's 24), and each part's
//   products with q are exact in fp32. Only the fp32 accumulation rounds, as in an fp32 GEMM.
//
// Layout: the weight is the tiles' A operand (16 rows n x 32 k, bf16 q unpacked from the
// 2/3/4/5/6/8-bit rows, row-major as stored), x the B operand in the VNNI layout TDPBF16PS
// wants (row kp holds the pairs (x[m, 2kp], x[m, 2kp + 1]) for 16 m), so each accumulator
// tile is C[n][m] and the per-group epilogue scales a row by one s[n, g]. References: Intel 64
// and IA-32 Architectures Software Developer's Manual, vol. 2 (TDPBF16PS, LDTILECFG) and vol. 1
// ch. 3 (AMX state);
// Linux Documentation/arch/x86/xstate.rst (ARCH_REQ_XCOMP_PERM before first use).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VUN_AMX 1
#endif

namespace vun {

namespace {
constexpr size_t kTile = 16;       // rows of a tile; also columns (fp32) of an accumulator
constexpr size_t kDepth = 32;      // bf16 elements of k per tile row (64 bytes)
constexpr size_t kParts = 3;       // bf16 parts of each x value
constexpr size_t kTileElems = kTile * kDepth;  // bf16 per A or B tile (1 KiB)
}  // namespace

#ifdef VUN_AMX
namespace {

#define VUN_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16," \
                         "avx512vbmi,bmi2")))

// AMX-TILE, AMX-BF16 and AMX-INT8 (CPUID leaf 7: EDX bits 24, 22 and 25), plus the AVX-512 subsets the
// conversions and the 2/3/5/6-bit unpacking (VBMI) use, which __builtin_cpu_supports reports
// only where the OS saves their state, and BMI2 (every AMX CPU has both).
bool cpu_has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1) ||
      !((d >> 25) & 1)) {
    return false;
  }
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi2");
}

// Linux hands out AMX tile data per process on request (xstate.rst); without it the first tile
// instruction raises SIGILL.
bool os_grants_amx() {
  constexpr long kReqXcompPerm = 0x1023;
  constexpr long kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators, 4: weights, 5-7: the three parts of x. All 16 rows x 64 bytes.
VUN_AMX_TARGET void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// bf16 -> fp32 of 16 values (exact: bf16 is fp32's upper half).
VUN_AMX_TARGET inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One weight tile: dst[r][0..32) = bf16(q[n0 + r, 32 seg + i]) for the 16 rows of the block
// starting at n0, rows past N zero.
template <int BITS>
VUN_AMX_TARGET inline void unpack_tile(const uint8_t* wq, size_t N, size_t K, size_t n0,
                                       size_t seg, uint16_t* dst) {
  const size_t row_bytes = K * BITS / 8;
  const size_t rows = std::min(kTile, N - n0);
  // bf16 bit patterns of 0 .. 31 (only 0 .. 15 are looked up).
  alignas(64) static const uint16_t lut_values[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m512i lut = _mm512_load_si512(lut_values);
  const uint8_t* src = wq + n0 * row_bytes + seg * kDepth * BITS / 8;
  for (size_t r = 0; r < rows; ++r, src += row_bytes) {
    // 64 rows (4 tiles) are read a segment at a time: 64 interleaved streams, more than the
    // hardware prefetcher follows, so each row's next lines are asked for here
    _mm_prefetch(reinterpret_cast<const char*>(src) + 128, _MM_HINT_T0);
    __m512i out;
    if constexpr (BITS == 4) {
      // Byte j holds k = 2j (low nibble) and 2j + 1 (high): as a dword, (lo | hi << 16) is the
      // pair in VNNI order.
      const __m512i d =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m512i pair = _mm512_ternarylogic_epi32(
          d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000f000f), 0xA8);  // (d | d<<12) & m
      out = _mm512_permutexvar_epi16(pair, lut);
    } else {
      // 8 bits: the codes are the row's bytes; 2, 3, 5 and 6 bits: the segment's 4 * BITS
      // bytes spread to 32 code bytes by VBMI (cpu_avx512.h; PDEP per 8 codes took most of a
      // batch-16 Qwen2.5-Coder step's 5-bit layers).
      __m128i first, second;
      if constexpr (BITS == 8) {
        first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      } else {
        const __m512i codes = codes64<BITS>(src, kDepth);
        first = _mm512_castsi512_si128(codes);
        second = _mm512_extracti32x4_epi32(codes, 1);
      }
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second));
      out = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // exact: q < 256
    }
    _mm512_store_si512(dst + r * kDepth, out);
  }
  for (size_t r = rows; r < kTile; ++r) {
    _mm512_store_si512(dst + r * kDepth, _mm512_setzero_si512());
  }
}

}  // namespace
#endif  // VUN_AMX

bool amx_usable() {
#ifdef VUN_AMX
  static const bool usable = [] {
    if (isa_cap() != IsaCap::kAmx) {
      return false;  // a lower level asked for (avx512, avx2, portable)
    }
    return cpu_has_amx() && os_grants_amx();
  }();
  return usable;
#else
  return false;
#endif
}

size_t amx_x_tile_elems(size_t M, size_t K) {
  return (M + kTile - 1) / kTile * (K / kDepth) * kParts * kTileElems;
}

size_t amx_x_sum_floats(size_t M, size_t K, size_t group_size) {
  return (M + kTile - 1) / kTile * (K / group_size + 1) * kTile;  // + 1: the rows' scaling
}

size_t amx_weight_elems(size_t N, size_t K) {
  return (N + kTile - 1) / kTile * K * kTile;
}

#ifdef VUN_AMX
VUN_AMX_TARGET void amx_prepare_x(const float* x, size_t M, size_t K, size_t group_size,
                                  uint16_t* tiles, float* sums, size_t mb0, size_t mb1) {
  const size_t segs = K / kDepth;
  const size_t groups = K / group_size;
  alignas(64) __m512i parts[kParts][kTile];
  for (size_t mb = mb0; mb < mb1; ++mb) {
    // Row m is scaled by 2^exps[m] (its largest magnitude into [1, 2)); a row that is zero or
    // not finite is left as is (NaN either way, see the docs).
    float* exps = sums + (mb * (groups + 1) + groups) * kTile;
    for (size_t m = 0; m < kTile; ++m) {
      const size_t row = mb * kTile + m;
      exps[m] = 0.0f;
      if (row >= M) {
        continue;
      }
      __m512 top = _mm512_setzero_ps();
      for (size_t k = 0; k < K; k += 16) {
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + row * K + k)));
      }
      const float largest = _mm512_reduce_max_ps(top);
      if (std::isfinite(largest) && largest > 0.0f) {
        exps[m] = static_cast<float>(-std::ilogb(largest));
      }
    }
    for (size_t s = 0; s < segs; ++s) {
      for (size_t m = 0; m < kTile; ++m) {
        const size_t row = mb * kTile + m;
        if (row >= M) {
          for (size_t p = 0; p < kParts; ++p) {
            parts[p][m] = _mm512_setzero_si512();
          }
          continue;
        }
        const __m512 e = _mm512_set1_ps(exps[m]);
        __m512 a0 = _mm512_scalef_ps(_mm512_loadu_ps(x + row * K + s * kDepth), e);
        __m512 a1 = _mm512_scalef_ps(_mm512_loadu_ps(x + row * K + s * kDepth + 16), e);
        for (size_t p = 0; p < kParts; ++p) {
          const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(a1, a0));
          parts[p][m] = h;
          a0 = _mm512_sub_ps(a0, widen(_mm512_castsi512_si256(h)));
          a1 = _mm512_sub_ps(a1, widen(_mm512_extracti64x4_epi64(h, 1)));
        }
      }
      for (size_t p = 0; p < kParts; ++p) {
        transpose16(parts[p]);
        uint16_t* dst = tiles + ((mb * segs + s) * kParts + p) * kTileElems;
        for (size_t kp = 0; kp < kTile; ++kp) {
          _mm512_store_si512(dst + kp * kDepth, parts[p][kp]);
        }
      }
    }
    for (size_t g = 0; g < groups; ++g) {
      float* dst = sums + (mb * (groups + 1) + g) * kTile;
      for (size_t m = 0; m < kTile; ++m) {
        const size_t row = mb * kTile + m;
        if (row >= M) {
          dst[m] = 0.0f;
          continue;
        }
        const float* src = x + row * K + g * group_size;
        const __m512 e = _mm512_set1_ps(exps[m]);
        __m512 acc = _mm512_scalef_ps(_mm512_loadu_ps(src), e);
        for (size_t k = 16; k < group_size; k += 16) {
          acc = _mm512_add_ps(acc, _mm512_scalef_ps(_mm512_loadu_ps(src + k), e));
        }
        dst[m] = _mm512_reduce_add_ps(acc);
      }
    }
  }
}

namespace {

// acc[r][m] += s[r] * c[r][m] + b[r] * sx[m] for the first `rows` rows of a 16 x 16 block.
VUN_AMX_TARGET inline void scale_group(float* acc, const float* c, const float* s, const float* b,
                                       size_t stride, const __m512 sx, size_t rows) {
  for (size_t r = 0; r < rows; ++r) {
    __m512 a = _mm512_load_ps(acc + r * kTile);
    a = _mm512_fmadd_ps(_mm512_set1_ps(s[r * stride]), _mm512_load_ps(c + r * kTile), a);
    a = _mm512_fmadd_ps(_mm512_set1_ps(b[r * stride]), sx, a);
    _mm512_store_ps(acc + r * kTile, a);
  }
}

// y[m0 + m, n0 + r] = acc[r][m] * 2^-exps[m] for m < mrows, r < rows (acc is [n][m]: transposed
// on the way; exps: amx_prepare_x's row scaling, undone).
VUN_AMX_TARGET inline void store_block(const float* acc, const float* exps, float* y, size_t N,
                                       size_t n0, size_t rows, size_t m0, size_t mrows) {
  __m512i t[kTile];
  for (size_t r = 0; r < kTile; ++r) {
    t[r] = _mm512_load_si512(acc + r * kTile);
  }
  transpose16(t);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (size_t m = 0; m < mrows; ++m) {
    const __m512 out = _mm512_scalef_ps(_mm512_castsi512_ps(t[m]), _mm512_set1_ps(-exps[m]));
    _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, out);
  }
}

// Up to 4 n-blocks (count) of one m-block: accumulators in tiles 0-3, the weight tile in 4,
// x's three parts in 5-7 (loaded once per segment for all 4 n-blocks).
// (_tile_* take tile numbers as literals: a macro, not a template.)
#define VUN_DP3(I, a)          \
  do {                         \
    _tile_loadd(4, (a), 64);   \
    _tile_dpbf16ps(I, 4, 5);   \
    _tile_dpbf16ps(I, 4, 6);   \
    _tile_dpbf16ps(I, 4, 7);   \
  } while (0)

// Up to 4 n-blocks (count, starting at row n0) of one m-block (rows m0 .. m0 + mrows of y).
// Weight tiles come from `panel` (one block's tiles every panel_elems) or, when JIT, are
// unpacked from wq segment by segment just before use (decode: each is used once).
template <int BITS, bool JIT>
VUN_AMX_TARGET void blocks4(const uint16_t* panel, size_t panel_elems, const uint8_t* wq,
                            size_t count, const uint16_t* xt, const float* sums,
                            const float* scales, const float* biases, float* y, size_t N,
                            size_t K, size_t group_size, size_t n0, size_t m0, size_t mrows) {
  const size_t groups = K / group_size;
  const size_t per_group = group_size / kDepth;
  alignas(64) float acc[4][kTile * kTile] = {};
  alignas(64) float c[4][kTile * kTile];
  alignas(64) uint16_t fresh[4][kTileElems];
  for (size_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (size_t s = g * per_group; s < (g + 1) * per_group; ++s) {
      const uint16_t* bt = xt + s * kParts * kTileElems;
      _tile_loadd(5, bt, 64);
      _tile_loadd(6, bt + kTileElems, 64);
      _tile_loadd(7, bt + 2 * kTileElems, 64);
      const uint16_t* a[4];
      for (size_t i = 0; i < count; ++i) {
        if constexpr (JIT) {
          unpack_tile<BITS>(wq, N, K, n0 + i * kTile, s, fresh[i]);
          a[i] = fresh[i];
        } else {
          a[i] = panel + i * panel_elems + s * kTileElems;
        }
      }
      VUN_DP3(0, a[0]);
      if (count > 1) VUN_DP3(1, a[1]);
      if (count > 2) VUN_DP3(2, a[2]);
      if (count > 3) VUN_DP3(3, a[3]);
    }
    _tile_stored(0, c[0], 64);
    if (count > 1) _tile_stored(1, c[1], 64);
    if (count > 2) _tile_stored(2, c[2], 64);
    if (count > 3) _tile_stored(3, c[3], 64);
    const __m512 sx = _mm512_load_ps(sums + g * kTile);
    for (size_t i = 0; i < count; ++i) {
      const size_t n = n0 + i * kTile;
      const size_t rows = std::min(kTile, N - n);
      // scales and biases start at row n0 (ScaleRows)
      scale_group(acc[i], c[i], scales + (i * kTile) * groups + g,
                  biases + (i * kTile) * groups + g, groups, sx, rows);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    const size_t n = n0 + i * kTile;
    store_block(acc[i], sums + groups * kTile, y, N, n, std::min(kTile, N - n), m0, mrows);
  }
}

// The n-blocks [nb0, nb1) for every m-block (decode-sized M), each weight tile unpacked just
// before its one use per m-block.
template <int BITS>
VUN_AMX_TARGET void qlinear_jit(
    const uint16_t* tiles, const float* sums, const uint8_t* wq, const void* scales,
    const void* biases, ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
    size_t nb0, size_t nb1) {
  const size_t segs = K / kDepth;
  const size_t groups = K / group_size;
  const size_t mblocks = (M + kTile - 1) / kTile;
  configure_tiles();
  for (size_t nb = nb0; nb < nb1; nb += 4) {
    // widened once per 4 blocks, not per group in the epilogue
    const ScaleRowsF32 sr = scale_rows_f32(scales, biases, st, groups, nb * kTile,
                                           std::min(N, (nb + 4) * kTile) - nb * kTile);
    for (size_t mb = 0; mb < mblocks; ++mb) {
      blocks4<BITS, true>(nullptr, 0, wq, std::min<size_t>(4, nb1 - nb),
                          tiles + mb * segs * kParts * kTileElems,
                          sums + mb * (groups + 1) * kTile, sr.s, sr.b, y, N, K,
                          group_size, nb * kTile, mb * kTile,
                          std::min(kTile, M - mb * kTile));
    }
  }
  _tile_release();
}

}  // namespace

void amx_quantized_linear_blocks(
    const uint16_t* tiles, const float* sums, const uint32_t* wq, const void* scales,
    const void* biases, ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
    int bits, size_t nb0, size_t nb1) {
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  decltype(&qlinear_jit<8>) fn = qlinear_jit<8>;
  switch (bits) {
    case 2: fn = qlinear_jit<2>; break;
    case 3: fn = qlinear_jit<3>; break;
    case 4: fn = qlinear_jit<4>; break;
    case 5: fn = qlinear_jit<5>; break;
    case 6: fn = qlinear_jit<6>; break;
    default: break;
  }
  fn(tiles, sums, w8, scales, biases, st, y, M, N, K, group_size, nb0, nb1);
}

VUN_AMX_TARGET void amx_unpack_weight(const uint32_t* wq, size_t N, size_t K, int bits,
                                      uint16_t* panel, size_t nb0, size_t nb1) {
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  const size_t segs = K / kDepth;
  for (size_t nb = nb0; nb < nb1; ++nb) {
    for (size_t s = 0; s < segs; ++s) {
      uint16_t* dst = panel + (nb * segs + s) * kTileElems;
      switch (bits) {
        case 2: unpack_tile<2>(w8, N, K, nb * kTile, s, dst); break;
        case 3: unpack_tile<3>(w8, N, K, nb * kTile, s, dst); break;
        case 4: unpack_tile<4>(w8, N, K, nb * kTile, s, dst); break;
        case 5: unpack_tile<5>(w8, N, K, nb * kTile, s, dst); break;
        case 6: unpack_tile<6>(w8, N, K, nb * kTile, s, dst); break;
        default: unpack_tile<8>(w8, N, K, nb * kTile, s, dst); break;
      }
    }
  }
}

VUN_AMX_TARGET void amx_quantized_linear_panel(
    const uint16_t* tiles, const float* sums, const uint16_t* panel, const void* scales,
    const void* biases, ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
    size_t nb0, size_t nb1, size_t mb0, size_t mb1) {
  const size_t segs = K / kDepth;
  const size_t groups = K / group_size;
  const size_t panel_elems = segs * kTileElems;
  configure_tiles();
  for (size_t nb = nb0; nb < nb1; nb += 4) {
    // widened once per 4 blocks, not per group in the epilogue
    const ScaleRowsF32 sr = scale_rows_f32(scales, biases, st, groups, nb * kTile,
                                           std::min(N, (nb + 4) * kTile) - nb * kTile);
    for (size_t mb = mb0; mb < mb1; ++mb) {
      blocks4<4, false>(panel + nb * panel_elems, panel_elems, nullptr,
                        std::min<size_t>(4, nb1 - nb), tiles + mb * segs * kParts * kTileElems,
                        sums + mb * (groups + 1) * kTile, sr.s, sr.b, y, N, K,
                        group_size, nb * kTile, mb * kTile, std::min(kTile, M - mb * kTile));
    }
  }
  _tile_release();
}

// ---- int8 tiles (TDPBUSD) for decode batches of 5-16 rows, x quantized as in cpu_q8.cpp ----
//
// The weight codes are the A operand as they are (unsigned bytes, 16 rows n x D k, unpacked by
// VBMI), x the signed-byte B operand in VNNI layout (row kr: 4 bytes k = 4 kr .. 4 kr + 3 of
// each of 16 x rows), one or two int8 terms of x (quantized_gemv_q8's), so a tile product is
// the exact integer sum over D elements of q times a term of x. D = 32 (one block of x, one
// dx) or 16 for groups of 16; the epilogue applies s[n, g] * dx[m] per segment and b[n, g] *
// sum(x over g) per group, in fp32.

namespace {

size_t q8_depth(size_t group_size) {
  return group_size == 16 ? 16 : 32;
}

struct AmxQ8Layout {
  size_t depth, segs, tile_bytes, hi, lo, dx, sx, bytes;
};

AmxQ8Layout amx_q8_layout(size_t K, size_t group_size) {
  AmxQ8Layout l{};
  l.depth = q8_depth(group_size);
  l.segs = K / l.depth;
  l.tile_bytes = l.depth / 4 * 64;
  l.hi = 0;
  l.lo = l.segs * l.tile_bytes;
  l.dx = 2 * l.segs * l.tile_bytes;
  l.sx = l.dx + K / 32 * kTile * 4;
  l.bytes = l.sx + K / group_size * kTile * 4;
  return l;
}

// A: tile 0 (16 rows x D bytes); B: tiles 1 and 2 (D / 4 rows x 64 bytes); C: tiles 3 and 4.
VUN_AMX_TARGET void configure_q8_tiles(size_t depth) {
  TileConfig cfg;
  cfg.rows[0] = kTile;
  cfg.colsb[0] = static_cast<uint16_t>(depth);
  for (int t = 1; t <= 2; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(depth / 4);
    cfg.colsb[t] = 64;
  }
  for (int t = 3; t <= 4; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The codes of segment seg (D elements) of `rows` weight rows from w, one row per 64 bytes.
template <int BITS, size_t D>
VUN_AMX_TARGET inline void unpack_codes(const uint8_t* w, size_t row_bytes, size_t rows,
                                        size_t seg, uint8_t* dst) {
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* p = w + r * row_bytes + seg * D * BITS / 8;
    _mm_prefetch(reinterpret_cast<const char*>(p) + 128, _MM_HINT_T0);  // see unpack_tile
    _mm512_store_si512(dst + r * 64, codes64<BITS>(p, D));
  }
}

// Segment seg's integer sums (hi, lo: [16 weight rows][16 x rows]) into acc: acc[r] += (256 hi
// + lo) * s[r, g] * dx (+ b[r, g] * sum of x over the group at the group's first segment), for
// the first `rows` weight rows (all 16 when FULL: an unrolled loop keeps acc in registers).
template <bool TWO, bool FULL>
VUN_AMX_TARGET __attribute__((always_inline)) inline void q8_epilogue(
    __m512* acc, const int32_t* hi, const int32_t* lo, const float* s, const float* b,
    size_t groups, size_t g, __m512 dxv, __m512 sxv, bool first, size_t rows) {
#pragma GCC unroll 16
  for (size_t r = 0; r < (FULL ? kTile : rows); ++r) {
    __m512i tot = _mm512_load_si512(hi + r * kTile);
    if constexpr (TWO) {  // 256 hi + lo per lane: |D * 255 * 127| * 257 fits in int32
      tot = _mm512_add_epi32(_mm512_slli_epi32(tot, 8), _mm512_load_si512(lo + r * kTile));
    }
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot),
                             _mm512_mul_ps(_mm512_set1_ps(s[r * groups + g]), dxv), acc[r]);
    if (first) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(b[r * groups + g]), sxv, acc[r]);
    }
  }
}

// q8_epilogue of segment seg, its sums in hi[seg % 2] and lo[seg % 2].
template <bool TWO, size_t D, bool FULL>
VUN_AMX_TARGET __attribute__((always_inline)) inline void q8_segment(
    __m512* acc, const int32_t (*hi)[kTile * kTile], const int32_t (*lo)[kTile * kTile],
    const uint8_t* xbuf, const AmxQ8Layout& l, const float* s, const float* b, size_t groups,
    size_t group_size, size_t seg, size_t rows) {
  const size_t k0 = seg * D, g = k0 / group_size;
  const auto* dx = reinterpret_cast<const float*>(xbuf + l.dx);
  const auto* sx = reinterpret_cast<const float*>(xbuf + l.sx);
  q8_epilogue<TWO, FULL>(acc, hi[seg % 2], lo[seg % 2], s, b, groups, g,
                         _mm512_load_ps(dx + k0 / 32 * kTile), _mm512_load_ps(sx + g * kTile),
                         k0 % group_size == 0, rows);
}

// y[m, n0 .. n0 + 16) for m < M (y: the m-block's first row); s, b: this block's fp32 scales
// and biases [rows, groups]. Segment seg's A tile is a_tile(seg) (16 rows `stride` bytes apart);
// overlap(seg) runs while seg's products are in flight (the just-in-time unpacking of the next
// segment, or nothing where the codes are unpacked already). Each segment's sums are stored
// after the previous segment's epilogue, which so runs while the tiles compute.
template <bool TWO, size_t D, bool FULL, class ATile, class Overlap>
VUN_AMX_TARGET inline void q8_tile_core(const uint8_t* xbuf, const AmxQ8Layout& l, size_t stride,
                                        ATile&& a_tile, Overlap&& overlap, const float* s,
                                        const float* b, float* y, size_t M, size_t N,
                                        size_t K, size_t group_size, size_t n0) {
  const size_t groups = K / group_size;
  const size_t rows = std::min(kTile, N - n0);
  alignas(64) int32_t hi[2][kTile * kTile];
  alignas(64) int32_t lo[2][kTile * kTile];
  __m512 acc[kTile];
  for (size_t r = 0; r < kTile; ++r) {
    acc[r] = _mm512_setzero_ps();
  }
  for (size_t seg = 0; seg < l.segs; ++seg) {
    _tile_loadd(0, a_tile(seg), stride);
    _tile_loadd(1, xbuf + l.hi + seg * l.tile_bytes, 64);
    _tile_zero(3);
    _tile_dpbusd(3, 0, 1);
    if constexpr (TWO) {
      _tile_loadd(2, xbuf + l.lo + seg * l.tile_bytes, 64);
      _tile_zero(4);
      _tile_dpbusd(4, 0, 2);
    }
    overlap(seg);
    if (seg > 0) {
      q8_segment<TWO, D, FULL>(acc, hi, lo, xbuf, l, s, b, groups, group_size, seg - 1, rows);
    }
    _tile_stored(3, hi[seg % 2], 64);
    if constexpr (TWO) {
      _tile_stored(4, lo[seg % 2], 64);
    }
  }
  q8_segment<TWO, D, FULL>(acc, hi, lo, xbuf, l, s, b, groups, group_size, l.segs - 1, rows);
  __m512i t[kTile];
  for (size_t r = 0; r < kTile; ++r) {
    t[r] = _mm512_castps_si512(acc[r]);
  }
  transpose16(t);  // t[m]: y[m, n0 .. n0 + 16)
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (size_t m = 0; m < M; ++m) {
    _mm512_mask_storeu_ps(y + m * N + n0, mask, _mm512_castsi512_ps(t[m]));
  }
}

// q8_tile_core for the block at n0, its epilogue unrolled over 16 weight rows where the block
// is whole (FULL), over the rows that exist where it is the last, partial one.
template <bool TWO, size_t D, class ATile, class Overlap>
VUN_AMX_TARGET inline void q8_tile_run(const uint8_t* xbuf, const AmxQ8Layout& l, size_t stride,
                                       ATile&& a_tile, Overlap&& overlap, const float* s,
                                       const float* b, float* y, size_t M, size_t N, size_t K,
                                       size_t group_size, size_t n0) {
  if (N - n0 >= kTile) {
    q8_tile_core<TWO, D, true>(xbuf, l, stride, a_tile, overlap, s, b, y, M, N, K, group_size,
                               n0);
  } else {
    q8_tile_core<TWO, D, false>(xbuf, l, stride, a_tile, overlap, s, b, y, M, N, K, group_size,
                                n0);
  }
}

// q8_tile_core with each segment's codes unpacked from w8 just before use (decode: each weight
// tile is used once per call), double-buffered.
template <int BITS, bool TWO, size_t D>
VUN_AMX_TARGET void q8_tile_block(const uint8_t* xbuf, const AmxQ8Layout& l, const uint8_t* w8,
                                  const float* s, const float* b, float* y, size_t M, size_t N,
                                  size_t K, size_t group_size, size_t n0) {
  const size_t row_bytes = K * BITS / 8;
  const size_t rows = std::min(kTile, N - n0);
  alignas(64) uint8_t a[2][kTile * 64];  // this segment's codes and the next one's
  for (size_t r = rows; r < kTile; ++r) {
    _mm512_store_si512(a[0] + r * 64, _mm512_setzero_si512());
    _mm512_store_si512(a[1] + r * 64, _mm512_setzero_si512());
  }
  const uint8_t* w = w8 + n0 * row_bytes;
  unpack_codes<BITS, D>(w, row_bytes, rows, 0, a[0]);
  const auto a_tile = [&](size_t seg) { return a[seg % 2]; };
  const auto overlap = [&](size_t seg) {
    if (seg + 1 < l.segs) {
      unpack_codes<BITS, D>(w, row_bytes, rows, seg + 1, a[(seg + 1) % 2]);
    }
  };
  q8_tile_run<TWO, D>(xbuf, l, 64, a_tile, overlap, s, b, y, M, N, K, group_size, n0);
}

// q8_tile_core over codes unpacked already (amx_q8_unpack_panel): the block's segment seg is
// 16 rows of D codes, contiguous at codes + seg * 16 * D.
template <bool TWO, size_t D>
VUN_AMX_TARGET void q8_panel_block(const uint8_t* xbuf, const AmxQ8Layout& l, const uint8_t* codes,
                                   const float* s, const float* b, float* y, size_t M, size_t N,
                                   size_t K, size_t group_size, size_t n0) {
  const auto a_tile = [&](size_t seg) { return codes + seg * kTile * D; };
  q8_tile_run<TWO, D>(xbuf, l, D, a_tile, [](size_t) {}, s, b, y, M, N, K, group_size, n0);
}

// The codes of w's 16-row blocks [nb0, nb1) as tiles of 16 rows x D codes, one byte each:
// block nb's segment seg at panel + (nb * segs + seg) * 16 * D; rows past N zero.
template <int BITS, size_t D>
VUN_AMX_TARGET void q8_unpack_tiles(const uint8_t* w8, size_t N, size_t K, uint8_t* panel,
                                    size_t nb0, size_t nb1) {
  const size_t row_bytes = K * BITS / 8, segs = K / D;
  for (size_t nb = nb0; nb < nb1; ++nb) {
    uint8_t* block = panel + nb * segs * kTile * D;
    for (size_t r = 0; r < kTile; ++r) {
      const size_t n = nb * kTile + r;
      for (size_t k = 0; k < K; k += 64) {
        alignas(64) uint8_t codes[64];
        _mm512_store_si512(codes, n < N ? codes64<BITS>(w8 + n * row_bytes + k * BITS / 8,
                                                        std::min<size_t>(64, K - k))
                                        : _mm512_setzero_si512());
        for (size_t j = 0; j < 64 && k + j < K; j += D) {
          std::memcpy(block + ((k + j) / D * kTile + r) * D, codes + j, D);
        }
      }
    }
  }
}

using Q8TileFn = void (*)(const uint8_t*, const AmxQ8Layout&, const uint8_t*, const float*,
                          const float*, float*, size_t, size_t, size_t, size_t, size_t);

template <int BITS>
Q8TileFn q8_tile_for(bool two, size_t depth) {
  if (depth == 16) {
    return two ? q8_tile_block<BITS, true, 16> : q8_tile_block<BITS, false, 16>;
  }
  return two ? q8_tile_block<BITS, true, 32> : q8_tile_block<BITS, false, 32>;
}

Q8TileFn q8_tile_fn(int bits, bool two, size_t depth) {
  switch (bits) {
    case 2: return q8_tile_for<2>(two, depth);
    case 3: return q8_tile_for<3>(two, depth);
    case 4: return q8_tile_for<4>(two, depth);
    case 5: return q8_tile_for<5>(two, depth);
    case 6: return q8_tile_for<6>(two, depth);
    default: return q8_tile_for<8>(two, depth);
  }
}

}  // namespace

size_t amx_q8_x_bytes(size_t K, size_t group_size) {
  return amx_q8_layout(K, group_size).bytes;
}

VUN_AMX_TARGET void amx_q8_prepare_x(const float* x, size_t M, size_t K, size_t group_size,
                                     bool two_terms, uint8_t* buf) {
  const AmxQ8Layout l = amx_q8_layout(K, group_size);
  if (M < kTile) {
    std::memset(buf, 0, l.bytes);  // the columns of rows past M stay zero
  }
  auto* dx = reinterpret_cast<float*>(buf + l.dx);
  auto* sx = reinterpret_cast<float*>(buf + l.sx);
  for (size_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (size_t blk = 0; blk < K / 32; ++blk) {
      const __m512 x0 = _mm512_loadu_ps(xr + 32 * blk), x1 = _mm512_loadu_ps(xr + 32 * blk + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512 v0 = _mm512_mul_ps(x0, inv), v1 = _mm512_mul_ps(x1, inv);
      // rint: round to nearest, ties to even (the current MXCSR mode, as nearbyint)
      const __m512 h0 = _mm512_roundscale_ps(v0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 h1 = _mm512_roundscale_ps(v1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      alignas(32) uint32_t words[2][8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(words[0]), int8_bytes32(h0, h1));
      if (two_terms) {
        const __m512 scale = _mm512_set1_ps(256.0f);
        const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v0, h0), scale),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v1, h1), scale),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_store_si256(reinterpret_cast<__m256i*>(words[1]), int8_bytes32(r0, r1));
      }
      // 4 consecutive elements (one dword) per B row: segment, row, column m
      for (size_t w = 0; w < 8; ++w) {
        const size_t k = 32 * blk + 4 * w;
        const size_t at = k / l.depth * l.tile_bytes + k % l.depth / 4 * 64 + m * 4;
        std::memcpy(buf + l.hi + at, &words[0][w], 4);
        if (two_terms) {
          std::memcpy(buf + l.lo + at, &words[1][w], 4);
        }
      }
      dx[blk * kTile + m] = two_terms ? amax / 127.0f / 256.0f : amax / 127.0f;
    }
    for (size_t g = 0; g < K / group_size; ++g) {
      float sum = 0.0f;
      for (size_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        sum += xr[k];
      }
      sx[g * kTile + m] = sum;
    }
  }
}

VUN_AMX_TARGET void amx_q8_linear_blocks(const uint8_t* xbuf, const uint32_t* wq,
                                         const void* scales, const void* biases, ScaleType st,
                                         float* y, size_t M, size_t N, size_t K,
                                         size_t group_size, int bits, bool two_terms,
                                         size_t nb0, size_t nb1) {
  const AmxQ8Layout l = amx_q8_layout(K, group_size);
  const size_t groups = K / group_size;
  const Q8TileFn fn = q8_tile_fn(bits, two_terms, l.depth);
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  configure_q8_tiles(l.depth);
  for (size_t nb = nb0; nb < nb1; ++nb) {
    const size_t n0 = nb * kTile, rows = std::min(kTile, N - n0);
    const ScaleRowsF32 sr = scale_rows_f32(scales, biases, st, groups, n0, rows);
    fn(xbuf, l, w8, sr.s, sr.b, y, M, N, K, group_size, n0);
  }
  _tile_release();
}

VUN_AMX_TARGET void amx_q8_unpack_panel(const uint32_t* wq, size_t N, size_t K, size_t group_size,
                                        int bits, uint8_t* panel, size_t nb0, size_t nb1) {
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  const bool d16 = q8_depth(group_size) == 16;
  switch (bits) {
#define VUN_Q8_UNPACK(B)                                             \
  case B:                                                            \
    (d16 ? q8_unpack_tiles<B, 16> : q8_unpack_tiles<B, 32>)(w8, N, K, panel, nb0, nb1); \
    break;
    VUN_Q8_UNPACK(2)
    VUN_Q8_UNPACK(3)
    VUN_Q8_UNPACK(4)
    VUN_Q8_UNPACK(5)
    VUN_Q8_UNPACK(6)
#undef VUN_Q8_UNPACK
    default:
      (d16 ? q8_unpack_tiles<8, 16> : q8_unpack_tiles<8, 32>)(w8, N, K, panel, nb0, nb1);
      break;
  }
}

VUN_AMX_TARGET void amx_q8_linear_panel(const uint8_t* xbufs, const uint8_t* panel,
                                        const void* scales, const void* biases, ScaleType st,
                                        float* y, size_t M, size_t N, size_t K,
                                        size_t group_size, bool two_terms, size_t nb0,
                                        size_t nb1, size_t mb0, size_t mb1) {
  const AmxQ8Layout l = amx_q8_layout(K, group_size);
  const size_t groups = K / group_size;
  decltype(&q8_panel_block<true, 32>) fn =
      l.depth == 16 ? (two_terms ? q8_panel_block<true, 16> : q8_panel_block<false, 16>)
                    : (two_terms ? q8_panel_block<true, 32> : q8_panel_block<false, 32>);
  configure_q8_tiles(l.depth);
  for (size_t nb = nb0; nb < nb1; ++nb) {
    const size_t n0 = nb * kTile, rows = std::min(kTile, N - n0);
    const ScaleRowsF32 sr = scale_rows_f32(scales, biases, st, groups, n0, rows);
    for (size_t mb = mb0; mb < mb1; ++mb) {
      fn(xbufs + mb * l.bytes, l, panel + n0 * K, sr.s, sr.b, y + mb * kTile * N,
         std::min(kTile, M - mb * kTile), N, K, group_size, n0);
    }
  }
  _tile_release();
}
#else
void amx_prepare_x(const float*, size_t, size_t, size_t, uint16_t*, float*, size_t, size_t) {
  std::abort();  // callers check amx_usable()
}
void amx_quantized_linear_blocks(const uint16_t*, const float*, const uint32_t*, const void*,
                                 const void*, ScaleType, float*, size_t, size_t, size_t, size_t,
                                 int, size_t, size_t) {
  std::abort();
}
void amx_unpack_weight(const uint32_t*, size_t, size_t, int, uint16_t*, size_t, size_t) {
  std::abort();
}
void amx_quantized_linear_panel(const uint16_t*, const float*, const uint16_t*, const void*,
                                const void*, ScaleType, float*, size_t, size_t, size_t, size_t,
                                size_t, size_t, size_t, size_t) {
  std::abort();
}
size_t amx_q8_x_bytes(size_t, size_t) {
  return 0;
}
void amx_q8_prepare_x(const float*, size_t, size_t, size_t, bool, uint8_t*) {
  std::abort();
}
void amx_q8_linear_blocks(const uint8_t*, const uint32_t*, const void*, const void*, ScaleType,
                          float*, size_t, size_t, size_t, size_t, int, bool, size_t, size_t) {
  std::abort();
}
void amx_q8_unpack_panel(const uint32_t*, size_t, size_t, size_t, int, uint8_t*, size_t,
                         size_t) {
  std::abort();
}
void amx_q8_linear_panel(const uint8_t*, const uint8_t*, const void*, const void*, ScaleType,
                         float*, size_t, size_t, size_t, size_t, bool, size_t, size_t, size_t,
                         size_t) {
  std::abort();
}
#endif

}  // namespace vun
