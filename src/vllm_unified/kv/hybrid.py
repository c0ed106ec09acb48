"""Hybrid attention + state-space models: which mlx-lm layers are recurrent, the state (Mamba)
cache specs vLLM gets for them, and each request's state slot.

Supported families name, per mlx-lm model type, how to find a layer's recurrent mixer and which
vLLM state kind it is. The state shapes and dtypes come from vLLM's own model class
(``get_mamba_state_shape_from_config`` / ``..._dtype_from_config``), exactly what vLLM's
block-size alignment used, so the pages vLLM sizes are the pages we fill.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
import numpy as np

from vllm_unified import compat
from vllm_unified.kv.state_pages import StatePages, StateStore, state_fields


@dataclass(frozen=True)
class HybridFamily:
    """How one mlx-lm hybrid architecture is laid out.

    Attributes:
        mixer: the attribute of a decoder layer holding its recurrent mixer; ``""``: the
            decoder layer itself is wrapped (RWKV-7, whose layer keeps one cache of several
            states read by both its time mixing and its channel mixing).
        is_recurrent: decides from the mlx-lm layer whether it is a recurrent one.
        mamba_type: name of vLLM's ``MambaAttentionBackendEnum`` member for its state kind.
        is_stateless: decides whether a layer has neither attention nor recurrent state (an
            MLP-only block); mlx-lm's cache list has no entry for such layers (Nemotron-H
            counts caches over attention and Mamba blocks only). None: no such layers.
        fresh_is_none: the mixer must see a sequence's first tokens with its cache entries
            unset (None), as mlx-lm's generation starts them, rather than zero states
            (RecurrentGemma's RG-LRU does not normalise its first input otherwise).
        state_in_attention: the "mixer" is the attention module itself, which keeps a state
            of its own (Baichuan-M1's convolution over keys and values:
            :mod:`vllm_unified.models.attention_state`).
        start_position: the mixer's argument taking the position of each sequence's first
            token in the step (Bailing's linear attention rotates its queries and keys from
            ``offset``); mlx-lm's model hands the whole batch one value, the wrapper gives
            each segment its own (:class:`vllm_unified.models.routing.RecurrentMixer`).
            None: the mixer takes no position.
        to_mixer: vLLM's states of a batch (its pages' fields, in order) -> the mixer's cache
            entries, where they are laid out otherwise (Kimi Linear's three convolution
            states are one in vLLM); None: the same arrays.
        from_mixer: the inverse of ``to_mixer``.
    """

    mixer: str
    is_recurrent: Callable[[Any], bool]
    mamba_type: str
    is_stateless: Callable[[Any], bool] | None = None
    fresh_is_none: bool = False
    state_in_attention: bool = False
    start_position: str | None = None
    to_mixer: Callable[[list[Any]], list[Any]] | None = None
    from_mixer: Callable[[list[Any]], list[Any]] | None = None


def _split_kda_conv(states: list[Any]) -> list[Any]:
    """vLLM's KDA states ``[conv [B, K-1, 3P], recurrent]`` -> Kimi Linear's cache entries
    ``[q conv, k conv, v conv, recurrent]`` (each conv ``[B, K-1, P]``)."""
    conv, recurrent = states
    width = conv.shape[-1] // 3
    return [conv[..., i * width:(i + 1) * width] for i in range(3)] + [recurrent]


def _join_kda_conv(states: list[Any]) -> list[Any]:
    """The inverse of :func:`_split_kda_conv`."""
    import mlx.core as mx

    q, k, v, recurrent = states
    return [mx.concatenate([q, k, v], axis=-1), recurrent]


HYBRID_FAMILIES: dict[str, HybridFamily] = {
    "qwen3_next": HybridFamily("linear_attn", lambda layer: bool(layer.is_linear), "GDN_ATTN"),
    "granitemoehybrid": HybridFamily("mamba", lambda layer: layer.layer_type == "mamba",
                                     "MAMBA2"),
    "lfm2": HybridFamily("conv", lambda layer: not layer.is_attention_layer, "SHORT_CONV"),
    "qwen3_5": HybridFamily("linear_attn", lambda layer: bool(layer.is_linear), "GDN_ATTN"),
    # Kimi delta attention (a gated delta rule like GDN's) next to NoPE MLA layers; mlx-lm
    # keeps the q, k and v convolution states apart, vLLM as one
    "kimi_linear": HybridFamily("self_attn", lambda layer: bool(layer.is_linear), "GDN_ATTN",
                                to_mixer=_split_kda_conv, from_mixer=_join_kda_conv),
    # Kimi K3's KDA keeps one fused convolution state, as vLLM does
    "kimi_k3": HybridFamily("self_attn", lambda layer: bool(layer.is_linear), "GDN_ATTN"),
    # Qwen3.5 with Hadamard-rotated 2-bit packed linears (mlx-lm's prism_hadamard_qwen35)
    "prism_hadamard_qwen35": HybridFamily("linear_attn", lambda layer: bool(layer.is_linear),
                                          "GDN_ATTN"),
    "qwen3_5_moe": HybridFamily("linear_attn", lambda layer: bool(layer.is_linear),
                                "GDN_ATTN"),
    "lfm2_moe": HybridFamily("conv", lambda layer: not layer.is_attention_layer, "SHORT_CONV"),
    # Mamba (v1) layers next to attention layers, MoE on some of both
    "jamba": HybridFamily("mamba", lambda layer: not layer.is_attn, "MAMBA1"),
    # block kinds: "M" Mamba2, "*" attention, "-" MLP (mlx-lm's hybrid_override_pattern)
    "nemotron_h": HybridFamily("mixer", lambda layer: layer.block_type == "M", "MAMBA2",
                               is_stateless=lambda layer: layer.block_type not in ("M", "*")),
    # every layer runs a Mamba2 mixer and attention side by side (mlx-lm's CacheList of an
    # ArraysCache and a KVCache per layer: one layer on state pages and on KV pages)
    "falcon_h1": HybridFamily("mamba", lambda layer: True, "MAMBA2"),
    # Griffin: RG-LRU recurrent blocks (a conv state and the recurrence) next to local
    # attention; vLLM has no class for it (state shapes: mlx-lm's probed caches)
    "recurrent_gemma": HybridFamily(
        "temporal_block", lambda layer: layer.temporal_block_type == "recurrent", "MAMBA1",
        fresh_is_none=True),
    # every attention layer convolves its keys and values with the previous token's (a state
    # of the last raw key and value; mlx-lm's CacheList of an ArraysCache and a KV cache)
    "baichuan_m1": HybridFamily("self_attn", lambda layer: True, "SHORT_CONV",
                                state_in_attention=True),
    # PLaMo 2: Mamba2-style mixers (one B/C group) and attention layers, both under "mixer"
    "plamo2": HybridFamily("mixer", lambda layer: bool(layer.is_mamba), "MAMBA2"),
    # attention-free: every layer is recurrent (vLLM's IsAttentionFree models)
    "mamba": HybridFamily("mixer", lambda layer: True, "MAMBA1"),
    "falcon_mamba": HybridFamily("mixer", lambda layer: True, "MAMBA1"),
    "mamba2": HybridFamily("mixer", lambda layer: True, "MAMBA2"),
    # RWKV-7, attention-free: each layer's one cache holds the time mixing's token shift and
    # wkv state and the channel mixing's token shift, so the whole layer is the mixer; the
    # value of layer 0 (v_first) flows to later layers per token within the step
    "rwkv7": HybridFamily("", lambda layer: True, "LINEAR"),
    # Ling (Bailing) linear: lightning-attention layers (one [H, D, D] state each, decayed per
    # head) with rotary from each sequence's start position, a GQA attention layer closing
    # each group of layer_group_size; vLLM has no class for it (state shapes: mlx-lm's probed
    # caches)
    "bailing_moe_linear": HybridFamily("attention", lambda layer: not layer.is_global,
                                       "LINEAR", start_position="offset"),
    # Ling 2.5 (Bailing hybrid): the same lightning attention, MLA layers closing each group
    "bailing_hybrid": HybridFamily("attention", lambda layer: not layer.is_global, "LINEAR",
                                   start_position="offset"),
    # Bailing V3: Kimi delta attention (three short convolutions, a gated delta rule, kept
    # as Kimi Linear's are) and gated MLA layers
    "bailing_moe_v3": HybridFamily("attention", lambda layer: bool(layer.is_linear),
                                   "GDN_ATTN", to_mixer=_split_kda_conv,
                                   from_mixer=_join_kda_conv),
}


#: requests whose state slots :attr:`HybridLayers.slot_owners` remembers
SLOT_HISTORY = 1024


def recurrent_layer_name(i: int) -> str:
    """KV-cache layer name we report to vLLM for recurrent decoder layer ``i``."""
    return f"model.layers.{i}.mixer"


def recurrent_layers(model_type: str, model: nn.Module) -> list[int]:
    """Indices of the recurrent layers (empty for a model type that is not hybrid)."""
    family = HYBRID_FAMILIES.get(model_type)
    if family is None:
        return []
    return [i for i, layer in enumerate(model.layers) if family.is_recurrent(layer)]


def stateless_layers(model_type: str, model: nn.Module) -> list[int]:
    """Indices of the layers with neither attention nor recurrent state (see
    :attr:`HybridFamily.is_stateless`; empty for most families)."""
    family = HYBRID_FAMILIES.get(model_type)
    if family is None or family.is_stateless is None:
        return []
    return [i for i, layer in enumerate(model.layers) if family.is_stateless(layer)]


def mamba_spec(vllm_config: Any, model_type: str):
    """The ``MambaSpec`` of every recurrent layer, as vLLM's ``MambaBase.get_kv_cache_spec``
    would build it for this model (shapes and dtypes from vLLM's model class).

    Raises:
        ValueError: vLLM's state layout is not mlx-lm's (conv state dim-first), or vLLM's
            class for the architecture does not describe its states (no vLLM class for it).
    """
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    model_cls, _ = compat.ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    if not hasattr(model_cls, "get_mamba_state_shape_from_config"):
        raise ValueError(f"model type {model_type!r}: a recurrent layer of an architecture "
                         f"vLLM has no state-space class for ({model_config.architecture}; "
                         "vLLM's class gives the state pages' shapes) is not supported by "
                         "vllm-unified yet")
    shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
    dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
    family = HYBRID_FAMILIES[model_type]
    _check_conv_layout(shapes)
    return compat.MambaSpec(
        shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes),
        block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded,
        mamba_type=compat.MambaAttentionBackendEnum[family.mamba_type],
        mamba_cache_mode=cache_config.mamba_cache_mode,
    )


def _check_conv_layout(shapes) -> None:
    if compat.is_conv_state_dim_first():
        raise ValueError(
            "VLLM_SSM_CONV_STATE_LAYOUT=DS: vllm-unified keeps conv states as "
            f"(state_len, dim) like mlx-lm (state shapes {shapes}); unset it"
        )


class HybridLayers:
    """The runner's view of a model's layer kinds: attention layers (on the paged KV pool, in
    pool order) and recurrent layers (on state pages), plus the state store once bound.

    For a model that is not hybrid every layer is an attention layer. ``held``: the layer
    indices this worker holds (a pipeline stage's; default all): only they have pages here.
    ``attention``: the attention layer indices where a layer may be both (mlx-lm's CacheList
    of a recurrent state and a KV cache, Falcon-H1); default: every layer not recurrent.
    """

    def __init__(self, model_type: str, num_layers: int, recurrent: list[int],
                 held: range | None = None, attention: list[int] | None = None) -> None:
        self.model_type = model_type
        self.num_layers = num_layers
        held = range(num_layers) if held is None else held
        self.recurrent = [i for i in recurrent if i in held]
        rec = set(self.recurrent)
        self.attention = ([i for i in held if i not in rec] if attention is None
                          else [i for i in held if i in set(attention)])
        #: request id -> its state slot per state group, recorded when first scheduled, for
        #: the last ``SLOT_HISTORY`` requests (tests check that a finished request's slot is
        #: reused cleanly; bounded so a long-running server does not grow it)
        self.slot_owners: OrderedDict[str, list[int]] = OrderedDict()

    @property
    def is_hybrid(self) -> bool:
        """The model keeps recurrent state (next to attention layers, or alone)."""
        return bool(self.recurrent)

    @property
    def attention_free(self) -> bool:
        """Every layer held here is recurrent (vLLM's attention-free Mamba models): vLLM's
        KV cache config then has state groups only, and no attention pool is allocated."""
        return bool(self.recurrent) and not self.attention

    def state_specs(self, vllm_config: Any) -> dict[str, Any]:
        """``{layer name: MambaSpec}`` for the recurrent layers."""
        if not self.recurrent:
            return {}
        spec = mamba_spec(vllm_config, self.model_type)
        return {recurrent_layer_name(i): spec for i in self.recurrent}

    def attention_group(self, kv_cache_config: Any, names: list[str]) -> int:
        """The KV cache group holding all attention layers ``names``.

        Raises:
            ValueError: they are spread over several groups, or some are missing.
        """
        groups = [i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                  if set(g.layer_names) & set(names)]
        found = {n for i in groups for n in kv_cache_config.kv_cache_groups[i].layer_names}
        if len(groups) != 1 or not set(names) <= found:
            raise ValueError(f"attention layers {names} are not one KV cache group "
                             f"(groups {groups})")
        return groups[0]

    def state_layout(self, kv_cache_config: Any) -> dict[int, tuple[str, int, Any]]:
        """Per recurrent layer index: its KV-cache layer name, its state group and the packing
        of its states (:func:`vllm_unified.kv.state_pages.state_fields`), from vLLM's sized
        config; the pages themselves are vLLM's views of that layer
        (:meth:`vllm_unified.kv.cache.KVCache.initialize` imports them with the pool).

        Raises:
            ValueError: a recurrent layer has no state group, or a state dtype is not held.
        """
        layout = {}
        for i in self.recurrent:
            name = recurrent_layer_name(i)
            gid = next((g for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                        if name in grp.layer_names), None)
            if gid is None:
                raise ValueError(f"recurrent layer {name} is in no KV cache group")
            spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            layout[i] = (name, gid, state_fields(spec.shapes, spec.dtypes))
        return layout

    def slots(self, store: Any, states: list[Any]) -> dict[int, Any]:
        """Per state group, each request's state slot (its one block of that group).

        Raises:
            RuntimeError: a request has no block in a state group.
        """
        out = {}
        for g in sorted(set(store.groups.values())):
            ids = []
            for s in states:
                blocks = s.other_block_ids.get(g)
                if not blocks:
                    raise RuntimeError(f"request {s.req_id!r} has no state block in group {g}")
                ids.append(blocks[0])
            out[g] = np.asarray(ids, dtype=np.int32)
        for i, s in enumerate(states):
            if s.req_id not in self.slot_owners:
                self.slot_owners[s.req_id] = [int(out[g][i]) for g in sorted(out)]
                if len(self.slot_owners) > SLOT_HISTORY:
                    self.slot_owners.popitem(last=False)
        return out

    def temp_store(self, vllm_config: Any, num_blocks: int):
        """An MLX-owned zeroed state store (profiling forward), or None if not hybrid."""
        if not self.recurrent:
            return None
        spec = mamba_spec(vllm_config, self.model_type)
        fields = state_fields(spec.shapes, spec.dtypes)
        return StateStore({i: StatePages.allocate_mlx(num_blocks, spec.page_size_bytes, fields)
                           for i in self.recurrent}, {i: 0 for i in self.recurrent})

    def step_slots(self, store: Any, states: list[Any] | None, num_seqs: int) -> dict:
        """``slots`` for :func:`build_state_metadata`: the requests' slots, or slot 0 (vLLM's
        null block, never handed to a request) for ``num_seqs`` dummy sequences."""
        if states is not None:
            return self.slots(store, states)
        return {g: np.zeros(num_seqs, np.int32) for g in set(store.groups.values())}
