"""One engine step or one engine feature, measured in-process or through vLLM's offline LLM.

Each subcommand runs one measurement of ``benchmarks/measure/`` with its own arguments
(``--help`` lists them); results go to ``benchmarks/results/<measurement>-<time>.json``.

    .venv/bin/python benchmarks/engine.py decode [--help]
    .venv/bin/python benchmarks/engine.py prefill [--help]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

COMMANDS = {
    "decode": ("decode_forward", "one decode step, our paged forward vs mlx-lm's, per batch size"),
    "prefill": ("prefill_forward",
                "one prefill step in each arithmetic of the quantized layers (fp32, int16, int8)"),
    "gguf-widths": ("gguf_widths_ab",
                    "decode step with a GGUF's own widths vs the same values widened to 8 bits"),
    "spec-decode": ("spec_decode", "speculative decoding (draft model / n-gram) vs plain decode"),
    "mla-decode": ("mla_decode",
                   "one decode step of a latent-attention (MLA) model vs a llama of its width"),
    "family-decode": ("family_decode",
                      "one decode step of each model family vs a llama of the same width"),
    "kv-offload": ("kv_offload",
                   "time to first token after eviction: recomputed vs host tier vs disk tier"),
}

if __name__ == "__main__":
    sys.exit(harness.dispatch(__doc__, COMMANDS, sys.argv[1:]))
