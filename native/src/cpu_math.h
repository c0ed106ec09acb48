// Vectorized elementwise kernels for MLX's CPU backend (see cpu_math.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>
#include <optional>
#include <string>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// One variant per ISA level, chosen at load time by the dynamic linker (GCC function
// multiversioning): a build machine's flags never decide what a user's CPU must support.
#define VUN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VUN_CLONES
#endif

namespace vun {

// Settings (cpu_config.cpp): the highest instruction set the dispatched kernels may use and the
// most threads of the kernel pool. vllm_unified_native sets them at import from
// vllm_unified.envs (VLLM_UNIFIED_CPU_ISA, VLLM_UNIFIED_CPU_THREADS); each is fixed once a
// kernel first decides with it (once per process).
// kAvxVnni: AVX2 and, where the CPU has it, AVX-VNNI (its VEX dot products: Intel Alder Lake
// and later client CPUs, Sapphire Rapids, Zen 5); kAvx2 leaves AVX-VNNI out.
enum class IsaCap { kPortable = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512 = 3, kAmx = 4 };

// isa: "amx", "avx512", "avxvnni", "avx2", "portable" or nullopt (no cap); threads: >= 1 or nullopt (no
// cap; a count >= the CPUs allowed means all of them). std::invalid_argument for another value;
// std::runtime_error, changing neither, when a setting already fixed would change.
void configure(const std::optional<std::string>& isa, std::optional<long> threads);

// The ISA cap (kAmx when none), fixing it.
IsaCap isa_cap();

// The thread cap (0 when none), fixing it.
size_t thread_cap();

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i]: mlx-lm's SwiGLU
// (`swiglu` in mlx_lm/models/activations.py). fp32, n elements, any alignment; out may alias
// neither input.
void silu_mul_f32(const float* gate, const float* up, float* out, size_t n);

// out[i] = gelu_tanh(gate[i]) * up[i], gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715
// g^3))): MLX's nn.gelu_approx times up (Gemma's GeGLU MLP; vLLM's gelu_tanh_and_mul). fp32, n
// elements, any alignment; out may alias neither input.
void gelu_tanh_mul_f32(const float* gate, const float* up, float* out, size_t n);

// out[i] = cap * tanh(x[i] / cap): logit soft-capping (Gemma 2 / 4's final logits), cap > 0.
// fp32, n elements; out may alias x.
void softcap_f32(const float* x, float cap, float* out, size_t n);

// out[i] = gelu(x[i]): exact 0.5 x (1 + erf(x / sqrt(2))) (transformers' "gelu", MLX's
// nn.gelu) unless tanh, else the tanh approximation (MLX's nn.gelu_approx). fp32, n elements.
void gelu_f32(const float* x, float* out, size_t n, bool tanh);

// out = softmax of each of `rows` rows of n fp32 values (x - max, exp, normalised: MLX's
// mx.softmax over the last axis). Finite inputs (an additive mask's lowest float is finite).
void softmax_rows_f32(const float* x, float* out, size_t rows, size_t n);

} // namespace vun

