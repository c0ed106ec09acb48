"""Zero-copy conversion between torch tensors and MLX arrays.

vLLM hands tensors around in torch; the model computes in MLX. Crossing must not copy bytes where
the backend can share them, because a silent copy hides writes from the other side. So:

* :func:`to_torch` (MLX -> torch) and :func:`to_mlx` (torch -> MLX) return a **view of the same
  bytes** (same data pointer), or raise :class:`RuntimeError` when sharing is impossible. They copy
  only when the caller passes ``copy=True``, and then always (a fresh, unshared buffer).
* :func:`write_rows` is the one way MLX code may *write* into a shared buffer. MLX's own updates
  (``a[idx] = v``, ``mx.slice_update``, ``.at[].add``) never write into memory MLX does not own, or
  into a buffer that a torch view holds: they silently allocate a new buffer and copy the whole
  array, and torch never sees the write (docs/dev/architecture.md, "KV writes stay in place").

What each backend can share (MLX 0.32.4, torch 2.13):

============  ==========================================  =======================================
backend       torch -> MLX                                MLX -> torch
============  ==========================================  =======================================
CPU (Linux)   native ``adopt`` (vllm-unified-native)       native DLPack export (or MLX's own)
Metal         ``mx.from_dlpack(t, copy=False)``            DLPack
CUDA          impossible: raises unless ``copy=True``      impossible: raises unless ``copy=True``
============  ==========================================  =======================================

MLX 0.32.4 refuses a no-copy import of CPU memory ("Cannot import a CPU array without a copy"), so
on the CPU backend torch -> MLX goes through the small native extension in ``native/`` (built by
``scripts/setup.sh`` against the installed MLX): it wraps the tensor's memory as an MLX array that
MLX's allocator does not own and keeps the tensor alive until MLX drops its last reference.

Importing this module imports no MLX (the platform imports it, through
:mod:`vllm_unified.distributed.pipeline`, in vLLM's API-server process): MLX is imported on the
first call, through :func:`vllm_unified.backend.import_mlx` (which interposes the fast BLAS first).

Two MLX 0.32.4 traps around shared buffers:

* ``a[i]`` (an integer index on axis 0) is a gather, i.e. a **copy**; take a per-layer view
  with a slice (``a[i:i + 1].squeeze(0)``, ``a[:, j]``, reshape), which aliases.
* an adopted array reaches its data through an offset that may be negative; MLX's own
  ``__dlpack__`` then gives torch a tensor that breaks on indexing. Export with
  :func:`to_torch`, never ``torch.from_dlpack`` on such an array (numpy is fine).

Ordering rules (MLX evaluates lazily, on its own worker thread):

* MLX reads a shared buffer when the reading graph is *evaluated*, not when it is built;
* before torch reads or writes memory that pending MLX work may touch, ``mx.eval`` the arrays
  involved (or ``mx.synchronize()``); torch sees a :func:`write_rows` only after its result is
  evaluated.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from vllm_unified import backend

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["data_ptr", "mlx_dtype", "native_error", "to_mlx", "to_torch", "write_rows"]

#: torch dtype -> name of the MLX dtype (resolved lazily: MLX is imported on first use).
_TORCH_TO_MLX_NAME: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool_",
}

_SUPPORTED = "float32, float16, bfloat16, int8, uint8, int16, int32, int64, bool"


def _mx() -> ModuleType:
    return backend.import_mlx()


@functools.cache
def _dtype_maps() -> tuple[dict[torch.dtype, Any], dict[Any, torch.dtype]]:
    mx = _mx()
    to_mx = {t: getattr(mx, name) for t, name in _TORCH_TO_MLX_NAME.items()}
    return to_mx, {m: t for t, m in to_mx.items()}


def _backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: which allocator MLX's buffers come from
    (:func:`vllm_unified.backend.mlx_allocator`, the backend profile's answer)."""
    return backend.mlx_allocator()


def _native() -> tuple[ModuleType | None, str | None]:
    return backend.native_extension()


def native_error() -> str | None:
    """Why the native extension cannot be used, or None when it is importable.

    The extension (distribution ``vllm-unified-native``, built from ``native/``) provides
    torch -> MLX sharing on the CPU backend and :func:`write_rows`.
    """
    return _native()[1]


