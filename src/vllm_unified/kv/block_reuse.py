"""Which free block vLLM's scheduler hands out next: written blocks before fresh ones.

The KV pool on unified memory is lazy (:mod:`vllm_unified.kv.allocation`): a block's pages are
committed to RAM when it is first written and stay committed. vLLM 0.32's ``BlockPool`` takes
new blocks from the front of its ``FreeKVCacheBlockQueue``, which starts as every block in id
order, and puts every freed block that the prefix cache keeps (it has a hash) at the back
(``BlockPool.free_blocks``). So it hands out never-written blocks until the whole pool has been
written once, and the engine's resident memory climbs with the traffic towards the pool's size
(the prefix cache keeping every freed block), whatever the load needs. On a CUDA card the pool
is committed device memory from the start and that order costs nothing; on a Mac it is RAM
taken from everything else.

:class:`CommittedFirstQueue` is vLLM's queue with one change of order: never-written ("fresh")
blocks stay in a segment at the back, and a free block that has been written is handed out
before a fresh one when it holds nothing the prefix cache keeps (no hash), or when more written
blocks are free than the cache retains: ``max(retain_blocks, the most blocks held at once)``.
The prefix cache thus keeps at least that many freed blocks (as many as are free) and evicts its
least recently used block rather than commit new memory beyond that; fresh pages are committed
only while the load needs more blocks than are written. Everything else is vLLM's: the
free-block count, LRU order among cached blocks, eviction (``BlockPool.get_new_blocks`` evicts a
handed-out block's hash), prefix-cache hits (``touch`` removes any free block).

Where the worker shares the scheduler's process and can drop pages
(:mod:`vllm_unified.kv.page_release`), the queue also gives memory back: whenever more written
blocks are free than the cache retains, the least recently used of them are evicted from the
prefix cache (``BlockPool._maybe_evict_cached_block``, as vLLM evicts), moved back to the fresh
segment and their pages released. The pool's resident pages are then the blocks in use now plus
at most the retained ones: at most twice the load's peak (or the peak plus ``retain_blocks``),
and back to the retained blocks when the server is idle. A block vLLM keeps readable until
reuse (``BlockPool.unpin_blocks``) is never released.

Installed by :func:`vllm_unified.patches.bound_prefix_cache_residency` in the scheduler's
process; ``VLLM_UNIFIED_PREFIX_CACHE_RETAIN`` (:mod:`vllm_unified.envs`) sets the bound in
tokens or restores vLLM's order (``all``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_unified import envs
from vllm_unified.backend import detect_backend
from vllm_unified.compat import FreeKVCacheBlockQueue, KVCacheBlock
from vllm_unified.kv import page_release


def prefix_cache_retain_tokens(max_model_len: int) -> int | None:
    """Tokens of freed KV blocks the prefix cache keeps in written pool pages before it reuses
    its least recently used block (``VLLM_UNIFIED_PREFIX_CACHE_RETAIN``), or None for vLLM's
    own order. Unset: ``max_model_len`` where the pool is committed lazily (Metal, CPU), None
    where it is committed whole (CUDA, or ``VLLM_UNIFIED_KV_EAGER_ZERO=1``): there fresh
    blocks cost nothing.

    Raises:
        ValueError: the variable does not parse.
    """
    value = envs.read(envs.PREFIX_CACHE_RETAIN_ENV)
    if value is None:
        lazy = detect_backend().unified and not envs.read(envs.KV_EAGER_ZERO_ENV)
        return max_model_len if lazy else None
    return None if value == "all" else int(value)


class CommittedFirstQueue(FreeKVCacheBlockQueue):
    """vLLM's free-block queue, handing out written blocks before never-written ones.

    The doubly linked list is ``[written free blocks, vLLM's order] + [fresh blocks, id order]``;
    every block starts fresh. ``num_free_blocks`` counts both segments, as vLLM's does.

    Args:
        blocks: every block of the pool, as vLLM's ``BlockPool`` passes them (none written).
        retain_blocks: the fewest written free blocks the prefix cache keeps before a cached
            one is handed out instead of a fresh one, or released (>= 0). The cache keeps more
            when running requests have held more blocks at once: ``max(retain_blocks, peak)``
            (:attr:`retained_blocks`), so its share scales with the load it serves.
    """

    def __init__(self, blocks: list[KVCacheBlock], retain_blocks: int) -> None:
        if retain_blocks < 0:
            raise ValueError(f"retain_blocks must be >= 0, got {retain_blocks}")
        super().__init__(blocks)
        self.retain_blocks = retain_blocks
        self._num_blocks = len(blocks)
        #: the most blocks held at once (by running requests and prefix-cache hits)
        self.peak_used_blocks = 0
        self._fresh_ids: set[int] = {b.block_id for b in blocks}
        self._first_fresh: KVCacheBlock | None = blocks[0] if blocks else None
        #: vLLM's BlockPool owning this queue (set by the installer): evicts released blocks
        self.block_pool: Any = None
        #: fresh-segment blocks whose pages were handed to the release target
        self._released_ids: set[int] = set()

    @classmethod
    def replacing(cls, queue: FreeKVCacheBlockQueue, retain_blocks: int) -> CommittedFirstQueue:
        """The same free blocks as ``queue`` (vLLM's, none handed out yet but the null block),
        all fresh, in the same order. Raises ValueError if any has a hash (it was used)."""
        blocks = queue.get_all_free_blocks()
        if any(b.block_hash is not None for b in blocks):
            raise ValueError("the free-block queue to replace has cached blocks")
        for b in blocks:
            b.prev_free_block = b.next_free_block = None
        return cls(blocks, retain_blocks)

    @property
    def num_fresh_blocks(self) -> int:
        """Free blocks never handed out (their pages not committed by the pool)."""
        return len(self._fresh_ids)

    @property
    def retained_blocks(self) -> int:
        """How many written free blocks the prefix cache may keep now."""
        return max(self.retain_blocks, self.peak_used_blocks)

    @property
    def num_written_free_blocks(self) -> int:
        """Free blocks handed out before: the prefix cache's candidates and hashless ones."""
        return self.num_free_blocks - len(self._fresh_ids)

    def _take_written(self) -> bool:
        written = self.num_written_free_blocks
        if written == 0:
            return False
        head = self.fake_free_list_head.next_free_block
        assert head is not None and head.block_id not in self._fresh_ids
        return (head.block_hash is None or written > self.retained_blocks
                or not self._fresh_ids)

    def popleft(self) -> KVCacheBlock:
        if self._take_written():
            block = super().popleft()
        elif self._first_fresh is None:
            block = super().popleft()  # empty: vLLM's own error
        else:
            block = self._first_fresh
            self.remove(block)
        self._note_use()
        return block

    def _note_use(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks,
                                    self._num_blocks - self.num_free_blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks from {self.num_free_blocks} free ones")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.block_id in self._released_ids:  # handed out again before its pages went
            self._released_ids.discard(block.block_id)
            target = page_release.registered()
            if target is not None:
                target.cancel(block.block_id)
        if block.block_id in self._fresh_ids:
            self._fresh_ids.discard(block.block_id)
            if block is self._first_fresh:
                nxt = block.next_free_block
                self._first_fresh = None if nxt is self.fake_free_list_tail else nxt
        super().remove(block)
        self._note_use()

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        anchor = self._first_fresh
        if anchor is None or not blocks:
            super().append_n(blocks)
        else:
            self._insert_before(anchor, blocks)
        self._release_surplus()

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        super().prepend_n(blocks)
        self._release_surplus()

    def _insert_before(self, anchor: KVCacheBlock, blocks: list[KVCacheBlock]) -> None:
        prev = anchor.prev_free_block
        assert prev is not None
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = anchor
        anchor.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def _release_surplus(self) -> None:
        """Evict and release the least recently used written free blocks beyond the bound."""
        target = page_release.registered()
        surplus = self.num_written_free_blocks - self.retained_blocks
        if target is None or surplus <= 0 or self.block_pool is None:
            return
        pinned = self.block_pool._reuse_watchers
        victims: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        while len(victims) < surplus and block is not None and block is not self._first_fresh \
                and block is not self.fake_free_list_tail:
            if block.block_id not in pinned:
                victims.append(block)
            block = block.next_free_block
        for block in victims:
            self.block_pool._maybe_evict_cached_block(block)
            super().remove(block)
        anchor = self._first_fresh
        if anchor is None:
            super().append_n(victims)
        else:
            self._insert_before(anchor, victims)
        ids = [b.block_id for b in victims]
        self._fresh_ids.update(ids)
        self._released_ids.update(ids)
        if victims:
            self._first_fresh = victims[0]
            target.request(ids)
