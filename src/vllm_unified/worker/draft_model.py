"""``--speculative-config '{"method": "draft_model", "model": ...}'``: a smaller model with the
target's tokenizer, run in MLX next to the target, proposing ``k`` tokens per step greedily.

How vLLM 0.32 lays it out, and what we follow (``vllm/v1/spec_decode/draft_model.py``,
``llm_base_proposer.py``): the draft's attention layers are extra layers of the same
``get_kv_cache_spec`` answer (names prefixed ``draft_model.``), so vLLM's KV cache manager puts
them in the target's KV cache group (one block table for both: every request's blocks hold
the draft's pages too) and sizes ``num_blocks`` over both; the scheduler reserves ``k``
lookahead slots (``VllmConfig.num_lookahead_tokens``) for the positions the draft writes past
the target's query. Here the draft's layers get their own :class:`~vllm_unified.kv.cache.
KVCache` (same lazily committed pool design, its own buffer) over the draft's part of vLLM's
``KVCacheConfig`` (:func:`split_kv_cache_config`).

Proposal (after a step is sampled, on the host tokens): each sampling request feeds the tokens
the draft has no KV for yet (the whole sequence the first time, afterwards the tokens accepted
in the last step plus the new one) in draft forwards of at most ``max_num_batched_tokens``
tokens (the target's prefill is chunked the same way); the argmax after its last token is
draft 1, and one-token forwards give the rest, up to each request's depth (``k``, or fewer
when the draft budget caps it: :mod:`vllm_unified.worker.draft_budget`; depth 0 drafts
nothing and leaves the request's draft KV to be caught up later). Draft tokens are argmax
(deterministic), so vLLM's rejection sampler with ``draft_probs=None`` keeps the target's
distribution exactly.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified.backend import BackendProfile
from vllm_unified.bridge import mlx_dtype
from vllm_unified.compat import KVCacheConfig, KVCacheSpec, init_logger
from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
from vllm_unified.kv.forward_context import set_step_context
from vllm_unified.kv.hybrid import HybridLayers
from vllm_unified.models.capability import route_model
from vllm_unified.models.loader import check_dtype_supported, load_model
from vllm_unified.worker.forward import forward
from vllm_unified.worker.input_batch import RequestState

logger = init_logger(__name__)

#: prefix of the draft's KV layer names (vLLM's ``DraftModelProposer`` loads with this prefix)
DRAFT_PREFIX = "draft_model."


def split_kv_cache_config(config: KVCacheConfig, draft_names: set[str]
                          ) -> tuple[KVCacheConfig, KVCacheConfig]:
    """vLLM's config over target + draft layers, as two configs over the same ``num_blocks``:
    the target's layers, and the draft's with :data:`DRAFT_PREFIX` taken off their names.

    Each ``KVCacheTensor`` that stacks layers of both is split into two tensors of the same
    layer layout (strides, page), each starting at offset 0 of its own allocation.

    Raises:
        ValueError: draft layers in more than one group, or outside the target's group, or a
            tensor whose layers are not stacked at one stride.
    """
    groups = [g for g in config.kv_cache_groups if draft_names & set(g.layer_names)]
    if len(groups) != 1:
        raise ValueError(f"draft layers in {len(groups)} KV cache groups (one expected)")
    if not set(groups[0].layer_names) - draft_names:
        raise ValueError("the draft's KV cache group holds no target layer: the draft would "
                         "not share the target's block table")

    def group_part(g: Any, names: list[str], strip: bool) -> Any:
        spec = g.kv_cache_spec
        if hasattr(spec, "kv_cache_specs"):  # UniformTypeKVCacheSpecs: one spec per layer
            spec = spec.kv_cache_specs[names[0]]
        out_names = [n[len(DRAFT_PREFIX):] for n in names] if strip else names
        return replace(g, layer_names=out_names, kv_cache_spec=spec)

    def tensor_part(t: Any, names: list[str], strip: bool) -> Any:
        idx = [t.layers.index(n) for n in names]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError(f"KV tensor layers {t.layers}: draft and target layers are not "
                             "stacked apart")
        # bytes from the last layer's start to the end of the allocation (its blocks)
        last_span = t.size - t.offset - (len(t.layers) - 1) * t.layer_stride
        out_names = [n[len(DRAFT_PREFIX):] for n in names] if strip else names
        return replace(t, size=(len(names) - 1) * t.layer_stride + last_span,
                       layers=out_names, offset=0)

    parts = []
    for strip in (False, True):
        keep = (lambda n: n in draft_names) if strip else (lambda n: n not in draft_names)
        tensors = []
        for t in config.kv_cache_tensors:
            names = [n for n in t.layers if keep(n)]
            if names:
                tensors.append(tensor_part(t, names, strip))
        kv_groups = []
        for g in config.kv_cache_groups:
            names = [n for n in g.layer_names if keep(n)]
            if names:
                kv_groups.append(group_part(g, names, strip))
        parts.append(replace(config, kv_cache_tensors=tensors, kv_cache_groups=kv_groups))
    return parts[0], parts[1]


class DraftModel:
    """The draft model, its KV cache and its greedy proposals.

    Args:
        vllm_config: vLLM's config (``speculative_config.method == "draft_model"``).
        backend: the worker's backend profile.

    Raises:
        ValueError: a hybrid (recurrent) draft model, naming ``--speculative-config``.
    """

    def __init__(self, vllm_config: Any, backend: BackendProfile) -> None:
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.k = int(spec.num_speculative_tokens)
        self.model_config = spec.draft_model_config
        self.backend = backend
        self.max_model_len = vllm_config.model_config.max_model_len
        #: tokens per draft forward at most (the target's step budget)
        self.budget = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self._first: list[int] = []
        self.model: Any = None
        self.kv_cache: KVCache | None = None
        #: req_id -> (the block list the draft's KV was written under, tokens with draft KV)
        self._computed: dict[str, tuple[list[int], int]] = {}
        self.forwards = 0
        #: the last :meth:`propose`'s forwards: (token rows, seconds), rows of at most
        #: 8 tokens per request (catch-ups of whole prompts are not kept: a prefill's cost
        #: per row is another)
        self.last_forwards: list[tuple[int, float]] = []

    def load(self, checkpoint: str, keep_quantized: bool) -> None:
        """Load the draft's weights (the target's loader) and route its attention to its own
        paged cache."""
        mc = self.model_config
        dtype = mlx_dtype(mc.dtype)
        loaded = load_model(checkpoint, hf_config=mc.hf_config.to_dict(), dtype=dtype,
                            keep_quantized=keep_quantized)
        self.model = loaded.model
        check_dtype_supported(self.model, dtype, self.backend.kind)
        pc = self.vllm_config.parallel_config
        layout, _ = route_model(self.model, loaded.config,
                                kv_shape=(mc.get_num_kv_heads(pc), mc.get_head_size()),
                                config_window=mc.get_sliding_window())
        if layout.recurrent:
            raise ValueError("--speculative-config: a hybrid attention + state-space draft "
                             "model is not supported by vllm-unified")
        if layout.shared:
            raise ValueError("--speculative-config: a draft model whose layers share KV is "
                             "not supported by vllm-unified")
        if any(layout.windows.values()):
            raise ValueError("--speculative-config: a draft model with sliding-window "
                             "layers is not supported by vllm-unified")
        if layout.latent is not None:
            raise ValueError("--speculative-config: a draft model with multi-head latent "
                             "attention is not supported by vllm-unified")
        layers = HybridLayers(loaded.config["model_type"], layout.num_slots, [])
        cache_dtype = (self.vllm_config.speculative_config.kv_cache_dtype
                       or self.vllm_config.cache_config.cache_dtype or "auto")
        shape = AttentionShape(mc.get_num_kv_heads(pc), mc.get_head_size(), mc.dtype,
                               cache_dtype)
        kv_shapes = {i: (a.num_kv_heads, a.head_dim) for i, a in layout.attention.items()
                     if a.num_kv_heads is not None}
        self.kv_cache = KVCache(self.backend, layers, shape, layout.windows, dtype,
                                kv_shapes=kv_shapes)
        logger.info("vllm-unified: draft model %s loaded (%s, %d layers)", mc.model,
                    loaded.source, len(self.model.layers))

    def kv_cache_spec(self, block_size: int) -> dict[str, KVCacheSpec]:
        """The draft's attention specs under :data:`DRAFT_PREFIX` names."""
        return {DRAFT_PREFIX + n: s
                for n, s in self.kv_cache.kv_cache_spec(block_size, self.vllm_config).items()}

    def layer_names(self) -> set[str]:
        return {DRAFT_PREFIX + layer_name(i) for i in self.kv_cache.layers.attention}

    def initialize(self, config: KVCacheConfig, layout: str | None) -> None:
        """Allocate the draft's pool over its part of vLLM's config (already split)."""
        logger.info("vllm-unified: draft model's KV pool (%d layers, the target's block table):",
                    len(self.kv_cache.layers.attention))
        self.kv_cache.initialize(config, layout)
        if self.kv_cache.kernel_block_size is None:
            raise ValueError("draft KV cache without a kernel block size")

    # ------------------------------------------------------------------ proposal
    def _forward(self, ids: list[int], query_lens: list[int], seq_lens: list[int],
                 table: np.ndarray) -> list[int]:
        """One draft forward; the argmax token of each request's last row."""
        started = time.perf_counter()
        ctx = self.kv_cache.step_context(query_lens, seq_lens, table, None)
        rows = (np.cumsum(query_lens) - 1).astype(np.int32)
        with set_step_context(ctx):
            logits = forward(self.model, self.kv_cache.layer_caches,
                             mx.array(np.asarray(ids, np.int32)), rows)
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens, self.kv_cache.arrays())
        out = tokens.tolist()
        self.forwards += 1
        if len(ids) <= 8 * len(query_lens):
            self.last_forwards.append((len(ids), time.perf_counter() - started))
        return out

    def _catch_up(self, states: list[RequestState], active: list[int], starts: list[int],
                  slens: list[int], table: np.ndarray) -> None:
        """Feed each active request's tokens ``[start, len)`` (KV written), in forwards of at
        most ``max_num_batched_tokens`` tokens, as the target's prefill is chunked; sets
        ``_first[j]``, the argmax after each request's last token."""
        budget = self.budget
        pieces: list[tuple[int, int, int]] = []  # (row j, first position, end position)
        for j in range(len(active)):
            for a in range(starts[j], slens[j], budget):
                pieces.append((j, a, min(a + budget, slens[j])))
        self._first = [0] * len(active)
        group: list[tuple[int, int, int]] = []

        def run(group: list[tuple[int, int, int]]) -> None:
            ids: list[int] = []
            for j, a, e in group:
                ids += states[active[j]].token_ids[a:e]
            out = self._forward(ids, [e - a for _, a, e in group], [e for _, _, e in group],
                                table[[j for j, _, _ in group]])
            for (j, _, e), t in zip(group, out, strict=True):
                if e == slens[j]:
                    self._first[j] = t

        for piece in pieces:
            if group and sum(e - a for _, a, e in group) + piece[2] - piece[1] > budget:
                run(group)
                group = []
            group.append(piece)
        if group:
            run(group)

    def stats(self) -> dict[str, int]:
        """Draft forwards so far and requests whose draft KV is tracked."""
        return {"draft_forwards": self.forwards, "draft_tracked_requests": len(self._computed)}

    def forget(self, req_ids: Any) -> None:
        """Drop the KV bookkeeping of finished requests."""
        for req_id in req_ids:
            self._computed.pop(req_id, None)

    def propose(self, states: list[RequestState], sampled: list[list[int]],
                depths: list[int] | None = None) -> list[list[int]]:
        """Greedy drafts per request that sampled this step (none for the rest).

        Args:
            states: the step's requests; ``token_ids`` hold this step's tokens.
            sampled: tokens sampled per request this step (empty: no drafts).
            depths: drafts wanted per request (``0..k``; 0: none, and no draft forward for
                it); None: ``k`` each. Positions past ``max_model_len`` are never drafted.

        Raises:
            RuntimeError: a position the draft writes has no block in the request's table
                (vLLM's lookahead slots were not reserved).
            ValueError: a depth outside ``0..k``.
        """
        drafts: list[list[int]] = [[] for _ in states]
        self.last_forwards = []
        if depths is None:
            depths = [self.k] * len(states)
        if any(not 0 <= d <= self.k for d in depths):
            raise ValueError(f"draft depths {depths}: each must be in 0..{self.k}")
        active = [i for i, s in enumerate(states) if sampled[i] and depths[i]
                  and len(s.token_ids) < self.max_model_len]
        if not active:
            return drafts
        bs = self.kv_cache.block_size
        starts, slens = [], []
        for i in active:
            s = states[i]
            owner, done = self._computed.get(s.req_id, (None, 0))
            starts.append(min(done, len(s.token_ids) - 1) if owner is s.block_ids else 0)
            slens.append(len(s.token_ids))
        width = max(len(states[i].block_ids) for i in active)
        table = np.zeros((len(active), width), dtype=np.int32)
        for j, i in enumerate(active):
            table[j, :len(states[i].block_ids)] = states[i].block_ids
        steps = [min(depths[i], self.max_model_len - slens[j]) for j, i in enumerate(active)]
        for j, i in enumerate(active):
            last = slens[j] + steps[j] - 2  # the last position a draft forward writes
            if last // bs >= len(states[i].block_ids):
                raise RuntimeError(
                    f"request {states[i].req_id}: draft position {last} has no KV block "
                    f"({len(states[i].block_ids)} blocks of {bs}): lookahead slots missing")
        self._catch_up(states, active, starts, slens, table)
        for j, i in enumerate(active):
            drafts[i].append(self._first[j])
            self._computed[states[i].req_id] = (states[i].block_ids, slens[j])
        for step in range(1, max(steps)):
            rows = [j for j in range(len(active)) if steps[j] > step]
            if not rows:
                break
            out = self._forward([drafts[active[j]][-1] for j in rows], [1] * len(rows),
                                [slens[j] + step for j in rows], table[rows])
            for t, j in zip(out, rows, strict=True):
                drafts[active[j]].append(t)
        return drafts
