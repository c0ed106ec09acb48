"""The quantizing KV write on MLX's GPU backends (CUDA and Metal): vLLM's page bytes, in place.

The GPU counterpart of the native ``write_kv_quant`` (native/src/cpu_kvquant.cpp): each
(token, KV head) side of the new keys and values is quantized with vLLM's arithmetic into its
cell of a quantized pool (``[slots, Hkv, cell bytes]``, :mod:`vllm_unified.kv.quant`), written
into the pool's own buffer through the writable-input cast and ordered by ``mx.depends``, as
:mod:`vllm_unified.kv.gpu.write` does for the model-dtype pool. One body for both dialects
(:mod:`vllm_unified.gpu_dialect`).

**Work split.** One SIMD group (warp) per (token, head, side): lane ``l`` holds elements
``i * 32 + l`` (``i < D / 32``; consecutive lanes read consecutive elements). int4 first applies
vLLM's ``single_rht``: the +-1 signs, then the butterfly stages ``h = 1, 2, ... b / 2`` over
blocks of ``b`` (the largest power of two dividing ``D``), stage ``h < 32`` by a lane shuffle,
``h >= 32`` within the lane; every element's sum or difference takes the same two operands as
the CPU loop, so the result is the same float. The side's max |x| (int8, fp8) or min and max
(int4) are SIMD-group reductions (exact in any order); every lane then computes the scale, its
reciprocal and the zero point itself.

**Exactly the CPU's (and vLLM's) bytes.** Every operation is the native kernel's, each rounded
on its own: ``scale = max(amax / 127, 1e-6)`` (fp8: ``/ 448``; int4: ``(max - min) / 15``),
``inv = 1 / scale`` (IEEE division: NVRTC's default ``-prec-div=true``, MLX's Metal library
without fast math), the product ``x * inv`` and the sum after it through ``uni_mul_rn`` /
``uni_add_rn`` (never fused into an FMA), Triton's round half away from zero (``(int)(q +
0.5)`` / ``(int)(q - 0.5)``), the clamps written as the ternaries ``std::min`` / ``std::max``
are, the int4 zero point in the scale's low 4 mantissa bits, and fp8 e4m3fn bytes from
integer arithmetic on the float's bits (round to nearest even, subnormals below 2^-6, no
infinity). ``tests/test_gpu_kv_quant.py`` compares the Metal instance, emulated, with the native
write byte for byte; ``benchmarks/cuda.py decode`` the CUDA instance with
:func:`vllm_unified.kv.quant.quantize_cells_reference` on the H200.

Slots outside ``[0, slots)`` (vLLM's padding slot -1) are skipped: the native write skips
negative slots and raises for slots past the end; a kernel cannot raise.
"""

from __future__ import annotations

import mlx.core as mx

from vllm_unified import gpu_dialect
from vllm_unified.gpu_dialect import Dialect
from vllm_unified.kv.gpu.write import ordered_after
from vllm_unified.kv.quant import KVFormat, rotation_block

#: kernel name, input names, output names
KERNEL = ("vllm_unified_write_kv_quant", ("pool", "slots", "keys", "values", "signs"),
          ("done",))

#: helpers of both quantized-KV kernels: vLLM's rounding and the float8 e4m3fn encoding
HEADER = """
// Triton's where(x >= 0, (x + 0.5).to(int32), (x - 0.5).to(int32)): half away from zero
UNI_FUNC float uni_kvq_round(float x) {
    return x >= 0.0f ? (float)(int)uni_add_rn(x, 0.5f) : (float)(int)uni_add_rn(x, -0.5f);
}
// |x| (bits a, below the format's smallest normal) as a whole number of the format's
// subnormal step 2^(top - 150): the significand >> (top - exponent), round to nearest even;
// 0 where it is below half a step (float subnormals included). fp8 e4m3fn: top 141 (2^-9),
// fp16: top 126 (2^-24).
UNI_FUNC unsigned int uni_kvq_steps(unsigned int a, unsigned int top) {
    const unsigned int e = a >> 23;
    const unsigned int shift = top - e;
    if (e == 0u || shift > 24u) {
        return 0u;
    }
    const unsigned int m = (a & 0x7fffffu) | 0x800000u;
    unsigned int q = m >> shift;
    const unsigned int rest = m & ((1u << shift) - 1u);
    const unsigned int halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (q & 1u) != 0u)) {
        q += 1u;
    }
    return q;
}
// float -> float8 e4m3fn byte, round to nearest even (native f32_to_e4m3, in integers)
UNI_FUNC unsigned int uni_kvq_e4m3(float x) {
    const unsigned int bits = uni_as_uint(x);
    const unsigned int sign = (bits >> 24) & 0x80u;
    const unsigned int a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7fu;  // NaN
    }
    if (a < 0x3c800000u) {  // below 2^-6: multiples of 2^-9 (8 of them are the first normal)
        return sign | uni_kvq_steps(a, 141u);
    }
    const unsigned int r = a + 0x7ffffu + ((a >> 20) & 1u);  // 3 mantissa bits, ties to even
    const int e = (int)(r >> 23) - 120;
    const unsigned int m = (r >> 20) & 7u;
    if (e > 15 || (e == 15 && m == 7u)) {
        return sign | 0x7fu;  // beyond 448: e4m3fn has no infinity
    }
    return sign | ((unsigned int)e << 3) | m;
}
// float -> float16 bits, round to nearest even (native f32_to_f16, in integers)
UNI_FUNC unsigned int uni_kvq_f16(float x) {
    const unsigned int bits = uni_as_uint(x);
    const unsigned int sign = (bits >> 16) & 0x8000u;
    const unsigned int a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u;  // NaN
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;  // from 65520 up: infinity
    }
    if (a < 0x38800000u) {  // below 2^-14: multiples of 2^-24
        return sign | uni_kvq_steps(a, 126u);
    }
    const unsigned int r = a + 0xfffu + ((a >> 13) & 1u);  // 10 mantissa bits, ties to even
    return sign | ((r - (112u << 23)) >> 13);
}
"""

