"""Per-request recurrent state of hybrid models, in vLLM's state (Mamba) cache pages.

vLLM gives every recurrent layer a ``MambaSpec`` KV-cache group: one page per state slot,
holding the layer's states (e.g. conv state then SSM/recurrent state) packed one after the
other, padded to the attention page size. With ``mamba_cache_mode == "none"`` each request owns
exactly one block of its layer's group, for its whole life: that block id is its state slot.

:class:`StatePages` holds one layer's pages as an MLX ``int8`` array ``[num_blocks, page_bytes]``
imported from vLLM's torch buffer (no copy). A step gathers the slots' pages, reinterprets the
bytes as the states (vLLM's shapes and dtypes, which for the supported families are mlx-lm's
per-sequence layouts), and writes the new states back in place (the bridge's ``write_rows`` on
the CPU, the Metal row kernel on Metal) at the end of the layer (the mixer that does so is
:class:`vllm_unified.models.routing.RecurrentMixer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import mlx.core as mx
import numpy as np

from vllm_unified import bridge
from vllm_unified.kv.allocation import import_views
from vllm_unified.kv.gpu.write import write_rows_gpu

#: state dtypes the pages hold (vLLM's names)
_STATE_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


@dataclass(frozen=True)
class StateField:
    """One state inside a page: bytes ``offset ... offset + nbytes`` are ``shape`` x ``dtype``."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: mx.Dtype


def state_fields(shapes, dtypes) -> tuple[StateField, ...]:
    """The packing of vLLM's ``MambaBase.bind_kv_cache``: states back to back in spec order.

    Args:
        shapes: per-state shapes (``MambaSpec.shapes``).
        dtypes: per-state torch dtypes (``MambaSpec.dtypes``).

    Raises:
        ValueError: a dtype MLX does not hold here.
    """
    fields, offset = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        if str(dtype) not in _STATE_DTYPES:
            raise ValueError(f"state dtype {dtype} is not supported (float32/bfloat16/float16)")
        mx_dtype = bridge.mlx_dtype(dtype)
        nbytes = prod(shape) * mx_dtype.size
        fields.append(StateField(offset, nbytes, tuple(shape), mx_dtype))
        offset += nbytes
    return tuple(fields)


def page_rows(view, buffer):
    """vLLM's ``[num_blocks, 1, 1, state_bytes]`` int8 page view as whole page rows
    ``[num_blocks, page_stride]`` (the padding included): a contiguous torch view, no copy.

    Raises:
        ValueError: the pages are not rows of one stride inside ``buffer``.
    """
    import torch

    stride = view.stride(0)
    num_blocks = view.shape[0]
    start = view.data_ptr() - buffer.data_ptr()
    if start < 0 or start + num_blocks * stride > buffer.numel() * buffer.element_size():
        raise ValueError("state pages run past the KV buffer")
    return torch.as_strided(view, (num_blocks, stride), (stride, 1))


