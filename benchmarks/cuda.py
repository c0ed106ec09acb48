"""The lent NVIDIA GPU (run through benchmarks/cuda_h200.sh, which packs what travels).

Each subcommand runs one measurement of ``benchmarks/measure/`` with its own arguments
(``--help`` lists them); results go to ``benchmarks/results/<measurement>-<time>.json``.

    .venv/bin/python benchmarks/cuda.py decode [--help]
    .venv/bin/python benchmarks/cuda.py kvq-e2e [--help]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

COMMANDS = {
    "decode": ("cuda_decode",
               "expected/device/check: decode and TTFT through MLX's CUDA backend, kernel checks"),
    "kvq-e2e": ("cuda_kvq_e2e",
                "greedy output with a quantized KV cache on the GPU against the CPU backend"),
    "fusion-probe": ("cuda_fusion_probe",
                     "plain mlx-lm decode step with fused projections (host-bound GPU step)"),
    "kernel-checks": ("cuda_kernel_checks",
                      "paged attention kernels' CUDA instance vs the reference (fp32, TF32)"),
}

if __name__ == "__main__":
    sys.exit(harness.dispatch(__doc__, COMMANDS, sys.argv[1:]))
