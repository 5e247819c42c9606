"""The Mooncake Transfer Engine: this process's end of every KV transfer.

One ``TransferEngine`` per process that owns a KV pool, started in peer-to-peer mode (no
metadata server: a peer is named by ``host:rpc_port``, its "session id", and the engines
exchange their segment descriptors on first contact), over TCP by default or RDMA when a
device is named. The pool's layer tensors are registered once, at start; a prefill instance
then writes a request's KV straight from its blocks into the decode instance's registered
blocks in one batch (:meth:`MooncakeTransport.submit`), and polls it (:meth:`status`)
between engine steps, so no step waits on the network.

The batch runs as ``batch_transfer_sync_write`` on a worker thread (the binding releases the
GIL while it waits), not as ``batch_transfer_async_write``: with 0.3.13's TCP transport,
``transfer_check_status`` answered "completed" for half of the batches of a test (8 writes of
512 KiB, 200 rounds) while their bytes were still landing, up to 20 ms later, so a decode
instance told "done" computed on a partly written prompt (``get_batch_transfer_status``
frees the batch when it completes, and a second call aborts the process). The synchronous
call returns after the peer acknowledged every write: the same test saw no early answer.

Mooncake ships as ``mooncake-transfer-engine-non-cuda`` on PyPI; its shared library links
Debian's ``libibverbs1``, ``librdmacm1`` and ``libnuma1`` even for TCP
(``scripts/install_system_deps.sh`` installs them).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from moeserve.platform import UNPINNED_CPUS_ENV

logger = logging.getLogger(__name__)

_STALL_S = 5  # Mooncake's progress timeout at most
# writes per engine call: 0.3.13 answers -1 at once for 4096, and its TCP lanes reject
# writes when their queue is full ("TCP lane queue-full rejection") from a few thousand
# queued at once, so a batch with more (runs of fragmented blocks, times the layers) is sent
# in parts, one after the other
MAX_WRITES = 256
PENDING, DONE, FAILED = 0, 1, -1  # a batch's states (:meth:`MooncakeTransport.status`)
# batches run one at a time per peer, on a thread of that peer's own (a peer that stops
# answering holds only its own queue). With the engine's threads pinned to a rank's cores,
# beside its compute, about 1 batch in 50 stalled until Mooncake's timeout ("no status frame
# within 30s") on this 2-core host; the threads now run unpinned, and a batch that stalls
# anyway fails after a short progress timeout and is sent again

_SYSTEM_LIBS = "libibverbs1 librdmacm1 libnuma1"


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "prefill/decode disaggregation needs the Mooncake Transfer Engine: "
            "pip install mooncake-transfer-engine-non-cuda, and Debian's "
            f"{_SYSTEM_LIBS} (apt-get install {_SYSTEM_LIBS}; scripts/install_system_deps.sh "
            f"does it as root). The import failed with: {e}"
        ) from e
    return TransferEngine


def _cpus_before_pinning() -> set[int] | None:
    text = os.environ.get(UNPINNED_CPUS_ENV)
    if not text or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        return {int(c) for c in text.split(",")}
    except ValueError:
        return None


def _unpin_this_thread() -> None:
    cpus = _cpus_before_pinning()
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # a cpuset shrank since: keep the rank's
            pass


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """This thread on the CPUs the process had before it was pinned, for the duration."""
    if _cpus_before_pinning() is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _unpin_this_thread()
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class MooncakeTransport:
    """This process's transfer engine and its registered memory."""

    def __init__(self, host: str, ib_device: str | None = None, timeout_s: float = 30.0) -> None:
        """Start the engine on ``host`` (the address peers reach this process at): TCP, or
        RDMA on ``ib_device`` (e.g. ``mlx5_0``). A batch that makes no progress for
        ``min(5, timeout_s / 3)`` seconds (Mooncake's ``MC_TRANSFER_TIMEOUT``, unless set) is
        sent again until ``timeout_s`` has passed. Raises RuntimeError when it cannot
        start."""
        # Mooncake's timeout counts seconds without progress: a stalled batch fails after it
        # and is sent again (the same bytes to the same place) while the deadline allows
        self.stall_s = max(1, math.ceil(min(_STALL_S, timeout_s / 3)))
        self.timeout_s = timeout_s
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(self.stall_s))
        engine_cls = _import_engine()
        self.engine = engine_cls()
        self.protocol = "rdma" if ib_device else "tcp"
        # the engine's threads start here and inherit this thread's CPUs: not the rank's
        # pinned cores, where its compute threads starve them (batches stalled for seconds)
        with _unpinned():
            rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, ib_device or "")
        if rc != 0:
            raise RuntimeError(
                f"the Mooncake transfer engine did not start on {host} over {self.protocol} "
                f"(code {rc})"
            )
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._queues: dict[str, ThreadPoolExecutor] = {}  # peer session -> its thread

    def register(self, addrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Register memory the peers may write into or this process writes from (once)."""
        rc = self.engine.batch_register_memory(list(addrs), list(sizes))
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register {len(addrs)} KV buffers (code {rc})")
        self._registered.extend(addrs)

    def submit(
        self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int]
    ) -> Future:
        """Start writing ``lengths[i]`` bytes from local ``srcs[i]`` to ``dsts[i]`` in the
        peer's registered memory; returns the batch to poll with :meth:`status`."""
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = ThreadPoolExecutor(1, thread_name_prefix="mooncake")
        return queue.submit(self._write, peer, list(srcs), list(dsts), list(lengths))

    def _write(self, peer: str, srcs: list, dsts: list, lengths: list) -> int:
        _unpin_this_thread()
        deadline = time.monotonic() + self.timeout_s
        for i in range(0, len(srcs), MAX_WRITES):  # the engine refuses larger batches
            part = slice(i, i + MAX_WRITES)
            while True:
                rc = self.engine.batch_transfer_sync_write(
                    peer, srcs[part], dsts[part], lengths[part]
                )
                if rc == 0:
                    break
                if time.monotonic() + self.stall_s > deadline:
                    return rc
                logger.warning(
                    "a KV transfer batch to %s failed (code %d): sending it again", peer, rc
                )
        return 0

    def status(self, batch: Future) -> int:
        """PENDING, DONE (every byte acknowledged by the peer) or FAILED."""
        if not batch.done():
            return PENDING
        if batch.cancelled() or batch.exception() is not None:
            return FAILED
        return DONE if batch.result() == 0 else FAILED

    def close(self) -> None:
        for queue in self._queues.values():
            queue.shutdown(wait=False, cancel_futures=True)
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()
