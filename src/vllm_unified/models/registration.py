"""Let vLLM accept checkpoints of the mlx-lm model types that transformers and vLLM do not know.

vLLM reads a checkpoint's config through transformers (``AutoConfig``, or vLLM's own config
classes) and checks its ``architectures`` against its model registry before any worker runs.
For an mlx-lm type neither knows (``internlm2`` without remote code, ``openelm``, ``plamo``,
...) both steps fail, although our worker builds the model from mlx-lm alone. So the plugin
registers, in every vLLM process (:func:`register_mlx_lm_types`, from the general-plugin entry
point):

* with transformers (its public ``AutoConfig.register``), a config class per such type:
  :class:`MLXLMConfig`, the config.json as mlx-lm reads it, plus the standard names vLLM reads
  (``num_hidden_layers``, ``hidden_size``, ...) where the type spells them differently;
* with vLLM (its public ``ModelRegistry.register_model``), when such a config is read, each of
  its ``architectures`` that vLLM has no class for, as :class:`MLXLMOnlyModel`: a text-
  generation model whose torch class is never built (our worker runs mlx-lm's).

Nothing is registered for a type transformers or vLLM already knows: their classes stay in
charge. The exception are mlx-lm's hybrid (attention + recurrent) architectures vLLM has no
class for (:data:`MLX_LM_HYBRID_ARCHITECTURES`), registered as :class:`MLXLMHybridModel` even
where transformers knows their config: vLLM must see them as hybrid (state pages next to
attention pages). The shapes and dtypes of
their states are not derived from the config: the worker records them from mlx-lm's own
caches after its load-time probe step (:func:`record_state_layout`), before vLLM sizes the
state pages in that process. Those without attention layers
(:data:`MLX_LM_ATTENTION_FREE_ARCHITECTURES`, RWKV-7) are registered as
:class:`MLXLMAttentionFreeModel`: state pages only.

Imports no MLX (vLLM may fork after loading plugins): mlx-lm's model types are the file names
of its ``models`` folder.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from vllm_unified import compat

__all__ = ["ENCODER_TYPES_AT_TOP", "MLX_LM_ATTENTION_FREE_ARCHITECTURES",
           "MLX_LM_HYBRID_ARCHITECTURES", "as_image_text_config",
           "MLXLMAttentionFreeModel", "MLXLMConfig", "MLXLMHybridModel", "MLXLMOnlyModel",
           "mlx_lm_model_types", "record_state_layout", "register_mlx_lm_types"]

logger = logging.getLogger("vllm.vllm_unified.models.registration")

#: modules of mlx_lm/models that are building blocks, not model types
_HELPER_MODULES = frozenset({
    "__init__", "base", "cache", "rope_utils", "switch_layers", "activations", "gated_delta",
    "mla", "ssm", "pipeline", "bitlinear_layers",
})

#: the name vLLM reads -> the names mlx-lm's model types use for it, first match wins
_STANDARD_NAMES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers", "num_transformer_layers"),
    "hidden_size": ("n_embd", "d_model", "hidden_dim", "model_dim", "dim"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads", "num_query_heads"),
    "num_key_value_heads": ("n_kv_heads", "num_kv_heads", "multi_query_group_num"),
    "max_position_embeddings": ("n_positions", "n_ctx", "block_size", "model_max_length",
                                "seq_length"),
}

#: names vLLM reads the KV head count from (ahead of ``num_key_value_heads``)
_VLLM_KV_HEAD_NAMES = ("n_head_kv", "num_kv_heads", "multi_query_group_num",
                       "num_attention_groups")
#: standard names whose mlx-lm spelling may hold one count per layer
_PER_LAYER_COUNTS = frozenset({"num_attention_heads", "num_key_value_heads"})


def mlx_lm_model_types() -> list[str]:
    """mlx-lm's model types (the modules of ``mlx_lm/models`` except building blocks), found
    without importing mlx-lm; empty when mlx-lm is not installed."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(list(spec.submodule_search_locations)[0]) / "models"
    return sorted(p.stem for p in folder.glob("*.py") if p.stem not in _HELPER_MODULES)


