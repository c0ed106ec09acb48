"""Paged attention over quantized KV pages on MLX's GPU backends: one source, CUDA and Metal.

The quantized counterpart of :mod:`vllm_unified.kv.gpu.paged`, with its work split,
tiles, masks and combine (one thread group per (tile, KV head); the warps split the keys, each
lane ``D / 32`` contiguous channels; an fp32 online softmax per (row, query head); the warps'
results combined in shared memory ``CB`` pairs per pass). The pool holds vLLM's cells
(:mod:`vllm_unified.kv.quant`, ``[slots, Hkv, cell bytes]``): each key and value is read
where it lies, through the block table, and dequantized in registers (never a dense copy of
the context), as the native CPU kernel does (native/src/cpu_kvquant.cpp):

* int8 / fp8: a lane's bytes widened (fp8 e4m3fn decoded from its bits), score
  ``(q . k_q) * s_k`` with the softmax scale folded into ``q``, values weighted by
  ``p * s_v``;
* int4: nibbles less the zero point, ``(q . (k_q - zp_k)) * s_k``, values
  ``p * s_v * (v_q - zp_v)``; as vLLM's ``unified_attention_int4`` and the CPU kernel do, the
  queries are rotated by ``single_rht`` (in shared memory, butterfly stage by stage between
  barriers) and rounded to the queries' dtype, the softmax scale is divided by the rotation
  block ``b``, and each output row is rounded to the dtype, rotated back (butterfly, signs)
  and divided by ``b`` before it is stored.

* turboquant_k8v4: keys the fp8 bytes decoded (no scale), values ``q * s + min`` with the
  cell's fp16 scale and minimum, weighted by ``p``.

Routing (:func:`paged_gpu_attention_quant`): every decode row and every prefill chunk of at
most :data:`gpu_paged.MAX_KERNEL_CHUNK` rows goes to the kernel; for the per-token-head formats
fresh chunks too (the pool's quantized keys are what vLLM's Triton backend attends over, not the
layer's unquantized ones); a longer chunk goes to MLX's SDPA over its own context gathered from
the pool and dequantized (:func:`vllm_unified.kv.attention.reference.quantized_chunk_attention`), as
the dense path gathers long chunks. turboquant_k8v4 follows vLLM's TurboQuant backend: a chunk
that starts its sequence goes to MLX's SDPA over the step's own unquantized keys and values,
one longer than :data:`~vllm_unified.kv.quant.TQ_SHORT_CONTINUATION` tokens over its context's
cells followed by its own unquantized rows; shorter ones and decode rows read every key from
the cells.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from vllm_unified import gpu_dialect
from vllm_unified.kv.attention import reference
from vllm_unified.kv.attention.metadata import AttentionMetadata, Window
from vllm_unified.kv.gpu import paged as gpu_paged
from vllm_unified.kv.gpu import quant_write
from vllm_unified.kv.gpu.paged import LaunchArgs
from vllm_unified.kv.gpu.quant_write import HEADER as QUANT_HEADER
from vllm_unified.kv.quant import TQ_SHORT_CONTINUATION, KVFormat, rotation_block

KERNEL_NAME = "vllm_unified_paged_attention_quant"
#: ``after``: as :data:`gpu_paged.INPUT_NAMES`'s (the write's completion token, not read)
INPUT_NAMES = ["q", "kv", "tables", "tiles", "scale", "signs", "after"]
OUTPUT_NAMES = ["out"]

#: the kernel's helpers: the dense kernel's vector type, vLLM's float8 e4m3fn decoding and the
#: fp32 scale word of a cell side (read byte by byte: any alignment)
HEADER = gpu_paged.HEADER + QUANT_HEADER + """
UNI_FUNC float uni_kvq_e4m3_value(unsigned int b) {
    if ((b & 0x7fu) == 0x7fu) {
        return uni_as_float(0x7fc00000u);  // e4m3fn's NaN (it has no infinity)
    }
    const unsigned int e = (b >> 3) & 15u;
    const unsigned int m = b & 7u;
    const float mag = e == 0u ? (float)m * 0.001953125f
                              : uni_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) != 0u ? -mag : mag;
}
UNI_FUNC float uni_kvq_f16_value(unsigned int h) {
    const unsigned int e = (h >> 10) & 31u;
    const unsigned int m = h & 0x3ffu;
    const float mag = e == 0u ? (float)m * 5.9604644775390625e-8f  // m * 2^-24
                    : e == 31u ? uni_as_float(m != 0u ? 0x7fc00000u : 0x7f800000u)
                               : uni_as_float(((e + 112u) << 23) | (m << 13));
    return (h & 0x8000u) != 0u ? -mag : mag;
}
UNI_FUNC unsigned int uni_kvq_word(const UNI_DEVICE unsigned char* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16)
        | ((unsigned int)p[3] << 24);
}
"""

#: The kernel body. Template arguments: T (queries' dtype), P (pool dtype, int8/uint8), MODE
#: (1 int8, 2 int4, 3 fp8, 4 turboquant_k8v4), BLK (int4's rotation block, else 1), RQ (rows
#: of the rotation buffer: QT * G for int4, else 1), and those of :data:`gpu_paged.SOURCE`
#: (D, H, HKV, BS, WARPS, WINDOW, QT, CB, DECODE). ``scale`` is the softmax scale (int4:
#: divided by BLK).
SOURCE = """
    constexpr int EPL = D / 32;
    constexpr int G = H / HKV;
    constexpr int QG = QT * G;
    constexpr int DK = MODE == 2 ? D / 2 : D;
    constexpr int CELL = MODE == 4 ? D + D / 2 + 4 : 2 * (DK + 4);
    const int grp = (int)uni_group;
    const int tile = grp / HKV;
    const int kh = grp - tile * HKV;
    const int warp = (int)uni_simd;
    const int lane = (int)uni_lane;
    int row0 = tile;
    int nrows = 1;
    int seq = tile;
    int len_last;
    if (DECODE) {
        len_last = tiles[tile];
    } else {
        row0 = tiles[tile * 4];
        nrows = tiles[tile * 4 + 1];
        seq = tiles[tile * 4 + 2];
        len_last = tiles[tile * 4 + 3];
    }
    const int len0 = len_last - nrows + 1;
    const int kbeg = WINDOW > 0 ? (len0 > WINDOW ? len0 - WINDOW : 0) : 0;
    const int mb = tables_shape[1];
    const float sc = scale[0];
    const float neg_inf = uni_neg_inf();
    const UNI_DEVICE uint8_t* cells = reinterpret_cast<const UNI_DEVICE uint8_t*>(kv);
    UNI_SHARED float srot[RQ][D];
    if (MODE == 2) {
        // vLLM's single_rht of the tile's query rows: signs, then the butterfly stage by stage
        for (int x = (int)uni_thread; x < QG * D; x += (int)uni_threads) {
            const int i = x / D;
            const int d = x - i * D;
            const int qi = i / G;
            const int g = i - qi * G;
            const float v = qi < nrows
                ? static_cast<float>(q[((int64_t)(row0 + qi) * H + kh * G + g) * D + d]) : 0.f;
            srot[i][d] = v * signs[d % BLK];
        }
        UNI_BARRIER();
        for (int hh = 1; hh < BLK; hh <<= 1) {
            for (int x = (int)uni_thread; x < QG * D / 2; x += (int)uni_threads) {
                const int i = x / (D / 2);
                const int p = x - i * (D / 2);
                const int j = (p / hh) * 2 * hh + p % hh;
                const float a = srot[i][j];
                const float b = srot[i][j + hh];
                srot[i][j] = a + b;
                srot[i][j + hh] = a - b;
            }
            UNI_BARRIER();
        }
    }
    float qv[QG][EPL];
    float acc[QG][EPL];
    float m[QG];
    float l[QG];