def _require_native(what: str) -> ModuleType:
    mod, err = _native()
    if mod is None:
        raise RuntimeError(
            f"{what} needs the native extension vllm-unified-native, which is not usable "
            f"({err}). Build it with scripts/setup.sh (or `pip install --no-build-isolation "
            "./native` in this environment)."
        )
    return mod


def mlx_dtype(dtype: torch.dtype) -> Any:
    """The MLX dtype of a torch dtype (the project's one torch -> MLX dtype map).

    Raises:
        TypeError: a dtype MLX does not hold.
    """
    to_mx, _ = _dtype_maps()
    try:
        return to_mx[dtype]
    except KeyError:
        raise TypeError(f"bridge: torch dtype {dtype} is not supported ({_SUPPORTED})") from None


def _torch_dtype(dtype: Any) -> torch.dtype:
    _, to_torch_map = _dtype_maps()
    try:
        return to_torch_map[dtype]
    except KeyError:
        raise TypeError(f"bridge: MLX dtype {dtype} is not supported ({_SUPPORTED})") from None


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of an MLX dtype (TypeError for one torch does not hold)."""
    return _torch_dtype(dtype)


def to_torch(a: mx.array, *, copy: bool = False) -> torch.Tensor:
    """A torch CPU tensor viewing ``a``'s bytes (``copy=False``), or a fresh copy (``copy=True``).

    Args:
        a: any MLX array of a supported dtype (float32, float16, bfloat16, int8, uint8, int16,
            int32, int64, bool), any shape, any strides; it is evaluated if it is lazy.
        copy: return a new, contiguous tensor that shares nothing with ``a``.

    Returns:
        Without ``copy``: a tensor of ``a``'s shape, strides and dtype whose ``data_ptr()`` is
        ``a``'s data pointer. It keeps ``a``'s buffer alive. Writes through it are seen by every
        MLX array sharing that buffer (MLX's value semantics are deliberately bypassed), and MLX
        will not donate that buffer to another op while the tensor lives.

    Raises:
        TypeError: ``a`` is not an ``mx.array``, or its dtype is not supported.
        RuntimeError: ``copy=False`` on a backend where MLX cannot export its memory to torch
            (CUDA: MLX 0.32.4 has no CUDA DLPack export, and torch here is CPU-only).
    """
    mx = _mx()
    if not isinstance(a, mx.array):
        raise TypeError(f"to_torch expects an mx.array, got {type(a).__name__}")
    dtype = _torch_dtype(a.dtype)
    if copy:
        return _copy_to_torch(a, dtype)
    if _backend() == "cuda":
        raise RuntimeError(
            "to_torch: MLX's CUDA backend cannot share its memory with torch (no DLPack export "
            "in MLX 0.32.4); pass copy=True to copy explicitly"
        )
    native, _ = _native()
    if native is not None and _backend() == "cpu":
        # Exact data pointer whatever the array's offset. MLX's own __dlpack__ hands torch the
        # offset as an unsigned byte_offset; an adopted array's offset can be negative, and
        # torch then builds a tensor that fails on any indexing.
        t = native.to_torch(a)
    else:
        t = torch.from_dlpack(a)  # MLX-owned memory: offsets are never negative
    if t.dtype != dtype:  # not expected; never hand out a reinterpretation silently
        raise RuntimeError(f"to_torch: DLPack gave {t.dtype} for MLX {a.dtype}")
    return t


def _copy_to_torch(a: mx.array, dtype: torch.dtype) -> torch.Tensor:
    import numpy as np

    mx = _mx()
    if dtype == torch.bfloat16:  # numpy has no bfloat16: copy the bit pattern
        return torch.from_numpy(np.array(a.view(mx.int16), copy=True)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def to_mlx(t: torch.Tensor, *, copy: bool = False) -> mx.array:
    """An MLX array viewing ``t``'s bytes (``copy=False``), or a fresh copy (``copy=True``).

    Args:
        t: a CPU tensor of a supported dtype (float32, float16, bfloat16, int8, uint8, int16,
            int32, int64, bool). Without ``copy`` it must be contiguous (``t.is_contiguous()``);
            a storage offset is fine (views such as ``pool[3]`` or ``buf[64:]`` share too).
        copy: return an MLX-owned copy (any strides, any device torch can move to the CPU).

    Returns:
        Without ``copy``: an array of ``t``'s shape and dtype over the very same bytes (its data
        pointer is ``t.data_ptr()``); the array keeps ``t`` alive until MLX drops it. Torch's
        writes are seen by MLX (when MLX evaluates its reads). MLX ops never write into it: an
        update such as ``a[i] = v`` returns a *new* MLX buffer that torch does not see; write
        through :func:`write_rows` or through torch instead (on Metal: the in-place kernels of
        :mod:`vllm_unified.kv.gpu.write`). On the CPU backend the adopted bytes are not
        counted by ``mx.get_active_memory()`` or MLX's memory limits; on Metal they are (MLX
        wraps them as one of its buffers, ``allocator::make_buffer``), see
        :func:`vllm_unified.memory.wired.prepare_kv_adoption`. Autograd is ignored (``t`` is
        detached).

    Raises:
        TypeError: ``t`` is not a tensor, or its dtype is not supported.
        RuntimeError: ``copy=False`` and sharing is impossible: ``t`` is not contiguous, not
            on the CPU, MLX runs on CUDA (discrete memory), on Metal MLX refuses the pointer
            (not page-aligned: 16 KiB on Apple Silicon) or, on the CPU backend, the native
            extension is missing or was built for another MLX.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_mlx expects a torch.Tensor, got {type(t).__name__}")
    dtype = mlx_dtype(t.dtype)
    t = t.detach()
    mx = _mx()
    if copy:
        return mx.from_dlpack(t.cpu(), copy=True)
    if t.device.type != "cpu":
        raise RuntimeError(
            f"to_mlx: cannot share a tensor on {t.device}; pass copy=True to copy explicitly"
        )
    if not t.is_contiguous():
        raise RuntimeError(
            f"to_mlx: cannot share a non-contiguous tensor (shape {tuple(t.shape)}, strides "
            f"{t.stride()}): MLX adopts row-major memory only. Pass copy=True to copy, or "
            "call .contiguous() yourself (which copies)"
        )
    allocator = _backend()
    if allocator == "cuda":
        raise RuntimeError(
            "to_mlx: MLX's CUDA backend cannot use torch CPU memory in place; "
            "pass copy=True to copy explicitly"
        )
    if allocator == "metal":
        try:
            return mx.from_dlpack(t, copy=False)
        except (RuntimeError, ValueError) as exc:
            raise RuntimeError(f"to_mlx: MLX refused to share the tensor ({exc})") from exc
    native = _require_native("to_mlx on MLX's CPU backend")
    nbytes = t.numel() * t.element_size()
    return native.adopt(t.data_ptr(), nbytes, list(t.shape), dtype, t)


