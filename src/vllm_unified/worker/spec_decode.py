"""Speculative decoding (vLLM's ``--speculative-config``): vLLM's proposers and rejection sampler
driven from the MLX runner.

The flow is vLLM's GPU runner's (``vllm/v1/worker/gpu_model_runner.py``) with synchronous
scheduling (vLLM 0.32 turns async scheduling off for the ``ngram`` and ``suffix`` methods):

1. After a step is sampled, :meth:`SpecDecoder.propose` runs vLLM's own proposer
   (``NgramProposer``, ``SuffixDecodingProposer``) over the requests that sampled, on the
   tokens known on the host; :meth:`SpecDecoder.take` hands them to vLLM's engine
   (``take_draft_token_ids``), whose scheduler validates them (structured output, budget,
   ``max_model_len``) and schedules them with the next step
   (``scheduled_spec_decode_tokens``).
2. That step's layout (:meth:`vllm_unified.worker.input_batch.InputBatch.layout`) feeds each
   request's last token followed by its draft tokens: a decode row grows to ``k + 1`` query
   tokens, all requests in the same single MLX forward as the rest of the batch; the LM head
   runs on every one of those rows.
3. :meth:`SpecDecoder.sample` runs vLLM's ``RejectionSampler`` on those logits (a torch view
   on MLX's CPU backend) with :func:`spec_decode_metadata`: greedy and random requests,
   per-request generators, penalties with the drafts counted as outputs, min tokens, bad
   words, allowed token ids, the grammar bitmask applied beforehand, logprobs of every
   accepted token. Rejected drafts' K/V stay in the pool where the next step overwrites them
   (vLLM's scheduler rolls ``num_computed_tokens`` back). A request with no draft in the step
   that needs nothing else of vLLM's sampler and has no seed is sampled in MLX instead, as
   without speculation (``RequestState.mlx_when_undrafted``, decided by the runner).

How many drafts each request hands to vLLM (the draft budget, :attr:`SpecDecoder.policy`;
seeded requests always hand all theirs):

* ``adaptive`` (the default): :class:`~vllm_unified.worker.draft_budget.DraftBudget` caps
  each request's drafts per step from the runner's own timing of recent steps and the
  observed acceptance per position (:mod:`vllm_unified.worker.draft_budget`);
  ``VLLM_UNIFIED_SPEC_BUDGET=0`` turns it off;
* ``schedule``: the user set vLLM's ``num_speculative_tokens_per_batch_size``; vLLM's scheduler
  puts that schedule's count for the step's batch size in ``num_spec_tokens_to_schedule`` and
  the proposer drafts that many, as vLLM's GPU runner does (the adaptive budget stays off);
* ``off``: every draft the proposer makes (up to ``k``) is handed.

vLLM's scheduler counts drafts and accepted tokens itself (``SpecDecodingStats``) from the
drafts it scheduled, so the ``vllm:spec_decode_*`` metrics need nothing from the worker and
count only the drafts that were handed.

On CPU tensors vLLM's rejection sampler runs its Triton kernels through vLLM's C++ stand-ins
(``vllm.utils.cpu_triton_utils``; the expand kernel is ours, vLLM's is broken):
:func:`vllm_unified.patches.route_rejection_sampler_kernels`, run from the platform's
``register_triton_kernel_overrides`` (before MLX loads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm_unified import compat, envs, patches
from vllm_unified.envs import SPEC_BUDGET_ENV
from vllm_unified.worker.draft_budget import DraftBudget
from vllm_unified.worker.input_batch import RequestState

#: ``--speculative-config`` methods the MLX runner implements.
SUPPORTED_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpecSampled:
    """What :meth:`SpecDecoder.sample` returns.

    Attributes:
        token_ids: per sampled row (request) the accepted drafts followed by the bonus or
            recovered token (1 to ``d + 1`` tokens).
        logprobs: vLLM ``LogprobsLists`` over those tokens, ``cu_num_generated_tokens`` per
            row (None unless a request asked for logprobs).
    """

    token_ids: list[list[int]]
    logprobs: Any


def spec_decode_metadata(num_draft_tokens: list[int], draft_token_ids: list[int]) -> Any:
    """vLLM ``SpecDecodeMetadata`` for logits laid out request after request, ``d + 1`` rows
    for a request with ``d`` drafts (the rows of its last token and of each draft), as vLLM's
    ``GPUModelRunner._calc_spec_decode_metadata`` computes it when every request samples.

    Args:
        num_draft_tokens: ``[B]`` drafts per request (0 allowed).
        draft_token_ids: the drafts of all requests, concatenated (``sum(num_draft_tokens)``).

    Returns:
        ``SpecDecodeMetadata`` with CPU int32 tensors; ``logits_indices`` is the identity over
        the ``sum(d + 1)`` logits rows.

    Raises:
        ValueError: ``draft_token_ids`` does not hold ``sum(num_draft_tokens)`` tokens.
    """
    num_draft = np.asarray(num_draft_tokens, dtype=np.int32)
    if len(draft_token_ids) != int(num_draft.sum()):
        raise ValueError(f"{len(draft_token_ids)} draft tokens for counts {num_draft_tokens}")
    num_sampled = num_draft + 1
    cu_sampled = np.cumsum(num_sampled, dtype=np.int32)
    cu_draft = np.cumsum(num_draft, dtype=np.int32)
    starts = cu_sampled - num_sampled
    target = (np.repeat(starts, num_draft)
              + np.arange(int(cu_draft[-1]) if len(cu_draft) else 0, dtype=np.int32)
              - np.repeat(cu_draft - num_draft, num_draft)).astype(np.int32)
    t = torch.from_numpy
    return compat.SpecDecodeMetadata(
        draft_token_ids=torch.tensor(draft_token_ids, dtype=torch.int32),
        num_draft_tokens=num_draft.tolist(),
        cu_num_draft_tokens=t(cu_draft),
        cu_num_sampled_tokens=t(cu_sampled),
        target_logits_indices=t(target),
        bonus_logits_indices=t(cu_sampled - 1),
        logits_indices=torch.arange(int(cu_sampled[-1]) if len(cu_sampled) else 0,
                                    dtype=torch.int32),
    )


class _ProposerBatch:
    """The part of vLLM's ``InputBatch`` that ``SuffixDecodingProposer.propose`` reads."""

    def __init__(self, states: list[RequestState], token_ids: np.ndarray,
                 num_tokens: np.ndarray) -> None:
        self.req_ids = [s.req_id for s in states]
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.num_tokens_no_spec = num_tokens
        self.num_prompt_tokens = np.array([s.num_prompt_tokens for s in states], np.int32)
        self.token_ids_cpu = token_ids


