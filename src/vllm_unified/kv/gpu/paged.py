"""Paged attention straight from the pool on MLX's GPU backends: one kernel source, CUDA and Metal.

The pure-MLX reference (:mod:`vllm_unified.kv.attention.reference`) gathers every sequence's keys
and values out of the pool into dense arrays per layer and step, then runs SDPA over them: at batch
64 and 640-token contexts that is ~170 MB written and read again per layer, and the boolean mask of
unequal lengths takes SDPA off its fastest path. The kernel here reads each key and value once,
where it lies in the pool, through the block table. It is written once (:data:`SOURCE`, in the
names of :mod:`vllm_unified.gpu_dialect`: ``kernels/paged_attention.inc``, the body it shares
with :mod:`vllm_unified.kv.gpu.paged_quant`, filled by ``kernels/paged.inc``) and instantiated
as ``mx.fast.cuda_kernel`` or ``mx.fast.metal_kernel`` for the backend profile's
``gpu_attention`` dialect.

**Work split.** One thread group per (tile, KV head). A tile is up to ``QT`` consecutive query rows
of one sequence (a decode row is a tile of one row); the group serves every query head of the KV
head's GQA group for every row of its tile, so each key and value loaded serves ``QT x G`` query
vectors. The group's SIMD groups (warps) split the keys (warp w takes keys ``first + w``,
``first + w + WARPS``, ...), each lane holding ``D / 32`` channels of a key and its value as one
vector load (the key loop unrolled by two, so two keys' loads are in flight per warp); each
warp keeps an online softmax per (row, query head) in fp32. At the end the warps' partial
results are combined in shared memory, ``CB`` (row, head) pairs per pass
(:func:`combine_batch`), so the shared memory used, ``WARPS x (2 QT G + CB D) x 4`` bytes,
stays within the 32 KiB that both Metal and CUDA guarantee.

**Masks.** Row r of a tile sees keys ``first_r ... len_r - 1`` where ``len_r`` is its position + 1
(causal) and ``first_r = max(len_r - window, 0)`` with a sliding window, else 0: the convention of
the reference (``mlx_lm.models.base.create_causal_mask``); with an attention chunk (chunked local
attention) ``first_r`` is raised to the start of the row's chunk,
``(len_r - 1) // chunk * chunk``. A key no row of the tile sees is never
read; every key read was written by this or an earlier step, so the kernel never reads unowned
pool memory.

**Options.** Attention logit soft-capping (``SOFTCAP``: each scaled score becomes
``cap * tanh(s / cap)``, ``cap`` the second word of the ``scale`` input) and attention sinks
(``SINKS``: one fp32 logit per query head, input ``sinks``, counted in the combine's maximum and
denominator, weighting no value) are template options of the shared body, so both kernels and
both dialects have them; the chunks left to MLX's SDPA take them through
:func:`vllm_unified.kv.attention.reference.sdpa`.

**Tiles.** Built once per step on the host (:meth:`AttentionMetadata.gpu_tiles`, vectorised
numpy, cached on the metadata, all layers share them) and ordered by decreasing key count, so the
longest tiles start first. A pure-decode step needs none: group ``i`` is decode row ``i``, read
through the decode rows' block tables and lengths (``decode_tables`` / ``decode_lens``, which a
compiled step passes as traced inputs), with ``QT = 1``.

**Routing rule (time to first token).** A prefill chunk with no context before it in the pool
(it is its sequence's whole context so far, ``seq_len == length``) attends exactly to the keys
and values its layer just computed. Those are handed to the attention with the queries
(``models/routing.py`` ``paged_sdpa`` receives them), so such a chunk goes to MLX's own SDPA with
``mask="causal"`` over them: no gather, MLX's fastest path, the same function (the keys are cast
to the pool's dtype, so they are the values the pool holds). A chunk after cached context
(chunked prefill, a prefix-cache hit) of more than :data:`MAX_KERNEL_CHUNK` rows goes to MLX's
SDPA over its keys gathered from the pool (the reference's per-chunk path: the gather is small
next to the attention, and MLX's SDPA runs on the matrix units where this kernel does scalar
dot products). Decode rows and short chunks after cached context go to the paged kernel, all
of them in one launch per layer and step. A step that is one fresh prompt launches no paged
kernel at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from vllm_unified import gpu_dialect
from vllm_unified.kv.attention import reference
from vllm_unified.kv.attention.metadata import AttentionMetadata, Chunk, Window
from vllm_unified.kv.attention.qk_prologue import QKPrologue, prologue_code

#: Warps (SIMD groups of 32) per thread group, at most.
MAX_WARPS = 16
#: Query rows per tile, at most.
MAX_Q_TILE = 16
#: Prefill chunks after cached context longer than this many rows go to MLX's SDPA over keys
#: gathered from the pool instead of the kernel (fp32 scalar dot products and SIMD
#: reductions): on the H200, over 2,048 keys, the kernel was faster than gather + SDPA up to
#: 16 rows and 10x slower at 512 (benchmarks/results/HISTORY.md, run J). The kernel serves
#: decode rows and short chunks (speculative verification, small chunked-prefill tails).
MAX_KERNEL_CHUNK = 16
#: Registers of one thread group on CUDA (64 K) and the fp32 values of the query and
#: accumulator vectors one lane may hold (``2 x QT x G x D / 32``), kept well below the
#: per-thread register limit so a group of MAX_WARPS warps still launches.
_REGISTERS_PER_GROUP = 65536
_LANE_VECTOR_FLOATS = 64
#: Shared memory both dialects guarantee a thread group (bytes).
SHARED_BYTES = 32768

KERNEL_NAME = "vllm_unified_paged_attention"
#: ``after``: the completion token of the step's write into ``kv`` (not read: an input so
#: the GPU orders the kernel after the write; :func:`vllm_unified.kv.gpu.write.ordered_after`)
#: ``scale``: fp32 ``[2]``, the score scale and the soft-cap (0: none); ``sinks``: fp32 ``[H]``
#: sink logits (``[1]``, unread, without sinks)
INPUT_NAMES = ["q", "kv", "tables", "tiles", "scale", "sinks", "after"]
OUTPUT_NAMES = ["out"]

#: A vector of N elements loaded (and stored) as one access.
HEADER = gpu_dialect.kernel_file(__package__, "paged.h")

#: The body both paged-attention kernels share (``kernels/paged_attention.inc``), with holes
#: ``@NAME@`` that each kernel fills from the sections of its own file (:func:`attention_body`).
_SHARED_BODY = gpu_dialect.kernel_sections(
    gpu_dialect.kernel_file(__package__, "paged_attention.inc"))["BODY"]


def attention_body(parts: str, keep: tuple[str, ...] = ()) -> str:
    """The shared paged-attention body with its holes filled by the sections of the kernel
    file ``parts`` (``kernels/paged.inc``, ``kernels/paged_quant.inc``); placeholders named in
    ``keep`` are left for a later :func:`vllm_unified.gpu_dialect.render`.

    Raises:
        ValueError: a hole without a section, or a section for no hole.
    """
    sections = gpu_dialect.kernel_sections(gpu_dialect.kernel_file(__package__, parts))
    return gpu_dialect.render(_SHARED_BODY, keep, **sections)


#: The kernel body. Template arguments: T (dtype), D (head size, one of HEAD_SIZES),
#: H, HKV (query and KV heads), BS (tokens per block), WARPS, WINDOW (0: none), CHUNK
#: (attention chunk, 0: none), QT (rows per
#: tile), CB ((row, head) pairs combined per pass, :func:`combine_batch`), DECODE (1: group i
#: is decode row i, ``tiles`` holds the decode lengths ``[Bd]``; 0: ``tiles`` is ``[NT, 4]``:
#: first row, rows, sequence, keys seen by the tile's last row), SOFTCAP and SINKS (0 or 1:
#: the options, see the module docstring). ``@Q_PROLOGUE@`` is filled by
#: :func:`kernel_source`.
SOURCE = attention_body("paged.inc", keep=("Q_PROLOGUE",))


#: Head sizes the GPU kernels take: each lane holds D / 32 channels, loaded as one aligned
#: vector (``UniVec``), whose alignment must be a power of two (so 96, 160, 192 and 224 are
#: not taken; the rotation's adjacent pairs of the q/k prologue also assume it)
HEAD_SIZES = (32, 64, 128, 256)


def supported(head_dim: int) -> bool:
    """Head sizes the GPU kernels handle: :data:`HEAD_SIZES`."""
    return head_dim in HEAD_SIZES


@functools.cache
def q_tile(group: int, head_dim: int) -> int:
    """Query rows per prefill tile for a GQA group of ``group`` query heads of ``head_dim``:
    as many as keep a lane's fp32 query and accumulator vectors within
    ``_LANE_VECTOR_FLOATS`` (``2 x QT x G x D / 32``), at least 1, at most MAX_Q_TILE."""
    per_row = 2 * group * (head_dim // 32)
    return max(1, min(MAX_Q_TILE, _LANE_VECTOR_FLOATS // per_row))


@functools.cache
def warps_per_group(group: int, head_dim: int, rows: int) -> int:
    """Warps per thread group serving ``rows`` query rows x ``group`` heads of ``head_dim``:
    MAX_WARPS, halved while the group's estimated registers (per lane: the query and
    accumulator vectors, the softmax state, the key and value, ~40 more) exceed 64 K or its
    shared memory exceeds SHARED_BYTES."""
    qg, epl = rows * group, head_dim // 32
    registers = 2 * qg * epl + 4 * qg + 2 * epl + 40
    shared = 4 * (head_dim + 2 * qg)
    warps = MAX_WARPS
    while warps > 1 and (warps * 32 * registers > _REGISTERS_PER_GROUP
                         or warps * shared > SHARED_BYTES):
        warps //= 2
    return warps


@functools.cache
def combine_batch(group: int, head_dim: int, rows: int, warps: int) -> int:
    """(row, head) pairs whose warp results are combined per pass: as many as the shared
    memory budget holds next to the softmax state (``WARPS x (2 QG + CB x D) x 4`` bytes),
    at least 1, at most all ``QG = rows x group``."""
    qg = rows * group
    return max(1, min(qg, (SHARED_BYTES // 4 // warps - 2 * qg) // head_dim))


def kernel_source(prologue: bool) -> str:
    """The body: :data:`SOURCE`, with the query prologue (``prologue``: each query head
    normalised and rotated at its row's position, ``len - 1``, as it is loaded;
    :mod:`vllm_unified.kv.attention.qk_prologue`) or without."""
    code = prologue_code("qv[i]", 0, "len0 + qi - 1") if prologue else ""
    return gpu_dialect.render(SOURCE, Q_PROLOGUE=code)


def kernel_spec(prologue: bool) -> tuple[str, list[str], list[str]]:
    """``(name, input names, output names)`` of the kernel with or without the prologue."""
    if prologue:
        return KERNEL_NAME + "_qk", [*INPUT_NAMES, "qkp"], OUTPUT_NAMES
    return KERNEL_NAME, INPUT_NAMES, OUTPUT_NAMES


@functools.cache
def _kernel(dialect: str, prologue: bool = False):
    name, inputs, outputs = kernel_spec(prologue)
    return gpu_dialect.kernel(name, inputs, outputs, kernel_source(prologue), dialect=dialect,
                              header=HEADER)


@functools.cache
def scale_input(scale: float, softcap: float | None = None) -> mx.array:
    """The ``scale`` input, ``[scale, softcap or 0]`` fp32, made once per value pair (not once
    per layer and step)."""
    return mx.array([scale, softcap or 0.0], dtype=mx.float32)


@functools.cache
def no_sinks() -> mx.array:
    """The ``sinks`` input without sinks (never read)."""
    return mx.zeros((1,), dtype=mx.float32)


def sinks_input(sinks: mx.array | None) -> mx.array:
    """The ``sinks`` input: ``sinks`` (``[H]``, any float dtype) as fp32, or :func:`no_sinks`."""
    if sinks is None:
        return no_sinks()
    return sinks if sinks.dtype == mx.float32 else sinks.astype(mx.float32)


def option_template(softcap: float | None, sinks: mx.array | None) -> list[tuple[str, int]]:
    """The template arguments SOFTCAP and SINKS of the shared body."""
    return [("SOFTCAP", int(softcap is not None)), ("SINKS", int(sinks is not None))]


def options(softcap: float | None, sinks: mx.array | None) -> dict[str, object]:
    """The keyword arguments of a launch for these options: none when neither is set (so a
    launch is called as before they existed)."""
    out: dict[str, object] = {}
    if softcap is not None:
        out["softcap"] = softcap
    if sinks is not None:
        out["sinks"] = sinks
    return out


@functools.cache
def no_write() -> mx.array:
    """The ``after`` input when nothing wrote the pool in this evaluation."""
    return mx.zeros((1,), dtype=mx.int32)


@dataclass(frozen=True)
class LaunchArgs:
    """One launch of the kernel, as MLX's kernel call takes it."""

    inputs: list[mx.array]
    template: list[tuple[str, int | mx.Dtype]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]


