"""BLAS interposition under MLX's CPU backend (vllm_unified.blas).

Interposition is per process and only works before ``mlx.core`` is imported, so every case that
loads a library runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_unified import blas

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="BLAS interposition is a Linux CPU matter"
)

# Preload, import MLX, multiply fp32 matrices of model-like shapes, compare with numpy.
CHILD = textwrap.dedent(
    """
    import json, sys
    from vllm_unified.blas import preload_blas

    first = preload_blas()
    assert preload_blas() is first, "preload_blas() is not idempotent"
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    worst = 0.0
    for m, k, n in [(1, 576, 1536), (16, 576, 1536), (257, 1024, 129), (64, 64, 64)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        got = np.array(mx.array(a) @ mx.array(b))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        worst = max(worst, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
        # A transposed operand goes through the same cblas_sgemm with other flags.
        got_t = np.array(mx.array(b).T @ mx.array(a).T)
        worst = max(worst, float(np.max(np.abs(got_t - ref.T)) / np.max(np.abs(ref))))
    print(json.dumps({"name": first.name, "path": first.path, "reason": first.reason,
                      "err": worst}))
    """
)


def run_child(
    code: str = CHILD, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != blas.BLAS_ENV}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_libraries() -> list[tuple[str, Path]]:
    return [(kind, path) for kind, path in blas.candidates() if path.exists()]


def test_default_preload_is_correct_and_reports_library() -> None:
    out = last_json(run_child())
    assert out["err"] < 1e-5
    found = available_libraries()
    if not found:
        assert out["name"] == "reference"
        assert "no optimized BLAS" in out["reason"]
        return
    kind, path = found[0]
    assert out["name"] == kind
    assert out["path"] == str(path)


def test_mlx_really_calls_the_preloaded_library() -> None:
    """The dynamic linker binds libmlx's cblas_sgemm to the preloaded library."""
    found = available_libraries()
    if not found:
        pytest.skip("no optimized BLAS installed (scripts/setup.sh installs OpenBLAS)")
    proc = run_child(env={"LD_DEBUG": "bindings"})
    out = last_json(proc)
    bindings = [
        line
        for line in proc.stderr.splitlines()
        if "libmlx.so" in line and "`cblas_sgemm'" in line and "binding file" in line
    ]
    assert bindings, "libmlx.so never bound cblas_sgemm"
    real = os.path.realpath(out["path"])
    # e.g. "binding file .../libmlx.so [0] to /usr/lib/.../libopenblas.so.0 [0]: normal symbol"
    assert any(out["path"] in line or real in line for line in bindings), bindings
    assert not any("mlx_cpu.libs/libblas" in line for line in bindings), bindings


def test_none_keeps_the_bundled_reference_blas() -> None:
    out = last_json(run_child(env={blas.BLAS_ENV: "none"}))
    assert out["name"] == "reference"
    assert out["path"] is None
    assert out["err"] < 1e-5


def test_explicit_path() -> None:
    found = available_libraries()
    if not found:
        pytest.skip("no optimized BLAS installed")
    kind, path = found[-1]
    out = last_json(run_child(env={blas.BLAS_ENV: str(path)}))
    assert (out["name"], out["path"]) == (kind, str(path))
    assert out["err"] < 1e-5


def test_explicit_path_that_does_not_load_raises() -> None:
    proc = run_child(env={blas.BLAS_ENV: "/nonexistent/libopenblas.so.0"})
    assert proc.returncode != 0
    assert "OSError" in proc.stderr


def test_too_late_after_mlx_import_warns_and_reports_reference() -> None:
    code = textwrap.dedent(
        """
        import json, logging
        logging.basicConfig(level=logging.WARNING)
        import mlx.core
        from vllm_unified.blas import preload_blas
        info = preload_blas()
        print(json.dumps({"name": info.name, "reason": info.reason}))
        """
    )
    proc = run_child(code)
    out = last_json(proc)
    assert out["name"] == "reference"
    assert "already imported" in out["reason"]
    assert "before importing mlx.core" in proc.stderr


def test_macos_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    info = blas._preload()
    assert (info.name, info.path) == ("accelerate", None)
