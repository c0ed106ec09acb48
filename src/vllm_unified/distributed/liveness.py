"""Peer liveness across nodes: a lost node fails the engine instead of hanging it.

vLLM's multiprocessing executor watches the worker processes of its own node (process
sentinels), but not those of another node: when a node is lost, the engine waits for the
reply of a worker that no longer exists, and the stages on this node wait for the engine's
next call, so nothing ever fails. Each worker of a multi-node engine therefore bumps a counter
in the rendezvous store (the ``TCPStore`` of ``--master-addr:--master-port`` that
torch.distributed already runs) every :data:`HEARTBEAT_S` seconds and watches everyone
else's; a peer whose counter has not moved for :data:`LOST_AFTER_S` seconds (or a store that
cannot be reached: node 0 lost) ends this worker and its engine (:func:`abandon_pipeline`):
the API server fails the requests and exits; a ``--headless`` node's process exits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

from vllm_unified.compat import init_logger

logger = init_logger(__name__)

__all__ = ["HEARTBEAT_S", "LOST_AFTER_S", "PeerWatch", "abandon_pipeline"]

#: seconds between two heartbeats of a worker
HEARTBEAT_S = 2.0
#: seconds without a peer's heartbeat after which it is lost (well above a busy step's stall
#: of the heartbeat thread; the engine then fails within about this plus vLLM's shutdown)
LOST_AFTER_S = 12.0

_KEY = "vllm_unified/heartbeat/{}"


class PeerWatch:
    """Heartbeats of ``rank`` and watching of the other ``world_size - 1`` ranks through the
    rendezvous store at ``host:port`` (vLLM's ``--master-addr`` / ``--master-port``: where
    torch.distributed's process group of a multi-node engine meets)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.host, self.port = host, port
        self.rank, self.world_size = rank, world_size
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-unified-peer-watch",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("vllm-unified: watching %d peer worker(s) through %s:%d (heartbeat every "
                    "%.0f s, lost after %.0f s)", self.world_size - 1, self.host, self.port,
                    HEARTBEAT_S, LOST_AFTER_S)

    def stop(self) -> None:
        """Stop watching (the engine is shutting down: peers going away is expected)."""
        self._stopped.set()

    def _run(self) -> None:
        from torch.distributed import TCPStore

        try:
            store = TCPStore(self.host, self.port, is_master=False,
                             timeout=timedelta(seconds=LOST_AFTER_S), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - reported, then fatal
            self._lost(f"the rendezvous store {self.host}:{self.port} cannot be reached ({e})")
            return
        peers = [r for r in range(self.world_size) if r != self.rank]
        last: dict[int, tuple[int, float]] = {}
        while not self._stopped.wait(HEARTBEAT_S):
            now = time.monotonic()
            try:
                store.add(_KEY.format(self.rank), 1)
                for r in peers:
                    count = store.add(_KEY.format(r), 0)
                    if r not in last or last[r][0] != count:
                        last[r] = (count, now)
                    elif now - last[r][1] > LOST_AFTER_S:
                        self._lost(f"worker rank {r} sent no heartbeat for "
                                   f"{now - last[r][1]:.0f} s")
                        return
            except Exception as e:  # noqa: BLE001 - reported, then fatal
                self._lost(f"the rendezvous store {self.host}:{self.port} failed ({e})")
                return

    def _lost(self, why: str) -> None:
        if self._stopped.is_set():
            return
        abandon_pipeline(f"pipeline peer lost: {why}")


def abandon_pipeline(why: str) -> None:
    """End this worker process and stop the process that launched it (the engine core on
    node 0, ``vllm serve --headless`` elsewhere) with SIGTERM, after logging ``why``.

    The worker's own death is what vLLM's executor watches for, but the engine's thread may
    be blocked waiting for the reply of a worker on a lost node (up to
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s by default), and vLLM's SIGTERM handler
    only flags a shutdown that thread never reaches: after :data:`_PARENT_GRACE_S` seconds
    the launcher is killed, which vLLM's API server watches for (it fails the requests with
    an error and exits).
    """
    parent = os.getppid()
    logger.error("vllm-unified: %s; ending this worker process and stopping its engine (pid "
                 "%d) so the requests fail instead of waiting", why, parent)
    os.kill(parent, signal.SIGTERM)
    deadline = time.monotonic() + _PARENT_GRACE_S
    while time.monotonic() < deadline and _alive(parent):
        time.sleep(0.1)
    if _alive(parent):  # vLLM's engine core only flags SIGTERM while its thread is blocked
        os.kill(parent, signal.SIGKILL)
    os._exit(1)


#: seconds the engine core gets to exit on SIGTERM before it is killed
_PARENT_GRACE_S = 3.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
