// Dequantization of MLX's affine-quantized weights (mx.quantize's layout) on the CPU.
//
// Rounded exactly as MLX 0.32.4's own dequantize: scale * q, rounded, plus bias, rounded. This
// file is therefore compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add
// rounds once and differs in the last bit for ~20% of weights (measured on random data), which
// would make a quantized model's outputs differ from the same model dequantized at load.
//
// x86_64 gets AVX-512 and AVX2 variants written with intrinsics (GCC's generic vectors lowered
// the byte -> int widening to scalar inserts), chosen once by what the CPU supports
// (an ISA cap of avx2 or portable, see configure in cpu_math.h, forces a lower one); other
// CPUs run the portable loop.
//
// Widths other than 4 and 8 (2, 3, 5, 6 bits): the vector kernels spread each 8-element chunk
// (BITS bytes) to 8 bytes with BMI2's PDEP, in registers, then go on as for 8 bits; the
// portable path unpacks a row's codes to bytes first (rows_via_bytes), then runs the 8-bit
// kernel. Every width rounds the same way (scale * q, then + bias).

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VUN_X86 1
#endif

namespace vun {

namespace {

// The instruction set the dispatched kernels below may use: the CPU's best, or lower when the
// ISA cap (isa_cap) asks (tests run every variant on one machine that way).
// 2: AVX-512, 1: AVX2, 0: portable C++.
int isa_level() {
  int level = 0;
#ifdef VUN_X86
  __builtin_cpu_init();
  level = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
  const int cap = std::min(static_cast<int>(isa_cap()), 2);  // amx: no lower than AVX-512
  return std::min(level, cap);
}

#ifdef VUN_X86
// BMI2's PDEP deposits the 8 consecutive BITS-bit fields of a chunk into the low bits of 8
// bytes at once (the bits above the chunk's 8 * BITS are not taken).
template <int BITS>
__attribute__((target("bmi2"))) inline uint64_t spread8(uint64_t chunk) {
  return _pdep_u64(chunk, 0x0101010101010101ull * ((1u << BITS) - 1));
}

bool has_bmi2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("bmi2");
}
#endif

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
// The 16 values of elements [k, k + 16) as bytes in order, from the row's bytes at
// p = k * BITS / 8 (`end`: the row's end, for the 2/3/5/6-bit loads).
template <int BITS>
__attribute__((target("avx2,bmi2"))) inline __m128i bytes16(const uint8_t* p,
                                                            const uint8_t* end) {
  if constexpr (BITS == 8) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else if constexpr (BITS == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  } else {
    // two 8-element chunks of BITS bytes, each spread to 8 bytes in registers
    const auto lo = static_cast<long long>(spread8<BITS>(load_chunk<BITS>(p, end)));
    const auto hi = static_cast<long long>(spread8<BITS>(load_chunk<BITS>(p + BITS, end)));
    return _mm_set_epi64x(hi, lo);
  }
}

template <int BITS>
__attribute__((target("avx512f,avx2,bmi2"))) void rows_avx512(
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
        const __m512 q = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(bytes16<BITS>(wr + k * BITS / 8, wr + row_bytes)));
        _mm512_storeu_ps(o + k, _mm512_add_ps(_mm512_mul_ps(q, s), b));
      }
    }
  }
}

template <int BITS>
__attribute__((target("avx2,bmi2"))) void rows_avx2(
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
        const __m128i v = bytes16<BITS>(wr + k * BITS / 8, wr + row_bytes);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        _mm256_storeu_ps(o + k, _mm256_add_ps(_mm256_mul_ps(lo, s), b));
        _mm256_storeu_ps(o + k + 8, _mm256_add_ps(_mm256_mul_ps(hi, s), b));
      }
    }
  }
}
#endif

