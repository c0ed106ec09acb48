"""Block copies between the KV pool and the host pool: one copy per block, no temporaries.

Both sides are byte views (``int8``/``uint8`` numpy arrays sharing the torch memory, see
:mod:`.host_views`), one pair per canonical KV tensor of vLLM's offloading connector:

* KV side ``[num_blocks, page]``: one layer's blocks (vLLM's ``CanonicalKVCacheTensor``);
* host side ``[num_chunks, page * blocks_per_chunk]`` with the shared region's row stride:
  a host chunk holds ``blocks_per_chunk`` consecutive KV blocks of each tensor.

The addressing follows vLLM's ``GPULoadStoreSpec`` contract: KV block ids are grouped by KV
cache group (``group_sizes``); the first block of group ``g`` is logical block
``block_indices[g]`` of its request, so it sits at slot ``block_indices[g] % blocks_per_chunk``
of the group's first host chunk (a chunk may be entered mid-way). Runs of consecutive blocks
that are also consecutive on the host side are copied with one strided ``np.copyto`` per
tensor, straight from source to destination.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorRef:
    """One layer of a KV cache group: which tensor pair it uses and its (unpadded) bytes per
    block (vLLM's ``CanonicalKVCacheRef``)."""

    tensor_idx: int
    page_size_bytes: int


def _check_ids(ids: np.ndarray, limit: int, what: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        bad = ids[(ids < 0) | (ids >= limit)]
        raise IndexError(f"{what} {bad.tolist()[:8]} out of range [0, {limit})")


def block_pairs(
    kv_ids: np.ndarray, group_sizes: Sequence[int], block_indices: Sequence[int],
    chunk_ids: np.ndarray, blocks_per_chunk: int, num_blocks: int, num_chunks: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pair each KV block with its host position, per KV cache group.

    Args:
        kv_ids: ``[n]`` KV pool block ids, ordered by group.
        group_sizes: blocks per group (sums to ``n``).
        block_indices: logical index (within its request) of each group's first block.
        chunk_ids: host chunk ids, ordered by group: ``ceil((size + skip) / blocks_per_chunk)``
            per non-empty group, ``skip = block_indices[g] % blocks_per_chunk``.
        blocks_per_chunk: KV blocks per host chunk (>= 1).
        num_blocks: KV pool size in blocks; num_chunks: host pool size in chunks.

    Returns:
        Per group ``(kv block ids [size], host positions [size])``, a host position being
        ``chunk * blocks_per_chunk + slot``.

    Raises:
        IndexError: a KV block id or host chunk id is out of range.
        ValueError: the counts do not add up.
    """
    kv_ids = np.asarray(kv_ids, dtype=np.int64)
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    _check_ids(kv_ids, num_blocks, "KV block ids")
    _check_ids(chunk_ids, num_chunks, "host chunk ids")
    if len(group_sizes) != len(block_indices) or sum(group_sizes) != kv_ids.size:
        raise ValueError(
            f"group sizes {list(group_sizes)} / block indices {list(block_indices)} do not "
            f"match {kv_ids.size} KV block ids"
        )
    pairs, kv_off, chunk_off = [], 0, 0
    slots = np.arange(blocks_per_chunk, dtype=np.int64)
    for size, first in zip(group_sizes, block_indices, strict=True):
        if size == 0:
            pairs.append((kv_ids[:0], kv_ids[:0]))
            continue
        skip = int(first) % blocks_per_chunk
        count = -(-(size + skip) // blocks_per_chunk)
        chunks = chunk_ids[chunk_off:chunk_off + count]
        if chunks.size != count:
            raise ValueError(f"a group of {size} blocks needs {count} host chunks, got "
                             f"{chunks.size}")
        positions = (chunks[:, None] * blocks_per_chunk + slots[None]).ravel()[skip:skip + size]
        pairs.append((kv_ids[kv_off:kv_off + size], positions))
        kv_off, chunk_off = kv_off + size, chunk_off + count
    if chunk_off != chunk_ids.size:
        raise ValueError(f"{chunk_ids.size} host chunk ids given, {chunk_off} addressed")
    return pairs


def _runs(kv: np.ndarray, pos: np.ndarray, blocks_per_chunk: int):
    """``(kv start, host position start, length)`` of maximal runs that are consecutive on
    both sides (and, with several blocks per chunk, inside one chunk)."""
    if kv.size == 0:
        return
    breaks = (np.diff(kv) != 1) | (np.diff(pos) != 1)
    if blocks_per_chunk > 1:
        breaks |= np.diff(pos // blocks_per_chunk) != 0
    starts = np.concatenate([[0], np.nonzero(breaks)[0] + 1, [kv.size]])
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        yield int(kv[a]), int(pos[a]), int(b - a)


class BlockTransfer:
    """Copies blocks between KV-side and host-side byte views.

    Args:
        kv: per tensor, ``[num_blocks, page_t]`` byte array (rows may be padded past the data).
        host: per tensor, ``[num_chunks, page_t * blocks_per_chunk]`` byte array, any row stride.
        group_refs: per KV cache group, the :class:`TensorRef` of each layer.
        blocks_per_chunk: KV blocks per host chunk.

    Raises:
        ValueError: shapes or dtypes that do not fit together.
    """

    def __init__(self, kv: list[np.ndarray], host: list[np.ndarray],
                 group_refs: list[list[TensorRef]], blocks_per_chunk: int) -> None:
        if len(kv) != len(host) or not kv:
            raise ValueError(f"{len(kv)} KV tensors but {len(host)} host tensors")
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk {blocks_per_chunk} must be >= 1")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = kv[0].shape[0]
        self.num_chunks = host[0].shape[0]
        self.kv = kv
        self.host3 = []
        for t, (k, h) in enumerate(zip(kv, host, strict=True)):
            if k.dtype.itemsize != 1 or h.dtype.itemsize != 1 or k.ndim != 2 or h.ndim != 2:
                raise ValueError(f"tensor {t}: byte arrays [rows, bytes] expected")
            page = k.shape[1]
            if (k.shape[0] != self.num_blocks or h.shape[0] != self.num_chunks
                    or h.shape[1] != page * blocks_per_chunk or k.strides[1] != 1
                    or h.strides[1] != 1):
                raise ValueError(
                    f"tensor {t}: KV {k.shape} / host {h.shape} do not fit "
                    f"{blocks_per_chunk} blocks per chunk"
                )
            # [num_chunks, blocks_per_chunk, page]: a view, same bytes as ``h``.
            self.host3.append(np.lib.stride_tricks.as_strided(
                h, shape=(self.num_chunks, blocks_per_chunk, page),
                strides=(h.strides[0], page, 1), writeable=True))
        for refs in group_refs:
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(kv) or not (
                        0 < ref.page_size_bytes <= kv[ref.tensor_idx].shape[1]):
                    raise ValueError(f"bad tensor reference {ref}")
        self.group_refs = group_refs

    def copy(self, kv_ids: np.ndarray, group_sizes: Sequence[int],
             block_indices: Sequence[int], chunk_ids: np.ndarray, *, to_host: bool) -> int:
        """Copy the addressed blocks KV -> host (``to_host``) or host -> KV.

        Every id is checked before any byte moves. Returns the bytes copied.

        Raises:
            IndexError, ValueError: see :func:`block_pairs`.
        """
        if len(group_sizes) != len(self.group_refs):
            raise ValueError(f"{len(group_sizes)} groups addressed, {len(self.group_refs)} "
                             "KV cache groups registered")
        pairs = block_pairs(kv_ids, group_sizes, block_indices, chunk_ids,
                            self.blocks_per_chunk, self.num_blocks, self.num_chunks)
        nbytes = 0
        bpc = self.blocks_per_chunk
        for (kv, pos), refs in zip(pairs, self.group_refs, strict=True):
            for k0, p0, n in _runs(kv, pos, bpc):
                for ref in refs:
                    size = ref.page_size_bytes
                    kv_part = self.kv[ref.tensor_idx][k0:k0 + n, :size]
                    h3 = self.host3[ref.tensor_idx]
                    if bpc == 1:
                        host_part = h3[p0:p0 + n, 0, :size]
                    else:
                        chunk, slot = divmod(p0, bpc)
                        host_part = h3[chunk, slot:slot + n, :size]
                    if to_host:
                        np.copyto(host_part, kv_part)
                    else:
                        np.copyto(kv_part, host_part)
                    nbytes += n * size
        return nbytes
