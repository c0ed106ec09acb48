"""Pooling models (vLLM's ``--runner pooling``): the last layer's hidden states, after the
final norm, go through vLLM's own pooler on torch views, as vLLM's runners hand theirs over.

The pooler is the one vLLM's model adapter would build for the model
(``DispatchPooler.for_embedding``, under the engine's config: pooling type, normalisation,
Matryoshka ``dimensions``, a sentence-transformers ``Dense`` projector where the checkpoint has
one). What the runner serves is decided by the platform before the model loads
(:func:`vllm_unified.platform.pooling_policy`); this module runs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_unified.compat import (
    DispatchPooler,
    PoolingMetadata,
    PoolingStates,
    VllmConfig,
    set_current_vllm_config,
)

__all__ = ["SERVED_TASKS", "Pooling"]

#: pooling tasks the runner serves. ``token_embed`` is left out: vLLM's ALL pooling keeps
#: per-token slices of the step's hidden states across chunks, which here are views of MLX
#: buffers freed after the step.
SERVED_TASKS = ("embed",)


class Pooling:
    """vLLM's pooler for the served model, fed one step's hidden states at a time.

    Args:
        vllm_config: the engine's config (``model_config.pooler_config`` resolved by vLLM).
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        pooler_config = vllm_config.model_config.pooler_config
        with set_current_vllm_config(vllm_config):
            self.pooler = DispatchPooler.for_embedding(pooler_config)
        offered = self.pooler.get_supported_tasks()
        #: the tasks the worker reports to vLLM (``get_supported_tasks``)
        self.tasks: tuple[str, ...] = tuple(t for t in SERVED_TASKS if t in offered)

    def describe(self) -> str:
        return f"pooling runner, tasks {', '.join(self.tasks)}; vLLM's pooler {self.pooler}"

    def new_request(self, params: Any) -> PoolingStates:
        """Apply the pooler's updates to a new request's ``PoolingParams`` (as vLLM's GPU
        runner does) and return the request's pooling states.

        Raises:
            ValueError: the request's task is not served.
        """
        if params is None or params.task not in self.tasks:
            task = None if params is None else params.task
            raise ValueError(f"pooling task {task!r} is not served by vllm-unified "
                             f"(served: {', '.join(self.tasks)})")
        self.pooler.get_pooling_updates(params.task).apply(params)
        return PoolingStates()

    def pool(self, hidden: torch.Tensor, states: list[Any], query_lens: np.ndarray,
             seq_lens: np.ndarray) -> list[torch.Tensor | None]:
        """vLLM's pooler over one step.

        Args:
            hidden: ``[T, D]`` hidden states of the step's tokens, token-major in request
                order (a view of the evaluated MLX array on the CPU backend).
            states: the step's ``RequestState`` objects, in the same order.
            query_lens / seq_lens: ``[B]`` tokens fed this step / context length after it.

        Returns:
            One entry per request: its pooled output (a tensor that owns its memory) once its
            prompt's last token ran this step, else None (a prefill chunk before the last).
        """
        params = [s.pooling_params for s in states]
        prompt_lens = torch.tensor([s.num_prompt_tokens for s in states], dtype=torch.int64)
        token_ids = (_padded_prompts(states) if any(p.requires_token_ids for p in params)
                     else None)
        metadata = PoolingMetadata(
            prompt_lens=prompt_lens, prompt_token_ids=token_ids, prompt_token_ids_cpu=token_ids,
            pooling_params=params, pooling_states=[s.pooling_states for s in states])
        metadata.build_pooling_cursor(query_lens.astype(np.int64),
                                      torch.from_numpy(seq_lens.astype(np.int64)),
                                      device=hidden.device)
        with torch.inference_mode():
            raw = self.pooler(hidden_states=hidden, pooling_metadata=metadata)
        finished = metadata.get_pooling_cursor().get_finished_mask()
        if len(raw) != len(states):
            raise RuntimeError(f"vLLM's pooler returned {len(raw)} outputs for "
                               f"{len(states)} requests")
        return [_owned(out, hidden) if done else None
                for out, done in zip(raw, finished, strict=True)]


def _padded_prompts(states: list[Any]) -> torch.Tensor:
    """``[B, max prompt]`` int64 prompt token ids, rows padded with 0 (vLLM's layout)."""
    out = torch.zeros((len(states), max(s.num_prompt_tokens for s in states)),
                      dtype=torch.int64)
    for i, s in enumerate(states):
        out[i, :s.num_prompt_tokens] = torch.tensor(s.prompt_token_ids, dtype=torch.int64)
    return out


def _owned(out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``out``, or an explicit copy where it still shares the step's hidden-state buffer (an
    MLX buffer that is freed after the step)."""
    if out.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr():
        return out.clone()
    return out
