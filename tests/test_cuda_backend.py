"""CUDA backend selection and device-memory accounting, with the device mocked.

The real CUDA runs happen on the lent H200 (benchmarks/cuda_h200.sh); here the same code paths
run against fakes of ``nvidia-smi`` and of ``mlx.core``'s memory API.
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import mlx.core as mx
import pytest

from vllm_unified import backend
from vllm_unified.memory.budget import GIB, compute_kv_budget, read_device_memory

CARD = 143_771 * 2**20  # an H200 as nvidia-smi reports it (MiB)
BLOCK_BYTES = 28 * 2 * 16 * 8 * 128 * 2  # Qwen3-0.6B bf16: 28 layers, 8 KV heads, head 128


@pytest.fixture
def fresh_backend():
    backend.detect_backend.cache_clear()
    yield backend
    backend.detect_backend.cache_clear()


def test_cuda_wheel_selects_cuda_with_card_memory(fresh_backend, monkeypatch):
    monkeypatch.delenv(backend.DEVICE_ENV, raising=False)
    monkeypatch.setattr(backend, "_installed", lambda dist: dist == "mlx-cuda-13")
    monkeypatch.setattr(backend, "_cuda_total_memory", lambda: CARD)
    info = backend.detect_backend()
    assert info.kind == "cuda" and not info.unified
    assert info.total_memory == CARD
    assert "mlx-cuda" in info.reason


def test_forced_cuda_without_wheel_names_the_package(fresh_backend, monkeypatch):
    monkeypatch.setenv(backend.DEVICE_ENV, "cuda")
    monkeypatch.setattr(backend, "_installed", lambda dist: False)
    with pytest.raises(ValueError, match=r"mlx\[cuda13\]"):
        backend.detect_backend()


def test_cuda_total_memory_parses_nvidia_smi(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return SimpleNamespace(stdout="143771\n")

    monkeypatch.setattr(backend.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(backend.subprocess, "run", fake_run)
    assert backend._cuda_total_memory() == CARD
    assert "--query-gpu=memory.total" in calls[0]

    def failing_run(cmd, **kw):
        raise subprocess.CalledProcessError(9, cmd)

    monkeypatch.setattr(backend.subprocess, "run", failing_run)
    assert backend._cuda_total_memory() is None


class FakeCudaMX:
    """What read_device_memory uses of ``mlx.core`` on the CUDA backend."""

    def __init__(self, total: int, free: int, active: int, keys=("total_memory", "free_memory")):
        self.info = {"device_name": "NVIDIA H200", "total_memory": total, "free_memory": free}
        self.info = {k: v for k, v in self.info.items() if k == "device_name" or k in keys}
        self.active = active
        self.events: list[str] = []

    def clear_cache(self):
        self.events.append("clear_cache")

    def device_info(self):
        self.events.append("device_info")
        return self.info

    def get_active_memory(self):
        return self.active

    def set_cache_limit(self, n):
        self.events.append(f"cache_limit {n}")
        return 0


def test_cuda_memory_comes_from_the_device_not_ram():
    mx = FakeCudaMX(total=CARD, free=100 * GIB, active=3 * GIB)
    mem = read_device_memory(mx, "cuda", rss=7 * GIB, ram=2000 * GIB)
    assert (mem.total, mem.in_use, mem.free) == (CARD, 3 * GIB, 100 * GIB)
    # MLX's buffer cache is emptied first, so cached buffers count as free.
    assert mx.events[:2] == ["clear_cache", "device_info"]


def test_unified_memory_is_ram_and_rss():
    mem = read_device_memory(FakeCudaMX(1, 1, 1), "cpu", rss=5 * GIB, ram=24 * GIB)
    assert (mem.total, mem.in_use, mem.free) == (24 * GIB, 5 * GIB, None)


def test_cuda_device_info_without_free_memory_raises():
    with pytest.raises(RuntimeError, match="free_memory"):
        read_device_memory(FakeCudaMX(CARD, 0, 0, keys=("total_memory",)), "cuda", rss=0, ram=0)


def _budget(**kw):
    args = dict(total=CARD, utilization=0.9, in_use=2 * GIB, activations=GIB,
                bytes_per_block=BLOCK_BYTES, block_size=16, max_model_len=4096)
    args.update(kw)
    return compute_kv_budget(**args)


def test_budget_capped_at_free_device_memory():
    # Another process holds most of the card: 0.9 x 140 GiB - 2 - 1 would be ~123 GiB.
    b = _budget(free=20 * GIB)
    assert b.capped and b.budget == 20 * GIB - GIB
    assert "20.00 GiB free on the device" in b.describe()


def test_budget_uses_utilization_when_enough_is_free():
    b = _budget(free=135 * GIB)
    assert not b.capped and b.budget == int(0.9 * CARD) - 2 * GIB - GIB


def test_explicit_bytes_over_free_memory_rejected():
    msg = r"--kv-cache-memory-bytes 8589934592: .*\(4.00 GiB\) free"
    with pytest.raises(ValueError, match=msg):
        _budget(free=4 * GIB, kv_cache_memory_bytes=8 * GIB)
    assert _budget(free=4 * GIB, kv_cache_memory_bytes=2 * GIB).budget == 2 * GIB


def test_nearly_full_card_names_the_flags():
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.9.*free on the device"):
        _budget(free=GIB + BLOCK_BYTES)


def test_worker_budget_on_cuda_reads_the_card(monkeypatch):
    """MLXWorker.determine_available_memory on CUDA: card memory, MLX's active bytes, free cap."""
    from vllm_unified.distributed.pipeline import PipelineStage
    from vllm_unified.worker import worker

    mx = FakeCudaMX(total=CARD, free=30 * GIB, active=2 * GIB)
    cuda = backend.BackendInfo("cuda", "NVIDIA GPU", CARD, False, "test")
    monkeypatch.setattr(worker, "import_mlx", lambda: mx)
    monkeypatch.setattr(worker, "detect_backend", lambda: cuda)
    w = object.__new__(worker.MLXWorker)
    w.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9,
                                     block_size=16)
    w.scheduler_config = SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=4)
    w.model_config = SimpleNamespace(max_model_len=4096, get_vocab_size=lambda: 1000,
                                     get_num_attention_heads=lambda pc: 16)
    w.parallel_config = SimpleNamespace(local_world_size=1, data_parallel_size_local=1)
    w.model_runner = SimpleNamespace(profile_activations=lambda n: 100 * 2**20,
                                     kv_bytes_per_block=lambda: BLOCK_BYTES,
                                     stage=PipelineStage.whole(2), lora=None)
    activations = 100 * 2**20 + 2 * 16 * 256 * 256 * 4 + 4 * 1000 * 4 * 2
    assert w.determine_available_memory() == 30 * GIB - activations


