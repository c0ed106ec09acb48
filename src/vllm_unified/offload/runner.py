"""What the MLX model runner and worker call for vLLM's KV connector (the OffloadingConnector).

The same lifecycle as vLLM's ``KVConnectorModelRunnerMixin`` (whose helpers are used as is):
register the KV views once, then per step submit deferred stores (``handle_preemptions``),
bind the step's connector metadata, start loads, queue stores, collect finished transfers
into ``ModelRunnerOutput.kv_connector_output``; steps without tokens still run the connector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from vllm_unified import compat
from vllm_unified.compat import init_logger
from vllm_unified.offload.worker import MLXOffloadingWorker

logger = init_logger(__name__)


def init_single_rank_groups(vllm_config: Any, distributed_init_method: str) -> None:
    """vLLM's connector set-up reads the tensor-parallel group (``ensure_kv_transfer_
    initialized`` broadcasts the engine id over it): create the one-rank groups (gloo) when a
    connector is configured. Nothing happens otherwise."""
    if vllm_config.kv_transfer_config is None:
        return
    compat.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=distributed_init_method, local_rank=0,
        backend="gloo",
    )
    compat.ensure_model_parallel_initialized(1, 1)


class KVConnectorHooks:
    """The runner's side of the KV connector; every call is a no-op without one."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.enabled = vllm_config.kv_transfer_config is not None

    def register(self, kv_cache_config: Any, views: dict[str, Any] | None,
                 kv_barrier: Callable[[], None]) -> None:
        """Create the worker-side connector and hand it vLLM's per-layer KV views.

        Args:
            views: layer name -> vLLM's torch view of the KV pool (None when MLX owns it).
            kv_barrier: evaluates MLX's pending writes to the pool.

        Raises:
            RuntimeError: the KV pool is not shared with torch, or the connector's worker is
                not the MLX offloading worker.
            ValueError: more than one KV cache group (hybrid models).
        """
        if not self.enabled:
            return
        if views is None:
            raise RuntimeError(
                "--kv-offloading-size: KV offloading needs the KV pool shared with torch "
                "(MLX's CPU backend with the native bridge, or Metal); this pool is MLX-owned"
            )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(f"--kv-offloading-size: {len(kv_cache_config.kv_cache_groups)} KV "
                             "cache groups (hybrid model): not supported by vllm-unified yet")
        compat.ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        connector = compat.get_kv_transfer_group()
        connector.register_kv_caches(views)
        worker = getattr(getattr(connector, "connector_worker", None), "worker", None)
        if not isinstance(worker, MLXOffloadingWorker):
            raise RuntimeError(f"KV connector worker {type(worker).__name__}: expected "
                               "MLXOffloadingWorker")
        worker.bind_kv_barrier(kv_barrier)

    def handle_preemptions(self, scheduler_output: Any) -> None:
        """Submit stores deferred from the last step (and flush those vLLM asks for) before
        this step's blocks change hands."""
        if self.enabled:
            compat.get_kv_transfer_group().handle_preemptions(
                scheduler_output.kv_connector_metadata)

    def step(self, scheduler_output: Any):
        """Context around the step's forward; yields the step's ``KVConnectorOutput`` (None
        without a connector), complete once the context exits."""
        if not self.enabled:
            return nullcontext(None)
        return self._step(scheduler_output)

    @contextmanager
    def _step(self, scheduler_output: Any) -> Iterator[Any]:
        with compat.set_forward_context(None, self.vllm_config), \
                compat.KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(
                    scheduler_output) as output:
            yield output

    def empty_step(self, scheduler_output: Any) -> Any:
        """Output of a step without tokens: transfers still progress."""
        if not self.enabled:
            return compat.EMPTY_MODEL_RUNNER_OUTPUT
        return compat.KVConnectorModelRunnerMixin.kv_connector_no_forward(
            scheduler_output, self.vllm_config)

    def handshake_metadata(self) -> None:
        """The OffloadingConnector exchanges no handshake metadata between workers.

        Raises:
            RuntimeError: the connector has some (it is not one this platform supports).
        """
        if self.enabled and compat.get_kv_transfer_group().get_handshake_metadata() is not None:
            raise RuntimeError("KV connector handshake metadata is not supported")
        return None

    def shutdown(self) -> None:
        """Drain and release the worker-side connector (and the host pool mapping)."""
        if self.enabled:
            compat.ensure_kv_transfer_shutdown()
