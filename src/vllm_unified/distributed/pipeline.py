"""Pipeline parallelism: which layers this worker holds, and the hidden states between stages.

vLLM splits the decoder layers over ``--pipeline-parallel-size`` stages with its own
``get_pp_indices`` (``VLLM_PP_LAYER_PARTITION`` overrides it) and moves each step's hidden
states from one stage to the next through its pipeline group (``get_pp_group()``: gloo over TCP
for CPU tensors), as ``IntermediateTensors``. Here a stage:

* keeps only its layers' weights (:func:`vllm_unified.models.pipeline_layers.prune_model`): the
  other decoder layers become parameterless identities in the model's own layer loop, the
  token embedding stays on the first stage (and on the last when the LM head is the tied
  embedding), the final norm and the LM head on the last;
* runs the mlx-lm model's own forward over all layer indices (masks and per-layer choices keep
  their meaning), with :class:`~vllm_unified.kv.layer_cache.MissingLayerCache` for the layers
  it does not hold;
* sends ``[T, D]`` hidden states (the residual stream before the final norm) to the next stage
  as a torch view of the MLX array, and adopts what it receives without a copy
  (:mod:`vllm_unified.bridge`).

Nothing here imports MLX at module import: the worker module imports this before
:func:`vllm_unified.backend.import_mlx` has interposed the fast BLAS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_unified import bridge, compat

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["HIDDEN", "PP_MODEL_TYPES", "PipelineStage", "init_stage_groups", "recv_hidden",
           "send_intermediate"]

#: mlx-lm architectures whose inner model takes ``input_embeddings`` unchanged (no scaling
#: after the embedding), so a later stage can feed the received hidden states.
PP_MODEL_TYPES = ("llama", "qwen2", "qwen3")

#: the tensor name of the hidden states in vLLM's ``IntermediateTensors``
HIDDEN = "hidden_states"


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage: decoder layers ``[start, end)`` of ``num_layers``.

    Attributes:
        rank: the stage's rank in vLLM's pipeline group (0 = first).
        size: ``--pipeline-parallel-size``.
    """

    rank: int
    size: int
    start: int
    end: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """No pipeline parallelism: one stage with every layer."""
        return cls(0, 1, 0, num_layers, num_layers)

    @classmethod
    def of_this_worker(cls, num_layers: int, size: int) -> PipelineStage:
        """This worker's stage from vLLM's pipeline group and layer split (call after the
        distributed environment is initialised when ``size > 1``)."""
        if size == 1:
            return cls.whole(num_layers)
        rank = compat.get_pp_group().rank_in_group
        start, end = compat.get_pp_indices(num_layers, rank, size)
        return cls(rank, size, start, end, num_layers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def describe(self) -> str:
        return (f"pipeline stage {self.rank + 1} of {self.size}: layers {self.start}-"
                f"{self.end - 1} of {self.num_layers}"
                f"{', token embedding' if self.is_first else ''}"
                f"{', final norm and LM head' if self.is_last else ''}")


def init_stage_groups(vllm_config: Any, rank: int, local_rank: int,
                      distributed_init_method: str) -> None:
    """Join vLLM's distributed environment (gloo: every tensor that crosses is a CPU tensor)
    and build its parallel groups: the pipeline group that carries the hidden states, the
    data-parallel and the (one-rank) tensor-parallel groups. vLLM's executor gives each worker
    its rank and the rendezvous address (``tcp://`` of ``--master-addr`` across nodes)."""
    pc = vllm_config.parallel_config
    compat.init_distributed_environment(
        world_size=pc.world_size, rank=rank, distributed_init_method=distributed_init_method,
        local_rank=local_rank, backend="gloo")
    compat.ensure_model_parallel_initialized(pc.tensor_parallel_size,
                                             pc.pipeline_parallel_size)


def send_intermediate(intermediate: Any) -> None:
    """Send a step's ``IntermediateTensors`` (:data:`HIDDEN`: ``[T, D]``, a torch view of the
    evaluated MLX array on the CPU backend) to the next stage through vLLM's pipeline group.
    Blocks until the transfer completes, so the MLX array behind it may be freed."""
    compat.get_pp_group().send_tensor_dict(intermediate.tensors)


def recv_hidden(zero_copy: bool) -> mx.array:
    """The previous stage's ``[T, D]`` hidden states of this step, as an MLX array over the
    received tensor's memory when ``zero_copy`` (the backend profile's ``logits_zero_copy``:
    MLX's CPU backend), else a copy.

    Raises:
        RuntimeError: the previous stage sent nothing or no hidden states.
    """
    received = compat.get_pp_group().recv_tensor_dict()
    if not received or HIDDEN not in received:
        raise RuntimeError(f"pipeline stage received {sorted(received or {})}, expected "
                           f"{HIDDEN!r}")
    return bridge.to_mlx(received[HIDDEN].contiguous(), copy=not zero_copy)
