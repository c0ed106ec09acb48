"""Decode attention straight from the paged pool on the CUDA backend (an optional accelerator).

The pure-MLX reference (:mod:`vllm_unified.attention.paged`) gathers every decode sequence's
keys and values out of the pool into ``[Bd, Hkv, S, D]`` arrays per layer and step, then runs
SDPA over them: at batch 64 and 640-token contexts that is ~170 MB written and read again per
layer, and the boolean mask of unequal lengths takes SDPA off its fastest path. This kernel
reads each key and value once, where it lies in the pool, through the block table: one thread
block per (sequence, KV head) serving all the query heads of that GQA group (so each cell is
read once, not once per query head), its warps splitting the keys, each lane loading its
channels of a key and its value as one vector, an online softmax per warp and query head
(fp32), the warps' partial results combined in shared memory. It computes exactly the
reference's function (keys ``first ... seq_len - 1``, ``first`` from the sliding window), which
``benchmarks/cuda_decode.py`` checks on the GPU against the reference before timing.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from vllm_unified.attention.metadata import AttentionMetadata, Window

#: Warps per thread block (each takes every WARPS-th key), at most; fewer when the block's
#: partial results would not fit in 32 KiB of shared memory (large GQA groups, D = 256).
MAX_WARPS = 16
_SHARED_BYTES = 32768

_SOURCE = """
    constexpr int EPL = D / 32;
    constexpr int G = H / HKV;
    const int b = blockIdx.x / HKV;
    const int kh = blockIdx.x - b * HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int mb = tables_shape[1];
    const int len = lens[b];
    const int first = WINDOW > 0 ? max(len - WINDOW, 0) : 0;
    const float sc = scale[0];
    const float neg_inf = __int_as_float(0xff800000);
    float qv[G][EPL];
    float acc[G][EPL];
    float m[G];
    float l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const T* qp = q + ((long long)b * H + kh * G + g) * D + lane * EPL;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            qv[g][e] = static_cast<float>(qp[e]) * sc;
            acc[g][e] = 0.f;
        }
        m[g] = neg_inf;
        l[g] = 0.f;
    }
    struct alignas(sizeof(T) * EPL) Vec {
        T v[EPL];
    };
    const int* tb = tables + (long long)b * mb;
#pragma unroll 2
    for (int j = first + warp; j < len; j += WARPS) {
        const long long slot = (long long)tb[j / BS] * BS + j % BS;
        const T* kp = kv + (slot * HKV + kh) * (2 * D) + lane * EPL;
        const Vec kk = *reinterpret_cast<const Vec*>(kp);
        const Vec vv = *reinterpret_cast<const Vec*>(kp + D);
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float t = 0.f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                t += qv[g][e] * static_cast<float>(kk.v[e]);
            }
            s[g] = t;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                s[g] += __shfl_xor_sync(0xffffffff, s[g], off);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_new = fmaxf(m[g], s[g]);
            const float corr = __expf(m[g] - m_new);
            const float p = __expf(s[g] - m_new);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                acc[g][e] = acc[g][e] * corr + p * static_cast<float>(vv.v[e]);
            }
            m[g] = m_new;
        }
    }
    __shared__ float sm[WARPS][G];
    __shared__ float sl[WARPS][G];
    __shared__ float sacc[WARPS][G][D];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            sm[warp][g] = m[g];
            sl[warp][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            sacc[warp][g][lane * EPL + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i - g * D;
        float mm = neg_inf;
        for (int w = 0; w < WARPS; ++w) {
            mm = fmaxf(mm, sm[w][g]);
        }
        float ll = 0.f;
        float o = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            const float f = sm[w][g] == neg_inf ? 0.f : __expf(sm[w][g] - mm);
            ll += sl[w][g] * f;
            o += sacc[w][g][d] * f;
        }
        out[((long long)b * H + kh * G + g) * D + d] = static_cast<T>(o / ll);
    }
"""


@functools.cache
def warps_per_block(group: int, head_dim: int) -> int:
    """Warps per block for a GQA group of ``group`` query heads of ``head_dim``: MAX_WARPS,
    halved until the warps' fp32 partial outputs fit in the shared-memory budget."""
    warps = MAX_WARPS
    while warps > 1 and warps * group * head_dim * 4 > _SHARED_BYTES:
        warps //= 2
    return warps


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
    warps = warps_per_block(heads // kv_heads, dim)
    return _kernel()(
        inputs=[queries, kv_pool, tables, lens, _scale(scale)],
        template=[("T", queries.dtype), ("D", dim), ("H", heads), ("HKV", kv_heads),
                  ("BS", meta.block_size), ("WARPS", warps),
                  ("WINDOW", 0 if window is None else int(window))],
        grid=(bd * kv_heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(bd, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )[0]
