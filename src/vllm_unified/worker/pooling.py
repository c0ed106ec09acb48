"""Pooling models (vLLM's ``--runner pooling``): the last layer's hidden states, after the
final norm, go through vLLM's own pooler on torch views, as vLLM's runners hand theirs over.

The pooler is the one vLLM's model adapters would build for the model, under the engine's
config: ``DispatchPooler.for_embedding`` (pooling type, normalisation, Matryoshka
``dimensions``, a sentence-transformers ``Dense`` projector where the checkpoint has one) or
``DispatchPooler.for_seq_cls`` with the classifier vLLM's ``as_seq_cls_model`` loads (the
checkpoint's ``score`` layer, or rows of the LM head for ``classifier_from_token`` models such
as Qwen3-Reranker), in vLLM's head dtype. What the runner serves is decided by the platform
before the model loads (:mod:`vllm_unified.worker.pooling_policy`); this module runs it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch

from vllm_unified.compat import (
    BertPooler,
    DispatchPooler,
    ModernBertPooler,
    PoolingMetadata,
    PoolingStates,
    RobertaClassificationHead,
    VllmConfig,
    get_tokenizer,
    set_current_vllm_config,
)
from vllm_unified.models.backbone_weights import STAND_IN_HEAD
from vllm_unified.models.encoders import ENCODER_MODEL_TYPES, LoadedEncoder
from vllm_unified.models.loader import LoadedModel
from vllm_unified.models.output_head import decoder
from vllm_unified.worker.pooling_policy import pooling_head

__all__ = ["SERVED_TASKS", "Pooling", "classifier"]

#: pooling tasks the runner serves. Per-token outputs (``token_embed``, ``token_classify``)
#: may be slices of the step's hidden states, a view of an MLX buffer freed after the step:
#: ``_owned`` copies them (vLLM's ALL pooling itself copies the chunks it keeps across steps).
SERVED_TASKS = ("embed", "classify", "token_embed", "token_classify")


class Pooling:
    """vLLM's pooler for the served model, fed one step's hidden states at a time.

    Args:
        vllm_config: the engine's config (``model_config.pooler_config`` resolved by vLLM).
        loaded: the loaded model (a classifier's weights come from it).
    """

    def __init__(self, vllm_config: VllmConfig, loaded: LoadedModel | LoadedEncoder) -> None:
        pooler_config = vllm_config.model_config.pooler_config
        with set_current_vllm_config(vllm_config):
            if pooling_head(vllm_config.model_config) != "classify":
                self.pooler = DispatchPooler.for_embedding(pooler_config)
            elif isinstance(loaded, LoadedEncoder):
                pooling, head = encoder_classifier(vllm_config, loaded)
                self.pooler = DispatchPooler.for_seq_cls(pooler_config, pooling=pooling,
                                                         classifier=head)
            else:
                self.pooler = DispatchPooler.for_seq_cls(
                    pooler_config, classifier=classifier(vllm_config, loaded))
        offered = self.pooler.get_supported_tasks()
        #: the tasks the worker reports to vLLM (``get_supported_tasks``)
        self.tasks: tuple[str, ...] = tuple(t for t in SERVED_TASKS if t in offered)

    def describe(self) -> str:
        return f"pooling runner, tasks {', '.join(self.tasks)}; vLLM's pooler {self.pooler}"

    def new_request(self, params: Any) -> PoolingStates:
        """Apply the pooler's updates to a new request's ``PoolingParams`` (as vLLM's GPU
        runner does) and return the request's pooling states.

        Raises:
            ValueError: the request's task is not served.
        """
        if params is None or params.task not in self.tasks:
            task = None if params is None else params.task
            raise ValueError(f"pooling task {task!r} is not served by vllm-unified "
                             f"(served: {', '.join(self.tasks)})")
        self.pooler.get_pooling_updates(params.task).apply(params)
        return PoolingStates()

    def pool(self, hidden: torch.Tensor, states: list[Any], query_lens: np.ndarray,
             seq_lens: np.ndarray) -> list[torch.Tensor | None]:
        """vLLM's pooler over one step.

        Args:
            hidden: ``[T, D]`` hidden states of the step's tokens, token-major in request
                order (a view of the evaluated MLX array on the CPU backend).
            states: the step's ``RequestState`` objects, in the same order.
            query_lens / seq_lens: ``[B]`` tokens fed this step / context length after it.

        Returns:
            One entry per request: its pooled output (a tensor that owns its memory) once its
            prompt's last token ran this step, else None (a prefill chunk before the last).
        """
        params = [s.pooling_params for s in states]
        prompt_lens = torch.tensor([s.num_prompt_tokens for s in states], dtype=torch.int64)
        token_ids = (_padded_prompts(states) if any(p.requires_token_ids for p in params)
                     else None)
        metadata = PoolingMetadata(
            prompt_lens=prompt_lens, prompt_token_ids=token_ids, prompt_token_ids_cpu=token_ids,
            pooling_params=params, pooling_states=[s.pooling_states for s in states])
        metadata.build_pooling_cursor(query_lens.astype(np.int64),
                                      torch.from_numpy(seq_lens.astype(np.int64)),
                                      device=hidden.device)
        with torch.inference_mode():
            raw = self.pooler(hidden_states=hidden, pooling_metadata=metadata)
        finished = metadata.get_pooling_cursor().get_finished_mask()
        if len(raw) != len(states):
            raise RuntimeError(f"vLLM's pooler returned {len(raw)} outputs for "
                               f"{len(states)} requests")
        return [_owned(out, hidden) if done else None
                for out, done in zip(raw, finished, strict=True)]


def classifier(vllm_config: VllmConfig, loaded: LoadedModel) -> torch.nn.Linear:
    """The sequence classifier vLLM's ``as_seq_cls_model`` loads, as a torch linear in vLLM's
    head dtype: the checkpoint's ``score`` layer, or for a ``classifier_from_token`` model the
    LM head's rows of those tokens (``method: from_2_way_softmax``: the second row minus the
    first, one label; ``no_post_processing``: the rows as they are).

    Raises:
        ValueError: no ``score.weight`` in the checkpoint, an unknown ``method``, a token the
            tokenizer does not have, or an LM head that is quantized or missing from the
            checkpoint.
    """
    model_config = vllm_config.model_config
    text_config = model_config.hf_config.get_text_config()
    tokens = getattr(text_config, "classifier_from_token", None)
    method = getattr(text_config, "method", None)
    head = loaded.pooling_head
    bias = None
    if tokens is None and method is None:
        if "score.weight" not in head:
            raise ValueError(f"{model_config.architecture}: the checkpoint has no score.weight "
                             "(the classifier layer)")
        weight = _to_torch(head["score.weight"])
        bias = _to_torch(head["score.bias"]) if "score.bias" in head else None
    else:
        if method not in ("from_2_way_softmax", "no_post_processing"):
            raise ValueError(f"classifier_from_token with method {method!r}: not supported "
                             "(from_2_way_softmax, no_post_processing)")
        rows = _lm_head_rows(vllm_config, loaded, list(tokens))
        weight = rows[1:2] - rows[0:1] if method == "from_2_way_softmax" else rows
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                             dtype=model_config.head_dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.eval()


def encoder_classifier(vllm_config: VllmConfig,
                       loaded: LoadedEncoder) -> tuple[Any, torch.nn.Module]:
    """(pooling, classifier) of an encoder's ``*ForSequenceClassification`` as vLLM's model
    class builds them, with the checkpoint's head tensors: BERT's ``BertPooler`` (CLS, dense,
    tanh) and a linear classifier; RoBERTa's ``RobertaClassificationHead`` (dense, tanh,
    out_proj) after vLLM's default pooling; ModernBERT's ``ModernBertPooler`` (dense, GELU,
    LayerNorm) and a linear classifier. All in vLLM's head dtype.

    Raises:
        RuntimeError: the checkpoint's head tensors do not fit the head (missing, unexpected,
            wrong shapes).
    """
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    kind = ENCODER_MODEL_TYPES[loaded.config["model_type"]]
    if kind == "xlm_roberta":
        return None, _with_tensors(RobertaClassificationHead(model_config), loaded,
                                   "classifier.")
    linear = torch.nn.Linear(hf.hidden_size, hf.num_labels, dtype=model_config.head_dtype)
    linear = _with_tensors(linear, loaded, "classifier.")
    if kind == "bert":
        return _with_tensors(BertPooler(model_config), loaded, "pooler."), linear
    return _with_tensors(ModernBertPooler(model_config), loaded, "head."), linear


def _with_tensors(module: torch.nn.Module, loaded: LoadedEncoder,
                  prefix: str) -> torch.nn.Module:
    """``module`` with the encoder checkpoint's ``prefix`` head tensors loaded strictly."""
    state = {n.removeprefix(prefix): _to_torch(w) for n, w in loaded.head.items()
             if n.startswith(prefix)}
    module.load_state_dict(state, strict=True)
    return module.eval()


