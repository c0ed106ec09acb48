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
   (vLLM's scheduler rolls ``num_computed_tokens`` back).

vLLM's scheduler counts drafts and accepted tokens itself (``SpecDecodingStats``), so the
``vllm:spec_decode_*`` metrics need nothing from the worker.

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

from vllm_unified import compat, patches
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
        #: drafts proposed after the last step, until vLLM takes them: (req_ids, drafts)
        self._drafts: tuple[list[str], list[list[int]]] | None = None
        #: totals for logs and tests
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def describe(self) -> str:
        return f"method {self.method}, k = {self.k} draft tokens per step"

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
        return SpecSampled(token_ids, logprobs)

    # ------------------------------------------------------------------ proposal
    def propose(self, states: list[RequestState], sampled: list[list[int]]) -> None:
        """Propose drafts for the requests of a finished step (their ``token_ids`` hold this
        step's tokens); requests that sampled nothing (prefill chunks) get none."""
        if self.method == "draft_model":
            drafts = self.proposer.propose(states, sampled)
            self._drafts = ([s.req_id for s in states], drafts)
            return
        num_tokens = np.array([len(s.token_ids) for s in states], dtype=np.int32)
        width = int(num_tokens.max()) if len(states) else 0
        token_ids = np.zeros((len(states), max(width, 1)), dtype=np.int32)
        for i, s in enumerate(states):
            token_ids[i, :num_tokens[i]] = s.token_ids
        if self.method == "ngram":
            drafts = self.proposer.propose(self.k, sampled, num_tokens, token_ids)
        else:
            drafts = self.proposer.propose(self.k, _ProposerBatch(states, token_ids, num_tokens),
                                           sampled)
        self._drafts = ([s.req_id for s in states], [list(d) for d in drafts])

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

    def stats(self) -> dict[str, int]:
        out = {"spec_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
               "spec_accepted_tokens": self.num_accepted_tokens}
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
