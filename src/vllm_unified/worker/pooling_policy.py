"""What the platform serves with vLLM's pooling runner (``--runner pooling``, or vLLM's
automatic choice from the architecture or a sentence-transformers folder), decided before the
model loads: causal decoder LMs with last-token pooling through the paged forward, as
embedders (Qwen3-Embedding style) or sequence classifiers (``*ForSequenceClassification``,
``--convert classify``, Qwen3-Reranker's LM-head scorer). Everything else vLLM would pool is
refused, naming the model type or the task, instead of loading and computing something else.

Imports no vLLM and no MLX: it reads vLLM's resolved ``ModelConfig`` only.
"""

from __future__ import annotations

from typing import Any

from vllm_unified.errors import StartupRefused

__all__ = ["SERVED_POOLING_TYPES", "pooling_head", "pooling_policy"]

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


def pooling_head(model_config: Any) -> str | None:
    """The pooler vLLM's model class for this config builds: ``"embed"`` (``--convert
    embed``), ``"classify"`` (``--convert classify``, or a ``*ForSequenceClassification``
    architecture vLLM builds from the causal LM), None for any other pooling head."""
    if model_config.convert_type in ("embed", "classify"):
        return model_config.convert_type
    arch = model_config.architecture
    if (model_config.convert_type == "none" and arch.endswith("ForSequenceClassification")
            and arch not in OWN_CLASSIFIER_HEADS):
        return "classify"
    return None


def pooling_policy(vllm_config: Any) -> None:
    """Refuse a pooling model the runner cannot serve yet; nothing for a generating one.

    Raises:
        StartupRefused: an encoder-only or bidirectional model (BERT, XLM-RoBERTa,
            ModernBERT, ``is_causal: false`` decoders), a hybrid or attention-free model, a
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
    if attn_type == "encoder_only":
        raise StartupRefused(
            f"{what} is an encoder-only (bidirectional) model; vllm-unified pools causal "
            "decoder models only so far (encoder models such as BERT, XLM-RoBERTa and "
            "ModernBERT are not supported yet)")
    if attn_type != "decoder":
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