class StatePages:
    """One recurrent layer's state pages: ``pages`` int8 ``[num_blocks, page_bytes]``.

    ``page_bytes`` is the page stride (the padded page); the fields occupy its start.
    ``write``: how new states go in (:data:`vllm_unified.backend.KVWritePath`): the native
    ``write_rows`` (shared pages on the CPU), the Metal row kernel (shared pages on Metal,
    :func:`vllm_unified.kv.gpu.write.write_rows_gpu`), or MLX's donated scatter (MLX-owned
    pages); default: ``native_rows`` when ``shared``, else ``scatter``.

    Raises:
        ValueError: ``pages`` is not int8 ``[blocks, >= used bytes]``, or shared pages with a
            write path that does not write in place.
    """

    def __init__(self, pages: mx.array, fields: tuple[StateField, ...], shared: bool,
                 write: str | None = None) -> None:
        used = fields[-1].offset + fields[-1].nbytes
        if pages.ndim != 2 or pages.dtype != mx.int8 or pages.shape[1] < used:
            raise ValueError(f"state pages must be int8 [blocks, >= {used}], got "
                             f"{pages.shape} {pages.dtype}")
        write = write or ("native_rows" if shared else "scatter")
        if write not in ("native_rows", "metal_kernel", "scatter") or (
                shared and write == "scatter"):
            raise ValueError(f"state pages ({'shared' if shared else 'MLX-owned'}) cannot be "
                             f"written by {write}")
        self.pages = pages
        self.fields = fields
        self.shared = shared
        self.write_path = write

    @classmethod
    def from_torch(cls, view, fields: tuple[StateField, ...], buffer, *,
                   write: str = "native_rows") -> StatePages:
        """Import vLLM's ``[num_blocks, 1, 1, state_bytes]`` int8 page view as whole page rows
        (:func:`page_rows`), sharing the bytes.

        Raises:
            ValueError: the pages are not rows of one stride inside ``buffer``.
            RuntimeError: the bridge cannot share the memory.
        """
        (rows,) = import_views([page_rows(view, buffer)])
        return cls(rows, fields, shared=True, write=write)

    @classmethod
    def allocate_mlx(cls, num_blocks: int, page_bytes: int, fields) -> StatePages:
        """MLX-owned zeroed pages (profiling, warm-up, backends without the shared pool)."""
        return cls(mx.zeros((num_blocks, page_bytes), dtype=mx.int8), fields, shared=False)

    def read(self, slots: mx.array) -> list[mx.array]:
        """States of ``slots`` (int32 ``[n]``): one ``[n, *shape]`` array per field."""
        rows = self.pages[slots]
        return [rows[:, f.offset:f.offset + f.nbytes].view(f.dtype).reshape(-1, *f.shape)
                for f in self.fields]

    def _put(self, idx: mx.array, rows: mx.array) -> None:
        """Rows ``rows`` into pages ``idx``, in place, on this store's write path."""
        if self.write_path == "native_rows":
            self.pages = bridge.write_rows(self.pages, idx, rows)
        elif self.write_path == "metal_kernel":
            self.pages = write_rows_gpu(self.pages, idx, rows, dialect="metal")
        else:
            self.pages[idx] = rows

    def write(self, slots: mx.array, states: list[mx.array]) -> None:
        """Write ``states`` (one ``[n, *shape]`` per field) into the pages of ``slots``
        (lazily, in place: ``write_rows`` or the Metal row kernel on the shared buffer, a
        donated scatter otherwise)."""
        n = slots.shape[0]
        parts = []
        for f, s in zip(self.fields, states, strict=True):
            if s.shape[1:] != f.shape:
                raise ValueError(f"state shape {s.shape[1:]} != page field {f.shape}")
            parts.append(mx.contiguous(s.astype(f.dtype)).reshape(n, -1).view(mx.int8))
        rest = self.pages.shape[1] - (self.fields[-1].offset + self.fields[-1].nbytes)
        if rest:
            parts.append(mx.zeros((n, rest), dtype=mx.int8))
        self._put(slots, mx.concatenate(parts, axis=1))

    def zero(self, slots: list[int]) -> None:
        """Zero whole pages (vLLM's ``new_block_ids_to_zero`` of this layer's blocks)."""
        if not slots:
            return
        zeros = mx.zeros((len(slots), self.pages.shape[1]), dtype=mx.int8)
        self._put(mx.array(slots, dtype=mx.int32), zeros)


@dataclass
class StateMetadata:
    """Per step: which slot each sequence reads and writes, and whether it has state yet.

    Sequences are those of the step's :class:`AttentionMetadata`, split the same way: the
    single-token ones (batched) and the multi-token chunks (one call each).

    Attributes:
        decode_slots: int32 ``[Bd]`` per state group, keyed by group id.
        decode_has_state: bool ``[Bd]``: False where the token is at position 0.
        prefill_slots: per group, one slot per prefill chunk.
        prefill_has_state: per chunk: False where the chunk starts at position 0.
        decode_fresh: indices (into the single-token sequences) of those at position 0.
    """

    decode_slots: dict[int, mx.array]
    decode_has_state: mx.array | None
    prefill_slots: dict[int, list[int]]
    prefill_has_state: list[bool]
    decode_fresh: list[int] = field(default_factory=list)


def build_state_metadata(
    query_lens: np.ndarray, seq_lens: np.ndarray, slots: dict[int, np.ndarray]
) -> StateMetadata:
    """Args: per sequence its query and context lengths (after the step), and per state group
    its slot ``[B]``. Raises ValueError on mismatched lengths."""
    qlens = np.asarray(query_lens, dtype=np.int64)
    starts = np.asarray(seq_lens, dtype=np.int64) - qlens
    decode, prefill = np.flatnonzero(qlens == 1), np.flatnonzero(qlens > 1)
    for g, s in slots.items():
        if len(s) != len(qlens):
            raise ValueError(f"group {g}: {len(s)} slots for {len(qlens)} sequences")
    return StateMetadata(
        decode_slots={g: mx.array(np.asarray(s)[decode].astype(np.int32))
                      for g, s in slots.items()},
        decode_has_state=mx.array(starts[decode] > 0) if len(decode) else None,
        prefill_slots={g: [int(x) for x in np.asarray(s)[prefill]] for g, s in slots.items()},
        prefill_has_state=[bool(x) for x in starts[prefill] > 0],
        decode_fresh=[int(i) for i in np.flatnonzero(starts[decode] == 0)],
    )


class StateStore:
    """The state pages of every recurrent layer."""

    def __init__(self, pages: dict[int, StatePages], groups: dict[int, int]) -> None:
        """Args: ``pages`` per model layer index; ``groups``: layer index -> KV-cache group."""
        self.pages = pages
        self.groups = groups

    def arrays(self) -> list[mx.array]:
        """Every layer's pages, to evaluate with the step (the writes happen then)."""
        return [p.pages for p in self.pages.values()]

    def zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero these blocks' pages in every layer (vLLM's ``new_block_ids_to_zero``: block
        ids are shared by all KV cache groups, so a page not owned by a layer's group is
        free memory)."""
        for pages in self.pages.values():
            pages.zero(block_ids)
        mx.eval(self.arrays())
