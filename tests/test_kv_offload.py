"""KV offload: block copies between the KV pool and the host pool carved out of
vLLM's shared offload region, the zero-copy guard, the disk tier's file format, the platform
policy, and (slow) end to end with the default model: host tier, disk tier after a restart,
a corrupted block file."""

from __future__ import annotations

import os
import re
import stat
import time
import types
import uuid

import numpy as np
import pytest
import torch

from vllm_unified import compat
from vllm_unified.offload import disk, host_views
from vllm_unified.offload.config import FS_TIER_TYPE, SPEC_NAME, configure_kv_offloading
from vllm_unified.offload.private_dir import PrivateDir
from vllm_unified.offload.worker import MLXOffloadingWorker

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD = 3, 12, 4, 2, 8


# ----------------------------------------------------------------------------- fixtures
class Pool:
    """A KV pool laid out like ours (one buffer, per-layer ``[B, N, H, 2*D]`` regions) with
    random contents, and vLLM's canonical int8 per-block views of it."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD)
        self.kv = torch.randn(shape, generator=g).to(dtype)
        self.page = BLOCK * HEADS * 2 * HEAD * self.kv.element_size()
        raw = self.kv.view(torch.int8).view(NUM_LAYERS, NUM_BLOCKS, self.page)
        self.canonical = compat.CanonicalKVCaches(
            tensors=[compat.CanonicalKVCacheTensor(raw[i], self.page) for i in range(NUM_LAYERS)],
            group_data_refs=[[compat.CanonicalKVCacheRef(i, self.page)
                              for i in range(NUM_LAYERS)]],
        )

    def block(self, b: int) -> torch.Tensor:
        return self.kv[:, b].clone()


def make_worker(pool: Pool, blocks_per_chunk: int, num_chunks: int = 6):
    kv_bytes_per_chunk = pool.page * NUM_LAYERS * blocks_per_chunk
    aligned = -(-kv_bytes_per_chunk // 4096) * 4096
    region = compat.SharedOffloadRegion(
        engine_id=f"test-{uuid.uuid4()}", num_chunks=num_chunks, rank=0,
        kv_bytes_per_chunk=aligned, cpu_page_size=kv_bytes_per_chunk,
    )
    try:
        worker = MLXOffloadingWorker(pool.canonical, blocks_per_chunk, region)
    except BaseException:
        region.cleanup()
        raise
    calls = []
    worker.bind_kv_barrier(lambda: calls.append(1))
    return worker, region, calls


def gpu_spec(ids, block_index=0):
    return compat.GPULoadStoreSpec(list(ids), group_sizes=[len(ids)], block_indices=[block_index])


def cpu_spec(ids):
    return compat.CPULoadStoreSpec(list(ids))


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("blocks_per_chunk,block_index", [(1, 0), (3, 0), (3, 2)],
                         ids=["factor1", "factor3", "factor3-mid-chunk"])
def test_store_then_load_is_byte_exact(dtype, blocks_per_chunk, block_index):
    pool = Pool(dtype)
    worker, region, barrier_calls = make_worker(pool, blocks_per_chunk)
    try:
        src = [5, 2, 9, 10, 11]  # not consecutive, then a run
        skip = block_index % blocks_per_chunk
        nchunks = -(-(len(src) + skip) // blocks_per_chunk)
        chunks = [4, 1, 3, 0, 5][:nchunks]
        expected = [pool.block(b) for b in src]
        assert worker.submit_store(1, gpu_spec(src, block_index), cpu_spec(chunks))
        # The host pool holds each block at (chunk, slot) in vLLM's layout.
        host = region.base_tensor.view(region.num_chunks, -1)
        for j, b in enumerate(src):
            chunk, slot = chunks[(skip + j) // blocks_per_chunk], (skip + j) % blocks_per_chunk
            for layer in range(NUM_LAYERS):
                start = (layer * blocks_per_chunk + slot) * pool.page
                got = host[chunk, start:start + pool.page]
                assert torch.equal(got, pool.kv[layer, b].reshape(-1).view(torch.int8))
        del host, got
        pool.kv.zero_()
        dst = [0, 7, 8, 3, 6]
        assert worker.submit_load(2, cpu_spec(chunks), gpu_spec(dst, block_index))
        for b, want in zip(dst, expected, strict=True):
            got = pool.block(b)
            assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32))
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not pool.kv[:, untouched].any()
        results = worker.get_finished()
        nbytes = len(src) * NUM_LAYERS * pool.page
        assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
            (1, True, nbytes), (2, True, nbytes)]
        assert len(barrier_calls) == 2  # MLX's pending writes evaluated before each copy
    finally:
        worker.shutdown()


@pytest.mark.parametrize("kv_ids,chunk_ids", [
    ([NUM_BLOCKS], [0]), ([-1], [0]), ([0], [6]), ([0], [-2]),
], ids=["kv-past-end", "kv-negative", "chunk-past-end", "chunk-negative"])
def test_out_of_range_ids_raise_before_any_copy(kv_ids, chunk_ids):
    pool = Pool(torch.float16)
    worker, region, _ = make_worker(pool, 1)
    try:
        before = region.base_tensor.clone()
        with pytest.raises(IndexError, match="out of range"):
            worker.submit_store(1, gpu_spec([1, *kv_ids]), cpu_spec([2, *chunk_ids]))
        assert torch.equal(region.base_tensor, before)
        with pytest.raises(IndexError, match="out of range"):
            worker.submit_load(2, cpu_spec([2, *chunk_ids]), gpu_spec([1, *kv_ids]))
    finally:
        worker.shutdown()


def test_mismatched_chunk_count_raises():
    pool = Pool(torch.float32)
    worker, _, _ = make_worker(pool, 2)
    try:
        with pytest.raises(ValueError, match="host chunk"):
            worker.submit_store(1, gpu_spec([1, 2, 3]), cpu_spec([0]))  # needs 2 chunks
    finally:
        worker.shutdown()


def test_worker_refuses_copies_before_it_is_bound():
    pool = Pool(torch.float32)
    worker, _, _ = make_worker(pool, 1)
    worker._kv_barrier = None
    try:
        with pytest.raises(RuntimeError, match="bound to the KV pool"):
            worker.submit_store(1, gpu_spec([1]), cpu_spec([0]))
    finally:
        worker.shutdown()


# ----------------------------------------------------------------------------- zero-copy guard
def test_forced_copying_host_view_raises(monkeypatch):
    """A numpy conversion that copies (as ``np.array(t)`` would) is caught when the worker
    carves the host pool, and the region is released."""
    monkeypatch.setattr(host_views, "_to_numpy", lambda t: t.numpy().copy())
    pool = Pool(torch.float32)
    with pytest.raises(RuntimeError, match="not zero-copy"):
        make_worker(pool, 1)


def test_checked_numpy_accepts_views_and_rejects_copies(monkeypatch):
    t = torch.arange(64, dtype=torch.int8).view(8, 8)[:, 2:6]
    arr = host_views.checked_numpy(t, "view")
    arr[0, 0] = 99
    assert t[0, 0] == 99  # same bytes
    monkeypatch.setattr(host_views, "_to_numpy", lambda x: np.ascontiguousarray(x.numpy()))
    with pytest.raises(RuntimeError, match="view: numpy view is not zero-copy"):
        host_views.checked_numpy(t, "view")


def test_disk_tier_view_must_be_the_shared_region():
    region = np.zeros((4, 4096), dtype=np.int8)
    host_views.check_buffer_address(memoryview(region), region.ctypes.data, "tier view")
    with pytest.raises(RuntimeError, match="tier view: memoryview .* is not the shared region"):
        host_views.check_buffer_address(memoryview(region.copy()), region.ctypes.data,
                                        "tier view")


# ----------------------------------------------------------------------------- disk format
LAYOUT = bytes(range(32))


def _payload(n=3 * 4096, seed=0):
    return np.random.default_rng(seed).integers(-128, 127, n, dtype=np.int8)


def test_block_file_round_trip_private_modes(tmp_path):
    tier = PrivateDir(str(tmp_path), "root")
    path = str(tmp_path / "root" / "a" / "b" / "blk.bin")
    src = _payload()
    disk.store_block(tier, path, memoryview(src), LAYOUT, b"key-1")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for d in (tmp_path / "root", tmp_path / "root" / "a", tmp_path / "root" / "a" / "b"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.path.getsize(path) == disk.HEADER_SIZE + src.nbytes
    dst = np.zeros_like(src)
    disk.load_block(tier, path, memoryview(dst), LAYOUT, b"key-1")
    assert np.array_equal(src, dst)
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.endswith(".tmp")]
    tier.close()


@pytest.mark.parametrize("damage,reason", [
    ("payload", "corrupt"), ("header", "corrupt"), ("truncate", "truncated"),
    ("layout", "foreign"), ("key", "foreign"), ("size", "truncated"),
])
def test_damaged_block_file_is_rejected_and_removed(tmp_path, damage, reason):
    tier = PrivateDir(str(tmp_path), "tier")
    path = str(tmp_path / "tier" / "blk.bin")
    src = _payload()
    disk.store_block(tier, path, memoryview(src), LAYOUT, b"key-1")
    layout, key, dst = LAYOUT, b"key-1", np.zeros_like(src)
    if damage in ("payload", "header"):
        with open(path, "r+b") as f:
            f.seek(disk.HEADER_SIZE + 100 if damage == "payload" else 60)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncate":
        os.truncate(path, disk.HEADER_SIZE + 4096)
    elif damage == "layout":
        layout = bytes(32)
    elif damage == "key":
        key = b"key-2"
    elif damage == "size":
        dst = np.zeros(src.size + 4096, dtype=np.int8)
    with pytest.raises(disk.InvalidBlockFile) as err:
        disk.load_block(tier, path, memoryview(dst), layout, key)
    assert err.value.reason == reason
    assert not os.path.exists(path)
    tier.close()


def test_shutdown_finishes_or_drops_queued_writes_never_half(tmp_path):
    """The disk tier's shutdown at server stop: :func:`disk.drain` waits for queued
    writes up to its deadline; then vLLM's pool shutdown drops the jobs not started while the
    one in progress completes. What is left is whole files that load and verify, and no
    temporary file."""
    import threading

    pool = compat.DualQueueThreadPool(n_read_threads=0, n_write_threads=1)
    layout, payload = b"L" * 32, np.arange(256, dtype=np.int8)
    release = threading.Event()
    tier = PrivateDir(str(tmp_path), "d")
    paths = [str(tmp_path / "d" / f"{i}.bin") for i in range(3)]

    def store(i: int, gate: threading.Event | None = None) -> None:
        if gate is not None:
            assert gate.wait(30)
        disk.store_block(tier, paths[i], memoryview(payload), layout, b"key%d" % i)

    pool.enqueue_store(0, 1, [lambda: store(0)])
    assert disk.drain(pool, 30)  # finished within the deadline
    pool.enqueue_store(1, 1, [lambda: store(1, release)])  # in progress at shutdown
    pool.enqueue_store(2, 1, [lambda: store(2)])  # queued behind it
    assert not disk.drain(pool, 0.2)
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    deadline = time.monotonic() + 30
    while pool._store_q and time.monotonic() < deadline:  # shutdown clears the queue first
        time.sleep(0.01)
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert [os.path.exists(p) for p in paths] == [True, True, False]
    assert not [n for n in os.listdir(tmp_path / "d") if n.endswith(".tmp")]
    for i in (0, 1):
        out = np.empty_like(payload)
        disk.load_block(tier, paths[i], memoryview(out), layout, b"key%d" % i)
        assert np.array_equal(out, payload)
    tier.close()


def test_layout_digest_separates_dtype_and_geometry():
    def spec(dtype="float16", heads=3, bytes_per_block=1024):
        config = types.SimpleNamespace(
            model=types.SimpleNamespace(name="m", dtype=dtype),
            cache=types.SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
            groups=[types.SimpleNamespace(tokens_per_block=16, layer_names=("a", "b"))],
            worker_kv_bytes_per_block=bytes_per_block, kv_cache_layout="LBNHC")
        return types.SimpleNamespace(config=config, kv_bytes_per_chunk=4096, extra_config={
            "kv_geometry": {"num_kv_heads": heads, "head_size": 64, "block_size": 16}})

    base = disk.layout_digest(spec())
    assert base == disk.layout_digest(spec())
    assert base != disk.layout_digest(spec(dtype="bfloat16"))
    assert base != disk.layout_digest(spec(heads=6))
    assert base != disk.layout_digest(spec(bytes_per_block=2048))


# ----------------------------------------------------------------------------- policy
def _config(size=1.0, connector=None, extra=None, backend="native", hybrid=False):
    kvt = None
    if connector is not None or extra is not None:
        kvt = compat.KVTransferConfig(kv_connector=connector, kv_role="kv_both" if connector
                                      else None, kv_connector_extra_config=extra or {})
    model = types.SimpleNamespace(is_hybrid=hybrid, revision=None, get_num_kv_heads=lambda p: 3,
                                  get_head_size=lambda: 64)
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(kv_offloading_size=size,
                                           kv_offloading_backend=backend, block_size=16,
                                           cache_dtype="auto", kv_cache_dtype_skip_layers=[]),
        kv_transfer_config=kvt, model_config=model, parallel_config=None)


def test_offloading_size_selects_our_spec_and_disk_tier(tmp_path):
    cfg = _config(0.5, extra={"secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]})
    configure_kv_offloading(cfg)
    configure_kv_offloading(cfg)  # vLLM calls the platform hook twice
    kvt = cfg.kv_transfer_config
    extra = kvt.kv_connector_extra_config
    assert (kvt.kv_connector, kvt.kv_role) == ("OffloadingConnector", "kv_both")
    assert extra["spec_name"] == SPEC_NAME and extra["cpu_bytes_to_use"] == 0.5 * 2**30
    assert extra["secondary_tiers"] == [{"type": FS_TIER_TYPE, "root_dir": str(tmp_path),
                                         "module_path": "vllm_unified.offload.disk"}]
    assert extra["kv_geometry"] == {"num_kv_heads": 3, "head_size": 64, "block_size": 16,
                                    "kv_cache_dtype": "auto"}
    # layers kept in the model dtype are part of the pages' layout (the disk tier's key)
    cfg.cache_config.cache_dtype = "int8_per_token_head"
    cfg.cache_config.kv_cache_dtype_skip_layers = ["1", "0"]
    configure_kv_offloading(cfg)
    assert extra["kv_geometry"]["kv_cache_dtype_skip_layers"] == ["0", "1"]


def test_no_offloading_leaves_config_alone():
    cfg = _config(None)
    configure_kv_offloading(cfg)
    assert cfg.kv_transfer_config is None


@pytest.mark.parametrize("kwargs,match", [
    ({"connector": "NixlConnector"}, "kv_connector=NixlConnector"),
    ({"backend": "lmcache"}, "--kv-offloading-backend lmcache"),
    ({"size": None, "connector": "OffloadingConnector"}, "--kv-offloading-size"),
    ({"extra": {"secondary_tiers": [{"type": "obj"}]}}, "type='obj'"),
    ({"extra": {"secondary_tiers": [{"type": "fs"}]}}, "root_dir"),
    ({"extra": {"canonical_layout": True}}, "canonical_layout"),
    ({"extra": {"spec_name": "Other"}}, "spec_name=Other"),
    ({"hybrid": True}, "hybrid"),
])
def test_unsupported_offloading_configs_fail_at_start(kwargs, match):
    with pytest.raises(ValueError, match=match):
        configure_kv_offloading(_config(**kwargs))


def test_simple_offload_env_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "1")
    with pytest.raises(ValueError, match="VLLM_USE_SIMPLE_KV_OFFLOAD"):
        configure_kv_offloading(_config())


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=256, **kwargs).create_engine_config()


def test_engine_config_with_offloading_size_uses_our_spec(default_model, tmp_path):
    """Through vLLM's own config path: the platform hook runs before vLLM turns
    --kv-offloading-size into a connector, and vLLM's translation keeps ours."""
    from vllm_unified.platform import MLXPlatform

    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    cfg = _engine_config(default_model, kv_offloading_size=0.5, kv_transfer_config={
        "kv_connector_extra_config": {"secondary_tiers": tiers}})
    MLXPlatform.check_and_update_config(cfg)  # again, as in the engine core
    kvt = cfg.kv_transfer_config
    extra = kvt.kv_connector_extra_config
    assert (kvt.kv_connector, kvt.kv_role) == ("OffloadingConnector", "kv_both")
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        SPEC_NAME, "vllm_unified.offload.spec")
    assert extra["cpu_bytes_to_use"] == 0.5 * 2**30
    assert extra["secondary_tiers"][0]["type"] == FS_TIER_TYPE
    assert extra["kv_geometry"] == {"num_kv_heads": 3, "head_size": 64, "block_size": 16,
                                    "kv_cache_dtype": "auto"}


