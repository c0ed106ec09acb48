// Quantized KV cache formats of vLLM 0.32 on the CPU (see cpu_kvquant.cpp): the quantizing
// write of one (token, head) cell and attention over quantized cells.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu_math.h"  // ScoreOpts

namespace vun {

// vLLM's per-token-head KV formats (vllm/v1/kv_cache_interface.py KVQuantMode), as the native
// kernels number them. One (slot, KV head) cell of a layer's page holds, in bytes,
// [K data (Dk) | K scale (fp32) | V data (Dk) | V scale (fp32)]: vLLM's Triton backend layout
// (TritonAttentionBackend.customize_spec, TritonAttentionImpl._ensure_scale_caches).
enum KVMode : int {
  kKVDense = 0,  // the model dtype, K then V (no cell format)
  kKVInt8 = 1,   // int8_per_token_head: Dk = D int8, scale = absmax / 127
  kKVInt4 = 2,   // int4_per_token_head: Dk = D / 2 bytes (even element in the low nibble),
                 // data Hadamard-rotated, asymmetric: scale with the 4-bit zero point in its
                 // mantissa's low 4 bits
  kKVFp8 = 3,    // fp8_per_token_head: Dk = D bytes of float8 e4m3fn, scale = absmax / 448
  // turboquant_k8v4 (vLLM's TurboQuant backend, triton_turboquant_store.py): a cell is
  // [K: D bytes float8 e4m3fn, no scale | V: D / 2 bytes, 4-bit (even element in the low
  // nibble) | V scale fp16 | V zero (the row's min) fp16], slot_size = 3D/2 + 4 (even for
  // D % 4 == 0, so vLLM's slot_size_aligned adds nothing).
  kKVTqK8V4 = 4,
};

// The last mode number.
constexpr int kKVLastMode = kKVTqK8V4;

// float -> IEEE half bits, rounded to nearest even (overflow to infinity), as numpy's and
// Triton's fp32 -> fp16 conversion.
uint16_t f32_to_f16(float x);

// IEEE half bits -> float (exact).
float f16_to_f32(uint16_t h);

// float -> float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinities),
// rounded to nearest even: torch's conversion for |x| <= 448 (what the write stores).
uint8_t f32_to_e4m3(float x);

// float8 e4m3fn -> float (0x7f / 0xff: NaN).
float e4m3_to_f32(uint8_t b);

// Bytes of one side's data (K or V) in a cell (per-token-head modes).
inline size_t kv_data_bytes(int mode, size_t dim) {
  return mode == kKVInt4 ? dim / 2 : dim;
}

// Bytes of one (slot, head) cell: 2 * (data + fp32 scale); turboquant_k8v4: vLLM's
// TurboQuantConfig.slot_size_aligned (D fp8 key bytes + D / 2 value bytes + 4, rounded up to
// even).
inline size_t kv_cell_bytes(int mode, size_t dim) {
  if (mode == kKVTqK8V4) {
    const size_t s = dim + dim / 2 + 4;
    return s + (s % 2);
  }
  return 2 * (kv_data_bytes(mode, dim) + 4);
}

// turboquant_k8v4's write of one cell from fp32 key and value rows of dim floats (vLLM's
// _tq_fused_store_fp8 with FP8_E4B15 = 0, unfused): key bytes fp8(clamp(k, -448, 448)) (round
// to nearest even; GPUs' satfinite conversion), values
// q = clamp(trunc((v - min) / s + 0.5), 0, 15) with s = (max - min) / 15 (1e-8 where not
// above it), then s and min as fp16. The padding byte (if any) is not written.
void quantize_tq_k8v4(const float* k, const float* v, size_t dim, uint8_t* cell);

// turboquant_k8v4's cell back to fp32 key and value rows: k = fp8 value, v = q * s + min.
void dequantize_tq_k8v4(const uint8_t* cell, size_t dim, float* k, float* v);

// vLLM's single_rht forward (x * signs, then the unnormalised Walsh-Hadamard butterfly) in
// place, block-diagonal over blocks of `block` elements (block: the largest power-of-two
// divisor of dim); signs: `block` entries of +-1. The butterfly's additions are vLLM's CPU
// path's (fast_hadamard_transform's PyTorch butterfly), in the same order: bit-identical.
void rht_forward(float* x, size_t dim, size_t block, const float* signs);

// The inverse's unnormalised part (butterfly, then * signs): vLLM's single_rht(inverse=True).
void rht_inverse(float* x, size_t dim, size_t block, const float* signs);

// Quantizes one side (K or V) of one cell: x has dim floats (int4: already rotated), dst the
// side's data bytes followed by its 4 scale bytes. Exactly the arithmetic of vLLM's Triton
// write kernels (_reshape_cache_per_token_head, _reshape_cache_int4_kernel), unfused.
void quantize_side(int mode, const float* x, size_t dim, uint8_t* dst);

// Dequantizes one side of a cell to dim floats (int4: still rotated).
void dequantize_side(int mode, const uint8_t* src, size_t dim, float* out);

// Attention of `heads` query heads sharing one KV head over n quantized cells:
// out[r] = softmax_j(scale * q[r] . K_j) . V_j with K_j, V_j dequantized from cells[j] in
// registers (vLLM's score form: int8 (q . k_q) * scale * s_k; int4 (q . k_q - zp * sum(q)) *
// scale * s_k; values weighted by p_j * s_v, int4 less the zero point's share;
// turboquant_k8v4: (q . k_fp8) * scale, values q_v * s + min weighted by p_j, as vLLM's
// _tq_decode_stage1). q: [heads,
// dim] fp32 (int4: rotated, scale already divided by the rotation's norm); scores: scratch of
// heads * n floats; out: [heads, dim] (int4: still rotated). n >= 1.
// raw_k / raw_v (optional, turboquant_k8v4 only): per key j, a fp32 key and value row to read
// instead of the cell where raw_k[j] is not null (vLLM's TurboQuant backend attends a prefill
// chunk over its own unquantized K/V: turboquant_attn.py _prefill_attention).
// opts: soft-capping of the scores and sink logits (ScoreOpts, cpu_math.h).
void attend_rows_quant(
    int mode, const float* q, size_t heads, size_t dim, const uint8_t* const* cells, size_t n,
    float scale, float* scores, float* out, const float* const* raw_k = nullptr,
    const float* const* raw_v = nullptr, ScoreOpts opts = {});

} // namespace vun
