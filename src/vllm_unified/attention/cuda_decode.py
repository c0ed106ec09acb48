"""Decode attention straight from the paged pool on the CUDA backend (an optional accelerator).

The pure-MLX reference (:mod:`vllm_unified.attention.paged`) gathers every decode sequence's
keys and values out of the pool into ``[Bd, Hkv, S, D]`` arrays per layer and step, then runs
SDPA over them: at batch 64 and 640-token contexts that is ~170 MB written and read again per
layer, and the boolean mask of unequal lengths takes SDPA off its fastest path. This kernel
reads each key and value once, where it lies in the pool, through the block table: one thread
block per (sequence, query head), its warps splitting the keys, an online softmax per warp
(fp32), the warps' partial results combined in shared memory. It computes exactly the
reference's function (keys ``first ... seq_len - 1``, ``first`` from the sliding window), which
``benchmarks/cuda_decode.py`` checks on the GPU against the reference before timing.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from vllm_unified.attention.metadata import AttentionMetadata, Window

WARPS = 16

_SOURCE = """
    constexpr int EPL = D / 32;
    const int b = blockIdx.x / H;
    const int h = blockIdx.x - b * H;
    const int g = h / (H / HKV);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int mb = tables_shape[1];
    const int len = lens[b];
    const int first = WINDOW > 0 ? max(len - WINDOW, 0) : 0;
    const float sc = scale[0];
    const float neg_inf = __int_as_float(0xff800000);
    float qv[EPL];
    float acc[EPL];
    const T* qp = q + ((long long)b * H + h) * D + lane * EPL;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        qv[e] = static_cast<float>(qp[e]) * sc;
        acc[e] = 0.f;
    }
    float m = neg_inf;
    float l = 0.f;
    for (int j = first + warp; j < len; j += WARPS) {
        const long long blk = tables[(long long)b * mb + j / BS];
        const long long slot = blk * BS + j % BS;
        const T* kp = kv + (slot * HKV + g) * (2 * D) + lane * EPL;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            s += qv[e] * static_cast<float>(kp[e]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            s += __shfl_xor_sync(0xffffffff, s, off);
        }
        const float m_new = fmaxf(m, s);
        const float corr = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            acc[e] = acc[e] * corr + p * static_cast<float>(kp[D + e]);
        }
        m = m_new;
    }
    __shared__ float sm[WARPS];
    __shared__ float sl[WARPS];
    __shared__ float sacc[WARPS][D];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        sacc[warp][lane * EPL + e] = acc[e];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float mm = neg_inf;
        for (int w = 0; w < WARPS; ++w) {
            mm = fmaxf(mm, sm[w]);
        }
        float ll = 0.f;
        float o = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            const float f = sm[w] == neg_inf ? 0.f : __expf(sm[w] - mm);
            ll += sl[w] * f;
            o += sacc[w][d] * f;
        }
        out[((long long)b * H + h) * D + d] = static_cast<T>(o / ll);
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="vllm_unified_paged_decode",
        input_names=["q", "kv", "tables", "lens", "scale"],
        output_names=["out"],
        source=_SOURCE,
    )


def supported(head_dim: int) -> bool:
    """Head sizes the kernel handles: a multiple of 32 (each lane takes D / 32 channels)."""
    return head_dim % 32 == 0 and head_dim <= 256


@functools.cache
def _scale(scale: float) -> mx.array:
    """The score scale as a device array, made once (not once per layer and step)."""
    return mx.array([scale], dtype=mx.float32)


def paged_decode_attention(
    queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: Window,
) -> mx.array:
    """Decode rows' attention over ``kv_pool`` (``[slots, Hkv, 2 * D]``, K then V per cell).

    Args:
        queries: ``[Bd, H, 1, D]`` decode queries (RoPE'd), in the pool's dtype.
        kv_pool: one layer's pool.
        meta: the step's metadata: its decode rows' block tables and lengths as device arrays
            (:meth:`AttentionMetadata.decode_tables_lens`, made once per step, or the traced
            inputs of a compiled step).
        scale: score multiplier.
        window: sliding window in tokens (keys at positions > len - 1 - window are visible)
            or None.

    Returns:
        ``[Bd, H, 1, D]`` in the queries' dtype.
    """
    bd, heads, _, dim = queries.shape
    kv_heads = kv_pool.shape[1]
    tables, lens = meta.decode_tables_lens()
    return _kernel()(
        inputs=[queries, kv_pool, tables, lens, _scale(scale)],
        template=[("T", queries.dtype), ("D", dim), ("H", heads), ("HKV", kv_heads),
                  ("BS", meta.block_size), ("WARPS", WARPS),
                  ("WINDOW", 0 if window is None else int(window))],
        grid=(bd * heads * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(bd, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )[0]