def launch_args(
    queries: mx.array, kv_pool: mx.array, tables: mx.array, tiles: mx.array, scale: float,
    window: Window, block_size: int, rows: int, decode: bool,
    prologue: QKPrologue | None = None, after: mx.array | None = None, chunk: Chunk = None,
    softcap: float | None = None, sinks: mx.array | None = None,
) -> LaunchArgs:
    """The kernel call over ``tiles`` (see :func:`launch`)."""
    tokens, heads, _, dim = queries.shape
    kv_heads = kv_pool.shape[1]
    group = heads // kv_heads
    warps = warps_per_group(group, dim, rows)
    extra = [] if prologue is None else [prologue.params]
    return LaunchArgs(
        inputs=[queries, kv_pool, tables, tiles, scale_input(scale, softcap),
                sinks_input(sinks), no_write() if after is None else after, *extra],
        template=[("T", queries.dtype), ("D", dim), ("H", heads), ("HKV", kv_heads),
                  ("BS", block_size), ("WARPS", warps),
                  ("WINDOW", 0 if window is None else int(window)),
                  ("CHUNK", 0 if chunk is None else int(chunk)), ("QT", rows),
                  ("CB", combine_batch(group, dim, rows, warps)), ("DECODE", int(decode)),
                  *option_template(softcap, sinks),
                  *(() if prologue is None else prologue.template())],
        grid=(tiles.shape[0] * kv_heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(tokens, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )


def launch(
    dialect: str, queries: mx.array, kv_pool: mx.array, tables: mx.array, tiles: mx.array,
    scale: float, window: Window, block_size: int, rows: int, decode: bool,
    prologue: QKPrologue | None = None, after: mx.array | None = None, chunk: Chunk = None,
    softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """One launch of the kernel over ``tiles``; returns ``[T, H, 1, D]`` where only the rows the
    tiles cover are written (the others are uninitialised memory).

    Args:
        dialect: ``"cuda"`` or ``"metal"``.
        queries: ``[T, H, 1, D]`` in the pool's dtype.
        kv_pool: ``[slots, Hkv, 2 * D]``.
        tables: int32 ``[B, max_blocks]`` block tables, indexed by a tile's sequence.
        tiles: int32; ``decode``: the decode lengths ``[Bd]`` (tile i = row i of sequence i,
            ``Bd == T``); else ``[NT, 4]`` (first row, rows <= ``rows``, sequence, keys seen by
            the last row).
        scale, window, block_size: as :func:`paged_gpu_attention`.
        rows: QT, the most rows of a tile (1 when ``decode``).
        prologue: the layer's query norm and rotation, applied by the kernel to the raw
            queries (:mod:`vllm_unified.kv.attention.qk_prologue`), or None (queries already
            normalised and rotated).
        after: the completion token of the write into ``kv_pool`` in the same evaluation,
            if any (:func:`vllm_unified.kv.gpu.write.ordered_after`).
        chunk: attention chunk in tokens (chunked local attention) or None.
        softcap, sinks: as :func:`paged_gpu_attention`.
    """
    a = launch_args(queries, kv_pool, tables, tiles, scale, window, block_size, rows, decode,
                    prologue, after, chunk, softcap, sinks)
    kern = _kernel(dialect, prologue is not None)
    return kern(inputs=a.inputs, template=a.template, grid=a.grid, threadgroup=a.threadgroup,
                output_shapes=a.output_shapes, output_dtypes=a.output_dtypes)[0]


def paged_gpu_attention(
    dialect: str, queries: mx.array, kv_pool: mx.array, meta: AttentionMetadata, scale: float,
    window: Window, fresh: tuple[mx.array, mx.array] | None = None,
    max_chunk: int | None = None, prologue: QKPrologue | None = None,
    after: mx.array | None = None, chunk: Chunk = None, softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Every row's attention over ``kv_pool`` (``[slots, Hkv, 2 * D]``, K then V per cell).

    Args:
        dialect: ``"cuda"`` or ``"metal"`` (the backend profile's ``gpu_attention``).
        queries: ``[T, H, 1, D]`` (RoPE'd), token-major, in the pool's dtype.
        kv_pool: one layer's pool, this step's keys and values already written.
        meta: the step's metadata (for a pure-decode step the decode tables and lengths, which
            may be a compiled step's traced inputs; otherwise its host-side fields).
        scale: score multiplier.
        window: sliding window in tokens or None.
        fresh: this step's keys and values of the layer (``[T, Hkv, 1, D]`` or
            ``[T, Hkv, D]``), or None: with them, prefill chunks with no context before them
            go to MLX's SDPA over these (the module's routing rule).
        max_chunk: prefill chunks longer than this that are not attended over ``fresh`` go to
            MLX's SDPA over keys gathered from the pool (the reference's per-chunk path);
            default :data:`MAX_KERNEL_CHUNK`. A huge value sends every such row to the kernel.
        prologue: pure-decode steps only: ``queries`` are the raw projections, which the
            kernel normalises and rotates (:mod:`vllm_unified.kv.attention.qk_prologue`).
        after: the completion token of this evaluation's write into ``kv_pool``, taken as an
            input by every read of it here (:func:`vllm_unified.kv.gpu.write.ordered_after`).
        chunk: attention chunk in tokens (chunked local attention) or None.
        softcap: attention logit soft-capping of the scaled scores, or None.
        sinks: ``[H]`` sink logits (any float dtype), or None.

    Returns:
        ``[T, H, 1, D]`` in the queries' dtype and token order, lazily.

    Raises:
        ValueError: a head size the kernel does not take, a step with prefill chunks whose
            metadata lacks the host-side fields (a compiled step's), a ``prologue`` in a
            step that is not pure decode, or bad ``softcap`` / ``sinks``
            (:func:`~vllm_unified.kv.attention.reference.check_logit_options`).
    """
    tokens, heads, _, dim = queries.shape
    if not supported(dim):
        raise ValueError(f"the paged GPU kernel takes head sizes {HEAD_SIZES}, not {dim}")
    reference.check_logit_options(heads, softcap, sinks)
    # launch's defaults where unset (launch stand-ins keep their signature)
    extra = {**({} if chunk is None else {"chunk": chunk}), **options(softcap, sinks)}
    if meta.is_pure_decode:
        tables, lens = meta.decode_tables_lens()
        return launch(dialect, queries, kv_pool, tables, lens, scale, window, meta.block_size,
                      1, True, prologue, after, **extra)
    if prologue is not None:
        raise ValueError("the query prologue is applied in pure-decode steps only")
    rows = q_tile(heads // kv_pool.shape[1], dim)
    plan = meta.gpu_plan(rows, fresh is not None,
                         MAX_KERNEL_CHUNK if max_chunk is None else max_chunk)
    out = None
    if plan.tiles is not None:
        out = launch(dialect, queries, kv_pool, plan.tables, plan.tiles, scale, window,
                     meta.block_size, rows, False, None, after, **extra)
    if not plan.sdpa:
        return out
    pieces = []
    for start, stop, index in plan.segments:
        if index is None:
            pieces.append(out[start:stop])
        elif fresh is not None and meta.prefills[index].seq_len == stop - start:
            pieces.append(fresh_chunk(queries[start:stop], fresh, start, stop, kv_pool.dtype,
                                       meta.fresh_mask(index, window, chunk), scale, softcap,
                                       sinks))
        else:
            pieces.append(reference.prefill_chunk_attention(queries, kv_pool, meta, index,
                                                            scale, window, after, chunk,
                                                            softcap, sinks))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)


def fresh_chunk(queries: mx.array, fresh: tuple[mx.array, mx.array], start: int, stop: int,
                dtype: mx.Dtype, mask: mx.array | str, scale: float,
                softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """A chunk's ``[L, H, 1, D]`` queries over its own fresh keys and values (rows
    ``start ... stop - 1`` of ``fresh``), cast to the pool's dtype, by MLX's SDPA
    (:func:`vllm_unified.kv.attention.reference.sdpa`, with ``softcap`` and ``sinks``)."""
    keys, values = fresh
    if keys.ndim == 3:
        keys, values = keys[:, :, None], values[:, :, None]
    # [L, H, 1, D] rows -> [1, H, L, D]: the chunk as one sequence.
    q = queries.transpose(2, 1, 0, 3)
    k = keys[start:stop].astype(dtype).transpose(2, 1, 0, 3)
    v = values[start:stop].astype(dtype).transpose(2, 1, 0, 3)
    out = reference.sdpa(q, k, v, scale, mask, softcap, sinks)
    return out.transpose(2, 1, 0, 3)