#pragma unroll
    for (int i = 0; i < QG; ++i) {
        const int qi = i / G;
        const int g = i - qi * G;
        const int64_t qoff = ((int64_t)(row0 + (qi < nrows ? qi : 0)) * H + kh * G + g) * D
                          + lane * EPL;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            // int4: the rotated query rounded to T, as vLLM's rotated queries are
            const float x = MODE == 2 ? static_cast<float>(static_cast<T>(srot[i][lane * EPL + e]))
                                      : static_cast<float>(q[qoff + e]);
            qv[i][e] = qi < nrows ? x * sc : 0.f;
            acc[i][e] = 0.f;
        }
        m[i] = neg_inf;
        l[i] = 0.f;
    }
    const int64_t trow = (int64_t)seq * mb;
#pragma unroll 2
    for (int j = kbeg + warp; j < len_last; j += WARPS) {
        const int64_t slot = (int64_t)tables[trow + j / BS] * BS + j % BS;
        const UNI_DEVICE uint8_t* kc = cells + (slot * HKV + kh) * CELL;
        const UNI_DEVICE uint8_t* vc = kc + (MODE == 4 ? D : DK + 4);
        // the scale words (turboquant: the value's fp16 scale, then its fp16 minimum)
        const uint32_t kw = MODE == 4 ? 0u : uni_kvq_word(kc + DK);
        const uint32_t vw = uni_kvq_word(vc + (MODE == 4 ? D / 2 : DK));
        float ks, kz, vs, vz;
        if (MODE == 4) {
            ks = 1.f;  // keys: fp8 of the key itself
            kz = 0.f;
            vs = uni_kvq_f16_value(vw & 0xffffu);
            vz = uni_kvq_f16_value(vw >> 16);
        } else if (MODE == 2) {
            ks = uni_as_float(kw & 0xfffffff0u);
            kz = (float)(kw & 15u);
            vs = uni_as_float(vw & 0xfffffff0u);
            vz = (float)(vw & 15u);
        } else {
            ks = uni_as_float(kw);
            kz = 0.f;
            vs = uni_as_float(vw);
            vz = 0.f;
        }
        float kf[EPL];
        float vf[EPL];
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            const int c = lane * EPL + e;
            if (MODE == 4) {  // values q * s + min
                kf[e] = uni_kvq_e4m3_value((uint32_t)kc[c]);
                vf[e] = (float)(((uint32_t)vc[c >> 1] >> ((c & 1) * 4)) & 15u) * vs + vz;
            } else if (MODE == 2) {
                const int sh = (c & 1) * 4;
                kf[e] = (float)(((uint32_t)kc[c >> 1] >> sh) & 15u) - kz;
                vf[e] = (float)(((uint32_t)vc[c >> 1] >> sh) & 15u) - vz;
            } else if (MODE == 3) {
                kf[e] = uni_kvq_e4m3_value((uint32_t)kc[c]);
                vf[e] = uni_kvq_e4m3_value((uint32_t)vc[c]);
            } else {
                kf[e] = static_cast<float>(static_cast<int8_t>(kc[c]));
                vf[e] = static_cast<float>(static_cast<int8_t>(vc[c]));
            }
        }
