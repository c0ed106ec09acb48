"""Memory of the engine: start-up, per model, KV capacity.

Each subcommand runs one measurement of ``benchmarks/measure/`` with its own arguments
(``--help`` lists them); results go to ``benchmarks/results/<measurement>-<time>.json``.

    .venv/bin/python benchmarks/memory.py startup [--help]
    .venv/bin/python benchmarks/memory.py models [--help]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

COMMANDS = {
    "startup": ("memory_startup", "start-up RSS of the KV pool, lazy allocation vs eager zeroing"),
    "models": ("memory_models",
               "engine RSS after start-up, a real model against a tiny one (breakdown by kind)"),
    "kv-capacity": ("kv_quant_capacity", "tokens per GiB of KV for each quantized format"),
}

if __name__ == "__main__":
    sys.exit(harness.dispatch(__doc__, COMMANDS, sys.argv[1:]))
