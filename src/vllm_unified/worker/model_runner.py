"""The model runner: one MLX forward per scheduler step, over all scheduled requests.

vLLM's names, as in ``vllm/v1/worker/gpu_model_runner.py``: :meth:`MLXModelRunner.execute_model`
takes the ``scheduler_output``; ``_update_states`` folds it into the persistent
:class:`~vllm_unified.worker.input_batch.InputBatch` (``requests``); ``_prepare_inputs`` lays
every scheduled token (decode tokens and prefill chunks of all requests) out as one row of a
token-major batch and builds the step's context (:class:`~vllm_unified.kv.forward_context.
StepContext`, through the KV cache, :mod:`vllm_unified.kv.cache`); ``_model_forward`` runs the
mlx-lm model once over it under that context, the LM head only on the rows that sample (plus
prompt rows of requests asking for prompt logprobs), and the MLX sampler
(:mod:`vllm_unified.worker.sampler`) in the same evaluation; requests using more than it
implements are sampled by vLLM's own sampler on a torch view of the logits
(:mod:`vllm_unified.worker.vllm_sampling`). A step with structured-output requests returns None
from ``execute_model`` and samples in ``sample_tokens`` with vLLM's grammar bitmask. A pooling
model (``--runner pooling``) runs the same forward and hands the final hidden states to vLLM's
pooler instead of the LM head (:mod:`vllm_unified.worker.pooling`).

Backend-dependent choices (pool memory, write path, kernels, logits transfer, quantized
layers) come from the worker's :class:`~vllm_unified.backend.BackendProfile`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch

from vllm_unified import envs
from vllm_unified.backend import BackendProfile
from vllm_unified.bridge import mlx_dtype
from vllm_unified.compat import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    GrammarOutput,
    IntermediateTensors,
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
from vllm_unified.distributed.pipeline import HIDDEN, PipelineStage
from vllm_unified.envs import COMPILE_DECODE_ENV
from vllm_unified.kv import page_release
from vllm_unified.kv.attention.dispatch import chunk_routing, gpu_attention_routed
from vllm_unified.kv.block_reuse import prefix_cache_retain_tokens
from vllm_unified.kv.cache import AttentionShape, KVCache, layer_name
from vllm_unified.kv.forward_context import StepContext, set_step_context
from vllm_unified.kv.hybrid import HybridLayers
from vllm_unified.kv.page_release import PageRelease, placements
from vllm_unified.memory.mlx_log import MemoryLog
from vllm_unified.models.capability import (
    UnsupportedModel,
    probed_state_layout,
    route_model,
)
from vllm_unified.models.cpu_kernels import install_cpu_kernels, keep_quantized_on_cpu
from vllm_unified.models.decode_attention import install_fused_decode_attention
from vllm_unified.models.fused_projections import fuse_projections
from vllm_unified.models.gguf_dir import gguf_in_dir
from vllm_unified.models.gpu_gemm import install_gpu_gemm
from vllm_unified.models.loader import LoadedModel, check_dtype_supported, load_model
from vllm_unified.models.lora import install_lora_layers, lora_targets
from vllm_unified.models.parameters import parameter_summary
from vllm_unified.models.registration import MLX_LM_HYBRID_ARCHITECTURES, record_state_layout
from vllm_unified.offload.runner import KVConnectorHooks
from vllm_unified.worker.async_output import MLXAsyncOutput, feed_pending
from vllm_unified.worker.compiled_decode import CompiledDecode
from vllm_unified.worker.draft_model import DraftModel, split_kv_cache_config
from vllm_unified.worker.encode_thread import EncodeThread
from vllm_unified.worker.forward import forward, forward_hidden
from vllm_unified.worker.input_batch import InputBatch, RequestState, StepBatch, split_groups
from vllm_unified.worker.lora import LoRAAdapters
from vllm_unified.worker.pooling import Pooling
from vllm_unified.worker.sampler import SamplingRow, sample
from vllm_unified.worker.spec_decode import SpecDecoder, logprobs_for_requests
from vllm_unified.worker.step_profile import StepProfile, StepTimer
from vllm_unified.worker.vllm_sampling import (
    VllmSampling,
    apply_grammar_bitmask,
    logprobs_lists,
    mlx_to_torch,
    needs_vllm_sampler,
)

logger = init_logger(__name__)

__all__ = ["MLXModelRunner", "RunnerStats", "layer_name"]


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
    #: steps laid out and built while the encode thread still encoded the previous one
    built_alongside: int = 0
    #: pooling requests whose output was handed to vLLM (``--runner pooling``)
    pooled: int = 0


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
class _StepInputs:
    """What ``_prepare_inputs`` gives ``_model_forward``: the step's token layout, its
    context, and which rows the LM head and the samplers take."""

    step: StepBatch
    ctx: StepContext
    states: list[RequestState]
    #: indices into ``step.req_ids`` sampled by vLLM's sampler (logits rows 0..) and in MLX
    vllm_idx: list[int]
    mlx_idx: list[int]
    prompt: list[_PromptSlice]
    #: int32 token rows whose logits are computed: vLLM-sampled, MLX-sampled, prompt rows
    logit_rows: np.ndarray
    #: logits rows of the vLLM-sampled requests (one each, ``d + 1`` with ``d`` drafts)
    num_vllm_rows: int
    #: the logits go to torch (vLLM's sampler or prompt logprobs)
    needs_torch: bool


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
    #: logits rows of the vLLM-sampled requests (one each, ``d + 1`` with ``d`` drafts)
    num_vllm_rows: int
    #: evaluated float32 logits ``[rows, V]`` when torch needs them, else None
    logits: mx.array | None
    mlx_tokens: list[int]
    #: the step's KVConnectorOutput (KV offloading), None without a connector
    kv_output: Any = None
    #: asynchronous scheduling: the step was queued (``mx.async_eval``), not waited for; its
    #: MLX-sampled tokens are ``lazy_tokens`` (read back by ``_sample``), None if it has none
    lazy: bool = False
    lazy_tokens: mx.array | None = None
    #: the encode thread's job for a lazy step, and the copy of ``lazy_tokens`` it evaluates
    #: for the host to read back (:meth:`EncodeThread.read_back`)
    lazy_job: Future | None = None
    read_back: mx.array | None = None
    timer: StepTimer | None = None
    #: every request had one query token (``AttentionMetadata.is_pure_decode``)
    pure_decode: bool = False
    #: ``time.perf_counter()`` at the step's ``execute_model`` start
    started: float = 0.0
    #: ``RunnerStats.forwards`` once this step's forward was queued
    forward_index: int = 0


class MLXModelRunner:
    """Executes scheduler steps on an mlx-lm model with a paged KV cache.

    Args:
        vllm_config: vLLM's config.
        backend: the worker's backend profile (:func:`vllm_unified.backend.profile`).
    """

    #: forwards whose MLX graph has finished (the later ones may still read the pool)
    forwards_done: int = 0
    #: drops the pages of blocks the scheduler no longer caches (None: never)
    page_release: PageRelease | None = None

    def __init__(self, vllm_config: VllmConfig, backend: BackendProfile) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.backend = backend
        self.dtype: mx.Dtype = mlx_dtype(self.model_config.dtype)
        self.loaded: LoadedModel | None = None
        self.model: nn.Module | None = None
        self.layers: HybridLayers | None = None
        #: the KV cache (made when the model is loaded, allocated by initialize_kv_cache)
        self.kv_cache: KVCache | None = None
        self.compiled_decode: CompiledDecode | None = None
        self.input_batch = InputBatch()
        self.stats = RunnerStats()
        self.step_profile = StepProfile()
        #: MLX's memory counters in the log every VLLM_UNIFIED_MEMORY_LOG steps
        self.memory_log = MemoryLog()
        #: the timer of the step being prepared (each queued step keeps its own)
        self._timer: StepTimer = self.step_profile.start()
        self.vocab_size: int = self.model_config.get_vocab_size()
        self.vllm_sampling = VllmSampling(vllm_config)
        #: speculative decoding (vLLM's proposer and rejection sampler), None without it
        self.spec: SpecDecoder | None = None
        #: the draft model of method ``draft_model`` (its own KV cache), else None
        self.draft: DraftModel | None = None
        if vllm_config.speculative_config is not None:
            if vllm_config.speculative_config.method == "draft_model":
                self.draft = DraftModel(vllm_config, backend)
            self.spec = SpecDecoder(vllm_config, self.vllm_sampling.sampler, self.draft)
            logger.info("vllm-unified: speculative decoding, %s; requests with drafts are "
                        "sampled by vLLM's rejection sampler", self.spec.describe())
        if self.vllm_sampling.custom_logitsprocs:
            logger.info(
                "vllm-unified: custom logits processors %s: every request is sampled by "
                "vLLM's sampler", self.vllm_sampling.custom_logitsprocs,
            )
        #: vLLM's async scheduling (see worker/async_output.py): steps are queued, not awaited
        self.async_scheduling: bool = bool(vllm_config.scheduler_config.async_scheduling)
        #: pure-decode steps are built while the encode thread encodes the previous step
        #: (``VLLM_UNIFIED_BUILD_ALONGSIDE``; :meth:`_builds_alongside_queued_step`)
        self.build_alongside = bool(envs.BUILD_ALONGSIDE)
        #: evaluates queued steps off the engine's thread (None: in it)
        self.encoder = (EncodeThread() if self.async_scheduling and backend.encode_thread
                        else None)
        #: queued steps whose outputs vLLM has not collected yet, oldest first
        self._unresolved: list[MLXAsyncOutput] = []
        self._pending: _PendingStep | None = None
        self.kv_connector = KVConnectorHooks(vllm_config)
        #: the pipeline stage this worker runs (set when the model loads)
        self.stage: PipelineStage | None = None
        #: start time of the previous step if it was pure decode (for RunnerStats.decode_*)
        self._decode_started: float | None = None
        #: a pooling model's pooler (``--runner pooling``; made when the model is loaded),
        #: None for generation
        self.pooling: Pooling | None = None
        #: the LoRA adapters (``--enable-lora``; made when the model is loaded), else None
        self.lora: LoRAAdapters | None = None

    @property
    def requests(self) -> dict[str, RequestState]:
        """The live requests by id (vLLM's ``requests``)."""
        return self.input_batch.requests

    @property
    def pool(self):
        """The KV pool (:class:`vllm_unified.kv.pool.KVPool`), once allocated."""
        return self.kv_cache.pool if self.kv_cache is not None else None

    # ----------------------------------------------------------------------------- model
    def load_model(self) -> None:
        """Load weights with the project's loader and route attention to the paged cache."""
        start = time.perf_counter()
        hf_config = self.model_config.hf_config.to_dict()
        path = self.model_config.model
        native = not self.backend.keep_quantized and keep_quantized_on_cpu(self.dtype)
        pc = self.vllm_config.parallel_config
        self.stage = PipelineStage.of_this_worker(
            self.model_config.get_total_num_hidden_layers(), pc.pipeline_parallel_size)
        self.loaded = load_model(
            _checkpoint_path(path), hf_config=hf_config, dtype=self.dtype,
            keep_quantized=self.backend.keep_quantized or native, native_kernels=native,
            stage=self.stage, max_model_len=self.model_config.max_model_len,
            pooling=self.model_config.runner_type == "pooling",
        )
        self.model = self.loaded.model
        check_dtype_supported(self.model, self.dtype, self.backend.kind)
        if self.model_config.runner_type == "pooling":
            self.pooling = Pooling(self.vllm_config, self.loaded)
            logger.info("vllm-unified: %s", self.pooling.describe())
        model_type = self.loaded.config["model_type"]
        head_size = self.model_config.get_head_size()
        cpu_kernels = install_cpu_kernels(self.model)
        if self.vllm_config.lora_config is not None:
            self.lora = self._lora_adapters()
        # on the CPU only one-row inputs: wider ones would leave strided column views that
        # the native kernels copy before reading. Not with adapters: each projection adds
        # its own update. (The GPU decode GEMM takes exact MLX linears: adapted ones stay.)
        fused = (fuse_projections(self.model, max_rows=1 if self.backend.cpu_kernels else None)
                 if self.backend.fuse_projections and self.lora is None else {})
        gemm = install_gpu_gemm(self.model) if self.backend.gpu_gemm else 0
        fused_qk = (install_fused_decode_attention(self.model, head_size)
                    if self.backend.fused_qk else 0)
        # checked as it will run: the probe's forward goes through the layers installed above
        probe_start = time.perf_counter()
        self.layout, patched = route_model(
            self.model, self.loaded.config,
            kv_shape=(self.model_config.get_num_kv_heads(pc), head_size),
            config_window=self.model_config.get_sliding_window(),
            probe=self.stage.size == 1)
        probe_s = time.perf_counter() - probe_start
        arch = self.model_config.architecture
        states = (probed_state_layout(self.layout) if arch in MLX_LM_HYBRID_ARCHITECTURES
                  else None)
        if states is not None:  # what vLLM sizes the state pages of an mlx-lm-only hybrid by
            record_state_layout(arch, *states)
        num_layers = self.layout.num_slots
        if self.stage.size > 1 and num_layers != self.stage.num_layers:
            raise ValueError(f"mlx-lm built {num_layers} cache slots but vLLM's config has "
                             f"{self.stage.num_layers} layers")
        if self.layout.shared and self.stage.size > 1:
            raise ValueError("pipeline parallelism with layers that share KV is not "
                             "supported by vllm-unified")
        self.layers = HybridLayers(model_type, num_layers, self.layout.recurrent,
                                   held=self.stage.layers if self.stage.size > 1 else None,
                                   attention=list(self.layout.attention))
        cache_config = self.vllm_config.cache_config
        if self.layout.latent is not None:  # MLA: vLLM's MLA pages, whatever vLLM's model does
            shape = AttentionShape.latent(*self.layout.latent, self.model_config.dtype,
                                          cache_config.cache_dtype or "auto")
        else:
            shape = AttentionShape(self.model_config.get_num_kv_heads(pc),
                                   head_size, self.model_config.dtype,
                                   cache_config.cache_dtype or "auto",
                                   tuple(cache_config.kv_cache_dtype_skip_layers or ()))
        windows = {i: self.layout.attention[i].window for i in self.layers.attention}
        kv_shapes = {i: (a.num_kv_heads, a.head_dim) for i, a in self.layout.attention.items()
                     if a.num_kv_heads is not None and i in windows}
        chunks = {i: self.layout.attention[i].chunk for i in self.layers.attention}
        self.kv_cache = KVCache(self.backend, self.layers, shape, windows, self.dtype,
                                kv_shapes=kv_shapes, shared=self.layout.shared, chunks=chunks,
                                cache_lists=self.layout.cache_lists)
        if any(chunks.values()):
            logger.info("vllm-unified: %s (layers %s)", chunk_routing(self.backend),
                        [i for i, c in chunks.items() if c])
        if self.draft is not None:
            self.draft.load(_checkpoint_path(self.draft.model_config.model),
                            keep_quantized=self.backend.keep_quantized or native)
        logger.info(
            "vllm-unified: loaded %s (%s, %d layers, dtype %s, quantized=%s) in %.2f s; "
            "paged attention routed in %s (layers checked in %.2f s%s); native CPU kernels: %s; "
            "fused projections: %s; "
            "decode-sized matmuls by the GPU kernel: %d layers; decode q/k norms and RoPE "
            "in the attention kernels: %d layers",
            path, self.loaded.source, num_layers, self.dtype, self.loaded.quantized,
            time.perf_counter() - start, ", ".join(patched) or "(already routed)", probe_s,
            "".join(f"; {n}" for n in self.layout.notes),
            ", ".join(cpu_kernels) or "(none)",
            ", ".join(f"{n} {name}" for name, n in fused.items()) or "(none)", gemm, fused_qk,
        )
        # as held after the kernels' installation (which may re-lay or dequantize layers)
        logger.info("vllm-unified: %s", parameter_summary(self.model, self.loaded.config)
                    .describe())
        if self.stage.size > 1:
            logger.info("vllm-unified: %s", self.stage.describe())

    def _lora_adapters(self) -> LoRAAdapters:
        """Give the model's adaptable linears the per-step adapter update (after the native
        kernels are installed: the update wraps what will run)."""
        targets = lora_targets(self.model)
        if not targets:
            raise ValueError(f"--enable-lora: {self.model_config.architecture} has no linear "
                             f"layer vllm-unified adapts")
        install_lora_layers(self.model, targets)
        hf = self.model_config.hf_text_config
        adapters = LoRAAdapters(self.vllm_config.lora_config, targets, self.dtype,
                                getattr(hf, "max_position_embeddings", None))
        logger.info("vllm-unified: %s", adapters.describe())
        return adapters

    @property
    def block_size(self) -> int:
        """vLLM's attention block size: the KV cache's once it is allocated, before that the
        cache config's (final once the platform's ``update_block_size_for_backend`` has run,
        after the model loaded)."""
        allocated = self.kv_cache.block_size if self.kv_cache is not None else None
        return allocated or self.vllm_config.cache_config.block_size

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """vLLM's per-layer KV cache specs (:meth:`KVCache.kv_cache_spec`), with the draft
        model's layers (``draft_model.`` names) as vLLM's GPU runner reports them."""
        specs = self.kv_cache.kv_cache_spec(self.block_size, self.vllm_config)
        if self.draft is not None:
            specs.update(self.draft.kv_cache_spec(self.block_size))
        return specs

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all attention layers (:meth:`KVCache.
        bytes_per_block`)."""
        draft = 0
        if self.draft is not None:
            draft = self.draft.kv_cache.bytes_per_block(self.block_size, self.vllm_config)
        return self.kv_cache.bytes_per_block(self.block_size, self.vllm_config) + draft

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache for ``kv_cache_config`` (:meth:`KVCache.initialize`), then
        the compiled decode step and the KV connector where they apply.

        Raises:
            ValueError: as :meth:`KVCache.initialize`, or KV offloading with kernel blocks
                smaller than vLLM's blocks.
        """
        layout = self.vllm_config.cache_config.kv_cache_layout
        if self.draft is not None:
            kv_cache_config, draft_config = split_kv_cache_config(kv_cache_config,
                                                                  self.draft.layer_names())
            self.draft.initialize(draft_config, layout)
        self.kv_cache.initialize(kv_cache_config, layout)
        self.input_batch.attn_group = self.kv_cache.attn_group
        self.compiled_decode = self._compiled_decode()
        if self.kv_connector.enabled:
            self.kv_connector.register(kv_cache_config, self.kv_cache.connector_views(),
                                       lambda: mx.eval(self.kv_cache.arrays()))
        self.page_release = self._page_release(kv_cache_config)

    def _page_release(self, kv_cache_config: KVCacheConfig) -> PageRelease | None:
        """The pool's page release (:mod:`vllm_unified.kv.page_release`), registered for the
        scheduler of this process, where it applies: a pool that is a mapping of ours, one
        pipeline stage, no KV connector (its transfers read blocks on their own schedule), no
        draft model (its pages are another buffer's), vLLM's prefix-cache bound in force."""
        buffer = self.kv_cache.pool.backing_buffer
        if (buffer is None or self.kv_connector.enabled or self.draft is not None
                or self.stage.size > 1
                or prefix_cache_retain_tokens(self.model_config.max_model_len) is None):
            page_release.register(None)
            return None
        release = PageRelease(buffer.data_ptr(), buffer.numel(), placements(kv_cache_config),
                              lambda: self.stats.forwards, lambda: self.forwards_done)
        page_release.register(release)
        return release

    def _compiled_decode(self) -> CompiledDecode | None:
        """The compiled pure-decode forward where it applies: the in-place CUDA KV write and
        the paged GPU attention kernel for every layer's head size, or on MLX's CPU backend
        the native KV write and attention kernel (pools other than TurboQuant's, whose fresh
        rows are laid out on the host); no recurrent or latent layers, one pipeline stage,
        not turned off by its variable."""
        pool = self.kv_cache.pool
        head_dims = {d for _, d in self.kv_cache.kv_shapes.values()}
        gpu = pool.cuda_write and all(gpu_attention_routed(d, self.backend) for d in head_dims)
        cpu = (self.backend.cpu_attention and pool.write_path == "native_rows"
               and not pool.fmt.turboquant)
        if not ((gpu or cpu) and not self.layers.is_hybrid and self.backend.compile_decode
                and self.stage.size == 1 and not self.kv_cache.latent_layers()):
            return None
        logger.info("vllm-unified: pure-decode steps run as one compiled MLX graph "
                    "(mx.compile, one trace per batch size; %s=0 turns it off)",
                    COMPILE_DECODE_ENV)
        return CompiledDecode(self.model, pool, self.kv_cache.layer_caches,
                              forward, self.kv_cache.kernel_block_size)

    # ----------------------------------------------------------------------------- steps
    def _new_request(self, new: NewRequestData) -> RequestState:
        if new.prompt_token_ids is None:
            raise ValueError(f"request {new.req_id}: prompt embeddings are not supported")
        if self.pooling is not None:
            attn_blocks, other_blocks = split_groups(new.block_ids, self.input_batch.attn_group)
            return RequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids), block_ids=attn_blocks,
                other_block_ids=other_blocks, num_computed_tokens=new.num_computed_tokens,
                sampling_params=None, pooling_params=new.pooling_params,
                pooling_states=self.pooling.new_request(new.pooling_params),
                lora_request=new.lora_request,
            )
        params = new.sampling_params
        mlx_capable = not (needs_vllm_sampler(params)
                           or self.vllm_sampling.custom_logitsprocs)
        uses_vllm = not mlx_capable or self.spec is not None
        key = generator = None
        if params.sampling_type == SamplingType.RANDOM_SEED:
            if uses_vllm:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(params.seed)
            else:
                # MLX keys take an unsigned 64-bit seed, vLLM's are signed (any int64; a
                # negative one raised TypeError here and killed the engine): the same 64 bits.
                key = mx.random.key(params.seed % 2**64)
        num_prompt_logprobs = None
        if params.prompt_logprobs is not None:
            num_prompt_logprobs = (
                self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            )
        attn_blocks, other_blocks = split_groups(new.block_ids, self.input_batch.attn_group)
        return RequestState(
            req_id=new.req_id, token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids), block_ids=attn_blocks,
            other_block_ids=other_blocks,
            num_computed_tokens=new.num_computed_tokens, sampling_params=params, rng_key=key,
            uses_vllm_sampler=uses_vllm, generator=generator,
            mlx_when_undrafted=(self.spec is not None and mlx_capable
                                and params.sampling_type != SamplingType.RANDOM_SEED),
            num_prompt_logprobs=num_prompt_logprobs, lora_request=new.lora_request,
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, hidden_in: mx.array | None = None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run one scheduler step: update request states, one forward, sample.

        Args:
            hidden_in: with pipeline parallelism, on every stage but the first: the previous
                stage's ``[T, D]`` hidden states of this step.

        Returns:
            ``ModelRunnerOutput`` with one entry per scheduled request (``[]`` for a request
            whose prefill chunk does not reach the end of its prompt); None when the step has
            structured-output requests, async scheduling is on or this is the last of several
            pipeline stages (vLLM's batch queue): vLLM's engine then computes the grammar
            bitmask and calls :meth:`sample_tokens`, which samples from this step's logits.
            On a pipeline stage before the last: ``IntermediateTensors`` with the step's
            hidden states for the next stage (a torch view of the evaluated MLX array). A
            pooling model: ``ModelRunnerOutput`` with ``pooler_output`` (:meth:`_pool_step`),
            always synchronously.

        Raises:
            RuntimeError: called before the previous step's ``sample_tokens``; speculative
                decoding tokens without ``--speculative-config``; KV block copies in the step
                (not supported).
        """
        started = time.perf_counter()
        if not self._builds_alongside_queued_step(scheduler_output):
            self.quiesce()
        elif self.encoder.busy:
            self.stats.built_alongside += 1
        if self.page_release is not None:
            self.page_release.flush()
        previous_decode, self._decode_started = self._decode_started, None
        if self._pending is not None:
            raise RuntimeError("execute_model called before sample_tokens of the previous step")
        if scheduler_output.scheduled_spec_decode_tokens and self.spec is None:
            raise RuntimeError("speculative decoding tokens in a step without a "
                               "speculative config")
        if scheduler_output.kv_cache_block_copies:
            raise RuntimeError("KV block copies requested: not supported by vllm-unified")
        self._timer = self.step_profile.start()
        if self.spec is not None:
            self.spec.step_started(scheduler_output, started)
        self._update_states(scheduler_output)
        self.stats.steps += 1
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            return self.kv_connector.empty_step(scheduler_output)

        if self.pooling is not None:
            with self.kv_connector.step(scheduler_output) as kv_output:
                output = self._pool_step(scheduler_output)
            output.kv_connector_output = kv_output
            return output
        inputs = self._prepare_inputs(scheduler_output)
        if not self.stage.is_last:
            return self._forward_to_next_stage(inputs, hidden_in)
        with self.kv_connector.step(scheduler_output) as kv_output:
            pending = self._model_forward(inputs, scheduler_output, hidden_in)
        pending.kv_output = kv_output
        pending.started = started
        if inputs.ctx.attn.is_pure_decode:
            self._decode_started = started
            if previous_decode is not None:  # two decode steps in a row: one whole period
                self.stats.decode_steps += 1
                self.stats.decode_period_s += started - previous_decode
        if (scheduler_output.has_structured_output_requests or self.async_scheduling
                or self.stage.size > 1):
            self._pending = pending
            return None
        return self._finish_step(pending, self._sample(pending, None))

    def _builds_alongside_queued_step(self, so: SchedulerOutput) -> bool:
        """Whether this step is laid out and its graph built while the encode thread still
        encodes the previous step (the job is waited for when this one is queued,
        :meth:`EncodeThread.submit`): a pure-decode step (every scheduled request one token,
        none new, resumed, drafted or structured) that runs the compiled graph, with nothing
        that reads or writes the pool before the forward (no blocks to zero, no KV connector,
        no page release), one pipeline stage and no draft model. Such a step only makes MLX
        arrays and calls the compiled graph, which reads the queued step's outputs' shapes and
        dtypes alone and hands back new pool arrays instead of assigning into the old ones
        (the plain forward's writes do: ``pages[idx] = rows`` rebinds an array the queued job
        may not have evaluated yet) (:mod:`vllm_unified.worker.encode_thread`, "Building
        alongside a job")."""
        return (self.encoder is not None and self.build_alongside
                and self.compiled_decode is not None and self.spec is None
                and self.draft is None
                and self.page_release is None and not self.kv_connector.enabled
                and self.stage.size == 1 and so.total_num_scheduled_tokens > 0
                and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
                and not so.scheduled_new_reqs and not so.scheduled_cached_reqs.resumed_req_ids
                and not so.new_block_ids_to_zero and not so.scheduled_spec_decode_tokens
                and not so.has_structured_output_requests and not so.preempted_req_ids)

    def _waits_for_previous_step(self, pure_decode: bool) -> bool:
        """Whether this step waits for the device before it is built: with asynchronous
        scheduling on Metal, where pages are written in place by kernels that output only a
        token (:func:`vllm_unified.kv.gpu.write.ordered_after`) and Metal orders work across
        evaluations only by fences on encoder outputs, a step may read pages a still-running
        step wrote without any data path from that write: a step with prefill chunks (its
        token ids known on the host), or any step of a hybrid model (a recurrent layer's
        state write is not on the path to the sampled tokens). A pure-decode step of an
        attention-only model reads the previous step's sampled tokens, which depend on every
        layer's attention, which takes that layer's write token: it need not wait. CUDA runs
        every evaluation on one stream, in order."""
        return (self.async_scheduling and self.kv_cache is not None
                and self.kv_cache.pool.write_path == "metal_kernel"
                and (not pure_decode or self.kv_cache.store is not None))

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Fold the step's request changes into the persistent batch (new, resumed, finished
        requests; new blocks), hand preempted requests to the KV connector, and zero the
        blocks vLLM asks to zero."""
        self.kv_connector.handle_preemptions(scheduler_output)
        self.input_batch.update(scheduler_output, self._new_request)
        if self.spec is not None and scheduler_output.finished_req_ids:
            self.spec.forget(scheduler_output.finished_req_ids)
        if scheduler_output.new_block_ids_to_zero:
            self.kv_cache.zero_blocks(list(scheduler_output.new_block_ids_to_zero))

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> _StepInputs:
        """The step's token layout, its step context, and the rows the LM head runs on: the
        rows sampled by vLLM's sampler, then the rows sampled in MLX, then the prompt rows
        whose logprobs were asked for."""
        step = self.input_batch.layout(scheduler_output)
        states = [self.requests[r] for r in step.req_ids]
        drafts = step.num_draft_tokens
        # With speculative decoding a request without drafts this step is sampled in MLX
        # when it can be (RequestState.mlx_when_undrafted): no logits to torch for it, no
        # rejection sampler (when the draft budget withholds every draft, the step samples
        # as it would without speculation).
        by_vllm = [states[i].uses_vllm_sampler
                   and not (drafts[i] == 0 and states[i].mlx_when_undrafted)
                   for i in range(len(states))]
        vllm_idx = [i for i in step.sample_req_idx if by_vllm[i]]
        mlx_idx = [i for i in step.sample_req_idx if not by_vllm[i]]
        last_rows = np.cumsum(step.query_lens) - 1
        first_rows = last_rows - step.query_lens + 1
        prompt = self._prompt_logprob_slices(step, states, first_rows)
        # A request with d drafts verifies on its last d + 1 rows (vLLM's logits_indices).
        vllm_rows = [np.arange(last_rows[i] - drafts[i], last_rows[i] + 1) for i in vllm_idx]
        rows = np.concatenate([
            *vllm_rows, last_rows[mlx_idx],
            *[np.arange(p.row, p.row + p.num_logits) for p in prompt],
        ]).astype(np.int32)
        ctx = self.kv_cache.step_context(step.query_lens, step.seq_lens, step.block_table,
                                         states)
        if self.lora is not None:
            ctx.lora = self.lora.step(states, step.query_lens)
        return _StepInputs(
            step=step, ctx=ctx, states=states, vllm_idx=vllm_idx, mlx_idx=mlx_idx,
            prompt=prompt, logit_rows=rows, num_vllm_rows=sum(len(r) for r in vllm_rows),
            needs_torch=bool(vllm_idx) or any(p.num_logits for p in prompt),
        )

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
        self._log_step(pending.timer, pending.step, pending.pure_decode)
        return output

    def _log_step(self, timer: StepTimer, step: StepBatch, pure_decode: bool) -> None:
        """Close the step's timer; log the step profile and MLX memory when they are due."""
        timer.mark("output")
        line = self.step_profile.finish(timer, len(step.req_ids), int(step.input_ids.size),
                                        pure_decode)
        if line is not None:
            logger.info(line)
        line = self.memory_log.step(mx)
        if line is not None:
            logger.info(line)

    def _pool_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A pooling model's step: one forward over every scheduled token (KV writes
        included, so prefix caching and chunked prefill work as for generation), evaluated,
        then vLLM's pooler on a torch view of the final hidden states. A request whose prompt
        is not done yet (a chunk before its last) gets None in ``pooler_output``."""
        step = self.input_batch.layout(scheduler_output)
        states = [self.requests[r] for r in step.req_ids]
        ctx = self.kv_cache.step_context(step.query_lens, step.seq_lens, step.block_table,
                                         states)
        if self.lora is not None:
            ctx.lora = self.lora.step(states, step.query_lens)
        self._timer.mark("prepare")
        with set_step_context(ctx):
            hidden = forward_hidden(self.model, self.kv_cache.layer_caches,
                                    mx.array(step.input_ids), None)
        self._timer.mark("graph")
        mx.eval(hidden, self.kv_cache.arrays())
        self._timer.mark("eval")
        self._count_forward(step, evaluated=True)
        pooled = self.pooling.pool(mlx_to_torch(hidden, self.backend.logits_zero_copy),
                                   states, step.query_lens, step.seq_lens)
        self.stats.pooled += sum(out is not None for out in pooled)
        self._log_step(self._timer, step, False)
        return ModelRunnerOutput(
            req_ids=step.req_ids, req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            pooler_output=pooled,
        )

    def _count_forward(self, step: StepBatch, evaluated: bool) -> None:
        """Count one forward of ``step`` in :attr:`stats` (and in ``forwards_done`` when it
        was evaluated, not queued)."""
        self.stats.forwards += 1
        if evaluated:
            self.forwards_done = self.stats.forwards
        self.stats.tokens += int(step.input_ids.size)
        by_reqs = self.stats.forwards_by_num_reqs
        by_reqs[len(step.req_ids)] = by_reqs.get(len(step.req_ids), 0) + 1

    def _forward_to_next_stage(self, inputs: _StepInputs,
                               hidden_in: mx.array | None) -> IntermediateTensors:
        """A pipeline stage before the last: its layers over the step (KV writes included),
        evaluated, as ``IntermediateTensors`` for the next stage."""
        self._timer.mark("prepare")
        with set_step_context(inputs.ctx):
            hidden = forward_hidden(self.model, self.kv_cache.layer_caches,
                                    mx.array(inputs.step.input_ids), hidden_in)
        mx.eval(hidden, self.kv_cache.arrays())
        self.stats.forwards += 1
        self.stats.tokens += int(inputs.step.input_ids.size)
        return IntermediateTensors({HIDDEN: mlx_to_torch(hidden, self.backend.logits_zero_copy)})

    def _model_forward(self, inputs: _StepInputs, scheduler_output: SchedulerOutput,
                       hidden_in: mx.array | None = None) -> _PendingStep:
        """The step's one forward under its step context (from ``hidden_in`` on a later
        pipeline stage); the MLX rows are sampled in the same evaluation as the forward and
        the KV writes."""
        step, states, mlx_idx = inputs.step, inputs.states, inputs.mlx_idx
        self._timer.mark("prepare")
        if self._waits_for_previous_step(inputs.ctx.attn.is_pure_decode):
            mx.synchronize()
        # the compiled trace holds the base layers only: steps with adapter rows run eagerly
        if (self.compiled_decode is not None and inputs.ctx.attn.is_pure_decode
                and inputs.ctx.lora is None):
            logits = self.compiled_decode(inputs.ctx.attn, step.input_ids, step.pending_rows,
                                          inputs.logit_rows)
        else:
            with set_step_context(inputs.ctx):
                input_ids = feed_pending(mx.array(step.input_ids), step.pending_rows)
                logits = forward(self.model, self.kv_cache.layer_caches, input_ids,
                                 inputs.logit_rows, hidden_in)
        mlx_rows = [self._sampling_row(step.req_ids[i]) for i in mlx_idx]
        tokens = None
        if mlx_rows:
            start = inputs.num_vllm_rows
            tokens = sample(logits[start:start + len(mlx_idx)], mlx_rows)
        if inputs.needs_torch and logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        self._timer.mark("graph")
        # Async scheduling queues the step and returns; a step whose logits go to torch
        # (vLLM's sampler, prompt logprobs) is waited for here.
        lazy = self.async_scheduling and not inputs.needs_torch
        outputs = [*([logits] if inputs.needs_torch else []),
                   *([tokens] if tokens is not None else []), self.kv_cache.arrays()]
        job = read_back = None
        if lazy and self.encoder is not None:
            # the host reads a copy: the next step's graph holds `tokens` (encode_thread.py)
            read_back = mx.contiguous(tokens) if tokens is not None else None
            job = self.encoder.submit([*outputs, *([read_back] if read_back is not None else [])])
        else:
            self.quiesce()  # this step may have been built alongside a queued one
            (mx.async_eval if lazy else mx.eval)(*outputs)
        self._timer.mark("eval")
        self._count_forward(step, evaluated=not lazy)
        if lazy and tokens is not None:
            for j, i in enumerate(mlx_idx):  # the next step feeds these on the device
                states[i].pending = (tokens, j)
        return _PendingStep(
            step=step, out=scheduler_output, states=states, vllm_idx=inputs.vllm_idx,
            mlx_idx=mlx_idx, prompt=inputs.prompt, num_vllm_rows=inputs.num_vllm_rows,
            logits=logits if inputs.needs_torch else None,
            mlx_tokens=tokens.tolist() if tokens is not None and not lazy else [],
            lazy=lazy, lazy_tokens=tokens if lazy else None, lazy_job=job, read_back=read_back,
            timer=self._timer, forward_index=self.stats.forwards,
            pure_decode=inputs.ctx.attn.is_pure_decode,
        )

    def _prompt_logprob_slices(
        self, step: StepBatch, states: list[RequestState], first_rows: np.ndarray
    ) -> list[_PromptSlice]:
        """Which rows of this step give prompt logprobs, with the chunking rules of vLLM's GPU
        runner (``_get_prompt_logprobs_dict``): the row of prompt position ``p`` scores token
        ``p + 1``; the tensors are handed over when the last prompt row has been scored, or,
        if a chunk ends exactly there, with the next step's sampled token.

        A step that starts past the prompt has no prompt rows: the step that reached the
        prompt's end hands the tensors over. That step's sampling may not have run yet when
        this one is laid out (async scheduling resolves a step's outputs after the next step
        was prepared), so such a step is skipped here rather than by the cleared
        ``num_prompt_logprobs`` alone; counting it again killed the engine (a one-token
        prompt with ``prompt_logprobs``).
        """
        slices = []
        for i, state in enumerate(states):
            if state.num_prompt_logprobs is None:
                continue
            start = int(step.seq_lens[i] - step.query_lens[i])  # num_computed_tokens
            if start >= state.num_prompt_tokens:
                continue
            num_tokens = int(step.query_lens[i])
            remaining = state.num_prompt_tokens - (start + 1)
            complete = num_tokens > remaining
            num_logits = max(remaining, 0) if complete else num_tokens
            slices.append(_PromptSlice(i, int(first_rows[i]), num_logits, start, complete))
        return slices

    def _sample(self, pending: _PendingStep, grammar_output: GrammarOutput | None):
        step, states = pending.step, pending.states
        if pending.lazy_job is not None:  # queued on the encode thread
            job, copy = pending.lazy_job, pending.read_back
            pending.mlx_tokens = (self.encoder.read_back(job, copy) if copy is not None
                                  else job.result() or [])
        elif pending.lazy_tokens is not None:  # waits for the queued step
            pending.mlx_tokens = pending.lazy_tokens.tolist()
        if pending.lazy_tokens is not None:
            # this step's graph has finished, and every forward queued before it
            self.forwards_done = max(self.forwards_done, pending.forward_index)
            if self.page_release is not None:
                self.page_release.flush()
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        for i, token in zip(pending.mlx_idx, pending.mlx_tokens, strict=True):
            sampled[i] = [token]
        logits = (
            mlx_to_torch(pending.logits, self.backend.logits_zero_copy)
            if pending.logits is not None else None
        )
        prompt_logprobs = self._prompt_logprobs(pending, logits)
        logprobs = None
        if pending.vllm_idx:
            n = len(pending.vllm_idx)
            rows = logits[:pending.num_vllm_rows]
            req_ids = [step.req_ids[i] for i in pending.vllm_idx]
            if grammar_output is not None:
                apply_grammar_bitmask(pending.out, grammar_output, req_ids, rows)
            if self.spec is not None:
                logprobs = self._verify(pending, rows, sampled)
            else:
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
            for token in sampled[i]:
                states[i].append_output(token)
            pend = states[i].pending
            if pend is not None and pend[0] is pending.lazy_tokens:
                states[i].pending = None  # now known on the host
        self.stats.sampled += sum(len(sampled[i]) for i in step.sample_req_idx)
        if self.spec is not None:
            # A decode/verification step (every request its last token and its drafts) times
            # the draft budget's step cost.
            self.spec.verified(pending.started, int(step.input_ids.size), step.req_ids,
                               len(step.sample_req_idx) == len(step.req_ids)
                               and bool(np.all(step.query_lens == step.num_draft_tokens + 1)))
            self.spec.propose(states, sampled, pending.out.num_spec_tokens_to_schedule)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
            kv_connector_output=pending.kv_output,
        )

    def _verify(self, pending: _PendingStep, rows: torch.Tensor,
                sampled: list[list[int]]) -> Any:
        """Speculative decoding: the vLLM-sampled requests (those with drafts, and those the
        MLX sampler cannot take) through vLLM's rejection sampler (:meth:`SpecDecoder.sample`)
        on their ``d + 1`` rows; ``sampled[i]`` gets request
        ``i``'s accepted drafts and its bonus (or recovered) token. Returns the logprobs as
        ``LogprobsLists`` indexed by scheduled request, or None."""
        step, idx = pending.step, pending.vllm_idx
        drafts = step.num_draft_tokens
        offsets = np.concatenate([[0], np.cumsum(drafts)])
        draft_ids = [t for i in idx
                     for t in step.draft_token_ids[offsets[i]:offsets[i] + drafts[i]]]
        metadata = self.vllm_sampling.prepare([pending.states[i] for i in idx],
                                              rows.shape[-1])
        result = self.spec.sample(rows, [int(drafts[i]) for i in idx], draft_ids, metadata,
                                  self.vocab_size)
        for i, tokens in zip(idx, result.token_ids, strict=True):
            sampled[i] = tokens
        if result.logprobs is None:
            return None
        return logprobs_for_requests(result.logprobs, idx,
                                     [len(t) for t in result.token_ids], len(step.req_ids))

    def take_draft_token_ids(self) -> Any:
        """The drafts proposed after the last step (vLLM ``DraftTokenIds``), once; None
        without speculative decoding or when already taken."""
        return self.spec.take() if self.spec is not None else None

    def _prompt_logprobs(self, pending: _PendingStep, logits) -> dict[str, Any]:
        """Fill each asking request's prompt logprobs from this step's prompt rows; return the
        finished ones (``prompt_logprobs_dict``)."""
        done: dict[str, Any] = {}
        row = pending.num_vllm_rows + len(pending.mlx_idx)
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
        return forward(self.model, self.kv_cache.layer_caches, input_ids, rows)

    def shutdown(self) -> None:
        """Stop the encode thread and the KV connector; log the counters."""
        if self.encoder is not None:
            self.encoder.shutdown()
        logger.info("vllm-unified: runner stats %s", self.stats)
        self.kv_connector.shutdown()

    def quiesce(self) -> None:
        """Wait for the step the encode thread is evaluating, if any: called before any MLX
        call outside a step's own path (:mod:`vllm_unified.worker.encode_thread`)."""
        if self.encoder is not None:
            self.encoder.wait()

    def stats_dict(self) -> dict:
        """Counters, plus the step-time breakdown in seconds summed over all steps
        (``prepare_s``, ``build_s``: graph building, ``eval_s``, ``finish_s``: output; see
        :mod:`vllm_unified.worker.step_profile`) and the per-kind profile."""
        phases = self.step_profile.seconds()
        self.quiesce()
        encoder = self.encoder
        return {**asdict(self.stats), "resumed": self.input_batch.num_resumed,
                **(self.spec.stats() if self.spec is not None else {}),
                "encode_thread_s": encoder.encode_s if encoder else 0.0,
                "encode_wait_s": encoder.wait_s if encoder else 0.0,
                "read_back_s": encoder.read_back_s if encoder else 0.0,
                "live_requests": len(self.requests),
                "prepare_s": phases["prepare"], "build_s": phases["graph"],
                "eval_s": phases["eval"], "finish_s": phases["output"],
                "step_profile": self.step_profile.as_dict()}

    def _sampling_row(self, req_id: str) -> SamplingRow:
        state = self.requests[req_id]
        p: Any = state.sampling_params
        key = None
        if state.rng_key is not None:
            state.rng_key, key = mx.random.split(state.rng_key)
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, key=key
        )

    # ----------------------------------------------------------------------------- memory
    def weights_nbytes(self) -> dict[str, int]:
        """Bytes of the model parameters this process holds (a pipeline stage: its own):
        ``layers`` (the decoder layers) and ``other`` (embedding, final norm, LM head)."""
        from mlx.utils import tree_flatten

        sizes = {"layers": 0, "other": 0}
        for name, a in tree_flatten(self.model.parameters()):
            sizes["layers" if name.startswith("model.layers.") else "other"] += a.nbytes
        return sizes

    def profile_activations(self, num_tokens: int) -> int:
        """Peak MLX memory (bytes) above what is allocated now, of one prefill forward over
        ``num_tokens`` tokens of a single sequence (the largest attention a step can hold),
        with a temporary pool just big enough for it. Logits of the sampled rows are added by
        the caller; this measures the transformer's activations."""
        caches, ctx, arrays = self.kv_cache.temporary(num_tokens, self.block_size,
                                                      self.vllm_config)
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        ids = mx.zeros((num_tokens,), dtype=mx.int32)
        try:
            with set_step_context(ctx):
                logits = self._stage_forward(caches, ids, np.array([num_tokens - 1], np.int32))
            mx.eval(logits, arrays())
        except Exception as e:  # the first token-major forward: name the model, keep the cause
            raise UnsupportedModel(
                self.loaded.config["model_type"], "a forward with every scheduled token as its "
                f"own batch row and positions as an array ({e!r})") from e
        peak = mx.get_peak_memory() - base
        del caches, ctx, arrays, logits
        mx.clear_cache()
        return max(int(peak), 0)

    # ----------------------------------------------------------------------------- warm-up
    def warm_up(self) -> float:
        """Run a dummy prefill through the real path (block 0 is vLLM's null block, never
        handed to requests, so writing it is harmless), with logits for its last two rows,
        so that the kernels a batch of decode rows needs are compiled here (on CUDA the decode
        GEMM kernel's instances, the output head's included) and not by the first requests.
        Returns seconds taken."""
        start = time.perf_counter()
        n = min(self.block_size, self.model_config.max_model_len)
        ctx = self.kv_cache.step_context([n], [n], np.zeros((1, 1), dtype=np.int32), None)
        with set_step_context(ctx):
            logits = self._stage_forward(self.kv_cache.layer_caches,
                                         mx.zeros((n,), dtype=mx.int32),
                                         np.arange(max(n - 2, 0), n, dtype=np.int32))
        mx.eval(logits, self.kv_cache.arrays())
        return time.perf_counter() - start

    def _stage_forward(self, caches: list[Any], input_ids: mx.array,
                       rows: np.ndarray) -> mx.array:
        """A dummy forward of this pipeline stage alone (profiling, warm-up): zero hidden
        states in on a later stage, hidden states out (no LM head) before the last."""
        hidden_in = None
        if not self.stage.is_first:
            width = int(self.loaded.config["hidden_size"])
            hidden_in = mx.zeros((input_ids.shape[0], width), dtype=self.dtype)
        if not self.stage.is_last:
            return forward_hidden(self.model, caches, input_ids, hidden_in)
        return forward(self.model, caches, input_ids, rows, hidden_in)


def _checkpoint_path(path: str) -> str:
    """The file or folder to load: the linked GGUF of a folder made by ``prepare_gguf_dir``,
    else the checkpoint folder itself."""
    gguf = gguf_in_dir(path)
    return str(gguf) if gguf is not None else path
