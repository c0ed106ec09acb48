"""Platform policy for KV offloading: what ``--kv-offloading-size`` and
``--kv-transfer-config`` become on vllm-unified, and what is refused at start-up.

Runs in every process from ``MLXPlatform.check_and_update_config`` (twice; idempotent) and
imports neither MLX nor the offload worker. vLLM turns ``--kv-offloading-size GIB`` into its
OffloadingConnector only after the platform hook (``VllmConfig._post_init_kv_transfer_config``),
keeping whatever extra config is already there; so the connector is set up here, the same
way, with our spec (:mod:`vllm_unified.offload.spec`) and our disk tier for ``"fs"``.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_unified import compat

CONNECTOR = "OffloadingConnector"
SPEC_NAME = "MLXOffloadingSpec"
SPEC_MODULE = "vllm_unified.offload.spec"
FS_TIER_TYPE = "VerifiedFileSystemTier"
FS_TIER_MODULE = "vllm_unified.offload.disk"
#: vLLM's own spec names a user may have written; they mean the same thing here.
_VLLM_SPECS = (None, "CPUOffloadingSpec", "TieringOffloadingSpec", SPEC_NAME)


def configure_kv_offloading(vllm_config: Any) -> None:
    """Point vLLM's OffloadingConnector at the MLX offloading spec, or refuse.

    Raises:
        ValueError: another KV connector or offloading backend, ``VLLM_USE_SIMPLE_KV_OFFLOAD``,
            no host pool size, an unsupported secondary tier or option, or a hybrid model;
            the message names the flag.
    """
    cache = vllm_config.cache_config
    size = cache.kv_offloading_size
    kvt = vllm_config.kv_transfer_config
    if kvt is None and size is None:
        return
    if size is not None and cache.kv_offloading_backend != "native":
        raise ValueError(f"--kv-offloading-backend {cache.kv_offloading_backend}: "
                         "vllm-unified supports 'native' (vLLM's OffloadingConnector)")
    if os.environ.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0") not in ("", "0"):
        raise ValueError("VLLM_USE_SIMPLE_KV_OFFLOAD: vllm-unified supports vLLM's "
                         "OffloadingConnector only; unset it")
    if kvt is None:
        kvt = vllm_config.kv_transfer_config = compat.KVTransferConfig()
    if kvt.kv_connector not in (None, CONNECTOR):
        raise ValueError(f"--kv-transfer-config kv_connector={kvt.kv_connector}: vllm-unified "
                         f"supports only vLLM's {CONNECTOR} (KV offloading)")
    extra = kvt.kv_connector_extra_config
    if extra.get("spec_name") not in _VLLM_SPECS:
        raise ValueError(f"--kv-transfer-config spec_name={extra.get('spec_name')}: "
                         f"vllm-unified runs its own {SPEC_NAME}")
    if size is not None:
        extra["cpu_bytes_to_use"] = size * (1 << 30)  # as vLLM's post-init does
    if not extra.get("cpu_bytes_to_use"):
        raise ValueError(f"--kv-transfer-config with the {CONNECTOR}: set the host pool size "
                         "with --kv-offloading-size GIB")
    if extra.get("canonical_layout"):
        raise ValueError("--kv-transfer-config canonical_layout: not supported by vllm-unified")
    model = vllm_config.model_config
    if model is not None and (model.is_hybrid or getattr(model, "is_attention_free", False)):
        raise ValueError("--kv-offloading-size: KV offloading of hybrid (attention + state) "
                         "and attention-free state-space models is not supported by "
                         "vllm-unified yet")
    extra["secondary_tiers"] = [_tier(t) for t in extra.get("secondary_tiers") or []]
    extra["spec_name"], extra["spec_module_path"] = SPEC_NAME, SPEC_MODULE
    if model is not None:
        parallel = vllm_config.parallel_config
        extra["kv_geometry"] = {
            "num_kv_heads": model.get_num_kv_heads(parallel), "head_size": model.get_head_size(),
            "block_size": cache.block_size,
            # the pages' format: a file of one --kv-cache-dtype never loads into another
            "kv_cache_dtype": cache.cache_dtype or "auto",
        }
        if cache.kv_cache_dtype_skip_layers:
            # ... nor one whose model-dtype layers are others (same bytes per block)
            extra["kv_geometry"]["kv_cache_dtype_skip_layers"] = \
                sorted(cache.kv_cache_dtype_skip_layers)
        # the disk tier keys its files with the checkpoint's identity (weights_identity)
        extra["model_revision"] = model.revision
    kvt.kv_connector = CONNECTOR
    kvt.kv_role = kvt.kv_role or "kv_both"


def _tier(tier: Any) -> dict[str, Any]:
    """vLLM's ``fs`` tier becomes our verified one; other tier types are refused."""
    if not isinstance(tier, dict):
        raise ValueError(f"--kv-transfer-config secondary_tiers: {tier!r} is not a dict")
    kind = tier.get("type")
    if kind not in ("fs", FS_TIER_TYPE):
        raise ValueError(f"--kv-transfer-config secondary_tiers type={kind!r}: vllm-unified "
                         "supports 'fs'")
    if not tier.get("root_dir"):
        raise ValueError("--kv-transfer-config secondary_tiers: the fs tier needs 'root_dir'")
    return {**tier, "type": FS_TIER_TYPE, "module_path": FS_TIER_MODULE}
