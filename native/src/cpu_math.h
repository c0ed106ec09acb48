// Vectorized elementwise kernels for MLX's CPU backend (see cpu_math.cpp).
#pragma once

#include <cstddef>

namespace vun {

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i]: mlx-lm's SwiGLU
// (`swiglu` in mlx_lm/models/activations.py). fp32, n elements, any alignment; out may alias
// neither input.
void silu_mul_f32(const float* gate, const float* up, float* out, size_t n);

} // namespace vun

namespace vun {

// Decode attention of `heads` query heads sharing one KV head over n keys:
// out[r] = softmax_j(scale * q[r] . keys[j]) . values[j], fp32, the maximum subtracted before
// exp. q: [heads, dim]; keys[j], values[j]: dim floats each (rows of the paged pool, read where
// they lie); scores: scratch of heads * n floats; out: [heads, dim]. n >= 1.
void attend_rows_f32(
    const float* q, size_t heads, size_t dim, const float* const* keys, const float* const* values,
    size_t n, float scale, float* scores, float* out);

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
