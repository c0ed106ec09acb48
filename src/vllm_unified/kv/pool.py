"""The paged KV pool of all attention layers as MLX arrays, and the ways rows go into it.

How the pool is owned and written is the backend profile's decision
(:class:`vllm_unified.backend.BackendProfile`): a torch buffer in vLLM's layout that MLX adopts
(written by the native ``write_rows``), or MLX-owned arrays (written by the in-place CUDA
kernel, or MLX's donated scatter).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import mlx.core as mx
import numpy as np

from vllm_unified.kv.gpu_write import write_kv_gpu

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def release_zero_pages(arr: mx.array) -> int:
    """Return the whole pages inside a freshly zeroed, evaluated MLX array to the OS.

    Linux and MLX's CPU backend only (elsewhere returns 0). ``madvise(MADV_DONTNEED)`` on
    private anonymous memory makes the next read of a page see zeros and the next write commit
    a fresh page, so the contents are unchanged (the array must hold zeros) while its resident
    size drops to the partial pages at its ends. The buffer and its address stay the same, so
    MLX keeps writing into it in place.

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
      allocated by :func:`vllm_unified.kv.allocation.allocate_kv_cache`, adopted into MLX
      without a copy. MLX never writes adopted memory itself (a slice write would fork the whole
      pool silently), so rows go in through the native ``write_rows`` primitive.
    * :meth:`allocate_mlx` (Metal/CUDA, or without the native bridge): MLX owns the arrays and
      this object alone refers to them, so the scatter that writes rows reuses ("donates") the
      buffer. On the CPU backend the zero fill's pages are handed back to the OS. MLX's CUDA
      scatter copies the whole pool instead, so there rows go in through a small CUDA kernel
      that writes into the pool's buffer (:mod:`vllm_unified.kv.gpu_write`).

    ``kv`` holds the cache's current arrays: a write rebinds its entry to the written array
    (the same buffer), so later readers are ordered after the write.
    """

    def __init__(self, kv: list[mx.array], block_size: int, *, shared: bool,
                 torch_views: list | None = None, buffer: object = None) -> None:
        self.kv = kv
        self.block_size = block_size
        self.num_blocks = kv[0].shape[0] // block_size
        self.shared = shared
        self.torch_views = torch_views
        self._buffer = buffer  # keeps a torch-owned backing buffer alive
        #: write rows with the in-place CUDA kernel (MLX-owned pool on the CUDA backend)
        self.cuda_write = False

    @classmethod
    def allocate_mlx(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, dtype: mx.Dtype, cuda_write: bool | None = None,
    ) -> KVPool:
        """MLX-owned pool, one array per layer, zero-filled then handed back page by page.

        ``cuda_write``: write rows with the in-place CUDA kernel; None: as the backend profile
        says (``kv_write == "cuda_kernel"``)."""
        shape = (num_blocks * block_size, num_kv_heads, 2 * head_dim)
        kv = []
        # One array at a time: MLX's zero fill commits every page it writes, so hand the pages
        # back before allocating the next one; start-up RSS then stays flat.
        for _ in range(num_layers):
            arr = mx.zeros(shape, dtype=dtype)
            mx.eval(arr)
            release_zero_pages(arr)
            kv.append(arr)
        pool = cls(kv, block_size, shared=False)
        if cuda_write is None:
            from vllm_unified.backend import profile

            cuda_write = profile().kv_write == "cuda_kernel"
        pool.cuda_write = cuda_write
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
        from vllm_unified.kv.allocation import slot_major

        kv = [to_mlx(slot_major(v)) for v in views]
        return cls(kv, block_size, shared=True, torch_views=list(views), buffer=buffer)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kv)

    def arrays(self) -> list[mx.array]:
        """The per-layer arrays, to evaluate together with a step's outputs."""
        return self.kv

    def write(self, layer: int, slot_mapping: mx.array, keys: mx.array, values: mx.array,
              arrays: list[mx.array] | None = None) -> None:
        """Write ``keys``/``values`` (``[T, Hkv, D]`` or ``[T, Hkv, 1, D]``) at ``slot_mapping``
        ``[T]`` into layer ``layer``, in place (lazily; evaluated with the step).

        ``arrays``: the per-layer arrays to write and rebind (a compiled trace's inputs);
        default: this pool's own :attr:`kv`."""
        kv = self.kv if arrays is None else arrays
        dst = kv[layer]
        if keys.dtype != dst.dtype:
            keys, values = keys.astype(dst.dtype), values.astype(dst.dtype)
        if self.cuda_write:  # K and V side by side by the kernel itself: no concatenation
            kv[layer] = write_kv_gpu(dst, slot_mapping, keys, values, dialect="cuda")
            return
        if keys.ndim == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        rows = mx.concatenate([keys, values], axis=-1)
        if self.shared:
            from vllm_unified.bridge import write_rows

            kv[layer] = write_rows(dst, slot_mapping, rows)
        else:
            dst[slot_mapping] = rows  # rebinds kv[layer] in place: MLX donates the buffer

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
