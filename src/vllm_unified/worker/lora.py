"""The LoRA adapters a worker holds (vLLM's ``--enable-lora``): loaded, cached and grouped per
step.

vLLM keeps the adapter plumbing: the OpenAI server's ``--lora-modules``, ``/v1/models`` and
runtime ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, the ``LoRARequest`` on each
request, the scheduler's ``max_loras`` per step and the adapter id in prefix-cache block
hashes. This module is the worker side of its ``add_lora`` / ``remove_lora`` / ``pin_lora`` /
``list_loras``: adapters read with vLLM's own PEFT rules (:class:`PEFTHelper`: rank and alpha
patterns, rsLoRA; :class:`LoRAModel`: the checkpoint reader and its target check) or from
mlx-lm's adapter format (``adapters.safetensors`` with ``lora_parameters``), kept as MLX
arrays in an LRU cache of ``max_cpu_loras`` adapters, and put in one of ``max_loras`` slots
(:class:`LoRASlots`) when a step schedules it, the least recently used slot of an adapter the
step does not use giving way (vLLM's scheduler puts at most ``max_loras`` adapters in a step).
An adapter a scheduled request names is (re)loaded from its path if it is not held, as vLLM's
worker manager does.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_unified import compat
from vllm_unified.models.lora import TARGETS, AdapterWeights, LoRASlots, LoRAStep

__all__ = ["LoRAAdapters"]

logger = compat.init_logger(__name__)

#: mlx-lm's adapter files (``mlx_lm.lora`` writes them)
MLX_LM_CONFIG, MLX_LM_WEIGHTS = "adapter_config.json", "adapters.safetensors"


class LoRAAdapters:
    """The adapters of one model runner.

    Args:
        lora_config: vLLM's ``LoRAConfig`` (``max_lora_rank``, ``max_cpu_loras``).
        targets: the model's adaptable linears, module path -> ``(in, out)``
            (:func:`vllm_unified.models.lora.lora_targets`).
        dtype: the compute dtype adapters are held in.
        max_position_embeddings: the model's, for vLLM's PEFT config reader.
    """

    def __init__(self, lora_config: Any, targets: dict[str, tuple[int, int]], dtype: mx.Dtype,
                 max_position_embeddings: int | None) -> None:
        self.config = lora_config
        self.targets = targets
        self.dtype = dtype
        self.max_position_embeddings = max_position_embeddings
        self.capacity = int(lora_config.max_cpu_loras or lora_config.max_loras)
        self._held: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recent first
        self._pinned: set[int] = set()
        self.slots = LoRASlots(targets, int(lora_config.max_loras),
                               int(lora_config.max_lora_rank), dtype)
        #: each slot's adapter id (None: free) and the step count when it was last used
        self._slot_owner: list[int | None] = [None] * self.slots.num_slots
        self._slot_used = [0] * self.slots.num_slots
        self._steps = 0

    def describe(self) -> str:
        names = sorted({p.rsplit(".", 1)[-1] for p in self.targets})
        return (f"LoRA adapters on {len(self.targets)} linear layers ({', '.join(names)}); "
                f"{self.slots.num_slots} slots of rank {self.slots.max_rank} "
                f"({self.slots.nbytes / 2**20:.1f} MiB, "
                f"{str(self.dtype).rsplit('.', 1)[-1]}), {self.capacity} adapters held")

    def held_bytes_limit(self) -> int:
        """The most bytes the held adapters take: ``max_cpu_loras`` adapters of
        ``max_lora_rank`` on every target (the KV budget sets them aside; the slots are
        allocated at load, in the worker's resident memory already)."""
        per_rank = sum(i + o for i, o in self.targets.values()) * self.dtype.size
        return self.capacity * self.slots.max_rank * per_rank

    # ----------------------------------------------------------------- vLLM's worker calls
    def add(self, request: Any, reload: bool = False) -> bool:
        """Load ``request``'s adapter unless held (then mark it most recent).

        Args:
            reload: read it again even if held (``/v1/load_lora_adapter`` with
                ``load_inplace``: new weights under the same name).

        Returns:
            True when it was loaded now.

        Raises:
            LoRAAdapterNotFoundError: no adapter at its path (vLLM's server answers 404).
            ValueError: an adapter vLLM would refuse (rank above ``--max-lora-rank``, DoRA,
                bias, targets this model lacks, shapes that differ from the model's).
        """
        if request.lora_int_id in self._held and not reload:
            self._held.move_to_end(request.lora_int_id)
            return False
        adapter = self._load(request)
        self._held[request.lora_int_id] = adapter
        self._held.move_to_end(request.lora_int_id)
        self._free_slot(request.lora_int_id)  # a reload may bring new weights
        self._evict()
        logger.info("vllm-unified: LoRA adapter %r (id %d) loaded from %s: %d layers, rank %d, "
                    "%.1f MiB", adapter.name, adapter.lora_int_id, request.lora_path,
                    len(adapter.modules), adapter.rank, adapter.nbytes / 2**20)
        return True

    def remove(self, lora_id: int) -> bool:
        self._pinned.discard(lora_id)
        self._free_slot(lora_id)
        return self._held.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> bool:
        """Keep ``lora_id`` out of the LRU eviction (vLLM's ``pin_lora``).

        Raises:
            ValueError: the adapter is not held (vLLM's message).
        """
        if lora_id not in self._held:
            raise ValueError(f"LoRA {lora_id} is not registered")
        self._pinned.add(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self._held)

    # ------------------------------------------------------------------------------ steps
    def step(self, requests: list[Any], query_lens: np.ndarray) -> LoRAStep | None:
        """Each token row's slot for a step (requests in step order, ``query_lens[i]`` rows
        each, token-major), the step's adapters put in slots; None when no request has one.

        Raises:
            RuntimeError: more adapters in the step than slots (vLLM's scheduler keeps to
                ``max_loras``).
        """
        ids = [(r.lora_request.lora_int_id if r.lora_request is not None else 0)
               for r in requests]
        wanted = list(dict.fromkeys(i for i, n in zip(ids, query_lens.tolist(), strict=True)
                                    if i > 0 and n))
        if not wanted:
            return None
        if len(wanted) > self.slots.num_slots:
            raise RuntimeError(f"{len(wanted)} LoRA adapters in one step, {self.slots.num_slots}"
                               f" slots (--max-loras)")
        self._steps += 1
        by_id = {r.lora_request.lora_int_id: r.lora_request for r in requests
                 if r.lora_request is not None}
        slot_of = {i: self._slot(by_id[i], wanted) for i in wanted}
        row_slots = np.repeat([slot_of.get(i, -1) for i in ids], query_lens).astype(np.int32)
        targeted = set().union(*(self._held[i].modules for i in wanted))
        return LoRAStep(self.slots, row_slots, targeted,
                        {slot_of[i]: self._held[i].rank for i in wanted})

    def _slot(self, request: Any, step_ids: list[int]) -> int:
        """The slot of ``request``'s adapter, loading the adapter (if not held) and writing it
        into a free slot or the least recently used one no adapter of the step holds."""
        lora_id = request.lora_int_id
        self.add(request)  # reloaded if it was evicted or unloaded meanwhile
        if lora_id in self._slot_owner:
            slot = self._slot_owner.index(lora_id)
        else:
            free = [s for s, o in enumerate(self._slot_owner) if o not in step_ids]
            slot = min(free, key=lambda s: (self._slot_owner[s] is not None,
                                            self._slot_used[s]))
            self.slots.write(slot, self._held[lora_id])
            self._slot_owner[slot] = lora_id
        self._slot_used[slot] = self._steps
        return slot

    def _free_slot(self, lora_id: int) -> None:
        if lora_id in self._slot_owner:
            self._slot_owner[self._slot_owner.index(lora_id)] = None

    # ---------------------------------------------------------------------------- loading
    def _evict(self) -> None:
        """Drop least recently used unpinned adapters beyond ``max_cpu_loras``."""
        for lora_id in list(self._held):
            if len(self._held) <= self.capacity:
                return
            if lora_id not in self._pinned:
                del self._held[lora_id]

    def _load(self, request: Any) -> AdapterWeights:
        path = compat.get_adapter_absolute_path(request.lora_path)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise compat.LoRAAdapterNotFoundError(request.lora_name, request.lora_path)
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        if "lora_parameters" in config or "fine_tune_type" in config:
            modules = self._read_mlx_lm(path, config)
        else:
            modules = self._read_peft(path, request)
        for name, (a, b) in modules.items():
            self._check_shape(request, name, a.shape, b.shape)
        rank = max((a.shape[1] for a, _ in modules.values()), default=0)
        return AdapterWeights(request.lora_int_id, request.lora_name, modules, rank)

    def _read_peft(self, path: str, request: Any) -> dict[str, tuple[mx.array, mx.array]]:
        """A PEFT adapter through vLLM's reader: ``lora_a [r, in]``, ``lora_b [out, r]`` and
        the scaling of PEFT's rules (``alpha / r``, rsLoRA ``alpha / sqrt(r)``, per-module
        patterns) -> ``(A [in, r], B [r, out] x scaling)``."""
        import torch

        helper = compat.PEFTHelper.from_local_dir(path, self.max_position_embeddings)
        helper.validate_legal(self.config)
        model = compat.LoRAModel.from_local_checkpoint(
            path, set(TARGETS), peft_helper=helper, lora_model_id=request.lora_int_id,
            device="cpu", dtype=torch.float32)
        if model.modules_to_save:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: modules_to_save "
                             f"{sorted(model.modules_to_save)} are not supported by vllm-unified")
        modules = {}
        for name, layer in model.loras.items():
            a = layer.lora_a.numpy().T
            b = (layer.lora_b.numpy() * np.float32(layer.scaling)).T
            modules[name] = self._held_pair(a, b)
        return modules

    def _read_mlx_lm(self, path: str, config: dict) -> dict[str, tuple[mx.array, mx.array]]:
        """An mlx-lm adapter: ``<module>.lora_a [in, r]``, ``<module>.lora_b [r, out]``,
        update ``scale * (x @ lora_a) @ lora_b``."""
        kind = config.get("fine_tune_type", "lora")
        if kind != "lora":
            raise ValueError(f"mlx-lm adapter at {path}: fine_tune_type {kind!r} is not "
                             "supported (LoRA adapters only)")
        params = config.get("lora_parameters") or {}
        scale = float(params.get("scale", 20.0))  # mlx-lm's default
        rank = int(params.get("rank", 8))
        if rank > self.config.max_lora_rank:
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank "
                             f"{self.config.max_lora_rank}.")
        weights = mx.load(os.path.join(path, MLX_LM_WEIGHTS))
        modules = {}
        for key in sorted(weights):
            name, _, part = key.rpartition(".")
            if part == "lora_a":
                a, b = weights[key], weights.get(f"{name}.lora_b")
                if b is None:
                    raise ValueError(f"mlx-lm adapter at {path}: {name}.lora_b is missing")
                modules[name] = self._held_pair(np.asarray(a.astype(mx.float32)),
                                                np.asarray(b.astype(mx.float32)) * scale)
            elif part != "lora_b":
                raise ValueError(f"mlx-lm adapter at {path}: {key} is not a LoRA weight")
        return modules

    def _held_pair(self, a: np.ndarray, b: np.ndarray) -> tuple[mx.array, mx.array]:
        pair = (mx.array(np.ascontiguousarray(a)).astype(self.dtype),
                mx.array(np.ascontiguousarray(b)).astype(self.dtype))
        mx.eval(*pair)
        return pair

    def _check_shape(self, request: Any, name: str, a_shape: tuple, b_shape: tuple) -> None:
        """Raises ValueError naming the module when ``name`` is not an adaptable linear of
        this model or its shapes differ from the layer's."""
        dims = self.targets.get(name)
        if dims is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} targets {name}, which is not "
                             f"a linear layer of this model that vllm-unified adapts "
                             f"({', '.join(TARGETS)})")
        if (a_shape[0], b_shape[1]) != dims or a_shape[1] != b_shape[0]:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {name} has A {a_shape} and "
                             f"B {b_shape} (as [in, r], [r, out]); the layer is {dims[0]} -> "
                             f"{dims[1]}")
