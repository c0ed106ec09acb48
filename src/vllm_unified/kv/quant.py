"""Quantized KV cache formats: vLLM's own ``--kv-cache-dtype`` per-token-head pages.

vLLM 0.32 defines the formats (``vllm/v1/kv_cache_interface.py`` ``KVQuantMode``,
``get_kv_quant_mode``; ``vllm/config/cache.py`` ``CacheDType``) and, for its Triton attention
backend, their page layout (``TritonAttentionBackend.customize_spec``,
``TritonAttentionImpl._ensure_scale_caches``). Each (slot, KV head) cell of a layer's page holds
``[K data | K scale (fp32) | V data | V scale (fp32)]``, in bytes:

* ``int8_per_token_head``: ``D`` int8 per side, scale ``max(|x|) / 127`` (at least 1e-6),
  ``q = clamp(round_half_away(x * (1 / scale)), -128, 127)``; storage dtype ``torch.int8``.
* ``fp8_per_token_head``: as int8 with float8 e4m3fn values: scale ``max(|x|) / 448``,
  ``q = fp8(clamp(x * (1 / scale), -448, 448))`` (round to nearest even); storage
  ``torch.uint8``. MLX has no fp8 dtype: the pages are bytes, which the native kernels encode
  and decode themselves.
* ``int4_per_token_head``: the side first rotated by vLLM's randomized Hadamard transform
  (``single_rht``: fixed +-1 signs, then the unnormalised Walsh-Hadamard butterfly, block-diagonal
  over the largest power-of-two divisor ``b`` of ``D``), then asymmetric 4-bit:
  ``scale = max((max - min) / 15, 1e-6)``, zero point ``zp = clamp(round_half_away(-min /
  scale), 0, 15)``, ``q = clamp(round_half_away(x * (1 / scale) + zp), 0, 15)``, two values per
  byte (even element in the low nibble), ``D / 2`` bytes per side; the zero point is stored in
  the scale's low 4 mantissa bits. Queries are rotated the same way, the softmax scale is
  divided by ``b`` and the output rotated back and divided by ``b``. Storage ``torch.uint8``.

vLLM's TurboQuant backend (``vllm/v1/attention/backends/turboquant_attn.py``,
``TurboQuantAttentionBackend.customize_spec``; the write ``triton_turboquant_store.py``
``_tq_fused_store_fp8``) packs a (slot, KV head) cell differently:

* ``turboquant_k8v4``: ``[K: D bytes float8 e4m3fn, no scale | V: D / 2 bytes of 4-bit values |
  V scale fp16 | V zero fp16]``, ``TurboQuantConfig.slot_size_aligned`` bytes (``3D/2 + 4``, even).
  Keys ``fp8(k)`` (round to nearest even, saturating at +-448 as GPUs convert); values
  ``s = (max - min) / 15`` (``1e-8`` where not above it), ``q = clamp(trunc((v - min) / s + 0.5),
  0, 15)``; ``s`` and ``min`` stored rounded to fp16, the dequantized value ``q * s + min``.
  vLLM keeps the first and last two attention layers of a dense model in the model dtype
  (``TurboQuantConfig.get_boundary_skip_layers``, added to ``--kv-cache-dtype-skip-layers``):
  those layers' pages are the model dtype's (:class:`KVFormat` ``auto``). As vLLM's backend
  does, a prefill chunk that starts its sequence, or is longer than
  :data:`TQ_SHORT_CONTINUATION` tokens, attends its own tokens' K/V unquantized (earlier
  tokens from the cells); decode rows and short chunks read every key from the cells.

So the pages are vLLM's bytes: its block accounting (``page_size_bytes``), prefix caching and
the offloading tiers carry them unchanged. The native CPU kernels write them
(``write_kv_quant``, in place) and attend over them directly (``paged_attention`` with
``kv_mode``), each cell dequantized in registers. :func:`dequantize_pool` is the pure-MLX
dequantization the reference attention reads in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vllm_unified import compat

#: ``--kv-cache-dtype`` values served, in the order the errors list them.
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8_per_token_head",
                                              "int4_per_token_head", "fp8_per_token_head",
                                              "turboquant_k8v4")

#: the native kernels' numbering of the formats (native/src/cpu_kvquant.h ``KVMode``)
_NATIVE_MODE = {"auto": 0, "int8_per_token_head": 1, "int4_per_token_head": 2,
                "fp8_per_token_head": 3, "turboquant_k8v4": 4}

#: Bytes of one fp32 scale per side of a cell.
_SCALE_BYTES = 4

#: vLLM's TurboQuant backend attends a prefill chunk after cached context through its cache
#: (like decode rows) up to this many tokens, longer ones over their own unquantized K/V
#: (``turboquant_attn.py`` ``_CONTINUATION_DECODE_THRESHOLD``; tests check it is vLLM's).
TQ_SHORT_CONTINUATION = 128


@dataclass(frozen=True)
class KVFormat:
    """How the attention pages hold K and V.

    Attributes:
        name: the ``--kv-cache-dtype`` value (``auto``: the model dtype, unquantized).
        native_mode: the native kernels' format number (0: dense).
    """

    name: str = "auto"
    native_mode: int = 0

    @property
    def quantized(self) -> bool:
        return self.native_mode != 0

    @property
    def rotated(self) -> bool:
        """Sides are Hadamard-rotated before quantization (int4)."""
        return self.name == "int4_per_token_head"

    @property
    def turboquant(self) -> bool:
        """A TurboQuant preset (vLLM's TurboQuant backend's cell; boundary layers skipped)."""
        return self.name.startswith("turboquant_")

    def data_bytes(self, head_size: int) -> int:
        """Bytes of one side's (K or V) data in a cell (per-token-head formats)."""
        return head_size // 2 if self.rotated else head_size

    def cell_bytes(self, head_size: int) -> int:
        """Bytes of one (slot, KV head) cell (quantized): both sides' data and scales; for
        TurboQuant vLLM's ``TurboQuantConfig.slot_size_aligned``."""
        if self.turboquant:
            return _turboquant_slot_bytes(self.name, head_size)
        return 2 * (self.data_bytes(head_size) + _SCALE_BYTES)

    def bytes_per_token_head(self, head_size: int, model_dtype_size: int) -> int:
        """Bytes one token takes per KV head and layer in this format."""
        if not self.quantized:
            return 2 * head_size * model_dtype_size
        return self.cell_bytes(head_size)


