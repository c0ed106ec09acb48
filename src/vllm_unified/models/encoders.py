"""Encoder-only models (BERT, RoBERTa / XLM-RoBERTa, ModernBERT) for vLLM's pooling runner.

The architectures come from mlx-vlm's model modules (``mlx_vlm.models.bert``,
``xlm_roberta``, ``modernbert``), installed without mlx-vlm's own dependencies
(``pip install --no-deps mlx-vlm``; docs/features/retrieval.md): this module builds the
encoder body, loads the checkpoint's safetensors into it and keeps aside the tensors of the
pooling head vLLM's pooler runs (BERT's ``pooler.dense``, a classifier), which the MLX body has
no layer for. Nothing here runs a pooler.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from vllm_unified.versions import MLX_VLM_INSTALL

__all__ = ["ENCODER_MODEL_TYPES", "LoadedEncoder", "encode",
           "load_encoder", "mlx_vlm_missing"]

#: HF ``model_type`` -> mlx-vlm module that defines its encoder
ENCODER_MODEL_TYPES = {"bert": "bert", "roberta": "xlm_roberta", "xlm-roberta": "xlm_roberta",
                       "modernbert": "modernbert"}


@dataclass(frozen=True)
class _Layout:
    """Where a model type's tensors live in HF checkpoints."""

    #: prefix of the encoder body's tensors in task-specific checkpoints (``bert.``)
    body_prefix: str
    #: prefixes (after ``body_prefix`` is stripped) of the pooling head's tensors
    head_prefixes: tuple[str, ...]
    #: prefixes of tensors neither the body nor vLLM's pooler uses (MLM heads, position ids)
    unused: tuple[str, ...]
    #: whether the embedding adds token type ids (cross-encoder pairs)
    token_types: bool
    #: the config key naming the MLP activation, and its module's attribute in a layer
    act_key: str
    act_path: tuple[str, str]


_LAYOUTS = {
    "bert": _Layout("bert.", ("pooler.", "classifier."), ("cls.",), True, "hidden_act",
                    ("intermediate", "intermediate_act_fn")),
    "xlm_roberta": _Layout("roberta.", ("classifier.",), ("lm_head.", "pooler."), True,
                           "hidden_act", ("intermediate", "intermediate_act_fn")),
    "modernbert": _Layout("model.", ("head.", "classifier."), ("decoder.",), False,
                          "hidden_activation", ("mlp", "act")),
}
#: transformers' activation names -> the MLX module computing the same function
_ACTIVATIONS = {"gelu": lambda: nn.GELU(), "gelu_pytorch_tanh": lambda: nn.GELU("precise"),
                "gelu_new": lambda: nn.GELU("precise"), "gelu_fast": lambda: nn.GELU("precise"),
                "relu": lambda: nn.ReLU(), "silu": lambda: nn.SiLU(), "swish": lambda: nn.SiLU()}


@dataclass
class LoadedEncoder:
    """A loaded encoder body and what its pooler needs.

    model: mlx-vlm's ``Model`` for the type (the body: embeddings, layers, a final norm where
        the type has one), evaluated, in eval mode; run it with :func:`encode`.
    config: the HF config dict it was built from.
    dtype: the dtype of every weight.
    head: the pooling head's tensors, named as in the checkpoint after the body prefix
        (``pooler.dense.weight``, ``classifier.weight``, ``head.norm.weight``...), as stored.
    token_types: whether the model adds token type embeddings.
    """

    model: nn.Module
    config: dict
    dtype: mx.Dtype
    head: dict[str, mx.array] = field(default_factory=dict)
    token_types: bool = False
    quantized: bool = False
    source: str = "safetensors"

    def num_parameters(self) -> int:
        return sum(a.size for _, a in tree_flatten(self.model.parameters()))


def mlx_vlm_missing() -> bool:
    """Whether mlx-vlm is not installed (checked without importing it)."""
    return importlib.util.find_spec("mlx_vlm") is None


def load_encoder(path: str | Path, hf_config: Mapping[str, Any], dtype: mx.Dtype) -> LoadedEncoder:
    """Build the encoder of ``hf_config["model_type"]`` and load ``path``'s safetensors.

    Raises:
        ValueError: a model type without an encoder here, quantized weights, missing or
            unexpected body weights, wrong shapes.
        ModuleNotFoundError: mlx-vlm is not installed (the message gives the command).
        FileNotFoundError: no ``*.safetensors`` in ``path``.
    """
    config = dict(hf_config)
    model_type = config.get("model_type")
    module_name = ENCODER_MODEL_TYPES.get(model_type)
    if module_name is None:
        raise ValueError(f"model type {model_type!r} is not an encoder vllm-unified serves "
                         f"(supported: {', '.join(ENCODER_MODEL_TYPES)})")
    if mlx_vlm_missing():
        raise ModuleNotFoundError(f"encoder model type {model_type!r} is defined by mlx-vlm, "
                                  f"which is not installed: {MLX_VLM_INSTALL}")
    module = importlib.import_module(f"mlx_vlm.models.{module_name}")
    layout = _LAYOUTS[module_name]
    model = module.Model(module.ModelConfig.from_dict(config))
    _match_activation(model, config, layout)
    body, head = _split(_read_safetensors(Path(path)), layout)
    if any(n.endswith((".scales", ".biases")) for n in body):
        raise ValueError(f"{path}: quantized encoder weights are not supported by "
                         "vllm-unified (dense safetensors only)")
    body = {n: w.astype(dtype) for n, w in model.sanitize(body).items()}
    model.load_weights(list(body.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return LoadedEncoder(model, config, dtype, head, layout.token_types)


def encode(loaded: LoadedEncoder, input_ids: mx.array, attention_mask: mx.array,
           token_type_ids: mx.array | None) -> mx.array:
    """``[B, L, D]`` final hidden states of right-padded ``[B, L]`` int32 ``input_ids``;
    ``attention_mask`` ``[B, L]`` is 1 on real tokens, 0 on padding (bidirectional attention
    within each row). ``token_type_ids`` ``[B, L]`` (or None: all 0) for types that have
    them."""
    if loaded.token_types:
        hidden, _ = loaded.model._encode(input_ids, attention_mask, token_type_ids)
    else:
        hidden, _ = loaded.model._encode(input_ids, attention_mask)
    return hidden


def _match_activation(model: nn.Module, config: dict[str, Any], layout: _Layout) -> None:
    """Give every layer's MLP the config's activation: mlx-vlm hard-codes one per family
    (ModernBERT's tanh-approximated GELU where its configs say exact ``gelu``).

    Raises:
        ValueError: an activation without an MLX counterpart here.
    """
    name = config.get(layout.act_key, "gelu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"{config.get('model_type')}: {layout.act_key} {name!r} is not "
                         f"supported (supported: {', '.join(_ACTIVATIONS)})")
    parent, attr = layout.act_path
    for layer in model.layers:
        setattr(getattr(layer, parent), attr, _ACTIVATIONS[name]())


def _read_safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def _split(weights: dict[str, mx.array],
           layout: _Layout) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(body tensors, pooling-head tensors); unused ones (MLM heads, position ids) dropped."""
    body: dict[str, mx.array] = {}
    head: dict[str, mx.array] = {}
    for name, w in weights.items():
        name = name.removeprefix(layout.body_prefix)
        if name.startswith(layout.head_prefixes):
            head[name] = w
        elif not (name.startswith(layout.unused) or name.endswith("position_ids")):
            body[name] = w
    return body, head
