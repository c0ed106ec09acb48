"""Serve a GGUF file through vLLM 0.32, which no longer reads GGUF itself.

vLLM's front end needs an HF-style model folder (``config.json``, tokenizer files) to build its
config and tokenizer. :func:`prepare_gguf_dir` derives that folder from the GGUF once, with
transformers' GGUF reader (config, tokenizer and chat template come out of the file's metadata),
and links the GGUF into it; our worker then loads the weights from the linked file with MLX
(:mod:`vllm_unified.models.loader`). Nothing is dequantized or copied here.

``vllm serve FILE.gguf`` does this transparently (see :mod:`vllm_unified.cli`); from Python call
:func:`prepare_gguf_dir` and pass the folder to ``LLM(model=...)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from vllm_unified import envs

#: Name of the link to the GGUF inside a prepared folder.
GGUF_LINK = "model.gguf"
_STAMP = "vllm_unified_gguf.json"


def default_cache_root() -> Path:
    """``$VLLM_UNIFIED_CACHE`` or ``~/.cache/vllm-unified``."""
    root = envs.read(envs.CACHE_ENV) or Path.home() / ".cache" / "vllm-unified"
    return Path(root)


def _source_stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"source": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": 3}


def prepare_gguf_dir(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None
) -> Path:
    """Make (or reuse) an HF-style folder that serves ``gguf_path``.

    Args:
        gguf_path: a ``.gguf`` file.
        out_dir: where to write; default ``<cache root>/gguf/<file stem>-<hash of its path>``.

    Returns:
        The folder: ``config.json``, tokenizer files (with the GGUF's chat template, if any) and
        ``model.gguf`` linking to the source file. Reused as long as the source's size and
        modification time are unchanged.

    Raises:
        FileNotFoundError: ``gguf_path`` is not a file.
        ValueError: transformers cannot read the GGUF's architecture.
    """
    gguf = Path(gguf_path).resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    if out_dir is None:
        digest = hashlib.sha256(str(gguf).encode()).hexdigest()[:12]
        out_dir = default_cache_root() / "gguf" / f"{gguf.stem}-{digest}"
    out = Path(out_dir)
    stamp = _source_stamp(gguf)
    stamp_file = out / _STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out

    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = gguf_hf_config(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError) as err:
        raise ValueError(f"{gguf.name}: transformers cannot read this GGUF ({err})") from err
    _apply_bos_eos(tokenizer, gguf)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    link = out / GGUF_LINK
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(gguf)
    stamp_file.write_text(json.dumps(stamp))
    return out


#: GGUF architecture -> (metadata key after ``<arch>.``, HF config field) that transformers'
#: GGUF reader leaves out or fills from the wrong key: the experts' width (the dense
#: ``feed_forward_length`` is no expert's), gpt-oss's window and head size.
_MOE_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen3moe": (("expert_count", "num_experts"),
                 ("expert_used_count", "num_experts_per_tok"),
                 ("expert_feed_forward_length", "moe_intermediate_size")),
    "gpt-oss": (("expert_count", "num_local_experts"),
                ("expert_used_count", "num_experts_per_tok"),
                ("expert_feed_forward_length", "intermediate_size"),
                ("attention.sliding_window", "sliding_window"),
                ("attention.key_length", "head_dim")),
}


def gguf_hf_config(gguf_path: str | os.PathLike):
    """The ``transformers.PretrainedConfig`` of a GGUF: transformers' GGUF reader, then
    :func:`_complete_config` (causal-LM class, mixture-of-experts fields from the metadata).

    Raises:
        ValueError: transformers cannot read the GGUF's architecture.
    """
    from transformers import AutoConfig

    # lazy: models.gguf imports MLX, and the platform imports this module in vLLM's API server
    from vllm_unified.models.gguf import read_gguf_index

    gguf = Path(gguf_path)
    index = read_gguf_index(gguf)
    if index.metadata.get("general.architecture") == "gpt-oss":
        # transformers' reader takes gpt-oss's rope.scaling.* keys' length fields for their
        # values and then fails on every file llama.cpp writes (YaRN is always there)
        config = _gpt_oss_config(index.metadata, "output.weight" not in index.tensors)
    else:
        try:
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError) as err:
            raise ValueError(f"{gguf.name}: transformers cannot read this GGUF ({err})") from err
    _complete_config(config, index.metadata)
    return config


def _gpt_oss_config(metadata: dict, tied: bool):
    """``GptOssConfig`` from a ``gpt-oss`` GGUF's metadata (the keys llama.cpp's converter
    writes; :data:`_MOE_FIELDS` adds the experts' and window fields after)."""
    from transformers import GptOssConfig

    def get(key: str, default=None):
        value = metadata.get(f"gpt-oss.{key}", default)
        if value is None:
            raise ValueError(f"gpt-oss GGUF without gpt-oss.{key}")
        return value

    rope: dict = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 150000.0))}
    scaling = metadata.get("gpt-oss.rope.scaling.type")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")),
                    original_max_position_embeddings=int(
                        get("rope.scaling.original_context_length")),
                    beta_fast=32.0, beta_slow=1.0, truncate=False)  # llama.cpp's defaults
    elif scaling not in (None, "none"):
        raise ValueError(f"gpt-oss GGUF with rope scaling {scaling!r} (only yarn is known)")
    tokens = {f"{name}_token_id": metadata.get(f"tokenizer.ggml.{key}_token_id")
              for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))}
    return GptOssConfig(
        vocab_size=int(get("vocab_size")), hidden_size=int(get("embedding_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count_kv")),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope, tie_word_embeddings=tied, **tokens)