@lru_cache(maxsize=16)
def _turboquant_slot_bytes(name: str, head_size: int) -> int:
    return compat.TurboQuantConfig.from_cache_dtype(name, head_size).slot_size_aligned


def kv_format(cache_dtype: str | None, head_size: int | None = None) -> KVFormat:
    """The format of ``--kv-cache-dtype`` ``cache_dtype``.

    Raises:
        ValueError: a value this platform does not serve (naming the flag and the supported
            values; vLLM's per-tensor fp8 formats and TurboQuant presets other than
            ``turboquant_k8v4`` among them), or a head size the quantized kernels do not take
            (a multiple of 8 up to 512).
    """
    name = cache_dtype or "auto"
    if name not in _NATIVE_MODE:
        what = ("of vLLM's TurboQuant presets only turboquant_k8v4 is implemented (the "
                "Lloyd-Max key presets are not)" if name.startswith("turboquant_") else
                "per-tensor fp8, the TurboQuant presets other than turboquant_k8v4, NVFP4 "
                "and UltraQuant are not implemented")
        raise ValueError(f"--kv-cache-dtype {name}: not supported by vllm-unified ({what}); "
                         f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
    fmt = KVFormat(name, _NATIVE_MODE[name])
    if fmt.quantized and head_size is not None and (head_size % 8 or head_size > 512):
        raise ValueError(f"--kv-cache-dtype {name}: head size {head_size} is not supported "
                         "by the quantized KV kernels (a multiple of 8, at most 512)")
    return fmt


def storage_dtype(fmt: KVFormat) -> Any:
    """vLLM's torch dtype of the pages (``STR_DTYPE_TO_TORCH_DTYPE``) for a quantized format."""
    return compat.STR_DTYPE_TO_TORCH_DTYPE[fmt.name]


def quant_mode(fmt: KVFormat) -> Any:
    """vLLM's ``KVQuantMode`` of the format (``get_kv_quant_mode``)."""
    return compat.get_kv_quant_mode(fmt.name)


def rotation_block(head_size: int) -> int:
    """int4's rotation block ``b``: the largest power of two dividing ``head_size`` (vLLM's
    ``largest_power_of_2_divisor``)."""
    return head_size & -head_size


@lru_cache(maxsize=8)
def _signs_list(head_size: int) -> tuple[float, ...]:
    block = compat.largest_power_of_2_divisor(head_size)
    return tuple(float(s) for s in compat.get_rht_signs(block, 0, "cpu").tolist())


def rht_signs(head_size: int) -> Any:
    """vLLM's RHT signs for ``head_size`` (fp32 ``[b]``, ``b`` the largest power-of-two
    divisor of the head size; vLLM's ``_get_rht_signs(b, 0)``), as an MLX array."""
    import mlx.core as mx

    return mx.array(_signs_list(head_size), dtype=mx.float32)


def _e4m3_table() -> Any:
    """Every float8 e4m3fn byte's value, decoded by torch (``torch.float8_e4m3fn``)."""
    import mlx.core as mx
    import torch

    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return mx.array(table.numpy())


def _butterfly(x: Any) -> Any:
    """vLLM's ``fast_hadamard_transform`` CPU butterfly over the last axis (a power of two)."""
    import mlx.core as mx

    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*x.shape[:-1], d)
        h *= 2
    return x