namespace vun {

// What the attention kernels do to a row's scores before the softmax, beyond the scale:
// softcap > 0: s = softcap * tanh(s / softcap) (attention logit soft-capping, Gemma 2);
// sinks != nullptr: sinks[r] is query head r's sink logit (gpt-oss), which joins the
// softmax's denominator (exp(sinks[r] - m)) and weights no value.
struct ScoreOpts {
  float softcap = 0.f;
  const float* sinks = nullptr;
};

// Decode attention of `heads` query heads sharing one KV head over n keys:
// out[r] = softmax_j(scale * q[r] . keys[j]) . values[j], fp32, the maximum subtracted before
// exp (with `opts`' soft-capping and sinks). q: [heads, dim]; keys[j], values[j]: dim floats
// each (rows of the paged pool, read where they lie); scores: scratch of heads * n floats;
// out: [heads, dim]. n >= 1.
void attend_rows_f32(
    const float* q, size_t heads, size_t dim, const float* const* keys, const float* const* values,
    size_t n, float scale, float* scores, float* out, ScoreOpts opts = {});

// s[j] = exp(s[j] - max(s)) for j < n (n >= 1), vectorized (the attention kernels' softmax
// numerator); returns the sum.
float softmax_exp(float* s, size_t n);

// softmax_exp of one query head's scores with soft-capping (softcap > 0) applied to s first
// and the head's sink logit (sink != nullptr) counted in the maximum and the returned sum.
float softmax_exp_opts(float* s, size_t n, float softcap, const float* sink);

// attend_rows_f32 for head sizes 64, 128 and 256, with the dot products and the weighted sum
// of values in 16-wide registers (4 keys per reduction tree; the output accumulated in
// registers across all keys). Returns false, computing nothing, for other head sizes.
bool attend_rows_f32_fixed(
    const float* q, size_t heads, size_t dim, const float* const* keys, const float* const* values,
    size_t n, float scale, float* scores, float* out, ScoreOpts opts = {});

} // namespace vun

namespace vun {

// y[m, n] = sum_k x[m, k] * w[n, k] for n in [n0, n1) and all m < M: a linear layer's
// x @ w.T (w in nn.Linear's [out, in] layout), fp32, row-contiguous x [M, K], w [N, K],
// y [M, N]. Reads each weight row once from memory and reuses it from L1 for all M rows of x,
// so it suits small M (decode batches), where BLAS's packing of the whole weight per call
// dominates. Sums in a different order than BLAS: equal within fp32 rounding.
void linear_rows_f32(
    const float* x, const float* w, float* y, size_t M, size_t N, size_t K, size_t n0,
    size_t n1);

} // namespace vun