def _complete_config(config, metadata: dict) -> None:
    """Name the causal-LM class in ``architectures``: transformers' GGUF reader leaves it empty,
    and vLLM would then resolve the bare backbone (e.g. ``LlamaModel``) as a pooling model.
    Set the mixture-of-experts fields of :data:`_MOE_FIELDS` from ``metadata``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = metadata.get("general.architecture")
    for key, field in _MOE_FIELDS.get(arch, ()):
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            setattr(config, field, int(value))
    if not config.architectures:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(f"no causal-LM architecture known for model_type {config.model_type}")
        config.architectures = [arch]


def _apply_bos_eos(tokenizer, gguf: Path) -> None:
    """Honour the GGUF's ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``: transformers'
    converter drops them (Gemma 3 then gets no BOS and degenerates)."""
    # lazy: models.gguf imports MLX, and the platform imports this module in vLLM's API server
    from vllm_unified.models.gguf import read_gguf_index

    meta = read_gguf_index(gguf).metadata
    for key, attr in (("tokenizer.ggml.add_bos_token", "add_bos_token"),
                      ("tokenizer.ggml.add_eos_token", "add_eos_token")):
        if key in meta and hasattr(tokenizer, attr):
            setattr(tokenizer, attr, bool(meta[key]))


def gguf_in_dir(folder: str | os.PathLike) -> Path | None:
    """The GGUF a prepared folder serves, or None for an ordinary checkpoint folder."""
    link = Path(folder) / GGUF_LINK
    return link.resolve() if link.exists() else None


def weights_file_bytes(model_path: str) -> int:
    """Bytes of the checkpoint files the worker loads from ``model_path``: the GGUF a
    prepared folder links, else the folder's ``model*.safetensors``; 0 where that is not a
    local folder (a hub name) or holds neither."""
    folder = Path(model_path)
    if not folder.is_dir():
        return 0
    gguf = gguf_in_dir(folder)
    if gguf is not None:
        return gguf.stat().st_size
    return sum(f.stat().st_size for f in folder.glob("model*.safetensors") if f.is_file())


def export_dequantized(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the GGUF's weights as an fp32 HF safetensors folder (transformers dequantizes).

    Meant for comparisons with backends that read no GGUF, e.g. vLLM's native CPU backend as
    the reference of our differential tests and benchmarks. Tied embeddings are stored under
    the embedding's name only, as HF checkpoints do. The config is :func:`gguf_hf_config`'s;
    gpt-oss's experts and attention sinks, which transformers' GGUF loader does not read from
    llama.cpp's names, come from the ``gguf`` reference dequantization here.

    Returns:
        ``out_dir`` with ``config.json`` (``dtype`` float32, no GGUF quantization entry),
        ``model.safetensors`` and the tokenizer files. Reused if already complete.

    Raises:
        ValueError: a weight of the model would not come from the file (it would be random).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_path).resolve()
    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    model, info = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=gguf_hf_config(gguf), dtype=torch.float32,
        output_loading_info=True)
    missing = set(info["missing_keys"])
    if model.config.model_type == "gpt_oss":
        experts = _gpt_oss_expert_state(gguf)
        model.load_state_dict(experts, strict=False)
        missing -= set(experts)
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{gguf.name}: transformers' GGUF loader leaves {len(missing)} "
                         f"weights unread (e.g. {sorted(missing)[:4]}); not exported")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # transformers marks GGUF loads as quantized
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    out.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / "model.safetensors"))  # last: marks the folder complete
    return out


def _gpt_oss_expert_state(gguf: Path) -> dict:
    """transformers' GptOss expert and sink parameters (fp32 torch tensors) from a gpt-oss
    GGUF's ``ffn_{gate,up,down}_exps`` (or fused ``ffn_gate_up_exps``) weights and biases and
    ``attn_sinks``, dequantized by the ``gguf`` reference: ``gate_up_proj`` ``[E, hidden,
    2 ffn]`` with gate and up interleaved by column, ``down_proj`` ``[E, ffn, hidden]``."""
    import numpy as np
    import torch

    # lazy: models.gguf imports MLX, and the platform imports this module in vLLM's API server
    from vllm_unified.models.gguf import (
        GGUFIndex,
        read_gguf_index,
        read_gguf_tensors,
        split_fused_experts,
    )

    index = read_gguf_index(gguf)
    wanted = re.compile(r"blk\.\d+\.(ffn_(gate|up|down|gate_up)_exps|attn_sinks)\.(weight|bias)")
    sub = GGUFIndex(index.metadata, {n: t for n, t in index.tensors.items()
                                     if wanted.fullmatch(n)})
    read = read_gguf_tensors(gguf, sub, quantized=False)
    dense = {n: torch.from_numpy(np.array(t, dtype=np.float32))
             for item in read.items() for n, t in split_fused_experts(*item)}
    state = {}
    for layer in range(int(index.metadata["gpt-oss.block_count"])):
        b, p = f"blk.{layer}.", f"model.layers.{layer}."
        gate, up = (dense[f"{b}ffn_{x}_exps.weight"].transpose(1, 2) for x in ("gate", "up"))
        state[p + "mlp.experts.gate_up_proj"] = torch.stack([gate, up], -1).flatten(-2)
        state[p + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            [dense[f"{b}ffn_gate_exps.bias"], dense[f"{b}ffn_up_exps.bias"]], -1).flatten(-2)
        state[p + "mlp.experts.down_proj"] = dense[f"{b}ffn_down_exps.weight"].transpose(1, 2)
        state[p + "mlp.experts.down_proj_bias"] = dense[f"{b}ffn_down_exps.bias"]
        state[p + "self_attn.sinks"] = dense[f"{b}attn_sinks.weight"]
    return state
