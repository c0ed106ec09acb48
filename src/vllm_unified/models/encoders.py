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

from vllm_unified.models.cpu_activations import Gelu
from vllm_unified.models.encoder_attention import encoder_attention
from vllm_unified.versions import MLX_VLM_INSTALL

__all__ = ["ENCODER_MODEL_TYPES", "AttentionGroup", "LoadedEncoder", "encode", "encode_packed",
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
    #: whether the body is BERT's (embeddings, ``encoder.layer`` of self-attention, output and
    #: intermediate blocks), which :func:`encode_packed` runs on packed tokens
    packs: bool


_LAYOUTS = {
    "bert": _Layout("bert.", ("pooler.", "classifier."), ("cls.",), True, "hidden_act",
                    ("intermediate", "intermediate_act_fn"), True),
    "xlm_roberta": _Layout("roberta.", ("classifier.",), ("lm_head.", "pooler."), True,
                           "hidden_act", ("intermediate", "intermediate_act_fn"), True),
    "modernbert": _Layout("model.", ("head.", "classifier."), ("decoder.",), False,
                          "hidden_activation", ("mlp", "act"), False),
}
#: transformers' activation names -> the MLX module computing the same function (GELU on the
#: native CPU kernels where they run)
_ACTIVATIONS = {"gelu": lambda: Gelu(), "gelu_pytorch_tanh": lambda: Gelu(approximate=True),
                "gelu_new": lambda: Gelu(approximate=True),
                "gelu_fast": lambda: Gelu(approximate=True),
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
    #: whether :func:`encode_packed` runs it (else :func:`encode`, padded)
    packs: bool = False
    #: the position id of a sequence's first token (XLM-RoBERTa's count after the padding id)
    position_offset: int = 0
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
    offset = int(config.get("pad_token_id", 1)) + 1 if module_name == "xlm_roberta" else 0
    return LoadedEncoder(model, config, dtype, head, layout.token_types, layout.packs, offset)


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


@dataclass
class AttentionGroup:
    """Sequences of a packed step that attend as one right-padded batch.

    rows: ``[B * L]`` int32 packed token index of each padded position (``T``, one past the
        last token, for padding).
    real: ``[n]`` int32 padded position of each of the group's tokens, in packed order (the
        group's tokens are consecutive in the packed layout).
    batch / width: ``B`` sequences, ``L`` positions (the longest).
    mask: ``[B, 1, 1, L]`` additive: 0 on real keys, the dtype's lowest value on padding.
    """

    rows: mx.array
    real: mx.array
    batch: int
    width: int
    mask: mx.array


def encode_packed(loaded: LoadedEncoder, input_ids: mx.array, positions: mx.array,
                  token_type_ids: mx.array, groups: list[AttentionGroup]) -> mx.array:
    """``[T, D]`` final hidden states of ``T`` packed tokens (``[T]`` int32 ids, positions
    from 0 within each sequence, token types): embeddings, projections, MLPs and norms on the
    packed rows (no padding), attention per :class:`AttentionGroup` (BERT and RoBERTa bodies:
    ``loaded.packs``). The same function as :func:`encode` on each sequence."""
    model = loaded.model
    emb = model.embeddings
    h = emb.LayerNorm(emb.word_embeddings(input_ids)
                      + emb.position_embeddings(positions + loaded.position_offset)
                      + emb.token_type_embeddings(token_type_ids))
    for layer in model.encoder.layer:
        sa = layer.attention.self
        attn = _grouped_attention(sa.query(h), sa.key(h), sa.value(h), sa.num_attention_heads,
                                  sa.scale, groups)
        a = layer.attention.output(attn, h)
        h = layer.output(layer.intermediate(a), a)
    return h


def _grouped_attention(q: mx.array, k: mx.array, v: mx.array, heads: int, scale: float,
                       groups: list[AttentionGroup]) -> mx.array:
    """``[T, D]`` attention of packed ``[T, D]`` projections, each group padded on its own."""
    dim = q.shape[-1]
    pad = mx.zeros((1, dim), dtype=q.dtype)
    q, k, v = (mx.concatenate([x, pad]) for x in (q, k, v))
    outs = []
    for g in groups:
        def padded(x: mx.array, g: AttentionGroup = g) -> mx.array:
            return x[g.rows].reshape(g.batch, g.width, heads, dim // heads).transpose(0, 2, 1, 3)

        out = encoder_attention(padded(q), padded(k), padded(v), None, scale, g.mask)
        outs.append(out.transpose(0, 2, 1, 3).reshape(-1, dim)[g.real])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def _match_activation(model: nn.Module, config: dict[str, Any], layout: _Layout) -> None:
    """Give every layer's MLP the config's activation: mlx-vlm hard-codes one per family
    (ModernBERT's tanh-approximated GELU where its configs say exact ``gelu``), and MLX's
    CPU GELU is scalar (:class:`~vllm_unified.models.cpu_activations.Gelu`).

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