class SpecDecoder:
    """vLLM's proposer and rejection sampler for one runner.

    Args:
        vllm_config: vLLM's config (``speculative_config`` set, method in
            :data:`SUPPORTED_METHODS`).
        sampler: the runner's vLLM ``Sampler`` (bonus tokens are sampled by it).
        draft: the draft model (:class:`vllm_unified.worker.draft_model.DraftModel`) for
            method ``draft_model``.

    Raises:
        ValueError: a method the runner does not implement (names ``--speculative-config``).
    """

    def __init__(self, vllm_config: Any, sampler: Any, draft: Any = None) -> None:
        spec = vllm_config.speculative_config
        self.method: str = spec.method
        self.k: int = int(spec.num_speculative_tokens)
        self.max_model_len: int = vllm_config.model_config.max_model_len
        if self.method == "ngram":
            self.proposer = compat.NgramProposer(vllm_config)
        elif self.method == "suffix":
            self.proposer = compat.SuffixDecodingProposer(vllm_config)
        elif self.method == "draft_model" and draft is not None:
            self.proposer = draft
        else:
            raise ValueError(
                f"--speculative-config method {self.method!r}: vllm-unified implements "
                f"{', '.join(SUPPORTED_METHODS)}"
            )
        patches.require_rejection_sampler_kernels()
        self.rejection_sampler = compat.RejectionSampler(sampler, spec, torch.device("cpu"))
        #: vLLM's batch-size schedule of draft counts, when the user set one
        self.schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        #: the draft budget: "adaptive", "schedule" (vLLM's, set by the user) or "off"
        self.policy = ("schedule" if self.schedule else
                       "adaptive" if envs.read(SPEC_BUDGET_ENV) else "off")
        self.budget: DraftBudget | None = (
            DraftBudget(self.k, draft_forwards=self.method == "draft_model")
            if self.policy == "adaptive" else None)
        #: drafts proposed after the last step, until vLLM takes them: (req_ids, drafts)
        self._drafts: tuple[list[str], list[list[int]]] | None = None
        #: the last decode/verification step whose period is still open:
        #: (scheduled tokens, its execute_model start, its request ids)
        self._open: tuple[int, float, set[str]] | None = None
        #: seconds of draft-model forwards since that step's verification
        self._draft_s = 0.0
        #: totals for logs and tests
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        #: drafts handed to vLLM, and those the budget kept back (proposed, or for a draft
        #: model positions it did not draft)
        self.num_handed_tokens = 0
        self.num_withheld_tokens = 0

    def describe(self) -> str:
        """The start-up log's words: method, k and the draft budget in use."""
        if self.policy == "adaptive":
            budget = (f"draft budget adaptive (per step, the draft count with the most expected "
                      f"tokens/s from measured step times and acceptance; {SPEC_BUDGET_ENV}=0 "
                      f"hands every draft)")
        elif self.policy == "schedule":
            budget = (f"draft budget: vLLM's num_speculative_tokens_per_batch_size "
                      f"{self.schedule}")
        else:
            budget = f"draft budget off ({SPEC_BUDGET_ENV}=0): every draft is handed"
        return f"method {self.method}, k = {self.k} draft tokens per step; {budget}"

    # ------------------------------------------------------------------ step timing
    def step_started(self, scheduler_output: Any, now: float) -> None:
        """At every ``execute_model`` start: closes the open decode/verification step's
        period (the budget's step-cost observation: ``now`` less that step's start, less the
        draft forwards since), unless the new step admits new requests or shares none of
        its requests (either may follow an idle engine)."""
        prev, self._open = self._open, None
        if prev is None or self.budget is None:
            return
        num_tokens, started, req_ids = prev
        if scheduler_output.scheduled_new_reqs or not (
                req_ids & set(scheduler_output.num_scheduled_tokens)):
            return
        self.budget.observe_step(num_tokens, now - started - self._draft_s)

    def verified(self, started: float, num_tokens: int, req_ids: list[str],
                 decode_only: bool) -> None:
        """After a step's verification: opens its period if every scheduled request had one
        token plus its drafts (``decode_only``), which :meth:`step_started` closes."""
        self._draft_s = 0.0
        self._open = ((num_tokens, started, set(req_ids))
                      if decode_only and self.budget is not None else None)

    # ------------------------------------------------------------------ verification
    def sample(self, logits: torch.Tensor, num_draft_tokens: list[int],
               draft_token_ids: list[int], metadata: Any, vocab: int) -> SpecSampled:
        """Accept or reject each request's drafts with vLLM's ``RejectionSampler``.

        Args:
            logits: ``[sum(d + 1), V]`` float32 target logits, request after request (the
                grammar bitmask already applied); may be modified in place.
            num_draft_tokens: ``[B]`` drafts per request, in row order.
            draft_token_ids: the drafts, concatenated.
            metadata: vLLM ``SamplingMetadata`` of the ``B`` requests (their
                ``output_token_ids`` without this step's tokens).
            vocab: the vocabulary size (tokens at or above it are dropped, as vLLM does).
        """
        spec = spec_decode_metadata(num_draft_tokens, draft_token_ids)
        drafts, start = [], 0
        for d in num_draft_tokens:
            drafts.append(list(draft_token_ids[start:start + d]))
            start += d
        metadata = replace(metadata, spec_token_ids=drafts)
        with torch.inference_mode():
            out = self.rejection_sampler(spec, None, logits, metadata)
        token_ids, logprobs = compat.RejectionSampler.parse_output(
            out.sampled_token_ids, vocab, logprobs_tensors=out.logprobs_tensors)
        for d, toks in zip(num_draft_tokens, token_ids, strict=True):
            if d:
                self.num_drafts += 1
                self.num_draft_tokens += d
                self.num_accepted_tokens += len(toks) - 1
                if self.budget is not None:
                    self.budget.observe_acceptance(d, len(toks) - 1)
        return SpecSampled(token_ids, logprobs)

    # ------------------------------------------------------------------ proposal
    def propose(self, states: list[RequestState], sampled: list[list[int]],
                num_spec_tokens: int | None = None) -> None:
        """Propose drafts for the requests of a finished step (their ``token_ids`` hold this
        step's tokens); requests that sampled nothing (prefill chunks) get none.

        Args:
            states: the step's requests.
            sampled: tokens sampled per request this step.
            num_spec_tokens: the step's ``SchedulerOutput.num_spec_tokens_to_schedule`` (vLLM's
                count for this batch size: ``k`` unless ``num_speculative_tokens_per_batch_size``
                says otherwise); None: ``k``.
        """
        k = self.k if num_spec_tokens is None else min(self.k, int(num_spec_tokens))
        req_ids = [s.req_id for s in states]
        active = [i for i, s in enumerate(states)
                  if sampled[i] and len(s.token_ids) < self.max_model_len]
        if k <= 0 or not active:
            self._drafts = (req_ids, [[] for _ in states])
            return
        seeded = [states[i].sampling_params.sampling_type == compat.SamplingType.RANDOM_SEED
                  for i in active]
        if self.method == "draft_model":
            room = [min(k, self.max_model_len - len(states[i].token_ids)) for i in active]
            caps = self._caps(room, seeded)
            depths = [0] * len(states)
            for i, c in zip(active, caps, strict=True):
                depths[i] = c
            drafts = self.proposer.propose(states, sampled, depths)
            for rows, seconds in self.proposer.last_forwards:
                self._draft_s += seconds
                if self.budget is not None:
                    self.budget.observe_draft_forward(rows, seconds)
            self.num_withheld_tokens += sum(room) - sum(caps)
        else:
            num_tokens = np.array([len(s.token_ids) for s in states], dtype=np.int32)
            width = int(num_tokens.max())
            token_ids = np.zeros((len(states), max(width, 1)), dtype=np.int32)
            for i, s in enumerate(states):
                token_ids[i, :num_tokens[i]] = s.token_ids
            if self.method == "ngram":
                proposed = self.proposer.propose(k, sampled, num_tokens, token_ids)
            else:
                proposed = self.proposer.propose(
                    k, _ProposerBatch(states, token_ids, num_tokens), sampled)
            drafts = [list(d)[:k] for d in proposed]
            lengths = [len(drafts[i]) for i in active]
            caps = self._caps(lengths, seeded)
            for i, c in zip(active, caps, strict=True):
                drafts[i] = drafts[i][:c]
            self.num_withheld_tokens += sum(lengths) - sum(caps)
        self.num_handed_tokens += sum(len(d) for d in drafts)
        self._drafts = (req_ids, drafts)

    def _caps(self, lengths: list[int], seeded: list[bool]) -> list[int]:
        """The budget's caps (seeded requests exempt: their drafts decide which random numbers
        they draw), or the lengths themselves without an adaptive budget."""
        return self.budget.caps(lengths, seeded) if self.budget is not None else lengths

    def forget(self, req_ids: Any) -> None:
        """Finished requests: the draft model drops what it tracks for them."""
        if self.method == "draft_model":
            self.proposer.forget(req_ids)

    def take(self) -> Any:
        """vLLM ``DraftTokenIds`` of the last step's proposals (once), or None."""
        drafts, self._drafts = self._drafts, None
        if drafts is None:
            return None
        return compat.DraftTokenIds(*drafts)

    def stats(self) -> dict[str, Any]:
        """Counters for logs and tests (JSON-able), the budget's among them."""
        out = {"spec_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
               "spec_accepted_tokens": self.num_accepted_tokens,
               "spec_handed_tokens": self.num_handed_tokens,
               "spec_withheld_tokens": self.num_withheld_tokens, "spec_policy": self.policy}
        if self.budget is not None:
            out.update({f"spec_{k}": v for k, v in self.budget.stats().items()})
        if self.method == "draft_model":
            out.update(self.proposer.stats())
        return out


def logprobs_for_requests(lists: Any, rows: list[int], counts: list[int], num_reqs: int
                          ) -> Any:
    """Re-index the rejection sampler's ``LogprobsLists`` (one entry per sampled row) by
    scheduled request: ``cu_num_generated_tokens[i]`` is where request ``i``'s tokens start
    (requests that sampled nothing have none), which is how vLLM's scheduler slices it.

    Args:
        lists: ``LogprobsLists`` with ``cu_num_generated_tokens`` over the sampled rows.
        rows: the scheduled-request index of each sampled row, ascending.
        counts: tokens generated by each sampled row.
        num_reqs: scheduled requests in the step.
    """
    per_req = [0] * num_reqs
    for r, c in zip(rows, counts, strict=True):
        per_req[r] = c
    cu = [0, *np.cumsum(per_req).tolist()]
    return compat.LogprobsLists(lists.logprob_token_ids, lists.logprobs,
                                lists.sampled_token_ranks, cu)