def test_engine_config_refuses_another_connector(default_model):
    with pytest.raises(Exception, match="kv_connector=ExampleConnector"):
        _engine_config(default_model, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_both"})


# ----------------------------------------------------------------------------- end to end
HARNESS = os.path.join(os.path.dirname(__file__), "kv_offload_harness.py")
#: P (~1,500 tokens), Q (a short prompt whose disk file gets corrupted), and two unrelated
#: prompts that together need more blocks than the pool has (101 usable blocks of 16 tokens),
#: so P is evicted from the KV pool before it returns.
PROMPTS = {"P": {"seed": 1, "tokens": 1500}, "Q": {"seed": 4, "tokens": 300},
           "E1": {"seed": 2, "tokens": 900}, "E2": {"seed": 3, "tokens": 900}}
MAX_TOKENS = 16
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"
DISK = "vllm:prompt_tokens_cached_by_source{source=disk}"
DEVICE = "vllm:prompt_tokens_cached_by_source{source=device}"
CORRUPT = "vllm:kv_offload_fs_invalid_blocks{reason=corrupt}"


def _serve(model: str, disk_dir, tmp_path, tag: str, phases: list[dict]) -> dict:
    import json
    import subprocess
    import sys

    engine = {
        "max_model_len": 1600, "num_gpu_blocks_override": 102, "max_num_batched_tokens": 512,
        "kv_offloading_size": 0.25,
        "kv_transfer_config": {"kv_connector_extra_config": {
            "secondary_tiers": [{"type": "fs", "root_dir": str(disk_dir)}]}},
    }
    spec = {"model": model, "engine": engine, "prompts": PROMPTS, "disk_dir": str(disk_dir),
            "phases": [{"max_tokens": MAX_TOKENS, **p} for p in phases]}
    spec_path, out_path = tmp_path / f"{tag}-spec.json", tmp_path / f"{tag}-out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["PYTHONHASHSEED"] = "0"  # block hashes (and file names) stable across restarts
    proc = subprocess.run([sys.executable, HARNESS, str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(f"{tag} run failed (rc={proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    result = json.loads(out_path.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


def _delta(phases: list[dict], i: int, key: str) -> float:
    before = phases[i - 1]["metrics"].get(key, 0) if i else 0
    return phases[i]["metrics"].get(key, 0) - before


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-offload")


@pytest.fixture(scope="module")
def host_run(default_model, offload_dir):
    """P, Q, E1, E2, P in one engine (the disk tier fills as well)."""
    return _serve(default_model, offload_dir / "disk", offload_dir, "host",
                  [{"prompt": p} for p in ("P", "Q", "E1", "E2", "P")])


@pytest.fixture(scope="module")
def restart_run(default_model, offload_dir, host_run):
    """A new engine on the same disk tier: P, then Q after one of Q's files got a bit flipped."""
    p_files = set(host_run["phases"][0]["disk_files"])
    q_files = sorted(set(host_run["phases"][1]["disk_files"]) - p_files)
    assert len(q_files) >= 10
    victim = q_files[len(q_files) // 2]
    run = _serve(default_model, offload_dir / "disk", offload_dir, "restart",
                 [{"prompt": "P"}, {"prompt": "Q", "corrupt": victim}])
    run["victim"] = str(offload_dir / "disk" / victim)
    return run


@pytest.mark.engine
def test_prefix_evicted_from_kv_pool_comes_back_from_host_tier(host_run):
    phases = host_run["phases"]
    first, again = phases[0], phases[4]
    assert 1450 <= first["num_prompt_tokens"] <= 1600
    assert _delta(phases, 4, DEVICE) == 0  # P was evicted from the KV pool
    assert _delta(phases, 4, HOST) >= 1400  # ... and restored from host RAM
    assert _delta(phases, 4, DISK) == 0
    assert again["token_ids"] == first["token_ids"]
    assert again["metrics"]["vllm:kv_offload_load_bytes"] > 0
    assert len(first["disk_files"]) >= 90  # P's blocks also reached the disk tier
    # The host pool's /dev/shm file lost its name once mapped: nothing is left behind.
    shm = re.search(r"unlinked (/dev/shm/vllm_offload_\S+\.mmap)", host_run["log"])
    assert shm is not None and not os.path.exists(shm.group(1))


@pytest.mark.engine
def test_prefix_comes_back_from_disk_after_restart(restart_run, host_run):
    phase = restart_run["phases"][0]
    assert phase["metrics"].get(DISK, 0) >= 1400
    assert phase["metrics"].get(HOST, 0) == 0
    assert phase["token_ids"] == host_run["phases"][0]["token_ids"]


@pytest.mark.engine
def test_corrupted_block_file_is_a_counted_miss(restart_run, host_run):
    phases = restart_run["phases"]
    assert _delta(phases, 1, CORRUPT) == 1
    assert phases[1]["token_ids"] == host_run["phases"][1]["token_ids"]
    assert "corrupt KV block file (payload checksum mismatch); treated as a miss" in (
        restart_run["log"])
    # The file was removed, that part of Q recomputed and stored again: it loads cleanly now.
    victim = restart_run["victim"]
    with open(victim, "rb") as f:
        layout = f.read(disk.HEADER_SIZE)[16:48]
    key = bytes.fromhex(os.path.basename(victim)[:-4]) + (0).to_bytes(4, "big")
    buf = np.empty(os.path.getsize(victim) - disk.HEADER_SIZE, dtype=np.int8)
    tier = PrivateDir(*os.path.split(os.path.dirname(victim)))
    disk.load_block(tier, victim, memoryview(buf), layout, key)
