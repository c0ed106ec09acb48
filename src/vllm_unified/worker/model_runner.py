"""The model runner: one MLX forward per scheduler step, over all scheduled requests.

Each step, every scheduled token (decode tokens and prefill chunks of all requests) becomes one
row of a token-major batch ``[T, 1]``; the mlx-lm model runs once over it with the paged KV cache
(:mod:`vllm_unified.models.paged_cache`), the LM head runs only on the rows that sample, and the
sampler (:mod:`vllm_unified.worker.sampler`) picks the tokens. Evaluation happens once per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_unified.attention.metadata import build_attention_metadata
from vllm_unified.compat import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    VllmConfig,
    init_logger,
)
from vllm_unified.models.gguf_dir import gguf_in_dir
from vllm_unified.models.loader import LoadedModel, load_model
from vllm_unified.models.paged_cache import KVPool, PagedLayerCache, install_paged_attention
from vllm_unified.worker.input_batch import InputBatch, RequestState
from vllm_unified.worker.sampler import SamplingRow, sample

logger = init_logger(__name__)

_TORCH_TO_MLX = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def layer_name(i: int) -> str:
    """KV-cache layer name we report to vLLM for decoder layer ``i``."""
    return f"model.layers.{i}.self_attn.attn"


@dataclass
class RunnerStats:
    """Counters for logs and tests (e.g. "one forward per step")."""

    steps: int = 0
    empty_steps: int = 0
    forwards: int = 0
    tokens: int = 0
    sampled: int = 0
    #: number of forwards by how many requests they covered
    forwards_by_num_reqs: dict[int, int] = field(default_factory=dict)


class MLXModelRunner:
    """Executes scheduler steps on an mlx-lm model with a paged KV cache."""

    def __init__(self, vllm_config: VllmConfig, keep_quantized: bool) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.block_size: int = vllm_config.cache_config.block_size
        self.dtype: mx.Dtype = _TORCH_TO_MLX[str(self.model_config.dtype).removeprefix("torch.")]
        self.keep_quantized = keep_quantized
        self.loaded: LoadedModel | None = None
        self.model: nn.Module | None = None
        self.pool: KVPool | None = None
        self.layer_caches: list[PagedLayerCache] = []
        self.batch = InputBatch()
        self.stats = RunnerStats()

    # ----------------------------------------------------------------------------- model
    def load_model(self) -> None:
        """Load weights with the project's loader and route attention to the paged cache."""
        start = time.perf_counter()
        hf_config = self.model_config.hf_config.to_dict()
        path = self.model_config.model
        self.loaded = load_model(
            _checkpoint_path(path), hf_config=hf_config, dtype=self.dtype,
            keep_quantized=self.keep_quantized,
        )
        self.model = self.loaded.model
        patched = install_paged_attention(self.model)
        num_layers = len(self.model.layers)
        if num_layers != self.model_config.get_num_layers(self.vllm_config.parallel_config):
            raise ValueError(
                f"mlx-lm built {num_layers} layers but vLLM's config has "
                f"{self.model_config.get_num_layers(self.vllm_config.parallel_config)}"
            )
        logger.info(
            "vllm-unified: loaded %s (%s, %d layers, dtype %s, quantized=%s) in %.2f s; "
            "paged attention routed in %s",
            path, self.loaded.source, num_layers, self.dtype, self.loaded.quantized,
            time.perf_counter() - start, ", ".join(patched) or "(already routed)",
        )

    def _window(self, i: int) -> int | None:
        """Sliding window of layer ``i`` (tokens), None for full attention."""
        layer = self.model.layers[i]
        # mlx-lm marks it on the block (llama: use_sliding) or on the attention (gemma3).
        attn = getattr(layer, "self_attn", None)
        if getattr(layer, "use_sliding", False) or getattr(attn, "is_sliding", False):
            return int(self.loaded.config["sliding_window"])
        return None

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One ``FullAttentionSpec`` per layer; sliding-window layers record their window (vLLM
        keeps blocks for all tokens, the attention applies the window)."""
        pc = self.vllm_config.parallel_config
        num_kv_heads = self.model_config.get_num_kv_heads(pc)
        head_size = self.model_config.get_head_size()
        return {
            layer_name(i): FullAttentionSpec(
                block_size=self.block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                dtype=self.model_config.dtype, sliding_window=self._window(i),
            )
            for i in range(len(self.model.layers))
        }

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers: 2 (K and V) x block_size x kv_heads x
        head_size x dtype size x layers."""
        return sum(spec.page_size_bytes for spec in self.get_kv_cache_spec().values())

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the paged pool for ``kv_cache_config.num_blocks`` blocks.

        Raises:
            ValueError: more than one KV-cache group (hybrid models are not supported yet).
        """
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{len(groups)} KV cache groups: only one is supported")
        names = groups[0].layer_names
        expected = [layer_name(i) for i in range(len(self.model.layers))]
        if sorted(names) != sorted(expected):
            raise ValueError("KV cache group layers do not match the model's layers")
        spec = groups[0].kv_cache_spec
        self.pool = KVPool(
            num_layers=len(expected), num_blocks=kv_cache_config.num_blocks,
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size, dtype=self.dtype,
        )
        self.layer_caches = [PagedLayerCache(self.pool, i) for i in range(len(expected))]
        logger.info(
            "vllm-unified: KV pool %d blocks x %d tokens, %.2f GiB",
            kv_cache_config.num_blocks, spec.block_size, self.pool.nbytes / 2**30,
        )

    # ----------------------------------------------------------------------------- steps
    def _new_request(self, new: NewRequestData) -> RequestState:
        if new.prompt_token_ids is None:
            raise ValueError(f"request {new.req_id}: prompt embeddings are not supported")
        params = new.sampling_params
        key = mx.random.key(params.seed) if params.seed is not None else None
        return RequestState(
            req_id=new.req_id, token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids), block_ids=list(new.block_ids[0]),
            num_computed_tokens=new.num_computed_tokens, sampling_params=params, rng_key=key,
        )

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduler step: update request states, one forward, sample.

        Returns:
            ``ModelRunnerOutput`` with one entry per scheduled request (``[]`` for a request
            whose prefill chunk does not reach the end of its prompt).
        """
        if out.scheduled_spec_decode_tokens:
            raise RuntimeError("speculative decoding tokens in a step: not supported")
        if out.kv_cache_block_copies:
            raise RuntimeError("KV block copies requested: not supported by vllm-unified")
        self.batch.update(out, self._new_request)
        if out.new_block_ids_to_zero:
            self.pool.zero_blocks(list(out.new_block_ids_to_zero))
        self.stats.steps += 1
        if out.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            return EMPTY_MODEL_RUNNER_OUTPUT

        step = self.batch.layout(out)
        token_ids = self._forward_and_sample(step)
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        for j, i in enumerate(step.sample_req_idx):
            token = token_ids[j]
            state = self.batch.requests[step.req_ids[i]]
            state.token_ids.append(token)
            sampled[i] = [token]
        self.stats.sampled += len(token_ids)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
        )

    def _forward_and_sample(self, step) -> list[int]:
        meta = build_attention_metadata(
            step.query_lens.tolist(), step.seq_lens.tolist(), step.block_table, self.block_size
        )
        self.pool.meta = meta
        try:
            logits = self.forward(mx.array(step.input_ids), step.sample_token_idx)
            rows = [self._sampling_row(step.req_ids[i]) for i in step.sample_req_idx]
            tokens = sample(logits, rows) if rows else mx.zeros((0,), dtype=mx.int32)
            mx.eval(tokens, self.pool.k, self.pool.v)
        finally:
            self.pool.meta = None
        self.stats.forwards += 1
        self.stats.tokens += int(step.input_ids.size)
        by_reqs = self.stats.forwards_by_num_reqs
        by_reqs[len(step.req_ids)] = by_reqs.get(len(step.req_ids), 0) + 1
        return tokens.tolist()

    def forward(self, input_ids: mx.array, sample_rows: np.ndarray) -> mx.array:
        """See :func:`forward`; uses this runner's model and layer caches."""
        return forward(self.model, self.layer_caches, input_ids, sample_rows)

    def stats_dict(self) -> dict:
        return {**asdict(self.stats), "resumed": self.batch.num_resumed,
                "live_requests": len(self.batch.requests)}

    def _sampling_row(self, req_id: str) -> SamplingRow:
        state = self.batch.requests[req_id]
        p: Any = state.sampling_params
        key = None
        if state.rng_key is not None:
            state.rng_key, key = mx.random.split(state.rng_key)
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, key=key
        )

    # ----------------------------------------------------------------------------- warm-up
    def warm_up(self) -> float:
        """Run a dummy prefill and decode through the real path (block 0 is vLLM's null block,
        never handed to requests, so writing it is harmless). Returns seconds taken."""
        start = time.perf_counter()
        n = min(self.block_size, self.model_config.max_model_len)
        table = np.zeros((1, 1), dtype=np.int32)
        meta = build_attention_metadata([n], [n], table, self.block_size)
        self.pool.meta = meta
        try:
            logits = self.forward(mx.zeros((n,), dtype=mx.int32), np.array([n - 1], np.int32))
            mx.eval(logits, self.pool.k, self.pool.v)
        finally:
            self.pool.meta = None
        return time.perf_counter() - start


