"""The scheduler's free-block order on lazily committed pools (``kv/block_reuse.py``).

Driven through vLLM's own ``KVCacheManager`` (prefix cache, hashes, ``free``, ``touch``) with
the patch installed, as the engine core runs it; vLLM's unpatched queue is the contrast.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, get_request_block_hasher
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.request import Request

from vllm_unified import envs, patches
from vllm_unified.kv import block_reuse, page_release
from vllm_unified.kv.block_reuse import CommittedFirstQueue

BLOCK = 16
NUM_BLOCKS = 400
MAX_MODEL_LEN = 512


@pytest.fixture(autouse=True)
def _patched(monkeypatch):
    kv_cache_utils.init_none_hash(sha256)
    saved, saved_release = KVCacheManager.__init__, page_release.registered()
    patches.bound_prefix_cache_residency(patches.logging.getLogger("test"))
    page_release.register(None)
    yield
    KVCacheManager.__init__ = saved
    page_release.register(saved_release)


def _manager(monkeypatch, retain: str | None, caching: bool = True) -> KVCacheManager:
    if retain is None:
        monkeypatch.delenv(envs.PREFIX_CACHE_RETAIN_ENV, raising=False)
    else:
        monkeypatch.setenv(envs.PREFIX_CACHE_RETAIN_ENV, retain)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS,
                                        layers=["layer.0"], layer_stride=0,
                                        block_stride=spec.page_size_bytes)],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, MAX_MODEL_LEN, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, enable_caching=caching)


class Traffic:
    """Requests through the manager as the scheduler does it: computed prefix, allocate the
    rest of the prompt, free. Records every block id handed out."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.used: set[int] = set()
        self.live: dict[str, Request] = {}
        self.peak_live_blocks = 0
        self.n = 0

    def start(self, tokens: list[int]) -> int:
        """Admit a request for ``tokens`` (its whole prompt computed); returns the prompt
        tokens served from the prefix cache."""
        self.n += 1
        req = Request(f"r{self.n}", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=self.hasher)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        new = self.manager.allocate_slots(req, len(tokens) - hit, hit, blocks)
        assert new is not None, "the pool ran out"
        req.num_computed_tokens = len(tokens)
        self.manager.cache_blocks(req, len(tokens))
        ids = self.manager.get_block_ids(req.request_id)[0]
        self.used.update(ids)
        self.live[req.request_id] = req
        held = {b for r in self.live.values()
                for b in self.manager.get_block_ids(r.request_id)[0]}
        self.peak_live_blocks = max(self.peak_live_blocks, len(held))
        return hit

    def finish(self, request_id: str | None = None) -> None:
        req = self.live.pop(request_id or next(iter(self.live)))
        self.manager.free(req)

    def run(self, tokens: list[int]) -> int:
        hit = self.start(tokens)
        self.finish()
        return hit


def _prompt(seed: int, blocks: float) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(int(blocks * BLOCK))]