def _lm_head_rows(vllm_config: VllmConfig, loaded: LoadedModel,
                  tokens: list[str]) -> torch.Tensor:
    """``[len(tokens), D]`` float32 rows of the LM head (the tied embedding where the model
    ties it) for ``tokens``, through vLLM's tokenizer."""
    model_config = vllm_config.model_config
    if STAND_IN_HEAD in loaded.pooling_head:
        raise ValueError(f"{model_config.architecture}: classifier_from_token reads the LM "
                         "head, which the checkpoint does not have")
    tokenizer = get_tokenizer(model_config.tokenizer, revision=model_config.tokenizer_revision,
                              tokenizer_mode=model_config.tokenizer_mode,
                              trust_remote_code=model_config.trust_remote_code)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"classifier_from_token {tokens}: not all are tokens of the tokenizer "
                         f"({ids})")
    model = loaded.model
    layer = model.lm_head if "lm_head" in model else decoder(model).embed_tokens
    if not isinstance(layer, (nn.Linear, nn.Embedding)) or "scales" in layer:
        raise ValueError(f"classifier_from_token reads the LM head's rows: a quantized head "
                         f"({type(layer).__name__}) is not supported")
    return _to_torch(layer.weight[mx.array(ids, dtype=mx.int32)])


def _to_torch(a: mx.array) -> torch.Tensor:
    """An explicit float32 host copy of a (small) MLX weight."""
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def _padded_prompts(states: list[Any]) -> torch.Tensor:
    """``[B, max prompt]`` int64 prompt token ids, rows padded with 0 (vLLM's layout)."""
    out = torch.zeros((len(states), max(s.num_prompt_tokens for s in states)),
                      dtype=torch.int64)
    for i, s in enumerate(states):
        out[i, :s.num_prompt_tokens] = torch.tensor(s.prompt_token_ids, dtype=torch.int64)
    return out


def _owned(out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``out``, or an explicit copy where it still shares the step's hidden-state buffer (an
    MLX buffer that is freed after the step)."""
    if out.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr():
        return out.clone()
    return out