class AttributeDict(dict):
    """A config dict whose keys read as attributes too, an absent key as None: what vLLM reads
    of DeciLM's per-layer ``block_configs`` (``block.attention.no_op``), which its remote
    config code makes dataclasses with those defaults. Still a dict: JSON and mlx-lm take it
    as written."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)


def _attribute_dicts(value: Any) -> Any:
    if isinstance(value, dict):
        return AttributeDict({k: _attribute_dicts(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_attribute_dicts(v) for v in value]
    return value


class MLXLMConfig(PretrainedConfig):
    """The config.json of an mlx-lm model type transformers has no class for, as mlx-lm reads
    it (every key kept as given), with the standard names vLLM reads (``num_hidden_layers``,
    ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``max_position_embeddings``) taken from the type's own spelling where the standard one is
    absent (:data:`_STANDARD_NAMES`; per-layer head counts give vLLM their largest, and
    :meth:`to_dict` the lists). A ``text_config`` dict (mlx-lm's wrappers of a language
    model) becomes an :class:`MLXLMConfig` of its own, which vLLM reads as the text
    config. Subclassed once per model type by :func:`register_mlx_lm_types`."""

    model_type = ""

    def __post_init__(self, **kwargs: Any) -> None:
        # transformers 5 makes every config class a dataclass: keys that are not fields (all
        # of ours) arrive here
        text = kwargs.get("text_config")
        if isinstance(text, dict):
            kwargs["text_config"] = MLXLMConfig(**text)
        if isinstance(kwargs.get("block_configs"), list):  # DeciLM (nemotron-nas)
            kwargs["block_configs"] = _attribute_dicts(kwargs["block_configs"])
        for standard, spellings in _STANDARD_NAMES.items():
            if kwargs.get(standard) is None:
                value = next((kwargs[s] for s in spellings if kwargs.get(s) is not None), None)
                if isinstance(value, list | tuple) and standard in _PER_LAYER_COUNTS:
                    # per-layer counts (OpenELM's heads): vLLM takes one number; the largest
                    # bounds every layer (the worker sizes each layer's pages by its own)
                    value = max(int(v) for v in value)
                if value is not None:
                    kwargs[standard] = value
        # vLLM reads KV heads under these names before num_key_value_heads: one number each
        # for vLLM, the per-layer lists kept for mlx-lm (:meth:`to_dict`)
        per_layer = {k: kwargs[k] for k in _VLLM_KV_HEAD_NAMES
                     if isinstance(kwargs.get(k), list | tuple)}
        kwargs.update({k: max(int(v) for v in values) for k, values in per_layer.items()})
        super().__post_init__(**kwargs)
        self._per_layer_counts = per_layer
        if type(self).model_type:
            _register_architectures(self.architectures or ())

    def to_dict(self) -> dict[str, Any]:
        """The config as mlx-lm reads it: per-layer head counts as the lists given."""
        out = super().to_dict()
        out.pop("_per_layer_counts", None)
        out.update(getattr(self, "_per_layer_counts", {}))
        return out

    def get_text_config(self, *args: Any, **kwargs: Any) -> PretrainedConfig:
        text = getattr(self, "text_config", None)
        return text if isinstance(text, PretrainedConfig) else self


class MLXLMOnlyModel(torch.nn.Module):
    """What vLLM's model registry holds for an architecture only mlx-lm defines: a text-
    generation model (the interface vLLM's registry inspects) that vllm-unified's worker
    serves with mlx-lm's own model. vLLM never builds it on this platform; building or calling
    it raises.

    Raises:
        RuntimeError: on construction, naming vllm-unified.
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        raise RuntimeError(
            "this architecture is defined only by mlx-lm: vllm-unified's worker serves it; "
            "vLLM's own model runner cannot build it")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("MLXLMOnlyModel is never run")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("MLXLMOnlyModel is never run")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("MLXLMOnlyModel is never run")


#: architectures of mlx-lm hybrid model types vLLM has no class for -> the model type
MLX_LM_HYBRID_ARCHITECTURES: dict[str, str] = {
    "RecurrentGemmaForCausalLM": "recurrent_gemma",
    "Plamo2ForCausalLM": "plamo2",
    "BaichuanM1ForCausalLM": "baichuan_m1",
    "RWKV7ForCausalLM": "rwkv7",
    # a Hadamard-rotated 2-bit pack of a Qwen3.5 text model (gated delta-net + attention)
    "PrismHadamardQwen35ForCausalLM": "prism_hadamard_qwen35",
    # Ling linear (lightning attention + GQA attention): vLLM's class of a similar name,
    # BailingMoeV2_5ForCausalLM, is Ling 2.5 (mlx-lm's bailing_hybrid: MLA attention layers,
    # other layers linear, a head_dim from the config), so its state pages are not this
    # model's
    "BailingMoeLinearForCausalLM": "bailing_moe_linear",
    # Ling 2.5 under mlx-lm's type name; checkpoints naming vLLM's BailingMoeV2_5ForCausalLM
    # get their state pages from vLLM's class (the same shapes)
    "BailingHybridForCausalLM": "bailing_hybrid",
}
#: those of :data:`MLX_LM_HYBRID_ARCHITECTURES` without attention layers (state pages only)
MLX_LM_ATTENTION_FREE_ARCHITECTURES = frozenset({"RWKV7ForCausalLM"})

#: architecture -> (state shapes, torch dtypes) of one recurrent layer, per sequence, as
#: mlx-lm's own cache held them after the worker's probe step (this process only)
_STATE_LAYOUTS: dict[str, tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]] = {}


def record_state_layout(architecture: str, shapes: Iterable[Iterable[int]],
                        dtypes: Iterable[torch.dtype]) -> None:
    """Record the per-sequence state shapes and dtypes of ``architecture``'s recurrent layers
    (what :class:`MLXLMHybridModel` tells vLLM in this process)."""
    _STATE_LAYOUTS[architecture] = (tuple(tuple(int(d) for d in s) for s in shapes),
                                    tuple(dtypes))