// The kernel for BITS at the ISA level allowed; 2/3/5/6 bits: the vector kernels need BMI2
// (every AVX2 CPU has it), else nullptr: unpacked to bytes, then the 8-bit kernel.
template <int BITS>
RowsFn pick() {
#ifdef VUN_X86
  if (BITS != 4 && BITS != 8 && !has_bmi2()) {
    return nullptr;
  }
  switch (isa_level()) {
    case 2:
      return rows_avx512<BITS>;
    case 1:
      return rows_avx2<BITS>;
    default:
      break;
  }
#endif
  if constexpr (BITS == 4 || BITS == 8) {
    return rows_portable<BITS>;
  } else {
    return nullptr;
  }
}

// The codes of one packed row of K elements (dequantize_rows_f32's layout) as bytes.
template <int BITS>
void unpack_row(const uint8_t* row, size_t K, uint8_t* dst) {
  constexpr uint64_t mask = (uint64_t{1} << BITS) - 1;
  const uint8_t* end = row + K * BITS / 8;
  for (size_t c = 0; c < K / 8; ++c) {
    const uint64_t v = load_chunk<BITS>(row + c * BITS, end);
    for (int i = 0; i < 8; ++i) {
      dst[8 * c + i] = static_cast<uint8_t>((v >> (BITS * i)) & mask);
    }
  }
}

// Rows [r0, r1) of a 2/3/5/6-bit matrix without the vector kernels (portable ISA, or no BMI2):
// each row's codes unpacked to bytes in a per-thread buffer, then the 8-bit kernel on that row.
void rows_via_bytes(RowsFn eight, int bits, const uint32_t* wq, const float* scales,
                    const float* biases, float* out, size_t r0, size_t r1, size_t K,
                    size_t group_size) {
  thread_local std::vector<uint8_t> codes;
  if (codes.size() < K) {
    codes.resize(K);
  }
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  const size_t row_bytes = K * static_cast<size_t>(bits) / 8;
  const size_t groups = K / group_size;
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* row = w8 + r * row_bytes;
    switch (bits) {
      case 2: unpack_row<2>(row, K, codes.data()); break;
      case 3: unpack_row<3>(row, K, codes.data()); break;
      case 5: unpack_row<5>(row, K, codes.data()); break;
      default: unpack_row<6>(row, K, codes.data()); break;
    }
    eight(reinterpret_cast<const uint32_t*>(codes.data()), scales + r * groups,
          biases + r * groups, out + (r - r0) * K, 0, 1, K, group_size);
  }
}

} // namespace

void dequantize_rows_f32(
    const uint32_t* wq, const float* scales, const float* biases, float* out, size_t r0,
    size_t r1, size_t K, size_t group_size, int bits) {
  static const RowsFn fns[9] = {nullptr, nullptr, pick<2>(), pick<3>(), pick<4>(), pick<5>(),
                                 pick<6>(), nullptr, pick<8>()};
  if (const RowsFn fn = fns[bits]; fn != nullptr) {
    fn(wq, scales, biases, out, r0, r1, K, group_size);
  } else {
    rows_via_bytes(fns[8], bits, wq, scales, biases, out, r0, r1, K, group_size);
  }
}

namespace {

// The 16 e2m1 values (sign, 2 exponent bits, 1 mantissa bit), by code.
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) as fp32: the subnormal 2^-127 for s = 0, infinity for s = 255.
inline float e8m0_to_float(uint8_t s) {
  const uint32_t bits = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

#ifdef VUN_X86
__attribute__((target("avx512f,avx2"))) void mxfp4_rows_avx512(
    const uint32_t* wq, const uint8_t* scales, float* out, size_t r0, size_t r1, size_t K) {
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(wq) + r * (K / 2);
    const uint8_t* sr = scales + r * (K / 32);
    float* o = out + (r - r0) * K;
    for (size_t k = 0; k < K; k += 16) {
      const __m512 s = _mm512_set1_ps(e8m0_to_float(sr[k / 32]));
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2));
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
      _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), s));
    }
  }
}
#endif

