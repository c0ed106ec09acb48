"""vLLM's pooling runner for encoder-only models (BERT, RoBERTa / XLM-RoBERTa, ModernBERT).

An encoder attends bidirectionally within each request and keeps no KV cache: the runner
reports no KV cache spec (vLLM then treats the model as attention-free: no blocks, chunked
prefill and prefix caching off, so each step holds whole prompts). A step's requests are
sorted by length and cut into groups of similar length. BERT and RoBERTa bodies run on the
step's packed tokens (projections, MLPs and norms without padding) with attention as one
right-padded batch per group; other encoders run each group as a padded batch. The step is one
MLX graph, evaluated once; the rows come back in the ``[T, D]`` token-major layout of the
step's requests that vLLM's pooler reads (:mod:`vllm_unified.worker.pooling`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified.backend import BackendProfile
from vllm_unified.bridge import mlx_dtype
from vllm_unified.compat import (
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    PoolingStates,
    SchedulerOutput,
    VllmConfig,
)
from vllm_unified.distributed.pipeline import PipelineStage
from vllm_unified.models.encoder_attention import route_encoder_attention
from vllm_unified.models.encoders import (
    AttentionGroup,
    LoadedEncoder,
    encode,
    encode_packed,
    load_encoder,
)
from vllm_unified.worker.pooling import Pooling
from vllm_unified.worker.step_profile import StepProfile
from vllm_unified.worker.vllm_sampling import mlx_to_torch

__all__ = ["EncoderModelRunner", "EncoderStats", "length_groups"]

logger = logging.getLogger("vllm.vllm_unified.worker.encoder_runner")

#: a group grows while its padded tokens stay within this factor of its real tokens
PADDING_SLACK = 1.1
#: at most this many padded tokens per group (bounds the ``B x heads x L x L`` scores)
MAX_GROUP_TOKENS = 8192


@dataclass
class EncoderRequest:
    """A request of one step (the fields vLLM's pooler reads, as ``RequestState``)."""

    req_id: str
    prompt_token_ids: list[int]
    pooling_params: Any
    pooling_states: PoolingStates

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_type_start(self) -> int | None:
        """Where token type 1 starts (a cross-encoder pair's second text), or None."""
        extra = self.pooling_params.extra_kwargs or {}
        return extra.get("compressed_token_type_ids")


@dataclass
class EncoderStats:
    """Counters for logs and tests."""

    steps: int = 0
    empty_steps: int = 0
    forwards: int = 0
    #: real tokens encoded / tokens computed with padding
    tokens: int = 0
    padded_tokens: int = 0
    #: padded batches run (one or more per forward)
    groups: int = 0
    pooled: int = 0


def length_groups(lengths: np.ndarray, slack: float = PADDING_SLACK,
                  max_tokens: int = MAX_GROUP_TOKENS) -> list[np.ndarray]:
    """Indices into ``lengths`` in groups of similar length, shortest first: each group's
    padded size (count x its longest) stays within ``slack`` x its real tokens and within
    ``max_tokens`` (a single longer sequence is a group of its own)."""
    order = np.argsort(lengths, kind="stable")
    groups: list[list[int]] = []
    real = 0
    for i in order:
        n = int(lengths[i])
        group = groups[-1] if groups else None
        if group is not None:
            padded = n * (len(group) + 1)
            if padded <= slack * (real + n) and padded <= max_tokens:
                group.append(int(i))
                real += n
                continue
        groups.append([int(i)])
        real = n
    return [np.array(g, dtype=np.int64) for g in groups]


class EncoderModelRunner:
    """The model runner of an encoder-only pooling model (no KV cache, no sampling).

    Offers the part of :class:`~vllm_unified.worker.model_runner.MLXModelRunner`'s interface
    the worker uses for a pooling model.
    """

    def __init__(self, vllm_config: VllmConfig, backend: BackendProfile) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.backend = backend
        self.dtype: mx.Dtype = mlx_dtype(self.model_config.dtype)
        self.loaded: LoadedEncoder | None = None
        self.pooling: Pooling | None = None
        self.stage = PipelineStage.whole(self.model_config.get_num_layers(
            vllm_config.parallel_config))
        self.stats = EncoderStats()
        self.step_profile = StepProfile()
        #: no queued steps, no KV pool, no connector: what the worker asks a runner for
        self.encoder = None
        self.pool = None
        self.pad_token_id = int(getattr(self.model_config.hf_config, "pad_token_id", 0) or 0)

    @property
    def model(self):
        return self.loaded.model if self.loaded is not None else None

    def load_model(self) -> None:
        start = time.perf_counter()
        self.loaded = load_encoder(self.model_config.model,
                                   self.model_config.hf_config.to_dict(), self.dtype)
        self.pooling = Pooling(self.vllm_config, self.loaded)
        routed = route_encoder_attention(self.loaded.model)
        logger.info("vllm-unified: loaded encoder %s (%s, %d layers, %.1fM parameters, dtype "
                    "%s, mlx-vlm's definition) in %.2f s; no KV cache (bidirectional "
                    "attention within each request%s); %s", self.model_config.model,
                    self.loaded.config["model_type"], self.stage.num_layers,
                    self.loaded.num_parameters() / 1e6, self.dtype,
                    time.perf_counter() - start,
                    ", routed in " + ", ".join(m for m, _ in routed) if routed else "",
                    self.pooling.describe())

    # ------------------------------------------------------------------ no KV cache
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """None: vLLM then runs the model as attention-free (no KV blocks)."""
        return {}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        if kv_cache_config.kv_cache_groups:
            raise RuntimeError("an encoder-only model was given KV cache groups "
                               f"({len(kv_cache_config.kv_cache_groups)})")

    def warm_up(self) -> float:
        """One small forward, so that the first request does not pay for graph set-up.
        Returns seconds taken."""
        start = time.perf_counter()
        n = min(8, self.model_config.max_model_len)
        ids = mx.zeros((1, n), dtype=mx.int32)
        mx.eval(encode(self.loaded, ids, mx.ones((1, n), dtype=mx.int32), mx.zeros_like(ids)))
        return time.perf_counter() - start

    def quiesce(self) -> None:
        """Nothing is queued: every step is evaluated before it returns."""

    def shutdown(self) -> None:
        logger.info("vllm-unified: encoder runner stats %s", self.stats_dict())

    def stats_dict(self) -> dict:
        return {**asdict(self.stats), **{f"{k}_s": v
                                         for k, v in self.step_profile.seconds().items()}}

    def weights_nbytes(self) -> dict[str, int]:
        from mlx.utils import tree_flatten

        return {"layers": 0, "other": sum(a.nbytes for _, a in
                                          tree_flatten(self.loaded.model.parameters()))}

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        raise RuntimeError("sample_tokens called on a pooling model")

    def take_draft_token_ids(self) -> None:
        return None

    # ------------------------------------------------------------------ steps
    def execute_model(self, scheduler_output: SchedulerOutput,
                      hidden_in: mx.array | None = None) -> ModelRunnerOutput:
        """One step: every scheduled request's whole prompt encoded, pooled by vLLM's pooler.

        Raises:
            RuntimeError: a request scheduled with part of its prompt, or one not new in
                this step (an encoder model keeps nothing between steps).
        """
        self.stats.steps += 1
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            return ModelRunnerOutput(req_ids=[], req_id_to_index={})
        timer = self.step_profile.start()
        requests = self._step_requests(scheduler_output)
        lengths = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)
        timer.mark("prepare")
        hidden = self._forward(requests, lengths)
        timer.mark("graph")
        mx.eval(hidden)
        timer.mark("eval")
        pooled = self.pooling.pool(mlx_to_torch(hidden, self.backend.logits_zero_copy),
                                   requests, lengths, lengths)
        self.stats.pooled += sum(out is not None for out in pooled)
        line = self.step_profile.finish(timer, len(requests), int(lengths.sum()), False)
        if line is not None:
            logger.info(line)
        req_ids = [r.req_id for r in requests]
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 pooler_output=pooled)

    def _step_requests(self, scheduler_output: SchedulerOutput) -> list[EncoderRequest]:
        if scheduler_output.scheduled_cached_reqs.req_ids:
            raise RuntimeError("an encoder-only model was scheduled a request it has seen "
                               "before; it keeps nothing between steps")
        scheduled = scheduler_output.num_scheduled_tokens
        requests = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise ValueError(f"request {new.req_id}: prompt embeddings are not supported")
            n = len(new.prompt_token_ids)
            if new.num_computed_tokens != 0 or scheduled.get(new.req_id) != n:
                raise RuntimeError(
                    f"request {new.req_id}: {scheduled.get(new.req_id)} of its {n} tokens "
                    f"scheduled from {new.num_computed_tokens}; an encoder needs the whole "
                    "prompt in one step (chunked prefill must be off)")
            requests.append(EncoderRequest(
                new.req_id, list(new.prompt_token_ids), new.pooling_params,
                self.pooling.new_request(new.pooling_params)))
        return requests

    def _forward(self, requests: list[EncoderRequest], lengths: np.ndarray) -> mx.array:
        """``[T, D]`` final hidden states of the requests' tokens, token-major in request
        order. The requests are cut into :func:`length_groups`; a BERT or RoBERTa body runs
        on the packed tokens with attention per group (:func:`encode_packed`), others as one
        padded batch per group (:func:`encode`)."""
        groups = length_groups(lengths)
        order = np.concatenate(groups)  # request indices, group by group
        ids = np.concatenate([requests[i].prompt_token_ids for i in order]).astype(np.int32)
        positions = np.concatenate([np.arange(lengths[i]) for i in order]).astype(np.int32)
        types = np.zeros_like(ids)
        starts = np.concatenate([[0], np.cumsum(lengths[order])[:-1]])  # packed, by order
        for i, start in zip(order, starts, strict=True):
            type_start = requests[i].token_type_start()
            if type_start is not None:
                types[start + type_start:start + lengths[i]] = 1
        total = int(ids.size)
        attention: list[AttentionGroup] = []
        first = 0
        for group in groups:
            attention.append(self._attention_group(lengths[group], starts[first:], total))
            first += len(group)
        self.stats.forwards += 1
        self.stats.tokens += total
        self.stats.groups += len(groups)
        self.stats.padded_tokens += sum(g.batch * g.width for g in attention)
        if self.loaded.packs:
            hidden = encode_packed(self.loaded, mx.array(ids), mx.array(positions),
                                   mx.array(types), attention)
        else:
            hidden = self._padded_groups(ids, types, attention)
        # packed (group order) -> request order
        packed_start = np.empty(len(requests), dtype=np.int64)
        packed_start[order] = starts
        back = np.concatenate([packed_start[i] + np.arange(lengths[i])
                               for i in range(len(requests))])
        return hidden[mx.array(back.astype(np.int32))]

    def _attention_group(self, lengths: np.ndarray, starts: np.ndarray,
                         total: int) -> AttentionGroup:
        """The :class:`AttentionGroup` of sequences of ``lengths`` whose packed tokens start
        at ``starts[:len(lengths)]`` (``total`` packed tokens in the step)."""
        batch, width = len(lengths), int(lengths.max())
        rows = np.full((batch, width), total, dtype=np.int32)
        real = []
        mask = np.full((batch, 1, 1, width), np.finfo(np.float32).min, dtype=np.float32)
        for r, n in enumerate(lengths):
            rows[r, :n] = starts[r] + np.arange(n)
            real.append(r * width + np.arange(n))
            mask[r, ..., :n] = 0
        return AttentionGroup(mx.array(rows.reshape(-1)),
                              mx.array(np.concatenate(real).astype(np.int32)), batch, width,
                              mx.array(mask).astype(self.dtype))

    def _padded_groups(self, ids: np.ndarray, types: np.ndarray,
                       groups: list[AttentionGroup]) -> mx.array:
        """``[T, D]`` packed hidden states from one padded :func:`encode` per group."""
        pad = np.array([self.pad_token_id], dtype=np.int32)
        ids_ext, types_ext = np.concatenate([ids, pad]), np.concatenate([types, [0]])
        outs = []
        for g in groups:
            rows = np.array(g.rows)
            shape = (g.batch, g.width)
            hidden = encode(self.loaded, mx.array(ids_ext[rows].reshape(shape)),
                            mx.array((rows < ids.size).reshape(shape).astype(np.int32)),
                            mx.array(types_ext[rows].reshape(shape).astype(np.int32)))
            outs.append(hidden.reshape(-1, hidden.shape[-1])[g.real])
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)
