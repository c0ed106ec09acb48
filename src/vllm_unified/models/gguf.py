"""Reading GGUF files for the MLX loader.

Three jobs, kept apart from the model-building code in :mod:`vllm_unified.models.loader`:

* an index of the file (tensor names, GGML types, shapes, offsets) from a small header parser:
  ``gguf.GGUFReader`` is slow on large vocabularies (seconds per file) because it turns every
  vocabulary string into a numpy view, and MLX's reader does not report tensor types at all;
* tensor decoding. MLX's own reader (``mx.load``) is fast and returns Q4_0 / Q4_1 / Q8_0 as
  MLX affine triples, but in MLX 0.32.4 it decodes Q4_K wrongly (every second 32-value sub-block
  is off), refuses the whole file on Q5_0 / Q5_1, and narrows BF16 to float16. So ``mx.load`` is
  used only when every tensor has a type it handles exactly; otherwise each tensor is decoded
  from the memory-mapped file here: Q4_0 / Q4_1 / Q8_0 / Q4_K are repacked bit-exactly into MLX
  affine triples, Q5_* / IQ4_NL / IQ4_XS (and Q6_K / Q3_K / Q2_K where the native CPU kernels
  run the model) re-coded from the ``gguf`` package's reference values into exact triples,
  MXFP4 re-laid into MLX's ``mxfp4`` mode (same e2m1 codes and e8m0 scales), everything else
  dequantized with that reference code. Mixture-of-experts files stack each expert projection
  in one 3-D tensor ``[experts, rows, cols]``; it is re-laid expert by expert into the same
  layouts, 3-D, as mlx-lm's ``QuantizedSwitchLinear`` holds them;
* GGUF -> Hugging Face tensor names for the supported families, and undoing llama.cpp's
  Q/K row permutation for Llama.

A quantized tensor is returned as :class:`QuantizedTensor` (MLX affine, 2-8 bits, groups of 32
or 16, or MXFP4); a plain one as an ``mx.array``.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "GGUFIndex",
    "GGUFTensorInfo",
    "QuantizedTensor",
    "describe_weights",
    "gguf_to_hf_name",
    "read_gguf_index",
    "read_gguf_tensors",
    "split_fused_experts",
    "unpermute_rows",
]

# GGML type ids (ggml.h); only the ones this module treats specially are named.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16 = (
    0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30)
MXFP4 = 39
_TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
               Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K",
               Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS", BF16: "BF16", MXFP4: "MXFP4"}

# Types MLX 0.32.4's reader decodes exactly (checked against the gguf package's reference).
MLX_EXACT_TYPES = frozenset({F32, F16, Q4_0, Q4_1, Q8_0})
#: Types re-coded from the gguf reference's values (:func:`_requantize`) -> (bits, group size)
#: of the MLX affine triple: their own width where the values are evenly spaced per group
#: (Q5_*: 5 bits; Q6_K: 6, Q3_K: 3, Q2_K: 2 bits in groups of 16), 8 bits for IQ4_NL / IQ4_XS
#: (16 levels that are not evenly spaced, spanning -127..113).
REQUANTIZED = {Q5_0: (5, 32), Q5_1: (5, 32), Q5_K: (5, 32), IQ4_NL: (8, 32), IQ4_XS: (8, 32),
               Q6_K: (6, 16), Q3_K: (3, 16), Q2_K: (2, 16)}
# Types with 16-value sub-blocks, held as affine groups of 16 only when the reader is told the
# native CPU kernels will run them (``group16``): MLX's own quantized ops refuse groups of 16,
# so such a layer exists only where the native kernels take every call (linear layers and
# embeddings on the CPU backend: models/cpu_kernels.py). Elsewhere they are dequantized.
GROUP16_TYPES = frozenset({Q6_K, Q3_K, Q2_K})
# Types this module repacks into MLX affine triples at groups MLX's ops take (bit-exact).
REPACKABLE_TYPES = frozenset({Q4_0, Q4_1, Q8_0, Q4_K}) | (frozenset(REQUANTIZED)
                                                          - GROUP16_TYPES)
GROUP_SIZE = 32
#: MXFP4's e8m0 scale byte that MLX decodes as infinity (2**128) where ggml's reference gives
#: 2**127 (the MX spec makes it NaN); a block with it is refused
_E8M0_UNREPRESENTABLE = 255
#: the group sizes MLX's own quantized ops take
MLX_GROUP_SIZES = (32, 64, 128)

_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the GGUF index.

    ``shape`` is in numpy/MLX order (rows first), i.e. GGML's ``ne`` reversed; ``offset`` is
    absolute in the file; ``nbytes`` is the size of the stored (possibly quantized) data.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """Human-readable GGML type name, e.g. ``"Q4_K"``."""
        return _type_name(self.ggml_type)


@dataclass(frozen=True)
class GGUFIndex:
    """Scalar metadata (arrays such as the vocabulary are skipped) and tensor entries."""

    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @property
    def architecture(self) -> str:
        """``general.architecture``, e.g. ``"llama"``; ValueError if absent."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError("GGUF file has no general.architecture")
        return arch


