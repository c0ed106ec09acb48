// LoRA updates of a step's rows, each row under its own adapter slot (vLLM's punica "shrink"
// and "expand" on the CPU): fp32, row-contiguous, rows whose slot is negative untouched.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vun {

// h[t, j] = sum_k x[t, k] * a[s * R + j, k] for t in [t0, t1), s = slot[t] >= 0, j < rank[s]:
// x [T, K], a [S * R, K] (each slot's A transposed, rank rows of K), h [T, R] (columns from
// rank[s] on left as they are).
void lora_shrink_f32(const float* x, const float* a, float* h, const int32_t* slot,
                     const int32_t* rank, size_t K, size_t R, size_t t0, size_t t1);

// y[t, n] += sum_{j < rank[s]} h[t, j] * b[s * R + j, n] for n in [n0, n1) and every t < T with
// s = slot[t] >= 0: h [T, R], b [S * R, N], y [T, N].
void lora_expand_f32(const float* h, const float* b, float* y, const int32_t* slot,
                     const int32_t* rank, size_t T, size_t N, size_t R, size_t n0, size_t n1);

} // namespace vun