def write_kv(dst: mx.array, slot_mapping: mx.array, keys: mx.array, values: mx.array
             ) -> mx.array:
    """:func:`write_rows` of ``concatenate([keys, values], -1)`` into a dense K|V pool
    ``[slots, Hkv, 2 * D]``, without building the concatenation: ``keys``, ``values``
    ``[T, Hkv, D]`` or ``[T, Hkv, 1, D]`` in the pool's dtype, ``slot_mapping`` int32/int64
    ``[T]``. Same contract as :func:`write_rows` (in place, lazy, the pool's buffer returned,
    indices outside ``[0, slots)`` raise, CPU streams only).

    Raises:
        RuntimeError: the native extension is not available.
        TypeError / ValueError / IndexError: as :func:`write_rows`.
    """
    native = _require_native("write_kv")
    return native.write_kv(dst, slot_mapping, keys, values)


def write_rows(
    dst: mx.array, row_idx: mx.array, src: mx.array, *, stream: Any = None
) -> mx.array:
    """Write ``src[i]`` into row ``row_idx[i]`` of ``dst``'s buffer, in place; lazily.

    The contract, in full:

    * Rows are along axis 0: ``dst`` has shape ``[R, *row]``, ``src`` has shape ``[N, *row]``
      and the same dtype, ``row_idx`` is a 1-D integer array of ``N`` indices in ``[0, R)``.
      ``dst`` must be row-contiguous (any view with an offset is fine, e.g. one layer of a pool);
      ``src`` and ``row_idx`` may have any layout.
    * The returned array has ``dst``'s shape and dtype and **shares ``dst``'s buffer** (same data
      pointer, no copy, whoever owns it: MLX, or torch through :func:`to_mlx`). When it is
      evaluated the rows are written into that buffer, so the write is visible through every
      alias: ``dst`` itself, other MLX views, and torch views.
    * It is lazy and stays in MLX's graph: anything computed *from the returned array* is ordered
      after the write. The buffer is shared, not versioned, so two things are **not** ordered:
      a reader built on the old ``dst`` (it may run before or after the write), and a reader of
      this result against a *later* write to the same buffer in the same evaluation (it may see
      that write too). Read through the latest result, and evaluate between writes when a
      reader must see one particular state. Duplicate indices: the last one wins. ``src`` must
      not overlap ``dst``'s buffer.
    * Bounds: indices outside ``[0, R)`` raise and nothing is written: ``IndexError`` at the call
      when ``row_idx`` is already computed, ``RuntimeError`` from the ``mx.eval`` that runs the
      write when it is lazy.
    * Only CPU streams are implemented (``stream``: None for the default stream, or an
      ``mx.Stream`` / ``mx.Device``); a GPU stream raises ``NotImplementedError`` (on GPU
      backends :func:`vllm_unified.kv.gpu.write.write_rows_gpu` writes in place). Torch sees
      the write once the result is evaluated.

    Raises:
        RuntimeError: the native extension is not available.
        TypeError: dtype mismatch, or ``row_idx`` not 1-D integer.
        ValueError: shape mismatch, or ``dst`` not row-contiguous.
        IndexError: an already-computed index out of range.
        NotImplementedError: a GPU stream.
    """
    native = _require_native("write_rows")
    return native.write_rows(dst, row_idx, src, stream=stream)