def test_distinct_prompts_reuse_written_blocks_instead_of_the_whole_pool(monkeypatch):
    """60 distinct 10-block prompts one after another: vLLM's order hands out 600 different
    blocks (every one fresh); with a 20-block bound the pool writes 10 + 20 of them."""
    ours = Traffic(_manager(monkeypatch, str(20 * BLOCK)))
    vllms = Traffic(_manager(monkeypatch, "all"))
    assert isinstance(ours.manager.block_pool.free_block_queue, CommittedFirstQueue)
    assert type(vllms.manager.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    for i in range(60):
        assert ours.run(_prompt(i, 10)) == 0
        vllms.run(_prompt(i, 10))
    assert len(vllms.used) == NUM_BLOCKS - 1  # every block but the null block, and it wrapped
    assert len(ours.used) == 10 + 20
    queue = ours.manager.block_pool.free_block_queue
    assert queue.num_free_blocks == vllms.manager.block_pool.get_num_free_blocks()
    assert queue.num_fresh_blocks == NUM_BLOCKS - 1 - 30
    assert len(queue.get_all_free_blocks()) == queue.num_free_blocks


def test_the_prefix_cache_keeps_the_bound_and_evicts_least_recently_used(monkeypatch):
    """A prompt is still a full hit after 1 other prompt (its blocks fit the 20-block bound)
    and a miss after 3 (evicted, least recently used first), as vLLM would with a pool that
    small; the hit re-uses its blocks without writing any."""
    traffic = Traffic(_manager(monkeypatch, str(20 * BLOCK)))
    a = _prompt(100, 10)
    traffic.run(a)
    traffic.run(_prompt(101, 10))
    used = set(traffic.used)
    # A's last token is recomputed by vLLM's rule (the last block of a full hit is dropped).
    assert traffic.run(a) == 9 * BLOCK
    assert len(traffic.used - used) == 1  # the recomputed last block: a fresh one (bound)
    for seed in (102, 103, 104):
        traffic.run(_prompt(seed, 10))
    assert traffic.run(a) == 0


def test_hashless_blocks_are_reused_before_fresh_ones(monkeypatch):
    """A partial block (no hash: nothing for the prefix cache) is handed out again first, even
    with room left under the bound; with caching off every freed block is."""
    traffic = Traffic(_manager(monkeypatch, str(100 * BLOCK)))
    traffic.run(_prompt(1, 2.5))  # 2 full blocks kept, 1 partial freed hashless
    partial = max(traffic.used)
    queue = traffic.manager.block_pool.free_block_queue
    assert queue.fake_free_list_head.next_free_block.block_id == partial
    traffic.start(_prompt(2, 1))
    assert traffic.manager.get_block_ids("r2")[0] == [partial]

    off = Traffic(_manager(monkeypatch, str(100 * BLOCK), caching=False))
    for i in range(20):
        off.run(_prompt(i, 5))
    assert len(off.used) == 5


def test_random_traffic_keeps_vllms_accounting_and_the_bound(monkeypatch):
    """Random overlapping requests (shared prefixes, partial blocks, up to 8 live): the free
    count and free list are consistent after every step and blocks ever written stay within the
    live peak plus the bound; the same traffic in vLLM's order writes most of the pool."""
    retain = 24
    ours = _random_traffic(Traffic(_manager(monkeypatch, str(retain * BLOCK))), retain)
    vllms = _random_traffic(Traffic(_manager(monkeypatch, "all")), None)
    assert len(ours.used) < NUM_BLOCKS // 2 < len(vllms.used)


def _random_traffic(traffic: Traffic, retain: int | None) -> Traffic:
    rng = random.Random(0)
    prefixes = [_prompt(1000 + i, 4) for i in range(3)]
    for step in range(400):
        if traffic.live and (len(traffic.live) >= 8 or rng.random() < 0.45):
            traffic.finish(rng.choice(list(traffic.live)))
        else:
            tail = _prompt(step, rng.choice([0.5, 1, 2.25, 3, 6]))
            traffic.start((rng.choice(prefixes) if rng.random() < 0.5 else []) + tail)
        pool = traffic.manager.block_pool
        queue = pool.free_block_queue
        free = queue.get_all_free_blocks()
        assert len(free) == queue.num_free_blocks == pool.get_num_free_blocks()
        assert all(b.ref_cnt == 0 for b in free)
        if retain is not None:
            fresh = [b.block_id in queue._fresh_ids for b in free]
            assert fresh == sorted(fresh), "fresh blocks are not all behind the written ones"
            peak = traffic.peak_live_blocks
            assert len(traffic.used) <= peak + max(retain, peak) + 1
    return traffic


def test_default_bound_is_max_model_len_on_a_lazy_pool_and_none_on_cuda(monkeypatch):
    monkeypatch.delenv(envs.PREFIX_CACHE_RETAIN_ENV, raising=False)
    monkeypatch.delenv(envs.KV_EAGER_ZERO_ENV, raising=False)
    assert block_reuse.prefix_cache_retain_tokens(2048) == 2048  # this CPU machine: lazy pool
    monkeypatch.setenv(envs.KV_EAGER_ZERO_ENV, "1")
    assert block_reuse.prefix_cache_retain_tokens(2048) is None
    monkeypatch.setenv(envs.PREFIX_CACHE_RETAIN_ENV, "0")
    assert block_reuse.prefix_cache_retain_tokens(2048) == 0
    monkeypatch.setenv(envs.PREFIX_CACHE_RETAIN_ENV, "ALL")
    assert block_reuse.prefix_cache_retain_tokens(2048) is None
    monkeypatch.setenv(envs.PREFIX_CACHE_RETAIN_ENV, "-5")
    with pytest.raises(ValueError, match="VLLM_UNIFIED_PREFIX_CACHE_RETAIN='-5'"):
        block_reuse.prefix_cache_retain_tokens(2048)


def test_the_patch_is_idempotent_and_logged(monkeypatch):
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    # A logger of its own: vLLM's logging set-up (run by other tests) disables existing ones.
    log = logging.getLogger("test_block_reuse.install")
    log.disabled, log.propagate = False, False
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    KVCacheManager.__init__ = KVCacheManager.__init__.__wrapped__  # unpatched (fixture restores)
    patches.bound_prefix_cache_residency(log)
    patched = KVCacheManager.__init__
    patches.bound_prefix_cache_residency(log)
    assert KVCacheManager.__init__ is patched
    _manager(monkeypatch, "160")
    assert any("prefix cache keeps at least 10 freed blocks (160 tokens" in r for r in records)


class Released:
    """A page-release target recording what the queue hands it."""

    def __init__(self, check=None) -> None:
        self.ids: list[int] = []
        self.cancelled: list[int] = []
        self.check = check

    def request(self, ids: list[int]) -> None:
        if self.check is not None:
            self.check(ids)
        self.ids += ids

    def cancel(self, block_id: int) -> None:
        self.cancelled.append(block_id)


def test_blocks_beyond_the_bound_are_evicted_and_released(monkeypatch):
    """With a release target, written free blocks never exceed the bound: the least recently
    used are evicted from the prefix cache and released, and a later prompt is a miss for
    them and a hit for the ones kept; a block vLLM keeps readable (unpinned) is never
    released."""
    released = Released()
    page_release.register(released)
    traffic = Traffic(_manager(monkeypatch, str(20 * BLOCK)))
    queue = traffic.manager.block_pool.free_block_queue
    prompts = [_prompt(200 + i, 10) for i in range(6)]
    for p in prompts:
        traffic.run(p)
        assert queue.num_written_free_blocks <= 20
    assert len(released.ids) == 6 * 10 - 20
    assert len(traffic.used) == 10 + 20  # released blocks are handed out again first
    # ... and each such hand-out cancels its release (the new owner writes those pages)
    assert sorted(released.cancelled) == sorted(released.ids[:len(released.cancelled)])
    assert len(released.cancelled) == 6 * 10 - 20 - 10
    pool = traffic.manager.block_pool
    back_to_fresh = set(released.ids) & queue._fresh_ids
    assert len(back_to_fresh) == 10
    assert all(pool.blocks[i].block_hash is None for i in back_to_fresh)
    assert traffic.run(prompts[0]) == 0  # evicted with its pages
    assert traffic.run(prompts[5]) == 9 * BLOCK  # kept: among the 20 most recent blocks
    assert traffic.run(prompts[4]) == 0  # the least recently used when prompts[0] came back
    # A block vLLM still reads until it is handed out again is never released while so.
    pinned_released: list[int] = []
    page_release.register(Released(lambda ids: pinned_released.extend(
        i for i in ids if i in pool._reuse_watchers)))
    traffic.start(_prompt(300, 30))
    req = next(iter(traffic.live.values()))
    blocks = list(traffic.manager.coordinator.get_blocks(req.request_id)[0])
    pool.unpin_blocks(blocks, on_reuse=lambda block: None)
    del traffic.live[req.request_id]
    assert queue.num_written_free_blocks > 20  # surplus, all of it pinned
    for i in range(8):
        traffic.run(_prompt(400 + i, 5))
    assert not pinned_released


def test_page_release_drops_pages_only_after_the_steps_before_it(monkeypatch):
    """Real pages: a block's pages stay while a forward queued before the release has not
    finished, then read as zeros and leave the resident set; other blocks keep their bytes."""
    from vllm_unified.kv.allocation import aligned_empty, resident_bytes
    from vllm_unified.kv.page_release import PageRelease

    block_bytes, num_layers, num_blocks = 3 * 4096, 2, 8
    buf = aligned_empty(block_bytes * num_blocks * num_layers)
    buf.fill_(7)
    queued, done = [3], [2]
    release = PageRelease(buf.data_ptr(), buf.numel(),
                          [(0, block_bytes * num_blocks, block_bytes, block_bytes, num_layers)],
                          lambda: queued[0], lambda: done[0])
    full = resident_bytes(buf)
    release.request([2, 5])
    assert resident_bytes(buf) == full and release.blocks_released == 0
    done[0] = 3
    release.flush()
    assert release.blocks_released == 2 and release.bytes_released == 4 * block_bytes
    assert resident_bytes(buf) == full - 4 * block_bytes
    view = buf.view(num_layers, num_blocks, block_bytes)
    for layer in range(num_layers):
        for block in range(num_blocks):
            want = 0 if block in (2, 5) else 7
            assert bool((view[layer, block] == want).all()), (layer, block)
    release.request([1])  # nothing in flight: at once
    assert release.blocks_released == 3
    # A block handed out again before its turn keeps its pages (its new owner writes them).
    queued[0] = 4
    release.request([6, 7])
    release.cancel(6)
    done[0] = 4
    release.flush()
    assert release.blocks_released == 4
    assert bool((view[:, 6] == 7).all()) and bool((view[:, 7] == 0).all())
    # Released, handed out, freed and released again: only the later release's turn counts.
    queued[0] = 5
    release.request([0])
    release.cancel(0)
    queued[0] = 6
    release.request([0])
    done[0] = 5
    release.flush()
    assert bool((view[:, 0] == 7).all()), "dropped at the first request's turn"
    done[0] = 6
    release.flush()
    assert bool((view[:, 0] == 0).all()) and release.blocks_released == 5
