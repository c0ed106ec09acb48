"""Every VLLM_UNIFIED_* setting in one module (vllm_unified.envs): typed, validated, listed."""

from __future__ import annotations

import pytest

from vllm_unified import envs


def test_defaults_when_unset_or_empty() -> None:
    for name, setting in envs.SETTINGS.items():
        assert envs.read(name, {}) == setting.default
        assert envs.read(name, {name: "  "}) == setting.default


@pytest.mark.parametrize("bad", ["true", "yes", "2", "on", "-1"])
def test_bools_take_only_0_or_1(bad) -> None:
    assert envs.read(envs.COMPILE_DECODE_ENV, {envs.COMPILE_DECODE_ENV: "0"}) is False
    assert envs.read(envs.KV_EAGER_ZERO_ENV, {envs.KV_EAGER_ZERO_ENV: " 1 "}) is True
    with pytest.raises(ValueError, match=f"{envs.CPU_QUANTIZED_ENV}='{bad}': expected 0 or 1"):
        envs.read(envs.CPU_QUANTIZED_ENV, {envs.CPU_QUANTIZED_ENV: bad})


def test_counts() -> None:
    assert envs.read(envs.MAX_N_ENV, {envs.MAX_N_ENV: "4"}) == 4
    assert envs.read(envs.STEP_PROFILE_ENV, {envs.STEP_PROFILE_ENV: "0"}) == 0
    for name, bad in ((envs.MAX_N_ENV, "0"), (envs.CPU_THREADS_ENV, "two"),
                      (envs.MAX_REQUEST_BYTES_ENV, "1MB"), (envs.STEP_PROFILE_ENV, "-5")):
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            envs.read(name, {name: bad})


def test_choices() -> None:
    assert envs.read(envs.DEVICE_ENV, {envs.DEVICE_ENV: "CPU"}) == "cpu"
    with pytest.raises(ValueError, match=f"{envs.DEVICE_ENV}='tpu': expected one of metal"):
        envs.read(envs.DEVICE_ENV, {envs.DEVICE_ENV: "tpu"})
    with pytest.raises(ValueError, match=f"{envs.CPU_ISA_ENV}='avx-2'"):
        envs.read(envs.CPU_ISA_ENV, {envs.CPU_ISA_ENV: "avx-2"})


def test_attribute_access_reads_os_environ(monkeypatch) -> None:
    monkeypatch.setenv(envs.MAX_N_ENV, "7")
    assert envs.MAX_N == 7
    monkeypatch.setenv(envs.MAX_N_ENV, "seven")
    with pytest.raises(ValueError, match=envs.MAX_N_ENV):
        _ = envs.MAX_N
    with pytest.raises(AttributeError):
        _ = envs.NO_SUCH_SETTING


def test_validate_raises_on_a_bad_value_and_returns_unknown_names() -> None:
    environ = {"VLLM_UNIFIED_MAX_NN": "4", "VLLM_UNIFIED_VISIBLE_DEVICES": "0",
               envs.MAX_N_ENV: "4", "VLLM_OTHER": "1", "VLLM_UNIFIED_BLASS": "none"}
    assert envs.validate(environ) == ["VLLM_UNIFIED_BLASS", "VLLM_UNIFIED_MAX_NN"]
    with pytest.raises(ValueError, match=f"{envs.DISABLE_ENV}='true'"):
        envs.validate({**environ, envs.DISABLE_ENV: "true"})


def test_name_constants_and_table_cover_every_setting() -> None:
    constants = {v for k, v in vars(envs).items()
                 if k.endswith("_ENV") and k != "VISIBLE_DEVICES_ENV"}
    assert constants == set(envs.SETTINGS)
    table = envs.describe()
    assert all(f"`{name}`" in table for name in envs.SETTINGS)


def test_platform_warns_about_unknown_names(monkeypatch, caplog) -> None:
    import logging

    from vllm_unified.platform import MLXPlatform

    monkeypatch.setenv("VLLM_UNIFIED_MAXN", "4")
    with caplog.at_level(logging.WARNING):
        MLXPlatform.validate_environ(hard_fail=False)
    assert "VLLM_UNIFIED_MAXN" in caplog.text
    with pytest.raises(ValueError, match="VLLM_UNIFIED_MAXN"):
        MLXPlatform.validate_environ(hard_fail=True)


def test_docs_table_is_describe() -> None:
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert envs.describe() in docs.read_text()