#: The body. Template arguments: P (pool dtype, int8/uint8), T (keys' dtype), MODE (1 int8,
#: 2 int4, 3 fp8, 4 turboquant_k8v4: KVFormat.native_mode), D (head size, a multiple of 32),
#: BLK (int4's rotation block, else 1). Thread ``32 * item + lane`` serves item
#: ``(t * Hkv + h) * 2 + side``.
SOURCE = """
    constexpr int EPL = D / 32;
    constexpr int DK = MODE == 2 ? D / 2 : D;
    constexpr int CELL = MODE == 4 ? D + D / 2 + 4 : 2 * (DK + 4);
    const int lane = (int)uni_lane;
    const int64_t hkv = (int64_t)pool_shape[1];
    const int64_t item = (int64_t)(uni_global / 32);
    if (uni_global == 0) {
        done[0] = 1;
    }
    // uniform over the SIMD group (one item per group): the shuffles below see every lane
    if (item < (int64_t)keys_shape[0] * hkv * 2) {
        const int64_t cell = item >> 1;  // t * Hkv + h
        const int side = (int)(item & 1);
        const int64_t t = cell / hkv;
        const int64_t h = cell - t * hkv;
        const int64_t slot = (int64_t)slots[t];
        if (slot >= 0 && slot < (int64_t)pool_shape[0]) {
            const UNI_DEVICE T* src = side == 0 ? keys : values;
            float x[EPL];
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                x[i] = static_cast<float>(src[cell * D + i * 32 + lane]);
            }
            if (MODE == 2) {
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    x[i] = x[i] * signs[(i * 32 + lane) % BLK];
                }
                for (int hh = 1; hh < BLK; hh <<= 1) {
                    if (hh < 32) {
#pragma unroll
                        for (int i = 0; i < EPL; ++i) {
                            const float o = uni_shfl_xor(x[i], hh);
                            x[i] = (lane & hh) != 0 ? o - x[i] : x[i] + o;
                        }
                    } else {
                        const int s = hh / 32;
                        float y[EPL];
#pragma unroll
                        for (int i = 0; i < EPL; ++i) {
                            const float o = x[i ^ s];
                            y[i] = (i & s) != 0 ? o - x[i] : x[i] + o;
                        }
#pragma unroll
                        for (int i = 0; i < EPL; ++i) {
                            x[i] = y[i];
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    x[i] = static_cast<float>(static_cast<T>(x[i]));  // vLLM rounds to T
                }
            }
            UNI_DEVICE uint8_t* dst = reinterpret_cast<UNI_DEVICE uint8_t*>(UNI_WRITABLE(P, pool))
                + (slot * hkv + h) * CELL + side * (MODE == 4 ? D : DK + 4);
            uint32_t word = 0u;
            // the row's [min, max] for the 4-bit sides (int4; turboquant's values), from +-inf
            // as the native loops: a NaN never becomes the min or the max. Uniform over the
            // SIMD group (MODE and side are), so the reductions see every lane.
            float lo = uni_as_float(0x7f800000u);
            float hi = -lo;
            if (MODE == 2 || (MODE == 4 && side == 1)) {
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    lo = x[i] < lo ? x[i] : lo;
                    hi = hi < x[i] ? x[i] : hi;
                }
                lo = -uni_simd_max(-lo);
                hi = uni_simd_max(hi);
            }
            if (MODE == 4 && side == 0) {
                // turboquant_k8v4's keys: fp8 of the key itself, saturated, no scale
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    float k = x[i] < -448.0f ? -448.0f : x[i];
                    k = 448.0f < k ? 448.0f : k;
                    dst[i * 32 + lane] = (uint8_t)uni_kvq_e4m3(k);
                }
            } else if (MODE == 4) {
                // its values: 16 levels over the row's [min, max]; scale and min as fp16
                const float s0 = (hi - lo) / 15.0f;
                const float scale = s0 > 1e-8f ? s0 : 1e-8f;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    float q = uni_add_rn((x[i] - lo) / scale, 0.5f);
                    q = q > 0.0f ? q : 0.0f;  // a NaN to 0, as the native fmax
                    q = q < 15.0f ? q : 15.0f;
                    const float next = uni_shfl_xor(q, 1);  // element i * 32 + lane + 1
                    if ((lane & 1) == 0) {
                        dst[i * 16 + lane / 2] = (uint8_t)((uint32_t)q | ((uint32_t)next << 4));
                    }
                }
                word = uni_kvq_f16(scale) | (uni_kvq_f16(lo) << 16);
                if (lane < 4) {  // fp16 scale, then fp16 min, little-endian
                    dst[D / 2 + lane] = (uint8_t)((word >> (8 * lane)) & 0xffu);
                }
            } else if (MODE == 2) {
                const float s0 = (hi - lo) / 15.0f;
                const float scale = s0 < 1e-6f ? 1e-6f : s0;
                float zp = uni_kvq_round(-lo / scale);
                zp = zp < 0.0f ? 0.0f : zp;
                zp = 15.0f < zp ? 15.0f : zp;
                const float inv = 1.0f / scale;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    float q = uni_kvq_round(uni_add_rn(uni_mul_rn(x[i], inv), zp));
                    q = q < 0.0f ? 0.0f : q;
                    q = 15.0f < q ? 15.0f : q;
                    const float next = uni_shfl_xor(q, 1);  // element i * 32 + lane + 1
                    if ((lane & 1) == 0) {
                        dst[i * 16 + lane / 2] = (uint8_t)((uint32_t)q | ((uint32_t)next << 4));
                    }
                }
                word = (uni_as_uint(scale) & 0xfffffff0u) | (uint32_t)zp;
            } else {
                float amax = 0.0f;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    const float ax = x[i] < 0.0f ? -x[i] : x[i];
                    amax = amax < ax ? ax : amax;
                }
                amax = uni_simd_max(amax);
                const float s0 = amax / (MODE == 1 ? 127.0f : 448.0f);
                const float scale = s0 < 1e-6f ? 1e-6f : s0;
                const float inv = 1.0f / scale;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    uint32_t b;
                    if (MODE == 1) {
                        float q = uni_mul_rn(x[i], inv);
                        q = q >= 0.0f ? uni_add_rn(q, 0.5f) : uni_add_rn(q, -0.5f);
                        q = q < -128.0f ? -128.0f : q;
                        q = 127.0f < q ? 127.0f : q;
                        b = (uint32_t)(int)q & 0xffu;  // truncates, as Triton's store
                    } else {
                        float q = x[i] * inv;
                        q = q < -448.0f ? -448.0f : q;
                        q = 448.0f < q ? 448.0f : q;
                        b = uni_kvq_e4m3(q);
                    }
                    dst[i * 32 + lane] = (uint8_t)b;
                }
                word = uni_as_uint(scale);
            }
            if (MODE != 4 && lane < 4) {  // the fp32 scale word, little-endian, byte by byte
                dst[DK + lane] = (uint8_t)((word >> (8 * lane)) & 0xffu);
            }
        }
    }
"""