#pragma unroll
        for (int qi = 0; qi < QT; ++qi) {
            const int lr = len0 + qi;
            // Uniform over the warp (j, qi and the tile are): the reductions below see
            // every lane.
            if (qi < nrows && j < lr && (WINDOW == 0 || j >= lr - WINDOW)) {
                float s[G];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    float t = 0.f;
#pragma unroll
                    for (int e = 0; e < EPL; ++e) {
                        t += qv[qi * G + g][e] * kf[e];
                    }
                    s[g] = uni_simd_sum(t) * ks;
                }
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const int i = qi * G + g;
                    const float m_new = uni_fmax(m[i], s[g]);
                    const float corr = m[i] == neg_inf ? 0.f : uni_exp(m[i] - m_new);
                    const float p = uni_exp(s[g] - m_new);
                    const float w = MODE == 4 ? p : p * vs;  // turboquant: s is in vf
                    l[i] = l[i] * corr + p;
#pragma unroll
                    for (int e = 0; e < EPL; ++e) {
                        acc[i][e] = acc[i][e] * corr + w * vf[e];
                    }
                    m[i] = m_new;
                }
            }
        }
    }
    UNI_SHARED float sm[WARPS][QG];
    UNI_SHARED float sl[WARPS][QG];
    UNI_SHARED float sacc[WARPS][CB][D];
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < QG; ++i) {
            sm[warp][i] = m[i];
            sl[warp][i] = l[i];
        }
    }
