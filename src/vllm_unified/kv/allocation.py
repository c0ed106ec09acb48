"""Allocate the KV cache the way vLLM does, without paying for it up front, and hand its bytes to
MLX without a copy.

vLLM's ``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) backs every layer with one
``torch.zeros`` buffer and views it per layer with ``create_kv_cache_views``. On unified memory
the zero fill commits every page of a pool that mostly stays unused. Here the same buffer is a
fresh anonymous private mapping (:func:`aligned_empty`): its pages read as zeros until written
and are committed by the first write to them, so vLLM's need for zeroed blocks
(``KVCacheConfig.needs_kv_cache_zeroing``: Mamba layers, mixed KV precision) is met without a
fill, and the pool stays lazy for hybrid models too. vLLM's own
``create_kv_cache_views`` then makes the per-layer views, so sizes, strides, storage offsets and
dtypes are exactly vLLM's. Never-written memory cannot reach an output: attention only reads
positions below each sequence's length (and the MLX kernel keeps garbage in unread slots out of
the softmax; see ``kv/attention/metadata.py``).

**Memory that is promised, not taken.** Because pages are committed only as blocks are
written, the pool can be larger than the memory the host has free when a long request reaches
it (other processes grew meanwhile, or the budget counted on RAM that is gone). No system call
fails then: on Linux the kernel's OOM killer ends the largest process, the engine, with SIGKILL
(vLLM's API server then fails every request in flight with an error and exits; see
docs/troubleshooting.md), and macOS swaps. :func:`commit_shortfall` says at start-up when the pool
could outgrow what is free; ``VLLM_UNIFIED_KV_EAGER_ZERO=1`` commits the whole pool at start
instead, so a shortage fails start-up rather than a request.

**Alignment.** One buffer serves every unified-memory backend. On Metal, MLX 0.32.4 imports a
CPU tensor without a copy (``mx.from_dlpack(t, copy=False)``, ``python/src/convert.cpp``
``cpu_nd_array_to_mlx_no_copy``) by wrapping the pointer as a shared Metal buffer
(``allocator::make_buffer`` -> ``newBuffer(ptr, size, StorageModeShared, nullptr)`` in
``mlx/backend/metal/allocator.cpp``); Metal refuses a pointer that is not page-aligned, and
``copy=False`` then raises instead of copying. Apple's ``newBufferWithBytesNoCopy`` wants the
memory to be one VM region from ``vm_allocate``/``mmap`` (not ``malloc``). So the buffer is an
``mmap`` of its own, started at a multiple of :data:`PAGE_ALIGN` (16 KiB, Apple Silicon's page)
and rounded up to whole pages; torch views it with ``torch.frombuffer`` at that start, so the
storage begins there (storage offset 0, as vLLM's own buffer) and the mapping is unmapped when
the last tensor or MLX array over it is gone. ``torch.empty`` promises 64-byte alignment only.

**Import granularity** (:func:`import_views`). vLLM's per-layer offsets (``layer l`` at
``offset + l * layer_stride``, a hybrid model's state pages overlaying the attention pages)
need not be page-aligned, so importing each layer's view with ``from_dlpack`` would fail on
Metal for most pool sizes. Instead the buffer is imported in as few page-aligned chunks as the
device allows (one, unless the pool exceeds Metal's ``max_buffer_length``, which ``newBuffer``
cannot wrap in one piece), each as a 2-D int8 array, and every layer's MLX array is a view of
its chunk (reshape, slice, dtype view, reshape: MLX shares the buffer for each on row-contiguous
input, and no intermediate has a dimension above 2**31 - 1, MLX's limit). A view never
straddles two chunks. Each chunk is one buffer in MLX's accounting and residency sets; the
import checks every view's data pointer against torch's (a copy would hide writes).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import torch

from vllm_unified import bridge, compat

#: The layout the MLX attention reads: layer-compact, then block, token, head, channels. One
#: layer's region is then ``[num_blocks * block_size, num_kv_heads, head_size + head_size_v]``
#: slot-major, exactly what ``paged_attention_kv`` takes.
KV_LAYOUT = "LBNHC"

#: Alignment (bytes) of the KV buffer's start and of every chunk MLX imports: Apple Silicon's
#: VM page (what Metal's no-copy buffers need), or the host's page where that is larger.
PAGE_ALIGN = max(16384, mmap.PAGESIZE)

#: MLX's largest dimension (its shapes are int32).
_MAX_DIM = 2**31 - 1


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised int8 ``[nbytes]`` tensor in a fresh anonymous private mapping.

    Its ``data_ptr()`` is a multiple of :data:`PAGE_ALIGN`, its storage starts there (storage
    offset 0) and holds ``nbytes`` rounded up to whole :data:`PAGE_ALIGN` pages (the tail
    belongs to no view). No page is committed until it is written. The mapping lives until the
    last tensor (or MLX array importing it) is gone.

    Raises:
        ValueError: ``nbytes`` is not positive.
        OSError: the mapping cannot be made.
    """
    if nbytes <= 0:
        raise ValueError(f"KV buffer of {nbytes} bytes")
    length = -(-nbytes // PAGE_ALIGN) * PAGE_ALIGN
    # mmap returns host-page-aligned memory; over-map by the difference to reach PAGE_ALIGN
    # (nothing extra on macOS arm64, where the host page is 16 KiB).
    mapping = mmap.mmap(-1, length + PAGE_ALIGN - mmap.PAGESIZE,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(mapping)
    pad = -ctypes.addressof(probe) % PAGE_ALIGN
    del probe  # a live export would keep the mapping from ever being closed
    full = torch.frombuffer(mapping, dtype=torch.int8, count=length, offset=pad)
    return full[:nbytes]


def resident_bytes(buffer: torch.Tensor) -> int:
    """Bytes of ``buffer``'s memory that are resident (committed) now, whole host pages
    counted (``mincore(2)``, Linux and macOS); for a lazy pool, the pages written so far.

    Raises:
        OSError: ``mincore`` fails (``buffer`` not in a mapping).
    """
    page = mmap.PAGESIZE
    start = buffer.data_ptr() // page * page
    end = buffer.data_ptr() + buffer.numel() * buffer.element_size()
    pages = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return sum(b & 1 for b in vec) * page


def commit_shortfall(pool_bytes: int, committed: int, available: int) -> int:
    """Bytes by which committing the rest of a lazy pool (``pool_bytes``, ``committed`` of them
    already) would exceed the host's ``available`` memory, else 0."""
    return max(0, pool_bytes - committed - available)


def allocate_kv_cache(
    kv_cache_config, layout_name: str = KV_LAYOUT, *, zero: bool = False,
    kernel_block_sizes: dict[int, int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The backing buffer and vLLM's per-layer views of it.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig``.
        layout_name: a ``KVCacheLayout`` name (vLLM's resolved layout).
        zero: write the zeros now, committing every page as vLLM's ``torch.zeros`` does
            (benchmarks compare start-up memory with it); not needed for correctness, since
            the fresh mapping reads as zeros (``needs_kv_cache_zeroing`` holds either way).
        kernel_block_sizes: KV-cache group id -> kernel block size ``k`` for attention
            groups whose pages the MLX attention reads as ``B/k`` kernel blocks (vLLM's
            ``create_kv_cache_views(kernel_block_size=k)``: a view of the same bytes).

    Returns:
        ``(buffer, views)``: the int8 buffer (:func:`aligned_empty`: reads as zeros; filled
        and committed when ``zero``) and ``{layer name: view}``, each attention view a
        ``[num_blocks * B/k, num_kv_heads, k, head_size + head_size_v]`` tensor in the spec's
        dtype with vLLM's strides and storage offsets (``k = B`` without a kernel block
        size); each state (Mamba) view vLLM's int8 ``[num_blocks, 1, 1, state_bytes]`` page
        view.

    Raises:
        ValueError: the config's tensors do not share one backing allocation, or a layer has no
            per-layer view.
    """
    tensors = kv_cache_config.kv_cache_tensors
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"KV cache tensors must share one backing allocation, got {sizes}")
    buf = aligned_empty(sizes.pop())
    if zero:
        buf.zero_()
    return buf, kv_cache_views(buf, kv_cache_config, layout_name, kernel_block_sizes)


def kv_cache_views(buf: torch.Tensor, kv_cache_config, layout_name: str = KV_LAYOUT,
                   kernel_block_sizes: dict[int, int] | None = None
                   ) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of ``buf`` for ``kv_cache_config`` (as
    :func:`allocate_kv_cache` returns them; without ``kernel_block_sizes`` the manager-block
    views ``[num_blocks, H, B, C]`` that vLLM hands KV connectors). A group of
    ``UniformTypeKVCacheSpecs`` (layers of one kind with different pages, e.g. the skip layers
    of a quantized cache) views each layer with its own spec, as vLLM's ``allocate_kv_cache``
    does.

    Raises:
        ValueError: a layer has no per-layer view.
    """
    layout = compat.KVCacheLayout[layout_name]
    views: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        gid = next(i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                   if tensor.layers[0] in g.layer_names)
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if per_layer is not None:
            spec = per_layer[tensor.layers[0]]
        if not getattr(spec, "has_layer_views", True):
            raise ValueError(f"layer {tensor.layers[0]} has no per-layer view")
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        kernel = (kernel_block_sizes or {}).get(gid)
        layer_views = compat.create_kv_cache_views(buf, spec, num_blocks, layout, tensor,
                                                   kernel_block_size=kernel)
        views.update(zip(tensor.layers, layer_views, strict=True))
    return views


def slot_major(view: torch.Tensor) -> torch.Tensor:
    """One layer's ``[B, H, N, C]`` view (LBNHC strides) as ``[B * N, H, C]`` rows, no copy.

    Raises:
        ValueError: the view's memory is not block, token, head, channel ordered (another
            layout was resolved).
    """
    rows = view.permute(0, 2, 1, 3)
    if not rows.is_contiguous():
        raise ValueError(
            f"KV view with strides {tuple(view.stride())} is not in {KV_LAYOUT} order"
        )
    return rows.reshape(rows.shape[0] * rows.shape[1], rows.shape[2], rows.shape[3])


@dataclass(frozen=True)
class _Span:
    """Bytes ``start ... end`` of the storage that view ``index`` covers."""

    index: int
    start: int
    end: int


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """An int8 tensor over ``t``'s whole storage (offset 0), sharing it."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage, 0, (storage.nbytes(),), (1,))


def _chunks(spans: list[_Span], size: int, max_chunk: int | None) -> list[tuple[int, int]]:
    """Page-aligned ``(start, end)`` byte ranges of a storage of ``size`` bytes, each at most
    ``max_chunk`` bytes (None: no limit), such that every span lies inside one of them.

    Spans that overlap (a hybrid model's state pages over attention pages) stay together.
    Consecutive chunks may share a page where a boundary between spans is not page-aligned.

    Raises:
        ValueError: overlapping spans that together do not fit ``max_chunk``.
    """
    def floor(x: int) -> int:
        return x // PAGE_ALIGN * PAGE_ALIGN

    def ceil(x: int) -> int:
        return min(-(-x // PAGE_ALIGN) * PAGE_ALIGN, size)

    clusters: list[list[int]] = []  # [start, end] of groups of overlapping spans
    for s in sorted(spans, key=lambda s: s.start):
        if clusters and s.start < clusters[-1][1]:
            clusters[-1][1] = max(clusters[-1][1], s.end)
        else:
            clusters.append([s.start, s.end])
    chunks: list[tuple[int, int]] = []
    for start, end in clusters:
        if max_chunk is not None and ceil(end) - floor(start) > max_chunk:
            raise ValueError(
                f"KV cache views over bytes {start}..{end} ({end - start} bytes) do not fit "
                f"one device buffer of at most {max_chunk} bytes (Metal's max_buffer_length); "
                "lower --gpu-memory-utilization or --kv-cache-memory-bytes")
        if chunks and (max_chunk is None or ceil(end) - chunks[-1][0] <= max_chunk):
            chunks[-1] = (chunks[-1][0], ceil(end))
        else:
            chunks.append((floor(start), ceil(end)))
    return chunks


def import_views(views: Sequence[torch.Tensor], *, max_chunk: int | None = None
                 ) -> list[mx.array]:
    """MLX arrays over the very bytes of row-contiguous CPU tensors, importing each storage
    once (in page-aligned chunks) rather than each tensor.

    Args:
        views: contiguous CPU tensors (e.g. :func:`slot_major` layer views and state page
            rows), possibly overlapping, of dtypes the bridge supports; views of one storage
            are imported together.
        max_chunk: the largest buffer one import may cover (Metal: the device's
            ``max_buffer_length``); None for no limit.

    Returns:
        One array per view, of its shape and dtype, whose data pointer is the view's
        ``data_ptr()``. The arrays keep the storage alive.

    Raises:
        ValueError: a view is not contiguous, is empty, or needs a dimension MLX cannot hold;
            views that do not fit ``max_chunk``.
        RuntimeError: the bridge cannot share the memory (:func:`vllm_unified.bridge.to_mlx`;
            on Metal a chunk start that is not page-aligned), or an MLX view did not keep the
            tensor's bytes.
    """
    out: list[mx.array | None] = [None] * len(views)
    storages: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        if not v.is_contiguous() or v.numel() == 0:
            raise ValueError(f"view {i} {tuple(v.shape)} strides {v.stride()}: import needs "
                             "a non-empty contiguous tensor")
        storages.setdefault(v.untyped_storage().data_ptr(), []).append(i)
    for base_ptr, members in storages.items():
        base = _storage_bytes(views[members[0]])
        spans = [_Span(i, views[i].data_ptr() - base_ptr,
                       views[i].data_ptr() - base_ptr + views[i].numel()
                       * views[i].element_size()) for i in members]
        for (start, end) in _chunks(spans, base.numel(), max_chunk):
            length = end - start
            row = math.gcd(length, PAGE_ALIGN)
            if length // row > _MAX_DIM:
                raise ValueError(f"a {length}-byte chunk cannot be an MLX array of "
                                 f"{row}-byte rows")
            chunk = bridge.to_mlx(base[start:end].view(length // row, row))
            for s in spans:
                if s.start >= start and s.end <= end and out[s.index] is None:
                    out[s.index] = _view_of(chunk, length, row, s.start - start, views[s.index])
    mx.eval(out)
    for i, (arr, v) in enumerate(zip(out, views, strict=True)):
        if bridge.data_ptr(arr) != v.data_ptr():
            raise RuntimeError(f"view {i}: the MLX array does not share the tensor's bytes "
                               "(MLX copied it)")
    return out


def _view_of(chunk: mx.array, length: int, row: int, offset: int, v: torch.Tensor) -> mx.array:
    """The bytes ``offset ... offset + v.nbytes`` of ``chunk`` (``length`` bytes as
    ``[length / row, row]`` int8) as an array of ``v``'s shape and dtype, sharing them."""
    nbytes = v.numel() * v.element_size()
    width = math.gcd(row, offset, nbytes)
    if width % v.element_size() or length // width > _MAX_DIM:
        raise ValueError(f"a view of {nbytes} bytes at offset {offset} cannot be cut from an "
                         "MLX array without a dimension above 2**31 - 1")
    rows = chunk.reshape(length // width, width)[offset // width:(offset + nbytes) // width]
    return rows.view(bridge.mlx_dtype(v.dtype)).reshape(tuple(v.shape))