class MLXLMHybridModel(MLXLMOnlyModel):
    """:class:`MLXLMOnlyModel` of a hybrid (attention + recurrent) architecture only mlx-lm
    defines: vLLM gives its recurrent layers state pages of the shapes the worker recorded
    from mlx-lm's caches (:func:`record_state_layout`). Subclassed once per architecture.

    Raises:
        RuntimeError: state shapes asked for before the worker recorded them (a process that
            has not loaded the model).
    """

    is_hybrid = True
    #: the architecture this subclass stands for
    architecture = ""

    @classmethod
    def _layout(cls) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
        layout = _STATE_LAYOUTS.get(cls.architecture)
        if layout is None:
            raise RuntimeError(f"{cls.architecture}: the recurrent state shapes come from "
                               "mlx-lm's caches once vllm-unified's worker has loaded the "
                               "model; none recorded in this process")
        return layout

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], ...]:
        return cls._layout()[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[torch.dtype, ...]:
        return cls._layout()[1]

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        raise RuntimeError(f"{cls.architecture}: vLLM's state copies (prefix caching of "
                           "hybrid models) are not supported by vllm-unified")


class MLXLMAttentionFreeModel(MLXLMHybridModel):
    """:class:`MLXLMHybridModel` of an architecture without attention layers (vLLM's
    ``IsAttentionFree``, like its Mamba): every layer is on state pages."""

    is_hybrid = False
    is_attention_free = True
    has_inner_state = True


#: architectures this process registered as :class:`MLXLMHybridModel`
_HYBRIDS_REGISTERED: set[str] = set()


def _register_hybrid_architectures() -> None:
    """Register each of :data:`MLX_LM_HYBRID_ARCHITECTURES` vLLM has no class for as an
    :class:`MLXLMHybridModel` of its own."""
    registry = compat.ModelRegistry
    for arch in MLX_LM_HYBRID_ARCHITECTURES:
        if arch in _HYBRIDS_REGISTERED or arch in registry.get_supported_archs():
            continue
        base = (MLXLMAttentionFreeModel if arch in MLX_LM_ATTENTION_FREE_ARCHITECTURES
                else MLXLMHybridModel)
        cls = type(f"MLXLMHybrid_{arch}", (base,),
                   {"architecture": arch, "__module__": __name__})
        registry.register_model(arch, cls)
        _HYBRIDS_REGISTERED.add(arch)


def _register_architectures(architectures: Iterable[str]) -> None:
    """Register each of ``architectures`` vLLM has no class for as :class:`MLXLMOnlyModel`."""
    registry = compat.ModelRegistry
    for arch in architectures:
        if arch not in registry.get_supported_archs():
            registry.register_model(arch, MLXLMOnlyModel)
            logger.info("vllm-unified: architecture %s (an mlx-lm model type vLLM does not "
                        "define) registered for vllm-unified's worker", arch)


def register_mlx_lm_types() -> list[str]:
    """Register :class:`MLXLMConfig` with transformers for every mlx-lm model type that neither
    transformers nor vLLM has a config class for. Idempotent.

    Returns:
        The model types registered by this call.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    _register_hybrid_architectures()
    done = []
    for model_type in mlx_lm_model_types():
        if model_type in CONFIG_MAPPING or compat.has_vllm_config_class(model_type):
            continue
        cls = type(f"MLXLMConfig_{model_type.replace('-', '_')}", (MLXLMConfig,),
                   {"model_type": model_type, "__module__": __name__})
        AutoConfig.register(model_type, cls)
        done.append(model_type)
    return done


#: model types transformers knows as a vision encoder's config, which mlx-lm (for mlx-vlm's
#: conversions) also reads as the top-level type of a whole image-text checkpoint, with a
#: ``text_config``: the image-text model type Hugging Face's own checkpoints of the family use
ENCODER_TYPES_AT_TOP: dict[str, str] = {"pixtral": "llava"}


def as_image_text_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` unchanged, unless transformers read a whole image-text checkpoint's
    config.json as its vision encoder's config (a type of :data:`ENCODER_TYPES_AT_TOP` with a
    ``text_config`` dict): then the family's image-text config built from the file's keys
    (``to_diff_dict``: the keys the encoder class does not default), which vLLM serves as it
    serves Hugging Face's checkpoints of the family. Without this vLLM stops at start-up with
    "The text_config ... does not have `num_attention_heads`"."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    image_text = ENCODER_TYPES_AT_TOP.get(getattr(config, "model_type", None))
    if image_text is None or not isinstance(getattr(config, "text_config", None), dict):
        return config
    keys = {k: v for k, v in config.to_diff_dict().items()
            if k not in ("model_type", "transformers_version")}
    converted = CONFIG_MAPPING[image_text](**keys)
    logger.info("config.json's model_type %r with a text_config: read as %r (the image-text "
                "checkpoint mlx-lm reads it as)", config.model_type, image_text)
    return converted