#pragma unroll
    for (int b = 0; b < QG; b += CB) {
        if (b / G < nrows) {  // uniform over the group: the barriers see every thread
#pragma unroll
            for (int c = 0; c < CB; ++c) {
                if (b + c < QG) {
#pragma unroll
                    for (int e = 0; e < EPL; ++e) {
                        sacc[warp][c][lane * EPL + e] = acc[b + c][e];
                    }
                }
            }
            UNI_BARRIER();
            for (int x = (int)uni_thread; x < CB * D; x += (int)uni_threads) {
                const int c = x / D;
                const int d = x - c * D;
                const int i = b + c;
                const int qi = i / G;
                if (i < QG && qi < nrows) {
                    float mm = neg_inf;
                    for (int w = 0; w < WARPS; ++w) {
                        mm = uni_fmax(mm, sm[w][i]);
                    }
                    float ll = 0.f;
                    float o = 0.f;
                    for (int w = 0; w < WARPS; ++w) {
                        const float f = sm[w][i] == neg_inf ? 0.f : uni_exp(sm[w][i] - mm);
                        ll += sl[w][i] * f;
                        o += sacc[w][c][d] * f;
                    }
                    const int g = i - qi * G;
                    if (MODE == 2) {
                        srot[c][d] = static_cast<float>(static_cast<T>(o / ll));  // rounded first
                    } else {
                        out[((int64_t)(row0 + qi) * H + kh * G + g) * D + d] =
                            static_cast<T>(o / ll);
                    }
                }
            }
            UNI_BARRIER();
            if (MODE == 2) {
                // the output rows back to the model's basis: butterfly, signs, / BLK
                for (int hh = 1; hh < BLK; hh <<= 1) {
                    for (int x = (int)uni_thread; x < CB * D / 2; x += (int)uni_threads) {
                        const int c = x / (D / 2);
                        const int p = x - c * (D / 2);
                        const int j = (p / hh) * 2 * hh + p % hh;
                        const float a0 = srot[c][j];
                        const float b0 = srot[c][j + hh];
                        srot[c][j] = a0 + b0;
                        srot[c][j + hh] = a0 - b0;
                    }
                    UNI_BARRIER();
                }
                for (int x = (int)uni_thread; x < CB * D; x += (int)uni_threads) {
                    const int c = x / D;
                    const int d = x - c * D;
                    const int i = b + c;
                    const int qi = i / G;
                    if (i < QG && qi < nrows) {
                        const int g = i - qi * G;
                        out[((int64_t)(row0 + qi) * H + kh * G + g) * D + d] =
                            static_cast<T>((srot[c][d] * signs[d % BLK]) / (float)BLK);
                    }
                }
                UNI_BARRIER();
            }
        }
    }
"""


def supported(head_dim: int) -> bool:
    """Head sizes the kernel takes: a multiple of 32 up to 256 (as the quantizing write,
    :func:`vllm_unified.kv.gpu.quant_write.supported`; no vector loads of D / 32 elements,
    so unlike the dense kernel 96, 160, 192 and 224 are taken too)."""
    return quant_write.supported(head_dim)


@functools.cache
def launch_shape(group: int, head_dim: int, rows: int, rotated: bool) -> tuple[int, int]:
    """``(WARPS, CB)`` for ``rows`` query rows x ``group`` heads of ``head_dim``: the dense
    kernel's warps (:func:`gpu_paged.warps_per_group`), halved while the shared memory
    (``WARPS x (2 QG + CB x D) x 4`` bytes with ``CB = 1``, plus the rotation buffer
    ``RQ x D x 4``, ``RQ = QG`` for int4, else 1) exceeds :data:`gpu_paged.SHARED_BYTES`; CB as
    many pairs as the rest holds, at least 1, at most ``QG``."""
    qg = rows * group
    floats = gpu_paged.SHARED_BYTES // 4 - rotation_rows(group, rows, rotated) * head_dim
    warps = gpu_paged.warps_per_group(group, head_dim, rows)
    while warps > 1 and warps * (2 * qg + head_dim) > floats:
        warps //= 2
    return warps, max(1, min(qg, (floats // warps - 2 * qg) // head_dim))


@functools.cache
def q_tile(group: int, head_dim: int, rotated: bool) -> int:
    """Query rows per prefill tile: the dense kernel's (:func:`gpu_paged.q_tile`), fewer
    while one warp's shared memory does not fit beside the int4 rotation buffer."""
    rows = gpu_paged.q_tile(group, head_dim)
    while rows > 1 and launch_shape(group, head_dim, rows, rotated)[0] * \
            (2 * rows * group + head_dim) > gpu_paged.SHARED_BYTES // 4 - \
            rotation_rows(group, rows, rotated) * head_dim:
        rows -= 1
    return rows