namespace vun {

// linear_rows_f32 for the columns [n, n + count) of y, their weight rows given separately:
// wn [count, K] row-contiguous (e.g. rows dequantized into a scratch buffer). The same tiles
// in the same order as linear_rows_f32, so equal weights give bit-identical outputs.
void linear_cols_f32(
    const float* x, const float* wn, float* y, size_t M, size_t N, size_t K, size_t n,
    size_t count);

// The element type of a quantized weight's scales and biases (both the same): float32, or the
// 16-bit float16 / bfloat16 that MLX-format checkpoints store and that GGUF's Q4_0, Q4_1, Q5_0,
// Q5_1 and Q8_0 scales fit exactly. The kernels widen each one to fp32 (exactly) as they read it.
enum class ScaleType { kF32, kF16, kBF16 };

// An IEEE binary16 value (its bits) as the fp32 of the same value (exact, subnormals, infinities
// and NaN included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24, exact in fp32
    const float f = static_cast<float>(man) * 0x1p-24f;
    __builtin_memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// A bfloat16 value (its bits) as fp32: the high half of the fp32 word.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Element i of p (scales or biases of type ST) as fp32, exactly.
template <ScaleType ST>
inline float scale_at(const void* p, size_t i) {
  if constexpr (ST == ScaleType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == ScaleType::kF16) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

// dst[i] = element i of src (scales or biases of type t) as fp32, for i < n.
void widen_scales(const void* src, ScaleType t, size_t n, float* dst);

// A GEMM panel's fp32 scales and biases: the scales [groups][block_rows] at dst, then the
// biases, of weight rows [n0, n0 + rows) (rows past them 0). The rows' values are contiguous:
// widened in one widen_scales call each (vectors; a scalar half_to_float per value cost more
// than unpacking the rows' codes), then transposed.
template <ScaleType ST>
void widen_panel_scales(const void* scales, const void* biases, size_t groups, size_t n0,
                        size_t rows, size_t block_rows, float* dst) {
  constexpr size_t eb = ST == ScaleType::kF32 ? 4 : 2;
  thread_local std::vector<float> wide;
  wide.resize(rows * groups);
  float* const parts[2] = {dst, dst + groups * block_rows};
  const void* const src[2] = {scales, biases};
  for (int p = 0; p < 2; ++p) {
    widen_scales(static_cast<const char*>(src[p]) + n0 * groups * eb, ST, rows * groups,
                 wide.data());
    for (size_t g = 0; g < groups; ++g) {
      float* out = parts[p] + g * block_rows;
      for (size_t r = 0; r < block_rows; ++r) {
        out[r] = r < rows ? wide[r * groups + g] : 0.0f;
      }
    }
  }
}

// The scales and biases ([rows, groups], type t) of rows [n, n + count) as fp32 [count, groups]:
// float32 ones where they lie, 16-bit ones widened into this thread's buffers (valid until the
// thread's next call).
struct ScaleRowsF32 {
  const float* s;
  const float* b;
};
ScaleRowsF32 scale_rows_f32(const void* scales, const void* biases, ScaleType t, size_t groups,
                            size_t n, size_t count);

// Dequantize rows [r0, r1) of an MLX affine-quantized matrix (mx.quantize's layout, "affine"
// mode) into out [(r1 - r0), K] fp32: out[r, k] = scales[r, g] * q[r, k] + biases[r, g] with
// g = k / group_size, rounded as MLX's own dequantize does (product, then sum: bit-identical to
// mx.dequantize with fp32 scales and biases). wq: uint32 [rows, K * bits / 32]; each row is a
// little-endian bit stream, element k in bits [bits * k, bits * (k + 1)) of the row's bytes
// (MLX 0.32.4's packing for every width: 2 and 4 bits within 32-bit words, 3, 5 and 6 bits as
// 8 elements in `bits` bytes, 8 bits a byte each); scales, biases: fp32 [rows, K / group_size].
// bits: 2, 3, 4, 5, 6 or 8; group_size: a multiple of 16 dividing K; K * bits a multiple of
// 32. Other values are the caller's to refuse (unchecked here).
void dequantize_rows_f32(
    const uint32_t* wq, const float* scales, const float* biases, float* out, size_t r0,
    size_t r1, size_t K, size_t group_size, int bits);

// Rows [r0, r1) of an MLX mxfp4 weight as fp32 into out [(r1 - r0), K] (mx.dequantize's values
// in mode "mxfp4", all exact in fp32): element k = e2m1 code (4 bits, dequantize_rows_f32's
// 4-bit layout) times 2^(s - 127), s the uint8 e8m0 scale of its group of 32 (scales
// [rows, K / 32]; 255 gives infinities, as MLX's). K a multiple of 32.
void dequantize_rows_mxfp4(const uint32_t* wq, const uint8_t* scales, float* out, size_t r0,
                           size_t r1, size_t K);

// y[m, n] for m < M and the n of whole 4-row blocks from n0 on, up to n1 (the rows
// [n0, returned) with returned - n0 = (n1 - n0) / 4 * 4), for M in 1..3: x @ dequantize(w).T
// with each weight dequantized in registers (dequantize_rows_f32's layout, widths and group
// sizes; x [M, K], y [M, N] fp32 row-contiguous), bit-identical to linear_cols_f32 on
// dequantize_rows_f32's rows: mode 1 looks each weight up in a table of its group's 2^bits
// dequantized values (widths up to 4; wider as mode 2), mode 2 dequantizes each weight. Returns
// n0, computing nothing, without AVX-512 and BMI2, for another M or mode <= 0: the rows left are
// the caller's.
size_t quantized_gemv_f32(const float* x, const uint32_t* wq, const float* scales,
                          const float* biases, float* y, size_t M, size_t N, size_t K,
                          size_t group_size, int bits, size_t n0, size_t n1, int mode);

// quantized_gemv_f32's table kernel for mxfp4 weights (dequantize_rows_mxfp4's layout: uint8
// e8m0 scales [N, K / 32]): bit-identical to linear_cols_f32 on dequantize_rows_mxfp4's rows,
// for M in 1..3 (else, or without AVX-512 and BMI2, it returns n0).
size_t quantized_gemv_mxfp4(const float* x, const uint32_t* wq, const uint8_t* scales, float* y,
                            size_t M, size_t N, size_t K, size_t n0, size_t n1);

// ---- int8 activations (cpu_q8.cpp): llama.cpp's arithmetic for quantized layers ----

// x quantized for quantized_gemv_q8, per row of x [M, K] and 64-element span (spans = ceil(K /
// 64)), in one or two int8 terms per element. Per block of 32 elements, v = x * (127 / amax)
// (fp32, amax = the block's max|x|); one term: xq = rint(v), x~ = dx * xq with dx = amax / 127;
// two terms: also xq_lo = rint((v - xq) * 256), x~ = dx * (256 xq + xq_lo) with dx = amax /
// 127 / 256 (x to about 16 bits). xq, xq_lo: int8 [M, spans * 64] (64-byte aligned, zero past
// K; xq_lo null for one term); dx: fp32 [M, spans * 16] (64-byte aligned; each block's dx on
// its 8 VPDPBUSD lanes); sx: fp32 [M, K / group_size], the fp32 sum of x over each weight group.
struct Q8Activations {
  const int8_t* xq;
  const int8_t* xq_lo;
  const float* dx;
  const float* sx;
};

// Fills Q8Activations' buffers (sizes above; xq_lo only with two_terms) from x [M, K] fp32
// row-contiguous.
void q8_quantize_rows(const float* x, size_t M, size_t K, size_t group_size, bool two_terms,
                      int8_t* xq, int8_t* xq_lo, float* dx, float* sx);

// Whether quantized_gemv_q8 runs here for this layer: AVX-512 with BW, VBMI and VNNI (and an
// ISA cap of avx512 or amx), bits 2, 3, 4, 5, 6 or 8, group_size 16, 32 or a multiple of 64
// dividing K, K % 32 == 0.
bool q8_usable(size_t K, size_t group_size, int bits);

// y[m, n] for all m < M and the n of whole 4-row blocks from n0 (returns the first row not
// computed, as quantized_gemv_f32 does; n0 where !q8_usable): sum over groups of s * (q . x~)
// + b * sum(x), the products of q and the int8 terms of x summed exactly in int32 (cpu_q8.cpp).
// Weights in dequantize_rows_f32's layout; scales, biases [N, K / group_size] of type st.
size_t quantized_gemv_q8(const Q8Activations& a, const uint32_t* wq, const void* scales,
                         const void* biases, ScaleType st, float* y, size_t M, size_t N,
                         size_t K, size_t group_size, int bits, size_t n0, size_t n1);

// ---- the same arithmetic for 5 rows and more on AVX-512 VNNI (cpu_q8_gemm.cpp) ----
// Where q8_usable and no AMX: the AMX-INT8 tiles' arithmetic (amx_q8_linear_*) in zmm
// registers, the weight's codes unpacked into panels that every row of x reuses.

// x prepared for q8_gemm_compute: int8 terms hi (and lo with two terms) [M, K] as the rows of
// x lie, dx [M, K / 32] and sx [M, groups] fp32 (as Q8Activations defines them), each part at
// its byte offset in one 64-byte aligned buffer of `bytes`.
struct Q8GemmXLayout {
  size_t M, K, groups, hi, lo, dx, sx, bytes;
};
Q8GemmXLayout q8_gemm_x_layout(size_t M, size_t K, size_t group_size, bool two_terms);

// Rows [m0, m1) of x [M, K] (fp32, row-contiguous) into buf (l.bytes, 64-byte aligned).
void q8_gemm_prepare_x(const float* x, const Q8GemmXLayout& l, size_t group_size,
                       bool two_terms, uint8_t* buf, size_t m0, size_t m1);

// Bytes of one panel block (16 weight rows: codes, then fp32 scales and biases).
size_t q8_gemm_panel_bytes(size_t K, size_t group_size);

// Panel blocks [nb0, nb1) of w (dequantize_rows_f32's layout; scales, biases [N, K /
// group_size] of type st) into panel (64-byte aligned, (nb1 - nb0) panel blocks).
void q8_gemm_pack(const uint32_t* wq, const void* scales, const void* biases, ScaleType st,
                  size_t N, size_t K, size_t group_size, int bits, size_t nb0, size_t nb1,
                  uint8_t* panel);

// y[m, n] (y [M, N] fp32) for m in [m0, m1) and the rows n of panel blocks [nb0, nb1), from
// q8_gemm_prepare_x's buffer and q8_gemm_pack's panel of those blocks.
void q8_gemm_compute(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint8_t* panel,
                     float* y, size_t N, size_t group_size, bool two_terms, size_t nb0,
                     size_t nb1, size_t m0, size_t m1);

// ---- the same arithmetic on AVX2 (cpu_q8_avx2.cpp), bit-identical to the AVX-512 GEMM ----
// For CPUs without AVX-512 VNNI (or an ISA cap of avx2): x quantized as q8_gemm_prepare_x
// does, held as int16 x16 (hi, or 256 hi + lo), codes widened to int16 in 8-row panels (bytes
// with one term and 2-4-bit codes); every number of rows, 1-4 included.

// Whether the AVX2 kernels run here for this layer: AVX2, FMA and F16C (and an ISA cap of avx2 or
// above), the widths, group sizes and K that q8_usable takes.
bool q8_avx2_usable(size_t K, size_t group_size, int bits);

// The AVX2 GEMM's x buffer: hi is x16 [M, K] int16, lo x8 [M, K] int8 (hi alone, written
// with one term), dx and sx as q8_gemm_x_layout's.
Q8GemmXLayout q8_avx2_x_layout(size_t M, size_t K, size_t group_size);

// Rows [m0, m1) of x [M, K] (fp32, row-contiguous) into buf (l.bytes, 64-byte aligned); x16
// in even/odd order per block of 32 (its even elements, then its odd ones) where even_odd.
void q8_avx2_prepare_x(const float* x, const Q8GemmXLayout& l, size_t group_size,
                       bool two_terms, bool even_odd, uint8_t* buf, size_t m0, size_t m1);

// Whether the GEMM's panel for these holds 4-bit codes in even/odd order (x16 prepared so).
bool q8_avx2_even_odd(int bits, bool two_terms, size_t group_size);

// Whether the AVX2 GEMM's int16 products run on AVX-VNNI (VPDPWSSD): the CPU has it and the ISA
// cap is avxvnni or above. The same integer sums, so the same bits.
bool q8_avx2_vnni_runs();

// Bytes of one panel block (8 weight rows: int16 codes, then fp32 scales and biases).
size_t q8_avx2_panel_bytes(size_t K, size_t group_size);

// Panel blocks [nb0, nb1) (8 weight rows each) of w into panel (64-byte aligned); the codes'
// layout depends on bits and two_terms (the same two q8_avx2_compute takes).
void q8_avx2_pack(const uint32_t* wq, const void* scales, const void* biases, ScaleType st,
                  size_t N, size_t K, size_t group_size, int bits, bool two_terms, size_t nb0,
                  size_t nb1, uint8_t* panel);

// y[m, n] for m in [m0, m1) and the rows n of panel blocks [nb0, nb1) (8 rows each).
void q8_avx2_compute(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint8_t* panel,
                     float* y, size_t N, size_t group_size, int bits, bool two_terms,
                     size_t nb0, size_t nb1, size_t m0, size_t m1);

// The AVX2 gemv, for few rows of x: each weight row read once, its codes unpacked in registers
// and shared by up to 4 rows of x (the GEMM unpacks every code into a panel per call). Same
// integer sums as the GEMM; the fp32 sums in another order (not bit-identical to it).
// y[m, n] for every m < l.M and n in [n0, n1), from x prepared by q8_avx2_prepare_x (x16 in
// even/odd order for 4-bit codes, in order otherwise) and w's rows (scales and biases
// [N, K / group_size] of type st).
void q8_avx2_gemv(const uint8_t* xbuf, const Q8GemmXLayout& l, const uint32_t* wq, const void* scales, const void* biases, ScaleType st,
                  float* y, size_t N, size_t group_size, int bits, size_t n0, size_t n1);

// The 8 elements of a packed row that start at byte p (a multiple of BITS bytes into the row)
// as the low 8 * BITS bits of a little-endian integer; the bits above are other elements' (or
// zero). Reads 8 bytes at once where they lie before `end` (the row's end), else only the
// BITS bytes it needs, assembled in registers (a memcpy of BITS bytes into a zeroed integer
// goes through the stack and stalls the load on store forwarding: 8x slower decode).
template <int BITS>
inline uint64_t load_chunk(const uint8_t* p, const uint8_t* end) {
  uint64_t v;
  if (end - p >= 8) {
    __builtin_memcpy(&v, p, 8);
    return v;
  }
  v = 0;
  for (int i = 0; i < BITS; ++i) {
    v |= static_cast<uint64_t>(p[i]) << (8 * i);
  }
  return v;
}

} // namespace vun

namespace vun {

// RMSNorm of each row (nn.RMSNorm / mx.fast.rms_norm): out[r, d] = x[r, d] / sqrt(mean_d(x[r]^2)
// + eps) * w[d], fp32, x and out [rows, D] row-contiguous, w [D]; IEEE semantics (cpu_norm.cpp).
void rms_norm_f32(const float* x, const float* w, float* out, size_t rows, size_t D, float eps);

// Rotary embedding (mx.fast.rope's function) in two steps. rope_table_f32: for each (b, l) of
// x [B, H, L, D], position p = (l + offset_b) * scale in fp32, offset_b = offsets[b]
// (offsets[0] for all b when num_offsets == 1), theta_i = p * inv_freq[i] for i < half = dims /
// 2; table[(b * L + l) * 2 * half + i] = cos(theta_i), [... + half + i] = sin(theta_i).
// rope_apply_f32: rows [row0, row1) of x viewed as [B * H * L, D] (row-contiguous, fp32), pairs
// (x[i], x[i + half]) (traditional: (x[2i], x[2i + 1])) rotated by theta_i, elements past dims
// copied. dims <= D, even (unchecked here).
void rope_table_f32(
    const int32_t* offsets, size_t num_offsets, size_t B, size_t L, size_t half,
    const float* inv_freq, float scale, float* table);
void rope_apply_f32(
    const float* x, float* out, const float* table, size_t H, size_t L, size_t D, size_t dims,
    bool traditional, size_t row0, size_t row1);

} // namespace vun

namespace vun {

// Intel AMX kernels for x @ dequantize(w).T (cpu_amx.cpp): fp32-accurate (x split into three
// bf16 parts, the integer q of the weight exact in bf16, scales and biases applied per group in
// fp32). Not bit-identical to dequantize-then-multiply: the sums are grouped differently.

// Whether they may run: the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16, Linux granted the tile
// state, and the ISA cap (isa_cap) is amx. Decided once per process.
bool amx_usable();

// Sizes of amx_prepare_x's outputs for x [M, K]: bf16 tiles (uint16 elements) and fp32 sums.
size_t amx_x_tile_elems(size_t M, size_t K);
size_t amx_x_sum_floats(size_t M, size_t K, size_t group_size);

// x [M, K] fp32 row-contiguous -> tiles (64-byte aligned): for 16-row blocks mb in [mb0, mb1)
// and 32-column segments, the three bf16 parts of x in TDPBF16PS's B layout, rows past M zero;
// sums [mb][groups + 1][16]: for g < groups the sum over group g of row 16 mb + m, and at
// g = groups the exponent e of that row's scaling: the tiles and sums hold x * 2^e, e chosen so
// the row's largest magnitude is in [1, 2) (0 for a zero or non-finite row), undone on the
// output. K % 32 == 0, group_size % 32 == 0.
void amx_prepare_x(const float* x, size_t M, size_t K, size_t group_size, uint16_t* tiles,
                   float* sums, size_t mb0, size_t mb1);

// y[m, n] for n in 16-row blocks [nb0, nb1) of w and all m < M, from amx_prepare_x's tiles and
// sums and an MLX affine-quantized w (dequantize_rows_f32's layout and widths), each weight
// tile unpacked just before use: for decode-sized M (one or two 16-row blocks). scales, biases:
// [N, K / group_size] of type st.
void amx_quantized_linear_blocks(
    const uint16_t* tiles, const float* sums, const uint32_t* wq, const void* scales,
    const void* biases, ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
    int bits, size_t nb0, size_t nb1);

// For larger M, the weight unpacked once per call and shared by all threads: panel (64-byte
// aligned, amx_weight_elems(N, K) uint16) gets the bf16 tiles of the 16-row blocks [nb0, nb1).
size_t amx_weight_elems(size_t N, size_t K);
void amx_unpack_weight(const uint32_t* wq, size_t N, size_t K, int bits, uint16_t* panel,
                       size_t nb0, size_t nb1);

// y[m, n] for the n-blocks [nb0, nb1) (a multiple of 4 apart, or ending at the last) and the
// 16-row m-blocks [mb0, mb1), from prepared x and an unpacked weight panel.
void amx_quantized_linear_panel(
    const uint16_t* tiles, const float* sums, const uint16_t* panel, const void* scales,
    const void* biases, ScaleType st, float* y, size_t M, size_t N, size_t K, size_t group_size,
    size_t nb0, size_t nb1, size_t mb0, size_t mb1);


// Batches of 5 rows and more against x quantized as quantized_gemv_q8 quantizes it (one or two
// int8 terms per 32 elements), on AMX-INT8 tiles (TDPBUSD: the weight codes times the terms of
// x, exact integer sums per 32 elements, or 16 for groups of 16; scales, dx and the biases
// applied in fp32). amx_q8_prepare_x fills buf (amx_q8_x_bytes(K, group_size) bytes, 64-byte
// aligned) from x [M <= 16, K] (one m-block); amx_q8_linear_blocks computes y[m, n] for the
// 16-row weight blocks [nb0, nb1) and all m < M, each weight tile unpacked just before use. Layouts as quantized_gemv_q8 takes them (q8_usable), with
// amx_usable() and AMX-INT8.
size_t amx_q8_x_bytes(size_t K, size_t group_size);
void amx_q8_prepare_x(const float* x, size_t M, size_t K, size_t group_size, bool two_terms,
                      uint8_t* buf);
void amx_q8_linear_blocks(const uint8_t* xbuf, const uint32_t* wq, const void* scales,
                          const void* biases, ScaleType st, float* y, size_t M, size_t N,
                          size_t K, size_t group_size, int bits, bool two_terms, size_t nb0,
                          size_t nb1);

// Larger M (prefill chunks): x prepared per 16-row m-block, block mb at xbufs + mb *
// amx_q8_x_bytes(K, group_size); the weight's codes unpacked once per call, one byte each, by
// amx_q8_unpack_panel for the 16-row blocks [nb0, nb1) into panel (64-byte aligned, N rounded
// up to 16 rows x K bytes: each block's tiles of 16 rows x 32 codes, or 16 for groups of 16,
// contiguous; rows past N zero); amx_q8_linear_panel computes y[m, n] for the n-blocks
// [nb0, nb1) and m-blocks [mb0, mb1).
void amx_q8_unpack_panel(const uint32_t* wq, size_t N, size_t K, size_t group_size, int bits,
                         uint8_t* panel, size_t nb0, size_t nb1);
void amx_q8_linear_panel(const uint8_t* xbufs, const uint8_t* panel, const void* scales,
                         const void* biases, ScaleType st, float* y, size_t M, size_t N,
                         size_t K, size_t group_size, bool two_terms, size_t nb0, size_t nb1,
                         size_t mb0, size_t mb1);

} // namespace vun