def unrotate(x: Any, head_size: int) -> Any:
    """Undo vLLM's ``single_rht`` (``x`` fp32 ``[..., D]`` rotated): ``single_rht(x,
    inverse=True) / b``, pure MLX."""
    signs = rht_signs(head_size)
    block = signs.shape[0]
    lead = x.shape[:-1]
    y = _butterfly(x.reshape(*lead, head_size // block, block)) * signs
    return (y / block).reshape(*lead, head_size)


def dequantize_pool(pool: Any, fmt: KVFormat, head_size: int) -> Any:
    """A quantized layer pool ``[slots, Hkv, cell bytes]`` (int8/uint8) as fp32
    ``[slots, Hkv, 2 * D]`` K|V rows, pure MLX (the reference attention's input in tests;
    int4 rotated back to the model's basis). Materialises the whole pool: never on the serving
    path.

    Raises:
        ValueError: the pool's last axis is not the format's cell size.
    """
    import mlx.core as mx

    if pool.shape[-1] != fmt.cell_bytes(head_size):
        raise ValueError(f"pool cells of {pool.shape[-1]} bytes, expected "
                         f"{fmt.cell_bytes(head_size)} for {fmt.name} and head size "
                         f"{head_size}")
    u8 = pool.view(mx.uint8)
    if fmt.turboquant:
        return _dequantize_tq_k8v4(u8, head_size)
    dk = fmt.data_bytes(head_size)
    sides = []
    for side in range(2):
        base = side * (dk + _SCALE_BYTES)
        data = u8[..., base:base + dk]
        word = mx.contiguous(u8[..., base + dk:base + dk + _SCALE_BYTES]).view(mx.uint32)
        if fmt.rotated:
            lo, hi = data & 15, data >> 4
            nib = mx.stack([lo, hi], axis=-1).reshape(*data.shape[:-1], head_size)
            zp = (word & 15).astype(mx.float32)
            scale = (word & mx.array(0xFFFFFFF0, dtype=mx.uint32)).view(mx.float32)
            x = (nib.astype(mx.float32) - zp) * scale
            x = unrotate(x, head_size)
        elif fmt.name == "fp8_per_token_head":
            scale = word.view(mx.float32)
            x = _e4m3_table()[data.astype(mx.int32)] * scale
        else:
            scale = word.view(mx.float32)
            x = mx.contiguous(data).view(mx.int8).astype(mx.float32) * scale
        sides.append(x)
    return mx.concatenate(sides, axis=-1)


def f32_to_e4m3_reference(x: Any) -> Any:
    """float32 -> float8 e4m3fn bytes (numpy uint8, same shape), round to nearest even,
    subnormals below 2^-6, NaN (0x7f) beyond 448 and for NaN: the native ``f32_to_e4m3`` in
    integer arithmetic on the bits (numpy; the reference of the GPU write's encoding)."""
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint32)
    a = bits & np.uint32(0x7FFFFFFF)
    # normal range: round the 23-bit mantissa to 3 bits, ties to even
    r = a + np.uint32(0x7FFFF) + ((a >> 20) & 1)
    e = (r >> 23).astype(np.int64) - 120
    m = (r >> 20) & 7
    normal = (np.clip(e, 0, 15).astype(np.uint32) << 3) | m
    normal = np.where((e > 15) | ((e == 15) & (m == 7)), np.uint32(0x7F), normal)
    # below 2^-6: multiples of 2^-9, round to nearest even
    ex = (a >> 23).astype(np.int64)
    shift = np.clip(141 - ex, 1, 31).astype(np.uint32)
    mant = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    q = mant >> shift
    rest = mant & ((np.uint32(1) << shift) - 1)
    half = np.uint32(1) << (shift - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).astype(np.uint32)
    small = np.where((ex == 0) | (141 - ex > 24), np.uint32(0), q)
    out = np.where(a < 0x3C800000, small, normal)
    out = np.where(a > 0x7F800000, np.uint32(0x7F), out)
    return (sign | out).astype(np.uint8)


def round_to_dtype_reference(x: Any, dtype: str) -> Any:
    """float32 numpy values rounded to ``dtype`` (``float32``, ``float16``, ``bfloat16``; round
    to nearest even) and back to float32, numpy only."""
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype != "bfloat16":
        raise ValueError(f"unknown dtype {dtype!r}")
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16) << 16
    return np.where(np.isnan(x), x, r.astype(np.uint32).view(np.float32))


