"""Give a lazy KV pool's pages back to the OS when the scheduler drops blocks from its cache.

The scheduler side (:class:`vllm_unified.kv.block_reuse.CommittedFirstQueue`) decides which free
blocks the prefix cache no longer keeps (beyond ``VLLM_UNIFIED_PREFIX_CACHE_RETAIN``), evicts
their hashes and hands their ids to the target registered here with :func:`register`; this
module, on the worker side, drops the pages of those blocks (``madvise``) once no step that was
queued before the release can still read them, unless the scheduler has handed the block out
again meanwhile (``cancel``: the new owner's writes may already be queued).

vLLM lets a step in flight read blocks the scheduler has just freed (a preempted request's
in-flight tokens are delivered; with asynchronous scheduling a step is evaluated while the next
is scheduled): it only hands such a block to another request, whose writes come after the step
in the device's order. Pages dropped
at once would read as zeros under that step; so a release waits until every forward queued
before it has finished (:meth:`PageRelease.flush` after each step's read-back).

Only where the scheduler and the worker share a process (vLLM's uniprocess executor, the
default for one worker), for a pool that is a mapping of ours, and without a KV connector
(whose transfers read blocks on their own schedule). A block's bytes are vLLM's
``KVCacheTensor`` placement: layer ``l`` of a tensor at ``offset + l * layer_stride + b *
block_stride`` for ``page_size_bytes`` of the layer's spec; only the whole host pages inside
each range are dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections import deque
from collections.abc import Callable
from typing import Protocol


class ReleaseTarget(Protocol):
    """What the scheduler's queue calls: ``request`` with the ids of free blocks whose pages
    may go, ``cancel`` with the id of such a block when it hands it out again (its pages must
    then stay: the new owner writes them)."""

    def request(self, block_ids: list[int]) -> None: ...

    def cancel(self, block_id: int) -> None: ...


#: the scheduler's release target in this process (None: pages are never dropped)
_target: ReleaseTarget | None = None


def register(target: ReleaseTarget | None) -> None:
    """Set (or clear, with None) the release target of this process's scheduler."""
    global _target
    _target = target


def registered() -> ReleaseTarget | None:
    """The registered release target, if any (the scheduler's queue reads it per release)."""
    return _target


def _advice() -> int:
    # Linux: MADV_DONTNEED drops private anonymous pages now (they read as zeros after).
    # macOS: MADV_FREE_REUSABLE, what its malloc uses, takes them off the footprint now.
    if sys.platform == "darwin" and hasattr(mmap, "MADV_FREE_REUSABLE"):
        return mmap.MADV_FREE_REUSABLE
    return mmap.MADV_DONTNEED


class PageRelease:
    """The worker side: block ids in, pages out once the steps before them have finished.

    Args:
        base: address of the pool's backing buffer (its ``data_ptr()``).
        nbytes: the buffer's length.
        ranges: per tensor placement, ``(offset, layer_stride, block_stride, page_bytes,
            num_layers)`` (vLLM's ``KVCacheTensor`` fields and the layers' page size).
        forwards_queued: the number of forwards queued so far (a counter that only grows).
        forwards_done: the number of those whose graph has finished (forwards finish in
            order).
    """

    def __init__(self, base: int, nbytes: int,
                 ranges: list[tuple[int, int, int, int, int]],
                 forwards_queued: Callable[[], int], forwards_done: Callable[[], int]) -> None:
        self.base, self.nbytes, self.ranges = base, nbytes, ranges
        self._queued, self._done = forwards_queued, forwards_done
        self._pending: deque[tuple[int, list[int]]] = deque()
        #: block id -> the tag of its latest release request (an id can be released, handed
        #: out, freed and released again before the first request's turn)
        self._pending_ids: dict[int, int] = {}
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._advice = _advice()
        #: blocks whose pages were dropped, and the bytes (whole pages) dropped
        self.blocks_released = 0
        self.bytes_released = 0

    def request(self, block_ids: list[int]) -> None:
        """The scheduler's call: drop these free blocks' pages once the forwards queued now
        have finished (at once if they have)."""
        if block_ids:
            tag = self._queued()
            self._pending.append((tag, list(block_ids)))
            self._pending_ids.update(dict.fromkeys(block_ids, tag))
            self.flush()

    def cancel(self, block_id: int) -> None:
        """The scheduler hands ``block_id`` out again before its pages were dropped: keep them."""
        self._pending_ids.pop(block_id, None)

    def flush(self) -> None:
        """Drop the pages of every request made when no more forwards had been queued than
        have finished now.

        Raises:
            OSError: ``madvise`` refused a range (never expected: the ranges are inside the
                mapping).
        """
        done = self._done()
        while self._pending and self._pending[0][0] <= done:
            tag, ids = self._pending.popleft()
            for block in ids:
                if self._pending_ids.get(block) == tag:
                    del self._pending_ids[block]
                    self._drop(block)
                    self.blocks_released += 1

    def _drop(self, block: int) -> None:
        page = mmap.PAGESIZE
        for offset, layer_stride, block_stride, page_bytes, num_layers in self.ranges:
            for layer in range(num_layers):
                start = self.base + offset + layer * layer_stride + block * block_stride
                first = -(-start // page) * page
                last = (start + page_bytes) // page * page
                if last <= first:
                    continue
                if not (self.base <= first and last <= self.base + self.nbytes):
                    raise ValueError(f"block {block}: bytes outside the KV buffer")
                if self._libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                                      self._advice) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"madvise: {os.strerror(err)}")
                self.bytes_released += last - first


def placements(kv_cache_config) -> list[tuple[int, int, int, int, int]]:
    """``(offset, layer_stride, block_stride, page_bytes, num_layers)`` for every tensor of
    vLLM's ``KVCacheConfig`` (a layer's page size from its group's spec, or from its own spec
    in a group of ``UniformTypeKVCacheSpecs``, whose ``page_size_bytes`` sums its layers')."""
    page_of = {}
    for g in kv_cache_config.kv_cache_groups:
        per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        for name in g.layer_names:
            spec = per_layer[name] if per_layer is not None else g.kv_cache_spec
            page_of[name] = spec.page_size_bytes
    out = []
    for t in kv_cache_config.kv_cache_tensors:
        pages = {page_of[name] for name in t.layers if name in page_of}
        if not pages:
            continue
        out.append((t.offset, t.layer_stride, t.block_stride, min(pages), len(t.layers)))
    return out
