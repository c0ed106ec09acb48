"""The cases every dialect of the quantized-KV GPU kernels is checked on.

Used by ``tests/test_gpu_kv_quant.py`` (the Metal dialect through the CPU emulation) and by
``benchmarks/cuda.py decode`` (the CUDA dialect on the H200; ``benchmarks/cuda_h200.sh pack``
copies this file and ``gpu_attention_grid.py`` next to it), so both check the same cases
against the same expectations:

* the quantizing write (``kv/gpu/quant_write.py``): :func:`write_cases`, each a pool of
  marker bytes, rows with an outlier, an all-zero side (the 1e-6 scale floor), a one-sided
  side (the int4 zero point at an end), values at fp8 rounding ties and subnormals, slots in
  random order and one padding slot -1; the expected pool is
  :func:`vllm_unified.kv.quant.quantize_cells_reference` (numpy) at the slots, every other
  byte unchanged. (Here the numpy reference is also checked against the native write, itself
  checked against vLLM's own kernels in ``tests/test_kv_quant.py``.)
* the paged attention over quantized pages (``kv/gpu/paged_quant.py``): the step kinds
  of :mod:`gpu_attention_grid` (decode rows, prefill chunks, a mix), a covering design over
  format x step kind x dtype with head size, GQA group, block size, window and route rotating
  (turboquant_k8v4 also a ``long`` continuation chunk, and the step's unquantized K/V as
  ``fresh`` for the chunks vLLM's TurboQuant backend attends over them);
  block tables with holes from a pool twice the size needed; every cell no sequence owns
  0xFF bytes (a NaN scale: a read outside a row's keys makes the output NaN). The oracle is
  the pure-MLX reference over the pool dequantized by pure MLX
  (``reference.paged_attention_kv(..., kv_format=...)``), in fp32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from gpu_attention_grid import EVERY_ROW, OPTIONS, STEPS, TOLERANCE, option_name, options_of

MODES = ("int8_per_token_head", "int4_per_token_head", "fp8_per_token_head",
         "turboquant_k8v4")
DTYPES = ("float32", "float16", "bfloat16")
WRITE_DIMS = (64, 96, 128, 256)


def storage_dtype(name: str) -> mx.Dtype:
    """vLLM's storage dtype of a format's pages, as MLX's (int8 for int8, else uint8)."""
    return mx.int8 if name == "int8_per_token_head" else mx.uint8


def signs_for(name: str, dim: int) -> mx.array | None:
    """vLLM's RHT signs for int4 (None for the other formats)."""
    from vllm_unified.kv.quant import kv_format, rht_signs

    return rht_signs(dim) if kv_format(name).rotated else None


@dataclass(frozen=True)
class WriteCase:
    """One quantizing write: format, head size, dtype, KV heads, tokens (4-D rows when
    ``four_d``), seed."""

    mode: str
    dim: int
    dtype: str
    kv_heads: int
    tokens: int
    four_d: bool
    seed: int

    @property
    def name(self) -> str:
        return (f"{self.mode.split('_')[0]}-D{self.dim}-{self.dtype}-H{self.kv_heads}-"
                f"T{self.tokens}{'-4d' if self.four_d else ''}")


def write_cases() -> list[WriteCase]:
    """Every format x head size once, the dtypes rotating so that each format meets each
    dtype; KV heads 1-3, token counts from 3 (slots in Metal's constant address space) up."""
    cases = []
    for m, mode in enumerate(MODES):
        for j, dim in enumerate(WRITE_DIMS):
            cases.append(WriteCase(mode, dim, DTYPES[(j + m) % 3], 1 + (j + m) % 3,
                                   (3, 11, 20)[(j + 2 * m) % 3], (j + m) % 2 == 1,
                                   seed=10 * m + j))
    return cases


@dataclass
class WriteInputs:
    pool: mx.array
    slots: mx.array
    keys: mx.array
    values: mx.array
    expected: np.ndarray