def quantize_cells_reference(keys: Any, values: Any, fmt: KVFormat, dtype: str,
                             signs: Any = None) -> Any:
    """The cells vLLM's quantizing write makes of ``keys``/``values`` (float32 numpy
    ``[T, Hkv, D]`` holding values of the model dtype ``dtype``), as numpy uint8
    ``[T, Hkv, cell bytes]``: the native write's arithmetic (cpu_kvquant.cpp) in numpy float32,
    each operation rounded on its own. ``signs``: int4's RHT signs (numpy fp32 ``[b]``).
    The expected bytes of the GPU write's checks; never on the serving path.

    Raises:
        ValueError: an unquantized format, or int4 without signs.
    """
    import numpy as np

    if not fmt.quantized:
        raise ValueError(f"{fmt.name}: not a quantized KV format")
    f32 = np.float32
    tokens, heads, dim = keys.shape
    if fmt.turboquant:
        return _tq_cells_reference(np.asarray(keys, f32), np.asarray(values, f32))
    sides = []
    for rows in (keys, values):
        x = np.asarray(rows, dtype=f32).reshape(tokens * heads, dim).copy()
        if fmt.rotated:
            if signs is None:
                raise ValueError(f"{fmt.name} needs the RHT signs")
            block = len(signs)
            x = (x.reshape(-1, dim // block, block) * np.asarray(signs, f32)).reshape(-1, dim)
            h = 1
            while h < block:  # vLLM's CPU butterfly, stage by stage
                v = x.reshape(-1, dim // (2 * h), 2, h)
                a, b = v[:, :, 0, :].copy(), v[:, :, 1, :].copy()
                v[:, :, 0, :], v[:, :, 1, :] = a + b, a - b
                h *= 2
            x = round_to_dtype_reference(x, dtype)
            lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
            scale = np.maximum((hi - lo) / f32(15), f32(1e-6))
            zp = np.clip(_round_half_away(-lo / scale), f32(0), f32(15))
            inv = f32(1) / scale
            q = np.clip(_round_half_away((x * inv) + zp), f32(0), f32(15)).astype(np.uint8)
            data = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)
            word = (scale.view(np.uint32) & np.uint32(0xFFFFFFF0)) | zp.astype(np.uint32)
        else:
            amax = np.abs(x).max(axis=1, keepdims=True)
            scale = np.maximum(amax / f32(127 if fmt.native_mode == 1 else 448), f32(1e-6))
            inv = f32(1) / scale
            q = x * inv
            if fmt.native_mode == 1:
                q = np.where(q >= 0, q + f32(0.5), q - f32(0.5))
                data = np.clip(q, f32(-128), f32(127)).astype(np.int8).view(np.uint8)
            else:
                data = f32_to_e4m3_reference(np.clip(q, f32(-448), f32(448)))
            word = scale.view(np.uint32)
        sides += [data.astype(np.uint8), word.astype("<u4").view(np.uint8)]
    return np.concatenate(sides, axis=1).reshape(tokens, heads, -1)


def _tq_cells_reference(keys: Any, values: Any) -> Any:
    """``turboquant_k8v4`` cells of float32 ``[T, Hkv, D]`` keys and values (numpy uint8
    ``[T, Hkv, 3D/2 + 4]``): the native ``quantize_tq_k8v4`` in numpy float32 (keys fp8 of the
    key clamped to +-448; values ``q = clamp(trunc((v - min) / s + 0.5), 0, 15)`` with
    ``s = (max - min) / 15`` floored at 1e-8, a NaN to 0, min and max skipping NaNs; then
    ``s`` and ``min`` as fp16, round to nearest even). A row whose minimum is a zero met with
    both signs may store either zero's sign (the native loop keeps the first it meets; the
    dequantized values are the same)."""
    import numpy as np

    f32 = np.float32
    kbytes = f32_to_e4m3_reference(np.clip(keys, f32(-448), f32(448)))
    # NaNs skipped, from +-inf (the native loop's std::min / std::max)
    lo = np.fmin.reduce(values, axis=-1, keepdims=True, initial=np.inf).astype(f32)
    hi = np.fmax.reduce(values, axis=-1, keepdims=True, initial=-np.inf).astype(f32)
    s = (hi - lo) / f32(15)
    s = np.where(s > f32(1e-8), s, f32(1e-8)).astype(f32)
    with np.errstate(invalid="ignore"):
        q = ((values - lo) / s + f32(0.5)).astype(f32)
    q = np.nan_to_num(np.clip(q, f32(0), f32(15)), nan=0.0).astype(np.uint8)  # truncates
    data = (q[..., 0::2] & 15) | ((q[..., 1::2] & 15) << 4)
    halves = np.concatenate([s, lo], axis=-1).astype("<f2").view(np.uint8)
    return np.concatenate([kbytes, data.astype(np.uint8), halves], axis=-1)


def _round_half_away(x: Any) -> Any:
    """Triton's ``where(x >= 0, (x + 0.5).to(int32), (x - 0.5).to(int32))``, float32 numpy."""
    import numpy as np

    f32 = np.float32
    return np.where(x >= 0, np.trunc(x + f32(0.5)), np.trunc(x - f32(0.5))).astype(f32)


def _dequantize_tq_k8v4(u8: Any, head_size: int) -> Any:
    """``turboquant_k8v4`` cells (uint8 ``[..., cell bytes]``) as fp32 ``[..., 2 * D]`` K|V:
    keys the fp8 values, values ``q * scale + zero`` (both fp16 in the cell), as vLLM's
    ``_tq_decode_stage1`` reads them."""
    import mlx.core as mx

    d = head_size
    keys = _e4m3_table()[u8[..., :d].astype(mx.int32)]
    data = u8[..., d:d + d // 2]
    nib = mx.stack([data & 15, data >> 4], axis=-1).reshape(*data.shape[:-1], d)
    halves = mx.contiguous(u8[..., d + d // 2:d + d // 2 + 4]).view(mx.float16)
    scale = halves[..., :1].astype(mx.float32)
    zero = halves[..., 1:2].astype(mx.float32)
    values = nib.astype(mx.float32) * scale + zero
    return mx.concatenate([keys, values], axis=-1)


def tokens_per_gib(fmts: Sequence[KVFormat], num_kv_heads: int, head_size: int,
                   model_dtype_size: int) -> float:
    """KV tokens one GiB holds over the attention layers, layer ``l`` in format ``fmts[l]``
    (the layers of ``--kv-cache-dtype-skip-layers`` in ``auto``, the model dtype)."""
    per_token = sum(num_kv_heads * f.bytes_per_token_head(head_size, model_dtype_size)
                    for f in fmts)
    return 2**30 / per_token


def attention_spec(fmt: KVFormat, *, block_size: int, num_kv_heads: int, head_size: int,
                   dtype: Any, sliding_window: int | None = None,
                   attention_chunk_size: int | None = None) -> Any:
    """vLLM's ``FullAttentionSpec`` of one attention layer in this format: the model dtype
    ``dtype`` unquantized, else vLLM's storage dtype, ``kv_quant_mode`` and packed cell size
    (``state_content_bytes``, what ``TritonAttentionBackend.customize_spec`` sets:
    ``(data_k + data_v) + 2 * 4`` bytes; for TurboQuant what
    ``TurboQuantAttentionBackend.customize_spec`` sets, ``slot_size_aligned``), so
    ``page_size_bytes`` is vLLM's. ``attention_chunk_size``: a chunked local attention layer's
    chunk, recorded as vLLM records it where it keeps such layers in the full-attention group."""
    if not fmt.quantized:
        return compat.FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                                        head_size=head_size, dtype=dtype,
                                        sliding_window=sliding_window,
                                        attention_chunk_size=attention_chunk_size)
    return compat.FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
        dtype=storage_dtype(fmt), sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size, kv_quant_mode=quant_mode(fmt),
        state_content_bytes=fmt.cell_bytes(head_size))
