"""Route mlx-lm's attention to the paged KV cache.

mlx-lm's model files stay untouched. Each step the runner lays out every scheduled token as its
own batch row (``inputs`` of shape ``[T, 1]``) and hands the model one :class:`PagedLayerCache`
per layer. Through mlx-lm's cache protocol that gives us:

* ``cache.offset`` -> a ``[T]`` array of token positions, so RoPE rotates each row by its own
  position (``mx.fast.rope`` accepts one offset per batch row);
* ``cache.update_and_fetch(k, v)`` -> writes the new K/V rows into the pool by slot mapping;
* ``cache.make_mask(...)`` -> a :class:`PagedMask` marker carrying the sliding window, if any.

The attention itself is reached by replacing the ``scaled_dot_product_attention`` name that
each mlx-lm model module imports from ``mlx_lm.models.base``: for a :class:`PagedLayerCache`
it runs :func:`vllm_unified.attention.paged.paged_attention_kv` over the block tables; for any other
cache it calls mlx-lm's original function, so plain mlx-lm use in the same process is unchanged.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import numpy as np

from vllm_unified.attention.gpu_write import write_kv_cuda
from vllm_unified.attention.metadata import AttentionMetadata
from vllm_unified.attention.paged import paged_attention_kv

_original_sdpa = mlx_base.scaled_dot_product_attention


_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def release_zero_pages(arr: mx.array) -> int:
    """Return the whole pages inside a freshly zeroed, evaluated MLX array to the OS.

    Linux and MLX's CPU backend only (elsewhere returns 0). ``madvise(MADV_DONTNEED)`` on
    private anonymous memory makes the next read of a page see zeros and the next write commit
    a fresh page, so the contents are unchanged (the array must hold zeros) while its resident
    size drops to the partial pages at its ends. The buffer and its address stay the same, so
    MLX keeps writing into it in place. Measured in the zero-copy spike
    (notes/zero-copy-spike.md, "No-native fallback").

    Returns:
        Bytes released.

    Raises:
        OSError: ``madvise`` failed.
    """
    # Only MLX's CPU backend keeps arrays in ordinary malloc'd host memory; Metal and CUDA
    # buffers belong to their drivers.
    on_cpu = mx.default_device() == mx.cpu
    if not (sys.platform.startswith("linux") and on_cpu) or arr.nbytes < 2 * mmap.PAGESIZE:
        return 0
    view = arr.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[arr.dtype.size])
    start = int(np.asarray(view).ctypes.data)
    del view
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + arr.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED):
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) on the KV pool failed: {os.strerror(err)}")
    return last - first


class KVPool:
    """The paged KV cache of all layers, as MLX arrays.

    ``kv[l]`` has shape ``[num_blocks * block_size, num_kv_heads, 2 * head_dim]`` in the model's
    compute dtype: slot-major (slot = block_id * block_size + offset; vLLM's block ids index it
    directly), each (slot, head) cell holding the key followed by the value, i.e. vLLM's
    attention page ``[B, H, N, C]`` in its LBNHC layout. Two ways to own the bytes:

    * :meth:`from_torch_views` (MLX's CPU backend): vLLM-layout torch views of a buffer
      allocated by :func:`vllm_unified.memory.kv_allocation.allocate_kv_cache`, adopted into MLX
      without a copy. MLX never writes adopted memory itself (a slice write would fork the whole
      pool silently), so rows go in through the native ``write_rows`` primitive.
    * :meth:`allocate_mlx` (Metal/CUDA, or without the native bridge): MLX owns the arrays and
      this object alone refers to them, so the scatter that writes rows reuses ("donates") the
      buffer. On the CPU backend the zero fill's pages are handed back to the OS. MLX's CUDA
      scatter copies the whole pool instead, so there rows go in through a small CUDA kernel
      that writes into the pool's buffer (:mod:`vllm_unified.attention.gpu_write`).
    """

    def __init__(self, kv: list[mx.array], block_size: int, *, shared: bool,
                 torch_views: list | None = None, buffer: object = None) -> None:
        self.kv = kv
        self.block_size = block_size
        self.num_blocks = kv[0].shape[0] // block_size
        self.shared = shared
        self.torch_views = torch_views
        self._buffer = buffer  # keeps a torch-owned backing buffer alive
        self.released_bytes = 0
        self.meta: AttentionMetadata | None = None
        #: write rows with the in-place CUDA kernel (MLX-owned pool on the CUDA backend)
        self.cuda_write = False

    @classmethod
    def allocate_mlx(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, dtype: mx.Dtype,
    ) -> KVPool:
        """MLX-owned pool, one array per layer, zero-filled then handed back page by page."""
        shape = (num_blocks * block_size, num_kv_heads, 2 * head_dim)
        kv, released = [], 0
        # One array at a time: MLX's zero fill commits every page it writes, so hand the pages
        # back before allocating the next one; start-up RSS then stays flat.
        for _ in range(num_layers):
            arr = mx.zeros(shape, dtype=dtype)
            mx.eval(arr)
            released += release_zero_pages(arr)
            kv.append(arr)
        pool = cls(kv, block_size, shared=False)
        pool.released_bytes = released
        from vllm_unified.backend import detect_backend

        pool.cuda_write = detect_backend().kind == "cuda"
        return pool

    @classmethod
    def from_torch_views(cls, views: list, block_size: int, buffer: object = None) -> KVPool:
        """Adopt vLLM-layout torch views (``[B, H, N, C]``, LBNHC strides, one per layer, in
        model layer order) as MLX arrays sharing their bytes.

        Raises:
            RuntimeError: the native bridge is unavailable (``vllm_unified.bridge``).
            ValueError: a view is not in LBNHC order.
        """
        from vllm_unified.bridge import to_mlx
        from vllm_unified.memory.kv_allocation import slot_major

        kv = [to_mlx(slot_major(v)) for v in views]
        return cls(kv, block_size, shared=True, torch_views=list(views), buffer=buffer)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kv)

    def arrays(self) -> list[mx.array]:
        """The per-layer arrays, to evaluate together with a step's outputs."""
        return self.kv

    def write(self, layer: int, slot_mapping: mx.array, keys: mx.array, values: mx.array) -> None:
        """Write ``keys``/``values`` (``[T, Hkv, D]`` or ``[T, Hkv, 1, D]``) at ``slot_mapping``
        ``[T]`` into layer ``layer``, in place (lazily; evaluated with the step)."""
        dst = self.kv[layer]
        if keys.dtype != dst.dtype:
            keys, values = keys.astype(dst.dtype), values.astype(dst.dtype)
        if self.cuda_write:  # K and V side by side by the kernel itself: no concatenation
            self.kv[layer] = write_kv_cuda(dst, slot_mapping, keys, values)
            return
        if keys.ndim == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        rows = mx.concatenate([keys, values], axis=-1)
        if self.shared:
            from vllm_unified.bridge import write_rows

            self.kv[layer] = write_rows(dst, slot_mapping, rows)
        else:
            dst[slot_mapping] = rows  # rebinds self.kv[layer]: MLX donates the buffer

    def data_ptrs(self) -> list[int]:
        """Addresses of every layer's buffer (for checks that writes stay in place).

        Takes a transient NumPy view per array (released before returning), so it does not
        hold references that would stop the next write from reusing the buffer.
        """
        if self.shared:
            from vllm_unified.bridge import data_ptr

            return [data_ptr(a) for a in self.kv]
        ptrs = []
        for a in self.kv:
            as_uint = a.view({2: mx.uint16, 4: mx.uint32}[a.dtype.size])
            ptrs.append(int(np.asarray(as_uint).ctypes.data))
            del as_uint
        return ptrs

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero whole blocks (vLLM's ``new_block_ids_to_zero``), in place."""
        if not block_ids:
            return
        slots = (mx.array(block_ids, dtype=mx.int32)[:, None] * self.block_size
                 + mx.arange(self.block_size, dtype=mx.int32)[None]).reshape(-1)
        for layer, arr in enumerate(self.kv):
            half = arr.shape[-1] // 2
            zeros = mx.zeros((slots.size, arr.shape[1], half), dtype=arr.dtype)
            self.write(layer, slots, zeros, zeros)
        mx.eval(self.kv)


@dataclass(frozen=True)
class PagedMask:
    """Stands in for mlx-lm's mask: the paged kernel builds masks from the metadata itself.

    Attributes:
        window: sliding-window size in tokens, or None for full causal attention.
    """

    window: int | None = None


class PagedLayerCache:
    """mlx-lm cache protocol for one layer, backed by :class:`KVPool`."""

    def __init__(self, pool: KVPool, layer: int) -> None:
        self.pool = pool
        self.layer = layer

    @property
    def _meta(self) -> AttentionMetadata:
        meta = self.pool.meta
        if meta is None:
            raise RuntimeError("PagedLayerCache used outside a step (no attention metadata)")
        return meta

    @property
    def offset(self) -> mx.array:
        """``[T]`` int32 positions: mlx-lm passes this to RoPE as per-row offsets."""
        return self._meta.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` (``[T, Hkv, 1, D]``, post-RoPE) at the step's slot mapping.

        Returns the inputs unchanged; attention reads the context from the pool.
        """
        self.pool.write(self.layer, self._meta.slot_mapping, keys, values)
        return keys, values

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None  # noqa: N803
    ) -> PagedMask:
        if return_array:
            raise NotImplementedError("paged attention does not materialise dense masks")
        return PagedMask(window_size)

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> Any:
        raise NotImplementedError("the paged cache state lives in the KV pool")


def _paged_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    if not isinstance(cache, PagedLayerCache):
        return _original_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    if sinks is not None:
        raise NotImplementedError("attention sinks are not supported by the paged kernel yet")
    window = mask.window if isinstance(mask, PagedMask) else None
    if mask is not None and not isinstance(mask, PagedMask):
        raise TypeError(f"unexpected attention mask {type(mask).__name__} with a paged cache")
    pool = cache.pool
    return paged_attention_kv(
        queries, pool.kv[cache.layer], cache._meta, scale, window
    )


def install_paged_attention(model: Any, recurrent: Collection[int] = ()) -> list[str]:
    """Point ``scaled_dot_product_attention`` of every module that defines a layer of ``model``
    at the paged router (an architecture built from another's layers is covered too).

    ``recurrent``: indices of state-space layers (hybrid models), which have no attention.
    Idempotent. Returns the names of the modules patched, for the log.
    """
    patched = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is _original_sdpa:
            module.scaled_dot_product_attention = _paged_sdpa
            patched.append(name)
    for i, layer in enumerate(model.layers):
        if i in recurrent:
            continue
        attn = getattr(layer, "self_attn", None)
        module = sys.modules.get(type(attn).__module__) if attn is not None else None
        if getattr(module, "scaled_dot_product_attention", None) is not _paged_sdpa:
            raise ValueError(
                f"layer {i} ({type(layer).__name__}) does not compute attention through mlx-lm's "
                "scaled_dot_product_attention, so it cannot be routed to the paged KV cache"
            )
    return patched
