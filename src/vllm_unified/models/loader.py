"""Turn a checkpoint (GGUF file or HF/MLX safetensors folder) into an mlx-lm model.

Architectures come from mlx-lm (``mlx_lm.models.<model_type>``); this module only decides the
config mlx-lm is built with, where the weights come from, and whether they stay quantized:

* folders are loaded by mlx-lm itself (``mlx_lm.utils.load_model``: its sanitize, its
  quantization handling, strict weight checking), with the config laid out as mlx-lm reads it
  first (:func:`vllm_unified.models.config.mlx_lm_config`);
* GGUF files are read by :mod:`vllm_unified.models.gguf` (MLX's reader where it is exact),
  renamed to HF names, un-permuted (Llama Q/K) and un-shifted (Gemma norms), then loaded
  strictly into the mlx-lm model.

Whether the loaded model's layers can be driven by the paged cache is decided afterwards, by
:mod:`vllm_unified.models.capability`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from vllm_unified.distributed.pipeline import PipelineStage
from vllm_unified.models.activations import match_config_activations
from vllm_unified.models.backbone_weights import with_backbone_weights
from vllm_unified.models.bitlinear import replace_bitlinears
from vllm_unified.models.cache_fixes import match_cache_windows
from vllm_unified.models.capability import UnsupportedModel
from vllm_unified.models.config import mlx_lm_config, model_classes
from vllm_unified.models.gguf import (
    MLX_GROUP_SIZES,
    QuantizedTensor,
    describe_weights,
    gguf_to_hf_name,
    read_gguf_index,
    read_gguf_tensors,
    split_fused_experts,
    unpermute_rows,
)
from vllm_unified.models.gguf_dir import gguf_hf_config
from vllm_unified.models.multipliers import apply_config_multipliers
from vllm_unified.models.pipeline_layers import prune_model
from vllm_unified.models.rope_fixes import match_yarn_truncation

__all__ = ["LoadedModel", "check_dtype_supported", "load_model"]

logger = logging.getLogger("vllm.vllm_unified.models.loader")

# GGUF general.architecture -> HF model type.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                       "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


@dataclass
class LoadedModel:
    """A loaded mlx-lm model and how it was built.

    model: the mlx-lm ``Model`` (``model.model.layers``, ``model.model.embed_tokens``, and
        ``model.lm_head`` unless embeddings are tied); evaluated, in eval mode.
    config: the HF-style config dict mlx-lm's ``ModelArgs`` was built from (normalised:
        ``rope_theta`` and ``rope_scaling`` at top level, Gemma's ``sliding_window_pattern``).
    dtype: compute dtype of every non-quantized floating weight (and of quantization scales).
    quantized: whether any ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` /
        ``QuantizedSwitchLinear`` (mixture-of-experts) remains.
    source: ``"gguf"`` or ``"safetensors"``.
    pooling_head: a pooling model's classifier tensors the mlx-lm model has no layer for
        (``score.weight``, ``score.bias`` of a ``*ForSequenceClassification`` checkpoint),
        as stored; empty otherwise.
    """

    model: nn.Module
    config: dict
    dtype: mx.Dtype
    quantized: bool
    source: str
    pooling_head: dict[str, mx.array] = field(default_factory=dict)


def load_model(
    path: str | Path,
    *,
    hf_config: Mapping[str, Any] | Any | None = None,
    dtype: mx.Dtype,
    keep_quantized: bool,
    native_kernels: bool = False,
    stage: PipelineStage | None = None,
    max_model_len: int | None = None,
    pooling: bool = False,
) -> LoadedModel:
    """Load ``path`` into an mlx-lm model.

    Args:
        path: a ``.gguf`` file, or a folder with ``config.json`` and ``model*.safetensors``.
        hf_config: the HF config as vLLM has it (dict or ``transformers.PretrainedConfig``).
            If None it is read with transformers (``AutoConfig.from_pretrained``, with
            ``gguf_file=`` for GGUF), as vLLM would. For folders it is laid over
            ``config.json``, so transformers' defaults (not mlx-lm's) fill absent keys.
        dtype: compute dtype (``mx.float32``, ``mx.bfloat16``, ``mx.float16``) for all
            non-quantized floating weights and for quantization scales/biases.
        keep_quantized: keep quantized weights quantized (``nn.QuantizedLinear`` /
            ``nn.QuantizedEmbedding``, MLX affine) where MLX can hold them exactly; otherwise
            dequantize them once, here, to ``dtype``.
        native_kernels: the native CPU kernels will run every ``nn.QuantizedLinear`` and
            ``nn.QuantizedEmbedding`` (MLX's CPU backend, fp32, the extension built:
            ``cpu_kernels.keep_quantized_on_cpu``), so formats only they take are used: GGUF
            Q6_K / Q3_K / Q2_K layers stay quantized as 6 / 3 / 2-bit groups of 16, which MLX's
            own quantized ops refuse (off: they are dequantized), and scales and biases stay
            16-bit where they are exactly so (:func:`held_scales`; off: cast to ``dtype``).
        stage: the pipeline stage this process runs (``--pipeline-parallel-size``): only its
            layers' weights are evaluated and kept (:func:`~vllm_unified.distributed.pipeline.
            prune_model`). None: the whole model.
        max_model_len: vLLM's context length, for config choices vLLM makes by it
            (LongRoPE's short or long factors); None: vLLM's default (the model's maximum).
        pooling: the model serves vLLM's pooling runner: a folder of backbone weights
            without an LM head loads, a classifier's ``score`` tensors are kept aside
            (``LoadedModel.pooling_head``; :mod:`vllm_unified.models.backbone_weights`).

    Raises:
        ValueError: unsupported architecture or config feature, GGUF tensor without a
            counterpart in the model, missing or unexpected weights, wrong shapes.
        FileNotFoundError: ``path`` does not exist or a folder lacks config/weights.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    start = time.perf_counter()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{str(path)!r}: expected a .gguf file or a checkpoint folder")
        loaded = _load_gguf(path, hf_config, dtype, keep_quantized, native_kernels, stage,
                            max_model_len)
    else:
        loaded = _load_folder(path, hf_config, dtype, keep_quantized, native_kernels, stage,
                              max_model_len, pooling)
    logger.info("Loaded %s (%s, %s, %s) in %.2f s", path.name, loaded.config["model_type"],
                loaded.source, "quantized" if loaded.quantized else f"dense {dtype}",
                time.perf_counter() - start)
    return loaded


# ----------------------------------------------------------------------------- config


def _as_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"hf_config must be a dict or a transformers config, not {type(config)}")


# ----------------------------------------------------------------------------- GGUF


def _gguf_hf_config(path: Path) -> dict[str, Any]:
    return gguf_hf_config(path).to_dict()


def _load_gguf(
    path: Path, hf_config: Any, dtype: mx.Dtype, keep_quantized: bool, native_kernels: bool,
    stage: PipelineStage | None, max_model_len: int | None,
) -> LoadedModel:
    index = read_gguf_index(path)
    arch = index.architecture
    model_type = _GGUF_ARCHITECTURES.get(arch)
    if model_type is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(_GGUF_ARCHITECTURES)})")
    hf = _as_dict(hf_config) if hf_config is not None else _gguf_hf_config(path)
    if hf.get("model_type") != model_type:
        raise ValueError(f"hf_config model_type {hf.get('model_type')!r} does not match the "
                         f"GGUF architecture {arch!r} ({model_type})")
    config = mlx_lm_config(hf, max_model_len=max_model_len)
    tensors = read_gguf_tensors(path, index, quantized=keep_quantized,
                                group16=keep_quantized and native_kernels)
    tensors = {name: held_scales(t, dtype, native_kernels) if isinstance(t, QuantizedTensor)
               else t for name, t in tensors.items()}
    for line in describe_weights(index, tensors, dtype):
        logger.info("GGUF weights %s", line)

    n_heads = int(config["num_attention_heads"])
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    weights: dict[str, mx.array | QuantizedTensor] = {}
    hf_to_gguf: dict[str, str] = {}
    parts = (part for item in tensors.items() for part in split_fused_experts(*item))
    for name, tensor in parts:
        if name == "rope_freqs.weight":
            # llama.cpp stores Llama 3 RoPE frequency factors; mlx-lm derives the same ones
            # from rope_scaling, so the tensor is redundant only if that is set.
            if (config.get("rope_scaling") or {}).get("rope_type") != "llama3":
                raise ValueError("GGUF tensor 'rope_freqs.weight' needs llama3 rope_scaling in "
                                 "the config, which is absent")
            continue
        hf_name = gguf_to_hf_name(name, model_type)
        if model_type == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = n_heads if ".attn_q." in name else n_kv_heads
            tensor = _map_rows(tensor, lambda x, h=heads: unpermute_rows(x, h))
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's RMSNorm scale as 1 + w; mlx-lm (like HF) adds the 1
            tensor = _dense(tensor, name) - 1.0
        weights[hf_name] = tensor
        hf_to_gguf[hf_name] = name

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    match_yarn_truncation(model, config)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if stage is not None and stage.size > 1:
        prune_model(model, stage, model_type)
        weights = _held_weights(model, weights)

    quantized_layers = {k.removesuffix(".weight"): v for k, v in weights.items()
                        if isinstance(v, QuantizedTensor)}
    if quantized_layers:
        def predicate(p: str, m: nn.Module) -> dict[str, Any] | bool:
            qt = quantized_layers.get(p)
            if qt is None:
                return False
            # groups MLX cannot make (16) are built as 32 and resized below
            return {"group_size": qt.group_size if qt.group_size in MLX_GROUP_SIZES else 32,
                    "bits": qt.bits, "mode": qt.mode}

        nn.quantize(model, class_predicate=predicate)
        _resize_groups(model, quantized_layers)

    flat: dict[str, mx.array] = {}
    for name, value in weights.items():
        if isinstance(value, QuantizedTensor):
            base = name.removesuffix(".weight")
            flat[name] = value.weight
            flat[f"{base}.scales"] = value.scales  # as held_scales made them
            if value.biases is not None:  # mxfp4 has none
                flat[f"{base}.biases"] = value.biases
        else:
            flat[name] = value.astype(dtype)
    _check_names(model, flat, hf_to_gguf, f"GGUF {arch}")
    model.load_weights(list(flat.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return LoadedModel(model, config, dtype, _has_quantized(model), "gguf")


def held_scales(t: QuantizedTensor, dtype: mx.Dtype, native_kernels: bool) -> QuantizedTensor:
    """``t`` with the scales and biases it is held with: float16 when the native CPU kernels run
    it (``native_kernels``, compute dtype float32) and both convert to float16 and back exactly
    (GGUF Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store their scale and minimum as float16, and the
    biases -8d, -16d, -128d are exact too), else ``dtype``. The kernels widen them back to
    float32 exactly as they read them, so results are unchanged; the K-quants' scales (a float16
    times a 6- or 8-bit integer) need float32. Stacked experts (3-D) alike: the native expert
    kernel (``gather_quantized_linear``) widens them the same way. MXFP4's e8m0 scales stay as
    they are."""
    if t.mode != "affine":
        return t
    assert t.biases is not None  # affine triples always have them
    if native_kernels and dtype == mx.float32:
        s16, b16 = t.scales.astype(mx.float16), t.biases.astype(mx.float16)
        exact = (mx.array_equal(s16.astype(mx.float32), t.scales.astype(mx.float32))
                 and mx.array_equal(b16.astype(mx.float32), t.biases.astype(mx.float32)))
        if exact:
            return QuantizedTensor(t.weight, s16, b16, t.bits, t.source_type, t.group_size)
    return QuantizedTensor(t.weight, t.scales.astype(dtype), t.biases.astype(dtype), t.bits,
                           t.source_type, t.group_size)


def _held_weights(model: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without those of the modules :func:`prune_model` removed (another pipeline
    stage's layers, embedding, norm or LM head); any other name is kept for
    :func:`_check_names` to judge."""
    expected = {k for k, _ in tree_flatten(model.parameters())}
    return {k: v for k, v in weights.items() if k in expected or not _STAGE_OWNED.match(k)}


#: weight names a pipeline stage may not hold (mlx-lm / HF names)
_STAGE_OWNED = re.compile(r"^(model\.layers\.\d+\.|model\.embed_tokens\.|model\.norm\.|"
                          r"lm_head\.)")


def _resize_groups(model: nn.Module, layers: Mapping[str, QuantizedTensor]) -> None:
    """Give the layers whose groups MLX cannot make (groups of 16, for the native CPU
    kernels: ``read_gguf_tensors(group16=True)``) their group size and scales/biases of the
    loaded shapes (the values are loaded next). Only ``nn.QuantizedLinear`` and
    ``nn.QuantizedEmbedding`` may have them (both run natively: models/cpu_kernels.py)."""
    modules = dict(model.named_modules())
    for name, qt in layers.items():
        if qt.group_size in MLX_GROUP_SIZES:
            continue
        module = modules[name]
        if type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            raise ValueError(f"{name}: groups of {qt.group_size} ({qt.source_type}) are only "
                             f"supported for linear and embedding layers, not "
                             f"{type(module).__name__}")
        module.group_size = qt.group_size
        module.scales = mx.zeros(qt.scales.shape, dtype=module.scales.dtype)
        module.biases = mx.zeros(qt.biases.shape, dtype=module.biases.dtype)


def _map_rows(
    t: mx.array | QuantizedTensor, fn: Callable[[mx.array], mx.array]
) -> mx.array | QuantizedTensor:
    return t.map_rows(fn) if isinstance(t, QuantizedTensor) else fn(t)


def _dense(t: mx.array | QuantizedTensor, name: str) -> mx.array:
    if isinstance(t, QuantizedTensor):
        raise ValueError(f"GGUF tensor {name!r} is quantized ({t.source_type}) but must be dense")
    return t.astype(mx.float32)


def _check_names(model: nn.Module, weights: Mapping[str, mx.array],
                 hf_to_gguf: Mapping[str, str], what: str) -> None:
    """ValueError listing missing and unexpected weights, with their GGUF names."""
    expected = {k for k, _ in tree_flatten(model.parameters())}
    given = set(weights)

    def show(names: set[str]) -> str:
        items = sorted(names)
        shown = ", ".join(f"{n} (from {hf_to_gguf[n]})" if n in hf_to_gguf else n
                          for n in items[:8])
        return shown + (f", ... ({len(items)} in all)" if len(items) > 8 else "")

    problems = []
    if missing := expected - given:
        problems.append(f"missing: {show(missing)}")
    if unexpected := given - expected:
        problems.append(f"not in the model: {show(unexpected)}")
    if problems:
        raise ValueError(f"{what}: checkpoint does not match the mlx-lm model; "
                         + "; ".join(problems))


# ----------------------------------------------------------------------------- folders


def _load_folder(
    path: Path, hf_config: Any, dtype: mx.Dtype, keep_quantized: bool, native_kernels: bool,
    stage: PipelineStage | None, max_model_len: int | None, pooling: bool = False,
) -> LoadedModel:
    from mlx_lm.utils import dequantize_model, load_config
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json")
    if not any(path.glob("model*.safetensors")):
        raise FileNotFoundError(f"{str(path)!r} has no model*.safetensors")
    raw = load_config(path)
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(path))
    config = mlx_lm_config({**raw, **_as_dict(hf_config)}, max_model_len=max_model_len)
    head: dict[str, mx.array] = {}
    try:
        model, config = mlx_lm_load_model(
            path, lazy=True, strict=True, model_config=config,
            get_model_classes=lambda config: _backbone_classes(config, pooling, head))
    except TypeError as e:  # ModelArgs missing a field its dataclass requires
        raise ValueError(f"model type {config['model_type']!r}: the config does not fit "
                         f"mlx-lm's ModelArgs ({e})") from e
    match_config_activations(model, config)
    replace_bitlinears(model)
    model, config = language_model_of(model, config)
    apply_config_multipliers(model, config)
    match_yarn_truncation(model, config)
    match_cache_windows(model, config)
    if stage is not None and stage.size > 1:  # before any weight is read (they load lazily)
        prune_model(model, stage, config["model_type"])
    if not keep_quantized and _has_quantized(model):
        model = dequantize_model(model)
    model.update(_cast_floats(model.parameters(), dtype,
                              keep_16bit_scales=native_kernels and dtype == mx.float32))
    model.eval()
    mx.eval(model.parameters())
    mx.eval(head)
    return LoadedModel(model, config, dtype, _has_quantized(model), "safetensors", head)


def _backbone_classes(config: Mapping[str, Any], pooling: bool,
                      head: dict[str, mx.array]) -> tuple[type, type]:
    """:func:`model_classes`, its ``Model`` also taking backbone-relative weights (and, for
    pooling, putting a classifier's tensors into ``head``)."""
    model_class, args_class = model_classes(config)
    return with_backbone_weights(model_class, pooling, head), args_class


#: multimodal model types whose mlx-lm ``Model`` only hands its inputs to ``language_model``
#: (an mlx-lm text model of its own type), vision weights dropped by its ``sanitize``
#: (``llava``: HF's Pixtral, which mlx-lm loads with its ``mistral3`` module; ``qwen2_5_vl``:
#: its ``qwen2_vl`` module)
TEXT_PART_WRAPPERS = frozenset({"gemma3", "gemma4", "mistral3", "pixtral", "llava",
                                "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                                "lfm2-vl"})


#: multimodal model types whose language model the runner cannot drive yet -> what is missing
UNSUPPORTED_MULTIMODAL = {
    "gemma3n": "Gemma 3n's KV sharing (its last layers read the keys and values another "
               "layer's mlx-lm cache object holds, keys_and_values())",
}


def language_model_of(model: nn.Module, config: dict[str, Any]) -> tuple[nn.Module, dict]:
    """For a multimodal type of :data:`TEXT_PART_WRAPPERS`, its language model and that
    model's config (``text_config`` as mlx-lm built it, ``model_type`` the language model's
    mlx-lm type: ``gemma3_text``, ``llama``, ``qwen3``, ...), which the runner then drives
    as any text model; anything else unchanged.

    Raises:
        UnsupportedModel: a type of :data:`UNSUPPORTED_MULTIMODAL`, naming what is missing.
    """
    if config.get("model_type") in UNSUPPORTED_MULTIMODAL:
        raise UnsupportedModel(config["model_type"], UNSUPPORTED_MULTIMODAL[config["model_type"]])
    if config.get("model_type") not in TEXT_PART_WRAPPERS:
        return model, config
    inner = model.language_model
    text = {**config["text_config"], "model_type": type(inner).__module__.rsplit(".", 1)[-1]}
    logger.info("%s: serving its language model (mlx-lm %s)", config["model_type"],
                text["model_type"])
    return inner, text


def _cast_floats(tree: Any, dtype: mx.Dtype, keep_16bit_scales: bool = False) -> Any:
    """Every floating array of ``tree`` cast to ``dtype``; with ``keep_16bit_scales`` (the
    native CPU kernels run the quantized layers and widen 16-bit scales exactly as they read
    them) quantized layers' float16 / bfloat16 ``scales`` and ``biases`` stay as stored."""
    from mlx.utils import tree_map_with_path

    def cast(path: str, x: Any) -> Any:
        if not isinstance(x, mx.array) or not mx.issubdtype(x.dtype, mx.floating):
            return x
        if (keep_16bit_scales and path.rsplit(".", 1)[-1] in ("scales", "biases")
                and x.dtype in (mx.float16, mx.bfloat16)):
            return x
        return x.astype(dtype)

    return tree_map_with_path(cast, tree)


def check_dtype_supported(model: nn.Module, dtype: mx.Dtype, backend: str) -> None:
    """Refuse what MLX cannot run here: on MLX's CPU backend mixture-of-experts layers
    (``gather_mm``, mlx-lm's ``SwitchLinear``) compute in float32 only (MLX 0.32.4 raises
    "[GatherMM::eval] Currently only supports float32." at the first forward).

    Raises:
        ValueError: naming ``--dtype``.
    """
    from mlx_lm.models.switch_layers import SwitchLinear

    if backend == "cpu" and dtype != mx.float32 and any(
        isinstance(m, SwitchLinear) for _, m in model.named_modules()
    ):
        raise ValueError(f"--dtype {str(dtype).removeprefix('mlx.core.')}: this model's "
                         "mixture-of-experts layers run in float32 only on MLX's CPU backend; "
                         "use --dtype float32 (auto takes the checkpoint's dtype)")


def _has_quantized(model: nn.Module) -> bool:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear)
               for _, m in model.named_modules())