def test_cuda_write_rejects_mismatched_rows():
    from vllm_unified.kv.gpu.write import _threads_per_block, write_kv_gpu

    def write(*args):
        return write_kv_gpu(*args, dialect="cuda")

    pool = mx.zeros((32, 2, 8), dtype=mx.float16)
    k = mx.zeros((2, 2, 4), mx.float16)
    slots = mx.array([1, 2], dtype=mx.int32)
    with pytest.raises(ValueError, match="do not fit pool rows"):
        write(pool, slots, mx.zeros((2, 2, 4)), k)  # dtype
    with pytest.raises(ValueError, match="do not fit pool rows"):
        write(pool, slots, k, mx.zeros((2, 2, 8), mx.float16))  # head size
    with pytest.raises(ValueError, match="do not fit pool rows"):
        write(pool, slots, mx.zeros((2, 2, 2, 4), mx.float16), k)  # not [T, Hkv, 1, D]
    with pytest.raises(ValueError, match="slots shape"):
        write(pool, mx.array([1], dtype=mx.int32), k, k)
    with pytest.raises(ValueError, match="values"):
        write(pool, slots, k, mx.zeros((2, 2, 1, 4), mx.float16))
    with pytest.raises(ValueError, match="unknown GPU dialect"):
        write_kv_gpu(pool, slots, k, k, dialect="rocm")
    empty = mx.zeros((0, 2, 1, 4), mx.float16)
    assert write(pool, mx.zeros((0,), mx.int32), empty, empty) is pool
    assert (_threads_per_block(2048), _threads_per_block(128), _threads_per_block(96)) == \
        (256, 128, 32)
