"""The paged KV pool of all attention layers as MLX arrays, and the ways rows go into it.

How the pool is owned and written is the backend profile's decision
(:class:`vllm_unified.backend.BackendProfile`): a torch buffer in vLLM's layout that MLX adopts
(written by the native ``write_rows`` on the CPU, by the in-place Metal kernel on Metal), or
MLX-owned arrays (written by the in-place CUDA kernel, or MLX's donated scatter).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified import backend, bridge
from vllm_unified.backend import KVWritePath
from vllm_unified.kv.allocation import import_views, resident_bytes, slot_major
from vllm_unified.kv.attention.qk_prologue import QKPrologue
from vllm_unified.kv.gpu import quant_write as gpu_quant_write
from vllm_unified.kv.gpu import write as gpu_write
from vllm_unified.kv.gpu.write import write_kv_gpu, write_kv_qk_gpu
from vllm_unified.kv.quant import KVFormat, rht_signs

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

    * :meth:`from_torch_views` (MLX's CPU and Metal backends): vLLM-layout torch views of a
      buffer allocated by :func:`vllm_unified.kv.allocation.allocate_kv_cache`, imported into
      MLX without a copy (:func:`vllm_unified.kv.allocation.import_views`). MLX never writes
      adopted memory itself (a slice write would fork the whole pool silently), so rows go in
      in place: the native ``write_rows`` primitive on the CPU, a Metal kernel writing into its
      pool input on Metal (:func:`vllm_unified.kv.gpu.write.write_kv_gpu`).
    * :meth:`allocate_mlx` (CUDA, the profiling forward, or the CPU without the native
      bridge): MLX owns the arrays and this object alone refers to them, so the scatter that
      writes rows reuses ("donates") the buffer. On the CPU backend the zero fill's pages are
      handed back to the OS. MLX's CUDA scatter copies the whole pool instead, so there rows go
      in through a small CUDA kernel that writes into the pool's buffer
      (:mod:`vllm_unified.kv.gpu.write`).

    ``write`` names the write path (:data:`vllm_unified.backend.KVWritePath`). ``kv`` holds the
    cache's current arrays: a write rebinds its entry to the written array (the same buffer),
    so later readers are ordered after the write.

    ``fmt``: a quantized KV format (:mod:`vllm_unified.kv.quant`) makes ``kv[l]`` vLLM's
    quantized page bytes ``[slots, Hkv, cell bytes]`` (int8 / uint8), written in place by the
    quantizing write of the write path (``native_rows``: the native ``write_kv_quant``, MLX's
    CPU backend; ``metal_kernel`` / ``cuda_kernel``: the GPU kernel of
    :mod:`vllm_unified.kv.gpu.quant_write`) and read by the paged attention of the backend;
    ``head_size`` is then required.

    ``layer_formats``: one format per layer where they differ (the layers of
    ``--kv-cache-dtype-skip-layers`` keep the model dtype, ``auto``, next to quantized ones,
    each layer written and attended by its format's kernels); default ``fmt`` for every
    layer. :attr:`fmt` is then the pool's quantized format (``auto`` if none).

    ``latent_layers``: the layers that hold vLLM's MLA pages, ``[slots, 1, W]`` with one
    latent row per token (no K|V halves), written by :meth:`write_latent` in the model dtype.

    Raises:
        ValueError: a shared pool with a write path that would not write in place
            (``scatter``, ``cuda_kernel``); a quantized format on the ``scatter`` path or
            without ``head_size``; ``layer_formats`` not one per layer.
    """

    def __init__(self, kv: list[mx.array], block_size: int, *, shared: bool,
                 torch_views: list | None = None, buffer: object = None,
                 write: KVWritePath | None = None, fmt: KVFormat | None = None,
                 head_size: int | None = None,
                 layer_formats: list[KVFormat] | None = None,
                 latent_layers: frozenset[int] = frozenset()) -> None:
        if layer_formats is not None:
            if len(layer_formats) != len(kv):
                raise ValueError(f"{len(layer_formats)} layer formats for {len(kv)} layers")
            fmt = next((f for f in layer_formats if f.quantized), KVFormat())
        fmt = fmt or KVFormat()
        write = write or ("native_rows" if shared or fmt.quantized else "scatter")
        if shared and write not in ("native_rows", "metal_kernel"):
            raise ValueError(f"a KV pool shared with torch cannot be written by {write}: "
                             "only native_rows / metal_kernel write it in place")
        if fmt.quantized and (write == "scatter" or head_size is None):
            raise ValueError(f"--kv-cache-dtype {fmt.name}: the quantized KV pool is written "
                             "by a quantizing kernel (the native CPU one, or the Metal / CUDA "
                             f"one); write path {write}, head size {head_size}")
        #: the pages' format (the model dtype unless --kv-cache-dtype quantizes)
        self.fmt = fmt
        #: each layer's format (the model dtype on the skip layers)
        self.layer_formats = list(layer_formats) if layer_formats is not None \
            else [fmt] * len(kv)
        self.head_size = head_size
        #: vLLM's RHT signs (int4), an input of the write and the attention
        self.signs = rht_signs(head_size) if fmt.rotated else None
        self.kv = kv
        self.block_size = block_size
        # no layers: an attention-free model's (its state pages live elsewhere)
        self.num_blocks = kv[0].shape[0] // block_size if kv else 0
        self.shared = shared
        self.torch_views = torch_views
        self._buffer = buffer  # keeps a torch-owned backing buffer alive
        #: how rows go into the pool
        self.write_path: KVWritePath = write
        #: the layers holding MLA pages (one latent row per token)
        self.latent_layers = frozenset(latent_layers)
        if fmt.quantized and self.latent_layers:
            raise ValueError(f"--kv-cache-dtype {fmt.name}: MLA pages keep the model dtype")

    @property
    def cuda_write(self) -> bool:
        """Rows go in through the in-place CUDA kernel (MLX-owned pool on CUDA)."""
        return self.write_path == "cuda_kernel"

    @cuda_write.setter
    def cuda_write(self, on: bool) -> None:
        if self.shared:
            raise ValueError("a KV pool shared with torch is not written by the CUDA kernel")
        self.write_path = "cuda_kernel" if on else "scatter"

    @classmethod
    def allocate_mlx(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, dtype: mx.Dtype, cuda_write: bool | None = None,
        write: KVWritePath | None = None, fmt: KVFormat | None = None,
        layer_formats: list[KVFormat] | None = None,
        layer_shapes: list[tuple[int, int]] | None = None,
    ) -> KVPool:
        """MLX-owned pool, one array per layer, zero-filled then handed back page by page.

        ``write``: the write path (``scatter``, or an in-place kernel: ``cuda_kernel``,
        ``metal_kernel``, ``native_rows``). Without it, ``cuda_write`` picks the CUDA kernel or
        the scatter; with neither, the backend profile's ``kv_write`` decides (the CUDA kernel
        where it says so, else the scatter). A quantized ``fmt`` holds its cells as uint8
        bytes, written by the GPU quantizing kernel of ``write`` (``cuda_kernel``,
        ``metal_kernel``; or ``cuda_write``), else by the native quantizing write;
        ``layer_formats``: one format per layer where they differ (the skip layers in the
        model dtype); ``layer_shapes``: ``(num_kv_heads, head_dim)`` per layer where they
        differ (unquantized only).

        Raises:
            ValueError: ``layer_shapes`` with a quantized format, or not one per layer."""
        if layer_formats is not None:
            fmt = next((f for f in layer_formats if f.quantized), KVFormat())
        fmt = fmt or KVFormat()
        shape = dense_shape = (num_blocks * block_size, num_kv_heads, 2 * head_dim)
        dense_dtype = dtype
        if fmt.quantized:
            shape, dtype = shape[:2] + (fmt.cell_bytes(head_dim),), mx.uint8
            if write not in ("cuda_kernel", "metal_kernel"):
                write = "cuda_kernel" if cuda_write else "native_rows"
        formats = layer_formats or [fmt] * num_layers
        if layer_shapes is not None and (fmt.quantized or len(layer_shapes) != num_layers):
            raise ValueError(f"{len(layer_shapes)} per-layer KV shapes for {num_layers} layers "
                             f"in format {fmt.name}: one per layer, unquantized only")
        kv = []
        # One array at a time: MLX's zero fill commits every page it writes, so hand the pages
        # back before allocating the next one; start-up RSS then stays flat.
        for j, f in enumerate(formats):
            if layer_shapes is not None:
                heads, dim = layer_shapes[j]
                shape = (num_blocks * block_size, heads, 2 * dim)
            arr = mx.zeros(shape if f.quantized or not fmt.quantized else dense_shape,
                           dtype=dtype if f.quantized or not fmt.quantized else dense_dtype)
            mx.eval(arr)
            release_zero_pages(arr)
            kv.append(arr)
        if write is None:
            if cuda_write is None:
                cuda_write = backend.profile().kv_write == "cuda_kernel"
            write = "cuda_kernel" if cuda_write else "scatter"
        return cls(kv, block_size, shared=False, write=write, fmt=fmt, head_size=head_dim,
                   layer_formats=layer_formats)

    @classmethod
    def allocate_latent_mlx(cls, num_layers: int, num_blocks: int, block_size: int,
                            width: int, dtype: mx.Dtype, write: KVWritePath = "scatter"
                            ) -> KVPool:
        """MLX-owned MLA pool: ``num_layers`` arrays ``[num_blocks * block_size, 1, width]``
        (:meth:`write_latent`'s rows), zero-filled then handed back page by page as
        :meth:`allocate_mlx`; ``write``: ``scatter`` or an in-place GPU kernel."""
        kv = []
        for _ in range(num_layers):
            arr = mx.zeros((num_blocks * block_size, 1, width), dtype=dtype)
            mx.eval(arr)
            release_zero_pages(arr)
            kv.append(arr)
        return cls(kv, block_size, shared=False, write=write,
                   latent_layers=frozenset(range(num_layers)))

    def write_latent(self, layer: int, slot_mapping: mx.array, rows: mx.array,
                     arrays: list[mx.array] | None = None) -> mx.array | None:
        """Write MLA rows ``[T, 1, W]`` (or ``[T, W]``) at ``slot_mapping`` ``[T]`` into
        latent layer ``layer``, in place on the pool's write path (lazily), cast to the pool's
        dtype. ``arrays`` and the result as :meth:`write`.

        Raises:
            ValueError: ``layer`` is not a latent layer, or the rows do not fit its pages.
        """
        kv = self.kv if arrays is None else arrays
        dst = kv[layer]
        if layer not in self.latent_layers:
            raise ValueError(f"layer {layer} holds K|V pages, not MLA rows")
        if rows.ndim == 2:
            rows = rows[:, None]
        if rows.shape[1:] != dst.shape[1:]:
            raise ValueError(f"MLA rows {rows.shape} do not fit pages {dst.shape}")
        if rows.dtype != dst.dtype:
            rows = rows.astype(dst.dtype)
        if self.write_path in ("cuda_kernel", "metal_kernel"):
            tokens: list[mx.array] = []
            kv[layer] = gpu_write.write_rows_gpu(dst, slot_mapping, rows,
                                                 dialect=self._dialect(), tokens=tokens)
            return tokens[0] if tokens else None
        if self.write_path == "native_rows":
            kv[layer] = bridge.write_rows(dst, slot_mapping, rows)
            return None
        dst[slot_mapping] = rows  # rebinds kv[layer] in place: MLX donates the buffer
        kv[layer] = dst
        return None

    @classmethod
    def from_torch_views(cls, views: list, block_size: int, buffer: object = None, *,
                         write: KVWritePath = "native_rows", max_chunk: int | None = None,
                         fmt: KVFormat | None = None, head_size: int | None = None,
                         layer_formats: list[KVFormat] | None = None) -> KVPool:
        """Import vLLM-layout torch views (``[B, H, N, C]``, LBNHC strides, one per layer, in
        model layer order) as MLX arrays sharing their bytes.

        Args:
            buffer: the backing buffer, kept alive with the pool.
            write: ``native_rows`` (CPU) or ``metal_kernel`` (Metal).
            max_chunk: the largest buffer MLX may wrap at once
                (:func:`vllm_unified.kv.allocation.import_views`).

        Raises:
            RuntimeError: the bridge cannot share the memory (:mod:`vllm_unified.bridge`).
            ValueError: a view is not in LBNHC order; a write path that is not in place.
        """
        kv = import_views([slot_major(v) for v in views], max_chunk=max_chunk)
        return cls(kv, block_size, shared=True, torch_views=list(views), buffer=buffer,
                   write=write, fmt=fmt, head_size=head_size, layer_formats=layer_formats)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kv)

    @property
    def backing_buffer(self) -> Any:
        """The shared pool's int8 backing buffer (a mapping of ours), None when MLX owns it."""
        return self._buffer

    def resident_bytes(self) -> int | None:
        """Bytes of the shared pool's buffer committed to memory now (its pages written so
        far); None for an MLX-owned pool (not a mapping of ours)."""
        return None if self._buffer is None else resident_bytes(self._buffer)

    def arrays(self) -> list[mx.array]:
        """The per-layer arrays, to evaluate together with a step's outputs."""
        return self.kv

    def write(self, layer: int, slot_mapping: mx.array, keys: mx.array, values: mx.array,
              arrays: list[mx.array] | None = None, prologue: QKPrologue | None = None,
              positions: mx.array | None = None) -> mx.array | None:
        """Write ``keys``/``values`` (``[T, Hkv, D]`` or ``[T, Hkv, 1, D]``) at ``slot_mapping``
        ``[T]`` into layer ``layer``, in place (lazily; evaluated with the step).

        ``arrays``: the per-layer arrays to write and rebind (a compiled trace's inputs);
        default: this pool's own :attr:`kv`. ``prologue`` (with ``positions`` ``[T]``): the
        keys are raw projections (any shape of ``[T, Hkv * D]`` rows) that the GPU write
        kernel normalises and rotates first (:func:`vllm_unified.kv.gpu.write.
        write_kv_qk_gpu`).

        Returns:
            A GPU kernel write's completion token, which a GPU kernel reading the layer in
            the same evaluation must take as an input
            (:func:`vllm_unified.kv.gpu.write.ordered_after`); None for the other paths.

        Raises:
            ValueError: a ``prologue`` where the layer is not written by a GPU kernel in its
                own dtype (a quantized layer, another write path).
        """
        kv = self.kv if arrays is None else arrays
        dst = kv[layer]
        fmt = self.layer_formats[layer]
        if prologue is not None:
            if (fmt.quantized or self.write_path not in ("cuda_kernel", "metal_kernel")
                    or positions is None):
                raise ValueError(f"layer {layer}: the key prologue needs an unquantized "
                                 "layer written by a GPU kernel, and the positions")
            tokens: list[mx.array] = []
            kv[layer] = write_kv_qk_gpu(dst, slot_mapping, keys, values, positions, prologue,
                                        dialect=self._dialect(), tokens=tokens)
            return tokens[0] if tokens else None
        if fmt.quantized and self.write_path in ("cuda_kernel", "metal_kernel"):
            tokens = []
            kv[layer] = gpu_quant_write.write_kv_quant_gpu(
                dst, slot_mapping, keys, values, fmt, self.signs, dialect=self._dialect(),
                tokens=tokens)
            return tokens[0] if tokens else None
        if fmt.quantized:
            if keys.ndim == 4:
                keys, values = keys.squeeze(2), values.squeeze(2)
            native = bridge.native_kernels()
            if native is None:
                raise RuntimeError(f"--kv-cache-dtype {fmt.name} needs the native CPU "
                                   "extension (see bridge.native_error)")
            kv[layer] = native.write_kv_quant(dst, slot_mapping, keys, values,
                                              fmt.native_mode, self.signs)
            return
        if keys.dtype != dst.dtype:
            keys, values = keys.astype(dst.dtype), values.astype(dst.dtype)
        if self.write_path in ("cuda_kernel", "metal_kernel"):
            # K and V side by side by the kernel itself: no concatenation.
            tokens = []
            kv[layer] = write_kv_gpu(dst, slot_mapping, keys, values, dialect=self._dialect(),
                                     tokens=tokens)
            return tokens[0] if tokens else None
        if self.write_path == "native_rows":
            # K and V side by side by the kernel itself: no squeeze or concatenation nodes
            kv[layer] = bridge.write_kv(dst, slot_mapping, keys, values)
            return
        if keys.ndim == 4:
            keys, values = keys.squeeze(2), values.squeeze(2)
        # rebinds kv[layer] in place: MLX donates the buffer
        dst[slot_mapping] = mx.concatenate([keys, values], axis=-1)

    def _dialect(self) -> str:
        """The GPU dialect of the write path (``cuda_kernel`` / ``metal_kernel``)."""
        return "cuda" if self.write_path == "cuda_kernel" else "metal"

    def layer_format(self, layer: int) -> KVFormat:
        """The format of layer ``layer``'s pages."""
        return self.layer_formats[layer]

    def data_ptrs(self) -> list[int]:
        """Addresses of every layer's buffer (for checks that writes stay in place).

        Takes a transient view per array (released before returning), so it does not hold
        references that would stop the next write from reusing the buffer.
        """
        return [bridge.data_ptr(a) for a in self.kv]

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero whole blocks (vLLM's ``new_block_ids_to_zero``), in place (through
        :meth:`write`, so on the pool's write path)."""
        if not block_ids:
            return
        slots = (mx.array(block_ids, dtype=mx.int32)[:, None] * self.block_size
                 + mx.arange(self.block_size, dtype=mx.int32)[None]).reshape(-1)
        gpu = self.write_path in ("cuda_kernel", "metal_kernel")
        for layer, arr in enumerate(self.kv):
            if layer in self.latent_layers:
                self.write_latent(layer, slots, mx.zeros((slots.size, *arr.shape[1:]),
                                                         dtype=arr.dtype))
                continue
            if self.layer_formats[layer].quantized:  # zero bytes, as vLLM zeroes its pages
                rows = mx.zeros((slots.size, *arr.shape[1:]), dtype=arr.dtype)
                self.kv[layer] = (gpu_write.write_rows_gpu(arr, slots, rows,
                                                           dialect=self._dialect())
                                  if gpu else bridge.write_rows(arr, slots, rows))
                continue
            half = arr.shape[-1] // 2
            zeros = mx.zeros((slots.size, arr.shape[1], half), dtype=arr.dtype)
            self.write(layer, slots, zeros, zeros)
        mx.eval(self.kv)
