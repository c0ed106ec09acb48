"""Sampling through vLLM's own ``Sampler`` for everything the MLX sampler does not implement.

Requests that only use greedy / temperature / top-k / top-p / min-p / seed and ask for no
logprobs are sampled in MLX (:mod:`vllm_unified.worker.sampler`). A request that uses anything
else — presence/frequency/repetition penalties, ``logit_bias``, ``bad_words``,
``allowed_token_ids``, ``min_tokens``, ``logprobs``, structured output — is sampled, for its
whole lifetime, by vLLM 0.32's ``vllm.v1.sample.sampler.Sampler`` with vLLM's builtin logits
processors (min-p, logit bias, min tokens) and a ``SamplingMetadata`` built the way
``vllm/v1/worker/gpu_input_batch.py`` builds it. The decision is per request and fixed, so a
seeded request always draws from the same generator whatever shares its batch (MLX key on the
fast path, a persistent ``torch.Generator`` here).

The logits reach torch through :func:`mlx_to_torch` (:mod:`vllm_unified.bridge`): on MLX's
CPU backend it is a view of the MLX buffer (no bytes move; vLLM's sampler then works
in place on it). On the GPU backends (Metal, CUDA) the rows are copied into host memory,
explicitly (vLLM's sampler runs on CPU tensors in this worker): a documented copy of
``[rows, vocab]`` float32 per step, only for the rows that need vLLM's sampler or prompt
logprobs. Steps without such rows never leave MLX.

Prompt logprobs use the same ``Sampler.compute_logprobs`` / ``gather_logprobs`` as vLLM's GPU
runner (``_get_prompt_logprobs_dict``), on logits of the prompt rows the runner asks the
forward for only when a request wants them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import torch

from vllm_unified import bridge, compat
from vllm_unified.compat import SAMPLING_EPS
from vllm_unified.worker.input_batch import RequestState


def needs_vllm_sampler(p: Any) -> bool:
    """Whether a request's ``SamplingParams`` use anything the MLX sampler does not implement."""
    return bool(
        abs(p.presence_penalty) > SAMPLING_EPS
        or abs(p.frequency_penalty) > SAMPLING_EPS
        or abs(p.repetition_penalty - 1.0) > SAMPLING_EPS
        or p.logit_bias
        or p.allowed_token_ids
        or p.bad_words
        or p.bad_words_token_ids
        or p.min_tokens > 0
        or p.logprobs is not None
        or p.structured_outputs is not None
    )


def mlx_to_torch(arr: mx.array, zero_copy: bool) -> torch.Tensor:
    """A torch tensor of the evaluated ``arr``: a view of its buffer with ``zero_copy`` (MLX's
    CPU backend; writes are seen by MLX), else an explicit host copy (GPU backends)."""
    return bridge.to_torch(arr, copy=not zero_copy)


class _RowIds:
    """What ``apply_grammar_bitmask`` reads of vLLM's input batch: the request of each row."""

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids


class VllmSampling:
    """vLLM's ``Sampler`` plus its logits processors, fed from our request states.

    vLLM's logits processors keep per-row state updated through ``BatchUpdate`` messages
    (added / removed / moved rows of a persistent batch). Our rows are the requests of one step
    that use this path, in step order; each call diffs them against the previous call's rows:
    a row whose request changed is "added" (replacing whatever was there), rows past the new
    batch size are "removed".
    """

    def __init__(self, vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        self.logprobs_mode: str = model_config.logprobs_mode
        self.sampler = compat.Sampler(logprobs_mode=model_config.logprobs_mode)
        self.logitsprocs = compat.build_logitsprocs(
            vllm_config, torch.device("cpu"), False, False,
            tuple(model_config.logits_processors or ()),
        )
        builtin = tuple(compat.BUILTIN_LOGITS_PROCESSORS)
        #: names of custom (non-builtin) logits processors loaded from plugins or
        #: ``--logits-processors``; when there are any, every request takes this path so they
        #: apply to all of them.
        self.custom_logitsprocs: list[str] = [
            type(p).__name__ for p in self.logitsprocs.all if not isinstance(p, builtin)
        ]
        self._rows: list[str] = []

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: torch.Tensor, states: list[RequestState]) -> Any:
        """Sample one token per row with vLLM's sampler (``logits`` may be modified in place).

        Args:
            logits: ``[N, V]`` float32 logits, row ``i`` for ``states[i]``.
            states: the requests, in row order; their ``output_token_ids`` must not yet hold
                this step's token.

        Returns:
            vLLM ``SamplerOutput`` (``sampled_token_ids`` ``[N, 1]``, optional
            ``logprobs_tensors`` for the rows' logprobs).
        """
        if len(states) != logits.shape[0]:
            raise ValueError(f"{len(states)} requests for {logits.shape[0]} logits rows")
        metadata = self.prepare(states, logits.shape[-1])
        with torch.inference_mode():
            return self.sampler(logits, metadata)

    def prepare(self, states: list[RequestState], vocab: int) -> Any:
        """Bring the logits processors' rows up to ``states`` (``BatchUpdate``) and return
        the step's ``SamplingMetadata`` (:meth:`metadata`); for callers that sample
        themselves (the rejection sampler of speculative decoding)."""
        self._update_logitsprocs(states)
        return self.metadata(states, vocab)

    def _update_logitsprocs(self, states: list[RequestState]) -> None:
        prev = self._rows
        added = [
            (i, s.sampling_params, s.prompt_token_ids, s.output_token_ids)
            for i, s in enumerate(states)
            if i >= len(prev) or prev[i] != s.req_id
        ]
        removed = list(range(len(states), len(prev)))
        update = None
        if added or removed:
            update = compat.BatchUpdate(
                batch_size=len(states), removed=removed, added=added, moved=[]
            )
        for proc in self.logitsprocs.all:
            proc.update_state(update)
        self._rows = [s.req_id for s in states]

    def metadata(self, states: list[RequestState], vocab: int) -> Any:
        """``SamplingMetadata`` for ``states`` in row order, with the conventions of vLLM's
        ``InputBatch._make_sampling_metadata`` (greedy rows get temperature 0, top-k of the
        vocabulary size means "off", prompts padded with ``vocab`` for penalties, the
        allowed-token mask is True where a token is *not* allowed)."""
        params = [s.sampling_params for s in states]
        n = len(params)
        greedy = [p.sampling_type == compat.SamplingType.GREEDY for p in params]
        temperature = torch.tensor(
            [0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
            dtype=torch.float32,
        )
        top_p = [p.top_p for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        num_logprobs = [vocab if p.logprobs == -1 else p.logprobs
                        for p in params if p.logprobs is not None]
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        no_penalties = all(
            p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and p.repetition_penalty == 1.0 for p in params
        )
        prompt_ids = None
        if not no_penalties:
            width = max(s.num_prompt_tokens for s in states)
            prompt_ids = torch.full((n, width), vocab, dtype=torch.int64)
            for i, s in enumerate(states):
                prompt_ids[i, : s.num_prompt_tokens] = torch.tensor(
                    s.prompt_token_ids, dtype=torch.int64
                )
        allowed_mask = None
        if any(p.allowed_token_ids for p in params):
            allowed_mask = torch.zeros((n, vocab), dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    allowed_mask[i] = True
                    allowed_mask[i, p.allowed_token_ids] = False
        return compat.SamplingMetadata(
            temperature=None if all(greedy) else temperature,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=None if all(tp >= 1.0 for tp in top_p)
            else torch.tensor(top_p, dtype=torch.float32),
            top_k=None if all(k == vocab for k in top_k)
            else torch.tensor(top_k, dtype=torch.int32),
            generators={i: s.generator for i, s in enumerate(states)
                        if s.generator is not None},
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            no_penalties=no_penalties,
            prompt_token_ids=prompt_ids,
            frequency_penalties=freq,
            presence_penalties=pres,
            repetition_penalties=rep,
            output_token_ids=[s.output_token_ids for s in states],
            allowed_token_ids_mask=allowed_mask,
            bad_words_token_ids={i: p.bad_words_token_ids for i, p in enumerate(params)
                                 if p.bad_words_token_ids},
            logitsprocs=self.logitsprocs,
        )

    # ------------------------------------------------------------------ prompt logprobs
    def prompt_logprobs(
        self, logits: torch.Tensor, num_logprobs: int, target_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-``num_logprobs`` and target-token logprobs of prompt rows, as vLLM's GPU runner
        computes them (prompt rows skip the sampling processors, so raw and processed modes
        agree).

        Returns:
            ``(token_ids [n, k+1] int32, logprobs [n, k+1], ranks [n])``.
        """
        with torch.inference_mode():
            if self.logprobs_mode in ("raw_logits", "processed_logits"):
                scores = logits.to(torch.float32)
            else:
                scores = self.sampler.compute_logprobs(logits)
            ids, lps, ranks, *_ = self.sampler.gather_logprobs(
                scores, num_logprobs, target_ids
            )
        return ids, lps, ranks


def logprobs_lists(tensors: Any, rows: list[int], num_reqs: int) -> Any:
    """vLLM ``LogprobsLists`` with one row per scheduled request (what the scheduler slices by
    request index), filled from the sampler's rows; other requests' rows stay zero and are
    never read (they asked for no logprobs or sampled nothing)."""
    ids = tensors.logprob_token_ids.numpy()
    lps = tensors.logprobs.numpy()
    ranks = tensors.selected_token_ranks.numpy()
    out_ids = np.zeros((num_reqs, ids.shape[1]), dtype=ids.dtype)
    out_lps = np.zeros((num_reqs, lps.shape[1]), dtype=lps.dtype)
    out_ranks = np.zeros((num_reqs,), dtype=ranks.dtype)
    out_ids[rows], out_lps[rows], out_ranks[rows] = ids, lps, ranks
    return compat.LogprobsLists(out_ids, out_lps, out_ranks)


def apply_grammar_bitmask(
    scheduler_output: Any, grammar_output: Any, req_ids: list[str], logits: torch.Tensor
) -> None:
    """vLLM's ``apply_grammar_bitmask`` on our rows (``req_ids[i]`` owns ``logits[i]``);
    structured-output requests without a row this step (mid-prefill) are skipped by it."""
    compat.apply_grammar_bitmask(scheduler_output, grammar_output, _RowIds(req_ids), logits)
