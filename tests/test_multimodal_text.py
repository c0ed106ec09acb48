"""Multimodal checkpoints served text-only (their language model, mlx-lm's model for the type):
the torchvision stand-in that lets vLLM inspect their architectures where torchvision is not
installed, the platform's text-only policy, the text config's fix-up and the loader's
language model. Served end to end by tests/test_model_matrix.py (``gemma3`` in the CI tier,
the other multimodal types in the slow tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import model_matrix as mm
import pytest

STUBS = Path(__file__).parent / "stubs"


def _python(code: str, *, path: str | None = None) -> subprocess.CompletedProcess:
    env_path = [str(Path(__file__).parents[1] / "src")] + ([path] if path else [])
    code = "import sys; sys.path[:0] = " + repr(env_path) + "\n" + code
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_stand_in_imports_and_refuses_use():
    """Where torchvision is absent, its imports succeed (the ones transformers' image
    processors make) and any call raises naming the CPU build to install."""
    out = _python(
        "from vllm_unified import torchvision_stand_in as t\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torchvision') is None, 'torchvision is installed'\n"
        "assert t.install() and t.install() and t.installed()\n"
        "import torchvision\n"
        "from torchvision.transforms.v2 import functional as tvF\n"
        "from torchvision.io import ImageReadMode, decode_image\n"
        "assert torchvision.__version__ == t.VERSION\n"
        "try:\n"
        "    tvF.resize(None, [2, 2])\n"
        "except t.TorchvisionMissing as e:\n"
        "    print('refused:', e)\n")
    assert out.returncode == 0, out.stderr
    assert "torchvision.transforms.v2.functional.resize" in out.stdout
    assert "torchvision==0.28.0+cpu" in out.stdout


def test_stand_in_stays_out_when_torchvision_is_found():
    """A torchvision that can be found (here tests/stubs/torchvision) is never shadowed."""
    out = _python("from vllm_unified import torchvision_stand_in as t\n"
                  "print(t.install(), t.installed())", path=str(STUBS))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_text_part_fixup_lays_out_the_language_models_config():
    """A wrapper's text_config gets its language model's own fix-up (Gemma 3's rope thetas
    per layer type and window pattern), on a copy, keeping its model_type."""
    from vllm_unified.models.config import mlx_lm_config

    text = {"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {"full_attention": {"rope_type": "default",
                                                   "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 1e4}}}
    hf = {"model_type": "gemma3", "text_config": text}
    cfg = mlx_lm_config(hf)
    assert cfg["text_config"]["rope_theta"] == 1e6
    assert cfg["text_config"]["rope_local_base_freq"] == 1e4
    assert cfg["text_config"]["sliding_window_pattern"] == 2
    assert cfg["text_config"]["model_type"] == "gemma3_text"
    assert "rope_theta" not in hf["text_config"]  # the caller's config is unchanged
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        mlx_lm_config({"model_type": "gemma3",
                       "text_config": {**text, "final_logit_softcapping": 30.0}})
    with pytest.raises(ValueError, match="no text_config"):
        mlx_lm_config({"model_type": "qwen3_vl"})


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mm")
    result = mm.build_checkpoint("gemma3", root)
    assert result.built, result.build_error
    return root / "gemma3"


def test_matrix_checkpoint_is_as_hf_writes_it(gemma3_checkpoint):
    cfg = json.loads((gemma3_checkpoint / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert cfg["text_config"]["model_type"] == "gemma3_text"
    assert mm.architecture("qwen3_vl") == "Qwen3VLForConditionalGeneration"
    assert mm.architecture("pixtral") == "LlavaForConditionalGeneration"


def test_loader_drives_the_language_model(gemma3_checkpoint):
    """The loaded model is mlx-lm's Gemma 3 language model with its text config, and computes
    what mlx-lm's whole multimodal model computes on text."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    from vllm_unified.models.loader import load_model

    loaded = load_model(gemma3_checkpoint, dtype=mx.float32, keep_quantized=False)
    assert isinstance(loaded.model, gemma3_text.Model)
    assert loaded.config["model_type"] == "gemma3_text"
    reference = mm.load_reference_model(gemma3_checkpoint)
    tokens = mx.array([list(range(100, 120))])
    assert mx.array_equal(loaded.model(tokens), reference(tokens)).item()


@pytest.fixture(scope="module")
def kimi_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kimi")
    for model_type in ("kimi_vl", "kimi_k25"):
        result = mm.build_checkpoint(model_type, root)
        assert result.built, result.build_error
    return root


@pytest.mark.parametrize("model_type", ["kimi_vl", "kimi_k25"])
def test_kimi_language_model_is_served_one_level_up(model_type, kimi_checkpoints):
    """Kimi-VL and Kimi K2.5 load as their DeepSeek-V3 language model with its layers (no
    vision tower built), from the config vLLM reads (its own classes for both), computing
    what mlx-lm's whole model computes; sanitizing takes names with or without
    ``language_model.`` and drops vision weights."""
    import mlx.core as mx
    from mlx_lm.models.deepseek_v3 import DeepseekV3Model
    from vllm.transformers_utils.config import get_config

    from vllm_unified.models.loader import load_model
    from vllm_unified.models.text_parts import TEXT_MODELS

    folder = kimi_checkpoints / model_type
    loaded = load_model(folder, hf_config=get_config(str(folder), trust_remote_code=False),
                        dtype=mx.float32, keep_quantized=False)
    model = loaded.model
    assert isinstance(model, TEXT_MODELS[model_type][0])  # with backbone-relative weights
    assert isinstance(model.model, DeepseekV3Model) and len(model.layers) == 2
    assert not any(n.startswith(("vision", "multi_modal", "mm_")) for n, _ in
                   model.named_modules())
    reference = mm.load_reference_model(folder)
    tokens = mx.array([list(range(100, 120))])
    assert mx.array_equal(model(tokens), reference(tokens)).item()
    weights = {"lm_head.weight": mx.zeros((2, 2)),
               "language_model.model.norm.weight": mx.ones((2,)),
               "vision_tower.patch_embed.weight": mx.zeros((2,)),
               "multi_modal_projector.linear_1.weight": mx.zeros((2,))}
    assert sorted(model.sanitize(weights)) == ["lm_head.weight", "model.norm.weight"]