def write_inputs(case: WriteCase) -> WriteInputs:
    """The case's pool (marker bytes 0xA5), slots (one of them -1), keys and values in its
    dtype, and the pool expected after the write (numpy uint8)."""
    from vllm_unified.kv.quant import (
        kv_format,
        quantize_cells_reference,
        round_to_dtype_reference,
    )

    fmt = kv_format(case.mode)
    rng = np.random.default_rng(case.seed)
    t, h, d = case.tokens, case.kv_heads, case.dim
    keys = rng.standard_normal((t, h, d)).astype(np.float32) * 2
    values = rng.standard_normal((t, h, d)).astype(np.float32)
    keys[0, 0, 3] = 37.0  # an outlier
    keys[0, h - 1, 5] = -600.0  # beyond fp8's range: turboquant's unscaled keys saturate
    if case.mode.startswith("turboquant_"):
        values[0, 0, 7] = np.nan  # skipped by the row's min and max, stored as level 0
    values[1, h - 1] = 0.0  # a zero side: the scale floor
    keys[2] = np.abs(keys[2])  # one-sided: the int4 zero point at an end
    # a narrow value row: turboquant's fp16 scale a subnormal (below 2^-14)
    values[2, 0] = 1e-4 * rng.standard_normal(d).astype(np.float32)
    if t > 5:
        # fp8 rounding ties and subnormals after the scale (amax 448 makes inv 1): values
        # halfway between e4m3 neighbours, and below 2^-6
        row = rng.choice(np.array([448.0, 3.375, 3.125, 13.5, 12.5, 15.5, 0.0048828125,
                                   0.0068359375, 0.0146484375, -0.0185546875, -3.375,
                                   0.000976], np.float32), d)
        row[0] = 448.0
        keys[4, 0] = row  # token 4: never the padding slot (token t // 2)
    keys = round_to_dtype_reference(keys, case.dtype)
    values = round_to_dtype_reference(values, case.dtype)
    cell = fmt.cell_bytes(d)
    num_slots = 2 * t + 8
    pool = np.full((num_slots, h, cell), 0xA5, np.uint8)
    slots = rng.permutation(num_slots)[:t].astype(np.int32)
    slots[t // 2] = -1  # vLLM's padding slot: skipped
    signs = signs_for(case.mode, d)
    cells = quantize_cells_reference(keys, values, fmt, case.dtype,
                                     None if signs is None else np.array(signs))
    expected = pool.copy()
    ok = slots >= 0
    expected[slots[ok]] = cells[ok]
    dtype = getattr(mx, case.dtype)
    shape = (t, h, 1, d) if case.four_d else (t, h, d)
    return WriteInputs(
        pool=mx.array(pool).view(storage_dtype(case.mode)), slots=mx.array(slots),
        keys=mx.array(keys).astype(dtype).reshape(shape),
        values=mx.array(values).astype(dtype).reshape(shape), expected=expected)


def pool_bytes(pool: mx.array | np.ndarray) -> np.ndarray:
    """A pool's bytes as numpy uint8."""
    if isinstance(pool, mx.array):
        pool = np.array(pool.view(mx.uint8))
    return np.asarray(pool).view(np.uint8)


# --------------------------------------------------------------------------- attention grid

HEAD_SIZES = (64, 128, 256, 96)
GROUPS = (1, 4, 8, 2)
BLOCK_SIZES = (16, 32)
WINDOWS = (None, 16, 61)
KINDS = ("decode", "prefill", "mixed")
ROUTES = ("kernel", "split")
#: turboquant_k8v4 also meets a chunk longer than vLLM's TurboQuant short-continuation limit
#: (128 tokens) after cached context: it reads its own 150 rows unquantized, the earlier ones
#: from the cells; beside it a short continuation and a decode row
TQ_STEPS = {"long": ([1, 150, 20], [40, 300, 180])}


def kinds(mode: str) -> tuple[str, ...]:
    """The step kinds a format meets (turboquant_k8v4: also ``long``)."""
    return KINDS + tuple(TQ_STEPS) if mode.startswith("turboquant_") else KINDS


@dataclass(frozen=True)
class Case:
    """One step over a quantized pool (the fields of :class:`gpu_attention_grid.Case`, with the
    format ``mode``)."""

    mode: str
    kind: str
    dim: int
    group: int
    kv_heads: int
    block_size: int
    window: int | None
    dtype: str
    route: str
    seed: int
    softcap: float | None = None
    sinks: bool = False

    @property
    def name(self) -> str:
        return (f"{self.mode.split('_')[0]}-{self.kind}-D{self.dim}-G{self.group}x"
                f"{self.kv_heads}-bs{self.block_size}-w{self.window or 0}-{self.dtype}-"
                f"{self.route}{option_name(self)}")


def grid(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[Case]:
    """Each (format, step kind, dtype) once; head size, group, KV heads, block size, window
    and route rotating, so every format meets every head size and every step kind every
    window and route."""
    cases = []
    i = 0
    for t, dtype in enumerate(dtypes):
        for m, mode in enumerate(MODES):
            for k, kind in enumerate(kinds(mode)):
                # the long continuation once without a window and once with one
                window = WINDOWS[(m + k) % 3] if kind in KINDS else (None, 61)[t % 2]
                cases.append(Case(
                    mode=mode, kind=kind, dim=HEAD_SIZES[(i + m) % 4],
                    group=GROUPS[(i + k) % 4], kv_heads=1 + i % 2,
                    block_size=BLOCK_SIZES[(i // 3) % 2], window=window,
                    dtype=dtype, route=ROUTES[(i // 3 + k) % 2], seed=100 + i))
                i += 1
    return cases


def option_grid(dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[Case]:
    """Steps with attention options (soft-capping, sinks: :data:`gpu_attention_grid.OPTIONS`):
    each format once per dtype with each options pair, step kind, head size, group, window
    and route rotating."""
    cases = []
    i = 0
    for dtype in dtypes:
        for m, mode in enumerate(MODES):
            softcap, sinks = OPTIONS[(i + m) % len(OPTIONS)]
            cases.append(Case(
                mode=mode, kind=KINDS[i % 3], dim=HEAD_SIZES[(i + 1) % 4],
                group=GROUPS[(i + 2) % 4], kv_heads=1 + i % 2,
                block_size=BLOCK_SIZES[i % 2], window=WINDOWS[(i + 1) % 3], dtype=dtype,
                route=ROUTES[i % 2], seed=700 + i, softcap=softcap, sinks=sinks))
            i += 1
    return cases


@dataclass
class Built:
    """A case's inputs and the reference output (fp32 numpy)."""

    queries: mx.array
    pool: mx.array
    meta: object
    scale: float
    fmt: object
    signs: mx.array | None
    max_chunk: int | None
    fresh: tuple[mx.array, mx.array]
    reference: np.ndarray
    options: dict = field(default_factory=dict)


def build(case: Case) -> Built:
    """The case's queries ``[T, H, 1, D]``, quantized pool (owned cells written by the numpy
    reference of the write, the rest 0xFF), metadata and the reference output."""
    from vllm_unified.kv.attention.metadata import build_attention_metadata
    from vllm_unified.kv.attention.reference import paged_attention_kv
    from vllm_unified.kv.quant import kv_format, quantize_cells_reference

    fmt = kv_format(case.mode)
    rng = np.random.default_rng(case.seed)
    qlens, slens = {**STEPS, **TQ_STEPS}[case.kind]
    bs, dim = case.block_size, case.dim
    need = [-(-s // bs) for s in slens]
    num_blocks = 2 * sum(need) + 3
    ids = rng.permutation(num_blocks)
    owned_ids, spare = ids[: sum(need)], ids[sum(need):]
    tables = np.empty((len(slens), max(need) + 2), np.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = owned_ids[used:used + n]
        tables[i, n:] = spare[i % len(spare)]
        used += n
    slots = np.concatenate([
        tables[i, np.arange(s) // bs].astype(np.int64) * bs + np.arange(s) % bs
        for i, s in enumerate(slens)])
    keys = rng.standard_normal((len(slots), case.kv_heads, dim)).astype(np.float32)
    values = rng.standard_normal((len(slots), case.kv_heads, dim)).astype(np.float32)
    keys[:, :, 3] += 4.0  # a channel outlier, as real keys have
    signs = signs_for(case.mode, dim)
    from vllm_unified.kv.quant import round_to_dtype_reference

    keys = round_to_dtype_reference(keys, case.dtype)
    values = round_to_dtype_reference(values, case.dtype)
    cells = quantize_cells_reference(keys, values, fmt, case.dtype,
                                     None if signs is None else np.array(signs))
    pool = np.full((num_blocks * bs, case.kv_heads, fmt.cell_bytes(dim)), 0xFF, np.uint8)
    pool[slots] = cells
    heads = case.group * case.kv_heads
    queries = rng.standard_normal((sum(qlens), heads, 1, dim)).astype(np.float32)
    dtype = getattr(mx, case.dtype)
    q = mx.array(queries).astype(dtype)
    kv = mx.array(pool).view(storage_dtype(case.mode))
    meta = build_attention_metadata(qlens, slens, tables, bs)
    scale = dim ** -0.5
    # the step's own keys and values, unquantized ([T, Hkv, 1, D]): each sequence's last rows
    ends = np.cumsum(slens)
    own = np.concatenate([np.arange(e - n, e) for e, n in zip(ends, qlens, strict=True)])
    fresh = tuple(mx.array(x[own][:, :, None]).astype(dtype) for x in (keys, values))
    ref_meta = build_attention_metadata(qlens, slens, tables, bs)
    options = options_of(case, heads, rng)
    with mx.stream(mx.cpu):  # exact fp32 on every machine (no TF32)
        reference = np.array(paged_attention_kv(
            q.astype(mx.float32), kv, ref_meta, scale, case.window, kv_format=fmt,
            fresh=fresh, **options).astype(mx.float32))
    max_chunk = EVERY_ROW if case.route == "kernel" else None
    return Built(q, kv, meta, scale, fmt, signs, max_chunk, fresh, reference, options)


Attend = Callable[..., mx.array]


def max_error(case: Case, attend: Attend) -> float:
    """Largest absolute difference between ``attend(queries, pool, meta, scale, window, fmt,
    signs, max_chunk, fresh, **options)`` (the arguments of ``paged_gpu_attention_quant``
    after the dialect; ``options``: ``softcap`` / ``sinks`` for a case that has them) and the
    reference on ``case`` (NaN when the output is not finite)."""
    b = build(case)
    got = np.array(attend(b.queries, b.pool, b.meta, b.scale, case.window, b.fmt, b.signs,
                          b.max_chunk, b.fresh, **b.options).astype(mx.float32))
    if got.shape != b.reference.shape:
        raise AssertionError(f"{case.name}: output {got.shape} != {b.reference.shape}")
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.abs(got - b.reference).max())


__all__ = ["TOLERANCE", "Case", "WriteCase", "build", "grid", "max_error", "option_grid",
           "pool_bytes", "write_cases", "write_inputs"]
