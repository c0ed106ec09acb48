"""Per-request state the runner keeps across steps, updated from each ``SchedulerOutput``.

vLLM's scheduler (model-runner V1 message format) sends a request's prompt and blocks once, when
it is new; later steps only say how far it has been computed, which blocks were added, and
whether it was resumed after preemption. This module folds those messages into
:class:`RequestState` objects and builds the token-major layout of one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_unified.compat import SchedulerOutput


@dataclass
class RequestState:
    """What the runner knows about one request.

    Attributes:
        req_id: vLLM's request id.
        token_ids: prompt followed by the output tokens accepted so far.
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        block_ids: KV block ids of the attention KV cache group, in sequence order.
        num_computed_tokens: tokens whose K/V are in the pool (from the scheduler).
        sampling_params: vLLM ``SamplingParams`` (None for a pooling request).
        rng_key: MLX PRNG key of a seeded request sampled in MLX (split once per sampled
            token), else None.
        uses_vllm_sampler: sampled by vLLM's own ``Sampler`` (penalties, logit bias, bad
            words, allowed token ids, min tokens, logprobs, structured output) rather than by
            the MLX sampler; fixed for the request's lifetime so a seeded request always draws
            from the same generator.
        mlx_when_undrafted: with speculative decoding (``uses_vllm_sampler`` then always
            True), a step that verifies no draft of this request may sample it in MLX
            instead: it needs nothing the MLX sampler lacks, no custom logits processor runs
            and it has no seed (a seeded request keeps drawing from its one generator).
        generator: torch generator of a seeded request sampled by vLLM's ``Sampler``; it
            persists across steps (and preemption), as in vLLM's GPU runner.
        output_token_ids: the output part of ``token_ids``, as its own list that is only ever
            mutated in place: vLLM's logits processors (min tokens) and penalties keep a
            reference to it.
        num_prompt_logprobs: top-N of the request's prompt logprobs still to compute (the
            vocabulary size for -1), None when not asked or done.
        prompt_logprobs: the prompt logprobs filled chunk by chunk (vLLM ``LogprobsTensors``).
        other_block_ids: block ids of the other KV cache groups (hybrid models' state
            groups: one block, the request's state slot), by group id.
        pending: with asynchronous scheduling, the token sampled by a step whose output has
            not been read back yet, as ``(tokens, index)``: element ``index`` of that step's
            (possibly still computing) MLX token array. It is the token after ``token_ids``;
            the next step feeds it on the device, without waiting for it.
        pooling_params: a pooling model's request: its vLLM ``PoolingParams`` (then
            ``sampling_params`` is None), else None.
        pooling_states: vLLM's ``PoolingStates`` of a pooling request, else None.
        lora_request: vLLM's ``LoRARequest`` of a request served under an adapter, else None.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: object
    rng_key: object | None = None
    uses_vllm_sampler: bool = False
    mlx_when_undrafted: bool = False
    generator: object | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs: int | None = None
    prompt_logprobs: object | None = None
    other_block_ids: dict[int, list[int]] = field(default_factory=dict)
    pending: tuple[object, int] | None = None
    pooling_params: object | None = None
    pooling_states: object | None = None
    lora_request: object | None = None

    def __post_init__(self) -> None:
        self.output_token_ids[:] = self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def append_output(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)

    def set_tokens(self, token_ids: list[int]) -> None:
        """Replace prompt + outputs (resumed request); the output list keeps its identity."""
        self.pending = None  # the scheduler's copy is authoritative
        self.token_ids = list(token_ids)
        self.output_token_ids[:] = self.token_ids[self.num_prompt_tokens:]

    def set_scheduled_tokens(self, start: int, tokens: list[int]) -> None:
        """Make ``tokens`` the known tokens from position ``start`` on (the scheduler's copy,
        with pipeline parallelism); the output list keeps its identity.

        Raises:
            RuntimeError: ``start`` is past the known tokens (a token would be missing).
        """
        if start > len(self.token_ids):
            raise RuntimeError(f"request {self.req_id!r}: tokens from position {start} sent, "
                               f"but only {len(self.token_ids)} are known")
        self.token_ids[start:start + len(tokens)] = tokens
        # only the tail from `start` changed: update that part of the outputs (per step)
        out = max(start - self.num_prompt_tokens, 0)
        self.output_token_ids[out:] = self.token_ids[self.num_prompt_tokens + out:]

    def truncate_outputs(self, num_output: int) -> None:
        del self.token_ids[self.num_prompt_tokens + num_output:]
        del self.output_token_ids[num_output:]


@dataclass
class StepBatch:
    """One step laid out token-major (requests in ``num_scheduled_tokens`` order).

    Attributes:
        req_ids: ``B`` scheduled request ids.
        input_ids: ``[T]`` int32 token ids to feed.
        query_lens / seq_lens: ``[B]`` tokens fed / context length after this step.
        block_table: ``[B, max_blocks]`` int32, rows padded with 0.
        sample_req_idx: indices into ``req_ids`` of requests that sample a token this step
            (their fed tokens reach the end of what is known); the others are prefill chunks.
        pending_rows: rows of ``input_ids`` whose token is a request's ``pending`` token (a
            placeholder 0 in ``input_ids``), as ``(row, (tokens, index))``.
        num_draft_tokens: ``[B]`` speculative draft tokens fed after each request's known
            tokens (``scheduled_spec_decode_tokens``; all 0 without speculative decoding).
        draft_token_ids: the drafts of all requests, concatenated in request order.
    """

    req_ids: list[str]
    input_ids: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    sample_req_idx: list[int]
    pending_rows: list[tuple[int, tuple[object, int]]] = field(default_factory=list)
    num_draft_tokens: np.ndarray | None = None
    draft_token_ids: list[int] = field(default_factory=list)


