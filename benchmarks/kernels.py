"""The CPU kernels and their arithmetic: speed against the kernel they replace, accuracy
against exact arithmetic.

Each subcommand runs one measurement of ``benchmarks/measure/`` with its own arguments
(``--help`` lists them); results go to ``benchmarks/results/<measurement>-<time>.json``.

    .venv/bin/python benchmarks/kernels.py gemv [--help]
    .venv/bin/python benchmarks/kernels.py linear [--help]
    .venv/bin/python benchmarks/kernels.py experts [--help]
    .venv/bin/python benchmarks/kernels.py attention [--help]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

COMMANDS = {
    "gemv": ("quantized_gemv",
             "decode-sized quantized_linear: scratch path vs in-register and integer gemv"),
    "linear": ("quantized_linear",
               "quantized_linear: AMX tiles vs AVX-512 vs dequantize + BLAS, per shape and width"),
    "experts": ("expert_linear",
                "quantized experts at Qwen3-30B-A3B decode shapes: native kernel vs MLX's "
                "gather_qmm vs dequantized gather_mm"),
    "attention": ("paged_attention_speed",
                  "paged attention ms for one prompt's prefill and a decode step at model shapes"),
    "blas": ("blas_matmul",
             "fp32 matmul GFLOP/s under MLX with each BLAS preloaded vs the bundled one"),
    "int8-accuracy": ("int8_activations_accuracy",
                      "perplexity of the integer arithmetic (int16, int8) against exact fp32"),
    "kv-quant-speed": ("kv_quant_speed",
                       "output tok/s with each quantized KV format vs the unquantized cache"),
    "kv-quant-accuracy": ("kv_quant_accuracy",
                          "perplexity and greedy outputs with each quantized KV format"),
}

if __name__ == "__main__":
    sys.exit(harness.dispatch(__doc__, COMMANDS, sys.argv[1:]))