@dataclass
class QuantizedTensor:
    """An MLX-quantized matrix, or a stack of expert matrices: ``mx.dequantize(weight,
    scales, biases, group_size, bits, mode)``.

    ``mode="affine"`` (groups of 16 only for the native CPU kernels: MLX's ops refuse them):
    weight uint32 ``[..., rows, cols * bits / 32]`` (bits 2, 3, 4, 5, 6 or 8); scales, biases
    float ``[..., rows, cols / group_size]``. ``mode="mxfp4"``: 4-bit e2m1 codes, scales uint8
    e8m0 per 32 values, biases None. A leading ``[experts]`` axis where the GGUF stacks
    experts (``QuantizedSwitchLinear``'s layout). ``source_type`` names the GGML type it came
    from (for logs and errors).
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    bits: int
    source_type: str
    group_size: int = GROUP_SIZE
    mode: str = "affine"

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape ``(rows, cols)`` or ``(experts, rows, cols)``."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def dequantize(self, dtype: mx.Dtype) -> mx.array:
        """Dense array of :attr:`shape` in ``dtype``; computed in float32, so the only rounding
        is the final cast."""
        if self.mode != "affine":
            return mx.dequantize(self.weight, self.scales, None, self.group_size, self.bits,
                                 mode=self.mode, dtype=mx.float32).astype(dtype)
        assert self.biases is not None  # affine triples always have them
        scales, biases = self.scales.astype(mx.float32), self.biases.astype(mx.float32)
        if self.group_size in MLX_GROUP_SIZES:
            w = mx.dequantize(self.weight, scales, biases, self.group_size, self.bits)
        else:  # groups of 16 (Q6_K/Q3_K/Q2_K): MLX's dequantize refuses them; same rounding
            shape = self.shape
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            words = np.array(self.weight).reshape(rows, -1)
            codes = mx.array(_unpack_bits(words, self.bits, cols))
            codes = codes.astype(mx.float32).reshape(*shape[:-1], -1, self.group_size)
            w = (codes * scales[..., None] + biases[..., None]).reshape(shape)
        return w.astype(dtype)

    def map_rows(self, fn: Callable[[mx.array], mx.array]) -> QuantizedTensor:
        """Apply the same row operation (e.g. a permutation) to weight, scales and biases."""
        biases = None if self.biases is None else fn(self.biases)
        return QuantizedTensor(fn(self.weight), fn(self.scales), biases, self.bits,
                               self.source_type, self.group_size, self.mode)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and (affine) biases."""
        return self.weight.nbytes + self.scales.nbytes + (
            0 if self.biases is None else self.biases.nbytes)


def _type_name(ggml_type: int) -> str:
    if ggml_type in _TYPE_NAMES:
        return _TYPE_NAMES[ggml_type]
    try:
        import gguf

        return gguf.GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type{ggml_type}"


