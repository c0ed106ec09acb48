"""MLX's own memory counters in the engine's log, every N scheduler steps.

MLX keeps three counters in its allocator: **active** (bytes held by live arrays), **cache**
(bytes of freed buffers MLX keeps for reuse instead of returning them) and **peak** (the most
active memory since start or since the last ``mx.reset_peak_memory()``, which the activation
profiling at start-up calls). None of them is visible outside the engine process: the process
RSS mixes them with the KV pool's committed pages, torch, Python and malloc's free lists. A
growing active figure under steady load is a leak of arrays (stale references); a growing cache
figure is MLX holding on to freed memory. With ``VLLM_UNIFIED_MEMORY_LOG=N`` the runner logs
them every N finished steps (``benchmarks/serve.py soak`` reads the lines to show their drift)::

    vllm-unified: MLX memory after 1200 steps: active 412.3 MiB, cache 96.0 MiB, peak 530.1 MiB

On the CPU backend the KV pool is torch memory imported into MLX (``native/``), outside MLX's
allocator: it is not in these figures. Reading the counters costs three atomic loads; nothing is
synchronised or freed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

from vllm_unified import envs
from vllm_unified.envs import MEMORY_LOG_ENV

#: The log line's fixed start, which the benchmark searches for.
LOG_PREFIX = "vllm-unified: MLX memory"

_MIB = 2**20
_LINE_RE = re.compile(
    re.escape(LOG_PREFIX) + r" after (?P<steps>\d+) steps: active (?P<active>[\d.]+) MiB, "
    r"cache (?P<cache>[\d.]+) MiB, peak (?P<peak>[\d.]+) MiB"
)


@dataclass(frozen=True)
class MlxMemory:
    """One reading of MLX's allocator counters after ``steps`` finished steps (sizes in MiB)."""

    steps: int
    active_mib: float
    cache_mib: float
    peak_mib: float


def read(mx: ModuleType, steps: int) -> MlxMemory:
    """MLX's counters now (``mx.get_active_memory``, ``get_cache_memory``, ``get_peak_memory``)."""
    return MlxMemory(steps, mx.get_active_memory() / _MIB, mx.get_cache_memory() / _MIB,
                     mx.get_peak_memory() / _MIB)


def format_line(m: MlxMemory) -> str:
    """The log line for ``m`` (the format :func:`parse_line` reads)."""
    return (f"{LOG_PREFIX} after {m.steps} steps: active {m.active_mib:.1f} MiB, "
            f"cache {m.cache_mib:.1f} MiB, peak {m.peak_mib:.1f} MiB")


def parse_line(line: str) -> MlxMemory | None:
    """The reading in a log line (any prefix before :data:`LOG_PREFIX`), or None if the line
    holds none."""
    m = _LINE_RE.search(line)
    if m is None:
        return None
    return MlxMemory(int(m["steps"]), float(m["active"]), float(m["cache"]), float(m["peak"]))


class MemoryLog:
    """Counts finished steps and produces a line every ``interval`` of them.

    Args:
        interval: steps between lines; default ``VLLM_UNIFIED_MEMORY_LOG`` (0: never).

    Raises:
        ValueError: the variable is set but not a non-negative integer.
    """

    def __init__(self, interval: int | None = None) -> None:
        self.interval: int = envs.read(MEMORY_LOG_ENV) if interval is None else interval
        self.steps = 0

    def step(self, mx: ModuleType) -> str | None:
        """Count one finished step; the log line when the interval is reached, else None."""
        self.steps += 1
        if not self.interval or self.steps % self.interval:
            return None
        return format_line(read(mx, self.steps))