void mxfp4_rows_portable(const uint32_t* wq, const uint8_t* scales, float* out, size_t r0,
                         size_t r1, size_t K) {
  for (size_t r = r0; r < r1; ++r) {
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(wq) + r * (K / 2);
    const uint8_t* sr = scales + r * (K / 32);
    float* o = out + (r - r0) * K;
    for (size_t k = 0; k < K; ++k) {
      o[k] = kE2m1[(wr[k / 2] >> (4 * (k % 2))) & 0xf] * e8m0_to_float(sr[k / 32]);
    }
  }
}

}  // namespace

void dequantize_rows_mxfp4(const uint32_t* wq, const uint8_t* scales, float* out, size_t r0,
                           size_t r1, size_t K) {
#ifdef VUN_X86
  static const bool vector = isa_level() >= 2;
  if (vector) {
    mxfp4_rows_avx512(wq, scales, out, r0, r1, K);
    return;
  }
#endif
  mxfp4_rows_portable(wq, scales, out, r0, r1, K);
}

} // namespace vun

namespace vun {

namespace {

#ifdef VUN_X86
// 16 at a time: VCVTPH2PS converts float16 exactly (subnormals included, whatever MXCSR says);
// bfloat16 is the high half of a float32.
__attribute__((target("avx512f"))) size_t widen16_avx512(const uint16_t* src, bool bf16,
                                                         size_t n, float* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512 f = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                          : _mm512_cvtph_ps(h);
    _mm512_storeu_ps(dst + i, f);
  }
  return i;
}

// The same 8 at a time (AVX2 with F16C).
__attribute__((target("avx2,f16c"))) size_t widen8_avx2(const uint16_t* src, bool bf16, size_t n,
                                                        float* dst) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256 f = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                          : _mm256_cvtph_ps(h);
    _mm256_storeu_ps(dst + i, f);
  }
  return i;
}

bool f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
}
#endif

}  // namespace

void widen_scales(const void* src, ScaleType t, size_t n, float* dst) {
  size_t done = 0;
#ifdef VUN_X86
  // a scalar conversion per scale cost more than the 4-bit decode kernel's whole row
  static const int level = isa_level();
  static const bool avx2 = level == 1 && f16c();
  if (level >= 2 && t != ScaleType::kF32) {
    done = widen16_avx512(static_cast<const uint16_t*>(src), t == ScaleType::kBF16, n, dst);
  } else if (avx2 && t != ScaleType::kF32) {
    done = widen8_avx2(static_cast<const uint16_t*>(src), t == ScaleType::kBF16, n, dst);
  }
#endif
  src = static_cast<const char*>(src) + done * (t == ScaleType::kF32 ? 4 : 2);
  dst += done;
  n -= done;
  switch (t) {
    case ScaleType::kF16:
      for (size_t i = 0; i < n; ++i) {
        dst[i] = half_to_float(static_cast<const uint16_t*>(src)[i]);
      }
      break;
    case ScaleType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        dst[i] = bf16_to_float(static_cast<const uint16_t*>(src)[i]);
      }
      break;
    default:
      std::copy_n(static_cast<const float*>(src), n, dst);
      break;
  }
}

ScaleRowsF32 scale_rows_f32(const void* scales, const void* biases, ScaleType t, size_t groups,
                            size_t n, size_t count) {
  if (t == ScaleType::kF32) {
    return {static_cast<const float*>(scales) + n * groups,
            static_cast<const float*>(biases) + n * groups};
  }
  thread_local std::vector<float> s32, b32;
  if (s32.size() < count * groups) {
    s32.resize(count * groups);
    b32.resize(count * groups);
  }
  constexpr size_t elem = 2;  // bytes of a float16 / bfloat16
  widen_scales(static_cast<const char*>(scales) + n * groups * elem, t, count * groups,
               s32.data());
  widen_scales(static_cast<const char*>(biases) + n * groups * elem, t, count * groups,
               b32.data());
  return {s32.data(), b32.data()};
}

} // namespace vun

