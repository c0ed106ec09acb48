"""The model runner: one MLX forward per scheduler step, over all scheduled requests.

Each step, every scheduled token (decode tokens and prefill chunks of all requests) becomes one
row of a token-major batch ``[T, 1]``; the mlx-lm model runs once over it with the paged KV cache
(:mod:`vllm_unified.models.paged_cache`), the LM head runs only on the rows that sample (plus
prompt rows of requests asking for prompt logprobs), and the tokens are picked by the MLX sampler
(:mod:`vllm_unified.worker.sampler`) or, for requests using more than it implements, by vLLM's
own sampler on a torch view of the logits (:mod:`vllm_unified.worker.vllm_sampling`). Evaluation
happens once per step. A step with structured-output requests returns None from
``execute_model`` and samples in ``sample_tokens`` with vLLM's grammar bitmask.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch

from vllm_unified import bridge
from vllm_unified.attention.block_translation import (
    expand_block_table,
    select_kernel_block_size,
)
from vllm_unified.attention.metadata import AttentionMetadata, build_attention_metadata
from vllm_unified.attention.paged import cuda_decode_routed
from vllm_unified.backend import detect_backend
from vllm_unified.compat import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    FullAttentionSpec,
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    LogprobsTensors,
    ModelRunnerOutput,
    NewRequestData,
    SamplingType,
    SchedulerOutput,
    VllmConfig,
    init_logger,
)
from vllm_unified.memory.kv_allocation import KV_LAYOUT, allocate_kv_cache
from vllm_unified.models.cpu_kernels import install_cpu_kernels, keep_quantized_on_cpu
from vllm_unified.models.gguf_dir import gguf_in_dir
from vllm_unified.models.hybrid import HybridLayers
from vllm_unified.models.loader import LoadedModel, check_dtype_supported, load_model
from vllm_unified.models.paged_cache import KVPool, PagedLayerCache, install_paged_attention
from vllm_unified.models.state_cache import build_state_metadata
from vllm_unified.offload.runner import KVConnectorHooks
from vllm_unified.platform import KERNEL_BLOCK_SIZES
from vllm_unified.worker.async_output import MLXAsyncOutput, feed_pending
from vllm_unified.worker.compiled_decode import (
    COMPILE_DECODE_ENV,
    CompiledDecode,
    compile_decode_enabled,
    is_pure_decode,
)
from vllm_unified.worker.input_batch import InputBatch, RequestState, StepBatch, split_groups
from vllm_unified.worker.sampler import SamplingRow, sample
from vllm_unified.worker.step_profile import StepProfile, StepTimer
from vllm_unified.worker.vllm_sampling import (
    VllmSampling,
    apply_grammar_bitmask,
    logprobs_lists,
    mlx_to_torch,
    needs_vllm_sampler,
)

logger = init_logger(__name__)

#: Set to 1 to zero-fill the KV buffer at start as vLLM's own allocator does (benchmarks only).
EAGER_ZERO_ENV = "VLLM_UNIFIED_KV_EAGER_ZERO"

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
    #: tokens sampled by vLLM's own sampler (the rest were sampled in MLX)
    sampled_by_vllm: int = 0
    #: prompt rows whose logprobs were computed
    prompt_logprob_rows: int = 0
    #: number of forwards by how many requests they covered
    forwards_by_num_reqs: dict[int, int] = field(default_factory=dict)
    #: pure-decode steps (every request one token) that followed one, and the wall time from
    #: the previous step's start to theirs: the engine's whole step period, scheduler included
    decode_steps: int = 0
    decode_period_s: float = 0.0


@dataclass
class _PromptSlice:
    """Prompt rows of one request in one step: ``num_logits`` rows from token row ``row``
    score prompt tokens ``start + 1 ...``; ``complete``: hand the tensors over this step."""

    index: int
    row: int
    num_logits: int
    start: int
    complete: bool


@dataclass
class _PendingStep:
    """A step between its forward and its sampling (across ``execute_model`` /
    ``sample_tokens`` when structured output needs vLLM's grammar bitmask)."""

    step: StepBatch
    out: Any
    states: list[RequestState]
    #: indices into ``step.req_ids`` sampled by vLLM's sampler (logits rows 0..) and in MLX
    vllm_idx: list[int]
    mlx_idx: list[int]
    prompt: list[_PromptSlice]
    #: evaluated float32 logits ``[rows, V]`` when torch needs them, else None
    logits: mx.array | None
    mlx_tokens: list[int]
    #: the step's KVConnectorOutput (KV offloading), None without a connector
    kv_output: Any = None
    #: asynchronous scheduling: the step was queued (``mx.async_eval``), not waited for; its
    #: MLX-sampled tokens are ``lazy_tokens`` (read back by ``_sample``), None if it has none
    lazy: bool = False
    lazy_tokens: mx.array | None = None
    timer: StepTimer | None = None


class MLXModelRunner:
    """Executes scheduler steps on an mlx-lm model with a paged KV cache."""

    def __init__(self, vllm_config: VllmConfig, keep_quantized: bool) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        #: tokens per block the MLX attention reads (``block_size`` divided, pillar 6)
        self.kernel_block_size: int | None = None
        #: vLLM's attention block size, fixed by the KV cache config
        self._kv_block_size: int | None = None
        self.layers: HybridLayers | None = None
        self.dtype: mx.Dtype = _TORCH_TO_MLX[str(self.model_config.dtype).removeprefix("torch.")]
        self.keep_quantized = keep_quantized
        self.loaded: LoadedModel | None = None
        self.model: nn.Module | None = None
        self.pool: KVPool | None = None
        self.pool_zeroed = False
        self.layer_caches: list[PagedLayerCache] = []
        self.compiled_decode: CompiledDecode | None = None
        self.batch = InputBatch()
        self.stats = RunnerStats()
        self.profile = StepProfile()
        #: the timer of the step being prepared (each queued step keeps its own)
        self._timer: StepTimer = self.profile.start()
        self.vocab_size: int = self.model_config.get_vocab_size()
        self.vllm_sampling = VllmSampling(vllm_config)
        if self.vllm_sampling.custom_logitsprocs:
            logger.info(
                "vllm-unified: custom logits processors %s: every request is sampled by "
                "vLLM's sampler", self.vllm_sampling.custom_logitsprocs,
            )
        #: MLX's CPU backend shares logits with torch (DLPack view); GPU backends copy them
        self.zero_copy_logits: bool = detect_backend().kind == "cpu"
        #: vLLM's async scheduling (see worker/async_output.py): steps are queued, not awaited
        self.async_scheduling: bool = bool(vllm_config.scheduler_config.async_scheduling)
        #: queued steps whose outputs vLLM has not collected yet, oldest first
        self._unresolved: list[MLXAsyncOutput] = []
        self._pending: _PendingStep | None = None
        self.kv_connector = KVConnectorHooks(vllm_config)
        #: start time of the previous step if it was pure decode (for RunnerStats.decode_*)
        self._decode_started: float | None = None

    # ----------------------------------------------------------------------------- model
    def load_model(self) -> None:
        """Load weights with the project's loader and route attention to the paged cache."""
        start = time.perf_counter()
        hf_config = self.model_config.hf_config.to_dict()
        path = self.model_config.model
        self.loaded = load_model(
            _checkpoint_path(path), hf_config=hf_config, dtype=self.dtype,
            keep_quantized=self.keep_quantized or keep_quantized_on_cpu(self.dtype),
        )
        self.model = self.loaded.model
        check_dtype_supported(self.model, self.dtype, detect_backend().kind)
        self.layers = HybridLayers(self.loaded.config["model_type"], self.model)
        patched = install_paged_attention(self.model, self.layers.recurrent)
        cpu_kernels = install_cpu_kernels(self.model)
        num_layers = len(self.model.layers)
        if num_layers != self.model_config.get_num_layers(self.vllm_config.parallel_config):
            raise ValueError(
                f"mlx-lm built {num_layers} layers but vLLM's config has "
                f"{self.model_config.get_num_layers(self.vllm_config.parallel_config)}"
            )
        logger.info(
            "vllm-unified: loaded %s (%s, %d layers, dtype %s, quantized=%s) in %.2f s; "
            "paged attention routed in %s; native CPU kernels: %s",
            path, self.loaded.source, num_layers, self.dtype, self.loaded.quantized,
            time.perf_counter() - start, ", ".join(patched) or "(already routed)",
            ", ".join(cpu_kernels) or "(none)",
        )

    @property
    def block_size(self) -> int:
        """vLLM's attention block size: the KV cache config's once it is allocated, before that
        the cache config's (final once the platform's ``update_block_size_for_backend`` has
        run, after the model loaded)."""
        return self._kv_block_size or self.vllm_config.cache_config.block_size

    @property
    def state_store(self):
        """Recurrent state pages of a hybrid model (None otherwise)."""
        return self.layers.store if self.layers is not None else None

    def _window(self, i: int) -> int | None:
        """Sliding window of layer ``i`` (tokens), None for full attention."""
        layer = self.model.layers[i]
        # mlx-lm marks it on the block (llama: use_sliding) or on the attention (gemma3).
        attn = getattr(layer, "self_attn", None)
        if getattr(layer, "use_sliding", False) or getattr(attn, "is_sliding", False):
            return int(self.loaded.config["sliding_window"])
        return None

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One ``FullAttentionSpec`` per attention layer; sliding-window layers record their
        window (vLLM keeps blocks for all tokens, the attention applies the window); one
        ``MambaSpec`` per recurrent layer of a hybrid model."""
        pc = self.vllm_config.parallel_config
        num_kv_heads = self.model_config.get_num_kv_heads(pc)
        head_size = self.model_config.get_head_size()
        specs = {
            layer_name(i): FullAttentionSpec(
                block_size=self.block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                dtype=self.model_config.dtype, sliding_window=self._window(i),
            )
            for i in self.layers.attention
        }
        specs.update(self.layers.state_specs(self.vllm_config))
        return specs

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all attention layers: 2 (K and V) x block_size x
        kv_heads x head_size x dtype size x layers. A hybrid model's state pages share vLLM's
        block pool with them (a request holds one per state group), so they are not added."""
        return sum(spec.page_size_bytes for spec in self.get_kv_cache_spec().values()
                   if isinstance(spec, FullAttentionSpec))

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the paged pool for ``kv_cache_config.num_blocks`` blocks.

        The attention reads each ``B``-token block as ``B/k`` kernel blocks of ``k`` tokens
        (vLLM's ``kernel_block_size`` views; no bytes move); a hybrid model's recurrent layers
        get their state pages.

        Raises:
            ValueError: KV-cache groups that do not match the model's layers (several groups
                for a model that is not hybrid), or a block size no kernel block divides.
        """
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 and not self.layers.is_hybrid:
            raise ValueError(f"{len(groups)} KV cache groups: only one is supported")
        expected = [layer_name(i) for i in self.layers.attention]
        attn_group = self.layers.attention_group(kv_cache_config, expected)
        if sorted(groups[attn_group].layer_names) != sorted(expected):
            raise ValueError("KV cache group layers do not match the model's layers")
        self.batch.attn_group = attn_group
        spec = groups[attn_group].kv_cache_spec
        self._kv_block_size = spec.block_size
        self.kernel_block_size = select_kernel_block_size(spec.block_size, KERNEL_BLOCK_SIZES)
        self.pool = self._allocate_pool(kv_cache_config, spec, expected, attn_group)
        self.layer_caches = self.layers.layer_caches(self.pool, self.state_store)
        self.compiled_decode = self._compiled_decode()
        self._register_kv_connector(kv_cache_config, spec.block_size, expected)
        logger.info(
            "vllm-unified: KV pool %d blocks x %d tokens (read as %d-token kernel blocks)%s, "
            "%.2f GiB (%s)",
            kv_cache_config.num_blocks, spec.block_size, self.kernel_block_size,
            f", {len(self.layers.recurrent)} recurrent layers on state pages in "
            f"{len(groups) - 1} state groups" if self.layers.is_hybrid else "",
            self.pool.nbytes / 2**30,
            "vLLM layout in torch memory, shared with MLX; zeroed" if self.pool.shared
            and self.pool_zeroed else
            "vLLM layout in torch memory, shared with MLX; uninitialised, committed as blocks "
            "are written" if self.pool.shared else "MLX-owned",
        )

    def _compiled_decode(self) -> CompiledDecode | None:
        """The compiled pure-decode forward where it applies: the in-place CUDA KV write, the
        CUDA decode kernel, no recurrent layers, not turned off by its variable."""
        head_dim = self.model_config.get_head_size()
        if not (self.pool.cuda_write and cuda_decode_routed(head_dim)
                and not self.layers.is_hybrid and compile_decode_enabled()):
            return None
        logger.info("vllm-unified: pure-decode steps run as one compiled MLX graph "
                    "(mx.compile, one trace per batch size; %s=0 turns it off)",
                    COMPILE_DECODE_ENV)
        return CompiledDecode(self.model, self.pool, self.layer_caches, forward)

    def _register_kv_connector(self, kv_cache_config: KVCacheConfig, block_size: int,
                               names: list[str]) -> None:
        """Hand vLLM's per-layer KV views to the KV connector (offloading), if one is set.

        Raises:
            ValueError: a connector is configured and the attention reads vLLM's blocks as
                smaller kernel blocks (its views are then the kernel-block views, whose block
                ids are not the scheduler's).
        """
        if not self.kv_connector.enabled:
            return
        if self.kernel_block_size != block_size:
            raise ValueError(
                f"--kv-offloading-size with --block-size {block_size}: the attention reads "
                f"{self.kernel_block_size}-token kernel blocks, and KV offloading needs a block "
                f"size the attention reads directly ({', '.join(map(str, KERNEL_BLOCK_SIZES))})"
            )
        views = dict(zip(names, self.pool.torch_views, strict=True)) \
            if self.pool.torch_views is not None else None
        self.kv_connector.register(kv_cache_config, views, lambda: mx.eval(self._cache_arrays()))

    def _allocate_pool(self, kv_cache_config: KVCacheConfig, spec, names: list[str],
                       attn_group: int = 0) -> KVPool:
        """Torch buffer in vLLM's layout shared with MLX on the CPU backend; MLX-owned arrays
        where the bridge cannot share (GPU backends) or is not installed (logged; hybrid
        models raise NotImplementedError there)."""
        error = bridge.native_error() if detect_backend().kind == "cpu" else "not the CPU backend"
        if error is None:
            layout = self.vllm_config.cache_config.kv_cache_layout or KV_LAYOUT
            # For benchmarks only: zero-fill like vLLM does, to compare start-up memory.
            eager = os.environ.get(EAGER_ZERO_ENV) == "1"
            self.pool_zeroed = eager or kv_cache_config.needs_kv_cache_zeroing
            buf, views = allocate_kv_cache(kv_cache_config, layout, zero=self.pool_zeroed,
                                           kernel_block_sizes={attn_group: self.kernel_block_size})
            if self.layers.is_hybrid:
                self.layers.bind(kv_cache_config, views, buf)
            return KVPool.from_torch_views([views[n] for n in names], spec.block_size, buf)
        if self.layers.is_hybrid:
            raise NotImplementedError(
                f"hybrid models need the KV cache shared with torch ({error})")
        logger.warning("vllm-unified: KV pool owned by MLX (torch cannot share it: %s)", error)
        return KVPool.allocate_mlx(
            num_layers=len(names), num_blocks=kv_cache_config.num_blocks,
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size, dtype=self.dtype,
        )

    # ----------------------------------------------------------------------------- steps
    def _new_request(self, new: NewRequestData) -> RequestState:
        if new.prompt_token_ids is None:
            raise ValueError(f"request {new.req_id}: prompt embeddings are not supported")
        params = new.sampling_params
        uses_vllm = needs_vllm_sampler(params) or bool(self.vllm_sampling.custom_logitsprocs)
        key = generator = None
        if params.sampling_type == SamplingType.RANDOM_SEED:
            if uses_vllm:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(params.seed)
            else:
                key = mx.random.key(params.seed)
        num_prompt_logprobs = None
        if params.prompt_logprobs is not None:
            num_prompt_logprobs = (
                self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            )
        attn_blocks, other_blocks = split_groups(new.block_ids, self.batch.attn_group)
        return RequestState(
            req_id=new.req_id, token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids), block_ids=attn_blocks,
            other_block_ids=other_blocks,
            num_computed_tokens=new.num_computed_tokens, sampling_params=params, rng_key=key,
            uses_vllm_sampler=uses_vllm, generator=generator,
            num_prompt_logprobs=num_prompt_logprobs,
        )

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one scheduler step: update request states, one forward, sample.

        Returns:
            ``ModelRunnerOutput`` with one entry per scheduled request (``[]`` for a request
            whose prefill chunk does not reach the end of its prompt); None when the step has
            structured-output requests or async scheduling is on: vLLM's engine then computes
            the grammar bitmask and calls :meth:`sample_tokens`, which samples from this
            step's logits.
        """
        started = time.perf_counter()
        previous_decode, self._decode_started = self._decode_started, None
        if self._pending is not None:
            raise RuntimeError("execute_model called before sample_tokens of the previous step")
        if out.scheduled_spec_decode_tokens:
            raise RuntimeError("speculative decoding tokens in a step: not supported")
        if out.kv_cache_block_copies:
            raise RuntimeError("KV block copies requested: not supported by vllm-unified")
        self._timer = self.profile.start()
        self.kv_connector.handle_preemptions(out)
        self.batch.update(out, self._new_request)
        if out.new_block_ids_to_zero:
            self.pool.zero_blocks(list(out.new_block_ids_to_zero))
            if self.state_store is not None:  # block ids are shared by all groups
                self.state_store.zero_block_ids(list(out.new_block_ids_to_zero))
        self.stats.steps += 1
        if out.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            return self.kv_connector.empty_step(out)

        step = self.batch.layout(out)
        with self.kv_connector.step(out) as kv_output:
            pending = self._forward(step, out)
        pending.kv_output = kv_output
        if bool((step.query_lens == 1).all()):
            self._decode_started = started
            if previous_decode is not None:  # two decode steps in a row: one whole period
                self.stats.decode_steps += 1
                self.stats.decode_period_s += started - previous_decode
        if out.has_structured_output_requests or self.async_scheduling:
            self._pending = pending
            return None
        return self._finish_step(pending, self._sample(pending, None))

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | MLXAsyncOutput:
        """Second half of a step whose :meth:`execute_model` returned None: apply vLLM's
        grammar bitmask to the structured-output rows, then sample. A step queued
        asynchronously returns an ``AsyncModelRunnerOutput`` that reads its tokens back when
        vLLM asks (after it has submitted the next step). A step that was waited for (its
        logits go to torch) first resolves the queued ones, so request states always take
        their tokens in step order and vLLM's sampler sees every earlier output token.

        Raises:
            RuntimeError: a grammar bitmask for a step that was queued asynchronously (steps
                with structured-output requests are always evaluated synchronously).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if pending.lazy:
            if grammar_output is not None:
                raise RuntimeError("grammar bitmask for an asynchronously queued step")
            self._unresolved = [o for o in self._unresolved if not o.resolved]
            output = MLXAsyncOutput(lambda: self._resolve(pending))
            self._unresolved.append(output)
            return output
        for earlier in self._unresolved:
            earlier.resolve()
        self._unresolved.clear()
        return self._finish_step(pending, self._sample(pending, grammar_output))

    def _resolve(self, pending: _PendingStep) -> ModelRunnerOutput:
        """Read back a queued step's tokens (waiting for its evaluation) and build its output."""
        pending.timer.resume()
        return self._finish_step(pending, self._sample(pending, None))

    def _finish_step(self, pending: _PendingStep, output: ModelRunnerOutput) -> ModelRunnerOutput:
        pending.timer.mark("output")
        line = self.profile.finish(
            pending.timer, len(pending.step.req_ids), int(pending.step.input_ids.size))
        if line is not None:
            logger.info(line)
        return output

    def _forward(self, step: StepBatch, out: SchedulerOutput) -> _PendingStep:
        """The step's one forward. The LM head runs on the rows sampled by vLLM's sampler,
        then the rows sampled in MLX, then the prompt rows whose logprobs were asked for; the
        MLX rows are sampled in the same evaluation as the forward and the KV writes."""
        states = [self.batch.requests[r] for r in step.req_ids]
        vllm_idx = [i for i in step.sample_req_idx if states[i].uses_vllm_sampler]
        mlx_idx = [i for i in step.sample_req_idx if not states[i].uses_vllm_sampler]
        last_rows = np.cumsum(step.query_lens) - 1
        first_rows = last_rows - step.query_lens + 1
        prompt = self._prompt_logprob_slices(step, states, first_rows)
        rows = np.concatenate([
            last_rows[vllm_idx], last_rows[mlx_idx],
            *[np.arange(p.row, p.row + p.num_logits) for p in prompt],
        ]).astype(np.int32)
        needs_torch = bool(vllm_idx) or any(p.num_logits for p in prompt)

        self._set_step_meta(step.query_lens, step.seq_lens, step.block_table, states)
        self._timer.mark("prepare")
        try:
            if self.compiled_decode is not None and is_pure_decode(self.pool.meta):
                logits = self.compiled_decode(step.input_ids, step.pending_rows, rows)
            else:
                input_ids = feed_pending(mx.array(step.input_ids), step.pending_rows)
                logits = self.forward(input_ids, rows)
            mlx_rows = [self._sampling_row(step.req_ids[i]) for i in mlx_idx]
            tokens = None
            if mlx_rows:
                start = len(vllm_idx)
                tokens = sample(logits[start:start + len(mlx_idx)], mlx_rows)
            if needs_torch and logits.dtype != mx.float32:
                logits = logits.astype(mx.float32)
            self._timer.mark("graph")
            # Async scheduling queues the step and returns; a step whose logits go to torch
            # (vLLM's sampler, prompt logprobs) is waited for here.
            lazy = self.async_scheduling and not needs_torch
            (mx.async_eval if lazy else mx.eval)(
                *([logits] if needs_torch else []), *([tokens] if tokens is not None else []),
                self._cache_arrays(),
            )
        finally:
            self._clear_step_meta()
        self._timer.mark("eval")
        self.stats.forwards += 1
        self.stats.tokens += int(step.input_ids.size)
        by_reqs = self.stats.forwards_by_num_reqs
        by_reqs[len(step.req_ids)] = by_reqs.get(len(step.req_ids), 0) + 1
        if lazy and tokens is not None:
            for j, i in enumerate(mlx_idx):  # the next step feeds these on the device
                states[i].pending = (tokens, j)
        return _PendingStep(
            step=step, out=out, states=states, vllm_idx=vllm_idx, mlx_idx=mlx_idx,
            prompt=prompt, logits=logits if needs_torch else None,
            mlx_tokens=tokens.tolist() if tokens is not None and not lazy else [],
            lazy=lazy, lazy_tokens=tokens if lazy else None, timer=self._timer,
        )

    def _set_step_meta(self, query_lens, seq_lens, block_table: np.ndarray,
                       states: list[RequestState] | None) -> AttentionMetadata:
        """The step's attention metadata, on kernel blocks (the block table expanded by
        ``block_size / kernel_block_size``), and a hybrid model's state slots (slot 0 for
        dummy sequences when ``states`` is None)."""
        table, size = block_table, self.block_size
        if self.kernel_block_size is not None and self.kernel_block_size != size:
            table = expand_block_table(table, size // self.kernel_block_size)
            size = self.kernel_block_size
        meta = build_attention_metadata(list(query_lens), list(seq_lens), table, size)
        self.pool.meta = meta
        store = self.state_store
        if store is not None:
            store.attn_meta = meta
            store.meta = build_state_metadata(
                query_lens, seq_lens, self.layers.step_slots(store, states, len(query_lens))
            )
        return meta

    def _clear_step_meta(self) -> None:
        self.pool.meta = None
        if self.state_store is not None:
            self.state_store.meta = self.state_store.attn_meta = None

    def _cache_arrays(self) -> list[mx.array]:
        """Pool and state arrays, evaluated with the step (their writes happen then)."""
        store = self.state_store
        return self.pool.arrays() + (store.arrays() if store is not None else [])

    def _prompt_logprob_slices(
        self, step: StepBatch, states: list[RequestState], first_rows: np.ndarray
    ) -> list[_PromptSlice]:
        """Which rows of this step give prompt logprobs, with the chunking rules of vLLM's GPU
        runner (``_get_prompt_logprobs_dict``): the row of prompt position ``p`` scores token
        ``p + 1``; the tensors are handed over when the last prompt row has been scored, or,
        if a chunk ends exactly there, with the next step's sampled token."""
        slices = []
        for i, state in enumerate(states):
            if state.num_prompt_logprobs is None:
                continue
            start = int(step.seq_lens[i] - step.query_lens[i])  # num_computed_tokens
            num_tokens = int(step.query_lens[i])
            remaining = state.num_prompt_tokens - (start + 1)
            complete = num_tokens > remaining
            num_logits = max(remaining, 0) if complete else num_tokens
            slices.append(_PromptSlice(i, int(first_rows[i]), num_logits, start, complete))
        return slices

    def _sample(self, pending: _PendingStep, grammar_output: GrammarOutput | None):
        step, states = pending.step, pending.states
        if pending.lazy_tokens is not None:  # waits for the queued step
            pending.mlx_tokens = pending.lazy_tokens.tolist()
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        for i, token in zip(pending.mlx_idx, pending.mlx_tokens, strict=True):
            sampled[i] = [token]
        logits = (
            mlx_to_torch(pending.logits, self.zero_copy_logits)
            if pending.logits is not None else None
        )
        prompt_logprobs = self._prompt_logprobs(pending, logits)
        logprobs = None
        if pending.vllm_idx:
            n = len(pending.vllm_idx)
            rows = logits[:n]
            req_ids = [step.req_ids[i] for i in pending.vllm_idx]
            if grammar_output is not None:
                apply_grammar_bitmask(pending.out, grammar_output, req_ids, rows)
            result = self.vllm_sampling.sample(rows, [states[i] for i in pending.vllm_idx])
            for i, token in zip(pending.vllm_idx, result.sampled_token_ids[:, 0].tolist(),
                                strict=True):
                sampled[i] = [token]
            if result.logprobs_tensors is not None:
                logprobs = logprobs_lists(
                    result.logprobs_tensors, pending.vllm_idx, len(step.req_ids)
                )
            self.stats.sampled_by_vllm += n
        for i in step.sample_req_idx:
            states[i].append_output(sampled[i][0])
            pend = states[i].pending
            if pend is not None and pend[0] is pending.lazy_tokens:
                states[i].pending = None  # now known on the host
        self.stats.sampled += len(step.sample_req_idx)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            kv_connector_output=pending.kv_output,
        )

    def _prompt_logprobs(self, pending: _PendingStep, logits) -> dict[str, Any]:
        """Fill each asking request's prompt logprobs from this step's prompt rows; return the
        finished ones (``prompt_logprobs_dict``)."""
        done: dict[str, Any] = {}
        row = len(pending.vllm_idx) + len(pending.mlx_idx)
        for p in pending.prompt:
            state = pending.states[p.index]
            num = state.num_prompt_logprobs
            if state.prompt_logprobs is None:
                state.prompt_logprobs = LogprobsTensors.empty_cpu(
                    state.num_prompt_tokens - 1, num + 1
                )
            if p.num_logits > 0:
                target = torch.tensor(
                    state.token_ids[p.start + 1: p.start + 1 + p.num_logits], dtype=torch.int64
                )
                ids, lps, ranks = self.vllm_sampling.prompt_logprobs(
                    logits[row: row + p.num_logits], num, target
                )
                row += p.num_logits
                chunk = slice(p.start, p.start + p.num_logits)
                state.prompt_logprobs.logprob_token_ids[chunk] = ids
                state.prompt_logprobs.logprobs[chunk] = lps
                state.prompt_logprobs.selected_token_ranks[chunk] = ranks
                self.stats.prompt_logprob_rows += p.num_logits
            if p.complete:
                done[state.req_id] = state.prompt_logprobs
                state.prompt_logprobs = None
                state.num_prompt_logprobs = None
        return done

    def forward(self, input_ids: mx.array, rows: np.ndarray) -> mx.array:
        """See :func:`forward`; uses this runner's model and layer caches."""
        return forward(self.model, self.layer_caches, input_ids, rows)

    def stats_dict(self) -> dict:
        """Counters, plus the step-time breakdown in seconds summed over all steps
        (``prepare_s``, ``build_s``: graph building, ``eval_s``, ``finish_s``: output; see
        :mod:`vllm_unified.worker.step_profile`) and the per-kind profile."""
        phases = self.profile.seconds()
        return {**asdict(self.stats), "resumed": self.batch.num_resumed,
                "live_requests": len(self.batch.requests),
                "prepare_s": phases["prepare"], "build_s": phases["graph"],
                "eval_s": phases["eval"], "finish_s": phases["output"],
                "step_profile": self.profile.as_dict()}

    def _sampling_row(self, req_id: str) -> SamplingRow:
        state = self.batch.requests[req_id]
        p: Any = state.sampling_params
        key = None
        if state.rng_key is not None:
            state.rng_key, key = mx.random.split(state.rng_key)
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, key=key
        )

    # ----------------------------------------------------------------------------- memory
    def profile_activations(self, num_tokens: int) -> int:
        """Peak MLX memory (bytes) above what is allocated now, of one prefill forward over
        ``num_tokens`` tokens of a single sequence (the largest attention a step can hold),
        with a temporary pool just big enough for it. Logits of the sampled rows are added by
        the caller; this measures the transformer's activations."""
        blocks = -(-num_tokens // self.block_size) + 1
        spec = self.get_kv_cache_spec()[layer_name(self.layers.attention[0])]
        pool = KVPool.allocate_mlx(len(self.layers.attention), blocks, self.block_size,
                                   spec.num_kv_heads, spec.head_size, self.dtype)
        store = self.layers.temp_store(self.vllm_config, 2)
        caches = self.layers.layer_caches(pool, store)
        table = np.arange(1, blocks, dtype=np.int32)[None]
        pool.meta = build_attention_metadata([num_tokens], [num_tokens], table, self.block_size)
        if store is not None:
            store.attn_meta = pool.meta
            store.meta = build_state_metadata(
                np.array([num_tokens]), np.array([num_tokens]),
                self.layers.step_slots(store, None, 1))
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        ids = mx.zeros((num_tokens,), dtype=mx.int32)
        mx.eval(forward(self.model, caches, ids, np.array([num_tokens - 1], np.int32)),
                pool.arrays(), store.arrays() if store is not None else [])
        peak = mx.get_peak_memory() - base
        del pool, caches, store
        mx.clear_cache()
        return max(int(peak), 0)

    # ----------------------------------------------------------------------------- warm-up
    def warm_up(self) -> float:
        """Run a dummy prefill and decode through the real path (block 0 is vLLM's null block,
        never handed to requests, so writing it is harmless). Returns seconds taken."""
        start = time.perf_counter()
        n = min(self.block_size, self.model_config.max_model_len)
        self._set_step_meta([n], [n], np.zeros((1, 1), dtype=np.int32), None)
        try:
            logits = self.forward(mx.zeros((n,), dtype=mx.int32), np.array([n - 1], np.int32))
            mx.eval(logits, self._cache_arrays())
        finally:
            self._clear_step_meta()
        return time.perf_counter() - start


def forward(
    model: nn.Module, layer_caches: list[PagedLayerCache], input_ids: mx.array,
    rows: np.ndarray,
) -> mx.array:
    """One token-major forward of an mlx-lm model over the paged cache (lazy).

    Args:
        model: mlx-lm model with paged attention installed.
        layer_caches: one :class:`PagedLayerCache` per layer; their pool's ``meta`` must hold the
            step's attention metadata.
        input_ids: ``[T]`` int32 token ids, one row per scheduled token.
        rows: ``[R]`` int32 rows whose logits are needed (numpy, or an MLX array): the rows
            that sample, plus prompt rows only for requests that asked for prompt logprobs.

    Returns:
        ``[R, V]`` logits in the model dtype (the LM head runs on those rows only).
    """
    hidden = model.model(input_ids[:, None], cache=layer_caches)  # [T, 1, D]
    if rows.size:
        hidden = hidden[rows if isinstance(rows, mx.array) else mx.array(rows), 0, :]
    else:
        hidden = hidden[:0, 0, :]
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
