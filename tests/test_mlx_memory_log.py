"""MLX's memory counters in the engine log (vllm_unified.memory.mlx_log): the interval, the
line's format and what the soak benchmark parses back."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vllm_unified.envs import MEMORY_LOG_ENV
from vllm_unified.memory.mlx_log import LOG_PREFIX, MemoryLog, MlxMemory, format_line, parse_line


def test_line_every_interval_steps_with_live_counters() -> None:
    log = MemoryLog(interval=3)
    keep = mx.ones((256, 1024))  # 1 MiB held by a live array
    mx.eval(keep)
    lines = [log.step(mx) for _ in range(7)]
    assert [line is not None for line in lines] == [False, False, True, False, False, True, False]
    reading = parse_line(f"(EngineCore pid=1) INFO 12-01 10:00:00 [x.py:1] {lines[5]}")
    assert reading is not None and reading.steps == 6
    assert reading.active_mib >= 1.0 and reading.peak_mib >= reading.active_mib
    del keep


def test_format_and_parse_round_trip() -> None:
    m = MlxMemory(steps=1200, active_mib=412.3, cache_mib=96.0, peak_mib=530.1)
    line = format_line(m)
    assert line == (f"{LOG_PREFIX} after 1200 steps: active 412.3 MiB, cache 96.0 MiB, "
                    "peak 530.1 MiB")
    assert parse_line(line) == m
    assert parse_line("vllm-unified: step profile decode: 10 steps") is None


def test_interval_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(MEMORY_LOG_ENV, raising=False)
    never = MemoryLog()
    assert never.interval == 0 and all(never.step(mx) is None for _ in range(5))
    monkeypatch.setenv(MEMORY_LOG_ENV, "2")
    assert MemoryLog().interval == 2
    monkeypatch.setenv(MEMORY_LOG_ENV, "often")
    with pytest.raises(ValueError, match=MEMORY_LOG_ENV):
        MemoryLog()