def data_ptr(a: mx.array) -> int:
    """The address of ``a``'s first element (evaluates ``a``), for zero-copy assertions.

    Compare it with ``tensor.data_ptr()`` to check that an MLX array and a torch tensor share
    their bytes. Uses the native extension when it is available, else a transient NumPy view
    of the bytes (MLX's buffer protocol gives the address, on every backend whose buffers the
    host can address; a DLPack export would name the Metal device, which torch's CPU build
    cannot import).
    """
    native, _ = _native()
    if native is not None:
        return native.info(a)["data_ptr"]
    import numpy as np

    mx = _mx()
    as_uint = a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size])
    return int(np.asarray(as_uint).ctypes.data)


def native_kernels() -> ModuleType | None:
    """The native extension when its CPU kernels apply (the backend profile's
    ``cpu_kernels``: CPU compute on CPU buffers, extension importable), else None: the
    callers' pure-MLX paths are used then. Decided once per process."""
    return _native()[0] if backend.profile().cpu_kernels else None


def gather_kv(pool_rows: mx.array, rows: mx.array) -> tuple[mx.array, mx.array] | None:
    """Keys and values at ``rows`` of a K|V pool, by the native CPU primitive; lazily.

    Args:
        pool_rows: ``[R, 2 * D]``, row-contiguous: each row one (slot, head) cell holding the
            key followed by the value (the paged pool viewed as rows, see
            :mod:`vllm_unified.kv.attention.reference`).
        rows: int32 indices in ``[0, R)``, any shape ``S``.

    Returns:
        ``(keys, values)``, each row-contiguous ``S + [D]`` in the pool's dtype, equal to
        ``pool_rows[rows, :D]`` and ``pool_rows[rows, D:]`` (the pure-MLX gather, which the tests
        compare against); or None when the accelerator does not apply: the native extension is
        missing or the default device is not the CPU (callers then gather with MLX ops).

    Raises:
        IndexError: an index outside ``[0, R)`` when ``rows`` is already computed;
            ``RuntimeError`` from the ``mx.eval`` that runs the gather when it is lazy.
    """
    mod = native_kernels()
    if mod is None:
        return None
    keys, values = mod.gather_kv(pool_rows, rows)
    return keys, values
