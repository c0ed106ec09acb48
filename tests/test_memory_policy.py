"""KV budget arithmetic and the wired limit (mocked device facts for Metal)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_unified.memory.budget import GIB, compute_kv_budget
from vllm_unified.memory.wired import configure_wired_limit

BLOCK_BYTES = 737_280  # SmolLM2 fp32: 2 x 16 tokens x 3 heads x 64 x 4 bytes x 30 layers


def _budget(**kw):
    args = dict(total=24 * GIB, utilization=0.5, in_use=1 * GIB, activations=GIB // 4,
                bytes_per_block=BLOCK_BYTES, block_size=16, max_model_len=2048)
    args.update(kw)
    return compute_kv_budget(**args)


def test_budget_formula_and_description():
    b = _budget()
    assert b.budget == 12 * GIB - GIB - GIB // 4
    text = b.describe()
    assert "0.50 x 24.00 GiB" in text and "1.00 GiB in use" in text and "0.25 GiB" in text


def test_explicit_bytes_win():
    b = _budget(kv_cache_memory_bytes=512 * 2**20)
    assert b.budget == 512 * 2**20 and b.explicit


def test_impossible_utilization_names_flags_and_numbers():
    with pytest.raises(ValueError) as err:
        _budget(utilization=0.01)
    msg = str(err.value)
    assert "--gpu-memory-utilization 0.01" in msg and "--max-model-len 2048" in msg
    assert "24.00 GiB" in msg and "129 blocks" in msg  # ceil(2048/16) + the null block


def test_too_small_explicit_bytes_rejected():
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        _budget(kv_cache_memory_bytes=BLOCK_BYTES * 10)


class _FakeMetal:
    def __init__(self, info):
        self.info = info
        self.calls = []

    def device_info(self):
        return self.info

    def set_wired_limit(self, n):
        self.calls.append(n)
        return 0


def test_wired_limit_set_on_metal(caplog):
    mx = _FakeMetal({"max_recommended_working_set_size": 12 * GIB, "memory_size": 16 * GIB})
    log = logging.getLogger("test.wired")
    with caplog.at_level(logging.INFO, logger="test.wired"):
        assert configure_wired_limit(mx, "metal", log) == 12 * GIB
    assert mx.calls == [12 * GIB]
    assert "12.00 GiB" in caplog.text


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_wired_limit_not_applicable_elsewhere(kind, caplog):
    mx = SimpleNamespace(set_wired_limit=lambda n: pytest.fail("must not wire"))
    log = logging.getLogger("test.wired")
    with caplog.at_level(logging.INFO, logger="test.wired"):
        assert configure_wired_limit(mx, kind, log) is None
    assert len([r for r in caplog.records if "does not apply" in r.getMessage()]) == 1


def test_metal_without_working_set_raises():
    with pytest.raises(RuntimeError, match="max_recommended_working_set_size"):
        configure_wired_limit(_FakeMetal({}), "metal", logging.getLogger("test.wired"))


def test_worker_wires_before_weights_load(monkeypatch):
    """MLXWorker.init_device sets the wired limit (Metal) before load_model allocates weights."""
    from vllm_unified import backend
    from vllm_unified.worker import model_runner, worker

    events = []

    class FakeMX(_FakeMetal):
        random = SimpleNamespace(seed=lambda s: None)

        def set_wired_limit(self, n):
            events.append(("wired", n))

        def default_device(self):
            return "gpu"

        def clear_cache(self):  # the worker gives the load's scratch back after it
            pass

    class FakeRunner:
        def __init__(self, vllm_config, backend):
            events.append(("runner", backend.keep_quantized))

        def load_model(self):
            events.append(("load", None))

    fake = FakeMX({"max_recommended_working_set_size": 8 * GIB})
    metal = backend.BackendInfo("metal", "Apple GPU", 16 * GIB, True, "test")
    monkeypatch.setattr(worker, "import_mlx", lambda: fake)
    monkeypatch.setattr(worker, "detect_backend", lambda: metal)
    monkeypatch.setattr(model_runner, "MLXModelRunner", FakeRunner)
    monkeypatch.setattr(worker, "resolve_profile", lambda: SimpleNamespace(
        keep_quantized=True, encode_thread=False, describe=lambda: "MLX metal backend (test)"))
    # The KV connector's one-rank process groups (KV offloading) are not under test here.
    monkeypatch.setattr(worker, "init_single_rank_groups", lambda config, method: None)
    w = object.__new__(worker.MLXWorker)
    w.model_config = SimpleNamespace(seed=0, runner_type="generate")
    w.parallel_config = SimpleNamespace(world_size=1, nnodes=1)
    w.vllm_config = None
    w.distributed_init_method = "tcp://127.0.0.1:0"
    w.init_device()
    w.load_model()
    assert events == [("wired", 8 * GIB), ("runner", True), ("load", None)]
