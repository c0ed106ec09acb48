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
HEADER = gpu_dialect.kernel_file(__package__, "quant_write.h")

#: The body. Template arguments: P (pool dtype, int8/uint8), T (keys' dtype), MODE (1 int8,
#: 2 int4, 3 fp8, 4 turboquant_k8v4: KVFormat.native_mode), D (head size, a multiple of 32),
#: BLK (int4's rotation block, else 1). Thread ``32 * item + lane`` serves item
#: ``(t * Hkv + h) * 2 + side``.
SOURCE = gpu_dialect.kernel_file(__package__, "quant_write.inc")

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