_GROUP = 256  # threads per group: 8 SIMD groups, 8 items
_MAX_GRID = 2**31 - 1


def supported(head_size: int) -> bool:
    """Head sizes the GPU quantizing write (and the quantized paged attention) take: a
    multiple of 32 up to 256 (each lane holds D / 32 elements, read element by element: any
    count works, unlike the dense kernel's vector loads)."""
    return head_size % 32 == 0 and 0 < head_size <= 256


def launch_args(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array,
                fmt: KVFormat, signs: mx.array | None) -> dict:
    """The keyword arguments of the kernel's call (shared by :func:`write_kv_quant_gpu`, the
    Metal emulation tests and the H200 check): ``inputs``, ``template``, ``grid``,
    ``threadgroup``, ``output_shapes``, ``output_dtypes``. ``keys``/``values``: ``[T, Hkv, D]``
    or ``[T, Hkv, 1, D]``. No checks."""
    dim = keys.shape[-1]
    threads = keys.shape[0] * pool.shape[1] * 2 * 32
    if signs is None:
        signs = _unused_signs()
    return dict(
        inputs=[pool, slots if slots.dtype == mx.int32 else slots.astype(mx.int32), keys,
                values, signs],
        template=[("P", pool.dtype), ("T", keys.dtype), ("MODE", fmt.native_mode), ("D", dim),
                  ("BLK", rotation_block(dim) if fmt.rotated else 1)],
        grid=(threads, 1, 1),
        threadgroup=(min(_GROUP, threads), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )


_UNUSED: list[mx.array] = []


def _unused_signs() -> mx.array:
    """The signs input of the formats that do not rotate (read by no thread), made once."""
    if not _UNUSED:
        _UNUSED.append(mx.array([1.0], dtype=mx.float32))
    return _UNUSED[0]


def write_kv_quant_gpu(pool: mx.array, slots: mx.array, keys: mx.array, values: mx.array,
                       fmt: KVFormat, signs: mx.array | None, *, dialect: Dialect,
                       tokens: list[mx.array] | None = None) -> mx.array:
    """Quantize ``keys``/``values`` into their cells at ``slots`` of ``pool``'s own buffer
    (lazily, in place): the bytes of the native ``write_kv_quant`` (vLLM's page bytes).

    Args:
        pool: ``[num_slots, Hkv, fmt.cell_bytes(D)]`` int8/uint8, row-contiguous (MLX-owned,
            or on Metal adopted torch memory), at least 8 bytes on Metal.
        slots: ``[T]`` integer slots (cast to int32 when another type); slots outside
            ``[0, num_slots)`` are skipped. Distinct slots (which of two writes to one slot
            lands is unspecified).
        keys, values: ``[T, Hkv, D]`` or ``[T, Hkv, 1, D]``, float32/float16/bfloat16, one
            dtype (int4 rounds the rotated rows to it, as vLLM does).
        fmt: a quantized format.
        signs: int4: vLLM's RHT signs (fp32 ``[b]``, :func:`vllm_unified.kv.quant.rht_signs`);
            ignored otherwise.
        dialect: ``"cuda"`` or ``"metal"``, the backend the kernel runs on.
        tokens: receives the write's completion token
            (:func:`vllm_unified.kv.gpu.write.ordered_after`).

    Returns:
        The pool to use from now on: the same buffer, ordered after the write
        (``mx.depends(pool, token)``); ``pool`` itself when ``T == 0``.

    Raises:
        ValueError: an unquantized format, shapes or dtypes that do not fit, a head size the
            kernel does not take, int4 without signs of the rotation block, unknown dialect,
            a Metal pool under 8 bytes, or a grid over 2**31 - 1 threads.
    """
    if not fmt.quantized:
        raise ValueError(f"{fmt.name}: not a quantized KV format")
    if dialect not in gpu_dialect.DIALECTS:
        raise ValueError(f"unknown GPU dialect {dialect!r} (expected one of "
                         f"{gpu_dialect.DIALECTS})")
    dim = keys.shape[-1]
    # [T, Hkv, D] and [T, Hkv, 1, D] are the same bytes: the kernel reads either as it is
    if (keys.ndim not in (3, 4) or (keys.ndim == 4 and keys.shape[2] != 1)
            or values.shape != keys.shape or pool.ndim != 3
            or pool.shape[1] != keys.shape[1] or pool.shape[2] != fmt.cell_bytes(dim)):
        raise ValueError(f"keys {keys.shape} / values {values.shape} do not fit a {fmt.name} "
                         f"pool {pool.shape}")
    if pool.dtype not in (mx.uint8, mx.int8):
        raise ValueError(f"a {fmt.name} pool holds int8/uint8 bytes, not {pool.dtype}")
    if keys.dtype != values.dtype or keys.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"keys {keys.dtype} / values {values.dtype}: one of float32, float16, "
                         "bfloat16")
    if not supported(dim):
        raise ValueError(f"--kv-cache-dtype {fmt.name}: the GPU kernels take head sizes that "
                         f"are multiples of 32 up to 256, not {dim}")
    if slots.shape != (keys.shape[0],):
        raise ValueError(f"slots shape {slots.shape} != ({keys.shape[0]},)")
    if fmt.rotated and (signs is None or signs.shape != (rotation_block(dim),)):
        raise ValueError(f"{fmt.name} needs vLLM's RHT signs [{rotation_block(dim)}]")
    if dialect == "metal" and pool.size < 8:
        raise ValueError(f"destination of {pool.size} elements: Metal passes inputs under 8 "
                         "elements in the constant address space, which cannot be written")
    if keys.shape[0] * pool.shape[1] * 64 > _MAX_GRID:
        raise ValueError(f"write of {keys.shape[0]} tokens exceeds one kernel's grid")
    if keys.shape[0] == 0:
        return pool
    done = gpu_dialect.kernel(*KERNEL, SOURCE, dialect=dialect, header=HEADER)(
        **launch_args(pool, slots, keys, values, fmt, signs))[0]
    return ordered_after(pool, done, tokens)