def _block_geometry(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type; ValueError if unknown."""
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as e:
        raise ValueError(f"unknown GGML tensor type id {ggml_type}") from e


# ----------------------------------------------------------------------------- index


def read_gguf_index(path: str | Path) -> GGUFIndex:
    """Parse a GGUF v2/v3 header: scalar metadata and the tensor table (no tensor data read).

    Raises ValueError if the file is not GGUF or is truncated.
    """
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        memoryview(mm) as buf,
    ):
        return _parse_index(buf, str(path))


def _parse_index(buf: memoryview, where: str) -> GGUFIndex:
    try:
        return _parse_index_unchecked(buf)
    except struct.error as e:
        raise ValueError(f"{where}: truncated or corrupt GGUF header") from e


def _parse_index_unchecked(buf: memoryview) -> GGUFIndex:
    if bytes(buf[:4]) != _GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported (need 2 or 3)")
    pos = 24

    def read_str(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return bytes(buf[p + 8 : p + 8 + n]).decode("utf-8", errors="replace"), p + 8 + n

    def skip_or_read(vtype: int, p: int) -> tuple[Any, int]:
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
        if vtype == _STRING:
            return read_str(p)
        if vtype == _ARRAY:
            etype, n = struct.unpack_from("<IQ", buf, p)
            p += 12
            if etype in _SCALAR_FMT:  # fixed-size elements: jump over them
                return None, p + n * struct.calcsize(_SCALAR_FMT[etype])
            for _ in range(n):  # strings (vocabulary) or nested arrays: walk them
                _, p = skip_or_read(etype, p)
            return None, p
        raise ValueError(f"unknown GGUF metadata value type {vtype}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        value, pos = skip_or_read(vtype, pos + 4)
        if value is not None:
            metadata[key] = value

    raw: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw.append((name, ggml_type, tuple(int(d) for d in reversed(dims)), offset))

    alignment = int(metadata.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ggml_type, shape, offset in raw:
        block, block_bytes = _block_geometry(ggml_type)
        n = int(np.prod(shape)) if shape else 1
        if n % block:
            raise ValueError(f"GGUF tensor {name!r}: {n} values is not a whole number of "
                             f"{_type_name(ggml_type)} blocks")
        tensors[name] = GGUFTensorInfo(name, ggml_type, shape, data_start + offset,
                                       n // block * block_bytes)
    if raw and max(t.offset + t.nbytes for t in tensors.values()) > len(buf):
        raise ValueError("GGUF tensor data runs past the end of the file (truncated?)")
    return GGUFIndex(metadata, tensors)


# ----------------------------------------------------------------------------- tensors


def read_gguf_tensors(
    path: str | Path, index: GGUFIndex, *, quantized: bool, group16: bool = False
) -> dict[str, mx.array | QuantizedTensor]:
    """Read every tensor of a GGUF file, keyed by GGUF name.

    With ``quantized=True`` quantized tensors MLX can hold exactly come back as
    :class:`QuantizedTensor` (MLX affine: Q4_0/Q4_1/Q4_K as 4 bits, Q5_0/Q5_1/Q5_K as 5 bits,
    Q8_0, IQ4_NL and IQ4_XS as 8 bits, all in groups of 32; MXFP4 as MLX's ``mxfp4``); with
    ``group16`` too, Q6_K / Q3_K / Q2_K matrices as 6 / 3 / 2-bit groups of 16
    (:data:`GROUP16_TYPES`: only for models whose linear layers and embeddings the native CPU
    kernels run; never stacked experts, which MLX's ``gather_qmm`` runs). Stacked expert
    tensors (3-D) come back 3-D. All others (and all of them with ``quantized=False``) come
    back dense: float32, or float16 for F16 tensors. Raises ValueError for GGML types neither
    MLX nor the ``gguf`` package can decode, or a block that does not map exactly onto its
    MLX layout (naming the tensor).
    """
    types = {t.ggml_type for t in index.tensors.values()}
    stacked = any(len(t.shape) > 2 and t.ggml_type not in (F32, F16)
                  for t in index.tensors.values())
    if types <= MLX_EXACT_TYPES and not stacked:  # MLX's reader is checked on matrices only
        return _read_with_mlx(path, index, quantized=quantized)
    return _read_with_numpy(path, index, quantized=quantized, group16=group16)


def _read_with_mlx(
    path: str | Path, index: GGUFIndex, *, quantized: bool
) -> dict[str, mx.array | QuantizedTensor]:
    arrays = mx.load(str(path))
    out: dict[str, mx.array | QuantizedTensor] = {}
    for name, info in index.tensors.items():
        if info.ggml_type in (F32, F16):
            out[name] = arrays[name]
            continue
        base = name.removesuffix(".weight")
        w, scales, biases = arrays[name], arrays[f"{base}.scales"], arrays[f"{base}.biases"]
        qt = QuantizedTensor(w, scales, biases, bits=w.shape[-1] // scales.shape[-1],
                             source_type=info.type_name)
        out[name] = qt if quantized else qt.dequantize(mx.float32)
    return out


def _read_with_numpy(
    path: str | Path, index: GGUFIndex, *, quantized: bool, group16: bool = False
) -> dict[str, mx.array | QuantizedTensor]:
    import gguf

    out: dict[str, mx.array | QuantizedTensor] = {}
    # numpy owns this map and unmaps it once the last view is gone; every branch below copies
    # into MLX, so nothing keeps it alive past this function
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in index.tensors.items():
        raw = data[info.offset : info.offset + info.nbytes]
        t = info.ggml_type
        if t == F32:
            out[name] = mx.array(raw.view(np.float32).reshape(info.shape))
        elif t == F16:
            out[name] = mx.array(raw.view(np.float16).reshape(info.shape))
        elif t == BF16:  # widen exactly: bf16 is the top half of a float32
            wide = raw.view(np.uint16).astype(np.uint32) << 16
            out[name] = mx.array(wide.view(np.float32).reshape(info.shape))
        elif quantized and t in REPACKABLE_TYPES and len(info.shape) == 2:
            out[name] = _repack(raw, info)
        elif quantized and t in REPACKABLE_TYPES | {MXFP4} and len(info.shape) == 3:
            out[name] = _repack_experts(raw, info)
        elif quantized and t == MXFP4 and len(info.shape) == 2:
            out[name] = _repack_mxfp4(raw, info)
        elif quantized and group16 and t in GROUP16_TYPES and len(info.shape) == 2:
            out[name] = _requantize(raw, info)
        else:
            try:
                qtype = gguf.GGMLQuantizationType(t)
                rows = raw.reshape(int(np.prod(info.shape[:-1])), -1)
                dense = gguf.quants.dequantize(rows, qtype)
            except (ValueError, NotImplementedError) as e:
                raise ValueError(f"GGUF tensor {name!r} has type {info.type_name}, which "
                                 "cannot be decoded") from e
            out[name] = mx.array(dense.reshape(info.shape).astype(np.float32, copy=False))
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values < 16, ``[rows, n]`` in element order -> MLX 4-bit words ``[rows, n/8]``.

    MLX stores element i of each 32-bit word in bits 4*(i%8), i.e. byte-wise low nibble first.
    """
    q = np.ascontiguousarray(q)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return np.ascontiguousarray(packed).view("<u4")


def _repack_experts(raw: np.ndarray, info: GGUFTensorInfo) -> QuantizedTensor:
    """A stacked expert tensor ``[experts, rows, cols]`` of a repackable type or MXFP4, re-laid
    expert by expert (every GGUF block lies within one row of one expert, so the stack is
    re-laid as ``experts * rows`` rows) into a 3-D :class:`QuantizedTensor`."""
    experts, rows, cols = info.shape
    flat = GGUFTensorInfo(info.name, info.ggml_type, (experts * rows, cols), info.offset,
                          info.nbytes)
    qt = _repack_mxfp4(raw, flat) if info.ggml_type == MXFP4 else _repack(raw, flat)
    return qt.map_rows(lambda a: a.reshape(experts, rows, a.shape[-1]))


def _repack_mxfp4(raw: np.ndarray, info: GGUFTensorInfo) -> QuantizedTensor:
    """Re-lay an MXFP4 matrix in MLX's ``mxfp4`` mode, code for code: both hold 32 e2m1
    codes (OCP MX: sign, 2 exponent bits, 1 mantissa bit) and one e8m0 scale per block
    (value ``2**(e - 127) * e2m1``). Only the nibble order differs: a GGUF block (17 bytes:
    ``e`` then 16 bytes, ggml-common.h ``block_mxfp4``) holds values ``j`` and ``j + 16`` in
    the low and high nibble of byte ``j``; MLX packs values in order, low nibble first.

    Raises:
        ValueError: naming the tensor, for a scale byte of 255 (MLX decodes it as infinity).
    """
    def rows_fn(per_row: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        rows, cols = per_row.shape[0], info.shape[1]
        blocks = per_row.reshape(rows, cols // 32, 17)
        scales = np.ascontiguousarray(blocks[..., 0])
        if np.any(scales == _E8M0_UNREPRESENTABLE):
            raise ValueError(f"GGUF tensor {info.name!r} (MXFP4) has a block scale byte of "
                             "255, which MLX's mxfp4 does not decode as ggml does")
        qs = blocks[..., 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
        return _pack_nibbles(codes), scales, None

    return _in_row_chunks(raw, info, 4, 32, rows_fn, mode="mxfp4")


def _repack(raw: np.ndarray, info: GGUFTensorInfo) -> QuantizedTensor:
    """Re-lay a Q4_0/Q4_1/Q8_0/Q4_K tensor as an MLX affine triple, value for value (the
    :data:`REQUANTIZED` types: :func:`_requantize`), a chunk of rows at a time
    (:func:`_in_row_chunks`).

    Block layouts (ggml-common.h): Q4_0 = f16 d + 16 bytes of nibbles (value d*(q-8), first 16
    values in the low nibbles); Q4_1 = f16 d, f16 m + nibbles (d*q + m); Q8_0 = f16 d + 32 int8
    (d*q); Q4_K = 256-value super-block with f16 d, f16 dmin, 12 bytes of packed 6-bit sub-block
    scales/mins and 128 bytes of nibbles (32-value sub-block j: d*sc_j*q - dmin*m_j).
    """
    t = info.ggml_type
    if t in REQUANTIZED:
        return _requantize(raw, info)
    return _in_row_chunks(raw, info, 8 if t == Q8_0 else 4, GROUP_SIZE,
                          lambda rows: _repack_rows(rows, t, info.shape[1]))


def _repack_rows(raw: np.ndarray, t: int, cols: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_repack` of whole rows ``raw`` (``[n, row bytes]``): packed words, scales and
    biases of those rows (numpy)."""
    rows = raw.shape[0]
    if t == Q4_K:
        return _repack_q4_k(raw, rows, cols)
    block_bytes = {Q4_0: 18, Q4_1: 20, Q8_0: 34}[t]
    blocks = raw.reshape(rows, cols // 32, block_bytes)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if t == Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        weight = np.ascontiguousarray(q.astype(np.uint8)).reshape(rows, cols).view("<u4")
        return weight, d, d * np.float16(-128)
    header = 2 if t == Q4_0 else 4
    qs = blocks[..., header : header + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    if t == Q4_0:
        biases = d * np.float16(-8)
    else:
        biases = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    return _pack_nibbles(q), d, biases


def _repack_q4_k(raw: np.ndarray, rows: int, cols: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sb = raw.reshape(rows, cols // 256, 144)
    d = np.ascontiguousarray(sb[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(sb[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    sc, mn = _k_scales_mins(sb[..., 4:16])  # 12 bytes: 8 six-bit scales and 8 six-bit mins
    qs = sb[..., 16:144].reshape(rows, cols // 256, 4, 32)  # 4 chunks of 64 values
    # chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c+1
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    # scales/biases in float32: d * sc needs more mantissa than float16 has
    scales = (d[..., None] * sc).reshape(rows, cols // 32)
    biases = (-(dmin[..., None] * mn)).reshape(rows, cols // 32)
    return _pack_nibbles(q), scales, biases


#: Values re-laid at once by :func:`_in_row_chunks`: the numpy temporaries of a repack or
#: re-coding take a few times 4 bytes per value, so a whole 136M-value token embedding or
#: output layer (Qwen2.5's vocabulary) at once made the load peak at ~3.3 GiB of RSS for a
#: 491 MB file; chunks of rows bound them to a few tens of MiB.
ROW_CHUNK_VALUES = 1 << 22


def _in_row_chunks(raw: np.ndarray, info: GGUFTensorInfo, bits: int, group: int,
                   rows_fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, Any]],
                   mode: str = "affine") -> QuantizedTensor:
    """``rows_fn`` over chunks of :data:`ROW_CHUNK_VALUES` values' worth of whole rows
    of ``raw`` (every GGUF block lies within one row), its (words, scales, biases) joined
    into one :class:`QuantizedTensor` (biases None for ``mode`` other than affine)."""
    rows, cols = info.shape
    per_row = raw.reshape(rows, -1)
    step = max(1, ROW_CHUNK_VALUES // cols)
    parts = [rows_fn(per_row[r:r + step]) for r in range(0, rows, step)]
    weight, scales = (np.concatenate([part[i] for part in parts]) for i in range(2))
    biases = None if mode != "affine" else mx.array(np.concatenate([p[2] for p in parts]))
    return QuantizedTensor(mx.array(weight), mx.array(scales), biases, bits=bits,
                           source_type=info.type_name, group_size=group, mode=mode)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-block scales and mins of a Q4_K/Q5_K super-block from its 12 packed
    bytes ``s[..., 12]`` (ggml's ``get_scale_min_k4``)."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(
        np.float32)


def _group_affine(raw: np.ndarray, t: int, rows: int, cols: int
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """Per group (:data:`REQUANTIZED`'s size) of a tensor of one of those types: the scale,
    the bias, and the integer offset ``o`` of the unsigned code (``value = scale * code +
    bias`` with ``code = q + o``; ``o`` is 0 where the bias is the block's own minimum),
    float32 ``[rows, cols / group]`` each. Block layouts as the ``gguf`` package reads them
    (gguf/quants.py; byte offsets within a block):

    * Q5_0 (22 B): f16 d, 4 B high bits, 16 B nibbles; ``d (q - 16)``.
    * Q5_1 (24 B): f16 d, f16 m, ...; ``d q + m``.
    * Q5_K (176 B / 256 values): f16 d, f16 dmin, Q4_K's 12 scale bytes; sub-block j of 32
      ``d sc_j q - dmin m_j``.
    * IQ4_NL (18 B): f16 d, nibbles indexing 16 levels in -127..113; ``d level``.
    * IQ4_XS (136 B / 256): f16 d, u16 high scale bits, 4 B low scale nibbles, 128 B
      nibbles; sub-block j of 32 ``d (ls_j - 32) level`` (6-bit ``ls_j``).
    * Q6_K (210 B / 256): 128 B low nibbles, 64 B high bits, 16 int8 scales, f16 d; sub-block
      j of 16 ``d sc_j (q - 32)``.
    * Q3_K (110 B / 256): 32 B high-bit mask, 64 B low 2 bits, 12 B of 6-bit scales, f16 d;
      sub-block j of 16 ``d (sc_j - 32) q`` with q in -4..3.
    * Q2_K (84 B / 256): 16 B of 4-bit scale / min pairs, 64 B 2-bit q, f16 d, f16 dmin;
      sub-block j of 16 ``d sc_j q - dmin m_j``.

    Every scale is an f16 times an integer of at most 6 bits, so ``scale * code`` is exact in
    float32 for codes below 256 and the triple can reproduce the reference's products.
    """
    if t == Q6_K:
        sb = raw.reshape(rows, cols // 256, 210)
        sc = sb[..., 192:208].view(np.int8).astype(np.float32)
        scales = (_f16(sb, 208)[..., None] * sc).reshape(rows, -1)
        return scales, scales * np.float32(-32), 32
    if t == Q3_K:
        sb = raw.reshape(rows, cols // 256, 110)
        packed = sb[..., 96:108]
        low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], -1)
        high = np.concatenate([(packed[..., 8:12] >> s) & 3 for s in (0, 2, 4, 6)], -1)
        sc = (low | (high << 4)).astype(np.float32) - np.float32(32)
        scales = (_f16(sb, 108)[..., None] * sc).reshape(rows, -1)
        return scales, scales * np.float32(-4), 4
    if t == Q2_K:
        sb = raw.reshape(rows, cols // 256, 84)
        sc = sb[..., 0:16]
        scales = (_f16(sb, 80)[..., None] * (sc & 0x0F).astype(np.float32)).reshape(rows, -1)
        mins = (_f16(sb, 82)[..., None] * (sc >> 4).astype(np.float32)).reshape(rows, -1)
        return scales, -mins, 0
    if t == IQ4_XS:
        sb = raw.reshape(rows, cols // 256, 136)
        high = np.ascontiguousarray(sb[..., 2:4]).view("<u2")  # [rows, n, 1]
        low = np.stack([sb[..., 4:8] & 0x0F, sb[..., 4:8] >> 4], -1).reshape(rows, -1, 8)
        high = np.concatenate([(high >> (2 * j)) & 3 for j in range(8)], -1)
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - np.float32(32)
        scales = (_f16(sb, 0)[..., None] * ls).reshape(rows, -1)
        return scales, scales * np.float32(-128), 128
    if t == Q5_K:
        sb = raw.reshape(rows, cols // 256, 176)
        sc, mn = _k_scales_mins(sb[..., 4:16])
        scales = (_f16(sb, 0)[..., None] * sc).reshape(rows, -1)
        return scales, (-(_f16(sb, 2)[..., None] * mn)).reshape(rows, -1), 0
    size = {Q5_0: 22, Q5_1: 24, IQ4_NL: 18}[t]
    d = _f16(raw.reshape(rows, cols // 32, size), 0)
    if t == Q5_1:
        return d, _f16(raw.reshape(rows, cols // 32, size), 2), 0
    offset = 16 if t == Q5_0 else 128
    return d, d * np.float32(-offset), offset


def _pack_bits(code: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes below ``2**bits``, ``[rows, cols]`` (cols a multiple of 32) -> MLX's packed
    uint32 words ``[rows, cols * bits / 32]``: each row a little-endian bit stream, element k
    in bits ``[bits k, bits (k + 1))`` (mx.quantize's layout for every width, checked in
    tests/test_cpu_kernels.py)."""
    rows, cols = code.shape
    if bits == 8:
        return np.ascontiguousarray(code).view("<u4")
    chunks = code.reshape(rows, cols // 8, 8)  # 8 elements fill `bits` whole bytes
    word = np.zeros((rows, cols // 8), dtype="<u8")
    for i in range(8):
        word |= chunks[..., i].astype("<u8") << np.uint64(bits * i)
    packed = word.view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")


def _unpack_bits(words: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The inverse of :func:`_pack_bits`: uint8 codes ``[rows, cols]``."""
    rows = words.shape[0]
    packed = np.ascontiguousarray(words).view(np.uint8).reshape(rows, cols // 8, bits)
    if bits == 8:
        return packed.reshape(rows, cols)
    chunk = np.zeros((rows, cols // 8, 8), dtype=np.uint8)
    chunk[..., :bits] = packed
    word = chunk.view("<u8")[..., 0]
    mask = np.uint64((1 << bits) - 1)
    return np.stack([(word >> np.uint64(bits * i)) & mask for i in range(8)], -1).astype(
        np.uint8).reshape(rows, cols)


def _requantize(raw: np.ndarray, info: GGUFTensorInfo) -> QuantizedTensor:
    """A tensor of a :data:`REQUANTIZED` type as the MLX affine triple that table names,
    value for value.

    The codes come from the ``gguf`` package's reference dequantization (no bit unpacking of
    our own): ``code = round((value - bias) / scale)`` per group, then the triple is decoded
    back in float32 (``scale * code + bias``, MLX's rounding) and must give the reference's
    values exactly. Done a chunk of rows at a time (:func:`_in_row_chunks`), so the
    temporaries stay small.

    Raises:
        ValueError: naming the tensor, when a code falls outside ``0 .. 2**bits - 1`` or a
            value does not come back exactly (a block that does not fit its layout, e.g. a
            non-finite scale).
    """
    bits, group = REQUANTIZED[info.ggml_type]
    return _in_row_chunks(raw, info, bits, group,
                          lambda rows: _requantize_rows(rows, info, bits, group))


def _requantize_rows(raw: np.ndarray, info: GGUFTensorInfo, bits: int, group: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_requantize` of whole rows ``raw`` (``[n, row bytes]``): packed words, scales and
    biases of those rows (numpy)."""
    import gguf

    rows, cols = raw.shape[0], info.shape[1]
    t = info.ggml_type
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite scale: refused below
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))
    scales, biases, offset = _group_affine(raw, t, rows, cols)
    ref = ref.astype(np.float32, copy=False).reshape(rows, cols // group, group)
    with np.errstate(divide="ignore", invalid="ignore"):
        code = np.rint((ref - biases[..., None]) / scales[..., None])
    code = np.where(scales[..., None] == 0, offset, code)  # all values equal the bias
    back = scales[..., None] * code + biases[..., None]
    if not (np.all((code >= 0) & (code < 2**bits)) and np.array_equal(back, ref)):
        raise ValueError(f"GGUF tensor {info.name!r} ({info.type_name}) does not map exactly "
                         f"onto {bits}-bit affine groups of {group}")
    return _pack_bits(code.astype(np.uint8).reshape(rows, cols), bits), scales, biases


#: Why a quantized GGML type is still dequantized to float32 at load (types not named here
#: and not repacked: "no MLX layout implemented yet").
_GROUP16_WHY = ("16-value sub-blocks; MLX affine groups are 32, 64 or 128, and groups of 16 "
                "are kept only where the native CPU kernels run the model")
_DEQUANTIZED_WHY = {"Q6_K": _GROUP16_WHY, "Q3_K": _GROUP16_WHY, "Q2_K": _GROUP16_WHY}
_GROUP16_EXPERTS_WHY = ("16-value sub-blocks; stacked experts run through MLX's gather_qmm, "
                        "which takes groups of 32, 64 or 128")


def describe_weights(index: GGUFIndex, tensors: dict[str, mx.array | QuantizedTensor],
                     dtype: mx.Dtype | None = None) -> list[str]:
    """One line per GGML type of the file, for the start-up log: how many tensors, how they
    are held (``kept as N-bit affine`` with the scales' dtype, ``dense``, or ``dequantized to
    float32`` with the reason) and their resident bytes (MiB) against the file's.

    Quantized tensors are counted as given (the loader passes them with the scales and biases
    it holds: ``loader.held_scales``). ``dtype``: the compute dtype the loader casts dense
    tensors to, so their bytes are those held after that cast; None: as read."""
    def held(a: mx.array) -> int:
        return a.size * (dtype.size if dtype is not None else a.itemsize)

    groups: dict[tuple[str, str], list[int]] = {}
    for name, info in index.tensors.items():
        t = tensors.get(name)
        if t is None:
            continue
        if isinstance(t, QuantizedTensor):
            if t.mode == "mxfp4":
                how = "kept as MXFP4 (mxfp4, e8m0 scales)"
            else:
                how = f"kept as {t.bits}-bit affine" + (
                    f" (groups of {t.group_size})" if t.group_size != GROUP_SIZE else "") + (
                    f", {str(t.scales.dtype).removeprefix('mlx.core.')} scales")
            if len(t.shape) == 3:
                how += ", stacked experts"
            nbytes = t.nbytes
        elif info.ggml_type in (F32, F16, BF16):
            shown = dtype if dtype is not None else t.dtype
            how, nbytes = f"dense {str(shown).removeprefix('mlx.core.')}", held(t)
        else:
            why = _DEQUANTIZED_WHY.get(info.type_name, "no MLX layout implemented yet")
            if info.ggml_type in GROUP16_TYPES and len(info.shape) == 3:
                why = _GROUP16_EXPERTS_WHY
            if info.ggml_type in REPACKABLE_TYPES | {MXFP4}:
                why = "not a matrix" if len(info.shape) not in (2, 3) else "quantized layers off"
            shown = dtype if dtype is not None else t.dtype
            how = f"dequantized to {str(shown).removeprefix('mlx.core.')} ({why})"
            nbytes = held(t)
        entry = groups.setdefault((info.type_name, how), [0, 0, 0])
        entry[0] += 1
        entry[1] += info.nbytes
        entry[2] += nbytes
    return [f"{name}: {n} tensors, {how}, {held_bytes / 2**20:.1f} MiB "
            f"(file {file / 2**20:.1f} MiB)"
            for (name, how), (n, file, held_bytes) in sorted(groups.items())]


# ----------------------------------------------------------------------------- names

# llama.cpp block-tensor names -> HF module paths under model.layers.N, per family. Gemma 3
# has four norms per block and llama.cpp calls its pre-MLP norm "ffn_norm", which in the
# Llama/Qwen layout is the post-attention norm.
_COMMON_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Mixture-of-experts blocks: the router (``ffn_gate_inp``) and the stacked experts, as
# mlx-lm's modules name them (qwen3_moe: ``mlp.gate`` + ``mlp.switch_mlp``; gpt_oss:
# ``mlp.router`` + ``mlp.experts``, both SwitchGLU).
_QWEN3_MOE_FFN = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
                  "ffn_up_exps": "mlp.switch_mlp.up_proj",
                  "ffn_down_exps": "mlp.switch_mlp.down_proj"}
_GPT_OSS_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# mlx-lm parameters that are bare arrays, not a module's ``weight`` (llama.cpp adds ".weight")
_BARE_PARAMS = frozenset({"self_attn.sinks"})
_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "llama": {**_COMMON_BLOCK, "ffn_norm": "post_attention_layernorm"},
    "qwen2": {**_COMMON_BLOCK, "ffn_norm": "post_attention_layernorm"},
    "qwen3": {**_COMMON_BLOCK, **_QK_NORM, "ffn_norm": "post_attention_layernorm"},
    "gemma3_text": {
        **_COMMON_BLOCK,
        **_QK_NORM,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "qwen3_moe": {**_COMMON_BLOCK, **_QK_NORM, **_QWEN3_MOE_FFN,
                  "ffn_norm": "post_attention_layernorm"},
    "gpt_oss": _GPT_OSS_BLOCK,
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
_TOP_RE = re.compile(r"([a-z0-9_]+)\.(weight|bias)")


def gguf_to_hf_name(name: str, model_type: str) -> str:
    """Map a llama.cpp tensor name to the HF / mlx-lm parameter name.

    ``blk.3.ffn_norm.weight`` -> ``model.layers.3.post_attention_layernorm.weight`` (Llama) or
    ``model.layers.3.pre_feedforward_layernorm.weight`` (Gemma 3). Raises ValueError naming the
    tensor if it has no counterpart in ``model_type``.
    """
    table = _BLOCK_NAMES.get(model_type)
    if table is None:
        raise ValueError(f"no GGUF tensor-name mapping for model type {model_type!r}")
    if m := _BLOCK_RE.fullmatch(name):
        layer, part, kind = m.groups()
        if part in table and table[part] in _BARE_PARAMS:
            if kind == "weight":
                return f"model.layers.{layer}.{table[part]}"
        elif part in table:
            return f"model.layers.{layer}.{table[part]}.{kind}"
    elif (m := _TOP_RE.fullmatch(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in a {model_type} model")


_FUSED_GATE_UP = re.compile(r"(blk\.\d+\.)ffn_gate_up_exps\.(weight|bias)")


def split_fused_experts(name: str, tensor: mx.array | QuantizedTensor
                        ) -> list[tuple[str, mx.array | QuantizedTensor]]:
    """``[(name, tensor)]``, except that a fused ``blk.N.ffn_gate_up_exps`` weight
    ``[experts, 2 * ffn, hidden]`` or bias ``[experts, 2 * ffn]`` (llama.cpp's converter may
    fuse the gate and up projections: gate rows first) comes back as the ``ffn_gate_exps`` and
    ``ffn_up_exps`` halves. ValueError for an odd number of rows."""
    m = _FUSED_GATE_UP.fullmatch(name)
    if m is None:
        return [(name, tensor)]
    prefix, kind = m.groups()
    axis = 1 if kind == "weight" else -1
    rows = tensor.shape[axis]
    if rows % 2:
        raise ValueError(f"GGUF tensor {name!r}: {rows} rows do not split into gate and up")
    half = rows // 2

    def part(t: mx.array | QuantizedTensor, lo: int) -> mx.array | QuantizedTensor:
        def cut(a: mx.array) -> mx.array:
            return mx.contiguous(a[:, lo:lo + half] if axis == 1 else a[..., lo:lo + half])

        return t.map_rows(cut) if isinstance(t, QuantizedTensor) else cut(t)

    return [(f"{prefix}ffn_gate_exps.{kind}", part(tensor, 0)),
            (f"{prefix}ffn_up_exps.{kind}", part(tensor, half))]


def unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation for a ``[n_heads * head_dim, ...]`` array.

    llama.cpp's converter reorders each head's rows from the "rotate halves" RoPE layout that
    HF uses into interleaved pairs (row ``2i + j`` of a head holds HF row ``j * head_dim/2 + i``);
    this is its inverse. Works on weights, scales, biases and 1-D bias vectors alike.
    """
    rows = x.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    rest = x.shape[1:]
    return x.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