class InputBatch:
    """Request states plus the step layout built from them."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        #: the KV cache group whose blocks the attention reads (0 unless hybrid; None for an
        #: attention-free model)
        self.attn_group: int | None = 0
        #: requests resumed after preemption (for logs and tests)
        self.num_resumed = 0

    def update(self, out: SchedulerOutput, new_state) -> None:
        """Apply one ``SchedulerOutput`` to the request states.

        Args:
            out: the scheduler's output for this step.
            new_state: callable ``NewRequestData -> RequestState`` (the runner decides sampling
                state such as PRNG keys).

        Raises:
            RuntimeError: the scheduler refers to a request the runner never saw.
        """
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = new_state(new)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                raise RuntimeError(f"scheduler step refers to unknown request {req_id!r}")
            state.num_computed_tokens = cached.num_computed_tokens[i]
            num_output = cached.num_output_tokens[i]
            resumed_tokens = cached.all_token_ids.get(req_id)
            if resumed_tokens is not None:
                # The scheduler's copy is authoritative for requests that were not scheduled in
                # the previous step (resumed after preemption, or skipped).
                state.set_tokens(resumed_tokens)
            elif num_output < state.num_output_tokens:
                # Tokens the scheduler did not accept (e.g. sampled past a stop) are dropped.
                state.truncate_outputs(num_output)
            if cached.new_token_ids:
                # Pipeline parallelism: the scheduler sends the tokens to feed (a stage before
                # the last samples nothing; on the last they are the ones it sampled).
                state.set_scheduled_tokens(state.num_computed_tokens, cached.new_token_ids[i])
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.num_resumed += 1
                if new_blocks is None:
                    raise RuntimeError(f"resumed request {req_id!r} came without block ids")
                state.block_ids, state.other_block_ids = split_groups(new_blocks,
                                                                      self.attn_group)
            elif new_blocks is not None:
                attn, others = split_groups(new_blocks, self.attn_group)
                state.block_ids.extend(attn)
                for g, ids in others.items():
                    state.other_block_ids.setdefault(g, []).extend(ids)

    def layout(self, out: SchedulerOutput) -> StepBatch:
        """Token-major layout of the step: which tokens to feed, where they go, what to sample.

        A request with speculative drafts (``scheduled_spec_decode_tokens``) is fed its last
        known token and then its drafts; it samples (verifies) on all of those rows.

        Raises:
            RuntimeError: the scheduler asks for tokens beyond what the request has (would mean
                a lost sampled token), or schedules drafts for a request whose known tokens
                the step does not reach.
        """
        req_ids = list(out.num_scheduled_tokens.keys())
        spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        drafts = [list(spec.get(r, ())) for r in req_ids]
        num_draft = np.fromiter((len(d) for d in drafts), dtype=np.int32, count=len(req_ids))
        states = [self.requests[r] for r in req_ids]
        query_lens = np.fromiter(
            (out.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=len(req_ids)
        )
        starts = np.fromiter(
            (s.num_computed_tokens for s in states), dtype=np.int32, count=len(states)
        )
        seq_lens = starts + query_lens
        pieces = []
        pending_rows = []
        row = 0
        known = [len(s.token_ids) + (s.pending is not None) for s in states]
        for state, start, end, n, draft in zip(states, starts.tolist(), seq_lens.tolist(),
                                               known, drafts, strict=True):
            end_known = end - len(draft)
            if end_known > n:
                raise RuntimeError(
                    f"request {state.req_id!r}: scheduled up to token {end} but only "
                    f"{n} tokens are known"
                    + (f" (and {len(draft)} draft tokens)" if draft else "")
                )
            if draft and end_known != n:
                raise RuntimeError(
                    f"request {state.req_id!r}: {len(draft)} draft tokens scheduled after "
                    f"token {end_known}, but {n} tokens are known"
                )
            piece = state.token_ids[start:end_known]
            if end_known > len(state.token_ids):  # the last known token is the pending one
                pending_rows.append((row + len(piece), state.pending))
                piece = [*piece, 0]
            pieces.append([*piece, *draft])
            row += end - start
        input_ids = np.fromiter(
            (t for p in pieces for t in p), dtype=np.int32, count=int(query_lens.sum())
        )
        max_blocks = max((len(s.block_ids) for s in states), default=0)
        block_table = np.zeros((len(states), max(max_blocks, 1)), dtype=np.int32)
        for i, state in enumerate(states):
            block_table[i, : len(state.block_ids)] = state.block_ids
        sample_req_idx = [
            i for i, (n, end, d) in enumerate(zip(known, seq_lens.tolist(), num_draft.tolist(),
                                                  strict=True)) if end - d == n
        ]
        return StepBatch(
            req_ids=req_ids,
            input_ids=input_ids,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=block_table,
            sample_req_idx=sample_req_idx,
            pending_rows=pending_rows,
            num_draft_tokens=num_draft,
            draft_token_ids=[t for d in drafts for t in d],
        )


def split_groups(
    block_ids: tuple[list[int], ...], attn_group: int | None
) -> tuple[list[int], dict[int, list[int]]]:
    """vLLM's per-group block ids -> (the attention group's, {other group: ids}); an
    attention-free model (``attn_group`` None) has no attention blocks."""
    return (list(block_ids[attn_group]) if attn_group is not None else [],
            {g: list(ids) for g, ids in enumerate(block_ids) if g != attn_group})