def forward(
    model: nn.Module, layer_caches: list[PagedLayerCache], input_ids: mx.array,
    sample_rows: np.ndarray,
) -> mx.array:
    """One token-major forward of an mlx-lm model over the paged cache (lazy).

    Args:
        model: mlx-lm model with paged attention installed.
        layer_caches: one :class:`PagedLayerCache` per layer; their pool's ``meta`` must hold the
            step's attention metadata.
        input_ids: ``[T]`` int32 token ids, one row per scheduled token.
        sample_rows: ``[R]`` int32 rows whose logits are needed.

    Returns:
        ``[R, V]`` logits in the model dtype (the LM head runs on those rows only).
    """
    hidden = model.model(input_ids[:, None], cache=layer_caches)  # [T, 1, D]
    hidden = hidden[mx.array(sample_rows), 0, :] if sample_rows.size else hidden[:0, 0, :]
    return _lm_head(model, hidden)


def _lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """The architecture's output projection: ``lm_head`` or the tied embedding."""
    if "lm_head" in model:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def _checkpoint_path(path: str) -> str:
    """The file or folder to load: the linked GGUF of a folder made by ``prepare_gguf_dir``,
    else the checkpoint folder itself."""
    gguf = gguf_in_dir(path)
    return str(gguf) if gguf is not None else path