// ---- quantized_gemv_f32: x @ dequantize(w).T for 1-3 rows of x, dequantized in registers ----

namespace vun {

namespace {

#ifdef VUN_X86
// Codes [k, k + 16) of a packed row as 16 dword indices whose low 4 bits are the codes (the
// bits above may hold neighbours': the table lookup reads only the low 4).
template <int BITS>
__attribute__((target("avx512f,avx2,bmi2"))) inline __m512i index16(const uint8_t* p,
                                                                   const uint8_t* end) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
  } else {
    return _mm512_cvtepu8_epi32(bytes16<BITS>(p, end));
  }
}

// The gemv's arithmetic: kExact dequantizes each weight (s * q rounded, + b rounded: MLX's
// values) and accumulates x * w with one FMA per lane in linear_cols_f32's order, so y is
// bit-identical to linear_cols_f32 on dequantize_rows_f32's rows; kTable is kExact with the
// group's 2^BITS dequantized values computed once and looked up in one register (same values,
// same bits; BITS <= 4: the two-register lookups of 5 and 6 bits were slower than the
// arithmetic). (Factoring s and b out of each group's sum was tried: slower here, and less
// accurate, since the bias term nearly cancels the scaled sum.) kMxfp4 is kTable for mxfp4
// weights (BITS 4, groups of 32): the table is the 16 e2m1 values times the group's e8m0 scale,
// `scales` the uint8 scales, `biases` unused.
enum class Gemv { kExact, kTable, kMxfp4 };

// y[m, n + j] for j < 4, m < MR: four whole weight rows from row n.
template <int BITS, int MR, Gemv MODE>
__attribute__((target("avx512f,avx2,bmi2"))) void gemv_block4(
    const float* x, const uint8_t* w8, const float* scales, const float* biases, float* y,
    size_t N, size_t K, size_t group_size, size_t n) {
  const size_t row_bytes = K * BITS / 8;
  const size_t groups = K / group_size;
  const uint8_t* wr[4];
  const float* sr[4] = {};
  const float* br[4] = {};
  const uint8_t* er[4] = {};  // kMxfp4: the rows' e8m0 scales
  for (int j = 0; j < 4; ++j) {
    wr[j] = w8 + (n + j) * row_bytes;
    if constexpr (MODE == Gemv::kMxfp4) {
      er[j] = reinterpret_cast<const uint8_t*>(scales) + (n + j) * groups;
    } else {
      sr[j] = scales + (n + j) * groups;
      br[j] = biases + (n + j) * groups;
    }
  }
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) {
      acc[m][j] = _mm512_setzero_ps();
    }
  }
  for (size_t g = 0; g < groups; ++g) {
    const size_t k0 = g * group_size, k1 = k0 + group_size;
    __m512 s[4], b[4], t[4];
    for (int j = 0; j < 4; ++j) {
      if constexpr (MODE == Gemv::kMxfp4) {
        t[j] = _mm512_mul_ps(lut, _mm512_set1_ps(e8m0_to_float(er[j][g])));
        continue;
      }
      s[j] = _mm512_set1_ps(sr[j][g]);
      b[j] = _mm512_set1_ps(br[j][g]);
      if constexpr (MODE == Gemv::kTable) {
        t[j] = _mm512_add_ps(_mm512_mul_ps(iota, s[j]), b[j]);
      }
    }
    for (size_t k = k0; k < k1; k += 16) {
      __m512 xv[MR];
      for (int m = 0; m < MR; ++m) {
        xv[m] = _mm512_loadu_ps(x + m * K + k);
      }
      for (int j = 0; j < 4; ++j) {
        __m512 w;
        if constexpr (MODE == Gemv::kTable || MODE == Gemv::kMxfp4) {
          const __m512i idx = index16<BITS>(wr[j] + k * BITS / 8, wr[j] + row_bytes);
          w = _mm512_permutexvar_ps(idx, t[j]);
        } else {
          const __m512 q = _mm512_cvtepi32_ps(
              _mm512_cvtepu8_epi32(bytes16<BITS>(wr[j] + k * BITS / 8, wr[j] + row_bytes)));
          w = _mm512_add_ps(_mm512_mul_ps(q, s[j]), b[j]);
        }
        for (int m = 0; m < MR; ++m) {
          acc[m][j] = _mm512_fmadd_ps(xv[m], w, acc[m][j]);
        }
      }
    }
  }
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int m = 0; m < MR; ++m) {
    __m128 r = _mm512_castps512_ps128(
        _mm512_permutexvar_ps(lanes, reduce4_512(acc[m][0], acc[m][1], acc[m][2], acc[m][3])));
    _mm_storeu_ps(y + m * N + n, r);
  }
}