def test_kimi_k25_without_processor_files_is_served_text_only(kimi_checkpoints):
    """vLLM builds Kimi K2.5's image processor from the checkpoint folder while it reads the
    config; an mlx-lm conversion has no preprocessor_config.json: text-only, not a crash."""
    folder = kimi_checkpoints / "kimi_k25"
    assert not (folder / "preprocessor_config.json").exists()
    cfg = _engine_config(folder)
    assert cfg.model_config.architecture == "KimiK25ForConditionalGeneration"
    assert cfg.model_config.multimodal_config.language_model_only
    assert not cfg.model_config.supports_multimodal_inputs


def test_kernel_registration_skips_modules_it_cannot_scan():
    """With llvmlite loaded (numba, which vLLM's Kimi K2.5 module imports) vLLM's kernel
    registration would raise on its library wrapper; the rejection-sampler kernels are routed
    and the module stays loaded."""
    out = _python("import sys, numba\n"
                  "from vllm_unified import patches\n"
                  "assert list(patches._unscannable_modules()) == ['llvmlite.binding.ffi']\n"
                  "patches.route_rejection_sampler_kernels()\n"
                  "patches.require_rejection_sampler_kernels()\n"
                  "assert 'llvmlite.binding.ffi' in sys.modules\n"
                  "print('routed')")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "routed"


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


def test_platform_serves_multimodal_text_only(gemma3_checkpoint):
    """vLLM accepts the real architecture name (no torchvision installed here) and the
    platform turns on language_model_only: no multimodal input is accepted."""
    cfg = _engine_config(gemma3_checkpoint)
    assert cfg.model_config.architecture == "Gemma3ForConditionalGeneration"
    assert cfg.model_config.multimodal_config.language_model_only
    assert not cfg.model_config.supports_multimodal_inputs


def test_platform_refuses_multimodal_inputs_asked_for(gemma3_checkpoint):
    with pytest.raises(Exception, match="--limit-mm-per-prompt"):
        _engine_config(gemma3_checkpoint, limit_mm_per_prompt={"image": 2})
    cfg = _engine_config(gemma3_checkpoint, limit_mm_per_prompt={"image": 0})
    assert cfg.model_config.multimodal_config.language_model_only


def test_language_model_the_runner_cannot_drive_is_refused_by_name():
    from vllm_unified.models.capability import UnsupportedModel
    from vllm_unified.models.loader import language_model_of

    with pytest.raises(UnsupportedModel, match=r"model type 'gemma3n': .*keys_and_values"):
        language_model_of(object(), {"model_type": "gemma3n"})
    model = object()
    assert language_model_of(model, {"model_type": "llama"}) == (model, {"model_type": "llama"})


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma3", "qwen2_vl", "mistral3"])
def test_text_only_equals_vllm_cpu_backend(model_type, tmp_path):
    """The same multimodal checkpoint served text-only by vLLM's own CPU backend in fp32
    (``language_model_only``; tests/stubs/torchvision lets it import its model module) and by
    ours: greedy ids equal, and equal to mlx-lm's own generation."""
    import os

    from conftest import run_llm

    result = mm.build_checkpoint(model_type, tmp_path / "checkpoints")
    assert result.built, result.build_error
    folder = tmp_path / "checkpoints" / model_type
    prompts = mm.prompts(model_type)
    spec = mm.engine_spec(folder, prompts, mm.NEW_TOKENS, recurrent=False)
    del spec["engine"]["kv_cache_memory_bytes"]  # vLLM's CPU backend sizes by its own setting
    ours = run_llm(spec, tmp_path)
    spec["engine"]["language_model_only"] = True
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(STUBS)) if p)
    native = run_llm(spec, tmp_path, native=True,
                     env={"PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"})

    def ids(out):
        return [o["completions"][0]["token_ids"] for o in out["outputs"]]

    assert ids(ours) == ids(native)
    assert ids(ours) == mm.mlx_lm_reference(folder, prompts, mm.NEW_TOKENS)


@pytest.mark.engine
@pytest.mark.slow
def test_server_refuses_an_image_with_400(gemma3_checkpoint, tmp_path):
    """``vllm serve`` on a multimodal checkpoint answers text and refuses an image (400, the
    modality named) instead of dropping it."""
    import base64
    import io

    import requests
    from conftest import vllm_server
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    model = str(gemma3_checkpoint)
    args = [model, "--dtype", "float32", "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(64 * 2**20)]
    with vllm_server(tmp_path, args) as (base, _):
        content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
        r = requests.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "image" in r.json()["error"]["message"]
        r = requests.post(f"{base}/v1/completions", timeout=120,
                          json={"model": model, "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200, r.text