def rotation_rows(group: int, rows: int, rotated: bool) -> int:
    """RQ, the rows of the kernel's rotation buffer: every (row, head) pair of a tile for int4
    (its queries, then the output rows of a combine pass), else 1 (unused)."""
    return rows * group if rotated else 1


@functools.cache
def _kernel(dialect: str):
    return gpu_dialect.kernel(KERNEL_NAME, INPUT_NAMES, OUTPUT_NAMES, SOURCE, dialect=dialect,
                              header=HEADER)


@functools.cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


_UNUSED: list[mx.array] = []


def _no_signs() -> mx.array:
    if not _UNUSED:
        _UNUSED.append(mx.array([1.0], dtype=mx.float32))
    return _UNUSED[0]


def launch_args(
    queries: mx.array, kv_pool: mx.array, tables: mx.array, tiles: mx.array, scale: float,
    window: Window, block_size: int, rows: int, decode: bool, fmt: KVFormat,
    signs: mx.array | None, after: mx.array | None = None,
) -> LaunchArgs:
    """The kernel call over ``tiles`` (see :func:`launch`)."""
    tokens, heads, _, dim = queries.shape
    kv_heads = kv_pool.shape[1]
    group = heads // kv_heads
    warps, cb = launch_shape(group, dim, rows, fmt.rotated)
    block = rotation_block(dim) if fmt.rotated else 1
    return LaunchArgs(
        inputs=[queries, kv_pool, tables, tiles, _scale(scale / block),
                signs if fmt.rotated else _no_signs(),
                gpu_paged.no_write() if after is None else after],
        template=[("T", queries.dtype), ("P", kv_pool.dtype), ("MODE", fmt.native_mode),
                  ("BLK", block), ("RQ", rotation_rows(group, rows, fmt.rotated)), ("D", dim),
                  ("H", heads), ("HKV", kv_heads), ("BS", block_size), ("WARPS", warps),
                  ("WINDOW", 0 if window is None else int(window)), ("QT", rows),
                  ("CB", cb), ("DECODE", int(decode))],
        grid=(tiles.shape[0] * kv_heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(tokens, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )


def launch(
    dialect: str, queries: mx.array, kv_pool: mx.array, tables: mx.array, tiles: mx.array,
    scale: float, window: Window, block_size: int, rows: int, decode: bool, fmt: KVFormat,
    signs: mx.array | None, after: mx.array | None = None,
) -> mx.array:
    """One launch over ``tiles`` (as :func:`gpu_paged.launch`, over a quantized pool
    ``[slots, Hkv, cell bytes]`` of format ``fmt``; ``signs``: int4's RHT signs; ``after``:
    the write's completion token); returns ``[T, H, 1, D]`` where only the rows the tiles
    cover are written."""
    a = launch_args(queries, kv_pool, tables, tiles, scale, window, block_size, rows, decode,
                    fmt, signs, after)
    return _kernel(dialect)(inputs=a.inputs, template=a.template, grid=a.grid,
                            threadgroup=a.threadgroup, output_shapes=a.output_shapes,
                            output_dtypes=a.output_dtypes)[0]


def paged_gpu_attention_quant(
    dialect: str, queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: Window, fmt: KVFormat, signs: mx.array | None, max_chunk: int | None = None,
    fresh: tuple[mx.array, mx.array] | None = None, after: mx.array | None = None,
) -> mx.array:
    """Every row's attention over a quantized pool (``[slots, Hkv, fmt.cell_bytes(D)]``).

    Args:
        dialect: ``"cuda"`` or ``"metal"`` (the backend profile's ``gpu_attention``).
        queries: ``[T, H, 1, D]`` (RoPE'd), token-major, float32/float16/bfloat16.
        kv_pool: one layer's quantized pool, this step's keys and values already written.
        meta: the step's metadata (as :func:`gpu_paged.paged_gpu_attention`).
        scale, window: score multiplier, sliding window or None.
        fmt: the pool's quantized format; ``signs``: int4's RHT signs (fp32 ``[b]``).
        max_chunk: prefill chunks longer than this go to MLX's SDPA over their context
            gathered and dequantized; default :data:`gpu_paged.MAX_KERNEL_CHUNK`
            (``turboquant_k8v4``: at most :data:`~vllm_unified.kv.quant.TQ_SHORT_CONTINUATION`).
        fresh: ``turboquant_k8v4``: this step's keys and values of the layer (``[T, Hkv, 1,
            D]`` or ``[T, Hkv, D]``, unquantized), which prefill chunks read for their own
            tokens as vLLM's TurboQuant backend does: a chunk that starts its sequence goes to
            MLX's SDPA over them alone, one longer than ``TQ_SHORT_CONTINUATION`` over its
            context's cells followed by them. Ignored by the other formats (vLLM attends
            every key from their cells).
        after: the completion token of this evaluation's write into ``kv_pool``
            (:func:`vllm_unified.kv.gpu.write.ordered_after`), taken by every read of it here.

    Returns:
        ``[T, H, 1, D]`` in the queries' dtype and token order, lazily.

    Raises:
        ValueError: a head size the kernel does not take, int4 without signs, a step with
            prefill chunks whose metadata lacks the host-side fields, or ``turboquant_k8v4``
            without ``fresh`` where a chunk reads its own keys unquantized.
    """
    dim = queries.shape[-1]
    if not supported(dim):
        raise ValueError(f"the paged GPU kernel takes head sizes that are multiples of 32 up "
                         f"to 256, not {dim}")
    if fmt.rotated and signs is None:
        raise ValueError(f"{fmt.name}: the attention needs vLLM's RHT signs")
    if meta.is_pure_decode:
        tables, lens = meta.decode_tables_lens()
        return launch(dialect, queries, kv_pool, tables, lens, scale, window, meta.block_size,
                      1, True, fmt, signs, after)
    limit = gpu_paged.MAX_KERNEL_CHUNK if max_chunk is None else max_chunk
    if fmt.turboquant:  # chunks that read their own K/V unquantized never reach the kernel
        if fresh is None and meta.fresh_key_rows(TQ_SHORT_CONTINUATION) is not None:
            raise ValueError(f"{fmt.name}: prefill chunks that start their sequence or are "
                             f"longer than {TQ_SHORT_CONTINUATION} tokens attend the step's "
                             "unquantized keys and values (fresh), which were not given")
        limit = min(limit, TQ_SHORT_CONTINUATION)
    rows = q_tile(queries.shape[1] // kv_pool.shape[1], dim, fmt.rotated)
    plan = meta.gpu_plan(rows, fmt.turboquant, limit)
    out = None
    if plan.tiles is not None:
        out = launch(dialect, queries, kv_pool, plan.tables, plan.tiles, scale, window,
                     meta.block_size, rows, False, fmt, signs, after)
    if not plan.sdpa:
        return out
    pieces = []
    for start, stop, chunk in plan.segments:
        if chunk is None:
            pieces.append(out[start:stop])
        elif fmt.turboquant and meta.prefills[chunk].seq_len == stop - start:
            pieces.append(gpu_paged.fresh_chunk(queries[start:stop], fresh, start, stop,
                                                queries.dtype, meta.fresh_mask(chunk, window),
                                                scale))
        else:
            own = fmt.turboquant and stop - start > TQ_SHORT_CONTINUATION
            pieces.append(reference.quantized_chunk_attention(
                queries, kv_pool, meta, chunk, scale, window, fmt, fresh if own else None,
                after))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