using GemvFn = void (*)(const float*, const uint8_t*, const float*, const float*, float*, size_t,
                        size_t, size_t, size_t);

template <int BITS, Gemv MODE>
GemvFn gemv_for_rows(size_t M) {
  switch (M) {
    case 1: return gemv_block4<BITS, 1, MODE>;
    case 2: return gemv_block4<BITS, 2, MODE>;
    default: return gemv_block4<BITS, 3, MODE>;
  }
}

template <Gemv MODE>
GemvFn gemv_for(int bits, size_t M) {
  constexpr Gemv kArith = Gemv::kExact;  // no table beyond 4 bits
  switch (bits) {
    case 2: return gemv_for_rows<2, MODE>(M);
    case 3: return gemv_for_rows<3, MODE>(M);
    case 4: return gemv_for_rows<4, MODE>(M);
    case 5: return gemv_for_rows<5, kArith>(M);
    case 6: return gemv_for_rows<6, kArith>(M);
    default: return gemv_for_rows<8, kArith>(M);
  }
}
#endif

} // namespace

size_t quantized_gemv_f32(const float* x, const uint32_t* wq, const float* scales,
                          const float* biases, float* y, size_t M, size_t N, size_t K,
                          size_t group_size, int bits, size_t n0, size_t n1, int mode) {
#ifdef VUN_X86
  static const bool usable = isa_level() == 2 && has_bmi2();
  if (!usable || M < 1 || M > 3 || mode <= 0) {
    return n0;
  }
  const size_t end = n0 + (n1 - n0) / 4 * 4;
  const GemvFn fn = mode == 1 ? gemv_for<Gemv::kTable>(bits, M) : gemv_for<Gemv::kExact>(bits, M);
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  for (size_t n = n0; n < end; n += 4) {
    fn(x, w8, scales, biases, y, N, K, group_size, n);
  }
  return end;
#else
  (void)x; (void)wq; (void)scales; (void)biases; (void)y; (void)M; (void)N; (void)K;
  (void)group_size; (void)bits; (void)n1; (void)mode;
  return n0;
#endif
}

size_t quantized_gemv_mxfp4(const float* x, const uint32_t* wq, const uint8_t* scales, float* y,
                            size_t M, size_t N, size_t K, size_t n0, size_t n1) {
#ifdef VUN_X86
  static const bool usable = isa_level() == 2 && has_bmi2();
  if (!usable || M < 1 || M > 3) {
    return n0;
  }
  const size_t end = n0 + (n1 - n0) / 4 * 4;
  const GemvFn fn = gemv_for_rows<4, Gemv::kMxfp4>(M);
  const auto* w8 = reinterpret_cast<const uint8_t*>(wq);
  // the kernel reads `scales` as bytes (kMxfp4); the pointer only passes through as float*
  const auto* s = reinterpret_cast<const float*>(scales);
  for (size_t n = n0; n < end; n += 4) {
    fn(x, w8, s, nullptr, y, N, K, 32, n);
  }
  return end;
#else
  (void)x; (void)wq; (void)scales; (void)y; (void)M; (void)N; (void)K; (void)n1;
  return n0;
#endif
}

} // namespace vun
