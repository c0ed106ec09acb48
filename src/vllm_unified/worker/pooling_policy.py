"""What the platform serves with vLLM's pooling runner (``--runner pooling``, or vLLM's
automatic choice from the architecture or a sentence-transformers folder), decided before the
model loads: causal decoder LMs through the paged forward, as embedders (Qwen3-Embedding
style) or sequence classifiers (``*ForSequenceClassification``, ``--convert classify``,
Qwen3-Reranker's LM-head scorer), and encoder-only models (BERT, RoBERTa / XLM-RoBERTa,
ModernBERT) as embedders and cross-encoders, without a KV cache. Everything else vLLM would
pool is refused, naming the model type or the task, instead of loading and computing
something else.

Imports no vLLM and no MLX: it reads vLLM's resolved ``ModelConfig`` only.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from vllm_unified.errors import StartupRefused
from vllm_unified.versions import MLX_VLM_INSTALL

__all__ = ["ENCODER_ARCHITECTURES", "SERVED_POOLING_TYPES", "is_encoder_model", "pooling_head",
           "pooling_policy"]

#: sequence pooling types served (vLLM keeps chunked prefill and prefix caching on for LAST
#: and turns both off for MEAN and CLS on a decoder, so those see each prompt whole)
SERVED_POOLING_TYPES = ("LAST", "MEAN", "CLS")
#: token pooling types the pooler config may name (per-token tasks are not served; STEP
#: changes what vLLM schedules)
SERVED_TOKEN_POOLING_TYPES = (None, "ALL")


#: ``*ForSequenceClassification`` architectures vLLM defines with heads of their own (not
#: ``as_seq_cls_model`` over the causal LM): not served
OWN_CLASSIFIER_HEADS = frozenset({
    "GPT2ForSequenceClassification", "LlamaNemotronVLForSequenceClassification",
    "TransformersForSequenceClassification", "TransformersMoEForSequenceClassification",
    "TransformersMultiModalForSequenceClassification"})


#: encoder-only architectures served (:mod:`vllm_unified.models.encoders`: mlx-vlm's
#: definitions) -> the pooler vLLM's model class builds for them
ENCODER_ARCHITECTURES = {
    "BertModel": "embed", "RobertaModel": "embed", "XLMRobertaModel": "embed",
    "ModernBertModel": "embed", "BertForSequenceClassification": "classify",
    "RobertaForSequenceClassification": "classify",
    "XLMRobertaForSequenceClassification": "classify",
    "ModernBertForSequenceClassification": "classify"}


def mlx_vlm_installed() -> bool:
    """Whether mlx-vlm (the encoders' definitions) is installed, checked without importing
    it."""
    return importlib.util.find_spec("mlx_vlm") is not None


def is_encoder_model(model_config: Any) -> bool:
    """Whether the pooling runner serves this model as an encoder (no KV cache)."""
    return (model_config.runner_type == "pooling" and model_config.attn_type == "encoder_only"
            and model_config.architecture in ENCODER_ARCHITECTURES)


def pooling_head(model_config: Any) -> str | None:
    """The pooler vLLM's model class for this config builds: ``"embed"`` (``--convert
    embed``, an encoder embedder), ``"classify"`` (``--convert classify``, or a
    ``*ForSequenceClassification`` architecture vLLM builds from the causal LM or an
    encoder), None for any other pooling head."""
    if model_config.convert_type in ("embed", "classify"):
        return model_config.convert_type
    arch = model_config.architecture
    if arch in ENCODER_ARCHITECTURES and model_config.convert_type == "none":
        return ENCODER_ARCHITECTURES[arch]
    if (model_config.convert_type == "none" and arch.endswith("ForSequenceClassification")
            and arch not in OWN_CLASSIFIER_HEADS):
        return "classify"
    return None


def pooling_policy(vllm_config: Any) -> None:
    """Refuse a pooling model the runner cannot serve yet; nothing for a generating one.

    Raises:
        StartupRefused: an encoder-only or bidirectional model other than the
            :data:`ENCODER_ARCHITECTURES` (``is_causal: false`` decoders, encoders converted
            by ``--convert``), one of those without mlx-vlm installed, a hybrid or
            attention-free model, a
            pooling head other than an embedder or a sequence classifier (reward models,
            token classifiers), a pooling type other than LAST, MEAN, CLS (and ALL for
            tokens: STEP is refused), pipeline parallelism or speculative decoding with
            pooling.
    """
    model_config = vllm_config.model_config
    if model_config is None or model_config.runner_type != "pooling":
        return
    model_type = getattr(model_config.hf_config, "model_type", "?")
    arch = model_config.architecture
    what = f"--runner pooling: model type {model_type!r} ({arch})"
    attn_type = model_config.attn_type
    if attn_type == "encoder_only" and not is_encoder_model(model_config):
        raise StartupRefused(
            f"{what} is an encoder-only (bidirectional) model; vllm-unified serves the "
            f"encoders {', '.join(sorted(ENCODER_ARCHITECTURES))} and causal decoders")
    if is_encoder_model(model_config) and not mlx_vlm_installed():
        raise StartupRefused(f"{what}: encoder models are defined by mlx-vlm, which is not "
                             f"installed: {MLX_VLM_INSTALL}")
    if attn_type not in ("decoder", "encoder_only"):
        raise StartupRefused(f"{what} has {attn_type} layers; vllm-unified pools plain "
                             "attention decoder models only so far")
    if pooling_head(model_config) is None:
        head = ("its own pooling head" if model_config.convert_type == "none"
                else f"--convert {model_config.convert_type}")
        raise StartupRefused(
            f"{what} with {head}: vllm-unified serves embedders and sequence classifiers "
            "of decoder LMs only so far (--convert embed, --convert classify, "
            "*ForSequenceClassification)")
    pooler = model_config.pooler_config
    for pooling_type, served in ((pooler.seq_pooling_type, SERVED_POOLING_TYPES),
                                 (pooler.tok_pooling_type, SERVED_TOKEN_POOLING_TYPES)):
        if pooling_type not in served:
            raise StartupRefused(
                f"{what}: pooling type {pooling_type} is not supported by vllm-unified yet "
                f"(supported: {', '.join(t for t in served if t)})")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise StartupRefused("--pipeline-parallel-size with --runner pooling is not "
                             "supported by vllm-unified")
    if vllm_config.speculative_config is not None:
        raise StartupRefused("--speculative-config with --runner pooling is not supported")
    if is_encoder_model(model_config) and vllm_config.kv_transfer_config is not None:
        raise StartupRefused(f"{what}: --kv-transfer-config with an encoder model (it has no "
                             "KV cache) is not supported")
